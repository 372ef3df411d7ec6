"""Round eighteen of real Apex programs, one pattern per test (written here after the programs' own code, CPU-sized):

- hpcaitech/ColossalAI's Apex mode (``colossalai/amp/apex_amp``): ``convert_to_apex_amp`` passes the config's whole
  ``fp16`` dict, every documented key spelt out with its default (``None`` for most), to ``amp.initialize``; its
  ``ApexAMPOptimizer`` wrapper scales the loss into the inner optimizer and clips ``amp.master_params`` with its
  own float32-only norm; ``GradAccumOptimizer`` accumulates by dividing each loss, with no ``delay_unscale``;
- a detectron2 fork's ``ApexTrainer`` (soldierofhell/detectron2, ``detectron2/engine/apex_trainer.py``): detectron2's
  optimizer (one param group per parameter, its class swapped for a gradient-clipping subclass) through
  ``amp.initialize``, a ``WarmupMultiStepLR`` built on the amp optimizer, ``{model, optimizer, scheduler}``
  checkpoints with no amp state;
- NVIDIA DeepLearningExamples' Transformer-XL (``PyTorch/LanguageModeling/Transformer-XL/pytorch/train.py``,
  ``--fp16 --amp apex``): ``register_half_function(torch, 'einsum')`` before anything is built, a memory carried
  between segments, the model's gradients set to None, ``--batch_chunk`` chunks each in their own ``scale_loss``, the
  loss cast back with ``type_as``, a hand warmup then ``CosineAnnealingLR.step(epoch)``, ``amp_state`` on restart;
- modelscope's ``ApexAMPOptimizerHook`` (``modelscope/trainers/hooks/optimizer/apex_optimizer_hook.py``): the model
  initialized out of its ``DataParallel`` and put back bare, losses divided in place, accumulation without
  ``delay_unscale``, the model's parameters clipped.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from ampkit.compat import install_apex_shim, uninstall_apex_shim


@pytest.fixture
def shim():
    install_apex_shim()
    yield
    uninstall_apex_shim()


# ColossalAI's documented Apex config: every key of ``amp.initialize`` with its default value written out.
_COLOSSAL_APEX_FP16 = dict(
    mode="apex", enabled=True, opt_level="O1", cast_model_type=None, patch_torch_functions=None,
    keep_batchnorm_fp32=None, master_weights=None, loss_scale=None, cast_model_outputs=None, num_losses=1,
    verbosity=0, min_loss_scale=None, max_loss_scale=16777216.0,
)  # fmt: skip


class _Config(dict):
    """ColossalAI's ``Config``: a dict whose keys read as attributes."""

    __getattr__ = dict.__getitem__


def _clip_grad_norm_fp32(parameters, max_norm: float) -> float:
    """ColossalAI's clipping outline: float32 gradients only (it asserts), the norm as a Python float."""
    params = [p for p in parameters if p.grad is not None]
    assert all(p.grad.dtype == torch.float32 for p in params), "expected gradient to be dtype torch.float"
    total_norm = sum(float(torch.norm(p.grad.detach(), 2.0)) ** 2 for p in params) ** 0.5
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for p in params:
            p.grad.detach().mul_(clip_coeff)
    return total_norm


class _OptimizerWrapper:
    """ColossalAI's ``OptimizerWrapper``: holds ``optim`` and forwards the optimizer's API to it."""

    def __init__(self, optim):
        self.optim = optim

    @property
    def param_groups(self):
        return self.optim.param_groups

    def step(self, *args, **kwargs):
        return self.optim.step(*args, **kwargs)

    def zero_grad(self, *args, **kwargs):
        self.optim.zero_grad(*args, **kwargs)

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, *args, **kwargs):
        self.optim.load_state_dict(*args, **kwargs)


class _ApexAMPOptimizer(_OptimizerWrapper):
    def backward(self, loss):
        import apex.amp as apex_amp

        with apex_amp.scale_loss(loss, self.optim) as scaled_loss:
            scaled_loss.backward()

    def clip_grad_norm(self, model, max_norm):
        import apex.amp as apex_amp

        if max_norm > 0:
            return _clip_grad_norm_fp32(apex_amp.master_params(self.optim), max_norm)


def _convert_to_apex_amp(model, optimizer, amp_config):
    import apex.amp as apex_amp

    model, optimizer = apex_amp.initialize(model, optimizer, **amp_config)
    return model, _ApexAMPOptimizer(optimizer)


