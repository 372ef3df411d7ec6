"""Callbacks: one concern each. :func:`default_callbacks` builds the ones a config asks for."""

from __future__ import annotations

from omegaconf import DictConfig

from ampkit.callbacks.checkpoint import ModelCheckpoint
from ampkit.callbacks.clipping import GradientClipping
from ampkit.callbacks.progress import ProgressBar
from ampkit.callbacks.tensorboard import TensorBoardLogger
from ampkit.trainer.callback import Callback

__all__ = [
    "Callback",
    "GradientClipping",
    "ModelCheckpoint",
    "ProgressBar",
    "TensorBoardLogger",
    "default_callbacks",
]


def default_callbacks(cfg: DictConfig) -> list[Callback]:
    """The callbacks that ``cfg`` switches on, in no particular order (each declares its own)."""
    callbacks: list[Callback] = []
    if cfg.trainer.clip_grad_norm is not None:
        callbacks.append(GradientClipping(cfg.trainer.clip_grad_norm))
    if cfg.trainer.progress_bar:
        callbacks.append(ProgressBar())
    if cfg.logging.tensorboard:
        callbacks.append(TensorBoardLogger(log_every_n_steps=cfg.logging.log_every_n_steps))
    if cfg.checkpoint.enabled:
        callbacks.append(
            ModelCheckpoint(
                every_n_steps=cfg.checkpoint.every_n_steps,
                every_n_epochs=cfg.checkpoint.every_n_epochs,
                keep_last=cfg.checkpoint.keep_last,
            )
        )
    return callbacks
