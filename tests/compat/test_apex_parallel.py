"""apex.parallel on torch.distributed: LARC maths, convert_syncbn_model, and 2-process gloo runs of
DistributedDataParallel (Apex's reduction options, rank-local buffers), Reducer and the CPU SyncBatchNorm."""

import contextlib
import copy
import functools
import gc
import io
import json
import os
import sys
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint

from ampkit.compat.parallel import (
    LARC,
    DistributedDataParallel,
    Reducer,
    SyncBatchNorm,
    convert_syncbn_model,
    create_syncbn_process_group,
)


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize(
    "dtype,scale", [(torch.float32, 1.0), (torch.float64, 1e-30)], ids=["float32", "float64_below_float32"]
)
def test_larc_scales_each_gradient_by_its_trust_ratio(clip, dtype, scale):
    """The norms are taken in the parameters' precision, float64 included (in float32 these underflowed to zero
    and LARC left the gradients unscaled)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    lr, wd, trust, eps = 0.1, 1e-2, 0.02, 1e-8
    optimizer = LARC(torch.optim.SGD(model.parameters(), lr=lr, weight_decay=wd), trust_coefficient=trust, clip=clip)
    model(torch.randn(4, 5, dtype=dtype)).pow(2).sum().backward()
    expected = []
    for p in model.parameters():
        w_norm, g_norm = p.detach().norm(), p.grad.norm()
        local = trust * w_norm / (g_norm + w_norm * wd + eps)
        if clip:
            local = min(local / lr, 1.0)
        expected.append(p.detach() - lr * local * (p.grad + wd * p.detach()))
    optimizer.step()
    for p, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.detach(), want, atol=0, rtol=1e-6)  # relative: the float64 ones are tiny
    assert optimizer.param_groups[0]["weight_decay"] == wd  # restored after the step


class _CountedGroup(dict):
    """A param group that counts LARC's (and the wrapped optimizer's) reads of its ``lr``."""

    lr_reads = 0

    def __getitem__(self, key):
        if key == "lr":
            self.lr_reads += 1
        return super().__getitem__(key)


@pytest.mark.parametrize("clip", [True, False])
def test_larc_reads_a_groups_lr_once_a_step_with_the_same_numbers(clip):
    """LARC read group["lr"] once per parameter; it reads it once a group a step now, a 0-dim tensor lr too, and each
    gradient is still the float64 formula's: trust * |w| / (|g| + wd * |w| + eps), clipped by the group's lr."""
    trust, eps, wd = 0.02, 1e-8, 1e-2
    reads = []
    for count in (2, 6):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(count)]
        for p in params:
            p.grad = torch.randn(4, 3) * (1e-3 if len(reads) else 1.0)
        groups = [{"params": params[:1], "lr": 0.1}, {"params": params[1:], "lr": torch.tensor(0.03)}]
        larc = LARC(torch.optim.SGD(groups, lr=0.1, weight_decay=wd), trust_coefficient=trust, eps=eps, clip=clip)
        larc.optim.param_groups = [_CountedGroup(group) for group in larc.optim.param_groups]
        expected = []
        for group in larc.param_groups:
            lr = float(group["lr"])
            for p in group["params"]:
                w, g = p.detach().double(), p.grad.double()
                local = trust * w.norm() / (g.norm() + wd * w.norm() + eps)
                local = min(local / lr, 1.0) if clip else local
                expected.append(w - lr * local * (g + wd * w))
        before = [group.lr_reads for group in larc.param_groups]
        larc.step()
        reads.append([group.lr_reads - start for group, start in zip(larc.param_groups, before, strict=True)])
        for p, want in zip(params, expected, strict=True):
            torch.testing.assert_close(p.detach().double(), want, atol=0, rtol=1e-6)
    assert reads[0] == reads[1]  # the same reads of the group of 1 and of 5 parameters as of those of 1 and 1


def test_larc_clipping_never_raises_a_layer_s_rate_above_the_group_s():
    """With clip=True the local rate is min(trust ratio / lr, 1): a layer whose ratio exceeds lr steps at lr, as the
    plain optimizer would; without clipping (LARS) the same ratio scales the step up."""
    torch.manual_seed(0)
    lr = 0.1
    for clip in (True, False):
        weight = torch.nn.Parameter(torch.randn(4, 3))
        weight.grad = 1e-3 * torch.randn(4, 3)  # tiny gradient: trust ratio 0.02 * |w| / |g| is far above lr
        ratio = 0.02 * weight.detach().norm() / (weight.grad.norm() + 1e-8)
        assert ratio / lr > 10
        expected = weight.detach() - lr * (1.0 if clip else ratio) * weight.grad
        LARC(torch.optim.SGD([weight], lr=lr), clip=clip).step()
        torch.testing.assert_close(weight.detach(), expected)


class _NoHostRead(torch.Tensor):
    """A tensor whose value, or any value computed from it, fails the test when read on the host (a sync on CUDA)."""

    def __bool__(self):
        raise AssertionError("LARC read a value to the host")

    item = __float__ = __int__ = tolist = __bool__


@pytest.mark.parametrize("clip", [True, False])
def test_larc_decides_each_layers_rate_on_the_device_with_apexs_numbers(clip):
    """Apex's ``if param_norm != 0 and grad_norm != 0`` read two norms to the host per parameter, two syncs a layer a
    step on CUDA; the same step is decided on the device: a zero parameter or gradient left as it was (no weight
    decay either), the others scaled by their trust ratio, as the float64 formula gives."""
    torch.manual_seed(0)
    lr, wd, trust = 0.1, 1e-2, 0.02
    values = [torch.randn(4, 3), torch.zeros(3), torch.randn(5)]
    grads = [torch.randn(4, 3), torch.tensor([0.5, -1.0, 2.0]), torch.zeros(5)]
    expected = []
    for w, g in zip(values, grads, strict=True):
        w, g = w.double(), g.double()
        if w.norm() == 0 or g.norm() == 0:
            expected.append(g)
            continue
        local = trust * w.norm() / (g.norm() + wd * w.norm() + 1e-8)
        expected.append((torch.clamp(local / lr, max=1.0) if clip else local) * (g + wd * w))
    params = [torch.nn.Parameter(w.clone()) for w in values]
    for param, g in zip(params, grads, strict=True):
        param.grad = g.clone().as_subclass(_NoHostRead)
    larc = LARC(torch.optim.SGD(params, lr=lr, weight_decay=wd), trust_coefficient=trust, clip=clip)
    larc.optim.step = lambda: None  # LARC's own part of the step: the gradients it hands the optimizer
    larc.step()
    for param, want in zip(params, expected, strict=True):
        torch.testing.assert_close(param.grad.as_subclass(torch.Tensor).double(), want, atol=0, rtol=1e-6)
    assert larc.param_groups[0]["weight_decay"] == wd


def test_larc_leaves_a_zero_parameter_or_gradient_to_the_wrapped_optimizer():
    """A zero-initialised bias has no norm to trust: Apex left its gradient as it was, so it trains at the group's
    rate (a ratio of 0 would freeze it at zero for good)."""
    bias = torch.nn.Parameter(torch.zeros(3))
    bias.grad = torch.tensor([0.5, -1.0, 2.0])
    LARC(torch.optim.SGD([bias], lr=0.1)).step()
    torch.testing.assert_close(bias.detach(), torch.tensor([-0.05, 0.1, -0.2]))


@pytest.mark.parametrize(
    ("key", "value", "clip", "message"),
    [
        ("weight_decay", "1e-4", False, r"Invalid weight_decay of LARC.param_groups\[1\]: '1e-4' is a str"),
        ("weight_decay", float("nan"), True, r"Invalid weight_decay of LARC.param_groups\[1\]: nan"),
        ("lr", "0.1", True, r"Invalid lr of LARC.param_groups\[1\]: '0.1' is a str"),
        ("lr", None, True, r"Invalid lr of LARC.param_groups\[1\]: None is a NoneType"),
    ],
)
def test_larc_names_a_bad_group_setting_before_touching_any_group(key, value, clip, message):
    """A scheduler or config writing a string into a group failed deep in LARC's arithmetic (a raw TypeError naming
    nothing) after the earlier groups' gradients were rescaled and their weight decay switched off for good."""
    first, second = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    first.grad, second.grad = torch.full((3,), 0.5), torch.full((3,), 0.5)
    larc = LARC(torch.optim.SGD([{"params": [first]}, {"params": [second]}], lr=0.1, weight_decay=0.01), clip=clip)
    larc.param_groups[1][key] = value
    with pytest.raises((TypeError, ValueError), match=message):
        larc.step()
    assert larc.param_groups[0]["weight_decay"] == 0.01
    assert torch.equal(first.grad, torch.full((3,), 0.5)) and torch.equal(first.detach(), torch.ones(3))


