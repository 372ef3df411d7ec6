"""The attributes Apex's optimizer wrappers (both ``FP16_Optimizer``s) promoted from the optimizer they wrap."""

from __future__ import annotations

from typing import Any

import torch


class PromotedOptimizerAttributes:
    """``state`` and ``param_groups`` of the wrapped ``self.optimizer``, readable and settable on the wrapper, so
    that code setting a learning rate in ``wrapper.param_groups`` reaches the optimizer, as with Apex."""

    optimizer: torch.optim.Optimizer

    @property
    def state(self) -> Any:
        """The wrapped optimizer's ``state`` (keyed by the fp32 masters; settable)."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's ``param_groups``, which hold the fp32 masters (settable)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value
