"""A trained model back from a checkpoint, for inference outside any training loop."""

from __future__ import annotations

import os

import torch

from ampkit.config import import_object
from ampkit.trainer.checkpoint_io import CheckpointError, load_checkpoint
from ampkit.trainer.devices import resolve_device
from ampkit.trainer.finite_weights import check_saved_weights_finite
from ampkit.trainer.run_life import load_failure_reason, load_with_fallback_hint, resolve_checkpoint
from ampkit.trainer.sharded_checkpoint import TRAINER_FILE, consolidate_checkpoint, is_sharded_checkpoint
from ampkit.trainer.state_misfit import load_model_state
from ampkit.trainer.trainer import Trainer
from ampkit.trainer.user_code import check_model_has_values
from ampkit.wording import shown


def load_model(
    ckpt: str | os.PathLike, trainer_class: type[Trainer] | None = None, device: str | torch.device = "cpu"
) -> torch.nn.Module:
    """The model of an ampkit checkpoint in eval mode: its Trainer's ``configure_model()`` with the saved weights.

    The Trainer class and its config come from the checkpoint (``trainer_class`` names another, e.g. one
    defined in a script's ``__main__``). The weights load in the model's own dtypes (an O2 run's half
    weights become float32 in a float32 model). A sharded (FSDP) checkpoint directory loads too, gathered whole.
    """
    device = resolve_device(device, "load_model(device=...)", types=None)  # before the checkpoint is read
    path = resolve_checkpoint(".", ckpt)  # 'last'/'best': of the runs under the current directory
    if path is None:
        raise CheckpointError(
            f"load_model({shown(str(ckpt))}): no run under the current directory '{os.getcwd()}' has a {ckpt} "
            f"checkpoint; pass a checkpoint's path (e.g. runs/version_0/checkpoints/{ckpt}.pt), or call it from the "
            "run_dir"
        )
    if is_sharded_checkpoint(path):  # its config is in its trainer file; its shards gathered into one state dict
        trainer_part = load_checkpoint(path / TRAINER_FILE)
        checkpoint = {**trainer_part, "model": consolidate_checkpoint(path, trainer_part)}
    else:  # a damaged file's error names the newest whole checkpoint beside it, as a resume's does
        checkpoint = load_with_fallback_hint(path)
    config = dict(checkpoint.get("config") or {})
    if trainer_class is None:
        if not config.get("trainer_class"):
            raise CheckpointError(f"checkpoint '{path}' names no trainer_class; pass trainer_class=")
        trainer_class = import_object(config["trainer_class"], search_from=path.parent)
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise CheckpointError(f"trainer_class of '{path}' is {shown(trainer_class)}, not a subclass of ampkit.Trainer")
    config["trainer"] = {**config.get("trainer", {}), "device": "cpu"}  # where it trained need not exist here
    # configure_model() is the plain model: float8 (and its torchao or GPU needs) was a training set-up step
    precision = config.get("precision", {})
    config["precision"] = {**precision, "fp8": {**precision.get("fp8", {}), "enabled": False}}
    module = trainer_class(config).configure_model()
    check_model_has_values(module)
    if "model" not in checkpoint:  # else load_state_dict's KeyError would read as a misfit
        raise CheckpointError(f"checkpoint '{path}' has no 'model' entry: it holds no weights to load")
    check_saved_weights_finite(path, checkpoint["model"])
    try:
        load_model_state(module, checkpoint["model"])
    except (KeyError, RuntimeError) as exc:
        detail = load_failure_reason(exc)
        raise CheckpointError(f"checkpoint '{path}' does not fit {trainer_class.__name__}'s model: {detail}") from None
    return module.to(device).eval()
