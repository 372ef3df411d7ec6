"""Apex's ``SyncBatchNorm`` / ``convert_syncbn_model`` on torch, including CPU (gloo) process groups.

torch's ``SyncBatchNorm`` refuses CPU tensors; Apex's pure-Python fallback did not. On CPU the batch
statistics are reduced with the differentiable ``torch.distributed.nn.functional.all_reduce``, so autograd
also reduces the statistics' gradients across ranks. Other devices use torch's kernel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce


class SyncBatchNorm(torch.nn.SyncBatchNorm):
    """Batch norm whose training statistics are computed over every rank of ``process_group``.

    Apex extras: ``channel_last`` is accepted (torch picks kernels from the memory format itself) and
    ``fuse_relu`` applies ``relu(bn(x) + z)``; ``forward(input, z=None)`` adds ``z`` before the relu.
    """

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

    def _sync_group_size(self) -> int:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group or dist.group.WORLD)

    def forward(self, input: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        if input.device.type == "cpu" and self._sync_group_size() > 1:
            out = self._cpu_synced_forward(input)
        else:
            out = super().forward(input)
        if z is not None:
            out = out + z
        if self.fuse_relu:
            out = F.relu(out)
        return out

    def _cpu_synced_forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        group = self.process_group or dist.group.WORLD
        reduce_dims = [0, *range(2, input.dim())]
        shape = [1, -1] + [1] * (input.dim() - 2)
        x = input.float()
        local_count = torch.tensor([input.numel() / input.size(1)], dtype=torch.float32)
        sums = differentiable_all_reduce(torch.cat([x.sum(reduce_dims), local_count]), group=group)
        count = sums[-1]
        mean = sums[:-1] / count
        centered = x - mean.view(shape)
        var = differentiable_all_reduce((centered * centered).sum(reduce_dims), group=group) / count
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.float().view(shape) + self.bias.float().view(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                unbiased_var = var * (count / (count - 1).clamp(min=1))
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
                self.running_var.lerp_(unbiased_var.to(self.running_var.dtype), factor)
        return out.to(input.dtype)


def convert_syncbn_model(
    module: torch.nn.Module, process_group: dist.ProcessGroup | None = None, channel_last: bool = False
) -> torch.nn.Module:
    """Return ``module`` with every ``BatchNorm*d`` replaced by :class:`SyncBatchNorm` (weights kept)."""
    converted = module
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(module, SyncBatchNorm):
        converted = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
            channel_last=channel_last,
        )
        if module.affine:
            with torch.no_grad():
                converted.weight = module.weight
                converted.bias = module.bias
        if module.track_running_stats:
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
    for name, child in module.named_children():
        converted.add_module(name, convert_syncbn_model(child, process_group, channel_last))
    return converted
