"""Training throughput: samples/s, tokens/s, achieved TFLOP/s and model FLOPs utilisation (MFU).

A Trainer tells it what one sample is worth by setting ``tokens_per_sample`` (a language model's sequence length)
and ``flops_per_sample`` (the training FLOPs of one sample, forward and backward: :func:`count_training_flops`
measures them once on a meta-device copy of the model, or use ``6 * N + 12 * layers * width * seq_len`` per
token, the matmul parameters ``N`` plus attention's two products, as torchtitan and nanoGPT do); each is None or a
finite number > 0, checked when training starts. Samples per batch are the Trainer's ``samples_in(batch)`` (by
default the leading size of the batch's first tensor) and tokens its ``tokens_in(batch)`` where that gives a number
(packed or variable-length sequences), each counted on the host before the batch moves: no device sync is added (a
batch whose samples are unknown leaves its window's rates unreported). Recomputation under activation
checkpointing is not counted (that would be hardware FLOPs, not model FLOPs).

MFU is achieved FLOP/s over the device's peak for the compute dtype: a table of dense (no sparsity) peaks for
current NVIDIA parts, or ``logging.peak_tflops``. On a CPU, or a GPU the table does not know, there is no MFU.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from ampkit.amp.opt_levels import parse_dtype
from ampkit.amp.scaler import interval_option, positive_option
from ampkit.trainer.callback import Callback, Phase
from ampkit.wording import beyond_float, integer_digits, shown, type_of

# Dense peak TFLOP/s by compute dtype ("tf32": float32 matmuls on tensor cores), from NVIDIA's data sheets.
# Keys are matched against torch.cuda.get_device_name() lower-cased; longer keys first (h100 nvl before h100).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "h200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "h100 nvl": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.8, "fp32": 60.0},
    "h100 pcie": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "h100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},  # SXM
    "a100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "l40s": {"bf16": 362.1, "fp16": 362.1, "tf32": 183.2, "fp32": 91.6},
    "l4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "a10g": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "a10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
}


def peak_tflops(device: torch.device, dtype: str) -> float | None:
    """The table's dense peak TFLOP/s of ``device`` for ``dtype`` (bf16, fp16, tf32, fp32); None on a CPU or
    an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    for part in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if part in name:
            return PEAK_TFLOPS[part].get(dtype)
    return None


def matmul_dtype(compute_dtype: torch.dtype | None) -> str:
    """The table column of a run: its autocast/cast dtype, or float32 (tf32 when torch allows it for matmuls)."""
    if compute_dtype == torch.bfloat16:
        return "bf16"
    if compute_dtype == torch.float16:
        return "fp16"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def checked_compute_dtype(value: Any) -> torch.dtype | None:
    """Throughput's ``compute_dtype``: None or float32 (the fp32/tf32 column), float16 or bfloat16, as a dtype or its
    name. Anything else was taken as float32: "bfloat16" written as text read the fp32 peak and logged a wrong MFU."""
    if value is None or value is torch.float32:
        return value
    if isinstance(value, str) and value.lower().removeprefix("torch.") in ("float32", "fp32"):
        return torch.float32
    if isinstance(value, str | torch.dtype):
        try:
            return parse_dtype(value)
        except ValueError:
            pass
    raise ValueError(
        f"Throughput: compute_dtype={shown(value)}: expected None, torch.float32, torch.float16 or torch.bfloat16 "
        "(or its name, such as 'bfloat16')"
    )


def count_training_flops(forward_loss: Callable[[], torch.Tensor]) -> int:
    """FLOPs of one forward and backward: ``forward_loss()`` (returning a scalar loss) and its backward, run under
    ``torch.utils.flop_counter.FlopCounterMode``. Run it on a model built under ``torch.device("meta")``:
    nothing is computed or allocated, and the real model's RNG and gradients are untouched."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        try:
            loss = forward_loss()
        except (RuntimeError, NotImplementedError, TypeError) as exc:  # torch's words name no way out
            reason = (str(exc).strip().splitlines() or [""])[0].split(". ")[0]  # torch's first sentence says it
            raise RuntimeError(
                f"count_training_flops: forward_loss() failed ({type(exc).__name__}: {reason}). On the meta device "
                "a forward that reads values (.item(), an if on a tensor, nonzero, .numpy()) cannot run, since none "
                "exist: count on a small real batch, or set flops_per_sample by hand (6 per matmul parameter per "
                "token, plus attention's) or to None"
            ) from None
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
            shown = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                shown = "a loss that needs no gradient (no trainable parameter reaches it, or it ran under no_grad)"
            raise TypeError(
                f"count_training_flops: forward_loss() returned {shown}; expected a scalar loss that backward() can "
                "differentiate, e.g. lambda: model(x).float().logsumexp(-1).sum()"
            )
        loss.backward()
    return counter.get_total_flops()


def sample_worth(trainer, name: str, what: str) -> float | None:
    """``trainer.<name>`` (``tokens_per_sample`` or ``flops_per_sample``): None, or a finite number > 0. Anything else
    is named before training, where it would log negative or nan rates, drop the figure silently (0) or fail at the
    first window's multiplication (a method, a string)."""
    value = getattr(trainer, name)
    if value is None:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not beyond_float(value) and math.isfinite(value) and value > 0:  # a float's range: its rates are floats
            return value
        problem, error = " is invalid", ValueError
    else:
        problem, error = f" is {type_of(value)}, not a number", TypeError
    if callable(value):  # a method: the figure is an attribute, read once when training starts, never called
        problem += f" (it is not called: set self.{name} = ... in configure_model, or make it a @property)"
    elif isinstance(value, torch.Tensor):
        problem += " (use .item())"
    raise error(
        f"{type(trainer).__name__}.{name}: {integer_digits(value) if beyond_float(value) else repr(value)}{problem}; "
        f"expected a finite number > 0 ({what}), or None "
        "for no such figures"
    )


