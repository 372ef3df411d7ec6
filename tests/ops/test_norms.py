"""Fused LayerNorm/RMSNorm kernels against the pure-PyTorch reference computed in float64.

Every test runs with ``AMPKIT_OPS=kernel`` (a broken build fails instead of silently testing the
reference against itself) and ``AMPKIT_FUSED_BACKEND=ampkit`` (ampkit's kernels even where torch's would run
them; ``test_norm_backend.py`` covers that routing), on fresh random inputs.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.autograd import forward_ad

from ampkit.ops import norms
from ampkit.ops.norms import (
    FusedLayerNorm,
    FusedRMSNorm,
    MixedFusedLayerNorm,
    MixedFusedRMSNorm,
    batch_norm_backward_reduce,
    batch_norm_stats,
    fused_layer_norm,
    fused_layer_norm_affine,
    fused_rms_norm,
    fused_rms_norm_affine,
    mixed_dtype_fused_layer_norm_affine,
    mixed_dtype_fused_rms_norm_affine,
)
from ampkit.ops.reference import norms as reference

EPS = 1e-5


@pytest.fixture(autouse=True)
def kernel_mode(monkeypatch):
    monkeypatch.setenv("AMPKIT_OPS", "kernel")
    monkeypatch.setenv("AMPKIT_FUSED_BACKEND", "ampkit")


def _weight(shape, dtype=torch.float32):
    """Weights bounded away from zero, so memory_efficient's (y - b) / w stays well conditioned."""
    magnitude = torch.rand(shape, dtype=torch.float64) + 0.5
    sign = torch.randint(0, 2, shape, dtype=torch.float64) * 2 - 1
    return (magnitude * sign).to(dtype)


def _run(kind, x, w, b, normalized_shape, memory_efficient=False, mixed=False):
    """Forward + backward through ampkit's fused op; returns (y, dy, grads of x, w, b)."""
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_() if w is not None else None
    b = b.detach().requires_grad_() if b is not None else None
    if kind == "layer":
        if w is None:
            y = fused_layer_norm(x, normalized_shape, EPS, memory_efficient)
        elif mixed:
            y = mixed_dtype_fused_layer_norm_affine(x, w, b, normalized_shape, EPS, memory_efficient)
        else:
            y = fused_layer_norm_affine(x, w, b, normalized_shape, EPS, memory_efficient)
    else:
        if w is None:
            y = fused_rms_norm(x, normalized_shape, EPS, memory_efficient)
        elif mixed:
            y = mixed_dtype_fused_rms_norm_affine(x, w, normalized_shape, EPS, memory_efficient)
        else:
            y = fused_rms_norm_affine(x, w, normalized_shape, EPS, memory_efficient)
    dy = torch.randn_like(y)
    y.backward(dy)
    return y.detach(), dy, (x.grad, None if w is None else w.grad, None if b is None else b.grad)


def _reference64(kind, x, w, b, normalized_shape, dy):
    """The reference in float64: output and grads of x, w, b."""
    x = x.detach().double().requires_grad_()
    w = w.detach().double().requires_grad_() if w is not None else None
    b = b.detach().double().requires_grad_() if b is not None else None
    if kind == "layer":
        y = reference.layer_norm(x, normalized_shape, w, b, EPS)
    else:
        y = reference.rms_norm(x, normalized_shape, w, EPS)
    y.backward(dy.double())
    return y.detach(), (x.grad, None if w is None else w.grad, None if b is None else b.grad)


def _assert_matches(kind, x, w, b, normalized_shape, tol, memory_efficient=False, mixed=False):
    if kind == "rms":
        b = None
    y, dy, grads = _run(kind, x, w, b, normalized_shape, memory_efficient, mixed)
    y_ref, grads_ref = _reference64(kind, x, w, b, normalized_shape, dy)
    expected_dtype = w.dtype if mixed else x.dtype
    assert y.dtype == expected_dtype and y.shape == x.shape
    torch.testing.assert_close(y.double(), y_ref, **tol["y"])
    names = ("grad_input", "grad_weight", "grad_bias")
    for name, got, want, like in zip(names, grads, grads_ref, (x, w, b), strict=True):
        if like is None:
            continue
        assert got is not None and got.dtype == like.dtype, name
        # Weight/bias grads sum over rows: scale the tolerance by the number of rows.
        rows = x.numel() // like.numel() if name != "grad_input" else 1
        atol = tol["grad"]["atol"] * max(1.0, rows**0.5)
        torch.testing.assert_close(got.double(), want, rtol=tol["grad"]["rtol"], atol=atol, msg=name)


FP32_TOL = {"y": {"rtol": 1e-5, "atol": 1e-5}, "grad": {"rtol": 1e-4, "atol": 1e-4}}

SHAPES = [
    ((4, 1), (1,)),
    ((6, 3), (3,)),
    ((5, 1000), (1000,)),
    ((3, 1023), (1023,)),
    ((2, 3, 17), (3, 17)),
    ((1037, 31), (31,)),
    ((7,), (7,)),
]


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("shape,normalized_shape", SHAPES)
@pytest.mark.parametrize("affine", [True, False])
def test_fp32_matches_float64_reference(kind, shape, normalized_shape, affine):
    x = torch.randn(shape) * 3 + 1
    w = _weight(normalized_shape) if affine else None
    b = torch.randn(normalized_shape) if affine else None
    _assert_matches(kind, x, w, b, normalized_shape, FP32_TOL)


FP64_TOL = {"y": {"rtol": 1e-12, "atol": 1e-12}, "grad": {"rtol": 1e-11, "atol": 1e-11}}


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("n", [1, 3, 4097])
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_float64_kernel_matches_float64_reference(kind, n, memory_efficient):
    """The float64 kernel is the reference's arithmetic: rows of odd lengths (a single element, shorter than a
    vector, one past a multiple of it), one of them read through a transposed (non-contiguous) view."""
    x = torch.randn(9, n, dtype=torch.float64) * 3 + 1
    transposed = (torch.randn(n, 5, dtype=torch.float64) * 2).t()
    w, b = _weight((n,), torch.float64), torch.randn(n, dtype=torch.float64)
    for inputs in (x, transposed):
        _assert_matches(kind, inputs, w, b, (n,), FP64_TOL, memory_efficient)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("affine", [True, False])
