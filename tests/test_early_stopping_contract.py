"""A stop keeps the contract Lightning users know: a stop asked mid-epoch (a callback, ``max_time``) validates the
weights it leaves once, in an epoch that validates at all, and that validation is ranked for ``best.pt``; early
stopping mid-epoch (``val_every_n_steps``) ends the run at the validation that asked, validated once, its
checkpoint at that step; a negative ``min_delta`` is refused rather than silently turned round; two instances, keyed
by their monitor as Lightning's are, save under names a resume finds. (Patience,
``check_finite``, the thresholds, a missing monitor and a resumed count: test_monitoring.py.)"""

from __future__ import annotations

import math
import re
from typing import ClassVar

import numpy as np
import pytest
import torch
from toy_trainers import ToyTrainer, toy_cfg

from ampkit import Callback, ConfigError, Phase
from ampkit.callbacks import EarlyStopping, EarlyStoppingReason
from ampkit.trainer.checkpoint_io import load_checkpoint
from ampkit.wording import shown

QUIET = {"logging.tensorboard": False, "trainer.progress_bar": False, "logging.throughput": False,
         "trainer.num_sanity_val_steps": 0, "trainer.max_epochs": 2}  # fmt: skip


class Scripted(ToyTrainer):
    """Validation reports ``scores[global_step]`` (8 batches per epoch)."""

    scores: ClassVar[list[float]] = []

    def validation_step(self, batch):
        return {"score": self.scores[self.state.global_step]}


class StopAt(Callback):
    """Asks to stop at the end of iteration ``step``, as MaxTime or a user's callback would; records validations."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.validated: list[int] = []

    def on_train_batch_end(self, trainer, outputs, batch) -> None:
        if trainer.state.global_step == self.step and not trainer.state.should_stop:
            trainer.state.should_stop, trainer.state.stop_reason = True, "enough"

    def on_validation_end(self, trainer, metrics) -> None:
        if trainer.state.stage == "fit":
            self.validated.append(trainer.state.global_step)


def _fit(tmp_path, stop_at: int, **overrides) -> tuple[Scripted, StopAt]:
    spy = StopAt(stop_at)
    trainer = Scripted(toy_cfg(tmp_path, **QUIET, **overrides), callbacks=[spy])
    trainer.fit()
    return trainer, spy


def test_a_stop_asked_mid_epoch_validates_the_weights_it_leaves_once_and_ranks_them(tmp_path):
    """The run ended at step 3 of an epoch that validates only at its end: the model it leaves was never validated,
    and best.pt named no checkpoint of it (Lightning validates once when a stop is asked)."""
    Scripted.scores = [9.0] * 3 + [1.0] * 13
    trainer, spy = _fit(tmp_path, 3, **{"checkpoint.monitor": "val/score", "checkpoint.every_n_epochs": 1})
    assert trainer.state.global_step == 3
    assert spy.validated == [3]
    assert trainer.val_metrics == {"score": 1.0} and trainer.val_metrics_step == 3
    checkpoints = trainer.version_dir / "checkpoints"
    assert load_checkpoint(checkpoints / "best.pt")["loop"]["global_step"] == 3
    last = load_checkpoint(checkpoints / "last.pt")
    assert last["loop"]["global_step"] == 3 and last["stopped_early"] == "enough"
    assert last["val_metrics"] == {"score": 1.0}


def test_the_last_checkpoint_of_a_stop_holds_its_validation_also_after_a_save_at_that_step(tmp_path):
    """Saved every step, at on_train_batch_end, before the stop's validation: the end saw that moment saved already,
    so last.pt held the step without its validation's metrics."""
    Scripted.scores = [9.0] * 3 + [1.0] * 13
    trainer, _ = _fit(tmp_path, 3, **{"checkpoint.every_n_steps": 1})
    last = load_checkpoint(trainer.version_dir / "checkpoints" / "last.pt")
    assert last["loop"]["global_step"] == 3 and last["stopped_early"] == "enough"
    assert (last["val_metrics"], last["val_metrics_step"]) == ({"score": 1.0}, 3)


