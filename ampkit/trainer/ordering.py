"""Order callbacks by the phase they serve (no names, no integer priorities of their own)."""

from __future__ import annotations

from collections.abc import Sequence

from ampkit.trainer.callback import Callback


class CallbackOrderError(ValueError):
    """Callbacks cannot be ordered (two share a name, so checkpoints could not tell their states apart)."""


def order_callbacks(callbacks: Sequence[Callback]) -> list[Callback]:
    """Sort ``callbacks`` by :class:`~ampkit.trainer.callback.Phase`; ties keep the given order."""
    names = [cb.name for cb in callbacks]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise CallbackOrderError(f"callback names must be unique, got duplicates: {duplicates}")
    return sorted(callbacks, key=lambda cb: cb.phase)
