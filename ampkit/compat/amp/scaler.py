"""Apex's ``LossScaler`` surface on ampkit's engine scaler, for code that reaches into ``_amp_state``.

NVIDIA's own scripts and tests read and write the scaler's private attributes (``_loss_scale`` set
from ``--init_loss_scale``, ``_unskipped`` for logging): every one of them is a live view of the engine's
state here, so a write changes the scale the next ``scale_loss`` uses.
"""

from __future__ import annotations

import numbers
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ampkit.amp import LossScaler as EngineLossScaler
from ampkit.amp.scaler import float32_scale, overflow_verdict, positive_option
from ampkit.compat import amp_c
from ampkit.ops import multi_tensor
from ampkit.wording import shown

# Apex's names for the engine scaler's options, which errors name
_APEX_OPTION_NAMES = {"growth_interval": "scale_window", "min_scale": "min_loss_scale", "max_scale": "max_loss_scale"}
# what Apex's multi_tensor_applier passed amp_C (the ops here do not depend on it)
_CHUNK_SIZE = 2048 * 32


def stashed_scales(scale_override: Sequence[Any] | None, loss_scale: float) -> tuple[float, float, float]:
    """Apex's ``scale_override`` of a stashed unscale, ``(grads_have_scale, stashed_have_scale, out_scale)``, as three
    finite numbers > 0 (``None``: ``(loss_scale, 1, 1)``); else a ValueError naming it (Apex's unpacking failed with
    Python's own words, and a scale of 0 divided by zero)."""
    if scale_override is None:
        return loss_scale, 1.0, 1.0
    if isinstance(scale_override, torch.Tensor) or not isinstance(scale_override, Sequence) or len(scale_override) != 3:
        raise ValueError(
            f"scale_override={shown(scale_override)}: expected None or three scales (grads_have_scale, "
            "stashed_have_scale, out_scale): those the new and the stashed gradients carry, and the one to leave them "
            "at"
        )
    names = ("grads_have_scale", "stashed_have_scale", "out_scale")
    grads_have, stashed_have, out = (
        positive_option(value, f"scale_override[{i}] ({name})")
        for i, (value, name) in enumerate(zip(scale_override, names, strict=True))
    )
    return grads_have, stashed_have, out


