"""Callbacks: one concern each. :func:`default_callbacks` builds the ones a config asks for."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ampkit.callbacks.checkpoint import ModelCheckpoint
from ampkit.callbacks.checkpointing_report import CheckpointingReport
from ampkit.callbacks.clipping import GradientClipping
from ampkit.callbacks.compile_report import CompileReport
from ampkit.callbacks.distributed import DistributedSync
from ampkit.callbacks.early_stopping import EarlyStopping, EarlyStoppingReason
from ampkit.callbacks.fp8 import Float8AllGatherScales, Float8Telemetry
from ampkit.callbacks.grad_histograms import GradientHistograms
from ampkit.callbacks.loss_scaling import LossScaling
from ampkit.callbacks.max_time import MaxTime
from ampkit.callbacks.nonfinite_guard import NonFiniteError, NonFiniteGuard
from ampkit.callbacks.precision import MixedPrecision
from ampkit.callbacks.precision_config import precision_callbacks, resolve_precision
from ampkit.callbacks.progress import ProgressBar
from ampkit.callbacks.tensorboard import TensorBoardLogger
from ampkit.callbacks.throughput import Throughput
from ampkit.config import ConfigError, duration_seconds
from ampkit.trainer.callback import Callback

if TYPE_CHECKING:
    from ampkit.trainer.trainer import Trainer

__all__ = [
    "Callback",
    "CheckpointingReport",
    "CompileReport",
    "DistributedSync",
    "EarlyStopping",
    "EarlyStoppingReason",
    "Float8AllGatherScales",
    "Float8Telemetry",
    "GradientClipping",
    "GradientHistograms",
    "LossScaling",
    "MaxTime",
    "MixedPrecision",
    "ModelCheckpoint",
    "NonFiniteError",
    "NonFiniteGuard",
    "ProgressBar",
    "TensorBoardLogger",
    "Throughput",
    "default_callbacks",
    "switched_on_by",
    "precision_callbacks",
]


def __getattr__(name: str) -> object:
    """A Lightning callback this module has none of (``LearningRateMonitor``) is an error naming what does its work
    here: an ImportError in a ``from ... import``, an AttributeError elsewhere, so ``hasattr`` and ``getattr`` with a
    default still answer as for any missing name."""
    from ampkit.missing_name import missing_name
    from ampkit.trainer.lightning_names import LIGHTNING_CALLBACKS

    if name in LIGHTNING_CALLBACKS:
        here = LIGHTNING_CALLBACKS[name]
        raise missing_name(
            f"cannot import name '{name}' from '{__name__}': it is Lightning's callback; here that is {here}",
            __name__,
            name,
        )
    raise AttributeError(f"module '{__name__}' has no attribute '{name}'", name=name, obj=sys.modules[__name__])


def default_callbacks(trainer: Trainer) -> list[Callback]:
    """The callbacks the trainer's config switches on, in no particular order (each declares its own)."""
    cfg = trainer.cfg
    callbacks: list[Callback] = precision_callbacks(cfg.precision, sharded=trainer.sharded)
    callbacks.append(NonFiniteGuard(check_every_n_steps=cfg.logging.log_every_n_steps))
    if trainer.world_size > 1:
        d = cfg.distributed
        grad_sync = d.grad_sync if d.grad_sync != "auto" else "ddp" if trainer.automatic_optimization else "step"
        grad_sync = "fsdp" if trainer.sharded else grad_sync
        ddp_kwargs = {
            "find_unused_parameters": d.find_unused_parameters,
            "static_graph": d.static_graph,
            "gradient_as_bucket_view": d.gradient_as_bucket_view,
            "bucket_cap_mb": d.bucket_cap_mb,
        }
        callbacks.append(DistributedSync(grad_sync, ddp_kwargs, sync_batchnorm=d.sync_batchnorm))
    clip = cfg.trainer.clip_grad_norm if cfg.trainer.clip_grad_norm is not None else cfg.precision.clip_grad_norm
    if clip is not None:  # both keys were checked when the Trainer was built
        callbacks.append(GradientClipping(clip))
    if trainer.model_setup is not None and trainer.model_setup.compiled:
        callbacks.append(CompileReport())
    if trainer.model_setup is not None and trainer.model_setup.checkpointed:
        callbacks.append(CheckpointingReport())
    if cfg.logging.throughput:
        props = resolve_precision(cfg.precision)
        compute_dtype = None if props.opt_level == "O0" else props.dtype
        callbacks.append(Throughput(cfg.logging.log_every_n_steps, compute_dtype, cfg.logging.peak_tflops))
    if cfg.trainer.progress_bar:
        callbacks.append(ProgressBar(every_n_steps=cfg.logging.console_every_n_steps))
    if cfg.logging.tensorboard:
        callbacks.append(TensorBoardLogger(cfg.logging.log_every_n_steps, log_momentum=cfg.logging.log_momentum))
        if cfg.logging.grad_histograms_every_n_steps > 0:
            callbacks.append(GradientHistograms(every_n_steps=cfg.logging.grad_histograms_every_n_steps))
    if cfg.checkpoint.enabled:
        c = cfg.checkpoint
        with _config_section("checkpoint"):
            callbacks.append(
                ModelCheckpoint(
                    every_n_steps=c.every_n_steps,
                    every_n_epochs=c.every_n_epochs,
                    keep_last=c.keep_last,
                    monitor=c.monitor,
                    mode=c.mode.value,
                    save_top_k=c.save_top_k,
                )
            )
        _set_by_config(callbacks[-1], "checkpoint.monitor")
    if cfg.trainer.max_time is not None:  # checked when the Trainer was built
        callbacks.append(MaxTime(duration_seconds(cfg.trainer.max_time)))
    if cfg.early_stopping.monitor:
        e = cfg.early_stopping
        with _config_section("early_stopping"):
            callbacks.append(
                EarlyStopping(
                    e.monitor,
                    mode=e.mode.value,
                    patience=e.patience,
                    min_delta=e.min_delta,
                    check_finite=e.check_finite,
                    stopping_threshold=e.stopping_threshold,
                    divergence_threshold=e.divergence_threshold,
                )
            )
        _set_by_config(callbacks[-1], "early_stopping.monitor")
    return callbacks


def _set_by_config(callback: ModelCheckpoint | EarlyStopping, key: str) -> None:
    """Messages about ``callback``'s monitor name config ``key``, which set it (one given in code names no key)."""
    if callback.monitor is not None:
        callback.monitor.setting = key


def switched_on_by(callback: Callback) -> str | None:
    """The config key that switches a callback of :func:`default_callbacks` on, to name in an error about it; None
    for one the precision or distributed settings imply, or that is always on (``NonFiniteGuard``)."""
    if isinstance(callback, ModelCheckpoint):
        return "checkpoint.monitor" if callback.monitor is not None else "checkpoint.enabled"
    return next((key for kind, key in _SWITCHED_ON_BY if isinstance(callback, kind)), None)


_SWITCHED_ON_BY = (
    (EarlyStopping, "early_stopping.monitor"),
    (TensorBoardLogger, "logging.tensorboard"),
    (GradientHistograms, "logging.grad_histograms_every_n_steps"),
    (ProgressBar, "trainer.progress_bar"),
    (Throughput, "logging.throughput"),
    (MaxTime, "trainer.max_time"),
    (GradientClipping, "trainer.clip_grad_norm"),
)


@contextmanager
def _config_section(section: str) -> Iterator[None]:
    """A callback's invalid argument reported as a config error of ``section``."""
    try:
        yield
    except ValueError as exc:
        raise ConfigError(f"config section '{section}': {exc}") from None
