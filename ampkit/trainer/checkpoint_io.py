"""Atomic checkpoint (and run) files, and loading that never executes a pickle payload."""

from __future__ import annotations

import errno
import functools
import hashlib
import io
import os
import pickle
import re
import shutil
import stat
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any, TypeVar

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from ampkit.trainer.foreign_checkpoint import foreign_contents
from ampkit.wording import shown

_E = TypeVar("_E", bound=BaseException)

FORMAT_KEY = "ampkit_checkpoint"
FORMAT_VERSION = 1

# The names ampkit gives the checkpoints it may prune: periodic ones (``step-00000100``, ``epoch-0003``) and best-k
# ones (``best-00000100``), with ``.pt`` for a file, bare for a sharded directory. Only names that match are ever
# pruned: a user's ``my-notes.pt`` or ``best-for-paper.pt`` beside them is left alone.
PERIODIC_STEM = r"(?:step-\d{8,}|epoch-\d{4,})"
BEST_K_STEM = r"best-\d{8,}"


def is_periodic_checkpoint_name(name: str, sharded: bool) -> bool:
    """Whether ``name`` is one ampkit gives a periodic checkpoint (a file, or a sharded directory)."""
    return re.fullmatch(PERIODIC_STEM + ("" if sharded else r"\.pt"), name) is not None


