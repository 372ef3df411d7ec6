"""Free temp names beside a checkpoint: where something of the user's stands at the temp name ampkit usually writes
through (``.step-00000100.tmp``, ``.last.old``, the ``.last.tmp`` link), the save goes through another one instead.

The other one is ``.<name>.<random>.<suffix>``, its random part as mkstemp's (eight of ``a-z0-9_``), so the next fit's
tidy knows it for ampkit's. The user's thing stays as it is, named in one warning: a run never stops for a name ampkit
chose.
"""

from __future__ import annotations

import os
import re
import secrets
import tempfile
from pathlib import Path

from lightning_utilities.core.rank_zero import rank_zero_warn

from ampkit.trainer.checkpoint_io import _umask

# mkstemp's and mkdtemp's random part (tempfile's own alphabet and length), which the tidy matches
RANDOM_PART = r"\.[a-z0-9_]{8}"
_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789_"

_named: set[Path] = set()  # the user's things at ampkit's temp names named so far: each once in the process


def step_around(beside: Path, suffix: str, what: str) -> None:
    """Say once (per process) that ``.<name>.<suffix>``, ampkit's usual temp name beside checkpoint ``beside``, holds
    ``what`` of the user's, which stays as it is while ampkit writes through a free name."""
    usual = beside.with_name(f".{beside.name}.{suffix}")
    if usual in _named:
        return
    _named.add(usual)
    rank_zero_warn(
        f"'{usual}' is {what}: ampkit keeps it as it is and writes through a free temp name beside it "
        f"('.{beside.name}.<random>.{suffix}', which the next fit tidies if a kill leaves it); move yours out of the "
        "checkpoints folder if it is not meant to be there"
    )


def free_dir(beside: Path, suffix: str) -> Path:
    """A new empty folder ``.<name>.<random>.<suffix>`` beside checkpoint ``beside``, with the permissions ``mkdir``
    would give it (mkdtemp's are owner-only): a save's folder is renamed into the checkpoint's place."""
    made = Path(tempfile.mkdtemp(prefix=f".{beside.name}.", suffix=f".{suffix}", dir=beside.parent))
    os.chmod(made, 0o777 & ~_umask())
    return made


def free_link(target: str, beside: Path, suffix: str) -> Path:
    """A new symlink to ``target`` at a free ``.<name>.<random>.<suffix>`` beside ``beside``. The random part comes
    from ``secrets``, so Python's ``random`` state (a resume's RNG) is left as it is."""
    while True:
        link = beside.with_name(f".{beside.name}.{''.join(secrets.choice(_ALPHABET) for _ in range(8))}.{suffix}")
        try:
            os.symlink(target, link)
        except FileExistsError:  # taken: one of 37**8 names, drawn again
            continue
        return link


def temp_name_of(name: str, suffix: str, stem: str) -> re.Match[str] | None:
    """``name`` matched as a temp name of a checkpoint matching regex ``stem`` (group 1), ampkit's usual one
    (``.<stem>.<suffix>``) or a free one (``.<stem>.<random>.<suffix>``), or None."""
    return re.fullmatch(rf"\.({stem})(?:{RANDOM_PART})?\.{re.escape(suffix)}", name)
