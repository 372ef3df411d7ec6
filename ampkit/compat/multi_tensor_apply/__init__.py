"""``apex.multi_tensor_apply``: the ``multi_tensor_applier`` that calls ``amp_C`` ops (laid out as Apex's package)."""

from typing import Any

from ampkit.compat.multi_tensor_apply.multi_tensor_apply import MultiTensorApply, multi_tensor_applier
from ampkit.missing_name import missing_name

__all__ = ["MultiTensorApply", "multi_tensor_applier"]


def __getattr__(name: str) -> Any:
    raise missing_name(
        f"apex.multi_tensor_apply (ampkit.compat.multi_tensor_apply) has no attribute {name!r}; "
        f"it provides {', '.join(__all__)}",
        "apex.multi_tensor_apply",
        name,
    )
