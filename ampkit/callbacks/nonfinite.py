"""Without a loss scaler: one fused inf/nan check per iteration, so a non-finite update is never applied."""

from __future__ import annotations

import torch

from ampkit.amp import unscale_and_check_
from ampkit.trainer.callback import Callback, Phase
from ampkit.trainer.state import BackwardState


class NonFiniteCheck(Callback):
    """After each backward that ends an iteration, check the gradients it wrote for inf/nan in one fused
    pass and report the (unread) flag as that loss's ``found_inf``; the Trainer then skips the optimizers the
    loss reached. Gradients accumulated over earlier micro-batches are in the same tensors, so they are
    checked too. This is ``precision.skip_nonfinite`` for bfloat16 (no loss scaler, nothing to unscale).
    """

    phase = Phase.SCALE

    def __init__(self) -> None:
        self._params: dict[torch.optim.Optimizer, list[torch.Tensor]] = {}
        self._one: dict[torch.device, torch.Tensor] = {}

    def on_fit_start(self, trainer) -> None:
        self._params = {
            optimizer: [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
            for optimizer in trainer.optimizers.values()
        }

    def on_after_backward(self, trainer, backward: BackwardState) -> None:
        if not trainer.state.is_iteration_end:
            return
        written = None if backward.inputs is None else {id(t) for t in backward.inputs}
        grads: list[torch.Tensor] = []
        for optimizer, params in self._params.items():
            reached = [p.grad for p in params if p.grad is not None and (written is None or id(p) in written)]
            if reached:
                trainer.optimizer_state[optimizer].loss_ids.add(backward.loss_id)
                grads += reached
        if not grads:
            return
        device = grads[0].device
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        one = self._one.get(device)
        if one is None:
            one = self._one[device] = torch.ones(1, dtype=torch.float32, device=device)
        with torch.no_grad():  # ``grad * 1.0`` leaves every bit as it was; FSDP's shards are checked locally
            unscale_and_check_(grads, found_inf, one)
        trainer.loss_state[backward.loss_id].report_found_inf(found_inf)
