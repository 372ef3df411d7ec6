"""Scripts that drive the loss scaler by hand, as NVIDIA's BERT pretraining does after gradient accumulation:
scale_loss with delay_overflow_check, the master grads rescaled into one flat buffer (``apex_C``) and back with
``amp_C.multi_tensor_scale`` into an overflow buffer, then ``scaler._overflow_buf = buf`` and
``scaler.update_scale()`` decide the step, and ``_amp_stash.all_fp32_from_fp16_params`` are cleared on an
overflow."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ampkit.compat import amp, amp_c, apex_c
from ampkit.compat.amp import _amp_state


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))


def _batch(i: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(i))


def _hand_unscaled_step(model, optimizer, x, poison: bool) -> bool:
    """One BERT-style iteration; returns ``had_overflow``."""
    loss = model(x.half()).float().mean() * 0.01  # small grads: x 2**16 must fit the fp16 flat buffer
    with amp.scale_loss(loss * math.inf if poison else loss, optimizer, delay_overflow_check=True) as scaled:
        scaled.backward()
    scaler = _amp_state.loss_scalers[0]
    master_grads = [p.grad for p in amp.master_params(optimizer) if p.grad is not None]
    flat = torch.empty(sum(g.numel() for g in master_grads), dtype=torch.float16)
    views = apex_c.unflatten(flat, master_grads)
    overflow_buf = torch.zeros(1, dtype=torch.int32)
    amp_c.multi_tensor_scale(65536, overflow_buf, [master_grads, views], scaler.loss_scale())
    overflow_buf.zero_()  # (an all-reduce of `flat` across ranks goes here)
    amp_c.multi_tensor_scale(65536, overflow_buf, [views, master_grads], 1.0 / scaler.loss_scale())
    old_overflow_buf = scaler._overflow_buf
    scaler._overflow_buf = overflow_buf
    had_overflow = scaler.update_scale()
    scaler._overflow_buf = old_overflow_buf
    if not had_overflow:
        optimizer.step()
    elif _amp_state.opt_properties.master_weights:
        for param in optimizer._amp_stash.all_fp32_from_fp16_params:
            param.grad = None
    for param in model.parameters():
        param.grad = None
    return had_overflow


def test_flatten_and_unflatten_give_views_of_one_buffer():
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 1, 2)]
    flat = apex_c.flatten(tensors)
    assert flat.shape == (21,) and torch.equal(flat, torch.cat([t.reshape(-1) for t in tensors]))
    views = apex_c.unflatten(flat, tensors)
    assert [v.shape for v in views] == [t.shape for t in tensors]
    views[1].fill_(7.0)
    assert torch.equal(flat[12:17], torch.full((5,), 7.0))


def test_bert_style_hand_unscaling_steps_and_skips_as_scale_loss_would():
    """The same iterations through plain ``scale_loss`` (a twin run) give the same masters, scale and skip."""
    model = _model()
    twin = copy.deepcopy(model)
    initial = [p.detach().clone() for p in model.parameters()]
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    assert optimizer._amp_stash.all_fp32_from_fp16_params and all(
        p.dtype == torch.float32 for p in optimizer._amp_stash.all_fp32_from_fp16_params
    )
    assert all(p.dtype == torch.float16 for p in optimizer._amp_stash.all_fp16_params)
    poisoned = {1}
    overflows = [_hand_unscaled_step(model, optimizer, _batch(i), i in poisoned) for i in range(3)]
    hand_masters = [p.detach().clone() for p in amp.master_params(optimizer)]
    hand_state = amp.state_dict()

    twin, twin_optimizer = amp.initialize(twin, torch.optim.SGD(twin.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    for i in range(3):
        loss = twin(_batch(i).half()).float().mean() * 0.01
        with amp.scale_loss(loss * math.inf if i in poisoned else loss, twin_optimizer) as scaled:
            scaled.backward()
        twin_optimizer.step()
        twin_optimizer.zero_grad()
    assert overflows == [False, True, False]
    assert not all(torch.equal(a, b) for a, b in zip(hand_masters, initial, strict=True))  # two steps were taken
    assert hand_state == amp.state_dict() == {"loss_scaler0": {"loss_scale": 32768.0, "unskipped": 1}}
    for ours, theirs in zip(hand_masters, amp.master_params(twin_optimizer), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-5)  # the flat buffer is fp16, as BERT's


@pytest.mark.parametrize("loss_scale", ["dynamic", 128.0])
def test_unscale_then_update_scale(loss_scale):
    """Apex's ``LossScaler.unscale`` flags inf/nan in ``_overflow_buf``; ``update_scale`` reads it (a dynamic
    scaler backs off and asks to skip; a static one never does) and ``clear_overflow_state`` zeroes it."""
    amp.initialize(torch.nn.Linear(2, 2), opt_level="O1", loss_scale=loss_scale, verbosity=0)
    scaler = _amp_state.loss_scalers[0]
    scale = scaler.loss_scale()
    grads = [torch.full((3,), scale), torch.tensor([scale, math.inf])]
    out = [torch.empty(3), torch.empty(2)]
    scaler.clear_overflow_state()
    scaler.unscale(grads, out, None)
    assert torch.equal(out[0], torch.ones(3))
    assert scaler._overflow_buf.item() == 1
    assert scaler.update_scale() is (loss_scale == "dynamic")
    assert scaler.loss_scale() == (scale / 2 if loss_scale == "dynamic" else scale)
    scaler.clear_overflow_state()
    assert scaler._overflow_buf.item() == 0 and not scaler._has_overflow


def _apex_update_scale(scale: float, unskipped: int, overflow: bool, window: int, floor: float, cap: float):
    """Apex's ``update_scale`` rule for a dynamic scaler, in float64: (new scale, new count, skip)."""
    if overflow:
        return max(floor, scale / 2.0) if floor else scale / 2.0, 0, True
    unskipped += 1
    if unskipped == window:
        return min(cap, scale * 2.0), 0, False
    return scale, unskipped, False


