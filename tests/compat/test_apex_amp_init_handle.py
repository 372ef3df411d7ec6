"""Apex's original API, ``handle = amp.init(...)``, and the O1 cast table it installs (on CPU).

Expectations follow Apex's tests/L0/run_amp (test_basic_casts, test_promotion, test_cache, test_rnn)
with CUDA type strings read as dtypes: Apex's behaviour is the spec of the compat layer.
"""

import functools
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampkit.compat import amp

LOW = [torch.float16, torch.bfloat16]


@pytest.fixture(params=LOW, ids=["fp16", "bf16"])
def handle(request):
    h = amp.init(enabled=True, patch_type=request.param)
    yield h
    h._deactivate()


def _check(fn, expected: dict, shape, backward=True):
    """``fn`` on a fresh input of each dtype in ``expected`` returns that dtype; the grad keeps the input's."""
    for dtype, out_dtype in expected.items():
        x = torch.randn(shape, dtype=dtype).requires_grad_()
        y = fn(x)
        assert y.dtype == out_dtype, (fn, dtype)
        if backward:
            y.float().sum().backward()
            assert x.grad.dtype == dtype


def test_whitelist_ops_run_in_the_patch_type_for_float_and_low_inputs(handle):
    low = handle.dtype
    always_low = {torch.float32: low, low: low}
    linear = nn.Linear(8, 8)
    _check(linear, always_low, (4, 8))
    _check(functools.partial(F.linear, weight=linear.weight, bias=linear.bias), always_low, (4, 8))
    conv = nn.Conv2d(3, 3, 3)
    _check(conv, always_low, (2, 3, 6, 6))
    other = torch.randn(8, 8)
    _check(lambda x: x.matmul(other), always_low, (8, 8))
    _check(lambda x: other @ x, always_low, (8, 8))
    _check(lambda x: torch.mm(x, other), always_low, (8, 8))


def test_blacklist_ops_run_in_float32(handle):
    always_float = {torch.float32: torch.float32, handle.dtype: torch.float32}
    _check(nn.Softmax(dim=1), always_float, (4, 8))
    _check(functools.partial(F.log_softmax, dim=1), always_float, (4, 8))
    _check(nn.GroupNorm(2, 4), always_float, (2, 4, 3, 3))
    target = torch.randn(4, 8)
    _check(lambda x: F.mse_loss(x, target), always_float, (4, 8))
    _check(lambda x: x.pow(2.0), always_float, (4, 8))
    _check(lambda x: x**2.0, always_float, (4, 8))
    _check(lambda x: x.sum(), always_float, (4, 8))
    _check(lambda x: torch.exp(x), always_float, (4, 8))
    grid = torch.rand(1, 3, 3, 2) * 2 - 1  # float32, as a spatial transformer's usually is
    _check(lambda x: F.grid_sample(x, grid, align_corners=False), always_float, (1, 2, 4, 4))


def test_cpu_leaves_a_tensor_already_on_the_cpu_as_it_is(handle):
    """Apex casts to float32 only a tensor about to leave the GPU: one already on the CPU comes back as the same
    object, so in-place edits reach it and a half model's ``.cpu()`` keeps it half."""
    x = torch.randn(4, 8, dtype=handle.dtype)
    assert x.cpu() is x
    model = nn.Linear(2, 2).to(handle.dtype).cpu()
    assert model.weight.dtype == handle.dtype


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a tensor leaving the GPU")
def test_cpu_of_a_gpu_tensor_arrives_in_float32(handle):
    for dtype in (torch.float32, handle.dtype):
        x = torch.randn(4, 8, dtype=dtype, device="cuda", requires_grad=True)
        y = x.cpu()
        assert y.dtype == torch.float32 and y.device.type == "cpu"
        y.sum().backward()
        assert x.grad.dtype == dtype


def test_match_ops_keep_the_input_type(handle):
    match = {torch.float32: torch.float32, handle.dtype: handle.dtype}
    _check(F.relu, match, (4, 8))
    _check(nn.ReLU(), match, (4, 8))
    bn = nn.BatchNorm2d(3)
    _check(bn, match, (2, 3, 4, 4))
    bn.eval()
    _check(bn, match, (2, 3, 4, 4), backward=False)


