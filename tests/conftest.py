"""Make ``tests/`` importable so tests share small trainers from ``tests/toy_trainers.py``."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("CI", "true")  # progress bars stay quiet in tests
