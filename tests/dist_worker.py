"""One rank of a distributed test: ``python dist_worker.py SCENARIO OUT_DIR`` with torchrun-style env vars."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from torn_checkpoint import tear
from toy_trainers import ToyTrainer, toy_dataset

import ampkit
from ampkit import cli as ampkit_cli
from ampkit.callbacks import EarlyStopping, MaxTime, ModelCheckpoint
from ampkit.callbacks import checkpoint as checkpoint_module
from ampkit.callbacks import tensorboard as tensorboard_module
from ampkit.trainer import trainer as trainer_module

RANK = int(os.environ.get("RANK", 0))
FUSED = os.environ.get("FUSED") == "1"  # torch's fused SGD: it takes GradScaler's found_inf, so device verdicts
SKIP_VERDICT = os.environ.get("SKIP_VERDICT", "auto")
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # which restart of torchrun's worker group this is


class Plain(ToyTrainer):
    """No dropout, no shuffling: 2 ranks x batch B see exactly 1 process x batch 2B."""

    def configure_model(self):
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def train_dataloader(self):
        return DataLoader(toy_dataset(64), batch_size=self.cfg.data.batch_size, shuffle=False)


class RankScores(Plain):
    """No validation; logs a train/score epoch mean of its own on each rank (4 batches per epoch): rank 1's alone
    would stop a patience of 2 after epoch 2, rank 0's after epoch 3; a ReduceLROnPlateau (patience 0) steps on it."""

    scores = {0: [0.5, 0.2, 0.3, 0.4, 0.1], 1: [0.1, 0.9, 0.9, 0.9, 0.9]}
    val_dataloader = ampkit.Trainer.val_dataloader

    def training_step(self, batch):
        self.log("train/score", self.scores[RANK][self.state.epoch], on_step=False, on_epoch=True)
        return super().training_step(batch)

    def configure_optimizers(self):
        sgd = torch.optim.SGD(self.module.parameters(), lr=0.05)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(sgd, patience=0, factor=0.5)
        return {"optimizer": sgd, "lr_scheduler": {"scheduler": plateau, "monitor": "train/score"}}


class RankZeroOnlyScores(RankScores):
    """The same scores, logged by rank 0 alone with Lightning's rank_zero_only=True (and its batch_size and
    add_dataloader_idx); each rank's first batch asks for sync_dist=True, which two ranks refuse."""

    sync_refused: str = ""

    def training_step(self, batch):
        if self.state.global_step == 0:
            try:
                self.log("train/synced", 1.0, sync_dist=True)
            except ampkit.trainer.user_code.UserCodeError as exc:
                self.sync_refused = str(exc)
        if RANK == 0:
            score = self.scores[0][self.state.epoch]
            options = {"rank_zero_only": True, "batch_size": 4, "add_dataloader_idx": False}
            self.log("train/score", score, on_step=False, on_epoch=True, **options)
        return Plain.training_step(self, batch)


class RankValidationScores(RankScores):
    """Validates each epoch; its on_validation_end logs a val_auc of its own on each rank (an AUC over that rank's
    shard): rank 1's alone would stop a patience of 1 after epoch 2, rank 0's after epoch 3; a ReduceLROnPlateau
    (patience 0) steps on it. A validate() after the fit logs one of its own on each rank too."""

    val_dataloader = Plain.val_dataloader

    def training_step(self, batch):
        return Plain.training_step(self, batch)

    def on_validation_end(self, metrics):
        value = {"fit": lambda: self.scores[RANK][self.state.epoch], "validate": lambda: 10.0 + RANK}
        self.log("val_auc", value.get(self.state.stage, lambda: 0.0)())

    def configure_optimizers(self):
        sgd = torch.optim.SGD(self.module.parameters(), lr=0.05)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(sgd, patience=0, factor=0.5)
        return {"optimizer": sgd, "lr_scheduler": {"scheduler": plateau, "monitor": "val_auc"}}


class RankZeroValidationScores(RankValidationScores):
    """The same, its val_auc logged by rank 0 alone (an AUC computed once, over what every rank predicted): rank zero's
    is the one monitored, so rank 1 has none of its own, in the sanity validation either."""

    def on_validation_end(self, metrics):
        if self.is_global_zero:
            super().on_validation_end(metrics)


class BareModule(Plain):
    """Its loss comes from self.module, the model DDP wraps, not from self.model."""

    def training_step(self, batch):
        x, y = batch
        return F.mse_loss(self.module(x).squeeze(1), y)


class UnfreezesAtEpoch1(Plain):
    """Fine-tuning: the first layer is frozen when DDP wraps the model, and unfrozen at epoch 1 (under O2, when it gets
    its fp32 master: the parameter the ranks must average)."""

    def configure_model(self):
        model = super().configure_model()
        model[0].requires_grad_(False)
        return model

    def on_train_epoch_start(self):
        if self.state.epoch == 1:
            self.module[0].requires_grad_(True)


class UnfreezesBetweenBackwards(UnfreezesAtEpoch1):
    """The same layer unfrozen in training_step at batch 3 instead, with two batches an iteration: between the two
    backwards of iteration 2."""

    def on_train_epoch_start(self):
        pass

    def training_step(self, batch):
        if self.state.epoch == 0 and self.state.batch_idx == 3:
            self.module[0].requires_grad_(True)
        return super().training_step(batch)


class RefreezesBetweenBackwards(UnfreezesAtEpoch1):
    """The same layer unfrozen at epoch 0's start (after DDP wrapped the model) and frozen again in training_step at
    batch 3, with two batches an iteration: between the two backwards of iteration 2, whose step it takes on the
    gradient of batch 2."""

    def on_train_epoch_start(self):
        if self.state.epoch == 0:
            self.module[0].requires_grad_(True)

    def training_step(self, batch):
        if self.state.epoch == 0 and self.state.batch_idx == 3:
            self.module[0].requires_grad_(False)
        return super().training_step(batch)


# the precision of each ddp_unfreeze scenario
UNFREEZE_PRECISION = {
    "ddp_unfreeze": {},
    "ddp_unfreeze_fp16": {"opt_level": "O1", "dtype": "float16", "init_scale": 256.0},
    "ddp_unfreeze_o2": {"opt_level": "O2", "dtype": "float16", "init_scale": 256.0},
    "ddp_unfreeze_between_fp16": {"opt_level": "O1", "dtype": "float16", "init_scale": 256.0},
    "ddp_unfreeze_between_o2": {"opt_level": "O2", "dtype": "float16", "init_scale": 256.0},
    "ddp_unfreeze_refreeze_between_o2": {"opt_level": "O2", "dtype": "float16", "init_scale": 256.0},
}


def unfreeze_run(scenario: str) -> tuple[type, dict]:
    """The trainer class of a ddp_unfreeze scenario, and its ``trainer`` options beyond two epochs."""
    if "_refreeze_between_" in scenario:
        return RefreezesBetweenBackwards, {"accumulate_grad_batches": 2}
    if "_between_" in scenario:
        return UnfreezesBetweenBackwards, {"accumulate_grad_batches": 2}
    return UnfreezesAtEpoch1, {}


