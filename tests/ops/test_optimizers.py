"""Fused optimizers vs torch.optim (100 fp32 steps), vs float64 references of the Apex/timm/AdamP maths,
state_dict round trips, the GradScaler contract, master weights and argument errors."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from fused_optimizer_cases import ALL_FUSED

from ampkit.ops.optimizers import (
    FusedAdadelta,
    FusedAdagrad,
    FusedAdam,
    FusedAdamP,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedRMSprop,
    FusedRMSpropTF,
    FusedSGD,
)

SHAPES = [(7, 13), (29,), (3, 5, 4), (1,)]


@pytest.fixture(autouse=True)
def kernel_mode(monkeypatch):
    monkeypatch.setenv("AMPKIT_OPS", "kernel")


def make_params(dtype=torch.float32, shapes=SHAPES):
    return [torch.nn.Parameter(torch.randn(s, dtype=torch.float64).to(dtype)) for s in shapes]


def clone_params(params, dtype=None):
    return [torch.nn.Parameter(p.detach().to(dtype or p.dtype, copy=True)) for p in params]


def rel_diff(actual, expected) -> float:
    num = max(
        float((a.detach().double() - e.detach().double()).abs().max()) for a, e in zip(actual, expected, strict=True)
    )
    den = max(float(e.detach().double().abs().max()) for e in expected)
    return num / den


def run_side_by_side(ours, theirs, a_params, b_params, steps=100, skip_every=0):
    """Feed identical fresh random grads to both; param 1 gets no grad every ``skip_every`` steps."""
    for step in range(steps):
        for i, (a, b) in enumerate(zip(a_params, b_params, strict=True)):
            if skip_every and i == 1 and step % skip_every == 0:
                a.grad = b.grad = None
                continue
            g = torch.randn(a.shape, dtype=torch.float64)
            a.grad, b.grad = g.to(a.dtype), g.to(b.dtype)
        ours.step()
        theirs.step()


TORCH_PAIRS = {
    "adamw": (
        lambda p: FusedAdam(p, lr=1e-3, weight_decay=0.05),
        lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.05),
    ),
    "adam_l2_amsgrad": (
        lambda p: FusedAdam(p, lr=1e-3, weight_decay=0.05, adam_w_mode=False, amsgrad=True),
        lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=0.05, amsgrad=True),
    ),
    "adam_maximize": (
        lambda p: FusedAdam(p, lr=1e-3, betas=(0.8, 0.99), maximize=True),
        lambda p: torch.optim.AdamW(p, lr=1e-3, betas=(0.8, 0.99), weight_decay=0.0, maximize=True),
    ),
    "sgd_momentum_dampening": (
        lambda p: FusedSGD(p, lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=1e-2),
        lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=1e-2),
    ),
    "sgd_nesterov": (
        lambda p: FusedSGD(p, lr=1e-2, momentum=0.9, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True),
    ),
    "sgd_plain": (lambda p: FusedSGD(p, lr=1e-2), lambda p: torch.optim.SGD(p, lr=1e-2)),
    "adagrad": (
        lambda p: FusedAdagrad(p, lr=1e-2, lr_decay=1e-3, weight_decay=1e-2, initial_accumulator_value=0.1),
        lambda p: torch.optim.Adagrad(p, lr=1e-2, lr_decay=1e-3, weight_decay=1e-2, initial_accumulator_value=0.1),
    ),
    "rmsprop_centered_momentum": (
        lambda p: FusedRMSprop(p, lr=1e-3, momentum=0.9, centered=True, weight_decay=1e-2),
        lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9, centered=True, weight_decay=1e-2),
    ),
    "rmsprop_plain": (lambda p: FusedRMSprop(p, lr=1e-3), lambda p: torch.optim.RMSprop(p, lr=1e-3)),
    "adadelta": (
        lambda p: FusedAdadelta(p, lr=1.0, weight_decay=1e-2),
        lambda p: torch.optim.Adadelta(p, lr=1.0, weight_decay=1e-2),
    ),
}


@pytest.mark.parametrize("case", list(TORCH_PAIRS))
def test_matches_torch_optim_over_100_fp32_steps(case):
    make_ours, make_theirs = TORCH_PAIRS[case]
    a = make_params()
    b = clone_params(a)
    run_side_by_side(make_ours(a), make_theirs(b), a, b, steps=100, skip_every=7)
    assert rel_diff(a, b) <= 1e-6


@pytest.mark.parametrize("case", ["adamw", "sgd_nesterov", "rmsprop_centered_momentum"])
def test_float64_params_match_torch_optim_to_rounding(case):
    make_ours, make_theirs = TORCH_PAIRS[case]
    a = make_params(torch.float64)
    b = clone_params(a)
    run_side_by_side(make_ours(a), make_theirs(b), a, b, steps=20)
    assert rel_diff(a, b) <= 1e-13


def test_param_groups_keep_their_own_hyperparameters():
    a = make_params()
    b = clone_params(a)
    ours = FusedAdam([{"params": a[:2]}, {"params": a[2:], "lr": 1e-2, "weight_decay": 0.0}], lr=1e-3, weight_decay=0.1)
    theirs = torch.optim.AdamW(
        [{"params": b[:2]}, {"params": b[2:], "lr": 1e-2, "weight_decay": 0.0}], lr=1e-3, weight_decay=0.1
    )
    run_side_by_side(ours, theirs, a, b, steps=20)
    assert rel_diff(a, b) <= 1e-6


def test_strided_gradients_are_used_correctly():
    a = [torch.nn.Parameter(torch.randn(13, 7))]
    b = clone_params(a)
    ours, theirs = FusedAdam(a, lr=1e-2), torch.optim.AdamW(a and b, lr=1e-2, weight_decay=0.0)
    for _ in range(5):
        g = torch.randn(7, 13).t()  # same shape as the param, transposed strides
        a[0].grad, b[0].grad = g, g.clone()
        ours.step()
        theirs.step()
    assert rel_diff(a, b) <= 1e-6


# ----------------------------------------------------------------- float64 references (no torch.optim twin)


def lamb_reference(params, grad_seq, lr, betas, eps, wd, max_grad_norm, adam_w_mode=True, use_nvlamb=False):
    """Apex FusedLAMB maths, per tensor in float64."""
    beta1, beta2 = betas
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step, grads in enumerate(grad_seq, start=1):
        norm = math.sqrt(sum(float(g.square().sum()) for g in grads))
        clip = norm / max_grad_norm if norm > max_grad_norm else 1.0
        bc1, bc2 = 1 - beta1**step, 1 - beta2**step
        for i, p in enumerate(params):
            g = grads[i] / clip
            if not adam_w_mode:
                g = g + wd * p
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            u = (m[i] / bc1) / ((v[i] / bc2).sqrt() + eps)
            if adam_w_mode:
                u = u + wd * p
            pn, un = float(p.norm()), float(u.norm())
            ratio = lr * pn / un if (wd != 0 or use_nvlamb) and pn > 0 and un > 0 else lr
            params[i] = p - ratio * u
    return params


def novograd_reference(params, grad_seq, lr, betas, eps, wd, reg_inside_moment=False, norm_type=2):
    """Apex FusedNovoGrad maths (grad averaging, init with the first norm), float64; with ``norm_type=0`` the
    per-tensor norm is the max abs value and its running blend is linear."""
    beta1, beta2 = betas
    m = [torch.zeros_like(p) for p in params]
    v = [None] * len(params)
    for step, grads in enumerate(grad_seq, start=1):
        bc1, bc2 = 1 - beta1**step, 1 - beta2**step
        for i, p in enumerate(params):
            g = grads[i]
            if norm_type == 2:
                n = float(g.norm())
                v[i] = n if v[i] is None else math.sqrt(beta2 * v[i] ** 2 + (1 - beta2) * n**2)
            else:
                n = float(g.abs().max())
                v[i] = n if v[i] is None else beta2 * v[i] + (1 - beta2) * n
            denom = v[i] / math.sqrt(bc2) + eps
            if reg_inside_moment:
                m[i] = beta1 * m[i] + (1 - beta1) * (g / denom + wd * p)
                params[i] = p - lr * m[i] / bc1
            else:
                m[i] = beta1 * m[i] + (1 - beta1) * g
                params[i] = p - lr * (m[i] / bc1 / denom + wd * p)
    return params


def adamp_reference(params, grad_seq, lr, betas, eps, wd, delta=0.1, wd_ratio=0.1, nesterov=False):
    """clovaai/AdamP maths, float64."""
    beta1, beta2 = betas
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step, grads in enumerate(grad_seq, start=1):
        for i, p in enumerate(params):
            g = grads[i]
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            bc1, bc2 = 1 - beta1**step, 1 - beta2**step
            denom = v[i].sqrt() / math.sqrt(bc2) + eps
            perturb = (beta1 * m[i] + (1 - beta1) * g) / denom if nesterov else m[i] / denom
            ratio = 1.0
            if p.dim() > 1:
                for view in (lambda x: x.reshape(x.size(0), -1), lambda x: x.reshape(1, -1)):
                    cos = (view(g) * view(p)).sum(1) / (
                        view(g).norm(dim=1).clamp_min(eps) * view(p).norm(dim=1).clamp_min(eps)
                    )
                    if float(cos.abs().max()) < delta / math.sqrt(view(p).size(1)):
                        shape = [-1] + [1] * (p.dim() - 1)
                        unit = p / (view(p).norm(dim=1).view(shape) + eps)
                        perturb = perturb - unit * view(unit * perturb).sum(1).view(shape)
                        ratio = wd_ratio
                        break
            if wd > 0:
                p = p * (1 - lr * wd * ratio)
            params[i] = p - lr / bc1 * perturb
    return params


def rmsprop_tf_reference(params, grad_seq, lr, alpha, eps, wd, momentum, decoupled_decay=False):
    """timm RMSpropTF maths (lr inside momentum, square_avg starts at one), float64."""
    sq = [torch.ones_like(p) for p in params]
    buf = [torch.zeros_like(p) for p in params]
    for grads in grad_seq:
        for i, p in enumerate(params):
            g = grads[i]
            if decoupled_decay:
                p = p * (1 - lr * wd)
            else:
                g = g + wd * p
            sq[i] = sq[i] + (1 - alpha) * (g * g - sq[i])
            avg = (sq[i] + eps).sqrt()
            buf[i] = momentum * buf[i] + lr * g / avg
            params[i] = p - buf[i]
    return params


REFERENCE_CASES = {
    "lamb": (
        lambda p: FusedLAMB(p, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0),
        lambda p, gs: lamb_reference(p, gs, 1e-2, (0.9, 0.999), 1e-6, 0.01, 1.0),
    ),
    "lamb_l2_nvlamb": (
        lambda p: FusedLAMB(p, lr=1e-2, weight_decay=0.0, adam_w_mode=False, use_nvlamb=True, max_grad_norm=50.0),
        lambda p, gs: lamb_reference(p, gs, 1e-2, (0.9, 0.999), 1e-6, 0.0, 50.0, adam_w_mode=False, use_nvlamb=True),
    ),
    "novograd": (
        lambda p: FusedNovoGrad(p, lr=1e-2, betas=(0.95, 0.98), weight_decay=1e-3),
        lambda p, gs: novograd_reference(p, gs, 1e-2, (0.95, 0.98), 1e-8, 1e-3),
    ),
    "novograd_max_norm": (
        lambda p: FusedNovoGrad(p, lr=1e-2, betas=(0.95, 0.98), weight_decay=1e-3, norm_type=0),
        lambda p, gs: novograd_reference(p, gs, 1e-2, (0.95, 0.98), 1e-8, 1e-3, norm_type=0),
    ),
    "novograd_reg_inside": (
        lambda p: FusedNovoGrad(p, lr=1e-2, weight_decay=1e-3, reg_inside_moment=True),
        lambda p, gs: novograd_reference(p, gs, 1e-2, (0.9, 0.999), 1e-8, 1e-3, reg_inside_moment=True),
    ),
    "adamp": (
        lambda p: FusedAdamP(p, lr=1e-2, weight_decay=1e-2),
        lambda p, gs: adamp_reference(p, gs, 1e-2, (0.9, 0.999), 1e-8, 1e-2),
    ),
    "adamp_nesterov": (
        lambda p: FusedAdamP(p, lr=1e-2, weight_decay=1e-2, nesterov=True, delta=0.2, wd_ratio=0.5),
        lambda p, gs: adamp_reference(p, gs, 1e-2, (0.9, 0.999), 1e-8, 1e-2, delta=0.2, wd_ratio=0.5, nesterov=True),
    ),
    "rmsprop_tf": (
        lambda p: FusedRMSpropTF(p, lr=1e-3, momentum=0.9, weight_decay=1e-2),
        lambda p, gs: rmsprop_tf_reference(p, gs, 1e-3, 0.9, 1e-10, 1e-2, 0.9),
    ),
}


def scale_invariant_grads(params):
    """Gradients orthogonal to their (2-D+) parameter, so AdamP's projection branch is exercised."""
    grads = []
    for p in params:
        g = torch.randn(p.shape, dtype=torch.float64)
        if p.dim() > 1:
            flat_p, flat_g = p.detach().double().reshape(1, -1), g.reshape(1, -1)
            g = (flat_g - flat_p * (flat_g * flat_p).sum() / flat_p.square().sum()).reshape(p.shape)
        grads.append(g)
    return grads


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 2e-5)])
@pytest.mark.parametrize("case", list(REFERENCE_CASES))
def test_matches_float64_reference_over_100_steps(case, dtype, tol):
    make_ours, reference = REFERENCE_CASES[case]
    params = make_params(dtype)
    expected = [p.detach().double().clone() for p in params]
    opt = make_ours(params)
    grad_seq = []
    for _ in range(100):
        grads = (
            scale_invariant_grads(params)
            if case.startswith("adamp")
            else [torch.randn(p.shape).double() for p in params]
        )
        grad_seq.append(grads)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.to(dtype)
        opt.step()
    expected = reference(expected, grad_seq)
    assert rel_diff(params, expected) <= tol


