"""Fused LayerNorm and RMSNorm: autograd Functions, Apex-named functional forms and ``nn.Module``s.

The kernels (``torch.ops.ampkit_norms.*``, C++ on CPU, CUDA where built) read each row once, keep the
row statistics in float32 (float64 for float64 inputs) whatever the input dtype, and compute dx, dweight
and dbias in one backward pass. Where the kernels are unavailable (no compiler, ``AMPKIT_OPS=reference``,
a CUDA tensor without a CUDA build, tracing, ``torch.compile`` or a ``torch.func`` transform) the same maths
runs through :mod:`ampkit.ops.reference.norms`.

Behaviour follows ``apex.normalization``:

* modules default to ``eps=1e-5``, the functional forms to Apex's ``eps=1e-6``;
* ``memory_efficient=True`` saves the output instead of the input and recomputes the normalized
  values in backward as ``(y - bias) / weight`` (so a zero weight element gives non-finite gradients,
  as in Apex);
* ``Mixed*`` variants return the weight's dtype (bf16 input + fp32 weight -> fp32 output); the plain
  ones return the input's dtype;
* under autocast the inputs and parameters are cast to the autocast dtype and the kernel runs on
  them with float32 statistics (Apex's ``_cast_if_autocast_enabled``).

Where torch's own kernels are the faster ones, the plain variants run ``F.layer_norm``/``F.rms_norm``
(``AMPKIT_FUSED_BACKEND``, see :mod:`ampkit.ops._backend` and :func:`_torch_runs`); the mixed-dtype and
memory-efficient variants always run ampkit's kernels, which are what give them their meaning.

SyncBatchNorm's local statistics live here too: :func:`batch_norm_stats` (a CPU kernel; torch has
none) and :func:`batch_norm_backward_reduce` (torch's own CPU/CUDA kernels, which are already
single-pass).

Inputs: float16/bfloat16/float32/float64; the LayerNorm weight (and bias) has the input's dtype or, for
float16/bfloat16 inputs, float32 (``F.layer_norm``'s rule); an RMSNorm weight and the ``Mixed*`` parameters may have
any of those dtypes (``F.rms_norm`` takes them all). Non-contiguous inputs are accepted and made contiguous (one
copy), as Apex does.
"""

from __future__ import annotations

import math
import numbers
import operator
import warnings
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ampkit.ops._backend import resolve_backend
from ampkit.ops._build import CSRC_DIR, register_family
from ampkit.ops._dtypes import HALF_DTYPES, KERNEL_DTYPES, accumulate_dtype
from ampkit.ops._errors import ArgumentTypeError
from ampkit.ops._switches import checked_switch
from ampkit.ops._transforms import transforms_active
from ampkit.ops.reference import norms as reference
from ampkit.wording import beyond_float, integer_digits, shown

__all__ = [
    "FusedLayerNorm",
    "FusedLayerNormFunction",
    "FusedRMSNorm",
    "FusedRMSNormFunction",
    "MixedFusedLayerNorm",
    "MixedFusedRMSNorm",
    "batch_norm_backward_reduce",
    "batch_norm_stats",
    "fused_layer_norm",
    "fused_layer_norm_affine",
    "fused_rms_norm",
    "fused_rms_norm_affine",
    "mixed_dtype_fused_layer_norm_affine",
    "mixed_dtype_fused_rms_norm_affine",
]

_FAMILY = register_family(
    "ampkit_norms",
    sources=[CSRC_DIR / "norms" / "norms_cpu.cpp", CSRC_DIR / "norms" / "batch_norm_stats_cpu.cpp"],
    cuda_sources=[CSRC_DIR / "norms" / "norms_cuda.cu", CSRC_DIR / "norms" / "norms_cuda.cpp"],
)
_TORCH_CPU_LAYER_NORM = (torch.float32, torch.float16)  # the LayerNorm dtypes whose CPU kernel torch's is faster

ShapeLike = int | Sequence[int] | torch.Size


def _size(value: object) -> int | None:
    """``value`` as a size if it is an integer (a Python, numpy or 0-dim integer tensor one; not a bool), else None."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dim() != 0):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _as_shape(normalized_shape: ShapeLike) -> tuple[int, ...]:
    """``normalized_shape`` as a tuple of ints. Only integers are taken, as by torch's norms: ``int()`` would read
    the string "768" (a size left unparsed in a config) as (7, 6, 8) and truncate a float 2.5 to 2."""
    if type(normalized_shape) is torch.Size:  # a module's own, the usual case: its entries are ints
        return _checked_shape(tuple(normalized_shape))
    single = _size(normalized_shape)
    if single is not None:
        return _checked_shape((single,))
    bad = TypeError(f"normalized_shape must be an int or a sequence of ints, got {shown(normalized_shape)}")
    if isinstance(normalized_shape, str | bytes) or not isinstance(normalized_shape, Iterable):
        raise bad
    try:
        sizes = [_size(s) for s in normalized_shape]
    except TypeError:  # a 0-dim float tensor
        raise bad from None
    if any(size is None for size in sizes):
        raise bad
    return _checked_shape(tuple(sizes))


def _checked_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` if it names a dimension and no negative size; else a :class:`NormShapeError` (torch's RuntimeError)."""
    if not shape:
        raise NormShapeError("normalized_shape must name at least one dimension, got ()")
    if min(shape) < 0:
        raise NormShapeError(f"normalized_shape must hold sizes >= 0, got {list(shape)}")
    return shape


