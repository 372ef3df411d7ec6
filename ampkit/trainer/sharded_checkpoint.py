"""Sharded checkpoints (``torch.distributed.checkpoint``) for FSDP runs: one directory per checkpoint.

Layout of ``checkpoints/step-00000009/``: DCP's ``.metadata`` and one ``*.distcp`` file per rank holding
the model and optimizer shards (keyed by parameter name, so any world size can load them), plus
``trainer.pt`` with everything else (loop position, RNG, loss scalers, schedulers, callbacks, config),
written by rank zero and loaded weights-only. Every rank writes into ``.step-00000009.tmp`` and rank zero
renames the finished directory into place, so a crash mid-save leaves the previous checkpoint (and
``last``, a symlink to the newest) intact.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import zlib
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_warn
from omegaconf import DictConfig
from torch import nn

from ampkit.trainer.checkpoint_io import (
    BEST_K_STEM,
    FOREIGN,
    PERIODIC_STEM,
    CheckpointError,
    _fsync_dir,
    copy_atomic,
    damaged_record,
    deletable,
    describe,
    is_best_k_checkpoint_name,
    is_periodic_checkpoint_name,
    load_checkpoint,
    peek_checkpoint,
    readable_format,
    refuse_protected,
    save_atomic,
    write_errors_surfaced,
)
from ampkit.trainer.distributed import DistributedEnv, decided_by_rank_zero, gather_object
from ampkit.trainer.optimizers import state_initialising_steps
from ampkit.trainer.param_groups import TRAINABLE_KEY, trainable_record
from ampkit.trainer.state_misfit import StateMisfit, check_optimizer_fits, model_misfit, shapes_of
from ampkit.trainer.temp_names import RANDOM_PART, free_dir, free_link, step_around
from ampkit.trainer.waiting import barrier

# torch.distributed.checkpoint is imported where it is used: loading it costs every run start-up time.

TRAINER_FILE = "trainer.pt"
LAST = "last"
# trainer.pt's record of each shard file's CRC-32, taken as the save ends: DCP keeps none, and reads a shard torn in a
# tensor's bytes without a word (torch.load checks no CRC), so a resume would train on other weights.
SHARD_CRCS = "shard_crc32"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a sharded checkpoint directory (or the ``last`` link to one)."""
    path = Path(path)
    return path.is_dir() and (path / TRAINER_FILE).is_file() and (path / ".metadata").is_file()


def missing_sharded_parts(path: str | os.PathLike) -> list[str]:
    """What directory ``path`` lacks of a sharded checkpoint (``.metadata``, ``trainer.pt``) where it holds a part of
    one (a save cut short, a partial copy); empty for a whole one, or for a directory that is no checkpoint at all."""
    path = Path(path)
    if not path.is_dir():
        return []
    parts = {".metadata": (path / ".metadata").is_file(), TRAINER_FILE: (path / TRAINER_FILE).is_file()}
    if not any(parts.values()) and next(path.glob("*.distcp"), None) is None:
        return []
    return [name for name, present in parts.items() if not present]


