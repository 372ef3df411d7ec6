"""Apex's first fused-optimizer API, as BERT fine-tuning scripts of 2019 (pytorch-pretrained-BERT's run_squad,
run_classifier) drove it: ``from apex.optimizers import FP16_Optimizer, FusedAdam``, ``FusedAdam(...,
bias_correction=False, max_grad_norm=1.0)`` wrapped in ``FP16_Optimizer(dynamic_loss_scale=True)`` around a
``model.half()``, then ``optimizer.backward(loss)``, the learning rate set in ``param_groups``, ``step()``,
``zero_grad()``. The update is checked against Apex's first kernel's formula, written out here in float64."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ampkit.compat import install_apex_shim, uninstall_apex_shim
from ampkit.compat.legacy_fused_adam import FP16_Optimizer, LegacyFusedAdam


@pytest.fixture
def shim():
    install_apex_shim()
    yield
    uninstall_apex_shim()


def first_kernel_step(p, m, v, g, *, lr, b1, b2, eps, scale, step, eps_inside_sqrt, bias_correction, decay):
    """Apex's first FusedAdam kernel on one tensor, in float64 (the tensors are updated in place)."""
    step_size = lr * math.sqrt(1 - b2**step) / (1 - b1**step) if bias_correction else lr
    g = g / scale
    m.mul_(b1).add_((1 - b1) * g)
    v.mul_(b2).add_((1 - b2) * g * g)
    denom = (v + eps).sqrt() if eps_inside_sqrt else v.sqrt() + eps
    p.sub_(step_size * (m / denom + decay * p))


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5, 1e6])
def test_the_update_is_the_first_kernels(bias_correction, eps_inside_sqrt, max_grad_norm):
    """Three steps with scaled fp16 gradients of fp32 params (non-contiguous, odd sizes), an fp16 copy written
    out, clipping folded into the scale: equal to the formula in float64 to float32 rounding."""
    torch.manual_seed(0)
    params = [torch.randn(7, 5).t(), torch.randn(13), torch.randn(1)]  # a transposed view among them
    hyper = dict(lr=1e-2, b1=0.8, b2=0.95, eps=1e-3, eps_inside_sqrt=eps_inside_sqrt, bias_correction=bias_correction,
                 decay=0.1)  # fmt: skip
    optimizer = LegacyFusedAdam(params, lr=hyper["lr"], betas=(hyper["b1"], hyper["b2"]), eps=hyper["eps"],
                                bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt, weight_decay=0.1,
                                max_grad_norm=max_grad_norm)  # fmt: skip
    ref = [p.double() for p in params]
    moments = [(torch.zeros_like(r), torch.zeros_like(r)) for r in ref]
    scale = 128.0
    for step in (1, 2, 3):
        grads = [(torch.randn_like(p) * scale).half() for p in params]
        copies = [torch.empty_like(p, dtype=torch.half) for p in params]
        norm = math.sqrt(sum(g.double().square().sum().item() for g in grads))
        combined = scale
        if max_grad_norm > 0 and (norm / scale + 1e-6) / max_grad_norm > 1:
            combined = scale * (norm / scale + 1e-6) / max_grad_norm
        optimizer.step(grads=grads, output_params=copies, scale=scale)  # the norm is computed when not given
        for r, (m, v), g in zip(ref, moments, grads, strict=True):
            first_kernel_step(r, m, v, g.double(), scale=combined, step=step, **hyper)
        for p, r, c in zip(params, ref, copies, strict=True):
            torch.testing.assert_close(p.double(), r, rtol=2e-6, atol=2e-7)
            assert torch.equal(c, p.half())
    assert [optimizer.state[p]["step"] for p in params] == [3, 3, 3]


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5])
def test_tensor_hyperparameters_are_read_once_a_group_a_step_and_step_as_their_numbers(max_grad_norm, monkeypatch):
    """Each parameter's update read the group's lr, betas, eps and weight decay again, and with tensor ones computed
    its step size in float32 (a read and a sync per tensor on a GPU): they are read once a group a step, as host
    numbers, and step exactly as those numbers, which the float64 formula matches."""
    from ampkit.compat import legacy_fused_adam

    hyper = dict(lr=2.0**-7, b1=0.75, b2=0.9375, eps=2.0**-10, decay=2.0**-4)  # exact in float32
    torch.manual_seed(0)
    start = [torch.randn(7, 5), torch.randn(13), torch.randn(1)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(3)]
    reads = []
    host_numbers = legacy_fused_adam.host_numbers
    monkeypatch.setattr(legacy_fused_adam, "host_numbers", lambda values: reads.append(values) or host_numbers(values))
    stepped = []
    for as_tensor in (True, False):
        number = torch.tensor if as_tensor else float
        params = [p.clone() for p in start]
        groups = [{"params": params[:2]}, {"params": params[2:], "lr": number(hyper["lr"] / 2)}]
        optimizer = LegacyFusedAdam(groups, lr=number(hyper["lr"]), betas=(number(hyper["b1"]), number(hyper["b2"])),
                                    eps=number(hyper["eps"]), weight_decay=number(hyper["decay"]),
                                    max_grad_norm=number(max_grad_norm))  # fmt: skip
        for step_grads in grads:
            optimizer.step(grads=[step_grads[:2], step_grads[2:]])  # one list a group
        stepped.append(params)
    assert len(reads) == 2 * 2 * 3  # twice (tensors, numbers) each group's values once a step, 3 steps
    assert all(torch.equal(a, b) for a, b in zip(*stepped, strict=True))
    ref = [p.double() for p in start]
    moments = [(torch.zeros_like(r), torch.zeros_like(r)) for r in ref]
    for step, step_grads in enumerate(grads, start=1):
        for index, (r, (m, v), g) in enumerate(zip(ref, moments, step_grads, strict=True)):
            in_group = step_grads[2:] if index == 2 else step_grads[:2]
            norm = math.sqrt(sum(x.double().square().sum().item() for x in in_group))
            clip = (norm + 1e-6) / max_grad_norm if max_grad_norm > 0 else 1.0
            group_hyper = {**hyper, "lr": hyper["lr"] / 2} if index == 2 else hyper
            first_kernel_step(r, m, v, g.double(), scale=max(clip, 1.0), step=step, eps_inside_sqrt=False,
                              bias_correction=True, **group_hyper)  # fmt: skip
    for p, r in zip(stepped[1], ref, strict=True):
        torch.testing.assert_close(p.double(), r, rtol=2e-6, atol=2e-7)


