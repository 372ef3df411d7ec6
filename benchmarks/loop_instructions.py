"""The Trainer's own cost per step as a count of CPU instructions, which does not drift as timings do.

Run: ``python benchmarks/loop_instructions.py [--model tiny|mlp] [--steps 200]`` (needs ``valgrind``; a few
minutes). ``tiny`` (the default) runs ``loop_overhead.py``'s loops: a near-empty step (``Linear(4, 1)``, SGD, a list
of batches), hand-written and through ``ampkit.Trainer``; ``mlp`` runs ``trainer_overhead.py``'s (a small MLP, a
DataLoader, AdamW), where the instruction ratio can be set beside that script's timed one. Each runs in a child
process under callgrind with instrumentation switched on only around the training loop, once for ``steps`` and once
for twice as many; the difference divided by ``steps`` is the instructions of one step, free of start-up and of the
switching itself. Timings of the same loops move by 10-30% between minutes on a shared machine; these counts
repeat to a fraction of a percent (about 2k instructions a step on ``tiny``, 10k on ``mlp``, whose shuffled
batches vary more), so a change of a few Python calls in the Trainer's hot path shows.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import loop_overhead  # sibling scripts: benchmarks/ is on the path
import torch
import trainer_overhead


class CallgrindSwitch:
    """Turns callgrind's instrumentation of this process on at its first call and off at its second; usable
    as the clock of ``timed_fit`` (read at the start and at the end of training)."""

    def __init__(self) -> None:
        self.on = False

    def __call__(self) -> float:
        self.on = not self.on
        subprocess.run(["callgrind_control", "-i", "on" if self.on else "off", str(os.getpid())],
                       check=True, capture_output=True)  # fmt: skip
        return time.perf_counter()


def loops(model: str) -> tuple[dict[str, tuple[torch.dtype | None, dict]], Callable, Callable, Callable]:
    """``model``'s precisions (name: dtype and options), hand loop, Trainer loop and data maker."""
    if model == "tiny":
        lo = loop_overhead
        return lo.PRECISIONS, lo.hand_loop, lo.trainer_loop, lo.make_batches
    to = trainer_overhead
    precisions = {name: (dtype, {}) for name, dtype in to.PRECISIONS.items()}
    return precisions, to.hand_loop, to.trainer_loop, lambda: to.make_data(32 * 200)


def child(model: str, loop: str, precision_name: str, steps: int) -> None:
    """Run one loop for ``steps`` steps with instrumentation on around it (inside callgrind)."""
    torch.set_num_threads(1)
    precisions, hand_loop, trainer_loop, make_data = loops(model)
    dtype, options = precisions[precision_name]
    data = make_data()
    switch = CallgrindSwitch()
    if loop == "hand":
        hand_loop(data, 50, dtype)  # warm-up: autocast and kernel caches
        switch()
        hand_loop(data, steps, dtype)
        switch()
    else:
        trainer_loop(data, 50, dtype, options)
        trainer_loop(data, steps, dtype, options, clock=switch)


def instructions(model: str, loop: str, precision_name: str, steps: int) -> int:
    """Instructions callgrind collected for one child run."""
    with tempfile.TemporaryDirectory() as out:
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}/cg.out",
                   sys.executable, __file__, "--child", model, loop, precision_name, str(steps)]  # fmt: skip
        run = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).parent)
    match = re.search(r"Collected : ([\d,]+)", run.stderr)
    if run.returncode != 0 or match is None:
        raise RuntimeError(f"callgrind run failed ({' '.join(command)}):\n{run.stderr[-2000:]}")
    return int(match.group(1).replace(",", ""))


def per_step(model: str, loop: str, precision_name: str, steps: int, pool: ThreadPoolExecutor) -> float:
    short, long = pool.map(lambda n: instructions(model, loop, precision_name, n), (steps, 2 * steps))
    return (long - short) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "mlp"), default="tiny")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--child", nargs=4, metavar=("MODEL", "LOOP", "PRECISION", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model, loop, precision_name, steps = args.child
        child(model, loop, precision_name, int(steps))
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("loop_instructions.py needs valgrind (callgrind); install it, e.g. apt install valgrind")
    print(f"torch {torch.__version__}, 1 thread, {args.model} model, instructions per step ({args.steps} vs "
          f"{2 * args.steps} steps); ratio = hand / Trainer")  # fmt: skip
    print(f"{'precision':26} {'hand':>10} {'Trainer':>10} {'Trainer adds':>13} {'ratio':>7}")
    with ThreadPoolExecutor(max_workers=2) as pool:
        for name in loops(args.model)[0]:
            hand = per_step(args.model, "hand", name, args.steps, pool)
            ours = per_step(args.model, "trainer", name, args.steps, pool)
            print(f"{name:26} {hand:10.0f} {ours:10.0f} {ours - hand:13.0f} {hand / ours:7.3f}")


if __name__ == "__main__":
    main()
