"""The optimizer methods amp patches under master weights (O2): ``zero_grad`` as Apex's and torch's contracts have it.

Apex's O2 ``zero_grad`` (it took no argument) zeroed the model's gradients in place and set the fp32 masters' to
None; torch's ``zero_grad(set_to_none=False)`` zeroes every gradient in place and ``True`` drops them all. Each way,
training goes on exactly as if the gradients had never been there.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

from ampkit.compat import amp


def _setup(combine_grad: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", combine_grad=combine_grad, verbosity=0)
    return model, optimizer


def _backward(model, optimizer, seed: int) -> None:
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(seed)).half()
    with amp.scale_loss(model(x).float().pow(2).mean(), optimizer) as scaled:
        scaled.backward()


def _trained(combine_grad: bool, zero) -> list[torch.Tensor]:
    """Three steps, each after a backward that ``zero`` discards (a batch thrown away) and one that counts."""
    amp._amp_state.reset()
    model, optimizer = _setup(combine_grad)
    for i in range(3):
        _backward(model, optimizer, 100 + i)
        zero(optimizer)
        _backward(model, optimizer, i)
        optimizer.step()
        zero(optimizer)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("combine_grad", [False, True])
def test_zero_grad_without_an_argument_zeroes_the_models_gradients_as_apexs_did(combine_grad):
    """Code reading ``p.grad`` after ``optimizer.zero_grad()`` (``p.grad.zero_()``, a norm) found zeroed tensors under
    Apex's O2; here they were None, and such code raised AttributeError."""
    model, optimizer = _setup(combine_grad)
    _backward(model, optimizer, 0)
    held = [p.grad for p in model.parameters()]
    optimizer.zero_grad()
    assert all(p.grad is g for p, g in zip(model.parameters(), held, strict=True))  # the same tensors, zeroed
    assert all(not p.grad.any() for p in model.parameters())
    stash = optimizer._amp_stash
    assert all(m.grad is None for m in stash.all_fp32_from_fp16_params)  # Apex set the masters' to None


@pytest.mark.parametrize("combine_grad", [False, True])
def test_zero_grad_set_to_none_false_zeroes_every_gradient_in_place(combine_grad):
    """torch's contract for ``set_to_none=False``: each gradient the optimizer's parameters (the masters) and the model
    hold is zeroed in place, none is dropped; it used to drop them all."""
    model, optimizer = _setup(combine_grad)
    _backward(model, optimizer, 0)
    holders = [*model.parameters(), *optimizer._amp_stash.all_fp32_from_fp16_params]
    held = [t.grad for t in holders]
    assert all(g is not None for g in held)
    optimizer.zero_grad(set_to_none=False)
    assert all(t.grad is g and not g.any() for t, g in zip(holders, held, strict=True))
    optimizer.zero_grad(set_to_none=True)
    assert all(t.grad is None for t in holders)


@pytest.mark.parametrize("combine_grad", [False, True])
def test_every_way_of_zeroing_trains_as_dropping_the_gradients(combine_grad):
    """Zeroed in place or dropped, the discarded backward leaves nothing behind: the same weights, bit for bit."""
    dropped = _trained(combine_grad, lambda opt: opt.zero_grad(set_to_none=True))
    for zero in (lambda opt: opt.zero_grad(), lambda opt: opt.zero_grad(set_to_none=False)):
        for a, b in zip(_trained(combine_grad, zero), dropped, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_loading_a_checkpoint_without_masters_mid_run_goes_on_from_the_loaded_weights():
    """A run rolled back to an Apex-layout checkpoint (the model's weights, the optimizer's state, no masters) while
    training: the masters it held were written over the loaded weights at the next step, so the run went on from where
    it was. Now it trains on as a fresh process that initializes and then loads the same checkpoint."""
    model, optimizer = _setup(False)
    _backward(model, optimizer, 0)
    optimizer.step()
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    del checkpoint["optimizer"]["ampkit_master_weights"]  # as Apex saved it
    checkpoint = copy.deepcopy(checkpoint)  # torch's load keeps the dict's tensors: each run loads its own copy
    for i in range(1, 3):
        optimizer.zero_grad()
        _backward(model, optimizer, i)
        optimizer.step()
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(copy.deepcopy(checkpoint["optimizer"]))
    runs = [(model, optimizer)]
    amp._amp_state.reset()
    runs.append(_setup(False))
    runs[1][0].load_state_dict(checkpoint["model"])
    runs[1][1].load_state_dict(checkpoint["optimizer"])
    for model, optimizer in runs:
        for i in range(10, 12):
            optimizer.zero_grad()
            _backward(model, optimizer, i)
            optimizer.step()
    # Up to an fp16 rounding: the fresh run's masters keep their initial fp32 bits where the loaded weight rounds the
    # same. Going on from where it was, the run differed by 2e-2 to 9e-2.
    for a, b in zip(runs[0][0].parameters(), runs[1][0].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-3)


class _Heads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = torch.nn.Linear(6, 8), torch.nn.Linear(8, 2)

    def forward(self, x, use_head):
        h = self.body(x)
        return self.head(h) if use_head else h


@pytest.mark.parametrize("delayed", [True, False])
def test_a_layer_no_backward_of_an_accumulation_reaches_steps_as_under_apex(delayed):
    """Apex's O2 ``zero_grad()`` zeroed the model's gradients in place, and a ``delay_unscale`` backward left them
    there: a layer that none of the accumulation's backwards reached got a zero master gradient and was stepped (its
    momentum went on). A backward without ``delay_unscale`` set them to None first, so such a layer was not stepped.
    The zero master gradient of the first case was missing."""
    amp._amp_state.reset()
    torch.manual_seed(0)
    model = _Heads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)

    def accumulate(use_head):
        optimizer.zero_grad()
        for k, delay in enumerate((delayed, False)):
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(k))
            with amp.scale_loss(model(x, use_head).float().pow(2).mean(), optimizer, delay_unscale=delay) as scaled:
                scaled.backward()
        optimizer.step()

    accumulate(use_head=True)  # the head gets momentum
    before = model.head.weight.detach().clone()
    accumulate(use_head=False)
    assert torch.equal(model.head.weight, before) is not delayed