class _CountedGroup(dict):
    """A param group that counts the reads of its values by key (``group[key]``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reads: dict[str, int] = {}

    def __getitem__(self, key):
        self.reads[key] = self.reads.get(key, 0) + 1
        return super().__getitem__(key)


def test_no_group_value_is_read_per_parameter_in_a_step():
    """The step read the group's bias_correction again for each parameter's update: every group value is read a number
    of times that does not grow with the group's parameters."""
    reads = []
    for count in (1, 5):
        params = [torch.nn.Parameter(torch.randn(3)) for _ in range(count)]
        optimizer = LegacyFusedAdam(params, lr=1e-2, max_grad_norm=1.0)
        optimizer.param_groups = [_CountedGroup(group) for group in optimizer.param_groups]
        for p in params:
            p.grad = torch.randn(3)
        optimizer.step()
        reads.append({key: n for key, n in optimizer.param_groups[0].reads.items() if key != "params"})
    assert reads[0] == reads[1], reads


def test_grad_norms_given_per_group_are_used_for_clipping():
    """FP16_Optimizer hands each group's norm of the scaled grads: a given norm decides the clip, not p.grad."""
    p = torch.ones(4)
    optimizer = LegacyFusedAdam([p], lr=1.0, max_grad_norm=1.0, eps=0.0)
    g = torch.full((4,), 2.0)
    optimizer.step(grads=[g], scale=1.0, grad_norms=[torch.tensor(1e9)])  # clipped far down, then Adam's sign
    assert torch.allclose(p, torch.zeros(4), atol=1e-6)  # Adam's first step moves by lr whatever the grad size
    assert optimizer.state[p]["exp_avg"].abs().max() < 1e-6  # the moment saw the clipped gradient


