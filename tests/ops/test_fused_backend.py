"""The fused optimizers' backend choice (``auto | torch | ampkit``): routed buckets are bit-identical to
``torch.optim``'s fused forms (plain, under GradScaler with overflowing first steps, in the Trainer), ineligible
buckets and Apex's classes stay on ampkit's kernels, and a bad choice is named."""

from __future__ import annotations

import pytest
import torch
from toy_trainers import ToyTrainer, toy_cfg

from ampkit.compat import optimizers as apex_optimizers
from ampkit.ops import _backend
from ampkit.ops.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedSGD

# Odd sizes, a one-element tensor and a transposed (non-contiguous) parameter.
SHAPES = [(7, 13), (29,), (3, 5, 4), (1,)]

# name: (ampkit factory taking params and backend, torch.optim's fused form)
ROUTED = {
    "adamw": (
        lambda p, b: FusedAdam(p, lr=1e-2, weight_decay=0.01, backend=b),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01, fused=True),
    ),
    "adam_l2_amsgrad": (
        lambda p, b: FusedAdam(p, lr=1e-2, weight_decay=0.01, adam_w_mode=False, amsgrad=True, backend=b),
        lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.01, amsgrad=True, fused=True),
    ),
    "adam_maximize": (
        lambda p, b: FusedAdam(p, lr=1e-2, maximize=True, backend=b),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0, maximize=True, fused=True),
    ),
    "sgd_nesterov_wd": (
        lambda p, b: FusedSGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, backend=b),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, fused=True),
    ),
    "sgd_dampening": (
        lambda p, b: FusedSGD(p, lr=0.05, momentum=0.9, dampening=0.5, backend=b),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.5, fused=True),
    ),
    "sgd_plain": (
        lambda p, b: FusedSGD(p, lr=0.05, backend=b),
        lambda p: torch.optim.SGD(p, lr=0.05, fused=True),
    ),
    "adagrad": (
        lambda p, b: FusedAdagrad(p, lr=0.05, lr_decay=1e-3, weight_decay=1e-3, backend=b),
        lambda p: torch.optim.Adagrad(p, lr=0.05, lr_decay=1e-3, weight_decay=1e-3, fused=True),
    ),
}


@pytest.fixture(autouse=True)
def kernel_mode(monkeypatch):
    monkeypatch.setenv("AMPKIT_OPS", "kernel")
    monkeypatch.delenv(_backend.ENV_VAR, raising=False)


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    params.append(torch.nn.Parameter(torch.randn(6, 5, generator=g).t()))
    return params


def twin(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def grad_sequence(params, steps, seed=1):
    """Gradients in their parameter's layout, as autograd makes them (torch's fused CPU ops misread a gradient
    whose strides differ from its parameter's; ampkit copies such a gradient first)."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.empty_like(p).copy_(torch.randn(p.shape, generator=g)) for p in params] for _ in range(steps)]


def kernels_called(monkeypatch):
    """Which kernels a step runs: names of torch's fused ops called, recorded through wrappers."""
    called = []
    for name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, _name=name, **k: (called.append(_name), _real(*a, **k)))
    return called


