"""Float8 training: the recipes, ampkit's pure-torch reference casts and Linear, the converter (reference or
torchao backend) and per-layer telemetry. Nothing here imports torchao until a torchao conversion asks for it."""

from ampkit.amp.fp8.casts import amax, amax_to_scale, from_float8, scaled_cast, to_float8
from ampkit.amp.fp8.convert import (
    BACKENDS,
    INSTALL_HINT,
    Float8Conversion,
    convert_to_float8,
    fp8_gemm_capable,
    is_float8_linear,
    torchao_available,
    torchao_import_error,
)
from ampkit.amp.fp8.linear import Float8Linear, Float8Matmul, scaled_mm
from ampkit.amp.fp8.recipes import RECIPES, Float8Recipe, OperandCast, recipe_named
from ampkit.amp.fp8.telemetry import ROLES, Float8Recorder, OperandStats, operand_stats

__all__ = [
    "BACKENDS",
    "INSTALL_HINT",
    "RECIPES",
    "ROLES",
    "Float8Conversion",
    "Float8Linear",
    "Float8Matmul",
    "Float8Recipe",
    "Float8Recorder",
    "OperandCast",
    "OperandStats",
    "amax",
    "amax_to_scale",
    "convert_to_float8",
    "fp8_gemm_capable",
    "from_float8",
    "is_float8_linear",
    "operand_stats",
    "recipe_named",
    "scaled_cast",
    "scaled_mm",
    "to_float8",
    "torchao_available",
    "torchao_import_error",
]
