"""The README's main job: the digits example trains to >= 95% validation accuracy, logs and checkpoints."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ampkit.trainer.checkpoint_io import load_checkpoint

REPO = Path(__file__).resolve().parents[1]


def test_digits_cli_reaches_95_percent_with_tensorboard_and_checkpoint(tmp_path):
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "ampkit", "fit", "--config", "configs/digits.yaml", f"run_dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr
    assert elapsed < 60, f"took {elapsed:.0f} s"
    run = tmp_path / "version_0"
    checkpoint = load_checkpoint(run / "checkpoints" / "last.pt")
    assert checkpoint["val_metrics"]["acc"] >= 0.95
    assert "val/acc=" in result.stdout

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {
        "train/loss",
        "train/lr/adamw",
        "train/grad_norm/adamw",
        "train/steps_per_sec",
        "val/acc",
        "val/loss",
    } <= scalars
    acc = events.Scalars("val/acc")
    assert len(acc) == 20 and acc[-1].value >= 0.95
    losses = [e.value for e in events.Scalars("train/loss")]
    assert losses[-1] < losses[0] / 3
