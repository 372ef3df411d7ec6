"""amp.initialize: signature, return shapes, Apex's property table and override errors, re-initialization."""

import copy
import functools
import gc
import inspect
import io
import pydoc
import re
import typing
import warnings
import weakref

import numpy as np
import pytest
import torch

from ampkit.compat import amp


def _model():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("models_as_list", [False, True])
@pytest.mark.parametrize("optimizers_as", [None, "single", "list", "tuple"])
def test_models_and_optimizers_come_back_in_the_shape_given(models_as_list, optimizers_as):
    model = _model()
    optimizer = _sgd(model)
    models = [model] if models_as_list else model
    optimizers = {None: None, "single": optimizer, "list": [optimizer], "tuple": (optimizer,)}[optimizers_as]
    result = amp.initialize(models, optimizers, opt_level="O1", verbosity=0)
    expected_models = [model] if models_as_list else model
    if optimizers_as is None:
        assert result == expected_models
    else:
        got_models, got_optimizers = result
        assert got_models == expected_models
        assert got_optimizers == optimizers and type(got_optimizers) is type(optimizers)


def test_zero_one_is_rejected_naming_the_valid_levels():
    with pytest.raises(RuntimeError) as err:
        amp.initialize(_model(), opt_level="01", verbosity=0)
    for level in ("O0", "O1", "O2", "O3"):
        assert level in str(err.value)
    assert "letter O" in str(err.value)


@pytest.mark.parametrize(
    "overrides, option",
    [
        (dict(opt_level="O1", cast_model_type=torch.float16), "cast_model_type"),
        (dict(opt_level="O1", keep_batchnorm_fp32=True), "keep_batchnorm_fp32"),
        (dict(opt_level="O1", master_weights=True), "master_weights"),
        (dict(opt_level="O2", patch_torch_functions=True), "patch_torch_functions"),
    ],
)
def test_overrides_apex_forbids_raise_naming_the_option(overrides, option):
    with pytest.raises(RuntimeError, match=option):
        amp.initialize(_model(), verbosity=0, **overrides)


@pytest.mark.parametrize(
    "level, weight_dtype, bn_dtype, master_weights, scale, dynamic",
    [
        ("O0", torch.float32, torch.float32, False, 1.0, False),
        ("O1", torch.float32, torch.float32, False, 2.0**16, True),
        ("O2", torch.float16, torch.float32, True, 2.0**16, True),
        ("O3", torch.float16, torch.float16, False, 1.0, False),
    ],
)
def test_property_table(level, weight_dtype, bn_dtype, master_weights, scale, dynamic):
    model = _model()
    optimizer = _sgd(model)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
    assert model[0].weight.dtype == weight_dtype
    assert model[1].weight.dtype == bn_dtype and model[1].running_mean.dtype == bn_dtype
    optimizer_dtypes = {p.dtype for p in amp.master_params(optimizer)}
    assert optimizer_dtypes == ({torch.float32} if master_weights or level in ("O0", "O1") else {weight_dtype})
    separate_master = [p is not q for p, q in zip(amp.master_params(optimizer), model.parameters(), strict=True)]
    assert separate_master == [master_weights and q.dtype != torch.float32 for q in model.parameters()]
    scaler = amp._amp_state.loss_scalers[0]
    assert scaler.loss_scale() == scale and scaler.dynamic == dynamic
    output = model(torch.randn(3, 4))
    assert output.dtype == (torch.float16 if level == "O1" else torch.float32)


def test_o2_keeps_only_affine_batchnorms_float32_as_apex():
    """Apex's ``keep_batchnorm_fp32`` kept a batch norm float32 only when it has a weight and bias: one built with
    ``affine=False`` (a projection head's) was cast to half, its running statistics too, and normalised in half.
    The state dict still saves float32, so a checkpoint loads at any level."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8, affine=False), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
    )
    model, optimizer = amp.initialize(model, _sgd(model), opt_level="O2", verbosity=0)
    plain, affine = model[1], model[2]
    assert plain.running_mean.dtype == plain.running_var.dtype == torch.float16
    assert affine.weight.dtype == affine.running_mean.dtype == torch.float32
    x = torch.randn(16, 4)
    model(x)
    assert plain.running_var.dtype == torch.float16  # the statistics are updated in half
    model.eval()
    hidden = model[0](x.half())
    expected = torch.nn.functional.batch_norm(hidden, plain.running_mean, plain.running_var, eps=plain.eps)
    torch.testing.assert_close(plain(hidden), expected, rtol=0, atol=0)
    assert model.state_dict()["1.running_mean"].dtype == torch.float32


class _LanguageModel(torch.nn.Module):
    """A recurrent LM whose trainer calls ``model.forward(x, hidden)`` itself, and whose loss method calls
    ``self.forward``: flair's LanguageModel and its trainer did both."""

    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(4, 8)
        self.rnn = torch.nn.GRU(8, 8)
        self.decoder = torch.nn.Linear(8, 5)

    def forward(self, x, hidden):
        output, hidden = self.rnn(self.encoder(x), hidden)
        return self.decoder(output), hidden

    def forward_loss(self, x, hidden, target):
        logits, _ = self.forward(x, hidden)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_direct_forward_call_casts_as_apexs_patched_forward_did(level):
    """Apex replaced ``model.forward``, so ``model.forward(x)`` and a method's ``self.forward(x)`` cast float32
    inputs to half and the outputs back, as ``model(x)`` does; they met half weights with float32 inputs before."""
    torch.manual_seed(0)
    model = _LanguageModel()
    model, optimizer = amp.initialize(model, _sgd(model), opt_level=level, verbosity=0)
    x, hidden = torch.randn(3, 2, 4), torch.zeros(1, 2, 8)
    logits, new_hidden = model.forward(x, hidden)
    assert logits.dtype == new_hidden.dtype == torch.float32
    assert list(inspect.signature(model.forward).parameters) == ["x", "hidden"]  # transformers reads it
    assert torch.equal(logits, model(x, hidden)[0])
    loss = model.forward_loss(x, hidden, torch.randint(0, 5, (3, 2)))
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()


