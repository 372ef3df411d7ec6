"""Apex's LAMB ops of ``amp_C`` on ampkit's two LAMB kernels (``lamb_stage1`` then ``lamb_stage2``, compiled for
CPU and CUDA, the pure-PyTorch reference elsewhere): ``multi_tensor_lamb`` (FusedLAMB), ``multi_tensor_lamb_mp``
(FusedMixedPrecisionLamb: tensors for lr, step and the norms, a GradScaler's inverse scale, fp32 masters) and
the separate stages NVIDIA's BERT pretraining drives itself, ``multi_tensor_lamb_stage1_cuda`` and
``multi_tensor_lamb_stage2_cuda``.

Apex's kernels took whatever dtypes their callers kept (fp16 moments beside fp16 params, an fp16 update
buffer, fp16 grads of fp32 params); ampkit's want moments in float32 laid out like the parameter. Tensors
that differ pass through float32 working copies written back after the op: the math is float32 either way,
and the caller's tensor gets one rounding, as Apex's store gave it. ampkit's LAMB kernels take the clipping
factor and the trust ratios as host numbers, where Apex's read them on the device: what they need is copied to
the host together, once before stage 1 (the global norm; for ``multi_tensor_lamb_mp`` also the flag, lr, step,
scales and parameter norms) and once after it (the direction's norms), two syncs a call on CUDA at most.
An inf/nan norm raises the flag on the device where the op goes on regardless.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ampkit.compat._pybind_numbers import pybind_numbers
from ampkit.ops import multi_tensor
from ampkit.ops._dtypes import HALF_DTYPES
from ampkit.ops._layout import is_dense
from ampkit.ops._switches import checked_switch
from ampkit.ops.host_values import host_vectors
from ampkit.ops.optimizers._kernels import op
from ampkit.wording import shown

TensorLists = Sequence[Sequence[Tensor]]


def check_lists(op_name: str, tensor_lists: TensorLists, counts: tuple[int, ...]) -> list[list[Tensor]]:
    """``tensor_lists`` as lists, checked as Apex's ``multi_tensor_apply`` did: one of ``counts`` lists of tensors,
    equal lengths, and ``tensor_lists[l][i]`` with as many elements as ``tensor_lists[0][i]``."""
    if isinstance(tensor_lists, Tensor) or not isinstance(tensor_lists, Sequence):
        raise TypeError(
            f"{op_name}: tensor_lists must be a list of lists of tensors, got {type(tensor_lists).__name__}"
        )
    for i, t in enumerate(tensor_lists):
        if isinstance(t, Tensor) or not isinstance(t, Sequence):
            raise TypeError(
                f"{op_name}: tensor_lists[{i}] must be a list of tensors, got {type(t).__name__} "
                f"(wrap a single tensor in a list)"
            )
        for j, tensor in enumerate(t):
            if not isinstance(tensor, Tensor):
                raise TypeError(
                    f"{op_name}: tensor_lists[{i}][{j}] must be a tensor, got {type(tensor).__name__} "
                    f"(a parameter without a .grad?)"
                )
    lists = [list(t) for t in tensor_lists]
    if len(lists) not in counts:
        expected = " or ".join(str(c) for c in counts)
        raise RuntimeError(f"{op_name}: tensor_lists has {len(lists)} lists; expected {expected}")
    for i, t in enumerate(lists[1:], start=1):
        if len(t) != len(lists[0]):
            raise RuntimeError(
                f"{op_name}: tensor_lists[{i}] has {len(t)} tensors but tensor_lists[0] has {len(lists[0])}"
            )
        for j, (tensor, first) in enumerate(zip(t, lists[0], strict=True)):
            if tensor.numel() != first.numel():
                raise RuntimeError(
                    f"{op_name}: tensor_lists[{i}][{j}] has {tensor.numel()} elements but tensor_lists[0][{j}] "
                    f"has {first.numel()}"
                )
    return lists


def check_scalar(op_name: str, name: str, value: Tensor | float) -> None:
    """A scalar Apex took as a number or a one-element tensor: refuse a tensor of another size."""
    if isinstance(value, Tensor) and value.numel() != 1:
        raise RuntimeError(f"{op_name}: {name} must be a number or a one-element tensor, got shape {list(value.shape)}")


def scalar_arg(op_name: str, name: str, value: Tensor | float) -> float:
    """A scalar Apex took as a number or a one-element tensor, read on the host."""
    check_scalar(op_name, name, value)
    return float(value)


def flag_if_not_finite(values: Tensor, noop_flag: Tensor) -> None:
    """Apex's norm kernels raise the flag on an inf/nan partial sum: raised here on the device, nothing read."""
    noop_flag.masked_fill_(~torch.isfinite(values).all().to(noop_flag.device), 1)


