"""What a Lightning user reaches for first: hooks on the Trainer subclass, no trainer_class in Python,
Lightning's ``configure_optimizers`` return forms."""

from __future__ import annotations

import re

import pytest
import torch
from toy_trainers import ManualOptimization, ToyTrainer, toy_cfg

from ampkit import Callback
from ampkit.trainer.distributed import DistributedEnv

QUIET = {"checkpoint.enabled": False, "logging.tensorboard": False, "trainer.progress_bar": False}


def test_hooks_defined_on_the_subclass_run_after_the_callbacks(tmp_path):
    calls: list[str] = []

    class Recorder(Callback):
        def on_train_epoch_end(self, trainer):
            calls.append("callback")

    class ValidationHook:  # a mixin's hooks count too
        def on_validation_end(self, metrics):
            calls.append(f"trainer val {sorted(metrics)}")

    class Hooked(ValidationHook, ToyTrainer):
        def on_train_epoch_end(self):
            calls.append(f"trainer epoch {self.state.epoch}")

    Hooked(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 2}), callbacks=[Recorder()]).fit()
    assert calls == [
        "trainer val ['mse']",  # the sanity validation before training
        "trainer val ['mse']",
        "callback",
        "trainer epoch 0",
        "trainer val ['mse']",
        "callback",
        "trainer epoch 1",
    ]


def test_a_misspelt_or_misshapen_hook_is_refused_before_anything_runs(tmp_path):
    class Misspelt(ToyTrainer):
        def on_validation_epoch_ends(self):
            pass

    with pytest.raises(
        TypeError, match=r"Misspelt.on_validation_epoch_ends is not a hook.*did you mean .*'on_validation_end'\?"
    ):
        Misspelt(toy_cfg(tmp_path))

    class CallbackShaped(ToyTrainer):
        def on_train_batch_end(self, trainer, outputs, batch):
            pass

    with pytest.raises(TypeError, match=r"define it as def on_train_batch_end\(self, outputs, batch\)"):
        CallbackShaped(toy_cfg(tmp_path))


class _PortedSetup(ToyTrainer):
    def setup(self, stage):  # Lightning calls it before each run; the Trainer never would
        self.weights = torch.ones(2)


class _PortedEpochEnd(ToyTrainer):
    def validation_epoch_end(self, outputs):  # Lightning 1.x
        self.best = outputs


class _OwnSetupHelper(ToyTrainer):
    def setup(self):  # a helper of the Trainer's own, called by its code: no Lightning 'stage'
        return 1


@pytest.mark.parametrize(("trainer_class", "said"), [
    (_PortedSetup, "_PortedSetup.setup is a LightningModule hook, which ampkit never calls; in ampkit: "
                   "configure_model() builds the model"),
    (_PortedEpochEnd, "_PortedEpochEnd.validation_epoch_end is a LightningModule hook, which ampkit never calls; in "
                      "ampkit: on_validation_end(self, metrics)"),
])  # fmt: skip
def test_a_lightning_module_hook_the_trainer_never_calls_is_refused_at_construction(tmp_path, trainer_class, said):
    """A ported setup(self, stage) or validation_epoch_end never ran, without a word: what it set was missing later,
    or its work silently undone."""
    with pytest.raises(TypeError, match=re.escape(said)):
        trainer_class(toy_cfg(tmp_path, **QUIET))
    assert _OwnSetupHelper(toy_cfg(tmp_path, **QUIET)).setup() == 1


@pytest.mark.parametrize(
    ("hook", "said"),
    [
        ("on_validation_epoch_end", "here: on_validation_end, whose metrics are validation_step's means over the set"),
        ("on_sanity_check_start", "here: on_validation_start, where trainer.state.stage == 'sanity'"),
        ("on_before_batch_transfer", "here: the DataLoader's collate_fn, which runs before the Trainer moves the "
                                     "batch"),
        ("on_test_batch_end", "here: test_step itself: what it returns is averaged over the set"),
        ("on_epoch_end", "here: on_train_epoch_end."),  # Lightning 1.x
    ],
)  # fmt: skip
def test_a_lightning_hook_the_trainer_never_calls_names_what_does_its_work_not_a_near_name(tmp_path, hook, said):
    """A Lightning callback's or module's on_... hook ampkit lacks was answered with the nearest names:
    on_before_batch_transfer with 'did you mean on_before_backward', on_sanity_check_start with on_fit_start."""
    as_callback = type("PortedCallback", (Callback,), {hook: lambda self, *args: None})
    with pytest.raises(TypeError, match=re.escape(f"PortedCallback.{hook} is not a hook the Trainer calls; it is "
                                                  f"Lightning's hook; {said}")) as caught:  # fmt: skip
        ToyTrainer(toy_cfg(tmp_path, **QUIET), callbacks=[as_callback()]).fit()
    assert "did you mean" not in str(caught.value)
    as_module = type("PortedModule", (ToyTrainer,), {hook: lambda self, *args: None})
    with pytest.raises(TypeError, match=re.escape(said)):
        as_module(toy_cfg(tmp_path, **QUIET))


