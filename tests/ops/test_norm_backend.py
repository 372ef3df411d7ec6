"""LayerNorm/RMSNorm routing (``AMPKIT_FUSED_BACKEND``): the plain variants run torch's own kernels where those
are the faster ones and then equal ``F.layer_norm``/``F.rms_norm`` bit for bit; the mixed-dtype and
memory-efficient variants keep ampkit's kernel results exactly; every backend matches the float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ampkit.ops.norms import (
    FusedLayerNorm,
    FusedRMSNorm,
    MixedFusedLayerNorm,
    MixedFusedRMSNorm,
    fused_layer_norm_affine,
)
from ampkit.ops.reference import norms as reference

SHAPE = (37, 96)  # odd row count

# name: (module factory, input dtype, parameter dtype, whether auto runs torch's kernel on the CPU)
CASES = {
    "layer-fp32": (lambda: FusedLayerNorm(96), torch.float32, torch.float32, True),
    "layer-fp32-no-affine": (lambda: FusedLayerNorm(96, elementwise_affine=False), torch.float32, None, True),
    "layer-bf16": (lambda: FusedLayerNorm(96), torch.bfloat16, torch.bfloat16, False),
    "layer-fp16": (lambda: FusedLayerNorm(96), torch.float16, torch.float16, True),
    "layer-fp64": (lambda: FusedLayerNorm(96), torch.float64, torch.float64, False),
    "rms-fp32": (lambda: FusedRMSNorm(96), torch.float32, torch.float32, False),
    "rms-bf16": (lambda: FusedRMSNorm(96), torch.bfloat16, torch.bfloat16, False),
    "rms-fp16": (lambda: FusedRMSNorm(96), torch.float16, torch.float16, False),
    "layer-memory-efficient": (lambda: FusedLayerNorm(96, memory_efficient=True), torch.float32, torch.float32, None),
    "rms-memory-efficient": (lambda: FusedRMSNorm(96, memory_efficient=True), torch.float32, torch.float32, None),
    "mixed-layer-bf16-fp32-weight": (lambda: MixedFusedLayerNorm(96), torch.bfloat16, torch.float32, None),
    "mixed-rms-bf16-fp32-weight": (lambda: MixedFusedRMSNorm(96), torch.bfloat16, torch.float32, None),
}
# None: never torch's kernel (mixed dtypes, memory_efficient), whatever the backend.


@pytest.fixture(autouse=True)
def kernel_mode(monkeypatch):
    monkeypatch.setenv("AMPKIT_OPS", "kernel")


def torch_norm_calls(monkeypatch):
    called = []
    for name in ("layer_norm", "rms_norm"):
        real = getattr(F, name)
        monkeypatch.setattr(F, name, lambda *a, _real=real, _name=name, **k: (called.append(_name), _real(*a, **k))[1])
    return called


def make_module(case, seed=0):
    make, dtype, param_dtype, _ = CASES[case]
    torch.manual_seed(seed)
    module = make()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.rand_like(p) + 0.5)  # away from zero: memory_efficient divides by the weight
            p.data = p.data.to(param_dtype)
    return module, dtype


def fwd_bwd(module, x, dy):
    x = x.detach().requires_grad_()
    y = module(x)
    y.backward(dy)
    return [y.detach(), x.grad, *(p.grad for p in module.parameters())]


def inputs(dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(SHAPE, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype)
    dy = torch.randn(SHAPE, generator=g, dtype=torch.float64)
    return x, dy


@pytest.mark.parametrize("backend", ["auto", "torch", "ampkit"])
@pytest.mark.parametrize("case", list(CASES))
def test_which_kernel_runs(case, backend, monkeypatch):
    monkeypatch.setenv("AMPKIT_FUSED_BACKEND", backend)
    called = torch_norm_calls(monkeypatch)
    module, dtype = make_module(case)
    x, dy = inputs(dtype)
    out = fwd_bwd(module, x, dy.to(module(x).dtype))
    torch_on_cpu = CASES[case][3]
    expected = torch_on_cpu is not None and (backend == "torch" or (backend == "auto" and torch_on_cpu))
    assert bool(called) == expected
    assert all(t.isfinite().all() for t in out)


@pytest.mark.parametrize("case", [c for c, spec in CASES.items() if spec[3] is not None])
def test_routed_norm_is_torch_bit_for_bit(case, monkeypatch):
    monkeypatch.setenv("AMPKIT_FUSED_BACKEND", "torch")
    module, dtype = make_module(case)
    x, dy = inputs(dtype)
    got = fwd_bwd(module, x, dy.to(dtype))
    twin, _ = make_module(case)
    weight = getattr(twin, "weight", None)
    bias = getattr(twin, "bias", None)
    xt = x.detach().requires_grad_()
    if isinstance(twin, FusedLayerNorm):
        y = F.layer_norm(xt, (96,), weight, bias, twin.eps)
    else:
        y = F.rms_norm(xt, (96,), weight, twin.eps)
    y.backward(dy.to(dtype))
    want = [y.detach(), xt.grad, *(p.grad for p in twin.parameters())]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", [c for c, spec in CASES.items() if spec[3] is None])
def test_mixed_and_memory_efficient_keep_ampkit_kernel_results(case, monkeypatch):
    results = []
    for backend in ("ampkit", "auto", "torch"):
        monkeypatch.setenv("AMPKIT_FUSED_BACKEND", backend)
        module, dtype = make_module(case)
        x, dy = inputs(dtype)
        results.append(fwd_bwd(module, x, dy.to(module(x).dtype)))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


TOL = {torch.float32: 2e-5, torch.float64: 1e-10, torch.bfloat16: 5e-2, torch.float16: 1e-2}


@pytest.mark.parametrize("backend", ["auto", "torch", "ampkit"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_backend_matches_the_float64_reference(case, backend, monkeypatch):
    monkeypatch.setenv("AMPKIT_FUSED_BACKEND", backend)
    module, dtype = make_module(case)
    x, dy = inputs(dtype)
    got = fwd_bwd(module, x, dy.to(module(x).dtype))
    params = [p.detach().double().requires_grad_() for p in module.parameters()]
    x64 = x.detach().double().requires_grad_()
    if isinstance(module, FusedLayerNorm):
        y = reference.layer_norm(x64, (96,), *(params or [None, None]), module.eps)
    else:
        y = reference.rms_norm(x64, (96,), params[0] if params else None, module.eps)
    y.backward(dy.to(got[0].dtype).double())
    want = [y.detach(), x64.grad, *(p.grad for p in params)]
    tol = TOL[dtype]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol)


def test_a_bad_backend_is_named(monkeypatch):
    monkeypatch.setenv("AMPKIT_FUSED_BACKEND", "fast")
    with pytest.raises(ValueError, match=r"AMPKIT_FUSED_BACKEND: invalid fused backend 'fast'; expected one of"):
        fused_layer_norm_affine(torch.randn(3, 4), torch.ones(4), torch.zeros(4), 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_auto_routes_every_plain_variant(case, monkeypatch):
    monkeypatch.setenv("AMPKIT_FUSED_BACKEND", "auto")
    called = torch_norm_calls(monkeypatch)
    module, dtype = make_module(case)
    module = module.cuda()
    x, dy = inputs(dtype)
    fwd_bwd(module, x.cuda(), dy.cuda().to(module(x.cuda()).dtype))
    assert bool(called) == (CASES[case][3] is not None)
