"""A small trainer whose Linears float8 converts (dims divisible by 16), for the fp8 training tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ampkit
from ampkit.amp.fp8 import torchao_available

BACKENDS = ["reference", "torchao"] if torchao_available() else ["reference"]


def fp8_dataset(n: int = 48, seed: int = 5) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, x[:, :4].sum(1, keepdim=True).tanh())


def fp8_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 1))


class Fp8Trainer(ampkit.Trainer):
    """Regression on 16 features; ``inf_at`` puts an inf into that iteration's batch."""

    inf_at: int | None = None

    def configure_model(self):
        return fp8_model()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.module.parameters(), lr=1e-2)

    def train_dataloader(self):
        return DataLoader(fp8_dataset(), batch_size=8, shuffle=True)

    def training_step(self, batch):
        x, y = batch
        if self.state.iteration == self.inf_at:
            x = x.clone()
            x[0, 0] = float("inf")
        return F.mse_loss(self.model(x).float(), y)


def fp8_cfg(tmp_path, backend: str = "reference", **sections) -> dict:
    """A config for Fp8Trainer with float8 on; ``sections`` are merged one level deep (``precision={...}``)."""
    precision = {
        "fp8": {"enabled": True, "backend": backend, **sections.pop("fp8", {})},
        **sections.pop("precision", {}),
    }
    trainer = {"progress_bar": False, "device": "cpu", "max_steps": 6, **sections.pop("trainer", {})}
    return {"trainer_class": "x:y", "run_dir": str(tmp_path / "run"), "logging": {"tensorboard": False},
            "checkpoint": {"enabled": False}, "trainer": trainer, "precision": precision, **sections}  # fmt: skip
