"""Stop training once it has run for ``trainer.max_time`` (wall-clock time, earlier runs of its lineage included)."""

from __future__ import annotations

import time
from typing import Any

from ampkit.amp.scaler import positive_option
from ampkit.trainer.callback import Callback
from ampkit.trainer.console import say


class MaxTime(Callback):
    """Sets ``trainer.state.should_stop`` at the end of the first iteration after ``max_time_s`` seconds of training.
    The time so far is saved in checkpoints (as Lightning's ``Timer`` does), so a resumed run counts on from it."""

    def __init__(self, max_time_s: float) -> None:
        self.max_time_s = positive_option(max_time_s, "MaxTime: max_time_s")  # seconds; trainer.max_time also
        # takes "HH:MM:SS" and null (no limit), and then builds no MaxTime
        self.elapsed_before = 0.0  # seconds trained by the runs this one resumed
        self._started: float | None = None

    def elapsed(self) -> float:
        """Seconds of training so far, earlier runs of this lineage included."""
        return self.elapsed_before + (0.0 if self._started is None else time.monotonic() - self._started)

    def on_train_start(self, trainer) -> None:
        self._started = time.monotonic()

    def on_train_batch_end(self, trainer, outputs: dict[str, Any], batch: Any) -> None:
        s = trainer.state
        if not s.is_iteration_end or s.should_stop:
            return
        # Under torchrun each rank reads its own clock; the loop stops every rank once any one has asked.
        if self.elapsed() >= self.max_time_s:
            reason = f"trainer.max_time={self.max_time_s:g}s reached after {self.elapsed():.1f}s of training"
            s.should_stop, s.stop_reason = True, reason
            if trainer.is_global_zero:
                say(f"ampkit: {reason}, at step {s.global_step}")

    def state_dict(self) -> dict[str, Any]:
        return {"elapsed_s": self.elapsed()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.elapsed_before = float(state["elapsed_s"])
