"""The contracts of ``nn.Linear`` (and of a Linear/activation stack) that code swapping in Apex's ``FusedDense``,
``FusedDenseGeluDense`` and ``MLP`` relies on: deferred init on ``meta`` with ``to_empty`` and ``reset_parameters``,
factory kwargs, nn.Linear's state dicts, copies and conversions, parameters replaced from outside (``to_empty``,
``load_state_dict(assign=True)``, ``torch.func.functional_call``), hooks, ``torch.func``, forward-mode AD, first
and second derivatives, a backward run twice, odd inputs, ``torch.compile``, ``torch.export`` and autocast. Each is
checked against the same maths written in torch ops on the module's own parameters."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad
from torch.func import functional_call, grad, vmap

from ampkit.compat.fused_dense import FusedDense, FusedDenseGeluDense, FusedDenseGeluDenseFunc
from ampkit.compat.mlp import MLP, MlpFunction


def stack(x, layers, activation):
    for weight, bias in layers:
        x = activation(F.linear(x, weight, bias))
    return x


# name: (the module from torch's factory kwargs, the same maths in torch ops on its parameters)
MODULES = {
    "dense": (lambda **kw: FusedDense(5, 3, **kw), lambda m, x: F.linear(x, m.weight, m.bias)),
    "dense_no_bias": (lambda **kw: FusedDense(5, 3, bias=False, **kw), lambda m, x: F.linear(x, m.weight)),
    "dense_gelu_dense": (
        lambda **kw: FusedDenseGeluDense(5, 4, 3, **kw),
        lambda m, x: F.linear(F.gelu(F.linear(x, m.weight1, m.bias1), approximate="tanh"), m.weight2, m.bias2),
    ),
    "mlp_relu": (
        lambda **kw: MLP([5, 4, 3], **kw),
        lambda m, x: stack(x, [(m.weight_0, m.bias_0), (m.weight_1, m.bias_1)], torch.relu),
    ),
    "mlp_sigmoid_no_bias": (
        lambda **kw: MLP([5, 4, 3], bias=False, activation="sigmoid", **kw),
        lambda m, x: stack(x, [(m.weight_0, None), (m.weight_1, None)], torch.sigmoid),
    ),
}
MLPS = [name for name in MODULES if name.startswith("mlp")]


def module(name, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return MODULES[name][0]().to(dtype)


def reference(name, m, x):
    return MODULES[name][1](m, x)


def inputs(*shape, dtype=torch.float64, seed=1):
    return torch.randn(*shape, 5, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def forward_backward(run, m, x, dy):
    x = x.detach().clone().requires_grad_()
    y = run(m, x)
    return y, torch.autograd.grad(y, [x, *(p for p in m.parameters() if p.requires_grad)], dy)


def assert_matches_torch_ops(name, m, x, tol=None):
    """The module's output and gradients equal the same maths in torch ops on its own parameters."""
    tol = tol or {"rtol": 1e-10, "atol": 1e-10}
    dy = torch.randn(*x.shape[:-1], 3, generator=torch.Generator().manual_seed(7), dtype=x.dtype)
    y, grads = forward_backward(lambda m, x: m(x), m, x, dy)
    y_ref, grads_ref = forward_backward(lambda m, x: reference(name, m, x), m, x, dy)
    torch.testing.assert_close(y, y_ref, **tol)
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, **tol)


# ------------------------------------------------------------------- construction and deferred init


@pytest.mark.parametrize("name", MODULES)
def test_factory_kwargs_and_a_meta_device_context_place_every_parameter(name):
    """``FusedDense(..., device=, dtype=)`` was a TypeError, as was ``MLP``'s."""
    built = MODULES[name][0](device="meta", dtype=torch.float64)
    assert all(p.is_meta and p.dtype == torch.float64 for p in built.parameters())
    with torch.device("meta"):
        in_context = MODULES[name][0]()
    assert all(p.is_meta for p in in_context.parameters())
    assert [n for n, _ in built.named_parameters()] == [n for n, _ in module(name).named_parameters()]


