"""Apex's manual mixed-precision helpers (``apex.fp16_utils.fp16util``), keyed on dtype, never on CUDA types.

Every function takes a ``dtype`` (float16 by default, as in Apex; bfloat16 works too) and works on any device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ampkit.ops._switches import checked_switch


class tofp16(torch.nn.Module):
    """Module that casts its floating-point input to ``dtype`` (Apex's first layer of ``network_to_half``)."""

    def __init__(self, dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input.to(self.dtype) if input.is_floating_point() else input


def BN_convert_float(module: torch.nn.Module) -> torch.nn.Module:
    """Cast affine batch-norm layers back to float32 (their statistics need the range), recursively."""
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.affine:
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def network_to_half(network: torch.nn.Module, dtype: torch.dtype = torch.float16) -> torch.nn.Module:
    """``Sequential(tofp16(), network)`` with the network cast to ``dtype`` except its affine batch norms."""
    return torch.nn.Sequential(tofp16(dtype), BN_convert_float(network.to(dtype)))


def convert_module(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast a module's own (non-recursive) floating parameters and buffers to ``dtype``."""
    for param in module.parameters(recurse=False):
        if param.is_floating_point():
            param.data = param.data.to(dtype)
            if param.grad is not None:
                param.grad.data = param.grad.data.to(dtype)
    for name, buf in module.named_buffers(recurse=False):
        if buf is not None and buf.is_floating_point():
            setattr(module, name, buf.to(dtype))


def convert_network(network: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast every module to ``dtype`` except affine batch norms, which stay float32 (Apex's rule)."""
    for module in network.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.affine:
            continue
        convert_module(module, dtype)
        if isinstance(module, torch.nn.RNNBase):
            module.flatten_parameters()
    return network


class FP16Model(torch.nn.Module):
    """Wrap a network converted to ``dtype`` (batch norms kept float32); floating inputs are cast on entry."""

    dtype = torch.float16  # Apex's FP16Model had no such field (always half): a model pickled with it loads

    def __init__(self, network: torch.nn.Module, dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        self.dtype = dtype
        self.network = convert_network(network, dtype=dtype)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        inputs = tuple(t.to(self.dtype) if torch.is_tensor(t) and t.is_floating_point() else t for t in inputs)
        return self.network(*inputs)


def prep_param_lists(
    model: torch.nn.Module, flat_master: bool = False
) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """Return ``(model_params, master_params)``: fp32 copies of the trainable params to hand the optimizer.

    With ``flat_master=True`` the masters are one flat fp32 parameter, whatever mix of float dtypes the model has.
    """
    # by truthiness "False" returned one flat master, which the optimizer would then step as the only parameter
    flat_master = checked_switch("prep_param_lists", "flat_master", flat_master)
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        if not model_params:
            raise ValueError(
                "prep_param_lists(flat_master=True): the model has no parameters with requires_grad=True to make a "
                "flat master of; use flat_master=False (it returns empty lists) or unfreeze a parameter"
            )
        # mixed dtypes (network_to_half keeps BatchNorm in fp32) flatten by type promotion, as Apex's did on torch 1.5+
        master = torch.nn.Parameter(_flatten_dense_tensors([p.detach() for p in model_params]).float())
        return model_params, [master]
    master_params = [torch.nn.Parameter(p.detach().clone().float()) for p in model_params]
    return model_params, master_params


def model_grads_to_master_grads(
    model_params: Sequence[torch.nn.Parameter], master_params: Sequence[torch.nn.Parameter], flat_master: bool = False
) -> None:
    """Copy model grads into the fp32 master grads (creating them); a model param without grad clears it."""
    _check_param_lists("model_grads_to_master_grads", model_params, master_params, flat_master)
    if flat_master:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model_params]
        master_params[0].grad = _flatten_dense_tensors([g.detach() for g in grads]).float()
        return
    for model, master in zip(model_params, master_params, strict=True):
        if model.grad is None:
            master.grad = None
        elif master.grad is None:
            master.grad = model.grad.detach().float()
        else:
            master.grad.copy_(model.grad)


def master_params_to_model_params(
    model_params: Sequence[torch.nn.Parameter], master_params: Sequence[torch.nn.Parameter], flat_master: bool = False
) -> None:
    """Copy the fp32 master values back into the (lower-precision) model params."""
    _check_param_lists("master_params_to_model_params", model_params, master_params, flat_master)
    with torch.no_grad():
        if flat_master:
            for model, master in zip(
                model_params, _unflatten_dense_tensors(master_params[0], model_params), strict=True
            ):
                model.copy_(master)
            return
        for model, master in zip(model_params, master_params, strict=True):
            model.copy_(master)


def _check_param_lists(
    caller: str,
    model_params: Sequence[torch.Tensor],
    master_params: Sequence[torch.Tensor],
    flat_master: bool,
) -> None:
    """Refuse lists that do not pair up one to one (Apex's zip silently copied a prefix, or broadcast a shape)."""
    checked_switch(caller, "flat_master", flat_master)
    advice = "pass the two lists prep_param_lists returned, in its order"
    if flat_master:
        total = sum(p.numel() for p in model_params)
        if len(master_params) != 1 or master_params[0].numel() != total:
            sizes = [m.numel() for m in master_params]
            raise ValueError(
                f"{caller}(flat_master=True) needs one flat master of {total} elements (the model params' total), "
                f"got master sizes {sizes}; {advice}"
            )
        return
    if len(model_params) != len(master_params):
        raise ValueError(
            f"{caller} got {len(model_params)} model params but {len(master_params)} master params; {advice} "
            "(flat_master=True for a single flat master)"
        )
    for index, (model, master) in enumerate(zip(model_params, master_params, strict=True)):
        if model.shape != master.shape:
            raise ValueError(
                f"{caller}: model param {index} has shape {tuple(model.shape)} but master param {index} has "
                f"{tuple(master.shape)}; {advice}"
            )


def to_python_float(t: torch.Tensor | float) -> float:
    """``t.item()`` for tensors, ``float(t)`` otherwise."""
    return t.item() if torch.is_tensor(t) else float(t)


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Apex's alias of :func:`torch.nn.utils.clip_grad_norm_`."""
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)
