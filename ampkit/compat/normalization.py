"""``apex.normalization`` (and ``apex.normalization.fused_layer_norm``) names, resolved lazily to ampkit's fused
norms in :mod:`ampkit.ops.norms`.

Besides the modules, legacy code (Megatron-style mixed-precision LayerNorms) calls Apex's autograd Functions
directly, ``FusedLayerNormAffineFunction.apply(input, weight, bias, normalized_shape, eps)``, and the
functional forms; both take Apex's arguments here and run ampkit's fused ops.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ampkit.compat.missing_name import missing_name
from ampkit.ops._dtypes import accumulate_dtype

_TARGET_MODULE = "ampkit.ops.norms"
_MODULES = ("FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm")
_FUNCTIONS = (
    "fused_layer_norm_affine",
    "fused_layer_norm",
    "mixed_dtype_fused_layer_norm_affine",
    "fused_rms_norm_affine",
    "fused_rms_norm",
    "mixed_dtype_fused_rms_norm_affine",
)


class _ApexNormFunction:
    """An Apex autograd Function's name: ``.apply`` takes Apex's arguments and runs ampkit's op ``_op``."""

    _op = ""

    @classmethod
    def apply(cls, *args: Any) -> torch.Tensor:
        return getattr(importlib.import_module(_TARGET_MODULE), cls._op)(*args)


class FusedLayerNormAffineFunction(_ApexNormFunction):
    """``apply(input, weight, bias, normalized_shape, eps, memory_efficient=False)``; output in the input dtype."""

    _op = "fused_layer_norm_affine"


class FusedLayerNormAffineMixedDtypesFunction(_ApexNormFunction):
    """``apply(input, weight, bias, normalized_shape, eps, memory_efficient=False)``; output in the weight dtype."""

    _op = "mixed_dtype_fused_layer_norm_affine"


class FusedLayerNormFunction(_ApexNormFunction):
    """``apply(input, normalized_shape, eps, memory_efficient=False)``: no weight or bias."""

    _op = "fused_layer_norm"


class FusedRMSNormAffineFunction(_ApexNormFunction):
    """``apply(input, weight, normalized_shape, eps, memory_efficient=False)``; output in the input dtype."""

    _op = "fused_rms_norm_affine"


class FusedRMSNormAffineMixedDtypesFunction(_ApexNormFunction):
    """``apply(input, weight, normalized_shape, eps, memory_efficient=False)``; output in the weight dtype."""

    _op = "mixed_dtype_fused_rms_norm_affine"


class FusedRMSNormFunction(_ApexNormFunction):
    """``apply(input, normalized_shape, eps, memory_efficient=False)``: no weight."""

    _op = "fused_rms_norm"


def manual_rms_norm(
    input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """Apex's unfused RMSNorm: the mean square in float32 (float64 for float64 input); with a half/bf16 weight the
    result is cast to it."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    dims = tuple(range(-len(shape), 0))
    normed = input * torch.rsqrt(input.to(accumulate_dtype(input.dtype)).pow(2).mean(dims, keepdim=True) + eps)
    if weight is None:
        return normed
    if weight.dtype in (torch.float16, torch.bfloat16):
        normed = normed.to(weight.dtype)
    return weight * normed


_FUNCTION_CLASSES = tuple(cls.__name__ for cls in _ApexNormFunction.__subclasses__())
__all__ = [*_MODULES, *_FUNCTIONS, *_FUNCTION_CLASSES, "manual_rms_norm"]


def __getattr__(name: str) -> Any:
    if name not in (*_MODULES, *_FUNCTIONS):
        raise missing_name(
            f"module {__name__!r} has no attribute {name!r}; Apex norm names are {__all__}",
            "apex.normalization",
            name,
        )
    value = getattr(importlib.import_module(_TARGET_MODULE), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
