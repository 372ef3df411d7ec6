"""``trainer.logger``: where training code and callbacks send images, histograms and text."""

from __future__ import annotations

from typing import Any

import torch

from ampkit.trainer.lightning_names import LIGHTNING_LOGGER_NAMES, missing_attribute
from ampkit.trainer.user_code import check_tag
from ampkit.wording import shown


class Logger:
    """Drops everything: the logger of a run without a logging callback, and of every rank but zero.

    A logging callback (e.g. TensorBoard) installs its own subclass as ``trainer.logger`` for the run, so
    code can always call ``self.logger.log_image(...)`` without checking which loggers are on. ``step``
    defaults to the current iteration. A tag is checked as ``log()``'s is, here too: a bad one fails alike on every
    rank and with or without a logging callback.
    """

    def __getattr__(self, name: str) -> Any:  # only names the class lacks: Lightning's get its ampkit spelling
        raise missing_attribute(self, name, LIGHTNING_LOGGER_NAMES)

    def log_image(self, tag: str, image: torch.Tensor, step: int | None = None) -> None:
        """An image: ``(H, W)`` or ``(C, H, W)`` with C in 1, 3, 4; floats in [0, 1] or uint8."""
        check_tag("log_image", tag)

    def log_histogram(self, tag: str, values: torch.Tensor, step: int | None = None) -> None:
        """The distribution of ``values`` (any shape; non-finite values are an error)."""
        check_tag("log_histogram", tag)

    def log_text(self, tag: str, text: str, step: int | None = None) -> None:
        """A piece of text (markdown in TensorBoard)."""
        check_tag("log_text", tag)


def check_image(tag: str, image: torch.Tensor) -> str:
    """The image's ``dataformats`` (``HW`` or ``CHW``), or a ValueError naming what is wrong with it."""
    if not isinstance(image, torch.Tensor):
        raise TypeError(f"log_image({shown(tag)}): expected a tensor, got {type(image).__name__}")
    if image.ndim == 2:
        dataformats = "HW"
    elif image.ndim == 3 and image.shape[0] in (1, 3, 4):
        dataformats = "CHW"
    else:
        raise ValueError(
            f"log_image({shown(tag)}): shape {tuple(image.shape)} is not an image; "
            "expected (H, W) or (C, H, W) with C in 1, 3, 4"
        )
    if image.is_floating_point() and image.numel():
        _check_float_range(tag, image)
    return dataformats


def _check_float_range(tag: str, image: torch.Tensor) -> None:
    """Float pixels must lie in [0, 1]: TensorBoard scales them by 255 and clips, so 0-255 data shows all white
    and a tanh output's negative half all black, with no error."""
    low, high = (float(v) for v in torch.aminmax(image.detach().float()))
    if not (low >= 0.0 and high <= 1.0):  # also false for nan
        raise ValueError(
            f"log_image({shown(tag)}): float pixels span [{low:g}, {high:g}]; expected [0, 1] "
            "(divide 0-255 values by 255 or pass a uint8 tensor; map [-1, 1] by (x + 1) / 2)"
        )
