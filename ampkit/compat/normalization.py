"""``apex.normalization`` names, resolved lazily to ampkit's fused norms in :mod:`ampkit.ops.norms`."""

from __future__ import annotations

import importlib
from typing import Any

_TARGET_MODULE = "ampkit.ops.norms"
_APEX_NAMES = ("FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm")
__all__ = list(_APEX_NAMES)


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}; Apex norm names are {__all__}")
    value = getattr(importlib.import_module(_TARGET_MODULE), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
