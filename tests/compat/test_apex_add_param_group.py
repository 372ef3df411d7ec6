"""add_param_group after amp.initialize (the semantics of Apex's test_add_param_group).

Training with a group added after ``initialize`` (under O2/O5 it gets fp32 masters on the spot) matches
training with both groups present from the start, bit for bit: at every opt level, whether the gradients
are zeroed through the model, the optimizer or ``param.grad = None``, with one or two backwards per
iteration, and with momentum state picked up by the new group.
"""

import pytest
import torch
from apex_test_helpers import half_exact_linear

from ampkit.compat import amp

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
ZEROING = ["model", "optimizer", "set_none"]


def _zero(how, model, optimizer):
    if how == "model":
        model.zero_grad()
    elif how == "optimizer":
        optimizer.zero_grad()
    else:
        for p in model.parameters():
            p.grad = None


def _backward(model, optimizer, x, accumulate):
    out = model(x).float()
    if accumulate:  # two backwards in one iteration: the grads of both add up
        with amp.scale_loss(out.pow(2).mean(), optimizer) as scaled:
            scaled.backward(retain_graph=True)
        with amp.scale_loss(out.abs().mean(), optimizer) as scaled:
            scaled.backward()
    else:
        with amp.scale_loss(out.pow(2).mean(), optimizer) as scaled:
            scaled.backward()


def _train(level, add_late, combine_grad, how_to_zero="optimizer", accumulate=False):
    first, second = half_exact_linear(4, 4, seed=3), half_exact_linear(4, 2, seed=4)
    model = torch.nn.Sequential(first, torch.nn.Tanh(), second)
    if add_late:
        optimizer = torch.optim.SGD(first.parameters(), lr=0.1, momentum=0.9)
    else:
        optimizer = torch.optim.SGD(
            [{"params": first.parameters()}, {"params": second.parameters(), "lr": 0.05}], lr=0.1, momentum=0.9
        )
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, combine_grad=combine_grad, verbosity=0)
    for it in range(4):
        if add_late and it == 1:
            optimizer.add_param_group({"params": second.parameters(), "lr": 0.05})
        _zero(how_to_zero, model, optimizer)
        x = torch.linspace(-1, 1, 24).reshape(6, 4) * (it + 1)
        _backward(model, optimizer, x, accumulate)
        if add_late and it == 0:
            second.weight.grad = None
            second.bias.grad = None  # not in the optimizer yet: the reference does not train it either
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("combine_grad", [False, True])
@pytest.mark.parametrize("level", LEVELS)
def test_group_added_after_initialize_trains_like_one_given_up_front(level, combine_grad):
    _check_late_matches_early(level, combine_grad, "optimizer", accumulate=False)


@pytest.mark.parametrize("accumulate", [False, True], ids=["one-backward", "two-backwards"])
@pytest.mark.parametrize("how_to_zero", ZEROING)
@pytest.mark.parametrize("level", LEVELS)
def test_added_group_trains_whichever_way_grads_are_zeroed(level, how_to_zero, accumulate):
    _check_late_matches_early(level, False, how_to_zero, accumulate)


def _check_late_matches_early(level, combine_grad, how_to_zero, accumulate):
    late_model, late_optimizer = _train(level, True, combine_grad, how_to_zero, accumulate)
    early_model, _ = _train_reference(level, combine_grad, how_to_zero, accumulate)
    for late, early in zip(late_model.parameters(), early_model.parameters(), strict=True):
        assert torch.equal(late, early)
    if level in ("O2", "O5"):
        assert all(p.dtype == torch.float32 for p in amp.master_params(late_optimizer))
    assert len(late_optimizer.param_groups) == 2
    momentum = [late_optimizer.state[p].get("momentum_buffer") for p in late_optimizer.param_groups[1]["params"]]
    assert all(buf is not None and buf.abs().sum() > 0 for buf in momentum)  # the new group has momentum now