class _PortedCallbackSetup(Callback):
    def setup(self, trainer, pl_module, stage):  # a Lightning Callback's
        self.ready = True


def test_a_lightning_callback_s_setup_is_refused_when_the_run_starts(tmp_path):
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET), callbacks=[_PortedCallbackSetup()])
    said = "_PortedCallbackSetup.setup is a Callback hook, which ampkit never calls; in ampkit: on_fit_start"
    with pytest.raises(TypeError, match=re.escape(said)):
        trainer.fit()


def test_a_callback_is_not_called_for_the_hooks_it_declares_unused(tmp_path):
    calls: list[str] = []

    class ManualOnly(Callback):
        def unused_hooks(self, trainer):
            return {"on_after_backward"} if trainer.automatic_optimization else ()

        def on_after_backward(self, trainer, backward):
            calls.append("after_backward")

        def on_train_batch_end(self, trainer, outputs, batch):
            calls.append("batch_end")

    class Manual(ManualOptimization, ToyTrainer):
        pass

    ToyTrainer(toy_cfg(tmp_path / "auto", **QUIET, **{"trainer.max_steps": 2}), callbacks=[ManualOnly()]).fit()
    assert calls == ["batch_end", "batch_end"]
    calls.clear()
    Manual(toy_cfg(tmp_path / "manual", **QUIET, **{"trainer.max_steps": 2}), callbacks=[ManualOnly()]).fit()
    assert calls == ["after_backward", "batch_end"] * 2


def test_an_unused_hook_that_is_no_hook_is_refused(tmp_path):
    class Typo(Callback):
        def unused_hooks(self, trainer):
            return {"on_after_backwards"}

    with pytest.raises(ValueError, match=r"Typo.unused_hooks\(\) names \['on_after_backwards'\], not hooks"):
        ToyTrainer(toy_cfg(tmp_path, **QUIET), callbacks=[Typo()]).fit()


def test_trainer_class_is_optional_in_python(tmp_path):
    quiet = {"checkpoint": {"enabled": False}, "logging": {"tensorboard": False}, "trainer": {"progress_bar": False}}
    trainer = ToyTrainer({"run_dir": str(tmp_path / "run"), **quiet})
    trainer.fit()
    assert trainer.cfg.trainer_class == "toy_trainers:ToyTrainer"
    assert "trainer_class: toy_trainers:ToyTrainer" in (trainer.version_dir / "config.yaml").read_text()


class TwoOptimizersTwoSchedulers(ToyTrainer):
    """Lightning's ``([opt1, opt2], [sched1, sched2])``, schedulers listed in the other order."""

    def configure_optimizers(self):
        first, last = self.module[0], self.module[3]
        opt_a = torch.optim.SGD(first.parameters(), lr=0.1)
        opt_b = torch.optim.SGD(last.parameters(), lr=0.2)
        sched_b = {
            "scheduler": torch.optim.lr_scheduler.StepLR(opt_b, 1, gamma=0.5),
            "name": "decay_b",
            "interval": "step",
        }
        sched_a = {"scheduler": torch.optim.lr_scheduler.StepLR(opt_a, 1, gamma=0.1), "interval": "step"}
        return [opt_a, opt_b], [sched_b, sched_a]


class BareScheduler(ToyTrainer):
    """A scheduler given without an interval, in each of Lightning's forms."""

    form = "pair"

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        if self.form == "pair":
            return [optimizer], [schedule]
        if self.form == "dict":
            return {"optimizer": optimizer, "lr_scheduler": schedule}
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "frequency": 1}}


