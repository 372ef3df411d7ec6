"""``apex.amp.frontend``'s ``Properties``, ``O0`` .. ``O3`` and ``opt_levels``, and ``apex.amp.utils``' helpers,
as scripts import them through the shim: to print a level's description, build its options, or write a cast
wrapper of their own around a torch function."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ampkit.compat import amp, install_apex_shim, uninstall_apex_shim


@pytest.fixture
def shim():
    install_apex_shim()
    yield
    uninstall_apex_shim()


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_a_level_class_builds_the_options_initialize_uses_at_that_level(shim, level):
    from apex.amp.frontend import O0, O1, O2, O3, Properties, opt_levels

    properties = opt_levels[level](Properties())
    amp.initialize(torch.nn.Linear(2, 2), opt_level=level, verbosity=0)
    assert properties.options == amp._amp_state.opt_properties.options
    assert properties.opt_level == level and properties.enabled is True
    assert type(opt_levels[level]) is {"O0": O0, "O1": O1, "O2": O2, "O3": O3}[level]
    assert opt_levels[level].brief.startswith(f"{level}:  ") and opt_levels[level].more


def test_a_fresh_properties_is_disabled_with_apex_defaults(shim):
    from apex.amp.frontend import Properties

    properties = Properties()
    assert properties.options == {
        "enabled": False,
        "opt_level": None,
        "cast_model_type": None,
        "patch_torch_functions": False,
        "keep_batchnorm_fp32": None,
        "master_weights": None,
        "loss_scale": 1.0,
    }
    with pytest.raises(AttributeError, match="no attribute 'fused_optimizer'"):
        getattr(properties, "fused_optimizer")  # noqa: B009 - the attribute read is what is tested


def test_properties_parse_string_overrides_and_refuse_what_the_level_forbids(shim, capsys):
    from apex.amp.frontend import O1, O2, Properties

    properties = O2()(Properties())
    properties.keep_batchnorm_fp32 = "False"
    properties.loss_scale = "128.0"
    assert (properties.keep_batchnorm_fp32, properties.loss_scale) == (False, 128.0)
    with pytest.raises(ValueError, match="keep_batchnorm_fp32='yes'"):
        properties.keep_batchnorm_fp32 = "yes"
    with pytest.raises(RuntimeError, match="patch_torch_functions"):
        properties.patch_torch_functions = True

    o1 = O1()(Properties())
    with pytest.raises(RuntimeError, match="cast_model_type was torch.float16"):
        o1.cast_model_type = torch.float16
    amp._amp_state.hard_override = True  # Apex's switch: the same override only warns
    try:
        o1.master_weights = True
    finally:
        amp._amp_state.hard_override = False
    assert o1.master_weights is True and "Warning:  master_weights makes no sense" in capsys.readouterr().out


def test_apex_amp_utils_is_served_and_bound_on_apex_amp(shim):
    import apex.amp

    assert importlib.util.find_spec("apex.amp.utils") is not None
    assert apex.amp.utils.is_fp_tensor(torch.ones(1))


def test_fp_tensor_tests_follow_apex(shim):
    from apex.amp.utils import collect_fp_tensor_types, is_fp_tensor, is_nested, should_cache, type_string

    x, h, i = torch.ones(2), torch.ones(2, dtype=torch.float16), torch.ones(2, dtype=torch.long)
    assert is_fp_tensor(x) and is_fp_tensor((x, h)) and is_fp_tensor([])
    assert not is_fp_tensor(i) and not is_fp_tensor([x, i]) and not is_fp_tensor(1.0)
    assert is_nested((x,)) and not is_nested(x)
    assert (type_string(x), type_string(h)) == ("FloatTensor", "HalfTensor")
    assert collect_fp_tensor_types((x, [h], i, "s"), {"w": x}) == {"FloatTensor", "HalfTensor"}
    weight = torch.nn.Parameter(torch.ones(2))
    assert should_cache(weight) and should_cache([weight]) and not should_cache(x) and not should_cache([weight, x])


def test_maybe_half_and_float_cast_by_dtype_on_any_device_keeping_containers(shim, capsys):
    from apex.amp.utils import maybe_float, maybe_half

    x = torch.ones(2)
    assert maybe_half(x).dtype == torch.float16  # on CPU too: ampkit casts by dtype, Apex only CUDA tensors
    h = x.half()
    assert maybe_half(h) is h and maybe_float(x) is x
    pair = maybe_float((h, h))
    assert type(pair) is tuple and all(t.dtype == torch.float32 for t in pair)
    maybe_half(x, name="linear", verbose=True)
    assert capsys.readouterr().out == "Float->Half (linear)\n"


def test_cuda_queries_answer_for_this_torch_build(shim):
    from apex.amp.utils import get_cuda_version, is_cuda_enabled

    assert is_cuda_enabled() is (torch.version.cuda is not None)
    if is_cuda_enabled():
        assert get_cuda_version() == tuple(int(p) for p in torch.version.cuda.split("."))
    else:
        with pytest.raises(RuntimeError, match="built without CUDA"):
            get_cuda_version()


def test_a_cast_wrapper_built_from_the_helpers_runs_and_is_undone_by_the_handle(shim):
    """Apex's own way to cast around a function, as scripts copied it: ``casted_args`` with ``verbosify``'d
    ``maybe_half``, installed by ``set_func_save`` on amp's handle, which puts the original back."""
    from apex.amp import utils

    handle = amp.init(enabled=True, verbose=False)
    calls = []

    class Namespace:
        @staticmethod
        def scale(x, *, by):
            calls.append((x.dtype, by.dtype))
            return x * by

    original = Namespace.scale

    def wrapper(*args, **kwargs):
        cast = utils.verbosify(utils.maybe_half, "scale", False)
        return original(*utils.casted_args(cast, args, kwargs), **kwargs)

    utils.set_func_save(handle, Namespace, "scale", wrapper)
    assert utils.has_func(Namespace, "scale") and utils.get_func(Namespace, "scale") is wrapper
    assert Namespace.scale(torch.ones(2), by=torch.ones(2)).dtype == torch.float16
    assert calls == [(torch.float16, torch.float16)]
    handle._deactivate()
    assert Namespace.scale is original
    table = {}
    utils.set_func(table, "f", len)
    assert utils.get_func(table, "f") is len and list(utils.as_inplace(["add", "mul"])) == ["add_", "mul_"]


