"""Apex's launcher, ``python -m apex.parallel.multiproc SCRIPT [ARGS...]``: one worker process per GPU.

Each worker runs ``python SCRIPT ARGS --world-size N --rank I`` (values ARGS already give are replaced). Rank 0
prints to this terminal and rank I > 0 to ``GPU_I.log`` in the working directory, as in Apex, but appended to:
Apex truncated it, so relaunching a crashed job erased what its workers had printed. N is the number of
CUDA devices, as in Apex; without one it is ARGS' ``--world-size`` (default 1), so CPU runs with gloo can start
several ranks. Unlike Apex, a failed worker stops the others (SIGTERM, then SIGKILL after ``STOP_GRACE_S``) and the
launcher exits with its status.

Run it through ``python -m ampkit.legacy -m apex.parallel.multiproc SCRIPT ...`` so the workers see the apex shim.
"""

from __future__ import annotations

import subprocess
import sys
import time

import torch

from ampkit.wording import shown

_USAGE = "usage: python -m apex.parallel.multiproc SCRIPT [ARGS...] [--world-size N]"
# How long the workers left get after the SIGTERM that stops them before a SIGKILL, as torchrun's agent gives them: one
# that handles SIGTERM (ampkit's fit() stops at its iteration's end and saves) may be stuck in a collective with the
# worker that died, where the launcher waited on it for ever.
STOP_GRACE_S = 30.0


def _option_value(args: list[str], option: str) -> str | None:
    """The value ``args`` give ``option`` (``--opt V`` or ``--opt=V``), or None."""
    for i, arg in enumerate(args):
        if arg == option and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(option + "="):
            return arg.partition("=")[2]
    return None


def _with_option(args: list[str], option: str, value: int) -> list[str]:
    """``args`` with ``option`` set to ``value``: replaced where given (either spelling), else appended."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg == option and i + 1 < len(out):
            out[i + 1] = str(value)
            return out
        if arg.startswith(option + "="):
            out[i] = f"{option}={value}"
            return out
    return [*out, option, str(value)]


def world_size(args: list[str]) -> int:
    """The number of workers: the CUDA device count, else ARGS' ``--world-size`` (default 1)."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.cuda.device_count()
    given = _option_value(args, "--world-size")
    if given is None:
        return 1
    if not given.isdigit() or int(given) < 1:
        raise SystemExit(f"apex.parallel.multiproc: --world-size must be a positive integer, got {shown(given)}")
    return int(given)


def worker_commands(args: list[str]) -> list[list[str]]:
    """The command line of each worker, rank 0 first."""
    size = world_size(args)
    base = _with_option(args, "--world-size", size)
    return [[sys.executable, *_with_option(base, "--rank", rank)] for rank in range(size)]


def _exit_status(returncode: int) -> int:
    """A worker's ``Popen.returncode`` as a shell gives it: one killed by signal N (returncode -N, an OOM kill's
    SIGKILL) is 128 + N; ``SystemExit(-9)`` would exit 247."""
    return 128 - returncode if returncode < 0 else returncode


def main(argv: list[str] | None = None) -> int:
    """Start the workers and wait for them; the first non-zero exit status stops the others and is returned."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0].startswith("-"):
        raise SystemExit(_USAGE)
    logs = []
    workers = []
    try:
        for rank, command in enumerate(worker_commands(args)):
            stdout = None if rank == 0 else open(f"GPU_{rank}.log", "a")  # closed below
            if stdout is not None:
                logs.append(stdout)
            workers.append(subprocess.Popen(command, stdout=stdout))
        while True:
            codes = [worker.poll() for worker in workers]
            failed = [code for code in codes if code not in (None, 0)]
            if failed or all(code == 0 for code in codes):
                return _exit_status(failed[0]) if failed else 0
            time.sleep(0.05)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for worker in workers:
            try:
                worker.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # it handles SIGTERM (ampkit's fit() saves first) and is stuck
                worker.kill()
                worker.wait()
        for log in logs:
            log.close()


if __name__ == "__main__":
    raise SystemExit(main())
