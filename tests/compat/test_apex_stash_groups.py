"""The lists Apex's lazy init left in ``optimizer._amp_stash``, which code outside amp reads: under O2 the per-group
``fp16_groups`` / ``fp32_from_fp16_groups`` / ``fp32_from_fp32_groups`` (model weights averaged across ranks by a
local-SGD or gossip wrapper are written into their fp32 masters through them), and under O1/O3 ``all_fp16_params``
/ ``all_fp32_params``. Such code asks ``hasattr(optimizer._amp_stash, "fp16_groups")`` first, so where a list is
missing it silently does nothing, and the next step writes the stale masters back over the averaged weights."""

from __future__ import annotations

import pytest
import torch

from ampkit.compat import amp


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))


def _two_groups(model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return torch.optim.SGD([{"params": decay, "weight_decay": 0.01}, {"params": rest}], lr=0.1)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(seed))
    with amp.scale_loss(model(x).float().pow(2).mean(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    optimizer.zero_grad()


def _fp16_fp32_pairs(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The pairs a weight-averaging wrapper keeps in step, found as such wrappers find them."""
    if not (hasattr(optimizer, "_amp_stash") and hasattr(optimizer._amp_stash, "fp16_groups")):
        return []
    stash = optimizer._amp_stash
    groups = zip(stash.fp16_groups, stash.fp32_from_fp16_groups, strict=True)
    return [pair for fp16, fp32 in groups for pair in zip(fp16, fp32, strict=True)]


def test_o2_stash_lists_masters_per_param_group_as_apexs_lazy_init_did():
    model = _model()
    model, optimizer = amp.initialize(model, _two_groups(model), opt_level="O2", verbosity=0)
    stash = optimizer._amp_stash
    assert len(stash.fp16_groups) == len(stash.fp32_from_fp16_groups) == len(stash.fp32_from_fp32_groups) == 2
    for group, fp16, fp32_from_fp16, fp32_from_fp32 in zip(
        optimizer.param_groups, stash.fp16_groups, stash.fp32_from_fp16_groups, stash.fp32_from_fp32_groups, strict=True
    ):
        # The optimizer steps exactly the masters and the float32 (batch norm) parameters of the group.
        assert {id(p) for p in group["params"]} == {id(p) for p in fp32_from_fp16 + fp32_from_fp32}
        assert all(p.dtype == torch.float16 for p in fp16) and all(p.dtype == torch.float32 for p in fp32_from_fp16)
        for low, master in zip(fp16, fp32_from_fp16, strict=True):
            assert low.shape == master.shape and torch.equal(low.float(), master.half().float())
    batch_norm = {id(model[1].weight), id(model[1].bias)}
    assert {id(p) for g in stash.fp32_from_fp32_groups for p in g} == batch_norm
    assert [id(p) for p in stash.all_fp16_params] == [id(p) for g in stash.fp16_groups for p in g]
    assert [id(p) for p in stash.all_fp32_from_fp16_params] == [id(p) for g in stash.fp32_from_fp16_groups for p in g]
    assert [id(p) for p in stash.all_fp32_from_fp32_params] == [id(p) for g in stash.fp32_from_fp32_groups for p in g]
    assert not hasattr(stash, "all_fp32_params")  # Apex's O1/O3 list, absent under O2


def test_weights_averaged_into_the_masters_through_fp16_groups_survive_the_next_step():
    """A local-SGD style wrapper averages the model's fp16 weights after a step and writes them into their fp32
    copies through the stash's groups; the next step must start from the averaged weights."""
    model = _model()
    model, optimizer = amp.initialize(model, _two_groups(model), opt_level="O2", verbosity=0)
    _train_step(model, optimizer, 1)
    pairs = _fp16_fp32_pairs(optimizer)
    assert len(pairs) == 4  # the two Linear layers' weights and biases
    with torch.no_grad():
        for low, master in pairs:
            low.mul_(0.5)  # stands in for the all-reduce average of the ranks' weights
            master.copy_(low)
    averaged = [low.detach().clone() for low, _ in pairs]
    for group in optimizer.param_groups:
        group["lr"] = 0.0  # a step that changes nothing but copies the masters into the model
    _train_step(model, optimizer, 2)
    for (low, _), expected in zip(pairs, averaged, strict=True):
        assert torch.equal(low, expected)


@pytest.mark.parametrize(("opt_level", "low"), [("O1", False), ("O3", True)])
def test_levels_without_masters_list_the_parameters_by_dtype(opt_level, low):
    model = _model()
    model, optimizer = amp.initialize(model, _two_groups(model), opt_level=opt_level, verbosity=0)
    stash = optimizer._amp_stash
    every = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert [id(p) for p in stash.all_fp16_params] == (every if low else [])
    assert [id(p) for p in stash.all_fp32_params] == ([] if low else every)
    assert not hasattr(stash, "fp16_groups")  # so weight-averaging wrappers take the parameters as they are
    assert _fp16_fp32_pairs(optimizer) == []
    # O2's lists are absent, as in Apex: read as empty, a zero_grad over all_fp16_params + all_fp32_from_fp32_params
    # cleared no O1 gradient
    for o2_only in ("all_fp32_from_fp16_params", "all_fp32_from_fp32_params"):
        assert not hasattr(stash, o2_only)
        with pytest.raises(AttributeError, match=rf"_amp_stash.{o2_only} is Apex's list with master weights \(O2\)"):
            getattr(stash, o2_only)


def _swap_in_sampled_weight(optimizer: torch.optim.Optimizer, bank: torch.Tensor, seed: int) -> torch.nn.Parameter:
    """A partial-FC classifier: a fresh Parameter of sampled class centres replaces the last group's weight, and
    (for Apex, whose O1 unscaled the parameters of its own list) the stash's list is told too."""
    rows = torch.randperm(bank.shape[0], generator=torch.Generator().manual_seed(seed))[:3]
    sampled = torch.nn.Parameter(bank[rows].clone())
    optimizer.state.pop(optimizer.param_groups[-1]["params"][0], None)
    optimizer.param_groups[-1]["params"][0] = sampled
    if hasattr(optimizer._amp_stash, "all_fp32_params"):
        optimizer._amp_stash.all_fp32_params[-1] = sampled
    return sampled


def _partial_fc_loss(backbone: torch.nn.Module, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    normalize = torch.nn.functional.normalize
    return torch.nn.functional.linear(normalize(backbone(x).float()), normalize(weight)).float().logsumexp(-1).mean()


@pytest.mark.parametrize("combine_grad", [False, True])
def test_a_parameter_swapped_into_the_optimizer_before_each_o1_backward_gets_unscaled_gradients(combine_grad):
    torch.manual_seed(0)
    backbone, bank = torch.nn.Linear(4, 4), torch.randn(10, 4)
    first = torch.nn.Parameter(bank[:3].clone())
    optimizer = torch.optim.SGD([{"params": backbone.parameters()}, {"params": [first]}], lr=0.1, momentum=0.9)
    backbone, optimizer = amp.initialize(
        backbone, optimizer, opt_level="O1", loss_scale=1024.0, combine_grad=combine_grad, verbosity=0
    )
    for seed in range(3):
        sampled = _swap_in_sampled_weight(optimizer, bank, seed)
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 + seed))
        (expected,) = torch.autograd.grad(_partial_fc_loss(backbone, sampled, x), sampled)
        with amp.scale_loss(_partial_fc_loss(backbone, sampled, x), optimizer) as scaled:
            scaled.backward()
        torch.testing.assert_close(sampled.grad, expected, rtol=1e-2, atol=1e-4)  # not 1024 times it
        optimizer.step()
        optimizer.zero_grad()


def _frozen_first_layer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """O2 over a model whose first layer is frozen (a fine-tuned backbone) though the optimizer holds every parameter,
    the BatchNorm's weight frozen too (a float32 one)."""
    model = _model()
    model[0].requires_grad_(False)
    model[1].weight.requires_grad_(False)
    model, optimizer = amp.initialize(model, _two_groups(model), opt_level="O2", verbosity=0)
    return model, optimizer


def test_o2_gives_masters_only_to_parameters_that_require_a_gradient_as_apexs_lazy_init():
    """Apex's ``lazy_init_with_master_weights`` made an fp32 master only for a parameter with ``requires_grad``; a
    frozen one stayed in its group as it was, in none of the stash's lists, so ``amp.master_params`` yielded it
    itself. ampkit gave every fp16 parameter a master (a frozen backbone's fp32 copy, memory for nothing)."""
    model, optimizer = _frozen_first_layer()
    frozen = [model[0].weight, model[0].bias]
    masters = list(amp.master_params(optimizer))
    for param in frozen:
        assert param.dtype == torch.float16 and any(m is param for m in masters)
    assert [m.dtype for m in masters if m.requires_grad] == [torch.float32] * 3
    stash = optimizer._amp_stash
    assert [[tuple(p.shape) for p in g] for g in stash.fp16_groups] == [[(2, 8)], [(2,)]]
    assert [len(g) for g in stash.fp32_from_fp16_groups] == [1, 1]
    assert stash.fp32_from_fp32_groups == [[], [model[1].bias]]  # the frozen BatchNorm weight is in no list
    before = [p.detach().clone() for p in frozen]
    trained_before = model[2].weight.detach().clone()
    for seed in range(2):
        _train_step(model, optimizer, seed)
    assert all(torch.equal(p, b) for p, b in zip(frozen, before, strict=True))
    assert not torch.equal(model[2].weight, trained_before)

    # the checkpoint round trip: no master saved for a frozen parameter, the others restored exactly
    state = optimizer.state_dict()
    saved = state["ampkit_master_weights"]["master_params"]  # the fp16 parameters in the groups' order
    assert [m is None for m in saved] == [True, False, True, False]
    amp._amp_state.reset()
    model2, optimizer2 = _frozen_first_layer()
    model2.load_state_dict(model.state_dict())
    optimizer2.load_state_dict(state)
    for got, want in zip(amp.master_params(optimizer2), amp.master_params(optimizer), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)

    # a checkpoint of ampkit before this (a master for each fp16 parameter, a frozen one's equal to its value) still
    # loads: the frozen ones keep their values, and get no master
    frozen_left = iter(frozen)
    older = [next(frozen_left).detach().float() if m is None else m.clone() for m in saved]
    old = dict(state, ampkit_master_weights={"master_params": older})
    optimizer2.load_state_dict(old)
    assert torch.equal(model2[0].weight, model[0].weight)
    assert sum(m is p for m in amp.master_params(optimizer2) for p in model2[0].parameters()) == 2
    # one whose master holds more than its fp16 value trained before it was frozen: it gets that master back
    older[0] = older[0] + 2.0**-20
    optimizer2.load_state_dict(dict(state, ampkit_master_weights={"master_params": older}))
    master = next(iter(amp.master_params(optimizer2)))
    assert master.dtype == torch.float32 and torch.equal(master, older[0])
    assert torch.equal(model2[0].weight, older[0].half())


def test_a_frozen_o2_parameter_unfrozen_later_gets_its_master_then():
    """Apex left a parameter frozen at its lazy init out of every list for good: unfrozen, it stepped in fp16 on
    gradients still at the loss scale. Here it gets an fp32 master at the next backward and trains on unscaled ones."""
    model, optimizer = _frozen_first_layer()
    _train_step(model, optimizer, 0)
    model[0].requires_grad_(True)
    before = model[0].weight.detach().clone()
    _train_step(model, optimizer, 1)
    masters = list(amp.master_params(optimizer))
    assert not any(m is model[0].weight for m in masters) and masters[0].dtype == torch.float32
    assert optimizer._amp_stash.fp16_groups[0][0] is model[0].weight
    step = (model[0].weight.float() - before.float()).abs().max().item()
    assert 0 < step < 1  # moved, by an lr-sized step (at the loss scale it was 2**16 times that)
    assert len(optimizer.state_dict()["ampkit_master_weights"]["master_params"]) == 4
