"""The dtypes the ops take, and the one they compute and accumulate in."""

from __future__ import annotations

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)
"""The 16-bit floats: parameters that get float32 master weights and may take float32 gradients or moments."""

KERNEL_DTYPES = (*HALF_DTYPES, torch.float32, torch.float64)
"""Every dtype the kernels and their pure-PyTorch references read and write."""


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 data, float32 for everything narrower (float32, float16, bfloat16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
