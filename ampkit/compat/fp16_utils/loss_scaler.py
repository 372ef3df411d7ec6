"""Apex's stand-alone ``fp16_utils.LossScaler`` and ``DynamicLossScaler``, for scripts that scale by hand.

Scripts used them as ``loss_scaler.backward(loss)`` (or ``(loss * loss_scaler.loss_scale).backward()``), then
``overflow = loss_scaler.has_overflow(params)``, unscaled and stepped when there was none, and called
``loss_scaler.update_scale(overflow)``. The dynamic rules are Apex's: start at ``2**32``, divide by
``scale_factor`` on an overflow (never below 1), multiply by it after ``scale_window`` iterations without one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from ampkit.amp.scaler import float32_scale, interval_option, overflow_verdict, positive_option


def next_dynamic_scale(
    scale: float, overflow: bool, iteration: int, last_overflow_iter: int, scale_factor: float, scale_window: int
) -> tuple[float, int]:
    """Apex's first dynamic loss scaling at ``iteration``, as ``(scale, last_overflow_iter)`` after it: divided by
    ``scale_factor`` on an overflow (never below 1), multiplied by it once every ``scale_window`` clean iterations
    since the last overflow. Its ``DynamicLossScaler`` and its first ``FP16_Optimizer`` both follow it."""
    if overflow:
        return max(scale / scale_factor, 1), iteration
    if (iteration - last_overflow_iter) % scale_window == 0:
        return scale * scale_factor, last_overflow_iter
    return scale, last_overflow_iter


def _has_inf_or_nan(x: torch.Tensor) -> bool:
    """Whether ``x`` holds an inf or a NaN (one sum, read once)."""
    return not math.isfinite(float(x.float().sum()))


class LossScaler:
    """A static loss scale: ``has_overflow`` is always False and ``update_scale`` changes nothing."""

    def __init__(self, scale: float = 1) -> None:
        # 0 zeroed every gradient, NaN or inf made them all NaN, a string failed at the first backward
        self.cur_scale = float32_scale(scale, "scale")

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        """Always False: a static scale never reports an overflow."""
        return False

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return False

    def update_scale(self, overflow: bool) -> None:
        """Nothing to update: the scale is static."""
        pass

    @property
    def loss_scale(self) -> float:
        """The current scale."""
        return self.cur_scale

    def scale_gradient(self, module: Any, grad_in: tuple[torch.Tensor, ...], grad_out: Any) -> tuple:
        """A backward hook multiplying the incoming gradients by the scale."""
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss * loss_scale``."""
        (loss * self.loss_scale).backward()


class DynamicLossScaler(LossScaler):
    """A loss scale that backs off on overflow and grows back after ``scale_window`` clean iterations.

    Args:
        init_scale: the first scale tried (Apex's ``2**32``).
        scale_factor: what an overflow divides the scale by, and a clean window multiplies it by.
        scale_window: iterations without an overflow before the scale grows.
    """

    def __init__(self, init_scale: float = 2**32, scale_factor: float = 2.0, scale_window: int = 1000) -> None:
        super().__init__(float32_scale(init_scale, "init_scale"))
        self.cur_iter = 0
        self.last_overflow_iter = -1
        # a factor of 1 never backed off, so every step after an overflow was skipped; a window of 0 divided by zero
        self.scale_factor = positive_option(scale_factor, "scale_factor", above_one=True)
        self.scale_window = interval_option(scale_window, "scale_window")

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether any of ``params``' gradients holds an inf or a NaN."""
        return any(p.grad is not None and _has_inf_or_nan(p.grad.data) for p in params)

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return _has_inf_or_nan(x)

    def update_scale(self, overflow: bool) -> None:
        """One iteration's update: divide on overflow (floor 1); multiply once every ``scale_window`` clean
        iterations since the last overflow (counted as Apex counted them). ``overflow`` is a bool or a one-element
        tensor: None (a verdict never computed) counted as clean and "no" as an overflow."""
        self.cur_scale, self.last_overflow_iter = next_dynamic_scale(
            self.cur_scale, overflow_verdict(overflow, "overflow"), self.cur_iter, self.last_overflow_iter,
            self.scale_factor, self.scale_window,
        )  # fmt: skip
        self.cur_iter += 1
