"""Round twenty of real Apex programs, one pattern per test (written here after the programs' own code, CPU-sized):

- a speech runner (``core/runner/base_runner.py``) whose model backpropagates part of its loss inside its forward,
  at the scale it reads from amp, and that replaces ``optimizer._prepare_amp_backward`` by a no-op so that amp
  stashes none of those gradients: they are unscaled (and checked for inf) with the loss's own; and its ``BMUF``,
  which writes a block-momentum update into the masters and pushes them into the model through
  ``optimizer._master_params_to_model_params()`` where the optimizer has it (Apex's O2);
- a script that wraps ``optimizer._post_amp_backward`` to see each backward's unscaled gradients (and one that records
  the scale there for its own step, as Apex's ``FusedSGD`` with ``materialize_master_grads=False`` did);
- code that calls an O2 optimizer's ``zero_grad`` before the first backward, then reads the masters in
  ``param_groups``: Apex's O2 ``zero_grad`` ran the lazy init, which built the masters from the model;
- a model-parallel trainer that patches ``apex.amp.scaler.LossScaler.update_scale`` to agree the overflow across ranks;
- DeepSpeed's engine with an ``"amp"`` config section: ``amp.initialize(module, optimizer, **amp_params)`` at O2,
  ``delay_unscale`` off the accumulation boundary, ``amp.master_params`` clipped at the boundary, and Megatron's
  ``apex.transformer`` import guarded by ``except ImportError``.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F

from ampkit.compat import install_apex_shim, uninstall_apex_shim


@pytest.fixture
def shim():
    install_apex_shim()
    yield
    uninstall_apex_shim()


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batch(i: int) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(i))


def _joint_and_rest(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The runner's two parts of the loss: the 'jointer' one its forward backpropagates, and the rest."""
    return out[:, 0].pow(2).mean(), (out[:, 1] - 1).abs().mean()


def test_a_runner_backpropagating_inside_its_forward_has_those_gradients_unscaled_through_a_no_op_prepare(shim):
    """With ``_prepare_amp_backward`` replaced by a no-op, ``scale_loss`` calls it (as Apex did) and stashes nothing,
    so gradients that the forward backpropagated at amp's scale are unscaled with the loss's: the run's gradients are
    the float32 reference's, and an inf among the forward's gradients skips the step and halves the scale. amp's own
    prepare counted them as already unscaled (65536 times too large) and never checked them."""
    from apex import amp

    model, accum = _mlp(), 2
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O0", loss_scale="dynamic", verbosity=0)
    optimizer._prepare_amp_backward = types.MethodType(lambda opt: "", optimizer)  # the runner's before_train
    scaler = amp._amp_state.loss_scalers[0]
    for step in range(3):
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        for i in range(accum):
            x = _batch(step * accum + i)
            joint, rest = _joint_and_rest(model(x))
            blow_up = 1e38 if step == 2 and i == 0 else 1.0  # the forward's part overflows once
            (joint * blow_up * scaler.loss_scale() / accum).backward(retain_graph=True)  # inside the forward
            with amp.scale_loss(rest / accum, optimizer, delay_unscale=i + 1 < accum) as scaled_loss:
                scaled_loss.backward()
            ref_joint, ref_rest = _joint_and_rest(reference(x))
            ((ref_joint + ref_rest) / accum).backward()
        if step < 2:
            for ours, ref in zip(model.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(ours.grad, ref.grad)
            optimizer.step()
            ref_optimizer.step()
        else:
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.step()
            assert scaler.loss_scale() == 2.0**15
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_a_wrapped_post_amp_backward_runs_once_per_unscaling_backward_and_sees_unscaled_master_gradients(shim):
    """``scale_loss`` calls ``optimizer._post_amp_backward(loss_scaler)`` through the attribute, as Apex did: a
    script's wrapper (here one that records each backward's master-gradient norm) runs after amp's own unscale,
    once per backward that unscales (not for ``delay_unscale`` ones), and amp's overflow verdict still skips."""
    from apex import amp

    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale=1024.0, verbosity=0)
    norms: list[float] = []
    amps_own = optimizer._post_amp_backward

    def post_amp_backward(self, loss_scaler):
        amps_own(loss_scaler)
        norms.append(float(torch.cat([p.grad.flatten() for p in amp.master_params(self)]).norm()))

    optimizer._post_amp_backward = types.MethodType(post_amp_backward, optimizer)
    reference = _mlp()
    for delayed in (True, False):
        loss = F.mse_loss(model(_batch(0).half()).float(), torch.zeros(8, 2))
        with amp.scale_loss(loss, optimizer, delay_unscale=delayed) as scaled_loss:
            scaled_loss.backward()
    F.mse_loss(reference(_batch(0)), torch.zeros(8, 2)).mul(2).backward()
    expected = float(torch.cat([p.grad.flatten() for p in reference.parameters()]).norm())
    assert len(norms) == 1 and norms[0] == pytest.approx(expected, rel=2e-2)


