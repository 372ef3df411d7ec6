"""Apex's O0-O3 table and every override rule, with errors naming the option."""

import numpy as np
import pytest
import torch

from ampkit.amp.opt_levels import OPT_LEVELS, parse_dtype, parse_loss_scale, resolve_opt_level
from ampkit.config import Config, build_config


@pytest.mark.parametrize(
    "level, cast, patch, keep_bn, master, scale",
    [
        ("O0", torch.float32, False, None, False, 1.0),
        ("O1", None, True, None, None, "dynamic"),
        ("O2", torch.float16, False, True, True, "dynamic"),
        ("O3", torch.float16, False, False, False, 1.0),
    ],
)
def test_table_matches_apex(level, cast, patch, keep_bn, master, scale):
    props = resolve_opt_level(level)
    assert props.opt_level == level
    assert props.cast_model_type == cast
    assert props.patch_torch_functions is patch
    assert props.keep_batchnorm_fp32 is keep_bn
    assert props.master_weights is master
    assert props.loss_scale == scale
    assert props.dtype == torch.float16
    assert props.dynamic_loss_scale == (scale == "dynamic")


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_dtype_replaces_half(level):
    assert resolve_opt_level(level, dtype="bf16").cast_model_type == torch.bfloat16
    assert resolve_opt_level(level, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert resolve_opt_level(level, cast_model_type=torch.bfloat16).dtype == torch.bfloat16


def test_dtype_conflict_and_bad_dtype_name_the_option():
    with pytest.raises(ValueError, match="cast_model_type=torch.bfloat16 conflicts with dtype"):
        resolve_opt_level("O2", dtype="float16", cast_model_type=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype='float64'.*float16 or bfloat16"):
        resolve_opt_level("O2", dtype="float64")
    with pytest.raises(ValueError, match="dtype=torch.int8"):
        parse_dtype(torch.int8)


def _parsed(value) -> str:
    """The dtype ``value`` parses to, or the words it is refused with."""
    try:
        return str(parse_dtype(value))
    except ValueError as refused:
        return str(refused)


@pytest.mark.parametrize("value", [16, "16", 16.0, True, 32, "fp16", "bf16"])
def test_the_python_api_takes_a_dtype_as_the_config_does(value):
    """precision.dtype: 16 (a YAML integer, as Lightning writes precision) is float16 in a config, where the Python
    API refused parse_dtype(16) and resolve_opt_level(dtype=16): both take what the other takes, in the same words."""
    configured = build_config(Config, {"trainer_class": "x:Y", "precision": {"dtype": value}}).precision.dtype
    assert _parsed(value) == _parsed(configured).replace(repr(configured), repr(value))  # each names what it got


@pytest.mark.parametrize("sixteen", [16, np.int64(16)])
def test_an_integer_16_is_float16_wherever_a_dtype_is_taken(sixteen):
    assert resolve_opt_level("O2", dtype=sixteen).cast_model_type == torch.float16
    assert resolve_opt_level("O2", cast_model_type=sixteen).cast_model_type == torch.float16


@pytest.mark.parametrize("bad", ["01", "O6", "o1", "", None])
def test_unknown_level_lists_valid_levels(bad):
    with pytest.raises(RuntimeError, match="'O0', 'O1', 'O2', 'O3', 'O4', 'O5'.*letter O"):
        resolve_opt_level(bad)
    assert OPT_LEVELS == ("O0", "O1", "O2", "O3", "O4", "O5")


def test_o4_and_o5_are_apex_bfloat16_levels_without_loss_scaling():
    o4, o5 = resolve_opt_level("O4"), resolve_opt_level("O5")
    assert (o4.dtype, o4.patch_torch_functions, o4.cast_model_type, o4.loss_scale) == (torch.bfloat16, True, None, 1.0)
    assert (o5.dtype, o5.cast_model_type, o5.master_weights, o5.keep_batchnorm_fp32, o5.loss_scale) == (
        torch.bfloat16,
        torch.bfloat16,
        True,
        True,
        1.0,
    )
    with pytest.raises(RuntimeError, match="cast_model_type was"):
        resolve_opt_level("O4", cast_model_type=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 level"):
        resolve_opt_level("O5", dtype="float16")


@pytest.mark.parametrize("cast", [torch.float16, torch.bfloat16, "float16"])
def test_o1_rejects_model_cast(cast):
    with pytest.raises(RuntimeError, match="cast_model_type was"):
        resolve_opt_level("O1", cast_model_type=cast)


@pytest.mark.parametrize("cast", [False, torch.float32])
def test_o1_accepts_float32_cast(cast):
    expected = torch.float32 if cast is torch.float32 else None
    assert resolve_opt_level("O1", cast_model_type=cast).cast_model_type == expected


@pytest.mark.parametrize("value", [True, False, "True", "False"])
def test_o1_rejects_keep_batchnorm_fp32(value):
    with pytest.raises(RuntimeError, match="keep_batchnorm_fp32 was"):
        resolve_opt_level("O1", keep_batchnorm_fp32=value)


@pytest.mark.parametrize("value", [True, False])
def test_o1_rejects_master_weights(value):
    with pytest.raises(RuntimeError, match="master_weights"):
        resolve_opt_level("O1", master_weights=value)


@pytest.mark.parametrize("level", ["O0", "O2", "O3", "O5"])
def test_patch_torch_functions_only_with_o1(level):
    with pytest.raises(RuntimeError, match="patch_torch_functions=True is only valid with opt_level='O1' or 'O4'"):
        resolve_opt_level(level, patch_torch_functions=True)
    assert resolve_opt_level(level, patch_torch_functions=False).patch_torch_functions is False
    assert resolve_opt_level("O1", patch_torch_functions=False).patch_torch_functions is False


@pytest.mark.parametrize("level", OPT_LEVELS)
def test_loss_scale_override_at_every_level(level):
    assert resolve_opt_level(level, loss_scale="dynamic").loss_scale == "dynamic"
    assert resolve_opt_level(level, loss_scale="128.0").loss_scale == 128.0
    assert resolve_opt_level(level, loss_scale=64).loss_scale == 64.0


@pytest.mark.parametrize("bad", ["dynamc", -1.0, 0, float("inf"), float("nan"), True, [1.0]])
def test_bad_loss_scale_names_the_option(bad):
    with pytest.raises(ValueError, match="loss_scale="):
        parse_loss_scale(bad)


@pytest.mark.parametrize("bad", ["Dynamic", "DYNAMIC", " dynamic"])
def test_a_loss_scale_spelling_dynamic_otherwise_is_told_the_spelling(bad):
    """Apex compares loss_scale with the exact word 'dynamic': another case or spaces is refused, saying so."""
    with pytest.raises(
        ValueError, match=rf"loss_scale={bad!r}: expected 'dynamic' or a .* \(written exactly 'dynamic'"
    ):
        resolve_opt_level("O1", loss_scale=bad)


@pytest.mark.parametrize(("bad", "meant"), [("o1", "O1"), ("o2", "O2"), (" O3", "O3")])
def test_an_opt_level_in_another_case_or_padded_names_the_level_meant(bad, meant):
    with pytest.raises(RuntimeError, match=rf"Unexpected optimization level {bad!r}.*Did you mean '{meant}'\?"):
        resolve_opt_level(bad)
    with pytest.raises(RuntimeError) as caught:
        resolve_opt_level("01")  # the number zero: no level is meant
    assert "Did you mean" not in str(caught.value)


@pytest.mark.parametrize("bad", [1e40, "1e-50"])
def test_a_static_loss_scale_outside_float32_s_range_is_refused_naming_the_range(bad):
    with pytest.raises(ValueError, match=r"must lie in float32's range of scales, 2\*\*-126 to 3.403e\+38"):
        resolve_opt_level("O2", loss_scale=bad)


def test_overrides_at_o2_o3():
    props = resolve_opt_level("O2", keep_batchnorm_fp32="False", master_weights=False)
    assert props.keep_batchnorm_fp32 is False and props.master_weights is False
    props = resolve_opt_level("O3", keep_batchnorm_fp32="True", master_weights=True)
    assert props.keep_batchnorm_fp32 is True and props.master_weights is True
    assert resolve_opt_level("O2", cast_model_type=torch.float32).cast_model_type == torch.float32


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"keep_batchnorm_fp32": "yes"}, "keep_batchnorm_fp32='yes'"),
        ({"master_weights": "True"}, "master_weights='True'"),
        ({"cast_model_type": torch.int32}, "cast_model_type=torch.int32"),
        ({"patch_torch_functions": 1}, "patch_torch_functions=1"),
        ({"enabled": "no"}, "enabled='no'"),
    ],
)
def test_bad_override_values_name_the_option(kwargs, option):
    with pytest.raises(ValueError, match=option.replace("(", r"\(")):
        resolve_opt_level("O2", **kwargs)


def test_disabled_is_float32():
    props = resolve_opt_level("O2", enabled=False)
    assert props.enabled is False and props.cast_model_type == torch.float32
    assert props.loss_scale == 1.0 and props.master_weights is False


def test_options_is_apex_s_seven_keys_with_the_resolved_values():
    props = resolve_opt_level("O2", dtype="bf16", keep_batchnorm_fp32=False, loss_scale=64)
    assert props.options == {
        "enabled": True,
        "opt_level": "O2",
        "cast_model_type": torch.bfloat16,
        "patch_torch_functions": False,
        "keep_batchnorm_fp32": False,
        "master_weights": True,
        "loss_scale": 64.0,
    }


def test_the_static_loss_scale_range_is_the_one_the_message_names():
    smallest, largest = 2.0**-126, torch.finfo(torch.float32).max
    assert parse_loss_scale(smallest) == smallest and parse_loss_scale(largest) == largest
    for outside in (2.0**-127, 2.0**-140, largest * 2):
        with pytest.raises(ValueError, match=r"2\*\*-126 to 3.403e\+38"):
            parse_loss_scale(outside)
