"""The contracts of ``nn.LayerNorm`` and ``nn.RMSNorm`` that code swapping in ampkit's norms relies on, held by every
fused norm under each implementation (ampkit's C++ kernels, the pure-PyTorch references, torch's kernels where
``AMPKIT_FUSED_BACKEND=torch`` routes to them): deferred init on ``meta``, factory kwargs, torch's state dicts,
copies, dtype and layout conversions, hooks, ``torch.func``, first and second derivatives, odd inputs,
``torch.compile``, ``torch.export`` and autocast. Each is checked against the torch module it stands in for
(``test_modules``' generic checks, in ampkit's own tests); SyncBatchNorm's are in
``test_sync_batchnorm_module_contract.py``."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from ampkit.compat import normalization as apex_normalization
from ampkit.ops import (
    FusedLayerNorm,
    FusedRMSNorm,
    MixedFusedLayerNorm,
    MixedFusedRMSNorm,
)

SHAPE = (3, 4)  # two normalized dims: the general case

# name: (ampkit's norm, the torch module it replaces), each taking torch's factory kwargs.
NORMS = {
    "layer": (lambda **kw: FusedLayerNorm(SHAPE, **kw), lambda **kw: nn.LayerNorm(SHAPE, **kw)),
    "layer_no_bias": (
        lambda **kw: FusedLayerNorm(SHAPE, bias=False, **kw),
        lambda **kw: nn.LayerNorm(SHAPE, bias=False, **kw),
    ),
    "layer_no_affine": (
        lambda **kw: FusedLayerNorm(SHAPE, elementwise_affine=False, **kw),
        lambda **kw: nn.LayerNorm(SHAPE, elementwise_affine=False, **kw),
    ),
    "rms": (lambda **kw: FusedRMSNorm(SHAPE, **kw), lambda **kw: nn.RMSNorm(SHAPE, eps=1e-5, **kw)),
    "rms_no_affine": (
        lambda **kw: FusedRMSNorm(SHAPE, elementwise_affine=False, **kw),
        lambda **kw: nn.RMSNorm(SHAPE, eps=1e-5, elementwise_affine=False, **kw),
    ),
    "mixed_layer": (lambda **kw: MixedFusedLayerNorm(SHAPE, **kw), lambda **kw: nn.LayerNorm(SHAPE, **kw)),
    "mixed_rms": (lambda **kw: MixedFusedRMSNorm(SHAPE, **kw), lambda **kw: nn.RMSNorm(SHAPE, eps=1e-5, **kw)),
}
AFFINE = [name for name in NORMS if "no_affine" not in name]


@pytest.fixture(params=["kernel", "reference", "torch"], autouse=True)
def ops_mode(request, monkeypatch):
    """ampkit's C++ kernels (never torch's, which ``auto`` picks for fp32 LayerNorm on the CPU), the references, then
    torch's kernels wherever they take the call (a GPU's default)."""
    monkeypatch.setenv("AMPKIT_OPS", "reference" if request.param == "reference" else "kernel")
    monkeypatch.setenv("AMPKIT_FUSED_BACKEND", "torch" if request.param == "torch" else "ampkit")
    return request.param


def pair(name, dtype=torch.float64, seed=0):
    """ampkit's norm and torch's, holding the same random parameters (away from ones and zeros)."""
    make_ours, make_theirs = NORMS[name]
    ours, theirs = make_ours(dtype=dtype), make_theirs(dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.rand(p.shape, generator=generator, dtype=torch.float64) + 0.5)
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def inputs(*leading, dtype=torch.float64, seed=1):
    return torch.randn(*leading, *SHAPE, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def forward_backward(module, x, dy):
    """Output, and gradients of the input and of each parameter that asks for one."""
    x = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()
    y = module(x)
    params = [p for p in module.parameters() if p.requires_grad]
    grads = torch.autograd.grad(y, [x, *params], dy)
    return y, grads


def assert_same_maths(ours, theirs, x, tol=None):
    """The same output and the same gradients as torch's module on ``x``."""
    tol = tol or {"rtol": 1e-10, "atol": 1e-10}
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(x.dtype)
    (y, grads), (y_ref, grads_ref) = forward_backward(ours, x, dy), forward_backward(theirs, x, dy)
    torch.testing.assert_close(y, y_ref, **tol)
    assert len(grads) == len(grads_ref)
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, **tol)
    return y


# ------------------------------------------------------------------- construction and deferred init


