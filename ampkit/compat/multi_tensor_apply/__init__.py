"""``apex.multi_tensor_apply``: the ``multi_tensor_applier`` that calls ``amp_C`` ops (laid out as Apex's package)."""

from ampkit.compat.multi_tensor_apply.multi_tensor_apply import MultiTensorApply, multi_tensor_applier

__all__ = ["MultiTensorApply", "multi_tensor_applier"]
