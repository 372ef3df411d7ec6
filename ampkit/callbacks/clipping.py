"""Gradient clipping by total L2 norm; a non-finite norm skips the step instead of crashing the run."""

from __future__ import annotations

import math

import torch

from ampkit.trainer.callback import Callback, Phase


class GradientClipping(Callback):
    """Scale an optimizer's gradients so their total L2 norm is at most ``max_norm``.

    Runs in ``on_before_optimizer_step``, when mixed-precision gradients are already unscaled and averaged
    across ranks. The norm is ``trainer.grad_norm(optimizer)``, shared with logging, so it is computed once.
    A non-finite norm is reported as ``grad_norm_nonfinite``; the Trainer then skips the step.
    """

    phase = Phase.CLIP

    def __init__(self, max_norm: float) -> None:
        if not max_norm > 0:
            raise ValueError(f"GradientClipping: max_norm must be > 0, got {max_norm!r}")
        self.max_norm = float(max_norm)

    def on_before_optimizer_step(self, trainer, optimizer: torch.optim.Optimizer) -> None:
        norm = trainer.grad_norm(optimizer)
        if not math.isfinite(norm.item()):
            trainer.optimizer_state[optimizer].grad_norm_nonfinite = True
            return
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, norm, foreach=True)
