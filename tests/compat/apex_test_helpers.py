"""Helpers shared by the Apex API tests."""

import torch


def half_exact_linear(n_in: int, n_out: int, seed: int) -> torch.nn.Linear:
    """A Linear whose fp32 weights are exactly representable in fp16 and bf16 (so casts lose nothing)."""
    torch.manual_seed(seed)
    layer = torch.nn.Linear(n_in, n_out)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(p.bfloat16().half().float())
    return layer