def test_loss_scaler_takes_apexs_positional_constructor_and_follows_apexs_update_rule():
    """``LossScaler(loss_scale, init_scale, scale_factor, scale_window, min_loss_scale, max_loss_scale)`` by position,
    as code copied from Apex builds it: the scale follows Apex's rule step for step (the engine's keywords only were
    taken, and the second positional argument was a TypeError)."""
    from ampkit.compat.amp.scaler import LossScaler

    scaler = LossScaler("dynamic", 8.0, 2.0, 3, 2.0, 32.0)
    assert (scaler.dynamic, scaler._scale_seq_len, scaler._min_loss_scale, scaler._max_loss_scale) == (True, 3, 2, 32)
    scale, unskipped = 8.0, 0
    for overflow in [True] * 3 + [False] * 14 + [True]:
        scale, unskipped, skip = _apex_update_scale(scale, unskipped, overflow, 3, 2.0, 32.0)
        scaler.clear_overflow_state()
        scaler._has_overflow = overflow
        assert scaler.update_scale() is skip
        assert (scaler.loss_scale(), scaler._unskipped) == (scale, unskipped)
    assert scale == 16.0  # the floor, the cap and a back-off from it were all reached
    assert LossScaler("dynamic", 2.0**30).loss_scale() == 2.0**24  # Apex: min(max_loss_scale, init_scale)
    assert LossScaler(128.0).loss_scale() == 128.0 and not LossScaler(128.0).dynamic
    assert LossScaler("dynamic", min_loss_scale=0)._min_loss_scale is None  # Apex: a falsy floor is none
    with pytest.raises(ValueError, match=r"scale_window=0: expected an integer >= 1"):
        LossScaler("dynamic", 2.0**16, 2.0, 0)
    with pytest.warns(UserWarning, match=r"scale_factor=4.0 is ignored, as Apex ignored it"):
        quartering = LossScaler("dynamic", 64.0, 4.0)
    quartering._has_overflow = True
    quartering.update_scale()
    assert quartering.loss_scale() == 32.0  # halved, as Apex did whatever scale_factor said


