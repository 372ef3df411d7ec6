"""Config keys someone wrote that the run never reads (O0's precision.dtype, checkpoint keys with checkpointing off)
are named at fit start, with their values; the keys a file carries for the settings it chose are not."""

from __future__ import annotations

import copy
import pickle
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from toy_trainers import ToyTrainer, toy_cfg

import ampkit
from ampkit.config import ConfigError, load_config
from ampkit.trainer.unread_settings import unread_settings

GAN = Path(__file__).resolve().parents[1] / "configs" / "gan.yaml"
QUIET = {"logging.tensorboard": False, "trainer.progress_bar": False, "logging.throughput": False,
         "trainer.num_sanity_val_steps": 0, "checkpoint.enabled": False}  # fmt: skip
O0_WHY = "precision.opt_level=O0 trains in float32, with no loss scaler, so this run does not read "


def _unread(trainer, world_size: int = 1) -> list[str]:
    return unread_settings(trainer.cfg, trainer.config_class, world_size)


def test_o0_keys_written_beside_it_are_named_once_at_fit_start_with_their_values(tmp_path):
    """Apex's O0 is plain float32: a dtype, master weights or batch-norm setting given with it was dropped silently."""
    precision = {"precision.dtype": "bfloat16", "precision.master_weights": True, "precision.keep_batchnorm_fp32": True}
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET, **precision, **{"trainer.max_steps": 2}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit()
    said = [str(w.message) for w in caught if "trains in float32" in str(w.message)]
    assert said == [
        O0_WHY + "precision.dtype=bfloat16, precision.keep_batchnorm_fp32=true, precision.master_weights=true"
    ]


def test_a_shipped_file_s_keys_for_its_own_level_are_not_named_when_the_command_line_sets_o0():
    """gan.yaml sets dtype, skip_nonfinite and cast_modules for its O1: precision.opt_level=O0 on the command line
    makes them unread, which nobody asked for at O0; a key that command line writes itself is named."""
    trainer_class, cfg = load_config(GAN, ["precision.opt_level=O0"])
    assert _unread(trainer_class(cfg)) == []
    trainer_class, cfg = load_config(GAN, ["precision.opt_level=O0", "precision.dtype=bfloat16"])
    assert _unread(trainer_class(cfg)) == [O0_WHY + "precision.dtype=bfloat16"]


COPIES = {
    "deepcopy": copy.deepcopy,
    "copy": copy.copy,
    "DictConfig.copy": lambda cfg: cfg.copy(),
    "pickle": lambda cfg: pickle.loads(pickle.dumps(cfg)),
    "OmegaConf.merge": lambda cfg: OmegaConf.merge(cfg, {}),
}


@pytest.mark.parametrize("copied", COPIES.values(), ids=COPIES.keys())
def test_a_copy_of_a_loaded_config_keeps_its_file_and_command_line_apart(copied):
    """A copy made before building the Trainer (a sweep's, a notebook's) kept no sources: the whole config read as one
    written source, so gan.yaml's keys for its own O1 were named beside the command line's O0."""
    trainer_class, cfg = load_config(GAN, ["precision.opt_level=O0"])
    assert _unread(trainer_class(copied(cfg))) == []
    trainer_class, cfg = load_config(GAN, ["precision.opt_level=O0", "precision.dtype=bfloat16"])
    assert _unread(trainer_class(copied(cfg))) == [O0_WHY + "precision.dtype=bfloat16"]


def test_an_override_merged_onto_a_loaded_config_is_a_later_source():
    """OmegaConf.merge(cfg, override) is the override written over the file: its keys are named at O0, the file's
    keys for its own O1 are not."""
    trainer_class, cfg = load_config(GAN, ["precision.opt_level=O0"])
    merged = OmegaConf.merge(cfg, {"precision": {"dtype": "bfloat16", "init_scale": 1024.0}})
    assert _unread(trainer_class(merged)) == [O0_WHY + "precision.dtype=bfloat16, precision.init_scale=1024.0"]
    merged = OmegaConf.merge(cfg, OmegaConf.from_dotlist(["trainer.max_steps=5"]))
    assert _unread(trainer_class(merged)) == []


@pytest.mark.parametrize("base", [{}, {"trainer": {"max_steps": 5}}, ampkit.Config], ids=["empty", "dict", "schema"])
def test_a_loaded_config_merged_over_a_base_keeps_its_file_and_command_line_apart(base):
    """OmegaConf.merge(base, cfg), the loaded config laid over a user's defaults, kept the base's metadata only: the
    sources were lost, and gan.yaml's keys for its own O1 were named as if written for the command line's O0."""
    trainer_class, cfg = load_config(GAN, ["precision.opt_level=O0"])
    base = OmegaConf.structured(base) if isinstance(base, type) else base
    assert _unread(trainer_class(OmegaConf.merge(base, cfg))) == []
    merged = OmegaConf.merge(base, cfg, {"precision": {"init_scale": 1024.0}})
    assert _unread(trainer_class(merged)) == [O0_WHY + "precision.init_scale=1024.0"]


