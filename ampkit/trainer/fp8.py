"""The fp8 set-up step (``precision.fp8``): convert the model's Linear layers once, before anything wraps it."""

from __future__ import annotations

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from omegaconf import DictConfig
from torch import nn

from ampkit.amp.fp8 import Float8Conversion, convert_to_float8, fp8_gemm_capable
from ampkit.config import ConfigError


def fsdp_float8_all_gather(fp8: DictConfig, sharded: bool) -> bool:
    """``precision.fp8.fsdp_float8_all_gather`` resolved (``sharded``: FSDP): ``auto`` is on for FSDP with torchao's
    tensorwise recipe, the only one whose weights torchao gathers in float8."""
    if not (fp8.enabled and sharded):
        return False
    if fp8.fsdp_float8_all_gather != "auto":
        return bool(fp8.fsdp_float8_all_gather)
    return fp8.backend == "torchao" and fp8.recipe == "tensorwise"


def convert_model_to_float8(module: nn.Module, cfg: DictConfig, device: torch.device) -> Float8Conversion | None:
    """Convert ``module``'s eligible Linears in place as ``precision.fp8`` says; what was converted and what was
    kept (None when fp8 is off).

    The ``fp8`` step of :data:`~ampkit.trainer.model_setup.MODEL_STEPS`: after ``configure_model`` and the rank-0
    broadcast, before activation checkpointing, compile, FSDP and ``configure_optimizers`` (the optimizers then
    hold the very parameters the float8 layers use).
    """
    f = cfg.precision.fp8
    if not f.enabled:
        return None
    emulate = not fp8_gemm_capable(device) if f.emulate == "auto" else bool(f.emulate)
    try:
        report = convert_to_float8(
            module,
            f.recipe,
            backend=f.backend,
            emulate=emulate,
            modules=list(f.modules),
            skip_modules=list(f.skip_modules),
            fsdp_float8_all_gather=fsdp_float8_all_gather(f, cfg.distributed.strategy == "fsdp"),
        )
    except ValueError as exc:
        raise ConfigError(f"config section 'precision.fp8': {exc}") from None
    if not report.converted:
        rank_zero_warn(f"precision.fp8 is enabled but no Linear layer was converted ({report.summary()})")
    return report