@pytest.mark.parametrize("name", NORMS)
def test_factory_kwargs_and_a_meta_device_context_place_every_parameter(name):
    make_ours, make_theirs = NORMS[name]
    built = make_ours(device="meta", dtype=torch.float64)
    with torch.device("meta"):
        in_context = make_ours()
    reference = make_theirs(dtype=torch.float64)
    assert [n for n, _ in built.named_parameters()] == [n for n, _ in reference.named_parameters()]
    for p, p_ref in zip(built.parameters(), reference.parameters(), strict=True):
        assert p.is_meta and p.dtype == torch.float64 and p.shape == p_ref.shape
    assert all(p.is_meta and p.dtype == torch.float32 for p in in_context.parameters())


@pytest.mark.parametrize("name", AFFINE)
def test_a_meta_built_norm_comes_to_life_with_to_empty_and_reset_parameters(name):
    """FSDP2 / torchtitan's deferred init: build on ``meta``, allocate with ``to_empty``, then ``reset_parameters``."""
    with torch.device("meta"):
        norm = NORMS[name][0]()
    norm.to_empty(device="cpu")
    norm.reset_parameters()
    fresh = NORMS[name][1]()
    assert norm.state_dict().keys() == fresh.state_dict().keys()
    for key, value in norm.state_dict().items():
        assert value.device.type == "cpu"
        torch.testing.assert_close(value, fresh.state_dict()[key], rtol=0, atol=0)
    x = inputs(2, dtype=torch.float32)
    torch.testing.assert_close(norm(x), fresh(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [4, [4], (4,), torch.Size([4]), [3, 4], (3, 4), torch.Size([3, 4])])
@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm])
def test_normalized_shape_as_an_int_list_tuple_or_size_is_torchs(cls, shape):
    norm = cls(shape)
    theirs = (nn.LayerNorm if "Layer" in cls.__name__ else nn.RMSNorm)(shape)
    assert norm.normalized_shape == theirs.normalized_shape and type(norm.normalized_shape) is torch.Size
    assert norm.weight.shape == theirs.weight.shape


def test_the_apex_normalization_names_are_these_modules():
    """So every contract below holds for ``apex.normalization``'s modules too."""
    for cls in (FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm):
        assert getattr(apex_normalization, cls.__name__) is cls


# ------------------------------------------------------------------- state, copies, conversions


@pytest.mark.parametrize("name", NORMS)
def test_state_dicts_load_strictly_both_ways_with_torchs_module(name):
    ours, theirs = pair(name)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    other_ours, other_theirs = NORMS[name][0](dtype=torch.float64), NORMS[name][1](dtype=torch.float64)
    other_ours.load_state_dict(theirs.state_dict(), strict=True)
    other_theirs.load_state_dict(ours.state_dict(), strict=True)
    x = inputs(5)
    torch.testing.assert_close(other_ours(x), theirs(x))
    torch.testing.assert_close(other_theirs(x), ours(x))


@pytest.mark.parametrize("name", NORMS)
def test_pickle_torch_save_and_deepcopy_give_an_equal_independent_norm(name):
    norm, _ = pair(name)
    x = inputs(5)
    buffer = io.BytesIO()
    torch.save(norm, buffer)
    buffer.seek(0)
    copies = [pickle.loads(pickle.dumps(norm)), copy.deepcopy(norm), torch.load(buffer, weights_only=False)]
    for twin in copies:
        assert type(twin) is type(norm) and repr(twin) == repr(norm)
        torch.testing.assert_close(twin(x), norm(x), rtol=0, atol=0)
        with torch.no_grad():
            for p in twin.parameters():
                p.mul_(2)
        assert all(not torch.equal(a, b) for a, b in zip(twin.parameters(), norm.parameters(), strict=True))


@pytest.mark.parametrize("name", ["layer", "layer_no_affine", "rms", "rms_no_affine"])
def test_repr_starts_as_torchs_module_does(name):
    ours, theirs = NORMS[name][0](), NORMS[name][1]()
    assert ours.extra_repr().startswith(theirs.extra_repr())
    assert str(ours).startswith(type(ours).__name__ + "(" + theirs.extra_repr())


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("name", AFFINE)
def test_dtype_and_layout_conversions_keep_the_parameters_and_run_as_torchs(name, swap, monkeypatch):
    """``.double()/.half()/.bfloat16()/.float()/.to(memory_format=...)/.cpu()``, in place (``set_data``) and with
    ``torch.__future__``'s swapped tensors, as ``test_modules`` runs them: the same Parameter objects, their grads
    converted with them, and the norm runs in the new dtype as torch's does."""
    monkeypatch.setattr(torch.__future__, "get_swap_module_params_on_conversion", lambda: swap)
    ours, theirs = pair(name, dtype=torch.float32)
    for m in (ours, theirs):
        m(inputs(2, dtype=torch.float32)).sum().backward()
    params = list(ours.parameters())
    tolerances = {torch.float64: 1e-10, torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}
    for convert, dtype in (
        (lambda m: m.double(), torch.float64),
        (lambda m: m.bfloat16(), torch.bfloat16),
        (lambda m: m.half(), torch.float16),
        (lambda m: m.float().cpu().to(memory_format=torch.channels_last), torch.float32),
    ):
        convert(ours)
        convert(theirs)
        assert list(ours.parameters()) == params and all(p is q for p, q in zip(ours.parameters(), params, strict=True))
        assert all(p.dtype == dtype and p.grad.dtype == dtype for p in ours.parameters())
        x = inputs(2, dtype=dtype)
        with torch.no_grad():  # a graph holding the parameters would stop the next swap, for torch's module too
            y, y_ref = ours(x), theirs(x)
        assert y.dtype == y_ref.dtype
        torch.testing.assert_close(y.float(), y_ref.float(), rtol=tolerances[dtype], atol=tolerances[dtype])