@pytest.mark.parametrize("form", ["pair", "dict", "config"])
def test_a_scheduler_without_an_interval_steps_once_per_epoch_as_in_lightning(tmp_path, form):
    """Lightning's default interval is "epoch": a ported StepLR(step_size=30) must not decay 30 times too soon."""
    trainer = type("Bare", (BareScheduler,), {"form": form})(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 2}))
    trainer.fit()
    assert trainer.state.global_step > 2 and trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)


def test_lightning_pair_of_lists_attaches_each_scheduler_to_its_optimizer(tmp_path):
    trainer = TwoOptimizersTwoSchedulers(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 3}))
    trainer.fit()
    lrs = {name: opt.param_groups[0]["lr"] for name, opt in trainer.optimizers.items()}
    assert lrs == pytest.approx({"sgd_0": 0.1 * 0.1**3, "sgd_1": 0.2 * 0.5**3})
    assert [s.schedulers[0].name for s in trainer._specs] == [None, "decay_b"]


def test_a_scheduler_of_an_unlisted_optimizer_is_refused(tmp_path):
    class Stray(ToyTrainer):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.module.parameters(), lr=0.1)
            other = torch.optim.SGD(self.module.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.StepLR(other, 1)]

    with pytest.raises(ValueError, match=r"configure_optimizers\(\)\[1\]\[0\] is a scheduler of an optimizer missing"):
        Stray(toy_cfg(tmp_path, **QUIET)).fit()


def test_a_monitored_scheduler_without_an_interval_steps_once_per_epoch(tmp_path):
    class Plateau(ToyTrainer):  # Lightning's documented shape: no interval given
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.module.parameters(), lr=0.05)
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5, threshold=10.0)
            return {"optimizer": opt, "lr_scheduler": sched, "monitor": "val/mse"}

    trainer = Plateau(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 2}))
    trainer.fit()
    # threshold=10: no validation counts as an improvement, so the LR halves at each of the 2 epoch ends
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**2)


def test_top_level_monitor_and_non_strict_scheduler(tmp_path):
    class Plateau(ToyTrainer):
        strict = True

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.module.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
            return {
                "optimizer": opt,
                "lr_scheduler": {"scheduler": sched, "interval": "step", "strict": self.strict, "name": "plateau"},
                "monitor": "val/mse",
            }

    with pytest.raises(KeyError, match="scheduler 'plateau' of 'sgd' monitors 'val/mse'"):
        Plateau(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 1})).fit()
    Plateau.strict = False
    with pytest.warns(UserWarning, match="not stepping it"):
        Plateau(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 1})).fit()


class LogsWithLightningOptions(ToyTrainer):
    def training_step(self, batch):
        loss = super().training_step(batch)
        self.log("train_loss", loss, on_epoch=True, prog_bar=True, sync_dist=True)
        return loss


def test_log_with_lightning_only_options_names_what_does_their_work(tmp_path):
    """Lightning's prog_bar: one UserCodeError naming it and log()'s own options, not a TypeError; sync_dist=True
    beside it is taken in one process, where Lightning syncs nothing either."""
    from ampkit.trainer.user_code import UserCodeError

    trainer = LogsWithLightningOptions(toy_cfg(tmp_path, **QUIET))
    with pytest.raises(UserCodeError, match=r"log\('train_loss'\) got prog_bar=True, which it does "
                       r"not take: log\(\) takes on_step, on_epoch, always and step; the progress"):  # fmt: skip
        trainer.fit()


class LogsWithLightningOptionsAtWhatLogDoes(ToyTrainer):
    def training_step(self, batch):
        loss = super().training_step(batch)
        self.log("plain", loss, on_epoch=True)
        options = {"prog_bar": False, "logger": True, "sync_dist": False, "rank_zero_only": False}
        self.log("spelt_out", loss, on_epoch=True, enable_graph=False, reduce_fx="mean", **options)
        self.log("torch_mean", loss, on_epoch=True, reduce_fx=torch.mean)
        self.log("avg", loss, on_epoch=True, reduce_fx="avg")  # Lightning's other name for the mean, and its case
        self.log("capitalised", loss, on_epoch=True, reduce_fx="Mean")
        self.log("peak", loss, reduce_fx="max")  # on_step only: Lightning reduces nothing, its max is the value
        self.log("least", loss, reduce_fx=torch.min)
        # one process: sync_dist=True syncs nothing, as in Lightning; the rest change nothing at any value
        lightning = {"sync_dist": True, "sync_dist_group": None, "rank_zero_only": True, "add_dataloader_idx": False,
                     "metric_attribute": "acc", "batch_size": None}  # fmt: skip
        self.log("synced", loss, on_epoch=True, **lightning)
        return loss


