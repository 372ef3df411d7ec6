"""apex.parallel on torch.distributed: LARC maths, convert_syncbn_model, and 2-process gloo runs of
DistributedDataParallel (Apex's reduction options) and the CPU SyncBatchNorm."""

import gc
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ampkit.compat.parallel import LARC, DistributedDataParallel, SyncBatchNorm, convert_syncbn_model


@pytest.mark.parametrize("clip", [True, False])
def test_larc_scales_each_gradient_by_its_trust_ratio(clip):
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    lr, wd, trust, eps = 0.1, 1e-2, 0.02, 1e-8
    optimizer = LARC(torch.optim.SGD(model.parameters(), lr=lr, weight_decay=wd), trust_coefficient=trust, clip=clip)
    model(torch.randn(4, 5)).pow(2).sum().backward()
    expected = []
    for p in model.parameters():
        w_norm, g_norm = p.detach().norm(), p.grad.norm()
        local = trust * w_norm / (g_norm + w_norm * wd + eps)
        if clip:
            local = min(local / lr, 1.0)
        expected.append(p.detach() - lr * local * (p.grad + wd * p.detach()))
    optimizer.step()
    for p, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.detach(), want)
    assert optimizer.param_groups[0]["weight_decay"] == wd  # restored after the step


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
    torch.testing.assert_close(new_bn(x), torch.nn.functional.batch_norm(x, None, None, bn.weight, bn.bias, True))
    fused = SyncBatchNorm(4, fuse_relu=True)
    z = torch.randn_like(x)
    expected = torch.relu(torch.nn.functional.batch_norm(x, None, None, training=True) + z)
    torch.testing.assert_close(fused(x, z), expected)


def test_ddp_rejects_shared_param():
    with pytest.raises(ValueError, match="shared_param"):
        DistributedDataParallel(torch.nn.Linear(2, 2), shared_param=True)


def _rank_data(rank):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(6, 4, generator=g), torch.randn(6, 4, 3, generator=g)


def _worker(rank, world_size, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        base = torch.nn.Linear(4, 2)
        # Reference gradients of each rank's loss, computed locally.
        per_rank = []
        for r in range(world_size):
            model = torch.nn.Linear(4, 2)
            model.load_state_dict(base.state_dict())
            model(_rank_data(r)[0]).pow(2).sum().backward()
            per_rank.append([p.grad.clone() for p in model.parameters()])
        mean = [sum(g) / world_size for g in zip(*per_rank, strict=True)]
        total = [sum(g) for g in zip(*per_rank, strict=True)]
        cases = [
            (dict(), mean),
            (dict(gradient_predivide_factor=2.0, allreduce_always_fp32=True), mean),
            (dict(gradient_average=False), total),
            (dict(delay_allreduce=True, message_size=1), mean),
        ]
        for kwargs, want in cases:
            model = torch.nn.Linear(4, 2)
            model.load_state_dict(base.state_dict())
            ddp = DistributedDataParallel(model, **kwargs)
            ddp(_rank_data(rank)[0]).pow(2).sum().backward()
            for p, w in zip(model.parameters(), want, strict=True):
                torch.testing.assert_close(p.grad, w, msg=f"DDP grads wrong with {kwargs}")

        # SyncBatchNorm on CPU: statistics (and their gradients) over both ranks' halves of a batch.
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
        del ddp, model
        # DDP's reducer holds the process group (its comm hook makes a reference cycle): free it now, with the
        # interpreter alive, not in finalization, where gloo's teardown can abort the process (SIGABRT).
        gc.collect()
        dist.barrier()  # leave together: a rank exiting while its peer still runs gloo work can abort it
    finally:
        dist.destroy_process_group()
        gc.collect()


def test_two_process_gloo_ddp_options_and_cpu_sync_batchnorm(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(2, str(tmp_path / "init")), nprocs=2, join=True)


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
