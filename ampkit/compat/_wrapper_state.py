"""The check both of Apex's ``FP16_Optimizer`` wrappers run before loading a state dict."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def require_wrapper_keys(state_dict: Mapping[str, Any], required: Iterable[str]) -> None:
    """A one-line ``ValueError`` naming the keys ``state_dict`` lacks; a plain optimizer's is named as such.

    Resuming an fp32 run with fp16 on (ParlAI's ``--fp16``) hands the wrapper the wrapped optimizer's own state dict:
    it was a bare ``KeyError: 'loss_scaler'``, which callers catching ``ValueError`` for a changed model missed.
    """
    missing = [key for key in required if key not in state_dict]
    if not missing:
        return
    plain = {"state", "param_groups"} <= set(state_dict)
    hint = (
        "; it is a plain optimizer's state dict (keys 'state', 'param_groups'): load that with "
        "FP16_Optimizer.optimizer.load_state_dict(...)"
        if plain
        else f"; it has {sorted(state_dict)}"
    )
    raise ValueError(f"FP16_Optimizer.load_state_dict: the state dict lacks {missing}{hint}")