@pytest.mark.parametrize("layout", ["transposed", "channels_last"])
def test_adamp_projects_the_rows_of_a_weight_whatever_its_memory_layout(layout):
    """AdamP's projection test and coefficients are per row (dim 0). A weight stored transposed (a dense
    ``nn.Parameter(w.t())``) has its rows spread across memory: the kernel, which sums rows over memory blocks, took
    its columns for rows (0.03 off after one step). Such a weight now steps through the reference; a channels-last
    one (rows still blocks) through the kernel; both as the row-major weight does."""
    shape = (7, 13) if layout == "transposed" else (6, 4, 3, 3)
    weight = torch.randn(shape, dtype=torch.float64)
    stored = weight.t().contiguous().t() if layout == "transposed" else weight.to(memory_format=torch.channels_last)
    ours, plain = torch.nn.Parameter(stored.clone()), torch.nn.Parameter(weight.clone())
    assert ours.is_contiguous() is False
    expected = [weight.clone()]
    grad_seq = []
    optimizers = [FusedAdamP([p], lr=0.1, weight_decay=0.1) for p in (ours, plain)]
    for _ in range(3):
        g = torch.randn(shape, dtype=torch.float64)  # orthogonal to each row: the channel-wise projection
        rows, g_rows = plain.detach().reshape(shape[0], -1), g.reshape(shape[0], -1)
        g = (g_rows - rows * (g_rows * rows).sum(1, keepdim=True) / rows.square().sum(1, keepdim=True)).reshape(shape)
        grad_seq.append([g])
        ours.grad, plain.grad = g.clone(), g.clone()
        for opt in optimizers:
            opt.step()
    expected = adamp_reference(expected, grad_seq, 0.1, (0.9, 0.999), 1e-8, 0.1)
    torch.testing.assert_close(ours.detach(), plain.detach(), rtol=1e-9, atol=1e-9)  # sums in another order
    torch.testing.assert_close(ours.detach(), expected[0], rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------- state_dict compatibility

STATE_PAIRS = {
    "adamw": (
        lambda p: FusedAdam(p, lr=1e-3, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1),
    ),
    "adam_amsgrad": (
        lambda p: FusedAdam(p, lr=1e-3, adam_w_mode=False, amsgrad=True),
        lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True),
    ),
    "sgd": (
        lambda p: FusedSGD(p, lr=1e-2, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    ),
    "adagrad": (lambda p: FusedAdagrad(p, lr=1e-2), lambda p: torch.optim.Adagrad(p, lr=1e-2)),
    "rmsprop": (
        lambda p: FusedRMSprop(p, lr=1e-3, momentum=0.5, centered=True),
        lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5, centered=True),
    ),
    "adadelta": (lambda p: FusedAdadelta(p), lambda p: torch.optim.Adadelta(p)),
}


@pytest.mark.parametrize("direction", ["fused_to_torch", "torch_to_fused"])
@pytest.mark.parametrize("case", list(STATE_PAIRS))
def test_state_dict_moves_between_fused_and_torch(case, direction):
    make_fused, make_torch = STATE_PAIRS[case]
    first, second = (make_fused, make_torch) if direction == "fused_to_torch" else (make_torch, make_fused)
    a = make_params()
    opt_a = first(a)
    for _ in range(5):
        for p in a:
            p.grad = torch.randn(p.shape)
        opt_a.step()
    saved = copy.deepcopy(opt_a.state_dict())  # as torch.save + torch.load would (no shared tensors)
    b = clone_params(a)
    opt_b = second(b)
    opt_b.load_state_dict(saved)
    for pa, pb in zip(a, b, strict=True):
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert set(sa) == set(sb)
        for key in sa:
            torch.testing.assert_close(torch.as_tensor(sb[key]).float(), torch.as_tensor(sa[key]).float())
    run_side_by_side(opt_a, opt_b, a, b, steps=5)
    assert rel_diff(b, a) <= 1e-6


@pytest.mark.parametrize(("first", "second"), [
    (lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1), lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1)),
    (lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1), lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1)),
], ids=["torch_adam_to_fused", "fused_adamw_to_torch_adam"])  # fmt: skip
def test_a_resumed_adam_keeps_the_saved_weight_decay_mode(first, second):
    """torch.optim.Adam resumes a checkpoint with the saved group's ``decoupled_weight_decay`` (AdamW's too). A
    FusedAdam ignored torch's flag (an L2-decay Adam went on with AdamW maths) and did not save it for its own
    ``adam_w_mode`` (torch's Adam went on with L2 decay): both drifted from the run they resumed."""
    a = make_params(torch.float64)
    b = clone_params(a)
    uninterrupted, resumed = first(a), first(b)
    run_side_by_side(uninterrupted, resumed, a, b, steps=3)
    resumed_in_second = second(b)
    resumed_in_second.load_state_dict(copy.deepcopy(resumed.state_dict()))
    run_side_by_side(uninterrupted, resumed_in_second, a, b, steps=5)
    assert rel_diff(b, a) <= 1e-12


def test_torch_adams_decoupled_weight_decay_in_a_group_is_refused_where_it_says_other_than_adam_w_mode():
    """A group written for torch.optim.Adam (``decoupled_weight_decay=False``: L2 decay) was kept and ignored: FusedAdam
    went on with AdamW's decay. Agreeing with ``adam_w_mode`` it is taken, leaving the group ``adam_w_mode`` only."""
    params = make_params(torch.float32)
    with pytest.raises(ValueError, match=r"decoupled_weight_decay=False .* and adam_w_mode=True: FusedAdam reads"):
        FusedAdam([{"params": params, "decoupled_weight_decay": False}], weight_decay=0.1)
    optimizer = FusedAdam([{"params": params[:1], "decoupled_weight_decay": False, "adam_w_mode": False}])
    with pytest.raises(ValueError, match=r"decoupled_weight_decay=True .* and adam_w_mode=False"):
        optimizer.add_param_group({"params": params[1:], "decoupled_weight_decay": True, "adam_w_mode": False})
    assert len(optimizer.param_groups) == 1 and "decoupled_weight_decay" not in optimizer.param_groups[0]


@pytest.mark.parametrize("decoupled", [True, False])
def test_torch_adams_decoupled_weight_decay_keyword_is_taken_where_it_agrees_with_adam_w_mode(decoupled):
    """torch.optim.Adam(params, decoupled_weight_decay=True) was an 'unexpected keyword argument' for FusedAdam, which
    takes the key in a param group: the keyword follows the group's rule, and steps as adam_w_mode says."""
    torch.optim.Adam(make_params(torch.float32), decoupled_weight_decay=decoupled)  # the spec takes it
    results = []
    for extra in ({"decoupled_weight_decay": decoupled}, {}):
        torch.manual_seed(0)
        params = make_params(torch.float32)
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer = FusedAdam(params, weight_decay=0.1, adam_w_mode=decoupled, **extra)
        optimizer.step()
        results.append(params)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    assert "decoupled_weight_decay" not in optimizer.defaults
    message = rf"decoupled_weight_decay={decoupled} .* and adam_w_mode={not decoupled}: FusedAdam reads adam_w_mode"
    with pytest.raises(ValueError, match=message):
        FusedAdam(make_params(torch.float32), adam_w_mode=not decoupled, decoupled_weight_decay=decoupled)
    with pytest.raises(TypeError, match=r"Invalid decoupled_weight_decay: 'yes' is a str"):
        FusedAdam(make_params(torch.float32), decoupled_weight_decay="yes")


