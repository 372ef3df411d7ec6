"""add_param_group after amp.initialize (the semantics of Apex's test_add_param_group).

Training with a group added after ``initialize`` (under O2 it gets fp32 masters on the spot) matches
training with both groups present from the start, bit for bit.
"""

import pytest
import torch
from apex_test_helpers import half_exact_linear

from ampkit.compat import amp


def _train(level, add_late, combine_grad):
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
        optimizer.zero_grad()
        x = torch.linspace(-1, 1, 24).reshape(6, 4) * (it + 1)
        with amp.scale_loss(model(x).float().pow(2).mean(), optimizer) as scaled:
            scaled.backward()
        if add_late and it == 0:
            second.weight.grad = None
            second.bias.grad = None  # not in the optimizer yet: the reference does not train it either
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("combine_grad", [False, True])
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_group_added_after_initialize_trains_like_one_given_up_front(level, combine_grad):
    late_model, late_optimizer = _train(level, add_late=True, combine_grad=combine_grad)
    early_model, _ = _train_reference(level, combine_grad)
    for late, early in zip(late_model.parameters(), early_model.parameters(), strict=True):
        assert torch.equal(late, early)
    if level == "O2":
        assert all(p.dtype == torch.float32 for p in amp.master_params(late_optimizer))
        assert len(late_optimizer.param_groups) == 2


def _train_reference(level, combine_grad):
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
        optimizer.zero_grad()
        x = torch.linspace(-1, 1, 24).reshape(6, 4) * (it + 1)
        with amp.scale_loss(model(x).float().pow(2).mean(), optimizer) as scaled:
            scaled.backward()
        if it == 0:
            for p in amp.master_params(optimizer):
                if p.shape[0] == 2:
                    p.grad = None
        optimizer.step()
    return model, optimizer
