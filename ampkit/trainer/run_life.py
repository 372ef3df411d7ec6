"""A run directory's life: which checkpoint a run starts from, which ``version_N`` it writes, its lock, its
config. Its rules, stated once (nothing a user wrote is ever overwritten or deleted by another run):

* ``fit()`` without ``resume`` writes a new ``<run_dir>/version_N`` (the next free N); in a worker group torchrun
  restarted (``--max-restarts``) it resumes the newest checkpoint this launch saved, if any (:func:`restarted_from`).
* ``fit(resume=...)`` starts from ``last``/``best`` (of the newest ``version_N`` under ``run_dir`` that has
  one) or a path, and then, decided before any user code runs:

  - **finished**: the checkpoint already reached ``trainer.max_epochs``/``trainer.max_steps``, or training
    stopped early there (early stopping, ``trainer.max_time``, or ``state.should_stop`` set by user code) and
    the keys that decide when it stops are unchanged (:data:`STOPPING_KEYS`). Nothing runs and nothing is
    written; a larger limit (or a changed stopping key) continues it from its exact state (RNG included).
  - **continue**: the checkpoint is its version directory's newest (``last.pt`` holds the same loop
    position) and that directory is under ``run_dir``: training goes on there (unless it is read-only, or its
    ``last``/``best`` is write-protected: then it is a branch).
  - **branch**: anything else (an older step file, a ``best.pt`` behind ``last.pt``, a file outside a run, the
    newest of a run under another ``run_dir``):
    a new ``version_N`` under ``run_dir``, whose ``lineage.yaml`` and ``config.yaml`` name the checkpoint
    it started from (TensorBoard's text ``run/lineage`` too). So a version directory holds one lineage, and
    pruning (``keep_last``, best-k), which only ever deletes inside the directory a run writes, never
    deletes a file of another lineage.

* Under ``torchrun`` rank zero alone looks at ``run_dir`` and decides the above for every rank; a rank that does not
  see the checkpoint it chose at that path (a node-local disk) stops every rank (``agreed_start``).
* A file with no write permission (``chmod a-w``, by mode: root too) is the user's to keep: nothing deletes or
  replaces it (``checkpoint_io.write_protected``). Pruning passes over it, uncounted, with one warning.
* Before a ``fit()`` (finished or not) writes anything, the temp files that a killed save left under ``run_dir``
  are removed: only ampkit's own temp names (:func:`remove_stale_temps`) holding what ampkit writes there, only in
  version directories an ampkit run made (another tool's ``version_N`` beside them is left alone) and no live run
  holds, and a sharded checkpoint set aside by an interrupted save is put back, never deleted. A save never stops
  for the user's thing at its temp name: it goes through a free one (``temp_names``).
* A run holds ``version_N/run.lock`` (its pid, host and process start) while it writes there; a second run into
  that directory is refused, naming both. A lock whose process is gone on this host (a SIGKILLed run, or a pid
  now another process's after a reboot or a container restart), or one of this process whose removal the disk
  refused, is stale and taken over. Under ``torchrun`` only rank zero takes it. The tidying above takes each idle
  directory's lock for a moment; a run starting there meanwhile waits for it, not refused.
* ``predict(output=...)`` never writes over a checkpoint: an output inside a ``checkpoints/`` folder or on a
  file that holds an ampkit checkpoint is refused; an existing file only with ``overwrite`` (never a write-protected
  one); an existing directory (or a path ending in ``/``) gets ``predictions.pt`` inside it; a symlink is written
  where it leads (the link stays).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from lightning_utilities.core.rank_zero import rank_zero_warn
from omegaconf import DictConfig, OmegaConf

from ampkit.amp import parse_dtype
from ampkit.config import AMPKIT_KEYS, duration_seconds, flatten, one_max_time
from ampkit.trainer.checkpoint_io import (
    BEST_K_STEM,
    FORMAT_KEY,
    NO_HARD_LINKS,
    PERIODIC_STEM,
    PROTECTED,
    CheckpointError,
    DamagedCheckpointError,
    _umask,
    deletable,
    foreign_file,
    from_storage,
    is_best_k_checkpoint_name,
    is_periodic_checkpoint_name,
    load_checkpoint,
    load_fingerprinted,
    peek_checkpoint,
    save_atomic,
    write_protected,
    write_text_atomic,
)
from ampkit.trainer.console import say
from ampkit.trainer.launch_env import launch_int
from ampkit.trainer.run_dir import new_version_dir, quoted_run_dir, unwritable_reason, version_dirs
from ampkit.trainer.sharded_checkpoint import (
    TRAINER_FILE,
    checkpoint_damage,
    checkpoint_kind,
    discard_checkpoint_dir,
    is_our_link,
    is_sharded_checkpoint,
    missing_sharded_parts,
    newest_whole_beside,
    periodic_checkpoints,
    training_order,
    users_own_at,
)
from ampkit.trainer.temp_names import RANDOM_PART, temp_name_of
from ampkit.wording import shown

LOCK_FILE = "run.lock"
LINEAGE_FILE = "lineage.yaml"
PREDICTIONS_FILE = "predictions.pt"
# The sections a resume reads; a checkpoint without one is refused before anything runs.
RESUME_SECTIONS = ("loop", "rng", "epoch_rng", "schedulers", "optimizer_counts", "callbacks")


class RunDirectoryError(RuntimeError):
    """A run directory cannot be used as asked (locked by a live run, an output that would destroy a checkpoint)."""


def resolve_checkpoint(run_dir: str | os.PathLike, ckpt: str | os.PathLike | None) -> Path | None:
    """A checkpoint from ``"last"``/``"best"`` (None if ``run_dir`` has none yet) or a path (an error if absent)."""
    if ckpt is None:
        return None
    if not isinstance(ckpt, str | os.PathLike):  # str() of it named a file of that name: fit(resume=True) 'True'
        hint = " ('last': the newest run's last checkpoint)" if isinstance(ckpt, bool) else ""
        raise TypeError(
            f"the checkpoint given is {shown(ckpt)}, of type {type(ckpt).__name__}; expected a path (str or "
            f"os.PathLike), 'last' or 'best'{hint}"
        )
    if str(ckpt) == "last":
        return next(filter(None, map(_last_of, reversed(version_dirs(run_dir)))), None)
    if str(ckpt) == "best":
        return next(filter(None, map(_best_of, reversed(version_dirs(run_dir)))), None)
    if not str(ckpt).strip():
        raise CheckpointError("the checkpoint path is empty: pass a path, 'last' or 'best'")
    path = Path(os.path.expandvars(os.path.expanduser(str(ckpt))))
    if path.is_file() or is_sharded_checkpoint(path):
        return path
    if missing := missing_sharded_parts(path):
        raise CheckpointError(f"'{path}' {_incomplete(path, missing)}{_newest_whole_beside(path)}")
    if path.is_dir():
        inside = next((c for c in (path / "last.pt", path / "checkpoints" / "last.pt") if c.is_file()), None)
        inside = inside or resolve_checkpoint(path, "last")  # a run_dir: its newest run's last
        hint = f" (e.g. '{inside}')" if inside is not None else ""
        raise CheckpointError(
            f"'{path}' is a directory, not a checkpoint: pass a checkpoint file in it{hint}, or 'last' or 'best'"
        )
    raise CheckpointError(f"no checkpoint file or sharded checkpoint at '{path}' (pass a path, 'last' or 'best')")


def _incomplete(path: Path, missing: list[str]) -> str:
    """Why sharded checkpoint directory ``path``, which lacks ``missing``, cannot be resumed."""
    return (
        f"is a sharded checkpoint without {' and '.join(missing)} (a save cut short, or a partial copy): it cannot "
        "be resumed"
    )


def _newest_whole_beside(path: Path) -> str:
    """``; the newest whole checkpoint beside it is '...'`` (:func:`newest_whole_beside`), or nothing."""
    whole = newest_whole_beside(path)
    return f"; the newest whole checkpoint beside it is '{whole}'" if whole is not None else ""


def _broken_alias(run_dir: str | os.PathLike, alias: str) -> str | None:
    """Why the newest version directory under ``run_dir`` whose ``checkpoints/`` holds ``alias`` (``last``/``best``,
    a file or a link) has no checkpoint by that name: it leads nowhere, or to a sharded checkpoint cut short."""
    for version in reversed(version_dirs(run_dir)):
        for name in (f"{alias}.pt", alias):
            link = version / "checkpoints" / name
            if not os.path.lexists(link):
                continue
            target = link.resolve()
            if missing := missing_sharded_parts(target):
                return f"'{link}' leads to '{target.name}', which {_incomplete(target, missing)}"
            if not target.exists():
                return f"'{link}' is a link to '{os.readlink(link)}', which does not exist"
            return None
    return None


def missing_alias_hint(run_dir: str | os.PathLike, alias: str, monitor: str | None, option: str = "--ckpt") -> str:
    """Why ``alias`` (``last``/``best``) names no checkpoint under ``run_dir``, and what to pass instead (to
    ``option``): a ``best`` missing beside a ``last`` is a run that never logged ``monitor`` (this config's
    ``checkpoint.monitor``)."""
    if broken := _broken_alias(run_dir, alias):
        return f" ({broken}; pass a path)"
    last = resolve_checkpoint(run_dir, "last") if alias == "best" else None
    if last is not None:
        kept = f"checkpoint.monitor ({shown(monitor)}) was logged" if monitor else "checkpoint.monitor is set"
        return f": best.pt is kept only where {kept} at a save; '{last}' is the newest checkpoint ({option} last)"
    left = newest_periodic_checkpoint(run_dir)
    return f": the newest checkpoint left is '{left}' (pass its path)" if left is not None else " (pass a path)"


def _trainer_part(path: Path) -> Path:
    """The file holding a checkpoint's loop position (a sharded checkpoint keeps it in ``trainer.pt``)."""
    return path / TRAINER_FILE if is_sharded_checkpoint(path) else path


