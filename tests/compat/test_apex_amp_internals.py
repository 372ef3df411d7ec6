"""Apex internals that code around Apex touches: ``hasattr(_amp_state, "opt_properties")`` as the "is amp
initialized" test, the O1 handle's ``_all_wrappers`` / ``_save_func``, ``apex.amp.handle.disable_casts``, and
Apex's per-optimizer protocol (``_prepare_amp_backward`` / ``_post_amp_backward`` /
``_amp_stash.params_have_scaled_gradients``) driven by a copy of Apex's ``scale_loss``."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch

from ampkit.compat import amp, install_apex_shim, uninstall_apex_shim
from ampkit.compat.amp import _amp_state


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batch(i: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(i))


@pytest.fixture
def shim_installed():
    install_apex_shim()
    yield
    uninstall_apex_shim()


def test_opt_properties_exists_only_once_initialize_ran():
    """A trainer that initializes amp (disabled) when its caller did not, and warns when amp is on unasked."""
    assert not hasattr(_amp_state, "opt_properties")
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if not hasattr(amp._amp_state, "opt_properties"):
        model, optimizer = amp.initialize(model, optimizer, enabled=False)
    assert hasattr(_amp_state, "opt_properties") and not _amp_state.opt_properties.enabled
    loss = model(_batch(0)).sum()
    with amp.scale_loss(loss, optimizer) as scaled:
        assert scaled is loss
    amp.initialize(_model(), opt_level="O0", verbosity=0, min_loss_scale=1.0, max_loss_scale=2.0**20)
    assert (_amp_state.min_loss_scale, _amp_state.max_loss_scale, _amp_state.hard_override) == (1.0, 2.0**20, False)
    _amp_state.reset()
    assert not hasattr(_amp_state, "opt_properties")


def test_loss_scalers_and_handle_exist_only_once_amp_made_them():
    """Libraries ask ``hasattr(amp._amp_state, "loss_scalers")`` (is amp training?) and ``"handle"`` (are O1's
    casts on?) before touching them, as with Apex, whose state gained each attribute only when it was made."""
    assert not any(hasattr(_amp_state, name) for name in ("loss_scalers", "handle", "min_loss_scale"))
    assert amp.state_dict() == {}
    amp.init(enabled=False)  # a NoOpHandle is not kept as the handle
    amp.initialize(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), enabled=False)
    assert not any(hasattr(_amp_state, name) for name in ("loss_scalers", "handle", "min_loss_scale"))
    assert amp.state_dict() == {}
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0}})  # a disabled run skips it
    amp.initialize(_model(), opt_level="O2", verbosity=0)
    assert len(_amp_state.loss_scalers) == 1 and not hasattr(_amp_state, "handle")
    amp.initialize(_model(), opt_level="O1", verbosity=0)
    handle = _amp_state.handle
    assert handle.is_active()
    amp.initialize(_model(), opt_level="O0", verbosity=0)
    assert _amp_state.handle is handle and not handle.is_active()  # kept, deactivated, as Apex left it


def test_all_wrappers_lists_the_patched_functions_and_deactivate_restores_them_and_saved_ones():
    original_mm, original_sigmoid = torch.mm, torch.sigmoid
    handle = amp.init(verbose=False)
    try:
        saved = {(owner, name): fn for owner, name, fn in handle._all_wrappers}
        assert saved[(torch, "mm")] is original_mm and torch.mm is not original_mm
        # Code that patches a function beside amp hands the original to the handle, as with Apex's utils.
        handle._save_func(torch, "sigmoid", original_sigmoid)
        torch.sigmoid = lambda x: x
        assert (torch, "sigmoid", original_sigmoid) in handle._all_wrappers
    finally:
        handle._deactivate()
    assert torch.mm is original_mm and torch.sigmoid is original_sigmoid
    assert handle._all_wrappers == []


def test_disable_casts_imports_from_apexs_handle_module(shim_installed):
    from apex.amp.handle import disable_casts

    assert disable_casts is amp.disable_casts


@contextlib.contextmanager
def copied_apex_scale_loss(loss, optimizer, loss_id=0, delay_unscale=False):
    """The body of Apex's ``scale_loss`` as projects copied it, on the optimizer's protocol methods."""
    loss_scaler = _amp_state.loss_scalers[loss_id]
    if not delay_unscale and not optimizer._amp_stash.params_have_scaled_gradients:
        optimizer._prepare_amp_backward()
    yield loss.float() * loss_scaler.loss_scale()
    if delay_unscale:
        optimizer._amp_stash.params_have_scaled_gradients = True
        return
    loss_scaler.clear_overflow_state()
    optimizer._post_amp_backward(loss_scaler)
    optimizer._amp_stash.params_have_scaled_gradients = False
    if loss_scaler.update_scale() and not optimizer._amp_stash.already_patched:
        real_step = optimizer.step

        def skip_step(closure=None):
            optimizer.step = real_step
            optimizer._amp_stash.already_patched = False

        optimizer.step = skip_step
        optimizer._amp_stash.already_patched = True


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_copied_apex_scale_loss_trains_as_amp_scale_loss_does(opt_level):
    """Accumulation over a delayed backward, an overflow that skips, then clean steps: the same weights, scale
    and gradients as ``amp.scale_loss`` gives."""
    runs = []
    for scale_loss in (amp.scale_loss, copied_apex_scale_loss):
        _amp_state.reset()
        model = copy.deepcopy(_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
        assert not optimizer._amp_stash.lazy_init_called
        for i in range(4):
            optimizer.zero_grad()
            for micro in range(2):
                loss = model(_batch(10 * i + micro).half() if opt_level == "O2" else _batch(10 * i + micro))
                loss = loss.float().pow(2).mean() * (math.inf if (i, micro) == (1, 1) else 1.0)
                with scale_loss(loss, optimizer, delay_unscale=micro == 0) as scaled:
                    scaled.backward()
            grads = [p.grad.clone() for p in amp.master_params(optimizer)]
            optimizer.step()
        assert optimizer._amp_stash.lazy_init_called
        runs.append(([p.detach().clone() for p in model.parameters()], grads, _amp_state.loss_scalers[0].loss_scale()))
    (params_a, grads_a, scale_a), (params_b, grads_b, scale_b) = runs
    assert scale_a == scale_b == 2.0**15, "one overflow halved the scale once"
    for a, b in zip(params_a + grads_a, params_b + grads_b, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_marking_scaled_gradients_done_before_unscaling_them_is_a_clear_error():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0, dtype=torch.bfloat16)
    optimizer._prepare_amp_backward()
    with pytest.raises(RuntimeError, match=r"call optimizer._post_amp_backward\(loss_scaler\) first"):
        optimizer._amp_stash.params_have_scaled_gradients = False


def test_catalyst_casts_a_models_io_with_the_options_dict_and_amps_applier(shim_installed):
    """catalyst's apex engine patches ``model.forward`` with ``apex.amp._initialize.applier`` and the dtypes in
    ``_amp_state.opt_properties.options``."""
    import apex

    model = _model()
    model, _ = apex.amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    options = apex.amp._amp_state.opt_properties.options
    assert options == {"enabled": True, "opt_level": "O2", "cast_model_type": torch.float16,
                       "patch_torch_functions": False, "keep_batchnorm_fp32": True, "master_weights": True,
                       "loss_scale": "dynamic"}  # fmt: skip

    def input_caster(tensor):
        return tensor.to(options["cast_model_type"]) if tensor.is_floating_point() else tensor

    def output_caster(tensor):
        return tensor.to(options.get("cast_model_outputs", torch.float32)) if tensor.is_floating_point() else tensor

    applier = apex.amp._initialize.applier
    original = model.forward
    model.forward = lambda *args, **kwargs: applier(
        original(*applier(args, input_caster), **applier(kwargs, input_caster)), output_caster
    )
    out = model(_batch(0))
    assert out.dtype == torch.float32
    nested = applier({"x": (torch.ones(2), "text", [torch.zeros(1)]), "n": 3}, input_caster)
    assert nested["x"][0].dtype == torch.float16 and nested["x"][1] == "text" and nested["n"] == 3
    assert isinstance(nested["x"], tuple) and nested["x"][2][0].dtype == torch.float16
