"""Start a test's worker processes as forks of one process that has already imported torch and ampkit.

A fresh ``python worker.py`` spends seconds importing torch, ampkit and ``torch._dynamo`` (which the first
optimizer step imports): two ranks per launch, dozens of launches, most of the distributed tests' time on CI's
2 cores. A rank forked from a warm server starts at once and is otherwise the process a fresh interpreter would
be: its own environment, argv, working directory, stdout and stderr, an exit status (negative when a signal
killed it), and an interpreter exit that runs atexit hooks and prints an uncaught exception's traceback.

``ForkedPython`` has the part of ``subprocess.Popen``'s interface the tests use (``args``, ``pid``, ``poll``,
``communicate``, ``kill``, ``returncode``). The server runs with ``OMP_NUM_THREADS=1``, as every rank does, and
runs no tensor op before it forks, so no OpenMP or other thread exists to be lost in a fork.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# What a rank imports before its scenario runs (the first optimizer step imports torch._dynamo). Not torchao: its
# import asks torch.cuda.is_available(), and a CUDA driver initialised before a fork fails in the forked ranks.
WARM_MODULES = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.fsdp", "ampkit", "toy_trainers")


class ForkedPython:
    """``python SCRIPT ARGS...`` forked from the warm server, with ``env`` as its whole environment."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.args = args
        self.returncode: int | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="forked-rank-"))
        request = {
            "script": str(args[1]),
            "argv": [str(a) for a in args[1:]],
            "env": env,
            "cwd": os.getcwd(),
            "stdout": str(self._dir / "stdout"),
            "stderr": str(self._dir / "stderr"),
            "pid": str(self._dir / "pid"),
            "status": str(self._dir / "status"),
        }
        _server().send(request)
        self.pid = int(self._wait_for(self._dir / "pid", deadline=time.monotonic() + 60))

    def poll(self) -> int | None:
        if self.returncode is None and (self._dir / "status").exists():
            self.returncode = int((self._dir / "status").read_text())
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self.returncode = int(self._wait_for(self._dir / "status", deadline))
        except subprocess.TimeoutExpired:
            raise subprocess.TimeoutExpired(self.args, timeout) from None
        out, err = ((self._dir / name).read_text(errors="replace") for name in ("stdout", "stderr"))
        for name in ("stdout", "stderr", "pid", "status"):
            (self._dir / name).unlink(missing_ok=True)
        self._dir.rmdir()
        return out, err

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _wait_for(self, path: Path, deadline: float | None) -> str:
        """The text of ``path``, written whole (by rename) by the server's side once it is known."""
        while not path.exists():
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, 0)
            time.sleep(0.01)
        return path.read_text()


class _Server:
    """The warm process: reads one JSON request per line on stdin and forks a rank for each."""

    def __init__(self) -> None:
        # NVML's device count, not the CUDA driver's: a driver initialised before a fork fails in the forked ranks,
        # and torch.cuda.is_available() (which an import may ask) initialises it otherwise.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
        env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.log = tempfile.NamedTemporaryFile(prefix="rank-forkserver-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__)), "--serve"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        ready = self.proc.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the rank fork server did not start: {Path(self.log.name).read_text()[-3000:]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, request: dict) -> None:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        alive = self.alive()
        try:
            self.proc.stdin.close()  # the server exits at the end of its input
        except OSError:  # it died with unread input: the pipe is broken
            pass
        if alive:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.stdout.close()
        self.log.close()  # at exit, an open one is a ResourceWarning printed after the test summary
        Path(self.log.name).unlink(missing_ok=True)


_the_server: _Server | None = None


def _server() -> _Server:
    global _the_server
    if _the_server is None or not _the_server.alive():
        _the_server = _Server()
        atexit.register(_the_server.close)
    return _the_server


# ----------------------------------------------------------------------------------------------- the server's side
def _write_whole(path: str, text: str) -> None:
    """Write ``path`` by rename, so the test never reads it half-written."""
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)


def _become_the_rank(request: dict) -> None:
    """Turn this fork into ``python SCRIPT ARGS...`` and run the script. Its exit (normal, ``sys.exit``, an uncaught
    exception) propagates to the interpreter's top level, which ends the process as it would end a fresh one."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    sys.stdin = open(os.devnull)  # the server's reader may hold later requests read ahead
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))
    wanted = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:1] = [p for p in wanted if p not in sys.path]  # as a fresh interpreter reads PYTHONPATH
    import runpy

    runpy.run_path(request["script"], run_name="__main__")
    sys.exit(0)


def _monitor(request: dict) -> None:
    """Fork the rank, publish its pid, wait for it and publish its exit status as ``Popen.returncode`` gives it."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # waitpid needs its children kept until reaped
    pid = os.fork()
    if pid == 0:
        _become_the_rank(request)
    _write_whole(request["pid"], str(pid))
    _, status = os.waitpid(pid, 0)
    _write_whole(request["status"], str(os.waitstatus_to_exitcode(status)))
    os._exit(0)


def _serve() -> None:
    for name in WARM_MODULES:
        importlib.import_module(name)
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised while warming up: forked ranks could not use it")

    torch.default_generator.manual_seed(torch.default_generator.initial_seed())  # as a fresh process starts
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the monitors are reaped by the kernel
    print("ready", flush=True)
    while line := sys.stdin.readline():
        request = json.loads(line)
        if os.fork() == 0:
            _monitor(request)


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    sys.path.insert(0, str(HERE))
    _serve()
