"""How a checkpoint's state differs from this run's, said in one line before torch's loads would refuse it: the model
key by key and shape by shape (``load_state_dict`` lists every key in a wall of text whose last line, all a one-line
error keeps, names only one kind of difference), an optimizer's param groups by size and parameter name (torch says
only "a different number of parameter groups"), and its schedulers by class (a zip() error, or another class's
state loaded into this one's without a word)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from ampkit.trainer.user_code import first_names
from ampkit.wording import counted

Shape = tuple[int, ...] | None  # None: an entry that is no tensor (a module's extra state)


class StateMisfit(RuntimeError):
    """A checkpoint's state does not fit what it is loaded into; the message names each difference."""


def shapes_of(state: Mapping[str, Any]) -> dict[str, Shape]:
    """Each entry of a state dict with its tensor's shape (None for an entry that is no tensor, or a lazy module's
    parameter not made yet: loading gives it the checkpoint's shape)."""
    return {
        key: tuple(value.shape) if isinstance(value, torch.Tensor) and not is_lazy(value) else None
        for key, value in state.items()
    }


def _shape(shape: Shape) -> str:
    return "" if shape is None else f" {list(shape)}"


def model_misfit(saved: Mapping[str, Shape], ours: Mapping[str, Shape], shown: int = 4) -> str | None:
    """The keys this run's model (``ours``) has that the checkpoint (``saved``) lacks, the tensors the checkpoint has
    that the model lacks, and the tensors whose shapes differ, each with its shapes; None when none does."""
    missing = [f"{key}{_shape(shape)}" for key, shape in ours.items() if key not in saved]
    unexpected = [f"{key}{_shape(shape)}" for key, shape in saved.items() if key not in ours and shape is not None]
    resized = [
        (key, saved[key], shape)
        for key, shape in ours.items()
        if shape is not None and saved.get(key) is not None and saved[key] != shape
    ]
    parts = [f"Missing key(s) in the checkpoint: {first_names(missing, shown)}"] * bool(missing)
    parts += [f"Unexpected key(s) in the checkpoint: {first_names(unexpected, shown)}"] * bool(unexpected)
    if resized:
        key, then, now = resized[0]
        part = f"size mismatch for {key}: shape {list(then)} in the checkpoint, {list(now)} in this run's model"
        others = [f"{key} {list(then)} -> {list(now)}" for key, then, now in resized[1:]]
        parts.append(part + (f"; also {first_names(others, shown - 1)}" if others else ""))
    return "; ".join(parts) or None


def load_model_state(module: torch.nn.Module, state: Mapping[str, Any]) -> None:
    """``module.load_state_dict(state)``, first raising :class:`StateMisfit` naming every difference of keys and
    shapes (what ``load_state_dict`` would refuse, said in one line)."""
    misfit = model_misfit(shapes_of(state), shapes_of(module.state_dict()))
    if misfit is not None:
        raise StateMisfit(misfit)
    module.load_state_dict(state)


def _groups(sizes: list[int]) -> str:
    groups = counted(len(sizes), "param group")
    return f"{groups} of {', '.join(map(str, sizes))} parameter{'' if sizes == [1] else 's'}"


def check_optimizer_fits(
    name: str,
    then: list[int],
    optimizer: torch.optim.Optimizer,
    saved_names: list[list[str | None]] | None,
    our_names: list[list[str | None]],
) -> None:
    """Raise :class:`StateMisfit` when the checkpoint's param groups (``then``: their sizes) are not ``optimizer``'s:
    their sizes, and the parameters (by name, ``saved_names`` as the checkpoint recorded them) held on one side only."""
    now = [len(group["params"]) for group in optimizer.param_groups]
    if then == now:
        return
    text = f"optimizer '{name}' holds {_groups(then)} in the checkpoint, {_groups(now)} in this run"
    if saved_names is not None:
        held_then = [n for group in saved_names for n in group if n is not None]
        held_now = [n for group in our_names for n in group if n is not None]
        only_now = [n for n in held_now if n not in set(held_then)]
        only_then = [n for n in held_then if n not in set(held_now)]
        text += f"; only this run's holds {first_names(only_now, 4)}" * bool(only_now)
        text += f"; only the checkpoint's holds {first_names(only_then, 4)}" * bool(only_then)
    raise StateMisfit(
        f"{text}: its state cannot be restored into other param groups. Resume with configure_optimizers() building "
        "them as the saved run had, or start a new run that loads the checkpoint's weights in configure_model()"
    )


def check_schedulers_fit(name: str, saved_types: list[str] | None, saved_count: int, schedulers: list[Any]) -> None:
    """Raise :class:`StateMisfit` when optimizer ``name``'s schedulers are not those the checkpoint saved, by count
    or (where it recorded them) class: ``load_state_dict`` of another class's state takes its attributes silently."""
    now = [type(scheduler).__name__ for scheduler in schedulers]
    if len(now) == saved_count and (saved_types is None or saved_types == now):
        return
    then = ", ".join(saved_types) if saved_types is not None else f"{saved_count} scheduler(s)"
    raise StateMisfit(
        f"optimizer '{name}' has the lr schedulers [{then or 'none'}] in the checkpoint, [{', '.join(now) or 'none'}] "
        "in this run: their state (the steps taken, the decay so far) restores only into the same schedulers. "
        "Resume with configure_optimizers() returning those, or start a new run"
    )
