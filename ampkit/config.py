"""Structured configuration: dataclass schemas merged with a YAML file and ``key=value`` overrides.

A run's YAML names its Trainer subclass (``trainer_class: package.module:ClassName``); that class's
``config_class`` (a dataclass extending :class:`Config`) is the schema, so unknown keys and wrong types
anywhere fail before training with the dotted path, the bad value and what would be valid.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import importlib
import importlib.machinery
import importlib.util
import math
import os
import re
import sys
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf, TupleConfig
from omegaconf.errors import GrammarParseError, OmegaConfBaseException
from omegaconf.nodes import AnyNode, BooleanNode, EnumNode, FloatNode, PathNode

from ampkit.config_explain import interpolation_problem, malformed_interpolation, wrong_type
from ampkit.config_sources import remember_sources, sources_of
from ampkit.lightning_settings import LIGHTNING_SETTINGS, LIGHTNING_ZERO
from ampkit.wording import beyond_float, counted, integer_digits, shown


class ConfigError(ValueError):
    """Invalid configuration: the message names the dotted key, the bad value and the valid choices."""


class MonitorMode(str, Enum):
    """Which way a monitored metric improves (OmegaConf rejects any other value, listing these)."""

    min = "min"
    max = "max"


@dataclass
class TrainerConfig:
    """The loop."""

    max_epochs: int = 1  # epochs to train (max_steps may stop it earlier); -1: no limit, as in Lightning
    max_steps: int = -1  # iterations (optimizer steps incl. skipped ones); -1 = no limit
    max_time: Any = None  # training's wall-clock limit (a resume counts on): seconds, "[DD:]HH:MM:SS", {hours: 5}
    accumulate_grad_batches: int = 1  # batches per iteration: gradients accumulate, optimizers step once
    limit_train_batches: int | float | None = None  # batches per epoch: a count, or a fraction (0.25); null: all
    limit_val_batches: int | float | None = None  # batches per validation: a count, or a fraction of them; null: all
    num_sanity_val_steps: int = 2  # validation batches run before training, checking monitors (0: none, -1: all)
    val_every_n_epochs: int = 1  # 0 disables epoch-end validation (none when val_every_n_steps just ran)
    val_every_n_steps: int = 0  # 0 disables step-based validation
    clip_grad_norm: float | None = None  # clip each optimizer's unscaled gradients to this total L2 norm (null: off)
    # Where a step's skip verdict (found_inf flags, a non-finite clipping norm) is decided: read on the host each
    # iteration, or handed to optimizers that take GradScaler's found_inf, loss scales updated on the device
    skip_verdict: str = "auto"  # auto (device on CUDA, host on CPU) | host | device: see docs/mixed-precision.md
    seed: int | None = 0  # seeds Python, NumPy and torch before configure_model (null: no seeding)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    compile: Any = False  # false | true (torch.compile the whole model) | [Block, ...] (those classes, in place)
    compile_mode: str = "default"  # torch.compile mode: default | reduce-overhead | max-autotune | ...
    activation_checkpointing: list[str] = field(default_factory=list)  # classes recomputed in backward ([Block])
    progress_bar: bool = True  # console output: bars in a terminal, plain lines otherwise (false: none)


@dataclass
class CheckpointConfig:
    """Where and when to write checkpoints (``<run_dir>/version_N/checkpoints``)."""

    enabled: bool = True  # false: the config's ModelCheckpoint is off (one given in code still saves)
    every_n_steps: int = 0  # a step-N.pt every N iterations (0: never)
    every_n_epochs: int = 1  # an epoch-N.pt every N epochs (0: never)
    keep_last: int = 2  # step/epoch files kept besides last.pt
    monitor: str | None = None  # val/loss, or a train/ epoch mean: keep the best as best-<step>.pt, best.pt
    mode: MonitorMode = MonitorMode.min  # which way monitor improves
    save_top_k: int = 1  # best files kept (-1: every one; without a monitor, every step/epoch file)


@dataclass
class EarlyStoppingConfig:
    """Stop when validation metric ``monitor`` has not improved by more than ``min_delta`` for ``patience``
    validations in a row (off while ``monitor`` is null), and at once when it is NaN/inf or crosses a threshold
    (as Lightning's EarlyStopping)."""

    monitor: str | None = None  # val/loss, or a train/ epoch mean (checked at epoch ends); null: no early stopping
    mode: MonitorMode = MonitorMode.min  # which way monitor improves
    patience: int = 3  # validations in a row without an improvement before stopping
    min_delta: float = 0.0  # a change of at most this does not count as an improvement
    check_finite: bool = True  # stop at once when monitor is NaN/inf (false: no improvement; inf meets thresholds)
    stopping_threshold: float | None = None  # stop at once when monitor is better than this (null: never)
    divergence_threshold: float | None = None  # stop at once when monitor is worse than this (null: never)


@dataclass
class LoggingConfig:
    """TensorBoard logging and the console."""

    tensorboard: bool = True  # write TensorBoard event files under <version_dir>/tensorboard
    log_every_n_steps: int = 10  # scalars (and trainer.log's on_step values) every N iterations
    log_momentum: bool = False  # also train/momentum/<optimizer>: each group's momentum or Adam's beta1
    console_every_n_steps: int = 50  # a plain progress line every N iterations when stdout is not a terminal
    grad_histograms_every_n_steps: int = 0  # per-parameter gradient histograms every N iterations (0: off)
    throughput: bool = True  # samples/s (tokens/s, TFLOP/s, MFU when the Trainer sets what a sample is worth)
    peak_tflops: float | None = None  # the device's peak TFLOP/s for MFU (null: NVIDIA's for known GPUs)


@dataclass
class Float8Config:
    """Float8 training of the model's Linear layers (composes with every opt level but O3, in float16 or bfloat16).

    Eligible ``nn.Linear`` layers (both dims divisible by 16, named by ``modules``, not by ``skip_modules``) are
    converted once, after ``configure_model`` and before sharding, compile and ``configure_optimizers``; they keep
    ``nn.Linear``'s parameters, so checkpoints load into the plain model. Scaling is dynamic (no amax history), so a
    skipped step leaves nothing behind and an inf becomes non-finite gradients that the loss scaler or
    ``skip_nonfinite`` catches as in float16/bfloat16.
    """

    enabled: bool = False  # convert the eligible Linear layers to float8
    backend: str = "torchao"  # torchao (pip install "ampkit[fp8]") | reference (ampkit's pure-torch casts, emulated)
    recipe: str = "tensorwise"  # tensorwise | rowwise | rowwise_with_gw_hp
    emulate: Any = "auto"  # auto | true | false: float8 GEMMs in float32 (auto: unless CUDA capability >= 8.9)
    modules: list[str] = field(default_factory=list)  # fnmatch patterns of Linear names to convert ([]: all)
    skip_modules: list[str] = field(default_factory=list)  # fnmatch patterns of Linear names to keep (e.g. lm_head)
    fsdp_float8_all_gather: Any = "auto"  # auto | true | false: FSDP2 gathers weights in float8 (torchao, tensorwise)
    telemetry_every_n_steps: int = 100  # per-layer amax, scale, underflow to TensorBoard every N iterations (0: off)


@dataclass
class PrecisionConfig:
    """Mixed precision with Apex's opt levels (O0 fp32, O1 autocast, O2 cast model + fp32 masters, O3 pure half;
    O4/O5 are O1/O2 in bfloat16).

    ``None`` means the opt level's default (Apex's table), except that bfloat16 has no loss scaler by default:
    its range is float32's, so torch's recipe and Lightning's ``bf16-mixed`` scale nothing.
    ``skip_nonfinite`` keeps "never apply a non-finite update" without a scaler: one fused inf/nan check of
    the gradients per iteration, and the Trainer skips the step when it finds one. Its default (null) is on
    for float16 and off for bfloat16, whose range is float32's: torch's recipe, Lightning's ``bf16-mixed``
    and Apex's O4/O5 (static loss scale 1) check nothing, and on a GPU the check costs a device-to-host read
    every iteration. Without it a non-finite update is applied, and the NonFiniteGuard stops the run at its
    next check, before a non-finite model is checkpointed. A loss scaler always skips the steps it overflows.
    """

    opt_level: str = "O0"  # O0 (float32) | O1 | O2 | O3 | O4 | O5: Apex's table
    dtype: str | None = None  # float16 | bfloat16; null: the opt level's (float16, bfloat16 at O4/O5)
    loss_scale: Any = None  # dynamic | <number> | none (no scaler); null: the opt level's, none for bfloat16
    skip_nonfinite: bool | None = None  # no scaler: check grads for inf/nan, skip such steps (null: not in bf16)
    init_scale: float = 65536.0  # a dynamic loss scaler's first scale
    growth_factor: float = 2.0  # the scale is multiplied by this after growth_interval clean iterations
    backoff_factor: float = 0.5  # the scale is multiplied by this at each overflow
    growth_interval: int | None = None  # 2000; alias scale_window
    scale_window: int | None = None  # Apex's name for growth_interval
    min_scale: float | None = None  # floor of the dynamic scale (null: 2^-126, where 1/scale still fits a float32)
    max_scale: float | None = 16777216.0  # cap of the dynamic scale (null: none)
    num_losses: int | None = None  # with a loss scale, int loss_ids must be below it; names are always accepted
    combine_grad: bool = False  # one flat gradient buffer per dtype
    keep_batchnorm_fp32: Any = None  # True | False | "True" | "False"
    master_weights: bool | None = None  # fp32 master copies of low-precision weights in the optimizer (null: O2's)
    cast_model_outputs: str | None = None  # O2/O3 outputs are cast to float32 unless this names a dtype
    cast_modules: list[str] = field(default_factory=list)  # submodules cast at their boundary ([]: the model)
    clip_grad_norm: float | None = None  # same as trainer.clip_grad_norm
    warn_consecutive_skips: int = 10  # warn after this many skipped steps in a row, again at twice as many (0: never)
    max_overflows_at_min_scale: int = 10  # error after this many overflows in a row at min_scale (0: never)
    fp8: Float8Config = field(default_factory=Float8Config)


@dataclass
class FSDPConfig:
    """FSDP2 sharding (only with ``distributed.strategy: fsdp``)."""

    shard_modules: list[str] = field(default_factory=list)  # module class names sharded one by one, then the root
    reshard_after_forward: bool | None = None  # None: True (free gathered parameters after each forward)
    cpu_offload: bool = False  # keep sharded parameters, gradients and optimizer state in CPU memory


@dataclass
class DistributedConfig:
    """torch.distributed under ``torchrun`` (gloo on CPU, NCCL on GPU); ignored in a single process, except
    ``strategy: fsdp``, which also shards (trivially) on one process so its checkpoints resume at any world size."""

    strategy: str = "ddp"  # ddp (every rank holds the whole model) | fsdp (FSDP2: parameters, grads, state sharded)
    backend: str = "auto"  # auto | gloo | nccl
    timeout_s: float = 300.0  # a collective waiting longer than this fails the run instead of hanging
    grad_sync: str = "auto"  # auto | ddp | step  (auto: ddp under automatic optimization, else step)
    find_unused_parameters: bool = False  # passed to torch's DistributedDataParallel
    gradient_as_bucket_view: bool = False  # passed to torch's DistributedDataParallel
    static_graph: bool = False  # passed to torch's DistributedDataParallel
    bucket_cap_mb: float = 25.0  # passed to torch's DistributedDataParallel
    sync_batchnorm: bool = False  # synchronise batch-norm statistics across ranks (CPU too)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class Config:
    """The root schema; a Trainer subclass extends it with its own sections (model, data, optim...)."""

    trainer_class: str = MISSING  # package.module:Class, the Trainer subclass to run
    name: str = "run"  # the run's name (run_dir's default uses it)
    run_dir: str = "runs/${name}"  # each fresh run writes <run_dir>/version_N/
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


# The root keys every Trainer's config has; any other root key is a section of a Trainer subclass's own.
AMPKIT_KEYS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(Config))


