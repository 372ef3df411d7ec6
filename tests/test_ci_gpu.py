"""``.ci/gpu``'s shell logic, run here with stand-ins for ``python3`` and ``timeout``: a GPU session gets one try
at it, so what can fail without a GPU (arguments, the call's time budget, the device check) fails here first."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from child_env import child_env
from rank_forkserver import ForkedPython

SCRIPT = Path(__file__).resolve().parents[1] / ".ci" / "gpu"

# python3: a fake GPU machine (device check, family list, builds, pytest, benchmarks), or the real interpreter with
# only pip faked (REAL_PYTHON set); with FAKE_PYTEST_HANGS its pytest reports a failure, hangs in the next test and,
# on SIGINT, prints what pytest prints then (the failure's traceback, the summary, the counts).
# timeout: logs its options and limit, then runs the command without one; with FAKE_LIMIT_S, stops a command still
# running after that many seconds with SIGINT, as GNU timeout does at its limit (status 124).
FAKE_PYTHON = """#!/usr/bin/env bash
echo "python3 $*" >> "$FAKE_LOG"
if [[ "$1 $2" == "-m pip" ]]; then exit 0; fi
if [[ -n "${REAL_PYTHON:-}" ]]; then exec "$REAL_PYTHON" "$@"; fi
case "$1" in
    -) cat >/dev/null; echo "torch 0 (CUDA 0) on a fake GPU" ;;
    -c) if [[ "$2" == *FAMILIES* ]]; then echo "fam_a fam_b"; exit; fi
        if [[ -n "${FAKE_PYTEST_HANGS:-}" ]]; then
            interrupted() {
                printf '%s\\n' "!!! KeyboardInterrupt !!!" "=== FAILURES ===" "___ test_b_cuda ___" \\
                    "tests/test_a.py:7: in test_b_cuda" "    assert 1 == 2" "E   assert 1 == 2" \\
                    "=== short test summary info ===" "FAILED tests/test_a.py::test_b_cuda - assert 1 == 2" \\
                    "=== 1 failed, 1 passed in 2.00s ==="
                exit 2
            }
            trap interrupted INT
            printf '%s\\n' "tests/test_a.py::test_a_cuda PASSED" "tests/test_a.py::test_b_cuda FAILED" \\
                "tests/test_a.py::test_c_cuda"
            for ((tenths = 0; tenths < 300; tenths++)); do sleep 0.1; done  # the trap runs within 0.1 s of SIGINT
            exit 0
        fi
        echo "3 passed in 0.01s"; sleep "$FAKE_PYTEST_S"; exit "${FAKE_PYTEST_RC:-0}" ;;
esac
"""
FAKE_TIMEOUT = """#!/usr/bin/env bash
echo "timeout ${*:1:6}" >> "$FAKE_LOG"
while [[ "$1" == -* ]]; do case "$1" in -s|-k) shift 2 ;; *) shift ;; esac; done
shift
if [[ -z "${FAKE_LIMIT_S:-}" ]]; then exec "$@"; fi
set -m  # the command in a group of its own with SIGINT not ignored, as GNU timeout starts it
"$@" & command=$!
for ((tenths = 0; tenths < FAKE_LIMIT_S * 10; tenths++)); do
    kill -0 "$command" 2>/dev/null || break
    sleep 0.1
done
if kill -0 "$command" 2>/dev/null; then kill -INT "$command"; wait "$command"; exit 124; fi
wait "$command"
"""

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def run_script(
    tmp_path: Path, *args: str, real_python: bool = False, **env: str
) -> tuple[subprocess.CompletedProcess, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("python3", FAKE_PYTHON), ("timeout", FAKE_TIMEOUT)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    log.write_text("")
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log),
                "OUT": str(tmp_path / "out"), "FAKE_PYTEST_S": "0", **env}  # fmt: skip
    if real_python:
        full_env["REAL_PYTHON"] = sys.executable
    done = subprocess.run(["bash", str(SCRIPT), *args], env=full_env, capture_output=True, text=True, timeout=60,
                          preexec_fn=_sigint_catchable)  # fmt: skip
    return done, log.read_text()


def _sigint_catchable() -> None:
    """The fake pytest is bash, which cannot trap a SIGINT ignored when it starts (the real one restores Python's
    handler itself): a suite started in the background of a non-interactive shell ignores SIGINT, and there the
    time-limit tests ran the fake's whole 30 s hang and lost the lines they check."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def limits(log: str) -> list[int]:
    """Each step's time limit, in order, from the logged ``timeout`` calls (all SIGINT, then SIGKILL after 15 s)."""
    calls = [line.split()[1:] for line in log.splitlines() if line.startswith("timeout ")]
    assert all(call[:4] == ["-s", "INT", "-k", "15"] for call in calls), calls
    return [int(call[4]) for call in calls]


