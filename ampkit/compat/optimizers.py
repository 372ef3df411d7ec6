"""``apex.optimizers`` names, resolved lazily to ampkit's fused optimizers in :mod:`ampkit.ops.optimizers`.

Apex's ``FusedAdam``/``FusedLAMB``/... and Ascend's ``FusedAdadelta``/``FusedAdamP``/``FusedRMSprop``/
``FusedRMSpropTF`` keep their names and constructor arguments; importing this module does not load the
kernels, touching a name does. Apex's FusedAdam, FusedLAMB and FusedMixedPrecisionLamb counted steps per param
group: their names here are subclasses that do the same.
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


# Apex counted these optimizers' steps per param group: their Apex names are subclasses that do the same.
_GROUP_STEP_NAMES = ("FusedAdam", "FusedLAMB", "FusedMixedPrecisionLamb")


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}; Apex optimizer names are {__all__}")
    value = getattr(importlib.import_module(_TARGET_MODULE), name)
    if name in _GROUP_STEP_NAMES:
        doc = (
            f"Apex's ``{name}``: :class:`ampkit.ops.optimizers.{name}` counting steps per param group, as Apex "
            "did (a parameter that had no gradient for some steps takes its group's bias correction)."
        )
        value = type(name, (value,), {"_steps_per_group": True, "__module__": __name__, "__doc__": doc})
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
