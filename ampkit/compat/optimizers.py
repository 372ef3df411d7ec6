"""``apex.optimizers`` names, resolved lazily to ampkit's fused optimizers in :mod:`ampkit.ops.optimizers`.

Apex's ``FusedAdam``/``FusedLAMB``/... and Ascend's ``FusedAdadelta``/``FusedAdamP``/``FusedRMSprop``/
``FusedRMSpropTF`` keep their names and constructor arguments; importing this module does not load the
kernels, touching a name does. Each name is a subclass that also sets the attributes Apex's ``__init__`` set
and that subclassing code reads (fairseq's ``FusedAdamV2`` drives its own step through
``multi_tensor_applier(self.multi_tensor_adam, self._dummy_overflow_buf, [g, p, m, v], ..., self.adam_w_mode,
...)``): the ``amp_C`` ops, the skip buffer, the integer mode flags. Apex's FusedAdam, FusedLAMB and
FusedMixedPrecisionLamb counted steps per param group: their names here do the same.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ampkit.missing_name import missing_name
from ampkit.wording import shown

_TARGET_MODULE = "ampkit.ops.optimizers"
_APEX_NAMES = (
    "FusedAdam",
    "FusedSGD",
    "FusedLAMB",
    "FusedNovoGrad",
    "FusedAdagrad",
    "FusedAdadelta",
    "FusedAdamP",
    "FusedRMSprop",
    "FusedRMSpropTF",
    "FusedMixedPrecisionLamb",
)
# Apex's first API (its first FusedAdam's wrapper), kept by BERT fine-tuning scripts: see legacy_fused_adam.
_LEGACY_NAMES = ("FP16_Optimizer",)
__all__ = [*_APEX_NAMES, *_LEGACY_NAMES]

# Apex counted these optimizers' steps per param group: their Apex names do the same.
_GROUP_STEP_NAMES = ("FusedAdam", "FusedLAMB", "FusedMixedPrecisionLamb", "FusedNovoGrad")

Arguments = dict[str, Any]

# What Apex's ``__init__`` set on each optimizer, from its constructor arguments (besides ``_dummy_overflow_buf``
# and the ``amp_C`` ops in ``_AMP_C_OPS``).
_APEX_ATTRIBUTES: dict[str, dict[str, Callable[[Arguments], Any]]] = {
    "FusedAdam": {
        "adam_w_mode": lambda a: int(bool(a["adam_w_mode"])),
        "capturable": lambda a: a["capturable"],
    },
    "FusedSGD": {
        "materialize_master_grads": lambda a: a["materialize_master_grads"],
        "most_recent_scale": lambda a: 1.0,
        "scale_set_by_backward": lambda a: False,
    },
    "FusedLAMB": {
        "adam_w_mode": lambda a: int(bool(a["adam_w_mode"])),
        "use_nvlamb": lambda a: a["use_nvlamb"],
    },
    "FusedNovoGrad": {
        "moment_mode": lambda a: 0 if a["reg_inside_moment"] else 1,
    },
    "FusedAdagrad": {
        "adagrad_w_mode": lambda a: int(bool(a["adagrad_w_mode"])),
    },
    "FusedMixedPrecisionLamb": {
        "adam_w_mode": lambda a: int(bool(a["adam_w_mode"])),
        "use_nvlamb": lambda a: a["use_nvlamb"],
        "param_groups_full_precision": lambda a: [],
    },
}

# Apex's attribute -> the ``amp_C`` op it held.
_AMP_C_OPS: dict[str, dict[str, str]] = {
    "FusedAdam": {
        "multi_tensor_adam": "multi_tensor_adam",
        "multi_tensor_adam_capturable": "multi_tensor_adam_capturable",
        "multi_tensor_adam_capturable_master": "multi_tensor_adam_capturable_master",
    },
    "FusedSGD": {"multi_tensor_sgd": "multi_tensor_sgd"},
    "FusedLAMB": {"multi_tensor_l2norm": "multi_tensor_l2norm", "multi_tensor_lamb": "multi_tensor_lamb"},
    "FusedNovoGrad": {"multi_tensor_novograd": "multi_tensor_novograd"},
    "FusedAdagrad": {"multi_tensor_adagrad": "multi_tensor_adagrad"},
    "FusedMixedPrecisionLamb": {
        "multi_tensor_l2norm": "multi_tensor_l2norm_mp",
        "multi_tensor_lamb": "multi_tensor_lamb_mp",
    },
}


def _param_groups_master(self: torch.optim.Optimizer) -> list[dict[str, list[torch.Tensor | None]]]:
    """Apex's FusedAdam list of fp32 masters per group (None where a parameter has none yet or needs none)."""
    return [
        {"params": [self.state.get(p, {}).get("master_param") for p in group["params"]]} for group in self.param_groups
    ]


# FusedAdam.step arguments of Apex's first FusedAdam, which Apex's last one still took only to refuse them.
_FUSED_ADAM_LEGACY_STEP_ARGUMENTS = ("grads", "output_params", "scale", "grad_norms")


def _fused_adam_step(base: type) -> Callable[..., Any]:
    def step(self: Any, closure: Any = None, *legacy: Any, **kwargs: Any) -> Any:
        """One step, as ``base.step``; Apex's deprecated ``grads``/``output_params``/``scale``/``grad_norms`` are
        refused with Apex's message (not a TypeError about an unexpected argument)."""
        given = list(legacy) + [kwargs.pop(name, None) for name in _FUSED_ADAM_LEGACY_STEP_ARGUMENTS]
        if any(value is not None for value in given):
            raise RuntimeError(
                "FusedAdam has been updated.  Simply initialize it identically to torch.optim.Adam, and call "
                "step() with no arguments."
            )
        return _unhooked(base.step)(self, closure, **kwargs)

    return step


