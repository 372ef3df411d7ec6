"""Apex's O0-O5 optimization levels and their override rules, with a ``dtype`` replacing hard-coded half.

O4 and O5 are Apex's bfloat16 levels (O1 and O2 in bfloat16, with a static loss scale of 1: bfloat16
has float32's range, so nothing overflows that scaling would rescue).

``resolve_opt_level("O2", dtype="bfloat16", loss_scale=128)`` returns the frozen
:class:`OptLevelProperties` the casting, scaling and master-weight code reads. The table and the
rules are Apex's (``apex/amp/frontend.py`` before its removal); an override that Apex rejects
raises ``RuntimeError`` naming the option, a value of the wrong kind raises ``ValueError``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ampkit.ops._switches import is_switch
from ampkit.wording import beyond_float, integer_digits, shown

__all__ = ["OPT_LEVELS", "OptLevelProperties", "parse_dtype", "parse_loss_scale", "resolve_opt_level"]

OPT_LEVELS: tuple[str, ...] = ("O0", "O1", "O2", "O3", "O4", "O5")
"""Apex's opt levels: O0 fp32, O1 autocast, O2 cast model + fp32 masters, O3 pure half; O4/O5 are O1/O2 in bf16."""
_BF16_LEVELS = ("O4", "O5")

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
_CAST_DTYPE_NAMES: dict[str, torch.dtype] = {**_DTYPE_NAMES, "float32": torch.float32, "fp32": torch.float32}

LossScale = float | Literal["dynamic"]


@dataclass(frozen=True)
class OptLevelProperties:
    """The resolved mixed-precision recipe: what gets cast, how losses are scaled, where weights live.

    Attributes:
        opt_level: ``"O0"`` .. ``"O3"``.
        dtype: the low-precision type (``torch.float16`` or ``torch.bfloat16``) used by autocast (O1)
            and by the model cast (O2/O3).
        cast_model_type: type the model's parameters are cast to, or ``None`` to leave them alone.
        patch_torch_functions: O1's per-function casting (autocast here).
        keep_batchnorm_fp32: keep batch-norm layers in float32 when the model is cast.
        master_weights: keep float32 master copies of low-precision parameters in the optimizer.
        loss_scale: ``"dynamic"`` or a static float scale.
        enabled: ``False`` turns every mechanism off (plain float32 training).
    """

    opt_level: str
    dtype: torch.dtype
    cast_model_type: torch.dtype | None
    patch_torch_functions: bool
    keep_batchnorm_fp32: bool | None
    master_weights: bool | None
    loss_scale: LossScale
    enabled: bool = True

    @property
    def dynamic_loss_scale(self) -> bool:
        """Whether the loss scale adapts to overflows."""
        return self.loss_scale == "dynamic"

    @property
    def options(self) -> dict[str, Any]:
        """The properties as Apex's ``Properties.options`` dict (its seven keys), which scripts log or read
        (catalyst casts a DataParallel model's inputs to ``options["cast_model_type"]``)."""
        names = ("enabled", "opt_level", "cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32")
        return {name: getattr(self, name) for name in (*names, "master_weights", "loss_scale")}


def _dtype_key(value: Any) -> str | None:
    """The name ``value`` gives a dtype under, as the config reads it: a string, or an integer (the config's ``16``,
    as Lightning writes precision, is the text ``"16"`` there; a bool or float is not)."""
    if isinstance(value, str):
        return value.lower().removeprefix("torch.")
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and not beyond_float(value):
        return str(int(value))
    return None


def parse_dtype(value: Any, option: str = "dtype") -> torch.dtype:
    """Map ``float16``/``fp16``/``half``/``16``/``bfloat16``/``bf16`` (or the torch dtypes) to a torch dtype, as the
    config's ``precision.dtype`` does (its ``16``, a YAML integer, is float16 in the Python API too)."""
    if value in (torch.float16, torch.bfloat16):
        return value
    if (key := _dtype_key(value)) in _DTYPE_NAMES:
        return _DTYPE_NAMES[key]
    meant = dtype_meant(value)
    raise ValueError(
        f"{option}={shown(value)} is not a low-precision dtype; use float16 or bfloat16"
        + (f" ({meant})" if meant else "")
    )


# Lightning's precision settings, which name a dtype and an opt level at once.
_LIGHTNING_PRECISION = {"16-mixed": ("float16", "O1"), "bf16-mixed": ("bfloat16", "O4"),
                        "16-true": ("float16", "O3"), "bf16-true": ("bfloat16", "O3")}  # fmt: skip


