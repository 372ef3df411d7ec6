"""``apex.amp.amp``, the module Apex's functional API lived in. Scripts import it as ``from apex.amp import amp``
and call ``amp.initialize``, ``amp.register_float_function`` and the rest on it, so it has the names Apex's had:
``init``, the cast decorators and registrations, ``initialize``, ``state_dict``, ``load_state_dict`` and the
handles. ``scale_loss`` and ``master_params`` were never among them: they are ``apex.amp``'s.
"""

from typing import Any

from ampkit.compat.amp._amp_state import _amp_state
from ampkit.compat.amp.frontend import initialize, load_state_dict, state_dict
from ampkit.compat.amp.functions import (
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from ampkit.compat.amp.handle import AmpHandle, NoOpHandle, init
from ampkit.compat.amp.lists import functional_overrides, tensor_overrides, torch_overrides  # noqa: F401 - Apex's
from ampkit.missing_name import missing_name

__all__ = [
    "AmpHandle",
    "NoOpHandle",
    "_amp_state",
    "float_function",
    "half_function",
    "init",
    "initialize",
    "load_state_dict",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "state_dict",
]


def __getattr__(name: str) -> Any:
    raise missing_name(
        f"apex.amp.amp (ampkit.compat.amp.amp) has no attribute {name!r}, as in Apex; it provides "
        f"{', '.join(__all__)}, and apex.amp itself has scale_loss, master_params and disable_casts",
        "apex.amp.amp",
        name,
    )
