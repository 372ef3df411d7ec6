"""TensorBoard logging (rank zero only): losses, learning rates, gradient norms, steps/s, val metrics, hparams,
and ``trainer.logger``'s images, histograms and text."""

from __future__ import annotations

import functools
import math
import numbers
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from omegaconf import OmegaConf

from ampkit.amp.scaler import interval_option
from ampkit.config import flatten, one_max_time
from ampkit.ops._switches import checked_switch
from ampkit.ops.host_values import host_numbers
from ampkit.trainer.callback import Callback, Phase
from ampkit.trainer.checkpoint_io import from_storage
from ampkit.trainer.distributed import decided_by_rank_zero
from ampkit.trainer.logger import Logger, check_image
from ampkit.trainer.run_life import RunDirectoryError, created_here
from ampkit.wording import beyond_float, shown


@contextmanager
def writing_events(log_dir: Path, failed: Callable[[RunDirectoryError], None] | None = None) -> Iterator[None]:
    """A failed write of the event files (a full disk, a read-only remount; TensorBoard's writer thread reports it
    at the next write) as one line naming ``log_dir``, not an OSError without a path: raised, or given to ``failed``
    (``Trainer.fail_on_every_rank``: under torchrun, rank zero alone writes events, and every rank must stop)."""
    try:
        yield
    except OSError as exc:
        error = from_storage(
            RunDirectoryError(
                f"cannot write TensorBoard events under '{log_dir}' ({exc.strerror or exc}): free space (or get write "
                "access) there, or set logging.tensorboard=false; no checkpoint was touched"
            ),
            exc,
        )
        error.__suppress_context__ = True  # the OSError names no file: this line says it all
        if failed is None:
            raise error from None
        failed(error)


# TensorBoard's writer threads of ampkit's SummaryWriters: an OSError there (a full disk) is raised again by the
# writer's next write, flush or close on the training thread, where writing_events names the directory in one line.
_WRITER_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_open_writers = 0  # summary_writer's writers not yet closed: the hook goes once none is


def _quiet_writer_threads(args: threading.ExceptHookArgs, previous: Callable[[Any], Any]) -> None:
    """``threading.excepthook``: silent for an OSError of a writer thread (its traceback would come before the one
    line the training thread gives), ``previous`` for everything else."""
    if args.thread in _WRITER_THREADS and isinstance(args.exc_value, OSError):
        return
    previous(args)


def summary_writer(log_dir: Path, purge_step: int | None) -> Any:
    """A ``SummaryWriter`` for ``log_dir`` whose writer thread leaves a failed write to the training thread; call
    :func:`writer_closed` after closing it."""
    global _open_writers
    from torch.utils.tensorboard import SummaryWriter

    before, files = set(threading.enumerate()), set(_event_files(log_dir))
    writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
    _WRITER_THREADS.update(set(threading.enumerate()) - before)
    for created in set(_event_files(log_dir)) - files:  # the writer's own file, made as it was built
        created_here(created, whole=False)
    if getattr(threading.excepthook, "func", None) is not _quiet_writer_threads:
        threading.excepthook = functools.partial(_quiet_writer_threads, previous=threading.excepthook)
    _open_writers += 1
    return writer


def writer_closed() -> None:
    """Call once a writer of :func:`summary_writer` is closed (or failed to close: its thread then waits on an empty
    queue, idle). Once none is open, ``threading.excepthook`` is as it was before the first, so that after ``fit()``
    the process is as the caller left it; a hook installed since (which may call ours) stays."""
    global _open_writers
    _open_writers -= 1
    hook = threading.excepthook
    if _open_writers == 0 and getattr(hook, "func", None) is _quiet_writer_threads:
        threading.excepthook = hook.keywords["previous"]


_EVENT_FILE = re.compile(r"^events\.out\.tfevents\.(\d+)\.")


def _event_files(log_dir: Path) -> list[Path]:
    """The TensorBoard event files directly in ``log_dir`` (none where it does not exist yet)."""
    return list(log_dir.glob("events.out.tfevents.*"))


def _after_the_newest_event_file(log_dir: Path) -> None:
    """Wait, if need be, for the second after the newest event file's in ``log_dir`` began. TensorBoard reads a
    directory's files in name order, which starts with the second a file was created: a continued run's file made in
    the same second as its predecessor's could be read first (the pid decides), and the predecessor's purge would
    then hide this run's steps. At most a second: a file stamped later still (another machine's clock) is not waited
    for."""
    seconds = [int(m.group(1)) for p in _event_files(log_dir) if (m := _EVENT_FILE.match(p.name))]
    if seconds and 0 < (wait := max(seconds) + 1 - time.time()) <= 1:
        time.sleep(wait)


