"""What the console shows (rank zero): a start banner, progress, validation and per-epoch lines.

In a terminal: a tqdm bar per epoch (named losses, the loss scale of each ``loss_id``, skipped steps) and
one per validation run. When stdout is not a terminal (``nohup``, a batch scheduler, ``| tee``) or under
CI: the same facts as a plain line every ``every_n_steps`` iterations, so a log file shows progress.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch

from ampkit.amp.scaler import interval_option
from ampkit.callbacks.precision_config import describe_precision
from ampkit.ops._switches import checked_switch
from ampkit.trainer.callback import Callback, Phase
from ampkit.trainer.console import console_gone
from ampkit.wording import counted, shown

Hook = TypeVar("Hook", bound=Callable[..., None])


def _interactive() -> bool:
    return sys.stdout.isatty() and not os.environ.get("CI")


def _number(value: float) -> str:
    return f"{value:.4g}"


def _duration(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


def _throughput(figures: dict[str, float]) -> list[str]:
    """``tok/s=12.3k TFLOP/s=0.021 MFU=41.2%`` from the latest throughput figures (samples/s without tokens)."""
    shown = []
    if "tokens_per_sec" in figures:
        shown.append(f"tok/s={_si(figures['tokens_per_sec'])}")
    elif "samples_per_sec" in figures:
        shown.append(f"samples/s={_si(figures['samples_per_sec'])}")
    if "tflops" in figures:
        shown.append(f"TFLOP/s={figures['tflops']:.3g}")
    if "mfu" in figures:
        shown.append(f"MFU={figures['mfu']:.1%}")
    return shown


def _si(value: float) -> str:
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.3g}"


def _writes_to_the_console(hook: Hook) -> Hook:
    """A hook that draws or prints: where the console is gone (an ``OSError``: a closed pipe, a full disk under a
    redirected log), the bar turns itself off for the rest of the run, said once, and the run goes on
    (:mod:`ampkit.trainer.console`)."""

    @functools.wraps(hook)
    def drawing(self: ProgressBar, trainer: Any, *args: Any) -> None:
        if self._console_gone:
            return
        try:
            hook(self, trainer, *args)
        except OSError as exc:
            self._console_gone = True
            for bar in (self._val_bar, self._train_bar):
                if bar is not None:
                    bar.disable = True  # closed without drawing again
            self._train_bar = self._val_bar = None
            console_gone(exc)

    return drawing  # type: ignore[return-value]


class ProgressBar(Callback):
    """Console output. ``bar``: draw tqdm bars (default: when stdout is a terminal and ``CI`` is unset),
    redrawn at most every ``refresh_s`` seconds; otherwise print a plain status line every ``every_n_steps``
    iterations."""

    phase = Phase.OBSERVE
    # The validation's and the epoch's lines wait for the Trainer's own hook and every other callback's but a
    # checkpoint's, wherever they stand in the list (reads_logged_values): they show what those log there (an AUC
    # over the set, an epoch metric) beside validation_step's means and the epoch means.
    hook_phases = {"on_validation_end": Phase.PERSIST, "on_train_epoch_end": Phase.PERSIST}
    reads_logged_values = True

    def __init__(self, bar: bool | None = None, every_n_steps: int = 50, refresh_s: float = 0.1) -> None:
        hint = " (None: a bar where the console is interactive)"
        self.bar = _interactive() if bar is None else checked_switch("ProgressBar", "bar", bar, hint)
        self.every_n_steps = interval_option(every_n_steps, "ProgressBar: every_n_steps")
        if isinstance(refresh_s, bool) or not isinstance(refresh_s, numbers.Real) or not 0 <= refresh_s < math.inf:
            raise ValueError(f"ProgressBar: refresh_s={shown(refresh_s)}: expected a finite number of seconds >= 0")
        self.refresh_s = float(refresh_s)
        self._train_bar: Any = None
        self._val_bar: Any = None
        self._scales: dict[Any, float] = {}
        self._epoch_val: dict[str, float] = {}
        self._fit_start = self._epoch_start = self._val_start = self._last_postfix = 0.0
        self._epoch_first_step = 0
        self._fit_first_step = 0  # the step fit() started from (a resume's)
        self._console_gone = False  # a write failed: nothing is drawn or printed for the rest of the run

    # ------------------------------------------------------------------ output
    def _print(self, text: str) -> None:
        if self._train_bar is not None or self._val_bar is not None:
            from tqdm.auto import tqdm

            tqdm.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def _status(self, trainer, outputs: dict[str, Any]) -> list[str]:
        """``name=value`` for each scalar output, the loss scale of each loss_id and the skipped steps."""
        shown = [
            f"{key}={_number(float(value))}"
            for key, value in outputs.items()
            if isinstance(value, int | float) or (isinstance(value, torch.Tensor) and value.numel() == 1)
        ]
        shown += [f"scale[{loss_id}]={value:g}" for loss_id, value in self._scales.items()]
        shown += _throughput(trainer.state.throughput)
        states = list(trainer.optimizer_state.values())
        if self._scales or any(st.skipped_steps for st in states):
            if len(states) == 1:
                shown.append(f"skipped={states[0].skipped_steps}")
            else:
                shown += [f"skipped[{st.name}]={st.skipped_steps}" for st in states]
        return shown

    # ------------------------------------------------------------------ hooks
    @_writes_to_the_console
    def on_fit_start(self, trainer) -> None:
        if not trainer.is_global_zero:
            return
        self._fit_start = time.perf_counter()
        params = list(trainer.module.parameters())
        total = sum(p.numel() for p in params)
        trainable = sum(p.numel() for p in params if p.requires_grad)
        precision = describe_precision(trainer.cfg.precision)
        t = trainer.settings
        length = counted(t.max_epochs, "epoch") if t.max_epochs >= 0 else "no epoch limit"
        length += f", at most {counted(t.max_steps, 'step')}" if t.max_steps >= 0 else ""
        batches = trainer.num_train_batches
        lines = [
            f"ampkit: training {type(trainer).__name__}",
            f"  device      {trainer.device}" + (f" x {trainer.world_size} ranks" if trainer.world_size > 1 else ""),
            f"  precision   {precision}",
            *(f"  {what:<11} {note}" for what, note in trainer.model_setup.notes.items()),
            f"  parameters  {total:,} ({trainable:,} trainable)",
            f"  data        {'?' if batches is None else batches} batches/epoch, {length}, "
            f"accumulate {t.accumulate_grad_batches}",
            f"  run dir     {trainer.version_dir}",
        ]
        start = getattr(trainer, "fit_start", None)
        self._fit_first_step = trainer.state.global_step
        if start is not None and start.checkpoint_path is not None:
            how = "branched" if start.branched_from is not None else "resumed"
            lines.append(f"  {how:<11} from {start.checkpoint_path} at step {trainer.state.global_step}")
            change = getattr(trainer, "resumed_layout_change", None)
            if change is not None:  # allowed (the sample order continues), but the curve is not the saved run's
                lines.append(f"  {'batch':<11} samples a step: {change}; the loss curve follows another batch size")
        self._print("\n".join(lines))

    def on_loss_scale_update(self, trainer, loss_id: Any, old: float, new: float) -> None:
        self._scales[loss_id] = new

    @_writes_to_the_console
    def on_train_epoch_start(self, trainer) -> None:
        if not trainer.is_global_zero:
            return
        self._epoch_start, self._epoch_first_step = time.perf_counter(), trainer.state.global_step
        self._epoch_val = {}
        if self.bar:
            from tqdm.auto import tqdm

            self._train_bar = tqdm(
                total=trainer.num_train_batches,
                initial=trainer.state.batches_done,
                desc=f"epoch {trainer.state.epoch}",
                dynamic_ncols=True,
                leave=False,
                mininterval=self.refresh_s,
            )

    @_writes_to_the_console
    def on_train_batch_end(self, trainer, outputs: dict[str, Any], batch: Any) -> None:
        if not trainer.is_global_zero:
            return
        s = trainer.state
        if self._train_bar is not None:
            now = time.perf_counter()
            if s.is_iteration_end and now - self._last_postfix >= 5 * self.refresh_s:  # reading losses syncs a GPU
                self._last_postfix = now
                self._train_bar.set_postfix_str(" ".join(self._status(trainer, outputs)), refresh=False)
            self._train_bar.update(1)
        elif s.is_iteration_end and s.iteration % self.every_n_steps == 0:
            elapsed = time.perf_counter() - self._epoch_start
            rate = (s.iteration - self._epoch_first_step) / elapsed if elapsed > 0 else 0.0
            total = trainer.num_train_batches
            where = f"epoch {s.epoch} batch {s.batches_done}/{'?' if total is None else total} step {s.iteration}"
            parts = [where, " ".join(self._status(trainer, outputs)), _rate(rate)]
            parts.append(f"elapsed {_duration(time.perf_counter() - self._fit_start)}")
            self._print(" | ".join(part for part in parts if part))

    @_writes_to_the_console
    def on_validation_start(self, trainer) -> None:
        if not trainer.is_global_zero:
            return
        self._val_start = time.perf_counter()
        if self.bar:
            from tqdm.auto import tqdm

            during_fit = trainer.state.stage == "fit"  # trainer.validate() runs over a loader of its own
            self._val_bar = tqdm(
                total=trainer.num_val_batches if during_fit else None,
                desc="validation",
                dynamic_ncols=True,
                leave=False,
                mininterval=self.refresh_s,
            )

    @_writes_to_the_console
    def on_validation_batch_end(self, trainer, metrics: dict[str, Any], batch: Any) -> None:
        if self._val_bar is not None:
            self._val_bar.update(1)

    @_writes_to_the_console
    def on_validation_end(self, trainer, metrics: dict[str, float]) -> None:
        if not trainer.is_global_zero:
            return
        if self._val_bar is not None:
            self._val_bar.close()
            self._val_bar = None
        # what on_validation_end hooks logged, under the tags they logged
        shown = {f"val/{key}": value for key, value in metrics.items()} | trainer.validation_end_values
        s = trainer.state
        if s.stage != "fit":  # trainer.validate() returns its metrics (the CLI prints them)
            return
        if s.epoch_finished:  # the epoch line reports it
            self._epoch_val = shown
            return
        values = " ".join(f"{k}={_number(v)}" for k, v in shown.items())
        took = time.perf_counter() - self._val_start
        self._print(f"epoch {s.epoch} step {s.global_step} | {values} | validation {took:.1f} s")

    @_writes_to_the_console
    def on_train_epoch_end(self, trainer) -> None:
        if not trainer.is_global_zero:
            return
        self._close_bars()
        s = trainer.state
        took = time.perf_counter() - self._epoch_start
        steps = s.global_step - self._epoch_first_step
        rate = _rate(steps / took if took > 0 else 0.0)
        parts = [f"epoch {s.epoch}", f"{counted(steps, 'step')} in {_duration(took)} ({rate})"]
        for metrics in (trainer.monitor_values(), self._epoch_val):  # epoch means, and what epoch-end hooks logged
            if metrics:
                parts.append(" ".join(f"{k}={_number(v)}" for k, v in metrics.items()))
        self._print(" | ".join(parts))

    @_writes_to_the_console
    def on_train_end(self, trainer) -> None:
        if trainer.is_global_zero:
            took = time.perf_counter() - self._fit_start
            step, first = trainer.state.global_step, self._fit_first_step
            this_run = f"to step {step} ({counted(step - first, 'step')} in this run)"
            trained = counted(step, "step") if first == 0 else this_run
            self._print(f"ampkit: trained {trained} in {_duration(took)}")

    @_writes_to_the_console
    def on_fit_end(self, trainer) -> None:
        self._close_bars()

    def _close_bars(self) -> None:
        for bar in (self._val_bar, self._train_bar):
            if bar is not None:
                bar.close()
        self._train_bar = self._val_bar = None


def _rate(per_second: float) -> str:
    """Iterations per second, or seconds per iteration below one a second (as tqdm shows it): slow steps (a
    compiled GPT on a CPU) read "(0.0 it/s)" otherwise."""
    if 0 < per_second < 1:
        return f"{1 / per_second:.1f} s/it"
    return f"{per_second:.1f} it/s"
