"""Classify scikit-learn's bundled 8x8 handwritten digits (1,797 images, no download) with an MLP.

Launch: ``ampkit fit --config digits`` (the packaged ``ampkit/configs/digits.yaml``; override anything:
``optim.lr=3e-3``). Needs scikit-learn: ``pip install "ampkit[examples]"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ampkit


@dataclass
class ModelConfig:
    hidden: int = 128
    dropout: float = 0.1


@dataclass
class DataConfig:
    batch_size: int = 32
    val_fraction: float = 0.2
    split_seed: int = 0


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 1e-2


@dataclass
class DigitsConfig(ampkit.Config):
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


def load_digits_split(val_fraction: float, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """The digits set scaled to [0, 1], split reproducibly into train and validation sets."""
    try:
        from sklearn.datasets import load_digits
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "the digits example reads scikit-learn's bundled data set; pip install 'ampkit[examples]'"
        ) from None

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(x) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


def make_mlp(hidden: int, dropout: float) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 10))


class DigitsTrainer(ampkit.Trainer):
    """An MLP on the digits set; reports validation accuracy and loss."""

    config_class = DigitsConfig

    def configure_model(self) -> nn.Module:
        return make_mlp(self.cfg.model.hidden, self.cfg.model.dropout)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.module.parameters(), lr=self.cfg.optim.lr, weight_decay=self.cfg.optim.weight_decay
        )

    def _splits(self) -> tuple[TensorDataset, TensorDataset]:
        if not hasattr(self, "_datasets"):
            self._datasets = load_digits_split(self.cfg.data.val_fraction, self.cfg.data.split_seed)
        return self._datasets

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._splits()[0], batch_size=self.cfg.data.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._splits()[1], batch_size=256)

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()  # the held-out images: `ampkit predict --config digits --output p.pt`

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def validation_step(self, batch):
        x, y = batch
        logits = self.model(x)
        return {"loss": F.cross_entropy(logits, y), "acc": (logits.argmax(-1) == y).float().mean()}
