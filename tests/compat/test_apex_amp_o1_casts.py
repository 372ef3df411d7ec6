"""O1 casting and promotion (the semantics of Apex's test_basic_casts / test_promotion / test_cache), on CPU.

As in Apex, an O1 ``initialize`` (or ``amp.init()``) patches torch's functions process-wide: the casts
apply to every call while the handle is active, inside a model's forward or not, until the next
``initialize`` or ``handle._deactivate()``.
"""

import types

import pytest
import torch
import torch.nn.functional as F

from ampkit.compat import amp

LOW = [torch.float16, torch.bfloat16]


class Probe(torch.nn.Module):
    """Runs ``fn`` inside its forward, i.e. where O1's casts apply."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.fn = None

    def forward(self, x):
        return self.fn(x)


def _o1_probe(dtype, **kwargs):
    probe = Probe()
    amp.initialize(probe, opt_level="O1", dtype=dtype, verbosity=0, **kwargs)
    return probe


def _run(probe, fn, x=None):
    probe.fn = fn
    return probe(torch.randn(4, 4) if x is None else x)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize(
    "name, fn",
    [
        ("linear", lambda p, x: p.linear(x)),
        ("matmul", lambda p, x: x @ x),
        ("bmm", lambda p, x: torch.bmm(x[None], x[None])),
        ("addmm", lambda p, x: torch.addmm(x, x, x)),
        ("linalg.matmul", lambda p, x: torch.linalg.matmul(x, x)),  # a function of its own, not torch.matmul
        ("linalg.multi_dot", lambda p, x: torch.linalg.multi_dot([x.half(), x, x])),
        ("chain_matmul", lambda p, x: torch.chain_matmul(x, x.half())),
        ("sdpa", lambda p, x: F.scaled_dot_product_attention(x[None].half(), x[None], x[None], attn_mask=x.float())),
        ("conv1d", lambda p, x: F.conv1d(x[None], x[:, :, None])),
    ],
)
def test_matmul_like_ops_run_in_low_precision(dtype, name, fn):
    probe = _o1_probe(dtype)
    assert _run(probe, lambda x: fn(probe, x)).dtype == dtype


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize(
    "fn",
    [
        lambda x: F.mse_loss(x, x * 2),
        lambda x: F.cross_entropy(x, torch.zeros(4, dtype=torch.long)),
        lambda x: F.binary_cross_entropy_with_logits(x, torch.ones_like(x)),
        lambda x: torch.prod(x),
    ],
)
def test_loss_functions_run_in_float32_even_on_low_precision_inputs(dtype, fn):
    probe = _o1_probe(dtype)
    assert _run(probe, lambda x: fn(x.to(dtype))).dtype == torch.float32


@pytest.mark.parametrize("dtype", LOW)
def test_gelu_and_ctc_loss_run_in_float32_as_apex_added_them(dtype):
    """Apex's last float32 list has ``gelu`` (BERT's activation, 2019) and ``ctc_loss`` (Jasper, ESPnet; 2020):
    gelu ran in low precision here, and ``ctc_loss`` on low-precision log-probs failed on the CPU ("not implemented
    for 'Half'"), where Apex handed it float32."""
    probe = _o1_probe(dtype)
    assert _run(probe, lambda x: torch.nn.GELU(approximate="tanh")(x.to(dtype))).dtype == torch.float32
    log_probs = torch.randn(5, 2, 6).log_softmax(-1).to(dtype)
    targets, lengths = torch.tensor([[1, 2, 3], [4, 5, 1]]), torch.tensor([5, 5])
    loss = _run(probe, lambda _: torch.nn.CTCLoss()(log_probs, targets, lengths, torch.tensor([3, 3])))
    reference = F.ctc_loss(log_probs.float(), targets, lengths, torch.tensor([3, 3]))
    assert loss.dtype == torch.float32 and torch.equal(loss, reference)


@pytest.mark.parametrize("dtype", LOW)
def test_promotion_to_the_widest_type(dtype):
    probe = _o1_probe(dtype)
    assert _run(probe, lambda x: x.to(dtype) + x).dtype == torch.float32
    assert _run(probe, lambda x: torch.cat([x.to(dtype), x])).dtype == torch.float32
    assert _run(probe, lambda x: torch.stack([x, x.to(dtype)])).dtype == torch.float32
    assert _run(probe, lambda x: torch.addcmul(x, x.to(dtype), x.to(dtype))).dtype == torch.float32

    def inplace(x):
        low = x.to(dtype)
        low.add_(x)
        return low

    assert _run(probe, inplace).dtype == dtype  # in-place ops keep the destination's type
    assert _run(probe, lambda x: F.relu(x.to(dtype))).dtype == dtype  # type-preserving ops preserve
    assert _run(probe, lambda x: F.relu(x)).dtype == torch.float32


# Each O1 rule with its tensors passed by keyword (torch's own names for them), a low-precision and a float32 one mixed.
_BY_KEYWORD = {
    "where": (lambda low, f: torch.where(condition=f > 1, input=low, other=f), torch.float32),
    "addcmul": (lambda low, f: torch.addcmul(f, tensor1=low, tensor2=f), torch.float32),
    "lerp": (lambda low, f: torch.lerp(low, end=f, weight=f), torch.float32),
    "Tensor.lerp": (lambda low, f: low.lerp(end=f, weight=0.5), torch.float32),
    "add": (lambda low, f: torch.add(input=low, other=f), torch.float32),
    "cat": (lambda low, f: torch.cat(tensors=[low, f]), torch.float32),
    "cat dim": (lambda low, f: torch.cat(tensors=(low, f), dim=1), torch.float32),
    "stack": (lambda low, f: torch.stack(tensors=[f, low], dim=0), torch.float32),
    "F.linear": (lambda low, f: F.linear(f, weight=f, bias=f[0]), "low"),
    "F.linear all": (lambda low, f: F.linear(input=low, weight=f, bias=f[0]), "low"),
    "addmm": (lambda low, f: torch.addmm(input=f, mat1=low, mat2=f), "low"),
    "softmax": (lambda low, f: F.softmax(input=low, dim=-1), torch.float32),
}


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("name", _BY_KEYWORD)
def test_tensors_passed_by_keyword_are_cast_as_positional_ones(dtype, name):
    """``torch.cat(tensors=[...])`` was a ``TypeError`` (its wrapper took the sequence positionally); the others are
    pinned so that keyword tensors stay cast as positional ones are."""
    fn, expected = _BY_KEYWORD[name]
    probe = _o1_probe(dtype)
    out = _run(probe, lambda x: fn(x.to(dtype), x.abs() + 0.5))
    assert out.dtype == (dtype if expected == "low" else expected)


_INDEX = torch.tensor([2, 0, 3, 1])
_SCATTER_INDEX = torch.tensor([[1, 0, 3, 2]] * 4)
_SPD = torch.eye(4) * 4 + torch.arange(16.0).reshape(4, 4) / 16  # float32 matrices the solvers factor
_SPD = _SPD @ _SPD.T


# Functions that refuse mixed float16/float32 inputs on current torch and that Apex's lists predate or missed,
# each called with a low-precision ``low`` and a float32 ``f`` (4x4, values in [0.5, 1.5)).
_PROMOTED = {
    "tensordot": lambda low, f: torch.tensordot(low, f, dims=1),
    "cdist": lambda low, f: torch.cdist(low, f),
    "lerp": lambda low, f: torch.lerp(low, f, 0.3),
    "lerp weight": lambda low, f: torch.lerp(f, f * 2, low),
    "Tensor.lerp": lambda low, f: low.lerp(f, 0.3),
    "heaviside": lambda low, f: torch.heaviside(low - 1, f),
    "isclose": lambda low, f: torch.isclose(low, f),
    "allclose": lambda low, f: torch.tensor(torch.allclose(low, low.float())),
    "cholesky_solve": lambda low, f: torch.cholesky_solve(low, torch.linalg.cholesky(_SPD)),
    "triangular_solve": lambda low, f: torch.triangular_solve(low, torch.linalg.cholesky(_SPD), upper=False),
    "complex": lambda low, f: torch.complex(low, f),
    "polar": lambda low, f: torch.polar(low, f),
    "binomial": lambda low, f: (torch.manual_seed(0), torch.binomial(f.floor() * 9, low - 0.5))[1],
    "histogram": lambda low, f: torch.histogram(f, torch.linspace(0, 2, 5).to(low.dtype)),
    "meshgrid": lambda low, f: torch.meshgrid(low[0], f[0], indexing="ij"),
    "cartesian_prod": lambda low, f: torch.cartesian_prod(low[0], f[0]),
    "index_add": lambda low, f: torch.index_add(f, 0, _INDEX, low),
    "Tensor.index_add": lambda low, f: low.index_add(0, _INDEX, f),
    "index_copy": lambda low, f: torch.index_copy(f, 0, _INDEX, low),
    "index_put": lambda low, f: torch.index_put(f, (_INDEX,), low),
    "index_reduce": lambda low, f: torch.index_reduce(f, 0, _INDEX, low, "prod"),
    "scatter": lambda low, f: torch.scatter(f, 0, _SCATTER_INDEX, low),
    "scatter_add": lambda low, f: torch.scatter_add(f, 0, _SCATTER_INDEX, low),
    "Tensor.scatter_add": lambda low, f: low.scatter_add(0, _SCATTER_INDEX, f),
    "scatter_reduce": lambda low, f: torch.scatter_reduce(f, 0, _SCATTER_INDEX, low, "amax"),
    "masked_scatter": lambda low, f: torch.masked_scatter(f, f > 1, low),
    "put": lambda low, f: torch.put(f, _INDEX, low[0]),
    "F.embedding_bag": lambda low, f: F.embedding_bag(_SCATTER_INDEX, f, per_sample_weights=low, mode="sum"),
    "linalg.vecdot": lambda low, f: torch.linalg.vecdot(low, f),
    "linalg.cross": lambda low, f: torch.linalg.cross(low[:, :3], f[:, :3]),
    "linalg.solve": lambda low, f: torch.linalg.solve(_SPD, low),
    "linalg.solve_ex": lambda low, f: torch.linalg.solve_ex(_SPD, low),
    "linalg.lstsq": lambda low, f: torch.linalg.lstsq(_SPD, low).solution,
    "linalg.lu_solve": lambda low, f: torch.linalg.lu_solve(*torch.linalg.lu_factor(_SPD), low),
    "linalg.ldl_solve": lambda low, f: torch.linalg.ldl_solve(*torch.linalg.ldl_factor(_SPD), low),
    "linalg.householder_product": lambda low, f: torch.linalg.householder_product(f, low[0, :2]),
}


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("name", _PROMOTED)
def test_functions_newer_than_apex_lists_promote_mixed_inputs(dtype, name):
    """torch refuses these with one float16 and one float32 input ("expected both vectors to have same dtype");
    O1 runs them in float32, as Apex's ``dot`` and ``cross``: the result is what the float32 call gives."""
    fn = _PROMOTED[name]
    torch.manual_seed(1)
    low, f = (torch.rand(4, 4) + 0.5).to(dtype), torch.rand(4, 4) + 0.5
    reference = fn(low.float(), f)  # the same values, all float32: nothing to promote
    _o1_probe(dtype)
    torch.testing.assert_close(fn(low, f), reference)  # dtypes too: float32 (complex64, bool) as the reference's


@pytest.mark.parametrize("dtype", LOW)
def test_in_place_forms_of_the_newer_promoted_functions_keep_self_type(dtype):
    """``index_add_`` of O1-cast messages into a float32 buffer (a graph network's aggregation) adds them as
    float32; ``lerp_`` of a low-precision tensor towards a float32 one stays low precision, as ``add_`` does."""
    messages, buffer = torch.rand(4, 4).to(dtype), torch.zeros(4, 4)
    _o1_probe(dtype)
    buffer.index_add_(0, _INDEX, messages)
    expected = torch.zeros(4, 4).index_add(0, _INDEX, messages.float())
    assert buffer.dtype == torch.float32 and torch.equal(buffer, expected)
    low = torch.zeros(4, dtype=dtype)
    low.lerp_(torch.ones(4), 0.5)
    assert low.dtype == dtype and torch.equal(low, torch.full((4,), 0.5, dtype=dtype))


def test_weights_and_their_grads_stay_float32_and_casts_last_until_the_next_initialize():
    probe = _o1_probe(torch.float16)
    out = _run(probe, lambda x: probe.linear(x))
    out.float().sum().backward()
    assert probe.linear.weight.dtype == torch.float32 and probe.linear.weight.grad.dtype == torch.float32
    assert probe.linear(torch.randn(2, 4)).dtype == torch.float16  # process-wide, as Apex's patches
    amp.initialize(Probe(), opt_level="O0", verbosity=0)
    assert probe.linear(torch.randn(2, 4)).dtype == torch.float32


def test_cast_model_outputs_casts_o1_outputs():
    probe = _o1_probe(torch.float16, cast_model_outputs=torch.float32)
    assert _run(probe, lambda x: probe.linear(x)).dtype == torch.float32


def test_disable_casts_turns_o1_off_inside_the_block():
    probe = _o1_probe(torch.float16)

    def fn(x):
        with amp.disable_casts():
            inside = probe.linear(x)
        return inside, probe.linear(x)

    inside, after = _run(probe, fn)
    assert inside.dtype == torch.float32 and after.dtype == torch.float16

    def nested(x):  # leaving an inner block restores the state it found: still off inside the outer one
        with amp.disable_casts():
            with amp.disable_casts():
                pass
            return probe.linear(x)

    assert _run(probe, nested).dtype == torch.float32


def test_registered_functions_apply_from_the_next_o1_initialize_and_are_undone_after():
    namespace = types.SimpleNamespace(
        softmax=F.softmax, mix=lambda a, b: a * b, add=lambda a, b: a + b, original=F.softmax
    )
    amp.register_float_function(namespace, "softmax")
    amp.register_promote_function(namespace, "mix")
    amp.register_half_function(namespace, "add")
    try:
        probe = _o1_probe(torch.float16)
        assert _run(probe, lambda x: namespace.softmax(x.half(), -1)).dtype == torch.float32
        assert _run(probe, lambda x: namespace.mix(x.half(), x)).dtype == torch.float32
        assert _run(probe, lambda x: namespace.add(x, x)).dtype == torch.float16
        with amp.disable_casts():
            assert namespace.softmax(torch.randn(2, 2).half(), -1).dtype == torch.float16
        amp.initialize(Probe(), opt_level="O0", verbosity=0)
        assert namespace.softmax is namespace.original
    finally:
        from ampkit.compat.amp import functions

        functions._registry.clear()


def test_register_rejects_missing_functions():
    with pytest.raises(ValueError, match="no_such_fn"):
        amp.register_half_function(torch, "no_such_fn")
    with pytest.raises(ValueError, match=r"No function named 'fff.*\(5002 characters\) in module") as refused:
        amp.register_half_function(torch, "f" * 5000)  # named by its start and length, not repeated whole
    assert len(str(refused.value)) < 300


def test_decorators_cast_only_while_o1_is_active():
    @amp.half_function
    def as_half(x):
        return x * 1

    @amp.float_function
    def as_float(x):
        return x * 1

    @amp.promote_function
    def promoted(a, b):
        return a.dtype, b.dtype

    x = torch.randn(3)
    assert as_half(x).dtype == torch.float32  # amp not initialized: no casts
    amp.initialize(Probe(), opt_level="O1", dtype=torch.bfloat16, verbosity=0)
    assert as_half(x).dtype == torch.bfloat16
    assert as_float(x.half()).dtype == torch.float32
    assert promoted(x.half(), x) == (torch.float32, torch.float32)
    assert promoted(x, b=x.half()) == (torch.float32, torch.float32)  # a keyword argument is cast too
    assert promoted(x.half(), b=x.half()) == (torch.float16, torch.float16)  # no mix: left as it is
    amp.initialize(Probe(), opt_level="O2", verbosity=0)
    assert as_half(x).dtype == torch.float32


def test_cast_weights_are_not_cached_across_iterations():
    """Apex's test_cache: after a step the next forward sees the updated weights, not a stale fp16 copy."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    x = torch.randn(8, 4)
    for _ in range(3):
        out = model(x)
        expected = F.linear(x.half(), model.weight.detach().half(), model.bias.detach().half())
        assert torch.equal(out, expected)
        optimizer.zero_grad()
        with amp.scale_loss(out.float().pow(2).mean(), optimizer) as scaled:
            scaled.backward()
        optimizer.step()


@pytest.mark.parametrize("dtype", LOW)
def test_eval_attention_layers_after_a_cast_op_run_the_cast_functions(dtype):
    """torch >= 1.12 sends an eval-mode batch_first ``TransformerEncoderLayer`` or ``MultiheadAttention`` through
    fused kernels no O1 list reaches, which refused the low-precision output of the Linear before them next to
    their float32 weights. As under autocast, O1 keeps them on the layer's functions: the torch those Apex scripts
    were written for had no such kernels. After O1 the fast paths are back."""
    torch.manual_seed(0)
    embed = torch.nn.Linear(6, 8)
    encoder = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    model = torch.nn.ModuleList([embed, encoder, attention]).eval()
    amp.initialize(model, opt_level="O1", dtype=dtype, verbosity=0)
    x = torch.randn(3, 5, 6)
    with torch.no_grad():
        h = embed(x)
        encoded = encoder(h)
        attended, _ = attention(h, h, h, need_weights=False)
    assert attended.dtype == dtype  # its output projection is a Linear
    assert encoded.dtype == torch.float32  # its last function is layer_norm, which O1 runs in float32
    with torch.no_grad(), amp.disable_casts():
        reference = encoder(embed(x))  # the same functions in float32: the cast path agrees within rounding
    torch.testing.assert_close(encoded.float(), reference, atol=0.05, rtol=0.05)
    amp.initialize(torch.nn.Linear(1, 1), opt_level="O0", verbosity=0)
    assert torch.backends.mha.get_fastpath_enabled()


@pytest.mark.parametrize("dtype", LOW)
def test_prelu_and_bilinear_modules_after_a_cast_op_are_cast_as_torch_prelu_and_bilinear(dtype):
    """Apex's O1 patched ``torch.prelu`` (low precision) and ``torch.bilinear`` (promote), which ``nn.PReLU`` and
    ``nn.Bilinear`` reached through ``F.prelu``/``F.bilinear``. torch has since made those two F functions the very
    objects ``torch.prelu``/``torch.bilinear`` were, so a patch of torch's name alone missed the modules: a
    face-recognition backbone's Conv-BN-PReLU failed with "prelu: Type promoting not supported"."""
    originals = (F.prelu, F.bilinear, torch.prelu, torch.bilinear)
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.PReLU(4))
    head = torch.nn.Bilinear(4, 4, 2)
    model = torch.nn.ModuleList([body, head])
    amp.initialize(model, opt_level="O1", dtype=dtype, verbosity=0)
    features = body(torch.randn(2, 3, 5, 5))
    assert features.dtype == dtype
    pooled = features.mean((2, 3))
    scores = head(pooled, torch.randn(2, 4))  # a low-precision and a float32 input: promoted, as Apex's CASTS
    assert scores.dtype == torch.float32
    scores.sum().backward()
    assert body[2].weight.grad.dtype == torch.float32
    amp.initialize(torch.nn.Linear(1, 1), opt_level="O0", verbosity=0)
    assert (F.prelu, F.bilinear, torch.prelu, torch.bilinear) == originals  # all four put back
