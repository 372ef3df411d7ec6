"""CUDA sync budget: at most one device-to-host read per iteration under O1/O2 fp16, whatever the number of
losses and optimizers, with clipping or without (the per-loss found_inf flags stay on the device until the
Trainer reads them all at once, and a clipping norm is left on the device when those flags cover it).
Counted with ``torch.cuda.set_sync_debug_mode``, which warns at every synchronizing CUDA call."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from toy_trainers import ToyTrainer, toy_cfg, toy_dataset

from ampkit import Callback
from ampkit.ops.optimizers import (
    FusedAdadelta,
    FusedAdagrad,
    FusedAdam,
    FusedRMSprop,
    FusedRMSpropTF,
    FusedSGD,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: counts CUDA synchronizations")

QUIET = {"checkpoint.enabled": False, "logging.tensorboard": False, "trainer.progress_bar": False}
SMALL_SCALE = {"precision.init_scale": 256}  # the toy model overflows fp16 at 2**16: let the steps run


class CudaBatches(ToyTrainer):
    """Batches already on the GPU, so the only host reads are the loop's own."""

    def train_dataloader(self):
        x, y = toy_dataset(64).tensors
        return [(x[i : i + 8].cuda(), y[i : i + 8].cuda()) for i in range(0, 64, 8)]

    def val_dataloader(self):
        return None


class TwoLosses(CudaBatches):
    """Manual optimization: loss "A" reaches both optimizers, loss "B" only the head's."""

    automatic_optimization = False

    def configure_optimizers(self):
        body = torch.optim.Adam(self.module[0].parameters(), lr=1e-3)
        head = torch.optim.Adam(self.module[3].parameters(), lr=1e-3)
        return [{"optimizer": body, "name": "body"}, {"optimizer": head, "name": "head"}]

    def training_step(self, batch):
        x, y = batch
        self.backward((self.model(x).squeeze(1) - y).square().mean(), loss_id="A")
        features = self.module[1](self.module[0](x)).detach()
        self.backward(self.module[3](features).abs().mean(), loss_id="B", optimizer=self.optimizers["head"])
        for optimizer in self.optimizers.values():
            self.step(optimizer)


def sync_sites(caught: list) -> list[str]:
    """Where each synchronizing call came from (the Python line that made it), for a failing count to show."""
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchronizing" in str(w.message)]


class SyncCounter(Callback):
    """Synchronizing CUDA calls per iteration, from the first batch of an iteration to the end of its last."""

    def __init__(self) -> None:
        self.per_iteration: list[int] = []
        self.sites: list[list[str]] = []  # per iteration: the lines that synchronized
        self._caught: list = []
        self._guard: warnings.catch_warnings | None = None

    def on_train_batch_start(self, trainer, batch) -> None:
        if trainer.state.is_iteration_start:
            self._guard = warnings.catch_warnings(record=True)
            self._caught = self._guard.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(self, trainer, outputs, batch) -> None:
        if trainer.state.is_iteration_end:
            torch.cuda.set_sync_debug_mode("default")
            self._guard.__exit__(None, None, None)
            self.sites.append(sync_sites(self._caught))
            self.per_iteration.append(len(self.sites[-1]))

    def on_exception(self, trainer, exception) -> None:
        torch.cuda.set_sync_debug_mode("default")


def test_the_counter_sees_a_host_read():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            torch.ones(1, device="cuda").item()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert any("synchronizing" in str(w.message) for w in caught)


@pytest.mark.parametrize(
    ("trainer_class", "overrides"),
    [
        (TwoLosses, {"precision.opt_level": "O1"}),
        (TwoLosses, {"precision.opt_level": "O2", "precision.cast_modules": "[0,3]"}),
        (CudaBatches, {"precision.opt_level": "O1", "trainer.accumulate_grad_batches": 2}),
        (CudaBatches, {"precision.opt_level": "O2", "precision.combine_grad": True}),
        (CudaBatches, {"precision.opt_level": "O1", "trainer.clip_grad_norm": 0.5}),  # the norm stays on the GPU
        (TwoLosses, {"precision.opt_level": "O1", "trainer.clip_grad_norm": 0.5}),
    ],
)
def test_at_most_one_host_read_per_iteration_fp16(tmp_path, trainer_class, overrides):
    counter = SyncCounter()
    cfg = toy_cfg(tmp_path, **{**QUIET, **SMALL_SCALE, "trainer.device": "cuda", "trainer.max_steps": 4, **overrides})
    trainer_class(cfg, callbacks=[counter]).fit()
    assert len(counter.per_iteration) == 4
    assert counter.per_iteration[1:] == [1, 1, 1], counter.sites  # the found_inf read; the first also builds buffers


