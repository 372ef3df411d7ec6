"""A model holding fp16 and fp32 parameters at once, passed with ``cast_model_type=False`` (and
``allow_incoming_model_not_fp32``): amp keeps each parameter's type, gives fp16 ones fp32 masters, and
skips exactly the iteration in which any parameter's gradient of any loss overflowed.
"""

import pytest
import torch
from apex_test_helpers import half_exact_linear

from ampkit.compat import amp


class Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.low = half_exact_linear(4, 4, seed=1).half()
        self.high = half_exact_linear(4, 2, seed=2)

    def forward(self, x):
        return self.high(self.low(x.half()).float())


def _build(num_losses, verbosity=0):
    model = Mixed()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp._amp_state.allow_incoming_model_not_fp32 = True
    try:
        return amp.initialize(
            model, optimizer, opt_level="O2", cast_model_type=False, num_losses=num_losses, verbosity=verbosity
        )
    finally:
        amp._amp_state.allow_incoming_model_not_fp32 = False


def _reference_grads(model, x, num_losses):
    """float32 gradients of the same losses from a float32 copy of the weights, the same fp16 rounding of
    the first layer's output (so only accumulation order differs)."""
    low_w, low_b = (p.detach().float().requires_grad_() for p in model.low.parameters())
    high_w, high_b = (p.detach().clone().requires_grad_() for p in model.high.parameters())
    hidden = torch.nn.functional.linear(x.half().float(), low_w, low_b)
    out = torch.nn.functional.linear(hidden, high_w, high_b)
    total = sum((k + 1) * out.pow(2).mean() for k in range(num_losses))
    return torch.autograd.grad(total, [low_w, low_b, high_w, high_b])


@pytest.mark.parametrize("num_losses", [1, 2])
def test_parameter_types_are_kept_and_master_grads_match_a_float32_reference(num_losses):
    model, optimizer = _build(num_losses)
    assert model.low.weight.dtype == torch.float16 and model.high.weight.dtype == torch.float32
    masters = list(amp.master_params(optimizer))
    assert all(m.dtype == torch.float32 for m in masters)
    for it in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(it))
        optimizer.zero_grad()
        out = model(x)
        for loss_id in range(num_losses):
            with amp.scale_loss((loss_id + 1) * out.pow(2).mean(), optimizer, loss_id=loss_id) as scaled:
                scaled.backward(retain_graph=loss_id + 1 < num_losses)
        expected = _reference_grads(model, x, num_losses)
        for master, reference in zip(amp.master_params(optimizer), expected, strict=True):
            torch.testing.assert_close(master.grad, reference, rtol=2e-3, atol=1e-4)
        optimizer.step()


@pytest.mark.parametrize("num_losses", [1, 2])
@pytest.mark.parametrize("where", ["low.weight", "low.bias", "high.weight", "high.bias"])
def test_an_inf_in_any_parameter_of_any_loss_skips_exactly_that_iteration(where, num_losses, capsys):
    for inf_loss in range(num_losses):
        model, optimizer = _build(num_losses, verbosity=1)
        target = dict(model.named_parameters())[where]
        for scaler in amp._amp_state.loss_scalers:
            scaler._loss_scale = 128.0
        for it in range(3):
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.zero_grad()
            out = model(torch.randn(5, 4))
            for loss_id in range(num_losses):
                with amp.scale_loss(out.pow(2).mean(), optimizer, loss_id=loss_id) as scaled:
                    scaled.backward(retain_graph=loss_id + 1 < num_losses)
                    if it == 1 and loss_id == inf_loss:
                        target.grad.view(-1)[0] = float("inf")
            optimizer.step()
            changed = [not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)]
            assert (not any(changed)) if it == 1 else all(changed), (where, inf_loss, it)
        scales = [s.loss_scale() for s in amp._amp_state.loss_scalers]
        assert scales == [64.0 if k == inf_loss else 128.0 for k in range(num_losses)]
        assert f"loss scaler {inf_loss} reducing loss scale to 64.0" in capsys.readouterr().out
