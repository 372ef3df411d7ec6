"""Clipping never lets a non-finite norm reach the step, and reads the norm only when no inf check did the job."""

from __future__ import annotations

import pytest
import torch
from toy_trainers import NaNLossToyTrainer, toy_cfg

from ampkit import Callback

QUIET = {"checkpoint.enabled": False, "logging.tensorboard": False, "trainer.progress_bar": False}


class SkipRecorder(Callback):
    """Each skipped step with who decided it, and the weights around the NaN iteration."""

    def __init__(self, nan_at: int) -> None:
        self.nan_at = nan_at
        self.skips: list[tuple[int, list, bool]] = []
        self.before: dict[str, torch.Tensor] = {}
        self.after: dict[str, torch.Tensor] = {}

    def _weights(self, trainer) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}

    def on_train_batch_start(self, trainer, batch):
        if trainer.state.iteration == self.nan_at:
            self.before = self._weights(trainer)

    def on_optimizer_step_skipped(self, trainer, optimizer, loss_ids):
        nonfinite_norm = trainer.optimizer_state[optimizer].grad_norm_nonfinite
        self.skips.append((trainer.state.iteration, loss_ids, nonfinite_norm))

    def on_train_batch_end(self, trainer, outputs, batch):
        if trainer.state.iteration == self.nan_at:
            self.after = self._weights(trainer)


@pytest.mark.parametrize(
    ("precision", "expected_skip"),
    [
        ({}, (6, [], True)),  # fp32: no inf check, so clipping reads the norm and reports it non-finite
        # bf16 checks nothing by default, so clipping reads the norm as in fp32; skip_nonfinite's check decides
        ({"precision.opt_level": "O1", "precision.dtype": "bfloat16"}, (6, [], True)),
        (
            {"precision.opt_level": "O1", "precision.dtype": "bfloat16", "precision.skip_nonfinite": True},
            (6, [0], False),
        ),
        # the loss scaler's check (a scale the toy model does not overflow at)
        ({"precision.opt_level": "O1", "precision.dtype": "float16", "precision.init_scale": 256}, (6, [0], False)),
    ],
)
def test_a_nan_iteration_is_skipped_and_the_check_decides_when_there_is_one(tmp_path, precision, expected_skip):
    recorder = SkipRecorder(nan_at=NaNLossToyTrainer.nan_at)
    overrides = {**QUIET, **precision, "trainer.clip_grad_norm": 0.5, "trainer.max_steps": 8}
    trainer = NaNLossToyTrainer(toy_cfg(tmp_path, **overrides), callbacks=[recorder])
    trainer.fit()
    assert recorder.skips == [expected_skip]
    assert all(torch.equal(recorder.before[k], recorder.after[k]) for k in recorder.before)  # nothing applied
    assert trainer.state.global_step == 8
    assert all(v.isfinite().all() for v in trainer.module.state_dict().values() if v.is_floating_point())
