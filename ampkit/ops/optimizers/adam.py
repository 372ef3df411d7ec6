"""FusedAdam: Adam/AdamW in one pass over parameters, gradients and moments (Apex semantics)."""

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
    check_betas,
    check_flag,
    check_hyper,
    torch_step_counts,
)
from ampkit.ops.optimizers._kernels import op
from ampkit.ops.optimizers._torch_keywords import check_torch_keywords
from ampkit.wording import shown


class FusedAdam(FusedOptimizer):
    """Adam with decoupled weight decay by default (``adam_w_mode=True``, i.e. AdamW), as Apex's FusedAdam.

    State (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``) matches ``torch.optim.Adam``/``AdamW``,
    so checkpoints move between them. ``adam_w_mode=False`` adds ``weight_decay * param`` to the gradient
    (torch.optim.Adam). Unlike Apex, ``amsgrad`` is supported.

    ``capturable=True`` is accepted as in Apex (which requires it for ``master_weights=True``; here either works
    alone) and ``lr`` may be a one-element tensor; the update is the same. The step count lives on the
    parameter's device, where the kernel reads and advances it (as torch's fused Adam keeps it), but ``lr`` is
    read on the host, so the step is not CUDA-graph capturable.

    Buckets of float32/float64 parameters without master weights run ``torch._fused_adamw_`` (or
    ``_fused_adam_`` with ``adam_w_mode=False``) where ``backend`` routes them there (on a GPU under ``auto``):
    the update is then bit-identical to ``torch.optim.AdamW(fused=True)``. ``bias_correction=False`` and Apex's
    per-group step counts stay on ampkit's kernel.

    Example:
        >>> opt = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)  # doctest: +SKIP
    """

    _acc_state_keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    _scaler_in_kernel = True
    _torch_op = "_fused_adamw_"
    # Under ``auto`` on the CPU a plain step stays on ampkit's kernel (1.15x / 1.01x torch's fused AdamW at 1M /
    # 10M params, 66 tensors, against 1.06x / 1.01x for the same update through ``_fused_adamw_``); a step that
    # unscales inside the kernel (``GradScaler.step``) measured 1.20x / 0.95x / 0.81x torch's at 1M / 10M / 50M,
    # so a bucket of this many elements or more goes to torch's op under a grad_scale.
    _cpu_scaled_torch_from = 1 << 22

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
        backend: str | None = None,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
        decoupled_weight_decay: bool | None = None,
    ) -> None:
        check_torch_keywords(type(self).__name__, foreach=foreach, fused=fused, differentiable=differentiable)
        if decoupled_weight_decay is not None:  # torch.optim.Adam's switch: taken where it says what adam_w_mode does
            check_flag("decoupled_weight_decay", decoupled_weight_decay)
            _refuse_other_decay("FusedAdam is given", decoupled_weight_decay, adam_w_mode)
        check_hyper("lr", lr)
        check_hyper("eps", eps)
        betas = check_betas(betas)
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
        super().__init__(params, defaults, master_weights, set_grad_none, backend)

    def _check_group(self, group: dict[str, Any]) -> None:
        """The base class's checks; a group given torch.optim.Adam's ``decoupled_weight_decay`` (which the step does not
        read) is refused where it says other than the group's ``adam_w_mode``, and else left to ``adam_w_mode``."""
        super()._check_group(group)
        if "decoupled_weight_decay" not in group:
            return
        check_flag("decoupled_weight_decay of a param group", group["decoupled_weight_decay"])
        _refuse_other_decay("A param group gives", group["decoupled_weight_decay"], group["adam_w_mode"])
        del group["decoupled_weight_decay"]

    def _init_state(self, param: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
        state["exp_avg"] = torch.zeros_like(param, dtype=acc_dtype(param))
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=acc_dtype(param))
        (amsgrad,) = self._state_inputs(group, ("amsgrad",))
        if amsgrad:
            state["max_exp_avg_sq"] = torch.zeros_like(param, dtype=acc_dtype(param))

    def state_dict(self) -> dict[str, Any]:
        """torch's, each group also saying ``decoupled_weight_decay`` (torch.optim.Adam's name for ``adam_w_mode``): a
        ``torch.optim.Adam`` that loads it resumes with the same weight decay, as it resumes an ``AdamW``'s."""
        saved = super().state_dict()
        for group in saved.get("param_groups", ()):  # as torch's state_dict post-hooks left it
            if "adam_w_mode" in group:
                group["decoupled_weight_decay"] = bool(group["adam_w_mode"])
        return saved

    def _load_state(self, state_dict: dict[str, Any]) -> None:
        """torch's loader; a group saved by ``torch.optim.Adam``/``AdamW`` resumes with its ``decoupled_weight_decay``
        as ``adam_w_mode``, as torch's Adam takes the saved flag over its own (the saved group's options win). The
        flag then leaves the group (``state_dict`` writes it from ``adam_w_mode``): kept, it was a second switch the
        step never reads, and the resumed groups differed from the saved run's."""
        super()._load_state(state_dict)
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            if "adam_w_mode" not in saved and "decoupled_weight_decay" in saved:
                group["adam_w_mode"] = bool(saved["decoupled_weight_decay"])
            group.pop("decoupled_weight_decay", None)

    def _torch_can_run(self, group: dict[str, Any], param: Tensor) -> bool:
        return group["bias_correction"] and acc_dtype(param) == param.dtype

    def _cpu_prefers_torch(self, bucket: Bucket, scaler: ScalerTensors) -> bool:
        return scaler.grad_scale is not None and bucket.numel >= self._cpu_scaled_torch_from

    def _update(
        self, group: dict[str, Any], bucket: Bucket, grad_factor: float, scaler: ScalerTensors = NO_SCALER
    ) -> None:
        if self._routes_to_torch(group, bucket, grad_factor, scaler):
            self._torch_update(group, bucket, scaler)
            return
        amsgrad = group["amsgrad"]
        lr, beta1, beta2, eps, weight_decay = self.group_numbers(group, ("lr", "betas", "eps", "weight_decay"))
        op("adam_step", bucket.device)(
            bucket.params,
            bucket.grads,
            bucket.state_list("exp_avg"),
            bucket.state_list("exp_avg_sq"),
            bucket.state_list("max_exp_avg_sq") if amsgrad else [],
            bucket.masters(),
            bucket.state_list("step"),
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            group["adam_w_mode"],
            amsgrad,
            group["bias_correction"],
            grad_factor,
            *scaler,
        )

    def _torch_update(self, group: dict[str, Any], bucket: Bucket, scaler: ScalerTensors) -> None:
        """The bucket's step as ``torch.optim.Adam``/``AdamW(fused=True)`` takes it: counters advanced around the
        op and taken back on the device where ``found_inf`` made the op skip."""
        beta1, beta2, weight_decay, eps = self.group_numbers(group, ("betas", "weight_decay", "eps"))
        fused = torch._fused_adamw_ if group["adam_w_mode"] else torch._fused_adam_
        with torch_step_counts(bucket, scaler.found_inf) as steps:
            fused(
                bucket.params,
                bucket.grads,
                bucket.state_list("exp_avg"),
                bucket.state_list("exp_avg_sq"),
                bucket.state_list("max_exp_avg_sq") if group["amsgrad"] else [],
                steps,
                amsgrad=group["amsgrad"],
                lr=lr_for_torch_op(group["lr"], bucket.device),
                beta1=beta1,
                beta2=beta2,
                weight_decay=weight_decay,
                eps=eps,
                maximize=group["maximize"],
                grad_scale=scaler.grad_scale,
                found_inf=scaler.found_inf,
            )


def _refuse_other_decay(who: str, decoupled_weight_decay: Any, adam_w_mode: Any) -> None:
    """Raise ValueError where torch.optim.Adam's ``decoupled_weight_decay`` says other than ``adam_w_mode``, which is
    what the step reads: one of the two would be dropped without a word."""
    if bool(decoupled_weight_decay) != bool(adam_w_mode):
        raise ValueError(
            f"{who} decoupled_weight_decay={shown(decoupled_weight_decay)} (torch.optim.Adam's name) and "
            f"adam_w_mode={shown(adam_w_mode)}: FusedAdam reads adam_w_mode (True: AdamW's decay, False: L2 as "
            "torch.optim.Adam); set that one"
        )
