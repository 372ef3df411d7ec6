"""Every Apex API test starts and ends with amp uninitialized, as in a fresh process."""

import os
import sys

import pytest
import torch

from ampkit.compat import amp

sys.path.insert(0, os.path.dirname(__file__))  # apex_test_helpers (pytest runs in importlib mode)


@pytest.fixture(autouse=True)
def _fresh_amp_state():
    """Each test starts (and leaves) amp uninitialized, as a new process would."""
    amp._amp_state.reset()
    yield
    amp.initialize(torch.nn.Linear(1, 1), opt_level="O0", verbosity=0)  # undoes O1 function patches
    amp._amp_state.__init__()  # forgets the last O1 handle too, which a reset keeps (as Apex did)