@pytest.mark.parametrize(
    "fn",
    [torch.atan2, torch.mul, torch.add, lambda x, y: x.mul(y), lambda x, y: x + y, lambda x, y: y * x],
)
def test_binary_ops_promote_to_the_widest_type(handle, fn):
    low = handle.dtype
    for xtype in (low, torch.float32):
        for ytype in (low, torch.float32):
            x = torch.randn(5, dtype=xtype).requires_grad_()
            out = fn(x, torch.randn(5, dtype=ytype))
            assert out.dtype == (torch.float32 if torch.float32 in (xtype, ytype) else low)
            out.float().sum().backward()
            assert x.grad.dtype == xtype


def test_inplace_ops_keep_self_type_and_inplace_blacklist_refuses_low_precision(handle):
    low = handle.dtype
    for xtype in (low, torch.float32):
        for ytype in (low, torch.float32):
            leaf = torch.randn(5, dtype=xtype).requires_grad_()
            x = leaf.clone()
            assert x.add_(torch.randn(5, dtype=ytype)).dtype == xtype
            x.float().sum().backward()
            assert leaf.grad.dtype == xtype
    xs = torch.randn(5)
    xs.exp_()
    assert xs.dtype == torch.float32
    with pytest.raises(NotImplementedError, match="exp_"):
        torch.randn(5, dtype=low).exp_()


def test_cat_and_stack_match_the_widest(handle):
    low = handle.dtype
    ys = [torch.randn(4, dtype=low) for _ in range(3)]
    assert torch.cat([*ys, torch.randn(4)]).dtype == torch.float32
    assert torch.cat([*ys, torch.randn(4, dtype=low)]).dtype == low
    assert torch.stack([torch.randn(4), *ys]).dtype == torch.float32


def test_binary_cross_entropy_on_low_precision_is_refused_unless_allowed():
    target = torch.rand(4, 8)
    handle = amp.init(patch_type=torch.float16)
    for fn in (nn.BCELoss(), F.binary_cross_entropy):
        with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss") as info:
            fn(torch.rand(4, 8, dtype=torch.float16), target)
        assert "allow_banned=True" in str(info.value)
    assert F.binary_cross_entropy(torch.rand(4, 8), target).dtype == torch.float32  # float inputs are fine
    handle._deactivate()
    handle = amp.init(patch_type=torch.bfloat16, allow_banned=True)
    assert nn.BCELoss()(torch.rand(4, 8, dtype=torch.bfloat16), target).dtype == torch.float32
    handle._deactivate()


@pytest.mark.parametrize("cell, state_tuple", [(nn.RNNCell, False), (nn.GRUCell, False), (nn.LSTMCell, True)])
def test_rnn_cells_run_in_low_precision(handle, cell, state_tuple):
    rnn = cell(6, 6)
    for dtype in (torch.float32, handle.dtype):
        xs = [torch.randn(3, 6, dtype=dtype).requires_grad_() for _ in range(4)]
        hidden = torch.zeros(3, 6, dtype=dtype)
        hidden = (hidden, hidden.clone()) if state_tuple else hidden
        for x in xs:
            hidden = rnn(x, hidden)
            assert (hidden[0] if state_tuple else hidden).dtype == handle.dtype
        (hidden[0] if state_tuple else hidden).float().sum().backward()
        assert all(x.grad.dtype == dtype for x in xs)
        assert rnn.weight_ih.grad.dtype == torch.float32