def _train_reference(level, combine_grad, how_to_zero="optimizer", accumulate=False):
    """Both groups from the start, but the second one frozen during the first iteration."""
    first, second = half_exact_linear(4, 4, seed=3), half_exact_linear(4, 2, seed=4)
    model = torch.nn.Sequential(first, torch.nn.Tanh(), second)
    optimizer = torch.optim.SGD(
        [{"params": first.parameters()}, {"params": second.parameters(), "lr": 0.05}], lr=0.1, momentum=0.9
    )
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, combine_grad=combine_grad, verbosity=0)
    lr = optimizer.param_groups[1]["lr"]
    for it in range(4):
        optimizer.param_groups[1]["lr"] = 0.0 if it == 0 else lr
        _zero(how_to_zero, model, optimizer)
        x = torch.linspace(-1, 1, 24).reshape(6, 4) * (it + 1)
        _backward(model, optimizer, x, accumulate)
        if it == 0:
            for p in amp.master_params(optimizer):
                if p.shape[0] == 2:
                    p.grad = None
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("level", ["O2", "O5"])
@pytest.mark.parametrize("as_given", [lambda p: [p], lambda p: p, lambda p: iter([p])], ids=["list", "tensor", "iter"])
def test_a_parameter_already_stepped_through_its_master_is_refused_in_a_new_group(level, as_given):
    """Under master weights the optimizer holds fp32 masters, so torch's check for a parameter in two groups compared
    the model's parameter with them and let it in again: it got a second master, and the two groups' updates
    overwrote each other every step. As torch does for one optimizer, the group is refused and not kept."""
    model = half_exact_linear(4, 2, seed=3)
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, verbosity=0)
    with pytest.raises(
        ValueError, match=r"more than one parameter group: params\[0\] \(shape \(2, 4\)\) is already in"
    ):
        optimizer.add_param_group({"params": as_given(model.weight), "lr": 0.5})
    assert len(optimizer.param_groups) == 1
    extra = torch.nn.Parameter(torch.ones(3))
    optimizer.add_param_group({"params": iter([extra]), "lr": 0.5})  # a new parameter, as an iterator, still joins
    assert optimizer.param_groups[1]["params"] == [extra]


@pytest.mark.parametrize("delayed", [False, True], ids=["inside_the_block", "after_delay_unscale"])
def test_add_param_group_while_gradients_are_scaled_names_where_it_was_called(delayed):
    # A layer unfrozen mid-iteration: the error must say which scaled state the gradients are in, not always the
    # delay_unscale one, and leave the optimizer as it was.
    model = torch.nn.Linear(4, 2)
    head = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", loss_scale=8.0, verbosity=0)
    want = "delay_unscale=True" if delayed else "inside the `with amp.scale_loss"
    with amp.scale_loss(model(torch.ones(3, 4)).sum(), optimizer, delay_unscale=delayed) as scaled:
        scaled.backward()
        if not delayed:
            with pytest.raises(RuntimeError, match=want):
                optimizer.add_param_group({"params": head.parameters()})
    if delayed:
        with pytest.raises(RuntimeError, match=want):
            optimizer.add_param_group({"params": head.parameters()})
    assert len(optimizer.param_groups) == 1


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_add_param_group_runs_the_lazy_init_and_keeps_the_callers_dict_as_the_group(level):
    """Apex's add_param_group ran the lazy init first, through ``_lazy_init_maybe_master_weights`` (a script's wrapper
    of it ran there, once; the masters took the weights loaded since initialize), and kept the caller's dict as the
    group, its params swapped for fp32 masters under O2, as torch keeps it. Here the O2 dict was copied, so a later
    ``group["lr"] = ...`` on it was silently dropped, and the lazy init waited for the first backward."""
    first, second = half_exact_linear(4, 4, seed=3), half_exact_linear(4, 2, seed=4)
    model = torch.nn.Sequential(first, torch.nn.Tanh(), second)
    optimizer = torch.optim.SGD(first.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
    calls = []
    amps_own = optimizer._lazy_init_maybe_master_weights
    optimizer._lazy_init_maybe_master_weights = lambda: calls.append("lazy init") or amps_own()
    pretrained = half_exact_linear(4, 4, seed=5)
    first.load_state_dict(pretrained.state_dict())  # cast into the model after initialize
    group = {"params": second.parameters(), "lr": 0.05}
    optimizer.add_param_group(group)
    assert calls == ["lazy init"] and optimizer._amp_stash.lazy_init_called
    assert optimizer.param_groups[-1] is group
    assert [p.dtype for p in group["params"]] == [torch.float32] * 2  # O2's fp32 masters, O1's fp32 model
    for held, loaded in zip(optimizer.param_groups[0]["params"], first.parameters(), strict=True):
        assert torch.equal(held.to(loaded.dtype), loaded)  # the masters took the loaded weights
    group["lr"] = 0.0  # the new layer frozen through the caller's dict
    before = [p.detach().clone() for p in model.parameters()]
    with amp.scale_loss(model(torch.linspace(-1, 1, 24).reshape(6, 4)).float().pow(2).mean(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    moved = [not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True)]
    assert moved == [True, True, False, False]
    assert calls == ["lazy init"]
