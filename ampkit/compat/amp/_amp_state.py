"""Process-wide state of the Apex API, reset by every ``amp.initialize``.

Legacy code reads it directly (``amp._amp_state.loss_scalers[0].loss_scale()`` for logging), so the
object keeps Apex's attribute names and is reset in place rather than replaced: a reference taken
before a re-initialize sees the new run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ampkit.amp import LossScaler, OptLevelProperties


class AmpState:
    """What ``amp.initialize`` set up: the resolved properties, one scaler per loss, the cast settings."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget the previous run (called at the start of every ``initialize``)."""
        self.opt_properties: OptLevelProperties | None = None
        self.loss_scalers: list[LossScaler] = []
        self.verbosity: int = 1
        self.cast_device_types: tuple[str, ...] = ("cpu",)
        self.casts_disabled_depth: int = 0
        self.allow_incoming_model_not_fp32: bool = getattr(self, "allow_incoming_model_not_fp32", False)

    @property
    def initialized(self) -> bool:
        return self.opt_properties is not None

    def casts_active(self) -> bool:
        """Whether O1's function casts apply right now (O1 enabled and not inside ``disable_casts``)."""
        props = self.opt_properties
        return props is not None and props.enabled and props.patch_torch_functions and self.casts_disabled_depth == 0


_amp_state = AmpState()


def maybe_print(message: str) -> None:
    """Print when ``verbosity > 0`` (Apex's switch for its overflow and setup messages)."""
    if _amp_state.verbosity > 0:
        print(message)


def master_params(optimizer: Any) -> Iterator[torch.Tensor]:
    """Yield the parameters the optimizer updates: the fp32 masters under O2, the model params otherwise.

    Use it for gradient clipping: ``clip_grad_norm_(amp.master_params(optimizer), max_norm)``.
    """
    for group in optimizer.param_groups:
        yield from group["params"]
