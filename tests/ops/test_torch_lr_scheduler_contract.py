"""Every ``torch.optim.lr_scheduler`` class and ``torch.optim.swa_utils`` drive the fused optimizers as they drive
torch.optim's, under both implementations (the C++ kernels and the pure-PyTorch references): the same lrs and
momenta step by step, a scheduler's state_dict resumes, and the lr a scheduler sets is the one the next step uses."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from fused_optimizer_cases import OPTIMIZERS as FUSED_OPTIMIZERS
from torch.optim import lr_scheduler
from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn

from ampkit.ops.optimizers import FusedRMSpropTF

OPTIMIZERS = {name: make for name, make in FUSED_OPTIMIZERS.items() if name != "adam_l2"}
# timm's default puts lr inside the momentum buffer, which then moves weights at lr 0: off, so that a zero lr stops
# this optimizer as it stops the others.
OPTIMIZERS["rmsprop_tf"] = lambda p, **kw: FusedRMSpropTF(p, lr=1e-2, momentum=0.9, lr_in_momentum=False, **kw)
# Each scheduler class, built on an optimizer; CyclicLR and OneCycleLR also with momentum cycling, which needs
# ``momentum`` or ``betas`` in the optimizer's groups.
SCHEDULERS = {
    "LambdaLR": lambda o: lr_scheduler.LambdaLR(o, lambda epoch: 0.9**epoch),
    "MultiplicativeLR": lambda o: lr_scheduler.MultiplicativeLR(o, lambda epoch: 0.9),
    "StepLR": lambda o: lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: lr_scheduler.MultiStepLR(o, milestones=[1, 3]),
    "ConstantLR": lambda o: lr_scheduler.ConstantLR(o, factor=0.5, total_iters=2),
    "LinearLR": lambda o: lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3),
    "ExponentialLR": lambda o: lr_scheduler.ExponentialLR(o, gamma=0.9),
    "PolynomialLR": lambda o: lr_scheduler.PolynomialLR(o, total_iters=4, power=2.0),
    "CosineAnnealingLR": lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=4),
    "CosineAnnealingWarmRestarts": lambda o: lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=2),
    "CyclicLR": lambda o: lr_scheduler.CyclicLR(o, base_lr=1e-3, max_lr=1e-2, step_size_up=2, cycle_momentum=False),
    "CyclicLR_momentum": lambda o: lr_scheduler.CyclicLR(o, base_lr=1e-3, max_lr=1e-2, step_size_up=2),
    "OneCycleLR": lambda o: lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=10, cycle_momentum=False),
    "OneCycleLR_momentum": lambda o: lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=10),
    "SequentialLR": lambda o: lr_scheduler.SequentialLR(
        o, [lr_scheduler.LinearLR(o, 0.1, total_iters=2), lr_scheduler.ExponentialLR(o, 0.9)], milestones=[2]
    ),
    "ChainedScheduler": lambda o: lr_scheduler.ChainedScheduler(
        [lr_scheduler.ConstantLR(o, 0.5, total_iters=2), lr_scheduler.ExponentialLR(o, 0.9)]
    ),
    "ReduceLROnPlateau": lambda o: lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5),
}
CYCLES_MOMENTUM = ("CyclicLR_momentum", "OneCycleLR_momentum")
SHAPES = [(5, 4), (7,)]
# A scheduler warns when it steps before its optimizer did: it must see the fused optimizers' steps as torch.optim's.
pytestmark = pytest.mark.filterwarnings("error:Detected call of `lr_scheduler.step\\(\\)` before")


@pytest.fixture(params=["kernel", "reference"], autouse=True)
def ops_mode(request, monkeypatch):
    monkeypatch.setenv("AMPKIT_OPS", request.param)


def make_params():
    generator = torch.Generator().manual_seed(1)
    return [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in SHAPES]


def set_grads(params, step):
    generator = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)


def torch_twin(optimizer, params):
    """A torch.optim optimizer with the fused one's lr and its momentum or betas (what schedulers read and set)."""
    defaults = optimizer.defaults
    if "betas" in defaults:
        return torch.optim.Adam(params, lr=defaults["lr"], betas=defaults["betas"])
    return torch.optim.SGD(params, lr=defaults["lr"], momentum=defaults.get("momentum", 0.0))


def scheduler_step(scheduler, epoch):
    if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
        scheduler.step(1.0)  # no improvement: the lr is cut after every epoch
    else:
        scheduler.step()


def schedule(optimizer):
    group = optimizer.param_groups[0]
    return group["lr"], group.get("momentum"), group.get("betas")


def cases():
    for name in OPTIMIZERS:
        for scheduler in SCHEDULERS:
            has_momentum = name not in ("adagrad", "adadelta")
            if scheduler not in CYCLES_MOMENTUM or has_momentum:
                yield name, scheduler


