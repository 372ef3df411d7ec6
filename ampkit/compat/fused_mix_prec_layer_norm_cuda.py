"""Megatron-LM's own ``fused_mix_prec_layer_norm_cuda`` extension (2021-2022), a top-level module served while the
apex shim is installed.

Megatron built it from Apex's layer norm and its ``MixedFusedLayerNorm`` loads it by name on construction
(``importlib.import_module("fused_mix_prec_layer_norm_cuda")``). It has two ops:
``forward_affine(input, normalized_shape, gamma, beta, epsilon)`` returns ``(output, mean, invvar)`` with the output
in the weight's dtype (an fp32 residual normalized into fp16 weights gives fp16) and the statistics 1-D float32
(float64 for float64 input); ``backward_affine(dout, mean, invvar, input, normalized_shape, gamma, beta, epsilon)``
returns ``(grad_input, grad_gamma, grad_beta)`` in the input's and the weights' dtypes. They are Apex's
``forward_affine_mixed_dtypes`` and ``backward_affine`` (:mod:`ampkit.compat.fused_layer_norm_cuda`).
"""

from __future__ import annotations

from torch import Tensor

from ampkit.compat import fused_layer_norm_cuda
from ampkit.compat.fused_layer_norm_cuda import ShapeLike

__all__ = ["backward_affine", "forward_affine"]


def forward_affine(
    input: Tensor, normalized_shape: ShapeLike, gamma: Tensor, beta: Tensor, epsilon: float
) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm with a weight and bias, output in the weight's dtype: ``(output, mean, invvar)``."""
    return fused_layer_norm_cuda.forward_affine_mixed_dtypes(input, normalized_shape, gamma, beta, epsilon)


def backward_affine(
    dout: Tensor, mean: Tensor, invvar: Tensor, input: Tensor, normalized_shape: ShapeLike, gamma: Tensor,
    beta: Tensor, epsilon: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """LayerNorm's ``(grad_input, grad_gamma, grad_beta)`` from the forward's input and statistics."""
    return fused_layer_norm_cuda.backward_affine(dout, mean, invvar, input, normalized_shape, gamma, beta, epsilon)