class Shuffled(Plain):
    """Shuffled: the Trainer's seeded sampler deals one permutation per epoch round-robin to the ranks, so 2 ranks
    x batch B still see 1 process x batch 2B, and a checkpoint resumes on either along the same samples."""

    def train_dataloader(self):
        return DataLoader(toy_dataset(64), batch_size=self.cfg.data.batch_size, shuffle=True)


class Evaluated(Plain):
    """Predicts on the validation set (24 samples: 12 per rank, no padding)."""

    def predict_dataloader(self):
        return self.val_dataloader()


class ValidatesInAHook(Plain):
    """Calls validate() itself at each epoch's end, inside the fit."""

    def on_train_epoch_end(self):
        self.hook_metrics = self.validate()


class UnevenValidation(Plain):
    """25 validation samples in batches of 4: 13 for rank 0 (4 batches), 12 for rank 1 (3 batches)."""

    def val_dataloader(self):
        return DataLoader(toy_dataset(25, seed=7), batch_size=4)


class RankStream(IterableDataset):
    """A stream of its own samples per rank: 40 (10 batches of 4) on rank 0, the other 24 (6 batches) on rank 1."""

    def __iter__(self):
        x, y = toy_dataset(64).tensors
        samples = list(zip(x, y, strict=True))
        return iter(samples[:40] if RANK == 0 else samples[40:])


class UnevenStream(Plain):
    def train_dataloader(self):
        return DataLoader(RankStream(), batch_size=self.cfg.data.batch_size)


class WholeStream(IterableDataset):
    """The same 24 samples on every rank: a stream that never looks at its rank."""

    def __iter__(self):
        x, y = toy_dataset(64).tensors
        return iter(list(zip(x, y, strict=True))[:24])


class DuplicatedStream(Plain):
    def train_dataloader(self):
        return DataLoader(WholeStream(), batch_size=self.cfg.data.batch_size)


def warned(fit) -> list[str]:
    """The warnings ``fit()`` gave."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fit()
    return [str(w.message) for w in seen]


class UnevenLists(Plain):
    """Batches a user split by hand: 10 on rank 0, 6 on rank 1 (a length each, known before training)."""

    def train_dataloader(self):
        return list(DataLoader(RankStream(), batch_size=self.cfg.data.batch_size))


class UnevenStreamAndList(Plain):
    """Rank 0 streams its 10 batches, rank 1 hands over a list of its 6: only rank 0's count is unknown."""

    def train_dataloader(self):
        loader = DataLoader(RankStream(), batch_size=self.cfg.data.batch_size)
        return list(loader) if RANK == 1 else loader


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 1), nn.Linear(6, 1)

    def forward(self, x, use_b: bool):
        return self.b(x) if use_b else self.a(x)


class UnusedParameters(Plain):
    """Odd steps train branch b, even steps branch a: each step leaves the other's parameters without a gradient."""

    def configure_model(self):
        return Branches()

    def training_step(self, batch):
        x, y = batch
        return F.mse_loss(self.model(x, self.state.global_step % 2 == 1).squeeze(1), y)

    def val_dataloader(self):
        return None


class FrozenA(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 1), nn.Linear(6, 1)
        self.a.requires_grad_(False)

    def forward(self, x, use_b_weight: bool):
        return self.a(x) + (self.b(x) if use_b_weight else self.b.bias)


class UnusedAfterUnfreezing(UnusedParameters):
    """Branch a is frozen when DDP wraps the model; from step 2 it is unfrozen and b's weight is left unused."""

    def configure_model(self):
        return FrozenA()

    def training_step(self, batch):
        x, y = batch
        if self.state.global_step == 2:
            self.module.a.requires_grad_(True)
        return F.mse_loss(self.model(x, self.state.global_step < 2).squeeze(1), y)


class ValidationStream(IterableDataset):
    """The 13 samples of UnevenValidation's stream split by hand: 0-8 on rank 0 (3 batches of 4), 9-12 on rank 1
    (1 batch); none on rank 1 when ``empty_on_1``."""

    def __init__(self, empty_on_1: bool = False):
        self.empty_on_1 = empty_on_1

    def __iter__(self):
        x, y = toy_dataset(13, seed=7).tensors
        mine = range(9) if RANK == 0 else range(0) if self.empty_on_1 else range(9, 13)
        return iter([(x[i], y[i]) for i in mine])


class UnevenValidationStream(Plain):
    empty_on_1 = False

    def val_dataloader(self):
        return DataLoader(ValidationStream(self.empty_on_1), batch_size=4)

    def predict_dataloader(self):
        return self.val_dataloader()


class NormedUnevenValidation(UnevenValidationStream):
    """A BatchNorm (buffers DDP broadcasts at the first forward after a training one) and a validation stream whose
    9 samples are all rank 0's: rank 1 has none."""

    empty_on_1 = True

    def configure_model(self):
        return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))


class Normed(Plain):
    """A BatchNorm, whose buffers every rank takes from rank 0 before each validation."""

    def configure_model(self):
        return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))


class CountsRecompiles(ampkit.Callback):
    """The recompiles torch's dynamo logged by the end of each validation and of the fit, and the graphs it compiled."""

    def __init__(self):
        import logging

        torch._logging.set_logs(recompiles=True)
        self.logged = 0
        counter = logging.Handler()
        counter.emit = lambda record: setattr(self, "logged", self.logged + 1)
        logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(counter)
        self.seen: list[int] = []
        self.graphs = 0

    def on_validation_end(self, trainer, metrics):
        self.seen.append(self.logged)

    def on_fit_end(self, trainer):
        self.seen.append(self.logged)
        self.graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]


def compiled_with(backend: str) -> None:
    """``torch.compile`` with ``backend`` (``trainer.compile`` takes none: inductor builds C++ for minutes on CPU)."""
    compile_ = torch.compile
    torch.compile = lambda model, mode=None, **kwargs: compile_(model, **{**kwargs, "backend": backend})


class DuplicatedEvaluation(Plain):
    """Validates, tests and predicts on a stream that gives every rank the same 24 samples."""

    def val_dataloader(self):
        return DataLoader(WholeStream(), batch_size=4)

    test_dataloader = predict_dataloader = val_dataloader

    def test_step(self, batch):
        return self.validation_step(batch)


class UnevenValidationLists(Plain):
    """Per-rank lists of validation batches, their counts known up front: 3 on rank 0, 1 on rank 1."""

    rank1_batches = slice(3, None)

    def val_dataloader(self):
        x, y = toy_dataset(16, seed=7).tensors
        batches = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 16, 4)]
        return batches[:3] if RANK == 0 else batches[self.rank1_batches]


class EmptyValidationListOnRank1(UnevenValidationLists):
    """The same, with none on rank 1: it runs each validation with no batch, meeting rank 0's collectives."""

    rank1_batches = slice(0, 0)


class ValidationLoaderOnRank0Only(UnevenValidationLists):
    """Rank 1's val_dataloader() returns None, rank 0's batches: refused on every rank at set-up."""

    def val_dataloader(self):
        return super().val_dataloader() if RANK == 0 else None


class OptimizerFailsOnRank1(Plain):
    def configure_optimizers(self):
        if RANK == 1:
            raise ValueError("rank 1's optimizer settings are wrong")
        return super().configure_optimizers()


