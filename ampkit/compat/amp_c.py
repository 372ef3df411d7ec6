"""Apex's ``amp_C`` extension on ampkit's kernels (CPU and CUDA): ``import amp_C`` under the apex shim.

Every op takes Apex's arguments in Apex's order, ``op(chunk_size, noop_flag, tensor_lists, *args)``, as
``multi_tensor_applier(op, noop_flag, tensor_lists, *args)`` passes them. ``chunk_size`` only tuned Apex's
CUDA launch and does not change results here. ``noop_flag`` is a one-element int32 (or float32) tensor on the
tensors' device with Apex's meaning per op: ``multi_tensor_scale``/``axpby``/``l2norm``/``unscale_l2norm``
set it to 1 when they meet inf/nan (and never clear it); ``multi_tensor_sgd`` does nothing while it is set;
``multi_tensor_adam``/``multi_tensor_adagrad``/``multi_tensor_novograd`` and the LAMB stages ignore it, as
Apex's non-capturable kernels do (``multi_tensor_lamb`` raises it on an inf/nan norm and goes on);
``multi_tensor_adam_capturable(_master)`` and ``multi_tensor_lamb_mp`` change nothing while it is set.
The LAMB ops live in :mod:`ampkit.compat._amp_c_lamb`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ampkit.compat._amp_c_lamb import (
    check_lists,
    check_step,
    flag_if_not_finite,
    multi_tensor_lamb,
    multi_tensor_lamb_mp,
    multi_tensor_lamb_stage1_cuda,
    multi_tensor_lamb_stage2_cuda,
    switch_args,
)
from ampkit.compat._pybind_numbers import pybind_numbers
from ampkit.missing_name import missing_name
from ampkit.ops import multi_tensor
from ampkit.ops.host_values import host_numbers
from ampkit.ops.optimizers._base import ScalerTensors, _skip_flag, decay_weights_
from ampkit.ops.optimizers._kernels import op
from ampkit.ops.optimizers.sgd import sgd_step
from ampkit.wording import shown

__all__ = [
    "multi_tensor_adagrad",
    "multi_tensor_adam",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
    "multi_tensor_axpby",
    "multi_tensor_l2norm",
    "multi_tensor_l2norm_mp",
    "multi_tensor_l2norm_scale",
    "multi_tensor_lamb",
    "multi_tensor_lamb_mp",
    "multi_tensor_lamb_stage1_cuda",
    "multi_tensor_lamb_stage2_cuda",
    "multi_tensor_novograd",
    "multi_tensor_scale",
    "multi_tensor_sgd",
    "multi_tensor_unscale_l2norm",
    "update_scale_hysteresis",
]

TensorLists = Sequence[Sequence[Tensor]]


def _skip_flag_on(noop_flag: Tensor, device: torch.device) -> Tensor:
    """``noop_flag`` as the float32 ``found_inf`` the optimizer kernels skip on (1.0 where it is not 0), on
    ``device``, with no host read: the kernels read it where they run."""
    return _skip_flag(noop_flag.to(device, non_blocking=True))


def _norm_outputs(result: multi_tensor.L2Norm) -> tuple[Tensor, Tensor]:
    """Apex's return shapes: the total as a one-element tensor, per-tensor norms or an empty tensor."""
    total = result.total.reshape(1).float()
    per = result.per_tensor if result.per_tensor is not None else total.new_empty(0)
    return total, per.float()


def _steps_before(step: int | Tensor, count: int, device: torch.device) -> list[Tensor]:
    """Per-tensor step counters holding ``step - 1`` on ``device``: ampkit's kernels count the step they take."""
    return [torch.full((), float(step) - 1.0, dtype=torch.float32, device=device) for _ in range(count)]


