"""Apex's ``fused_weight_gradient_mlp_cuda`` extension, a top-level module served while the apex shim is installed.

Megatron-LM's linear layers accumulate their weight gradient straight into ``weight.main_grad`` through it when
``gradient_accumulation_fusion`` is on, Megatron's default, and refuse to build without it. Each op adds
``d_output^T @ input`` (both flattened to 2-D) into ``d_weight`` in place, with float32 accumulation as Apex's
GEMMs: ``wgrad_gemm_accum_fp32`` into a float32 ``d_weight``, ``wgrad_gemm_accum_fp16`` into a float16/bfloat16 one
(the sum rounded once).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["wgrad_gemm_accum_fp16", "wgrad_gemm_accum_fp32"]


def _weight_gradient(op: str, input: Tensor, d_output: Tensor, d_weight: Tensor) -> Tensor:
    """``d_output^T @ input`` in float32, after checking the shapes against ``d_weight``."""
    for name, tensor in (("input", input), ("d_output", d_output)):
        if not tensor.is_floating_point():
            raise TypeError(f"fused_weight_gradient_mlp_cuda.{op}: {name} must be floating-point, got {tensor.dtype}")
        if tensor.dim() == 0:
            raise ValueError(f"fused_weight_gradient_mlp_cuda.{op}: {name} must have a feature dim, got a 0-dim tensor")
    input_2d = input.reshape(-1, input.shape[-1])
    d_output_2d = d_output.reshape(-1, d_output.shape[-1])
    expected = (d_output_2d.shape[1], input_2d.shape[1])
    if input_2d.shape[0] != d_output_2d.shape[0] or tuple(d_weight.shape) != expected:
        raise ValueError(
            f"fused_weight_gradient_mlp_cuda.{op}: input {list(input.shape)} and d_output {list(d_output.shape)} "
            f"need as many rows and a d_weight of shape {list(expected)}, got {list(d_weight.shape)}"
        )
    return d_output_2d.float().t() @ input_2d.float()


def wgrad_gemm_accum_fp32(input: Tensor, d_output: Tensor, d_weight: Tensor) -> None:
    """``d_weight += d_output^T @ input`` for a float32 ``d_weight`` (Megatron's float32 ``main_grad``)."""
    if d_weight.dtype != torch.float32:
        raise TypeError(
            f"fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32: d_weight must be float32, got {d_weight.dtype}"
        )
    d_weight.add_(_weight_gradient("wgrad_gemm_accum_fp32", input, d_output, d_weight))


def wgrad_gemm_accum_fp16(input: Tensor, d_output: Tensor, d_weight: Tensor) -> None:
    """``d_weight += d_output^T @ input`` for a float16/bfloat16 ``d_weight``, summed in float32, rounded once."""
    if d_weight.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(
            f"fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16: d_weight must be float16 or bfloat16, got "
            f"{d_weight.dtype}"
        )
    total = d_weight.float() + _weight_gradient("wgrad_gemm_accum_fp16", input, d_output, d_weight)
    d_weight.copy_(total)