def switch_args(op_name: str, **values: Any) -> tuple[bool, ...]:
    """Apex's on/off arguments (ints or bools in its bindings) as bools, checked before the op changes anything:
    pybind11 refused a string, and Apex's kernels took only 1 as on, where ``bool("0")`` or ``bool(2)`` is True."""
    return tuple(checked_switch(op_name, name, value) for name, value in values.items())


def check_step(op_name: str, step: int | float, bias_correction: int) -> None:
    """A bias-corrected step counts from 1: at 0 the correction ``1 - beta ** 0`` divides by zero (NaN params)."""
    if bias_correction and float(step) < 1:
        raise RuntimeError(
            f"{op_name}: step={shown(step)} with bias_correction; the first step is 1 (increment it before the call)"
        )


class _Working:
    """``tensors`` as a kernel takes them: ``dtype`` (default their own) and laid out like ``like`` (default
    dense), copied where they are not; :meth:`write_back` stores the copies into the caller's tensors."""

    def __init__(self, tensors: Sequence[Tensor], dtype: torch.dtype | None = None, like: Sequence[Tensor] = ()):
        self.originals = list(tensors)
        self.tensors = []
        for i, t in enumerate(self.originals):
            layout = like[i] if like else t
            wanted = dtype or t.dtype
            fits = t.dtype == wanted and t.stride() == layout.stride() and is_dense(layout)
            self.tensors.append(t if fits else torch.empty_like(layout, dtype=wanted).copy_(t.reshape(layout.shape)))

    def write_back(self) -> None:
        for original, working in zip(self.originals, self.tensors, strict=True):
            if working is not original:
                original.copy_(working.reshape(original.shape))


def _acc_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _grad_dtype(grads: list[Tensor], param: Tensor) -> torch.dtype:
    """What ampkit's kernels read: the parameter's dtype, or float32 grads of fp16/bf16 params, all alike."""
    dtype = grads[0].dtype
    allowed = (param.dtype, torch.float32) if param.dtype in HALF_DTYPES else (param.dtype,)
    return dtype if dtype in allowed and all(g.dtype == dtype for g in grads) else _acc_dtype(param)


def clip_ratio(global_norm: float, max_norm: float) -> float:
    """Apex's global clipping divisor: ``norm / max_norm`` when the norm exceeds ``max_norm``, else 1.
    ``max_norm <= 0`` turns it off (Apex's kernels divided by zero and zeroed every gradient)."""
    return global_norm / max_norm if max_norm > 0 and global_norm > max_norm else 1.0


def _check_per_tensor(op_name: str, name: str, values: Tensor, count: int) -> Tensor:
    """The first ``count`` of ``values`` (flattened), one per tensor, as Apex's kernels read them."""
    flat = values.detach().reshape(-1)
    if flat.numel() < count:
        raise RuntimeError(f"{op_name}: {name} has {flat.numel()} values; expected one per tensor ({count})")
    return flat[:count]


def lamb_direction(
    params: list[Tensor],
    masters: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    step: float,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    grad_averaging: bool,
    bias_correction: bool,
    grad_factor: float,
) -> list[Tensor]:
    """LAMB stage 1 (ampkit's kernel): the moments of step ``step`` updated in place and the raw direction
    returned, one float32 (float64) tensor per param laid out like it. The param is read from ``masters``
    when given."""
    work_params = _Working(params)
    like = work_params.tensors
    acc = _acc_dtype(params[0])
    work_masters = _Working(masters, torch.float32, like)
    work_grads = _Working(grads, _grad_dtype(grads, params[0]), like)
    moments = [_Working(exp_avgs, acc, like), _Working(exp_avg_sqs, acc, like)]
    updates = [torch.empty_like(p, dtype=acc) for p in like]
    steps = [torch.tensor(step - 1.0, dtype=torch.float64) for _ in params]  # the kernel counts its own step
    op("lamb_stage1", params[0].device)(
        like, work_grads.tensors, moments[0].tensors, moments[1].tensors, updates, work_masters.tensors, steps,
        beta1, beta2, eps, weight_decay, adam_w_mode, grad_averaging, bias_correction, grad_factor,
    )  # fmt: skip
    for working in moments:
        working.write_back()
    return updates