def _project_root(start: Path, module_name: str) -> Path | None:
    """The nearest of ``start`` and its parents holding the module's top package (``examples/`` or ``examples.py``)."""
    top = module_name.partition(".")[0]
    for folder in (start, *start.parents):
        if (folder / top).is_dir() or (folder / f"{top}.py").is_file():
            return folder
    return None


def _at_least(low: int) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v >= low), f"an integer >= {low}"


# A batch count, or a fraction of a loader's batches as Lightning's limit_*_batches take (1.0: all of them).
_BATCH_LIMIT = (
    lambda v: v >= 1 if isinstance(v, int) else 0.0 < v <= 1.0,
    "an integer >= 1 (batches) or a fraction in (0.0, 1.0] of them",
)


def _optional(rule: tuple[Callable[[Any], bool], str], none_means: str) -> tuple[Callable[[Any], bool], str]:
    check, valid = rule
    return (lambda v: v is None or check(v)), f"null ({none_means}) or {valid}"


def _one_of(*choices: str) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v in choices), "one of " + ", ".join(choices)


_POSITIVE_NUMBER = (lambda v: 0 < v < math.inf), "a finite number > 0"  # nan and inf fail the comparison
_FINITE_NUMBER = (lambda v: -math.inf < v < math.inf), "a finite number"


def names_a_metric(value: str) -> bool:
    """Whether a monitor's text names a metric: not blank, and not blank after its ``val/`` or ``train/`` prefix
    (``""`` monitored nothing, silently; ``"val/"`` looked for a metric with no name), and printable: a newline, tab
    or other control character is in no tag a run logs, so the monitor failed only at the first validation."""
    return value.isprintable() and bool(re.sub(r"^\s*(val|train)/", "", value).strip())


