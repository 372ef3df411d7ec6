"""Apex's LARC: layer-wise adaptive rate control wrapped around any optimizer."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import torch

from ampkit.ops._dtypes import accumulate_dtype
from ampkit.ops._switches import checked_switch
from ampkit.ops.host_values import host_numbers
from ampkit.ops.optimizers._base import check_group_at_step
from ampkit.wording import shown


class LARC:
    """Scale each parameter's gradient by ``trust_coefficient * ||w|| / (||g|| + wd * ||w|| + eps)``.

    With ``clip=True`` the local rate is ``min(local_lr / lr, 1)`` (LARC clipping); otherwise it multiplies
    the group's learning rate (LARS scaling). Weight decay is folded into the gradient before scaling and
    switched off inside the wrapped optimizer for that step, exactly as Apex did.

    Example:
        >>> opt = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))  # doctest: +SKIP
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, trust_coefficient: float = 0.02, clip: bool = True, eps: float = 1e-8
    ) -> None:
        # Both divide or scale each layer's rate: NaN (and a negative eps, which can zero the denominator) gave NaN
        # weights; "False" for clip was read as on.
        if not (isinstance(trust_coefficient, numbers.Real) and 0 < trust_coefficient < math.inf):
            raise ValueError(f"LARC: trust_coefficient must be a finite number > 0, got {shown(trust_coefficient)}")
        if not (isinstance(eps, numbers.Real) and 0 <= eps < math.inf):
            raise ValueError(f"LARC: eps must be a finite number >= 0, got {shown(eps)}")
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.clip = checked_switch("LARC", "clip", clip)

    @property
    def state(self) -> Any:
        """The wrapped optimizer's ``state``."""
        return self.optim.state

    def __repr__(self) -> str:
        return f"LARC({self.optim!r}, trust_coefficient={self.trust_coefficient}, clip={self.clip})"

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's ``param_groups`` (settable)."""
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optim.param_groups = value

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (LARC itself keeps no state)."""
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict`` into the wrapped optimizer."""
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the wrapped optimizer's gradients; without an argument, as its own ``zero_grad()`` does (Apex's
        LARC took none: a fused optimizer built with ``set_grad_none=False`` zeroes in place)."""
        if set_to_none is None:
            self.optim.zero_grad()
        else:
            self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add ``param_group`` to the wrapped optimizer."""
        self.optim.add_param_group(param_group)

    def _check_groups(self) -> None:
        """The fused optimizers' step-time rules on what LARC reads of each group, all groups before any is touched:
        a string ``weight_decay`` or ``lr`` failed in the arithmetic naming neither, after earlier groups' gradients
        were rescaled and their weight decay switched off."""
        for index, group in enumerate(self.optim.param_groups):
            read = ("weight_decay", "lr") if self.clip else ("weight_decay",)  # Apex reads lr only to clip
            check_group_at_step("LARC", index, {key: group[key] for key in read if key in group})

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Rescale the gradients layer by layer, then step the wrapped optimizer."""
        self._check_groups()
        with torch.no_grad():
            saved_weight_decays = []
            for group in self.optim.param_groups:
                saved_weight_decays.append(group.get("weight_decay", 0.0))
                # Read once a group, as host numbers (a tensor's in one transfer), where lr was read per parameter.
                weight_decay, lr = host_numbers([saved_weight_decays[-1], group["lr"] if self.clip else 1.0])
                group["weight_decay"] = 0
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    compute = accumulate_dtype(p.dtype)
                    param_norm = torch.linalg.vector_norm(p.to(compute))
                    grad_norm = torch.linalg.vector_norm(p.grad.to(compute))
                    adaptive_lr = (
                        self.trust_coefficient * param_norm / (grad_norm + param_norm * weight_decay + self.eps)
                    )
                    if self.clip:
                        adaptive_lr = torch.clamp(adaptive_lr / lr, max=1.0)
                    # A zero norm leaves the gradient as it is (no weight decay either), as Apex's skip did, decided
                    # on the device: Apex's `if` read both norms to the host, two syncs a parameter a step on CUDA.
                    untouched = (param_norm == 0) | (grad_norm == 0)
                    if weight_decay != 0:
                        p.grad.copy_(torch.where(untouched, p.grad, torch.add(p.grad, p, alpha=weight_decay)))
                    p.grad.mul_(torch.where(untouched, 1.0, adaptive_lr).to(p.grad.dtype))
        try:
            return self.optim.step(closure) if closure is not None else self.optim.step()
        finally:
            for group, weight_decay in zip(self.optim.param_groups, saved_weight_decays, strict=True):
                group["weight_decay"] = weight_decay


# Apex's apex.parallel never exported LARC: clients reached the class through its module, as
# apex.parallel.LARC.LARC(opt) or `from apex.parallel import LARC` then LARC.LARC(opt). Here parallel.LARC is the
# class itself, so it also answers to .LARC, keeping both spellings working.
LARC.LARC = LARC  # type: ignore[attr-defined]
