"""FSDP2 sharding (``distributed.strategy: fsdp``): its config checks, ``fully_shard`` wrapping and precision policy.

Each rank keeps a 1/N shard of every parameter (a ``DTensor``), of its gradient and of the optimizer state;
the modules named in ``distributed.fsdp.shard_modules`` are all-gathered one at a time for their forward
and backward, and gradients are reduce-scattered in float32. Under O2 the sharded float32 parameters are
the master weights: FSDP casts the gathered copy to ``precision.dtype`` for compute, so there is no second
fp32 copy and no model cast. Loss scaling, the skip verdict and clipping stay the Trainer's and its
callbacks'; they see sharded gradients, whose inf flags and norms are agreed over ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ampkit.amp import OptLevelProperties
from ampkit.config import ConfigError, DistributedConfig
from ampkit.trainer.module_names import has_forward, modules_named
from ampkit.wording import shown

STRATEGIES = ("ddp", "fsdp")


def uses_fsdp(cfg: DictConfig) -> bool:
    """Whether the config asks for FSDP sharding."""
    return cfg.distributed.strategy == "fsdp"


def validate_strategy(cfg: DictConfig) -> None:
    """Reject an unknown strategy, FSDP knobs without ``strategy: fsdp`` and what FSDP cannot combine with.

    Raises:
        ConfigError: naming the dotted key, its value and what would be valid.
    """
    d = cfg.distributed
    if d.strategy not in STRATEGIES:
        raise ConfigError(f"config key 'distributed.strategy': {shown(d.strategy)} is invalid; expected ddp or fsdp")
    if d.strategy != "fsdp":
        fsdp_knobs = {
            "distributed.fsdp.shard_modules": list(d.fsdp.shard_modules) or None,
            "distributed.fsdp.reshard_after_forward": d.fsdp.reshard_after_forward,
            "distributed.fsdp.cpu_offload": d.fsdp.cpu_offload or None,
        }
        for key, value in fsdp_knobs.items():
            if value is not None:
                raise ConfigError(
                    f"config key '{key}' is set ({shown(value)}) but distributed.strategy is '{d.strategy}'; "
                    "FSDP knobs apply only with distributed.strategy: fsdp"
                )
        return
    p = cfg.precision
    conflicts = {
        "trainer.compile": (
            cfg.trainer.compile is True,
            "the whole model would be compiled around FSDP's hooks; name the blocks to compile instead "
            "(trainer.compile=[Block]: each compiled in place, then sharded)",
        ),
        "precision.combine_grad": (
            p.combine_grad,
            "FSDP already keeps each rank's gradient shard in one flat buffer; set it to false",
        ),
        "precision.opt_level": (
            fsdp_param_dtype(p) is None and _recipe(p).cast_model_type not in (None, torch.float32),
            "a cast model without fp32 master weights (O3, or master_weights false) cannot be sharded: FSDP's "
            "sharded parameters are the fp32 masters; use O2/O5 (compute in precision.dtype) or O1/O4",
        ),
        "distributed.grad_sync": (
            d.grad_sync != "auto",
            "FSDP reduce-scatters gradients itself; leave it at auto",
        ),
        "distributed.fsdp.cpu_offload": (
            d.fsdp.cpu_offload and (cfg.trainer.device == "cpu" or not torch.cuda.is_available()),
            "it moves shards between GPU and CPU memory; with trainer.device cpu they are in CPU memory already",
        ),
        "distributed.sync_batchnorm": (d.sync_batchnorm, "it is supported with strategy ddp only"),
        "distributed.find_unused_parameters": (d.find_unused_parameters, "it is a DDP knob"),
        "distributed.static_graph": (d.static_graph, "it is a DDP knob"),
        "distributed.gradient_as_bucket_view": (d.gradient_as_bucket_view, "it is a DDP knob"),
        "distributed.bucket_cap_mb": (d.bucket_cap_mb != DistributedConfig.bucket_cap_mb, "it is a DDP knob"),
    }
    for key, (bad, why) in conflicts.items():
        if bad:
            value = OmegaConf.select(cfg, key)
            raise ConfigError(
                f"config key '{key}': {shown(value)} cannot be used with distributed.strategy: fsdp ({why})"
            )


def _recipe(precision: DictConfig) -> OptLevelProperties:
    from ampkit.callbacks.precision_config import resolve_precision  # the callbacks package imports the trainer's

    return resolve_precision(precision)


def fsdp_param_dtype(precision: DictConfig) -> torch.dtype | None:
    """The dtype FSDP gathers parameters in for compute: the model cast of a level with fp32 master weights
    (O2, O5), else None (fp32 parameters; O1/O4 autocast as without FSDP)."""
    recipe = _recipe(precision)
    cast = recipe.cast_model_type
    return cast if cast not in (None, torch.float32) and recipe.master_weights else None


def shard_model(module: nn.Module, cfg: DictConfig, device: torch.device) -> nn.Module:
    """``fully_shard`` every submodule whose class is named in ``distributed.fsdp.shard_modules`` (innermost
    first), then the root. Needs a process group (one rank is fine).

    Raises:
        ConfigError: a named class the model does not contain (listing the classes it does), or a container class
            (``ModuleList``), which ``fully_shard`` refuses.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    knobs = cfg.distributed.fsdp
    names = list(knobs.shard_modules)
    named = modules_named(module, names, "distributed.fsdp.shard_modules", nested=True)  # FSDP2 nests units
    param_dtype = fsdp_param_dtype(cfg.precision)
    inner = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    root = MixedPrecisionPolicy(
        param_dtype=param_dtype,
        reduce_dtype=torch.float32,
        output_dtype=torch.float32 if param_dtype is not None else None,
    )
    common = {
        "mesh": init_device_mesh(device.type, (dist.get_world_size(),)),
        "reshard_after_forward": True if knobs.reshard_after_forward is None else knobs.reshard_after_forward,
        "offload_policy": CPUOffloadPolicy() if knobs.cpu_offload else OffloadPolicy(),
    }
    units = [sub for sub in named if sub is not module]
    container = not has_forward(module)  # a ModuleDict whose children training code calls
    if container:
        covered = {id(p) for unit in units for p in unit.parameters()}
        loose = [name for name, p in module.named_parameters() if id(p) not in covered]
        if loose:
            raise ConfigError(
                f"config key 'distributed.fsdp.shard_modules': {names} leaves parameters {loose[:4]} unsharded; "
                f"the model's root ({type(module).__name__}) has no forward, so name the classes of the "
                f"modules training code calls ({', '.join(sorted({type(c).__name__ for c in module.children()}))})"
            )
    for sub in reversed(units):  # innermost first: FSDP2 shards bottom-up; a called unit is its own root
        fully_shard(sub, mp_policy=root if container else inner, **common)
    if not container:
        fully_shard(module, mp_policy=root, **common)
    return module


def full_norm(norm: torch.Tensor) -> torch.Tensor:
    """A gradient norm as a plain tensor: the global value when it was computed over DTensor shards."""
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def backward_to(loss: torch.Tensor, inputs: list[torch.Tensor] | None, module: nn.Module) -> None:
    """``loss.backward(inputs=inputs)`` for a sharded model.

    Autograd reaches FSDP's gathered copies, not the sharded parameters, so ``inputs`` cannot name them:
    the backward runs over every parameter and the gradients outside ``inputs`` are put back as they were
    (set aside, since FSDP accumulates into an existing gradient in place).
    """
    if inputs is None:
        loss.backward()
        return
    targets = {id(t) for t in inputs}
    others = [p for p in module.parameters() if id(p) not in targets]
    before = [p.grad for p in others]
    for param in others:
        param.grad = None
    loss.backward()
    for param, grad in zip(others, before, strict=True):
        param.grad = grad
