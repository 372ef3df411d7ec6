"""Combined unscaling: per-loss inf flags, exact accumulation, flat buffers equal the per-tensor path."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ampkit.amp.grad_combine import GradientCombiner, read_flags
from ampkit.amp.scaler import LossScaler

DTYPES = [torch.float16, torch.bfloat16]


def make_params(dtype, shapes=((3, 4), (5,), (2, 2))):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def backward_with(params, grads, scale):
    """A backward whose gradient for each param is exactly ``grads[i] * scale`` (None: not reached)."""
    loss = sum((p * (g.to(p.dtype) * scale)).sum() for p, g in zip(params, grads, strict=True) if g is not None)
    loss.backward()


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_inf_in_loss_a_does_not_flag_loss_b(dtype, flat):
    params = make_params(dtype)
    combiner = GradientCombiner(params, flat=flat)
    scaler_a, scaler_b = LossScaler(init_scale=4.0), LossScaler(init_scale=8.0)
    ones = [torch.ones(p.shape) for p in params]
    bad = [g.clone() for g in ones]
    bad[1][2] = float("inf")

    combiner.prepare_backward()
    backward_with(params, bad, scaler_a.scale)
    result_a = combiner.combine(scaler_a)
    combiner.prepare_backward()
    backward_with(params, ones, scaler_b.scale)
    result_b = combiner.combine(scaler_b)

    assert read_flags([result_a.found_inf, result_b.found_inf]) == [True, False]
    assert scaler_a.update(result_a.found_inf) == (4.0, 2.0)
    assert scaler_b.update(result_b.found_inf) == (8.0, 8.0)
    assert torch.isinf(params[1].grad[2])  # the optimizer still sees loss A's overflow
    assert len(result_a.reached) == len(result_b.reached) == 3


def exact_grads(shapes, gen):
    # small integers times powers of two: every partial sum is exact in fp16, bf16 and fp32
    grads = []
    for shape in shapes:
        exponent = torch.randint(-3, 2, (), generator=gen).item()
        grads.append(torch.randint(-8, 9, shape, generator=gen).float() * 2.0**exponent)
    return grads


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("masters", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulation_over_backwards_equals_fp32_sum(dtype, masters, flat):
    shapes = [(3, 4), (5,), (2, 2)]
    params = make_params(dtype, shapes)
    owners = [p.detach().float().requires_grad_() for p in params] if masters else None
    combiner = GradientCombiner(params, owners, flat=flat)
    gen = torch.Generator().manual_seed(1)
    expected = [torch.zeros(s) for s in shapes]
    for scale in [2.0**10, 2.0**3, 1.0, 2.0**7]:
        grads = exact_grads(shapes, gen)
        grads[2] = None if scale == 2.0**3 else grads[2]
        combiner.prepare_backward()
        backward_with(params, grads, scale)
        result = combiner.combine(LossScaler(init_scale=scale))
        assert not read_flags([result.found_inf])[0]
        assert len(result.reached) == (2 if grads[2] is None else 3)
        for e, g in zip(expected, grads, strict=True):
            if g is not None:
                e += g
    holders = owners if masters else params
    for holder, e in zip(holders, expected, strict=True):
        assert holder.grad.dtype == (torch.float32 if masters else dtype)
        torch.testing.assert_close(holder.grad.float(), e, rtol=0, atol=0)
    if masters:
        assert all(p.grad is None or not p.grad.any() for p in params)


def run_sequence(dtype, masters, flat, plan, seed=3):
    """Replay a plan of (scale, inf position or None, reached mask) backwards; return the final grads."""
    shapes = [(7,), (3, 5), (1,), (4, 1)]
    params = make_params(dtype, shapes)
    owners = [p.detach().float().requires_grad_() for p in params] if masters else None
    combiner = GradientCombiner(params, owners, flat=flat)
    gen = torch.Generator().manual_seed(seed)
    flags, reached = [], []
    for scale, inf_at, mask in plan:
        grads = [torch.randn(s, generator=gen) if m else None for s, m in zip(shapes, mask, strict=True)]
        if inf_at is not None and grads[inf_at % len(shapes)] is not None:
            grads[inf_at % len(shapes)].view(-1)[-1] = float("nan") if inf_at % 2 else float("inf")
        combiner.prepare_backward()
        if any(mask):
            backward_with(params, grads, scale)
        result = combiner.combine(scale)
        flags.append(result.found_inf)
        reached.append(tuple(id(p) for p in result.reached))
    holders = owners if masters else params
    return [h.grad for h in holders], read_flags(flags), [len(r) for r in reached], combiner


@settings(max_examples=15, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    masters=st.booleans(),
    plan=st.lists(
        st.tuples(
            st.sampled_from([1.0, 2.0**-2, 2.0**5, 2.0**12]),
            st.one_of(st.none(), st.integers(0, 7)),
            st.lists(st.booleans(), min_size=4, max_size=4),
        ),
        min_size=1,
        max_size=4,
    ),
)
def test_flat_buffers_match_per_tensor_path(dtype, masters, plan):
    per_tensor = run_sequence(dtype, masters, False, plan)
    flat = run_sequence(dtype, masters, True, plan)
    assert per_tensor[1] == flat[1] and per_tensor[2] == flat[2]
    for a, b in zip(per_tensor[0], flat[0], strict=True):
        if a is None:  # never reached: both paths leave .grad None so optimizers skip the param
            assert b is None
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("masters", [False, True])
def test_flat_grads_are_views_of_one_buffer_per_dtype(masters):
    params = make_params(torch.float16) + make_params(torch.bfloat16) + make_params(torch.float32)
    owners = [p.detach().float().requires_grad_() if p.dtype != torch.float32 else p for p in params]
    combiner = GradientCombiner(params, owners if masters else None, flat=True)
    holders = owners if masters else params
    buffers = combiner.flat_buffers()
    assert len(buffers) == 3
    assert all(h.grad is None for h in holders)  # no grad yet: the buffers are not handed out early
    combiner.prepare_backward()
    backward_with(params, [torch.ones(p.shape) for p in params], 2.0)
    combiner.combine(2.0)
    for buffer in buffers:
        ptr = buffer.untyped_storage().data_ptr()
        members = [h for h in holders if h.grad.untyped_storage().data_ptr() == ptr]
        assert len(members) == 3 and all(h.grad.dtype == buffer.dtype for h in members)
    assert sum(b.sum().item() for b in buffers) == sum(p.numel() for p in params)
    combiner.zero_grad()
    assert all(not b.any() for b in buffers) and all(h.grad is None for h in holders)
    combiner.prepare_backward()
    backward_with(params, [torch.ones(p.shape) for p in params[:4]] + [None] * 5, 2.0)
    result = combiner.combine(2.0)
    assert result.reached == tuple(params[:4])
    assert [h.grad is None for h in holders] == [False] * 4 + [True] * 5
    ptrs = {b.untyped_storage().data_ptr() for b in buffers}
    assert all(h.grad.untyped_storage().data_ptr() in ptrs for h in holders[:4])


@pytest.mark.parametrize("flat", [False, True])
def test_zero_grad_set_to_none_between_iterations(flat):
    params = make_params(torch.float32)
    opt = torch.optim.SGD(params, lr=1.0)
    combiner = GradientCombiner(params, flat=flat)
    for it in range(2):
        opt.zero_grad(set_to_none=True)
        combiner.prepare_backward()
        backward_with(params, [torch.full(p.shape, 4.0) for p in params], 4.0)
        result = combiner.combine(4.0)
        assert len(result.reached) == 3
        assert all(torch.equal(p.grad, torch.full(p.shape, 4.0)) for p in params), it


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("masters", [False, True])
def test_zero_grad_in_place_keeps_the_tensors_and_the_next_backward_exact(flat, masters):
    """``zero_grad(False)`` is ``Optimizer.zero_grad(set_to_none=False)``: each gradient zeroed in place (a None stays
    None), and the next backward's gradient arrives as if there had been none."""
    params = make_params(torch.float16)
    owners = [p.detach().float().requires_grad_() for p in params] if masters else None
    combiner = GradientCombiner(params, owners, flat=flat)
    holders = owners if masters else params
    combiner.prepare_backward()
    backward_with(params, [torch.ones(p.shape) for p in params[:2]] + [None], 2.0)
    combiner.combine(2.0)
    held = [h.grad for h in holders]
    combiner.zero_grad(False)
    assert [h.grad is g for h, g in zip(holders, held, strict=True)] == [True, True, True]
    assert held[2] is None and all(not g.any() for g in held[:2])
    combiner.prepare_backward()
    backward_with(params, [torch.full(p.shape, 3.0) for p in params], 2.0)
    combiner.combine(2.0)
    assert all(torch.equal(h.grad, torch.full_like(h, 3.0)) for h in holders)
    if masters:  # Apex's O2: the model's gradients zeroed, the masters' dropped
        combiner.zero_grad(False, owners_to_none=True)
        assert all(h.grad is None for h in holders)
        assert all(p.grad is None or not p.grad.any() for p in params)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("masters", [False, True])