def _is_overridden(name, instance, parent):
    """Lightning's ``is_overridden``: follow ``__wrapped__`` (functools.wraps) and compare the code objects."""
    method = getattr(instance, name)
    method = getattr(method, "__wrapped__", method)
    return method.__code__ is not getattr(parent, name).__code__


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_the_casting_forward_answers_as_the_bound_forward_does(level):
    """Code that introspects ``model.forward`` after ``initialize`` sees the model's own: Lightning's
    ``is_overridden`` reads ``__code__`` through ``__wrapped__`` (an AttributeError before), loggers its names. It
    has no ``__func__``: accelerate rebinds ``forward.__func__`` where it exists, which would drop the casts, and
    wraps the forward whole otherwise; that wrapper still casts."""
    model = _LanguageModel()
    model = amp.initialize(model, opt_level=level, verbosity=0)
    forward = model.forward
    assert _is_overridden("forward", model, torch.nn.Module)
    assert (forward.__name__, forward.__qualname__) == ("forward", "_LanguageModel.forward")
    assert forward.__self__ is model and inspect.unwrap(forward) == _LanguageModel.forward.__get__(model)
    assert not hasattr(forward, "__func__")
    wrapped = functools.wraps(forward)(lambda *args, **kwargs: forward(*args, **kwargs))
    assert wrapped.__name__ == "forward" and list(inspect.signature(wrapped).parameters) == ["x", "hidden"]
    logits, _ = wrapped(torch.randn(3, 2, 4), torch.zeros(1, 2, 8))
    assert logits.dtype == torch.float32


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_torchscript_module_is_refused_where_it_would_be_cast_and_left_as_it_was():
    """O2/O3 refuse a scripted model before touching it, saying what works (Apex cast it to half, then failed in
    torch's "_register_state_dict_hook is not supported on ScriptModules"); O1, whose patched functions its compiled
    code never calls, warns that it runs in float32."""
    scripted = torch.jit.script(_model())
    with pytest.raises(RuntimeError, match=r"models\[0\] is a TorchScript module .*O2.*torch\.jit\.trace"):
        amp.initialize(scripted, _sgd(scripted), opt_level="O2", verbosity=0)
    assert all(p.dtype == torch.float32 for p in scripted.parameters())
    assert isinstance(scripted.forward, torch.ScriptMethod)
    with pytest.warns(UserWarning, match="runs in float32"):
        amp.initialize(scripted, _sgd(scripted), opt_level="O1", verbosity=0)


class _Documented(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)
        self.norm = torch.nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """Project ``x`` and normalise it."""
        return self.norm(self.proj(x)) * scale


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_help_and_inspect_show_the_models_forward_not_the_casting_object(level):
    """``help(model.forward)``, ``inspect.getdoc``/``getsource`` and type hints after ``initialize`` show the model's
    forward, as ``functools.wraps`` would: help() printed the casting class's docstring and no signature."""
    model = amp.initialize(_Documented(), opt_level=level, verbosity=0)
    text = pydoc.render_doc(model.forward, renderer=pydoc.plaintext)
    assert "forward(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor\n    Project ``x`` and normalise it." in text
    assert inspect.getdoc(model.forward) == "Project ``x`` and normalise it."
    assert inspect.getsource(model.forward) == inspect.getsource(_Documented.forward)
    assert typing.get_type_hints(model.forward) == {"x": torch.Tensor, "scale": float, "return": torch.Tensor}
    assert model.forward.__module__ == __name__


