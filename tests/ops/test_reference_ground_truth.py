"""The pure-PyTorch references themselves pinned to ground truth, in float64 on fresh random inputs.

The kernel tests compare every C++ kernel against ``ampkit.ops.reference``; these tests check that reference
against an independent source: torch's own algorithm where torch has one (``torch.optim`` single-tensor paths,
``F.layer_norm``/``F.rms_norm`` and their autograd backward, ``torch._amp_foreach_non_finite_check_and_unscale_``,
``torch.linalg.vector_norm``), each option combination the reference op accepts, over several steps. The reference
ops are driven here as the fused optimizers drive them: state starts at zero, ``maximize`` is a grad factor of -1,
SGD's first step seeds its momentum buffers.

LAMB, NovoGrad, AdamP and RMSprop-TF have no torch twin: each is checked on a small case worked out element by
element in plain Python floats from the published algorithm (Apex's ``multi_tensor_lamb``/``multi_tensor_novograd``
and their Python drivers, clovaai/AdamP, timm's ``RMSpropTF``), through the fused optimizer with the reference
(``AMPKIT_OPS=reference``) and with the kernel.
"""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from ampkit.ops.optimizers import FusedAdamP, FusedLAMB, FusedNovoGrad, FusedRMSpropTF
from ampkit.ops.reference import multi_tensor as ref_mt
from ampkit.ops.reference import norms as ref_norms
from ampkit.ops.reference import optimizers as ref

SHAPES = [(3,), (2, 5), (1,), (0,)]
STEPS = 5
TOL = dict(rtol=1e-12, atol=1e-14)


def fresh_params() -> list[torch.Tensor]:
    return [torch.randn(s, dtype=torch.float64) for s in SHAPES]


def zeros(params: list[torch.Tensor], value: float = 0.0) -> list[torch.Tensor]:
    return [torch.full_like(p, value) for p in params]


def counters(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros((), dtype=torch.float32) for _ in params]  # the fused optimizers' ``state["step"]``


def run_torch(make, params, grad_seq) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """``torch.optim``'s single-tensor (for-loop) implementation over ``grad_seq`` on float64 copies."""
    theirs = [torch.nn.Parameter(p.clone()) for p in params]
    opt = make(theirs)
    for grads in grad_seq:
        for p, g in zip(theirs, grads, strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in theirs], opt


def assert_matches_torch(ours: list[torch.Tensor], theirs: list[torch.Tensor], what: str) -> None:
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, i=i: f"{what}[{i}]: {m}")


def assert_state_matches(opt: torch.optim.Optimizer, key: str, ours: list) -> None:
    theirs = [opt.state[p][key] for p in opt.param_groups[0]["params"]]
    assert_matches_torch(ours, theirs, key)


def grads_for(params, steps=STEPS) -> list[list[torch.Tensor]]:
    return [[torch.randn_like(p) for p in params] for _ in range(steps)]


# ----------------------------------------------------------------------------------------------- optimizers