class StepFailsOnRank1(Plain):
    def training_step(self, batch):
        if RANK == 1 and self.state.global_step == 3:
            raise ValueError("rank 1's batch 3 is corrupt")
        return super().training_step(batch)


class MetricsPerRank(Plain):
    """Each rank returns one metric the other does not, in another order: the averages must still line up."""

    def validation_step(self, batch):
        mse = super().validation_step(batch)["mse"]
        return {"mse": mse, "only0": 1.0} if RANK == 0 else {"only1": 3.0, "mse": mse}


class ExpertOnRank1(Plain):
    """A layer only rank 1's batches reach (a routed expert): on rank 0 it has no gradient at all."""

    def configure_model(self):
        body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        return nn.ModuleDict({"body": body, "expert": nn.Linear(6, 1)})

    def training_step(self, batch):
        x, y = batch
        out = self.model["body"](x).squeeze(1)
        if RANK == 1:
            out = out + self.model["expert"](x).squeeze(1)
        return F.mse_loss(out, y)

    def val_dataloader(self):
        return None


class KeepInitialExpert(ampkit.Callback):
    def on_train_start(self, trainer):
        self.weight = trainer.module["expert"].weight.detach().clone()


class TwoLosses(Plain):
    automatic_optimization = False

    def configure_model(self):
        return nn.ModuleDict({"G": nn.Linear(6, 6), "D": nn.Linear(6, 1)})

    def configure_optimizers(self):
        def sgd(name: str) -> dict:
            return {"optimizer": torch.optim.SGD(self.module[name].parameters(), lr=0.1, fused=FUSED), "name": name}

        return [sgd("D"), sgd("G")]

    def val_dataloader(self):
        return None

    def training_step(self, batch):
        x = batch[0]
        G, D = self.model["G"], self.model["D"]
        loss_d = F.softplus(-D(x)).mean() + F.softplus(D(G(x).detach())).mean()
        self.backward(loss_d, loss_id=0, optimizer=self.optimizers["D"])
        self.step(self.optimizers["D"])
        loss_g = self.generator_loss(F.softplus(-D(G(x))).mean())
        self.backward(loss_g, loss_id=1, optimizer=self.optimizers["G"])
        self.step(self.optimizers["G"])

    def generator_loss(self, loss):
        return loss


class InfOnRank1(TwoLosses):
    """Rank 1 alone gets an inf loss 1 at iteration 3; the real loss scalers must agree across ranks."""

    def generator_loss(self, loss):
        return loss * float("inf") if RANK == 1 and self.state.iteration == 3 else loss


class SkipRecorder(ampkit.Callback):
    def __init__(self):
        self.skips = []

    def on_optimizer_step_skipped(self, trainer, optimizer, loss_ids):
        self.skips.append((trainer.state.iteration, trainer.optimizer_state[optimizer].name))


class OverflowOnRank1(ampkit.Callback):
    """Rank 1 alone sees a non-finite gradient in loss 1 (reaching optimizer G) at iteration 3."""

    def __init__(self):
        self.skips = []

    def on_after_backward(self, trainer, backward):
        for opt, state in trainer.optimizer_state.items():
            if any(p.grad is not None for g in opt.param_groups for p in g["params"]):
                state.loss_ids.add(backward.loss_id)
        if RANK == 1 and backward.loss_id == 1 and trainer.state.iteration == 3:
            trainer.loss_state[1].found_inf = True

    def on_optimizer_step_skipped(self, trainer, optimizer, loss_ids):
        self.skips.append((trainer.state.iteration, trainer.optimizer_state[optimizer].name))


class SuicideAt(ampkit.Callback):
    def on_train_batch_end(self, trainer, outputs, batch):
        if RANK == 1 and trainer.state.global_step == 3:
            os.kill(os.getpid(), signal.SIGKILL)


class SigtermOnRank1At3(ampkit.Callback):
    """What torchrun's agent passes on when a scheduler preempts the job, here on rank 1 only."""

    def on_train_batch_end(self, trainer, outputs, batch):
        if RANK == 1 and trainer.state.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)


class FusedSgdToy(ToyTrainer):
    """ToyTrainer with torch's fused SGD (no momentum): it takes GradScaler's found_inf, so under
    ``skip_verdict=device`` the iteration's facts stay on the device."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.module.parameters(), lr=self.cfg.lr, fused=True)


def preempted_then_resumed(out: Path, base: dict, trainer_class=ToyTrainer, log_every: int = 2) -> dict:
    """The ``resume`` scenario's run, SIGTERMed on rank 1 at step 3 (logging every ``log_every`` steps), then
    resumed."""
    cfg = {**base, "data": {"batch_size": 4}, "checkpoint": {"every_n_steps": 3, "keep_last": 50},
           "trainer": {**base["trainer"], "max_epochs": 2},
           "logging": {"tensorboard": False, "log_every_n_steps": log_every}}  # fmt: skip
    trainer = trainer_class(cfg, callbacks=[SigtermOnRank1At3()])
    try:
        trainer.fit()
        preempted = None
    except KeyboardInterrupt as exc:
        preempted = f"{type(exc).__name__}: {exc}"
    last = torch.load(out / "run" / "version_0" / "checkpoints" / "last.pt", weights_only=True)
    resumed = trainer_class(cfg)
    resumed.fit(resume="last")
    return {"preempted": preempted, "saved": last["loop"], "stopped_early": last.get("stopped_early"),
            "resumed_at": resumed.fit_start.loop, "continued": str(resumed.fit_start.version_dir),
            "model": resumed.module.state_dict(), "facts_on_device": trainer._facts_on_device,
            "final_step": resumed.state.global_step}  # fmt: skip


class DiesOnceAt4(ampkit.Callback):
    """Under torchrun --max-restarts: rank 1 is SIGKILLed after step 4 of the first attempt (if ``kills``); records
    where each attempt started."""

    def __init__(self, kills: bool = True):
        self.started_at, self.kills = None, kills

    def on_train_start(self, trainer):
        self.started_at = trainer.state.global_step

    def on_train_batch_end(self, trainer, outputs, batch):
        if self.kills and RANK == 1 and ATTEMPT == 0 and trainer.state.global_step == 4:
            os.kill(os.getpid(), signal.SIGKILL)


class StopAtStep3(ampkit.Callback):
    """Asks to stop after step 3 (mid-epoch), as a rule reading this rank's own facts would."""

    def on_train_batch_end(self, trainer, outputs, batch):
        if trainer.state.global_step == 3:
            trainer.state.should_stop, trainer.state.stop_reason = True, f"rank {RANK}'s rule"


class StopAtSecondValidation(ampkit.Callback):
    """Asks to stop at the end of the second validation, as an early stopping rule of this rank's own would."""

    def __init__(self) -> None:
        self.validations = 0

    def on_validation_end(self, trainer, metrics):
        self.validations += 1
        if self.validations == 2:
            trainer.state.should_stop, trainer.state.stop_reason = True, f"rank {RANK}'s validation rule"


