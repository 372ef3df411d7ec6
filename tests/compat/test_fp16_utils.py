"""apex.fp16_utils on CPU: FP16Model / network_to_half casting, master-param helpers, FP16_Optimizer."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F

from ampkit.compat.fp16_utils import (
    FP16_Optimizer,
    FP16Model,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
)


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.bn_no_affine = torch.nn.BatchNorm2d(4, affine=False)
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        x = self.bn_no_affine(self.bn(self.conv(x)))
        return self.fc(x.mean((2, 3)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp16model_casts_all_but_affine_batchnorm(dtype):
    model = FP16Model(ConvNet(), dtype=dtype)
    net = model.network
    assert net.conv.weight.dtype == dtype and net.fc.weight.dtype == dtype
    assert net.bn.weight.dtype == torch.float32 and net.bn.running_mean.dtype == torch.float32
    assert net.bn_no_affine.running_mean.dtype == dtype
    out = model(torch.randn(2, 3, 6, 6))  # float32 input is cast on entry
    assert out.dtype == dtype
    out.float().sum().backward()
    assert net.conv.weight.grad.dtype == dtype and net.bn.weight.grad.dtype == torch.float32


def test_network_to_half_casts_input_and_keeps_batchnorm_float():
    model = network_to_half(ConvNet())
    assert model[1].conv.weight.dtype == torch.float16 and model[1].bn.weight.dtype == torch.float32
    assert model[1].bn.running_mean.dtype == torch.float32
    # Apex's rule is affine batch norms only: one without weight and bias is cast, its statistics too
    assert model[1].bn_no_affine.running_mean.dtype == torch.float16
    assert model(torch.randn(2, 3, 6, 6)).dtype == torch.float16


def test_network_to_half_passes_integer_inputs_through_uncast():
    """Token ids stay integers: tofp16 casts floating inputs only, so an embedding model still indexes."""
    model = network_to_half(torch.nn.Embedding(5, 3))
    out = model(torch.tensor([[1, 4]]))
    assert out.dtype == torch.float16 and torch.equal(out[0], model[1].weight[[1, 4]])


def test_convert_network_casts_existing_gradients_with_their_parameters():
    """A model converted after a backward keeps grads of its parameters' dtype, so the next backward accumulates."""
    from ampkit.compat.fp16_utils import convert_network

    model = torch.nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    before = model.weight.grad.clone()
    convert_network(model, torch.bfloat16)
    assert model.weight.grad.dtype == model.bias.grad.dtype == torch.bfloat16
    assert torch.equal(model.weight.grad, before.to(torch.bfloat16))
    model(torch.randn(4, 3, dtype=torch.bfloat16)).sum().backward()
    assert model.weight.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("flat_master", [False, True])