def test_zero_grad_keeping_the_pending_backward_drops_the_stash_and_combines_what_comes_after(flat, masters):
    """``keep_pending=True`` between prepare and combine (Apex's zero_grad inside scale_loss): the stash and the
    gradients so far are gone, and the combine unscales only a backward that came after the zero_grad."""
    params = make_params(torch.float16)
    owners = [p.detach().float().requires_grad_() for p in params] if masters else None
    combiner = GradientCombiner(params, owners, flat=flat)
    holders = owners if masters else params
    combiner.prepare_backward()
    backward_with(params, [torch.ones(p.shape) for p in params], 2.0)
    combiner.combine(2.0)  # a stash for the next backward
    combiner.prepare_backward()
    backward_with(params, [torch.full(p.shape, 5.0) for p in params], 2.0)
    combiner.zero_grad(keep_pending=True)
    assert combiner.pending
    backward_with(params, [torch.full(p.shape, 3.0) for p in params[:2]] + [None], 2.0)
    result = combiner.combine(2.0)
    assert not read_flags([result.found_inf])[0]
    assert all(torch.equal(h.grad, torch.full_like(h, 3.0)) for h in holders[:2])
    assert holders[2].grad is None or not holders[2].grad.any()
    combiner.zero_grad(keep_pending=True)  # nothing pending: nothing kept
    assert not combiner.pending


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("masters", [False, True])
def test_drop_pending_gives_back_the_gradients_from_before_the_backward(flat, masters):
    """``drop_pending`` (a backward that cannot be unscaled): the gradients it produced are gone, those from before it
    are back unscaled, a holder that had none has none, nothing is pending, and the next backward combines as usual."""
    params = make_params(torch.float16)
    owners = [p.detach().float().requires_grad_() for p in params] if masters else None
    combiner = GradientCombiner(params, owners, flat=flat)
    holders = owners if masters else params
    combiner.prepare_backward()
    backward_with(params, [torch.ones(p.shape) for p in params[:2]] + [None], 2.0)
    combiner.combine(2.0)
    combiner.prepare_backward()
    backward_with(params, [torch.full(p.shape, 5.0) for p in params], 2.0)
    combiner.drop_pending()
    assert not combiner.pending
    assert all(torch.equal(h.grad, torch.ones_like(h)) for h in holders[:2]) and holders[2].grad is None
    if masters:  # the model's own gradients, of the dropped backward, are gone too
        assert all(p.grad is None or not p.grad.any() for p in params)
    combiner.drop_pending()  # nothing pending: a no-op
    combiner.prepare_backward()
    backward_with(params, [torch.full(p.shape, 3.0) for p in params], 2.0)
    combiner.combine(2.0)
    assert all(torch.equal(h.grad, torch.full_like(h, 4.0)) for h in holders[:2])
    assert torch.equal(holders[2].grad, torch.full_like(holders[2], 3.0))


