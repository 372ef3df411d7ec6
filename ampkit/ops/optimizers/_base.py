"""Base class of ampkit's fused optimizers: GradScaler contract, master weights, per-dtype buckets.

A subclass declares its state (``_init_state``) and applies one multi-tensor update per bucket of
parameters sharing a dtype (``_update``); this class gathers the parameters that have gradients,
normalises the gradients' layout, keeps optional fp32 master copies of fp16/bf16 parameters, and honours
torch's GradScaler contract (``grad_scale``/``found_inf`` attributes). Adam, SGD, Adagrad, Adadelta and the
RMSprops hand both tensors to their kernels, which skip the step or unscale the gradients where they run,
in the same pass as the update and with no read back to the host; LAMB and NovoGrad read gradient norms on
the host each step anyway (in the same transfer as the two scalars) and AdamP's
kernels take host numbers, so they read the two scalars there and fold ``1 / grad_scale`` into the one
``grad_factor`` their kernels multiply each gradient by. Either way the grads are left unscaled after a
step, as torch's fused optimizers leave them.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, ParamSpec, TypeVar

import numpy as np
import torch
from torch import Tensor

from ampkit.ops._backend import resolve_backend, torch_has_fused_op
from ampkit.ops._dtypes import HALF_DTYPES, KERNEL_DTYPES
from ampkit.ops._errors import ArgumentTypeError, StateDictKeyError
from ampkit.ops._layout import dtensor_type, first_overlap, is_dense, local_shard, shares_memory
from ampkit.ops._switches import is_switch
from ampkit.ops.host_values import host_numbers, host_vectors
from ampkit.ops.optimizers._state_map import StateMap
from ampkit.wording import beyond_float, integer_digits, shown, type_of


def acc_dtype(param: Tensor) -> torch.dtype:
    """The dtype optimizer state is kept in: float64 for float64 parameters, float32 otherwise."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


class ScalerTensors(NamedTuple):
    """GradScaler's ``grad_scale`` and ``found_inf`` on one device, as the kernels take them (or None)."""

    grad_scale: Tensor | None = None
    found_inf: Tensor | None = None

    def to(self, device: torch.device) -> ScalerTensors:
        return ScalerTensors(*(None if t is None else _scalar_on(t, device) for t in self))


NO_SCALER = ScalerTensors()


def _as_tensor(value: Tensor | float | None, name: str) -> Tensor | None:
    """GradScaler's ``found_inf``/``grad_scale`` as a one-element tensor: its ``found_inf`` is the sum of its
    per-device flags, the Python int 0 when none of the optimizer's parameters has a gradient. Anything else is named:
    a string was read by ``float()``, a many-element tensor failed in a reshape naming neither."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise RuntimeError(f"step(): {name} must be a one-element tensor, got shape {tuple(value.shape)}")
        if value.is_meta:  # its value decides the step; torch's copy out of it named neither the argument nor why
            raise ValueError(f"step(): {name} is on the meta device, which holds no value; pass a real tensor")
        # torch's fused optimizers read both as float32; a bool scale was taken as 1, a complex one lost its part
        if value.is_complex() or (name == "grad_scale" and not value.is_floating_point()):
            kind = "a floating-point" if name == "grad_scale" else "a real"
            raise ArgumentTypeError(
                f"step(): {name} must be {kind} one-element tensor (GradScaler's float32), got a {value.dtype} tensor"
            )
        if name == "grad_scale" and value.dtype != torch.float32:  # was converted without a word
            raise ArgumentTypeError(
                f"step(): grad_scale must be a float32 one-element tensor (GradScaler's), got a {value.dtype} tensor; "
                "torch's fused optimizers refuse it too ('expected scalar type Float'): pass grad_scale.float()"
            )
        return value
    if name == "grad_scale" and isinstance(value, bool):
        raise ArgumentTypeError(
            f"step(): grad_scale must be a number or a one-element float32 tensor, got {shown(value)}"
        )
    if isinstance(value, bool | numbers.Real):
        if name == "grad_scale" and not valid_scale(value):  # a host number is checked for free
            raise ValueError(
                "step(): grad_scale must be a finite float32 number > 0 (the scale the gradients carry), got "
                f"{shown(value)}"
            )
        return torch.tensor(float(value))
    raise ArgumentTypeError(f"step(): {name} must be a one-element tensor or a number, got {shown(value)}")


_SCALE_RANGE = (torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max)


def valid_scale(value: float) -> bool:
    """Whether a loss scale is a finite float32 number > 0 (not subnormal, whose inverse overflows float32)."""
    return _SCALE_RANGE[0] <= value <= _SCALE_RANGE[1]


def check_grad_factor(grad_factor: float) -> None:
    """``step_with_grad_factor``'s factor must be a finite number: NaN or inf would turn every weight NaN."""
    if isinstance(grad_factor, bool) or not (isinstance(grad_factor, numbers.Real) and abs(grad_factor) < math.inf):
        raise ValueError(f"step_with_grad_factor: grad_factor must be a finite number, got {shown(grad_factor)}")


def _skip_on_bad_scale(found_inf: Tensor | None, grad_scale: Tensor) -> Tensor:
    """``found_inf`` as a 0/1 skip flag (:func:`_skip_flag`) with a ``grad_scale`` that is not a finite number > 0
    counted as an overflow, decided on the scale's device (a few small ops, no host read): gradients divided by 0, inf
    or NaN are not finite (GradScaler's own ``unscale_`` finds them so and skips), and by a negative scale they point
    uphill."""
    scale = _scalar_on(grad_scale, grad_scale.device)
    valid = scale.clamp(*_SCALE_RANGE) == scale  # as valid_scale: false for 0, a negative, inf and NaN
    if found_inf is not None:
        valid &= _scalar_on(found_inf, scale.device) == 0
    return torch.where(valid, 0.0, 1.0)


def _skip_flag(found_inf: Tensor) -> Tensor:
    """``found_inf`` as 1.0 where it is not zero (NaN included), else 0.0, on its device. GradScaler hands the sum of
    its per-device flags (2.0 when two devices overflowed); torch's fused ops skip only on exactly 1.0 and count the
    step back by the flag's value, so 2.0 stepped on inf gradients and left the step count at -1."""
    return (_scalar_on(found_inf, found_inf.device) != 0).float()


def _scalar_on(t: Tensor, device: torch.device) -> Tensor:
    return t.to(device=device, dtype=torch.float32, non_blocking=True).reshape(())


@dataclass
class Bucket:
    """Parameters of one group sharing (param dtype, grad dtype), with their grads and state dicts. For sharded
    parameters (FSDP2's DTensors) ``params``, ``grads`` and ``state_list`` hold each rank's local shards, which the
    element-wise kernels update in place."""

    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    states: list[dict[str, Any]] = field(default_factory=list)
    has_master: bool = False
    sharded: bool = False
    # The DTensors whose local shards ``params`` holds (empty unless ``sharded``): state made lazily is made like them.
    whole_params: list[Tensor] = field(default_factory=list)
    # ``.grad`` tensors the kernels read through a copy (another dtype or layout): they unscale the copy.
    copied_grads: list[Tensor] = field(default_factory=list)
    # With masters: each parameter's version counter when it last held its master's rounding (None: not yet read).
    versions: list[int] | None = None

    def state_list(self, key: str) -> list[Tensor]:
        if self.sharded:
            return [local_shard(s[key]) for s in self.states]
        return [s[key] for s in self.states]

    def masters(self) -> list[Tensor]:
        return self.state_list("master_param") if self.has_master else []

    def adopt_outside_writes(self) -> None:
        """Each fp32 master takes its parameter's values where something else wrote the parameter since the last
        step (``model.load_state_dict`` of an earlier checkpoint, weight clipping under ``no_grad``): the step would
        otherwise write the stale master back over them. Only a moved version counter leads to a compare, and equal
        values (an EMA swapped in for evaluation and back) keep the master's extra bits."""
        versions = [p._version for p in self.params]
        if self.versions is not None and versions != self.versions:
            for p, master, now, before in zip(self.params, self.masters(), versions, self.versions, strict=True):
                if now != before and not torch.equal(p, master.to(p.dtype)):
                    master.copy_(p)
        self.versions = versions

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


