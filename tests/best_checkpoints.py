"""What a run's best-k ranking left on disk: the steps of its best-N.pt files, and the step best.pt holds."""

from __future__ import annotations

import re

from ampkit.trainer.checkpoint_io import load_checkpoint


def best_steps(run) -> list[int]:
    """The steps of the best-k files on disk, oldest first."""
    names = (p.name for p in (run.version_dir / "checkpoints").iterdir())
    return sorted(int(m.group(1)) for name in names if (m := re.fullmatch(r"best-(\d{8})\.pt", name)))


def best_pt_step(run) -> int:
    """The step of the checkpoint ``best.pt`` holds."""
    return load_checkpoint(run.version_dir / "checkpoints" / "best.pt")["loop"]["global_step"]
