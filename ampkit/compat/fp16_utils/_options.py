"""The options both of Apex's ``FP16_Optimizer`` classes take (the first, over ``FusedAdam``, and the last, in
``apex.fp16_utils``), checked by one function so a mistake gets the same words from either."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ampkit.ops._switches import checked_switch
from ampkit.wording import shown


def checked_options(
    verbose: Any, dynamic_loss_scale: Any, dynamic_loss_args: Any, keys: Sequence[str]
) -> tuple[bool, bool, dict[str, Any]]:
    """``verbose``, ``dynamic_loss_scale`` and ``dynamic_loss_args`` as a dict, checked before the optimizer is touched
    (one refused leaves its groups as they were): a switch read by truthiness took ``"False"`` as on, and with dynamic
    scaling the args hold only ``keys`` (a misspelt ``scale_windw`` was otherwise a setting nothing reads); without it,
    the args are ``{}``."""
    verbose = checked_switch("FP16_Optimizer", "verbose", verbose)  # "False" printed every message
    dynamic = checked_switch("FP16_Optimizer", "dynamic_loss_scale", dynamic_loss_scale)
    if not dynamic:  # Apex's last ignores dynamic_loss_args then, and its first refuses any (its caller says so)
        return verbose, dynamic, {}
    if dynamic_loss_args is not None and not isinstance(dynamic_loss_args, Mapping):
        expected = f"expected None or a dict of {', '.join(keys)}"
        raise TypeError(f"FP16_Optimizer: dynamic_loss_args={shown(dynamic_loss_args)}: {expected}")
    args = dict(dynamic_loss_args or {})
    unknown = sorted(set(args) - set(keys), key=repr)
    if unknown:
        raise TypeError(
            f"FP16_Optimizer: dynamic_loss_args has unknown keys {shown(unknown)}; the keys it takes are {list(keys)}"
        )
    return verbose, dynamic, args
