"""What an on/off argument may be, for the fused ops and the Apex API they serve."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from ampkit.ops._errors import ArgumentTypeError
from ampkit.wording import shown


def is_switch(value: Any) -> bool:
    """Whether ``value`` says True or False unambiguously: a bool, numpy's ``bool_`` (Apex's pybind11 bindings took
    it as a bool), or the integers 0 and 1. ``"False"`` (truthy) or ``2`` is not."""
    if isinstance(value, bool | np.bool_):
        return True
    return isinstance(value, numbers.Integral) and value in (0, 1)


def checked_switch(owner: str, name: str, value: Any, hint: str = "") -> bool:
    """``value`` as a Python bool if :func:`is_switch` takes it; else an :class:`ArgumentTypeError` naming ``owner``'s
    ``name`` and the value (``bool("False")`` is True: a switch read from a config as text would be on)."""
    if is_switch(value):
        return bool(value)
    raise ArgumentTypeError(f"{owner}: {name} must be True or False, got {shown(value)}{hint}")