class _GradAccumOptimizer(_OptimizerWrapper):
    """ColossalAI's ``GradAccumOptimizer``: zeroes only after a step, steps (and clips) every ``accumulate_size``
    backwards, each loss divided by ``accumulate_size``."""

    def __init__(self, optim, accumulate_size):
        super().__init__(optim)
        self.accumulate_size, self.accumulate_step = accumulate_size, 0

    def zero_grad(self, *args, **kwargs):
        if self.accumulate_step == 0:
            self.optim.zero_grad(*args, **kwargs)

    def step(self, *args, **kwargs):
        if self.accumulate_step < self.accumulate_size:
            return None
        self.accumulate_step = 0
        return self.optim.step(*args, **kwargs)

    def clip_grad_norm(self, model, max_norm):
        if self.accumulate_step >= self.accumulate_size:
            return self.optim.clip_grad_norm(model, max_norm)

    def backward(self, loss):
        self.accumulate_step += 1
        self.optim.backward(loss / self.accumulate_size)


def _colossal_run(opt_level: str, iterations: int = 8):
    """ColossalAI's engine loop: ``zero_grad``, forward, criterion, ``backward``, then ``step`` (which clips)."""
    import apex.amp as apex_amp

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    fp16 = _Config(_COLOSSAL_APEX_FP16, opt_level=opt_level)
    mode = fp16.pop("mode")  # colossalai.initialize pops the mode and hands the rest on
    assert mode == "apex"
    model, optimizer = _convert_to_apex_amp(model, optimizer, fp16)
    optimizer = _GradAccumOptimizer(optimizer, accumulate_size=2)
    losses, norms = [], []
    for i in range(iterations):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x).float(), y)
        optimizer.backward(loss)
        norm = optimizer.clip_grad_norm(model, 0.3)
        optimizer.step()
        losses.append(loss.item())
        if norm is not None:
            norms.append(norm)
    masters = [p.detach().float().clone() for p in apex_amp.master_params(optimizer.optim.optim)]
    return losses, norms, masters, apex_amp._amp_state.loss_scalers[0].loss_scale()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_colossalai_apex_mode_with_every_key_spelt_out_accumulates_and_clips_as_float32(shim, opt_level):
    """Every key of ColossalAI's documented config reaches ``initialize`` (``None`` meaning the level's default); two
    micro-batches per step, each unscaled at its ``scale_loss`` exit, then the float32 masters clipped to 0.3. The
    run tracks O0's: the same clip norms (the clip bites every step), losses and weights."""
    runs = {level: _colossal_run(level) for level in ("O0", opt_level)}
    (losses, norms, masters, scale), (losses0, norms0, masters0, scale0) = runs[opt_level], runs["O0"]
    assert scale0 == 1.0 and scale == 2.0**16  # None keeps each level's own loss scale
    assert len(norms) == len(norms0) == 4 and all(n > 0.3 and math.isfinite(n) for n in norms0)
    torch.testing.assert_close(norms, norms0, rtol=1e-2, atol=0)
    torch.testing.assert_close(losses, losses0, rtol=0, atol=5e-3)
    for ours, full in zip(masters, masters0, strict=True):
        torch.testing.assert_close(ours, full, rtol=0, atol=5e-3)


class _TwoLossDetector(torch.nn.Module):
    """A detectron2 meta-architecture in outline: a backbone with a frozen-statistics norm, two heads, and a loss
    dict returned in training."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GroupNorm(4, 16), torch.nn.ReLU())
        self.cls_head, self.box_head = torch.nn.Linear(16, 3), torch.nn.Linear(16, 4)

    def forward(self, batched_inputs):
        x, labels, boxes = batched_inputs
        features = self.backbone(x)
        return {
            "loss_cls": F.cross_entropy(self.cls_head(features).float(), labels),
            "loss_box_reg": F.smooth_l1_loss(self.box_head(features).float(), boxes),
        }


def _d2_build_optimizer(model: torch.nn.Module, base_lr: float = 0.05) -> torch.optim.Optimizer:
    """detectron2's 2020 ``build_optimizer``: one param group per parameter (biases at twice the lr, no weight
    decay on norms), then ``maybe_add_gradient_clipping``, which swaps the instance's class for a subclass whose
    ``step`` clips each parameter by value before calling the parent's."""
    groups = []
    for module in model.modules():
        for name, value in module.named_parameters(recurse=False):
            lr, weight_decay = base_lr, 1e-4
            if isinstance(module, torch.nn.GroupNorm):
                weight_decay = 0.0
            if name == "bias":
                lr = base_lr * 2
            groups.append({"params": [value], "lr": lr, "weight_decay": weight_decay})
    optimizer = torch.optim.SGD(groups, base_lr, momentum=0.9)

    def clipped_step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                torch.nn.utils.clip_grad_value_(p, 0.05)
        super(type(self), self).step(closure)

    optimizer_type = type(optimizer)
    optimizer.__class__ = type(optimizer_type.__name__ + "WithGradientClip", (optimizer_type,), {"step": clipped_step})
    return optimizer


