"""Apex's ``xentropy_cuda`` extension (apex.contrib.xentropy), a top-level module served while the apex shim is
installed.

fairseq's ``modules/cross_entropy.py`` and MosaicML Composer import it by name for a fused softmax cross-entropy
with label smoothing. ``forward(logits, labels, smoothing, half_to_float)`` takes ``(N, C)`` logits and ``N``
int64 labels and returns ``(losses, max_log_sum_exp)``: per row ``(1 - smoothing) * -log p[label] + smoothing *
mean(-log p)``, float32 (float64 for float64 logits), and the row's log-sum-exp (float32 with ``half_to_float``, else
the logits' dtype). ``backward(grad_loss, logits, max_log_sum_exp, labels, smoothing)`` returns
``grad_loss * (softmax - (1 - smoothing) * onehot(label) - smoothing / C)`` in the logits' dtype. The caller masks
padding rows (a label outside ``0..C-1``, such as -100, gets a NaN loss and no one-hot term). float32 maths in
PyTorch on any device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ampkit.ops._dtypes import HALF_DTYPES, KERNEL_DTYPES
from ampkit.ops._switches import checked_switch
from ampkit.ops.optimizers._base import check_hyper

__all__ = ["backward", "forward"]


def _accumulate_dtype(logits: Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _check(op: str, logits: Tensor, labels: Tensor) -> None:
    if logits.dtype not in KERNEL_DTYPES:
        raise TypeError(f"xentropy_cuda.{op}: logits must be float16, bfloat16, float32 or float64, got {logits.dtype}")
    for name, tensor in (("logits", logits), ("labels", labels)):  # both failed in the dispatcher or a kernel
        if tensor.layout != torch.strided:
            raise TypeError(f"xentropy_cuda.{op}: {name} is a {tensor.layout} tensor; pass a dense one (.to_dense())")
    if labels.device != logits.device:
        raise ValueError(f"xentropy_cuda.{op}: labels are on {labels.device} but logits on {logits.device}")
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"xentropy_cuda.{op}: logits must be 2-D (rows, classes), got shape {list(logits.shape)}")
    if labels.dtype != torch.long or labels.dim() != 1 or labels.shape[0] != logits.shape[0]:
        raise ValueError(
            f"xentropy_cuda.{op}: labels must be 1-D int64 with one entry per logits row ({logits.shape[0]}), got "
            f"{labels.dtype} of shape {list(labels.shape)}"
        )


def _checked_smoothing(op: str, smoothing: float) -> float:
    """``smoothing`` as a float in [0, 1], torch's range for ``label_smoothing``: a NaN gave NaN losses, 1.5 weighted
    the true class negatively and the string "0.1" (a config left unparsed) was read as a number, all silently."""
    check_hyper(f"xentropy_cuda.{op} smoothing", smoothing, 0.0, 1.0, closed=True)
    return float(smoothing)


def _one_hot(labels: Tensor, classes: int, dtype: torch.dtype) -> Tensor:
    """One-hot rows; a label outside ``0..classes-1`` (a padding index such as -100) gives a row of zeros."""
    return (labels.unsqueeze(1) == torch.arange(classes, device=labels.device)).to(dtype)


def forward(logits: Tensor, labels: Tensor, smoothing: float, half_to_float: bool) -> tuple[Tensor, Tensor]:
    """``(losses, max_log_sum_exp)``: the label-smoothed cross-entropy of each row and the row's log-sum-exp."""
    _check("forward", logits, labels)
    half_to_float = checked_switch("xentropy_cuda.forward", "half_to_float", half_to_float)
    if half_to_float and logits.dtype not in HALF_DTYPES:
        raise ValueError(
            f"xentropy_cuda.forward: half_to_float=True takes float16 or bfloat16 logits, got {logits.dtype}; pass "
            "half_to_float=False"
        )
    s = _checked_smoothing("forward", smoothing)
    x = logits.to(_accumulate_dtype(logits))
    classes = x.shape[1]
    log_sum_exp = torch.logsumexp(x, dim=1)
    in_range = (labels >= 0) & (labels < classes)
    label_logit = x.gather(1, labels.clamp(0, classes - 1).unsqueeze(1)).squeeze(1)
    label_logit = torch.where(in_range, label_logit, torch.nan)
    losses = (log_sum_exp - x.mean(dim=1)) * s - (label_logit - log_sum_exp) * (1 - s)
    return losses, log_sum_exp.to(torch.float32 if half_to_float else logits.dtype)


def backward(grad_loss: Tensor, logits: Tensor, max_log_sum_exp: Tensor, labels: Tensor, smoothing: float) -> Tensor:
    """The logits' gradient, ``grad_loss * (softmax - (1 - smoothing) * onehot - smoothing / classes)``."""
    _check("backward", logits, labels)
    rows = logits.shape[0]
    if grad_loss.numel() != rows or max_log_sum_exp.numel() != rows:
        raise ValueError(
            f"xentropy_cuda.backward: grad_loss and max_log_sum_exp need one entry per logits row ({rows}), got "
            f"shapes {list(grad_loss.shape)} and {list(max_log_sum_exp.shape)}"
        )
    accumulate = _accumulate_dtype(logits)
    x = logits.to(accumulate)
    if max_log_sum_exp.dtype in HALF_DTYPES:  # forward without half_to_float kept it rounded: take it again
        log_sum_exp = torch.logsumexp(x, dim=1)
    else:
        log_sum_exp = max_log_sum_exp.reshape(rows).to(accumulate)
    classes = x.shape[1]
    s = _checked_smoothing("backward", smoothing)
    grad = torch.exp(x - log_sum_exp.unsqueeze(1)) - _one_hot(labels, classes, accumulate) * (1 - s) - s / classes
    return (grad * grad_loss.reshape(rows, 1).to(accumulate)).to(logits.dtype)