def dtype_meant(value: Any) -> str | None:
    """What a dtype name torch does not spell means, in words: one quoted twice, padded, written with a dash
    (``bf-16``), or Lightning's ``16-mixed``, which is a dtype and an opt level here."""
    if not isinstance(value, str):
        return None
    name = value.strip().strip("'\"").strip().lower().removeprefix("torch.")
    if name in _LIGHTNING_PRECISION:
        dtype, level = _LIGHTNING_PRECISION[name]
        return f"Lightning's precision {shown(value)} is two settings here: dtype {dtype} and opt_level {level}"
    squashed = name.replace("-", "").replace("_", "").replace(" ", "")
    if squashed not in _DTYPE_NAMES:
        return None
    dtype = str(_DTYPE_NAMES[squashed]).removeprefix("torch.")
    return f"{shown(value)} reads as {dtype}; write {dtype}"


def parse_loss_scale(value: Any, option: str = "loss_scale") -> LossScale:
    """Return ``"dynamic"`` or a positive finite float, as Apex's ``float(value)`` rule allows."""
    if value == "dynamic":
        return "dynamic"
    if isinstance(value, str) and value.strip().lower() == "dynamic":  # Apex compares the exact word
        raise ValueError(
            f"{option}={shown(value)}: expected 'dynamic' or a positive number "
            "(written exactly 'dynamic': lowercase, no spaces)"
        )
    if isinstance(value, bool):
        raise ValueError(f"{option}={shown(value)}: expected 'dynamic' or a positive number")
    try:
        scale = float(value)
    except OverflowError:  # an int no float holds: float() named neither it nor the option
        raise ValueError(
            f"{option}={integer_digits(value)}: a static loss scale must lie in float32's range of scales, 2**-126 "
            f"to {FLOAT32_SCALES[1]:.4g}"
        ) from None
    except (TypeError, ValueError):
        raise ValueError(f"{option}={shown(value)}: expected 'dynamic' or a positive number") from None
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{option}={shown(value)}: a static loss scale must be finite and > 0")
    if not FLOAT32_SCALES[0] <= scale <= FLOAT32_SCALES[1]:  # finite for Python, not for the float32 it scales
        raise ValueError(
            f"{option}={shown(value)}: a static loss scale must lie in float32's range of scales, 2**-126 to "
            f"{FLOAT32_SCALES[1]:.4g}: beyond it the scaled loss is inf or its unscaling factor is (every step NaN)"
        )
    return scale


# The scales a float32 loss and gradient can carry: float32's smallest normal number (whose reciprocal it still
# holds) to its largest. Apex's float() took 1e40, which made every scaled loss inf.
FLOAT32_SCALES = (2.0**-126, torch.finfo(torch.float32).max)


def _parse_cast_model_type(value: Any) -> torch.dtype | None | Literal[False]:
    if value is None or value is False:
        return value
    if isinstance(value, torch.dtype) and value in _CAST_DTYPE_NAMES.values():
        return value
    if (key := _dtype_key(value)) in _CAST_DTYPE_NAMES:
        return _CAST_DTYPE_NAMES[key]
    raise ValueError(
        f"cast_model_type={shown(value)}: expected None, False, torch.float32, torch.float16 or torch.bfloat16"
    )


def parse_keep_batchnorm_fp32(value: Any) -> bool | None:
    """Apex's ``keep_batchnorm_fp32``: True, False, their strings (Apex's argparse scripts pass them) or None."""
    if value == "True":
        return True
    if value == "False":
        return False
    if value is None or value is True or value is False:
        return value
    word = value.strip().capitalize() if isinstance(value, str) else None
    meant = (  # Apex compares its two strings exactly
        f" ({shown(value)} is the string {word!r} spelt otherwise: write {word}, or {str(word).lower()} in YAML)"
        if word in ("True", "False")
        else ""
    )
    raise ValueError(
        f"keep_batchnorm_fp32={shown(value)}: expected True, False, the string 'True' or 'False', or None{meant}"
    )


def _parse_bool_or_none(value: Any, option: str) -> bool | None:
    if value is None or value is True or value is False:
        return value
    raise ValueError(f"{option}={shown(value)}: expected True, False or None")