@pytest.mark.parametrize(
    "adam_w_mode,amsgrad,maximize,weight_decay",
    list(itertools.product([True, False], [False, True], [False, True], [0.0, 0.1])),
)
def test_adam_reference_is_torchs_adam_and_adamw(adam_w_mode, amsgrad, maximize, weight_decay):
    params = fresh_params()
    grad_seq = grads_for(params)
    lr, betas, eps = 1e-2, (0.8, 0.99), 1e-8
    ours = [p.clone() for p in params]
    m, v, vmax, steps = zeros(ours), zeros(ours), zeros(ours) if amsgrad else [], counters(ours)
    for grads in grad_seq:
        ref.adam_step(
            ours,
            [g.clone() for g in grads],
            m,
            v,
            vmax,
            [],
            steps,
            lr,
            *betas,
            eps,
            weight_decay,
            adam_w_mode,
            amsgrad,
            True,
            -1.0 if maximize else 1.0,
        )
    make = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    theirs, opt = run_torch(
        lambda p: make(
            p, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize, foreach=False
        ),
        params,
        grad_seq,
    )
    assert_matches_torch(ours, theirs, "params")
    assert_state_matches(opt, "exp_avg", m)
    assert_state_matches(opt, "exp_avg_sq", v)
    if amsgrad:
        assert_state_matches(opt, "max_exp_avg_sq", vmax)
    assert [float(s) for s in steps] == [float(STEPS)] * len(SHAPES)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_adam_reference_without_bias_correction_steps_on_the_raw_moments(adam_w_mode):
    """Apex's ``FusedAdam(bias_correction=False)``, which torch has no twin of: ``p -= lr * m / (sqrt(v) + eps)``
    with the moments as they are, worked out element by element in Python floats."""
    start, grad_seq = [0.5, -1.5, 2.0], [[0.3, -0.2, 0.1], [-0.4, 0.6, 0.05], [0.2, 0.2, -0.3]]
    lr, b1, b2, eps, wd = 1e-2, 0.8, 0.99, 1e-8, 0.1
    ours = [torch.tensor(start, dtype=torch.float64)]
    m, v, steps = zeros(ours), zeros(ours), counters(ours)
    for g in grad_seq:
        grads = [torch.tensor(g, dtype=torch.float64)]
        ref.adam_step(ours, grads, m, v, [], [], steps, lr, b1, b2, eps, wd, adam_w_mode, False, False, 1.0)
    want = []
    for i, x in enumerate(start):
        mi = vi = 0.0
        for g in (step[i] for step in grad_seq):
            if adam_w_mode:
                x *= 1 - lr * wd
            else:
                g += wd * x
            mi, vi = b1 * mi + (1 - b1) * g, b2 * vi + (1 - b2) * g * g
            x -= lr * mi / (math.sqrt(vi) + eps)
        want.append(x)
    torch.testing.assert_close(ours[0], torch.tensor(want, dtype=torch.float64), **TOL)


SGD_OPTIONS = [
    (momentum, dampening, nesterov, weight_decay, maximize)
    for momentum, dampening, nesterov, weight_decay, maximize in itertools.product(
        [0.0, 0.9], [0.0, 0.3], [False, True], [0.0, 0.01], [False, True]
    )
    if not nesterov or (momentum > 0 and dampening == 0)  # torch's (and FusedSGD's) rule for Nesterov
]


@pytest.mark.parametrize("momentum,dampening,nesterov,weight_decay,maximize", SGD_OPTIONS)
def test_sgd_reference_is_torchs_sgd(momentum, dampening, nesterov, weight_decay, maximize):
    params = fresh_params()
    grad_seq = grads_for(params)
    ours = [p.clone() for p in params]
    # Uninitialised on purpose: the first step must seed the buffers with the gradient, as torch clones it.
    buffers = zeros(ours, float("nan")) if momentum else []
    for step, grads in enumerate(grad_seq):
        ref.sgd_step(
            ours,
            [g.clone() for g in grads],
            buffers,
            [],
            0.1,
            weight_decay,
            momentum,
            dampening,
            nesterov,
            step == 0,
            -1.0 if maximize else 1.0,
        )
    theirs, opt = run_torch(
        lambda p: torch.optim.SGD(
            p,
            lr=0.1,
            momentum=momentum,
            dampening=dampening,
            nesterov=nesterov,
            weight_decay=weight_decay,
            maximize=maximize,
            foreach=False,
        ),
        params,
        grad_seq,
    )
    assert_matches_torch(ours, theirs, "params")
    if momentum:
        assert_state_matches(opt, "momentum_buffer", buffers)


