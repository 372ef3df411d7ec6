"""A GAN on the classic 2-D ring of eight Gaussians, with separate D and G optimizers and loss scalers.

Launch: ``ampkit fit --config configs/gan.yaml`` (O1 float16 on CPU); ``precision.opt_level=O2`` casts both
networks to half with fp32 master weights; ``precision.dtype=bfloat16`` for bf16 (no loss scaler; the config
turns ``precision.skip_nonfinite`` on, so a non-finite step is skipped). Under float16 each loss has its own
``loss_id`` ("D", "G"), hence its own dynamic loss scaler: an overflow in the discriminator's loss skips
only the discriminator's step and backs off only its scale. TensorBoard shows ``amp/loss_scale/D`` and
``amp/loss_scale/G``, and under Images ``samples``: every ``samples.every_n_steps`` iterations, where the
generator's points land (white) against the ring's centres (red).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ampkit


@dataclass
class GanModelConfig:
    latent: int = 8
    hidden: int = 128


@dataclass
class GanDataConfig:
    modes: int = 8
    radius: float = 2.0
    std: float = 0.05
    samples: int = 16384
    batch_size: int = 128
    seed: int = 0


@dataclass
class GanOptimConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.5, 0.999)


@dataclass
class GanSamplesConfig:
    every_n_steps: int = 100  # 0: never
    points: int = 4096
    pixels: int = 128


@dataclass
class GanConfig(ampkit.Config):
    model: GanModelConfig = field(default_factory=GanModelConfig)
    data: GanDataConfig = field(default_factory=GanDataConfig)
    optim: GanOptimConfig = field(default_factory=GanOptimConfig)
    samples: GanSamplesConfig = field(default_factory=GanSamplesConfig)


def ring_centers(modes: int, radius: float) -> torch.Tensor:
    angles = torch.arange(modes, dtype=torch.float32) * (2 * math.pi / modes)
    return radius * torch.stack([angles.cos(), angles.sin()], dim=1)


def sample_ring(n: int, modes: int, radius: float, std: float, seed: int) -> torch.Tensor:
    """``n`` points from an equal mixture of Gaussians centred on a ring."""
    gen = torch.Generator().manual_seed(seed)
    centers = ring_centers(modes, radius)
    which = torch.randint(0, modes, (n,), generator=gen)
    return centers[which] + std * torch.randn(n, 2, generator=gen)


def samples_image(points: torch.Tensor, centers: torch.Tensor, extent: float, pixels: int) -> torch.Tensor:
    """An RGB image (3, pixels, pixels) of the square [-extent, extent]^2: point density in white, centres red."""
    bounds = [-extent, extent, -extent, extent]
    density, _ = torch.histogramdd(points.detach().float().cpu(), bins=[pixels, pixels], range=bounds)
    density = (density / density.max().clamp(min=1)).sqrt()  # sqrt: a lone point stays visible
    marks, _ = torch.histogramdd(centers.float().cpu(), bins=[pixels, pixels], range=bounds)
    size = 2 * (pixels // 64) + 1  # centres drawn as squares of ~1/40 of the image
    marks = F.max_pool2d((marks > 0).float()[None], size, stride=1, padding=size // 2)[0]
    red = torch.maximum(density, marks)
    image = torch.stack([red, density, density])  # indexed [x, y]; images are [row, column], row 0 on top
    return image.transpose(1, 2).flip(1)


class Gan(nn.Module):
    def __init__(self, latent: int, hidden: int) -> None:
        super().__init__()
        self.generator = nn.Sequential(
            nn.Linear(latent, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 2)
        )
        self.discriminator = nn.Sequential(
            nn.Linear(2, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, 1)
        )


class GanTrainer(ampkit.Trainer):
    """Non-saturating GAN: a discriminator step (loss_id "D") then a generator step (loss_id "G") per batch.

    Validation reports ``modes_covered`` (modes holding at least a fifth of their fair share of 2048
    generated points, each within 4 std of its centre) and ``quality`` (the fraction of points that close
    to some centre).
    """

    config_class = GanConfig
    automatic_optimization = False

    def configure_model(self) -> nn.Module:
        return Gan(self.cfg.model.latent, self.cfg.model.hidden)

    def configure_optimizers(self):
        lr, betas = self.cfg.optim.lr, tuple(self.cfg.optim.betas)
        return [
            {"optimizer": torch.optim.Adam(self.module.discriminator.parameters(), lr, betas), "name": "discriminator"},
            {"optimizer": torch.optim.Adam(self.module.generator.parameters(), lr, betas), "name": "generator"},
        ]

    def train_dataloader(self) -> DataLoader:
        d = self.cfg.data
        points = sample_ring(d.samples, d.modes, d.radius, d.std, d.seed)
        return DataLoader(TensorDataset(points), batch_size=d.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(2048, 1)), batch_size=2048)

    def _noise(self, n: int) -> torch.Tensor:
        return torch.randn(n, self.cfg.model.latent, device=self.device)

    def training_step(self, batch):
        real = batch[0]
        d_opt, g_opt = self.optimizers["discriminator"], self.optimizers["generator"]
        fake = self.module.generator(self._noise(real.shape[0]))

        d_real = self.module.discriminator(real)
        d_fake = self.module.discriminator(fake.detach())
        loss_d = F.binary_cross_entropy_with_logits(
            d_real, torch.ones_like(d_real)
        ) + F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake))
        self.backward(loss_d, loss_id="D", optimizer=d_opt)
        self.step(d_opt)

        d_fake = self.module.discriminator(fake)
        loss_g = F.binary_cross_entropy_with_logits(d_fake, torch.ones_like(d_fake))
        self.backward(loss_g, loss_id="G", optimizer=g_opt)
        self.step(g_opt)
        every = self.cfg.samples.every_n_steps
        if every and self.state.is_iteration_end and self.state.iteration % every == 0:
            self._log_samples()
        return {"loss_d": loss_d, "loss_g": loss_g}

    @torch.no_grad()
    def _log_samples(self) -> None:
        d, s = self.cfg.data, self.cfg.samples
        points = self.module.generator(self._noise(s.points))
        image = samples_image(points, ring_centers(d.modes, d.radius), d.radius * 1.5, s.pixels)
        self.logger.log_image("samples", image)

    def validation_step(self, batch):
        d = self.cfg.data
        points = self.module.generator(self._noise(batch[0].shape[0])).float()
        centers = ring_centers(d.modes, d.radius).to(points.device)
        dist, nearest = torch.cdist(points, centers).min(dim=1)
        close = dist < 4 * d.std
        counts = torch.bincount(nearest[close], minlength=d.modes)
        fair = points.shape[0] / d.modes
        return {"modes_covered": (counts >= 0.2 * fair).sum().float(), "quality": close.float().mean()}
