"""Per-step cost of ``ampkit.Trainer`` against plain PyTorch loops on a tiny MLP, where overhead shows.

Run: ``python benchmarks/trainer_overhead.py [--steps 1000 --repeats 5]``. Each precision has its own hand
loop, measured in the same process: fp32 a bare loop; bf16 O1 a raw ``torch.autocast(bfloat16)`` loop (no
scaler, torch's recipe); fp16 O1 ``torch.autocast(float16)`` with ``torch.amp.GradScaler``. The Trainer runs
the same model, DataLoader and AdamW with ``precision: {opt_level: O1, dtype: ...}`` (defaults otherwise:
bf16 has no loss scaler and, like the hand loop, no inf check; ``skip_nonfinite`` would add one). Runs
alternate; the ms columns are median per-step times. Times are this process's CPU time
(``time.process_time``): with one thread and no DataLoader workers it is the wall time of an idle machine,
and other jobs on a shared machine do not inflate it. "speed" = hand-loop time / Trainer time (1.0 = no
overhead), per run against the hand loops just before and after it (the machine's speed drifts between runs),
the median over runs with its quartiles.
Targets: fp32 >= 0.98, bf16 O1 >= 0.98, fp16 O1 >= 0.97. A Lightning column appears when ``lightning``
is importable.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ampkit

PRECISIONS = {"fp32": None, "bf16 O1": torch.bfloat16, "fp16 O1": torch.float16}


def make_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def hand_loop(data: TensorDataset, steps: int, dtype: torch.dtype | None) -> float:
    """torch's recipe for ``dtype``: autocast around the forward, a GradScaler for float16 only."""
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(data, batch_size=32, shuffle=True)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    done, start = 0, time.process_time()
    while done < steps:
        model.train()
        for x, y in loader:
            with torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext():
                loss = F.cross_entropy(model(x), y)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad(set_to_none=True)
            done += 1
            if done == steps:
                break
    return (time.process_time() - start) / steps


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


def timed_fit(
    trainer_class: type[ampkit.Trainer],
    steps: int,
    dtype: torch.dtype | None,
    clock: Callable[[], float] = time.process_time,
    tensorboard: bool = False,
    precision: dict[str, Any] | None = None,
    **attributes: Any,
) -> float:
    """Seconds per step of ``trainer_class`` fitting ``steps`` steps on CPU (O1 in ``dtype`` when given, with
    the ``precision`` options on top), by ``clock`` from the start of training to its end; ``attributes`` are
    set on the trainer before ``fit``."""
    with tempfile.TemporaryDirectory() as run_dir:
        if dtype is not None:
            precision = {"opt_level": "O1", "dtype": str(dtype).removeprefix("torch."), **(precision or {})}
        cfg = {
            "run_dir": run_dir,
            "trainer": {"max_steps": steps, "max_epochs": 10**6, "progress_bar": False, "device": "cpu"},
            "logging": {"tensorboard": tensorboard, "log_every_n_steps": 10},
            "checkpoint": {"enabled": False},
            "precision": precision or {},
        }
        timings: dict[str, float] = {}

        class Clock(ampkit.Callback):
            # Last at every hook: the time includes what other callbacks do at on_train_end (TensorBoard writes
            # the scalars it queued there).
            phase = ampkit.Phase.PERSIST

            def on_train_start(self, trainer):
                timings["start"] = clock()

            def on_train_end(self, trainer):
                timings["end"] = clock()

        trainer = trainer_class(cfg, callbacks=[Clock()])
        for name, value in attributes.items():
            setattr(trainer, name, value)
        trainer.fit()
    return (timings["end"] - timings["start"]) / steps


def trainer_loop(
    data: TensorDataset,
    steps: int,
    dtype: torch.dtype | None,
    precision: dict[str, Any] | None = None,
    clock: Callable[[], float] = time.process_time,
    tensorboard: bool = False,
) -> float:
    return timed_fit(MLPTrainer, steps, dtype, clock, tensorboard=tensorboard, precision=precision, data=data)


def lightning_loop(data: TensorDataset, steps: int, dtype: torch.dtype | None) -> float:
    """Lightning's Trainer on the same model and data (``bf16-mixed`` / ``16-mixed`` / ``32-true``)."""
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    timings: dict[str, float] = {}

    class Clock(L.Callback):
        def on_train_start(self, trainer, module):
            timings["start"] = time.process_time()

        def on_train_end(self, trainer, module):
            timings["end"] = time.process_time()

    precision = {None: "32-true", torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}[dtype]
    torch.manual_seed(0)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", precision=precision, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Clock()])  # fmt: skip
    trainer.fit(Module(), DataLoader(data, batch_size=32, shuffle=True))
    return (timings["end"] - timings["start"]) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the tiny MLP gains nothing from more)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = make_data(32 * 200)
    with_lightning = importlib.util.find_spec("lightning") is not None
    for dtype in PRECISIONS.values():  # warm-up: autocast and kernel caches
        hand_loop(data, 100, dtype)
        trainer_loop(data, 100, dtype)
    loops = {"ampkit": trainer_loop, **({"lightning": lightning_loop} if with_lightning else {})}
    times: dict[tuple[str, str], list[float]] = {}
    speeds: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for name, dtype in PRECISIONS.items():
            # Each loop is compared with the hand loops run just before and after it: the machine's speed
            # drifts between seconds (by more than the overhead on a shared machine), and a paired ratio
            # cancels the drift that a ratio of medians over the whole run keeps.
            before = hand_loop(data, args.steps, dtype)
            times.setdefault((name, "hand"), []).append(before)
            for loop, fn in loops.items():
                ours = fn(data, args.steps, dtype)
                after = hand_loop(data, args.steps, dtype)
                times.setdefault((name, loop), []).append(ours)
                speeds.setdefault((name, loop), []).append((before + after) / 2 / ours)
                before = after
        before = hand_loop(data, args.steps, None)
        tb = trainer_loop(data, args.steps, None, tensorboard=True)
        after = hand_loop(data, args.steps, None)
        speeds.setdefault(("fp32", "ampkit + TensorBoard/10"), []).append((before + after) / 2 / tb)

    def quartiles(values: list[float]) -> str:
        q1, median, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
        return f"{statistics.median(values):6.3f} [{q1:.3f}, {q3:.3f}]"

    ms = {key: statistics.median(values) * 1e3 for key, values in times.items()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} steps x {args.repeats} runs")
    print("speed = hand-loop time / loop time, the median over runs of each run against the hand loops just before")
    print("and after it [quartiles] (1.0 = no overhead); targets fp32 0.98, bf16 O1 0.98, fp16 O1 0.97")
    lightning_head = f" {'Lightning ms':>12} {'speed [q1, q3]':>22}" if with_lightning else ""
    print(f"{'precision':10} {'hand ms':>8} {'ampkit ms':>10} {'speed [q1, q3]':>22}{lightning_head}")
    for name in PRECISIONS:
        speed = quartiles(speeds[(name, "ampkit")])
        row = f"{name:10} {ms[(name, 'hand')]:8.3f} {ms[(name, 'ampkit')]:10.3f} {speed:>22}"
        if with_lightning:
            row += f" {ms[(name, 'lightning')]:12.3f} {quartiles(speeds[(name, 'lightning')]):>22}"
        print(row)
    if not with_lightning:
        print("Lightning: not importable, skipped")
    print(f"fp32 + TensorBoard every 10 steps: speed {quartiles(speeds[('fp32', 'ampkit + TensorBoard/10')])}")


if __name__ == "__main__":
    main()