class StepLog(ampkit.Callback):
    """A user's logging callback with no collectives: the steps this rank ended."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_batch_end(self, trainer, outputs, batch):
        self.steps.append(trainer.state.global_step)


def callbacks_on_rank_zero(out: Path, base: dict) -> dict:
    """A fit per callback given on rank 0 alone (Lightning's ``[...] if rank == 0 else []``): a ModelCheckpoint and an
    EarlyStopping take part in collectives (refused on every rank at set-up), a plain logging callback does not. And a
    subclass of ModelCheckpoint on rank 0 beside a ModelCheckpoint on rank 1: the same collectives, so it trains."""
    given = {"checkpoint": lambda: ModelCheckpoint(every_n_steps=1), "early_stopping": lambda: EarlyStopping("val/mse"),
             "logging": StepLog,
             "subclass": lambda: (RenamedCheckpoint if RANK == 0 else ModelCheckpoint)(every_n_steps=1)}  # fmt: skip
    outcomes = {}
    for name, make in given.items():
        trained = {**base["trainer"], "max_steps": 2, "val_every_n_steps": 1}
        cfg = {**base, "run_dir": str(out / name), "data": {"batch_size": 4}, "checkpoint": {"enabled": False},
               "trainer": trained, "distributed": {"timeout_s": 10}}  # fmt: skip
        callbacks = [make()] if RANK == 0 or name == "subclass" else []
        outcome = _outcome(Plain(cfg, callbacks=callbacks))
        outcomes[name] = outcome[:2] if outcome[0] == "trained" else (outcome[0], outcome[1], outcome[3])
        if name == "logging" and callbacks:
            outcomes[name] += (callbacks[0].steps,)
    return outcomes


class RenamedCheckpoint(ModelCheckpoint):
    """A ModelCheckpoint under another name: it takes the same collectives as the class it extends."""


class StopAtEpoch1Start(ampkit.Callback):
    """Asks to stop as the second epoch starts, before any of its batches."""

    def on_train_epoch_start(self, trainer):
        if trainer.state.epoch == 1:
            trainer.state.should_stop, trainer.state.stop_reason = True, f"rank {RANK}'s epoch rule"


def stop_runs(out: Path, base: dict) -> dict:
    """One fit per way to stop, each asked on some ranks only: the step every rank ended at, and rank zero's last
    checkpoint (loop position and recorded stop). Two epochs for the stop asked at an epoch's start, one otherwise."""
    rule = StopAtStep3
    asked_on = {"rank 1": {1: [rule()]}, "rank 0": {0: [rule()]}, "both": {0: [rule()], 1: [rule()]},
                "validation rule on rank 1": {1: [StopAtSecondValidation()]},
                "max_time on rank 1": {1: [MaxTime(1e-3)]},
                "epoch start on rank 1": {1: [StopAtEpoch1Start()]}}  # fmt: skip
    runs = {}
    for name, callbacks in asked_on.items():
        run_dir = out / name.replace(" ", "_")
        epochs = 2 if name.startswith("epoch start") else 1
        cfg = {**base, "run_dir": str(run_dir), "data": {"batch_size": 4}, "logging": {"tensorboard": False,
               "log_every_n_steps": 100}, "trainer": {**base["trainer"], "max_epochs": epochs, "val_every_n_steps": 3,
               "num_sanity_val_steps": 0}, "distributed": {"timeout_s": 10}}  # fmt: skip
        trainer = Plain(cfg, callbacks=callbacks.get(RANK, []))
        trainer.fit()
        last = torch.load(run_dir / "version_0" / "checkpoints" / "last.pt", weights_only=False) if RANK == 0 else {}
        runs[name] = (trainer.state.global_step, last.get("loop"), last.get("stopped_early"))
    return runs


class BatchNormNet(ToyTrainer):
    """Unequal per-rank batches (3 and 5 rows); loss scaled so averaged grads equal the 8-row batch's."""

    def configure_model(self):
        return nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))

    def configure_optimizers(self):
        return torch.optim.SGD(self.module.parameters(), lr=0.1)

    def train_dataloader(self):
        x = toy_dataset(8).tensors[0]
        return [x[:3]] if RANK == 0 else [x[3:]]

    def val_dataloader(self):
        return None

    def training_step(self, batch):
        return (self.model(batch) ** 2).sum() * 2 / 8


class OneSamplePerRank(BatchNormNet):
    """2 samples over 2 ranks: each rank's batch norm sees one."""

    def train_dataloader(self):
        return [toy_dataset(8).tensors[0][RANK : RANK + 1]]


class BufferSpy(ampkit.Callback):
    """The module's buffers as each batch's forward will see them."""

    def __init__(self) -> None:
        self.seen: list[dict[str, torch.Tensor]] = []

    def on_train_batch_start(self, trainer, batch):
        self.seen.append({k: v.clone() for k, v in trainer.module.named_buffers()})


class GradSpy(ampkit.Callback):
    def on_before_optimizer_step(self, trainer, optimizer):
        self.grads = {n: p.grad.clone() for n, p in trainer.module.named_parameters()}