def test_a_model_param_without_a_gradient_gives_its_master_none_or_zeros(flat_master):
    """A parameter the loss never reached: its own master's grad is cleared, its span of a flat master's is zero."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)).half()
    model_params, master_params = prep_param_lists(model, flat_master=flat_master)
    model[0](torch.ones(1, 2, dtype=torch.float16)).float().sum().backward()  # model[1] gets no gradient
    if not flat_master:
        master_params[2].grad = torch.ones(2, 2)  # a stale grad of an earlier iteration
    model_grads_to_master_grads(model_params, master_params, flat_master=flat_master)
    if flat_master:
        grad = master_params[0].grad
        assert torch.equal(grad[:6], torch.cat([model[0].weight.grad.float().reshape(-1), model[0].bias.grad.float()]))
        assert torch.equal(grad[6:], torch.zeros(6))
    else:
        assert master_params[0].grad is not None and master_params[2].grad is None and master_params[3].grad is None


@pytest.mark.parametrize("flat_master", [False, True])
def test_master_param_helpers_round_trip(flat_master):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).half()
    model_params, master_params = prep_param_lists(model, flat_master=flat_master)
    assert all(m.dtype == torch.float32 and m.requires_grad for m in master_params)
    assert sum(m.numel() for m in master_params) == sum(p.numel() for p in model_params)
    model(torch.randn(4, 3).half()).float().sum().backward()
    model_grads_to_master_grads(model_params, master_params, flat_master=flat_master)
    flat_grads = torch.cat([p.grad.float().reshape(-1) for p in model_params])
    assert torch.equal(torch.cat([m.grad.reshape(-1) for m in master_params]), flat_grads)
    with torch.no_grad():
        for m in master_params:
            m.add_(1.0)
    before = [p.detach().float().clone() for p in model_params]
    master_params_to_model_params(model_params, master_params, flat_master=flat_master)
    for p, b in zip(model_params, before, strict=True):
        assert torch.equal(p.float(), (b + 1.0).half().float())


@pytest.mark.parametrize("helper", [master_params_to_model_params, model_grads_to_master_grads])
def test_master_param_helpers_refuse_lists_that_do_not_pair_up(helper):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)).half()
    model_params, master_params = prep_param_lists(model)
    with pytest.raises(ValueError, match=r"got 4 model params but 3 master params; pass the two lists"):
        helper(model_params, master_params[:3])  # Apex's zip copied the first three and dropped the last
    swapped = [master_params[0], master_params[2], master_params[1], master_params[3]]
    with pytest.raises(ValueError, match=r"model param 1 has shape \(2,\) but master param 1 has \(1, 2\)"):
        helper(model_params, swapped)  # copy_ would have broadcast the (1, 2) weight into the (2,) bias
    _, flat = prep_param_lists(model, flat_master=True)
    with pytest.raises(ValueError, match=r"one flat master of 8 elements .* got master sizes \[11\]"):
        helper(model_params[:2], flat, flat_master=True)  # unflattening took a prefix of the flat master


def test_a_flat_master_of_a_network_to_half_model_trains_like_per_param_masters():
    """The DAWNBench-era loop: ``prep_param_lists(network_to_half(model), flat_master=True)``, an optimizer on the one
    flat master, grads copied in and values copied back by hand. network_to_half keeps BatchNorm in fp32, so the
    params mix dtypes; Apex flattened them into one fp32 master (torch.cat promotes), and this was refused here."""
    torch.manual_seed(0)
    reference = ConvNet()
    x, target = torch.randn(4, 3, 6, 6), torch.tensor([0, 1, 1, 0])
    trained = []
    for flat in (True, False):
        model = network_to_half(copy.deepcopy(reference))
        model_params, master_params = prep_param_lists(model, flat_master=flat)
        assert {p.dtype for p in model_params} == {torch.float16, torch.float32}
        optimizer = torch.optim.SGD(master_params, lr=0.1, momentum=0.9, weight_decay=1e-4)
        for _ in range(3):
            model.zero_grad()
            (F.cross_entropy(model(x).float(), target) * 128.0).backward()
            model_grads_to_master_grads(model_params, master_params, flat_master=flat)
            for master in master_params:
                master.grad.mul_(1.0 / 128.0)
            optimizer.step()
            master_params_to_model_params(model_params, master_params, flat_master=flat)
        trained.append([p.detach().clone() for p in model_params])
    for flat_trained, per_param_trained in zip(*trained, strict=True):
        torch.testing.assert_close(flat_trained, per_param_trained, rtol=0, atol=0)  # dtypes too
    assert not torch.equal(trained[0][0], reference.conv.weight.half())  # it trained


def test_a_flat_master_of_a_frozen_model_is_refused_by_name():
    model = torch.nn.Linear(2, 2).half().requires_grad_(False)
    assert prep_param_lists(model) == ([], [])
    with pytest.raises(ValueError, match=r"flat_master=True\): the model has no parameters with requires_grad=True"):
        prep_param_lists(model, flat_master=True)  # torch.cat's 'expected a non-empty list of Tensors' before


def _half_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


def _loss(model, x, y):
    return (model(x.to(next(model.parameters()).dtype)).float() - y).pow(2).mean()


def test_fp16_optimizer_trains_like_fp32_with_masters():
    reference = _half_model()
    model = copy.deepcopy(reference).half()
    with torch.no_grad():
        for p, q in zip(reference.parameters(), model.parameters(), strict=True):
            p.copy_(q.float())  # same starting point
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=128.0)
    for x, y in _batches(5):
        optimizer.zero_grad()
        optimizer.backward(_loss(model, x, y))
        optimizer.step()
        ref_opt.zero_grad()
        _loss(reference, x, y).backward()
        ref_opt.step()
    assert all(p.dtype == torch.float32 for g in optimizer.param_groups for p in g["params"])
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.dtype == torch.float16
        torch.testing.assert_close(p.float(), q, atol=5e-3, rtol=5e-3)


def test_fp16_optimizer_dynamic_overflow_skips_and_backs_off(capsys):
    model = _half_model().half()
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True)
    assert optimizer.loss_scale == 2.0**16  # Apex amp LossScaler's default
    # Apex starts at init_scale as given, even above max_loss_scale (2**24): fp16 overflows at once.
    optimizer = FP16_Optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**32}
    )
    assert optimizer.loss_scale == 2.0**32
    weights = [p.detach().clone() for p in model.parameters()]
    ((x, y),) = _batches(1)
    steps_skipped = 0
    while True:
        optimizer.zero_grad()
        optimizer.backward(_loss(model, x, y))  # backs off here, at the end of update_master_grads
        if optimizer.clip_master_grads(1.0) != -1:
            break
        assert optimizer.step() is None
        steps_skipped += 1
        assert optimizer.loss_scale == 2.0 ** (32 - steps_skipped)
        assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    optimizer.step()
    assert optimizer.loss_scale == 2.0 ** (32 - steps_skipped) and steps_skipped > 10
    assert not all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    assert "Gradient overflow.  Skipping step, reducing loss scale to 2147483648.0" in capsys.readouterr().out


def test_fp16_optimizer_clip_master_grads_returns_the_norm():
    model = _half_model().half()
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=64.0)
    ((x, y),) = _batches(1)
    optimizer.backward(_loss(model, x, y))
    masters = [p for g in optimizer.param_groups for p in g["params"]]
    norm = torch.linalg.vector_norm(torch.cat([m.grad.reshape(-1) for m in masters])).item()
    total = optimizer.clip_master_grads(norm / 2)
    assert isinstance(total, torch.Tensor) and total.item() == pytest.approx(norm, rel=1e-5)  # torch's return
    clipped = torch.linalg.vector_norm(torch.cat([m.grad.reshape(-1) for m in masters])).item()
    assert clipped == pytest.approx(norm / 2, rel=1e-4)


def _dynamic_adam(model):
    args = {"init_scale": 2.0**20, "scale_window": 2}
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    return FP16_Optimizer(adam, dynamic_loss_scale=True, dynamic_loss_args=args, verbose=False)


def test_fp16_optimizer_state_dict_resumes_identically():
    def run(model, optimizer, batches):
        for x, y in batches:
            optimizer.zero_grad()
            optimizer.backward(_loss(model, x, y))
            optimizer.step()

    batches = _batches(6)
    model = _half_model().half()
    optimizer = _dynamic_adam(model)
    run(model, optimizer, batches[:3])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    run(model, optimizer, batches[3:])
    model2 = _half_model().half()
    optimizer2 = _dynamic_adam(model2)
    state = torch.load(io.BytesIO(buffer.getvalue()))
    model2.load_state_dict(state["model"])
    optimizer2.load_state_dict(state["optimizer"])
    run(model2, optimizer2, batches[3:])
    assert optimizer2.loss_scale == optimizer.loss_scale
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("first_api", [False, True])
def test_a_plain_optimizers_state_dict_is_named_not_a_bare_key_error(first_api):
    """ParlAI resuming an fp32 run with ``--fp16`` hands the wrapper the wrapped optimizer's own state dict and
    catches ``ValueError`` for "model params changed"; it got ``KeyError: 'loss_scaler'``."""
    from ampkit.compat.legacy_fused_adam import FP16_Optimizer as FirstFP16Optimizer

    model = _half_model().half()
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    optimizer = FirstFP16Optimizer(adam) if first_api else FP16_Optimizer(adam, verbose=False)
    plain = torch.optim.Adam(_half_model().parameters()).state_dict()
    lacks = "'cur_scale'" if first_api else "'loss_scaler'"
    with pytest.raises(ValueError, match=rf"lacks \[.*{lacks}.*\]; it is a plain optimizer's state dict"):
        optimizer.load_state_dict(plain)
    with pytest.raises(ValueError, match=r"lacks .*; it has \['junk'\]"):
        optimizer.load_state_dict({"junk": 1})


def test_fp16_optimizer_closure_and_bad_args():
    model = _half_model().half()
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=8.0)
    ((x, y),) = _batches(1)
    before = [p.detach().clone() for p in model.parameters()]

    def closure():
        optimizer.zero_grad()
        loss = _loss(model, x, y)
        optimizer.backward(loss)
        return loss

    assert torch.isfinite(optimizer.step(closure))
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    with pytest.raises(TypeError, match=r"scale_windw.*'scale_window'"):  # Apex: LossScaler(**args) TypeError
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                       dynamic_loss_args={"scale_windw": 3})  # fmt: skip


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"static_loss_scale": 0}, r"^static_loss_scale=0: a static loss scale must be finite and > 0"),
    ({"dynamic_loss_args": {"scale_window": 0}}, r"^dynamic_loss_args\['scale_window'\]=0: expected an integer >= 1"),
    ({"dynamic_loss_args": {"min_loss_scale": 8.0, "max_loss_scale": 2.0}},
     r"^dynamic_loss_args\['min_loss_scale'\]=8.0 is larger than dynamic_loss_args\['max_loss_scale'\]=2.0"),
])  # fmt: skip
def test_fp16_optimizers_bad_scale_options_are_named_as_the_user_wrote_them(kwargs, message):
    """Not as the engine's scaler calls them (loss_scale, growth_interval, min_scale, max_scale)."""
    model = torch.nn.Linear(2, 2).half()
    dynamic = "dynamic_loss_args" in kwargs
    with pytest.raises(ValueError, match=message):
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=dynamic, **kwargs)


