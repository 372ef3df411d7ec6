"""Loop semantics: several optimizers per step, skipped steps, scheduler gating, stopping, compile."""

from __future__ import annotations

import copy
import re
import warnings
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data import DataLoader
from toy_trainers import ToyTrainer, toy_cfg, toy_dataset

from ampkit import Callback, Phase
from ampkit.callbacks import EarlyStopping, ModelCheckpoint
from ampkit.trainer.optimizers import step_
from ampkit.trainer.ordering import CallbackOrderError, order_callbacks

QUIET = {"logging.tensorboard": False, "checkpoint.enabled": False}


class _InitialWeights(Callback):
    def on_train_start(self, trainer):
        self.state = copy.deepcopy(trainer.module.state_dict())


def _gan_losses(G: nn.Module, D: nn.Module, x: torch.Tensor) -> tuple:
    loss_d = F.softplus(-D(x)).mean() + F.softplus(D(G(x).detach())).mean()
    return loss_d, lambda: F.softplus(-D(G(x))).mean()


class TwoPlayer(ToyTrainer):
    """A GAN-shaped step: D then G, each with its own optimizer and loss_id, in one training_step."""

    automatic_optimization = False

    def configure_model(self):
        return nn.ModuleDict({"G": nn.Linear(6, 6), "D": nn.Linear(6, 1)})

    def configure_optimizers(self):
        d, g = self.module["D"].parameters(), self.module["G"].parameters()
        return [{"optimizer": torch.optim.SGD(d, lr=0.1, momentum=0.5), "name": "D"},
                {"optimizer": torch.optim.SGD(g, lr=0.1, momentum=0.5), "name": "G"}]  # fmt: skip

    def train_dataloader(self):
        return DataLoader(toy_dataset(64), batch_size=8)

    def val_dataloader(self):
        return None

    def training_step(self, batch):
        loss_d, loss_g_fn = _gan_losses(self.model["G"], self.model["D"], batch[0])
        self.backward(loss_d, loss_id="D", optimizer=self.optimizers["D"])
        self.step(self.optimizers["D"])
        loss_g = loss_g_fn()
        self.backward(loss_g, loss_id="G", optimizer=self.optimizers["G"])
        self.step(self.optimizers["G"])
        return {"loss_D": loss_d, "loss_G": loss_g}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_two_optimizers_in_one_step_equal_a_hand_written_gan_loop(tmp_path, accumulate):
    initial = _InitialWeights()
    trainer = TwoPlayer(toy_cfg(tmp_path, **{"trainer.max_epochs": 2, "trainer.accumulate_grad_batches": accumulate,
                                             **QUIET}), callbacks=[initial])  # fmt: skip
    trainer.fit()

    model = nn.ModuleDict({"G": nn.Linear(6, 6), "D": nn.Linear(6, 1)})
    model.load_state_dict(initial.state)
    G, D = model["G"], model["D"]
    opt_d = torch.optim.SGD(D.parameters(), lr=0.1, momentum=0.5)
    opt_g = torch.optim.SGD(G.parameters(), lr=0.1, momentum=0.5)
    for _epoch in range(2):
        for i, (x, _) in enumerate(DataLoader(toy_dataset(64), batch_size=8)):
            loss_d, loss_g_fn = _gan_losses(G, D, x)
            loss_d.backward(inputs=list(D.parameters()))
            if (i + 1) % accumulate == 0:
                opt_d.step()
            loss_g_fn().backward(inputs=list(G.parameters()))
            if (i + 1) % accumulate == 0:
                opt_g.step()
                opt_d.zero_grad()
                opt_g.zero_grad()
    for key, value in model.state_dict().items():
        assert torch.equal(trainer.module.state_dict()[key], value), key
    assert trainer.optimizer_state[trainer.optimizers["G"]].steps == 16 // accumulate


