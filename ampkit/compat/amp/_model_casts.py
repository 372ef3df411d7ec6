"""How ``amp.initialize`` casts models: O2/O3 cast the weights and the model's inputs and outputs; O1 casts
no model (it patches torch's functions, see ``o1_casts``) but may cast its outputs. An input or output of the
script's own class is cast by its ``.to(dtype)``, as Apex's applier did ("Allow handling of custom batch classes").

``model(x)`` is cast by hooks, and ``model.forward`` is replaced as Apex's was, so a script calling
``model.forward(x)`` itself (flair's language-model trainer) or a model calling ``self.forward`` gets the casts
too (see ``patch_forward_casts``); both are objects, not closures, so the model still pickles. A state-dict hook
saves float32. What each model got is remembered, so that a later ``initialize`` of the same model takes it off
before adding its own.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampkit.amp import OptLevelProperties
from ampkit.amp.casting import cast_model, patch_forward_casts
from ampkit.compat.fp16_utils.fp16util import convert_network

_installed: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()


class Float32StateDict:
    """State-dict hook of O2/O3 models: low-precision parameters and buffers are saved as float32.

    Apex registered the same hook, so checkpoints load into a model at any opt level. Where the
    optimizer keeps a float32 master of a parameter (O2), the master is saved rather than the upcast
    low-precision copy: a checkpoint then holds the weights training really continues from. A copy of the
    model (``copy.deepcopy`` for an EMA, pickling) gets a hook without masters: they are the original's,
    so the copy saves its own weights, upcast.
    """

    def __init__(self) -> None:
        # Each source returns ``id(model parameter) -> float32 master``; asked at save time, so params added
        # with ``add_param_group`` after ``initialize`` are found too.
        self.master_sources: list[Callable[[], dict[int, torch.Tensor]]] = []

    def __reduce__(self) -> tuple[type, tuple]:
        return (Float32StateDict, ())

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        by_name = {prefix + name: p for name, p in module.named_parameters(remove_duplicate=False)}
        masters = {k: v for source in self.master_sources for k, v in source().items()}
        for key, value in state_dict.items():
            if not (isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16)):
                continue
            master = masters.get(id(by_name.get(key)))
            state_dict[key] = master.detach().clone() if master is not None else value.to(torch.float32)


def remove_model_casts(model: nn.Module) -> None:
    """Take off the forward and hooks a previous ``initialize`` put on ``model``."""
    for handle in _installed.pop(model, []):
        handle.remove()


def apply_model_casts(
    model: nn.Module, properties: OptLevelProperties, cast_model_outputs: Any, state_dict_hook: Float32StateDict
) -> None:
    """Cast ``model`` as ``properties`` say and install the casting forward and state-dict hook of its opt level."""
    remove_model_casts(model)
    handles: list[Any] = []
    output_dtype = cast_model_outputs
    if properties.cast_model_type is not None:
        handles.append(model._register_state_dict_hook(state_dict_hook))
        if properties.keep_batchnorm_fp32:
            # Apex's rule: only batch norms with a weight and bias stay float32; one with affine=False is cast,
            # running statistics included
            convert_network(model, properties.cast_model_type)
        else:
            cast_model(model, properties.cast_model_type)
        if output_dtype is None:
            output_dtype = torch.float32
        handles.append(patch_forward_casts(model, properties.cast_model_type, output_dtype, own_to=True))
    elif output_dtype is not None:
        handles.append(patch_forward_casts(model, None, output_dtype, own_to=True))
    if handles:
        _installed[model] = handles