def _assert_float64(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """``actual`` is ``expected`` (computed in float64) rounded to ``actual``'s dtype, within two roundings."""
    eps = torch.finfo(actual.dtype).eps
    torch.testing.assert_close(actual.double(), expected, rtol=2 * eps, atol=0)


def test_unscale_with_scale_override_divides_by_it():
    """``unscale(..., scale_override=s)`` divides by ``s`` instead of the loss scale (Apex's FusedSGD path), a unit
    override of a static scaler's masters is left alone (as Apex), and a scale of 0 is refused naming it."""
    from ampkit.compat.amp.scaler import LossScaler

    scaler = LossScaler(3.0)
    model = [torch.randn(5).half(), torch.randn(3, 4).half()]
    master = [torch.empty(5), torch.empty(3, 4)]
    scaler.unscale(model, master, None, scale_override=6.0)
    for out, grad in zip(master, model, strict=True):
        _assert_float64(out, grad.double() / 6.0)
    assert scaler._overflow_buf.item() == 0
    grads = [torch.randn(4)]
    before = grads[0].clone()
    scaler.unscale(grads, grads, None, models_are_masters=True, scale_override=1.0)
    assert torch.equal(grads[0], before)
    with pytest.raises(ValueError, match=r"scale_override=0(\.0)?: expected a finite number > 0"):
        scaler.unscale(grads, grads, None, scale_override=0)


@pytest.mark.parametrize("override", [None, (6.0, 3.0, 2.0)])
def test_unscale_with_stashed_is_apexs_axpby_and_checks_only_the_new_gradients(override):
    """``master = model * out/grads_have + stashed * out/stashed_have`` (default: the loss scale, 1, 1), against
    float64; an inf among the stashed gradients is not this backward's overflow, one among the new ones is."""
    from ampkit.compat.amp.scaler import LossScaler

    scaler = LossScaler(5.0)
    grads_have, stashed_have, out = override or (5.0, 1.0, 1.0)
    model = [torch.randn(7).half(), torch.randn(2, 3).half()]
    stashed = [torch.randn(7), torch.randn(2, 3)]
    expected = [
        m.double() * (out / grads_have) + s.double() * (out / stashed_have) for m, s in zip(model, stashed, strict=True)
    ]
    scaler.unscale_with_stashed(model, stashed, stashed, override)  # in place, as Apex's O2 called it
    for got, want in zip(stashed, expected, strict=True):
        _assert_float64(got, want)
    assert scaler._overflow_buf.item() == 0
    stashed[0][0] = float("inf")
    scaler.unscale_with_stashed(model, stashed, [torch.empty(7), torch.empty(2, 3)], override)
    assert scaler._overflow_buf.item() == 0
    model[1][0, 0] = float("nan")
    scaler.unscale_with_stashed(model, stashed, [torch.empty(7), torch.empty(2, 3)], override)
    assert scaler._overflow_buf.item() == 1
    with pytest.raises(ValueError, match=r"scale_override=\(1.0, 2.0\): expected None or three scales"):
        scaler.unscale_with_stashed(model, stashed, stashed, (1.0, 2.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_post_backward_models_are_masters_takes_apexs_fused_sgd_scale_override(dtype):
    """Apex's FusedSGD post-backward calls ``post_backward_models_are_masters(scaler, params, stash,
    (grads_have_scale, stashed_have_scale, out_scale))``: every gradient is left at ``out_scale`` (the new ones, those
    added to a stash, and a stash handed back), against float64; the stash is emptied. The 4th argument was a
    TypeError."""
    from ampkit.compat.amp._process_optimizer import post_backward_models_are_masters
    from ampkit.compat.amp.scaler import LossScaler

    scaler = LossScaler("dynamic", init_scale=2.0**10)
    grads_have, stashed_have, out = 2.0**10, 3.0, 96.0
    params = [torch.zeros(4, dtype=dtype, requires_grad=True) for _ in range(4)]
    new = [torch.randn(4).to(dtype) * 100 for _ in range(2)]
    stash = [torch.randn(4).to(dtype) for _ in range(2)]
    params[0].grad, params[1].grad = new[0].clone(), new[1].clone()
    stashed_grads = [None, stash[0].clone(), stash[1].clone(), None]  # new only, new + stash, stash only, nothing
    expected = [
        new[0].double() * out / grads_have,
        new[1].double() * out / grads_have + stash[0].double() * out / stashed_have,
        stash[1].double() * out / stashed_have,
    ]
    post_backward_models_are_masters(scaler, params, stashed_grads, (grads_have, stashed_have, out))
    for param, want in zip(params[:3], expected, strict=True):
        _assert_float64(param.grad, want)
    assert params[3].grad is None and stashed_grads == [None] * 4
    assert scaler._overflow_buf.item() == 0


def test_post_backward_models_are_masters_at_a_static_unit_scale_keeps_the_stash():
    """At a static scale of 1 the new gradients are left as they are and the stash is added back (Apex returned
    early and dropped it: an O2 accumulation of float32 parameters lost all but the last backward)."""
    from ampkit.compat.amp._process_optimizer import post_backward_models_are_masters
    from ampkit.compat.amp.scaler import LossScaler

    params = [torch.zeros(3, requires_grad=True), torch.zeros(3, requires_grad=True)]
    params[0].grad = torch.tensor([1.0, 2.0, 3.0])
    stashed = [torch.tensor([0.5, 0.5, 0.5]), torch.tensor([4.0, 5.0, 6.0])]
    post_backward_models_are_masters(LossScaler(1.0), params, stashed)
    assert params[0].grad.tolist() == [1.5, 2.5, 3.5] and params[1].grad.tolist() == [4.0, 5.0, 6.0]


def _copied_update_scale(self) -> bool:
    """Apex's ``LossScaler.update_scale``, as scripts copied it into their patches (min/max scale left out)."""
    from ampkit.compat.amp.scaler import LossScaler

    if LossScaler.has_fused_kernel and self.dynamic and not self._has_overflow:
        self._has_overflow = self._overflow_buf.item()
    if self._has_overflow and self.dynamic:
        self._loss_scale, self._unskipped = self._loss_scale / 2.0, 0
        return True
    self._unskipped += 1
    return False


@pytest.mark.parametrize("patched_update", [False, True], ids=["own_update_scale", "apex_update_scale_copied"])
def test_has_fused_kernel_false_takes_apexs_python_path(monkeypatch, patched_update):
    """``LossScaler.has_fused_kernel = False`` (set by a script, or by Apex itself where amp_C was missing) sent Apex's
    unscale down its Python path: each unscale read its verdict to the host into ``_has_overflow`` at once, and
    ``_overflow_buf`` was never written nor read. ampkit ignored the flag: ``_has_overflow`` stayed False until
    update_scale, and an update_scale copied from Apex, which then reads only ``_has_overflow``, stepped on inf."""
    from ampkit.compat.amp.scaler import LossScaler

    monkeypatch.setattr(LossScaler, "has_fused_kernel", False)
    if patched_update:
        monkeypatch.setattr(LossScaler, "update_scale", _copied_update_scale)
    # by hand: the verdict is there right after unscale, a static scaler checks nothing, the buffer stays 0
    dynamic, static = LossScaler("dynamic"), LossScaler(128.0)
    grads = [torch.tensor([1.0, math.inf], dtype=torch.float16), torch.ones(3, dtype=torch.float16)]
    for scaler, want in ((dynamic, True), (static, False)):
        scaler.clear_overflow_state()
        masters = [torch.empty(g.shape) for g in grads]
        scaler.unscale(grads, masters, None)
        assert bool(scaler._has_overflow) is want and scaler._overflow_buf.item() == 0
        assert scaler.update_scale() is want
    assert (dynamic.loss_scale(), static.loss_scale()) == (2.0**15, 128.0)
    # through amp.scale_loss at O2: the inf backward is skipped, the others step, and the buffer is never raised
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    scaler = _amp_state.loss_scalers[0]
    moved = []
    for i, poison in enumerate((False, True, False)):
        before = [p.detach().clone() for p in amp.master_params(optimizer)]
        optimizer.zero_grad()
        loss = model(_batch(i).half()).float().mean()
        with amp.scale_loss(loss * math.inf if poison else loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        moved.append(not all(torch.equal(a, b) for a, b in zip(amp.master_params(optimizer), before, strict=True)))
        assert scaler._overflow_buf.item() == 0
    assert moved == [True, False, True] and scaler.loss_scale() == 2.0**15
    assert all(torch.isfinite(p).all() for p in amp.master_params(optimizer))
