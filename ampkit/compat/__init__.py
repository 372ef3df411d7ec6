"""Apex-compatible API on ampkit's engine: ``amp``, ``fp16_utils``, ``parallel``, ``optimizers``,
``normalization``, ``mlp``, ``fused_dense``, ``multi_tensor_apply`` (its ops in ``amp_c``, Apex's ``amp_C``), and
:func:`install_apex_shim` so that ``import apex`` resolves here.

Submodules load on first touch, so ``import ampkit.compat`` is cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from ampkit.compat.shim import install_apex_shim, uninstall_apex_shim

_SUBMODULES = (
    "amp",
    "fp16_utils",
    "parallel",
    "optimizers",
    "normalization",
    "multi_tensor_apply",
    "mlp",
    "fused_dense",
)
__all__ = [*_SUBMODULES, "install_apex_shim", "uninstall_apex_shim"]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
