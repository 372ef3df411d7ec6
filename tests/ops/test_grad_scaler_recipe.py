"""torch.amp.GradScaler's recipe, as torch's own tests hold it, run on every fused optimizer under both
implementations (the C++ kernels and the pure-PyTorch references): a scaled run with an overflow equals the unscaled
run without that iteration, with or without ``unscale_``, clipping, accumulation, several optimizers on one scaler,
a disabled scaler and a resume of scaler and optimizer mid-run."""

from __future__ import annotations

import copy

import pytest
import torch
from fused_optimizer_cases import OPTIMIZERS, SHAPES

OVERFLOW_AT = 2  # the iteration whose gradients get an inf
# init 2**8, growth interval 3: halved by the overflow at iteration 2, doubled after the 3 clean ones that follow.
SCALES = [256.0, 256.0, 128.0, 128.0, 128.0, 256.0]


@pytest.fixture(params=["kernel", "reference"], autouse=True)
def ops_mode(request, monkeypatch):
    monkeypatch.setenv("AMPKIT_OPS", request.param)


def make_params():
    generator = torch.Generator().manual_seed(1)
    return [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in SHAPES]


def targets(step):
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=generator) for s in SHAPES]


def loss_of(params, step):
    """A loss whose gradient with respect to each parameter is that step's target (summed over losses)."""
    return sum((p * t).sum() for p, t in zip(params, targets(step), strict=True))


def scaler_for_test(enabled=True):
    return torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3, enabled=enabled)


def unscaled_run(optimizer, params, steps, skip=()):
    for step in steps:
        if step in skip:
            continue
        optimizer.zero_grad()
        loss_of(params, step).backward()
        optimizer.step()


