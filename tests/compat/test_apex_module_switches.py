"""The on/off arguments of Apex's modules and wrappers take True or False (numpy's ``bool_``, 0 and 1 too), as
``amp.initialize``'s do; torch's classes read them by truthiness, so ``"False"`` from a config switched them on.
The numbers their maths divides by are checked where they are given."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ampkit.compat.amp.handle import AmpHandle
from ampkit.compat.fused_dense import FusedDense
from ampkit.compat.mlp import MLP
from ampkit.compat.parallel import LARC, DistributedDataParallel, SyncBatchNorm


def _sgd():
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)


def _ddp(**kwargs):
    return DistributedDataParallel(torch.nn.Linear(2, 2), **kwargs)


BUILDS = {
    "apex.mlp.MLP: bias": lambda v: MLP([4, 3], bias=v),
    "FusedDense: bias": lambda v: FusedDense(4, 3, bias=v),
    "SyncBatchNorm: affine": lambda v: SyncBatchNorm(4, affine=v),
    "SyncBatchNorm: track_running_stats": lambda v: SyncBatchNorm(4, track_running_stats=v),
    "SyncBatchNorm: channel_last": lambda v: SyncBatchNorm(4, channel_last=v),
    "SyncBatchNorm: fuse_relu": lambda v: SyncBatchNorm(4, fuse_relu=v),
    "LARC: clip": lambda v: LARC(_sgd(), clip=v),
    "AmpHandle: enable_caching": lambda v: AmpHandle(enable_caching=v),
    "AmpHandle: verbose": lambda v: AmpHandle(verbose=v),
    # refused before torch's DDP needs a process group
    "DistributedDataParallel: delay_allreduce": lambda v: _ddp(delay_allreduce=v),
    "DistributedDataParallel: gradient_average": lambda v: _ddp(gradient_average=v),
    "DistributedDataParallel: allreduce_always_fp32": lambda v: _ddp(allreduce_always_fp32=v),
}  # fmt: skip


@pytest.mark.parametrize("value", ["False", 2, None])
@pytest.mark.parametrize("where", list(BUILDS))
def test_a_switch_that_is_not_true_or_false_is_named(where, value):
    with pytest.raises(ValueError, match=rf"^{where} must be True or False, got {value!r}$") as raised:
        BUILDS[where](value)
    assert isinstance(raised.value, TypeError)  # as ampkit's other switch errors


def test_true_false_and_their_numpy_and_integer_forms_still_build():
    assert MLP([4, 3], bias=np.bool_(False)).bias == 0 and FusedDense(4, 3, bias=0).bias is None
    norm = SyncBatchNorm(4, affine=np.bool_(False), channel_last=1)
    assert norm.weight is None and norm.affine is False and norm.channel_last is True
    norm._specify_channel_last(False)
    assert norm.channel_last is False
    with pytest.raises(ValueError, match="channel_last must be True or False, got 'True'"):
        norm._specify_channel_last("True")
    assert LARC(_sgd(), clip=np.bool_(False)).clip is False
    handle = AmpHandle(enable_caching=np.bool_(False), verbose=1)
    assert handle.has_cache is False and handle.verbose is True


@pytest.mark.parametrize("value", [math.nan, math.inf, 0.0, -1.0])
def test_numbers_that_would_divide_into_nan_are_named(value):
    """LARC's rate is ``trust * |w| / (|g| + wd |w| + eps)`` and Apex's DDP divides every gradient by
    ``gradient_predivide_factor``: NaN (and inf) slipped past their ``<= 0`` checks into NaN weights."""
    with pytest.raises(ValueError, match=rf"LARC: trust_coefficient must be a finite number > 0, got {value}"):
        LARC(_sgd(), trust_coefficient=value)
    with pytest.raises(ValueError, match=rf"gradient_predivide_factor must be a finite number > 0, got {value}"):
        _ddp(gradient_predivide_factor=value)
    if value != 0.0:
        with pytest.raises(ValueError, match=rf"LARC: eps must be a finite number >= 0, got {value}"):
            LARC(_sgd(), eps=value)
    assert LARC(_sgd(), eps=0.0).eps == 0.0


def test_convert_syncbn_model_and_fp16_optimizer_backward_name_a_switch_before_changing_anything():
    from ampkit.compat.fp16_utils import FP16_Optimizer
    from ampkit.compat.parallel import convert_syncbn_model

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match="convert_syncbn_model: channel_last must be True or False, got 'False'"):
        convert_syncbn_model(model, channel_last="False")
    assert type(model[1]) is torch.nn.BatchNorm1d  # left as it was
    half = torch.nn.Linear(4, 2).half()
    optimizer = FP16_Optimizer(torch.optim.SGD(half.parameters(), lr=0.1), static_loss_scale=8.0, verbose=False)
    loss = half(torch.randn(3, 4).half()).float().sum()
    with pytest.raises(ValueError, match="update_master_grads must be True or False, got 'False'"):
        optimizer.backward(loss, update_master_grads="False")
    assert all(p.grad is None for p in half.parameters())  # no backward ran