def test_log_takes_lightning_options_at_the_values_that_ask_for_what_it_does(tmp_path):
    """A port spelling out Lightning's defaults (sync_dist=False, reduce_fx="mean") logs as without them, as does
    one giving an on_step value a reduce_fx (Lightning reduces only epoch values); the same options at other values,
    or a 0 for a False, are still refused by name and value."""
    from ampkit.trainer.user_code import UserCodeError

    trainer = LogsWithLightningOptionsAtWhatLogDoes(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 1}))
    trainer.fit()
    means = trainer.monitor_values()
    assert means["plain_epoch"] == means["spelt_out_epoch"] == means["torch_mean_epoch"]
    assert means["plain_epoch"] == means["avg_epoch"] == means["capitalised_epoch"] == means["synced_epoch"]
    trainer = LogsWithLightningOptionsAtWhatLogDoes(toy_cfg(tmp_path, **QUIET))
    trainer.log("peak", 2.0, reduce_fx="MAX")  # outside a batch: written at once, as without reduce_fx
    assert [(tag, value) for tag, value, _ in trainer.logged_scalars] == [("peak", 2.0)]
    for refused, shown in [
        ({"sync_dist": 0}, "sync_dist=0"),
        ({"reduce_fx": "max", "on_epoch": True}, "reduce_fx='max'"),  # an epoch's max, which log() does not take
        ({"reduce_fx": "median"}, "reduce_fx='median'"),  # not Lightning's either, even on_step
        ({"reduce_fx": torch.max, "on_epoch": True}, "reduce_fx=<built-in method max"),
        ({"prog_bar": True, "logger": True}, "got prog_bar=True, which"),
        ({"logger": False}, "got logger=False, which"),
        ({"rank_zero_only": 1}, "got rank_zero_only=1, which"),
        ({"add_dataloader_idx": "no"}, "got add_dataloader_idx='no', which"),
        ({"enable_graph": True}, "got enable_graph=True, which it does not take: "),
        ({"enable_graph": True}, "; log() detaches every value and keeps no graph: keep the tensor yourself"),
        ({"batch_size": 0}, "log('x', batch_size=0): batch_size is the batch's weight in an on_epoch mean: an "),
        ({"batch_size": 2.5}, "log('x', batch_size=2.5): batch_size is the batch's weight"),
        ({"batch_size": True}, "log('x', batch_size=True): batch_size is the batch's weight"),
    ]:
        with pytest.raises(UserCodeError, match=re.escape(shown)):
            trainer.log("x", 1.0, **refused)
    trainer.dist = DistributedEnv(0, 2)  # under torchrun: rank zero's value alone is written, so a sync is refused
    with pytest.raises(UserCodeError, match=r"got sync_dist=True, which it does not take: .*; under torchrun each "
                       r"rank logs its own value .* all-reduce it across the ranks yourself first"):  # fmt: skip
        trainer.log("x", 1.0, sync_dist=True)


class LogsWithABatchSize(ToyTrainer):
    """Logs its batch index with a batch_size of its own (index + 1), and its loss with batch_size given on_step only,
    where Lightning weighs nothing."""

    def training_step(self, batch):
        loss = super().training_step(batch)
        self.log("train/index", float(self.state.batch_idx), on_epoch=True, batch_size=self.state.batch_idx + 1)
        self.log("train/index_by_samples", float(self.state.batch_idx), on_epoch=True)
        self.log("train/loss_now", loss, batch_size=3)
        return loss


def test_log_weighs_an_epoch_mean_by_lightning_s_batch_size(tmp_path):
    """Lightning's batch_size is the value's weight in its epoch mean: it was refused, and a port had to move the
    weight into samples_in. Without it the weight is samples_in(batch), as before."""
    trainer = LogsWithABatchSize(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 1, "data.n": 40}))
    trainer.fit()  # 5 batches of 8
    means = trainer.monitor_values()
    assert means["train/index_epoch"] == pytest.approx(sum(i * (i + 1) for i in range(5)) / sum(range(1, 6)))
    assert means["train/index_by_samples_epoch"] == pytest.approx(2.0)


