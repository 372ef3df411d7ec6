"""The Trainer's parameters after N steps equal a plain PyTorch loop's exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hand_loop import hand_loop

from examples.digits import DigitsTrainer

REPO = Path(__file__).resolve().parents[1]


def _trainer(tmp_path, **trainer_overrides) -> DigitsTrainer:
    cfg = {
        "trainer_class": "examples.digits:DigitsTrainer",
        "run_dir": str(tmp_path),
        # the hand loop runs on the CPU: on a machine with a GPU, device auto would put the Trainer there
        "trainer": {"val_every_n_epochs": 0, "max_epochs": 100, "device": "cpu", **trainer_overrides},
        "logging": {"tensorboard": False},
        "checkpoint": {"enabled": False},
    }
    return DigitsTrainer(cfg)


@pytest.mark.parametrize(
    ("steps", "accumulate", "clip"),
    [(60, 1, None), (70, 3, None), (50, 1, 0.5)],  # 60 and 70 cross an epoch boundary (45 batches/epoch)
)
def test_trainer_equals_hand_loop_bit_for_bit(tmp_path, steps, accumulate, clip):
    trainer = _trainer(tmp_path, max_steps=steps, accumulate_grad_batches=accumulate, clip_grad_norm=clip)
    trainer.fit()
    reference = hand_loop(steps, accumulate=accumulate, clip=clip)
    assert trainer.state.global_step == steps
    for (name, a), b in zip(trainer.module.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
