"""Apex's LAMB ops of ``amp_C`` (``multi_tensor_lamb_mp``, ``multi_tensor_lamb_stage1_cuda``,
``multi_tensor_lamb_stage2_cuda``) against a float64 reference of Apex's math: fp32, fp16 and fp32-master
layouts, odd sizes, transposed and strided tensors, the overflow flag, inf/nan, empty lists."""

from __future__ import annotations

import math

import pytest
import torch

from ampkit.compat import amp_c as amp_C
from ampkit.compat import optimizers
from ampkit.compat.multi_tensor_apply import multi_tensor_applier

SIZES = [(7, 13), (29,), (3, 5, 4), (1,), (6, 5)]
LR, BETA1, BETA2, EPS = 1e-2, 0.9, 0.99, 1e-6


@pytest.fixture(autouse=True)
def kernel_mode(monkeypatch):
    monkeypatch.setenv("AMPKIT_OPS", "kernel")


def flag():
    return torch.zeros(1, dtype=torch.int32)


def fresh(dtype, scale=1.0, sizes=SIZES):
    """Random tensors of ``dtype``; the last is a transposed view (dense, not contiguous)."""
    tensors = [(torch.randn(s, dtype=torch.float64) * scale).to(dtype) for s in sizes]
    tensors[-1] = tensors[-1].t()
    return tensors


def lamb_reference(p, g, m, v, *, step, wd, mode=1, grad_averaging=1, nvlamb=False, factor=1.0, stored=torch.float64,
                   kept=torch.float64):  # fmt: skip
    """One step of Apex's LAMB on one tensor in float64: the new param, moments and direction, rounded where
    Apex stored them: the direction to ``stored`` (its dtype between the two stages), the rest to ``kept``."""
    p, g, m, v = p.double(), g.double() * factor, m.double(), v.double()
    if mode == 0:
        g = g + wd * p
    m = BETA1 * m + ((1 - BETA1) if grad_averaging else 1.0) * g
    v = BETA2 * v + (1 - BETA2) * g * g
    m, v = m.to(kept).double(), v.to(kept).double()
    direction = (m / (1 - BETA1**step)) / ((v / (1 - BETA2**step)).sqrt() + EPS)
    if mode == 1:
        direction = direction + wd * p
    direction = direction.to(stored).double()
    ratio = 1.0
    if (nvlamb or wd != 0) and p.norm() > 0 and direction.norm() > 0:
        ratio = float(p.norm() / direction.norm())
    return (p - LR * ratio * direction).to(kept).double(), m, v, direction


def close(got, want, tol):
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


# ----------------------------------------------------------------- multi_tensor_lamb_mp


def mp_lists(layout):
    """``(lists, masters_or_params)`` for FusedMixedPrecisionLamb's two layouts and the three dtypes."""
    if layout in ("fp16_master", "bf16_master"):
        low = torch.float16 if layout == "fp16_master" else torch.bfloat16
        masters = fresh(torch.float32)
        moments = [[torch.zeros(t.shape) for t in masters] for _ in range(2)]
        return [[], masters, *moments, [t.to(low) for t in masters]], masters
    dtype = torch.float32 if layout == "fp32" else torch.float16
    params = fresh(dtype)
    return [[], params, *[[torch.zeros(t.shape, dtype=dtype) for t in params] for _ in range(2)]], params