@pytest.mark.parametrize("name", MODULES)
def test_a_meta_built_module_comes_to_life_with_to_empty_and_reset_parameters(name):
    """FSDP2 / torchtitan's deferred init. ``FusedDense`` had no ``reset_parameters``; ``MLP``'s forward kept reading
    the meta tensors ``to_empty`` had replaced."""
    with torch.device("meta"):
        m = MODULES[name][0](dtype=torch.float64)
    m.to_empty(device="cpu")
    torch.manual_seed(0)
    m.reset_parameters()
    torch.manual_seed(0)
    eager = MODULES[name][0](dtype=torch.float64)
    for (key, value), (key_ref, value_ref) in zip(m.state_dict().items(), eager.state_dict().items(), strict=True):
        assert key == key_ref and value.device.type == "cpu"
        torch.testing.assert_close(value, value_ref, rtol=0, atol=0)  # the same draws as a module built eagerly
    assert_matches_torch_ops(name, m, inputs(4))


@pytest.mark.parametrize("bias", [True, False])
def test_fused_dense_starts_saves_loads_and_prints_as_nn_linear(bias):
    torch.manual_seed(3)
    linear = nn.Linear(5, 3, bias=bias)
    torch.manual_seed(3)
    dense = FusedDense(5, 3, bias=bias)
    assert dense.extra_repr() == linear.extra_repr()
    assert list(dense.state_dict()) == list(linear.state_dict())
    for key, value in linear.state_dict().items():
        torch.testing.assert_close(dense.state_dict()[key], value, rtol=0, atol=0)  # the same initialization
    with torch.no_grad():
        for p in linear.parameters():
            p.mul_(2)
    FusedDense(5, 3, bias=bias).load_state_dict(linear.state_dict(), strict=True)
    dense.load_state_dict(linear.state_dict(), strict=True)
    nn.Linear(5, 3, bias=bias).load_state_dict(dense.state_dict(), strict=True)
    x = inputs(4, dtype=torch.float32)
    torch.testing.assert_close(dense(x), linear(x))


def test_fused_dense_gelu_dense_layers_start_as_nn_linears():
    torch.manual_seed(4)
    first, second = nn.Linear(5, 4), nn.Linear(4, 3)
    torch.manual_seed(4)
    fused = FusedDenseGeluDense(5, 4, 3)
    for got, want in zip(fused.parameters(), (*first.parameters(), *second.parameters()), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert "intermediate_features=4" in repr(fused)


@pytest.mark.parametrize("name", MLPS)
def test_mlp_runs_the_parameters_put_in_place_of_its_own(name):
    """``to_empty``, ``load_state_dict(assign=True)`` and ``functional_call`` register other tensors; ``MLP``'s
    forward ran the ones in lists built at construction (silently, for the last two)."""
    m = module(name)
    other = module(name, seed=5)
    m.load_state_dict(other.state_dict(), assign=True)
    assert {id(p) for p in m.weights + m.biases} == {id(p) for p in m.parameters()}
    x = inputs(4)
    torch.testing.assert_close(m(x), other(x), rtol=0, atol=0)
    given = {k: v.detach().clone().requires_grad_() for k, v in module(name, seed=6).named_parameters()}
    y = functional_call(m, given, (x,))
    torch.testing.assert_close(y, module(name, seed=6)(x), rtol=0, atol=0)
    assert all(g is not None for g in torch.autograd.grad(y.sum(), list(given.values())))


# ------------------------------------------------------------------- copies and conversions


@pytest.mark.parametrize("name", MODULES)
def test_pickle_torch_save_and_deepcopy_give_an_equal_independent_module(name):
    m = module(name)
    x = inputs(4)
    buffer = io.BytesIO()
    torch.save(m, buffer)
    buffer.seek(0)
    for twin in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m), torch.load(buffer, weights_only=False)):
        assert repr(twin) == repr(m)
        torch.testing.assert_close(twin(x), m(x), rtol=0, atol=0)
        with torch.no_grad():
            for p in twin.parameters():
                p.add_(1)
        assert_matches_torch_ops(name, twin, x)  # the copy runs its own parameters
        assert not torch.equal(twin(x), m(x))


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("name", MODULES)
def test_dtype_and_layout_conversions_keep_the_parameters_and_run_in_the_new_dtype(name, swap, monkeypatch):
    monkeypatch.setattr(torch.__future__, "get_swap_module_params_on_conversion", lambda: swap)
    m = module(name, dtype=torch.float32)
    m(inputs(2, dtype=torch.float32)).sum().backward()
    params = list(m.parameters())
    for convert, dtype in (
        (lambda m: m.double(), torch.float64),
        (lambda m: m.bfloat16(), torch.bfloat16),
        (lambda m: m.half(), torch.float16),
        (lambda m: m.float().cpu().to(memory_format=torch.channels_last), torch.float32),
    ):
        convert(m)
        assert all(p is q for p, q in zip(m.parameters(), params, strict=True))
        assert all(p.dtype == dtype and p.grad.dtype == dtype for p in m.parameters())
        x = inputs(2, dtype=dtype)
        with torch.no_grad():
            y, y_ref = m(x), reference(name, m, x)
        assert y.dtype == dtype
        torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------- hooks, torch.func, derivatives