METRIC_NAME_RULE = "a metric's name (printable text: no newline, tab or control character), such as val/loss"
_METRIC_NAME = names_a_metric, METRIC_NAME_RULE

# Every integer key holds a 64-bit integer: torch, islice and DataLoader take nothing larger (trainer.seed has its
# own range: torch takes any seed that a signed or unsigned 64-bit integer holds).
_INT64_EXCEPT = frozenset({"trainer.seed"})


# The keywords of ``datetime.timedelta``, which Lightning's ``max_time`` takes as a dict (``{"days": 1, "hours": 5}``).
DURATION_UNITS = ("weeks", "days", "hours", "minutes", "seconds", "milliseconds", "microseconds")


def duration_seconds(value: Any) -> float | None:
    """Seconds in ``value``: a number of seconds, ``"HH:MM:SS"`` or ``"DD:HH:MM:SS"``, a ``datetime.timedelta`` or a
    dict of its keywords (Lightning's ``max_time`` forms); None if none of these (``"1:30"`` too: hours and minutes,
    or minutes and seconds?), or if it is no time at all."""
    if isinstance(value, bool):
        return None
    if isinstance(value, Mapping):
        units = dict(value.items())
        if not units or any(
            key not in DURATION_UNITS
            or isinstance(n, bool)
            or not isinstance(n, int | float)
            or beyond_float(n)  # math.isfinite raised a bare OverflowError
            or not math.isfinite(n)
            for key, n in units.items()
        ):
            return None
        try:
            value = datetime.timedelta(**units)
        except OverflowError:  # more days than a timedelta holds: no limit anyone means
            return None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
        return seconds if seconds > 0 else None
    if isinstance(value, int | float):
        return float(value) if value > 0 and not beyond_float(value) and math.isfinite(value) else None
    parts = str(value).split(":")
    if len(parts) not in (3, 4) or not all(part.strip().isdigit() for part in parts):
        return None
    days, hours, minutes, seconds = (int(part) for part in [*(["0"] * (4 - len(parts))), *parts])
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    return float(total) if total > 0 and not beyond_float(total) else None


# Every value a schema type cannot constrain, with what is valid (other precision keys: checked by its callbacks).
VALUE_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "run_dir": ((lambda v: bool(v.strip()) and "\0" not in v), "a non-empty path without NUL characters"),
    "trainer.max_epochs": ((lambda v: v >= -1), "-1 (no limit: max_steps, max_time or a stop ends the run) or >= 0"),
    "trainer.max_steps": ((lambda v: v >= -1), "-1 (no limit) or an integer >= 0"),
    "trainer.max_time": (
        (lambda v: v is None or duration_seconds(v) is not None),
        'null (no limit), a number of seconds > 0, "HH:MM:SS" or "DD:HH:MM:SS" (e.g. 12:00:00 or 1:00:00:00), or a '
        f"dict of timedelta's keywords ({', '.join(DURATION_UNITS)}), e.g. {{days: 1, hours: 5}}",
    ),
    "trainer.accumulate_grad_batches": _at_least(1),
    "trainer.limit_train_batches": _optional(_BATCH_LIMIT, "all batches; ampkit validate validates alone"),
    "trainer.limit_val_batches": _optional(_BATCH_LIMIT, "all batches; val_every_n_epochs=0 turns validation off"),
    "trainer.num_sanity_val_steps": ((lambda v: v >= -1), "-1 (all batches), 0 (no sanity validation) or more"),
    "trainer.val_every_n_epochs": ((lambda v: v >= 0), "an integer >= 0 (0: never)"),
    "trainer.val_every_n_steps": ((lambda v: v >= 0), "an integer >= 0 (0: never)"),
    "trainer.clip_grad_norm": _optional(_POSITIVE_NUMBER, "no clipping"),
    "trainer.skip_verdict": _one_of("auto", "host", "device"),
    "trainer.seed": (
        (lambda v: v is None or -(2**63) <= v < 2**64),
        "null (no seeding) or an integer in [-2**63, 2**64)",
    ),
    "checkpoint.every_n_steps": ((lambda v: v >= 0), "an integer >= 0 (0: never)"),
    "checkpoint.every_n_epochs": ((lambda v: v >= 0), "an integer >= 0 (0: never)"),
    "checkpoint.keep_last": _at_least(1),
    "checkpoint.save_top_k": (
        (lambda v: v >= 1 or v == -1),
        f"an integer >= 1, or -1 (keep every one); {LIGHTNING_ZERO['save_top_k']}",
    ),
    "checkpoint.monitor": _optional(_METRIC_NAME, "no best checkpoint"),
    "early_stopping.patience": (
        (lambda v: v >= 1),
        f"an integer >= 1 ({LIGHTNING_ZERO['patience']})",
    ),
    "early_stopping.monitor": _optional(_METRIC_NAME, "no early stopping"),
    "early_stopping.min_delta": ((lambda v: 0 <= v < math.inf), "a finite number >= 0"),
    "early_stopping.stopping_threshold": _optional(_FINITE_NUMBER, "never"),
    "early_stopping.divergence_threshold": _optional(_FINITE_NUMBER, "never"),
    "precision.opt_level": (
        _one_of("O0", "O1", "O2", "O3", "O4", "O5")[0],
        "one of O0, O1, O2, O3, O4, O5 (the letter O, not the number zero)",
    ),
    "precision.clip_grad_norm": _optional(_POSITIVE_NUMBER, "no clipping"),
    "precision.warn_consecutive_skips": ((lambda v: v >= 0), "an integer >= 0 (0: never)"),
    # The loss scaler's knobs, checked at every opt level: a typo at O0 would surface only when O1 is tried.
    "precision.init_scale": _POSITIVE_NUMBER,
    "precision.growth_factor": ((lambda v: 1 < v < math.inf), "a finite number > 1"),
    "precision.backoff_factor": ((lambda v: 0 < v < 1), "a number in (0, 1)"),
    "precision.growth_interval": _optional(_at_least(1), "scale_window, else 2000"),
    "precision.scale_window": _optional(_at_least(1), "growth_interval, else 2000"),
    "precision.min_scale": _optional(_POSITIVE_NUMBER, "2**-126, where 1/scale still fits a float32"),
    "precision.max_scale": _optional(_POSITIVE_NUMBER, "no cap"),
    "precision.max_overflows_at_min_scale": ((lambda v: v >= 0), "an integer >= 0 (0: never)"),
    "logging.log_every_n_steps": _at_least(1),
    "logging.console_every_n_steps": _at_least(1),
    "logging.grad_histograms_every_n_steps": ((lambda v: v >= 0), "an integer >= 0 (0: off)"),
    "logging.peak_tflops": _optional(_POSITIVE_NUMBER, "from the table of known GPUs"),
    "distributed.backend": _one_of("auto", "gloo", "nccl"),
    "distributed.timeout_s": (  # torch's deadlines (now + timeout, in int64 nanoseconds) overflow well before inf
        (lambda v: 0 < v <= 1e9),
        "a number of seconds > 0, at most 1e9 (about 31 years)",
    ),
    "distributed.grad_sync": _one_of("auto", "ddp", "step"),
    "distributed.bucket_cap_mb": (
        (lambda v: 0 < v < 2**43),
        "a number > 0 and below 2**43 (DDP counts the bucket's bytes in a 64-bit integer)",
    ),
    "precision.fp8.backend": _one_of("torchao", "reference"),
    "precision.fp8.recipe": _one_of("tensorwise", "rowwise", "rowwise_with_gw_hp"),
    "precision.fp8.emulate": ((lambda v: v in ("auto", True, False)), "auto, true or false"),
    "precision.fp8.fsdp_float8_all_gather": ((lambda v: v in ("auto", True, False)), "auto, true or false"),
    "precision.fp8.telemetry_every_n_steps": ((lambda v: v >= 0), "an integer >= 0 (0: off)"),
}


