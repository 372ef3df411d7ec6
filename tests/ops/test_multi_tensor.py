"""Multi-tensor kernels vs their pure-PyTorch reference computed in float64, on fresh random inputs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ampkit.ops import multi_tensor as mt
from ampkit.ops.reference import multi_tensor as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Odd sizes, an empty tensor, one spanning several 32768-element chunks, and many small ones.
SIZES = [1, 3, 0, 17, 1000, 33333, 100_003, *range(5, 300, 7)]
TOL = {
    torch.float32: dict(rtol=2e-6, atol=1e-6),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=8e-3, atol=8e-3),
    torch.float64: dict(rtol=1e-12, atol=1e-12),
}
POSITIONS = ["first", "middle", "last"]
BAD_VALUES = [float("inf"), float("-inf"), float("nan")]


@pytest.fixture(autouse=True)
def kernel_mode(monkeypatch):
    """Every test here runs the compiled kernel; a failed build is an error, never a silent fallback."""
    monkeypatch.setenv("AMPKIT_OPS", "kernel")


def randn_list(sizes, dtype, noncontiguous=False, scale=1.0):
    """Fresh random tensors; non-contiguous ones are every other element of a wider tensor."""
    if noncontiguous:
        return [(torch.randn(n, 2) * scale)[:, 1].to(dtype) for n in sizes]
    return [(torch.randn(n) * scale).to(dtype) for n in sizes]


def as64(tensors):
    return [t.to(torch.float64) for t in tensors]


def put(tensors, index, position, value):
    t = tensors[index]
    t.view(-1)[{"first": 0, "middle": t.numel() // 2, "last": -1}[position]] = value


def assert_lists_close(actual, expected, dtype):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a.to(torch.float64), e, equal_nan=True, **TOL[dtype])


def flag():
    return torch.zeros(1)


# ---------------------------------------------------------------- scale_


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_scale_matches_reference(in_dtype, out_dtype):
    xs = randn_list(SIZES, in_dtype, scale=100.0)
    outs = [torch.empty(x.shape, dtype=out_dtype) for x in xs]
    found = flag()
    mt.scale_(xs, 1 / 1024, found, out=outs)
    expected = [torch.empty(x.shape, dtype=torch.float64) for x in xs]
    ref.scale_(as64(xs), expected, 1 / 1024, torch.zeros(1))
    assert_lists_close(outs, expected, out_dtype)
    assert found.item() == 0


def test_scale_in_place_and_noncontiguous():
    xs = randn_list([5, 40_000, 7], torch.float32, noncontiguous=True)
    assert not xs[1].is_contiguous()
    expected = [x.double() * 3.5 for x in xs]
    mt.scale_(xs, torch.tensor(3.5), flag())  # in place, factor as a tensor
    assert_lists_close(xs, expected, torch.float32)
    transposed = torch.empty(300, 200).t()  # non-contiguous output
    src = [torch.randn(200, 300)]
    mt.scale_(src, 2.0, flag(), out=[transposed])
    torch.testing.assert_close(transposed, src[0] * 2.0)


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("value", BAD_VALUES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_flags_nonfinite(position, value, dtype):
    xs = randn_list([10, 70_001, 33], dtype)
    put(xs, 1, position, value)
    expected = [x.double() * 0.5 for x in xs]
    found = flag()
    mt.scale_(xs, 0.5, found)
    assert found.item() == 1
    assert_lists_close(xs, expected, dtype)


def test_flag_is_never_cleared_and_may_be_int():
    found = torch.ones(1, dtype=torch.int32)
    mt.scale_(randn_list([10], torch.float32), 2.0, found)
    assert found.item() == 1
    found = torch.zeros(1, dtype=torch.int32)
    xs = randn_list([10], torch.float32)
    xs[0][3] = float("nan")
    mt.scale_(xs, 2.0, found)
    assert found.dtype == torch.int32 and found.item() == 1


# ---------------------------------------------------------------- axpby_


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("noncontiguous", [False, True])
def test_axpby_matches_reference(dtype, noncontiguous):
    xs = randn_list(SIZES, dtype, noncontiguous)
    ys = randn_list(SIZES, dtype, noncontiguous)
    outs = [torch.empty(x.shape, dtype=torch.float32) for x in xs]
    mt.axpby_(0.75, xs, -1.25, ys, outs, flag())
    expected = [torch.empty(x.shape, dtype=torch.float64) for x in xs]
    ref.axpby_(0.75, as64(xs), -1.25, as64(ys), expected, torch.zeros(1))
    assert_lists_close(outs, expected, torch.float32)


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize(("bad_arg", "arg_to_check", "flagged"), [
    ("x", -1, True), ("y", -1, True), ("x", 0, True), ("y", 0, False), ("x", 1, False), ("y", 1, True),
])  # fmt: skip
def test_axpby_checks_the_chosen_argument(position, bad_arg, arg_to_check, flagged):
    xs, ys = randn_list([9, 50_000], torch.float32), randn_list([9, 50_000], torch.float32)
    put(xs if bad_arg == "x" else ys, 1, position, float("inf"))
    found = flag()
    mt.axpby_(2.0, xs, 3.0, ys, ys, found, arg_to_check=arg_to_check)  # out aliases y
    assert found.item() == float(flagged)


# ---------------------------------------------------------------- combine_


@pytest.mark.parametrize("new_dtype", DTYPES)
def test_combine_matches_reference(new_dtype):
    sizes = SIZES
    new = randn_list(sizes, new_dtype, scale=1024.0)  # finite in fp16
    stash = [torch.randn(n) if i % 3 else None for i, n in enumerate(sizes)]
    out = [torch.empty(n) for n in sizes]
    found = flag()
    mt.combine_(new, stash, out, 1 / 65536, found)
    expected = [torch.empty(n, dtype=torch.float64) for n in sizes]
    stash64 = [None if s is None else s.double() for s in stash]
    ref.combine_(as64(new), stash64, expected, 1 / 65536, torch.zeros(1))
    assert_lists_close(out, expected, torch.float32)
    assert found.item() == 0


def test_combine_accumulates_in_place_into_the_stash():
    new = randn_list([7, 40_000], torch.float16, noncontiguous=True)
    grads = randn_list([7, 40_000], torch.float32)
    expected = [n.double() / 8 + g.double() for n, g in zip(new, grads, strict=True)]
    mt.combine_(new, grads, grads, 1 / 8, flag())
    assert_lists_close(grads, expected, torch.float32)
    no_stash = randn_list([3, 5], torch.float32)
    expected = [n.double() / 8 for n in no_stash]
    mt.combine_(no_stash, None, no_stash, torch.tensor(1 / 8), flag())
    assert_lists_close(no_stash, expected, torch.float32)


@pytest.mark.parametrize("position", POSITIONS)
def test_combine_checks_only_the_new_grads(position):
    new, stash = randn_list([11, 40_000], torch.float32), randn_list([11, 40_000], torch.float32)
    put(stash, 1, position, float("nan"))
    found = flag()
    mt.combine_(new, stash, [torch.empty(11), torch.empty(40_000)], 0.5, found)
    assert found.item() == 0
    put(new, 1, position, float("-inf"))
    mt.combine_(new, stash, [torch.empty(11), torch.empty(40_000)], 0.5, found)
    assert found.item() == 1


# ---------------------------------------------------------------- norms


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])
@pytest.mark.parametrize("noncontiguous", [False, True])
def test_l2norm_matches_reference(dtype, noncontiguous):
    xs = randn_list(SIZES, dtype, noncontiguous)
    total, per = mt.l2norm(xs, per_tensor=True)
    ref_total, ref_per = ref.l2norm(as64(xs), True)
    assert total.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = TOL[torch.float64] if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(total.double(), ref_total, **tol)
    torch.testing.assert_close(per.double(), ref_per, **tol)
    assert mt.l2norm(xs).per_tensor is None


def test_l2norm_of_mixed_dtypes_and_matrices():
    xs = [torch.randn(64, 33), torch.randn(1001).half(), torch.randn(7, 3, 5).bfloat16()]
    total, per = mt.l2norm(xs, per_tensor=True)
    expected = torch.stack([x.double().norm() for x in xs])
    torch.testing.assert_close(per.double(), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(total.double(), expected.norm(), rtol=1e-5, atol=0)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(0, 70_000), max_size=12))
def test_l2norm_any_size_mix(sizes):
    xs = randn_list(sizes, torch.float32)
    total, per = mt.l2norm(xs, per_tensor=True)
    expected = torch.stack([x.double().norm() for x in xs]) if xs else torch.zeros(0, dtype=torch.float64)
    torch.testing.assert_close(per.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(total.double(), expected.norm(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("write", [False, True])
def test_unscale_l2norm_matches_reference(dtype, write):
    xs = randn_list(SIZES, dtype, scale=4096.0)
    before = [x.clone() for x in xs]
    found = flag()
    total, per = mt.unscale_l2norm(xs, 1 / 4096, found, out=xs if write else None, per_tensor=True)
    expected_out = [torch.empty(x.shape, dtype=torch.float64) for x in xs]
    ref_total, ref_per = ref.unscale_l2norm(as64(before), expected_out, 1 / 4096, torch.zeros(1), True)
    torch.testing.assert_close(total.double(), ref_total, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(per.double(), ref_per, rtol=1e-5, atol=1e-6)
    assert_lists_close(xs, expected_out if write else as64(before), dtype)
    assert found.item() == 0


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("value", BAD_VALUES)
def test_unscale_l2norm_flags_nonfinite(position, value):
    xs = randn_list([3, 70_000, 8], torch.bfloat16)
    put(xs, 1, position, value)
    found = flag()
    total, _ = mt.unscale_l2norm(xs, 0.5, found)
    assert found.item() == 1
    assert not torch.isfinite(total)


def test_unscale_l2norm_flags_nonfinite_inputs_not_overflowing_squares():
    found = flag()
    total, _ = mt.unscale_l2norm([torch.full((100,), 3e38)], 1.0, found)
    assert found.item() == 0 and total.item() == float("inf")


# ---------------------------------------------------------------- empty lists and bad input


def test_empty_lists_do_nothing():
    found = flag()
    mt.scale_([], 2.0, found)
    mt.axpby_(1.0, [], 1.0, [], [], found)
    mt.combine_([], None, [], 1.0, found)
    assert mt.l2norm([]).total.item() == 0
    total, per = mt.unscale_l2norm([], 1.0, found, per_tensor=True)
    assert total.item() == 0 and per.numel() == 0 and found.item() == 0


@pytest.fixture(params=["kernel", "reference"])
def any_mode(request, monkeypatch):
    """Bad input gets the same error, naming the argument, from the kernel and from the reference."""
    monkeypatch.setenv("AMPKIT_OPS", request.param)


def ones(n=3, dtype=torch.float32, device="cpu"):
    return torch.ones(n, dtype=dtype, device=device)


BAD_CALLS = {
    "length": (
        lambda: mt.scale_([ones()] * 2, 2.0, flag(), out=[ones()]),
        r"`out` has 1 tensors but `inputs` has 2",
    ),
    "dtype": (lambda: mt.scale_([ones(), ones(dtype=torch.int64)], 2.0, flag()), r"`inputs\[1\]` has dtype"),
    "numel": (
        lambda: mt.scale_([ones()], 2.0, flag(), out=[ones(4)]),
        r"`out\[0\]` has 4 elements but the matching input has 3",
    ),
    "device": (
        lambda: mt.scale_([ones()], 2.0, flag(), out=[ones(device="meta")]),
        r"`out\[0\]` is on the meta device, which holds no values",
    ),
    "flag_size": (
        lambda: mt.scale_([ones()], 2.0, torch.zeros(2)),
        r"`found_inf` must have exactly one element",
    ),
    "flag_dtype": (lambda: mt.scale_([ones()], 2.0, torch.zeros(1).half()), r"`found_inf` has dtype"),
    "axpby_length": (
        lambda: mt.axpby_(1.0, [ones()], 1.0, [ones()], [], flag()),
        r"`out` has 0 tensors but `x` has 1",
    ),
    "axpby_dtype": (
        lambda: mt.axpby_(1.0, [ones()], 1.0, [ones(dtype=torch.half)], [ones()], flag()),
        r"`y\[0\]` has dtype .* must share a dtype",
    ),
    "axpby_check": (
        lambda: mt.axpby_(1.0, [ones()], 1.0, [ones()], [ones()], flag(), arg_to_check=2),
        r"`arg_to_check` is 2",
    ),
    "stash_length": (
        lambda: mt.combine_([ones()], [None, None], [ones()], 1.0, flag()),
        r"`stash` has 2 entries but `new` has 1",
    ),
    "stash_dtype": (
        lambda: mt.combine_([ones()], [ones(dtype=torch.half)], [ones()], 1.0, flag()),
        r"`stash\[0\]` has dtype .* but `out\[0\]`",
    ),
    "norm_dtype": (lambda: mt.l2norm([ones(), ones(2, dtype=torch.int32)]), r"`inputs\[1\]` has dtype"),
    "norm_out_length": (
        lambda: mt.unscale_l2norm([ones()], 1.0, flag(), out=[ones(), ones()]),
        r"`out` has 2 tensors but `inputs` has 1",
    ),
    # out may be its input (in place) but not a shifted view of it: parallel chunks would race
    "out_partly_shared": (
        lambda: (lambda x: mt.scale_([ones(), x[1:]], 2.0, flag(), out=[ones(), x[:-1]]))(ones(9)),
        r"`out\[1\]` shares part of its memory with `inputs\[1\]`",
    ),
    "out_expanded": (
        lambda: mt.scale_([ones()], 2.0, flag(), out=[torch.zeros(1).expand(3)]),
        r"`out\[0\]` holds one element at several positions",
    ),
    "axpby_out_partly_y": (
        lambda: (lambda y: mt.axpby_(1.0, [ones(4)], 1.0, [y[:4]], [y[2:]], flag()))(ones(6)),
        r"`out\[0\]` shares part of its memory with `y\[0\]`",
    ),
    "combine_out_partly_stash": (
        lambda: (lambda s: mt.combine_([ones(4)], [s[1:]], [s[:4]], 1.0, flag()))(ones(5)),
        r"`out\[0\]` shares part of its memory with `stash\[0\]`",
    ),
    "norm_out_partly_shared": (
        lambda: (lambda x: mt.unscale_l2norm([x[:4]], 1.0, flag(), out=[x[2:6]]))(ones(8)),
        r"`out\[0\]` shares part of its memory with `inputs\[0\]`",
    ),
    # nor another index's tensor: every index's chunks run in parallel, so out[1] over inputs[0] raced
    "out_is_another_inputs_tensor": (
        lambda: (lambda a, b: mt.scale_([a, b], 2.0, flag(), out=[b, a]))(ones(4), ones(4)),
        r"`out\[\d\]` shares memory with `inputs\[\d\]`; an output may be its own index's input",
    ),
    "one_tensor_written_at_two_indices": (
        lambda: (lambda a: mt.scale_([a, a], 2.0, flag()))(ones(4)),
        r"`out\[\d\]` shares memory with `(inputs|out)\[\d\]`",
    ),
    "axpby_out_over_another_index_of_x": (
        lambda: (lambda x: mt.axpby_(1.0, [x[:3], x[3:]], 1.0, [ones(3), ones(3)], [x[3:], ones(3)], flag()))(ones(6)),
        r"`out\[0\]` shares memory with `x\[1\]`",
    ),
    "combine_out_over_another_index_of_stash": (
        lambda: (lambda s: mt.combine_([ones(2), ones(2)], [s, None], [ones(2), s], 1.0, flag()))(ones(2)),
        r"`out\[1\]` shares memory with `stash\[0\]`",
    ),
    "norm_out_over_another_index": (
        lambda: (lambda a, b: mt.unscale_l2norm([a, b], 1.0, flag(), out=[a, a]))(ones(3), ones(3)),
        r"`out\[\d\]` shares memory with `(inputs|out)\[\d\]`",
    ),
    # the flag, which any chunk that sees an inf writes, may share memory with nothing it reads or writes
    "flag_inside_an_in_place_tensor": (
        lambda: (lambda t: mt.scale_([ones(2), t], 2.0, t[:1]))(ones(4)),
        r"`found_inf` shares memory with `(inputs|out)\[1\]`; pass a flag tensor of its own",
    ),
    "flag_over_an_output": (
        lambda: (lambda o: mt.axpby_(1.0, [ones(3)], 1.0, [ones(3)], [o], o[2:].view(torch.int32)))(ones(3)),
        r"`found_inf` shares memory with `out\[0\]`",
    ),
    "flag_over_a_stash": (
        lambda: (lambda s: mt.combine_([ones(2)], [s], [ones(2)], 1.0, s[1:]))(ones(2)),
        r"`found_inf` shares memory with `stash\[0\]`",
    ),
    "flag_over_a_norm_input": (
        lambda: (lambda x: mt.unscale_l2norm([ones(2), x], 1.0, x[3:]))(ones(4)),
        r"`found_inf` shares memory with `inputs\[1\]`",
    ),
}


@pytest.mark.usefixtures("any_mode")
@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_input_names_the_argument(case):
    call, message = BAD_CALLS[case]
    with pytest.raises(RuntimeError, match=message):
        call()


def test_a_single_tensor_is_not_a_list():
    with pytest.raises(TypeError, match="`inputs` must be a list or tuple of tensors"):
        mt.l2norm(torch.ones(3))


def test_a_missing_flag_or_factor_is_named():
    with pytest.raises(TypeError, match="`found_inf` must be a one-element float32 or int32 tensor .* got NoneType"):
        mt.scale_([torch.ones(3)], 2.0, None)
    with pytest.raises(TypeError, match="`factor` must be a real number .* got NoneType"):
        mt.scale_([torch.ones(3)], None, flag())
    with pytest.raises(TypeError, match="`inv_scale` must be a real number .* got complex"):
        mt.unscale_l2norm([torch.ones(3)], 1j, flag())


@pytest.mark.usefixtures("any_mode")
def test_a_sparse_tensor_or_a_complex_or_bool_factor_is_named():
    """A sparse tensor was read as 'an expanded tensor' by the writing ops and failed in the norm with a dispatcher
    dump naming a backend; a complex one-element factor failed in ``float()`` naming no argument, and ``tensor(True)``
    was taken as 1 where ``True`` is refused."""
    sparse = torch.ones(3, 4).to_sparse()
    calls = [
        (r"`inputs\[0\]`", lambda: mt.scale_([sparse], 2.0, flag())),
        (r"`inputs\[0\]`", lambda: mt.l2norm([sparse])),
        (r"`new\[0\]`", lambda: mt.combine_([sparse], None, [torch.ones(3, 4)], 1.0, flag())),
        (r"`stash\[0\]`", lambda: mt.combine_([torch.ones(3, 4)], [sparse], [torch.ones(3, 4)], 1.0, flag())),
        (r"`y\[0\]`", lambda: mt.axpby_(1.0, [torch.ones(3, 4)], 1.0, [sparse], [torch.ones(3, 4)], flag())),
    ]
    for name, call in calls:
        with pytest.raises(TypeError, match=rf"^{name} is a torch.sparse_coo tensor; these ops take dense ones"):
            call()
    for factor in (torch.tensor(2.0 + 0j), torch.tensor(True)):
        with pytest.raises(TypeError, match=rf"`factor` must be a real number .* got a {factor.dtype} tensor"):
            mt.scale_([torch.ones(3)], factor, flag())


@pytest.mark.usefixtures("any_mode")
def test_an_on_off_or_choice_argument_of_the_wrong_type_is_named_in_one_line():
    """``per_tensor="yes"`` or ``arg_to_check="x"`` reached the kernel's schema, a five-line RuntimeError about
    ``ampkit_multi_tensor::l2norm()``, or (the reference, without a compiler) ran as if True."""
    x, y = [torch.ones(3)], [torch.ones(3)]
    with pytest.raises(TypeError, match=r"^`per_tensor` must be True or False, got 'yes'$"):
        mt.l2norm(x, per_tensor="yes")
    with pytest.raises(TypeError, match=r"^`per_tensor` must be True or False, got None$"):
        mt.unscale_l2norm(x, 1.0, flag(), per_tensor=None)
    for bad in ("x", 1.0, True):
        with pytest.raises(TypeError, match=rf"^`arg_to_check` must be -1 .*, got {bad!r}$"):
            mt.axpby_(1.0, x, 1.0, y, [torch.ones(3)], flag(), arg_to_check=bad)
    assert mt.l2norm(x, per_tensor=1).per_tensor is not None  # 0 and 1 stay valid, as in Apex's calls


@pytest.mark.usefixtures("any_mode")
def test_meta_tensors_are_named_even_when_every_tensor_is_on_meta():
    """With every tensor on the meta device (a model not yet materialized) there was no other device to name: each
    op failed with ``Tensor.item() cannot be called on meta tensors``, naming no argument."""
    meta = [torch.ones(3, device="meta")]
    meta_flag = torch.zeros(1, device="meta")
    calls = [
        (r"`inputs\[0\]`", lambda: mt.scale_(meta, 2.0, meta_flag)),
        (r"`x\[0\]`", lambda: mt.axpby_(1.0, meta, 1.0, meta, meta, meta_flag)),
        (r"`new\[0\]`", lambda: mt.combine_(meta, None, meta, 1.0, meta_flag)),
        (r"`inputs\[0\]`", lambda: mt.l2norm(meta, per_tensor=True)),
        (r"`factor`", lambda: mt.scale_([torch.ones(3)], torch.ones(1, device="meta"), flag())),
        (r"`found_inf`", lambda: mt.unscale_l2norm([torch.ones(3)], 1.0, meta_flag)),
    ]
    for name, call in calls:
        with pytest.raises(RuntimeError, match=rf"^{name} is on the meta device, which holds no values; materialize"):
            call()


def test_a_list_of_numbers_is_refused_naming_the_entry():
    with pytest.raises(TypeError, match=r"`inputs\[1\]` must be a tensor, got float"):
        mt.l2norm([torch.ones(3), 2.0])
    with pytest.raises(TypeError, match=r"`out\[0\]` must be a tensor, got NoneType"):
        mt.scale_([torch.ones(3)], 2.0, flag(), out=[None])


@pytest.mark.usefixtures("any_mode")
def test_in_place_and_disjoint_views_of_one_buffer_are_allowed():
    """What the overlap check lets through: the input itself as out, and views that do not intersect (a flat
    gradient buffer split per parameter, as DDP and Apex's flattened masters lay them out)."""
    buffer = torch.arange(1.0, 9.0)
    halves = [buffer[:4], buffer[4:]]
    mt.scale_(halves, 2.0, flag())
    assert torch.equal(buffer, torch.arange(1.0, 9.0) * 2)
    source = torch.arange(1.0, 9.0)
    mt.scale_([source[4:]], 0.5, flag(), out=[source[:4]])  # out reads from the other half
    assert torch.equal(source[:4], torch.arange(5.0, 9.0) * 0.5)
    doubled = [torch.empty(3), torch.empty(3)]
    mt.axpby_(1.0, [source[:3], source[:3]], 1.0, [source[:3], source[:3]], doubled, flag())  # read at two indices
    assert all(torch.equal(d, source[:3] * 2) for d in doubled)


@pytest.mark.usefixtures("any_mode")
def test_params_that_require_grad_are_updated_in_place_outside_autograd():
    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(40_000))]
    expected = [p.detach().double() * 0.5 for p in params]
    mt.scale_(params, 0.5, flag())
    assert_lists_close([p.detach() for p in params], expected, torch.float32)
    assert mt.l2norm(params).total.requires_grad is False