@contextmanager
def torch_step_counts(bucket: Bucket, found_inf: Tensor | None) -> Iterator[list[Tensor]]:
    """The bucket's ``step`` tensors counted as ``torch.optim`` counts around its fused ops: advanced before the op,
    and taken back on the device after it where ``found_inf`` made the op skip (no host read)."""
    steps = bucket.state_list("step")
    torch._foreach_add_(steps, 1)
    yield steps
    if found_inf is not None:
        torch._foreach_sub_(steps, [found_inf] * len(steps))


@dataclass
class _BucketPlan:
    """One param group's buckets as last built, with what they were built from: the group's parameters, each
    gradient's (dtype, strides) with its parameter's (None: no gradient), and the optimizer's state map (which
    ``load_state_dict`` replaces) with its count of resets (a parameter's state removed or replaced); ``filled``
    holds the parameters' state dicts that held state then, which ``state[p].clear()`` would empty."""

    params: list[Tensor]
    layout: list[tuple[Any, ...] | None]
    state: StateMap
    resets: int
    buckets: list[Bucket]
    slots: list[list[int]]
    reusable: bool = True  # False: kept for the one-element look-up only (a copied gradient is made anew each step)
    filled: list[dict[str, Any]] = field(init=False)
    _one_element: frozenset[int] | None = field(default=None, init=False)
    _one_element_params: list[int] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.filled = [s for bucket in self.buckets for s in bucket.states if s]

    def fits(self, params: list[Tensor], layout: list[tuple[Any, ...] | None], state: StateMap) -> bool:
        if not self.reusable or layout != self.layout or not all(self.filled):
            return False
        if state is not self.state or state.resets != self.resets:
            return False
        return len(params) == len(self.params) and all(map(operator.is_, params, self.params))

    def holds_state_of(self, params: list[Tensor], state: StateMap) -> bool:
        """Whether no state tensor was made or loaded since, as far as a look costing nothing per parameter tells: the
        same state map, no entry replaced or removed, as many parameters, the same first (a state tensor replaced by
        hand, or a parameter swapped in place further down the group's list, is not seen)."""
        if state is not self.state or state.resets != self.resets or len(params) != len(self.params):
            return False
        return not params or params[0] is self.params[0]

    def one_element_addresses(self) -> frozenset[int]:
        """The addresses of the group's one-element state tensors (every step count), found once for the plan: the
        only state a one-element tensor of its own (GradScaler's scale) could be."""
        if self._one_element is None:
            held = (local_shard(v) for p in self.params for v in self.state.get(p, {}).values())
            self._one_element = frozenset(t.data_ptr() for t in held if isinstance(t, Tensor) and t.numel() == 1)
        return self._one_element

    def one_element_params(self) -> list[int]:
        """The indices of the group's one-element parameters, whose own and gradients' addresses are read each step."""
        if self._one_element_params is None:
            self._one_element_params = [i for i, p in enumerate(self.params) if local_shard(p).numel() == 1]
        return self._one_element_params


def read_together(
    found_inf: Tensor | None, grad_scale: Tensor | None, values: Tensor | None
) -> tuple[bool, float | None, Tensor | None]:
    """GradScaler's skip and scale as host numbers, and ``values`` (a vector, or None) as a float64 host tensor: all
    copied in one transfer (one synchronization on CUDA)."""
    if values is None:
        skip, scale = host_numbers([found_inf, grad_scale])
        return bool(skip), scale, None
    scalars = [t for t in (found_inf, grad_scale) if t is not None]
    *read, host = host_vectors([*scalars, values])
    head = iter(float(v) for v in read)
    skip = found_inf is not None and next(head) != 0
    scale = next(head) if grad_scale is not None else None
    return skip, scale, host


def decay_weights_(weights: list[Tensor], factor: float, found_inf: Tensor | None = None) -> None:
    """Multiply the weights a kernel will update (fp32 masters where there are) by ``factor``: a weight decay
    applied outside the gradient, ``w - lr * (u + wd * w) = (1 - lr * wd) * w - lr * u``, before a kernel that
    adds ``-lr * u``. A non-zero ``found_inf`` (the step is skipped on the device) leaves them as they are."""
    if not weights:
        return
    if found_inf is None:
        torch._foreach_mul_(weights, factor)
        return
    multiplier = torch.where(_scalar_on(found_inf, weights[0].device) != 0, 1.0, factor)
    torch._foreach_mul_(weights, multiplier)


def check_hyper(
    name: str, value: float, low: float = 0.0, high: float | None = None, *, closed: bool = False, finite: bool = True
) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is a number with ``low <= value`` (and ``value < high``
    when given, ``value <= high`` when ``closed``); a bool counts as 0 or 1 and a one-element tensor of a real dtype as
    its number, as torch.optim takes them (``lr=True`` is 1). One of another type is also a TypeError, as in torch.
    With no ``high`` it must also be finite unless ``finite`` is False: an infinite ``lr``, ``eps`` or
    ``weight_decay`` passes ``>= 0`` and turns every weight inf or NaN, or freezes it."""
    finite_word = ""
    if high is not None:
        bound = f"in [{low}, {high}{']' if closed else ')'}"
    else:
        bound, finite_word = f">= {low}", "finite " if finite else ""
        high, closed = math.inf, not finite
    if isinstance(value, Tensor) and value.numel() != 1:  # torch.optim's words for it
        raise ValueError(f"Invalid {name}: Tensor {name} must be 1-element, got shape {tuple(value.shape)}")
    if isinstance(value, Tensor) and not value.is_complex() and not value.is_meta:
        value = value.item()
    elif isinstance(value, np.bool_):  # numpy's bool is no numbers.Real, but is torch.optim's 0 or 1 as a bool is
        value = bool(value)
    if not isinstance(value, numbers.Real):
        raise ArgumentTypeError(
            f"Invalid {name}: {shown(value)} is {type_of(value)} (expected a {finite_word}number {bound})"
        )
    if beyond_float(value):  # passes value < inf, then every step's float() raised a bare OverflowError
        raise ValueError(f"Invalid {name}: {integer_digits(value)} (expected a {finite_word}value {bound})")
    if not (value >= low) or not (value <= high if closed else value < high):
        theirs = _torch_words(name)
        also = f"; torch.optim: Invalid {theirs}: {value}" if theirs else ""
        raise ValueError(f"Invalid {name}: {shown(value)} (expected a {finite_word}value {bound}{also})")


def _torch_words(name: str) -> str | None:
    """How ``torch.optim``'s constructors name the hyper-parameter ``name`` in their ``Invalid ...`` errors (None where
    torch has none), so code and ported tests matching torch's message match ours too."""
    if name in ("lr", "eps"):
        return "learning rate" if name == "lr" else "epsilon value"
    if name in ("betas[0]", "betas[1]"):
        return f"beta parameter at index {name[6]}"
    if name in ("weight_decay", "momentum", "rho", "lr_decay", "initial_accumulator_value", "alpha"):
        return f"{name} value"
    return None


# The hyper-parameters a param group may carry, whichever optimizer it belongs to: (low, high or None). Checked on
# every group when it is added (the constructor's groups too) and loaded, so that a group's own ``lr`` of -1 or
# NaN is refused as the constructor's would be.
GROUP_HYPER_RULES: dict[str, tuple[float, float | None]] = {
    "lr": (0.0, None),
    "eps": (0.0, None),
    "weight_decay": (0.0, None),
    "momentum": (0.0, None),
    "dampening": (0.0, None),
    "alpha": (0.0, None),
    "rho": (0.0, 1.0 + 1e-12),
    "lr_decay": (0.0, None),
    "initial_accumulator_value": (0.0, None),
    "max_grad_norm": (0.0, math.inf),  # inf: never clip
    "delta": (0.0, math.inf),  # inf: always project (AdamP)
    "wd_ratio": (0.0, None),
}


