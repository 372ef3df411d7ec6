"""The torch modes of the code that calls ``fit()``, which a run's training must not inherit: a grad mode that
is off, and an autocast of the caller's around it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from omegaconf import DictConfig

from ampkit.trainer.user_code import UserCodeError


@contextmanager
def grad_mode_for_training() -> Iterator[None]:
    """Autograd on while a fit runs, whatever mode its caller is in: called under ``torch.no_grad()`` or
    ``torch.inference_mode()`` (an evaluation function's decorator, a notebook cell), every loss had no graph and the
    run failed at its first backward. Its validation still runs without gradients."""
    with torch.inference_mode(False), torch.enable_grad():
        yield


def refuse_outer_autocast(cfg: DictConfig, device: torch.device) -> None:
    """Refuse a fit called inside a ``torch.autocast`` block: it would cast every forward, backward and validation
    of the run to its dtype, whatever ``precision`` says (O0's float32, O2's half weights with float32 masters)."""
    for device_type in dict.fromkeys(("cpu", "cuda", device.type)):
        if not torch.is_autocast_enabled(device_type):
            continue
        dtype = str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")
        precision = f"precision.opt_level={cfg.precision.opt_level}"
        if cfg.precision.dtype is not None:
            precision += f" precision.dtype={cfg.precision.dtype}"
        raise UserCodeError(
            f"fit() was called inside torch.autocast(device_type='{device_type}', dtype=torch.{dtype}), which would "
            f"cast every forward and backward of the run to {dtype} whatever its config says ({precision}); call "
            f"fit() outside the autocast block, and set precision.opt_level=O1 precision.dtype={dtype} to train "
            "under autocast"
        )
