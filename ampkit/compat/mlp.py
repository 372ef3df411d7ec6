"""``apex.mlp``: Apex's fused MLP, ``MLP(mlp_sizes, bias=True, activation="relu")``, on PyTorch ops (any device).

Every layer is a linear map followed by the activation, the last one included, as in Apex's kernel. The
parameters keep Apex's layout: ``weights``/``biases`` lists whose entries are the module's ``weight_{i}`` and
``bias_{i}``, so Apex checkpoints load. ``MlpFunction`` keeps Apex's calling convention
(``forward(ctx, bias, activation, input, *weights, *biases)``), which projects such as NVIDIA's DLRM call from
their own autograd Functions.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from copy import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ampkit.compat._kernel_dtype import in_input_dtype
from ampkit.ops._switches import checked_switch
from ampkit.ops._transforms import transforms_active
from ampkit.wording import shown

__all__ = ["MLP", "MlpFunction", "mlp_function"]

_ACTIVATIONS = {"none": 0, "relu": 1, "sigmoid": 2}


def _activate(x: Tensor, activation: int) -> Tensor:
    if activation == 1:
        return torch.relu(x)
    return torch.sigmoid(x) if activation == 2 else x


def _through_activation(grad: Tensor, activated: Tensor, activation: int) -> Tensor:
    """The gradient before the activation, from the one after it and the activated output."""
    if activation == 1:
        return grad * (activated > 0).to(grad.dtype)
    return grad * activated * (1 - activated) if activation == 2 else grad


def _layers(use_bias: int, args: Sequence[Tensor]) -> tuple[Tensor, Sequence[Tensor], Sequence[Tensor | None]]:
    """``(input, weights, biases)`` from Apex's flat ``(input, *weights, *biases)``, checked to chain."""
    per_layer = 2 if use_bias else 1
    count = (len(args) - 1) // per_layer
    if count == 0 or len(args) - 1 != count * per_layer:
        raise ValueError(
            f"apex.mlp: expected the input and then {per_layer} tensor(s) per layer (weights, then biases when "
            f"bias={use_bias}), got {len(args) - 1} after the input"
        )
    x, weights = args[0], args[1 : 1 + count]
    biases = args[1 + count :] if use_bias else [None] * count
    if x.dim() != 2:
        raise ValueError(f"apex.mlp: the input must be 2-D (batch, features), got shape {list(x.shape)}")
    features = x.shape[1]
    for i, (weight, bias) in enumerate(zip(weights, biases, strict=True)):
        if weight.dim() != 2 or weight.shape[1] != features:
            raise ValueError(
                f"apex.mlp: weights[{i}] must be [out, {features}] to take the previous layer's {features} "
                f"features, got {list(weight.shape)}"
            )
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"apex.mlp: biases[{i}] must be [{weight.shape[0]}], got {list(bias.shape)}")
        for name, tensor in ((f"weights[{i}]", weight), (f"biases[{i}]", bias)):
            if tensor is not None and tensor.dtype != x.dtype:
                raise TypeError(
                    f"apex.mlp: {name} is {tensor.dtype} but the input is {x.dtype}; Apex's kernel takes one "
                    "floating dtype (cast the input, or run under autocast)"
                )
        features = weight.shape[0]
    if not x.is_floating_point():
        raise TypeError(f"apex.mlp: the input must be floating-point, got {x.dtype}")
    return x, weights, biases


def mlp_forward(use_bias: int, activation: int, args: Sequence[Tensor]) -> list[Tensor]:
    """``[output, *each layer's activated output]`` (Apex returned ``[output, reserved_space]``)."""
    x, weights, biases = _layers(use_bias, args)
    activated = []
    for weight, bias in zip(weights, biases, strict=True):
        x = _activate(F.linear(x, weight, bias), activation)
        activated.append(x)
    return [x, *activated]


def mlp_backward(
    use_bias: int, activation: int, grad_o: Tensor, fprop_outputs: Sequence[Tensor], args: Sequence[Tensor]
) -> list[Tensor]:
    """``[grad_input, *grad_weights, *grad_biases]`` from the forward's outputs and inputs."""
    x, weights, _ = _layers(use_bias, args)
    activated = list(fprop_outputs[1:])
    layer_inputs = [x, *activated[:-1]]
    grad = grad_o
    grad_weights: list[Tensor] = [grad] * len(weights)
    grad_biases: list[Tensor] = [grad] * len(weights)
    for i in reversed(range(len(weights))):
        grad = _through_activation(grad, activated[i], activation)
        grad_weights[i] = grad.t() @ layer_inputs[i]
        grad_biases[i] = grad.sum(0)
        grad = grad @ weights[i]
    return [grad, *grad_weights, *(grad_biases if use_bias else [])]


class MlpFunction(torch.autograd.Function):
    """Apex's autograd Function: ``apply(bias, activation, input, *weights, *biases)``."""

    @staticmethod
    @in_input_dtype
    def forward(ctx: Any, bias: int, activation: int, *args: Tensor) -> Tensor:
        output = mlp_forward(bias, activation, args)
        # Saved, not kept as ctx attributes: a backward with retain_graph=True may run again, and a ctx holding its
        # own output would be a reference cycle.
        ctx.save_for_backward(*args, *output[1:])
        ctx.num_args = len(args)
        ctx.bias = bias
        ctx.activation = activation
        return output[0]

    @staticmethod
    @in_input_dtype
    def backward(ctx: Any, grad_o: Tensor) -> tuple:
        saved = ctx.saved_tensors
        args, activated = saved[: ctx.num_args], saved[ctx.num_args :]
        if torch.is_grad_enabled():  # create_graph=True: the layers' own ops, so second derivatives are exact
            return (None, None, *_differentiable_grads(ctx, grad_o, args))
        grads = mlp_backward(ctx.bias, ctx.activation, grad_o, [activated[-1], *activated], args)
        return (None, None, *grads)


