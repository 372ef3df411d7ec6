"""Order callbacks by the phase they serve (no names, no integer priorities of their own)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ampkit.trainer.callback import Callback
from ampkit.trainer.user_code import UserCodeError


class CallbackOrderError(ValueError):
    """Callbacks cannot run together: two share a ``state_key`` (checkpoints could not tell their states apart), or
    two would write the same files (two ``ModelCheckpoint`` ranking best checkpoints)."""


def order_callbacks(callbacks: Sequence[Callback]) -> list[Callback]:
    """Sort ``callbacks`` by :class:`~ampkit.trainer.callback.Phase`, those that save checkpoints last in theirs; ties
    keep the given order.

    Each ``state_key`` must be unique: a checkpoint keeps callbacks' states by it, so a shared one saved only the last.
    """
    for i, cb in enumerate(callbacks):  # not a state_key clash to fix: one object, whose hooks would run twice
        if any(other is cb for other in callbacks[:i]):
            raise CallbackOrderError(
                f"the same {type(cb).__name__} object is given twice (in Trainer(callbacks=...), "
                "configure_callbacks() or both): its hooks would run twice at every point; give it once"
            )
    keys = [cb.state_key for cb in callbacks]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        owners = sorted({type(cb).__name__ for cb in callbacks if cb.state_key in duplicates})
        raise CallbackOrderError(
            f"callback state_key must be unique, got duplicates: {duplicates} (from {', '.join(owners)}); a checkpoint "
            "could not tell their states apart: give each its own state_key property, e.g. f'{type(self).__name__}"
            "[{self.monitor}]'"
        )
    return sorted(callbacks, key=lambda cb: (cb.phase, cb.saves_checkpoints))


def callback_list(value: Any, where: str) -> list[Callback]:
    """``value`` as a list of callback instances (None: none; one callback: itself), or a one-line error at ``where``.

    Raises:
        UserCodeError: a Callback class instead of an instance, or something that is no Callback.
    """
    if value is None:
        return []
    if isinstance(value, Mapping):  # iterating it would name its keys
        raise UserCodeError(
            f"{where} is a {type(value).__name__} (keys {list(value)[:5]}); expected a Callback instance or a list of "
            "them (a dict's callbacks: list(d.values()))"
        )
    if isinstance(value, str | bytes):  # iterating it would name its characters
        raise UserCodeError(
            f"{where} is the {type(value).__name__} {value[:40]!r}; expected a Callback instance or a list of them"
        )
    items = [value] if isinstance(value, Callback) or not isinstance(value, Iterable) else list(value)
    for i, item in enumerate(items):
        at = where if items[0] is value else f"{where}[{i}]"
        if isinstance(item, type) and issubclass(item, Callback):
            raise UserCodeError(f"{at} is the class {item.__name__}; pass an instance: {item.__name__}()")
        if not isinstance(item, Callback):
            raise UserCodeError(f"{at} is {type(item).__name__}; expected an ampkit.Callback instance")
    return items
