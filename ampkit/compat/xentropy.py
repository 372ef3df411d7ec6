"""``apex.contrib.xentropy``: Apex's fused softmax cross-entropy with label smoothing, on
:mod:`ampkit.compat.xentropy_cuda`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ampkit.compat import xentropy_cuda

__all__ = ["SoftmaxCrossEntropyLoss"]


class SoftmaxCrossEntropyLoss(torch.autograd.Function):
    """Apex's Function: ``apply(logits, labels, smoothing=0.0, padding_idx=0, half_to_float=False)`` gives each row's
    float32 loss, 0 (and no gradient) where the label is ``padding_idx``."""

    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, labels: Tensor, smoothing: float = 0.0, padding_idx: int = 0,
        half_to_float: bool = False,
    ) -> Tensor:  # fmt: skip
        losses, max_log_sum_exp = xentropy_cuda.forward(logits, labels, smoothing, half_to_float)
        padding = labels == padding_idx
        _check_labels(labels, padding, logits.shape[1], padding_idx)
        losses.masked_fill_(padding, 0)
        ctx.save_for_backward(logits, max_log_sum_exp, labels)
        ctx.smoothing, ctx.padding_idx = smoothing, padding_idx
        return losses

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple:
        logits, max_log_sum_exp, labels = ctx.saved_tensors
        grad_loss = grad_loss.masked_fill(labels == ctx.padding_idx, 0)
        grad_logits = xentropy_cuda.backward(grad_loss, logits, max_log_sum_exp, labels, ctx.smoothing)
        return grad_logits, None, None, None, None


def _check_labels(labels: Tensor, padding: Tensor, classes: int, padding_idx: int) -> None:
    """Refuse a label outside ``0..classes-1`` that is not ``padding_idx`` (Apex's kernel read past the row)."""
    outside = ((labels < 0) | (labels >= classes)) & ~padding
    if bool(outside.any()):
        row = int(outside.nonzero()[0, 0])
        raise ValueError(
            f"SoftmaxCrossEntropyLoss: label {int(labels[row])} (row {row}) is outside 0..{classes - 1} and is not "
            f"padding_idx={padding_idx}"
        )