@pytest.mark.parametrize(("name", "scheduler"), list(cases()))
def test_a_scheduler_sets_the_lrs_and_momenta_it_sets_on_torch_optim_and_resumes_from_its_state_dict(name, scheduler):
    make, make_scheduler = OPTIMIZERS[name], SCHEDULERS[scheduler]
    params = make_params()
    optimizer = make(params)
    twin = torch_twin(optimizer, make_params())
    scheduled, twin_scheduled = make_scheduler(optimizer), make_scheduler(twin)
    for epoch in range(4):
        set_grads(params, epoch)
        optimizer.step()
        twin.step()  # no gradients: only the lr and momenta are compared
        scheduler_step(scheduled, epoch)
        scheduler_step(twin_scheduled, epoch)
        assert schedule(optimizer)[0] == schedule(twin)[0]
        assert schedule(optimizer)[1:] in ((schedule(twin)[1], None), (None, schedule(twin)[2]))
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = make(resumed_params)
    resumed_scheduler = make_scheduler(resumed)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    resumed_scheduler.load_state_dict(copy.deepcopy(scheduled.state_dict()))
    for epoch in range(4, 7):
        for p_params, o, s in ((params, optimizer, scheduled), (resumed_params, resumed, resumed_scheduler)):
            set_grads(p_params, epoch)
            o.step()
            scheduler_step(s, epoch)
        assert schedule(resumed) == schedule(optimizer)
    torch.testing.assert_close(resumed_params, params, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["adagrad", "adadelta"])
@pytest.mark.parametrize("scheduler", CYCLES_MOMENTUM)
def test_momentum_cycling_on_an_optimizer_without_momentum_is_refused_as_torch_refuses_it(name, scheduler):
    torch_class = {"adagrad": torch.optim.Adagrad, "adadelta": torch.optim.Adadelta}[name]
    with pytest.raises(ValueError, match="momentum") as theirs:
        SCHEDULERS[scheduler](torch_class(make_params()))
    with pytest.raises(ValueError, match="momentum") as ours:
        SCHEDULERS[scheduler](OPTIMIZERS[name](make_params()))
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_lr_a_scheduler_sets_is_the_one_the_next_step_uses(name):
    """The kept buckets of a step (rebuilt only when parameters or gradients change) must not keep an lr: a
    scheduler's zero lr stops every weight from the next step on, and its lr back moves them again."""
    params = make_params()
    optimizer = OPTIMIZERS[name](params)
    scheduled = lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.0 if epoch in (1, 2) else 1.0)
    moved = []
    for epoch in range(4):
        before = [p.detach().clone() for p in params]
        set_grads(params, epoch)
        optimizer.step()
        scheduled.step()
        moved.append(any(not torch.equal(p, b) for p, b in zip(params, before, strict=True)))
    assert moved == [True, False, False, True]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_scheduler_updates_a_tensor_lr_in_place_and_steps_as_with_the_number(name):
    params, twins = make_params(), make_params()
    lr = OPTIMIZERS[name](make_params()).defaults["lr"]
    with_tensor = OPTIMIZERS[name]([{"params": params, "lr": torch.tensor(lr)}])
    with_number = OPTIMIZERS[name](twins)
    tensor = with_tensor.param_groups[0]["lr"]
    schedulers = [lr_scheduler.CosineAnnealingLR(o, T_max=4) for o in (with_tensor, with_number)]
    for epoch in range(4):
        for p_params, optimizer, scheduled in zip((params, twins), (with_tensor, with_number), schedulers, strict=True):
            set_grads(p_params, epoch)
            optimizer.step()
            scheduled.step()
    assert with_tensor.param_groups[0]["lr"] is tensor
    torch.testing.assert_close(float(tensor), with_number.param_groups[0]["lr"])
    torch.testing.assert_close(params, twins)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_swa_and_ema_average_the_weights_the_optimizer_stepped_to_while_swalr_anneals_its_lr(name):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = OPTIMIZERS[name](model.parameters())
    swa, ema = AveragedModel(model), AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    annealing = SWALR(optimizer, swa_lr=0.005, anneal_epochs=2)
    twin = torch_twin(optimizer, [torch.nn.Parameter(torch.zeros(1))])
    twin_annealing = SWALR(twin, swa_lr=0.005, anneal_epochs=2)
    visited = []
    for _ in range(4):
        optimizer.zero_grad()
        model(torch.randn(4, 3)).square().sum().backward()
        optimizer.step()
        twin.step()
        annealing.step()
        twin_annealing.step()
        assert optimizer.param_groups[0]["lr"] == twin.param_groups[0]["lr"]
        swa.update_parameters(model)
        ema.update_parameters(model)
        visited.append([p.detach().clone() for p in model.parameters()])
    expected_ema = visited[0]  # the first update copies the weights; each later one blends in a tenth
    for weights in visited[1:]:
        expected_ema = [0.9 * e + 0.1 * w for e, w in zip(expected_ema, weights, strict=True)]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.005)
    for i, averaged in enumerate(swa.module.parameters()):
        torch.testing.assert_close(averaged, torch.stack([v[i] for v in visited]).mean(0))
    torch.testing.assert_close(list(ema.module.parameters()), expected_ema)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_an_optimizer_and_its_scheduler_are_freed_when_dropped_without_the_cycle_collector(name):
    """torch keeps optimizers and schedulers free of reference cycles, so a dropped one frees its state (the size of
    the model, twice for Adam) at once rather than at some later garbage collection: kept buckets must not add one."""

    def train_and_drop():
        params = make_params()
        optimizer = OPTIMIZERS[name](params)
        scheduled = lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0)
        set_grads(params, 0)
        optimizer.step()
        scheduled.step()
        return weakref.ref(optimizer), weakref.ref(scheduled)

    gc.collect()
    gc.disable()
    try:
        optimizer, scheduled = train_and_drop()
        assert optimizer() is None and scheduled() is None
    finally:
        gc.enable()
