"""Callbacks that take part in collectives must be given on every rank: one on rank 0 alone (Lightning's
``callbacks=[ModelCheckpoint()] if rank == 0 else []``) would wait in its first collective for ranks that never join
it, until ``distributed.timeout_s``. Checked once, when a run sets its callbacks up, before any of them runs.

Callbacks are matched by the class whose collectives they take (:func:`collective_role`), not by name: a subclass of
``ModelCheckpoint`` on one rank lines up with a ``ModelCheckpoint`` (or another subclass of it) on the others. A class
is known by its module and qualified name: two unrelated classes that share a name (a user's ``ModelCheckpoint``) take
different collectives, so they do not match."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ampkit.trainer.callback import Callback
from ampkit.trainer.distributed import DistributedEnv, gather_object


class CallbacksDifferAcrossRanksError(ValueError):
    """Ranks set up different callbacks among those that take part in collectives."""


def collective_role(callback: Callback) -> str:
    """The module and qualified name of the class whose collectives ``callback`` takes: the nearest class in its line
    that says ``takes_part_in_collectives = True`` in its own body (``ModelCheckpoint`` for a subclass that only renames
    or extends it; the subclass itself where it says so again, as one that joins collectives of its own does)."""
    line = type(callback).__mro__  # an instance that sets the flag itself is matched by its own class
    role = next((k for k in line if k.__dict__.get("takes_part_in_collectives")), type(callback))
    return f"{role.__module__}.{role.__qualname__}"


def _short(role: str) -> str:
    """A role's class name, as messages give it (its qualified name's last part)."""
    return role.rsplit(".", 1)[-1]


def collective_callback_kinds(callbacks: Sequence[Callback]) -> list[tuple[str, str]]:
    """``(role, name)`` of each of ``callbacks`` whose hooks join collectives (``takes_part_in_collectives``), sorted:
    the role (:func:`collective_role`) is what must match across ranks, the name says which class a rank gave."""
    return sorted((collective_role(cb), cb.name) for cb in callbacks if cb.takes_part_in_collectives)


def check_collective_callbacks_on_every_rank(callbacks: Sequence[Callback], env: DistributedEnv) -> None:
    """Raise on every rank, naming each callback and the ranks that lack it, unless every rank has as many callbacks of
    each collective role (one all_gather_object of their roles and names; nothing on one process)."""
    if not env.enabled:
        return
    gathered = gather_object(collective_callback_kinds(callbacks), env)
    counts = [Counter(role for role, _ in kinds) for kinds in gathered]
    roles = sorted(set().union(*counts), key=lambda role: (_short(role), role))
    shorts = Counter(_short(role) for role in roles)
    lacking = []
    for role in roles:
        most = max(count[role] for count in counts)
        short = [rank for rank, count in enumerate(counts) if count[role] < most]
        if short:
            having = [rank for rank, count in enumerate(counts) if count[role] == most]
            label = _short(role)  # in full where an unrelated class of that name is among them too
            label = label if shorts[label] == 1 else role
            named = sorted({name for rank in having for kind, name in gathered[rank] if kind == role} - {_short(role)})
            given = label + (f" (as {', '.join(named)})" if named else "")
            times, fewer = (f" {most} times", "fewer times") if most > 1 else ("", "not")
            lacking.append(f"{given} is given{times} on {_listed(having)} but {fewer} on {_listed(short)}")
    if lacking:
        raise CallbacksDifferAcrossRanksError(
            f"{'; '.join(lacking)}: these callbacks take part in collectives (a checkpoint's save, a monitored value "
            "agreed across ranks), so one given on some ranks only would wait for the others until "
            "distributed.timeout_s. Give it on every rank (Trainer(callbacks=...) or configure_callbacks() the same "
            "everywhere; a subclass counts as the class it extends), and guard work of your own that only one rank "
            "should do with trainer.is_global_zero"
        )


def _listed(ranks: list[int]) -> str:
    return "rank(s) " + ", ".join(str(rank) for rank in ranks)
