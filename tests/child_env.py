"""The environment of a test's subprocess: folders put first on PYTHONPATH, the caller's PYTHONPATH kept.

Replacing PYTHONPATH would hide packages that the test process itself finds through it (a
``--target`` install, a source checkout), so the child could not import what the parent can.
"""

from __future__ import annotations

import os
from pathlib import Path


def child_env(*paths: str | Path, **extra: str) -> dict[str, str]:
    """``os.environ`` with ``paths`` prepended to PYTHONPATH and ``extra`` variables set."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, paths), *inherited]), **extra}
