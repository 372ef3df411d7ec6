"""The Trainer's own cost per step, in µs, on a step that does almost nothing: what the loop adds, isolated.

Run: ``python benchmarks/loop_overhead.py [--steps 3000 --repeats 7]``. The step is ``Linear(4, 1)`` on a
fixed list of 200 batches with SGD, so the data pipeline and the math are as small as torch allows and the
Trainer's Python (hooks, state, the skip verdict; with ``skip_nonfinite``, the inf check and its flag read) is
what differs between a hand loop and ``ampkit.Trainer`` (checkpoints, TensorBoard and the progress bar off),
both in bf16 without a check (the default) and with it. Each Trainer run is
compared with the hand loops run just before and after it; the table gives the median difference over runs
with its quartiles. ``trainer_overhead.py`` gives the same cost as a ratio on a realistic small model.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from trainer_overhead import timed_fit  # a sibling script: benchmarks/ is on the path

import ampkit

# name: (dtype, precision options beyond O1 in that dtype)
PRECISIONS = {
    "fp32": (None, {}),
    "bf16 O1": (torch.bfloat16, {}),
    "bf16 O1 + skip_nonfinite": (torch.bfloat16, {"skip_nonfinite": True}),
}


def make_batches() -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 4, generator=g),) for _ in range(200)]


def hand_loop(batches: list, steps: int, dtype: torch.dtype | None) -> float:
    """torch's recipe: autocast around the forward for bf16, no scaler."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    done, start = 0, time.perf_counter()
    while done < steps:
        model.train()
        for (x,) in batches:
            with torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext():
                loss = model(x).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done += 1
            if done == steps:
                break
    return (time.perf_counter() - start) / steps


class TinyTrainer(ampkit.Trainer):
    batches: list

    def configure_model(self):
        return nn.Linear(4, 1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.module.parameters(), lr=1e-3)

    def train_dataloader(self):
        return self.batches

    def training_step(self, batch):
        return self.model(batch[0]).sum()


def trainer_loop(
    batches: list,
    steps: int,
    dtype: torch.dtype | None,
    precision: dict | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    return timed_fit(TinyTrainer, steps, dtype, clock=clock, precision=precision, batches=batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    batches = make_batches()
    print(f"torch {torch.__version__}, 1 thread, {args.steps} steps x {args.repeats} runs")
    print(f"{'precision':26} {'hand us':>8} {'Trainer adds us [q1, q3]':>26}")
    for name, (dtype, precision) in PRECISIONS.items():
        hand_loop(batches, 200, dtype)  # warm-up: autocast and kernel caches
        trainer_loop(batches, 200, dtype, precision)
        hands, added = [], []
        for _ in range(args.repeats):
            before = hand_loop(batches, args.steps, dtype)
            ours = trainer_loop(batches, args.steps, dtype, precision)
            after = hand_loop(batches, args.steps, dtype)
            hands.append((before + after) / 2 * 1e6)
            added.append((ours - (before + after) / 2) * 1e6)
        q1, median, q3 = statistics.quantiles(added, n=4) if len(added) > 1 else added * 3
        print(f"{name:26} {statistics.median(hands):8.1f} {statistics.median(added):12.1f} [{q1:.1f}, {q3:.1f}]")


if __name__ == "__main__":
    main()
