"""Apex's ``apex._autocast_utils``: the helpers its fused layers (and copies of them in Megatron, NeMo and
FastLayerNorm ports) call to cast their inputs under autocast before running a kernel with autocast off.

Apex read CUDA's autocast only. Here the autocast of the device the arguments live on is read (CUDA's where they
hold no tensor), so a copied layer runs the same under ``torch.autocast("cpu", ...)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.amp.autocast_mode import _cast

__all__ = ["_cast_if_autocast_enabled"]  # Apex's __all__; the other two are imported by name


def _device_type(args: Sequence[Any]) -> str | None:
    """The device type of the first tensor among ``args``, looking into lists, tuples and dicts; None if none."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device.type
        nested = arg.values() if isinstance(arg, Mapping) else arg if isinstance(arg, (list, tuple)) else ()
        found = _device_type(list(nested))
        if found is not None:
            return found
    return None


def _get_autocast_dtypes() -> Sequence[torch.dtype]:
    """The low-precision dtypes autocast can run here: float16, and bfloat16 where the device has it (a CPU has)."""
    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return [torch.half]
    return [torch.half, torch.bfloat16]


def _get_current_dtype(dtype: torch.dtype | None = None) -> torch.dtype:
    """Autocast's dtype while autocast is on (CUDA's, else the CPU's), else float32, as Apex's answered (its
    ``torch.float or dtype`` never reached ``dtype``)."""
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    return torch.float


def _cast_if_autocast_enabled(*args: Any) -> tuple[Any, ...]:
    """``args`` with their floating tensors (in lists, tuples and dicts too) cast to autocast's dtype when autocast
    is on for their device; unchanged otherwise. float64 tensors and other devices' tensors stay as they are."""
    device_type = _device_type(args) or "cuda"  # Apex's only device
    if not torch.is_autocast_enabled(device_type):
        return args
    return _cast(args, device_type, torch.get_autocast_dtype(device_type))