def _version_dir_of(path: Path) -> Path | None:
    """The ``version_N`` directory ``path`` is a checkpoint of, or None for a file outside a run."""
    checkpoints = path.parent
    if checkpoints.name == "checkpoints" and (checkpoints.parent / "config.yaml").is_file():
        return checkpoints.parent
    return None


def loop_of(path: Path) -> dict[str, int] | None:
    """The loop position saved in checkpoint ``path`` (memory-mapped: the tensors are not read), None if unreadable."""
    checkpoint = peek_checkpoint(_trainer_part(path))
    try:
        return dict(checkpoint["loop"])
    except (TypeError, KeyError, ValueError):  # a half-written or foreign newest file: not shown to be the newest
        return None


def load_with_fallback_hint(path: Path) -> dict[str, Any]:
    """:func:`load_checkpoint` (which reads every record against its CRC-32); when ``path`` cannot be read or is
    damaged, the error names the newest whole checkpoint beside it (a damaged ``last.pt`` leaves its step files to
    resume from: a resume from one is a branch; a sharded checkpoint's ``trainer.pt``, the directories beside it)."""
    with fallback_hint(path):
        return load_checkpoint(path)


@contextmanager
def fallback_hint(path: Path) -> Iterator[None]:
    """A :class:`CheckpointError` of a load of ``path`` in the block, raised again naming the newest whole checkpoint
    beside it (see :func:`load_with_fallback_hint`)."""
    try:
        yield
    except CheckpointError as exc:
        sharded = path.name == TRAINER_FILE and is_sharded_checkpoint(path.parent)  # its directory's neighbours
        fallback = newest_whole_beside(path.parent if sharded else path)
        if fallback is None:
            raise
        hint = f"{exc}; the newest whole checkpoint beside it is '{fallback}'"
        if isinstance(exc, DamagedCheckpointError):
            raise DamagedCheckpointError(hint, exc.damage, fallback) from None
        raise CheckpointError(hint) from None


def _newest_of_its_run(path: Path, version_dir: Path, loop: dict[str, int]) -> bool:
    """Whether checkpoint ``path`` holds ``version_dir``'s newest state (``last.pt``'s loop position)."""
    last = _last_of(version_dir)
    if last is None:
        return False
    if last.resolve() == path.resolve() or (last.is_file() and path.is_file() and os.path.samefile(last, path)):
        return True
    return loop_of(last) == loop


def _newer_than_last(last: Path) -> Path | None:
    """The newest periodic or best-k checkpoint (file or shard directory) beside ``last`` whose saved loop position
    is past ``last``'s, and whole as a load finds it (:func:`checkpoint_damage`: a sharded one's shard files too): a
    kill between ModelCheckpoint's save of it and its move of ``last`` leaves it. Only loop positions are read (no
    tensors), and the CRC-32s of the newest, and of an older one only where every newer one is damaged."""
    checkpoints, position = last.parent, loop_of(last)
    if position is None or not checkpoints.is_dir():
        return None
    kinds = {p: kind for p in checkpoints.iterdir() if (kind := checkpoint_kind(p)) in (0, 1)}  # step/epoch, best-k
    ahead = [p for p in kinds if (loop := loop_of(p)) and _is_past(loop, position)]
    # newest_whole_beside's order: of one step, a step/epoch one first, then the later moment (an epoch's end after
    # its last batch's), not the directory's listing order
    order = {p: training_order(p) for p in ahead}
    newest_first = sorted(ahead, key=lambda p: (order[p][0], -kinds[p], order[p]), reverse=True)
    return next((p for p in newest_first if checkpoint_damage(p) is None), None)


def _is_past(loop: dict[str, int], last: dict[str, int]) -> bool:
    """Whether loop position ``loop`` is later than ``last``'s (a whole-number global step beyond it)."""
    step, last_step = loop.get("global_step"), last.get("global_step")
    return isinstance(step, int) and isinstance(last_step, int) and step > last_step


def position_text(loop: dict[str, int] | None) -> str:
    """``epoch E, step S`` of a saved loop position, for messages."""
    return "no loop position" if loop is None else f"epoch {loop.get('epoch')}, step {loop.get('global_step')}"


@dataclass
class FitStart:
    """Where a ``fit()`` starts: from scratch, or a checkpoint (loaded unless sharded) and what to do with it."""

    checkpoint_path: Path | None = None
    checkpoint: dict[str, Any] | None = None  # None for a sharded checkpoint: its shards need the model
    # A sharded checkpoint's trainer.pt as loaded to plan (CRC-32s checked): the restore and the shards' load take
    # this one reading, so a large file is read once and one replaced meanwhile cannot give them two.
    trainer_part: dict[str, Any] | None = None
    # The file_fingerprint of the file that load read (a sharded checkpoint's trainer.pt): what the other ranks' copies
    # are checked against (agreed_start), not a file put at its path since.
    fingerprint: str | None = None
    loop: dict[str, int] | None = None
    version_dir: Path | None = None  # the directory a *continue* writes; None: a new version_N
    branched_from: Path | None = None  # the checkpoint a *branch* started from
    nothing_to_train: str | None = None  # why the checkpoint is *finished* (resuming it trains nothing), or None
    # A mid-epoch checkpoint's changed keys that may move the sample order it resumes in: ``{key: (then, now)}``
    # of data.* and trainer.seed; whether they do is known once the train loader is built (batch_layout.py).
    order_changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    # ``key: old -> new`` of every config key changed since the save (:func:`config_changes`), said once by the
    # Trainer with the optimizer settings the checkpoint restores over them (:func:`resume_settings_warning`).
    config_changes: list[str] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        """Whether resuming the checkpoint would train nothing (see the module's rules)."""
        return self.nothing_to_train is not None


# The ampkit sections whose keys decide when training stops; every section a Trainer subclass adds counts too
# (a ``should_stop`` set by its code may read it).
STOPPING_KEYS = ("trainer.max_epochs", "trainer.max_steps", "trainer.max_time", "early_stopping.")


def _stopping_key(key: str) -> bool:
    return key.startswith(STOPPING_KEYS) or key.partition(".")[0] not in AMPKIT_KEYS


