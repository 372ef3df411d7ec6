"""The Trainer's state that callbacks read and write (their only channel to each other)."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ampkit.wording import shown


@dataclass(slots=True)
class LoopState:
    """Where the loop is. An *iteration* is one accumulation window ending in optimizer steps."""

    epoch: int = 0
    batch_idx: int = 0  # index of the current batch within the epoch
    batches_done: int = 0  # batches of this epoch fully processed
    global_step: int = 0  # iterations completed (including ones whose steps were skipped)
    iteration: int = 0  # 1-based number of the iteration the current batch belongs to (the logging step)
    is_iteration_start: bool = True  # the current batch opens an accumulation window
    is_iteration_end: bool = True  # the current batch closes it: optimizers step after it
    batch_size: int | None = None  # samples in the current training batch (Trainer.samples_in; None: unknown)
    batch_tokens: int | None = None  # its tokens (Trainer.tokens_in; None: samples x tokens_per_sample)
    epoch_finished: bool = False
    # Set it to end training after this batch (under torchrun on one rank too: every rank ends where they next agree,
    # see docs/distributed.md); a resume of the checkpoint trains nothing.
    should_stop: bool = False
    stop_reason: str = ""  # why should_stop was set, shown when a resume finds the run stopped
    stage: str = "fit"  # fit | sanity (validation before training) | validate | test | predict: what runs now
    # A callback takes each backward's gradients out of ``.grad`` (unscaled into a stash or fp32 masters), so data
    # parallelism must average them at every backward, not only at an iteration's last (where DDP would average
    # just that micro-batch's share).
    grads_leave_params: bool = False
    # The latest throughput figures (samples_per_sec, tokens_per_sec, tflops, mfu) of a throughput callback.
    throughput: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class OptimizerState:
    """Per-optimizer facts for the current iteration, plus cumulative counts.

    Facts come from callbacks; the Trainer turns them into its one verdict, :func:`skip_verdict`.
    """

    name: str
    found_inf: bool = False  # a callback may set it to skip this iteration's step
    grad_norm_nonfinite: bool = False  # clipping found the total gradient norm inf/nan
    loss_ids: set[Any] = field(default_factory=set)  # losses whose gradients reached this optimizer
    grad_norm: torch.Tensor | None = None  # cached total L2 norm, see Trainer.grad_norm
    # A flag on the device (non-zero: skip) that the step takes as GradScaler's found_inf instead of the host
    # reading it; set by a check only where ``Trainer.skips_on_device`` allows (see ampkit.trainer.device_skip).
    device_skip: torch.Tensor | None = None
    master_weights: Any = None  # the casting callback's MasterWeights: who owns the gradients the optimizer reads
    stepped: bool = False  # stepped in this iteration
    skipped: bool = False  # skipped in this iteration (``step_was_skipped``)
    steps: int = 0
    skipped_steps: int = 0
    epoch_steps: int = 0
    epoch_skipped_steps: int = 0  # skipped in this epoch: an epoch of nothing but skips trained nothing

    def begin_iteration(self) -> None:
        """Clear the per-iteration facts; the counts carry on."""
        self.found_inf = False
        self.grad_norm_nonfinite = False
        self.loss_ids = set()
        self.grad_norm = None
        self.device_skip = None
        self.stepped = False
        self.skipped = False


class LossScaleUpdater(Protocol):
    """What the Trainer needs of a loss scaler: its scale, and one update per iteration."""

    @property
    def scale(self) -> float: ...

    def update(self, found_inf: bool) -> tuple[float, float]: ...


def loss_id_key(loss_id: Any) -> int | str:
    """``loss_id`` as the key of its loss's scaler and facts: an int (numpy's made one) or a name; else a TypeError.
    True and 1.0 hash as 1, and a tensor by identity: a new key (and a new scaler) at each backward."""
    if type(loss_id) is int or type(loss_id) is str:  # nearly every call (each backward): no ABC check
        return loss_id
    if isinstance(loss_id, bool) or not isinstance(loss_id, numbers.Integral | str):
        raise TypeError(f"loss_id={shown(loss_id)}: expected an int or a str, not a {type(loss_id).__name__}")
    return loss_id if isinstance(loss_id, int | str) else int(loss_id)


@dataclass(slots=True)
class LossState:
    """Per-loss facts for the current iteration, keyed by ``loss_id`` in ``trainer.loss_state``.

    A callback that checks this loss's gradients reports each check with :meth:`report_found_inf` (a device
    flag, not read yet); the Trainer reads all reported flags with one sync and agrees them across ranks in
    one collective, into ``found_inf``, before any skip verdict or scaler update.
    """

    loss_id: Any
    found_inf: bool = False  # agreed across ranks: a backward of this loss produced inf/nan gradients
    backwards: int = 0  # backward calls of this loss in this iteration
    scaler: LossScaleUpdater | None = None  # this loss's scaler (mixed precision); the Trainer updates it
    reported: list[torch.Tensor] = field(default_factory=list)  # found_inf flags not yet read and agreed
    checked: bool = False  # a check looked at this loss's gradients for inf/nan in this iteration
    # With the verdicts kept on the device (``Trainer.facts_on_device``): the reported flags summed there,
    # unread (non-zero: inf/nan); the steps of the optimizers it reached take it as GradScaler's found_inf.
    device_found_inf: torch.Tensor | None = None

    @property
    def scale(self) -> float | None:
        """The current loss scale, or ``None`` when this loss is not scaled."""
        return None if self.scaler is None else self.scaler.scale

    def report_found_inf(self, flag: torch.Tensor) -> None:
        """Report a check of this loss's new gradients: ``flag`` (one element, on the device) non-zero = inf/nan.

        Called from ``on_after_backward`` (the Trainer looks for reports after each backward). A flag already
        reported in this iteration (one flag shared by several checks) counts once.
        """
        self.checked = True
        for reported in self.reported:
            if reported is flag:
                return
        self.reported.append(flag)

    def begin_iteration(self) -> None:
        """Clear the per-iteration facts before the iteration's first backward."""
        self.found_inf = False
        self.backwards = 0
        self.reported = []
        self.checked = False
        self.device_found_inf = None


def skip_verdict(opt_state: OptimizerState, losses: Mapping[Any, LossState]) -> list[Any] | None:
    """The skip rule, the only one: ``None`` when the optimizer steps, else the loss ids to blame.

    It skips when a loss that reached it had inf/nan gradients on any rank, when clipping found a non-finite
    norm, or when a callback set ``found_inf``. Blamed are the overflowing losses, else every loss that
    reached it.
    """
    culprits = []
    for k in opt_state.loss_ids:  # a loop, not a comprehension: asked at every step
        loss = losses.get(k)
        if loss is not None and loss.found_inf:
            culprits.append(k)
    if not (culprits or opt_state.found_inf or opt_state.grad_norm_nonfinite):
        return None
    return sorted(culprits or opt_state.loss_ids, key=str)


@dataclass(slots=True)
class BackwardState:
    """One ``Trainer.backward`` call: callbacks may replace ``loss`` (e.g. scale it) before autograd."""

    loss: torch.Tensor
    loss_id: Any = 0
    inputs: list[torch.Tensor] | None = None  # when set, only these tensors receive gradients
