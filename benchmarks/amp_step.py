"""Per-step time of mixed-precision training through the Trainer vs hand-written loops, on CPU.

Run: ``PYTHONPATH=. python benchmarks/amp_step.py [--steps 60] [--models mlp,conv]``

Rows per model: a float32 hand loop, a raw ``torch.autocast`` bf16 hand loop (no scaler), and the Trainer
at O0 / O1 bf16 / O1 fp16 / O2 bf16 / O2 fp16 (dynamic loss scaling, per-loss combined unscale, skip
checks). Target: Trainer O1 bf16 >= 0.95x the autocast hand loop (ratio = hand time / Trainer time).
Times are the median per-step wall time after warm-up, best of ``--repeats`` runs; the rows are
interleaved within each repeat so that load from other jobs on the machine hits them alike. fp16 on
CPU is slow (no fp16 arithmetic in the CPU: ~25x fp32), so fp16 conv rows use fewer steps and one run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

import ampkit


def make_model(kind: str) -> nn.Module:
    if kind == "mlp":
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, stride=2),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def make_batches(kind: str, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    shape = (256, 256) if kind == "mlp" else (32, 3, 16, 16)
    return [(torch.randn(*shape, generator=gen), torch.randint(0, 10, (shape[0],), generator=gen)) for _ in range(n)]


def hand_loop(kind: str, batches, autocast_dtype: torch.dtype | None) -> list[float]:
    torch.manual_seed(0)
    model = make_model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for x, y in batches:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times


class StepTimer(ampkit.Callback):
    """Wall time of each batch, from on_train_batch_start to on_train_batch_end."""

    phase = ampkit.Phase.PERSIST  # last at every hook: times everything else in the batch

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, batch) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, outputs, batch) -> None:
        self.times.append(time.perf_counter() - self._start)


class BenchTrainer(ampkit.Trainer):
    def configure_model(self) -> nn.Module:
        torch.manual_seed(0)
        return make_model(self.kind)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.module.parameters(), lr=1e-3)

    def train_dataloader(self):
        return self.batches

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)


def trainer_loop(kind: str, batches, precision: dict) -> list[float]:
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = {
            "trainer_class": "benchmarks.amp_step:BenchTrainer",
            "run_dir": run_dir,
            "trainer": {"max_epochs": 1, "progress_bar": False, "device": "cpu", "seed": 0},
            "checkpoint": {"enabled": False},
            "logging": {"tensorboard": False},
            "precision": precision,
        }
        timer = StepTimer()
        trainer = BenchTrainer(cfg, callbacks=[timer])
        trainer.kind, trainer.batches = kind, batches
        trainer.fit()
    return timer.times


def median_after_warmup(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:])


ROWS = [
    ("hand loop fp32", "hand", None),
    ("hand loop autocast bf16", "hand", torch.bfloat16),
    ("Trainer O0 (fp32)", "trainer", {"opt_level": "O0"}),
    ("Trainer O1 bf16", "trainer", {"opt_level": "O1", "dtype": "bfloat16"}),
    ("Trainer O1 bf16 combine_grad", "trainer", {"opt_level": "O1", "dtype": "bfloat16", "combine_grad": True}),
    ("Trainer O1 fp16", "trainer", {"opt_level": "O1", "dtype": "float16"}),
    ("Trainer O2 bf16", "trainer", {"opt_level": "O2", "dtype": "bfloat16"}),
    ("Trainer O2 fp16", "trainer", {"opt_level": "O2", "dtype": "float16"}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="mlp,conv")
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median ms/step, best of {args.repeats}")
    for kind in args.models.split(","):
        results = {label: float("inf") for label, _, _ in ROWS}
        for repeat in range(args.repeats):
            for label, runner, setting in ROWS:
                slow_fp16 = kind == "conv" and "fp16" in label
                if slow_fp16 and repeat:
                    continue
                steps = max(args.warmup + 5, args.steps // 4) if slow_fp16 else args.steps
                batches = make_batches(kind, steps)
                if runner == "hand":
                    times = hand_loop(kind, batches, setting)
                else:
                    times = trainer_loop(kind, batches, setting)
                results[label] = min(results[label], median_after_warmup(times, args.warmup))
        fp32, autocast = results["hand loop fp32"], results["hand loop autocast bf16"]
        print(f"\n{kind}: {'configuration':32s} {'ms/step':>9s} {'speed vs fp32 hand':>19s} {'vs autocast hand':>17s}")
        for label, value in results.items():
            print(f"{'':5s} {label:32s} {value * 1e3:9.3f} {fp32 / value:18.2f}x {autocast / value:16.2f}x")


if __name__ == "__main__":
    main()