def _casts_of(weight: torch.Tensor, output: torch.Tensor) -> int:
    """How many nodes of ``output``'s graph read ``weight`` directly (each a cast of it)."""
    seen, count, stack = set(), 0, [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            count += type(child).__name__ == "AccumulateGrad" and child.variable is weight
            stack.append(child)
    return count


def test_a_cell_unrolled_over_a_sequence_casts_its_weights_once(handle):
    """Apex cached the low-precision casts of a cell's weights: 20 steps of an LSTMCell hold one copy of each
    weight in the graph, not 20, and the gradient is the same as without the cache."""
    cell = nn.LSTMCell(8, 8)
    xs = [torch.randn(3, 8) for _ in range(20)]

    def unroll() -> torch.Tensor:
        hidden = (torch.zeros(3, 8), torch.zeros(3, 8))
        for x in xs:
            hidden = cell(x, hidden)
        return hidden[0]

    output = unroll()
    assert _casts_of(cell.weight_ih, output) == 1 and _casts_of(cell.bias_hh, output) == 1
    output.float().sum().backward()
    cached_grad, cell.weight_ih.grad = cell.weight_ih.grad, None
    weights = [w.to(handle.dtype) for w in (cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)]
    hidden = (torch.zeros(3, 8, dtype=handle.dtype), torch.zeros(3, 8, dtype=handle.dtype))
    with amp.disable_casts():  # the reference: the same casts made by hand
        for x in xs:
            hidden = torch.lstm_cell(x.to(handle.dtype), hidden, *weights)
        hidden[0].float().sum().backward()
    torch.testing.assert_close(cached_grad, cell.weight_ih.grad)


@pytest.mark.parametrize("module", [nn.RNN, nn.GRU, nn.LSTM])
def test_rnns_run_in_low_precision(handle, module):
    rnn = module(input_size=6, hidden_size=6, num_layers=2, bidirectional=True)
    for dtype in (torch.float32, handle.dtype):
        x = torch.randn(5, 3, 6, dtype=dtype).requires_grad_()
        output, _ = rnn(x)
        assert output.dtype == handle.dtype
        output[-1].float().sum().backward()
        assert x.grad.dtype == dtype
    lengths = torch.tensor([5, 4, 2])
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(5, 3, 6), lengths)
    output, _ = rnn(packed)
    assert output.data.dtype == handle.dtype


def test_deactivate_restores_every_patched_function():
    names = [(torch, "mm"), (torch, "cat"), (F, "linear"), (F, "binary_cross_entropy"), (torch.Tensor, "sum")]
    names += [(torch.Tensor, "__add__"), (torch.Tensor, "__matmul__"), (torch.Tensor, "cpu"), (torch.Tensor, "add_")]
    before = {(owner, name): getattr(owner, name) for owner, name in names}
    own_before = {(owner, name): name in vars(owner) for owner, name in names}
    rnn_backend = torch.nn.modules.rnn._VF
    handle = amp.init()
    assert all(getattr(owner, name) is not before[(owner, name)] for owner, name in names)
    handle._deactivate()
    for owner, name in names:
        assert (name in vars(owner)) == own_before[(owner, name)], name
        assert getattr(owner, name) == before[(owner, name)], name
    assert torch.nn.modules.rnn._VF is rnn_backend
    assert not handle.is_active()


def test_disabled_init_returns_a_no_op_handle():
    handle = amp.init(enabled=False)
    x = torch.randn(3, 3)
    assert not handle.is_active() and not handle.has_cache
    assert torch.mm(x, x).dtype == torch.float32
    loss = x.sum()
    with handle.scale_loss(loss, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1)) as scaled:
        assert scaled is loss


def _fp16_exact_linear(seed=0):
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    return model


def test_handle_scale_loss_unscales_grads_and_skips_the_step_after_an_overflow(capsys):
    handle = amp.init(loss_scale="dynamic")
    model = _fp16_exact_linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    handle._default_scaler._loss_scale = 128.0  # 2**16 itself overflows fp16 grads of a sum
    with handle.scale_loss(model(x).float().sum(), optimizer) as scaled:
        assert scaled.item() == pytest.approx(model(x).float().sum().item() * 128.0, rel=1e-3)
        scaled.backward()
    with handle._disable_casts():
        expected = torch.ones(3, 2).t().mm(x.half().float())  # d(sum(xW^T+b))/dW
    torch.testing.assert_close(model.weight.grad, expected, rtol=2e-3, atol=2e-3)
    before = model.weight.detach().clone()
    optimizer.step()
    assert not torch.equal(model.weight, before)

    optimizer.zero_grad()
    with handle.scale_loss(model(x).float().sum() * float("inf"), optimizer) as scaled:
        scaled.backward()
    before = model.weight.detach().clone()
    optimizer.step()  # skipped
    assert torch.equal(model.weight, before)
    assert "Gradient overflow, skipping update" in capsys.readouterr().out
    assert handle._default_scaler.loss_scale() == 64.0
    optimizer.step()  # the skip was one-shot
    assert not torch.equal(model.weight, before)
    handle._deactivate()


