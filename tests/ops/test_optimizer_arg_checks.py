"""The fused optimizers' argument checks as a class: each hyper-parameter as torch.optim checks it, GradScaler's
tensors as torch's fused ops take them, checked once a step."""

import pytest
import torch

from ampkit.ops.optimizers import _base
from fused_optimizer_cases import OPTIMIZERS


def _model_params():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 4)), torch.nn.Parameter(torch.randn(7))]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("how", ["step", "scaled step", "step_with_grad_factor"])
def test_each_group_is_checked_once_a_step(name, how, monkeypatch):
    """The host-read optimizers (AdamP's first) ran the step-time group check twice: step() checked, then the
    step_with_grad_factor it called checked again."""
    params = _model_params()
    optimizer = OPTIMIZERS[name]([{"params": params[:1]}, {"params": params[1:]}])
    seen = []
    monkeypatch.setattr(_base, "check_group_at_step", lambda owner, index, group: seen.append(index))
    if how == "step":
        optimizer.step()
    elif how == "scaled step":
        optimizer.step(grad_scale=torch.tensor(2.0), found_inf=torch.tensor(0.0))
    else:
        optimizer.step_with_grad_factor(0.5)
    assert seen == [0, 1]
