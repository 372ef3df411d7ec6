"""The float8 training recipes: how each operand of a Linear's three GEMMs is cast.

A Linear ``y = x @ W.t()`` runs three GEMMs, each ``A (M, K) @ B (K, N)``: the output ``x @ W.t()``, the input
gradient ``dy @ W`` and the weight gradient ``dy.t() @ x``. Each operand is cast to float8 with a scale that makes
its largest magnitude the format's largest value; the scale is one per tensor (tensorwise) or one per slice along
the contraction dimension (rowwise: one per row of ``A``, one per column of ``B``), or the operand stays in high
precision. The three recipes (the names torchao uses):

- ``tensorwise``: every operand per tensor; e4m3 forward, e5m2 for the output gradient. Fastest.
- ``rowwise``: every operand rowwise, all e4m3, scales rounded down to a power of two.
- ``rowwise_with_gw_hp``: as rowwise, but the weight gradient GEMM stays in high precision and the weight is cast
  per tensor for the input gradient. Most accurate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ampkit.wording import shown

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


@dataclass(frozen=True)
class OperandCast:
    """How one GEMM operand is cast: ``dtype`` None keeps it in high precision; ``rowwise`` scales each slice
    along the contraction dimension instead of the whole tensor."""

    dtype: torch.dtype | None
    rowwise: bool = False

    @property
    def high_precision(self) -> bool:
        """Whether this operand stays in high precision (no float8 cast)."""
        return self.dtype is None


@dataclass(frozen=True)
class Float8Recipe:
    """The casts of a Linear's six GEMM operands, and whether scales are rounded down to powers of two."""

    name: str
    input: OperandCast  # x in the output GEMM
    weight: OperandCast  # W.t() in the output GEMM
    grad_output: OperandCast  # dy in the input-gradient GEMM
    weight_for_grad_input: OperandCast  # W in the input-gradient GEMM
    grad_output_for_grad_weight: OperandCast  # dy.t() in the weight-gradient GEMM
    input_for_grad_weight: OperandCast  # x in the weight-gradient GEMM
    power_of_2_scales: bool = False


_TENSOR_E4M3 = OperandCast(E4M3)
_TENSOR_E5M2 = OperandCast(E5M2)
_ROW_E4M3 = OperandCast(E4M3, rowwise=True)
_HIGH = OperandCast(None)

RECIPES: dict[str, Float8Recipe] = {
    "tensorwise": Float8Recipe(
        "tensorwise", _TENSOR_E4M3, _TENSOR_E4M3, _TENSOR_E5M2, _TENSOR_E4M3, _TENSOR_E5M2, _TENSOR_E4M3
    ),
    "rowwise": Float8Recipe(
        "rowwise", _ROW_E4M3, _ROW_E4M3, _ROW_E4M3, _ROW_E4M3, _ROW_E4M3, _ROW_E4M3, power_of_2_scales=True
    ),
    "rowwise_with_gw_hp": Float8Recipe(
        "rowwise_with_gw_hp", _ROW_E4M3, _ROW_E4M3, _ROW_E4M3, _TENSOR_E4M3, _HIGH, _HIGH, power_of_2_scales=True
    ),
}
"""The float8 recipes by name (precision.fp8.recipe): tensorwise, rowwise, rowwise_with_gw_hp."""


def recipe_named(name: str) -> Float8Recipe:
    """The recipe called ``name``; a ValueError lists the valid names."""
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown fp8 recipe {shown(name)}; expected one of {', '.join(RECIPES)}") from None
