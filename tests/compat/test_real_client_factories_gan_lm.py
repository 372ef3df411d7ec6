"""Round seventeen of real Apex programs, one pattern per test (written here after the programs' own code, CPU-sized):

- an optimizer-factory module whose ``Adam``/``SGD`` forward every argument positionally to ``apex.optimizers``'
  ``FusedAdam``/``FusedSGD``, ``lr=torch.optim.optimizer.required`` included (Apex's ``FusedSGD`` default), with a
  ``DecayingCosineAnnealingWarmRestarts`` beside them;
- a GPT-2 adapter trainer: O2 with ``master_weights=False`` for an Adafactor that steps fp16 weights itself,
  ``cast_model_outputs=torch.float32`` on a model returning a tuple, chunks of a batch each in its own
  ``scale_loss`` before one step;
- hukkelas/DeepPrivacy's ``LossOptimizer``: a generator and a discriminator with their ``FusedAdam`` (betas as a
  list under lazy regularization) in one O1 ``initialize`` with ``num_losses`` = number of criteria, one ``loss_id``
  per criterion, a lazily applied gradient penalty through ``torch.autograd.grad(create_graph=True)``, and a resume
  that calls ``initialize`` a second time on the same models with new optimizers;
- transformers' question-answering scripts (``run_squad.py``), which call
  ``apex.amp.register_half_function(torch, "einsum")`` before ``initialize`` so that XLNet's attention einsums run in
  half at O1;
- onnxruntime-training's ``ApexAMPModifier``: a ``zero_grad`` over the stash's lists and a replaced
  ``_post_amp_backward`` written against Apex's ``_process_optimizer``, which amp calls as Apex did.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.optim.optimizer import required

from ampkit.compat import install_apex_shim, uninstall_apex_shim


@pytest.fixture
def shim():
    install_apex_shim()
    yield
    uninstall_apex_shim()


def _factory_sgd(params, lr=required, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                 wd_after_momentum=False, materialize_master_grads=True):  # fmt: skip
    """The factory's ``SGD``: Apex's positional order, its ``required`` default passed on."""
    from apex.optimizers import FusedSGD

    return FusedSGD(params, lr, momentum, dampening, weight_decay, nesterov, wd_after_momentum,
                    materialize_master_grads)  # fmt: skip


def _factory_adam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                  weight_decay=0.0, amsgrad=False, set_grad_none=True):  # fmt: skip
    from apex.optimizers import FusedAdam

    return FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad, set_grad_none)


def _bn_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    # no bias before the batch norm: its gradient would be rounding noise, which Adam turns into full-size steps
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8, bias=False), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
    )


def _groups(model: torch.nn.Module) -> list[dict]:
    rest = list(model[1].parameters()) + list(model[3].parameters())
    return [{"params": model[0].parameters(), "lr": 0.05}, {"params": rest, "lr": 0.1, "weight_decay": 1e-4}]


@pytest.mark.parametrize("make", ["sgd", "adam"])
def test_an_optimizer_factory_forwarding_apex_defaults_positionally_trains_at_o2_as_at_o0(shim, make):
    """The factory's ``SGD`` called without ``lr`` hands ``FusedSGD`` Apex's ``required``, with every param group
    naming its own ``lr``: Apex took it, ampkit refused it as an lr that is no number. At O2 (fp32 masters,
    ``materialize_master_grads=False``) the run tracks the float32 one."""
    from apex import amp

    def build(opt_level):
        model = _bn_mlp()
        if make == "sgd":
            optimizer = _factory_sgd(_groups(model), momentum=0.9, nesterov=True, materialize_master_grads=False)
        else:
            optimizer = _factory_adam(_groups(model), 1e-2, True, [0.9, 0.99])
        return amp.initialize(model, optimizer, opt_level=opt_level, loss_scale=128.0, verbosity=0)

    finals = {}
    for opt_level in ("O0", "O2"):
        model, optimizer = build(opt_level)
        assert [g["lr"] for g in optimizer.param_groups] == [0.05, 0.1]
        for i in range(5):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
            optimizer.zero_grad()
            with amp.scale_loss(F.mse_loss(model(x).float(), y), optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
        finals[opt_level] = [p.detach().float().clone() for p in amp.master_params(optimizer)]
    for ours, full in zip(finals["O2"], finals["O0"], strict=True):
        torch.testing.assert_close(ours, full, rtol=0, atol=2e-3)


def test_fused_sgd_with_apexs_required_lr_refuses_a_group_without_one(shim):
    from apex.optimizers import FusedSGD

    model = _bn_mlp()
    with pytest.raises(ValueError, match="didn't specify a value of required optimization parameter lr"):
        FusedSGD(model.parameters(), required, 0.9)
    optimizer = FusedSGD([{"params": model[0].parameters(), "lr": 0.1}], required)
    with pytest.raises(ValueError, match="required optimization parameter lr"):
        optimizer.add_param_group({"params": model[3].parameters()})
    with pytest.raises(ValueError, match=r"Invalid lr: -1"):
        FusedSGD(model.parameters(), -1)


class _AdapterLM(torch.nn.Module):
    """A GPT-2-shaped LM returning ``(logits, past, hidden)``; ``past`` is None unless asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(12, 8, padding_idx=0)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 12)

    def forward(self, tokens, return_past=True):
        hidden = self.norm(self.embedding(tokens))
        return self.head(hidden), (hidden if return_past else None), hidden