def test_verify_fits_each_step_into_what_is_left_of_the_calls_budget(tmp_path):
    """The steps' own limits add up to 560 s, past a 10-minute call once the build's time is counted: each is cut
    to the budget left when it starts, so the last lines and logs come back before the device tool kills the call."""
    done, log = run_script(tmp_path, "verify", "1/2", GPU_SECONDS="130", FAKE_PYTEST_S="2")
    assert done.returncode == 0, done.stderr
    steps = limits(log)
    assert len(steps) == 4  # the CUDA tests, the kernels bench, the GPT step, the fp8 block bench
    assert steps[0] <= 130 - 25 and steps[1] == 60  # the tests took 2 s of the budget:
    assert all(limit <= 130 - 2 - 25 for limit in steps[1:])
    assert "-k cuda tests" in log and "gpt_step.py --device cuda" in log
    assert f"--json {tmp_path / 'out' / 'gpt_step.json'}" in log  # every step's time comes back for a later look
    assert (tmp_path / "out" / "tests-cuda.log").read_text().strip() == "3 passed in 0.01s"


@pytest.mark.parametrize(("args", "steps"), [(["verify", "1/2"], 4), (["tests", "1/2"], 1)])
def test_a_failed_test_step_fails_the_call_though_later_steps_pass(tmp_path, args, steps):
    """The call's status was its last step's: CUDA tests failing in verify 1/2 (pytest's status 1) read as a pass
    once the fp8 bench after them had run."""
    done, log = run_script(tmp_path, *args, FAKE_PYTEST_RC="1")
    assert len(limits(log)) == steps  # every step still runs
    assert done.returncode == 1, done.stderr


@pytest.mark.parametrize(("shard", "log"), [("1/2", "tests-cuda"), ("2/2", "tests-rest")])
def test_verify_keeps_every_traceback_in_a_full_log_though_a_time_limit_stops_pytest(tmp_path, shard, log):
    """The filtered log keeps only result lines, and pytest ran with --tb=line: the GPU's failures came back with no
    file:line. The full log has pytest's whole -v --tb=short output, down to the counts it prints at the SIGINT."""
    done, calls = run_script(tmp_path, "verify", shard, FAKE_PYTEST_HANGS="1", FAKE_LIMIT_S="2")
    assert done.returncode == 124, done.stderr
    assert "-v --tb=short" in calls
    full = (tmp_path / "out" / f"{log}-full.log").read_text().splitlines()
    kept = ["tests/test_a.py::test_a_cuda PASSED", "tests/test_a.py:7: in test_b_cuda", "E   assert 1 == 2",
            "FAILED tests/test_a.py::test_b_cuda - assert 1 == 2", "=== 1 failed, 1 passed in 2.00s ==="]  # fmt: skip
    assert [line for line in kept if line not in full] == [], full
    filtered = (tmp_path / "out" / f"{log}.log").read_text().splitlines()
    assert "E   assert 1 == 2" not in filtered and "=== 1 failed, 1 passed in 2.00s ===" in filtered
    assert "stopped at its" in (tmp_path / "out" / "stopped.txt").read_text()