@pytest.mark.parametrize(("make", "message"), [
    (lambda s: s.LossScaler(0), r"scale=0.0: expected a finite number > 0"),
    (lambda s: s.LossScaler(float("nan")), r"scale=nan: expected a finite number > 0"),
    (lambda s: s.LossScaler("128"), r"scale='128': expected a number"),
    (lambda s: s.DynamicLossScaler(init_scale=float("inf")), r"init_scale=inf: expected a finite number > 0"),
    (lambda s: s.DynamicLossScaler(scale_factor=1), r"scale_factor=1.0: expected a number > 1"),
    (lambda s: s.DynamicLossScaler(scale_window=0), r"scale_window=0: expected an integer >= 1"),
    (lambda s: s.LossScaler(1e39), r"scale=1e\+39: a loss scale must lie in float32's range of scales"),
    (lambda s: s.LossScaler(1e-300), r"scale=1e-300: a loss scale must lie in float32's range of scales"),
    (lambda s: s.DynamicLossScaler(init_scale=1e300), r"init_scale=1e\+300: a loss scale must lie in float32's"),
])  # fmt: skip
def test_stand_alone_loss_scalers_name_a_scale_that_cannot_train(make, message):
    """A static scale of 0 zeroed every gradient and NaN made them all NaN, without a word; a scale_factor of 1
    never backed off, so every step after an overflow was skipped; a scale_window of 0 divided by zero at the first
    clean iteration. A scale float32 cannot carry made every scaled loss inf (a static scaler, whose has_overflow is
    always False, stepped on the inf gradients; a dynamic one skipped some 870 steps from 1e300) or 0."""
    from ampkit.compat import fp16_utils

    with pytest.raises(ValueError, match=message):
        make(fp16_utils)


