"""Callbacks that take part in collectives must be given on every rank: one on rank 0 alone (Lightning's
``callbacks=[ModelCheckpoint()] if rank == 0 else []``) would wait in its first collective for ranks that never join
it, until ``distributed.timeout_s``. Checked once, when a run sets its callbacks up, before any of them runs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ampkit.trainer.callback import Callback
from ampkit.trainer.distributed import DistributedEnv, gather_object


class CallbacksDifferAcrossRanksError(ValueError):
    """Ranks set up different callbacks among those that take part in collectives."""


def collective_callback_kinds(callbacks: Sequence[Callback]) -> list[str]:
    """The names of ``callbacks`` whose hooks join collectives (``takes_part_in_collectives``), sorted."""
    return sorted(cb.name for cb in callbacks if cb.takes_part_in_collectives)


def check_collective_callbacks_on_every_rank(callbacks: Sequence[Callback], env: DistributedEnv) -> None:
    """Raise on every rank, naming each callback and the ranks that lack it, unless every rank has the same callbacks
    among those that take part in collectives (one all_gather_object of their names; nothing on one process)."""
    if not env.enabled:
        return
    counts = [Counter(kinds) for kinds in gather_object(collective_callback_kinds(callbacks), env)]
    lacking = []
    for name in sorted(set().union(*counts)):
        most = max(count[name] for count in counts)
        ranks = [rank for rank, count in enumerate(counts) if count[name] < most]
        if ranks:
            having = _listed([rank for rank, count in enumerate(counts) if count[name] == most])
            given = f"{name} is given on rank(s) {having} but not on rank(s) {_listed(ranks)}"
            if most > 1:
                given = f"{name} is given {most} times on rank(s) {having} but fewer times on rank(s) {_listed(ranks)}"
            lacking.append(given)
    if lacking:
        raise CallbacksDifferAcrossRanksError(
            f"{'; '.join(lacking)}: these callbacks take part in collectives (a checkpoint's save, a monitored value "
            "agreed across ranks), so one given on some ranks only would wait for the others until "
            "distributed.timeout_s. Give it on every rank (Trainer(callbacks=...) or configure_callbacks() the same "
            "everywhere), and guard work of your own that only one rank should do with trainer.is_global_zero"
        )


def _listed(ranks: list[int]) -> str:
    return ", ".join(str(rank) for rank in ranks)
