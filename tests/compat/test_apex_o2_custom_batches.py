"""O2/O3's boundary casts of inputs and outputs that are objects of the script's own classes: Apex cast them with
their own ``.to(dtype)`` ("provide your custom batch class with a .to(dtype) method", its applier's contract), so
such a batch reaches the half model in half precision and such an output comes back as the class made it."""

from __future__ import annotations

import collections
from typing import NamedTuple

import pytest
import torch

from ampkit.compat import amp


class Batch:
    """A batch class with the ``.to`` Apex asked for: floating tensors follow, integer labels stay."""

    def __init__(self, x: torch.Tensor, labels: torch.Tensor) -> None:
        self.x, self.labels = x, labels

    def to(self, *args, **kwargs) -> Batch:
        return Batch(self.x.to(*args, **kwargs), self.labels)


class Masked(NamedTuple):
    """A NamedTuple batch whose ``.to`` keeps its mask in float32: the class decides, as under Apex."""

    x: torch.Tensor
    mask: torch.Tensor

    def to(self, dtype: torch.dtype) -> Masked:
        return Masked(self.x.to(dtype), self.mask)


class Scores:
    """An output class with a ``.to``: the boundary cast calls it with the output dtype."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def to(self, dtype: torch.dtype) -> Scores:
        return Scores(self.logits.to(dtype))


class DeviceOnly:
    """A batch whose ``.to`` takes a device only (as torch_geometric's ``Data`` and DGL's graphs do)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def to(self, device: str | torch.device) -> DeviceOnly:
        return DeviceOnly(self.x.to(device=device))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.seen: list[torch.dtype] = []

    def forward(self, batch, helper: torch.nn.Module | None = None) -> Scores:
        if isinstance(batch, Masked):
            self.seen.append(batch.mask.dtype)
        self.seen.append(batch.x.dtype)
        return Scores(self.linear(batch.x))


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_a_custom_batch_and_output_are_cast_by_their_own_to(opt_level):
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    batch = Batch(torch.randn(2, 4), torch.tensor([0, 2]))
    out = model(batch)
    assert model.seen == [torch.float16]
    assert isinstance(out, Scores) and out.logits.dtype == torch.float32
    assert batch.x.dtype == torch.float32, "the caller's batch is not changed"
    with amp.scale_loss(torch.nn.functional.cross_entropy(out.logits, batch.labels), optimizer) as scaled:
        scaled.backward()
    optimizer.step()


def test_the_class_decides_what_its_to_casts_and_the_output_type_follows_cast_model_outputs():
    model = Net()
    model = amp.initialize(model, opt_level="O2", cast_model_outputs=torch.float16, verbosity=0)
    out = model(Masked(torch.randn(2, 4), torch.ones(2, 4)))
    assert model.seen == [torch.float32, torch.float16]  # mask kept float32 by Masked.to, x half
    assert out.logits.dtype == torch.float16


def test_a_module_passed_to_forward_is_not_cast():
    """Apex's applier cast any argument with a ``.to``, a module too (in place); here modules are left alone."""
    model = amp.initialize(Net(), opt_level="O2", verbosity=0)
    helper = torch.nn.Linear(2, 2)
    model(Batch(torch.randn(2, 4), torch.tensor([0, 1])), helper=helper)
    assert helper.weight.dtype == torch.float32


def test_a_batch_whose_to_takes_no_dtype_is_named():
    model = amp.initialize(Net(), opt_level="O2", verbosity=0)
    with pytest.raises(TypeError, match=r"DeviceOnly.*\.to\(torch\.float16\)"):
        model(DeviceOnly(torch.randn(2, 4)))


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_defaultdict_of_losses_comes_back_cast_with_its_factory(opt_level):
    """A model returning its losses in a ``collections.defaultdict`` (and taking one): rebuilding it with
    ``defaultdict(dict_of_values)`` failed ("first argument must be callable or None") at O2, and under O1 with
    ``cast_model_outputs``; Apex returned a plain dict."""

    class Losses(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 2)

        def forward(self, x: torch.Tensor, weights: collections.defaultdict) -> collections.defaultdict:
            losses = collections.defaultdict(float)
            losses["cls"] += (self.linear(x) * weights["cls"].to(x.dtype)).sum()
            return losses

    kwargs = {"cast_model_outputs": torch.float32} if opt_level == "O1" else {}
    model = amp.initialize(Losses(), opt_level=opt_level, verbosity=0, **kwargs)
    out = model(torch.randn(3, 4), collections.defaultdict(lambda: torch.ones(1), {"cls": torch.ones(2)}))
    assert isinstance(out, collections.defaultdict) and out.default_factory is float
    assert out["cls"].dtype == torch.float32 and out["box"] == 0.0