class _SkipAt(Callback):
    """Marks an optimizer's step as overflowed at chosen iterations (what a loss scaler does)."""

    def __init__(self, name: str, iterations: set[int]) -> None:
        self.target, self.iterations, self.skipped = name, iterations, []

    def on_before_optimizer_step(self, trainer, optimizer):
        state = trainer.optimizer_state[optimizer]
        if state.name == self.target and trainer.state.iteration in self.iterations:
            state.found_inf = True
            state.loss_ids.add("D")

    def on_optimizer_step_skipped(self, trainer, optimizer, loss_ids):
        self.skipped.append((trainer.state.iteration, trainer.optimizer_state[optimizer].name, loss_ids))


def test_a_skipped_step_leaves_params_state_and_scheduler_untouched(tmp_path):
    class WithSchedulers(TwoPlayer):
        def configure_optimizers(self):
            specs = super().configure_optimizers()
            for spec in specs:
                schedule = torch.optim.lr_scheduler.StepLR(spec["optimizer"], step_size=1, gamma=0.5)
                spec["lr_scheduler"] = {"scheduler": schedule, "interval": "step"}
            return specs

    class Watch(Callback):
        def on_train_batch_start(self, trainer, batch):
            self.before = copy.deepcopy(trainer.module["D"].state_dict())
            self.opt_before = copy.deepcopy(trainer.optimizers["D"].state_dict())

        def on_train_batch_end(self, trainer, outputs, batch):
            if trainer.state.iteration == 3:
                for key, value in trainer.module["D"].state_dict().items():
                    assert torch.equal(self.before[key], value)
                assert str(trainer.optimizers["D"].state_dict()) == str(self.opt_before)

    skip = _SkipAt("D", {3})
    trainer = WithSchedulers(toy_cfg(tmp_path, **{"trainer.max_steps": 5, **QUIET}), callbacks=[skip, Watch()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        trainer.fit()
    d_state, g_state = (trainer.optimizer_state[trainer.optimizers[n]] for n in "DG")
    assert (d_state.steps, d_state.skipped_steps, g_state.steps) == (4, 1, 5)
    assert skip.skipped == [(3, "D", ["D"])]
    assert trainer.optimizers["D"].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4)
    assert trainer.optimizers["G"].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**5)


def test_an_optimizer_without_gradients_is_not_stepped(tmp_path):
    class OnlyD(TwoPlayer):
        def training_step(self, batch):
            loss_d, _ = _gan_losses(self.model["G"], self.model["D"], batch[0])
            self.backward(loss_d, optimizer=self.optimizers["D"])
            return {"D": self.step(self.optimizers["D"]), "G": self.step(self.optimizers["G"])}

    trainer = OnlyD(toy_cfg(tmp_path, **{"trainer.max_steps": 3, **QUIET}))
    trainer.fit()
    assert trainer.optimizer_state[trainer.optimizers["G"]].steps == 0
    assert trainer.optimizer_state[trainer.optimizers["D"]].steps == 3


def test_stepping_twice_in_one_iteration_is_an_error(tmp_path):
    class Twice(TwoPlayer):
        def training_step(self, batch):
            loss_d, _ = _gan_losses(self.model["G"], self.model["D"], batch[0])
            self.backward(loss_d)
            self.step(self.optimizers["D"])
            self.step(self.optimizers["D"])

    with pytest.raises(RuntimeError, match="'D' was already stepped in this iteration"):
        Twice(toy_cfg(tmp_path, **QUIET)).fit()


def test_epoch_scheduler_with_monitor_and_max_steps_stop(tmp_path):
    class Plateau(ToyTrainer):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.module.parameters(), lr=0.05)
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5, threshold=10.0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch", "monitor": "val/mse"}}

    trainer = Plateau(toy_cfg(tmp_path, **{"trainer.max_epochs": 3, **QUIET}))
    trainer.fit()
    # threshold=10 (relative, mode min) means no epoch ever counts as an improvement: the LR halves every epoch.
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**3)
    stopped = ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_epochs": 10, "trainer.max_steps": 11, **QUIET}))
    stopped.fit()
    assert (stopped.state.global_step, stopped.state.epoch, stopped.state.batches_done) == (11, 1, 3)