@pytest.mark.parametrize("masters", [False, True])
def test_take_stash_hands_over_what_was_there_before_the_backward_and_leaves_the_new_gradients(masters):
    """``take_stash`` (a script's own unscale runs the post-backward): per param, the gradient from before the backward
    (None where there was none, or where a master owns it: the master's ``.grad`` is its stash), each ``.grad`` left
    with the backward's new, still scaled gradient, nothing pending; refused with nothing pending or flat buffers."""
    params = make_params(torch.float16)
    owners = [p.detach().float().requires_grad_() for p in params] if masters else None
    combiner = GradientCombiner(params, owners)
    with pytest.raises(RuntimeError, match=r"take_stash\(\) called without prepare_backward\(\)"):
        combiner.take_stash()
    combiner.prepare_backward()
    backward_with(params, [torch.ones(p.shape) for p in params[:2]] + [None], 2.0)
    combiner.combine(2.0)
    combiner.prepare_backward()
    backward_with(params, [torch.full(p.shape, 3.0) for p in params], 2.0)
    stash = combiner.take_stash()
    assert not combiner.pending
    assert all(torch.equal(p.grad, torch.full_like(p, 6.0)) for p in params)  # new and scaled
    if masters:
        assert stash == [None] * 3
        assert all(torch.equal(o.grad, torch.ones_like(o)) for o in owners[:2]) and owners[2].grad is None
    else:
        assert all(torch.equal(s, torch.ones_like(s)) for s in stash[:2]) and stash[2] is None
    flat = GradientCombiner(make_params(torch.float32), flat=True)
    flat.prepare_backward()
    with pytest.raises(RuntimeError, match=r"flat gradient buffers \(combine_grad=True\) are unscaled by combine"):
        flat.take_stash()


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("scale", [0.0, -2.0, math.inf, math.nan])
def test_a_scale_that_is_not_finite_and_positive_is_named_and_loses_nothing(flat, scale):
    """A scale of 0 raised ZeroDivisionError halfway through combine(), after the stashed gradients (an earlier
    backward's) had been let go; NaN or inf unscaled every gradient to NaN or 0."""
    params = make_params(torch.float32)
    combiner = GradientCombiner(params, flat=flat)
    combiner.prepare_backward()
    backward_with(params, [torch.ones(p.shape) for p in params], 2.0)
    combiner.combine(2.0)
    combiner.prepare_backward()
    backward_with(params, [torch.full(p.shape, 3.0) for p in params], 4.0)
    with pytest.raises(ValueError, match=rf"scale={scale}: expected a finite number > 0"):
        combiner.combine(scale)
    combiner.combine(4.0)  # the same backward, combined with its own scale: nothing was lost
    assert all(torch.equal(p.grad, torch.full(p.shape, 4.0)) for p in params)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_flat_path_survives_create_graph_backward():
    params = make_params(torch.float32)
    combiner = GradientCombiner(params, flat=True)
    combiner.prepare_backward()
    backward_with(params, [torch.ones(p.shape) for p in params], 1.0)
    combiner.combine(1.0)
    combiner.prepare_backward()
    loss = sum((p * p).sum() for p in params[:1])
    loss.backward(create_graph=True)
    result = combiner.combine(2.0)
    assert result.reached == (params[0],)
    expected = torch.ones(params[0].shape) + params[0].detach()
    torch.testing.assert_close(params[0].grad, expected)
    buffer = combiner.flat_buffers()[0]
    assert params[0].grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_state_errors():
    params = make_params(torch.float32)
    combiner = GradientCombiner(params)
    with pytest.raises(RuntimeError, match="without prepare_backward"):
        combiner.combine(1.0)
    combiner.prepare_backward()
    assert combiner.pending
    with pytest.raises(RuntimeError, match="prepare_backward\\(\\) called twice"):
        combiner.prepare_backward()
    with pytest.raises(ValueError, match="grad_owners has 1 tensors but params has 3"):
        GradientCombiner(params, params[:1])
    with pytest.raises(ValueError, match="grad_owners\\[0\\] has shape \\(4,\\)"):
        GradientCombiner(params[:1], [torch.zeros(4)])
    with pytest.raises(ValueError, match="params\\[0\\] does not require grad; flat buffers"):
        GradientCombiner([torch.zeros(2)], flat=True)
    GradientCombiner([torch.zeros(2)])  # unflat, a frozen parameter waits: it has no gradient until unfrozen


