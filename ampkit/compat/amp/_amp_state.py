"""Process-wide state of the Apex API, reset by every ``amp.initialize``.

Legacy code reads it directly (``amp._amp_state.loss_scalers[0].loss_scale()`` for logging), so the
object keeps Apex's attribute names and is reset in place rather than replaced: a reference taken
before a re-initialize sees the new run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ampkit.amp import OptLevelProperties
from ampkit.compat.amp.scaler import ApexLossScaler


class AmpState:
    """What ``amp.initialize`` set up: the resolved properties, one scaler per loss, the cast settings.

    As in Apex, ``opt_properties`` exists only once ``initialize`` ran, ``loss_scalers`` (and the
    ``min_loss_scale``/``max_loss_scale`` it was given) only once an enabled one did, and ``handle`` only
    once O1 (or ``amp.init``) patched torch: ``hasattr(amp._amp_state, "loss_scalers")`` and the like are
    how libraries around Apex ask whether amp is on. ampkit's own code reads ``active_handle``.
    """

    opt_properties: OptLevelProperties
    loss_scalers: list[ApexLossScaler]
    min_loss_scale: float | None
    max_loss_scale: float | None

    def __init__(self) -> None:
        self.hard_override = False  # Apex's switch turning the opt-level Properties' errors into warnings
        self.active_handle: Any = None  # the handle O1's casts and decorators follow (a NoOpHandle too)
        self._apex_handle: Any = None  # the last AmpHandle, what Apex kept in ``_amp_state.handle``
        self.reset()

    def reset(self) -> None:
        """Forget the previous run (called at the start of every ``initialize``); its O1 casts are undone."""
        # The AmpHandle of the last O1 (``amp.init`` or an O1 ``initialize``); as in Apex it stays reachable
        # after a later ``initialize``, deactivated, so ``_amp_state.handle._deactivate()`` keeps working.
        if self.active_handle is not None:
            self.active_handle._deactivate()
        for name in ("opt_properties", "loss_scalers", "min_loss_scale", "max_loss_scale"):
            vars(self).pop(name, None)
        self.verbosity: int = 1
        self.combine_grad: bool = False
        self.allow_incoming_model_not_fp32: bool = getattr(self, "allow_incoming_model_not_fp32", False)

    @property
    def handle(self) -> Any:
        """The last O1 handle; absent (AttributeError) until ``amp.init`` or an O1 ``initialize`` made one."""
        if self._apex_handle is None:
            raise AttributeError("'AmpState' object has no attribute 'handle' (no O1 handle was made yet)")
        return self._apex_handle

    @handle.setter
    def handle(self, handle: Any) -> None:
        self.active_handle = self._apex_handle = handle

    @property
    def initialized(self) -> bool:
        return "opt_properties" in vars(self)

    @property
    def gradients_leave_params(self) -> bool:
        """True when ``scale_loss`` takes each backward's gradients out of ``.grad`` (loss scaling, O2 masters,
        flat buffers) and adds them back after it: a backward then only ever sees its own new gradients."""
        if not self.initialized:  # amp.init's handle API stashes around every scaled backward
            return self.active_handle is not None and self.active_handle.is_active()
        if not self.opt_properties.enabled:
            return False
        unit_static = all(not s.dynamic and s.loss_scale() == 1.0 for s in self.loss_scalers)
        return bool(self.opt_properties.master_weights) or self.combine_grad or not unit_static


_amp_state = AmpState()
"""The one ``AmpState`` of the process, reset in place by every ``amp.initialize``."""


def maybe_print(message: str) -> None:
    """Print when ``verbosity > 0`` (Apex's switch for its overflow and setup messages)."""
    if _amp_state.verbosity > 0:
        print(message)


def warn_or_err(message: str) -> None:
    """Raise RuntimeError(message), or only print it as a warning while ``hard_override`` is set (Apex's rule)."""
    if _amp_state.hard_override:
        print(f"Warning:  {message}")
    else:
        raise RuntimeError(message)


def master_params(optimizer: Any) -> Iterator[torch.Tensor]:
    """Yield the parameters the optimizer updates: the fp32 masters under O2, the model params otherwise.

    Use it for gradient clipping: ``clip_grad_norm_(amp.master_params(optimizer), max_norm)``.
    """
    if not hasattr(optimizer, "param_groups"):
        raise TypeError(
            f"amp.master_params expects an optimizer (the one amp.initialize returned), got {type(optimizer).__name__}"
        )
    for group in optimizer.param_groups:
        yield from group["params"]