def test_larc_without_clipping_reads_no_lr():
    """Apex's LARC reads a group's lr only to clip: without clipping it is the wrapped optimizer's business."""
    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.full((3,), 0.5)

    class NoLr(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": None})

        def step(self, closure=None):
            return None

    LARC(NoLr([weight]), clip=False).step()  # a LARS scaling: the gradient is rescaled, no lr is needed
    assert not torch.equal(weight.grad, torch.full((3,), 0.5))


def test_convert_syncbn_model_replaces_batchnorms_and_keeps_their_state():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.Sequential(torch.nn.BatchNorm2d(4)))
    bn = model[1][0]
    with torch.no_grad():
        bn.weight.fill_(2.0)
        bn.running_mean.fill_(0.5)
    converted = convert_syncbn_model(model, channel_last=True)
    new_bn = converted[1][0]
    assert new_bn.channel_last
    assert isinstance(new_bn, SyncBatchNorm) and isinstance(converted[0], torch.nn.Conv2d)
    assert new_bn.weight is bn.weight and torch.equal(new_bn.running_mean, bn.running_mean)
    x = torch.randn(2, 4, 3, 3)
    expected = torch.nn.functional.batch_norm(x, None, None, bn.weight, bn.bias, True)
    # channel_last (Apex's meaning): the input is laid out (N, H, W, C), channels in the last dimension
    torch.testing.assert_close(new_bn(x.permute(0, 2, 3, 1)), expected.permute(0, 2, 3, 1))
    fused = SyncBatchNorm(4, fuse_relu=True)
    z = torch.randn_like(x)
    expected = torch.relu(torch.nn.functional.batch_norm(x, None, None, training=True) + z)
    torch.testing.assert_close(fused(x, z), expected)


def test_ddp_rejects_shared_param():
    with pytest.raises(ValueError, match="shared_param"):
        DistributedDataParallel(torch.nn.Linear(2, 2), shared_param=True)


def test_convert_syncbn_model_starts_new_layers_in_training_mode_as_apex():
    bn = torch.nn.BatchNorm2d(3)
    bn.num_batches_tracked.fill_(7)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 1), bn).eval()
    converted = convert_syncbn_model(model)
    assert converted[1].training  # Apex builds the replacement afresh and never copies the mode
    assert not converted.training and not converted[0].training  # untouched modules keep theirs
    assert converted[1].num_batches_tracked is bn.num_batches_tracked  # shared, as Apex since 2019 (PR #380)


def _rank_data(rank):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(6, 4, generator=g), torch.randn(6, 4, 3, generator=g)


def _linear_grads(world_size):
    """A Linear layer and the mean and sum over ranks of its gradients for each rank's loss, computed locally."""
    torch.manual_seed(0)
    base = torch.nn.Linear(4, 2)
    per_rank = []
    for r in range(world_size):
        model = torch.nn.Linear(4, 2)
        model.load_state_dict(base.state_dict())
        model(_rank_data(r)[0]).pow(2).sum().backward()
        per_rank.append([p.grad.clone() for p in model.parameters()])
    total = [sum(g) for g in zip(*per_rank, strict=True)]
    return base, [t / world_size for t in total], total


def _assert_ddp_grads(rank, base, kwargs, want):
    model = torch.nn.Linear(4, 2)
    model.load_state_dict(base.state_dict())
    ddp = DistributedDataParallel(model, **kwargs)
    ddp(_rank_data(rank)[0]).pow(2).sum().backward()
    for p, w in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, w, msg=f"DDP grads wrong with {kwargs}")


def _check_ddp_reduction_options(rank, world_size):
    base, mean, total = _linear_grads(world_size)
    cases = [
        (dict(), mean),
        (dict(gradient_predivide_factor=2.0, allreduce_always_fp32=True), mean),
        (dict(gradient_average=False), total),
        (dict(delay_allreduce=True, message_size=1), mean),
        (dict(delay_allreduce=True, gradient_predivide_factor=2.0, allreduce_always_fp32=True), mean),
        (dict(delay_allreduce=True, gradient_average=False), total),
    ]
    for kwargs, want in cases:
        _assert_ddp_grads(rank, base, kwargs, want)


def _check_ddp_always_fp32_sums_half_gradients_in_float32(rank, world_size):
    # Apex's reason for the option: float16 gradients of 40000 on every rank sum past float16's 65504; summed in
    # float32 and averaged, they come back as 40000 (in float16, every element was inf).
    for kwargs in (dict(allreduce_always_fp32=True), dict(allreduce_always_fp32=True, delay_allreduce=True)):
        model = torch.nn.Linear(1, 1, bias=False).half()
        with torch.no_grad():
            model.weight.fill_(1.0)
        ddp = DistributedDataParallel(model, **kwargs)
        ddp(torch.full((1, 1), 40000.0, dtype=torch.float16)).sum().backward()
        grad = model.weight.grad
        assert grad.dtype == torch.float16 and grad.item() == 40000.0, f"{kwargs}: {grad}"


def _check_ddp_sum_stays_predivided(rank, world_size):
    # Apex's allreduce_bucket divides by the factor before the allreduce and only multiplies back when averaging.
    base, _, total = _linear_grads(world_size)
    _assert_ddp_grads(rank, base, dict(gradient_average=False, gradient_predivide_factor=4.0), [t / 4 for t in total])


def _bn_net(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))


def _check_ddp_keeps_rank_local_buffers(rank, world_size):
    # Apex broadcast rank 0's parameters once and never touched buffers: each rank keeps its own running stats.
    net = _bn_net(seed=rank)
    expected = _bn_net(seed=0)  # rank 0's parameters ...
    for bn in (net[1], expected[1]):
        bn.running_mean.fill_(float(rank))  # ... with this rank's buffers
    swapped = []  # torch >= 2.13 deprecates broadcast_buffers: a catch_warnings hiding it swaps every thread's filters

    class Recorded(warnings.catch_warnings):
        def __enter__(self):
            swapped.append(sys._getframe(1).f_globals.get("__name__", "?"))
            return super().__enter__()

    with warnings.catch_warnings(), mock.patch.object(warnings, "catch_warnings", Recorded):
        warnings.filterwarnings("error", message=".*broadcast_buffers", category=FutureWarning)
        ddp = DistributedDataParallel(net)
    assert not [name for name in swapped if name.startswith("ampkit")], swapped
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x = torch.randn(4, 3, generator=g) + 5 * rank
        ddp(x).sum().backward()
        expected(x)
    for (name, got), want in zip(net.state_dict().items(), expected.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, msg=f"{name} differs from Apex's (rank-local buffers)")


def _check_reducer_broadcasts_parameters_only(rank, world_size):
    bn = torch.nn.BatchNorm1d(2)
    with torch.no_grad():
        bn.weight.fill_(rank + 1.0)
        bn.running_mean.fill_(float(rank))
    reducer = Reducer(bn)
    weight, running_mean = bn.weight.detach().clone(), bn.running_mean.clone()
    for p in bn.parameters():
        p.grad = torch.full_like(p, rank + 1.0)
    reducer.reduce()
    torch.testing.assert_close(weight, torch.ones(2), msg="Reducer must broadcast rank 0's parameters")
    torch.testing.assert_close(running_mean, torch.full((2,), float(rank)), msg="Reducer must leave buffers alone")
    for p in bn.parameters():
        torch.testing.assert_close(p.grad, torch.full_like(p, (world_size + 1) / 2))


def _check_reducer_of_a_grads_list_takes_the_tensors_in_it_as_apex(rank, world_size):
    """Apex's Reducer gathered the tensors of any nesting of lists, tuples or generators, skipping anything else:
    ``Reducer([p.grad for p in params])`` after a backward that left one parameter without a grad kept working.
    Here the list was kept as given and ``reduce()`` failed on the ``None`` (or on a nested list)."""
    used, unused, other = torch.full((3,), rank + 1.0), None, torch.full((2, 2), rank * 4.0).half()
    reducer = Reducer([[used, unused], (g for g in [other])])
    reducer.reduce()
    torch.testing.assert_close(used, torch.full((3,), (world_size + 1) / 2))
    torch.testing.assert_close(other, torch.full((2, 2), 2.0 * (world_size - 1)).half())


