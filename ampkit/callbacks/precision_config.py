"""Turn the ``precision:`` config section into the mixed-precision callbacks (or none, for O0)."""

from __future__ import annotations

import dataclasses
import re

import torch
from omegaconf import DictConfig

from ampkit.amp import OptLevelProperties, resolve_opt_level
from ampkit.callbacks.fp8 import Float8AllGatherScales, Float8Telemetry
from ampkit.callbacks.loss_scaling import LossScaling, check_num_losses
from ampkit.callbacks.nonfinite import NonFiniteCheck
from ampkit.callbacks.precision import MixedPrecision, output_dtype
from ampkit.config import ConfigError
from ampkit.trainer.callback import Callback
from ampkit.trainer.fp8 import fsdp_float8_all_gather
from ampkit.wording import shown

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


def _config_error(exc: Exception, precision: DictConfig) -> ConfigError:
    """``exc`` of the opt-level resolver or the scaler, which speak Apex's ``name=value: why``, as a config user reads
    it: by the dotted key (``config key 'precision.dtype': ...``) where it names one of the section's keys."""
    named = re.fullmatch(r"(\w+)=(.*)", str(exc), re.DOTALL)
    if named and named.group(1) in precision:
        said = named.group(2).replace("'dynamic' or", f"'dynamic', '{NO_LOSS_SCALE}' (no loss scaler) or")
        return ConfigError(f"config key 'precision.{named.group(1)}': {said}")
    return ConfigError(f"config section 'precision': {exc}")


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
        raise _config_error(exc, precision) from None


def precision_callbacks(precision: DictConfig, sharded: bool = False) -> list[Callback]:
    """The callbacks ``precision`` asks for: :func:`mixed_precision_callbacks`, then float8's (``precision.fp8``):
    :class:`Float8AllGatherScales` under FSDP's float8 all-gather and :class:`Float8Telemetry` unless it is off."""
    callbacks = mixed_precision_callbacks(precision, sharded)
    fp8 = precision.fp8
    if fp8.enabled:
        if fsdp_float8_all_gather(fp8, sharded):
            callbacks.append(Float8AllGatherScales())
        if fp8.telemetry_every_n_steps > 0:
            callbacks.append(Float8Telemetry(fp8.recipe, every_n_steps=fp8.telemetry_every_n_steps))
    return callbacks


