"""Which trainable parameters training reaches: those no optimizer holds that get gradients anyway, and those an
optimizer holds that no loss reaches. Both never train, without a word, so they are named once per fit.

They are judged over a window, not at the first step: a mixture of experts, a head on some batches only or a
layer of a curriculum leaves parameters without a gradient at any one step, and an EMA copy, a teacher or a
module frozen in a hook after ``configure_optimizers`` holds parameters that require grad, are in no optimizer,
and never get one. The window is this fit's first epoch, or its first ``WINDOW_STEPS`` steps if sooner."""

from __future__ import annotations

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
        held = {id(p) for spec in specs for group in spec.optimizer.param_groups for p in group["params"]}
        self._unheld = [(name, p) for name, p in module.named_parameters() if p.requires_grad and id(p) not in held]
        self._unreached: dict[torch.optim.Optimizer, tuple[str, Any, list[torch.Tensor]]] = {}
        self._seen: set[torch.optim.Optimizer] = set()
        self._steps: dict[torch.optim.Optimizer, int] = {}
        self.watching = True

    def at_step(self, optimizer: torch.optim.Optimizer, name: str, masters: Any = None) -> list[str]:
        """Note which of ``optimizer``'s parameters lack a gradient now (at its first step: all of them; later: those
        that lacked one so far). Returns the warnings due when this step closes the window."""
        self._steps[optimizer] = steps = self._steps.get(optimizer, 0) + 1
        if optimizer not in self._seen:
            self._seen.add(optimizer)
            left = [
                p for group in optimizer.param_groups for p in group["params"] if p.requires_grad and p.grad is None
            ]
            if left:
                self._unreached[optimizer] = (name, masters, left)
        elif optimizer in self._unreached:
            name, masters, left = self._unreached[optimizer]
            left = [p for p in left if p.grad is None]
            if left:
                self._unreached[optimizer] = (name, masters, left)
            else:
                del self._unreached[optimizer]
        return self.finish() if steps >= WINDOW_STEPS else []

    def finish(self) -> list[str]:
        """The warnings for what the window found, once: parameters no optimizer holds that got a gradient, then
        each optimizer's parameters that never got one while it stepped."""
        if not self.watching:
            return []
        self.watching = False
        found = []
        reached = [(name, p) for name, p in self._unheld if p.requires_grad and p.grad is not None]
        if why := unoptimized_parameters_warning(reached):
            found.append(why)
        for optimizer, (name, masters, left) in self._unreached.items():
            left = [p for p in left if p.requires_grad]  # frozen since: a decision, not a mistake
            if why := unreached_parameters_warning(left, name, self._steps[optimizer], self._module, masters):
                found.append(why)
        self._unheld, self._unreached = [], {}
        return found