@pytest.mark.filterwarnings("ignore:`torch.jit.(script|trace|trace_method)` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_an_initialized_model_is_exported_or_traced_with_its_casts_and_refused_by_torchscript(level):
    """``torch.export`` and ``torch.jit.trace`` record the casts (export failed reading ``forward.__code__``);
    ``torch.jit.script`` would compile the model's own forward without them, so it is refused naming the cause and
    what works (it failed on an unexplained ``__globals__``; Apex's closure could not be scripted either)."""
    torch.manual_seed(0)
    model = amp.initialize(_Documented(), opt_level=level, verbosity=0).eval()
    x = torch.randn(5, 4)
    with pytest.raises(AttributeError, match=r"script cannot compile the forward .* on _Documented .*jit\.trace"):
        torch.jit.script(model)
    for recorded in (torch.export.export(model, (x,)).module(), torch.jit.trace(model, (x,))):
        out = recorded(x)
        assert out.dtype == torch.float32 and torch.equal(out, model(x))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_fx_symbolic_trace_of_an_initialized_model_leaves_out_the_casts_as_under_apex(level):
    """``torch.fx.symbolic_trace(model)`` traces the class's ``forward`` (``type(root).forward``), never the one
    ``initialize`` set on the model, as with Apex's: the traced module meets float32 inputs with half weights and
    fails with torch's dtype error, and runs on inputs cast by hand. A module that calls the model is traced
    through its casts (they become ``.to`` nodes), and ``torch.export``'s module is an fx GraphModule with them."""
    torch.manual_seed(0)
    model = amp.initialize(_Documented(), opt_level=level, verbosity=0).eval()
    x = torch.randn(5, 4)
    traced = torch.fx.symbolic_trace(model)
    assert not any(node.target == "to" for node in traced.graph.nodes)
    with pytest.raises(RuntimeError, match=r"must have the same dtype, but got Float and Half"):
        traced(x)
    assert torch.equal(traced(x.half()).float(), model(x))

    class Caller(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    exported = torch.export.export(model, (x,)).module()
    for graph_module in (torch.fx.symbolic_trace(Caller(model)), exported):
        assert isinstance(graph_module, torch.fx.GraphModule)
        out = graph_module(x)
        assert out.dtype == torch.float32 and torch.equal(out, model(x))


def test_torch_compile_after_o2_trains_as_the_eager_model():
    """A newer user's ``torch.compile(model)`` (or ``model.compile()``) after O2 ``initialize`` compiles in one graph
    and trains bit for bit as the eager model: the casting forward and hooks trace through."""

    def train(compile_it):
        torch.manual_seed(0)
        model = _model()
        model, optimizer = amp.initialize(model, _sgd(model), opt_level="O2", verbosity=0)
        run = torch.compile(model, backend="eager", fullgraph=True) if compile_it else model
        for _ in range(2):
            out = run(torch.randn(6, 4))
            with amp.scale_loss(out.pow(2).mean(), optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
        return out, model.state_dict()

    torch._dynamo.reset()
    (out, state), (eager_out, eager_state) = train(True), train(False)
    assert out.dtype == torch.float32 and torch.equal(out, eager_out)
    assert all(torch.equal(state[k], eager_state[k]) for k in eager_state)


def test_a_deep_copy_made_after_initialize_runs_its_own_weights():
    """An EMA made with ``copy.deepcopy(model)`` after O2 gets a casting forward of its own: Apex's closure kept
    calling the original model's forward, so the copy's weights were never used."""
    torch.manual_seed(0)
    model = amp.initialize(_LanguageModel(), opt_level="O2", verbosity=0)
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for param in ema.parameters():
            param.zero_()
    x, hidden = torch.randn(3, 2, 4), torch.zeros(1, 2, 8)
    assert not ema.forward(x, hidden)[0].any() and model.forward(x, hidden)[0].any()
    restored = torch.load(io.BytesIO(_pickled(ema)), weights_only=False)
    assert restored.forward(x, hidden)[0].dtype == torch.float32 and not restored(x, hidden)[0].any()


class _Projection(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        return x @ self.weight


def test_a_dataparallel_replica_runs_its_own_weights():
    """DataParallel replicas share the model's ``forward`` object (a shallow copy of its ``__dict__``): each must
    still run its own weights, which Apex's replaced forward did not (NVIDIA/apex#227: O2 + DataParallel failed
    with a device mismatch). The replica is built here as torch's ``replicate`` builds it, on one CPU."""
    torch.manual_seed(0)
    model = amp.initialize(_Projection(), opt_level="O2", verbosity=0)
    replica = model._replicate_for_data_parallel()
    replica.weight = model.weight.detach() * 2  # replicate() sets each replica's copies as plain attributes
    x = torch.randn(2, 4)
    assert torch.equal(replica(x), (x.half() @ (model.weight.detach() * 2)).float())
    assert torch.equal(model(x), (x.half() @ model.weight.detach()).float())


def test_models_initialized_and_dropped_are_freed():
    """A sweep or a notebook initializes model after model: amp's record of each model's casting forward must not
    keep the dropped ones (and their weights) alive."""
    refs = []
    for _ in range(3):
        model = torch.nn.Linear(3, 3)
        model, optimizer = amp.initialize(model, _sgd(model), opt_level="O2", verbosity=0)
        model(torch.randn(1, 3))
        refs.append(weakref.ref(model))
        del model, optimizer
    amp.initialize(torch.nn.Linear(1, 1), opt_level="O0", verbosity=0)
    gc.collect()
    assert [ref() for ref in refs] == [None, None, None]


def test_a_call_aborted_by_a_later_hook_leaves_direct_forward_calls_cast():
    """A pre-hook of the script's that raises (a shape check) aborts ``model(x)`` between amp's input cast and the
    forward: a later ``model.forward(x)`` must still cast its float32 inputs."""
    torch.manual_seed(0)
    model = amp.initialize(_Projection(), opt_level="O2", verbosity=0)

    def reject(module, args):
        raise ValueError("batch too small")

    handle = model.register_forward_pre_hook(reject)
    with pytest.raises(ValueError, match="batch too small"):
        model(torch.randn(2, 4))
    handle.remove()
    x = torch.randn(2, 4)
    assert torch.equal(model.forward(x), (x.half() @ model.weight.detach()).float())


def _pickled(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_overrides_that_apex_allows():
    model = _model()
    model, optimizer = amp.initialize(
        model, _sgd(model), opt_level="O2", keep_batchnorm_fp32="False", loss_scale="128.0", verbosity=0
    )
    assert model[1].weight.dtype == torch.float16
    assert amp._amp_state.loss_scalers[0].loss_scale() == 128.0
    assert not amp._amp_state.loss_scalers[0].dynamic


def test_ascend_knobs_configure_the_dynamic_scalers():
    model = _model()
    amp.initialize(
        model, _sgd(model), opt_level="O1", num_losses=2, dynamic_init_scale=2.0**10, scale_growth_factor=4.0,
        scale_backoff_factor=0.25, scale_window=3, min_loss_scale=8.0, max_loss_scale=2.0**12, verbosity=0,
    )  # fmt: skip
    for scaler in amp._amp_state.loss_scalers:
        assert scaler.loss_scale() == 2.0**10
        assert (scaler.growth_factor, scaler.backoff_factor, scaler.growth_interval) == (4.0, 0.25, 3)
        assert (scaler.min_scale, scaler.max_scale) == (8.0, 2.0**12)


@pytest.mark.parametrize(("option", "value", "message"), [
    ("dynamic_init_scale", -1.0, r"dynamic_init_scale=-1.0: expected a finite number > 0"),
    ("scale_growth_factor", 0.5, r"scale_growth_factor=0.5: expected a number > 1"),
    ("scale_backoff_factor", 2.0, r"scale_backoff_factor=2.0: expected a number in \(0, 1\)"),
    ("scale_window", 0, r"scale_window=0: expected an integer >= 1"),
    ("min_loss_scale", -1.0, r"min_loss_scale=-1.0: expected a finite number > 0"),
    ("max_loss_scale", 0.0, r"max_loss_scale=0.0: expected a finite number > 0"),
])  # fmt: skip
def test_a_bad_scaler_option_is_named_as_initialize_spells_it(option, value, message):
    """The engine's scaler calls these init_scale, growth_factor, ... growth_interval: an error naming those sent the
    user looking for an argument their call to initialize does not have."""
    model = _model()
    with pytest.raises(ValueError, match=rf"^{message}"):
        amp.initialize(model, _sgd(model), opt_level="O1", verbosity=0, **{option: value})
    with pytest.raises(ValueError, match=r"^min_loss_scale=1024.0 is larger than max_loss_scale=8.0"):
        amp.initialize(model, _sgd(model), opt_level="O1", verbosity=0, min_loss_scale=1024.0, max_loss_scale=8.0)


def test_a_first_scale_float32_cannot_carry_is_named_as_initialize_spells_it():
    """With no cap, dynamic_init_scale=1e300 scaled every loss to inf: some 870 steps skipped, as under Apex, before
    the scale halved back into float32's range. The default cap of 2**24 still takes it."""
    model = _model()
    with pytest.raises(ValueError, match=r"^dynamic_init_scale=1e\+300: the first dynamic scale must lie in float32"):
        amp.initialize(model, _sgd(model), verbosity=0, dynamic_init_scale=1e300, max_loss_scale=None)
    amp.initialize(model, _sgd(model), verbosity=0, dynamic_init_scale=1e300)
    assert amp._amp_state.loss_scalers[0].loss_scale() == 2.0**24


def test_bfloat16_on_request():
    model = _model()
    model, _ = amp.initialize(model, _sgd(model), opt_level="O2", dtype="bfloat16", verbosity=0)
    assert model[0].weight.dtype == torch.bfloat16
    o1 = _model()
    amp.initialize(o1, _sgd(o1), opt_level="O1", dtype=torch.bfloat16, verbosity=0)
    assert o1(torch.randn(3, 4)).dtype == torch.bfloat16


def test_disabled_returns_inputs_and_scale_loss_is_a_passthrough():
    model = _model()
    optimizer = _sgd(model)
    assert amp.initialize(model, optimizer, enabled=False, opt_level="O2", verbosity=0) == (model, optimizer)
    assert model[0].weight.dtype == torch.float32
    loss = model(torch.randn(3, 4)).sum()
    with amp.scale_loss(loss, optimizer) as scaled:
        assert scaled is loss


@pytest.mark.parametrize(
    "settings",
    [
        dict(opt_level=None),
        dict(opt_level="o2"),
        dict(opt_level="O2", loss_scale=0),  # pytorch-pretrained-BERT's "0 means dynamic", passed through
        dict(opt_level="O1", keep_batchnorm_fp32=True),
        dict(opt_level="O2", loss_scale="None", num_losses=0, min_loss_scale=-1.0),
    ],
)
def test_disabled_reads_no_other_setting_as_apex(settings):
    """Apex's ``initialize`` returned at ``enabled=False`` before reading anything else, so the float32 run of a
    script passing its fp16 settings through (``enabled=cfg.fp16, opt_level=cfg.opt_level, ...``) ran whatever
    they held; here it stopped on them. The switch itself is still checked: ``'False'`` is not False."""
    model = _model()
    optimizer = _sgd(model)
    returned = amp.initialize(model, optimizer, enabled=False, verbosity=0, **settings)
    assert returned[0] is model and returned[1] is optimizer
    assert amp.initialize(model, enabled=False, **settings) is model
    with amp.scale_loss(model(torch.randn(3, 4)).sum(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert not amp._amp_state.opt_properties.enabled and amp.state_dict() == {}
    with pytest.raises(ValueError, match=r"enabled='False': expected True or False"):
        amp.initialize(model, optimizer, enabled="False", **settings)


def test_scale_loss_before_initialize_is_a_clear_error():
    model = _model()
    with pytest.raises(RuntimeError, match="amp.initialize"):
        with amp.scale_loss(model(torch.randn(3, 4)).sum(), _sgd(model)):
            pass


def test_load_state_dict_before_initialize_is_kept_for_the_scalers_initialize_makes():
    """Apex had no scalers to restore into before ``initialize`` (an AttributeError); the saved scale must not be
    dropped: the next ``initialize`` loads it, once (Lightning 1.x restores amp state before initializing)."""
    amp._amp_state.reset()  # a fresh process
    assert not hasattr(amp._amp_state, "opt_properties")
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 128.0, "unskipped": 7}})
    assert not hasattr(amp._amp_state, "opt_properties")
    amp.initialize(_model(), opt_level="O1", verbosity=0)
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 128.0, "unskipped": 7}}
    amp.initialize(_model(), opt_level="O1", verbosity=0)
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 2.0**16, "unskipped": 0}}