def _checked_memory_efficient(op: str, value: object) -> bool:
    """True or False (or 0 and 1) as a bool: torch's norms take ``bias`` (LayerNorm) or ``device`` (RMSNorm) fourth,
    where Apex's, and these, take ``memory_efficient``, so ``FusedRMSNorm(64, None, True, "cuda")`` built a
    memory-efficient norm on the CPU. Checked once when a module is built (its forward is the hot path, whose host
    time is the step's on a GPU); the functional forms check theirs each call."""
    hint = " (the fourth positional argument is Apex's memory_efficient; pass bias, device and dtype by keyword)"
    return checked_switch(op, "memory_efficient", value, hint)


def _check_eps(op: str, eps: float) -> None:
    """eps is added to a variance (a mean square) under a square root: a negative or NaN one gives NaN outputs. One
    that is not a number is also a TypeError, as torch's norms raise for it."""
    if type(eps) is float and 0.0 <= eps < math.inf:  # the usual case, on every call: no ABC check
        return
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise ArgumentTypeError(f"{op}: eps must be a finite number >= 0, got {shown(eps)} (a {type(eps).__name__})")
    if beyond_float(eps):  # passes 0 <= eps < inf, then float() in the op raised a bare OverflowError
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {integer_digits(eps)}")
    if not 0 <= eps < math.inf:
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {shown(eps)}")


class NormShapeError(ValueError, RuntimeError):
    """An input or parameter whose shape or device does not fit: a ValueError, and also the RuntimeError that
    ``F.layer_norm``/``F.rms_norm`` raise for it, so code written against torch's norms catches it."""


class NormDtypeError(TypeError, RuntimeError):
    """An input or parameter whose dtype does not fit: a TypeError, and also torch's norms' RuntimeError."""


def _check_inputs(
    op: str,
    input: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    any_param_dtype: bool = False,
) -> None:
    """Raise a clear error naming the bad argument; shared by the kernel and the reference path. ``any_param_dtype``:
    parameters of any floating dtype fit (RMSNorm and the mixed-dtype norms), else the input's or, for a half input,
    float32 (``F.layer_norm``'s rule)."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{op}: input must be a torch.Tensor, got {type(input).__name__}")
    if input.dtype not in KERNEL_DTYPES:
        raise NormDtypeError(f"{op}: input must be float16, bfloat16, float32 or float64, got {input.dtype}")
    _refuse_sparse(op, "input", input)
    k = len(normalized_shape)
    if input.dim() < k or tuple(input.shape[input.dim() - k :]) != normalized_shape:
        raise NormShapeError(
            f"{op}: normalized_shape {list(normalized_shape)} does not match the trailing dimensions "
            f"of input with shape {list(input.shape)}"
        )
    for name, param in (("weight", weight), ("bias", bias)):
        if param is None:
            continue
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor or None, got {type(param).__name__}")
        _refuse_sparse(op, name, param)
        if tuple(param.shape) != normalized_shape:
            raise NormShapeError(
                f"{op}: {name} has shape {list(param.shape)}, expected normalized_shape {list(normalized_shape)}"
            )
        if param.device != input.device:
            raise NormShapeError(f"{op}: {name} is on {param.device} but input is on {input.device}")
        allowed = (input.dtype, torch.float32) if input.dtype in HALF_DTYPES else (input.dtype,)
        if any_param_dtype:
            allowed = KERNEL_DTYPES
        if param.dtype not in allowed:
            raise NormDtypeError(
                f"{op}: {name} dtype {param.dtype} does not fit input dtype {input.dtype}; "
                f"use {' or '.join(str(d) for d in allowed)}"
            )
    if weight is not None and bias is not None and bias.dtype != weight.dtype:
        raise NormDtypeError(f"{op}: bias dtype {bias.dtype} differs from weight dtype {weight.dtype}")


def _refuse_sparse(op: str, name: str, tensor: torch.Tensor) -> None:
    """A sparse tensor has no rows to normalize in place: the kernels' error was torch's "unsupported memory format
    option", the reference's a dispatcher dump naming a backend."""
    if tensor.layout != torch.strided:
        raise NormDtypeError(f"{op}: {name} is a {tensor.layout} tensor; the norms take dense ones (use .to_dense())")