def _fused_sgd_step(base: type) -> Callable[..., Any]:
    def step(self: Any, closure: Any = None, **kwargs: Any) -> Any:
        """One step, as ``base.step``, each gradient divided by ``most_recent_scale`` (the scale Apex's amp backward
        recorded there for a FusedSGD with ``materialize_master_grads=False``; 1 otherwise), which is then reset to 1
        with ``scale_set_by_backward`` to False, as Apex's step did: a scale a script recorded was ignored, and the
        step took its gradients still scaled."""
        scale = self.most_recent_scale
        if kwargs and scale != 1.0:  # refused before the reset below: the recorded scale stays for a corrected call
            raise ValueError(
                f"FusedSGD.step got {sorted(kwargs)} while most_recent_scale={shown(scale)} says the gradients are "
                "scaled by it: unscale them one way (set most_recent_scale to 1.0, or pass no grad_scale)"
            )
        try:
            if scale == 1.0:
                return _unhooked(base.step)(self, closure, **kwargs)
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self.step_with_grad_factor(1.0 / scale)
            return loss
        finally:
            self.most_recent_scale, self.scale_set_by_backward = 1.0, False

    return step


def _unhooked(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` without the wrapper torch puts around a class's ``step`` (hooks, profiler record) when the class's first
    optimizer is built: called from the subclass's own wrapped ``step``, ``base``'s hooks ran a second time once any
    ``base`` had been built in the process, and a pre-hook that replaces the arguments got them twice."""
    return step.__wrapped__ if getattr(step, "hooked", False) else step


def _first_fused_adam_when_asked(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``FusedAdam(..., max_grad_norm=1.0)`` and the like: an argument only Apex's first FusedAdam took builds
    that one (:class:`~ampkit.compat.legacy_fused_adam.LegacyFusedAdam`), as the scripts written for it expect."""
    from ampkit.compat import legacy_fused_adam

    if any(name in kwargs for name in legacy_fused_adam.LEGACY_ONLY_ARGUMENTS):
        return legacy_fused_adam.LegacyFusedAdam(*args, **kwargs)
    return object.__new__(cls)


def _apex_class(name: str, base: type) -> type:
    """``base`` under Apex's name, setting Apex's attributes after ``base.__init__``."""
    signature = inspect.signature(base.__init__)
    recipes = _APEX_ATTRIBUTES.get(name, {})
    amp_c = importlib.import_module("ampkit.compat.amp_c")
    ops = {attribute: getattr(amp_c, op_name) for attribute, op_name in _AMP_C_OPS.get(name, {}).items()}

    @functools.wraps(base.__init__)  # help() and inspect show Apex's arguments
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        for attribute, recipe in recipes.items():
            setattr(self, attribute, recipe(bound.arguments))
        for attribute, op in ops.items():
            setattr(self, attribute, op)

    namespace: dict[str, Any] = {
        "__init__": __init__,
        "_dummy_overflow_buf": _SkipFlagOnTheParamsDevice(),
        "__module__": __name__,
        "__doc__": f"Apex's ``{name}``: :class:`ampkit.ops.optimizers.{name}` with Apex's attributes"
        + (", counting steps per param group as Apex did." if name in _GROUP_STEP_NAMES else "."),
    }
    if name in _GROUP_STEP_NAMES:
        namespace["_steps_per_group"] = True
    if name == "FusedSGD":
        namespace["step"] = _fused_sgd_step(base)
    if name == "FusedAdam":
        namespace["param_groups_master"] = property(_param_groups_master)
        namespace["step"] = _fused_adam_step(base)
        namespace["__new__"] = _first_fused_adam_when_asked
    return type(name, (base,), namespace)


class _SkipFlagOnTheParamsDevice:
    """Apex's ``_dummy_overflow_buf``, the one-element int32 flag subclasses hand ``amp_C`` with their tensors: on the
    parameters' device as they are now (Apex's was ``torch.cuda.IntTensor([0])``), so an optimizer built before
    ``model.cuda()`` gives the kernels a flag on the GPU, not one on the CPU beside CUDA tensors. Moved once, its value
    kept; one a script assigns is its own, left where it is."""

    def __get__(self, optimizer: Any, owner: type | None = None) -> Any:
        if optimizer is None:
            return self
        state = optimizer.__dict__
        buf = state.get("_apex_skip_flag")
        if state.get("_apex_skip_flag_assigned"):
            return buf
        first = next((p for group in optimizer.param_groups for p in group["params"]), None)
        device = torch.device("cpu") if first is None else first.device
        if buf is None or buf.device != device:
            buf = state["_apex_skip_flag"] = (
                torch.zeros(1, dtype=torch.int32, device=device) if buf is None else buf.to(device)
            )
        return buf

    def __set__(self, optimizer: Any, value: Any) -> None:
        optimizer.__dict__["_apex_skip_flag"] = value
        optimizer.__dict__["_apex_skip_flag_assigned"] = True


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise missing_name(
            f"module {__name__!r} has no attribute {name!r}; Apex optimizer names are {__all__}",
            "apex.optimizers",
            name,
        )
    if name in _LEGACY_NAMES:
        value = getattr(importlib.import_module("ampkit.compat.legacy_fused_adam"), name)
    else:
        value = _apex_class(name, getattr(importlib.import_module(_TARGET_MODULE), name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
