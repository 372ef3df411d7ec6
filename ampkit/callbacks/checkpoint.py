"""Periodic and best-k checkpoints, written atomically (by rank zero; under FSDP every rank writes its shards);
``last.pt`` always names the newest, ``best.pt`` the best by the monitored metric."""

from __future__ import annotations

import glob
import numbers
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_warn

from ampkit.amp.scaler import interval_option
from ampkit.callbacks.checkpoint_names import LIGHTNING_NAMING, check_naming, is_own_name, last_file_name
from ampkit.callbacks.lightning_attributes import RefusesLightningAttributes
from ampkit.callbacks.monitor import KeyedByMonitor, Monitor, check_mode
from ampkit.lightning_settings import (
    LIGHTNING_NONE_INTERVAL,
    LIGHTNING_POSITIONAL_ORDER,
    LIGHTNING_ZERO,
    lightning_arguments_error,
    lightning_positional_error,
)
from ampkit.trainer.callback import Phase
from ampkit.trainer.checkpoint_io import (
    CheckpointError,
    copy_atomic,
    deletable,
    foreign_file,
    from_storage,
    is_best_k_checkpoint_name,
    peek_checkpoint,
    refuse_foreign,
    save_atomic,
    unloadable_entry,
)
from ampkit.trainer.distributed import broadcast_object, decided_by_rank_zero
from ampkit.trainer.ordering import CallbackOrderError
from ampkit.trainer.preemption import Preempted
from ampkit.trainer.run_life import half_written, loop_of, prune_periodic
from ampkit.trainer.sharded_checkpoint import (
    LAST,
    copy_sharded,
    is_our_link,
    is_sharded_checkpoint,
    periodic_checkpoints,
    point_last_at,
    prune_sharded,
    remove_sharded,
    save_sharded,
    training_order,
    write_failure,
)
from ampkit.trainer.temp_names import temp_name_of
from ampkit.trainer.waiting import barrier
from ampkit.wording import shown


