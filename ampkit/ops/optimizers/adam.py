"""FusedAdam: Adam/AdamW in one pass over parameters, gradients and moments (Apex semantics)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from ampkit.ops.optimizers._base import NO_SCALER, Bucket, FusedOptimizer, ScalerTensors, acc_dtype, check_hyper
from ampkit.ops.optimizers._kernels import op


class FusedAdam(FusedOptimizer):
    """Adam with decoupled weight decay by default (``adam_w_mode=True``, i.e. AdamW), as Apex's FusedAdam.

    State (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``) matches ``torch.optim.Adam``/``AdamW``,
    so checkpoints move between them. ``adam_w_mode=False`` adds ``weight_decay * param`` to the gradient
    (torch.optim.Adam). Unlike Apex, ``amsgrad`` is supported.

    ``capturable=True`` is accepted as in Apex (which requires it for ``master_weights=True``; here either works
    alone) and ``lr`` may be a one-element tensor; the update is the same. The step count lives on the
    parameter's device, where the kernel reads and advances it (as torch's fused Adam keeps it), but ``lr`` is
    read on the host, so the step is not CUDA-graph capturable.

    Example:
        >>> opt = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)  # doctest: +SKIP
    """

    _acc_state_keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    _scaler_in_kernel = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        check_hyper("lr", float(lr))
        check_hyper("eps", eps)
        check_hyper("betas[0]", betas[0], 0.0, 1.0)
        check_hyper("betas[1]", betas[1], 0.0, 1.0)
        check_hyper("weight_decay", weight_decay)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            adam_w_mode=adam_w_mode,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            capturable=capturable,
        )
        super().__init__(params, defaults, master_weights, set_grad_none)

    def _init_state(self, param: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
        state["exp_avg"] = torch.zeros_like(param, dtype=acc_dtype(param))
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=acc_dtype(param))
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(param, dtype=acc_dtype(param))

    def _update(
        self, group: dict[str, Any], bucket: Bucket, grad_factor: float, scaler: ScalerTensors = NO_SCALER
    ) -> None:
        amsgrad = group["amsgrad"]
        beta1, beta2 = group["betas"]
        op("adam_step", bucket.device)(
            bucket.params,
            bucket.grads,
            bucket.state_list("exp_avg"),
            bucket.state_list("exp_avg_sq"),
            bucket.state_list("max_exp_avg_sq") if amsgrad else [],
            bucket.masters(),
            bucket.state_list("step"),
            float(group["lr"]),
            beta1,
            beta2,
            group["eps"],
            group["weight_decay"],
            group["adam_w_mode"],
            amsgrad,
            group["bias_correction"],
            grad_factor,
            *scaler,
        )