def bert_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def bert_loop(model, optimizer, steps, start=0, overflow_at=None):
    """run_squad's fp16 loop: backward through the wrapper, warm-up learning rate set by hand, step, zero_grad."""
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(16, 8, generator=g) for _ in range(steps)]
    losses = []
    for i, x in enumerate(batches[start:], start):
        loss = (model(x.half()).float() - x.sum(1, keepdim=True)).pow(2).mean()
        if i == overflow_at:
            loss = loss * float("inf")
        optimizer.backward(loss)
        for group in optimizer.param_groups:
            group["lr"] = 5e-3 * min(1.0, (i + 1) / 4)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_bert_fp16_script_trains_skips_an_overflow_and_resumes_exactly(shim, capsys):
    from apex.optimizers import FP16_Optimizer as ApexFP16Optimizer
    from apex.optimizers import FusedAdam

    def build():
        model = bert_model().half()
        optimizer = FusedAdam(list(model.parameters()), lr=5e-3, bias_correction=False, max_grad_norm=1.0)
        return model, ApexFP16Optimizer(optimizer, dynamic_loss_scale=True)

    model, optimizer = build()
    assert isinstance(optimizer.optimizer, LegacyFusedAdam)
    losses = bert_loop(model, optimizer, 30, overflow_at=10)
    assert math.isinf(losses[10]) and losses[-1] < 0.5 * losses[0]
    out = capsys.readouterr().out  # 2**16 overflows the first two fp16 backwards, as it did under Apex
    assert [line for line in out.splitlines() if "Grad overflow" in line] == [
        f"Grad overflow on iteration {i}" for i in (0, 1, 10)
    ]
    assert optimizer.cur_scale == 2.0**13 and optimizer.last_overflow_iter == 10
    masters = [p for group in optimizer.fp32_groups for p in group]
    assert all(p.dtype == torch.float32 for p in masters)
    assert all(torch.equal(p, m.half()) for p, m in zip(model.parameters(), masters, strict=True))

    # resume at iteration 15 from a checkpoint of the model and the wrapper, as the scripts save them
    model, optimizer = build()
    bert_loop(model, optimizer, 15, overflow_at=10)
    saved = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    model, optimizer = build()
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    resumed = bert_loop(model, optimizer, 30, start=15)
    assert resumed == losses[15:]


def test_an_overflow_leaves_params_moments_and_step_counts_untouched():
    model = bert_model().half()
    optimizer = FP16_Optimizer(LegacyFusedAdam(model.parameters(), lr=1e-3), static_loss_scale=8.0)
    bert_loop(model, optimizer, 2)
    before = copy.deepcopy((model.state_dict(), optimizer.optimizer.state_dict()))
    bert_loop(model, optimizer, 3, start=2, overflow_at=2)
    after = (model.state_dict(), optimizer.optimizer.state_dict())
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert before[1]["state"][0]["step"] == after[1]["state"][0]["step"] == 2
    assert optimizer.cur_scale == 8.0  # a static scale stays


