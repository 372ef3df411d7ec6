"""FusedSGD: SGD with momentum, dampening, Nesterov and weight decay in one pass (torch.optim.SGD maths)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from ampkit.ops._backend import lr_for_torch_op
from ampkit.ops.optimizers._base import (
    NO_SCALER,
    Bucket,
    FusedOptimizer,
    ScalerTensors,
    acc_dtype,
    check_hyper,
    decay_weights_,
)
from ampkit.ops.optimizers._kernels import op


class FusedSGD(FusedOptimizer):
    """SGD as ``torch.optim.SGD`` (state ``momentum_buffer``, created on a parameter's first step).

    The momentum buffer of an fp16/bf16 parameter is kept in the parameter's dtype with float32 math, as
    ``torch.optim.SGD`` and Apex do; ``fp32_momentum=True`` keeps it in float32 instead (less rounding, twice
    the memory). With ``master_weights=True`` the buffer belongs to the fp32 master and is float32.

    Apex's ``materialize_master_grads`` is accepted for compatibility and has no effect: with
    ``master_weights=True`` the kernel reads the fp16/bf16 gradients directly.

    Buckets whose momentum buffers are in the parameter's dtype (no master weights, no ``fp32_momentum``, no
    ``wd_after_momentum``) run ``torch._fused_sgd_`` where ``backend`` routes them there (on a GPU under
    ``auto``), bit-identical to ``torch.optim.SGD(fused=True)``, except that a buffer created on a step that
    ``found_inf`` skips starts at zero here (torch's holds uninitialised memory then).

    Example:
        >>> opt = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)  # doctest: +SKIP
    """

    _scaler_in_kernel = True
    _torch_op = "_fused_sgd_"
    # Under ``auto`` on the CPU every bucket stays on ampkit's kernel: it measured 1.25x / 1.01x / 1.01x torch's
    # fused SGD at 1M / 10M / 50M params (66 tensors); through torch's op the update runs at torch's speed.

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
        materialize_master_grads: bool = True,
        set_grad_none: bool = True,
        *,
        maximize: bool = False,
        master_weights: bool = False,
        fp32_momentum: bool = False,
        backend: str | None = None,
    ) -> None:
        check_hyper("lr", lr)
        check_hyper("momentum", momentum)
        check_hyper("weight_decay", weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(
                f"Nesterov momentum requires momentum > 0 and dampening == 0; got momentum={momentum}, "
                f"dampening={dampening}"
            )
        if not isinstance(fp32_momentum, bool):
            raise TypeError(f"fp32_momentum must be a bool; got {fp32_momentum!r}")
        self.fp32_momentum = fp32_momentum
        self.wd_after_momentum = bool(wd_after_momentum)  # Apex: weight decay added after the momentum update
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
        )
        super().__init__(params, defaults, master_weights, set_grad_none, backend)

    def _init_state(self, param: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """torch.optim.SGD keeps no state until the first momentum step; nothing to create here."""

    def _state_in_acc_dtype(self, key: str, saved: dict[str, Any]) -> bool:
        if key == "momentum_buffer":
            return self.fp32_momentum or "master_param" in saved
        return super()._state_in_acc_dtype(key, saved)

    def _buffer_dtype(self, param: Tensor, has_master: bool) -> torch.dtype:
        return acc_dtype(param) if self.fp32_momentum or has_master else param.dtype

    def _torch_can_run(self, group: dict[str, Any], param: Tensor) -> bool:
        return not self.wd_after_momentum and self._buffer_dtype(param, False) == param.dtype

    def _update(
        self, group: dict[str, Any], bucket: Bucket, grad_factor: float, scaler: ScalerTensors = NO_SCALER
    ) -> None:
        momentum = group["momentum"]
        if momentum == 0:
            self._launch(group, bucket, [], False, grad_factor, scaler)
            return
        buffers = [s.get("momentum_buffer") for s in bucket.states]
        if all(b is not None for b in buffers):  # every step after each parameter's first: the bucket as it is
            self._launch(group, bucket, buffers, False, grad_factor, scaler)
            return
        # Under a device found_inf the kernel may skip the step that creates the buffers, and the host does not
        # know. Without dampening a zero buffer updated as usual becomes the gradient, exactly what a first step
        # writes: such buffers start at zero and take the usual update, and a skipped step leaves them at zero
        # for the next one, with no host read. With dampening the first step differs, so found_inf is read on
        # the host, once, on the step that creates the buffers: a skipped step drops them again.
        zero_start = scaler.found_inf is not None and group["dampening"] == 0
        fresh = Bucket(has_master=bucket.has_master)
        seen = Bucket(has_master=bucket.has_master)
        for p, g, s in zip(bucket.params, bucket.grads, bucket.states, strict=True):
            target = seen
            if "momentum_buffer" not in s:
                dtype = self._buffer_dtype(p, bucket.has_master)
                if zero_start:
                    s["momentum_buffer"] = torch.zeros_like(p, dtype=dtype)
                else:
                    s["momentum_buffer"] = torch.empty_like(p, dtype=dtype)
                    target = fresh
            target.params.append(p)
            target.grads.append(g)
            target.states.append(s)
        if fresh.params and scaler.found_inf is not None and bool(scaler.found_inf):
            for s in fresh.states:
                del s["momentum_buffer"]
            fresh = Bucket(has_master=bucket.has_master)
        for part, first in ((seen, False), (fresh, True)):
            if part.params:
                self._launch(group, part, part.state_list("momentum_buffer"), first, grad_factor, scaler)

    def _launch(
        self,
        group: dict[str, Any],
        bucket: Bucket,
        buffers: list[Tensor],
        first_step: bool,
        grad_factor: float,
        scaler: ScalerTensors,
    ) -> None:
        if self._routes_to_torch(group, bucket, grad_factor, scaler):
            torch._fused_sgd_(
                bucket.params,
                bucket.grads,
                buffers,
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                lr=lr_for_torch_op(group["lr"], bucket.device),
                dampening=group["dampening"],
                nesterov=group["nesterov"],
                maximize=group["maximize"],
                is_first_step=first_step,
                grad_scale=scaler.grad_scale,
                found_inf=scaler.found_inf,
            )
            return
        weight_decay = group["weight_decay"]
        if self.wd_after_momentum and weight_decay != 0:  # w -= lr * (momentum update + wd * w)
            decay_weights_(bucket.masters() or bucket.params, 1.0 - group["lr"] * weight_decay, scaler.found_inf)
            weight_decay = 0.0
        sgd_step(
            bucket.params,
            bucket.grads,
            buffers,
            bucket.masters(),
            lr=group["lr"],
            weight_decay=weight_decay,
            momentum=group["momentum"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            first_step=first_step,
            grad_factor=grad_factor,
            scaler=scaler,
        )


def sgd_step(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    master_params: list[Tensor],
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    first_step: bool,
    grad_factor: float,
    scaler: ScalerTensors = NO_SCALER,
) -> None:
    """One ``sgd_step`` kernel launch; momentum buffers may be in float32 or in the (half) param dtype.

    The kernel does its math in float32 on float32 buffers: a half-precision buffer goes through a float32
    copy and is rounded once on the way back (the update itself uses the unrounded value, as Apex's does).
    """
    staged = [b if b.dtype == acc_dtype(b) else b.float() for b in momentum_buffers]
    device = params[0].device if params else torch.device("cpu")
    op("sgd_step", device)(
        params,
        grads,
        staged,
        master_params,
        lr,
        weight_decay,
        momentum,
        dampening,
        nesterov,
        first_step,
        grad_factor,
        *scaler,
    )
    for buffer, value in zip(momentum_buffers, staged, strict=True):
        if buffer is not value:
            buffer.copy_(value)
