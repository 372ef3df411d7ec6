"""Apex's ``fused_layer_norm_cuda`` extension under the shim, as Megatron-LM (2023) drove it: its
``MixedFusedLayerNorm`` runs ``importlib.import_module("fused_layer_norm_cuda")`` on construction, and
autograd Functions written around the extension call ``forward_affine``/``backward_affine`` (and the RMSNorm
and non-affine ops) with Apex's arguments. Every op is checked against autograd through torch's norms, in
float64."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from ampkit.compat import install_apex_shim, uninstall_apex_shim


@pytest.fixture
def fused_layer_norm_cuda():
    install_apex_shim()
    yield importlib.import_module("fused_layer_norm_cuda")
    uninstall_apex_shim()


megatron_extension = None  # Megatron-LM's module-level global, set when a MixedFusedLayerNorm is built


class MegatronLayerNormFunction(torch.autograd.Function):
    """Megatron-LM's own Function around the extension (2021-2023), saving the input and the statistics."""

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps):
        ctx.normalized_shape, ctx.eps = normalized_shape, eps
        output, mean, invvar = megatron_extension.forward_affine(input, normalized_shape, weight, bias, eps)
        ctx.save_for_backward(input, weight, bias, mean, invvar)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias, mean, invvar = ctx.saved_tensors
        grads = megatron_extension.backward_affine(
            grad_output, mean, invvar, input, ctx.normalized_shape, weight, bias, ctx.eps
        )  # Apex's call before 2023 had no ninth (memory_efficient) argument
        return (*grads, None, None)