@pytest.mark.parametrize("flat", [False, True])
def test_a_parameter_listed_twice_is_refused_not_unscaled_twice(flat):
    """Unflat, the second listing unscaled the one gradient again: 3.0 came out as 3/scale, silently."""
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match=r"params\[0\] and params\[2\] are one tensor \(shape \(2,\)\): its gradient"):
        GradientCombiner([p, torch.nn.Parameter(torch.ones(3)), p], flat=flat)
    combiner, scaler = GradientCombiner([p], flat=flat), LossScaler(init_scale=4.0)
    combiner.prepare_backward()
    scaler.scale_loss((p * 3).sum()).backward()
    combiner.combine(scaler)
    assert p.grad.tolist() == [3.0, 3.0]


def test_a_switch_that_is_no_bool_is_named():
    """flat="False" (truthy) built flat buffers no one asked for."""
    for option in ("flat", "keep_param_grads"):
        with pytest.raises(ValueError, match=f"GradientCombiner: {option} must be True or False, got 'False'"):
            GradientCombiner([torch.nn.Parameter(torch.ones(2))], **{option: "False"})


def test_unreached_optimizer_gets_no_grads_and_no_flag():
    params = make_params(torch.float32)
    combiner = GradientCombiner(params)
    combiner.prepare_backward()
    result = combiner.combine(LossScaler())
    assert result.reached == () and read_flags([result.found_inf]) == [False]
    assert all(p.grad is None for p in params)