def test_memory_efficient_matches_float64_reference(kind, affine):
    x = torch.randn(33, 257)
    w = _weight((257,)) if affine else None
    b = torch.randn(257) if affine else None
    _assert_matches(kind, x, w, b, (257,), FP32_TOL, memory_efficient=True)


HALF_TOL = {
    torch.float16: {"y": {"rtol": 2e-3, "atol": 2e-3}, "grad": {"rtol": 4e-3, "atol": 4e-3}},
    torch.bfloat16: {"y": {"rtol": 1.6e-2, "atol": 1.6e-2}, "grad": {"rtol": 3e-2, "atol": 3e-2}},
}


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", ["same", torch.float32])
@pytest.mark.parametrize("mixed", [False, True])
def test_half_inputs_accumulate_in_fp32(kind, dtype, weight_dtype, mixed):
    weight_dtype = dtype if weight_dtype == "same" else weight_dtype
    x = (torch.randn(65, 515) * 2).to(dtype)
    w = _weight((515,), weight_dtype)
    b = torch.randn(515).to(weight_dtype)
    tol = HALF_TOL[dtype]
    if mixed and weight_dtype == torch.float32:
        # fp32 output: only the inputs were rounded, so the output is as exact as fp32's.
        tol = {"y": FP32_TOL["y"], "grad": tol["grad"]}
    _assert_matches(kind, x, w, b, (515,), tol, mixed=mixed)


def _tolerance(dtype):
    return HALF_TOL.get(dtype, FP32_TOL)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # F.rms_norm's, asked for its dtype
@pytest.mark.parametrize("ops", ["kernel", "reference"])
@pytest.mark.parametrize(
    ("kind", "mixed"), [("rms", False), ("rms", True), ("layer", True)], ids=["rms", "mixed_rms", "mixed_layer"]
)
@pytest.mark.parametrize(
    ("dtype", "weight_dtype"),
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.float64, torch.float32),
        (torch.float64, torch.bfloat16),
        (torch.float16, torch.bfloat16),
        (torch.bfloat16, torch.float64),
    ],
)
def test_a_weight_in_another_dtype_than_the_input_is_taken_as_torchs_rms_norm_takes_it(
    monkeypatch, ops, kind, mixed, dtype, weight_dtype
):
    """``F.rms_norm``/``nn.RMSNorm`` take a weight of any floating dtype (float32 activations against a bf16 model's
    weights) and answer in the input's dtype; FusedRMSNorm refused it. The Mixed* norms answer in the weight's
    dtype, as Apex's kernels do for a float32 input with a half weight. Gradients come back in each one's dtype."""
    monkeypatch.setenv("AMPKIT_OPS", ops)
    x = (torch.randn(65, 515) * 2).to(dtype)
    w = _weight((515,), weight_dtype)
    b = torch.randn(515).to(weight_dtype)
    output_dtype = weight_dtype if mixed else dtype
    loosest = max((dtype, weight_dtype), key=lambda d: _tolerance(d)["grad"]["atol"])
    tol = {"y": _tolerance(output_dtype)["y"], "grad": _tolerance(loosest)["grad"]}
    _assert_matches(kind, x, w, b, (515,), tol, mixed=mixed)
    if not mixed:
        assert F.rms_norm(x, (515,), w, EPS).dtype == fused_rms_norm_affine(x, w, 515, EPS).dtype == dtype


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_efficient_equals_plain(kind, dtype):
    # Fixed inputs: drawn from whatever RNG state earlier tests left, about 5% of them (measured over 200 seeds)
    # put a bf16 LayerNorm weight gradient past the tolerance, and the suite failed by test order.
    torch.manual_seed(0)
    x = torch.randn(40, 96).to(dtype)
    w = _weight((96,), dtype)
    b = torch.randn(96).to(dtype) if kind == "layer" else None
    y0, dy, g0 = _run(kind, x, w, b, (96,), memory_efficient=False)
    x1, w1 = x.detach().requires_grad_(), w.detach().requires_grad_()
    b1 = b.detach().requires_grad_() if b is not None else None
    if kind == "layer":
        y1 = fused_layer_norm_affine(x1, w1, b1, 96, EPS, memory_efficient=True)
    else:
        y1 = fused_rms_norm_affine(x1, w1, 96, EPS, memory_efficient=True)
    y1.backward(dy)
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    # Recomputing xhat from the rounded output costs precision in bf16, not in fp32.
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 5e-2, "atol": 5e-2}
    for got, want in zip((x1.grad, w1.grad, None if b1 is None else b1.grad), g0, strict=True):
        if want is not None:
            torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_gradcheck_float64(memory_efficient):
    x = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    w = _weight((3, 5), torch.float64).requires_grad_()
    b = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    shape = (3, 5)
    assert torch.autograd.gradcheck(
        lambda x, w, b: fused_layer_norm_affine(x, w, b, shape, EPS, memory_efficient), (x, w, b)
    )
    assert torch.autograd.gradcheck(lambda x: fused_layer_norm(x, shape, EPS, memory_efficient), (x,))
    assert torch.autograd.gradcheck(lambda x, w: fused_rms_norm_affine(x, w, shape, EPS, memory_efficient), (x, w))
    assert torch.autograd.gradcheck(lambda x: fused_rms_norm(x, shape, EPS, memory_efficient), (x,))


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_non_contiguous_input_is_made_contiguous(kind):
    base = torch.randn(64, 2 * 129)
    x = base[:, ::2]
    assert not x.is_contiguous()
    w, b = _weight((129,)), torch.randn(129)
    _assert_matches(kind, x, w, b, (129,), FP32_TOL)
    transposed = torch.randn(129, 50).t()
    _assert_matches(kind, transposed, w, b, (129,), FP32_TOL)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("position", ["first", "middle", "last"])
