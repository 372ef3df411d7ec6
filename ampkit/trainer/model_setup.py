"""The model as training code calls it: one ordered list of "apply X to the model" steps, stated here only.

:data:`MODEL_STEPS`, in the order the APIs require (torchtitan's order):

1. ``broadcast``: every rank starts from rank 0's weights, before anything derives from them (an O2 master copy,
   a cast). Under FSDP the shards come from one seeded initialisation instead.
2. convert steps, which replace modules, so they run before anything wraps, checkpoints or compiles them:
   ``fp8`` (``precision.fp8``) swaps the eligible ``nn.Linear`` layers for float8 ones.
3. ``activation_checkpointing``: each module whose class is named in ``trainer.activation_checkpointing``
   recomputes its forward during backward instead of keeping its activations. Before compile, so the compiler
   traces ``torch.utils.checkpoint`` as one region, and before sharding, so FSDP gathers the block's parameters
   again for the recompute.
4. ``compile_regions``: each module whose class is named in ``trainer.compile`` (a list) gets a compiled
   forward, in place: parameter names do not change, training code that calls a submodule directly (a GAN's
   ``generator``) runs it compiled, and FSDP's hooks stay outside the compiled region.
5. ``shard``: FSDP2 ``fully_shard`` per block, then the root (``distributed.strategy: fsdp``).
6. ``compile_whole_model`` (``trainer.compile: true``): ``torch.compile`` of the root; the result is what
   training code calls as ``self.model``, while ``self.module`` stays the bare model.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from torch.utils.checkpoint import checkpoint

from ampkit.config import ConfigError
from ampkit.trainer.distributed import DistributedEnv, broadcast_module_
from ampkit.trainer.fp8 import convert_model_to_float8
from ampkit.trainer.fsdp import shard_model
from ampkit.trainer.module_names import has_forward, modules_named
from ampkit.trainer.user_code import UserCodeError
from ampkit.wording import counted, shown

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class ModelSetup:
    """What the steps need, and what they did (``notes``: one line per applied step, for the start banner)."""

    cfg: DictConfig
    device: torch.device
    dist: DistributedEnv
    sharded: bool
    notes: dict[str, str] = field(default_factory=dict)
    compiled: bool = False  # some forward is compiled: the first step pays for compilation
    compiled_regions: list[nn.Module] = field(default_factory=list)  # modules compiled in place (trainer.compile)
    checkpointed: list[nn.Module] = field(default_factory=list)  # trainer.activation_checkpointing's modules

    @property
    def compile_setting(self) -> Any:
        return self.cfg.trainer.compile


ModelStep = Callable[[nn.Module, ModelSetup], nn.Module]


def _broadcast(module: nn.Module, setup: ModelSetup) -> nn.Module:
    if not setup.sharded:
        broadcast_module_(module, setup.dist)
    return module


def _convert_to_float8(module: nn.Module, setup: ModelSetup) -> nn.Module:
    report = convert_model_to_float8(module, setup.cfg, setup.device)
    if report is not None:
        setup.notes["fp8"] = report.summary()
    return module


def _activation_checkpointing(module: nn.Module, setup: ModelSetup) -> nn.Module:
    names = list(setup.cfg.trainer.activation_checkpointing)
    blocks = modules_named(module, names, "trainer.activation_checkpointing")
    for block in blocks:
        block.forward = functools.partial(_checkpointed, block.forward)
    setup.checkpointed = blocks
    if blocks:
        setup.notes["checkpointing"] = f"activations recomputed in backward: {_count(blocks)}"
    return module


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``forward`` under non-reentrant activation checkpointing (RNG state replayed: dropout recomputes alike)."""
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _compile_mode(setup: ModelSetup) -> str:
    """``trainer.compile_mode``. reduce-overhead off a GPU warns: what it adds to the default mode is CUDA graphs,
    which torch leaves out there without a word, so the key would change nothing, silently."""
    mode = setup.cfg.trainer.compile_mode
    if mode == "reduce-overhead" and setup.device.type != "cuda" and setup.dist.rank == 0:
        warnings.warn(
            f"config key 'trainer.compile_mode': 'reduce-overhead' adds CUDA graphs to the default mode, and on "
            f"{setup.device.type} there are none: it compiles as mode default does (leave the key out there)",
            stacklevel=2,
        )
    return mode


def _compile_regions(module: nn.Module, setup: ModelSetup) -> nn.Module:
    names = compiled_classes(setup.cfg)
    if not names:
        return module
    mode = _compile_mode(setup)
    blocks = modules_named(module, names, "trainer.compile")
    for block in blocks:
        block.forward = torch.compile(block.forward, mode=mode)
    setup.compiled, setup.compiled_regions = True, blocks
    setup.notes["compile"] = f"regional, mode {mode}: {_count(blocks)}"
    return module


def _shard(module: nn.Module, setup: ModelSetup) -> nn.Module:
    if not setup.sharded:
        return module
    from torch.distributed.fsdp import FSDPModule

    names = list(setup.cfg.distributed.fsdp.shard_modules)
    units = _count([sub for sub in list(module.modules())[1:] if type(sub).__name__ in names])  # before renaming
    module = shard_model(module, setup.cfg, setup.device)  # before the optimizers: they must hold its shards
    parts = [units] * bool(units) + ["the root"] * isinstance(module, FSDPModule)
    ranks = setup.dist.world_size
    setup.notes["sharding"] = f"FSDP2 over {counted(ranks, 'rank')}, one unit each: {', then '.join(parts)}"
    return module