@pytest.mark.parametrize("name", MODULES)
def test_forward_and_full_backward_hooks_fire_in_torchs_order(name):
    m, calls = module(name), []
    m.register_forward_pre_hook(lambda mod, args: calls.append("pre"))
    m.register_forward_hook(lambda mod, args, out: calls.append("forward"))
    m.register_full_backward_pre_hook(lambda mod, go: calls.append("backward_pre"))
    m.register_full_backward_hook(lambda mod, gi, go: calls.append(("backward", gi[0].shape)))
    m(inputs(4).requires_grad_()).sum().backward()
    assert calls == ["pre", "forward", "backward_pre", ("backward", torch.Size([4, 5]))]


@pytest.mark.parametrize("name", MODULES)
def test_per_sample_gradients_with_vmap_and_grad_and_forward_mode_ad_run(name):
    """``vmap`` and ``grad`` refused the Apex Functions (no ``setup_context``), as forward-mode AD did (no jvp);
    ``nn.Linear`` takes all three."""
    m = module(name)
    params = {k: v.detach() for k, v in m.named_parameters()}

    def per_sample(run):
        def loss(p, sample):
            return run(p, sample.unsqueeze(0)).sin().sum()

        return vmap(grad(loss), in_dims=(None, 0))(params, inputs(6))

    got = per_sample(lambda p, x: functional_call(m, p, (x,)))
    want = per_sample(lambda p, x: reference(name, _Params(p), x))
    for key in params:
        torch.testing.assert_close(got[key], want[key])
    x, tangent = inputs(4), inputs(4, seed=2)
    with forward_ad.dual_level():
        out = forward_ad.unpack_dual(m(forward_ad.make_dual(x, tangent)))
    _, jvp = torch.func.jvp(lambda x: reference(name, m, x), (x,), (tangent,))
    torch.testing.assert_close(out.tangent, jvp)


class _Params:
    """A module's parameters by attribute, for the torch-ops reference under ``torch.func``."""

    def __init__(self, params):
        self.__dict__.update(params)
        self.__dict__.setdefault("bias", None)