def _settings(config: dict[str, Any] | DictConfig, spelt: bool = False) -> dict[str, Any]:
    """``config`` flattened to dotted keys (a ``trainer.max_time`` dict is one key, not one per unit); unless
    ``spelt``, a value with several spellings in its one meaning (``trainer.max_time`` ``3600``, ``"01:00:00"`` or
    ``{hours: 1}``, ``precision.dtype`` ``bf16`` or ``bfloat16``), so a resume compares what the settings mean, not
    how they were written."""
    if isinstance(config, DictConfig):
        config = OmegaConf.to_container(config, resolve=True, enum_to_str=True)
    flat = flatten(one_max_time(config, str if spelt else duration_seconds), sep=".")
    if spelt:
        return flat
    for key, meaning in _MEANING.items():
        if flat.get(key) is not None:
            try:
                flat[key] = meaning(flat[key])
            except ValueError:  # a value the config check refuses: compared as written
                pass
    return flat


_MEANING = {"trainer.max_time": lambda v: duration_seconds(v) or v, "precision.dtype": parse_dtype}


def why_finished(checkpoint: dict[str, Any], path: Path, cfg: DictConfig) -> str | None:
    """Why resuming ``checkpoint`` would train nothing under ``cfg`` (it reached a limit, or stopped early and no
    stopping key changed), or None when it has training left."""
    loop, t = checkpoint["loop"], cfg.trainer
    where = f"epoch {loop['epoch']}, step {loop['global_step']}"
    if 0 <= t.max_epochs <= loop["epoch"] or 0 <= t.max_steps <= loop["global_step"]:
        return (
            f"'{path}' already reached trainer.max_epochs={t.max_epochs} / trainer.max_steps={t.max_steps} ({where}); "
            "nothing was written. Raise a limit to train further from its exact state."
        )
    stopped = checkpoint.get("stopped_early")
    if not stopped:
        return None
    before, now = _settings(checkpoint.get("config", {})), _settings(cfg)
    if any(before.get(key) != now.get(key) for key in before.keys() | now.keys() if _stopping_key(key)):
        return None
    return (
        f"'{path}' stopped early ({stopped}; {where}); nothing was written. To train further from its exact "
        "state, raise trainer.max_steps/max_epochs/max_time or change early_stopping.* (or your Trainer's own "
        "settings)."
    )


def _version_number(path: Path) -> int:
    """N of the ``version_N`` directory that holds ``path`` (or is it), -1 outside one."""
    for part in (path, *path.parents):
        if re.fullmatch(r"version_\d+", part.name):
            return int(part.name.removeprefix("version_"))
    return -1


def newest_periodic_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest periodic checkpoint (file or shard directory) of the newest version under ``run_dir`` that has
    one: what is left when ``last`` is gone."""
    for version in reversed(version_dirs(run_dir)):
        checkpoints = version / "checkpoints"
        if not checkpoints.is_dir():
            continue
        found = periodic_checkpoints(checkpoints, sharded=False) + periodic_checkpoints(checkpoints, sharded=True)
        if found:
            return max(found, key=training_order)
    return None


_fits_started = 0  # fit() calls of this process so far: a script's stages, in the same order in every attempt


def torchrun_launch() -> str | None:
    """Which fit of which torchrun launch this is, the same in every restart of its worker group (``--max-restarts``)
    on this node: torchrun's run id, its agent process (this process's parent: host, pid, start) and the number of
    this process's fit() calls so far. None outside torchrun. Each call counts one fit."""
    global _fits_started
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    _fits_started += 1
    agent = os.getppid()
    return f"{run_id}/{socket.gethostname()}/{agent}/{_process_start(agent)}/fit{_fits_started}"


def restarted_from(run_dir: str | os.PathLike, launch: str) -> Path | None:
    """In a worker group torchrun restarted (``--max-restarts``), the checkpoint the same fit of its earlier attempt
    left under ``run_dir``: the newest ``last`` whose ``launch`` is ``launch``, else None (a first attempt, or one
    that died before saving, starts fresh)."""
    if launch_int("TORCHELASTIC_RESTART_COUNT") < 1:
        return None
    for version in reversed(version_dirs(run_dir)):
        path = _last_of(version)
        checkpoint = peek_checkpoint(_trainer_part(path)) if path is not None else None
        if checkpoint is not None and checkpoint.get("launch") == launch:
            return path
    return None


def _last_of(version_dir: Path) -> Path | None:
    """``version_dir``'s ``last`` checkpoint (``last.pt``, or the link to a sharded one), or None. Where the ``last``
    link of sharded checkpoints is gone (a copy that drops links: rsync without -l, an object store; a kill before
    the first save made it), their newest complete directory, which the link would name."""
    checkpoints = version_dir / "checkpoints"
    last_file, last_link = checkpoints / "last.pt", checkpoints / "last"
    if last_file.is_file():
        return last_file
    if (last_link / ".metadata").is_file():  # a damaged one is named, and its load says what it lacks
        return last_link
    if os.path.lexists(last_link) or not checkpoints.is_dir():  # a dangling link names what is lost: no guess
        return None
    names = (is_periodic_checkpoint_name, is_best_k_checkpoint_name)
    sharded = [p for p in checkpoints.iterdir() if any(n(p.name, True) for n in names) and is_sharded_checkpoint(p)]
    return max(sharded, key=training_order, default=None)


def _best_of(version_dir: Path) -> Path | None:
    """``version_dir``'s ``best`` checkpoint (``best.pt``, or the link to a sharded one), or None. Where ``best.pt``
    or the ``best`` link is gone (deleted by hand; a copy that drops links), the checkpoint its newest one ranks
    best, which ``best`` would be; never a guess past a dangling link."""
    checkpoints = version_dir / "checkpoints"
    best_file, best_link = checkpoints / "best.pt", checkpoints / "best"
    if best_file.is_file():
        return best_file
    if (best_link / ".metadata").is_file():
        return best_link
    if os.path.lexists(best_link) or not checkpoints.is_dir():
        return None
    newest = _last_of(version_dir)
    if newest is None:
        return None
    try:
        states = peek_checkpoint(_trainer_part(newest))["callbacks"].values()
    except (TypeError, KeyError, AttributeError, ValueError):
        return None
    ranked = next((s["best_k"] for s in states if isinstance(s, dict) and s.get("best_k")), None)
    if not isinstance(ranked, dict):
        return None
    best = checkpoints / next(iter(ranked))  # the best first, as ModelCheckpoint ranks them
    return best if best.is_file() or (best / ".metadata").is_file() else None