def test_a_warmup_and_linear_decay_schedule_sizes_itself_from_num_train_batches_in_configure_optimizers(tmp_path):
    class WarmupDecay(ToyTrainer):
        loaders_made = 0

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.module.parameters(), lr=0.05)
            accumulate, epochs = self.cfg.trainer.accumulate_grad_batches, self.cfg.trainer.max_epochs
            self.total = self.num_train_batches // accumulate * epochs  # BERT's num_training_steps
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(step + 1, 2) / 2 * (1 - step / self.total))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self):
            type(self).loaders_made += 1
            return super().train_dataloader()

    trainer = WarmupDecay(toy_cfg(tmp_path, **{"trainer.max_epochs": 3, "trainer.accumulate_grad_batches": 2, **QUIET}))
    trainer.fit()
    assert trainer.total == trainer.state.global_step == 12  # 64 samples / batch 8 / 2 accumulated x 3 epochs
    assert trainer.optimizer.param_groups[0]["lr"] == 0.0  # the schedule ended where the run did
    assert WarmupDecay.loaders_made == 1  # the loader asked for the count is the one trained on


@pytest.mark.parametrize(("accumulate", "max_steps", "steps"), [(3, -1, 9), (1, 5, 5), (3, 100, 9)])
def test_num_training_steps_counts_each_epoch_s_short_last_window(tmp_path, accumulate, max_steps, steps):
    # 8 batches stepping every 3 are 3 iterations an epoch, not 8 // 3 = 2: the schedule the docs sized with the
    # floor reached its end a third of the way early, and a cosine past its end climbs back to the peak.
    class CosineToZero(ToyTrainer):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.module.parameters(), lr=0.05)
            return {
                "optimizer": opt,
                "lr_scheduler": {
                    "scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.num_training_steps),
                    "interval": "step",
                },
            }

    settings = {"trainer.max_epochs": 3, "trainer.accumulate_grad_batches": accumulate, "trainer.max_steps": max_steps}
    trainer = CosineToZero(toy_cfg(tmp_path, **settings, **QUIET))
    trainer.fit()
    assert trainer.num_training_steps == trainer.state.global_step == steps
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)  # the schedule ended with the run


def test_training_step_must_return_a_loss_under_automatic_optimization(tmp_path):
    class NoLoss(ToyTrainer):
        def training_step(self, batch):
            return 3

    with pytest.raises(TypeError, match="returned int 3, a number with no autograd graph.*returns the loss tensor"):
        NoLoss(toy_cfg(tmp_path, **QUIET)).fit()


def test_callbacks_are_ordered_by_phase_ties_keep_the_given_order():
    def make(name, phase=Phase.DEFAULT):
        return type(name, (Callback,), {"phase": phase})()

    given = [make("Save", Phase.PERSIST), make("U1"), make("Clip", Phase.CLIP), make("Cast", Phase.CAST), make("U2")]
    given += [make("Log", Phase.OBSERVE), make("Scale", Phase.SCALE), make("Sync", Phase.DISTRIBUTE)]
    ordered = [cb.name for cb in order_callbacks(given)]
    assert ordered == ["Cast", "Sync", "Scale", "Clip", "U1", "U2", "Log", "Save"]
    with pytest.raises(CallbackOrderError, match="unique"):
        order_callbacks([make("A"), make("A")])


class _KeyedCounter(Callback):
    """Lightning's pattern for several instances of one callback: a state_key naming what this one tracks."""

    def __init__(self, key):
        self.key, self.batches = key, 0

    @property
    def state_key(self):
        return self.key

    def on_train_batch_end(self, trainer, outputs, batch):
        self.batches += 1

    def state_dict(self):
        return {"batches": self.batches}