class _WarmupMultiStepLR(torch.optim.lr_scheduler.LRScheduler):
    """detectron2's ``WarmupMultiStepLR``: linear warmup, then a decay at each milestone."""

    def __init__(self, optimizer, milestones, gamma=0.1, warmup_iters=3, warmup_factor=0.1, last_epoch=-1):
        self.milestones, self.gamma = milestones, gamma
        self.warmup_iters, self.warmup_factor = warmup_iters, warmup_factor
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        warmup = 1.0
        if self.last_epoch < self.warmup_iters:
            alpha = self.last_epoch / self.warmup_iters
            warmup = self.warmup_factor * (1 - alpha) + alpha
        decay = self.gamma ** sum(m <= self.last_epoch for m in self.milestones)
        return [base_lr * warmup * decay for base_lr in self.base_lrs]


class _ApexTrainer:
    """A detectron2 fork's ``ApexTrainer``: model, optimizer, ``amp.initialize`` (O1), then the scheduler on the
    amp optimizer, a checkpointer of ``{model, optimizer, scheduler}`` (no amp state), and ``run_step``."""

    def __init__(self, opt_level: str):
        from apex import amp

        torch.manual_seed(0)
        model = _TwoLossDetector()
        optimizer = _d2_build_optimizer(model)
        self.model, self.optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
        self.scheduler = _WarmupMultiStepLR(self.optimizer, milestones=[6])
        self.iter = 0

    def run_step(self) -> dict:
        from apex import amp

        g = torch.Generator().manual_seed(self.iter)
        data = (
            torch.randn(16, 6, generator=g),
            torch.randint(0, 3, (16,), generator=g),
            torch.randn(16, 4, generator=g),
        )
        loss_dict = self.model(data)
        losses = sum(loss for loss in loss_dict.values())
        if not torch.isfinite(losses).all():  # _detect_anomaly
            raise FloatingPointError(f"Loss became infinite or NaN at iteration={self.iter}!")
        self.optimizer.zero_grad()
        with amp.scale_loss(losses, self.optimizer) as scaled_loss:
            scaled_loss.backward()
        self.optimizer.step()
        self.scheduler.step()  # the LRScheduler hook, after every iteration
        self.iter += 1
        return {k: v.item() for k, v in loss_dict.items()}

    def checkpoint(self) -> dict:
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "iteration": self.iter,
        }

    def resume(self, checkpoint: dict) -> None:
        self.model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        self.iter = checkpoint["iteration"]


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_detectron2_apex_trainer_with_a_class_swapped_clipping_optimizer_trains_and_resumes(shim, opt_level):
    """The fork's ``ApexTrainer`` over detectron2's optimizer: per-parameter groups and the class swapped for
    ``SGDWithGradientClip`` before ``initialize``. The clipping step clips what the optimizer steps (the fp32 masters
    at O2) and the scheduler built on the amp optimizer counts the steps. The losses track O0's; a trainer built
    again and resumed from the checkpoint goes on bit for bit."""
    reference = _ApexTrainer("O0")
    losses0 = [reference.run_step() for _ in range(8)]

    trainer = _ApexTrainer(opt_level)
    assert type(trainer.optimizer).__name__ == "SGDWithGradientClip"
    losses = [trainer.run_step() for _ in range(4)]
    checkpoint = trainer.checkpoint()
    losses += [trainer.run_step() for _ in range(4)]
    assert trainer.scheduler.get_last_lr()[0] == pytest.approx(0.005)  # past the milestone at iteration 6
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [g["lr"] for g in reference.optimizer.param_groups]
    for ours, full in zip(losses, losses0, strict=True):
        for key in full:
            assert ours[key] == pytest.approx(full[key], abs=5e-3), key

    resumed = _ApexTrainer(opt_level)
    resumed.resume(checkpoint)
    assert [resumed.run_step() for _ in range(4)] == losses[4:]
    for a, b in zip(resumed.model.state_dict().values(), trainer.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _MemLM(torch.nn.Module):
    """Transformer-XL's ``MemTransformerLM`` in outline: einsum attention over the segment and a detached memory of
    the previous one, a per-token loss returned with the new memory."""

    def __init__(self, n_token: int = 20, d_model: int = 8, mem_len: int = 4) -> None:
        super().__init__()
        self.mem_len = mem_len
        self.word_emb = torch.nn.Embedding(n_token, d_model)
        self.qkv = torch.nn.Linear(d_model, 3 * d_model, bias=False)
        self.r_w_bias = torch.nn.Parameter(torch.zeros(d_model))
        self.norm = torch.nn.LayerNorm(d_model)
        self.out = torch.nn.Linear(d_model, n_token)

    def forward(self, data, target, mems):
        hidden = self.word_emb(data)  # [len, batch, d]
        cat = hidden if mems is None else torch.cat([mems.to(hidden.dtype), hidden], 0)
        q, k, v = self.qkv(cat).chunk(3, dim=-1)
        q = q[-hidden.size(0) :] + self.r_w_bias  # r_w_bias stays float32 under O1: einsum needs the half cast
        score = torch.einsum("ibd,jbd->ijb", q, k) / 8**0.5
        attn = torch.einsum("ijb,jbd->ibd", score.softmax(1), v)
        out = self.norm(hidden + attn)
        loss = F.cross_entropy(self.out(out).flatten(0, 1).float(), target.flatten(), reduction="none")
        new_mems = cat[-self.mem_len :].detach()
        return loss.view_as(target).type_as(self.out(out)), new_mems


def _txl_train(opt_level: str, steps: int, restart: dict | None = None, batch_chunk: int = 2):
    """DLE Transformer-XL's ``train.py --fp16 --amp apex``: ``register_half_function(torch, 'einsum')`` first,
    ``initialize``, the model's gradients set to None, chunks each in their own ``scale_loss`` (``delay_unscale``
    only under DDP), the loss cast back with ``type_as``, clipping through ``amp.master_params``, a hand warmup of
    ``param_groups[0]['lr']`` then ``CosineAnnealingLR.step(step - warmup)``, and ``amp_state`` in the checkpoint."""
    from apex import amp

    torch.manual_seed(0)
    model = _MemLM()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 10, eta_min=0.001)
    train_step, warmup_step = 0, 2
    if restart is not None:
        model.load_state_dict(restart["model_state"])
        optimizer.load_state_dict(restart["optimizer_state"])
        scheduler.load_state_dict(restart["scheduler_state"])
        amp.load_state_dict(restart["amp_state"])
        train_step = restart["train_step"]
    losses, steps_per_epoch = [], 3
    while train_step < steps:
        if train_step % steps_per_epoch == 0:
            mems = [None] * batch_chunk  # train() starts each epoch without memory; so does a restart
        g = torch.Generator().manual_seed(train_step)
        data = torch.randint(0, 20, (5, 4), generator=g)
        target = torch.randint(0, 20, (5, 4), generator=g)
        for param in model.parameters():
            param.grad = None
        train_loss = 0.0
        for i, (data_i, target_i) in enumerate(
            zip(torch.chunk(data, batch_chunk, 1), torch.chunk(target, batch_chunk, 1), strict=True)
        ):
            loss, mems[i] = model(data_i.contiguous(), target_i.contiguous(), mems[i])
            loss = loss.float().mean().type_as(loss) / batch_chunk
            with amp.scale_loss(loss, optimizer, delay_unscale=False) as scaled_loss:
                scaled_loss.backward()
            train_loss += loss.float().item()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 0.25)
        optimizer.step()
        train_step += 1
        if train_step < warmup_step:
            optimizer.param_groups[0]["lr"] = 0.01 * train_step / warmup_step
        else:
            with pytest.warns(UserWarning, match="epoch parameter"):  # torch deprecates step(epoch); TXL passes it
                scheduler.step(train_step - warmup_step)
        losses.append(train_loss)
    checkpoint = {
        "model_state": copy.deepcopy(model.state_dict()),
        "optimizer_state": copy.deepcopy(optimizer.state_dict()),
        "scheduler_state": scheduler.state_dict(),
        "amp_state": amp.state_dict(),
        "train_step": train_step,
    }
    return losses, checkpoint, [p.detach().float().clone() for p in amp.master_params(optimizer)]


