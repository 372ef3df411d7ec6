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

import numpy as np
import torch
from torch import Tensor

from ampkit.ops import multi_tensor
from ampkit.ops.optimizers._base import FusedOptimizer

# clip_grad_norm_'s guard against division by zero, kept so clipping matches torch bit for bit in fp32.
_CLIP_EPS = np.float32(1e-6)


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
    inv_scale = float(inv_scale)
    if not (math.isfinite(inv_scale) and inv_scale > 0):
        raise ValueError(f"inv_scale must be a finite number > 0; got {inv_scale!r}")
    if max_norm is not None and not (math.isfinite(float(max_norm)) and float(max_norm) > 0):
        raise ValueError(f"max_norm must be None or a finite number > 0; got {max_norm!r}")

    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return False, torch.zeros((), dtype=torch.float32)
    found = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
    total = multi_tensor.unscale_l2norm(grads, inv_scale, found).total
    found_value, total_value = torch.stack([found.reshape(()), total.reshape(()).float()]).tolist()  # one read
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
