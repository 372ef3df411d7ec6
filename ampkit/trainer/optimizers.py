"""Normalise what ``configure_optimizers`` returns into named optimizers with their schedulers."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SchedulerSpec:
    """An LR scheduler and when it steps: every ``frequency`` iterations or epochs; ``monitor``: val metric."""

    scheduler: Any
    interval: str = "step"
    frequency: int = 1
    monitor: str | None = None


@dataclass
class OptimizerSpec:
    name: str
    optimizer: torch.optim.Optimizer
    schedulers: list[SchedulerSpec] = field(default_factory=list)


_ACCEPTED = (
    "an Optimizer, a list of Optimizers, or dicts {'optimizer': opt, 'lr_scheduler': sched or "
    "{'scheduler': sched, 'interval': 'step'|'epoch', 'frequency': n, 'monitor': 'val/metric'}, 'name': str}"
)


def _scheduler_spec(value: Any, where: str) -> SchedulerSpec:
    if isinstance(value, dict):
        unknown = set(value) - {"scheduler", "interval", "frequency", "monitor"}
        if unknown or "scheduler" not in value:
            raise ValueError(
                f"{where}: lr_scheduler dict needs 'scheduler' and may have interval/frequency/"
                f"monitor; got keys {sorted(value)}"
            )
        spec = SchedulerSpec(**value)
    else:
        spec = SchedulerSpec(scheduler=value)
    if spec.interval not in ("step", "epoch"):
        raise ValueError(f"{where}: lr_scheduler interval '{spec.interval}' must be 'step' or 'epoch'")
    if spec.frequency < 1:
        raise ValueError(f"{where}: lr_scheduler frequency {spec.frequency} must be >= 1")
    return spec


def normalize_optimizers(result: Any) -> list[OptimizerSpec]:
    """Accept the usual shapes; names default to the lower-cased class name, suffixed when repeated."""
    items = list(result) if isinstance(result, list | tuple) else [result]
    if not items:
        raise ValueError(f"configure_optimizers returned nothing; return {_ACCEPTED}")
    specs: list[OptimizerSpec] = []
    for i, item in enumerate(items):
        where = f"configure_optimizers()[{i}]"
        if isinstance(item, torch.optim.Optimizer):
            specs.append(OptimizerSpec(name="", optimizer=item))
        elif isinstance(item, dict) and isinstance(item.get("optimizer"), torch.optim.Optimizer):
            unknown = set(item) - {"optimizer", "lr_scheduler", "name"}
            if unknown:
                raise ValueError(f"{where}: unknown keys {sorted(unknown)}; return {_ACCEPTED}")
            scheds = item.get("lr_scheduler")
            scheds = scheds if isinstance(scheds, list) else ([] if scheds is None else [scheds])
            specs.append(
                OptimizerSpec(
                    name=str(item.get("name") or ""),
                    optimizer=item["optimizer"],
                    schedulers=[_scheduler_spec(s, where) for s in scheds],
                )
            )
        else:
            raise ValueError(f"{where} is {type(item).__name__}; return {_ACCEPTED}")
    defaults = Counter(type(s.optimizer).__name__.lower() for s in specs if not s.name)
    seen: Counter[str] = Counter()
    for spec in specs:
        if not spec.name:
            base = type(spec.optimizer).__name__.lower()
            spec.name = base if defaults[base] == 1 else f"{base}_{seen[base]}"
            seen[base] += 1
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"optimizer names must be unique, got {names}")
    if len({id(s.optimizer) for s in specs}) != len(specs):
        raise ValueError("the same optimizer object was returned twice by configure_optimizers")
    return specs
