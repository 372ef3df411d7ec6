"""LossScaler: growth, backoff floor, cap, static scale, Apex state format, knob errors."""

import math
import re

import numpy as np
import pytest
import torch

from ampkit.amp.scaler import LossScaler


def test_defaults_match_apex_and_torch():
    s = LossScaler()
    assert s.dynamic and s.scale == 2.0**16 and s.loss_scale() == 2.0**16
    assert (s.growth_factor, s.backoff_factor, s.growth_interval) == (2.0, 0.5, 2000)
    assert s.min_scale is None and s.max_scale == 2.0**24
    assert LossScaler(init_scale=2.0**30).scale == 2.0**24


@pytest.mark.parametrize("interval", [1, 3, 7])
def test_growth_after_exactly_interval_clean_updates(interval):
    s = LossScaler(init_scale=8.0, growth_interval=interval)
    for _ in range(interval - 1):
        assert s.update(False) == (8.0, 8.0)
    assert s.update(False) == (8.0, 16.0)
    assert s.unskipped == 0
    # an overflow resets the clean-update count
    for _ in range(interval - 1):
        s.update(False)
    assert s.update(True) == (16.0, 8.0)
    for _ in range(interval - 1):
        assert s.update(False) == (8.0, 8.0)
    assert s.update(torch.zeros(1)) == (8.0, 16.0)


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize(
    "state",
    [{"scale": 1024.0, "_growth_tracker": 1500}, {"loss_scale": 1024.0, "unskipped": 1500}],
    ids=["grad_scaler_state", "own_state"],
)
def test_a_restored_clean_count_past_the_interval_grows_at_the_next_clean_update(state, on_device):
    """A GradScaler's state counting toward a longer interval, or a resume with ``growth_interval`` lowered, restores a
    clean count already past the interval: counted on to equality, the scale never grew again until an overflow."""
    scaler = LossScaler(growth_interval=1000)
    if on_device:
        scaler.keep_on_device(torch.device("cpu"))
    scaler.load_state_dict(dict(state))
    if on_device:
        scaler.update_on_device(torch.tensor(0.0))
        assert scaler.scale_loss(torch.ones(())).item() == 2048.0  # the device copy grew
    assert scaler.update(False) == (1024.0, 2048.0) and scaler.unskipped == 0


def test_backoff_floored_at_min_scale_and_at_the_float32_limit_without():
    s = LossScaler(init_scale=8.0, min_scale=2.0)
    assert [s.update(torch.ones(1))[1] for _ in range(4)] == [4.0, 2.0, 2.0, 2.0]
    s = LossScaler(init_scale=8.0)
    for _ in range(20):
        s.update(True)
    assert s.scale == 8.0 * 2.0**-20  # far below 1: no floor before float32's limit
    for _ in range(200):
        s.update(True)
    assert s.scale == s.floor == 2.0**-126
    assert torch.isfinite(s.inv_scale_tensor("cpu")).all()  # the unscale factor stays a finite float32


def test_growth_capped_at_max_scale():
    s = LossScaler(init_scale=6.0, growth_interval=1, max_scale=20.0, growth_factor=3.0)
    assert [s.update(False)[1] for _ in range(3)] == [18.0, 20.0, 20.0]
    s = LossScaler(init_scale=1.0, growth_interval=1, max_scale=None)
    for _ in range(40):
        s.update(False)
    assert s.scale == 2.0**40


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("max_scale", [None, 1e300])
def test_growth_that_float32_cannot_carry_keeps_the_scale_as_torch_grad_scaler(on_device, max_scale):
    """Without a cap within float32 (torch's GradScaler has none) the scale grew past float32's largest number: every
    scaled loss was then inf, each growth one more skipped step. torch's _amp_update_scale_ keeps the scale instead."""
    knobs = {"init_scale": 2.0**126, "growth_interval": 2, "growth_factor": 2.0}
    grad_scaler = torch.amp.GradScaler("cpu", **knobs)
    scaler = LossScaler(max_scale=max_scale, **knobs)
    if on_device:
        scaler.keep_on_device(torch.device("cpu"))
    weight = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    for _ in range(6):
        grad_scaler.scale(weight.sum() * 0).backward()
        grad_scaler.step(optimizer)
        grad_scaler.update()
        if on_device:
            scaler.update_on_device(torch.tensor(0.0))
        scaler.update(False)
        assert scaler.scale == grad_scaler.get_scale()
        assert torch.isfinite(scaler.scale_loss(torch.ones(()))), "the scaled loss stays finite"
    assert scaler.scale == 2.0**127 and scaler.unskipped == grad_scaler.state_dict()["_growth_tracker"] == 0


