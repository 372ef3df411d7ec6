"""Float8 engine: the reference casts against float64 and against torchao's emulate path, the converter's rules and
state_dict keys, and the telemetry recorder's numbers."""

from __future__ import annotations

import copy
import dataclasses
import io

import pytest
import torch
from torch import nn

from ampkit.amp.fp8 import (
    RECIPES,
    Float8Linear,
    Float8Recorder,
    amax_to_scale,
    convert_to_float8,
    from_float8,
    is_float8_linear,
    operand_stats,
    scaled_cast,
    to_float8,
    torchao_available,
)
from ampkit.amp.fp8.recipes import E4M3, E5M2, OperandCast

needs_torchao = pytest.mark.skipif(
    not torchao_available(), reason='torchao is not installed (pip install "ampkit[fp8]")'
)


def _nearest_float8(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 reference: every finite value of ``dtype``, and the nearest one to each of ``values`` (saturating)."""
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).double()
    grid = grid[grid.isfinite()].unique()
    clamped = values.double().clamp(grid.min(), grid.max())
    return grid[(clamped[:, None] - grid[None, :]).abs().argmin(dim=1)]


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_scaled_cast_rounds_to_the_nearest_float8_value_and_saturates(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(517, generator=g) * torch.logspace(-6, 3, 517)
    x[3], x[7] = 0.0, -x.abs().max()  # a zero, and the amax as a negative value
    data, scale, amax = scaled_cast(x, OperandCast(dtype), -1, power_of_2=False)
    assert amax == x.abs().max()
    assert scale == torch.tensor(torch.finfo(dtype).max / float(amax), dtype=torch.float32)
    assert torch.equal(data.double(), _nearest_float8(x.double() * scale.double(), dtype))
    assert data.double().abs().max() == torch.finfo(dtype).max  # the amax lands on the format's largest value
    assert torch.equal(to_float8(torch.tensor([1e30, -1e30]), torch.tensor(1.0), dtype).double().abs(),
                       torch.full((2,), torch.finfo(dtype).max, dtype=torch.float64))  # fmt: skip


def test_rowwise_scales_run_along_the_contraction_dim_and_round_down_to_powers_of_two():
    x = torch.tensor([[1.0, -3.0], [0.5, 0.25], [0.0, 0.0]])
    _, left, _ = scaled_cast(x, OperandCast(E4M3, rowwise=True), -1, power_of_2=True)
    _, right, _ = scaled_cast(x, OperandCast(E4M3, rowwise=True), 0, power_of_2=True)
    assert left.shape == (3, 1) and right.shape == (1, 2)
    assert left.flatten().tolist() == [128.0, 512.0, 2.0**48]  # 448/3 → 128; 448/0.5 → 512; a zero row: 448/1e-12
    assert right.flatten().tolist() == [256.0, 128.0]
    assert amax_to_scale(torch.tensor(448.0), E4M3, power_of_2=False) == 1.0


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_an_empty_batch_gives_an_empty_output_and_zero_gradients(recipe):
    layer = Float8Linear.from_linear(nn.Linear(16, 32), RECIPES[recipe])
    x = torch.randn(0, 16, requires_grad=True)
    out = layer(x)
    out.sum().backward()
    assert out.shape == (0, 32) and x.grad.shape == (0, 16)
    assert torch.equal(layer.weight.grad, torch.zeros(32, 16)) and torch.equal(layer.bias.grad, torch.zeros(32))


def test_an_inf_in_a_float8_operand_makes_the_output_non_finite():
    layer = Float8Linear.from_linear(nn.Linear(16, 16), RECIPES["tensorwise"])
    x = torch.randn(4, 16)
    x[1, 3] = float("inf")
    assert not layer(x).isfinite().all()  # scale 0: inf * 0 = nan, so the loss scaler or skip_nonfinite sees it


def _torchao_linear(linear: nn.Linear, recipe: str) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    return convert_to_float8_training(nn.Sequential(copy.deepcopy(linear)), config=config)[0]


_PRECISIONS = [
    (torch.float32, None),
    (torch.bfloat16, None),
    (torch.float32, torch.bfloat16),  # O1's autocast
    (torch.float32, torch.float16),
]


@needs_torchao
@pytest.mark.parametrize(
    ("recipe", "dtype", "autocast"),
    # torchao's rowwise_with_gw_hp fails under CPU autocast (a config error in ampkit): not compared there
    [(r, d, a) for r in RECIPES for d, a in _PRECISIONS if not (r == "rowwise_with_gw_hp" and a is not None)],
)
def test_reference_equals_torchao_emulate_bit_for_bit_forward_and_backward(recipe, dtype, autocast):
    g = torch.Generator().manual_seed(1)
    linear = nn.Linear(48, 32).to(dtype)
    ours = Float8Linear.from_linear(copy.deepcopy(linear), RECIPES[recipe])
    theirs = _torchao_linear(linear, recipe)
    x = (torch.randn(3, 7, 96, generator=g) * 4)[..., ::2].to(dtype)  # non-contiguous, 3-D
    x[0, 0, :5] = 0.0
    inputs = [x.detach().clone().requires_grad_() for _ in range(2)]
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        outputs = [ours(inputs[0]), theirs(inputs[1])]
    grad = torch.randn(outputs[0].shape, generator=g).to(outputs[0].dtype) * 1e-3
    for out in outputs:
        out.backward(grad)
    assert outputs[0].dtype == outputs[1].dtype == (autocast or dtype)
    assert torch.equal(outputs[0], outputs[1])
    assert torch.equal(inputs[0].grad, inputs[1].grad)
    assert torch.equal(ours.weight.grad, theirs.weight.grad)
    assert torch.equal(ours.bias.grad, theirs.bias.grad)


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize(("rows", "fan_in", "fan_out"), [(40, 64, 32), (33, 37, 23)])  # odd sizes work too
def test_reference_linear_is_close_to_the_float64_linear(recipe, rows, fan_in, fan_out):
    g = torch.Generator().manual_seed(2)
    linear = nn.Linear(fan_in, fan_out)
    layer = Float8Linear.from_linear(copy.deepcopy(linear), RECIPES[recipe])
    x = torch.randn(rows, fan_in, generator=g, requires_grad=True)
    out = layer(x)
    grad_out = torch.randn(rows, fan_out, generator=g)
    out.backward(grad_out)
    x64, w64, dy64 = x.detach().double(), linear.weight.detach().double(), grad_out.double()

    def sqnr(exact: torch.Tensor, approx: torch.Tensor) -> float:
        return float(20 * torch.log10(exact.norm() / (exact - approx.double()).norm()))

    assert sqnr(x64 @ w64.t() + linear.bias.detach().double(), out) > 25  # e4m3's 3 mantissa bits: ~30 dB
    assert sqnr(dy64 @ w64, x.grad) > 20  # tensorwise casts dy to e5m2 (2 mantissa bits): ~25 dB
    assert sqnr(dy64.t() @ x64, layer.weight.grad) > 20


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10), nn.Sequential(nn.Linear(10, 16), nn.Linear(16, 16))
    )


@pytest.mark.parametrize("backend", ["reference", pytest.param("torchao", marks=needs_torchao)])
def test_converter_keeps_odd_dims_filtered_and_subclassed_linears_in_high_precision(backend):
    model = _mlp()
    model.append(nn.modules.linear.NonDynamicallyQuantizableLinear(16, 16))
    report = convert_to_float8(model, "rowwise", backend=backend, skip_modules=["3.1"])
    assert report.converted == ["0"]
    assert report.skipped == {
        "2": "64x10 not divisible by 16",
        "3.0": "10x16 not divisible by 16",
        "3.1": "named by skip_modules",
        "4": "a subclass of nn.Linear (its forward may differ)",
    }
    assert is_float8_linear(model[0]) and not any(is_float8_linear(m) for m in list(model.modules())[2:])
    only = convert_to_float8(_mlp(), backend=backend, modules=["3.*"])
    assert only.converted == ["3.1"] and only.skipped["0"] == "not named by modules"


def test_converter_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match=r"modules \['decoder\.\*'\] name no nn.Linear; the model's: 0, 2, 3.0, 3.1"):
        convert_to_float8(_mlp(), modules=["decoder.*"])
    with pytest.raises(ValueError, match=r"skip_modules \['lm_head'\] name no nn.Linear; the model's: 0, 2, 3.0, 3.1"):
        convert_to_float8(_mlp(), skip_modules=["lm_head", "3.*"])  # a misspelt skip left the layer in float8
    with pytest.raises(ValueError, match="unknown fp8 recipe 'blockwise'; expected one of tensorwise, rowwise"):
        convert_to_float8(_mlp(), "blockwise")
    with pytest.raises(ValueError, match="unknown fp8 backend 'te'"):
        convert_to_float8(_mlp(), backend="te")
    with pytest.raises(ValueError, match="the model itself is a Linear"):
        convert_to_float8(nn.Linear(16, 16))


@pytest.mark.parametrize("backend", ["reference", pytest.param("torchao", marks=needs_torchao)])
def test_a_converted_models_state_dict_loads_into_the_plain_model_with_weights_only(backend):
    model = _mlp()
    plain_keys = list(model.state_dict())
    convert_to_float8(model, backend=backend)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert list(state) == plain_keys
    fresh = _mlp()
    fresh.load_state_dict(state)
    x = torch.randn(2, 32)
    assert torch.equal(fresh[0](x), nn.functional.linear(x, model[0].weight, model[0].bias))


@needs_torchao
def test_the_float8_all_gather_weight_is_saved_as_the_plain_tensor_it_wraps():
    """torchao's FSDP float8 all-gather makes each weight a tensor subclass; pickled, it names a torchao class that
    torch.load(weights_only=True) refuses where torchao is not imported. The checkpoint holds the plain weight."""
    model = _mlp()
    convert_to_float8(model, backend="torchao", fsdp_float8_all_gather=True)
    assert type(model[0].weight).__name__ == "WeightWithDynamicFloat8CastTensor"
    state = model.state_dict()
    assert all(type(v) is torch.Tensor and not v.requires_grad for v in state.values())
    buffer = io.BytesIO()
    torch.save(state, buffer)
    assert b"torchao" not in buffer.getvalue()
    model.load_state_dict({k: torch.zeros_like(v) for k, v in state.items()})  # and it loads back into the subclass
    assert type(model[0].weight).__name__ == "WeightWithDynamicFloat8CastTensor" and not model[0].weight.any()


def test_recorder_records_the_casts_statistics_of_training_forwards_and_backwards_only():
    torch.manual_seed(3)
    model = _mlp()
    convert_to_float8(model, "tensorwise")
    recorder = Float8Recorder({"0": model[0]}, RECIPES["tensorwise"])
    x = torch.randn(8, 32)
    x[0, 0] = 1e-9  # underflows in e4m3 at this scale
    with torch.no_grad():
        recorder.arm()
        model(x)
        assert recorder.disarm() == {}
    recorder.arm()
    assert recorder.armed
    model(x).sum().backward()
    stats = recorder.disarm()
    assert not recorder.armed and recorder.disarm() == {}
    inp, weight, grad_out = stats["0"]["input"], stats["0"]["weight"], stats["0"]["grad_output"]
    assert inp.amax == x.abs().max() and inp.scale == amax_to_scale(x.abs().max(), E4M3, False)
    assert inp.underflow == pytest.approx(1 / x.numel())
    assert weight.amax == model[0].weight.abs().max()
    assert grad_out.scale == amax_to_scale(grad_out.amax, E5M2, False)  # the output gradient is cast to e5m2
    data, scale, _ = scaled_cast(x, OperandCast(E4M3), -1, False)
    assert torch.equal(operand_stats(x, OperandCast(E4M3), -1, False).scale, inp.scale)
    assert (from_float8(data, scale) - x).abs().max() <= x.abs().max() / 16  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_power_of_two_loss_scale_leaves_float8_gradients_bit_identical_once_unscaled(recipe):
    g = torch.Generator().manual_seed(4)
    layer = Float8Linear.from_linear(nn.Linear(32, 48), RECIPES[recipe])
    x = torch.randn(24, 32, generator=g)
    grad_out = torch.randn(24, 48, generator=g)
    grads = []
    for scale in (1.0, 2.0**16):
        inp = x.clone().requires_grad_()
        layer.zero_grad()
        layer(inp).backward(grad_out * scale)
        grads.append((inp.grad / scale, layer.weight.grad / scale))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize(
    ("recipe", "device"),
    [*((r, "cuda") for r in RECIPES), pytest.param("rowwise", "cpu", marks=pytest.mark.slow)],  # CPU: ~10 s
)
def test_the_compiled_reference_equals_eager_bit_for_bit(recipe, device):
    """Each emulated GEMM is a custom op inductor cannot fuse into (traced, Triton's approximate float32 division,
    its log2/exp2 and the bfloat16 rounding it elides under autocast changed the bits on an H200). The bias's
    gradient is not compared: a sum over the batch, which inductor orders differently from eager, float8 or not."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(6)
    layer = Float8Linear.from_linear(nn.Linear(48, 80), RECIPES[recipe]).to(device)
    x = (torch.randn(5, 37, 96, generator=g) * torch.logspace(-3, 3, 96))[..., ::2].to(device)  # non-contiguous
    grad = torch.randn(5, 37, 80, generator=g).to(device) * 1e-4
    results = []
    for run in (layer, torch.compile(layer, fullgraph=True)):
        for autocast in (False, True):  # float32, then O1's bfloat16 autocast
            layer.zero_grad()
            inp = x.clone().requires_grad_()
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                out = run(inp)
            out.backward(grad.to(out.dtype))
            results.append((out, inp.grad, layer.weight.grad.clone()))
    for eager, compiled in zip(results[:2], results[2:], strict=True):
        for a, b in zip(eager, compiled, strict=True):
            assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recording_telemetry_reads_nothing_from_the_device(recipe):
    """Every layer's statistics stay on the GPU until the logger reads them all at once: recording a training step
    of a two-layer float8 model raises under CUDA's sync debug mode only if some statistic forced a read."""
    model = _mlp().cuda()
    convert_to_float8(model, recipe)
    layers = {name: m for name, m in model.named_modules() if is_float8_linear(m)}
    recorder = Float8Recorder(layers, RECIPES[recipe])
    x = torch.randn(64, 32, device="cuda")
    recorder.arm()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(x).sum().backward()
        stats = recorder.disarm()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert set(stats) == set(layers) == {"0", "3.1"}
    assert all(set(roles) == {"input", "weight", "grad_output"} for roles in stats.values())