# ------------------------------------------------------------------- hooks and torch.func


@pytest.mark.parametrize("name", ["layer", "rms", "mixed_layer"])
def test_forward_and_full_backward_hooks_fire_as_on_torchs_module(name):
    def recorded(module):
        calls = []
        handles = [
            module.register_forward_pre_hook(lambda m, args: calls.append(("pre", args[0].shape))),
            module.register_forward_hook(lambda m, args, out: calls.append(("forward", out.shape))),
            module.register_full_backward_pre_hook(lambda m, go: calls.append(("backward_pre", go[0].shape))),
            module.register_full_backward_hook(lambda m, gi, go: calls.append(("backward", gi[0].shape))),
        ]
        x = inputs(2, 5).requires_grad_()
        module(x).sum().backward()
        for handle in handles:
            handle.remove()
        module(x).sum().backward()  # removed: nothing more is recorded
        return calls

    ours, theirs = pair(name)
    assert recorded(ours) == recorded(theirs) and len(recorded(ours)) == 4


@pytest.mark.parametrize("name", AFFINE)
def test_functional_call_runs_the_parameters_it_is_given(name):
    ours, theirs = pair(name)
    new = {k: (v.detach() * 1.5 + 0.25).requires_grad_() for k, v in ours.named_parameters()}
    x = inputs(5)
    y = functional_call(ours, new, (x,))
    y_ref = functional_call(theirs, {k: v.detach().clone().requires_grad_() for k, v in new.items()}, (x,))
    torch.testing.assert_close(y, y_ref)
    grads = torch.autograd.grad(y.square().sum(), list(new.values()))
    assert all(g.abs().sum() > 0 for g in grads)
    assert all(p.grad is None for p in ours.parameters())


@pytest.mark.parametrize("name", AFFINE)
def test_per_sample_gradients_with_vmap_and_grad_equal_torchs(name):
    """The torch.func recipe (``vmap(grad(loss of functional_call))``), as Opacus-style DP training runs it."""

    def per_sample_grads(module):
        params = {k: v.detach() for k, v in module.named_parameters()}

        def loss(p, sample):
            return functional_call(module, p, (sample.unsqueeze(0),)).sin().sum()

        return vmap(grad(loss), in_dims=(None, 0))(params, inputs(6))

    ours, theirs = pair(name)
    got, want = per_sample_grads(ours), per_sample_grads(theirs)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].shape == (6, *SHAPE)
        torch.testing.assert_close(got[key], want[key])
    torch.testing.assert_close(vmap(ours)(inputs(6, 2)), vmap(theirs)(inputs(6, 2)))


# ------------------------------------------------------------------- derivatives and inputs


@pytest.mark.parametrize("name", NORMS)
def test_gradcheck_and_gradgradcheck_in_float64_in_total_and_per_parameter(name):
    """As ``test_modules`` checks them: every input at once, then the input with each parameter alone. torch's norms
    have exact second derivatives (a gradient penalty takes them), so must these."""
    norm, _ = pair(name)
    params = list(norm.parameters())
    names = [k for k, _ in norm.named_parameters()]
    x = inputs(2, 2).requires_grad_()

    def run(x, *given):
        return functional_call(norm, dict(zip(names, given, strict=True)), (x,))

    subsets = [params] + [[p if p is q else p.detach() for p in params] for q in params]
    for subset in subsets:
        args = (x, *subset)
        assert torch.autograd.gradcheck(run, args)
        assert torch.autograd.gradgradcheck(run, args)


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm])
def test_a_memory_efficient_norm_refuses_a_second_derivative_it_cannot_give(cls, ops_mode):
    """It keeps the output, not the input: with the kernels (ampkit's, whatever the backend: torch's keep the input) a
    graph of its gradients is refused by name; the reference keeps torch's graph and so gives exact second
    derivatives."""
    norm = cls(SHAPE, memory_efficient=True).double()
    x = inputs(2).requires_grad_()
    if ops_mode != "reference":
        with pytest.raises(RuntimeError, match="memory_efficient=True"):
            torch.autograd.grad(norm(x).sin().sum(), x, create_graph=True)
    else:
        assert torch.autograd.gradgradcheck(norm, (x,))


