"""Make ``tests/`` importable so tests share small trainers from ``tests/toy_trainers.py``; mark the CUDA-only tests."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("CI", "true")  # progress bars stay quiet in tests


def pytest_collection_modifyitems(items):
    """Tests skipped without a CUDA GPU (a ``skipif`` whose reason names CUDA) get the ``cuda`` marker, so ``-k cuda``
    selects them whatever their names: ``.ci/gpu verify 1/2`` runs them first, ``2/2`` leaves them out."""
    for item in items:
        if any("CUDA" in str(mark.kwargs.get("reason", "")) for mark in item.iter_markers("skipif")):
            item.add_marker("cuda")
