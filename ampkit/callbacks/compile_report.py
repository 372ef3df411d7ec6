"""What ``trainer.compile`` cost and whether it compiled anything, said once after the first iteration, and each
frame dynamo gave up recompiling (its recompile limit) during the fit, said when it happens."""

from __future__ import annotations

import logging
import re
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


_LIMIT_GB_TYPE = "Dynamo recompile limit exceeded"  # dynamo's graph-break type for it, a key of its counters


def _limit_hits_counted() -> int:
    """How many times dynamo's counters say a frame reached a recompile limit (logged or not)."""
    from torch._dynamo.utils import counters

    return sum(n for reason, n in counters["unimplemented"].items() if reason.startswith(_LIMIT_GB_TYPE))


class _RecompileLimitHits(logging.Handler):
    """Keeps dynamo's "hit config.recompile_limit" warnings as they are logged: past the limit dynamo compiles that
    frame no more and runs it eagerly for any input its cached graphs' guards refuse, which its counters record
    without naming the frame. Attached to dynamo's own logger for one fit."""

    logger_name = "torch._dynamo.convert_frame"

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hits: list[tuple[str, str, str]] = []  # (config key, limit, frame), unreported ones
        self.heard = 0
        self.last_reason: dict[tuple[str, str, str], str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("torch._dynamo hit config."):
            return
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) >= 4:  # (limit's config key, its value, "'name' (file:line)", the guard that failed last, ...)
            key, limit, frame, reason = (str(a) for a in args[:4])
        else:  # another torch's wording: its first line, and no frame
            key, limit, frame, reason = "recompile_limit", "?", record.getMessage().splitlines()[0], ""
        self.heard += 1
        hit = (key, limit, frame)
        if hit not in self.last_reason:
            self.hits.append(hit)
        self.last_reason[hit] = _guard_of(reason)

    def listen(self) -> _RecompileLimitHits:
        logging.getLogger(self.logger_name).addHandler(self)
        return self

    def stop(self) -> None:
        logging.getLogger(self.logger_name).removeHandler(self)


def _guard_of(reason: str) -> str:
    """The guard in dynamo's "last reason" (``0/1: self.temperature == 1.0   # return ... # file:line in forward``,
    then its stack), without the compile id and the source line it quotes."""
    first = reason.strip().splitlines()[0] if reason.strip() else ""
    return re.sub(r"^\d+/\d+: ", "", first.split("  #")[0]).strip()


class CompileReport(Callback):
    """Prints the first training iteration's wall time (where compilation happens) and the graphs compiled then
    (0 when they came from the cache of an earlier compile in this process); warns when training code called
    none of the compiled callables in that iteration, which means ``trainer.compile`` did nothing, and when it
    called them but dynamo compiled no graph of them (it looked at the code and left it eager, unlike a cache hit).

    Everything is counted from ``on_train_start``: the sanity validation before it calls the whole model, so
    it would show compiled code running even when training code bypasses it.

    From ``on_fit_start`` to ``on_fit_end`` it also warns of each frame that reached dynamo's recompile limit
    (a changing shape or Python value in a guard, recompiled once per value until the limit): from then on that
    frame runs eagerly for new inputs, and nothing else would say why the steps slowed down.
    """

    phase = Phase.OBSERVE

    def __init__(self) -> None:
        self._start: float | None = None
        self._counts = _DynamoCounts(0, 0, {})
        self._called = False
        self._hooks: list[Any] = []
        self._limits: _RecompileLimitHits | None = None
        self._limits_counted = 0

    def on_fit_start(self, trainer) -> None:
        self._limits = _RecompileLimitHits().listen()
        self._limits_counted = _limit_hits_counted()

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
        if self._limits is not None and self._limits.hits:
            self._say_limit_hits(trainer)
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

    def on_validation_end(self, trainer, metrics: dict[str, float]) -> None:
        if self._limits is not None and self._limits.hits:
            self._say_limit_hits(trainer)

    def on_fit_end(self, trainer) -> None:
        self._remove_hooks()  # a run that stopped before its first iteration ended
        if self._limits is None:
            return
        self._say_limit_hits(trainer)
        self._limits.stop()
        unheard = _limit_hits_counted() - self._limits_counted - self._limits.heard
        self._limits = None
        if unheard > 0:  # dynamo's warnings were silenced (its log level): its counters still count each hit
            from torch._dynamo import config

            key = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # older torch
            rank_zero_warn(
                f"config key 'trainer.compile'={_shown(trainer.cfg.trainer.compile)}: dynamo reached its recompile "
                f"limit (torch._dynamo.config.{key} = {getattr(config, key, '?')}) "
                f"{counted(unheard, 'time')} in this fit, so code it gave up on ran eagerly; {_LIMIT_CAUSE}; "
                'TORCH_LOGS="recompiles" names the frames and guards'
            )

    def _say_limit_hits(self, trainer) -> None:
        """Warn once per frame that reached a recompile limit since the last call."""
        hits, self._limits.hits = self._limits.hits, []
        for key, limit, frame in hits:
            guard = self._limits.last_reason.get((key, limit, frame), "")
            failed = f" (the guard that failed last: {guard})" if guard else ""
            rank_zero_warn(
                f"config key 'trainer.compile'={_shown(trainer.cfg.trainer.compile)}: dynamo reached "
                f"torch._dynamo.config.{key} = {limit} recompiling {frame}{failed}, so that frame now runs eagerly "
                f"for every input its cached graphs do not fit; {_LIMIT_CAUSE}"
            )


_LIMIT_CAUSE = (
    "the usual cause is a shape or a Python value (an int, a flag, a string) that changes between calls and is "
    "guarded, each new value compiling again: keep it fixed (pad the batches, drop_last), pass it as a tensor, "
    "mark the dimension dynamic (torch._dynamo.mark_dynamic), or raise the limit if the values are few"
)


def _shown(setting: Any) -> str:
    from omegaconf import ListConfig, OmegaConf

    if isinstance(setting, bool):
        return str(setting).lower()
    return str(OmegaConf.to_container(setting) if isinstance(setting, ListConfig) else setting)
