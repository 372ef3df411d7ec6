"""``apex.optimizers`` names, resolved lazily to ampkit's fused optimizers in :mod:`ampkit.ops.optimizers`.

Apex's ``FusedAdam``/``FusedLAMB``/... and Ascend's ``FusedAdadelta``/``FusedAdamP``/``FusedRMSprop``/
``FusedRMSpropTF`` keep their names and constructor arguments; importing this module does not load the
kernels, touching a name does.
"""

from __future__ import annotations

import importlib
from typing import Any

_TARGET_MODULE = "ampkit.ops.optimizers"
_APEX_NAMES = (
    "FusedAdam",
    "FusedSGD",
    "FusedLAMB",
    "FusedNovoGrad",
    "FusedAdagrad",
    "FusedAdadelta",
    "FusedAdamP",
    "FusedRMSprop",
    "FusedRMSpropTF",
    "FusedMixedPrecisionLamb",
)
__all__ = list(_APEX_NAMES)


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}; Apex optimizer names are {__all__}")
    value = getattr(importlib.import_module(_TARGET_MODULE), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
