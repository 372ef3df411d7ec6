"""``apex.contrib.clip_grad``: Apex's ``clip_grad_norm_``, which NVIDIA's MoFlow imports unconditionally.

Apex documented it as identical to ``torch.nn.utils.clip_grad_norm_`` (its CUDA fast path only fused the 2-norm
and the scaling), and off CUDA it called torch's; here it is torch's on every device.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale the gradients in place so that their total ``norm_type`` norm is at most ``max_norm``; return it."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [p for p in parameters if p.grad is not None]
    if not parameters:
        return torch.tensor(0.0)  # Apex's answer, before torch's own empty case
    return torch.nn.utils.clip_grad_norm_(
        parameters, float(max_norm), norm_type=float(norm_type), error_if_nonfinite=error_if_nonfinite
    )