def is_best_k_checkpoint_name(name: str, sharded: bool) -> bool:
    """Whether ``name`` is one ampkit gives a best-k checkpoint (a file, or a sharded directory)."""
    return re.fullmatch(BEST_K_STEM + ("" if sharded else r"\.pt"), name) is not None


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, unsafe or not ampkit's."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint file whose bytes are not those written (a copy torn or cut short, a disk's error); ``damage`` says
    what in it (:func:`damaged_record`), apart from the file's name: a whole copy of it elsewhere is another matter.
    ``fallback``: the newest whole checkpoint beside it, where the message names one."""

    def __init__(self, message: str, damage: str, fallback: Path | None = None) -> None:
        super().__init__(message)
        self.damage = damage
        self.fallback = fallback

    def __reduce__(self) -> tuple[type, tuple[str, str, Path | None]]:  # it travels to the other ranks whole
        return type(self), (str(self), self.damage, self.fallback)


# A storage failure: the disk under the run failed it (full, over quota, an I/O error, remounted read-only), not its
# config or its checkpoints, so the run can go on from its newest checkpoint once there is room (or on another disk or
# machine). ``ampkit fit`` exits with its own status for it (STORAGE_EXIT_STATUS, sysexits' EX_IOERR).
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})
STORAGE_EXIT_STATUS = 74


def storage_errno(exc: BaseException) -> int | None:
    """The errno of the storage failure ``exc`` is (an OSError, or DCP's exception gathering one from a rank), or
    None when it is none."""
    if isinstance(exc, OSError):
        return exc.errno if exc.errno in STORAGE_ERRNOS else None
    if type(exc).__name__ != "CheckpointException":  # DCP's; not imported: that costs start-up
        return None
    found = (storage_errno(err) for err, _ in getattr(exc, "failures", {}).values() if isinstance(err, BaseException))
    return next((n for n in found if n is not None), None)


def from_storage(error: _E, cause: BaseException) -> _E:
    """``error`` (the one line a failed write raises) with ``storage_errno``, :func:`storage_errno` of the ``cause``
    it replaces: an attribute, so it travels to the other ranks with the error."""
    error.storage_errno = storage_errno(cause)
    return error


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (``/proc/self/status``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class _WriteFailureRecorder:
    """A file whose ``write`` keeps the ``OSError`` it raised; everything else is the wrapped file's."""

    def __init__(self, file: IO) -> None:
        self._file = file
        self.failure: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._file.write(data)
        except OSError as exc:
            self.failure = exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


@contextmanager
def write_errors_surfaced(file: IO, path: str | os.PathLike) -> Iterator[IO]:
    """``file``, whose failed write (a full disk, a quota, an I/O error, a file-size limit) is what a save into it
    raises, with ``path``: ``torch.save`` swallows its stream's ``OSError`` and raises ``RuntimeError: [enforce fail
    at inline_container.cc] unexpected pos``, which names neither the file nor the reason."""
    recorder = _WriteFailureRecorder(file)
    try:
        yield recorder
    except Exception as exc:
        failure = recorder.failure
        if failure is None or failure is exc:
            raise
        if failure.filename is None:
            failure.filename = os.fspath(path)
        raise failure from None


# A user keeps a file by taking away its write permission (``chmod a-w``), as rm, rsync and git understand it: they ask
# before deleting, or refuse to overwrite. ampkit never deletes or replaces such a file.
PROTECTED = "write-protected (no write permission): ampkit never deletes or replaces it"


def write_protected(path: str | os.PathLike, contents: bool = True) -> bool:
    """Whether ``path`` was made read-only to keep it: a file, or a directory (a sharded checkpoint) or, with
    ``contents``, any file directly in it, with no write permission for anyone. Read from the mode, not
    ``os.access``: root may write anything, yet a ``chmod a-w`` is a request to keep the file all the same. A
    symlink is read where it leads. Never under a umask that takes every write permission away (``umask 0277``):
    then every file and folder ampkit writes looks so, and none can be told to be the user's."""
    try:
        mode = Path(path).stat().st_mode
        read_only = not mode & 0o222 or (
            contents
            and stat.S_ISDIR(mode)
            and any(not e.stat().st_mode & 0o222 for e in os.scandir(path) if e.is_file())
        )
    except OSError:  # gone, or unreadable: nothing there to keep
        return False
    return read_only and bool(0o222 & ~_umask())  # the umask read only for a file that looks kept


def refuse_protected(path: str | os.PathLike) -> None:
    """A ``PermissionError`` naming ``path`` when it is :func:`write_protected`: a write would replace what the user
    keeps."""
    if write_protected(path):
        raise PermissionError(errno.EACCES, PROTECTED, os.fspath(path))


def deletable(checkpoints: list[Path], warned: set[Path] | None = None) -> list[Path]:
    """``checkpoints`` less those ampkit keeps, each named in one warning (once per ``warned``, which records it):
    write-protected ones (``chmod a-w``: the user keeps them), links (the user's, to files elsewhere), and files under
    a checkpoint's name that hold no ampkit checkpoint (a user's own, copied or saved there). Pruning neither deletes
    nor counts them."""
    warned = set() if warned is None else warned
    kept = {path: why for path in checkpoints if (why := _kept_because(path))}
    for path, (why, fix) in kept.items():
        if path not in warned:
            warned.add(path)
            rank_zero_warn(
                f"'{path}' {why}: ampkit keeps it, outside the checkpoints that keep_last and save_top_k count; {fix}"
            )
    return [path for path in checkpoints if path not in kept]


def _kept_because(path: Path) -> tuple[str, str] | None:
    """Why pruning keeps ``path`` (see :func:`deletable`) and what lets it go, or None."""
    if path.is_symlink():  # ampkit copies a checkpoint to its other names: a link there is the user's, to their files
        return (
            f"is a link (to '{os.readlink(path)}'), which ampkit never makes under a checkpoint's name",
            "remove the link yourself if it should go; what it points to is never deleted through it",
        )
    if write_protected(path):
        return "is write-protected (chmod a-w)", "make it writable again (chmod u+w) to let them delete it"
    if foreign_file(path):
        return "holds no ampkit checkpoint", "move it out of the checkpoints folder, or delete it yourself"
    return None


# A file under a name ampkit gives its checkpoints (last.pt, best.pt, step-N.pt...) that holds no ampkit checkpoint
# is the user's (notes, a torch.save of weights put there): ampkit never deletes or replaces it.
FOREIGN = (
    "holds no ampkit checkpoint, so it is yours and ampkit never replaces it: move it out of the checkpoints folder"
)


def foreign_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file (or a symlink to one) that holds no ampkit checkpoint: a user's own under a
    checkpoint's name. Each file is read once (without its tensors) however often this asks."""
    identity = _identity(path)
    return identity is not None and identity not in _WRITTEN and not _holds_ampkit_checkpoint(*identity)


# The identities of the checkpoint files this process wrote (or copied from one it wrote): known to be ampkit's
# without a read, which for a large one (thousands of tensors) costs most of a save's time. The newest few are kept.
_WRITTEN: dict[tuple[str, int, int, int], None] = {}


def _identity(path: str | os.PathLike) -> tuple[str, int, int, int] | None:
    """``(path, inode, mtime, size)`` of the regular file ``path`` (a symlink read where it leads), or None."""
    try:
        info = os.stat(path)
    except OSError:  # gone, or unreadable
        return None
    return (os.fspath(path), info.st_ino, info.st_mtime_ns, info.st_size) if stat.S_ISREG(info.st_mode) else None


def _remember_written(path: Path) -> None:
    """Record checkpoint file ``path``, just written by this process, as ampkit's (see :data:`_WRITTEN`)."""
    if (identity := _identity(path)) is not None:
        _WRITTEN[identity] = None
        while len(_WRITTEN) > 256:
            del _WRITTEN[next(iter(_WRITTEN))]


def refuse_foreign(path: str | os.PathLike) -> None:
    """A ``FileExistsError`` naming ``path`` when it is a :func:`foreign_file`: a save there would replace the user's
    file with a checkpoint."""
    if foreign_file(path):
        raise FileExistsError(errno.EEXIST, FOREIGN, os.fspath(path))


@functools.lru_cache(maxsize=256)
def _holds_ampkit_checkpoint(path: str, inode: int, mtime_ns: int, size: int) -> bool:
    """Whether file ``path`` reads as an ampkit checkpoint (without its tensors); keyed by its identity, so each file
    is read once however many saves prune beside it."""
    checkpoint = peek_checkpoint(path)
    return checkpoint is not None and FORMAT_KEY in checkpoint


# os.link's errors on a file system that has no hard links (an object-store mount: s3fs, gcsfuse, blobfuse; FAT):
# there, no file can be put in place only where none is in one step, and a save that must not replace one looks first.
NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}


