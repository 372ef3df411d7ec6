"""Seeding and capture/restore of every RNG the loop consumes, in checkpoint-safe containers."""

from __future__ import annotations

import random
from typing import Any

import torch
from lightning_utilities.core.imports import RequirementCache

from ampkit.wording import counted

_NUMPY = RequirementCache("numpy")


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's (if installed) and torch's generators."""
    random.seed(seed)
    if _NUMPY:
        import numpy as np

        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng() -> dict[str, Any]:
    """RNG states as tensors and plain containers, so ``torch.load(weights_only=True)`` reads them."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "torch": torch.get_rng_state(),
    }
    if _NUMPY:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
        state["cuda_device"] = torch.cuda.current_device()  # the one this process draws on (a rank's own GPU)
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state and _NUMPY:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    # One state per device the saving process had: a machine with fewer (8 GPUs resumed on 1, a GPU run resumed on a
    # CPU) restores those that fit, as set_rng_state_all would fail past its last device (when CUDA starts, if later).
    for device, device_state in enumerate(state.get("cuda", ())[: _cuda_devices()]):
        torch.cuda.set_rng_state(device_state, device)
    # The saving process's own device's state goes to this process's own device: a checkpoint is rank zero's, whose
    # state of GPU r is untouched since seeding, while rank r drew on its GPU r as rank zero did on its own.
    saver = state.get("cuda_device")
    if saver is not None and saver < len(state["cuda"]) and _cuda_devices():
        torch.cuda.set_rng_state(state["cuda"][saver], "cuda")  # the current device, when CUDA starts if later


def capture_callers_rng() -> dict[str, Any]:
    """The RNG states of the code calling a seeded run, for :func:`restore_callers_rng` as the run ends, and the seed
    torch's CUDA generators start from (CUDA may start during the run)."""
    state = capture_rng()
    state["initial_seed"] = torch.initial_seed()
    return state


def restore_callers_rng(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_callers_rng` captured: the run's seeding and draws do not reach the caller's
    generators (a sweep drawing each trial's settings from ``random`` got the same ones after every fit). CUDA that
    started during the run gets the generators it would have started with."""
    restore_rng(state)
    if "cuda" not in state and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(state["initial_seed"])


def rng_not_restored(state: dict[str, Any]) -> str | None:
    """What :func:`restore_rng` leaves out of ``state`` on this machine, as a clause for a warning; None if nothing:
    the CUDA states of devices it lacks."""
    saved, here = len(state.get("cuda", ())), _cuda_devices()
    if saved <= here:
        return None
    has = "no CUDA device" if here == 0 else counted(here, "CUDA device")
    left = f"device {here}'s is" if saved - here == 1 else f"those of devices {here}-{saved - 1} are"
    return (
        f"it holds the CUDA RNG states of {counted(saved, 'device')} and this machine has {has}: {left} not "
        "restored (random draws there would differ from the run it continues)"
    )


def _cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
