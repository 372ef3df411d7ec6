"""Overflow handling with several models, optimizers and losses (the semantics of Apex's
test_multiple_models_optimizers_losses and test_fused_sgd's overflow checks), on CPU.

An inf is injected into a chosen backward of a chosen iteration; only that loss's scaler backs off,
only the optimizers that loss reached skip their next step (with Apex's message), skipped steps leave
the parameters untouched, and the final parameters equal a plain float32 loop that skips the same steps.
"""

import copy

import pytest
import torch
from apex_test_helpers import half_exact_linear

from ampkit.compat import amp

ITERS = 4


def _inject_inf(tensor):
    tensor.register_hook(lambda grad: grad * float("inf"))


def _models():
    return half_exact_linear(4, 4, seed=1), half_exact_linear(4, 1, seed=2)


def _optimizers(m0, m1):
    return (
        torch.optim.SGD(m0.parameters(), lr=0.05, momentum=0.9),
        torch.optim.SGD(m1.parameters(), lr=0.05, momentum=0.9),
    )


def _batch(it):
    return torch.linspace(-1, 1, 32).reshape(8, 4) * (1 + 0.1 * it)


def _losses(m0, m1, x, inject=None):
    """loss0 reaches m0 only; loss1 reaches m0 and m1."""
    h = m0(x)
    if inject == 0:
        _inject_inf(h)
    loss0 = h.float().pow(2).mean()
    h1 = m0(x)
    out = m1(torch.tanh(h1))
    if inject == 1:
        _inject_inf(out)
    loss1 = out.float().pow(2).mean()
    return loss0, loss1


def _reference(inject_iter, inject_loss):
    """Plain float32 training that skips what amp should skip."""
    m0, m1 = _models()
    opt0, opt1 = _optimizers(m0, m1)
    for it in range(ITERS):
        opt0.zero_grad()
        opt1.zero_grad()
        loss0, loss1 = _losses(m0, m1, _batch(it))
        (loss0 + loss1).backward()
        skip0 = it == inject_iter
        skip1 = it == inject_iter and inject_loss == 1
        if not skip0:
            opt0.step()
        if not skip1:
            opt1.step()
    return m0, m1


def _train_with_amp(level, inject_iter, inject_loss, combine_grad=False, **kwargs):
    m0, m1 = _models()
    opt0, opt1 = _optimizers(m0, m1)
    [m0, m1], [opt0, opt1] = amp.initialize(
        [m0, m1], [opt0, opt1], opt_level=level, num_losses=2, combine_grad=combine_grad, verbosity=0, **kwargs
    )
    untouched = None
    for it in range(ITERS):
        opt0.zero_grad()
        opt1.zero_grad()
        inject = inject_loss if it == inject_iter else None
        loss0, loss1 = _losses(m0, m1, _batch(it), inject)
        with amp.scale_loss(loss0, opt0, loss_id=0) as scaled:
            scaled.backward()
        with amp.scale_loss(loss1, [opt0, opt1], loss_id=1) as scaled:
            scaled.backward()
        before = copy.deepcopy([m0.state_dict(), m1.state_dict()])
        opt0.step()
        opt1.step()
        if it == inject_iter:
            untouched = (before, copy.deepcopy([m0.state_dict(), m1.state_dict()]))
    return m0, m1, untouched