@pytest.mark.parametrize(
    ("settings", "validated"),
    [
        ({"trainer.val_every_n_epochs": 2}, []),  # epoch 0 does not validate: a stop in it does not either
        ({"trainer.val_every_n_epochs": 0}, []),  # validation off
        ({"trainer.val_every_n_epochs": 0, "trainer.val_every_n_steps": 3}, [3]),  # it just ran: not again
        ({"trainer.val_every_n_epochs": 0, "trainer.val_every_n_steps": 2}, [2, 3]),
    ],
)
def test_a_stop_validates_only_where_the_run_validates_and_not_twice_on_one_model(tmp_path, settings, validated):
    Scripted.scores = [1.0] * 16
    trainer, spy = _fit(tmp_path, 3, **{"checkpoint.enabled": False}, **settings)
    assert trainer.state.global_step == 3
    assert spy.validated == validated


def test_a_stop_at_an_epoch_s_last_batch_validates_once_as_the_epoch_s_end(tmp_path):
    Scripted.scores = [1.0] * 16
    _, spy = _fit(tmp_path, 8, **{"checkpoint.enabled": False})
    assert spy.validated == [8]


def test_the_stop_s_own_reason_stays_when_its_validation_would_also_stop_early(tmp_path):
    """Early stopping sees the stop's validation (a NaN here) and asks too; the run stopped for the first reason."""
    Scripted.scores = [1.0, 1.0, 1.0, float("nan")] + [1.0] * 12
    es = {"early_stopping.monitor": "val/score", "checkpoint.enabled": False}
    trainer, spy = _fit(tmp_path, 3, **es)
    assert spy.validated == [3]
    assert trainer.state.stop_reason == "enough"


def test_early_stopping_mid_epoch_ends_at_the_validation_that_asked_with_its_checkpoint(tmp_path):
    """Validation every 2 steps, patience 2: best at step 2, none better at 4 and 6, so the run ends at step 6,
    mid-epoch, validated once there (no second pass for the stop), its last checkpoint that step's."""
    Scripted.scores = [5.0, 5.0, 1.0, 1.0, 2.0, 2.0, 1.5] + [0.0] * 9
    es = {"early_stopping.monitor": "val/score", "early_stopping.patience": 2, "checkpoint.monitor": "val/score"}
    trainer, spy = _fit(tmp_path, -1, **es, **{"trainer.val_every_n_steps": 2, "trainer.val_every_n_epochs": 0})
    assert trainer.state.global_step == 6 and trainer.state.batches_done == 6
    assert spy.validated == [2, 4, 6]
    assert trainer.state.stop_reason.startswith("early stopping: val/score did not improve on 1.0 for 2 validations")
    checkpoints = trainer.version_dir / "checkpoints"
    last = load_checkpoint(checkpoints / "last.pt")
    assert last["loop"]["global_step"] == 6 and last["stopped_early"] == trainer.state.stop_reason
    saved = last["callbacks"]["EarlyStopping[val/score]"]
    assert saved["best"] == 1.0 and saved["wait"] == 2
    assert load_checkpoint(checkpoints / "best.pt")["loop"]["global_step"] == 2


def test_a_negative_min_delta_is_refused_naming_it_rather_than_turned_round(tmp_path):
    """Lightning takes min_delta's magnitude whatever its sign; here the sign would be a silent guess."""
    message = "'early_stopping.min_delta': -0.1 is invalid"
    with pytest.raises(ConfigError, match=re.escape(message)):
        ToyTrainer(toy_cfg(tmp_path, **{"early_stopping.monitor": "val/mse", "early_stopping.min_delta": -0.1}))


def test_two_early_stoppings_keyed_by_their_monitor_save_under_names_a_resume_finds(tmp_path):
    """The key held the Monitor object's repr, a memory address that differs in every process, so a resume could
    never find either state (it warned that the checkpoint's were not this run's, and both counts started afresh)."""
    callbacks = [EarlyStopping("val/mse", patience=9), EarlyStopping("train/loss", patience=9)]
    run = ToyTrainer(toy_cfg(tmp_path, **{**QUIET, "trainer.max_epochs": 1, "data.n": 16}), callbacks=callbacks)
    run.fit()
    saved = load_checkpoint(run.version_dir / "checkpoints" / "last.pt")["callbacks"]
    assert {key for key in saved if "EarlyStopping" in key} == {
        "EarlyStopping[val/mse]",
        "EarlyStopping[train/loss]",
    }
    assert saved["EarlyStopping[train/loss]"]["monitor"] == "train/loss"


