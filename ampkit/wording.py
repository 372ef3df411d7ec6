"""How a message words a count: one helper for every module, so that no message says "1 batches"; an integer
no float holds, which ``float()`` refuses with a bare OverflowError naming neither the value nor the argument; and a
value whose repr would fill the screen."""

from __future__ import annotations

import math
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
    """``"an integer of 401 digits"``, ``"a negative integer of 501 digits"``: how a message shows an integer whose
    digits would fill the screen (str() refuses over 4300 digits, so they are counted from its bits)."""
    magnitude = abs(value)
    digits = max(1, int((magnitude.bit_length() - 1) * math.log10(2)) + 1)  # within one of the count
    while magnitude >= 10**digits:
        digits += 1
    while digits > 1 and magnitude < 10 ** (digits - 1):
        digits -= 1
    return f"{'a negative' if value < 0 else 'an'} integer of {digits} digits"


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to its first ``limit`` characters and its length where longer: a message names a 100 kB
    string pasted into a config key without repeating all of it."""
    text = integer_digits(value) if beyond_float(value) else repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
