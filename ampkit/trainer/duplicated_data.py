"""Under torchrun, a training stream no sampler deals to the ranks (an IterableDataset, an iterable of the user's) may
give every rank the same batches: each rank then trains on the same samples, N-fold, without a word. Lightning does
not look; ampkit compares the ranks' first batches once per fit (one gather of a short digest), so a stream that
shards itself (by ``torch.distributed.get_rank()``) is never named, and only batches alike on every rank are."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from itertools import chain
from typing import Any

import torch
import torch.utils._pytree as pytree
from lightning_utilities.core.rank_zero import rank_zero_warn

from ampkit.trainer.distributed import DistributedEnv, gather_object, sampler_of

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
        self.pending = env.enabled and not _dealt_by_a_sampler(loader)

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
        self.pending = False
        self._compare(batch_fingerprint(batch))
        yield batch

    def _compare(self, fingerprint: str | None) -> None:
        fingerprints = gather_object(fingerprint, self.env)
        if None in fingerprints or len(set(fingerprints)) > 1:
            return
        what = getattr(self.loader, "dataset", self.loader)
        rank_zero_warn(
            f"{self.source} gave each of the {self.env.world_size} ranks the same first batch: its "
            f"{type(what).__name__} is not sharded across ranks (no DistributedSampler deals it, and ampkit does not "
            f"split a stream), so every rank trains on the same samples, {self.env.world_size} times over; in its "
            "__iter__, keep the samples of torch.distributed.get_rank() out of every get_world_size() (and of "
            "get_worker_info() under DataLoader workers), or use a map-style Dataset, which ampkit shards (samples "
            "alike by design, such as a constant benchmark batch, may ignore this)"
        )


def _dealt_by_a_sampler(loader: Any) -> bool:
    """Whether a ``DistributedSampler`` gives each rank its own share of ``loader``'s samples."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    if not isinstance(loader, DataLoader):
        return False
    return isinstance(loader.sampler, DistributedSampler) or isinstance(sampler_of(loader), DistributedSampler)
