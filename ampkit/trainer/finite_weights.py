"""Which weights of a model's state hold NaN/inf: the guard's check before a checkpoint is written, and the check
of the weights a checkpoint brings back (a resume or an evaluation from NaN weights yields nothing but NaN)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ampkit.ops.host_values import host_numbers
from ampkit.trainer.checkpoint_io import CheckpointError
from ampkit.trainer.distributed import DistributedEnv, all_reduce_sum
from ampkit.trainer.user_code import first_names


def nonfinite_entries(state: dict[str, Any], env: DistributedEnv | None = None) -> list[str]:
    """Names of the floating-point tensors in ``state`` (a model's state dict) holding a NaN or an inf.

    A sharded entry (FSDP's DTensor) is checked on this rank's shard; with ``env`` the ranks' verdicts are then
    summed (one collective, every rank calls it), so each rank names the same entries whichever shard holds them.
    """
    names = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if not names:
        return []
    local = [state[k].to_local() if isinstance(state[k], DTensor) else state[k] for k in names]
    bad = host_numbers(torch.isfinite(t).all().logical_not() for t in local)  # one sync for all, wherever they are
    if env is not None:
        bad = all_reduce_sum([float(b) for b in bad], env)
    return [name for name, b in zip(names, bad, strict=True) if b]


def check_saved_weights_finite(path: str | os.PathLike, model_state: Any, env: DistributedEnv | None = None) -> None:
    """Refuse the weights of checkpoint ``path`` unless they are a state dict with no NaN/inf: ampkit never writes
    other, so the file was damaged or written by other code, and training or evaluating from NaN gives NaN
    everywhere. ``env``: the state is sharded (FSDP), and every rank calls this so that all refuse it together."""
    if not isinstance(model_state, Mapping):  # load_state_dict's TypeError would name neither file nor entry
        raise CheckpointError(
            f"checkpoint '{path}' has a 'model' entry of type {type(model_state).__name__}; expected the model's "
            "state_dict (a dict of tensors): the file was written by other code or damaged"
        )
    bad = nonfinite_entries(model_state, env)
    if bad:
        verb = "holds" if len(bad) == 1 else "hold"
        raise CheckpointError(
            f"checkpoint '{path}' holds non-finite model weights ({first_names(bad)} {verb} "
            "NaN/inf): a diverged model (ampkit never saves one) or a damaged file; resume or evaluate an earlier "
            "checkpoint"
        )