def test_non_finite_input_poisons_only_its_row(kind, bad, position):
    n = 37
    x = torch.randn(5, n)
    col = {"first": 0, "middle": n // 2, "last": n - 1}[position]
    x[2, col] = bad
    w, b = _weight((n,)), torch.randn(n) if kind == "layer" else None
    y, dy, (dx, dw, db) = _run(kind, x, w, b, (n,))
    y_ref, (dx_ref, dw_ref, db_ref) = _reference64(kind, x, w, b, (n,), dy)
    clean = [0, 1, 3, 4]
    torch.testing.assert_close(y[clean].double(), y_ref[clean], **FP32_TOL["y"])
    torch.testing.assert_close(dx[clean].double(), dx_ref[clean], **FP32_TOL["grad"])
    # The poisoned row is non-finite exactly where the reference's is, and so are the param grads.
    assert torch.equal(y[2].isfinite(), y_ref[2].isfinite())
    assert not y[2].isfinite().all()
    assert torch.equal(dw.isfinite(), dw_ref.isfinite())
    if db is not None:
        torch.testing.assert_close(db.double(), db_ref, **FP32_TOL["grad"])


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_float16_kernel_is_the_float32_kernel_rounded_once(kind, monkeypatch):
    """Half rows convert to float and back with F16C (round to nearest-even): the fp16 kernel gives the fp32
    kernel's result on the same values rounded once, bit for bit, with inf, nan, overflow past 65504 and
    subnormal outputs in the rows."""
    monkeypatch.setenv("AMPKIT_FUSED_BACKEND", "ampkit")  # auto hands fp16 LayerNorm on the CPU to torch
    torch.manual_seed(0)
    n = 515
    x = (torch.randn(37, n) * 3).half()
    x[3, 7], x[5, 0] = float("inf"), float("nan")
    w = _weight((n,), torch.float16).detach()
    w[:4] = torch.tensor([3e4, -3e4, 1e-6, -1e-6])  # outputs past fp16's range, and subnormal ones
    b = torch.randn(n).half() if kind == "layer" else None
    dy = torch.randn(37, n).half()
    results = {}
    for dtype in (torch.float16, torch.float32):
        xs, ws = (t.detach().to(dtype).requires_grad_() for t in (x, w))
        bs = b.detach().to(dtype).requires_grad_() if b is not None else None
        if kind == "layer":
            y = fused_layer_norm_affine(xs, ws, bs, n, EPS)
        else:
            y = fused_rms_norm_affine(xs, ws, n, EPS)
        y.backward(dy.to(dtype))
        results[dtype] = [y.detach(), xs.grad, ws.grad, bs.grad if bs is not None else None]
    assert not results[torch.float16][0].isfinite().all()  # the cases above are there
    assert (results[torch.float16][0].abs() < 6.2e-5).logical_and(results[torch.float16][0] != 0).any()
    names = ("y", "dx", "dw", "db")
    for name, half, single in zip(names, results[torch.float16], results[torch.float32], strict=True):
        if half is not None:
            differ = (half != single.half()) & ~(half.isnan() & single.half().isnan())
            assert not differ.any(), (
                f"{name} differs at {differ.nonzero()[:4].tolist()}: fp16 kernel {half[differ][:4].tolist()}, "
                f"fp32 kernel rounded {single.half()[differ][:4].tolist()} (fp32 {single[differ][:4].tolist()})"
            )


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_empty_batch(kind):
    x = torch.randn(0, 8)
    w, b = _weight((8,)), torch.randn(8)
    y, _, (dx, dw, db) = _run(kind, x, w, b if kind == "layer" else None, (8,))
    assert y.shape == (0, 8) and dx.shape == (0, 8)
    assert torch.equal(dw, torch.zeros(8))
    if kind == "layer":
        assert torch.equal(db, torch.zeros(8))


def test_many_rows_split_across_threads():
    x = torch.randn(4099, 64)
    w, b = _weight((64,)), torch.randn(64)
    for kind in ("layer", "rms"):
        _assert_matches(kind, x, w, b, (64,), FP32_TOL)


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "theirs, ours",
    [
        (lambda x: F.layer_norm(x, (4,)), lambda x: fused_layer_norm(x, (4,))),  # shape does not match the input
        (lambda x: F.rms_norm(x, (4,)), lambda x: fused_rms_norm(x, (4,))),
        (  # a weight of another shape
            lambda x: F.layer_norm(x, (3,), torch.ones(4), torch.zeros(4)),
            lambda x: fused_layer_norm_affine(x, torch.ones(4), torch.zeros(4), (3,)),
        ),
        (  # a weight of another dtype
            lambda x: F.layer_norm(x, (3,), torch.ones(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)),
            lambda x: fused_layer_norm_affine(
                x, torch.ones(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64), (3,)
            ),
        ),
        (lambda x: F.layer_norm(x.long(), (3,)), lambda x: fused_layer_norm(x.long(), (3,))),  # an integer input
    ],
)
def test_what_torchs_norms_refuse_with_a_runtime_error_ours_refuse_with_one_too(theirs, ours):
    """Code written against F.layer_norm/F.rms_norm catches RuntimeError (torch's error for a bad shape or dtype):
    ours name the bad argument and are RuntimeErrors as well as ValueError/TypeError."""
    x = torch.randn(2, 3)
    with pytest.raises((RuntimeError, NotImplementedError)):  # NotImplementedError: torch's for an integer input
        theirs(x)
    with pytest.raises(RuntimeError, match=r"fused_(layer|rms)_norm(_affine)?: .*(normalized_shape|weight|input)"):
        ours(x)


def test_wrong_normalized_shape_is_named():
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match=r"normalized_shape \[5\] does not match .*\[4, 6\]"):
        fused_layer_norm(x, 5)
    with pytest.raises(ValueError, match="normalized_shape"):
        fused_rms_norm(x, (2, 4, 6))
    with pytest.raises(ValueError, match="at least one dimension"):
        fused_layer_norm(x, ())
    with pytest.raises(ValueError, match=r"sizes >= 0, got \[-6\]"):
        FusedLayerNorm(-6)


def test_an_empty_or_negative_normalized_shape_and_a_non_number_eps_raise_torchs_exception_types():
    """torch's norms raise RuntimeError for ``normalized_shape=()`` and a negative size, and TypeError for an eps that
    is not a number: ours raised a plain ValueError, which code written against torch's norms does not catch."""
    x = torch.randn(2, 6)
    with pytest.raises(RuntimeError):
        F.layer_norm(x, ())
    with pytest.raises(TypeError):
        F.layer_norm(x, (6,), eps="1e-5")
    for call in (lambda: fused_layer_norm(x, ()), lambda: fused_rms_norm(x, []), lambda: FusedRMSNorm(())):
        with pytest.raises(RuntimeError, match="normalized_shape must name at least one dimension"):
            call()
    for call in (lambda: FusedLayerNorm(-6), lambda: FusedRMSNorm((2, -3))):
        with pytest.raises(RuntimeError, match=r"normalized_shape must hold sizes >= 0, got \[.*-\d\]"):
            call()
    for call in (lambda: FusedLayerNorm(6, eps="1e-5"), lambda: fused_rms_norm(x, 6, eps=[1e-5])):
        with pytest.raises(TypeError, match=r"eps must be a finite number >= 0, got .* \(a (str|list)\)") as raised:
            call()
        assert isinstance(raised.value, ValueError)  # as before, for code catching that


