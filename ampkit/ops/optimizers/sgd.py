"""FusedSGD: SGD with momentum, dampening, Nesterov and weight decay in one pass (torch.optim.SGD maths)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import _RequiredParameter, required

from ampkit.ops._backend import lr_for_torch_op
from ampkit.ops.optimizers._base import (
    NO_SCALER,
    Bucket,
    FusedOptimizer,
    ScalerTensors,
    acc_dtype,
    check_flag,
    check_hyper,
    decay_weights_,
)
from ampkit.ops.optimizers._kernels import op
from ampkit.ops.optimizers._torch_keywords import check_torch_keywords
from ampkit.wording import shown


class _PendingFirstStep:
    """Momentum buffers (with dampening) made on a step that GradScaler's device ``found_inf`` may skip: ``flag``
    stays 1 on the device while every step since has been skipped, so their first step, which differs from the
    usual one, is still to come. The host learns it has passed without waiting for the device: on the CPU by
    reading the flag, on a GPU from a copy into host memory once the device has written it."""

    def __init__(self, device: torch.device) -> None:
        self.flag = torch.ones((), device=device)
        self._host: Tensor | None = None
        self._copied: Any = None  # the CUDA event after the copy into ``_host``

    def skip_flags(self, found_inf: Tensor | None) -> tuple[Tensor, Tensor]:
        """``found_inf`` for the first-step launch (skip unless pending and not skipped) and for the usual one."""
        overflow = self.flag.new_zeros(()) if found_inf is None else (found_inf.reshape(()) != 0).float()
        waiting = (self.flag != 0).float()
        return torch.maximum(overflow, 1 - waiting), torch.maximum(overflow, waiting)

    def taken(self, found_inf: Tensor | None) -> None:
        """After this step's launches: still pending only if the step was skipped."""
        if found_inf is None:
            self.flag.zero_()
        else:
            self.flag.mul_((found_inf.reshape(()) != 0).float())
        if self.flag.device.type == "cuda":
            if self._host is None:
                self._host = torch.empty((), pin_memory=True)
            self._host.copy_(self.flag, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def done(self) -> bool:
        """Whether the first step is known, on the host and without a sync, to have been taken."""
        if self.flag.device.type != "cuda":
            return not bool(self.flag)
        return self._copied is not None and self._copied.query() and not bool(self._host)


class FusedSGD(FusedOptimizer):
    """SGD as ``torch.optim.SGD`` (state ``momentum_buffer``, created on a parameter's first step).

    The momentum buffer of an fp16/bf16 parameter is kept in the parameter's dtype with float32 math, as
    ``torch.optim.SGD`` and Apex do; ``fp32_momentum=True`` keeps it in float32 instead (less rounding, twice
    the memory). With ``master_weights=True`` the buffer belongs to the fp32 master and is float32.

    ``lr=torch.optim.optimizer.required`` (Apex's default, which wrappers of it pass on) takes each param group's own
    ``lr``; a group without one is torch's ``ValueError``.

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
    _scratch_attrs = (*FusedOptimizer._scratch_attrs, "_pending_first")
    _lazy_state_keys = ("momentum_buffer",)
    # Under ``auto`` on the CPU every bucket stays on ampkit's kernel: it measured 1.25x / 1.01x / 1.01x torch's
    # fused SGD at 1M / 10M / 50M params (66 tensors); through torch's op the update runs at torch's speed.

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | _RequiredParameter = 1e-3,
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
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
        capturable: bool = False,
    ) -> None:
        check_torch_keywords(
            type(self).__name__, foreach=foreach, fused=fused, differentiable=differentiable, capturable=capturable
        )
        check_flag("wd_after_momentum", wd_after_momentum)  # a truthy "False" switched the decay's order
        check_flag("materialize_master_grads", materialize_master_grads)
        if lr is not required:  # Apex's default, which wrappers pass on: then every param group names its own lr
            check_hyper("lr", lr)
        check_hyper("momentum", momentum)
        check_hyper("weight_decay", weight_decay)
        check_flag("nesterov", nesterov)  # before it is read: "False" was refused as a Nesterov without momentum
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(
                f"Nesterov momentum requires momentum > 0 and dampening == 0; got momentum={momentum}, "
                f"dampening={dampening}"
            )
        if not isinstance(fp32_momentum, bool):
            raise TypeError(f"fp32_momentum must be a bool; got {shown(fp32_momentum)}")
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
        self._pending_first: dict[Tensor, _PendingFirstStep] = {}

    def _load_state(self, state_dict: dict[str, Any]) -> None:
        """torch's loader; buffers loaded from a checkpoint have had their first step."""
        self._pending_first.clear()
        super()._load_state(state_dict)

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
        momentum, dampening = self.group_numbers(group, ("momentum", "dampening"))
        if momentum == 0:
            self._launch(group, bucket, [], False, grad_factor, scaler)
            return
        if all("momentum_buffer" in s for s in bucket.states) and not any(
            p in self._pending_first for p in bucket.params
        ):
            buffers = bucket.state_list("momentum_buffer")
            self._launch(group, bucket, buffers, False, grad_factor, scaler)  # every later step: the bucket as it is
            return
        # Under a device found_inf the kernel may skip the step that creates the buffers, and the host does not
        # know. Without dampening a zero buffer updated as usual becomes the gradient, exactly what a first step
        # writes: such buffers start at zero and take the usual update, and a skipped step leaves them at zero for
        # the next one. With dampening the first step differs: the new buffers start at zero and wait on a device
        # flag (_PendingFirstStep) that tells the kernels whether their first step is still to come: no host read.
        dampened = scaler.found_inf is not None and dampening != 0
        created: _PendingFirstStep | None = None
        fresh_ids: set[int] = set()  # buffers made from uninitialised memory: their first step is this one
        wholes = bucket.whole_params if bucket.sharded else bucket.params  # a sharded buffer is a DTensor as its param
        for p, whole, s in zip(bucket.params, wholes, bucket.states, strict=True):
            if "momentum_buffer" in s:
                continue
            dtype = self._buffer_dtype(p, bucket.has_master)
            if scaler.found_inf is None:
                s["momentum_buffer"] = torch.empty_like(whole, dtype=dtype)
                fresh_ids.add(id(p))
            else:
                s["momentum_buffer"] = torch.zeros_like(whole, dtype=dtype)
            if dampened:
                created = created or _PendingFirstStep(p.device)
                self._pending_first[p] = created
        seen, fresh = (
            Bucket(has_master=bucket.has_master, sharded=bucket.sharded),
            Bucket(has_master=bucket.has_master, sharded=bucket.sharded),
        )
        waiting: dict[int, tuple[_PendingFirstStep, Bucket]] = {}
        for p, g, s in zip(bucket.params, bucket.grads, bucket.states, strict=True):
            pending = self._pending_first.get(p)
            if pending is not None and pending is not created and pending.done():
                del self._pending_first[p]
                pending = None
            if pending is not None:
                part = waiting.setdefault(
                    id(pending), (pending, Bucket(has_master=bucket.has_master, sharded=bucket.sharded))
                )[1]
            else:
                part = fresh if id(p) in fresh_ids else seen
            part.params.append(p)
            part.grads.append(g)
            part.states.append(s)
        for part, first in ((seen, False), (fresh, True)):
            if part.params:
                self._launch(group, part, part.state_list("momentum_buffer"), first, grad_factor, scaler)
        for pending, part in waiting.values():  # both forms launched; the device skips the one that does not apply
            first, usual = pending.skip_flags(scaler.found_inf)
            buffers = part.state_list("momentum_buffer")
            self._launch(group, part, buffers, True, grad_factor, ScalerTensors(scaler.grad_scale, first))
            self._launch(group, part, buffers, False, grad_factor, ScalerTensors(scaler.grad_scale, usual))
            pending.taken(scaler.found_inf)

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
            weight_decay, momentum, dampening = self.group_numbers(group, ("weight_decay", "momentum", "dampening"))
            torch._fused_sgd_(
                bucket.params,
                bucket.grads,
                buffers,
                weight_decay=weight_decay,
                momentum=momentum,
                lr=lr_for_torch_op(group["lr"], bucket.device),
                dampening=dampening,
                nesterov=group["nesterov"],
                maximize=group["maximize"],
                is_first_step=first_step,
                grad_scale=scaler.grad_scale,
                found_inf=scaler.found_inf,
            )
            return
        lr, weight_decay, momentum, dampening = self.group_numbers(
            group, ("lr", "weight_decay", "momentum", "dampening")
        )
        if self.wd_after_momentum and weight_decay != 0:  # w -= lr * (momentum update + wd * w)
            decay_weights_(bucket.masters() or bucket.params, 1.0 - lr * weight_decay, scaler.found_inf)
            weight_decay = 0.0
        sgd_step(
            bucket.params,
            bucket.grads,
            buffers,
            bucket.masters(),
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            dampening=dampening,
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
