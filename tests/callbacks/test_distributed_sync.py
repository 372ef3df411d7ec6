"""DistributedSync's account of a failed collective: which pass was running when it failed. A fit's validation runs
in the fit's stage, so the stage alone would call a rank lost during validation a failure "during training"."""

from __future__ import annotations

import types

import pytest
import torch.distributed as dist

from ampkit.callbacks import distributed as sync_module
from ampkit.callbacks.distributed import DistributedSync
from ampkit.trainer.distributed import DistributedError


def _where_it_failed(monkeypatch, stage: str, before=()) -> str:
    said = []
    monkeypatch.setattr(sync_module, "diagnose_failure", lambda what, exc, wait_s: said.append(what) or exc)
    sync, trainer = DistributedSync(), types.SimpleNamespace(state=types.SimpleNamespace(stage=stage))
    for hook, *args in before:
        getattr(sync, hook)(trainer, *args)
    lost = dist.DistError("gloo: Connection closed by peer")
    with pytest.raises(dist.DistError):
        sync.on_exception(trainer, lost)
    return said[0]


@pytest.mark.parametrize(
    ("stage", "before", "where"),
    [
        ("fit", (), "a collective during training"),
        ("sanity", [("on_validation_start",)], "a collective during validation"),
        ("sanity", (), "a collective during validation before training"),
        ("fit", [("on_validation_start",)], "a collective during validation"),
        ("fit", [("on_validation_start",), ("on_validation_end", {})], "a collective during training"),
        ("fit", [("on_test_start",)], "a collective during test"),
        ("fit", [("on_test_start",), ("on_test_end", {})], "a collective during training"),
        ("predict", [("on_predict_start",)], "a collective during prediction"),
        ("predict", [("on_predict_start",), ("on_predict_end", [])], "a collective during training"),
    ],
)
def test_a_failed_collective_names_the_pass_that_was_running(monkeypatch, stage, before, where):
    assert _where_it_failed(monkeypatch, stage, before) == where


def test_an_already_diagnosed_failure_is_not_diagnosed_again(monkeypatch):
    monkeypatch.setattr(sync_module, "diagnose_failure", lambda *a: pytest.fail("diagnosed twice"))
    trainer = types.SimpleNamespace(state=types.SimpleNamespace(stage="fit"))
    assert DistributedSync().on_exception(trainer, DistributedError("rank 1: ...")) is None


class _DDPBuffers:
    """What DistributedSync reads of DDP's buffer sync: DDP syncs buffers at a forward while
    ``require_forward_param_sync`` is on (a training forward turns it on again)."""

    def __init__(self, has_buffers: bool) -> None:
        self.has_buffers, self.require_forward_param_sync, self.synced = has_buffers, True, 0

    def will_sync_module_buffers(self) -> bool:
        return self.require_forward_param_sync and self.has_buffers

    def _sync_buffers(self) -> None:
        self.synced += 1


@pytest.mark.parametrize("start", ["on_validation_start", "on_test_start", "on_predict_start"])
def test_every_rank_syncs_the_buffers_at_an_evaluation_s_start_and_ddp_syncs_none_in_its_forwards(start):
    """A rank with no evaluation batch never ran the first forward where DDP broadcast the buffers, and the others
    waited there until the timeout: each pass's start syncs them on every rank, once, and tells DDP not to."""
    trainer = types.SimpleNamespace(state=types.SimpleNamespace(stage="fit"))
    sync = DistributedSync()
    sync._ddp = ddp = _DDPBuffers(has_buffers=True)
    getattr(sync, start)(trainer)
    assert (ddp.synced, ddp.require_forward_param_sync) == (1, False)
    getattr(sync, start)(trainer)  # no training forward since: nothing to sync again
    assert ddp.synced == 1
    sync._ddp = bare = _DDPBuffers(has_buffers=False)  # no buffers (or broadcast_buffers=False): no collective
    getattr(sync, start)(trainer)
    assert (bare.synced, bare.require_forward_param_sync) == (0, True)


def test_sync_batchnorm_keeps_the_compiled_model_it_converts_in_place():
    """``distributed.sync_batchnorm`` with ``trainer.compile: true``: the batch norms are replaced inside the model,
    which the compiled model runs as is; setting ``trainer.model`` to the bare module ran a grad_sync=step fit
    uncompiled, and handed a DDP fit's end the bare module. A model that is one batch norm is compiled anew."""
    import torch
    from omegaconf import OmegaConf

    from ampkit.ops.sync_batchnorm import SyncBatchNorm

    cfg = OmegaConf.create({"trainer": {"compile": True, "compile_mode": "default"}})
    module = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.BatchNorm1d(4))
    compiled = torch.compile(module)
    trainer = types.SimpleNamespace(module=module, model=compiled, cfg=cfg)
    DistributedSync("step", sync_batchnorm=True).on_fit_start(trainer)
    assert trainer.module is module and trainer.model is compiled and isinstance(module[1], SyncBatchNorm)
    alone = torch.nn.BatchNorm1d(4)
    trainer = types.SimpleNamespace(module=alone, model=torch.compile(alone), cfg=cfg)
    DistributedSync("step", sync_batchnorm=True).on_fit_start(trainer)
    assert isinstance(trainer.module, SyncBatchNorm) and trainer.model._orig_mod is trainer.module