# Integer and bool tensors: a state dict's counters and masks (BatchNorm's num_batches_tracked; a causal mask kept as
# a persistent bool buffer, as older transformers' GPT-2 attention did).
_INTEGER_DTYPES = frozenset(
    (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
    + (torch.uint16, torch.uint32, torch.uint64)
)


def _is_integer(t: Tensor) -> bool:
    """Whether ``t`` holds integers (bool among them), which the float kernels do not take."""
    return t.dtype in _INTEGER_DTYPES


def _take_integer_entries(lists: list[list[Tensor]]) -> list[tuple[Tensor, ...]]:
    """Remove from ``lists`` the entries where any list holds an integer tensor and return them as tuples."""
    entries = list(zip(*lists, strict=True))
    integer = [any(_is_integer(t) for t in entry) for entry in entries]
    for k, tensors in enumerate(lists):
        tensors[:] = [entry[k] for entry, is_int in zip(entries, integer, strict=True) if not is_int]
    return [entry for entry, is_int in zip(entries, integer, strict=True) if is_int]


def _with_integer_entries_apart(
    lists: list[list[Tensor]], float_kernel: Callable[[], None], integer_op: Callable[..., None]
) -> None:
    """``float_kernel()`` over ``lists``; if it refuses them because entries hold integer tensors, ``float_kernel()``
    on the rest, then ``integer_op`` on each of those entries (so a call refused for another reason writes none).

    A model's whole state dict is a common list here (an EMA, a copy), with BatchNorm's int64
    ``num_batches_tracked`` among the floats: Apex's kernels took it and read its bytes as floats. The kernels
    check every argument before they write, so a refused call changed nothing, and a call without integers pays
    nothing (reading each tensor's dtype first cost 0.2 us a tensor)."""
    try:
        float_kernel()
    except RuntimeError:
        integer = _take_integer_entries(lists)
        if not integer:
            raise
        float_kernel()
        for entry in integer:
            integer_op(*entry)


def _write_rounded(out: Tensor, value: Tensor) -> None:
    """``out = value``, rounded to the nearest integer when ``out`` is an integer tensor (not truncated:
    ``0.7 * 3 + 0.3 * 3`` is 2.9999999999999996 in float64); a bool one is then True where that is not 0."""
    out.copy_(value.round() if _is_integer(out) else value)


@pybind_numbers("amp_C")
def multi_tensor_scale(chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, scale: float) -> None:
    """``out[i] = in[i] * scale`` for ``tensor_lists = [in, out]``; flags inf/nan inputs. Integer and bool tensors
    (a state dict's step counters and masks) are computed in float64 and rounded to the nearest integer when
    written."""
    inputs, outputs = check_lists("multi_tensor_scale", tensor_lists, (2,))

    def integer_op(xi: Tensor, oi: Tensor) -> None:
        wide = xi.double()
        flag_if_not_finite(wide, noop_flag)
        _write_rounded(oi, wide * float(scale))

    _with_integer_entries_apart(
        [inputs, outputs], lambda: multi_tensor.scale_(inputs, scale, noop_flag, out=outputs), integer_op
    )


@pybind_numbers("amp_C")
def multi_tensor_axpby(
    chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, a: float, b: float, arg_to_check: int
) -> None:
    """``out = a * x + b * y`` for ``[x, y, out]``; flags inf/nan in x and y (-1), x only (0) or y only (1).
    Integer tensors are computed in float64 and rounded, as in :func:`multi_tensor_scale`."""
    x, y, out = check_lists("multi_tensor_axpby", tensor_lists, (3,))
    if arg_to_check not in (-1, 0, 1):
        raise RuntimeError(f"multi_tensor_axpby: arg_to_check={shown(arg_to_check)}; expected -1, 0 or 1")

    def float_kernel() -> None:
        # Apex pairs any x/y dtypes; ampkit's kernel wants x[i] and y[i] alike. The math is float32 either way,
        # so a float pair that differs is read through float32 copies (exact), at the cost of one extra pass.
        xs, ys = list(x), list(y)
        for i, (xi, yi) in enumerate(zip(xs, ys, strict=True)):
            if xi.dtype != yi.dtype and xi.is_floating_point() and yi.is_floating_point():
                xs[i], ys[i] = xi.float(), yi.float()
        multi_tensor.axpby_(a, xs, b, ys, out, noop_flag, arg_to_check=arg_to_check)

    def integer_op(xi: Tensor, yi: Tensor, oi: Tensor) -> None:
        wide_x, wide_y = xi.double(), yi.double()
        for checked in {-1: (wide_x, wide_y), 0: (wide_x,), 1: (wide_y,)}[arg_to_check]:
            flag_if_not_finite(checked, noop_flag)
        _write_rounded(oi, float(a) * wide_x + float(b) * wide_y)

    _with_integer_entries_apart([x, y, out], float_kernel, integer_op)


@pybind_numbers("amp_C")
def multi_tensor_l2norm(
    chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, per_tensor: bool | None = None
) -> tuple[Tensor, Tensor]:
    """``(norm, per_tensor_norms)`` of ``tensor_lists[0]`` in float32; per-tensor norms are empty unless asked."""
    (inputs,) = check_lists("multi_tensor_l2norm", tensor_lists, (1,))
    result = multi_tensor.l2norm(inputs, per_tensor=per_tensor is not None and per_tensor)
    total, per = _norm_outputs(result)
    flag_if_not_finite(total, noop_flag)
    return total, per


@pybind_numbers("amp_C")
def multi_tensor_l2norm_mp(
    chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, per_tensor: bool | None = None
) -> tuple[Tensor, Tensor]:
    """Apex's mixed-precision l2norm: the same float32-accumulated norms as ``multi_tensor_l2norm``."""
    return multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor)


