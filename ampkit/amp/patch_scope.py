"""Where Apex's process-wide patches of torch's functions (``amp.init()``, ``amp.initialize(...,
patch_torch_functions=True)``) cast: in every thread but one running a Trainer, whose own config sets its precision.

Without this, an O0 fit in a process where an Apex script had patched torch (or did so from another thread while the
fit ran) ran its forward in float16, silently.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_here = threading.local()


@contextmanager
def without_torch_patches() -> Iterator[None]:
    """Apex's patched torch functions run as torch's own in this thread while the block runs."""
    depth = getattr(_here, "exempt", 0)
    _here.exempt = depth + 1
    try:
        yield
    finally:
        _here.exempt = depth


def torch_patches_cast() -> bool:
    """Whether Apex's patched torch functions cast in this thread (see :func:`without_torch_patches`)."""
    return not getattr(_here, "exempt", 0)