# ---------------------------------------------------------------- CUDA (runs where a GPU exists)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(params=["per_tensor", "multi_tensor"])
def cuda_kernels(request, monkeypatch):
    """The CUDA tests run with both loops AMPKIT_CUDA_KERNELS selects: element at a time (the default) and vector
    loads of aligned chunks (opt-in until these pass on a GPU)."""
    monkeypatch.setenv("AMPKIT_CUDA_KERNELS", request.param)
    return request.param


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_kernels_match_the_reference(dtype, cuda_kernels):
    sizes = [*SIZES, 200_001, *([3] * 80)]  # more tensors than one launch's metadata holds
    xs = randn_list(sizes, dtype)
    ys = randn_list(sizes, dtype)
    put(xs, len(xs) - 1, "last", float("nan"))
    on_gpu = [x.cuda() for x in xs]
    found = torch.zeros(1, device="cuda")
    outs = [torch.empty(x.shape, device="cuda") for x in xs]
    mt.scale_(on_gpu, 0.25, found, out=outs)
    assert found.item() == 1
    assert_lists_close([o.cpu() for o in outs], [x.double() * 0.25 for x in xs], torch.float32)

    mt.axpby_(2.0, on_gpu, -1.0, [y.cuda() for y in ys], outs, found, arg_to_check=1)
    expected = [2 * x.double() - y.double() for x, y in zip(xs, ys, strict=True)]
    assert_lists_close([o.cpu() for o in outs], expected, torch.float32)

    stash = [y.float().cuda() if i % 2 else None for i, y in enumerate(ys)]
    combined = [torch.empty(x.shape, device="cuda") for x in xs]
    mt.combine_(on_gpu, stash, combined, 0.5, found)
    expected = [x.double() * 0.5 + (y.double() if i % 2 else 0) for i, (x, y) in enumerate(zip(xs, ys, strict=True))]
    assert_lists_close([c.cpu() for c in combined], expected, torch.float32)

    clean = [y.cuda() for y in ys]
    flag_gpu = torch.zeros(1, dtype=torch.int32, device="cuda")
    total, per = mt.unscale_l2norm(clean, 0.5, flag_gpu, per_tensor=True)
    ref_total, ref_per = ref.l2norm([y.double() * 0.5 for y in ys], True)
    torch.testing.assert_close(total.cpu().double(), ref_total, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(per.cpu().double(), ref_per, rtol=1e-5, atol=1e-6)
    assert flag_gpu.item() == 0


@needs_cuda
def test_cuda_tensor_split_across_launches(cuda_kernels):
    """A tensor with more chunks than one launch holds (320 x 65536 elements) continues in the next."""
    x = torch.randn(330 * 65536 + 5)
    found = torch.zeros(1, device="cuda")
    on_gpu = [torch.randn(7, device="cuda"), x.cuda()]
    total, per = mt.unscale_l2norm(on_gpu, 2.0, found, out=on_gpu, per_tensor=True)
    torch.testing.assert_close(on_gpu[1].cpu(), x * 2.0)
    torch.testing.assert_close(per[1].cpu().double(), (x.double() * 2).norm(), rtol=1e-5, atol=0)
    assert found.item() == 0


def one_element_off(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values stored one element past an aligned address (a storage_offset view): no vector loads."""
    view = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
    return view.copy_(t)


@needs_cuda
@pytest.mark.parametrize("layout", ["aligned", "offset_views", "noncontiguous"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_vector_loads_equal_the_element_loop(dtype, layout, monkeypatch):
    """Same results and flags with AMPKIT_CUDA_KERNELS=multi_tensor as with the default, for odd sizes (a scalar
    tail), misaligned views (the scalar fallback) and non-contiguous inputs, with a nan in the last tensor."""
    sizes = [*SIZES, 200_001, *([3] * 80)]
    xs = randn_list(sizes, dtype, noncontiguous=layout == "noncontiguous")
    ys = randn_list(sizes, dtype)
    put(xs, len(xs) - 1, "last", float("nan"))
    results = {}
    for choice in ("per_tensor", "multi_tensor"):
        monkeypatch.setenv("AMPKIT_CUDA_KERNELS", choice)
        on_gpu = [x.cuda() for x in xs]
        if layout == "offset_views":
            on_gpu = [one_element_off(x) for x in on_gpu]
        found = torch.zeros(1, device="cuda")
        scaled = [torch.empty(x.shape, device="cuda") for x in xs]
        mt.scale_(on_gpu, 0.25, found, out=scaled)
        summed = [one_element_off(torch.empty(x.shape, device="cuda", dtype=dtype)) for x in xs]
        mt.axpby_(2.0, on_gpu, -1.0, [y.cuda() for y in ys], summed, found, arg_to_check=1)
        stash = [y.float().cuda() if i % 2 else None for i, y in enumerate(ys)]
        combined = [torch.empty(x.shape, device="cuda") for x in xs]
        mt.combine_(on_gpu, stash, combined, 0.5, found)
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        unscaled = [torch.empty(x.shape, device="cuda") for x in xs]
        total, per = mt.unscale_l2norm(on_gpu, 0.5, flag, out=unscaled, per_tensor=True)
        results[choice] = [*scaled, *summed, *combined, *unscaled, found, flag]
        results[choice] = [t.cpu() for t in results[choice]] + [total.cpu(), per.cpu()]
    element, vector = results["per_tensor"], results["multi_tensor"]
    for i, (a, b) in enumerate(zip(element[:-2], vector[:-2], strict=True)):
        assert torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a.nan_to_num(), b.nan_to_num()), i
    assert element[-4].item() == 1 and element[-3].item() == 1  # found and flag: the nan was seen
    # the norms sum per-thread partials in another order: equal to float32 rounding
    torch.testing.assert_close(vector[-1], element[-1], rtol=1e-6, atol=0, equal_nan=True)


@needs_cuda
def test_cuda_unscale_l2norm_writes_out_when_the_first_tensor_is_empty(cuda_kernels):
    """Whether outputs are written is the caller's word, not read off the first tensor (an empty one has no address)."""
    xs = [torch.randn(0, device="cuda"), torch.randn(1001, device="cuda")]
    out = [torch.zeros(0, device="cuda"), torch.zeros(1001, device="cuda")]
    found = torch.zeros(1, device="cuda")
    total, _ = mt.unscale_l2norm(xs, 0.5, found, out=out)
    torch.testing.assert_close(out[1], xs[1] * 0.5)
    torch.testing.assert_close(total, (xs[1] * 0.5).norm(), rtol=1e-6, atol=0)


@pytest.mark.usefixtures("any_mode")
@pytest.mark.parametrize("factor", [math.inf, -math.inf, math.nan, 1e300], ids=["inf", "-inf", "nan", "past_float32"])
def test_a_factor_that_is_not_finite_raises_the_flag(factor):
    """The kernels check their inputs: unscaling finite gradients by ``1 / 0`` or NaN gave inf or NaN outputs with the
    flag down, so a caller skipping on it stepped on them. A factor past float32's range is inf in the kernels."""
    ops = {
        "scale_": lambda x, f: mt.scale_(x, factor, f),
        "axpby_a": lambda x, f: mt.axpby_(factor, x, 1.0, [torch.ones(3)], [torch.empty(3)], f),
        "axpby_b": lambda x, f: mt.axpby_(1.0, x, factor, [torch.ones(3)], [torch.empty(3)], f),
        "combine_": lambda x, f: mt.combine_(x, None, [torch.empty(3)], factor, f),
        "unscale_l2norm": lambda x, f: mt.unscale_l2norm(x, factor, f),
    }
    for name, op in ops.items():
        found = flag()
        op([torch.ones(3)], found)
        assert found.item() == 1, name
    found = flag()
    mt.scale_([torch.ones(0)], factor, found)  # nothing scaled, nothing non-finite
    assert found.item() == 0
