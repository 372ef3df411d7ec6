"""Seeding and capture/restore of every RNG the loop consumes, in checkpoint-safe containers."""

from __future__ import annotations

import random
from typing import Any

import torch
from lightning_utilities.core.imports import RequirementCache

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
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