@pytest.mark.parametrize("cls", ALL_FUSED, ids=lambda cls: cls.__name__)
def test_torch_optims_implementation_keywords_are_taken_where_they_agree_and_refused_by_name(cls):
    """torch.optim's foreach=/fused=/differentiable=/capturable= were Python's bare 'unexpected keyword argument': the
    values that say what the fused step does are taken (and stored nowhere), the others refused naming the value."""
    lr = {"lr": 0.1} if cls is FusedSGD else {}
    torch.manual_seed(0)
    plain, ported = make_params(torch.float32), make_params(torch.float32)
    for a, b in zip(plain, ported, strict=True):
        b.data.copy_(a)
        a.grad = b.grad = torch.randn_like(a)
    agreeing = {"foreach": None, "fused": True, "differentiable": False}
    if cls is not FusedAdam:  # FusedAdam's capturable is Apex's own switch, taken either way
        agreeing["capturable"] = False
    optimizers = [cls(plain, **lr), cls(ported, **lr, **agreeing)]
    for optimizer in optimizers:
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(plain, ported, strict=True))
    assert optimizers[0].state_dict()["param_groups"] == optimizers[1].state_dict()["param_groups"]
    assert not set(agreeing) & (set(optimizers[1].defaults) - {"capturable"})
    refused = {"foreach": [True, False], "fused": [False], "differentiable": [True]}
    if cls is not FusedAdam:
        refused["capturable"] = [True]
    for keyword, values in refused.items():
        for value in values:
            with pytest.raises(ValueError, match=rf"^{cls.__name__}: {keyword}={value} asks for .*; leave it out"):
                cls(make_params(torch.float32), **lr, **{keyword: value})
    with pytest.raises(TypeError, match=r"invalid fused: 'yes' is a str \(expected None or True"):
        cls(make_params(torch.float32), **lr, fused="yes")


# torch.optim's classes that take capturable=, each with the fused optimizer a checkpoint of it loads into
CAPTURABLE_TWINS = {
    "adam": (torch.optim.Adam, lambda p, **kw: FusedAdam(p, adam_w_mode=False, **kw)),
    "adamw": (torch.optim.AdamW, FusedAdam),
    "rmsprop": (torch.optim.RMSprop, FusedRMSprop),
    "adadelta": (torch.optim.Adadelta, FusedAdadelta),
}


@pytest.mark.parametrize("twin", sorted(CAPTURABLE_TWINS))
def test_capturable_none_is_taken_as_torch_takes_it_in_the_constructor_a_group_and_a_checkpoint(twin):
    """torch.optim keeps capturable=None (falsy: it steps as with False) in its defaults and groups; the fused
    optimizers refused it as no switch, so the port and a torch checkpoint of that optimizer failed to load."""
    theirs, ours = CAPTURABLE_TWINS[twin]
    torch.manual_seed(0)
    params = make_params(torch.float32)
    for p in params:
        p.grad = torch.randn_like(p)
    torch_optimizer = theirs([{"params": params[:1]}, {"params": params[1:]}], lr=1e-2, capturable=None)
    torch_optimizer.step()  # the spec: None steps as False
    assert torch_optimizer.param_groups[0]["capturable"] is None
    saved = torch_optimizer.state_dict()
    results = []
    for capturable in (None, False):
        fresh = [p.detach().clone().requires_grad_() for p in params]
        for p, q in zip(fresh, params, strict=True):
            p.grad = q.grad.clone()
        optimizer = ours(fresh[:1], lr=1e-2, capturable=capturable)
        optimizer.add_param_group({"params": fresh[1:], "capturable": capturable})
        optimizer.step()
        optimizer.load_state_dict(saved)  # a torch checkpoint whose groups hold capturable=None
        assert [group["capturable"] for group in optimizer.param_groups] == [None, None]
        optimizer.step()
        results.append(fresh)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    # None is no licence for any value, and the refusal names it among the valid ones (FusedAdam's said True or False)
    with pytest.raises(TypeError, match=r"nvalid capturable: 'yes' is a str \(expected (True, )?False or None"):
        ours(make_params(torch.float32), capturable="yes")


@pytest.mark.parametrize("cls", ALL_FUSED, ids=lambda cls: cls.__name__)
def test_differentiable_none_is_refused_saying_torchs_step_fails_on_it(cls):
    """torch.optim keeps differentiable=None, then each step fails in torch.set_grad_enabled(None): it is no value
    torch steps with, so it stays refused, the message saying why."""
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    with pytest.raises(TypeError, match="set_grad_enabled"):
        torch.optim.Adam([p], differentiable=None).step()  # the spec
    lr = {"lr": 0.1} if cls is FusedSGD else {}
    with pytest.raises(TypeError, match=r"invalid differentiable: None .*each of its steps then fails"):
        cls(make_params(torch.float32), **lr, differentiable=None)


# ----------------------------------------------------------------- GradScaler contract, zero_grad


def test_grad_scaler_step_unscales_inside_the_kernel_and_skips_on_inf():
    scale = 2.0**10
    a = make_params()
    b = clone_params(a)
    ours, theirs = FusedAdam(a, lr=1e-3), torch.optim.AdamW(b, lr=1e-3, weight_decay=0.0)
    scaler_a = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler_b = torch.amp.GradScaler("cpu", init_scale=scale)
    assert FusedAdam._step_supports_amp_scaling
    for step in range(6):
        grads = [torch.randn(p.shape) for p in a]
        if step == 3:
            grads[2].view(-1)[5] = math.inf
        before = [p.detach().clone() for p in a]
        state_before = {k: v.clone() for k, v in ours.state[a[0]].items()} if ours.state else {}
        for p, q, g in zip(a, b, grads, strict=True):
            scaler_a.scale(torch.ones(()))
            scaler_b.scale(torch.ones(()))
            p.grad, q.grad = g * scale, g * scale
        scaler_a.step(ours)
        scaler_b.step(theirs)
        scaler_a.update()
        scaler_b.update()
        if step == 3:
            assert all(torch.equal(x, y) for x, y in zip(a, before, strict=True))
            for key, value in state_before.items():
                assert torch.equal(ours.state[a[0]][key], value), key
        scale = scaler_a.get_scale()
    assert scaler_a.get_scale() == scaler_b.get_scale()
    assert float(ours.state[a[0]]["step"]) == 5.0
    assert rel_diff(a, b) <= 1e-6


def test_grad_scaler_explicit_unscale_then_step():
    a = make_params()
    b = clone_params(a)
    ours, theirs = FusedSGD(a, lr=0.1, momentum=0.9), torch.optim.SGD(b, lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for _ in range(3):
        scaler.scale(torch.ones(()))
        for p, q in zip(a, b, strict=True):
            g = torch.randn(p.shape)
            p.grad, q.grad = g * 256.0, g.clone()
        scaler.unscale_(ours)
        scaler.step(ours)
        scaler.update()
        theirs.step()
    assert rel_diff(a, b) <= 1e-6


@pytest.mark.parametrize("set_grad_none", [True, False])
def test_zero_grad_default_follows_set_grad_none(set_grad_none):
    params = make_params()
    opt = FusedSGD(params, lr=0.1, set_grad_none=set_grad_none)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.zero_grad()
    assert all((p.grad is None) == set_grad_none for p in params)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none):
    params = make_params()
    opt = FusedAdam(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.zero_grad(set_to_none=set_to_none)
    for p in params:
        assert p.grad is None if set_to_none else torch.equal(p.grad, torch.zeros_like(p))


# ----------------------------------------------------------------- fp16/bf16 params with fp32 master weights


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "make_ours,make_theirs",
    [
        (
            lambda p, **k: FusedAdam(p, lr=1e-2, weight_decay=0.1, **k),
            lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        ),
        (
            lambda p, **k: FusedSGD(p, lr=1e-2, momentum=0.9, **k),
            lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
        ),
    ],
    ids=["adamw", "sgd"],
)
def test_half_params_with_master_weights_track_an_fp32_model(dtype, make_ours, make_theirs):
    half = make_params(dtype)
    full = clone_params(half, torch.float32)
    ours, theirs = make_ours(half, master_weights=True), make_theirs(full)
    for _ in range(20):
        for h, f in zip(half, full, strict=True):
            g = torch.randn(h.shape).to(dtype)
            h.grad, f.grad = g, g.float()
        ours.step()
        theirs.step()
    masters = [ours.state[p]["master_param"] for p in half]
    assert all(m.dtype == torch.float32 for m in masters)
    assert rel_diff(masters, full) <= 1e-6
    for p, m in zip(half, masters, strict=True):
        assert torch.equal(p, m.to(dtype))
    state_dtypes = {v.dtype for s in ours.state.values() for k, v in s.items() if k != "step"}
    assert state_dtypes == {torch.float32}


def test_master_weights_and_fp32_state_survive_a_state_dict_round_trip():
    half = make_params(torch.float16)
    opt = FusedAdam(half, lr=1e-2, master_weights=True)
    for _ in range(3):
        for p in half:
            p.grad = torch.randn(p.shape).half()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    twins = clone_params(half)
    restored = FusedAdam(twins, lr=1e-2, master_weights=True)
    restored.load_state_dict(saved)
    for p, q in zip(half, twins, strict=True):
        for key in ("master_param", "exp_avg", "exp_avg_sq"):
            assert restored.state[q][key].dtype == torch.float32
            assert torch.equal(restored.state[q][key], opt.state[p][key])


def test_half_params_without_master_weights_update_in_place():
    half = make_params(torch.bfloat16)
    before = [p.detach().clone() for p in half]
    opt = FusedAdagrad(half, lr=0.1)
    for p in half:
        p.grad = torch.randn(p.shape).bfloat16()
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(half, before, strict=True))
    assert "master_param" not in opt.state[half[0]]


def test_mixed_precision_lamb_keeps_fp32_masters():
    half = make_params(torch.bfloat16)
    opt = FusedMixedPrecisionLamb(half, lr=1e-2)
    for p in half:
        p.grad = torch.randn(p.shape).bfloat16()
    opt.step()
    assert all(opt.state[p]["master_param"].dtype == torch.float32 for p in half)
    assert all(torch.equal(p, opt.state[p]["master_param"].bfloat16()) for p in half)


