"""FusedNovoGrad (Apex semantics): per-tensor second moments of the gradient norm, one element pass."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from ampkit.ops import multi_tensor
from ampkit.ops.optimizers._base import (
    Bucket,
    FusedOptimizer,
    _scalar_on,
    acc_dtype,
    check_betas,
    check_choice,
    check_flag,
    check_grad_factor,
    check_hyper,
    eager_under_compile,
)
from ampkit.ops.optimizers._kernels import op
from ampkit.ops.optimizers._torch_keywords import check_torch_keywords

_UNSET = -1.0  # exp_avg_sq before a parameter's first step (norms are >= 0)


class FusedNovoGrad(FusedOptimizer):
    """NovoGrad as Apex's FusedNovoGrad (no torch.optim counterpart).

    State: ``exp_avg`` per element and ``exp_avg_sq`` per tensor (the running blend
    ``sqrt(beta2 * v^2 + (1 - beta2) * ||g||^2)``, or with ``norm_type=0`` ``beta2 * v + (1 - beta2) * max|g|``,
    seeded with the first norm unless ``init_zero``); the step
    count is per group (``group["step"]``) as in Apex.

    Example:
        >>> opt = FusedNovoGrad(model.parameters(), lr=1e-2, weight_decay=1e-3)  # doctest: +SKIP
    """

    _acc_state_keys = ("exp_avg", "exp_avg_sq")
    _updates_shards = False  # norms over whole tensors
    _scratch_attrs = (*FusedOptimizer._scratch_attrs, "_blends")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        reg_inside_moment: bool = False,
        grad_averaging: bool = True,
        norm_type: int = 2,
        init_zero: bool = False,
        set_grad_none: bool = True,
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
            raise RuntimeError("FusedNovoGrad does not support the AMSGrad variant (amsgrad=True).")
        check_choice("norm_type", norm_type, "norm_type")
        check_hyper("lr", lr)
        check_hyper("eps", eps)
        betas = check_betas(betas)
        check_hyper("weight_decay", weight_decay)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            reg_inside_moment=reg_inside_moment,
            grad_averaging=grad_averaging,
            norm_type=norm_type,
            init_zero=init_zero,
            maximize=maximize,
        )
        super().__init__(params, defaults, master_weights, set_grad_none, backend)
        self._blends: list[tuple[dict[str, Any], Bucket, Tensor]] = []

    def _init_state(self, param: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["exp_avg"] = torch.zeros_like(param, dtype=acc_dtype(param))
        (init_zero,) = self._state_inputs(group, ("init_zero",))
        init = 0.0 if init_zero else _UNSET
        state["exp_avg_sq"] = torch.tensor(init, dtype=acc_dtype(param), device=param.device)

    def _load_state(self, state_dict: dict[str, Any]) -> None:
        """Also a state dict written by Apex's FusedNovoGrad, which kept each group's second moments in the group
        (``exp_avg_sq = [fp16 params' norms, fp32 params' norms]``, each in the group's order)."""
        super()._load_state(state_dict)
        for group in self.param_groups:
            norms = group.pop("exp_avg_sq", None)
            if norms is None:
                continue
            by_dtype = {torch.float16: iter(norms[0].tolist()), torch.float32: iter(norms[1].tolist())}
            for param in group["params"]:
                state = self.state.get(param)
                if state is not None and "exp_avg_sq" not in state and param.dtype in by_dtype:
                    value = next(by_dtype[param.dtype])
                    state["exp_avg_sq"] = torch.tensor(value, dtype=acc_dtype(param), device=param.device)

    @eager_under_compile
    def step_with_grad_factor(self, grad_factor: float) -> None:
        check_grad_factor(grad_factor)
        self._check_groups_at_step()
        blended = self._blend_norms(abs(grad_factor))
        self._step_on_host(grad_factor, None if blended is None else blended.cpu())

    def _read_with_scaler(self, grad_scale: Tensor | None) -> Tensor | None:
        """Every bucket's blended gradient norm, the kernels' per-tensor denominators, read with the scaler's two
        scalars (one host read a step, where each bucket took one of its own)."""
        return self._blend_norms(1.0 if grad_scale is None else grad_scale)

    def _blend_norms(self, unscale: float | Tensor) -> Tensor | None:
        """Each bucket's blended norms (the ``exp_avg_sq`` values the step stores), float64 on the device, in group
        and bucket order, all in one vector; ``unscale`` multiplies the gradient norms (a float, or ``grad_scale``
        on the device, which divides them). Kept with their buckets for ``_step_on_host``: nothing is stored yet,
        as the step may be skipped."""
        self._blends = []
        self._new_read_pass()  # this step's pass over the groups (as _all_buckets starts one)
        for group in self.param_groups:
            for bucket in self._buckets(group):
                factor = unscale if isinstance(unscale, float) else 1.0 / _scalar_on(unscale, bucket.device).double()
                beta2 = self.group_numbers(group, ("betas",))[1]
                self._blends.append((group, bucket, self._blended(group, bucket, factor, beta2)))
        if not self._blends:
            return None
        device = self._blends[0][2].device
        return torch.cat([blended.to(device) for _, _, blended in self._blends])

    @staticmethod
    def _blended(group: dict[str, Any], bucket: Bucket, factor: float | Tensor, beta2: float) -> Tensor:
        previous = torch.stack(bucket.state_list("exp_avg_sq")).to(torch.float64)
        if group["norm_type"] == 2:  # Apex's blend of per-tensor norms: sqrt(b2 * v^2 + (1 - b2) * n^2) ...
            norms = multi_tensor.l2norm(bucket.grads, per_tensor=True).per_tensor.double() * factor
            blended = (beta2 * previous.square() + (1 - beta2) * norms.square()).sqrt()
        else:  # ... and with the max-abs norm, b2 * v + (1 - b2) * n
            norms = torch.stack(torch._foreach_norm(bucket.grads, math.inf)).double() * factor
            blended = beta2 * previous + (1 - beta2) * norms
        return torch.where(previous == _UNSET, norms, blended)

    def _step_on_host(self, grad_factor: float, prefetched: Tensor | None) -> None:
        for group in self.param_groups:  # a group whose parameters had no gradient sat the step out, as torch's do;
            # Apex's class counted every step() in every group (``_steps_per_group``)
            if self._steps_per_group or any(p.grad is not None for p in group["params"]):
                group["step"] = group.get("step", 0) + 1
        offset = 0
        for group, bucket, blended in self._blends:
            count = len(bucket.params)
            self._apply(group, bucket, grad_factor, blended, prefetched[offset : offset + count])
            offset += count
        self._blends = []

    def _apply(
        self, group: dict[str, Any], bucket: Bucket, grad_factor: float, blended: Tensor, blended_on_host: Tensor
    ) -> None:
        """Store the bucket's blended norms and run its kernel, which reads the denominators on the host."""
        lr, beta1, beta2, eps, weight_decay = self.group_numbers(group, ("lr", "betas", "eps", "weight_decay"))
        step = group["step"]
        torch._foreach_copy_(bucket.state_list("exp_avg_sq"), list(blended.unbind()))
        bc1 = 1 - beta1**step if group["bias_correction"] else 1.0
        bc2_sqrt = math.sqrt(1 - beta2**step) if group["bias_correction"] else 1.0
        denoms = (blended_on_host / bc2_sqrt + eps).contiguous()
        op("novograd_step", bucket.device)(
            bucket.params,
            bucket.grads,
            bucket.state_list("exp_avg"),
            bucket.masters(),
            denoms,
            lr,
            beta1,
            weight_decay,
            group["reg_inside_moment"],
            group["grad_averaging"],
            bc1,
            -grad_factor if group.get("maximize", False) else grad_factor,
        )