def _check_flat_dist_call_broadcasts_and_averages_each_type(rank, world_size):
    """NVIDIA's BERT pretraining: ``flat_dist_call(params, dist.broadcast, (0,))`` before training; Apex
    averaged a flat ``all_reduce`` over the world."""
    from ampkit.compat import install_apex_shim, uninstall_apex_shim

    install_apex_shim()
    try:
        from apex.parallel.distributed import flat_dist_call, split_half_float_double
    finally:
        uninstall_apex_shim()
    tensors = [torch.full((3, 2), rank + 1.0), torch.full((4,), rank + 10.0).half(), torch.full((1,), rank * 2.0)]
    flat_dist_call(tensors, dist.broadcast, (0,))
    broadcast = [t.clone() for t in tensors]
    flat_dist_call(tensors, dist.all_reduce)
    assert [t.dtype for t in tensors] == [torch.float32, torch.float16, torch.float32]
    for got, want in zip(broadcast, (torch.ones(3, 2), torch.full((4,), 10.0).half(), torch.zeros(1)), strict=True):
        torch.testing.assert_close(got, want)
    averaged = [torch.full((3, 2), 1.0), torch.full((4,), 10.0).half(), torch.zeros(1)]  # every rank held rank 0's
    for got, want in zip(tensors, averaged, strict=True):
        torch.testing.assert_close(got, want)
    assert [[t.dtype for t in b] for b in split_half_float_double(tensors)] == [[torch.float16], [torch.float32] * 2]


def _check_sync_batchnorm_matches_full_batch(rank, world_size):
    # Statistics (and their gradients) over both ranks' halves of a batch.
    full = torch.cat([_rank_data(r)[1] for r in range(world_size)])
    weight = torch.linspace(0.5, 2.0, 4)
    reference_bn = torch.nn.BatchNorm1d(4)
    full_input = full.clone().requires_grad_(True)
    reference_out = reference_bn(full_input)
    (reference_out * weight[None, :, None]).sum().backward()
    sync_bn = SyncBatchNorm(4)
    local = _rank_data(rank)[1].clone().requires_grad_(True)
    out = sync_bn(local)
    (out * weight[None, :, None]).sum().backward()
    rows = slice(rank * 6, (rank + 1) * 6)
    torch.testing.assert_close(out, reference_out[rows])
    torch.testing.assert_close(local.grad, full_input.grad[rows])
    torch.testing.assert_close(sync_bn.running_mean, reference_bn.running_mean)
    torch.testing.assert_close(sync_bn.running_var, reference_bn.running_var)


def _check_sync_batchnorm_function_with_statistics_reduced_by_hand_matches_full_batch(rank, world_size):
    # A masked batch norm subclassing apex.parallel.SyncBatchNorm reduces its own statistics and calls Apex's
    # pure-Python SyncBatchnormFunction, whose backward averages mean(dy) and mean(dy * (x - mean)) over the ranks.
    from ampkit.compat.parallel.sync_batchnorm_kernel import SyncBatchnormFunction

    full = torch.cat([_rank_data(r)[1] for r in range(world_size)])
    upstream = torch.linspace(-1.0, 1.0, full.numel()).reshape(full.shape)
    reference_bn = torch.nn.BatchNorm1d(4)
    full_input = full.clone().requires_grad_(True)
    reference_out = reference_bn(full_input)
    (reference_out * upstream).sum().backward()
    local = _rank_data(rank)[1].clone().requires_grad_(True)
    with torch.no_grad():
        flat = local.transpose(0, 1).reshape(4, -1)
        stats = torch.cat([flat.mean(1), flat.pow(2).mean(1)])
        dist.all_reduce(stats)
        mean, sqr_mean = (stats / world_size).chunk(2)
    bn_weight, bn_bias = torch.ones(4, requires_grad=True), torch.zeros(4, requires_grad=True)
    out = SyncBatchnormFunction.apply(local, bn_weight, bn_bias, mean, sqr_mean - mean.pow(2), 1e-5, None, world_size)
    rows = slice(rank * 6, (rank + 1) * 6)
    (out * upstream[rows]).sum().backward()
    weight_grad = bn_weight.grad.clone()
    dist.all_reduce(weight_grad)  # local, as Apex left them: data parallelism sums (or averages) them
    torch.testing.assert_close(out, reference_out[rows], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(local.grad, full_input.grad[rows], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weight_grad, reference_bn.weight.grad, rtol=1e-4, atol=1e-5)


def _check_sync_batchnorm_keeps_float64(rank, world_size):
    # Float64 data (a large offset, a small spread: float32 keeps none of it) normalises as torch's float64 batch
    # norm does, forward and backward; statistics computed in float32 lost everything below 1e-3 here.
    full = torch.cat([_rank_data(r)[1] for r in range(world_size)]).double() * 1e-3 + 1e4
    reference_bn = torch.nn.BatchNorm1d(4).double()
    full_input = full.clone().requires_grad_(True)
    reference_out = reference_bn(full_input)
    reference_out.square().sum().backward()
    sync_bn = SyncBatchNorm(4).double()
    local = full[rank * 6 : (rank + 1) * 6].clone().requires_grad_(True)
    out = sync_bn(local)
    out.square().sum().backward()
    rows = slice(rank * 6, (rank + 1) * 6)
    torch.testing.assert_close(out, reference_out[rows])
    torch.testing.assert_close(local.grad, full_input.grad[rows])
    torch.testing.assert_close(sync_bn.running_mean, reference_bn.running_mean)
    torch.testing.assert_close(sync_bn.running_var, reference_bn.running_var)


def _check_syncbn_process_groups(rank, world_size):
    # Apex's create_syncbn_process_group: groups of one rank normalise locally, a group of all ranks globally.
    local = _rank_data(rank)[1]
    assert create_syncbn_process_group(0) is None
    with pytest.raises(ValueError, match="must divide the world size"):
        create_syncbn_process_group(world_size + 1)
    alone = SyncBatchNorm(4)
    alone._specify_process_group(create_syncbn_process_group(1))
    torch.testing.assert_close(alone(local), torch.nn.functional.batch_norm(local, None, None, training=True))
    together = SyncBatchNorm(4, process_group=create_syncbn_process_group(world_size))
    full = torch.cat([_rank_data(r)[1] for r in range(world_size)])
    expected = torch.nn.functional.batch_norm(full, None, None, training=True)[rank * 6 : (rank + 1) * 6]
    torch.testing.assert_close(together(local), expected)


def _check_sync_batchnorm_eval_without_running_stats_syncs(rank, world_size):
    # With no running statistics Apex normalises with the distributed batch's, in eval mode too.
    full = torch.cat([_rank_data(r)[1] + 3 * r for r in range(world_size)])
    sync_bn = SyncBatchNorm(4, track_running_stats=False).eval()
    out = sync_bn(_rank_data(rank)[1] + 3 * rank)
    want = torch.nn.functional.batch_norm(full, None, None, sync_bn.weight, sync_bn.bias, training=True)
    torch.testing.assert_close(out, want[rank * 6 : (rank + 1) * 6])


def _check_ddp_disable_and_enable_allreduce(rank, world_size):
    # Apex's gradient accumulation switch: local grads while disabled, the mean of the summed grads once enabled.
    base, mean, _ = _linear_grads(world_size)
    for delay_allreduce in (False, True):
        model = torch.nn.Linear(4, 2)
        model.load_state_dict(base.state_dict())
        ddp = DistributedDataParallel(model, delay_allreduce=delay_allreduce)
        ddp.disable_allreduce()
        ddp(_rank_data(rank)[0]).pow(2).sum().backward()
        assert not torch.allclose(model.weight.grad, mean[0])  # this rank's own gradient: nothing was reduced
        ddp.enable_allreduce()
        ddp(_rank_data(rank)[0]).pow(2).sum().backward()
        for p, m in zip(model.parameters(), mean, strict=True):  # the accumulated gradients, averaged over ranks
            torch.testing.assert_close(p.grad, 2 * m)


def _check_ddp_reduces_a_layer_unfrozen_after_construction(rank, world_size):
    # A fine-tuning run unfreezes a layer after wrapping: torch's reducer keeps the parameters trainable at
    # construction, so its gradient stayed rank-local and the ranks drifted apart; Apex rebuilt its buckets.
    base, mean, _ = _linear_grads(world_size)
    for delay_allreduce in (False, True):
        model = torch.nn.Linear(4, 2)
        model.load_state_dict(base.state_dict())
        model.weight.requires_grad_(False)
        ddp = DistributedDataParallel(model, delay_allreduce=delay_allreduce)
        model.weight.requires_grad_(True)
        ddp(_rank_data(rank)[0]).pow(2).sum().backward()
        for p, m in zip(model.parameters(), mean, strict=True):
            torch.testing.assert_close(p.grad, m, msg=f"delay_allreduce={delay_allreduce}")


def _check_ddp_takes_a_module_frozen_whole(rank, world_size):
    """kanachan's IQL wraps its target Q networks, frozen whole and updated from the online networks' masters, in Apex
    DDP, then ``convert_syncbn_model``: torch's constructor refused them ("not needed when a module doesn't have any
    parameter that requires a gradient"). Apex broadcast their parameters and ran their forwards. Unfrozen later,
    such a module's gradients are averaged, as any layer's unfrozen after wrapping."""
    torch.manual_seed(rank)
    target = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.BatchNorm1d(2))
    target.requires_grad_(False)
    ddp = convert_syncbn_model(DistributedDataParallel(target))
    weights = torch.cat([p.flatten() for p in target.parameters()])
    rank0 = weights.clone()
    dist.broadcast(rank0, 0)
    x = _rank_data(rank)[0]
    outputs = []
    for _ in range(2):  # forwards with and without grad mode and no backward, as a target network runs
        with torch.no_grad():
            outputs.append(ddp(x))
        outputs.append(ddp(x))
    frozen_outputs = [out.requires_grad for out in outputs]
    head = torch.nn.Linear(4, 2)
    head.requires_grad_(False)
    wrapped_head = DistributedDataParallel(head)
    head.requires_grad_(True)  # unfrozen later
    expected = _averaged_grads(head, head(x).pow(2).sum(), world_size)
    wrapped_head(x).pow(2).sum().backward()
    assert torch.equal(weights, rank0)
    assert frozen_outputs == [False] * 4
    assert isinstance(ddp.module[1], SyncBatchNorm)
    assert _grads_equal(head, expected)