def test_dle_transformer_xl_chunks_type_as_losses_and_restarts_with_amp_state(shim):
    """At O1 the per-token loss is half, and the script casts its mean back to half (``type_as``): the scaled
    gradient, 2**16, passes through that cast and overflows, so the first step is skipped and the scale halves, as
    under Apex. At O2 the model's outputs come back float32 (Apex's output cast), so nothing overflows. Both then
    track O0. Restarted at an epoch's end from the checkpoint, amp state included, O1 goes on bit for bit."""
    from apex import amp

    amp.register_half_function(torch, "einsum")  # train.py's __main__, before main() builds anything
    losses0, _, masters0 = _txl_train("O0", 6)
    for opt_level, scale, atol in (("O2", 2.0**16, 1e-3), ("O1", 2.0**15, 5e-2)):
        losses, _, masters = _txl_train(opt_level, 6)
        assert amp._amp_state.loss_scalers[0].loss_scale() == scale, opt_level
        torch.testing.assert_close(losses, losses0, rtol=0, atol=atol)
        if opt_level == "O2":  # O1's weights are one Adam step (lr 0.01) behind where the skip left them
            for ours, full in zip(masters, masters0, strict=True):
                torch.testing.assert_close(ours, full, rtol=0, atol=atol)
        first, checkpoint, _ = _txl_train(opt_level, 3)
        rest, _, resumed = _txl_train(opt_level, 6, restart=checkpoint)
        # O2 rebuilds its masters from the saved half weights, as Apex did: close, not equal
        exact = 0 if opt_level == "O1" else 1e-3
        torch.testing.assert_close(first + rest, losses, rtol=0, atol=exact)
        for ours, full in zip(resumed, masters, strict=True):
            torch.testing.assert_close(ours, full, rtol=0, atol=exact)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_sparse_embedding_in_the_amp_optimizer_trains_as_at_o0(shim, opt_level):
    """Transformer-XL's ``--sample_softmax`` gives its word embedding sparse gradients; it keeps them in a second
    optimizer outside amp, but a script that hands the whole model to one SGD passes them to ``scale_loss``. Their
    unscale raised NotImplementedError from torch's op (no sparse kernel); now they are unscaled through their values
    as torch's ``GradScaler`` does, accumulated over two chunks, and training follows O0."""
    from apex import amp

    finals = {}
    for level in ("O0", opt_level):
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(12, 4, sparse=True), "head": torch.nn.Linear(4, 1)})
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = amp.initialize(model, optimizer, opt_level=level, loss_scale=1024.0, verbosity=0)
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            ids, y = torch.randint(0, 12, (2, 8), generator=g), torch.randn(2, 8, generator=g)
            optimizer.zero_grad()
            for chunk in range(2):
                loss = F.mse_loss(model["head"](model["emb"](ids[chunk])).squeeze(-1).float(), y[chunk]) / 2
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
            optimizer.step()
        finals[level] = [p.detach().float().clone() for p in amp.master_params(optimizer)]
    for ours, full in zip(finals[opt_level], finals["O0"], strict=True):
        torch.testing.assert_close(ours, full, rtol=0, atol=2e-3)


