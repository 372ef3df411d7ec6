"""``scaled_masked_softmax_cuda``: the scaled softmax of ``[b, np, sq, sk]`` scores under a mask of 1s where masked."""

from __future__ import annotations

from torch import Tensor

from ampkit.compat.fused_softmax import get_batch_per_block, softmax, softmax_backward

__all__ = ["backward", "forward", "get_batch_per_block"]
_OP = "scaled_masked_softmax_cuda"


def forward(inputs: Tensor, mask: Tensor, scale: float | Tensor) -> Tensor:
    """The softmax of ``scale * inputs``, a masked element (1) counting as -10000; a fully masked row is zeros."""
    return softmax(f"{_OP}.forward", inputs, scale, 4, mask=mask)


def backward(output_grads: Tensor, softmax_results: Tensor, scale: float | Tensor) -> Tensor:
    """The input gradient, in place in ``output_grads``."""
    return softmax_backward(f"{_OP}.backward", output_grads, softmax_results, scale, 4)
