"""Run directories: ``<run_dir>/version_N/{config.yaml,checkpoints/,tensorboard/}``; nothing is overwritten."""

from __future__ import annotations

import re
from pathlib import Path

_VERSION = re.compile(r"^version_(\d+)$")


def _versions(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _VERSION.match(p.name)) and p.is_dir()]
    return sorted(found)


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


def latest_checkpoint(root: str | Path, name: str = "last.pt") -> Path | None:
    """``checkpoints/<name>`` (``last.pt``, ``best.pt``, or ``last``/``best``, the links to sharded checkpoint
    directories) of the newest version under ``root`` that has one."""
    candidates = [name, name.removesuffix(".pt")]  # a .pt file, or the link to a sharded checkpoint directory
    for _, version in reversed(_versions(Path(root))):
        for found in (version / "checkpoints" / c for c in candidates):
            if found.is_file() or (found / ".metadata").is_file():
                return found
    return None