def rank_zero_decides(out: Path, base: dict) -> dict:
    """Each rank in a folder of its own with a relative run_dir, as each node of a job sees its own local disk: a run
    of 4 steps (rank 0's folder gets its checkpoints), then resumes of it while rank 1's folder holds nothing, an older
    checkpoint at last.pt's path, a copy of rank 0's torn in a tensor's bytes, and a whole copy (a validate of it
    first, while rank 1 has none); then a resume rank 0 refuses (a live run holds the lock), one whose pruning at its
    start fails on rank 0, a run whose dropping of a best-k file fails on rank 0, one whose run_dir rank 0 cannot look
    at, one whose TensorBoard events rank 0 cannot open, a run whose TensorBoard events rank 0 can no longer write
    mid-run (and its resume), a predict whose output rank 0 refuses (a file of the user's in the way on its disk
    alone), one whose shard rank 1 cannot write, a fresh run whose first save fails on rank 0 (its disk is full),
    the one rank that writes, and a run whose training step fails on every rank after rank 0 saved a checkpoint."""
    here = out / f"node{RANK}"
    here.mkdir()
    os.chdir(here)
    checkpoints = Path("run/version_0/checkpoints")
    trained = {**base["trainer"], "max_steps": 4, "max_epochs": 10}
    cfg = {**base, "run_dir": "run", "checkpoint": {"every_n_steps": 2, "keep_last": 50, "every_n_epochs": 0},
           "distributed": {"timeout_s": 20}, "trainer": trained}  # fmt: skip
    Plain(cfg).fit()
    node0 = out / "node0" / checkpoints
    outcomes = {"validate": _outcome(Plain(cfg), validate="last")}
    for case, max_steps, copied in [("none", 6, None), ("older", 6, "step-00000002.pt"), ("torn", 6, "last.pt"),
                                    ("copied", 6, "last.pt"), ("locked", 8, "last.pt")]:  # fmt: skip
        if RANK == 1 and copied is not None:
            checkpoints.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(node0 / copied, checkpoints / "last.pt")
            if case == "torn":
                tear(checkpoints / "last.pt", checkpoints / "last.pt")
        if RANK == 0 and case == "locked":  # the pid of a live process on this host: another run's
            lock = {"pid": os.getppid(), "host": socket.gethostname(), "since": "now"}
            (checkpoints.parent / "run.lock").write_text(json.dumps(lock))
        outcomes[case] = _outcome(Plain({**cfg, "trainer": {**cfg["trainer"], "max_steps": max_steps}}), resume="last")
    prune_periodic = checkpoint_module.prune_periodic
    if RANK == 0:  # the lock's run gone, a resume's pruning of rank 0's checkpoints at fit start fails (EACCES)
        (checkpoints.parent / "run.lock").unlink()
        checkpoint_module.prune_periodic = _cannot_delete
    outcomes["prune_refused"] = _outcome(Plain({**cfg, "trainer": {**cfg["trainer"], "max_steps": 8}}), resume="last")
    checkpoint_module.prune_periodic = prune_periodic
    deletable = checkpoint_module.deletable
    if RANK == 0:  # rank 0 cannot look at the best-k files it would drop from the ranking (EACCES)
        checkpoint_module.deletable = _cannot_delete
    ranked = {**cfg, "run_dir": "ranked", "data": {"batch_size": 8}, "trainer": {**base["trainer"], "max_epochs": 2},
              "checkpoint": {"monitor": "train/score", "every_n_steps": 0, "every_n_epochs": 0}}  # fmt: skip
    outcomes["drop_refused"] = _outcome(RankScores(ranked))
    checkpoint_module.deletable = deletable
    unwritable_reason, looking = trainer_module.unwritable_reason, Plain({**cfg, "run_dir": "looked"})
    if RANK == 0:  # at fit's start rank 0 cannot look at run_dir's parent (EACCES on a folder above it)
        trainer_module.unwritable_reason = _cannot_delete
    outcomes["look_refused"] = _outcome(looking)
    trainer_module.unwritable_reason = unwritable_reason
    summary_writer = tensorboard_module.summary_writer
    if RANK == 0:  # rank 0, the one that writes events, cannot open them (its disk is full)
        tensorboard_module.summary_writer = _disk_full
    outcomes["events_refused"] = _outcome(Plain({**cfg, "run_dir": "events", "logging": {"tensorboard": True}}))
    tensorboard_module.summary_writer = summary_writer
    events_failed = _events_fail_mid_run(cfg, checkpoints)
    outcomes["events_fail_mid_run"], outcomes["resumed_after_events"], outcomes["events_fail_at_the_end"] = (
        events_failed
    )
    if RANK == 0:  # a user's file in the way on rank 0's disk only: rank 1 would have predicted into a collective
        Path("preds.rank0.pt").write_text("the user's")
    outcomes["predict_refused"] = _outcome(Plain(cfg), predict="preds.pt")
    save_atomic = trainer_module.save_atomic
    if RANK == 1:  # rank 1's disk fills as it writes its shard of the predictions; rank 0 writes its own
        trainer_module.save_atomic = _disk_full
    outcomes["predict_unwritten"] = _outcome(Evaluated(cfg), predict="unwritten.pt")
    trainer_module.save_atomic = save_atomic
    saving = checkpoint_module.save_atomic
    if RANK == 0:
        checkpoint_module.save_atomic = _disk_full
    outcomes["disk_full"] = _outcome(Plain(cfg))
    outcomes["disk_full_cli"] = _cli_fit({**cfg, "run_dir": "clirun", "trainer_class": "dist_worker:Plain"})
    checkpoint_module.save_atomic = saving
    outcomes["failed_at_step_3"] = _noted(FailsAtStep3({**cfg, "run_dir": "failing"}))
    return {"outcomes": outcomes}


class FailsAtStep3(Plain):
    """A training step that raises on every rank at step 3, after the checkpoint of step 2 (rank 0's disk alone)."""

    def training_step(self, batch):
        if self.state.global_step == 2:
            raise ValueError("a sample that cannot be read")
        return super().training_step(batch)


def _noted(trainer: ampkit.Trainer) -> list[str]:
    """The notes ampkit added to the error of ``trainer.fit()``."""
    try:
        trainer.fit()
    except ValueError as exc:
        return list(getattr(exc, "__notes__", []))
    return []


class EventsDiskFills(ampkit.Callback):
    """From step ``from_step`` on, the disk under rank 0's event files is full: TensorBoard's writer thread fails, and
    the next write on the training thread raises. A text is logged at each step, as examples/gpt.py logs samples."""

    full = False

    def __init__(self, from_step: int) -> None:
        self.from_step = from_step

    def on_train_batch_start(self, trainer, batch):
        EventsDiskFills.full = RANK == 0 and trainer.state.global_step + 1 >= self.from_step

    def on_train_batch_end(self, trainer, outputs, batch):
        trainer.logger.log_text("sample", f"at step {trainer.state.global_step}")


class EventsDiskFillsAtTheEnd(ampkit.Callback):
    """Rank 0's disk under the event files fills once training ended: closing the writer fails, after the last point
    in the loop where the ranks agree on a stop."""

    def on_train_end(self, trainer):
        EventsDiskFills.full = RANK == 0


def _events_fail_mid_run(cfg: dict, checkpoints: Path) -> tuple[tuple, tuple, tuple]:
    """A run of 8 steps whose event files rank 0 can no longer write from step 5 on, then (rank 1 given a copy of
    rank 0's newest checkpoint) its resume, without TensorBoard; and a run whose events fail as it ends, after
    the last point in the loop where the ranks agree on a stop (its failure is agreed as the fit ends)."""
    from tensorboard.summary.writer.record_writer import RecordWriter

    real_write, real_flush = RecordWriter.write, RecordWriter.flush

    def full(real):
        def fails_when_full(self, *args):
            if EventsDiskFills.full:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(self, *args)

        return fails_when_full

    RecordWriter.write, RecordWriter.flush = full(real_write), full(real_flush)
    trained = {**cfg["trainer"], "max_steps": 8}
    logged = {**cfg, "run_dir": "midrun", "trainer": trained, "logging": {"tensorboard": True, "log_every_n_steps": 1}}
    try:
        failed = _outcome(Plain(logged, callbacks=[EventsDiskFills(5)]))
        EventsDiskFills.full = False
        at_the_end = _outcome(Plain({**logged, "run_dir": "endrun"}, callbacks=[EventsDiskFillsAtTheEnd()]))
    finally:
        RecordWriter.write, RecordWriter.flush, EventsDiskFills.full = real_write, real_flush, False
    newest = Path("midrun") / checkpoints.relative_to("run") / "last.pt"
    if RANK == 1:
        newest.parent.mkdir(parents=True)
        shutil.copyfile(Path("..") / "node0" / newest, newest)
    step = torch.load(newest, weights_only=False)["loop"]["global_step"]
    resumed = _outcome(Plain({**logged, "logging": {"tensorboard": False}}), resume="last")
    return failed, (step, *resumed), at_the_end


def _cannot_delete(where: Path | list, *args) -> None:
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), "checkpoints")