@pytest.mark.parametrize(
    "lr_decay,weight_decay,initial,maximize",
    list(itertools.product([0.0, 0.05], [0.0, 0.1], [0.0, 0.5], [False, True])),
)
def test_adagrad_reference_is_torchs_adagrad(lr_decay, weight_decay, initial, maximize):
    params = fresh_params()
    grad_seq = grads_for(params)
    ours = [p.clone() for p in params]
    sums, steps = zeros(ours, initial), counters(ours)
    for grads in grad_seq:
        ref.adagrad_step(
            ours,
            [g.clone() for g in grads],
            sums,
            [],
            steps,
            0.1,
            lr_decay,
            weight_decay,
            1e-10,
            -1.0 if maximize else 1.0,
        )
    theirs, opt = run_torch(
        lambda p: torch.optim.Adagrad(
            p,
            lr=0.1,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            initial_accumulator_value=initial,
            eps=1e-10,
            maximize=maximize,
            foreach=False,
        ),
        params,
        grad_seq,
    )
    assert_matches_torch(ours, theirs, "params")
    assert_state_matches(opt, "sum", sums)


@pytest.mark.parametrize("rho,weight_decay,maximize", list(itertools.product([0.9, 0.5], [0.0, 0.1], [False, True])))
def test_adadelta_reference_is_torchs_adadelta(rho, weight_decay, maximize):
    params = fresh_params()
    grad_seq = grads_for(params)
    ours = [p.clone() for p in params]
    square_avgs, acc_deltas, steps = zeros(ours), zeros(ours), counters(ours)
    for grads in grad_seq:
        ref.adadelta_step(
            ours,
            [g.clone() for g in grads],
            square_avgs,
            acc_deltas,
            [],
            steps,
            0.5,
            rho,
            1e-6,
            weight_decay,
            -1.0 if maximize else 1.0,
        )
    theirs, opt = run_torch(
        lambda p: torch.optim.Adadelta(
            p, lr=0.5, rho=rho, eps=1e-6, weight_decay=weight_decay, maximize=maximize, foreach=False
        ),
        params,
        grad_seq,
    )
    assert_matches_torch(ours, theirs, "params")
    assert_state_matches(opt, "square_avg", square_avgs)
    assert_state_matches(opt, "acc_delta", acc_deltas)


@pytest.mark.parametrize(
    "centered,momentum,weight_decay,maximize",
    list(itertools.product([False, True], [0.0, 0.9], [0.0, 0.1], [False, True])),
)
def test_rmsprop_reference_is_torchs_rmsprop(centered, momentum, weight_decay, maximize):
    params = fresh_params()
    grad_seq = grads_for(params)
    ours = [p.clone() for p in params]
    square_avgs, grad_avgs, buffers = zeros(ours), zeros(ours) if centered else [], zeros(ours) if momentum else []
    steps = counters(ours)
    for grads in grad_seq:
        ref.rmsprop_step(
            ours,
            [g.clone() for g in grads],
            square_avgs,
            grad_avgs,
            buffers,
            [],
            steps,
            1e-2,
            0.9,
            1e-8,
            weight_decay,
            momentum,
            centered,
            -1.0 if maximize else 1.0,
        )
    theirs, opt = run_torch(
        lambda p: torch.optim.RMSprop(
            p,
            lr=1e-2,
            alpha=0.9,
            eps=1e-8,
            weight_decay=weight_decay,
            momentum=momentum,
            centered=centered,
            maximize=maximize,
            foreach=False,
        ),
        params,
        grad_seq,
    )
    assert_matches_torch(ours, theirs, "params")
    assert_state_matches(opt, "square_avg", square_avgs)
    if centered:
        assert_state_matches(opt, "grad_avg", grad_avgs)
    if momentum:
        assert_state_matches(opt, "momentum_buffer", buffers)


# ----------------------------------------------------------------------------------------------- norms


