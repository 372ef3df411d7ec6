"""FP16_Optimizer against the last Apex version: amp LossScaler defaults, the scale updated in every
update_master_grads, Apex's step / closure / zero_grad control flow, its attribute surface, LARC, checkpoints."""

import copy
import io
import pickle
import re
import types

import pytest
import torch

from ampkit.compat.fp16_utils import FP16_Optimizer, clip_grad_norm
from ampkit.compat.parallel import LARC


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)).half()


def _x():
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(1)).half()


def _loss(model, scale=1.0):
    return model(_x()).float().pow(2).mean() * scale


def _dynamic(model, verbose=False, **args):
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    return FP16_Optimizer(sgd, dynamic_loss_scale=True, dynamic_loss_args=args or None, verbose=verbose)


def _masters(optimizer):
    return [p for g in optimizer.param_groups for p in g["params"]]


def test_dynamic_defaults_are_amp_loss_scaler():
    optimizer = _dynamic(_model())
    assert optimizer.loss_scale == 2.0**16
    for _ in range(1999):  # each update_master_grads is one scaler update (Apex's update_scale)
        optimizer.update_master_grads()
    assert optimizer.loss_scale == 2.0**16
    optimizer.update_master_grads()
    assert optimizer.loss_scale == 2.0**17  # window 2000, factor 2
    optimizer.loss_scale = 2.0**24
    for _ in range(2000):
        optimizer.update_master_grads()
    assert optimizer.loss_scale == 2.0**24  # max_loss_scale
    model = _model()
    with pytest.warns(UserWarning, match=r"dynamic_loss_args\['scale_factor'\]=4.0 is ignored, as Apex ignored it"):
        optimizer = _dynamic(model, init_scale=1.0, scale_factor=4.0)  # scale_factor: accepted, ignored
    optimizer.backward(_loss(model, float("inf")))
    assert optimizer.overflow and optimizer.loss_scale == 0.5  # halves, and no floor (the old one was 1)


def test_dynamic_loss_args_are_loss_scaler_keywords():
    model = _model()
    optimizer = _dynamic(model, init_scale=4.0, scale_window=1, min_loss_scale=2.0, max_loss_scale=16.0)
    for expected in (2.0, 2.0):
        optimizer.zero_grad()
        optimizer.backward(_loss(model, float("inf")))
        assert optimizer.loss_scale == expected  # floored at min_loss_scale
    for expected in (4.0, 8.0, 16.0, 16.0):
        optimizer.zero_grad()
        optimizer.backward(_loss(model))
        assert not optimizer.overflow and optimizer.loss_scale == expected  # window 1, capped at 16
    optimizer = _dynamic(model, init_scale=1.0, min_loss_scale=0)  # Apex: a falsy floor is no floor
    optimizer.backward(_loss(model, float("inf")))
    assert optimizer.loss_scale == 0.5
    with pytest.raises(TypeError, match=r"\['delayed_shift'\].*'init_scale'.*'max_loss_scale'"):
        _dynamic(model, delayed_shift=2)  # the older DynamicLossScaler's key
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    static = FP16_Optimizer(sgd, static_loss_scale=8.0, dynamic_loss_args={"anything": 1}, verbose=False)
    assert static.loss_scale == 8.0 and not static.dynamic_loss_scale  # Apex ignores the args when static


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dynamic_loss_scale": "False"}, "FP16_Optimizer: dynamic_loss_scale must be True or False, got 'False'"),
    ({"static_loss_scale": 0.0}, "^static_loss_scale=0.0: a static loss scale must be finite and > 0"),
    ({"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 0}},
     r"^dynamic_loss_args\['init_scale'\]=0.0: expected a finite"),
    ({"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 1e39}},  # above the cap: it was taken as given
     r"^dynamic_loss_args\['init_scale'\]=1e\+39: a loss scale must lie in float32's range"),
])  # fmt: skip
def test_a_refused_option_leaves_the_optimizer_as_it_was(kwargs, message):
    """A switch read by truthiness took ``dynamic_loss_scale="False"`` as on; a refused scale was named only after the
    optimizer's params had been swapped for fp32 masters that no wrapper would ever step or copy back."""
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=message):
        FP16_Optimizer(sgd, verbose=False, **kwargs)
    assert all(p is q for p, q in zip(sgd.param_groups[0]["params"], model.parameters(), strict=True))