def plan_fit(
    run_dir: str | os.PathLike, resume: str | os.PathLike | None, path: Path | None, cfg: DictConfig
) -> FitStart:
    """Load ``path`` (``resume`` resolved by :func:`resolve_checkpoint`) and decide whether it continues its run
    or branches (see the module's rules); warn about every config key that changed since it was saved."""
    if resume is not None and path is None:
        left = newest_periodic_checkpoint(run_dir)
        broken = _broken_alias(run_dir, str(resume))
        if str(resume) == "best" and not broken and resolve_checkpoint(run_dir, "last") is not None:
            hint = missing_alias_hint(run_dir, "best", cfg.checkpoint.monitor, "--resume")
            raise CheckpointError(f"resume='best': no best.pt under run_dir {quoted_run_dir(run_dir)}{hint}")
        raise CheckpointError(
            f"resume='{resume}': no checkpoint under run_dir {quoted_run_dir(run_dir)} "
            + (f"({broken}); " if broken else f"(no version_N/checkpoints/{resume}.pt or {resume} link); ")
            + (
                f"the newest checkpoint left is '{left}': resume it by its path"
                if left is not None
                else "check run_dir, or start without resume for a fresh run"
            )
        )
    if path is None:
        return FitStart()
    newer = [v for v in version_dirs(run_dir) if _version_number(v) > _version_number(path)]
    if str(resume) in ("last", "best") and newer:
        rank_zero_warn(
            f"resume='{resume}': {', '.join(v.name for v in newer)} under run_dir '{run_dir}' is newer but has no "
            f"{resume} checkpoint; resuming '{path}' (name a checkpoint by its path to choose another)"
        )
    if path.name in ("last.pt", "last") and (ahead := _newer_than_last(path)) is not None:  # a torchrun restart's too
        rank_zero_warn(
            f"'{ahead}' beside '{path.name}' is newer ({position_text(loop_of(ahead))}; "
            f"{path.name}: {position_text(loop_of(path))}): the run was stopped between the two saves. Resuming "
            f"'{path}'; to take the newer one instead, --resume {ahead} (a branch)"
        )
    sharded = is_sharded_checkpoint(path)
    # Loaded before any user code runs, so an empty, foreign or incomplete file fails at once.
    with fallback_hint(_trainer_part(path)):
        checkpoint, fingerprint = load_fingerprinted(_trainer_part(path))
    missing = [section for section in RESUME_SECTIONS if section not in checkpoint]
    if not sharded:  # a sharded checkpoint keeps its model and optimizers in the shards
        missing[:0] = [section for section in ("model", "optimizers") if section not in checkpoint]
    if missing:
        weights = " (its weights may still load with validate/test/predict --ckpt)" if "model" not in missing else ""
        complete = newest_whole_beside(path, ("model", "optimizers", *RESUME_SECTIONS))
        beside = f"; the newest complete checkpoint beside it is '{complete}'" if complete is not None else ""
        raise CheckpointError(
            f"checkpoint '{path}' (format {checkpoint[FORMAT_KEY]}) lacks {', '.join(missing)}: it cannot be "
            f"resumed{weights}{beside}"
        )
    _check_loop_position(path, checkpoint["loop"])
    changed = config_changes(checkpoint.get("config", {}), cfg)  # said by the Trainer: see resume_settings_warning
    mid_epoch = checkpoint["loop"].get("batches_done", 0) > 0
    order_changes = _order_changes(checkpoint.get("config", {}), cfg) if mid_epoch else {}
    loop = dict(checkpoint["loop"])
    version_dir = _version_dir_of(path)
    if version_dir is not None and not _newest_of_its_run(path, version_dir, loop):
        version_dir = None
    if version_dir is not None and (unwritable := _unwritable(version_dir)) is not None:
        rank_zero_warn(
            f"'{path}' is the last checkpoint of its run, but '{unwritable}' cannot be written (read-only): "
            f"training branches from it into a new version under run_dir '{run_dir}'"
        )
        version_dir = None
    if version_dir is not None and (kept := _protected_alias(version_dir)) is not None:
        rank_zero_warn(
            f"'{path}' is the last checkpoint of its run, but '{kept}' is write-protected (kept by chmod a-w), and "
            f"continuing there would replace it: training branches from it into a new version under run_dir "
            f"'{run_dir}'"
        )
        version_dir = None
    if version_dir is not None and Path(run_dir).absolute().resolve() != version_dir.parent.resolve():
        # Continuing there would prune that run's files by this config's keep_last and replace its last/best.
        rank_zero_warn(
            f"'{path}' is the last checkpoint of a run outside run_dir '{run_dir}': training branches from it into "
            f"a new version under run_dir and leaves '{version_dir}' as it is (to continue that run in place, set "
            f"run_dir to '{version_dir.parent}')"
        )
        version_dir = None
    if version_dir is not None and (yours := _users_file_in_the_way(version_dir, loop, sharded)) is not None:
        raise CheckpointError(
            f"'{yours}' holds no ampkit checkpoint (a file of yours under a name ampkit gives its checkpoints), and "
            f"continuing the run in '{version_dir}' from '{path}' would write that name: move it out of "
            f"'{yours.parent}' (or rename it) and resume again; nothing was trained and nothing written"
        )
    return FitStart(
        checkpoint_path=path,
        checkpoint=None if sharded else checkpoint,
        trainer_part=checkpoint if sharded else None,
        fingerprint=fingerprint,
        loop=loop,
        version_dir=version_dir,
        branched_from=path if version_dir is None else None,
        nothing_to_train=why_finished(checkpoint, path, cfg),
        order_changes=order_changes,
        config_changes=changed,
    )


def _check_loop_position(path: Path, loop: Any) -> None:
    """Refuse a loop position that is not whole numbers >= 0 (a file edited or written by other code): a string
    failed deep in the limit checks as a TypeError, and a negative step resumed before the start."""
    keys = ("epoch", "batches_done", "global_step")
    values = [loop.get(k, 0 if k == "batches_done" else None) for k in keys] if isinstance(loop, dict) else [None]
    fine = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)  # batches_done: format 1
    if not fine:
        position = {k: loop.get(k) for k in keys} if isinstance(loop, dict) else loop
        raise CheckpointError(
            f"checkpoint '{path}' has a loop position {shown(position)}; expected whole numbers >= 0 for "
            f"{', '.join(keys)} (the file was edited or written by other code): resume another checkpoint"
        )


def _unwritable(version_dir: Path) -> Path | None:
    """The first of ``version_dir`` and its ``checkpoints/`` that this process cannot write, or that was made
    read-only to keep it (an archived run; ``chmod a-w checkpoints``, which root could write through), or None: a
    resume of its last checkpoint branches then, rather than training on to fail at its first save."""
    folders = (version_dir, version_dir / "checkpoints")  # a protected checkpoint in one is not the folder's mode
    return next((d for d in folders if not os.access(d, os.W_OK | os.X_OK) or write_protected(d, contents=False)), None)


def _protected_alias(version_dir: Path) -> Path | None:
    """The first of ``version_dir``'s ``last``/``best`` checkpoints (``last.pt``, ``best.pt``; a copied ``last`` or
    ``best`` directory) that is write-protected, or None: the next save of a run continued there would replace it.
    A ``last``/``best`` symlink is no such file (moving it leaves the checkpoint it named in place)."""
    checkpoints = version_dir / "checkpoints"
    aliases = [checkpoints / name for name in ("last.pt", "best.pt", "last", "best")]
    return next((a for a in aliases if a.exists() and not a.is_symlink() and write_protected(a)), None)


def _users_file_in_the_way(version_dir: Path, loop: dict[str, int], sharded: bool) -> Path | None:
    """The first file in ``version_dir``'s ``checkpoints/`` that holds no ampkit checkpoint (a user's own) under a
    name a run continued from ``loop`` writes, or None: ``last``, ``best``, or a step, epoch or best-k name past that
    position (``.pt`` files; a ``sharded`` run's directories and links: :func:`users_own_at`). Its save would stop
    there."""
    checkpoints = version_dir / "checkpoints"
    past = {"step": loop.get("global_step", 0), "best": loop.get("global_step", 0), "epoch": loop.get("epoch", 0)}
    suffix, users_own = ("", users_own_at) if sharded else (".pt", foreign_file)

    def written_later(name: str) -> bool:
        numbered = re.fullmatch(rf"(step|epoch|best)-(\d+){re.escape(suffix)}", name)
        aliases = (f"last{suffix}", f"best{suffix}")
        return name in aliases or (numbered is not None and int(numbered[2]) > past[numbered[1]])

    names = sorted(p.name for p in checkpoints.iterdir()) if checkpoints.is_dir() else []
    return next((checkpoints / n for n in names if written_later(n) and users_own(checkpoints / n)), None)


# Keys whose change is the point of a resume (train longer) or names where it runs, not how it trains.
_EXPECTED_CHANGES = {"name", "run_dir", "trainer.max_epochs", "trainer.max_steps"}


def config_changes(saved: dict[str, Any], cfg: DictConfig) -> list[str]:
    """``key: old -> new`` for every config key that differs from the checkpoint's (``saved``), but those a
    resume is expected to change."""
    before, now = _settings(saved, spelt=True), _settings(cfg, spelt=True)
    meant_before, meant_now = _settings(saved), _settings(cfg)
    return [
        f"{key}: {before.get(key, '(absent)')} -> {now.get(key, '(absent)')}"
        for key in sorted(before.keys() | now.keys())
        if key not in _EXPECTED_CHANGES and meant_before.get(key) != meant_now.get(key)
    ]


