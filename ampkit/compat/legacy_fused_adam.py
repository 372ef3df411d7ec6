"""Apex's first fused-optimizer API (2018-2019), which BERT fine-tuning scripts of that time were written against::

    from apex.optimizers import FP16_Optimizer, FusedAdam
    optimizer = FusedAdam(params, lr=lr, bias_correction=False, max_grad_norm=1.0)
    optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True)  # or static_loss_scale=128.0
    model.half()
    ...
    optimizer.backward(loss); optimizer.step(); optimizer.zero_grad()

Apex later moved both to ``apex.contrib.optimizers`` and gave ``apex.optimizers.FusedAdam`` another signature.
Through the shim, ``apex.optimizers.FusedAdam`` built with an argument only the first one had (``max_grad_norm``,
``eps_inside_sqrt``, ``use_mt``, ``amp_scale_adjustment``) is :class:`LegacyFusedAdam`, and
``apex.optimizers.FP16_Optimizer`` is :class:`FP16_Optimizer`.

The update is Apex's first kernel's, in float32: with ``g = grad / combined_scale``, ``m = b1 m + (1 - b1) g``,
``v = b2 v + (1 - b2) g^2``, ``denom = sqrt(v) + eps`` (``sqrt(v + eps)`` with ``eps_inside_sqrt``),
``p -= step_size * (m / denom + weight_decay * p)`` where ``step_size = lr * sqrt(1 - b2^t) / (1 - b1^t)``
(``lr`` without bias correction). ``combined_scale`` is ``scale``, raised by ``max_grad_norm`` clipping to
``scale * (norm / scale + 1e-6) / max_grad_norm`` when that ratio exceeds 1 (the norm is of the scaled grads).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ampkit.amp.scaler import float32_scale, interval_option, positive_option
from ampkit.compat._wrapped_optimizer import PromotedOptimizerAttributes
from ampkit.compat._wrapper_state import require_wrapper_keys
from ampkit.compat.fp16_utils._options import checked_options
from ampkit.compat.fp16_utils.loss_scaler import next_dynamic_scale
from ampkit.ops._switches import checked_switch
from ampkit.ops.host_values import host_numbers
from ampkit.ops.multi_tensor import unscale_l2norm
from ampkit.ops.optimizers._base import (
    check_betas,
    check_group_at_step,
    check_group_hypers,
    check_hyper,
)
from ampkit.ops.optimizers._torch_keywords import check_torch_keywords
from ampkit.wording import shown

# Constructor arguments of the first FusedAdam that its successor does not take: any of them selects this class.
LEGACY_ONLY_ARGUMENTS = ("eps_inside_sqrt", "max_grad_norm", "use_mt", "amp_scale_adjustment")


@torch.no_grad()
def first_adam_update(
    p: torch.Tensor,
    p_copy: torch.Tensor | None,
    m: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    grad_scale: float,
    step: int,
    mode: int,
    bias_correction: int = 1,
    decay: float = 0.0,
) -> None:
    """One tensor's update by Apex's first FusedAdam kernel (``fused_adam_cuda.adam``'s arguments), in float32
    whatever the tensors' dtypes: ``p``, ``m``, ``v`` in place, the new weights copied into ``p_copy`` when it
    is given and not empty. ``mode`` 0 adds ``eps`` inside the square root, 1 outside."""
    _check_first_adam_args(p, p_copy, m, v, g, step, bias_correction)
    step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step) if bias_correction else lr
    weight = p.float()
    grad = g.float().reshape(p.shape) / grad_scale
    new_m = m.float().reshape(p.shape).mul_(beta1).add_(grad, alpha=1 - beta1)
    new_v = v.float().reshape(p.shape).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (new_v + eps).sqrt_() if mode == 0 else new_v.sqrt().add_(eps)
    update = (new_m / denom).add_(weight, alpha=decay)
    weight.add_(update, alpha=-step_size)
    m.copy_(new_m.reshape(m.shape))
    v.copy_(new_v.reshape(v.shape))
    p.copy_(weight)
    if p_copy is not None and p_copy.numel():
        p_copy.copy_(weight.reshape(p_copy.shape))


def _check_first_adam_args(
    p: torch.Tensor, p_copy: torch.Tensor | None, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, step: int,
    bias_correction: int,
) -> None:  # fmt: skip
    """Apex's asserts: m, v, g (and a non-empty p_copy) hold as many elements as p; its kernel took float p only."""
    if not isinstance(p, torch.Tensor) or not p.is_floating_point():
        got = p.dtype if isinstance(p, torch.Tensor) else type(p).__name__
        raise TypeError(f"fused_adam_cuda.adam: p must be a floating-point tensor, got {got}")
    for name, tensor in (("exp_avg", m), ("exp_avg_sq", v), ("grad", g), ("p_copy", p_copy)):
        if name == "p_copy" and (tensor is None or (isinstance(tensor, torch.Tensor) and tensor.numel() == 0)):
            continue
        if not isinstance(tensor, torch.Tensor) or tensor.numel() != p.numel():
            got = f"shape {list(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"fused_adam_cuda.adam: {name} must have p's {p.numel()} elements, got {got}")
    if bias_correction and step < 1:
        raise ValueError(
            f"fused_adam_cuda.adam: step must be 1 or more with bias_correction (the first is 1), got {step}"
        )


def _per_group(values: Any, groups: int) -> list:
    """The first FusedAdam's reading of ``grads``/``output_params``: None, one flat list (one group), or a list
    of lists (one per group)."""
    if values is None:
        return [None] * groups
    if isinstance(values, types.GeneratorType):
        return [list(values)]
    values = list(values)
    if values and not isinstance(values[0], list | tuple):
        return [values]
    return values


def _check_adam_keywords(
    maximize: Any, decoupled_weight_decay: Any, weight_decay: float | torch.Tensor, bias_correction: bool
) -> None:
    """torch.optim.Adam's ``maximize`` and ``decoupled_weight_decay``, taken where they say what the first FusedAdam's
    step does and refused naming what it does instead: it descends only, and adds ``weight_decay * p`` to the update
    it scales by the step size (AdamW's decay where that size is ``lr``, without bias correction)."""
    if checked_switch("FusedAdam", "maximize", maximize):
        raise ValueError(
            "FusedAdam: maximize=True asks for gradient ascent; Apex's first FusedAdam (built by max_grad_norm, "
            "eps_inside_sqrt, use_mt or amp_scale_adjustment) only descends: negate the loss, or leave those out"
        )
    if decoupled_weight_decay is None:
        return
    decoupled = checked_switch("FusedAdam", "decoupled_weight_decay", decoupled_weight_decay)
    if float(weight_decay) == 0 or (decoupled and not bias_correction):
        return
    asked = (
        "AdamW's decay, p -= lr * weight_decay * p"
        if decoupled
        else "torch.optim.Adam's L2 decay, weight_decay * p added to the gradient"
    )
    raise ValueError(
        f"FusedAdam: decoupled_weight_decay={shown(decoupled_weight_decay)} asks for {asked}; Apex's first FusedAdam "
        "adds weight_decay * p to the update it scales by the step size, which is AdamW's decay only with "
        "bias_correction=False (the step size is then lr): leave decoupled_weight_decay out"
    )


class LegacyFusedAdam(torch.optim.Optimizer):
    """Apex's first ``FusedAdam``: Adam with decoupled weight decay scaled by the step size, optional
    ``max_grad_norm`` clipping folded into the gradient scale, and a ``step`` that can take the gradients, a
    reduced-precision copy to write the new weights into, the loss scale and the gradient norms."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        amsgrad: bool = False,
        use_mt: bool = False,
        amp_scale_adjustment: float = 1.0,
        *,
        maximize: bool = False,
        decoupled_weight_decay: bool | None = None,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
        capturable: bool = False,
    ) -> None:
        # torch.optim.Adam's keywords, in a port that also gives max_grad_norm: taken where they say what this does
        check_torch_keywords(
            "FusedAdam", foreach=foreach, fused=fused, differentiable=differentiable, capturable=capturable
        )
        # Apex's first FusedAdam read these by truthiness: "False" turned them on
        bias_correction = checked_switch("FusedAdam", "bias_correction", bias_correction)
        eps_inside_sqrt = checked_switch("FusedAdam", "eps_inside_sqrt", eps_inside_sqrt)
        amsgrad = checked_switch("FusedAdam", "amsgrad", amsgrad)
        checked_switch("FusedAdam", "use_mt", use_mt)  # unused here: Apex's chose its multi-tensor kernel
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        check_hyper("lr", lr)
        check_hyper("eps", eps)
        betas = check_betas(betas)
        check_hyper("weight_decay", weight_decay)
        check_hyper("max_grad_norm", max_grad_norm, finite=False)
        _check_adam_keywords(maximize, decoupled_weight_decay, weight_decay, bias_correction)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
        )
        super().__init__(params, defaults)
        self.eps_mode = 0 if eps_inside_sqrt else 1  # Apex's attribute: 0 adds eps inside the square root
        self._amp_scale_adjustment = amp_scale_adjustment  # read only by Apex's long-gone amp integration

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, then the group's own settings are checked as the constructor's (an ``lr`` of -1 in a group dict
        was taken); a group refused is not kept."""
        super().add_param_group(param_group)
        try:
            check_group_hypers(self.param_groups[-1])
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        grads: Any = None,
        output_params: Any = None,
        scale: float = 1.0,
        grad_norms: Sequence[Any] | None = None,
    ) -> Any:
        """One Adam step. ``grads``: the gradients to use instead of ``p.grad`` (fp16 gradients of fp32
        parameters, say); ``output_params``: tensors that receive a copy of the new weights (the fp16 model of
        fp32 masters); ``scale``: the factor the gradients carry; ``grad_norms``: each group's norm of those
        scaled gradients, for ``max_grad_norm`` (computed here when not given)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # the kernel divides every gradient by it: 0, inf or NaN made the weights NaN, a negative one stepped uphill
        scale = positive_option(scale, "FusedAdam.step: scale")
        for index, group in enumerate(self.param_groups):  # a value written since construction, before any moves
            check_group_at_step("FusedAdam", index, group)
        groups = len(self.param_groups)
        grads_per_group = _per_group(grads, groups)
        outputs_per_group = _per_group(output_params, groups)
        norms = list(grad_norms) if grad_norms is not None else [None] * groups
        for group, group_grads, group_outputs, norm in zip(
            self.param_groups, grads_per_group, outputs_per_group, norms, strict=True
        ):
            params = group["params"]
            group_grads = [None] * len(params) if group_grads is None else list(group_grads)
            group_outputs = [None] * len(params) if group_outputs is None else list(group_outputs)
            chosen = [g if g is not None else p.grad for p, g in zip(params, group_grads, strict=True)]
            # read once a group a step, as host numbers: tensor ones were read (and computed with) per parameter
            lr, beta1, beta2, eps, weight_decay, max_grad_norm = host_numbers(
                [group["lr"], *group["betas"], group["eps"], group["weight_decay"], group["max_grad_norm"]]
            )
            bias_correction = int(group["bias_correction"])
            combined_scale = float(scale)
            if max_grad_norm > 0:
                if norm is None:
                    present = [g for g in chosen if g is not None]
                    flag = torch.zeros(1, device=present[0].device if present else "cpu")
                    norm = unscale_l2norm(present, 1.0, flag).total
                clip = (float(norm) / combined_scale + 1e-6) / max_grad_norm
                if clip > 1:
                    combined_scale = clip * combined_scale
            for p, grad, output in zip(params, chosen, group_outputs, strict=True):
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError(
                        "FusedAdam does not support sparse gradients, please consider SparseAdam instead"
                    )
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                first_adam_update(p, output, state["exp_avg"], state["exp_avg_sq"], grad, lr, beta1, beta2, eps,
                                  combined_scale, state["step"], self.eps_mode, bias_correction,
                                  weight_decay)  # fmt: skip
        return loss


class FP16_Optimizer(PromotedOptimizerAttributes):  # noqa: N801 - Apex's name
    """Apex's first ``FP16_Optimizer``: fp32 masters of an fp16 model for a fused optimizer.

    The masters replace the model's parameters in the wrapped optimizer's groups. ``backward(loss)`` runs the
    backward of ``loss * cur_scale`` into the fp16 grads; ``step()`` measures each group's fp16 gradient norm
    and, when every one is finite, hands the fp16 grads, the fp16 params (to receive the new weights), the scale
    and the norms to :class:`LegacyFusedAdam`'s step; an inf/nan skips the step. Any other optimizer gets the
    unscaled gradients as fp32 master grads, steps, and its masters are copied into the model.

    Dynamic scaling as Apex's: start at ``2**16``, halve on overflow (floor 1), double every ``scale_window``
    (1000) iterations counted from the last overflow. ``dynamic_loss_args`` may set ``init_scale``,
    ``scale_factor`` and ``scale_window`` (Apex refused any).
    """

    _DYNAMIC_ARGS = ("init_scale", "scale_factor", "scale_window")

    def __init__(
        self,
        init_optimizer: torch.optim.Optimizer,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: Mapping[str, Any] | None = None,
        verbose: bool = True,
    ) -> None:
        if not isinstance(init_optimizer, torch.optim.Optimizer):
            raise TypeError(f"FP16_Optimizer wraps a torch.optim.Optimizer, got {type(init_optimizer).__name__}")
        # the scale's options first: one refused leaves the optimizer's groups as they were
        verbose, dynamic, args = checked_options(verbose, dynamic_loss_scale, dynamic_loss_args, self._DYNAMIC_ARGS)
        if not dynamic and dynamic_loss_args is not None:  # Apex's first refused any args; these ones a dynamic scale's
            raise ValueError("FP16_Optimizer: dynamic_loss_args needs dynamic_loss_scale=True")
        self._configure_scale(static_loss_scale, dynamic, args)
        self.optimizer = init_optimizer
        self.fp16_groups: list[list[torch.Tensor]] = []  # the model's params
        self.fp32_groups: list[list[torch.Tensor]] = []  # their fp32 masters, stepped by the optimizer
        for group in self.optimizer.param_groups:
            self.fp16_groups.append(list(group["params"]))
            masters = [p.detach().clone().float() for p in group["params"]]
            self.fp32_groups.append(masters)
            group["params"] = masters
        self._legacy_step = isinstance(init_optimizer, LegacyFusedAdam)
        self.verbose = verbose

    def _configure_scale(self, static_loss_scale: float, dynamic: bool, args: dict[str, Any]) -> None:
        """The loss scale and, when ``dynamic``, how it moves by ``args`` (checked keys); each value checked and named
        (an ``init_scale`` of 0 divided the gradients by it)."""
        self.dynamic_loss_scale = dynamic
        self.cur_iter = 0
        if dynamic:
            self.cur_scale = args.get("init_scale", 2**16)  # an int, as Apex's (its messages print 65536)
            float32_scale(self.cur_scale, "FP16_Optimizer: dynamic_loss_args init_scale")  # 1e39: every loss inf
            self.scale_factor = positive_option(
                args.get("scale_factor", 2), "FP16_Optimizer: dynamic_loss_args scale_factor", above_one=True
            )
            self.scale_window = interval_option(
                args.get("scale_window", 1000), "FP16_Optimizer: dynamic_loss_args scale_window"
            )
            self.last_overflow_iter = -1
        else:
            if not (isinstance(static_loss_scale, int | float) and 0 < static_loss_scale < math.inf):
                raise ValueError(f"FP16_Optimizer: static_loss_scale={shown(static_loss_scale)}: expected a number > 0")
            self.cur_scale = float32_scale(static_loss_scale, "FP16_Optimizer: static_loss_scale")

    def zero_grad(self, set_grads_to_None: bool = True) -> None:  # noqa: N803 - Apex's name
        """Clear the model's fp16 grads (the masters never hold any)."""
        set_grads_to_None = checked_switch("FP16_Optimizer.zero_grad", "set_grads_to_None", set_grads_to_None)
        for group in self.fp16_groups:
            for p in group:
                if set_grads_to_None:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.detach_()
                    p.grad.zero_()

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss.float() * cur_scale`` into the model's fp16 grads."""
        (loss.float() * self.cur_scale).backward()

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """Step the masters and copy them into the model, or skip the step on an inf/nan gradient."""
        if closure is not None:
            raise RuntimeError("FP16_Optimizer.step does not take a closure (Apex's did not either)")
        grads = [[p.grad for p in group] for group in self.fp16_groups]
        group_norms: list[torch.Tensor | None] = []
        flags: list[torch.Tensor] = []
        for group_grads in grads:
            present = [g for g in group_grads if g is not None]
            if not present:
                group_norms.append(None)
                continue
            flags.append(torch.zeros(1, device=present[0].device))
            group_norms.append(unscale_l2norm(present, 1.0, flags[-1]).total)
        # every group's inf check and norm read in one transfer (a GPU sync each was two per group): the norms reach
        # the step as host numbers, as Apex's did
        values = host_numbers([*flags, *group_norms])
        overflow = any(value != 0 for value in values[: len(flags)])
        norms = values[len(flags) :]
        if not overflow:
            if self._legacy_step:
                self.optimizer.step(grads=grads, output_params=self.fp16_groups, scale=self.cur_scale, grad_norms=norms)
            else:
                self._step_with_master_grads(grads)
        self._update_scale(overflow)

    @torch.no_grad()
    def _step_with_master_grads(self, grads: list[list[torch.Tensor | None]]) -> None:
        for masters, group_grads in zip(self.fp32_groups, grads, strict=True):
            for master, grad in zip(masters, group_grads, strict=True):
                master.grad = None if grad is None else grad.float() / self.cur_scale
        self.optimizer.step()
        for masters, params in zip(self.fp32_groups, self.fp16_groups, strict=True):
            for master, param in zip(masters, params, strict=True):
                master.grad = None
                param.copy_(master)

    def _update_scale(self, skip: bool) -> None:
        if self.dynamic_loss_scale:
            if skip:
                if self.verbose:
                    print("\nGrad overflow on iteration", self.cur_iter)
                    print("Using dynamic loss scale of", self.cur_scale)
            self.cur_scale, self.last_overflow_iter = next_dynamic_scale(
                self.cur_scale, skip, self.cur_iter, self.last_overflow_iter, self.scale_factor, self.scale_window
            )
        elif skip:
            print("\nGrad overflow on iteration", self.cur_iter)
            print("Using static loss scale of", self.cur_scale)
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        """Apex's keys: the scale and its schedule, the wrapped optimizer's state dict and the fp32 masters."""
        state = {"dynamic_loss_scale": self.dynamic_loss_scale, "cur_scale": self.cur_scale, "cur_iter": self.cur_iter}
        if self.dynamic_loss_scale:
            state["last_overflow_iter"] = self.last_overflow_iter
            state["scale_factor"] = self.scale_factor
            state["scale_window"] = self.scale_window
        state["optimizer_state_dict"] = self.optimizer.state_dict()
        state["fp32_groups"] = self.fp32_groups
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, the masters included (so they keep their fp32 precision). The
        2019 wrapper's layout, one flat master per group (``fp32_groups_flat``), is read too."""
        if "fp32_groups_flat" in state_dict and "fp32_groups" not in state_dict:
            state_dict = self._from_flat_groups(state_dict)
        require_wrapper_keys(
            state_dict, ("dynamic_loss_scale", "cur_scale", "cur_iter", "optimizer_state_dict", "fp32_groups")
        )
        self.dynamic_loss_scale = state_dict["dynamic_loss_scale"]
        self.cur_scale = state_dict["cur_scale"]
        self.cur_iter = state_dict["cur_iter"]
        if self.dynamic_loss_scale:
            self.last_overflow_iter = state_dict["last_overflow_iter"]
            self.scale_factor = state_dict["scale_factor"]
            self.scale_window = state_dict["scale_window"]
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        with torch.no_grad():
            for current, saved in zip(self.fp32_groups, state_dict["fp32_groups"], strict=True):
                for master, value in zip(current, saved, strict=True):
                    master.copy_(value)

    def _from_flat_groups(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """The 2019 layout in this one's: each group's flat master, and the wrapped optimizer's state of it (one
        entry per group), cut into the group's parameters in order."""
        flats = state_dict["fp32_groups_flat"]
        saved = state_dict["optimizer_state_dict"]
        if len(flats) != len(self.fp16_groups) or len(saved["param_groups"]) != len(self.fp16_groups):
            raise ValueError(
                f"FP16_Optimizer.load_state_dict: the checkpoint has {len(flats)} flat master groups, this optimizer "
                f"{len(self.fp16_groups)} parameter groups"
            )
        state, groups, index = {}, [], 0
        for params, flat, group in zip(self.fp16_groups, flats, saved["param_groups"], strict=True):
            if flat.numel() != sum(p.numel() for p in params):
                raise ValueError(
                    f"FP16_Optimizer.load_state_dict: a flat master of {flat.numel()} elements for a group of "
                    f"{sum(p.numel() for p in params)}: the checkpoint is of another model"
                )
            flat_state = saved["state"].get(group["params"][0], {})
            split = {  # the moments are cut like the master; a per-group number (the step count) is shared
                key: pieces_of(value, params) if torch.is_tensor(value) and value.numel() == flat.numel()
                else [value] * len(params)
                for key, value in flat_state.items()
            }  # fmt: skip
            indices = list(range(index, index + len(params)))
            for j, i in enumerate(indices):
                if split:
                    state[i] = {key: values[j] for key, values in split.items()}
            groups.append({**group, "params": indices})
            index += len(params)
        converted = {k: v for k, v in state_dict.items() if k != "fp32_groups_flat"}
        converted["optimizer_state_dict"] = {"state": state, "param_groups": groups}
        converted["fp32_groups"] = [pieces_of(f, p) for f, p in zip(flats, self.fp16_groups, strict=True)]
        return converted


def pieces_of(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut into tensors shaped as ``params``, in order."""
    return [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in params]), params, strict=True)]
