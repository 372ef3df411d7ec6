"""Gradient clipping by total L2 norm; a non-finite norm skips the step instead of crashing the run."""

from __future__ import annotations

import math

import torch

from ampkit.amp.scaler import positive_option
from ampkit.trainer.callback import Callback, Phase
from ampkit.trainer.device_skip import nonfinite_flag
from ampkit.trainer.state import skip_verdict


class GradientClipping(Callback):
    """Scale an optimizer's gradients so their total L2 norm is at most ``max_norm``.

    Runs in ``on_before_optimizer_step``, when mixed-precision gradients are already unscaled and averaged
    across ranks. The norm is ``trainer.grad_norm(optimizer)``, shared with logging, so it is computed once.

    A non-finite norm must not reach the step. When an inf/nan check covered every loss that reached the
    optimizer (a loss scaler's, or bf16's ``skip_nonfinite``), non-finite gradients already make the Trainer skip
    the step, so the norm stays on the device: clipping costs no host read, and the iteration keeps its one.
    Without such a check the norm is read, and a non-finite one is reported as ``grad_norm_nonfinite``; the
    Trainer then skips the step. Where ``trainer.skips_on_device(optimizer)`` (``trainer.skip_verdict``: on CUDA
    by default, for optimizers that take GradScaler's ``found_inf``) the norm's finiteness goes to the step as a
    device flag instead: the step is skipped there, and the host learns it at the next iteration.
    """

    phase = Phase.CLIP

    def __init__(self, max_norm: float) -> None:
        self.max_norm = positive_option(max_norm, "GradientClipping: max_norm")  # as trainer.clip_grad_norm

    def on_before_optimizer_step(self, trainer, optimizer: torch.optim.Optimizer) -> None:
        opt_state = trainer.optimizer_state[optimizer]
        if skip_verdict(opt_state, trainer.loss_state) is not None:  # facts agreed already: it will be skipped
            return
        losses = [trainer.loss_state.get(k) for k in opt_state.loss_ids]
        checked = bool(losses) and all(loss is not None and loss.checked for loss in losses)
        norm = trainer.grad_norm(optimizer)
        if not checked:
            if trainer.skips_on_device(optimizer):  # the step takes the verdict as a flag: no host read
                opt_state.device_skip = nonfinite_flag(norm)
            elif not math.isfinite(norm.item()):
                opt_state.grad_norm_nonfinite = True
                return
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, norm, foreach=True)