def test_an_o2_zero_grad_before_the_first_backward_builds_the_masters_from_the_model_as_apex_did(shim):
    """Apex's O2 ``zero_grad`` ran ``_amp_lazy_init``: weights loaded into the model after ``initialize`` are in the
    masters that ``param_groups`` holds right after it (not only after the first backward), and a script's wrapper of
    ``_lazy_init_maybe_master_weights`` runs there, once."""
    from apex import amp

    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    calls: list[str] = []
    amps_own = optimizer._lazy_init_maybe_master_weights

    def lazy_init_maybe_master_weights(self):
        calls.append("lazy init")
        amps_own()

    optimizer._lazy_init_maybe_master_weights = types.MethodType(lazy_init_maybe_master_weights, optimizer)
    pretrained = _mlp(seed=1)
    model.load_state_dict(pretrained.state_dict())  # cast into the fp16 model
    optimizer.zero_grad()
    optimizer.zero_grad()
    masters = [p for group in optimizer.param_groups for p in group["params"]]
    for master, weight in zip(masters, pretrained.parameters(), strict=True):
        assert master.dtype == torch.float32
        torch.testing.assert_close(master, weight.half().float(), rtol=0, atol=0)
    assert calls == ["lazy init"] and optimizer._amp_stash.lazy_init_called


def test_a_replaced_amp_lazy_init_runs_where_apex_called_it_and_a_checkpoint_loaded_after_zero_grad_is_trained(shim):
    """A script's wrapper of ``optimizer._amp_lazy_init`` runs where Apex called it through the attribute: at an O2
    ``zero_grad`` and before and after each backward's unscale (it was never called: amp called its own). A model
    checkpoint loaded after a ``zero_grad`` that follows an optimizer checkpoint without masters is still what the
    masters take over at the backward, as with amp's own lazy init."""
    from apex import amp

    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    calls: list[str] = []
    amps_own = optimizer._amp_lazy_init

    def amp_lazy_init(self):
        calls.append("lazy init")
        amps_own()

    optimizer._amp_lazy_init = types.MethodType(amp_lazy_init, optimizer)
    optimizer.zero_grad()
    assert calls == ["lazy init"]
    plain = {key: value for key, value in optimizer.state_dict().items() if key in ("state", "param_groups")}
    optimizer.load_state_dict(plain)  # torch's checkpoint: no masters, so they come from the model again
    optimizer.zero_grad()
    pretrained = _mlp(seed=1)
    model.load_state_dict(pretrained.state_dict())  # loaded after that zero_grad
    loss = F.mse_loss(model(_batch(0).half()).float(), torch.zeros(8, 2))
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()  # lr 0: the masters stay the weights they took over, and are pushed into the model
    assert calls == ["lazy init"] * 4  # two zero_grads, then before and after the backward's unscale
    for master, weight in zip(amp.master_params(optimizer), pretrained.parameters(), strict=True):
        torch.testing.assert_close(master, weight.half().float(), rtol=0, atol=0)


