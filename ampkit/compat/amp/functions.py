"""O1's user-registered casts: ``register_{half,float,promote}_function`` and the matching decorators.

A registration takes effect at the next O1 ``initialize`` or ``amp.init()`` (as in Apex), which patches
``module.name`` under the handle it creates; the decorators consult the active handle at every call.
Either way the function's floating arguments are cast (to the low-precision dtype, to float32, or to
float32 when they mix a low dtype with float32) only while that handle is active and not inside
``disable_casts``. Unlike Apex, a registration is kept for later initializations instead of being
consumed by the first one.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ampkit.compat.amp import o1_casts
from ampkit.compat.amp._amp_state import _amp_state
from ampkit.wording import shown

_registry: dict[tuple[int, str], tuple[Any, str, str]] = {}


def registered_casts() -> list[tuple[Any, str, str]]:
    """The ``(module, name, kind)`` registrations an O1 handle applies when it is created."""
    return list(_registry.values())


def _register(module: Any, name: str, kind: str) -> None:
    if not hasattr(module, name):
        raise ValueError(f"No function named {shown(name)} in module {module!r}")
    _registry[(id(module), name)] = (module, name, kind)


def register_half_function(module: Any, name: str) -> None:
    """Run ``module.name`` in the low-precision dtype under O1 (applied by the next ``initialize``)."""
    _register(module, name, "half")


def register_float_function(module: Any, name: str) -> None:
    """Run ``module.name`` in float32 under O1 (applied by the next ``initialize``)."""
    _register(module, name, "float")


def register_promote_function(module: Any, name: str) -> None:
    """Run ``module.name`` in float32 under O1 when its arguments mix a low-precision dtype with float32."""
    _register(module, name, "promote")


class _ActiveHandle:
    """The cast state of whichever handle is current when a decorated function is called."""

    def is_active(self) -> bool:
        handle = _amp_state.active_handle
        return handle is not None and handle.is_active()

    @property
    def has_cache(self) -> bool:
        return _amp_state.active_handle.has_cache

    @property
    def cache(self) -> dict[torch.Tensor, torch.Tensor]:
        return _amp_state.active_handle.cache


def _decorate(fn: Callable, kind: str) -> Callable:
    state = _ActiveHandle()
    promoted = o1_casts.promote_wrapper(state)(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not o1_casts.casts_here(state):
            return fn(*args, **kwargs)
        if kind == "promote":
            return promoted(*args, **kwargs)
        dtype = _amp_state.active_handle.dtype if kind == "half" else torch.float32
        args, kwargs = o1_casts.cast_arguments(state, dtype, kind == "half", args, kwargs)
        return fn(*args, **kwargs)

    wrapper.__ampkit_cast__ = kind
    return wrapper


def half_function(fn: Callable) -> Callable:
    """Decorator: under O1, call ``fn`` with floating tensors cast to the low-precision dtype."""
    return _decorate(fn, "half")


def float_function(fn: Callable) -> Callable:
    """Decorator: under O1, call ``fn`` with floating tensors cast to float32."""
    return _decorate(fn, "float")


def promote_function(fn: Callable) -> Callable:
    """Decorator: under O1, call ``fn`` in float32 when its arguments mix a low dtype with float32."""
    return _decorate(fn, "promote")


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Turn O1's casts off inside the block (Apex's ``amp.disable_casts``)."""
    handle = _amp_state.active_handle
    if handle is None:
        yield
        return
    with handle._disable_casts():
        yield
