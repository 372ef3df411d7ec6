"""Code that subclasses Apex's classes reads the attributes Apex's ``__init__`` set and drives steps through them
(fairseq's ``FusedAdamV2``: ``multi_tensor_applier(self.multi_tensor_adam, self._dummy_overflow_buf, ...)``)."""

import copy

import pytest
import torch

from ampkit.compat import amp_c, fp16_utils, optimizers
from ampkit.compat.multi_tensor_apply import multi_tensor_applier

# Attributes Apex's __init__ set (apex/optimizers/*.py before amp was removed), besides torch's own.
APEX_OPTIMIZER_ATTRIBUTES = {
    "FusedAdam": "adam_w_mode set_grad_none capturable master_weights param_groups_master _step_supports_amp_scaling "
    "_dummy_overflow_buf multi_tensor_adam multi_tensor_adam_capturable multi_tensor_adam_capturable_master",
    "FusedSGD": "wd_after_momentum materialize_master_grads most_recent_scale scale_set_by_backward set_grad_none "
    "_dummy_overflow_buf multi_tensor_sgd",
    "FusedLAMB": "multi_tensor_l2norm _dummy_overflow_buf multi_tensor_lamb adam_w_mode set_grad_none use_nvlamb",
    "FusedNovoGrad": "_dummy_overflow_buf multi_tensor_novograd moment_mode set_grad_none",
    "FusedAdagrad": "adagrad_w_mode set_grad_none _dummy_overflow_buf multi_tensor_adagrad",
    "FusedMixedPrecisionLamb": "multi_tensor_l2norm _dummy_overflow_buf reduced_precision_dtype "
    "param_groups_full_precision _step_supports_amp_scaling adam_w_mode use_nvlamb",
}


