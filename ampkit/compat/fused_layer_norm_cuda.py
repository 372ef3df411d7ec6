"""Apex's ``fused_layer_norm_cuda`` extension, a top-level module served while the apex shim is installed.

Apex's ``fused_layer_norm`` loads it with ``importlib.import_module("fused_layer_norm_cuda")``, and so do
projects that wrote their own autograd Functions around it (Megatron-LM's ``MixedFusedLayerNorm`` imports it
on construction). Each op takes Apex's arguments in Apex's order and returns what Apex's did: LayerNorm
forwards ``(output, mean, invvar)``, RMSNorm forwards ``(output, invvar)``, with the row statistics as 1-D
float32 tensors (float64 for float64 input); backwards take them back, with ``memory_efficient=True`` meaning
that ``input_or_output`` is the forward's output. The maths runs in float32 (float64 for float64) on any device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ampkit.compat._pybind_numbers import pybind_numbers
from ampkit.ops._dtypes import accumulate_dtype
from ampkit.ops._switches import checked_switch
from ampkit.ops.norms import NormDtypeError, NormShapeError

__all__ = [
    "backward",
    "backward_affine",
    "forward",
    "forward_affine",
    "forward_affine_mixed_dtypes",
    "rms_backward",
    "rms_backward_affine",
    "rms_forward",
    "rms_forward_affine",
    "rms_forward_affine_mixed_dtypes",
]

ShapeLike = int | Sequence[int]


def _shape(
    op: str, normalized_shape: ShapeLike, gamma: Tensor | None = None, beta: Tensor | None = None
) -> tuple[int, ...]:
    """``normalized_shape`` as a tuple, after checking it is not empty and that ``gamma``/``beta`` have it (as Apex).
    Shape errors are RuntimeErrors, as Apex's TORCH_CHECKs raised, and ValueErrors."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape:
        raise NormShapeError(f"fused_layer_norm_cuda.{op}: normalized_shape must have at least one dim, got []")
    for name, weight in (("gamma", gamma), ("beta", beta)):
        if weight is not None and (tuple(weight.shape) != shape or not weight.is_floating_point()):
            raise NormShapeError(
                f"fused_layer_norm_cuda.{op}: {name} must be a floating-point tensor of normalized_shape "
                f"{list(shape)}, got {weight.dtype} of shape {list(weight.shape)}"
            )
    return shape


def _rows(op: str, tensor: Tensor, normalized_shape: ShapeLike, name: str = "input") -> Tensor:
    """``tensor`` as ``(n1, n2)``, ``n2`` the product of ``normalized_shape``, which must end its shape."""
    shape = _shape(op, normalized_shape)
    if len(shape) > tensor.dim() or tuple(tensor.shape[tensor.dim() - len(shape) :]) != shape:
        raise NormShapeError(
            f"fused_layer_norm_cuda.{op}: normalized_shape {list(shape)} must be the trailing dims of the "
            f"{name}'s shape {list(tensor.shape)}"
        )
    if not tensor.is_floating_point():
        raise NormDtypeError(f"fused_layer_norm_cuda.{op}: {name} must be a floating-point tensor, got {tensor.dtype}")
    return tensor.reshape(math.prod(tensor.shape[: tensor.dim() - len(shape)]), math.prod(shape))


def _check_stats(op: str, rows: int, mean: Tensor | None, invvar: Tensor) -> None:
    """The forward's statistics: one floating-point value per normalized row."""
    for name, stat in (("mean", mean), ("invvar", invvar)):
        if stat is not None and (stat.numel() != rows or not stat.is_floating_point()):
            raise NormShapeError(
                f"fused_layer_norm_cuda.{op}: {name} must be the forward's floating-point statistics, one per row "
                f"({rows}), got {stat.dtype} of shape {list(stat.shape)}"
            )


def _check_dout(op: str, dout: Tensor, input_or_output: Tensor) -> None:
    if dout.shape != input_or_output.shape:
        raise NormShapeError(
            f"fused_layer_norm_cuda.{op}: dout {list(dout.shape)} must have input_or_output's shape "
            f"{list(input_or_output.shape)}"
        )


def _flat(weight: Tensor | None, acc: torch.dtype) -> Tensor | None:
    return None if weight is None else weight.reshape(-1).to(acc)


def _affine(x_hat: Tensor, gamma: Tensor | None, beta: Tensor | None) -> Tensor:
    if gamma is not None:
        x_hat = x_hat * gamma
    return x_hat if beta is None else x_hat + beta