@pytest.mark.parametrize("layout", ["fp32", "fp16", "fp16_master", "bf16_master"])
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize(("wd", "nvlamb", "grad_averaging"), [(0.01, False, 1), (0.0, True, 0), (0.0, False, 1)])
def test_lamb_mp_matches_apex_math_with_unscaling_and_clipping(layout, mode, wd, nvlamb, grad_averaging):
    lists, weights = mp_lists(layout)
    grad_dtype = lists[4][0].dtype if len(lists) == 5 else weights[0].dtype
    ref = [(w.double(), torch.zeros(w.shape, dtype=torch.float64), torch.zeros(w.shape, dtype=torch.float64))
           for w in weights]  # fmt: skip
    scale = 1024.0
    for step in (1, 2, 3):
        # |grad| in [0.5, 1.5) and clipped by 2: the second moments stay normal numbers in fp16
        lists[0] = [(g.sign() * (0.5 + torch.rand(g.shape)) * scale).to(grad_dtype) for g in fresh(torch.float32)]
        scaled = [g.clone() for g in lists[0]]
        norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm_mp, flag(), [lists[0]], False)
        max_norm = norm / 2  # FusedMixedPrecisionLamb passes max_grad_norm times the loss scale, as a tensor
        multi_tensor_applier(
            amp_C.multi_tensor_lamb_mp, flag(), lists, torch.tensor(LR), BETA1, BETA2, EPS,
            torch.tensor([step], dtype=torch.int32), 1, wd, grad_averaging, mode, norm, max_norm, nvlamb,
            torch.zeros(1), torch.tensor([1 / scale]),
        )  # fmt: skip
        factor = (1 / scale) / (norm.double().item() / max_norm.item())
        new = [
            lamb_reference(
                p,
                g,
                m,
                v,
                step=step,
                wd=wd,
                mode=mode,
                grad_averaging=grad_averaging,
                nvlamb=nvlamb,
                factor=factor,
                stored=grad_dtype,
                kept=weights[0].dtype,
            )  # fmt: skip
            for (p, m, v), g in zip(ref, scaled, strict=True)
        ]
        ref = [r[:3] for r in new]
        for grad, (*_, direction) in zip(lists[0], new, strict=True):
            close(grad, direction, 1e-2 if grad_dtype != torch.float32 else 1e-5)
    tol = 2e-3 if layout == "fp16" else 1e-5
    # A direction stored in half precision may round one ulp apart from the reference's (float64 rounded once) at a
    # tie: each of the 3 steps may then move a weight by LR x ratio (about 1) x |direction| (< 4) x that ulp.
    flips = 0.0 if grad_dtype == torch.float32 else 3 * LR * 4 * torch.finfo(grad_dtype).eps
    for i, (p, m, v) in enumerate(ref):
        close(weights[i], p, tol + flips)
        close(lists[2][i], m, tol)
        close(lists[3][i], v, tol)
        assert lists[2][i].dtype == weights[i].dtype, "the moments keep the caller's dtype"
        if len(lists) == 5:
            assert torch.equal(lists[4][i], weights[i].to(lists[4][i].dtype)), "the model gets the rounded master"


def mp_call(lists, noop, step=1):
    amp_C.multi_tensor_lamb_mp(
        2048, noop, lists, torch.tensor(LR), BETA1, BETA2, EPS, torch.tensor([step], dtype=torch.int32), 1, 0.01,
        1, 1, torch.tensor([1.0]), torch.tensor([10.0]), False, torch.zeros(1), torch.ones(1),
    )  # fmt: skip


def test_lamb_mp_changes_nothing_while_the_flag_is_set_or_a_param_is_not_finite():
    lists, _ = mp_lists("fp16_master")
    lists[0] = [torch.randn(t.shape).half() for t in lists[1]]
    before = [[t.clone() for t in lst] for lst in lists]
    raised = flag().fill_(1)
    mp_call(lists, raised)
    assert all(torch.equal(a, b) for la, lb in zip(lists, before, strict=True) for a, b in zip(la, lb, strict=True))
    for bad in (math.inf, math.nan):
        lists[1][2].view(-1)[4] = bad
        before = [[t.clone() for t in lst] for lst in lists]
        noop = flag()
        mp_call(lists, noop)
        assert noop.item() == 1
        assert all(
            torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a.nan_to_num(), b.nan_to_num())
            for la, lb in zip(lists, before, strict=True)
            for a, b in zip(la, lb, strict=True)
        )


def test_lamb_mp_with_an_inf_gradient_raises_the_flag_and_leaves_the_params():
    lists, weights = mp_lists("fp32")
    lists[0] = [torch.randn(t.shape) for t in weights]
    lists[0][1][3] = math.inf
    before = [w.clone() for w in weights]
    noop = flag()
    mp_call(lists, noop)
    assert noop.item() == 1
    assert all(torch.equal(a, b) for a, b in zip(weights, before, strict=True))
    assert not torch.isfinite(lists[0][1]).all(), "as in Apex the grads already hold the (non-finite) direction"


def test_lamb_mp_fp32_step_matches_ampkits_fused_lamb():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    twin = [p.detach().clone().requires_grad_() for p in model.parameters()]
    grads = [torch.randn_like(p) for p in twin]
    for p, g in zip(twin, grads, strict=True):
        p.grad = g.clone()
    theirs = optimizers.FusedLAMB(twin, lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=0.01, max_grad_norm=1.0)
    theirs.step()
    params = [p.detach() for p in model.parameters()]
    lists = [[g.clone() for g in grads], params, *[[torch.zeros_like(p) for p in params] for _ in range(2)]]
    norm, _ = amp_C.multi_tensor_l2norm_mp(2048, flag(), [lists[0]], False)
    amp_C.multi_tensor_lamb_mp(
        2048, flag(), lists, torch.tensor(LR), BETA1, BETA2, EPS, torch.tensor([1], dtype=torch.int32), 1, 0.01,
        1, 1, norm, torch.tensor([1.0]), False, torch.zeros(1), torch.ones(1),
    )  # fmt: skip
    for ours, expected in zip(params, twin, strict=True):
        torch.testing.assert_close(ours, expected.detach())