class _ScoresAtPersist(Callback):
    """Logs a value over the validated set from PERSIST (a callback that reads what the Trainer's own hooks log),
    given after the config's EarlyStopping: it rises over the first two validations, then falls for good."""

    phase = Phase.PERSIST

    def on_validation_end(self, trainer, metrics):
        step = trainer.state.global_step
        trainer.log("val/auc", 0.5 + step / 10 if step <= 4 else 0.5)


def test_early_stopping_sees_a_value_a_persist_phase_callback_logs_wherever_it_stands_in_the_list(tmp_path):
    """Given after EarlyStopping, it logged after early stopping had looked: the run failed at its first validation
    with 'not a metric of the validation', though the sanity check had found the value."""
    settings = {"early_stopping.monitor": "val/auc", "early_stopping.mode": "max", "early_stopping.patience": 2,
                "trainer.val_every_n_steps": 2, "trainer.num_sanity_val_steps": 1,
                "checkpoint.enabled": False}  # fmt: skip
    trainer = ToyTrainer(toy_cfg(tmp_path, **{**QUIET, **settings}), callbacks=[_ScoresAtPersist()])
    trainer.fit()
    assert trainer.state.global_step == 8  # validations at 2, 4 (best 0.9), 6 and 8 (0.5): patience 2 ends it at 8
    assert trainer.state.stop_reason == "early stopping: val/auc did not improve on 0.9 for 2 validations"


def test_wait_count_best_score_and_stopped_epoch_read_as_lightning_s_and_a_resume_counts_on(tmp_path):
    """A Lightning test of a port asserts ``early_stopping.stopped_epoch`` and ``wait_count`` after fit: neither
    existed. Best at step 2, five worse validations stop it at step 12 (epoch 1); a resume with patience 6 counts on
    from 5, so the next worse validation (step 14) stops it, not a fresh count."""
    Scripted.scores = [9.0, 9.0, 1.0] + [2.0] * 13
    settings = {**QUIET, "early_stopping.monitor": "val/score", "trainer.val_every_n_steps": 2,
                "trainer.val_every_n_epochs": 0}  # fmt: skip

    def fit(patience, resume=None):
        trainer = Scripted(toy_cfg(tmp_path, **settings, **{"early_stopping.patience": patience}))
        trainer.fit(resume=resume)
        return trainer, next(cb for cb in trainer.callbacks if isinstance(cb, EarlyStopping))

    assert (EarlyStopping("val/loss").stopped_epoch, EarlyStopping("val/loss").wait_count) == (0, 0)
    trainer, stopper = fit(5)
    assert trainer.state.global_step == 12
    assert (stopper.stopped_epoch, stopper.wait_count, stopper.best_score) == (1, 5, 1.0)
    trainer, stopper = fit(6, resume="last")
    assert trainer.state.global_step == 14
    assert (stopper.stopped_epoch, stopper.wait_count, stopper.best_score) == (1, 6, 1.0)
    saved = load_checkpoint(trainer.version_dir / "checkpoints" / "last.pt")["callbacks"]["EarlyStopping[val/score]"]
    assert saved["stopped_epoch"] == 1
    trainer, stopper = fit(6, resume="last")  # the stopped run again: it trains nothing, and reads as it stopped
    assert trainer.state.global_step == 14
    assert (stopper.stopped_epoch, stopper.wait_count, stopper.best_score) == (1, 6, 1.0)


class CallbacksFromTheModel(Scripted):
    def configure_callbacks(self):  # reads the model, which a finished run's fit() does not build
        return [EarlyStopping("val/score", patience=len(list(self.module.parameters())))]


def test_a_finished_run_whose_callbacks_need_the_model_still_trains_nothing_and_says_why_they_read_empty(tmp_path):
    """fit() on a finished run restores the callbacks' states where it can rebuild them; a configure_callbacks()
    that needs the model (not built there) leaves them unrestored with one warning, never an error."""
    Scripted.scores = [1.0] * 8
    trainer = CallbacksFromTheModel(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 2}))
    trainer.fit()
    again = CallbacksFromTheModel(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 2}))
    with pytest.warns(UserWarning, match=r"callbacks of the finished run .* were not restored \(AttributeError"):
        again.fit(resume="last")
    assert again.state.global_step == 2 and again.callbacks == []