def _replace_atomically(path: Path, mode: str, write: Callable[[IO], None], replace: bool = True) -> None:
    """``write`` into a temp file beside ``path``, fsync it, then rename it over ``path`` (the temp file is
    removed if anything fails): readers see the old file or the new one, never half of one. The file gets the
    permissions ``open()`` would give it (the umask's), not the temp file's owner-only ones, so a run directory
    on a shared filesystem stays readable by whom the user's umask lets read it. A write-protected ``path`` is
    refused (:func:`refuse_protected`); so is, unless ``replace``, a file at ``path`` however new (one that another
    process wrote while this one wrote its own): a FileExistsError."""
    refuse_protected(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            with write_errors_surfaced(f, path) as sink:
                write(sink)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            _put_in_place_unless_taken(Path(tmp), path)
    except BaseException:
        # Where it cannot go (ext4 remounts read-only after an I/O error), the error raised stays the write's, and the
        # next fit's tidy removes the temp file.
        with suppress(OSError):
            Path(tmp).unlink(missing_ok=True)
        raise


def _put_in_place_unless_taken(tmp: Path, path: Path) -> None:
    """Give finished file ``tmp`` the name ``path`` only where no file has it (a FileExistsError else), in one step
    (a hard link) where the filesystem has them; the temp name goes."""
    try:
        os.link(tmp, path)
    except OSError as exc:
        if exc.errno not in NO_HARD_LINKS:
            raise
        if path.exists() or path.is_symlink():  # no atomic way here: looked at as late as can be
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path)) from None
        os.replace(tmp, path)
        return
    tmp.unlink()