@pytest.mark.parametrize("ops_mode", ["kernel", "reference"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_mixed_precision_lamb_fp16_follows_float64_lamb_where_fp16_moments_underflow(
    monkeypatch, ops_mode, weight_decay
):
    """Apex's fp16 test setup (global norm ~77, so clipping divides every grad by it): a weight whose clipped
    grad times (1 - beta1) is below fp16's smallest subnormal still moves, because moments, clipping and the
    update stay in fp32 and only the new weight is rounded to fp16."""
    monkeypatch.setenv("AMPKIT_OPS", ops_mode)
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(18011, generator=gen).half()
    grads = torch.rand(18011, generator=gen).half()
    tiny = torch.arange(0, 18011, 997)
    weights[tiny], grads[tiny] = 0.01, 2e-5  # 0.1 * 2e-5 / 77 = 2.6e-8 < 2**-25: an fp16 moment flushes to 0
    param = torch.nn.Parameter(weights.clone())
    opt = FusedMixedPrecisionLamb([param], lr=5e-4, eps=1e-8, weight_decay=weight_decay, use_nvlamb=True)
    param.grad = grads.clone()
    opt.step()
    (expected,) = lamb_reference(
        [weights.double()], [[grads.double()]], 5e-4, (0.9, 0.999), 1e-8, weight_decay, 1.0, use_nvlamb=True
    )
    assert float(grads.double().norm()) > 50
    torch.testing.assert_close(opt.state[param]["master_param"], expected.float())
    torch.testing.assert_close(param.detach(), expected.half())
    assert (weights[tiny] - param.detach()[tiny]).min() > 2e-4  # moved by about lr * trust ratio, not 0


def test_reference_mode_runs_the_same_maths(monkeypatch):
    a = make_params()
    b = clone_params(a)
    kernel_opt = FusedRMSprop(a, lr=1e-2, momentum=0.9)
    reference_opt = FusedRMSprop(b, lr=1e-2, momentum=0.9)
    for _ in range(10):
        for p, q in zip(a, b, strict=True):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        kernel_opt.step()
        monkeypatch.setenv("AMPKIT_OPS", "reference")
        reference_opt.step()
        monkeypatch.setenv("AMPKIT_OPS", "kernel")
    assert rel_diff(a, b) <= 1e-6


# ----------------------------------------------------------------- errors

BAD_CONSTRUCTIONS = [
    (lambda p: FusedAdam(p, lr=-1.0), ValueError, "Invalid lr"),
    (lambda p: FusedAdam(p, betas=(1.0, 0.999)), ValueError, r"Invalid betas\[0\]"),
    (lambda p: FusedAdam(p, weight_decay=-0.1), ValueError, "Invalid weight_decay"),
    (lambda p: FusedAdam(p, master_weights="yes"), TypeError, "master_weights must be a bool"),
    (lambda p: FusedSGD(p, lr=0.1, nesterov=True), ValueError, "Nesterov momentum requires"),
    (lambda p: FusedLAMB(p, amsgrad=True), RuntimeError, "does not support the AMSGrad"),
    (lambda p: FusedNovoGrad(p, norm_type=1), ValueError, "expected 2 \\(L2\\) or 0"),
    (
        lambda p: FusedMixedPrecisionLamb(p, reduced_precision_dtype=torch.int8),
        ValueError,
        "reduced_precision_dtype",
    ),
    (lambda p: FusedRMSprop(p, alpha=-0.5), ValueError, "Invalid alpha"),
    (lambda p: FusedAdam(p, lr=None), ValueError, "Invalid lr: None is a NoneType"),  # was float()'s bare TypeError
    (lambda p: FusedSGD(p, lr=0.1, dampening="0.1"), ValueError, "Invalid dampening"),  # failed in the first step
]


@pytest.mark.parametrize("make,error,message", BAD_CONSTRUCTIONS)
def test_bad_hyperparameters_are_named(make, error, message):
    with pytest.raises(error, match=message):
        make(make_params())


@pytest.mark.parametrize(
    "make",
    [
        lambda p: FusedAdam(p, lr="1e-3" * 25_000),
        lambda p: FusedAdam(p, lr=list(range(10**5))),
        lambda p: FusedSGD(p, lr=0.1, dampening="0." * 50_000),
    ],
    ids=["100kB lr", "100000-item lr", "100kB dampening"],
)
def test_a_long_hyperparameter_is_named_by_its_start_and_length(make):
    """A pasted 100 kB value, or a list of 10**5 items, was repeated whole in the error."""
    with pytest.raises(
        ValueError, match=r"^Invalid (lr|dampening)( of a param group)?: .{80}\.\.\. \(\d+ characters\) is a"
    ) as err:
        make(make_params())
    assert len(str(err.value)) < 300


# Hyper-parameters torch.optim's constructors refuse, beside the fused optimizer taking the same arguments.
TORCH_REFUSALS = [
    (FusedAdam, torch.optim.Adam, dict(lr=-1.0)),
    (FusedAdam, torch.optim.Adam, dict(lr=torch.tensor([1e-3, 1e-3]))),
    (FusedAdam, torch.optim.AdamW, dict(betas=(1.0, 0.999))),
    (FusedAdam, torch.optim.AdamW, dict(betas=(0.9, -0.5))),
    (FusedAdam, torch.optim.AdamW, dict(eps=-1e-8)),
    (FusedAdam, torch.optim.AdamW, dict(weight_decay=-1)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=-0.5)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.1, weight_decay=-0.1)),
    (FusedAdagrad, torch.optim.Adagrad, dict(lr_decay=-0.5)),
    (FusedAdagrad, torch.optim.Adagrad, dict(initial_accumulator_value=-1.0)),
    (FusedRMSprop, torch.optim.RMSprop, dict(alpha=-1.0)),
    (FusedRMSprop, torch.optim.RMSprop, dict(momentum=-1.0)),
    (FusedAdadelta, torch.optim.Adadelta, dict(rho=1.1)),
]


@pytest.mark.parametrize("fused,theirs,kwargs", TORCH_REFUSALS)
def test_a_hyperparameter_torch_optim_refuses_is_refused_with_torchs_words_too(fused, theirs, kwargs):
    """Code and ported torch tests match torch's message ("Invalid weight_decay value: -1", "Tensor lr must be
    1-element"); the fused optimizers said "Invalid weight_decay: -1" and called a two-element lr a wrong type."""
    with pytest.raises(ValueError) as torchs:
        theirs(make_params(), **kwargs)
    with pytest.raises(ValueError, match=re.escape(str(torchs.value))):
        fused(make_params(), **kwargs)


def test_bad_params_are_named():
    with pytest.raises(TypeError, match=r"params\[1\] has dtype torch.int64"):
        FusedAdam([torch.nn.Parameter(torch.zeros(2)), torch.zeros(2, dtype=torch.int64)])
    with pytest.raises(ValueError, match=r"params\[0\] .* is not dense"):
        FusedAdam([torch.nn.Parameter(torch.zeros(4, 6)[:, ::2])])


def test_sparse_gradients_are_rejected():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.zeros(4).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        FusedAdam([p]).step()


# ----------------------------------------------------------------- the CUDA kernels, where a GPU exists
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")


@pytest.fixture(params=["ampkit", "auto", "ampkit-multi_tensor"])
def cuda_backend(request, monkeypatch):
    """The CUDA tests run ampkit's kernels, both the default per-tensor ones and those AMPKIT_CUDA_KERNELS=
    multi_tensor selects, and, under ``auto``, torch's fused ops where a bucket routes there."""
    backend, _, kernels = request.param.partition("-")
    monkeypatch.setenv("AMPKIT_FUSED_BACKEND", backend)
    monkeypatch.setenv("AMPKIT_CUDA_KERNELS", kernels or "per_tensor")
    return backend


@needs_cuda
@pytest.mark.parametrize("case", list(TORCH_PAIRS))
def test_cuda_matches_torch_optim_over_100_fp32_steps(case, cuda_backend):
    make_ours, make_theirs = TORCH_PAIRS[case]
    a = [torch.nn.Parameter(p.detach().cuda()) for p in make_params()]
    b = clone_params(a)
    ours, theirs = make_ours(a), make_theirs(b)
    for step in range(100):
        for i, (pa, pb) in enumerate(zip(a, b, strict=True)):
            if i == 1 and step % 7 == 0:
                pa.grad = pb.grad = None
                continue
            g = torch.randn(pa.shape, device="cuda")
            pa.grad, pb.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    assert rel_diff(a, b) <= 1e-6
    # The kernels that take GradScaler's tensors read and advance their step counters on the GPU.
    on_device = isinstance(ours, FusedAdam | FusedAdagrad | FusedAdadelta | FusedRMSprop | FusedRMSpropTF)
    for p, s in ours.state.items():
        if "step" in s:
            assert s["step"].device == (p.device if on_device else torch.device("cpu"))


@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 2e-5)])
@pytest.mark.parametrize("case", list(REFERENCE_CASES))
def test_cuda_matches_float64_reference_over_100_steps(case, dtype, tol, cuda_backend):
    make_ours, reference = REFERENCE_CASES[case]
    params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params(dtype)]
    expected = [p.detach().double().cpu() for p in params]
    opt = make_ours(params)
    grad_seq = []
    for _ in range(100):
        grads = scale_invariant_grads([p.cpu() for p in params]) if case.startswith("adamp") else None
        grads = grads or [torch.randn(p.shape).double() for p in params]
        grad_seq.append(grads)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.to(device="cuda", dtype=dtype)
        opt.step()
    expected = reference(expected, grad_seq)
    assert rel_diff([p.cpu() for p in params], expected) <= tol


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_half_params_with_master_weights_track_an_fp32_model(dtype, cuda_backend):
    half = [torch.nn.Parameter(p.detach().cuda()) for p in make_params(dtype)]
    full = clone_params(half, torch.float32)
    ours = FusedAdam(half, lr=1e-2, weight_decay=0.1, master_weights=True)
    theirs = torch.optim.AdamW(full, lr=1e-2, weight_decay=0.1)
    for _ in range(20):
        for h, f in zip(half, full, strict=True):
            g = torch.randn(h.shape, device="cuda").to(dtype)
            h.grad, f.grad = g, g.float()
        ours.step()
        theirs.step()
    masters = [ours.state[h]["master_param"] for h in half]
    assert rel_diff(masters, full) <= 1e-6
    for h, m in zip(half, masters, strict=True):
        assert torch.equal(h, m.to(dtype))


# ----------------------------------------------------------------- FusedSGD momentum buffer of fp16/bf16 params


