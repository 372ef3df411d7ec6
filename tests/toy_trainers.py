"""Small trainers on synthetic data shared by the Trainer's tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ampkit


@dataclass
class ToyData:
    n: int = 64
    batch_size: int = 8


@dataclass
class ToyConfig(ampkit.Config):
    data: ToyData = field(default_factory=ToyData)
    lr: float = 0.05


def toy_dataset(n: int, seed: int = 123) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x @ torch.randn(6, 1, generator=g)).squeeze(1) + 0.1 * torch.randn(n, generator=g)
    return TensorDataset(x, y)


def toy_model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))


class ToyTrainer(ampkit.Trainer):
    """Regression with dropout (so RNG matters) and shuffling (so data order matters)."""

    config_class = ToyConfig

    def configure_model(self):
        return toy_model()

    def configure_optimizers(self):
        return torch.optim.SGD(self.module.parameters(), lr=self.cfg.lr, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(toy_dataset(self.cfg.data.n), batch_size=self.cfg.data.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(toy_dataset(24, seed=7), batch_size=8)

    def training_step(self, batch):
        x, y = batch
        return F.mse_loss(self.model(x).squeeze(1), y)

    def validation_step(self, batch):
        x, y = batch
        return {"mse": F.mse_loss(self.model(x).squeeze(1), y)}


def toy_cfg(tmp_path, **overrides) -> dict:
    """A config dict for ToyTrainer writing under ``tmp_path``; ``overrides`` use dotted keys. On the CPU unless an
    override says otherwise: the tests compare with tensors they build on the CPU, and on a machine with a GPU the
    default device (auto) would put the toy there; the CUDA tests name their device."""
    from omegaconf import OmegaConf

    base = OmegaConf.create(
        {"trainer_class": "toy_trainers:ToyTrainer", "run_dir": str(tmp_path / "run"), "trainer": {"device": "cpu"}}
    )
    dotted = OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()])
    return OmegaConf.to_container(OmegaConf.merge(base, dotted))


class ManualOptimization:
    """Mixin for a toy trainer: its training step backpropagates and steps the loss itself."""

    automatic_optimization = False

    def training_step(self, batch):
        loss = super().training_step(batch)
        self.backward(loss)
        self.step(self.optimizer)


class _Sleep(ampkit.Callback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer, outputs, batch) -> None:
        import time

        time.sleep(self.seconds)


class SlowToyTrainer(ToyTrainer):
    """ToyTrainer that sleeps after each batch, so a test can kill it mid-run."""

    def configure_callbacks(self):
        return [_Sleep(0.02)]


_WORKER_INIT_RAN: list[int] = []  # in a DataLoader worker: the ids its worker_init_fn was called with


def _note_worker_init(worker_id: int) -> None:
    _WORKER_INIT_RAN.append(worker_id)


class _NeedsWorkerInit(TensorDataset):
    def __getitem__(self, index):
        if torch.utils.data.get_worker_info() is not None and not _WORKER_INIT_RAN:
            raise RuntimeError("the loader's own worker_init_fn did not run in this worker")
        return super().__getitem__(index)


class _GroupSigterm(ampkit.Callback):
    """SIGTERM to the whole process group (as Slurm and torchrun's agent send it), once, at step 3 or at the first
    validation batch (env AMPKIT_TEST_GROUP_SIGTERM: train, validation), or to torchrun's agent at step 3 (torchrun);
    then a pause for the workers to die of it."""

    def __init__(self) -> None:
        self.when, self.sent = os.environ.get("AMPKIT_TEST_GROUP_SIGTERM"), False

    def _send(self) -> None:
        self.sent = True  # sent by another process, as a scheduler's is: the workers' own parent may end them
        kill = f"import os, signal; os.killpg({os.getpgid(0)}, signal.SIGTERM)"
        subprocess.run([sys.executable, "-c", kill], start_new_session=True, check=True)
        time.sleep(0.3)

    def on_train_batch_end(self, trainer, outputs, batch) -> None:
        if self.when == "train" and not self.sent and trainer.state.global_step == 3:
            self._send()
        if self.when == "torchrun" and not self.sent and trainer.state.global_step == 3 and trainer.is_global_zero:
            self.sent = True  # to torchrun's agent, which passes it on to each rank's process group
            os.kill(os.getppid(), signal.SIGTERM)
            time.sleep(1)

    def on_validation_batch_end(self, trainer, metrics, batch) -> None:
        if self.when == "validation" and not self.sent and trainer.state.global_step > 0:
            self._send()


class WorkersToyTrainer(ToyTrainer):
    """ToyTrainer whose loaders read in worker processes (persistent for training), with a worker_init_fn of its own."""

    def configure_callbacks(self):
        return [_GroupSigterm()]

    def train_dataloader(self):
        data = _NeedsWorkerInit(*toy_dataset(self.cfg.data.n).tensors)
        return DataLoader(data, batch_size=self.cfg.data.batch_size, shuffle=True, num_workers=2,
                          persistent_workers=True, worker_init_fn=_note_worker_init)  # fmt: skip

    def val_dataloader(self):
        data = _NeedsWorkerInit(*toy_dataset(24, seed=7).tensors)
        return DataLoader(data, batch_size=8, num_workers=2, worker_init_fn=_note_worker_init)


class _Marker(ampkit.Callback):
    pass


class DuplicateCallbacksTrainer(ToyTrainer):
    """Two callbacks of one name (checkpoints could not tell their states apart): a CallbackOrderError at set-up."""

    def configure_callbacks(self):
        return [_Marker(), _Marker()]


class NaNLossToyTrainer(ToyTrainer):
    """ToyTrainer whose loss is NaN in iteration ``nan_at`` (only in its reported value when ``detached``)."""

    nan_at = 6
    detached = False

    def training_step(self, batch):
        loss = super().training_step(batch)
        if self.state.iteration != self.nan_at:
            return loss
        nan = torch.tensor(float("nan"))
        return loss * nan if not self.detached else loss + (nan * loss).detach()


def fit_toy_resuming(cfg: dict) -> None:
    """Run ToyTrainer on ``cfg``, resuming the newest checkpoint under its run_dir if there is one."""
    from ampkit.trainer.run_life import resolve_checkpoint

    torch.set_num_threads(1)
    ToyTrainer(cfg).fit(resume="last" if resolve_checkpoint(cfg["run_dir"], "last") else None)


class ScheduledToyTrainer(ToyTrainer):
    """Two optimizers: the first layer's with a per-step OneCycleLR, the head's with a ReduceLROnPlateau on val/mse."""

    def configure_optimizers(self):
        first, head = self.module[0], self.module[3]
        sgd = torch.optim.SGD(first.parameters(), lr=self.cfg.lr, momentum=0.9)
        adam = torch.optim.Adam(head.parameters(), lr=self.cfg.lr)
        one_cycle = torch.optim.lr_scheduler.OneCycleLR(sgd, 0.1, total_steps=40)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(adam, patience=0)
        return [
            {"optimizer": sgd, "lr_scheduler": {"scheduler": one_cycle, "interval": "step"}},
            {"optimizer": adam, "lr_scheduler": {"scheduler": plateau, "monitor": "val/mse"}},
        ]


class OwnGeneratorToyTrainer(ToyTrainer):
    """Samples drawn by a WeightedRandomSampler from a torch.Generator of its own, not torch's global RNG."""

    def train_dataloader(self):
        data = toy_dataset(self.cfg.data.n)
        generator = torch.Generator().manual_seed(1)
        sampler = torch.utils.data.WeightedRandomSampler(torch.ones(len(data)), len(data), generator=generator)
        return DataLoader(data, batch_size=self.cfg.data.batch_size, sampler=sampler)


class SignalledToyTrainer(ToyTrainer):
    """Once in the process, in the step after step 10: a signal to this process as a scheduler or a closed terminal
    sends it (env AMPKIT_TEST_SIGNAL: TERM, HUP), or a crash (crash); nothing where the variable is unset."""

    def training_step(self, batch):
        if self.state.global_step == 10 and (name := os.environ.pop("AMPKIT_TEST_SIGNAL", None)) is not None:
            if name == "crash":
                raise RuntimeError("a batch this step cannot take")
            os.kill(os.getpid(), getattr(signal, f"SIG{name}"))
        return super().training_step(batch)


class CtrlCToyTrainer(ToyTrainer):
    """A Ctrl-C (KeyboardInterrupt) in the step after step 10, two steps past the epoch-end checkpoint of step 8."""

    def training_step(self, batch):
        if self.state.global_step == 10:
            raise KeyboardInterrupt
        return super().training_step(batch)