def _norm_inputs(normalized_shape, affine, transposed):
    x = torch.randn(4, 3, *normalized_shape, dtype=torch.float64)
    if transposed:  # a non-contiguous input (rows not adjacent in memory)
        x = torch.randn(3, 4, *normalized_shape, dtype=torch.float64).transpose(0, 1)
    w = torch.randn(normalized_shape, dtype=torch.float64) if affine else None
    b = torch.randn(normalized_shape, dtype=torch.float64) if affine else None
    return x, w, b


def _value_and_grads(fn, x, params, dy):
    """``fn``'s output and autograd's gradients of ``sum(out * dy)`` w.r.t. ``x`` and each parameter given."""
    leaves = [t.clone().requires_grad_() for t in (x, *params)]
    y = fn(*leaves)
    grads = torch.autograd.grad(y, leaves, dy)
    return y.detach(), grads


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("normalized_shape", [(7,), (3, 5), (1,)])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("transposed", [False, True])
def test_norm_references_are_torchs_norms_forward_and_backward(kind, normalized_shape, affine, transposed):
    eps = 1e-5
    x, w, b = _norm_inputs(normalized_shape, affine, transposed)
    dy = torch.randn(x.shape, dtype=torch.float64)
    if kind == "layer_norm":
        params = [w, b] if affine else []
        ours = _value_and_grads(lambda x, *wb: ref_norms.layer_norm(x, normalized_shape, *wb, eps=eps), x, params, dy)
        theirs = _value_and_grads(lambda x, *wb: F.layer_norm(x, normalized_shape, *wb, eps=eps), x, params, dy)
    else:
        params = [w] if affine else []
        ours = _value_and_grads(lambda x, *w: ref_norms.rms_norm(x, normalized_shape, *w, eps=eps), x, params, dy)
        theirs = _value_and_grads(lambda x, *w: F.rms_norm(x, normalized_shape, *w, eps=eps), x, params, dy)
    torch.testing.assert_close(ours[0], theirs[0], **TOL)
    for name, a, e in zip(["input", "weight", "bias"], ours[1], theirs[1], strict=False):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"grad of {n}: {m}")


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_norm_references_of_an_empty_batch_are_torchs(kind):
    x = torch.randn(0, 6, dtype=torch.float64)
    fn = ref_norms.layer_norm if kind == "layer_norm" else ref_norms.rms_norm
    torch.testing.assert_close(fn(x, (6,)), getattr(F, kind)(x, (6,)))


# ----------------------------------------------------------------------------------------------- multi-tensor ops

MT_SHAPES = [(3,), (0,), (4097,), (5, 7), (1,)]


def _mt_inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(s, dtype=torch.float64).to(dtype) for s in MT_SHAPES]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")])
def test_scale_reference_is_torchs_unscale_and_inf_check(dtype, bad):
    """``scale_`` is what ``GradScaler.unscale_`` runs: torch's ``_amp_foreach_non_finite_check_and_unscale_``."""
    inputs = _mt_inputs(dtype)
    if bad is not None:
        inputs[2][1234] = bad
    inv_scale = float(torch.tensor(1 / 3.0))  # GradScaler's float32 reciprocal, not a power of two
    ours, our_flag = [torch.empty_like(t) for t in inputs], torch.zeros(1)
    ref_mt.scale_(inputs, ours, inv_scale, our_flag)
    theirs, their_flag = [t.clone() for t in inputs], torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, their_flag, torch.tensor([inv_scale]))
    assert float(our_flag) == float(their_flag) == (0.0 if bad is None else 1.0)
    for a, e in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_l2norm_references_are_torchs_vector_norm(dtype):
    inputs = _mt_inputs(dtype)
    inputs[3] = inputs[3].t()  # non-contiguous
    total, per = ref_mt.l2norm(inputs, True)
    torch.testing.assert_close(per, torch.stack([torch.linalg.vector_norm(t) for t in inputs]), rtol=1e-6, atol=0)
    expected_total = torch.linalg.vector_norm(torch.cat([t.reshape(-1).double() for t in inputs]))
    torch.testing.assert_close(total.double(), expected_total, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=0)
    outputs, flag = [torch.empty_like(t) for t in inputs], torch.zeros(1)
    total, per = ref_mt.unscale_l2norm(inputs, outputs, 0.25, flag, True)
    torch.testing.assert_close(total.double(), expected_total * 0.25, rtol=1e-6, atol=0)
    assert all(torch.equal(o, t * 0.25) for o, t in zip(outputs, inputs, strict=True)) and float(flag) == 0