class ApexLossScaler(EngineLossScaler):
    """An engine :class:`~ampkit.amp.LossScaler` that also answers to Apex's attribute names; ``amp.scale_loss``
    decides each skip through its :meth:`update_scale`, so a script's replacement of it (on this class, which
    ``apex.amp.scaler.LossScaler`` names, or on one scaler) decides there, as under Apex."""

    # Apex's class flag: with amp_C, unscale leaves the overflow in ``_overflow_buf`` for update_scale to read (so
    # do amp's unscales here); replacements of update_scale copied from Apex test it. A script (or a platform without
    # amp_C) that sets it False gets Apex's Python path: each unscale reads its verdict to the host into
    # ``_has_overflow`` at once, and ``_overflow_buf`` is neither written, zeroed nor read.
    has_fused_kernel = True
    # amp's own _overflow_buf, which follows the gradients' device (not a buffer a script put there)
    _own_overflow_buf: torch.Tensor | None = None

    def __init__(
        self,
        loss_scale: float | str = "dynamic",
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 2000,
        min_loss_scale: float | None = None,
        max_loss_scale: float | None = 2.0**24,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        option_names: Mapping[str, str] | None = None,
    ) -> None:
        """Apex's ``LossScaler(loss_scale, init_scale, scale_factor, scale_window, min_loss_scale, max_loss_scale)``,
        by position or keyword; ``growth_factor``/``backoff_factor`` are Ascend's (``amp.initialize``'s
        ``scale_growth_factor``/``scale_backoff_factor``). ``scale_factor`` did nothing in Apex (the scale halved and
        doubled): it does nothing here either, and a value other than 2 warns so. A falsy ``min_loss_scale`` is no
        floor, as in Apex."""
        names = {**_APEX_OPTION_NAMES, **(option_names or {})}
        if not (isinstance(scale_factor, numbers.Real) and scale_factor == 2.0):
            warnings.warn(
                f"LossScaler: {names.get('scale_factor', 'scale_factor')}={shown(scale_factor)} is ignored, as Apex "
                "ignored it: a dynamic scale halves on an overflow and doubles after scale_window clean steps "
                "(amp.initialize's scale_growth_factor and scale_backoff_factor, or LossScaler's growth_factor= and "
                "backoff_factor=, change them)",
                UserWarning,
                stacklevel=2,
            )
        super().__init__(
            loss_scale,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=scale_window,
            min_scale=min_loss_scale or None,
            max_scale=max_loss_scale,
            option_names=names,
        )
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
        sync (a dynamic one reads it there, once a backward, as Apex did). Without ``has_fused_kernel``, Apex's
        Python path: a dynamic scaler's verdict is read now into ``_has_overflow`` (a static one checks nothing)."""
        if not self.has_fused_kernel:
            if self.dynamic and not self.last_found_inf:
                self.last_found_inf = bool(found_inf.reshape(-1)[:1].item() != 0)
            return
        buf = self._overflow_buf_on(found_inf.device)
        buf.masked_fill_((found_inf.reshape(-1)[:1] != 0).to(buf.device), 1)

    def _overflow_buf_on(self, device: torch.device) -> torch.Tensor:
        """``_overflow_buf``, amp's own moved to ``device`` (the gradients'), as Apex's lived on the GPU: moved once,
        not read across each step. A buffer the script put there is its own, left where it is."""
        buf = self._overflow_buf
        if buf is self._own_overflow_buf and buf.device != device:
            buf = self._overflow_buf = self._own_overflow_buf = buf.to(device)
        return buf

    def clear_overflow_state(self) -> None:
        """Forget the last overflow and zero the overflow buffer (Apex calls it before each unscale; without
        ``has_fused_kernel`` the buffer is left as it is, as Apex's was)."""
        self.last_found_inf = False
        if self.has_fused_kernel:
            self._overflow_buf.zero_()

    def unscale(
        self,
        model_grads: list[torch.Tensor],
        master_grads: list[torch.Tensor],
        unused_scale: float | None = None,
        models_are_masters: bool = False,
        scale_override: float | None = None,
    ) -> None:
        """Apex's ``LossScaler.unscale``: ``master_grads = model_grads / scale``, flagging inf/nan in
        ``_overflow_buf`` for :meth:`update_scale` (nothing once an overflow is known, or at a static scale of 1
        with no masters; into ``_has_overflow`` without ``has_fused_kernel``). ``scale_override`` divides instead of
        the loss scale, as Apex's FusedSGD post-backward asked (the scale the gradients carry over the one they are
        to be left at)."""
        if self._has_overflow:
            return
        scale = self._loss_scale if scale_override is None else positive_option(scale_override, "scale_override")
        if scale == 1.0 and models_are_masters and not self.dynamic:
            return
        grads = list(model_grads)
        flag = self._flag_for(grads)
        multi_tensor.scale_(grads, 1.0 / scale, flag, out=list(master_grads))
        self._python_path_verdict(flag)

    def unscale_with_stashed(
        self,
        model_grads: list[torch.Tensor],
        stashed_master_grads: list[torch.Tensor],
        master_grads: list[torch.Tensor],
        scale_override: tuple[float, float, float] | None = None,
    ) -> None:
        """Apex's ``LossScaler.unscale_with_stashed``: ``master = model * out/grads_have + stashed * out/stashed_have``
        (a backward's gradients unscaled onto those stashed before it), the scales ``scale_override`` =
        ``(grads_have_scale, stashed_have_scale, out_scale)``, by default ``(loss scale, 1, 1)``. Only the model
        gradients are checked for inf/nan (into ``_overflow_buf``): an overflow is this backward's own."""
        if self._has_overflow:
            return
        grads_have, stashed_have, out = stashed_scales(scale_override, self._loss_scale)
        lists = [list(model_grads), list(stashed_master_grads), list(master_grads)]
        flag = self._flag_for(lists[0])
        amp_c.multi_tensor_axpby(_CHUNK_SIZE, flag, lists, out / grads_have, out / stashed_have, 0)
        self._python_path_verdict(flag)

    def _flag_for(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Where an unscale of ``grads`` flags inf/nan: ``_overflow_buf`` on their device, or a flag of its own on
        Apex's Python path (``has_fused_kernel`` False), which never touched the buffer."""
        if not self.has_fused_kernel:
            return torch.zeros(1, dtype=torch.int32, device=grads[0].device if grads else None)
        return self._overflow_buf_on(grads[0].device) if grads else self._overflow_buf

    def _python_path_verdict(self, flag: torch.Tensor) -> None:
        """On Apex's Python path, the unscale's own flag read into ``_has_overflow`` (by a dynamic scaler)."""
        if not self.has_fused_kernel:
            self.flag_overflow(flag)

    def update_scale(self) -> bool:
        """Apex's ``LossScaler.update_scale``: a dynamic scaler reads ``_overflow_buf`` (unless an overflow is
        already known), backs off or counts a clean step, and returns whether the step must be skipped; legacy
        scripts that unscale by hand (NVIDIA's BERT pretraining) call it instead of ``scale_loss``. Without
        ``has_fused_kernel`` only ``_has_overflow`` decides, as on Apex's Python path."""
        found_inf = self.last_found_inf
        if self.dynamic and not found_inf and self.has_fused_kernel:
            found_inf = bool(self._overflow_buf.item())
        self.update(found_inf)
        return found_inf and self.dynamic


# Apex's name for the class of amp's scalers: a script's patch of ``apex.amp.scaler.LossScaler.update_scale`` (an
# overflow agreed across ranks) reaches ``_amp_state.loss_scalers``, which the engine's class did not.
LossScaler = ApexLossScaler

# The class's own unscale methods, kept apart from the class so that a script's patch of the class itself is told too
_OWN_UNSCALES = {"unscale": ApexLossScaler.unscale, "unscale_with_stashed": ApexLossScaler.unscale_with_stashed}
# Each scaler's verdict, with the methods it was read from: the per-step cost is four lookups and identity compares
# (getattr of both methods and the test of each was several times that). A scaler that cannot be a weak key is looked
# at every time.
_SCRIPTS_UNSCALES: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], frozenset[str]]] = weakref.WeakKeyDictionary()


