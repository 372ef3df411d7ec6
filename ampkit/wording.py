"""How a message words a count: one helper for every module, so that no message says "1 batches"; and an integer
no float holds, which ``float()`` refuses with a bare OverflowError naming neither the value nor the argument."""

from __future__ import annotations

import sys
from typing import Any


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``"1 step"``, ``"2 steps"``, ``"0 steps"``; ``plural`` where adding an s is wrong (``"batches"``)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def type_of(value: Any) -> str:
    """``"an int"``, ``"a float"``, ``"a Tensor"``: the article and type name a message says a value is."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def beyond_float(value: Any) -> bool:
    """Whether ``value`` is an integer too large for a float (``float(value)`` raises OverflowError)."""
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) > sys.float_info.max


def integer_digits(value: int) -> str:
    """``"an integer of 401 digits"``: how a message shows an integer whose digits would fill the screen."""
    return f"an integer of {len(str(abs(value)))} digits"