class _Standardize(torch.nn.Module):
    """A module of buffers only (an input normalizer, as image models put before their backbone)."""

    def __init__(self, rank):
        super().__init__()
        self.register_buffer("mean", torch.full((4,), float(rank)))
        self.register_buffer("std", torch.full((4,), 2.0))

    def forward(self, x):
        return (x - self.mean) / self.std


def _check_ddp_takes_a_module_without_parameters(rank, world_size):
    """torch's constructor refuses a module with no parameter at all (it cannot even tell its device); Apex's class
    broadcast and reduced nothing and ran its forwards, leaving each rank's buffers its own. In every reduce mode a
    backward through it reaches the input's gradient, and a misspelt torch keyword is still an error."""
    x = _rank_data(rank)[0]
    outputs, grads = [], []
    for kwargs in ({}, {"delay_allreduce": True}, {"gradient_average": False}, {"retain_allreduce_buffers": True}):
        ddp = DistributedDataParallel(_Standardize(rank), **kwargs)
        leaf = x.clone().requires_grad_(True)
        out = ddp(leaf)
        out.pow(2).sum().backward()
        outputs.append(out.detach())
        grads.append(leaf.grad)
        ddp.disable_allreduce()
        ddp(leaf)
    expected = (x - rank) / 2
    with pytest.raises(TypeError, match="find_unused_parameter"):
        DistributedDataParallel(_Standardize(rank), find_unused_parameter=True)
    assert all(torch.equal(out, expected) for out in outputs)
    assert all(torch.equal(grad, expected) for grad in grads)  # d/dx of ((x - m) / 2)^2 summed
    assert torch.equal(ddp.module.mean, torch.full((4,), float(rank)))  # rank-local, not broadcast
    assert ddp.world_size == float(world_size) and list(ddp.parameters()) == []


def _check_ddp_delay_allreduce_with_an_unused_parameter(rank, world_size):
    # Apex's delay_allreduce reduced the grads that existed at the end of backward; an unused layer is fine.
    base, mean, _ = _linear_grads(world_size)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 2), "unused": torch.nn.Linear(2, 2)})
    model["used"].load_state_dict(base.state_dict())

    class Forward(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x):
            return self.inner["used"](x)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = DistributedDataParallel(Forward(), delay_allreduce=True)
        for _ in range(2):
            model.zero_grad()
            ddp(_rank_data(rank)[0]).pow(2).sum().backward()
    for p, m in zip(model["used"].parameters(), mean, strict=True):
        torch.testing.assert_close(p.grad, m)
    assert all(p.grad is None for p in model["unused"].parameters())
    # One allreduce at the end of backward, as Apex: torch's graph walk (and its warning) stays off.
    assert not ddp.find_unused_parameters and not caught, [str(w.message) for w in caught]


