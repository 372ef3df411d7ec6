"""Trainer flags a Lightning user types keep a contract: a key ampkit names otherwise (``val_check_interval``,
``check_val_every_n_epoch``, ``gradient_clip_val``), one that lives in another section (``trainer.log_every_n_steps``)
and one ampkit has no key for (``fast_dev_run``, ``overfit_batches``, ``save_on_train_epoch_end``) are refused
naming what does its work here, before training; the recipe named for ``fast_dev_run`` runs one batch of each and
writes no checkpoint nor events; and the learning rate each optimizer's step used reaches TensorBoard per param
group, as Lightning's LearningRateMonitor logs it."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from omegaconf import OmegaConf
from toy_trainers import ToyTrainer, toy_cfg

from ampkit import Callback, ConfigError
from ampkit.callbacks import EarlyStopping, ModelCheckpoint, lightning_attributes
from ampkit.callbacks.lightning_attributes import SAID_ANYWAY
from ampkit.config import Config, build_config


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        ("trainer.val_check_interval=0.25", "(Lightning's val_check_interval; here it is trainer.val_every_n_steps, "
                                            "in iterations counted over the whole run, beside which epoch ends "
                                            "validate too unless trainer.val_every_n_epochs=0"),
        ("trainer.check_val_every_n_epoch=2", "(Lightning's check_val_every_n_epoch; here it is "
                                              "trainer.val_every_n_epochs)"),
        ("trainer.gradient_clip_val=1.0", "(Lightning's gradient_clip_val; here it is trainer.clip_grad_norm)"),
        ("trainer.log_every_n_steps=5", "(did you mean 'logging.log_every_n_steps'?)"),  # not val_every_n_steps
        ("trainer.fast_dev_run=true", "(Lightning's fast_dev_run has no config key here: trainer.max_epochs=1 "
                                      "trainer.limit_train_batches=1"),
        ("trainer.overfit_batches=2", "(Lightning's overfit_batches has no config key here: "
                                      "trainer.limit_train_batches=N"),
        ("trainer.limit_test_batches=2", "(Lightning's limit_test_batches has no config key here"),  # not limit_train
        ("trainer.min_epochs=2", "(Lightning's min_epochs has no config key here"),  # not max_epochs
        ("checkpoint.save_on_train_epoch_end=true", "(Lightning's save_on_train_epoch_end has no config key here: a "
                                                    "train/ monitor ranks at each epoch's end"),
        ("early_stopping.check_on_train_epoch_end=true", "(Lightning's check_on_train_epoch_end has no config key"),
        ("checkpoint.save_last=true", "(Lightning's save_last has no config key here: last.pt is always written)"),
        ("trainer.logger=false", "(Lightning's logger; here it is logging.tensorboard)"),
        ("trainer.enable_checkpointing=false", "(Lightning's enable_checkpointing; here it is checkpoint.enabled, "
                                               "which switches the config's ModelCheckpoint off; one given in code "
                                               "still saves"),
        ("checkpoint.save_weights_only=true", "(Lightning's save_weights_only has no config key here: a checkpoint "
                                              "holds everything a resume needs; ampkit.load_model(path)"),
        ("trainer.reload_dataloaders_every_n_epochs=1", "(Lightning's reload_dataloaders_every_n_epochs has no config "
                                                        "key here: train_dataloader() and val_dataloader() are called "
                                                        "once per run"),
    ],
)  # fmt: skip
def test_a_lightning_flag_is_refused_naming_what_does_its_work_here(override, hint):
    with pytest.raises(ConfigError) as caught:
        build_config(Config, OmegaConf.from_dotlist([override]))
    key = override.partition("=")[0]
    assert str(caught.value).startswith(f"unknown config key '{key}' {hint}")


class Counts(Callback):
    def __init__(self) -> None:
        self.train_batches = self.validation_batches = 0

    def on_train_batch_start(self, trainer, batch) -> None:
        self.train_batches += 1

    def on_validation_batch_end(self, trainer, metrics, batch) -> None:
        self.validation_batches += 1


@pytest.mark.parametrize("batches", [1, 3])
def test_the_fast_dev_run_recipe_runs_its_batches_of_each_and_writes_no_checkpoint_nor_events(tmp_path, batches):
    """The settings the fast_dev_run error names, as written there (Lightning's fast_dev_run=N: both limits N), do
    what Lightning's fast_dev_run does."""
    with pytest.raises(ConfigError) as caught:
        build_config(Config, OmegaConf.from_dotlist([f"trainer.fast_dev_run={batches if batches > 1 else 'true'}"]))
    said = str(caught.value)
    settings = said.partition("no config key here: ")[2].partition(" runs ")[0].split()
    assert "(for Lightning's fast_dev_run=N, N batches of each, set both limits to N)" in said
    counts = Counts()
    overrides = dict(setting.split("=") for setting in settings)
    for limit in ("trainer.limit_train_batches", "trainer.limit_val_batches"):
        overrides[limit] = batches
    trainer = ToyTrainer(toy_cfg(tmp_path, **overrides, **{"trainer.progress_bar": False}), callbacks=[counts])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit()
    assert (counts.train_batches, counts.validation_batches) == (batches, batches)
    written = {p.name for p in trainer.version_dir.rglob("*")}
    assert not any(name.endswith(".pt") or name.startswith("events.out") for name in written), written


def test_checkpoint_enabled_false_switches_off_the_config_s_checkpoint_only(tmp_path):
    """As the enable_checkpointing hint and the config reference say: the config's ModelCheckpoint writes nothing,
    one given in code still saves (where Lightning refuses the pair)."""
    settings = {"checkpoint.enabled": False, "checkpoint.every_n_steps": 2, "trainer.max_steps": 4,
                "trainer.progress_bar": False, "logging.tensorboard": False}  # fmt: skip
    off = ToyTrainer(toy_cfg(tmp_path / "off", **settings))
    off.fit()
    assert not list(off.version_dir.rglob("*.pt")) and not any(isinstance(c, ModelCheckpoint) for c in off.callbacks)
    mine = ModelCheckpoint(every_n_steps=2, every_n_epochs=0)
    coded = ToyTrainer(toy_cfg(tmp_path / "coded", **settings), callbacks=[mine])
    coded.fit()
    assert {p.name for p in coded.version_dir.rglob("*.pt")} >= {"last.pt", "step-00000004.pt"}


class TwoOptimizers(ToyTrainer):
    """A per-step warmup on SGD's two param groups (step n trains at n/10 of each group's rate), Adam unscheduled."""

    def configure_optimizers(self):
        first, head = self.module[0], self.module[3]
        sgd = torch.optim.SGD([{"params": first.weight}, {"params": first.bias, "lr": 0.01}], lr=0.1, momentum=0.9)
        warmup = torch.optim.lr_scheduler.LambdaLR(sgd, lambda done: (done + 1) / 10)
        adam = torch.optim.Adam(head.parameters(), lr=0.001)
        return [{"optimizer": sgd, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}, adam]


def test_each_optimizer_s_and_param_group_s_learning_rate_reaches_tensorboard_as_its_step_used_it(tmp_path):
    """LearningRateMonitor's per-step curve: one tag per optimizer (train/lr/<name>) and per further param group
    (/group_<i>), each point the rate that step trained at, before its step-interval scheduler moved it on."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    settings = {"trainer.progress_bar": False, "logging.log_every_n_steps": 1, "checkpoint.enabled": False,
                "trainer.num_sanity_val_steps": 0, "data.n": 32}  # fmt: skip
    trainer = TwoOptimizers(toy_cfg(tmp_path, **settings))
    trainer.fit()
    events = EventAccumulator(str(trainer.version_dir / "tensorboard"))
    events.Reload()
    steps = [1, 2, 3, 4]
    for tag, rates in [("train/lr/sgd", [0.1 * n / 10 for n in steps]),
                       ("train/lr/sgd/group_1", [0.01 * n / 10 for n in steps]),
                       ("train/lr/adam", [0.001] * 4)]:  # fmt: skip
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [step for step, _ in logged] == steps, tag
        assert [value for _, value in logged] == pytest.approx(rates, rel=1e-6), tag
    assert "train/lr/adam/group_1" not in events.Tags()["scalars"]


class NamedGroups(ToyTrainer):
    def configure_optimizers(self):
        first, head = self.module[0], self.module[3]
        return torch.optim.AdamW([{"params": first.weight, "name": "body", "lr": 0.1},
                                  {"params": first.bias, "name": "body", "lr": 0.2},
                                  {"params": head.parameters(), "name": "head", "lr": 0.3}])  # fmt: skip


def test_a_param_group_s_name_names_its_learning_rate_tag_and_a_shared_name_hides_no_value(tmp_path):
    """As Lightning's LearningRateMonitor: a group given a "name" is logged under it; a second group of that name
    keeps its index, as one tag would show only one of the two rates."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    settings = {"trainer.progress_bar": False, "logging.log_every_n_steps": 1, "checkpoint.enabled": False,
                "trainer.max_steps": 1}  # fmt: skip
    trainer = NamedGroups(toy_cfg(tmp_path, **settings))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit()
    events = EventAccumulator(str(trainer.version_dir / "tensorboard"))
    events.Reload()
    logged = {tag: events.Scalars(tag)[0].value for tag in events.Tags()["scalars"] if tag.startswith("train/lr/")}
    assert logged == pytest.approx({"train/lr/adamw/body": 0.1, "train/lr/adamw/group_1": 0.2,
                                    "train/lr/adamw/head": 0.3})  # fmt: skip


