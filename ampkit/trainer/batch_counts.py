"""What one batch holds, as the Trainer's ``samples_in`` and ``tokens_in`` say: checked counts for the epoch
means, validation averages and throughput figures; how many batches a loader says it has; and how many batches a
``limit_*_batches`` setting leaves."""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ampkit.config import ConfigError
from ampkit.trainer.user_code import UserCodeError
from ampkit.wording import counted, shown


def checked_count(value: Any, owner: object, method: str) -> int | None:
    """``value`` returned by ``owner.<method>(batch)``: None (unknown) or an integer >= 0.

    Raises:
        TypeError: not an integer (a float, a bool, a tensor), naming the method and the value.
        ValueError: a negative integer.
    """
    if value is None:
        return None
    if type(value) is int and value >= 0:  # asked at every batch: an int skips the ABC check below
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if value >= 0:
            return int(value)
        problem, error = "negative", ValueError
    else:
        problem, error = f"a {type(value).__name__}, not an int", TypeError
        if isinstance(value, torch.Tensor):
            problem += " (count on the host, before the batch moves to the device, and return int(...))"
    raise error(
        f"{type(owner).__name__}.{method}(batch) returned {shown(value)}: {problem}; expected an integer >= 0 "
        "(the batch's count), or None where it is unknown"
    )


def loader_length(loader: Any, source: str) -> int | None:
    """``len(loader)``, None for a loader without a length: no ``__len__``, or one raising ``TypeError`` or
    ``NotImplementedError``, as streams' and some samplers' do.

    Raises:
        UserCodeError: its ``__len__`` raised another error, or returned no integer >= 0 (Python's own message named
            neither the loader, ``source``, nor the way out).
    """
    try:
        return len(loader)
    except (TypeError, NotImplementedError):
        return None
    except Exception as exc:
        raise UserCodeError(
            f"len({source}) raised {type(exc).__name__}: {exc}; its __len__ returns the number of batches of a pass "
            "(an integer >= 0), or raises TypeError where it has no length (the epoch then ends where the data does)"
        ) from exc


def batch_limit(limit: int | float | None, loader: Any, key: str, source: str) -> int | None:
    """``trainer.limit_*_batches`` (config ``key``) as a count of ``loader``'s batches, None for all: an int is a
    count, a float a fraction of the batches (Lightning's ``int(fraction * len)``; 1.0: all).

    Raises:
        ConfigError: a fraction below 1.0 of a loader without a length (``source`` names it), or one that leaves no
            batch.
    """
    if limit is None or isinstance(limit, int):
        return limit
    if limit >= 1.0:
        return None
    total = loader_length(loader, source)
    if total is None:
        raise ConfigError(
            f"config key '{key}': {limit} is a fraction of the batches, but {source} has no length (a stream): give "
            "a number of batches (an integer) instead"
        )
    count = int(total * limit)
    if count == 0:
        raise ConfigError(
            f"config key '{key}': {limit} of {source}'s {counted(total, 'batch', 'batches')} is less than one batch; "
            f"give at least {1 / total:.3g}, or a number of batches (an integer)"
        )
    return count


def shuffled_subset_message(loader: Any, limit: int | None, setting: Any, key: str, source: str) -> str | None:
    """Why a shuffled evaluation ``loader`` that ``limit`` batches of it cut (config ``key`` = ``setting``) is said:
    each validation then measures other samples, so its metrics, and the best checkpoint or early stopping that rank
    them, compare different subsets (Lightning warns of any shuffled evaluation loader). None where every
    validation measures the same samples: no shuffling, or a limit that leaves every batch."""
    from torch.utils.data import DataLoader, RandomSampler, SubsetRandomSampler
    from torch.utils.data.distributed import DistributedSampler

    if limit is None or not isinstance(loader, DataLoader):
        return None
    sampler = getattr(loader.batch_sampler, "sampler", loader.sampler)
    shuffled = isinstance(sampler, RandomSampler | SubsetRandomSampler) or (
        isinstance(sampler, DistributedSampler) and sampler.shuffle
    )
    total = loader_length(loader, source)
    if not shuffled or (total is not None and limit >= total):
        return None
    batches = "? batches" if total is None else counted(total, "batch", "batches")
    return (
        f"{source} shuffles its samples ({type(sampler).__name__}) and {key}={setting} runs {limit} of its "
        f"{batches}: each validation measures other samples, so its metrics (and a "
        "monitor ranking them: the best checkpoint, early stopping) compare different subsets; give it shuffle=False"
    )


def length_may_undercount(loader: Any) -> bool:
    """Whether a pass over ``loader`` may yield more batches than its ``len()``: a DataLoader over an IterableDataset
    (a stream's ``__len__`` is its author's count) or an iterable of the user's own; a DataLoader over a map-style
    dataset and a list count exactly."""
    from torch.utils.data import DataLoader, IterableDataset

    if isinstance(loader, DataLoader):
        return isinstance(loader.dataset, IterableDataset)
    return not isinstance(loader, Sequence)


def yields_more(iterator: Iterator[Any]) -> bool:
    """Whether ``iterator``, an epoch's pass cut at its loader's ``len()``, had a batch left: one more is fetched and
    dropped (each epoch starts a new pass); an error fetching it is no batch's the run trains on, so it says False.

    torch's DataLoader iterator warns of a stream longer than its ``len()`` (the caller's own warning names the way
    out); it is told the length is unknown instead of the warning being filtered, as ``warnings.catch_warnings``
    swaps the process's filters, which a run in another thread (or the loader's own code) shares."""
    if getattr(iterator, "_IterableDataset_len_called", None) is not None:
        iterator._IterableDataset_len_called = None  # type: ignore[attr-defined]  # reset with each new pass
    try:
        return next(iterator, _END) is not _END
    except Exception:
        return False


_END = object()