def _check_ddp_delay_allreduce_flattens_each_dtype(rank, world_size):
    # O2 keeps batch norm in fp32 beside fp16 layers: each dtype is reduced in its own flat tensor, to the mean.
    class HalfThenFloat(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.low, self.high = torch.nn.Linear(4, 3).half(), torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.high(self.low(x).float())

    torch.manual_seed(0)
    model = HalfThenFloat()
    x = _rank_data(rank)[0]
    expected = _averaged_grads(model, model(x.half()).float().pow(2).sum(), world_size)
    ddp = DistributedDataParallel(model, delay_allreduce=True)
    out = ddp(x.half())
    out.float().pow(2).sum().backward()
    for p, want in zip(model.parameters(), expected, strict=True):
        assert p.grad.dtype == p.dtype
        torch.testing.assert_close(p.grad, want)


def _averaged_grads(model: torch.nn.Module, loss: torch.Tensor, world_size: int) -> list[torch.Tensor | None]:
    """The gradients ``loss`` gives ``model``'s parameters, averaged over the ranks by hand (what DDP must produce;
    None for a parameter it does not reach); the model's own are zeroed again."""
    loss.backward()
    expected = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    for grad in expected:
        if grad is not None:
            dist.all_reduce(grad)
            grad.div_(world_size)
    model.zero_grad()
    return expected


def _check_ddp_reduces_at_the_end_of_backward_whatever_the_forward_returns(rank, world_size):
    """A model returning an object of its own class (ModelOutput-like: no tensor, list, tuple or dict for a search to
    find) kept its gradients rank-local, silently, in every mode that reduces at the end of backward: the reduce was
    queued from hooks on the tensors found in the output. Apex queued it from the parameters' gradient hooks."""

    class Output:
        def __init__(self, logits):
            self.logits = logits

    class OwnOutput(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 2)

        def forward(self, x):
            return Output(self.linear(x))

    x = _rank_data(rank)[0]
    rank_local = []  # asserted after every case's collectives, so that a failure leaves the ranks in step
    cases = [(dict(delay_allreduce=True), False), (dict(retain_allreduce_buffers=True), False), (dict(), True)]
    for kwargs, unfrozen_after_wrapping in cases:
        torch.manual_seed(0)
        model = OwnOutput()
        expected = _averaged_grads(model, model(x).logits.pow(2).sum(), world_size)
        model.linear.weight.requires_grad_(not unfrozen_after_wrapping)
        ddp = DistributedDataParallel(model, **kwargs)
        model.linear.weight.requires_grad_(True)
        for step in range(2):  # the hooks serve every backward, not only the first
            model.zero_grad()
            ddp(x).logits.pow(2).sum().backward()
            if not all(torch.allclose(p.grad, want) for p, want in zip(model.parameters(), expected, strict=True)):
                rank_local.append(f"{kwargs}, unfrozen after wrapping: {unfrozen_after_wrapping}, backward {step}")
    assert not rank_local, rank_local


def _grads_equal(model: torch.nn.Module, expected: list[torch.Tensor | None]) -> bool:
    """Whether ``model``'s gradients are ``expected`` (None where expected is None)."""
    pairs = zip([p.grad for p in model.parameters()], expected, strict=True)
    return all(got is None if want is None else got is not None and torch.allclose(got, want) for got, want in pairs)


class _UnusedBranch(torch.nn.Module):
    """thunlp/ERNIE's last layer in outline: it computes an entity branch that no loss reads, and returns an object
    of its own class (no tensor, list, tuple or dict to search)."""

    class Output:
        def __init__(self, logits, entities):
            self.logits, self.entities = logits, entities

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.Output(self.used(x), self.unused(x))


def _check_ddp_default_mode_with_a_layer_the_forward_never_uses(rank, world_size):
    """Apex built its buckets from the parameters its first backward reached, so ERNIE trained under its default
    mode; torch's reducer stopped the second forward ("Expected to have finished reduction in the prior
    iteration"). Every backward must average the gradients the loss gives, with or without the unused layer."""
    x = _rank_data(rank)[0]
    wrong, overlapping = [], []  # asserted after every case's collectives, so that a failure leaves the ranks in step
    for kwargs in (dict(), dict(gradient_predivide_factor=2.0)):
        for unused_layer in (True, False):
            torch.manual_seed(0)
            model = _UnusedBranch()
            model.unused.requires_grad_(unused_layer)
            expected = _averaged_grads(model, model(x).logits.pow(2).sum(), world_size)
            ddp = DistributedDataParallel(model, **kwargs)
            for step in range(3):
                model.zero_grad()
                ddp(x).logits.pow(2).sum().backward()
                if not _grads_equal(model, expected):
                    wrong.append(f"{kwargs}, unused layer: {unused_layer}, backward {step}")
            # every parameter reached: torch's reducer overlaps the allreduce from the second forward on
            overlapping.append(ddp.require_backward_grad_sync)
    assert not wrong, wrong
    assert overlapping == [False, True, False, True]


def _check_ddp_with_a_branch_only_some_ranks_use(rank, world_size):
    """ERNIE's entity branch is used on a rank whose batch has entities only: each rank's end-of-backward reduce then
    held other gradients. A flat buffer of another size failed in gloo (NCCL would hang); under ``delay_allreduce``
    and ``retain_allreduce_buffers``, two branches of one size used on different ranks were summed into each other,
    silently, and the ranks' weights drifted apart (as under Apex). A gradient some rank has is averaged on every
    rank, the others' counted as zeros, as torch's reducer counts an unused parameter's."""
    x = _rank_data(rank)[0]
    uses = {  # the silent case first: a failure there stops the check before gloo's abort on the other
        "each rank uses one branch": lambda out: (out.logits if rank == 0 else out.entities).pow(2).sum(),
        "rank 0 also uses the entities": lambda out: (
            out.logits.pow(2).sum() + (out.entities.pow(2).sum() if rank == 0 else 0)
        ),
    }
    cases = [
        (kwargs, use)
        for kwargs in (dict(), dict(delay_allreduce=True), dict(retain_allreduce_buffers=True))
        for use in uses
    ]
    wrong = []
    for kwargs, use in cases:
        torch.manual_seed(0)
        model = _UnusedBranch()
        uses[use](model(x)).backward()
        expected = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
        for grad in expected:
            dist.all_reduce(grad)
            grad.div_(world_size)
        ddp = DistributedDataParallel(model, **kwargs)
        for step in range(3):
            model.zero_grad()
            uses[use](ddp(x)).backward()
            if not _grads_equal(model, expected):
                wrong.append(f"{kwargs}, {use}, backward {step}: gradients differ from the hand-averaged ones")
        if wrong:  # every rank stops here: the ranks' gradients were compared after the same collectives
            break
    assert not wrong, wrong


def _check_reducer_of_a_module_averages_a_gradient_only_some_ranks_have(rank, world_size):
    """Apex's ``Reducer(module).reduce()`` flattened each rank's own gradients: with a branch used on one rank and
    another of the same size on the other, each rank averaged its gradient with the other branch's. Every rank now
    reduces the same list, a gradient it lacks counted as zeros."""
    torch.manual_seed(0)
    model = _UnusedBranch()
    reducer = Reducer(model)
    out = model(_rank_data(rank)[0])
    (out.logits if rank == 0 else out.entities).pow(2).sum().backward()
    expected = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    for grad in expected:
        dist.all_reduce(grad)
        grad.div_(world_size)
    reducer.reduce()
    assert _grads_equal(model, expected)


def _check_ddp_default_mode_leaves_sparse_embeddings_to_torchs_reducer(rank, world_size):
    """The end-of-backward reduce takes dense gradients only; torch's reducer takes sparse ones, as it did."""
    torch.manual_seed(0)
    embedding, dense = torch.nn.Embedding(6, 3, sparse=True), torch.nn.Embedding(6, 3)
    dense.load_state_dict(embedding.state_dict())
    tokens = torch.tensor([rank, 3, 5])
    dense(tokens).pow(2).sum().backward()
    want = dense.weight.grad
    dist.all_reduce(want)
    ddp = DistributedDataParallel(embedding)
    averaged = []
    for _ in range(2):
        embedding.zero_grad()
        ddp(tokens).pow(2).sum().backward()
        averaged.append(torch.allclose(embedding.weight.grad.to_dense(), want / world_size))
    assert averaged == [True, True]


def _check_ddp_sum_reduces_each_gradient_once_per_forward(rank, world_size):
    """A second backward before the next forward (here a loss on the weights themselves, the same on every rank)
    adds to gradients already summed over the ranks. Reduced again, they were counted once per rank; Apex queued its
    reduce once per forward, which left the later part local, and so does torch's reducer."""
    base, _, total = _linear_grads(world_size)
    cases = [("delay_allreduce", False), ("retain_allreduce_buffers", False), (None, True), (None, False)]
    wrong = []
    for switch, unused_layer in cases:
        model = _UnusedBranch()
        model.used.load_state_dict(base.state_dict())
        model.unused.requires_grad_(unused_layer)
        kwargs = {switch: True} if switch else {}
        ddp = DistributedDataParallel(model, gradient_average=False, **kwargs)
        for step in range(2):  # the default mode's second forward is torch's reducer's when no layer is unused
            model.zero_grad()
            ddp(_rank_data(rank)[0]).logits.pow(2).sum().backward()
            model.used.weight.pow(2).sum().backward()
            want = [total[0] + 2 * base.weight.detach(), total[1]]
            if not all(torch.allclose(p.grad, w) for p, w in zip(model.used.parameters(), want, strict=True)):
                wrong.append(f"{kwargs}, unused layer: {unused_layer}, backward {step}")
    assert not wrong, wrong


def _check_ddp_reduces_both_backwards_of_a_reentrant_checkpoint(rank, world_size):
    """A head under a reentrant checkpoint is differentiated in a backward of its own, which ends before the rest of
    the model gets its gradients: both backwards must be reduced (once per forward left the body rank-local), and a
    sum must not sum the head's gradients twice. Nor may that inner backward decide the default mode's overlap (it
    would find the body unreached)."""

    class CheckpointedHead(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

        def forward(self, x):
            return checkpoint(self.head, self.body(x), use_reentrant=True)

    x = _rank_data(rank)[0]
    wrong = []
    cases = [
        {switch: True, **average}
        for switch in ("delay_allreduce", "retain_allreduce_buffers")
        for average in ({}, dict(gradient_average=False))
    ]
    for kwargs in [*cases, dict()]:
        torch.manual_seed(0)
        model = CheckpointedHead()
        expected = _averaged_grads(model, model(x).pow(2).sum(), world_size)
        if kwargs.get("gradient_average") is False:
            expected = [g * world_size for g in expected]
        ddp = DistributedDataParallel(model, **kwargs)
        for step in range(3):
            model.zero_grad(set_to_none=step % 2 == 0)
            ddp(x).pow(2).sum().backward()
            if not _grads_equal(model, expected):
                wrong.append(f"{kwargs}, backward {step}")
            if kwargs.get("retain_allreduce_buffers") and not _retained_buffers_hold_every_gradient(ddp, model):
                wrong.append(f"{kwargs}, backward {step}: allreduce_buffers miss a gradient")
        if not kwargs and not ddp.require_backward_grad_sync:
            wrong.append("the default mode never handed over to torch's reducer")
    assert not wrong, wrong


def _retained_buffers_hold_every_gradient(ddp: DistributedDataParallel, model: torch.nn.Module) -> bool:
    """Whether ``allreduce_buffers`` (one flat buffer per dtype) hold every gradient, each a view of its buffer, and
    ``active_params``/``active_i_buckets`` list them: what a flat step (MLPerf SSD's masters) reads and writes. Under
    a reentrant checkpoint the head, summed by the inner backward, was left out of the buffers the outer one kept."""
    buckets = [[ddp.active_params[i] for i in bucket] for bucket in ddp.active_i_buckets]
    if sorted(id(p) for bucket in buckets for p in bucket) != sorted(id(p) for p in model.parameters()):
        return False
    for buffer, params in zip(ddp.allreduce_buffers, buckets, strict=True):
        if not torch.equal(buffer, torch.cat([p.grad.flatten() for p in params])):
            return False
        buffer.add_(1)  # a flat step on the buffer must be a step on every gradient
        moved = torch.equal(buffer, torch.cat([p.grad.flatten() for p in params]))
        buffer.sub_(1)
        if not moved:
            return False
    return True


def _check_ddp_retains_allreduce_buffers_for_a_flat_step(rank, world_size):
    # MLPerf's GNMT and SSD step fp32 masters from ``model.allreduce_buffers``: one flat reduced buffer per dtype
    # (float16 first), which each gradient is a view of, refilled by every backward; SSD builds its masters from
    # the parameters ``active_i_buckets`` lists for each.
    class FloatThenHalf(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.high, self.low = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2).half()

        def forward(self, x):
            return self.low(self.high(x).half())

    torch.manual_seed(0)
    model = FloatThenHalf()
    x = _rank_data(rank)[0]
    expected = _averaged_grads(model, model(x).float().pow(2).sum(), world_size)
    ddp = DistributedDataParallel(model, retain_allreduce_buffers=True)
    for _ in range(2):  # the second backward's buffers replace the first's
        model.zero_grad(set_to_none=True)
        ddp(x).float().pow(2).sum().backward()
    half, single = ddp.allreduce_buffers
    assert (half.dtype, single.dtype) == (torch.float16, torch.float32)
    torch.testing.assert_close(half, torch.cat([g.flatten() for g in expected[2:]]))
    torch.testing.assert_close(single, torch.cat([g.flatten() for g in expected[:2]]))
    buckets = [[ddp.active_params[i] for i in bucket] for bucket in ddp.active_i_buckets]
    assert buckets == [[model.low.weight, model.low.bias], [model.high.weight, model.high.bias]]
    half.mul_(2)  # what a flat step does to the buffer, every fp16 gradient sees
    torch.testing.assert_close(model.low.weight.grad, 2 * expected[2])


def _check_o2_masters_stay_identical_across_ranks(rank, world_size):
    # Each rank builds its own model; DDP hands every rank rank 0's fp16 weights. The fp32 masters must then be
    # identical on every rank (Apex built them from the fp16 weights), or the replicas drift apart for good.
    from ampkit.compat import amp

    torch.manual_seed(rank)
    model = torch.nn.Linear(8, 4)
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    ddp = DistributedDataParallel(model)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
    for _ in range(3):
        optimizer.zero_grad()
        with amp.scale_loss(ddp(x.half()).float().pow(2).mean(), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    mine = torch.cat([t.detach().float().flatten() for t in [*amp.master_params(optimizer), *model.parameters()]])
    theirs = mine.clone()
    dist.broadcast(theirs, 0)
    drift = (mine - theirs).abs().max()
    dist.all_reduce(drift, op=dist.ReduceOp.MAX)  # every rank fails together, so the next check is not stranded
    assert drift.item() == 0, f"replicas differ from rank 0 by {drift.item():.3g}"


def _apex_imagenet_example(seed: int, world_size: int):
    """Apex's own ``examples/imagenet/main_amp.py`` set-up, CPU-sized: ``convert_syncbn_model``, channels_last, the
    learning rate scaled by the global batch, O2 with ``keep_batchnorm_fp32`` and ``loss_scale`` as the strings
    argparse gives, then Apex DDP with ``delay_allreduce=True``."""
    from ampkit.compat import amp

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, 5),
    )
    model = convert_syncbn_model(model).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), 0.1 * 8 * world_size / 256, momentum=0.9, weight_decay=1e-4)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", keep_batchnorm_fp32="True", loss_scale="128.0", verbosity=0
    )
    return DistributedDataParallel(model, delay_allreduce=True), optimizer