def _params_for_kernels(
    input: torch.Tensor, params: tuple[torch.Tensor | None, ...], output_dtype: torch.dtype | None
) -> tuple[tuple[torch.Tensor | None, ...], torch.dtype | None, torch.dtype | None]:
    """Parameters, output dtype and final cast for a dtype pair the kernels do not read as such (float32 input with
    bfloat16 weight, as ``F.rms_norm`` takes): the kernels read parameters in the input's dtype or the one it
    accumulates in, and write the input's dtype or float32 for a half input. Such parameters are cast to the
    accumulation dtype (in the autograd graph: their gradients come back in their own dtype), and an output dtype the
    kernels cannot write is reached by one cast of their widest output."""
    acc = accumulate_dtype(input.dtype)
    if any(p is not None and p.dtype not in (input.dtype, acc) for p in params):
        params = tuple(p if p is None else p.to(acc) for p in params)
    if output_dtype in (None, input.dtype) or (output_dtype == torch.float32 and input.dtype in HALF_DTYPES):
        return params, output_dtype, None
    return params, (torch.float32 if input.dtype in HALF_DTYPES else None), output_dtype


def _one_dtype(input: object, params: tuple[object, ...]) -> bool:
    """Whether ``input`` is a tensor of a dtype the norms take and each parameter None or a tensor of its dtype: what
    torch's own norms run as given. They check shapes and devices themselves, so where torch runs the norm (a GPU's
    usual case) this is all that is checked first; a call torch refuses is checked again to name the bad argument (a
    norm is called dozens of times a step, and on a GPU its host time is the step's). The dtype is checked here: torch's
    ``F.rms_norm`` takes a complex input and squares it where the RMS wants its modulus."""
    if not isinstance(input, torch.Tensor):
        return False
    dtype = input.dtype
    if dtype not in KERNEL_DTYPES:
        return False
    for p in params:  # a loop, not all() over a generator: this runs on every call
        if p is not None and (not isinstance(p, torch.Tensor) or p.dtype != dtype):
            return False
    return True


def _use_kernel(input: torch.Tensor) -> bool:
    """Whether ampkit's kernel runs: not while tracing or compiling, nor under a ``torch.func`` transform (``vmap``,
    ``grad``, ``jacrev``: the kernels have no batching rule) or forward-mode AD (``forward_ad.dual_level``: they have
    no jvp), where the reference's torch ops run instead."""
    return not transforms_active() and _FAMILY.serves(input.device, "layer_norm_fwd")


def _torch_runs(
    op: str, input: torch.Tensor, weight: torch.Tensor | None, memory_efficient: bool, layer_norm: bool
) -> bool:
    """Whether torch's own kernel runs this norm. Only a weight (and bias) in the input's dtype and no
    ``memory_efficient`` qualify (torch reads no fp16/bf16 input against fp32 weights and saves the input, not the
    output). Under ``auto``: on a GPU always (ampkit's CUDA norms measured 0.31-1.0x torch's on an H100); on the
    CPU fp32 LayerNorm (fwd+bwd 0.86x ``F.layer_norm`` at 8192x1024, 1.00x at 32768x4096) and fp16 LayerNorm
    (0.25-0.36x at 1024x64 and 8192x1024: torch's converts whole vectors of halves), while bf16 LayerNorm
    (0.98-1.42x at 1024-8192 rows x 64-1024), RMSNorm (fp16 1.8-6.7x, bf16 3.3-9.9x) and float64 (not
    measured) keep ampkit's kernels."""
    if memory_efficient or (weight is not None and weight.dtype != input.dtype):
        return False
    backend = resolve_backend(None, op)
    if backend != "auto":
        return backend == "torch"
    return input.device.type != "cpu" or (layer_norm and input.dtype in _TORCH_CPU_LAYER_NORM)


