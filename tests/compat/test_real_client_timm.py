"""A real Apex client: timm's training loop (``timm==1.0.31`` from PyPI, as its users install it) run through
``python -m ampkit.legacy`` on CPU, checked against timm's native torch path, its own resume and 2-rank DDP.

timm needs torchvision; where none loads with this torch (PyPI has no CPU torchvision for a CPU-only torch),
timm is not importable and these tests skip, saying so.
"""

import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

TIMM_VERSION = "1.0.31"
CLIENT = Path(__file__).resolve().parent / "real_clients" / "timm_train_loop.py"
pytestmark = pytest.mark.slow  # each run starts Python, torch and timm (several seconds on 2 cores)


@functools.cache
def _timm_unavailable() -> str | None:
    """Why timm cannot run here, or None (imported in a child: a broken torchvision fails at import)."""
    probe = subprocess.run([sys.executable, "-c", "import timm.utils, timm.optim; print(timm.__version__)"],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"timm is not importable ({last}); install timm=={TIMM_VERSION} with a torchvision built for this torch"
    return None


@pytest.fixture
def timm_client():
    reason = _timm_unavailable()
    if reason:
        pytest.skip(reason)


def _run(out: Path, *args: str, legacy: bool = True, nproc: int = 1) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    entry = ["-m", "ampkit.legacy", str(CLIENT)] if legacy else [str(CLIENT)]
    if nproc > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        launcher = ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={port}"]
        command = [sys.executable, *launcher, *entry, str(out), *args]
    else:
        command = [sys.executable, *entry, str(out), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "find_unused_parameters" not in done.stderr, done.stderr[-3000:]  # no graph-walk warning from torch
    return [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in range(nproc)]


def test_apex_path_resumes_exactly_and_agrees_with_timms_native_path(tmp_path, timm_client):
    (whole,) = _run(tmp_path / "whole", "--updates=4", "--save-after=2", "--clip-grad=1.0")
    (resumed,) = _run(tmp_path / "resumed", "--updates=4", f"--resume={tmp_path / 'whole'}.ckpt", "--clip-grad=1.0")
    # timm's resume_checkpoint restores weights, FusedAdam's state and amp's scaler: the run continues bit for bit.
    assert resumed["losses"] == whole["losses"][2:]
    assert (resumed["checksum"], resumed["abs_sum"]) == (whole["checksum"], whole["abs_sum"])
    assert resumed["loss_scale"] == whole["loss_scale"]
    # timm's native path (torch.autocast, torch's AdamW) trains the same model to the same losses, up to fp16.
    (native,) = _run(tmp_path / "native", "--updates=4", "--amp-impl=native", "--opt=adamw", "--clip-grad=1.0",
                     legacy=False)  # fmt: skip
    assert native["losses"] == pytest.approx(whole["losses"], rel=5e-3)
    assert native["abs_sum"] == pytest.approx(whole["abs_sum"], rel=1e-4)


def test_apex_ddp_with_accumulation_and_sync_bn_keeps_ranks_identical(tmp_path, timm_client):
    # timm calls model.no_sync() when the model has it; Apex's DDP (delay_allreduce=True, as timm passes) has not.
    rank0, rank1 = _run(tmp_path / "ddp", "--updates=2", "--grad-accum-steps=2", "--sync-bn", "--clip-grad=1.0",
                        nproc=2)  # fmt: skip
    assert (rank0["checksum"], rank0["abs_sum"]) == (rank1["checksum"], rank1["abs_sum"])
    assert rank0["loss_scale"] == rank1["loss_scale"]
