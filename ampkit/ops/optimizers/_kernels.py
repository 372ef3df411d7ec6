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

_CUDA_SOURCES = [
    CSRC_DIR / "optimizers" / name
    for name in (
        "optimizers_cuda.cpp",  # checks and dispatch (AMPKIT_CUDA_KERNELS picks the kernels below)
        "optimizers_kernels.cu",  # one launch per tensor
        "optimizers_multi_tensor.cu",  # one launch per planned block of tensors
    )
]

FAMILY = register_family("ampkit_optimizers", sources=_CPU_SOURCES, cuda_sources=_CUDA_SOURCES)


def op(name: str, device: torch.device) -> Callable[..., object]:
    """The op ``name`` for tensors on ``device``: the C++/CUDA kernel when built for it, else the reference.

    CUDA kernels join the build only where torch sees a GPU and nvcc at build time; without them CUDA
    tensors use the reference (an error under ``AMPKIT_OPS=kernel``).
    """
    if FAMILY.serves(device, name):
        return getattr(torch.ops.ampkit_optimizers, name)
    return getattr(reference, name)