def _autocast_dtype(input: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast casts to on ``input``'s device, or None when autocast is off there (or the device has no
    autocast: ``meta``, on which models are built and their FLOPs counted without computing anything)."""
    device_type = input.device.type if isinstance(input, torch.Tensor) else "cpu"
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # "unknown device type for autocast"
        return None
    return torch.get_autocast_dtype(device_type) if enabled else None


def _in_float32_under_autocast(
    input: torch.Tensor, params: tuple[torch.Tensor | None, ...], memory_efficient: bool, mixed: bool
) -> bool:
    """Whether a norm under autocast computes in float32 and only its output takes the autocast dtype: for float32
    parameters (a model's own) and an input of a float dtype autocast handles, as torch's autocast runs its norms
    in float32. Apex's casts of the input, weight and bias to the autocast dtype gave the same output dtype for
    three extra casts a call (each with its backward), which on a GPU cost more than the norm's own kernel, and
    normalised an input already rounded. ``memory_efficient`` (it saves the output: half the memory in half) and
    the mixed-dtype norms (output in the weight's dtype) keep Apex's casts."""
    if memory_efficient or mixed or input.dtype not in (torch.float32, *HALF_DTYPES):
        return False
    return all(p is None or p.dtype == torch.float32 for p in params)


def _cast_to(dtype: torch.dtype, *args: object) -> tuple:
    """Apex's ``_cast_if_autocast_enabled``: cast floating tensors to the active autocast dtype."""
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def _grads_to_differentiate(
    ctx, grad_output: torch.Tensor, inputs: tuple[torch.Tensor | None, ...], forward: Callable[..., torch.Tensor]
) -> tuple[torch.Tensor | None, ...]:
    """The input gradients of a norm as a graph of their own (``backward(create_graph=True)``, as a gradient
    penalty asks): the reference forward is run again on the saved inputs and differentiated with
    ``create_graph``, so the kernels' first-order gradients are replaced by ones autograd can differentiate."""
    with torch.enable_grad():
        out = forward(*inputs)  # the saved inputs keep their own graphs: the second backward reaches them
        needed = [t is not None and need for t, need in zip(inputs, ctx.needs_input_grad, strict=False)]
        wanted = [t for t, need in zip(inputs, needed, strict=True) if need]
        grads = iter(torch.autograd.grad(out, wanted, grad_output, create_graph=True, allow_unused=True))
    return tuple(next(grads) if need else None for need in needed)


def _refuse_second_order(norm: str, grad_output: torch.Tensor, saved: tuple[torch.Tensor | None, ...]) -> None:
    """A memory-efficient norm saves its output, not its input, so its gradients cannot be differentiated: under
    ``create_graph=True`` they would carry no graph to the input (``once_differentiable`` only fails a second
    backward that passes through the gradient's own node, so ``torch.autograd.grad(..., inputs=x)`` and
    gradgradcheck saw zeros for its terms). Refused here, by name, whenever that graph would be asked for."""
    if not torch.is_grad_enabled():
        return
    if grad_output.requires_grad or any(t is not None and t.requires_grad for t in saved):
        raise RuntimeError(
            f"{norm} with memory_efficient=True keeps the output instead of the input, so its backward cannot be "
            "differentiated again (backward(create_graph=True), a gradient penalty, gradgradcheck); build it with "
            "memory_efficient=False"
        )


class FusedLayerNormFunction(torch.autograd.Function):
    """LayerNorm through the C++/CUDA kernels; weight/bias may be None, output dtype defaults to input's."""

    @staticmethod
    def forward(
        ctx,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        normalized_shape: tuple[int, ...],
        eps: float,
        memory_efficient: bool = False,
        output_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        out, mean, rstd = torch.ops.ampkit_norms.layer_norm_fwd(
            input.contiguous(), list(normalized_shape), weight, bias, eps, output_dtype
        )
        ctx.normalized_shape = list(normalized_shape)
        ctx.memory_efficient = memory_efficient
        ctx.input_dtype = input.dtype
        ctx.eps, ctx.output_dtype = eps, output_dtype
        if memory_efficient:
            ctx.save_for_backward(out, weight, bias, None, rstd)
        else:  # the caller's tensor (not a contiguous copy), so a double backward can reach what it came from
            ctx.save_for_backward(input, weight, bias, mean, rstd)
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        # Unpacked once: torch.utils.checkpoint(use_reentrant=False) refuses a second unpack of a saved tensor.
        saved_tensors = ctx.saved_tensors
        saved, weight, bias, _, _ = saved_tensors
        if ctx.memory_efficient:
            _refuse_second_order("a fused layer norm", grad_output, (saved, weight, bias))
        elif torch.is_grad_enabled():  # create_graph=True: a gradient penalty
            grads = _grads_to_differentiate(
                ctx, grad_output, (saved, weight, bias),
                lambda x, w, b: reference.layer_norm(x, ctx.normalized_shape, w, b, ctx.eps, ctx.output_dtype),
            )  # fmt: skip
            return (*grads, None, None, None, None)
        return _layer_norm_kernel_backward(ctx, grad_output, saved_tensors)


@once_differentiable  # memory_efficient saves the output, not the input: the reference cannot run again
def _layer_norm_kernel_backward(ctx, grad_output: torch.Tensor, saved_tensors: tuple) -> tuple:
    saved, weight, bias, mean, rstd = saved_tensors
    if mean is None:
        mean = rstd.new_empty(0)
    grad_input, grad_weight, grad_bias = torch.ops.ampkit_norms.layer_norm_bwd(
        grad_output.contiguous(),
        saved.contiguous(),
        mean,
        rstd,
        ctx.normalized_shape,
        weight,
        bias,
        ctx.memory_efficient,
        ctx.input_dtype,
    )
    return grad_input, grad_weight, grad_bias, None, None, None, None


class FusedRMSNormFunction(torch.autograd.Function):
    """RMSNorm through the C++/CUDA kernels (``weight`` may be None; output dtype defaults to input's)."""

    @staticmethod
    def forward(
        ctx,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        normalized_shape: tuple[int, ...],
        eps: float,
        memory_efficient: bool = False,
        output_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        out, rstd = torch.ops.ampkit_norms.rms_norm_fwd(
            input.contiguous(), list(normalized_shape), weight, eps, output_dtype
        )
        ctx.normalized_shape = list(normalized_shape)
        ctx.memory_efficient = memory_efficient
        ctx.input_dtype = input.dtype
        ctx.eps, ctx.output_dtype = eps, output_dtype
        ctx.save_for_backward(out if memory_efficient else input, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        saved_tensors = ctx.saved_tensors  # unpacked once, as in FusedLayerNormFunction.backward
        saved, weight, _ = saved_tensors
        if ctx.memory_efficient:
            _refuse_second_order("a fused RMS norm", grad_output, (saved, weight))
        elif torch.is_grad_enabled():  # create_graph=True: a gradient penalty
            grads = _grads_to_differentiate(
                ctx, grad_output, (saved, weight),
                lambda x, w: reference.rms_norm(x, ctx.normalized_shape, w, ctx.eps, ctx.output_dtype),
            )  # fmt: skip
            return (*grads, None, None, None, None)
        return _rms_norm_kernel_backward(ctx, grad_output, saved_tensors)


@once_differentiable
def _rms_norm_kernel_backward(ctx, grad_output: torch.Tensor, saved_tensors: tuple) -> tuple:
    saved, weight, rstd = saved_tensors
    grad_input, grad_weight = torch.ops.ampkit_norms.rms_norm_bwd(
        grad_output.contiguous(),
        saved.contiguous(),
        rstd,
        ctx.normalized_shape,
        weight,
        ctx.memory_efficient,
        ctx.input_dtype,
    )
    return grad_input, grad_weight, None, None, None, None


def _layer_norm(
    op: str,
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    normalized_shape: ShapeLike,
    eps: float,
    memory_efficient: bool,
    mixed: bool,
) -> torch.Tensor:
    shape = _as_shape(normalized_shape)
    autocast_dtype = _autocast_dtype(input)
    if autocast_dtype is not None:
        if _in_float32_under_autocast(input, (weight, bias), memory_efficient, mixed):  # autocast may stay on
            return _layer_norm_as_given(op, input.float(), weight, bias, shape, eps, False, False).to(autocast_dtype)
        with torch.autocast(input.device.type, enabled=False):
            input, weight, bias = _cast_to(autocast_dtype, input, weight, bias)  # Apex's casts
            return _layer_norm_as_given(op, input, weight, bias, shape, eps, memory_efficient, mixed)
    return _layer_norm_as_given(op, input, weight, bias, shape, eps, memory_efficient, mixed)


def _layer_norm_as_given(
    op: str,
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    shape: tuple[int, ...],
    eps: float,
    memory_efficient: bool,
    mixed: bool,
) -> torch.Tensor:
    if not mixed and _one_dtype(input, (weight, bias)) and _torch_runs(op, input, weight, memory_efficient, True):
        _check_eps(op, eps)
        try:
            return F.layer_norm(input, shape, weight, bias, eps)
        except RuntimeError:
            _check_inputs(op, input, shape, weight, bias)  # the bad argument by name, where this check has it
            raise
    _check_inputs(op, input, shape, weight, bias, any_param_dtype=mixed)
    _check_eps(op, eps)
    output_dtype = weight.dtype if mixed and weight is not None else None
    (weight, bias), output_dtype, cast_to = _params_for_kernels(input, (weight, bias), output_dtype)
    if _torch_runs(op, input, weight, memory_efficient, layer_norm=True):
        output = F.layer_norm(input, shape, weight, bias, eps)
    elif _use_kernel(input):
        output = FusedLayerNormFunction.apply(input, weight, bias, shape, eps, memory_efficient, output_dtype)
    else:
        output = reference.layer_norm(input, shape, weight, bias, eps, output_dtype)
    return output if cast_to is None else output.to(cast_to)


def _rms_norm(
    op: str,
    input: torch.Tensor,
    weight: torch.Tensor | None,
    normalized_shape: ShapeLike,
    eps: float | None,
    memory_efficient: bool,
    mixed: bool,
) -> torch.Tensor:
    shape = _as_shape(normalized_shape)
    autocast_dtype = _autocast_dtype(input)
    if autocast_dtype is not None:
        if _in_float32_under_autocast(input, (weight,), memory_efficient, mixed):  # autocast may stay on
            return _rms_norm_as_given(op, input.float(), weight, shape, eps, False, False).to(autocast_dtype)
        with torch.autocast(input.device.type, enabled=False):
            input, weight = _cast_to(autocast_dtype, input, weight)  # Apex's casts
            return _rms_norm_as_given(op, input, weight, shape, eps, memory_efficient, mixed)
    return _rms_norm_as_given(op, input, weight, shape, eps, memory_efficient, mixed)


def _rms_eps(eps: float | None, dtype: torch.dtype) -> float | None:
    """``eps``, or for None torch's RMSNorm default: the machine epsilon of the dtype it computes in."""
    return torch.finfo(accumulate_dtype(dtype)).eps if eps is None else eps


def _rms_norm_as_given(
    op: str,
    input: torch.Tensor,
    weight: torch.Tensor | None,
    shape: tuple[int, ...],
    eps: float | None,
    memory_efficient: bool,
    mixed: bool,
) -> torch.Tensor:
    if not mixed and _one_dtype(input, (weight,)) and _torch_runs(op, input, weight, memory_efficient, False):
        eps = _rms_eps(eps, input.dtype)
        _check_eps(op, eps)
        try:
            return F.rms_norm(input, shape, weight, eps)
        except RuntimeError:
            _check_inputs(op, input, shape, weight, None, any_param_dtype=True)
            raise
    _check_inputs(op, input, shape, weight, None, any_param_dtype=True)  # F.rms_norm takes any weight dtype
    eps = _rms_eps(eps, input.dtype)
    _check_eps(op, eps)
    output_dtype = weight.dtype if mixed and weight is not None else None
    (weight,), output_dtype, cast_to = _params_for_kernels(input, (weight,), output_dtype)
    if _torch_runs(op, input, weight, memory_efficient, layer_norm=False):
        output = F.rms_norm(input, shape, weight, eps)
    elif _use_kernel(input):
        output = FusedRMSNormFunction.apply(input, weight, shape, eps, memory_efficient, output_dtype)
    else:
        output = reference.rms_norm(input, shape, weight, eps, output_dtype)
    return output if cast_to is None else output.to(cast_to)


# ``torch.fx.symbolic_trace`` records each norm as one call (``nn.LayerNorm`` is a leaf module to it; these modules are
# traced through, and their checks cannot read a Proxy's dtype or shape); the traced graph calls the norm as is.
torch.fx.wrap("_layer_norm")
torch.fx.wrap("_rms_norm")


def fused_layer_norm_affine(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    normalized_shape: ShapeLike,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> torch.Tensor:
    """LayerNorm with a weight and bias; output in the input's dtype (Apex signature)."""
    memory_efficient = checked_switch("fused_layer_norm_affine", "memory_efficient", memory_efficient)
    return _layer_norm("fused_layer_norm_affine", input, weight, bias, normalized_shape, eps, memory_efficient, False)


def fused_layer_norm(
    input: torch.Tensor, normalized_shape: ShapeLike, eps: float = 1e-6, memory_efficient: bool = False
) -> torch.Tensor:
    """LayerNorm without affine parameters (Apex signature)."""
    memory_efficient = checked_switch("fused_layer_norm", "memory_efficient", memory_efficient)
    return _layer_norm("fused_layer_norm", input, None, None, normalized_shape, eps, memory_efficient, False)


def mixed_dtype_fused_layer_norm_affine(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    normalized_shape: ShapeLike,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> torch.Tensor:
    """LayerNorm with a weight and bias; output in the weight's dtype (Apex signature)."""
    memory_efficient = checked_switch("mixed_dtype_fused_layer_norm_affine", "memory_efficient", memory_efficient)
    return _layer_norm(
        "mixed_dtype_fused_layer_norm_affine",
        input,
        weight,
        bias,
        normalized_shape,
        eps,
        memory_efficient,
        True,
    )


def fused_rms_norm_affine(
    input: torch.Tensor,
    weight: torch.Tensor,
    normalized_shape: ShapeLike,
    eps: float | None = 1e-6,
    memory_efficient: bool = False,
) -> torch.Tensor:
    """RMSNorm with a weight; output in the input's dtype (Apex signature)."""
    memory_efficient = checked_switch("fused_rms_norm_affine", "memory_efficient", memory_efficient)
    return _rms_norm("fused_rms_norm_affine", input, weight, normalized_shape, eps, memory_efficient, False)


def fused_rms_norm(
    input: torch.Tensor, normalized_shape: ShapeLike, eps: float | None = 1e-6, memory_efficient: bool = False
) -> torch.Tensor:
    """RMSNorm without a weight (Apex signature)."""
    memory_efficient = checked_switch("fused_rms_norm", "memory_efficient", memory_efficient)
    return _rms_norm("fused_rms_norm", input, None, normalized_shape, eps, memory_efficient, False)


def mixed_dtype_fused_rms_norm_affine(
    input: torch.Tensor,
    weight: torch.Tensor,
    normalized_shape: ShapeLike,
    eps: float | None = 1e-6,
    memory_efficient: bool = False,
) -> torch.Tensor:
    """RMSNorm with a weight; output in the weight's dtype (Apex signature)."""
    memory_efficient = checked_switch("mixed_dtype_fused_rms_norm_affine", "memory_efficient", memory_efficient)
    return _rms_norm("mixed_dtype_fused_rms_norm_affine", input, weight, normalized_shape, eps, memory_efficient, True)


class FusedLayerNorm(nn.Module):
    """``apex.normalization.FusedLayerNorm``: LayerNorm over the trailing ``normalized_shape`` dims.

    Args:
        normalized_shape: trailing shape to normalize over (an int means the last dimension).
        eps: added to the variance. Default: 1e-5.
        elementwise_affine: learn a per-element weight (init 1) and bias (init 0).
        memory_efficient: save the output instead of the input for backward.
        bias: with ``elementwise_affine``, learn the bias too (``nn.LayerNorm``'s ``bias=False``: a weight only).

    Example:
        >>> norm = FusedLayerNorm(16)
        >>> norm(torch.randn(4, 16)).shape
        torch.Size([4, 16])
    """

    __constants__ = ("_mixed",)
    _mixed = False
    memory_efficient = False  # Apex's before mid-2023 had no such field: a model pickled with one loads and runs

    def __init__(
        self,
        normalized_shape: ShapeLike,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        memory_efficient: bool = False,
        *,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = torch.Size(_as_shape(normalized_shape))
        _check_eps(type(self).__name__, eps)
        self.eps = eps
        name = type(self).__name__
        self.memory_efficient = _checked_memory_efficient(name, memory_efficient)
        # torch's norms read these by truthiness: "False" from a config built an affine norm
        self.elementwise_affine = elementwise_affine = checked_switch(name, "elementwise_affine", elementwise_affine)
        bias = checked_switch(name, "bias", bias)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        if elementwise_affine and bias:
            self.bias = nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weight to ones and bias to zeros, as ``nn.LayerNorm``."""
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # TorchScript compiles this branch alone: torch's norm, as Apex's modules ran
            if not self._mixed:  # a constant to TorchScript: only one of the two forms is compiled
                return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)
            acc = torch.promote_types(input.dtype, torch.float32)  # the kernels' maths: float32, read any weight
            bias = self.bias.to(acc) if self.bias is not None else None
            output = F.layer_norm(input.to(acc), self.normalized_shape, self.weight.to(acc), bias, self.eps)
            return output.to(self.weight.dtype)
        name = type(self).__name__
        return _layer_norm(
            name,
            input,
            self.weight,
            self.bias,
            self.normalized_shape,
            self.eps,
            self.memory_efficient,
            self._mixed,
        )

    def extra_repr(self) -> str:
        return (
            f"{tuple(self.normalized_shape)}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
            f"bias={self.bias is not None}, memory_efficient={self.memory_efficient}"
        )


class FusedRMSNorm(nn.Module):
    """``apex.normalization.FusedRMSNorm``: ``x / sqrt(mean(x**2) + eps) * weight`` over ``normalized_shape``.

    Args:
        normalized_shape: trailing shape to normalize over (an int means the last dimension).
        eps: added to the mean square. Default: 1e-5 (Apex's); None is ``nn.RMSNorm``'s default, the machine
            epsilon of the dtype the norm computes in (float32 for fp16/bf16/fp32 inputs, float64 for float64).
        elementwise_affine: learn a per-element weight (init 1).
        memory_efficient: save the output instead of the input for backward.
    """

    __constants__ = ("_mixed",)
    _mixed = False
    memory_efficient = False  # as FusedLayerNorm: Apex's before mid-2023 had no such field

    def __init__(
        self,
        normalized_shape: ShapeLike,
        eps: float | None = 1e-5,
        elementwise_affine: bool = True,
        memory_efficient: bool = False,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = torch.Size(_as_shape(normalized_shape))
        if eps is not None:
            _check_eps(type(self).__name__, eps)
        self.eps = eps
        name = type(self).__name__
        self.memory_efficient = _checked_memory_efficient(name, memory_efficient)
        self.elementwise_affine = elementwise_affine = checked_switch(name, "elementwise_affine", elementwise_affine)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weight to ones, as ``nn.RMSNorm``."""
        if self.elementwise_affine:
            nn.init.ones_(self.weight)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # TorchScript compiles this branch alone: torch's norm, as Apex's modules ran
            if not self._mixed:  # a constant to TorchScript: only one of the two forms is compiled
                return F.rms_norm(input, self.normalized_shape, self.weight, self.eps)
            acc = torch.promote_types(input.dtype, torch.float32)  # the kernels' maths: float32, read any weight
            output = F.rms_norm(input.to(acc), self.normalized_shape, self.weight.to(acc), self.eps)
            return output.to(self.weight.dtype)
        name = type(self).__name__
        return _rms_norm(name, input, self.weight, self.normalized_shape, self.eps, self.memory_efficient, self._mixed)

    def extra_repr(self) -> str:
        return (
            f"{tuple(self.normalized_shape)}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
            f"memory_efficient={self.memory_efficient}"
        )


def _mixed_affine_only(cls_name: str, kwargs: dict) -> dict:
    """Apex's Mixed modules are always affine: warn on ``elementwise_affine``, refuse False."""
    if "elementwise_affine" in kwargs:
        warnings.warn(f"{cls_name} does not support `elementwise_affine` argument", stacklevel=3)
        if not checked_switch(cls_name, "elementwise_affine", kwargs.pop("elementwise_affine")):
            raise RuntimeError(f"{cls_name} does not support `elementwise_affine = False`")
    return kwargs


class MixedFusedLayerNorm(FusedLayerNorm):
    """``apex.normalization.MixedFusedLayerNorm``: always affine; output in the weight's dtype."""

    _mixed = True

    def __init__(self, normalized_shape: ShapeLike, eps: float = 1e-5, *, memory_efficient: bool = False, **kwargs):
        kwargs = _mixed_affine_only(type(self).__name__, kwargs)
        super().__init__(normalized_shape, eps, elementwise_affine=True, memory_efficient=memory_efficient, **kwargs)


class MixedFusedRMSNorm(FusedRMSNorm):
    """``apex.normalization.MixedFusedRMSNorm``: always affine; output in the weight's dtype."""

    _mixed = True

    def __init__(
        self, normalized_shape: ShapeLike, eps: float | None = 1e-5, *, memory_efficient: bool = False, **kwargs
    ):
        kwargs = _mixed_affine_only(type(self).__name__, kwargs)
        super().__init__(normalized_shape, eps, elementwise_affine=True, memory_efficient=memory_efficient, **kwargs)


def _check_batch_norm_input(op: str, input: torch.Tensor) -> None:
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{op}: input must be a torch.Tensor, got {type(input).__name__}")
    if input.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{op}: input must be float16, bfloat16, float32 or float64, got {input.dtype}")
    if input.dim() < 2 or input.numel() == 0:
        raise ValueError(f"{op}: input must be (N, C, ...) with at least one element, got shape {list(input.shape)}")


def _channels_last_or_contiguous(input: torch.Tensor) -> torch.Tensor:
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    if input.is_contiguous() or (input.dim() in formats and input.is_contiguous(memory_format=formats[input.dim()])):
        return input
    return input.contiguous()


def batch_norm_stats(input: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and ``1 / sqrt(var + eps)`` (biased var) of an (N, C, ...) input: SyncBatchNorm's
    local statistics, as ``torch.batch_norm_stats`` (which has no CPU kernel). Statistics are float32
    (float64 for float64 input). Contiguous and channels-last inputs are read in place; others are copied.
    """
    _check_batch_norm_input("batch_norm_stats", input)
    if input.device.type == "cuda":
        return torch.batch_norm_stats(input, eps)
    input = _channels_last_or_contiguous(input)
    if input.device.type == "cpu" and _FAMILY.use_kernel():
        planes = input.is_contiguous() and input.dim() > 2 and input[0, 0].numel() > 1
        if not planes and input.dtype in (torch.float32, torch.float64):
            # Channels-last and (N, C) inputs: torch's CPU kernel is vectorised there and measured as
            # fast as ours (0.75-1.0x); for NCHW it runs scalar double loops (ours: 5-7x faster). It
            # returns half-precision statistics for half inputs, so those stay on our kernel.
            mean, var = torch.batch_norm_update_stats(input, None, None, 0.0)
            return mean, torch.rsqrt(var + eps)
        return torch.ops.ampkit_norms.batch_norm_stats(input, eps)
    return reference.batch_norm_stats(input, eps)


def batch_norm_backward_reduce(
    grad_output: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ``sum(dy)`` and ``sum(dy * (x - mean))`` for SyncBatchNorm's backward, by torch's kernels.

    On CPU this is ``native_batch_norm_backward`` with only the weight/bias gradients requested (one
    vectorised pass; ``sum_dy_xmu = grad_weight / invstd``), on CUDA ``torch.batch_norm_backward_reduce``.
    """
    _check_batch_norm_input("batch_norm_backward_reduce", input)
    if grad_output.shape != input.shape or grad_output.dtype != input.dtype:
        raise ValueError(
            f"batch_norm_backward_reduce: grad_output {list(grad_output.shape)} {grad_output.dtype} "
            f"must match input {list(input.shape)} {input.dtype}"
        )
    if input.device.type == "cuda":
        sum_dy, sum_dy_xmu, _, _ = torch.batch_norm_backward_reduce(
            grad_output, input, mean, invstd, None, True, False, False
        )
        return sum_dy, sum_dy_xmu
    _, grad_weight, grad_bias = torch.ops.aten.native_batch_norm_backward(
        grad_output, input, None, None, None, mean, invstd, True, 0.0, [False, True, True]
    )
    return grad_bias, grad_weight / invstd
