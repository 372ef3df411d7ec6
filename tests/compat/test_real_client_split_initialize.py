"""Programs that call ``amp.initialize`` more than once, one program per test (written here after the projects' own
code, CPU-sized): ColossalAI's nanoGPT benchmark (2023) initializes its model alone with ``num_losses=0``, builds the
optimizer over the cast parameters (after its DDP or FSDP wrap), initializes that optimizer with a
``torch.nn.Identity()`` in a second call, and swaps the scaler that call made for a subclass of
``apex.amp.scaler.LossScaler`` built from the old one's settings; a Facebook Lightning task mixin (2021) sets an
O1 model up again after Lightning restored a checkpoint, carrying the optimizer and ``amp.state_dict()`` across."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F

from ampkit.compat import install_apex_shim, uninstall_apex_shim


@pytest.fixture
def shim():
    install_apex_shim()
    yield
    uninstall_apex_shim()


def _gpt_like(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))


def _benchmark_run(level: int, steps: int, overflow_at: int | None = None) -> tuple[list[float], list[float], dict]:
    """The benchmark's set-up and loop: model-only ``initialize`` (``num_losses=0``, ``cast_model_type`` only from O2),
    the optimizer's own ``initialize`` beside an Identity, the scaler replaced, two micro-batches per step each in
    ``scale_loss``, the masters clipped, the learning rate written into the groups."""
    import apex.amp as amp
    from apex.amp import _amp_state
    from apex.amp.scaler import LossScaler

    class GradScaler(LossScaler):
        """The benchmark's scaler: Apex's positional constructor, plus a process group to agree overflows in."""

        def __init__(self, loss_scale, process_group=None, init_scale=2.0**16, scale_factor=2.0, scale_window=2000,
                     min_loss_scale=None, max_loss_scale=2.0**24):  # fmt: skip
            super().__init__(loss_scale, init_scale, scale_factor, scale_window, min_loss_scale, max_loss_scale)
            self.process_group = process_group

    model = _gpt_like(seed=0)
    _amp_state.allow_incoming_model_not_fp32 = False
    model = amp.initialize(
        model,
        opt_level=f"O{level}",
        cast_model_type=torch.float16 if level >= 2 else None,
        num_losses=0,
        verbosity=0,
    )
    assert isinstance(model, torch.nn.Module) and _amp_state.loss_scalers == []
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=1e-2)
    _, optimizer = amp.initialize(torch.nn.Identity(), optimizer, opt_level=f"O{level}", verbosity=0)
    old = amp._amp_state.loss_scalers[0]
    amp._amp_state.loss_scalers[0] = GradScaler(
        loss_scale="dynamic" if old.dynamic else old._loss_scale,
        max_loss_scale=old._max_loss_scale,
        min_loss_scale=old._min_loss_scale,
    )
    losses, scales = [], []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = 1e-2 * (step + 1) / steps
        optimizer.zero_grad()
        step_loss = 0.0
        for micro in range(2):
            g = torch.Generator().manual_seed(100 * step + micro)
            x, y = torch.randn(8, 4, generator=g), 0.1 * torch.randn(8, 1, generator=g)
            loss = F.mse_loss(model(x).float(), y) / 2
            if step == overflow_at and micro == 1:
                loss = loss * float("inf")
            step_loss += loss.item()
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        optimizer.step()
        losses.append(step_loss)
        scales.append(amp._amp_state.loss_scalers[0].loss_scale())
    return losses, scales, amp.state_dict()


@pytest.mark.parametrize("level", [1, 2])
def test_colossalai_gpt_benchmark_initializes_the_model_with_no_scaler_and_the_optimizer_in_a_second_call(shim, level):
    """Apex's ``range(0)`` made no scaler for the model-only call (ampkit refused ``num_losses=0``); the second call's
    scaler, replaced by the benchmark's subclass, is the one ``scale_loss`` scales and backs off with: an overflow
    halves it and skips that step, and training follows the float32 run of the same loop."""
    import apex.amp as amp

    reference = _gpt_like(seed=0)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=1e-2)
    ref_losses = []
    for step in range(4):
        for group in ref_optimizer.param_groups:
            group["lr"] = 1e-2 * (step + 1) / 4
        ref_optimizer.zero_grad()
        total = 0.0
        for micro in range(2):
            g = torch.Generator().manual_seed(100 * step + micro)
            x, y = torch.randn(8, 4, generator=g), 0.1 * torch.randn(8, 1, generator=g)
            loss = F.mse_loss(reference(x), y) / 2
            total += loss.item()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_optimizer.step()
        ref_losses.append(total)

    losses, scales, state = _benchmark_run(level, steps=4)
    assert scales == [2.0**16] * 4 and state == {"loss_scaler0": {"loss_scale": 2.0**16, "unskipped": 8}}
    torch.testing.assert_close(losses, ref_losses, rtol=2e-2, atol=2e-3)

    losses, scales, state = _benchmark_run(level, steps=3, overflow_at=1)
    assert type(amp._amp_state.loss_scalers[0]).__name__ == "GradScaler"
    assert scales == [2.0**16, 2.0**15, 2.0**15] and state["loss_scaler0"] == {"loss_scale": 2.0**15, "unskipped": 2}


def test_scale_loss_after_a_model_only_initialize_names_num_losses_zero(shim):
    """With no scaler (``num_losses=0`` and no later ``initialize``), Apex's ``scale_loss`` failed indexing an empty
    list; the error says why and what to pass."""
    import apex.amp as amp

    model = amp.initialize(_gpt_like(seed=0), opt_level="O1", num_losses=0, verbosity=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer._amp_stash = None  # never reached: the missing scaler is named first
    with pytest.raises(IndexError, match=r"loss_id=0: amp.initialize was called with num_losses=0, so there is no"):
        with amp.scale_loss(model(torch.randn(2, 4)).sum(), optimizer):
            pass
    assert amp.state_dict() == {}


@pytest.mark.parametrize("level", [1, 2])
def test_colossalai_gpt_benchmark_scaler_agrees_the_overflow_in_its_own_unscale(shim, level):
    """The benchmark's scaler overrides ``unscale`` and ``unscale_with_stashed``: each calls Apex's, then all-reduces
    ``_overflow_buf`` (MAX) over the model-parallel group and sets ``_has_overflow`` from it. amp called neither, so an
    overflow on another rank was never seen here: this rank stepped while that one skipped. Here the other rank's flag
    stands in for the all-reduce; the step it overflowed is skipped on this rank too, and the scale halves."""
    import apex.amp as amp
    from apex.amp.scaler import LossScaler

    other_rank = {"overflowed": 0}  # its verdict for the backward under way
    seen: list[tuple[str, list[torch.dtype], list[torch.dtype]]] = []

    class GradScaler(LossScaler):
        def _agree(self) -> None:
            flag = torch.tensor([other_rank["overflowed"]], dtype=self._overflow_buf.dtype)
            self._overflow_buf.copy_(torch.maximum(self._overflow_buf, flag))  # all_reduce(MAX) over the ranks
            self._has_overflow = self._overflow_buf.item()

        def unscale(self, model_grads, master_grads, unused_scale, models_are_masters=False):
            seen.append(("unscale", [g.dtype for g in model_grads], [g.dtype for g in master_grads]))
            super().unscale(model_grads, master_grads, unused_scale, models_are_masters)
            self._agree()

        def unscale_with_stashed(self, model_grads, stashed_master_grads, master_grads):
            seen.append(("stashed", [g.dtype for g in model_grads], [g.dtype for g in master_grads]))
            super().unscale_with_stashed(model_grads, stashed_master_grads, master_grads)
            self._agree()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    model = amp.initialize(
        model, opt_level=f"O{level}", cast_model_type=torch.float16 if level >= 2 else None, num_losses=0, verbosity=0
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _, optimizer = amp.initialize(torch.nn.Identity(), optimizer, opt_level=f"O{level}", verbosity=0)
    amp._amp_state.loss_scalers[0] = GradScaler("dynamic")
    weights = []
    for step, other in enumerate((0, 1, 0)):
        optimizer.zero_grad()
        for micro in range(2):
            other_rank["overflowed"] = other if micro == 1 else 0
            g = torch.Generator().manual_seed(100 * step + micro)
            loss = F.mse_loss(model(torch.randn(8, 4, generator=g)).float(), 0.1 * torch.randn(8, 1, generator=g))
            with amp.scale_loss(loss / 2, optimizer) as scaled_loss:
                scaled_loss.backward()
        optimizer.step()
        weights.append([p.detach().clone() for p in amp.master_params(optimizer)])
    assert amp._amp_state.loss_scalers[0].loss_scale() == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(weights[0], weights[1], strict=True))  # skipped, as the other rank
    assert not all(torch.equal(a, b) for a, b in zip(weights[1], weights[2], strict=True))
    half, single = [torch.float16] * 4, [torch.float32] * 2
    if level == 2:  # Apex's O2: the fp16 grads onto their fp32 masters, then the batch norm's (fp32, its own masters),
        # whose grads zero_grad zeroes in place after the first step (the masters' it sets to None)
        first = [("unscale", half, [torch.float32] * 4), ("unscale", single, single)]
        later = [("unscale", half, [torch.float32] * 4), ("stashed", single, single)]
        accumulated = [("stashed", half, [torch.float32] * 4), ("stashed", single, single)]
        assert seen == first + accumulated + (later + accumulated) * 2
    else:  # O1: every param is its own master; torch's zero_grad sets the grads to None
        assert seen == [("unscale", single * 3, single * 3), ("stashed", single * 3, single * 3)] * 3


@pytest.mark.parametrize("level", [1, 2])
def test_a_scripts_unscale_that_raises_leaves_no_gradient_at_the_loss_scale(shim, level):
    """The benchmark's scaler all-reduces in its unscale; where that raised (a rank gone), the backward's gradients
    were left in ``.grad`` at the loss scale and the earlier backward's lost (O1), or a new master's gradient left
    unwritten (O2): a caller that caught the error and stepped trained on them. The backward is dropped instead, as
    amp's own route drops one it cannot unscale, and the next ``scale_loss`` unscales as before."""
    import apex.amp as amp
    from apex.amp.scaler import LossScaler

    class GradScaler(LossScaler):
        fail = False

        def unscale(self, *args, **kwargs):
            if self.fail:
                raise RuntimeError("all-reduce: a rank is gone")
            super().unscale(*args, **kwargs)

        def unscale_with_stashed(self, *args, **kwargs):
            if self.fail:
                raise RuntimeError("all-reduce: a rank is gone")
            super().unscale_with_stashed(*args, **kwargs)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    model, optimizer = amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=f"O{level}", verbosity=0
    )
    scaler = amp._amp_state.loss_scalers[0] = GradScaler("dynamic", init_scale=128.0)
    x = torch.randn(8, 4)

    def backward() -> None:
        with amp.scale_loss(model(x).float().mean(), optimizer) as scaled_loss:
            scaled_loss.backward()

    if level == 1:
        backward()  # accumulated onto: O1's gradients are the params' own, stashed before the next backward
    before = [None if p.grad is None else p.grad.clone() for p in amp.master_params(optimizer)]
    scaler.fail = True
    with pytest.raises(RuntimeError, match="a rank is gone"):
        backward()
    after = [p.grad for p in amp.master_params(optimizer)]
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(after, before, strict=True))
    scaler.fail = False
    backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in amp.master_params(optimizer))