# The options a param group may carry that take one of a few numbers: (the numbers, what they mean).
GROUP_CHOICES: dict[str, tuple[tuple[int, ...], str]] = {
    "norm_type": ((0, 2), "2 (L2) or 0 (max abs), as Apex's FusedNovoGrad"),
}


def check_choice(name: str, value: Any, key: str) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is one of ``GROUP_CHOICES[key]``'s numbers (not a bool)."""
    choices, meaning = GROUP_CHOICES[key]
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value not in choices:
        raise ValueError(f"Invalid {name}: {shown(value)} (expected {meaning})")


# The on/off options a param group may carry, whichever optimizer it belongs to: True or False (or Apex's 0 and 1).
GROUP_FLAGS = (
    "adam_w_mode",
    "amsgrad",
    "bias_correction",
    "capturable",
    "centered",
    "decoupled_decay",
    "grad_averaging",
    "init_zero",
    "lr_in_momentum",
    "maximize",
    "nesterov",
    "reg_inside_moment",
    "use_nvlamb",
)


def check_flag(name: str, value: Any) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is True or False (0 or 1). Anything else is truthy or falsy
    by accident: ``FusedAdam(params, 1e-3, (0.9, 0.95))``, torch.optim's positional order, puts the betas in
    Apex's ``bias_correction`` and would run with the default betas."""
    if is_switch(value):
        return
    hint = " (betas go by keyword: the third positional argument is bias_correction, as in Apex)"
    hint = hint if name.startswith("bias_correction") and isinstance(value, tuple | list) else ""
    raise ArgumentTypeError(f"Invalid {name}: {shown(value)} is {type_of(value)} (expected True or False){hint}")


# The flags torch.optim also takes as None, meaning False: torch.optim.Adam(capturable=None) keeps None in its groups
# (and checkpoints) and steps as with False.
_NONE_IS_FALSE = frozenset({"capturable"})


def check_group_flag(name: str, key: str, value: Any) -> None:
    """:func:`check_flag` on the flag ``key`` (named ``name``), which may also be None where torch.optim takes None
    as False (``capturable``): a torch checkpoint of ``Adam(capturable=None)`` was refused at load."""
    if key not in _NONE_IS_FALSE:
        check_flag(name, value)
    elif value is not None and not is_switch(value):  # None is as valid as False here: the error says so
        raise ArgumentTypeError(f"Invalid {name}: {shown(value)} is {type_of(value)} (expected True, False or None)")


def check_betas(betas: Any, where: str = "") -> tuple[Any, Any]:
    """``betas`` as a tuple if it is a sequence of two numbers in [0, 1) (a tuple, a list, OmegaConf's ListConfig, as
    torch.optim takes them); else a ValueError (a float there is a positional call gone astray)."""
    expected = "(expected two numbers in [0.0, 1.0))"
    if not isinstance(betas, Sequence) or isinstance(betas, str | bytes):
        raise ArgumentTypeError(f"Invalid betas{where}: {shown(betas)} is {type_of(betas)} {expected}")
    if len(betas) != 2:
        raise ValueError(f"Invalid betas{where}: {shown(betas)} {expected}")
    for i, beta in enumerate(betas):
        check_hyper(f"betas[{i}]{where}", beta, 0.0, 1.0)
    if isinstance(betas[0], Tensor) != isinstance(betas[1], Tensor):  # torch.optim's rule and words
        raise ValueError(
            f"Invalid betas{where}: {shown(tuple(betas))} mixes a tensor and a number; betas must be either both "
            "floats or both Tensors"
        )
    return tuple(betas)


def check_group_hypers(group: dict[str, Any]) -> None:
    """:func:`check_hyper` on each known hyper-parameter of ``group`` (see :data:`GROUP_HYPER_RULES`), its
    ``betas`` and :func:`check_flag` on its on/off options, named as ``param_groups[i]['lr']`` would be read; torch's
    ``differentiable=True``, which these steps cannot honour, is refused rather than ignored."""
    for key, (low, high) in GROUP_HYPER_RULES.items():
        if key in group:
            check_hyper(f"{key} of a param group", group[key], low, high, closed=high == math.inf)
    for key in GROUP_FLAGS:
        if key in group:
            check_group_flag(f"{key} of a param group", key, group[key])
    for key in GROUP_CHOICES:
        if key in group:
            check_choice(f"{key} of a param group", group[key], key)
    if "betas" in group:
        check_betas(group["betas"], " of a param group")
    if group.get("differentiable"):  # torch.optim's switch, in a group of the user's or from a torch checkpoint
        raise ValueError(
            f"Invalid differentiable of a param group: {shown(group['differentiable'])} (fused optimizers update in "
            "place under torch.no_grad(), so no gradient flows through their step; use torch.optim's optimizer for "
            "that)"
        )


def check_group_at_step(owner: str, index: int, group: dict[str, Any]) -> None:
    """:func:`check_group_hypers`' rules again at a step, for values written into ``param_groups[index]`` since it
    was added (a scheduler's, a config's): a string, None or a two-element tensor failed deep in torch's dispatcher,
    and ``betas=(0.9, 1.5)`` or ``lr=nan`` turned every weight NaN. One pass over the group's items: a float in
    range (an int too: ``weight_decay=0``, FusedAdam's default) or a bool flag costs a look-up and two comparisons."""
    for key, value in group.items():
        if type(value) is float or type(value) is int:
            if key in GROUP_CHOICES:
                if value in GROUP_CHOICES[key][0]:
                    continue
            else:
                bounds = _STEP_BOUNDS.get(key)
                if bounds is not None:
                    if bounds[0] <= value < bounds[1]:
                        continue
                elif key not in _FLAG_KEYS or (type(value) is int and 0 <= value <= 1):
                    continue  # a key with no rule, or a flag's 0 or 1 (Apex's); amsgrad=2 stepped as True
        elif type(value) is bool and key in _FLAG_KEYS:
            continue
        elif key == "betas" and type(value) in (tuple, list) and len(value) == 2:  # a list: add_param_group's, YAML's
            beta1, beta2 = value
            if type(beta1) in _NUMBER_TYPES and type(beta2) in _NUMBER_TYPES and 0 <= beta1 < 1 and 0 <= beta2 < 1:
                continue
        if key in _STEP_BOUNDS or key in _FLAG_KEYS or key in GROUP_CHOICES or key == "betas":
            _check_group_value(f"{key} of {owner}.param_groups[{index}]", key, value)


def _check_group_value(name: str, key: str, value: Any) -> None:
    """The slow path of :func:`check_group_at_step`: the rule of ``key``. A one-element float tensor off the CPU (a
    capturable ``lr``, betas on the GPU) is checked for its shape and dtype, its value never read (a host sync each
    step, where the kernels' one read a step is :meth:`FusedOptimizer.group_numbers`')."""
    if key in GROUP_HYPER_RULES:
        if _unread_on_device(value):
            return
        low, high = GROUP_HYPER_RULES[key]
        check_hyper(name, value, low, high, closed=high == math.inf)
    elif key in _FLAG_KEYS:
        check_group_flag(name, key, value)
    elif key in GROUP_CHOICES:
        check_choice(name, value, key)
    elif key == "betas":
        pair = isinstance(value, tuple | list) and len(value) == 2
        if pair and _unread_on_device(value[0]) and _unread_on_device(value[1]):
            return
        check_betas(value, name[len(key) :])


def _unread_on_device(value: Any) -> bool:
    """Whether ``value`` is a one-element real tensor off the CPU: its shape and dtype are checked, its value left
    unread at a step (a host sync); it was checked when its group was added."""
    off_cpu = isinstance(value, Tensor) and value.device.type not in ("cpu", "meta")  # meta holds no value at all
    return off_cpu and value.numel() == 1 and not value.is_complex()


