"""What ``trainer.compile`` cost and whether it compiled anything, said once after the first iteration."""

from __future__ import annotations

import time
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_warn

from ampkit.trainer.callback import Callback, Phase


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


class CompileReport(Callback):
    """Prints the first iteration's wall time (where compilation happens) and the graphs compiled (0 when they
    came from the cache of an earlier compile in this process); warns when training code called none of the
    modules ``trainer.compile`` names, which means the setting did nothing."""

    phase = Phase.OBSERVE

    def __init__(self) -> None:
        self._start: float | None = None
        self._graphs = 0

    def on_train_start(self, trainer) -> None:
        self._start, self._graphs = time.perf_counter(), _graphs_compiled()

    def on_train_batch_end(self, trainer, outputs: dict[str, Any], batch: Any) -> None:
        if self._start is None or not trainer.state.is_iteration_end:
            return
        took, self._start = time.perf_counter() - self._start, None
        graphs = _graphs_compiled() - self._graphs
        setup = trainer.model_setup
        if trainer.cfg.trainer.compile is not True and not setup.regions_called:
            rank_zero_warn(
                f"trainer.compile={trainer.cfg.trainer.compile!s}: training code called none of these modules in "
                "the first iteration, so nothing ran compiled; name the classes it calls (e.g. [Block])"
            )
        elif trainer.is_global_zero:
            from tqdm.auto import tqdm

            tqdm.write(f"ampkit: compiled {graphs} graph{'s' * (graphs != 1)}; first iteration {took:.1f} s")
