"""Steps/s of data-parallel training on CPU (gloo) with 1 and 2 processes, launched by torchrun.

Run: ``python benchmarks/ddp_scaling.py [--steps 300 --batch 64]``. Each process trains the same MLP on
its own batch (so 2 processes do twice the samples per step); the first table reports steps/s, samples/s and
the scaling efficiency against 1 process. The second compares, on 2 processes and a hand-written loop, the
gradient sync of torch's DDP with Apex's ``DistributedDataParallel`` as :mod:`ampkit.compat` provides it
(default and ``delay_allreduce=True``) and with torch's ``find_unused_parameters=True``, timed in
interleaved rounds in the same processes. On a 2-core machine the figures are informative only: the
two ranks share the cores with each other and with gloo's threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ampkit


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


class MLPTrainer(ampkit.Trainer):
    batch = 64

    def configure_model(self):
        return _mlp()

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


SYNC_VARIANTS = {
    "torch DDP": lambda model: nn.parallel.DistributedDataParallel(model),
    "torch DDP find_unused_parameters": lambda model: nn.parallel.DistributedDataParallel(
        model, find_unused_parameters=True
    ),
    "apex DDP": lambda model: _apex_ddp(model),
    "apex DDP delay_allreduce": lambda model: _apex_ddp(model, delay_allreduce=True),
}


def _apex_ddp(model: nn.Module, **kwargs) -> nn.Module:
    from ampkit.compat.parallel import DistributedDataParallel

    return DistributedDataParallel(model, **kwargs)


def sync_worker(steps: int, batch: int, rounds: int = 30) -> None:
    """Time each gradient-sync variant in a hand loop, ``rounds`` interleaved blocks of ``steps / rounds`` each;
    the ratio against torch's DDP is the median over rounds of the two neighbouring blocks' ratio."""
    torch.distributed.init_process_group("gloo")
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    x, y = torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g)
    runs = {}
    for name, wrap in SYNC_VARIANTS.items():
        torch.manual_seed(0)
        model = _mlp()
        runs[name] = (wrap(model), torch.optim.AdamW(model.parameters(), lr=1e-3))

    def block(name: str, n: int) -> float:
        ddp, optimizer = runs[name]
        torch.distributed.barrier()
        start = time.perf_counter()
        for _ in range(n):
            optimizer.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            optimizer.step()
        torch.distributed.barrier()
        return time.perf_counter() - start

    for name in runs:
        block(name, 10)  # warm-up
    per_block = max(1, steps // rounds)
    names = list(runs)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):  # each round times every variant back to back, starting from a rotating one
        for name in names[r % len(names) :] + names[: r % len(names)]:
            seconds[name].append(block(name, per_block))
    if torch.distributed.get_rank() == 0:
        reference = seconds["torch DDP"]
        result = {
            name: {
                "steps_per_s": per_block / min(times),
                "ratio": statistics.median(ref / t for ref, t in zip(reference, times, strict=True)),
            }
            for name, times in seconds.items()
        }
        print(json.dumps(result))
    torch.distributed.destroy_process_group()


def _torchrun(nproc: int, args: list[str]) -> dict:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
    out = subprocess.run([*launcher, __file__, *args], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("{")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sync-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.batch, args.run_dir)
        return
    if args.sync_worker:
        sync_worker(args.steps, args.batch)
        return
    sizes = [f"--steps={args.steps}", f"--batch={args.batch}"]
    rows = []
    for nproc in (1, 2):
        run_dir = tempfile.mkdtemp(prefix="ampkit-ddp-")  # one directory all ranks agree on
        result = _torchrun(nproc, ["--worker", *sizes, f"--run-dir={run_dir}"])
        rows.append((nproc, result["steps_per_s"]))
    base = rows[0][1]
    print(f"MLP 256-512-512-10, batch {args.batch}/process, AdamW, gloo, {os.cpu_count()} cores")
    print(f"{'processes':>9} {'steps/s':>9} {'samples/s':>10} {'efficiency':>11}")
    for nproc, steps_per_s in rows:
        efficiency = steps_per_s / base
        print(f"{nproc:9d} {steps_per_s:9.1f} {steps_per_s * nproc * args.batch:10.0f} {efficiency:10.2f}x")
    sync = _torchrun(2, ["--sync-worker", *sizes])
    print(f"\n2 processes, hand loop, 30 interleaved rounds of {max(1, args.steps // 30)} steps per variant")
    print(f"{'gradient sync':>34} {'best steps/s':>13} {'vs torch DDP (median)':>22}")
    for name, row in sync.items():
        print(f"{name:>34} {row['steps_per_s']:13.1f} {row['ratio']:21.2f}x")


if __name__ == "__main__":
    main()
