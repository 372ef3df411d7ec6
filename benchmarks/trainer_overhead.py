"""Per-step cost of ``ampkit.Trainer`` against a plain PyTorch loop on a tiny MLP, where overhead shows.

Run: ``python benchmarks/trainer_overhead.py [--steps 3000 --repeats 5]``. Both loops train the same
model on the same DataLoader; runs alternate and the median per-step time of each is reported.
Target: the bare Trainer (no logging/checkpointing) within 3% of the hand loop.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ampkit


def make_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def hand_loop(data: TensorDataset, steps: int) -> float:
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(data, batch_size=32, shuffle=True)
    done, start = 0, time.perf_counter()
    while done < steps:
        model.train()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done += 1
            if done == steps:
                break
    return (time.perf_counter() - start) / steps


class MLPTrainer(ampkit.Trainer):
    data: TensorDataset

    def configure_model(self):
        return make_model()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.module.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=32, shuffle=True)

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)


def trainer_loop(data: TensorDataset, steps: int, tensorboard: bool) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = {
            "trainer_class": "x:MLPTrainer",
            "run_dir": run_dir,
            "trainer": {"max_steps": steps, "max_epochs": 10**6, "progress_bar": False},
            "logging": {"tensorboard": tensorboard, "log_every_n_steps": 10},
            "checkpoint": {"enabled": False},
        }
        trainer = MLPTrainer(cfg)
        trainer.data = data
        timings: dict[str, float] = {}

        class Clock(ampkit.Callback):
            def on_train_start(self, trainer):
                timings["start"] = time.perf_counter()

            def on_train_end(self, trainer):
                timings["end"] = time.perf_counter()

        trainer._user_callbacks.append(Clock())
        trainer.fit()
    return (timings["end"] - timings["start"]) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    data = make_data(32 * 200)
    runs: dict[str, list[float]] = {"hand loop": [], "Trainer (bare)": [], "Trainer + TensorBoard/10 steps": []}
    hand_loop(data, 200)  # warm-up
    for _ in range(args.repeats):
        runs["hand loop"].append(hand_loop(data, args.steps))
        runs["Trainer (bare)"].append(trainer_loop(data, args.steps, tensorboard=False))
        runs["Trainer + TensorBoard/10 steps"].append(trainer_loop(data, args.steps, tensorboard=True))
    base = statistics.median(runs["hand loop"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} steps x {args.repeats} runs")
    print(f"{'loop':34} {'ms/step':>9} {'vs hand loop':>13} {'overhead us/step':>17}")
    for name, values in runs.items():
        median = statistics.median(values)
        print(f"{name:34} {median * 1e3:9.3f} {median / base:12.3f}x {(median - base) * 1e6:17.1f}")


if __name__ == "__main__":
    main()
