"""Per-loss found_inf flags that live across iterations, so a clean iteration allocates none."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ampkit.trainer.state import LossState


class FoundInfFlags:
    """One one-element float32 found_inf flag per ``loss_id``. An inf/nan check only ever sets a flag, so a
    flag is reused until an iteration finds it set; :meth:`renew` then swaps it for a fresh zero one."""

    def __init__(self) -> None:
        self._flags: dict[Any, torch.Tensor] = {}

    def get(self, loss_id: Any, device: torch.device) -> torch.Tensor:
        """The flag of ``loss_id`` (zero unless a check of this iteration set it), created on ``device``."""
        flag = self._flags.get(loss_id)
        if flag is None:
            flag = self._flags[loss_id] = torch.zeros(1, dtype=torch.float32, device=device)
        return flag

    def renew(self, losses: Mapping[Any, LossState], everything: bool = False) -> None:
        """At the end of an iteration (its flags read and agreed): drop the flags of the losses that overflowed;
        ``everything``: all of them (a Trainer that keeps the verdicts on the device has read none yet)."""
        if everything:
            self._flags.clear()
            return
        for loss_id in [k for k in self._flags if losses[k].found_inf]:
            del self._flags[loss_id]