def test_deepspeeds_amp_section_trains_at_o2_with_accumulation_and_megatrons_guarded_import_falls_back(shim):
    """DeepSpeed's engine with ``"amp": {"enabled": true, "opt_level": "O2", ...}``: the section less ``enabled`` goes
    to ``amp.initialize`` as keywords, it logs ``amp.__path__``, micro-batches off the accumulation boundary backward
    with ``delay_unscale=True``, and at the boundary ``amp.master_params`` are clipped and the optimizer steps: the
    run follows float32's, less the first step, skipped (its accumulation overflowed fp16 at 2**16, as under Apex).
    Its Megatron path guards ``from apex.transformer import ...`` with ``except ImportError``, which the shim's
    refusal (naming what to use) is."""
    from apex import amp

    try:
        from apex.transformer import parallel_state  # noqa: F401
    except ImportError as error:
        assert "torch.distributed.tensor.parallel" in str(error)
    else:
        raise AssertionError("apex.transformer was served")
    config = {"enabled": True, "opt_level": "O2", "loss_scale": "dynamic", "min_loss_scale": 1.0}
    amp_params = {key: value for key, value in config.items() if key != "enabled"}
    finals = {}
    for half in (False, True):
        module = _mlp()
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
        if half:
            assert amp.__path__
            module, optimizer = amp.initialize(module, optimizer, verbosity=0, **amp_params)
        accum = 2
        for micro_step in range(6):
            x = _batch(micro_step)
            loss = F.mse_loss(module(x.half() if half else x).float(), torch.ones(8, 2)) / accum
            boundary = (micro_step + 1) % accum == 0
            if half:
                with amp.scale_loss(loss, optimizer, delay_unscale=not boundary) as scaled_loss:
                    scaled_loss.backward()
            else:
                loss.backward()
            if boundary:
                params = amp.master_params(optimizer) if half else module.parameters()
                torch.nn.utils.clip_grad_norm_(params, max_norm=0.5)
                if half or micro_step > 1:  # 2**16 overflows the first accumulation in fp16: amp skips that step
                    optimizer.step()
                optimizer.zero_grad()
        finals[half] = [p.detach().float() for p in (amp.master_params(optimizer) if half else module.parameters())]
    assert amp._amp_state.loss_scalers[0].loss_scale() == 2.0**15
    for ours, full in zip(finals[True], finals[False], strict=True):
        torch.testing.assert_close(ours, full, rtol=0, atol=5e-3)


