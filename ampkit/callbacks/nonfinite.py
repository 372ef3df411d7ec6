"""Without a loss scaler: one fused inf/nan check per iteration, so a non-finite update is never applied."""

from __future__ import annotations

from typing import Any

import torch

from ampkit.amp import unscale_and_check_
from ampkit.callbacks.found_inf_flags import FoundInfFlags
from ampkit.trainer.callback import Callback, Phase
from ampkit.trainer.param_groups import TrainableParams
from ampkit.trainer.state import BackwardState


class NonFiniteCheck(Callback):
    """After each backward that ends an iteration, check the gradients it wrote for inf/nan in one fused
    pass and report the (unread) flag as that loss's ``found_inf``; the Trainer then skips the optimizers the
    loss reached. Gradients accumulated over earlier micro-batches are in the same tensors, so they are
    checked too. This is ``precision.skip_nonfinite`` for bfloat16 (no loss scaler, nothing to unscale).

    Per iteration it costs the check and nothing else: each loss keeps its flag tensor, which the check only
    ever sets, and gets a fresh zero one only after an iteration that found inf/nan.
    """

    phase = Phase.SCALE

    def __init__(self) -> None:
        self._params: list[tuple[torch.optim.Optimizer, list[torch.Tensor]]] = []
        self._trainable: TrainableParams | None = None  # when the parameters must be looked up again
        self._flags = FoundInfFlags()
        self._one: torch.Tensor | None = None  # the 1.0 the check multiplies by, on the gradients' device

    def on_fit_start(self, trainer) -> None:
        self._trainable = TrainableParams(trainer.module, trainer.optimizers.values())

    def on_after_backward(self, trainer, backward: BackwardState) -> None:
        if not trainer.state.is_iteration_end:
            return
        if self._trainable is not None and self._trainable.changed():  # the first time, and after an unfreeze
            self._params = [
                (optimizer, [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad])
                for optimizer in trainer.optimizers.values()
            ]
        written = None if backward.inputs is None else {id(t) for t in backward.inputs}
        grads: list[torch.Tensor] = []
        for optimizer, params in self._params:
            if written is None:
                reached = [p.grad for p in params if p.grad is not None]
            else:
                reached = [p.grad for p in params if p.grad is not None and id(p) in written]
            if reached:
                trainer.optimizer_state[optimizer].loss_ids.add(backward.loss_id)
                grads += reached
        if not grads:
            return
        flag = self._flags.get(backward.loss_id, grads[0].device)
        if self._one is None:
            self._one = torch.ones(1, dtype=torch.float32, device=flag.device)
        # ``grad * 1.0`` leaves every bit as it was; FSDP's shards are checked locally. Gradients do not
        # require grad (the Trainer's backward builds no graph of them), so no autograd context is needed.
        unscale_and_check_(grads, flag, self._one)
        trainer.loss_state[backward.loss_id].report_found_inf(flag)

    def on_train_batch_end(self, trainer, outputs: dict[str, Any], batch: Any) -> None:
        if not trainer.state.is_iteration_end:
            return
        self._flags.renew(trainer.loss_state)