def test_a_run_without_amp_resumes_from_the_amp_state_it_saved():
    """mmcv-style runners (Swin-Transformer-Object-Detection) save amp.state_dict() and restore it on resume
    whether or not fp16 was on: with no initialize, the empty state round-trips instead of failing the resume."""
    amp._amp_state.reset()  # a fresh process, fp16 off: amp.initialize never called
    saved = amp.state_dict()
    assert saved == {}
    amp.load_state_dict(saved)
    assert amp.state_dict() == {}


class _MatmulSGD(torch.optim.Optimizer):
    """An optimizer whose update goes through torch.mm (as Shampoo/K-FAC-style preconditioners do)."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})
        self.update_dtypes: list[torch.dtype] = []

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                update = torch.mm(torch.eye(p.shape[0]), p.grad)
                self.update_dtypes.append(update.dtype)
                p.add_(update, alpha=-group["lr"])


def test_o1_casts_are_off_inside_optimizer_step():
    """Apex wrapped every optimizer's step in disable_casts: an optimizer's own matmuls stay float32, so an
    update too small for float16 is still applied."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4, bias=False)
    model, optimizer = amp.initialize(model, _MatmulSGD(model.parameters(), lr=1.0), opt_level="O1", verbosity=0)
    with amp.scale_loss(model(torch.randn(8, 4)).float().mean() * 1e-7, optimizer) as scaled:
        scaled.backward()
    expected = -model.weight.grad.clone()
    with torch.no_grad():
        model.weight.zero_()
    optimizer.step()
    assert optimizer.update_dtypes == [torch.float32]
    assert torch.equal(model.weight, expected) and expected.abs().max() < 1e-7


