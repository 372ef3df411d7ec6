"""SyncBatchNorm that works on every device the process group does, CPU/gloo included.

torch's ``nn.SyncBatchNorm`` refuses CPU inputs (its ``batch_norm_stats`` kernels are CUDA-only), so CPU
data-parallel training had no synchronised batch norm. This one reduces per-channel sums with
``all_reduce`` (two passes: the mean, then the centred sum of squares, which stays accurate where
``E[x^2] - E[x]^2`` cancels), so ranks with unequal batch sizes get the statistics of the concatenated batch.
Backward all-reduces ``sum(dy)`` and ``sum(dy * x_hat)`` like torch's; weight/bias gradients stay local
(data parallelism averages them, as it averages every parameter's gradient).
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ampkit.ops._dtypes import accumulate_dtype
from ampkit.ops._switches import checked_switch
from ampkit.ops.norms import NormShapeError
from ampkit.ops.optimizers._base import check_hyper
from ampkit.wording import shown


def _all_reduce(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    dist.all_reduce(tensor, group=group)
    return tensor


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group):  # noqa: D102
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        compute = accumulate_dtype(x.dtype)  # float64 data keeps float64 statistics, as torch's batch norm
        xf = x.to(compute)
        count = torch.full((1,), x.numel() / x.shape[1], dtype=compute, device=x.device)  # a fill: no copy to wait on
        sums = _all_reduce(torch.cat([xf.sum(dims), count]), group)
        total = sums[-1]
        mean = sums[:-1] / total
        centred = xf - mean.view(shape)
        var = _all_reduce(centred.square().sum(dims), group) / total
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                unbiased = var * total / (total - 1).clamp(min=1)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        x_hat = centred * invstd.view(shape)
        y = x_hat
        if weight is not None:
            y = y * weight.to(compute).view(shape) + bias.to(compute).view(shape)
        ctx.save_for_backward(x_hat, invstd, weight, total)
        ctx.group, ctx.dims, ctx.shape = group, dims, shape
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        x_hat, invstd, weight, total = ctx.saved_tensors
        dims, shape = ctx.dims, ctx.shape
        dyf = dy.to(x_hat.dtype)
        local = torch.cat([dyf.sum(dims), (dyf * x_hat).sum(dims)])
        grad_bias, grad_weight = local.chunk(2)
        grad_bias, grad_weight = grad_bias.clone(), grad_weight.clone()
        mean_dy, mean_dy_xhat = (_all_reduce(local, ctx.group) / total).chunk(2)
        scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
        dx = (dyf - mean_dy.view(shape) - x_hat * mean_dy_xhat.view(shape)) * scale.view(shape)
        if weight is None:
            return dx.to(dy.dtype), None, None, None, None, None, None, None
        return (dx.to(dy.dtype), grad_weight.to(weight.dtype), grad_bias.to(weight.dtype),
                None, None, None, None, None)  # fmt: skip


def _check_numbers(name: str, num_features: Any, eps: Any, momentum: Any) -> None:
    """torch's batch norms take these unchecked: a NaN ``eps`` or ``momentum`` gave NaN outputs or running statistics,
    a momentum of 2 extrapolated them past the batch's, and ``num_features=-1`` failed naming a tensor dimension."""
    if isinstance(num_features, bool) or not isinstance(num_features, numbers.Integral) or num_features < 1:
        raise ValueError(f"{name}: num_features must be an integer >= 1 (the channels), got {shown(num_features)}")
    check_hyper(f"{name} eps", eps)
    if momentum is not None:
        check_hyper(f"{name} momentum", momentum, 0.0, 1.0, closed=True)


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batch norm whose training statistics span every rank of ``process_group`` (default: the world)."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        # torch's batch norms read these by truthiness: affine="False" built a weight and bias
        name = type(self).__name__
        affine = checked_switch(name, "affine", affine)
        track_running_stats = checked_switch(name, "track_running_stats", track_running_stats)
        _check_numbers(name, num_features, eps, momentum)
        check_process_group(process_group, name)
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        """Before ``num_batches_tracked`` counts the batch or a collective starts: torch's errors named neither the
        layer nor its channels ("running_mean should contain 3 elements not 4"), and the synced path reduced the
        statistics of the wrong channels first."""
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2-D input (N, C, ...), got {input.dim()}-D")
        per_channel = self.affine or self.running_mean is not None  # else any channel count normalizes, as torch's
        if per_channel and input.shape[1] != self.num_features:  # also torch's RuntimeError, for code that catches it
            raise NormShapeError(
                f"{type(self).__name__}({self.num_features}) got an input of {input.shape[1]} channels (shape "
                f"{list(input.shape)}); dimension 1 holds the channels"
            )
        batch_stats = self.training or self.running_mean is None  # torch's eval on running statistics takes eps=0
        if batch_stats and not self.eps > 0:  # a channel of equal values normalized by 1/0
            raise ValueError(
                f"{type(self).__name__}: eps={shown(self.eps)} must be > 0 to normalize by batch statistics "
                "(training); eps=0 serves evaluation on running statistics only"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        synced = self.training and dist.is_available() and dist.is_initialized()
        if not synced or dist.get_world_size(self.process_group) == 1:
            use_batch_stats = self.training or self.running_mean is None
            return F.batch_norm(input, self.running_mean if not self.training or self.track_running_stats else None,
                                self.running_var if not self.training or self.track_running_stats else None,
                                self.weight, self.bias, use_batch_stats, momentum, self.eps)  # fmt: skip
        running = (self.running_mean, self.running_var) if self.track_running_stats else (None, None)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, *running, self.eps, momentum,
                                            self.process_group)  # fmt: skip

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: Any = None) -> nn.Module:
        """Replace every ``_BatchNorm`` in ``module`` by this class, sharing parameters and buffers."""
        check_convertible(module, process_group, f"{cls.__name__}.convert_sync_batchnorm")
        converted = module
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, cls):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group)  # fmt: skip
            if module.affine:
                converted.weight, converted.bias = module.weight, module.bias
            converted.running_mean, converted.running_var = module.running_mean, module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted


def check_convertible(module: Any, process_group: Any, where: str) -> None:
    """Refuse what no conversion takes, before a layer is replaced: a ``module`` that is no ``nn.Module`` (it failed
    as "'str' object has no attribute 'parameters'"), or a ``process_group`` :func:`check_process_group` refuses."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{where}: module must be a torch.nn.Module, got {type(module).__name__}")
    check_process_group(process_group, where)


def check_process_group(process_group: Any, where: str) -> None:
    """Refuse a ``process_group`` that is neither None (the world) nor a torch.distributed group: a layer would keep
    it until its first synced forward failed in a collective."""
    group_type = getattr(dist, "ProcessGroup", None) if dist.is_available() else None
    if process_group is not None and (group_type is None or not isinstance(process_group, group_type)):
        raise TypeError(
            f"{where}: process_group must be None (every rank) or a torch.distributed group "
            f"(torch.distributed.new_group(ranks)), got {type(process_group).__name__}"
        )


def convert_sync_batchnorm(module: nn.Module, process_group: Any = None) -> nn.Module:
    """Synchronise ``module``'s batch norms: torch's SyncBatchNorm on CUDA, :class:`SyncBatchNorm` elsewhere."""
    check_convertible(module, process_group, "convert_sync_batchnorm")
    on_cuda = any(p.is_cuda for p in module.parameters())
    if on_cuda:
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    return SyncBatchNorm.convert_sync_batchnorm(module, process_group)
