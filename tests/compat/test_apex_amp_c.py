"""Apex's ``amp_C`` ops and ``multi_tensor_applier`` on ampkit's kernels: argument order, overflow-buffer
semantics and results against float64 references (odd sizes, non-contiguous tensors, empty lists, inf/nan)."""

from __future__ import annotations

import importlib
import math
import sys

import pytest
import torch

from ampkit.compat import amp_c as amp_C
from ampkit.compat import apex_c, install_apex_shim, uninstall_apex_shim
from ampkit.compat.multi_tensor_apply import MultiTensorApply, multi_tensor_applier

SIZES = [(7, 13), (29,), (3, 5, 4), (1,), (6, 5)]


@pytest.fixture(autouse=True)
def kernel_mode(monkeypatch):
    monkeypatch.setenv("AMPKIT_OPS", "kernel")


def flag():
    return torch.zeros(1, dtype=torch.int32)


def randn_list(dtype, sizes=SIZES, scale=1.0):
    """Fresh random tensors; the last one is a transposed (non-contiguous) view."""
    tensors = [(torch.randn(s, dtype=torch.float64) * scale).to(dtype) for s in sizes]
    tensors[-1] = tensors[-1].t()
    return tensors


# ----------------------------------------------------------------- the import surface


def test_amp_c_and_the_applier_import_through_the_shim_only():
    assert "amp_C" not in sys.modules
    install_apex_shim()
    try:
        imported = importlib.import_module("amp_C")
        from amp_C import multi_tensor_scale
        from apex.multi_tensor_apply import multi_tensor_applier as applier
        from apex.multi_tensor_apply.multi_tensor_apply import MultiTensorApply as by_module_path

        assert imported is amp_C and multi_tensor_scale is amp_C.multi_tensor_scale
        assert applier is multi_tensor_applier and applier.available
        assert by_module_path is MultiTensorApply
        from apex_C import flatten, unflatten  # Apex's other top-level extension

        assert (flatten, unflatten) == (apex_c.flatten, apex_c.unflatten)
    finally:
        uninstall_apex_shim()
    assert "amp_C" not in sys.modules and "apex_C" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("amp_C")
    with pytest.raises(AttributeError, match="it provides .*multi_tensor_adam"):
        _ = amp_C.multi_tensor_fused_adam  # a name Apex's amp_C never had


def test_applier_passes_its_chunk_size_first():
    seen = []
    MultiTensorApply(333)(lambda *args: seen.append(args), "flag", [["x"]], 1.5)
    assert seen == [(333, "flag", [["x"]], 1.5)]
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        MultiTensorApply(0)


# ----------------------------------------------------------------- scale, axpby, norms


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_scale_matches_float64_and_flags_inf_nan(in_dtype, out_dtype):
    inputs = randn_list(in_dtype)
    outputs = [torch.empty(t.shape, dtype=out_dtype) for t in inputs]
    buf = flag()
    multi_tensor_applier(amp_C.multi_tensor_scale, buf, [inputs, outputs], 0.25)
    assert buf.item() == 0
    for i, o in zip(inputs, outputs, strict=True):
        assert torch.equal(o, (i.double() * 0.25).to(out_dtype))
    for bad in (math.inf, math.nan):
        inputs[2].view(-1)[5] = bad
        buf = flag()
        multi_tensor_applier(amp_C.multi_tensor_scale, buf, [inputs, outputs], 0.25)
        assert buf.item() == 1
        multi_tensor_applier(amp_C.multi_tensor_scale, buf, [inputs[:2], outputs[:2]], 0.25)
        assert buf.item() == 1, "the flag is raised, never cleared"
    multi_tensor_applier(amp_C.multi_tensor_scale, flag(), [[], []], 0.25)


@pytest.mark.parametrize("arg_to_check", [-1, 0, 1])
def test_axpby_matches_float64_and_checks_the_named_argument(arg_to_check):
    x, y = randn_list(torch.float16), randn_list(torch.float32)
    x[1:3] = [t.float() for t in x[1:3]]  # x/y pairs of mixed and of equal dtypes, as Apex allows
    out = [torch.empty(t.shape, dtype=torch.float16) for t in x]
    buf = flag()
    multi_tensor_applier(amp_C.multi_tensor_axpby, buf, [x, y, out], 2.0, -0.5, arg_to_check)
    assert buf.item() == 0
    for a, b, o in zip(x, y, out, strict=True):
        assert torch.equal(o, (2.0 * a.double() - 0.5 * b.double()).float().half())
    x[0].view(-1)[3] = math.inf
    buf = flag()
    multi_tensor_applier(amp_C.multi_tensor_axpby, buf, [x, y, out], 2.0, -0.5, arg_to_check)
    assert buf.item() == (arg_to_check in (-1, 0))
    with pytest.raises(RuntimeError, match="arg_to_check=2"):
        amp_C.multi_tensor_axpby(2048, flag(), [x, y, out], 1.0, 1.0, 2)