def test_handle_scale_loss_unscales_a_parameter_listed_twice_once():
    """torch takes a parameter listed twice in a group with a warning; the handle's unscale walked the groups and
    divided its one gradient by the scale twice."""
    handle = amp.init(loss_scale=4.0)
    try:
        weight = torch.nn.Parameter(torch.ones(2))
        with pytest.warns(UserWarning, match="duplicate parameters"):
            optimizer = torch.optim.SGD([weight, weight], lr=0.1)
        with handle.scale_loss((weight * 3).sum(), optimizer) as scaled:
            scaled.backward()
        assert weight.grad.tolist() == [3.0, 3.0]
    finally:
        handle._deactivate()


def test_the_handle_apis_name_a_loss_that_is_a_number_and_an_optimizer_list():
    """``amp.scale_loss`` named a loss passed as a number; Apex's older ``handle.scale_loss`` and
    ``optimizer.scale_loss`` (of ``wrap_optimizer``) failed on it with ``'float' object has no attribute 'float'``,
    and ``handle.scale_loss`` on a list of optimizers with ``'list' object has no attribute 'param_groups'``."""
    handle = amp.init()
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with pytest.raises(TypeError, match=r"^handle.scale_loss expects the loss as a tensor, got float: "):
            with handle.scale_loss(3.0, optimizer):
                pass
        with pytest.raises(TypeError, match=r"^handle.scale_loss expects one optimizer, got list"):
            with handle.scale_loss(model(torch.randn(3, 4)).sum(), [optimizer]):
                pass
        wrapped = amp.init().wrap_optimizer(optimizer)
        with pytest.raises(TypeError, match=r"^optimizer.scale_loss expects the loss as a tensor, got int: "):
            with wrapped.scale_loss(3):
                pass
    finally:
        handle._deactivate()


@pytest.mark.parametrize("name", ["enabled", "enable_caching", "verbose", "allow_banned"])
def test_amp_init_refuses_a_switch_that_is_not_true_or_false(name):
    """``amp.init(enabled="False")`` (a string from a config) was read by truthiness and patched torch for O1,
    where ``amp.initialize(enabled="False")`` is refused; ``verbose="yes"`` was kept as the handle's flag."""
    with pytest.raises(ValueError, match=rf"^{name}='False': expected True or False$"):
        amp.init(**{name: "False"})
    handle = amp.init(**{name: 0})
    assert isinstance(handle, amp.handle.NoOpHandle if name == "enabled" else amp.handle.AmpHandle)
    handle._deactivate()


def test_the_wrapped_optimizers_zero_grad_without_an_argument_is_the_optimizers_own():
    """Apex's ``OptimWrapper.zero_grad()`` called the optimizer's with no argument; here it forced ``set_to_none=True``
    over an optimizer whose own default zeroes in place (a fused one built with ``set_grad_none=False``)."""
    from ampkit.compat.optimizers import FusedAdam

    param = torch.nn.Parameter(torch.ones(3))
    wrapped = amp.init().wrap_optimizer(FusedAdam([param], set_grad_none=False))
    try:
        param.grad = grad = torch.ones(3)
        wrapped.zero_grad()
        assert param.grad is grad and not grad.any()
        wrapped.zero_grad(set_to_none=True)
        assert param.grad is None
    finally:
        amp._amp_state.handle._deactivate()


