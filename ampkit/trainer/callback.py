"""The callback base: every hook the Trainer fires, as a no-op to override.

Hooks run in the order documented on :class:`ampkit.Trainer`. At every hook, callbacks run in the order
of the :class:`Phase` they serve (casting before data parallelism before loss scaling before clipping
before user code before loggers before checkpoints); callbacks of one phase keep the order they were
given in, but one that reads what was logged (``reads_logged_values``: the console, early stopping) runs after
the others of its phase, and one that saves checkpoints (``saves_checkpoints``) after that; among the checkpoint
writers, one that reads logged values (``ModelCheckpoint``, ranking by its monitor) runs last. No correctness
depends on another callback's name, nor on a callback's place in the list given.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from enum import IntEnum
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from ampkit.trainer.state import BackwardState
    from ampkit.trainer.trainer import Trainer


def run_order(callback: Callback, hook: str | None = None) -> tuple[int, bool, bool]:
    """Where ``callback`` runs at ``hook`` (None: its own phase): by phase, then one reading logged values after the
    others of its phase, then one saving checkpoints after those, one that also reads logged values (a best-k ranking)
    last; a sort key, ties kept in the order given."""
    phase = callback.phase if hook is None else callback.hook_phases.get(hook, callback.phase)
    return phase, callback.saves_checkpoints, callback.reads_logged_values


HOOKS: tuple[str, ...] = (
    "on_fit_start",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_after_unscale",
    "on_before_optimizer_step",
    "on_after_optimizer_step",
    "on_optimizer_step_skipped",
    "on_before_zero_grad",
    "on_loss_scale_update",
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_batch_end",
    "on_validation_end",
    "on_evaluation_setup",
    "on_test_start",
    "on_test_end",
    "on_predict_start",
    "on_predict_end",
    "on_train_epoch_end",
    "on_save_checkpoint",
    "on_load_checkpoint",
    "on_train_end",
    "on_fit_end",
    "on_exception",
)
"""Every hook the Trainer fires: the names a callback or a Trainer subclass may define."""


class Phase(IntEnum):
    """The part of a step a callback serves; the Trainer runs callbacks in this order at every hook."""

    CAST = 1  # casts the model, runs autocast: before anything wraps the model or scales a loss
    DISTRIBUTE = 2  # wraps the model for data parallelism, averages gradients before anything reads them
    SCALE = 3  # scales losses, unscales gradients and reports each loss's found_inf
    CLIP = 4  # clips the unscaled, averaged gradients (may report a non-finite norm)
    DEFAULT = 5  # user callbacks: they see finished gradients and agreed facts
    OBSERVE = 6  # logging and progress: they read an iteration's final facts
    PERSIST = 7  # checkpoints: they save an iteration's final state


class Callback:
    """A unit of behaviour plugged into the Trainer's loop; override only the hooks you need."""

    phase: ClassVar[Phase] = Phase.DEFAULT
    # True when a hook must learn a skip verdict in its own iteration (``on_optimizer_step_skipped`` reading that
    # iteration's gradients, say): the Trainer then reads verdicts on the host (``trainer.skip_verdict``).
    needs_verdicts_at_once: ClassVar[bool] = False
    # True when a resume without this callback may drop its saved state without a warning: state that only shapes
    # what it would log next (a logger's window of batch outputs), nothing the run's training depends on.
    state_is_optional: ClassVar[bool] = False
    # Hooks this callback runs in another phase than ``phase``: a timer whose start and end hooks must enclose the
    # work the other callbacks do in theirs (Throughput leaves validation out, the loggers' flush at its end too).
    hook_phases: ClassVar[Mapping[str, Phase]] = {}
    # True for a callback whose ``state_key`` names what it watches (``EarlyStopping[val/loss]``): a resume whose
    # checkpoint lacks that key gives it the state its class saved under another (the metric changed since, or an older
    # ampkit keyed it by class name alone), and its ``load_state_dict`` decides what of it still holds.
    state_key_may_change: ClassVar[bool] = False
    # True for a callback that writes checkpoints: at every hook it runs after the other callbacks of its phase (as
    # Lightning runs its checkpoint callbacks last), so what they changed or logged there is in the checkpoint.
    saves_checkpoints: ClassVar[bool] = False
    # True for a callback that reads what the hooks before it logged (the console's lines, early stopping's monitor): at
    # every hook it runs after the other callbacks of its phase, whatever their place in the list, but before a
    # checkpoint's, so a value another callback of its phase logs there is one it sees. A checkpoint writer that reads
    # them (ModelCheckpoint's monitor) runs after the other checkpoint writers, whose logged values it then ranks.
    reads_logged_values: ClassVar[bool] = False
    # True for a callback whose hooks join collectives (a save rank zero decides, a value it broadcasts): every rank
    # must then have it, which the Trainer checks when it sets callbacks up (a callback on one rank alone would wait).
    takes_part_in_collectives: ClassVar[bool] = False

    @property
    def name(self) -> str:
        """The callback's name in messages (its class name)."""
        return type(self).__name__

    @property
    def state_key(self) -> str:
        """Key of this callback's ``state_dict`` inside a checkpoint (unique among a Trainer's callbacks)."""
        return self.name

    def state_dict(self) -> dict[str, Any]:
        """State to save in checkpoints (plain containers and tensors only)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Work inside is not training (a checkpoint save, a generated sample): a callback that measures training
        time leaves it out. Entered through :meth:`Trainer.paused`; the default does nothing."""
        yield

    def unused_hooks(self, trainer: Trainer) -> Collection[str]:
        """Hooks this callback overrides but has nothing to do in for this run (say, work for manual
        optimization in an automatic run). Asked once, when the Trainer sets its callbacks up; the Trainer
        then never calls them, which saves a call per hook per step."""
        return ()

    def explain_exception(self, trainer: Trainer, exception: BaseException) -> str | None:
        """One line naming this callback's setting behind ``exception`` and the way out, or None. Asked (not a hook:
        it changes nothing) when ``fit()`` or a standalone ``validate``/``test``/``predict`` raises."""
        return None

    def on_fit_start(self, trainer: Trainer) -> None:
        """After set-up (model, optimizers, data, resume) and before the first epoch."""

    def on_train_start(self, trainer: Trainer) -> None:
        """Just before the first training epoch runs."""

    def on_train_epoch_start(self, trainer: Trainer) -> None:
        """At the start of every training epoch."""

    def on_train_batch_start(self, trainer: Trainer, batch: Any) -> None:
        """Before ``training_step``; ``trainer.state`` says the batch index and whether it ends an iteration."""

    def on_before_backward(self, trainer: Trainer, backward: BackwardState) -> None:
        """Before autograd runs; may replace ``backward.loss`` (e.g. with a scaled loss)."""

    def on_after_backward(self, trainer: Trainer, backward: BackwardState) -> None:
        """After autograd has written this loss's gradients."""

    def on_after_unscale(self, trainer: Trainer, optimizer: torch.optim.Optimizer, found_inf: bool) -> None:
        """Mixed precision, in ``step``: ``optimizer``'s gradients are unscaled and every rank agreed on
        ``found_inf`` (whether they hold inf/nan, so the step will be skipped)."""

    def on_before_optimizer_step(self, trainer: Trainer, optimizer: torch.optim.Optimizer) -> None:
        """Before the skip verdict and ``optimizer.step()`` (clipping runs here); facts set here must be the
        same on every rank, e.g. ``trainer.optimizer_state[optimizer].found_inf = True`` to skip the step."""

    def on_after_optimizer_step(self, trainer: Trainer, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.step()`` ran (not called for a skipped step)."""

    def on_optimizer_step_skipped(
        self, trainer: Trainer, optimizer: torch.optim.Optimizer, loss_ids: list[Any]
    ) -> None:
        """Instead of the step when a non-finite gradient was found; ``loss_ids`` are the culprits."""

    def on_before_zero_grad(self, trainer: Trainer, optimizer: torch.optim.Optimizer) -> None:
        """At the end of an iteration, before the optimizer's gradients are cleared."""

    def on_loss_scale_update(self, trainer: Trainer, loss_id: Any, old: float, new: float) -> None:
        """Mixed precision: loss scaler ``loss_id`` updated its scale, once at the end of an iteration."""

    def on_train_batch_end(self, trainer: Trainer, outputs: dict[str, Any], batch: Any) -> None:
        """After the batch (and, at the end of an iteration, schedulers, zeroing and due validation)."""

    def on_validation_start(self, trainer: Trainer) -> None:
        """Before a validation run."""

    def on_validation_batch_end(self, trainer: Trainer, metrics: dict[str, Any], batch: Any) -> None:
        """After ``validation_step`` returned ``metrics`` for one batch."""

    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """After a validation run, with its averaged metrics."""

    def on_evaluation_setup(self, trainer: Trainer, stage: str) -> None:
        """A standalone ``validate``/``test``/``predict`` (``stage``) built the model and loaded its weights;
        fit does this set-up in ``on_fit_start`` (e.g. the precision casts)."""

    def on_test_start(self, trainer: Trainer) -> None:
        """Before :meth:`Trainer.test` runs its batches."""

    def on_test_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """After :meth:`Trainer.test`, with its averaged metrics."""

    def on_predict_start(self, trainer: Trainer) -> None:
        """Before :meth:`Trainer.predict` runs its batches."""

    def on_predict_end(self, trainer: Trainer, predictions: list[Any]) -> None:
        """After :meth:`Trainer.predict`, with the per-batch outputs."""

    def on_train_epoch_end(self, trainer: Trainer) -> None:
        """At the end of every training epoch (after the epoch's validation, if due)."""

    def on_save_checkpoint(self, trainer: Trainer, checkpoint: dict[str, Any]) -> None:
        """While a checkpoint is assembled; may add entries."""

    def on_load_checkpoint(self, trainer: Trainer, checkpoint: dict[str, Any]) -> None:
        """While a checkpoint is restored, after the model, optimizers and callback states (Lightning calls it before
        them): an edit of ``checkpoint['model']`` here would change nothing, and is refused."""

    def on_train_end(self, trainer: Trainer) -> None:
        """After the last epoch."""

    def on_fit_end(self, trainer: Trainer) -> None:
        """At the very end of ``fit()``, also after an exception."""

    def on_exception(self, trainer: Trainer, exception: BaseException) -> None:
        """When ``fit()``, ``validate()``, ``test()`` or ``predict()`` raises (``trainer.state.stage`` says which);
        the exception propagates afterwards. An error this hook raises becomes a note on it, unless raised ``from
        exception``: that one explains it (``DistributedSync`` names the rank that died) and propagates instead."""
