"""O1 autocast on CPU, O2/O3 model casts keeping batch norm fp32, casts at the model boundary."""

import dataclasses
import io
from collections import defaultdict, namedtuple

import pytest
import torch
from torch import nn

from ampkit.amp.casting import add_boundary_casts, autocast_for, cast_floating, cast_model, model_device

DTYPES = [torch.float16, torch.bfloat16]


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 2)
        self.seen = []

    def forward(self, x, scale=None):
        self.seen.append((x.dtype, None if scale is None else scale.dtype))
        y = self.bn(self.conv(x)).relu().mean((2, 3))
        return {"logits": self.head(y), "pair": (y, torch.arange(2))}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("keep_bn", [True, False])
def test_cast_model_keeps_batchnorm_fp32_when_asked(dtype, keep_bn):
    model = cast_model(ConvNet(), dtype, keep_batchnorm_fp32=keep_bn)
    bn_type = torch.float32 if keep_bn else dtype
    assert model.conv.weight.dtype == model.head.bias.dtype == dtype
    assert model.bn.weight.dtype == model.bn.running_mean.dtype == model.bn.running_var.dtype == bn_type
    assert model.bn.num_batches_tracked.dtype == torch.int64


@pytest.mark.parametrize("dtype", DTYPES)
def test_cast_model_casts_gradients_already_there_with_their_parameters(dtype):
    """A model cast after a backward (a warm-up step in float32) keeps each grad in its parameter's dtype, so the
    next backward accumulates into it; batch norm kept float32 keeps float32 grads."""
    model = ConvNet()
    model(torch.randn(2, 3, 5, 5))["logits"].sum().backward()
    conv_grad = model.conv.weight.grad.clone()
    cast_model(model, dtype, keep_batchnorm_fp32=True)
    assert model.conv.weight.grad.dtype == model.head.weight.grad.dtype == dtype
    assert model.bn.weight.grad.dtype == torch.float32
    assert torch.equal(model.conv.weight.grad, conv_grad.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_o2_forward_backward_with_boundary_casts(dtype):
    torch.manual_seed(0)
    model = cast_model(ConvNet(), dtype, keep_batchnorm_fp32=True)
    params_before = list(model.parameters())
    add_boundary_casts(model, dtype, torch.float32)
    x = torch.randn(2, 3, 5, 5)
    out = model(x, scale=torch.ones(1))
    assert model.seen == [(dtype, dtype)]  # positional and keyword inputs cast at the boundary
    assert out["logits"].dtype == torch.float32 and out["pair"][0].dtype == torch.float32
    assert out["pair"][1].dtype == torch.int64
    out["logits"].sum().backward()
    assert list(model.parameters()) == params_before  # casting kept parameter identity
    assert model.conv.weight.grad.dtype == dtype and model.bn.weight.grad.dtype == torch.float32


def test_boundary_casts_none_and_remove():
    model = ConvNet()
    handle = add_boundary_casts(model, None, None)
    model(torch.randn(1, 3, 4, 4))
    assert model.seen[-1][0] == torch.float32
    handle.remove()
    model = cast_model(ConvNet(), torch.bfloat16)
    handle = add_boundary_casts(model, torch.bfloat16, output_dtype=None)
    assert model(torch.randn(1, 3, 4, 4))["logits"].dtype == torch.bfloat16
    handle.remove()
    with pytest.raises(RuntimeError):  # no cast any more: fp32 input into a bf16 conv
        model(torch.randn(1, 3, 4, 4))


@pytest.mark.parametrize("dtype", DTYPES)
def test_boundary_casts_stand_down_on_a_model_cast_back_to_float32(dtype):
    """``model.float()`` for export: float32 inputs reach float32 weights, and ``model.to(dtype)`` casts again."""
    torch.manual_seed(0)
    model = cast_model(ConvNet(), dtype, keep_batchnorm_fp32=True)
    add_boundary_casts(model, dtype, torch.float32)
    model.float()
    x = torch.randn(2, 3, 5, 5)
    model(x, scale=torch.ones(1))
    assert model.seen[-1] == (torch.float32, torch.float32)
    model.to(dtype)
    model(x, scale=torch.ones(1))
    assert model.seen[-1] == (dtype, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_model_with_boundary_casts_pickles_whole_and_keeps_casting(dtype):
    model = cast_model(ConvNet(), dtype, keep_batchnorm_fp32=True)
    add_boundary_casts(model, dtype, torch.float32)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the whole model, hooks included
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    out = loaded(torch.randn(2, 3, 5, 5))
    assert loaded.seen[-1][0] == dtype and out["logits"].dtype == torch.float32


def test_cast_floating_recurses_and_leaves_others():
    Pair = namedtuple("Pair", "a b")
    value = {"x": [torch.ones(1), (torch.ones(1, dtype=torch.int32), "s")], "p": Pair(torch.ones(1), 3)}
    out = cast_floating(value, torch.float16)
    assert out["x"][0].dtype == torch.float16 and out["x"][1][0].dtype == torch.int32
    assert out["x"][1][1] == "s" and isinstance(out["p"], Pair) and out["p"].a.dtype == torch.float16
    t = torch.ones(2, dtype=torch.float16)
    assert cast_floating(t, torch.float16) is t


@dataclasses.dataclass(frozen=True)
class _Inputs:
    image: torch.Tensor
    ids: torch.Tensor
    name: str = "batch"


def test_cast_floating_casts_the_fields_of_a_dataclass_frozen_too_and_leaves_the_original():
    """Passed through uncast, a dataclass's float32 tensors met an O2 model's float16 weights in its first matmul (a
    dtype mismatch), and a dataclass the model returned stayed float16 where a dict or a namedtuple is cast back."""
    value = _Inputs(torch.ones(2), torch.ones(2, dtype=torch.int64))
    out = cast_floating({"inputs": [value]}, torch.float16)["inputs"][0]
    assert isinstance(out, _Inputs) and out.name == "batch"
    assert out.image.dtype == torch.float16 and out.ids.dtype == torch.int64
    assert value.image.dtype == torch.float32, "the original is not changed"


def test_cast_floating_rebuilds_mappings_whose_constructor_takes_no_dict():
    """A defaultdict of losses keeps its factory, and a dict class whose constructor takes arguments of its own
    keeps its class and attributes: rebuilding them with ``type(value)(dict_of_values)`` failed or built a wrong
    object."""

    class Named(dict):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

    losses = defaultdict(float, {"cls": torch.ones(1)})
    out = cast_floating(losses, torch.float16)
    assert isinstance(out, defaultdict) and out.default_factory is float and out["cls"].dtype == torch.float16
    named = Named("heads")
    named["box"] = torch.ones(1)
    out = cast_floating(named, torch.float16)
    assert isinstance(out, Named) and out.name == "heads" and out == {"box": torch.ones(1, dtype=torch.float16)}
    assert named["box"].dtype == torch.float32, "the original is not changed"


@pytest.mark.parametrize("dtype", DTYPES)
def test_autocast_for_cpu_model(dtype):
    model = nn.Linear(4, 4)
    assert model_device(model) == torch.device("cpu")
    with autocast_for(model, dtype):
        assert model(torch.randn(2, 4)).dtype == dtype
    with autocast_for("cpu", dtype, enabled=False):
        assert model(torch.randn(2, 4)).dtype == torch.float32
    assert model_device(nn.ReLU()) == torch.device("cpu")


def test_cast_model_rejects_bad_dtype():
    with pytest.raises(ValueError, match="dtype=torch.int8"):
        cast_model(nn.Linear(2, 2), torch.int8)


def _bn_model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: autocast_for("cpu", torch.int32), ValueError, "dtype=torch.int32 is not a low-precision dtype"),
        (lambda: autocast_for("cpu", torch.float32), ValueError, "dtype=torch.float32 is not a low-precision dtype"),
        (
            lambda: autocast_for("cpu", torch.bfloat16, "False"),
            ValueError,
            "enabled must be True or False, got 'False'",
        ),
        (lambda: cast_floating(torch.ones(2), torch.int32), ValueError, "dtype=torch.int32: expected a floating-point"),
        (lambda: add_boundary_casts(nn.Linear(2, 2), torch.int64), ValueError, "input_dtype=torch.int64: expected a"),
        (lambda: add_boundary_casts(nn.Linear(2, 2), None, torch.bool), ValueError, "output_dtype=torch.bool: expect"),
        (lambda: cast_model([nn.Linear(2, 2)], torch.float16), TypeError, "cast_model expects a torch.nn.Module, got"),
        (lambda: cast_model(_bn_model(), torch.float16, "maybe"), ValueError, "keep_batchnorm_fp32='maybe': expected"),
    ],
    ids=[
        "autocast int",
        "autocast fp32",
        "autocast enabled text",
        "cast int",
        "inputs to int",
        "outputs to bool",
        "cast a list",
        "keep bn maybe",
    ],  # fmt: skip
)
def test_the_casting_helpers_name_a_dtype_or_switch_they_cannot_use(call, error, message):
    """Taken as given: torch's autocast warned and ran in float32 (int32, float32), enabled="False" autocast anyway,
    an integer dtype truncated every floating tensor it cast, and a list failed in model.modules()."""
    with pytest.raises(error, match=message):
        call()


def test_cast_model_reads_apexs_keep_batchnorm_strings():
    """Apex's argparse scripts pass keep_batchnorm_fp32 as the string "False", which kept batch norm in float32
    (a truthy string); resolve_opt_level already read it, cast_model now does too."""
    assert cast_model(_bn_model(), torch.float16, keep_batchnorm_fp32="False")[1].weight.dtype == torch.float16
    assert cast_model(_bn_model(), torch.float16, keep_batchnorm_fp32="True")[1].weight.dtype == torch.float32
    with autocast_for("cpu", "bfloat16"):  # a dtype's name, as the config and resolve_opt_level take it
        assert nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.bfloat16
