"""The numbers Apex's extension functions took through pybind11, checked by name before anything runs.

A ``float`` argument took any real number (numpy's, a bool, a one-element tensor), an ``int`` one an integer (a
bool, numpy's, a one-element integer tensor); a string, None or a float for an ``int`` was pybind11's
"incompatible function arguments". The shim's functions, annotated with Apex's types, took a string through
``float()`` as a number, and handed None or a many-element tensor to a kernel's schema, a multi-line error.
"""

from __future__ import annotations

import functools
import inspect
import numbers
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
from torch import Tensor

from ampkit.ops._errors import ArgumentTypeError
from ampkit.wording import shown

F = TypeVar("F", bound=Callable[..., Any])


def _is_float(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.numel() == 1 and not value.is_complex()
    return isinstance(value, numbers.Real | np.bool_)


def _is_int(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.numel() == 1 and not value.is_floating_point() and not value.is_complex()
    return isinstance(value, numbers.Integral | np.bool_)


_CHECKS = {"float": (_is_float, "a number"), "int": (_is_int, "an integer")}
# Apex's on/off ints: the functions check them as switches (True, False, 0 or 1), whose message says so.
_SWITCHES = frozenset({"bias_correction", "grad_averaging"})


def check_number(owner: str, name: str, value: Any, kind: str = "float") -> None:
    """Raise an :class:`ArgumentTypeError` naming ``owner``'s ``name`` unless ``value`` is what Apex's binding took for
    an argument of C++ type ``kind`` (``"float"`` or ``"int"``)."""
    accepts, expected = _CHECKS[kind]
    if not accepts(value):
        raise ArgumentTypeError(
            f"{owner}: {name} must be {expected}, as Apex's binding took it; got {shown(value)} (a "
            f"{type(value).__name__})"
        )


def pybind_numbers(module: str) -> Callable[[F], F]:
    """A decorator: each argument of the function annotated ``float`` or ``int`` checked as Apex's binding checked it,
    a bool given for a ``float`` taken as 1.0 or 0.0 as pybind11 took it; anything else is an
    :class:`ArgumentTypeError` (a TypeError, as pybind11's, and a ValueError) naming ``module.function`` and the
    argument."""

    def decorate(func: F) -> F:
        checked = [
            (index, name, param.annotation)
            for index, (name, param) in enumerate(inspect.signature(func).parameters.items())
            if param.annotation in _CHECKS and name not in _SWITCHES
        ]

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for index, name, kind in checked:
                positional = index < len(args)
                if not positional and name not in kwargs:
                    continue
                value = args[index] if positional else kwargs[name]
                check_number(f"{module}.{func.__name__}", name, value, kind)
                if kind == "float" and isinstance(value, bool | np.bool_):
                    if positional:
                        args = (*args[:index], float(value), *args[index + 1 :])
                    else:
                        kwargs[name] = float(value)
            return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
