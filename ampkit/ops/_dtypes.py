"""The dtype the ops compute and accumulate in."""

from __future__ import annotations

import torch


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 data, float32 for everything narrower (float32, float16, bfloat16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
