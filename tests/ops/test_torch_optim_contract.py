"""The contracts of ``torch.optim.Optimizer`` that code swapping in a fused optimizer relies on, held by every fused
optimizer under both implementations (the C++ kernels and the pure-PyTorch references): saving and resuming,
copying, param groups, hooks, closures, gradients left out, ``maximize`` and torch's own state dicts."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from fused_optimizer_cases import OPTIMIZERS, SHAPES
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import ampkit.compat.optimizers as apex_optimizers
from ampkit.compat.legacy_fused_adam import LegacyFusedAdam
from ampkit.ops.optimizers import FusedAdadelta, FusedAdagrad, FusedAdam, FusedRMSprop, FusedRMSpropTF, FusedSGD

# Apex's names (``apex.optimizers`` through the shim), with their defaults: subclasses of the fused optimizers, with
# Apex's attributes, FusedAdam's own step and, for FusedAdam, FusedLAMB and FusedNovoGrad, step counts per group.
APEX_OPTIMIZERS = {f"apex_{name}": getattr(apex_optimizers, name) for name in apex_optimizers._APEX_NAMES}
# Flags torch.optim added over its versions; a checkpoint written before them lacks them.
NEWER_TORCH_FLAGS = ("maximize", "foreach", "fused", "differentiable", "capturable", "decoupled_weight_decay")


@pytest.fixture(params=["kernel", "reference"], autouse=True)
def ops_mode(request, monkeypatch):
    monkeypatch.setenv("AMPKIT_OPS", request.param)
    return request.param


def make_params(shapes=SHAPES):
    generator = torch.Generator().manual_seed(1)
    return [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]


def copies(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def grads_of(step, shapes=SHAPES):
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=generator) for s in shapes]


def run(optimizer, params, start, steps):
    """Steps ``start`` .. ``start + steps - 1``, each with the same fresh gradients whichever optimizer runs it."""
    for step in range(start, start + steps):
        for p, g in zip(params, grads_of(step), strict=True):
            p.grad = g.clone()
        optimizer.step()


def assert_same(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


# ----------------------------------------------------------------- saving, resuming, copying


@pytest.mark.parametrize("how", ["state_dict", "torch_save_weights_only", "deepcopy", "pickle"])
@pytest.mark.parametrize("name", [*OPTIMIZERS, *APEX_OPTIMIZERS])
def test_a_saved_or_copied_optimizer_continues_bit_identically_and_saves_the_same_state(name, how):
    """torch's rule: an optimizer resumed from its ``state_dict()`` (or a deep copy, or a pickle) steps exactly as
    the one it came from, and then saves the same state dict. A resumed fused optimizer used to save torch's own
    ``differentiable`` option in every group, which the original had not."""
    make = {**OPTIMIZERS, **APEX_OPTIMIZERS}[name]
    params = make_params()
    optimizer = make(params)
    run(optimizer, params, 0, 3)
    if how in ("deepcopy", "pickle"):
        twin = (lambda x: copy.deepcopy(x)) if how == "deepcopy" else (lambda x: pickle.loads(pickle.dumps(x)))
        resumed_params, resumed = twin((params, optimizer))
    else:
        resumed_params = copies(params)
        resumed = make(resumed_params)
        saved = copy.deepcopy(optimizer.state_dict())
        if how == "torch_save_weights_only":
            buffer = io.BytesIO()
            torch.save(optimizer.state_dict(), buffer)
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=True)
        resumed.load_state_dict(saved)
    run(optimizer, params, 3, 3)
    run(resumed, resumed_params, 3, 3)
    assert_same(resumed_params, params)
    assert_same(resumed.state_dict(), optimizer.state_dict())


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_resumed_optimizers_param_groups_hold_what_the_saved_ones_held_and_nothing_else(name):
    """torch restores each saved group whole: keys of the user's own (a group's name for logging) come back, and
    nothing is added. A resumed FusedAdam kept torch's ``decoupled_weight_decay``, which it saves beside
    ``adam_w_mode`` for torch.optim's Adam, in its groups: a key its step never reads, there after a resume only."""
    make = OPTIMIZERS[name]
    params = make_params()
    optimizer = make([{"params": params[:2], "name": "backbone"}, {"params": params[2:], "lr": 1e-3, "tags": ["head"]}])
    run(optimizer, params, 0, 1)
    resumed_params = copies(params)
    resumed = make([{"params": resumed_params[:2]}, {"params": resumed_params[2:]}])
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))

    def settings(opt):
        return [{key: value for key, value in group.items() if key != "params"} for group in opt.param_groups]

    assert settings(resumed) == settings(optimizer)
    assert settings(resumed)[0]["name"] == "backbone" and settings(resumed)[1]["tags"] == ["head"]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_deep_copy_has_the_same_public_attributes(name):
    params = make_params()
    optimizer = OPTIMIZERS[name](params)
    run(optimizer, params, 0, 2)

    def public(obj):
        return {key for key in vars(obj) if not key.startswith("_")}

    assert public(copy.deepcopy(optimizer)) == public(optimizer)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_checkpoint_from_before_torchs_newer_flags_resumes_as_the_run_it_came_from(name):
    make = OPTIMIZERS[name]
    params = make_params()
    optimizer = make(params)
    run(optimizer, params, 0, 3)
    old = copy.deepcopy(optimizer.state_dict())
    for group in old["param_groups"]:
        for flag in NEWER_TORCH_FLAGS:
            group.pop(flag, None)
    resumed_params = copies(params)
    resumed = make(resumed_params)
    resumed.load_state_dict(old)
    run(optimizer, params, 3, 2)
    run(resumed, resumed_params, 3, 2)
    assert_same(resumed_params, params)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_step_count_saved_as_a_number_resumes_as_the_tensor_did(name):
    make = OPTIMIZERS[name]
    params = make_params()
    optimizer = make(params)
    run(optimizer, params, 0, 3)
    saved = copy.deepcopy(optimizer.state_dict())
    for state in saved["state"].values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].item()
    resumed_params = copies(params)
    resumed = make(resumed_params)
    resumed.load_state_dict(saved)
    run(optimizer, params, 3, 2)
    run(resumed, resumed_params, 3, 2)
    assert_same(resumed_params, params)