def test_wrap_optimizers_num_loss_follows_initializes_num_losses():
    """numpy's int64 was refused where amp.initialize takes it, and 10**8 (a typo) made a scaler each for the better
    part of an hour; both follow initialize's rule now."""
    import numpy as np

    handle = amp.init()
    try:
        sgd = torch.optim.SGD(_fp16_exact_linear().parameters(), lr=0.1)
        for bad in (0, True, 1.5, 1025, 10**8):  # 1025: one past the bound, refused before any scaler is made
            with pytest.raises(ValueError, match=rf"^num_loss={bad!r}: expected an integer in \[1, 1024\]"):
                handle.wrap_optimizer(sgd, num_loss=bad)
        assert len(handle.wrap_optimizer(sgd, num_loss=np.int64(2))._loss_scaler) == 2
    finally:
        handle._deactivate()


def test_wrapped_optimizer_keeps_one_scaler_per_loss_and_combines_their_grads():
    handle = amp.init()
    model = _fp16_exact_linear()
    optimizer = handle.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), num_loss=2)
    with pytest.raises(RuntimeError, match="wrap_optimizer"):
        with handle.scale_loss(model(torch.randn(2, 4)).sum(), optimizer):
            pass
    x = torch.randn(3, 4)
    for scaler in optimizer._loss_scaler:
        scaler._loss_scale = 128.0
    optimizer.zero_grad()
    for loss in (model(x).float().sum(), 2 * model(x).float().sum()):
        with optimizer.scale_loss(loss) as scaled:
            scaled.backward()
    with amp.disable_casts():
        expected = 3 * torch.ones(3, 2).t().mm(x.half().float())
    torch.testing.assert_close(model.weight.grad, expected, rtol=2e-3, atol=2e-3)
    optimizer.step()
    optimizer.zero_grad()
    with optimizer.scale_loss(model(x).float().sum()) as scaled:
        scaled.backward()
    with optimizer.scale_loss(model(x).float().sum() * float("inf")) as scaled:
        scaled.backward()
    before = model.weight.detach().clone()
    optimizer.step()
    assert torch.equal(model.weight, before)
    scales = [s.loss_scale() for s in optimizer._loss_scaler]
    assert scales == [128.0, 64.0]  # only the overflowing loss backed off
    handle._deactivate()


class _Whitelist(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.arange(64, dtype=dtype).view(8, 8) / 64)

    @staticmethod
    def ops(x, w):
        return x.mm(w).mm(w).sum()

    def forward(self, x):
        return self.ops(x, self.weight)


def test_weight_casts_are_cached_within_an_iteration_and_refreshed_after_eval_and_updates():
    model = _Whitelist(torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    handle = amp._amp_state.handle
    x = torch.ones(2, 8)

    def train_step():
        model.weight.grad = None
        loss = model(x)
        assert len(handle.cache) == 1  # one cast of the weight, used by both mm calls
        amp._amp_state.loss_scalers[0]._loss_scale = 4.0
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        assert handle.cache == {}  # cleared when the backward's unscale is done
        w = model.weight.detach().clone().requires_grad_()
        _Whitelist.ops(x, w).backward()
        torch.testing.assert_close(model.weight.grad, w.grad, rtol=1e-2, atol=1e-2)
        model.weight.data -= 1.0

    train_step()
    with torch.no_grad():
        model(x)  # an eval forward caches a cast without an autograd edge
    train_step()  # ... which must not be reused for training: the weight still gets its gradient


def test_cached_cast_is_refreshed_when_the_weight_changes_in_place():
    handle = amp.init()
    weight = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4)
    first = F.linear(x, weight)
    with torch.no_grad():
        weight.mul_(2)
    second = F.linear(x, weight)
    torch.testing.assert_close(second.float(), 2 * first.float(), rtol=1e-2, atol=1e-2)
    handle._deactivate()


