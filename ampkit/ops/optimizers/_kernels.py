"""The ``ampkit_optimizers`` op family: compiled kernel on CPU tensors, pure-PyTorch reference otherwise."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ampkit.ops._build import CSRC_DIR, register_family
from ampkit.ops.reference import optimizers as reference

_CPU_SOURCES = [
    CSRC_DIR / "optimizers" / name
    for name in (
        "optimizers_cpu.cpp",  # op schemas, Adam/AdamW, SGD
        "adaptive_cpu.cpp",  # Adagrad, Adadelta, RMSprop, RMSpropTF
        "lamb_cpu.cpp",  # LAMB stages, NovoGrad
    )
]

FAMILY = register_family("ampkit_optimizers", sources=_CPU_SOURCES)


def op(name: str, device: torch.device) -> Callable[..., object]:
    """The op ``name`` for tensors on ``device``: the C++ kernel on CPU when it builds, else the reference.

    The CUDA sources compile in CI but are not linked into this CPU build, so GPU tensors use the reference.
    """
    if device.type == "cpu" and FAMILY.use_kernel():
        return getattr(torch.ops.ampkit_optimizers, name)
    return getattr(reference, name)