def scripts_unscales(scaler: Any) -> frozenset[str]:
    """Which of ``scaler``'s ``unscale`` and ``unscale_with_stashed`` are a script's (a subclass's override, a patch of
    the class or of the one scaler, made before or after the first unscale): amp's post-backward and ``FP16_Optimizer``
    then unscale through them, as Apex did (ColossalAI's scaler agrees its overflow across model-parallel ranks there).
    The verdict is kept while the class's and the scaler's own entries of both names stay the same objects."""
    cls, own = type(scaler), getattr(scaler, "__dict__", {})
    methods = tuple(getattr(cls, name, None) for name in _OWN_UNSCALES) + tuple(own.get(name) for name in _OWN_UNSCALES)
    try:
        known = _SCRIPTS_UNSCALES.get(scaler)
    except TypeError:  # unhashable, or no weak reference to it
        return _scripts_unscales(scaler)
    if known is not None and all(a is b for a, b in zip(known[0], methods, strict=True)):
        return known[1]
    names = _scripts_unscales(scaler)
    _SCRIPTS_UNSCALES[scaler] = (methods, names)
    return names


def _scripts_unscales(scaler: Any) -> frozenset[str]:
    methods = ((name, getattr(scaler, name, None), own) for name, own in _OWN_UNSCALES.items())
    return frozenset(
        name for name, method, own in methods if method is not None and getattr(method, "__func__", None) is not own
    )
