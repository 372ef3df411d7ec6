"""Stop a run whose model turned NaN/inf before that model is checkpointed over a finite one."""

from __future__ import annotations

import math
from typing import Any

import torch
from omegaconf import OmegaConf

from ampkit.amp.scaler import interval_option
from ampkit.ops.host_values import host_numbers
from ampkit.trainer.callback import Callback
from ampkit.trainer.distributed import all_reduce_sum
from ampkit.trainer.finite_weights import nonfinite_entries
from ampkit.trainer.user_code import first_names


class NonFiniteError(RuntimeError):
    """The model's parameters or buffers became NaN/inf; the message names the first step that made them so."""


class NonFiniteGuard(Callback):
    """Checks the model before every checkpoint, at the end of training, and every ``check_every_n_steps``
    iterations whether a loss of an iteration whose update was applied (an optimizer stepped) was non-finite; a
    non-finite model stops the run with :class:`NonFiniteError` naming that first step, so the last checkpoint
    keeps a finite model and a run shorter than the interval does not end with a NaN model said by nothing.

    Cheap: it keeps a reference to each loss (under automatic optimization the Trainer's own detached copy in
    the batch outputs, so it adds no tensor op; under manual optimization a detached copy at each backward);
    the periodic check reads them all at once (one sync on a GPU), and reads the parameters only when a loss
    was non-finite. Iterations in which every step was skipped (a loss scaler's overflow, clipping) never count.
    """

    takes_part_in_collectives = True  # the ranks agree on a non-finite loss

    def __init__(self, check_every_n_steps: int = 10) -> None:
        self.check_every_n_steps = interval_option(check_every_n_steps, "NonFiniteGuard: check_every_n_steps")
        self._pending: list[torch.Tensor] = []  # this iteration's losses, until its end
        self._applied: list[tuple[int, list[torch.Tensor]]] = []  # (iteration, losses) of steps since the last check
        self._finite_at = 0  # the last global step at which the model was seen finite

    def on_fit_start(self, trainer) -> None:
        self._finite_at = trainer.state.global_step

    def unused_hooks(self, trainer) -> set[str]:
        return {"on_before_backward"} if trainer.automatic_optimization else set()

    def on_before_backward(self, trainer, backward) -> None:  # manual optimization: the losses given to backward
        self._pending.append(backward.loss.detach())

    def on_train_batch_end(self, trainer, outputs: dict[str, Any], batch: Any) -> None:
        if trainer.automatic_optimization:
            loss = outputs.get("loss")
            if isinstance(loss, torch.Tensor):
                self._pending.append(loss)
        s = trainer.state
        if not s.is_iteration_end:
            return
        if self._pending:
            for opt_state in trainer.optimizer_state.values():  # a loop, not any(generator): asked every step
                if opt_state.stepped:
                    self._applied.append((s.iteration, self._pending))
                    break
            self._pending = []
        if s.global_step % self.check_every_n_steps == 0:
            first_bad = self._first_nonfinite_loss()
            # Every rank must agree to look at the model (identical on all ranks), or one would stop alone.
            if all_reduce_sum([float(first_bad is not None)], trainer.dist)[0]:
                self._check_model(trainer, trainer.module.state_dict(), first_bad)
            self._applied = []

    def on_train_end(self, trainer) -> None:
        # Steps since the last check (a run shorter than check_every_n_steps, checkpoints off) would go unread:
        # the fit would return a NaN model without a word. A model seen finite at this step is not read again.
        if self._finite_at != trainer.state.global_step:
            self._check_model(trainer, trainer.module.state_dict(), self._first_nonfinite_loss())
        self._applied = []

    def on_save_checkpoint(self, trainer, checkpoint: dict[str, Any]) -> None:
        model = checkpoint["model"] if "model" in checkpoint else trainer.module.state_dict()  # FSDP saves it apart
        self._check_model(trainer, model, self._first_nonfinite_loss())
        self._applied = []

    def _first_nonfinite_loss(self) -> tuple[int, float] | None:
        if not self._applied:
            return None
        steps = [(iteration, loss) for iteration, losses in self._applied for loss in losses]
        values = host_numbers(loss for _, loss in steps)  # one sync
        for (iteration, _), value in zip(steps, values, strict=True):
            if not math.isfinite(value):
                return iteration, value
        return None

    def _check_model(self, trainer, model_state: dict[str, Any], first_bad: tuple[int, float] | None) -> None:
        # Whole models are the same on every rank; FSDP's shards differ, so the ranks agree on what they hold.
        bad = nonfinite_entries(model_state, trainer.dist if trainer.sharded else None)
        step = trainer.state.global_step
        if not bad:
            self._finite_at = step
            return
        if first_bad is not None:
            since = f"step {first_bad[0]} applied a loss of {first_bad[1]}"
        else:
            since = f"somewhere in steps {self._finite_at + 1}..{step} (every loss was finite: a step overflowed)"
        raise NonFiniteError(
            f"the model is not finite at step {step} ({first_names(bad)} hold NaN/inf): {since}. Stopped before "
            f"checkpointing it, so the last checkpoint keeps a finite model. {_advice(trainer)}"
        )


def _advice(trainer) -> str:
    """What to change: a half-precision model stepped without fp32 masters (O3, or O2/O5 with master weights off)
    is the likely cause where it is one (the optimizer's moments and updates in half overflow or round to
    nothing); else the usual levers."""
    level = OmegaConf.select(trainer.cfg, "precision.opt_level")
    masters = OmegaConf.select(trainer.cfg, "precision.master_weights")
    if level == "O3" or (level in ("O2", "O5") and masters is False):
        return (
            f"precision.opt_level={level} steps the half-precision weights and optimizer state themselves, without "
            "fp32 master weights (O3 is Apex's speed baseline, not a training recipe): train with O2 (or O5 in "
            "bfloat16) and master weights on."
        )
    return "Lower the learning rate, clip gradients, or use a loss scaler (precision.opt_level)."