@pybind_numbers("amp_C")
def multi_tensor_l2norm_scale(
    chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, scale: float, per_tensor: bool | None = None
) -> tuple[Tensor, Tensor]:
    """Norms of ``in`` (before scaling) while writing ``out = in * scale`` for ``[in, out]``; flags inf/nan."""
    inputs, outputs = check_lists("multi_tensor_l2norm_scale", tensor_lists, (2,))
    total, per = _norm_outputs(multi_tensor.l2norm(inputs, per_tensor=per_tensor is not None and per_tensor))
    multi_tensor.scale_(inputs, scale, noop_flag, out=outputs)
    flag_if_not_finite(total, noop_flag)
    return total, per


@pybind_numbers("amp_C")
def multi_tensor_unscale_l2norm(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    inv_scale: Tensor | float,
    per_tensor: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Norms of ``tensor_lists[0] * inv_scale`` (the tensors are not written), as ``multi_tensor_l2norm``."""
    (inputs,) = check_lists("multi_tensor_unscale_l2norm", tensor_lists, (1,))
    result = multi_tensor.unscale_l2norm(inputs, inv_scale, noop_flag, per_tensor=per_tensor is not None and per_tensor)
    total, per = _norm_outputs(result)
    flag_if_not_finite(total, noop_flag)
    return total, per


@pybind_numbers("amp_C")
def multi_tensor_adam(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: int,
    mode: int,
    bias_correction: int,
    weight_decay: float,
) -> None:
    """Adam on ``[grads, params, exp_avgs, exp_avg_sqs]``; ``mode`` 0 adds L2 to the grad, 1 decays (AdamW).

    ``step`` is the step being taken (1 on the first). Moments of fp16/bf16 params are float32, as in Apex.
    """
    grads, params, exp_avgs, exp_avg_sqs = check_lists("multi_tensor_adam", tensor_lists, (4,))
    (bias_correction,) = switch_args("multi_tensor_adam", bias_correction=bias_correction)
    check_step("multi_tensor_adam", step, bias_correction)
    if mode not in (0, 1):
        raise RuntimeError(f"multi_tensor_adam: mode={shown(mode)}; expected 0 (L2) or 1 (decoupled, AdamW)")
    if not params:
        return
    op("adam_step", params[0].device)(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        [],
        _steps_before(step, len(params), params[0].device),
        float(lr),
        beta1,
        beta2,
        epsilon,
        weight_decay,
        mode == 1,
        False,
        bias_correction,
        1.0,
    )


def _adam_capturable(
    op_name: str,
    noop_flag: Tensor,
    lists: list[list[Tensor]],
    lr: Tensor,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: Tensor,
    mode: int,
    bias_correction: int,
    weight_decay: float,
    inv_scale: Tensor,
) -> None:
    (bias_correction,) = switch_args(op_name, bias_correction=bias_correction)
    if mode not in (0, 1):
        raise RuntimeError(f"{op_name}: mode={shown(mode)}; expected 0 (L2) or 1 (decoupled, AdamW)")
    for name, value in (("lr", lr), ("step", step), ("inv_scale", inv_scale), ("noop_flag", noop_flag)):
        tensor_only = name in ("inv_scale", "noop_flag")  # read on the device, never on the host
        if (isinstance(value, Tensor) and value.numel() != 1) or (tensor_only and not isinstance(value, Tensor)):
            got = f"shape {list(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
            raise RuntimeError(f"{op_name}: {name} must be a one-element tensor, got {got}")
    grads, params, exp_avgs, exp_avg_sqs = lists[:4]
    if not params:
        return
    device = params[0].device
    lr, step = host_numbers([lr, step])  # ampkit's kernel takes them as numbers: one transfer for both
    op("adam_step", device)(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        lists[4] if len(lists) == 5 else [],
        _steps_before(step, len(params), device),
        float(lr),
        beta1,
        beta2,
        epsilon,
        weight_decay,
        mode == 1,
        False,
        bias_correction,
        1.0,
        inv_scale.reshape(()).float().reciprocal().to(device, non_blocking=True),
        _skip_flag_on(noop_flag, device),
    )


@pybind_numbers("amp_C")
def multi_tensor_adam_capturable(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: Tensor,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: Tensor,
    mode: int,
    bias_correction: int,
    weight_decay: float,
    inv_scale: Tensor,
) -> None:
    """Adam on ``[grads, params, exp_avgs, exp_avg_sqs]`` with ``lr`` and ``step`` as tensors, grads multiplied by
    ``inv_scale``, and nothing changed while ``noop_flag`` is set (GradScaler's found_inf), as Apex's kernel."""
    lists = check_lists("multi_tensor_adam_capturable", tensor_lists, (4,))
    _adam_capturable("multi_tensor_adam_capturable", noop_flag, lists, lr, beta1, beta2, epsilon, step, mode,
                     bias_correction, weight_decay, inv_scale)  # fmt: skip


@pybind_numbers("amp_C")
def multi_tensor_adam_capturable_master(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: Tensor,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: Tensor,
    mode: int,
    bias_correction: int,
    weight_decay: float,
    inv_scale: Tensor,
) -> None:
    """:func:`multi_tensor_adam_capturable` on ``[grads, params, exp_avgs, exp_avg_sqs, fp32 masters]``: the
    masters are updated and the (fp16/bf16) params receive their rounded copy."""
    lists = check_lists("multi_tensor_adam_capturable_master", tensor_lists, (5,))
    _adam_capturable("multi_tensor_adam_capturable_master", noop_flag, lists, lr, beta1, beta2, epsilon, step, mode,
                     bias_correction, weight_decay, inv_scale)  # fmt: skip


@pybind_numbers("amp_C")
def multi_tensor_adagrad(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: float,
    epsilon: float,
    mode: int,
    weight_decay: float,
) -> None:
    """Adagrad on ``[grads, params, state_sums]``; ``mode`` 0 adds L2 to the grad, 1 decays the weights as AdamW
    (``p -= lr * (g / (sqrt(h) + eps) + wd * p)``)."""
    grads, params, sums = check_lists("multi_tensor_adagrad", tensor_lists, (3,))
    if mode not in (0, 1):
        raise RuntimeError(f"multi_tensor_adagrad: mode={shown(mode)}; expected 0 (L2) or 1 (decoupled weight decay)")
    if not params:
        return
    if mode == 1 and weight_decay != 0:  # the update does not read p, so decaying first is the same
        decay_weights_(params, 1.0 - lr * weight_decay)
        weight_decay = 0.0
    device = params[0].device
    steps = [torch.zeros((), dtype=torch.float32, device=device) for _ in params]  # read only by lr_decay
    op("adagrad_step", device)(params, grads, sums, [], steps, float(lr), 0.0, weight_decay, epsilon, 1.0)


@pybind_numbers("amp_C")
def multi_tensor_novograd(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    grad_norms: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: int,
    bias_correction: int,
    weight_decay: float,
    grad_averaging: int,
    moment_mode: int,
    norm_type: int,
) -> None:
    """NovoGrad on ``[grads, params, exp_avgs]``. ``grad_norms`` (one float32 per tensor) holds the second
    moments and is blended in place with the new per-tensor norms first: ``sqrt(b2 * v^2 + (1 - b2) * n^2)``
    (``norm_type`` 2) or ``b2 * v + (1 - b2) * n`` (0, max-abs); ``moment_mode`` 0 puts the weight decay inside
    the moment, 1 outside."""
    grads, params, exp_avgs = check_lists("multi_tensor_novograd", tensor_lists, (3,))
    bias_correction, grad_averaging = switch_args(
        "multi_tensor_novograd", bias_correction=bias_correction, grad_averaging=grad_averaging
    )
    check_step("multi_tensor_novograd", step, bias_correction)
    if norm_type not in (0, 2):
        raise RuntimeError(f"multi_tensor_novograd: norm_type={shown(norm_type)}; expected 2 (L2) or 0 (max abs)")
    if moment_mode not in (0, 1):
        raise RuntimeError(f"multi_tensor_novograd: moment_mode={shown(moment_mode)}; expected 0 or 1")
    if not isinstance(grad_norms, Tensor) or grad_norms.numel() != len(params) or not grad_norms.is_floating_point():
        got = f"{grad_norms.dtype} of shape {list(grad_norms.shape)}" if isinstance(grad_norms, Tensor) else grad_norms
        raise ValueError(
            f"multi_tensor_novograd: grad_norms must be a float32 tensor with one second moment per tensor "
            f"({len(params)}), got {got}"
        )
    if not params:
        return
    previous = grad_norms.double()
    if norm_type == 2:
        norms = multi_tensor.l2norm(grads, per_tensor=True).per_tensor.double().to(previous.device)
        blended = (beta2 * previous.square() + (1 - beta2) * norms.square()).sqrt()
    else:
        norms = torch.stack(torch._foreach_norm(grads, float("inf"))).double().to(previous.device)
        blended = beta2 * previous + (1 - beta2) * norms
    grad_norms.copy_(blended)
    bias_correction1 = 1 - beta1**step if bias_correction else 1.0
    bias_correction2 = (1 - beta2**step) ** 0.5 if bias_correction else 1.0
    # One host read per call (a sync on CUDA), kept: ampkit's novograd_step op takes its denominators as a float64
    # CPU vector (per_tensor_values in csrc/optimizers/list_checks.h refuses a device tensor), and its CUDA
    # multi-tensor path copies them back to the device (novograd_step_cuda in csrc/optimizers/optimizers_cuda.cpp).
    # Dropping it needs that op to take them on the params' device, which its per-tensor CUDA path (a host double per
    # launch) cannot. FusedNovoGrad's step reads every bucket's in one transfer instead.
    denoms = (blended / bias_correction2 + epsilon).cpu().contiguous()
    op("novograd_step", params[0].device)(
        params, grads, exp_avgs, [], denoms, float(lr), beta1, weight_decay, moment_mode == 0,
        grad_averaging, bias_correction1, 1.0,
    )  # fmt: skip


@pybind_numbers("amp_C")
def multi_tensor_sgd(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    wd: float,
    momentum: float,
    dampening: float,
    lr: float,
    nesterov: bool,
    first_run: bool,
    wd_after_momentum: bool,
    scale: float,
) -> None:
    """SGD on ``[grads, weights, momentum_buffers]``, or with a fourth list of fp16 model weights that receive
    a copy of the updated (fp32 master) weights; grads are multiplied by ``scale``. Skipped while the flag is set.
    """
    lists = check_lists("multi_tensor_sgd", tensor_lists, (3, 4))
    nesterov, first_run, wd_after_momentum = switch_args(
        "multi_tensor_sgd", nesterov=nesterov, first_run=first_run, wd_after_momentum=wd_after_momentum
    )
    if not isinstance(noop_flag, Tensor) or noop_flag.numel() != 1:
        got = list(noop_flag.shape) if isinstance(noop_flag, Tensor) else type(noop_flag).__name__
        raise TypeError(f"multi_tensor_sgd: noop_flag must be a one-element int32 or float32 tensor, got {got}")
    if not lists[0]:
        return
    grads, weights, buffers = lists[:3]
    skip = _skip_flag_on(noop_flag, weights[0].device)  # Apex's kernel read the flag on the device: no host read
    if wd_after_momentum and wd != 0:  # w - lr * (u + wd * w) == (1 - lr * wd) * w - lr * u
        decay_weights_(weights, 1.0 - lr * wd, skip)
        wd = 0.0
    if len(lists) == 4:
        params, masters = lists[3], weights
    else:
        params, masters = weights, []
    sgd_step(
        params,
        grads,
        buffers if momentum != 0 else [],
        masters,
        lr=lr,
        weight_decay=wd,
        momentum=momentum,
        dampening=dampening,
        nesterov=nesterov,
        first_step=first_run,
        grad_factor=scale,
        scaler=ScalerTensors(found_inf=skip),
    )


def _check_scaler_state(current_scale: Tensor, growth_tracker: Tensor, hysteresis_tracker: Tensor,
                        found_inf: Tensor) -> None:  # fmt: skip
    """Apex's kernel read one float32 scale and flag and two int32 trackers; any one-element tensor holds one."""
    named = {"current_scale": current_scale, "growth_tracker": growth_tracker,
             "hysteresis_tracker": hysteresis_tracker, "found_inf": found_inf}  # fmt: skip
    for name, value in named.items():
        if not isinstance(value, Tensor) or value.numel() != 1:
            got = f"shape {list(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"update_scale_hysteresis: {name} must be a one-element tensor, got {got}")
    if not current_scale.is_floating_point():
        raise TypeError(
            f"update_scale_hysteresis: current_scale must be floating-point (Apex's float32), got {current_scale.dtype}"
        )


@pybind_numbers("amp_C")
def update_scale_hysteresis(
    current_scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
) -> torch.Tensor:
    """Apex's ``amp_C.update_scale_hysteresis``: the dynamic-scale update that backs off only after
    ``hysteresis`` consecutive overflows (Megatron's scaler). Updates the one-element tensors in place,
    on their device, with no host read; returns ``current_scale``.

    An overflow counts the hysteresis tracker down; while it stays above zero only the growth tracker
    resets. Past it, each overflow multiplies the scale by ``backoff_factor`` (a result below float32's
    smallest normal becomes 0, as the CUDA kernel's flush-to-zero gives). ``growth_interval`` clean
    updates in a row multiply it by ``growth_factor`` unless that overflows float32. A clean update
    refills the hysteresis tracker.
    """
    _check_scaler_state(current_scale, growth_tracker, hysteresis_tracker, found_inf)
    inf = found_inf.reshape(()) > 0
    tracker = torch.where(inf, hysteresis_tracker - 1, hysteresis_tracker)
    hold = inf & (tracker > 0)  # an overflow absorbed by the hysteresis: only the growth tracker resets
    backed_off = current_scale.double() * backoff_factor
    backed_off = torch.where(backed_off < torch.finfo(torch.float32).tiny, torch.zeros_like(backed_off), backed_off)
    successful = growth_tracker + 1
    grow = ~inf & (successful == growth_interval)
    grown = (current_scale.double() * growth_factor).float()
    grown = torch.where(torch.isfinite(grown), grown, current_scale)
    new_scale = torch.where(inf & ~hold, backed_off.float(), torch.where(grow, grown, current_scale))
    new_growth = torch.where(inf | grow, torch.zeros_like(growth_tracker), successful.to(growth_tracker.dtype))
    new_hysteresis = torch.where(inf, tracker, torch.full_like(tracker, hysteresis))
    current_scale.copy_(new_scale)
    growth_tracker.copy_(new_growth)
    hysteresis_tracker.copy_(new_hysteresis.to(hysteresis_tracker.dtype))
    return current_scale


def __getattr__(name: str) -> object:
    raise missing_name(
        f"ampkit's amp_C has no {shown(name)}; it provides {', '.join(__all__)}",
        "amp_C",
        name,
    )
