"""The ``torch.Generator`` objects a training loader draws from besides torch's global RNG, captured and restored with
a checkpoint: a sampler given its own generator (``WeightedRandomSampler(..., generator=g)``) draws each epoch's order
from it, and a loader's ``generator=`` seeds its workers, so a resume must put them where the saved run had them.
A sampler seeded per epoch (``set_epoch``) is told each epoch here too."""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn


def _owners(loader: Any) -> tuple[Any, ...]:
    """``loader``, its sampler, its batch sampler and that one's sampler (a ``batch_sampler=`` hides its own)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    return loader, getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None)


def set_sampler_epoch(loader: Any, epoch: int) -> None:
    """Tell each of ``loader``'s samplers that has a ``set_epoch`` (a ``DistributedSampler``, whose order is a function
    of it) which epoch starts, each once, as Lightning does: one never told shuffles every epoch alike."""
    told: list[Any] = []
    for owner in _owners(loader)[1:]:
        if callable(getattr(owner, "set_epoch", None)) and all(owner is not seen for seen in told):
            owner.set_epoch(epoch)
            told.append(owner)


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The generators of ``loader``, its sampler and its batch sampler (and that one's sampler), each once."""
    found: list[torch.Generator] = []
    for owner in _owners(loader):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not seen for seen in found):
            found.append(generator)
    return found


def capture_generators(loader: Any) -> list[torch.Tensor]:
    """The states of :func:`loader_generators`, as tensors a ``weights_only`` load reads."""
    return [generator.get_state() for generator in loader_generators(loader)]


def restore_generators(loader: Any, states: list[torch.Tensor]) -> None:
    """Put ``loader``'s generators back to ``states`` (from :func:`capture_generators`); a loader that now has other
    generators than the saved one keeps its own, with a warning that its order is not the saved run's."""
    generators = loader_generators(loader)
    if len(generators) != len(states):
        rank_zero_warn(
            f"the checkpoint holds the state of {len(states)} torch.Generator(s) of the train loader (its own, its "
            f"sampler's), this run's train_dataloader() has {len(generators)}: they are not restored, so the samples "
            "they order (or the workers they seed) differ from the saved run's"
        )
        return
    for generator, state in zip(generators, states, strict=True):
        generator.set_state(state)
