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