@pytest.mark.parametrize(("every", "tensorboard", "warned"), [(10, True, True), (4, True, False), (10, False, False)])
def test_a_log_interval_longer_than_the_run_is_named_at_fit_start(tmp_path, every, tensorboard, warned):
    """4 iterations logged every 10 would write no per-step value at all (no learning-rate curve): named at fit start,
    as Lightning warns of a logging interval above the batches it trains."""
    settings = {"trainer.progress_bar": False, "logging.log_every_n_steps": every, "logging.tensorboard": tensorboard,
                "checkpoint.enabled": False, "data.n": 32}  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ToyTrainer(toy_cfg(tmp_path, **settings)).fit()
    said = [str(w.message) for w in caught if "logging.log_every_n_steps" in str(w.message)]
    expected = ["logging.log_every_n_steps=10 is more than this run's 4 iterations: TensorBoard gets no learning rate"]
    assert [message[: len(expected[0])] for message in said] == (expected if warned else [])


class OneCycle(ToyTrainer):
    """SGD and Adam under per-step OneCycleLR, which cycles SGD's momentum and Adam's first beta with the rate."""

    def configure_optimizers(self):
        first, head = self.module[0], self.module[3]
        sgd = torch.optim.SGD(first.parameters(), lr=0.1, momentum=0.9)
        adam = torch.optim.Adam(head.parameters(), lr=0.01)
        schedules = []
        for opt in (sgd, adam):
            cycle = torch.optim.lr_scheduler.OneCycleLR(opt, opt.defaults["lr"], total_steps=4)
            schedules.append({"optimizer": opt, "lr_scheduler": {"scheduler": cycle, "interval": "step"}})
        return schedules


