"""ampkit_optimizers kernels vs their pure-PyTorch reference, computed in float64 on fresh random inputs.

Each op runs (a) in float64 against the float64 reference (the same arithmetic, tight tolerance), (b) on
float32 inputs against the float64 reference of the same inputs, (c) on fp16/bf16 params (with and
without fp32 master weights, with fp16/bf16 or fp32 grads) against the reference run on identical
inputs. Non-dense tensors are rejected with an error naming the list; the optimizers copy strided
gradients into the parameter's layout before calling the kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from ampkit.ops.reference import optimizers as ref

# Odd sizes, an empty tensor, one spanning several parallel chunks (65537 > 2**16), many small ones.
SHAPES = [(1,), (7, 13), (0,), (65537,), (3, 5, 4), *[(n,) for n in range(5, 120, 19)]]
HALF = [torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def kernel_mode(monkeypatch):
    """The compiled kernel must build here: a failed build is an error, never a silent fallback."""
    monkeypatch.setenv("AMPKIT_OPS", "kernel")


def kernel(name: str) -> Callable[..., object]:
    from ampkit.ops.optimizers._kernels import op

    return op(name, torch.device("cpu"))


def rand_list(dtype: torch.dtype, kind: str = "randn", shapes=SHAPES) -> list[torch.Tensor]:
    make = {"randn": torch.randn, "rand": torch.rand}[kind]
    return [make(s, dtype=torch.float64).to(dtype) for s in shapes]


def steps(start: float = 3.0) -> list[torch.Tensor]:
    return [torch.tensor(start) for _ in SHAPES]


# Each case: op name, builder(param dtype, grad dtype, with_master) -> kwargs in schema order.
def adam_args(pd, gd, master, adam_w_mode=True, amsgrad=False, bias_correction=True):
    sd = torch.float64 if pd == torch.float64 else torch.float32
    params = rand_list(pd)
    return dict(
        params=params,
        grads=rand_list(gd),
        exp_avgs=rand_list(sd),
        exp_avg_sqs=rand_list(sd, "rand"),
        max_exp_avg_sqs=rand_list(sd, "rand") if amsgrad else [],
        master_params=[p.float() for p in params] if master else [],
        steps=steps(),
        lr=1e-2,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.1,
        adam_w_mode=adam_w_mode,
        amsgrad=amsgrad,
        bias_correction=bias_correction,
        grad_factor=0.5,
    )


def sgd_args(pd, gd, master, momentum=0.9, nesterov=False, first_step=False):
    sd = torch.float64 if pd == torch.float64 else torch.float32
    params = rand_list(pd)
    return dict(
        params=params,
        grads=rand_list(gd),
        momentum_buffers=rand_list(sd) if momentum else [],
        master_params=[p.float() for p in params] if master else [],
        lr=1e-2,
        weight_decay=0.1,
        momentum=momentum,
        dampening=0.0 if nesterov else 0.2,
        nesterov=nesterov,
        first_step=first_step,
        grad_factor=-0.25,
    )


def adagrad_args(pd, gd, master):
    sd = torch.float64 if pd == torch.float64 else torch.float32
    params = rand_list(pd)
    return dict(
        params=params,
        grads=rand_list(gd),
        state_sums=rand_list(sd, "rand"),
        master_params=[p.float() for p in params] if master else [],
        steps=steps(),
        lr=1e-2,
        lr_decay=0.01,
        weight_decay=0.1,
        eps=1e-10,
        grad_factor=2.0,
    )


def rmsprop_args(pd, gd, master, centered=True, momentum=0.9):
    sd = torch.float64 if pd == torch.float64 else torch.float32
    params = rand_list(pd)
    return dict(
        params=params,
        grads=rand_list(gd),
        square_avgs=[t + 1 for t in rand_list(sd, "rand")],
        grad_avgs=[t * 0.1 for t in rand_list(sd, "rand")] if centered else [],
        momentum_buffers=rand_list(sd) if momentum else [],
        master_params=[p.float() for p in params] if master else [],
        steps=steps(),
        lr=1e-2,
        alpha=0.99,
        eps=1e-8,
        weight_decay=0.1,
        momentum=momentum,
        centered=centered,
        grad_factor=0.5,
    )


def rmsprop_tf_args(pd, gd, master, centered=False, momentum=0.9, decoupled_decay=True, lr_in_momentum=True):
    args = rmsprop_args(pd, gd, master, centered, momentum)
    args.update(alpha=0.9, eps=1e-3, decoupled_decay=decoupled_decay, lr_in_momentum=lr_in_momentum)
    order = list(rmsprop_args(pd, gd, master, centered, momentum))[:-1]
    order += ["decoupled_decay", "lr_in_momentum", "grad_factor"]
    return {k: args[k] for k in order}


def adadelta_args(pd, gd, master):
    sd = torch.float64 if pd == torch.float64 else torch.float32
    params = rand_list(pd)
    return dict(
        params=params,
        grads=rand_list(gd),
        square_avgs=rand_list(sd, "rand"),
        acc_deltas=rand_list(sd, "rand"),
        master_params=[p.float() for p in params] if master else [],
        steps=steps(),
        lr=1.0,
        rho=0.9,
        eps=1e-6,
        weight_decay=0.1,
        grad_factor=0.5,
    )


def lamb_stage1_args(pd, gd, master, adam_w_mode=True, grad_averaging=True):
    sd = torch.float64 if pd == torch.float64 else torch.float32
    params = rand_list(pd)
    return dict(
        params=params,
        grads=rand_list(gd),
        exp_avgs=rand_list(sd),
        exp_avg_sqs=rand_list(sd, "rand"),
        updates=[torch.full(s, math.nan, dtype=sd) for s in SHAPES],
        master_params=[p.float() for p in params] if master else [],
        steps=steps(),
        beta1=0.9,
        beta2=0.999,
        eps=1e-6,
        weight_decay=0.01,
        adam_w_mode=adam_w_mode,
        grad_averaging=grad_averaging,
        bias_correction=True,
        grad_factor=0.3,
    )


def lamb_stage2_args(pd, gd, master):
    sd = torch.float64 if pd == torch.float64 else torch.float32
    params = rand_list(pd)
    return dict(
        params=params,
        updates=rand_list(sd),
        master_params=[p.float() for p in params] if master else [],
        ratios=torch.rand(len(SHAPES), dtype=torch.float64),
    )


def novograd_args(pd, gd, master, reg_inside_moment=False):
    sd = torch.float64 if pd == torch.float64 else torch.float32
    params = rand_list(pd)
    return dict(
        params=params,
        grads=rand_list(gd),
        exp_avgs=rand_list(sd),
        master_params=[p.float() for p in params] if master else [],
        denoms=torch.rand(len(SHAPES), dtype=torch.float64) + 0.5,
        lr=1e-2,
        beta1=0.95,
        weight_decay=0.1,
        reg_inside_moment=reg_inside_moment,
        grad_averaging=True,
        bias_correction1=0.4,
        grad_factor=0.5,
    )


# AdamP's projection test reads each weight against its gradient: (7, 13) gets gradients orthogonal to every
# row (channel-wise projection), (3, 5, 4) orthogonal to the whole weight only (layer-wise), the rest random
# (none). (40, 1700) splits its rows over parallel chunks; (4, 0) is an empty matrix.
ADAMP_SHAPES = [(7, 13), (3, 5, 4), (6, 9), (1, 33), (4, 0), (0,), (1,), (65537,), (40, 1700)]


def orthogonal_to(g: torch.Tensor, p: torch.Tensor, rows: int) -> torch.Tensor:
    """``g`` minus its projection on ``p``, in ``rows`` groups of ``p``'s flattened elements (float64)."""
    gr, pr = g.reshape(rows, -1), p.reshape(rows, -1)
    return (gr - pr * (gr * pr).sum(1, keepdim=True) / (pr * pr).sum(1, keepdim=True)).reshape(p.shape)


