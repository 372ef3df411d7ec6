"""``apex.multi_tensor_apply``: ``multi_tensor_applier(op, noop_flag, tensor_lists, *args)`` calls an ``amp_C`` op.

Apex's applier only forwarded its chunk size to the CUDA extension; here the ops are ampkit's kernels
(:mod:`ampkit.compat.amp_c`), available on CPU and CUDA, so ``available`` is always True.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from ampkit.wording import shown

__all__ = ["MultiTensorApply", "multi_tensor_applier"]


class MultiTensorApply:
    """Calls ``op(chunk_size, noop_flag, tensor_lists, *args)``, Apex's calling convention for ``amp_C`` ops."""

    available = True
    warned = False

    def __init__(self, chunk_size: int) -> None:
        if not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int; got {shown(chunk_size)}")
        self.chunk_size = chunk_size

    def check_avail(self) -> None:
        """Apex raised here when its CUDA extension was missing; ampkit's kernels are always there."""

    def __call__(
        self, op: Callable[..., Any], noop_flag_buffer: Tensor, tensor_lists: Sequence[Sequence[Tensor]], *args: Any
    ) -> Any:
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(2048 * 32)