def test_torchs_fourth_positional_argument_is_not_taken_as_memory_efficient():
    """``nn.RMSNorm``'s fourth argument is ``device``; here, as in Apex, it is ``memory_efficient``, and a truthy
    "cpu" built a memory-efficient norm."""
    with pytest.raises(TypeError, match=r"FusedRMSNorm: memory_efficient must be True or False, got 'cpu' .*keyword"):
        FusedRMSNorm(64, None, True, "cpu")
    with pytest.raises(TypeError, match=r"FusedLayerNorm: memory_efficient must be True or False, got None"):
        FusedLayerNorm(64, 1e-5, True, None)
    assert FusedLayerNorm(64, 1e-5, True, 1).memory_efficient  # Apex-era 0/1 flags still work


@pytest.mark.parametrize("value", ["False", "True", 2, None])
def test_a_switch_that_is_not_true_or_false_is_refused_by_every_norm(value):
    """torch's norms read ``elementwise_affine`` and ``bias`` by truthiness, so ``elementwise_affine="False"`` (a
    config read as text) built an affine norm; here, as for ampkit's other switches, the norm names the value."""
    builds = {
        "FusedLayerNorm: elementwise_affine": lambda: FusedLayerNorm(6, elementwise_affine=value),
        "FusedLayerNorm: bias": lambda: FusedLayerNorm(6, bias=value),
        "FusedRMSNorm: elementwise_affine": lambda: FusedRMSNorm(6, elementwise_affine=value),
        "MixedFusedLayerNorm: elementwise_affine": lambda: MixedFusedLayerNorm(6, elementwise_affine=value),
        "MixedFusedRMSNorm: elementwise_affine": lambda: MixedFusedRMSNorm(6, elementwise_affine=value),
        "MixedFusedRMSNorm: memory_efficient": lambda: MixedFusedRMSNorm(6, memory_efficient=value),
        "fused_layer_norm: memory_efficient": lambda: fused_layer_norm(torch.randn(2, 6), 6, 1e-5, value),
        "fused_rms_norm_affine: memory_efficient": (
            lambda: fused_rms_norm_affine(torch.randn(2, 6), torch.ones(6), 6, 1e-5, value)
        ),
    }
    for where, build in builds.items():
        # the Mixed norms warn that they take no elementwise_affine (Apex's warning) before checking it
        with warnings.catch_warnings(action="ignore"), pytest.raises(TypeError, match=rf"{where} must be") as raised:
            build()
        assert f"must be True or False, got {value!r}" in str(raised.value)
        assert isinstance(raised.value, ValueError)  # ampkit's switch error is both, as its other switches'
    plain = FusedLayerNorm(6, elementwise_affine=np.bool_(False), bias=0)
    assert plain.weight is None and plain.elementwise_affine is False  # numpy's bool_ and 0/1 as Apex took them
    assert FusedRMSNorm(6, memory_efficient=np.bool_(True)).memory_efficient is True


@pytest.mark.parametrize("shape", ["768", [768.0], (2.5,), True, torch.tensor(2.5)])
def test_a_normalized_shape_of_other_than_ints_is_refused_as_torch_refuses_it(shape):
    """``int()`` on each element read the string "768" (a size left unparsed in a config) as (7, 6, 8), and
    truncated 2.5 to 2; ``nn.LayerNorm`` refuses both."""
    for build in (FusedLayerNorm, FusedRMSNorm, lambda s: fused_layer_norm(torch.randn(2, 768), s)):
        with pytest.raises(TypeError, match="normalized_shape must be an int or a sequence of ints, got"):
            build(shape)
    assert FusedRMSNorm(np.array([3, 4])).normalized_shape == (3, 4) == FusedRMSNorm((np.int64(3), 4)).normalized_shape


@pytest.mark.parametrize("eps", [-1e-5, float("nan"), float("inf"), "1e-5", None])
def test_an_eps_that_would_give_nan_is_refused_where_it_is_given(eps):
    """torch's LayerNorm takes a negative eps and returns NaN rows; here the constructor or the call names it. (None
    is RMSNorm's default in torch, and here too: ``test_rms_norm_eps_none_is_torchs_default``.)"""
    for module in (FusedLayerNorm, FusedRMSNorm) if eps is not None else (FusedLayerNorm,):
        with pytest.raises(ValueError, match=rf"{module.__name__}: eps must be a finite number >= 0, got"):
            module(6, eps=eps)
    with pytest.raises(ValueError, match="fused_layer_norm: eps must be a finite number >= 0"):
        fused_layer_norm(torch.randn(2, 6), 6, eps=eps)
    if eps is not None:
        with pytest.raises(ValueError, match="fused_rms_norm: eps must be a finite number >= 0"):
            fused_rms_norm(torch.randn(2, 6), 6, eps=eps)
    assert torch.isfinite(FusedLayerNorm(6, eps=0.0)(torch.randn(3, 6))).all()


def test_bad_weight_and_bias_are_named():
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match=r"weight has shape \[5\]"):
        fused_layer_norm_affine(x, torch.ones(5), torch.zeros(6), 6)
    with pytest.raises(ValueError, match=r"bias has shape \[3\]"):
        fused_layer_norm_affine(x, torch.ones(6), torch.zeros(3), 6)
    with pytest.raises(TypeError, match="weight dtype torch.float16 does not fit input dtype torch.float32"):
        fused_layer_norm_affine(x, torch.ones(6, dtype=torch.float16), None, 6)  # F.layer_norm refuses it too
    with pytest.raises(TypeError, match="weight dtype torch.bfloat16 does not fit input dtype torch.float16"):
        fused_layer_norm_affine(x.half(), torch.ones(6, dtype=torch.bfloat16), None, 6)
    with pytest.raises(TypeError, match="bias dtype torch.float16 differs from weight dtype torch.float32"):
        fused_layer_norm_affine(x.half(), torch.ones(6), torch.zeros(6, dtype=torch.float16), 6)
    with pytest.raises(ValueError, match="weight is on meta but input is on cpu"):
        fused_layer_norm_affine(x, torch.ones(6, device="meta"), None, 6)


