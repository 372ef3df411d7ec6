"""A tqdm progress bar per epoch; quiet when stderr is not a terminal or under CI."""

from __future__ import annotations

import os
import sys

from ampkit.trainer.callback import Callback, Phase


def _interactive() -> bool:
    return sys.stderr.isatty() and not os.environ.get("CI")


class ProgressBar(Callback):
    """Shows batches of the current epoch and the latest loss; prints nothing when not interactive."""

    phase = Phase.OBSERVE

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = _interactive() if enabled is None else enabled
        self._bar = None

    def on_train_epoch_start(self, trainer) -> None:
        if not (self.enabled and trainer.is_global_zero):
            return
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=trainer._num_train_batches,
            initial=trainer.state.batches_done,
            desc=f"epoch {trainer.state.epoch}",
            dynamic_ncols=True,
            leave=False,
        )

    def on_train_batch_end(self, trainer, outputs, batch) -> None:
        if self._bar is None:
            return
        self._bar.update(1)
        if trainer.state.is_iteration_end and "loss" in outputs:
            self._bar.set_postfix(loss=f"{float(outputs['loss']):.4f}", refresh=False)

    def on_train_epoch_end(self, trainer) -> None:
        self._close()
        if self.enabled and trainer.is_global_zero and trainer.val_metrics:
            shown = ", ".join(f"{k}={v:.4f}" for k, v in trainer.val_metrics.items())
            print(f"epoch {trainer.state.epoch}: {shown}", file=sys.stderr)

    def on_fit_end(self, trainer) -> None:
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