def save_atomic(obj: Any, path: str | os.PathLike, replace: bool = True) -> Path:
    """Write ``obj`` to a temp file beside ``path``, fsync it, then rename: readers see old or new, never half.
    Unless ``replace``, a file at ``path`` (one written meanwhile by another process) stays: a FileExistsError."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _replace_atomically(path, "wb", lambda f: torch.save(obj, f), replace)
    _fsync_dir(path.parent)
    if isinstance(obj, dict) and FORMAT_KEY in obj:
        _remember_written(path)
    return path


def write_text_atomic(text: str, path: Path) -> None:
    """Write ``text`` to ``path`` as :func:`save_atomic` writes: a kill leaves the old file or the new one."""
    _replace_atomically(path, "w", lambda f: f.write(text))


# copy_file_range's errors meaning "not between these files" (another filesystem, an old kernel): copy in Python.
_NO_KERNEL_COPY = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF}


def _copy_bytes(source: Path, target: IO) -> None:
    """Copy ``source``'s bytes into the open file ``target``: in the kernel (``copy_file_range``, which shares the
    blocks copy-on-write where the filesystem can: btrfs, XFS, ZFS), else through Python."""
    copy_range = getattr(os, "copy_file_range", None)  # Linux only
    with source.open("rb") as src:
        size, copied = os.fstat(src.fileno()).st_size, 0
        try:
            while copy_range is not None and copied < size:
                n = copy_range(src.fileno(), target.fileno(), size - copied)
                if n == 0:
                    break
                copied += n
        except OSError as exc:
            if copied or exc.errno not in _NO_KERNEL_COPY:  # a full disk, a quota, an I/O error: the save fails
                raise
        if copied < size:
            src.seek(copied)
            shutil.copyfileobj(src, target, 16 << 20)


def copy_atomic(source: Path, alias: Path) -> None:
    """Make ``alias`` a copy of ``source``, atomically (as :func:`save_atomic` writes). A copy, not a link: a user
    who rewrites one checkpoint in place (``torch.save(ck, "last.pt")``) changes that one, not every name of it."""
    ours = _identity(source) in _WRITTEN
    _replace_atomically(alias, "wb", lambda f: _copy_bytes(source, f))
    _fsync_dir(alias.parent)
    if ours:
        _remember_written(alias)


_NUMBERED_NAMES = (is_periodic_checkpoint_name, is_best_k_checkpoint_name)


def _expected_instead(name: str) -> str:
    """What a load expected of a foreign file named ``name``: a file at a checkpoint's own name was put there by
    someone else (ampkit wrote no such file), and a run would never replace it."""
    if name in ("last.pt", "best.pt") or any(named(name, False) for named in _NUMBERED_NAMES):
        return (
            f"ampkit did not write it, though {name} is the name of one of its checkpoints: a file of yours put there, "
            "which a run never replaces; move it out of the checkpoints folder"
        )
    return "Expected a file ampkit's ModelCheckpoint wrote (last.pt, step-N.pt)"


# Words of torch's weights-only unpickler when a pickle names code (a GLOBAL, a reduce call, a class), as
# opposed to bytes no unpickler can read ("Unsupported operand 103" for a text file).
_CODE_WORDS = ("GLOBAL", "global", "reduce", "class")


def _unpickler_detail(exc: pickle.UnpicklingError) -> tuple[bool, str]:
    """``(names_code, reason)`` from torch's weights-only unpickler error (its message is mostly advice)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    advice = ("(1)", "(2)", "Please file", "Check the documentation")
    reasons = [line.split("WeightsUnpickler error:", 1)[-1].strip() for line in lines[1:]]
    reasons = [r for r in reasons if r and not r.startswith(advice)]
    reason = reasons[-1] if reasons else (lines[0] if lines else type(exc).__name__)
    return any(word in reason for word in _CODE_WORDS), reason