# Values other tools take for a key, and the setting that does the same here (Lightning's Trainer(precision=...)).
_FOREIGN_SPELLINGS = {
    "precision.opt_level": {
        "bf16-mixed": "Lightning's autocast in bfloat16: opt_level O4, or O1 with precision.dtype=bfloat16",
        "16-mixed": "Lightning's autocast in float16 with a dynamic loss scaler: opt_level O1",
        "bf16-true": "Lightning's model in bfloat16: opt_level O3 with precision.dtype=bfloat16",
        "16-true": "Lightning's model in float16: opt_level O3",
        **dict.fromkeys(("32-true", "32", "fp32", "float32"), "float32: opt_level O0"),
        "16": "Lightning's precision=16 (16-mixed), autocast in float16 with a dynamic loss scaler: opt_level O1",
        "bf16": "Lightning's precision='bf16' (bf16-mixed), autocast in bfloat16: opt_level O4",
        **{f"o{n}": f"opt_level O{n}, with a capital letter O" for n in range(6)},  # a lowercase spelling
    }
}


def _valid_text(key: str, text: str) -> bool:
    """Whether ``text`` passes ``key``'s rule (False where the rule takes no string)."""
    try:
        return bool(VALUE_RULES[key][0](text))
    except TypeError:
        return False


def _look_alike(key: str, value: Any) -> str | None:
    """What an invalid ``value`` of ``key`` looks like it means, in words, or None where nothing is near: a value
    quoted twice ("'O2'"), one with spaces around it, an opt level YAML read as a number (``02`` is 2), another tool's
    spelling (Lightning's 16-mixed)."""
    if not isinstance(value, str):  # a str key holds a number YAML read as its text
        return None
    text, bare = value, value.strip()
    if len(bare) > 80:  # a value to write out in full is a short one
        return None
    if len(bare) > 2 and bare[0] == bare[-1] and bare[0] in "'\"" and _valid_text(key, bare[1:-1].strip()):
        return f"{shown(value)} holds its quote marks, as a value quoted twice does; write {bare[1:-1].strip()}"
    if key == "precision.opt_level" and bare.isdigit() and len(bare) <= 2 and int(bare) < 6:
        level = f"O{int(bare)}"
        if len(bare) == 1:  # YAML and the command line read 02, 2 and 0o2 as the number 2
            return f"YAML reads 0{bare} and {bare} as the number {bare}: an opt level starts with the letter O: {level}"
        return f"{shown(value)} starts with the number zero, not the letter O; write {level}"
    if bare != text and _valid_text(key, bare):
        return f"{shown(value)} has spaces around it; write {bare}"
    same = _FOREIGN_SPELLINGS.get(key, {}).get(bare.lower())
    return f"{shown(value)} is {same}" if same else None


def _integers_out_of_range(cfg: DictConfig, prefix: str = "") -> dict[str, int]:
    """Each integer key, in any section (a Trainer's own too), whose value no 64-bit integer holds, by dotted key."""
    found = {}
    for key in cfg.keys():
        full_key = f"{prefix}{key}"
        value = cfg._get_node(key)
        if isinstance(value, DictConfig):
            found |= _integers_out_of_range(value, f"{full_key}.")
            continue
        if isinstance(value, AnyNode):  # a key of several forms (loss_scale, max_time): its own rule words it
            continue
        value = cfg[key]
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
            if full_key not in _INT64_EXCEPT:
                found[full_key] = value
    return found


def check_values(cfg: DictConfig) -> None:
    """Check every key of :data:`VALUE_RULES` and every integer's range; one :class:`ConfigError` names each bad
    dotted key and what is valid."""
    out_of_range = _integers_out_of_range(cfg)
    problems = [
        f"config key '{key}': {integer_digits(value) if beyond_float(value) else value} is out of range; expected a "
        "64-bit integer, in [-2**63, 2**63)"
        for key, value in out_of_range.items()
    ]
    for key, (ok, valid) in VALUE_RULES.items():
        value = OmegaConf.select(cfg, key)
        if key not in out_of_range and not ok(value):
            meant = _look_alike(key, value)
            problems.append(
                f"config key '{key}': {shown(value)} is invalid; expected {valid}" + (f" ({meant})" if meant else "")
            )
    if not problems and (problem := _top_k_without_monitor(cfg)) is not None:
        problems.append(problem)
    if not problems and OmegaConf.select(cfg, "precision.fp8.enabled"):
        from ampkit.callbacks.precision_config import fp8_problems  # it resolves opt levels: the callbacks' layer

        problems = fp8_problems(cfg)
    if problems:
        raise ConfigError("; ".join(problems))


def _top_k_without_monitor(cfg: DictConfig) -> str | None:
    """``checkpoint.save_top_k`` above 1 without ``checkpoint.monitor`` ranks nothing, so it kept no file at all
    (Lightning's ModelCheckpoint refuses it too); -1 without a monitor keeps every step and epoch file."""
    top_k = OmegaConf.select(cfg, "checkpoint.save_top_k")
    if top_k in (1, -1) or not isinstance(top_k, int) or OmegaConf.select(cfg, "checkpoint.monitor"):
        return None
    return (
        f"config key 'checkpoint.save_top_k': {top_k} keeps the best checkpoints by checkpoint.monitor, which is not "
        "set: set checkpoint.monitor to a validation metric (val/loss), or checkpoint.keep_last to keep the newest "
        "step and epoch files (checkpoint.save_top_k=-1 without a monitor keeps every one)"
    )