def adamp_args(pd, gd, master, nesterov=False):
    sd = torch.float64 if pd == torch.float64 else torch.float32
    params = rand_list(pd, shapes=ADAMP_SHAPES)
    grads = [torch.randn(s, dtype=torch.float64) for s in ADAMP_SHAPES]
    grads[0] = orthogonal_to(grads[0], params[0].double(), rows=7)
    grads[1] = orthogonal_to(grads[1], params[1].double(), rows=1)
    return dict(
        params=params,
        grads=[g.to(gd) for g in grads],
        exp_avgs=rand_list(sd, shapes=ADAMP_SHAPES),
        exp_avg_sqs=rand_list(sd, "rand", shapes=ADAMP_SHAPES),
        master_params=[p.float() for p in params] if master else [],
        steps=[torch.tensor(3.0) for _ in ADAMP_SHAPES],
        lr=1e-2,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.1,
        delta=0.1,
        wd_ratio=0.1,
        nesterov=nesterov,
        grad_factor=0.5,
    )


CASES = {
    "adamw": ("adam_step", adam_args),
    "adam_l2_amsgrad": ("adam_step", lambda *a: adam_args(*a, adam_w_mode=False, amsgrad=True)),
    "adam_no_bias_correction": ("adam_step", lambda *a: adam_args(*a, bias_correction=False)),
    "sgd_momentum": ("sgd_step", sgd_args),
    "sgd_nesterov_first": ("sgd_step", lambda *a: sgd_args(*a, nesterov=True, first_step=True)),
    "sgd_plain": ("sgd_step", lambda *a: sgd_args(*a, momentum=0.0)),
    "adagrad": ("adagrad_step", adagrad_args),
    "rmsprop_centered_momentum": ("rmsprop_step", rmsprop_args),
    "rmsprop_plain": ("rmsprop_step", lambda *a: rmsprop_args(*a, centered=False, momentum=0.0)),
    "rmsprop_tf": ("rmsprop_tf_step", rmsprop_tf_args),
    "rmsprop_tf_centered_l2": (
        "rmsprop_tf_step",
        lambda *a: rmsprop_tf_args(*a, centered=True, decoupled_decay=False, lr_in_momentum=False),
    ),
    "adadelta": ("adadelta_step", adadelta_args),
    "lamb_stage1": ("lamb_stage1", lamb_stage1_args),
    "lamb_stage1_l2": (
        "lamb_stage1",
        lambda *a: lamb_stage1_args(*a, adam_w_mode=False, grad_averaging=False),
    ),
    "lamb_stage2": ("lamb_stage2", lamb_stage2_args),
    "novograd": ("novograd_step", novograd_args),
    "novograd_reg_inside": ("novograd_step", lambda *a: novograd_args(*a, reg_inside_moment=True)),
    "adamp": ("adamp_step", adamp_args),
    "adamp_nesterov": ("adamp_step", lambda *a: adamp_args(*a, nesterov=True)),
}


