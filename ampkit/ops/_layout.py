"""Memory layout questions the ops ask of a tensor: dense or not, sharded (FSDP2's DTensor) or not."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from itertools import pairwise

from torch import Tensor


def dtensor_type() -> type | None:
    """DTensor's class where something loaded it (FSDP2, tensor parallel), else None. Looked up, not imported: it is
    loaded by whoever made DTensors, and importing it costs every other run a noticeable start-up time."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def local_shard(t: Tensor) -> Tensor:
    """A DTensor as this rank's shard (its storage: an in-place op writes the DTensor); a plain tensor as it is."""
    return getattr(t, "_local_tensor", t)


def local_shards(tensors: list[Tensor]) -> list[Tensor]:
    """Each DTensor among ``tensors`` as this rank's shard (:func:`local_shard`)."""
    if dtensor_type() is None:
        return tensors
    return [local_shard(t) for t in tensors]


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


def rows_are_blocks(t: Tensor) -> bool:
    """Whether each index of ``t``'s first dimension covers one gap-free block of a dense ``t``'s memory (contiguous,
    channels-last; not a transpose): kernels that reduce over a weight's rows by reading memory blocks need it."""
    if t.dim() < 2 or t.size(0) <= 1 or t.numel() == 0:
        return True
    return t.stride(0) == t.numel() // t.size(0)


def shares_memory(a: Tensor, b: Tensor) -> bool:
    """Whether dense ``a`` and ``b`` hold a byte in common, as ``at::get_overlap_status`` judges it (one storage, byte
    ranges that meet); tensors it cannot judge (not dense) and empty ones count as apart, as there."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or not (is_dense(a) and is_dense(b)):
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    return a.data_ptr() < b.data_ptr() + b.numel() * b.element_size() and b.data_ptr() < a.data_ptr() + a.nbytes


def first_overlap(tensors: Sequence[Tensor]) -> tuple[int, int] | None:
    """Indices ``(i, j)``, ``i < j``, of two of ``tensors`` (dense ones) whose memory overlaps, or None. Sorted by
    address, each compared with the next: if any two overlap, two neighbours do. Empty tensors hold no memory."""
    spans = sorted(
        (str(t.device), t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i)
        for i, t in enumerate(tensors)
        if t.numel()
    )
    for (device, _, end, i), (next_device, next_begin, _, j) in pairwise(spans):
        if device == next_device and next_begin < end:
            return min(i, j), max(i, j)
    return None