def import_object(path: str, what: str = "trainer_class", search_from: Path | None = None) -> Any:
    """Import ``package.module:Name`` (or ``package.module.Name``).

    The working directory is importable; failing that, the nearest of ``search_from`` (a config file's folder)
    and its parents that holds the module's top package, so a repository's configs run from any directory.
    """
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{what}: '{path}' is not an import path; expected 'package.module:ClassName'")
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    imported_before = set(sys.modules)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        root = _project_root(search_from.resolve(), module_name) if search_from is not None else None
        if root is not None and _shadowed(module_name, exc, root):
            _import_top_package_from(root, module_name, imported_before, what)
            return import_object(path, what)
        if root is None or str(root) in sys.path:
            raise ConfigError(f"{what}: cannot import module '{module_name}' of '{path}' ({exc})") from None
        sys.path.append(str(root))
        return import_object(path, what)
    try:
        return getattr(module, attr)
    except AttributeError:
        # its own classes and those it exports (__all__), not the DataLoader it imported: no config names that
        exported = set(getattr(module, "__all__", ()))
        public = sorted(
            n
            for n, v in vars(module).items()
            if not n.startswith("_") and isinstance(v, type) and (v.__module__ == module.__name__ or n in exported)
        )
        close = difflib.get_close_matches(attr, public, n=1, cutoff=0.6)
        hint = f" (did you mean '{module_name}:{close[0]}'?)" if close else ""
        raise ConfigError(
            f"{what}: module '{module_name}' has no '{attr}'{hint}; classes it defines: {', '.join(public) or 'none'}"
        ) from None


def _shadowed(module_name: str, exc: ModuleNotFoundError, root: Path) -> bool:
    """Whether ``module_name`` was missing only because its top package came from somewhere other than ``root``
    (another installed ``examples`` package, say), while ``root`` holds the module the config names."""
    top, _, rest = module_name.partition(".")
    missing = exc.name or ""
    if not rest or not (module_name == missing or module_name.startswith(missing + ".")) or missing == top:
        return False
    cached = sys.modules.get(top)
    own = (root / top).resolve()
    if cached is None or any(Path(p).resolve() == own for p in getattr(cached, "__path__", ())):
        return False
    tail = Path(*rest.split("."))
    return (own / tail).with_suffix(".py").is_file() or (own / tail / "__init__.py").is_file()


def _import_top_package_from(root: Path, module_name: str, imported_before: set[str], what: str) -> None:
    """Bind ``module_name``'s top package to the one in ``root``, replacing the other one only where this lookup
    imported it; a package of that name the program imported before is kept, and the error says what clashes."""
    top = module_name.partition(".")[0]
    other = sys.modules[top]
    where = ", ".join(str(p) for p in getattr(other, "__path__", ())) or getattr(other, "__file__", None) or "?"
    if top in imported_before:
        raise ConfigError(
            f"{what}: cannot import '{module_name}': the package '{top}' this program already imported comes from "
            f"{where}, which has no such module; the config's project {root} has it in {root / top}: rename one "
            "of the two packages"
        )
    for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
        del sys.modules[name]  # the other package, imported by this lookup only
    spec = importlib.machinery.PathFinder.find_spec(top, [str(root)])
    if spec is None or spec.loader is None:
        raise ConfigError(f"{what}: cannot import '{top}' from {root}")
    package = importlib.util.module_from_spec(spec)
    sys.modules[top] = package
    try:
        spec.loader.exec_module(package)
    except BaseException:
        del sys.modules[top]
        raise
    if str(root) not in sys.path:
        sys.path.append(str(root))


def _valid_keys(schema: DictConfig, parent: str) -> list[str]:
    node = OmegaConf.select(schema, parent) if parent else schema
    return sorted(str(k) for k in node.keys()) if isinstance(node, DictConfig) else []


def _nearest_key(schema: DictConfig, parent: str, name: str, valid: list[str]) -> str:
    """`` (did you mean '...'?)`` for Lightning's name of a setting (``val_check_interval``), a key written in
    another section (``trainer.log_every_n_steps``, which is ``logging.log_every_n_steps``: that exact name beats a
    near one here) or a misspelt key (``max_epoch``); empty when nothing is near."""
    if name in LIGHTNING_SETTINGS:
        instead = LIGHTNING_SETTINGS[name]
        if instead.startswith("no config key: "):
            return f" (Lightning's {name} has no config key here: {instead.removeprefix('no config key: ')})"
        return f" (Lightning's {name}; here it is {instead})"
    elsewhere = [path for path in _key_paths(schema) if path.rpartition(".")[2] == name]
    if elsewhere:
        return f" (did you mean {' or '.join(repr(path) for path in elsewhere)}?)"
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.8)
    return f" (did you mean '{f'{parent}.' if parent else ''}{close[0]}'?)" if close else ""


def _key_paths(node: DictConfig, prefix: str = "") -> list[str]:
    """Every key's dotted path in ``node``, sections included."""
    paths = []
    for key in node.keys():
        path = f"{prefix}{key}"
        paths.append(path)
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            paths.extend(_key_paths(child, f"{path}."))
    return paths


# What the value of Lightning's setting that a key replaces means here, where its type is the key's error (a float for
# an int): the type error alone leaves a port's user guessing what to write.
_LIGHTNING_VALUES: dict[str, str] = {
    "trainer.val_every_n_steps": (
        "it takes a count of iterations: Lightning's fractional val_check_interval is that share of an epoch's "
        "iterations (num_train_batches / accumulate_grad_batches), e.g. 100 for 0.25 of 400"
    ),
    "trainer.val_every_n_epochs": (
        "Lightning's check_val_every_n_epoch=None, validation only every val_check_interval batches, is 0 here beside "
        "trainer.val_every_n_steps"
    ),
}


def _explain(exc: OmegaConfBaseException, schema: DictConfig) -> ConfigError:
    error = _explain_plainly(exc, schema)
    full_key = str(getattr(exc, "full_key", "") or "")
    if full_key in _LIGHTNING_VALUES and not str(error).startswith("unknown"):
        return ConfigError(f"{error}; {_LIGHTNING_VALUES[full_key]}")
    return error


def _explain_plainly(exc: OmegaConfBaseException, schema: DictConfig) -> ConfigError:
    full_key = str(getattr(exc, "full_key", "") or "")
    message = str(getattr(exc, "msg", None) or exc).splitlines()[0]
    key = str(getattr(exc, "key", None) or "")
    if type(exc).__name__ == "ConfigKeyError" and "." in key:  # {"trainer.max_steps": 3} in a dict or a YAML file
        first, _, rest = key.partition(".")
        return ConfigError(
            f"config key '{full_key}' is written with a dot inside one mapping; nest it ({first}: {{{rest}: ...}} in "
            "YAML, a dict in a dict in Python): the dotted form is for key=value overrides"
        )
    if type(exc).__name__ == "MissingMandatoryValue":  # a '???' (MISSING) field of the schema nothing set
        return ConfigError(
            f"config key '{full_key}' is required and has no value (the schema's '???'); set it, e.g. {full_key}=..."
        )
    empty = re.fullmatch(r"Incompatible value 'None' for field of type '(.+)'", message)
    if empty:  # key= on the command line, "key:" with no value in YAML
        return ConfigError(f"config key '{full_key}' is empty (null); expected a value of type {empty.group(1)}")
    if type(exc).__name__ == "ConfigKeyError" or "not in" in message:
        parent = full_key.rpartition(".")[0]
        valid = _valid_keys(schema, parent)
        where = f"'{parent}'" if parent else "the top level"
        hint = _nearest_key(schema, parent, full_key.rpartition(".")[2], valid)
        includes = (  # Hydra's defaults list: ampkit reads one file
            "; ampkit reads one file, with no includes (Hydra's defaults list): write the keys in it, or as key=value"
            if full_key == "defaults"
            else ""
        )
        return ConfigError(
            f"unknown config key '{full_key}'{hint}{includes}; valid keys at {where}: {', '.join(valid)}"
        )
    plainly = (
        wrong_type(message, getattr(exc, "value", None), _takes(schema, full_key))
        or interpolation_problem(message)
        or message
    )
    return ConfigError(f"config key '{full_key}': {plainly}")


