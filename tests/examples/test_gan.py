"""The GAN example trains in O1 and O2 (fp16, CPU) with two loss scalers visible in TensorBoard."""

import math
from pathlib import Path

import pytest
import torch

from ampkit.config import load_config

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gan.yaml"


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_gan_example_two_loss_scalers(tmp_path, monkeypatch, opt_level):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # trainer_class: examples.gan:GanTrainer
    trainer_class, cfg = load_config(
        CONFIG,
        [
            f"run_dir={tmp_path}",
            f"precision.opt_level={opt_level}",
            "trainer.max_steps=8",
            "trainer.progress_bar=false",
            "trainer.device=cpu",
            "logging.log_every_n_steps=2",
            "model.hidden=32",
            "data.samples=2048",
            "precision.init_scale=1024",
            "precision.growth_interval=4",
            "samples.every_n_steps=4",
        ],
    )
    trainer = trainer_class(cfg)
    trainer.fit()
    assert {st.name: st.steps + st.skipped_steps for st in trainer.optimizer_state.values()} == {
        "discriminator": 8,
        "generator": 8,
    }
    if opt_level == "O2":
        assert trainer.module.generator[0].weight.dtype == torch.float16
    events = EventAccumulator(str(trainer.version_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"amp/loss_scale/D", "amp/loss_scale/G", "train/loss_d", "train/loss_g"} <= tags
    for loss_id in ("D", "G"):
        scales = [e.value for e in events.Scalars(f"amp/loss_scale/{loss_id}")]
        overflowed = any(e.value for e in events.Scalars(f"amp/overflow/{loss_id}"))
        assert len(scales) == 4  # logged at steps 2, 4, 6, 8
        assert overflowed or scales == [1024.0, 2048.0, 2048.0, 4096.0]  # growth after every 4 clean updates
    assert all(math.isfinite(e.value) for e in events.Scalars("train/loss_d"))
    images = events.Images("samples")
    assert [(i.step, i.width, i.height) for i in images] == [(4, 128, 128), (8, 128, 128)]
    assert (trainer.version_dir / "checkpoints" / "last.pt").exists()


def test_samples_image_puts_points_where_a_plot_would():
    from examples.gan import samples_image

    points = torch.tensor([[1.5, 1.5]] * 3 + [[-1.5, -1.5]])  # upper right (x 3 times), lower left (once)
    image = samples_image(points, centers=torch.tensor([[0.0, 1.0]]), extent=2.0, pixels=4)
    assert image.shape == (3, 4, 4)
    white = image[1]  # green and blue carry the point density only
    assert white[0, 3] == 1.0 and math.isclose(white[3, 0].item(), (1 / 3) ** 0.5, rel_tol=1e-6)
    assert int((white > 0).sum()) == 2
    assert image[0, 0, 2] == 1.0 and image[1, 0, 2] == 0.0  # the centre (0, 1): red only, in the top row