class ModelCheckpoint(KeyedByMonitor, RefusesLightningAttributes):
    """Save ``step-N.pt`` every ``every_n_steps`` iterations and ``epoch-N.pt`` every ``every_n_epochs``
    epochs, plus at the end of training; keep the newest ``keep_last`` of them and ``last.pt`` (every one of them
    with ``save_top_k=-1`` and no ``monitor``, as Lightning's ModelCheckpoint keeps every save then).

    Its phase runs last, after the Trainer's own hooks too, so it captures an iteration's final state (e.g. updated
    loss scales, what the Trainer's ``on_train_batch_end`` changed).
    A crash at any moment leaves the previous ``last.pt`` loadable: files are renamed into place.

    With ``monitor`` (a validation metric, ``mode`` min or max) each validation among the ``save_top_k`` (-1: all)
    best so far is saved as ``best-<step>.pt`` and ``best.pt`` names the best one; a ``train/`` tag ranks each
    epoch's end by its ``log(..., on_epoch=True)`` mean instead. The ranking is saved in checkpoints, so a resumed
    run keeps it. A file leaves the top k only after its replacement is written.
    A run resumed with another ``monitor`` or ``mode`` ranks afresh; the earlier ranking's files are kept.
    Beside another one (the config's, and a best-k one in code) the step and epoch files have one writer, the first
    that saves them: it alone writes them, prunes them by its ``keep_last`` and makes the run's end save.

    Lightning's ``CHECKPOINT_NAME_LAST`` (``"{epoch}-last"``, set on the class, a subclass or an instance) names a copy
    of each checkpoint it saves, formatted as Lightning's (``epoch=3-last.pt``, the previous one removed), beside
    ``last.pt``, which ``--resume last`` reads; Lightning's other naming attributes are refused where changed.
    """

    CHECKPOINT_NAME_LAST: str = LIGHTNING_NAMING["CHECKPOINT_NAME_LAST"]
    CHECKPOINT_JOIN_CHAR: str = LIGHTNING_NAMING["CHECKPOINT_JOIN_CHAR"]
    CHECKPOINT_EQUALS_CHAR: str = LIGHTNING_NAMING["CHECKPOINT_EQUALS_CHAR"]
    FILE_EXTENSION: str = LIGHTNING_NAMING["FILE_EXTENSION"]
    STARTING_VERSION: int = LIGHTNING_NAMING["STARTING_VERSION"]

    phase = Phase.PERSIST
    saves_checkpoints = True  # after every other PERSIST hook: its save holds what they did
    # Its monitor reads what was logged: it runs after every other checkpoint writer too (Lightning runs it last), so
    # a value one of them logs at that hook is ranked, wherever that one stands in the list.
    reads_logged_values = True
    takes_part_in_collectives = True  # rank zero decides saves; a subclass on another rank takes the same ones

    def __init__(
        self,
        every_n_steps: int = 0,
        every_n_epochs: int = 1,
        keep_last: int = 2,
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
        **lightning_only: Any,
    ) -> None:
        if lightning_only:  # dirpath, filename, save_last...: a port hears what does their work here
            raise lightning_arguments_error(type(self), list(lightning_only))
        check_naming(self, sharded=False)  # a subclass's; one set on the instance later is checked as a fit starts
        for name, value in (
            ("every_n_steps", every_n_steps),
            ("every_n_epochs", every_n_epochs),
            ("keep_last", keep_last),
        ):
            if isinstance(value, (str, os.PathLike)):  # Lightning's dirpath, filename and monitor come first
                raise lightning_positional_error(type(self), name, value, _interval_refusal(name, value))
        for name, value in (("every_n_steps", every_n_steps), ("every_n_epochs", every_n_epochs)):
            _interval(name, value, positional=True)  # None: Lightning's default, or its dirpath or filename
        self.every_n_steps, self.every_n_epochs = every_n_steps, every_n_epochs  # each checked as it is set
        self.keep_last = keep_last
        check_mode(mode)  # without a monitor too, as Lightning: a typo would surface only once one is set
        save_top_k = _top_k(save_top_k)
        # 0 or "" was no monitor, silently (the config refuses a blank one)
        # default_callbacks names the config key of the config's
        self._monitor = _watching(None if monitor is None else Monitor(monitor, mode), save_top_k)
        self._mode, self._save_top_k = mode, save_top_k
        self.best_k: dict[str, float] = {}  # file name -> monitored value, the best first
        self.kept: list[str] = []  # best-k files ranked by an earlier monitor or mode: neither ranked nor pruned
        self._ranked_by: dict[str, str] = {}  # the monitor and mode of a restored ranking, kept when this run has none
        self._saved_at: dict[str, Any] | None = None  # the moment (loop position, stop, validation) saved last
        self._pending: float | None = None  # a validation's value, saved once the iteration's state is final
        self._protected: set[Path] = set()  # write-protected files pruning passed over, each warned about once
        self._protected_before: list[str] = []  # the names of those a resumed run's checkpoint had warned about
        self._restored = False  # a resume loaded its state: its ranking says which best files are this lineage's
        self._peers: list[ModelCheckpoint] = [self]  # every ModelCheckpoint of the run, this one among them
        self._writes_periodic = True  # whether this one writes and prunes the step/epoch files (one per run does)
        self._directory: Path | None = None  # the checkpoints directory of the latest fit, which best_k's names are in
        self._newest: str | None = None  # the step or epoch file it saved last: best_model_path without a monitor
        self._current: float | None = None  # the monitored value of the best-k file saved last (current_score)
        self._inherited: list[str] = []  # a branch's ranked files, in the run it branched from: copied at its save
        self._inherit_from: Path | None = None  # that run's checkpoints directory
        self._branched_newest = ""  # a branch's best_model_path without a monitor until it saves: its origin's file
        self._branched_last = ""  # a branch's last_model_path until it saves: the checkpoint it resumed
        self._named_last: str | None = None  # the CHECKPOINT_NAME_LAST file it wrote last (None: last.pt alone)
        self._replacing: str | None = None  # the one before it, which that save removed (a kill may have left it)

    @property
    def monitor(self) -> Monitor | None:
        """The metric best-k ranks by (equal to its name, as Lightning's string is), or None; a name (or None)
        assigned after construction (``ckpt.monitor = "val/acc"``, as Lightning allows) is checked as the
        constructor's, and a ranking by another metric or mode is set aside as a resume by one sets it aside."""
        return self._monitor

    @monitor.setter
    def monitor(self, metric: str | None) -> None:
        self._set_monitor(_watching(None if metric is None else Monitor(metric, self.mode), self.save_top_k))

    @property
    def mode(self) -> str:
        """Lightning's ``mode``: ``min`` or ``max``, as given (also without a ``monitor``); assignable, checked as the
        constructor's."""
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        check_mode(mode)
        watched = self._monitor
        self._set_monitor(None if watched is None else Monitor(watched.metric, mode, key=watched.setting))
        self._mode = mode

    @property
    def save_top_k(self) -> int:
        """How many best checkpoints by ``monitor`` are kept (-1: every one); assignable, checked as the
        constructor's."""
        return self._save_top_k

    @save_top_k.setter
    def save_top_k(self, save_top_k: int) -> None:
        save_top_k = _top_k(save_top_k)
        _watching(self._monitor, save_top_k)
        self._save_top_k = save_top_k

    @property
    def keep_last(self) -> int | None:
        """How many of the newest step and epoch files are kept; None (every one) with ``save_top_k=-1`` and no
        ``monitor``, as Lightning's ModelCheckpoint keeps every save then."""
        return None if self.save_top_k == -1 and self.monitor is None else self._keep_last

    @keep_last.setter
    def keep_last(self, keep_last: int) -> None:
        self._keep_last = interval_option(keep_last, "ModelCheckpoint: keep_last")

    @property
    def every_n_steps(self) -> int:
        """Save ``step-N.pt`` every this many iterations (0: never); assignable, checked as the constructor's."""
        return self._every_n_steps

    @every_n_steps.setter
    def every_n_steps(self, every_n_steps: int) -> None:
        self._every_n_steps = _interval("every_n_steps", every_n_steps)

    @property
    def every_n_epochs(self) -> int:
        """Save ``epoch-N.pt`` every this many epochs (0: never); assignable, checked as the constructor's."""
        return self._every_n_epochs

    @every_n_epochs.setter
    def every_n_epochs(self, every_n_epochs: int) -> None:
        self._every_n_epochs = _interval("every_n_epochs", every_n_epochs)

    def _set_monitor(self, monitor: Monitor | None) -> None:
        """Rank by ``monitor`` from now on; the files ranked by another metric or mode (the monitor set before, or,
        while none was, the one a restored ranking was measured by) are kept, no longer ranked."""
        ranked_by = self._monitor.state_dict() if self._monitor is not None else self._ranked_by
        if monitor is None:  # the ranking stays: what measured it is saved with it and checked by the next monitor
            self._ranked_by = ranked_by
        elif self.best_k and monitor.changed_since(ranked_by) is not None:
            self.kept += list(self.best_k)
            self.best_k, self._current = {}, None
        self._monitor = monitor

    @property
    def best_k_models(self) -> dict[str, float]:
        """Lightning's ``best_k_models``: each kept best-k checkpoint's path -> its monitored value, the best first
        (floats, not tensors); restored by a resume, empty before a fit or without a ``monitor``."""
        if self._directory is None:
            return {}
        return {self._path_of(name): value for name, value in self.best_k.items()}

    def _path_of(self, name: str) -> str:
        """The path of ranked file ``name``: in the checkpoints directory, or, for a branch's inherited file not yet
        copied in (before its first save), in the run it branched from, where it is."""
        return str((self._inherit_from if name in self._inherited else self._directory) / name)

    @property
    def best_model_path(self) -> str:
        """Lightning's ``best_model_path``: the path of the best checkpoint ranked so far (``best.pt`` is a copy of
        it), or ``""`` where none was; without a ``monitor``, as Lightning's, the step or epoch file saved last (the
        run's, where another ModelCheckpoint writes them)."""
        if self.monitor is not None:
            return next(iter(self.best_k_models), "")
        newest = self._newest or next((cb._newest for cb in self._peers if cb._newest), None)
        if newest is None:  # none saved yet: a branch names the file its checkpoint named, in the run it came from
            return self._branched_newest if self._directory is not None else ""
        return str(self._directory / newest) if self._directory is not None else ""

    @property
    def best_model_score(self) -> float | None:
        """Lightning's ``best_model_score``: the monitored value of :attr:`best_model_path`, or None where none was
        ranked."""
        return next(iter(self.best_k.values()), None) if self._directory is not None else None

    @property
    def current_score(self) -> float | None:
        """Lightning's ``current_score``: the monitored value of the checkpoint that entered the top k last (a
        float), or None before one did; restored by a resume."""
        return self._current

    @property
    def kth_best_model_path(self) -> str:
        """Lightning's ``kth_best_model_path``: once the top k is full (with ``save_top_k=-1``, once one is ranked), the
        path of the checkpoint a better value pushes out next, the oldest of the worst; ``""`` before."""
        kth = self._kth()
        return "" if kth is None or self._directory is None else self._path_of(kth)

    @property
    def kth_value(self) -> float | None:
        """Lightning's ``kth_value``: the monitored value of :attr:`kth_best_model_path` (a float), a value to beat to
        enter the full top k; None before (where Lightning's holds inf)."""
        kth = self._kth()
        return None if kth is None or self._directory is None else self.best_k[kth]

    def _kth(self) -> str | None:
        """The name of the ranked file a better value pushes out next, or None while the top k has room."""
        if not self.best_k or (self.save_top_k != -1 and len(self.best_k) < self.save_top_k):
            return None
        ranked = list(self.best_k.items())
        return ranked[_oldest_of_the_worst(ranked)][0]

    @property
    def last_model_path(self) -> str:
        """Lightning's ``last_model_path`` (ampkit always keeps one, as Lightning's ``save_last=True``): the path of
        ``last.pt`` (a sharded run's ``last``) once the run saved a checkpoint, ``""`` before; a branch, before its
        first save, the checkpoint it resumed (in the run it branched from), as Lightning's restored path names one."""
        if self._directory is None:
            return ""
        # a branch's inherited best files are in the run it branched from: its own last is not written yet
        own = (name for cb in self._peers for name in (cb._newest, *cb.best_k, *cb.kept) if name not in cb._inherited)
        saved = next((name for name in own if name), None)
        if saved is None:
            return self._branched_last
        if self._named_last is not None:  # Lightning's: the file its CHECKPOINT_NAME_LAST names
            return str(self._directory / self._named_last)
        return str(self._directory / ("last.pt" if saved.endswith(".pt") else LAST))

    @property
    def dirpath(self) -> str | None:
        """Lightning's ``dirpath``: the checkpoints directory of the latest fit (``<run>/version_N/checkpoints``), or
        None before one; set by the run directory here, not by an argument."""
        return None if self._directory is None else str(self._directory)

    def ranked_in(self, directory: Path) -> None:
        """Name the restored ranking's files in ``directory``: for a resume of a finished run, where no
        :meth:`on_fit_start` runs to say where the run's checkpoints are."""
        self._directory = directory

    def on_fit_start(self, trainer) -> None:
        """Tidy up after a killed run: drop files beyond ``keep_last`` and best files out of the restored ranking
        (all of this directory's own lineage; its temp files went before: see ``ampkit.trainer.run_life``)."""
        peers = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
        check_naming(self, trainer.sharded)  # CHECKPOINT_NAME_LAST set on the instance, as Lightning's docs show
        if self.monitor is not None:
            self.monitor.check_reachable(trainer)
            rankers = [str(cb.monitor) for cb in peers if cb.monitor is not None]
            if len(rankers) > 1:  # one checkpoints directory: each would prune the other's best files and best.pt
                raise CallbackOrderError(
                    f"{len(rankers)} ModelCheckpoint callbacks rank best checkpoints (monitors {', '.join(rankers)}); "
                    "they would share best.pt and the best-N files of one checkpoints directory, each pruning the "
                    "other's: rank by one monitor (checkpoint.monitor), and stop or log by the others"
                )
        periodic = {cb.state_key: cb._periodic_settings() for cb in peers if cb.every_n_steps or cb.every_n_epochs}
        if len(set(periodic.values())) > 1:  # one directory: the one keeping fewer would prune the other's files
            raise CallbackOrderError(
                f"{len(periodic)} ModelCheckpoint callbacks save step/epoch files into one checkpoints directory by "
                f"other settings ({'; '.join(f'{key}: {kept}' for key, kept in periodic.items())}), each pruning the "
                "other's: give the one in code every_n_epochs=0 and every_n_steps=0 (it saves its best-k files only), "
                "or the config's settings"
            )
        # One writer per file: the step and epoch files (periodic, and the run's end save) are the first periodic
        # one's to write and prune, so two by the same settings do not each write every file, and a best-k one does
        # not prune them by its own keep_last. Alone, one writes them all.
        self._peers = peers
        # rank zero's on every rank (a DDP run's other ranks have no version_dir): every rank ranks alike, so
        # best_model_path is one path on all of them, as Lightning's, for a test(ckpt=...) every rank runs
        named = trainer.rank_zero_version_dir
        self._directory = named / "checkpoints" if named is not None else None
        self._writes_periodic = self is next((cb for cb in peers if cb.every_n_steps or cb.every_n_epochs), peers[0])
        if trainer.fit_start.checkpoint_path is not None:  # the restored state is saved already: not again at the end
            self._saved_at = _moment(trainer)
        self._inherited, self._inherit_from, self._branched_newest, self._branched_last = [], None, "", ""
        if trainer.fit_start.branched_from is not None:  # a new version directory: the ranked files are in the old one
            # The branch ranks on from the restored ranking (ties too), so it keeps what the run it branched from
            # would have; its first save copies the ranked files in (on every rank alike: all save shards).
            self._inherited, self._inherit_from = list(self.best_k), trainer.fit_start.branched_from.parent
            # best_model_path until it saves, as Lightning's restored one (the straight run's has one too): the file its
            # checkpoint named newest, else (gone, or a checkpoint outside a run) the checkpoint it branched from
            named = self._inherit_from / self._newest if self._newest is not None else None
            self._branched_newest = str(
                named if named is not None and named.exists() else trainer.fit_start.branched_from
            )
            self._branched_last = str(trainer.fit_start.branched_from)
            self.kept, self._newest, self._protected_before = [], None, []
            self._named_last = self._replacing = None  # that run's named files are in its directory: not this one's
        # Rank zero alone tidies (other ranks have no run directory); its failure (a file it may not delete) stops
        # every rank here, or the others would train on into a collective it never joins.
        decided_by_rank_zero(partial(self._tidy, trainer, peers), trainer.dist)

    def _tidy(self, trainer, peers: list[ModelCheckpoint]) -> None:
        """Rank zero's tidy-up of the checkpoints directory at a fit's start (see :meth:`on_fit_start`)."""
        directory = trainer.version_dir / "checkpoints"
        self._protected = {directory / name for name in self._protected_before}  # said once in the run, not per resume
        if not directory.is_dir():
            return
        if self._restored:
            self._remove_named_temps(directory)
            self._remove_replaced_last(directory)
        if not self._restored or (self.monitor is None and not self.best_k and not self.kept):
            # No ranking of its own to tidy by: the best files there are another ModelCheckpoint's, or of a ranking
            # a resume did not restore (named in its warning), and stay.
            self._prune(directory)
            return
        ranked = {name for cb in peers for name in (*cb.best_k, *cb.kept)}  # any ModelCheckpoint's ranking stays
        unranked = [best for best in directory.glob("best-*") if best.name not in ranked]
        with _deleting(directory, "a best file out of the ranking the resume restored"):
            for best in deletable(sorted(unranked), self._protected):  # out of the top k, or written after last
                if is_best_k_checkpoint_name(best.name, sharded=False):
                    best.unlink(missing_ok=True)
                elif trainer.sharded and is_best_k_checkpoint_name(best.name, sharded=True):
                    if is_sharded_checkpoint(best) and not best.is_symlink():  # a whole model and optimizer state
                        remove_sharded(best)
        if trainer.sharded:
            self._copy_resumed_moment(trainer, directory)
            self._relink_best(directory)
        else:
            self._recopy_best(directory)
        self._prune(directory)

    def _remove_named_temps(self, directory: Path) -> None:
        """Remove the temp files a kill left while copying to the ``CHECKPOINT_NAME_LAST`` names the resumed state names
        (``.<name>.<random>.tmp``, which the fit's tidy, knowing ampkit's own names alone, keeps): only one holding what
        a killed copy leaves there, never a user's file under such a name."""
        for name in {self._named_last, self._replacing} - {None}:
            for path in directory.glob(f".{glob.escape(name)}.*.tmp"):
                if temp_name_of(path.name, "tmp", re.escape(name)) and not path.is_symlink() and half_written(path):
                    path.unlink(missing_ok=True)

    def _remove_replaced_last(self, directory: Path) -> None:
        """Remove the ``CHECKPOINT_NAME_LAST`` copy the resumed save replaced, where a kill before its removal left it:
        only a file provably that copy (its own state names it as its copy), never a user's under its name."""
        name = self._replacing
        if name is None or name == self._named_last:
            return
        path = directory / name
        if not _own_file(path) or not _names_itself_last(path):
            return
        with _deleting(directory, "the CHECKPOINT_NAME_LAST copy a killed save was replacing"):
            for left in deletable([path], self._protected):  # a write-protected one stays, named in a warning
                left.unlink(missing_ok=True)

    def _copy_resumed_moment(self, trainer, directory: Path) -> None:
        """Make the resumed moment's best-k copy where its ranking names one that is missing: a sharded run's first
        save failed copying it (a full disk) before any ``last`` was made, and ``--resume last`` took that moment's
        periodic directory (the fallback where ``last`` is missing). ``best`` names the copy where it leads the
        ranking, as after that save. (A file's moment has no such fallback: its resume by path branches.)"""
        start, loop = trainer.fit_start.checkpoint_path, trainer.fit_start.loop
        if start is None or loop is None:
            return
        copy = directory / f"best-{loop['global_step']:08d}"
        source = start.resolve()
        if copy.name not in self.best_k or copy.exists() or copy.is_symlink() or source.parent != directory.resolve():
            return
        copy_sharded(source, copy)
        if copy.name == next(iter(self.best_k)):
            point_last_at(copy, "best")

    def _recopy_best(self, directory: Path) -> None:
        """Make ``best.pt`` a copy of the restored ranking's best again where a kill left it holding another state:
        a save copies its new best there before it moves ``last.pt``, and that best's own file went above. A
        ``best.pt`` deleted by hand stays deleted."""
        if not self.best_k:
            return
        alias, best = directory / "best.pt", directory / next(iter(self.best_k))
        if alias.is_file() and best.is_file() and loop_of(alias) != loop_of(best):
            refuse_foreign(alias)  # a file of the user's there: plan_fit refused to continue the run, but not in code
            copy_atomic(best, alias)

    def _relink_best(self, directory: Path) -> None:
        """Point a sharded run's ``best`` link at the restored ranking's best again, where a kill left it naming a
        directory written after ``last`` (removed above). A dangling link to no checkpoint's name, the user's, stays."""
        link = directory / "best"
        if not link.is_symlink() or link.exists():
            return
        if self.best_k and is_sharded_checkpoint(directory / next(iter(self.best_k))):
            point_last_at(directory / next(iter(self.best_k)), "best")
        elif is_our_link(link):
            link.unlink(missing_ok=True)

    def _periodic_settings(self) -> str:
        """What it saves and keeps of the step and epoch files (``keep_last`` None: every one)."""
        return f"every_n_steps={self.every_n_steps}, every_n_epochs={self.every_n_epochs}, keep_last={self.keep_last}"

    def on_train_batch_end(self, trainer, outputs: dict[str, Any], batch: Any) -> None:
        s = trainer.state
        due = s.is_iteration_end and self.every_n_steps > 0 and s.global_step % self.every_n_steps == 0
        due = due and self._writes_periodic
        self._save_now(trainer, f"step-{s.global_step:08d}.pt" if due else None)

    def on_train_epoch_end(self, trainer) -> None:
        s = trainer.state
        if self.monitor is not None and self.monitor.per_epoch:  # a train/ epoch mean ranks this epoch's end
            self._pending = self.monitor.epoch_value(trainer)
        due = s.epoch_finished and self.every_n_epochs > 0 and (s.epoch + 1) % self.every_n_epochs == 0
        due = due and self._writes_periodic
        self._save_now(trainer, f"epoch-{s.epoch + 1:04d}.pt" if due else None)

    def on_validation_end(self, trainer, metrics: dict[str, float]) -> None:
        if self.monitor is not None and not self.monitor.per_epoch and trainer.state.stage == "fit":
            self._pending = self.monitor.value(metrics, trainer)

    def _save_now(self, trainer, periodic: str | None) -> None:
        """Save this moment under its periodic name and/or as a best-k file. The ranking takes in the pending
        validation first, so every file of one moment holds one state; ``last.pt`` moves last, so a kill
        before it leaves the previous moment as the one a resume repeats from."""
        ranking = self.best_k, self._current
        best, dropped = self._rank_pending(trainer)
        if periodic is None and best is None:
            return
        try:
            self.save(trainer, periodic or best, best=best)
        except BaseException:  # a failed save (a full disk): the ranking names only files that were written
            self.best_k, self._current = ranking
            raise
        # Rank zero deletes what left the ranking; its failure (a file it may not delete) stops every rank here, or
        # the others would train on into a collective it never joins. Every rank ranks rank zero's value from one
        # state, so all of them drop the same files and take this collective, or none does (most saves drop none).
        if dropped:
            decided_by_rank_zero(partial(self._drop, trainer, dropped), trainer.dist)

    def _drop(self, trainer, dropped: list[str]) -> None:
        """Delete the best-k files ``dropped`` from the ranking (rank zero; a write-protected one stays)."""
        directory = trainer.version_dir / "checkpoints"
        with _deleting(directory, f"out of the save_top_k={self.save_top_k} best"):
            for name in (old.name for old in deletable([directory / name for name in dropped], self._protected)):
                if trainer.sharded:
                    remove_sharded(directory / name)
                else:
                    (directory / name).unlink(missing_ok=True)

    def _rank_pending(self, trainer) -> tuple[str | None, list[str]]:
        """Enter the pending validation value into the best-k ranking: (this moment's best-k file name if it
        made the top k, the names it pushed out)."""
        value, self._pending = self._pending, None
        if value is None:
            return None, []
        ranked = list(self.best_k.items())
        top_k = len(ranked) + 1 if self.save_top_k == -1 else self.save_top_k  # -1: every one (Lightning's)
        if len(ranked) >= top_k and not self.monitor.improves(value, ranked[-1][1]):
            return None, []
        if not self.monitor.improves(value, None):  # NaN or inf: never among the best
            return None, []
        name = f"best-{trainer.state.global_step:08d}" + ("" if trainer.sharded else ".pt")
        ranked.append((name, value))
        ranked.sort(key=lambda item: item[1], reverse=self.monitor.mode == "max")  # stable: ties oldest first
        dropped = []
        while len(ranked) > top_k:  # more than one only where a resume lowered save_top_k
            dropped.append(ranked.pop(_oldest_of_the_worst(ranked))[0])
        self.best_k, self._current = dict(ranked), value  # recorded first: the new file's own state includes them
        return name, dropped

    def state_dict(self) -> dict[str, Any]:
        ranked_by = self.monitor.state_dict() if self.monitor is not None else self._ranked_by
        protected = sorted(path.name for path in self._protected if path.exists())
        newest = {} if self._newest is None else {"newest": self._newest}
        current = {} if self._current is None else {"current_score": self._current}
        named = {} if self._named_last is None else {"named_last": self._named_last}
        replacing = {} if self._replacing is None else {"replacing_last": self._replacing}
        return {
            "best_k": dict(self.best_k),
            "kept": list(self.kept),
            "protected": protected,
            **newest,
            **current,
            **named,
            **replacing,
            **ranked_by,
        }

    def _check_names(self, ranked: list[Any], protected: list[Any]) -> None:
        """Refuse a restored state naming a file outside its checkpoints directory (``../notes.txt``), which pruning
        would delete: an edited or damaged checkpoint, as ampkit writes best-k names and plain file names only."""
        ranked = [name for name in ranked if not _is_best_k_name(name)]
        plain = [name for name in protected if not _is_plain_name(name)]
        if ranked or plain:
            raise CheckpointError(
                f"the checkpoint's {self.state_key} state names {shown((ranked or plain)[0])} among its checkpoint "
                "files, which is no file name ampkit gives one (best-<step>.pt) and which its pruning would delete: "
                "the checkpoint was edited or is damaged; resume an earlier one"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved ranking; one by another monitor or mode is set aside (its files kept) and ranking restarts."""
        best_k, kept, protected = dict(state.get("best_k", {})), list(state.get("kept", [])), state.get("protected", [])
        newest = state.get("newest")  # absent before this ampkit, and before a first save
        named = state.get("named_last")  # as newest, and where CHECKPOINT_NAME_LAST was 'last'
        replacing = state.get("replacing_last")  # as named_last, and where no earlier copy was replaced
        files = (name for name in (newest, named, replacing) if name is not None)
        self._check_names([*best_k, *kept], [*protected, *files])
        for copy in (named, replacing):  # the next save (or the resume) would remove that file as a previous copy
            if copy is not None and is_own_name(copy):
                raise CheckpointError(
                    f"the checkpoint's {self.state_key} state names {copy!r} as a CHECKPOINT_NAME_LAST copy, which is "
                    "the name of one of ampkit's own checkpoint files: the checkpoint was edited or is damaged; resume "
                    "an earlier one"
                )
        current = state.get("current_score")  # as newest
        if current is not None and (isinstance(current, bool) or not isinstance(current, numbers.Real)):
            raise CheckpointError(
                f"the checkpoint's {self.state_key} state holds current_score {shown(current)}, which is no number: "
                "the checkpoint was edited or is damaged; resume an earlier one"
            )
        # Only once all of it is checked: a refused state leaves the ranking this callback had.
        self.best_k, self.kept, self._protected_before = best_k, kept, list(protected)
        self._newest, self._named_last, self._replacing = newest, named, replacing
        self._restored = True
        self._ranked_by = {key: state[key] for key in ("monitor", "mode") if key in state}
        change = self.monitor.changed_since(state) if self.monitor is not None else None
        self._current = None if current is None or change is not None else float(current)  # another metric's: none
        if change is not None and self.best_k:
            rank_zero_warn(
                f"checkpoint.monitor or mode changed since the checkpoint ({change}): best-k ranks afresh from the "
                f"next validation; the files ranked before ({', '.join(self.best_k)}) are kept and no longer pruned, "
                "and best.pt names the earlier best until the first validation"
            )
            self.kept += list(self.best_k)
            self.best_k = {}

    def on_train_end(self, trainer) -> None:
        moment = _moment(trainer)  # also a stop asked after this step's save (an epoch-end hook) is another moment
        if self._writes_periodic and all(cb._saved_at != moment for cb in self._peers):
            self.save(trainer, f"step-{trainer.state.global_step:08d}.pt")

    def on_exception(self, trainer, exception: BaseException) -> None:
        """A SIGTERM's stop (every rank raised :class:`Preempted` at the same iteration's end) saves that step, so the
        preempted run resumes from where it stopped."""
        if not isinstance(exception, Preempted) or trainer.state.global_step == 0:
            return
        self.on_train_end(trainer)
        if trainer.dist.enabled:  # no rank leaves before rank zero's file is written: torchrun would end it
            barrier(f"the save of step {trainer.state.global_step}, where a SIGTERM stopped the run")

    def save(self, trainer, filename: str, best: str | None = None) -> Path | None:
        """Write a checkpoint named ``filename`` (also named ``best`` when given, and ``best.pt`` pointed at the
        best one), then point ``last.pt`` at it (rank zero; under FSDP every rank writes its shards). Every rank calls
        it: rank zero's failure stops them all. Saving is no training: the throughput windows leave its time out."""
        with trainer.paused():
            return self._save(trainer, filename, best)

    def _save(self, trainer, filename: str, best: str | None) -> Path | None:
        previous, named, replacing = self._newest, self._named_last, self._replacing
        # as Lightning's, first; before anything is recorded: a name set anew since the fit started may be refused
        named_now = last_file_name(self, trainer.state.epoch, trainer.state.global_step)
        if filename != best:  # a step or epoch file (a best-k one alone is named after its ranking), recorded first:
            self._newest = Path(filename).stem if trainer.sharded else filename  # its own state names it
        self._named_last = named_now
        self._replacing = named if named != named_now else None  # its state names both: a resume finds both
        try:
            return self._write_everywhere(trainer, filename, best, named)
        except BaseException:  # a failed save (a full disk): best_model_path names the file before it, which is there
            self._newest, self._named_last, self._replacing = previous, named, replacing
            raise

    def _write_everywhere(self, trainer, filename: str, best: str | None, named: str | None) -> Path | None:
        checkpoint = trainer.checkpoint_dict()  # every rank assembles: hooks may need collectives
        if (entry := unloadable_entry(checkpoint)) is not None:  # found at the first save, not at the resume
            raise CheckpointError(
                f"checkpoint '{filename}' would hold {entry}, which torch.load(weights_only=True) refuses, so the run "
                "could never resume from it: a callback's state_dict() or on_save_checkpoint may hold tensors, "
                "numbers, strings and lists, tuples and dicts of them (float(x), torch.as_tensor(x)), or what "
                "torch.serialization.add_safe_globals allows"
            )
        self._saved_at = _moment(trainer)
        inherited, self._inherited = self._inherited, []  # a branch's first save copies them; on every rank alike
        if trainer.sharded:  # FSDP: every rank writes its shards into a directory named without ".pt"
            return self._save_sharded(trainer, checkpoint, Path(filename).stem, best, inherited)
        # Rank zero writes the file; where that fails (a full disk) every rank stops here with its error, rather than
        # training on into a collective rank zero never joins.
        write = partial(self._write, trainer, checkpoint, filename, best, inherited, named)
        path = decided_by_rank_zero(write, trainer.dist)
        trainer.rank_zero_last = path.parent / "last.pt"  # every rank: a failure's note names rank zero's
        return path if trainer.is_global_zero else None

    def _copy_inherited(self, trainer, inherited: list[str]) -> None:
        """Copy the ranked files a branch inherited (those still among its best) from the run it branched from into its
        own checkpoints directory, and make ``best.pt`` (a sharded run's ``best``) name the best of them where it leads
        the ranking (rank zero, at its first save). A file gone from there (pruned since, deleted) or no longer that
        step's stays ranked by its value, as in that run, and is named in a warning."""
        if not inherited:
            return
        directory, source = trainer.version_dir / "checkpoints", self._inherit_from
        names = [name for name in inherited if name in self.best_k]
        gone, writing = [], directory
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for name in names:
                origin, writing = source / name, directory / name
                whole = is_sharded_checkpoint(origin) if trainer.sharded else origin.is_file()
                loop = loop_of(origin) if whole else None
                if loop is None or loop.get("global_step") != int(name.removeprefix("best-").removesuffix(".pt")):
                    gone.append(name)
                elif trainer.sharded:
                    copy_sharded(origin, writing)
                else:
                    refuse_foreign(writing)
                    copy_atomic(origin, writing)
            best = directory / next(iter(self.best_k))
            if best.name in names and best.name not in gone:
                if trainer.sharded:
                    writing = directory / "best"
                    point_last_at(best, "best")
                else:
                    refuse_foreign(writing := directory / "best.pt")
                    copy_atomic(best, writing)
        except OSError as exc:  # a full disk: the run it branched from is as it was, and this one has no save yet
            last = directory / ("last" if trainer.sharded else "last.pt")
            raise _save_failed(writing, exc.strerror or str(exc), last, None, exc, trainer.rank_zero_last) from None
        if gone:
            rank_zero_warn(
                f"the best-k ranking this branch continues names {', '.join(gone)}, no longer in '{source}' as that "
                "step's checkpoint (deleted, unreadable, or something else under its name now, which stays as it is): "
                "they stay ranked by their values (so the branch keeps what that run would), without a copy in this run"
            )

    def _write(
        self,
        trainer,
        checkpoint: dict[str, Any],
        filename: str,
        best: str | None,
        inherited: list[str],
        replaced_last: str | None,
    ) -> Path:
        """Rank zero's part of a save: the file, a branch's inherited best-k files (its first save), its best-k copies,
        ``last.pt`` (then the ``CHECKPOINT_NAME_LAST`` copy, and ``replaced_last``, the one before it, goes), then the
        pruning. ``last.pt`` moves last: a kill before leaves the previous one."""
        directory, path = trainer.version_dir / "checkpoints", None
        new_best = best is not None and best == next(iter(self.best_k))  # best.pt copies it (else it holds it already)
        names = [filename, *([best] if best not in (None, filename) else []), *(["best.pt"] if new_best else [])]
        named = [] if self._named_last is None else [self._named_last]
        writing, last_moved = directory / filename, False
        try:
            for name in (*names, "last.pt", *named):  # a file of the user's at any stops the save before it writes
                refuse_foreign(writing := directory / name)
            path = save_atomic(checkpoint, writing := directory / filename)
            self._copy_inherited(trainer, inherited)
            for name in names[1:]:
                copy_atomic(path, writing := directory / name)
            copy_atomic(path, writing := directory / "last.pt")
            last_moved = True
            for name in named:
                copy_atomic(path, writing := directory / name)
            if replaced_last not in (None, *named) and _own_file(writing := directory / replaced_last):
                writing.unlink(missing_ok=True)  # Lightning's save_last removes the previous too
        except OSError as exc:  # a full disk, a quota, a read-only remount: the previous files are whole
            reason = exc.strerror or str(exc)
            if directory.exists() and not directory.is_dir():  # mkdir's bare "File exists" named no culprit
                reason = f"'{directory}' is a file now, not the checkpoints folder; ampkit leaves it as it is"
            if last_moved:  # this save is whole, last.pt too: only the named copy (or the removal of the one before)
                raise from_storage(
                    CheckpointError(
                        f"could not write or replace the CHECKPOINT_NAME_LAST copy '{writing}' ({reason}); last.pt "
                        f"holds this save's checkpoint ('{path}'), and --resume last continues from it"
                    ),
                    exc,
                ) from None
            raise _save_failed(writing, reason, directory / "last.pt", path, exc, trainer.rank_zero_last) from None
        self._prune(directory)
        return path

    def _prune(self, directory: Path, sharded: bool = False) -> None:
        """Delete the periodic checkpoints ``keep_last`` no longer keeps. A deletion that fails (an I/O error, a
        read-only remount, a folder without write permission) stops the run in one line: what was saved is whole."""
        if self.keep_last is None or not self._writes_periodic:
            return
        with _deleting(directory, f"older than the keep_last={self.keep_last} newest checkpoints"):
            (prune_sharded if sharded else prune_periodic)(directory, self.keep_last, self._protected)

    def _save_sharded(
        self, trainer, checkpoint: dict[str, Any], name: str, best: str | None, inherited: list[str]
    ) -> Path:
        directory, path = trainer.version_dir / "checkpoints", None
        writing = directory / name
        try:
            path = save_sharded(checkpoint, trainer.module, trainer.optimizers, writing, trainer.dist)
            if best is not None and best != name:  # one moment, two names: the state written once, then copied
                writing = directory / best
                decided_by_rank_zero(partial(copy_sharded, path, writing), trainer.dist)
            if inherited:  # a branch's first save: after its own directory, so a kill leaves that one the newest
                decided_by_rank_zero(partial(self._copy_inherited, trainer, inherited), trainer.dist)
        except BaseException as exc:  # a full disk on any rank (DCP gathers the failures): the previous ones are whole
            reason = write_failure(exc)
            if reason is None:
                raise
            raise _save_failed(writing, reason, directory / LAST, path, exc, trainer.rank_zero_last) from None
        # Rank zero moves the links; its failure (a write-protected copy of a checkpoint in a link's place) stops every
        # rank, or the others would train on into a collective it never joins.
        failed = self._point_links(directory, path, best) if trainer.is_global_zero else None
        if (failed := broadcast_object(failed, trainer.dist)) is not None:
            reason = failed[1].strerror or str(failed[1])
            raise _save_failed(Path(failed[0]), reason, directory / LAST, path, failed[1], trainer.rank_zero_last)
        if self.keep_last is not None and self._writes_periodic:  # rank zero's failure stops every rank, as above
            decided_by_rank_zero(partial(self._prune, directory, sharded=True), trainer.dist)
        trainer.rank_zero_last = directory / LAST  # every rank: a failure's note names rank zero's
        return path

    def _point_links(self, directory: Path, path: Path, best: str | None) -> tuple[str, OSError] | None:
        """Point ``best`` (when this moment ranked) and ``last`` at their checkpoints; ``(link, error)`` of the one
        that could not be, or None."""
        writing = directory / "best"
        try:
            if best is not None:
                point_last_at(directory / next(iter(self.best_k)), "best")
            writing = directory / LAST
            point_last_at(path)
        except OSError as exc:
            return str(writing), exc
        return None