class MegatronMixedFusedLayerNorm(torch.nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        global megatron_extension
        megatron_extension = importlib.import_module("fused_layer_norm_cuda")
        self.normalized_shape, self.eps = torch.Size([hidden]), eps
        self.weight = torch.nn.Parameter(torch.rand(hidden, dtype=torch.float64) + 0.5)
        self.bias = torch.nn.Parameter(torch.randn(hidden, dtype=torch.float64))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return MegatronLayerNormFunction.apply(input, self.weight, self.bias, self.normalized_shape, self.eps)


def _float64(*shape, offset=0.0):
    return (torch.randn(*shape, dtype=torch.float64) + offset).requires_grad_()


def test_megatron_layer_norm_loading_the_extension_by_name_matches_torch(fused_layer_norm_cuda):
    torch.manual_seed(0)
    norm = MegatronMixedFusedLayerNorm(8)
    x = _float64(3, 5, 8)
    y = norm(x)
    expected = F.layer_norm(x, (8,), norm.weight, norm.bias, 1e-5)
    grad = torch.randn_like(y)
    assert torch.allclose(y, expected, atol=1e-12)
    got = torch.autograd.grad(y, (x, norm.weight, norm.bias), grad)
    want = torch.autograd.grad(expected, (x, norm.weight, norm.bias), grad)
    assert all(torch.allclose(g, e, atol=1e-12) for g, e in zip(got, want, strict=True))


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_every_op_matches_torch_and_memory_efficient_backward_reads_the_output(fused_layer_norm_cuda, memory_efficient):
    torch.manual_seed(0)
    ext = fused_layer_norm_cuda
    x, w, b = _float64(4, 2, 6), _float64(2, 6, offset=1.0), _float64(2, 6)
    shape = [2, 6]
    grad = torch.randn(4, 2, 6, dtype=torch.float64)

    def check(out, backward, expected, inputs):
        """``backward(saved)`` gets what Apex's Functions save: the output when memory efficient, else the input."""
        assert torch.allclose(out, expected, atol=1e-12)
        want = torch.autograd.grad(expected, inputs, grad)
        got = backward(out if memory_efficient else x.detach())
        got = got if isinstance(got, tuple) else (got,)
        assert all(torch.allclose(g, e, atol=1e-12) for g, e in zip(got, want, strict=True))

    out, mean, invvar = ext.forward_affine(x.detach(), shape, w.detach(), b.detach(), 1e-5)
    assert mean.shape == invvar.shape == (4,)
    check(out, lambda saved: ext.backward_affine(
        grad, None if memory_efficient else mean, invvar, saved, shape, w.detach(), b.detach(), 1e-5,
        memory_efficient,
    ), F.layer_norm(x, shape, w, b, 1e-5), (x, w, b))  # fmt: skip
    out, mean, invvar = ext.forward(x.detach(), shape, 1e-5)
    check(out, lambda saved: ext.backward(grad, mean, invvar, saved, shape, 1e-5, memory_efficient),
          F.layer_norm(x, shape, eps=1e-5), (x,))  # fmt: skip
    out, invvar = ext.rms_forward_affine(x.detach(), shape, w.detach(), 1e-5)
    check(out, lambda saved: ext.rms_backward_affine(grad, invvar, saved, shape, w.detach(), 1e-5,
          memory_efficient), F.rms_norm(x, shape, w, 1e-5), (x, w))  # fmt: skip
    out, invvar = ext.rms_forward(x.detach(), shape, 1e-5)
    check(out, lambda saved: ext.rms_backward(grad, invvar, saved, shape, 1e-5, memory_efficient),
          F.rms_norm(x, shape, eps=1e-5), (x,))  # fmt: skip


def test_dtypes_follow_apex_and_a_wrong_shape_is_named(fused_layer_norm_cuda):
    ext = fused_layer_norm_cuda
    x = torch.randn(3, 8, dtype=torch.half)
    weight, bias = torch.ones(8), torch.zeros(8)
    out, mean, invvar = ext.forward_affine(x, [8], weight.half(), bias.half(), 1e-5)
    assert (out.dtype, mean.dtype, invvar.dtype) == (torch.half, torch.float32, torch.float32)
    out, _, _ = ext.forward_affine_mixed_dtypes(x, [8], weight, bias, 1e-5)
    out_rms, _ = ext.rms_forward_affine_mixed_dtypes(x, [8], weight, 1e-5)
    assert out.dtype == out_rms.dtype == torch.float32
    grad_input, grad_weight, grad_bias = ext.backward_affine(
        torch.ones_like(x), mean, invvar, x, [8], weight.half(), bias.half(), 1e-5
    )
    assert (grad_input.dtype, grad_weight.dtype, grad_bias.dtype) == (torch.half,) * 3
    with pytest.raises(
        ValueError, match=r"normalized_shape \[7\] must be the trailing dims of the input's shape \[3, 8\]"
    ):
        ext.forward_affine(x, [7], weight, bias, 1e-5)


@pytest.mark.filterwarnings("ignore:var_mean.*degrees of freedom")  # no features: torch warns, returns nan stats
def test_hostile_arguments_are_refused_by_name_not_broadcast_into_a_wrong_gradient(fused_layer_norm_cuda):
    ext = fused_layer_norm_cuda
    x = torch.randn(3, 8)
    weight, bias = torch.ones(8), torch.zeros(8)
    _, mean, invvar = ext.forward_affine(x, [8], weight, bias, 1e-5)
    cases = [  # Apex's check_args refused the weights and an empty normalized_shape; its kernels had no integers
        (lambda: ext.forward_affine(x, [8], torch.ones(8, 1), bias, 1e-5), r"gamma must be .* \[8\], got .* \[8, 1\]"),
        (lambda: ext.rms_forward_affine(x, [8], torch.ones(8).long(), 1e-5), r"gamma must be a floating-point"),
        (lambda: ext.forward(x.long(), [8], 1e-5), r"input must be a floating-point tensor, got torch.int64"),
        (lambda: ext.forward(x, [], 1e-5), r"normalized_shape must have at least one dim"),
        (lambda: ext.rms_backward(torch.ones_like(x), invvar[:1], x, [8], 1e-5), r"invvar must be .* \(3\)"),
        (lambda: ext.backward(torch.ones_like(x), mean[:2], invvar, x, [8], 1e-5), r"mean must be .* \(3\)"),
        (lambda: ext.backward(torch.ones(1, 8), mean, invvar, x, [8], 1e-5), r"dout \[1, 8\] must have input_or"),
    ]
    for call, message in cases:  # RuntimeErrors, as Apex's TORCH_CHECKs raised: code written for Apex catches them
        with pytest.raises(RuntimeError, match=message) as raised:
            call()
        assert isinstance(raised.value, TypeError | ValueError)
    out, _, _ = ext.forward(torch.randn(3, 0), [0], 1e-5)  # no features: an empty output, as torch's layer_norm
    assert out.shape == (3, 0)
    # pybind11 refused a memory_efficient that is not a bool (a TypeError); read by truthiness, "False" took the
    # input for the output and returned wrong gradients
    for call in (
        lambda: ext.backward_affine(torch.ones_like(x), mean, invvar, x, [8], weight, bias, 1e-5, "False"),
        lambda: ext.rms_backward(torch.ones_like(x), invvar, x, [8], 1e-5, "False"),
    ):
        with pytest.raises(TypeError, match=r"memory_efficient must be True or False, got 'False'"):
            call()


mix_prec_extension = None  # Megatron-LM 2021-2022's module-level global, its own extension built from Apex's


class MegatronMixPrecLayerNormFunction(torch.autograd.Function):
    """Megatron-LM 2021-2022's FusedLayerNormAffineFunction on its ``fused_mix_prec_layer_norm_cuda``."""

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps):
        ctx.normalized_shape, ctx.eps = normalized_shape, eps
        input_, weight_, bias_ = input.contiguous(), weight.contiguous(), bias.contiguous()
        output, mean, invvar = mix_prec_extension.forward_affine(input_, normalized_shape, weight_, bias_, eps)
        ctx.save_for_backward(input_, weight_, bias_, mean, invvar)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight_, bias_, mean, invvar = ctx.saved_tensors
        grad_input, grad_weight, grad_bias = mix_prec_extension.backward_affine(
            grad_output.contiguous(), mean, invvar, input_, ctx.normalized_shape, weight_, bias_, ctx.eps
        )
        return grad_input, grad_weight, grad_bias, None, None