class _HalfSafeAdafactorLike(torch.optim.Optimizer):
    """fairseq's Adafactor in outline: the update computed in float32 and copied back into an fp16 weight."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.copy_(p.float() - group["lr"] * p.grad.float())


def test_an_o2_run_without_master_weights_casts_tuple_outputs_and_steps_the_half_weights(shim):
    """``initialize(..., opt_level, master_weights=False, cast_model_outputs=torch.float32)``: at O2 the optimizer
    holds the fp16 weights themselves (no masters), the tuple's float tensors come back float32 and its None stays
    None; each chunk of a batch has its own ``scale_loss`` and the step follows them. The losses track O0's."""
    from apex import amp

    tokens = torch.randint(1, 12, (4, 6), generator=torch.Generator().manual_seed(0))
    losses = {}
    for opt_level in ("O0", "O2"):
        torch.manual_seed(0)
        model = _AdapterLM()
        optimizer = _HalfSafeAdafactorLike(model.parameters(), lr=0.5)
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, master_weights=False,
                                          cast_model_outputs=torch.float32, loss_scale=None, verbosity=0)  # fmt: skip
        assert {p.dtype for p in model.parameters()} == {torch.float32 if opt_level == "O0" else torch.float16}
        assert list(amp.master_params(optimizer)) == list(model.parameters())  # no masters
        losses[opt_level] = []
        for _ in range(4):
            optimizer.zero_grad()
            chunks = tokens.split(2)
            total = 0.0
            for chunk in chunks:
                logits, past, hidden = model(chunk[:, :-1], return_past=False)
                assert logits.dtype == hidden.dtype == torch.float32 and past is None
                loss = F.cross_entropy(logits.reshape(-1, 12), chunk[:, 1:].reshape(-1), ignore_index=0) / len(chunks)
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
                total += loss.item()
            optimizer.step()
            losses[opt_level].append(total)
    assert losses["O2"][-1] < losses["O2"][0]
    torch.testing.assert_close(losses["O2"], losses["O0"], rtol=0, atol=5e-3)
    with pytest.raises(RuntimeError, match="master_weights"):  # Apex's error: O1 keeps the weights float32
        amp.initialize(_AdapterLM(), opt_level="O1", master_weights=False, verbosity=0)