def trust_ratios(lr: float, param_norms: Tensor, update_norms: Tensor, weight_decay: float, use_nvlamb: bool) -> Tensor:
    """``lr * ||param|| / ||update||`` per tensor (``lr`` where either norm is 0), applied only with weight
    decay or ``use_nvlamb``, as Apex's stage 2: a float64 CPU vector, what ampkit's stage-2 kernel reads. The norms
    are read only where the ratio applies, both in one transfer."""
    if not (use_nvlamb or weight_decay != 0):
        return torch.full((param_norms.numel(),), float(lr), dtype=torch.float64)
    param_norms, update_norms = host_vectors([param_norms, update_norms])
    usable = (param_norms != 0) & (update_norms != 0)
    return torch.where(usable, lr * (param_norms / update_norms.where(usable, 1.0)), lr).contiguous()


def apply_lamb(params: list[Tensor], masters: list[Tensor], updates: list[Tensor], ratios: Tensor) -> None:
    """LAMB stage 2 (ampkit's kernel): ``param -= ratios[i] * update`` on the masters when given, with the
    params receiving their rounded copy."""
    work_params = _Working(params)
    like = work_params.tensors
    work_masters = _Working(masters, torch.float32, like)
    work_updates = _Working(updates, _acc_dtype(params[0]), like)
    op("lamb_stage2", params[0].device)(like, work_updates.tensors, work_masters.tensors, ratios)
    work_params.write_back()
    work_masters.write_back()


def _per_tensor_norms(tensors: list[Tensor]) -> Tensor:
    return multi_tensor.l2norm(tensors, per_tensor=True).per_tensor


def _copy_into(targets: list[Tensor], values: list[Tensor]) -> None:
    """Store each value into its target (in the target's dtype and shape)."""
    for target, value in zip(targets, values, strict=True):
        target.copy_(value.reshape(target.shape))


@pybind_numbers("amp_C")
def multi_tensor_lamb(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: int,
    bias_correction: int,
    weight_decay: float,
    grad_averaging: int,
    mode: int,
    global_grad_norm: Tensor | float,
    max_grad_norm: float | None = None,
    use_nvlamb: bool | None = None,
) -> None:
    """LAMB on ``[grads, params, exp_avgs, exp_avg_sqs]``: grads divided by ``global_grad_norm / max_grad_norm``
    when the norm exceeds ``max_grad_norm``; ``mode`` 0 adds L2 to the grad, 1 decays as AdamW. As in Apex the
    grads are left holding the LAMB direction, the flag is raised (never read) on an inf/nan norm.

    Called as Apex had it from August 2019 to April 2020, with ``max_grad_norm`` right after ``mode`` (the
    FusedLAMB of that time, still copied into projects), the global norm is that of this call's grads and the
    trust ratio applies to every tensor, as that kernel did."""
    grads, params, exp_avgs, exp_avg_sqs = check_lists("multi_tensor_lamb", tensor_lists, (4,))
    norm_of_own_grads = max_grad_norm is None
    if norm_of_own_grads:
        max_grad_norm, use_nvlamb = scalar_arg("multi_tensor_lamb", "max_grad_norm", global_grad_norm), True
    bias_correction, grad_averaging, use_nvlamb = switch_args(
        "multi_tensor_lamb", bias_correction=bias_correction, grad_averaging=grad_averaging,
        use_nvlamb=use_nvlamb or False,  # None: Apex's default, off
    )  # fmt: skip
    check_step("multi_tensor_lamb", step, bias_correction)
    if mode not in (0, 1):
        raise RuntimeError(f"multi_tensor_lamb: mode={shown(mode)}; expected 0 (L2) or 1 (decoupled, AdamW)")
    if not params:
        return
    if norm_of_own_grads:
        global_grad_norm = multi_tensor.l2norm(grads).total
        flag_if_not_finite(global_grad_norm, noop_flag)
    param_norms = _per_tensor_norms(params)
    flag_if_not_finite(param_norms, noop_flag)
    # Two host reads per call (syncs on CUDA), kept: the global norm here, as stage 1's clip is the lamb_stage1 op's
    # host double grad_factor, and the per-tensor norms in trust_ratios (only with weight decay or use_nvlamb), as
    # the lamb_stage2 op takes its ratios as a float64 CPU vector (per_tensor_values, csrc/optimizers/list_checks.h)
    # and the norms of the direction exist only after stage 1. Both ops would need device-side scalars to drop them.
    clip = clip_ratio(scalar_arg("multi_tensor_lamb", "global_grad_norm", global_grad_norm), max_grad_norm)
    updates = lamb_direction(
        params, [], grads, exp_avgs, exp_avg_sqs, float(step), beta1=beta1, beta2=beta2, eps=epsilon,
        weight_decay=weight_decay, adam_w_mode=mode == 1, grad_averaging=grad_averaging,
        bias_correction=bias_correction, grad_factor=1.0 / clip,
    )  # fmt: skip
    _copy_into(grads, updates)  # Apex left the direction in .grad and took its norm from there
    update_norms = _per_tensor_norms(grads)
    flag_if_not_finite(update_norms, noop_flag)
    ratios = trust_ratios(float(lr), param_norms, update_norms, weight_decay, use_nvlamb)
    apply_lamb(params, [], grads, ratios)


