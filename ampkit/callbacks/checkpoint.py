"""Periodic checkpoints, written atomically (by rank zero; under FSDP every rank writes its shards)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ampkit.trainer.callback import Callback
from ampkit.trainer.checkpoint_io import link_atomic, save_atomic
from ampkit.trainer.sharded_checkpoint import point_last_at, prune_sharded, save_sharded


class ModelCheckpoint(Callback):
    """Save ``step-N.pt`` every ``every_n_steps`` iterations and ``epoch-N.pt`` every ``every_n_epochs``
    epochs, plus at the end of training; keep the newest ``keep_last`` of them and ``last.pt``.

    Runs after every other callback so it captures an iteration's final state (e.g. updated loss scales).
    A crash at any moment leaves the previous ``last.pt`` loadable: files are renamed into place.
    """

    after = ("*",)

    def __init__(self, every_n_steps: int = 0, every_n_epochs: int = 1, keep_last: int = 2) -> None:
        if every_n_steps < 0 or every_n_epochs < 0 or keep_last < 1:
            raise ValueError(
                f"ModelCheckpoint: every_n_steps ({every_n_steps}) and every_n_epochs ({every_n_epochs}) "
                f"must be >= 0 and keep_last ({keep_last}) >= 1"
            )
        self.every_n_steps = every_n_steps
        self.every_n_epochs = every_n_epochs
        self.keep_last = keep_last
        self._saved_at: dict[str, int] | None = None

    def on_fit_start(self, trainer) -> None:
        """Tidy up after a killed run: drop half-written temp files and files beyond ``keep_last``."""
        if not trainer.is_global_zero:  # other ranks have no run directory
            return
        directory = trainer.version_dir / "checkpoints"
        if not directory.is_dir():
            return
        for tmp in directory.glob(".*.tmp"):  # save_atomic's and link_atomic's, left by a kill before the rename
            if tmp.is_file():  # a sharded save's temp directory is the sharded writer's to clean
                tmp.unlink(missing_ok=True)
        self._prune(directory)

    def on_train_batch_end(self, trainer, outputs: dict[str, Any], batch: Any) -> None:
        s = trainer.state
        if s.is_iteration_end and self.every_n_steps > 0 and s.global_step % self.every_n_steps == 0:
            self.save(trainer, f"step-{s.global_step:08d}.pt")

    def on_train_epoch_end(self, trainer) -> None:
        s = trainer.state
        if s.epoch_finished and self.every_n_epochs > 0 and (s.epoch + 1) % self.every_n_epochs == 0:
            self.save(trainer, f"epoch-{s.epoch + 1:04d}.pt")

    def on_train_end(self, trainer) -> None:
        if self._saved_at != trainer.loop_position():
            self.save(trainer, f"step-{trainer.state.global_step:08d}.pt")

    def save(self, trainer, filename: str) -> Path | None:
        """Write a checkpoint named ``filename`` and point ``last.pt`` at it (rank zero only)."""
        checkpoint = trainer.checkpoint_dict()  # every rank assembles: hooks may need collectives
        self._saved_at = trainer.loop_position()
        if trainer.sharded:  # FSDP: every rank writes its shards into a directory named without ".pt"
            return self._save_sharded(trainer, checkpoint, Path(filename).stem)
        if not trainer.is_global_zero:
            return None
        directory = trainer.version_dir / "checkpoints"
        path = save_atomic(checkpoint, directory / filename)
        link_atomic(path, directory / "last.pt")
        self._prune(directory)
        return path

    def _prune(self, directory: Path) -> None:
        kept = sorted((p for p in directory.glob("*-*.pt")), key=lambda p: p.stat().st_mtime_ns)
        for old in kept[: -self.keep_last]:
            old.unlink(missing_ok=True)

    def _save_sharded(self, trainer, checkpoint: dict[str, Any], name: str) -> Path:
        directory = trainer.version_dir / "checkpoints"
        path = save_sharded(checkpoint, trainer.module, trainer.optimizers, directory / name, trainer.is_global_zero)
        if trainer.is_global_zero:
            point_last_at(path)
            prune_sharded(directory, self.keep_last)
        return path