class _InpaintGenerator(torch.nn.Module):
    """DeepPrivacy's generators fill the masked region; ``forward_train`` returns a list of outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 6))

    def forward_train(self, img, mask, **kwargs):
        fake = self.net(torch.cat([img * mask, mask], dim=1))
        return [img * mask + fake * (1 - mask)]


class _PoseDiscriminator(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 1))

    def forward(self, img, mask, with_pose=False, **kwargs):
        return [self.net(torch.cat([img, mask], dim=1))]

    def forward_fake(self, img, mask, fake_img, with_pose=False, **kwargs):
        return self.forward(fake_img, mask)


class _LossOptimizer:
    """DeepPrivacy's ``LossOptimizer`` in outline: WGAN losses, a gradient penalty applied every second iteration
    (lazy regularization, its lr and betas adjusted by ``c``), an epsilon penalty, and an L1 loss for the generator;
    each criterion has its own ``loss_id``."""

    def __init__(self, generator, discriminator, lr=1e-3, lazy_interval=2):
        self.generator, self.discriminator, self.lazy_interval, self.it = generator, discriminator, lazy_interval, 0
        from apex.optimizers import FusedAdam

        c = lazy_interval / (lazy_interval + 1)
        self.d_optimizer = FusedAdam(discriminator.parameters(), lr=lr * c, betas=[b**c for b in (0.0, 0.99)])
        self.g_optimizer = FusedAdam(generator.parameters(), lr=lr, betas=(0.0, 0.99))
        self.criterions_d = [self._wgan_d, self._gradient_penalty, self._epsilon_penalty]
        self.criterions_g = [self._wgan_g, self._l1]

    def initialize_amp(self):
        from apex import amp

        [self.generator, self.discriminator], [self.g_optimizer, self.d_optimizer] = amp.initialize(
            [self.generator, self.discriminator], [self.g_optimizer, self.d_optimizer], opt_level="O1",
            num_losses=len(self.criterions_d) + len(self.criterions_g), max_loss_scale=2.0**17,
        )  # fmt: skip
        return self.generator, self.discriminator

    def state_dict(self):
        return {"d_optimizer": self.d_optimizer.state_dict(), "g_optimizer": self.g_optimizer.state_dict()}

    def load_state_dict(self, state):
        self.d_optimizer.load_state_dict(state["d_optimizer"])
        self.g_optimizer.load_state_dict(state["g_optimizer"])

    def _wgan_d(self, batch):
        return (batch["fake_scores"][0] - batch["real_scores"][0]).view(-1)

    def _gradient_penalty(self, batch):
        self.it += 1
        if self.it % self.lazy_interval != 0:
            return None
        real, fake = batch["img"], batch["fake_data"][0].detach()
        epsilon = torch.rand(real.shape[0], 1)
        x_hat = (epsilon * real + (1 - epsilon) * fake).requires_grad_(True)
        logit = self.discriminator.forward_fake(**batch, fake_img=x_hat)[0]
        grad = torch.autograd.grad(logit, x_hat, torch.ones_like(logit), create_graph=True, only_inputs=True)[0]
        return (grad.view(grad.shape[0], -1).norm(p=2, dim=1) - 1).pow(2) * 10 * self.lazy_interval

    def _epsilon_penalty(self, batch):
        return batch["real_scores"][0].pow(2).view(-1) * 1e-3

    def _wgan_g(self, batch):
        return -batch["fake_scores"][0].view(-1)

    def _l1(self, batch):
        return (batch["img"] - batch["fake_data"][0]).abs().sum(dim=1) * (1 - batch["mask"][:, 0])

    def _backward(self, batch, loss_funcs, model, optimizer, id_offset):
        from apex import amp

        for param in model.parameters():
            param.grad = None
        for i, loss_fn in enumerate(loss_funcs):
            loss = loss_fn(batch)
            if loss is None:
                continue
            with amp.scale_loss(loss.mean(), optimizer, loss_id=id_offset + i) as scaled_loss:
                scaled_loss.backward(retain_graph=len(loss_funcs) - 1 != i)
        optimizer.step()

    def step(self, batch):
        with torch.no_grad():
            fake_data = self.generator.forward_train(**batch)
        real_scores = self.discriminator(**batch, with_pose=True)
        fake_scores = self.discriminator.forward_fake(**batch, with_pose=True, fake_img=fake_data[0])
        d_batch = {**batch, "fake_data": fake_data, "real_scores": real_scores, "fake_scores": fake_scores}
        self._backward(d_batch, self.criterions_d, self.discriminator, self.d_optimizer, 0)
        for p in self.discriminator.parameters():
            p.requires_grad = False
        fake_data = self.generator.forward_train(**batch)
        g_batch = {**batch, "fake_data": fake_data, "fake_scores": self.discriminator.forward_fake(**batch,
                   fake_img=fake_data[0])}  # fmt: skip
        self._backward(g_batch, self.criterions_g, self.generator, self.g_optimizer, len(self.criterions_d))
        for p in self.discriminator.parameters():
            p.requires_grad = True


class _DeepPrivacyTrainer:
    """DeepPrivacy's ``Trainer``: models, then ``init_optimizer`` (which initializes amp), then the checkpoint, whose
    loading builds the optimizers and initializes amp once more on the same models."""

    def __init__(self, checkpoint=None):
        torch.manual_seed(0)
        self.generator, self.discriminator = _InpaintGenerator(), _PoseDiscriminator()
        self.init_optimizer()
        self.global_step = 0
        if checkpoint is not None:
            self.global_step = checkpoint["global_step"]
            self.discriminator.load_state_dict(checkpoint["D"])
            self.generator.load_state_dict(checkpoint["G"])
            self.init_optimizer()
            self.loss_optimizer.load_state_dict(checkpoint["optimizer"])

    def init_optimizer(self):
        self.loss_optimizer = _LossOptimizer(self.generator, self.discriminator)
        self.loss_optimizer.it = getattr(self, "global_step", 0)
        self.generator, self.discriminator = self.loss_optimizer.initialize_amp()

    def state_dict(self):
        return {"D": self.discriminator.state_dict(), "G": self.generator.state_dict(),
                "optimizer": self.loss_optimizer.state_dict(), "global_step": self.global_step}  # fmt: skip

    def train(self, steps):
        for _ in range(steps):
            g = torch.Generator().manual_seed(self.global_step)
            img = torch.rand(8, 6, generator=g) * 2 - 1
            mask = (torch.rand(8, 1, generator=g) > 0.5).float().expand(8, 6).contiguous()
            torch.manual_seed(1000 + self.global_step)  # the penalty's epsilon
            self.loss_optimizer.step({"img": img, "mask": mask})
            self.global_step += 1


def test_deepprivacy_gan_with_a_loss_id_per_criterion_resumes_after_a_second_initialize(shim, capsys):
    """Five criteria, five loss scalers; the gradient penalty's ``loss_id`` is skipped every other iteration. Its
    losses are the half means of the discriminator's half scores, as under Apex (``mean`` is on none of its O1 lists),
    so each one's first backward at ``2**16`` overflows in the cast of its gradient and halves that scale alone. The
    resume initializes amp a second time on the models the first ``initialize`` returned, with new ``FusedAdam``s,
    as DeepPrivacy's trainer does (Apex took it at O1). DeepPrivacy keeps no amp state, so every scale restarts at
    ``2**16`` and overflows once more, as under Apex; with the scales restored the resumed run is bit-identical."""
    import copy

    from apex import amp

    reference = _DeepPrivacyTrainer()
    reference.train(6)
    trainer = _DeepPrivacyTrainer()
    trainer.train(3)
    scales = [s.loss_scale() for s in amp._amp_state.loss_scalers]
    assert scales[0] == scales[3] == 2.0**15 and scales[4] == 2.0**16  # the half losses backed off, the L1 did not
    assert "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0" in capsys.readouterr().out
    checkpoint = copy.deepcopy(trainer.state_dict())
    saved_scales = amp.state_dict()

    resumed = _DeepPrivacyTrainer(checkpoint)
    assert [s.loss_scale() for s in amp._amp_state.loss_scalers] == [2.0**16] * 5
    amp.load_state_dict(saved_scales)
    resumed.train(3)
    for model in ("generator", "discriminator"):
        ours, theirs = getattr(resumed, model).state_dict(), getattr(reference, model).state_dict()
        for key in theirs:
            torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0)
    assert all(p.requires_grad for p in resumed.discriminator.parameters())


class _RelativeAttention(torch.nn.Module):
    """XLNet's attention score in outline: einsums of projected heads, with float32 bias parameters added first."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.r_w_bias = torch.nn.Parameter(torch.randn(2, 4) * 0.1)
        self.out = torch.nn.Linear(8, 2)

    def forward(self, h):  # h: (len, batch, 8)
        q_head = self.q(h).view(h.shape[0], h.shape[1], 2, 4)
        k_head = self.k(h).view(h.shape[0], h.shape[1], 2, 4)
        scores = torch.einsum("ibnd,jbnd->bnij", q_head + self.r_w_bias, k_head)
        probs = F.softmax(scores * 0.5, dim=-1)
        context = torch.einsum("bnij,jbnd->ibnd", probs, k_head)
        return self.out(context.reshape(h.shape[0], h.shape[1], 8)), scores


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_run_squads_einsum_registered_half_before_initialize_runs_xlnets_attention_in_half(
    shim, opt_level, monkeypatch
):
    """transformers' ``run_squad.py --fp16`` calls ``apex.amp.register_half_function(torch, "einsum")`` before
    ``initialize``: at O1 the attention einsums then take the half query plus the float32 ``r_w_bias`` and run in
    half (unregistered, torch's einsum refuses the mix); at O2 the model is half already. Training follows O0."""
    import apex
    from apex import amp

    monkeypatch.setattr("ampkit.compat.amp.functions._registry", {})  # the registration stays in this test
    apex.amp.register_half_function(torch, "einsum")
    h = torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(0))
    target = torch.randn(5, 3, 2, generator=torch.Generator().manual_seed(1))
    losses = {}
    for level in ("O0", opt_level):
        torch.manual_seed(0)
        model = _RelativeAttention()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = amp.initialize(model, optimizer, opt_level=level, loss_scale=128.0, verbosity=0)
        losses[level] = []
        for _ in range(4):
            optimizer.zero_grad()
            out, scores = model(h)
            assert scores.dtype == (torch.float16 if level == "O1" else torch.float32)  # O2 casts outputs back
            loss = F.mse_loss(out.float(), target)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            losses[level].append(loss.item())
    assert model.r_w_bias.dtype == (torch.float32 if opt_level == "O1" else torch.float16)
    assert losses[opt_level][-1] < losses[opt_level][0]
    torch.testing.assert_close(losses[opt_level], losses["O0"], rtol=0, atol=2e-3)


