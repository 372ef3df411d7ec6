"""Barriers that say whom they wait for. At ampkit's own barriers (a sharded save's and resume's, the end of a
preempted run's save) rank zero, once it has waited :data:`SAY_AFTER_S` there, names the ranks that have not come yet,
once: a rank that died or hangs otherwise shows nothing until ``distributed.timeout_s`` (300 s by default) fails the
run.

Each rank counts its arrivals in the group's store (``store.add``), so the count starts afresh with each process
group, and a rank whose count is behind rank zero's has not come to this barrier.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from ampkit.trainer.console import say

SAY_AFTER_S = 10.0  # how long rank zero waits at a barrier before it names the ranks not there yet


def barrier(what: str) -> None:
    """``dist.barrier()`` (nothing without a process group); rank zero names the ranks it still waits for at
    ``what`` (``the save of step-00000006``) after :data:`SAY_AFTER_S` seconds."""
    if not dist.is_initialized():
        return
    if dist.get_world_size() == 1:
        dist.barrier()
        return
    store, rank = dist.distributed_c10d._get_default_store(), dist.get_rank()
    arrivals = store.add(f"ampkit/barriers/{rank}", 1)
    work = dist.barrier(async_op=True)
    if rank == 0:
        _say_who_is_late(work, store, arrivals, what)
    work.wait()


def _say_who_is_late(work: dist.Work, store: dist.Store, arrivals: int, what: str) -> None:
    """Wait up to :data:`SAY_AFTER_S` for ``work``; then print once which ranks have not counted ``arrivals``."""
    deadline = time.monotonic() + SAY_AFTER_S
    while not work.is_completed():
        if time.monotonic() >= deadline:
            try:
                late = [r for r in range(1, dist.get_world_size()) if store.add(f"ampkit/barriers/{r}", 0) < arrivals]
            except Exception:  # the store is unreachable: the barrier's own error will say more
                return
            if late:
                say(
                    f"ampkit: rank 0 has waited {SAY_AFTER_S:g} s at {what} for rank(s) {', '.join(map(str, late))}; "
                    "a rank that died or hangs there stops the run after distributed.timeout_s (its own output says "
                    "why)"
                )
            return
        time.sleep(0.01)