class _ModelScopeHookTrainer:
    """modelscope's ``EpochBasedTrainer`` in outline, driven by its ``ApexAMPOptimizerHook``: ``before_run``
    initializes the model inside a ``DataParallel`` (``trainer.model.module``) and puts the bare amp model back;
    ``after_train_iter`` divides each loss key in place by ``cumulative_iters``, scales each into the optimizer and
    every ``cumulative_iters`` iterations clips the model's parameters and steps."""

    def __init__(self, opt_level: str, cumulative_iters: int = 2, max_norm: float = 0.3):
        from apex import amp

        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        self.model = torch.nn.DataParallel(net)  # no GPU: DataParallel only holds the module
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.02)
        self.cumulative_iters, self.max_norm, self.iter = cumulative_iters, max_norm, 0
        if hasattr(self.model, "module"):
            self.model, self.optimizer = amp.initialize(self.model.module, self.optimizer, opt_level=opt_level)
        else:
            self.model, self.optimizer = amp.initialize(self.model, self.optimizer, opt_level=opt_level)
        self.optimizer.zero_grad()
        self.norms: list[float] = []

    def train_iter(self) -> float:
        from apex import amp

        g = torch.Generator().manual_seed(self.iter)
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        train_outputs = {"loss": F.cross_entropy(self.model(x).float(), y)}
        value = train_outputs["loss"].item()
        for k in ["loss"]:
            train_outputs[k] /= self.cumulative_iters  # in place on the loss tensor
        for k in ["loss"]:
            with amp.scale_loss(train_outputs[k], self.optimizer) as scaled_loss:
                scaled_loss.backward()
        self.iter += 1
        if self.iter % self.cumulative_iters == 0:
            params = [p for p in self.model.parameters() if p.requires_grad and p.grad is not None]
            self.norms.append(float(torch.nn.utils.clip_grad_norm_(params, self.max_norm)))
            self.optimizer.step()
            self.optimizer.zero_grad()
        return value