def _ort_apex_amp_modifier(optimizer, calls: list[str]) -> None:
    """onnxruntime-training's ``ApexAMPModifier`` (what its ``FP16_Optimizer(optimizer)`` applies to an amp optimizer
    once ``import amp_C`` works and the optimizer has ``_post_amp_backward`` and ``zero_grad``): a faster copy of
    Apex's O2 ``_post_amp_backward`` (its fused kernel unscales the fp16 gradients into new fp32 master gradients,
    flagging inf/nan in ``scaler._overflow_buf``; here the scaler's own ``unscale`` stands in for it) that hands the
    fp32 parameters to Apex's ``_process_optimizer.post_backward_models_are_masters``, and a ``zero_grad`` over the
    stash's lists that sets the gradients to None."""
    import types

    import amp_C  # noqa: F401  (its requirement check)

    assert callable(optimizer._post_amp_backward) and callable(optimizer.zero_grad)

    def post_backward_with_master_weights(self, scaler):
        from apex import amp as apex_amp

        calls.append("post")
        stash = self._amp_stash
        self._amp_lazy_init()
        model_grads, master_grads = [], []
        for param, master in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params, strict=True):
            if param.grad is not None:
                master.grad = torch.empty_like(master)
                model_grads.append(param.grad)
                master_grads.append(master.grad)
        scaler.unscale(model_grads, master_grads, scaler._loss_scale)
        apex_amp._process_optimizer.post_backward_models_are_masters(
            scaler, stash.all_fp32_from_fp32_params, stash.all_fp32_from_fp32_grad_stash
        )

    def zero_grad(self, set_to_none=True):
        stash = self._amp_stash
        self._amp_lazy_init()
        for param in stash.all_fp16_params + stash.all_fp32_from_fp32_params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.detach_()
                param.grad.zero_()
        for param in stash.all_fp32_from_fp16_params:
            param.grad = None

    optimizer._post_amp_backward = types.MethodType(post_backward_with_master_weights, optimizer)
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)


def test_onnxruntimes_apex_amp_modifier_unscales_through_its_replaced_post_backward_at_o2(shim):
    """``amp.scale_loss`` calls ``optimizer._post_amp_backward`` through the attribute, as Apex did: onnxruntime's
    replacement unscales every backward (fp16 gradients into the masters, the batch norm's fp32 ones through
    ``apex.amp._process_optimizer``), the run follows O0, and the inf it flags skips that step and halves the scale.
    Its ``zero_grad`` (gradients to None, the model's and the masters') is the optimizer's from then on."""
    from apex import amp

    finals = {}
    for opt_level in ("O0", "O2"):
        model = _bn_mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, loss_scale="dynamic", verbosity=0)
        calls: list[str] = []
        if opt_level == "O2":
            _ort_apex_amp_modifier(optimizer, calls)
        for i in range(5):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
            optimizer.zero_grad()
            assert all(p.grad is None for p in model.parameters()) or opt_level == "O0"
            with amp.scale_loss(F.mse_loss(model(x).float(), y), optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
        finals[opt_level] = [p.detach().float().clone() for p in amp.master_params(optimizer)]
        assert calls == (["post"] * 5 if opt_level == "O2" else [])
        if opt_level == "O2":  # an inf in a batch norm (fp32) gradient, flagged by Apex's helper: a skipped step
            before = [p.detach().clone() for p in amp.master_params(optimizer)]
            scale = amp._amp_state.loss_scalers[0].loss_scale()
            optimizer.zero_grad()
            with amp.scale_loss(F.mse_loss(model(x).float(), y), optimizer) as scaled_loss:
                scaled_loss.backward()
                model[1].weight.grad[0] = float("inf")
            optimizer.step()
            assert amp._amp_state.loss_scalers[0].loss_scale() == scale / 2
            for after, was in zip(amp.master_params(optimizer), before, strict=True):
                assert torch.equal(after, was)
    for ours, full in zip(finals["O2"], finals["O0"], strict=True):
        torch.testing.assert_close(ours, full, rtol=0, atol=2e-3)