def apex_sgd_reference(params, grads_per_step, lr, momentum, dampening, weight_decay, nesterov):
    """Apex's multi_tensor_sgd on half params and buffers: float32 math, buffer rounded to the param dtype,
    the param updated with the unrounded buffer."""
    params = [p.detach().clone() for p in params]
    buffers = [None] * len(params)
    for grads in grads_per_step:
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            g32 = g.float() + weight_decay * p.float()
            buf = g32 if buffers[i] is None else buffers[i].float() * momentum + (1 - dampening) * g32
            step = g32 + momentum * buf if nesterov else buf
            params[i] = (p.float() - lr * step).to(p.dtype)
            buffers[i] = buf.to(p.dtype)
    return params, buffers


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "hyper",
    [dict(momentum=0.9), dict(momentum=0.9, nesterov=True), dict(momentum=0.8, dampening=0.25, weight_decay=0.01)],
    ids=["momentum", "nesterov", "dampening_wd"],
)
def test_sgd_half_momentum_buffer_is_in_param_dtype_with_fp32_math_as_apex(dtype, hyper):
    from ampkit.compat.optimizers import FusedSGD as ApexFusedSGD

    params = make_params(dtype)
    grads_per_step = [[torch.randn(p.shape).to(dtype) for p in params] for _ in range(7)]
    full = dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False) | hyper
    expected_params, expected_buffers = apex_sgd_reference(params, grads_per_step, lr=0.1, **full)
    opt = ApexFusedSGD(params, lr=0.1, **hyper)
    for grads in grads_per_step:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
    for p, want, buf in zip(params, expected_params, expected_buffers, strict=True):
        assert opt.state[p]["momentum_buffer"].dtype == dtype
        assert torch.equal(opt.state[p]["momentum_buffer"], buf)
        assert torch.equal(p.detach(), want)
    saved = opt.state_dict()
    assert {s["momentum_buffer"].dtype for s in saved["state"].values()} == {dtype}
    twins = clone_params(params)
    restored = FusedSGD(twins, lr=0.1, **hyper)
    restored.load_state_dict(copy.deepcopy(saved))
    assert all(restored.state[q]["momentum_buffer"].dtype == dtype for q in twins)


def test_sgd_fp32_momentum_knob_and_master_weights_keep_fp32_buffers():
    half = make_params(torch.float16)
    full = clone_params(half, torch.float32)
    knob = FusedSGD(clone_params(half), lr=0.1, momentum=0.9, fp32_momentum=True)
    master = FusedSGD(half, lr=0.1, momentum=0.9, master_weights=True)
    fp32 = torch.optim.SGD(full, lr=0.1, momentum=0.9)
    knob_params = knob.param_groups[0]["params"]
    for _ in range(5):
        for h, k, f in zip(half, knob_params, full, strict=True):
            g = torch.randn(h.shape).half()
            h.grad, k.grad, f.grad = g, g.clone(), g.float()
        for opt in (knob, master, fp32):
            opt.step()
    for opt in (knob, master):
        assert {s["momentum_buffer"].dtype for s in opt.state.values()} == {torch.float32}
    assert rel_diff([master.state[p]["master_param"] for p in half], full) <= 1e-6
    restored = FusedSGD(clone_params(knob_params), lr=0.1, momentum=0.9, fp32_momentum=True)
    restored.load_state_dict(knob.state_dict())
    assert {s["momentum_buffer"].dtype for s in restored.state.values()} == {torch.float32}
    with pytest.raises(TypeError, match="fp32_momentum must be a bool"):
        FusedSGD(half, fp32_momentum="yes")


# ----------------------------------------------------------------- FusedAdam(capturable=True), Apex's spelling


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_capturable_adam_with_master_weights_and_tensor_lr_steps_as_the_plain_one(dtype):
    plain_params = make_params(dtype)
    capturable_params = clone_params(plain_params)
    master = dtype == torch.float16
    lr = 2.0**-7  # exact in float32, so the tensor lr is the same number
    plain = FusedAdam(plain_params, lr=lr, weight_decay=0.01, master_weights=master)
    capturable = FusedAdam(
        capturable_params, lr=torch.tensor(lr), weight_decay=0.01, capturable=True, master_weights=master
    )
    assert capturable.param_groups[0]["capturable"] and not plain.param_groups[0]["capturable"]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for _ in range(5):
        scaler.scale(torch.ones(()))
        for p, q in zip(plain_params, capturable_params, strict=True):
            g = torch.randn(p.shape).to(dtype)
            p.grad, q.grad = g, g * 2.0**8
        plain.step()
        scaler.step(capturable)
        scaler.update()
    for p, q in zip(plain_params, capturable_params, strict=True):
        assert torch.equal(p, q)
        if master:
            assert capturable.state[q]["master_param"].dtype == torch.float32
            assert torch.equal(capturable.state[q]["master_param"], plain.state[p]["master_param"])