@pytest.mark.parametrize("inject_loss", [0, 1])
@pytest.mark.parametrize(
    "level, extra, tol", [("O0", {"loss_scale": "dynamic"}, 0.0), ("O1", {}, 2e-2), ("O2", {}, 2e-2)]
)
def test_inf_in_one_backward_skips_exactly_the_optimizers_it_reached(inject_loss, level, extra, tol):
    inject_iter = 1
    m0, m1, (before, after) = _train_with_amp(level, inject_iter, inject_loss, **extra)
    scalers = amp._amp_state.loss_scalers
    assert scalers[inject_loss].loss_scale() == 2.0**15
    assert scalers[1 - inject_loss].loss_scale() == 2.0**16
    assert scalers[inject_loss].unskipped == ITERS - 1 - inject_iter
    assert scalers[1 - inject_loss].unskipped == ITERS
    # model 0 is reached by both losses and always skips; model 1 only when loss 1 overflowed
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    m1_untouched = all(torch.equal(before[1][k], after[1][k]) for k in before[1])
    assert m1_untouched == (inject_loss == 1)
    ref0, ref1 = _reference(inject_iter, inject_loss)
    for got, want in ((m0, ref0), (m1, ref1)):
        for p, q in zip(got.parameters(), want.parameters(), strict=True):
            assert torch.isfinite(p).all()
            torch.testing.assert_close(p.float(), q, atol=tol, rtol=tol)


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_an_inf_in_one_optimizer_s_gradients_skips_every_optimizer_its_scale_loss_names(level):
    """Apex keeps one overflow verdict per ``scale_loss``: loss 1's inf reaching model 1's weight alone skips the next
    step of both optimizers it names (model 0's gradients are finite) and backs off loss 1's scaler once."""
    m0, m1 = _models()
    opt0, opt1 = _optimizers(m0, m1)
    extra = {"loss_scale": "dynamic"} if level == "O0" else {}
    [m0, m1], [opt0, opt1] = amp.initialize(
        [m0, m1], [opt0, opt1], opt_level=level, num_losses=2, verbosity=0, **extra
    )  # fmt: skip
    m1.weight.register_hook(lambda grad: grad * float("inf"))
    _, loss1 = _losses(m0, m1, _batch(0))
    with amp.scale_loss(loss1, [opt0, opt1], loss_id=1) as scaled:
        scaled.backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in m0.parameters())
    before = copy.deepcopy([m0.state_dict(), m1.state_dict()])
    opt0.step()
    opt1.step()
    after = [m0.state_dict(), m1.state_dict()]
    assert all(torch.equal(b[k], a[k]) for b, a in zip(before, after, strict=True) for k in b)
    assert [s.loss_scale() for s in amp._amp_state.loss_scalers] == [2.0**16, 2.0**15]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_combine_grad_flat_buffers_give_bitwise_the_same_training(level):
    plain = _train_with_amp(level, inject_iter=2, inject_loss=1)
    plain_scales = amp.state_dict()
    flat = _train_with_amp(level, inject_iter=2, inject_loss=1, combine_grad=True)
    assert amp.state_dict() == plain_scales
    for got, want in zip(flat[:2], plain[:2], strict=True):
        for p, q in zip(got.parameters(), want.parameters(), strict=True):
            assert torch.equal(p, q)


@pytest.mark.parametrize("which", [0, 1])
def test_forced_fp16_overflow_halves_the_right_scaler_exactly_n_times(which, capsys):
    n = 3
    m0, m1 = _models()
    opt0, opt1 = _optimizers(m0, m1)
    [m0, m1], [opt0, opt1] = amp.initialize([m0, m1], [opt0, opt1], opt_level="O1", num_losses=2, verbosity=1)
    capsys.readouterr()
    for it in range(n + 2):
        x = _batch(it)
        outs = [m0(x), m1(torch.tanh(x))]
        if it < n:
            outs[which] = outs[which] * 70000.0  # overflows float16 (max 65504) in forward and backward
        for loss_id, (out, opt) in enumerate(zip(outs, (opt0, opt1), strict=True)):
            opt.zero_grad()
            with amp.scale_loss(out.float().mean() * 0.01, opt, loss_id=loss_id) as scaled:
                scaled.backward()
            opt.step()
    scalers = amp._amp_state.loss_scalers
    assert scalers[which].loss_scale() == 2.0**16 / 2**n
    assert scalers[1 - which].loss_scale() == 2.0**16
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Gradient overflow")]
    assert lines == [
        f"Gradient overflow.  Skipping step, loss scaler {which} reducing loss scale to {2.0**16 / 2**k}"
        for k in range(1, n + 1)
    ]


def test_skip_is_one_shot_and_verbosity_zero_is_silent(capsys):
    m0, m1 = _models()
    opt0, _ = _optimizers(m0, m1)
    m0, opt0 = amp.initialize(m0, opt0, opt_level="O1", verbosity=0)
    out = m0(_batch(0))
    _inject_inf(out)
    with amp.scale_loss(out.float().sum(), opt0) as scaled:
        scaled.backward()
    weight = m0.weight.detach().clone()
    opt0.step()
    assert torch.equal(weight, m0.weight)
    opt0.zero_grad()
    with amp.scale_loss(m0(_batch(0)).float().mean() * 0.01, opt0) as scaled:
        scaled.backward()
    opt0.step()
    assert not torch.equal(weight, m0.weight)
    assert amp._amp_state.loss_scalers[0].loss_scale() == 2.0**15
    assert capsys.readouterr().out == ""


