"""The mixed-precision engine: loss scalers, combined unscaling, opt levels, casting."""

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
    "LossScaler",
    "OptLevelProperties",
    "parse_dtype",
    "parse_loss_scale",
    "resolve_opt_level",
]
