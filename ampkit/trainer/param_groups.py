"""Which parameters train: training code changes it mid-run (a fine-tuning run unfreezes its backbone, or adds it to
its optimizer as a param group), and whatever keeps a list of the trainable parameters must follow."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class TrainableParams:
    """Tells a cache of the trainable parameters when to rebuild: training code unfroze or froze a parameter, or
    added a param group, since the last look (a fine-tuning run unfreezing its backbone at some epoch)."""

    def __init__(self, module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self._params = list(module.parameters())
        self._optimizers = list(optimizers)
        self._seen: tuple[Any, ...] | None = None

    def changed(self) -> bool:
        """Whether they changed since the last call (True at the first)."""
        held = sum(len(group["params"]) for optimizer in self._optimizers for group in optimizer.param_groups)
        now = (held, *(param.requires_grad for param in self._params))
        if now == self._seen:
            return False
        self._seen = now
        return True
