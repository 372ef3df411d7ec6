"""What a torch file that is no ampkit checkpoint holds (a bare ``state_dict``, a Lightning ``.ckpt``, an Apex-era
training script's dict), and how to use its weights instead: the words for the error that refuses it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ampkit.wording import counted

_LOAD_IN_CONFIGURE_MODEL = (
    "to use its weights, load them in configure_model (model.load_state_dict(torch.load(path, weights_only=True)"
    "{entry}))"
)


def foreign_contents(obj: Any) -> str:
    """``obj`` (what ``torch.load`` read from a file lacking ampkit's format entry) in words, with the way to use its
    weights where it has some."""
    if not isinstance(obj, Mapping):
        kind = f"a tensor of shape {tuple(obj.shape)}" if isinstance(obj, torch.Tensor) else f"a {type(obj).__name__}"
        return f"it holds {kind}, not a dict of a training run's state"
    if "pytorch-lightning_version" in obj or ("state_dict" in obj and "optimizer_states" in obj):
        version = obj.get("pytorch-lightning_version")
        return (
            f"it is a Lightning checkpoint{f' (Lightning {version})' if version else ''}, whose weights are under "
            "'state_dict', keyed by the LightningModule's attribute names; "
            + _LOAD_IN_CONFIGURE_MODEL.format(entry="['state_dict'], with that attribute's prefix taken off each key")
        )
    if isinstance(obj.get("amp"), Mapping) and any(str(key).startswith("loss_scaler") for key in obj["amp"]):
        model = "['model']" if "model" in obj else ""
        return (
            f"it is an Apex-era training script's checkpoint (keys {_keys(obj)}; 'amp' holds amp.state_dict()): resume "
            "it with the script that wrote it (python -m ampkit.legacy script.py runs it unchanged), or "
            + _LOAD_IN_CONFIGURE_MODEL.format(entry=model)
        )
    if obj and all(isinstance(value, torch.Tensor) for value in obj.values()):
        wrapped = all(str(key).startswith("module.") for key in obj)  # saved from a DDP/DataParallel wrapper
        return (
            f"it is a bare state_dict of {counted(len(obj), 'tensor')} (torch.save(model.state_dict())), no training "
            "run's state; "
            + _LOAD_IN_CONFIGURE_MODEL.format(entry="")
            + (", taking the 'module.' prefix of a DDP wrapper off its keys" if wrapped else "")
        )
    return f"it is a dict with keys {_keys(obj)}"


def _keys(obj: Mapping) -> str:
    keys = [repr(key) for key in list(obj)[:6]]
    return ", ".join(keys) + (", ..." if len(obj) > 6 else "") if keys else "none"