_NUMBER_TYPES = (float, int)  # check_group_at_step's fast path: a bool (an int's subclass) is not one of them

# check_group_at_step's fast path: (low, high) of each hyper-parameter, high at most the largest float; a value at
# or past it (inf where inf is allowed, which the slow path accepts; an int no float holds, which it refuses) takes
# the slow path
_STEP_BOUNDS = {
    key: (low, min(math.inf if high is None else high, sys.float_info.max))
    for key, (low, high) in GROUP_HYPER_RULES.items()
}
_FLAG_KEYS = frozenset(GROUP_FLAGS)


def check_state_dict_layout(owner: str, state_dict: Any, tensor_keys: Iterable[str]) -> None:
    """Raise naming what is wrong unless ``state_dict`` is laid out as ``Optimizer.state_dict()`` returns: a dict of
    ``state`` (per parameter, dicts whose ``tensor_keys`` hold tensors or None and whose ``step`` is a number) and
    ``param_groups`` (dicts with ``params``). The types are torch's for the same mistakes: TypeError, KeyError."""
    where = f"{owner}.load_state_dict"
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{where} expects the dict optimizer.state_dict() returns, got a {type(state_dict).__name__}")
    missing = [key for key in ("state", "param_groups") if key not in state_dict]
    if missing:
        keys = sorted(map(str, state_dict))
        first_keys = keys[:6] + (["..."] if len(keys) > 6 else [])
        raise StateDictKeyError(
            f"{where}: the state dict lacks {missing} (its keys: {first_keys}): expected optimizer.state_dict(), not a "
            "model's state_dict() or a whole checkpoint"
        )
    groups, states = state_dict["param_groups"], state_dict["state"]
    if not isinstance(groups, list | tuple) or not isinstance(states, Mapping):
        raise TypeError(
            f"{where}: 'param_groups' must be a list and 'state' a dict, got a {type(groups).__name__} and a "
            f"{type(states).__name__}"
        )
    for i, group in enumerate(groups):
        if not isinstance(group, Mapping) or "params" not in group:
            raise StateDictKeyError(f"{where}: saved param_groups[{i}] has no 'params' (got {group!r:.80})")
    tensor_keys = set(tensor_keys)
    for pid, entry in states.items():
        if not isinstance(entry, Mapping):
            raise TypeError(f"{where}: saved state[{shown(pid)}] is {type_of(entry)}, expected a dict")
        for key, value in entry.items():
            if key == "step":
                if isinstance(value, bool) or not isinstance(value, numbers.Real | Tensor):
                    raise TypeError(f"{where}: saved state[{shown(pid)}]['step'] is {value!r:.40}, expected a number")
            elif key in tensor_keys and value is not None and not isinstance(value, Tensor):
                raise TypeError(
                    f"{where}: saved state[{shown(pid)}][{shown(key)}] is {type_of(value)}, expected a tensor"
                )


def refuse_reordered_names(owner: str, saved_groups: Sequence[Any], groups: Sequence[dict[str, Any]]) -> None:
    """Raise ValueError when the state dict names this optimizer's parameters (``param_names``, kept by an optimizer
    built from ``named_parameters()``) in another order: torch's loader pairs states with parameters by position, so
    each parameter would take another's moments (silently, where their shapes agree)."""
    if not all(isinstance(pid, int) for group in saved_groups for pid in group["params"]):
        return  # torch.distributed.checkpoint's, keyed by name and put in this optimizer's order (names as saved)
    saved, ours = _param_names(saved_groups), _param_names(groups)
    if saved is None or ours is None or saved == ours or sorted(saved) != sorted(ours):
        return  # unnamed, or other names (a wrapper's prefix, ``module.``): loaded by position, as torch loads them
    at = next(i for i, (then, now) in enumerate(zip(saved, ours, strict=True)) if then != now)
    raise ValueError(
        f"{owner}.load_state_dict: the state dict holds this optimizer's parameters in another order (parameter {at} "
        f"is '{saved[at]}' there, '{ours[at]}' here); states load by position, so each would take another's. Build "
        "the optimizer with the parameters in the saved order, or reorder the state dict in a load_state_dict pre-hook"
    )


def _param_names(groups: Sequence[Any]) -> list[str] | None:
    """Every group's ``param_names`` in order, or None unless each group holds a list of strings there."""
    names: list[str] = []
    for group in groups:
        held = group.get("param_names")
        if not isinstance(held, list | tuple) or not all(isinstance(name, str) for name in held):
            return None
        names += held
    return names


P = ParamSpec("P")
T = TypeVar("T")


def eager_under_compile(fn: Callable[P, T]) -> Callable[P, T]:
    """``fn`` run eagerly inside a ``torch.compile``d function (a whole train step compiled), as a graph break: the
    C++ kernels have no fake-tensor form for dynamo to trace, and a step reads host numbers (GradScaler's skip,
    LAMB's norms). Made at the first call, as torch.optim makes its own: ``torch.compiler.disable`` imports dynamo,
    seconds an ``ampkit`` command that never steps (``--help``, a config error) would otherwise wait for."""

    @functools.wraps(fn)
    def run_eagerly(*args: P.args, **kwargs: P.kwargs) -> T:
        eager = _eager_forms.get(fn)
        if eager is None:
            reason = "ampkit's fused optimizer steps run their C++/CUDA kernels eagerly"
            eager = _eager_forms[fn] = torch.compiler.disable(fn, recursive=True, reason=reason)
        return eager(*args, **kwargs)

    return run_eagerly


_eager_forms: dict[Callable, Callable] = {}  # each step function's dynamo-disabled form, made at its first call