def resolve_opt_level(
    opt_level: str = "O1",
    *,
    dtype: torch.dtype | str | None = None,
    enabled: bool = True,
    cast_model_type: torch.dtype | str | bool | None = None,
    patch_torch_functions: bool | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    master_weights: bool | None = None,
    loss_scale: float | str | None = None,
) -> OptLevelProperties:
    """Apply Apex's table for ``opt_level`` and then the user's overrides (those that are not ``None``).

    Args:
        opt_level: ``"O0"`` .. ``"O5"`` (the letter O); O4/O5 are O1/O2 in bfloat16 with loss scale 1.
        dtype: low-precision type, float16 (default; bfloat16 at O4/O5) or bfloat16. When omitted and
            ``cast_model_type`` names a low-precision type, that type is used.
        enabled: ``False`` resolves to O0's float32 recipe whatever ``opt_level`` says.
        cast_model_type: Apex's override of the model's cast, as ``patch_torch_functions``,
            ``keep_batchnorm_fp32``, ``master_weights`` and ``loss_scale`` are of the other properties.

    Raises:
        RuntimeError: unknown ``opt_level`` or an override Apex forbids at that level.
        ValueError: an override of the wrong kind, or ``dtype`` conflicting with ``cast_model_type``.

    Example:
        >>> resolve_opt_level("O2", dtype="bf16").cast_model_type
        torch.bfloat16
    """
    if opt_level not in OPT_LEVELS:
        meant = str(opt_level).strip().upper() if isinstance(opt_level, str) else None
        hint = f" Did you mean {shown(meant)}? The O is a capital letter." if meant in OPT_LEVELS else ""
        raise RuntimeError(
            f"Unexpected optimization level {shown(opt_level)}. Options are 'O0', 'O1', 'O2', 'O3', 'O4', 'O5'. "
            f"Note that in 'O0', 'O1', etc., the prefix O is the letter O, not the number zero.{hint}"
        )
    if not is_switch(enabled):
        raise ValueError(f"enabled={shown(enabled)}: expected True or False")
    enabled = bool(enabled)
    parsed_cast = _parse_cast_model_type(cast_model_type)
    low = parse_dtype(dtype) if dtype is not None else None
    if isinstance(parsed_cast, torch.dtype) and parsed_cast != torch.float32:
        if low is not None and low != parsed_cast:
            raise ValueError(f"cast_model_type={parsed_cast} conflicts with dtype={low}; give one of them")
        low = parsed_cast
    if opt_level in _BF16_LEVELS and low not in (None, torch.bfloat16):
        raise ValueError(f"opt_level={shown(opt_level)} is a bfloat16 level; dtype={low} conflicts with it")
    low = low or (torch.bfloat16 if opt_level in _BF16_LEVELS else torch.float16)

    table: dict[str, dict[str, Any]] = {
        "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False, keep_batchnorm_fp32=None,
                   master_weights=False, loss_scale=1.0),
        "O1": dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None,
                   master_weights=None, loss_scale="dynamic"),
        "O2": dict(cast_model_type=low, patch_torch_functions=False, keep_batchnorm_fp32=True,
                   master_weights=True, loss_scale="dynamic"),
        "O3": dict(cast_model_type=low, patch_torch_functions=False, keep_batchnorm_fp32=False,
                   master_weights=False, loss_scale=1.0),
        "O4": dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None,
                   master_weights=None, loss_scale=1.0),
        "O5": dict(cast_model_type=low, patch_torch_functions=False, keep_batchnorm_fp32=True,
                   master_weights=True, loss_scale=1.0),
    }  # fmt: skip
    props = dict(table[opt_level])
    o1 = opt_level in ("O1", "O4")

    if cast_model_type is not None:
        if o1 and parsed_cast not in (False, torch.float32):
            raise RuntimeError(
                "O1 inserts casts around torch functions rather than casting the model weights, so with O1 "
                "the weights stay float32; use opt_level='O2' or 'O3' to cast the model. "
                f"cast_model_type was {shown(cast_model_type)}"
            )
        props["cast_model_type"] = parsed_cast or None
    if patch_torch_functions is not None:
        value = _parse_bool_or_none(patch_torch_functions, "patch_torch_functions")
        if value and not o1:
            raise RuntimeError(
                f"patch_torch_functions=True is only valid with opt_level='O1' or 'O4' (got "
                f"opt_level={shown(opt_level)})"
            )
        props["patch_torch_functions"] = value
    if keep_batchnorm_fp32 is not None:
        value = parse_keep_batchnorm_fp32(keep_batchnorm_fp32)
        if o1:
            raise RuntimeError(
                "With opt_level O1, batchnorm runs in float32 automatically, so keep_batchnorm_fp32 should "
                f"be None. keep_batchnorm_fp32 was {shown(keep_batchnorm_fp32)}"
            )
        props["keep_batchnorm_fp32"] = value
    if master_weights is not None:
        value = _parse_bool_or_none(master_weights, "master_weights")
        if o1:
            raise RuntimeError(
                "master_weights makes no sense with opt_level O1: the model weights themselves stay float32. "
                f"master_weights was {shown(master_weights)}"
            )
        props["master_weights"] = value
    if loss_scale is not None:
        props["loss_scale"] = parse_loss_scale(loss_scale)

    if not enabled:
        props = dict(table["O0"], loss_scale=1.0)
    return OptLevelProperties(opt_level=opt_level, dtype=low, enabled=enabled, **props)