def _disk_full(obj, path: Path, *args, **kwargs) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def _outcome(
    trainer: ampkit.Trainer, resume: str | None = None, validate: str | None = None, predict: str | None = None
) -> tuple:
    """``("trained", step, model)`` of ``fit(resume)`` (or ``validate(ckpt=validate)``, ``predict(output=predict)``),
    or the error's type, message and ``storage_errno`` (None where it has none) and the seconds it took to come."""
    start = time.monotonic()
    try:
        if predict:
            trainer.predict(output=predict)
        else:
            trainer.validate(ckpt=validate) if validate else trainer.fit(resume=resume)
    except Exception as exc:
        return type(exc).__name__, str(exc), getattr(exc, "storage_errno", None), time.monotonic() - start
    return "trained", trainer.state.global_step, trainer.module.state_dict()


def _cli_fit(cfg: dict) -> tuple[int, list[str]]:
    """``ampkit fit --config`` of ``cfg`` (written as this rank's YAML), as ``python -m ampkit`` runs it: the status
    the process would exit with, and the lines of its stderr that say ``ampkit: error:``."""
    path = Path(f"cli.rank{RANK}.yaml")
    path.write_text(json.dumps(cfg))  # JSON is YAML
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        status = ampkit_cli.main(["fit", "--config", str(path)])
    return status, [line for line in stderr.getvalue().splitlines() if line.startswith("ampkit: error:")]


