"""How many samples one training batch draws over all ranks, saved with each checkpoint, so that a mid-epoch resume
on another world size or batch size continues at the same sample of the epoch instead of the same batch count."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ampkit.trainer.checkpoint_io import CheckpointError
from ampkit.wording import counted


def batch_layout(loader: Any, world_size: int, epoch_batches: int | None) -> dict[str, int] | None:
    """``{"ranks", "batch_size", "epoch_batches"}`` of a training DataLoader with a fixed batch size over a map-style
    dataset, else None (a batch sampler, a plain iterable, or an IterableDataset, which orders its own samples)."""
    from torch.utils.data import DataLoader, IterableDataset

    ordered = isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset)
    size = loader.batch_size if ordered else None
    if not isinstance(size, int) or epoch_batches is None:
        return None
    return {"ranks": world_size, "batch_size": size, "epoch_batches": epoch_batches}


@dataclass(frozen=True)
class RescaledResume:
    """A mid-epoch resume into epoch ``epoch`` whose position moved to batches of another size: the checkpoint's
    ``saved_batches`` batches of the ``saved`` layout are this run's first ``batches`` of the ``here`` layout."""

    epoch: int
    saved_batches: int
    saved: dict[str, int]
    batches: int
    here: dict[str, int]

    def note(self) -> str:
        """What this run's batch count means in the resumed epoch, after the count of its batches: ``"of 8 samples
        (1 rank x 8), the first 4 of them the resumed checkpoint's 2 batches of 16 samples (2 ranks x 8)"``."""
        return (
            f"of {samples_a_batch(self.here)}, the first {self.batches} of them the resumed checkpoint's "
            f"{counted(self.saved_batches, 'batch', 'batches')} of {samples_a_batch(self.saved)}"
        )


def samples_a_batch(layout: dict[str, int]) -> str:
    """``"16 samples (2 ranks x 8)"``: the samples one batch draws over all ranks."""
    ranks, size = layout["ranks"], layout["batch_size"]
    return f"{counted(ranks * size, 'sample')} ({counted(ranks, 'rank')} x {size})"


def rescaling(
    epoch: int, saved: dict[str, int] | None, here: dict[str, int] | None, saved_batches: int, batches: int
) -> RescaledResume | None:
    """The :class:`RescaledResume` of a resume ``saved_batches`` into epoch ``epoch`` that :func:`batches_done_here`
    moved to ``batches`` of this run's; None where the batches kept their size (or either layout is unknown)."""
    if not saved_batches or saved is None or here is None:
        return None
    if saved["ranks"] * saved["batch_size"] == here["ranks"] * here["batch_size"]:
        return None
    return RescaledResume(epoch, saved_batches, saved, batches, here)


def batches_done_here(
    saved: dict[str, int] | None,
    here: dict[str, int] | None,
    batches_done: int,
    accumulate: int,
    path: Path,
) -> int:
    """The batches of the resumed epoch this run skips: the saved count, rescaled when ranks x batch size changed
    since the checkpoint (each global batch covers the next ``ranks * batch_size`` samples of the epoch's order).

    A position that falls inside one of this run's batches, or inside an accumulation window, is refused."""
    if not batches_done or saved is None or here is None:
        return batches_done
    saved_samples, samples = saved["ranks"] * saved["batch_size"], here["ranks"] * here["batch_size"]
    if saved_samples == samples:
        return batches_done
    if batches_done >= saved["epoch_batches"]:  # saved after the epoch's last (maybe partial) batch
        return here["epoch_batches"]
    done, rest = divmod(batches_done * saved_samples, samples)
    if rest or done % accumulate:
        raise CheckpointError(
            f"checkpoint '{path}' is {counted(batches_done, 'batch', 'batches')} of {samples_a_batch(saved)} into its "
            f"epoch; this run's batches take {samples_a_batch(here)}"
            + (f" and step every {accumulate}" if accumulate > 1 else "")
            + ", so it cannot continue at that sample: resume with ranks x batch size "
            f"= {saved_samples}, or from an epoch-end checkpoint"
        )
    return done


def layout_change(
    saved: dict[str, int] | None, here: dict[str, int] | None, saved_accumulate: int = 1, accumulate: int = 1
) -> str | None:
    """How a resume changed the samples each optimizer step trains (``"16 (2 ranks x 8) then, 8 (1 rank x 8) now"``),
    counting the batches each step accumulates, or None when it did not or either side is unknown: the same windows,
    but the loss curve follows another batch size. Fewer ranks with more accumulation keep the step's samples."""
    if saved is None or here is None:
        return None
    if saved["ranks"] * saved["batch_size"] * saved_accumulate == here["ranks"] * here["batch_size"] * accumulate:
        return None

    def shown(layout: dict[str, int], accumulate: int) -> str:
        ranks, size = layout["ranks"], layout["batch_size"]
        batches = f" x {accumulate} batches accumulated" if accumulate != 1 else ""
        return f"{ranks * size * accumulate} ({counted(ranks, 'rank')} x {size}{batches})"

    return f"{shown(saved, saved_accumulate)} then, {shown(here, accumulate)} now"


def saved_accumulation(checkpoint: dict[str, Any]) -> int:
    """The batches each optimizer step accumulated in the run that saved ``checkpoint`` (its config's
    ``trainer.accumulate_grad_batches``; 1 where it does not say)."""
    config = checkpoint.get("config")
    trainer = config.get("trainer") if isinstance(config, dict) else None
    accumulate = trainer.get("accumulate_grad_batches") if isinstance(trainer, dict) else None
    return accumulate if isinstance(accumulate, int) and not isinstance(accumulate, bool) and accumulate >= 1 else 1


def order_change_note(
    changes: dict[str, tuple[Any, Any]], saved: dict[str, int] | None, here: dict[str, int] | None, batches_done: int
) -> str | None:
    """What the changed keys (``{key: (then, now)}`` of ``data.*`` and ``trainer.seed``) do to the samples a resume
    ``batches_done`` batches into its epoch skips, or None when they do not change them.

    With both layouts known the position moves in samples, so a key that is the loader's batch size (its values
    are the layouts' batch sizes) changes nothing there; the banner names the changed samples a step instead."""
    seed = changes.get("trainer.seed")
    data = [key for key in changes if key != "trainer.seed"]
    notes = []
    if seed is not None:
        notes.append(
            f"trainer.seed ({seed[0]} -> {seed[1]}) orders a shuffled epoch, so the samples it skips are not the ones "
            "the saved run trained"
        )
    if saved is not None and here is not None:
        sizes = (saved["batch_size"], here["batch_size"])
        data = [key for key in data if sizes[0] == sizes[1] or changes[key] != sizes]
        if data:
            notes.append(
                f"it continues at sample {batches_done * saved['ranks'] * saved['batch_size']} of the epoch's order; "
                f"if {', '.join(data)} changed the dataset or its order, the samples it skips are not the ones the "
                "saved run trained"
            )
    elif data:
        notes.append(
            f"this train loader (no fixed batch size over a map-style dataset) resumes at a count of batches "
            f"({batches_done}), not at a sample, so {', '.join(data)} may change which samples those batches are"
        )
    return "; ".join(notes) or None
