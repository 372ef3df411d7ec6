"""fused_unscale_clip_step_ vs the unfused sequence GradScaler.unscale_ + clip_grad_norm_ + step."""

from __future__ import annotations

import math

import pytest
import torch

from ampkit.ops.optimizers import FusedAdam, FusedLAMB, FusedRMSprop, FusedSGD
from ampkit.ops.pipeline import fused_unscale_clip_step_

SHAPES = [(33, 17), (65537,), (5,), (1,)]
SCALE = 2.0**12


@pytest.fixture(autouse=True)
def kernel_mode(monkeypatch):
    monkeypatch.setenv("AMPKIT_OPS", "kernel")


def make_params(dtype=torch.float32):
    return [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in SHAPES]


def twin(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def rel_diff(actual, expected) -> float:
    num = max(
        float((a.detach().double() - e.detach().double()).abs().max()) for a, e in zip(actual, expected, strict=True)
    )
    return num / max(float(e.detach().double().abs().max()) for e in expected)


def unfused_step(scaler, optimizer, params, max_norm):
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True) if max_norm else None
    scaler.step(optimizer)
    scaler.update()
    return norm


PAIRS = {
    "adamw": (
        lambda p: FusedAdam(p, lr=1e-3, weight_decay=0.01),
        lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),
    ),
    "sgd": (
        lambda p: FusedSGD(p, lr=1e-2, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    ),
    "rmsprop": (
        lambda p: FusedRMSprop(p, lr=1e-3, centered=True),
        lambda p: torch.optim.RMSprop(p, lr=1e-3, centered=True),
    ),
    "lamb": (lambda p: FusedLAMB(p, lr=1e-3), lambda p: FusedLAMB(p, lr=1e-3)),
}


@pytest.mark.parametrize("max_norm", [1.0, 1e6, None], ids=["clipping", "not_clipping", "no_max_norm"])
@pytest.mark.parametrize("case", list(PAIRS))
def test_matches_unscale_clip_step_sequence(case, max_norm):
    make_fused, make_unfused = PAIRS[case]
    a = make_params()
    b = twin(a)
    fused, unfused = make_fused(a), make_unfused(b)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=10**6)
    for _ in range(10):
        scaler.scale(torch.ones(()))
        for p, q in zip(a, b, strict=True):
            g = torch.randn(p.shape) * SCALE
            p.grad, q.grad = g.clone(), g.clone()
        found_inf, norm = fused_unscale_clip_step_(fused, 1.0 / SCALE, max_norm)
        expected_norm = unfused_step(scaler, unfused, b, max_norm)
        assert found_inf is False
        assert norm.dtype == torch.float32
        if expected_norm is not None:
            torch.testing.assert_close(norm, expected_norm, rtol=2e-6, atol=0)
    assert rel_diff(a, b) <= 1e-6


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("position", ["first", "middle", "last"])
def test_inf_or_nan_skips_the_update_entirely(position, value):
    params = make_params()
    opt = FusedAdam(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn(p.shape) * SCALE
    fused_unscale_clip_step_(opt, 1.0 / SCALE, 1.0)
    target = params[1].grad.view(-1)
    target[{"first": 0, "middle": target.numel() // 2, "last": -1}[position]] = value
    before = [p.detach().clone() for p in params]
    grads_before = [p.grad.clone() for p in params]
    state_before = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    found_inf, norm = fused_unscale_clip_step_(opt, 1.0 / SCALE, 1.0)
    assert found_inf is True and math.isnan(float(norm))
    for p, b, g in zip(params, before, grads_before, strict=True):
        assert torch.equal(p, b)
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0, equal_nan=True)
        for key, value in state_before[id(p)].items():
            assert torch.equal(opt.state[p][key], value), key
    assert float(opt.state[params[0]]["step"]) == 1.0


def test_gradients_are_left_untouched():
    params = make_params()
    opt = FusedAdam(params)
    for p in params:
        p.grad = torch.randn(p.shape) * SCALE
    grads = [p.grad.clone() for p in params]
    fused_unscale_clip_step_(opt, 1.0 / SCALE, 0.5)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))


def test_half_gradients_with_master_weights():
    half = make_params(torch.bfloat16)
    full = [torch.nn.Parameter(p.detach().float()) for p in half]
    fused = FusedAdam(half, lr=1e-3, master_weights=True)
    reference = torch.optim.AdamW(full, lr=1e-3, weight_decay=0.0)
    for _ in range(5):
        for h, f in zip(half, full, strict=True):
            g = (torch.randn(h.shape) * SCALE).bfloat16()
            h.grad, f.grad = g, g.float() / SCALE
        fused_unscale_clip_step_(fused, 1.0 / SCALE, 1.0)
        torch.nn.utils.clip_grad_norm_(full, 1.0)
        reference.step()
    masters = [fused.state[p]["master_param"] for p in half]
    assert rel_diff(masters, full) <= 1e-6


def test_no_gradients_is_a_no_op():
    params = make_params()
    found_inf, norm = fused_unscale_clip_step_(FusedAdam(params), 1.0, 1.0)
    assert found_inf is False and float(norm) == 0.0


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(inv_scale=0.0), ValueError, "inv_scale must be a finite number > 0"),
        (dict(inv_scale=math.inf), ValueError, "inv_scale must be a finite number > 0"),
        (dict(inv_scale=1.0, max_norm=-1.0), ValueError, "max_norm must be None or a finite number > 0"),
        (dict(inv_scale=1.0, max_norm=math.nan), ValueError, "max_norm must be None or a finite number > 0"),
        # float() read "0.5" and True as numbers, and failed on None or "x" without naming the argument
        (dict(inv_scale="0.5"), TypeError, r"inv_scale must be a finite number > 0; got '0.5' \(a str\)"),
        (dict(inv_scale=None), TypeError, r"inv_scale must be a finite number > 0; got None \(a NoneType\)"),
        (dict(inv_scale=1.0, max_norm=True), TypeError, r"max_norm must be None or a finite .*; got True \(a bool\)"),
        # item() on a meta tensor named neither the argument nor why
        (dict(inv_scale=torch.ones((), device="meta")), ValueError, "inv_scale must be .* on the meta device"),
        (dict(inv_scale=1.0, max_norm=torch.ones(1, device="meta")), ValueError, "max_norm must be .* on the meta"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        fused_unscale_clip_step_(FusedAdam(make_params()), **kwargs)


def test_torch_optimizer_is_rejected():
    with pytest.raises(TypeError, match="ampkit fused optimizer"):
        fused_unscale_clip_step_(torch.optim.AdamW(make_params()), 1.0, 1.0)


def test_strided_gradients_match_the_unfused_sequence():
    a = [torch.nn.Parameter(torch.randn(13, 7))]
    b = twin(a)
    fused, unfused = FusedAdam(a, lr=1e-2), torch.optim.AdamW(b, lr=1e-2, weight_decay=0.0)
    for _ in range(3):
        g = torch.randn(7, 13).t() * SCALE  # the parameter's shape with transposed strides
        a[0].grad, b[0].grad = g, g.clone()
        fused_unscale_clip_step_(fused, 1.0 / SCALE, 1.0)
        b[0].grad.mul_(1.0 / SCALE)
        torch.nn.utils.clip_grad_norm_(b, 1.0)
        unfused.step()
    assert rel_diff(a, b) <= 1e-6