@pytest.mark.parametrize("name", NORMS)
@pytest.mark.parametrize(
    "layout",
    ["non_contiguous", "channels_last", "transposed_batch", "extra_leading_dims", "one_sample", "no_batch_dim"],
)
def test_odd_inputs_give_torchs_outputs_and_gradients(name, layout):
    ours, theirs = pair(name)
    x = {
        # test_modules' form: every other element of a tensor twice as wide
        "non_contiguous": inputs(6, 2).repeat_interleave(2, dim=-1)[..., ::2],
        "channels_last": inputs(2, 5).to(memory_format=torch.channels_last),
        "transposed_batch": inputs(5, 2).transpose(0, 1),
        "extra_leading_dims": inputs(2, 3, 2),
        "one_sample": inputs(1),
        "no_batch_dim": inputs(),
    }[layout]
    assert_same_maths(ours, theirs, x)


@pytest.mark.parametrize("name", NORMS)
@pytest.mark.parametrize("leading", [(0,), (2, 0)])
def test_a_zero_size_batch_gives_an_empty_output_and_zero_parameter_gradients(name, leading):
    ours, theirs = pair(name)
    assert_same_maths(ours, theirs, inputs(*leading))
    for p in ours.parameters():  # torch's give zeros, not None: an optimizer step keeps its state moving
        p.grad = None
    ours(inputs(*leading).requires_grad_()).sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in ours.parameters())


@pytest.mark.parametrize("name", AFFINE)
def test_frozen_parameters_get_no_gradient_and_the_input_gets_torchs(name):
    ours, theirs = pair(name)
    for m in (ours, theirs):
        m.requires_grad_(False)
    assert_same_maths(ours, theirs, inputs(4))
    x = inputs(4).requires_grad_()
    ours(x).sum().backward()
    assert all(p.grad is None for p in ours.parameters())


@pytest.mark.parametrize("name", ["layer", "rms"])
def test_forward_does_not_read_the_training_flag(name):
    """As torch's norms (``test_if_train_and_eval_modes_differ``): train and eval give the same output."""
    ours, _ = pair(name)
    x = inputs(2)
    before = ours(x)
    del ours.training
    torch.testing.assert_close(ours(x), before, rtol=0, atol=0)


# ------------------------------------------------------------------- compile, export, autocast


class Block(nn.Module):
    """A pre-norm residual block, the place these norms take in a transformer."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.proj = nn.Linear(SHAPE[-1], SHAPE[-1], dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(x))


@pytest.mark.parametrize("name", AFFINE)
def test_torch_compile_fullgraph_trains_a_model_holding_the_norm_as_eager(name):
    ours, theirs = pair(name)
    torch.manual_seed(0)
    model = Block(ours)
    x = inputs(2)
    y_eager, grads_eager = forward_backward(model, x, torch.ones_like(x))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # inductor adds minutes of codegen only
    y, grads = forward_backward(compiled, x, torch.ones_like(x))
    torch.testing.assert_close(y, y_eager)
    for got, want in zip(grads, grads_eager, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", AFFINE)
def test_torch_export_exports_a_model_holding_the_norm(name):
    ours, theirs = pair(name)
    torch.manual_seed(0)
    model = Block(ours).eval()
    exported = torch.export.export(model, (inputs(2),))
    x = inputs(2, seed=3)
    torch.testing.assert_close(exported.module()(x), model(x))
    reference = Block(theirs)
    reference.proj.load_state_dict(model.proj.state_dict())
    torch.testing.assert_close(exported.module()(x), reference(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", AFFINE)
def test_under_cpu_autocast_a_norm_answers_in_the_autocast_dtype_with_torchs_values_rounded_once(name, dtype):
    """A deliberate difference (Apex's, kept): torch's norms answer in float32 under autocast, ampkit's in the
    autocast dtype, the float32 result rounded once (Apex's memory_efficient and Mixed norms compute in the autocast
    dtype, so only the dtype is held there). Gradients reach the float32 parameters in float32."""
    ours, theirs = pair(name, dtype=torch.float32)
    x = inputs(4, dtype=torch.float32)
    with torch.autocast("cpu", dtype=dtype):
        y, y_ref = ours(x), theirs(x)
    assert y_ref.dtype == torch.float32 and y.dtype == dtype
    if not name.startswith("mixed"):
        torch.testing.assert_close(y, y_ref.to(dtype), rtol=0, atol=0)
    y.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in ours.parameters())
