"""How ``amp.initialize`` casts models: O2/O3 cast the weights and the model's inputs and outputs; O1 casts
no model (it patches torch's functions, see ``o1_casts``) but may cast its outputs.

Everything is hooks (no ``model.forward`` replaced), so models stay picklable, and each model's hooks
are remembered so that a later ``initialize`` of the same model removes them before adding its own.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ampkit.amp import OptLevelProperties
from ampkit.amp.casting import add_boundary_casts, cast_model

_installed: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()


def remove_model_casts(model: nn.Module) -> None:
    """Take off the hooks a previous ``initialize`` put on ``model``."""
    for handle in _installed.pop(model, []):
        handle.remove()


def apply_model_casts(model: nn.Module, properties: OptLevelProperties, cast_model_outputs: Any) -> None:
    """Cast ``model`` as ``properties`` say and install the forward hooks of its opt level."""
    remove_model_casts(model)
    handles: list[Any] = []
    output_dtype = cast_model_outputs
    if properties.cast_model_type is not None:
        keep_bn = bool(properties.keep_batchnorm_fp32)
        cast_model(model, properties.cast_model_type, keep_batchnorm_fp32=keep_bn)
        if output_dtype is None:
            output_dtype = torch.float32
        handles.append(add_boundary_casts(model, properties.cast_model_type, output_dtype))
    elif output_dtype is not None:
        handles.append(add_boundary_casts(model, None, output_dtype))
    if handles:
        _installed[model] = handles
