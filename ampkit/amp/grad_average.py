"""Averaging gradients over the ranks where some ranks have none: the Trainer's own gradient sync
(``grad_sync: step``) and the Apex API's after a DDP ``no_sync`` block both need buffers that line up."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


@torch.no_grad()
def average_grads(tensors: Sequence[torch.Tensor], world_size: int, all_reduce: Callable[[torch.Tensor], None]) -> None:
    """Average the ``.grad`` of ``tensors`` (the same list, in the same order, on every rank) over the ranks.

    A rank without a gradient for one (a layer only some ranks' batches reach) sends zeros in its place, so the
    ranks' buffers line up, with a count of the ranks that had one: a tensor no rank reached keeps no gradient,
    one some reached gets the average on every rank, as DDP gives it. ``all_reduce(flat)`` sums ``flat`` over the
    ranks in place, once per device and dtype. The counts are read back only on a rank that lacks a gradient, so
    the common step reads nothing back.
    """
    if not tensors:
        return
    fillers = {id(t): torch.zeros_like(t) for t in tensors if t.grad is None}
    grads = [fillers[id(t)] if id(t) in fillers else t.grad for t in tensors]
    # Filled on the device: a list copied there (torch.tensor(..., device=cuda)) makes torch wait for the GPU.
    held = torch.ones(len(tensors), device=tensors[0].device)
    for index, t in enumerate(tensors):
        if id(t) in fillers:
            held[index] = 0.0

    def average(flat: torch.Tensor) -> None:
        all_reduce(flat)
        flat.div_(world_size)

    through_flat_buffers_((*grads, held), average)
    if fillers:
        for t, reached in zip(tensors, held.tolist(), strict=True):
            if id(t) in fillers and reached > 0:
                t.grad = fillers[id(t)]


@torch.no_grad()
def through_flat_buffers_(tensors: Sequence[torch.Tensor], fn: Callable[[torch.Tensor], None]) -> None:
    """Run the in-place ``fn(flat)`` (a collective) once per device and dtype over ``tensors`` flattened together, and
    write the results back: a model on two devices (model parallel, or parts offloaded to the CPU) has tensors that
    one buffer cannot hold, nor one collective take."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    for group in groups.values():
        flat = _flatten_dense_tensors(group)
        fn(flat)
        for tensor, synced in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
            tensor.copy_(synced)