def test_a_post_amp_backward_that_unscales_by_itself_keeps_the_gradients_stashed_before_the_backward(shim):
    """A replacement written against Apex's internals (onnxruntime-training's, through
    ``apex.amp._process_optimizer.post_backward_models_are_masters``) unscales only the new gradients; the float32
    gradients amp stashed before the backward are added back after it, so two backwards accumulate as in float32."""
    from apex import amp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale=256.0, verbosity=0)

    def post_amp_backward(self, scaler):  # unscales by itself, as a copy of Apex's O2 one does
        stash = self._amp_stash
        for param, master in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params, strict=True):
            if param.grad is not None:
                new = param.grad.float() / scaler.loss_scale()
                master.grad = new if master.grad is None else master.grad + new
        amp._process_optimizer.post_backward_models_are_masters(
            scaler, stash.all_fp32_from_fp32_params, stash.all_fp32_from_fp32_grad_stash
        )

    optimizer._post_amp_backward = types.MethodType(post_amp_backward, optimizer)
    for i in range(2):  # two backwards, no zero_grad between them
        with amp.scale_loss(model(_batch(i).half()).float().pow(2).mean(), optimizer) as scaled_loss:
            scaled_loss.backward()
        reference(_batch(i)).pow(2).mean().backward()
    for master, ref in zip(amp.master_params(optimizer), reference.parameters(), strict=True):
        torch.testing.assert_close(master.grad, ref.grad, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("name", ["_prepare_amp_backward", "_post_amp_backward"])
def test_a_replacement_that_skips_amps_own_method_under_combine_grad_is_refused_naming_it(shim, name):
    """With ``combine_grad=True`` (Ascend's flat gradient buffers) only amp's own methods know the buffers: a no-op
    replacement is refused naming the method and what to do, where the combiner's own error named neither."""
    from apex import amp

    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", combine_grad=True, verbosity=0)
    setattr(optimizer, name, types.MethodType(lambda opt, *scaler: None, optimizer))
    with pytest.raises(RuntimeError, match=rf"optimizer\.{name} was replaced by .*call the original"):
        with amp.scale_loss(model(_batch(0)).sum(), optimizer) as scaled_loss:
            scaled_loss.backward()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_post_amp_backward_refused_under_combine_grad_says_the_backward_ran_and_gives_back_the_gradients(
    shim, opt_level
):
    """Whether a replaced ``_post_amp_backward`` calls amp's own is known only once it returned, after the backward:
    the refusal says the backward ran, its gradients are dropped and those from before it are back in ``.grad``
    (unscaled) with the scale unchanged, so the run goes on once the original is restored. They stayed scaled in the
    flat buffers and pending: the next step was refused as following a delay_unscale backward."""
    from apex import amp

    model, reference = _mlp(), _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, combine_grad=True, verbosity=0)
    half = opt_level == "O2"
    amps_own, scaler = optimizer._post_amp_backward, amp._amp_state.loss_scalers[0]

    def backward(i: int) -> None:
        loss = F.mse_loss(model(_batch(i).half() if half else _batch(i)).float(), torch.zeros(8, 2))
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        F.mse_loss(reference(_batch(i)), torch.zeros(8, 2)).backward()

    backward(0)
    before = [p.grad.clone() for p in amp.master_params(optimizer)]
    optimizer._post_amp_backward = types.MethodType(lambda opt, loss_scaler: None, optimizer)
    with pytest.raises(RuntimeError, match=r"call the original.*The backward ran: its gradients .* were dropped"):
        backward(1)  # raised at the block's exit: the reference has backward 0's gradients only
    optimizer._post_amp_backward = amps_own
    assert scaler.loss_scale() == 2.0**16
    for grad, kept in zip((p.grad for p in amp.master_params(optimizer)), before, strict=True):
        assert torch.equal(grad, kept)
    backward(1)
    for ours, ref in zip(amp.master_params(optimizer), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, ref.grad, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize(("name", "which"), [("_prepare_amp_backward", 1), ("_post_amp_backward", 0)])
def test_a_refused_method_of_one_optimizer_leaves_none_of_a_scale_loss_s_optimizers_pending(shim, name, which):
    """``scale_loss`` prepares, then unscales, its optimizers one by one: when one's replacement is refused
    (combine_grad), the others this block prepared are not left pending but get their gradients back as they were.
    A first optimizer prepared before the second's refused prepare stayed prepared for good (every later
    ``scale_loss`` of it was refused as nested in this one); a second left after the first's refused unscale kept the
    backward's gradients scaled, and the next backward was unscaled with them."""
    from apex import amp

    model = _mlp()
    optimizers = [torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[2].parameters(), lr=0.1)]
    model, optimizers = amp.initialize(model, optimizers, opt_level="O1", combine_grad=True, verbosity=0)

    def backward() -> None:
        with amp.scale_loss(F.mse_loss(model(_batch(0)), torch.zeros(8, 2)), optimizers) as scaled_loss:
            scaled_loss.backward()

    backward()
    before = [p.grad.clone() for p in model.parameters()]
    amps_own = getattr(optimizers[which], name)
    setattr(optimizers[which], name, types.MethodType(lambda opt, *scaler: None, optimizers[which]))
    with pytest.raises(RuntimeError, match=rf"optimizer\.{name} was replaced"):
        backward()
    assert all(torch.equal(p.grad, kept) for p, kept in zip(model.parameters(), before, strict=True))
    setattr(optimizers[which], name, amps_own)
    backward()
    for param, kept in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(param.grad, 2 * kept, rtol=2e-3, atol=1e-5)


