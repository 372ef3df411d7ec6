"""FusedRMSprop (torch.optim.RMSprop maths) and FusedRMSpropTF (TensorFlow/timm maths), one pass each."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from ampkit.ops.optimizers._base import NO_SCALER, Bucket, FusedOptimizer, ScalerTensors, acc_dtype, check_hyper
from ampkit.ops.optimizers._kernels import op
from ampkit.ops.optimizers._torch_keywords import check_torch_keywords


class _RMSpropFamily(FusedOptimizer):
    """What both RMSprops share: their state (``step``, ``square_avg`` from ``_square_init``, ``momentum_buffer``
    with momentum, ``grad_avg`` when centered), their hyper-parameter checks and their kernel call, whose schema
    takes the group's ``_extra_options`` after ``centered``."""

    _acc_state_keys = ("square_avg", "momentum_buffer", "grad_avg")
    _scaler_in_kernel = True
    _op: str
    _square_init: float
    _extra_options: tuple[str, ...] = ()

    def _setup(
        self,
        params: Iterable[Any],
        hyper: dict[str, float],
        options: dict[str, Any],
        master_weights: bool,
        set_grad_none: bool,
        backend: str | None,
    ) -> None:
        for name, value in hyper.items():
            check_hyper(name, value)
        FusedOptimizer.__init__(self, params, {**hyper, **options}, master_weights, set_grad_none, backend)

    def _init_state(self, param: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        dtype = acc_dtype(param)
        momentum, centered = self._state_inputs(group, ("momentum", "centered"))
        state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
        state["square_avg"] = torch.full_like(param, self._square_init, dtype=dtype)
        if momentum > 0:
            state["momentum_buffer"] = torch.zeros_like(param, dtype=dtype)
        if centered:
            state["grad_avg"] = torch.zeros_like(param, dtype=dtype)

    def _update(
        self, group: dict[str, Any], bucket: Bucket, grad_factor: float, scaler: ScalerTensors = NO_SCALER
    ) -> None:
        lr, alpha, eps, weight_decay, momentum = self.group_numbers(
            group, ("lr", "alpha", "eps", "weight_decay", "momentum")
        )
        op(self._op, bucket.device)(
            bucket.params,
            bucket.grads,
            bucket.state_list("square_avg"),
            bucket.state_list("grad_avg") if group["centered"] else [],
            bucket.state_list("momentum_buffer") if momentum > 0 else [],
            bucket.masters(),
            bucket.state_list("step"),
            lr,
            alpha,
            eps,
            weight_decay,
            momentum,
            group["centered"],
            *(group[name] for name in self._extra_options),
            grad_factor,
            *scaler,
        )


class FusedRMSprop(_RMSpropFamily):
    """RMSprop as ``torch.optim.RMSprop`` (state ``step``, ``square_avg``, ``momentum_buffer``, ``grad_avg``).

    Example:
        >>> opt = FusedRMSprop(model.parameters(), lr=1e-2, momentum=0.9, centered=True)  # doctest: +SKIP
    """

    _op = "rmsprop_step"
    _square_init = 0.0

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
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
        hyper = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum)
        options = dict(centered=centered, maximize=maximize)
        self._setup(params, hyper, options, master_weights, set_grad_none, backend)


class FusedRMSpropTF(_RMSpropFamily):
    """TensorFlow-style RMSprop as timm's ``RMSpropTF``: ``eps`` inside the square root, ``square_avg``
    starting at one, optional decoupled weight decay, and (by default) the learning rate applied inside
    the momentum buffer, which keeps the buffer consistent when the learning rate changes.

    Example:
        >>> opt = FusedRMSpropTF(model.parameters(), lr=1e-2, momentum=0.9)  # doctest: +SKIP
    """

    _op = "rmsprop_tf_step"
    _square_init = 1.0
    _extra_options = ("decoupled_decay", "lr_in_momentum")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        alpha: float = 0.9,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
        decoupled_decay: bool = False,
        lr_in_momentum: bool = True,
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
        hyper = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum)
        options = dict(
            centered=centered, decoupled_decay=decoupled_decay, lr_in_momentum=lr_in_momentum, maximize=maximize
        )
        self._setup(params, hyper, options, master_weights, set_grad_none, backend)