@pybind_numbers("amp_C")
def multi_tensor_lamb_mp(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: Tensor,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: Tensor,
    bias_correction: int,
    weight_decay: float,
    grad_averaging: int,
    mode: int,
    global_grad_norm: Tensor,
    max_grad_norm: Tensor,
    use_nvlamb: bool | None,
    found_inf: Tensor,
    inv_scale: Tensor,
) -> None:
    """Apex's mixed-precision LAMB (FusedMixedPrecisionLamb's op) on ``[grads, params, exp_avgs, exp_avg_sqs]``
    or ``[grads, fp32 masters, exp_avgs, exp_avg_sqs, fp16/bf16 model params]``.

    ``lr``, ``step`` (the step being taken), ``global_grad_norm`` and ``max_grad_norm`` are one-element tensors;
    grads are multiplied by ``inv_scale`` before clipping. Nothing changes while ``noop_flag`` is set (the
    caller copies GradScaler's found_inf into it; ``found_inf`` itself is not read, as in Apex). An inf/nan
    param norm raises the flag and changes nothing; an inf/nan direction raises it after the moments and the
    grads (which hold the direction, as in Apex) were written, and the params are not updated.
    """
    lists = check_lists("multi_tensor_lamb_mp", tensor_lists, (4, 5))
    bias_correction, grad_averaging, use_nvlamb = switch_args(
        "multi_tensor_lamb_mp", bias_correction=bias_correction, grad_averaging=grad_averaging,
        use_nvlamb=use_nvlamb or False,
    )  # fmt: skip
    if mode not in (0, 1):
        raise RuntimeError(f"multi_tensor_lamb_mp: mode={shown(mode)}; expected 0 (L2) or 1 (decoupled, AdamW)")
    grads, params, exp_avgs, exp_avg_sqs = lists[:4]
    if not params:
        return
    name = "multi_tensor_lamb_mp"
    scalars = {"inv_scale": inv_scale, "lr": lr, "global_grad_norm": global_grad_norm, "max_grad_norm": max_grad_norm}
    for arg, value in scalars.items():
        check_scalar(name, arg, value)
    # fp16/bf16 model params get their rounded copy from the fp32 masters the kernels update; full-precision
    # "model params" in a fifth list are copied from the params after the step.
    with_masters = len(lists) == 5 and lists[4][0].dtype in HALF_DTYPES
    model_params, masters = (lists[4], params) if with_masters else (params, [])
    # What the host needs before stage 1, in one transfer: the flag, step, the scalars and the param norms.
    flag, step_now, *numbers, param_norms = host_vectors(
        [noop_flag.reshape(-1)[:1], step.reshape(-1)[:1], *scalars.values(), _per_tensor_norms(params)]
    )
    inv_scale, lr, global_grad_norm, max_grad_norm = (float(n) for n in numbers)
    if bool(flag[0]):
        return
    if not bool(torch.isfinite(param_norms).all()):  # host values: no read
        noop_flag.fill_(1)
        return
    updates = lamb_direction(
        model_params, masters, grads, exp_avgs, exp_avg_sqs, float(step_now[0]), beta1=beta1, beta2=beta2,
        eps=epsilon, weight_decay=weight_decay, adam_w_mode=mode == 1, grad_averaging=grad_averaging,
        bias_correction=bias_correction, grad_factor=inv_scale / clip_ratio(global_grad_norm, max_grad_norm),
    )  # fmt: skip
    _copy_into(grads, updates)  # Apex left the direction in .grad and took its norm from there
    # the second host read, kept: the ratios the lamb_stage2 op takes are a float64 CPU vector (see multi_tensor_lamb)
    (update_norms,) = host_vectors([_per_tensor_norms(grads)])
    if not bool(torch.isfinite(update_norms).all()):
        noop_flag.fill_(1)
        return
    ratios = trust_ratios(lr, param_norms, update_norms, weight_decay, use_nvlamb)
    apply_lamb(model_params, masters, grads, ratios)
    if len(lists) == 5 and not with_masters:
        _copy_into(lists[4], params)