def _apex_sgd_wd_after_momentum(params, grads_per_step, lr, momentum, wd, nesterov):
    """Apex's multi_tensor_sgd with wd_after_momentum, in float64: the decay joins after the momentum update."""
    params = [p.clone() for p in params]
    bufs = [None] * len(params)
    for grads in grads_per_step:
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            bufs[i] = g.clone() if bufs[i] is None else bufs[i] * momentum + g
            update = g + momentum * bufs[i] if nesterov else bufs[i]
            params[i] = p - lr * (update + wd * p)
    return params


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_weight_decay_after_momentum_matches_apex(nesterov):
    torch.manual_seed(0)
    start = [torch.randn(7, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(4)]
    params = [torch.nn.Parameter(p.clone()) for p in start]
    opt = FusedSGD(params, lr=0.1, momentum=0.9, weight_decay=0.05, nesterov=nesterov, wd_after_momentum=True)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    expected = _apex_sgd_wd_after_momentum(start, grads, 0.1, 0.9, 0.05, nesterov)
    for ours, theirs in zip(params, expected, strict=True):
        torch.testing.assert_close(ours.detach(), theirs, rtol=1e-12, atol=1e-12)
    plain = FusedSGD([torch.nn.Parameter(start[0].clone())], lr=0.1, momentum=0.9, weight_decay=0.05)
    plain.param_groups[0]["params"][0].grad = grads[0][0].clone()
    plain.step()
    plain.param_groups[0]["params"][0].grad = grads[1][0].clone()
    plain.step()
    assert not torch.allclose(plain.param_groups[0]["params"][0], expected[0])  # the two orders differ


def test_adagrad_decoupled_weight_decay_matches_apex():
    """Apex's adagrad_w_mode: w -= lr * (g / (sqrt(sum) + eps) + wd * w), the sum built from g alone."""
    torch.manual_seed(0)
    start = torch.randn(9, dtype=torch.float64)
    grads = [torch.randn_like(start) for _ in range(4)]
    param = torch.nn.Parameter(start.clone())
    opt = FusedAdagrad([param], lr=0.1, eps=1e-10, weight_decay=0.05, adagrad_w_mode=True)
    w, total = start.clone(), torch.zeros_like(start)
    for g in grads:
        param.grad = g.clone()
        opt.step()
        total = total + g * g
        w = w - 0.1 * (g / (total.sqrt() + 1e-10) + 0.05 * w)
    torch.testing.assert_close(param.detach(), w, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="lr_decay"):
        FusedAdagrad([param], adagrad_w_mode=True, lr_decay=0.1)


def test_decoupled_decay_waits_for_a_step_skipped_on_the_device():
    """Under GradScaler a found_inf skips the whole step inside the kernel: the decay must not happen either."""
    param = torch.nn.Parameter(torch.ones(4))
    opt = FusedSGD([param], lr=0.1, momentum=0.9, weight_decay=0.5, wd_after_momentum=True)
    param.grad = torch.ones(4)
    opt.step(grad_scale=torch.tensor(1.0), found_inf=torch.tensor(1.0))
    assert torch.equal(param.detach(), torch.ones(4))


# ----------------------------------------------------------------- AdamP decides its projection on the device
class ScalarReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every tensor read back as a Python number (``.item()``, ``float(t)``, ``bool(t)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.read: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.read.append(args[0])
        return func(*args, **(kwargs or {}))


def test_adamp_reference_reads_nothing_but_its_host_step_counters():
    """On CUDA AdamP runs the reference: its projection test, coefficients and decay stay tensors on the params'
    device (one host read per tensor and view before), so only the step counters, host tensors, are read."""
    from ampkit.ops.reference.optimizers import adamp_step

    params = make_params(torch.float32)
    grads = scale_invariant_grads(params)
    steps = [torch.tensor(0.0) for _ in params]
    state = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    with torch.no_grad(), ScalarReads() as reads:
        grads = [g.float() for g in grads]
        adamp_step(params, grads, *state, [], steps, 1e-2, 0.9, 0.999, 1e-8, 1e-2, 0.1, 0.1, False, 1.0)
    assert len(reads.read) == len(steps)
    assert all(any(r.data_ptr() == s.data_ptr() for s in steps) for r in reads.read)


@needs_cuda
def test_cuda_adamp_step_does_not_synchronize():
    params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params()]
    opt = FusedAdamP(params, lr=1e-2, weight_decay=1e-2)
    for p, g in zip(params, scale_invariant_grads([p.cpu() for p in params]), strict=True):
        p.grad = g.float().cuda()
    opt.step()  # state is created here
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


ALL_FUSED = [FusedAdam, FusedSGD, FusedLAMB, FusedNovoGrad, FusedAdagrad, FusedAdadelta, FusedAdamP, FusedRMSprop,
             FusedRMSpropTF, FusedMixedPrecisionLamb]  # fmt: skip


@pytest.mark.parametrize("cls", ALL_FUSED, ids=lambda c: c.__name__)
@pytest.mark.parametrize("lr", [-1.0, float("nan"), "0.1", None])
def test_a_groups_own_hyperparameters_are_checked_and_a_refused_group_is_not_kept(cls, lr):
    """A group's ``lr`` of -1 trained by gradient ascent and NaN ruined the weights; and the group a check
    refused stayed in ``param_groups``, failing every later step."""
    kwargs = {"lr": 0.1} if cls is FusedSGD else {}
    with pytest.raises(ValueError, match=r"Invalid lr of a param group"):
        cls([{"params": make_params()[:1], "lr": lr}], **kwargs)
    optimizer = cls(make_params()[:1], **kwargs)
    with pytest.raises(ValueError, match=r"Invalid lr of a param group"):
        optimizer.add_param_group({"params": make_params()[1:2], "lr": lr})
    with pytest.raises(TypeError, match=r"params\[0\] has dtype torch.int64"):
        optimizer.add_param_group({"params": [torch.zeros(2, dtype=torch.int64)]})
    assert len(optimizer.param_groups) == 1
    optimizer.param_groups[0]["params"][0].grad = torch.ones_like(optimizer.param_groups[0]["params"][0])
    optimizer.step()  # still steps


_WRITTEN_AFTER_CONSTRUCTION = [
    ("lr", "1e-3", r"Invalid lr of {}\.param_groups\[1\]: '1e-3' is a str"),  # FusedAdam read it through float()
    ("lr", None, r"Invalid lr of {}\.param_groups\[1\]: None is a NoneType"),
    (
        "lr",
        torch.tensor([1e-3, 1e-3]),
        r"Invalid lr of {}\.param_groups\[1\]: Tensor lr of .* must be 1-element, got shape \(2,\)",
    ),
    ("lr", float("nan"), r"Invalid lr of {}\.param_groups\[1\]: nan \(expected a finite value >= 0"),
    ("lr", -1, r"Invalid lr of {}\.param_groups\[1\]: -1 \(expected a finite value >= 0"),
    ("eps", "1e-8", r"Invalid eps of {}\.param_groups\[1\]: '1e-8' is a str"),
    ("weight_decay", None, r"Invalid weight_decay of {}\.param_groups\[1\]: None"),
    ("betas", (0.9, 1.5), r"Invalid betas\[1\] of {}\.param_groups\[1\]: 1.5 \(expected a value in \[0.0, 1.0\)"),
    ("betas", None, r"Invalid betas of {}\.param_groups\[1\]: None is a NoneType"),
    ("maximize", "False", r"Invalid maximize of {}\.param_groups\[1\]: 'False' is a str"),
]


@pytest.mark.parametrize(
    "cls, key, value, message",
    [
        (cls, *case)
        for cls in ALL_FUSED
        for case in _WRITTEN_AFTER_CONSTRUCTION
        if case[0] in cls(make_params()[:1], **({"lr": 0.1} if cls is FusedSGD else {})).defaults
    ],
    ids=str,
)
def test_a_group_setting_written_after_construction_is_checked_at_step_before_anything_moves(cls, key, value, message):
    """Written into ``param_groups`` after the constructor checked it (a scheduler's, a config's), a string, None or
    a two-element tensor failed deep in torch's dispatcher ('adam_step() Expected a value of type float'), and
    ``betas=(0.9, 1.5)``, ``lr=nan`` or ``lr=-1`` stepped every weight to NaN or uphill. Refused at the step, naming
    the group and the key, before any group has moved."""
    kwargs = {"lr": 0.1} if cls is FusedSGD else {}
    params = make_params()[:2]
    optimizer = cls([{"params": params[:1]}, {"params": params[1:]}], **kwargs)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.param_groups[1][key] = value
    before = [p.detach().clone() for p in params]
    with pytest.raises((TypeError, ValueError), match=message.format(cls.__name__)):
        optimizer.step()
    assert all(torch.equal(b, p) for b, p in zip(before, params, strict=True))
    with pytest.raises((TypeError, ValueError), match=message.format(cls.__name__)):
        optimizer.step_with_grad_factor(1.0)
    optimizer.param_groups[1][key] = optimizer.defaults[key]
    optimizer.param_groups[1]["lr"] = torch.tensor(optimizer.defaults["lr"])  # a one-element tensor is an lr
    optimizer.step()
    assert not torch.equal(before[1], params[1])


def test_a_loaded_state_without_masters_gets_them_back():
    """fp16 weights with ``master_weights=True``, loaded from a state saved without masters (torch's AdamW, a run
    without them): the masters are made again, so updates smaller than fp16's spacing still add up."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.ones(64, dtype=torch.float16))
    plain = torch.optim.AdamW([torch.nn.Parameter(weight.detach().float())], lr=1e-4)
    plain.param_groups[0]["params"][0].grad = torch.ones(64)
    plain.step()
    optimizer = FusedAdam([weight], lr=1e-4, weight_decay=0.0, master_weights=True)
    optimizer.load_state_dict(plain.state_dict())
    for _ in range(40):
        weight.grad = torch.ones(64, dtype=torch.float16)
        optimizer.step()
    assert optimizer.state[weight]["master_param"].dtype == torch.float32
    assert torch.all(weight < 1.0)  # 40 steps of 1e-4: below 1 - 2**-11, where each step alone rounds back to 1


def _reorder_by_names(optimizer, state_dict):
    """torch's documented use of a load pre-hook: a checkpoint whose parameters come in another order is remapped
    by the ``param_names`` it carries."""
    state_dict = copy.deepcopy(state_dict)
    group, wanted = state_dict["param_groups"][0], optimizer.param_groups[0]["param_names"]
    by_name = {name: state_dict["state"][pid] for name, pid in zip(group["param_names"], group["params"], strict=True)}
    state_dict["state"] = {pid: by_name[name] for pid, name in zip(group["params"], wanted, strict=True)}
    group["param_names"] = list(wanted)
    return state_dict


@pytest.mark.parametrize(("ours", "theirs"), [
    (lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1), lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
    (lambda p: FusedSGD(p, lr=1e-2, momentum=0.9), lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9)),
    (lambda p: FusedAdagrad(p, lr=1e-2), lambda p: torch.optim.Adagrad(p, lr=1e-2)),
])  # fmt: skip
def test_a_load_pre_hooks_state_dict_is_the_one_loaded_and_post_hooks_see_it(ours, theirs):
    """The fix-ups after torch's loader (steps, moments in the accumulate dtype) read the caller's state dict, not
    the one a pre-hook returned, so a remapped checkpoint's moments and steps were put back as saved."""
    saved_params = make_params(torch.float64, [(3,), (4, 2)])
    source = theirs(list(zip(["a", "b"], saved_params, strict=True)))
    for p in saved_params:
        p.grad = torch.randn_like(p)
    source.step()
    seen = []
    sides = []
    for make in (ours, theirs):
        params = clone_params(saved_params[::-1])  # this model lists b before a
        optimizer = make(list(zip(["b", "a"], params, strict=True)))
        optimizer.register_load_state_dict_pre_hook(_reorder_by_names)
        optimizer.register_load_state_dict_post_hook(
            lambda o: seen.append(sorted(o.state[o.param_groups[0]["params"][0]]))
        )
        optimizer.load_state_dict(source.state_dict())
        sides.append((optimizer, params))
    (fused, fused_params), (reference, reference_params) = sides
    for _ in range(3):
        for a, b in zip(fused_params, reference_params, strict=True):
            a.grad = b.grad = torch.randn_like(a)
        fused.step()
        reference.step()
    torch.testing.assert_close(fused_params, reference_params, rtol=1e-12, atol=1e-12)
    assert seen[0] == seen[1] and seen[0], "the post-hook saw the loaded state, as torch's does"


@pytest.mark.parametrize(("saved", "message"), [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), r"lacks \['exp_avg', 'exp_avg_sq'\]"),
    (lambda p: FusedAdam(p, lr=1e-3, weight_decay=0.0), None),
    (lambda p: FusedAdam([torch.nn.Parameter(torch.zeros(3)) for _ in p]), "has 'exp_avg' of shape"),
])  # fmt: skip
def test_a_state_that_does_not_fit_is_refused_at_load_and_the_old_one_kept(saved, message):
    params = make_params()
    source = saved(clone_params(params))
    for p in source.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    source.step()
    optimizer = FusedAdam(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    before = copy.deepcopy(optimizer.state_dict())
    if message is None:  # the fitting case loads
        optimizer.load_state_dict(source.state_dict())
        return
    with pytest.raises(ValueError, match=message):
        optimizer.load_state_dict(source.state_dict())
    after = optimizer.state_dict()
    assert all(torch.equal(before["state"][i]["exp_avg"], after["state"][i]["exp_avg"]) for i in before["state"])
    optimizer.step()
    bad = copy.deepcopy(before)
    bad["param_groups"][0]["lr"] = -1.0
    with pytest.raises(ValueError, match=r"saved param_groups\[0\]: Invalid lr of a param group: -1.0"):
        optimizer.load_state_dict(bad)


@pytest.mark.parametrize(("make", "key"), [
    (lambda p: FusedSGD(p, lr=0.1, momentum=0.9), "momentum_buffer"),
    (lambda p: FusedSGD(p, lr=0.1, master_weights=True), "master_param"),
])  # fmt: skip
def test_a_state_made_at_the_first_step_that_does_not_fit_is_refused_at_load(make, key):
    # Made by the first step rather than by _init_state, such a tensor was not checked: a momentum buffer of
    # another model loaded and failed at the next step with the kernel's shape error, naming no parameter.
    source = make([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))])
    source.param_groups[0]["params"][0].grad = torch.ones(3, dtype=torch.float16)
    source.step()
    param = torch.nn.Parameter(torch.zeros(5, dtype=torch.float16))
    optimizer = make([param])
    message = rf"params'\]\[0\] has '{key}' of shape \(3,\), its parameter needs \(5,\)"
    with pytest.raises(ValueError, match=message):
        optimizer.load_state_dict(source.state_dict())
    assert not optimizer.state[param]  # the old (empty) state is kept
    param.grad = torch.ones(5, dtype=torch.float16)
    optimizer.step()


def _stepped(optimizer_class, **kwargs):
    model = torch.nn.Linear(3, 2)
    optimizer = optimizer_class(model.parameters(), lr=0.1, **kwargs)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_state_dict_that_is_not_an_optimizers_is_named_with_torchs_exception_type():
    """A model's state_dict or a whole checkpoint handed to ``optimizer.load_state_dict`` was torch's bare
    ``KeyError: 'param_groups'``, None an AttributeError about ``copy``, and a step of None or "3" (a hand-edited
    checkpoint) ``must be real number, not NoneType`` from deep in the loader."""
    model, optimizer = _stepped(FusedAdam)
    saved = optimizer.state_dict()
    with pytest.raises(KeyError, match=r"lacks \['state', 'param_groups'\] \(its keys: \['bias', 'weight'\]\)"):
        optimizer.load_state_dict(model.state_dict())
    with pytest.raises(TypeError, match="expects the dict optimizer.state_dict\\(\\) returns, got a NoneType"):
        optimizer.load_state_dict(None)
    with pytest.raises(KeyError, match=r"saved param_groups\[0\] has no 'params'"):
        optimizer.load_state_dict({**saved, "param_groups": [{"lr": 0.1}]})
    with pytest.raises(ValueError, match="the state dict has 2 param groups, this optimizer 1"):
        optimizer.load_state_dict({**saved, "param_groups": saved["param_groups"] * 2})
    for step in (None, "3"):
        bad = copy.deepcopy(saved)
        bad["state"][0]["step"] = step
        with pytest.raises(TypeError, match=rf"saved state\[0\]\['step'\] is {step!r}, expected a number"):
            optimizer.load_state_dict(bad)
    optimizer.load_state_dict(saved)  # the real one still loads