@pytest.mark.parametrize(
    "make",
    [
        lambda p: FusedAdam(p, lr=1e-3),
        lambda p: FusedSGD(p, lr=1e-3, momentum=0.9),
        lambda p: FusedSGD(p, lr=1e-3),
        lambda p: FusedAdagrad(p, lr=1e-3),
        lambda p: FusedRMSprop(p, lr=1e-3, momentum=0.9, centered=True),
        lambda p: FusedRMSpropTF(p, lr=1e-3, momentum=0.9),
        lambda p: FusedAdadelta(p),
    ],
    ids=["adam", "sgd_momentum", "sgd", "adagrad", "rmsprop", "rmsprop_tf", "adadelta"],
)
def test_fused_optimizer_under_grad_scaler_never_reads_the_host(make):
    """torch's GradScaler hands ``found_inf``/``grad_scale`` to a fused optimizer: its kernels skip or unscale on
    the device, step counters included, so ``scaler.step`` costs no host read, even on an overflow."""
    params = [torch.randn(64, 32, device="cuda", requires_grad=True) for _ in range(3)]
    optimizer = make(params)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    counts, sites = [], []
    for i in range(4):
        loss = sum(p.square().sum() for p in params)
        scaler.scale(loss * math.inf if i == 1 else loss).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                scaler.step(optimizer)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        sites.append(sync_sites(caught))
        counts.append(len(sites[-1]))
        scaler.update()
        optimizer.zero_grad()
    assert counts == [0, 0, 0, 0], sites
    assert scaler.get_scale() == 2.0**9  # one overflow
    if "step" in optimizer.state[params[0]]:
        assert float(optimizer.state[params[0]]["step"]) == 3.0


class FusedAdamWBatches(CudaBatches):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.module.parameters(), lr=1e-3, fused=True)


class AmpkitAdamBatches(CudaBatches):
    def configure_optimizers(self):
        return FusedAdam(self.module.parameters(), lr=1e-3)


@pytest.mark.parametrize("trainer_class", [FusedAdamWBatches, AmpkitAdamBatches])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_clipped_run_without_a_scaler_reads_nothing_per_iteration(tmp_path, trainer_class, dtype):
    """bf16/fp32 with clipping: the norm's finiteness goes to the fused step as ``found_inf`` (``skip_verdict:
    auto`` on CUDA) and the last iteration's verdict is read from pinned memory after its own event, so no
    iteration synchronizes; with ``skip_verdict=host`` each reads the norm once."""
    precision = {"precision.opt_level": "O1", "precision.dtype": "bfloat16"} if dtype == "bfloat16" else {}
    common = {**QUIET, **precision, "trainer.device": "cuda", "trainer.max_steps": 4, "trainer.clip_grad_norm": 0.5}
    counts, sites = {}, {}
    for verdict in ("auto", "host"):
        counter = SyncCounter()
        cfg = toy_cfg(tmp_path / verdict, **{**common, "trainer.skip_verdict": verdict})
        trainer_class(cfg, callbacks=[counter]).fit()
        counts[verdict], sites[verdict] = counter.per_iteration[1:], counter.sites[1:]
    assert counts == {"auto": [0, 0, 0], "host": [1, 1, 1]}, sites


@pytest.mark.parametrize("trainer_class", [FusedAdamWBatches, AmpkitAdamBatches])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_fp16_with_a_fused_optimizer_reads_nothing_per_iteration(tmp_path, trainer_class, clip):
    """O1 fp16: the found_inf flags go to the fused step and the scale updates on the GPU, so no iteration
    synchronizes (as torch's GradScaler with a fused AdamW); ``skip_verdict=host`` reads them once."""
    common = {**QUIET, **SMALL_SCALE, "precision.opt_level": "O1", "trainer.device": "cuda", "trainer.max_steps": 4}
    if clip is not None:
        common["trainer.clip_grad_norm"] = clip
    counts, sites = {}, {}
    for verdict in ("auto", "host"):
        counter = SyncCounter()
        trainer_class(toy_cfg(tmp_path / verdict, **{**common, "trainer.skip_verdict": verdict}), [counter]).fit()
        counts[verdict], sites[verdict] = counter.per_iteration[1:], counter.sites[1:]
    assert counts == {"auto": [0, 0, 0], "host": [1, 1, 1]}, sites