@pybind_numbers("amp_C")
def multi_tensor_lamb_stage1_cuda(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    per_tensor_decay: Tensor,
    step: int,
    beta1: float,
    beta2: float,
    epsilon: float,
    global_grad_norm: Tensor | float,
    max_global_grad_norm: float,
) -> None:
    """Apex's LAMB stage 1 on ``[grads, params, exp_avgs, exp_avg_sqs, updates]``: the moments of step
    ``step + 1`` (Apex's bias correction counts the step *after* ``step``) and ``updates[i]`` = Adam's direction
    ``+ per_tensor_decay[i] * param``, grads clipped by the global norm; grad averaging always on. The flag is
    not read; the params are not written."""
    name = "multi_tensor_lamb_stage1_cuda"
    grads, params, exp_avgs, exp_avg_sqs, updates = check_lists(name, tensor_lists, (5,))
    if not params:
        return
    check_scalar(name, "global_grad_norm", global_grad_norm)
    decays, norm = host_vectors(
        [_check_per_tensor(name, "per_tensor_decay", per_tensor_decay, len(params)), global_grad_norm]
    )
    clip = clip_ratio(float(norm), max_global_grad_norm)
    decays = decays.tolist()
    for decay in dict.fromkeys(decays):  # ampkit's kernel takes one weight decay: one call per distinct value
        picked = [i for i, d in enumerate(decays) if d == decay]
        select = [[t[i] for i in picked] for t in (params, grads, exp_avgs, exp_avg_sqs, updates)]
        directions = lamb_direction(
            select[0], [], select[1], select[2], select[3], float(step) + 1.0, beta1=beta1, beta2=beta2,
            eps=epsilon, weight_decay=decay, adam_w_mode=True, grad_averaging=True, bias_correction=True,
            grad_factor=1.0 / clip,
        )  # fmt: skip
        _copy_into(select[4], directions)


@pybind_numbers("amp_C")
def multi_tensor_lamb_stage2_cuda(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    per_tensor_param_norm: Tensor,
    per_tensor_update_norm: Tensor,
    lr: float,
    weight_decay: float | None = None,
    use_nvlamb: bool | None = None,
) -> None:
    """Apex's LAMB stage 2 on ``[params, updates]``: ``param -= lr * ratio * update`` with the trust ratio
    ``||param|| / ||update||`` from the given per-tensor norms when ``weight_decay != 0`` or ``use_nvlamb``
    (1 where a norm is 0). The flag is not read.

    Called as Apex had it until April 2020, with ``lr`` the last argument (NVIDIA's 2019 BERT ``BertLAMB``),
    the ratio applies to every tensor, as that kernel did."""
    name = "multi_tensor_lamb_stage2_cuda"
    params, updates = check_lists(name, tensor_lists, (2,))
    if not params:
        return
    param_norms = _check_per_tensor(name, "per_tensor_param_norm", per_tensor_param_norm, len(params))
    update_norms = _check_per_tensor(name, "per_tensor_update_norm", per_tensor_update_norm, len(params))
    if weight_decay is None:
        weight_decay, use_nvlamb = 0.0, True
    ratios = trust_ratios(float(lr), param_norms, update_norms, weight_decay, bool(use_nvlamb))
    apply_lamb(params, [], updates, ratios)
