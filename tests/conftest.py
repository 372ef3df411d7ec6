"""Make ``tests/`` importable so tests share small trainers from ``tests/toy_trainers.py``; mark the CUDA-only tests."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("CI", "true")  # progress bars stay quiet in tests
# Set before torch loads OpenMP (nothing has imported torch yet), and inherited by every child process. OpenMP's
# threads otherwise spin after each parallel region; with another job on CI's 2 cores, a rank's or the suite's next
# region then waits for a thread the spinning ones crowd out, and a fused optimizer step on a few small tensors took
# 2-27 ms instead of 0.1 (ops/test_fused_backend.py ran 120 s instead of 5). Sleeping threads compute the same
# numbers: the thread count and each thread's share of the work are unchanged.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_collection_modifyitems(items):
    """Tests skipped without a CUDA GPU (a ``skipif`` whose reason names CUDA) get the ``cuda`` marker, so ``-k cuda``
    selects them whatever their names: ``.ci/gpu verify 1/2`` runs them first, ``2/2`` leaves them out."""
    for item in items:
        if any("CUDA" in str(mark.kwargs.get("reason", "")) for mark in item.iter_markers("skipif")):
            item.add_marker("cuda")
