"""The fused optimizers' argument checks as a class: each hyper-parameter as torch.optim checks it, GradScaler's
tensors as torch's fused ops take them, checked once a step."""

import numpy as np
import pytest
import torch
from fused_optimizer_cases import OPTIMIZERS

from ampkit.ops.optimizers import FusedAdadelta, FusedAdagrad, FusedAdam, FusedRMSprop, FusedSGD, _base


def _model_params():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 4)), torch.nn.Parameter(torch.randn(7))]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("how", ["step", "scaled step", "step_with_grad_factor"])
def test_each_group_is_checked_once_a_step(name, how, monkeypatch):
    """The host-read optimizers (AdamP's first) ran the step-time group check twice: step() checked, then the
    step_with_grad_factor it called checked again."""
    params = _model_params()
    optimizer = OPTIMIZERS[name]([{"params": params[:1]}, {"params": params[1:]}])
    seen = []
    monkeypatch.setattr(_base, "check_group_at_step", lambda owner, index, group: seen.append(index))
    if how == "step":
        optimizer.step()
    elif how == "scaled step":
        optimizer.step(grad_scale=torch.tensor(2.0), found_inf=torch.tensor(0.0))
    else:
        optimizer.step_with_grad_factor(0.5)
    assert seen == [0, 1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_grad_scale_of_another_float_dtype_is_refused_as_torchs_fused_adam_refuses_it(name, dtype):
    """torch.optim.Adam(fused=True) refuses it ('expected scalar type Float'); every fused optimizer here converted
    it to float32 without a word (a float16 scale of 2**16 is inf: the step was skipped for good)."""
    params = _model_params()
    optimizer = OPTIMIZERS[name](params)
    before = [p.detach().clone() for p in params]
    with pytest.raises(TypeError, match=rf"grad_scale must be a float32 one-element tensor .* got a {dtype} tensor"):
        optimizer.step(grad_scale=torch.tensor(2.0, dtype=dtype), found_inf=torch.tensor(0.0))
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    with pytest.raises(RuntimeError, match="expected scalar type Float"):  # torch's own refusal, the spec
        _torch_fused_adam(dtype)


def _torch_fused_adam(dtype):
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    optimizer = torch.optim.Adam([p], fused=True)
    optimizer.grad_scale, optimizer.found_inf = torch.tensor(2.0, dtype=dtype), torch.tensor(0.0)
    optimizer.step()


def _inside(name: str, params, optimizer) -> torch.Tensor:
    """A one-element float32 view into what ``name`` names: the second parameter, its .grad or a state tensor."""
    if name == "param":
        return params[1].data.view(-1)[2:3]
    if name == "grad":
        return params[1].grad.view(-1)[2:3]
    state = next(v for k, v in optimizer.state[params[1]].items() if k != "step" and v.numel() > 1)
    return state.view(-1)[2:3]


@pytest.mark.parametrize("inside", ["param", "grad", "state"])
@pytest.mark.parametrize("argument", ["grad_scale", "found_inf"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_scaler_tensor_inside_a_parameter_its_grad_or_state_is_refused_by_every_optimizer(name, argument, inside):
    """Whoever's kernels run the bucket: torch's fused Adam took a grad_scale inside a gradient and divided the later
    gradients by the scale the step had already changed; the host-read optimizers unscaled by it the same way."""
    params = _model_params()
    optimizer = OPTIMIZERS[name](params, backend="torch") if name.startswith("adam") else OPTIMIZERS[name](params)
    optimizer.step()  # the state exists
    for p in params:
        p.grad = torch.ones_like(p)
    shared = _inside(inside, params, optimizer)
    shared.fill_(0.0 if argument == "found_inf" else 2.0)
    before = [p.detach().clone() for p in params]
    other = {"found_inf": torch.tensor(0.0)} if argument == "grad_scale" else {"grad_scale": torch.tensor(2.0)}
    where = r"param_groups\[0\]\['params'\]\[1\]"
    with pytest.raises(RuntimeError, match=rf"step\(\): {argument} shares memory with {where}.*of its own"):
        optimizer.step(**{argument: shared}, **other)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    optimizer.step(**{argument: shared.clone()}, **other)  # its clone steps


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_scaler_viewing_a_buffer_is_compared_in_full_only_with_tensors_starting_inside_it(name, monkeypatch):
    """A grad_scale/found_inf viewing a larger buffer (a flat buffer of scalars, an all-reduced pair) was compared in
    full with every parameter, gradient and state tensor each step: about 1 ms at 200 parameters. Each now costs an
    address compare, and the step goes on; one inside a parameter is still refused (the test above)."""
    params = _model_params()
    optimizer = OPTIMIZERS[name](params)
    optimizer.step()  # the state exists
    buffer = torch.tensor([2.0, 0.0, 5.0])
    looks = []
    shares_memory = _base.shares_memory
    monkeypatch.setattr(_base, "shares_memory", lambda a, b: looks.append(b) or shares_memory(a, b))
    before = [p.detach().clone() for p in params]
    optimizer.step(grad_scale=buffer[0:1], found_inf=buffer[1:2])
    assert looks == []
    assert not any(torch.equal(p, b) for p, b in zip(params, before, strict=True))


def _one_element_params():
    """A parameter and a one-element one (a scalar temperature, a gain), each with a gradient."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 4)), torch.nn.Parameter(torch.randn(()))]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def _own_one_element(what: str, params, optimizer) -> torch.Tensor:
    """A tensor the step writes that holds its one element alone, as GradScaler's scale does: the one-element
    parameter (by ``.data``, another tensor object), its .grad, or the first one-element state tensor (a step count,
    NovoGrad's per-tensor moment, SGD's momentum of the one-element parameter)."""
    if what == "param":
        return params[1].data
    if what == "grad":
        return params[1].grad
    held = (v for p in params for v in optimizer.state[p].values() if isinstance(v, torch.Tensor))
    return next(v for v in held if v.numel() == 1)


@pytest.mark.parametrize("backend", ["ampkit", "torch"])
@pytest.mark.parametrize("what", ["param", "grad", "state", "param at the first step"])
@pytest.mark.parametrize("argument", ["grad_scale", "found_inf"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_one_element_parameter_grad_or_state_as_a_scaler_is_refused_on_every_route(name, argument, what, backend):
    """Only a scaler viewing a larger buffer was looked for: ampkit's Adam kernel refused a one-element gradient as
    grad_scale, but torch's fused ops stepped with it (the gradient unscaled by itself), the host-read optimizers
    divided the gradients by a scale the step had just changed, and found_inf was taken everywhere."""
    params = _one_element_params()
    optimizer = OPTIMIZERS[name](params, backend=backend)
    if what != "param at the first step":
        optimizer.step()  # the state exists, and the buckets are kept
    shared = _own_one_element(what.split()[0], params, optimizer)
    shared.fill_(0.0 if argument == "found_inf" else 2.0)
    before = [p.detach().clone() for p in params]
    other = {"found_inf": torch.tensor(0.0)} if argument == "grad_scale" else {"grad_scale": torch.tensor(2.0)}
    where = r"param_groups\[0\]\['params'\]\[[01]\]"
    message = rf"^{type(optimizer).__name__}\.step\(\): {argument} shares memory with {where}"
    with pytest.raises(RuntimeError, match=message):
        optimizer.step(**{argument: shared}, **other)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    optimizer.step(**{argument: shared.clone()}, **other)  # its clone steps


@pytest.mark.parametrize("copied", [False, True], ids=["grads as their params", "a grad of other strides"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_scalers_of_their_own_are_looked_up_without_a_pass_over_the_tensors(name, copied, monkeypatch):
    """GradScaler's scale and flag each hold their memory alone: after a group's first step, the step finds them
    among no parameter, gradient or state by a look-up per group, not by comparing every tensor (a pass over all of
    them each step, as long again as the rest of a small model's step); a group whose gradient is copied each step
    (strides other than its parameter's) too."""
    params = _one_element_params()
    if copied:
        params[0].grad = params[0].grad.t().contiguous().t()
    optimizer = OPTIMIZERS[name](params)
    optimizer.step()
    scans = []
    monkeypatch.setattr(optimizer, "_refuse_group_overlap", lambda *args: scans.append(args))
    before = [p.detach().clone() for p in params]
    optimizer.step(grad_scale=torch.tensor(2.0), found_inf=torch.tensor(0.0))
    assert scans == []
    assert not any(torch.equal(p, b) for p, b in zip(params, before, strict=True))


BETAS_OPTIMIZERS = ["adamw", "adam_l2", "adamp", "lamb", "mixed_precision_lamb", "novograd"]


@pytest.mark.parametrize("backend", ["ampkit", "torch"])
@pytest.mark.parametrize("shape", [(), (1,)], ids=["0-dim", "1-element"])
@pytest.mark.parametrize("name", BETAS_OPTIMIZERS)
def test_tensor_betas_step_exactly_as_their_numbers(name, shape, backend):
    """torch.optim takes one-element tensor betas; torch's fused ops refused a (1,)-shaped one ('invalid combination of
    arguments') and NovoGrad took 1 - beta in float32. Both are now read once, as float64 host numbers."""
    betas = (torch.tensor(0.8).reshape(shape), torch.tensor(0.95).reshape(shape))
    numbers = tuple(float(b) for b in betas)  # the same float32-rounded values
    results = []
    for value in (betas, numbers):
        params = _model_params()
        optimizer = OPTIMIZERS[name](params, betas=value, backend=backend)
        for _ in range(3):
            optimizer.step()
        results.append(params)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("name", BETAS_OPTIMIZERS)
def test_int_betas_and_an_int_weight_decay_take_the_step_checks_fast_path(name, monkeypatch):
    """int betas are numbers (YAML reads ``betas: [0, 0.999]``'s 0 as one; Apex and torch's NAdam/RAdam take them):
    they step as their floats, and the step-time check no longer sends them down its slow path each step."""
    results = []
    for betas in ((0, 0.5), (0.0, 0.5)):
        params = _model_params()
        optimizer = OPTIMIZERS[name](params, betas=betas)
        optimizer.step()
        results.append(params)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    slow = []
    monkeypatch.setattr(_base, "_check_group_value", lambda *args: slow.append(args))
    optimizer.param_groups[0].update(betas=(0, 0), weight_decay=0)
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))], "betas": [0.5, 0.9]})  # a list
    optimizer.step()
    assert slow == []