def test_non_float_input_is_named():
    with pytest.raises(TypeError, match="input must be float16, bfloat16, float32 or float64, got torch.int64"):
        fused_layer_norm(torch.ones(3, 4, dtype=torch.int64), 4)
    with pytest.raises(TypeError, match="input must be a torch.Tensor"):
        FusedRMSNorm(4)([1.0, 2.0, 3.0, 4.0])


@pytest.mark.parametrize("ops", ["kernel", "reference"])
@pytest.mark.parametrize("backend", ["torch", "ampkit"])
def test_a_complex_input_is_refused_whoever_runs_the_norm(ops, backend, monkeypatch):
    """Where torch's kernel runs a norm, ampkit leaves the checks to it; ``F.rms_norm`` takes a complex input and
    squares it where the RMS wants its modulus, so ``backend=torch`` returned a wrong norm without a word."""
    monkeypatch.setenv("AMPKIT_OPS", ops)
    monkeypatch.setenv("AMPKIT_FUSED_BACKEND", backend)
    x = torch.randn(4, 6, dtype=torch.complex64)
    for norm in (
        lambda x: fused_rms_norm(x, 6),
        FusedRMSNorm(6, elementwise_affine=False),
        lambda x: fused_layer_norm(x, 6),
    ):
        with pytest.raises(
            TypeError, match=r"input must be float16, bfloat16, float32 or float64, got torch.complex64"
        ):
            norm(x)


@pytest.mark.parametrize("ops", ["kernel", "reference"])
@pytest.mark.parametrize("backend", ["torch", "ampkit"])
def test_a_sparse_input_or_weight_is_named(ops, backend, monkeypatch):
    """The kernels' error was torch's 'unsupported memory format option Contiguous', the reference's a dispatcher dump
    naming a SparseCPU backend."""
    monkeypatch.setenv("AMPKIT_OPS", ops)
    monkeypatch.setenv("AMPKIT_FUSED_BACKEND", backend)
    sparse = torch.randn(4, 6).to_sparse()
    for norm in (lambda x: fused_layer_norm(x, 6), FusedLayerNorm(6), FusedRMSNorm(6), MixedFusedRMSNorm(6)):
        with pytest.raises(TypeError, match=r"input is a torch.sparse_coo tensor; the norms take dense ones") as caught:
            norm(sparse)
        assert isinstance(caught.value, RuntimeError)  # as torch's norms raise for it
    with pytest.raises(TypeError, match=r"weight is a torch.sparse_coo tensor"):
        fused_rms_norm_affine(torch.randn(4, 6), torch.ones(6).to_sparse(), 6)


# -- modules --------------------------------------------------------------------------------------


