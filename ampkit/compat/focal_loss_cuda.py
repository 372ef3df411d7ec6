"""Apex's ``focal_loss_cuda`` extension (apex.contrib), a top-level module served while the apex shim is installed.

NVIDIA's EfficientDet (DeepLearningExamples) imports it at the top of ``effdet/focal_loss.py``, so the program needs
it to import at all. ``forward(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma,
label_smoothing)`` is a sigmoid focal loss over ``(..., num_classes)`` logits against class indices (``-2``
ignores an anchor; classes from ``num_real_classes`` on are padding and count nothing), summed and divided by
``num_positives_sum``; it returns ``(loss, partial_grad)``, the gradient before that division, and
``backward(grad_loss, partial_grad, num_positives_sum)`` finishes it in place, as Apex's kernels do. The maths
runs in float32 on any device.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ampkit.ops.optimizers._base import check_hyper
from ampkit.wording import shown

__all__ = ["backward", "forward"]


def _check(cls_output: Tensor, targets: Tensor, num_positives_sum: Tensor, num_real_classes: int) -> None:
    if not cls_output.is_floating_point():
        raise TypeError(f"focal_loss_cuda.forward: cls_output must be a floating-point tensor, got {cls_output.dtype}")
    if targets.dtype != torch.long:
        raise TypeError(f"focal_loss_cuda.forward: cls_targets_at_level must be int64, got {targets.dtype}")
    if cls_output.dim() != targets.dim() + 1 or tuple(cls_output.shape[:-1]) != tuple(targets.shape):
        raise ValueError(
            f"focal_loss_cuda.forward: cls_output {list(cls_output.shape)} must be cls_targets_at_level's shape "
            f"{list(targets.shape)} plus a class dimension"
        )
    if isinstance(num_real_classes, bool) or not isinstance(num_real_classes, int):  # Apex's binding took an int
        raise TypeError(f"focal_loss_cuda.forward: num_real_classes must be an int, got {shown(num_real_classes)}")
    if not 0 < num_real_classes <= cls_output.shape[-1]:
        raise ValueError(
            f"focal_loss_cuda.forward: num_real_classes {num_real_classes} must be in 1..{cls_output.shape[-1]}"
        )
    if num_positives_sum.numel() != 1 or num_positives_sum.dtype != torch.float32:
        raise ValueError("focal_loss_cuda.forward: num_positives_sum must be a one-element float32 tensor")


def forward(
    cls_output: Tensor, cls_targets_at_level: Tensor, num_positives_sum: Tensor, num_real_classes: int,
    alpha: float, gamma: float, label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(loss, partial_grad)``: the normalized float32 loss and its gradient times ``num_positives_sum``."""
    _check(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes)
    # Host numbers, checked for free (num_positives_sum is a device tensor: a 0 there gives inf, as in Apex). A NaN
    # or an infinite one made every loss NaN; a negative gamma is a power of sigma near 0: inf.
    check_hyper("focal_loss_cuda.forward alpha", alpha, -math.inf, math.inf)
    if math.isinf(alpha):  # check_hyper's lower bound is inclusive, and -inf made every loss NaN too
        raise ValueError(f"Invalid focal_loss_cuda.forward alpha: {shown(alpha)} (expected a finite number)")
    check_hyper("focal_loss_cuda.forward gamma", gamma, 0.0, math.inf)
    check_hyper("focal_loss_cuda.forward label_smoothing", label_smoothing, 0.0, 1.0, closed=True)
    p = cls_output.float()
    classes = torch.arange(p.shape[-1], device=p.device)
    targets = cls_targets_at_level.unsqueeze(-1)
    positive = targets == classes
    counted = (targets != -2) & (classes < num_real_classes)
    sigma = torch.sigmoid(p)
    s = float(label_smoothing)
    # Apex's kernel: base + off_a is the binary cross-entropy against the (smoothed) target, off_b its derivative's
    # residual; the focal factor is alpha * (1 - sigma)^gamma for positives, (1 - alpha) * sigma^gamma for negatives.
    base = torch.where(positive, (s - s / 2) * p, (1 - s / 2) * p)
    off_a = F.softplus(-p)
    off_b = torch.where(positive, 1 - s + s / 2, s / 2) - sigma
    coeff_f = torch.where(positive, alpha * (1 - sigma).pow(gamma), (1 - alpha) * sigma.pow(gamma))
    coeff_b = torch.where(positive, -gamma * sigma, gamma * (1 - sigma))
    bce = base + off_a
    loss = torch.where(counted, coeff_f * bce, 0.0).sum() / num_positives_sum.reshape(())
    partial_grad = torch.where(counted, coeff_f * (coeff_b * bce - off_b), 0.0)
    return loss, partial_grad.to(cls_output.dtype)


def backward(grad_loss: Tensor, partial_grad: Tensor, num_positives_sum: Tensor) -> Tensor:
    """The gradient of the logits: ``partial_grad`` scaled in place by ``grad_loss / num_positives_sum``."""
    if grad_loss.numel() != 1:
        raise ValueError(
            f"focal_loss_cuda.backward: grad_loss must be the one-element gradient of the loss, got shape "
            f"{list(grad_loss.shape)}"
        )
    scale = grad_loss.float().reshape(()) / num_positives_sum.float().reshape(())
    return partial_grad.copy_(partial_grad.float() * scale)