# ----------------------------------------------------------------------------------------------- no torch twin


def run_fused(make, weights: list[list], grad_seq: list[list[list]], ops: str, monkeypatch) -> list[list[float]]:
    """Step the fused optimizer ``make`` builds over float64 copies of ``weights`` (nested lists) with ``grad_seq``."""
    monkeypatch.setenv("AMPKIT_OPS", ops)
    params = [torch.nn.Parameter(torch.tensor(w, dtype=torch.float64)) for w in weights]
    opt = make(params)
    for grads in grad_seq:
        for p, g in zip(params, grads, strict=True):
            p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    return [p.detach().tolist() for p in params]


def assert_close_lists(actual: list, expected: list) -> None:
    """Each weight (nested lists) equal to its hand-computed value to float64 rounding."""
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(
            torch.tensor(a, dtype=torch.float64), torch.tensor(e, dtype=torch.float64), rtol=1e-13, atol=1e-15
        )


LAMB_OPTIONS = [  # adam_w_mode, weight_decay, use_nvlamb, grad_averaging, bias_correction, max_grad_norm
    (True, 0.01, False, True, True, 1.0),  # Apex's defaults: the global norm (2, then 1.0) is clipped to 1
    (False, 0.01, False, False, True, 10.0),  # L2 decay inside the moments, no clipping, no grad averaging
    (True, 0.0, True, True, False, 1.0),  # NVLAMB: the trust ratio without weight decay
    (True, 0.0, False, True, True, 1.0),  # no decay, no NVLAMB: plain lr
]


@pytest.mark.parametrize("ops", ["reference", "kernel"])
@pytest.mark.parametrize("adam_w_mode,wd,use_nvlamb,grad_averaging,bias_correction,max_grad_norm", LAMB_OPTIONS)
def test_lamb_on_hand_computed_steps(
    ops, adam_w_mode, wd, use_nvlamb, grad_averaging, bias_correction, max_grad_norm, monkeypatch
):
    """Apex FusedLAMB, two steps over two tensors: every gradient is divided by ``global_norm / max_grad_norm``
    when the norm of all of them exceeds max_grad_norm; stage 1 writes the Adam direction (plus ``wd * p`` in AdamW
    mode; L2 mode adds it to the gradient); stage 2 scales lr by the trust ratio ``|p| / |u|`` when weight decay
    is non-zero or use_nvlamb, except for a zero-norm weight (the second tensor), which takes lr alone."""
    lr, (b1, b2), eps = 0.1, (0.9, 0.999), 1e-6
    weights = [[3.0, 4.0], [0.0]]
    grad_seq = [[[1.2, 0.0], [1.6]], [[-0.6, 0.8], [0.0]]]
    m = [[0.0] * len(w) for w in weights]
    v = [[0.0] * len(w) for w in weights]
    beta3 = 1 - b1 if grad_averaging else 1.0
    p = [list(w) for w in weights]
    for t, grads in enumerate(grad_seq, start=1):
        norm = math.sqrt(sum(x * x for g in grads for x in g))
        clip = norm / max_grad_norm if norm > max_grad_norm else 1.0
        bc1, bc2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1.0, 1.0)
        for i, g in enumerate(grads):
            u = []
            for j, gj in enumerate(g):
                scaled = gj / clip + (0.0 if adam_w_mode else wd * p[i][j])
                m[i][j] = b1 * m[i][j] + beta3 * scaled
                v[i][j] = b2 * v[i][j] + (1 - b2) * scaled * scaled
                u.append(m[i][j] / bc1 / (math.sqrt(v[i][j] / bc2) + eps) + (wd * p[i][j] if adam_w_mode else 0.0))
            p_norm, u_norm = math.sqrt(sum(x * x for x in p[i])), math.sqrt(sum(x * x for x in u))
            trusted = (wd != 0 or use_nvlamb) and p_norm != 0 and u_norm != 0
            ratio = lr * p_norm / u_norm if trusted else lr
            p[i] = [pj - ratio * uj for pj, uj in zip(p[i], u, strict=True)]
    make = functools.partial(
        FusedLAMB,
        lr=lr,
        betas=(b1, b2),
        eps=eps,
        weight_decay=wd,
        adam_w_mode=adam_w_mode,
        use_nvlamb=use_nvlamb,
        grad_averaging=grad_averaging,
        bias_correction=bias_correction,
        max_grad_norm=max_grad_norm,
    )
    assert_close_lists(run_fused(make, weights, grad_seq, ops, monkeypatch), p)