@pytest.mark.parametrize("other", [torch.optim.Adam, torch.optim.RMSprop])
def test_sgd_refuses_another_optimizers_state_rather_than_starting_its_momentum_afresh(other):
    """FusedSGD makes its momentum buffer at the first step, so no key of its own is ever missing: Adam's or
    RMSprop's state loaded without a word and the resumed run restarted its momentum (and a str buffer failed at
    the first step)."""
    _, source = _stepped(other)
    _, optimizer = _stepped(FusedSGD, momentum=0.9)
    before = optimizer.state_dict()["state"][0]["momentum_buffer"].clone()
    with pytest.raises(ValueError, match=r"holds \[.*'(exp_avg|square_avg)'.*\], none of which FusedSGD keeps"):
        optimizer.load_state_dict(source.state_dict())
    assert torch.equal(optimizer.state_dict()["state"][0]["momentum_buffer"], before)
    bad = optimizer.state_dict()
    bad["state"][0]["momentum_buffer"] = "x"
    with pytest.raises(TypeError, match=r"saved state\[0\]\['momentum_buffer'\] is a str, expected a tensor"):
        optimizer.load_state_dict(bad)
    _, plain = _stepped(torch.optim.SGD, momentum=0.9)
    optimizer.load_state_dict(plain.state_dict())  # torch's SGD's state is its own


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB], ids=lambda c: c.__name__)
def test_step_names_a_grad_scale_or_found_inf_that_is_not_one_number(cls):
    """``step(grad_scale=..., found_inf=...)`` (torch's fused-optimizer keywords) read a string with ``float()`` and
    failed on a two-element tensor in a reshape: ``shape '[]' is invalid for input of size 2``."""
    optimizer = cls(make_params()[:1], lr=0.1)
    optimizer.param_groups[0]["params"][0].grad = torch.ones(SHAPES[0])
    for name in ("grad_scale", "found_inf"):
        with pytest.raises(RuntimeError, match=rf"^step\(\): {name} must be a one-element tensor, got shape \(2,\)$"):
            optimizer.step(**{name: torch.ones(2)})
        with pytest.raises(TypeError, match=rf"^step\(\): {name} must be a one-element tensor or a number, got '1'$"):
            optimizer.step(**{name: "1"})
    optimizer.step(grad_scale=torch.ones(1), found_inf=0)  # GradScaler's own forms
    assert optimizer.state[optimizer.param_groups[0]["params"][0]]


def test_sparse_gradients_are_named_by_the_lamb_optimizers_too():
    for cls in (FusedLAMB, FusedMixedPrecisionLamb):
        p = torch.nn.Parameter(torch.zeros(4))
        p.grad = torch.zeros(4).to_sparse()
        with pytest.raises(RuntimeError, match=f"{cls.__name__} does not support sparse gradients"):
            cls([p]).step()


@pytest.mark.parametrize("cls", [FusedAdam, FusedSGD, FusedLAMB, FusedNovoGrad], ids=lambda c: c.__name__)
def test_a_compiled_train_step_runs_the_optimizer_step_eagerly(cls):
    """``torch.compile`` of a whole train step (forward, backward, ``optimizer.step()``) failed in dynamo's
    fake-tensor pass over the C++ kernels; the step is now a graph break and trains as the eager loop does."""
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 2).double() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [cls(m.parameters(), lr=1e-2) for m in models]
    x = torch.randn(8, 4, dtype=torch.float64)

    def train_step(model, optimizer):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    compiled = torch.compile(train_step, backend="eager")
    for _ in range(3):
        train_step(models[0], optimizers[0])
        compiled(models[1], optimizers[1])
    for eager, traced in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(traced, eager, rtol=0, atol=0)


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB, FusedNovoGrad], ids=lambda c: c.__name__)
def test_betas_given_in_torch_optims_positional_place_are_refused_not_dropped(cls):
    """``AdamW(params, 1e-3, (0.9, 0.95))`` swapped for a fused Adam-like put the betas in Apex's third positional
    slot, ``bias_correction``, which took the tuple as True: the step ran with the default betas, silently."""
    with pytest.raises(ValueError, match=r"Invalid bias_correction: \(0.9, 0.95\) is a tuple .*betas go by keyword"):
        cls(make_params(), 1e-3, (0.9, 0.95))
    with pytest.raises(ValueError, match=r"Invalid betas: 1e-08 is a float \(expected two numbers"):
        cls(make_params(), 1e-3, True, 1e-8)


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB, FusedNovoGrad, FusedAdamP, FusedMixedPrecisionLamb],
                         ids=lambda c: c.__name__)  # fmt: skip
def test_betas_from_an_omegaconf_config_are_taken_as_torch_optim_takes_them(cls):
    """``betas=cfg.optim.betas`` is a ListConfig, which torch.optim and Apex index like a tuple; the fused optimizers
    refused it as not a tuple or list. It is kept as a tuple, so a checkpoint of the optimizer loads weights_only."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"betas": [0.8, 0.95]})
    params = make_params()[:1]
    params[0].grad = torch.ones_like(params[0])
    optimizer = cls(params, lr=0.1, betas=cfg.betas)
    optimizer.step()
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.95)
    with pytest.raises(TypeError, match=r"Invalid betas: '0.9, 0.95' is a str"):
        cls(make_params()[:1], lr=0.1, betas="0.9, 0.95")


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB, FusedNovoGrad], ids=lambda c: c.__name__)
def test_betas_mixing_a_tensor_and_a_number_are_refused_as_torch_optim_refuses_them(cls):
    """torch.optim.Adam raises 'betas must be either both floats or both Tensors' for ``(tensor(0.9), 0.999)``; the
    fused optimizers took it, at construction and written into a group before a step."""
    message = r"mixes a tensor and a number; betas must be either both floats or both Tensors"
    with pytest.raises(ValueError, match=r"Invalid betas: \(tensor\(0.9000\), 0.99\) " + message):
        cls(make_params()[:1], lr=0.1, betas=(torch.tensor(0.9), 0.99))
    params = make_params()[:1]
    params[0].grad = torch.ones_like(params[0])
    optimizer = cls(params, lr=0.1, betas=(torch.tensor(0.9), torch.tensor(0.99)))  # both tensors: torch's other way
    optimizer.step()
    optimizer.param_groups[0]["betas"] = (0.9, torch.tensor(0.99))
    with pytest.raises(ValueError, match=rf"Invalid betas of {cls.__name__}.param_groups\[0\]: .* {message}"):
        optimizer.step()


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB, FusedNovoGrad], ids=lambda c: c.__name__)
def test_a_numpy_bool_switch_is_taken_and_kept_as_a_bool_so_the_checkpoint_loads_weights_only(cls):
    """Apex's bindings took numpy's ``bool_`` as a bool; the fused optimizers refused it. Kept as a Python bool, the
    optimizer's state dict still loads with ``weights_only=True`` (numpy's type is not on its allow-list)."""
    import io

    import numpy as np

    params = make_params()[:1]
    params[0].grad = torch.ones_like(params[0])
    optimizer = cls(params, lr=0.1, bias_correction=np.bool_(False))
    optimizer.step()
    assert type(optimizer.param_groups[0]["bias_correction"]) is bool
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["param_groups"][0]["bias_correction"] is False


@pytest.mark.parametrize("cls", ALL_FUSED, ids=lambda c: c.__name__)
def test_a_hyperparameter_of_the_wrong_type_is_a_type_error_as_in_torch(cls):
    """torch.optim raises TypeError for ``lr="1e-3"`` (a number left unparsed in a config): code swapping in a fused
    optimizer and catching it must still catch it, as must code catching the ValueError raised here before."""
    kwargs = {"lr": 0.1} if cls is FusedSGD else {}
    for bad in ({"lr": "1e-3"}, {"weight_decay": None}, {"betas": "0.9"}, {"eps": [1e-8]}):
        key, value = next(iter(bad.items()))
        if key not in cls(make_params()[:1], **kwargs).defaults:
            continue
        with pytest.raises(TypeError, match=rf"Invalid {key}: .* is a {type(value).__name__}") as raised:
            cls(make_params()[:1], **{**kwargs, **bad})
        assert isinstance(raised.value, ValueError)
    optimizer = cls(make_params()[:1], **kwargs)
    state = optimizer.state_dict()
    state["param_groups"][0]["lr"] = "0.1"
    with pytest.raises(TypeError, match=r"load_state_dict: saved param_groups\[0\]: Invalid lr of a param group"):
        optimizer.load_state_dict(state)
    for flag in [key for key, value in optimizer.defaults.items() if isinstance(value, bool) and key != "nesterov"]:
        with pytest.raises(TypeError, match=rf"Invalid {flag}: 'yes' is a str"):
            cls(make_params()[:1], **kwargs, **{flag: "yes"})


@pytest.mark.parametrize("cls", ALL_FUSED, ids=lambda c: c.__name__)
def test_an_on_off_option_that_is_not_a_bool_is_named(cls):
    optimizer = cls(make_params()[:1], lr=0.1)
    flags = [key for key, value in optimizer.defaults.items() if isinstance(value, bool)]
    assert flags
    for key in flags:
        with pytest.raises(
            ValueError, match=rf"Invalid {key} of a param group: 'yes' is a str \(expected True(, False)? or"
        ):
            optimizer.add_param_group({"params": make_params()[1:2], key: "yes"})
    optimizer.add_param_group({"params": make_params()[1:2], flags[0]: 1})  # Apex's 0/1 spelling stays valid


@pytest.mark.parametrize(("cls", "option"), [
    (FusedSGD, "wd_after_momentum"),
    (FusedSGD, "materialize_master_grads"),
    (FusedAdagrad, "adagrad_w_mode"),
])  # fmt: skip
def test_apexs_constructor_only_switches_are_true_or_false_too(cls, option):
    """These options are the optimizer's own, not a param group's, and were read with ``bool()``: ``"False"`` (from
    a config) turned Apex's weight-decay order or decoupled decay on without a word."""
    with pytest.raises(TypeError, match=rf"Invalid {option}: 'False' is a str \(expected True or False\)"):
        cls(make_params(), lr=0.1, **{option: "False"})
    cls(make_params(), lr=0.1, **{option: 0})  # Apex's 0/1 spelling stays valid


