"""torch.amp.GradScaler driving every fused optimizer: grads after ``step`` are unscaled exactly as
``torch.optim.Adam(fused=True)`` leaves them, the update equals an unscaled step, and an inf skips the step
with parameters, state and (still scaled) grads untouched."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ampkit.ops.optimizers import (
    FusedAdadelta,
    FusedAdagrad,
    FusedAdam,
    FusedAdamP,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedRMSprop,
    FusedRMSpropTF,
    FusedSGD,
)

# Odd sizes, a non-contiguous (transposed) parameter and a one-element one.
SHAPES = [(7, 13), (29,), (3, 5, 4), (1,)]

EVERY_OPTIMIZER = {
    "adam": lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.01),
    "adam_master": lambda p: FusedAdam(p, lr=1e-2, master_weights=True),
    "sgd": lambda p: FusedSGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "adagrad": lambda p: FusedAdagrad(p, lr=0.1),
    "adadelta": lambda p: FusedAdadelta(p),
    "adamp": lambda p: FusedAdamP(p, lr=1e-2),
    "lamb": lambda p: FusedLAMB(p, lr=1e-2),
    "mixed_precision_lamb": lambda p: FusedMixedPrecisionLamb(p, lr=1e-2),
    "novograd": lambda p: FusedNovoGrad(p, lr=1e-2),
    "rmsprop": lambda p: FusedRMSprop(p, lr=1e-2, momentum=0.9, centered=True),
    "rmsprop_tf": lambda p: FusedRMSpropTF(p, lr=1e-2, momentum=0.9),
}


@pytest.fixture(autouse=True)
def kernel_mode(monkeypatch):
    monkeypatch.setenv("AMPKIT_OPS", "kernel")


def make_params(dtype):
    params = [torch.nn.Parameter(torch.randn(s, dtype=torch.float64).to(dtype)) for s in SHAPES]
    params.append(torch.nn.Parameter(torch.randn(6, 5, dtype=torch.float64).to(dtype).t()))
    return params


def scaled_step(scaler, opt, params, grads):
    """What ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` does to the grads."""
    scaler.scale(torch.ones(()))  # lazily creates the scale tensor, as a real backward would
    scale = scaler.get_scale()
    for p, g in zip(params, grads, strict=True):
        p.grad = (g * scale).to(p.dtype)
    scaler.step(opt)
    scaler.update()


def state_snapshot(opt):
    return {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for p, s in opt.state.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", list(EVERY_OPTIMIZER))
def test_grads_after_step_equal_torch_fused_adam_and_update_equals_an_unscaled_step(name, dtype):
    make = EVERY_OPTIMIZER[name]
    ours = make_params(dtype)
    unscaled = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    torch_params = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt, twin = make(ours), make(unscaled)
    torch_opt = torch.optim.Adam(torch_params, lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    for _ in range(4):
        grads = [torch.randn(p.shape).to(dtype).float() for p in ours]
        scaled_step(scaler, opt, ours, grads)
        scaled_step(torch_scaler, torch_opt, torch_params, grads)
        for p, q, t, g in zip(unscaled, ours, torch_params, grads, strict=True):
            p.grad = g.to(dtype)
            assert torch.equal(q.grad, t.grad)
            assert torch.equal(q.grad, g.to(dtype)), "a power-of-two scale unscales exactly"
        twin.step()
        for p, q in zip(ours, unscaled, strict=True):
            assert torch.equal(p, q)
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


@pytest.mark.parametrize("name", list(EVERY_OPTIMIZER))
def test_inf_step_is_skipped_leaving_params_state_and_grads_as_torch_does(name):
    make = EVERY_OPTIMIZER[name]
    ours = make_params(torch.float32)
    torch_params = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = make(ours)
    torch_opt = torch.optim.Adam(torch_params, lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaled_step(scaler, opt, ours, [torch.randn(p.shape) for p in ours])
    scaled_step(torch_scaler, torch_opt, torch_params, [torch.randn(p.shape) for p in ours])
    params_before = [p.detach().clone() for p in ours]
    state_before = state_snapshot(opt)
    grads = [torch.randn(p.shape) for p in ours]
    grads[2].view(-1)[3] = math.inf
    scaled_step(scaler, opt, ours, grads)
    scaled_step(torch_scaler, torch_opt, torch_params, grads)
    assert scaler.get_scale() == torch_scaler.get_scale() == 2.0**9
    for p, before in zip(ours, params_before, strict=True):
        assert torch.equal(p, before)
    after = state_snapshot(opt)
    for key, state in state_before.items():
        for k, v in state.items():
            assert torch.equal(after[key][k], v) if torch.is_tensor(v) else after[key][k] == v, k
    for p, q in zip(ours, torch_params, strict=True):
        assert torch.equal(p.grad, q.grad)  # still scaled, nan-free where finite: as torch leaves them


def test_step_takes_grad_scale_and_found_inf_as_keywords():
    params = make_params(torch.float32)
    opt = FusedSGD(params, lr=0.5)
    grads = [torch.randn(p.shape) for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g * 8.0
    before = [p.detach().clone() for p in params]
    opt.step(grad_scale=torch.tensor(8.0), found_inf=torch.tensor(1.0))
    assert all(
        torch.equal(p, b) and torch.equal(p.grad, g * 8.0) for p, b, g in zip(params, before, grads, strict=True)
    )
    opt.step(grad_scale=torch.tensor(8.0), found_inf=torch.tensor(0.0))
    for p, b, g in zip(params, before, grads, strict=True):
        assert torch.equal(p.grad, g)
        assert torch.equal(p, b - 0.5 * g)


def test_scale_that_is_not_a_power_of_two_divides_like_torch():
    params = make_params(torch.float32)
    torch_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    grads = [torch.randn(p.shape) * 3.0 for p in params]
    for p, q, g in zip(params, torch_params, grads, strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    scale, no_inf = torch.tensor(3.0), torch.tensor(0.0)
    FusedAdam(params).step(grad_scale=scale, found_inf=no_inf)
    torch_opt = torch.optim.Adam(torch_params, fused=True)
    torch_opt.grad_scale, torch_opt.found_inf = scale, no_inf
    torch_opt.step()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(params, torch_params, strict=True))


def test_explicit_unscale_then_step_does_not_unscale_twice():
    params = make_params(torch.float32)
    opt = FusedSGD(params, lr=0.1, momentum=0.9)
    twin_params = copy.deepcopy(params)
    twin = FusedSGD(twin_params, lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for _ in range(3):
        scaler.scale(torch.ones(()))
        grads = [torch.randn(p.shape) for p in params]
        for p, q, g in zip(params, twin_params, grads, strict=True):
            p.grad, q.grad = g * 256.0, g.clone()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        twin.step()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(params, twin_params, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(params, twin_params, strict=True))


@pytest.mark.parametrize("dampening", [0.0, 0.3], ids=["no_dampening", "dampening"])
def test_sgd_whose_first_step_overflows_matches_torch_sgd(dampening):
    """The step that would create the momentum buffers is skipped: the next one must still be a first step."""
    ours = make_params(torch.float32)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = FusedSGD(ours, lr=0.1, momentum=0.9, dampening=dampening)
    torch_opt = torch.optim.SGD(theirs, lr=0.1, momentum=0.9, dampening=dampening)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(4):
        grads = [torch.randn(p.shape) for p in ours]
        if step == 0:
            grads[1].view(-1)[0] = math.nan
        scaled_step(scaler, opt, ours, grads)
        scaled_step(torch_scaler, torch_opt, theirs, grads)
        if step == 0:
            assert all("momentum_buffer" not in opt.state[p] or not opt.state[p]["momentum_buffer"].any() for p in ours)
    assert scaler.get_scale() == torch_scaler.get_scale()
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], torch_opt.state[q]["momentum_buffer"])


@pytest.mark.parametrize("name", ["adam", "adagrad", "rmsprop", "adadelta"])
def test_step_counters_live_on_the_parameter_device_and_count_applied_steps(name):
    params = make_params(torch.float32)
    opt = EVERY_OPTIMIZER[name](params)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(3):
        grads = [torch.randn(p.shape) for p in params]
        if step == 1:
            grads[0].view(-1)[0] = math.inf
        scaled_step(scaler, opt, params, grads)
    for p in params:
        counter = opt.state[p]["step"]
        assert counter.device == p.device and counter.dtype == torch.float32
        assert float(counter) == 2.0


class NoHostRead(torch.Tensor):
    """A ``found_inf`` whose value (or any value computed from it) fails the test when read on the host."""

    def __bool__(self):
        raise AssertionError("found_inf was read on the host")

    item = __float__ = __int__ = tolist = __bool__


@pytest.mark.parametrize("backend", ["ampkit", "torch"])
def test_sgd_with_dampening_decides_a_skipped_first_step_on_the_device(backend):
    """Buffers made on skipped steps (two in a row, and a late parameter's) still take a first step when one is
    applied, as torch.optim.SGD stepping only the applied steps does, with found_inf never read on the host."""
    ours = make_params(torch.float32)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    hyper = dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01)
    opt, torch_opt = FusedSGD(ours, backend=backend, **hyper), torch.optim.SGD(theirs, **hyper)
    scale = torch.tensor(256.0)
    for step, skipped in enumerate([True, True, False, False, True, False]):
        late = step < 3  # the last parameter gets its first gradient on step 3
        grads = [torch.randn(p.shape) for p in ours]
        for i, (p, q, g) in enumerate(zip(ours, theirs, grads, strict=True)):
            has_grad = not (late and i == len(ours) - 1)
            p.grad = (g * scale).reshape(p.shape) if has_grad else None
            q.grad = g.reshape(q.shape).clone() if has_grad else None
        found_inf = torch.tensor(float(skipped)).as_subclass(NoHostRead)
        opt.step(grad_scale=scale, found_inf=found_inf)
        if skipped:
            assert all(p.grad is None or torch.equal(p.grad, g * scale) for p, g in zip(ours, grads, strict=True))
        else:
            torch_opt.step()
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], torch_opt.state[q]["momentum_buffer"])
    assert not opt._pending_first  # every parameter has taken its first step: later steps launch once


@pytest.mark.parametrize("name,values", [("lamb", 1), ("mixed_precision_lamb", 1), ("novograd", len(SHAPES) + 1)])
def test_norms_read_on_the_host_come_with_the_scalers_scalars_in_one_transfer(name, values, monkeypatch):
    """LAMB reads its global gradient norm on the host every step, NovoGrad each tensor's blended norm: GradScaler's
    found_inf and grad_scale come back in the same read (one synchronization on CUDA, where there were two, or one
    per bucket), and the step is the one the unscaled gradients give."""
    from ampkit.ops.optimizers import _base

    reads = []
    real = _base.read_together

    def recording(found_inf, grad_scale, values):
        reads.append((found_inf is not None, grad_scale is not None, None if values is None else values.numel()))
        return real(found_inf, grad_scale, values)

    monkeypatch.setattr(_base, "read_together", recording)
    make = EVERY_OPTIMIZER[name]
    params = make_params(torch.float32)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, reference = make(params), make(twin)
    grads = [torch.randn(p.shape, dtype=torch.float32) for p in params]
    for p, t, g in zip(params, twin, grads, strict=True):
        p.grad, t.grad = g * 1024.0, g.clone()
    opt.step(grad_scale=torch.tensor([1024.0]), found_inf=torch.tensor([0.0]))
    assert reads == [(True, True, values)]
    reference.step()
    for p, t in zip(params, twin, strict=True):
        torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", list(EVERY_OPTIMIZER))
def test_scaler_step_on_an_optimizer_without_gradients_is_a_no_op(name):
    """A frozen or unused part of the model: GradScaler hands an optimizer none of whose parameters has a gradient
    ``found_inf=0``, a Python int (its sum over no per-device flags); the step leaves everything as it is."""
    params = make_params(torch.float32)
    used = torch.nn.Parameter(torch.randn(3))
    opt, other = EVERY_OPTIMIZER[name](params), torch.optim.SGD([used], lr=0.1)
    before = [p.detach().clone() for p in params]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(used.sum()).backward()
    scaler.step(opt)
    scaler.step(other)
    scaler.update()
    assert all(torch.equal(p, b) and p.grad is None for p, b in zip(params, before, strict=True))
    assert scaler.get_scale() == 2.0**10


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts tensors read back as Python numbers (on CUDA each one waits for the GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


BAD_SCALES = [0.0, -1024.0, math.inf, math.nan]


@pytest.mark.parametrize("scale", BAD_SCALES)
@pytest.mark.parametrize("name", list(EVERY_OPTIMIZER))
def test_a_grad_scale_that_is_not_finite_and_positive_skips_the_step_in_every_optimizer(name, scale):
    """Gradients divided by a grad_scale of 0, inf or NaN are not finite (GradScaler's own ``unscale_`` calls that an
    overflow), by a negative one they point uphill: FusedAdam stepped to NaN and FusedLAMB raised ZeroDivisionError.
    Every optimizer now skips, with parameters, state and grads untouched, and the ones that take GradScaler's
    tensors into their kernels decide it there, with no host read."""
    make = EVERY_OPTIMIZER[name]
    params = make_params(torch.float32)
    opt = make(params)
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step(grad_scale=torch.tensor(4.0), found_inf=torch.tensor(0.0))  # state made
    params_before, state_before = [p.detach().clone() for p in params], state_snapshot(opt)
    grads = [torch.randn(p.shape) for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    for found_inf in (torch.tensor(0.0), None):
        with HostReads() as reads:
            opt.step(grad_scale=torch.tensor([scale]), found_inf=found_inf)
        if opt._scaler_in_kernel:
            assert reads.count == 0
        assert all(torch.equal(p, b) for p, b in zip(params, params_before, strict=True))
        assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))
        after = state_snapshot(opt)
        for key, state in state_before.items():
            for k, v in state.items():
                assert torch.equal(after[key][k], v) if torch.is_tensor(v) else after[key][k] == v, k
    with pytest.raises(ValueError, match=rf"grad_scale must be a finite float32 number > 0 .*, got {scale}"):
        opt.step(grad_scale=scale)  # a host number costs nothing to check: named where it is given
    opt.step(grad_scale=torch.tensor(2.0))
    assert not all(torch.equal(p, b) for p, b in zip(params, params_before, strict=True))


@pytest.mark.parametrize("factor", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", list(EVERY_OPTIMIZER))
def test_a_grad_factor_that_is_not_finite_is_named_before_anything_changes(name, factor):
    """``step_with_grad_factor`` (the fused pipeline's step, public) multiplied every gradient by NaN or inf inside
    the kernels: NaN weights and state, silently."""
    params = make_params(torch.float32)
    opt = EVERY_OPTIMIZER[name](params)
    for p in params:
        p.grad = torch.randn(p.shape)
    before = [p.detach().clone() for p in params]
    state_before = copy.deepcopy(opt.state_dict()["state"])  # empty, or Adagrad's state from construction
    with pytest.raises(ValueError, match=rf"grad_factor must be a finite number, got {factor}"):
        opt.step_with_grad_factor(factor)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    torch.testing.assert_close(opt.state_dict()["state"], state_before, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "ampkit"])
@pytest.mark.parametrize("found_inf", [2.0, float("nan"), -1.0])
@pytest.mark.parametrize("grad_scale", [None, 1.0], ids=["no_scale", "scale"])
@pytest.mark.parametrize("name", ["adam", "sgd", "adagrad", "rmsprop", "lamb"])
def test_any_nonzero_found_inf_skips_the_step_whoever_runs_it(name, grad_scale, found_inf, backend, monkeypatch):
    """GradScaler's ``found_inf`` is the sum of its per-device flags: 2.0 when two devices overflowed. torch's fused
    ops skip only on exactly 1.0 and count the step back by the flag's value, so under ``backend=torch`` (``auto`` on a
    GPU) a flag of 2.0 or NaN stepped on the inf gradients and left Adam's step count at -1."""
    monkeypatch.setenv("AMPKIT_FUSED_BACKEND", backend)
    params = make_params(torch.float32)
    opt = EVERY_OPTIMIZER[name](params)
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    scale = None if grad_scale is None else torch.tensor(grad_scale)
    opt.step(grad_scale=scale, found_inf=torch.tensor(found_inf))
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    for state in opt.state.values():
        if "step" in state:
            assert float(state["step"]) == 0.0


@pytest.mark.parametrize("argument", ["grad_scale", "found_inf"])
@pytest.mark.parametrize("name", list(EVERY_OPTIMIZER))
def test_a_scaler_tensor_on_the_meta_device_is_refused_by_name(name, argument):
    """A meta tensor holds no value to decide the step with: torch's copy out of it ('Cannot copy out of meta tensor')
    or ``item()`` named neither the argument nor why, and nothing moved either way."""
    params = make_params(torch.float32)
    opt = EVERY_OPTIMIZER[name](params)
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=rf"step\(\): {argument} is on the meta device"):
        opt.step(**{argument: torch.ones((), device="meta")})


@pytest.mark.parametrize(
    ("argument", "value", "message"),
    [
        ("grad_scale", torch.tensor(True), r"grad_scale must be a floating-point one-element tensor .* torch.bool"),
        ("grad_scale", True, r"grad_scale must be a number or a one-element float32 tensor, got True"),
        ("grad_scale", torch.tensor(1024), r"grad_scale must be a floating-point one-element tensor .* torch.int64"),
        ("grad_scale", torch.tensor(2 + 1j), r"grad_scale must be a floating-point .* torch.complex64"),
        ("found_inf", torch.tensor(1j), r"found_inf must be a real one-element tensor .* torch.complex64"),
    ],
)
@pytest.mark.parametrize("name", ["adam", "sgd", "lamb"])
def test_a_scaler_tensor_of_no_float_kind_is_refused_by_name(name, argument, value, message):
    """torch's fused optimizers read grad_scale and found_inf as float32 and refuse other dtypes: a bool scale was
    taken as a scale of 1 (the gradients stepped on 1024 times too large), a complex one or a complex flag of 1j
    (which skips nothing once its real part is read) lost a part silently."""
    params = make_params(torch.float32)
    opt = EVERY_OPTIMIZER[name](params)
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    with pytest.raises(TypeError, match=rf"step\(\): {message}"):
        opt.step(**{argument: value})
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