@pytest.mark.parametrize(
    "kwargs",
    [{"dynamic_loss_scale": True, "dynamic_loss_args": 5},
     {"dynamic_loss_scale": True, "dynamic_loss_args": {"scale_windw": 3}}],
)  # fmt: skip
def test_both_fp16_optimizers_refuse_an_option_in_the_same_words(kwargs):
    """Apex's first FP16_Optimizer (over FusedAdam) and its last checked the same options each its own way: a misspelt
    dynamic_loss_args key was a ValueError in one and a TypeError in the other, each worded otherwise, and a number
    for the args failed in dict(), naming neither."""
    from ampkit.compat.legacy_fused_adam import FP16_Optimizer as FirstFP16Optimizer

    refused = []
    for wrapper in (FP16_Optimizer, FirstFP16Optimizer):
        sgd = torch.optim.SGD(_model().parameters(), lr=0.1)
        with pytest.raises((TypeError, ValueError), match="^FP16_Optimizer: ") as caught:
            wrapper(sgd, **kwargs)
        assert "scale_window" in str(caught.value)  # the keys it takes (each class its own: the first takes fewer)
        refused.append((type(caught.value), re.sub(r"(dict of|takes are) .*", r"\1 ...", str(caught.value))))
    assert refused[0] == refused[1] and refused[0][0] is TypeError


@pytest.mark.parametrize("first_api", [False, True])
def test_a_switch_given_as_text_is_refused(first_api):
    """``verbose="False"`` printed every set-up message and ``zero_grad(set_grads_to_None="False")`` dropped the
    gradients: both FP16_Optimizers read them by truthiness."""
    from ampkit.compat.legacy_fused_adam import FP16_Optimizer as FirstFP16Optimizer

    model = _model()
    wrapper = FirstFP16Optimizer if first_api else FP16_Optimizer
    with pytest.raises(ValueError, match="^FP16_Optimizer: verbose must be True or False, got 'False'$"):
        wrapper(torch.optim.SGD(model.parameters(), lr=0.1), verbose="False")
    optimizer = wrapper(torch.optim.SGD(model.parameters(), lr=0.1), verbose=0)
    assert optimizer.verbose is False
    optimizer.backward(_loss(model))
    with pytest.raises(
        TypeError, match="^FP16_Optimizer.zero_grad: set_grads_to_None must be True or False, got 'no'$"
    ):
        optimizer.zero_grad(set_grads_to_None="no")
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    "kwargs", [{"static_loss_scale": 1e39}, {"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 1e39}}]
)
def test_the_first_apis_scale_float32_cannot_carry_is_refused(kwargs):
    """Apex's first FP16_Optimizer (beside its FusedAdam) took 1e39, and every float32 scaled loss was inf."""
    from ampkit.compat.legacy_fused_adam import FP16_Optimizer as FirstFP16Optimizer

    with pytest.raises(ValueError, match=r"=1e\+39: a loss scale must lie in float32's range"):
        FirstFP16Optimizer(torch.optim.SGD(_model().parameters(), lr=0.1), verbose=False, **kwargs)


def test_scale_moves_in_update_master_grads_and_step_only_reports(capsys):
    model = _model()
    optimizer = _dynamic(model, init_scale=2.0**10, scale_window=4)
    weights = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    optimizer.backward(_loss(model, float("inf")))
    assert optimizer.overflow and optimizer.loss_scale == 512.0  # backed off before step()
    grads = [m.grad for m in _masters(optimizer)]
    assert optimizer.clip_master_grads(1.0) == -1
    assert optimizer.step() is None
    assert "Gradient overflow.  Skipping step, reducing loss scale to 512.0" in capsys.readouterr().out
    assert optimizer.loss_scale == 512.0 and optimizer.overflow  # nothing updated, nothing zeroed
    assert all(m.grad is g and not torch.isfinite(g).all() for m, g in zip(_masters(optimizer), grads, strict=True))
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    scales = []
    for _ in range(4):  # two clean backwards per step: four clean updates (one window) every two steps
        optimizer.zero_grad()
        optimizer.backward(_loss(model))
        optimizer.backward(_loss(model))
        optimizer.step()
        scales.append(optimizer.loss_scale)
    assert scales == [512.0, 1024.0, 1024.0, 2048.0]


def test_overflow_verdict_is_sticky_until_zero_grad(capsys):
    model = _model()
    optimizer = _dynamic(model, init_scale=2.0**10)
    optimizer.backward(_loss(model, float("inf")))
    optimizer.backward(_loss(model))  # the first backward's inf is still in the master grads: backs off again
    assert optimizer.overflow and optimizer.loss_scale == 256.0
    optimizer.zero_grad()
    assert optimizer.overflow  # zero_grad leaves the verdict (Apex), step() still skips
    assert optimizer.step() is None and "Gradient overflow" in capsys.readouterr().out
    optimizer.backward(_loss(model))
    assert not optimizer.overflow and optimizer.loss_scale == 256.0 and optimizer.loss_scaler._unskipped == 1
    optimizer.zero_grad()
    optimizer.backward(_loss(model, float("inf")), update_master_grads=False)
    optimizer.backward(_loss(model), update_master_grads=False)
    assert optimizer.loss_scale == 256.0
    optimizer.update_master_grads()
    assert optimizer.overflow and optimizer.loss_scale == 128.0  # one update for the delayed backwards


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zeroing_the_models_grads_instead_of_the_optimizers_starts_each_iteration_afresh(set_to_none, capsys):
    """transformer-xl calls ``model.zero_grad()``, never the optimizer's: Apex rebuilt the master grads from the
    model's at each backward, so each step took that iteration's gradients. They had accumulated the earlier steps'
    here, and after one overflow its inf with them: every later step was skipped."""

    def train(zero_model_grads):
        model = _model()
        optimizer = _dynamic(model, init_scale=2.0**10)
        for loss_scale in (float("inf"), 1.0, 1.0, 1.0):
            model.zero_grad(set_to_none=set_to_none) if zero_model_grads else optimizer.zero_grad()
            optimizer.backward(_loss(model, loss_scale))
            optimizer.clip_master_grads(10.0)
            optimizer.step()
        return model, optimizer

    model, optimizer = train(zero_model_grads=True)
    reference, reference_optimizer = train(zero_model_grads=False)
    assert capsys.readouterr().out.count("Gradient overflow") == 2  # the first iteration's only, in each run
    assert not optimizer.overflow and optimizer.loss_scale == reference_optimizer.loss_scale == 512.0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))