@pytest.mark.parametrize("case", list(ROUTED))
def test_backend_torch_is_bit_identical_to_torch_optim_fused_over_100_steps(case):
    make, make_torch = ROUTED[case]
    ours = make_params()
    theirs = twin(ours)
    opt, torch_opt = make(ours, "torch"), make_torch(theirs)
    for grads in grad_sequence(ours, 100):
        for p, q, g in zip(ours, theirs, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        torch_opt.step()
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
    for p, q in zip(ours, theirs, strict=True):  # the state too: a checkpoint moves either way
        for key, value in torch_opt.state[q].items():
            assert torch.equal(opt.state[p][key], value), key


@pytest.mark.parametrize("case", list(ROUTED))
def test_backend_ampkit_and_cpu_auto_run_ampkit_kernels_close_to_torch(case, monkeypatch):
    make, make_torch = ROUTED[case]
    called = kernels_called(monkeypatch)
    ours = make_params()
    auto, theirs = twin(ours), twin(ours)
    opt, auto_opt, torch_opt = make(ours, "ampkit"), make(auto, None), make_torch(theirs)
    for grads in grad_sequence(ours, 100):
        for p, a, q, g in zip(ours, auto, theirs, grads, strict=True):
            p.grad, a.grad, q.grad = g.clone(), g.clone(), g.clone()
        opt.step()
        auto_opt.step()
        torch_opt.step()
    assert set(called) <= {"_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"}
    assert len(called) == 100  # torch's own optimizer only: neither ampkit optimizer routed a bucket
    for p, a, q in zip(ours, auto, theirs, strict=True):
        assert torch.equal(p, a)  # auto on the CPU keeps ampkit's kernel for a small plain step
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)


def scaled_grads(params, grads, scale, overflow):
    for p, g in zip(params, grads, strict=True):
        p.grad = g * scale
        if overflow:
            p.grad[(0,) * p.grad.dim()] = float("inf")


@pytest.mark.parametrize("backend", ["torch", "ampkit"])
@pytest.mark.parametrize("case", list(ROUTED))
def test_grad_scaler_with_overflowing_first_steps_equals_torch_stepped_only_on_finite_steps(case, backend):
    """The first two steps overflow (the scaler backs off; torch's fused SGD corrupts its momentum then): each
    routed optimizer must end where torch's fused form ends when it is stepped on the finite steps only. Routed,
    bit for bit; on ampkit's kernels, to rounding."""
    make, make_torch = ROUTED[case]
    ours = make_params()
    theirs = twin(ours)
    opt, torch_opt = make(ours, backend), make_torch(theirs)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    for i, grads in enumerate(grad_sequence(ours, 100)):
        scaler.scale(torch.ones(()))  # creates the scale tensor, as scaling a loss would
        scaled_grads(ours, grads, scaler.get_scale(), overflow=i < 2 or i == 50)
        before = [p.detach().clone() for p in ours]
        scaler.step(opt)
        scaler.update()
        if i < 2 or i == 50:
            assert all(torch.equal(p, b) for p, b in zip(ours, before, strict=True))
            continue
        for p, q, g in zip(ours, theirs, grads, strict=True):
            assert torch.equal(p.grad, g), "grads are left unscaled after a step"
            q.grad = g.clone()
        torch_opt.step()
    for p, q in zip(ours, theirs, strict=True):
        if backend == "torch":
            assert torch.equal(p, q)
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    for s in opt.state.values():
        for value in s.values():
            assert torch.isfinite(value).all()


@pytest.mark.parametrize("case", ["adamw", "adagrad"])
def test_grad_scaler_routed_matches_torch_fused_under_the_same_scaler(case):
    """Adam and Adagrad honour found_inf correctly in torch too: the same scaler sequence ends bit-identical."""
    make, make_torch = ROUTED[case]
    ours = make_params()
    theirs = twin(ours)
    opt, torch_opt = make(ours, "torch"), make_torch(theirs)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3) for _ in range(2)]
    for i, grads in enumerate(grad_sequence(ours, 30)):
        for params, o, scaler in ((ours, opt, scalers[0]), (theirs, torch_opt, scalers[1])):
            scaler.scale(torch.ones(()))
            scaled_grads(params, grads, scaler.get_scale(), overflow=i < 2)
            scaler.step(o)
            scaler.update()
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["step"], torch_opt.state[q]["step"])


HALF, FP32 = torch.float16, torch.float32