def main(scenario: str, out: Path) -> None:
    # CPU processes and gloo, also on a machine with a GPU (two ranks cannot share one GPU under NCCL).
    cpu = {"progress_bar": False, "device": "cpu", "skip_verdict": SKIP_VERDICT}
    base = {"trainer_class": "x:y", "run_dir": str(out / "run"), "logging": {"tensorboard": False}, "trainer": cpu}
    extra: dict = {}
    if scenario in ("ddp", "ddp_accumulate", "ddp_accumulate_fp16", "ddp_accumulate_o2"):
        accumulate = 1 if scenario == "ddp" else 2
        precision = {  # loss scaling / fp32 masters take each backward's gradients out of .grad
            "ddp_accumulate_fp16": {"opt_level": "O1", "dtype": "float16", "init_scale": 256.0},
            "ddp_accumulate_o2": {"opt_level": "O2", "dtype": "bfloat16"},
        }.get(scenario, {})
        cfg = {
            **base,
            "data": {"batch_size": 4},
            "checkpoint": {"enabled": False},
            "trainer": {**cpu, "max_epochs": 2, "accumulate_grad_batches": accumulate, "val_every_n_epochs": 1},
            "precision": precision,
        }
        trainer = Plain(cfg)
    elif scenario.startswith("ddp_unfreeze"):
        precision, (trainer_class, options) = UNFREEZE_PRECISION[scenario], unfreeze_run(scenario)
        cfg = {**base, "data": {"batch_size": 4}, "checkpoint": {"enabled": False},
               "trainer": {**cpu, "max_epochs": 2, **options}, "precision": precision}  # fmt: skip
        trainer = trainer_class(cfg)
    elif scenario == "overflow":
        spy = OverflowOnRank1()
        cfg = {**base, "checkpoint": {"enabled": False}, "trainer": {**cpu, "max_steps": 6}}
        trainer = TwoLosses(cfg, callbacks=[spy])
        extra = {"skips": spy.skips}
    elif scenario == "overflow_amp":
        spy = SkipRecorder()
        precision = {"opt_level": "O1", "dtype": "float16", "loss_scale": "dynamic", "init_scale": 1024.0,
                     "warn_consecutive_skips": 1}  # fmt: skip
        cfg = {**base, "checkpoint": {"enabled": False}, "trainer": {**cpu, "max_steps": 6}, "precision": precision}
        trainer = InfOnRank1(cfg, callbacks=[spy])
        extra = {"skips": spy.skips}
    elif scenario == "kill":
        cfg = {**base, "checkpoint": {"enabled": False}, "trainer": {**cpu, "max_epochs": 5},
               "distributed": {"timeout_s": 30}}  # fmt: skip
        trainer = Plain(cfg, callbacks=[SuicideAt()])
    elif scenario.startswith("resume"):
        cfg = {
            **base,
            "data": {"batch_size": 4},
            "checkpoint": {"every_n_steps": 3, "keep_last": 50},
            "trainer": {**cpu, "max_epochs": 2},
        }
        trainer = ToyTrainer(cfg)  # shuffling and dropout: the sampler and RNG must be restored too
        resume_from = os.environ.get("RESUME_FROM")
        trainer.fit(resume=resume_from)
        scenario = "done"
    elif scenario == "syncbn":
        spy = GradSpy()
        cfg = {
            **base,
            "checkpoint": {"enabled": False},
            "trainer": {**cpu, "max_steps": 1},
            "distributed": {"sync_batchnorm": True},
        }
        trainer = BatchNormNet(cfg, callbacks=[spy])
    elif scenario == "evaluate":  # the checkpoint under out/run was written by a single process
        trainer = Evaluated({**base, "checkpoint": {"enabled": False}})
        metrics = trainer.validate(ckpt="last")
        predictions = trainer.predict(ckpt="last", output=out / "predictions.pt")
        torch.save({"val": metrics, "predictions": predictions}, out / f"rank{RANK}.pt")
        return
    elif scenario == "fsdp_rank_1_cannot_write":  # as a run_dir on rank 0's disk, or one only rank 0's user may write
        real_access = os.access
        if RANK == 1:
            os.access = lambda path, mode, **kw: not str(path).startswith(str(out)) and real_access(path, mode, **kw)
        fsdp = {"strategy": "fsdp", "fsdp": {"shard_modules": ["Linear"]}}
        trainer = Plain({**base, "distributed": fsdp, "trainer": {**cpu, "max_steps": 2}})
        try:
            trainer.fit()
        finally:
            torch.save({"global_step": trainer.state.global_step}, out / f"rank{RANK}.pt")
        return
    elif scenario == "fit_then_evaluate":  # a new process group per run (10 s to connect one, if they clash)
        cfg = {**base, "checkpoint": {"enabled": False}, "trainer": {**cpu, "max_steps": 2},
               "distributed": {"timeout_s": 10}}  # fmt: skip
        if RANK == 0:  # rank 1 sets up a next group before rank 0's is gone, as a slower rank 0 would
            destroy = torch.distributed.destroy_process_group
            torch.distributed.destroy_process_group = lambda *a: (time.sleep(1), destroy(*a))[1]
        trainer = Evaluated(cfg)
        trainer.fit()
        runs = [len(trainer.predict()), trainer.validate()]
        torch.save({"runs": runs}, out / f"rank{RANK}.pt")
        return
    elif scenario == "validate_in_a_hook":  # the fit owns the process group: it must still leave it at its end
        cfg = {**base, "checkpoint": {"enabled": False}, "trainer": {**cpu, "max_epochs": 2}}
        trainer = ValidatesInAHook(cfg)
        trainer.fit()
        left = not torch.distributed.is_initialized()
        torch.save({"left": left, "hook": trainer.hook_metrics, "after": trainer.validate()}, out / f"rank{RANK}.pt")
        return
    elif scenario == "validate_uneven_fsdp":  # every FSDP forward is a collective: rank 1 runs a filler batch
        fsdp = {"strategy": "fsdp", "fsdp": {"shard_modules": ["Linear"]}}
        trainer = UnevenValidation({**base, "checkpoint": {"enabled": False}, "distributed": fsdp})
        torch.save({"val": trainer.validate()}, out / f"rank{RANK}.pt")
        return
    elif scenario == "validate_stream_fsdp":  # every FSDP forward is a collective: rank 1 pads with fillers
        fsdp = {"strategy": "fsdp", "fsdp": {"shard_modules": ["Linear"]}}
        cfg = {**base, "checkpoint": {"enabled": False}, "distributed": {**fsdp, "timeout_s": 10}}
        trainer = UnevenValidationStream(cfg)
        val, predictions = trainer.validate(), trainer.predict()
        UnevenValidationStream.empty_on_1 = True
        try:
            UnevenValidationStream(cfg).validate()
            refused = ""
        except ValueError as exc:
            refused = str(exc)
        fit_refused, trained = [], []
        for sanity in (2, 0):  # a fit's: rank 1's empty list is refused on every rank at set-up, sanity pass or not
            empty_on_1 = EmptyValidationListOnRank1({**cfg, "trainer": {**cpu, "max_steps": 1,
                                                                        "num_sanity_val_steps": sanity}})  # fmt: skip
            try:
                empty_on_1.fit()
                fit_refused.append("")
            except ValueError as exc:
                fit_refused.append(str(exc))
            trained.append(empty_on_1.state.global_step)
        saved = {"val": val, "predictions": len(predictions), "refused": refused, "fit_refused": fit_refused,
                 "trained": trained}  # fmt: skip
        torch.save(saved, out / f"rank{RANK}.pt")
        return
    elif scenario == "metrics_per_rank":
        trainer = MetricsPerRank({**base, "checkpoint": {"enabled": False}, "trainer": {**cpu, "max_steps": 1}})
        torch.save({"val": trainer.validate()}, out / f"rank{RANK}.pt")
        return
    elif scenario == "o2_unseeded":  # each rank initialises its own model; O2 builds fp32 masters from it
        precision = {"opt_level": "O2", "dtype": "float16", "init_scale": 256.0}
        cfg = {**base, "checkpoint": {"enabled": False}, "trainer": {**cpu, "max_steps": 3, "seed": None},
               "precision": precision}  # fmt: skip
        trainer = Plain(cfg)
    elif scenario == "step_buffers":  # no DDP: unequal batches give each rank its own BatchNorm statistics
        spy = BufferSpy()
        cfg = {**base, "checkpoint": {"enabled": False}, "trainer": {**cpu, "max_steps": 3, "max_epochs": 3},
               "distributed": {"grad_sync": "step"}}  # fmt: skip
        trainer = BatchNormNet(cfg, callbacks=[spy])
        extra = {"buffers": spy}
    elif scenario == "expert_on_rank_1":  # no DDP: the step's all-reduce must line up with a grad rank 0 lacks
        cfg = {**base, "checkpoint": {"enabled": False}, "trainer": {**cpu, "max_steps": 3},
               "distributed": {"grad_sync": "step", "timeout_s": 30}}  # fmt: skip
        initial = KeepInitialExpert()
        trainer = ExpertOnRank1(cfg, callbacks=[initial])
    elif scenario == "stop":
        torch.save({"runs": stop_runs(out, base)}, out / f"rank{RANK}.pt")
        return
    elif scenario == "sigterm":
        torch.save(preempted_then_resumed(out, base), out / f"rank{RANK}.pt")
        return
    elif scenario == "sigterm_logging_rarely":  # no logging iteration to agree the stop at before the epoch's end
        torch.save(preempted_then_resumed(out, base, FusedSgdToy, log_every=1000), out / f"rank{RANK}.pt")
        return
    elif scenario in ("train_monitor", "train_monitor_rank_zero_only"):
        cfg = {**base, "checkpoint": {"monitor": "train/score", "every_n_epochs": 0},
               "early_stopping": {"monitor": "train/score", "patience": 2}, "trainer": {**cpu, "max_epochs": 5},
               "distributed": {"timeout_s": 30}}  # fmt: skip
        trainer = (RankScores if scenario == "train_monitor" else RankZeroOnlyScores)(cfg)
    elif scenario in ("val_end_monitor", "val_end_monitor_rank_zero"):
        cfg = {**base, "checkpoint": {"monitor": "val_auc", "every_n_epochs": 0},
               "early_stopping": {"monitor": "val_auc", "patience": 1}, "trainer": {**cpu, "max_epochs": 4},
               "distributed": {"timeout_s": 30}}  # fmt: skip
        trainer = (RankValidationScores if scenario == "val_end_monitor" else RankZeroValidationScores)(cfg)
    elif scenario == "bare_module":
        trainer = BareModule({**base, "checkpoint": {"enabled": False}, "trainer": {**cpu, "max_steps": 2}})
    elif scenario == "uneven_batches":  # no hang until distributed.timeout_s (10 s here), whatever the data
        cfg = {**base, "checkpoint": {"enabled": False}, "data": {"batch_size": 4},
               "trainer": {**cpu, "max_epochs": 2}, "distributed": {"timeout_s": 10}}  # fmt: skip
        try:
            UnevenLists(cfg).fit()
            refused = ""
        except ValueError as exc:
            refused = str(exc)
        trainer = UnevenStream(cfg)
        sharded = warned(trainer.fit)
        duplicated = warned(DuplicatedStream({**cfg, "trainer": {**cpu, "max_steps": 2}}).fit)
        # evaluation: rank 1 has no validation batch, and DDP's first no-grad forward broadcasts the BatchNorm's
        normed = NormedUnevenValidation({**cfg, "trainer": {**cpu, "max_epochs": 1}})
        normed_warned = warned(normed.fit)
        # the same samples on every rank, evaluated: named once a fit (a sanity pass, two validations), once a call
        evaluated = DuplicatedEvaluation({**cfg, "trainer": {**cpu, "max_epochs": 1, "val_every_n_steps": 2}})
        calls = {"fit": evaluated.fit, "validate": evaluated.validate, "test": evaluated.test,
                 "predict": evaluated.predict}  # fmt: skip
        # counts known up front and unequal: a collective in validation_step could not line up, which is said
        lists = UnevenValidationLists({**cfg, "trainer": {**cpu, "max_steps": 1, "num_sanity_val_steps": 0}})
        uneven_lists = {"fit": warned(lists.fit), "validate": warned(lists.validate)}
        empty_validated: list[dict] = []
        # rank 1's list empty: it dropped its loader, there alone, and rank 0 waited in the sanity pass's gather
        empty_on_1 = EmptyValidationListOnRank1({**cfg, "trainer": {**cpu, "max_steps": 1}})
        uneven_lists["fit, empty on rank 1"] = warned(empty_on_1.fit)
        uneven_lists["validate, empty on rank 1"] = warned(lambda: empty_validated.append(empty_on_1.validate()))
        # a fit that never validates gathers no counts, and says nothing of them
        never = {**cpu, "max_steps": 1, "val_every_n_epochs": 0, "val_every_n_steps": 0}
        uneven_lists["fit, never validates"] = warned(UnevenValidationLists({**cfg, "trainer": never}).fit)
        try:
            ValidationLoaderOnRank0Only({**cfg, "trainer": {**cpu, "max_steps": 1}}).fit()
            loader_refused = ""
        except ValueError as exc:
            loader_refused = str(exc)
        try:  # a standalone validate() alike: rank 1 alone raising left rank 0 waiting in its set-up gathers
            ValidationLoaderOnRank0Only({**cfg, "trainer": cpu}).validate()
            validate_refused = ""
        except ValueError as exc:
            validate_refused = str(exc)
        saved = {"refused": refused, "global_step": trainer.state.global_step, "sharded": sharded,
                 "duplicated": duplicated, "model": trainer.module.state_dict(), "normed_val": normed.val_metrics,
                 "normed_warned": normed_warned, "normed_model": normed.module.state_dict(),
                 "evaluated": {call: warned(run) for call, run in calls.items()},
                 "uneven_lists": uneven_lists, "empty_on_1_val": [empty_on_1.val_metrics, *empty_validated],
                 "empty_on_1_model": empty_on_1.module.state_dict(), "loader_refused": loader_refused,
                 "validate_refused": validate_refused}  # fmt: skip
        torch.save(saved, out / f"rank{RANK}.pt")
        return
    elif scenario == "uneven_stream_accumulate":  # every rank fetches one ahead: their collectives stay in order
        train = {**cpu, "max_epochs": 2, "accumulate_grad_batches": 4}
        cfg = {**base, "checkpoint": {"enabled": False}, "data": {"batch_size": 4}, "trainer": train,
               "distributed": {"timeout_s": 10}}  # fmt: skip
        trainer = UnevenStreamAndList(cfg)
        trainer.fit()
        torch.save(
            {"global_step": trainer.state.global_step, "model": trainer.module.state_dict()}, out / f"rank{RANK}.pt"
        )
        return
    elif scenario == "unused_parameters":
        cfg = {**base, "checkpoint": {"enabled": False}, "trainer": {**cpu, "max_steps": 2}}
        try:
            UnusedParameters(cfg).fit()
            explained = None
        except RuntimeError as exc:
            explained = getattr(exc, "ampkit_setup_error", None)
        try:  # DDP numbers the parameters trainable when it wrapped the model, not those trainable now
            UnusedAfterUnfreezing({**cfg, "trainer": {**cpu, "max_steps": 4}}).fit()
            after_unfreezing = None
        except RuntimeError as exc:
            after_unfreezing = getattr(exc, "ampkit_setup_error", None)
        trainer = UnusedParameters({**cfg, "distributed": {"find_unused_parameters": True}})
        trainer.fit()
        try:  # 2 samples over 2 ranks: one per rank's batch norm
            OneSamplePerRank({**cfg, "trainer": {**cpu, "max_steps": 1}}).fit()
            batch_norm = None
        except ValueError as exc:
            batch_norm = getattr(exc, "ampkit_setup_error", None)
        torch.save({"explained": explained, "global_step": trainer.state.global_step, "batch_norm": batch_norm,
                    "after_unfreezing": after_unfreezing},
                   out / f"rank{RANK}.pt")  # fmt: skip
        return
    elif scenario == "restart":  # under torchrun --max-restarts 1
        if RANK == 0 and ATTEMPT == 1:  # joins late: rank 1 reads the group's keys first
            time.sleep(1)
        spy, first_stage = DiesOnceAt4(), DiesOnceAt4(kills=False)
        cfg = {**base, "data": {"batch_size": 4}, "checkpoint": {"every_n_steps": 3},
               "trainer": {**cpu, "max_epochs": 1}, "distributed": {"timeout_s": 20}}  # fmt: skip
        Plain({**cfg, "trainer": {**cfg["trainer"], "max_steps": 6}}, callbacks=[first_stage]).fit()  # version_0
        trainer = Plain(cfg, callbacks=[spy])  # version_1, where rank 1 dies
        trainer.fit()
        torch.save({"started_at": spy.started_at, "global_step": trainer.state.global_step, "attempt": ATTEMPT,
                    "first_stage_started_at": first_stage.started_at, "model": trainer.module.state_dict()},
                   out / f"rank{RANK}.pt")  # fmt: skip
        return
    elif scenario == "set_up_fails_on_rank_1":
        cfg = {**base, "checkpoint": {"enabled": False}, "trainer": {**cpu, "max_steps": 2},
               "distributed": {"timeout_s": 20}}  # fmt: skip
        trainer = OptimizerFailsOnRank1(cfg)
    elif scenario == "step_fails_on_rank_1":
        cfg = {**base, "checkpoint": {"enabled": False}, "trainer": {**cpu, "max_steps": 8},
               "distributed": {"timeout_s": 60}}  # fmt: skip
        trainer = StepFailsOnRank1(cfg)
    elif scenario == "callbacks_on_rank_zero":
        torch.save(callbacks_on_rank_zero(out, base), out / f"rank{RANK}.pt")
        return
    elif scenario == "rank_zero_decides":
        torch.save(rank_zero_decides(out, base), out / f"rank{RANK}.pt")
        return
    elif scenario == "ddp_compile_switches":  # DDP's buffer sync before each validation, the whole model compiled
        compiled_with("eager")
        spy = CountsRecompiles()
        train = {**cpu, "max_epochs": 3, "limit_train_batches": 2, "compile": True, "num_sanity_val_steps": 0}
        cfg = {**base, "data": {"batch_size": 4}, "checkpoint": {"enabled": False}, "trainer": train}
        trainer = Normed(cfg, callbacks=[spy])
        extra = {"recompiles": spy.seen}
    elif scenario == "mismatch":
        cfg = {**base, "checkpoint": {"enabled": False}, "trainer": {**cpu, "max_steps": 1 + RANK}}
        trainer = Plain(cfg)
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    if scenario != "done":
        trainer.fit()
    if scenario == "syncbn":
        extra = {"grads": spy.grads}
    if scenario == "step_buffers":
        extra = {"buffers": spy.seen}
    if scenario == "ddp_compile_switches":
        extra["compiled"] = spy.graphs
    if scenario == "expert_on_rank_1":
        extra = {"initial_expert": initial.weight}
    if scenario == "overflow_amp":
        scaling = next(cb for cb in trainer.callbacks if cb.name == "LossScaling")
        extra["scales"] = {str(k): v for k, v in scaling.scales.items()}
    if scenario.startswith("overflow"):
        extra["facts_on_device"] = trainer.facts_on_device
    if scenario == "train_monitor_rank_zero_only":
        extra["sync_refused"] = trainer.sync_refused
    if scenario in ("train_monitor", "train_monitor_rank_zero_only", "val_end_monitor", "val_end_monitor_rank_zero"):
        extra["stopped"] = (trainer.state.global_step, trainer.state.stop_reason)
        extra["lr"] = trainer.optimizer.param_groups[0]["lr"]
        extra["best_model_path"] = next(cb for cb in trainer.callbacks if cb.name == "ModelCheckpoint").best_model_path
    if scenario in ("val_end_monitor", "val_end_monitor_rank_zero"):
        extra["validated"] = trainer.validate()
    torch.save({"model": trainer.module.state_dict(), "val": trainer.val_metrics,
                "version_dir": str(trainer.version_dir), **extra}, out / f"rank{RANK}.pt")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