# How every file torch.save writes begins: a zip archive (the default) or a pickle stream (the legacy format).
_TORCH_FILE_STARTS = (b"PK\x03\x04", b"\x80")


def describe(exc: BaseException) -> str:
    """``Type: first sentence of the message`` (torch appends paragraphs of advice to a corrupt archive's)."""
    text = " ".join(str(exc).split())
    first = text.split(". ", 1)[0].rstrip(".")
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def peek_checkpoint(path: str | os.PathLike) -> dict[str, Any] | None:
    """A checkpoint file's entries, memory-mapped (its tensors are not read), for a look at its loop position or
    sections; None when it cannot be read as a dict (half-written, damaged or foreign)."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # whatever the unpickler meets in foreign bytes
        return None
    return checkpoint if isinstance(checkpoint, dict) else None


def file_fingerprint(path: str | os.PathLike | IO[bytes]) -> str | None:
    """A digest telling checkpoint file ``path`` from any other, read without its tensors: the names, sizes and
    CRC-32s of the records of torch's zip archive, the pickle that holds every value but the tensors, and each small
    record (``.data/serialization_id``, unique to each save). A copy of the file has the same one. None when no file
    can be read there. ``path`` may be a file open for reading (see :func:`damaged_record`)."""
    digest = hashlib.sha256()
    try:
        with _opened(path) as file:
            file.seek(0)
            try:
                with zipfile.ZipFile(file) as archive:
                    for record in archive.infolist():
                        name = record.filename.partition("/")[2]  # the archive's folder is named after nothing
                        digest.update(f"{name}:{record.file_size}:{record.CRC}\n".encode())
                        if name == "data.pkl" or record.file_size <= 4096:
                            digest.update(archive.read(record))
            except zipfile.BadZipFile:  # the legacy format, or a damaged file: every byte
                file.seek(0)
                digest.update(file.read())
    except OSError:
        return None
    return digest.hexdigest()


def readable_format(checkpoint: Any) -> bool:
    """Whether ``checkpoint`` (as loaded or peeked) is an ampkit checkpoint of a format this ampkit reads: what
    :func:`load_checkpoint` checks after the bytes load, so a hint never names a file it would refuse the same way."""
    version = checkpoint.get(FORMAT_KEY) if isinstance(checkpoint, dict) else None
    return isinstance(version, int) and not isinstance(version, bool) and version <= FORMAT_VERSION


def damaged_record(path: str | os.PathLike | IO[bytes]) -> str | None:
    """What is damaged in checkpoint file ``path`` (a copy cut short or torn, a disk's error), found by reading every
    record of its zip archive against the size and CRC-32 in the archive's directory, which torch.load checks not:
    a torn copy loads without a word, with wrong values. None where every record is whole, where the file is no zip
    archive (the legacy format holds no CRCs), and where it cannot be opened (the caller says so). ``path`` may be a
    file open for reading, read from its start: the file a load read, not one put at its path since."""
    try:
        with _opened(path) as file:
            file.seek(0)
            if file.read(4) != _TORCH_FILE_STARTS[0]:
                return None
            file.seek(0)
            return _damaged_in(file)
    except OSError:
        return None


@contextmanager
def _opened(path: str | os.PathLike | IO[bytes]) -> Iterator[IO[bytes]]:
    """``path`` opened for reading, closed after; a file object as it is, left open (its owner closes it)."""
    if isinstance(path, str | os.PathLike):
        with open(path, "rb") as file:
            yield file
    else:
        yield path


def _damaged_in(file: IO[bytes]) -> str | None:
    """:func:`damaged_record` of the zip archive in open ``file``."""
    try:
        with zipfile.ZipFile(file) as archive:
            for record in archive.infolist():
                try:
                    with archive.open(record) as stream:
                        while stream.read(1 << 24):  # zipfile checks the size and CRC-32 at the record's end
                            pass
                except (zipfile.BadZipFile, EOFError, ValueError, OSError) as exc:
                    return f"its record '{record.filename.partition('/')[2]}' is not as written ({describe(exc)})"
    except zipfile.BadZipFile as exc:
        return f"its zip archive's directory cannot be read, so the file was cut short ({exc})"
    return None


# What torch.load(weights_only=True) rebuilds without naming code: these exact types, tensors, and the classes torch
# allows by name (torch.Size, OrderedDict...). A subclass (a namedtuple, a defaultdict) or a NumPy value is refused.
_PLAIN_TYPES = frozenset({bool, int, float, complex, str, bytes, bytearray, type(None), torch.dtype, torch.device})
_CONTAINERS = frozenset({dict, list, tuple, set})


def unloadable_entry(obj: Any, where: str = "") -> str | None:
    """The first entry of ``obj`` that ``torch.load(weights_only=True)`` would refuse to rebuild, as ``key.key
    (its type)``, or None when a checkpoint holding ``obj`` loads back."""
    found = _refused_in(obj, set())
    if found is None:
        return None
    path, name = found
    keys = [where, *reversed(path)] if where else list(reversed(path))
    if len(keys) > 8:  # a path as deep as MAX_NESTING: its start and end say where
        keys = [*keys[:4], f"<{len(keys) - 6} more>", *keys[-2:]]
    return f"{'.'.join(keys) or '<root>'} ({name})"


# Containers nested deeper than this are refused: torch.save's pickler recurses once a level (and a level of the
# checkpoint's own), so a few hundred levels end in a RecursionError halfway through the save.
MAX_NESTING = 100


def _refused_in(obj: Any, around: set[int]) -> tuple[list[str], str] | None:
    """``(keys from the refused entry up to obj, its type's name)``; None when all of ``obj`` loads back. Run over
    every entry of every save (tens of thousands of tensors in a large model's states), so a key's text is made only
    for the entry found. ``around``: the ids of the containers ``obj`` is inside (pickle writes a container that holds
    itself once, and the load rebuilds it so)."""
    kind = type(obj)
    if isinstance(obj, torch.Tensor) or kind in _PLAIN_TYPES or id(obj) in around:
        return None
    if len(around) >= MAX_NESTING:
        return [], f"containers nested over {MAX_NESTING} deep: torch.save runs out of stack writing them"
    if kind not in _CONTAINERS:
        name = f"{kind.__module__}.{kind.__qualname__}"
        if name not in _torch_allowed_globals() and kind not in _user_safe_globals():
            # Rebuilt through other names than its class's (a NumPy scalar allowed as numpy.core.multiarray.scalar
            # and its dtype, a torch.layout): what the load itself does says.
            return None if _loads_back(obj) else ([], name)
    # Plain keys and values and tensors, nearly every entry, are passed over here rather than in a call each.
    around = around | {id(obj)}
    if isinstance(obj, dict):
        for key, value in obj.items():
            if type(key) not in _PLAIN_TYPES and (found := _refused_in(key, around)) is not None:
                found[0].append(f"<key {shown(key)}>")
                return found
            if isinstance(value, torch.Tensor) or type(value) in _PLAIN_TYPES:
                continue
            if (found := _refused_in(value, around)) is not None:
                found[0].append(str(key))
                return found
    elif isinstance(obj, list | tuple | set):
        for i, value in enumerate(obj):
            if isinstance(value, torch.Tensor) or type(value) in _PLAIN_TYPES:
                continue
            if (found := _refused_in(value, around)) is not None:
                found[0].append(str(i))
                return found
    return None


def _loads_back(obj: Any) -> bool:
    """Whether ``torch.load(weights_only=True)`` rebuilds ``obj`` saved alone."""
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:  # refused by name, or not picklable at all: either way no resume gets it back
        return False
    return True


@functools.cache
def _torch_allowed_globals() -> frozenset[str]:
    """The classes torch's weights-only unpickler rebuilds by name (a private table: the public few if it moves)."""
    try:
        from torch._weights_only_unpickler import _get_allowed_globals
    except ImportError:
        return frozenset({"collections.OrderedDict", "torch.Size"})
    return frozenset(_get_allowed_globals())


def _user_safe_globals() -> list[Any]:
    """What the user allowed with ``torch.serialization.add_safe_globals`` (classes, or ``(class, name)`` pairs)."""
    return [entry[0] if isinstance(entry, tuple) else entry for entry in torch.serialization.get_safe_globals()]


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load an ampkit checkpoint with ``weights_only=True``, its records read against their CRC-32s (a damaged copy is
    a :class:`DamagedCheckpointError`); every failure is one :class:`CheckpointError`."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint file at '{path}'")
    # Opened once: the load and the CRC-32 check read one file, even where another is put at its path meanwhile.
    with path.open("rb") as file:
        return _load_open(path, file)


def load_fingerprinted(path: str | os.PathLike) -> tuple[dict[str, Any], str | None]:
    """:func:`load_checkpoint`, and the :func:`file_fingerprint` of the file it read: the one open file, so a file put
    at ``path`` meanwhile is not the one the digest tells others to be."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint file at '{path}'")
    with path.open("rb") as file:
        return _load_open(path, file), file_fingerprint(file)


def _load_open(path: Path, file: IO[bytes]) -> dict[str, Any]:
    """:func:`load_checkpoint` of ``file``, open at ``path``."""
    start = file.read(4)
    file.seek(0)
    if not start:
        raise CheckpointError(f"checkpoint '{path}' is an empty file")
    if not start.startswith(_TORCH_FILE_STARTS):
        raise CheckpointError(f"'{path}' is not a torch checkpoint (torch.save writes a zip archive or a pickle)")
    try:
        checkpoint = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        names_code, detail = _unpickler_detail(exc)
        if not names_code:
            raise CheckpointError(f"checkpoint '{path}' is corrupt or not a torch checkpoint: {detail}") from None
        raise CheckpointError(
            f"refusing to load '{path}': it holds pickled objects other than tensors and plain containers, "
            f"which could run code ({detail}). ampkit loads checkpoints with weights_only=True."
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as exc:
        message = f"checkpoint '{path}' is corrupt or truncated: {describe(exc)}"
        damage = damaged_record(file)  # read only where torch failed: a copy cut short, a record torn
        raise (CheckpointError(message) if damage is None else DamagedCheckpointError(message, damage)) from None
    except Exception as exc:  # the unpickler fails on foreign bytes with whatever error it meets (KeyError...)
        raise CheckpointError(f"checkpoint '{path}' is corrupt or not a torch checkpoint: {describe(exc)}") from None
    # torch.load checks no CRC-32: a copy torn in a tensor's bytes loads without an error, with other values.
    if (damage := damaged_record(file)) is not None:
        raise DamagedCheckpointError(
            f"checkpoint '{path}' is damaged: {damage}; it would load without an error, with other values than "
            "those saved",
            damage,
        )
    if not isinstance(checkpoint, dict) or FORMAT_KEY not in checkpoint:
        raise CheckpointError(
            f"'{path}' is not an ampkit checkpoint (no '{FORMAT_KEY}' entry): {foreign_contents(checkpoint)}. "
            + _expected_instead(path.name)
        )
    if isinstance(checkpoint[FORMAT_KEY], bool) or not isinstance(checkpoint[FORMAT_KEY], int):
        raise CheckpointError(
            f"'{path}' has checkpoint format {shown(checkpoint[FORMAT_KEY])}; ampkit writes a whole number (this "
            f"ampkit reads up to {FORMAT_VERSION}): the file was written by other code or damaged"
        )
    if checkpoint[FORMAT_KEY] > FORMAT_VERSION:
        raise CheckpointError(
            f"'{path}' has checkpoint format {checkpoint[FORMAT_KEY]}; this ampkit reads up to {FORMAT_VERSION}"
        )
    return checkpoint
