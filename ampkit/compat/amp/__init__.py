"""Apex's ``apex.amp`` API on ampkit's engine: ``from ampkit.compat import amp`` (or ``from apex import amp``
through the shim).

``initialize``, ``scale_loss``, ``init`` (the original handle API), ``master_params``, ``state_dict`` /
``load_state_dict``, ``disable_casts``, ``register_{half,float,promote}_function`` and the
``{half,float,promote}_function`` decorators, with Apex's semantics; the scalers in
``_amp_state.loss_scalers`` answer to Apex's attributes (``_loss_scale`` read and written, ``_unskipped``, ...).
"""

from typing import Any

from ampkit.compat._exported_names import keep_exported_names

# apex.amp._initialize.applier is reached as an attribute (catalyst)
from ampkit.compat.amp import _initialize as _initialize

# apex.amp._process_optimizer.post_backward_models_are_masters is reached as an attribute (onnxruntime-training)
from ampkit.compat.amp import _process_optimizer as _process_optimizer

# apex.amp.lists: the O1 cast tables scripts edit before initialize (NVIDIA's Tacotron 2: amp.lists.functional_...)
from ampkit.compat.amp import lists as lists

# apex.amp.utils was bound on the package by Apex's own imports: `import apex.amp` then `apex.amp.utils.is_fp_tensor`
from ampkit.compat.amp import utils as utils
from ampkit.compat.amp._amp_state import _amp_state, master_params
from ampkit.compat.amp.frontend import initialize, load_state_dict, state_dict
from ampkit.compat.amp.functions import (
    disable_casts,
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from ampkit.compat.amp.handle import AmpHandle, NoOpHandle, init, scale_loss
from ampkit.missing_name import missing_name

__all__ = [
    "AmpHandle",
    "NoOpHandle",
    "_amp_state",
    "disable_casts",
    "float_function",
    "half_function",
    "init",
    "initialize",
    "load_state_dict",
    "master_params",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "state_dict",
]


def __getattr__(name: str) -> Any:
    raise missing_name(
        f"apex.amp (ampkit.compat.amp) has no attribute {name!r}; it provides {', '.join(__all__)}",
        "apex.amp",
        name,
    )


keep_exported_names(__name__)  # amp._amp_state stays the state object (see _exported_names)
