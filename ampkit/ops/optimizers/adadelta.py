"""FusedAdadelta: torch.optim.Adadelta maths in one pass over parameters, gradients and both averages."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from ampkit.ops.optimizers._base import NO_SCALER, Bucket, FusedOptimizer, ScalerTensors, acc_dtype, check_hyper
from ampkit.ops.optimizers._kernels import op
from ampkit.ops.optimizers._torch_keywords import check_torch_keywords


class FusedAdadelta(FusedOptimizer):
    """Adadelta as ``torch.optim.Adadelta`` (state ``step``, ``square_avg``, ``acc_delta``).

    Example:
        >>> opt = FusedAdadelta(model.parameters(), lr=1.0)  # doctest: +SKIP
    """

    _acc_state_keys = ("square_avg", "acc_delta")
    _scaler_in_kernel = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1.0,
        rho: float = 0.9,
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        maximize: bool = False,
        master_weights: bool = False,
        set_grad_none: bool = True,
        *,
        backend: str | None = None,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
        capturable: bool = False,
    ) -> None:
        check_torch_keywords(
            type(self).__name__, foreach=foreach, fused=fused, differentiable=differentiable, capturable=capturable
        )
        check_hyper("lr", lr)
        check_hyper("rho", rho, 0.0, 1.0 + 1e-12)
        check_hyper("eps", eps)
        check_hyper("weight_decay", weight_decay)
        defaults = dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, master_weights, set_grad_none, backend)

    def _init_state(self, param: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
        state["square_avg"] = torch.zeros_like(param, dtype=acc_dtype(param))
        state["acc_delta"] = torch.zeros_like(param, dtype=acc_dtype(param))

    def _update(
        self, group: dict[str, Any], bucket: Bucket, grad_factor: float, scaler: ScalerTensors = NO_SCALER
    ) -> None:
        lr, rho, eps, weight_decay = self.group_numbers(group, ("lr", "rho", "eps", "weight_decay"))
        op("adadelta_step", bucket.device)(
            bucket.params,
            bucket.grads,
            bucket.state_list("square_avg"),
            bucket.state_list("acc_delta"),
            bucket.masters(),
            bucket.state_list("step"),
            lr,
            rho,
            eps,
            weight_decay,
            grad_factor,
            *scaler,
        )
