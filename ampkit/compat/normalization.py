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

from ampkit.missing_name import missing_name
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


def _norms() -> Any:
    return importlib.import_module(_TARGET_MODULE)


class _ApexNormFunction:
    """An Apex autograd Function's name. ``forward(ctx, ...)`` has Apex's argument names, which Megatron inspects
    (``"memory_efficient" in inspect.getfullargspec(F.forward).args``); ``apply`` runs it. ``ctx`` is unused: the
    ampkit op records its own backward."""

    @staticmethod
    def forward(ctx: Any, *args: Any) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def apply(cls, *args: Any) -> torch.Tensor:
        return cls.forward(None, *args)


class FusedLayerNormAffineFunction(_ApexNormFunction):
    """Output in the input dtype."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        normalized_shape: Any,
        eps: float,
        memory_efficient: bool = False,
    ) -> torch.Tensor:
        """Apex's arguments (``ctx`` unused); runs :func:`ampkit.ops.norms.fused_layer_norm_affine`."""
        return _norms().fused_layer_norm_affine(input, weight, bias, normalized_shape, eps, memory_efficient)


class FusedLayerNormAffineMixedDtypesFunction(_ApexNormFunction):
    """Output in the weight dtype."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        normalized_shape: Any,
        eps: float,
        memory_efficient: bool = False,
    ) -> torch.Tensor:
        """Apex's arguments (``ctx`` unused); runs :func:`ampkit.ops.norms.mixed_dtype_fused_layer_norm_affine`."""
        return _norms().mixed_dtype_fused_layer_norm_affine(
            input, weight, bias, normalized_shape, eps, memory_efficient
        )


class FusedLayerNormFunction(_ApexNormFunction):
    """No weight or bias."""

    @staticmethod
    def forward(
        ctx: Any, input: torch.Tensor, normalized_shape: Any, eps: float, memory_efficient: bool = False
    ) -> torch.Tensor:
        """Apex's arguments (``ctx`` unused); runs :func:`ampkit.ops.norms.fused_layer_norm`."""
        return _norms().fused_layer_norm(input, normalized_shape, eps, memory_efficient)


class FusedRMSNormAffineFunction(_ApexNormFunction):
    """Output in the input dtype."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        normalized_shape: Any,
        eps: float,
        memory_efficient: bool = False,
    ) -> torch.Tensor:
        """Apex's arguments (``ctx`` unused); runs :func:`ampkit.ops.norms.fused_rms_norm_affine`."""
        return _norms().fused_rms_norm_affine(input, weight, normalized_shape, eps, memory_efficient)


class FusedRMSNormAffineMixedDtypesFunction(_ApexNormFunction):
    """Output in the weight dtype."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        normalized_shape: Any,
        eps: float,
        memory_efficient: bool = False,
    ) -> torch.Tensor:
        """Apex's arguments (``ctx`` unused); runs :func:`ampkit.ops.norms.mixed_dtype_fused_rms_norm_affine`."""
        return _norms().mixed_dtype_fused_rms_norm_affine(input, weight, normalized_shape, eps, memory_efficient)


class FusedRMSNormFunction(_ApexNormFunction):
    """No weight."""

    @staticmethod
    def forward(
        ctx: Any, input: torch.Tensor, normalized_shape: Any, eps: float, memory_efficient: bool = False
    ) -> torch.Tensor:
        """Apex's arguments (``ctx`` unused); runs :func:`ampkit.ops.norms.fused_rms_norm`."""
        return _norms().fused_rms_norm(input, normalized_shape, eps, memory_efficient)


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


# Apex's nvFuser instance norms (2022-23, CUDA only): MONAI asks for InstanceNorm3dNVFuser and falls back on None
_NVFUSER_INSTANCE_NORMS = ("InstanceNorm1dNVFuser", "InstanceNorm2dNVFuser", "InstanceNorm3dNVFuser")


def __getattr__(name: str) -> Any:
    if name in _NVFUSER_INSTANCE_NORMS:
        raise missing_name(
            f"ampkit's apex shim does not serve apex.normalization.{name} (an nvFuser kernel, removed from Apex in "
            f"2023); use torch.nn.{name.removesuffix('NVFuser')}",
            "apex.normalization",
            name,
        )
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
