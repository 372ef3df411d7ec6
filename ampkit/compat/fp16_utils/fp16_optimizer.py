"""Apex's ``FP16_Optimizer``: fp32 master weights and a loss scaler around any optimizer, on ampkit's engine.

The masters are :class:`~ampkit.amp.MasterWeights`, the unscale + inf check is
:class:`~ampkit.amp.GradientCombiner` (each backward's new grads are upcast, unscaled and added to the
master grads) and the scale is a :class:`~ampkit.amp.LossScaler` with Apex's ``DynamicLossScaler``
defaults (``init_scale=2**32``, factor 2, window 1000, floor 1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ampkit.amp import GradientCombiner, LossScaler, MasterWeights

_DYNAMIC_ARGS = {"init_scale": 2.0**32, "scale_factor": 2.0, "scale_window": 1000, "min_scale": 1.0}


def _dynamic_scaler(dynamic_loss_args: dict[str, Any] | None) -> LossScaler:
    args = dict(_DYNAMIC_ARGS)
    unknown = set(dynamic_loss_args or {}) - set(args) - {"delayed_shift"}
    if unknown:
        raise ValueError(f"dynamic_loss_args has unknown keys {sorted(unknown)}; valid keys are {sorted(args)}")
    args.update({k: v for k, v in (dynamic_loss_args or {}).items() if k != "delayed_shift"})
    return LossScaler(
        "dynamic",
        init_scale=args["init_scale"],
        growth_factor=args["scale_factor"],
        backoff_factor=1.0 / args["scale_factor"],
        growth_interval=args["scale_window"],
        min_scale=args["min_scale"],
        max_scale=None,
    )


class FP16_Optimizer:
    """Wrap ``init_optimizer`` (built on a half/bf16 model's params) with fp32 masters and loss scaling.

    Use ``optimizer.backward(loss)`` instead of ``loss.backward()``; ``step()`` skips (and backs off a
    dynamic scale) when the gradients overflowed.

    Example:
        >>> optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True)
        ... # doctest: +SKIP
    """

    def __init__(
        self,
        init_optimizer: torch.optim.Optimizer,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: dict[str, Any] | None = None,
        verbose: bool = True,
    ) -> None:
        self.optimizer = init_optimizer
        self.verbose = verbose
        self.dynamic_loss_scale = dynamic_loss_scale
        if dynamic_loss_scale:
            self.loss_scaler = _dynamic_scaler(dynamic_loss_args)
        else:
            if dynamic_loss_args is not None:
                raise ValueError("dynamic_loss_args needs dynamic_loss_scale=True")
            self.loss_scaler = LossScaler(static_loss_scale)
        self.master_weights = MasterWeights(init_optimizer)
        self._combiner = self._build_combiner()
        self.overflow = False
        self.first_closure_call_this_step = True

    def _build_combiner(self) -> GradientCombiner:
        pairs = [
            (p, m)
            for p, m in zip(self.master_weights.model_params, self.master_weights.master_params, strict=True)
            if p.requires_grad and p.is_floating_point()
        ]
        return GradientCombiner([p for p, _ in pairs], [m for _, m in pairs])

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def __repr__(self) -> str:
        return f"FP16_Optimizer({self.optimizer!r}, loss_scaler={self.loss_scaler!r})"

    def zero_grad(self, set_grads_to_None: bool = False) -> None:
        """Clear model and master gradients and the overflow verdict of the iteration."""
        self._combiner.zero_grad()
        self.overflow = False

    def backward(self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        """Backward of ``loss.float() * loss_scale``; then (unless told not to) unscale into the master grads."""
        if not self._combiner.pending:
            self._combiner.prepare_backward()
        (loss.float() * self.loss_scaler.loss_scale()).backward(retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Unscale the model grads of the backward(s) since the last call into the fp32 master grads."""
        if self._combiner.pending:
            found_inf = self._combiner.combine(self.loss_scaler).found_inf
            self.overflow = self.overflow or bool(found_inf.item())

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> float:
        """Clip the fp32 master grads; returns their total norm, or -1 when this iteration overflowed."""
        self.update_master_grads()
        if self.overflow:
            return -1
        grads = [m for m in self.master_weights.master_params if m.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(grads, max_norm, norm_type))

    def _update_scale(self) -> tuple[float, float, bool]:
        old, new = self.loss_scaler.update(self.overflow)
        return old, new, self.overflow and self.loss_scaler.dynamic

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the wrapped optimizer on the masters and copy them into the model, or skip after an overflow."""
        if closure is not None:
            return self._step_with_closure(closure)
        self.update_master_grads()
        old, new, skip = self._update_scale()
        if skip:
            if self.verbose:
                print(f"OVERFLOW! Skipping step. Attempted loss scale: {old}, reducing to {new}")
            self.zero_grad()
            return None
        self.overflow = False
        result = self.optimizer.step()
        self.master_weights.copy_to_model()
        return result

    def _step_with_closure(self, closure: Callable[[], Any]) -> Any:
        def wrapped_closure() -> Any:
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:
                self.master_weights.copy_to_model()
            loss = closure()
            self.update_master_grads()
            while self.overflow and self.loss_scaler.dynamic:
                old, new, _ = self._update_scale()
                if self.verbose:
                    print(f"OVERFLOW within closure! Skipping step. Attempted loss scale: {old}, reducing to {new}")
                self.zero_grad()
                loss = closure()
                self.update_master_grads()
            return loss

        result = self.optimizer.step(wrapped_closure)
        self.master_weights.copy_to_model()
        self.first_closure_call_this_step = True
        self.overflow = False
        return result

    def state_dict(self) -> dict[str, Any]:
        """Scaler, flags, the wrapped optimizer's state and the fp32 masters (Apex's keys)."""
        return {
            "loss_scaler": self.loss_scaler.state_dict(),
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": self.master_weights.state_dict()["master_params"],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; the masters are copied into the model too."""
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self.overflow = state_dict["overflow"]
        self.first_closure_call_this_step = state_dict["first_closure_call_this_step"]
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        self.master_weights.load_state_dict({"master_params": state_dict["fp32_from_fp16"]})
