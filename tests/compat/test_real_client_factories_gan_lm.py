"""Round seventeen of real Apex programs, one pattern per test (written here after the programs' own code, CPU-sized):

- an optimizer-factory module whose ``Adam``/``SGD`` forward every argument positionally to ``apex.optimizers``'
  ``FusedAdam``/``FusedSGD``, ``lr=torch.optim.optimizer.required`` included (Apex's ``FusedSGD`` default), with a
  ``DecayingCosineAnnealingWarmRestarts`` beside them;
- a GPT-2 adapter trainer: O2 with ``master_weights=False`` for an Adafactor that steps fp16 weights itself,
  ``cast_model_outputs=torch.float32`` on a model returning a tuple, chunks of a batch each in its own
  ``scale_loss`` before one step;
- hukkelas/DeepPrivacy's ``LossOptimizer``: a generator and a discriminator with their ``FusedAdam`` (betas as a
  list under lazy regularization) in one O1 ``initialize`` with ``num_losses`` = number of criteria, one ``loss_id``
  per criterion, a lazily applied gradient penalty through ``torch.autograd.grad(create_graph=True)``, and a resume
  that calls ``initialize`` a second time on the same models with new optimizers;
- transformers' question-answering scripts (``run_squad.py``), which call
  ``apex.amp.register_half_function(torch, "einsum")`` before ``initialize`` so that XLNet's attention einsums run in
  half at O1.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.optim.optimizer import required

from ampkit.compat import install_apex_shim, uninstall_apex_shim


@pytest.fixture
def shim():
    install_apex_shim()
    yield
    uninstall_apex_shim()


def _factory_sgd(params, lr=required, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                 wd_after_momentum=False, materialize_master_grads=True):  # fmt: skip
    """The factory's ``SGD``: Apex's positional order, its ``required`` default passed on."""
    from apex.optimizers import FusedSGD

    return FusedSGD(params, lr, momentum, dampening, weight_decay, nesterov, wd_after_momentum,
                    materialize_master_grads)  # fmt: skip


def _factory_adam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                  weight_decay=0.0, amsgrad=False, set_grad_none=True):  # fmt: skip
    from apex.optimizers import FusedAdam

    return FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad, set_grad_none)


def _bn_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    # no bias before the batch norm: its gradient would be rounding noise, which Adam turns into full-size steps
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8, bias=False), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
    )


def _groups(model: torch.nn.Module) -> list[dict]:
    rest = list(model[1].parameters()) + list(model[3].parameters())
    return [{"params": model[0].parameters(), "lr": 0.05}, {"params": rest, "lr": 0.1, "weight_decay": 1e-4}]


@pytest.mark.parametrize("make", ["sgd", "adam"])
def test_an_optimizer_factory_forwarding_apex_defaults_positionally_trains_at_o2_as_at_o0(shim, make):
    """The factory's ``SGD`` called without ``lr`` hands ``FusedSGD`` Apex's ``required``, with every param group
    naming its own ``lr``: Apex took it, ampkit refused it as an lr that is no number. At O2 (fp32 masters,
    ``materialize_master_grads=False``) the run tracks the float32 one."""
    from apex import amp

    def build(opt_level):
        model = _bn_mlp()
        if make == "sgd":
            optimizer = _factory_sgd(_groups(model), momentum=0.9, nesterov=True, materialize_master_grads=False)
        else:
            optimizer = _factory_adam(_groups(model), 1e-2, True, [0.9, 0.99])
        return amp.initialize(model, optimizer, opt_level=opt_level, loss_scale=128.0, verbosity=0)

    finals = {}
    for opt_level in ("O0", "O2"):
        model, optimizer = build(opt_level)
        assert [g["lr"] for g in optimizer.param_groups] == [0.05, 0.1]
        for i in range(5):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
            optimizer.zero_grad()
            with amp.scale_loss(F.mse_loss(model(x).float(), y), optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
        finals[opt_level] = [p.detach().float().clone() for p in amp.master_params(optimizer)]
    for ours, full in zip(finals["O2"], finals["O0"], strict=True):
        torch.testing.assert_close(ours, full, rtol=0, atol=2e-3)


def test_fused_sgd_with_apexs_required_lr_refuses_a_group_without_one(shim):
    from apex.optimizers import FusedSGD

    model = _bn_mlp()
    with pytest.raises(ValueError, match="didn't specify a value of required optimization parameter lr"):
        FusedSGD(model.parameters(), required, 0.9)
    optimizer = FusedSGD([{"params": model[0].parameters(), "lr": 0.1}], required)
    with pytest.raises(ValueError, match="required optimization parameter lr"):
        optimizer.add_param_group({"params": model[3].parameters()})
    with pytest.raises(ValueError, match=r"Invalid lr: -1"):
        FusedSGD(model.parameters(), -1)