@pytest.mark.parametrize("name", list(APEX_OPTIMIZER_ATTRIBUTES))
def test_fused_optimizers_carry_apexs_attributes(name):
    optimizer = getattr(optimizers, name)([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    missing = [a for a in APEX_OPTIMIZER_ATTRIBUTES[name].split() if not hasattr(optimizer, a)]
    assert not missing
    assert optimizer._dummy_overflow_buf.dtype == torch.int32 and optimizer._dummy_overflow_buf.tolist() == [0]


def test_mode_flags_are_apexs_integers():
    param = [torch.nn.Parameter(torch.zeros(3))]
    assert optimizers.FusedAdam(param, adam_w_mode=False).adam_w_mode == 0
    assert optimizers.FusedAdam(param).adam_w_mode == 1
    assert optimizers.FusedLAMB(param, adam_w_mode=False, use_nvlamb=True).adam_w_mode == 0
    assert optimizers.FusedNovoGrad(param, reg_inside_moment=True).moment_mode == 0
    assert optimizers.FusedNovoGrad(param).moment_mode == 1
    assert optimizers.FusedAdagrad(param, adagrad_w_mode=True).adagrad_w_mode == 1


class OwnStepAdam(optimizers.FusedAdam):
    """A subclass in fairseq's manner: refuses an Apex without the attributes, then steps through them itself
    (fp16 params updated on fp32 copies, steps counted per group)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not hasattr(self, "multi_tensor_adam"):
            raise RuntimeError("Apex installation is outdated")

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            grads, params, models, exp_avgs, exp_avg_sqs = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float)
                grads.append(p.grad.float())
                params.append(p.float() if p.dtype == torch.float16 else p)
                models.append(p)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
            lists = [grads, params, exp_avgs, exp_avg_sqs]
            multi_tensor_applier(self.multi_tensor_adam, self._dummy_overflow_buf, lists, group["lr"], beta1, beta2,
                                 group["eps"], group["step"], self.adam_w_mode, int(group["bias_correction"]),
                                 group["weight_decay"])  # fmt: skip
            for model, updated in zip(models, params, strict=True):
                if model is not updated:
                    model.copy_(updated)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_subclass_stepping_through_multi_tensor_adam_matches_torch_adamw(dtype):
    torch.manual_seed(0)
    model = torch.nn.Linear(7, 5).to(dtype)
    reference = copy.deepcopy(model).float()  # from the same (rounded) weights
    ours = OwnStepAdam(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    for _ in range(3):
        x = torch.randn(4, 7)
        model(x.to(dtype)).float().pow(2).sum().backward()
        reference.weight.grad = model.weight.grad.float()  # the same gradients, so only the update is compared
        reference.bias.grad = model.bias.grad.float()
        ours.step()
        theirs.step()
        ours.zero_grad()
        for mine, want in zip(model.parameters(), reference.parameters(), strict=True):
            if dtype == torch.float16:  # fp16 params: torch's fp32 update, rounded, exactly
                assert torch.equal(mine, want.half())
                with torch.no_grad():
                    want.copy_(mine.float())
            else:
                torch.testing.assert_close(mine, want, rtol=0, atol=3e-7)


def _twin(name, **kwargs):
    """An optimizer on a fresh Linear with gradients, and a deep copy of both (the reference)."""
    torch.manual_seed(1)
    model = torch.nn.Linear(6, 3)
    with torch.enable_grad():
        model(torch.randn(5, 6)).pow(2).sum().backward()
    twin = copy.deepcopy(model)
    for mine, copied in zip(model.parameters(), twin.parameters(), strict=True):
        copied.grad = mine.grad.clone()
    cls = getattr(optimizers, name)
    return cls(model.parameters(), **kwargs), model, cls(twin.parameters(), **kwargs), twin


def _assert_same(model, twin):
    for mine, want in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(mine, want, rtol=1e-6, atol=1e-7)


@torch.no_grad()
def test_own_sgd_step_through_multi_tensor_sgd_matches_the_class_step():
    ours, model, theirs, twin = _twin("FusedSGD", lr=0.1, momentum=0.9, weight_decay=0.01)
    buffers = [torch.zeros_like(p) for p in model.parameters()]
    lists = [[p.grad for p in model.parameters()], list(model.parameters()), buffers]
    multi_tensor_applier(ours.multi_tensor_sgd, ours._dummy_overflow_buf, lists, 0.01, 0.9, 0.0, 0.1, False, True,
                         ours.wd_after_momentum, 1.0)  # fmt: skip
    theirs.step()
    _assert_same(model, twin)


@torch.no_grad()
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_own_lamb_step_through_l2norm_and_multi_tensor_lamb_matches_the_class_step(adam_w_mode):
    kwargs = dict(lr=0.05, weight_decay=0.01, adam_w_mode=adam_w_mode, max_grad_norm=0.5)
    ours, model, theirs, twin = _twin("FusedLAMB", **kwargs)
    grads = [p.grad for p in model.parameters()]
    norm, _ = multi_tensor_applier(ours.multi_tensor_l2norm, ours._dummy_overflow_buf, [grads], False)
    moments = [[torch.zeros_like(p) for p in model.parameters()] for _ in range(2)]
    lists = [grads, list(model.parameters()), *moments]
    multi_tensor_applier(ours.multi_tensor_lamb, ours._dummy_overflow_buf, lists, 0.05, 0.9, 0.999, 1e-6, 1, 1, 0.01,
                         1, ours.adam_w_mode, norm, 0.5, ours.use_nvlamb)  # fmt: skip
    theirs.step()
    _assert_same(model, twin)


@torch.no_grad()
@pytest.mark.parametrize("reg_inside_moment", [True, False])
def test_own_novograd_step_through_multi_tensor_novograd_matches_the_class_step(reg_inside_moment):
    kwargs = dict(lr=0.05, weight_decay=0.01, reg_inside_moment=reg_inside_moment)
    ours, model, theirs, twin = _twin("FusedNovoGrad", **kwargs)
    grads = [p.grad for p in model.parameters()]
    _, per_tensor = multi_tensor_applier(amp_c.multi_tensor_l2norm, ours._dummy_overflow_buf, [grads], True)
    second_moments = per_tensor.clone()  # Apex's first step starts from the gradients' own norms
    exp_avgs = [torch.zeros_like(p) for p in model.parameters()]
    lists = [grads, list(model.parameters()), exp_avgs]
    multi_tensor_applier(ours.multi_tensor_novograd, ours._dummy_overflow_buf, lists, second_moments, 0.05, 0.9,
                         0.999, 1e-8, 1, 1, 0.01, 1, ours.moment_mode, 2)  # fmt: skip
    theirs.step()
    _assert_same(model, twin)
    torch.testing.assert_close(second_moments, per_tensor)


@torch.no_grad()
@pytest.mark.parametrize("adagrad_w_mode", [True, False])
def test_own_adagrad_step_through_multi_tensor_adagrad_matches_the_class_step(adagrad_w_mode):
    ours, model, theirs, twin = _twin("FusedAdagrad", lr=0.1, weight_decay=0.05, adagrad_w_mode=adagrad_w_mode)
    sums = [torch.zeros_like(p) for p in model.parameters()]
    lists = [[p.grad for p in model.parameters()], list(model.parameters()), sums]
    multi_tensor_applier(ours.multi_tensor_adagrad, ours._dummy_overflow_buf, lists, 0.1, 1e-10,
                         ours.adagrad_w_mode, 0.05)  # fmt: skip
    theirs.step()
    _assert_same(model, twin)


@torch.no_grad()
@pytest.mark.parametrize("master", [False, True])
def test_capturable_adam_unscales_skips_on_the_flag_and_updates_masters(master):
    torch.manual_seed(2)
    weights = [torch.randn(5), torch.randn(2, 3)]
    grads = [torch.randn_like(w) for w in weights]
    expected = [w.clone() for w in weights]
    moments = [[torch.zeros_like(w) for w in weights] for _ in range(4)]
    amp_c.multi_tensor_adam(0, torch.zeros(1, dtype=torch.int32), [grads, expected, *moments[:2]],
                            1e-2, 0.9, 0.999, 1e-8, 1, 1, 1, 0.1)  # fmt: skip
    optimizer = optimizers.FusedAdam([torch.nn.Parameter(torch.zeros(1))], capturable=True, master_weights=master)
    op = optimizer.multi_tensor_adam_capturable_master if master else optimizer.multi_tensor_adam_capturable
    params = [w.half() for w in weights] if master else [w.clone() for w in weights]
    lists = [[g * 4 for g in grads], params, *moments[2:]] + ([[w.clone() for w in weights]] if master else [])
    args = (torch.tensor(1e-2), 0.9, 0.999, 1e-8, torch.tensor(1), 1, 1, 0.1, torch.tensor(0.25))
    before = [t.clone() for t in lists[1]]
    multi_tensor_applier(op, torch.ones(1, dtype=torch.int32), lists, *args)  # GradScaler found an inf: no change
    assert all(torch.equal(a, b) for a, b in zip(lists[1], before, strict=True))
    multi_tensor_applier(op, optimizer._dummy_overflow_buf, lists, *args)
    updated = lists[4] if master else lists[1]
    for got, want in zip(updated, expected, strict=True):
        torch.testing.assert_close(got, want)
    if master:
        assert all(torch.equal(p, m.half()) for p, m in zip(lists[1], lists[4], strict=True))


def test_param_groups_master_lists_the_fp32_masters():
    param = torch.nn.Parameter(torch.randn(4).half())
    optimizer = optimizers.FusedAdam([param], master_weights=True, capturable=True)
    param.grad = torch.ones_like(param)
    optimizer.step()
    (master,) = optimizer.param_groups_master[0]["params"]
    assert master.dtype == torch.float32 and torch.equal(master.half(), param.detach())


def test_fp16_optimizer_carries_apexs_copy_op_and_buffer():
    model = torch.nn.Linear(3, 2).half()
    optimizer = fp16_utils.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    # Apex's own use: copy the fp32 masters into the fp16 model in one call.
    with torch.no_grad():
        for master in optimizer.all_fp32_from_fp16_params:
            master.add_(1.0)
    multi_tensor_applier(optimizer.multi_tensor_scale, optimizer._dummy_overflow_buf,
                         [optimizer.all_fp32_from_fp16_params, optimizer.all_fp16_params], 1.0)  # fmt: skip
    for model_param, master in zip(optimizer.all_fp16_params, optimizer.all_fp32_from_fp16_params, strict=True):
        assert torch.equal(model_param, master.half())


def test_fused_sgd_divides_by_the_scale_recorded_in_most_recent_scale_and_resets_it_as_apex_did():
    """Apex's FusedSGD stepped on each gradient times ``1/most_recent_scale`` (the scale amp's backward left its
    gradients at, with ``materialize_master_grads=False``) and reset it to 1 and ``scale_set_by_backward`` to False.
    The step ignored a scale recorded there, taking the gradients 1024 times too large, and kept it."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(5))
    twin = torch.nn.Parameter(param.detach().clone())
    optimizer = optimizers.FusedSGD([param], lr=0.1, momentum=0.9)
    reference = torch.optim.SGD([twin], lr=0.1, momentum=0.9)
    for scale in (1024.0, 1.0, 256.0):
        grad = torch.randn(5)
        param.grad, twin.grad = grad * scale, grad.clone()
        optimizer.most_recent_scale, optimizer.scale_set_by_backward = scale, scale != 1.0
        optimizer.step()
        reference.step()
        assert (optimizer.most_recent_scale, optimizer.scale_set_by_backward) == (1.0, False)
        torch.testing.assert_close(param, twin)
    optimizer.most_recent_scale, optimizer.scale_set_by_backward = 8.0, True
    with pytest.raises(ValueError, match=r"grad_scale.*most_recent_scale=8\.0"):
        optimizer.step(grad_scale=torch.ones(1))
    # the refused call stepped nothing and kept the record: the corrected call divides by it
    assert (optimizer.most_recent_scale, optimizer.scale_set_by_backward) == (8.0, True)
    grad = torch.randn(5)
    param.grad, twin.grad = grad * 8.0, grad.clone()
    optimizer.step()
    reference.step()
    torch.testing.assert_close(param, twin)
