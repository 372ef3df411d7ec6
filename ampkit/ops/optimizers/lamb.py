"""FusedLAMB and FusedMixedPrecisionLamb (Apex semantics): global grad-norm clipping, per-tensor trust ratio.

One step reads the gradients once for the global norm, then runs two multi-tensor kernels around the
per-tensor norms: stage 1 updates the moments and writes the Adam direction into a reusable buffer,
stage 2 applies ``lr * ||param|| / ||update||`` to each tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from ampkit.ops import multi_tensor
from ampkit.ops.optimizers._base import (
    Bucket,
    FusedOptimizer,
    acc_dtype,
    check_betas,
    check_flag,
    check_grad_factor,
    check_hyper,
    eager_under_compile,
)
from ampkit.ops.optimizers._kernels import op
from ampkit.ops.optimizers._torch_keywords import check_torch_keywords
from ampkit.wording import shown


class FusedLAMB(FusedOptimizer):
    """LAMB as Apex's FusedLAMB (state ``step``, ``exp_avg``, ``exp_avg_sq``; no torch.optim counterpart).

    Gradients are first scaled by ``1 / max(1, global_norm / max_grad_norm)`` (the norm over every
    gradient of every group; ``max_grad_norm=0`` disables it). The trust ratio applies when
    ``weight_decay != 0`` or ``use_nvlamb``; a zero parameter or update norm falls back to ratio 1.

    Example:
        >>> opt = FusedLAMB(model.parameters(), lr=1e-3, weight_decay=0.01)  # doctest: +SKIP
    """

    _acc_state_keys = ("exp_avg", "exp_avg_sq")
    _updates_shards = False  # norms over whole tensors
    _scratch_attrs = (*FusedOptimizer._scratch_attrs, "_update_buffers")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        set_grad_none: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
        *,
        master_weights: bool = False,
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
        check_flag("amsgrad", amsgrad)  # before it is read: "False" was refused as amsgrad=True
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant (amsgrad=True).")
        check_hyper("lr", lr)
        check_hyper("eps", eps)
        betas = check_betas(betas)
        check_hyper("weight_decay", weight_decay)
        check_hyper("max_grad_norm", max_grad_norm, finite=False)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adam_w_mode=adam_w_mode,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
            use_nvlamb=use_nvlamb,
            maximize=maximize,
        )
        super().__init__(params, defaults, master_weights, set_grad_none, backend)
        self._update_buffers: dict[Tensor, Tensor] = {}

    @eager_under_compile
    @torch.no_grad()
    def step_with_grad_factor(self, grad_factor: float) -> None:
        check_grad_factor(grad_factor)
        self._check_groups_at_step()
        norm = self._read_with_scaler(None)
        self._step_on_host(grad_factor, None if norm is None else norm.double().cpu())

    def _read_with_scaler(self, grad_scale: Tensor | None) -> Tensor | None:
        """The global L2 norm of the (still scaled) gradients, which the step reads on the host for its clip."""
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if any(g.is_sparse for g in grads):  # before the norm, which no sparse tensor can enter
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        for group in self.param_groups:  # before the norm too, which named a misfit only as its own input
            for index, p in enumerate(group["params"]):
                if p.grad is not None:
                    self._check_grad(group, index, p, p.grad)
        self.refuse_shards(grads)
        return multi_tensor.l2norm(grads).total.reshape(1) if grads else None

    def _step_on_host(self, grad_factor: float, prefetched: Tensor | None) -> None:
        global_norm = abs(grad_factor) * (0.0 if prefetched is None else float(prefetched[0]))
        for group, buckets in self._all_buckets():
            (max_norm,) = self.group_numbers(group, ("max_grad_norm",))  # a tensor's read once, not per comparison
            clip = global_norm / max_norm if max_norm > 0 and global_norm > max_norm else 1.0
            self._steps_from_group(group, buckets)
            factor = grad_factor / clip
            for bucket in buckets:
                self._update(group, bucket, -factor if group.get("maximize", False) else factor)
            self._advance_group_step(group)

    def _init_state(self, param: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(param, dtype=acc_dtype(param))
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=acc_dtype(param))

    def _update_buffer(self, param: Tensor) -> Tensor:
        buf = self._update_buffers.get(param)
        if buf is None or buf.dtype != acc_dtype(param):
            buf = self._update_buffers[param] = torch.empty_like(param, dtype=acc_dtype(param))
        return buf

    def _update(self, group: dict[str, Any], bucket: Bucket, grad_factor: float) -> None:
        lr, beta1, beta2, eps, weight_decay = self.group_numbers(group, ("lr", "betas", "eps", "weight_decay"))
        lamb_step(
            bucket.params,
            bucket.grads,
            bucket.state_list("exp_avg"),
            bucket.state_list("exp_avg_sq"),
            [self._update_buffer(p) for p in bucket.params],
            bucket.masters(),
            bucket.state_list("step"),
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            adam_w_mode=group["adam_w_mode"],
            grad_averaging=group["grad_averaging"],
            bias_correction=group["bias_correction"],
            use_nvlamb=group["use_nvlamb"],
            grad_factor=grad_factor,
        )


def lamb_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    updates: list[Tensor],
    master_params: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    grad_averaging: bool,
    bias_correction: bool,
    use_nvlamb: bool,
    grad_factor: float,
) -> None:
    """One LAMB update of tensors on one device: stage 1 (moments, raw direction into ``updates``), the
    per-tensor trust ratios, stage 2 (``param -= lr * ratio * update``)."""
    device = params[0].device if params else torch.device("cpu")
    op("lamb_stage1", device)(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        updates,
        master_params,
        steps,
        beta1,
        beta2,
        eps,
        weight_decay,
        adam_w_mode,
        grad_averaging,
        bias_correction,
        grad_factor,
    )
    if use_nvlamb or weight_decay != 0:
        param_norms = multi_tensor.l2norm(master_params or params, per_tensor=True).per_tensor.double()
        update_norms = multi_tensor.l2norm(updates, per_tensor=True).per_tensor.double()
        usable = (param_norms > 0) & (update_norms > 0)
        ratios = torch.where(usable, param_norms / update_norms.where(usable, 1.0), 1.0) * lr
    else:
        ratios = torch.full((len(params),), lr, dtype=torch.float64)
    # The kernels read the per-tensor ratios on the host (a float64 CPU vector, one sync on CUDA).
    op("lamb_stage2", device)(params, updates, master_params, ratios.cpu())


class FusedMixedPrecisionLamb(FusedLAMB):
    """FusedLAMB for fp16/bf16 models: fp32 master weights and moments, as Apex's FusedMixedPrecisionLamb.

    ``reduced_precision_dtype`` (Apex's argument) only selects which dtype may be reduced; every
    fp16/bf16 parameter gets an fp32 master copy. Unlike Apex, the LAMB direction is not written into
    ``.grad`` (rounded to the grad's dtype) but kept in an fp32 buffer; only the new weight is rounded.
    ``step`` (Apex's argument) is the step count training starts from (a resumed schedule's bias correction).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        step: int = 0,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
        reduced_precision_dtype: torch.dtype | None = None,
        *,
        set_grad_none: bool = True,
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
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={shown(step)}: expected the integer step count to start from (>= 0)")
        self._initial_step = step  # also where a per-group count starts (see FusedOptimizer._steps_per_group)
        if reduced_precision_dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError(
                f"reduced_precision_dtype must be None, torch.float16 or torch.bfloat16; got {reduced_precision_dtype}"
            )
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            adam_w_mode=adam_w_mode,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
            use_nvlamb=use_nvlamb,
            master_weights=True,
            set_grad_none=set_grad_none,
            backend=backend,
            maximize=maximize,
        )
        self.reduced_precision_dtype = reduced_precision_dtype

    def _init_state(self, param: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        super()._init_state(param, state, group)
        state["step"].fill_(float(self._initial_step))
