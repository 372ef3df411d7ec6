"""A monitored metric (a validation metric, or a ``train/`` epoch mean): which one, whether lower or higher is
better, and by how much."""

from __future__ import annotations

import math
import numbers
from typing import Any

from ampkit.config import METRIC_NAME_RULE, names_a_metric
from ampkit.trainer.callback import Callback
from ampkit.trainer.distributed import broadcast_object
from ampkit.trainer.optimizers import MonitorNotFoundError
from ampkit.trainer.sanity import is_training_metric, unprefixed_note
from ampkit.wording import shown

MODES = ("min", "max")


def check_mode(mode: Any) -> None:
    """Raise a ValueError naming ``mode`` unless it is one of :data:`MODES`."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode {shown(mode)} is invalid; expected one of {', '.join(MODES)}")


class Monitor:
    """``metric`` (``val/loss`` or ``loss``) read from validation's averaged metrics, or a ``train/`` tag read from
    the epoch means of ``log(..., on_epoch=True)`` at each epoch's end (``per_epoch``); ``mode`` min or max."""

    def __init__(self, metric: str, mode: str = "min", min_delta: float = 0.0, key: str | None = None) -> None:
        if not isinstance(metric, str) or not names_a_metric(metric):  # an int failed in str.startswith, naming neither
            raise ValueError(f"monitor {shown(metric)} is invalid; expected {METRIC_NAME_RULE}")
        check_mode(mode)
        if isinstance(min_delta, bool) or not isinstance(min_delta, numbers.Real) or not 0 <= min_delta < math.inf:
            raise ValueError(f"min_delta {shown(min_delta)} is invalid; expected a finite number >= 0")
        self.metric = metric
        self.shown = shown(metric)  # how messages name it: a pasted 100 kB name by its start and length
        self.per_epoch = is_training_metric(metric)
        self.key = metric if self.per_epoch else metric.removeprefix("val/")
        self.mode = mode
        self.min_delta = min_delta
        self.setting = key  # the config key it is set by (``checkpoint.monitor``), for messages

    def __str__(self) -> str:
        """The metric's name: a callback's ``state_key`` of ``f"{type(self).__name__}[{self.monitor}]"`` (the advice
        for several instances of one class) is the same in every process, so a resume finds each one's state."""
        return self.metric

    def __eq__(self, other: object) -> bool:
        """Equal to its metric's name, as Lightning's ``monitor`` is that string: a port's ``ckpt.monitor ==
        "val/loss"`` was False, silently. Two monitors are equal only where they are one."""
        return self.metric == other if isinstance(other, str) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.metric)  # as its name's: equal objects hash alike

    def value(self, metrics: dict[str, float], trainer) -> float:
        """The monitored value among ``metrics`` of the validation that just ran, or a value logged under the
        monitored tag in its ``on_validation_end`` (an AUC a callback or the Trainer computes there, as Lightning
        monitors what ``on_validation_epoch_end`` logs; see ``Trainer.monitored_validation_value``). A missing one is
        a one-line error naming what there is (Lightning's ModelCheckpoint raises too: no ranking skips a
        validation)."""
        value = trainer.monitored_validation_value(self.metric, metrics)
        if value is not None:
            return float(value)
        logged = trainer.validation_end_values
        returned = ", ".join(f"val/{m}" for m in sorted(metrics)) or "nothing"
        raise MonitorNotFoundError(
            f"{self._named()}: {self.shown} is not a metric of the validation at step {trainer.state.global_step}, "
            f"which returned {returned}"
            + (f" and logged {', '.join(sorted(logged))} in on_validation_end" if logged else "")
            + f"; validation_step must return a monitored metric at every validation, or a callback or the Trainer "
            f"log it in on_validation_end with self.log({self.shown}, value)"
        )

    def _named(self) -> str:
        """How a message names this monitor: by the config key that sets it, where one does."""
        return f"config key '{self.setting}'" if self.setting else "monitor"

    def check_reachable(self, trainer) -> None:
        """Refuse a validation metric in a run that never validates, at ``fit`` start: it would rank or stop nothing,
        without a word. The config's monitors are checked when the Trainer is built; this catches a callback given
        in code."""
        t = trainer.settings
        if self.per_epoch or (trainer.num_val_batches != 0 and (t.val_every_n_epochs or t.val_every_n_steps)):
            return
        which = f"config key '{self.setting}'" if self.setting else f"monitor {self.shown}"
        why = (  # num_val_batches is 0 for both: validation turned off says so first
            "trainer.val_every_n_epochs=0 and trainer.val_every_n_steps=0"
            if not (t.val_every_n_epochs or t.val_every_n_steps)
            else "no val_dataloader()"
        )
        raise MonitorNotFoundError(
            f"{which}: {self.shown} is a validation metric, but this run never validates ({why}), so nothing "
            f"would be ranked or stopped on it; validate, or monitor a training value: a train/ tag logged with "
            "self.log(..., on_epoch=True), checked at each epoch's end"
        )

    def epoch_value(self, trainer) -> float:
        """This epoch's mean of the monitored ``train/`` tag, at its end (``train/loss_epoch`` for ``train/loss``
        logged with ``on_step`` too, as Lightning's monitor finds it; a value logged in ``on_train_epoch_end``
        is the epoch's): rank zero's on every rank (the value
        TensorBoard shows), so all ranks rank and stop alike. One not logged is a one-line error naming the tags
        that were."""
        value = trainer.monitored_epoch_value(self.key)
        if value is not None:
            return float(value)
        names = broadcast_object(trainer.monitor_value_names(), trainer.dist)
        if unprefixed := unprefixed_note(self.metric, names):
            advice = f"{unprefixed}log it as self.log({self.shown}, value, on_epoch=True)"
        else:
            others = [name for name in names if is_training_metric(name)]
            instead = f"monitor one of {', '.join(others)}, or " if others else ""
            advice = (
                f"{instead}log {self.shown} in every epoch, e.g. self.log({self.shown}, loss, on_epoch=True) "
                "in training_step, or monitor a value training_step returns (train/loss: its loss)"
            )
        raise MonitorNotFoundError(
            f"{self._named()}: {self.shown} is no epoch mean of epoch {trainer.state.epoch}, which logged "
            f"{', '.join(names) or 'none'}; {advice}"
        )

    def state_dict(self) -> dict[str, str]:
        """Which metric and mode the values a callback saves beside this were measured by."""
        return {"monitor": self.metric, "mode": self.mode}

    def changed_since(self, state: dict[str, Any]) -> str | None:
        """``'val/mse (min) -> val/acc (max)'`` when the callback ``state`` was measured by another metric or mode
        (its values rank nothing under this one), else None (also for a state saved without them)."""
        if "monitor" not in state:
            return None
        before = Monitor(state["monitor"], state.get("mode", "min"))
        if (before.key, before.mode) == (self.key, self.mode):
            return None
        return f"{before.metric} ({before.mode}) -> {self.metric} ({self.mode})"

    def better(self, value: float, than: float) -> bool:
        """Whether ``value`` is strictly better than ``than`` in this mode (no ``min_delta``)."""
        return value < than if self.mode == "min" else value > than

    def improves(self, value: float, best: float | None) -> bool:
        """Whether ``value`` beats ``best`` by more than ``min_delta`` (a non-finite value never does)."""
        if not math.isfinite(value):
            return False
        if best is None:
            return True
        return value < best - self.min_delta if self.mode == "min" else value > best + self.min_delta


class KeyedByMonitor(Callback):
    """A callback whose checkpoint state is keyed by the metric it watches (``EarlyStopping[val/loss]``,
    ``ModelCheckpoint[None]`` without one): several of one class, on other metrics, each save and resume their own,
    as Lightning keys them by their monitor. A checkpoint of an older ampkit, keyed by the class name, or of a run
    that watched another metric still hands it its class's state (``state_key_may_change``).

    A subclass is keyed by the ampkit class it extends (``ModelCheckpoint[None]``), so one that
    ``configure_callbacks()`` returns beside the config's on the same metric clashes with it, as the plain class does,
    instead of running as a second writer or stopper by other rules (Lightning would let it replace the config's); on
    a metric of its own it runs beside it."""

    state_key_may_change = True
    monitor: Monitor | None

    @property
    def state_key(self) -> str:
        # The first class below KeyedByMonitor in the subclass's line (ModelCheckpoint, EarlyStopping).
        keyed = next(
            k for k in reversed(type(self).__mro__) if issubclass(k, KeyedByMonitor) and k is not KeyedByMonitor
        )
        return f"{keyed.__name__}[{self.monitor}]"
