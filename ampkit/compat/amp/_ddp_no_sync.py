"""torch's ``DistributedDataParallel.no_sync()`` under amp: gradients a ``no_sync`` backward left rank-local are
averaged across the ranks before the next scaled backward outside ``no_sync`` takes them out of ``.grad``.

``amp.scale_loss`` moves the gradients that exist out of ``.grad`` before each backward (loss scaling, O2's fp32
masters) and adds them back after it. Accumulating under torch's DDP with ``no_sync()`` around the first
micro-batches (Lightning's ``accumulate_grad_batches``, ClassyVision's ``simulated_global_batchsize``), the synced
backward then averages only its own micro-batch, each rank adds its own earlier ones back, and the ranks drift apart:
they did under Apex too. Averaging what ``no_sync`` left first makes the sum the average over every rank's
micro-batches, which is what DDP without amp computes.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ampkit.amp.grad_average import average_grads
from ampkit.amp.grad_combine import read_flags
from ampkit.compat.amp._amp_state import _amp_state

if TYPE_CHECKING:
    from ampkit.compat.amp._optimizer_stash import AmpOptimizerStash

_DDP = torch.nn.parallel.DistributedDataParallel
_torch_no_sync = _DDP.no_sync
_left_local: weakref.WeakSet[Any] = weakref.WeakSet()  # DDPs whose no_sync backwards kept their gradients local
_open_blocks = 0  # no_sync blocks entered and not yet left (a scaled backward inside one stays local)


@contextlib.contextmanager
def _no_sync(self: Any) -> Iterator[None]:
    global _open_blocks
    if not _amp_state.gradients_leave_params:
        with _torch_no_sync(self):
            yield
        return
    _open_blocks += 1
    try:
        with _torch_no_sync(self):
            yield
    finally:
        _open_blocks -= 1
        _left_local.add(self)


_no_sync.__doc__ = _torch_no_sync.__doc__


def install() -> None:
    """Route torch's ``DistributedDataParallel.no_sync`` through :func:`_no_sync` (once; amp.initialize calls it)."""
    if _DDP.no_sync is _torch_no_sync:
        _DDP.no_sync = _no_sync


@torch.no_grad()
def average_local_gradients(stashes: Sequence[AmpOptimizerStash]) -> bool:
    """Before a scaled backward outside ``no_sync``: average, over each such DDP's process group, the gradients its
    ``no_sync`` backwards accumulated that these optimizers are about to stash (the fp32 masters' under O2).

    Returns True when an inf or nan reached this rank's gradients from another rank only: this backward then counts
    as an overflow here, as it would have had the backward that made it been all-reduced (the rank that made it has
    already backed off and skips). Every rank of the group makes the same calls, in the order of the module's
    parameters (:func:`~ampkit.amp.grad_average.average_grads`): a parameter whose gradient exists on some ranks
    only gets the average on all of them, as DDP gives an unused one.
    """
    if _open_blocks or not _left_local:
        return False
    holders: dict[int, torch.Tensor] = {}  # id(model parameter) -> the tensor whose .grad the stash will take
    for stash in stashes:
        if stash.combiner.pending:  # a delay_unscale backward left them in .grad: the next one reduces them whole
            continue
        for param, owner in zip(stash.combiner.params, stash.combiner.grad_owners, strict=True):
            holders[id(param)] = owner
    ddps = list(_left_local)
    _left_local.clear()
    inherited_inf = False
    for ddp in ddps:
        mine = [holders[id(p)] for p in ddp.module.parameters() if id(p) in holders]
        if mine:
            inherited_inf |= _average_grads(mine, ddp.process_group)
    return inherited_inf


def _average_grads(tensors: list[torch.Tensor], group: Any) -> bool:
    """Average the ``.grad`` of ``tensors`` over ``group``; True if that brought in a non-finite value this rank had
    not."""
    finite_before = [torch.isfinite(t.grad).all() for t in tensors if t.grad is not None]
    average_grads(tensors, dist.get_world_size(group), lambda flat: dist.all_reduce(flat, group=group))
    finite_after = [torch.isfinite(t.grad).all() for t in tensors if t.grad is not None]
    finite = read_flags([*finite_before, *finite_after])  # one transfer: a bool() each was a GPU sync each
    return all(finite[: len(finite_before)]) and not all(finite[len(finite_before) :])