def resume_settings_warning(path: Path, changed: list[str], kept: list[str]) -> str | None:
    """One warning for a resume's ``changed`` config keys and the optimizer settings its checkpoint restores over
    configure_optimizers()'s (``kept``: a changed ``lr`` that does not train), or None where there is neither. Two
    warnings said the new rate was taken, then that it was not."""
    if not changed and not kept:
        return None
    said = f"resuming '{path}' with a changed config: {'; '.join(changed)}" if changed else f"checkpoint '{path}'"
    if not kept:
        return said
    return (
        f"{said}{'; but it' if changed else ''} restores its optimizers' settings over configure_optimizers()'s: "
        f"{'; '.join(kept)}{', so those train on as saved' if changed else ''}; to change them on resume, set "
        "param_groups in on_load_checkpoint"
    )


def misfit_detail(exc: BaseException, saved: dict[str, Any], cfg: DictConfig, shown: int = 5) -> str:
    """Why a checkpoint's state does not load into this run's model (``exc``, from ``load_state_dict``), and the
    Trainer or config keys it was saved with (``saved``) that differ from this run's: a model size left at its
    default on predict is then named as the fix, not only as a tensor shape."""
    return load_failure_reason(exc) + config_misfit(saved, cfg, shown)


def load_failure_reason(exc: BaseException) -> str:
    """The line of ``load_state_dict``'s error that says why (it lists every key first, then the reason)."""
    return str(exc).strip().splitlines()[-1].strip().rstrip(".")


def config_misfit(saved: dict[str, Any], cfg: DictConfig, shown: int = 5) -> str:
    """``"; it was saved by trainer_class X ..."`` or ``"; its config differs from this run's at key: a -> b"``: the
    part of a misfit's message that names the fix ("" when the configs agree)."""
    then, now = saved.get("trainer_class"), OmegaConf.select(cfg, "trainer_class")
    if then and now and then != now:
        return f"; it was saved by trainer_class {then}, not this run's {now}"
    changed = config_changes(saved, cfg) if saved else []
    if not changed:
        return ""
    more = f" (and {len(changed) - shown} more)" if len(changed) > shown else ""
    return f"; its config differs from this run's at {'; '.join(changed[:shown])}{more}: set them as it had"


def _order_changes(saved: dict[str, Any], cfg: DictConfig) -> dict[str, tuple[Any, Any]]:
    """``{key: (then, now)}`` for each changed ``data.*`` key and ``trainer.seed`` (the seed of a shuffled epoch)."""
    before, now = _settings(saved), _settings(cfg)
    keys = sorted(k for k in before.keys() | now.keys() if k.startswith("data.") or k == "trainer.seed")
    return {k: (before.get(k), now.get(k)) for k in keys if before.get(k) != now.get(k)}


def open_version_dir(
    run_dir: str | os.PathLike, start: FitStart, cfg: DictConfig, global_step: int
) -> tuple[Path, RunLock]:
    """The version directory this fit writes, locked before anything is written there: created (with its
    lineage) for a fresh run or a branch; its config saved. Rank zero only. Reached through a symlink, it is named
    by its real path (as Lightning's ModelCheckpoint takes its dirpath): a run_dir symlink re-pointed mid-run sent
    the next saves into another run's checkpoints, over its last.pt."""
    version_dir, lock = start.version_dir, None
    try:
        version_dir = _real(version_dir if version_dir is not None else new_version_dir(run_dir))
        lock = RunLock(version_dir)
        lock.acquire()
        if start.version_dir is not None:
            _refuse_if_written_since(start)
        if start.branched_from is not None:
            write_text_atomic(OmegaConf.to_yaml(lineage(start)), version_dir / LINEAGE_FILE)
        save_config(version_dir, cfg, global_step, start)
        if start.version_dir is None:  # a version_N made just now: what a run stopped before training takes back
            for record in (LINEAGE_FILE, "config.yaml"):
                created_here(version_dir / record)
    except BaseException as exc:
        if lock is not None:
            lock.release()
        if start.version_dir is None and version_dir is not None:  # a version_N made just now: no trace of it
            shutil.rmtree(version_dir, ignore_errors=True)
        if not isinstance(exc, OSError):
            raise
        if exc.strerror == PROTECTED:
            raise RunDirectoryError(_protected_record(Path(exc.filename))) from None
        where = exc.filename or version_dir or run_dir
        raise from_storage(
            RunDirectoryError(
                f"cannot write '{where}' ({exc.strerror or exc}): free space or write access under run_dir "
                f"'{run_dir}', or choose another run_dir; nothing was trained and no checkpoint was touched"
            ),
            exc,
        ) from None
    return version_dir, lock


def _refuse_if_written_since(start: FitStart) -> None:
    """A :class:`RunDirectoryError` where the run ``start`` continues saved a newer checkpoint after this fit read
    its own (another run, resumed at once, took the lock first and trained): continuing would write the older state
    over its ``last`` and prune its files by the older position."""
    last = _last_of(start.version_dir)
    now = loop_of(last) if last is not None else None
    if now is not None and now != start.loop:
        raise RunDirectoryError(
            f"'{last}' changed after this run read '{start.checkpoint_path}' ({position_text(start.loop)}; now "
            f"{position_text(now)}): another run wrote '{start.version_dir}' meanwhile, and continuing would write "
            "the older state over it. Nothing was trained or written: resume again to continue from the newest"
        )


def _real(version_dir: Path) -> Path:
    """``version_dir`` by its real path where a symlink leads there; else as given (a relative run_dir's stays
    relative in what the run prints)."""
    real = version_dir.resolve()
    return version_dir if real == Path(os.path.abspath(version_dir)) else real


def _protected_record(path: Path) -> str:
    """Why a run cannot start over ``path``, a record of its version directory the user write-protected."""
    return (
        f"'{path}' is write-protected (chmod a-w): this run would replace it, and ampkit never replaces such a file. "
        "Make it writable again (chmod u+w) to let it be replaced or move it elsewhere to keep it; nothing was "
        "trained and no checkpoint was touched"
    )


# The files this process created in version directories it made, by absolute path, each with its identity then
# (device, inode; for a file written whole also its mtime and size): what a run stopped before training removes, and
# nothing else (a file a callback of the user's put there, or one it wrote over ours, is not among them).
_CREATED: dict[str, tuple[int, ...]] = {}


