"""Opt-in: per-parameter gradient histograms, and the names of the parameters whose gradients overflowed."""

from __future__ import annotations

from typing import Any

import torch

from ampkit.amp import MasterWeights
from ampkit.amp.scaler import interval_option
from ampkit.ops.host_values import host_numbers
from ampkit.trainer.callback import Callback, Phase


def parameter_names(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, masters: MasterWeights | None = None
) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor ``optimizer`` updates; an O2 fp32 master (of ``masters``) takes its
    model parameter's name."""
    names = {id(p): name for name, p in module.named_parameters()}
    if masters is not None:
        pairs = zip(masters.model_params, masters.master_params, strict=True)
        names.update({id(master): names.get(id(param), "") for param, master in pairs})
    found = []
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            found.append((names.get(id(param)) or f"param_groups.{g}.params.{i}", param))
    return found


class GradientHistograms(Callback):
    """Logs a histogram of each parameter's (unscaled) gradient every ``every_n_steps`` iterations as
    ``grad/<parameter>``, and on every skipped step the parameters whose gradients held inf/nan, as the text
    ``amp/overflow_params/<optimizer>`` (also kept in :attr:`overflowed`). Writes through ``trainer.logger``.
    """

    needs_verdicts_at_once = True  # a skipped step's culprits are read from that iteration's gradients

    phase = Phase.OBSERVE  # reads the gradients once unscaled, averaged and clipped

    def __init__(self, every_n_steps: int = 100) -> None:
        self.every_n_steps = interval_option(every_n_steps, "GradientHistograms: every_n_steps")
        self.overflowed: dict[str, list[str]] = {}  # optimizer name -> parameters of its last skipped step

    def on_before_optimizer_step(self, trainer, optimizer: torch.optim.Optimizer) -> None:
        step = trainer.state.iteration
        if step % self.every_n_steps:
            return
        masters = trainer.optimizer_state[optimizer].master_weights
        for name, param in parameter_names(trainer.module, optimizer, masters):
            if param.grad is not None:
                grad = param.grad.detach()
                trainer.logger.log_histogram(f"grad/{name}", grad[grad.isfinite()], step)

    def on_optimizer_step_skipped(self, trainer, optimizer: torch.optim.Optimizer, loss_ids: list[Any]) -> None:
        params = parameter_names(trainer.module, optimizer, trainer.optimizer_state[optimizer].master_weights)
        grads = [p.grad for _, p in params if p.grad is not None]
        finite = host_numbers(g.isfinite().all() for g in grads)  # one sync, wherever they are
        with_grad = [name for name, p in params if p.grad is not None]
        culprits = [name for name, ok in zip(with_grad, finite, strict=True) if not ok]
        opt_name = trainer.optimizer_state[optimizer].name
        self.overflowed[opt_name] = culprits
        losses = ", ".join(str(k) for k in loss_ids)
        trainer.logger.log_text(
            f"amp/overflow_params/{opt_name}",
            f"step skipped (loss {losses}): non-finite gradients in " + (", ".join(culprits) or "no parameter"),
        )
