"""Config keys that someone wrote and this run never reads, because another setting turns off what reads them
(``precision.dtype`` at O0, ``checkpoint.keep_last`` with checkpointing off): named at fit start, since a run that
trains on without them looks like one that used them.

Only keys written where the setting that leaves them unread was already so are named: ``configs/gan.yaml`` sets
``precision.dtype: float16`` for its O1, so ``precision.opt_level=O0`` on the command line makes that key unread
without anyone having asked for it at O0; the same key written on that command line, or in a file that sets O0
itself, is named.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import GrammarParseError, InterpolationResolutionError, MissingMandatoryValue

from ampkit.config_sources import is_set, merged, sources_of, written_value

AUTO = "auto"  # an opt level the run chooses when it starts (ampkit.examples.gpt's choose_precision)


def unread_keys(cfg: DictConfig, world_size: int, validates: bool = True) -> dict[str, str]:
    """``{dotted key: why this run does not read it}`` for every key that another setting leaves unread (or this run:
    ``world_size`` processes, ``validates``: a validation loader with batches)."""
    from ampkit.callbacks.precision_config import unread_precision_keys  # the callbacks' layer, as the Trainer's

    unread = {f"precision.{key}": why for key, why in unread_precision_keys(cfg.precision).items()}
    if not cfg.precision.fp8.enabled:
        keys = [f"precision.fp8.{key}" for key in cfg.precision.fp8 if key != "enabled"]
        unread |= dict.fromkeys(keys, "precision.fp8.enabled is false")
    c = cfg.checkpoint
    if not c.enabled:
        keys = [f"checkpoint.{key}" for key in c if key != "enabled"]
        unread |= dict.fromkeys(keys, "checkpoint.enabled is false: the config's checkpoints are off")
    else:
        if not c.monitor:
            unread["checkpoint.mode"] = "checkpoint.monitor is not set: no best checkpoint is ranked"
        if not c.every_n_steps and not c.every_n_epochs:
            unread["checkpoint.keep_last"] = (
                "checkpoint.every_n_steps and checkpoint.every_n_epochs are 0: no step or epoch file is written"
            )
    if not cfg.early_stopping.monitor:
        keys = [f"early_stopping.{key}" for key in cfg.early_stopping if key != "monitor"]
        unread |= dict.fromkeys(keys, "early_stopping.monitor is not set: early stopping is off")
    if not cfg.logging.tensorboard:
        unread |= dict.fromkeys(
            ("logging.log_momentum", "logging.grad_histograms_every_n_steps"), "logging.tensorboard is false"
        )
    if not cfg.logging.throughput:
        unread["logging.peak_tflops"] = "logging.throughput is false"
    if not cfg.trainer.progress_bar:
        unread["logging.console_every_n_steps"] = "trainer.progress_bar is false: no console progress"
    if not validates:  # a value that turns validation off asks nothing of it; val_every_n_steps: idle_settings
        t = cfg.trainer
        asked = {"num_sanity_val_steps": t.num_sanity_val_steps, "limit_val_batches": t.limit_val_batches,
                 "val_every_n_epochs": t.val_every_n_epochs}  # fmt: skip
        keys = [f"trainer.{key}" for key, value in asked.items() if value not in (0, None)]
        unread |= dict.fromkeys(keys, "there is no validation (val_dataloader() returned None, or no batches)")
    if cfg.distributed.strategy == "fsdp":
        unread["trainer.skip_verdict"] = "distributed.strategy=fsdp reads every skip verdict on the host"
    if world_size == 1:
        keys = [f"distributed.{key}" for key in cfg.distributed if key not in ("strategy", "fsdp")]
        unread |= dict.fromkeys(keys, "this run is one process (torchrun starts several)")
    return unread


def unread_settings(cfg: DictConfig, schema: type, world_size: int, validates: bool = True) -> list[str]:
    """One warning per reason, naming each key with its value that a source of ``cfg`` (the file, the command line,
    a dict) wrote for a run that does not read it: written while the setting that leaves it unread was already so,
    and not ``schema``'s default."""
    defaults = OmegaConf.to_container(OmegaConf.structured(schema), enum_to_str=True)
    sources = sources_of(cfg) or (OmegaConf.to_container(cfg),)
    named: dict[str, list[str]] = {}
    values = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    for key, why in unread_keys(cfg, world_size, validates).items():
        value = written_value(values, key)
        if value == written_value(defaults, key):
            continue  # the default asks nothing
        writers = [index for index, source in enumerate(sources) if is_set(written_value(source, key))]
        if not writers:
            continue
        written = merged(defaults, *sources[: writers[-1] + 1])
        as_written = OmegaConf.create(_as_chosen(written, values))
        _filled(as_written, values)
        if key in unread_keys(as_written, world_size, validates):
            named.setdefault(_said_of_auto(why, written, values), []).append(f"{key}={_shown(value)}")
    return [f"{why}, so this run does not read {', '.join(keys)}" for why, keys in named.items()]


def _as_chosen(as_written: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """``as_written`` with ``precision.opt_level: auto`` (the GPT example's: the run chooses a level when it starts) as
    the run's level and dtype: a key written beside ``auto`` was written for whatever level it chose, O0's too."""
    precision = as_written.get("precision")
    run = values.get("precision")
    if not (isinstance(precision, Mapping) and isinstance(run, Mapping)) or precision.get("opt_level") != AUTO:
        return as_written
    if run.get("opt_level") == AUTO:  # not chosen yet (a Trainer built, no run started): nothing to judge it by
        return as_written
    return {**as_written, "precision": {**precision, "opt_level": run["opt_level"], "dtype": run["dtype"]}}


def _said_of_auto(why: str, written: dict[str, Any], values: dict[str, Any]) -> str:
    """``why`` naming the run's level as auto's choice where the key was written beside ``auto``: the user never
    wrote that level (``precision.opt_level=auto chose O0, which trains in float32``)."""
    level = values["precision"]["opt_level"]
    if written.get("precision", {}).get("opt_level") != AUTO or not why.startswith(f"precision.opt_level={level} "):
        return why
    return why.replace(f"precision.opt_level={level} ", f"precision.opt_level=auto chose {level}, which ", 1)


def _filled(cfg: DictConfig, run: Mapping[str, Any]) -> None:
    """Fill in place each value of ``cfg``, a config as a source left it, that does not resolve (``???``, an unset
    ``${oc.env:VAR}``, both replaced by a later source) with the run's value from ``run``: what that source left open
    was filled as the run filled it."""
    for key in list(cfg.keys()):
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not node._is_interpolation():
            _filled(node, run.get(key) if isinstance(run.get(key), Mapping) else {})
            continue
        try:
            value = cfg[key]
            if isinstance(value, ListConfig):
                OmegaConf.to_container(value, resolve=True, throw_on_missing=True)
        except (InterpolationResolutionError, MissingMandatoryValue, GrammarParseError):
            cfg[key] = run.get(key)


def _shown(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
