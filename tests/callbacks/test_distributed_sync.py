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