def assert_same(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_then_step"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_scaled_run_with_an_overflow_equals_the_unscaled_run_without_that_iteration(name, unscale_first):
    """torch's recipe test: an inf in one gradient skips the whole step and halves the scale, the clean iterations
    step exactly as without scaling (the scales are powers of two), and the scale grows after the interval."""
    scaled_params, plain_params = make_params(), make_params()
    optimizer, plain = OPTIMIZERS[name](scaled_params), OPTIMIZERS[name](plain_params)
    scaler = scaler_for_test()
    scales = []
    for step in range(6):
        optimizer.zero_grad()
        scaler.scale(loss_of(scaled_params, step)).backward()
        if step == OVERFLOW_AT:
            scaled_params[1].grad[0] = float("inf")
        if unscale_first:
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    unscaled_run(plain, plain_params, range(6), skip=(OVERFLOW_AT,))
    assert scales == SCALES
    assert_same(scaled_params, plain_params)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_unscale_twice_before_update_is_an_error(name):
    params = make_params()
    optimizer = OPTIMIZERS[name](params)
    scaler = scaler_for_test()
    scaler.scale(loss_of(params, 0)).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(optimizer)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_one_scaler_for_two_optimizers_skips_only_the_one_that_overflowed_and_updates_once(name):
    params, plain_params = make_params(), make_params()
    first, second = OPTIMIZERS[name](params[:1]), OPTIMIZERS[name](params[1:])
    plain_first, plain_second = OPTIMIZERS[name](plain_params[:1]), OPTIMIZERS[name](plain_params[1:])
    scaler = scaler_for_test()
    for step in range(2):
        scaler.scale(loss_of(params, step)).backward()
        if step == 1:
            params[0].grad[0, 0] = float("nan")
        scaler.step(first)
        scaler.step(second)
        scaler.update()
        first.zero_grad()
        second.zero_grad()
        loss_of(plain_params, step).backward()
        if step == 0:
            plain_first.step()
        plain_second.step()
        plain_first.zero_grad()
        plain_second.zero_grad()
    assert scaler.get_scale() == 128.0
    assert_same(params, plain_params)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_gradients_unscaled_for_clipping_are_clipped_and_stepped_as_unscaled_ones(name):
    params, plain_params = make_params(), make_params()
    optimizer, plain = OPTIMIZERS[name](params), OPTIMIZERS[name](plain_params)
    scaler = scaler_for_test()
    for step in range(3):
        optimizer.zero_grad()
        scaler.scale(loss_of(params, step)).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        plain.zero_grad()
        loss_of(plain_params, step).backward()
        torch.nn.utils.clip_grad_norm_(plain_params, max_norm=1.0)
        plain.step()
    assert_same(params, plain_params)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_gradients_accumulated_over_scaled_backwards_step_as_their_unscaled_sum(name):
    params, plain_params = make_params(), make_params()
    optimizer, plain = OPTIMIZERS[name](params), OPTIMIZERS[name](plain_params)
    scaler = scaler_for_test()
    for micro_batch in range(2):
        scaler.scale(loss_of(params, micro_batch)).backward()
        loss_of(plain_params, micro_batch).backward()
    scaler.step(optimizer)
    scaler.update()
    plain.step()
    assert_same(params, plain_params)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_disabled_scaler_steps_as_the_bare_optimizer(name):
    params, plain_params = make_params(), make_params()
    optimizer, plain = OPTIMIZERS[name](params), OPTIMIZERS[name](plain_params)
    scaler = scaler_for_test(enabled=False)
    for step in range(3):
        optimizer.zero_grad()
        scaler.scale(loss_of(params, step)).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
    unscaled_run(plain, plain_params, range(3))
    assert not scaler.is_enabled()
    assert scaler.get_scale() == 1.0
    assert scaler.state_dict() == {}
    assert_same(params, plain_params)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_scaler_and_optimizer_resumed_mid_run_go_on_as_the_uninterrupted_run(name):
    def iteration(scaler, optimizer, params, step):
        optimizer.zero_grad()
        scaler.scale(loss_of(params, step)).backward()
        if step == 4:
            params[2].grad[1, 1] = float("inf")
        scaler.step(optimizer)
        scaler.update()

    params = make_params()
    optimizer, scaler = OPTIMIZERS[name](params), scaler_for_test()
    for step in range(3):
        iteration(scaler, optimizer, params, step)
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed, resumed_scaler = OPTIMIZERS[name](resumed_params), scaler_for_test()
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    resumed_scaler.load_state_dict(copy.deepcopy(scaler.state_dict()))
    for step in range(3, 7):
        iteration(scaler, optimizer, params, step)
        iteration(resumed_scaler, resumed, resumed_params, step)
        assert resumed_scaler.get_scale() == scaler.get_scale()
    assert_same(resumed_params, params)
    assert_same(resumed.state_dict(), optimizer.state_dict())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_half_weights_with_fp32_masters_skip_and_step_as_the_unscaled_half_run(name, dtype):
    """The same recipe on float16/bfloat16 weights whose fp32 masters live in the optimizer (GradScaler hands
    the half gradients to ``step``; its ``unscale_`` refuses float16 ones, for torch's optimizers too)."""

    def half_params():
        return [torch.nn.Parameter(p.detach().to(dtype)) for p in make_params()]

    def build(params):
        if name == "mixed_precision_lamb":  # always keeps masters
            return OPTIMIZERS[name](params)
        return OPTIMIZERS[name](params, master_weights=True)

    scaled_params, plain_params = half_params(), half_params()
    optimizer, plain = build(scaled_params), build(plain_params)
    scaler = scaler_for_test()
    for step in range(5):
        optimizer.zero_grad()
        scaler.scale(loss_of(scaled_params, step)).backward()
        if step == OVERFLOW_AT:
            scaled_params[0].grad[1, 2] = float("inf")
        scaler.step(optimizer)
        scaler.update()
    unscaled_run(plain, plain_params, range(5), skip=(OVERFLOW_AT,))
    assert scaler.get_scale() == SCALES[4]
    assert all(optimizer.state[p]["master_param"].dtype == torch.float32 for p in scaled_params)
    assert_same(scaled_params, plain_params)
