"""The reference float8 Linear: ``nn.Linear`` whose three GEMMs run on float8-cast operands, emulated in float32.

It keeps ``nn.Linear``'s parameters (``weight``, ``bias``), so its ``state_dict`` loads into a plain ``nn.Linear``
and back. Under autocast its output has the autocast dtype, as torchao's; the casts and GEMMs themselves run with
autocast off, so what autocast would round does not change them.

Each emulated GEMM (casts, float32 product, rounding to the output dtype) is one custom op that ``torch.compile``
cannot see into, so a compiled model computes the same bits as eager on any device. Traced, the chain would not:
inductor's Triton ``/`` in float32 is approximate, its ``log2``/``exp2`` may differ from eager's by an ulp, and it
drops a float32 -> bfloat16 -> float32 round trip it fuses (the product's rounding to the output dtype under O1,
and the bias's cast to it, which is one more custom op).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ampkit.amp.fp8.casts import from_float8, scaled_cast
from ampkit.amp.fp8.recipes import Float8Recipe, OperandCast


def scaled_mm(
    a: torch.Tensor, b: torch.Tensor, cast_a: OperandCast, cast_b: OperandCast, power_of_2: bool, out_dtype
) -> torch.Tensor:
    """``a @ b`` with both operands cast to float8 (rowwise: ``a`` per row, ``b`` per column), multiplied in
    float32 and rounded to ``out_dtype``; in high precision (``a``'s dtype) when the recipe keeps them there."""
    return _emulated_scaled_mm(a, b, cast_a.dtype, cast_a.rowwise, cast_b.dtype, cast_b.rowwise, power_of_2, out_dtype)


@torch.library.custom_op("ampkit::float8_emulated_mm", mutates_args=())
def _emulated_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_dtype: torch.dtype | None,
    a_rowwise: bool,
    b_dtype: torch.dtype | None,
    b_rowwise: bool,
    power_of_2: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    if a_dtype is None:
        return torch.mm(a, b.to(a.dtype)).to(out_dtype)
    a_data, a_scale, _ = scaled_cast(a, OperandCast(a_dtype, a_rowwise), -1, power_of_2)
    b_data, b_scale, _ = scaled_cast(b, OperandCast(b_dtype, b_rowwise), 0, power_of_2)
    return torch.mm(from_float8(a_data, a_scale), from_float8(b_data, b_scale)).to(out_dtype)


@_emulated_scaled_mm.register_fake
def _(a, b, a_dtype, a_rowwise, b_dtype, b_rowwise, power_of_2, out_dtype) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.custom_op("ampkit::float8_unfused_cast", mutates_args=())
def _unfused_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` that inductor cannot fuse into the add it feeds (it would skip the rounding, as above)."""
    return x.to(dtype, copy=True)


@_unfused_cast.register_fake
def _(x, dtype) -> torch.Tensor:
    return torch.empty_like(x, dtype=dtype)


def _unfused_cast_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.dtype = inputs[0].dtype


_unfused_cast.register_autograd(lambda ctx, grad: (grad.to(ctx.dtype), None), setup_context=_unfused_cast_setup)


class Float8Matmul(torch.autograd.Function):
    """``input @ weight.t()`` whose forward and both backward GEMMs cast their operands as ``recipe`` says."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor, recipe: Float8Recipe, out_dtype) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.recipe = recipe
        with torch.autocast(input.device.type, enabled=False):
            x = input.reshape(-1, input.shape[-1])
            out = scaled_mm(x, weight.t(), recipe.input, recipe.weight, recipe.power_of_2_scales, out_dtype)
        return out.reshape(*input.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight = ctx.saved_tensors
        r: Float8Recipe = ctx.recipe
        pow2 = r.power_of_2_scales
        grad_input = grad_weight = None
        with torch.autocast(grad_output.device.type, enabled=False):
            dy = grad_output.reshape(-1, grad_output.shape[-1])
            if ctx.needs_input_grad[0]:
                grad_input = scaled_mm(dy, weight, r.grad_output, r.weight_for_grad_input, pow2, dy.dtype)
                grad_input = grad_input.reshape(*input.shape[:-1], weight.shape[1]).to(input.dtype)
            if ctx.needs_input_grad[1]:
                x = input.reshape(-1, input.shape[-1])
                cast_dy, cast_x = r.grad_output_for_grad_weight, r.input_for_grad_weight
                grad_weight = scaled_mm(dy.t(), x, cast_dy, cast_x, pow2, dy.dtype).to(weight.dtype)
        return grad_input, grad_weight, None, None


class Float8Linear(nn.Linear):
    """``nn.Linear`` computing in emulated float8 per ``recipe`` (ampkit's reference backend)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe: Float8Recipe, **kw) -> None:
        super().__init__(in_features, out_features, bias, **kw)
        self.recipe = recipe

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Float8Recipe) -> Float8Linear:
        """A Float8Linear sharing ``linear``'s parameters (no copy)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False, recipe=recipe)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        device = input.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else input.dtype
        output = Float8Matmul.apply(input, self.weight, self.recipe, out_dtype)
        if self.bias is None:
            return output
        return output + (self.bias if self.bias.dtype == output.dtype else _unfused_cast(self.bias, output.dtype))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"
