"""One loss scaler, static or dynamic, with Apex's semantics and torch.amp's knob names.

The scale lives on the host as a Python float: scaling a loss and building the unscale factor cost
no device sync, and :meth:`LossScaler.update` syncs at most once (when handed a device flag). A Trainer that
keeps skip verdicts on the GPU (``trainer.skip_verdict``) moves the authoritative scale there with
:meth:`LossScaler.keep_on_device`: :meth:`LossScaler.update_on_device` applies the same rule in float64 tensor
ops, bit for bit the host's, and the host copy follows one iteration later through :meth:`LossScaler.update`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ampkit.amp.opt_levels import FLOAT32_SCALES, parse_loss_scale
from ampkit.wording import integer_digits, shown

__all__ = ["LossScaler"]

# Without ``min_scale`` the dynamic scale still stops here: the unscale factor ``1/scale`` is a float32,
# and 2**-126 (float32's smallest normal number) is the last power of two whose reciprocal float32 holds.
# Apex let the scale decay to 1e-200; its unscale factor was a Python float.
LOWEST_SCALE = 2.0**-126
# A scaler per loss is made up front (Apex's num_losses): a bound, so a typo cannot hang the set-up.
MAX_NUM_LOSSES = 1024
# The constructor's options, by their own names; a caller may spell them its way (``option_names``).
_OPTIONS = ("loss_scale", "init_scale", "growth_factor", "backoff_factor", "growth_interval", "min_scale", "max_scale")


def positive_option(value: Any, option: str, *, above_one: bool = False, below_one: bool = False) -> float:
    """``value`` as a float if it is a finite number > 0 (and > 1 or < 1 where asked); else a ValueError naming
    ``option``. Any real number counts (numpy's ``float32``, a one-element tensor), as Apex took them."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_meta:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{option}={shown(value)}: expected a number")
    try:
        value = float(value)
    except OverflowError:  # an int of more digits than a float holds: float() names neither it nor the option
        raise ValueError(f"{option}: {integer_digits(int(value))}: expected a finite number > 0") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{option}={shown(value)}: expected a finite number > 0")
    if above_one and value <= 1.0:
        raise ValueError(f"{option}={shown(value)}: expected a number > 1")
    if below_one and value >= 1.0:
        raise ValueError(f"{option}={shown(value)}: expected a number in (0, 1)")
    return value


def float32_scale(value: Any, option: str) -> float:
    """``value`` as a scale a float32 loss can carry (as amp's static ``loss_scale``), else a ValueError naming
    ``option``: 1e39 scaled every loss to inf, which a static scaler stepped on and a dynamic one skipped some 870
    times from 1e300; 1e-300 scaled every loss to 0, which trained nothing."""
    scale = positive_option(value, option)
    if not FLOAT32_SCALES[0] <= scale <= FLOAT32_SCALES[1]:
        raise ValueError(
            f"{option}={shown(value)}: a loss scale must lie in float32's range of scales, 2**-126 to "
            f"{FLOAT32_SCALES[1]:.4g}: beyond it the scaled loss is inf or 0"
        )
    return scale


def interval_option(value: Any, option: str, *, zero_means: str | None = None) -> int:
    """``value`` as an int if it is a whole number >= 1 (a count of iterations: ``1000.0`` from a float option, as
    Apex took it, or numpy's ``int64``), or 0 where ``zero_means`` says what 0 does ("never"); else a ValueError
    naming ``option``."""
    whole = isinstance(value, numbers.Integral) or (isinstance(value, numbers.Real) and float(value).is_integer())
    lowest = 0 if zero_means else 1
    if isinstance(value, bool) or not whole or value < lowest:
        zero = f" ({lowest}: {zero_means})" if zero_means else ""
        raise ValueError(f"{option}={shown(value)}: expected an integer >= {lowest}{zero}")
    return int(value)


def loss_count_option(value: Any, option: str, *, optional: bool = False, zero_means: str | None = None) -> int | None:
    """``value`` as a number of losses, each given its scaler up front: an integer (numpy's too, as Apex's
    ``range(num_losses)`` took it; not a bool, nor 2.0 or "2", which Apex's range refused) in [1, MAX_NUM_LOSSES]
    (from 0 where ``zero_means`` says what 0 does), or None where ``optional``; else a ValueError naming ``option``.
    The one rule of the Trainer and the Apex layer."""
    if optional and value is None:
        return None
    lowest = 0 if zero_means else 1
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not lowest <= value <= MAX_NUM_LOSSES:
        allowed = "None or an integer" if optional else "an integer"
        zero = f"; {lowest}: {zero_means}" if zero_means else ""
        raise ValueError(
            f"{option}={shown(value)}: expected {allowed} in [{lowest}, {MAX_NUM_LOSSES}] (each loss gets its scaler "
            f"up front{zero})"
        )
    return int(value)


def overflow_verdict(found_inf: Any, name: str = "found_inf") -> bool:
    """An iteration's overflow verdict as a bool: a bool or number (non-zero: overflow), or a one-element tensor
    (read: a sync on CUDA). Anything else was taken by its truthiness: ``None`` as no overflow, ``"no"`` as one.
    ``name``: the argument as the caller's API spells it, for the error."""
    if found_inf is True or found_inf is False:  # the Trainer's agreed verdict, once an iteration
        return found_inf
    if isinstance(found_inf, torch.Tensor):
        if found_inf.numel() != 1:
            raise ValueError(f"{name} must be a one-element tensor, got shape {tuple(found_inf.shape)}")
        return bool(found_inf.item())
    if not isinstance(found_inf, bool | numbers.Number | np.generic):
        raise TypeError(f"{name} must be a bool or a one-element tensor, got {shown(found_inf)}")
    return bool(found_inf)


class LossScaler:
    """Scales one loss and adapts the scale to overflows.

    Dynamic scaling (``loss_scale="dynamic"``): starts at ``min(init_scale, max_scale)``; an update
    that saw an overflow multiplies the scale by ``backoff_factor`` (floored at :attr:`floor`:
    ``min_scale`` when given, else 2**-126, where float32 can no longer hold ``1/scale``) and resets
    the clean-update counter; the
    ``growth_interval``-th consecutive clean update multiplies it by ``growth_factor`` (capped at
    ``max_scale``; not at all where float32 could not carry the result, as torch's GradScaler), or the next one where
    a restored count had passed it. A static scale (a number) never changes.

    Call :meth:`update` exactly once per iteration, after every optimizer that used this loss stepped.

    Args:
        loss_scale: ``"dynamic"`` or a positive static scale (Apex's ``float()`` rule: ``"128.0"`` works).
        init_scale: first dynamic scale (Apex's ``dynamic_init_scale``), default ``2**16``.
        growth_factor: multiplier after ``growth_interval`` clean updates (> 1), default 2.
        backoff_factor: multiplier after an overflow (in (0, 1)), default 0.5.
        growth_interval: clean updates between growths (Apex's ``scale_window``), default 2000.
        min_scale: floor for the dynamic scale, or ``None`` for none.
        max_scale: cap for the dynamic scale, or ``None`` for none; default ``2**24``.
        option_names: how the caller spells these options (``{"growth_interval": "scale_window"}``), so that an
            error names the argument the user wrote.

    Example:
        >>> scaler = LossScaler()
        >>> scaler.update(found_inf=True)
        (65536.0, 32768.0)
    """

    def __init__(
        self,
        loss_scale: float | str = "dynamic",
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float | None = None,
        max_scale: float | None = 2.0**24,
        option_names: Mapping[str, str] | None = None,
    ) -> None:
        names = {**{o: o for o in _OPTIONS}, **(option_names or {})}
        mode = parse_loss_scale(loss_scale, names["loss_scale"])
        self.dynamic: bool = mode == "dynamic"
        self.growth_factor = positive_option(growth_factor, names["growth_factor"], above_one=True)
        self.backoff_factor = positive_option(backoff_factor, names["backoff_factor"], below_one=True)
        self.growth_interval = interval_option(growth_interval, names["growth_interval"])
        self.min_scale = None if min_scale is None else positive_option(min_scale, names["min_scale"])
        self.max_scale = None if max_scale is None else positive_option(max_scale, names["max_scale"])
        if self.min_scale is not None and self.max_scale is not None and self.min_scale > self.max_scale:
            raise ValueError(
                f"{names['min_scale']}={shown(min_scale)} is larger than {names['max_scale']}={shown(max_scale)}: the "
                "floor of the dynamic scale must not exceed its cap"
            )
        if self.dynamic:
            start = positive_option(init_scale, names["init_scale"])
            if self.max_scale is not None:
                start = min(start, self.max_scale)
            if self.min_scale is not None:
                start = max(start, self.min_scale)
            if not FLOAT32_SCALES[0] <= start <= FLOAT32_SCALES[1]:  # as a static scale (torch refuses it too)
                which, given = ("min_scale", min_scale) if start == self.min_scale else ("init_scale", init_scale)
                raise ValueError(
                    f"{names[which]}={shown(given)}: the first dynamic scale must lie in float32's range of "
                    f"scales, 2**-126 to {FLOAT32_SCALES[1]:.4g}: beyond it the scaled loss or its unscaling factor is "
                    "inf, and every step is skipped until the scale backs off into it"
                )
        else:
            start = float(mode)
        self._scale: float = start
        self.unskipped: int = 0
        self._inv_scale_cache: dict[torch.device, tuple[float, torch.Tensor]] = {}
        self._scale_cache: dict[torch.device, tuple[float, torch.Tensor]] = {}
        self._on_device: _DeviceScale | None = None

    @property
    def scale(self) -> float:
        """The current loss scale."""
        return self._scale

    @property
    def floor(self) -> float:
        """The lowest dynamic scale: ``min_scale``, and never below 2**-126 (``1/scale`` is a float32)."""
        return LOWEST_SCALE if self.min_scale is None else max(self.min_scale, LOWEST_SCALE)

    def loss_scale(self) -> float:
        """The current loss scale (Apex's spelling, read by legacy logging code)."""
        return self._scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Return ``loss`` in float32 times the scale (float32 so the scaled loss itself cannot overflow).

        The scale is a cached 0-dim tensor: a tensor product skips wrapping a Python number on every call
        (torch's GradScaler does the same); both multiply in float32, so the bits are the same.
        """
        if not isinstance(loss, torch.Tensor):  # a float or a list failed on .dtype
            raise TypeError(f"scale_loss expects the loss as a tensor, got {type(loss).__name__}")
        if loss.dtype != torch.float32:
            loss = loss.float()
        if self._on_device is not None:
            return loss * self._on_device.scale32
        device = loss.device
        cached = self._scale_cache.get(device)
        if cached is None or cached[0] != self._scale:
            cached = (self._scale, torch.full((), self._scale, dtype=torch.float32, device=device))  # no H2D copy
            self._scale_cache[device] = cached
        return loss * cached[1]

    def inv_scale_tensor(self, device: torch.device | str) -> torch.Tensor:
        """``1/scale`` as a one-element float32 tensor on ``device``, cached until the scale changes."""
        if not isinstance(device, torch.device):
            device = torch.device(device)
        if self._on_device is not None and self._on_device.scale.device == device:
            return self._on_device.inv32
        cached = self._inv_scale_cache.get(device)
        if cached is None or cached[0] != self._scale:
            cached = (self._scale, torch.full((1,), 1.0 / self._scale, dtype=torch.float32, device=device))
            self._inv_scale_cache[device] = cached
        return cached[1]

    def update(self, found_inf: bool | torch.Tensor) -> tuple[float, float]:
        """Record one iteration's overflow verdict and adapt the scale; returns ``(old, new)``.

        ``found_inf`` may be a bool or a tensor (non-zero means overflow; reading it is the one sync).
        """
        found_inf = overflow_verdict(found_inf)
        old = self._scale
        if not self.dynamic:
            self.unskipped += 1
            return old, old
        if found_inf:
            new = max(old * self.backoff_factor, self.floor)
            self.unskipped = 0
        else:
            new = old
            self.unskipped += 1
            # At least, not exactly: a count restored from a run with a longer interval (a GradScaler's state, or a
            # resume with growth_interval lowered) had passed it, and counting on to equality never grew again.
            if self.unskipped >= self.growth_interval:
                new = old * self.growth_factor
                if self.max_scale is not None:
                    new = min(new, self.max_scale)
                if new > FLOAT32_SCALES[1]:  # as torch's _amp_update_scale_: no growth to a scale float32 cannot carry
                    new = old
                self.unskipped = 0
        self._scale = new
        return old, new

    def keep_on_device(self, device: torch.device) -> None:
        """Make a copy of the scale (and the clean-update count) on ``device`` the one that scales and unscales,
        updated there by :meth:`update_on_device` with no host read. :meth:`update` then only replays each
        verdict on the host copy (:attr:`scale`, checkpoints), which lags until the verdicts are read."""
        if self._on_device is None or self._on_device.scale.device != device:
            self._on_device = _DeviceScale(self._scale, self.unskipped, device)

    @property
    def on_device(self) -> bool:
        """Whether :meth:`keep_on_device` moved the authoritative scale to a device."""
        return self._on_device is not None

    def update_on_device(self, found_inf: torch.Tensor) -> None:
        """:meth:`update`'s rule on the device copy, with ``found_inf`` (non-zero: overflow) never read: float64
        tensor ops give the host's Python-float results bit for bit."""
        state = self._on_device
        if state is None:
            raise RuntimeError("update_on_device() before keep_on_device()")
        if not self.dynamic:
            return
        overflow = found_inf.reshape(()).to(state.scale.device) != 0
        clean = state.unskipped + 1
        grows = clean >= self.growth_interval  # as update(): a restored count may have passed it
        grown = state.scale * self.growth_factor
        if self.max_scale is not None:
            grown = torch.clamp_max(grown, self.max_scale)
        if self.max_scale is None or self.max_scale > FLOAT32_SCALES[1]:  # (a cap within float32, the default: no op)
            grown = torch.where(grown > FLOAT32_SCALES[1], state.scale, grown)  # as update()
        backed_off = torch.clamp_min(state.scale * self.backoff_factor, self.floor)
        state.set(
            torch.where(overflow, backed_off, torch.where(grows, grown, state.scale)),
            torch.where(overflow | grows, torch.zeros_like(clean), clean),
        )

    def state_dict(self) -> dict[str, Any]:
        """Apex's per-scaler format: ``{"loss_scale": float, "unskipped": int}``."""
        return {"loss_scale": self._scale, "unskipped": self.unskipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (or an Apex ``loss_scalerN`` entry, or a ``torch.amp.GradScaler``'s
        state: its ``scale`` and ``_growth_tracker``, the clean steps since the scale last changed); knobs stay as
        configured, a dynamic scale outside this scaler's ``min_scale``/``max_scale`` (and float32's range) is brought
        within them, and a static scale float32 cannot carry is refused."""
        if not isinstance(state, Mapping):
            raise TypeError(
                f"a loss scaler's state is a dict {{'loss_scale': float, 'unskipped': int}}, got {type(state).__name__}"
            )
        if is_grad_scaler_state(state):
            state = {"loss_scale": state["scale"], "unskipped": state["_growth_tracker"]}
        missing = {"loss_scale", "unskipped"} - set(state)
        if missing:
            raise KeyError(f"loss scaler state is missing {sorted(missing)}; got keys {sorted(state)}")
        scale, unskipped = state["loss_scale"], state["unskipped"]
        if isinstance(scale, torch.Tensor):
            scale = scale.item()
        if isinstance(unskipped, torch.Tensor):
            unskipped = int(unskipped.item())
        scale = positive_option(scale, "loss_scale")
        unskipped = interval_option(unskipped, "unskipped", zero_means="no clean update yet")  # numpy's and 3.0 too
        if self.dynamic:  # this run's floor and cap hold for a restored scale too (a GradScaler's had no cap)
            cap = FLOAT32_SCALES[1] if self.max_scale is None else min(self.max_scale, FLOAT32_SCALES[1])
            scale = min(max(scale, self.floor), cap)
        else:  # a static scale never backs off: one float32 cannot carry made every step inf
            scale = float32_scale(scale, "loss_scale")
        # Set together, both checked first: a refused state leaves the scaler as it was.
        self._scale, self.unskipped = scale, unskipped
        if self._on_device is not None:
            self._on_device = _DeviceScale(self._scale, self.unskipped, self._on_device.scale.device)

    def __repr__(self) -> str:
        mode = "dynamic" if self.dynamic else "static"
        return f"LossScaler({mode}, scale={self._scale}, unskipped={self.unskipped})"


def is_grad_scaler_state(state: Mapping[str, Any]) -> bool:
    """Whether ``state`` is a ``torch.amp.GradScaler.state_dict()`` (one scale for every loss)."""
    return "scale" in state and "_growth_tracker" in state and "loss_scale" not in state


class _DeviceScale:
    """A scaler's state on a device: the scale in float64 (the host's Python float, exactly), the clean-update
    count, and the float32 forms the loss scaling and unscaling use."""

    def __init__(self, scale: float, unskipped: int, device: torch.device) -> None:
        self.set(
            torch.tensor(scale, dtype=torch.float64, device=device),
            torch.tensor(unskipped, dtype=torch.int64, device=device),
        )

    def set(self, scale: torch.Tensor, unskipped: torch.Tensor) -> None:
        self.scale, self.unskipped = scale, unskipped
        self.scale32 = scale.to(torch.float32)  # as torch.full(..., python_float, dtype=float32) rounds
        self.inv32 = (1.0 / scale).to(torch.float32).reshape(1)  # 1.0 / python_float, rounded to float32
