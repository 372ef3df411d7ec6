"""Apex's ``SyncBatchNorm`` / ``convert_syncbn_model`` on ampkit's synchronised batch norm.

:class:`ampkit.ops.sync_batchnorm.SyncBatchNorm` reduces the statistics over the process group on every
device, CPU/gloo included (torch's refuses CPU tensors; Apex's pure-Python fallback did not). This adds
Apex's constructor extras: ``channel_last`` (the channels are the input's last dimension, ``(N, ..., C)``) and
``fuse_relu`` with ``forward(input, z=None)`` computing ``relu(bn(input) + z)``; and, as Apex, batch statistics
synchronised in eval mode too when ``track_running_stats=False`` (there are no running ones to fall back on).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ampkit.ops import sync_batchnorm as _ops
from ampkit.ops._switches import checked_switch
from ampkit.ops.norms import NormShapeError
from ampkit.wording import shown


def _spans_ranks(process_group: dist.ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1


class SyncBatchNorm(_ops.SyncBatchNorm):
    """Batch norm whose training statistics are computed over every rank of ``process_group``."""

    # Apex's Python SyncBatchNorm (apex built without --cuda_ext) had neither field: a model pickled with it loads
    channel_last = False
    fuse_relu = False

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
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        channel_last = checked_switch("SyncBatchNorm", "channel_last", channel_last)
        fuse_relu = checked_switch("SyncBatchNorm", "fuse_relu", fuse_relu)
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, process_group, device=device, dtype=dtype
        )
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def _specify_process_group(self, process_group: dist.ProcessGroup | None) -> None:
        """Apex's setter (``convert_syncbn_model`` called it): synchronise over ``process_group`` from now on."""
        self.process_group = process_group

    def _specify_channel_last(self, channel_last: bool) -> None:
        """Apex's setter: whether the input's last dimension holds the channels."""
        self.channel_last = checked_switch("SyncBatchNorm", "channel_last", channel_last)

    def forward(self, input: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        channels_moved = self.channel_last and input.dim() > 2
        if channels_moved and input.shape[-1] != self.num_features:  # named before the move, as the caller laid it out
            raise NormShapeError(
                f"SyncBatchNorm({self.num_features}, channel_last=True) got an input of {input.shape[-1]} channels "
                f"(shape {list(input.shape)}); its last dimension holds the channels"
            )
        if channels_moved:  # Apex's channel_last: the channels are the input's last dimension, (N, ..., C)
            input = input.movedim(-1, 1)
        if not self.training and not self.track_running_stats and _spans_ranks(self.process_group):
            # Apex normalises with the statistics of the whole distributed batch here, as in training.
            self._check_input_dim(input)
            out = _ops._SyncBatchNormFunction.apply(
                input, self.weight, self.bias, None, None, self.eps, 0.0, self.process_group
            )
        else:
            out = super().forward(input)
        if channels_moved:
            out = out.movedim(1, -1)
        if z is not None:
            out = out + z
        if self.fuse_relu:
            out = F.relu(out)
        return out


def create_syncbn_process_group(group_size: int) -> dist.ProcessGroup | None:
    """Apex's helper: split the ranks into consecutive groups of ``group_size`` for SyncBatchNorm and return
    this rank's group (``None`` for 0, meaning the whole world). Every rank must call it: each creates all the
    groups."""
    if group_size == 0:
        return None
    world_size = dist.get_world_size()
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 0:
        raise ValueError(f"group_size={shown(group_size)}: expected an integer >= 0 (0 = the whole world)")
    if group_size > world_size or world_size % group_size:
        raise ValueError(f"group_size={group_size} must divide the world size {world_size}")
    mine = None
    for start in range(0, world_size, group_size):
        group = dist.new_group(ranks=list(range(start, start + group_size)))
        if start <= dist.get_rank() < start + group_size:
            mine = group
    return mine


def convert_syncbn_model(
    module: torch.nn.Module, process_group: dist.ProcessGroup | None = None, channel_last: bool = False
) -> torch.nn.Module:
    """Return ``module`` with every ``BatchNorm*d`` replaced by :class:`SyncBatchNorm` (parameters, running
    statistics and ``num_batches_tracked`` shared with the originals). As in Apex, which builds each replacement
    afresh, the new layers start in training mode whatever mode the originals were in."""
    channel_last = checked_switch("convert_syncbn_model", "channel_last", channel_last)  # before the model changes
    _ops.check_convertible(module, process_group, "convert_syncbn_model")
    already_synced = {id(sub) for sub in module.modules() if isinstance(sub, SyncBatchNorm)}
    converted = SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    for sub in converted.modules():
        if isinstance(sub, SyncBatchNorm):
            sub.channel_last = channel_last
            if id(sub) not in already_synced:
                sub.train()
    return converted