def test_the_dynamic_scale_grows_every_window_counted_from_the_last_overflow():
    """Apex's rule: after an overflow at iteration k the scale doubles at k + window, k + 2 window, ...; before
    any overflow (last_overflow_iter = -1) at window - 1, 2 window - 1, ..."""
    model = bert_model().half()
    optimizer = FP16_Optimizer(LegacyFusedAdam(model.parameters(), lr=1e-4), dynamic_loss_scale=True,
                               dynamic_loss_args={"scale_window": 3, "init_scale": 64.0}, verbose=False)  # fmt: skip
    scales = []
    g = torch.Generator().manual_seed(0)
    for i in range(10):
        loss = model(torch.randn(4, 8, generator=g).half()).float().mean() * (float("inf") if i == 4 else 1.0)
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scales.append(optimizer.cur_scale)
    assert scales == [64, 64, 128, 128, 64, 64, 64, 128, 128, 128]


def test_any_other_optimizer_steps_the_masters_with_unscaled_grads():
    """Wrapping torch's SGD: the masters see the unscaled gradient and the model gets their rounding."""
    model = bert_model().half()
    reference = copy.deepcopy(model).float()
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=64.0)
    x = torch.randn(8, 8)
    optimizer.backward(model(x.half()).float().mean())
    optimizer.step()
    reference(x.half().float()).mean().backward()  # fp32 grads of the same (fp16-valued) weights
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.float(), r, rtol=1e-2, atol=2e-3)  # fp16 forward against fp32's
    masters = [m for group in optimizer.fp32_groups for m in group]
    assert all(torch.equal(p, m.half()) for p, m in zip(model.parameters(), masters, strict=True))