def _tensor_state(module: nn.Module, optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = get_model_state_dict(module)
    with state_initialising_steps():  # an optimizer with no state yet is stepped once, at a zero learning rate
        return {
            "model": model,
            "optimizers": {name: get_optimizer_state_dict(module, o) for name, o in optimizers.items()},
        }


def _shard_writer(path: Path) -> Any:
    """DCP's ``FileSystemWriter`` for ``path``, whose files' failed writes are what ``dcp.save`` gathers: DCP writes
    tensors with ``torch.save``, which hides a full disk behind ``RuntimeError: unexpected pos``."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class Files(FileSystem):
        @contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
            with super().create_stream(path, mode) as stream, write_errors_surfaced(stream, path) as surfaced:
                yield surfaced

    writer = FileSystemWriter(path)
    writer.fs = Files()
    return writer


def _shard_reader(path: Path) -> Any:
    """DCP's ``FileSystemReader`` for ``path``, whose failure to read a shard file (truncated, damaged) names that file:
    DCP's own error names neither the file nor, in a multi-rank load, which of the rank's files it was reading."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem

    class Files(FileSystem):
        @contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
            with super().create_stream(path, mode) as stream:
                try:
                    yield stream
                except Exception as exc:
                    raise CheckpointError(f"shard file '{Path(path).name}' is damaged ({describe(exc)})") from None

    reader = FileSystemReader(path)
    reader.fs = Files()
    return reader


def _make_room(path: Path) -> Path:
    """Refuse a write-protected checkpoint at ``path``, or a file or folder of the user's; make the empty folder the
    save writes its files into (``.<name>.tmp``, or a free name where the user's thing stands there) and return it."""
    refuse_protected(path)
    refuse_users_own(path)
    tmp = free_temp_dir_name(path, "tmp")
    tmp.mkdir(parents=True, exist_ok=True)  # a free name's folder is made already, empty
    return tmp


def free_temp_dir_name(beside: Path, suffix: str) -> Path:
    """The temp name checkpoint folder ``beside`` (or its save's files) moves through: ``.<name>.<suffix>`` once what a
    killed save or removal left there is gone, or, where something of the user's stands there (kept, named once), a new
    empty ``.<name>.<random>.<suffix>`` folder, which a rename of a folder replaces."""
    usual = beside.with_name(f".{beside.name}.{suffix}")
    what = _users_thing_at(usual)
    if what is None:
        return usual
    step_around(beside, suffix, what)
    return free_dir(beside, suffix)


def _users_thing_at(usual: Path) -> str | None:
    """Delete what a crashed save or removal left at temp name ``usual`` (its checkpoint's own files only); what is
    left there, the user's (a file, a link, a folder, or their file in ampkit's folder), described, or None where the
    name is free now."""
    if not usual.exists() and not usual.is_symlink():
        return None
    if usual.is_dir() and not usual.is_symlink():
        _, kept = _delete_own_files(usual, passed_over=FileNotFoundError)  # failing to delete one of them: its error
        if not kept:
            return None
        return f"a folder holding {', '.join(kept)}, which ampkit did not write"
    return "a link" if usual.is_symlink() else "a file"


def save_sharded(
    checkpoint: dict[str, Any],
    module: nn.Module,
    optimizers: dict[str, torch.optim.Optimizer],
    path: Path,
    env: DistributedEnv,
) -> Path:
    """Write ``module``'s and ``optimizers``' shards (every rank) and ``checkpoint`` (rank zero) to ``path``.

    Collective: every rank calls it with the same ``path``. Returns ``path`` once it is complete. A write-protected
    checkpoint already at ``path`` (or a directory that cannot be made) is refused on every rank alike, as rank zero
    found it, before any writes.
    """
    import torch.distributed.checkpoint as dcp

    is_zero = env.rank == 0
    barrier(f"the save of {path.name}")  # every rank has come: rank zero names one that died or hangs before it
    # Rank zero's refusal, or the folder it made, on every rank alike; also the barrier: no rank writes before that
    tmp = decided_by_rank_zero(functools.partial(_make_room, path), env)
    try:
        state = _tensor_state(module, optimizers)
        dcp.save(state, checkpoint_id=tmp, storage_writer=_shard_writer(tmp), no_dist=not dist.is_initialized())
        # Each rank reads back the files it wrote (still in the page cache), and rank zero records them all.
        crcs = _every_ranks_crcs(tmp, env)
        # dcp.save returned on rank zero after it wrote .metadata, i.e. after every rank's shards. Rank zero's last
        # writes (trainer.pt, the rename) failing (a full disk) stop every rank with its error: the others waited for
        # it at the next collective until distributed.timeout_s, to fail there with a timeout.
        decided_by_rank_zero(functools.partial(_finish_save, checkpoint, crcs, tmp, path), env)
    except BaseException as exc:
        # DCP fails on every rank once all are done writing; trainer.pt is rank zero's last write: the partial
        # directory goes now, not at the next run, so a full disk gets its space back.
        if is_zero and write_failure(exc) is not None and tmp.is_dir():
            discard_checkpoint_dir(tmp, tmp)
        raise
    barrier(f"the end of the save of {path.name}")
    return path


def _every_ranks_crcs(tmp: Path, env: DistributedEnv) -> list[dict[str, int]]:
    """Each rank's CRC-32s of the shard files it wrote into ``tmp``, on every rank; a rank that cannot read one back
    (an I/O error) fails every rank's save with its error, rather than leaving the others in this collective."""
    try:
        mine: dict[str, int] | OSError = _crcs(sorted(tmp.glob(f"__{env.rank}_*.distcp")))
    except OSError as exc:
        mine = exc
    found = gather_object(mine, env)
    if (failure := next((f for f in found if isinstance(f, OSError)), None)) is not None:
        raise failure
    return found


def _finish_save(checkpoint: dict[str, Any], crcs: list[dict[str, int]], tmp: Path, path: Path) -> None:
    """Rank zero's end of a sharded save: ``trainer.pt`` with every shard's CRC-32 written into ``tmp``, then ``tmp``
    renamed to ``path`` (a checkpoint of that name set aside until the new one is in its place)."""
    save_atomic({**checkpoint, SHARD_CRCS: {k: v for rank in crcs for k, v in rank.items()}}, tmp / TRAINER_FILE)
    _move_into_place(tmp, path)


def _move_into_place(tmp: Path, path: Path) -> None:
    """Rename finished checkpoint directory ``tmp`` to ``path`` (rank zero), a checkpoint of that name set aside until
    the new one is in its place."""
    aside = path.with_name(f".{path.name}.old")
    if path.exists():  # the same name saved again (e.g. after a resume): keep the old one until replaced
        if aside.is_dir() and not aside.is_symlink():  # an older one a kill left: what the user put there moves on
            _carry_users_files(aside, path)
        aside = free_temp_dir_name(path, "old")  # anything else of the user's there stays, stepped around
        os.replace(path, aside)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    if aside.is_dir() and not aside.is_symlink():
        _carry_users_files(aside, path)
        discard_checkpoint_dir(aside, aside)


def _carry_users_files(old: Path, new: Path) -> None:
    """Move what the user put in checkpoint folder ``old`` (all but the checkpoint's own files) into ``new``, the one
    that replaces it under its name; a name ``new`` holds already stays in ``old``."""
    for entry in old.iterdir():
        target = new / entry.name
        if not _is_checkpoint_part(entry) and not target.exists() and not target.is_symlink():
            with suppress(OSError):
                os.replace(entry, target)


def copy_sharded(source: Path, alias: Path) -> Path:
    """Make checkpoint directory ``alias`` a copy of ``source`` (rank zero), renamed into place once whole, as a save's
    directory is: one moment's state saved once under two names (a periodic and a best-k one), each whole on its own
    when retention deletes the other. Copies, not links, as :func:`copy_atomic` makes a file's aliases."""
    tmp = _make_room(alias)
    try:
        for file in sorted(source.iterdir()):  # DCP's .metadata and shard files, and trainer.pt: no subdirectories
            copy_atomic(file, tmp / file.name)
        _move_into_place(tmp, alias)
    except BaseException:
        if tmp.is_dir():  # a full disk gets its space back now, not at the next run
            discard_checkpoint_dir(tmp, tmp)
        raise
    return alias


def _crc32(file: Path) -> int:
    crc = 0
    with file.open("rb") as stream:
        while chunk := stream.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _crcs(files: list[Path]) -> dict[str, int]:
    return {file.name: _crc32(file) for file in files}


def refuse_damaged_shards(path: Path, saved: dict[str, int] | None, collective: bool) -> None:
    """A :class:`CheckpointError` naming each shard file of sharded checkpoint ``path`` whose CRC-32 is not the one
    recorded at its save (``saved``; None for a checkpoint of an ampkit that recorded none). ``collective``: every
    rank checks its share of the files (every world-size-th one) and hears the others' findings; else this process
    checks them all."""
    if not saved:
        return
    env = _process_group() if collective else DistributedEnv()
    found = gather_object(damaged_shards(path, saved, sorted(saved)[env.rank :: env.world_size]), env)
    if damaged := sorted(name for names in found for name in names):
        raise CheckpointError(
            f"sharded checkpoint '{path}': shard file(s) {', '.join(damaged)} are not as written (their CRC-32s are "
            "not those recorded at the save): a copy torn or a disk's error, which would load without an error, "
            f"with other values; {_resume_instead(path, env)}"
        )


def _process_group() -> DistributedEnv:
    """This process's place in the process group there is (one process where there is none)."""
    if not dist.is_initialized():
        return DistributedEnv()
    return DistributedEnv(rank=dist.get_rank(), world_size=dist.get_world_size())


# The copies (or links) of a run's newest and best checkpoints, by kind: files and sharded directories.
_ALIASES = {False: ("last.pt", "best.pt"), True: (LAST, "best")}


def newest_whole_beside(path: Path, sections: tuple[str, ...] = ("loop",)) -> Path | None:
    """The newest of ampkit's checkpoints beside ``path`` (step/epoch, best-k and last/best ones, files and shard
    directories alike; not ``path``, nor a link or copy of it by another name) that holds ``sections`` and that a load
    takes whole (:func:`checkpoint_damage`), or None: the one rule every hint naming a checkpoint to take instead
    follows. Newest by global step, a step/epoch one first (kept longest), then a best-k one; read newest first, an
    older one only where every newer one is damaged."""
    if not path.parent.is_dir():
        return None
    kinds = {p: kind for p in path.parent.iterdir() if (kind := checkpoint_kind(p)) is not None}
    order = {p: training_order(p) for p in kinds if not _same(p, path) and _holds(p, sections)}
    newest_first = sorted(order, key=lambda p: (order[p][0], -kinds[p], order[p]), reverse=True)
    return next((p for p in newest_first if checkpoint_damage(p) is None), None)


def checkpoint_kind(path: Path) -> int | None:
    """Which of ampkit's checkpoints ``path`` is (0: step/epoch, 1: best-k, 2: an alias, last or best), or None for
    anything else (a user's file, a temp file, a directory that is no whole sharded checkpoint's)."""
    sharded = path.is_dir()
    if sharded and not is_sharded_checkpoint(path) or not sharded and not path.is_file():
        return None
    kinds = (is_periodic_checkpoint_name(path.name, sharded), is_best_k_checkpoint_name(path.name, sharded),
             path.name in _ALIASES[sharded])  # fmt: skip
    return next((i for i, is_kind in enumerate(kinds) if is_kind), None)


def _same(path: Path, other: Path) -> bool:
    """Whether ``path`` is ``other`` under another name (a link to it, a hard link)."""
    try:
        return os.path.samefile(path, other)
    except OSError:  # ``other`` gone: no name is it
        return False


def _holds(path: Path, sections: tuple[str, ...]) -> bool:
    """Whether checkpoint ``path`` can be read, is of a format this ampkit reads (a copy of a file refused for its
    newer format is refused alike) and holds ``sections`` (memory-mapped: the tensors are not read); a sharded one's
    ``trainer.pt`` lacks the model and optimizers its shards hold."""
    checkpoint = peek_checkpoint(path / TRAINER_FILE if path.is_dir() else path)
    needed = [s for s in sections if not (path.is_dir() and s in ("model", "optimizers"))]
    return readable_format(checkpoint) and all(section in checkpoint for section in needed)


def _resume_instead(path: Path, env: DistributedEnv) -> str:
    """What to resume in the place of damaged sharded checkpoint ``path``: the newest whole one beside it, as rank zero
    finds it (every rank refuses it together; each reading every shard file of the others would cost as many loads)."""
    whole = decided_by_rank_zero(functools.partial(newest_whole_beside, path), env)
    if whole is None:
        return "resume an older checkpoint, if one is left"
    return f"the newest whole checkpoint beside it is '{whole}' (--resume {whole}, a branch)"


def damaged_shards(path: Path, saved: dict[str, int], names: list[str]) -> list[str]:
    """Those of shard files ``names`` of sharded checkpoint ``path`` that are missing, unreadable or not as written
    (their CRC-32 is not the one ``saved`` at the save)."""
    damaged = []
    for name in names:
        try:
            whole = _crc32(path / name) == saved[name]
        except OSError:  # gone, or unreadable: no rank can load it
            whole = False
        if not whole:
            damaged.append(name)
    return damaged


def checkpoint_damage(path: Path) -> str | None:
    """What a load would find damaged or missing in checkpoint ``path`` (a file, or a sharded directory: its
    ``.metadata``, its ``trainer.pt``'s records, and its shard files against the CRC-32s recorded at the save), or
    None where it is whole: the one test of a checkpoint to name in a load's place."""
    if not path.is_dir():
        return damaged_record(path) if path.is_file() else "it is gone"
    if missing := missing_sharded_parts(path):
        return f"it lacks {' and '.join(missing)}"
    if (damage := damaged_record(path / TRAINER_FILE)) is not None:
        return f"its {TRAINER_FILE}: {damage}"
    trainer_part = peek_checkpoint(path / TRAINER_FILE)
    if trainer_part is None:
        return f"its {TRAINER_FILE} cannot be read"
    saved = trainer_part.get(SHARD_CRCS) or {}
    if torn := damaged_shards(path, saved, sorted(saved)):
        return f"its shard file(s) {', '.join(torn)} are not as written"
    return None


def write_failure(exc: BaseException) -> str | None:
    """Why a sharded save failed writing (``No space left on device``, from an OSError or from DCP's
    CheckpointException, which gathers every rank's), or None when ``exc`` is no write failure (an OSError)."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    if type(exc).__name__ != "CheckpointException":  # DCP's, a BaseException; not imported: that costs start-up
        return None
    failed = {rank: err for rank, (err, _) in getattr(exc, "failures", {}).items() if isinstance(err, OSError)}
    if not failed:  # no rank failed writing (a bug): DCP's exception, with its ranks' tracebacks, stands
        return None
    reasons = "; ".join(sorted({write_failure(err) for err in failed.values()}))
    return f"{reasons} on rank {', '.join(str(rank) for rank in sorted(failed))}"


def users_own_at(path: Path) -> bool:
    """Whether ``path``, a name a sharded save writes (a checkpoint directory, the ``last`` or ``best`` link), holds
    something of the user's that the save would replace: a file, or a directory holding no part of a sharded
    checkpoint (not a link, a checkpoint, a copy of one that a tool following links made, or a save cut short)."""
    if path.is_symlink() or not path.exists():
        return False
    return not path.is_dir() or not (is_sharded_checkpoint(path) or missing_sharded_parts(path))


def refuse_users_own(path: Path) -> None:
    """A ``FileExistsError`` naming ``path`` where it is :func:`users_own_at`."""
    if users_own_at(path):
        raise FileExistsError(errno.EEXIST, FOREIGN, str(path))


def point_last_at(path: Path, alias: str = LAST) -> None:
    """Make ``alias`` (``last``, or ``best``) beside ``path`` a symlink to it, replaced atomically (rank zero).

    In a copy of the run made by a tool that follows links (zip, ``shutil.copytree``, an object store) ``alias`` is a
    whole checkpoint directory: it is set aside (as ``.<alias>.old``, which a tidy puts back after a kill) and goes
    once the link is in its place, as ``last.pt`` is replaced by the newer one."""
    link = path.parent / alias
    refuse_users_own(link)
    tmp = _temp_link(path.name, link)
    aside = link.with_name(f".{alias}.old")
    copied = link.is_dir() and not link.is_symlink()
    try:
        if copied:  # a symlink cannot be renamed over a directory
            refuse_protected(link)
            aside = free_temp_dir_name(link, "old")  # an older copy a kill left goes; the user's own stays
            os.replace(link, aside)
        os.replace(tmp, link)
    except BaseException:  # a full disk, an I/O error: no temp link is left, and a copy set aside is put back
        with suppress(OSError):
            tmp.unlink(missing_ok=True)
        if copied and not link.exists() and not link.is_symlink():
            with suppress(OSError):
                os.replace(aside, link)
        raise
    _fsync_dir(path.parent)
    if copied:  # what the user put in the copy stays, named
        discard_checkpoint_dir(aside, aside)


def _temp_link(target: str, link: Path) -> Path:
    """A new symlink to ``target``, to be renamed over ``link``: at ``.<link>.tmp`` where that is free or holds a link
    a kill left (:func:`is_our_link`), else (the user's thing there kept, named once) at a free name."""
    usual = link.with_name(f".{link.name}.tmp")
    if is_our_link(usual):
        usual.unlink()
    if not usual.exists() and not usual.is_symlink():
        with suppress(FileExistsError):  # made there meanwhile: a free name, as for the user's
            os.symlink(target, usual)
            return usual
    step_around(link, "tmp", "a link of yours" if usual.is_symlink() else "a folder" if usual.is_dir() else "a file")
    return free_link(target, link, "tmp")


def is_our_link(path: Path) -> bool:
    """Whether ``path`` is a link as :func:`point_last_at` makes one: to a checkpoint's name beside it."""
    try:
        target = os.readlink(path)
    except OSError:
        return False
    return re.fullmatch(rf"{PERIODIC_STEM}|{BEST_K_STEM}|{LAST}|best", target) is not None


def periodic_checkpoints(directory: Path, sharded: bool) -> list[Path]:
    """ampkit's periodic checkpoints in ``directory`` (``step-*``/``epoch-*`` files, or shard directories), oldest
    first: the only candidates pruning deletes and a lost ``last`` falls back to. A user's file under such a name
    that holds no ampkit checkpoint is among them; pruning keeps it (``checkpoint_io.deletable``)."""
    kind = is_sharded_checkpoint if sharded else Path.is_file
    found = [p for p in directory.iterdir() if is_periodic_checkpoint_name(p.name, sharded) and kind(p)]
    return sorted(found, key=training_order)


def training_order(path: Path) -> tuple[int, int, int, str]:
    """Sort key of checkpoint ``path`` (a file or shard directory): the loop position it holds, then its mtime and
    name. Not the mtime first: a run directory copied without its mtimes (``cp -r``, ``scp``, an object store)
    has them in the copy's order. A ``step-N`` name says its global step; other files are read for it."""
    part = path / TRAINER_FILE if path.is_dir() else path
    info = part.stat()
    step = re.fullmatch(r"step-(\d+)(?:\.pt)?", path.name)
    position = (
        (int(step.group(1)), -1) if step else _loop_position(str(part), info.st_ino, info.st_mtime_ns, info.st_size)
    )
    return (*position, info.st_mtime_ns, path.name)


@functools.lru_cache(maxsize=256)
def _loop_position(file: str, inode: int, mtime_ns: int, size: int) -> tuple[int, int]:
    """(global step, epoch) saved in ``file`` (memory-mapped: its tensors are not read), (-1, -1) if unreadable;
    cached per version of the file (its inode, mtime and size), so each save's pruning reads only the new file."""
    checkpoint = peek_checkpoint(file)
    try:
        loop = checkpoint["loop"]
        return int(loop["global_step"]), int(loop["epoch"])
    except (TypeError, KeyError, ValueError):  # damaged or foreign: ordered before every readable one
        return -1, -1


def remove_sharded(path: Path) -> None:
    """Delete checkpoint directory ``path`` at once: renamed to its temp name first (``.step-00000006.tmp``, or a free
    one where something of the user's stands there, kept and named once; the next fit's tidy removes either), so a kill
    midway leaves no half of it under a checkpoint's name, where it would be neither resumable nor ever pruned. Only the
    checkpoint's own files go: a file the user put in it (an evaluation's results) is kept, back under ``path`` (a
    folder of the user's now, which no save replaces), and named in a warning."""
    if path.is_symlink():  # the user's link to a checkpoint elsewhere (deletable() keeps it, named): nothing goes
        return
    if not path.is_dir():  # gone already
        return
    doomed = None
    try:
        doomed = free_temp_dir_name(path, "tmp")  # an earlier removal cut short there goes; the user's thing stays
        os.replace(path, doomed)
    except OSError:  # gone already, or its folder is read-only: nothing is deleted, and it stays whole
        if doomed is not None and doomed.name != f".{path.name}.tmp":
            with suppress(OSError):
                doomed.rmdir()  # the free name's empty folder
        return
    discard_checkpoint_dir(doomed, path)


def discard_checkpoint_dir(directory: Path, home: Path) -> bool:
    """Delete the checkpoint's own files in ``directory`` (a temp name a removal or a save gave it), and the directory
    once nothing else is left. What the user put there is kept: the directory goes back to ``home``, its checkpoint's
    name, where nothing is now (else it stays as it is), and a warning names the files, once: a folder that holds
    nothing of ampkit's (any more, told so before; or ever: the user's own at a temp name) stays where it is, without
    a word. Returns whether anything was removed."""
    if directory.is_symlink():  # its files are the link target's, outside the checkpoints folder: never deleted
        return False
    removed, kept = _delete_own_files(directory, passed_over=OSError)
    if not kept:
        return removed
    if removed and not home.exists() and not home.is_symlink():  # a folder that held no part of one is not ampkit's
        with suppress(OSError):
            os.replace(directory, home)
    if not removed and directory.exists():  # only the user's files, as a tidy before found and named them
        return False
    where = home if not directory.exists() else directory
    stuck = [name for name in kept if _is_checkpoint_part(where / name)]
    yours = [name for name in kept if name not in stuck]
    if yours:
        rank_zero_warn(
            f"'{where}' held {', '.join(yours)} beside the checkpoint, which ampkit did not write: the checkpoint's "
            "own files were deleted and yours kept there; move them elsewhere if you want the folder gone"
        )
    if stuck:
        rank_zero_warn(
            f"'{where}': the checkpoint's own {', '.join(stuck)} could not be deleted (check the folder's "
            "permissions); they are left there"
        )
    return removed


# The files a sharded save writes into its folder, and a kill can leave there: DCP's ``.metadata`` (written as
# ``.metadata.tmp`` first; ``__<rank>.metadata`` where the ranks plan alone) and ``__<rank>_<n>.distcp`` shards,
# ``trainer.pt``, and the ``.<file>.<random>.tmp`` files ``save_atomic`` and ``copy_atomic`` (a best-k copy) write
# first. Nothing else in such a folder is ampkit's.
_CHECKPOINT_PART = re.compile(
    rf"(?:\.metadata(?:\.tmp)?|__\d+\.metadata(?:\.tmp)?|__\d+_\d+\.distcp|{re.escape(TRAINER_FILE)})"
    rf"|\.(?:\.metadata|__\d+_\d+\.distcp|{re.escape(TRAINER_FILE)}){RANDOM_PART}\.tmp"
)


def _delete_own_files(directory: Path, passed_over: type[OSError]) -> tuple[bool, list[str]]:
    """Delete the checkpoint's own files in ``directory``, then the directory once nothing else is in it; a failure of
    the ``passed_over`` kind leaves that file (or the directory) as it is, any other is raised. Returns whether anything
    was deleted, and the sorted names of what was left beside them (empty when the directory was emptied)."""
    removed = False
    for part in filter(_is_checkpoint_part, directory.iterdir()):
        with suppress(passed_over):
            part.unlink()
            removed = True
    kept = sorted(p.name for p in directory.iterdir())
    if not kept:
        with suppress(passed_over):
            directory.rmdir()
            removed = True
    return removed, kept


def _is_checkpoint_part(path: Path) -> bool:
    """Whether ``path``, in a sharded checkpoint directory, is a file a save wrote there (see above)."""
    return _CHECKPOINT_PART.fullmatch(path.name) is not None and path.is_file() and not path.is_symlink()


def prune_sharded(directory: Path, keep_last: int, warned: set[Path] | None = None) -> None:
    """Delete all but the newest ``keep_last`` periodic checkpoint directories (never the one ``last`` points at;
    ``best-*`` ones are the best-k ranking's to keep or drop; a write-protected one is kept, uncounted)."""
    last = (directory / LAST).resolve()
    for old in deletable(periodic_checkpoints(directory, sharded=True), warned)[:-keep_last]:
        if old.resolve() != last:
            remove_sharded(old)


def load_sharded(
    path: Path,
    module: nn.Module,
    optimizers: dict[str, torch.optim.Optimizer],
    cfg: DictConfig | None = None,
    trainer_part: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load the shards at ``path`` into ``module`` and ``optimizers`` (resharded to this run's world size).

    Returns ``trainer.pt``'s dict, with ``model``/``optimizers`` set to the loaded states so the Trainer's
    plain restore path can apply them as for an unsharded checkpoint. ``cfg``: this run's config, whose keys that
    differ from the checkpoint's a misfit names. ``trainer_part``: ``trainer.pt`` as this process loaded it already
    (``load_checkpoint``, a resume's plan): not read again.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    checkpoint = dict(trainer_part) if trainer_part is not None else load_checkpoint(path / TRAINER_FILE)
    state = _tensor_state(module, optimizers)
    misfit = _model_misfit(path, state["model"])
    if misfit is not None:  # else DCP's size error reads as a damaged shard, and keys it lacks load nothing silently
        from ampkit.trainer.run_life import config_misfit  # run_life builds on this module

        hint = config_misfit(checkpoint.get("config") or {}, cfg) if cfg is not None else ""
        raise CheckpointError(f"sharded checkpoint '{path}' does not fit this run's model: {misfit}{hint}")
    _check_param_groups(path, checkpoint, module, optimizers)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: caught by name

    barrier(f"the resume of {path.name}")  # every rank has read trainer.pt: rank zero names one that has not
    try:
        dcp.load(state, checkpoint_id=path, storage_reader=_shard_reader(path), no_dist=not dist.is_initialized())
    except CheckpointException as exc:  # a shard file truncated, missing or unreadable
        failures = "; ".join(f"rank {rank}: {type(err).__name__}: {err}" for rank, (err, _) in exc.failures.items())
        raise CheckpointError(
            f"sharded checkpoint '{path}' cannot be read ({failures or exc}): a shard file is damaged or missing; "
            f"{_resume_instead(path, _process_group())}"
        ) from None
    # DCP read them: a shard torn in a tensor's bytes passes it.
    refuse_damaged_shards(path, checkpoint.get(SHARD_CRCS), collective=True)
    try:
        set_model_state_dict(module, state["model"])
        with state_initialising_steps():
            for name, opt in optimizers.items():
                set_optimizer_state_dict(module, opt, state["optimizers"][name])
    except (KeyError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"sharded checkpoint '{path}' does not fit this run's model/optimizers: {exc}") from None
    checkpoint["model"] = module.state_dict()
    checkpoint["optimizers"] = {name: opt.state_dict() for name, opt in optimizers.items()}
    return checkpoint


def _check_param_groups(
    path: Path, checkpoint: dict[str, Any], module: nn.Module, optimizers: dict[str, torch.optim.Optimizer]
) -> None:
    """Refuse optimizers whose param groups are not those saved (by the names ``trainer.pt`` recorded), as an
    unsharded resume does: DCP's load named a missing ``param_groups.1.lr`` key, read as a damaged shard."""
    saved_groups = (checkpoint.get(TRAINABLE_KEY) or {}).get("groups", {})
    our_groups = trainable_record(module, optimizers)["groups"]
    for name, optimizer in optimizers.items():
        saved_names = saved_groups.get(name)
        if saved_names is None:  # a checkpoint from before the record was kept
            continue
        try:
            check_optimizer_fits(name, [len(g) for g in saved_names], optimizer, saved_names, our_groups[name])
        except StateMisfit as exc:
            raise CheckpointError(f"sharded checkpoint '{path}' does not fit this run's optimizers: {exc}") from None


def _model_misfit(path: Path, model_state: dict[str, Any]) -> str | None:
    """How the model saved at ``path`` differs from ``model_state`` (this run's, as DTensors or tensors) in its keys
    or shapes, as ``load_state_dict`` says it of an unsharded checkpoint; None when they match."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = {
        key.removeprefix("model."): tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else None
        for key, meta in dcp.FileSystemReader(path).read_metadata().state_dict_metadata.items()
        if key.startswith("model.")
    }
    return model_misfit(saved, shapes_of(model_state))


def consolidate_checkpoint(
    path: str | os.PathLike, trainer_part: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """The model's full state dict from an ampkit checkpoint (sharded directory or ``.pt`` file), in one
    process, e.g. for inference: ``model.load_state_dict(ampkit.consolidate_checkpoint(path))``. ``trainer_part``: a
    sharded one's ``trainer.pt`` as the caller loaded it already (``load_checkpoint``): not read again."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(path)
    if not is_sharded_checkpoint(path):
        return load_checkpoint(path)["model"]
    metadata = dcp.FileSystemReader(path).read_metadata()
    prefix = "model."
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    # dcp.load's single-process mode warns that it is one, which is the point here: its loader is called directly
    # rather than the warning filtered, as warnings.catch_warnings swaps the filters of every thread's run
    _load_state_dict(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    # A process of its own (a script's rank zero alone may call it): it checks every shard file itself.
    trainer_part = trainer_part if trainer_part is not None else load_checkpoint(path / TRAINER_FILE)
    refuse_damaged_shards(path, trainer_part.get(SHARD_CRCS), collective=False)
    return {key.removeprefix(prefix): tensor for key, tensor in state.items()}