@pytest.mark.parametrize("how", ["step", "scaled step", "step_with_grad_factor"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_tensor_hyperparameters_are_read_once_a_group_a_step_and_anew_at_the_next(name, how, monkeypatch):
    """Read by each bucket (NovoGrad's betas twice), a tensor lr, betas or eps cost a host sync apiece a bucket on a
    GPU: a group's are read together once a step, and a value changed in place since (a scheduler's ``lr.fill_``) is
    the next step's. The reference kernels took them as tensors, and stepped in their float32 (Adagrad's lr_decay)."""
    twins = []
    for tensors in (True, False):  # tensor hyper-parameters, and their numbers (exact in float32)
        params = [*_model_params(), torch.nn.Parameter(torch.randn(3, dtype=torch.float64))]  # a second bucket
        params[-1].grad = torch.randn_like(params[-1])
        optimizer = OPTIMIZERS[name](params, backend="ampkit")
        hypers = {"lr": 2.0**-7, "eps": 2.0**-20, "betas": (0.75, 0.9375)}
        hypers = {k: v for k, v in hypers.items() if k in optimizer.defaults}
        if tensors:
            hypers = {k: tuple(map(torch.tensor, v)) if k == "betas" else torch.tensor(v) for k, v in hypers.items()}
        optimizer.param_groups[0].update(hypers)
        twins.append((optimizer, params))
    reads = []
    host_numbers = _base.host_numbers
    tensor_group = twins[0][0].param_groups[0]  # its hyper-parameters' reads are counted, not the scaler's
    hyper_tensors = {id(t) for key in hypers for t in (tensor_group[key] if key == "betas" else (tensor_group[key],))}
    count = lambda values: reads.append(sum(id(v) in hyper_tensors for v in values))  # noqa: E731
    monkeypatch.setattr(_base, "host_numbers", lambda values: count(values) or host_numbers(values))
    scaler = {"grad_scale": torch.tensor(1.0), "found_inf": torch.tensor(0.0)} if how == "scaled step" else {}
    for lr in (None, 2.0**-5):
        for optimizer, _ in twins:
            group = optimizer.param_groups[0]
            if lr is not None and isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # in place, as a scheduler changes a tensor lr
            elif lr is not None:
                group["lr"] = lr
            if how == "step_with_grad_factor":
                optimizer.step_with_grad_factor(1.0)
            else:
                optimizer.step(**scaler)
    tensors = len(hypers) + ("betas" in hypers)  # lr, eps and both betas where the optimizer has them
    assert sum(reads) == 2 * tensors  # each once a step, for both buckets
    (_, stepped), (_, expected) = twins
    assert all(torch.equal(a, b) for a, b in zip(stepped, expected, strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", BETAS_OPTIMIZERS)
def test_betas_and_lr_on_the_gpu_are_checked_at_step_without_a_host_sync(name):
    params = [p.cuda() for p in _model_params()]
    for p in params:
        p.grad = torch.randn_like(p)
    betas = (torch.tensor(0.8, device="cuda"), torch.tensor(0.95, device="cuda"))
    optimizer = OPTIMIZERS[name](params, betas=betas)
    optimizer.param_groups[0]["lr"] = torch.tensor(1e-3, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        optimizer._check_groups_at_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    optimizer.step()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_meta_lr_written_into_a_group_is_refused_by_name_at_step(name):
    """The step-time check let any one-element float tensor off the CPU by unread, a meta one too, which then failed
    in a kernel's read ('Tensor.item() cannot be called on meta tensors'), naming neither the group nor the key."""
    params = _model_params()
    optimizer = OPTIMIZERS[name](params)
    optimizer.param_groups[0]["lr"] = torch.tensor(0.1, device="meta")
    with pytest.raises(ValueError, match=rf"Invalid lr of {type(optimizer).__name__}.param_groups\[0\]: .*meta"):
        optimizer.step()


@pytest.mark.parametrize("norm_type", [1, -1, False, "2", None, float("nan")])
def test_novograds_norm_type_is_checked_when_added_and_at_step_as_at_construction(norm_type):
    """Only the constructor checked it: a group added or edited with norm_type=1 (or None, '2') stepped with the
    max-abs norm, the branch any value but 2 took; False passed even there, as 0."""
    from ampkit.ops.optimizers import FusedNovoGrad

    message = rf"Invalid norm_type.*: {norm_type!r} \(expected 2 \(L2\) or 0 \(max abs\)"
    with pytest.raises(ValueError, match=message):
        FusedNovoGrad(_model_params(), norm_type=norm_type)
    params = _model_params()
    optimizer = FusedNovoGrad(params[:1])
    with pytest.raises(ValueError, match=message):
        optimizer.add_param_group({"params": params[1:], "norm_type": norm_type})
    assert len(optimizer.param_groups) == 1
    optimizer.param_groups[0]["norm_type"] = norm_type
    before = params[0].detach().clone()
    with pytest.raises(ValueError, match=rf"Invalid norm_type of FusedNovoGrad.param_groups\[0\]: {norm_type!r}"):
        optimizer.step()
    assert torch.equal(params[0], before)
    optimizer.param_groups[0]["norm_type"] = 0
    optimizer.step()


TORCH_ROUTABLE = {  # the optimizers torch has a fused op for, each hyper-parameter left to the test
    "adamw": lambda p, **kw: FusedAdam(p, lr=1e-2, **kw),
    "adam_l2": lambda p, **kw: FusedAdam(p, lr=1e-2, adam_w_mode=False, **kw),
    "sgd": lambda p, **kw: FusedSGD(p, lr=0.1, **{"momentum": 0.9, **kw}),
    "adagrad": lambda p, **kw: FusedAdagrad(p, lr=0.1, **kw),
}
TORCH_ROUTED_HYPERS = [
    ("adamw", "eps"),
    ("adamw", "weight_decay"),
    ("adam_l2", "weight_decay"),
    ("sgd", "momentum"),
    ("sgd", "dampening"),
    ("sgd", "weight_decay"),
    ("adagrad", "lr_decay"),
    ("adagrad", "eps"),
    ("adagrad", "initial_accumulator_value"),
]


@pytest.mark.parametrize("backend", ["torch", "ampkit"])
@pytest.mark.parametrize(("name", "key"), TORCH_ROUTED_HYPERS)
def test_a_one_element_tensor_hyperparameter_steps_as_its_number_on_every_backend(name, key, backend):
    """The group checks take a one-element tensor of shape (1,) (as torch.optim's constructors do); ampkit's kernels
    stepped with it, but torch's fused ops refused it deep in the dispatcher ('invalid combination of arguments'),
    and Adagrad's initial_accumulator_value failed in full_like."""
    results = []
    for value in (torch.tensor([0.25]), 0.25):
        params = _model_params()
        optimizer = TORCH_ROUTABLE[name](params, **{key: value}, backend=backend)
        for _ in range(2):
            optimizer.step()
        results.append(params)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


TORCH_TWINS = {  # each fused optimizer torch.optim has one of, with its number hyper-parameters (both take them)
    "adam": (
        lambda p, **kw: FusedAdam(p, adam_w_mode=False, **kw),
        torch.optim.Adam,
        ("lr", "eps", "weight_decay"),
    ),
    "adamw": (FusedAdam, torch.optim.AdamW, ("lr", "eps", "weight_decay")),
    "sgd": (FusedSGD, torch.optim.SGD, ("lr", "momentum", "dampening", "weight_decay")),
    "adagrad": (
        FusedAdagrad,
        torch.optim.Adagrad,
        ("lr", "lr_decay", "weight_decay", "eps", "initial_accumulator_value"),
    ),
    "adadelta": (FusedAdadelta, torch.optim.Adadelta, ("lr", "rho", "eps", "weight_decay")),
    "rmsprop": (FusedRMSprop, torch.optim.RMSprop, ("lr", "alpha", "eps", "weight_decay", "momentum")),
}


@pytest.mark.parametrize(
    "value",
    [True, False, np.bool_(True), torch.tensor(True), torch.tensor(1)],
    ids=["True", "False", "np.True_", "tensor(True)", "tensor(1)"],
)
@pytest.mark.parametrize("twin", sorted(TORCH_TWINS))
def test_a_bool_or_an_integer_tensor_hyperparameter_is_its_number_as_in_torch(twin, value):
    """``lr=True`` is torch.optim's 1 (a bool is an int; numpy's too), as a one-element integer or bool tensor is its
    number: each torch.optim twin takes them, the fused optimizers refused them ('True is a bool'). They step as the
    float."""
    ours, theirs, keys = TORCH_TWINS[twin]
    for key in keys:
        extra = {"lr": 0.1} if key != "lr" else {}
        theirs([torch.nn.Parameter(torch.ones(2))], **{key: value}, **extra)  # the spec: torch takes it
        results = []
        for given in (value, float(value)):
            params = _model_params()
            optimizer = ours(params, **{key: given}, **extra)
            for _ in range(2):
                optimizer.step()
            results.append(params)
        assert all(torch.equal(a, b) for a, b in zip(*results, strict=True)), key


@pytest.mark.parametrize("twin", ["adam", "adamw"])
def test_a_bool_beta_is_refused_in_torchs_words(twin):
    """True is 1, out of [0, 1): refused as torch.optim.Adam refuses it, naming the index."""
    ours, theirs, _ = TORCH_TWINS[twin]
    with pytest.raises(ValueError, match=r"Invalid beta parameter at index 1: True"):
        theirs([torch.nn.Parameter(torch.ones(2))], betas=(0.9, True))
    message = r"Invalid betas\[1\]: True .*torch.optim: Invalid beta parameter at index 1: True"
    with pytest.raises(ValueError, match=message):
        ours(_model_params(), betas=(0.9, True))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_number_other_than_0_or_1_written_into_a_groups_flag_is_refused_at_step(name):
    """The constructor and add_param_group refuse ``amsgrad=2``; written into ``param_groups`` later, the step's fast
    path let any int or float of a flag by (2, 0.5, -1 stepped as True), as no bounds were kept for it."""
    params = _model_params()
    optimizer = OPTIMIZERS[name](params)
    flags = [key for key, value in optimizer.defaults.items() if type(value) is bool and key in _base.GROUP_FLAGS]
    assert flags
    for key in flags:
        before = [p.detach().clone() for p in params]
        kept = optimizer.param_groups[0][key]
        for value in (2, 0.5, -1):
            optimizer.param_groups[0][key] = value
            with pytest.raises(TypeError, match=rf"Invalid {key} of {type(optimizer).__name__}\.param_groups\[0\]"):
                optimizer.step()
            assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
        optimizer.param_groups[0][key] = int(kept)  # Apex's 0/1 spelling steps
        optimizer.step()
        optimizer.param_groups[0][key] = kept


def test_an_integer_tensor_lr_goes_to_torchs_fused_ops_as_float32_off_the_cpu():
    """A group now takes a one-element integer or bool tensor lr as its number; torch's fused ops read a tensor lr off
    the CPU as floating point, so it is handed to them as float32 (the meta device stands in for a GPU: only its
    dtype is looked at), and a float one as it is."""
    from ampkit.ops._backend import lr_for_torch_op

    meta = torch.device("meta")
    for lr in (torch.tensor(1, device=meta), torch.tensor(True, device=meta)):
        assert lr_for_torch_op(lr, meta).dtype == torch.float32
    assert lr_for_torch_op(torch.tensor(0.5, dtype=torch.float64, device=meta), meta).dtype == torch.float64
    assert lr_for_torch_op(torch.tensor(1), torch.device("cpu")) == 1.0


class _ReadCounted(torch.Tensor):
    """A hyper-parameter tensor that counts its reads to the host (``item()``, ``bool()``, ``float()``), those of the
    tensors computed from it (``value > 0``) included."""

    reads = 0

    def item(self):
        _ReadCounted.reads += 1
        return super().item()

    def __bool__(self):
        _ReadCounted.reads += 1
        return super().__bool__()

    def __float__(self):
        _ReadCounted.reads += 1
        return super().__float__()


class _CountedGroup(dict):
    """A param group that counts the reads of its values by key (``group[key]``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reads: dict[str, int] = {}

    def __getitem__(self, key):
        self.reads[key] = self.reads.get(key, 0) + 1
        return super().__getitem__(key)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_no_group_value_is_read_per_parameter_in_a_step(name):
    """Making each parameter's state read the group's values again (RMSprop's momentum and centered, Adam's amsgrad,
    NovoGrad's init_zero, Adagrad's initial_accumulator_value: a host read apiece for a tensor): every group value is
    read as many times in a group of 5 parameters' first two steps as in a group of 1's."""
    reads = []
    for count in (1, 5):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(3)) for _ in range(count)]
        optimizer = OPTIMIZERS[name]([torch.nn.Parameter(torch.randn(2))])
        group = _CountedGroup(params=params)  # added after construction: its states are made by the first step
        optimizer.add_param_group(group)
        for _ in range(2):
            for p in params:
                p.grad = torch.randn(3)
            optimizer.step()
        reads.append({key: n for key, n in group.reads.items() if key != "params"})
    assert reads[0] == reads[1], reads


STATE_NUMBERS = {  # the group numbers a state is created from: (fused, torch.optim twin, key, value, the rest)
    "rmsprop": (FusedRMSprop, torch.optim.RMSprop, "momentum", 0.875, {"lr": 1e-2, "centered": True}),
    "adagrad": (FusedAdagrad, torch.optim.Adagrad, "initial_accumulator_value", 0.1, {"lr": 1e-2}),
}


@pytest.mark.parametrize("case", sorted(STATE_NUMBERS))
def test_a_state_creating_hyperparameter_is_read_once_a_group_with_the_same_numbers(case):
    """RMSprop's momentum (is there a momentum_buffer?) and Adagrad's initial_accumulator_value (sum's start) were read
    per parameter as a state was made, a host read apiece for a tensor. They are read once a group now, and a float64
    run with a 0-dim tensor value steps as torch.optim's twin does with the number."""
    ours, theirs, key, value, rest = STATE_NUMBERS[case]
    reads = []
    for count in (2, 6):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64)) for _ in range(count)]
        twins = [p.detach().clone().requires_grad_() for p in params]
        optimizer = ours(params, **rest, **{key: value}, backend="ampkit")
        optimizer.state.clear()  # made again at the first step (Adagrad's constructor made them), from the tensor
        optimizer.param_groups[0][key] = torch.tensor(value, dtype=torch.float64).as_subclass(_ReadCounted)
        reference = theirs(twins, **rest, **{key: value})
        _ReadCounted.reads = 0
        for _ in range(3):
            for p, t in zip(params, twins, strict=True):
                p.grad = torch.randn_like(p)
                t.grad = p.grad.clone()
            optimizer.step()
            reference.step()
        reads.append(_ReadCounted.reads)
        for p, t in zip(params, twins, strict=True):
            torch.testing.assert_close(p, t, atol=0, rtol=1e-12)
    assert reads[0] == reads[1], reads  # as many host reads for a group of 2 parameters as for one of 6


def test_adagrads_share_memory_reads_a_tensor_initial_value_as_it_is_now():
    """share_memory() makes the state of parameters that have none from the group's initial_accumulator_value, read
    anew there: not the number the last step read (making another parameter's state), before a fill_ changed it."""
    params = _model_params()
    initial = torch.tensor(0.25)
    optimizer = FusedAdagrad(params, lr=0.1, initial_accumulator_value=initial)
    grown, late = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    grown.grad = torch.zeros(3)
    optimizer.param_groups[0]["params"].append(grown)  # joins the group (a layer grown in place): state at the step
    optimizer.step()
    initial.fill_(0.5)
    optimizer.param_groups[0]["params"].append(late)
    optimizer.share_memory()
    assert torch.equal(optimizer.state[grown]["sum"], torch.full((3,), 0.25))
    assert torch.equal(optimizer.state[late]["sum"], torch.full((3,), 0.5))


@pytest.mark.parametrize("clipped", [True, False])
@pytest.mark.parametrize("name", ["FusedLAMB", "FusedMixedPrecisionLamb"])
def test_lambs_tensor_max_grad_norm_is_read_once_a_step_and_clips_as_its_number(name, clipped):
    """LAMB compared a tensor max_grad_norm with the global norm twice (a host read each) and handed the clip, a tensor
    then, to each bucket's kernel: it is read once a group a step now, as the other hyper-parameters, with the same
    update as the number's."""
    from ampkit.ops import optimizers

    limit = 0.5 if clipped else 1e3
    results, reads = [], []
    for value in (torch.tensor(limit, dtype=torch.float64).as_subclass(_ReadCounted), limit):
        params = [*_model_params(), torch.nn.Parameter(torch.randn(3, dtype=torch.float64))]  # a second bucket
        params[-1].grad = torch.randn_like(params[-1])
        optimizer = getattr(optimizers, name)(params, lr=1e-2, max_grad_norm=value)
        _ReadCounted.reads = 0
        for _ in range(2):
            optimizer.step()
        reads.append(_ReadCounted.reads)
        results.append(params)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    assert reads[0] == 4, reads  # a step's two: the step-time group check's of a CPU tensor, and group_numbers'
