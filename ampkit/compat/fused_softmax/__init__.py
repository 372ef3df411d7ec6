"""Apex's Megatron softmax extensions (``scaled_upper_triang_masked_softmax_cuda``, ``scaled_masked_softmax_cuda``,
``generic_scaled_masked_softmax_cuda``, ``scaled_softmax_cuda``), served as top-level modules by the apex shim.

Megatron-LM (mid-2023 on) imports them inside its fused-softmax Functions, and asks
``scaled_masked_softmax_cuda.get_batch_per_block`` whether the fused path applies, for every fp16/bf16 attention
with its default ``masked_softmax_fusion``. The softmax of ``scale * input`` is taken in float32 and returned in
the input's dtype; a masked element (mask value 1) counts as -10000 and a row masked throughout gives zeros, the
causal variant leaves out the elements above the diagonal, as Apex's kernels do. Each backward is
``scale * y * (g - sum(g * y))``, written into (contiguous) ``output_grads`` in place and returned, as Apex's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ampkit.compat._pybind_numbers import check_number

_MASKED_VALUE = -10000.0
_WARP_SIZE = 32  # CUDA's warp; the batches per block below are what Apex's kernels launch


def _check(op: str, tensor: Tensor, dims: int, name: str = "inputs") -> None:
    if tensor.dim() != dims:
        raise ValueError(f"{op}: expected a {dims}-D tensor, got shape {list(tensor.shape)}")
    if not tensor.is_floating_point():
        raise TypeError(
            f"{op}: {name} must be a floating-point tensor (float16, bfloat16, float32), got {tensor.dtype}"
        )
    if tensor.layout != torch.strided:  # the softmax failed in the dispatcher, naming a backend
        raise TypeError(f"{op}: {name} is a {tensor.layout} tensor; pass a dense one (.to_dense())")


def _check_mask(op: str, mask: Tensor, inputs: Tensor) -> None:
    """Apex read the mask as bytes, 1 where masked, over ``[1 or b, 1, sq, sk]``; here any shape that broadcasts."""
    if mask.dim() != 4:
        raise ValueError(f"{op}: expected a 4-D mask, got shape {list(mask.shape)}")
    if mask.dtype not in (torch.bool, torch.uint8):
        raise TypeError(f"{op}: mask must be bool or uint8 (1 where masked), got {mask.dtype}")
    if any(m not in (1, n) for m, n in zip(mask.shape, inputs.shape, strict=True)):
        raise ValueError(
            f"{op}: mask shape {list(mask.shape)} does not broadcast to the inputs' shape {list(inputs.shape)}; "
            f"Apex's is [1 or {inputs.shape[0]}, 1, {inputs.shape[2]}, {inputs.shape[3]}]"
        )


def _scale(op: str, scale: float | Tensor) -> float:
    if isinstance(scale, Tensor) and scale.numel() != 1:
        raise ValueError(f"{op}: scale must be a number or a one-element tensor, got shape {list(scale.shape)}")
    check_number(op, "scale", scale)  # float() read "0.125" as a number and named no argument for None
    return float(scale)


def softmax(op: str, inputs: Tensor, scale: float | Tensor, dims: int, mask: Tensor | None = None,
            causal: bool = False) -> Tensor:  # fmt: skip
    """The scaled (masked) softmax over the last dim, in float32, returned in the input's dtype."""
    _check(op, inputs, dims)
    if causal and inputs.shape[-2] != inputs.shape[-1]:
        raise ValueError(
            f"{op}: the causal softmax needs square [attn_batches, sq, sq] scores, got {list(inputs.shape)}"
        )
    if mask is not None:
        _check_mask(op, mask, inputs)
    x = inputs.float() * _scale(op, scale)
    if causal:
        sq, sk = x.shape[-2:]
        above = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(1)
        x = x.masked_fill(above, float("-inf"))
    if mask is None:
        return torch.softmax(x, -1).to(inputs.dtype)
    masked = mask == 1  # as Apex's kernel: only a 1 masks (a uint8 255 does not)
    x = x.masked_fill(masked, _MASKED_VALUE)
    probs = torch.softmax(x, -1)
    return probs.masked_fill(masked.all(-1, keepdim=True), 0.0).to(inputs.dtype)


def softmax_backward(
    op: str, output_grads: Tensor, softmax_results: Tensor, scale: float | Tensor, dims: int, causal: bool = False
) -> Tensor:
    """``scale * y * (g - sum(g * y))``, written into ``output_grads`` (a contiguous copy if it is not) and returned."""
    _check(op, output_grads, dims, "output_grads")
    _check(op, softmax_results, dims, "softmax_results")
    if output_grads.shape != softmax_results.shape:
        raise ValueError(
            f"{op}: output_grads {list(output_grads.shape)} and softmax_results {list(softmax_results.shape)} "
            "must have the same shape"
        )
    if causal and output_grads.shape[-2] != output_grads.shape[-1]:
        raise ValueError(
            f"{op}: the causal softmax needs square [attn_batches, sq, sq] gradients, got {list(output_grads.shape)}"
        )
    output_grads = output_grads.contiguous()  # as Apex's: an expanded or strided gradient is copied first
    g, y = output_grads.float(), softmax_results.float()
    grad = _scale(op, scale) * y * (g - (g * y).sum(-1, keepdim=True))
    return output_grads.copy_(grad)


def get_batch_per_block(query_seq_len: int, key_seq_len: int, batches: int, attn_heads: int) -> int:
    """Apex's rows per CUDA block for ``key_seq_len`` keys, which Megatron's kernel-availability test divides by."""
    next_power_of_two = 1 << max(0, (int(key_seq_len) - 1).bit_length())
    warp_size = min(next_power_of_two, _WARP_SIZE)
    batches_per_warp = 2 if next_power_of_two <= 128 else 1
    return (128 // warp_size) * batches_per_warp
