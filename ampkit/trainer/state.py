"""The Trainer's state that callbacks read and write (their only channel to each other)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class LoopState:
    """Where the loop is. An *iteration* is one accumulation window ending in optimizer steps."""

    epoch: int = 0
    batch_idx: int = 0  # index of the current batch within the epoch
    batches_done: int = 0  # batches of this epoch fully processed
    global_step: int = 0  # iterations completed (including ones whose steps were skipped)
    iteration: int = 0  # 1-based number of the iteration the current batch belongs to (the logging step)
    is_iteration_start: bool = True  # the current batch opens an accumulation window
    is_iteration_end: bool = True  # the current batch closes it: optimizers step after it
    epoch_finished: bool = False
    should_stop: bool = False
    stage: str = "fit"  # fit | validate | test | predict: what the Trainer is running now


@dataclass
class OptimizerState:
    """Per-optimizer facts for the current iteration, plus cumulative counts."""

    name: str
    found_inf: bool = False  # any callback may set it; the step is then skipped
    loss_ids: set[Any] = field(default_factory=set)  # losses whose gradients reached this optimizer
    grad_norm: torch.Tensor | None = None  # cached total L2 norm, see Trainer.grad_norm
    stepped: bool = False  # stepped in this iteration
    skipped: bool = False  # skipped in this iteration (``step_was_skipped``)
    steps: int = 0
    skipped_steps: int = 0
    epoch_steps: int = 0

    def begin_iteration(self) -> None:
        self.found_inf = False
        self.loss_ids = set()
        self.grad_norm = None
        self.stepped = False
        self.skipped = False


@dataclass
class LossState:
    """Per-loss facts for the current iteration, keyed by ``loss_id`` in ``trainer.loss_state``.

    Mixed precision sets ``found_inf`` when a backward of this loss produced non-finite gradients; distributed
    training agrees on it across ranks before any skip decision or scaler update.
    """

    loss_id: Any
    found_inf: bool = False
    backwards: int = 0  # backward calls of this loss in this iteration

    def begin_iteration(self) -> None:
        self.found_inf = False
        self.backwards = 0


@dataclass
class BackwardState:
    """One ``Trainer.backward`` call: callbacks may replace ``loss`` (e.g. scale it) before autograd."""

    loss: torch.Tensor
    loss_id: Any = 0
    inputs: list[torch.Tensor] | None = None  # when set, only these tensors receive gradients
