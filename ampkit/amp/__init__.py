"""The mixed-precision engine: loss scalers, combined unscaling, opt levels, casting, master weights.

Used by the Trainer's precision callbacks and by the Apex-compatible API; it imports neither.
"""

from ampkit.amp.casting import (
    BoundaryCasts,
    add_boundary_casts,
    autocast_for,
    cast_floating,
    cast_model,
    model_device,
)
from ampkit.amp.grad_combine import CombineResult, GradientCombiner, read_flags, unscale_and_check_
from ampkit.amp.master_weights import MasterWeights
from ampkit.amp.opt_levels import (
    OPT_LEVELS,
    OptLevelProperties,
    parse_dtype,
    parse_loss_scale,
    resolve_opt_level,
)
from ampkit.amp.scaler import LossScaler

__all__ = [
    "OPT_LEVELS",
    "BoundaryCasts",
    "CombineResult",
    "GradientCombiner",
    "LossScaler",
    "MasterWeights",
    "OptLevelProperties",
    "add_boundary_casts",
    "autocast_for",
    "cast_floating",
    "cast_model",
    "model_device",
    "parse_dtype",
    "parse_loss_scale",
    "read_flags",
    "resolve_opt_level",
    "unscale_and_check_",
]

# Apex's ``amp.initialize`` & co. by name, so ``from ampkit import amp; amp.initialize(...)`` works as the
# issue asks. They live in ``ampkit.compat.amp`` (which sits on top of this engine) and are looked up on
# first access only: importing the engine never imports compat, and no engine module refers to them.
_APEX_API = frozenset(
    {
        "initialize", "scale_loss", "master_params", "state_dict", "load_state_dict", "disable_casts",
        "register_half_function", "register_float_function", "register_promote_function",
        "half_function", "float_function", "promote_function", "_amp_state", "init",
    }
)  # fmt: skip


def __getattr__(name: str):
    if name in _APEX_API:
        import importlib

        return getattr(importlib.import_module("ampkit.compat.amp"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
