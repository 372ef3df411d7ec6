"""O1's casts of ``torch.Tensor`` methods (Apex's ``apex/amp/lists/tensor_overrides.py``): Apex's own entries, then
every ``torch_overrides`` entry that is also a method, taken when this module is imported (as Apex did).

``cpu`` is cast to float32 only for a tensor that is not on the CPU already ("before transfer to CPU")."""

import torch

from ampkit.compat.amp.lists import torch_overrides

MODULE = torch.Tensor


def _methods(names: list[str]) -> list[str]:
    return [name for name in names if hasattr(MODULE, name)]


FP16_FUNCS = _methods(["__matmul__", *torch_overrides.FP16_FUNCS])

FP32_FUNCS = _methods(["__ipow__", "__pow__", "__rpow__", "cpu", *torch_overrides.FP32_FUNCS])

CASTS = _methods([
    "__add__", "__div__", "__eq__", "__ge__", "__gt__", "__iadd__", "__idiv__", "__imul__", "__isub__",
    "__itruediv__", "__le__", "__lt__", "__mul__", "__ne__", "__radd__", "__rdiv__", "__rmul__", "__rsub__",
    "__rtruediv__", "__sub__", "__truediv__", *torch_overrides.CASTS,
])  # fmt: skip

SEQUENCE_CASTS = _methods(torch_overrides.SEQUENCE_CASTS)
