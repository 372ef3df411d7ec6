"""``apex.amp._initialize``: the helper of Apex's module that code outside Apex calls, ``applier`` (catalyst casts
a DataParallel model's inputs and outputs with it)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch


def applier(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` applied to every tensor (and object with a ``.to`` method, Apex's custom batches) inside nested
    mappings and iterables, rebuilt with their own types; strings, numpy arrays and other values pass through."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, str | np.ndarray):
        return value
    if hasattr(value, "to"):
        return fn(value)
    if isinstance(value, Mapping):
        return {applier(k, fn): applier(v, fn) for k, v in value.items()}
    if isinstance(value, Iterable):
        return type(value)(applier(v, fn) for v in value)
    return value
