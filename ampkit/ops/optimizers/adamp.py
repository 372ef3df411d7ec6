"""FusedAdamP (Heo et al., clovaai/AdamP semantics): Adam whose update is projected off the radial
direction of scale-invariant weights.

The moment updates run as multi-tensor (``torch._foreach_*``) ops; the projection needs two cosine
similarities per tensor (channel-wise and layer-wise) and runs per tensor of two or more dimensions.
There is no C++ kernel for this family.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ampkit.ops.optimizers._base import Bucket, FusedOptimizer, acc_dtype, check_hyper


def _project(param: Tensor, grad: Tensor, perturb: Tensor, delta: float, wd_ratio: float, eps: float) -> float:
    """Remove the radial component of ``perturb`` in place if ``param`` looks scale-invariant.

    Returns the weight-decay multiplier (``wd_ratio`` if projected, else 1).
    """
    expand = [-1] + [1] * (param.dim() - 1)
    for view in (lambda x: x.reshape(x.size(0), -1), lambda x: x.reshape(1, -1)):
        cosine = F.cosine_similarity(view(grad), view(param), dim=1, eps=eps).abs_()
        if cosine.max() < delta / math.sqrt(view(param).size(1)):
            unit = param / view(param).norm(dim=1).view(expand).add_(eps)
            perturb.sub_(unit * view(unit * perturb).sum(dim=1).view(expand))
            return wd_ratio
    return 1.0


class FusedAdamP(FusedOptimizer):
    """AdamP with the reference implementation's defaults (state ``step``, ``exp_avg``, ``exp_avg_sq``).

    Example:
        >>> opt = FusedAdamP(model.parameters(), lr=1e-3, weight_decay=1e-2)  # doctest: +SKIP
    """

    _acc_state_keys = ("exp_avg", "exp_avg_sq")

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
    ) -> None:
        check_hyper("lr", lr)
        check_hyper("eps", eps)
        check_hyper("betas[0]", betas[0], 0.0, 1.0)
        check_hyper("betas[1]", betas[1], 0.0, 1.0)
        check_hyper("weight_decay", weight_decay)
        check_hyper("delta", delta)
        check_hyper("wd_ratio", wd_ratio)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            delta=delta,
            wd_ratio=wd_ratio,
            nesterov=nesterov,
        )
        super().__init__(params, defaults, master_weights, set_grad_none, backend)

    def _init_state(self, param: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(param, dtype=acc_dtype(param))
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=acc_dtype(param))

    def _update(self, group: dict[str, Any], bucket: Bucket, grad_factor: float) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        masters = bucket.masters()
        values = masters or [p if p.dtype == acc_dtype(p) else p.to(acc_dtype(p)) for p in bucket.params]
        grads = [g.to(v.dtype) for g, v in zip(bucket.grads, values, strict=True)]
        grads = torch._foreach_mul(grads, grad_factor)
        exp_avgs, exp_avg_sqs = bucket.state_list("exp_avg"), bucket.state_list("exp_avg_sq")
        steps = bucket.state_list("step")
        torch._foreach_add_(steps, 1.0)
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        for i, value in enumerate(values):
            step = float(steps[i])
            bc1, bc2 = 1 - beta1**step, 1 - beta2**step
            denom = (exp_avg_sqs[i].sqrt() / math.sqrt(bc2)).add_(eps)
            if group["nesterov"]:
                perturb = (beta1 * exp_avgs[i] + (1 - beta1) * grads[i]) / denom
            else:
                perturb = exp_avgs[i] / denom
            ratio = 1.0
            if value.dim() > 1:
                ratio = _project(value, grads[i], perturb, group["delta"], group["wd_ratio"], eps)
            if weight_decay > 0:
                value.mul_(1 - lr * weight_decay * ratio)
            value.add_(perturb, alpha=-lr / bc1)
            if value is not bucket.params[i]:
                bucket.params[i].copy_(value)