@contextmanager
def _load_hooks_held(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """``torch.optim.Optimizer.load_state_dict`` without its load hooks (the caller runs them): the hook dicts are
    swapped for empty ones and put back, so the handles that remove hooks stay valid."""
    pre, post = optimizer._optimizer_load_state_dict_pre_hooks, optimizer._optimizer_load_state_dict_post_hooks
    optimizer._optimizer_load_state_dict_pre_hooks, optimizer._optimizer_load_state_dict_post_hooks = {}, {}
    try:
        yield
    finally:
        optimizer._optimizer_load_state_dict_pre_hooks, optimizer._optimizer_load_state_dict_post_hooks = pre, post


class FusedOptimizer(torch.optim.Optimizer):
    """Shared machinery of the fused optimizers (see the module docstring).

    Args:
        params: parameters or parameter groups, as for any ``torch.optim.Optimizer``.
        defaults: default hyper-parameters of a group.
        master_weights: keep an fp32 copy (``state["master_param"]``) of each fp16/bf16 parameter, update
            the copy and write the rounded result back to the parameter after each step.
        set_grad_none: what ``zero_grad()`` without an argument does (Apex's option; torch's default).
        backend: ``"auto"``, ``"torch"`` or ``"ampkit"``: whose kernels run a bucket that torch's fused op can
            run with the same meaning (see :mod:`ampkit.ops._backend`); None reads
            ``$AMPKIT_FUSED_BACKEND`` (default ``auto``). Optimizers torch has no fused op for always run ampkit's.
    """

    # torch.amp.GradScaler calls step() directly and sets ``grad_scale``/``found_inf`` on the optimizer.
    _step_supports_amp_scaling = True
    # Names of the per-parameter state tensors that must be kept in the accumulate dtype.
    _acc_state_keys: tuple[str, ...] = ()
    # Per-parameter state tensors made on a parameter's first step rather than by ``_init_state`` (SGD's momentum
    # buffer), shaped as the parameter: a loaded one is checked against it too.
    _lazy_state_keys: tuple[str, ...] = ()
    # Whether each element's update depends on that element alone, so a rank can step its shard of a DTensor.
    _updates_shards: bool = True
    # Whether ``_update`` hands GradScaler's tensors to its kernels (see the module docstring); such optimizers
    # keep their step counters on the parameter's device, where the kernels read and advance them.
    _scaler_in_kernel: bool = False
    # Apex's FusedAdam/FusedLAMB counted steps per param group (``group["step"]``, every step that is not skipped),
    # so a parameter without a gradient for a while keeps its group's bias correction; torch and ampkit's own
    # optimizers count per parameter. ``ampkit.compat.optimizers`` sets this for Apex's names.
    _steps_per_group: bool = False
    _initial_step: int = 0  # the group count a fresh group starts from (FusedMixedPrecisionLamb's ``step``)
    # Per-instance caches (dicts) rebuilt on use: neither pickled nor deep-copied.
    _scratch_attrs: tuple[str, ...] = ("_plans", "_host_hypers")
    # torch's fused op that can run a bucket of this optimizer (``torch._fused_adam_`` and kin), or None.
    _torch_op: str | None = None
    _memory_check_deferred: bool = False  # True while the constructor adds its groups (checked once after)

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        master_weights: bool = False,
        set_grad_none: bool = True,
        backend: str | None = None,
    ) -> None:
        if not isinstance(master_weights, bool):
            raise TypeError(f"master_weights must be a bool; got {shown(master_weights)}")
        for key in GROUP_FLAGS:  # named as given, before the groups that take them as defaults
            if key in defaults:
                check_group_flag(key, key, defaults[key])
                if defaults[key] is not None:  # kept as given, as torch keeps it
                    defaults[key] = bool(defaults[key])  # numpy's bool_ would not load back under weights_only
        check_flag("set_grad_none", set_grad_none)
        self.master_weights = master_weights
        self.backend = resolve_backend(backend, type(self).__name__)
        self._plans: dict[int, _BucketPlan] = {}  # id(param group) -> its buckets as last built
        self._host_hypers: dict[int, dict[str, Any]] = {}  # id(param group) -> this step's reads (group_numbers)
        self.set_grad_none = bool(set_grad_none)
        # The constructor's groups are checked for shared memory once, together: group by group (torch adds them one
        # at a time) the check went over every parameter again, quadratic in the groups of per-parameter settings.
        self._memory_check_deferred = True
        super().__init__(params, defaults)
        self._memory_check_deferred = False
        self._refuse_shared_memory()
        self.state = StateMap(self.state)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Reset gradients: to None, or to zeros; ``set_to_none=None`` follows ``set_grad_none`` (Apex)."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, then the group's parameters and hyper-parameters are checked; a group refused is not kept."""
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1])
            if not self._memory_check_deferred:
                self._refuse_shared_memory()
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    def _check_group(self, group: dict[str, Any]) -> None:
        for i, p in enumerate(group["params"]):
            if p.dtype not in KERNEL_DTYPES:
                raise TypeError(
                    f"{type(self).__name__}: params[{i}] has dtype {p.dtype}; expected float32, float64, "
                    "float16 or bfloat16"
                )
            if p.is_meta:
                raise ValueError(
                    f"{type(self).__name__}: params[{i}] is on the meta device, which holds no values to update; "
                    "materialize the model (e.g. model.to_empty(device=...)) before building its optimizer"
                )
            if not is_dense(p):
                raise ValueError(
                    f"{type(self).__name__}: params[{i}] (shape {tuple(p.shape)}, strides {p.stride()}) is "
                    "not dense; fused optimizers update parameters in place over their memory and need "
                    "dense tensors"
                )
        check_group_hypers(group)

    def _refuse_shared_memory(self) -> None:
        """Refuse two parameters over the same memory (one Parameter listed twice in a group, or two tensors viewing
        one storage): the kernels update every parameter of a bucket in parallel, so both updates would race on it,
        where ``torch.optim`` applied one after the other. A tied weight is one Parameter, which torch's
        ``parameters()`` lists once."""
        names = [(g, i) for g, group in enumerate(self.param_groups) for i in range(len(group["params"]))]
        pair = first_overlap([local_shard(p) for group in self.param_groups for p in group["params"]])
        if pair is None:
            return
        (g1, i1), (g2, i2) = names[pair[0]], names[pair[1]]
        raise ValueError(
            f"{type(self).__name__}: param_groups[{g1}]['params'][{i1}] and param_groups[{g2}]['params'][{i2}] share "
            "memory; fused kernels update parameters in parallel, so each must own its memory (tie weights by "
            "assigning one Parameter to both modules, which parameters() lists once)"
        )

    @eager_under_compile
    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], float] | None = None,
        *,
        grad_scale: Tensor | None = None,
        found_inf: Tensor | None = None,
    ) -> float | None:
        """One optimization step under torch's GradScaler contract (as ``torch.optim.Adam(fused=True)``).

        ``grad_scale``/``found_inf`` (keywords, else the attributes GradScaler sets) are one-element tensors.
        A non-zero ``found_inf`` skips the step: parameters, state, step counts and the (scaled) grads are left
        untouched. Otherwise the kernels read each grad divided by ``grad_scale`` and the grads are unscaled in
        place, so code reading ``.grad`` after the step (grad-norm logging, EMA) sees unscaled values.

        A ``grad_scale`` that is not a finite number > 0 would make every gradient inf, NaN or uphill: given as a
        number it is a ValueError; as a tensor (read on the device, never on the host) it skips the step as an
        overflow does, in every fused optimizer alike.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_groups_at_step()
        found_inf = _as_tensor(getattr(self, "found_inf", None) if found_inf is None else found_inf, "found_inf")
        grad_scale = _as_tensor(getattr(self, "grad_scale", None) if grad_scale is None else grad_scale, "grad_scale")
        self._refuse_shared_scaler(ScalerTensors(grad_scale, found_inf))
        if self._scaler_in_kernel:
            if grad_scale is not None:
                found_inf = _skip_on_bad_scale(found_inf, grad_scale)
            elif found_inf is not None:
                found_inf = _skip_flag(found_inf)
            self._step_with_scaler_tensors(ScalerTensors(grad_scale, found_inf))
            return loss
        # These kernels take the skip and the factor as host numbers: both are read in one go (one sync on CUDA),
        # with what the optimizer reads on the host every step anyway (LAMB's and NovoGrad's gradient norms).
        skip, scale, prefetched = read_together(found_inf, grad_scale, self._read_with_scaler(grad_scale))
        if skip or (scale is not None and not valid_scale(scale)):  # as _skip_on_bad_scale decides on the device
            return loss
        self._step_on_host(1.0 if scale is None else 1.0 / scale, prefetched)
        if scale is not None:
            grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
            self._unscale_(grads, grad_scale)
        return loss

    def _refuse_shared_scaler(self, scaler: ScalerTensors) -> None:
        """Refuse a ``grad_scale`` or ``found_inf`` sharing memory with a parameter, its gradient or its state, on every
        route alike: ampkit's kernels refuse it, torch's fused ops took it, and they and the host-read steps read it
        while writing those (the gradients unscaled too), so a scale inside a gradient was read as changed by the step.
        A tensor sharing a scaler's memory starts inside the scaler's storage: each tensor of a group costs one address
        compare with that span, and only one starting there is compared in full. A scaler whose storage is its one
        element (GradScaler's, or a step count or a one-element parameter passed by mistake) is looked up among the
        one-element tensors of each group's kept buckets instead (:meth:`_BucketPlan.one_element_addresses`), so the
        usual step pays no pass over its tensors; a group with none kept is compared tensor by tensor."""
        spans, singles = [], []
        for name, t in zip(ScalerTensors._fields, scaler, strict=True):
            if t is None:
                continue
            t = local_shard(t)
            storage = t.untyped_storage()
            begin, size = storage.data_ptr(), storage.nbytes()
            (spans if size > t.element_size() else singles).append((name, t, begin, begin + size))
        if not spans and not singles:
            return
        addresses = [begin for _, _, begin, _ in singles]
        for g, group in enumerate(self.param_groups):
            if spans or self._may_hold_scaler(group, addresses):
                self._refuse_group_overlap(g, group, spans + singles)

    def _may_hold_scaler(self, group: dict[str, Any], addresses: list[int]) -> bool:
        """Whether one of ``group``'s parameters, gradients or state tensors may start at one of ``addresses`` (those
        of one-element scalers): from the group's kept buckets where they still fit it, else True."""
        plan = self._plans.get(id(group))
        params = group["params"]
        if plan is None or not plan.holds_state_of(params, self.state):
            return True
        held = plan.one_element_addresses()
        for i in plan.one_element_params():  # read anew: ``p.data = ...`` and each step's gradient move them
            p, grad = local_shard(params[i]), params[i].grad
            if p.data_ptr() in addresses or (grad is not None and grad.layout != torch.strided):
                return True  # a sparse gradient has no address: the step refuses it as its bucket is built
            if grad is not None and local_shard(grad).data_ptr() in addresses:
                return True
        return not held.isdisjoint(addresses)

    def _refuse_group_overlap(self, g: int, group: dict[str, Any], spans: list[tuple[str, Tensor, int, int]]) -> None:
        """Raise naming the first tensor of ``group`` (its parameters, gradients, state) that starts inside one of
        ``spans`` (a scaler's storage) and shares memory with that scaler."""
        for i, p in enumerate(group["params"]):
            state = self.state.get(p)
            held = [p, p.grad, *state.values()] if state else [p, p.grad]
            for k, other in enumerate(held):
                if not isinstance(other, Tensor):
                    continue
                other = local_shard(other)
                try:
                    address = other.data_ptr()
                except RuntimeError:  # no storage (a sparse gradient, refused as its bucket is built)
                    continue
                for name, t, begin, end in spans:
                    if begin <= address < end and shares_memory(t, other):
                        what = ("", "'s .grad")[k] if k < 2 else f"'s state[{shown(list(state)[k - 2])}]"
                        raise RuntimeError(
                            f"{type(self).__name__}.step(): {name} shares memory with param_groups[{g}]['params']"
                            f"[{i}]{what}, which the step writes (torch: some elements of the input tensor and "
                            f"the written-to tensor refer to a single memory location); pass a {name} of its own, "
                            "e.g. its clone()"
                        )

    def _check_groups_at_step(self) -> None:
        """:func:`check_group_at_step` on every group, before anything is read or stepped."""
        owner = type(self).__name__
        for index, group in enumerate(self.param_groups):
            check_group_at_step(owner, index, group)

    def _read_with_scaler(self, grad_scale: Tensor | None) -> Tensor | None:
        """Values the step reads on the host anyway (a vector on the device, computed with the gradients divided by
        ``grad_scale``), read in the same transfer as GradScaler's two scalars: one synchronization on CUDA, not
        two or more. None for none."""
        return None

    def _step_on_host(self, grad_factor: float, prefetched: Tensor | None) -> None:
        """The step of an optimizer whose kernels take host numbers; ``prefetched`` is ``_read_with_scaler``'s
        vector, read (float64, on the host). The groups are checked already: by ``step`` or ``step_with_grad_factor``,
        once a step."""
        self._step_by_factor(grad_factor)

    @staticmethod
    def _unscale_(grads: list[Tensor], grad_scale: Tensor, found_inf: Tensor | None = None) -> None:
        """Divide ``grads`` by ``grad_scale`` in place (torch's fused optimizers divide, they do not multiply),
        unless ``found_inf`` is non-zero; decided on the device, with no host read."""
        by_device: dict[torch.device, list[Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        for device, group in by_device.items():
            divisor = _scalar_on(grad_scale, device)
            if found_inf is not None:
                divisor = torch.where(_scalar_on(found_inf, device) != 0, 1.0, divisor)
            torch._foreach_div_(group, divisor)

    def _step_with_scaler_tensors(self, scaler: ScalerTensors) -> None:
        """Every bucket's kernel gets ``scaler`` on its device: it skips or unscales there, with no host read."""
        on_device: dict[torch.device, ScalerTensors] = {}
        copied: list[Tensor] = []
        for group, buckets in self._all_buckets():
            factor = -1.0 if group.get("maximize", False) else 1.0
            self._steps_from_group(group, buckets)
            for bucket in buckets:
                here = on_device.get(bucket.device)
                if here is None:
                    here = on_device[bucket.device] = scaler.to(bucket.device)
                self._update(group, bucket, factor, here)
                copied += bucket.copied_grads
            self._advance_group_step(group, scaler.found_inf)
        if copied and scaler.grad_scale is not None:  # the kernels unscaled the copies they read
            self._unscale_(copied, scaler.grad_scale, scaler.found_inf)

    @eager_under_compile
    @torch.no_grad()
    def step_with_grad_factor(self, grad_factor: float) -> None:
        """One step with every gradient multiplied by ``grad_factor`` inside the kernel (unscale x clip).

        The gradients themselves are not modified. Used by ``step`` and by ``ampkit.ops.pipeline``.

        Raises:
            ValueError: if ``grad_factor`` is NaN or infinite (every weight would become NaN); a host number,
                checked for free.
        """
        check_grad_factor(grad_factor)
        self._check_groups_at_step()
        self._step_by_factor(grad_factor)

    def _step_by_factor(self, grad_factor: float) -> None:
        """:meth:`step_with_grad_factor` past its checks: every bucket's kernel with ``grad_factor``."""
        for group, buckets in self._all_buckets():
            factor = -grad_factor if group.get("maximize", False) else grad_factor
            self._steps_from_group(group, buckets)
            for bucket in buckets:
                self._update(group, bucket, factor)
            self._advance_group_step(group)

    def _steps_from_group(self, group: dict[str, Any], buckets: list[Bucket]) -> None:
        """Under per-group counting, each parameter about to step starts from its group's count (the kernels then
        advance it with the group's), however many steps it sat out without a gradient."""
        if not self._steps_per_group:
            return
        count = group.get("step", self._initial_step)
        for bucket in buckets:
            for state in bucket.states:
                if isinstance(count, Tensor):
                    state["step"].copy_(count)
                else:
                    state["step"].fill_(float(count))

    def _advance_group_step(self, group: dict[str, Any], found_inf: Tensor | None = None) -> None:
        """Under per-group counting, count the step just taken: one, or none where ``found_inf`` made the kernels
        skip it (counted on the device then, with no host read)."""
        if self._steps_per_group:
            count = group.get("step", self._initial_step)
            group["step"] = count + 1 if found_inf is None else count + (found_inf == 0).reshape(())

    def _all_buckets(self) -> list[tuple[dict[str, Any], list[Bucket]]]:
        """Every group with its buckets, all built before any is stepped: a gradient refused in a later group
        (``_check_grad``) then stops the step before an earlier group's parameters have moved. The start of a step's
        pass over the groups: the host numbers read by the last one (:meth:`group_numbers`) are dropped."""
        self._new_read_pass()
        return [(group, self._buckets(group)) for group in self.param_groups]

    def _new_read_pass(self) -> None:
        """Start a pass over the groups that reads their values anew (:meth:`group_numbers`, :meth:`_state_inputs`): a
        step's, or one that creates state outside a step (``share_memory``, ``load_state_dict``)."""
        self._host_hypers = {}

    def _state_inputs(self, group: dict[str, Any], keys: tuple[str, ...]) -> list[Any]:
        """The group's ``keys`` a parameter's state is made from (:meth:`_init_state`), read once a pass however many
        of its parameters get a state then: a flag as it is, a tensor as its host number (:func:`host_numbers`)."""
        known = self._host_hypers.setdefault(id(group), {})
        missing = [key for key in keys if key not in known]
        if missing:
            known.update(zip(missing, host_numbers([group[key] for key in missing]), strict=True))
        return [known[key] for key in keys]

    def group_numbers(self, group: dict[str, Any], keys: tuple[str, ...]) -> list[float]:
        """The group's ``keys`` as host numbers (``betas`` as its two), in order: each read once a step however many
        buckets the group has, those not read yet this step together (:func:`host_numbers`: one transfer for the
        tensors on a GPU), where each bucket read each tensor again, a host sync apiece. A tensor changed in place (a
        scheduler's ``lr.fill_``) is read anew at the next step's :meth:`_all_buckets`."""
        plain: list[Any] = []
        for key in keys:  # the usual group, of Python numbers: as they are, with nothing to cache (a quarter the time)
            value = group[key]
            if key == "betas":
                plain += value
            else:
                plain.append(value)
        if not any(isinstance(value, Tensor) for value in plain):
            return plain
        known = self._host_hypers.setdefault(id(group), {})
        missing = [key for key in keys if key not in known]
        if missing:
            values = [v for key in missing for v in (group[key] if key == "betas" else (group[key],))]
            read = iter(host_numbers(values))
            known.update((key, (next(read), next(read)) if key == "betas" else next(read)) for key in missing)
        return [n for key in keys for n in (known[key] if key == "betas" else (known[key],))]

    def _buckets(self, group: dict[str, Any]) -> list[Bucket]:
        """The group's parameters with gradients in buckets of one (param dtype, grad dtype, device), state created
        on a parameter's first step. The buckets are kept between steps and reused, with this step's gradients,
        while the group holds the same parameters, every gradient has the dtype and layout it had, and the state is
        the same (see ``_BucketPlan``): building them is most of the Python a step runs."""
        params = group["params"]
        grads = [p.grad for p in params]
        layout = [
            None if g is None else (g.dtype, g.shape, g.stride(), p.dtype, p.stride())
            for p, g in zip(params, grads, strict=True)
        ]
        if type(self.state) is not StateMap:  # assigned by hand (``optimizer.state = defaultdict(dict)``)
            self.state = StateMap(self.state)
        plan = self._plans.get(id(group))
        if plan is not None and plan.fits(params, layout, self.state):
            for bucket, slots in zip(plan.buckets, plan.slots, strict=True):
                bucket.grads = [local_shard(grads[i]) for i in slots] if bucket.sharded else [grads[i] for i in slots]
                if bucket.has_master:
                    bucket.adopt_outside_writes()
            return plan.buckets
        buckets, slots = self._build_buckets(group, grads)
        for bucket in buckets:
            if bucket.has_master:
                bucket.adopt_outside_writes()  # the versions a kept plan compares with next step
        if not any(b.copied_grads for b in buckets):  # a copied gradient is made anew each step
            self._plans[id(group)] = _BucketPlan(list(params), layout, self.state, self.state.resets, buckets, slots)
        else:  # kept without its buckets, whose gradient copies would stay alive until the next step
            self._plans[id(group)] = _BucketPlan(list(params), layout, self.state, self.state.resets, [], [], False)
        return buckets

    def _build_buckets(self, group: dict[str, Any], grads: list[Tensor | None]) -> tuple[list[Bucket], list[list[int]]]:
        """The buckets of ``_buckets``, and for each the indices of its parameters in ``group["params"]``."""
        buckets: dict[tuple[torch.dtype, torch.dtype, torch.device, bool], Bucket] = {}
        slots: dict[tuple[torch.dtype, torch.dtype, torch.device, bool], list[int]] = {}
        dtensor = dtensor_type()
        for index, (p, grad) in enumerate(zip(group["params"], grads, strict=True)):
            g = grad
            if g is None:
                continue
            sharded = dtensor is not None and isinstance(p, dtensor)
            if sharded and not self._updates_shards:
                self.refuse_shards([p])
            if g.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            self._check_grad(group, index, p, g)
            if g.dtype != p.dtype and not (g.dtype == torch.float32 and p.dtype in HALF_DTYPES):
                g = g.to(p.dtype)
            if g.stride() != p.stride():
                g = torch.empty_like(p, dtype=g.dtype).copy_(g)
            state = self.state[p]
            if len(state) == 0:
                self._init_state(p, state, group)
            if self.master_weights and p.dtype in HALF_DTYPES and "master_param" not in state:
                # a fresh state, or one loaded without it (saved without master weights, by torch.optim)
                state["master_param"] = p.detach().to(torch.float32, copy=True)
            key = (p.dtype, g.dtype, p.device, sharded)
            bucket = buckets.get(key)
            if bucket is None:
                bucket = buckets[key] = Bucket(has_master="master_param" in state, sharded=sharded)
                slots[key] = []
            if ("master_param" in state) != bucket.has_master:
                raise RuntimeError(
                    f"{type(self).__name__}: some {p.dtype} params have fp32 master copies and some do not; "
                    "load a state_dict saved with the same master_weights setting"
                )
            bucket.params.append(local_shard(p) if sharded else p)
            if sharded:
                bucket.whole_params.append(p)
            bucket.grads.append(local_shard(g) if sharded else g)
            bucket.states.append(state)
            slots[key].append(index)
            if g is not grad:
                bucket.copied_grads.append(grad)
        return list(buckets.values()), list(slots.values())

    def _check_grad(self, group: dict[str, Any], index: int, param: Tensor, grad: Tensor) -> None:
        """Refuse a ``.grad`` that torch's own assignment check would have (one set through ``.grad.data``, as Apex-era
        code does): of another shape, the step broadcast it over the parameter (or the kernels read past its end); of a
        dtype that is not floating point, it was cast (a complex one losing its imaginary part)."""
        if grad.shape == param.shape and grad.dtype in KERNEL_DTYPES:
            return
        group_index = next(i for i, g in enumerate(self.param_groups) if g is group)
        where = f"{type(self).__name__}: param_groups[{group_index}]['params'][{index}]"
        if grad.shape != param.shape:
            raise RuntimeError(
                f"{where} has shape {tuple(param.shape)} but its .grad has shape {tuple(grad.shape)}; a gradient "
                "must have its parameter's shape"
            )
        raise TypeError(f"{where} has a .grad of dtype {grad.dtype}; expected float32, float64, float16 or bfloat16")

    def _init_state(self, param: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        raise NotImplementedError

    def refuse_shards(self, tensors: Sequence[Tensor]) -> None:
        """Refuse sharded (FSDP2's DTensor) ``tensors`` where this optimizer's step takes norms over whole tensors,
        which no rank holds (LAMB, NovoGrad, AdamP): each rank's shard would get its own trust ratio or denominator."""
        dtensor = dtensor_type()
        if not self._updates_shards and dtensor is not None and any(isinstance(t, dtensor) for t in tensors):
            raise RuntimeError(
                f"{type(self).__name__} cannot step sharded (FSDP2/DTensor) parameters: its step takes norms over "
                "whole tensors, which no rank holds; use FusedAdam, FusedSGD or another element-wise optimizer"
            )

    def _routes_to_torch(
        self, group: dict[str, Any], bucket: Bucket, grad_factor: float, scaler: ScalerTensors
    ) -> bool:
        """Whether torch's fused op runs ``bucket``: the backend allows it, torch has the op on this device, and the
        op computes what ampkit's kernel would: no fp32 masters inside the optimizer, gradients and state in the
        parameter's dtype, no factor folded into the gradient (a clip coefficient; ``-1`` is ``maximize``), no
        per-group step count (Apex's classes) and the group's options within the op's (``_torch_can_run``)."""
        if self.backend == "ampkit" or self._torch_op is None or self._steps_per_group or bucket.has_master:
            return False
        if grad_factor not in (1.0, -1.0):
            return False
        param = bucket.params[0]
        if bucket.grads[0].dtype != param.dtype or not self._torch_can_run(group, param):
            return False
        if not torch_has_fused_op(self._torch_op, param.device.type):
            return False
        if self.backend == "torch" or param.device.type != "cpu":
            return True
        return self._cpu_prefers_torch(bucket, scaler)

    def _torch_can_run(self, group: dict[str, Any], param: Tensor) -> bool:
        """Whether torch's op has every option of ``group`` and keeps this optimizer's state dtype for ``param``."""
        return False

    def _cpu_prefers_torch(self, bucket: Bucket, scaler: ScalerTensors) -> bool:
        """Under ``auto`` on the CPU: whether torch's op measured faster than ampkit's kernel for such a bucket."""
        return False

    def _update(
        self, group: dict[str, Any], bucket: Bucket, grad_factor: float, scaler: ScalerTensors = NO_SCALER
    ) -> None:
        """Run the kernels on ``bucket``; ``scaler`` is passed only where ``_scaler_in_kernel`` is set."""
        raise NotImplementedError

    def _step_device(self, param: Tensor) -> torch.device:
        """Where ``state["step"]`` lives: the parameter's device when the kernels advance it, else the host."""
        return param.device if self._scaler_in_kernel else torch.device("cpu")

    def __getstate__(self) -> dict[str, Any]:
        """torch's state (defaults, state, param groups) and this optimizer's own options (``master_weights``,
        ``backend``, ...), so a deep copy or a pickle steps as the original; not torch's hooks, nor cached buckets."""
        state = super().__getstate__()
        for key, value in self.__dict__.items():
            if (
                key not in state
                and key not in self._scratch_attrs
                and not key.startswith(("_optimizer_", "_zero_grad"))
            ):
                state[key] = value
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A state dict from the torch.optim counterpart lacks our options (e.g. ``adam_w_mode``): they keep
        # this optimizer's constructor values.
        defaults = state.get("defaults", self.__dict__.get("defaults", {}))
        had_differentiable = "differentiable" in defaults
        super().__setstate__(state)
        if not had_differentiable:
            # torch adds its own ``differentiable`` option, which these steps do not have: copied into the groups
            # below, it made a resumed, deep-copied or unpickled optimizer's state_dict() differ from the original's.
            self.defaults.pop("differentiable", None)
        self.state = StateMap(self.state)
        for key in self._scratch_attrs:
            setattr(self, key, {})
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def _state_in_acc_dtype(self, key: str, saved: dict[str, Any]) -> bool:
        """Whether ``state[key]`` lives in the accumulate dtype (else in the param dtype, as torch loads it)."""
        return key == "master_param" or key in self._acc_state_keys

    def _adopt_group_step(self, param: Tensor, state: dict[str, Any], group: dict[str, Any]) -> bool:
        """A state dict written by Apex's fused optimizers keeps the step count in the param group, not per
        parameter: each parameter that keeps its own count here takes the group's (0 where Apex had none)."""
        fresh: dict[str, Any] = {}
        self._init_state(param, fresh, group)
        if "step" not in fresh:
            return False
        saved = group.get("step", 0)
        count = float(saved.reshape(-1)[0]) if isinstance(saved, Tensor) else float(saved)
        state["step"] = torch.tensor(count, dtype=torch.float32).to(self._step_device(param))
        return True

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader, then state is put back in the accumulate dtype (torch casts it to the param dtype).

        A state dict saved by the ``torch.optim`` counterpart loads as is; fp32 master copies and fp32
        moments of fp16/bf16 parameters keep their precision. One saved by Apex's fused optimizer (the step
        count in the param group) resumes at its step. One that does not fit (another optimizer's state, a
        state missing a moment, a hyper-parameter out of range) is refused here, naming what is wrong, and the
        optimizer keeps the state it had.
        """
        # torch's hooks, run around the whole load rather than inside torch's part of it: ampkit's fix-ups read the
        # state dict a pre-hook returns (torch's way to remap a checkpoint), and post-hooks see the loaded state.
        tensor_keys = ("master_param", *self._acc_state_keys, *self._lazy_state_keys)
        if not isinstance(state_dict, Mapping):
            check_state_dict_layout(type(self).__name__, state_dict, tensor_keys)  # names what it got
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            returned = pre_hook(self, state_dict)
            if returned is not None:
                state_dict = returned
        check_state_dict_layout(type(self).__name__, state_dict, tensor_keys)
        refuse_reordered_names(type(self).__name__, state_dict["param_groups"], self.param_groups)
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the state dict has {len(state_dict['param_groups'])} param "
                f"groups, this optimizer {len(self.param_groups)}: it was saved with other param groups"
            )
        for i, group in enumerate(state_dict["param_groups"]):
            try:
                check_group_hypers(group)
            except ValueError as exc:  # its type kept: a saved lr of "0.1" is a TypeError as well
                raise type(exc)(f"{type(self).__name__}.load_state_dict: saved param_groups[{i}]: {exc}") from None
        before = (self.state, self.param_groups)
        self._new_read_pass()  # the fresh states _init_state builds to check the loaded ones read the groups once
        try:
            with _load_hooks_held(self):
                self._load_state(state_dict)
            self._check_loaded_state()
        except BaseException:
            self.state, self.param_groups = before  # torch's loader built new containers: the old ones are intact
            raise
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _check_loaded_state(self) -> None:
        """Each loaded parameter state holds what this optimizer's step reads, shaped as its parameter."""
        for g, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                state = self.state.get(p)
                if not state:
                    continue
                for key in [k for k, v in state.items() if v is None]:  # torch's "not created yet"
                    del state[key]
                if "master_param" in state and p.dtype not in HALF_DTYPES:
                    del state["master_param"]  # a float32/64 parameter is its own master
                fresh: dict[str, Any] = {}
                self._init_state(p, fresh, group)
                where = f"{type(self).__name__}.load_state_dict: the state of param_groups[{g}]['params'][{j}]"
                missing = sorted(k for k in fresh if k not in state and k != "step")
                if missing:
                    raise ValueError(
                        f"{where} lacks {missing} (it has {sorted(state)}): it was saved by another optimizer or "
                        "with other options"
                    )
                ours = {*fresh, *self._lazy_state_keys, *self._acc_state_keys, "master_param"}
                theirs = sorted(k for k in state if k != "step")
                if theirs and not ours.intersection(theirs):  # SGD's momentum is made at the first step: none missing
                    raise ValueError(
                        f"{where} holds {theirs}, none of which {type(self).__name__} keeps: it was saved by another "
                        "optimizer"
                    )
                shapes = {key: value.shape for key, value in fresh.items() if isinstance(value, Tensor)}
                for key in ("master_param", *self._lazy_state_keys):  # made at the first step, not by _init_state
                    shapes.setdefault(key, p.shape)
                for key, shape in shapes.items():
                    loaded = state.get(key)
                    if isinstance(loaded, Tensor) and loaded.shape != shape:
                        raise ValueError(
                            f"{where} has '{key}' of shape {tuple(loaded.shape)}, its parameter needs "
                            f"{tuple(shape)}: the state dict is of another model"
                        )

    def _load_state(self, state_dict: dict[str, Any]) -> None:
        """torch's loader and the dtype and step-count fix-ups of :meth:`load_state_dict` (subclasses add theirs)."""
        super().load_state_dict(state_dict)
        saved_groups = state_dict["param_groups"]
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            adopted = False
            counts: list[float] = []  # the per-parameter step counts saved (torch.optim's, ampkit's own names')
            for p, pid in zip(group["params"], saved["params"], strict=True):
                incoming = state_dict["state"].get(pid)
                if incoming is None or p not in self.state:
                    continue
                state = self.state[p]
                for key, value in incoming.items():
                    if key == "step":
                        step = torch.as_tensor(value, dtype=torch.float32).detach().clone().reshape(())
                        state["step"] = step.to(self._step_device(p))
                        counts.append(float(step))
                    elif self._state_in_acc_dtype(key, incoming):
                        if isinstance(value, Tensor):
                            state[key] = value.detach().to(device=p.device, dtype=acc_dtype(p), copy=True)
                if "step" not in state:
                    adopted = self._adopt_group_step(p, state, group) or adopted
            if adopted and not self._steps_per_group:
                group.pop("step", None)  # the count now lives with each parameter
            if self._steps_per_group and "step" not in saved and counts:
                # Counted per group (Apex's names) from a checkpoint that counted per parameter: the group has
                # taken as many steps as its most-stepped parameter. Without this the count restarted at 0 and
                # the first steps after the resume ran with step 1's bias correction.
                group["step"] = int(max(counts))