def _takes(schema: DictConfig, full_key: str) -> str | None:
    """What ``full_key`` takes in words: its rule's (:data:`VALUE_RULES`) or its enum's members; None where its type
    says it all."""
    if full_key in VALUE_RULES:
        return VALUE_RULES[full_key][1]
    parent, _, key = full_key.rpartition(".")
    section = OmegaConf.select(schema, parent) if parent else schema
    node = section._get_node(key) if isinstance(section, DictConfig) and key in section else None
    return f"one of {', '.join(m.name for m in node.enum_type)}" if isinstance(node, EnumNode) else None


# The words OmegaConf reads as a boolean (YAML's and the command line's true/false are already booleans).
_BOOL_WORDS = frozenset({"true", "false", "yes", "no", "y", "n", "on", "off"})


def _reads_as_bool(value: Any) -> bool:
    """Whether ``value`` means a boolean: OmegaConf would also read any integer (``2``, ``"-1"``) as true."""
    if value is None or isinstance(value, bool):
        return True
    if isinstance(value, int):
        return value in (0, 1)
    if isinstance(value, str):  # an interpolation is checked once resolved; "???" is filled by a later source
        return "${" in value or value == MISSING or value.lower() in _BOOL_WORDS | {"0", "1"}
    return False


def _interpolated_non_bool(cfg: DictConfig, prefix: str = "") -> ConfigError | None:
    """The error for a boolean key given by an interpolation (``${oc.env:X}``, ``${other.key}``) that resolves to
    no boolean: OmegaConf converts what it resolves to the key's type, reading ``2`` as true."""
    for key in cfg.keys():
        node = cfg._get_node(key)
        if isinstance(node, DictConfig):
            found = _interpolated_non_bool(node, f"{prefix}{key}.")
            if found is not None:
                return found
        elif isinstance(node, BooleanNode) and node._is_interpolation():
            raw = node._value()
            resolved = cfg._maybe_resolve_interpolation(  # resolved as an untyped value, before the bool conversion
                parent=cfg, key=key, value=AnyNode(raw), throw_on_resolution_failure=True
            )._value()
            if not _reads_as_bool(resolved):
                return ConfigError(
                    f"config key '{prefix}{key}': {shown(raw)} gives {shown(resolved)}, which is not a boolean; "
                    "expected true or false (also yes/no, on/off, 1/0)"
                )
    return None


def _plain(source: Any) -> Any:
    """``source`` as nested dicts: a DictConfig's container, or a config dataclass instance's fields."""
    if isinstance(source, DictConfig):
        return OmegaConf.to_container(source)
    if is_config_instance(source):
        return {f.name: _plain(getattr(source, f.name)) for f in dataclasses.fields(source)}
    return source


def _wrong_shape(schema: DictConfig, sources: tuple[Any, ...]) -> ConfigError | None:
    """The error for a section given a plain value (``trainer=3``), a list key given anything but a list
    (``trainer.activation_checkpointing=Block``), which OmegaConf reports without its key or as a raw TypeError, a
    boolean key given anything but a boolean (``trainer.progress_bar=2``), which OmegaConf reads as true, or a float
    key given an integer no float holds (400 digits), which OmegaConf reports as a bare OverflowError."""

    def find(node: DictConfig, source: Any, prefix: str) -> ConfigError | None:
        if not isinstance(source, dict):
            return None
        for key, value in source.items():
            child = node._get_node(key) if isinstance(key, str) and key in node else None
            if isinstance(child, FloatNode) and beyond_float(value):  # OmegaConf: a bare OverflowError
                return ConfigError(
                    f"config key '{prefix}{key}': {integer_digits(value)} is out of range; "
                    f"expected a float, between -{sys.float_info.max:.4g} and {sys.float_info.max:.4g}"
                )
            if isinstance(child, BooleanNode) and not _reads_as_bool(value):
                padded = isinstance(value, str) and _reads_as_bool(value.strip())  # OmegaConf refuses " true"
                return ConfigError(
                    f"config key '{prefix}{key}': {shown(value)} is not a boolean; expected true or false "
                    "(also yes/no, on/off, 1/0)"
                    + (f" ({shown(value)} has spaces around it; write {value.strip()})" if padded else "")
                )
            length = _tuple_length(child)
            if length is not None and isinstance(value, list | tuple) and len(value) != length:
                return ConfigError(  # OmegaConf's own error names no key ("TupleConfig length 1 does not match")
                    f"config key '{prefix}{key}': {shown(list(value))} has {counted(len(value), 'item')}; "
                    f"expected {length} (e.g. {prefix}{key}={list(child)})"
                )
            if (isinstance(child, ListConfig) or length is not None) and not isinstance(value, list | tuple):
                if value is None and child._is_optional():
                    continue
                example = value if isinstance(value, str) and value.isidentifier() else "a, b"
                if length is not None:  # a pair such as betas: its default shows the shape
                    example = ", ".join(str(item) for item in child)
                return ConfigError(
                    f"config key '{prefix}{key}': {shown(value)} is not a list; expected a list, e.g. "
                    f"{prefix}{key}=[{example}] (a YAML list in a file)"
                )
            if not isinstance(child, DictConfig):
                continue
            keys = ", ".join(str(k) for k in child.keys())
            if value is None and not child._is_optional():  # "checkpoint:" with every key under it commented out
                return ConfigError(
                    f"config key '{prefix}{key}' is an empty section (null); set its keys ({prefix}{key}.<key>=...) or "
                    f"leave it out for the defaults: {keys}"
                )
            if value is not None and not isinstance(value, dict):
                keys = keys or f"a mapping of its own keys, e.g. {prefix}{key}={{name: value}}"  # a dict-typed field
                return ConfigError(
                    f"config key '{prefix}{key}' is a section, not a value ({shown(value)}); set its keys instead "
                    f"({prefix}{key}.<key>=...): {keys}"
                )
            found = find(child, value, f"{prefix}{key}.")
            if found is not None:
                return found
        return None

    for source in sources:
        found = find(schema, _plain(source), "")
        if found is not None:
            return found
    return None