def test_a_file_that_sets_o0_itself_has_its_precision_keys_named(tmp_path):
    """Which file it is does not matter: keys written in the source that also chose O0 (or left it, the default)
    were written for O0, and are named; a later source's O0 leaves an earlier one's keys alone."""
    own = tmp_path / "own.yaml"
    own.write_text(
        "trainer_class: toy_trainers:ToyTrainer\nprecision:\n  opt_level: O0\n  dtype: float16\n  init_scale: 1024\n"
    )
    trainer_class, cfg = load_config(own, [f"run_dir={tmp_path / 'run'}"])
    assert _unread(trainer_class(cfg)) == [O0_WHY + "precision.dtype=float16, precision.init_scale=1024.0"]
    own.write_text("trainer_class: toy_trainers:ToyTrainer\nprecision:\n  opt_level: O1\n  dtype: float16\n")
    trainer_class, cfg = load_config(own, [f"run_dir={tmp_path / 'run'}", "precision.opt_level=O0"])
    assert _unread(trainer_class(cfg)) == []


def test_a_value_a_file_leaves_open_is_taken_as_the_command_line_filled_it(tmp_path):
    """A file's '???' or unset ${oc.env:...}, given on the command line, made the file's config unreadable as
    written, and its init_scale beside O0 went unnamed."""
    own = tmp_path / "open.yaml"
    own.write_text("trainer_class: toy_trainers:ToyTrainer\nprecision:\n  opt_level: O0\n  init_scale: 1024\n"
                   "  dtype: ???\n  growth_factor: ${oc.env:AMPKIT_TEST_UNSET}\n")  # fmt: skip
    overrides = [f"run_dir={tmp_path / 'run'}", "precision.dtype=bfloat16", "precision.growth_factor=3"]
    trainer_class, cfg = load_config(own, overrides)
    assert _unread(trainer_class(cfg)) == [
        O0_WHY + "precision.dtype=bfloat16, precision.init_scale=1024.0, precision.growth_factor=3.0"
    ]


@pytest.mark.parametrize(
    ("written", "replaced"),
    [("opt_level: O7", "O0"), ("loss_scale: dynamc", "null"), ("dtype: float8", "null"),
     ("keep_batchnorm_fp32: maybe", "null")],
)  # fmt: skip
def test_a_file_s_value_no_run_takes_replaced_on_the_command_line_names_nothing_beside_it(tmp_path, written, replaced):
    """Keys written beside a level no run takes were written for no level: nothing to say of them, and no error."""
    own = tmp_path / "own.yaml"
    own.write_text(f"trainer_class: toy_trainers:ToyTrainer\nprecision:\n  {written}\n  init_scale: 1024\n")
    key = written.split(":")[0]
    trainer_class, cfg = load_config(own, [f"run_dir={tmp_path / 'run'}", f"precision.{key}={replaced}"])
    assert _unread(trainer_class(cfg)) == []


def test_an_error_judging_a_source_s_config_is_raised_not_taken_for_nothing_unread(tmp_path, monkeypatch):
    """A source's config is judged without a try: a bug there would have hidden as 'nothing unread' in every test."""
    import ampkit.trainer.unread_settings as module

    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"precision.dtype": "bfloat16"}))
    judged = []

    def broken_for_sources(cfg, *args):
        judged.append(cfg)
        if len(judged) > 1:
            raise TypeError("a bug judging a source's config")
        return unread_keys(cfg, *args)

    unread_keys = module.unread_keys
    monkeypatch.setattr(module, "unread_keys", broken_for_sources)
    with pytest.raises(TypeError, match="a bug judging"):
        _unread(trainer)


def test_defaults_and_keys_that_are_read_are_not_named(tmp_path):
    assert _unread(ToyTrainer(toy_cfg(tmp_path, **QUIET))) == []
    dynamic = {"precision.opt_level": "O1", "precision.init_scale": 1024.0, "precision.cast_modules": "[0]"}
    assert _unread(ToyTrainer(toy_cfg(tmp_path, **dynamic))) == []
    scaled_o0 = {"precision.loss_scale": "dynamic", "precision.growth_interval": 100}  # O0 with Apex's loss scaler
    assert _unread(ToyTrainer(toy_cfg(tmp_path, **scaled_o0))) == []


