"""``benchmarks/gpt_step.py``'s measurement, run on the CPU at a tiny shape: a GPU session gets a few minutes for it,
so the pairing of its runs, their raw times and what a SIGINT at the time limit leaves are checked here first."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from step_times import RunTimes, detail_table, paired_ratios, write_json  # noqa: E402  (a script's sibling, not a package)

TINY = ["--layers", "1", "--width", "32", "--seq-len", "8", "--batch", "2", "--threads", "1", "--precisions", "fp32",
        "--modes", "eager"]  # fmt: skip


def bench(tmp_path: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(BENCHMARKS.parent)}
    command = [sys.executable, str(BENCHMARKS / "gpt_step.py"), *TINY, "--run-dir", str(tmp_path / "runs"), *args]
    # SIGINT as a terminal or GNU timeout leaves it (a runner that ignores it would pass the ignoring on)
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip


def run(contender: str, repeat: int, step_ms: float, tokens_per_s: float) -> RunTimes:
    return RunTimes("bf16", "eager", contender, repeat, 0, 1, [50.0, step_ms, step_ms], [1.0, 2.0, 2.0], 0.5, 0.1,
                    tokens_per_s)  # fmt: skip


def test_an_existing_json_file_is_replaced_only_with_overwrite(tmp_path, monkeypatch, capsys):
    """--json replaced the times an earlier run left at that path, without a word. Run in this process: the refusal
    is argparse's exit 2 before any run, and a new Python spent seconds importing torch to give it."""
    import gpt_step

    out = tmp_path / "gpt.json"
    out.write_text("the times of an earlier run")
    argv = [*TINY, "--run-dir", str(tmp_path / "runs"), "--steps", "2", "--warmup", "1", "--repeats", "1"]
    monkeypatch.setattr(sys, "argv", ["gpt_step.py", *argv, "--json", str(out)])
    with pytest.raises(SystemExit) as exited:
        gpt_step.main()
    assert exited.value.code == 2 and "exists already: pass --overwrite" in capsys.readouterr().err
    assert out.read_text() == "the times of an earlier run"


def test_the_json_file_is_written_whole_through_a_temp_name_no_file_of_the_user_s_has(tmp_path):
    """It went through a fixed ``gpt.json.partial``, replacing a file of that name."""
    mine = tmp_path / "gpt.json.partial"
    mine.write_text("the user's own file")
    write_json(str(tmp_path / "gpt.json"), {"steps": 3}, [run("hand", 0, 2.0, 100.0)])
    assert json.loads((tmp_path / "gpt.json").read_text())["runs"][0]["contender"] == "hand"
    assert mine.read_text() == "the user's own file" and sorted(tmp_path.iterdir()) == [tmp_path / "gpt.json", mine]


def test_each_repeat_runs_between_two_hand_loops_in_a_rotated_order_and_keeps_every_step(tmp_path):
    out = tmp_path / "gpt.json"
    done = bench(tmp_path, "--steps", "3", "--warmup", "1", "--repeats", "3", "--json", str(out))
    stdout, stderr = done.communicate(timeout=300)
    assert done.returncode == 0, stderr
    runs = json.loads(out.read_text())["runs"]
    order = [(r["contender"], r["repeat"]) for r in runs]
    assert order == [("hand", 0), ("trainer", 0), ("fused", 0), ("hand", 1), ("fused", 1), ("trainer", 1),
                     ("hand", 2), ("trainer", 2), ("fused", 2), ("hand", 3)]  # fmt: skip
    assert all(len(r["device_ms"]) == len(r["host_ms"]) == 3 and min(r["device_ms"]) > 0 for r in runs)
    # what a CPU run cannot give is said before the table, with the command that gives it on a GPU
    assert "On a CPU: MFU is n/a" in stdout.split("| precision |")[0] and "need a GPU: --device cuda" in stdout
    detail = stdout[stdout.index("| precision | mode | contender |") :]
    for label in ("hand loop", "Trainer", "Trainer + ampkit fused"):
        assert f"| fp32 | eager | {label} | " in detail


def test_a_contender_is_compared_with_the_two_hand_loops_around_its_repeat():
    runs = [run("hand", 0, 10.0, 100.0), run("trainer", 0, 20.0, 50.0), run("hand", 1, 30.0, 300.0),
            run("trainer", 1, 20.0, 100.0), run("hand", 2, 10.0, 100.0)]  # fmt: skip
    assert paired_ratios(runs, "hand", lambda r: r.tokens_per_s) == {"trainer": [50 / 200, 100 / 200]}
    row = detail_table(runs, "hand", {"trainer": "Trainer"})[-1]
    # the warm-up step (50 ms) left out; median-step speed: 1/20 over the mean of 1/10 and 1/30, in both repeats
    assert row == "| bf16 | eager | Trainer | 2 | 20.00 | 20.00 | 20.00 | 2.00 | 0.5 | 0.10 | 0.750x [0.750, 0.750] |"


def test_a_sigint_at_the_time_limit_keeps_the_finished_runs_and_prints_their_details(tmp_path):
    out = tmp_path / "gpt.json"
    proc = bench(tmp_path, "--steps", "20", "--warmup", "1", "--repeats", "200", "--json", str(out))
    deadline = time.monotonic() + 240
    while not out.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if proc.poll() is not None:
        pytest.fail(f"the bench ended before a run finished: {proc.communicate()}")
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    # stdout's end says whether the SIGINT went unheard (the bench ran all its repeats) or ended it some other way
    assert proc.returncode == 130, f"stderr: {stderr!r}; stdout's end: {stdout[-1500:]!r}"
    finished = len(json.loads(out.read_text())["runs"])
    assert finished >= 1
    assert f"stopped by SIGINT in the fp32 eager row: the detail table below and --json hold the {finished}" in stdout
    assert "| fp32 | eager | hand loop | " in stdout
