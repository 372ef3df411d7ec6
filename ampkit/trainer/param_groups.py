"""Which parameters train: training code changes it mid-run (a fine-tuning run unfreezes its backbone, or adds it to
its optimizer as a param group). Whatever keeps a list of the trainable parameters must follow, and each checkpoint
records both by parameter name, so a resume rebuilds them before the optimizers' states load
(``configure_model`` and ``configure_optimizers`` only make the run's start)."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch

from ampkit.amp.trainable import any_requires_grad

TRAINABLE_KEY = "trainable"


def trainable_record(
    module: torch.nn.Module,
    optimizers: dict[str, torch.optim.Optimizer],
    stand_ins: Iterable[tuple[torch.Tensor, torch.Tensor]] = (),
) -> dict[str, Any]:
    """Each optimizer's param groups as parameter names (None: not a parameter of ``module``), and the frozen names.
    ``stand_ins``: (parameter, the tensor an optimizer holds in its place), as O2's fp32 masters."""
    names = {id(param): name for name, param in module.named_parameters()}
    names.update({id(held): names[id(param)] for param, held in stand_ins if id(param) in names})
    return {
        "groups": {
            opt_name: [[names.get(id(p)) for p in group["params"]] for group in optimizer.param_groups]
            for opt_name, optimizer in optimizers.items()
        },
        "frozen": [name for name, param in module.named_parameters() if not param.requires_grad],
    }


def restore_trainable(
    module: torch.nn.Module, optimizers: dict[str, torch.optim.Optimizer], record: dict[str, Any] | None
) -> None:
    """Freeze and unfreeze ``module``'s parameters as ``record`` says, and add to each optimizer the param groups
    the checkpoint's had beyond this run's (their hyperparameters come with the optimizer's state). A group that
    cannot be rebuilt (other parameter names) is left: loading the optimizer's state then says it does not fit."""
    if record is None:  # a checkpoint from before the record was kept
        return
    params = dict(module.named_parameters())
    frozen = set(record["frozen"])
    for name, param in params.items():
        if param.requires_grad == (name in frozen):
            param.requires_grad_(name not in frozen)
    for opt_name, saved in record["groups"].items():
        optimizer = optimizers.get(opt_name)
        if optimizer is None or len(saved) <= len(optimizer.param_groups):
            continue
        names = {id(param): name for name, param in params.items()}
        ours = [[names.get(id(p)) for p in group["params"]] for group in optimizer.param_groups]
        added = saved[len(ours) :]
        if ours != saved[: len(ours)] or any(name not in params for group in added for name in group):
            continue
        for group in added:
            optimizer.add_param_group({"params": [params[name] for name in group]})


class TrainableParams:
    """Tells a cache of the trainable parameters when to rebuild: training code unfroze or froze a parameter, or
    added, removed or replaced a param group, since the last look (a fine-tuning run unfreezing its backbone at some
    epoch)."""

    def __init__(self, module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self._params = list(module.parameters())
        self._optimizers = list(optimizers)
        self._lists: list[list[torch.Tensor]] | None = None  # each param group's list of tensors at the last look
        self._lengths: list[int] = []  # and its length
        self._trainable: list[bool] = []
        self._frozen: list[torch.Tensor] = []  # the parameters frozen at the last look

    def _group_lists(self) -> list[list[torch.Tensor]]:
        """Each param group's list of tensors, as the optimizers hold it."""
        return [group["params"] for optimizer in self._optimizers for group in optimizer.param_groups]

    def _same_groups(self, lists: list[list[torch.Tensor]]) -> bool:
        """Whether the param groups' ``lists`` are those of the last look, each as long: a group added, removed or
        replaced (even by one of the same size) or a list given another length is seen. The lists are held, so a new
        one cannot take a freed one's id, and compared by identity (``==`` would compare their tensors). A tensor
        assigned in place into a list is not seen: that would read every tensor each time."""
        seen = self._lists
        return (
            seen is not None
            and len(lists) == len(seen)
            and all(map(operator.is_, lists, seen))
            and list(map(len, lists)) == self._lengths
        )

    def changed(self) -> bool:
        """Whether they changed since the last call (True at the first). Asked once an iteration by each callback
        that keeps such a list, it reads every parameter's ``requires_grad`` (about 80 ns each): a comprehension,
        not a generator unpacked into a tuple (a fifth less)."""
        trainable = [param.requires_grad for param in self._params]
        lists = self._group_lists()
        if self._same_groups(lists) and trainable == self._trainable:
            return False
        self._lists, self._lengths, self._trainable = lists, list(map(len, lists)), trainable
        self._frozen = [param for param, grad in zip(self._params, trainable, strict=True) if not grad]
        return True

    def grew(self) -> bool:
        """Whether a parameter frozen at the last look requires a gradient now, or a param group was added or replaced;
        when so, the look is taken again as :meth:`changed` takes it. For the backwards after an iteration's first: it
        reads only the frozen parameters, nothing in a model with none (one frozen since is found at the next
        :meth:`changed`; until then a backward gives it no gradient, which a cache that still holds it handles)."""
        if not self._same_groups(self._group_lists()):
            return self.changed()
        return any_requires_grad(self._frozen) and self.changed()
