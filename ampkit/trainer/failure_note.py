"""Where in a fit an exception from the user's data or code struck, as a note at the end of its traceback: a
dataset that raises at one sample, a DataLoader worker that dies, a ``training_step`` that fails on one batch (and
in an evaluation, the batch its loader was producing)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

# torch's default collate_fn: in a traceback's frames, or in the text of the traceback a DataLoader worker sends back
_DEFAULT_COLLATE = os.path.join("torch", "utils", "data", "_utils", "collate.py")
# autograd's error for a saved tensor changed in place: "... modified by an inplace operation: [torch.FloatTensor
# [16, 1]], which is output 0 of AsStrided ..." (the shape of the tensor saved, a parameter's or its transpose's)
_VIEWS = {"AsStrided", "T", "Transpose", "Permute", "View", "Expand", "Squeeze", "Unsqueeze"}
_CHANGED_IN_PLACE = re.compile(r"modified by an inplace operation: \[\S+ \[([\d, ]*)\]\]")


def loop_position_note(
    exception: BaseException,
    phase: str,
    state: Any,
    fetched_ahead: int,
    newest_checkpoint: Path | None,
    module: torch.nn.Module | None = None,
    batch_is_none: bool = False,
    deleted: Path | None = None,
) -> str:
    """One line naming the batch and epoch that ``phase`` (``"fetch"``: ``train_dataloader()`` was producing the
    next batch; ``"batch"``: the step of the current one) was at, why where that is plain (the default collate_fn
    refusing the samples), and the checkpoint ``--resume last`` continues from. ``fetched_ahead``: batches the loop
    fetched beyond the one running (1 when it reads one ahead); ``module``: the model, whose parameters an in-place
    change autograd refused may name; ``batch_is_none``: the batch that step took was None; ``deleted``: the
    checkpoint ``--resume last`` would have continued from, gone where no ``newest_checkpoint`` is left (deleted by
    hand while the run trained)."""
    if phase == "fetch":
        where = f"while train_dataloader() produced batch {state.batches_done + fetched_ahead} of epoch {state.epoch}"
        where += _collate_hint(exception)
    else:
        where = f"in training batch {state.batch_idx} of epoch {state.epoch} (iteration {state.iteration})"
        if batch_is_none:
            where += (
                " (train_dataloader() gave None as this batch, as a collate_fn or an IterableDataset that returns None "
                "for a batch it drops does: leave such batches out in the loader)"
            )
        if module is not None and (changed := _changed_in_place(exception, module)):
            where += (
                f" (autograd needed {changed} as the forward used it, and something changed it in place before the "
                "backward, e.g. a forward or hook updating it under torch.no_grad(): change parameters only in the "
                "optimizer step, or use a copy)"
            )
    if newest_checkpoint is None and deleted is not None:
        kept = f"the newest checkpoint, '{deleted}', was deleted while the run trained"
    elif newest_checkpoint is None:
        kept = "no checkpoint was saved before it"
    else:
        kept = (
            f"the newest checkpoint, '{newest_checkpoint}', is intact: --resume last (fit(resume='last')) continues "
            "from it"
        )
    return f"ampkit: raised {where}; {kept}"


def noting_fetch_failures(batches: Iterable[Any], source: str) -> Iterator[Any]:
    """``batches``, an error raised while fetching one noted with the batch's index and ``source``
    (``"val_dataloader()"``), as :func:`loop_position_note` notes a training batch's."""
    iterator = iter(batches)
    index = 0
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except Exception as exc:
            if hasattr(exc, "add_note"):
                exc.add_note(f"ampkit: raised while {source} produced batch {index}{_collate_hint(exc)}")
            raise
        yield batch
        index += 1


def _collate_hint(exception: BaseException) -> str:
    """What to do, where the DataLoader's default collate_fn refused the samples; else ``""``."""
    if not _raised_in_default_collate(exception):
        return ""
    return (
        " (in the DataLoader's default collate_fn, which stacks each field of the samples into one tensor and cannot "
        "stack these: a None, tensors of unequal shapes, or a type it does not know; drop such samples in the "
        "dataset, or give the DataLoader a collate_fn that pads or filters them)"
    )


def _raised_in_default_collate(exception: BaseException) -> bool:
    frame = exception.__traceback__
    while frame is not None:
        if frame.tb_frame.f_code.co_filename.endswith(_DEFAULT_COLLATE):
            return True
        frame = frame.tb_next
    return _DEFAULT_COLLATE in str(exception)


def _changed_in_place(exception: BaseException, module: torch.nn.Module) -> str:
    """The parameters (``parameter 'b.weight'``) whose shape, or its transpose, is that of the saved tensor autograd
    found changed in place (a parameter or a view of one), or ``""``."""
    text = str(exception)
    found = _CHANGED_IN_PLACE.search(text)
    made_by = re.search(r"which is output \d+ of (\w+?)(?:Backward\d*)?\b", text)
    if found is None or (made_by is not None and made_by.group(1) not in _VIEWS):
        return ""  # an activation (output of ReluBackward0...): no parameter to name
    shape = tuple(int(size) for size in found.group(1).split(",") if size.strip())
    names = [name for name, p in module.named_parameters() if shape in (tuple(p.shape), tuple(p.shape)[::-1])]
    if not names:
        return ""
    return "parameter " + " or ".join(repr(name) for name in names[:3])