def test_a_scaler_with_its_own_unscale_under_combine_grad_is_refused_naming_it(shim):
    """combine_grad's flat buffers are unscaled by amp's own only: a scaler whose unscale is the script's would be
    passed over there, so ``scale_loss`` refuses, names it, and gives the gradients from before the backward back."""
    import apex.amp as amp
    from apex.amp.scaler import LossScaler

    class AgreeingScaler(LossScaler):
        def unscale(self, *args, **kwargs):
            super().unscale(*args, **kwargs)

    model = _gpt_like(seed=0)
    model, optimizer = amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", combine_grad=True, verbosity=0
    )
    amp._amp_state.loss_scalers[0] = AgreeingScaler("dynamic")
    with pytest.raises(RuntimeError, match=r"AgreeingScaler.unscale or unscale_with_stashed is the script's own"):
        with amp.scale_loss(model(torch.randn(2, 4)).sum(), optimizer) as scaled_loss:
            scaled_loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_a_copied_scale_loss_calling_post_amp_backward_unscales_through_the_scripts_scaler(shim):
    """Code that copied Apex's ``scale_loss`` calls ``optimizer._post_amp_backward(loss_scaler)`` itself; Apex's
    unscaled through ``loss_scaler.unscale``, so the benchmark's scaler agrees its overflow there too: an overflow only
    the other rank had skips this rank's step."""
    import apex.amp as amp
    from apex.amp.scaler import LossScaler

    calls = []

    class GradScaler(LossScaler):
        def unscale(self, model_grads, master_grads, unused_scale, models_are_masters=False):
            calls.append(len(model_grads))
            super().unscale(model_grads, master_grads, unused_scale, models_are_masters)
            self._overflow_buf.fill_(1)  # the other rank's overflow, through the all-reduce
            self._has_overflow = self._overflow_buf.item()

    model = _gpt_like(seed=0)
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    loss_scaler = amp._amp_state.loss_scalers[0] = GradScaler("dynamic")
    optimizer._prepare_amp_backward()
    loss = F.mse_loss(model(torch.randn(8, 4)).float(), torch.zeros(8, 1)) * 1e-3
    (loss * loss_scaler.loss_scale()).backward()
    loss_scaler.clear_overflow_state()
    optimizer._post_amp_backward(loss_scaler)
    assert calls == [6] and loss_scaler.update_scale() is True and loss_scaler.loss_scale() == 2.0**15
    assert all(torch.isfinite(p.grad).all() for p in amp.master_params(optimizer))  # this rank's own were clean


