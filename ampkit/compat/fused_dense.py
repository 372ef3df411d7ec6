"""``apex.fused_dense``: Apex's cuBLASLt dense layers, ``FusedDense`` and ``FusedDenseGeluDense``, on PyTorch ops.

``FusedDense(in_features, out_features, bias=True)`` is ``input @ weight.T + bias``; ``FusedDenseGeluDense(in,
intermediate, out)`` is two of them with GELU between, the tanh approximation that cuBLASLt's GELU epilogue
computes. The autograd Functions keep Apex's ``apply`` arguments and gradients (``FusedDenseFunc``,
``DenseNoBiasFunc``, ``FusedDenseGeluDenseFunc``), which projects call directly; inputs may have any number of
leading dimensions (Apex's kernels took 2-D only). Under autocast the arguments are cast to its dtype and the maths
runs outside it, as in Apex. Parameters start as ``torch.nn.Linear``'s (Apex left them uninitialized).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ampkit.compat._kernel_dtype import in_input_dtype
from ampkit.ops._switches import checked_switch
from ampkit.ops._transforms import transforms_active
from ampkit.wording import shown

__all__ = [
    "DenseNoBiasFunc",
    "FusedDense",
    "FusedDenseFunc",
    "FusedDenseGeluDense",
    "FusedDenseGeluDenseFunc",
    "dense_no_bias_function",
    "fused_dense_function",
    "fused_dense_gelu_dense_function",
]


def _rows(x: Tensor) -> Tensor:
    """``x`` as 2-D ``(rows, features)``."""
    return x.reshape(-1, x.shape[-1])


def _check(name: str, input: Tensor, *weights: Tensor) -> None:
    features = input.shape[-1] if input.dim() else 0
    for index, weight in enumerate(weights, start=1):
        if weight.dim() != 2 or weight.shape[1] != features:
            raise ValueError(
                f"apex.fused_dense.{name}: weight{index if len(weights) > 1 else ''} must be [out, {features}] to "
                f"take the input's last dimension ({list(input.shape)}), got {list(weight.shape)}"
            )
        features = weight.shape[0]


def _tanh_gelu_grad(x: Tensor) -> Tensor:
    """d/dx of ``gelu(x, approximate="tanh")``."""
    k = math.sqrt(2.0 / math.pi)
    inner = k * (x + 0.044715 * x.pow(3))
    tanh = torch.tanh(inner)
    return 0.5 * (1 + tanh) + 0.5 * x * (1 - tanh.pow(2)) * k * (1 + 3 * 0.044715 * x.pow(2))


class FusedDenseFunc(torch.autograd.Function):
    """``apply(input, weight, bias)``: ``input @ weight.T + bias``."""

    @staticmethod
    @in_input_dtype
    def forward(ctx: Any, input: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        _check("FusedDenseFunc", input, weight)
        ctx.save_for_backward(input, weight)
        return F.linear(input, weight, bias)

    @staticmethod
    @in_input_dtype
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        input, weight = ctx.saved_tensors
        grad_rows = _rows(grad_output)
        grad_input = (grad_rows @ weight).reshape(input.shape)
        return grad_input, grad_rows.t() @ _rows(input), grad_rows.sum(0)


class DenseNoBiasFunc(torch.autograd.Function):
    """``apply(input, weight)``: ``input @ weight.T``."""

    @staticmethod
    @in_input_dtype
    def forward(ctx: Any, input: Tensor, weight: Tensor) -> Tensor:
        _check("DenseNoBiasFunc", input, weight)
        ctx.save_for_backward(input, weight)
        return F.linear(input, weight)

    @staticmethod
    @in_input_dtype
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, Tensor]:
        input, weight = ctx.saved_tensors
        grad_rows = _rows(grad_output)
        return (grad_rows @ weight).reshape(input.shape), grad_rows.t() @ _rows(input)


class FusedDenseGeluDenseFunc(torch.autograd.Function):
    """``apply(input, weight1, bias1, weight2, bias2)``: ``gelu_tanh(input @ weight1.T + bias1) @ weight2.T +
    bias2``."""

    @staticmethod
    @in_input_dtype
    def forward(ctx: Any, input: Tensor, weight1: Tensor, bias1: Tensor, weight2: Tensor, bias2: Tensor) -> Tensor:
        _check("FusedDenseGeluDenseFunc", input, weight1, weight2)
        gelu_in = F.linear(input, weight1, bias1)
        output1 = F.gelu(gelu_in, approximate="tanh")
        ctx.save_for_backward(input, weight1, weight2, gelu_in, output1, bias1, bias2)
        return F.linear(output1, weight2, bias2)

    @staticmethod
    @in_input_dtype
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        input, weight1, weight2, gelu_in, output1, bias1, bias2 = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a gradient penalty, gradgradcheck
            return _differentiable_gelu_grads(ctx, grad_output, (input, weight1, bias1, weight2, bias2))
        grad2 = _rows(grad_output)
        grad_weight2, grad_bias2 = grad2.t() @ _rows(output1), grad2.sum(0)
        grad1 = (grad2 @ weight2) * _tanh_gelu_grad(_rows(gelu_in))
        grad_input = (grad1 @ weight1).reshape(input.shape)
        return grad_input, grad1.t() @ _rows(input), grad1.sum(0), grad_weight2, grad_bias2


def _dense_gelu_dense(input: Tensor, weight1: Tensor, bias1: Tensor, weight2: Tensor, bias2: Tensor) -> Tensor:
    """The linear-GELU-linear as torch ops, which autograd, ``torch.func`` and ``torch.compile`` see through."""
    return F.linear(F.gelu(F.linear(input, weight1, bias1), approximate="tanh"), weight2, bias2)


def _differentiable_gelu_grads(ctx: Any, grad_output: Tensor, args: tuple[Tensor, ...]) -> tuple:
    """``FusedDenseGeluDenseFunc``'s gradients as a graph of their own: the saved GELU input and output carry no graph
    back to the input and weights (their second derivatives came out wrong, with no error), so the layers run again
    on the saved inputs and are differentiated."""
    with torch.enable_grad():
        output = _dense_gelu_dense(*args)
        needed = [need and t.requires_grad for t, need in zip(args, ctx.needs_input_grad, strict=True)]
        wanted = [t for t, need in zip(args, needed, strict=True) if need]
        grads = iter(torch.autograd.grad(output, wanted, grad_output, create_graph=True, allow_unused=True))
    return tuple(next(grads) if need else None for need in needed)


def _outside_autocast(function: Any, plain: Any, *args: Tensor) -> Tensor:
    """Apex's ``_cast_if_autocast_enabled``: under autocast, floating arguments take its dtype, then the op runs
    with autocast off. Under a trace, ``torch.compile``, ``torch.func`` or forward-mode AD ``plain`` (the same maths
    as torch ops) runs in place of the autograd ``function``, which they cannot see through."""
    device_type = args[0].device.type
    if transforms_active():
        function = plain
    if not torch.is_autocast_enabled(device_type):
        return function(*args)
    dtype = torch.get_autocast_dtype(device_type)
    args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    with torch.autocast(device_type, enabled=False):
        return function(*args)


def fused_dense_function(input: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``FusedDenseFunc.apply`` with Apex's autocast handling."""
    return _outside_autocast(FusedDenseFunc.apply, F.linear, input, weight, bias)