def test_callbacks_are_told_apart_by_their_checkpoint_key(tmp_path):
    """Two instances with their own state_key both save their state; two callbacks sharing one (of different
    classes) are refused: the checkpoint kept only the last one's state, and a resume gave it to both."""
    counters = [_KeyedCounter("Counter[train]"), _KeyedCounter("Counter[all]")]
    trainer = ToyTrainer(
        toy_cfg(tmp_path, **{"logging.tensorboard": False, "trainer.max_steps": 3}), callbacks=counters
    )
    trainer.fit()
    saved = torch.load(trainer.version_dir / "checkpoints" / "last.pt", weights_only=True)["callbacks"]
    assert saved["Counter[train]"] == saved["Counter[all]"] == {"batches": 3}

    class Other(_KeyedCounter):
        pass

    with pytest.raises(
        CallbackOrderError, match=r"state_key must be unique.*\['shared'\] \(from Other, _KeyedCounter\)"
    ):
        order_callbacks([_KeyedCounter("shared"), Other("shared")])


class _PersistPhaseCounter(Callback):
    """Runs in PERSIST (as a callback reading what the Trainer's own hooks log must), given after the config's
    ModelCheckpoint: counts epoch ends, and logs one per batch into an epoch mean."""

    phase = Phase.PERSIST

    def __init__(self):
        self.epochs = 0

    def on_train_batch_end(self, trainer, outputs, batch):
        trainer.log("train/batches", 1.0, on_step=False, on_epoch=True)

    def on_train_epoch_end(self, trainer):
        self.epochs += 1

    def state_dict(self):
        return {"epochs": self.epochs}


def test_a_checkpoint_holds_what_the_other_callbacks_of_its_phase_did_at_its_hook(tmp_path):
    """Lightning runs checkpoint callbacks after every other: a step's and an epoch's checkpoint hold what a callback
    of the same phase logged and the state it reached at that hook. Given after the ModelCheckpoint, it ran after the
    save, and each checkpoint held the state of one hook earlier (a resume from it counted that hook twice)."""
    settings = {"logging.tensorboard": False, "trainer.max_epochs": 1, "data.n": 16, "checkpoint.every_n_steps": 1,
                "trainer.num_sanity_val_steps": 0, "checkpoint.keep_last": 9}  # fmt: skip
    trainer = ToyTrainer(toy_cfg(tmp_path, **settings), callbacks=[_PersistPhaseCounter()])
    trainer.fit()
    checkpoints = trainer.version_dir / "checkpoints"
    step, epoch = (torch.load(checkpoints / name, weights_only=True) for name in ("step-00000001.pt", "epoch-0001.pt"))
    assert step["epoch_sums"]["train/batches"] == [8.0, 8]  # one batch of 8
    assert epoch["callbacks"]["_PersistPhaseCounter"] == {"epochs": 1}
    assert [cb.name for cb in trainer.callbacks][-2:] == ["_PersistPhaseCounter", "ModelCheckpoint"]


class NoDropout(ToyTrainer):
    def configure_model(self):
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def test_compiled_model_trains_and_checkpoints_plain_state(tmp_path):
    torch._dynamo.reset()
    trainer = NoDropout(toy_cfg(tmp_path, **{"trainer.compile": True, "trainer.max_epochs": 2,
                                              "logging.tensorboard": False}))  # fmt: skip
    trainer.fit()
    assert trainer.model is not trainer.module and hasattr(trainer.model, "_orig_mod")
    from ampkit.trainer.checkpoint_io import load_checkpoint

    saved = load_checkpoint(trainer.version_dir / "checkpoints" / "last.pt")["model"]
    assert set(saved) == set(trainer.module.state_dict())  # no "_orig_mod." prefixes
    eager = NoDropout(toy_cfg(tmp_path, **{"trainer.max_epochs": 2, **QUIET}))
    eager.fit()
    for key, value in eager.module.state_dict().items():
        torch.testing.assert_close(trainer.module.state_dict()[key], value, rtol=1e-4, atol=1e-5)


