"""Apex's ``fused_weight_gradient_mlp_cuda`` under the shim, as Megatron-LM's linear layers drive it with
``gradient_accumulation_fusion`` on (its default): the weight gradient of each micro-batch is added into the
parameter's ``main_grad`` buffer, float32 or 16-bit, and autograd gets no weight gradient."""

from __future__ import annotations

import importlib

import pytest
import torch

from ampkit.compat import install_apex_shim, uninstall_apex_shim


@pytest.fixture
def extension():
    install_apex_shim()
    yield importlib.import_module("fused_weight_gradient_mlp_cuda")
    uninstall_apex_shim()


def _megatron_linear(extension):
    class LinearWithGradAccumulation(torch.autograd.Function):  # megatron/core/tensor_parallel/layers.py, 1 rank
        @staticmethod
        def forward(ctx, input, weight, bias):
            ctx.save_for_backward(input, weight)
            return torch.matmul(input, weight.t()) + bias

        @staticmethod
        def backward(ctx, grad_output):
            input, weight = ctx.saved_tensors
            grad_input = grad_output.matmul(weight)
            if weight.main_grad.dtype == torch.float32:
                extension.wgrad_gemm_accum_fp32(input, grad_output, weight.main_grad)
            else:
                extension.wgrad_gemm_accum_fp16(input, grad_output, weight.main_grad)
            return grad_input, None, grad_output.sum(dim=(0, 1))

    return LinearWithGradAccumulation


@pytest.mark.parametrize("main_grad_dtype", [torch.float32, torch.bfloat16])
def test_megatron_linear_accumulates_micro_batches_into_main_grad(extension, main_grad_dtype):
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(5, 4, dtype=torch.bfloat16))
    bias = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
    weight.main_grad = torch.zeros(5, 4, dtype=main_grad_dtype)
    linear = _megatron_linear(extension)
    inputs = [torch.randn(3, 2, 4, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]  # [s, b, h]
    expected = torch.zeros(5, 4, dtype=torch.float64)
    for x in inputs:
        grad = torch.randn(3, 2, 5, dtype=torch.bfloat16)
        linear.apply(x, weight, bias).backward(grad)
        expected += grad.double().reshape(-1, 5).t() @ x.detach().double().reshape(-1, 4)
    assert weight.grad is None
    tolerance = 1e-5 if main_grad_dtype == torch.float32 else 2e-2
    assert torch.allclose(weight.main_grad.double(), expected, rtol=tolerance, atol=tolerance)


def test_a_wrong_main_grad_is_named(extension):
    with pytest.raises(ValueError, match=r"need as many rows and a d_weight of shape \[5, 4\], got \[4, 5\]"):
        extension.wgrad_gemm_accum_fp32(torch.randn(6, 4), torch.randn(6, 5), torch.zeros(4, 5))
    with pytest.raises(TypeError, match="wgrad_gemm_accum_fp32: d_weight must be float32, got torch.float16"):
        extension.wgrad_gemm_accum_fp32(torch.randn(6, 4), torch.randn(6, 5), torch.zeros(5, 4, dtype=torch.half))


def test_integer_or_scalar_activations_are_named(extension):  # Apex's GEMM dispatched on float/half/bf16 only
    main_grad = torch.zeros(5, 4, dtype=torch.half)
    with pytest.raises(TypeError, match="wgrad_gemm_accum_fp16: input must be floating-point, got torch.int64"):
        extension.wgrad_gemm_accum_fp16(torch.ones(6, 4, dtype=torch.long), torch.randn(6, 5), main_grad)
    with pytest.raises(ValueError, match="wgrad_gemm_accum_fp32: d_output must have a feature dim, got a 0-dim"):
        extension.wgrad_gemm_accum_fp32(torch.randn(4), torch.tensor(1.0), torch.zeros(1, 4))
    assert torch.all(main_grad == 0)