@pytest.mark.parametrize("delayed", [True, False])
def test_gradients_never_zeroed_step_on_each_iterations_backwards_only(delayed):
    """A script that never zeroes: each O2 step takes only its own iteration's backwards, with or without
    ``delay_unscale``, as Apex's non-delayed path did (its prepare dropped the fp16 gradients). Apex's delayed
    accumulation skipped that prepare, so it added every earlier iteration's fp16 gradients, scaled by their own
    scales, into the next one; ampkit does not, on purpose (documented under "Accumulating with delay_unscale")."""
    amp._amp_state.reset()
    model = torch.nn.Linear(4, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale=8.0, verbosity=0)
    for it in range(3):
        for k, delay in enumerate((delayed, False)):
            with amp.scale_loss(model(torch.full((1, 4), 2.0 * it + k + 1)).sum(), optimizer, delay_unscale=delay) as s:
                s.backward()
        [master] = amp.master_params(optimizer)
        assert torch.equal(master.grad, torch.full((1, 4), 4.0 * it + 3))  # this iteration's two inputs
        optimizer.step()


def test_a_copy_of_apexs_master_params_to_model_params_runs_and_matches_amps_own_copy():
    """A script (a fork of Apex's ``_process_optimizer``) that sets Apex's ``_master_params_to_model_params`` on the
    optimizer reads ``_amp_stash.multi_tensor_scale`` and ``dummy_overflow_buf``, which Apex's stash held: they were
    missing (AttributeError at the first step). Its copy and amp's own (``copy_``) leave the same fp16 values, a
    master past fp16's range or nan included; Apex's kernel also raised the dummy buffer there, which nothing read."""
    from ampkit.compat.multi_tensor_apply import multi_tensor_applier

    def apex_master_params_to_model_params(self):  # Apex's, as the forks copied it
        stash = self._amp_stash
        if len(stash.all_fp16_params) > 0:
            multi_tensor_applier(
                stash.multi_tensor_scale,
                stash.dummy_overflow_buf,
                [stash.all_fp32_from_fp16_params, stash.all_fp16_params],
                1.0,
            )

    model, optimizer = _setup(combine_grad=False)
    _backward(model, optimizer, 0)  # the lazy init done: the masters do not take over the zeroed model below
    stash = optimizer._amp_stash
    with torch.no_grad():
        stash.all_fp32_from_fp16_params[0][0, :3] = torch.tensor([70000.0, float("nan"), 1 / 3])
    optimizer._master_params_to_model_params()  # amp's own
    own = [p.detach().clone() for p in stash.all_fp16_params]
    assert own[0][0, 0].item() == float("inf") and own[0][0, 1].isnan()
    assert stash.dummy_overflow_buf.dtype == torch.int32 and stash.dummy_overflow_buf.item() == 0
    with torch.no_grad():
        for p in stash.all_fp16_params:
            p.zero_()

    optimizer._master_params_to_model_params = types.MethodType(apex_master_params_to_model_params, optimizer)
    optimizer._master_params_to_model_params()
    for got, want in zip(stash.all_fp16_params, own, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert stash.dummy_overflow_buf.item() == 1  # the nan master, as Apex's kernel flagged it
    assert stash.multi_tensor_l2norm is not None