NOVOGRAD_OPTIONS = [  # reg_inside_moment, norm_type, init_zero, grad_averaging, bias_correction
    (False, 2, False, True, True),  # Apex's defaults
    (True, 2, False, True, True),
    (False, 0, True, False, True),
    (True, 0, False, True, False),
    (False, 2, True, True, False),
]


@pytest.mark.parametrize("ops", ["reference", "kernel"])
@pytest.mark.parametrize("reg_inside_moment,norm_type,init_zero,grad_averaging,bias_correction", NOVOGRAD_OPTIONS)
def test_novograd_on_hand_computed_steps(
    ops, reg_inside_moment, norm_type, init_zero, grad_averaging, bias_correction, monkeypatch
):
    """Apex FusedNovoGrad, two steps on one tensor. Its per-tensor norm (L2, or max-abs with norm_type=0) state
    starts at the first step's norm (at 0 with init_zero) and is blended every step as ``sqrt(b2 * v^2 + (1 - b2) *
    n^2)`` (``b2 * v + (1 - b2) * n`` for max-abs); the denominator is ``v / sqrt(1 - b2^t) + eps``; the moment
    takes ``1 - b1`` of the gradient with grad_averaging, all of it without."""
    lr, (b1, b2), eps, wd = 0.1, (0.95, 0.98), 1e-8, 0.001
    p, m, v = [3.0, 4.0], [0.0, 0.0], None
    grad_seq = [[0.3, 0.4]], [[-1.2, 0.5]]
    beta3 = 1 - b1 if grad_averaging else 1.0
    for t, (g,) in enumerate(grad_seq, start=1):
        n = math.hypot(*g) if norm_type == 2 else max(abs(x) for x in g)
        if v is None:
            v = 0.0 if init_zero else n
        v = math.sqrt(b2 * v * v + (1 - b2) * n * n) if norm_type == 2 else b2 * v + (1 - b2) * n
        bc1, bc2 = (1 - b1**t, math.sqrt(1 - b2**t)) if bias_correction else (1.0, 1.0)
        denom = v / bc2 + eps
        for j in range(2):
            if reg_inside_moment:  # Apex's moment mode 0: decay inside the moment
                m[j] = b1 * m[j] + beta3 * (g[j] / denom + wd * p[j])
                p[j] -= lr * m[j] / bc1
            else:
                m[j] = b1 * m[j] + beta3 * g[j]
                p[j] -= lr * (m[j] / bc1 / denom + wd * p[j])
    make = functools.partial(
        FusedNovoGrad,
        lr=lr,
        betas=(b1, b2),
        eps=eps,
        weight_decay=wd,
        reg_inside_moment=reg_inside_moment,
        norm_type=norm_type,
        init_zero=init_zero,
        grad_averaging=grad_averaging,
        bias_correction=bias_correction,
    )
    assert_close_lists(run_fused(make, [[3.0, 4.0]], list(grad_seq), ops, monkeypatch), [p])


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def _minus_radial(q: list[float], w: list[float], eps: float) -> list[float]:
    """``q`` less its part along the unit weight ``w / (|w| + eps)``: AdamP's projection."""
    unit = [x / (math.sqrt(_dot(w, w)) + eps) for x in w]
    radial = _dot(unit, q)
    return [qi - u * radial for qi, u in zip(q, unit, strict=True)]


