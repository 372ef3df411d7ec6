"""What ``trainer.compile`` cost and whether it compiled anything, said once after the first iteration."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import nn

from ampkit.trainer.callback import Callback, Phase
from ampkit.trainer.console import say_above_the_bars
from ampkit.wording import counted


class _DynamoCounts(NamedTuple):
    """torch._dynamo's counters the report compares: graphs compiled, frames dynamo looked at (a frame served from
    its cache is not looked at again), and each reason it gave for leaving code to run eagerly."""

    graphs: int
    frames: int
    reasons: dict[str, int]


def _dynamo_counts() -> _DynamoCounts:
    from torch._dynamo.utils import counters

    reasons = {**counters["graph_break"], **counters["unimplemented"]}
    return _DynamoCounts(counters["stats"]["unique_graphs"], counters["frames"]["total"], reasons)


def _new_reason(before: _DynamoCounts, after: _DynamoCounts) -> str:
    """The first line of the first reason dynamo gave since ``before`` (its explanation follows on later lines)."""
    for reason, count in after.reasons.items():
        if count > before.reasons.get(reason, 0):
            return reason.strip().splitlines()[0]
    return "no reason recorded"


class CompileReport(Callback):
    """Prints the first training iteration's wall time (where compilation happens) and the graphs compiled then
    (0 when they came from the cache of an earlier compile in this process); warns when training code called
    none of the compiled callables in that iteration, which means ``trainer.compile`` did nothing, and when it
    called them but dynamo compiled no graph of them (it looked at the code and left it eager, unlike a cache hit).

    Everything is counted from ``on_train_start``: the sanity validation before it calls the whole model, so
    it would show compiled code running even when training code bypasses it.
    """

    phase = Phase.OBSERVE

    def __init__(self) -> None:
        self._start: float | None = None
        self._counts = _DynamoCounts(0, 0, {})
        self._called = False
        self._hooks: list[Any] = []

    def on_train_start(self, trainer) -> None:
        self._called = False
        setup = trainer.model_setup
        watched = setup.compiled_regions or [trainer.model]  # regional, or the compiled root (DDP over it when wrapped)
        self._hooks = [m.register_forward_pre_hook(self._ran) for m in watched if isinstance(m, nn.Module)]
        self._start, self._counts = time.perf_counter(), _dynamo_counts()

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
        counts = _dynamo_counts()
        graphs, looked_at = counts.graphs - self._counts.graphs, counts.frames - self._counts.frames
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
        elif not graphs and looked_at > 0:  # dynamo saw the compiled code run and left all of it to run eagerly
            rank_zero_warn(
                f"config key 'trainer.compile'={_shown(setting)}: compiled code ran in the first iteration but dynamo "
                f"compiled no graph of it ({_new_reason(self._counts, counts)}), so it ran eagerly; remove what "
                "stops it (a torch.compiler.disable, a recompile limit...) or set trainer.compile=false"
            )
        elif trainer.is_global_zero:
            cached = "" if graphs else " (none new: this process's cache had them, or dynamo's recompile limit was hit)"
            say_above_the_bars(f"ampkit: compiled {counted(graphs, 'graph')}{cached}; first iteration {took:.1f} s")

    def on_fit_end(self, trainer) -> None:
        self._remove_hooks()  # a run that stopped before its first iteration ended


def _shown(setting: Any) -> str:
    from omegaconf import ListConfig, OmegaConf

    if isinstance(setting, bool):
        return str(setting).lower()
    return str(OmegaConf.to_container(setting) if isinstance(setting, ListConfig) else setting)
