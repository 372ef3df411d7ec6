"""The environment variables that steer ampkit's fused ops, checked together: a misspelt value fails where a run
starts, naming the variable and its valid values, not at the first fused op mid-epoch, nor never (a CUDA-only
choice read on a CPU machine, where no op asks for it)."""

from __future__ import annotations

import os

from ampkit.ops._backend import ENV_VAR as FUSED_BACKEND_VAR
from ampkit.ops._backend import resolve_backend
from ampkit.ops._build import ops_mode
from ampkit.wording import shown

CUDA_KERNELS_VAR = "AMPKIT_CUDA_KERNELS"
CUDA_KERNELS = ("per_tensor", "multi_tensor")


def cuda_kernels() -> str:
    """``AMPKIT_CUDA_KERNELS`` as the C++ ops read it (``per_tensor`` when unset or empty); a ValueError naming any
    other value, as those ops raise one, rather than Python's choice silently taking it as the default."""
    value = os.environ.get(CUDA_KERNELS_VAR) or "per_tensor"
    if value not in CUDA_KERNELS:
        raise ValueError(
            f"{CUDA_KERNELS_VAR}={shown(value)} is not valid; use per_tensor (the default) or multi_tensor"
        )
    return value


def environment_problems() -> list[str]:
    """What is wrong with ``AMPKIT_OPS``, ``AMPKIT_FUSED_BACKEND`` and ``AMPKIT_CUDA_KERNELS`` (each as its reader
    words it); empty when all three are usable."""
    problems = []
    for check in (ops_mode, lambda: resolve_backend(None, FUSED_BACKEND_VAR), cuda_kernels):
        try:
            check()
        except ValueError as exc:
            problems.append(str(exc))
    return problems