def test_stand_alone_loss_scalers_take_every_number_apex_took():
    """The checks above refused numbers Apex's scalers use as they are: a numpy float32 or a one-element tensor as a
    scale ('expected a number'), and a scale_window of 1000.0 (an option parsed with type=float, as Megatron's
    --loss-scale-window) or numpy's int64. The window counts iterations whole, so 1000.5 stays refused."""
    import numpy as np

    from ampkit.compat import fp16_utils

    assert fp16_utils.LossScaler(np.float32(128)).loss_scale == 128.0
    assert fp16_utils.LossScaler(torch.tensor(64.0)).loss_scale == 64.0
    scaler = fp16_utils.DynamicLossScaler(init_scale=np.float32(4), scale_factor=np.float64(2), scale_window=2.0)
    assert (scaler.loss_scale, scaler.scale_window) == (4.0, 2)
    for _ in range(2):
        scaler.update_scale(False)
    assert scaler.loss_scale == 8.0
    assert fp16_utils.DynamicLossScaler(scale_window=np.int64(1000)).scale_window == 1000
    with pytest.raises(ValueError, match=r"scale_window=1000.5: expected an integer >= 1"):
        fp16_utils.DynamicLossScaler(scale_window=1000.5)


def test_a_dynamic_scalers_overflow_verdict_is_a_flag():
    """update_scale took its verdict by truthiness: None (a verdict never computed) counted as a clean iteration and
    grew the scale, "no" as an overflow that backed it off. A bool, numpy's bool or a one-element tensor stays valid."""
    import numpy as np

    from ampkit.compat.fp16_utils import DynamicLossScaler

    scaler = DynamicLossScaler(init_scale=4.0, scale_window=1)
    for bad in (None, "no"):
        with pytest.raises(TypeError, match=rf"^overflow must be a bool or a one-element tensor, got {bad!r}"):
            scaler.update_scale(bad)
    assert scaler.loss_scale == 4.0
    scaler.update_scale(torch.tensor(True))
    scaler.update_scale(np.bool_(True))
    assert scaler.loss_scale == 1.0


