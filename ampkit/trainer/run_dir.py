"""Run directories: ``<run_dir>/version_N/{config.yaml,checkpoints/,tensorboard/}``; nothing is overwritten."""

from __future__ import annotations

import os
import re
from pathlib import Path

_VERSION = re.compile(r"^version_(\d+)$")


def _versions(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _VERSION.match(p.name)) and p.is_dir()]
    return sorted(found)


def version_dirs(root: str | Path) -> list[Path]:
    """Every ``version_N`` directory under ``root``, oldest first."""
    return [path for _, path in _versions(Path(root))]


def quoted_run_dir(root: str | Path) -> str:
    """``root`` quoted for a message; a relative one also names the working directory it is under."""
    return (
        f"'{root}'"
        if Path(root).is_absolute()
        else f"'{root}' (relative to the working directory: {Path(root).absolute()})"
    )


def unwritable_reason(root: str | Path, write: bool = True) -> str | None:
    """Why ``version_N`` could not be created under ``root`` (a file in the way; with ``write``, no write access: a
    read-only mount, permissions), or None."""
    existing = Path(root).absolute()
    too_long = [part for part in existing.parts if len(os.fsencode(part)) > 255]
    if too_long or len(os.fsencode(str(existing))) > 3800:  # the filesystem's limits, less room for its files
        return f"'{existing}' is too long a path (a name over 255 bytes, or the whole over 3800: its files go below it)"
    while not existing.exists() and not existing.is_symlink():  # climb to the part that is already there
        existing = existing.parent
    if not existing.is_dir():
        return f"'{existing}' is not a directory"
    if write and not os.access(existing, os.W_OK | os.X_OK):
        return f"'{existing}' is not writable"
    return None


def shard_writing_problem(version_dir: Path) -> str | None:
    """Why this process cannot write checkpoint shards into ``version_dir``, which another rank made, or None."""
    if not version_dir.is_dir():
        return "it does not exist there"
    if not os.access(version_dir, os.W_OK | os.X_OK):
        return "it is not writable there"
    return None


def new_version_dir(root: str | Path) -> Path:
    """Create and return the next free ``version_N`` under ``root``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    versions = _versions(root)
    n = versions[-1][0] + 1 if versions else 0
    while True:
        candidate = root / f"version_{n}"
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            n += 1