ADAMP_CASES = {  # a 2x2 weight and its gradient
    "channel": ([[1.0, 2.0], [3.0, -1.0]], [[2.0, -1.0], [1.0, 3.0]]),  # each row's gradient orthogonal to the row
    "layer": ([[2.0, 1.0], [1.0, 1.0]], [[1.0, 0.0], [0.0, -2.0]]),  # orthogonal to the whole weight only
    "none": ([[1.0, 2.0], [3.0, 4.0]], [[1.0, 1.0], [1.0, 1.0]]),
}


@pytest.mark.parametrize("ops", ["reference", "kernel"])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("case", list(ADAMP_CASES))
def test_adamp_on_a_hand_computed_step(ops, nesterov, case, monkeypatch):
    """clovaai/AdamP, one step. A weight whose every row has ``|cos(g, row)| < delta / sqrt(row length)`` has each
    row's radial part taken out of its Adam direction (channel-wise); failing that, one with ``|cos(g, w)| < delta /
    sqrt(numel)`` has the whole weight's (layer-wise); either way its weight decay is scaled by wd_ratio. Otherwise,
    and for the 1-D weight, plain Adam with the full decay. Nesterov's direction is ``b1 * m + (1 - b1) * g``."""
    lr, (b1, b2), eps, wd, wd_ratio, delta = 0.1, (0.9, 0.999), 1e-8, 0.1, 0.5, 0.1
    rows, grad_rows = ADAMP_CASES[case]

    def direction(g: list[float]) -> list[float]:
        m = [(1 - b1) * x for x in g]
        denom = [math.sqrt((1 - b2) * x * x) / math.sqrt(1 - b2) + eps for x in g]
        first = [b1 * mi + (1 - b1) * x for mi, x in zip(m, g, strict=True)] if nesterov else m
        return [f / d for f, d in zip(first, denom, strict=True)]

    def cosine(a: list[float], b: list[float]) -> float:
        return abs(_dot(a, b)) / math.sqrt(_dot(a, a) * _dot(b, b))

    flat, flat_g = [x for r in rows for x in r], [x for r in grad_rows for x in r]
    q = [direction(g) for g in grad_rows]
    if max(cosine(r, g) for r, g in zip(rows, grad_rows, strict=True)) < delta / math.sqrt(2):
        branch, ratio = "channel", wd_ratio
        q = [_minus_radial(qi, r, eps) for qi, r in zip(q, rows, strict=True)]
    elif cosine(flat, flat_g) < delta / math.sqrt(4):
        branch, ratio = "layer", wd_ratio
        projected = _minus_radial([x for r in q for x in r], flat, eps)
        q = [projected[:2], projected[2:]]
    else:
        branch, ratio = "none", 1.0
    assert branch == case
    plain = [direction(g) for g in grad_rows]
    moved = max(abs(a - b) for qa, qb in zip(q, plain, strict=True) for a, b in zip(qa, qb, strict=True))
    assert (moved > 0.01) == (case != "none")  # the projection changes the direction, where it applies
    expected = [
        [w * (1 - lr * wd * ratio) - lr / (1 - b1) * qi for w, qi in zip(r, qr, strict=True)]
        for r, qr in zip(rows, q, strict=True)
    ]
    v, h = [0.5, -0.5], [1.0, 2.0]
    v_new = [vi * (1 - lr * wd) - lr / (1 - b1) * qi for vi, qi in zip(v, direction(h), strict=True)]
    make = functools.partial(
        FusedAdamP, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, wd_ratio=wd_ratio, delta=delta, nesterov=nesterov
    )
    got = run_fused(make, [rows, v], [[grad_rows, h]], ops, monkeypatch)
    assert_close_lists(got, [expected, v_new])


