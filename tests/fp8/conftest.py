"""Make ``tests/fp8/`` importable: its tests and the FSDP worker share ``fp8_trainers.py``."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