class PlateauEachEpoch(ToyTrainer):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.module.parameters(), lr=0.05)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val/mse"}}


def test_an_epoch_scheduler_stepping_before_the_first_validation_is_refused_before_training(tmp_path):
    """Validation every 2nd epoch: it would step after epoch 0 with no metric (a KeyError after a wasted epoch)."""
    from ampkit import ConfigError

    trainer = PlateauEachEpoch(toy_cfg(tmp_path, **QUIET, **{"trainer.val_every_n_epochs": 2, "trainer.max_epochs": 4}))
    with pytest.raises(ConfigError, match=r"monitors 'val/mse' and steps every 1 epoch\(s\), but validation first runs "
                       r"after trainer.val_every_n_epochs=2: give it 'frequency': 2"):  # fmt: skip
        trainer.fit()
    assert trainer.state.global_step == 0


@pytest.mark.parametrize(
    ("call", "said"),
    [
        (lambda t: t.validate(ckpt_path="best"), "validate() takes ckpt: Lightning's ckpt_path is ckpt= here"),
        (
            lambda t: t.test(ckpt_path="last"),
            "test() takes ckpt: Lightning's ckpt_path is ckpt= here (test(ckpt='last')",
        ),
        (lambda t: t.fit(ckpt_path="last"), "fit() takes resume: Lightning's ckpt_path is resume= here"),
        (lambda t: t.validate(t), "Lightning's validate(model, ...) takes a model or loaders first; here the Trainer "),
        (
            lambda t: t.fit(torch.nn.Linear(2, 2)),
            "fit() takes resume: Lightning's fit(model, ...) takes a model or loaders first",
        ),
        (lambda t: t.test(None, [1]), "its test_dataloader() returns the batches: the first argument is ckpt"),
        (
            lambda t: t.validate(dataloaders=[1]),
            "Lightning's dataloaders has no place here: the Trainer's val_dataloader",
        ),
        (lambda t: t.test(verbose=False), "Lightning's verbose has no place here: test() prints nothing and returns"),
        (lambda t: t.predict(return_predictions=True), "predict() takes ckpt, output, overwrite: Lightning's return_"),
        (lambda t: t.validate(ckpt_pth="last"), "validate() takes ckpt: it has no argument 'ckpt_pth'"),
    ],
)
def test_lightning_s_arguments_to_fit_and_evaluation_name_what_does_their_work(tmp_path, call, said):
    """trainer.test(ckpt_path="best"), trainer.fit(model): Python's bare TypeError ('unexpected keyword argument
    ckpt_path'), or for a model or loader given first, a message about checkpoint paths naming no Lightning habit."""
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET))
    with pytest.raises(TypeError, match=re.escape(said)):
        call(trainer)
    assert not (tmp_path / "run").exists()  # refused before anything ran


class WritesThroughTheExperiment(ToyTrainer):
    def training_step(self, batch):
        loss = super().training_step(batch)
        self.logger.experiment.add_scalar("loss", loss.item(), self.state.global_step)
        return loss


def test_lightning_s_logger_attributes_name_ampkit_s_way(tmp_path):
    """self.logger.experiment.add_scalar(...), Lightning's way to the SummaryWriter, was a bare AttributeError; it
    names self.log and the logger's own methods, under TensorBoard and on a logger that drops everything."""
    from ampkit.trainer.logger import Logger

    trainer = WritesThroughTheExperiment(toy_cfg(tmp_path, **{"trainer.progress_bar": False, "trainer.max_steps": 1}))
    with pytest.raises(AttributeError, match=r"'TensorBoardWriter' object has no attribute 'experiment' \(Lightning's "
                       r"name; here it is self.log\(tag, value\) for scalars, and self.logger.log_image"):  # fmt: skip
        trainer.fit()
    with pytest.raises(AttributeError, match=r"no attribute 'log_metrics' \(Lightning's name; here it is self.log"):
        Logger().log_metrics({"acc": 1.0})
    with pytest.raises(AttributeError, match=r"^'Logger' object has no attribute 'nothing_of_lightning's'$"):
        getattr(Logger(), "nothing_of_lightning's")
