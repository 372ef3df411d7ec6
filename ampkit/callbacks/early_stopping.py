"""Stop training when a monitored metric stops improving, turns NaN/inf, or crosses a threshold."""

from __future__ import annotations

import math
import numbers
from enum import Enum
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from ampkit.amp.scaler import interval_option
from ampkit.callbacks.lightning_attributes import RefusesLightningAttributes
from ampkit.callbacks.monitor import KeyedByMonitor, Monitor
from ampkit.lightning_settings import LIGHTNING_ZERO, lightning_arguments_error, lightning_positional_error
from ampkit.ops._switches import checked_switch
from ampkit.trainer.callback import Phase
from ampkit.trainer.console import say
from ampkit.wording import beyond_float, counted, shown


class EarlyStoppingReason(Enum):
    """Why an :class:`EarlyStopping` stopped the run (its ``stopping_reason``), by Lightning's names."""

    NOT_STOPPED = "not_stopped"
    STOPPING_THRESHOLD = "stopping_threshold"
    DIVERGENCE_THRESHOLD = "divergence_threshold"
    PATIENCE_EXHAUSTED = "patience_exhausted"
    NON_FINITE_METRIC = "non_finite_metric"


class EarlyStopping(KeyedByMonitor, RefusesLightningAttributes):
    """Sets ``trainer.state.should_stop`` after ``patience`` validations in a row without an improvement of
    ``monitor`` by more than ``min_delta`` (``mode``: ``min`` or ``max``); the loop then ends after the
    current batch. A ``train/`` monitor is the epoch mean of a ``log(..., on_epoch=True)`` tag, checked at the end
    of each whole epoch, so patience counts epochs. Its best value and count are saved in checkpoints, so a resumed run
    keeps counting.

    As Lightning's ``EarlyStopping`` it also stops at the first validation whose value is NaN/inf
    (``check_finite``: a diverged run gains nothing from ``patience`` more validations), better than
    ``stopping_threshold`` (good enough) or worse than ``divergence_threshold`` (beyond recovery).
    """

    # After the Trainer's own on_train_epoch_end and on_validation_end, which may log the monitored value (and before
    # the checkpoint's, so that its checkpoint records a stop), as Lightning runs monitoring callbacks after the
    # module's hooks.
    hook_phases = {"on_train_epoch_end": Phase.PERSIST, "on_validation_end": Phase.PERSIST}
    reads_logged_values = True  # and after a PERSIST-phase callback that logs the monitored value, wherever it stands
    takes_part_in_collectives = True  # rank zero's monitored value is broadcast; a subclass takes the same collectives

    def __init__(
        self,
        monitor: str,
        mode: str = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        check_finite: bool = True,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        **lightning_only: Any,
    ) -> None:
        if lightning_only:  # check_on_train_epoch_end, verbose...: a port hears what does their work here
            raise lightning_arguments_error(type(self), list(lightning_only))
        if isinstance(mode, numbers.Real) and not isinstance(mode, bool):  # Lightning's min_delta comes second
            raise lightning_positional_error(type(self), "mode", mode)
        self.patience = patience
        watched = Monitor(monitor, mode, min_delta)  # default_callbacks names the config key of the config's
        stopping = _threshold("stopping_threshold", stopping_threshold)
        divergence = _threshold("divergence_threshold", divergence_threshold)
        self._monitor = _checked(watched, stopping, divergence)
        self._stopping_threshold, self._divergence_threshold = stopping, divergence
        self.check_finite = check_finite
        self.best: float | None = None
        self.wait = 0
        self.stopped_epoch = 0  # Lightning's: the epoch (0-based) whose check stopped the run, 0 while none did
        # Lightning's too: which rule stopped the run, and the line that said why (None while none did)
        self.stopping_reason = EarlyStoppingReason.NOT_STOPPED
        self.stopping_reason_message: str | None = None

    @property
    def monitor(self) -> Monitor:
        """The monitored metric (equal to its name, as Lightning's string is); a name assigned after construction
        (``es.monitor = "val/acc"``, as Lightning allows) is checked as the constructor's."""
        return self._monitor

    @monitor.setter
    def monitor(self, metric: str) -> None:
        self._watch(self._thresholds_kept(Monitor(metric, self.mode, self.min_delta)))

    @property
    def mode(self) -> str:
        """Lightning's ``mode``: ``min`` or ``max``; assignable, checked as the constructor's."""
        return self._monitor.mode

    @mode.setter
    def mode(self, mode: str) -> None:
        self._watch(self._thresholds_kept(Monitor(self._monitor.metric, mode, self.min_delta, self._monitor.setting)))

    @property
    def min_delta(self) -> float:
        """Lightning's ``min_delta``, as given (>= 0; Lightning's holds it negated in ``min`` mode); assignable, checked
        as the constructor's."""
        return self._monitor.min_delta

    @min_delta.setter
    def min_delta(self, min_delta: float) -> None:
        self._monitor = Monitor(self._monitor.metric, self.mode, min_delta, self._monitor.setting)

    @property
    def patience(self) -> int:
        """The validations in a row without an improvement that stop the run; assignable, checked as the
        constructor's."""
        return self._patience

    @patience.setter
    def patience(self, patience: int) -> None:
        if isinstance(patience, numbers.Real) and not isinstance(patience, bool) and patience == 0:
            raise ValueError(f"EarlyStopping: patience=0: expected an integer >= 1 ({LIGHTNING_ZERO['patience']})")
        self._patience = interval_option(patience, "EarlyStopping: patience")

    def _watch(self, monitor: Monitor) -> None:
        """Watch ``monitor`` from now on; the best value of another metric or mode is none of it, so patience counts
        afresh (as a resume by another one counts)."""
        if monitor.changed_since(self._monitor.state_dict()) is not None:
            self.best, self.wait = None, 0
        self._monitor = monitor

    def _thresholds_kept(self, monitor: Monitor) -> Monitor:
        """``monitor``, once its mode leaves some value between this callback's thresholds."""
        return _checked(monitor, self.stopping_threshold, self.divergence_threshold)

    @property
    def stopping_threshold(self) -> float | None:
        """Stop at the first value better than this (None: never); assignable, checked as the constructor's."""
        return self._stopping_threshold

    @stopping_threshold.setter
    def stopping_threshold(self, value: float | None) -> None:
        value = _threshold("stopping_threshold", value)
        _checked(self._monitor, value, self.divergence_threshold)
        self._stopping_threshold = value

    @property
    def divergence_threshold(self) -> float | None:
        """Stop at the first value worse than this (None: never); assignable, checked as the constructor's."""
        return self._divergence_threshold

    @divergence_threshold.setter
    def divergence_threshold(self, value: float | None) -> None:
        value = _threshold("divergence_threshold", value)
        _checked(self._monitor, self.stopping_threshold, value)
        self._divergence_threshold = value

    @property
    def check_finite(self) -> bool:
        """Stop at the first NaN/inf value; assignable, checked as the constructor's (``"False"`` is no switch)."""
        return self._check_finite

    @check_finite.setter
    def check_finite(self, check_finite: bool) -> None:
        self._check_finite = checked_switch("EarlyStopping", "check_finite", check_finite)  # bool("False") is True

    @property
    def wait(self) -> int:
        """The checks in a row without an improvement; assignable (an integer >= 0), checked when set rather than at the
        next check's comparison."""
        return self._wait

    @wait.setter
    def wait(self, wait: int) -> None:
        if isinstance(wait, bool) or not isinstance(wait, numbers.Integral) or wait < 0:
            raise ValueError(
                f"EarlyStopping: wait={shown(wait)}: expected an integer >= 0 (the checks in a row without an "
                "improvement)"
            )
        self._wait = int(wait)

    @property
    def best(self) -> float | None:
        """The best value so far (None before a check); assignable (a finite number or None), checked when set."""
        return self._best

    @best.setter
    def best(self, best: float | None) -> None:
        if best is not None and not _finite_number(best):  # a str failed at the next check's comparison
            raise ValueError(
                f"EarlyStopping: best={shown(best)}: expected a finite number or None (the best value so far)"
            )
        self._best = None if best is None else float(best)  # a numpy float would not load under weights_only

    @property
    def wait_count(self) -> int:
        """Lightning's name of :attr:`wait`: the checks in a row without an improvement."""
        return self.wait

    @property
    def best_score(self) -> float | None:
        """Lightning's name of :attr:`best`: the best value so far (a float, not a tensor; None before a check)."""
        return self.best

    def on_fit_start(self, trainer) -> None:
        self.monitor.check_reachable(trainer)

    def on_validation_end(self, trainer, metrics: dict[str, float]) -> None:
        if trainer.state.stage != "fit" or self.monitor.per_epoch:  # a standalone validate() is no training progress
            return
        self._check(trainer, self.monitor.value(metrics, trainer), "validation")

    def on_train_epoch_end(self, trainer) -> None:
        # A train/ epoch mean: Lightning's check_on_train_epoch_end. Not of an epoch a stop cut short (max_steps): the
        # run ends there anyway, and a resume that finishes the epoch checks it then, so it counts once.
        if self.monitor.per_epoch and trainer.state.epoch_finished:
            self._check(trainer, self.monitor.epoch_value(trainer), "epoch")

    def _check(self, trainer, value: float, check: str) -> None:
        """Count ``value`` against ``patience`` (``check``: what it counts, for the message), and stop if due."""
        # a value that stops the run at once is not counted, as in Lightning: a diverged one was taken as the best
        why, reason = self._stop_at_once(value)
        if reason is None and self.monitor.improves(value, self.best):
            self.best, self.wait = value, 0
        elif reason is None:
            self.wait += 1
            if self.wait >= self.patience:
                checks = counted(self.wait, check)
                why = EarlyStoppingReason.PATIENCE_EXHAUSTED
                reason = f"{self.monitor.metric} did not improve on {self.best} for {checks}"
        if reason is None:
            return
        self.stopping_reason, self.stopping_reason_message = why, reason
        reason = f"early stopping: {reason}"
        self.stopped_epoch = trainer.state.epoch
        trainer.state.should_stop, trainer.state.stop_reason = True, reason
        if trainer.is_global_zero:
            say(f"ampkit: {reason}, at step {trainer.state.global_step}")

    def _stop_at_once(self, value: float) -> tuple[EarlyStoppingReason, str | None]:
        """Which rule ends the run at ``value`` whatever the patience, and why (Lightning's order: non-finite, then
        each threshold); ``NOT_STOPPED`` and None when none does."""
        metric = self.monitor.metric
        if not math.isfinite(value) and self.check_finite:  # else an inf is still past a threshold, as in Lightning
            return EarlyStoppingReason.NON_FINITE_METRIC, (
                f"{metric} is {value}, not finite (best was {self.best}): the run diverged; set "
                "early_stopping.check_finite=false to count it against patience instead"
            )
        if self.stopping_threshold is not None and self.monitor.better(value, self.stopping_threshold):
            return EarlyStoppingReason.STOPPING_THRESHOLD, (
                f"{metric} = {value} reached early_stopping.stopping_threshold={self.stopping_threshold}"
            )
        if self.divergence_threshold is not None and self.monitor.better(self.divergence_threshold, value):
            return EarlyStoppingReason.DIVERGENCE_THRESHOLD, (
                f"{metric} = {value} is past early_stopping.divergence_threshold={self.divergence_threshold}"
            )
        return EarlyStoppingReason.NOT_STOPPED, None

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "wait": self.wait,
            "stopped_epoch": self.stopped_epoch,
            "stopping_reason": self.stopping_reason.value,  # its value, a str: a weights_only load takes no Enum
            "stopping_reason_message": self.stopping_reason_message,
            **self.monitor.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved best value and count; a checkpoint of another monitor or mode starts counting afresh."""
        change = self.monitor.changed_since(state)
        if change is not None:
            rank_zero_warn(
                f"early_stopping.monitor or mode changed since the checkpoint ({change}): its best value "
                f"{state['best']} is not one of this metric, so patience counts afresh"
            )
            return
        best, wait, stopped_epoch = state["best"], state["wait"], state.get("stopped_epoch", 0)  # none in an older one
        if isinstance(best, torch.Tensor) and best.numel() == 1:  # as a metric logged as a tensor may have been
            best = float(best)
        if best is not None and not _finite_number(best):
            raise _damaged("best", best, "None or a finite number")
        for key, count in (("wait", wait), ("stopped_epoch", stopped_epoch)):
            if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
                raise _damaged(key, count, "an integer >= 0")
        self.best, self.wait, self.stopped_epoch = best, int(wait), int(stopped_epoch)
        self.stopping_reason = _saved_reason(state.get("stopping_reason", EarlyStoppingReason.NOT_STOPPED.value))
        message = state.get("stopping_reason_message")  # as stopped_epoch
        if message is not None and not isinstance(message, str):
            raise _damaged("stopping_reason_message", message, "a string or None")
        self.stopping_reason_message = message


def _finite_number(value: Any) -> bool:
    """Whether ``value`` is a finite real number (not a bool, nor an int no float holds)."""
    return (
        not isinstance(value, bool)
        and isinstance(value, numbers.Real)
        and not beyond_float(value)
        and math.isfinite(value)
    )


def _threshold(name: str, value: Any) -> float | None:
    """``value`` of threshold ``name`` if it is None or a finite number, else a ValueError naming it."""
    if value is not None and not _finite_number(value):
        # a str (or an int no float holds) failed in math.isfinite naming neither; True was a threshold of 1
        raise ValueError(f"{name} {shown(value)} is invalid; expected a finite number or None")
    return value


def _checked(monitor: Monitor, stopping: float | None, divergence: float | None) -> Monitor:
    """``monitor``, once its mode leaves some value between the thresholds ``stopping`` and ``divergence`` (else every
    value would stop the run at its first validation)."""
    if stopping is not None and divergence is not None and not monitor.better(stopping, divergence):
        raise ValueError(
            f"stopping_threshold {stopping} is not better than divergence_threshold {divergence} in mode "
            f"{monitor.mode!r}: every value would stop the run"
        )
    return monitor


def _damaged(key: str, value: Any, valid: str) -> ValueError:
    """The refusal of a checkpoint's early stopping entry ``key`` that holds ``value``, not ``valid``."""
    return ValueError(
        f"the checkpoint's early stopping state holds {key}={shown(value)}: expected {valid}; the file is damaged or "
        "was not written by ampkit"
    )


def _saved_reason(value: Any) -> EarlyStoppingReason:
    """A checkpoint's ``stopping_reason`` (an :class:`EarlyStoppingReason`'s value) as the member; a ValueError naming
    the value and the valid ones where a damaged or foreign file holds another."""
    if isinstance(value, EarlyStoppingReason):
        return value
    if isinstance(value, str) and value in EarlyStoppingReason._value2member_map_:
        return EarlyStoppingReason(value)
    valid = ", ".join(repr(reason.value) for reason in EarlyStoppingReason)
    raise _damaged("stopping_reason", value, f"one of {valid}")
