"""What ampkit does when the console is gone mid-run: a closed pipe (``| head`` exited, the ``tee`` of a log killed),
a terminal that went away, a full disk under a redirected log.

The console is for a person watching; a run's record is its checkpoints and TensorBoard events. So a console write
that fails stops that output for the rest of the run, said once (a warning, on stderr where that still works), and
the run goes on, as Python's ``logging`` goes on when a handler cannot write (torchtitan logs through it). Raising
instead would end a week-long run for a closed pipe, and under torchrun end rank zero alone, the one that writes.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import TextIO

_gone: weakref.WeakSet[TextIO] = weakref.WeakSet()  # streams a write to failed: written to no more in this process


def say(text: str, stream: TextIO | None = None) -> None:
    """Print ``text`` to ``stream`` (stderr by default, where ampkit's notices go), unless that console is gone."""
    stream = sys.stderr if stream is None else stream
    if stream in _gone:
        return
    try:
        print(text, file=stream, flush=True)
    except OSError as exc:
        console_gone(exc, stream)


def say_above_the_bars(text: str) -> None:
    """Print ``text`` to stdout above the progress bars (``tqdm.write``), unless that console is gone."""
    from tqdm.auto import tqdm

    if sys.stdout in _gone:
        return
    try:
        tqdm.write(text, file=sys.stdout)
    except OSError as exc:
        console_gone(exc, sys.stdout)


def console_gone(exc: OSError, stream: TextIO | None = None) -> None:
    """Say that writing to ``stream`` failed with ``exc`` (``stream`` None: one the caller no longer writes to, as a
    progress bar that turned itself off), once per stream: :func:`say` writes to it no more, and the run goes on."""
    if stream is not None:
        if stream in _gone:
            return
        try:
            _gone.add(stream)
        except TypeError:  # a stream that takes no weak reference: written to again, and said again
            pass
    name = getattr(stream, "name", None)
    where = f"the console ({name})" if isinstance(name, str) else "the console"
    warnings.warn(  # rank zero's, the one process that writes to the console
        f"cannot write to {where}: {exc.strerror or exc}; ampkit writes no more progress or notices there, and the "
        "run goes on: its checkpoints and TensorBoard events are its record (run under nohup or "
        "redirect the output to a file to keep it)",
        stacklevel=2,
    )
