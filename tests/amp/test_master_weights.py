"""O2 master weights: fp32 masters in the optimizer, copy back after the step, bit-exact resume."""

import pytest
import torch
from torch import nn

from ampkit.amp.casting import add_boundary_casts, cast_model
from ampkit.amp.grad_combine import GradientCombiner, read_flags
from ampkit.amp.master_weights import MasterWeights
from ampkit.amp.scaler import LossScaler

DTYPES = [torch.float16, torch.bfloat16]


def build(dtype, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    cast_model(model, dtype, keep_batchnorm_fp32=True)
    add_boundary_casts(model, dtype, torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    masters = MasterWeights(optimizer)
    return model, optimizer, masters


@pytest.mark.parametrize("dtype", DTYPES)
def test_masters_live_in_the_optimizer(dtype):
    model, optimizer, masters = build(dtype)
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    assert all(p.dtype == torch.float32 for p in opt_params)
    assert opt_params == masters.master_params
    assert masters.model_params == list(model.parameters())
    low = [(p, m) for p, m in zip(masters.model_params, masters.master_params, strict=True) if p is not m]
    assert len(low) == 4  # the two Linear layers; BatchNorm stayed fp32 and is its own master
    assert all(torch.equal(m, p.float()) for p, m in low)


def test_a_group_repeating_a_parameter_that_has_a_master_is_refused_at_refresh():
    """A group added by hand with a low-precision parameter that already has its master (the optimizer holds the
    master, so torch saw no repeat) would get a second master, the two updates overwriting each other."""
    model, optimizer, masters = build(torch.float16)
    optimizer.add_param_group({"params": [model[0].weight]})
    with pytest.raises(ValueError, match=r"more than one parameter group: params\[0\] \(shape \(8, 6\)\)"):
        masters.refresh()
    assert len(masters.master_params) == len(list(model.parameters()))


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_step_updates_masters_then_model(dtype, flat):
    model, _, masters = build(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    masters = MasterWeights(optimizer)
    combiner = GradientCombiner(masters.model_params, masters.master_params, flat=flat)
    scaler = LossScaler(init_scale=2.0**8)
    before = [m.detach().clone() for m in masters.master_params]
    combiner.prepare_backward()
    scaler.scale_loss(model(torch.randn(4, 6)).square().mean()).backward()
    result = combiner.combine(scaler)
    assert read_flags([result.found_inf]) == [False]
    grads = [m.grad.clone() for m in masters.master_params]
    assert all(g.dtype == torch.float32 for g in grads)
    optimizer.step()
    masters.copy_to_model()
    for p, m, b, g in zip(masters.model_params, masters.master_params, before, grads, strict=True):
        torch.testing.assert_close(m, b - 0.5 * g, rtol=0, atol=0)
        assert torch.equal(p, m.to(p.dtype))


def train(model, optimizer, masters, combiner, scaler, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 6, generator=gen)
        combiner.zero_grad()
        combiner.prepare_backward()
        scaler.scale_loss(model(x).square().mean()).backward()
        found = combiner.combine(scaler).found_inf
        if not read_flags([found])[0]:
            optimizer.step()
            masters.copy_to_model()
        scaler.update(found)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_checkpoint_round_trip_continues_bit_identically(dtype, flat):
    model, optimizer, masters = build(dtype)
    scaler = LossScaler(init_scale=2.0**4, growth_interval=2)
    combiner = GradientCombiner(masters.model_params, masters.master_params, flat=flat)
    train(model, optimizer, masters, combiner, scaler, 3, seed=1)
    checkpoint = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "masters": masters.state_dict(),
        "scaler": scaler.state_dict(),
    }
    checkpoint = torch.load(_round_trip(checkpoint), weights_only=True)
    train(model, optimizer, masters, combiner, scaler, 3, seed=2)

    model2, optimizer2, masters2 = build(dtype, seed=7)  # different init: everything must come from the file
    model2.load_state_dict(checkpoint["model"])
    optimizer2.load_state_dict(checkpoint["optimizer"])
    masters2.load_state_dict(checkpoint["masters"])
    scaler2 = LossScaler(init_scale=2.0**4, growth_interval=2)
    scaler2.load_state_dict(checkpoint["scaler"])
    combiner2 = GradientCombiner(masters2.model_params, masters2.master_params, flat=flat)
    train(model2, optimizer2, masters2, combiner2, scaler2, 3, seed=2)

    assert scaler2.state_dict() == scaler.state_dict()
    for a, b in zip(masters.master_params, masters2.master_params, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_loaded_masters_are_what_the_model_computes_with(dtype):
    """A checkpoint's masters restored (Apex's FP16_Optimizer state loaded without the model's, say) go into the
    model at once: left stale, the model's forwards ran on its old weights until the first step overwrote them."""
    _, _, saved = build(dtype, seed=0)
    model, _, masters = build(dtype, seed=7)
    masters.load_state_dict(saved.state_dict())
    low = [(p, m) for p, m in zip(masters.model_params, masters.master_params, strict=True) if p is not m]
    assert len(low) == 4
    for (p, m), s in zip(low, saved.state_dict()["master_params"], strict=True):
        assert torch.equal(m, s) and torch.equal(p, s.to(dtype))


def _round_trip(obj):
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def test_refresh_after_add_param_group_and_state_moves():
    """A parameter added later gets its master with what it had: its gradient, its requires_grad, and the optimizer
    state kept under it (a loaded checkpoint's), which would otherwise sit under a tensor the optimizer never steps."""
    model, optimizer, masters = build(torch.float16)
    extra = nn.Parameter(torch.ones(3, dtype=torch.float16))
    extra.grad = torch.full((3,), 0.5, dtype=torch.float16)
    frozen = nn.Parameter(torch.ones(2, dtype=torch.float16), requires_grad=False)
    optimizer.add_param_group({"params": [extra, frozen]})
    optimizer.state[extra] = {"exp_avg": torch.full((3,), 0.25)}
    masters.refresh()
    (extra_model, frozen_model), (master, frozen_master) = masters.model_params[-2:], masters.master_params[-2:]
    assert extra_model is extra and frozen_model is frozen and master.dtype == frozen_master.dtype == torch.float32
    stepped = optimizer.param_groups[-1]["params"]
    assert stepped[0] is master and stepped[1] is frozen_master
    assert master.grad.dtype == torch.float32 and torch.equal(master.grad, torch.full((3,), 0.5))
    assert master.requires_grad and not frozen_master.requires_grad
    assert extra not in optimizer.state and torch.equal(optimizer.state[master]["exp_avg"], torch.full((3,), 0.25))


def test_load_state_dict_errors():
    _, _, masters = build(torch.float16)
    with pytest.raises(KeyError, match="master_params"):
        masters.load_state_dict({})
    with pytest.raises(ValueError, match="checkpoint holds 1 master weights but the optimizer has 4"):
        masters.load_state_dict({"master_params": [torch.zeros(1)]})
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        MasterWeights([torch.zeros(1)])
    sgd = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    with pytest.raises(TypeError, match="^frozen_masters must be True or False, got an integer of 5001 digits$"):
        MasterWeights(sgd, frozen_masters=10**5000)  # its repr() raised inside the message, naming neither


def test_a_refused_load_leaves_every_master_as_it_was():
    """A state whose last master has the wrong shape (or is no tensor) is refused before any master is copied: the
    loop copied the first ones, so the masters no longer matched the model they had trained."""
    _, _, masters = build(torch.float16)
    before = [m.clone() for m in masters.master_params]
    for last in (torch.zeros(2), [0.0]):
        state = {"master_params": [torch.full_like(m, 7.0) for m in masters._low_masters[:-1]] + [last]}
        with pytest.raises(ValueError, match=r"master_params\[3\] is (shape \(2,\)|a list), expected a tensor"):
            masters.load_state_dict(state)
        assert all(torch.equal(m, b) for m, b in zip(masters.master_params, before, strict=True))


def _frozen_first_layer_adam() -> tuple[nn.Module, torch.optim.Optimizer, MasterWeights]:
    """An fp16 model whose first layer is frozen, all of it in one Adam, with masters only for what trains."""
    model, _, _ = build(torch.float16)
    model[0].requires_grad_(False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optimizer, MasterWeights(optimizer, frozen_masters=False)


def test_a_frozen_parameter_with_optimizer_state_gets_its_saved_master_back_in_fp32():
    """A layer frozen after it trained has Adam state (fp32, as its master held it): a load that left it without its
    master put that state on the fp16 parameter, rounded, so a resume unfreezing it later was not bit-identical. Its
    saved master may hold no bits below fp16; the state says it trained."""
    model, optimizer, masters = _frozen_first_layer_adam()
    weight = model[0].weight
    assert optimizer.param_groups[0]["params"][0] is weight  # no master while frozen
    exp_avg = torch.full(weight.shape, 1e-5)  # as the Trainer's load before the cast leaves it: fp32
    optimizer.state[weight] = {"step": torch.tensor(3.0), "exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg.square()}
    saved = [None if m is None else m.clone() for m in masters.state_dict()["master_params"]]
    saved[0] = weight.detach().float()  # exactly its fp16 value
    masters.load_state_dict({"master_params": saved})
    master = optimizer.param_groups[0]["params"][0]
    assert master is not weight and master.dtype == torch.float32 and not master.requires_grad
    assert weight not in optimizer.state and torch.equal(optimizer.state[master]["exp_avg"], exp_avg)
    assert masters.state_dict()["master_params"][1] is None  # the frozen bias never trained: still none


def test_a_parameter_unfrozen_takes_its_fp16_optimizer_state_to_its_master_in_fp32():
    """torch's load_state_dict casts state to its parameter's dtype: one left without a master while frozen holds it in
    fp16. Unfrozen, its master gets it in fp32, as an fp32 master's state is (torch's Adam refuses the mix)."""
    model, optimizer, masters = _frozen_first_layer_adam()
    weight = model[0].weight
    optimizer.state[weight] = {"step": torch.tensor(3.0), "exp_avg": torch.full(weight.shape, 0.5, dtype=torch.float16)}
    optimizer.state[weight]["exp_avg_sq"] = torch.full(weight.shape, 0.25, dtype=torch.float16)
    model[0].requires_grad_(True)
    assert masters.adopt_unfrozen() and not masters.adopt_unfrozen()
    master = optimizer.param_groups[0]["params"][0]
    state = optimizer.state[master]
    assert master.dtype == state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert state["step"].dtype == torch.float32 and torch.equal(state["exp_avg"], torch.full(weight.shape, 0.5))
    model(torch.randn(4, 6)).sum().backward()
    master.grad = weight.grad.float()
    optimizer.step()
    masters.copy_to_model()
    assert torch.equal(weight, master.half())