def _layer_norm_forward(
    op: str, input: Tensor, normalized_shape: ShapeLike, gamma: Tensor | None, beta: Tensor | None, epsilon: float,
    output_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    acc = accumulate_dtype(input.dtype)
    x = _rows(op, input, normalized_shape).to(acc)
    _shape(op, normalized_shape, gamma, beta)
    var, mean = torch.var_mean(x, -1, correction=0)
    invvar = torch.rsqrt(var + epsilon)
    x_hat = (x - mean[:, None]) * invvar[:, None]
    output = _affine(x_hat, _flat(gamma, acc), _flat(beta, acc))
    return output.to(output_dtype).view(input.shape), mean, invvar


@pybind_numbers("fused_layer_norm_cuda")
def forward_affine(
    input: Tensor, normalized_shape: ShapeLike, gamma: Tensor, beta: Tensor, epsilon: float
) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm with a weight and bias, output in the input's dtype: ``(output, mean, invvar)``."""
    return _layer_norm_forward("forward_affine", input, normalized_shape, gamma, beta, epsilon, input.dtype)


@pybind_numbers("fused_layer_norm_cuda")
def forward_affine_mixed_dtypes(
    input: Tensor, normalized_shape: ShapeLike, gamma: Tensor, beta: Tensor, epsilon: float
) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm with a weight and bias, output in the weight's dtype: ``(output, mean, invvar)``."""
    op = "forward_affine_mixed_dtypes"
    return _layer_norm_forward(op, input, normalized_shape, gamma, beta, epsilon, gamma.dtype)


@pybind_numbers("fused_layer_norm_cuda")
def forward(input: Tensor, normalized_shape: ShapeLike, epsilon: float) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm without a weight or bias: ``(output, mean, invvar)``."""
    return _layer_norm_forward("forward", input, normalized_shape, None, None, epsilon, input.dtype)


def _normalized(
    op: str, input_or_output: Tensor, normalized_shape: ShapeLike, mean: Tensor | None, invvar: Tensor,
    gamma: Tensor | None, beta: Tensor | None, memory_efficient: bool,
) -> Tensor:  # fmt: skip
    """The forward's ``x_hat`` rows: from the input and its statistics, or (memory efficient) from the output."""
    acc = invvar.dtype
    saved = _rows(op, input_or_output, normalized_shape, "input_or_output").to(acc)
    if memory_efficient:
        if beta is not None:
            saved = saved - _flat(beta, acc)
        return saved if gamma is None else saved / _flat(gamma, acc)
    if mean is not None:  # LayerNorm; RMSNorm has no mean
        saved = saved - mean.reshape(-1, 1).to(acc)
    return saved * invvar.reshape(-1, 1)


def _grad_input(d_x_hat: Tensor, x_hat: Tensor, invvar: Tensor, like: Tensor, centred: bool) -> Tensor:
    """``dL/dx`` from ``dL/dx_hat``: LayerNorm's projection (``centred``) or RMSNorm's."""
    grad = d_x_hat - x_hat * (d_x_hat * x_hat).mean(-1, keepdim=True)
    if centred:
        grad = grad - d_x_hat.mean(-1, keepdim=True)
    return (grad * invvar.reshape(-1, 1)).to(like.dtype).view(like.shape)


def _backward(
    op: str, dout: Tensor, mean: Tensor | None, invvar: Tensor, input_or_output: Tensor,
    normalized_shape: ShapeLike, gamma: Tensor | None, beta: Tensor | None, memory_efficient: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:  # fmt: skip
    memory_efficient = checked_switch(f"fused_layer_norm_cuda.{op}", "memory_efficient", memory_efficient)
    if mean is None and not memory_efficient:
        raise ValueError(f"fused_layer_norm_cuda.{op}: mean is None, which only memory_efficient=True allows")
    return _norm_backward(
        op, dout, mean, invvar, input_or_output, normalized_shape, gamma, beta, memory_efficient, centred=True
    )


def _norm_backward(
    op: str, dout: Tensor, mean: Tensor | None, invvar: Tensor, input_or_output: Tensor,
    normalized_shape: ShapeLike, gamma: Tensor | None, beta: Tensor | None, memory_efficient: bool, centred: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:  # fmt: skip
    """LayerNorm's gradients (``centred``), or RMSNorm's (no mean subtracted, so none in the gradient)."""
    # pybind11 refused anything but a bool here; by truthiness "False" took the output for the input (wrong grads)
    memory_efficient = checked_switch(f"fused_layer_norm_cuda.{op}", "memory_efficient", memory_efficient)
    _check_dout(op, dout, input_or_output)
    _check_stats(op, _rows(op, input_or_output, normalized_shape, "input_or_output").shape[0], mean, invvar)
    _shape(op, normalized_shape, gamma, beta)
    acc = invvar.dtype
    x_hat = _normalized(op, input_or_output, normalized_shape, mean, invvar, gamma, beta, memory_efficient)
    d_out = _rows(op, dout, normalized_shape, "dout").to(acc)
    d_x_hat = d_out if gamma is None else d_out * _flat(gamma, acc)
    grad_input = _grad_input(d_x_hat, x_hat, invvar, input_or_output, centred=centred)
    grad_gamma = None if gamma is None else (d_out * x_hat).sum(0).to(gamma.dtype).view(gamma.shape)
    grad_beta = None if beta is None else d_out.sum(0).to(beta.dtype).view(beta.shape)
    return grad_input, grad_gamma, grad_beta


@pybind_numbers("fused_layer_norm_cuda")
def backward_affine(
    dout: Tensor, mean: Tensor | None, invvar: Tensor, input_or_output: Tensor, normalized_shape: ShapeLike,
    gamma: Tensor, beta: Tensor, epsilon: float, memory_efficient: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """LayerNorm's ``(grad_input, grad_gamma, grad_beta)``; ``memory_efficient`` (Apex's ninth argument, absent
    before 2023) says ``input_or_output`` is the output."""
    grads = _backward(
        "backward_affine", dout, mean, invvar, input_or_output, normalized_shape, gamma, beta, memory_efficient
    )
    return grads  # type: ignore[return-value]


@pybind_numbers("fused_layer_norm_cuda")
def backward(
    dout: Tensor, mean: Tensor | None, invvar: Tensor, input_or_output: Tensor, normalized_shape: ShapeLike,
    epsilon: float, memory_efficient: bool = False,
) -> Tensor:  # fmt: skip
    """LayerNorm's ``grad_input`` without a weight or bias."""
    return _backward("backward", dout, mean, invvar, input_or_output, normalized_shape, None, None, memory_efficient)[0]


def _rms_norm_forward(
    op: str, input: Tensor, normalized_shape: ShapeLike, gamma: Tensor | None, epsilon: float,
    output_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    acc = accumulate_dtype(input.dtype)
    x = _rows(op, input, normalized_shape).to(acc)
    _shape(op, normalized_shape, gamma)
    invvar = torch.rsqrt(x.square().mean(-1) + epsilon)
    output = _affine(x * invvar[:, None], _flat(gamma, acc), None)
    return output.to(output_dtype).view(input.shape), invvar


@pybind_numbers("fused_layer_norm_cuda")
def rms_forward_affine(
    input: Tensor, normalized_shape: ShapeLike, gamma: Tensor, epsilon: float
) -> tuple[Tensor, Tensor]:
    """RMSNorm with a weight, output in the input's dtype: ``(output, invvar)``."""
    return _rms_norm_forward("rms_forward_affine", input, normalized_shape, gamma, epsilon, input.dtype)


@pybind_numbers("fused_layer_norm_cuda")
def rms_forward_affine_mixed_dtypes(
    input: Tensor, normalized_shape: ShapeLike, gamma: Tensor, epsilon: float
) -> tuple[Tensor, Tensor]:
    """RMSNorm with a weight, output in the weight's dtype: ``(output, invvar)``."""
    return _rms_norm_forward("rms_forward_affine_mixed_dtypes", input, normalized_shape, gamma, epsilon, gamma.dtype)


@pybind_numbers("fused_layer_norm_cuda")
def rms_forward(input: Tensor, normalized_shape: ShapeLike, epsilon: float) -> tuple[Tensor, Tensor]:
    """RMSNorm without a weight: ``(output, invvar)``."""
    return _rms_norm_forward("rms_forward", input, normalized_shape, None, epsilon, input.dtype)


@pybind_numbers("fused_layer_norm_cuda")
def rms_backward_affine(
    dout: Tensor, invvar: Tensor, input_or_output: Tensor, normalized_shape: ShapeLike, gamma: Tensor,
    epsilon: float, memory_efficient: bool = False,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """RMSNorm's ``(grad_input, grad_gamma)``."""
    grad_input, grad_gamma, _ = _rms_backward(
        "rms_backward_affine", dout, invvar, input_or_output, normalized_shape, gamma, memory_efficient
    )
    return grad_input, grad_gamma  # type: ignore[return-value]


@pybind_numbers("fused_layer_norm_cuda")
def rms_backward(
    dout: Tensor, invvar: Tensor, input_or_output: Tensor, normalized_shape: ShapeLike, epsilon: float,
    memory_efficient: bool = False,
) -> Tensor:  # fmt: skip
    """RMSNorm's ``grad_input`` without a weight."""
    return _rms_backward("rms_backward", dout, invvar, input_or_output, normalized_shape, None, memory_efficient)[0]


def _rms_backward(
    op: str, dout: Tensor, invvar: Tensor, input_or_output: Tensor, normalized_shape: ShapeLike,
    gamma: Tensor | None, memory_efficient: bool,
) -> tuple[Tensor, Tensor | None, None]:  # fmt: skip
    grad_input, grad_gamma, _ = _norm_backward(
        op, dout, None, invvar, input_or_output, normalized_shape, gamma, None, memory_efficient, centred=False
    )
    return grad_input, grad_gamma, None