def _one_cycle_momenta(optimizer: torch.optim.Optimizer) -> list[float]:
    """The momentum (or beta1) a OneCycleLR of 4 steps gives each of its 4 steps, replayed on ``optimizer``."""
    cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, optimizer.defaults["lr"], total_steps=4)
    momenta = []
    for _ in range(4):
        group = optimizer.param_groups[0]
        momenta.append(group["momentum"] if "momentum" in group else group["betas"][0])
        optimizer.step()
        cycle.step()
    return momenta


@pytest.mark.parametrize("log_momentum", [True, False])
def test_log_momentum_writes_each_optimizer_s_momentum_as_its_step_used_it(tmp_path, log_momentum):
    """As LearningRateMonitor(log_momentum=True): a cycled momentum (SGD's, Adam's beta1) is visible per step; off by
    default, as there."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    settings = {"trainer.progress_bar": False, "logging.log_every_n_steps": 1, "checkpoint.enabled": False,
                "trainer.num_sanity_val_steps": 0, "data.n": 32, "logging.log_momentum": log_momentum}  # fmt: skip
    trainer = OneCycle(toy_cfg(tmp_path, **settings))
    trainer.fit()
    events = EventAccumulator(str(trainer.version_dir / "tensorboard"))
    events.Reload()
    tags = sorted(tag for tag in events.Tags()["scalars"] if tag.startswith("train/momentum/"))
    if not log_momentum:
        assert tags == []
        return
    assert tags == ["train/momentum/adam", "train/momentum/sgd"]
    parameter = [torch.nn.Parameter(torch.zeros(1))]
    expected = {"sgd": _one_cycle_momenta(torch.optim.SGD(parameter, lr=0.1, momentum=0.9)),
                "adam": _one_cycle_momenta(torch.optim.Adam(parameter, lr=0.01))}  # fmt: skip
    for name, momenta in expected.items():
        logged = events.Scalars(f"train/momentum/{name}")
        assert [e.step for e in logged] == [1, 2, 3, 4]
        assert [e.value for e in logged] == pytest.approx(momenta, rel=1e-6)
    assert len(set(expected["sgd"])) > 1, "the schedule moved the momentum, or the test shows nothing"


class LogsReturnedLossPerEpoch(ToyTrainer):
    """A Lightning port: self.log('train/loss', loss, on_epoch=True, on_step=False) of the loss it also returns."""

    def training_step(self, batch):
        loss = super().training_step(batch)
        self.log("train/loss", loss, on_step=False, on_epoch=True)
        return loss


def test_an_epoch_mean_under_the_tag_of_a_returned_value_gets_a_curve_of_its_own(tmp_path):
    """TensorBoard writes the returned loss as train/loss every log step; the epoch mean of log('train/loss',
    on_epoch=True, on_step=False) went to that curve too, two values at each epoch's last step. It goes to
    train/loss_epoch instead, said once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    settings = {"trainer.progress_bar": False, "logging.log_every_n_steps": 2, "checkpoint.enabled": False,
                "trainer.max_epochs": 2, "data.n": 32, "trainer.num_sanity_val_steps": 0}  # fmt: skip
    trainer = LogsReturnedLossPerEpoch(toy_cfg(tmp_path, **settings))
    with pytest.warns(UserWarning, match=r"its epoch mean goes to 'train/loss_epoch'") as said:
        trainer.fit()
    assert len([w for w in said if "train/loss_epoch" in str(w.message)]) == 1
    events = EventAccumulator(str(trainer.version_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6, 8]
    assert [e.step for e in events.Scalars("train/loss_epoch")] == [4, 8]


@pytest.mark.parametrize(("override", "said"), [
    ("checkpoint.save_top_k=0", "expected an integer >= 1, or -1 (keep every one); Lightning's 0 (save none) is "
                                "checkpoint.enabled=false"),
    ("early_stopping.patience=0", "expected an integer >= 1 (Lightning's 0 stops at the first validation without "
                                  "improvement, as 1 does here)"),
])  # fmt: skip
def test_a_lightning_value_ampkit_takes_otherwise_is_refused_naming_the_setting_that_does_its_work(
    tmp_path, override, said
):
    """Lightning's save_top_k=0 and patience=0 were refused as out of range only, naming nothing doing their work."""
    key, _, value = override.partition("=")
    with pytest.raises(ConfigError) as caught:
        ToyTrainer(toy_cfg(tmp_path, **{key: int(value)}))
    assert str(caught.value) == f"config key '{key}': 0 is invalid; {said}"


@pytest.mark.parametrize(
    ("build", "hint"),
    [
        (lambda: ModelCheckpoint(monitor="val/loss", filename="{epoch}-{val/loss:.2f}"),
         "filename (Lightning's; here: files are named by step (step-N.pt, epoch-N.pt, best-N.pt)"),
        (lambda: ModelCheckpoint(every_n_train_steps=100), "every_n_train_steps (Lightning's; here: every_n_steps)"),
        (lambda: ModelCheckpoint(save_last="link"), "save_last (Lightning's; here: last.pt is always written"),
        (lambda: ModelCheckpoint(dirpath="ckpts"), "dirpath (Lightning's; here: checkpoints go to <run_dir>/version_N"),
        (lambda: EarlyStopping("train/loss", check_on_train_epoch_end=True),
         "check_on_train_epoch_end (Lightning's; here: a train/ monitor counts at each epoch's end"),
        (lambda: EarlyStopping("val/loss", verbose=True), "verbose (Lightning's; here: a stop is always said"),
        (lambda: EarlyStopping("val/loss", pateince=3), "pateince. It takes monitor, mode, patience,"),
        (lambda: EarlyStopping("val/loss", patience=0), "(Lightning's 0 stops at the first validation without "
                                                       "improvement, as 1 does here)"),
        (lambda: ModelCheckpoint(monitor="val/loss", save_top_k=0), "; Lightning's 0 (save none) is "
                                                                    "checkpoint.enabled=false"),
    ],
)  # fmt: skip
def test_a_lightning_callback_argument_is_refused_naming_what_does_its_work_here(build, hint):
    """A port's ModelCheckpoint(filename=...) or EarlyStopping(check_on_train_epoch_end=...) met only Python's
    'unexpected keyword argument', naming nothing ampkit does instead (the config keys of the same names did)."""
    with pytest.raises((TypeError, ValueError)) as caught:  # a 0 is a value out of range, as for the config keys
        build()
    assert hint in str(caught.value)


# Lightning 2.x's ModelCheckpoint and EarlyStopping arguments, each with a value a port passes
LIGHTNING_CHECKPOINT_ARGUMENTS = {
    "dirpath": "ckpts", "filename": "{epoch}-{step}", "monitor": "val/loss", "verbose": True, "save_last": True,
    "save_top_k": 3, "save_weights_only": True, "mode": "max", "auto_insert_metric_name": False,
    "every_n_train_steps": 100, "train_time_interval": 3600, "every_n_epochs": 2, "save_on_train_epoch_end": True,
    "enable_version_counter": False,
}  # fmt: skip
LIGHTNING_EARLY_STOPPING_ARGUMENTS = {
    "min_delta": 0.01, "patience": 5, "verbose": True, "mode": "max", "strict": False, "check_finite": False,
    "stopping_threshold": 0.1, "divergence_threshold": 10.0, "check_on_train_epoch_end": True,
    "log_rank_zero_only": True,
}  # fmt: skip


@pytest.mark.parametrize("subclassed", [False, True])
@pytest.mark.parametrize(
    ("cls", "name", "value"),
    [(ModelCheckpoint, name, value) for name, value in LIGHTNING_CHECKPOINT_ARGUMENTS.items()]
    + [(EarlyStopping, name, value) for name, value in LIGHTNING_EARLY_STOPPING_ARGUMENTS.items()],
)
def test_every_lightning_callback_argument_is_taken_or_refused_naming_what_does_its_work_also_on_a_subclass(
    cls, name, value, subclassed
):
    """Each of Lightning's arguments is one of ours (its behaviour pinned by the contract tests) or refused with what
    does its work here. A subclass (class MyCheckpoint(ModelCheckpoint)) lost the hint: it was looked up by the
    subclass's own name, so a port met only 'got arguments it does not take'."""
    built = type(f"My{cls.__name__}", (cls,), {}) if subclassed else cls
    needs = {"monitor": "val/loss"} if cls is EarlyStopping or name == "save_top_k" else {}
    if name in inspect.signature(cls.__init__).parameters:
        callback = built(**{**needs, name: value})
        assert str(getattr(callback, name)) == str(value)  # monitor: a Monitor, whose str is the metric
        return
    with pytest.raises(TypeError) as refused:
        built(**needs, **{name: value})
    assert str(refused.value).startswith(
        f"{built.__name__}() got arguments it does not take: {name} (Lightning's; here: "
    )


@pytest.mark.parametrize("subclassed", [False, True])
@pytest.mark.parametrize(
    ("cls", "name", "value"),
    [(ModelCheckpoint, name, value) for name, value in LIGHTNING_CHECKPOINT_ARGUMENTS.items()]
    + [(EarlyStopping, name, value) for name, value in LIGHTNING_EARLY_STOPPING_ARGUMENTS.items()],
)
def test_every_lightning_attribute_set_after_construction_takes_effect_or_is_refused_naming_what_does_its_work(
    cls, name, value, subclassed, monkeypatch
):
    """Lightning's are plain attributes a port sets later (``ckpt.monitor = "val/acc"``, ``ckpt.dirpath = ...``). A
    monitor set so stayed a str where a Monitor is read (the first save crashed); the others became attributes nothing
    read. Each now acts as the constructor's argument, or is refused as the constructor refuses it."""
    built = type(f"My{cls.__name__}", (cls,), {}) if subclassed else cls
    needs = {"monitor": "val/mse"} if cls is EarlyStopping else {}
    callback = built(**needs)
    monkeypatch.setattr(lightning_attributes, "_warned", set())  # each class's is said once in a process
    if name in SAID_ANYWAY:  # what it says, ampkit says anyway: kept, said once (a ported subclass's own still works)
        with pytest.warns(UserWarning, match=f"^{built.__name__}.{name} = .* is kept but changes nothing: it is Light"):
            setattr(callback, name, value)
        assert vars(callback)[name] == value
        return
    if name not in inspect.signature(cls.__init__).parameters:
        with pytest.raises(AttributeError, match=f"^{built.__name__}.{name} = .* is not taken: it is Lightning's"):
            setattr(callback, name, value)
        assert name not in vars(callback)
        return
    if name == "save_top_k":
        callback.monitor = "val/loss"
    setattr(callback, name, value)
    constructed = built(**{**needs, **({"monitor": "val/loss"} if name == "save_top_k" else {}), name: value})
    assert str(getattr(callback, name)) == str(value) and callback.state_key == constructed.state_key
    watched = callback.monitor
    assert watched is None or (watched.metric, watched.mode, watched.min_delta) == (
        constructed.monitor.metric, constructed.monitor.mode, constructed.monitor.min_delta
    )  # fmt: skip
    assert getattr(callback, "keep_last", None) == getattr(constructed, "keep_last", None)


@pytest.mark.parametrize("subclassed", [False, True])
@pytest.mark.parametrize(
    ("cls", "name", "instead"),
    [(ModelCheckpoint, name, "ModelCheckpoint computes it") for name in
     ("best_k_models", "best_model_score", "current_score", "kth_best_model_path", "kth_value", "last_model_path")]
    + [(ModelCheckpoint, "best_model_path", r"trainer.test\(ckpt=...\)"),
       (EarlyStopping, "wait_count", r"set wait instead \(0: count afresh\)"),
       (EarlyStopping, "best_score", r"set best instead \(None: the next check sets it\)")],
)  # fmt: skip
def test_a_lightning_attribute_the_callback_computes_is_refused_saying_so(cls, name, instead, subclassed):
    """Lightning's are plain attributes a port may assign (``es.wait_count = 0``, ``ckpt.best_model_path = p``); here
    they are computed, and the assignment got Python's "property ... has no setter", naming neither why nor what to
    set instead."""
    built = type(f"My{cls.__name__}", (cls,), {}) if subclassed else cls
    callback = built(monitor="val/mse")
    before = getattr(callback, name)
    with pytest.raises(AttributeError, match=f"^{built.__name__}.{name} = 3 is not taken: .*{instead}"):
        setattr(callback, name, 3)
    assert getattr(callback, name) == before
    own = type("Own", (built,), {"__annotations__": {name: int}, name: 0})(monitor="val/mse")  # a subclass's own
    setattr(own, name, 3)
    assert getattr(own, name) == 3


@pytest.mark.parametrize(
    ("cls", "name", "value"),
    [(ModelCheckpoint, "monitor", 3), (ModelCheckpoint, "mode", "maximum"), (ModelCheckpoint, "save_top_k", 0),
     (ModelCheckpoint, "save_top_k", 3), (EarlyStopping, "monitor", "val loss\n"), (EarlyStopping, "mode", "up"),
     (EarlyStopping, "patience", 0), (EarlyStopping, "min_delta", -0.1), (EarlyStopping, "check_finite", "False"),
     (EarlyStopping, "stopping_threshold", float("nan")), (EarlyStopping, "divergence_threshold", "10")],
)  # fmt: skip
def test_a_bad_value_set_after_construction_gets_the_constructor_s_error_and_changes_nothing(cls, name, value):
    needs = {"monitor": "val/mse"} if cls is EarlyStopping else {}
    with pytest.raises(ValueError) as constructed:  # check_finite's ArgumentTypeError is a ValueError too
        cls(**{**needs, name: value})
    callback = cls(**needs)
    before = (str(callback.monitor), callback.mode, getattr(callback, name))
    with pytest.raises(ValueError) as assigned:
        setattr(callback, name, value)
    assert str(assigned.value) == str(constructed.value)
    assert (str(callback.monitor), callback.mode, getattr(callback, name)) == before


def test_a_ported_subclass_setting_lightning_names_in_its_init_constructs_where_harmless_and_hears_how_to_keep_others(
    monkeypatch,
):
    """A ported Lightning subclass's ``self.verbose = verbose`` (read by its own code) raised at construction: ampkit
    says what verbose said anyway, so it is kept with one warning. ``self.dirpath = ...`` (where Lightning writes) is
    still refused, naming the class-body declaration that keeps it the subclass's own; a user's subclass named
    ``ModelCheckpoint`` (a port's drop-in) keeps a name it declares, as any subclass does."""
    monkeypatch.setattr(lightning_attributes, "_warned", set())

    class Ported(ModelCheckpoint):
        def __init__(self, verbose: bool = False, **kwargs) -> None:
            super().__init__(**kwargs)
            self.verbose = verbose

        def said(self) -> bool:
            return self.verbose

    class PortedStopping(EarlyStopping):
        def __init__(self, monitor: str, verbose: bool = False, log_rank_zero_only: bool = False) -> None:
            super().__init__(monitor)
            self.verbose, self.log_rank_zero_only = verbose, log_rank_zero_only

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ported, again = Ported(verbose=True), Ported(verbose=False)
        stopping = PortedStopping("val/loss", verbose=True, log_rank_zero_only=True)
    assert ported.said() and not again.said() and stopping.verbose and stopping.log_rank_zero_only
    messages = [str(w.message) for w in said]
    assert len(messages) == 3 and messages[0].startswith("Ported.verbose = True is kept but changes nothing")
    assert "declaring it in its class body (verbose: bool = ...)" in messages[0]

    class Dirpath(ModelCheckpoint):
        def __init__(self) -> None:
            super().__init__()
            self.dirpath = "ckpts"

    with pytest.raises(AttributeError, match=r"^Dirpath.dirpath = 'ckpts' is not taken: .* class body \(dirpath: str"):
        Dirpath()

    class ModelCheckpoint_(ModelCheckpoint):
        dirpath: str = "declared"

    ModelCheckpoint_.__name__ = "ModelCheckpoint"  # a port's drop-in: class ModelCheckpoint(ampkit's ModelCheckpoint)
    drop_in = ModelCheckpoint_()
    drop_in.dirpath = "mine"
    assert drop_in.dirpath == "mine"


def test_a_monitor_set_after_construction_ranks_and_stops_the_fit_by_it_and_subclass_attributes_stay_free(tmp_path):
    """The issue's case: ``ckpt.monitor = "val/mse"`` crashed the first save. A subclass's own attributes, and one of a
    Lightning name it declares, are its own."""

    class Recording(ModelCheckpoint):
        verbose: bool = False

        def __init__(self) -> None:
            super().__init__()
            self.verbose, self.calls = True, []

    checkpoint, stopper = Recording(), EarlyStopping("val/other", patience=1, min_delta=1e9)
    checkpoint.monitor, checkpoint.save_top_k = "val/mse", 2
    stopper.monitor = "val/mse"
    run = ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_epochs": 4}), callbacks=[checkpoint, stopper])
    run.fit()
    assert len(checkpoint.best_k_models) == 2 and checkpoint.verbose and checkpoint.calls == []
    assert run.state.epoch < 3 and stopper.stopping_reason_message.startswith("val/mse did not improve")


def test_a_monitor_or_mode_set_after_a_ranking_ranks_and_counts_afresh_as_a_resume_by_another_one_does():
    """Values of another metric or direction rank nothing: pruning by them would drop the wrong best files."""
    checkpoint, stopper = ModelCheckpoint(monitor="val/loss", save_top_k=2), EarlyStopping("val/loss")
    checkpoint.best_k, stopper.best, stopper.wait = {"best-00000004.pt": 0.5}, 0.5, 2
    checkpoint.mode, stopper.min_delta = "min", 0.1  # the same metric and mode: the ranking and count stand
    assert checkpoint.best_k and (stopper.best, stopper.wait) == (0.5, 2)
    checkpoint.mode, stopper.monitor = "max", "val/acc"
    assert (checkpoint.best_k, checkpoint.kept) == ({}, ["best-00000004.pt"]) and (stopper.best, stopper.wait) == (
        None,
        0,
    )


@pytest.mark.parametrize(
    ("assigned", "set_aside"), [("val/loss", False), ("val/acc", True), ({"metric": "val/loss", "mode": "max"}, True)]
)
def test_a_monitor_set_after_a_ranking_restored_without_one_ranks_afresh_where_it_measures_otherwise(
    assigned, set_aside
):
    """A ranking restored (or kept) while no monitor was set was never set aside: a monitor assigned then pruned the
    files ranked by another metric or direction by values that rank nothing under it."""
    restored = ModelCheckpoint()
    restored.load_state_dict({"best_k": {"best-00000004.pt": 0.5}, "kept": [], "monitor": "val/loss", "mode": "min"})
    unset = ModelCheckpoint(monitor="val/loss")
    unset.best_k = {"best-00000004.pt": 0.5}
    unset.monitor = None
    assert unset.state_dict()["monitor"] == "val/loss"  # what measured the ranking it keeps is saved with it
    for checkpoint in (restored, unset):
        if isinstance(assigned, dict):
            checkpoint.mode, checkpoint.monitor = assigned["mode"], assigned["metric"]
        else:
            checkpoint.monitor = assigned
        expected = ({}, ["best-00000004.pt"]) if set_aside else ({"best-00000004.pt": 0.5}, [])
        assert (checkpoint.best_k, checkpoint.kept) == expected


def test_a_callback_s_monitor_compares_equal_to_its_metric_name_as_lightning_s_string_does():
    """Lightning's ``ckpt.monitor`` is the metric's name; here a Monitor, so a port's ``cb.monitor == "val/loss"`` was
    False without a word. Two monitors of one name are still told apart (each callback's own)."""
    checkpoint, stopper = ModelCheckpoint(monitor="val/loss"), EarlyStopping("val/loss", mode="max")
    assert checkpoint.monitor == "val/loss" == stopper.monitor and "val/loss" == checkpoint.monitor
    assert checkpoint.monitor != "val/acc" and checkpoint.monitor in {"val/loss"}
    assert checkpoint.monitor != stopper.monitor and ModelCheckpoint().monitor is None


@pytest.mark.parametrize(
    ("build", "given", "order"),
    [
        (lambda: EarlyStopping("val/loss", 0.01, 5), "mode=0.01", "(monitor, min_delta, patience)"),
        (lambda: EarlyStopping("val/loss", 0), "mode=0", "(monitor, min_delta, patience)"),
        (lambda: ModelCheckpoint("ckpts/"), "every_n_steps='ckpts/'", "(dirpath, filename, monitor, verbose"),
        (lambda: ModelCheckpoint(None, "{epoch}"), "every_n_epochs='{epoch}'", "(dirpath, filename, monitor, verbose"),
        (lambda: ModelCheckpoint(None, None, "val/loss"), "keep_last='val/loss'", "(dirpath, filename, monitor,"),
        (lambda: ModelCheckpoint(None), "every_n_steps=None is not taken here", "position for Lightning's dirpath"),
    ],
)  # fmt: skip
def test_a_call_by_lightning_s_positional_order_is_refused_saying_so(build, given, order):
    """EarlyStopping("val_loss", 0.01, 5) is Lightning's (monitor, min_delta, patience): here 0.01 lands on mode,
    refused as an invalid mode without saying why; ModelCheckpoint("ckpts/") put the dirpath on every_n_steps."""
    with pytest.raises(ValueError) as refused:
        build()
    assert given in str(refused.value) and order in str(refused.value) and "by keyword" in str(refused.value)


def test_a_port_s_drop_in_subclass_named_as_ours_hears_our_positional_order_not_its_own():
    """A port's ``class ModelCheckpoint(ampkit's)`` with Lightning's ``__init__(dirpath, ...)`` passing on by position
    was told ampkit's order is its own ``(dirpath)``: the class was looked up by name, finding the subclass."""

    class Drop(ModelCheckpoint):
        def __init__(self, dirpath: str = "ckpts/") -> None:
            super().__init__(dirpath)

    Drop.__name__ = "ModelCheckpoint"  # class ModelCheckpoint(ampkit.callbacks.ModelCheckpoint)
    with pytest.raises(ValueError, match=r"as ModelCheckpoint's own order is \(every_n_steps, every_n_epochs, keep_l"):
        Drop()


@pytest.mark.parametrize("name", ["every_n_steps", "every_n_epochs"])
def test_lightning_s_none_interval_is_refused_naming_what_gives_its_saves(name):
    """Lightning's every_n_epochs=None (its default) means 1 or 0 by the other intervals: refused as only 'expected an
    integer >= 0', naming nothing to give instead."""
    with pytest.raises(ValueError, match=f"{name}=None is not taken here; Lightning's None saves every epoch where"):
        ModelCheckpoint(**{name: None})


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("LearningRateMonitor", "the TensorBoard logger (logging.tensorboard), which writes each optimizer's learning "
                                "rate as train/lr/<optimizer>"),
        ("Timer", "trainer.max_time"),
        ("TQDMProgressBar", "ProgressBar (trainer.progress_bar)"),
        ("GradientAccumulationScheduler", "trainer.accumulate_grad_batches"),
    ],
)  # fmt: skip
def test_a_lightning_callback_ampkit_has_none_of_is_an_import_error_naming_what_does_its_work_here(name, hint):
    """A port's ``from ampkit.callbacks import LearningRateMonitor`` met Python's bare 'cannot import name'; any other
    missing name still reads as Python's. Outside an import the name is a missing attribute as any other:
    ``hasattr`` is False and ``getattr`` with a default answers it, as code probing for a callback expects."""
    import ampkit.callbacks

    with pytest.raises(
        ImportError, match=f"cannot import name '{name}' from 'ampkit.callbacks': it is Lightning's "
    ) as caught:
        exec(f"from ampkit.callbacks import {name}", {})
    assert hint in str(caught.value)
    with pytest.raises(AttributeError, match=f"'{name}' from 'ampkit.callbacks': it is Lightning's callback") as caught:
        getattr(ampkit.callbacks, name)
    assert hint in str(caught.value)
    assert not hasattr(ampkit.callbacks, name)
    assert getattr(ampkit.callbacks, name, None) is None
    with pytest.raises(ImportError, match=r"^cannot import name 'NoSuchCallback' from 'ampkit.callbacks' \("):
        exec("from ampkit.callbacks import NoSuchCallback", {})
    assert getattr(ampkit.callbacks, "NoSuchCallback", None) is None