def mixed_precision_callbacks(precision: DictConfig, sharded: bool = False) -> list[Callback]:
    """The opt level's callbacks; ``[]`` for O0 (plain float32, identical to a hand loop).

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
        # checked at every level: the early returns below build no callback that would check them
        check_num_losses(p.num_losses)
        output_dtype(p.cast_model_outputs)
        if props.opt_level == "O0" and (p.loss_scale is None or _unscaled(p)):
            return []
        if sharded:
            props = dataclasses.replace(props, cast_model_type=None, master_weights=False)
        unscaled = _without_scaler(p, props)
        skip_nonfinite = _skips_nonfinite(p, props, unscaled)
        if not (unscaled or skip_nonfinite):
            raise ValueError(
                "skip_nonfinite=False needs loss_scale: none (a loss scaler skips every step it overflows); "
                f"loss_scale is {shown(props.loss_scale)}"
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
        raise _config_error(exc, precision) from None
    return [casting, scaling]


def fp8_problems(cfg: DictConfig) -> list[str]:
    """What is wrong with ``precision.fp8`` (enabled) given the rest of ``cfg``: one message per bad key, naming it."""
    from ampkit.amp.fp8 import INSTALL_HINT, fp8_gemm_capable, torchao_available, torchao_import_error

    f, props = cfg.precision.fp8, resolve_precision(cfg.precision)
    problems: dict[str, str] = {}
    if props.cast_model_type not in (None, torch.float32) and not props.master_weights:
        problems["precision.opt_level"] = (
            f"{shown(cfg.precision.opt_level)} casts the weights without float32 master weights: float8 training keeps "
            "high-precision weights (use O1/O2 or O4/O5, or master_weights: true)"
        )
    if f.backend == "torchao" and not torchao_available():
        problems["precision.fp8.backend"] = f"'torchao' needs torchao, which is not installed: {INSTALL_HINT}"
    elif f.backend == "torchao" and (broken := torchao_import_error()):  # else a traceback once the model is built
        problems["precision.fp8.backend"] = (
            f"'torchao' needs torchao, which is installed but fails to import ({broken}): install one built for torch "
            f"{torch.__version__} ({INSTALL_HINT}), or use backend 'reference'"
        )
    try:
        auto = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(auto if cfg.trainer.device == "auto" else cfg.trainer.device)
    except RuntimeError:  # not a device: the Trainer's own check names trainer.device
        device = torch.device("cpu")
    if f.emulate is False and f.backend == "reference":
        problems["precision.fp8.emulate"] = "false needs backend torchao (the reference backend always emulates)"
    elif f.emulate is False and not fp8_gemm_capable(device):
        problems["precision.fp8.emulate"] = (
            f"false needs float8 GEMMs, i.e. a CUDA device of compute capability >= 8.9; trainer.device is "
            f"{device} (use auto or true)"
        )
    if (
        f.backend == "torchao"
        and f.recipe == "rowwise_with_gw_hp"
        and props.patch_torch_functions
        and device.type == "cpu"
    ):
        problems["precision.fp8.recipe"] = (
            f"torchao's rowwise_with_gw_hp fails under {cfg.precision.opt_level}'s autocast on CPU (its weight "
            "gradient multiplies the autocast dtype by float32); use O2/O5, backend reference or another recipe"
        )
    if f.fsdp_float8_all_gather is True:
        if cfg.distributed.strategy != "fsdp":
            problems["precision.fp8.fsdp_float8_all_gather"] = "true needs distributed.strategy: fsdp"
        elif f.backend != "torchao" or f.recipe != "tensorwise":
            problems["precision.fp8.fsdp_float8_all_gather"] = (
                f"true needs backend torchao and recipe tensorwise (got {f.backend}, {f.recipe})"
            )
    return [f"config key '{key}': {why}" for key, why in problems.items()]


def describe_precision(precision: DictConfig) -> str:
    """One line naming what ``precision`` runs, e.g. ``O1 bfloat16``, ``O4 bfloat16, skip_nonfinite`` (no scaler,
    inf/nan steps skipped) or ``O2 float16, loss scale dynamic``.

    Resolved as :func:`precision_callbacks` does (the opt level's dtype, no scaler for bfloat16 by default);
    ``precision`` must already be valid.
    """
    fp8 = precision.fp8
    described = _describe_mixed_precision(precision)
    return f"{described}, fp8 {fp8.recipe} ({fp8.backend})" if fp8.enabled else described


def _describe_mixed_precision(precision: DictConfig) -> str:
    p = precision
    props = resolve_precision(p)
    if props.opt_level == "O0" and (p.loss_scale is None or _unscaled(p)):
        return "O0 (float32)"
    unscaled = _without_scaler(p, props)
    # O0 casts nothing: its loss scale (a float32 loss scaled) runs beside no low-precision dtype, whatever ``dtype``
    runs = "O0 (float32)" if props.opt_level == "O0" else f"{p.opt_level} {str(props.dtype).removeprefix('torch.')}"
    if unscaled:
        return runs + (", skip_nonfinite" if _skips_nonfinite(p, props, unscaled) else "")
    return f"{runs}, loss scale {props.loss_scale}"


# The dynamic loss scaler's knobs: read by a scaler whose scale adapts, by nothing else.
DYNAMIC_SCALER_KEYS = (
    "init_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "scale_window",
    "min_scale",
    "max_scale",
    "max_overflows_at_min_scale",
)
# Read by LossScaling alone: no loss scaler and no master weights leave them unread.
_SCALER_KEYS = (*DYNAMIC_SCALER_KEYS, "warn_consecutive_skips", "num_losses", "combine_grad")
# What casting and master weights read, which float32 (O0) has none of.
_CASTING_KEYS = ("dtype", "keep_batchnorm_fp32", "master_weights", "cast_model_outputs", "cast_modules")


def unread_precision_keys(precision: DictConfig) -> dict[str, str]:
    """``{key of the section: why the run does not read it}`` for the keys this opt level and loss scale leave
    unread (O0's dtype, a static or absent scaler's growth knobs); ``{}`` for a section no level resolves from."""
    try:
        props = resolve_precision(precision)
    except ConfigError:  # not a run's section (GPT's 'auto', a file's half-written one): nothing to say of it
        return {}
    unscaled = _without_scaler(precision, props)
    if props.opt_level == "O0" and (precision.loss_scale is None or unscaled):
        why = "precision.opt_level=O0 trains in float32, with no loss scaler"
        return dict.fromkeys((*_CASTING_KEYS, "skip_nonfinite", *_SCALER_KEYS), why)
    unread: dict[str, str] = {}
    if props.opt_level == "O0":
        unread |= dict.fromkeys(("dtype", "keep_batchnorm_fp32"), "precision.opt_level=O0 trains in float32")
    if unscaled:
        why = (
            "precision.loss_scale=none: there is no loss scaler"
            if _unscaled(precision)
            else "bfloat16 has no loss scaler unless precision.loss_scale asks for one"
        )
        unread |= dict.fromkeys(_SCALER_KEYS if not props.master_weights else DYNAMIC_SCALER_KEYS, why)
    elif not props.dynamic_loss_scale:
        why = f"precision.loss_scale={props.loss_scale:g} is a static scale (dynamic: one that adapts)"
        unread |= dict.fromkeys(DYNAMIC_SCALER_KEYS, why)
    return unread