def test_stand_alone_loss_scalers_follow_apex_rules():
    """Apex's fp16_utils.DynamicLossScaler: 2**32 first, divided by scale_factor on an overflow (floor 1),
    multiplied after scale_window clean iterations; LossScaler is static and never sees an overflow."""
    from ampkit.compat.fp16_utils import DynamicLossScaler, LossScaler

    scaler = DynamicLossScaler(scale_window=3)
    assert scaler.loss_scale == 2.0**32
    weight = torch.nn.Parameter(torch.ones(2))
    trace = []
    for overflow in (True, False, False, False, False, False, True):
        weight.grad = torch.tensor([float("inf") if overflow else 1.0, 0.0])
        seen = scaler.has_overflow([weight])
        assert seen == overflow
        scaler.update_scale(seen)
        trace.append(scaler.loss_scale)
    # back off; clean iterations 1, 2, 3 since the overflow grow it once (Apex counts from the overflow's index)
    assert trace == [2.0**31, 2.0**31, 2.0**31, 2.0**32, 2.0**32, 2.0**32, 2.0**31]
    tiny = DynamicLossScaler(init_scale=1.5)
    tiny.update_scale(True)
    assert tiny.loss_scale == 1  # never below 1
    static = LossScaler(128.0)
    weight.grad = torch.tensor([float("nan"), 0.0])
    assert not static.has_overflow([weight]) and static.loss_scale == 128.0
    static.update_scale(True)
    assert static.loss_scale == 128.0
    weight.grad = None
    LossScaler(4.0).backward((weight * 2).sum())  # backward of the scaled loss
    assert torch.equal(weight.grad, torch.full((2,), 8.0))


def test_scale_gradient_as_a_backward_hook_scales_the_input_gradients():
    """Apex's scalers also scale by hook: ``module.register_full_backward_hook(scaler.scale_gradient)`` multiplies
    the gradient flowing out of the module to its input by the current scale."""
    from ampkit.compat.fp16_utils import DynamicLossScaler, LossScaler

    for scaler, scale in ((LossScaler(4.0), 4.0), (DynamicLossScaler(init_scale=8.0), 8.0)):
        layer = torch.nn.Linear(2, 2)
        layer.register_full_backward_hook(scaler.scale_gradient)
        x = torch.ones(1, 2, requires_grad=True)
        layer(x).sum().backward()
        assert torch.allclose(x.grad, scale * layer.weight.detach().sum(0, keepdim=True))


def test_a_flat_master_that_is_not_true_or_false_is_named():
    """``flat_master="False"`` was read as True: one flat fp32 master came back, and the optimizer built on it stepped
    a single parameter the rest of the script did not expect."""
    model = torch.nn.Linear(3, 2).half()
    with pytest.raises(ValueError, match="prep_param_lists: flat_master must be True or False, got 'False'"):
        prep_param_lists(model, flat_master="False")
    model_params, master_params = prep_param_lists(model, flat_master=0)
    assert len(master_params) == len(model_params) == 2
    for copier in (model_grads_to_master_grads, master_params_to_model_params):
        with pytest.raises(ValueError, match=rf"{copier.__name__}: flat_master must be True or False, got 'no'"):
            copier(model_params, master_params, flat_master="no")


def _frozen_then_unfrozen(wrapped: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    if wrapped:
        model = model.half()
    for param in model[0].parameters():
        param.requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if wrapped:
        optimizer = FP16_Optimizer(optimizer, static_loss_scale=128.0, verbose=False)
    generator = torch.Generator().manual_seed(2)
    for step in range(4):
        if step == 2:
            for param in model[0].parameters():
                param.requires_grad_(True)
        x = torch.randn(16, 8, generator=generator)
        loss = F.mse_loss(model(x.half() if wrapped else x).float(), x.sum(1, keepdim=True))
        optimizer.zero_grad()
        if wrapped:
            optimizer.backward(loss)
        else:
            loss.backward()
        optimizer.step()
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def test_a_param_frozen_when_wrapped_and_unfrozen_later_trains_through_a_master():
    """FP16_Optimizer took the trainable params when it was built: a layer unfrozen later never trained (Apex's
    stepped it in fp16 on its scaled gradients)."""
    torch.testing.assert_close(_frozen_then_unfrozen(True), _frozen_then_unfrozen(False), atol=2e-3, rtol=0)