class HostStopwatch:
    """Window boundaries read from a host clock, at once."""

    lags = False

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock

    def mark(self) -> float:
        return self.clock()

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaStopwatch:
    """Window boundaries as CUDA events on the current stream. The host runs ahead of an asynchronous GPU, so a
    host clock times the enqueueing, not the training; the events time the GPU's own timeline (its idle gaps
    included). A window is read one window later, when its end event has long completed: no sync is added."""

    lags = True

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def stopwatch_for(device: torch.device, clock: Callable[[], float]) -> HostStopwatch | CudaStopwatch:
    """CUDA events on a GPU (unless a clock was given, as tests do), the host clock elsewhere."""
    if device.type == "cuda" and clock is time.perf_counter:
        return CudaStopwatch()
    return HostStopwatch(clock)


class Throughput(Callback):
    """Samples/s, tokens/s, TFLOP/s and MFU over each window of ``every_n_steps`` iterations (all ranks together).

    Figures go to ``trainer.state.throughput`` (the console shows them) and to ``trainer.log`` as
    ``perf/samples_per_sec``, ``perf/tokens_per_sec``, ``perf/tflops`` and ``perf/mfu`` (TensorBoard). The first
    iteration (compilation, warm-up), validation runs and checkpoint saves are left out of the windows. On a GPU the
    windows are timed by CUDA events and each is reported one window late (logged at its own last iteration), so
    timing never waits for the GPU. Work a hook does that is not training (sampling text) is left out inside
    :func:`paused`. ``clock``: a host clock instead (tests).
    """

    phase = Phase.DEFAULT  # a fact producer: the loggers and the console (OBSERVE) read its figures after it
    # Validation's pause opens before any callback's on_validation_start and closes after the loggers' flush at its
    # end (a checkpoint's save there pauses on its own).
    hook_phases = {"on_validation_start": Phase.CAST, "on_validation_end": Phase.PERSIST}

    def __init__(
        self,
        every_n_steps: int = 10,
        compute_dtype: torch.dtype | None = None,
        peak_tflops: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.every_n_steps = interval_option(every_n_steps, "Throughput: every_n_steps")
        self.compute_dtype = checked_compute_dtype(compute_dtype)
        # a str, bool or inf was taken as given: a str failed the comparison, inf and True logged a wrong MFU
        self.peak = None if peak_tflops is None else positive_option(peak_tflops, "Throughput: peak_tflops")
        if not callable(clock):
            raise TypeError(
                f"Throughput: clock must be a function returning seconds (time.perf_counter), got {shown(clock)}"
            )
        self.clock = clock
        self._tokens_per_sample: int | None = None
        self._flops_per_sample: float | None = None
        self._world = 1
        self._watch: HostStopwatch | CudaStopwatch = HostStopwatch(clock)
        self._start: Any = None  # the window's start mark; None until the first iteration has ended
        self._samples: int | None = 0  # this rank's samples in the window (None: a batch in it had no tensor)
        self._tokens: int | None = 0  # this rank's tokens in the window (None: not known for every batch in it)
        self._pauses: list[tuple[Any, Any]] = []  # validation runs and saves inside the window: (start, end) marks
        self._paused_at: Any = None
        self._pause_depth = 0  # pauses open now: one inside another (a save during validation) is left out once
        self._unread: tuple | None = None  # a lagging stopwatch's last window: (start, end, samples, pauses, step)
        self._uncounted = ""  # the type of the last batch whose samples could not be counted (no tensor in it)
        self._warned = False

    def on_train_start(self, trainer) -> None:
        self._tokens_per_sample = sample_worth(trainer, "tokens_per_sample", "the tokens in one sample")
        self._flops_per_sample = sample_worth(trainer, "flops_per_sample", "one sample's training FLOPs")
        self._world = trainer.world_size
        if self.peak is None:
            self.peak = peak_tflops(trainer.device, matmul_dtype(self.compute_dtype))
        self._watch = stopwatch_for(trainer.device, self.clock)
        self._start, self._samples, self._tokens, self._pauses, self._unread = None, 0, 0, [], None
        self._pause_depth = 0
        self._uncounted, self._warned = "", False

    def on_train_batch_end(self, trainer, outputs: dict[str, Any], batch: Any) -> None:
        s = trainer.state
        if self._start is None:  # the first iteration pays for compilation and warm-up: the clock starts after it
            if s.is_iteration_end:
                self._start = self._watch.mark()
            return
        samples = s.batch_size  # the Trainer's count of this batch, taken before it ran
        if samples is None:  # no tensor in the batch: the window's rates are unknown, not 0
            self._samples, self._uncounted = None, type(batch).__name__
        elif self._samples is not None:
            self._samples += samples
        tokens = s.batch_tokens
        if tokens is None and samples is not None and self._tokens_per_sample:
            tokens = samples * self._tokens_per_sample
        self._tokens = None if tokens is None or self._tokens is None else self._tokens + tokens
        if not (s.is_iteration_end and s.iteration % self.every_n_steps == 0):
            return
        counted = None if self._samples is None else (self._samples * self._world, self._tokens)
        window = (self._start, self._watch.mark(), counted, self._pauses, s.iteration)
        self._start, self._samples, self._tokens, self._pauses = window[1], 0, 0, []
        if self._watch.lags:  # report the previous window, whose end the GPU has passed long ago
            window, self._unread = self._unread, window
        if window is not None:
            self._report(trainer, *window)

    def _report(self, trainer, start: Any, end: Any, counted: tuple | None, pauses: list, step: int) -> None:
        if counted is None:
            if not self._warned:
                self._warned = True
                rank_zero_warn(
                    f"Throughput: a training batch ({self._uncounted}) holds no tensor, so its samples cannot be "
                    "counted: no samples/s, tokens/s, TFLOP/s or MFU is reported (batches of tensors, or dicts, "
                    "lists, tuples or dataclasses of them, are counted by their leading size)"
                )
            return
        seconds = self._watch.seconds(start, end) - sum(self._watch.seconds(a, b) for a, b in pauses)
        if seconds <= 0:
            return
        samples, tokens = counted
        figures = self.figures(samples, seconds, None if tokens is None else tokens * self._world)
        trainer.state.throughput = figures
        for key, value in figures.items():
            trainer.log(f"perf/{key}", value, always=True, step=step)

    def figures(self, samples: int, seconds: float, tokens: int | None = None) -> dict[str, float]:
        """The rates of ``samples`` (all ranks) trained in ``seconds``; ``tokens`` (all ranks) where counted, else
        samples x ``tokens_per_sample``."""
        figures = {"samples_per_sec": samples / seconds}
        if tokens is None and self._tokens_per_sample:
            tokens = samples * self._tokens_per_sample
        if tokens is not None:
            figures["tokens_per_sec"] = tokens / seconds
        if self._flops_per_sample:
            tflops = samples * self._flops_per_sample / seconds / 1e12
            figures["tflops"] = tflops
            if self.peak:
                figures["mfu"] = tflops / (self.peak * self._world)
        return figures

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the time inside out of the current window, as validation is."""
        self._open_pause()
        try:
            yield
        finally:
            self._close_pause(counts=True)

    def _open_pause(self) -> None:
        if self._pause_depth == 0:
            self._paused_at = self._watch.mark()
        self._pause_depth += 1

    def _close_pause(self, counts: bool) -> None:
        """End a pause; the outermost one, when ``counts``, leaves its time out of the window."""
        self._pause_depth = max(self._pause_depth - 1, 0)
        if self._pause_depth == 0 and counts and self._start is not None:
            self._pauses.append((self._paused_at, self._watch.mark()))

    def on_validation_start(self, trainer) -> None:
        self._open_pause()

    def on_validation_end(self, trainer, metrics: dict[str, float]) -> None:
        self._close_pause(counts=trainer.state.stage == "fit")  # validation time is not training time


def paused(trainer) -> AbstractContextManager[None]:
    """``trainer.paused()``: leave the work inside (a sample generated in a hook) out of the throughput windows."""
    return trainer.paused()
