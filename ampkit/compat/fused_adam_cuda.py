"""Apex's deprecated ``fused_adam_cuda`` extension, a top-level module served while the apex shim is installed.

Copies of Apex's first FusedAdam live on in other projects (OpenNMT-py's ``-optim fusedadam``, fairseq forks,
MASS, UniLM) and load it with ``importlib.import_module("fused_adam_cuda")``, then call
``fused_adam_cuda.adam(p.data, out_p, exp_avg, exp_avg_sq, grad, lr, beta1, beta2, eps, combined_scale, step,
eps_mode, bias_correction, weight_decay)`` per tensor, or ``adam_mt`` through ``multi_tensor_applier``. Both run
:func:`~ampkit.compat.legacy_fused_adam.first_adam_update` on any device; an empty ``out_p`` means no copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ampkit.compat._amp_c_lamb import switch_args
from ampkit.compat._pybind_numbers import pybind_numbers
from ampkit.compat.legacy_fused_adam import first_adam_update

__all__ = ["adam", "adam_mt"]


@pybind_numbers("fused_adam_cuda")
def adam(
    p: torch.Tensor,
    p_copy: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    grad_scale: float,
    step: int,
    mode: int,
    bias_correction: int = 1,
    decay: float = 0.0,
) -> None:
    """One tensor's step of Apex's first FusedAdam (its oldest callers pass neither ``bias_correction`` nor
    ``decay``)."""
    (bias_correction,) = switch_args("fused_adam_cuda.adam", bias_correction=bias_correction)
    first_adam_update(p, p_copy, m, v, g, lr, beta1, beta2, eps, grad_scale, step, mode, bias_correction, decay)


@pybind_numbers("fused_adam_cuda")
def adam_mt(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    grad_scale: float,
    step: int,
    mode: int,
    bias_correction: int = 1,
    decay: float = 0.0,
) -> None:
    """``adam`` over ``[params, exp_avgs, exp_avg_sqs, grads]`` (and a fifth list of copies), as
    ``multi_tensor_applier(fused_adam_cuda.adam_mt, overflow_buf, lists, ...)`` calls it."""
    (bias_correction,) = switch_args("fused_adam_cuda.adam_mt", bias_correction=bias_correction)
    if len(tensor_lists) not in (4, 5):
        raise ValueError(
            f"fused_adam_cuda.adam_mt: expected 4 lists [params, exp_avgs, exp_avg_sqs, grads] and optionally the "
            f"copies, got {len(tensor_lists)}"
        )
    for i, tensors in enumerate(tensor_lists):
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
            raise TypeError(
                f"fused_adam_cuda.adam_mt: tensor_lists[{i}] must be a list of tensors, got {type(tensors).__name__}"
            )
    lengths = {len(tensors) for tensors in tensor_lists}
    if len(lengths) != 1:
        raise ValueError(f"fused_adam_cuda.adam_mt: the lists differ in length ({[len(t) for t in tensor_lists]})")
    copies = tensor_lists[4] if len(tensor_lists) == 5 else [None] * len(tensor_lists[0])
    for p, m, v, g, p_copy in zip(*tensor_lists[:4], copies, strict=True):
        first_adam_update(p, p_copy, m, v, g, lr, beta1, beta2, eps, grad_scale, step, mode, bias_correction, decay)
