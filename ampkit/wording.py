"""How a message words a count: one helper for every module, so that no message says "1 batches"."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``"1 step"``, ``"2 steps"``, ``"0 steps"``; ``plural`` where adding an s is wrong (``"batches"``)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
