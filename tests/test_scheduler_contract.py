"""LR schedulers from ``configure_optimizers`` keep the contract Lightning users know: every return form Lightning
accepts is accepted and steps the same, a form it cannot take is refused naming it and what is valid, ``interval``
and ``frequency`` say when a scheduler steps, a monitored scheduler reads validation's metric (a missing one is an
error naming the metrics there are, or a warning when ``strict`` is False), a step the loss scaler skipped does not
advance the schedule, and a resume continues the schedule where it was."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from toy_trainers import ToyTrainer, toy_cfg

import ampkit
from ampkit.trainer.user_code import UserCodeError

QUIET = {"checkpoint.enabled": False, "logging.tensorboard": False, "trainer.progress_bar": False,
         "logging.throughput": False, "trainer.num_sanity_val_steps": 0}  # fmt: skip


def _fit(tmp_path, trainer_class, resume=None, **overrides):
    trainer = trainer_class(toy_cfg(tmp_path, **{**QUIET, **overrides}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a run of 2 epochs is named as too short for an epoch schedule
        trainer.fit(resume=resume)
    return trainer


def _halving(form: str):
    """A Trainer whose ``configure_optimizers`` returns SGD(lr=0.1) and a StepLR halving it, in ``form``."""

    class Form(ToyTrainer):
        def configure_optimizers(self):
            sgd = torch.optim.SGD(self.module.parameters(), lr=0.1)
            halve = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
            return {
                "optimizer": sgd,
                "[optimizer]": [sgd],
                "(optimizer,)": (sgd,),
                "([optimizer], [scheduler])": ([sgd], [halve]),
                "([optimizer], scheduler)": ([sgd], halve),
                "([optimizer], [config])": ([sgd], [{"scheduler": halve}]),
                "{optimizer, lr_scheduler}": {"optimizer": sgd, "lr_scheduler": halve},
                "{optimizer, lr_scheduler: config}": {"optimizer": sgd, "lr_scheduler": {"scheduler": halve}},
                "[{optimizer, lr_scheduler}]": [{"optimizer": sgd, "lr_scheduler": halve}],
                "({optimizer, lr_scheduler: config},)": ({"optimizer": sgd, "lr_scheduler": {"scheduler": halve}},),
                "{optimizer, lr_scheduler: (scheduler,)}": {"optimizer": sgd, "lr_scheduler": (halve,)},
            }[form]

    return Form


WITHOUT_SCHEDULER = ["optimizer", "[optimizer]", "(optimizer,)"]
WITH_SCHEDULER = [
    "([optimizer], [scheduler])",
    "([optimizer], scheduler)",  # Lightning takes one scheduler outside a list; it was refused as "[0] is list"
    "([optimizer], [config])",
    "{optimizer, lr_scheduler}",
    "{optimizer, lr_scheduler: config}",
    "[{optimizer, lr_scheduler}]",
    "{optimizer, lr_scheduler: (scheduler,)}",  # a list of them was taken, a tuple named as no scheduler
    "({optimizer, lr_scheduler: config},)",
]


@pytest.mark.parametrize("form", WITHOUT_SCHEDULER + WITH_SCHEDULER)
def test_every_form_lightning_accepts_trains_and_steps_its_scheduler_once_per_epoch(tmp_path, form):
    """Two epochs: a scheduler given without an interval steps at each epoch's end (Lightning's default)."""
    trainer = _fit(tmp_path, _halving(form), **{"trainer.max_epochs": 2})
    assert trainer.state.global_step == 16
    schedulers = [sched for spec in trainer._specs for sched in spec.schedulers]
    assert len(schedulers) == (form in WITH_SCHEDULER)
    expected = 0.1 * 0.5**2 if schedulers else 0.1
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(expected)


def _returning(make):
    class Returns(ToyTrainer):
        def configure_optimizers(self):
            return make(torch.optim.SGD(self.module.parameters(), lr=0.1))

    return Returns


def _plateau(sgd):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(sgd)


def _step(sgd):
    return torch.optim.lr_scheduler.StepLR(sgd, 1)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        pytest.param(lambda sgd: None, r"returned None; return an Optimizer, a list of Optimizers, a pair", id="none"),
        pytest.param(lambda sgd: [], r"returned nothing; return an Optimizer", id="empty list"),
        pytest.param(lambda sgd: ([], []), r"returned an empty list of optimizers; return", id="empty pair"),
        pytest.param(lambda sgd: "adam", r"configure_optimizers\(\)\[0\] is str; return an Optimizer", id="str"),
        pytest.param(
            lambda sgd: {"optimizer": "adam"},
            r"is a dict whose 'optimizer' is str \(keys: \['optimizer'\]\); it needs 'optimizer': a torch.optim",
            id="dict without an optimizer",
        ),
        pytest.param(
            lambda sgd: {"optimizer": sgd, "lr_scheduler": {"interval": "step"}},
            r"lr_scheduler dict needs 'scheduler' and may have interval/frequency/monitor/strict/name; got keys "
            r"\['interval'\]",
            id="config without a scheduler",
        ),
        pytest.param(
            lambda sgd: {"optimizer": sgd, "lr_scheduler": {"scheduler": _step(sgd), "interval": "batch"}},
            r"lr_scheduler interval 'batch' must be 'step' or 'epoch'",
            id="interval batch",
        ),
        pytest.param(
            lambda sgd: {"optimizer": sgd, "lr_scheduler": {"scheduler": _step(sgd), "frequency": 0}},
            r"lr_scheduler frequency 0 must be >= 1",
            id="frequency 0",
        ),
        pytest.param(  # Lightning warns and drops such a key; a misspelt "intervals" would silently step per epoch
            lambda sgd: {"optimizer": sgd, "lr_scheduler": {"scheduler": _step(sgd), "intervals": "step"}},
            r"may have interval/frequency/monitor/strict/name; got keys \['intervals', 'scheduler'\]",
            id="unknown scheduler key",
        ),
        pytest.param(
            lambda sgd: ([sgd], "cosine"),
            r"configure_optimizers\(\)\[1\]\[0\]: lr_scheduler is str \('cosine'\); expected a scheduler object",
            id="pair with a string",
        ),
        pytest.param(
            lambda sgd: ([sgd], [_plateau(sgd)]),
            r"a ReduceLROnPlateau steps on a metric: name it with 'monitor'",
            id="plateau without a monitor",
        ),
        pytest.param(
            lambda sgd: {"optimizer": sgd, "lr_scheduler": _step(torch.optim.SGD([sgd.param_groups[0]["params"][0]]))},
            r"its lr_scheduler steps another optimizer than its 'optimizer' \(a SGD that configure_optimizers\(\) "
            r"did not return\)",
            id="scheduler of another optimizer",
        ),
        # Each below was a bare TypeError or AttributeError from inside ampkit, or (strict) a string taken as True.
        pytest.param(
            lambda sgd: {"optimizer": sgd, "lr_scheduler": {"scheduler": _step(sgd), "frequency": "2"}},
            r"lr_scheduler frequency '2' must be an integer >= 1",
            id="frequency a string",
        ),
        pytest.param(
            lambda sgd: {"optimizer": sgd, "lr_scheduler": {"scheduler": _step(sgd), "frequency": 1.5}},
            r"lr_scheduler frequency 1.5 must be an integer >= 1",
            id="frequency a fraction",
        ),
        pytest.param(
            lambda sgd: {
                "optimizer": sgd,
                "lr_scheduler": {"scheduler": _plateau(sgd), "monitor": "val/mse", "strict": "false"},
            },
            r"lr_scheduler strict 'false' must be True or False",
            id="strict a string",
        ),
        pytest.param(
            lambda sgd: {"optimizer": sgd, "lr_scheduler": {"scheduler": _plateau(sgd), "monitor": 5}},
            r"lr_scheduler monitor 5 must be a string \(e.g. 'val/loss'\) or None",
            id="monitor a number",
        ),
        pytest.param(  # a prefix alone: the scheduler waited for a metric with no name
            lambda sgd: {"optimizer": sgd, "lr_scheduler": {"scheduler": _plateau(sgd), "monitor": "val/"}},
            r"lr_scheduler monitor 'val/' names no metric; give one such as 'val/loss', or None",
            id="monitor a prefix alone",
        ),
        pytest.param(  # a newline is in no tag a run logs; a pasted 100 kB one is named by its start and length
            lambda sgd: {"optimizer": sgd, "lr_scheduler": {"scheduler": _plateau(sgd), "monitor": "val/a\n" * 20_000}},
            r"lr_scheduler monitor 'val/a\\nval.{69}\.\.\. \(140002 characters\) names no metric; .*no newline",
            id="monitor a long text of lines",
        ),
        pytest.param(
            lambda sgd: {"optimizer": sgd, "lr_scheduler": _plateau(sgd), "monitor": ""},
            r"monitor '' names no metric; give one such as 'val/loss', or None",
            id="monitor blank",
        ),
        pytest.param(
            lambda sgd: {"optimizer": sgd, "lr_scheduler": torch.optim.lr_scheduler.StepLR},
            r"lr_scheduler is the class StepLR, not a scheduler: construct it on the optimizer",
            id="scheduler class",
        ),
        pytest.param(
            lambda sgd: torch.optim.SGD,
            r"configure_optimizers\(\)\[0\] is the class SGD, not an optimizer: construct it",
            id="optimizer class",
        ),
        pytest.param(  # it was stepped twice per epoch, then named as stepped outside the Trainer
            lambda sgd: (lambda halve: ([sgd], [halve, halve]))(_step(sgd)),
            r"returned one StepLR object twice: the Trainer would step it once for each",
            id="one scheduler twice",
        ),
        pytest.param(
            lambda sgd: (lambda other: [{"optimizer": sgd, "lr_scheduler": _step(other)}, other])(
                torch.optim.SGD([sgd.param_groups[0]["params"].pop()], lr=0.1)
            ),
            r"steps another optimizer than its 'optimizer' \(that of configure_optimizers\(\)\[1\]\)",
            id="scheduler beside the wrong one of two optimizers",
        ),
    ],
)
def test_a_form_it_cannot_take_is_refused_before_training_naming_it(tmp_path, make, message):
    trainer = _returning(make)(toy_cfg(tmp_path, **QUIET))
    with pytest.raises(UserCodeError, match=message):
        trainer.fit()
    assert trainer.state.global_step == 0


class StepEvery(ToyTrainer):
    """A StepLR halving per step of it, on SGD; ``interval`` and ``frequency`` as the class says."""

    interval, frequency = "step", 2

    def configure_optimizers(self):
        sgd = torch.optim.SGD(self.module.parameters(), lr=0.1)
        self.halve = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
        config = {"scheduler": self.halve, "interval": self.interval, "frequency": self.frequency}
        return {"optimizer": sgd, "lr_scheduler": config}


def test_a_step_frequency_counts_the_optimizer_s_steps_over_the_whole_run(tmp_path):
    """Five iterations an epoch (40 samples in 8s), two epochs, frequency 2: the scheduler steps at the optimizer's
    steps 2, 4, 6, 8 and 10, five times. (Lightning counts the batch index within each epoch, so it steps at
    batches 2 and 4 of each, four times; the rule here is the one docs/trainer.md states.)"""
    trainer = _fit(tmp_path, StepEvery, **{"data.n": 40, "trainer.max_epochs": 2})
    assert trainer.state.global_step == 10
    assert trainer.halve.last_epoch == 5


def test_a_step_frequency_counts_iterations_not_batches_under_accumulation(tmp_path):
    """Eight batches in windows of 2 are four optimizer steps an epoch: frequency 2 steps twice an epoch."""
    trainer = _fit(tmp_path, StepEvery, **{"trainer.accumulate_grad_batches": 2, "trainer.max_epochs": 2})
    assert trainer.state.global_step == 8
    assert trainer.halve.last_epoch == 4


def test_an_epoch_frequency_steps_after_every_nth_epoch(tmp_path):
    trainer = type("EpochEvery", (StepEvery,), {"interval": "epoch", "frequency": 2})
    run = _fit(tmp_path, trainer, **{"data.n": 16, "trainer.max_epochs": 5})
    assert run.halve.last_epoch == 2  # after epochs 2 and 4 (1-based), not after the 5th
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)


class PlateauOn(ToyTrainer):
    """ReduceLROnPlateau at each epoch's end on ``monitor``; threshold=10 makes no validation an improvement."""

    monitor, strict = "val/mse", True

    def configure_optimizers(self):
        sgd = torch.optim.SGD(self.module.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(sgd, patience=0, factor=0.5, threshold=10.0)
        config = {"scheduler": plateau, "monitor": self.monitor, "strict": self.strict, "name": "plateau"}
        return {"optimizer": sgd, "lr_scheduler": config}


def test_a_plateau_scheduler_steps_on_the_validation_metric_it_monitors(tmp_path):
    trainer = _fit(tmp_path, PlateauOn, **{"data.n": 16, "trainer.max_epochs": 3})
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


class PlateauOnALoggedTag(PlateauOn):
    """Monitors a tag its own on_validation_end logs (Lightning's on_validation_epoch_end + self.log('val_auc'))."""

    monitor = "val_auc"

    def on_validation_end(self, metrics):
        self.log("val_auc", 1.0)


def test_a_plateau_scheduler_steps_on_a_tag_logged_in_on_validation_end(tmp_path):
    trainer = _fit(tmp_path, PlateauOnALoggedTag, **{"data.n": 16, "trainer.max_epochs": 3})
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


class DecayBesideAMonitor(ToyTrainer):
    """Lightning's habit: 'monitor' beside the optimizer while its scheduler is an epoch decay."""

    def configure_optimizers(self):
        sgd = torch.optim.SGD(self.module.parameters(), lr=0.1)
        self.halve = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
        return {"optimizer": sgd, "lr_scheduler": self.halve, "monitor": "val/mse"}


def test_a_monitor_beside_the_optimizer_leaves_a_scheduler_that_takes_no_metric_stepping_as_it_would(tmp_path):
    """The StepLR was stepped with the metric (step(14.4)), which torch reads as an epoch number: its epoch count
    became the metric and the rate fell to 6e-6 in 3 epochs. Lightning gives the monitor to a plateau scheduler
    only; so does ampkit now."""
    run = DecayBesideAMonitor(toy_cfg(tmp_path, **{**QUIET, "data.n": 16, "trainer.max_epochs": 3}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "The epoch parameter in `scheduler.step()` ..." warning
        run.fit()
    assert run.halve.last_epoch == 3
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


def test_a_monitor_in_the_dict_of_a_scheduler_that_takes_no_metric_is_refused(tmp_path):
    make = lambda sgd: {"optimizer": sgd, "lr_scheduler": {"scheduler": _step(sgd), "monitor": "val/mse"}}  # noqa: E731
    with pytest.raises(UserCodeError, match=r"its StepLR has 'monitor': 'val/mse', but it steps without a metric"):
        _returning(make)(toy_cfg(tmp_path, **QUIET)).fit()


def test_a_monitor_validation_never_returns_is_an_error_naming_the_metrics_it_does(tmp_path):
    """Without the sanity validation (which refuses it before training) the first epoch-end step raises, naming
    the scheduler, its optimizer and what validation produced, as Lightning names its available metrics."""
    trainer = type("Misspelt", (PlateauOn,), {"monitor": "val/loss"})(toy_cfg(tmp_path, **QUIET))
    with pytest.raises(KeyError, match=r"scheduler 'plateau' of 'sgd' monitors 'val/loss', but validation produced "
                       r"\['mse'\]"):  # fmt: skip
        trainer.fit()


def test_the_sanity_validation_refuses_a_monitor_validation_never_returns_before_training(tmp_path):
    from ampkit import ConfigError

    trainer = type("Misspelt", (PlateauOn,), {"monitor": "val/loss"})
    run = trainer(toy_cfg(tmp_path, **{**QUIET, "trainer.num_sanity_val_steps": 2}))
    with pytest.raises(ConfigError, match=r"the scheduler of optimizer 'sgd': monitors 'val/loss', which is not a "
                       r"validation metric; validation_step returns val/mse"):  # fmt: skip
        run.fit()
    assert run.state.global_step == 0


def test_a_monitor_missing_under_strict_false_warns_at_each_step_and_leaves_the_rate(tmp_path):
    trainer = type("Lenient", (PlateauOn,), {"monitor": "val/loss", "strict": False})
    run = trainer(toy_cfg(tmp_path, **{**QUIET, "data.n": 16, "trainer.max_epochs": 2}))
    with pytest.warns(UserWarning, match=r"monitors 'val/loss', but validation produced \['mse'\]; not stepping it "
                      r"\(strict=False\)") as caught:  # fmt: skip
        run.fit()
    assert sum("not stepping it" in str(w.message) for w in caught) == 2
    assert run.optimizer.param_groups[0]["lr"] == 0.1


class OverflowsAt(StepEvery):
    """Float16 under O1; the loss of the iterations in ``overflow_at`` is infinite, so their step is skipped."""

    frequency = 1
    overflow_at: tuple[int, ...] = (1,)

    def training_step(self, batch):
        loss = super().training_step(batch)
        return loss * math.inf if self.state.iteration in self.overflow_at else loss


FP16 = {"precision.opt_level": "O1", "precision.dtype": "float16", "precision.init_scale": 256, "data.n": 32}


def test_a_step_the_scaler_skipped_does_not_advance_the_schedule_nor_make_torch_warn(tmp_path):
    """The first iteration overflows: torch's recipe steps the scheduler only after a step that was taken, so it
    never warns "lr_scheduler.step() before optimizer.step()"; the skipped iteration leaves the rate where it was."""
    trainer = OverflowsAt(toy_cfg(tmp_path, **{**QUIET, **FP16}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit()
    opt_state = trainer.optimizer_state[trainer.optimizer]
    assert (trainer.state.global_step, opt_state.steps, opt_state.skipped_steps) == (4, 3, 1)
    assert trainer.halve.last_epoch == 3
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


def test_an_epoch_whose_every_step_was_skipped_does_not_step_an_epoch_scheduler(tmp_path):
    trainer = type("AllSkipped", (OverflowsAt,), {"interval": "epoch", "overflow_at": (1, 2, 3, 4)})
    run = trainer(toy_cfg(tmp_path, **{**QUIET, **FP16, "trainer.max_epochs": 2}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the epoch that trained nothing is named
        run.fit()
    assert run.optimizer_state[run.optimizer].steps == 4  # epoch 2 stepped, epoch 1 did not
    assert run.halve.last_epoch == 1


class ThreeSchedules(ToyTrainer):
    """A warm-up per step, a decay per epoch and a plateau on validation: each keeps state a resume must restore."""

    def configure_optimizers(self):
        body = torch.optim.SGD(self.module[0].parameters(), lr=0.1)
        head = torch.optim.SGD(self.module[3].parameters(), lr=0.1)
        self.warmup = torch.optim.lr_scheduler.LambdaLR(body, lambda step: min(1.0, (step + 1) / 5))
        self.decay = torch.optim.lr_scheduler.StepLR(head, step_size=1, gamma=0.7)
        self.plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(head, patience=0, factor=0.5, threshold=0.05)
        return [
            {"optimizer": body, "lr_scheduler": {"scheduler": self.warmup, "interval": "step"}, "name": "body"},
            {"optimizer": head, "lr_scheduler": [self.decay, {"scheduler": self.plateau}], "monitor": "val/mse",
             "name": "head"},
        ]  # fmt: skip


def test_a_resume_mid_epoch_continues_every_schedule_where_it_was(tmp_path):
    """Stopped by max_steps in the middle of the second epoch and resumed: each scheduler's state and each rate
    equal an uninterrupted run's."""
    settings = {"checkpoint.enabled": True, "trainer.max_epochs": 3}
    whole = _fit(tmp_path / "whole", ThreeSchedules, **settings)
    _fit(tmp_path / "split", ThreeSchedules, **settings, **{"trainer.max_steps": 11})
    resumed = _fit(tmp_path / "split", ThreeSchedules, resume="last", **settings)
    assert resumed.state.global_step == whole.state.global_step == 24
    for name in ("warmup", "decay", "plateau"):
        assert getattr(resumed, name).state_dict() == getattr(whole, name).state_dict(), name
    for name, optimizer in whole.optimizers.items():
        assert resumed.optimizers[name].param_groups[0]["lr"] == optimizer.param_groups[0]["lr"], name


class StepsItsSchedulerByHand(ToyTrainer):
    """Lightning's manual optimization steps its schedulers itself: ``self.lr_schedulers().step()``."""

    automatic_optimization = False

    def configure_optimizers(self):
        sgd = torch.optim.SGD(self.module.parameters(), lr=0.1)
        return {"optimizer": sgd, "lr_scheduler": {"scheduler": _step(sgd), "interval": "step"}}

    def training_step(self, batch):
        self.backward(super().training_step(batch))
        self.step(self.optimizer)
        self.lr_schedulers().step()


def test_lightning_s_lr_schedulers_under_manual_optimization_says_the_trainer_steps_them(tmp_path):
    expected = r"no attribute 'lr_schedulers' \(Lightning's name; here it is nothing to step: each scheduler"
    with pytest.raises(AttributeError, match=expected):
        StepsItsSchedulerByHand(toy_cfg(tmp_path, **QUIET)).fit()


class StepsItsOwnSchedulerToo(StepsItsSchedulerByHand):
    """The port kept its scheduler and steps it in training_step, as Lightning's manual optimization needs."""

    def configure_optimizers(self):
        config = super().configure_optimizers()
        self.halve = config["lr_scheduler"]["scheduler"]
        return config

    def training_step(self, batch):
        self.backward(ToyTrainer.training_step(self, batch))
        self.step(self.optimizer)
        self.halve.step()


def test_a_scheduler_the_trainer_steps_and_the_step_steps_too_is_refused_at_once(tmp_path):
    """It stepped twice per iteration without a word: the rate fell twice as fast as the schedule said."""
    run = StepsItsOwnSchedulerToo(toy_cfg(tmp_path, **QUIET))
    with pytest.raises(UserCodeError, match=r"the LR scheduler StepLR of optimizer 'sgd' was stepped outside the "
                       r"Trainer \(its count went from 2 to 3 since the Trainer stepped it\)"):  # fmt: skip
        run.fit()
    assert run.state.global_step == 1


class OneCycle(ToyTrainer):
    def configure_optimizers(self):
        sgd = torch.optim.SGD(self.module.parameters(), lr=0.1)
        one_cycle = torch.optim.lr_scheduler.OneCycleLR(sgd, max_lr=0.1, total_steps=8)
        return {"optimizer": sgd, "lr_scheduler": {"scheduler": one_cycle, "interval": "step"}}


def test_a_one_cycle_schedule_the_run_would_step_past_is_refused_before_training(tmp_path):
    """torch raised 'Tried to step 9 times' at the ninth step, after training that far (and, without a checkpoint
    since, losing it). A schedule the run fits in trains, also resumed; a resume that would outrun it is refused."""
    half = {"checkpoint.enabled": True, "trainer.max_steps": 4, "trainer.max_epochs": 2}
    assert _fit(tmp_path, OneCycle, **half).state.global_step == 4
    resumed = _fit(tmp_path, OneCycle, resume="last", **{**half, "trainer.max_steps": 8})
    assert resumed.state.global_step == 8
    refused = r"the OneCycleLR of optimizer 'sgd' steps at each step of it \('interval': 'step'\), {} times in this run"
    with pytest.raises(UserCodeError, match=refused.format(2) + r", but has total_steps=8 \(0 left\): .* step 9"):
        _fit(tmp_path, OneCycle, resume="last", **{**half, "trainer.max_steps": 10})
    with pytest.raises(UserCodeError, match=refused.format(16) + r".*total_steps=self.num_training_steps"):
        _fit(tmp_path / "two epochs", OneCycle, **{"trainer.max_epochs": 2})
    assert not (tmp_path / "two epochs").exists()


class _LogsAccuracyAtPersist(ampkit.Callback):
    """Logs an epoch's accuracy in PERSIST (after the Trainer's own hook): 0.5, then worse, 0.4, for a plateau."""

    phase = ampkit.Phase.PERSIST

    def on_train_epoch_end(self, trainer):
        trainer.log("train/acc", 0.5 if trainer.state.epoch == 0 else 0.4)


class _SavesAndLogsAccuracy(_LogsAccuracyAtPersist):
    saves_checkpoints = True  # its on_train_epoch_end runs after epoch-interval schedulers step


class PlateauOnEpochEndValue(ToyTrainer):
    def configure_optimizers(self):
        sgd = torch.optim.SGD(self.module.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(sgd, mode="max", patience=0, factor=0.5)
        return {"optimizer": sgd, "lr_scheduler": {"scheduler": plateau, "monitor": "train/acc", "interval": "epoch"}}


def test_a_plateau_scheduler_steps_on_an_epoch_end_value_a_persist_callback_logs(tmp_path):
    """Epoch schedulers stepped before every PERSIST hook: the plateau scheduler monitoring a value a PERSIST callback
    logs at the epoch's end found none and the run was refused. Lightning steps them after the epoch-end callbacks;
    ampkit does so too, before the checkpoint writers' alone (whose save holds the stepped scheduler)."""
    cfg = toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 2})
    trainer = PlateauOnEpochEndValue(cfg, callbacks=[_LogsAccuracyAtPersist()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first iteration gave the monitor no value yet: said
        trainer.fit()
    assert trainer.state.epoch == 2
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)  # 0.5, then 0.4: one halving


def test_a_scheduler_missing_an_epoch_end_value_a_checkpoint_writer_logs_names_where_it_counts(tmp_path):
    """The error only said to log it in training_step, though it was logged at the epoch's end, after the step."""
    trainer = PlateauOnEpochEndValue(toy_cfg(tmp_path, **QUIET), callbacks=[_SavesAndLogsAccuracy()])
    said = (
        r"or in on_train_epoch_end by the Trainer's own hook or a callback that saves no checkpoints \(epoch-interval "
        r"schedulers step before the checkpoint writers' on_train_epoch_end"
    )
    with pytest.raises(UserCodeError, match=said):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the first iteration gave the monitor no value: said, then refused
            trainer.fit()