def test_cpu_unscale_runs_ampkit_kernel_with_torchs_bits(monkeypatch):
    """The engine's unscale of a large list on CPU is ampkit's multi-tensor kernel, bit-identical to torch's op;
    a small list (one step of a small model) goes to torch's op, whose dispatch is cheaper."""
    from ampkit.amp.grad_combine import KERNEL_MIN_NUMEL, unscale_and_check_
    from ampkit.ops import multi_tensor

    monkeypatch.setenv("AMPKIT_OPS", "kernel")  # a failed build fails the test instead of falling back
    sizes = (1, 7, KERNEL_MIN_NUMEL)
    grads = [torch.randn(n) * 2.0**12 for n in sizes] + [torch.randn(13).half(), torch.randn(5).bfloat16()]
    grads[2][40000] = math.inf
    inv_scale = torch.full((1,), 2.0**-12)
    expected, torch_found = [g.clone() for g in grads], torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_(expected, torch_found, inv_scale)
    calls = []
    real_scale = multi_tensor.scale_
    monkeypatch.setattr(multi_tensor, "scale_", lambda *a, **k: calls.append(1) or real_scale(*a, **k))
    found = torch.zeros(1)
    unscale_and_check_(grads, found, inv_scale)
    assert calls and found.item() == torch_found.item() == 1.0
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    small = [torch.randn(1000)]
    unscale_and_check_(small, torch.zeros(1), inv_scale)
    assert len(calls) == 1


@pytest.mark.parametrize("keep", [False, True])
def test_params_with_masters_keep_their_scaled_grads_only_when_asked(keep):
    """Apex's amp left each fp16 param its scaled gradient until the next backward; the masters sum unscaled."""
    params = make_params(torch.float16)
    masters = [p.detach().float().requires_grad_() for p in params]
    combiner = GradientCombiner(params, masters, keep_param_grads=keep)
    gen = torch.Generator().manual_seed(1)
    first, second = exact_grads([p.shape for p in params], gen), exact_grads([p.shape for p in params], gen)
    for grads in (first, second):
        combiner.prepare_backward()
        backward_with(params, grads, 8.0)
        combiner.combine(8.0)
        if keep:
            assert all(torch.equal(p.grad.float(), g * 8.0) for p, g in zip(params, grads, strict=True))
        else:
            assert all(p.grad is None for p in params)
    assert all(torch.equal(m.grad, a + b) for m, a, b in zip(masters, first, second, strict=True))


class _SparseLookup(torch.nn.Module):
    """An ``Embedding(sparse=True)`` and a dense head: the embedding's gradient is sparse, with repeated rows."""

    def __init__(self, dtype: torch.dtype, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(6, 3, sparse=sparse).to(dtype)
        self.head = torch.nn.Linear(3, 1).to(dtype)

    def loss(self, ids: torch.Tensor, scale: float) -> torch.Tensor:
        return self.head(self.emb(ids)).float().pow(2).sum() * scale


@pytest.mark.parametrize("masters", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse_gradients_are_unscaled_checked_and_accumulated_as_dense_ones(dtype, masters):
    """Two backwards into an ``Embedding(sparse=True)`` (ids repeated): the combined gradient equals the dense
    embedding's, with fp32 masters too; an inf among the sparse values is flagged. torch's unscale op takes no
    sparse tensor, so combine() raised NotImplementedError (Apex's O1/O2 and the Trainer reached it)."""
    results = {}
    for sparse in (False, True):
        model = _SparseLookup(dtype, sparse)
        params = list(model.parameters())
        owners = [p.detach().float().requires_grad_() for p in params] if masters else None
        combiner = GradientCombiner(params, owners)
        for ids, scale in ((torch.tensor([1, 4, 1]), 1024.0), (torch.tensor([4, 2, 2, 2]), 256.0)):
            combiner.prepare_backward()
            model.loss(ids, scale).backward()
            result = combiner.combine(scale)
            assert read_flags([result.found_inf]) == [False]
        grads = [(o if masters else p).grad for p, o in zip(params, owners or params, strict=True)]
        assert grads[0].is_sparse == sparse
        results[sparse] = [g.to_dense() if g.is_sparse else g for g in grads]
    for with_sparse, with_dense in zip(results[True], results[False], strict=True):
        torch.testing.assert_close(with_sparse, with_dense, rtol=1e-3 if dtype == torch.float16 else 0, atol=0)

    model = _SparseLookup(dtype, sparse=True)
    combiner = GradientCombiner(list(model.parameters()))
    combiner.prepare_backward()
    model.loss(torch.tensor([0]), 1.0).backward()
    model.emb.weight.grad._values()[0, 0] = float("inf")
    assert read_flags([combiner.combine(1.0).found_inf]) == [True]
