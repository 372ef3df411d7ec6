"""Apex's CUDA kernels computed in their inputs' dtype whatever autocast was on. The torch maths that stands in for
one runs with autocast off: a Function applied under autocast (or its ``forward`` called from another Function's, as
NVIDIA's DLRM does with ``MlpFunction``) gives what the kernel gave, and its backward finds the dtypes its forward
saved instead of failing on a low-precision gradient against float32 weights."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


def in_input_dtype(maths: Callable[..., Any]) -> Callable[..., Any]:
    """Run an autograd Function's ``forward(ctx, *args)`` or ``backward(ctx, *grads)`` with autocast off on the
    device of its first tensor argument."""

    @functools.wraps(maths)
    def run(ctx: Any, *args: Any) -> Any:
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), None)
        if device is None or not torch.amp.is_autocast_available(device) or not torch.is_autocast_enabled(device):
            return maths(ctx, *args)
        with torch.autocast(device, enabled=False):
            return maths(ctx, *args)

    return run