def test_skip_hook_names_only_the_losses_that_overflowed(tmp_path):
    class Flags(Callback):
        def on_after_backward(self, trainer, backward):
            for state in trainer.optimizer_state.values():
                state.loss_ids.update({"D", "G"})  # both losses reached both optimizers
            if backward.loss_id == "G" and trainer.state.iteration == 2:
                trainer.loss_state["G"].found_inf = True

        def on_before_optimizer_step(self, trainer, optimizer):
            state = trainer.optimizer_state[optimizer]
            state.found_inf = any(trainer.loss_state[k].found_inf for k in state.loss_ids if k in trainer.loss_state)

    skipped = []

    class Record(Callback):
        def on_optimizer_step_skipped(self, trainer, optimizer, loss_ids):
            skipped.append((trainer.state.iteration, trainer.optimizer_state[optimizer].name, loss_ids))

    TwoPlayer(toy_cfg(tmp_path, **{"trainer.max_steps": 3, **QUIET}), callbacks=[Flags(), Record()]).fit()
    assert skipped == [(2, "G", ["G"])]  # D stepped before G's backward flagged the overflow


class _GradsAtBatchEnd(Callback):
    """Records, after each iteration's zeroing, whether any parameter still holds a gradient."""

    def __init__(self) -> None:
        self.left: list[bool] = []

    def on_train_batch_end(self, trainer, outputs, batch) -> None:
        self.left.append(any(p.grad is not None for p in trainer.module.parameters()))


def test_gradients_are_none_after_every_iteration(tmp_path):
    seen = _GradsAtBatchEnd()
    ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_steps": 4, **QUIET}), callbacks=[seen]).fit()
    assert seen.left == [False] * 4


class _CountingZeroGrad(torch.optim.SGD):
    calls: list[bool | None] = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        type(self).calls.append(set_to_none)
        super().zero_grad(set_to_none=set_to_none)


def test_an_optimizer_s_own_zero_grad_is_called(tmp_path):
    """The Trainer zeroes plain optimizers' grads itself, but a zero_grad an optimizer overrides (a class's or an
    instance's) is the one that runs, once per iteration with set_to_none=True."""

    class OwnClass(ToyTrainer):
        def configure_optimizers(self):
            return _CountingZeroGrad(self.module.parameters(), lr=0.1)

    _CountingZeroGrad.calls = []
    OwnClass(toy_cfg(tmp_path / "class", **{"trainer.max_steps": 3, **QUIET})).fit()
    assert _CountingZeroGrad.calls == [True] * 3

    instance_calls = []

    class OwnInstance(ToyTrainer):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)
            plain = optimizer.zero_grad

            def zero_grad(set_to_none: bool = True) -> None:
                instance_calls.append(set_to_none)
                plain(set_to_none=set_to_none)

            optimizer.zero_grad = zero_grad
            return optimizer

    OwnInstance(toy_cfg(tmp_path / "instance", **{"trainer.max_steps": 3, **QUIET})).fit()
    assert instance_calls == [True] * 3


def test_zeroing_and_stepping_show_in_a_profile_as_torch_s_own(tmp_path):
    """While a profiler records, torch's zero_grad and step run, so their ranges are in the trace as in a hand
    loop."""
    trainer = ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_steps": 2, **QUIET}))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        trainer.fit()
    names = [event.name for event in prof.events()]
    assert names.count("Optimizer.zero_grad#SGD.zero_grad") == 2
    assert names.count("Optimizer.step#SGD.step") == 2


@pytest.mark.parametrize(
    "make",
    [
        lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
        lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True),
    ],
)
def test_step_updates_as_torch_s_step(make):
    """step_ (the Trainer's call of optimizer.step) leaves parameters and state bit for bit as torch's step."""
    torch.manual_seed(0)
    ours, theirs = nn.Linear(5, 3), nn.Linear(5, 3)
    theirs.load_state_dict(ours.state_dict())
    opt_ours, opt_theirs = make(ours.parameters()), make(theirs.parameters())
    for _ in range(3):
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        step_(opt_ours)
        opt_theirs.step()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)
    assert str(opt_ours.state_dict()) == str(opt_theirs.state_dict())


