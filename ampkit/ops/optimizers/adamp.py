"""FusedAdamP (Heo et al., clovaai/AdamP semantics): Adam whose update is projected off the radial
direction of scale-invariant weights.

One kernel runs the step: per weight of two or more dimensions, a pass updates the moments and sums what the
projection test needs per row, and a second applies the projected direction. On CUDA that kernel is opt-in
(``AMPKIT_CUDA_KERNELS=multi_tensor``) until a GPU run has checked it; by default the step runs as torch ops
(``ampkit.ops.reference.optimizers.adamp_step``) that decide the projection on the device, with no host read
per tensor. GradScaler's ``found_inf``/``grad_scale`` are read once per step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from ampkit.ops._layout import rows_are_blocks
from ampkit.ops.optimizers._base import Bucket, FusedOptimizer, acc_dtype, check_betas, check_hyper
from ampkit.ops.optimizers._kernels import op
from ampkit.ops.optimizers._torch_keywords import check_torch_keywords
from ampkit.ops.reference import optimizers as reference


class FusedAdamP(FusedOptimizer):
    """AdamP with the reference implementation's defaults (state ``step``, ``exp_avg``, ``exp_avg_sq``).

    Example:
        >>> opt = FusedAdamP(model.parameters(), lr=1e-3, weight_decay=1e-2)  # doctest: +SKIP
    """

    _acc_state_keys = ("exp_avg", "exp_avg_sq")
    _updates_shards = False  # norms over whole tensors

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        delta: float = 0.1,
        wd_ratio: float = 0.1,
        nesterov: bool = False,
        master_weights: bool = False,
        set_grad_none: bool = True,
        *,
        backend: str | None = None,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
        capturable: bool = False,
        maximize: bool = False,
    ) -> None:
        check_torch_keywords(
            type(self).__name__, foreach=foreach, fused=fused, differentiable=differentiable, capturable=capturable
        )
        check_hyper("lr", lr)
        check_hyper("eps", eps)
        betas = check_betas(betas)
        check_hyper("weight_decay", weight_decay)
        check_hyper("delta", delta, finite=False)
        check_hyper("wd_ratio", wd_ratio)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            delta=delta,
            wd_ratio=wd_ratio,
            nesterov=nesterov,
            maximize=maximize,
        )
        super().__init__(params, defaults, master_weights, set_grad_none, backend)

    def _init_state(self, param: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(param, dtype=acc_dtype(param))
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=acc_dtype(param))

    def _update(self, group: dict[str, Any], bucket: Bucket, grad_factor: float) -> None:
        lr, beta1, beta2, eps, weight_decay, delta, wd_ratio = self.group_numbers(
            group, ("lr", "betas", "eps", "weight_decay", "delta", "wd_ratio")
        )
        # The kernels sum each row of a weight over its block of memory; a weight stored transposed has its rows
        # spread across memory, so its bucket takes the reference's torch ops, which index rows as torch does.
        step = op("adamp_step", bucket.device) if all(map(rows_are_blocks, bucket.params)) else reference.adamp_step
        step(
            bucket.params,
            bucket.grads,
            bucket.state_list("exp_avg"),
            bucket.state_list("exp_avg_sq"),
            bucket.masters(),
            bucket.state_list("step"),
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            delta,
            wd_ratio,
            group["nesterov"],
            grad_factor,
        )
