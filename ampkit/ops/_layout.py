"""Memory layout questions the ops ask of a tensor."""

from __future__ import annotations

from torch import Tensor


def is_dense(t: Tensor) -> bool:
    """Whether ``t`` covers one gap-free block of memory, each element once, in some dimension order (contiguous,
    channels-last, a transpose): what kernels that run over a tensor's memory, not its indices, need."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape, strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True
