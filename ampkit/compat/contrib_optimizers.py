"""``apex.contrib.optimizers``: where Apex moved its first fused API. ``FP16_Optimizer`` and the first ``FusedAdam``
are served (:mod:`ampkit.compat.legacy_fused_adam`); NVIDIA's BERT ``run_swag.py`` imports ``FP16_Optimizer`` from
here. The distributed optimizers and this package's ``FusedLAMB``/``FusedSGD`` are not.
"""

from __future__ import annotations

from typing import Any

from ampkit.compat._unserved import unserved_advice
from ampkit.compat.legacy_fused_adam import FP16_Optimizer
from ampkit.compat.legacy_fused_adam import LegacyFusedAdam as FusedAdam
from ampkit.missing_name import missing_name

__all__ = ["FP16_Optimizer", "FusedAdam"]

_INSTEAD = {
    "FusedLAMB": "apex.optimizers.FusedLAMB",
    "FusedSGD": "apex.optimizers.FusedSGD",
    "DistributedFusedAdam": "apex.optimizers.FusedAdam with torch's ZeroRedundancyOptimizer or FSDP",
    "DistributedFusedLAMB": "apex.optimizers.FusedLAMB with torch's ZeroRedundancyOptimizer or FSDP",
}


def __getattr__(name: str) -> Any:
    advice = unserved_advice(f"apex.contrib.optimizers.{name}")  # a module of Apex's package: distributed_fused_adam
    if advice is not None:
        raise missing_name(advice, "apex.contrib.optimizers", name, submodule=True)
    instead = f"; use {_INSTEAD[name]}" if name in _INSTEAD else ""
    raise missing_name(
        f"ampkit's apex.contrib.optimizers provides FP16_Optimizer and FusedAdam (Apex's first API), not {name!r}"
        f"{instead}",
        "apex.contrib.optimizers",
        name,
    )
