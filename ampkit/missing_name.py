"""The error a module's ``__getattr__`` raises for a name it lacks (a served Apex module's, a Lightning callback's),
kept under ``from module import name``."""

from __future__ import annotations

import dis
import sys

_IMPORT_FROM = dis.opmap["IMPORT_FROM"]


def missing_name(message: str, module: str, name: str, submodule: bool = False) -> AttributeError | ImportError:
    """An AttributeError with ``message``, or an ImportError with it where the caller of ``__getattr__`` runs
    ``from module import name``: Python replaces an AttributeError there with a bare 'cannot import name'.

    ``submodule``: ``name`` is a module of the package that is not served; the ImportError is then that module's
    ModuleNotFoundError. Attribute access still gets an AttributeError, so ``hasattr`` and ``getattr(..., None)``
    answer (no class can be both: their instance layouts conflict)."""
    try:
        caller = sys._getframe(2)  # 0: here, 1: the module's __getattr__, 2: the code that asked for the name
    except ValueError:  # asked from C with no Python frame above
        caller = None
    if caller is not None and caller.f_code.co_code[caller.f_lasti] == _IMPORT_FROM:
        return ModuleNotFoundError(message, name=f"{module}.{name}") if submodule else ImportError(message, name=module)
    return AttributeError(message, name=name)
