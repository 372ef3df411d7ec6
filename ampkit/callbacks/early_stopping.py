"""Stop training when a validation metric stops improving."""

from __future__ import annotations

import sys
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_warn

from ampkit.callbacks.monitor import Monitor
from ampkit.trainer.callback import Callback


class EarlyStopping(Callback):
    """Sets ``trainer.state.should_stop`` after ``patience`` validations in a row without an improvement of
    ``monitor`` by more than ``min_delta`` (``mode``: ``min`` or ``max``); the loop then ends after the
    current batch. Its best value and count are saved in checkpoints, so a resumed run keeps counting."""

    def __init__(self, monitor: str, mode: str = "min", patience: int = 3, min_delta: float = 0.0) -> None:
        if patience < 1:
            raise ValueError(f"patience {patience!r} is invalid; expected an integer >= 1")
        self.monitor = Monitor(monitor, mode, min_delta, key="early_stopping.monitor")
        self.patience = patience
        self.best: float | None = None
        self.wait = 0

    def on_validation_end(self, trainer, metrics: dict[str, float]) -> None:
        if trainer.state.stage != "fit":  # a standalone validate() is no training progress
            return
        value = self.monitor.value(metrics, trainer.state.global_step)
        if self.monitor.improves(value, self.best):
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            reason = f"early stopping: {self.monitor.metric} did not improve on {self.best} for {self.wait} validations"
            trainer.state.should_stop, trainer.state.stop_reason = True, reason
            if trainer.is_global_zero:
                print(f"ampkit: {reason}, at step {trainer.state.global_step}", file=sys.stderr)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait, **self.monitor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved best value and count; a checkpoint of another monitor or mode starts counting afresh."""
        change = self.monitor.changed_since(state)
        if change is not None:
            rank_zero_warn(
                f"early_stopping.monitor or mode changed since the checkpoint ({change}): its best value "
                f"{state['best']} is not one of this metric, so patience counts afresh"
            )
            return
        self.best, self.wait = state["best"], state["wait"]