class _BlockMomentum:
    """The runner's ``BMUF`` optimizer in outline (one worker, so its allreduce is the identity): every ``block``
    steps the masters jump by a block-momentum update from their global copy, then, "for amp level O2", the masters
    are pushed into the model through ``optimizer._master_params_to_model_params()`` when the optimizer has it."""

    def __init__(self, optimizer, block: int = 2, block_lr: float = 1.0, block_momentum: float = 0.5) -> None:
        from apex import amp

        self.optimizer, self.block, self.block_lr, self.block_momentum = optimizer, block, block_lr, block_momentum
        self.params = list(amp.master_params(optimizer))
        self.global_params = [p.detach().clone() for p in self.params]
        self.delta = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self, iters: int) -> None:
        if (iters + 1) % self.block:
            return
        for param, delta, global_param in zip(self.params, self.delta, self.global_params, strict=True):
            delta.copy_(self.block_momentum * delta + self.block_lr * (param - global_param))
            param.copy_(global_param + delta)
            global_param.copy_(param)
        if hasattr(self.optimizer, "_master_params_to_model_params"):
            self.optimizer._master_params_to_model_params()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_block_momentum_sync_on_the_masters_reaches_the_model_through_master_params_to_model_params(shim, opt_level):
    """The runner's BMUF writes its block update into ``amp.master_params`` and, where the optimizer has Apex's O2
    ``_master_params_to_model_params`` (O2 only, as in Apex: O1 has no masters), pushes them into the fp16 model, so
    the next forward runs on the synced weights. amp's O2 optimizer lacked it: the model ran one block stale."""
    from apex import amp

    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, loss_scale=128.0, verbosity=0)
    assert hasattr(optimizer, "_master_params_to_model_params") == (opt_level == "O2")
    bmuf = _BlockMomentum(optimizer)
    for iters in range(4):
        optimizer.zero_grad()
        x = _batch(iters)
        with amp.scale_loss(model(x.half() if opt_level == "O2" else x).float().pow(2).mean(), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        bmuf.step(iters)
        for weight, master in zip(model.parameters(), amp.master_params(optimizer), strict=True):
            assert torch.equal(weight, master.to(weight.dtype))


def test_a_copy_of_apexs_o1_post_amp_backward_accumulates_through_apexs_helper_as_float32(shim):
    """A copy of Apex's O1 ``_post_amp_backward`` (no masters): each dtype's parameters and Apex's stash of them
    (``_amp_stash.all_fp16_grad_stash`` / ``all_fp32_grad_stash``) through ``post_backward_models_are_masters``. amp
    adds back what it stashed, so two backwards without a ``zero_grad`` accumulate as in float32."""
    from apex import amp

    model = _mlp()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", loss_scale=512.0, verbosity=0)

    def post_amp_backward(self, scaler):
        stash = self._amp_stash
        for params, stashed in ((stash.all_fp16_params, stash.all_fp16_grad_stash),
                                (stash.all_fp32_params, stash.all_fp32_grad_stash)):  # fmt: skip
            amp._process_optimizer.post_backward_models_are_masters(scaler, params, stashed)

    optimizer._post_amp_backward = types.MethodType(post_amp_backward, optimizer)
    for i in range(2):
        with amp.scale_loss(model(_batch(i)).float().pow(2).mean(), optimizer) as scaled_loss:
            scaled_loss.backward()
        reference(_batch(i)).pow(2).mean().backward()
    for ours, ref in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, ref.grad, rtol=2e-2, atol=2e-3)


class _OldFusedSGD:
    """Apex's FusedSGD with ``materialize_master_grads=False`` at O2, in outline: its ``_post_amp_backward`` left the
    model's fp16 gradients at the loss scale and recorded that scale (``most_recent_scale``, the lower of this
    backward's and the one recorded since the last step, with ``scale_set_by_backward``); its step divided by it,
    updated the masters and reset both. ``make`` builds it on apex.optimizers.FusedSGD, which has Apex's attributes."""

    @staticmethod
    def make(params, lr: float):
        from apex.optimizers import FusedSGD

        class OldFusedSGD(FusedSGD):
            @torch.no_grad()
            def step(self, closure=None):
                stash = self._amp_stash
                for models, masters in zip(stash.fp16_groups, stash.fp32_from_fp16_groups, strict=True):
                    for model, master in zip(models, masters, strict=True):
                        if model.grad is not None:
                            master.sub_(model.grad.float() / self.most_recent_scale, alpha=lr)
                self.most_recent_scale, self.scale_set_by_backward = 1.0, False

        return OldFusedSGD(params, lr=lr, materialize_master_grads=False)

    @staticmethod
    def record_scale(optimizer) -> list[tuple[float, bool]]:
        """Wrap amp's ``_post_amp_backward`` to record the scale as Apex's FusedSGD one did; returns the record seen
        before each step (or skip)."""
        amps_own, seen = optimizer._post_amp_backward, []

        def post_amp_backward(self, scaler):
            amps_own(scaler)
            scale = scaler.loss_scale()
            self.most_recent_scale = min(scale, self.most_recent_scale) if self.scale_set_by_backward else scale
            self.scale_set_by_backward = True
            seen.append((self.most_recent_scale, self.scale_set_by_backward))

        optimizer._post_amp_backward = types.MethodType(post_amp_backward, optimizer)
        return seen


