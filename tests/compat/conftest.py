"""Shared fixtures for the Apex API tests: a silent amp and small deterministic models."""

import pytest
import torch

from ampkit.compat import amp


@pytest.fixture(autouse=True)
def _fresh_amp_state():
    """Each test starts (and leaves) amp uninitialized, as a new process would."""
    amp._amp_state.reset()
    yield
    amp.initialize(torch.nn.Linear(1, 1), opt_level="O0", verbosity=0)
    amp._amp_state.reset()


def half_exact_linear(n_in: int, n_out: int, seed: int) -> torch.nn.Linear:
    """A Linear whose fp32 weights are exactly representable in fp16 (so casts lose nothing)."""
    torch.manual_seed(seed)
    layer = torch.nn.Linear(n_in, n_out)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(p.half().float())
    return layer