@pytest.mark.parametrize("ops", ["reference", "kernel"])
@pytest.mark.parametrize("centered,decoupled_decay,lr_in_momentum", [(False, False, True), (True, True, False)])
def test_rmsprop_tf_on_hand_computed_steps(ops, centered, decoupled_decay, lr_in_momentum, monkeypatch):
    """timm's RMSpropTF, two steps: square_avg starts at one (torch's at zero) and moves by
    ``(1 - alpha) * (g^2 - square_avg)``; eps sits inside the square root; with lr_in_momentum the buffer holds
    ``lr * g / avg`` and the weight moves by the buffer itself."""
    lr, alpha, eps, wd, mom = 0.01, 0.9, 1e-3, 0.1, 0.9
    p, sq, ga, buf = [1.5, -2.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]
    grad_seq = [[[0.5, -3.0]], [[-1.0, 0.25]]]
    for (g,) in grad_seq:
        for j in range(2):
            gj = g[j]
            if decoupled_decay:
                p[j] *= 1 - lr * wd
            else:
                gj += wd * p[j]
            sq[j] += (1 - alpha) * (gj * gj - sq[j])
            if centered:
                ga[j] += (1 - alpha) * (gj - ga[j])
            avg = math.sqrt(sq[j] - ga[j] * ga[j] + eps)
            if lr_in_momentum:
                buf[j] = mom * buf[j] + lr * gj / avg
                p[j] -= buf[j]
            else:
                buf[j] = mom * buf[j] + gj / avg
                p[j] -= lr * buf[j]
    make = functools.partial(
        FusedRMSpropTF,
        lr=lr,
        alpha=alpha,
        eps=eps,
        weight_decay=wd,
        momentum=mom,
        centered=centered,
        decoupled_decay=decoupled_decay,
        lr_in_momentum=lr_in_momentum,
    )
    assert_close_lists(run_fused(make, [[1.5, -2.0]], grad_seq, ops, monkeypatch), [p])


@pytest.mark.parametrize("ops", ["reference", "kernel"])
@pytest.mark.parametrize("lr_in_momentum", [True, False])
def test_rmsprop_tf_momentum_carries_the_rate_it_was_built_with_when_lr_in_momentum(ops, lr_in_momentum, monkeypatch):
    """Under a schedule the two forms part: with lr_in_momentum the buffer keeps each step's own rate (timm's
    RMSpropTF), without it the whole buffer moves at the current rate. The rate doubles between two steps here."""
    monkeypatch.setenv("AMPKIT_OPS", ops)
    alpha, eps, mom, rates, grads = 0.9, 1e-3, 0.9, [0.01, 0.02], [0.5, -1.0]
    w, sq, buf = 1.5, 1.0, 0.0
    for lr, g in zip(rates, grads, strict=True):
        sq += (1 - alpha) * (g * g - sq)
        if lr_in_momentum:
            buf = mom * buf + lr * g / math.sqrt(sq + eps)
            w -= buf
        else:
            buf = mom * buf + g / math.sqrt(sq + eps)
            w -= lr * buf
    param = torch.nn.Parameter(torch.tensor([1.5], dtype=torch.float64))
    opt = FusedRMSpropTF([param], lr=rates[0], alpha=alpha, eps=eps, momentum=mom, lr_in_momentum=lr_in_momentum)
    for lr, g in zip(rates, grads, strict=True):
        opt.param_groups[0]["lr"] = lr
        param.grad = torch.tensor([g], dtype=torch.float64)
        opt.step()
    assert_close_lists([param.detach().tolist()], [[w]])
