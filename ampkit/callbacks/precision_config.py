"""Turn the ``precision:`` config section into the mixed-precision callbacks (or none, for O0)."""

from __future__ import annotations

import dataclasses

import torch
from omegaconf import DictConfig

from ampkit.amp import OptLevelProperties, resolve_opt_level
from ampkit.callbacks.loss_scaling import LossScaling
from ampkit.callbacks.nonfinite import NonFiniteCheck
from ampkit.callbacks.precision import MixedPrecision
from ampkit.config import ConfigError
from ampkit.trainer.callback import Callback

NO_LOSS_SCALE = "none"


def _unscaled(precision: DictConfig) -> bool:
    return isinstance(precision.loss_scale, str) and precision.loss_scale.lower() == NO_LOSS_SCALE


def _without_scaler(precision: DictConfig, props: OptLevelProperties) -> bool:
    """Whether the losses go unscaled: ``loss_scale: none``, or bfloat16 with ``loss_scale`` left to its default."""
    return _unscaled(precision) or (precision.loss_scale is None and props.dtype == torch.bfloat16)


def _skips_nonfinite(precision: DictConfig, props: OptLevelProperties, unscaled: bool) -> bool:
    """``skip_nonfinite`` resolved: its default is on, but for bfloat16 without a loss scaler (torch's recipe,
    Lightning's ``bf16-mixed`` and Apex's O4/O5 check nothing there)."""
    if precision.skip_nonfinite is not None:
        return precision.skip_nonfinite
    return not (unscaled and props.dtype == torch.bfloat16)


def resolve_precision(precision: DictConfig) -> OptLevelProperties:
    """The opt level's recipe with the section's overrides (``loss_scale: none``: the level's default scale is
    dropped); an invalid option is a :class:`ConfigError` naming the section."""
    try:
        return resolve_opt_level(
            precision.opt_level,
            dtype=precision.dtype,
            keep_batchnorm_fp32=precision.keep_batchnorm_fp32,
            master_weights=precision.master_weights,
            loss_scale=None if _unscaled(precision) else precision.loss_scale,
        )
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"config section 'precision': {exc}") from None


def precision_callbacks(precision: DictConfig, sharded: bool = False) -> list[Callback]:
    """The callbacks ``precision`` asks for; ``[]`` for O0 (plain float32, identical to a hand loop).

    O1-O3 get :class:`MixedPrecision` (casting), plus :class:`LossScaling` when the losses are scaled or O2's
    fp32 master weights need the gradients combined onto them, else :class:`NonFiniteCheck` when
    ``skip_nonfinite`` is on (by default for float16 only). bfloat16 has no loss scaler unless ``loss_scale``
    asks for one.

    ``sharded`` (FSDP): O2/O5's model cast and fp32 masters are FSDP's (its policy computes in ``dtype`` from
    sharded fp32 parameters), so MixedPrecision leaves the model and optimizers alone.

    Raises:
        ConfigError: an invalid option or combination (Apex's rules), naming ``precision.<option>``.
    """
    p = precision
    if p.growth_interval is not None and p.scale_window is not None and p.growth_interval != p.scale_window:
        raise ConfigError(
            f"config keys 'precision.growth_interval' ({p.growth_interval}) and its alias "
            f"'precision.scale_window' ({p.scale_window}) disagree; set one of them"
        )
    growth_interval = p.growth_interval if p.growth_interval is not None else p.scale_window
    props = resolve_precision(p)
    try:
        if props.opt_level == "O0" and (p.loss_scale is None or _unscaled(p)):
            return []
        if sharded:
            props = dataclasses.replace(props, cast_model_type=None, master_weights=False)
        unscaled = _without_scaler(p, props)
        skip_nonfinite = _skips_nonfinite(p, props, unscaled)
        if not (unscaled or skip_nonfinite):
            raise ValueError(
                "skip_nonfinite=False needs loss_scale: none (a loss scaler skips every step it overflows); "
                f"loss_scale is {props.loss_scale!r}"
            )
        casting = MixedPrecision(props, cast_modules=list(p.cast_modules), cast_model_outputs=p.cast_model_outputs)
        if unscaled and not props.master_weights:
            return [casting, NonFiniteCheck()] if skip_nonfinite else [casting]
        scaling = LossScaling(
            NO_LOSS_SCALE if unscaled else props.loss_scale,
            init_scale=p.init_scale,
            growth_factor=p.growth_factor,
            backoff_factor=p.backoff_factor,
            growth_interval=2000 if growth_interval is None else growth_interval,
            min_scale=p.min_scale,
            max_scale=p.max_scale,
            num_losses=p.num_losses,
            combine_grad=p.combine_grad,
            warn_consecutive_skips=p.warn_consecutive_skips,
            max_overflows_at_min_scale=p.max_overflows_at_min_scale,
            check_nonfinite=skip_nonfinite,
        )
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"config section 'precision': {exc}") from None
    return [casting, scaling]


def describe_precision(precision: DictConfig) -> str:
    """One line naming what ``precision`` runs, e.g. ``O1 bfloat16``, ``O4 bfloat16, skip_nonfinite`` (no scaler,
    inf/nan steps skipped) or ``O2 float16, loss scale dynamic``.

    Resolved as :func:`precision_callbacks` does (the opt level's dtype, no scaler for bfloat16 by default);
    ``precision`` must already be valid.
    """
    p = precision
    props = resolve_precision(p)
    if props.opt_level == "O0" and (p.loss_scale is None or _unscaled(p)):
        return "O0 (float32)"
    unscaled = _without_scaler(p, props)
    dtype = str(props.dtype).removeprefix("torch.")
    if unscaled:
        return f"{p.opt_level} {dtype}" + (", skip_nonfinite" if _skips_nonfinite(p, props, unscaled) else "")
    return f"{p.opt_level} {dtype}, loss scale {props.loss_scale}"
