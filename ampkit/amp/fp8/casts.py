"""Dynamic float8 scaling in plain torch: amax → scale → scaled, saturating cast, and back.

The arithmetic (float64 reciprocal of a clamped amax, float32 scaling, clamp to the format's range, round to
nearest) is the one torchao's training path uses, so an emulated GEMM here equals its emulate mode bit for bit.
"""

from __future__ import annotations

import torch

from ampkit.amp.fp8.recipes import OperandCast

AMAX_EPS = 1e-12  # a zero tensor still gets a finite scale


def amax(x: torch.Tensor, rowwise: bool, dim: int) -> torch.Tensor:
    """max |x| over the whole tensor (0-dim), or along ``dim`` (kept as a size-1 dimension) when ``rowwise``; an
    empty tensor (an empty batch) has amax 0."""
    if rowwise:
        if x.shape[dim] == 0:
            return x.new_zeros([1 if d == dim % x.dim() else n for d, n in enumerate(x.shape)])
        return torch.amax(torch.abs(x), dim=dim, keepdim=True)
    return torch.max(torch.abs(x)) if x.numel() else x.new_zeros(())


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool) -> torch.Tensor:
    """The float32 scale mapping ``amax`` to ``dtype``'s largest value (rounded down to a power of two if asked)."""
    scale = (torch.finfo(dtype).max / torch.clamp(amax.to(torch.float64), min=AMAX_EPS)).to(torch.float32)
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def to_float8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` in float32, saturated to ``dtype``'s range and rounded to ``dtype``."""
    limit = torch.finfo(dtype).max
    return (x.to(torch.float32) * scale).clamp(min=-limit, max=limit).to(dtype)


def from_float8(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values float8 ``data`` stands for."""
    return data.float() / scale


def scaled_cast(
    x: torch.Tensor, cast: OperandCast, dim: int, power_of_2: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(float8 data, scale, amax)`` of ``x`` cast as ``cast`` says; rowwise scales go along ``dim`` (the GEMM's
    contraction dimension of this operand: -1 for the left one, 0 for the right one)."""
    x_amax = amax(x, cast.rowwise, dim)
    scale = amax_to_scale(x_amax, cast.dtype, power_of_2)
    return to_float8(x, scale, cast.dtype), scale, x_amax
