"""The CNN example: batch norm kept fp32 under O2 float16, channels_last kept through the cast, >= 95% in 3 epochs."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ampkit.config import load_config

REPO = Path(__file__).resolve().parents[2]


def test_digits_cnn_o2_channels_last_reaches_95_percent(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # trainer_class: examples.digits_cnn:DigitsCnnTrainer
    overrides = [f"run_dir={tmp_path}", "trainer.max_epochs=3", "trainer.device=cpu", "logging.tensorboard=false"]
    trainer_class, cfg = load_config(REPO / "configs" / "digits_cnn.yaml", overrides)
    trainer = trainer_class(cfg)
    trainer.fit()
    assert trainer.val_metrics["acc"] >= 0.95, trainer.val_metrics
    convs = [m for m in trainer.module.modules() if isinstance(m, nn.Conv2d)]
    norms = [m for m in trainer.module.modules() if isinstance(m, nn.BatchNorm2d)]
    assert {m.weight.dtype for m in convs} == {torch.float16}
    assert {t.dtype for m in norms for t in (m.weight, m.running_mean, m.running_var)} == {torch.float32}
    assert all(m.weight.is_contiguous(memory_format=torch.channels_last) for m in convs)
    masters = trainer.optimizer_state[trainer.optimizer].master_weights.master_params
    assert masters and {p.dtype for p in masters} == {torch.float32}
