"""Steps/s of data-parallel training on CPU (gloo) with 1 and 2 processes, launched by torchrun.

Run: ``python benchmarks/ddp_scaling.py [--steps 300 --batch 64]``. Each process trains the same MLP on
its own batch (so 2 processes do twice the samples per step); the table reports steps/s, samples/s and
the scaling efficiency against 1 process. On a 2-core machine the figures are informative only: the
two ranks share the cores with each other and with gloo's threads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ampkit


class MLPTrainer(ampkit.Trainer):
    batch = 64

    def configure_model(self):
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.module.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(self.batch * 400, 256, generator=g), torch.randint(0, 10, (self.batch * 400,)))
        return DataLoader(data, batch_size=self.batch, shuffle=True)

    def training_step(self, batch):
        return F.cross_entropy(self.model(batch[0]), batch[1])


def worker(steps: int, batch: int, run_dir: str) -> None:
    timings: dict[str, float] = {}

    class Clock(ampkit.Callback):
        def on_train_batch_end(self, trainer, outputs, b):
            if trainer.state.global_step == 20:  # after warm-up
                timings["start"] = time.perf_counter()

        def on_train_end(self, trainer):
            timings["end"] = time.perf_counter()

    MLPTrainer.batch = batch
    trainer = MLPTrainer(
        {"trainer_class": "x:y", "run_dir": run_dir, "trainer": {"max_steps": steps + 20, "max_epochs": 1000,
         "progress_bar": False}, "logging": {"tensorboard": False}, "checkpoint": {"enabled": False}},
        callbacks=[Clock()],
    )  # fmt: skip
    trainer.fit()
    if trainer.is_global_zero:
        print(json.dumps({"steps_per_s": steps / (timings["end"] - timings["start"])}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.batch, args.run_dir)
        return
    rows = []
    for nproc in (1, 2):
        run_dir = tempfile.mkdtemp(prefix="ampkit-ddp-")  # one directory all ranks agree on
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        command = [
            *launcher,
            __file__,
            "--worker",
            f"--steps={args.steps}",
            f"--batch={args.batch}",
            f"--run-dir={run_dir}",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
        result = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
        rows.append((nproc, result["steps_per_s"]))
    base = rows[0][1]
    print(f"MLP 256-512-512-10, batch {args.batch}/process, AdamW, gloo, {os.cpu_count()} cores")
    print(f"{'processes':>9} {'steps/s':>9} {'samples/s':>10} {'efficiency':>11}")
    for nproc, steps_per_s in rows:
        efficiency = steps_per_s / base
        print(f"{nproc:9d} {steps_per_s:9.1f} {steps_per_s * nproc * args.batch:10.0f} {efficiency:10.2f}x")


if __name__ == "__main__":
    main()
