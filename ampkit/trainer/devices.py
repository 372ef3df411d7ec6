"""The device a run (``trainer.device``) or a loaded model (``load_model(device=...)``) goes to, checked where it
is named: torch's own errors for a misspelt one or a missing GPU named neither the setting nor what is valid."""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from ampkit.config import ConfigError
from ampkit.wording import shown


def resolve_device(
    name: Any, where: str = "config key 'trainer.device'", types: tuple[str, ...] | None = ("cpu", "cuda")
) -> torch.device:
    """``name`` (``auto``, ``cpu``, ``cuda``, ``cuda:N`` or a ``torch.device``) as a device this process can use;
    ``types``: the device types taken (None: any torch knows, as a model loaded for inference may go to ``mps``).

    Raises:
        ConfigError: no such device, another type than ``types``, or cuda without CUDA, naming ``where``.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(name, str | torch.device):  # torch.device(5) is an accelerator's index, not a name
        raise ConfigError(f"{where}: {shown(name)} is not a device; use auto, cpu, cuda or cuda:N")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"{where}: {shown(str(name))} is not a device; use auto, cpu, cuda or cuda:N") from None
    if types is not None and device.type not in types:
        raise ConfigError(f"{where}: {shown(str(name))} is not supported; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{where}: '{name}' requested but CUDA is not available; use auto or cpu")
    return device


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The GPU a rank of several trains on: ``cuda:LOCAL_RANK``, one GPU each, also where ``trainer.device`` names
    one (``cuda:1``), which would put every rank on it; that index is named once (rank zero), not dropped unsaid."""
    if device.index is not None:
        rank_zero_warn(
            f"trainer.device={device} is not used: under torchrun each rank trains on cuda:LOCAL_RANK (cuda:0 on local "
            f"rank 0, cuda:1 on local rank 1, ...); set trainer.device=cuda (or auto), and choose the GPUs with "
            "CUDA_VISIBLE_DEVICES"
        )
    return torch.device("cuda", local_rank)