# Ops whose update depends on sums over a tensor, which the kernel adds in another order than torch's sum.
SUMMING_OPS = ("adamp_step",)
HALF_CASES = ["adamw", "sgd_momentum", "adagrad", "rmsprop_centered_momentum", "lamb_stage2", "adamp"]


def clone_args(args: dict, dtype: torch.dtype | None = None) -> dict:
    """Deep copy of the tensor arguments (cast to ``dtype`` when given, steps stay float32)."""

    def conv(t: torch.Tensor, key: str) -> torch.Tensor:
        if dtype is None or key == "steps" or key in ("ratios", "denoms"):
            return t.clone()
        return t.to(dtype)

    return {
        k: [conv(t, k) for t in v] if isinstance(v, list) else conv(v, k) if isinstance(v, torch.Tensor) else v
        for k, v in args.items()
    }


def assert_args_close(actual: dict, expected: dict, **tol) -> None:
    for key, value in expected.items():
        if isinstance(value, list):
            for i, (a, e) in enumerate(zip(actual[key], value, strict=True)):
                torch.testing.assert_close(
                    a.to(torch.float64),
                    e.to(torch.float64),
                    msg=lambda m, k=key, i=i: f"{k}[{i}]: {m}",
                    **tol,
                )


@pytest.mark.parametrize("case", list(CASES))
def test_float64_kernel_matches_reference(case):
    name, build = CASES[case]
    args = build(torch.float64, torch.float64, False)
    expected = clone_args(args)
    kernel(name)(**args)
    getattr(ref, name)(**expected)
    tol = 1e-10 if name in SUMMING_OPS else 1e-12
    assert_args_close(args, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", list(CASES))
def test_float32_kernel_matches_float64_reference(case):
    name, build = CASES[case]
    args64 = build(torch.float64, torch.float64, False)
    args32 = clone_args(args64, torch.float32)
    kernel(name)(**args32)
    getattr(ref, name)(**args64)
    assert_args_close(args32, args64, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("grad_dtype", ["same", "float32"])
@pytest.mark.parametrize("master", [False, True])
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", HALF_CASES)
def test_half_params_with_fp32_state_match_reference(case, dtype, master, grad_dtype):
    name, build = CASES[case]
    gd = dtype if grad_dtype == "same" else torch.float32
    args = build(dtype, gd, master)
    expected = clone_args(args)
    kernel(name)(**args)
    getattr(ref, name)(**expected)
    # State and master copies are fp32 in both; params may differ by one rounding of the half type.
    half_eps = torch.finfo(dtype).eps
    for key, value in expected.items():
        if isinstance(value, list) and key not in ("params", "grads"):
            assert_args_close({key: args[key]}, {key: value}, rtol=1e-5, atol=1e-6)
    assert_args_close({"params": args["params"]}, {"params": expected["params"]}, rtol=half_eps, atol=half_eps)
    if master:  # the half parameter is the rounded master
        for p, m in zip(args["params"], args["master_params"], strict=True):
            torch.testing.assert_close(p, m.to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_nonfinite_gradients_propagate_as_in_the_reference(case):
    """Called without ``found_inf`` (Apex's fused optimizers and amp_C never skip inside the op), a NaN, inf or -inf
    gradient reaches the arithmetic: each kernel writes non-finite values exactly where its reference does (AMSGrad's
    running max and the square roots included), and the other tensors stay finite and equal."""
    name, build = CASES[case]
    args = build(torch.float64, torch.float64, False)
    key = "grads" if "grads" in args else "updates"
    for i, value in ((1, math.nan), (3, math.inf), (7, -math.inf)):
        args[key][i].view(-1)[args[key][i].numel() // 2] = value
    expected = clone_args(args)
    kernel(name)(**args)
    getattr(ref, name)(**expected)
    tol = 1e-10 if name in SUMMING_OPS else 1e-12
    written = [k for k, v in expected.items() if isinstance(v, list) and k not in ("grads", "steps")]
    for key_ in written:
        for i, (a, e) in enumerate(zip(args[key_], expected[key_], strict=True)):
            torch.testing.assert_close(
                a, e, rtol=tol, atol=tol, equal_nan=True, msg=lambda m, k=key_, i=i: f"{k}[{i}]: {m}"
            )
    assert any(not t.isfinite().all() for k in written for t in args[k])


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_adamp_nonfinite_gradients_propagate_as_in_the_reference(bad):
    """A NaN or inf gradient makes the projection test fail for its row and tensor in the kernel as in the
    reference (torch's max propagates NaN), so both write the same non-finite weights and nothing else."""
    args = adamp_args(torch.float64, torch.float64, False)
    args["grads"][0][2, 5] = bad
    args["grads"][8][17, 3] = bad
    expected = clone_args(args)
    kernel("adamp_step")(**args)
    ref.adamp_step(**expected)
    for key in ("params", "exp_avgs", "exp_avg_sqs"):
        for a, e in zip(args[key], expected[key], strict=True):
            torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10, equal_nan=True)
    assert not args["params"][0].isfinite().all()
    assert args["params"][2].isfinite().all()


@pytest.mark.parametrize("case", list(CASES))
def test_empty_lists_are_a_no_op(case):
    """Every op, kernel and reference, takes empty lists (a group whose params got no grads), GradScaler's tensors
    included."""
    name, build = CASES[case]
    args = {k: [] if isinstance(v, list) else v for k, v in build(torch.float32, torch.float32, False).items()}
    for key in ("ratios", "denoms"):
        if key in args:
            args[key] = torch.zeros(0, dtype=torch.float64)
    scaler = dict(grad_scale=one(2.0), found_inf=one(0.0)) if case in SCALER_CASES else {}
    kernel(name)(**args, **scaler)
    getattr(ref, name)(**args, **scaler)


def test_strided_tensors_are_rejected_with_the_list_named():
    args = adam_args(torch.float32, torch.float32, False)
    args["grads"][1] = torch.randn(13, 7).t()
    with pytest.raises(RuntimeError, match=r"grads\[1\] has strides"):
        kernel("adam_step")(**args)
    args = adam_args(torch.float32, torch.float32, False)
    args["params"][3] = torch.randn(65537 * 2)[::2]
    args["exp_avgs"][3] = torch.randn(65537 * 2)[::2]
    with pytest.raises(RuntimeError, match=r"params\[3\] is not dense"):
        kernel("adam_step")(**args)


def test_dense_permuted_tensors_are_updated_elementwise():
    """A channels-last-like (permuted, dense) layout is fine when every list shares it."""
    args = adam_args(torch.float64, torch.float64, False)
    for key in ("params", "grads", "exp_avgs", "exp_avg_sqs"):
        args[key][1] = args[key][1].t().contiguous().t()
    expected = clone_args(args)
    kernel("adam_step")(**args)
    ref.adam_step(**expected)
    assert_args_close(args, expected, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- torch's GradScaler contract in the kernels
# The ops that take grad_scale/found_inf: the skip and the unscale happen inside the kernel.
SCALER_CASES = [
    "adamw",
    "adam_l2_amsgrad",
    "sgd_momentum",
    "sgd_nesterov_first",
    "sgd_plain",
    "adagrad",
    "rmsprop_centered_momentum",
    "rmsprop_tf",
    "adadelta",
]


def one(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32)


@pytest.mark.parametrize("case", SCALER_CASES)
def test_found_inf_leaves_every_list_and_step_counter_untouched(case):
    name, build = CASES[case]
    args = build(torch.float32, torch.float32, False)
    before = clone_args(args)
    kernel(name)(**args, grad_scale=one(1024.0), found_inf=one(1.0))
    for key, value in before.items():
        if isinstance(value, list):
            assert all(torch.equal(a, b) for a, b in zip(args[key], value, strict=True)), key


@pytest.mark.parametrize("scale", [1024.0, 3.0], ids=["power_of_two", "three"])
@pytest.mark.parametrize("case", SCALER_CASES)
def test_grad_scale_matches_the_reference_and_leaves_the_grads_unscaled(case, scale):
    name, build = CASES[case]
    args = build(torch.float64, torch.float64, False)
    args["grads"] = [g * scale for g in args["grads"]]
    expected = clone_args(args)
    scaled_grads = [g.clone() for g in args["grads"]]
    kernel(name)(**args, grad_scale=one(scale), found_inf=one(0.0))
    getattr(ref, name)(**expected, grad_scale=one(scale), found_inf=one(0.0))
    assert_args_close(args, expected, rtol=1e-12, atol=1e-12)
    for got, g in zip(args["grads"], scaled_grads, strict=True):
        assert torch.equal(got, g / scale)  # the division torch's fused optimizers leave in .grad
    if "steps" in args:
        assert [float(s) for s in args["steps"]] == [4.0] * len(SHAPES)


@pytest.mark.parametrize("case", SCALER_CASES)
def test_grad_scale_is_folded_into_the_grad_factor(case):
    """The update with grad_scale s equals the update with grad_factor / s, bit for bit, in float32."""
    name, build = CASES[case]
    args = build(torch.float32, torch.float32, False)
    folded = clone_args(args)
    folded["grad_factor"] = args["grad_factor"] / 8.0
    kernel(name)(**args, grad_scale=one(8.0))
    kernel(name)(**folded)
    for key, value in folded.items():
        if isinstance(value, list) and key != "grads":
            assert all(torch.equal(a, b) for a, b in zip(args[key], value, strict=True)), key


@pytest.mark.parametrize("dtype", HALF)
def test_half_grads_are_written_back_unscaled_like_foreach_div(dtype):
    args = adam_args(dtype, dtype, True)
    scaled = [g.float().mul(512.0).to(dtype) for g in args["grads"]]
    args["grads"] = [g.clone() for g in scaled]
    kernel("adam_step")(**args, grad_scale=one(512.0), found_inf=one(0.0))
    expected = [g.clone() for g in scaled]
    torch._foreach_div_(expected, torch.tensor(512.0))
    assert all(torch.equal(a, b) for a, b in zip(args["grads"], expected, strict=True))


@pytest.mark.parametrize(
    "argument,value,message",
    [
        ("grad_scale", torch.tensor([1.0, 2.0]), r"grad_scale must be a one-element float32 tensor on cpu"),
        ("grad_scale", torch.tensor([2.0], dtype=torch.float64), r"grad_scale must be a one-element float32"),
        ("found_inf", torch.tensor([0], dtype=torch.int32), r"found_inf must be a one-element float32"),
    ],
)
@pytest.mark.parametrize("side", ["kernel", "reference"])
def test_bad_scaler_tensors_are_named(argument, value, message, side):
    """By the reference too, which read an int32 found_inf or a float64 scale where the kernel refuses them."""
    args = adam_args(torch.float32, torch.float32, False)
    with pytest.raises(RuntimeError, match=message):
        (kernel("adam_step") if side == "kernel" else ref.adam_step)(**args, **{argument: value})


@pytest.mark.parametrize("argument", ["grad_scale", "found_inf"])
@pytest.mark.parametrize("case", SCALER_CASES)
@pytest.mark.parametrize("side", ["kernel", "reference"])
def test_a_scaler_tensor_sharing_memory_with_a_list_is_refused_before_anything_moves(case, argument, side):
    """The kernels read grad_scale and found_inf while they write every list in parallel chunks (the unscaled
    gradients too): one inside a parameter, gradient, state or step counter was read before or after a chunk wrote
    it (torch's fused ops take it and divide the later gradients by the changed scale)."""
    name, build = CASES[case]
    step = kernel(name) if side == "kernel" else getattr(ref, name)
    lists = [key for key, value in build(torch.float32, torch.float32, False).items() if isinstance(value, list)]
    for key in [k for k in lists if build(torch.float32, torch.float32, False)[k]]:
        args = build(torch.float32, torch.float32, False)
        shared = args[key][1] if key == "steps" else args[key][1].view(-1)[3:4]
        other = "found_inf" if argument == "grad_scale" else "grad_scale"
        before = clone_args(args)
        with pytest.raises(RuntimeError, match=rf"{name}: {argument} shares memory with {key}\[1\], which the step"):
            step(**args, **{argument: shared, other: one(0.0 if other == "found_inf" else 1.0)})
        for k in lists:
            assert all(torch.equal(a, b) for a, b in zip(args[k], before[k], strict=True)), (key, k)
    args = build(torch.float32, torch.float32, False)
    buffer = torch.ones(4)  # a view of a buffer no list holds is not refused
    step(**args, **{argument: buffer[2:3], other: one(0.0 if other == "found_inf" else 1.0)})


BAD_INPUTS = [
    ("length", lambda a: a.update(exp_avgs=a["exp_avgs"][:-1]), r"exp_avgs has \d+ tensors but params has"),
    ("shape", lambda a: a["grads"].__setitem__(2, torch.randn(4)), r"grads\[2\] has shape"),
    (
        "state dtype",
        lambda a: a["exp_avg_sqs"].__setitem__(0, torch.rand(1).half()),
        r"exp_avg_sqs\[0\] has dtype",
    ),
    ("grad dtype", lambda a: a.update(grads=[g.double() for g in a["grads"]]), r"grads have dtype Double"),
    (
        "int params",
        lambda a: a["params"].__setitem__(0, torch.ones(1, dtype=torch.int32)),
        r"params\[0\] has dtype",
    ),
    (
        "mixed params",
        lambda a: a["params"].__setitem__(1, a["params"][1].double()),
        r"params must share one dtype",
    ),
    (
        "fp32 master",
        lambda a: a.update(master_params=[p.clone() for p in a["params"]]),
        r"master_params are only",
    ),
    ("amsgrad list", lambda a: a.update(max_exp_avg_sqs=a["exp_avg_sqs"]), r"max_exp_avg_sqs must be empty"),
    ("step", lambda a: a["steps"].__setitem__(0, torch.tensor([1, 2])), r"steps\[0\] must be a one-element"),
]


@pytest.mark.parametrize("mutate,message", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_errors_name_the_argument(mutate, message):
    args = adam_args(torch.float32, torch.float32, False)
    mutate(args)
    with pytest.raises(RuntimeError, match=message):
        kernel("adam_step")(**args)


REFERENCE_DTYPE_INPUTS = [
    ("int params", lambda a: a["params"].__setitem__(0, torch.ones(1, dtype=torch.int32)), r"params\[0\] has dtype"),
    (
        "complex params",
        lambda a: a.update(params=[p.to(torch.complex64) for p in a["params"]]),
        r"params\[0\] has dtype torch.complex64; expected float32",
    ),
    ("mixed params", lambda a: a["params"].__setitem__(1, a["params"][1].double()), r"params must share one dtype"),
    ("meta params", lambda a: a["params"].__setitem__(1, a["params"][1].to("meta")), r"params\[1\] is on meta"),
    ("int grads", lambda a: a.update(grads=[g.int() for g in a["grads"]]), r"grads have dtype torch.int32"),
    (
        "state dtype",
        lambda a: a["exp_avg_sqs"].__setitem__(0, torch.rand(1).half()),
        r"exp_avg_sqs\[0\] has dtype torch.float16; expected torch.float32",
    ),
]


@pytest.mark.parametrize(
    "mutate,message", [b[1:] for b in REFERENCE_DTYPE_INPUTS], ids=[b[0] for b in REFERENCE_DTYPE_INPUTS]
)
def test_the_reference_refuses_the_dtypes_the_kernel_refuses(mutate, message):
    """The reference runs where no kernel is built (no compiler, and on CUDA for the ops whose CUDA kernels are not
    opted in), amp_C's optimizer ops included: it stepped an int parameter and truncated it ([1, 2, 3] became
    [0, 1, 2]), took int gradients, and dropped a complex parameter's imaginary part, all without a word."""
    args = adam_args(torch.float32, torch.float32, False)
    mutate(args)
    before = [p.clone() for p in args["params"]]
    with pytest.raises(RuntimeError, match=message):
        ref.adam_step(**args)
    assert all(p.is_meta or torch.equal(p, b) for p, b in zip(args["params"], before, strict=True))


def _replace(key: str, index: int, make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
    return lambda a: a[key].__setitem__(index, make(a[key][index]))


def _half_adam(*a, **k):
    return adam_args(torch.float16, torch.float16, True, **k)


# A bad list entry past the first tensor: the reference stepped every tensor before it, then failed naming nothing.
REFUSED_BY_BOTH = [
    ("short masters", _half_adam, lambda a: a.update(master_params=a["master_params"][:-1]), r"master_params has 11"),
    ("half master", _half_adam, _replace("master_params", 3, lambda t: t.half()), r"master_params\[3\] has dtype"),
    ("fp32 masters", adam_args, lambda a: a.update(master_params=[p.clone() for p in a["params"]]), r"only meaningful"),
    ("no amsgrad list", lambda *a: adam_args(*a, amsgrad=True), lambda a: a.update(max_exp_avg_sqs=[]), r"has 0 tens"),
    ("amsgrad list unused", adam_args, lambda a: a.update(max_exp_avg_sqs=a["exp_avgs"]), r"must be empty"),
    ("state on meta", adam_args, _replace("exp_avgs", 3, lambda t: t.to("meta")), r"exp_avgs\[3\] is on meta"),
    ("int step", adam_args, _replace("steps", 3, lambda t: t.long()), r"steps\[3\] must be a one-element float32"),
    ("short buffers", sgd_args, lambda a: a.update(momentum_buffers=a["momentum_buffers"][:-1]), r"buffers has 11"),
    ("buffer shape", sgd_args, _replace("momentum_buffers", 3, lambda t: t[:5]), r"buffers\[3\] has shape \[5\]"),
    ("no grad_avgs", rmsprop_args, lambda a: a.update(grad_avgs=[]), r"grad_avgs has 0 tensors"),
    ("short ratios", lamb_stage2_args, lambda a: a.update(ratios=a["ratios"][:3]), r"ratios must be a .*vector"),
    ("short denoms", novograd_args, lambda a: a.update(denoms=a["denoms"][:3]), r"denoms must be a .*vector"),
]
OPS_OF = {adam_args: "adam_step", _half_adam: "adam_step", sgd_args: "sgd_step", rmsprop_args: "rmsprop_step",
          lamb_stage2_args: "lamb_stage2", novograd_args: "novograd_step"}  # fmt: skip


@pytest.mark.parametrize("side", ["kernel", "reference"])
@pytest.mark.parametrize("build,mutate,message", [b[1:] for b in REFUSED_BY_BOTH], ids=[b[0] for b in REFUSED_BY_BOTH])
def test_the_reference_refuses_what_the_kernel_refuses_before_writing_anything(side, build, mutate, message):
    """The reference is the fallback and the CUDA path of the ops without a checked kernel: it takes the kernel's list
    checks, all before the first write. A list one tensor short, a tensor on another device or an int step counter
    stepped the tensors before it, then raised an IndexError or torch's error naming no list; masters of the wrong
    dtype or next to float32 params were taken without a word."""
    name = OPS_OF.get(build, "adam_step")
    args = build(torch.float32, torch.float32, False) if build is not _half_adam else build()
    mutate(args)
    before = clone_args({k: v for k, v in args.items() if isinstance(v, list)})
    run = kernel(name) if side == "kernel" else getattr(ref, name)
    with pytest.raises(RuntimeError, match=message):
        run(**args)
    for key, value in before.items():
        for i, (a, b) in enumerate(zip(args[key], value, strict=True)):
            assert a.is_meta or torch.equal(a, b), f"{key}[{i}] was written"


# ---------------------------------------------------------------- CUDA kernels (run where a GPU exists)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")


@pytest.fixture(params=["per_tensor", "multi_tensor"])
def cuda_kernels(request, monkeypatch):
    """Every CUDA test runs with both kernel sets AMPKIT_CUDA_KERNELS selects: the default per-tensor kernels and
    the multi-tensor ones (RMSprop, RMSprop-TF, Adadelta, LAMB, NovoGrad), which stay opt-in until these pass."""
    monkeypatch.setenv("AMPKIT_CUDA_KERNELS", request.param)
    return request.param


HOST_ARGS = ("ratios", "denoms")  # read on the host by both CPU and CUDA kernels
HOST_STEPS = ("lamb_stage1", "adamp_step")  # these read their step counters on the host; the others on the device


def to_cuda(args: dict, name: str = "") -> dict:
    def move(t: torch.Tensor, key: str) -> torch.Tensor:
        on_host = key in HOST_ARGS or (key == "steps" and name in HOST_STEPS)
        return t.clone() if on_host else t.cuda()

    return {
        k: [move(t, k) for t in v] if isinstance(v, list) else move(v, k) if isinstance(v, torch.Tensor) else v
        for k, v in args.items()
    }


def lists_on_cpu(args: dict) -> dict:
    """The tensor-list arguments of a CUDA call, copied back to the host for comparison."""
    return {k: [t.cpu() for t in v] for k, v in args.items() if isinstance(v, list)}


def cuda_kernel(name: str) -> Callable[..., object]:
    from ampkit.ops.optimizers._kernels import op

    return op(name, torch.device("cuda"))


@needs_cuda
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_float64_kernel_matches_reference(case, cuda_kernels):
    name, build = CASES[case]
    args = build(torch.float64, torch.float64, False)
    on_gpu = to_cuda(args, name)
    cuda_kernel(name)(**on_gpu)
    getattr(ref, name)(**args)
    tol = 1e-10 if name in SUMMING_OPS else 1e-12
    assert_args_close(lists_on_cpu(on_gpu), args, rtol=tol, atol=tol)
    if "steps" in args:  # step counters advance exactly as on CPU, on the device where the kernels read them
        assert [float(s) for s in on_gpu["steps"]] == [float(s) for s in args["steps"]]
        assert all(
            s.device == (torch.device("cpu") if name in HOST_STEPS else params_device(on_gpu)) for s in on_gpu["steps"]
        )


@needs_cuda
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_float32_kernel_matches_float64_reference(case, cuda_kernels):
    name, build = CASES[case]
    args64 = build(torch.float64, torch.float64, False)
    on_gpu = to_cuda(clone_args(args64, torch.float32), name)
    cuda_kernel(name)(**on_gpu)
    getattr(ref, name)(**args64)
    assert_args_close(lists_on_cpu(on_gpu), args64, rtol=2e-5, atol=2e-6)


@needs_cuda
@pytest.mark.parametrize("master", [False, True])
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", [*HALF_CASES, "rmsprop_tf", "adadelta", "lamb_stage1", "novograd"])
def test_cuda_half_params_match_reference(case, dtype, master, cuda_kernels):
    name, build = CASES[case]
    args = build(dtype, torch.float32, master)
    on_gpu = to_cuda(args, name)
    cuda_kernel(name)(**on_gpu)
    getattr(ref, name)(**args)
    half_eps = torch.finfo(dtype).eps
    got = lists_on_cpu(on_gpu)
    state = {k: v for k, v in args.items() if isinstance(v, list) and k not in ("params", "grads")}
    assert_args_close(got, state, rtol=1e-5, atol=1e-6)
    assert_args_close(got, {"params": args["params"]}, rtol=half_eps, atol=half_eps)


@needs_cuda
def test_cuda_kernel_rejects_a_list_on_another_device(cuda_kernels):
    args = to_cuda(adam_args(torch.float32, torch.float32, False), "adam_step")
    args["exp_avgs"][2] = args["exp_avgs"][2].cpu()
    with pytest.raises(RuntimeError, match=r"exp_avgs\[2\] is on cpu; expected cuda"):
        cuda_kernel("adam_step")(**args)


def params_device(args: dict) -> torch.device:
    return args["params"][0].device


@needs_cuda
@pytest.mark.parametrize("case", SCALER_CASES)
def test_cuda_found_inf_on_the_device_skips_without_a_host_read(case, cuda_kernels):
    name, build = CASES[case]
    on_gpu = to_cuda(build(torch.float32, torch.float32, False), name)
    before = {k: [t.clone() for t in v] for k, v in on_gpu.items() if isinstance(v, list)}
    # Made before the watched region: a host-to-device copy from pageable memory synchronizes by itself.
    grad_scale, found_inf = one(1024.0).cuda(), one(1.0).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cuda_kernel(name)(**on_gpu, grad_scale=grad_scale, found_inf=found_inf)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for key, value in before.items():
        assert all(torch.equal(a, b) for a, b in zip(on_gpu[key], value, strict=True)), key


@needs_cuda
@pytest.mark.parametrize("case", SCALER_CASES)
def test_cuda_grad_scale_matches_the_reference_without_a_host_read(case, cuda_kernels):
    name, build = CASES[case]
    args = build(torch.float64, torch.float64, False)
    args["grads"] = [g * 3.0 for g in args["grads"]]
    on_gpu = to_cuda(args, name)
    grad_scale, found_inf = one(3.0).cuda(), one(0.0).cuda()  # before the watched region, as above
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cuda_kernel(name)(**on_gpu, grad_scale=grad_scale, found_inf=found_inf)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    getattr(ref, name)(**args, grad_scale=one(3.0), found_inf=one(0.0))
    assert_args_close(lists_on_cpu(on_gpu), args, rtol=1e-12, atol=1e-12)


@needs_cuda
def test_cuda_steps_on_the_host_are_refused_by_name(cuda_kernels):
    args = to_cuda(adam_args(torch.float32, torch.float32, False), "adam_step")
    args["steps"][1] = args["steps"][1].cpu()
    with pytest.raises(RuntimeError, match=r"steps\[1\] must be a one-element float32 tensor on cuda"):
        cuda_kernel("adam_step")(**args)


# The ops with multi-tensor CUDA kernels, each variant the kernels compile separately.
MULTI_TENSOR_CASES = [
    "rmsprop_centered_momentum",
    "rmsprop_plain",
    "rmsprop_tf",
    "rmsprop_tf_centered_l2",
    "adadelta",
    "lamb_stage1",
    "lamb_stage1_l2",
    "lamb_stage2",
    "novograd",
    "novograd_reg_inside",
]


def joined(parts: list[dict]) -> dict:
    """Several argument sets as one call: every list (and per-tensor vector) concatenated, scalars of the first."""
    out = dict(parts[0])
    for key, value in parts[0].items():
        if isinstance(value, list):
            out[key] = [t for p in parts for t in p[key]]
        elif isinstance(value, torch.Tensor) and value.dim() == 1:
            out[key] = torch.cat([p[key] for p in parts])
    return out


def stored_one_element_off(args: dict) -> dict:
    """The same values stored one element past an aligned address (a storage_offset view of a larger buffer), so
    no tensor can take vector loads and every chunk runs the scalar path."""

    def shift(t: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        view = buffer[1:].view(t.shape)
        view.copy_(t)
        return view

    return {k: [shift(t) for t in v] if isinstance(v, list) and k != "steps" else v for k, v in args.items()}


@needs_cuda
@pytest.mark.parametrize("layout", ["aligned", "offset_views"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", MULTI_TENSOR_CASES)
def test_cuda_multi_tensor_kernels_equal_the_per_tensor_kernels(case, dtype, layout, monkeypatch):
    """Bit for bit: the same element math (optimizer_math.h, no FMA contraction) over 44 tensors (more than one
    launch's slots; odd sizes, empty, a two-chunk one), with vector loads or, for offset views, without."""
    name, build = CASES[case]
    half = dtype != torch.float32
    args = joined([build(dtype, torch.float32 if half else dtype, half) for _ in range(4)])
    results = {}
    for choice in ("per_tensor", "multi_tensor"):
        monkeypatch.setenv("AMPKIT_CUDA_KERNELS", choice)
        on_gpu = to_cuda(clone_args(args), name)
        if layout == "offset_views":
            on_gpu = stored_one_element_off(on_gpu)
        cuda_kernel(name)(**on_gpu)
        results[choice] = lists_on_cpu(on_gpu)
    for key, tensors in results["per_tensor"].items():
        for i, (a, b) in enumerate(zip(tensors, results["multi_tensor"][key], strict=True)):
            assert torch.equal(a, b), f"{key}[{i}]"


@needs_cuda
def test_cuda_multi_tensor_kernel_covers_a_tensor_longer_than_one_launch(monkeypatch):
    """320 chunks of 65536 elements fill a launch; the tensor goes on in the next one."""
    monkeypatch.setenv("AMPKIT_CUDA_KERNELS", "multi_tensor")
    n = 321 * 65536 + 7
    g = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(n, device="cuda", generator=g), torch.randn(5, device="cuda", generator=g)]
    grads = [torch.randn(p.shape, device="cuda", generator=g) for p in params]
    square_avgs = [torch.rand(p.shape, device="cuda", generator=g) for p in params]
    acc_deltas = [torch.rand(p.shape, device="cuda", generator=g) for p in params]
    steps_ = [torch.zeros((), device="cuda") for _ in params]
    expected = [t.double().cpu() for t in (params[0], grads[0], square_avgs[0], acc_deltas[0])]
    cuda_kernel("adadelta_step")(params, grads, square_avgs, acc_deltas, [], steps_, 1.0, 0.9, 1e-6, 0.0, 1.0)
    p, gr, sq, ad = expected
    ref.adadelta_step([p], [gr], [sq], [ad], [], [torch.zeros(())], 1.0, 0.9, 1e-6, 0.0, 1.0)
    torch.testing.assert_close(params[0].cpu().double(), p, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(square_avgs[0].cpu().double(), sq, rtol=1e-5, atol=1e-6)
