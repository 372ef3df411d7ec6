"""``python -m apex.parallel.multiproc main.py``: Apex's launcher, which its 2018 examples and READMEs ran."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from child_env import child_env

from ampkit.compat.parallel import multiproc

REPO = Path(__file__).resolve().parents[2]

# Apex's examples/simple/distributed of 2018 in outline: the launcher hands each process --world-size/--rank,
# the script builds its process group from them, then amp O1 and apex's DDP (on gloo here).
_DISTRIBUTED_SCRIPT = """\
import argparse
import sys
import torch
import torch.distributed as dist
from apex import amp
from apex.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--world-size", default=1, type=int)
parser.add_argument("--rank", default=0, type=int)
parser.add_argument("--dist-url", default="tcp://224.66.41.62:23456")
args = parser.parse_args()
dist.init_process_group("gloo", init_method=args.dist_url, world_size=args.world_size, rank=args.rank)
torch.manual_seed(args.rank)  # each rank starts elsewhere: DDP hands out rank 0's weights
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
model = DDP(model)
batches = torch.Generator().manual_seed(10 + args.rank)
for _ in range(3):
    loss = model(torch.randn(4, 8, generator=batches)).pow(2).mean()
    optimizer.zero_grad()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
weights = torch.cat([p.detach().flatten() for p in model.parameters()]).double().sum().item()
print(f"rank {args.rank} of {args.world_size}: {weights:.12f}")
# Apex's examples reduced the loss to print it, a tensor Python made, as the script's last collective. The
# switch interval keeps the GIL with this thread until the interpreter shuts down, as a busy main thread would.
sys.setswitchinterval(60)
reduced_loss = loss.detach().clone()
dist.all_reduce(reduced_loss)
del reduced_loss
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # three Pythons start torch: ~20 s on 2 cores
def test_an_apex_2018_distributed_script_runs_one_process_per_rank_under_the_launcher(tmp_path):
    """It was "No module named 'apex.parallel.multiproc'", and ``-m`` refused any Apex module. Then rank 0 aborted
    after its output about one exit in four (status 134): gloo's thread freed the last collective's tensor during
    the interpreter's shutdown."""
    script = tmp_path / "main.py"
    script.write_text(_DISTRIBUTED_SCRIPT)
    # CUDA hidden: with a GPU the launcher starts one worker per device, as Apex did, and --world-size is not read
    done = subprocess.run(
        [sys.executable, "-m", "ampkit.legacy", "-m", "apex.parallel.multiproc", str(script), "--world-size", "2",
         "--dist-url", f"tcp://127.0.0.1:{_free_port()}"],
        cwd=tmp_path, env=child_env(REPO, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rank0 = done.stdout.strip().splitlines()[-1]
    rank1 = (tmp_path / "GPU_1.log").read_text().strip().splitlines()[-1]  # Apex's log file for rank 1
    assert rank0.startswith("rank 0 of 2: ") and rank1.startswith("rank 1 of 2: ")
    assert rank0.partition(": ")[2] == rank1.partition(": ")[2]  # one model on both ranks


def test_each_worker_is_told_its_rank_and_the_world_size(monkeypatch):
    monkeypatch.setattr(multiproc.torch.cuda, "is_available", lambda: False)
    commands = multiproc.worker_commands(["main.py", "--world-size=2", "--rank", "7", "--lr", "0.1"])
    assert [c[1:] for c in commands] == [
        ["main.py", "--world-size=2", "--rank", "0", "--lr", "0.1"],
        ["main.py", "--world-size=2", "--rank", "1", "--lr", "0.1"],
    ]
    assert [c[1:] for c in multiproc.worker_commands(["main.py"])] == [["main.py", "--world-size", "1", "--rank", "0"]]
    with pytest.raises(SystemExit, match=r"--world-size must be a positive integer, got 'two'"):
        multiproc.worker_commands(["main.py", "--world-size", "two"])


def test_a_failed_worker_stops_the_others_and_is_the_launchers_exit_status(tmp_path, monkeypatch):
    """Apex waited on every worker: rank 0 then hung in its first collective after rank 1 died."""
    monkeypatch.setattr(multiproc.torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "worker.py"
    script.write_text("import sys, time\nif sys.argv[-1] == '1':\n    sys.exit(3)\ntime.sleep(120)\n")
    assert multiproc.main([str(script), "--world-size", "2"]) == 3


def test_a_relaunch_appends_to_the_workers_logs_and_keeps_what_the_crashed_launch_wrote(tmp_path, monkeypatch):
    """Apex opened ``GPU_I.log`` with "w": relaunching a crashed job erased what rank 1 had printed before the crash."""
    monkeypatch.setattr(multiproc.torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    crashed = "epoch 1 loss 0.52\nepoch 2 loss 0.47\n"
    (tmp_path / "GPU_1.log").write_text(crashed)
    script = tmp_path / "worker.py"
    script.write_text("import sys\nprint(f'rank {sys.argv[-1]} relaunched')\n")
    assert multiproc.main([str(script), "--world-size", "2"]) == 0
    assert (tmp_path / "GPU_1.log").read_text() == crashed + "rank 1 relaunched\n"


def test_a_worker_killed_by_a_signal_is_the_launchers_exit_status_as_a_shell_gives_it(tmp_path, monkeypatch):
    """An OOM kill (SIGKILL) was returncode -9, which SystemExit turned into exit status 247; a shell says 137."""
    monkeypatch.setattr(multiproc.torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "worker.py"
    rank_1_killed = "if sys.argv[-1] == '1':\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    script.write_text(f"import os, signal, sys, time\n{rank_1_killed}time.sleep(120)\n")
    assert multiproc.main([str(script), "--world-size", "2"]) == 128 + signal.SIGKILL


def test_a_worker_that_outlives_the_stopping_sigterm_is_killed_after_the_grace(tmp_path, monkeypatch):
    """A worker that handles SIGTERM (ampkit's fit() saves first) and is stuck, as in a collective with the rank that
    died, kept the launcher waiting on it for ever."""
    monkeypatch.setattr(multiproc.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(multiproc, "STOP_GRACE_S", 0.5)
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "worker.py"
    rank_1_fails = "if sys.argv[-1] == '1':\n    time.sleep(1)\n    sys.exit(3)\n"
    script.write_text(f"import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n{rank_1_fails}"
                      "time.sleep(60)\n")  # fmt: skip
    started = time.monotonic()
    assert multiproc.main([str(script), "--world-size", "2"]) == 3
    assert time.monotonic() - started < 30


def test_an_apex_module_the_shim_does_not_serve_is_named_by_the_launcher():
    from ampkit.legacy import main

    with pytest.raises(SystemExit, match=r"module not found: 'apex.amp.opt': .*apex.amp provides .*initialize"):
        main(["-m", "apex.amp.opt"])
    assert "AMPKIT_APEX_SHIM" not in os.environ and "apex" not in sys.modules  # nothing was installed
