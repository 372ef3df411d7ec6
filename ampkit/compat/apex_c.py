"""Apex's ``apex_C`` extension module: flattening a list of dense tensors into one buffer and back.

NVIDIA's BERT pretraining all-reduces the gradients through one flat buffer made with it. Apex wrapped
torch's own C++ helpers; these are torch's Python ones, which compute the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 1-D tensor holding ``tensors`` one after the other, on one device (mixed float dtypes are promoted, as
    ``torch.cat`` does)."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("apex_C.flatten: expected a non-empty list of tensors, got an empty one")
    return _flatten_dense_tensors(tensors)


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``tensors``, in order (writing them writes ``flat``)."""
    tensors = list(tensors)
    needed = sum(t.numel() for t in tensors)
    if flat.dim() != 1 or flat.numel() < needed:
        raise ValueError(
            f"apex_C.unflatten: flat must be 1-D with at least the tensors' {needed} elements, got shape "
            f"{list(flat.shape)}"
        )
    return list(_unflatten_dense_tensors(flat, tensors))
