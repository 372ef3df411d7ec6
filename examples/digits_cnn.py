"""A small CNN with batch norm on scikit-learn's 8x8 digits, in channels_last and Apex's O2.

Launch: ``ampkit fit --config configs/digits_cnn.yaml``. O2 casts the model to float16 but keeps the batch
norm layers in float32 (``precision.keep_batchnorm_fp32: true``, O2's default): their running statistics
and affine parameters stay exact while the convolutions run in half precision, with fp32 master weights in
the optimizer and dynamic loss scaling. ``model.channels_last`` stores weights and inputs as NHWC, the
layout fast convolution kernels want; the cast keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ampkit
from ampkit.examples.digits import DataConfig, OptimConfig, load_digits_split


@dataclass
class CnnModelConfig:
    channels: int = 16
    channels_last: bool = True


@dataclass
class DigitsCnnConfig(ampkit.Config):
    model: CnnModelConfig = field(default_factory=CnnModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


def make_cnn(channels: int) -> nn.Module:
    """conv-BN-ReLU twice at 8x8, a 2x2 pool, conv-BN-ReLU at 4x4, global average pool, linear head."""

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(1, channels),
        *block(channels, channels),
        nn.MaxPool2d(2),
        *block(channels, 2 * channels),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * channels, 10),
    )


def as_images(dataset: TensorDataset) -> TensorDataset:
    x, y = dataset.tensors
    return TensorDataset(x.view(-1, 1, 8, 8), y)


class DigitsCnnTrainer(ampkit.Trainer):
    """The CNN on the digits set; reports validation accuracy and loss."""

    config_class = DigitsCnnConfig

    @property
    def _memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.cfg.model.channels_last else torch.contiguous_format

    def configure_model(self) -> nn.Module:
        return make_cnn(self.cfg.model.channels).to(memory_format=self._memory_format)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.module.parameters(), lr=self.cfg.optim.lr, weight_decay=self.cfg.optim.weight_decay
        )

    def _splits(self) -> tuple[TensorDataset, TensorDataset]:
        if not hasattr(self, "_datasets"):
            train, val = load_digits_split(self.cfg.data.val_fraction, self.cfg.data.split_seed)
            self._datasets = as_images(train), as_images(val)
        return self._datasets

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._splits()[0], batch_size=self.cfg.data.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._splits()[1], batch_size=256)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.contiguous(memory_format=self._memory_format))

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self._logits(x), y)

    def validation_step(self, batch):
        x, y = batch
        logits = self._logits(x)
        return {"loss": F.cross_entropy(logits, y), "acc": (logits.argmax(-1) == y).float().mean()}