def _tuple_length(node: Any) -> int | None:
    """The fixed length of a ``tuple[float, float]`` key's node; None for any other node (``tuple[int, ...]`` too)."""
    if not isinstance(node, TupleConfig):
        return None
    args = typing.get_args(node._metadata.ref_type)
    return None if not args or Ellipsis in args else len(args)


def _override_pairs(overrides: list[str]) -> list[tuple[str, str]]:
    """``(dotted key, value text)`` of each ``key=value`` override, each checked on its own so an error names it."""
    pairs = []
    for index, item in enumerate(overrides):
        key, equals, value = item.partition("=")
        # Hydra's "+key=value" (add) and "++key=value" (add or override): the schema decides which keys exist.
        key = key.removeprefix("++").removeprefix("+")
        if key.startswith("~"):  # Hydra's deletion: read as a key named '~trainer...' or as no key=value at all
            name = key[1:] if 1 < len(key) <= 81 else "the key"  # a long one is shown in the item
            raise ConfigError(
                f"override {shown(item)}: removing a key (Hydra's '~') is not supported, as every key of the schema "
                f"has a value; leave out the override to keep {name}'s default, or set it ({name}=<value>)"
            )
        if not equals or not key:
            after = overrides[index + 1 : index + 2]
            meant = (  # "trainer.max_epochs 3": LightningCLI's and argparse's spelling, a space for the '='
                f"; a value after a space is not taken: write {key}={after[0]}"
                if key and after and "=" not in after[0] and len(key + after[0]) <= 80  # else the example
                else " (e.g. trainer.max_epochs=3)"
            )
            raise ConfigError(f"override {shown(item)} is not of the form key=value{meant}")
        if not all(part.strip() == part and part for part in key.split(".")):
            raise ConfigError(
                f"override {shown(item)}: key {shown(key)} has an empty or space-padded part; expected a dotted key "
                "such as trainer.max_epochs"
            )
        try:
            OmegaConf.from_dotlist([f"{key}={value}"])
        except Exception as exc:  # OmegaConf's own errors and the YAML parser's (an unclosed [ or {)
            reason = (getattr(exc, "problem", None) or getattr(exc, "msg", None) or str(exc)).splitlines()[0]
            raise ConfigError(
                f"override {shown(item)}: cannot read the value {shown(value)} ({reason}); quote a string "
                f"(key='\"...\"'), close a list or mapping (key=[a, b], key={{a: 1}})"
            ) from None
        pairs.append((key, value))
    return pairs


def is_config_instance(value: Any) -> bool:
    """Whether ``value`` is a dataclass instance (a config schema filled in), which OmegaConf merges as a mapping."""
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def build_config(schema_class: type, *sources: Any) -> DictConfig:
    """Merge ``sources`` (dicts/DictConfigs) onto the dataclass ``schema_class``; errors become ConfigError."""
    if not (isinstance(schema_class, type) and dataclasses.is_dataclass(schema_class)):
        raise ConfigError(f"config_class must be a dataclass extending ampkit.Config, got {shown(schema_class)}")
    schema = OmegaConf.structured(schema_class)
    sources = tuple(_max_time_in_seconds(source) for source in sources)
    wrong = _wrong_shape(schema, sources)  # also before merging: OmegaConf reads trainer.progress_bar=2 as true
    if wrong is not None:
        raise wrong
    try:
        cfg = OmegaConf.merge(schema, *sources)
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except (OmegaConfBaseException, TypeError) as exc:  # TypeError: OmegaConf merging a mapping into a list
        raise _wrong_shape(schema, sources) or _explain(exc, schema) from None
    wrong = _interpolated_non_bool(cfg)
    if wrong is not None:
        raise wrong
    written = _max_time_written(sources)
    if isinstance(written, Mapping):  # merged, {days: 1} under {hours: 5} would silently add up to 29 hours
        OmegaConf.update(cfg, "trainer.max_time", written, merge=False)
    _expand_paths(cfg)
    OmegaConf.set_struct(cfg, True)
    remember_sources(cfg, _written_sources(sources))
    return cfg


def _written_sources(sources: tuple[Any, ...]) -> tuple[Any, ...]:
    """``sources`` as the plain mappings someone wrote: a config built before stands for the sources it was built
    from (a loaded config keeps its file and its overrides apart)."""
    written: list[Any] = []
    for source in sources:
        known = sources_of(source)
        written.extend(known if known is not None else (_plain(source),))
    return tuple(written)


def _max_time_written(sources: tuple[Any, ...]) -> Any:
    """The ``trainer.max_time`` of the last of ``sources`` that sets it (None where none does): a duration dict takes
    the place of an earlier one whole, as any other value does."""
    found = None
    for source in sources:
        trainer = source.get("trainer") if isinstance(source, dict | DictConfig) else None
        if isinstance(trainer, dict | DictConfig) and "max_time" in trainer:
            found = trainer["max_time"]
    return found


def _max_time_in_seconds(source: Any) -> Any:
    """``source`` with a ``datetime.timedelta`` as ``trainer.max_time`` (Lightning's form, which OmegaConf cannot hold)
    given as its seconds, in a copy: the caller's dict stays as written."""
    trainer = source.get("trainer") if isinstance(source, dict) else None
    if not (isinstance(trainer, dict) and isinstance(trainer.get("max_time"), datetime.timedelta)):
        return source
    return {**source, "trainer": {**trainer, "max_time": trainer["max_time"].total_seconds()}}


_UNSET_VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")


def expand_path(value: str, key: str) -> str:
    """``~`` and ``$VAR`` expanded as a shell would (an unset variable is an error naming it). ``${VAR}`` never gets
    here: OmegaConf resolves it first as another config key; in braces an environment variable is ``${oc.env:VAR}``."""
    expanded = os.path.expanduser(os.path.expandvars(value))
    unset = _UNSET_VARIABLE.search(expanded)
    if unset:
        raise ConfigError(
            f"config key '{key}': '{value}' names environment variable {unset.group(1)}, which is not set"
        )
    return expanded


def _expand_paths(cfg: DictConfig, prefix: str = "") -> None:
    """Expand ``~`` and environment variables in every path key: ``run_dir`` and every key typed ``Path``."""
    for key in list(cfg.keys()):
        full_key = f"{prefix}{key}"
        node = cfg._get_node(key)
        if isinstance(node, DictConfig):
            _expand_paths(node, f"{full_key}.")
        elif (full_key == "run_dir" or isinstance(node, PathNode)) and not OmegaConf.is_missing(cfg, key):
            value = cfg[key]
            if value is not None and str(value) != expand_path(str(value), full_key):
                cfg[key] = type(value)(expand_path(str(value), full_key))