def test_modules_have_apex_defaults_and_torch_compatible_state():
    ln = FusedLayerNorm([3, 5])
    assert ln.eps == 1e-5 and ln.elementwise_affine and not ln.memory_efficient
    assert ln.normalized_shape == torch.Size([3, 5])
    assert torch.equal(ln.weight, torch.ones(3, 5)) and torch.equal(ln.bias, torch.zeros(3, 5))
    torch_ln = torch.nn.LayerNorm([3, 5], eps=1e-5)
    torch_ln.load_state_dict(ln.state_dict())
    rms = FusedRMSNorm(5, elementwise_affine=False)
    assert rms.weight is None and list(rms.parameters()) == []
    x = torch.randn(2, 3, 5)
    torch.testing.assert_close(ln(x), torch_ln(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rms(x), torch.nn.functional.rms_norm(x, (5,), eps=1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_layer_norm_without_a_bias_matches_and_loads_from_torchs(memory_efficient):
    """``nn.LayerNorm(d, bias=False)`` (a weight only, as GPT-style models take it) had no fused form: ``bias=False``
    was a TypeError and its checkpoint had no ``bias`` to give."""
    torch_ln = torch.nn.LayerNorm((3, 4), bias=False).double()
    with torch.no_grad():
        torch_ln.weight.copy_(_weight((3, 4), torch.float64))
    ln = FusedLayerNorm((3, 4), bias=False, memory_efficient=memory_efficient).double()
    assert ln.bias is None and list(ln.state_dict()) == ["weight"]
    ln.load_state_dict(torch_ln.state_dict())
    assert "bias=False" in repr(ln)
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    for norm, xi in zip((ln, torch_ln), xs, strict=True):
        norm(xi).sin().sum().backward()
    torch.testing.assert_close(ln(x), torch_ln(x))
    torch.testing.assert_close(xs[0].grad, xs[1].grad)
    torch.testing.assert_close(ln.weight.grad, torch_ln.weight.grad)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_rms_norm_eps_none_is_torchs_default(dtype):
    """``nn.RMSNorm(d, eps=None)`` (torch's default) swapped for ``FusedRMSNorm(d, eps=None)`` was a ValueError; None
    is the machine epsilon of the dtype the norm computes in, float32 for bf16 (torch's 0.0078 would halve rows of
    magnitude 0.01)."""
    torch_rms = torch.nn.RMSNorm((3, 4), eps=None).to(dtype)
    with torch.no_grad():
        torch_rms.weight.copy_(_weight((3, 4), dtype))
    rms = FusedRMSNorm((3, 4), eps=None).to(dtype)
    rms.load_state_dict(torch_rms.state_dict())
    assert "eps=None" in repr(rms)
    x = (torch.randn(5, 3, 4, dtype=torch.float64) * 1e-2).to(dtype)
    torch.testing.assert_close(rms(x), torch_rms(x))
    torch.testing.assert_close(fused_rms_norm(x, (3, 4), eps=None), torch.nn.functional.rms_norm(x, (3, 4)))


def test_mixed_modules_output_weight_dtype():
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    for mixed_cls, plain_cls in ((MixedFusedLayerNorm, FusedLayerNorm), (MixedFusedRMSNorm, FusedRMSNorm)):
        assert mixed_cls(16)(x).dtype == torch.float32
        assert plain_cls(16)(x).dtype == torch.bfloat16
        with pytest.warns(UserWarning, match="does not support `elementwise_affine`"):
            mixed_cls(16, elementwise_affine=True)
        with pytest.raises(RuntimeError, match="elementwise_affine = False"), pytest.warns(UserWarning):
            mixed_cls(16, elementwise_affine=False)


def test_module_memory_efficient_trains_like_plain():
    x = torch.randn(12, 40)
    plain, lean = FusedLayerNorm(40), FusedLayerNorm(40, memory_efficient=True)
    with torch.no_grad():
        plain.weight.copy_(_weight((40,)))
        lean.weight.copy_(plain.weight)
    for m in (plain, lean):
        m(x).square().sum().backward()
    torch.testing.assert_close(lean.weight.grad, plain.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lean.bias.grad, plain.bias.grad, rtol=1e-5, atol=1e-5)


def test_autocast_runs_in_autocast_dtype_like_apex():
    ln = FusedLayerNorm(32)
    x = torch.randn(4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ln(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert ln.weight.grad is not None and ln.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("backend", ["ampkit", "torch"])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_under_autocast_a_norm_with_float32_params_computes_in_float32_and_rounds_its_output_once(
    kind, backend, monkeypatch
):
    """As torch's autocast runs its norms; Apex cast the input, weight and bias to half first: three more casts
    a call (each with a backward), which on a GPU cost more than the norm, and a normalisation of rounded inputs."""
    monkeypatch.setenv("AMPKIT_FUSED_BACKEND", backend)
    torch.manual_seed(0)
    norm = FusedLayerNorm(48) if kind == "layer" else FusedRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(torch.randn_like(p))
    plain = copy.deepcopy(norm)
    x, dy = torch.randn(6, 48) * 3, torch.randn(6, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(x)
    y.backward(dy.bfloat16())
    want = plain(x)  # float32 throughout
    want.to(torch.bfloat16).float().backward(dy.bfloat16().float())  # the rounding's gradient is the identity
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, want.to(torch.bfloat16), rtol=0, atol=0)
    for got, expected in zip(norm.parameters(), plain.parameters(), strict=True):
        assert got.grad.dtype == torch.float32
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-5, atol=1e-5)

    # memory_efficient saves the output, so it keeps Apex's casts: the norm runs in bfloat16
    lean = FusedLayerNorm(48, memory_efficient=True) if kind == "layer" else FusedRMSNorm(48, 1e-5, True, True)
    lean.load_state_dict(plain.state_dict())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        halved = lean(x)
    cast = [t.bfloat16() for t in (x, *lean.parameters())]
    expected = (
        F.layer_norm(cast[0].float(), (48,), cast[1].float(), cast[2].float(), lean.eps)
        if kind == "layer"
        else F.rms_norm(cast[0].float(), (48,), cast[1].float(), lean.eps)
    )
    torch.testing.assert_close(halved.float(), expected, rtol=1e-2, atol=1e-2)
    assert not torch.equal(halved, want.to(torch.bfloat16))


def test_reference_mode_gives_the_same_results(monkeypatch):
    x = torch.randn(10, 48)
    w, b = _weight((48,)), torch.randn(48)
    for kind in ("layer", "rms"):
        bb = b if kind == "layer" else None
        y_kernel, dy, g_kernel = _run(kind, x, w, bb, (48,))
        monkeypatch.setenv("AMPKIT_OPS", "reference")
        x_ref, w_ref = x.clone().requires_grad_(), w.clone().requires_grad_()
        b_ref = bb.clone().requires_grad_() if bb is not None else None
        if kind == "layer":
            y_ref = fused_layer_norm_affine(x_ref, w_ref, b_ref, 48, EPS)
        else:
            y_ref = fused_rms_norm_affine(x_ref, w_ref, 48, EPS)
        assert y_ref.grad_fn is not None and "Fused" not in type(y_ref.grad_fn).__name__
        y_ref.backward(dy)
        monkeypatch.setenv("AMPKIT_OPS", "kernel")
        torch.testing.assert_close(y_ref, y_kernel, rtol=1e-5, atol=1e-5)
        for got, want in zip((x_ref.grad, w_ref.grad), g_kernel[:2], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_public_names():
    for name in ("FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm"):
        assert issubclass(getattr(norms, name), torch.nn.Module)
    assert set(norms.__all__) <= set(dir(norms))


# -- SyncBatchNorm local statistics ----------------------------------------------------------------

BN_CASES = [
    ((8, 6, 9, 11), torch.contiguous_format),
    ((8, 6, 9, 11), torch.channels_last),
    ((3, 5, 2, 4, 3), torch.channels_last_3d),
    ((300, 7), torch.contiguous_format),
    ((4, 3, 17), torch.contiguous_format),
    ((1, 2, 1, 1), torch.contiguous_format),
]


@pytest.mark.parametrize("shape,memory_format", BN_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_batch_norm_stats_match_float64_reference(shape, memory_format, dtype):
    # A large common offset: a naive sum-of-squares formula loses the variance here.
    x = (torch.randn(shape) * 2 + 1000).to(dtype).contiguous(memory_format=memory_format)
    mean, invstd = batch_norm_stats(x, EPS)
    mean_ref, invstd_ref = reference.batch_norm_stats(x.double(), EPS)
    assert mean.dtype == invstd.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(mean.double(), mean_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(invstd.double(), invstd_ref, rtol=1e-4, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_norm_stats_many_rows_and_odd_strides(dtype):
    x = torch.randn(4099, 33).to(dtype)  # bf16 (N, C) runs the kernel's row-blocked path across threads
    torch.testing.assert_close(batch_norm_stats(x, EPS), reference.batch_norm_stats(x.double(), EPS), check_dtype=False)
    strided = torch.randn(6, 10, 7)[:, ::2]  # neither contiguous nor channels-last: copied
    torch.testing.assert_close(
        batch_norm_stats(strided, EPS), reference.batch_norm_stats(strided.double(), EPS), check_dtype=False
    )


def test_batch_norm_stats_propagate_non_finite_per_channel():
    x = torch.randn(4, 3, 5, 5)
    x[2, 1, 4, 4] = float("nan")
    mean, invstd = batch_norm_stats(x, EPS)
    assert mean[1].isnan() and invstd[1].isnan()
    assert mean[[0, 2]].isfinite().all() and invstd[[0, 2]].isfinite().all()


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_batch_norm_backward_reduce_matches_reference(memory_format):
    x = torch.randn(6, 5, 7, 3).contiguous(memory_format=memory_format)
    dy = torch.randn(6, 5, 7, 3).contiguous(memory_format=memory_format)
    mean, invstd = batch_norm_stats(x, EPS)
    sum_dy, sum_dy_xmu = batch_norm_backward_reduce(dy, x, mean, invstd)
    ref_dy, ref_dy_xmu = reference.batch_norm_backward_reduce(dy.double(), x.double(), mean.double())
    torch.testing.assert_close(sum_dy.double(), ref_dy, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(sum_dy_xmu.double(), ref_dy_xmu, rtol=1e-5, atol=1e-4)


def test_batch_norm_bad_input_is_named():
    with pytest.raises(ValueError, match=r"batch_norm_stats: input must be \(N, C, ...\)"):
        batch_norm_stats(torch.randn(5), EPS)
    with pytest.raises(ValueError, match="at least one element"):
        batch_norm_stats(torch.randn(0, 3, 2), EPS)
    with pytest.raises(TypeError, match="input must be float16, bfloat16, float32 or float64, got torch.int32"):
        batch_norm_stats(torch.ones(2, 3, dtype=torch.int32), EPS)
    x = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="grad_output"):
        batch_norm_backward_reduce(torch.randn(2, 3, 5), x, *batch_norm_stats(x, EPS))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_cpu_kernel(kind, dtype):
    x = torch.randn(300, 1000).to(dtype)
    w, b = _weight((1000,), dtype), torch.randn(1000).to(dtype)
    b = b if kind == "layer" else None
    y_cpu, dy, g_cpu = _run(kind, x, w, b, (1000,))
    y_gpu, _, g_gpu = _run_on_cuda(kind, x, w, b, dy)
    tol = FP32_TOL["grad"] if dtype == torch.float32 else HALF_TOL[dtype]["grad"]
    torch.testing.assert_close(y_gpu.cpu(), y_cpu, **tol)
    for got, want in zip(g_gpu, g_cpu, strict=True):
        if want is not None:
            torch.testing.assert_close(got.cpu(), want, rtol=tol["rtol"], atol=tol["atol"] * 20)


def _run_on_cuda(kind, x, w, b, dy):
    x = x.cuda().requires_grad_()
    w = w.cuda().requires_grad_()
    b = b.cuda().requires_grad_() if b is not None else None
    if kind == "layer":
        y = fused_layer_norm_affine(x, w, b, x.shape[-1], EPS)
    else:
        y = fused_rms_norm_affine(x, w, x.shape[-1], EPS)
    assert "Fused" in type(y.grad_fn).__name__, "CUDA path fell back to the reference"
    y.backward(dy.cuda())
    return y.detach(), dy, (x.grad, w.grad, None if b is None else b.grad)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_a_gradient_penalty_differentiates_through_the_kernels(kind):
    """``backward(create_graph=True)`` (WGAN-GP, R1) through ampkit's kernels: the second derivatives are the
    reference's (gradgradcheck in float64, a transposed input among them), as with torch's own norms; Apex's
    functions were differentiable once only."""
    x = torch.randn(8, 3, dtype=torch.float64).t().requires_grad_()  # non-contiguous
    w = _weight((8,), torch.float64).requires_grad_()
    b = torch.randn(8, dtype=torch.float64, requires_grad=True)
    if kind == "layer":
        fused = lambda x, w, b: fused_layer_norm_affine(x, w, b, 8)  # noqa: E731
        ref = lambda x, w, b: reference.layer_norm(x, [8], w, b, 1e-6)  # noqa: E731
        inputs = (x, w, b)
    else:
        fused = lambda x, w: fused_rms_norm_affine(x, w, 8)  # noqa: E731
        ref = lambda x, w: reference.rms_norm(x, [8], w, 1e-6)  # noqa: E731
        inputs = (x, w)
    assert torch.autograd.gradgradcheck(fused, inputs)

    def penalty(norm):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        (grad_x,) = torch.autograd.grad(norm(*leaves).square().sum(), leaves[0], create_graph=True)
        grad_x.square().sum().backward()
        return [t.grad for t in leaves]

    for got, want in zip(penalty(fused), penalty(ref), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("module", [FusedLayerNorm, FusedRMSNorm])
def test_a_memory_efficient_norm_refuses_a_graph_of_its_gradients_it_could_not_differentiate(module):
    """It saves its output, not its input: under ``create_graph=True`` its gradients had no graph to the input, so
    gradgradcheck and ``torch.autograd.grad(..., inputs=...)`` got zeros for its terms instead of an error."""
    norm, plain = module(8, memory_efficient=True).double(), module(8).double()
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    (grad_x,) = torch.autograd.grad(norm(x).square().sum(), x)  # first order: as before
    torch.testing.assert_close(grad_x, torch.autograd.grad(plain(x).square().sum(), x)[0])
    with pytest.raises(RuntimeError, match="memory_efficient=True .* cannot be differentiated again"):
        torch.autograd.gradgradcheck(norm, (x,))
    with pytest.raises(RuntimeError, match="memory_efficient=False"):
        torch.autograd.grad(norm(x).square().sum(), norm.weight, create_graph=True)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_torch_func_transforms_run_through_the_norms(kind):
    """``vmap`` (per-sample gradients) and ``jacrev`` over a fused norm failed in the kernels' autograd Function,
    which has no batching rule; under a transform the reference's torch ops run, as ``nn.LayerNorm``'s would."""
    fused = FusedLayerNorm((3, 4)) if kind == "layer" else FusedRMSNorm((3, 4))
    fused = fused.double()
    with torch.no_grad():
        for p in fused.parameters():
            p.copy_(_weight(p.shape, torch.float64))
    params = dict(fused.named_parameters())

    def torch_norm(p, x):
        if kind == "layer":
            return torch.nn.functional.layer_norm(x, (3, 4), p["weight"], p["bias"], fused.eps)
        return torch.nn.functional.rms_norm(x, (3, 4), p["weight"], fused.eps)

    def fused_norm(p, x):
        return torch.func.functional_call(fused, p, (x,))

    def per_sample_grads(norm_fn, x):  # per-sample weight gradients, as Opacus-style DP training takes them
        loss = torch.func.grad(lambda p, row: norm_fn(p, row).sin().sum())
        return torch.func.vmap(loss, in_dims=(None, 0))(params, x)

    x = torch.randn(5, 3, 4, dtype=torch.float64)
    got, want = per_sample_grads(fused_norm, x), per_sample_grads(torch_norm, x)
    for name in params:
        torch.testing.assert_close(got[name], want[name])
    jacobian = torch.func.jacrev(lambda x: fused_norm(params, x))(x[0])
    torch.testing.assert_close(jacobian, torch.func.jacrev(lambda x: torch_norm(params, x))(x[0]))


def test_torch_fx_symbolic_trace_records_each_norm_as_one_call():
    """``torch.fx.symbolic_trace`` (torchvision's feature extraction, FX quantization) traces into these modules, as
    ``nn.LayerNorm`` is a leaf to it: their input checks got a Proxy and raised TypeError for any model holding one."""

    class Functional(torch.nn.Module):
        def forward(self, x):
            return fused_rms_norm(x, (3, 4), 1e-5)

    for norm in (FusedLayerNorm((3, 4)), FusedRMSNorm((3, 4)), MixedFusedLayerNorm((3, 4)), Functional()):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), norm).double()
        traced = torch.fx.symbolic_trace(model)
        x = torch.randn(5, 3, 4, dtype=torch.float64)
        torch.testing.assert_close(traced(x), model(x), rtol=0, atol=0)
        traced(x).sum().backward()
        assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    "make",
    [
        lambda: FusedLayerNorm((3, 4)),
        lambda: FusedLayerNorm((3, 4), elementwise_affine=False),
        lambda: FusedLayerNorm(4, bias=False),
        lambda: FusedRMSNorm((3, 4)),
        lambda: FusedRMSNorm(4, eps=None),
        lambda: FusedRMSNorm(4, elementwise_affine=False),
        lambda: MixedFusedLayerNorm(4),
        lambda: MixedFusedRMSNorm(4),
    ],
    ids=["layer", "layer_plain", "layer_no_bias", "rms", "rms_eps_none", "rms_plain", "mixed_layer", "mixed_rms"],
)
def test_torch_jit_script_compiles_a_model_holding_a_norm_and_the_saved_program_agrees(make, tmp_path):
    """``torch.jit.script`` (TorchScript export for serving) compiled Apex's norms, which ran torch's own under it;
    ours raised at ``type(self)`` in forward, so no model holding one could be scripted."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), make()).double()
    with torch.no_grad():
        for p in model[1].parameters():
            p.copy_(_weight(p.shape, torch.float64))
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    torch.jit.save(torch.jit.script(model), tmp_path / "model.pt")
    scripted = torch.jit.load(tmp_path / "model.pt")
    torch.testing.assert_close(scripted(x), model(x))
    scripted(x).sum().backward()
    assert all(p.grad is not None for p in scripted.parameters())


@pytest.mark.parametrize("cls", [MixedFusedLayerNorm, MixedFusedRMSNorm])
@pytest.mark.parametrize(
    ("weight_dtype", "input_dtype"), [(torch.float16, torch.float32), (torch.float32, torch.bfloat16)]
)
def test_a_scripted_mixed_norm_reads_any_weight_dtype_and_answers_in_it_as_in_eager(cls, weight_dtype, input_dtype):
    norm = cls(8).to(weight_dtype)
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(_weight(p.shape, weight_dtype))
    x = torch.randn(6, 8, dtype=input_dtype)
    scripted = torch.jit.script(norm)(x)
    assert scripted.dtype == weight_dtype
    torch.testing.assert_close(scripted, norm(x))


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_forward_mode_ad_runs_through_the_norms(kind):
    """A dual tensor (``torch.autograd.forward_ad``) through a fused norm raised NotImplementedError: the kernels'
    autograd Function has no jvp. The reference's torch ops run instead, as torch's norms would."""
    norm = (FusedLayerNorm((3, 4)) if kind == "layer" else FusedRMSNorm((3, 4))).double()
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(_weight(p.shape, torch.float64))

    def torch_norm(x):
        if kind == "layer":
            return torch.nn.functional.layer_norm(x, (3, 4), norm.weight, norm.bias, norm.eps)
        return torch.nn.functional.rms_norm(x, (3, 4), norm.weight, norm.eps)

    x, tangent = torch.randn(5, 3, 4, dtype=torch.float64), torch.randn(5, 3, 4, dtype=torch.float64)
    tangents = []
    for fn in (norm, torch_norm):
        with forward_ad.dual_level():
            tangents.append(forward_ad.unpack_dual(fn(forward_ad.make_dual(x, tangent))).tangent)
    torch.testing.assert_close(tangents[0], tangents[1])


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_non_reentrant_activation_checkpointing_trains_as_without(kind, memory_efficient):
    """``torch.utils.checkpoint(use_reentrant=False)`` (torch's recommended form) refuses a second unpack of a saved
    tensor, and the kernels' backward unpacked ``ctx.saved_tensors`` twice: every checkpointed block failed."""
    torch.manual_seed(0)
    norm = (FusedLayerNorm if kind == "layer" else FusedRMSNorm)(8, memory_efficient=memory_efficient)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), norm, torch.nn.Linear(8, 8)).double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)

    def grads(checkpointed):
        out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
        return torch.autograd.grad(out.sin().sum(), [x, *block.parameters()])

    for got, want in zip(grads(True), grads(False), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_features=-1), r"num_features must be an integer >= 1 \(the channels\), got -1"),
        (dict(num_features=4, eps=float("nan")), r"Invalid SyncBatchNorm eps: nan"),  # NaN outputs
        (dict(num_features=4, momentum=float("nan")), r"Invalid SyncBatchNorm momentum: nan"),  # NaN running stats
        (dict(num_features=4, momentum=2.0), r"Invalid SyncBatchNorm momentum: 2.0 \(expected a value in \[0.0, 1.0\]"),
    ],
)
def test_sync_batch_norm_refuses_numbers_torchs_batch_norm_takes_unchecked(kwargs, message):
    """torch's batch norms take these without a word: a NaN eps or momentum turned the outputs or the running
    statistics NaN, a momentum of 2 extrapolated the running statistics past the batch's, and num_features=-1 failed
    naming a tensor dimension. Apex's SyncBatchNorm, a subclass, refuses them too."""
    from ampkit.compat.parallel import SyncBatchNorm as ApexSyncBatchNorm
    from ampkit.ops import SyncBatchNorm

    for cls in (SyncBatchNorm, ApexSyncBatchNorm):
        with pytest.raises(ValueError, match=message):
            cls(**kwargs)
    SyncBatchNorm(4, momentum=None)  # a cumulative average, as in torch