def test_initialize_o1_creates_the_handle_and_scalers_answer_to_apex_attributes():
    model = nn.Linear(2, 2)
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=1), opt_level="O1", verbosity=0)
    state = amp._amp_state
    assert isinstance(state.handle, amp.AmpHandle) and state.handle.is_active()
    scaler = state.loss_scalers[0]
    assert scaler.dynamic and scaler._loss_scale == 2.0**16 and scaler.loss_scale() == 2.0**16
    assert (scaler._scale_seq_len, scaler._max_loss_scale, scaler._min_loss_scale) == (2000, 2.0**24, None)
    scaler._loss_scale = 8.0
    loss = model(torch.randn(3, 2)).sum()
    with amp.scale_loss(loss, optimizer) as scaled:
        assert scaled.item() == 8.0 * loss.float().item()  # the written scale is the one used
        scaled.backward()
    assert scaler._loss_scale == 8.0 and scaler._unskipped == 1 and not scaler._has_overflow
    with amp.scale_loss(model(torch.randn(3, 2)).sum() * float("inf"), optimizer) as scaled:
        scaled.backward()
    assert scaler._has_overflow and scaler._loss_scale == 4.0 and scaler._unskipped == 0
    with amp.scale_loss(model(torch.randn(3, 2)).sum(), optimizer, delay_overflow_check=True) as scaled:
        scaled.backward()
    assert not scaler._has_overflow  # Apex cleared it before every unscale, delayed check or not


@pytest.mark.parametrize("bad", [1e39, 0.0, float("nan"), "big"])
def test_a_written_scale_float32_cannot_carry_is_refused(bad):
    """NVIDIA's scripts write ``scaler._loss_scale = args.init_loss_scale``, and FP16_Optimizer's ``loss_scale`` is
    that attribute: 1e39 or 0 was taken, and every scaled loss was inf (skipped, or stepped on by a static scaler)
    or 0."""
    from ampkit.compat.fp16_utils import FP16_Optimizer

    model = nn.Linear(2, 2)
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=1), opt_level="O1", verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]
    with pytest.raises(ValueError, match=re.escape(f"_loss_scale={bad!r}: ")):
        scaler._loss_scale = bad
    assert scaler._loss_scale == 2.0**16
    wrapped = FP16_Optimizer(torch.optim.SGD(nn.Linear(2, 2).half().parameters(), lr=1), verbose=False)
    with pytest.raises(ValueError, match=re.escape(f"FP16_Optimizer.loss_scale={bad!r}: ")):
        wrapped.loss_scale = bad
    assert wrapped.loss_scale == 1.0


def test_a_static_scaler_never_reports_an_overflow_and_a_zero_floor_is_none():
    """Apex's static scaler neither skips nor sets ``_has_overflow``; ``min_loss_scale=0`` meant no floor."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", loss_scale=128.0, verbosity=0)
    with amp.scale_loss(model(torch.randn(3, 2)).sum() * float("inf"), optimizer) as scaled:
        scaled.backward()
    scaler = amp._amp_state.loss_scalers[0]
    assert not scaler._has_overflow and scaler._loss_scale == 128.0 and scaler._unskipped == 1
    amp.initialize(nn.Linear(2, 2), opt_level="O1", min_loss_scale=0, verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]
    assert scaler._min_loss_scale is None
    scaler._min_loss_scale = 0
    assert scaler._min_loss_scale is None


def _frozen_then_unfrozen(enabled: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for param in model[0].parameters():
        param.requires_grad_(False)
    handle = amp.init(enabled=enabled, loss_scale=128.0, verbose=False)
    generator = torch.Generator().manual_seed(2)
    try:
        for step in range(4):
            if step == 2:
                for param in model[0].parameters():
                    param.requires_grad_(True)
            x = torch.randn(16, 8, generator=generator)
            loss = F.mse_loss(model(x).float(), x.sum(1, keepdim=True))
            with handle.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        handle._deactivate()
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def test_handle_unscales_a_parameter_unfrozen_after_its_first_scale_loss():
    """The handle took the optimizer's trainable parameters at its first ``scale_loss``; one unfrozen later kept its
    gradient scaled by 128 and stepped that far."""
    torch.testing.assert_close(_frozen_then_unfrozen(True), _frozen_then_unfrozen(False), atol=2e-3, rtol=0)