def builtin_configs() -> dict[str, Path]:
    """The configs shipped inside the package (``ampkit/configs/*.yaml``), by name."""
    folder = Path(__file__).parent / "configs"
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def resolve_config_path(path: str | Path) -> Path:
    """``path`` if it is a file, else the built-in config of that name (``digits``)."""
    if not str(path).strip():  # Path("") is the working directory, which is no config
        builtin = ", ".join(builtin_configs()) or "none"
        raise ConfigError(f"--config {shown(str(path))} is empty; name a YAML file or a built-in config ({builtin})")
    candidate = Path(os.path.expanduser(str(path)))
    if candidate.is_file():
        return candidate
    if candidate.is_dir():
        raise ConfigError(f"--config '{path}' is a directory; name a YAML file in it (or a built-in config)")
    builtin = builtin_configs()
    if str(path) in builtin:
        return builtin[str(path)]
    raise ConfigError(
        f"config file '{path}' does not exist, and it is no built-in config (built-in: {', '.join(builtin) or 'none'})"
    )


def _top_level(path: Path) -> Any:
    """What a YAML file holds at its top level, as plain YAML reads it (a mapping when only OmegaConf can read it)."""
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except Exception:  # OmegaConf read it: its own loader's extensions
        return {}


# YAML 1.1 (PyYAML, so OmegaConf) reads unquoted digits joined by colons as base 60: ``1:00:00:00`` is 216000.
_BASE_60 = re.compile(r"[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?")


def _keep_base_60_texts(cfg: DictConfig, texts: dict[str, str]) -> None:
    """Put back, as written, each value of ``texts`` (``{dotted key: text}``) that YAML read as a base-60 number:
    nobody means ``max_time: 1:00:00:00`` (one day) as 2.5 days, or ``name: 12:30`` as 750."""
    for key, text in texts.items():
        if _BASE_60.fullmatch(text.strip()):
            OmegaConf.update(cfg, key, text.strip(), force_add=True)


def _scalar_texts(path: Path) -> dict[str, str]:
    """``{dotted key: text}`` of each plain (unquoted) scalar in a YAML file's mappings, as written."""
    import yaml

    texts: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    walk(value, f"{prefix}{key.value}.")
        elif isinstance(node, yaml.ScalarNode) and node.style is None:
            texts[prefix.rstrip(".")] = node.value

    try:
        walk(yaml.compose(path.read_text()), "")
    except Exception:  # OmegaConf read it: its own loader's extensions, which hold no base-60 number
        pass
    return texts


def _yaml_problem(exc: Exception, text: str | None = None) -> str:
    """A YAML error in one line: its problem and where (``did not find expected ',' at line 2, column 3``). ``text``:
    the YAML read, to name a tab where PyYAML's problem does not."""
    problem, mark = getattr(exc, "problem", None), getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        where = f"at line {mark.line + 1}, column {mark.column + 1}"
        line = (text or "").splitlines()[mark.line : mark.line + 1]
        if line and line[0][mark.column : mark.column + 1] == "\t":  # PyYAML names no character: "found character
            # that cannot start any token"
            return f"a tab {where}: YAML indents with spaces, never tabs"
        # an unclosed bracket or quote is found lines later (at the end of the file): where it opened is the line to fix
        context, opened = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context and opened is not None and opened.line != mark.line:
            where += f" ({context} that starts at line {opened.line + 1}, column {opened.column + 1})"
        return f"{problem} {where}"
    return " ".join(str(exc).split())


def load_config(path: str | Path, overrides: list[str] | None = None) -> tuple[type, DictConfig]:
    """Read ``path`` (a file, or the name of a built-in config such as ``digits``) and ``overrides``, import the
    named Trainer class, validate against its schema."""
    path = resolve_config_path(path)
    try:
        raw = OmegaConf.load(path)
    except GrammarParseError as exc:  # valid YAML, but a ${...} OmegaConf cannot read
        raise ConfigError(f"config key '{exc.full_key}': {malformed_interpolation(exc.value)}") from None
    except UnicodeDecodeError as exc:  # a binary file, or text in another encoding
        raise ConfigError(
            f"config file '{path}' is not a text file: byte {exc.object[exc.start]:#04x} at offset {exc.start} is not "
            "UTF-8; a config is a YAML file saved as UTF-8"
        ) from None
    except Exception as exc:  # yaml errors come in several types
        text = Path(path).read_text(errors="replace") if Path(path).is_file() else None
        raise ConfigError(f"config file '{path}' is not valid YAML: {_yaml_problem(exc, text)}") from None
    top = _top_level(path)  # not raw: OmegaConf reads a lone word as {word: None} and an empty file as {}
    if not isinstance(raw, DictConfig) or not isinstance(top, dict):
        got = "nothing (an empty file)" if top is None else f"a {type(top).__name__} ({str(top)[:40]!r})"
        raise ConfigError(
            f"config file '{path}' must hold a mapping at the top level (trainer_class: ..., trainer: ...); "
            f"it holds {got}"
        )
    pairs = _override_pairs(list(overrides or []))
    cli = OmegaConf.from_dotlist([f"{key}={value}" for key, value in pairs])
    _keep_base_60_texts(raw, _scalar_texts(path))
    _keep_base_60_texts(cli, dict(pairs))
    target = OmegaConf.select(cli, "trainer_class") or OmegaConf.select(raw, "trainer_class")
    if not target:
        raise ConfigError(f"config '{path}' must set trainer_class: 'package.module:TrainerSubclass'")
    from ampkit.trainer.trainer import Trainer

    trainer_class = import_object(str(target), search_from=path.parent)
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise ConfigError(f"trainer_class: '{target}' is {shown(trainer_class)}, not a subclass of ampkit.Trainer")
    return trainer_class, build_config(trainer_class.config_class, raw, cli)


def plain_config(cfg: DictConfig) -> dict[str, Any]:
    """``cfg`` resolved into the plain values a checkpoint holds (``torch.load(weights_only=True)`` rebuilds no
    ``Path`` or enum): enums by name, ``Path`` keys as strings, which the schema reads back as paths."""

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: plain(item) for key, item in value.items()}
        if isinstance(value, list):
            return [plain(item) for item in value]
        return str(value) if isinstance(value, os.PathLike) else value

    return plain(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))


def one_max_time(config: dict[str, Any], value: Callable[[Mapping[str, Any]], Any] = str) -> dict[str, Any]:
    """``config`` with a ``trainer.max_time`` dict (``{hours: 1}``) replaced by ``value`` of it (by default the dict as
    written): one setting, so a flattened view of the config (a message, TensorBoard's hparams) shows one key, not one
    per unit (``trainer.max_time.hours``)."""
    trainer = config.get("trainer")
    if not (isinstance(trainer, dict) and isinstance(trainer.get("max_time"), Mapping)):
        return config
    return {**config, "trainer": {**trainer, "max_time": value(trainer["max_time"])}}


def flatten(cfg: DictConfig | dict, prefix: str = "", sep: str = "/") -> dict[str, Any]:
    """``{"a/b": value}`` with TensorBoard-friendly scalars (lists and None become strings)."""
    container = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    flat: dict[str, Any] = {}
    for key, value in container.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, dict):
            flat.update(flatten(value, name, sep))
        elif isinstance(value, bool | int | float | str):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat
