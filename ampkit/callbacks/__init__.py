"""Callbacks: one concern each. :func:`default_callbacks` builds the ones a config asks for."""

from __future__ import annotations

from omegaconf import DictConfig

from ampkit.callbacks.checkpoint import ModelCheckpoint
from ampkit.callbacks.clipping import GradientClipping
from ampkit.callbacks.loss_scaling import LossScaling
from ampkit.callbacks.precision import MixedPrecision
from ampkit.callbacks.precision_config import precision_callbacks
from ampkit.callbacks.progress import ProgressBar
from ampkit.callbacks.tensorboard import TensorBoardLogger
from ampkit.config import ConfigError
from ampkit.trainer.callback import Callback

__all__ = [
    "Callback",
    "GradientClipping",
    "LossScaling",
    "MixedPrecision",
    "ModelCheckpoint",
    "ProgressBar",
    "TensorBoardLogger",
    "default_callbacks",
    "precision_callbacks",
]


def default_callbacks(cfg: DictConfig) -> list[Callback]:
    """The callbacks that ``cfg`` switches on, in no particular order (each declares its own)."""
    callbacks: list[Callback] = precision_callbacks(cfg.precision)
    clip, precision_clip = cfg.trainer.clip_grad_norm, cfg.precision.clip_grad_norm
    if clip is not None and precision_clip is not None and clip != precision_clip:
        raise ConfigError(
            f"config keys 'trainer.clip_grad_norm' ({clip}) and 'precision.clip_grad_norm' ({precision_clip}) "
            "disagree; set one of them"
        )
    clip = clip if clip is not None else precision_clip
    if clip is not None:
        if not clip > 0:
            raise ConfigError(
                f"config key 'precision.clip_grad_norm': {clip!r} is invalid; expected null or a number > 0"
            )
        callbacks.append(GradientClipping(clip))
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
