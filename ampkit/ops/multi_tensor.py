"""Multi-tensor primitives over lists of tensors: scale, axpby, combine, L2 norms.

Each op processes a whole list in one call (C++ over ``at::parallel_for`` on CPU; chunked CUDA
kernels on GPU) or, with ``AMPKIT_OPS=reference`` or no compiler, the pure-PyTorch reference in
:mod:`ampkit.ops.reference.multi_tensor`. Conventions shared by all ops:

* Tensors are float32, float16, bfloat16 or float64, all on one device. Paired tensors (``inputs[i]``
  and ``out[i]``) need the same number of elements; their dtypes may differ (e.g. fp16 model grads
  into fp32 master grads). Math runs in float32 (float64 if either side is float64).
* Non-contiguous tensors give the correct result: inputs are read through a contiguous copy and
  outputs written through a scratch buffer that is copied back (one extra pass; grads and params
  are contiguous in practice, so the hot path never pays it). An output may be the very tensor its
  own index's input is (in place) but must not partially overlap it, nor share memory with a tensor of
  another index (every index's chunks run in parallel).
* ``found_inf`` is a one-element float32 or int32 tensor on the tensors' device, like torch's
  ``found_inf`` (float) or Apex's ``noop_flag`` (int). Ops set it to 1 when they see a non-finite
  value (an input, or a factor, which makes every output it scales non-finite) and never clear it,
  so one flag can collect several calls; the ops here do not skip work when it is already set (the
  caller decides, e.g. an optimizer skipping its step).
* Empty lists are valid and do nothing (norms of an empty list are 0).
* Factors may be Python numbers or one-element tensors (read with ``.item()``: a sync on CUDA).
* Bad arguments raise ``RuntimeError`` naming the argument and index, e.g. ``\\`out[2]\\` has 10
  elements but the matching input has 12``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ampkit.ops._build import CSRC_DIR, register_family
from ampkit.ops._switches import is_switch
from ampkit.ops.reference import multi_tensor as reference
from ampkit.wording import beyond_float, integer_digits, shown

__all__ = [
    "L2Norm",
    "axpby_",
    "combine_",
    "kernel_available",
    "l2norm",
    "scale_",
    "unscale_l2norm",
]

_SRC = CSRC_DIR / "multi_tensor"
_FAMILY = register_family(
    "ampkit_multi_tensor",
    sources=[
        _SRC / "multi_tensor_ops.cpp",
        _SRC / "elementwise_cpu.cpp",
        _SRC / "norm_cpu.cpp",
        _SRC / "launch_plan_cpu.cpp",
    ],
    cuda_sources=[_SRC / "multi_tensor_cuda.cpp", _SRC / "multi_tensor_kernels.cu"],
)


class L2Norm(NamedTuple):
    """Result of the L2 norm ops: the norm of all tensors together, and per tensor (None unless asked)."""

    total: torch.Tensor
    per_tensor: torch.Tensor | None


def kernel_available(device: torch.device) -> bool:
    """True when these ops run compiled on ``device`` (building the family on first call), not the reference."""
    return _FAMILY.serves(torch.device(device), "scale_")


def _run(kernel_name: str, reference_op, kernel_args: tuple, reference_args: tuple):
    """Run the kernel (outside autograd: these ops update grads and params in place); if the
    dispatcher has none for these tensors' backends (e.g. a meta tensor in a CPU list), run the
    reference, which raises an error naming the offending argument."""
    op = getattr(torch.ops.ampkit_multi_tensor, kernel_name)
    try:
        if torch.is_grad_enabled():
            with torch.no_grad():
                return op(*kernel_args)
        return op(*kernel_args)
    except NotImplementedError:
        return reference_op(*reference_args)


def _as_list(tensors: Sequence[torch.Tensor], name: str, none_allowed: bool = False) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"`{name}` must be a list or tuple of tensors, got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) and not (none_allowed and t is None):
            raise TypeError(f"`{name}[{i}]` must be a tensor, got {type(t).__name__}")
        if t is not None and t.is_meta:
            raise _on_meta(f"`{name}[{i}]`")
        if t is not None and t.layout != torch.strided:  # read as an expanded tensor, or a dispatcher dump
            raise TypeError(f"`{name}[{i}]` is a {t.layout} tensor; these ops take dense ones (use .to_dense())")
    return list(tensors)


def _on_meta(what: str) -> RuntimeError:
    """A meta tensor holds no values for these ops to read or write: the error names it (it was ``Tensor.item()
    cannot be called on meta tensors``, naming no argument)."""
    return RuntimeError(
        f"{what} is on the meta device, which holds no values; materialize it (e.g. module.to_empty(device=...)) "
        "before these ops read or update it"
    )


def _factor(value: float | torch.Tensor, name: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            raise _on_meta(f"`{name}`")
        if value.numel() != 1:
            raise ValueError(f"`{name}` must be a number or a one-element tensor, got shape {tuple(value.shape)}")
        if value.is_complex() or value.dtype == torch.bool:  # float() named no argument, or read True as 1
            raise TypeError(f"`{name}` must be a real number or a one-element tensor, got a {value.dtype} tensor")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a real number or a one-element tensor, got {type(value).__name__}")
    if beyond_float(value):  # float() raised a bare OverflowError, naming neither
        raise ValueError(f"`{name}` must be a number within a float's range, got {integer_digits(value)}")
    return float(value)


_FLOAT32_MAX = torch.finfo(torch.float32).max


def _flag_non_finite_factors(found_inf: torch.Tensor, scaled: list[torch.Tensor], *factors: float) -> None:
    """Raise the flag for a factor that is not finite in float32, the kernels' arithmetic, if it scaled any element:
    every such output is inf or NaN although the inputs, which the kernels check, were finite (a loss scale of 0
    unscales by inf), and a caller skipping on the flag would have stepped on them."""
    if not all(abs(factor) <= _FLOAT32_MAX for factor in factors) and any(t.numel() for t in scaled):
        found_inf.fill_(1)


def _switch(value: bool, name: str) -> bool:
    """An on/off argument: True or False (numpy's bool_, 0 and 1 too). Anything else reached the kernel's schema as
    a multi-line error, or the reference as truthy."""
    if is_switch(value):
        return bool(value)
    raise TypeError(f"`{name}` must be True or False, got {shown(value)}")


def _arg_to_check(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`arg_to_check` must be -1 (check x and y), 0 (check x) or 1 (check y), got {shown(value)}")
    return int(value)


def _flag(found_inf: torch.Tensor) -> torch.Tensor:
    """The overflow flag the op raises: a tensor (its size, dtype and device are the op's own checks)."""
    if not isinstance(found_inf, torch.Tensor):
        raise TypeError(
            f"`found_inf` must be a one-element float32 or int32 tensor (set to 1 on inf/nan), got "
            f"{type(found_inf).__name__}"
        )
    if found_inf.is_meta:
        raise _on_meta("`found_inf`")
    return found_inf


def scale_(
    inputs: Sequence[torch.Tensor],
    factor: float | torch.Tensor,
    found_inf: torch.Tensor,
    *,
    out: Sequence[torch.Tensor] | None = None,
) -> None:
    """``out[i] = inputs[i] * factor`` (in place when ``out`` is None); flags non-finite inputs.

    Unscaling gradients is ``scale_(grads, 1 / loss_scale, found_inf)``.
    """
    inputs = _as_list(inputs, "inputs")
    outputs = inputs if out is None else _as_list(out, "out")
    factor, found_inf = _factor(factor, "factor"), _flag(found_inf)
    if kernel_available(found_inf.device):
        args = (inputs, outputs, factor, found_inf)
        _run("scale_", reference.scale_, args, args)
    else:
        reference.scale_(inputs, outputs, factor, found_inf)
    _flag_non_finite_factors(found_inf, inputs, factor)


def axpby_(
    a: float,
    x: Sequence[torch.Tensor],
    b: float,
    y: Sequence[torch.Tensor],
    out: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    *,
    arg_to_check: int = -1,
) -> None:
    """``out[i] = a * x[i] + b * y[i]``; flags non-finite values of x and y (-1), only x (0) or only y (1).

    ``x[i]`` and ``y[i]`` share a dtype; ``out`` may alias either.
    """
    x, y, out = _as_list(x, "x"), _as_list(y, "y"), _as_list(out, "out")
    a, b, found_inf = _factor(a, "a"), _factor(b, "b"), _flag(found_inf)
    arg_to_check = _arg_to_check(arg_to_check)
    if kernel_available(found_inf.device):
        kernel_args = (x, y, out, a, b, arg_to_check, found_inf)
        _run("axpby_", reference.axpby_, kernel_args, (a, x, b, y, out, found_inf, arg_to_check))
    else:
        reference.axpby_(a, x, b, y, out, found_inf, arg_to_check)
    _flag_non_finite_factors(found_inf, x, a, b)


def combine_(
    new: Sequence[torch.Tensor],
    stash: Sequence[torch.Tensor | None] | None,
    out: Sequence[torch.Tensor],
    inv_scale: float | torch.Tensor,
    found_inf: torch.Tensor,
) -> None:
    """``out[i] = new[i] * inv_scale + stash[i]``: unscale one backward's grads onto the stashed ones.

    Only ``new`` is checked for non-finite values (an overflow of this loss's backward must not
    blame the grads stashed from other losses). ``stash`` is None or has one entry per tensor, None
    where nothing is stashed; ``stash[i]`` has ``out[i]``'s dtype; ``out`` may alias ``new`` or ``stash``.
    """
    new, out = _as_list(new, "new"), _as_list(out, "out")
    stash = [] if stash is None else _as_list(stash, "stash", none_allowed=True)
    inv_scale, found_inf = _factor(inv_scale, "inv_scale"), _flag(found_inf)
    if kernel_available(found_inf.device):
        args = (new, stash, out, inv_scale, found_inf)
        _run("combine_", reference.combine_, args, args)
    else:
        reference.combine_(new, stash, out, inv_scale, found_inf)
    _flag_non_finite_factors(found_inf, new, inv_scale)


def l2norm(inputs: Sequence[torch.Tensor], *, per_tensor: bool = False) -> L2Norm:
    """L2 norm of all tensors together (and of each, if ``per_tensor``), accumulated in float32 or better.

    The result is float32 (float64 if an input is float64) on the inputs' device. This is
    ``clip_grad_norm_``'s total norm in one pass, without the per-tensor norm tensors.
    """
    inputs, per_tensor = _as_list(inputs, "inputs"), _switch(per_tensor, "per_tensor")
    device = inputs[0].device if inputs else torch.device("cpu")
    if inputs and kernel_available(device):
        total, per = _run("l2norm", reference.l2norm, (inputs, per_tensor), (inputs, per_tensor))
    else:
        total, per = reference.l2norm(inputs, per_tensor)
    return L2Norm(total, per if per_tensor else None)


def unscale_l2norm(
    inputs: Sequence[torch.Tensor],
    inv_scale: float | torch.Tensor,
    found_inf: torch.Tensor,
    *,
    out: Sequence[torch.Tensor] | None = None,
    per_tensor: bool = False,
) -> L2Norm:
    """Norm of ``inputs * inv_scale`` and the inf/nan check in one read pass.

    With ``out`` (which may be ``inputs`` itself) the unscaled values are written too, so
    unscale + inf check + norm for clipping cost one pass over the grads instead of three.
    """
    inputs = _as_list(inputs, "inputs")
    outputs = [] if out is None else _as_list(out, "out")
    inv_scale, found_inf = _factor(inv_scale, "inv_scale"), _flag(found_inf)
    per_tensor = _switch(per_tensor, "per_tensor")
    if kernel_available(found_inf.device):
        args = (inputs, outputs, inv_scale, found_inf, per_tensor)
        total, per = _run("unscale_l2norm", reference.unscale_l2norm, args, args)
    else:
        total, per = reference.unscale_l2norm(inputs, outputs, inv_scale, found_inf, per_tensor)
    _flag_non_finite_factors(found_inf, inputs, inv_scale)
    return L2Norm(total, per if per_tensor else None)