def test_validation_keys_are_named_where_there_is_no_validation_unless_they_turn_it_off(tmp_path):
    trainer = ToyTrainer(toy_cfg(tmp_path, **{"trainer.num_sanity_val_steps": 5, "trainer.val_every_n_epochs": 2}))
    assert unread_settings(trainer.cfg, trainer.config_class, 1, validates=False) == [
        "there is no validation (val_dataloader() returned None, or no batches), so this run does not read "
        "trainer.num_sanity_val_steps=5, trainer.val_every_n_epochs=2"
    ]
    assert _unread(trainer) == []
    off = ToyTrainer(toy_cfg(tmp_path, **{"trainer.num_sanity_val_steps": 0, "trainer.val_every_n_epochs": 0}))
    assert unread_settings(off.cfg, off.config_class, 1, validates=False) == []


def test_a_key_changed_in_place_after_construction_counts_as_written(tmp_path):
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET))
    trainer.cfg.precision.dtype = "bfloat16"
    assert _unread(trainer) == [O0_WHY + "precision.dtype=bfloat16"]


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (
            {"checkpoint.enabled": False, "checkpoint.keep_last": 5},
            "checkpoint.enabled is false: the config's checkpoints are off, so this run does not read "
            "checkpoint.keep_last=5",
        ),
        (
            {"checkpoint.mode": "max"},
            "checkpoint.monitor is not set: no best checkpoint is ranked, so this run does "
            "not read checkpoint.mode=max",
        ),
        (
            {"checkpoint.every_n_epochs": 0, "checkpoint.keep_last": 5},
            "checkpoint.every_n_steps and checkpoint.every_n_epochs are 0: no step or epoch file is written, so this "
            "run does not read checkpoint.keep_last=5",
        ),
        (
            {"early_stopping.patience": 7, "early_stopping.min_delta": 0.5},
            "early_stopping.monitor is not set: early stopping is off, so this run does not read "
            "early_stopping.patience=7, early_stopping.min_delta=0.5",
        ),
        (
            {"precision.fp8.recipe": "rowwise"},
            "precision.fp8.enabled is false, so this run does not read precision.fp8.recipe=rowwise",
        ),
        (
            {"logging.tensorboard": False, "logging.log_momentum": True},
            "logging.tensorboard is false, so this run does not read logging.log_momentum=true",
        ),
        (
            {"logging.throughput": False, "logging.peak_tflops": 100.0},
            "logging.throughput is false, so this run does not read logging.peak_tflops=100.0",
        ),
        (
            {"trainer.progress_bar": False, "logging.console_every_n_steps": 5},
            "trainer.progress_bar is false: no console progress, so this run does not read "
            "logging.console_every_n_steps=5",
        ),
        (
            {"distributed.find_unused_parameters": True, "distributed.backend": "gloo"},
            "this run is one process (torchrun starts several), so this run does not read distributed.backend=gloo, "
            "distributed.find_unused_parameters=true",
        ),
        (
            {"precision.opt_level": "O4", "precision.init_scale": 1024.0},
            "bfloat16 has no loss scaler unless precision.loss_scale asks for one, so this run does not read "
            "precision.init_scale=1024.0",
        ),
        (
            {"precision.opt_level": "O3", "precision.growth_interval": 100},
            "precision.loss_scale=1 is a static scale (dynamic: one that adapts), so this run does not read "
            "precision.growth_interval=100",
        ),
        (
            {"precision.opt_level": "O1", "precision.loss_scale": "none", "precision.warn_consecutive_skips": 3},
            "precision.loss_scale=none: there is no loss scaler, so this run does not read "
            "precision.warn_consecutive_skips=3",
        ),
    ],
)
def test_each_key_another_setting_leaves_unread_is_named(tmp_path, overrides, said):
    assert _unread(ToyTrainer(toy_cfg(tmp_path, **overrides))) == [said]


def test_a_sharded_run_names_the_skip_verdict_it_does_not_read(tmp_path):
    """FSDP decides skips on the host whatever trainer.skip_verdict asks."""
    fsdp = {"distributed.strategy": "fsdp", "trainer.skip_verdict": "device"}
    assert _unread(ToyTrainer(toy_cfg(tmp_path, **fsdp)), world_size=2) == [
        "distributed.strategy=fsdp reads every skip verdict on the host, so this run does not read "
        "trainer.skip_verdict=device"
    ]


def test_ddp_s_bucket_size_is_refused_under_fsdp_as_its_other_ddp_knobs(tmp_path):
    """bucket_cap_mb was the one DDP knob FSDP dropped without a word; find_unused_parameters, static_graph and
    gradient_as_bucket_view were refused already."""
    fsdp = {"distributed.strategy": "fsdp", "distributed.bucket_cap_mb": 50}
    with pytest.raises(
        ConfigError,
        match=r"config key 'distributed.bucket_cap_mb': 50.0 cannot be used with distributed.strategy: fsdp "
        r"\(it is a DDP knob\)",
    ):
        ToyTrainer(toy_cfg(tmp_path, **fsdp))
    ToyTrainer(toy_cfg(tmp_path, **{"distributed.strategy": "fsdp", "distributed.bucket_cap_mb": 25}))  # its default
