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
