"""FusedSGD: SGD with momentum, dampening, Nesterov and weight decay in one pass (torch.optim.SGD maths)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from ampkit.ops.optimizers._base import Bucket, FusedOptimizer, acc_dtype, check_hyper, reject_option
from ampkit.ops.optimizers._kernels import op


class FusedSGD(FusedOptimizer):
    """SGD as ``torch.optim.SGD`` (state ``momentum_buffer``, created on a parameter's first step).

    Apex's ``materialize_master_grads`` is accepted for compatibility and has no effect: with
    ``master_weights=True`` the kernel reads the fp16/bf16 gradients directly.

    Example:
        >>> opt = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)  # doctest: +SKIP
    """

    _acc_state_keys = ("momentum_buffer",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        maximize: bool = False,
        master_weights: bool = False,
        set_grad_none: bool = True,
        wd_after_momentum: bool = False,
        materialize_master_grads: bool = True,
    ) -> None:
        reject_option("FusedSGD", "wd_after_momentum", wd_after_momentum, False)
        check_hyper("lr", lr)
        check_hyper("momentum", momentum)
        check_hyper("weight_decay", weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(
                f"Nesterov momentum requires momentum > 0 and dampening == 0; got momentum={momentum}, "
                f"dampening={dampening}"
            )
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
        )
        super().__init__(params, defaults, master_weights, set_grad_none)

    def _init_state(self, param: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """torch.optim.SGD keeps no state until the first momentum step; nothing to create here."""

    def _update(self, group: dict[str, Any], bucket: Bucket, grad_factor: float) -> None:
        momentum = group["momentum"]
        if momentum == 0:
            self._launch(group, bucket, [], first_step=False, grad_factor=grad_factor)
            return
        fresh = Bucket(has_master=bucket.has_master)
        seen = Bucket(has_master=bucket.has_master)
        for p, g, s in zip(bucket.params, bucket.grads, bucket.states, strict=True):
            target = seen if "momentum_buffer" in s else fresh
            if target is fresh:
                s["momentum_buffer"] = torch.empty_like(p, dtype=acc_dtype(p))
            target.params.append(p)
            target.grads.append(g)
            target.states.append(s)
        for part, first in ((seen, False), (fresh, True)):
            if part.params:
                self._launch(group, part, part.state_list("momentum_buffer"), first, grad_factor)

    def _launch(
        self,
        group: dict[str, Any],
        bucket: Bucket,
        buffers: list[Tensor],
        first_step: bool,
        grad_factor: float,
    ) -> None:
        op("sgd_step", bucket.device)(
            bucket.params,
            bucket.grads,
            buffers,
            bucket.masters(),
            group["lr"],
            group["weight_decay"],
            group["momentum"],
            group["dampening"],
            group["nesterov"],
            first_step,
            grad_factor,
        )
