"""Order callbacks by the phase they serve (no names, no integer priorities of their own)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ampkit.trainer.callback import Callback, run_order
from ampkit.trainer.user_code import UserCodeError
from ampkit.wording import type_of

FROM_CONFIG = "the config"  # a built-in callback's source in order_callbacks: this, or "the config's <key>"


class CallbackOrderError(ValueError):
    """Callbacks cannot run together: two share a ``state_key`` (checkpoints could not tell their states apart), or
    two would write the same files (two ``ModelCheckpoint`` ranking best checkpoints, or keeping step files by other
    settings)."""


def order_callbacks(callbacks: Sequence[Callback], sources: Sequence[str] | None = None) -> list[Callback]:
    """Sort ``callbacks`` by :class:`~ampkit.trainer.callback.Phase` (:func:`~ampkit.trainer.callback.run_order`: those
    reading logged values after the others of their phase, those that save checkpoints last); ties keep the given order.

    Each ``state_key`` must be unique: a checkpoint keeps callbacks' states by it, so a shared one saved only the last.
    ``sources`` says where each callback came from (``"configure_callbacks()"``, ``"the config's
    early_stopping.monitor"``), for the error naming two that clash.
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
        clashing = [i for i, key in enumerate(keys) if key in duplicates]
        if sources is None:
            owners = ", ".join(sorted({type(callbacks[i]).__name__ for i in clashing}))
        else:
            owners = ", ".join(f"{type(callbacks[i]).__name__} of {sources[i]}" for i in clashing)
        origins = {sources[i] for i in clashing} if sources is not None else set()
        built_in = sorted(origin for origin in origins if origin.startswith(FROM_CONFIG))
        if built_in:
            advice = "keep one: leave it out of the code" + (
                "" if built_in[0] == FROM_CONFIG else f" or switch off {built_in[0]}"
            )
        else:
            advice = "give each its own state_key property, e.g. f'{type(self).__name__}[{self.monitor}]'"
        # Lightning drops the Trainer's callbacks of a type configure_callbacks() returns; ampkit runs every callback
        # it is given, so a setting of the dropped one (a CLI override of early_stopping.patience) is never ignored.
        if "configure_callbacks()" in origins and len(origins) > 1:
            advice = (
                "ampkit runs both, where Lightning lets configure_callbacks() replace the Trainer's callback of its "
                f"type; {advice}"
            )
        raise CallbackOrderError(
            f"callback state_key must be unique, got duplicates: {duplicates} (from {owners}); a checkpoint could not "
            f"tell their states apart: {advice}"
        )
    return sorted(callbacks, key=run_order)


def callback_list(value: Any, where: str) -> list[Callback]:
    """``value`` as a list of callback instances (None: none; one callback: itself), or a one-line error at ``where``.

    Raises:
        UserCodeError: a Callback class instead of an instance, or something that is no Callback.
    """
    if value is None:
        return []
    if isinstance(value, Mapping):  # iterating it would name its keys
        raise UserCodeError(
            f"{where} is {type_of(value)} (keys {list(value)[:5]}); expected a Callback instance or a list of "
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
