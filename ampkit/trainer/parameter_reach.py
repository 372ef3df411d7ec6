"""Which trainable parameters training reaches: those no optimizer holds that get gradients anyway, and those an
optimizer holds that no loss reaches. Both never train, without a word, so they are named once per fit.

They are judged over a window, not at the first step: a mixture of experts, a head on some batches only or a
layer of a curriculum leaves parameters without a gradient at any one step, and an EMA copy, a teacher or a
module frozen in a hook after ``configure_optimizers`` holds parameters that require grad, are in no optimizer,
and never get one. The window is this fit's first epoch, or its first ``WINDOW_STEPS`` steps if sooner."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ampkit.trainer.optimizers import OptimizerSpec, unoptimized_parameters_warning, unreached_parameters_warning

WINDOW_STEPS = 100  # long enough for every expert of a routed layer to see a token; short for a long epoch


class ParameterReach:
    """Follows, from set-up to the end of the window, the model's trainable parameters no optimizer holds, and the
    parameters each optimizer holds that had no gradient at its steps; :meth:`at_step` is called at each step that
    has gradients, :meth:`finish` at the window's end. ``watching`` is False once the window closed."""

    def __init__(self, specs: list[OptimizerSpec], module: torch.nn.Module) -> None:
        self._module = module
        self._optimizers = [spec.optimizer for spec in specs]
        held = _held(self._optimizers)
        self._unheld = [(name, p) for name, p in module.named_parameters() if p.requires_grad and id(p) not in held]
        self._unreached: dict[torch.optim.Optimizer, tuple[str, list[torch.Tensor]]] = {}
        self._steps: dict[torch.optim.Optimizer, int] = {}
        self._masters: dict[torch.optim.Optimizer, Any] = {}  # O2's MasterWeights of each optimizer that stepped
        self.watching = True

    def at_step(self, optimizer: torch.optim.Optimizer, name: str, masters: Any = None) -> list[str]:
        """Note which of ``optimizer``'s parameters lack a gradient now (at its first step: all of them; later: those
        that lacked one so far). Returns the warnings due when this step closes the window."""
        first = optimizer not in self._steps
        self._steps[optimizer] = steps = self._steps.get(optimizer, 0) + 1
        self._masters[optimizer] = masters
        if first:
            params = (p for group in optimizer.param_groups for p in group["params"])
            left = [p for p in params if p.requires_grad and p.grad is None]
        else:
            left = [p for p in self._unreached.pop(optimizer, (name, []))[1] if p.grad is None]
        if left:
            self._unreached[optimizer] = (name, left)
        return self.finish() if steps >= WINDOW_STEPS else []

    def finish(self, masters: Iterable[Any] = ()) -> list[str]:
        """The warnings for what the window found, once: parameters no optimizer holds that got a gradient, then
        each optimizer's parameters that never got one while it stepped. ``masters``: O2's MasterWeights, whose
        model parameters their optimizers hold through fp32 copies."""
        if not self.watching:
            return []
        self.watching = False
        held = _held(self._optimizers, [*masters, *self._masters.values()])  # add_param_group since set-up counts
        reached = [(n, p) for n, p in self._unheld if p.requires_grad and p.grad is not None and id(p) not in held]
        found = [why] if (why := unoptimized_parameters_warning(reached)) else []
        for optimizer, (name, left) in self._unreached.items():
            left = [p for p in left if p.requires_grad]  # frozen since: a decision, not a mistake
            steps, weights = self._steps[optimizer], self._masters[optimizer]
            if why := unreached_parameters_warning(left, name, steps, self._module, weights):
                found.append(why)
        self._unheld, self._unreached = [], {}
        return found


def _held(optimizers: list[torch.optim.Optimizer], masters: Iterable[Any] = ()) -> set[int]:
    """The ids of the parameters ``optimizers`` hold, and of the model parameters behind O2's fp32 copies."""
    held = {id(p) for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}
    held.update(id(p) for weights in masters if weights is not None for p in weights.model_params)
    return held