@pytest.mark.parametrize("make", [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), torch.optim.Adam])
def test_o3_recasts_optimizer_state_made_before_initialize(make):
    """Apex's state-dict trick at initialize: per-parameter state made before the model cast (momentum, Adam's
    moments) follows the parameters to float16, so the next step runs (Adam's failed on the mixed dtypes)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = make(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    model, optimizer = amp.initialize(model, optimizer, opt_level="O3", verbosity=0)
    state = optimizer.state[model.weight]
    assert {k: v.dtype for k, v in state.items() if k != "step"} == dict.fromkeys(set(state) - {"step"}, torch.half)
    optimizer.zero_grad()
    with amp.scale_loss(model(torch.randn(5, 4).half()).float().sum(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert model.weight.dtype == torch.half and torch.isfinite(model.weight).all()


@pytest.mark.parametrize("num_losses", [-1, 1.5, True, "2", 1025, 10**8])
def test_a_num_losses_that_is_no_count_of_scalers_is_named(num_losses):
    """10**8 (a typo) made a scaler each for the better part of an hour: bounded as precision.num_losses is, but from
    0, which makes no scaler (Apex's ``range(0)``: a model-only initialize before the optimizer's own)."""
    model = _model()
    with pytest.raises(
        ValueError,
        match=rf"^num_losses={re.escape(repr(num_losses))}: expected an integer in \[0, 1024\] \(each loss gets its "
        r"scaler up front; 0: no loss scaler",
    ):
        amp.initialize(model, _sgd(model), verbosity=0, num_losses=num_losses)


def test_loss_id_out_of_range_names_num_losses():
    model = _model()
    model, optimizer = amp.initialize(model, _sgd(model), opt_level="O1", num_losses=2, verbosity=0)
    with pytest.raises(ValueError, match="num_losses=2"):
        with amp.scale_loss(model(torch.randn(3, 4)).sum(), optimizer, loss_id=2):
            pass


def test_numpys_integers_count_losses_and_name_them_as_apexs_list_indexing_took_them():
    """A script that reads its loss count from a config through numpy (``np.int64``) ran under Apex, whose scaler
    list took it in ``range`` and as an index; it was refused as not an integer."""
    model = _model()
    model, optimizer = amp.initialize(model, _sgd(model), opt_level="O1", num_losses=np.int64(2), verbosity=0)
    for loss_id in (np.int64(1), np.int32(0)):
        with amp.scale_loss(model(torch.randn(3, 4)).sum(), optimizer, loss_id=loss_id) as scaled:
            scaled.backward()
    with pytest.raises(TypeError, match="loss_id=1.0 is a float"):
        with amp.scale_loss(model(torch.randn(3, 4)).sum(), optimizer, loss_id=1.0):
            pass


def test_a_loss_read_to_a_number_is_named():
    model = _model()
    model, optimizer = amp.initialize(model, _sgd(model), opt_level="O1", verbosity=0)
    with pytest.raises(TypeError, match="expects the loss as a tensor, got float"):
        with amp.scale_loss(model(torch.randn(3, 4)).sum().item(), optimizer):
            pass


def test_initializing_the_same_optimizer_twice_is_an_error():
    model = _model()
    optimizer = _sgd(model)
    amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    with pytest.raises(RuntimeError, match="only be passed through amp.initialize once"):
        amp.initialize(_model(), optimizer, opt_level="O1", verbosity=0)


def test_wrapped_models_and_cast_models_are_rejected():
    with pytest.raises(RuntimeError, match=r"AFTER .*: pass the model it wraps \(its \.module\) and wrap the model"):
        amp.initialize(torch.nn.DataParallel(_model()), opt_level="O1", verbosity=0)
    with pytest.raises(RuntimeError, match="do not need to call .half"):
        amp.initialize(_model().half(), opt_level="O1", verbosity=0)


def test_reinitialize_starts_a_new_run_without_stale_state():
    first = _model()
    first, opt1 = amp.initialize(first, _sgd(first), opt_level="O1", num_losses=2, verbosity=0)
    state = amp._amp_state
    state.loss_scalers[1].update(found_inf=True)
    second = _model()
    second, opt2 = amp.initialize(second, _sgd(second), opt_level="O0", verbosity=0)
    assert amp._amp_state is state  # references taken by legacy code see the new run
    assert len(state.loss_scalers) == 1 and state.loss_scalers[0].loss_scale() == 1.0
    assert not state.handle.is_active()  # the O1 casts of the first run are undone
    # The same model may be initialized again at another level: its old O1 hooks are replaced.
    third_opt = _sgd(first)
    amp.initialize(first, third_opt, opt_level="O0", verbosity=0)
    assert first(torch.randn(3, 4)).dtype == torch.float32


def test_verbosity_controls_the_setup_printout(capsys):
    model = _model()
    amp.initialize(model, _sgd(model), opt_level="O2", verbosity=1)
    out = capsys.readouterr().out
    assert "Selected optimization level O2" in out and "master_weights" in out
    model = _model()
    amp.initialize(model, _sgd(model), opt_level="O2", verbosity=0)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("is_master", [True, False])
def test_verbosity_may_be_a_bool_as_apex_took_it(is_master, capsys):
    """NVIDIA's retinanet-examples (odtk) passes ``verbosity=is_master``: Apex compared it with 0, so rank 0
    printed and the others kept quiet. It was refused as not an integer."""
    model = _model()
    amp.initialize(model, _sgd(model), opt_level="O2", verbosity=is_master)
    assert ("Selected optimization level O2" in capsys.readouterr().out) is is_master
    assert amp._amp_state.verbosity == int(is_master)
    with pytest.raises(ValueError, match=r"verbosity='1': expected an integer"):
        amp.initialize(model, opt_level="O0", verbosity="1")


def test_state_dict_has_apex_format_and_round_trips():
    model = _model()
    amp.initialize(model, _sgd(model), opt_level="O1", num_losses=2, verbosity=0)
    amp._amp_state.loss_scalers[1].update(found_inf=True)
    amp._amp_state.loss_scalers[0].update(found_inf=False)
    state = amp.state_dict()
    assert list(state) == ["loss_scaler0", "loss_scaler1"]
    assert state["loss_scaler0"] == {"loss_scale": 2.0**16, "unskipped": 1}
    assert state["loss_scaler1"] == {"loss_scale": 2.0**15, "unskipped": 0}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    model = _model()
    amp.initialize(model, _sgd(model), opt_level="O1", num_losses=2, verbosity=0)
    amp.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    assert amp.state_dict() == state
    with pytest.raises(RuntimeError, match='Unexpected key.*"optimizer"'):
        amp.load_state_dict({"optimizer": {}, "loss_scaler0": state["loss_scaler0"]})


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_step_right_after_a_delayed_unscale_is_refused(opt_level):
    """Apex stepped on gradients still multiplied by the scale (O1: an inf-sized step) or on none (O2)."""
    model = _model()
    model, optimizer = amp.initialize(model, _sgd(model), opt_level=opt_level, verbosity=0)
    x = torch.randn(3, 4)
    with amp.scale_loss(model(x).float().sum(), optimizer, delay_unscale=True) as scaled:
        scaled.backward()
    with pytest.raises(RuntimeError, match="right after amp.scale_loss\\(..., delay_unscale=True\\)"):
        optimizer.step()
    with amp.scale_loss(model(x).float().sum(), optimizer) as scaled:  # the accumulation's last backward
        scaled.backward()
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_step_inside_the_scale_loss_block_is_refused_as_such(opt_level):
    """A step indented into the with-block was refused as if ``delay_unscale=True`` had been passed, which the
    script never did: the message now says where the step is and where it belongs."""
    model = _model()
    model, optimizer = amp.initialize(model, _sgd(model), opt_level=opt_level, verbosity=0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"inside the `with amp\.scale_loss\(\.\.\.\)` block.*after the with-block"):
        with amp.scale_loss(model(torch.randn(3, 4)).float().sum(), optimizer) as scaled:
            scaled.backward()
            optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_o2_refuses_two_optimizers_over_one_parameter():
    model = _model()
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    second = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"optimizers\[0\] and optimizers\[1\] both hold a parameter of shape"):
        amp.initialize(model, [first, second], opt_level="O2", verbosity=0)


def test_nested_scale_loss_on_one_optimizer_is_named_and_an_error_inside_a_block_leaves_none_open():
    model = _model()
    model, optimizer = amp.initialize(model, _sgd(model), opt_level="O1", num_losses=2, verbosity=0)
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="amp.scale_loss inside another amp.scale_loss of the same optimizer"):
        with amp.scale_loss(model(x).sum(), optimizer, loss_id=0):
            with amp.scale_loss(model(x).sum(), optimizer, loss_id=1):
                pass
    with amp.scale_loss(model(x).sum(), optimizer) as scaled:  # the failed block closed
        scaled.backward()
    optimizer.step()


@pytest.mark.parametrize("none", [[], ()])
def test_scale_loss_with_no_optimizers_is_refused_not_left_scaled(none):
    """``amp.scale_loss(loss, [])`` (an optimizer list built empty by a filter) unscaled nothing: the backward's
    gradients stayed multiplied by 65536 and the step that followed took them as they were, with no skip."""
    model = _model()
    model, optimizer = amp.initialize(model, _sgd(model), opt_level="O1", verbosity=0)
    with pytest.raises(ValueError, match=r"amp.scale_loss got no optimizers \((\[\]|\(\))\): pass the optimizer"):
        with amp.scale_loss(model(torch.randn(3, 4)).sum(), none):
            pass
    with amp.scale_loss(model(torch.randn(3, 4)).sum(), optimizer) as scaled:  # nothing was left open
        scaled.backward()
    optimizer.step()


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2"])
def test_a_model_or_optimizer_on_the_meta_device_is_refused_at_initialize(opt_level):
    """A model built on the meta device (to materialize later) went through amp.initialize: O1 and O2 then failed
    in the first step with a raw op error (``Tensor.item() cannot be called on meta tensors``) and O0 trained
    nothing, its optimizer stepping the meta parameters that ``to_empty`` had replaced."""
    meta = torch.nn.Linear(4, 2, device="meta")
    with pytest.raises(ValueError, match=r"models\[0\]'s parameter 'weight' is on the meta device.*materialize"):
        amp.initialize(meta, _sgd(meta), opt_level=opt_level, verbosity=0)
    model = _model()
    with pytest.raises(ValueError, match=r"optimizers\[0\] \(SGD\) holds parameters on the meta device"):
        amp.initialize(model, _sgd(meta), opt_level=opt_level, verbosity=0)


def test_an_optimizer_over_another_models_parameters_is_warned_about():
    """``amp.initialize(model, optimizer)`` with the optimizer built over another model: every step trained the other
    model and this one never moved, with no word."""
    model, other = _model(), _model()
    with pytest.warns(UserWarning, match=r"optimizers\[0\] \(SGD\) holds none of the parameters of the model"):
        amp.initialize(model, _sgd(other), opt_level="O1", verbosity=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = _model()
        amp.initialize(model, _sgd(model), opt_level="O1", verbosity=0)


@pytest.mark.parametrize("bad", ["False", 2, 1.0])
def test_combine_grad_that_is_not_a_switch_is_refused(bad):
    """``combine_grad="False"`` (a string from a config) was read with ``bool()``: the flat gradient buffers went on."""
    model = _model()
    with pytest.raises(ValueError, match=rf"combine_grad={bad!r}: expected True, False or None"):
        amp.initialize(model, _sgd(model), opt_level="O1", verbosity=0, combine_grad=bad)
    model = _model()
    amp.initialize(model, _sgd(model), opt_level="O1", verbosity=0, combine_grad=0)


@pytest.mark.parametrize("name", ["delay_unscale", "delay_overflow_check"])
def test_a_scale_loss_switch_that_is_not_true_or_false_is_refused_before_the_backward(name):
    """``delay_overflow_check="False"`` was read as True: the scale never moved and an overflow was not skipped, so
    the step ran on inf gradients; ``delay_unscale="False"`` left the gradients scaled."""
    model = _model()
    model, optimizer = amp.initialize(model, _sgd(model), opt_level="O1", verbosity=0)
    loss = model(torch.randn(3, 4)).sum()
    with pytest.raises(ValueError, match=rf"amp.scale_loss: {name}='False': expected True or False"):
        with amp.scale_loss(loss, optimizer, **{name: "False"}):
            pass
    with amp.scale_loss(loss, optimizer, **{name: np.False_}) as scaled:  # numpy's bool_ as Apex took it
        scaled.backward()
    assert not optimizer._amp_stash.combiner.pending


def test_a_numpy_bool_is_a_switch_as_in_apex():
    """The checks for a switch that is not True or False refused numpy's bool_ (``enabled=args.fp16 > 0`` over a
    numpy value, a flag read with pandas), which Apex used as the bool it is."""
    import numpy as np

    model = _model()
    model, _ = amp.initialize(model, _sgd(model), opt_level="O1", verbosity=0, combine_grad=np.False_,
                              enabled=np.True_)  # fmt: skip
    handle = amp.init(enabled=np.True_, enable_caching=np.False_, allow_banned=np.False_)
    try:
        assert handle.is_active() and not handle.has_cache
    finally:
        handle._deactivate()


@pytest.mark.parametrize("loss_id", [-1, 2])
def test_a_loss_id_out_of_range_is_the_index_error_apex_raised_too(loss_id):
    """Apex indexed its scalers with ``loss_id`` (IndexError; -1 took the last loss's scaler): code written for it
    catches IndexError, code written for ampkit ValueError."""
    model = _model()
    model, optimizer = amp.initialize(model, _sgd(model), opt_level="O1", num_losses=2, verbosity=0)
    with pytest.raises(IndexError, match=rf"loss_id={loss_id} is out of range: .*num_losses=2, so valid .* 0..1") as e:
        with amp.scale_loss(model(torch.randn(3, 4)).sum(), optimizer, loss_id=loss_id):
            pass
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize(
    ("loss_id", "named", "error"),
    [
        (10**5000, r"loss_id=an integer of 5001 digits is out of range", IndexError),  # repr() of it raised
        ("x" * 100_000, r"loss_id='x{79}\.\.\. \(100002 characters\) is a str; loss ids are", TypeError),
    ],
    ids=["5001 digits", "100kB name"],
)
def test_a_long_loss_id_is_named_by_its_start_or_its_digits(loss_id, named, error):
    model = _model()
    model, optimizer = amp.initialize(model, _sgd(model), opt_level="O1", num_losses=2, verbosity=0)
    with pytest.raises(error, match=f"^{named}") as e:
        with amp.scale_loss(model(torch.randn(3, 4)).sum(), optimizer, loss_id=loss_id):
            pass
    assert len(str(e.value)) < 300


@pytest.mark.parametrize("loss_id", [None, "0", 1.0])
def test_a_loss_id_of_another_type_with_no_scaler_names_num_losses_zero_not_a_range(loss_id):
    """With ``num_losses=0`` a loss_id of another type was told that loss ids are "the integers 0..-1"; no loss id
    is valid there, and the error says why and what to pass."""
    model = _model()
    model, optimizer = amp.initialize(model, _sgd(model), opt_level="O1", num_losses=0, verbosity=0)
    with pytest.raises(IndexError, match=r"num_losses=0, so there is no loss scaler to scale with: pass num_losses=1"):
        with amp.scale_loss(model(torch.randn(3, 4)).sum(), optimizer, loss_id=loss_id):
            pass


def test_a_bool_loss_id_picks_the_scaler_it_indexed_in_apex():
    """Apex took ``_amp_state.loss_scalers[loss_id]``, so ``loss_id=is_discriminator`` used scaler 1 or 0."""
    model = _model()
    model, optimizer = amp.initialize(model, _sgd(model), opt_level="O1", num_losses=2, verbosity=0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0},
                         "loss_scaler1": {"loss_scale": 8.0, "unskipped": 0}})  # fmt: skip
    for loss_id, scale in ((True, 8.0), (False, 4.0)):
        loss = model(torch.randn(3, 4)).float().sum()
        with amp.scale_loss(loss, optimizer, loss_id=loss_id) as scaled:
            assert scaled.item() == pytest.approx(loss.item() * scale)
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
    model = _model()
    model, optimizer = amp.initialize(model, _sgd(model), opt_level="O1", verbosity=0)
    with pytest.raises(IndexError, match=r"^loss_id=True \(index 1\) is out of range: .*num_losses=1"):
        with amp.scale_loss(model(torch.randn(3, 4)).sum(), optimizer, loss_id=True):  # was named "loss_id=1"
            pass


def test_models_or_optimizers_given_as_a_generator_are_named_as_passed():
    """A generator was reported as "models[0] is a generator", an index into a list the caller never made; Apex took a
    single object or a list, and refused anything else."""
    model = _model()
    with pytest.raises(TypeError, match=r"^models is a generator; amp.initialize takes one model or a list of them"):
        amp.initialize((m for m in [model]), _sgd(model), verbosity=0)
    with pytest.raises(TypeError, match=r"^optimizers is a generator; .* one optimizer or a list of them: pass list"):
        amp.initialize(model, (o for o in [_sgd(model)]), verbosity=0)
    models, optimizers = amp.initialize((model,), [_sgd(model)], verbosity=0)  # a tuple and a list: as passed
    assert type(models) is tuple and type(optimizers) is list


def test_a_single_model_or_optimizer_of_another_type_is_named_as_passed():
    """A dict or a string passed alone was "models[0] is a dict", an index into a list the caller never made; a dict
    is told how to pass its values. In a list the index stays."""
    model = _model()
    with pytest.raises(TypeError, match=r"^models is a dict; .* or a list of them \(for a dict's values, pass list\("):
        amp.initialize({"generator": model}, _sgd(model), verbosity=0)
    with pytest.raises(TypeError, match=r"^optimizers is a str; expected a torch.optim.Optimizer or LARC, or a list"):
        amp.initialize(model, "sgd", verbosity=0)
    with pytest.raises(TypeError, match=r"^optimizers is a dict; .*\(for a dict's values, pass list\(optimizers"):
        amp.initialize(model, {"g": _sgd(model)}, verbosity=0)
    with pytest.raises(TypeError, match=r"^models\[1\] is a str; amp.initialize expects a torch.nn.Module"):
        amp.initialize([model, "head"], _sgd(model), verbosity=0)


def test_an_optimizer_listed_twice_in_scale_loss_is_unscaled_once():
    """[optimizer, optimizer] failed inside amp ("combine() called without prepare_backward()"), naming neither."""
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    model, optimizer = amp.initialize(model, _sgd(model), opt_level="O1", loss_scale=4.0, verbosity=0)
    with amp.scale_loss(model(torch.ones(1, 2)).float().sum(), [optimizer, optimizer]) as scaled:
        scaled.backward()
    assert model.weight.grad.tolist() == [[1.0, 1.0]]


def test_small_apex_misuses_are_named():
    model = _model()
    model, optimizer = amp.initialize(model, _sgd(model), opt_level="O1", verbosity=0)
    with pytest.raises(TypeError, match="amp.master_params expects an optimizer .* got Sequential"):
        list(amp.master_params(model))
    with pytest.raises(TypeError, match="a loss scaler's state is a dict"):
        amp.load_state_dict({"loss_scaler0": None})
    with pytest.raises(TypeError, match="loss_id='D' is a str; loss ids are the integers 0..0"):
        with amp.scale_loss(model(torch.randn(3, 4)).sum(), optimizer, loss_id="D"):
            pass


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_delayed_backward_of_another_loss_unscales_by_its_own_scale(opt_level):
    """UNITER's accumulation: a delay_unscale backward under loss_id=1, then the window's last under loss_id=0,
    with the two scalers apart (one backed off). Apex unscaled the sum by loss 0's scale alone, so the first
    micro-batch's gradients came out 8/256 of their size; here each part is unscaled by its own."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    reference = copy.deepcopy(model)
    model, optimizer = amp.initialize(model, _sgd(model), opt_level=opt_level, num_losses=2, verbosity=0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 256.0, "unskipped": 0},
                         "loss_scaler1": {"loss_scale": 8.0, "unskipped": 0}})  # fmt: skip
    x1, x2 = torch.randn(3, 4), torch.randn(3, 4)
    with amp.scale_loss(model(x1).float().mean(), optimizer, loss_id=1, delay_unscale=True) as scaled:
        scaled.backward()
    with amp.scale_loss(model(x2).float().mean(), optimizer, loss_id=0) as scaled:
        scaled.backward()
    (reference(x1).mean() + reference(x2).mean()).backward()
    grad = next(iter(amp.master_params(optimizer))).grad
    torch.testing.assert_close(grad.float(), reference.weight.grad, rtol=2e-3, atol=1e-5)