def test_the_successor_fusedadam_is_built_without_the_first_ones_arguments(shim):
    from apex.optimizers import FusedAdam

    p = torch.nn.Parameter(torch.randn(3))
    modern = FusedAdam([p], lr=1e-3)
    assert type(modern).__module__ == "ampkit.compat.optimizers" and not isinstance(modern, LegacyFusedAdam)
    with pytest.raises(RuntimeError, match="FusedAdam has been updated"):
        modern.step(grads=[torch.zeros(3)])
    for argument in ({"max_grad_norm": 1.0}, {"eps_inside_sqrt": True}, {"use_mt": True}):
        assert isinstance(FusedAdam([p], lr=1e-3, **argument), LegacyFusedAdam)
    import apex.optimizers.fp16_optimizer as module

    assert module.FP16_Optimizer is FP16_Optimizer


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"static_loss_scale": 0.0}, r"static_loss_scale=0.0: expected a number > 0"),
    ({"dynamic_loss_args": {"scale_window": 3}}, "dynamic_loss_args needs dynamic_loss_scale=True"),
    # an init_scale of 0 divided every gradient by it, inf overflowed every step; "False" was read as on
    ({"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 0}}, r"init_scale=0.0: expected a finite number"),
    ({"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": math.inf}}, r"init_scale=inf: expected a fin"),
    ({"dynamic_loss_scale": True, "dynamic_loss_args": {"scale_window": math.nan}}, r"scale_window=nan: expected an"),
    ({"dynamic_loss_scale": "False"}, r"dynamic_loss_scale must be True or False, got 'False'"),
    ({"verbose": "False"}, r"verbose must be True or False, got 'False'"),  # "False" printed every message
    # 1e39 is finite for Python, inf for the float32 loss it scales: every step overflowed
    ({"static_loss_scale": 1e39}, r"static_loss_scale=1e\+39: a loss scale must lie in float32's range"),
    ({"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 1e39}}, r"init_scale=1e\+39: a loss scale mu"),
])  # fmt: skip
def test_bad_wrapper_arguments_are_named_and_leave_the_optimizer_as_it_was(kwargs, message):
    param = torch.nn.Parameter(torch.randn(2).half())
    inner = LegacyFusedAdam([param])
    with pytest.raises(ValueError, match=message):
        FP16_Optimizer(inner, **kwargs)
    assert inner.param_groups[0]["params"][0] is param  # not swapped for fp32 masters no wrapper steps


@pytest.mark.parametrize("scale", [0.0, -8.0, math.inf, math.nan])
def test_a_step_scale_that_is_not_finite_and_positive_is_named(scale):
    """The first FusedAdam divides each gradient by ``scale``: 0, inf and NaN made the weights NaN (or froze them), a
    negative one stepped uphill, silently."""
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    optimizer = LegacyFusedAdam([param], lr=0.1)
    with pytest.raises(ValueError, match=rf"FusedAdam.step: scale={scale}: expected a finite number > 0"):
        optimizer.step(scale=scale)
    assert torch.equal(param.detach(), torch.ones(3)) and not optimizer.state


def test_bad_optimizer_arguments_are_named():
    for name in ("bias_correction", "eps_inside_sqrt", "amsgrad", "use_mt"):  # "False" was read as True
        with pytest.raises(ValueError, match=rf"FusedAdam: {name} must be True or False, got 'False'"):
            LegacyFusedAdam([torch.nn.Parameter(torch.randn(2))], **{name: "False"})
    with pytest.raises(ValueError, match="max_grad_norm"):
        LegacyFusedAdam([torch.nn.Parameter(torch.randn(2))], max_grad_norm=-1.0)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        LegacyFusedAdam([torch.nn.Parameter(torch.randn(2))], amsgrad=True)
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer, got str"):
        FP16_Optimizer("adam")


def test_a_group_s_own_settings_are_checked_when_added_and_at_each_step():
    """A group dict's ``lr=-1`` was taken by the constructor that refuses ``lr=-1``; a value written into
    ``param_groups`` later failed as "can't multiply sequence by non-int" ("1e-3") or "math domain error"
    (``betas=(0.9, 1.5)``), or turned every weight NaN (``lr=nan``)."""
    with pytest.raises(ValueError, match=r"Invalid lr of a param group: -1.0"):
        LegacyFusedAdam([{"params": [torch.nn.Parameter(torch.ones(3))], "lr": -1.0}])
    for key, value, message in [
        ("lr", "1e-3", r"Invalid lr of FusedAdam.param_groups\[1\]: '1e-3' is a str"),
        ("lr", math.nan, r"Invalid lr of FusedAdam.param_groups\[1\]: nan"),
        ("betas", (0.9, 1.5), r"Invalid betas\[1\] of FusedAdam.param_groups\[1\]: 1.5"),
        ("max_grad_norm", None, r"Invalid max_grad_norm of FusedAdam.param_groups\[1\]: None"),
    ]:
        params = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
        optimizer = LegacyFusedAdam([{"params": params[:1]}, {"params": params[1:]}], lr=0.1)
        for param in params:
            param.grad = torch.ones(3)
        optimizer.param_groups[1][key] = value
        with pytest.raises((TypeError, ValueError), match=message):
            optimizer.step()
        assert all(torch.equal(param.detach(), torch.ones(3)) for param in params) and not optimizer.state


class CopiedFirstFusedAdam(torch.optim.Optimizer):
    """How OpenNMT-py, fairseq forks and UniLM kept Apex's first FusedAdam: their own copy of its Python side,
    loading the deprecated ``fused_adam_cuda`` extension by name and calling it per tensor."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, eps_inside_sqrt=False,
                 weight_decay=0.0, max_grad_norm=0.0):  # fmt: skip
        global fused_adam_cuda
        import importlib

        fused_adam_cuda = importlib.import_module("fused_adam_cuda")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm)  # fmt: skip
        super().__init__(params, defaults)
        self.eps_mode = 0 if eps_inside_sqrt else 1

    def step(self, closure=None, scale=1.0):
        for group in self.param_groups:
            bias_correction = 1 if group["bias_correction"] else 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p.data)
                    state["exp_avg_sq"] = torch.zeros_like(p.data)
                beta1, beta2 = group["betas"]
                state["step"] += 1
                out_p = torch.tensor([], dtype=torch.float)
                fused_adam_cuda.adam(p.data, out_p, state["exp_avg"], state["exp_avg_sq"], p.grad.data, group["lr"],
                                     beta1, beta2, group["eps"], scale, state["step"], self.eps_mode,
                                     bias_correction, group["weight_decay"])  # fmt: skip


def test_a_copy_of_the_first_fusedadam_loading_fused_adam_cuda_steps_as_the_first_one(shim):
    torch.manual_seed(0)
    copied_params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    legacy_params = [torch.nn.Parameter(p.detach().clone()) for p in copied_params]
    copied = CopiedFirstFusedAdam(copied_params, lr=1e-2, weight_decay=0.01, eps_inside_sqrt=True)
    legacy = LegacyFusedAdam(legacy_params, lr=1e-2, weight_decay=0.01, eps_inside_sqrt=True)
    for _ in range(3):
        for a, b in zip(copied_params, legacy_params, strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        copied.step()
        legacy.step()
    assert all(torch.equal(a, b) for a, b in zip(copied_params, legacy_params, strict=True))


def test_opennmt_reads_the_first_fp16_optimizer_as_an_attribute_of_import_apex(shim):
    """OpenNMT-py 2.x-3.x, ``-optim fusedadam -model_dtype fp16`` without ``-apex_opt_level``: ``import apex`` at the
    top, then ``apex.contrib.optimizers.FP16_Optimizer(its copy of the first FusedAdam, ...)`` with nothing having
    imported ``apex.contrib``: an AttributeError before the first step."""
    import apex

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).half()
    inner = CopiedFirstFusedAdam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    optimizer = apex.contrib.optimizers.FP16_Optimizer(inner, static_loss_scale=0, dynamic_loss_scale=True)
    assert isinstance(optimizer, FP16_Optimizer)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.half()).float(), x.sum(1, keepdim=True))
        optimizer.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert apex.contrib.xentropy.SoftmaxCrossEntropyLoss and apex.contrib.clip_grad.clip_grad_norm_
    with pytest.raises(AttributeError, match="does not serve 'apex.contrib.layer_norm'"):
        apex.contrib.layer_norm  # noqa: B018


def test_fused_adam_cuda_adam_mt_is_adam_per_tensor_and_the_oldest_call_works(shim):
    import fused_adam_cuda

    from ampkit.compat.multi_tensor_apply import multi_tensor_applier

    torch.manual_seed(0)
    tensors = [[torch.randn(n) for n in (3, 17)] for _ in range(4)]  # params, m (any values), v >= 0, grads
    tensors[2] = [v.abs() for v in tensors[2]]
    copies = [torch.empty(n, dtype=torch.half) for n in (3, 17)]
    one_by_one = copy.deepcopy(tensors)
    args = (1e-2, 0.9, 0.99, 1e-8, 4.0, 5, 1, 1, 0.1)  # lr, betas, eps, grad_scale, step, mode, bias corr., decay
    multi_tensor_applier(fused_adam_cuda.adam_mt, torch.zeros(1, dtype=torch.int32), [*tensors, copies], *args)
    for p, m, v, g in zip(*one_by_one, strict=True):
        fused_adam_cuda.adam(p, torch.tensor([]), m, v, g, *args)
    assert all(torch.equal(a, b) for x, y in zip(tensors, one_by_one, strict=True) for a, b in zip(x, y, strict=True))
    assert all(torch.equal(c, p.half()) for c, p in zip(copies, tensors[0], strict=True))
    p, m, v, g = torch.ones(2), torch.zeros(2), torch.zeros(2), torch.ones(2)
    fused_adam_cuda.adam(p, torch.tensor([]), m, v, g, 0.1, 0.9, 0.999, 0.0, 1.0, 1, 1)  # 12 arguments: corrected
    assert torch.allclose(p, torch.full((2,), 0.9))
    with pytest.raises(ValueError, match="expected 4 lists"):
        fused_adam_cuda.adam_mt(2048, torch.zeros(1, dtype=torch.int32), tensors[:3], *args)


@pytest.mark.parametrize(
    ("argument", "value", "message"),
    [
        ("bias_correction", "False", r"bias_correction must be True or False, got 'False'"),  # read as on
        ("bias_correction", 2, r"bias_correction must be True or False, got 2"),  # Apex's kernel took only 1 as on
        ("step", 1.5, r"step must be an integer"),
        ("lr", "1e-2", r"lr must be a number"),
    ],
)
def test_fused_adam_cuda_names_an_argument_apexs_binding_refused(shim, argument, value, message):
    import fused_adam_cuda

    names = ("lr", "beta1", "beta2", "eps", "grad_scale", "step", "mode", "bias_correction", "decay")
    args = dict(zip(names, (1e-2, 0.9, 0.99, 1e-8, 1.0, 1, 1, 1, 0.0), strict=True)) | {argument: value}
    p = torch.ones(3)
    with pytest.raises(TypeError, match=rf"^fused_adam_cuda\.adam: {message}"):
        fused_adam_cuda.adam(p, torch.tensor([]), torch.zeros(3), torch.zeros(3), torch.ones(3), *args.values())
    assert torch.equal(p, torch.ones(3))


def as_2019_layout(state: dict) -> dict:
    """The 2019 wrapper's checkpoint of the same run: one flat master per group, and the optimizer's state of it."""
    flat = dict(state)
    masters = flat.pop("fp32_groups")
    flat["fp32_groups_flat"] = [torch.cat([m.flatten() for m in group]) for group in masters]
    inner = state["optimizer_state_dict"]
    flat_state, groups = {}, []
    for g, group in enumerate(inner["param_groups"]):
        entries = [inner["state"][i] for i in group["params"]]
        flat_state[g] = {"step": entries[0]["step"]} | {
            key: torch.cat([e[key].flatten() for e in entries]) for key in ("exp_avg", "exp_avg_sq")
        }
        groups.append({**group, "params": [g]})
    flat["optimizer_state_dict"] = {"state": flat_state, "param_groups": groups}
    return flat


def test_a_checkpoint_of_the_2019_wrapper_with_flat_masters_resumes_exactly():
    def build():
        model = bert_model().half()
        decay = [p for p in model.parameters() if p.dim() == 2]
        other = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}]
        return model, FP16_Optimizer(LegacyFusedAdam(groups, lr=5e-3, bias_correction=False, max_grad_norm=1.0),
                                     dynamic_loss_scale=True, verbose=False)  # fmt: skip

    model, optimizer = build()
    losses = bert_loop(model, optimizer, 20)
    model, optimizer = build()
    bert_loop(model, optimizer, 12)
    saved = copy.deepcopy({"model": model.state_dict(), "optimizer": as_2019_layout(optimizer.state_dict())})
    model, optimizer = build()
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    assert bert_loop(model, optimizer, 20, start=12) == losses[12:]
    with pytest.raises(ValueError, match="flat master of 3 elements for a group of"):
        broken = copy.deepcopy(saved["optimizer"])
        broken["fp32_groups_flat"][1] = torch.zeros(3)
        build()[1].load_state_dict(broken)


def test_fused_adam_cuda_names_mismatched_tensors_instead_of_broadcasting_them(shim):
    """Apex asserted that m, v, g and a non-empty copy hold p's element count; a one-element grad broadcast here."""
    import fused_adam_cuda

    def call(p=None, p_copy=None, m=None, v=None, g=None, step=1):
        p = torch.ones(5) if p is None else p
        m, v, g = (torch.zeros(5) if t is None else t for t in (m, v, g))
        fused_adam_cuda.adam(p, torch.empty(0) if p_copy is None else p_copy, m, v, g, 0.1, 0.9, 0.999, 1e-8, 1.0,
                             step, 0, 1, 0.0)  # fmt: skip

    for kwargs, error, message in [
        ({"g": torch.ones(1)}, ValueError, r"grad must have p's 5 elements, got shape \[1\]"),
        ({"m": torch.zeros(1)}, ValueError, r"exp_avg must have p's 5 elements"),
        ({"p_copy": torch.empty(3, dtype=torch.half)}, ValueError, r"p_copy must have p's 5 elements"),
        ({"p": torch.ones(5, dtype=torch.long)}, TypeError, r"p must be a floating-point tensor, got torch.int64"),
        ({"step": 0}, ValueError, r"step must be 1 or more with bias_correction"),
    ]:
        with pytest.raises(error, match=message):
            call(**kwargs)
    with pytest.raises(TypeError, match=r"adam_mt: tensor_lists\[0\] must be a list of tensors, got Tensor"):
        fused_adam_cuda.adam_mt(2048, torch.zeros(1, dtype=torch.int32), [torch.ones(5)] * 4, 0.1, 0.9, 0.999, 1e-8,
                                1.0, 1, 0, 1, 0.0)  # fmt: skip
    p, flat_grad = torch.ones(2, 3), torch.ones(6)  # same count, another shape: Apex read both flat
    fused_adam_cuda.adam(p, torch.empty(0), torch.zeros(2, 3), torch.zeros(2, 3), flat_grad, 0.1, 0.9, 0.999, 0.0, 1.0,
                         1, 1)  # fmt: skip
    assert torch.allclose(p, torch.full((2, 3), 0.9))


def test_torch_adams_keywords_are_taken_where_they_agree_and_refused_by_name(shim):
    """A port of torch.optim.Adam(params, lr, fused=True) that also gives max_grad_norm (which builds Apex's first
    FusedAdam) was Python's bare 'unexpected keyword argument': every keyword torch.optim.Adam takes is taken where it
    says what the first kernel does, as the fused optimizers take them, and refused naming it otherwise."""
    import inspect

    from apex.optimizers import FusedAdam

    ours = set(inspect.signature(LegacyFusedAdam.__init__).parameters)
    assert set(inspect.signature(torch.optim.Adam.__init__).parameters) <= ours
    agreeing = {
        "foreach": None, "fused": True, "differentiable": False, "capturable": None, "maximize": False,
        "decoupled_weight_decay": True,  # the first kernel's decay is AdamW's where its step size is lr
    }  # fmt: skip
    results = []
    for extra in (agreeing, {}):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(2)]
        optimizer = FusedAdam(params, lr=1e-2, bias_correction=False, weight_decay=0.1, max_grad_norm=1.0, **extra)
        assert isinstance(optimizer, LegacyFusedAdam)
        for _ in range(2):
            for p in params:
                p.grad = torch.randn_like(p)
            optimizer.step()
        results.append(params)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    for keyword, value, message in [
        ("foreach", True, "foreach=True asks for torch.optim's foreach"),
        ("fused", False, "fused=False asks for torch.optim's unfused"),
        ("differentiable", True, "differentiable=True asks for a step gradients flow through"),
        ("capturable", True, "capturable=True asks for a step CUDA graphs can capture"),
        ("maximize", True, "maximize=True asks for gradient ascent"),
        ("decoupled_weight_decay", False, "decoupled_weight_decay=False asks for torch.optim.Adam's L2 decay"),
    ]:
        with pytest.raises(ValueError, match=rf"^FusedAdam: {message}"):
            FusedAdam([torch.nn.Parameter(torch.ones(2))], weight_decay=0.1, max_grad_norm=1.0, **{keyword: value})
    with pytest.raises(ValueError, match=r"decoupled_weight_decay=True asks for AdamW's decay.*bias_correction=False"):
        LegacyFusedAdam([torch.nn.Parameter(torch.ones(2))], weight_decay=0.1, decoupled_weight_decay=True)
    LegacyFusedAdam([torch.nn.Parameter(torch.ones(2))], decoupled_weight_decay=False)  # no decay: nothing differs
    with pytest.raises(TypeError, match=r"invalid fused: 'yes' is a str"):
        LegacyFusedAdam([torch.nn.Parameter(torch.ones(2))], fused="yes")
