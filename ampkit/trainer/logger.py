"""``trainer.logger``: where training code and callbacks send images, histograms and text."""

from __future__ import annotations

import torch


class Logger:
    """Drops everything: the logger of a run without a logging callback, and of every rank but zero.

    A logging callback (e.g. TensorBoard) installs its own subclass as ``trainer.logger`` for the run, so
    code can always call ``self.logger.log_image(...)`` without checking which loggers are on. ``step``
    defaults to the current iteration.
    """

    def log_image(self, tag: str, image: torch.Tensor, step: int | None = None) -> None:
        """An image: ``(H, W)`` or ``(C, H, W)`` with C in 1, 3, 4; floats in [0, 1] or uint8."""

    def log_histogram(self, tag: str, values: torch.Tensor, step: int | None = None) -> None:
        """The distribution of ``values`` (any shape; non-finite values are an error)."""

    def log_text(self, tag: str, text: str, step: int | None = None) -> None:
        """A piece of text (markdown in TensorBoard)."""


def check_image(tag: str, image: torch.Tensor) -> str:
    """The image's ``dataformats`` (``HW`` or ``CHW``), or a ValueError naming what is wrong with it."""
    if not isinstance(image, torch.Tensor):
        raise TypeError(f"log_image('{tag}'): expected a tensor, got {type(image).__name__}")
    if image.ndim == 2:
        return "HW"
    if image.ndim == 3 and image.shape[0] in (1, 3, 4):
        return "CHW"
    raise ValueError(
        f"log_image('{tag}'): shape {tuple(image.shape)} is not an image; "
        "expected (H, W) or (C, H, W) with C in 1, 3, 4"
    )
