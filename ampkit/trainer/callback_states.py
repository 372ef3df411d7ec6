"""Which saved state each callback of a resumed run loads: the one under its ``state_key``, or for a callback whose key
names what it watches (``EarlyStopping[val/loss]``) the state its class saved under another key."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ampkit.trainer.callback import Callback


def states_to_load(callbacks: Sequence[Callback], saved: Mapping[str, Any]) -> list[tuple[Callback, str]]:
    """``(callback, key)`` for each callback with a state among ``saved``: the one under its ``state_key``; else, for
    a class with ``state_key_may_change``, a state of its class (under its class name, as an older ampkit keyed it,
    or ``Name[other metric]`` before a resume changed the metric) that no callback is keyed by. It goes to the only
    callback of the class lacking a state, or among several to the one watching the metric the state records; its
    ``load_state_dict`` then decides what still holds (a changed metric's values count nothing)."""
    found = [(cb, cb.state_key) for cb in callbacks if cb.state_key in saved]
    claimed = {key for _, key in found}
    lacking = [cb for cb in callbacks if cb.state_key not in saved and cb.state_key_may_change]
    for name in dict.fromkeys(_keyed_by(cb) for cb in lacking):
        candidates = [cb for cb in lacking if _keyed_by(cb) == name]
        own = {type(cb).__name__ for cb in candidates}  # an older ampkit keyed a subclass by its own name alone
        keys = [key for key in saved if key not in claimed and (key in {name, *own} or key.startswith(f"{name}["))]
        for key in keys:
            fits = (
                candidates
                if len(candidates) == 1 == len(keys)
                else [cb for cb in candidates if _watched(cb, saved[key])]
            )
            if len(fits) == 1:
                found.append((fits[0], key))
                candidates.remove(fits[0])
    return found


def _keyed_by(callback: Callback) -> str:
    """The class name ``callback``'s state is keyed by: ``ModelCheckpoint`` for ``ModelCheckpoint[val/loss]``, also
    for a subclass of it, which is keyed (and saved) as the class it extends."""
    return callback.state_key.partition("[")[0]


def _watched(callback: Callback, state: Any) -> bool:
    """Whether ``callback`` watches the metric ``state`` records (its ``monitor`` entry; None for none)."""
    measured = state.get("monitor") if isinstance(state, Mapping) else None
    return str(getattr(callback, "monitor", None)) == str(measured)