def test_cached_cast_reuses_a_cast_until_the_weight_changes(shim):
    from apex.amp.utils import cached_cast, maybe_half

    weight, cache = torch.nn.Parameter(torch.ones(3)), {}
    first = cached_cast(maybe_half, weight, cache)
    assert cached_cast(maybe_half, weight, cache) is first and first.grad_fn is not None
    with torch.no_grad():
        weight.mul_(2)
    second = cached_cast(maybe_half, weight, cache)
    assert second is not first and torch.equal(second, torch.full((3,), 2.0, dtype=torch.float16))
    with torch.no_grad():
        under_no_grad = cached_cast(maybe_half, torch.nn.Parameter(torch.ones(1)), cache)
    assert under_no_grad.requires_grad is False
    pair = cached_cast(maybe_half, [weight, weight], cache)
    assert pair[0] is second and pair[1] is second


@pytest.mark.parametrize("name", ["synthesize_flattened_rnn_weights", "new_synthesize_flattened_rnn_weights"])
def test_the_flat_rnn_weight_helpers_are_refused_naming_what_to_use(shim, name):
    with pytest.raises(ImportError, match=r"not served .*torch\.nn\.LSTM"):
        exec(f"from apex.amp.utils import {name}", {})
    import apex.amp.utils

    with pytest.raises(AttributeError, match="cuDNN RNN"):
        getattr(apex.amp.utils, name)