def test_a_skipped_step_resets_the_scale_apexs_fused_sgd_recorded_and_the_next_step_trains(shim):
    """An overflow's skipped step resets ``most_recent_scale`` to 1 and ``scale_set_by_backward`` to False on an
    optimizer that has them (Apex's FusedSGD), as Apex's skip did: the record belonged to the gradients the skip
    throws away (amp kept 65536 and True past the skip). The next, normal step trains as float32 does."""
    from apex import amp

    model, reference = _mlp(), _mlp()
    optimizer = _OldFusedSGD.make(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    seen = _OldFusedSGD.record_scale(optimizer)
    scaler = amp._amp_state.loss_scalers[0]
    for blow_up in (float("inf"), 1.0):
        optimizer.zero_grad()
        loss = F.mse_loss(model(_batch(0).half()).float() * blow_up, torch.zeros(8, 2))
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        if blow_up != 1.0:
            assert seen == [(2.0**16, True)] and scaler.loss_scale() == 2.0**15
            assert (optimizer.most_recent_scale, optimizer.scale_set_by_backward) == (1.0, False)
    assert seen[1] == (2.0**15, True) and (optimizer.most_recent_scale, optimizer.scale_set_by_backward) == (1.0, False)
    F.mse_loss(reference(_batch(0)), torch.zeros(8, 2)).backward()
    with torch.no_grad():
        for param in reference.parameters():
            param.sub_(param.grad, alpha=0.1)
    for master, ref in zip(amp.master_params(optimizer), reference.parameters(), strict=True):
        torch.testing.assert_close(master, ref, rtol=0, atol=2e-3)


def _update_scale_agreed_with(other_ranks_overflowed: list[bool]):
    """A copy of Apex's ``LossScaler.update_scale`` that first takes the MAX of ``_has_overflow`` over the ranks (the
    other ranks' verdicts given, one per call), as model-parallel trainers patched it."""

    def update_scale(self):
        if self.has_fused_kernel and self.dynamic and not self._has_overflow:
            self._has_overflow = self._overflow_buf.item()
        self._has_overflow = max(self._has_overflow, other_ranks_overflowed.pop(0))  # the client's all_reduce(MAX)
        if self._has_overflow and self.dynamic:
            should_skip = True
            if self._min_loss_scale:
                self._loss_scale = max(self._min_loss_scale, self._loss_scale / 2.0)
            else:
                self._loss_scale = self._loss_scale / 2.0
            self._unskipped = 0
        else:
            should_skip = False
            self._unskipped += 1
        if self._unskipped == self._scale_seq_len and self.dynamic:
            self._loss_scale = min(self._max_loss_scale, self._loss_scale * 2.0)
            self._unskipped = 0
        return should_skip

    return update_scale


def test_a_patched_loss_scaler_update_scale_agreeing_the_overflow_across_ranks_decides_the_skip(shim, monkeypatch):
    """A model-parallel trainer's ``monkey_patch_apex_amp_scaler`` replaces ``apex.amp.scaler.LossScaler.update_scale``
    by a copy of Apex's that first takes the MAX of ``_has_overflow`` over the ranks (here another rank's verdict,
    given). ``scale_loss`` decides the skip through ``loss_scaler.update_scale()``, as Apex did, so another rank's
    overflow skips this rank's clean step and halves its scale too. amp updated its scaler directly, and
    ``apex.amp.scaler.LossScaler`` was not the class of amp's scalers: the patch never ran, and the ranks drifted."""
    from apex import amp

    other_ranks_overflowed = [False, True, False]
    monkeypatch.setattr(amp.scaler.LossScaler, "update_scale", _update_scale_agreed_with(other_ranks_overflowed))
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]
    assert isinstance(scaler, amp.scaler.LossScaler)
    changed = []
    for i in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        with amp.scale_loss(F.mse_loss(model(_batch(i)), torch.zeros(8, 2)), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        changed.append(not all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True)))
    assert changed == [True, False, True] and other_ranks_overflowed == []
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0**15, "unskipped": 1}


def test_fp16_optimizer_decides_its_overflow_through_the_patched_update_scale(shim, monkeypatch):
    """Apex's last ``FP16_Optimizer`` kept an ``apex.amp.scaler.LossScaler`` and set ``overflow`` from its
    ``update_scale()`` after each unscale, so the same patch agreed its skips across ranks too; ampkit's updated the
    scaler directly, and a clean rank stepped where another skipped."""
    from apex import amp
    from apex.fp16_utils import FP16_Optimizer

    other_ranks_overflowed = [False, True, False]
    monkeypatch.setattr(amp.scaler.LossScaler, "update_scale", _update_scale_agreed_with(other_ranks_overflowed))
    model = _mlp().half()
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False)
    changed = []
    for i in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        optimizer.backward(F.mse_loss(model(_batch(i).half()).float(), torch.zeros(8, 2)))
        optimizer.step()
        changed.append(not all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True)))
    assert changed == [True, False, True] and other_ranks_overflowed == []
    assert optimizer.loss_scale == 2.0**15 and optimizer.loss_scaler._unskipped == 1


@pytest.mark.parametrize("how", ["subclass", "class patch"])
def test_fp16_optimizer_unscales_through_a_scalers_own_unscale_which_agrees_the_overflow(shim, monkeypatch, how):
    """Apex's last ``FP16_Optimizer`` unscaled each backward through ``loss_scaler.unscale(model_grads, master_grads,
    loss_scale())``, the fp16 params onto their masters, then the float32 params in place; a model-parallel script's
    scaler agrees the overflow across its ranks there (an all-reduce MAX of ``_overflow_buf``, here the other rank's
    verdict given), whether it swaps in a subclass or patches ``apex.amp.scaler.LossScaler``. ampkit's unscaled by
    itself and never called it: the other rank's overflow did not skip this rank's step. The gradients it leaves
    (two backwards a step, the second added to the first) are those of ampkit's own path."""
    from apex.amp.scaler import LossScaler
    from apex.fp16_utils import FP16_Optimizer

    other_rank = {"overflowed": 0}
    seen: list[tuple[list[torch.dtype], list[torch.dtype], float]] = []
    own_unscale = LossScaler.unscale

    def unscale(self, model_grads, master_grads, unused_scale, models_are_masters=False):
        seen.append(([g.dtype for g in model_grads], [g.dtype for g in master_grads], unused_scale))
        own_unscale(self, model_grads, master_grads, unused_scale, models_are_masters)
        flag = torch.tensor([other_rank["overflowed"]], dtype=self._overflow_buf.dtype)
        self._overflow_buf.copy_(torch.maximum(self._overflow_buf, flag))  # all_reduce(MAX) over the ranks

    def run(patched: bool) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]], float]:
        model = _mlp()
        model[0].half()  # fp16 params with float32 masters; the last layer's are float32, their own masters
        optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False)
        if patched and how == "subclass":
            optimizer.loss_scaler = type("AgreeingScaler", (LossScaler,), {"unscale": unscale})("dynamic")
        weights, grads = [], []
        for step, other in enumerate((0, 1, 0)):
            optimizer.zero_grad()
            for micro in range(2):
                other_rank["overflowed"] = other if patched and micro == 1 else 0
                x = _batch(10 * step + micro).half()
                optimizer.backward(F.mse_loss(model[2](model[1](model[0](x)).float()), torch.zeros(8, 2)) / 2)
            grads.append([p.grad.clone() for g in optimizer.param_groups for p in g["params"]])
            optimizer.step()
            weights.append([p.detach().clone() for p in model.parameters()])
        return weights, grads, optimizer.loss_scale

    own_weights, own_grads, _ = run(patched=False)
    if how == "class patch":
        monkeypatch.setattr(LossScaler, "unscale", unscale)
    weights, grads, loss_scale = run(patched=True)
    assert loss_scale == 2.0**15  # the other rank's overflow halved this rank's scale too
    assert all(torch.equal(a, b) for a, b in zip(weights[0], weights[1], strict=True))  # and skipped its step
    assert not all(torch.equal(a, b) for a, b in zip(weights[1], weights[2], strict=True))
    for got, want in zip(grads[0] + weights[0], own_grads[0] + own_weights[0], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Apex's calls: per backward, the fp16 grads onto float32 masters, then the float32 grads in place, at the scale
    per_backward = [([torch.float16] * 2, [torch.float32] * 2), ([torch.float32] * 2, [torch.float32] * 2)]
    assert [(m, o) for m, o, _ in seen] == per_backward * 6
    assert [s for _, _, s in seen] == [2.0**16] * 8 + [2.0**15] * 4


def test_fp16_optimizer_whose_scalers_unscale_raises_keeps_the_gradients_of_the_backwards_before(shim):
    """Where the scaler's own unscale raised (its all-reduce with a rank gone), the float32 params kept the
    backward's gradients at the loss scale, the earlier backward's lost: the backward is dropped instead, every
    gradient as the earlier backward left it, and the next one unscales as before."""
    from apex.amp.scaler import LossScaler
    from apex.fp16_utils import FP16_Optimizer

    class AgreeingScaler(LossScaler):
        fail = False

        def unscale(self, *args, **kwargs):
            if self.fail:
                raise RuntimeError("all-reduce: a rank is gone")
            super().unscale(*args, **kwargs)

    model = _mlp()
    model[0].half()
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False)
    scaler = optimizer.loss_scaler = AgreeingScaler("dynamic")

    def backward(i: int) -> None:
        optimizer.backward(F.mse_loss(model[2](model[1](model[0](_batch(i).half())).float()), torch.zeros(8, 2)))

    backward(0)
    before = [p.grad.clone() for g in optimizer.param_groups for p in g["params"]]
    scaler.fail = True
    with pytest.raises(RuntimeError, match="a rank is gone"):
        backward(1)
    after = [p.grad for g in optimizer.param_groups for p in g["params"]]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    scaler.fail = False
    backward(1)
    assert all(torch.isfinite(p.grad).all() for g in optimizer.param_groups for p in g["params"])


