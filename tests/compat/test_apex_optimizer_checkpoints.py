"""A checkpoint written by Apex's fused optimizers resumes in ampkit's: Apex kept the step count in the param
group (FusedAdam, FusedLAMB, FusedMixedPrecisionLamb, FusedNovoGrad), no step at all (FusedAdagrad), and
FusedNovoGrad's second moments in the group as ``[fp16 params' norms, fp32 params' norms]``; and counted it as
Apex did."""

from __future__ import annotations

import copy

import pytest
import torch

from ampkit.compat import optimizers
from ampkit.ops import FusedLAMB

STEPS = 5


def _apex_layout(state_dict: dict, name: str) -> dict:
    """``state_dict`` of an ampkit optimizer rewritten the way Apex's optimizer of ``name`` laid it out."""
    sd = copy.deepcopy(state_dict)
    for group in sd["param_groups"]:
        states = [sd["state"][i] for i in group["params"]]
        if name == "novograd":
            norms = torch.stack([s.pop("exp_avg_sq").float() for s in states])
            group["exp_avg_sq"] = [torch.empty(0, dtype=torch.float16), norms]
        else:
            for s in states:
                s.pop("step")
            if name != "adagrad":
                group["step"] = STEPS
    return sd


MAKERS = {
    "adam": lambda p: optimizers.FusedAdam(p, lr=1e-2, weight_decay=0.01),
    "lamb": lambda p: optimizers.FusedLAMB(p, lr=1e-2, weight_decay=0.0),
    "mixed_lamb": lambda p: optimizers.FusedMixedPrecisionLamb(p, lr=1e-2, weight_decay=0.0),
    "novograd": lambda p: optimizers.FusedNovoGrad(p, lr=1e-2),
    "adagrad": lambda p: optimizers.FusedAdagrad(p, lr=1e-1),
}


@pytest.mark.parametrize("name", list(MAKERS))
def test_an_apex_checkpoint_resumes_where_it_stopped(name):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(7, 3)), torch.nn.Parameter(torch.randn(5))]
    grads = [[torch.randn_like(p) for p in params] for _ in range(STEPS + 1)]
    optimizer = MAKERS[name](params)
    for step_grads in grads[:STEPS]:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
    saved = _apex_layout(optimizer.state_dict(), name)
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = MAKERS[name](resumed_params)
    resumed.load_state_dict(saved)
    for opt, ps in ((optimizer, params), (resumed, resumed_params)):
        for p, g in zip(ps, grads[STEPS], strict=True):
            p.grad = g.clone()
        opt.step()
    for ours, theirs in zip(resumed_params, params, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    # Apex's names count per group as Apex did, so the group keeps its count (ampkit's Adagrad counts per param)
    assert ("step" in resumed.param_groups[0]) == (name != "adagrad")


PER_PARAMETER_COUNTS = {
    "adam": (
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01),
        lambda p: optimizers.FusedAdam(p, lr=1e-2, weight_decay=0.01),
    ),
    "lamb": (
        lambda p: FusedLAMB(p, lr=1e-2, weight_decay=0.01),
        lambda p: optimizers.FusedLAMB(p, lr=1e-2, weight_decay=0.01),
    ),
}


@pytest.mark.parametrize("name", list(PER_PARAMETER_COUNTS))
def test_a_checkpoint_counting_steps_per_parameter_resumes_at_its_step_under_apexs_names(name):
    """torch.optim's and ampkit's own optimizers count steps per parameter; Apex's names count per group, and read
    no count from such a checkpoint: the group restarted at 0, so the resumed steps took step 1's bias correction."""
    saver, loader = PER_PARAMETER_COUNTS[name]
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(7, 3, dtype=torch.float64)), torch.nn.Parameter(torch.randn(5).double())]
    grads = [[torch.randn_like(p) for p in params] for _ in range(STEPS + 2)]
    uninterrupted = saver(params)
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    first = saver(resumed_params)
    for i, step_grads in enumerate(grads):
        if i == STEPS:
            resumed = loader(resumed_params)
            resumed.load_state_dict(first.state_dict())
            first = resumed
        for opt, ps in ((uninterrupted, params), (first, resumed_params)):
            for p, g in zip(ps, step_grads, strict=True):
                p.grad = g.clone()
            opt.step()
    for ours, theirs in zip(resumed_params, params, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    assert first.param_groups[0]["step"] == STEPS + 2


@pytest.mark.parametrize("name", ["FusedAdam", "FusedLAMB", "FusedNovoGrad"])
def test_apexs_names_count_a_step_a_group_sat_out_without_gradients(name):
    """Apex's FusedAdam, FusedLAMB and FusedNovoGrad advanced each group's ``step`` at every ``step()``, gradients or
    not: a group's first update after steps without gradients takes the bias correction of the steps taken."""
    cls = getattr(optimizers, name)
    sat_out, counted = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    sitting = cls([sat_out], lr=0.1)
    sitting.step()  # no gradient yet
    told = cls([counted], lr=0.1)
    told.param_groups[0]["step"] = 1
    for param, optimizer in ((sat_out, sitting), (counted, told)):
        param.grad = torch.tensor([0.5, -1.0, 2.0])
        optimizer.step()
    assert sitting.param_groups[0]["step"] == told.param_groups[0]["step"] == 2
    torch.testing.assert_close(sat_out, counted, rtol=0, atol=0)
