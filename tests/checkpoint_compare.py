"""Every key of two checkpoints compared, tensors bit for bit (RNG states included)."""

from __future__ import annotations

from typing import Any

import torch

# What legitimately differs between two runs of one training: where they were written, and when (the TensorBoard
# events of the checkpoint's step carry their wall times and steps/s).
RUN_SPECIFIC = {("config", "run_dir"), ("callbacks", "TensorBoardLogger", "step_events")}
# Which throughput figures a run logged depends on where it was cut: a resume starts a new window, its first
# iteration left out as warm-up, so a run resumed near its end may log none where the uninterrupted one did.
TIMING_TAGS = {("curve_kind",): "perf/"}


def differences(a: Any, b: Any, path: tuple[Any, ...] = ()) -> list[str]:
    """Where ``a`` and ``b`` differ, as dotted paths (empty when every key and value matches)."""
    if path in RUN_SPECIFIC:
        return []
    where = ".".join(map(str, path)) or "<root>"
    if path in TIMING_TAGS and isinstance(a, dict) and isinstance(b, dict):
        a, b = ({k: v for k, v in d.items() if not str(k).startswith(TIMING_TAGS[path])} for d in (a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys differ ({sorted(map(str, a.keys() ^ b.keys()))})"]
        return [d for key in a for d in differences(a[key], b[key], (*path, key))]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{where}: lengths differ ({len(a)} vs {len(b)})"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, (*path, i))]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [f"{where}: tensors differ"]
    return [] if type(a) is type(b) and a == b else [f"{where}: {a!r} != {b!r}"]


def assert_same_checkpoint(a: dict[str, Any], b: dict[str, Any]) -> None:
    found = differences(a, b)
    assert not found, "; ".join(found[:10])
