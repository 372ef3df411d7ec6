"""What ``trainer.compile`` cost and whether it compiled anything, said once after the first iteration."""

from __future__ import annotations

import time
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import nn

from ampkit.trainer.callback import Callback, Phase
from ampkit.trainer.console import say_above_the_bars
from ampkit.wording import counted


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


class CompileReport(Callback):
    """Prints the first training iteration's wall time (where compilation happens) and the graphs compiled then
    (0 when they came from the cache of an earlier compile in this process); warns when training code called
    none of the compiled callables in that iteration, which means ``trainer.compile`` did nothing.

    Everything is counted from ``on_train_start``: the sanity validation before it calls the whole model, so
    it would show compiled code running even when training code bypasses it.
    """

    phase = Phase.OBSERVE

    def __init__(self) -> None:
        self._start: float | None = None
        self._graphs = 0
        self._called = False
        self._hooks: list[Any] = []

    def on_train_start(self, trainer) -> None:
        self._called = False
        setup = trainer.model_setup
        watched = setup.compiled_regions or [trainer.model]  # regional, or the compiled root (DDP over it when wrapped)
        self._hooks = [m.register_forward_pre_hook(self._ran) for m in watched if isinstance(m, nn.Module)]
        self._start, self._graphs = time.perf_counter(), _graphs_compiled()

    def _ran(self, *_: Any) -> None:
        """A compiled callable ran in training: the setting did something. The hooks go, so later calls cost
        nothing."""
        self._called = True
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def on_train_batch_end(self, trainer, outputs: dict[str, Any], batch: Any) -> None:
        if self._start is None or not trainer.state.is_iteration_end:
            return
        took, self._start = time.perf_counter() - self._start, None
        graphs = _graphs_compiled() - self._graphs
        self._remove_hooks()
        setting = trainer.cfg.trainer.compile
        if not self._called:
            fix = (
                "name the classes it calls (e.g. [Block])"
                if setting is not True
                else "call self.model in training_step, or compile the submodules it calls in place with "
                "trainer.compile=[BlockClass]"
            )
            rank_zero_warn(
                f"config key 'trainer.compile'={_shown(setting)}: training code called none of the compiled "
                f"modules in the first iteration, so nothing ran compiled; {fix}"
            )
        elif trainer.is_global_zero:
            say_above_the_bars(f"ampkit: compiled {counted(graphs, 'graph')}; first iteration {took:.1f} s")

    def on_fit_end(self, trainer) -> None:
        self._remove_hooks()  # a run that stopped before its first iteration ended


def _shown(setting: Any) -> str:
    from omegaconf import ListConfig, OmegaConf

    if isinstance(setting, bool):
        return str(setting).lower()
    return str(OmegaConf.to_container(setting) if isinstance(setting, ListConfig) else setting)
