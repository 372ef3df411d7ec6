"""Where in a fit an exception from the user's data or code struck, as a note at the end of its traceback: a
dataset that raises at one sample, a DataLoader worker that dies, a ``training_step`` that fails on one batch."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# torch's default collate_fn: in a traceback's frames, or in the text of the traceback a DataLoader worker sends back
_DEFAULT_COLLATE = os.path.join("torch", "utils", "data", "_utils", "collate.py")


def loop_position_note(
    exception: BaseException, phase: str, state: Any, fetched_ahead: int, newest_checkpoint: Path | None
) -> str:
    """One line naming the batch and epoch that ``phase`` (``"fetch"``: ``train_dataloader()`` was producing the
    next batch; ``"batch"``: the step of the current one) was at, why where that is plain (the default collate_fn
    refusing the samples), and the checkpoint ``--resume last`` continues from. ``fetched_ahead``: batches the loop
    fetched beyond the one running (1 when it reads one ahead)."""
    if phase == "fetch":
        where = f"while train_dataloader() produced batch {state.batches_done + fetched_ahead} of epoch {state.epoch}"
        if _raised_in_default_collate(exception):
            where += (
                " (in the DataLoader's default collate_fn, which stacks each field of the samples into one tensor and "
                "cannot stack these: a None, tensors of unequal shapes, or a type it does not know; drop such "
                "samples in the dataset, or give the DataLoader a collate_fn that pads or filters them)"
            )
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


def _raised_in_default_collate(exception: BaseException) -> bool:
    frame = exception.__traceback__
    while frame is not None:
        if frame.tb_frame.f_code.co_filename.endswith(_DEFAULT_COLLATE):
            return True
        frame = frame.tb_next
    return _DEFAULT_COLLATE in str(exception)
