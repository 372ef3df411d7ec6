"""``scaled_upper_triang_masked_softmax_cuda``: the causal scaled softmax of ``[attn_batches, sq, sk]`` scores."""

from __future__ import annotations

from torch import Tensor

from ampkit.compat.fused_softmax import softmax, softmax_backward

__all__ = ["backward", "forward"]
_OP = "scaled_upper_triang_masked_softmax_cuda"


def forward(inputs: Tensor, scale: float | Tensor) -> Tensor:
    """The softmax of ``scale * inputs`` with the elements above the diagonal left out."""
    return softmax(f"{_OP}.forward", inputs, scale, 3, causal=True)


def backward(output_grads: Tensor, softmax_results: Tensor, scale: float | Tensor) -> Tensor:
    """The input gradient, in place in ``output_grads``."""
    return softmax_backward(f"{_OP}.backward", output_grads, softmax_results, scale, 3, causal=True)