@pytest.mark.parametrize("name", MODULES)
def test_gradcheck_and_gradgradcheck_in_float64_in_total_and_per_parameter(name):
    """As torch's ``test_modules`` checks ``nn.Linear``. The second derivatives of ``FusedDenseGeluDense`` and of an
    ``MLP`` came out wrong with no error: their backward read saved activations that carry no graph."""
    m = module(name)
    names = [k for k, _ in m.named_parameters()]
    params = list(m.parameters())
    x = inputs(3).requires_grad_()

    def run(x, *given):
        return functional_call(m, dict(zip(names, given, strict=True)), (x,))

    for subset in [params] + [[p if p is q else p.detach() for p in params] for q in params]:
        assert torch.autograd.gradcheck(run, (x, *subset))
        assert torch.autograd.gradgradcheck(run, (x, *subset))


def test_the_apex_functions_called_directly_have_exact_second_derivatives():
    """How projects call them (``FusedDenseGeluDenseFunc.apply``, ``MlpFunction.apply`` from their own Functions)."""
    m = module("dense_gelu_dense")
    x = inputs(3).requires_grad_()
    args = (x, m.weight1, m.bias1, m.weight2, m.bias2)
    assert torch.autograd.gradgradcheck(FusedDenseGeluDenseFunc.apply, args)
    mlp = module("mlp_sigmoid_no_bias")
    assert torch.autograd.gradgradcheck(lambda x, *w: MlpFunction.apply(0, 2, x, *w), (x, *mlp.weights))


@pytest.mark.parametrize("name", MLPS)
def test_an_mlp_backward_run_twice_with_retain_graph_gives_the_same_gradients(name):
    """The graph kept by ``retain_graph=True`` is for a second backward; MLP's first one deleted what it needed."""
    m = module(name)
    x = inputs(4).requires_grad_()
    y = m(x).square().sum()
    first = torch.autograd.grad(y, [x, *m.parameters()], retain_graph=True)
    second = torch.autograd.grad(y, [x, *m.parameters()])
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("shape", [(6,), (0,), (2, 3), ()])
def test_odd_batches_and_frozen_parameters_run_as_torch_ops(name, shape):
    """A zero-size batch, extra leading dims and no batch dim, as ``nn.Linear`` takes them (Apex's MLP takes 2-D only),
    and then with the parameters frozen."""
    m = module(name)
    if name.startswith("mlp") and len(shape) != 1:
        with pytest.raises(ValueError, match="the input must be 2-D"):
            m(inputs(*shape))
        return
    assert_matches_torch_ops(name, m, inputs(*shape))
    m.requires_grad_(False)
    assert_matches_torch_ops(name, m, inputs(*shape))


# ------------------------------------------------------------------- compile, export, autocast


@pytest.mark.parametrize("name", MODULES)
def test_torch_compile_fullgraph_and_torch_export_take_a_model_holding_the_module(name):
    """``MLP`` under ``torch.compile(fullgraph=True)`` was an error (its Function kept tensors on ``ctx``)."""
    m = module(name)
    model = nn.Sequential(nn.Linear(5, 5, dtype=torch.float64), m)
    x, dy = inputs(4), torch.ones(4, 3, dtype=torch.float64)
    y_eager, grads_eager = forward_backward(lambda mod, x: mod(x), model, x, dy)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    y, grads = forward_backward(lambda mod, x: mod(x), compiled, x, dy)
    torch.testing.assert_close(y, y_eager)
    for got, want in zip(grads, grads_eager, strict=True):
        torch.testing.assert_close(got, want)
    exported = torch.export.export(model, (x,))
    torch.testing.assert_close(exported.module()(inputs(4, seed=3)), model(inputs(4, seed=3)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", MODULES)
def test_under_cpu_autocast_the_output_takes_nn_linears_dtype(name, dtype):
    m = module(name, dtype=torch.float32)
    x = inputs(4, dtype=torch.float32)
    with torch.autocast("cpu", dtype=dtype):
        y = m(x)
        assert y.dtype == nn.Linear(5, 3)(x).dtype == dtype
    y.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in m.parameters())
    torch.testing.assert_close(y.float(), reference(name, m, x), rtol=5e-2, atol=5e-2)