def test_static_scale_does_not_skip_as_in_apex():
    m0, m1 = _models()
    opt0, _ = _optimizers(m0, m1)
    m0, opt0 = amp.initialize(m0, opt0, opt_level="O1", loss_scale=128.0, verbosity=0)
    out = m0(_batch(0))
    _inject_inf(out)
    with amp.scale_loss(out.float().sum(), opt0) as scaled:
        scaled.backward()
    opt0.step()
    assert not torch.isfinite(m0.weight).all()
    assert amp._amp_state.loss_scalers[0].loss_scale() == 128.0


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_delay_unscale_accumulates_exactly_and_checks_at_the_last_backward(level):
    m0, m1 = _models()
    opt0, _ = _optimizers(m0, m1)
    reference = copy.deepcopy(m0)
    m0, opt0 = amp.initialize(m0, opt0, opt_level=level, loss_scale="dynamic", verbosity=0)
    batches = [_batch(i) for i in range(3)]
    for i, x in enumerate(batches):
        last = i == len(batches) - 1
        with amp.scale_loss(m0(x).float().pow(2).mean(), opt0, delay_unscale=not last) as scaled:
            scaled.backward()
        if not last:
            assert opt0._amp_stash.params_have_scaled_gradients
    for x in batches:
        reference(x).pow(2).mean().backward()
    grads = [p.grad for p in amp.master_params(opt0)]
    tol = 0.0 if level == "O0" else 2e-2
    for got, want in zip(grads, (reference.weight.grad, reference.bias.grad), strict=True):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # an inf in a delayed backward is caught when the gradients are finally unscaled
    opt0.zero_grad()
    out = m0(batches[0])
    _inject_inf(out)
    with amp.scale_loss(out.float().sum(), opt0, delay_unscale=True) as scaled:
        scaled.backward()
    with amp.scale_loss(m0(batches[1]).float().sum(), opt0) as scaled:
        scaled.backward()
    assert amp._amp_state.loss_scalers[0].loss_scale() == 2.0**15


class _HostReads:
    """Counts the reads of a tensor's value to the host (each one a device sync on a GPU)."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
            monkeypatch.setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name)))

    def _counted(self, read):
        def counted(tensor, *args):
            self.count += 1
            return read(tensor, *args)

        return counted


@pytest.mark.parametrize(
    ("api", "level", "loss_scale", "reads_per_step"),
    [
        ("scale_loss", "O1", 128.0, 0),
        ("scale_loss", "O2", 128.0, 0),
        ("scale_loss", "O3", "128.0", 0),
        ("handle", "O1", 128.0, 0),
        ("scale_loss", "O1", "dynamic", 1),
        ("handle", "O1", "dynamic", 1),
    ],
)
def test_a_static_scale_reads_no_overflow_flag_to_the_host_and_a_dynamic_one_reads_one_a_step(
    monkeypatch, api, level, loss_scale, reads_per_step
):
    """A static scale never skips, so its overflow flags stay on the device: no host read (a GPU sync) per step, as
    Apex's update_scale read ``_overflow_buf`` only for a dynamic scaler; a dynamic scale reads it once a step.
    ``_overflow_buf`` still shows an inf of a static step's gradients, where Apex's unscale left it."""
    model = half_exact_linear(4, 2, seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    if api == "handle":
        handle = amp.init(loss_scale=loss_scale)
        scale_loss, scaler = handle.scale_loss, handle._default_scaler
    else:
        model, optimizer = amp.initialize(model, optimizer, opt_level=level, loss_scale=loss_scale, verbosity=0)
        scale_loss, scaler = amp.scale_loss, amp._amp_state.loss_scalers[0]
    dtype = next(model.parameters()).dtype
    reads = _HostReads(monkeypatch)
    for it in range(3):
        out = model(_batch(it).to(dtype))
        if it == 2:
            _inject_inf(out)
        with scale_loss(out.float().pow(2).mean(), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert reads.count == 3 * reads_per_step
    monkeypatch.undo()
    assert scaler._overflow_buf.item() == 1  # the last step's inf
    assert scaler.loss_scale() == (2.0**15 if loss_scale == "dynamic" else 128.0)


def test_a_delayed_overflow_check_leaves_the_overflow_in_the_buffer_for_the_script_to_read():
    """With ``delay_overflow_check=True`` the scale neither moves nor skips, but the backward's inf is in
    ``_overflow_buf``, where Apex's unscale left it for a script that calls ``update_scale()`` itself."""
    m0, m1 = _models()
    opt0, _ = _optimizers(m0, m1)
    m0, opt0 = amp.initialize(m0, opt0, opt_level="O1", verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]
    out = m0(_batch(0))
    _inject_inf(out)
    with amp.scale_loss(out.float().sum(), opt0, delay_overflow_check=True) as scaled:
        scaled.backward()
    assert scaler.loss_scale() == 2.0**16 and scaler._overflow_buf.item() == 1
    assert scaler.update_scale() and scaler.loss_scale() == 2.0**15