@pytest.mark.parametrize(("cls", "option"), [
    (FusedSGD, "nesterov"), (FusedLAMB, "amsgrad"), (FusedMixedPrecisionLamb, "amsgrad"), (FusedNovoGrad, "amsgrad"),
])  # fmt: skip
def test_a_switch_the_constructor_reads_first_is_named_as_a_switch(cls, option):
    """These were read before the switch check: ``nesterov="False"`` was refused as a Nesterov momentum without
    momentum, ``amsgrad="False"`` as an ``amsgrad=True`` the optimizer does not support."""
    with pytest.raises(TypeError, match=rf"^Invalid {option}: 'False' is a str \(expected True or False\)$"):
        cls(make_params(), lr=0.1, **{option: "False"})


RESETS = {
    "del state[p]": lambda state, p: state.__delitem__(p),
    "state[p] = {}": lambda state, p: state.__setitem__(p, {}),
    "state.pop(p)": lambda state, p: state.pop(p),
    "state.clear()": lambda state, p: state.clear(),
    "state[p].clear()": lambda state, p: state[p].clear(),  # was a KeyError for FusedAdam
}


@pytest.mark.parametrize("reset", list(RESETS))
@pytest.mark.parametrize("case", ["adamw", "sgd_momentum_dampening"])
def test_a_reset_parameter_state_starts_afresh_and_is_saved_as_torch_optims(case, reset):
    """Resetting a parameter's state (a re-initialised layer) left the buckets kept between steps on the old state
    dicts: the kernels went on stepping the old moments, and ``state_dict()`` saved nothing for that parameter."""
    make_ours, make_theirs = TORCH_PAIRS[case]
    a_params = make_params(torch.float64)
    b_params = clone_params(a_params)
    ours, theirs = make_ours(a_params), make_theirs(b_params)
    run_side_by_side(ours, theirs, a_params, b_params, steps=3)
    RESETS[reset](ours.state, a_params[0])
    RESETS[reset](theirs.state, b_params[0])
    run_side_by_side(ours, theirs, a_params, b_params, steps=3)
    assert rel_diff(a_params, b_params) <= 1e-12
    saved, expected = ours.state_dict()["state"], theirs.state_dict()["state"]
    assert sorted(saved) == sorted(expected) and sorted(saved[0]) == sorted(expected[0])
    for key, value in expected[0].items():
        torch.testing.assert_close(saved[0][key], value, msg=key)


@pytest.mark.parametrize("cls", [FusedAdam, FusedSGD, FusedLAMB], ids=lambda c: c.__name__)
def test_master_weights_take_values_written_outside_the_optimizer(cls):
    """With fp32 masters, weights written between steps (``model.load_state_dict`` of an earlier checkpoint, weight
    clipping under ``no_grad``) were overwritten by the stale masters on the next step; an EMA swapped in for
    evaluation and back must keep the masters' extra bits."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(64, dtype=torch.float64).to(torch.bfloat16))
    reference = torch.nn.Parameter(weight.detach().double())
    ours = cls([weight], lr=1e-3, master_weights=True)
    theirs = cls([reference], lr=1e-3)

    def steps(n):
        for _ in range(n):
            g = torch.randn(64, dtype=torch.float64)
            weight.grad = g.to(torch.bfloat16)
            reference.grad = weight.grad.double()
            ours.step()
            theirs.step()

    steps(3)
    with torch.no_grad():  # an EMA swapped in for evaluation, then the training weights put back
        saved = weight.detach().clone()
        weight.copy_(torch.zeros_like(weight))
        weight.copy_(saved)
    steps(2)
    master = ours.state[weight]["master_param"]
    torch.testing.assert_close(master.double(), reference.detach(), rtol=1e-6, atol=1e-6)  # no bf16 rounding
    with torch.no_grad():  # an earlier checkpoint loaded into the model
        restored = torch.randn(64, dtype=torch.float64)
        weight.copy_(restored.to(torch.bfloat16))
        reference.copy_(restored.to(torch.bfloat16).double())
    steps(3)
    torch.testing.assert_close(weight.double(), reference.detach(), rtol=1e-2, atol=1e-2)


def _built(cls, params):
    return cls(params, lr=0.1) if cls is FusedSGD else cls(params)


@pytest.mark.parametrize("backend", ["torch", "ampkit"])
@pytest.mark.parametrize(
    ("grad", "message"),
    [
        (torch.ones(3), r"has shape \(2, 3\) but its .grad has shape \(3,\)"),  # broadcast over the rows
        (torch.ones(7), r"has shape \(2, 3\) but its .grad has shape \(7,\)"),  # read past its end by torch's op
        (torch.ones(2, 3, dtype=torch.complex64), r"has a .grad of dtype torch.complex64"),  # imaginary part dropped
        (torch.ones(2, 3, dtype=torch.int32), r"has a .grad of dtype torch.int32"),
        (torch.ones(2, 3, dtype=torch.bool), r"has a .grad of dtype torch.bool"),
    ],
    ids=["broadcastable", "longer", "complex", "int", "bool"],
)
@pytest.mark.parametrize("cls", ALL_FUSED, ids=lambda c: c.__name__)
def test_a_grad_that_does_not_fit_its_parameter_is_refused_before_any_group_steps(cls, grad, message, backend,
                                                                                   monkeypatch):  # fmt: skip
    """torch refuses such a ``.grad`` when it is assigned, but not one set through ``.grad.data`` (Apex-era code
    does): the step cast it or broadcast it over the parameter and trained on it without a word. The error names the
    parameter, and the group before it has not moved."""
    monkeypatch.setenv("AMPKIT_FUSED_BACKEND", backend)
    first, second = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(2, 3))
    first.grad, second.grad = torch.ones(4), torch.zeros(2, 3)
    second.grad.data = grad
    optimizer = _built(cls, [{"params": [first]}, {"params": [second]}])
    with pytest.raises((RuntimeError, TypeError), match=r"param_groups\[1\]\['params'\]\[0\] " + message):
        optimizer.step()
    assert torch.equal(first.detach(), torch.ones(4)) and torch.equal(second.detach(), torch.ones(2, 3))


@pytest.mark.parametrize("cls", ALL_FUSED, ids=lambda c: c.__name__)
def test_a_grad_whose_shape_changes_between_steps_is_refused(cls):
    """The buckets are kept between steps while each gradient keeps its dtype and strides: a grad of (1,) replacing
    one of (3,) has the same strides, and must not reach the kernels as the (3,) one did."""
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    optimizer = _built(cls, [param])
    optimizer.step()
    param.grad.data = torch.ones(1)
    with pytest.raises(RuntimeError, match=r"has shape \(3,\) but its .grad has shape \(1,\)"):
        optimizer.step()


@pytest.mark.parametrize("hyper", ["lr", "eps", "weight_decay"])
@pytest.mark.parametrize("cls", [c for c in ALL_FUSED if c is not FusedSGD], ids=lambda c: c.__name__)
def test_an_infinite_hyperparameter_is_refused_as_nan_is(cls, hyper):
    """``inf`` passed the ``>= 0`` checks: an infinite ``lr`` or ``weight_decay`` turned every weight inf or NaN at the
    first step, an infinite ``eps`` froze them; refused by name, in the constructor and in a param group."""
    with pytest.raises(ValueError, match=rf"Invalid {hyper}: inf \(expected a finite value >= 0"):
        cls(make_params()[:1], **{hyper: math.inf})
    optimizer = cls(make_params()[:1])
    with pytest.raises(ValueError, match=rf"Invalid {hyper} of a param group: inf"):
        optimizer.add_param_group({"params": make_params()[1:2], hyper: math.inf})


@pytest.mark.parametrize("hyper", ["lr", "momentum", "weight_decay"])
def test_sgd_refuses_an_infinite_hyperparameter(hyper):
    kwargs = {"lr": 0.1, hyper: math.inf}
    with pytest.raises(ValueError, match=rf"Invalid {hyper}: inf"):
        FusedSGD(make_params()[:1], **kwargs)


def test_lambs_infinite_max_grad_norm_still_means_no_clipping():
    """``max_grad_norm=inf`` has a meaning (never clip), so it stays allowed where ``lr=inf`` is not."""
    params, twin = make_params(), make_params()
    for p, t in zip(params, twin, strict=True):
        t.data.copy_(p.data)
    unclipped, no_clip = FusedLAMB(params, lr=1e-2, max_grad_norm=math.inf), FusedLAMB(twin, lr=1e-2, max_grad_norm=0)
    run_side_by_side(unclipped, no_clip, params, twin, steps=3)
    for p, t in zip(params, twin, strict=True):
        torch.testing.assert_close(p, t)


def _sharing_memory():
    weight, flat = torch.nn.Parameter(torch.randn(4)), torch.randn(9)
    return {
        "one_parameter_twice": [weight, weight],
        "a_view_of_another": [weight, weight.detach().view(2, 2).requires_grad_()],
        "overlapping_slices": [flat[0:6].requires_grad_(), flat[3:9].requires_grad_()],
    }


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate parameters")
@pytest.mark.parametrize("case", list(_sharing_memory()))
@pytest.mark.parametrize("cls", ALL_FUSED, ids=lambda c: c.__name__)
def test_parameters_sharing_memory_are_refused(cls, case):
    """The kernels update a bucket's parameters in parallel: two over the same memory raced (torch.optim applied one
    update after the other), and a Parameter listed twice, which torch only warns of, was stepped twice."""
    params = _sharing_memory()[case]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] and param_groups\[0\]\['params'\]\[1\] "
                                         r"share memory"):  # fmt: skip
        _built(cls, params)
    optimizer = _built(cls, params[:1])
    in_another_group = r"\[0\]\['params'\]\[0\] and param_groups\[1\]\['params'\]\[0\] share memory"
    with pytest.raises(ValueError, match=in_another_group + "|appear in more than one parameter group"):  # torch's
        optimizer.add_param_group({"params": params[1:]})
    assert len(optimizer.param_groups) == 1


def test_parameters_over_separate_parts_of_one_storage_step_as_torch_steps_them():
    """Views of one flat buffer that do not overlap (FSDP1's original parameters, a contiguous-params buffer) stay
    allowed."""
    flat, twin = torch.randn(12), torch.randn(12)
    twin.copy_(flat)
    params = [flat[0:5].view(5).requires_grad_(), flat[5:12].view(7).requires_grad_()]
    reference = [twin[0:5].clone().requires_grad_(), twin[5:12].clone().requires_grad_()]
    ours, theirs = FusedSGD(params, lr=0.1, momentum=0.9), torch.optim.SGD(reference, lr=0.1, momentum=0.9)
    run_side_by_side(ours, theirs, params, reference, steps=3)
    torch.testing.assert_close(flat, torch.cat([r.detach() for r in reference]))
