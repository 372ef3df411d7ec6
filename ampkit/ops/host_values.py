"""Device values read on the host in one transfer: one synchronization on CUDA however many are read, where reading
each (``item()``, ``float()``, ``bool()``) synchronized once apiece.

CPU values are read where they are. The others are put in one tensor on the first one's device, in their own dtype
where they share it, else as float64, which holds every float32, float16, bfloat16 and int32 value exactly, and copied
to the host together.
"""

from __future__ import annotations

from collections.abc import Iterable
from numbers import Number

import torch
from torch import Tensor


def host_numbers(values: Iterable[Tensor | Number | None]) -> list[Number | None]:
    """``values`` (numbers, one-element tensors or None) as Python numbers: a number or None as it is, a tensor as its
    ``item()`` would be (an int of an integer tensor, a bool of a bool one, else a float) wherever it lives, so a step
    count stays an int on a GPU as on the CPU."""
    numbers = list(values)
    on_cpu: list[int] = []
    on_device: list[int] = []
    for i, value in enumerate(numbers):
        if isinstance(value, Tensor):
            (on_cpu if value.is_cpu else on_device).append(i)
    for i, number in zip(on_cpu, _read_cpu_scalars([numbers[i] for i in on_cpu]), strict=True):
        numbers[i] = number
    if on_device:
        tensors = [numbers[i] for i in on_device]
        if any(t.numel() != 1 for t in tensors):
            raise ValueError(f"host_numbers reads one-element tensors; got shapes {[list(t.shape) for t in tensors]}")
        for i, tensor, number in zip(on_device, tensors, _gathered(tensors).tolist(), strict=True):
            numbers[i] = _as_item(number, tensor.dtype)
    return numbers


def host_vectors(values: Iterable[Tensor | Number]) -> list[Tensor]:
    """``values`` (numbers, or tensors of any size) as flat float64 CPU tensors, those on a device copied in one
    transfer. A float64 CPU tensor comes back as a view of itself: read it, do not write it."""
    values = list(values)
    on_device = [v.detach() for v in values if isinstance(v, Tensor) and not v.is_cpu]
    copied = iter(())
    if on_device:
        flat = _gathered(on_device).cpu().double()
        copied = iter(flat.split([t.numel() for t in on_device]))
    host = []
    for value in values:
        if isinstance(value, Tensor) and not value.is_cpu:
            host.append(next(copied))
        elif isinstance(value, Tensor):
            host.append(value.detach().reshape(-1).double())
        else:
            host.append(torch.tensor([value], dtype=torch.float64))
    return host


def _gathered(tensors: list[Tensor]) -> Tensor:
    """``tensors`` flattened into one tensor on the first one's device: in their dtype where they share it and the
    device, else as float64 (exact for every float32 and int32 value)."""
    device, dtype = tensors[0].device, tensors[0].dtype
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    if all(t.device == device and t.dtype == dtype for t in tensors):
        return torch.cat([t.reshape(-1) for t in tensors])
    return torch.cat([t.reshape(-1).to(device, torch.float64, non_blocking=True) for t in tensors])


def _read_cpu_scalars(tensors: list[Tensor]) -> list[Number]:
    """CPU scalars' values. Zero-dim ones of one dtype (a window of losses) are stacked and read in two torch calls
    however many there are: inside a training loop each torch call costs microseconds of dispatch, well above
    what a tight loop shows (ten losses: 0.3% of a tiny model's step)."""
    if len(tensors) > 2:
        dtype = tensors[0].dtype
        if all(t.dim() == 0 and t.dtype == dtype for t in tensors):
            return torch.stack(tensors).tolist()
    return [t.item() for t in tensors]


def _as_item(number: Number, dtype: torch.dtype) -> Number:
    """A value read through float64 as ``item()`` gives it for ``dtype``."""
    if dtype == torch.bool:
        return bool(number)
    return float(number) if dtype.is_floating_point else int(number)
