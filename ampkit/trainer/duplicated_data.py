"""Under torchrun, a stream no sampler deals to the ranks (an IterableDataset, an iterable of the user's) may give
every rank the same batches: each rank then trains on the same samples, N-fold, or evaluates every sample N times
over, without a word. Lightning does not look; ampkit compares the ranks' first batches once (a short digest per
rank), so a stream that shards itself (by ``torch.distributed.get_rank()``) is never named, and only batches alike
on every rank are. Training compares at its first batch, where every rank has one; an evaluation pass, whose ranks
may run different counts (a rank with none), notes its first batch and compares in the gather that ends it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from itertools import chain
from typing import Any

import torch
import torch.utils._pytree as pytree
from lightning_utilities.core.rank_zero import rank_zero_warn

from ampkit.trainer.distributed import DistributedEnv, EvaluationBatches, gather_object, sampler_of

_NO_BATCH = object()


def batch_fingerprint(batch: Any) -> str | None:
    """A digest of ``batch``'s contents (its tensors' dtypes, shapes and bytes, and the ``repr`` of anything else,
    through dicts, lists and tuples); None where a tensor has no plain bytes to read (sparse, nested, quantized)."""
    digest = hashlib.blake2b(digest_size=16)
    for leaf in pytree.tree_leaves(batch):
        if not isinstance(leaf, torch.Tensor):
            digest.update(repr(leaf).encode())
            continue
        try:
            flat = leaf.detach().cpu().contiguous().reshape(-1)
            digest.update(f"{flat.dtype}{tuple(leaf.shape)}".encode())
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        except (RuntimeError, TypeError, NotImplementedError):
            return None
    return digest.hexdigest()


class FirstBatchComparison:
    """Compares the ranks' first training batch of a fit, once, where ``loader`` is not dealt to the ranks by a
    ``DistributedSampler``; warns (on rank zero) where every rank's is the same."""

    def __init__(self, loader: Any, env: DistributedEnv, source: str = "train_dataloader()") -> None:
        self.env, self.source, self.loader = env, source, loader
        self.pending = env.enabled and not _dealt_to_the_ranks(loader)

    def batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches``, the first one compared across ranks while a comparison is pending (every rank fetches its
        first batch at the same point: the loop agrees on each batch of a stream, or the counts are equal); after it,
        the loader's own iterator, with no Python frame per batch."""
        if not self.pending:
            return batches
        iterator = iter(batches)
        return chain(self._first(iterator), iterator)

    def _first(self, iterator: Iterator[Any]) -> Iterator[Any]:
        batch = next(iterator, _NO_BATCH)
        if batch is _NO_BATCH:  # an epoch with nothing left (a resume at its end): the next epoch's first, then
            return
        self.judge(gather_object(batch_fingerprint(batch), self.env))
        yield batch

    def judge(self, fingerprints: list[str | None]) -> None:
        """Warn where every rank's first batch has one fingerprint (None: a rank had none, or no plain bytes); the
        comparison is then done."""
        self.pending = False
        if None in fingerprints or len(set(fingerprints)) > 1:
            return
        what = getattr(self.loader, "dataset", self.loader)
        rank_zero_warn(
            f"{self.source} gave each of the {self.env.world_size} ranks the same first batch: its "
            f"{type(what).__name__} is not sharded across ranks (no DistributedSampler deals it, and ampkit does not "
            f"split a stream), so {self._outcome()}; in its __iter__, keep the samples of "
            "torch.distributed.get_rank() out of every get_world_size() (and of get_worker_info() under DataLoader "
            "workers), or use a map-style Dataset, which ampkit shards (samples alike by design, such as a constant "
            "benchmark batch, may ignore this)"
        )

    def _outcome(self) -> str:
        return f"every rank trains on the same samples, {self.env.world_size} times over"


class EvaluationFirstBatch(FirstBatchComparison):
    """The same comparison for an evaluation pass (validation, test, predict), whose ranks may run different numbers
    of batches, a rank none: the pass notes its first batch's fingerprint (:meth:`note`) and hands every rank's to
    :meth:`judge` from the gather that ends it, so the comparison costs no collective of its own."""

    def note(self, batch: Any) -> str | None:
        """The fingerprint of ``batch``, the pass's first, while the comparison is pending; else None."""
        return batch_fingerprint(batch) if self.pending else None

    def _outcome(self) -> str:
        n = self.env.world_size
        if self.source == "predict_dataloader()":
            return f"every rank predicts every sample, {n} times the work, and each rank's predictions hold them all"
        return f"every rank evaluates every sample: the means are right, but each pass does {n} times the work"


def _dealt_to_the_ranks(loader: Any) -> bool:
    """Whether each rank gets its own share of ``loader``'s samples: a ``DistributedSampler`` deals them, or ampkit's
    evaluation sharding (``EvaluationBatches``) does."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    if not isinstance(loader, DataLoader):
        return False
    if isinstance(loader.batch_sampler, EvaluationBatches):
        return True
    return isinstance(loader.sampler, DistributedSampler) or isinstance(sampler_of(loader), DistributedSampler)