@pytest.mark.parametrize("value", [128.0, "128.0", 1])
def test_static_never_changes(value):
    s = LossScaler(value)
    assert not s.dynamic
    for found in [True, False, True] * 5:
        assert s.update(found) == (float(value), float(value))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scale_loss_is_float32(dtype):
    s = LossScaler(init_scale=2.0**16)
    loss = torch.tensor(2.0, dtype=dtype)
    scaled = s.scale_loss(loss)
    assert scaled.dtype == torch.float32 and scaled.item() == 2.0**17  # would overflow fp16
    inv = s.inv_scale_tensor("cpu")
    assert inv.dtype == torch.float32 and inv.item() == 2.0**-16
    assert s.inv_scale_tensor("cpu") is inv
    s.update(True)
    assert s.inv_scale_tensor("cpu").item() == 2.0**-15


def test_state_dict_round_trip_apex_format():
    s = LossScaler(init_scale=1024.0, growth_interval=5)
    s.update(True)
    s.update(False)
    s.update(False)
    state = s.state_dict()
    assert state == {"loss_scale": 512.0, "unskipped": 2}
    t = LossScaler(init_scale=1024.0, growth_interval=5)
    t.load_state_dict(state)
    for found in [False, False, False, True, False]:
        assert t.update(found) == s.update(found)
    t.load_state_dict({"loss_scale": torch.tensor(4.0), "unskipped": torch.tensor(3)})
    assert (t.scale, t.unskipped) == (4.0, 3)


def test_load_state_dict_errors():
    s = LossScaler()
    with pytest.raises(KeyError, match="missing \\['unskipped'\\]"):
        s.load_state_dict({"loss_scale": 2.0})
    with pytest.raises(ValueError, match="loss_scale=-2.0"):
        s.load_state_dict({"loss_scale": -2.0, "unskipped": 0})
    with pytest.raises(ValueError, match="unskipped=-1"):
        s.load_state_dict({"loss_scale": 2.0, "unskipped": -1})
    assert (s.scale, s.unskipped) == (2.0**16, 0)  # a refused state changed the scale before the count was checked


def test_a_restored_dynamic_scale_keeps_this_runs_floor_and_cap():
    """torch's GradScaler has no cap (its scale may reach 2**30), and a resume may lower ``max_scale`` or raise
    ``min_scale``: the restored scale stayed outside them, so the next "growth" lowered it to the cap."""
    capped, floored, static = LossScaler(), LossScaler(min_scale=4.0), LossScaler(2.0**30)
    capped.load_state_dict({"scale": 2.0**30, "_growth_tracker": 5})
    floored.load_state_dict({"loss_scale": 1.0, "unskipped": 0})
    static.load_state_dict({"loss_scale": 2.0**30, "unskipped": 0})
    assert (capped.scale, capped.unskipped, floored.scale, static.scale) == (2.0**24, 5, 4.0, 2.0**30)


@pytest.mark.parametrize("saved", [1e39, 1e300, 2.0**-130])
def test_a_restored_scale_float32_cannot_carry(saved):
    """A static scaler took a saved scale its constructor refuses (every step inf, and a static scale never backs
    off), and a dynamic one without ``max_scale`` kept 1e300 and skipped hundreds of steps backing off from it."""
    static, state = LossScaler(128.0), {"loss_scale": saved, "unskipped": 3}
    with pytest.raises(ValueError, match=re.escape(f"loss_scale={saved!r}: a loss scale must lie in float32's range")):
        static.load_state_dict(state)
    assert (static.scale, static.unskipped) == (128.0, 0)
    uncapped = LossScaler(max_scale=None)
    uncapped.load_state_dict(state)
    assert uncapped.scale == (torch.finfo(torch.float32).max if saved > 1 else 2.0**-126)
    assert torch.isfinite(uncapped.scale_loss(torch.ones(()))) and torch.isfinite(uncapped.inv_scale_tensor("cpu"))