MODEL_STEPS: list[tuple[str, ModelStep]] = [
    ("broadcast", _broadcast),
    ("fp8", _convert_to_float8),  # convert steps (module swaps) here: before anything wraps what they replace
    ("activation_checkpointing", _activation_checkpointing),
    ("compile_regions", _compile_regions),
    ("shard", _shard),
]


def setup_model(module: nn.Module, setup: ModelSetup) -> tuple[nn.Module, Any]:
    """Apply :data:`MODEL_STEPS` to ``module`` (already on its device), then compile the whole model if asked.

    Returns ``(module, model)``: the bare (possibly sharded) module, and what training code calls.
    """
    if setup.sharded or setup.compile_setting:  # before any step: FSDP's checkpoints would fail only at the first save
        refuse_getattr_breaking_hasattr(module)
    for _, step in MODEL_STEPS:
        module = step(module, setup)
    return module, compile_whole_model(module, setup)


def refuse_getattr_breaking_hasattr(module: nn.Module) -> None:
    """Refuse a module class of the model whose ``__getattr__`` raises another error than ``AttributeError`` for a
    name it lacks: torch's compile, FSDP and sharded state dicts look attributes up with ``hasattr``, which lets only
    ``AttributeError`` through, so such a run failed deep inside torch, naming an attribute the user never used (under
    FSDP at the first checkpoint, its training lost)."""
    seen: set[type] = set()
    for sub in module.modules():
        kind = type(sub)
        if kind in seen or kind.__getattr__ is nn.Module.__getattr__:
            continue
        seen.add(kind)
        try:
            sub._ampkit_attribute_no_module_has  # noqa: B018 (the lookup is the probe)
        except AttributeError:
            continue
        except Exception as probe:
            raise UserCodeError(
                f"{kind.__name__}.__getattr__ raises {type(probe).__name__} ({probe}) for an attribute it lacks, where "
                "Python expects AttributeError: torch's compile and FSDP (distributed.strategy, trainer.compile) look "
                "attributes up with hasattr(), which lets only AttributeError through. Raise AttributeError there, as "
                "nn.Module's __getattr__ does"
            ) from None


def compile_whole_model(module: nn.Module, setup: ModelSetup) -> Any:
    """``torch.compile(module)`` under ``trainer.compile: true``, else ``module``.

    Raises:
        ConfigError: the root has no ``forward`` (training code calls its children): compiling it compiles nothing.
    """
    if setup.compile_setting is not True:
        return module
    if not has_forward(module):
        children = sorted({type(child).__name__ for child in module.children()})
        raise ConfigError(
            f"config key 'trainer.compile': true compiles the model's forward, but {type(module).__name__} has none "
            f"(training code calls its children), so nothing would be compiled; name the classes to compile in "
            f"place instead, e.g. trainer.compile=[{children[0] if children else 'Block'}] (its children: "
            f"{', '.join(children) or 'none'})"
        )
    mode = _compile_mode(setup)
    setup.compiled = True
    setup.notes["compile"] = f"whole model, mode {mode}"
    return torch.compile(module, mode=mode)


def compiles_whole_model(cfg: DictConfig) -> bool:
    """Whether ``trainer.compile`` asks for the whole model (a wrapper such as DDP is then compiled too)."""
    return cfg.trainer.compile is True


def compiled_classes(cfg: DictConfig) -> list[str]:
    """The module classes ``trainer.compile`` names for regional compilation (empty for true/false)."""
    setting = cfg.trainer.compile
    return [] if isinstance(setting, bool) else list(setting)


def validate_model_setup(cfg: DictConfig) -> None:
    """Check ``trainer.compile``, ``trainer.compile_mode`` and ``trainer.activation_checkpointing`` before any
    user code runs (whether the named classes exist is known once the model is built).

    Raises:
        ConfigError: naming the dotted key, its value and what would be valid.
    """
    t = cfg.trainer
    setting = t.compile
    if not isinstance(setting, bool) and not (
        _is_list(setting) and len(setting) and all(isinstance(n, str) and n for n in setting)
    ):
        raise ConfigError(
            f"config key 'trainer.compile': {shown(_plain(setting))} is invalid; expected true (the whole model), "
            "false, or a non-empty list of module class names compiled in place (e.g. [Block])"
        )
    if t.compile_mode not in COMPILE_MODES:
        raise ConfigError(
            f"config key 'trainer.compile_mode': {shown(t.compile_mode)} is invalid; "
            f"expected one of {', '.join(COMPILE_MODES)}"
        )
    if setting is False and t.compile_mode != "default":
        raise ConfigError(
            f"config key 'trainer.compile_mode' is set ({shown(t.compile_mode)}) but trainer.compile is false; "
            "set trainer.compile to true or to a list of module classes"
        )
    names = t.activation_checkpointing
    if not all(isinstance(n, str) and n for n in names):
        raise ConfigError(
            f"config key 'trainer.activation_checkpointing': {shown(_plain(names))} is invalid; expected a list of "
            "module class names (e.g. [Block])"
        )


def _count(modules: list[nn.Module]) -> str:
    counts: dict[str, int] = {}
    for m in modules:
        counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
    return ", ".join(f"{name} x{n}" for name, n in counts.items())


def _is_list(value: Any) -> bool:
    from omegaconf import ListConfig

    return isinstance(value, list | tuple | ListConfig)


def _plain(value: Any) -> Any:
    from omegaconf import ListConfig, OmegaConf

    return OmegaConf.to_container(value) if isinstance(value, ListConfig) else value