@pytest.mark.parametrize("where", ["instance", "class"])
def test_a_scalers_unscale_patched_after_the_first_backward_is_called_and_unpatched_is_not(shim, monkeypatch, where):
    """A script that patches the scaler once training runs (``amp._amp_state.loss_scalers[0].unscale = mine``, or
    ``apex.amp.scaler.LossScaler.unscale``, to agree the overflow across ranks from the step its group exists) had
    Apex call it at the next backward: Apex looked the method up each time. ampkit decided at the first unscale, so
    the patch went unheard and the other rank's overflow was not skipped here. Undone, amp's own unscales again."""
    import apex.amp as amp
    from apex.amp.scaler import LossScaler

    own_unscale, calls = LossScaler.unscale, []

    def agreeing_unscale(self, model_grads, master_grads, unused_scale, models_are_masters=False):
        calls.append(len(model_grads))
        own_unscale(self, model_grads, master_grads, unused_scale, models_are_masters)
        self._overflow_buf.fill_(1)  # all_reduce(MAX) over the ranks: another one overflowed

    model = _mlp()
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]

    def step(i: int) -> None:
        optimizer.zero_grad()
        with amp.scale_loss(F.mse_loss(model(_batch(i)).float(), torch.zeros(8, 2)), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()

    step(0)  # amp's own unscale: no overflow
    if where == "instance":
        scaler.unscale = types.MethodType(agreeing_unscale, scaler)
    else:
        monkeypatch.setattr(LossScaler, "unscale", agreeing_unscale)
    step(1)
    assert calls == [4] and scaler.loss_scale() == 2.0**15  # the script's unscale ran, and its overflow backed off
    if where == "instance":
        del scaler.unscale
    else:
        monkeypatch.setattr(LossScaler, "unscale", own_unscale)
    step(2)
    assert calls == [4] and scaler.loss_scale() == 2.0**15  # back to amp's own: no call, no overflow