class StepEvents:
    """Every event a writer writes passes here: those of its newest step are kept (serialized), so a checkpoint saved
    at that step carries them. In a run continued from a checkpoint of step N, TensorBoard's purge of step N comes
    just before the run's first event at N, followed by the events the checkpoint carries.

    Why: a step checkpoint at an epoch's last batch comes before that epoch's validation and epoch means, which the
    continued run logs at N again; the killed run may have written them too (two values at N). Purging N at the start
    instead would hide the step's loss, which only the killed run logged (before its checkpoint); where the continued
    run logs nothing at N, nothing is purged there."""

    def __init__(self, file_writer: Any, purge_at: int | None = None, carried: list[bytes] | None = None) -> None:
        self._add_event = file_writer.add_event
        file_writer.add_event = self.add_event
        self.step, self.events = -1, []
        self._purge_at, self._carried = purge_at, carried or []

    def add_event(self, event: Any, step: int | None = None, walltime: float | None = None) -> None:
        """``FileWriter.add_event``, noted; the purge and the carried events first where this is step N's first."""
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        if self._purge_at is not None and (event.step if step is None else int(step)) == self._purge_at:
            self._add_event(Event(step=self._purge_at, session_log=SessionLog(status=SessionLog.START)))
            self._purge_at = None
            for data in self._carried:
                carried = Event.FromString(data)
                self._add_event(carried, carried.step, carried.wall_time)
                self._note(carried)
        self._add_event(event, step, walltime)
        self._note(event)

    def _note(self, event: Any) -> None:
        if event.step > self.step:
            self.step, self.events = event.step, []
        if event.step == self.step:
            self.events.append(event.SerializeToString())


class TensorBoardWriter(Logger):
    """``trainer.logger`` while :class:`TensorBoardLogger` runs: writes to its event files."""

    def __init__(
        self,
        writer: Any,
        current_step: Callable[[], int],
        flush_scalars: Callable[[], None],
        failed: Callable[[RunDirectoryError], None],
    ) -> None:
        self.writer = writer
        self.log_dir = Path(writer.log_dir)
        self._current_step = current_step
        self._flush_scalars = flush_scalars
        self._failed = failed  # a failed write stops the fit on every rank (Trainer.fail_on_every_rank)

    def _step(self, step: int | None) -> int:
        self._flush_scalars()  # the earlier steps' scalars go first: the file stays in step order
        return self._current_step() if step is None else step

    def log_image(self, tag: str, image: torch.Tensor, step: int | None = None) -> None:
        super().log_image(tag, image)  # the tag's check
        dataformats = check_image(tag, image)
        with writing_events(self.log_dir, self._failed):
            self.writer.add_image(tag, image.detach().cpu(), self._step(step), dataformats=dataformats)

    def log_histogram(self, tag: str, values: torch.Tensor, step: int | None = None) -> None:
        super().log_histogram(tag, values)
        values = values.detach().float().cpu()
        if not bool(values.isfinite().all()):
            raise ValueError(f"log_histogram({shown(tag)}): the values hold inf/nan; log the finite ones")
        with writing_events(self.log_dir, self._failed):
            self.writer.add_histogram(tag, values, self._step(step))

    def log_text(self, tag: str, text: str, step: int | None = None) -> None:
        super().log_text(tag, text)
        with writing_events(self.log_dir, self._failed):
            self.writer.add_text(tag, text, self._step(step))