def _apex_imagenet_iterations(model, optimizer, rank, world_size, first, count):
    """The example's ``train``: its learning-rate schedule on the groups, channels_last inputs, ``scale_loss``, and
    the loss averaged over the ranks for printing (its ``reduce_tensor``)."""
    from ampkit.compat import amp

    printed = []
    for i in range(first, first + count):
        for group in optimizer.param_groups:
            group["lr"] = 0.01 * (i + 1)
        g = torch.Generator().manual_seed(100 * i + rank)
        images = torch.randn(8, 3, 8, 8, generator=g).contiguous(memory_format=torch.channels_last)
        loss = torch.nn.functional.cross_entropy(model(images), torch.randint(0, 5, (8,), generator=g))
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        reduced = loss.data.clone()
        dist.all_reduce(reduced)
        printed.append((reduced / world_size).item())
    return printed


def _check_apex_imagenet_example_resumes_exactly_and_keeps_the_ranks_equal(rank, world_size):
    """Apex's ImageNet example, resumed as it resumes: a new model and optimizer built and initialized, wrapped in
    DDP, then ``model.load_state_dict`` and ``optimizer.load_state_dict`` from ``{state_dict, optimizer}``."""
    model, optimizer = _apex_imagenet_example(seed=rank, world_size=world_size)
    _apex_imagenet_iterations(model, optimizer, rank, world_size, 0, 3)
    checkpoint = io.BytesIO()
    torch.save({"state_dict": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint)
    straight = _apex_imagenet_iterations(model, optimizer, rank, world_size, 3, 3)
    want = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    _reset_amp()
    model, optimizer = _apex_imagenet_example(seed=rank + 7, world_size=world_size)
    checkpoint.seek(0)
    saved = torch.load(checkpoint, weights_only=True)
    model.load_state_dict(saved["state_dict"])
    optimizer.load_state_dict(saved["optimizer"])
    resumed = _apex_imagenet_iterations(model, optimizer, rank, world_size, 3, 3)
    got = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    rank0 = got.clone()
    dist.broadcast(rank0, 0)
    assert resumed == straight
    assert torch.equal(got, want) and torch.equal(got, rank0)


def _integer_batches(world_size):
    """Micro-batches of small integers for a Linear with eighths for weights: every product and sum is exact in
    fp16, so two ranks on half batches must match one process on the whole batch bit for bit."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(-1, 2, (4 * world_size, 4), generator=g).float() for _ in range(4)]


def _eighths_linear():
    layer = torch.nn.Linear(4, 2)
    with torch.no_grad():
        for i, p in enumerate(layer.parameters()):
            p.copy_(torch.arange(p.numel()).reshape(p.shape).remainder(7).sub(3 - i).div(8))
    return layer


def _train_accumulating(opt_level, batches, wrap=None, sync="every", **amp_options):
    """timm's accumulation loop on the Apex API: 2 micro-batches per step, ``model.no_sync()`` around the first
    when the model has it (``sync="no_sync"``), or Apex's ``disable_allreduce`` (``sync="disable"``)."""
    from ampkit.compat import amp

    model = _eighths_linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.25)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, loss_scale=64.0, verbosity=0,
                                      **amp_options)  # fmt: skip
    net = wrap(model) if wrap is not None else model
    for step in range(2):
        for micro in range(2):
            last = micro == 1
            x = batches[2 * step + micro]
            if sync == "disable":
                net.enable_allreduce() if last else net.disable_allreduce()
            use_no_sync = sync == "no_sync" and hasattr(net, "no_sync") and not last
            with net.no_sync() if use_no_sync else contextlib.nullcontext():
                loss = net(x.to(next(model.parameters()).dtype)).float().pow(2).mean() / 2
                with amp.scale_loss(loss, optimizer) as scaled:
                    scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in [*amp.master_params(optimizer), *model.parameters()]]


