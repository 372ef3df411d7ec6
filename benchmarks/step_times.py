"""Per-step times of a benchmark's runs, and the summaries that tell a host-bound loop from a device-bound one.

Each run keeps, for every step, the device's milliseconds (between consecutive CUDA events on a GPU, the chosen CPU
clock on a CPU) and the host's (between ``time.perf_counter`` readings taken at the same marks), so that:

- a stall (a garbage collection, an allocator's ``cudaMalloc``, a host read of the device) shows as a step far above
  the median (the max), not as a uniformly slower loop (the median);
- a host-bound loop (the GPU waits for Python to launch kernels) has its device steps as long as its host steps and
  almost no work queued when its last step is launched; a device-bound one leaves the GPU that last step's queue
  (the end lag: host milliseconds from the last mark until the device reached it).

``gpt_step.py`` imports it as a sibling (a script's own folder is on the path when it runs).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass


@dataclass
class RunTimes:
    """One run of one contender: every step's device and host milliseconds, the warm-up steps included."""

    precision: str
    mode: str
    contender: str
    repeat: int  # a contender's repeat; a reference run's number (repeat r ran between reference runs r and r + 1)
    position: int  # its place in its repeat's order, from 1 (reference runs: 0)
    warmup: int  # the leading steps the figures leave out
    device_ms: list[float]
    host_ms: list[float]
    end_lag_ms: float | None  # None on a CPU, where the host is the device
    setup_s: float  # from the call to its first mark: model, optimizer, trainer set-up
    tokens_per_s: float  # over the timed steps' total device time

    @property
    def timed_device_ms(self) -> list[float]:
        return self.device_ms[self.warmup :]

    @property
    def timed_host_ms(self) -> list[float]:
        return self.host_ms[self.warmup :]


def p90(values: list[float]) -> float:
    """The 90th percentile (linear between the closest ranks; the value itself for one)."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def ratio_cell(ratios: list[float]) -> str:
    """``median x [min, max]`` over repeats."""
    return f"{statistics.median(ratios):.3f}x [{min(ratios):.3f}, {max(ratios):.3f}]"


def paired_ratios(runs: list[RunTimes], reference: str, measure) -> dict[str, list[float]]:
    """Each contender's ``measure`` over the mean of the two reference runs around its repeat, per repeat (a
    higher measure is faster)."""
    refs = {run.repeat: measure(run) for run in runs if run.contender == reference}
    ratios: dict[str, list[float]] = {}
    for run in runs:
        if run.contender != reference and run.repeat in refs and run.repeat + 1 in refs:
            ratios.setdefault(run.contender, []).append(measure(run) / ((refs[run.repeat] + refs[run.repeat + 1]) / 2))
    return ratios


def median_step_speed(run: RunTimes) -> float:
    """Steps per ms at the median device step: beside the tokens/s (total time, what a user gets) it says whether a
    gap is every step's or a few stalls'."""
    return 1 / statistics.median(run.timed_device_ms)


def detail_table(runs: list[RunTimes], reference: str, labels: dict[str, str]) -> list[str]:
    """Per row (precision, mode) and contender, over its repeats' timed steps pooled: device ms/step median, p90 and
    max; host ms/step median; the largest end lag; the median set-up; and the median-step speed against the
    reference runs around each repeat."""
    lines = [
        "| precision | mode | contender | runs | device ms/step median | p90 | max | host ms/step median | "
        "end lag ms (max) | set-up s | median-step speed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = list(dict.fromkeys((run.precision, run.mode) for run in runs))
    for precision, mode in rows:
        row = [run for run in runs if (run.precision, run.mode) == (precision, mode)]
        speeds = paired_ratios(row, reference, median_step_speed)
        for contender in dict.fromkeys(run.contender for run in row):
            mine = [run for run in row if run.contender == contender]
            device = [ms for run in mine for ms in run.timed_device_ms]
            host = [ms for run in mine for ms in run.timed_host_ms]
            lags = [run.end_lag_ms for run in mine if run.end_lag_ms is not None]
            lag = f"{max(lags):.1f}" if lags else "n/a"
            setup = statistics.median(run.setup_s for run in mine)
            speed = ratio_cell(speeds[contender]) if contender in speeds else "n/a"
            if contender == reference:
                speed = "reference"
            lines.append(
                f"| {precision} | {mode} | {labels.get(contender, contender)} | {len(mine)} | "
                f"{statistics.median(device):.2f} | {p90(device):.2f} | {max(device):.2f} | "
                f"{statistics.median(host):.2f} | {lag} | {setup:.2f} | {speed} |"
            )
    return lines


def write_json(path: str, meta: dict, runs: Iterable[RunTimes]) -> None:
    """``meta`` and every run's raw times, replacing ``path`` whole (a run cut mid-write leaves the last complete
    file), through a temp file of a name no other file has (a fixed ``<path>.partial`` replaced one of the user's)."""
    folder, name = os.path.split(os.path.abspath(path))
    fd, partial = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({**meta, "runs": [asdict(run) for run in runs]}, f)
        os.replace(partial, path)
    except BaseException:
        os.unlink(partial)
        raise
