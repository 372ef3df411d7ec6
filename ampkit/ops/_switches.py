"""What an on/off argument may be, for the fused ops and the Apex API they serve."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np


def is_switch(value: Any) -> bool:
    """Whether ``value`` says True or False unambiguously: a bool, numpy's ``bool_`` (Apex's pybind11 bindings took
    it as a bool), or the integers 0 and 1. ``"False"`` (truthy) or ``2`` is not."""
    if isinstance(value, bool | np.bool_):
        return True
    return isinstance(value, numbers.Integral) and value in (0, 1)