def test_each_master_grad_follows_what_the_script_did_to_its_model_grad():
    """Apex set each master grad to its model grad over the scale at every backward: a model grad never zeroed
    went on accumulating across steps, and one zeroed in place (``model.zero_grad(set_to_none=False)``) of a param
    no backward reached gave the step zeros (its momentum went on). Every master grad was dropped after a step."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"body": torch.nn.Linear(4, 3), "head": torch.nn.Linear(3, 2)}).half()
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.0), static_loss_scale=128.0, verbose=False)
    seen = []
    optimizer.optimizer.register_step_pre_hook(
        lambda opt, *_: seen.append([None if p.grad is None else p.grad.clone() for p in _masters(opt)])
    )

    def iteration(use_head):
        out = model["body"](_x())
        optimizer.backward((model["head"](out) if use_head else out).float().pow(2).mean())
        optimizer.step()

    for use_head in (True, True, True, False, True):  # never zeroed: it accumulates, as with torch's optimizers
        iteration(use_head)
    assert all(torch.allclose(g, 3 * f, rtol=1e-3) for g, f in zip(seen[2], seen[0], strict=True))
    assert torch.allclose(seen[3][2], 3 * seen[0][2], rtol=1e-3)  # not reached: the head's sum stays
    assert torch.allclose(seen[4][2], 4 * seen[0][2], rtol=1e-3)
    model.zero_grad(set_to_none=False)  # zeroed in place, then the head is not reached
    iteration(use_head=False)
    head_weight = seen[5][2]
    assert head_weight is not None and not head_weight.any()
    model.zero_grad()  # set to None: the head's master grad goes too
    iteration(use_head=False)
    assert seen[6][2] is None and seen[6][0] is not None


def test_static_scaler_never_overflows():
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = FP16_Optimizer(sgd, static_loss_scale=128.0, verbose=False)
    optimizer.backward(_loss(model, float("inf")))
    assert not optimizer.overflow and optimizer.loss_scale == 128.0
    norm = optimizer.clip_master_grads(1.0)
    assert isinstance(norm, torch.Tensor) and not torch.isfinite(norm)  # Apex returns the inf/nan norm
    weights = [p.detach().clone() for p in model.parameters()]
    optimizer.step()  # and steps
    assert not all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


def _mixed_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    model[0].half()
    return model


def _mixed_loss(model, seed):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed)).half()
    return model[2](model[1](model[0](x)).float()).pow(2).mean()


def test_zero_grad_zeroes_in_place_and_accumulation_stays_exact():
    model = _mixed_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = FP16_Optimizer(sgd, static_loss_scale=64.0, verbose=False)
    masters = _masters(optimizer)
    assert [m.dtype for m in masters] == [torch.float32] * 4 and masters[2] is model[2].weight
    singles = []
    for seed in (1, 2):
        optimizer.zero_grad()
        optimizer.backward(_mixed_loss(model, seed))
        singles.append([m.grad.clone() for m in masters])
    grads = [m.grad for m in masters]
    optimizer.zero_grad()  # Apex's default: zeroed in place, not dropped
    assert all(m.grad is g and not g.any() for m, g in zip(masters, grads, strict=True))
    optimizer.backward(_mixed_loss(model, 1))
    optimizer.backward(_mixed_loss(model, 2))
    for m, a, b in zip(masters, *singles, strict=True):
        assert torch.equal(m.grad, a + b)
    optimizer.backward(_mixed_loss(model, 1), update_master_grads=False)
    optimizer.zero_grad()  # a backward never unscaled is dropped too
    assert all(not m.grad.any() for m in masters)
    optimizer.backward(_mixed_loss(model, 2))
    for m, b in zip(masters, singles[1], strict=True):
        assert torch.equal(m.grad, b)
    optimizer.zero_grad(set_grads_to_None=True)
    assert all(m.grad is None for m in masters) and all(p.grad is None for p in model.parameters())


def test_model_grads_stay_after_backward_as_apex_left_them():
    """Apex's update_master_grads unscaled the fp16 grads into the masters and left them on the model, still scaled:
    scripts log a grad norm over ``model.parameters()`` after ``optimizer.backward(loss)``, or check that every
    parameter got a gradient."""
    model = _model()
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=64.0, verbose=False)
    optimizer.backward(_loss(model))
    for param, master in zip(model.parameters(), _masters(optimizer), strict=True):
        assert param.grad is not None and param.grad.dtype == torch.float16
        assert torch.equal(param.grad.float() / 64.0, master.grad)
    optimizer.step()
    optimizer.zero_grad()  # zeroed in place, as the masters' are
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_existing_optimizer_state_moves_to_the_masters_in_fp32():
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _loss(model).backward()
    sgd.step()
    buffers = [sgd.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    assert buffers[0].dtype == torch.float16
    optimizer = FP16_Optimizer(sgd, static_loss_scale=1.0, verbose=False)
    for master, buf in zip(_masters(optimizer), buffers, strict=True):
        state = optimizer.state[master]["momentum_buffer"]
        assert state.dtype == torch.float32 and torch.equal(state, buf.float())


def test_apex_attribute_surface(capsys):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3).half(), torch.nn.Linear(3, 2).half(), torch.nn.Linear(2, 2))
    model[1].bias.requires_grad_(False)
    groups = [{"params": model[0].parameters()}, {"params": list(model[1].parameters()) + list(model[2].parameters())}]
    optimizer = FP16_Optimizer(torch.optim.SGD(groups, lr=0.1), static_loss_scale=32.0)
    printed = capsys.readouterr().out
    assert "FP16_Optimizer processing param group 1:" in printed
    assert "FP16_Optimizer received torch.HalfTensor with torch.Size([3, 4])" in printed
    assert optimizer.fp16_groups == [[model[0].weight, model[0].bias], [model[1].weight]]  # trainable only
    assert optimizer.fp32_from_fp32_groups == [[], [model[2].weight, model[2].bias]]
    assert [[m.dtype for m in g] for g in optimizer.fp32_from_fp16_groups] == [[torch.float32] * 2, [torch.float32]]
    assert optimizer.all_fp16_params == [model[0].weight, model[0].bias, model[1].weight]
    assert (
        optimizer.all_fp32_from_fp16_params == optimizer.fp32_from_fp16_groups[0] + optimizer.fp32_from_fp16_groups[1]
    )
    assert optimizer.all_fp32_from_fp32_params == [model[2].weight, model[2].bias]
    assert optimizer.clip_grad_norm is clip_grad_norm
    optimizer.loss_scale = 8.0
    assert optimizer.loss_scale == 8.0 and optimizer.loss_scaler._loss_scale == 8.0
    optimizer.backward(model[2](model[1](model[0](torch.randn(5, 4).half())).float()).sum())
    data = optimizer.inspect_master_grad_data()
    assert [len(g) for g in data] == [2, 4] and data[1][1] is None  # the frozen bias has no grad
    assert torch.equal(data[0][0], optimizer.fp32_from_fp16_groups[0][0].grad)
    optimizer.overflow = True
    assert optimizer.inspect_master_grad_data() is None and "overflow state" in capsys.readouterr().out
    for copier in (pickle.dumps, copy.deepcopy):
        with pytest.raises(RuntimeError, match="state_dict"):
            copier(optimizer)
    groups, state = optimizer.param_groups, optimizer.state
    optimizer.param_groups = list(groups)
    optimizer.state = state
    assert optimizer.optimizer.param_groups == groups and optimizer.optimizer.state is state
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        FP16_Optimizer(torch.optim.SGD(torch.nn.Linear(2, 2).double().parameters(), lr=0.1))


def test_larc_wrapped_optimizer():
    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 2)
    model = copy.deepcopy(reference).half()
    with torch.no_grad():
        for p, q in zip(reference.parameters(), model.parameters(), strict=True):
            p.copy_(q.float())
    x = torch.randn(8, 4).half()
    larc = LARC(torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=1e-2))
    optimizer = FP16_Optimizer(larc, static_loss_scale=8.0, verbose=False)
    assert all(m.dtype == torch.float32 for m in _masters(optimizer))
    ref_larc = LARC(torch.optim.SGD(reference.parameters(), lr=0.1, weight_decay=1e-2))
    for _ in range(3):
        optimizer.zero_grad()
        optimizer.backward(model(x).float().pow(2).mean())
        optimizer.step()
        ref_larc.zero_grad()
        reference(x.float()).pow(2).mean().backward()
        ref_larc.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.float(), q, atol=2e-3, rtol=2e-3)


def test_closure_reruns_on_overflow_and_refreshes_the_model(capsys):
    model = _model()
    optimizer = _dynamic(model, init_scale=2.0**8)
    calls = []

    def closure():
        optimizer.zero_grad()
        loss = _loss(model, float("inf") if not calls else 1.0)
        calls.append(1)
        optimizer.backward(loss)
        return loss

    weights = [p.detach().clone() for p in model.parameters()]
    optimizer.step(closure)
    assert len(calls) == 2 and optimizer.loss_scale == 128.0 and not optimizer.overflow
    assert "OVERFLOW within closure! Skipping step, reducing loss scale to 128.0" in capsys.readouterr().out
    assert not all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    assert optimizer.first_closure_call_this_step

    model = _model()
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    optimizer = FP16_Optimizer(lbfgs, static_loss_scale=4.0, verbose=False)
    fresh = []

    def lbfgs_closure():  # from the second call on, the model holds the masters the optimizer moved
        fresh.append(
            all(torch.equal(p, m.half()) for p, m in zip(model.parameters(), _masters(optimizer), strict=True))
        )
        optimizer.zero_grad()
        loss = _loss(model)
        optimizer.backward(loss)
        return loss

    optimizer.step(lbfgs_closure)
    assert len(fresh) > 1 and all(fresh)
    assert all(torch.equal(p, m.half()) for p, m in zip(model.parameters(), _masters(optimizer), strict=True))


def test_load_state_dict_reads_apex_checkpoints():
    model = _model()
    optimizer = _dynamic(model)
    optimizer.backward(_loss(model))
    optimizer.step()
    saved = optimizer.state_dict()
    masters = [[m.detach() + 1.0 for m in g] for g in optimizer.fp32_from_fp16_groups]
    apex_scaler = types.SimpleNamespace(
        _loss_scale=1024.0, _unskipped=7, dynamic=True, _scale_seq_len=10, _min_loss_scale=None, _max_loss_scale=4096.0
    )
    restored = _dynamic(_model())
    restored.load_state_dict({**saved, "loss_scaler": apex_scaler, "fp32_from_fp16": masters})
    assert restored.loss_scale == 1024.0 and restored.loss_scaler._unskipped == 7
    assert restored.loss_scaler._scale_seq_len == 10 and restored.loss_scaler._max_loss_scale == 4096.0
    for got, want in zip(restored.all_fp32_from_fp16_params, [m for g in masters for m in g], strict=True):
        assert torch.equal(got, want)
    assert all(
        torch.equal(p, m.half())
        for p, m in zip(restored.all_fp16_params, restored.all_fp32_from_fp16_params, strict=True)
    )
    restored.load_state_dict(saved)  # ampkit's own form: the scale is brought under the cap the Apex one restored
    assert restored.loss_scale == 4096.0 < optimizer.loss_scale and restored.loss_scaler._unskipped == 1
    restored = _dynamic(_model())
    restored.load_state_dict(saved)  # ampkit's own form: scaler dict, flat masters
    assert restored.loss_scale == optimizer.loss_scale and restored.loss_scaler._unskipped == 1
    for got, want in zip(restored.all_fp32_from_fp16_params, optimizer.all_fp32_from_fp16_params, strict=True):
        assert torch.equal(got, want)


def _frozen_first_layer(momentum=0.0):
    """_model() with its first layer frozen (a fine-tuned backbone) though the optimizer holds every param."""
    model = _model()
    model[0].requires_grad_(False)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    return model, FP16_Optimizer(sgd, dynamic_loss_scale=True, verbose=False)


def _are(tensors, others) -> bool:
    """Whether ``tensors`` are ``others`` themselves, one for one."""
    others = list(others)
    return len(tensors) == len(others) and all(t is o for t, o in zip(tensors, others, strict=True))


def _train(model, optimizer, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        optimizer.backward(model(torch.randn(8, 4, generator=gen).half()).float().pow(2).mean())
        optimizer.step()


def test_a_frozen_param_stays_in_its_group_without_an_fp32_copy_as_apex():
    """Apex's FP16_Optimizer skipped a param with requires_grad False: it stayed in its group as it was, the fp16
    param, in none of the lists. ampkit made it an fp32 master too ("for unfreezing"): 4 bytes a param for nothing."""
    model, optimizer = _frozen_first_layer()
    frozen = list(model[0].parameters())
    held = _masters(optimizer)
    assert _are(held[:2], frozen) and [m.dtype for m in held[2:]] == [torch.float32] * 2
    assert optimizer.fp16_groups == [[model[2].weight, model[2].bias]]
    _train(model, optimizer, 2, seed=3)
    state = optimizer.state_dict()
    assert [len(g["params"]) for g in state["optimizer_state_dict"]["param_groups"]] == [4]
    assert [m is None for m in state["fp32_from_fp16"]] == [True, True, False, False]

    restored_model, restored = _frozen_first_layer()
    restored_model.load_state_dict(model.state_dict())
    restored.load_state_dict(state)
    assert _are(_masters(restored)[:2], restored_model[0].parameters())
    assert all(torch.equal(a, b) for a, b in zip(_masters(restored), _masters(optimizer), strict=True))
    # a checkpoint of ampkit before this (a master for every fp16 param, a frozen one's equal to its value) loads: the
    # frozen params keep their values and get no master
    older = [p.detach().float() for p in frozen] + state["fp32_from_fp16"][2:]
    restored.load_state_dict({**state, "fp32_from_fp16": older})
    assert _are(_masters(restored)[:2], restored_model[0].parameters())
    assert all(torch.equal(a, b) for a, b in zip(restored_model.parameters(), model.parameters(), strict=True))

    # unfrozen, in the original and the restored run alike: the next backward gives the layer its master
    before = model[0].weight.detach().clone()
    for m, o in ((model, optimizer), (restored_model, restored)):
        m[0].requires_grad_(True)
        _train(m, o, 2, seed=4)
        assert [t.dtype for t in _masters(o)] == [torch.float32] * 4
    assert not torch.equal(model[0].weight, before)
    for a, b in zip(restored_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_param_frozen_after_it_trained_gets_its_master_and_state_back_from_a_checkpoint():
    """A layer that trained, then froze, keeps its fp32 master and momentum; a restored optimizer (its layer frozen at
    wrapping, so without a master) takes both back from the checkpoint, and trains on as the original once unfrozen."""
    model, optimizer = _frozen_first_layer(momentum=0.9)
    model[0].requires_grad_(True)
    _train(model, optimizer, 2, seed=3)
    model[0].requires_grad_(False)
    buffer = io.BytesIO()  # through a file, as a checkpoint: in memory the two optimizers would share state tensors
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    restored_model, restored = _frozen_first_layer(momentum=0.9)
    restored_model.load_state_dict(model.state_dict())
    restored.load_state_dict(state)
    for got, want in zip(_masters(restored), _masters(optimizer), strict=True):
        assert got.dtype == torch.float32 and torch.equal(got, want)
        assert torch.equal(restored.state[got]["momentum_buffer"], optimizer.state[want]["momentum_buffer"])
    for m, o in ((model, optimizer), (restored_model, restored)):
        m[0].requires_grad_(True)
        _train(m, o, 2, seed=4)
    for a, b in zip(restored_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
