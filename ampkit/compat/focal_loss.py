"""``apex.contrib.focal_loss``: Apex's fused sigmoid focal loss, on :mod:`ampkit.compat.focal_loss_cuda`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ampkit.compat import focal_loss_cuda

__all__ = ["FocalLoss", "focal_loss"]


class FocalLoss(torch.autograd.Function):
    """Apex's Function: ``apply(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma,
    label_smoothing=0.0)``."""

    @staticmethod
    def forward(
        ctx: Any, cls_output: Tensor, cls_targets_at_level: Tensor, num_positives_sum: Tensor, num_real_classes: int,
        alpha: float, gamma: float, label_smoothing: float = 0.0,
    ) -> Tensor:  # fmt: skip
        loss, partial_grad = focal_loss_cuda.forward(
            cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma, label_smoothing
        )
        ctx.save_for_backward(partial_grad, num_positives_sum)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple:
        partial_grad, num_positives_sum = ctx.saved_tensors
        return focal_loss_cuda.backward(grad_loss, partial_grad, num_positives_sum), None, None, None, None, None, None


def focal_loss(
    cls_output: Tensor, cls_targets_at_level: Tensor, num_positive_sum: Tensor, num_real_classes: int,
    alpha: float, gamma: float, label_smoothing: float = 0.0,
) -> Tensor:  # fmt: skip
    """The focal loss, summed over counted logits and divided by ``num_positive_sum``."""
    return FocalLoss.apply(
        cls_output, cls_targets_at_level, num_positive_sum, num_real_classes, alpha, gamma, label_smoothing
    )
