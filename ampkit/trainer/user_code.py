"""What a Trainer subclass's methods must return, checked where the loop receives it: a mistake becomes one
:class:`UserCodeError` naming the method, what it gave and what is expected (one line in the CLI)."""

from __future__ import annotations

from typing import Any

import torch


class UserCodeError(TypeError, ValueError):
    """A Trainer subclass's method is misspelt, or returned something the loop cannot use.

    Both a TypeError and a ValueError, as the wrong type or the wrong value it reports."""


def check_loss(loss: torch.Tensor, loss_id: Any) -> None:
    """A loss ``backward`` can use: a scalar tensor that requires grad (two attribute reads per backward)."""
    if not isinstance(loss, torch.Tensor):
        raise UserCodeError(f"backward(loss_id={loss_id!r}) got a {type(loss).__name__}; expected the loss tensor")
    if loss.numel() != 1:
        raise UserCodeError(
            f"the loss of loss_id {loss_id!r} has shape {tuple(loss.shape)}; expected a scalar (reduce it: .mean())"
        )
    if not loss.requires_grad:
        raise UserCodeError(
            f"the loss of loss_id {loss_id!r} does not require grad: it was computed under torch.no_grad(), "
            "detached, or from no trainable parameter"
        )


def check_metrics(metrics: Any, method: str) -> dict[str, Any]:
    """``validation_step``/``test_step``'s return value: a dict of metric name to number or scalar tensor."""
    if not isinstance(metrics, dict):
        raise UserCodeError(
            f"{method} returned a {type(metrics).__name__}; expected a dict of metrics, e.g. {{'loss': loss}}"
        )
    return metrics


def check_batches(count: int | None, method: str) -> None:
    """A training loader with batches (an empty one would 'finish' at once, training nothing)."""
    if count == 0:
        raise UserCodeError(f"{method}() yields no batches (an empty dataset, or a batch size above its length?)")