class Megatron2021MixedFusedLayerNorm(torch.nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-5, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        global mix_prec_extension
        mix_prec_extension = importlib.import_module("fused_mix_prec_layer_norm_cuda")
        self.normalized_shape, self.eps = torch.Size([hidden]), eps
        self.weight = torch.nn.Parameter((torch.rand(hidden, dtype=torch.float64) + 0.5).to(dtype))
        self.bias = torch.nn.Parameter(torch.randn(hidden, dtype=torch.float64).to(dtype))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return MegatronMixPrecLayerNormFunction.apply(input, self.weight, self.bias, self.normalized_shape, self.eps)


def test_megatron_2021_mix_prec_extension_matches_torch(fused_layer_norm_cuda):
    torch.manual_seed(0)
    norm = Megatron2021MixedFusedLayerNorm(8)
    x = _float64(3, 5, 8, offset=4.0)
    y = norm(x)
    expected = F.layer_norm(x, (8,), norm.weight, norm.bias, 1e-5)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, norm.weight, norm.bias), grad)
    want = torch.autograd.grad(expected, (x, norm.weight, norm.bias), grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_megatron_2021_fp32_residual_into_fp16_weights_gives_fp16(fused_layer_norm_cuda):
    """``--fp16 --fp32-residual-connection``: a float32 residual stream normalized by fp16 weights comes out in
    fp16 (the weights' dtype), with float32 statistics; gradients come back in each tensor's dtype."""
    torch.manual_seed(0)
    norm = Megatron2021MixedFusedLayerNorm(16, dtype=torch.float16)
    x = torch.randn(4, 16, requires_grad=True)
    y = norm(x)
    assert y.dtype == torch.float16
    exact = F.layer_norm(x.double(), (16,), norm.weight.double(), norm.bias.double(), 1e-5)
    torch.testing.assert_close(y.double(), exact, rtol=0, atol=4e-3)  # float32 maths, rounded once to fp16
    grad_x, grad_w, grad_b = torch.autograd.grad(y, (x, norm.weight, norm.bias), torch.ones_like(y))
    assert (grad_x.dtype, grad_w.dtype, grad_b.dtype) == (torch.float32, torch.float16, torch.float16)
    _, mean, invvar = mix_prec_extension.forward_affine(x.detach(), [16], norm.weight, norm.bias, 1e-5)
    assert mean.dtype == invvar.dtype == torch.float32 and mean.shape == (4,)


@pytest.mark.parametrize("epsilon", ["1e-5", None, torch.ones(2)], ids=["str", "None", "two_elements"])
def test_an_epsilon_apexs_binding_refused_is_named(fused_layer_norm_cuda, epsilon):
    """pybind11 refused a string or None for Apex's ``double epsilon``; here it failed inside the maths as
    'unsupported operand type(s) for +: Tensor and str', naming neither the function nor the argument."""
    x = torch.randn(4, 8)
    calls = [
        lambda: fused_layer_norm_cuda.forward(x, [8], epsilon),
        lambda: fused_layer_norm_cuda.rms_forward_affine(x, [8], torch.ones(8), epsilon),
    ]
    for call in calls:
        with pytest.raises(TypeError, match=r"^fused_layer_norm_cuda\.\w+: epsilon must be a number"):
            call()
    fused_layer_norm_cuda.forward(x, [8], True)  # a bool is the number 1.0 to pybind11, as to Apex