@pytest.mark.parametrize(("named_first", "named_second"), [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_named_parameters_are_saved_by_name_and_load_either_way(name, named_first, named_second):
    make = OPTIMIZERS[name]
    model = torch.nn.Linear(3, 2)
    optimizer = make(model.named_parameters() if named_first else model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    resumed = make(model.named_parameters() if named_second else model.parameters())
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    model(torch.randn(4, 3)).sum().backward()
    resumed.step()
    assert resumed.state_dict()["param_groups"][0]["param_names"] == ["weight", "bias"]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_state_dict_naming_the_parameters_in_another_order_is_refused_and_a_reordering_pre_hook_loads_it(name):
    """torch pairs saved states with parameters by position: two ``Linear(3, 3)`` listed the other way round took
    each other's state without a word (their shapes agree). Where both sides name their parameters the load is
    refused, the optimizer keeping its state; a pre-hook that reorders the state dict by name (torch's advice), or
    torch.distributed.checkpoint, loads each state onto its own parameter."""
    make = OPTIMIZERS[name]
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    optimizer = make(model.named_parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    named = list(model.named_parameters())
    reordered = make(named[2:] + named[:2])
    kept = copy.deepcopy(reordered.state_dict())  # empty, or Adagrad's state from construction
    with pytest.raises(ValueError, match=r"another order \(parameter 0 is '0.weight' there, '1.weight' here\)"):
        reordered.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert_same(reordered.state_dict()["state"], kept["state"])
    not_names = copy.deepcopy(optimizer.state_dict())  # a tool's state dict whose param_names are no names
    not_names["param_groups"][0]["param_names"][1] = 7
    make(named[2:] + named[:2]).load_state_dict(not_names)  # by position, as torch loads it

    def by_name(opt, state_dict):
        saved, ours = state_dict["param_groups"][0], opt.param_groups[0]["param_names"]
        ids = dict(zip(saved["param_names"], saved["params"], strict=True))
        state_dict["param_groups"][0] = {**saved, "params": [ids[n] for n in ours], "param_names": ours}

    reordered.register_load_state_dict_pre_hook(by_name)
    reordered.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for p in model.parameters():
        assert_same(reordered.state[p], optimizer.state[p])
    # torch.distributed.checkpoint maps by name itself and hands the groups over in this optimizer's order, with their
    # names as saved: not refused.
    by_dcp = make(named[2:] + named[:2])
    set_optimizer_state_dict(model, by_dcp, get_optimizer_state_dict(model, optimizer))
    for p in model.parameters():
        assert_same(by_dcp.state[p], optimizer.state[p])


# ----------------------------------------------------------------- param groups and hyper-parameters


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_group_added_mid_run_steps_as_one_there_from_the_start_whose_params_had_no_grads(name):
    """``add_param_group`` mid-run (unfreezing a backbone): the new group keeps its own lr and its parameters start
    from fresh state, exactly as a group present from the start whose parameters had no gradients until then."""
    make = OPTIMIZERS[name]
    early, late = make_params(), make_params()
    growing = make(early[:2])
    from_start = make([{"params": late[:2]}, {"params": late[2:], "lr": 3e-3}])
    for step in range(5):
        if step == 2:
            growing.add_param_group({"params": early[2:], "lr": 3e-3})
        for params, optimizer in ((early, growing), (late, from_start)):
            for i, (p, g) in enumerate(zip(params, grads_of(step), strict=True)):
                p.grad = g.clone() if i < 2 or step >= 2 else None
            optimizer.step()
    assert_same(early, late)
    assert growing.state_dict()["param_groups"][1]["lr"] == 3e-3


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_each_group_steps_with_its_own_lr(name):
    params = make_params()
    frozen = params[0].detach().clone()
    optimizer = OPTIMIZERS[name]([{"params": params[:1], "lr": 0.0, "weight_decay": 0.0}, {"params": params[1:]}])
    before = [p.detach().clone() for p in params[1:]]
    run(optimizer, params, 0, 2)
    assert_same(params[0], frozen)
    assert all(not torch.equal(p, b) for p, b in zip(params[1:], before, strict=True))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_each_group_with_its_own_hyperparameters_steps_as_an_optimizer_of_that_group_alone(name):
    """Per-group lr, weight decay, betas or momentum and eps: a group of a shared optimizer (kept buckets, one step
    for all) steps exactly as an optimizer holding only that group. LAMB clips by the norm over every group, so
    its clipping is off here."""
    make = OPTIMIZERS[name]
    defaults = make(make_params()).defaults
    own = {"lr": defaults["lr"] / 2, "weight_decay": 0.05}
    if "eps" in defaults:
        own["eps"] = defaults["eps"] * 10
    if "betas" in defaults:
        own["betas"] = (0.8, 0.99)
    if defaults.get("momentum"):
        own["momentum"] = 0.5
    shared = {"max_grad_norm": 0.0} if "max_grad_norm" in defaults else {}
    params, alone = make_params(), make_params()
    together = make([{"params": params[:2], **shared}, {"params": params[2:], **shared, **own}])
    separate = [make([{"params": alone[:2], **shared}]), make([{"params": alone[2:], **shared, **own}])]
    for step in range(3):
        for p, q, g in zip(params, alone, grads_of(step), strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        together.step()
        for optimizer in separate:
            optimizer.step()
    assert_same(params, alone)


@pytest.mark.parametrize("where", ["constructor", "group"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_an_lr_given_as_a_0_dim_tensor_steps_as_the_number(name, where):
    """A tensor lr (torch's way to change it without recompiling) steps as the float; its value is a float32, so the
    result may differ in the last bits (torch's own tolerance)."""
    make = OPTIMIZERS[name]
    params, twins = make_params(), make_params()
    optimizer = make(params)
    lr = torch.tensor(optimizer.defaults["lr"])
    cls = type(optimizer)
    tensor_lr = cls(twins, lr=lr) if where == "constructor" else make([{"params": twins, "lr": lr}])
    if where == "constructor":
        optimizer = cls(params, lr=optimizer.defaults["lr"])
    run(optimizer, params, 0, 3)
    run(tensor_lr, twins, 0, 3)
    torch.testing.assert_close(twins, params)
    assert torch.is_tensor(tensor_lr.param_groups[0]["lr"])


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_maximize_ascends_as_a_step_on_the_negated_gradients(name):
    """torch's ``maximize=True`` is a step on ``-grad`` (weight decay still shrinks the weights), for every fused
    optimizer, given to the constructor or in a group. LAMB and NovoGrad took a group's ``maximize`` and minimized."""
    make = OPTIMIZERS[name]
    by_constructor, in_group, negated = make_params(), make_params(), make_params()
    optimizers = [make(by_constructor, maximize=True), make([{"params": in_group, "maximize": True}]), make(negated)]
    for step in range(3):
        for trio in zip(by_constructor, in_group, negated, grads_of(step), strict=True):
            *ascending, descending, g = trio
            for p in ascending:
                p.grad = g.clone()
            descending.grad = -g
        for optimizer in optimizers:
            optimizer.step()
    assert_same(by_constructor, negated)
    assert_same(in_group, negated)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_weight_decay_shrinks_weights_whose_gradients_are_zero_and_nothing_moves_without_it(name):
    decayed, kept = make_params(), make_params()
    with_decay = OPTIMIZERS[name](decayed)
    without = OPTIMIZERS[name](kept)
    for group in without.param_groups:
        group["weight_decay"] = 0.0
    before = [p.detach().clone() for p in kept]
    for _ in range(3):
        for p in (*decayed, *kept):
            p.grad = torch.zeros_like(p)
        with_decay.step()
        without.step()
    assert_same(kept, before)
    assert all(p.norm() < b.norm() for p, b in zip(decayed, before, strict=True))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_steps_lower_a_loss_and_maximize_raises_it(name):
    def losses(maximize):
        torch.manual_seed(0)
        weight, bias, x = torch.nn.Parameter(torch.randn(10, 5)), torch.nn.Parameter(torch.randn(10)), torch.randn(5)
        optimizer = OPTIMIZERS[name]([weight, bias], maximize=maximize)
        for group in optimizer.param_groups:
            group["lr"] = 1e-3 if group["lr"] < 1.0 else group["lr"]  # a small step for a quadratic of curvature ~10
        seen = []
        for _ in range(20):
            optimizer.zero_grad()
            loss = (weight.mv(x) + bias).pow(2).sum()
            loss.backward()
            seen.append(loss.item())
            optimizer.step()
        return seen

    descending, ascending = losses(False), losses(True)
    assert descending[-1] < descending[0]
    assert ascending[-1] > ascending[0]


# ----------------------------------------------------------------- step: closures, missing gradients, zero_grad


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_step_with_a_closure_returns_its_loss_and_steps_on_the_gradients_it_made(name):
    make = OPTIMIZERS[name]
    params, twins = make_params(), make_params()
    optimizer, plain = make(params), make(twins)
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        optimizer.zero_grad()
        loss = sum((p * g).sum() for p, g in zip(params, grads_of(0), strict=True))
        loss.backward()
        return loss

    with torch.no_grad():  # the closure's backward still runs: step enables grad for it, as torch.optim's does
        loss = optimizer.step(closure)
    run(plain, twins, 0, 1)
    assert calls == [True]
    assert torch.is_tensor(loss) and loss.requires_grad
    assert_same(params, twins)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_parameters_without_gradients_are_left_alone_and_get_no_state(name):
    params = make_params()
    optimizer = OPTIMIZERS[name](params)
    untouched = params[1].detach().clone()
    at_construction = copy.deepcopy(optimizer.state.get(params[1], {}))
    for step in range(2):
        for i, (p, g) in enumerate(zip(params, grads_of(step), strict=True)):
            p.grad = None if i == 1 else g
        optimizer.step()
    assert_same(params[1], untouched)
    assert_same(optimizer.state.get(params[1], {}), at_construction)  # none, or Adagrad's initial state, as torch's
    assert all(len(optimizer.state[p]) > 0 for p in (params[0], params[2]))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_step_with_no_gradients_at_all_changes_nothing(name):
    params = make_params()
    optimizer = OPTIMIZERS[name](params)
    before = [p.detach().clone() for p in params]
    saved = copy.deepcopy(optimizer.state_dict())
    optimizer.step()
    assert_same(params, before)
    assert_same(optimizer.state_dict(), saved)  # no state made (Adagrad's, made at construction as torch's, kept)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_zero_grad_without_set_to_none_zeroes_the_same_tensors_in_place(name):
    params = make_params()
    optimizer = OPTIMIZERS[name](params)
    run(optimizer, params, 0, 1)
    grads = [p.grad for p in params]
    optimizer.zero_grad(set_to_none=False)
    assert all(p.grad is g and not g.any() for p, g in zip(params, grads, strict=True))
    optimizer.zero_grad()
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_empty_and_0_dim_parameters_step_with_the_rest(name):
    params = [*make_params(), torch.nn.Parameter(torch.empty(0)), torch.nn.Parameter(torch.randn(()))]
    optimizer = OPTIMIZERS[name](params)
    for _ in range(2):
        for p in params:
            p.grad = torch.rand_like(p)
        optimizer.step()
    assert params[-1] in optimizer.state and torch.isfinite(params[-1])


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_complex_parameters_which_torch_optim_steps_as_real_pairs_are_refused_by_dtype(name):
    """A deliberate difference: the kernels step real floating tensors only. The error names the dtype, and a
    refused ``add_param_group`` leaves the optimizer as it was."""
    complex_param = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"params\[0\] has dtype torch.complex64; expected float32"):
        OPTIMIZERS[name]([complex_param])
    params = make_params()
    optimizer = OPTIMIZERS[name](params)
    with pytest.raises(TypeError, match="torch.complex64"):
        optimizer.add_param_group({"params": [complex_param]})
    assert len(optimizer.param_groups) == 1
    run(optimizer, params, 0, 1)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_torchs_differentiable_switch_on_is_refused_in_a_group_or_a_checkpoint_and_off_loads(name):
    """torch.optim's ``differentiable=True`` (meta-learning through the update) cannot hold for kernels stepping in
    place under ``no_grad``: given in a param group, or in a torch checkpoint's groups, it was kept and ignored."""
    params = make_params()
    optimizer = OPTIMIZERS[name](params)
    run(optimizer, params, 0, 1)
    with pytest.raises(ValueError, match=r"Invalid differentiable of a param group: True \(fused optimizers"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], "differentiable": True})
    assert len(optimizer.param_groups) == 1
    saved = optimizer.state_dict()
    from_torch = copy.deepcopy(saved)
    from_torch["param_groups"][0]["differentiable"] = True
    with pytest.raises(ValueError, match=r"saved param_groups\[0\]: Invalid differentiable"):
        optimizer.load_state_dict(from_torch)
    assert_same(optimizer.state_dict(), saved)
    from_torch["param_groups"][0]["differentiable"] = False  # as every torch.optim checkpoint has it
    optimizer.load_state_dict(from_torch)
    run(optimizer, params, 1, 1)


# ----------------------------------------------------------------- hooks


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_step_hooks_run_global_then_own_around_the_step_until_removed(name):
    params = make_params()
    optimizer = OPTIMIZERS[name](params)
    calls = []
    handles = [
        register_optimizer_step_pre_hook(lambda opt, args, kwargs: calls.append("global pre")),
        register_optimizer_step_post_hook(lambda opt, args, kwargs: calls.append("global post")),
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre")),
        optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append(("post", opt.state[params[0]] != {}))),
    ]
    try:
        run(optimizer, params, 0, 1)
    finally:
        for handle in handles:
            handle.remove()
    run(optimizer, params, 1, 1)
    assert calls == ["global pre", "pre", ("post", True), "global post"]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_step_pre_hook_may_replace_the_steps_arguments(name):
    params = make_params()
    optimizer = OPTIMIZERS[name](params)
    closure_calls = []

    def add_closure(opt, args, kwargs):  # args[0] is the optimizer itself
        return (*args, lambda: closure_calls.append(1) or 1.0), kwargs

    optimizer.register_step_pre_hook(add_closure)
    assert optimizer.step() == 1.0
    assert closure_calls == [1]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_dict_hooks_see_and_change_what_is_saved(name):
    params = make_params()
    optimizer = OPTIMIZERS[name](params)
    run(optimizer, params, 0, 1)
    optimizer.register_state_dict_pre_hook(lambda opt: opt.state.__setitem__("note", 1))
    assert optimizer.state_dict()["state"]["note"] == 1

    def post(opt, state_dict):
        state_dict["state"].pop("note")
        return {**state_dict, "saved_by": "post hook"}

    optimizer.register_state_dict_post_hook(post)
    saved = optimizer.state_dict()
    assert saved["saved_by"] == "post hook" and "note" not in saved["state"]
    del optimizer.state["note"]
    run(optimizer, params, 1, 1)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_load_state_dict_hooks_edit_in_place_or_replace_in_order_and_post_hooks_see_the_result(name):
    params = make_params()
    optimizer = OPTIMIZERS[name](params)
    run(optimizer, params, 0, 1)
    saved = optimizer.state_dict()

    def edit_in_place(opt, state_dict):
        state_dict["param_groups"][0]["lr"] = 0.002

    def replace(opt, state_dict):
        replaced = copy.deepcopy(state_dict)
        replaced["param_groups"][0]["lr"] = 0.003
        return replaced

    seen = []
    optimizer.register_load_state_dict_pre_hook(edit_in_place)
    optimizer.register_load_state_dict_post_hook(lambda opt: seen.append(opt.param_groups[0]["lr"]))
    optimizer.load_state_dict(copy.deepcopy(saved))
    optimizer.register_load_state_dict_pre_hook(replace, prepend=True)  # runs first: the in-place edit wins
    optimizer.load_state_dict(copy.deepcopy(saved))
    assert seen == [0.002, 0.002]
    run(optimizer, params, 1, 1)


@pytest.mark.parametrize("name", list(APEX_OPTIMIZERS))
def test_apexs_names_run_each_step_hook_once_whatever_was_built_before(name):
    """Apex's names are subclasses of the fused optimizers, and torch wraps a class's ``step`` in its hooks when the
    first optimizer of that class is built. Apex's FusedAdam has a step of its own calling its base's: once a plain
    ``FusedAdam`` had been built in the process, every hook ran twice and a pre-hook adding a closure added two."""
    cls = APEX_OPTIMIZERS[name]
    cls.__base__([torch.nn.Parameter(torch.zeros(2))])  # the base class's step is wrapped too now
    params = make_params()
    optimizer = cls(params)
    calls = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: ((*args, lambda: calls.append("closure")), kwargs))
    run(optimizer, params, 0, 1)
    assert calls == ["pre", "closure", "post"]


# ----------------------------------------------------------------- torch.optim's own state dicts

# The fused optimizer beside its torch.optim counterpart, with torch's fused kernel where it has one.
TORCH_TWINS = {
    "adamw": (lambda p, b: FusedAdam(p, lr=1e-2, weight_decay=0.01, backend=b), torch.optim.AdamW, True),
    "adam_l2": (
        lambda p, b: FusedAdam(p, lr=1e-2, weight_decay=0.01, adam_w_mode=False, backend=b),
        torch.optim.Adam,
        True,
    ),
    "sgd": (lambda p, b: FusedSGD(p, lr=0.1, momentum=0.9, weight_decay=0.01, backend=b), torch.optim.SGD, True),
    "adagrad": (lambda p, b: FusedAdagrad(p, lr=0.1, weight_decay=0.01, backend=b), torch.optim.Adagrad, True),
    "rmsprop": (lambda p, b: FusedRMSprop(p, lr=1e-2, momentum=0.9, weight_decay=0.01), torch.optim.RMSprop, False),
    "adadelta": (lambda p, b: FusedAdadelta(p, lr=1.0, weight_decay=0.01), torch.optim.Adadelta, False),
}


def torch_twin(name, params):
    """The torch.optim counterpart of ``TORCH_TWINS[name]``, built with the fused one's hyper-parameters."""
    make, cls, fused = TORCH_TWINS[name]
    defaults = make(copies(params), None).defaults
    options = {k: v for k, v in defaults.items() if k in ("lr", "momentum", "weight_decay", "betas")}
    return cls(params, **options, **({"fused": True} if fused else {}))


@pytest.mark.parametrize("backend", ["ampkit", "torch"])
@pytest.mark.parametrize("name", list(TORCH_TWINS))
def test_a_run_through_torch_optims_state_dict_and_back_continues_bit_identically(name, backend):
    """Fused -> torch.optim -> fused: the state survives both loads exactly."""
    make = TORCH_TWINS[name][0]
    params = make_params()
    optimizer = make(params, backend)
    run(optimizer, params, 0, 3)
    through_torch = torch_twin(name, copies(params))
    through_torch.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    resumed_params = copies(params)
    resumed = make(resumed_params, backend)
    resumed.load_state_dict(copy.deepcopy(through_torch.state_dict()))
    run(optimizer, params, 3, 3)
    run(resumed, resumed_params, 3, 3)
    assert_same(resumed_params, params)


@pytest.mark.parametrize("name", ["adamw", "adam_l2", "sgd", "adagrad"])
def test_a_torch_fused_run_resumed_on_torchs_kernel_continues_bit_identically(name):
    """``backend="torch"`` runs torch's fused op: a run of ``torch.optim.X(fused=True)`` resumed in the fused
    optimizer goes on exactly as the torch run does."""
    make = TORCH_TWINS[name][0]
    theirs = make_params()
    optimizer = torch_twin(name, theirs)
    run(optimizer, theirs, 0, 3)
    ours = copies(theirs)
    resumed = make(ours, "torch")
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    run(optimizer, theirs, 3, 3)
    run(resumed, ours, 3, 3)
    assert_same(ours, theirs)


@pytest.mark.parametrize("name", ["adamw", "adam_l2", "sgd", "adagrad"])
def test_torch_optims_fused_form_resumes_a_run_of_torchs_kernel_bit_identically(name):
    """The other way round: ``torch.optim.X(fused=True)`` loading a ``backend="torch"`` run goes on exactly as it.
    The state dict names no ``fused`` switch and torch takes the loaded group's: each falls back to its for-loop form
    (rounded in another order, which matched on some CPUs only) unless the switch is set again, as the docs say."""
    make = TORCH_TWINS[name][0]
    ours = make_params()
    optimizer = make(ours, "torch")
    run(optimizer, ours, 0, 3)
    theirs = copies(ours)
    resumed = torch_twin(name, theirs)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert all(not group["fused"] for group in resumed.param_groups)  # torch's kernel is dropped at the load
    for group in resumed.param_groups:
        group["fused"] = True
    run(optimizer, ours, 3, 3)
    run(resumed, theirs, 3, 3)
    assert_same(theirs, ours)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_compiled_function_calling_step_trains_as_the_eager_step(name):
    make = OPTIMIZERS[name]
    models = [torch.nn.Linear(4, 2) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [make(m.parameters()) for m in models]
    x = torch.randn(8, 4)

    def train_step(model, optimizer):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    compiled = torch.compile(train_step, backend="eager")
    for _ in range(2):
        train_step(models[0], optimizers[0])
        compiled(models[1], optimizers[1])
    assert_same(list(models[1].parameters()), list(models[0].parameters()))


@pytest.mark.parametrize("name", list(TORCH_TWINS))
def test_before_the_first_step_the_state_is_torch_optims_and_a_step_without_gradients_keeps_it(name):
    """What torch.optim holds before any step, side by side: nothing, except Adagrad, whose constructor makes each
    parameter's ``sum`` and ``step`` (FusedAdagrad made them at the first step, so its ``state_dict()`` was empty and
    ``state[p]["sum"]`` a KeyError). A step with no gradient at all changes neither; a group added later gets its
    state at its first step in both."""
    make = TORCH_TWINS[name][0]
    ours, theirs = make_params(), make_params()
    optimizer, twin = make(ours, None), torch_twin(name, theirs)
    assert_same(optimizer.state_dict()["state"], twin.state_dict()["state"])
    for opt in (optimizer, twin):
        opt.step()
    assert_same(optimizer.state_dict()["state"], twin.state_dict()["state"])
    assert_same(ours, theirs)
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    twin.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    assert_same(optimizer.state_dict()["state"], twin.state_dict()["state"])


def test_adagrads_initial_accumulator_is_in_its_state_from_construction_and_resumes_as_torchs():
    """``initial_accumulator_value`` read back from the state before any step, as torch's; a checkpoint saved before
    stepping, by torch.optim.Adagrad or by an earlier FusedAdagrad (no state at all), resumes as torch's run. Unlike
    torch, which fills every group from the constructor's value, a group's own value is kept."""
    options = dict(lr=0.1, lr_decay=1e-3, weight_decay=0.01, initial_accumulator_value=0.3)
    ours, theirs = make_params(), make_params()
    optimizer = FusedAdagrad([{"params": ours[:2]}, {"params": ours[2:], "initial_accumulator_value": 1.5}], **options)
    assert all(torch.equal(optimizer.state[p]["sum"], torch.full_like(p, 0.3)) for p in ours[:2])
    assert torch.equal(optimizer.state[ours[2]]["sum"], torch.full_like(ours[2], 1.5))
    assert all(optimizer.state[p]["step"] == 0 for p in ours)

    twin = torch.optim.Adagrad(theirs, **options)
    from_torch = FusedAdagrad(copies(theirs), lr=0.1, lr_decay=1e-3, weight_decay=0.01)  # its own value: 0
    from_torch.load_state_dict(copy.deepcopy(twin.state_dict()))
    earlier = FusedAdagrad(copies(theirs), **options)  # a checkpoint of an earlier FusedAdagrad, saved before a step
    earlier.load_state_dict({"state": {}, "param_groups": copy.deepcopy(twin.state_dict()["param_groups"])})
    resumed = [from_torch, earlier]
    run(twin, theirs, 0, 3)
    for opt in resumed:
        run(opt, [p for group in opt.param_groups for p in group["params"]], 0, 3)
        torch.testing.assert_close([p for group in opt.param_groups for p in group["params"]], theirs)
        torch.testing.assert_close(opt.state_dict()["state"], twin.state_dict()["state"])


def test_adagrad_share_memory_shares_each_sum_as_torchs_for_hogwild_training():
    """``torch.optim.Adagrad.share_memory()`` (Hogwild: processes stepping one model) was an AttributeError; a group
    added since construction, whose state torch.optim would not have yet (a KeyError there), is shared too."""
    params = make_params()
    optimizer = FusedAdagrad(params[:2], lr=0.1, initial_accumulator_value=0.2)
    optimizer.add_param_group({"params": params[2:]})
    twin = torch.optim.Adagrad(copies(params[:2]), lr=0.1, initial_accumulator_value=0.2)
    optimizer.share_memory()
    twin.share_memory()
    assert all(optimizer.state[p]["sum"].is_shared() for p in params)
    assert all(twin.state[p]["sum"].is_shared() for p in twin.param_groups[0]["params"])
    assert_same({i: optimizer.state_dict()["state"][i] for i in (0, 1)}, twin.state_dict()["state"])
    assert_same(optimizer.state_dict()["state"][2]["sum"], torch.full_like(params[2], 0.2))
    run(optimizer, params, 0, 1)
    assert all(optimizer.state[p]["sum"].is_shared() and optimizer.state[p]["step"] == 1 for p in params)


# Each optimizer that ports a torch.optim one, with it: ampkit's, Apex's names and Apex's first FusedAdam
PORTS = [
    (FusedAdam, torch.optim.Adam),
    (FusedAdam, torch.optim.AdamW),
    (FusedSGD, torch.optim.SGD),
    (FusedAdagrad, torch.optim.Adagrad),
    (FusedAdadelta, torch.optim.Adadelta),
    (FusedRMSprop, torch.optim.RMSprop),
    (FusedRMSpropTF, torch.optim.RMSprop),
    (apex_optimizers.FusedAdam, torch.optim.Adam),
    (apex_optimizers.FusedSGD, torch.optim.SGD),
    (apex_optimizers.FusedAdagrad, torch.optim.Adagrad),
    (LegacyFusedAdam, torch.optim.Adam),
]


@pytest.mark.parametrize(("ours", "theirs"), PORTS, ids=lambda c: f"{c.__module__.split('.')[1]}.{c.__name__}")
def test_every_keyword_of_the_torch_twin_is_taken_or_refused_by_name(ours, theirs):
    """A keyword torch.optim's constructor takes was Python's bare "unexpected keyword argument" for the optimizer a
    port swaps in (LegacyFusedAdam's foreach=/fused=/maximize=...): each one is in the signature, and passed at torch's
    default it is taken, or refused naming it where it disagrees with the fused step (FusedAdam's decoupled_weight_decay
    =False beside its default adam_w_mode=True)."""
    import inspect

    keywords = {
        name: parameter.default
        for name, parameter in inspect.signature(theirs.__init__).parameters.items()
        if name not in ("self", "params")
    }
    assert set(keywords) <= set(inspect.signature(ours.__init__).parameters), theirs.__name__
    for name, default in keywords.items():
        try:
            ours(make_params(), **{name: default})
        except (TypeError, ValueError) as error:
            assert name in str(error) and "unexpected keyword" not in str(error), (name, error)
