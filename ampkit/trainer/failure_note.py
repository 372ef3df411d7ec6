"""Where in a fit an exception from the user's data or code struck, as a note at the end of its traceback: a
dataset that raises at one sample, a DataLoader worker that dies, a ``training_step`` that fails on one batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def loop_position_note(phase: str, state: Any, fetched_ahead: int, newest_checkpoint: Path | None) -> str:
    """One line naming the batch and epoch that ``phase`` (``"fetch"``: ``train_dataloader()`` was producing the
    next batch; ``"batch"``: the step of the current one) was at, and the checkpoint ``--resume last`` continues
    from. ``fetched_ahead``: batches the loop fetched beyond the one running (1 when it reads one ahead)."""
    if phase == "fetch":
        where = f"while train_dataloader() produced batch {state.batches_done + fetched_ahead} of epoch {state.epoch}"
    else:
        where = f"in training batch {state.batch_idx} of epoch {state.epoch} (iteration {state.iteration})"
    if newest_checkpoint is None:
        kept = "no checkpoint was saved before it"
    else:
        kept = (
            f"the newest checkpoint, '{newest_checkpoint}', is intact: --resume last (fit(resume='last')) continues "
            "from it"
        )
    return f"ampkit: raised {where}; {kept}"
