"""O1's user-registered casts: ``register_{half,float,promote}_function`` and the matching decorators.

Under O1 the model's forward runs in autocast; these add per-function rules on top. A registered or
decorated function, called while O1 is active (and not inside ``disable_casts``), gets its floating
tensor arguments cast (to the low-precision dtype, to float32, or to the widest type among them) and
runs with autocast off, so the cast is what it computes in. Registrations take effect at the next O1
``initialize`` (as in Apex); every ``initialize`` first undoes the previous patches and re-applies the
registry only for O1, so a re-initialize leaves nothing stale behind.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from ampkit.compat.amp._amp_state import _amp_state

_PRECEDENCE = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
_registry: dict[tuple[int, str], tuple[Any, str, str]] = {}
_applied: list[tuple[Any, str, Any]] = []


def _cast_tree(value: Any, dtype: torch.dtype) -> Any:
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_tree(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_tree(v, dtype) for k, v in value.items()}
    return value


def _floating_dtypes(value: Any, found: set[torch.dtype]) -> set[torch.dtype]:
    if torch.is_tensor(value) and value.is_floating_point():
        found.add(value.dtype)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _floating_dtypes(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _floating_dtypes(v, found)
    return found


def _widest(dtypes: set[torch.dtype]) -> torch.dtype | None:
    if not dtypes:
        return None
    if dtypes == {torch.float16, torch.bfloat16}:
        return torch.float32
    return max(dtypes, key=lambda d: _PRECEDENCE.get(d, 2))


def _target_dtype(kind: str, args: tuple, kwargs: dict) -> torch.dtype | None:
    if kind == "half":
        return _amp_state.opt_properties.dtype
    if kind == "float":
        return torch.float32
    return _widest(_floating_dtypes((args, kwargs), set()))


def _autocast_off() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for device_type in _amp_state.cast_device_types:
        stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack


def _casting_wrapper(fn: Callable, kind: str) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _amp_state.casts_active():
            return fn(*args, **kwargs)
        dtype = _target_dtype(kind, args, kwargs)
        if dtype is None:
            return fn(*args, **kwargs)
        with _autocast_off():
            return fn(*_cast_tree(args, dtype), **_cast_tree(kwargs, dtype))

    wrapper.__ampkit_cast__ = kind
    return wrapper


def _register(module: Any, name: str, kind: str) -> None:
    if not hasattr(module, name):
        raise ValueError(f"No function named {name!r} in module {module!r}")
    _registry[(id(module), name)] = (module, name, kind)


def register_half_function(module: Any, name: str) -> None:
    """Run ``module.name`` in the low-precision dtype under O1 (applied by the next ``initialize``)."""
    _register(module, name, "half")


def register_float_function(module: Any, name: str) -> None:
    """Run ``module.name`` in float32 under O1 (applied by the next ``initialize``)."""
    _register(module, name, "float")


def register_promote_function(module: Any, name: str) -> None:
    """Run ``module.name`` in the widest floating type of its arguments under O1."""
    _register(module, name, "promote")


def half_function(fn: Callable) -> Callable:
    """Decorator: under O1, call ``fn`` with floating tensors cast to the low-precision dtype."""
    return _casting_wrapper(fn, "half")


def float_function(fn: Callable) -> Callable:
    """Decorator: under O1, call ``fn`` with floating tensors cast to float32."""
    return _casting_wrapper(fn, "float")


def promote_function(fn: Callable) -> Callable:
    """Decorator: under O1, call ``fn`` with floating tensors cast to the widest type among them."""
    return _casting_wrapper(fn, "promote")


def restore_registered_functions() -> None:
    """Undo the patches the previous ``initialize`` applied."""
    while _applied:
        module, name, original = _applied.pop()
        setattr(module, name, original)


def apply_registered_functions() -> None:
    """Patch every registered function (called by an O1 ``initialize``)."""
    for module, name, kind in _registry.values():
        original = getattr(module, name)
        _applied.append((module, name, original))
        setattr(module, name, _casting_wrapper(original, kind))


@contextlib.contextmanager
def disable_casts() -> Any:
    """Turn O1's casts (autocast and the registered functions) off inside the block."""
    _amp_state.casts_disabled_depth += 1
    try:
        with _autocast_off():
            yield
    finally:
        _amp_state.casts_disabled_depth -= 1