def _interval(name: str, value: Any, positional: bool = False) -> int:
    """``every_n_steps`` or ``every_n_epochs`` (``name``) as an int >= 0, else a ValueError naming it; Lightning's None
    (``positional``: or a None given by position for Lightning's first arguments) says what gives its saves."""
    if value is None:
        by_position = (
            f" (a None given by position for Lightning's {LIGHTNING_POSITIONAL_ORDER['ModelCheckpoint']}: pass them by "
            "keyword)"
            if positional
            else ""
        )
        raise ValueError(f"ModelCheckpoint: {name}=None is not taken here; {LIGHTNING_NONE_INTERVAL}{by_position}")
    return interval_option(value, f"ModelCheckpoint: {name}", zero_means="never")


def _interval_refusal(name: str, value: Any) -> str | None:
    """The error ``value`` gets as ``every_n_steps``, ``every_n_epochs`` or ``keep_last`` (``name``), or None where
    it is a valid one."""
    try:
        interval_option(value, f"ModelCheckpoint: {name}", zero_means=None if name == "keep_last" else "never")
    except ValueError as exc:
        return str(exc)
    return None


def _top_k(save_top_k: Any) -> int:
    """``save_top_k`` as an int >= 1 or -1, else a ValueError naming it (and Lightning's 0)."""
    if (
        isinstance(save_top_k, bool)
        or not isinstance(save_top_k, numbers.Integral)
        or (save_top_k < 1 and save_top_k != -1)
    ):  # True kept one file, a str failed in a comparison, 2.5 ranked 2.5 files
        zero = f"; {LIGHTNING_ZERO['save_top_k']}" if save_top_k == 0 and save_top_k is not False else ""
        raise ValueError(
            f"save_top_k {shown(save_top_k)} is invalid; expected an integer >= 1, or -1 (keep every one){zero}"
        )
    return int(save_top_k)