def dense_no_bias_function(input: Tensor, weight: Tensor) -> Tensor:
    """``DenseNoBiasFunc.apply`` with Apex's autocast handling."""
    return _outside_autocast(DenseNoBiasFunc.apply, F.linear, input, weight)


def fused_dense_gelu_dense_function(
    input: Tensor, weight1: Tensor, bias1: Tensor, weight2: Tensor, bias2: Tensor
) -> Tensor:
    """``FusedDenseGeluDenseFunc.apply`` with Apex's autocast handling."""
    return _outside_autocast(FusedDenseGeluDenseFunc.apply, _dense_gelu_dense, input, weight1, bias1, weight2, bias2)


def _linear_parameters(
    out_features: int, in_features: int, bias: bool, device: torch.device | str | None, dtype: torch.dtype | None
) -> tuple[nn.Parameter, nn.Parameter | None]:
    """An uninitialized ``[out, in]`` weight and ``[out]`` bias (None without ``bias``), made as ``nn.Linear`` makes
    them: on ``device`` in ``dtype``."""
    weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
    return weight, nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None


def _reset_linear(weight: Tensor, bias: Tensor | None) -> None:
    """``nn.Linear.reset_parameters``: the same draws in the same order, so a seeded model starts as with nn.Linear."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        fan_in, _ = nn.init._calculate_fan_in_and_fan_out(weight)
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(bias, -bound, bound)


class FusedDense(nn.Module):
    """Apex's ``FusedDense(in_features, out_features, bias=True)``: ``weight`` is ``[out, in]``, as in nn.Linear,
    whose ``device``/``dtype`` it takes and whose state dicts it loads and gives."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        bias = checked_switch("FusedDense", "bias", bias)  # nn.Linear reads it by truthiness: "False" gave a bias
        self.weight, bias_parameter = _linear_parameters(out_features, in_features, bias, device, dtype)
        self.register_parameter("bias", bias_parameter)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """As ``nn.Linear``'s (Apex left the parameters uninitialized); FSDP2's deferred init calls it after
        ``to_empty``."""
        _reset_linear(self.weight, self.bias)

    def forward(self, input: Tensor) -> Tensor:
        if self.bias is not None:
            return fused_dense_function(input, self.weight, self.bias)
        return dense_no_bias_function(input, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class FusedDenseGeluDense(nn.Module):
    """Apex's ``FusedDenseGeluDense(in_features, intermediate_features, out_features)``: ``weight1``/``bias1`` then
    GELU (tanh approximation) then ``weight2``/``bias2``."""

    def __init__(
        self,
        in_features: int,
        intermediate_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if bias is not True:
            raise ValueError(f"FusedDenseGeluDense takes bias=True only, as in Apex, got bias={shown(bias)}")
        self.in_features = in_features
        self.intermediate_features = intermediate_features
        self.out_features = out_features
        self.weight1, self.bias1 = _linear_parameters(intermediate_features, in_features, True, device, dtype)
        self.weight2, self.bias2 = _linear_parameters(out_features, intermediate_features, True, device, dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each layer as ``nn.Linear``'s."""
        _reset_linear(self.weight1, self.bias1)
        _reset_linear(self.weight2, self.bias2)

    def forward(self, input: Tensor) -> Tensor:
        return fused_dense_gelu_dense_function(input, self.weight1, self.bias1, self.weight2, self.bias2)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, intermediate_features={self.intermediate_features}, "
            f"out_features={self.out_features}"
        )
