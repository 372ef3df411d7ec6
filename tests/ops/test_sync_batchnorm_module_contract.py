"""The contracts of ``nn.BatchNorm2d`` that code converting a model with ``convert_sync_batchnorm`` relies on, held by
ampkit's ``SyncBatchNorm`` in one process (no process group: it is a batch norm there, as torch's): training and
eval statistics, layouts, deferred init, state dicts, copies, derivatives, ``vmap``, ``torch.compile``,
``torch.export`` and autocast. The statistics across ranks are ``tests/test_distributed.py``'s."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.func import functional_call, vmap

from ampkit.compat.parallel import SyncBatchNorm as ApexSyncBatchNorm
from ampkit.compat.parallel import convert_syncbn_model
from ampkit.ops import SyncBatchNorm, convert_sync_batchnorm

BATCH_NORMS = {
    "affine": {},
    "no_affine": {"affine": False},
    "cumulative_average": {"momentum": None},
    "no_running_stats": {"track_running_stats": False},
}


def batch_norm_pair(options, dtype=torch.float64, cls=SyncBatchNorm):
    ours, theirs = cls(3, dtype=dtype, **options), nn.BatchNorm2d(3, dtype=dtype, **options)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(0), dtype=dtype) + 0.5)
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def images(n=4, seed=1, dtype=torch.float64):
    return torch.randn(n, 3, 5, 4, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def forward_backward(module, x, dy):
    """Output, and gradients of the input and of each parameter that asks for one."""
    x = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()
    y = module(x)
    params = [p for p in module.parameters() if p.requires_grad]
    return y, torch.autograd.grad(y, [x, *params], dy)


def assert_same_maths(ours, theirs, x):
    """The same output and gradients as torch's module on ``x``; returns ours."""
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(7), dtype=x.dtype)
    (y, grads), (y_ref, grads_ref) = forward_backward(ours, x, dy), forward_backward(theirs, x, dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    return y


@pytest.mark.parametrize("cls", [SyncBatchNorm, ApexSyncBatchNorm], ids=["ampkit", "apex"])
@pytest.mark.parametrize("options", BATCH_NORMS.values(), ids=BATCH_NORMS)
def test_sync_batch_norm_alone_trains_and_evaluates_as_batch_norm_2d(options, cls):
    """Three training steps (running statistics), eval, and a channels-last input, against torch's module."""
    ours, theirs = batch_norm_pair(options, cls=cls)
    for step in range(3):
        layout = torch.channels_last if step == 1 else torch.contiguous_format
        x = images(seed=step).to(memory_format=layout)
        y = assert_same_maths(ours, theirs, x)
        assert y.is_contiguous(memory_format=layout)  # as torch's batch norm keeps it
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=1e-12, atol=1e-12)
    ours.eval()
    theirs.eval()
    assert_same_maths(ours, theirs, images(seed=9))


@pytest.mark.parametrize("cls", [SyncBatchNorm, ApexSyncBatchNorm], ids=["ampkit", "apex"])
@pytest.mark.parametrize("options", BATCH_NORMS.values(), ids=BATCH_NORMS)
def test_sync_batch_norm_construction_state_and_copies_are_batch_norms(options, cls):
    """``apex.parallel.SyncBatchNorm(..., device=, dtype=)`` was a TypeError (Apex's signature has neither)."""
    built = cls(3, device="meta", dtype=torch.float64, **options)
    assert all(t.is_meta and t.dtype in (torch.float64, torch.long) for t in (*built.parameters(), *built.buffers()))
    with torch.device("meta"):
        deferred = cls(3, **options)
    deferred.to_empty(device="cpu")
    deferred.reset_parameters()
    fresh = nn.BatchNorm2d(3, **options)
    assert deferred.state_dict().keys() == fresh.state_dict().keys()
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(deferred.state_dict()[key], value, rtol=0, atol=0)
    ours, theirs = batch_norm_pair(options, cls=cls)
    assert ours.extra_repr() == theirs.extra_repr()
    nn.BatchNorm2d(3, dtype=torch.float64, **options).load_state_dict(ours.state_dict(), strict=True)
    x = images()
    twin = pickle.loads(pickle.dumps(ours.eval()))
    torch.testing.assert_close(twin(x), ours(x), rtol=0, atol=0)
    torch.testing.assert_close(copy.deepcopy(ours)(x), ours(x), rtol=0, atol=0)


@pytest.mark.parametrize("training", [True, False])
def test_sync_batch_norm_gradcheck_gradgradcheck_and_vmap_as_batch_norm(training):
    ours, theirs = batch_norm_pair({"track_running_stats": not training})
    ours.train(training)
    theirs.train(training)
    x = images(n=2).requires_grad_()
    names = [k for k, _ in ours.named_parameters()]

    def run(x, *given):
        return functional_call(ours, dict(zip(names, given, strict=True)), (x,))

    assert torch.autograd.gradcheck(run, (x, *ours.parameters()))
    assert torch.autograd.gradgradcheck(run, (x, *ours.parameters()))
    batched = images(n=6).reshape(3, 2, 3, 5, 4)
    torch.testing.assert_close(vmap(ours)(batched), vmap(theirs)(batched))