def test_step_hooks_an_instance_step_and_a_scheduler_still_see_every_step(tmp_path):
    """The Trainer steps plain optimizers without torch's wrapper, but not past what the wrapper serves: global
    and per-optimizer step hooks, a step the instance overrides, and an LR scheduler's check that the optimizer
    stepped first (it warns otherwise) each see every step."""
    calls: list[str] = []

    class Hooked(ToyTrainer):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)
            optimizer.register_step_pre_hook(lambda *_: calls.append("pre"))
            optimizer.register_step_post_hook(lambda *_: calls.append("post"))
            return optimizer

    Hooked(toy_cfg(tmp_path / "hooks", **{"trainer.max_steps": 3, **QUIET})).fit()
    assert calls == ["pre", "post"] * 3

    calls.clear()
    handles = [
        register_optimizer_step_pre_hook(lambda *_: calls.append("global pre")),
        register_optimizer_step_post_hook(lambda *_: calls.append("global post")),
    ]
    try:
        ToyTrainer(toy_cfg(tmp_path / "global", **{"trainer.max_steps": 3, **QUIET})).fit()
    finally:
        for handle in handles:
            handle.remove()
    assert calls == ["global pre", "global post"] * 3

    calls.clear()

    class OwnInstance(ToyTrainer):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)
            plain = optimizer.step
            optimizer.step = lambda: (calls.append("instance"), plain())[1]
            return optimizer

    OwnInstance(toy_cfg(tmp_path / "instance", **{"trainer.max_steps": 3, **QUIET})).fit()
    assert calls == ["instance"] * 3

    class Scheduled(ToyTrainer):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)
            schedule = torch.optim.lr_scheduler.StepLR(optimizer, 1)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr_scheduler.step.*before.*optimizer.step")
        trainer = Scheduled(toy_cfg(tmp_path / "scheduler", **{"trainer.max_steps": 3, **QUIET}))
        trainer.fit()
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.1**3)


class _CountingLoader:
    """Ten batches per pass, counting how many the Trainer pulls."""

    def __init__(self) -> None:
        self.pulled = 0
        self.data = [toy_dataset(80)[i * 8 : (i + 1) * 8] for i in range(10)]

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self):
        for batch in self.data:
            self.pulled += 1
            yield batch


def test_limit_train_batches_trains_and_pulls_only_that_many(tmp_path):
    loader = _CountingLoader()

    class Limited(ToyTrainer):
        def train_dataloader(self):
            return loader

    cfg = toy_cfg(tmp_path, **{"trainer.max_epochs": 2, "trainer.limit_train_batches": 3, **QUIET})
    trainer = Limited(cfg)
    trainer.fit()
    assert trainer.num_train_batches == 3
    assert trainer.state.global_step == 6
    assert loader.pulled == 6  # no batch is drawn past the limit


class _Stream:
    """The same ten batches as _CountingLoader, without a length (as a loader of an IterableDataset)."""

    def __init__(self) -> None:
        self.data = _CountingLoader().data

    def __iter__(self):
        yield from self.data


def test_a_loader_without_a_length_steps_its_last_partial_window_with_the_epoch(tmp_path):
    """Ten batches in windows of 4: the last window (2 batches) steps at the epoch's end, as it does for a loader
    with a length; its gradients went into the next epoch's first step (6 batches in one), or after the last epoch
    into no step at all."""
    trained = []
    for loader in (_CountingLoader(), _Stream()):

        class Accumulating(ToyTrainer):
            def train_dataloader(self, loader=loader):
                return loader

        cfg = toy_cfg(tmp_path / type(loader).__name__, **{"trainer.max_epochs": 2, **QUIET})
        trainer = Accumulating({**cfg, "trainer": {**cfg["trainer"], "accumulate_grad_batches": 4}})
        trainer.fit()
        trained.append(trainer)
    sized, stream = trained
    assert stream.num_train_batches is None and stream.state.global_step == sized.state.global_step == 6
    for key, value in sized.module.state_dict().items():
        assert torch.equal(stream.module.state_dict()[key], value), key


