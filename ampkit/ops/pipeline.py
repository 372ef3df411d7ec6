"""The fused amp step: unscale + inf/nan check + global L2 norm + clip + optimizer update in two passes.

Pass 1 (``ampkit.ops.multi_tensor.unscale_l2norm``, read-only) reads every gradient once and returns
both the non-finite flag and the norm of the *unscaled* gradients (``grad * inv_scale``). Pass 2 is
the fused optimizer's own kernel, which multiplies each gradient by the combined factor
``inv_scale * clip_coef`` as it reads it. The unfused sequence
(``GradScaler.unscale_`` + ``clip_grad_norm_`` + ``step``) reads the gradients three times and writes
them twice; here the gradients are only read and are left as they were (still scaled).
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch
from torch import Tensor

from ampkit.ops import multi_tensor
from ampkit.ops._errors import ArgumentTypeError
from ampkit.ops.host_values import host_numbers
from ampkit.ops.optimizers._base import FusedOptimizer
from ampkit.wording import beyond_float, integer_digits, shown

# clip_grad_norm_'s guard against division by zero, kept so clipping matches torch bit for bit in fp32.
_CLIP_EPS = np.float32(1e-6)


def _finite_positive(value: float | Tensor, must_be: str) -> float:
    """``value`` (a number or a one-element tensor) as a float, if finite and > 0; ``float()`` read "1e-3" and
    ``True`` as numbers and named neither a string nor None it refused."""
    if isinstance(value, Tensor) and value.numel() == 1:
        if value.is_meta:  # item() raised, naming neither the argument nor why
            raise ValueError(f"{must_be} a finite number > 0; got a tensor on the meta device, which holds no value")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{must_be} a finite number > 0; got {shown(value)} (a {type(value).__name__})")
    if beyond_float(value):  # math.isfinite raised a bare OverflowError
        raise ValueError(f"{must_be} a finite number > 0; got {integer_digits(value)}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{must_be} a finite number > 0; got {shown(value)}")
    return float(value)


@torch.no_grad()
def fused_unscale_clip_step_(
    optimizer: FusedOptimizer, inv_scale: float, max_norm: float | None = None
) -> tuple[bool, Tensor]:
    """Unscale, check, clip and step ``optimizer`` in two passes over the gradients.

    Args:
        optimizer: an ampkit fused optimizer (``ampkit.ops.optimizers``) whose params hold scaled grads.
        inv_scale: ``1 / loss_scale``; finite and > 0.
        max_norm: clip the unscaled gradients to this global L2 norm (``clip_grad_norm_`` semantics,
            coefficient ``max_norm / (norm + 1e-6)`` capped at 1); None disables clipping.

    Returns:
        ``(found_inf, grad_norm)``: whether any gradient held inf/nan — then parameters, optimizer state
        and step counts are left untouched — and the float32 L2 norm of the unscaled gradients (nan when
        ``found_inf``), the value ``clip_grad_norm_`` would return.

    Raises:
        TypeError: if ``optimizer`` is not an ampkit fused optimizer.
        ValueError: if ``inv_scale`` or ``max_norm`` is not a finite positive number.
    """
    if not isinstance(optimizer, FusedOptimizer):
        raise TypeError(
            f"optimizer must be an ampkit fused optimizer (ampkit.ops.optimizers); got {type(optimizer).__name__}"
        )
    inv_scale = _finite_positive(inv_scale, "inv_scale must be")
    if max_norm is not None:
        max_norm = _finite_positive(max_norm, "max_norm must be None or")

    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return False, torch.zeros((), dtype=torch.float32)
    found = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
    total = multi_tensor.unscale_l2norm(grads, inv_scale, found).total
    found_value, total_value = host_numbers([found, total])  # one read
    if found_value:
        return True, torch.tensor(math.nan, dtype=torch.float32)
    norm = np.float32(total_value)
    grad_norm = torch.tensor(norm, dtype=torch.float32)
    factor = inv_scale
    if max_norm is not None:
        clip_coef = np.float32(max_norm) / (norm + _CLIP_EPS)
        if clip_coef < 1:
            factor *= float(clip_coef)
    optimizer.step_with_grad_factor(factor)
    return False, grad_norm
