"""The Trainer's own cost per step as a count of CPU instructions, which does not drift as timings do.

Run: ``python benchmarks/loop_instructions.py [--steps 200]`` (needs ``valgrind``; a few minutes). The loops
are ``loop_overhead.py``'s: a near-empty step (``Linear(4, 1)``, SGD, a list of batches), hand-written and
through ``ampkit.Trainer``. Each runs in a child process under callgrind with instrumentation switched on only
around the training loop, once for ``steps`` and once for twice as many; the difference divided by ``steps``
is the instructions of one step, free of start-up and of the switching itself. Timings of the same loops move
by 10-30% between minutes on a shared machine; these counts repeat to within a fraction of a percent, so a
change of a few hundred instructions (one Python call) in the Trainer's hot path shows.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from loop_overhead import PRECISIONS, hand_loop, make_batches, trainer_loop  # a sibling script


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


def child(loop: str, precision_name: str, steps: int) -> None:
    """Run one loop for ``steps`` steps with instrumentation on around it (inside callgrind)."""
    torch.set_num_threads(1)
    dtype, options = PRECISIONS[precision_name]
    batches = make_batches()
    switch = CallgrindSwitch()
    if loop == "hand":
        hand_loop(batches, 50, dtype)  # warm-up: autocast and kernel caches
        switch()
        hand_loop(batches, steps, dtype)
        switch()
    else:
        trainer_loop(batches, 50, dtype, options)
        trainer_loop(batches, steps, dtype, options, clock=switch)


def instructions(loop: str, precision_name: str, steps: int) -> int:
    """Instructions callgrind collected for one child run."""
    with tempfile.TemporaryDirectory() as out:
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}/cg.out",
                   sys.executable, __file__, "--child", loop, precision_name, str(steps)]  # fmt: skip
        run = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).parent)
    match = re.search(r"Collected : ([\d,]+)", run.stderr)
    if run.returncode != 0 or match is None:
        raise RuntimeError(f"callgrind run failed ({' '.join(command)}):\n{run.stderr[-2000:]}")
    return int(match.group(1).replace(",", ""))


def per_step(loop: str, precision_name: str, steps: int, pool: ThreadPoolExecutor) -> float:
    short, long = pool.map(lambda n: instructions(loop, precision_name, n), (steps, 2 * steps))
    return (long - short) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--child", nargs=3, metavar=("LOOP", "PRECISION", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        loop, precision_name, steps = args.child
        child(loop, precision_name, int(steps))
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("loop_instructions.py needs valgrind (callgrind); install it, e.g. apt install valgrind")
    print(f"torch {torch.__version__}, 1 thread, instructions per step ({args.steps} vs {2 * args.steps} steps)")
    print(f"{'precision':26} {'hand':>10} {'Trainer':>10} {'Trainer adds':>13}")
    with ThreadPoolExecutor(max_workers=2) as pool:
        for name in PRECISIONS:
            hand = per_step("hand", name, args.steps, pool)
            ours = per_step("trainer", name, args.steps, pool)
            print(f"{name:26} {hand:10.0f} {ours:10.0f} {ours - hand:13.0f}")


if __name__ == "__main__":
    main()
