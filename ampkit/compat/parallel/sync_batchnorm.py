"""Apex's ``SyncBatchNorm`` / ``convert_syncbn_model`` on ampkit's synchronised batch norm.

:class:`ampkit.ops.sync_batchnorm.SyncBatchNorm` reduces the statistics over the process group on every
device, CPU/gloo included (torch's refuses CPU tensors; Apex's pure-Python fallback did not). This adds
Apex's constructor extras: ``channel_last`` (accepted; torch follows the memory format itself) and
``fuse_relu`` with ``forward(input, z=None)`` computing ``relu(bn(input) + z)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ampkit.ops import sync_batchnorm as _ops


class SyncBatchNorm(_ops.SyncBatchNorm):
    """Batch norm whose training statistics are computed over every rank of ``process_group``."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        channel_last: bool = False,
        fuse_relu: bool = False,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, process_group)
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def forward(self, input: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        out = super().forward(input)
        if z is not None:
            out = out + z
        if self.fuse_relu:
            out = F.relu(out)
        return out


def convert_syncbn_model(
    module: torch.nn.Module, process_group: dist.ProcessGroup | None = None, channel_last: bool = False
) -> torch.nn.Module:
    """Return ``module`` with every ``BatchNorm*d`` replaced by :class:`SyncBatchNorm` (parameters and
    running statistics shared with the originals)."""
    converted = SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    for sub in converted.modules():
        if isinstance(sub, SyncBatchNorm):
            sub.channel_last = channel_last
    return converted