class TensorBoardLogger(Callback):
    """Writes ``<version_dir>/tensorboard`` event files.

    Tags: ``train/<output>`` (``train/loss`` and each named loss; mean over the batches since the last log, and at
    the last step over those since; a tag ``trainer.log`` writes is left to it),
    ``train/lr/<optimizer>`` (the rate the step used; ``train/lr/<optimizer>/group_<i>``: its other param groups',
    ``/<name>`` for a group with a ``"name"``; with ``log_momentum`` each group's ``train/momentum/...`` too),
    ``train/grad_norm/<optimizer>`` (total L2 norm of the gradients the optimizer is about to use, before clipping),
    ``train/steps_per_sec``, ``val/<metric>``; the resolved config as
    flattened hparams (with the final ``val/`` metrics and the tags ``on_validation_end`` logged, so the HParams tab
    compares runs by them); every scalar
    queued with ``trainer.log`` (``on_epoch`` means at each epoch's end); and, through ``trainer.logger``,
    images, histograms and text.

    Scalars are queued at their log step and written every ``flush_secs`` seconds, at the start of the iteration
    after a log step (every hook of the step has logged then: one point per tag and step), and before validation
    metrics, images (the earlier steps' there) and the end of the run, so the file stays in step order: one read
    of all queued tensors (one sync on a GPU) and one hand-off to the writer thread per flush, not per log step. On a
    tiny model each log step's write cost several times the step itself; SummaryWriter flushes its file to disk
    only every 120 s, so the queue delays nothing TensorBoard shows.
    """

    phase = Phase.OBSERVE  # after clipping has cached the pre-clip norm, after scalers logged
    state_is_optional = True  # a resume with logging.tensorboard=false has no use for the window
    takes_part_in_collectives = True  # rank zero opens the events file for every rank

    def __init__(self, log_every_n_steps: int = 10, flush_secs: float = 5.0, log_momentum: bool = False) -> None:
        if isinstance(flush_secs, bool) or not isinstance(flush_secs, numbers.Real) or not flush_secs >= 0:
            raise ValueError(f"TensorBoardLogger: flush_secs must be >= 0, got {shown(flush_secs)}")
        if beyond_float(flush_secs) or not math.isfinite(flush_secs):  # written only before validation and at the end
            raise ValueError(
                f"TensorBoardLogger: flush_secs={shown(flush_secs)} would hold every training scalar until validation "
                "or the end of the run; give a finite number of seconds >= 0 (0: write at every log step)"
            )
        self.log_every_n_steps = interval_option(log_every_n_steps, "TensorBoardLogger: log_every_n_steps")
        self.flush_secs = flush_secs
        self.log_momentum = checked_switch("TensorBoardLogger", "log_momentum", log_momentum)
        self.writer: Any = None
        self._window: dict[str, list[Any]] = {}  # each batch output's values since the last log (not read yet)
        self._output_tags: set[str] = set()  # train/<output> tags the window writes: no epoch mean may share one
        self._logged_tags: set[str] = set()  # tags log() wrote: a batch output of that name leaves them to it
        self._renamed: set[str] = set()  # epoch tags written as <tag>_epoch for that, said once each
        self._grad_norms: list[tuple[str, torch.Tensor]] = []  # this iteration's norms, read with the rest
        self._lrs: list[tuple[str, float]] = []  # this iteration's learning rates, taken at its start
        self._queued: list[tuple[int, str, Any]] = []  # (step, tag, value) rows not written yet
        self._last_flush = 0.0
        self._flush_next = False  # flush_secs passed at the last log step: its rows go at the next iteration's start
        self._last_time = 0.0
        self._last_step = 0
        self._failed = False  # the run raised: closing the writer must not replace that error with its own
        # Where a failed write goes (Trainer.fail_on_every_rank): every rank stops, not rank zero alone, which writes.
        self._fail_run: Callable[[RunDirectoryError], None] | None = None
        self._step_events: StepEvents | None = None
        self._take_logged: Callable[[], list[tuple[str, Any, int]]] = list  # the fitting Trainer's take_logged
        self._carried: dict[str, Any] | None = None  # the restored checkpoint's step and its events

    def _due(self, trainer) -> bool:
        return trainer.state.iteration % self.log_every_n_steps == 0

    def on_fit_start(self, trainer) -> None:
        # Rank zero alone writes events; its failure to open them (a full disk, a file in the way) stops every rank
        # here, or the others would train on into a collective it never joins.
        decided_by_rank_zero(functools.partial(self._open_writer, trainer), trainer.dist)

    def _open_writer(self, trainer) -> None:
        """Rank zero's writer for this fit, its hparams session started (see :meth:`on_fit_start`)."""
        # A continued run logs again the steps its killed predecessor wrote after the checkpoint: purge_step hides
        # those earlier events from TensorBoard (the files stay), so each step shows once, this run's value. The
        # checkpoint's own step is purged only if this run logs at it again (StepEvents).
        step, carried = trainer.state.global_step, self._carried
        continued = trainer.fit_start.version_dir is not None
        purge_step = step + 1 if continued else None
        self._failed = False
        log_dir = trainer.version_dir / "tensorboard"
        with writing_events(log_dir):
            if continued:
                _after_the_newest_event_file(log_dir)
            self.writer = summary_writer(log_dir, purge_step)
            if continued and carried is not None:  # a checkpoint of an older ampkit carries none: no purge at step
                events = carried["events"] if carried["step"] == step else []
                self._step_events = StepEvents(self.writer.file_writer, step, events)
            else:
                self._step_events = StepEvents(self.writer.file_writer)
            self._fail_run = trainer.fail_on_every_rank
            # Before an image, histogram or text: the earlier steps' scalars, not this one's, which a later hook of
            # the step may log again (one point per tag and step, as at the timed flush).
            trainer.logger = TensorBoardWriter(
                self.writer,
                lambda: trainer.state.iteration,
                lambda: self._flush(before=trainer.state.iteration),
                self._fail_run,
            )
            self._take_logged = trainer.take_logged
            # The session's hparams now; the experiment (which names the metrics) once the final metrics exist.
            _, start, _ = _hparams_summaries(trainer, {})
            self.writer.file_writer.add_summary(start)
        self._last_time, self._last_step = time.perf_counter(), trainer.state.global_step
        self._last_flush, self._flush_next = self._last_time, False

    def _writing(self) -> Any:
        """:func:`writing_events` for this fit's event files, a failure stopping the fit on every rank."""
        return writing_events(Path(self.writer.log_dir), self._fail_run)

    def on_train_batch_start(self, trainer, batch: Any) -> None:
        """The timed flush of the previous log step's rows, and the learning rates this iteration's steps use: at its
        end the step-interval schedulers have already moved them to the next iteration's."""
        if self.writer is None or not trainer.state.is_iteration_start:
            return
        if self._flush_next:  # now, not at the log step's end: the Trainer's own on_train_batch_end (after this
            self._flush_next = False  # callback's) may log a tag again there, and two writes were two points
            self._queued += self._taken()
            self._flush(before=trainer.state.iteration)
        if self._due(trainer):
            self._lrs = [
                row for name, opt in trainer.optimizers.items() for row in _learning_rates(name, opt, self.log_momentum)
            ]

    def on_train_batch_end(self, trainer, outputs: dict[str, Any], batch: Any) -> None:
        if self.writer is None:
            return
        window = self._window
        for key, value in outputs.items():  # kept, not added up: a log step reads them all at once
            if isinstance(value, torch.Tensor) and value.numel() == 1 or isinstance(value, int | float):
                values = window.get(key)
                if values is None:
                    window[key] = [value]
                    self._output_tags.add(f"train/{key}")
                else:
                    values.append(value)
        rows = self._taken()
        step = trainer.state.iteration
        if trainer.state.is_iteration_end and self._due(trainer):
            rows += self._window_rows(step)  # each output's values since the last log step, logged as their mean
            rows += [(step, tag, norm) for tag, norm in self._grad_norms]
            rows += [(step, tag, lr) for tag, lr in self._lrs]
            now = time.perf_counter()
            if step > self._last_step and now > self._last_time:
                rows.append((step, "train/steps_per_sec", (step - self._last_step) / (now - self._last_time)))
            self._last_time, self._last_step = now, step
            self._window, self._grad_norms, self._lrs = {}, [], []
            if rows:
                self._queued += rows
            self._flush_next = now - self._last_flush >= self.flush_secs
        elif rows:  # trainer.log(..., always=True) between log steps (an overflow event)
            self._queued += rows

    def _taken(self) -> list[tuple[int, str, Any]]:
        """``trainer.log``'s values not taken yet, as ``(step, tag, value)`` rows; their tags are noted."""
        rows = [(at_step, tag, value) for tag, value, at_step in self._take_logged()]
        self._logged_tags.update(tag for _, tag, _ in rows)
        return rows

    def _window_rows(self, step: int) -> list[tuple[int, str, Any]]:
        """The batch outputs since the last log step as ``train/<output>`` rows at ``step``, but for a tag the code
        logs itself: ``self.log('train/loss', v)`` is what its author asked to see, where one curve of both would
        mix its values with the returned loss's means (Lightning writes only what ``log()`` is given)."""
        rows = [(step, f"train/{key}", values) for key, values in self._window.items()]
        return [row for row in rows if row[1] not in self._logged_tags]

    def state_dict(self) -> dict[str, Any]:
        """What was logged so far goes to the event file first, before the checkpoint exists (SummaryWriter writes
        its buffer out every 120 s: a SIGKILL lost the steps before the checkpoint, which a resume does not log again).
        Saved: the events of the newest step (see :class:`StepEvents`), and the batch outputs since the last log step,
        so a resume's first ``train/<output>`` point averages the same batches as an uninterrupted run's."""
        state: dict[str, Any] = {}
        if self.writer is not None:
            # What log() got since the batch's take (the Trainer's own on_train_batch_end and on_train_epoch_end run
            # between it and the save): the run resumed from this checkpoint does not log at its step again.
            self._queued += self._taken()
            try:
                self._flush()
                with self._writing():
                    self.writer.flush()
            except RunDirectoryError:  # the checkpoint is saved all the same; the writer's next write says why
                pass  # (under torchrun the failure is kept, and every rank stops with it once they next meet)
            state["step_events"] = {"step": self._step_events.step, "events": list(self._step_events.events)}
        if not self._window:
            return state
        tensors = [v for values in self._window.values() for v in values if isinstance(v, torch.Tensor)]
        read = iter(host_numbers(tensors))
        state["window"] = {
            key: [float(next(read) if isinstance(v, torch.Tensor) else v) for v in values]
            for key, values in self._window.items()
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._window = {key: list(values) for key, values in state.get("window", {}).items()}
        self._carried = state.get("step_events")

    def on_before_optimizer_step(self, trainer, optimizer: torch.optim.Optimizer) -> None:
        if not self._due(trainer):
            return
        norm = trainer.grad_norm(optimizer)  # on every rank: a sharded model's norm is a collective
        if self.writer is not None:  # read at the batch end, with the other values of this step
            self._grad_norms.append((f"train/grad_norm/{trainer.optimizer_state[optimizer].name}", norm))

    def _flush(self, before: int | None = None) -> None:
        """Write the queued scalars (``before``: only those of earlier steps; the rest stay queued)."""
        self._last_flush = time.perf_counter()
        if self._queued:
            rows, self._queued = self._queued, []
            if before is not None:
                self._queued = [row for row in rows if row[0] >= before]
                rows = [row for row in rows if row[0] < before]
            with self._writing():
                self._write(rows)

    def _take_logged_and_flush(self) -> None:
        """Write the queued scalars with what log() got since the last take (the Trainer's own on_train_batch_end
        runs after this callback's): a tag logged twice in a step is one value, the last, as in Lightning, where
        writing the queue alone left the later value for another write, a second point at that step."""
        self._queued += self._taken()
        self._flush()

    def _write(self, rows: list[tuple[int, str, Any]]) -> None:
        """Write (step, tag, value) scalars, a list of values standing for their mean: every tensor is read to the
        host in one go (one sync) and averaged there (no tensor op per logged output), then one event per step
        holds all of that step's values (an event per value costs the writer several times more)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        tensors = [v for _, _, value in rows for v in _as_list(value) if isinstance(v, torch.Tensor)]
        read = iter(host_numbers(tensors))
        by_step: dict[int, dict[str, Any]] = {}
        for step, tag, value in rows:
            numbers = [next(read) if isinstance(v, torch.Tensor) else float(v) for v in _as_list(value)]
            number = numbers[0] if len(numbers) == 1 else sum(numbers) / len(numbers)  # inf - inf: nan, as torch
            # One value per tag and step, the last: trainer.log in each micro-batch of an accumulated iteration (as
            # Lightning logs the stepping batch's), a count logged at each of two optimizers' skips.
            by_step.setdefault(step, {})[tag] = Summary.Value(tag=tag, simple_value=number)
        for step, values in by_step.items():
            self.writer.file_writer.add_summary(Summary(value=list(values.values())), step)

    def on_validation_end(self, trainer, metrics: dict[str, float]) -> None:
        if self.writer is None or trainer.state.stage != "fit":  # not the sanity pass before training
            return
        # This step's logged values wait: inside a batch (val_every_n_steps) the Trainer's own on_train_batch_end may
        # log one again, and one tag's two values at one step would be two points.
        self._queued += self._taken()
        self._flush(before=trainer.state.global_step)
        with self._writing():
            for key, value in metrics.items():
                self.writer.add_scalar(f"val/{key}", value, trainer.state.global_step)
            self.writer.flush()

    def on_train_epoch_end(self, trainer) -> None:
        if self.writer is None:
            return
        self._take_logged_and_flush()
        with self._writing():
            for tag, value in trainer.epoch_scalars.items():
                self.writer.add_scalar(self._epoch_tag(tag), value, trainer.state.global_step)

    def _epoch_tag(self, tag: str) -> str:
        """``tag``, or ``<tag>_epoch`` where training_step returns a value of that name, which is written under
        ``tag`` at each log step: one curve would mix the two (log(on_epoch=True, on_step=False) of the returned
        loss, as a Lightning port does). Said once, naming both."""
        if tag not in self._output_tags:
            return tag
        if tag not in self._renamed:
            self._renamed.add(tag)
            named = shown(tag)  # a pasted 100 kB tag by its start and length
            rank_zero_warn(
                f"log({named}, on_epoch=True, on_step=False): TensorBoard writes {named} at each log step already "
                f"(training_step returns {shown(tag.removeprefix('train/'))}), so its epoch mean goes to "
                f"{shown(tag + '_epoch')} instead of mixing into that curve; log it under another tag, or with "
                "on_step=True for both"
            )
        return f"{tag}_epoch"

    def on_train_end(self, trainer) -> None:
        if self.writer is None:
            return
        self._take_logged_after_the_last_batch()  # first: the window leaves out a tag log() writes
        # The batches since the last log step, as their own point at the last step.
        self._queued += self._window_rows(trainer.state.global_step)
        self._window = {}
        self._flush()
        # The tags on_validation_end hooks logged are validation metrics too (an AUC over the set), as they are to
        # monitors and in what validate() returns; the HParams tab compares runs by them.
        final = {f"val/{key}": value for key, value in trainer.val_metrics.items()} | trainer.validation_end_values
        experiment, _, end = _hparams_summaries(trainer, final)
        with self._writing():
            self.writer.file_writer.add_summary(experiment)
            self.writer.file_writer.add_summary(end)

    def _take_logged_after_the_last_batch(self) -> None:
        """Queue what log() got after the last batch (the last epoch's on_train_epoch_end, a Trainer's own
        on_train_end, which runs after this callback's): no batch end follows to take it up."""
        self._queued += self._taken()

    def on_exception(self, trainer, exception: BaseException) -> None:
        self._failed = True

    def on_fit_end(self, trainer) -> None:  # after on_exception too: what was queued before a crash is written
        if self.writer is None:
            return
        try:
            self._take_logged_after_the_last_batch()
            self._flush()
            with self._writing():
                self.writer.close()
        except RunDirectoryError:
            if not self._failed:  # after a failure it fails again (its thread stopped at a full disk): the first stands
                raise
        finally:
            self.writer, self._step_events, self._carried = None, None, None
            trainer.logger = Logger()
            writer_closed()


def _learning_rates(optimizer_name: str, optimizer: torch.optim.Optimizer, momentum: bool) -> list[tuple[str, float]]:
    """Each param group's ``(tag, lr)``, as Lightning's LearningRateMonitor names them: ``train/lr/<optimizer>`` for
    the first, ``/group_<i>`` for the others, or ``/<name>`` for a group given a ``"name"`` (a name two groups share
    goes to the first; the second keeps its index, so neither value hides the other). With ``momentum``, also each
    group's ``train/momentum/...``: its ``momentum``, or Adam's first beta (a group with neither has none)."""
    rows, suffixes = [], set()
    for i, group in enumerate(optimizer.param_groups):
        name = group.get("name")
        suffix = f"/{name}" if isinstance(name, str) and name else None
        if suffix is None or suffix in suffixes:
            suffix = f"/group_{i}" if i else ""
        suffixes.add(suffix)
        rows.append((f"train/lr/{optimizer_name}{suffix}", group["lr"]))
        value = group.get("momentum", group.get("betas", (None,))[0]) if momentum else None
        if value is not None:
            rows.append((f"train/momentum/{optimizer_name}{suffix}", value))
    return rows


def _as_list(value: Any) -> list[Any]:
    """A logged value as the list of values it stands for (a window of batch outputs stands for its mean)."""
    return value if isinstance(value, list) else [value]


def _hparams_summaries(trainer, metrics: dict[str, float]) -> tuple[Any, Any, Any]:
    """TensorBoard's (experiment, session start, session end) summaries for the flattened config (a
    ``trainer.max_time`` dict is one value, as written, not one hparam per unit)."""
    from torch.utils.tensorboard.summary import hparams  # imports tensorboard's protobufs: only when logging

    config = OmegaConf.to_container(trainer.cfg, resolve=True, enum_to_str=True)
    return hparams(flatten(one_max_time(config)), metrics)
