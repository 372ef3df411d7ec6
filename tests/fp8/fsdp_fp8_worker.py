"""One rank of the float8 FSDP test: ``python fsdp_fp8_worker.py OUT_DIR`` with torchrun-style env vars. Trains
through one inf batch with the float8 all-gather (in OUT_DIR/float8), then again with the high-precision one (in
OUT_DIR/high), and saves what the test compares: one launch for both runs, each rank importing torchao once."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torchao.float8
from fp8_trainers import Fp8Trainer, fp8_cfg
from torch.distributed.tensor import DTensor

import ampkit

PRECOMPUTES = []
_precompute = torchao.float8.precompute_float8_dynamic_scale_for_fsdp


def counting_precompute(module):
    PRECOMPUTES.append(1)
    _precompute(module)


class KeepFinalState(ampkit.Callback):
    def on_train_end(self, trainer):
        self.state = {
            k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in trainer.module.state_dict().items()
        }


def train(all_gather: bool, out: Path) -> dict:
    """Train through one inf batch; the gathered weights, precompute count, step counts and the local weight type."""
    keep = KeepFinalState()
    fp8 = {"fsdp_float8_all_gather": all_gather, "telemetry_every_n_steps": 2}  # telemetry on sharded layers too
    cfg = fp8_cfg(out, "torchao", fp8=fp8, trainer={"max_epochs": 2}, checkpoint={"enabled": True},
                  precision={"opt_level": "O1", "dtype": "bfloat16", "skip_nonfinite": True},
                  distributed={"strategy": "fsdp", "fsdp": {"shard_modules": ["Float8Linear"]}})  # fmt: skip
    trainer = Fp8Trainer(cfg, callbacks=[keep])
    trainer.inf_at = 3
    trainer.fit()
    state = trainer.optimizer_state[trainer.optimizer]
    local_weight = type(trainer.module[0].weight.to_local()).__name__
    precomputes = len(PRECOMPUTES)
    PRECOMPUTES.clear()  # the next run counts its own
    return {"model": keep.state, "precomputes": precomputes, "steps": state.steps,
            "skipped": state.skipped_steps, "local_weight": local_weight}  # fmt: skip


if __name__ == "__main__":
    out = Path(sys.argv[1])
    torchao.float8.precompute_float8_dynamic_scale_for_fsdp = counting_precompute
    for all_gather in ("float8", "high"):
        torch.save(train(all_gather == "float8", out / all_gather), out / all_gather / f"rank{os.environ['RANK']}.pt")