@pytest.mark.parametrize(
    ("make", "dtype"),
    [
        pytest.param(lambda p: FusedAdam(p, lr=1e-2, master_weights=True, backend="torch"), HALF, id="adam-masters"),
        pytest.param(lambda p: FusedAdam(p, lr=1e-2, backend="torch"), HALF, id="adam-fp32-state-of-half-params"),
        pytest.param(
            lambda p: FusedAdam(p, bias_correction=False, backend="torch"), FP32, id="adam-no-bias-correction"
        ),
        pytest.param(lambda p: FusedSGD(p, momentum=0.9, fp32_momentum=True, backend="torch"), HALF, id="sgd-fp32-buf"),
        pytest.param(
            lambda p: FusedSGD(p, lr=0.1, momentum=0.9, weight_decay=0.1, wd_after_momentum=True, backend="torch"),
            FP32,
            id="sgd-wd-after-momentum",
        ),
        pytest.param(
            lambda p: FusedAdagrad(p, lr=0.1, weight_decay=0.1, adagrad_w_mode=True, backend="torch"),
            FP32,
            id="adagrad-w-mode",
        ),
        pytest.param(lambda p: FusedAdagrad(p, lr=0.1, backend="torch"), HALF, id="adagrad-fp32-state-of-half-params"),
        pytest.param(lambda p: apex_optimizers.FusedAdam(p, lr=1e-2, backend="torch"), FP32, id="apex-group-steps"),
    ],
)
def test_ineligible_buckets_stay_on_ampkit_kernels(make, dtype, monkeypatch):
    called = kernels_called(monkeypatch)
    params = [torch.nn.Parameter(torch.randn(5, 3).to(dtype)), torch.nn.Parameter(torch.randn(4).to(dtype))]
    opt = make(params)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    assert called == []


def test_folded_clip_factor_stays_on_ampkit_kernel(monkeypatch):
    from ampkit.ops.pipeline import fused_unscale_clip_step_

    called = kernels_called(monkeypatch)
    params = make_params()
    opt = FusedAdam(params, lr=1e-2, backend="torch")
    for p in params:
        p.grad = torch.randn_like(p) * 8
    fused_unscale_clip_step_(opt, 1 / 8, max_norm=0.1)  # the factor inv_scale * clip goes into ampkit's kernel
    assert called == []
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert called == ["_fused_adamw_"]


@pytest.mark.parametrize("case", ["adamw", "sgd_nesterov_wd", "adagrad"])
def test_routed_gradient_in_another_layout_is_read_by_element(case):
    make, _ = ROUTED[case]
    params = make_params()
    same_layout = twin(params)
    opt, twin_opt = make(params, "torch"), make(same_layout, "torch")
    for grads in grad_sequence(params, 3):
        for p, q, g in zip(params, same_layout, grads, strict=True):
            p.grad, q.grad = g.contiguous(), g.clone()
        opt.step()
        twin_opt.step()
    for p, q in zip(params, same_layout, strict=True):
        assert torch.equal(p, q)


def test_cpu_auto_routes_a_large_adam_bucket_under_a_grad_scale(monkeypatch):
    called = kernels_called(monkeypatch)
    monkeypatch.setattr(FusedAdam, "_cpu_scaled_torch_from", 100)
    small, large = [torch.nn.Parameter(torch.randn(9))], [torch.nn.Parameter(torch.randn(10, 10))]
    for params in (small, large):
        opt = FusedAdam(params, lr=1e-2)
        params[0].grad = torch.randn_like(params[0])
        opt.step()  # a plain step: ampkit's kernel at any size
        params[0].grad = torch.randn_like(params[0])
        opt.step(grad_scale=torch.ones(()), found_inf=torch.zeros(()))
    assert called == ["_fused_adamw_"]


def test_backend_keyword_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv(_backend.ENV_VAR, "torch")
    called = kernels_called(monkeypatch)
    params = make_params()
    assert FusedSGD(params, lr=0.1).backend == "torch"
    opt = FusedSGD(params, lr=0.1, backend="ampkit")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert called == []
    FusedSGD(params, lr=0.1).step()
    assert called == ["_fused_sgd_"]
    assert FusedLAMB(params).backend == "torch"  # accepted everywhere; LAMB has no torch op and runs ampkit's