def test_modelscope_apex_hook_unwraps_data_parallel_and_accumulates_at_o1_as_at_o0(shim):
    """modelscope's ``ApexAMPOptimizerHook`` at its default O1: the DataParallel wrapper is dropped for the amp
    model, the losses divided in place, two iterations accumulated without ``delay_unscale``, and the model's
    parameters (the fp32 weights O1 keeps, so their gradients are unscaled) clipped: the clip norms and losses follow
    O0's, and the clip bites every step."""
    runs = {}
    for opt_level in ("O0", "O1"):
        trainer = _ModelScopeHookTrainer(opt_level)
        assert not isinstance(trainer.model, torch.nn.DataParallel)
        losses = [trainer.train_iter() for _ in range(8)]
        runs[opt_level] = losses, trainer.norms
    (losses, norms), (losses0, norms0) = runs["O1"], runs["O0"]
    assert len(norms0) == 4 and min(norms0) > 0.3
    torch.testing.assert_close(norms, norms0, rtol=1e-2, atol=0)
    torch.testing.assert_close(losses, losses0, rtol=0, atol=5e-3)


def test_modelscope_apex_hook_at_o2_clips_the_scaled_model_gradients_not_the_masters_and_round_trips_amp(shim):
    """modelscope's hook at O2: its clip runs over the model's fp16 parameters, whose gradients stay scaled after the
    ``scale_loss`` exit (only the fp32 masters are unscaled), so under Apex it never reached the step: the run follows
    an O0 run without clipping, as it did there. ``amp.state_dict()`` carries the loss scale into a fresh run."""
    from apex import amp

    runs = {}
    for opt_level, max_norm in (("O0", float("inf")), ("O2", 0.3)):
        trainer = _ModelScopeHookTrainer(opt_level, max_norm=max_norm)
        runs[opt_level] = [trainer.train_iter() for _ in range(8)], trainer
    (losses, trainer), (losses0, _) = runs["O2"], runs["O0"]
    torch.testing.assert_close(losses, losses0, rtol=0, atol=5e-3)
    assert all(p.dtype == torch.float16 for p in trainer.model.parameters())
    assert all(m.dtype == torch.float32 for m in amp.master_params(trainer.optimizer))
    state = amp.state_dict()
    assert state == {"loss_scaler0": {"loss_scale": 2.0**16, "unskipped": 8}}  # one update per backward
    _ModelScopeHookTrainer("O2")
    amp.load_state_dict(state)
    assert amp.state_dict() == state


def test_colossalai_apex_mode_at_o3_has_no_masters_so_its_float32_only_clip_refuses_as_under_apex(shim):
    """ColossalAI's Apex mode at O3 (its config's ``None`` keys keep O3's own values): no masters, so
    ``amp.master_params`` are the fp16 model's parameters and ColossalAI's own clip, which takes float32 gradients
    only, stops at its assert as it did under Apex; the static scale of 1 round-trips through ``amp.state_dict()``."""
    import apex.amp as apex_amp

    with pytest.raises(AssertionError, match="expected gradient to be dtype torch.float"):
        _colossal_run("O3")
    state = apex_amp.state_dict()
    assert state == {"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}}  # scale_loss short-circuits at 1, as Apex
    apex_amp.load_state_dict(state)
    assert apex_amp.state_dict() == state