class _AugmentedStream:
    """A stream without a length whose every batch draws a random augmentation from torch's RNG as it is fetched."""

    def __iter__(self):
        for x, y in DataLoader(toy_dataset(48), batch_size=4):
            yield x + 0.1 * torch.randn_like(x), y


class _Augmenting(ToyTrainer):
    def train_dataloader(self):
        return _AugmentedStream()


def test_a_mid_epoch_resume_of_a_stream_fetched_ahead_is_bit_identical(tmp_path):
    """Accumulating over a stream fetches each batch before the one before it runs: the checkpoint's RNGs (after that
    batch) drew the resumed run's next batch, so its augmentation, and every weight after, differed."""
    quiet = {"logging.tensorboard": False, "trainer.accumulate_grad_batches": 2, "trainer.max_epochs": 2}
    whole = _Augmenting(toy_cfg(tmp_path / "whole", **quiet))
    whole.fit()
    _Augmenting(toy_cfg(tmp_path / "split", **quiet, **{"trainer.max_steps": 4})).fit()  # 8 of 12 batches
    resumed = _Augmenting(toy_cfg(tmp_path / "split", **quiet))
    resumed.fit(resume="last")
    assert resumed.state.global_step == whole.state.global_step == 12
    for key, value in whole.module.state_dict().items():
        assert torch.equal(resumed.module.state_dict()[key], value), key


class _Returns(ToyTrainer):
    """configure_callbacks() returns ``returned`` (a Lightning module's habit)."""

    returned: ClassVar[list[Callback]] = []

    def configure_callbacks(self):
        return self.returned


class _NamedCheckpoint(ModelCheckpoint):
    """A user's subclass, as a Lightning module returns one: it only adds to the files a save writes."""

    def on_save_checkpoint(self, trainer, checkpoint):
        checkpoint["note"] = "mine"


class _PatientStopping(EarlyStopping):
    """A user's subclass with a stopping rule of its own."""


@pytest.mark.parametrize(
    ("returned", "settings", "message"),
    [
        pytest.param(
            lambda: [EarlyStopping("val/mse", patience=9)],
            {"early_stopping.monitor": "val/mse"},
            "(from EarlyStopping of the config's early_stopping.monitor, EarlyStopping of configure_callbacks()); a "
            "checkpoint could not tell their states apart: ampkit runs both, where Lightning lets "
            "configure_callbacks() replace the Trainer's callback of its type; keep one: leave it out of the code or "
            "switch off the config's early_stopping.monitor",
            id="the config's early stopping",
        ),
        pytest.param(
            lambda: [ModelCheckpoint(every_n_epochs=1)],
            {},
            "['ModelCheckpoint[None]'] (from ModelCheckpoint of the config's checkpoint.enabled, ModelCheckpoint of "
            "configure_callbacks()); a checkpoint could not tell their states apart: ampkit runs both, where "
            "Lightning lets configure_callbacks() replace the Trainer's callback of its type; keep one: leave it out "
            "of the code or switch off the config's checkpoint.enabled",
            id="the config's periodic checkpoints",
        ),
        pytest.param(
            lambda: [_NamedCheckpoint(every_n_epochs=1, keep_last=5)],
            {},
            "['ModelCheckpoint[None]'] (from ModelCheckpoint of the config's checkpoint.enabled, _NamedCheckpoint of "
            "configure_callbacks()); a checkpoint could not tell their states apart: ampkit runs both, where "
            "Lightning lets configure_callbacks() replace the Trainer's callback of its type; keep one: leave it out "
            "of the code or switch off the config's checkpoint.enabled",
            id="a subclass beside the config's periodic checkpoints",
        ),
        pytest.param(
            lambda: [_PatientStopping("val/mse", patience=9)],
            {"early_stopping.monitor": "val/mse"},
            "(from EarlyStopping of the config's early_stopping.monitor, _PatientStopping of configure_callbacks())",
            id="a subclass on the config's early stopping metric",
        ),
    ],
)
def test_a_callback_configure_callbacks_returns_beside_the_configs_own_of_its_state_key_is_refused_naming_both(
    tmp_path, returned, settings, message
):
    """Lightning's configure_callbacks() replaces the Trainer's callback of its type or a subclass of it; ampkit runs
    every callback it is given (a CLI override of the config's would otherwise go unheard), so a clash names both and
    the way out. A subclass was keyed by its own class name: it ran beside the config's as a second writer keeping
    another number of files (or a second stopper on one metric)."""
    _Returns.returned = returned()
    trainer = _Returns(toy_cfg(tmp_path, **{"logging.tensorboard": False, **settings}))
    with pytest.raises(CallbackOrderError, match=re.escape(message)):
        trainer.fit()
    assert trainer.state.global_step == 0