def test_scale_and_axpby_take_a_whole_state_dict_with_its_integer_buffers():
    """An EMA or a copy over ``model.state_dict().values()`` meets BatchNorm's int64 counter among the floats."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).double()
    model(torch.randn(4, 3, dtype=torch.float64))
    ema = {k: v.clone() for k, v in model.state_dict().items()}
    ema["1.num_batches_tracked"].fill_(10)
    expected = {k: 0.3 * ema[k] + 0.7 * v for k, v in model.state_dict().items()}
    buf = flag()
    values = list(ema.values())
    multi_tensor_applier(
        amp_C.multi_tensor_axpby, buf, [values, list(model.state_dict().values()), values], 0.3, 0.7, -1
    )
    assert buf.item() == 0
    assert ema["1.num_batches_tracked"].dtype == torch.int64 and ema["1.num_batches_tracked"].item() == 4, (
        "0.3 * 10 + 0.7 * 1, rounded"
    )
    for key in ("0.weight", "1.running_var"):
        torch.testing.assert_close(ema[key], expected[key].float().double())
    copies = [torch.empty_like(v) for v in ema.values()]
    multi_tensor_applier(amp_C.multi_tensor_scale, buf, [list(ema.values()), copies], 1.0)
    assert all(torch.equal(c, v) for c, v in zip(copies, ema.values(), strict=True))
    x = [torch.tensor([1.0, math.nan]), torch.tensor(4)]
    multi_tensor_applier(amp_C.multi_tensor_axpby, buf, [x, [torch.zeros(2), torch.tensor(7)], x], 1.0, 1.0, 1)
    assert buf.item() == 0 and x[1].item() == 11, "only y is checked; the counter is 4 + 7"
    multi_tensor_applier(
        amp_C.multi_tensor_scale, buf, [[torch.tensor([math.inf])], [torch.zeros(1, dtype=torch.int32)]], 1.0
    )
    assert buf.item() == 1, "a float input written into an integer output is still checked"


def test_scale_and_axpby_take_a_state_dicts_bool_mask_as_its_integers():
    """A causal mask kept as a persistent bool buffer (older transformers' GPT-2 attention) is in the same EMA or copy
    over ``state_dict().values()``: it was refused by name where integer buffers were taken."""
    mask = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    weight = torch.randn(3)
    ema = [weight.clone(), torch.zeros(3, 3, dtype=torch.bool)]
    buf = flag()
    multi_tensor_applier(amp_C.multi_tensor_axpby, buf, [ema, [weight * 2, mask], ema], 0.25, 0.75, -1)
    assert buf.item() == 0 and ema[1].dtype == torch.bool
    assert torch.equal(ema[1], mask), "0.25 * False + 0.75 * True rounds to True, 0.75 * False to False"
    torch.testing.assert_close(ema[0], 0.25 * weight + 0.75 * weight * 2)
    copies = [torch.empty(3), torch.ones(3, 3, dtype=torch.bool)]
    multi_tensor_applier(amp_C.multi_tensor_scale, buf, [[weight, mask], copies], 1.0)
    assert torch.equal(copies[0], weight) and torch.equal(copies[1], mask) and buf.item() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_l2norm_and_unscale_l2norm_return_apex_shapes(dtype):
    tensors = randn_list(dtype, scale=8.0)
    expected = torch.stack([t.double().norm() for t in tensors])
    norm, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag(), [tensors])
    assert norm.shape == (1,) and norm.dtype == torch.float32 and per.numel() == 0
    assert torch.allclose(norm.double(), expected.norm().view(1), rtol=1e-6)
    norm, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag(), [tensors], True)
    assert torch.allclose(per.double(), expected, rtol=1e-6)
    before = [t.clone() for t in tensors]
    buf = flag()
    norm, per = multi_tensor_applier(amp_C.multi_tensor_unscale_l2norm, buf, [tensors], torch.tensor([0.125]), True)
    assert torch.allclose(norm.double(), expected.norm().view(1) * 0.125, rtol=1e-6)
    assert torch.allclose(per.double(), expected * 0.125, rtol=1e-6)
    assert buf.item() == 0 and all(torch.equal(a, b) for a, b in zip(tensors, before, strict=True))
    norm_mp, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm_mp, flag(), [tensors])
    assert torch.equal(norm_mp, multi_tensor_applier(amp_C.multi_tensor_l2norm, flag(), [tensors])[0])
    scaled = [torch.empty(t.shape) for t in tensors]
    norm, per = multi_tensor_applier(amp_C.multi_tensor_l2norm_scale, flag(), [tensors, scaled], 0.5, True)
    assert torch.allclose(norm.double(), expected.norm().view(1), rtol=1e-6), "the norm is of the unscaled input"
    assert all(torch.equal(s, t.float() * 0.5) for s, t in zip(scaled, tensors, strict=True))
    tensors[1][7] = math.nan
    for op, lists, args in (
        (amp_C.multi_tensor_l2norm, [tensors], ()),
        (amp_C.multi_tensor_unscale_l2norm, [tensors], (0.5,)),
        (amp_C.multi_tensor_l2norm_scale, [tensors, scaled], (0.5,)),
    ):
        buf = flag()
        multi_tensor_applier(op, buf, lists, *args)
        assert buf.item() == 1


# ----------------------------------------------------------------- optimizer ops


def adam_reference(p, g, m, v, lr, beta1, beta2, eps, step, mode, bias_correction, wd):
    """Apex's multi_tensor_adam element math in float64."""
    p, g, m, v = p.double(), g.double(), m.double(), v.double()
    if mode == 0:
        g = g + wd * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    c1, c2 = (1 - beta1**step, 1 - beta2**step) if bias_correction else (1.0, 1.0)
    update = (m / c1) / ((v / c2).sqrt() + eps)
    if mode == 1:
        update = update + wd * p
    return p - lr * update, m, v


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("bias_correction", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_adam_matches_apex_math(mode, bias_correction, dtype):
    params = [t.contiguous() for t in randn_list(dtype)]
    exp_avgs = [torch.zeros(p.shape) for p in params]
    exp_avg_sqs = [torch.zeros(p.shape) for p in params]
    ref = [(p.double(), m.double(), v.double()) for p, m, v in zip(params, exp_avgs, exp_avg_sqs, strict=True)]
    buf = flag()
    buf.fill_(1)  # Apex's non-capturable Adam ignores the overflow buffer
    for step in range(1, 4):
        grads = [torch.randn(p.shape).to(dtype) for p in params]
        multi_tensor_applier(
            amp_C.multi_tensor_adam, buf, [grads, params, exp_avgs, exp_avg_sqs],
            1e-2, 0.9, 0.999, 1e-8, step, mode, bias_correction, 0.1,
        )  # fmt: skip
        ref = [
            adam_reference(p, g, m, v, 1e-2, 0.9, 0.999, 1e-8, step, mode, bias_correction, 0.1)
            for (p, m, v), g in zip(ref, grads, strict=True)
        ]
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    for p, m, (rp, rm, _) in zip(params, exp_avgs, ref, strict=True):
        assert m.dtype == torch.float32
        assert torch.allclose(p.double(), rp, rtol=tol, atol=tol)
        assert torch.allclose(m.double(), rm, rtol=tol, atol=tol)


def sgd_reference(w, g, mom, wd, momentum, dampening, lr, nesterov, first_run, scale, wd_after_momentum=False):
    g = g.double() * scale + (0.0 if wd_after_momentum else wd * w.double())
    mom = g if first_run else mom.double() * momentum + (1 - dampening) * g
    step = g + momentum * mom if nesterov else mom
    if wd_after_momentum:  # Apex: the decay joins after the momentum update
        step = step + wd * w.double()
    return w.double() - lr * step, mom


@pytest.mark.parametrize("layout", ["fp32", "fp16", "fp16_grads_fp32_master"])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("wd_after_momentum", [False, True])
def test_sgd_three_and_four_lists_match_apex_math_and_skip_on_the_flag(layout, nesterov, wd_after_momentum):
    weight_dtype = torch.float16 if layout == "fp16" else torch.float32
    grad_dtype = torch.float32 if layout == "fp32" else torch.float16
    weights = [t.contiguous() for t in randn_list(weight_dtype)]
    moms = [torch.zeros(w.shape, dtype=weight_dtype) for w in weights]
    model_copies = [w.half() for w in weights]
    ref_w, ref_m = [w.double() for w in weights], [m.double() for m in moms]
    hyper = dict(wd=0.01, momentum=0.9, dampening=0.0, lr=0.1, nesterov=nesterov)
    for first_run in (True, False, False):
        grads = [torch.randn(w.shape).to(grad_dtype) for w in weights]
        lists = [grads, weights, moms] + ([model_copies] if layout == "fp16_grads_fp32_master" else [])
        multi_tensor_applier(amp_C.multi_tensor_sgd, flag(), lists, *hyper.values(), first_run, wd_after_momentum, 0.5)
        for i, g in enumerate(grads):
            ref_w[i], ref_m[i] = sgd_reference(
                ref_w[i], g, ref_m[i], **hyper, first_run=first_run, scale=0.5, wd_after_momentum=wd_after_momentum
            )
    tol = 1e-6 if weight_dtype == torch.float32 else 1e-2
    for i, w in enumerate(weights):
        assert moms[i].dtype == weight_dtype
        assert torch.allclose(w.double(), ref_w[i], rtol=tol, atol=tol)
        if layout == "fp16_grads_fp32_master":
            assert torch.equal(model_copies[i], w.half())
    frozen = [t.clone() for t in (*weights, *moms, *model_copies)]
    raised = flag().fill_(1)  # the lists Apex's kernel takes: it refused fp16 grads of fp32 weights without a copy
    multi_tensor_applier(amp_C.multi_tensor_sgd, raised, lists, *hyper.values(), False, wd_after_momentum, 1.0)
    kept = (*weights, *moms, *model_copies)
    assert all(torch.equal(a, b) for a, b in zip(kept, frozen, strict=True))


def test_lamb_matches_apex_math_with_global_norm_clipping():
    params = [t.contiguous() for t in randn_list(torch.float32)]
    exp_avgs = [torch.zeros(p.shape) for p in params]
    exp_avg_sqs = [torch.zeros(p.shape) for p in params]
    ref = [(p.double(), torch.zeros(p.shape, dtype=torch.float64)) for p in params]
    ref_v = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    lr, beta1, beta2, eps, wd, max_norm = 1e-2, 0.9, 0.999, 1e-6, 0.01, 1.0
    for step in (1, 2):
        grads = [torch.randn(p.shape) for p in params]
        fresh = [g.clone() for g in grads]  # the op leaves the LAMB direction in the grads, as Apex's did
        global_norm = torch.stack([g.double().norm() for g in grads]).norm().float().view(1)
        assert global_norm.item() > max_norm
        multi_tensor_applier(
            amp_C.multi_tensor_lamb, flag(), [grads, params, exp_avgs, exp_avg_sqs],
            lr, beta1, beta2, eps, step, 1, wd, 1, 1, global_norm, max_norm, False,
        )  # fmt: skip
        clip = global_norm.double().item() / max_norm
        for i, g in enumerate(fresh):
            p, m = ref[i]
            g = g.double() / clip
            m = beta1 * m + (1 - beta1) * g
            ref_v[i] = beta2 * ref_v[i] + (1 - beta2) * g * g
            update = (m / (1 - beta1**step)) / ((ref_v[i] / (1 - beta2**step)).sqrt() + eps) + wd * p
            ratio = p.norm() / update.norm()
            ref[i] = (p - lr * ratio * update, m)
    for p, m, (rp, rm) in zip(params, exp_avgs, ref, strict=True):
        assert torch.allclose(p.double(), rp, rtol=1e-5, atol=1e-6)
        assert torch.allclose(m.double(), rm, rtol=1e-5, atol=1e-6)


def test_lamb_called_as_in_2019_clips_by_its_own_grads_norm_and_always_applies_the_trust_ratio():
    """Apex's FusedLAMB of August 2019 to April 2020, still copied into projects, passed ``max_grad_norm`` right
    after ``mode`` and no global norm: the op took the norm of the grads it was given, and applied the trust
    ratio even with no weight decay."""
    params = [t.contiguous() for t in randn_list(torch.float32)]
    exp_avgs, exp_avg_sqs = [torch.zeros(p.shape) for p in params], [torch.zeros(p.shape) for p in params]
    grads = [torch.randn(p.shape) * 3 for p in params]
    before, fresh = [p.double() for p in params], [g.double() for g in grads]
    lr, beta1, beta2, eps, max_norm = 1e-2, 0.9, 0.999, 1e-6, 1.0
    multi_tensor_applier(
        amp_C.multi_tensor_lamb, flag(), [grads, params, exp_avgs, exp_avg_sqs],
        lr, beta1, beta2, eps, 1, 1, 0.0, 1, 1, max_norm,
    )  # fmt: skip
    clip = torch.stack([g.norm() for g in fresh]).norm().item() / max_norm
    assert clip > 1
    for p, g, got in zip(before, fresh, params, strict=True):
        g = g / clip
        update = ((1 - beta1) * g / (1 - beta1)) / (((1 - beta2) * g * g / (1 - beta2)).sqrt() + eps)
        assert torch.allclose(got.double(), p - lr * (p.norm() / update.norm()) * update, rtol=1e-5, atol=1e-6)


def test_empty_lists_do_nothing():
    buf = flag()
    norm, per = amp_C.multi_tensor_l2norm(2048, buf, [[]], True)
    assert norm.tolist() == [0.0] and per.numel() == 0
    amp_C.multi_tensor_axpby(2048, buf, [[], [], []], 1.0, 1.0, -1)
    amp_C.multi_tensor_adam(2048, buf, [[], [], [], []], 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    amp_C.multi_tensor_sgd(2048, buf, [[], [], []], 0.0, 0.9, 0.0, 0.1, False, True, False, 1.0)
    amp_C.multi_tensor_lamb(2048, buf, [[], [], [], []], 1e-3, 0.9, 0.999, 1e-6, 1, 1, 0.0, 1, 1, torch.zeros(1), 1.0)
    assert buf.item() == 0
    with pytest.raises(RuntimeError, match="tensor_lists has 2 lists; expected 4"):
        amp_C.multi_tensor_adam(2048, buf, [[], []], 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    with pytest.raises(RuntimeError, match=r"tensor_lists\[1\] has 0 tensors but tensor_lists\[0\] has 1"):
        amp_C.multi_tensor_scale(2048, buf, [[torch.ones(2)], []], 1.0)


def test_a_bare_tensor_a_missing_grad_or_a_bad_flag_is_named_not_iterated():
    """Apex's binding took lists of tensors only; iterating a bare tensor would run the op on its rows."""
    buf, param = flag(), torch.randn(2, 3)
    with pytest.raises(
        TypeError, match=r"multi_tensor_l2norm: tensor_lists\[0\] must be a list of tensors, got Tensor"
    ):
        amp_C.multi_tensor_l2norm(2048, buf, [param], True)
    with pytest.raises(TypeError, match=r"multi_tensor_adam: tensor_lists\[0\]\[0\] must be a tensor, got NoneType"):
        amp_C.multi_tensor_adam(2048, buf, [[param.grad], [param], [param * 0], [param * 0]], 1e-3, 0.9, 0.999, 1e-8,
                                1, 1, 1, 0.0)  # fmt: skip
    with pytest.raises(TypeError, match=r"multi_tensor_sgd: noop_flag must be a one-element .* got \[2\]"):
        amp_C.multi_tensor_sgd(2048, torch.zeros(2), [[param], [param], [param]], 0.0, 0.9, 0.0, 0.1, False, True,
                               False, 1.0)  # fmt: skip
    assert buf.item() == 0


def test_a_per_tensor_that_is_not_a_bool_is_named_as_apexs_binding_refused_it():
    """Apex's binding took ``per_tensor`` as an optional bool (a TypeError for anything else); ``bool()`` here read
    ``"no"`` as True and returned per-tensor norms. None (Apex's default) still means False."""
    param = torch.randn(2, 3)
    with pytest.raises(TypeError, match=r"`per_tensor` must be True or False, got 'no'"):
        amp_C.multi_tensor_l2norm(2048, flag(), [[param]], "no")
    with pytest.raises(TypeError, match=r"`per_tensor` must be True or False, got 'no'"):
        amp_C.multi_tensor_unscale_l2norm(2048, flag(), [[param]], torch.ones(1), "no")
    _, per = amp_C.multi_tensor_l2norm(2048, flag(), [[param]], None)
    assert per.numel() == 0


def _fresh_lists(count):
    params = [torch.randn(5), torch.randn(3, 2)]
    return [
        [torch.randn(p.shape) for p in params],
        params,
        *([torch.zeros(p.shape) for p in params] for _ in range(count)),
    ]


OPS_WITH_SWITCHES = {  # op -> (its call with one on/off argument set to ``value``, that argument's name)
    "multi_tensor_adam": lambda v: amp_C.multi_tensor_adam(
        2048, flag(), _fresh_lists(2), 0.1, 0.9, 0.99, 1e-8, 1, 1, v, 0.0
    ),
    "multi_tensor_novograd": lambda v: amp_C.multi_tensor_novograd(
        2048, flag(), _fresh_lists(1), torch.zeros(2), 0.1, 0.9, 0.99, 1e-8, 1, 1, 0.0, v, 0, 2
    ),
    "multi_tensor_lamb": lambda v: amp_C.multi_tensor_lamb(
        2048, flag(), _fresh_lists(2), 0.1, 0.9, 0.99, 1e-8, 1, 1, 0.0, 1, 1, torch.ones(1), 1.0, v
    ),
    "multi_tensor_sgd": lambda v: amp_C.multi_tensor_sgd(
        2048, flag(), _fresh_lists(1), 0.0, 0.9, 0.0, 0.1, v, 0, 0, 1.0
    ),
}  # fmt: skip


@pytest.mark.parametrize("value", ["False", "0", 2])
@pytest.mark.parametrize("name", list(OPS_WITH_SWITCHES))
def test_an_on_off_argument_that_is_not_a_bool_or_0_1_is_named_as_apexs_binding_refused_it(name, value):
    """pybind11 refused a string for Apex's int and bool flags, and its kernels took only 1 as on; ``bool()`` here
    read ``"0"`` and ``2`` as on (SGD's failed in the kernel's schema, naming neither the op nor the argument)."""
    with pytest.raises(TypeError, match=rf"^{name}: \w+ must be True or False, got {value!r}$"):
        OPS_WITH_SWITCHES[name](value)


def test_a_numpy_bool_per_tensor_is_taken_as_apexs_binding_took_it():
    """pybind11 reads numpy's bool_ as a bool; the check above refused it."""
    import numpy as np

    params = [torch.randn(2, 3), torch.randn(4)]
    _, per = amp_C.multi_tensor_l2norm(2048, flag(), [params], np.True_)
    torch.testing.assert_close(per, torch.stack([p.norm() for p in params]))


def test_novograd_names_grad_norms_of_the_wrong_length_or_dtype():
    """One float32 second moment per tensor: Apex's kernel indexed it by tensor; an integer one would truncate."""
    grads, params = [torch.randn(3), torch.randn(4)], [torch.randn(3), torch.randn(4)]
    lists = [grads, params, [torch.zeros(3), torch.zeros(4)]]
    for grad_norms in (torch.zeros(1), torch.zeros(2, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"grad_norms must be a float32 tensor with one second moment per tensor"):
            amp_C.multi_tensor_novograd(2048, flag(), lists, grad_norms, 0.1, 0.9, 0.99, 1e-8, 1, 1, 0.0, 1, 0, 2)


def test_a_bias_corrected_step_0_is_named_instead_of_turning_the_params_into_nan():
    """A custom optimizer that increments its step after the call passes 0 first: 1 - beta ** 0 divides by zero."""
    lists = [[torch.randn(5)], [torch.randn(5)], [torch.zeros(5)], [torch.zeros(5)]]
    before = lists[1][0].clone()
    calls = [
        lambda: amp_C.multi_tensor_adam(2048, flag(), lists, 1e-3, 0.9, 0.999, 1e-8, 0, 1, 1, 0.0),
        lambda: amp_C.multi_tensor_lamb(
            2048, flag(), lists, 1e-3, 0.9, 0.999, 1e-6, 0, 1, 0.0, 1, 1, torch.ones(1), 1.0
        ),
        lambda: amp_C.multi_tensor_novograd(
            2048, flag(), lists[:3], torch.zeros(1), 0.1, 0.9, 0.99, 1e-8, 0, 1, 0.0, 1, 0, 2
        ),  # fmt: skip
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match=r"step=0 with bias_correction; the first step is 1"):
            call()
    assert torch.equal(lists[1][0], before)
    amp_C.multi_tensor_adam(2048, flag(), lists, 1e-3, 0.9, 0.999, 1e-8, 0, 1, 0, 0.0)  # uncorrected: 0 is fine
    assert torch.isfinite(lists[1][0]).all()


def test_scalars_passed_as_tensors_of_several_elements_are_named():
    """lr, step, norms and scales are one value each; Apex's kernels read element 0 of whatever they got."""
    lists = [[torch.randn(5)], [torch.randn(5)], [torch.zeros(5)], [torch.zeros(5)]]
    lr, step, one = torch.tensor([1e-3]), torch.tensor([1]), torch.ones(1)
    calls = [
        (lambda: amp_C.multi_tensor_lamb(2048, flag(), lists, 1e-3, 0.9, 0.999, 1e-6, 1, 1, 0.0, 1, 1, torch.ones(2),
                                         1.0), r"multi_tensor_lamb: global_grad_norm must be .* got shape \[2\]"),
        (lambda: amp_C.multi_tensor_adam_capturable(2048, flag(), lists, lr, 0.9, 0.999, 1e-8, step, 1, 1, 0.0,
                                                    torch.ones(2)), r"inv_scale must be a one-element tensor"),
        (lambda: amp_C.multi_tensor_adam_capturable(2048, torch.zeros(2), lists, lr, 0.9, 0.999, 1e-8, step, 1, 1,
                                                    0.0, one), r"noop_flag must be a one-element tensor"),
    ]  # fmt: skip
    for call, message in calls:
        with pytest.raises(RuntimeError, match=message):
            call()


def test_apex_c_names_an_empty_list_and_a_flat_buffer_too_small_for_the_tensors():
    with pytest.raises(ValueError, match="apex_C.flatten: expected a non-empty list of tensors"):
        apex_c.flatten([])
    with pytest.raises(ValueError, match=r"apex_C.unflatten: flat must be 1-D with at least the tensors' 4 elements"):
        apex_c.unflatten(torch.ones(3), [torch.ones(2), torch.ones(2)])
    first, second = apex_c.unflatten(torch.arange(5.0), [torch.ones(2), torch.ones(2)])  # Apex read the leading part
    assert first.tolist() == [0.0, 1.0] and second.tolist() == [2.0, 3.0]


# ----------------------------------------------------------------- update_scale_hysteresis (Megatron's scaler)
def _hysteresis_reference(scale, growth, hyst, found, growth_factor, backoff, interval, hysteresis):
    """One update as plain Python numbers: an overflow first counts the hysteresis down and only backs off
    once it reaches zero; a clean step grows after ``interval`` in a row and refills the hysteresis."""
    if found:
        hyst -= 1
        if hyst > 0:
            return scale, 0, hyst
        return scale * backoff, 0, hyst
    growth += 1
    if growth == interval:
        grown = scale * growth_factor
        return (grown if grown < 3.4e38 else scale), 0, hysteresis
    return scale, growth, hysteresis


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_update_scale_hysteresis_follows_its_state_machine_over_a_random_overflow_pattern(hysteresis):
    generator = torch.Generator().manual_seed(hysteresis)
    pattern = (torch.rand(60, generator=generator) < 0.35).tolist()
    scale, growth, hyst = torch.tensor([2.0**20]), torch.zeros(1, dtype=torch.int32), torch.tensor([hysteresis])
    expected = (2.0**20, 0, hysteresis)
    for found in pattern:
        out = amp_C.update_scale_hysteresis(scale, growth, hyst, torch.tensor([float(found)]), 2.0, 0.5, 3, hysteresis)
        expected = _hysteresis_reference(*expected, found, 2.0, 0.5, 3, hysteresis)
        assert out is scale
        assert (scale.item(), growth.item(), hyst.item()) == expected
    assert growth.dtype == torch.int32 and scale.dtype == torch.float32


def test_update_scale_hysteresis_never_grows_to_inf_and_flushes_tiny_scales_to_zero():
    scale, growth, hyst = torch.tensor([3.0e38]), torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    amp_C.update_scale_hysteresis(scale, growth, hyst, torch.zeros(1), 2.0, 0.5, 1, 1)
    assert scale.item() == pytest.approx(3.0e38) and growth.item() == 0
    scale.fill_(torch.finfo(torch.float32).tiny)
    amp_C.update_scale_hysteresis(scale, growth, hyst, torch.ones(1), 2.0, 0.5, 1, 1)
    assert scale.item() == 0.0


def test_update_scale_hysteresis_takes_grad_scaler_style_0_dim_state_and_names_bad_state():
    """Apex's kernel read element 0 of whatever it was given, so torch.amp.GradScaler's 0-dim tensors worked."""
    scale, growth, hyst = torch.full((), 4.0), torch.full((), 0, dtype=torch.int32), torch.full((), 2)
    for found, expected in ((1.0, (4.0, 0, 1)), (1.0, (2.0, 0, 0)), (0.0, (2.0, 1, 2)), (0.0, (4.0, 0, 2))):
        amp_C.update_scale_hysteresis(scale, growth, hyst, torch.full((), found), 2.0, 0.5, 2, 2)
        assert (scale.item(), growth.item(), hyst.item()) == expected and scale.dim() == 0
    with pytest.raises(TypeError, match="current_scale must be floating-point .* got torch.int64"):
        amp_C.update_scale_hysteresis(torch.tensor([4]), growth, hyst, torch.ones(1), 2.0, 0.5, 2, 2)
    with pytest.raises(ValueError, match=r"found_inf must be a one-element tensor, got shape \[0\]"):
        amp_C.update_scale_hysteresis(scale, growth, hyst, torch.empty(0), 2.0, 0.5, 2, 2)


def test_amp_c_has_every_op_of_apexs_last_amp_c():
    """The ``m.def`` names of Apex's ``csrc/amp_C_frontend.cpp`` at the last commit before amp was removed."""
    apex_ops = {
        "multi_tensor_scale", "multi_tensor_sgd", "multi_tensor_axpby", "multi_tensor_l2norm",
        "multi_tensor_l2norm_mp", "multi_tensor_l2norm_scale", "multi_tensor_unscale_l2norm",
        "multi_tensor_lamb_stage1_cuda", "multi_tensor_lamb_stage2_cuda", "multi_tensor_adam",
        "multi_tensor_adam_capturable", "multi_tensor_adam_capturable_master", "multi_tensor_adagrad",
        "multi_tensor_novograd", "multi_tensor_lamb", "multi_tensor_lamb_mp", "update_scale_hysteresis",
    }  # fmt: skip
    assert set(amp_C.__all__) == apex_ops
    assert all(callable(getattr(amp_C, name)) for name in apex_ops)


def _adam_lists():
    return [[torch.ones(4)], [torch.randn(4)], [torch.zeros(4)], [torch.zeros(4)]]


NUMBER_CALLS = {
    "lr": lambda v: amp_C.multi_tensor_adam(2048, flag(), _adam_lists(), v, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0),
    "beta1": lambda v: amp_C.multi_tensor_adam(2048, flag(), _adam_lists(), 1e-3, v, 0.999, 1e-8, 1, 1, 1, 0.0),
    "step": lambda v: amp_C.multi_tensor_adam(2048, flag(), _adam_lists(), 1e-3, 0.9, 0.999, 1e-8, v, 1, 1, 0.0),
    "mode": lambda v: amp_C.multi_tensor_adam(2048, flag(), _adam_lists(), 1e-3, 0.9, 0.999, 1e-8, 1, v, 1, 0.0),
    "wd": lambda v: amp_C.multi_tensor_sgd(
        2048, flag(), _adam_lists()[:3], v, 0.9, 0.0, 0.1, False, True, False, 1.0
    ),  # fmt: skip
    "scale": lambda v: amp_C.multi_tensor_scale(2048, flag(), [[torch.ones(3)], [torch.empty(3)]], v),
    "chunk_size": lambda v: amp_C.multi_tensor_scale(v, flag(), [[torch.ones(3)], [torch.empty(3)]], 2.0),
}


@pytest.mark.parametrize("value", ["1e-3", None, torch.ones(2), 1.5], ids=["str", "None", "two_elements", "float"])
@pytest.mark.parametrize("name", list(NUMBER_CALLS))
def test_a_number_apexs_binding_refused_is_named(name, value):
    """pybind11 refused a string or None for a float argument and a float for an int one: ``float()`` here read
    ``lr="1e-3"`` as a number, step=1.5 ran as a step count, and None or a two-element ``beta1`` reached the kernel's
    schema, a multi-line error naming neither the op nor the argument."""
    is_int = name in ("step", "mode", "chunk_size")
    if isinstance(value, float) and not is_int:
        NUMBER_CALLS[name](value)  # a float for a float: fine
        return
    expected = "an integer" if is_int else "a number"
    with pytest.raises(TypeError, match=rf"^amp_C\.\w+: {name} must be {expected}, as Apex's binding took it"):
        NUMBER_CALLS[name](value)


def test_numbers_apexs_binding_took_are_taken():
    """numpy's numbers, a one-element tensor for a float, and a bool (1.0 for a float, as pybind11 reads it)."""
    import numpy as np

    out = [torch.empty(3)]
    for scale in (np.float32(2.0), np.int64(2), torch.tensor(2.0), True):
        amp_C.multi_tensor_scale(np.int64(2048), flag(), [[torch.ones(3)], out], scale)
        assert torch.equal(out[0], torch.full((3,), float(scale)))
    NUMBER_CALLS["step"](np.int64(1))
    NUMBER_CALLS["step"](torch.tensor(1))
