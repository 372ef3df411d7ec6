"""Apex's ``apex.parallel.sync_batchnorm_kernel.SyncBatchnormFunction``: the autograd function of Apex's pure-Python
SyncBatchNorm, which programs subclassing ``apex.parallel.SyncBatchNorm`` call with statistics they reduced
themselves (a masked batch norm counting only valid pixels, one normalising with its running statistics).

``forward(input, weight, bias, mean, var, eps, process_group, world_size)`` normalises ``input`` (channels in
dimension 1) with the given ``mean`` and biased ``var``. Its backward is the full batch-norm gradient, as if
``mean`` and ``var`` were the batch's statistics: the per-channel means of ``dy`` and ``dy * (x - mean)`` are
summed over ``process_group`` and divided by ``world_size`` (each rank's batch counts equally, as in Apex) when
torch.distributed is initialised. Weight and bias gradients stay local; data parallelism averages them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ampkit.ops._dtypes import accumulate_dtype

__all__ = ["SyncBatchnormFunction"]


def _channel_shape(x: torch.Tensor) -> list[int]:
    return [1, -1] + [1] * (x.dim() - 2)


def _averaged_over_ranks(tensor: torch.Tensor, process_group: Any, world_size: int) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, dist.ReduceOp.SUM, process_group)
        return tensor / world_size
    return tensor


class SyncBatchnormFunction(torch.autograd.Function):
    """Batch norm with caller-given statistics whose input gradient is averaged over ``process_group``."""

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_variance, eps, process_group, world_size):  # noqa: D102
        if input.dim() < 2 or running_mean.shape != (input.shape[1],) or running_variance.shape != (input.shape[1],):
            raise ValueError(
                f"SyncBatchnormFunction: mean and var must hold one value per channel (dimension 1) of the input "
                f"{tuple(input.shape)}, got {tuple(running_mean.shape)} and {tuple(running_variance.shape)}"
            )
        out_dtype = torch.promote_types(input.dtype, running_mean.dtype)
        compute = accumulate_dtype(out_dtype)
        shape = _channel_shape(input)
        centred = input.to(compute) - running_mean.to(compute).view(shape)
        invstd = torch.rsqrt(running_variance.to(compute) + eps)
        out = centred * invstd.view(shape)
        if weight is not None:
            out = out * weight.to(compute).view(shape)
        if bias is not None:
            out = out + bias.to(compute).view(shape)
        ctx.save_for_backward(centred, invstd, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.process_group, ctx.world_size = process_group, world_size
        ctx.input_dtype = input.dtype
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx, grad_output):  # noqa: D102
        centred, invstd, weight = ctx.saved_tensors
        shape = _channel_shape(centred)
        dims = [0, *range(2, centred.dim())]
        dy = grad_output.to(centred.dtype)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            means = torch.cat([dy.mean(dims), (dy * centred).mean(dims)])
            mean_dy, mean_dy_xmu = _averaged_over_ranks(means, ctx.process_group, ctx.world_size).chunk(2)
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            dx = dy - mean_dy.view(shape) - centred * (invstd.square() * mean_dy_xmu).view(shape)
            grad_input = (dx * scale.view(shape)).to(ctx.input_dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (centred * invstd.view(shape) * dy).sum(dims).to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = dy.sum(dims).to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None
