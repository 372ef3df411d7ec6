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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_grad_scale_of_another_float_dtype_is_refused_as_torchs_fused_adam_refuses_it(name, dtype):
    """torch.optim.Adam(fused=True) refuses it ('expected scalar type Float'); every fused optimizer here converted
    it to float32 without a word (a float16 scale of 2**16 is inf: the step was skipped for good)."""
    params = _model_params()
    optimizer = OPTIMIZERS[name](params)
    before = [p.detach().clone() for p in params]
    with pytest.raises(TypeError, match=rf"grad_scale must be a float32 one-element tensor .* got a {dtype} tensor"):
        optimizer.step(grad_scale=torch.tensor(2.0, dtype=dtype), found_inf=torch.tensor(0.0))
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    with pytest.raises(RuntimeError, match="expected scalar type Float"):  # torch's own refusal, the spec
        _torch_fused_adam(dtype)


def _torch_fused_adam(dtype):
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    optimizer = torch.optim.Adam([p], fused=True)
    optimizer.grad_scale, optimizer.found_inf = torch.tensor(2.0, dtype=dtype), torch.tensor(0.0)
    optimizer.step()
