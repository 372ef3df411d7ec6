"""Apex's flat collectives of ``apex.parallel.distributed``: one collective per tensor type over a flattened
copy (``flat_dist_call``), which NVIDIA's BERT pretraining and protein (TAPE) scripts import to broadcast
rank 0's parameters before training.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ampkit.compat.apex_c import flatten, unflatten

__all__ = [
    "apply_flat_dist_call",
    "extract_tensors",
    "flat_dist_call",
    "flatten",
    "split_by_type",
    "split_half_float_double",
    "unflatten",
]


def apply_flat_dist_call(
    bucket: Sequence[torch.Tensor], call: Callable[..., Any], extra_args: Sequence[Any] | None = None
) -> None:
    """``call(flat, *extra_args)`` on one flat copy of ``bucket`` (tensors of one type), copied back after;
    an ``all_reduce`` is averaged over the world, as in Apex."""
    coalesced = flatten(bucket)
    call(coalesced, *(extra_args or ()))
    if call is dist.all_reduce:
        coalesced /= dist.get_world_size()
    for tensor, synced in zip(bucket, unflatten(coalesced, bucket), strict=True):
        tensor.copy_(synced)


def split_half_float_double(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors in buckets of float16, float32 and float64, in that order, empty buckets left out (Apex
    matched CUDA type names, so it never bucketed CPU tensors; here the dtype decides on any device)."""
    buckets = [[t for t in tensors if t.dtype == dtype] for dtype in (torch.float16, torch.float32, torch.float64)]
    return [bucket for bucket in buckets if bucket]


def split_by_type(tensors: Sequence[torch.Tensor]) -> OrderedDict[str, list[torch.Tensor]]:
    """The tensors grouped by ``tensor.type()`` (``"torch.cuda.HalfTensor"``, ``"torch.FloatTensor"``, ...)."""
    buckets: OrderedDict[str, list[torch.Tensor]] = OrderedDict()
    for tensor in tensors:
        buckets.setdefault(tensor.type(), []).append(tensor)
    return buckets


def flat_dist_call(
    tensors: Sequence[torch.Tensor], call: Callable[..., Any], extra_args: Sequence[Any] | None = None
) -> None:
    """:func:`apply_flat_dist_call` once per tensor type, e.g. ``flat_dist_call([p.data for p in
    model.parameters()], torch.distributed.broadcast, (0,))`` to start every rank from rank 0's weights."""
    for bucket in split_by_type(tensors).values():
        apply_flat_dist_call(bucket, call, extra_args)


def extract_tensors(maybe_tensor: Any, tensor_list: list[torch.Tensor]) -> None:
    """Append every tensor found in ``maybe_tensor`` (a tensor or nested iterables of them) to ``tensor_list``."""
    if torch.is_tensor(maybe_tensor):
        tensor_list.append(maybe_tensor)
        return
    if isinstance(maybe_tensor, str | bytes):  # iterating a one-character string never ends
        return
    try:
        items = iter(maybe_tensor)
    except TypeError:
        return
    for item in items:
        extract_tensors(item, tensor_list)