def test_an_overflow_verdict_that_is_not_a_flag_is_refused():
    """``update`` took its verdict by truthiness: ``None`` (a verdict never computed) counted as a clean step and
    grew the scale, ``"no"`` as an overflow that backed it off."""
    s = LossScaler(growth_interval=1)
    for bad in (None, "no"):
        with pytest.raises(TypeError, match=rf"found_inf must be a bool or a one-element tensor, got {bad!r}"):
            s.update(bad)
    with pytest.raises(ValueError, match=r"found_inf must be a one-element tensor, got shape \(2,\)"):
        s.update(torch.zeros(2))
    assert s.scale == 2.0**16
    assert s.update(np.bool_(True)) == (2.0**16, 2.0**15)  # numpy's and torch's flags stay valid
    assert s.update(torch.tensor(0.0)) == (2.0**15, 2.0**16)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"growth_factor": 1.0}, "growth_factor=1.0: expected a number > 1"),
        ({"backoff_factor": 1.5}, r"backoff_factor=1.5: expected a number in \(0, 1\)"),
        ({"backoff_factor": 0}, "backoff_factor=0"),
        ({"growth_interval": 0}, "growth_interval=0"),
        ({"growth_interval": 2.5}, "growth_interval=2.5"),
        ({"init_scale": float("inf")}, "init_scale=inf"),
        ({"min_scale": -1.0}, "min_scale=-1.0"),
        ({"max_scale": "big"}, "max_scale='big'"),
        ({"min_scale": 8.0, "max_scale": 4.0}, "min_scale=8.0 is larger than max_scale=4.0"),
        ({"loss_scale": "dyn"}, "loss_scale='dyn'"),
        # as a static scale: a first scale float32 cannot carry skipped every step until it backed off
        ({"init_scale": 1e300, "max_scale": None}, "init_scale=1e[+]300: the first dynamic scale must lie in float32"),
        ({"init_scale": 1e-300}, "init_scale=1e-300: the first dynamic scale must lie in float32's range"),
        ({"min_scale": 1e39, "max_scale": None}, "min_scale=1e[+]39: the first dynamic scale must lie in float32"),
    ],
)
def test_bad_knobs_name_the_option(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossScaler(**kwargs)


def test_a_first_scale_beyond_float32_skipped_every_step_until_it_backed_off():
    """``init_scale=1e300`` with no cap scaled every loss to inf: about 870 skipped steps before the scale came back
    into float32's range (torch's GradScaler refuses it at its first scale()). A cap brings it into range, as before."""
    with pytest.raises(ValueError, match="init_scale"):
        LossScaler(init_scale=1e300, max_scale=None)
    assert LossScaler(init_scale=1e300).scale == 2.0**24  # the default cap
    assert LossScaler(init_scale=1e-300, min_scale=1.0).scale == 1.0  # the floor


def test_scale_loss_names_a_loss_that_is_no_tensor():
    with pytest.raises(TypeError, match="scale_loss expects the loss as a tensor, got float"):
        LossScaler().scale_loss(2.5)  # was: AttributeError: 'float' object has no attribute 'dtype'


def test_a_saved_clean_count_that_is_a_whole_number_of_another_type_loads():
    """Apex assigned whatever the state held; numpy's int64 (a state built with numpy) and 3.0 were refused."""
    s = LossScaler()
    s.load_state_dict({"loss_scale": 8.0, "unskipped": np.int64(3)})
    assert (s.scale, s.unskipped) == (8.0, 3) and type(s.unskipped) is int
    s.load_state_dict({"loss_scale": 8.0, "unskipped": 5.0})
    assert s.unskipped == 5 and type(s.unskipped) is int
    for bad in (2.5, True, "3"):
        with pytest.raises(ValueError, match=f"unskipped={bad!r}: expected an integer >= 0"):
            s.load_state_dict({"loss_scale": 4.0, "unskipped": bad})
        assert (s.scale, s.unskipped) == (8.0, 5)  # a state refused loads nothing of itself


def test_follows_torch_grad_scaler_through_overflows_and_growth_and_resumes_from_its_state_dict():
    """The scale torch.amp.GradScaler keeps, update by update (backoff on an inf, growth after the interval), on the
    host and on the device, the same float32 scaled loss; and a LossScaler loaded from GradScaler's state_dict
    mid-run goes on as GradScaler does (torch's cap is none: ``max_scale=None``). Factors other than the defaults, so a
    knob ignored on either path shows."""
    generator = torch.Generator().manual_seed(0)
    overflows = (torch.rand(120, generator=generator) < 0.2).tolist()
    knobs = {"growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 3}
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, **knobs)
    host = LossScaler(init_scale=2.0**10, max_scale=None, **knobs)
    device = LossScaler(init_scale=2.0**10, max_scale=None, **knobs)
    device.keep_on_device(torch.device("cpu"))
    weight = torch.nn.Parameter(torch.full((1,), 0.3))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    for i, overflow in enumerate(overflows):
        loss = weight.sum() * 1.7
        scaled = grad_scaler.scale(loss)
        assert torch.equal(host.scale_loss(loss), scaled) and torch.equal(device.scale_loss(loss), scaled)
        (scaled * (math.inf if overflow else 1.0)).backward()
        grad_scaler.step(optimizer)
        grad_scaler.update()
        optimizer.zero_grad()
        host.update(overflow)
        device.update_on_device(torch.tensor(float(overflow)))
        device.update(overflow)
        assert host.scale == device.scale == grad_scaler.get_scale(), i
        if i == 60:
            host = LossScaler(max_scale=None, **knobs)
            host.load_state_dict(grad_scaler.state_dict())
    assert grad_scaler.get_scale() != 2.0**10  # the sequence moved the scale


def test_the_device_update_under_a_float32_cap_runs_no_float32_check():
    """Under ``max_scale`` within float32 (2**24, the default) no grown scale can pass float32's largest: the check
    for it was two more device ops at every update (kernel launches on a GPU). Without a cap it runs and holds."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    for max_scale, checked in ((2.0**24, False), (None, True)):
        scaler = LossScaler(init_scale=2.0**127, max_scale=max_scale, growth_interval=1)
        scaler.keep_on_device(torch.device("cpu"))
        with Ops() as ops:
            scaler.update_on_device(torch.tensor(0.0))
        assert ("gt" in ops.names) == checked, ops.names
        assert scaler.scale_loss(torch.ones(())).item() == (2.0**24 if max_scale else 2.0**127)