def _identity(path: str, whole: bool) -> tuple[int, ...] | None:
    """``path``'s identity as :data:`_CREATED` keeps it, or None where it is no regular file (a symlink is not one)."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode):
        return None
    return (info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size) if whole else (info.st_dev, info.st_ino)


def created_here(path: Path, whole: bool = True) -> None:
    """Record ``path`` as a file this run just created in its version directory (``whole``: written once, complete;
    else one it goes on appending to, a TensorBoard event file), for :func:`discard_new_version_dir`."""
    key = os.path.abspath(path)
    if (identity := _identity(key, whole)) is not None:
        _CREATED[key] = identity
        while len(_CREATED) > 256:
            del _CREATED[next(iter(_CREATED))]


def discard_new_version_dir(version_dir: Path | None, start: FitStart) -> None:
    """Remove the version directory a fresh run or a branch created, when it stopped before training (its sanity
    validation failed): a mistake caught before training leaves no empty ``version_N`` behind. Only the files the run
    created go (:func:`created_here`: its config, lineage, TensorBoard event file), each only while it is the one the
    run wrote; a file a callback of the user's or the user put anywhere there is kept, with the folders holding it. A
    directory that a resume continues, or that holds anything under ``checkpoints/``, is never touched. Rank zero
    only."""
    if version_dir is None or start.version_dir is not None:
        return
    checkpoints = version_dir / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        return
    root = os.path.abspath(version_dir) + os.sep
    for key in [key for key in _CREATED if key.startswith(root)]:
        identity = _CREATED.pop(key)
        if _identity(key, whole=len(identity) > 2) == identity:
            with suppress(OSError):
                os.unlink(key)
    for folder in (version_dir / "tensorboard", checkpoints, version_dir):  # each only if nothing is left in it
        if not folder.is_symlink():
            with suppress(OSError):
                folder.rmdir()


def lineage(start: FitStart) -> dict[str, Any]:
    """What a branch records about where it came from."""
    origin = _version_dir_of(start.branched_from)
    return {
        "branched_from": str(start.branched_from.absolute()),
        "origin_version_dir": None if origin is None else str(origin.absolute()),
        "global_step": start.loop["global_step"],
        "epoch": start.loop["epoch"],
    }


def save_config(version_dir: Path, cfg: DictConfig, global_step: int, start: FitStart) -> None:
    """``config.yaml`` (a branch's names its origin in a comment); a resume with a config other than the one in
    effect at its step (the newest record up to it) adds ``config.resumed_at_step_N.yaml``, so the records say
    which config trained each step. No record is ever replaced (a damaged or edited ``config.yaml`` is kept): a
    second resume from step N with yet another config adds ``config.resumed_at_step_N.1.yaml``, as the first one's
    record says which config wrote what it left (its TensorBoard points, a prediction file)."""
    text = OmegaConf.to_yaml(cfg, resolve=True)
    if start.branched_from is not None:
        text = f"{_BRANCH_HEADER} {start.branched_from.absolute()} at global step {global_step}\n{text}"
    records = _config_records(version_dir)
    in_effect = max(((key, p) for key, p in records if key[0] <= global_step), default=None)
    if in_effect is None:
        write_text_atomic(text, version_dir / "config.yaml")
    elif _without_header(in_effect[1].read_text(errors="replace")) != _without_header(text):
        again = max((n + 1 for (step, n), _ in records if step == global_step), default=0)
        suffix = f".{again}" if again else ""
        write_text_atomic(text, version_dir / f"config.resumed_at_step_{global_step}{suffix}.yaml")


_BRANCH_HEADER = "# branched from"
_RESUMED_CONFIG = re.compile(r"^config\.resumed_at_step_(\d+)(?:\.(\d+))?\.yaml$")


def _config_records(version_dir: Path) -> list[tuple[tuple[int, int], Path]]:
    """``version_dir``'s config records, each keyed by ``(step, n)`` in the order they were written: ``config.yaml``
    ``(-1, 0)``, ``config.resumed_at_step_N.yaml`` ``(N, 0)``, its later namesake ``config.resumed_at_step_N.K.yaml``
    ``(N, K)``."""
    records = [((-1, 0), version_dir / "config.yaml")]
    for path in version_dir.iterdir():
        if m := _RESUMED_CONFIG.match(path.name):
            records.append(((int(m.group(1)), int(m.group(2) or 0)), path))
    return [(key, path) for key, path in records if path.is_file()]


def _without_header(text: str) -> str:
    """A config record without a branch's first-line comment (the settings are what a resume compares)."""
    return text.split("\n", 1)[1] if text.startswith(_BRANCH_HEADER) and "\n" in text else text


# ----------------------------------------------------------------------------------------- stale temp files
# Every name ampkit writes before renaming into place, so a kill can leave it behind: save_atomic's and
# copy_atomic's ``.<name>.<random>.tmp`` files, the sharded writer's ``.<name>.tmp`` directory, ``.<name>.old``
# (a checkpoint set aside while its name is saved again) and ``.last.tmp`` link (each of those three, where something
# of the user's stood at that name, at ``.<name>.<random>.tmp`` or ``.old``: temp_names); in the version directory
# the config's and lineage's temp files and the lock's (``.run.lock.<pid>.<random>.tmp``,
# ``.run.lock.stale.<pid>.<random>``; an older ampkit's without the random part). A name alone proves nothing: each
# is removed only where what it holds is what ampkit writes there.
_CHECKPOINT = rf"(?:{PERIODIC_STEM}|{BEST_K_STEM}|last|best)"
_RANDOM = rf"{RANDOM_PART}\.tmp"  # mkstemp's random part: eight of these characters, never another length
_TEMP_FILE = re.compile(rf"^\.{_CHECKPOINT}\.pt{_RANDOM}$")
_TEMP_TEXT = re.compile(rf"^\.((?:config(?:\.resumed_at_step_\d+(?:\.\d+)?)?|lineage)\.yaml){_RANDOM}$")
_LOCK_TEMP = re.compile(rf"^\.{re.escape(LOCK_FILE)}\.(?:(\d+)(?:{RANDOM_PART})?\.tmp|stale\.(\d+)(?:{RANDOM_PART})?)$")


def remove_stale_temps(version_dir: Path) -> list[Path]:
    """Remove what a killed save left in ``version_dir`` (only ampkit's temp names, see above; a sharded
    checkpoint set aside and never replaced is renamed back). The caller holds its lock. Returns what it removed."""
    removed: list[Path] = []
    for path in sorted(version_dir.iterdir()):
        lock_temp = _LOCK_TEMP.match(path.name)
        stale_lock = lock_temp is not None and not _pid_alive(int(lock_temp.group(1) or lock_temp.group(2)))
        text = _TEMP_TEXT.match(path.name)
        if stale_lock and _holds_a_lock(path) or text is not None and _holds_our_record(path, text.group(1)):
            path.unlink(missing_ok=True)
            removed.append(path)
    checkpoints = version_dir / "checkpoints"
    if not checkpoints.is_dir() or checkpoints.is_symlink():
        return removed
    for path in sorted(checkpoints.iterdir()):
        name, link = path.name, path.is_symlink()
        temp, link_temp = temp_name_of(name, "tmp", _CHECKPOINT), link and temp_name_of(name, "tmp", "last|best")
        if _TEMP_FILE.match(name) and not link and half_written(path) or link_temp and is_our_link(path):
            path.unlink(missing_ok=True)  # a link only as point_last_at makes one: ``.last.tmp``, to a checkpoint
        elif temp and path.is_dir() and not link:
            # a file the user put in it stays, back under its name
            if not discard_checkpoint_dir(path, checkpoints / temp.group(1)):
                continue
        elif (aside := temp_name_of(name, "old", _CHECKPOINT)) and path.is_dir() and not link:
            original = checkpoints / aside.group(1)
            if not original.exists():  # killed between setting it aside and renaming its replacement in: the only copy
                os.replace(path, original)
                continue
            if not discard_checkpoint_dir(path, path):  # the user's files alone, named by the tidy that kept them
                continue
        else:
            continue
        removed.append(path)
    return removed


def half_written(path: Path) -> bool:
    """Whether file ``path`` under a checkpoint's temp name holds what a killed ``torch.save`` (or a copy of its file)
    leaves: nothing yet, or the start of torch's zip archive. A file of the user's that happens to have such a name
    (their notes, a YAML) is no checkpoint's beginning, and stays."""
    try:
        with path.open("rb") as file:
            start = file.read(4)
    except OSError:  # gone, unreadable, or no file: nothing to remove
        return False
    return start == b"PK\x03\x04"[: len(start)]


def _opened_text(path: Path) -> str | None:
    """The text of regular file ``path`` (not through a link), or None where it is no such file or unreadable."""
    if path.is_symlink() or not path.is_file():
        return None
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _holds_a_lock(path: Path) -> bool:
    """Whether ``path`` holds what :class:`RunLock` writes at its temp and stale names: nothing yet (killed before the
    write), or a lock's record. A file of the user's that only has such a name stays."""
    text = _opened_text(path)
    if text is None or not text:
        return text == ""
    try:
        record = json.loads(text)
    except ValueError:
        return False
    return isinstance(record, dict) and {"pid", "host", "since", "lock"} <= record.keys()


# What a version directory's records hold at their top level: a lineage the keys lineage() writes; a config the
# sections and keys every resolved ampkit config has (a branch's with its header line first).
_LINEAGE_KEYS = frozenset({"branched_from", "origin_version_dir", "global_step", "epoch"})


def _holds_our_record(path: Path, record: str) -> bool:
    """Whether temp file ``path`` of record ``record`` (``lineage.yaml``, ``config.yaml``...) holds what a killed
    :func:`write_text_atomic` of it leaves: nothing yet, or that record as ampkit writes it (a lineage's keys, a
    config of ampkit's sections). A file of the user's that only has such a name stays."""
    text = _opened_text(path)
    if text is None or not text:
        return text == ""
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError:  # cut short mid-write (a power cut), or the user's: kept either way
        return False
    if not isinstance(loaded, dict):
        return False
    if record == LINEAGE_FILE:
        return loaded.keys() == _LINEAGE_KEYS
    return AMPKIT_KEYS <= loaded.keys() and "trainer_class" in loaded


def prune_periodic(checkpoints: Path, keep_last: int, warned: set[Path] | None = None) -> None:
    """Delete all but the newest ``keep_last`` periodic checkpoint files (``step-*``/``epoch-*``) in ``checkpoints``;
    ``best-*`` files are the best-k ranking's to keep or drop. A write-protected one is kept and not counted among
    the ``keep_last`` (:func:`deletable`)."""
    for old in deletable(periodic_checkpoints(checkpoints, sharded=False), warned)[:-keep_last]:
        old.unlink(missing_ok=True)


def finish_interrupted_pruning(start: FitStart) -> None:
    """A finished run resumed trains nothing, but a kill between its last save and that save's pruning left files
    beyond ``keep_last``: prune them as the run that wrote the checkpoint would have (its own ``keep_last``), under
    its lock. Rank zero only."""
    if start.version_dir is None or start.checkpoint is None or not start.checkpoint_path.is_file():
        return
    saved_settings = start.checkpoint.get("config", {}).get("checkpoint", {})
    keep_last = saved_settings.get("keep_last")
    if not isinstance(keep_last, int) or keep_last < 1:
        return
    if saved_settings.get("save_top_k") == -1 and not saved_settings.get("monitor"):  # that run kept every file
        return
    lock = RunLock(start.version_dir, tidying=True)
    try:
        lock.acquire()
    except (RunDirectoryError, OSError):  # a live run writes there, or it cannot be written
        return
    try:
        prune_periodic(start.version_dir / "checkpoints", keep_last)
    except OSError:
        pass
    finally:
        lock.release()


def tidy_run_dir(run_dir: str | os.PathLike) -> list[Path]:
    """:func:`remove_stale_temps` in every ``version_N`` under ``run_dir`` that an ampkit run made and no live run
    holds (each locked while it is tidied; a read-only one is skipped). Rank zero only, before the run writes
    anything."""
    removed: list[Path] = []
    for version_dir in filter(_made_by_a_run, version_dirs(run_dir)):
        lock = RunLock(version_dir, tidying=True)
        try:
            lock.acquire()
        except (RunDirectoryError, OSError):  # a live run writes there, or it cannot be written: not ours to tidy
            continue
        try:
            removed += remove_stale_temps(version_dir)
        except OSError:  # a file that cannot be removed (read-only): the run goes on, its saves do not need it
            pass
        finally:
            lock.release()
    if removed:
        names = ", ".join(str(p.relative_to(Path(run_dir))) for p in removed)
        say(f"ampkit: removed {len(removed)} temp file(s) left by an interrupted save: {names}")
    return removed


def _made_by_a_run(version_dir: Path) -> bool:
    """Whether ``version_dir`` is an ampkit run's: it holds the config a run writes first, under its lock, or the lock
    or its temp file (a run killed before the config). Another tool's ``version_N`` in the same folder (Lightning's
    ``lightning_logs/version_0``) is not tidied: names alike there (``.best.old/``) are its own files."""
    if (version_dir / "config.yaml").is_file():
        return True
    try:
        return any(p.name == LOCK_FILE or _LOCK_TEMP.match(p.name) for p in version_dir.iterdir())
    except OSError:  # unreadable: not ours to tidy
        return False


# ----------------------------------------------------------------------------------------- the lock
TIDYING_WAIT_S = 30.0  # how long a run waits for another process's tidying of its version directory

# The locks this process writes are named ``<its token>.<N>``; those of its RunLocks holding one now are in _held.
# A lock of this process that none holds was left by a release the disk refused: the next fit() takes it over.
_token = secrets.token_hex(8)
_count = itertools.count()
_held: set[str] = set()


def _new_process_token() -> None:
    global _token
    _token = secrets.token_hex(8)  # a forked child's locks are its own; the parent's stay the parent's
    _held.clear()


os.register_at_fork(after_in_child=_new_process_token)


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started, as this boot's id and its start tick (Linux; None where unknown): a pid that
    names another process now (reused after a reboot or a container restart) starts at another time."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        ticks = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None
    return f"{boot}/{ticks}"


def _no_hard_links(version_dir: Path, exc: OSError) -> str:
    """Why a run cannot write ``version_dir``: its file system makes no hard link, which the lock is taken by."""
    return (
        f"run directory '{version_dir}' is on a file system without hard links (os.link: {exc.strerror}), which the "
        "run lock is taken by: an object-store mount (s3fs, gcsfuse, blobfuse), whose renames are no atomic "
        "replacement either, so a kill mid-save could leave no whole last.pt. Put run_dir on a local disk or a "
        "network file system (NFS, Lustre, GPFS) and copy the run to the object store after"
    )


class RunLock:
    """``version_N/run.lock``: one live run writes a version directory at a time. ``tidying``: a lock held only while
    :func:`tidy_run_dir` (or a finished run's pruning) works there, for a moment; a run starting meanwhile waits for
    it (up to :data:`TIDYING_WAIT_S`) instead of being refused."""

    def __init__(self, version_dir: Path, tidying: bool = False) -> None:
        self.path = version_dir / LOCK_FILE
        self.tidying = tidying
        self._mine: dict[str, Any] | None = None

    def _holder(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def _stale(self, holder: dict[str, Any] | None) -> bool:
        if holder is None:  # unreadable: written by no run of ours
            return False
        if holder.get("host") != socket.gethostname():
            return False
        if _left_here(holder):
            return True
        pid = int(holder.get("pid", -1))
        if not _pid_alive(pid):
            return True
        started = holder.get("started")  # absent from older locks
        return started is not None and _process_start(pid) not in (None, started)

    def acquire(self) -> None:
        """Take the lock, taking over a stale one and waiting out another process's tidying; a
        :class:`RunDirectoryError` naming a live holder."""
        mine = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        mine["lock"] = f"{_token}.{next(_count)}"
        if (started := _process_start(os.getpid())) is not None:
            mine["started"] = started
        if self.tidying:
            mine["tidying"] = True
        # A free name (mkstemp's): a file of the user's at any name stays as it is, never written over
        fd, made = tempfile.mkstemp(prefix=f".{LOCK_FILE}.{os.getpid()}.", suffix=".tmp", dir=self.path.parent)
        tmp = Path(made)
        try:
            with os.fdopen(fd, "w") as file:
                os.fchmod(file.fileno(), 0o666 & ~_umask())
                file.write(json.dumps(mine))
        except BaseException:  # a full disk: the partial temp is ampkit's own, and goes with the error
            tmp.unlink(missing_ok=True)
            raise
        deadline, take_overs = time.monotonic() + TIDYING_WAIT_S, 0
        try:
            while True:
                try:
                    os.link(tmp, self.path)  # creates the lock with its content at once, or fails if there is one
                    self._mine = mine
                    _held.add(mine["lock"])
                    return
                except FileExistsError:
                    holder = self._holder()
                except OSError as exc:
                    if exc.errno not in NO_HARD_LINKS:
                        raise
                    raise RunDirectoryError(_no_hard_links(self.path.parent, exc)) from None
                if holder is None and not os.path.lexists(self.path):  # released just now: try again
                    continue
                if self._stale(holder) and take_overs < 3:
                    self._take_over(holder)
                    take_overs += 1
                elif self._waits_for(holder) and time.monotonic() < deadline:
                    time.sleep(0.02)
                else:
                    raise RunDirectoryError(self._refusal(holder))
        finally:
            tmp.unlink(missing_ok=True)

    def _waits_for(self, holder: dict[str, Any] | None) -> bool:
        """Whether a run taking the lock waits for ``holder`` to let go: another process tidying there for a moment
        (a tidier itself moves on: the directory is someone else's to tidy now)."""
        return not self.tidying and holder is not None and bool(holder.get("tidying"))

    def _take_over(self, stale: dict[str, Any]) -> None:
        """Remove a stale lock, unless another run replaced it meanwhile (then it is put back)."""
        # a free name (replacing the empty file mkstemp makes there): a file of the user's at any name stays
        fd, made = tempfile.mkstemp(prefix=f".{LOCK_FILE}.stale.{os.getpid()}.", dir=self.path.parent)
        os.close(fd)
        aside = Path(made)
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:
            aside.unlink(missing_ok=True)
            return
        try:
            if json.loads(aside.read_text()) != stale:  # a live run's fresh lock: restore it
                os.link(aside, self.path)
        except (OSError, ValueError):
            pass
        aside.unlink(missing_ok=True)

    def _refusal(self, holder: dict[str, Any] | None) -> str:
        if holder is None:
            who = "an unreadable lock"
        else:
            who = f"pid {holder.get('pid')} on host {holder.get('host')} (since {holder.get('since')})"
            if holder.get("tidying"):
                who += f", tidying it for over {TIDYING_WAIT_S:g} s"
        return (
            f"run directory '{self.path.parent}' is in use by {who}: two runs would write the same checkpoints. "
            f"Wait for it to end, start a fresh run (without --resume), or, if that run is gone, delete '{self.path}'"
        )

    def release(self) -> None:
        """Give the lock back (only if it is still this run's). Where the disk refuses (a read-only remount, an I/O
        error) it says so and goes on: the release comes as a fit ends, and its error took the place of the run's own
        (the save that failed on that same disk) and of the teardown after it. Once this process has ended, a later
        run on this host takes the lock over as stale, as does a later ``fit()`` of this process."""
        if self._mine is not None and self._holder() == self._mine:
            try:
                self.path.unlink(missing_ok=True)
            except OSError as exc:
                rank_zero_warn(f"could not remove the run lock '{self.path}' ({exc.strerror or exc}); it is stale: "
                               "a later fit() takes it over, of this process or another")  # fmt: skip
        if self._mine is not None:
            _held.discard(self._mine["lock"])
        self._mine = None


def _left_here(holder: dict[str, Any]) -> bool:
    """Whether ``holder`` is a lock this process wrote and no RunLock of it holds now: its release failed (a
    read-only remount, an I/O error), and a retried or second ``fit()`` of this process must not be refused by it."""
    lock = holder.get("lock")
    return (
        holder.get("pid") == os.getpid()
        and isinstance(lock, str)
        and lock.startswith(f"{_token}.")
        and lock not in _held
    )


# ----------------------------------------------------------------------------------------- predict's output
def prediction_output(
    output: str | os.PathLike, reading: Path | None, world_size: int = 1, overwrite: bool = False
) -> Path:
    """The file ``predict(output=...)`` writes: refused when it would overwrite a checkpoint (see the rules), a file
    that exists (unless ``overwrite``) or a write-protected one (even then), or, on ``world_size`` ranks (each writes
    ``<stem>.rank<N><suffix>``), when shards of a run on more ranks lie beside it."""
    text = os.path.expandvars(os.path.expanduser(str(output)))
    if not text.strip():
        raise RunDirectoryError("predict --output is empty: name a file to write the predictions to")
    if "\0" in text:  # no file system takes it; os.stat's own ValueError names no option
        raise RunDirectoryError(
            f"predict --output {shown(text, 300)} holds a NUL character, which no path can; name a file"
        )
    path = Path(text)
    if path.is_dir() and not is_sharded_checkpoint(path) or text.endswith(("/", os.sep)):
        path = path / PREDICTIONS_FILE
    refuse = None
    real = path.resolve()  # through symlinks: a link to checkpoints/ leads into it
    if is_sharded_checkpoint(path) or path.is_dir():
        refuse = "it is a directory"
    elif path.absolute().parent.name == "checkpoints" or real.parent.name == "checkpoints":
        refuse = "it lies inside a checkpoints/ folder"
    elif _is_run_record(real):
        refuse = "it is a record a run keeps (its config, lineage, lock or TensorBoard events)"
    elif reading is not None and path.exists() and path.resolve() == reading.resolve():
        refuse = "it is the checkpoint being read"
    elif path.is_file() and _holds_checkpoint(path):
        refuse = "it holds an ampkit checkpoint"
    if refuse:
        raise RunDirectoryError(f"predict --output '{output}': refusing to write there, {refuse}; name a new file")
    if unusable := unwritable_reason(path.parent):  # found only once every batch was predicted, which were lost
        raise RunDirectoryError(f"predict --output '{output}': cannot write there, {unusable}; name another file")
    stale = _rank_files_beyond(path, world_size) if world_size > 1 else []
    if stale:
        raise RunDirectoryError(
            f"predict --output '{output}': {', '.join(p.name for p in stale)} beside it hold the shards of an earlier "
            f"predict on more ranks, which a reader of {path.stem}.rank*{path.suffix} would mix with this run's "
            f"{world_size}: remove them or name another output"
        )
    # A symlink is written where it leads: the user's link stays, its file is updated.
    written = real if world_size == 1 and path.is_symlink() else path
    writes = [written] if world_size == 1 else [rank_output(path, rank) for rank in range(world_size)]
    if kept := next((w for w in writes if write_protected(w)), None):
        raise RunDirectoryError(
            f"predict --output '{output}': refusing to write there, '{kept}' is write-protected (chmod a-w): ampkit "
            "never replaces it; name a new file"
        )
    if not overwrite and (existing := [w for w in writes if w.exists()]):
        raise RunDirectoryError(
            f"predict --output '{output}': '{existing[0]}' exists already; pass --overwrite (predict(..., "
            "overwrite=True)) to replace it, or name a new file"
        )
    return written


def rank_output(path: Path, rank: int) -> Path:
    """The file rank ``rank`` of several writes for ``predict(output=path)``: ``<stem>.rank<N><suffix>``."""
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def save_predictions_beside(predictions: Any, path: Path) -> str:
    """Save ``predictions`` under the first free ``<stem>.<N><suffix>`` beside ``path`` (which another process took
    while they were computed), so the work is not lost; says where, or why nothing could be saved."""
    for n in range(1, 1000):
        beside = path.with_name(f"{path.stem}.{n}{path.suffix}")
        try:
            save_atomic(predictions, beside, replace=False)
        except FileExistsError:
            continue
        except OSError as exc:
            return f"this run's predictions could not be kept beside it either ({exc.strerror or exc})"
        return f"this run's predictions are in '{beside}'"
    return f"this run's predictions could not be kept: {path.stem}.1{path.suffix} to .999 are all taken"


def _rank_files_beyond(path: Path, world_size: int) -> list[Path]:
    """The ``<stem>.rank<N><suffix>`` files beside ``path`` with N >= ``world_size``, by N."""
    name = re.compile(rf"{re.escape(path.stem)}\.rank(\d+){re.escape(path.suffix)}")  # what rank_output names
    if not path.parent.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in path.parent.iterdir() if (m := name.fullmatch(p.name))]
    return [p for rank, p in sorted(found) if rank >= world_size]


def _is_run_record(path: Path) -> bool:
    """Whether ``path`` is a file a version directory keeps besides its checkpoints: its config files, lineage,
    lock, or anything under its ``tensorboard/``."""

    def is_version(directory: Path) -> bool:
        return re.fullmatch(r"version_\d+", directory.name) is not None

    if is_version(path.parent) and (
        path.name in (LOCK_FILE, LINEAGE_FILE) or re.fullmatch(r"config(\..+)?\.yaml", path.name)
    ):
        return True
    return any(a.name == "tensorboard" and is_version(a.parent) for a in path.parents)


def _holds_checkpoint(path: Path) -> bool:
    """Whether file ``path`` holds an ampkit checkpoint, read without its tensors: a damaged copy, which no load
    takes, is still the user's checkpoint."""
    checkpoint = peek_checkpoint(path)
    return checkpoint is not None and FORMAT_KEY in checkpoint
