"""What one batch holds, as the Trainer's ``samples_in`` and ``tokens_in`` say: checked counts for the epoch
means, validation averages and throughput figures."""

from __future__ import annotations

import numbers
from typing import Any

import torch


def checked_count(value: Any, owner: object, method: str) -> int | None:
    """``value`` returned by ``owner.<method>(batch)``: None (unknown) or an integer >= 0.

    Raises:
        TypeError: not an integer (a float, a bool, a tensor), naming the method and the value.
        ValueError: a negative integer.
    """
    if value is None:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if value >= 0:
            return int(value)
        problem, error = "negative", ValueError
    else:
        problem, error = f"a {type(value).__name__}, not an int", TypeError
        if isinstance(value, torch.Tensor):
            problem += " (count on the host, before the batch moves to the device, and return int(...))"
    raise error(
        f"{type(owner).__name__}.{method}(batch) returned {value!r}: {problem}; expected an integer >= 0 "
        "(the batch's count), or None where it is unknown"
    )