def _check_accumulation_matches_one_process_on_the_doubled_batch(rank, world_size):
    # Apex's DDP had no no_sync: timm (no_sync when present) and plain loops all-reduced every micro-batch, and
    # amp's stash then adds averaged gradients. Equal to one process on the whole batch, bit for bit.
    whole = _integer_batches(world_size)
    mine = [b[rank * 4 : (rank + 1) * 4] for b in whole]
    failures = []
    for opt_level in ("O1", "O2"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # disable_allreduce under amp warns that it reduces anyway
            runs = {f"{sync}{' delayed' if delay else ''}": _train_accumulating(opt_level, mine, functools.partial(
                        DistributedDataParallel, delay_allreduce=delay), sync)
                    for sync in ("every", "no_sync", "disable") for delay in (False, True)}  # fmt: skip
        expected = _train_accumulating(opt_level, whole)
        for sync, got in runs.items():
            if not all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)):
                failures.append(f"{opt_level} {sync}")
    # combine_grad's flat gradient buffers under the delayed allreduce.
    delayed = functools.partial(DistributedDataParallel, delay_allreduce=True)
    got = _train_accumulating("O1", mine, delayed, combine_grad=True)
    if not all(
        torch.equal(a, b) for a, b in zip(got, _train_accumulating("O1", whole, combine_grad=True), strict=True)
    ):
        failures.append("O1 combine_grad delayed")
    assert not failures, f"differ from one process on the doubled batch: {failures}"


def _check_torch_ddp_no_sync_accumulation_matches_one_process(rank, world_size):
    # Lightning's accumulate_grad_batches and ClassyVision's simulated batch wrap the first micro-batches in torch
    # DDP's no_sync(). scale_loss stashes those rank-local gradients before the synced backward, which then averaged
    # only its own micro-batch: the ranks drifted apart (under Apex too). Bit for bit one process on the whole batch.
    whole = _integer_batches(world_size)
    mine = [b[rank * 4 : (rank + 1) * 4] for b in whole]
    failures = []
    for opt_level, options in (("O1", {}), ("O2", {}), ("O1", {"combine_grad": True})):
        got = _train_accumulating(opt_level, mine, torch.nn.parallel.DistributedDataParallel, "no_sync", **options)
        expected = _train_accumulating(opt_level, whole, **options)
        if not all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)):
            failures.append(f"{opt_level} {options}")
    assert not failures, f"differ from one process on the doubled batch: {failures}"


def _check_torch_ddp_no_sync_overflow_on_one_rank_skips_on_every_rank(rank, world_size):
    # An inf in rank 0's no_sync micro-batch reaches rank 1 only through the averaged gradients: rank 1 must back off
    # and skip as rank 0 does, or the scales and then the weights differ for good.
    from ampkit.compat import amp

    model = _eighths_linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.25)
    # A dynamic scale low enough that only the inf overflows (65536 overflows these fp16 gradients by itself).
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", max_loss_scale=2.0**10, verbosity=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    start = [p.detach().clone() for p in model.parameters()]
    after_step = []
    for step in range(2):
        for micro in range(2):
            x = torch.ones(2, 4)
            if step == 0 and micro == 0 and rank == 0:
                x[0, 0] = float("inf")
            with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                with amp.scale_loss(ddp(x).float().pow(2).mean(), optimizer) as scaled:
                    scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
        after_step.append([p.detach().clone() for p in model.parameters()])
    mine = torch.cat(
        [*(t.flatten() for t in after_step[-1]), torch.tensor([amp.state_dict()["loss_scaler0"]["loss_scale"]])]
    )
    theirs = mine.clone()
    dist.broadcast(theirs, 0)
    drift = (mine - theirs).abs().max()
    dist.all_reduce(drift, op=dist.ReduceOp.MAX)
    assert drift.item() == 0, f"replicas (weights, loss scale) differ from rank 0 by {drift.item():.3g}"
    assert all(torch.equal(a, b) for a, b in zip(after_step[0], start, strict=True)), "the overflowed step was taken"
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**9


def _check_disable_allreduce_under_amp_warns_and_reduces(rank, world_size):
    from ampkit.compat import amp

    model, optimizer = amp.initialize(_eighths_linear(), torch.optim.SGD([torch.zeros(1)], lr=0.1), verbosity=0,
                                      opt_level="O1", loss_scale=64.0)  # fmt: skip
    ddp = DistributedDataParallel(model)
    ddp.disable_allreduce()
    with pytest.warns(UserWarning, match="every micro-batch is all-reduced"):
        ddp(torch.ones(2, 4)).float().sum().backward()  # the first backward reduces at its end, as Apex's did
    ddp(torch.ones(2, 4))  # then torch's reducer, synced though the switch is off
    assert not hasattr(ddp, "no_sync") and ddp.require_backward_grad_sync
    # Apex's reducer attributes, which scripts read (world_size as a float, the accumulation switch, ...)
    assert (ddp.world_size, ddp._disable_allreduce, ddp.delay_allreduce) == (float(world_size), True, False)
    assert (ddp.gradient_average, ddp.gradient_predivide_factor, ddp.allreduce_always_fp32) == (True, 1.0, False)
    assert (ddp.message_size, ddp.retain_allreduce_buffers, ddp.num_allreduce_streams) == (10_000_000, False, 1)


def _check_ddp_subclass_reduces_through_its_own_allreduce_bucket(rank, world_size):
    # A hierarchical trainer's subclass (HiT's ``_HiT_APEX_DDP``) overrides ``allreduce_bucket`` to all-reduce over its
    # own group (here one group per rank: the gradients stay local) and divide by that group's size. ampkit's class
    # reduced over the world by itself and never called it, averaging what the script kept apart.
    groups = [dist.new_group([r]) for r in range(world_size)]  # every rank makes every group, as torch asks
    calls = []

    class OwnGroupDDP(DistributedDataParallel):
        def __init__(self, module, delay_allreduce=False, process_group=None):
            super().__init__(module, delay_allreduce=delay_allreduce)
            self.process_group = process_group
            self.world_size = float(dist.get_world_size(group=process_group))

        def allreduce_bucket(self, bucket, bucket_idx, force_default_stream):  # Apex's signature, on CPU
            calls.append((len(bucket), force_default_stream))
            tensor = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(tensor, group=self.process_group)
            tensor.mul_(1.0 / self.world_size)
            for grad, synced in zip(bucket, tensor.split([g.numel() for g in bucket]), strict=True):
                grad.copy_(synced.view_as(grad))
            return tensor

    class OlderOwnGroupDDP(OwnGroupDDP):
        def allreduce_bucket(self, bucket):  # Apex's older signature: its caller copied the result into the grads
            calls.append((len(bucket), None))
            tensor = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(tensor, group=self.process_group)
            return tensor.mul_(1.0 / self.world_size)

    torch.manual_seed(0)
    base = torch.nn.Linear(4, 2)
    local = copy.deepcopy(base)
    local(_rank_data(rank)[0]).pow(2).sum().backward()
    results = []
    for cls, delay in ((OwnGroupDDP, False), (OwnGroupDDP, True), (OlderOwnGroupDDP, False)):
        model = copy.deepcopy(base)
        ddp = cls(model, delay_allreduce=delay, process_group=groups[rank])
        for _ in range(2):  # the first backward reduces at its end, later ones in torch's reducer (not delayed)
            model.zero_grad()
            ddp(_rank_data(rank)[0]).pow(2).sum().backward()
            results.append([p.grad.clone() for p in model.parameters()])
    assert [force for _, force in calls] == [True, False, True, True, None, None] and all(n == 2 for n, _ in calls)
    for grads in results:
        for got, want in zip(grads, (p.grad for p in local.parameters()), strict=True):
            torch.testing.assert_close(got, want, msg="the subclass's allreduce_bucket kept each rank's own gradient")