def _differentiable_grads(ctx: Any, grad_o: Tensor, args: Sequence[Tensor]) -> list[Tensor | None]:
    """The gradients as a graph of their own (a gradient penalty, gradgradcheck): the saved activations carry no
    graph back to the input and weights, so the layers are run again on the saved inputs and differentiated."""
    with torch.enable_grad():
        output = _plain_forward(ctx.bias, ctx.activation, args)
        needed = [need and t.requires_grad for t, need in zip(args, ctx.needs_input_grad[2:], strict=True)]
        wanted = [t for t, need in zip(args, needed, strict=True) if need]
        grads = iter(torch.autograd.grad(output, wanted, grad_o, create_graph=True, allow_unused=True))
    return [next(grads) if need else None for need in needed]


def _plain_forward(use_bias: int, activation: int, args: Sequence[Tensor]) -> Tensor:
    """The MLP as torch ops autograd differentiates itself (what ``torch.func``, ``torch.compile`` and a second
    derivative need)."""
    return mlp_forward(use_bias, activation, args)[0]


def mlp_function(bias: int, activation: int, *args: Tensor) -> Tensor:
    """``MlpFunction.apply`` with Apex's autocast rule: under autocast the tensors are cast to its dtype first."""
    device_type = args[0].device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        cast = [a.to(dtype) if a.is_floating_point() else a for a in args]
        with torch.autocast(device_type, enabled=False):
            return _run(bias, activation, cast)
    return _run(bias, activation, args)


def _run(bias: int, activation: int, args: Sequence[Tensor]) -> Tensor:
    if transforms_active():
        return _plain_forward(bias, activation, args)
    return MlpFunction.apply(bias, activation, *args)


def _is_positive_int(size: Any) -> bool:
    """An int-like layer size above zero (numpy integers included, as Apex's ``torch.empty`` took them)."""
    try:
        return operator.index(size) > 0
    except TypeError:
        return False


class MLP(nn.Module):
    """Apex's MLP: ``mlp_sizes`` ``[in, h1, ..., out]`` make ``len(mlp_sizes) - 1`` layers, each followed by the
    activation (``"none"``, ``"relu"`` or ``"sigmoid"``)."""

    def __init__(
        self,
        mlp_sizes: Sequence[int],
        bias: bool = True,
        activation: str = "relu",
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise TypeError(
                f"apex.mlp.MLP: activation {shown(activation)} is not one of {', '.join(map(repr, _ACTIVATIONS))}"
            )
        if len(mlp_sizes) < 2 or not all(_is_positive_int(n) for n in mlp_sizes):
            raise ValueError(
                f"apex.mlp.MLP: mlp_sizes must be [in, ..., out], at least two positive ints, got {list(mlp_sizes)}"
            )
        self.num_layers = len(mlp_sizes) - 1
        self.mlp_sizes = copy(mlp_sizes)
        self.bias = 1 if checked_switch("apex.mlp.MLP", "bias", bias) else 0  # "False" would build biases
        self.activation = _ACTIVATIONS[activation]
        factory = {"device": device, "dtype": dtype}
        for i in range(self.num_layers):
            out_features, in_features = mlp_sizes[i + 1], mlp_sizes[i]
            setattr(self, f"weight_{i}", nn.Parameter(torch.empty(out_features, in_features, **factory)))
            if self.bias:
                setattr(self, f"bias_{i}", nn.Parameter(torch.empty(out_features, **factory)))
        self.reset_parameters()

    # Apex's lists, read from the registered parameters on every access: a list built once kept the tensors that
    # to_empty(), load_state_dict(assign=True) or torch.func.functional_call put other ones in place of.
    @property
    def weights(self) -> list[nn.Parameter]:
        """Each layer's weight, ``[out, in]``: the module's ``weight_{i}``."""
        return [getattr(self, f"weight_{i}") for i in range(self.num_layers)]

    @property
    def biases(self) -> list[nn.Parameter]:
        """Each layer's bias (none without ``bias``): the module's ``bias_{i}``."""
        return [getattr(self, f"bias_{i}") for i in range(self.num_layers)] if self.bias else []

    def reset_parameters(self) -> None:
        """Apex's initialisation: normal weights with std ``sqrt(2 / (fan_in + fan_out))``, biases ``sqrt(1 / out)``."""
        for weight in self.weights:
            nn.init.normal_(weight, 0.0, math.sqrt(2.0 / float(weight.size(0) + weight.size(1))))
        for bias in self.biases:
            nn.init.normal_(bias, 0.0, math.sqrt(1.0 / float(bias.size(0))))

    def forward(self, input: Tensor) -> Tensor:
        return mlp_function(self.bias, self.activation, input, *self.weights, *self.biases)

    def extra_repr(self) -> str:
        return f"MLP sizes: {self.mlp_sizes}, Bias={self.bias}, activation={self.activation}"
