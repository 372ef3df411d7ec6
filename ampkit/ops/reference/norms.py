"""Pure-PyTorch LayerNorm and RMSNorm: the numerics the C++/CUDA kernels must match, and their fallback.

Statistics are computed in float32 (float64 for float64 inputs) whatever the input dtype, as the kernels
do; the result is cast to ``output_dtype`` (default: the input's dtype). Autograd differentiates these
directly, so the fallback needs no hand-written backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ampkit.ops._dtypes import accumulate_dtype


def layer_norm(
    input: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the trailing ``normalized_shape`` dims."""
    acc = accumulate_dtype(input.dtype)
    dims = tuple(range(-len(normalized_shape), 0))
    x = input.to(acc)
    mean = x.mean(dims, keepdim=True)
    centered = x - mean
    variance = centered.square().mean(dims, keepdim=True)
    y = centered * torch.rsqrt(variance + eps)
    if weight is not None:
        y = y * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(output_dtype or input.dtype)


def rms_norm(
    input: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float = 1e-5,
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the trailing ``normalized_shape`` dims."""
    acc = accumulate_dtype(input.dtype)
    dims = tuple(range(-len(normalized_shape), 0))
    x = input.to(acc)
    y = x * torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(acc)
    return y.to(output_dtype or input.dtype)


def batch_norm_stats(input: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (dim 1) mean and ``1 / sqrt(biased var + eps)``, as ``torch.batch_norm_stats``."""
    acc = accumulate_dtype(input.dtype)
    dims = [0, *range(2, input.dim())]
    var, mean = torch.var_mean(input.to(acc), dims, correction=0)
    return mean, torch.rsqrt(var + eps)


def batch_norm_backward_reduce(
    grad_output: torch.Tensor, input: torch.Tensor, mean: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ``sum(dy)`` and ``sum(dy * (x - mean))``: what SyncBatchNorm all-reduces in backward."""
    acc = accumulate_dtype(input.dtype)
    dims = [0, *range(2, input.dim())]
    shape = [1, -1] + [1] * (input.dim() - 2)
    dy = grad_output.to(acc)
    return dy.sum(dims), (dy * (input.to(acc) - mean.to(acc).view(shape))).sum(dims)