@pytest.mark.parametrize(
    ("threshold", "scores", "step", "best"),
    [
        ({"early_stopping.stopping_threshold": 2.5}, [9.0, 5.0, 2.5, 2.0], 3, 2.5),
        ({"early_stopping.divergence_threshold": 10.0}, [9.0, 11.0], 1, None),
    ],
)
def test_a_value_that_stops_the_run_at_once_leaves_best_score_and_wait_count_as_lightning_s(
    tmp_path, threshold, scores, step, best
):
    """Lightning counts no value that stops the run at once: a diverged first value (11.0) was read back as
    best_score, and the one past stopping_threshold replaced the best it was compared with."""
    Scripted.scores = scores
    settings = {**QUIET, "early_stopping.monitor": "val/score", "trainer.val_every_n_steps": 1,
                "trainer.val_every_n_epochs": 0, **threshold}  # fmt: skip
    trainer = Scripted(toy_cfg(tmp_path, **settings))
    trainer.fit()
    stopper = next(cb for cb in trainer.callbacks if isinstance(cb, EarlyStopping))
    assert trainer.state.global_step == step and trainer.state.should_stop
    assert (stopper.best_score, stopper.wait_count) == (best, 0)


@pytest.mark.parametrize(
    ("threshold", "scores", "step"),
    [
        ({"early_stopping.divergence_threshold": 10.0}, [9.0, 5.0, float("inf"), 4.0], 2),
        ({"early_stopping.stopping_threshold": 1.0}, [9.0, 5.0, float("-inf"), 4.0], 2),
        ({"early_stopping.divergence_threshold": 10.0}, [9.0, 5.0, float("nan"), 6.0, 7.0], 4),
    ],
)
def test_check_finite_off_still_stops_an_infinite_value_past_a_threshold_as_lightning(
    tmp_path, threshold, scores, step
):
    """check_finite=False counts a NaN/inf value as no improvement, but Lightning still weighs it against the
    thresholds: inf is past any divergence_threshold (min mode), -inf better than any stopping_threshold. The run
    trained on past them; a NaN, which no threshold compares with, still counts against patience."""
    Scripted.scores = scores
    settings = {**QUIET, "early_stopping.monitor": "val/score", "early_stopping.check_finite": False,
                "early_stopping.patience": 3, "trainer.val_every_n_steps": 1, "trainer.val_every_n_epochs": 0,
                **threshold}  # fmt: skip
    trainer = Scripted(toy_cfg(tmp_path, **settings))
    trainer.fit()
    stopper = next(cb for cb in trainer.callbacks if isinstance(cb, EarlyStopping))
    assert trainer.state.global_step == step and trainer.state.should_stop
    assert (stopper.best_score, stopper.wait_count) == (5.0, 3 if step == 4 else 0)


@pytest.mark.parametrize(
    ("settings", "scores", "reason", "said"),
    [
        ({"early_stopping.patience": 2}, [5.0, 6.0, 6.0, 6.0], EarlyStoppingReason.PATIENCE_EXHAUSTED,
         "did not improve"),
        ({"early_stopping.stopping_threshold": 0.6}, [5.0, 3.0, 0.5], EarlyStoppingReason.STOPPING_THRESHOLD,
         "stopping_threshold=0.6"),
        ({"early_stopping.divergence_threshold": 8.0}, [1.0, 9.0], EarlyStoppingReason.DIVERGENCE_THRESHOLD,
         "divergence_threshold=8.0"),
        ({}, [1.0, 0.5, float("nan")], EarlyStoppingReason.NON_FINITE_METRIC, "not finite"),
        ({"trainer.max_steps": 3}, [5.0, 4.0, 3.0], EarlyStoppingReason.NOT_STOPPED, None),
    ],
)  # fmt: skip
def test_stopping_reason_and_its_message_say_which_rule_stopped_the_run_as_lightning_s_and_a_resume_keeps_them(
    tmp_path, settings, scores, reason, said
):
    """Lightning's test of a port asserts ``early_stopping.stopping_reason`` (an ``EarlyStoppingReason``) and
    ``stopping_reason_message`` after fit: neither existed. The pair is saved, so the stopped run resumed reads
    alike."""
    Scripted.scores = scores + [0.1] * 8
    config = {**QUIET, "early_stopping.monitor": "val/score", "trainer.val_every_n_steps": 1,
              "trainer.val_every_n_epochs": 0, **settings}  # fmt: skip

    def stopper_after(resume=None) -> EarlyStopping:
        trainer = Scripted(toy_cfg(tmp_path, **config))
        trainer.fit(resume=resume)
        return next(cb for cb in trainer.callbacks if isinstance(cb, EarlyStopping))

    for stopper in (stopper_after(), stopper_after(resume="last")):
        assert stopper.stopping_reason is reason
        if said is None:
            assert stopper.stopping_reason_message is None and stopper.stopped_epoch == 0
        else:
            assert said in stopper.stopping_reason_message
    assert EarlyStopping("val/loss").stopping_reason is EarlyStoppingReason.NOT_STOPPED


