"""Apex's ``LossScaler`` surface on ampkit's engine scaler, for code that reaches into ``_amp_state``.

NVIDIA's own scripts and tests read and write the scaler's private attributes (``_loss_scale`` set
from ``--init_loss_scale``, ``_unskipped`` for logging): every one of them is a live view of the engine's
state here, so a write changes the scale the next ``scale_loss`` uses.
"""

from __future__ import annotations

from typing import Any

import torch

from ampkit.amp import LossScaler as EngineLossScaler
from ampkit.amp.scaler import float32_scale, overflow_verdict


class ApexLossScaler(EngineLossScaler):
    """An engine :class:`~ampkit.amp.LossScaler` that also answers to Apex's attribute names; ``amp.scale_loss``
    decides each skip through its :meth:`update_scale`, so a script's replacement of it (on this class, which
    ``apex.amp.scaler.LossScaler`` names, or on one scaler) decides there, as under Apex."""

    # Apex's class flag: with amp_C, unscale leaves the overflow in ``_overflow_buf`` for update_scale to read (so
    # do amp's unscales here); replacements of update_scale copied from Apex test it
    has_fused_kernel = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Apex's overflow flag, written by amp_C kernels (``multi_tensor_scale(..., scaler._overflow_buf, ...)``)
        # and read by update_scale; legacy code may put its own buffer here.
        self._overflow_buf = self._own_overflow_buf = torch.zeros(1, dtype=torch.int32)

    @property
    def _loss_scale(self) -> float:
        return self._scale

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        # NVIDIA's scripts set it from --init_loss_scale: 1e39 or 0 was taken, and every scaled loss was inf or 0
        self._scale = float32_scale(value, "_loss_scale")

    @property
    def _unskipped(self) -> int:
        return self.unskipped

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        self.unskipped = int(value)

    @property
    def _scale_seq_len(self) -> int:
        return self.growth_interval

    @_scale_seq_len.setter
    def _scale_seq_len(self, value: int) -> None:
        self.growth_interval = int(value)

    @property
    def _min_loss_scale(self) -> float | None:
        return self.min_scale

    @_min_loss_scale.setter
    def _min_loss_scale(self, value: float | None) -> None:
        self.min_scale = float(value) if value else None  # Apex: a falsy floor (None or 0) is no floor

    @property
    def _max_loss_scale(self) -> float | None:
        return self.max_scale

    @_max_loss_scale.setter
    def _max_loss_scale(self, value: float | None) -> None:
        self.max_scale = None if value is None else float(value)

    @property
    def _has_overflow(self) -> bool:
        """Whether the last update of a dynamic scaler saw an overflow, until the next ``clear_overflow_state``
        (as in Apex, a static scaler never reports one: it does not skip)."""
        return self.last_found_inf

    @_has_overflow.setter
    def _has_overflow(self, value: bool | torch.Tensor) -> None:
        """A verdict the script reached itself (Horovod's Adasum BERT optimizer checks its own gradient norm): the
        next ``update_scale`` takes it as Apex's did, backing a dynamic scale off without reading the buffer."""
        self.last_found_inf = overflow_verdict(value)

    last_found_inf: bool = False

    def update(self, found_inf: bool | torch.Tensor) -> tuple[float, float]:
        """The engine's update; a dynamic scaler's verdict is kept for ``_has_overflow``."""
        found_inf = overflow_verdict(found_inf)
        self.last_found_inf = found_inf and self.dynamic
        return super().update(found_inf)

    def flag_overflow(self, found_inf: torch.Tensor) -> None:
        """Raise ``_overflow_buf`` where ``found_inf`` (amp's unscale's flag) is non-zero, on the device, where Apex's
        kernels left it: nothing is read to the host, so a static scale, whose update_scale never reads it, costs no
        sync (a dynamic one reads it there, once a backward, as Apex did)."""
        buf = self._overflow_buf
        if buf is self._own_overflow_buf and buf.device != found_inf.device:
            # amp's own flag follows the gradients, as Apex's lived on the GPU: moved once, not read across each step
            buf = self._overflow_buf = self._own_overflow_buf = buf.to(found_inf.device)
        buf.masked_fill_((found_inf.reshape(-1)[:1] != 0).to(buf.device), 1)

    def clear_overflow_state(self) -> None:
        """Forget the last overflow and zero the overflow buffer (Apex calls it before each unscale)."""
        self.last_found_inf = False
        self._overflow_buf.zero_()

    def unscale(
        self,
        model_grads: list[torch.Tensor],
        master_grads: list[torch.Tensor],
        unused_scale: float | None = None,
        models_are_masters: bool = False,
    ) -> None:
        """Apex's ``LossScaler.unscale``: ``master_grads = model_grads / scale``, flagging inf/nan in
        ``_overflow_buf`` for :meth:`update_scale` (nothing once an overflow is known, or at a static scale of 1
        with no masters)."""
        if self._has_overflow:
            return
        if self._loss_scale == 1.0 and models_are_masters and not self.dynamic:
            return
        from ampkit.ops import multi_tensor

        multi_tensor.scale_(list(model_grads), 1.0 / self._loss_scale, self._overflow_buf, out=list(master_grads))

    def update_scale(self) -> bool:
        """Apex's ``LossScaler.update_scale``: a dynamic scaler reads ``_overflow_buf`` (unless an overflow is
        already known), backs off or counts a clean step, and returns whether the step must be skipped; legacy
        scripts that unscale by hand (NVIDIA's BERT pretraining) call it instead of ``scale_loss``."""
        found_inf = self.last_found_inf
        if self.dynamic and not found_inf:
            found_inf = bool(self._overflow_buf.item())
        self.update(found_inf)
        return found_inf and self.dynamic


# Apex's name for the class of amp's scalers: a script's patch of ``apex.amp.scaler.LossScaler.update_scale`` (an
# overflow agreed across ranks) reaches ``_amp_state.loss_scalers``, which the engine's class did not.
LossScaler = ApexLossScaler
