"""Whether autograd Functions written with ``ctx`` can run: not under a trace, ``torch.compile``, a ``torch.func``
transform or forward-mode AD, which need torch ops they can see through."""

from __future__ import annotations

import torch
from torch.autograd import forward_ad


def transforms_active() -> bool:
    """Whether a trace, a ``torch.compile``, a ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``) or forward-mode
    AD (``forward_ad.dual_level``) is running: a Function with ``ctx`` has no batching rule or jvp there and is opaque
    to dynamo, so the same maths must run as the torch ops it stands for."""
    if torch.jit.is_tracing() or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return True
    return forward_ad._current_level >= 0