def _watching(monitor: Monitor | None, save_top_k: int) -> Monitor | None:
    """``monitor``, unless ``save_top_k`` keeps several best checkpoints without one to rank them by."""
    if save_top_k not in (1, -1) and monitor is None:
        raise ValueError(
            f"save_top_k={save_top_k} keeps the best checkpoints by monitor, which is not set: give monitor a "
            "validation metric (val/loss), or keep_last to keep the newest step and epoch files (save_top_k=-1 "
            "without a monitor keeps every one)"
        )
    return monitor


def _own_file(path: Path) -> bool:
    """Whether ``path`` is a checkpoint file ampkit may remove: a file, not a link (the user's, even to a checkpoint)
    nor a folder, holding an ampkit checkpoint."""
    return not path.is_symlink() and path.is_file() and not foreign_file(path)


def _names_itself_last(path: Path) -> bool:
    """Whether checkpoint file ``path`` is a ``CHECKPOINT_NAME_LAST`` copy ampkit wrote: a ModelCheckpoint's state in
    it names the file by its own name (a copy of ``last.pt`` a user made under that name names another)."""
    states = (peek_checkpoint(path) or {}).get("callbacks")
    return isinstance(states, dict) and any(
        isinstance(state, dict) and state.get("named_last") == path.name for state in states.values()
    )


