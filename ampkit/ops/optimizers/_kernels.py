"""The ``ampkit_optimizers`` op family: compiled kernel on CPU tensors, pure-PyTorch reference otherwise."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ampkit.ops._build import CSRC_DIR, register_family
from ampkit.ops.environment import cuda_kernels
from ampkit.ops.reference import optimizers as reference

_CPU_SOURCES = [
    CSRC_DIR / "optimizers" / name
    for name in (
        "optimizers_cpu.cpp",  # op schemas, Adam/AdamW, SGD
        "adaptive_cpu.cpp",  # Adagrad, Adadelta, RMSprop, RMSpropTF
        "lamb_cpu.cpp",  # LAMB stages, NovoGrad
        "adamp_cpu.cpp",  # AdamP
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

# Ops whose CUDA kernel no GPU run has checked yet: on CUDA they run their reference (torch ops on the device,
# with no host read) unless AMPKIT_CUDA_KERNELS=multi_tensor opts into the unchecked kernels.
UNCHECKED_ON_CUDA = frozenset({"adamp_step"})

FAMILY = register_family("ampkit_optimizers", sources=_CPU_SOURCES, cuda_sources=_CUDA_SOURCES)


def op(name: str, device: torch.device) -> Callable[..., object]:
    """The op ``name`` for tensors on ``device``: the C++/CUDA kernel when built for it, else the reference.

    CUDA kernels join the build only where torch sees a GPU and nvcc at build time; without them CUDA
    tensors use the reference (an error under ``AMPKIT_OPS=kernel``). ``UNCHECKED_ON_CUDA`` ops use it on CUDA
    too unless opted in.
    """
    if device.type == "cuda" and name in UNCHECKED_ON_CUDA and cuda_kernels() != "multi_tensor":
        return getattr(reference, name)
    if FAMILY.serves(device, name):
        return getattr(torch.ops.ampkit_optimizers, name)
    return getattr(reference, name)