def test_sync_batch_norm_under_vmap_refuses_running_statistics_as_batch_norm_does():
    ours, theirs = batch_norm_pair({})
    batched = images(n=6).reshape(3, 2, 3, 5, 4)
    for module in (ours, theirs):
        with pytest.raises(RuntimeError, match="running_mean or running_var"):
            vmap(module)(batched)


def test_sync_batch_norm_compiles_exports_and_keeps_float32_under_autocast_as_batch_norm():
    ours, theirs = batch_norm_pair({}, dtype=torch.float32)
    x = images(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ours(x).dtype == theirs(x).dtype == torch.float32
    torch._dynamo.reset()
    eager = copy.deepcopy(ours)
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    y, grads = forward_backward(compiled, x, torch.ones_like(x))
    y_eager, grads_eager = forward_backward(eager, x, torch.ones_like(x))
    torch.testing.assert_close(y, y_eager)
    for got, want in zip(grads, grads_eager, strict=True):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(ours.running_mean, eager.running_mean)  # the compiled step updated its statistics
    exported = torch.export.export(ours.eval(), (x,))
    torch.testing.assert_close(exported.module()(x), ours(x))


@pytest.mark.parametrize("training", [True, False])
def test_sync_batch_norm_takes_a_zero_size_batch_as_batch_norm_does(training):
    ours, theirs = batch_norm_pair({})
    ours.train(training)
    theirs.train(training)
    assert assert_same_maths(ours, theirs, images(n=0)).shape == (0, 3, 5, 4)
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=0, atol=0)


@pytest.mark.parametrize("cls", [SyncBatchNorm, ApexSyncBatchNorm])
def test_an_input_of_other_channels_is_named_before_the_batch_counts(cls):
    """torch's 'running_mean should contain 3 elements not 4' named neither the layer nor its channels, and the
    failed batch was counted in num_batches_tracked (momentum=None's average then divided by one batch too many)."""
    layer = cls(4, momentum=None)
    with pytest.raises(RuntimeError, match=r"SyncBatchNorm\(4\) got an input of 3 channels \(shape \[2, 3, 5\]\)"):
        layer(torch.randn(2, 3, 5))
    assert int(layer.num_batches_tracked) == 0
    if cls is ApexSyncBatchNorm:  # Apex's channel_last: named as laid out, not as moved to dimension 1
        layer = cls(4, channel_last=True)
        with pytest.raises(RuntimeError, match=r"channel_last=True\) got an input of 5 channels \(shape \[2, 3, 5\]\)"):
            layer(torch.randn(2, 3, 5))


def test_a_layer_without_per_channel_state_takes_any_channel_count_as_torchs_does():
    """``affine=False, track_running_stats=False`` holds nothing per channel: torch's batch norm normalizes an input
    of any channel count, and so does ours, with the same values."""
    ours = SyncBatchNorm(4, affine=False, track_running_stats=False)
    theirs = torch.nn.BatchNorm1d(4, affine=False, track_running_stats=False)
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-12)


def test_eps_0_is_refused_where_batch_statistics_normalize_and_taken_on_running_ones():
    """torch's BatchNorm takes eps=0 and its training forward fails with 'batch_norm eps must be positive' naming no
    layer; the synced path divided a channel of equal values by 0. Evaluation on running statistics serves it."""
    layer = SyncBatchNorm(3, eps=0.0)
    with pytest.raises(ValueError, match=r"SyncBatchNorm: eps=0.0 must be > 0 to normalize by batch statistics"):
        layer(torch.randn(4, 3))
    assert int(layer.num_batches_tracked) == 0
    assert torch.isfinite(layer.eval()(torch.randn(4, 3))).all()
    with pytest.raises(ValueError, match=r"eps=0.0 must be > 0"):  # no running statistics: batch ones, in eval too
        SyncBatchNorm(3, eps=0.0, track_running_stats=False).eval()(torch.randn(4, 3))


@pytest.mark.parametrize(
    ("convert", "where"),
    [
        (convert_sync_batchnorm, "convert_sync_batchnorm"),
        (SyncBatchNorm.convert_sync_batchnorm, "SyncBatchNorm.convert_sync_batchnorm"),
        (convert_syncbn_model, "convert_syncbn_model"),
    ],
)
def test_a_conversion_of_no_module_or_with_no_process_group_names_the_argument(convert, where):
    """A string for the model was "'str' object has no attribute 'parameters'"; a string for the group was taken by
    every converted layer, to fail only in its first synced forward's collective."""
    with pytest.raises(TypeError, match=rf"^{where}: module must be a torch.nn.Module, got str"):
        convert("model")
    model = nn.Sequential(nn.BatchNorm1d(3))
    with pytest.raises(TypeError, match=rf"^{where}: process_group must be None \(every rank\) or a torch.distributed"):
        convert(model, process_group="group")
    assert type(model[0]) is nn.BatchNorm1d  # refused before any layer was replaced
    assert isinstance(convert(model)[0], SyncBatchNorm)
    with pytest.raises(TypeError, match=r"^SyncBatchNorm: process_group must be None \(every rank\) or a torch"):
        SyncBatchNorm(3, process_group="group")