def test_bad_backend_is_named_with_the_valid_choices(monkeypatch):
    params = make_params()
    with pytest.raises(
        ValueError, match=r"FusedAdam\(backend=...\): invalid fused backend 'cuda'; expected one of auto, torch, ampkit"
    ):
        FusedAdam(params, backend="cuda")
    monkeypatch.setenv(_backend.ENV_VAR, "Torch")
    with pytest.raises(ValueError, match=r"AMPKIT_FUSED_BACKEND: invalid fused backend 'Torch'; expected one of"):
        FusedSGD(params)


def test_torch_fused_op_availability_is_read_from_the_dispatcher():
    assert _backend.torch_has_fused_op("_fused_adamw_", "cpu")
    assert not _backend.torch_has_fused_op("_fused_adamw_", "meta-device-that-does-not-exist")
    assert not _backend.torch_has_fused_op("_fused_lamb_", "cpu")


class _FusedAdamToy(ToyTrainer):
    optimizer_factory = None

    def configure_model(self):
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def configure_optimizers(self):
        return type(self).optimizer_factory(self.module.parameters())

    def val_dataloader(self):
        return None


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        pytest.param(
            lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.01, backend="torch"),
            lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01, fused=True),
            id="adamw",
        ),
        pytest.param(
            lambda p: FusedSGD(p, lr=0.05, momentum=0.9, backend="torch"),
            lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
            id="sgd",
        ),
        pytest.param(
            lambda p: FusedAdagrad(p, lr=0.05, backend="torch"),
            lambda p: torch.optim.Adagrad(p, lr=0.05, fused=True),
            id="adagrad",
        ),
    ],
)
def test_in_the_trainer_with_fp16_overflows_routed_equals_torch_fused(tmp_path, ours, theirs):
    """The Trainer's fp16 loss scaling with an initial scale that overflows: routed optimizers end bit-identical
    to torch's fused forms run by the same Trainer (which never hands them a skipped step)."""
    finals = []
    for index, factory in enumerate((ours, theirs)):
        torch.manual_seed(0)
        trainer_class = type("Toy", (_FusedAdamToy,), {"optimizer_factory": staticmethod(factory)})
        overrides = {
            "trainer.max_steps": 100,
            "trainer.seed": 0,
            "precision.opt_level": "O1",
            "precision.dtype": "float16",
            "precision.init_scale": 2.0**24,
            "logging.tensorboard": False,
            "checkpoint.enabled": False,
        }
        trainer = trainer_class(toy_cfg(tmp_path / str(index), **overrides))
        trainer.fit()
        assert trainer.optimizer_state[trainer.optimizer].skipped_steps >= 1
        finals.append([p.detach().clone() for p in trainer.module.parameters()])
    for a, b in zip(*finals, strict=True):
        assert torch.equal(a, b)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")


@needs_cuda
@pytest.mark.parametrize("case", ["adamw", "adam_l2_amsgrad", "sgd_nesterov_wd", "sgd_dampening", "sgd_plain"])
def test_cuda_auto_is_torch_fused_bit_for_bit_with_no_host_read(case):
    """On a GPU ``auto`` routes to torch's fused op: the same scaler sequence (overflowing first steps) ends
    bit-identical to torch's fused form stepped on the finite steps, and a step under GradScaler syncs nothing."""
    make, make_torch = ROUTED[case]
    ours = [torch.nn.Parameter(p.detach().cuda()) for p in make_params()]
    theirs = twin(ours)
    opt, torch_opt = make(ours, None), make_torch(theirs)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16, growth_interval=3)
    for i, grads in enumerate(grad_sequence(ours, 100)):
        scaler.scale(torch.ones((), device="cuda"))
        skipped = i < 2 or i == 50
        scaled_grads(ours, grads, scaler.get_scale(), overflow=skipped)
        opt.grad_scale, opt.found_inf = scaler._scale, torch.full((), float(skipped), device="cuda")
        if i >= 3:
            torch.cuda.set_sync_debug_mode("error")  # any device-to-host read raises
        opt.step()
        torch.cuda.set_sync_debug_mode("default")
        if not skipped:  # torch's own GradScaler path: scaled grads, unscaled inside its kernel (CUDA's SGD kernel
            # rounds that unscale differently from a pre-unscaled gradient, by an ulp, so both sides take it)
            scaled_grads(theirs, grads, scaler.get_scale(), overflow=False)
            torch_opt.grad_scale, torch_opt.found_inf = scaler._scale, torch.zeros((), device="cuda")
            torch_opt.step()
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)