@pytest.mark.parametrize(
    ("key", "saved"),
    [("stopping_reason", "bogus"), ("stopping_reason", 3), ("stopping_reason", "PATIENCE_EXHAUSTED"),
     ("stopping_reason", None), ("stopping_reason_message", 5), ("wait", "3"), ("wait", -1), ("best", "0.5"),
     ("best", math.inf), ("stopped_epoch", 1.5)],
)  # fmt: skip
def test_a_damaged_saved_stopping_reason_is_refused_naming_it_and_the_valid_ones(key, saved):
    """A checkpoint's stopping_reason that is no EarlyStoppingReason's value failed deep in Enum's lookup, naming
    neither the key nor what it takes, and a count or best value of another type was taken to fail at the next
    validation's comparison; an older checkpoint without a stopping_reason still loads."""
    state = {**EarlyStopping(monitor="val/loss").state_dict(), key: saved}
    with pytest.raises(ValueError, match=rf"holds {key}={re.escape(repr(saved))}: expected "):
        EarlyStopping(monitor="val/loss").load_state_dict(state)
    saved_before = EarlyStopping(monitor="val/loss").state_dict()
    older = {k: v for k, v in saved_before.items() if not k.startswith("stopping_reason")}
    loaded = EarlyStopping(monitor="val/loss")
    loaded.load_state_dict(older)
    assert loaded.stopping_reason is EarlyStoppingReason.NOT_STOPPED and loaded.stopping_reason_message is None


@pytest.mark.parametrize(
    ("key", "value", "valid"),
    [("wait", "x", "an integer >= 0"), ("wait", -1, "an integer >= 0"), ("wait", True, "an integer >= 0"),
     ("wait", 2.0, "an integer >= 0"), ("best", "x", "a finite number or None"),
     ("best", math.nan, "a finite number or None"), ("best", True, "a finite number or None"),
     ("best", 10**400, "a finite number or None")],
)  # fmt: skip
def test_wait_and_best_assigned_a_bad_value_are_refused_naming_it(key, value, valid):
    """``es.wait = "x"`` was kept and failed at the next check's comparison, naming neither; a number is kept (best as
    a float: numpy's would not load under weights_only)."""
    stopper = EarlyStopping("val/loss")
    with pytest.raises(ValueError, match=rf"^EarlyStopping: {key}={re.escape(shown(value))}: expected {valid} \("):
        setattr(stopper, key, value)
    assert (stopper.wait, stopper.best) == (0, None)
    stopper.wait, stopper.best = np.int64(2), np.float64(0.5)
    assert (stopper.wait, stopper.best) == (2, 0.5) and type(stopper.wait) is int and type(stopper.best) is float
    stopper.best = None
    assert stopper.best is None and stopper.best_score is None


def test_a_resume_whose_file_holds_a_damaged_stopping_reason_names_the_file_and_the_callback(tmp_path):
    """The refusal of a damaged state named neither the checkpoint it came from nor whose state it was."""
    settings = {**QUIET, "early_stopping.monitor": "val/mse"}
    ToyTrainer(toy_cfg(tmp_path, **settings)).fit()
    last = tmp_path / "run" / "version_0" / "checkpoints" / "last.pt"
    checkpoint = load_checkpoint(last)
    checkpoint["callbacks"]["EarlyStopping[val/mse]"]["stopping_reason"] = "bogus"
    torch.save(checkpoint, last)
    with pytest.raises(ValueError, match="stopping_reason='bogus'") as caught:
        ToyTrainer(toy_cfg(tmp_path, **{**settings, "trainer.max_epochs": 3})).fit(resume="last")
    assert caught.value.__notes__ == [f"in checkpoint '{last}', the state of callback 'EarlyStopping[val/mse]'"]