def test_verify_2_of_2_can_run_the_test_files_in_reverse_so_a_cut_short_calls_last_files_come_first(tmp_path):
    """An H100's 2/2 reached about 70% of the tests before its budget ran out; the next call starts from the end."""
    done, log = run_script(tmp_path, "verify", "2/2", GPU_ORDER="reverse")
    assert done.returncode == 0, done.stderr
    call = next(line for line in log.splitlines() if "not cuda" in line)
    files = call.split("-k not cuda ")[1].split()
    everything = sorted(str(p.relative_to(SCRIPT.parents[1])) for p in (SCRIPT.parents[1] / "tests").rglob("test_*.py"))
    assert files == everything[::-1]
    done, _ = run_script(tmp_path, "verify", "2/2", GPU_ORDER="backwards")
    assert (
        done.returncode == 2
        and "GPU_ORDER must be unset or 'reverse'" in done.stderr
        and "got 'backwards'" in done.stderr
    )


def test_verify_skips_the_steps_the_budget_has_no_room_for_and_says_so(tmp_path):
    done, log = run_script(tmp_path, "verify", "2/2", GPU_SECONDS="40")
    assert done.returncode == 0, done.stderr
    assert limits(log) == [] and "pytest" not in log
    assert "== tests -k 'not cuda': skipped" in done.stderr
    assert "skipped" in (tmp_path / "out" / "skipped.txt").read_text()


@pytest.mark.parametrize(("args", "steps"), [(["tests", "1/2"], 1), (["bench", "2/3"], 2), (["bench", "1/3"], 2)])
def test_the_tests_and_bench_stages_keep_to_the_budget_too(tmp_path, args, steps):
    done, log = run_script(tmp_path, *args, GPU_SECONDS="200")
    assert done.returncode == 0, done.stderr
    assert len(limits(log)) == steps and all(limit <= 200 - 25 for limit in limits(log))


@pytest.mark.parametrize("value", ["abc", "0", "10m", "-5"])
def test_a_budget_that_is_not_whole_seconds_is_refused_before_anything_runs(tmp_path, value):
    done, log = run_script(tmp_path, "verify", "1/2", GPU_SECONDS=value)
    assert done.returncode == 2 and log == ""
    assert done.stderr == f"GPU_SECONDS must be a whole number of seconds (this call's budget); got '{value}'\n"


CHECKED = [(["verify", "3/2"], "shard must be K/N"), (["verify", "1/3"], "verify shards are 1/2 and 2/2"),
           (["verfy"], "usage: bash .ci/gpu [tests|bench|verify] [K/N]; got stage 'verfy'")]  # fmt: skip


@pytest.mark.parametrize(("args", "message"), CHECKED)
def test_stages_and_shards_are_checked(tmp_path, args, message):
    done, log = run_script(tmp_path, *args)
    assert done.returncode == 2 and message in done.stderr
    if args == ["verfy"]:  # before the device check and the build, not after them
        assert log == ""


def test_without_cuda_the_device_check_stops_the_script_with_one_line(tmp_path):
    """The real interpreter (CPU torch here): the check says what is missing, and nothing is built or run."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the script on a machine without CUDA; this one has a CUDA device")
    done, log = run_script(tmp_path, "verify", "1/2", real_python=True)
    assert done.returncode == 1
    device = (tmp_path / "out" / "device.txt").read_text()
    assert re.fullmatch(r"torch \S+ sees no CUDA device: this script is for the GPU machine\n", device), device
    assert "ampkit.ops.build" not in log and "timeout" not in log


def test_tests_skipped_without_cuda_are_selected_by_k_cuda_whatever_their_names(tmp_path):
    """``verify 1/2`` runs ``-k cuda``: a CUDA-only file whose tests are not named so (the sync-budget tests that show
    0 host reads per iteration) ran only in 2/2, among two thousand others, where a time limit can cut it. The
    collecting pytest is forked from the warm rank server: a new Python spent seconds importing torch and ampkit."""
    budget = str(Path(__file__).parent / "callbacks" / "test_sync_budget.py")
    script = tmp_path / "pytest_main.py"
    script.write_text("import sys, pytest\nsys.exit(pytest.main(sys.argv[1:]))\n")
    command = [sys.executable, str(script), "--collect-only", "-q", "-p", "no:cacheprovider", "-k", "not cuda", budget]
    done = ForkedPython(command, env=child_env())
    stdout, stderr = done.communicate(timeout=120)
    assert re.match(r"no tests collected \(\d+ deselected\) in ", stdout.strip().splitlines()[-1]), stdout + stderr