# ----------------------------------------------------------------- buckets kept between steps


def _step_all(opt, params, grads):
    for p, g in zip(params, grads, strict=True):
        p.grad = None if g is None else g.clone()
    opt.step()


@pytest.mark.parametrize("backend", ["ampkit", "torch"])
def test_cached_buckets_follow_every_change_between_steps(backend):
    """Gradients that come and go, change layout or dtype, a parameter swapped in the group, a group added and
    a state dict loaded: the optimizer that keeps its buckets ends where one rebuilt from scratch each step ends."""
    torch.manual_seed(0)
    shapes = [(4, 6), (5,), (3, 3)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = twin(ours)
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.01, backend=backend)
    rebuilt = FusedAdam(theirs, lr=1e-2, weight_decay=0.01, backend=backend)
    rebuilt._plans = _NeverKeeps()

    def both(grads):
        _step_all(opt, ours, grads)
        _step_all(rebuilt, theirs, grads)

    def grads_like(params):
        return [torch.randn_like(p) for p in params]

    for _ in range(3):
        both(grads_like(ours))
    both([None, *grads_like(ours[1:])])  # a parameter without a gradient
    both(grads_like(ours))
    transposed = torch.randn(6, 4).t()  # a gradient in another layout than its parameter
    both([transposed, *grads_like(ours[1:])])
    both(grads_like(ours))
    swapped = torch.randn(5)
    for optimizer, value in ((opt, ours), (rebuilt, theirs)):
        new = torch.nn.Parameter(swapped.clone())
        optimizer.state.pop(optimizer.param_groups[0]["params"][1])
        optimizer.param_groups[0]["params"][1] = new  # a parameter swapped in the same list
        value[1] = new
    both(grads_like(ours))
    extra_ours, extra_theirs = torch.nn.Parameter(torch.ones(7)), torch.nn.Parameter(torch.ones(7))
    opt.add_param_group({"params": [extra_ours]})
    rebuilt.add_param_group({"params": [extra_theirs]})
    ours.append(extra_ours)
    theirs.append(extra_theirs)
    both(grads_like(ours))
    saved = rebuilt.state_dict()
    opt.load_state_dict(saved)
    both(grads_like(ours))
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
    assert opt._plans  # the cache was in use, not bypassed


class _NeverKeeps(dict):
    """A plan store that forgets every plan: the optimizer rebuilds its buckets each step."""

    def __setitem__(self, key, value):
        pass


@pytest.mark.parametrize("copy_with", ["deepcopy", "pickle"])
def test_a_copied_optimizer_keeps_its_options(copy_with):
    import copy
    import pickle

    params = make_params()
    opt = FusedSGD(params, lr=0.1, momentum=0.9, fp32_momentum=True, backend="torch")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    clone = copy.deepcopy(opt) if copy_with == "deepcopy" else pickle.loads(pickle.dumps(opt))
    assert (clone.backend, clone.fp32_momentum, clone.master_weights) == ("torch", True, False)
    assert clone._plans == {}


def test_loading_a_state_dict_lets_the_replaced_state_go():
    import gc
    import weakref

    params = make_params()
    opt = FusedAdam(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    old_moment = weakref.ref(opt.state[params[0]]["exp_avg"])
    opt.load_state_dict(FusedAdam(twin(params), lr=1e-2).state_dict())
    gc.collect()
    assert old_moment() is None
