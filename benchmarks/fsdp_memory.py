"""Per-rank training state (parameters + gradients + optimizer state) of DDP vs FSDP at 1, 2 and 4 ranks.

Run: ``python benchmarks/fsdp_memory.py [--layers 20 --width 1024 --steps 10]``. Each configuration is a
torchrun launch (gloo on CPU) training an MLP of ``layers`` Linear(width, width) blocks (21M parameters by
default) with AdamW. Bytes are counted on each rank right after an optimizer step, when all three kinds of
state exist: the local storage of every parameter, its gradient and its optimizer state (a DTensor's local
shard under FSDP), the largest over ranks. FSDP should hold close to 1/N of DDP's; the table prints the
ratio and the target (<= 1.15/N), with the median step time beside it (informative only on a shared CPU).
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
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import ampkit


class WideMLPTrainer(ampkit.Trainer):
    layers = 20
    width = 1024

    def configure_model(self):
        return nn.Sequential(*[nn.Linear(self.width, self.width) for _ in range(self.layers)])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.module.parameters(), lr=1e-4)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return [torch.randn(8, self.width, generator=g) for _ in range(64)]

    def training_step(self, batch):
        return F.mse_loss(self.model(batch), batch)


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


class StateMeter(ampkit.Callback):
    """Bytes of parameters, gradients and optimizer state after each step, and the step times."""

    def __init__(self) -> None:
        self.state_bytes = 0
        self.step_times: list[float] = []
        self._start = 0.0
        self.result: dict = {}

    def on_train_batch_start(self, trainer, batch) -> None:
        self._start = time.perf_counter()

    def on_after_optimizer_step(self, trainer, optimizer) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        total = sum(_local_bytes(p) + (_local_bytes(p.grad) if p.grad is not None else 0) for p in params)
        total += sum(_local_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
        self.state_bytes = max(self.state_bytes, total)

    def on_train_batch_end(self, trainer, outputs, batch) -> None:
        self.step_times.append(time.perf_counter() - self._start)

    def on_train_end(self, trainer) -> None:
        """Rank zero's result holds the largest rank's bytes (gathered while the process group exists)."""
        params = sum(p.numel() for p in trainer.module.parameters())  # a DTensor's numel is the whole tensor
        self.result = {"bytes": self.state_bytes, "step_s": statistics.median(self.step_times[3:]), "params": params}
        if trainer.world_size > 1:
            gathered: list = [None] * trainer.world_size
            dist.all_gather_object(gathered, self.result)
            self.result = max(gathered, key=lambda r: r["bytes"])


def worker(strategy: str, layers: int, width: int, steps: int, run_dir: str) -> None:
    WideMLPTrainer.layers, WideMLPTrainer.width = layers, width
    meter = StateMeter()
    distributed = {"strategy": strategy}
    if strategy == "fsdp":
        distributed["fsdp"] = {"shard_modules": ["Linear"]}
    trainer = WideMLPTrainer(
        {"trainer_class": "x:y", "run_dir": run_dir, "trainer": {"max_steps": steps + 3, "progress_bar": False,
         "device": "cpu"}, "logging": {"tensorboard": False}, "checkpoint": {"enabled": False},
         "distributed": distributed},
        callbacks=[meter],
    )  # fmt: skip
    trainer.fit()
    if trainer.is_global_zero:
        print(json.dumps(meter.result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.layers, args.width, args.steps, args.run_dir)
        return
    rows = {}
    for nproc in map(int, args.ranks.split(",")):
        for strategy in ("ddp", "fsdp"):
            run_dir = tempfile.mkdtemp(prefix="ampkit-fsdp-")
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                       __file__, f"--worker={strategy}", f"--layers={args.layers}", f"--width={args.width}",
                       f"--steps={args.steps}", f"--run-dir={run_dir}"]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
            rows[nproc, strategy] = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    params = next(iter(rows.values()))["params"]
    print(f"MLP of {args.layers} x Linear({args.width}, {args.width}) = {params / 1e6:.1f}M params, AdamW, fp32, "
          f"gloo, {os.cpu_count()} cores")  # fmt: skip
    header = f"{'ranks':>5} {'DDP MiB/rank':>13} {'FSDP MiB/rank':>14} {'FSDP/DDP':>9} {'target':>7}"
    print(f"{header} {'DDP s/step':>11} {'FSDP s/step':>12}")
    for nproc in map(int, args.ranks.split(",")):
        ddp, fsdp = rows[nproc, "ddp"], rows[nproc, "fsdp"]
        ratio = fsdp["bytes"] / ddp["bytes"]
        target = 1.15 / nproc if nproc > 1 else 1.0
        verdict = "ok" if ratio <= target else "MISS"
        print(f"{nproc:5d} {ddp['bytes'] / 2**20:13.1f} {fsdp['bytes'] / 2**20:14.1f} {ratio:9.3f} "
              f"{'<=' + format(target, '.3f'):>7} {ddp['step_s']:11.3f} {fsdp['step_s']:12.3f}  {verdict}")  # fmt: skip


if __name__ == "__main__":
    main()