def _check_ddp_allreduce_bucket_set_on_the_instance_after_construction(rank, world_size):
    # Apex looked ``self.allreduce_bucket`` up at each bucket, so a script that sets its own on the instance after
    # wrapping (``ddp.allreduce_bucket = fn``, to reduce over its own group) had it called from then on; ampkit's
    # class decided at construction and averaged over the world. Here fn keeps each rank's gradient (a one-rank group).
    own_group = [dist.new_group([r]) for r in range(world_size)][rank]
    calls = []

    def keep_local(bucket, bucket_idx, force_default_stream):  # unbound: Apex called the instance's attribute
        calls.append(force_default_stream)
        tensor = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(tensor, group=own_group)
        return tensor

    def keep_local_older(bucket):  # Apex's older signature
        calls.append(None)
        return keep_local(bucket, 0, None)

    torch.manual_seed(0)
    base = torch.nn.Linear(4, 2)
    local = copy.deepcopy(base)
    local(_rank_data(rank)[0]).pow(2).sum().backward()
    averaged = copy.deepcopy(base)
    for options in ({}, {"gradient_predivide_factor": 2.0}):  # without a comm hook of its own, then with Apex's
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, **options)
        for step in range(4):  # a first backward reducing at its end, then torch's reducer
            if step == 2:
                ddp.allreduce_bucket = keep_local if not options else keep_local_older
            model.zero_grad()
            ddp(_rank_data(rank)[0]).pow(2).sum().backward()
            if step == 1:
                averaged.load_state_dict({"weight": model.weight.grad, "bias": model.bias.grad})
        for got, want in zip(model.parameters(), local.parameters(), strict=True):
            torch.testing.assert_close(got.grad, want.grad, msg="the allreduce_bucket set later was not called")
    assert calls == [False, False] + [None, None] * 2  # the reducer's buckets; the older one calls the other
    assert not torch.equal(averaged.weight, local.weight.grad)  # before the assignment the ranks were averaged


_TWO_RANK_CHECKS = {
    check.__name__.removeprefix("_check_"): check
    for check in (
        _check_ddp_reduction_options,
        _check_ddp_sum_stays_predivided,
        _check_ddp_always_fp32_sums_half_gradients_in_float32,
        _check_ddp_keeps_rank_local_buffers,
        _check_reducer_broadcasts_parameters_only,
        _check_reducer_of_a_module_averages_a_gradient_only_some_ranks_have,
        _check_sync_batchnorm_matches_full_batch,
        _check_sync_batchnorm_keeps_float64,
        _check_sync_batchnorm_function_with_statistics_reduced_by_hand_matches_full_batch,
        _check_sync_batchnorm_eval_without_running_stats_syncs,
        _check_ddp_disable_and_enable_allreduce,
        _check_syncbn_process_groups,
        _check_o2_masters_stay_identical_across_ranks,
        _check_apex_imagenet_example_resumes_exactly_and_keeps_the_ranks_equal,
        _check_ddp_delay_allreduce_with_an_unused_parameter,
        _check_ddp_takes_a_module_frozen_whole,
        _check_ddp_takes_a_module_without_parameters,
        _check_ddp_default_mode_with_a_layer_the_forward_never_uses,
        _check_ddp_with_a_branch_only_some_ranks_use,
        _check_ddp_default_mode_leaves_sparse_embeddings_to_torchs_reducer,
        _check_ddp_sum_reduces_each_gradient_once_per_forward,
        _check_ddp_reduces_both_backwards_of_a_reentrant_checkpoint,
        _check_ddp_reduces_a_layer_unfrozen_after_construction,
        _check_ddp_delay_allreduce_flattens_each_dtype,
        _check_ddp_retains_allreduce_buffers_for_a_flat_step,
        _check_ddp_reduces_at_the_end_of_backward_whatever_the_forward_returns,
        _check_accumulation_matches_one_process_on_the_doubled_batch,
        _check_disable_allreduce_under_amp_warns_and_reduces,
        _check_torch_ddp_no_sync_accumulation_matches_one_process,
        _check_torch_ddp_no_sync_overflow_on_one_rank_skips_on_every_rank,
        _check_flat_dist_call_broadcasts_and_averages_each_type,
        _check_reducer_of_a_grads_list_takes_the_tensors_in_it_as_apex,
        _check_ddp_subclass_reduces_through_its_own_allreduce_bucket,
        _check_ddp_allreduce_bucket_set_on_the_instance_after_construction,
    )
}


def _reset_amp():
    """Leave amp uninitialized for the next check, as a fresh process would be (undoing O1's patches)."""
    from ampkit.compat import amp

    amp.initialize(torch.nn.Linear(1, 1), opt_level="O0", verbosity=0)
    amp._amp_state.reset()


def _worker(rank, world_size, init_file, report_dir):
    """Run every two-rank check in one gloo group (one spawn keeps the tests fast); record each failure."""
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=30)
    )
    failures = {}
    try:
        for name, check in _TWO_RANK_CHECKS.items():
            try:
                check(rank, world_size)  # asserts only after its collectives, so a failure leaves ranks in step
            except Exception:
                failures[name] = traceback.format_exc(limit=-3)
            _reset_amp()
            # DDP's reducer holds the process group (its comm hook makes a reference cycle): free it now, with the
            # interpreter alive, not in finalization, where gloo's teardown can abort the process (SIGABRT).
            gc.collect()
            dist.barrier()  # in step: a rank exiting while its peer still runs gloo work can abort it
    finally:
        dist.destroy_process_group()
        gc.collect()
        Path(report_dir, f"rank{rank}.json").write_text(json.dumps(failures))


@pytest.fixture(scope="module")
def two_rank_failures(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gloo")
    with pytest.MonkeyPatch.context() as env:  # for these ranks only: later child processes keep their own threads
        env.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
        mp.spawn(_worker, args=(2, str(tmp / "init"), str(tmp)), nprocs=2, join=True)
    return [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("check", list(_TWO_RANK_CHECKS))
def test_two_process_gloo(check, two_rank_failures):
    failures = [f"rank {rank}:\n{failed[check]}" for rank, failed in enumerate(two_rank_failures) if check in failed]
    assert not failures, "\n".join(failures)


def test_larc_zero_grad_without_an_argument_is_the_wrapped_optimizers_own():
    """Apex's LARC called ``optim.zero_grad()``: a fused optimizer built with ``set_grad_none=False`` zeroed in place
    under it, where LARC's own default of True dropped the gradients."""
    from ampkit.compat.optimizers import FusedSGD

    param = torch.nn.Parameter(torch.ones(3))
    larc = LARC(FusedSGD([param], lr=0.1, set_grad_none=False))
    param.grad = grad = torch.ones(3)
    larc.zero_grad()
    assert param.grad is grad and not grad.any()
    larc.zero_grad(set_to_none=True)
    assert param.grad is None


def test_larc_goes_through_amp_initialize_and_scale_loss():
    from ampkit.compat import amp

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = LARC(torch.optim.SGD(model.parameters(), lr=0.1))
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    assert all(p.dtype == torch.float32 for p in amp.master_params(optimizer))
    before = model.weight.detach().clone()
    with amp.scale_loss(model(torch.randn(3, 4)).float().pow(2).mean(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert model.weight.dtype == torch.float16 and not torch.equal(model.weight, before)


def test_channel_last_normalizes_over_the_last_dimension_as_apex():
    """Apex's ``SyncBatchNorm(100, channel_last=True)`` took a (10, 14, 14, 100) input: channels last, whatever
    the other sizes are."""
    bn = SyncBatchNorm(5, channel_last=True)
    x = torch.randn(4, 3, 6, 5) * 3 + 1
    out = bn(x)
    assert out.shape == x.shape
    per_channel = out.reshape(-1, 5)
    torch.testing.assert_close(per_channel.mean(0), torch.zeros(5), atol=1e-5, rtol=0)
    torch.testing.assert_close(per_channel.var(0, unbiased=False), torch.ones(5), atol=1e-3, rtol=0)
    torch.testing.assert_close(bn.running_mean, 0.1 * x.reshape(-1, 5).mean(0))


def test_apex_parallel_names_and_module_paths():
    """Names legacy code imports from apex.parallel, and the fused SyncBatchNorm's module path."""
    from ampkit.compat import install_apex_shim, uninstall_apex_shim

    install_apex_shim()
    try:
        from apex.parallel import ReduceOp
        from apex.parallel.optimized_sync_batchnorm import SyncBatchNorm as OptimizedSyncBatchNorm

        assert ReduceOp is torch.distributed.ReduceOp and OptimizedSyncBatchNorm is SyncBatchNorm
    finally:
        uninstall_apex_shim()
    bn = SyncBatchNorm(3)
    bn._specify_channel_last(True)
    assert bn.channel_last