def test_a_callback_given_to_the_trainer_and_returned_by_configure_callbacks_is_refused_naming_both(tmp_path):
    _Returns.returned = [_KeyedCounter("Counter")]
    trainer = _Returns(toy_cfg(tmp_path, **{"logging.tensorboard": False}), callbacks=[_KeyedCounter("Counter")])
    message = (
        "(from _KeyedCounter of configure_callbacks(), _KeyedCounter of Trainer(callbacks=...)); a checkpoint could "
        "not tell their states apart: ampkit runs both, where Lightning lets configure_callbacks() replace the "
        "Trainer's callback of its type; give each its own state_key property"
    )
    with pytest.raises(CallbackOrderError, match=re.escape(message)):
        trainer.fit()


def test_a_best_k_checkpoint_configure_callbacks_returns_runs_beside_the_configs_periodic_one(tmp_path):
    """Lightning's commonest use: a ModelCheckpoint(monitor=...) from configure_callbacks(), here a subclass made on
    purpose. Its state_key differs from the config's periodic checkpoints', so both run, as Lightning's replacement
    would not (it drops the Trainer's): the periodic last.pt and the best-k files, each with its own state."""
    _Returns.returned = [_NamedCheckpoint(monitor="val/mse", save_top_k=1)]
    trainer = _Returns(toy_cfg(tmp_path, **{"logging.tensorboard": False, "trainer.max_epochs": 2}))
    trainer.fit()
    checkpoints = trainer.version_dir / "checkpoints"
    assert (checkpoints / "best.pt").is_file() and (checkpoints / "last.pt").is_file()
    saved = torch.load(checkpoints / "last.pt", weights_only=True)["callbacks"]
    assert {"ModelCheckpoint[None]", "ModelCheckpoint[val/mse]"} <= set(saved)
    assert torch.load(checkpoints / "best.pt", weights_only=True)["note"] == "mine"


def test_a_checkpoint_configure_callbacks_returns_saving_step_files_by_other_settings_than_the_configs_is_refused(
    tmp_path,
):
    """Both prune one directory's step and epoch files, each by its own keep_last: the config's keep_last=3 would
    keep two. One error before training names both settings and the way out."""
    _Returns.returned = [ModelCheckpoint(monitor="val/mse")]  # every_n_epochs=1, keep_last=2 by default
    trainer = _Returns(toy_cfg(tmp_path, **{"logging.tensorboard": False, "checkpoint.keep_last": 3}))
    message = (
        "2 ModelCheckpoint callbacks save step/epoch files into one checkpoints directory by other settings "
        "(ModelCheckpoint[None]: every_n_steps=0, every_n_epochs=1, keep_last=3; ModelCheckpoint[val/mse]: "
        "every_n_steps=0, every_n_epochs=1, keep_last=2), each pruning the other's: give the one in code "
        "every_n_epochs=0 and every_n_steps=0"
    )
    with pytest.raises(CallbackOrderError, match=re.escape(message)):
        trainer.fit()
    assert trainer.state.global_step == 0