def test_fused_mixed_precision_lamb_carries_apexs_mp_ops():
    optimizer = optimizers.FusedMixedPrecisionLamb([torch.nn.Parameter(torch.zeros(2))])
    assert optimizer.multi_tensor_lamb is amp_C.multi_tensor_lamb_mp
    assert optimizer.multi_tensor_l2norm is amp_C.multi_tensor_l2norm_mp


# ----------------------------------------------------------------- the two stages (NVIDIA's BERT pretraining)


@pytest.mark.parametrize(
    ("param_dtype", "grad_dtype", "state_dtype"),
    [
        (torch.float32, torch.float32, torch.float32),
        (torch.float32, torch.float16, torch.float32),  # fp16 grads of fp32 params, as Apex allowed
        (torch.float16, torch.float16, torch.float16),  # fp16 moments and update buffer
    ],
)
def test_stage1_then_stage2_match_apex_math_with_per_tensor_decay(param_dtype, grad_dtype, state_dtype):
    params = fresh(param_dtype)
    params[2] = torch.randn(3, 5, 8).to(param_dtype)[..., ::2]  # a strided view: read and written through a copy
    exp_avgs = [torch.zeros(p.shape, dtype=state_dtype) for p in params]
    exp_avg_sqs = [torch.zeros(p.shape, dtype=state_dtype) for p in params]
    updates = [torch.empty(p.shape, dtype=state_dtype) for p in params]
    decays = [0.01, 0.0, 0.01, 0.0, 0.01]
    ref = [(p.double(), m.double(), v.double()) for p, m, v in zip(params, exp_avgs, exp_avg_sqs, strict=True)]
    for step in (0, 1, 2):  # the step taken so far: stage 1's bias correction counts step + 1
        # |grad| in [0.5, 1.5) and clipped by 2: the second moments stay normal numbers in fp16
        grads = [(g.sign() * (0.5 + torch.rand(g.shape))).to(grad_dtype) for g in fresh(torch.float32)]
        global_norm = torch.stack([g.double().norm() for g in grads]).norm().float().view(1)
        buf = flag().fill_(1)  # neither stage reads the flag
        multi_tensor_applier(
            amp_C.multi_tensor_lamb_stage1_cuda, buf, [grads, params, exp_avgs, exp_avg_sqs, updates],
            torch.tensor(decays), step, BETA1, BETA2, EPS, global_norm, global_norm.item() / 2,
        )  # fmt: skip
        clip = 2.0
        expected = [  # stage 2 below is given weight_decay=0.01: every tensor gets its trust ratio
            lamb_reference(
                p, g, m, v, step=step + 1, wd=d, nvlamb=True, factor=1 / clip, stored=state_dtype, kept=param_dtype
            )  # fmt: skip
            for (p, m, v), g, d in zip(ref, grads, decays, strict=True)
        ]
        tol = 1e-5 if state_dtype == torch.float32 else 2e-3
        for u, (*_, direction) in zip(updates, expected, strict=True):
            close(u, direction, tol)
        param_norms = torch.stack([p.float().norm() for p in params])
        update_norms = torch.stack([u.float().norm() for u in updates])
        multi_tensor_applier(
            amp_C.multi_tensor_lamb_stage2_cuda, buf, [params, updates], param_norms, update_norms, LR, 0.01, False
        )
        ref = [e[:3] for e in expected]
        for i, (p, m, v) in enumerate(ref):
            close(params[i], p, tol)
            close(exp_avgs[i], m, tol)
            close(exp_avg_sqs[i], v, tol)
        assert buf.item() == 1


@pytest.mark.parametrize(
    ("weight_decay", "use_nvlamb", "trust"), [(0.0, False, False), (0.0, True, True), (0.1, None, True)]
)
def test_stage2_applies_the_trust_ratio_only_with_decay_or_nvlamb(weight_decay, use_nvlamb, trust):
    params = fresh(torch.float32)
    updates = fresh(torch.float32)
    param_norms = torch.tensor([2.0, 0.0, 3.0, 1.0, 4.0])  # a zero norm falls back to ratio 1
    update_norms = torch.tensor([4.0, 1.0, 0.0, 1.0, 1.0])
    expected = []
    for p, u, pn, un in zip(params, updates, param_norms.tolist(), update_norms.tolist(), strict=True):
        ratio = pn / un if trust and pn != 0 and un != 0 else 1.0
        expected.append(p.double() - LR * ratio * u.double())
    args = (param_norms, update_norms, LR, weight_decay) + (() if use_nvlamb is None else (use_nvlamb,))
    amp_C.multi_tensor_lamb_stage2_cuda(2048, flag(), [params, updates], *args)
    for p, e in zip(params, expected, strict=True):
        close(p, e, 1e-6)