def _lightning_task_steps(model, optimizer, first: int, count: int) -> list[float]:
    import apex.amp as amp

    losses = []
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, generator=g), 0.1 * torch.randn(8, 1, generator=g)
        loss = F.mse_loss(model(x).float(), y)
        if step == 1:
            loss = loss * float("inf")  # one overflow, so the scale to carry over is not the initial one
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _configure_optimizers(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def test_fb_lightning_checkpoint_mixin_reinitializes_after_restoring_and_loads_amp_state_back(shim):
    """A Lightning task mixin (Facebook, 2021) that resumed Apex runs: after Lightning restored the checkpoint it
    dumps the optimizers' states and ``amp.state_dict()``, sets the model up again (a new optimizer from
    ``configure_optimizers``, ``amp.initialize`` a second time on the same O1 model, which makes fresh scalers), and
    loads both back. The resumed run continues bit for bit, at the loss scale the overflow left."""
    import apex.amp as amp

    model = _gpt_like(seed=0)
    model, optimizer = amp.initialize(model, _configure_optimizers(model), opt_level="O1", verbosity=0)
    _lightning_task_steps(model, optimizer, 0, 3)
    saved = io.BytesIO()
    torch.save(
        {
            "state_dict": model.state_dict(),
            "optimizer_states": [optimizer.state_dict()],
            "amp_scaling_state": amp.state_dict(),
        },
        saved,
    )
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=True)
    assert checkpoint["amp_scaling_state"]["loss_scaler0"] == {"loss_scale": 2.0**15, "unskipped": 1}
    straight = _lightning_task_steps(model, optimizer, 3, 3)
    want = [p.detach().clone() for p in model.parameters()]

    # Lightning's resume: set up, initialize, restore
    model = _gpt_like(seed=1)
    model, optimizer = amp.initialize(model, _configure_optimizers(model), opt_level="O1", verbosity=0)
    model.load_state_dict(checkpoint["state_dict"])
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    amp.load_state_dict(checkpoint["amp_scaling_state"])
    # the mixin's on_pretrain_routine_end: dump, set the model up again, restore
    restored = {"optimizer_states": [optimizer.state_dict()], "amp_scaling_state": amp.state_dict()}
    model, optimizer = amp.initialize(model, _configure_optimizers(model), opt_level="O1", verbosity=0)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0**16, "unskipped": 0}  # a new run's scalers
    optimizer.load_state_dict(restored["optimizer_states"][0])
    amp.load_state_dict(restored["amp_scaling_state"])
    assert _lightning_task_steps(model, optimizer, 3, 3) == straight
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), want, strict=True))
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0**15, "unskipped": 4}