def _oldest_of_the_worst(ranked: list[tuple[str, float]]) -> int:
    """The index in ``ranked`` (best first, ties oldest first) of the worst entry, the oldest of those tied for that
    place: the one a better value replaces, as Lightning's ``kth_best_model_path`` (``max``/``min`` keep the first)."""
    return next(i for i, (_, value) in enumerate(ranked) if value == ranked[-1][1])


def _is_best_k_name(name: Any) -> bool:
    """Whether ``name`` is a best-k checkpoint's (``best-00000012.pt``, or a sharded one's directory)."""
    return isinstance(name, str) and (
        is_best_k_checkpoint_name(name, sharded=False) or is_best_k_checkpoint_name(name, sharded=True)
    )


def _is_plain_name(name: Any) -> bool:
    """Whether ``name`` names a file in the directory itself: no path, no ``..``."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def _moment(trainer) -> dict[str, Any]:
    """What a checkpoint saved now would record of the run's course: its loop position, whether it stopped, and the
    step of its latest validation (one run after this step's save, as a stop's, is saved again at the end)."""
    return {**trainer.loop_position(), "stopped_early": trainer.stop_reason(), "validated_at": trainer.val_metrics_step}


@contextmanager
def _deleting(directory: Path, why: str) -> Iterator[None]:
    """A failed deletion of a checkpoint that ``why`` drops (an I/O error, a read-only remount, a folder without write
    permission) as one line: what the run saved is whole."""
    try:
        yield
    except OSError as exc:
        said = (
            f"could not delete '{exc.filename or directory}' ({why}: {exc.strerror or exc}); the checkpoints saved are "
            "whole, and --resume last continues from the newest"
        )
        raise from_storage(CheckpointError(said), exc) from None


def _save_failed(
    writing: Path, reason: str, last: Path, written: Path | None, cause: BaseException, before: Path | None
) -> CheckpointError:
    """The one-line error of a save that failed writing ``writing`` (for ``cause``): what is left to resume from
    (``last``, or the ``written`` checkpoint of a run's first save whose ``last`` could not be made). ``before``: the
    run's newest checkpoint until this save (``last`` where this run saved or resumed one; None, or another version's,
    where it has none), so a ``last`` deleted while it trained is told from one never saved."""
    if last.is_file() or is_sharded_checkpoint(last):
        left = f"{last.name} still holds the previous checkpoint, and --resume last continues from it"
    elif written is not None:  # the run's first save: its checkpoint is whole, only last is missing
        left = f"'{written}' was written whole: resume it by its path"
    elif before is None or before.resolve() != last.resolve():
        left = "this run has no checkpoint yet: free space (or get write access) and start it again"
    else:  # saved or resumed from, then deleted by hand (the checkpoints folder with it, often)
        folder = last.parent
        left_there = periodic_checkpoints(folder, False) + periodic_checkpoints(folder, True) if folder.is_dir() else []
        newest = max(left_there, key=training_order, default=None)
        left = f"'{before}' was deleted while the run trained" + (
            f"; '{newest}' is the newest checkpoint left: resume it by its path"
            if newest is not None
            else ", and no other checkpoint of the run is left: free space (or get write access) and start it again"
        )
    return from_storage(CheckpointError(f"could not write checkpoint '{writing}' ({reason}); {left}"), cause)