def test_stage2_called_with_lr_last_as_in_2019_applies_the_trust_ratio_to_every_tensor():
    """Until April 2020 Apex's stage 2 took ``(param_norms, update_norms, lr)`` and always applied the ratio;
    NVIDIA's 2019 BERT ``BertLAMB`` calls it so, through ``multi_tensor_applier``."""
    params, updates = fresh(torch.float32), fresh(torch.float32)
    param_norms = torch.tensor([2.0, 0.0, 3.0, 1.0, 4.0])
    update_norms = torch.tensor([4.0, 1.0, 0.0, 1.0, 1.0])
    expected = [
        p.double() - LR * (pn / un if pn != 0 and un != 0 else 1.0) * u.double()
        for p, u, pn, un in zip(params, updates, param_norms.tolist(), update_norms.tolist(), strict=True)
    ]
    multi_tensor_applier(amp_C.multi_tensor_lamb_stage2_cuda, flag(), [params, updates], param_norms, update_norms, LR)
    for p, e in zip(params, expected, strict=True):
        close(p, e, 1e-6)


def test_lamb_ops_check_their_arguments_and_accept_empty_lists():
    buf = flag()
    amp_C.multi_tensor_lamb_stage1_cuda(2048, buf, [[]] * 5, torch.zeros(0), 0, 0.9, 0.99, 1e-6, 1.0, 1.0)
    amp_C.multi_tensor_lamb_stage2_cuda(2048, buf, [[]] * 2, torch.zeros(0), torch.zeros(0), 0.1, 0.0)
    mp_call([[]] * 5, buf)
    assert buf.item() == 0
    t = [torch.zeros(3)]
    with pytest.raises(RuntimeError, match="multi_tensor_lamb_stage1_cuda: tensor_lists has 4 lists; expected 5"):
        amp_C.multi_tensor_lamb_stage1_cuda(2048, buf, [t] * 4, torch.zeros(1), 0, 0.9, 0.99, 1e-6, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="per_tensor_decay has 0 values; expected one per tensor"):
        amp_C.multi_tensor_lamb_stage1_cuda(2048, buf, [t] * 5, torch.zeros(0), 0, 0.9, 0.99, 1e-6, 1.0, 1.0)
    with pytest.raises(RuntimeError, match=r"tensor_lists\[1\]\[0\] has 4 elements but tensor_lists\[0\]\[0\] has 3"):
        amp_C.multi_tensor_lamb_stage2_cuda(2048, buf, [t, [torch.zeros(4)]], torch.ones(1), torch.ones(1), 0.1, 0.0)
    with pytest.raises(RuntimeError, match="multi_tensor_lamb_mp: mode=2"):
        amp_C.multi_tensor_lamb_mp(
            2048, buf, [t] * 4, torch.tensor(0.1), 0.9, 0.99, 1e-6, torch.ones(1), 1, 0.0,
            1, 2, torch.ones(1), torch.ones(1), False, torch.zeros(1), torch.ones(1),
        )  # fmt: skip


def test_the_reference_backend_gives_the_kernels_results(monkeypatch):
    """CUDA tensors without a CUDA build of ampkit's kernels (and ``AMPKIT_OPS=reference``) take the reference."""
    results = {}
    for backend in ("kernel", "reference"):
        monkeypatch.setenv("AMPKIT_OPS", backend)
        torch.manual_seed(0)
        lists, masters = mp_lists("fp16_master")
        lists[0] = [torch.randn(t.shape).half() for t in masters]
        mp_call(lists, flag())
        params, updates = fresh(torch.float32), fresh(torch.float16)
        stage_lists = [fresh(torch.float32), params, *[[torch.zeros(p.shape) for p in params] for _ in range(2)]]
        amp_C.multi_tensor_lamb_stage1_cuda(2048, flag(), [*stage_lists, updates], torch.full((5,), 0.01), 0, BETA1,
                                            BETA2, EPS, torch.tensor([3.0]), 1.0)  # fmt: skip
        amp_C.multi_tensor_lamb_stage2_cuda(2048, flag(), [params, updates], torch.ones(5), torch.ones(5), LR, 0.01)
        results[backend] = [*masters, *lists[4], *params, *updates]
    for kernel, reference in zip(results["kernel"], results["reference"], strict=True):
        torch.testing.assert_close(kernel, reference, rtol=1e-6, atol=1e-6)
