"""``amp.scale_loss``: per-loss scaling, combined unscaling, one scale update per backward, one-shot skips."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ampkit.amp.grad_combine import read_flags
from ampkit.compat.amp._amp_state import _amp_state


def _optimizer_list(optimizers: Any) -> list[Any]:
    items = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    for i, optimizer in enumerate(items):
        if not hasattr(optimizer, "_amp_stash"):
            raise RuntimeError(
                f"optimizers[{i}] ({type(optimizer).__name__}) was not returned by amp.initialize; pass every "
                "optimizer used with amp.scale_loss through amp.initialize first."
            )
    return items


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: torch.nn.Module | None = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Iterator[torch.Tensor]:
    """Yield ``loss.float() * scale`` of scaler ``loss_id``; on exit unscale the new gradients of ``optimizers``.

    On a non-delayed exit the gradients that this backward produced are divided by the scale and added to
    those that existed before (checked for inf/nan on the new part only), and scaler ``loss_id`` updates
    once. An overflow (dynamic scaling) makes the next ``step()`` of each optimizer here a one-shot skip
    that prints ``Gradient overflow.  Skipping step, loss scaler K reducing loss scale to S``.
    ``delay_unscale=True`` leaves the gradients scaled until the next non-delayed ``scale_loss``;
    ``delay_overflow_check=True`` unscales but neither updates the scale nor skips (as in Apex).
    ``model`` is accepted for Apex compatibility and unused.

    Example:
        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:  # doctest: +SKIP
        ...     scaled_loss.backward()
    """
    if not _amp_state.initialized:
        raise RuntimeError(
            "Invoked 'with amp.scale_loss', but internal Amp state has not been initialized. "
            "model, optimizer = amp.initialize(model, optimizer, opt_level=...) must be called before "
            "'with amp.scale_loss'."
        )
    if not _amp_state.opt_properties.enabled:
        yield loss
        return
    scalers = _amp_state.loss_scalers
    if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not 0 <= loss_id < len(scalers):
        raise ValueError(
            f"loss_id={loss_id!r} is out of range: amp.initialize was called with num_losses={len(scalers)}, "
            f"so valid loss ids are 0..{len(scalers) - 1}"
        )
    stashes = [optimizer._amp_stash for optimizer in _optimizer_list(optimizers)]
    scaler = scalers[loss_id]
    unit_static = not scaler.dynamic and scaler.loss_scale() == 1.0
    if unit_static and not _amp_state.opt_properties.master_weights and not any(s.combine_grad for s in stashes):
        yield loss.float()  # nothing to unscale (O0/O3 defaults); flat combine_grad buffers still need the pass
        return
    for stash in stashes:
        stash.prepare_backward()
    yield loss.float() * scaler.loss_scale()
    if delay_unscale:
        return
    flags = [stash.combine(scaler).found_inf for stash in stashes]
    if delay_overflow_check:
        return
    found_inf = any(read_flags(flags))
    scaler.update(found_inf)
    if found_inf and scaler.dynamic:
        for stash in stashes:
            stash.schedule_skip(loss_id, scaler)
