"""Checkpoints: atomic, safe to load, and a SIGKILLed run resumes to bit-identical parameters."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import pickle
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoint_compare import assert_same_checkpoint
from child_env import child_env
from omegaconf import OmegaConf
from rank_forkserver import ForkedPython
from torch.utils.data import DataLoader
from toy_trainers import OwnGeneratorToyTrainer, ToyConfig, ToyTrainer, toy_cfg, toy_dataset

import ampkit
from ampkit import CheckpointError
from ampkit.cli import main
from ampkit.config import import_object
from ampkit.trainer.checkpoint_io import load_checkpoint, save_atomic

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def _final_params(version_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(version_dir / "checkpoints" / "last.pt")["model"]


def _assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("accumulate", [1, 2])
def test_resume_from_any_checkpoint_in_process_is_bit_identical(tmp_path, accumulate):
    common = {
        "trainer.max_epochs": 3,
        "trainer.accumulate_grad_batches": accumulate,
        "logging.tensorboard": False,
        "checkpoint.every_n_steps": 1,
        "checkpoint.keep_last": 100,
    }
    full = ToyTrainer(toy_cfg(tmp_path / "full", **common))
    full.fit()
    saved = sorted((full.version_dir / "checkpoints").glob("*-*.pt"))
    mid_epoch = [p for p in saved if load_checkpoint(p)["loop"]["batches_done"] not in (0, 8)][:2]
    epoch_end = [p for p in saved if p.name.startswith("epoch-")][:2]
    last_batch = [p for p in saved if load_checkpoint(p)["loop"]["batches_done"] == 8][:1]
    assert len(mid_epoch) == 2 and len(epoch_end) == 2 and len(last_batch) == 1
    for checkpoint in mid_epoch + epoch_end + last_batch:
        resumed = ToyTrainer(toy_cfg(tmp_path / checkpoint.stem, **common))
        resumed.fit(resume=checkpoint)
        assert resumed.state.global_step == full.state.global_step
        _assert_bit_identical(resumed.module.state_dict(), full.module.state_dict())
        opt_a, opt_b = full.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
        for key in opt_a:
            assert torch.equal(opt_a[key]["momentum_buffer"], opt_b[key]["momentum_buffer"])


# Settings the toy's own resume tests leave out, each resumed from a mid-epoch and an epoch-end checkpoint: float16
# loss scalers that overflow and grow (scales, skipped-step counts), their verdicts kept on the device, two losses
# with two optimizers and scalers, schedulers stepping per step and on a plateau beside early stopping, a sampler
# drawing from a generator of its own.
_SCALER = {"dtype": "float16", "init_scale": 2.0**22, "growth_interval": 2, "max_scale": None}
_RESUMED_SETTINGS = {
    "fp16-O1-overflowing": ("toy_trainers:ToyTrainer", {"precision": {"opt_level": "O1", **_SCALER}}),
    "fp16-O2-device-verdicts": (
        "toy_trainers:ToyTrainer",
        {"precision": {"opt_level": "O2", **_SCALER}, "trainer": {"skip_verdict": "device"}},
    ),
    "gan-two-losses-O2": (
        "examples.gan:GanTrainer",
        {
            "precision": {"opt_level": "O2", "cast_modules": ["generator", "discriminator"], **_SCALER},
            "model": {"hidden": 16},
            "data": {"samples": 512, "batch_size": 64},
            "samples": {"every_n_steps": 3, "points": 64, "pixels": 16},
        },
    ),
    "schedulers-early-stopping": (
        "toy_trainers:ScheduledToyTrainer",
        {
            "trainer": {"val_every_n_epochs": 0, "val_every_n_steps": 2},
            "early_stopping": {"monitor": "val/mse", "mode": "max", "patience": 4},
        },
    ),
    "sampler-with-its-own-generator": ("toy_trainers:OwnGeneratorToyTrainer", {}),
}


@pytest.mark.parametrize("setting", list(_RESUMED_SETTINGS))
def test_resume_mid_epoch_and_at_an_epoch_s_end_is_bit_identical_in_every_key(tmp_path, setting):
    trainer_class, settings = _RESUMED_SETTINGS[setting]
    base = {
        "trainer_class": trainer_class,
        "trainer": {"max_epochs": 3, "device": "cpu", "progress_bar": False},
        "logging": {"tensorboard": False},
        "checkpoint": {"every_n_steps": 1, "keep_last": 100},
    }
    cls = import_object(trainer_class)

    def cfg(run: str) -> dict:
        merged = OmegaConf.merge(base, settings, {"run_dir": str(tmp_path / run)})
        return OmegaConf.to_container(merged)

    full = cls(cfg("full"))
    full.fit()
    reference = load_checkpoint(full.version_dir / "checkpoints" / "last.pt")
    counts = reference["optimizer_counts"].values()
    if "O1" in setting or "O2" in setting:  # the scalers overflowed and grew back: their state is worth resuming
        assert all(c["skipped_steps"] > 0 and c["steps"] > 0 for c in counts), counts
    step = full.num_train_batches
    # mid-epoch 1, epoch 0's last batch (its end not run yet), epoch 0's end
    for name in (f"step-{step + 3:08d}.pt", f"step-{step:08d}.pt", "epoch-0001.pt"):
        resumed = cls(cfg(f"resumed-{name}"))
        resumed.fit(resume=full.version_dir / "checkpoints" / name)
        assert_same_checkpoint(load_checkpoint(resumed.version_dir / "checkpoints" / "last.pt"), reference)


def test_a_resume_whose_loader_lost_its_own_generator_says_its_order_is_not_restored(tmp_path):
    common = {
        "trainer.max_epochs": 2,
        "logging.tensorboard": False,
        "checkpoint.every_n_steps": 1,
        "checkpoint.keep_last": 20,
    }
    saved = OwnGeneratorToyTrainer(toy_cfg(tmp_path / "saved", **common))
    saved.fit()
    resumed = ToyTrainer(toy_cfg(tmp_path / "resumed", **common))  # shuffle=True: the Trainer's seeded sampler
    with pytest.warns(UserWarning, match=r"state of 1 torch.Generator\(s\) of the train loader .* has 0: they are not"):
        resumed.fit(resume=saved.version_dir / "checkpoints" / "step-00000011.pt")
    assert resumed.state.global_step == 16


def _cli(cfg_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ampkit", "fit", "--config", str(cfg_path), *extra]


def _forked_cli(tmp_path: Path, cfg_path: Path, *extra: str) -> ForkedPython:
    """``ampkit fit --config CFG_PATH EXTRA...`` forked from the warm rank server, not a new Python (which spent
    seconds importing torch and ampkit), computing with this process's thread count as a new Python would."""
    script = tmp_path / "ampkit_fit.py"
    script.write_text(
        f"import sys, torch\ntorch.set_num_threads({torch.get_num_threads()})\n"
        "from ampkit.cli import main\nsys.exit(main())\n"
    )
    command = [sys.executable, str(script), "fit", "--config", str(cfg_path), *extra]
    return ForkedPython(command, env=child_env(TESTS, REPO))


def test_sigkill_at_a_random_moment_then_resume_matches_uninterrupted(tmp_path):
    settings = {
        "trainer_class": "toy_trainers:SlowToyTrainer",
        "trainer": {"max_epochs": 3, "device": "cpu"},  # bit-identical resume is the CPU's promise
        "checkpoint": {"every_n_steps": 1},
        "logging": {"log_every_n_steps": 4},
    }
    cfg_path = tmp_path / "toy.yaml"
    OmegaConf.save(OmegaConf.create({**settings, "run_dir": str(tmp_path / "killed")}), cfg_path)
    # The uninterrupted run in a process of its own too (where this one has used CUDA, another test on a machine with
    # a GPU, its checkpoints also hold CUDA's RNG state, which a CPU run in a fresh process does not save), run on
    # the other core meanwhile.
    full_path = tmp_path / "full.yaml"
    OmegaConf.save(OmegaConf.create({**settings, "run_dir": str(tmp_path / "full")}), full_path)
    full = _forked_cli(tmp_path, full_path)
    try:
        _kill_resume_and_compare(cfg_path, full, tmp_path)
    finally:
        full.kill()


def _kill_resume_and_compare(cfg_path: Path, full: ForkedPython, tmp_path: Path) -> None:
    last = tmp_path / "killed" / "version_0" / "checkpoints" / "last.pt"
    killed = False
    for _attempt in range(3):
        proc = _forked_cli(tmp_path, cfg_path)
        deadline = time.monotonic() + 60
        while not last.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(random.uniform(0.0, 0.2))
        if proc.poll() is None:
            proc.kill()  # SIGKILL
            killed = True
        proc.communicate(timeout=60)
        if killed:
            break
    assert killed, "the training process finished before it could be killed"
    step_at_kill = load_checkpoint(last)["loop"]["global_step"]  # loadable after SIGKILL
    assert 0 < step_at_kill < 24
    resume = _forked_cli(tmp_path, cfg_path, "--resume", "last")
    _, stderr = resume.communicate(timeout=120)
    assert resume.returncode == 0, stderr
    resumed = load_checkpoint(last)
    assert resumed["loop"]["global_step"] == 24
    _, stderr = full.communicate(timeout=120)
    assert full.returncode == 0, stderr
    full_last = tmp_path / "full" / "version_0" / "checkpoints" / "last.pt"
    assert_same_checkpoint(resumed, load_checkpoint(full_last))  # RNG included


class UnfreezingToyTrainer(ToyTrainer):
    """Fine-tuning: the head trains from the start; at epoch 1 the first layer is unfrozen and added to the
    optimizer as a second param group, with its own learning rate."""

    def configure_model(self):
        model = super().configure_model()
        model[0].requires_grad_(False)
        return model

    def configure_optimizers(self):
        return torch.optim.AdamW(self.module[3].parameters(), lr=self.cfg.lr)

    def on_train_epoch_start(self):
        first = self.module[0]
        if self.state.epoch >= 1 and not first.weight.requires_grad:
            first.requires_grad_(True)
            self.optimizer.add_param_group({"params": list(first.parameters()), "lr": 1e-3})


@pytest.mark.parametrize("precision", [{}, {"opt_level": "O2", "dtype": "float16"}])
def test_a_run_that_unfroze_a_param_group_resumes_as_it_went_on(tmp_path, precision):
    # configure_model and configure_optimizers make the run's start: a resume after the unfreezing failed with "a
    # different number of parameter groups" (no hook could add the group before the optimizer's state loaded).
    # Under O2 the optimizer holds fp32 masters in the parameters' place: the record names them too.
    settings = {
        "trainer_class": "test_checkpoint:UnfreezingToyTrainer",
        "logging": {"tensorboard": False},
        "precision": precision,
    }

    def unfreezing(run: str, max_epochs: int) -> UnfreezingToyTrainer:  # on the CPU, where resume is bit-identical
        trainer = {"max_epochs": max_epochs, "device": "cpu"}
        return UnfreezingToyTrainer({**settings, "run_dir": str(tmp_path / run), "trainer": trainer})

    full = unfreezing("full", 3)
    full.fit()
    unfreezing("cut", 2).fit()
    resumed = unfreezing("cut", 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.fit(resume="last")
    assert len(resumed.optimizer.param_groups) == 2 and resumed.module[0].weight.requires_grad
    # the added group's own lr is no configure_optimizers() setting the checkpoint overrode
    assert not [w for w in caught if "optimizers' settings" in str(w.message)]
    assert_same_checkpoint(
        load_checkpoint(resumed.version_dir / "checkpoints" / "last.pt"),
        load_checkpoint(full.version_dir / "checkpoints" / "last.pt"),
    )


def test_checkpoint_holds_everything_needed(tmp_path):
    trainer = ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_epochs": 1, "logging.tensorboard": False}))
    trainer.fit()
    ckpt = load_checkpoint(trainer.version_dir / "checkpoints" / "last.pt")
    assert set(ckpt) >= {"model", "optimizers", "schedulers", "callbacks", "loop", "rng", "epoch_rng", "config"}
    assert set(ckpt["rng"]) >= {"python", "torch", "numpy"}
    assert ckpt["loop"] == {"epoch": 1, "batches_done": 0, "global_step": 8}


class _SklearnBest(ampkit.Callback):
    """Keeps the best validation score as a metrics library hands it back: a NumPy float."""

    def __init__(self):
        self.best = None

    def on_validation_end(self, trainer, metrics):
        self.best = np.float64(metrics["mse"])

    def state_dict(self):
        return {"best": self.best}


def test_a_callback_state_no_resume_could_load_stops_the_first_save_naming_it(tmp_path):
    # Saved without a word, every checkpoint was then refused by the resume's torch.load(weights_only=True): a run
    # that crashed after hours could resume from none of them.
    trainer = ToyTrainer(toy_cfg(tmp_path, **{"logging.tensorboard": False}), callbacks=[_SklearnBest()])
    with pytest.raises(CheckpointError, match=r"callbacks\._SklearnBest\.best \(numpy\.float64\).*weights_only"):
        trainer.fit()
    assert not list((tmp_path / "run").rglob("*.pt"))


def test_the_save_time_walk_calls_once_per_container_and_names_the_refused_entry(monkeypatch):
    # It runs at every save over the whole checkpoint: a large model's states hold tens of thousands of tensors, each
    # of which cost a call and two formatted key strings.
    from ampkit.trainer import checkpoint_io

    walk, calls = checkpoint_io._refused_in, []

    def counted(obj, around):
        calls.append(type(obj).__name__)
        return walk(obj, around)

    monkeypatch.setattr(checkpoint_io, "_refused_in", counted)
    tensors = {f"layer{i}.weight": torch.zeros(2) for i in range(500)}
    state = {i: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2)} for i in range(3)}
    checkpoint = {"model": tensors, "optimizers": {"opt": {"state": state, "param_groups": [{"params": [0, 1, 2]}]}}}
    assert checkpoint_io.unloadable_entry(checkpoint) is None
    assert len(calls) == 11, calls  # the dicts and lists, not the 500 tensors or the ints in them
    checkpoint["loop"] = {"scores": [1.0, (2, np.float64(3.0))], 3: {("a", 1): 1}}
    assert checkpoint_io.unloadable_entry(checkpoint) == "loop.scores.1.1 (numpy.float64)"
    assert checkpoint_io.unloadable_entry({"x": {np.int64(1): 0}}, "cb") == "cb.x.<key np.int64(1)> (numpy.int64)"
    assert checkpoint_io.unloadable_entry(np.float64(1.0)) == "<root> (numpy.float64)"


def test_a_state_that_holds_itself_saves_and_one_nested_past_torch_save_is_named(tmp_path):
    """An on_save_checkpoint entry that holds itself (pickle writes it once, the load rebuilds it) and one of lists
    nested thousands deep (torch.save's pickler runs out of stack) both ended in a RecursionError from the check
    before the save; the first saves and loads back, the second is refused naming where it is."""
    from ampkit.trainer import checkpoint_io

    itself: dict = {"step": 1}
    itself["me"] = itself
    assert checkpoint_io.unloadable_entry({"cb": itself}) is None
    save_atomic({"cb": itself}, tmp_path / "loop.pt")
    loaded = torch.load(tmp_path / "loop.pt", weights_only=True)["cb"]
    assert loaded["me"] is loaded
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    found = checkpoint_io.unloadable_entry({"cb": {"deep": deep}})
    assert found == (
        "cb.deep.0.0.<94 more>.0.0 (containers nested over 100 deep: torch.save runs out of stack writing them)"
    )
    nested_50: dict = {}
    for _ in range(50):
        nested_50 = {"a": nested_50}
    assert checkpoint_io.unloadable_entry({"config": nested_50}) is None


def test_a_numpy_value_allowed_with_add_safe_globals_saves_and_resumes(tmp_path):
    # torch's own refusal tells the user to allow numpy.core.multiarray.scalar and the dtype: a load that then works
    # must not be stopped at the save because the value's class is not the name the load rebuilds it by.
    allowed = [np.float64(0).__reduce__()[0], np.dtype, type(np.dtype("float64"))]  # numpy's scalar(), the dtype
    cfg = toy_cfg(tmp_path, **{"logging.tensorboard": False})
    with torch.serialization.safe_globals(allowed):
        ToyTrainer(cfg, callbacks=[_SklearnBest()]).fit()
        resumed = ToyTrainer(toy_cfg(tmp_path, **{"logging.tensorboard": False, "trainer.max_epochs": 3}))
        resumed.fit(resume="last")
    assert resumed.state.epoch == 3


@dataclasses.dataclass
class _PathConfig(ToyConfig):
    data_dir: Path = Path("~/data")


class _PathTrainer(ToyTrainer):
    config_class = _PathConfig


def test_a_config_with_a_path_key_saves_and_resumes(tmp_path):
    # The checkpoint kept the resolved config's PosixPath, which torch.load(weights_only=True) refuses: every save
    # was stopped as unloadable (before that check, every resume failed).
    cfg = {**toy_cfg(tmp_path, **{"logging.tensorboard": False}), "trainer_class": "test_checkpoint:_PathTrainer"}
    _PathTrainer(cfg).fit()
    assert load_checkpoint(tmp_path / "run/version_0/checkpoints/last.pt")["config"]["data_dir"] == str(
        Path("~/data").expanduser()
    )
    resumed = _PathTrainer({**cfg, "trainer": {**cfg["trainer"], "max_epochs": 2}})
    resumed.fit(resume="last")
    assert resumed.state.epoch == 2 and resumed.cfg.data_dir == Path("~/data").expanduser()


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_malicious_pickle_is_refused_and_not_executed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.pt"
    torch.save({"ampkit_checkpoint": 1, "model": _Payload()}, path)
    with pytest.raises(CheckpointError, match="refusing to load .*weights_only=True"):
        load_checkpoint(path)
    assert not (tmp_path / "PWNED").exists()


def test_corrupt_truncated_foreign_and_missing_checkpoints(tmp_path):
    good = save_atomic({"ampkit_checkpoint": 1, "x": torch.ones(1000)}, tmp_path / "good.pt")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint(truncated)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(pickle.dumps([1, 2, 3], protocol=2) + b"\x00junk")
    with pytest.raises(CheckpointError, match="garbage.pt' is corrupt or truncated"):
        load_checkpoint(garbage)
    for name, text in [("text.pt", "not a checkpoint\n"), ("metrics.csv", "epoch,loss\n1,0.5\n"), ("e.json", "{}")]:
        (tmp_path / name).write_text(text)
        with pytest.raises(CheckpointError, match=f"'{tmp_path / name}' is not a torch checkpoint"):
            load_checkpoint(tmp_path / name)
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty.pt' is an empty file$"):
        load_checkpoint(tmp_path / "empty.pt")
    foreign = save_atomic({"state_dict": {}}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="not an ampkit checkpoint"):
        load_checkpoint(foreign)
    with pytest.raises(CheckpointError, match="no checkpoint file"):
        load_checkpoint(tmp_path / "absent.pt")


def test_resume_with_a_checkpoint_of_another_model_fails_clearly_and_keeps_files(tmp_path):
    trainer = ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_epochs": 1, "logging.tensorboard": False}))
    trainer.fit()
    last = trainer.version_dir / "checkpoints" / "last.pt"
    before = last.read_bytes()

    class Wider(ToyTrainer):
        def configure_model(self):
            return torch.nn.Linear(6, 3)

    with pytest.raises(CheckpointError, match="does not fit"):
        Wider(toy_cfg(tmp_path, **{"trainer.max_epochs": 2})).fit(resume="last")
    assert last.read_bytes() == before


def test_resume_last_without_a_checkpoint_is_an_error_naming_run_dir(tmp_path):
    cfg = toy_cfg(tmp_path, **{"trainer.max_epochs": 1, "logging.tensorboard": False})
    (tmp_path / "run" / "version_0").mkdir(parents=True)  # killed before its first checkpoint
    with pytest.raises(CheckpointError, match=f"no checkpoint under run_dir '{tmp_path / 'run'}'"):
        ToyTrainer(cfg).fit(resume="last")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["version_0"]


def test_a_relative_run_dir_without_a_checkpoint_names_the_directory_it_was_looked_for_in(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a script run from another directory than the one it trained in
    cfg = toy_cfg(tmp_path, **{"run_dir": "runs/toy", "logging.tensorboard": False})
    where = f"'runs/toy' (relative to the working directory: {tmp_path / 'runs' / 'toy'})"
    with pytest.raises(CheckpointError, match=re.escape(f"no checkpoint under run_dir {where}")):
        ToyTrainer(cfg).fit(resume="last")
    with pytest.raises(CheckpointError, match=re.escape(f"validate: no 'last.pt' under {where}")):
        ToyTrainer(cfg).validate(ckpt="last")


def test_bad_resume_files_leave_nothing_behind(tmp_path):
    trainer = ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_epochs": 2, "logging.tensorboard": False}))
    trainer.fit()
    before = {p: p.read_bytes() for p in trainer.version_dir.rglob("*") if p.is_file()}
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")

    class Wider(ToyTrainer):
        def configure_model(self):
            return torch.nn.Linear(6, 3)

    for trainer_class, resume, why in [
        (ToyTrainer, text, "notes.txt' is not a torch checkpoint"),
        (ToyTrainer, tmp_path / "absent.pt", "no checkpoint file or sharded checkpoint at '.*absent.pt'"),
        (Wider, "last", r"last.pt' does not fit this run's model/optimizers: Missing key\(s\) in the checkpoint"),
    ]:
        with pytest.raises(CheckpointError, match=why):
            trainer_class(toy_cfg(tmp_path, **{"trainer.max_epochs": 3})).fit(resume=resume)
    after = {p: p.read_bytes() for p in trainer.version_dir.rglob("*") if p.is_file()}
    assert after == before  # no config.resumed_at_step_*.yaml
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["version_0"]  # no empty version_N


def test_resumed_run_saves_its_changed_config_under_the_restored_step(tmp_path):
    trainer = ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_epochs": 1, "logging.tensorboard": False}))
    trainer.fit()
    ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_epochs": 2, "logging.tensorboard": False})).fit(resume="last")
    assert (trainer.version_dir / "config.resumed_at_step_8.yaml").is_file()


class _CtrlCAtStep(ampkit.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, batch) -> None:
        if trainer.state.global_step == self.step:
            raise KeyboardInterrupt


def test_config_records_say_which_config_trained_each_step_also_back_to_the_first(tmp_path):
    """lr 0.05 is interrupted after step 8, lr 0.01 at step 10 (before a checkpoint), lr 0.02 after step 16; the
    first config then finishes the run. Its return at step 16 was recorded nowhere (it equals config.yaml), so the
    records said lr 0.02 trained to the end. The resume at step 8 that saved nothing keeps its record beside the
    second one's: replaced, nothing said which config wrote its steps' TensorBoard points."""
    common = {"trainer.max_epochs": 3, "checkpoint.every_n_steps": 4, "logging.tensorboard": False}
    for lr, stop, resume in ((0.05, 8, None), (0.01, 10, "last"), (0.02, 16, "last"), (0.05, -1, "last")):
        with contextlib.suppress(KeyboardInterrupt):
            ToyTrainer(toy_cfg(tmp_path, lr=lr, **common), callbacks=[_CtrlCAtStep(stop)]).fit(resume=resume)
    version = tmp_path / "run" / "version_0"
    records = {p.name: OmegaConf.load(p).lr for p in version.glob("config*.yaml")}
    assert records == {
        "config.yaml": 0.05,
        "config.resumed_at_step_8.yaml": 0.01,
        "config.resumed_at_step_8.1.yaml": 0.02,
        "config.resumed_at_step_16.yaml": 0.05,
    }


def test_restart_after_a_kill_removes_temp_files_and_extra_step_files(tmp_path):
    common = {"logging.tensorboard": False, "checkpoint.every_n_steps": 1, "checkpoint.keep_last": 2}
    trainer = ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_epochs": 1, **common}))
    trainer.fit()
    directory = trainer.version_dir / "checkpoints"
    # What a SIGKILL leaves: half-written temp files (mkstemp names them with 8 random characters) and step files
    # saved but not yet pruned.
    (directory / ".step-00000009.pt.x1y2z3w4.tmp").write_bytes(b"PK\x03\x04half")
    (directory / ".last.pt.a1b2c3d4.tmp").write_bytes(b"")
    for step in (5, 6, 7):
        save_atomic({"ampkit_checkpoint": 1}, directory / f"step-{step:08d}.pt")
    os.utime(directory / "step-00000007.pt", ns=(0, 0))  # older than step 8 by its number, whatever its time
    seen_at_start: list[str] = []

    class ListCheckpoints(ampkit.Callback):
        def on_train_start(self, trainer) -> None:
            seen_at_start.extend(sorted(p.name for p in directory.iterdir()))

    restarted = ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_epochs": 2, **common}), callbacks=[ListCheckpoints()])
    restarted.fit(resume="last")
    assert seen_at_start == ["epoch-0001.pt", "last.pt", "step-00000008.pt"]


class BatchCounter(ampkit.Callback):
    def __init__(self):
        self.batches = 0

    def on_train_batch_end(self, trainer, outputs, batch) -> None:
        self.batches += 1

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        self.batches = state["batches"]


def test_a_resume_without_a_stateful_callback_of_the_checkpoint_names_it(tmp_path):
    common = {"logging.tensorboard": False, "trainer.progress_bar": False}
    ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_epochs": 1, **common}), callbacks=[BatchCounter()]).fit()
    counter = BatchCounter()
    ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_epochs": 2, **common}), callbacks=[counter]).fit(resume="last")
    assert counter.batches == 2 * len(ToyTrainer(toy_cfg(tmp_path)).train_dataloader())  # restored, then counted on
    with pytest.warns(UserWarning, match=r"holds the state of callbacks \['BatchCounter'\] that this run does not"):
        ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_epochs": 3, **common})).fit(resume="last")


def test_a_callback_added_on_resume_starts_fresh_without_a_warning(tmp_path):
    """As Lightning's restore: a callback the checkpoint holds no state for is not loaded and not named (nothing saved
    is lost); it counts from the resume on."""
    common = {"logging.tensorboard": False, "trainer.progress_bar": False, "data.n": 16}
    ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_epochs": 1, **common})).fit()
    counter = BatchCounter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_epochs": 2, **common}), callbacks=[counter]).fit(resume="last")
    assert counter.batches == 2
    assert not [w for w in caught if "BatchCounter" in str(w.message)]


def test_fresh_runs_never_overwrite_earlier_ones(tmp_path):
    cfg = toy_cfg(tmp_path, **{"trainer.max_epochs": 1, "logging.tensorboard": False})
    first, second = ToyTrainer(cfg), ToyTrainer(cfg)
    first.fit()
    second.fit()
    assert first.version_dir.name == "version_0" and second.version_dir.name == "version_1"
    assert (first.version_dir / "checkpoints" / "last.pt").is_file()


def test_keep_last_prunes_old_files_but_last_survives(tmp_path):
    cfg = toy_cfg(
        tmp_path,
        **{
            "trainer.max_epochs": 1,
            "logging.tensorboard": False,
            "checkpoint.every_n_steps": 1,
            "checkpoint.keep_last": 2,
        },
    )
    trainer = ToyTrainer(cfg)
    trainer.fit()
    names = sorted(p.name for p in (trainer.version_dir / "checkpoints").glob("*.pt"))
    assert names == ["epoch-0001.pt", "last.pt", "step-00000008.pt"]


def test_rewriting_last_pt_in_place_changes_no_other_checkpoint(tmp_path):
    """last.pt, best.pt, best-N.pt and step/epoch-N.pt of one moment are separate files: a user who trims
    last.pt in place (torch.save onto it, which rewrites the file's bytes) keeps the best and the periodic ones."""
    cfg = toy_cfg(tmp_path, **{"trainer.max_epochs": 2, "logging.tensorboard": False, "trainer.progress_bar": False,
                               "checkpoint.monitor": "val/mse", "checkpoint.save_top_k": 2})  # fmt: skip
    trainer = ToyTrainer(cfg)
    trainer.fit()
    checkpoints = trainer.version_dir / "checkpoints"
    before = {p.name: p.read_bytes() for p in checkpoints.glob("*.pt")}
    assert {"last.pt", "best.pt", "best-00000016.pt", "epoch-0002.pt"} <= before.keys()
    assert before["last.pt"] == before["epoch-0002.pt"] == before["best-00000016.pt"]
    trimmed = torch.load(checkpoints / "last.pt", weights_only=True)
    del trimmed["optimizers"]
    torch.save(trimmed, checkpoints / "last.pt")
    after = {p.name: p.read_bytes() for p in checkpoints.glob("*.pt")}
    assert after["last.pt"] != before["last.pt"]
    assert {n: b for n, b in after.items() if n != "last.pt"} == {n: b for n, b in before.items() if n != "last.pt"}
    complete = re.escape(f"lacks optimizers: it cannot be resumed (its weights may still load with validate/test/"
                         f"predict --ckpt); the newest complete checkpoint beside it is '{checkpoints}/")  # fmt: skip
    with pytest.raises(CheckpointError, match=complete + r"epoch-0002\.pt'"):
        ToyTrainer({**cfg, "trainer": {**cfg["trainer"], "max_epochs": 3}}).fit(resume="last")


@pytest.mark.parametrize("failure", [errno.EXDEV, errno.ENOSPC])
def test_copies_fall_back_to_python_or_fail_leaving_the_previous_last(tmp_path, monkeypatch, failure):
    """Where the kernel cannot copy between the files the copy goes through Python; a full disk fails the save,
    and last.pt keeps the previous checkpoint."""
    cfg = toy_cfg(tmp_path, **{"trainer.max_epochs": 1, "logging.tensorboard": False, "trainer.progress_bar": False})
    ToyTrainer(cfg).fit()
    last = tmp_path / "run" / "version_0" / "checkpoints" / "last.pt"
    previous = last.read_bytes()

    def kernel_copy(*args):
        raise OSError(failure, os.strerror(failure))

    monkeypatch.setattr(os, "copy_file_range", kernel_copy, raising=False)
    resumed = ToyTrainer({**cfg, "trainer": {**cfg["trainer"], "max_epochs": 2}})
    if failure == errno.ENOSPC:
        with pytest.raises(CheckpointError, match="No space left on device.*last.pt still holds the previous"):
            resumed.fit(resume="last")
        assert last.read_bytes() == previous
    else:
        resumed.fit(resume="last")
        assert last.read_bytes() == (last.parent / "epoch-0002.pt").read_bytes() != previous
    assert not [p.name for p in last.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("failing", ["save", "copy"])
def test_a_full_disk_at_a_runs_first_save_says_what_is_left_to_resume(tmp_path, monkeypatch, failing):
    """No last.pt exists yet: the error does not promise one, it names the whole file to resume, or says none is."""

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if failing == "save":
        monkeypatch.setattr(torch, "save", full)
    else:
        monkeypatch.setattr(os, "copy_file_range", full, raising=False)
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    left = (
        "this run has no checkpoint yet"
        if failing == "save"
        else f"'{checkpoints / 'epoch-0001.pt'}' was written whole"
    )
    written = "epoch-0001.pt" if failing == "save" else "last.pt"
    with pytest.raises(
        CheckpointError, match=re.escape(f"'{checkpoints / written}' (No space left on device); {left}")
    ):
        ToyTrainer(toy_cfg(tmp_path, **{"logging.tensorboard": False, "trainer.progress_bar": False})).fit()
    assert not (checkpoints / "last.pt").exists()


@pytest.mark.parametrize("kind", ["step", "epoch"])
def test_a_run_copied_without_its_mtimes_prunes_its_oldest_checkpoints(tmp_path, kind):
    """A copy that does not keep mtimes (cp -r, scp, an object store) dates the files in its own order; pruning and
    the newest-left hint go by the step each file holds, so a resumed copy keeps its newest checkpoints."""
    from ampkit.trainer.run_life import newest_periodic_checkpoint

    every = {"checkpoint.every_n_steps": 4, "checkpoint.every_n_epochs": 0} if kind == "step" else {}
    quiet = {"logging.tensorboard": False, "trainer.progress_bar": False, "checkpoint.keep_last": 2, **every}
    ToyTrainer(toy_cfg(tmp_path, **quiet, **{"trainer.max_epochs": 3})).fit()
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    older, newer = ["step-00000020.pt", "step-00000024.pt"] if kind == "step" else ["epoch-0002.pt", "epoch-0003.pt"]
    os.utime(checkpoints / older, ns=(2_000_000_000_000_000_000,) * 2)  # copied last
    os.utime(checkpoints / newer, ns=(1_000_000_000_000_000_000,) * 2)
    assert newest_periodic_checkpoint(tmp_path / "run") == checkpoints / newer
    limit = {"trainer.max_steps": 28} if kind == "step" else {"trainer.max_epochs": 4}
    ToyTrainer(toy_cfg(tmp_path, **quiet, **{"trainer.max_epochs": 4, **limit})).fit(resume="last")
    written = "step-00000028.pt" if kind == "step" else "epoch-0004.pt"
    assert sorted(p.name for p in checkpoints.glob("*.pt")) == sorted(["last.pt", newer, written])


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_run_files_get_the_permissions_the_umask_gives(tmp_path, umask):
    """Checkpoints and the saved config are written through owner-only temp files; the finished files have the
    umask's permissions, as open() gives, so a group sharing a run directory can read them when the umask lets it."""
    old = os.umask(umask)
    try:
        ToyTrainer(toy_cfg(tmp_path, **{"logging.tensorboard": False, "trainer.progress_bar": False})).fit()
    finally:
        os.umask(old)
    written = [p for p in (tmp_path / "run").rglob("*") if p.is_file() and p.suffix in (".pt", ".yaml")]
    assert {p.name for p in written} >= {"last.pt", "config.yaml"}
    assert {stat.S_IMODE(p.stat().st_mode) for p in written} == {0o666 & ~umask}


@pytest.mark.parametrize("sharded", [False, True], ids=["files", "fsdp"])
def test_pruning_and_tidying_never_touch_a_users_own_files(tmp_path, sharded):
    """A user's files beside the checkpoints (notes, an export, a copy of the best one, a backup of a step
    directory), newer than every checkpoint, survive a resume's tidying and every later pruning; only ampkit's own
    names (step-NNNNNNNN, epoch-NNNN, best-NNNNNNNN) are pruned, and the newest of them are the ones kept."""
    import shutil

    quiet = {"logging.tensorboard": False, "trainer.progress_bar": False, "trainer.device": "cpu",
             "checkpoint.every_n_steps": 4, "checkpoint.every_n_epochs": 0, "checkpoint.keep_last": 2,
             "checkpoint.monitor": "val/mse",
             "checkpoint.save_top_k": 2}  # fmt: skip
    if sharded:
        quiet["distributed.strategy"] = "fsdp"
    trainer = ToyTrainer(toy_cfg(tmp_path, **quiet, **{"trainer.max_epochs": 1}))
    trainer.fit()
    checkpoints = trainer.version_dir / "checkpoints"
    mine = ["my-notes.pt", "final-model.pt", "best-for-paper.pt", "step-00000004.pt.bak", "epoch-final.pt"]
    for name in mine:
        (checkpoints / name).write_bytes(b"the user's")
    if sharded:
        newest = max(p for p in checkpoints.iterdir() if p.name.startswith("step-"))
        shutil.copytree(newest, checkpoints / "backup-step")
        mine.append("backup-step")
    ToyTrainer(toy_cfg(tmp_path, **quiet, **{"trainer.max_epochs": 1})).fit(resume="last")  # finished: a no-op
    ToyTrainer(toy_cfg(tmp_path, **quiet, **{"trainer.max_epochs": 3})).fit(resume="last")  # trains and prunes
    names = {p.name for p in checkpoints.iterdir()}
    assert set(mine) <= names
    periodic = sorted(n for n in names if re.fullmatch(r"step-\d{8}(\.pt)?", n))
    assert periodic == [f"step-{s:08d}" + ("" if sharded else ".pt") for s in (20, 24)]


class _SigtermAt(ampkit.Callback):
    def __init__(self, step: int, times: int = 1) -> None:
        self.step, self.times = step, times

    def on_train_batch_end(self, trainer, outputs, batch) -> None:
        if trainer.state.global_step == self.step:
            for _ in range(self.times):
                os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("times", [1, 2], ids=["once", "twice"])
def test_a_sigterm_saves_the_step_it_stops_at_and_the_resume_is_bit_identical(tmp_path, times):
    """A preemption at step 5, with a checkpoint only at epoch ends, lost steps 1-5; now step 5 is saved mid-epoch
    (as no early stop) and the resumed run ends equal to one never stopped; SIGTERM's handler is put back. Twice:
    Slurm signals every process of a job step, so a rank gets one from Slurm and one from torchrun's agent."""
    quiet = {"logging.tensorboard": False, "trainer.progress_bar": False, "trainer.max_epochs": 2}
    full = ToyTrainer(toy_cfg(tmp_path / "full", **quiet))
    full.fit()
    with pytest.raises(ampkit.Preempted, match="SIGTERM: stopped at step 5"):  # a KeyboardInterrupt, told apart
        ToyTrainer(toy_cfg(tmp_path / "cut", **quiet), callbacks=[_SigtermAt(5, times)]).fit()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    last = load_checkpoint(tmp_path / "cut" / "run" / "version_0" / "checkpoints" / "last.pt")
    assert last["loop"] == {"epoch": 0, "batches_done": 5, "global_step": 5} and last["stopped_early"] is None
    resumed = ToyTrainer(toy_cfg(tmp_path / "cut", **quiet))
    resumed.fit(resume="last")
    assert resumed.version_dir == tmp_path / "cut" / "run" / "version_0"
    assert_same_checkpoint(
        load_checkpoint(resumed.version_dir / "checkpoints" / "last.pt"),
        load_checkpoint(full.version_dir / "checkpoints" / "last.pt"),
    )


def test_a_sigterm_the_caller_ignores_stays_ignored_during_fit(tmp_path):
    quiet = {"logging.tensorboard": False, "trainer.progress_bar": False, "trainer.max_steps": 6}
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        trainer = ToyTrainer(toy_cfg(tmp_path, **quiet), callbacks=[_SigtermAt(2)])
        trainer.fit()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert trainer.state.global_step == 6


def test_a_sigterm_handler_installed_before_fit_still_hears_it(tmp_path):
    """fit() replaced the caller's SIGTERM handler (submitit's, a scheduler wrapper's) until it returned, so a
    preemption's notice never reached it; now it hears every SIGTERM, the step is saved, and it is put back."""
    heard = []

    def note(signum, frame):
        heard.append(signum)

    previous = signal.signal(signal.SIGTERM, note)
    quiet = {"logging.tensorboard": False, "trainer.progress_bar": False, "trainer.max_epochs": 2}
    try:
        with pytest.raises(ampkit.Preempted, match="SIGTERM: stopped at step 5"):
            ToyTrainer(toy_cfg(tmp_path, **quiet), callbacks=[_SigtermAt(5, times=2)]).fit()
        assert heard == [signal.SIGTERM, signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is note
    finally:
        signal.signal(signal.SIGTERM, previous)
    last = load_checkpoint(tmp_path / "run" / "version_0" / "checkpoints" / "last.pt")
    assert last["loop"] == {"epoch": 0, "batches_done": 5, "global_step": 5}


@pytest.mark.parametrize("step", [5, 16], ids=["mid-run", "last-step"])
def test_a_previous_sigterm_handler_that_exits_does_so_after_the_step_is_saved(tmp_path, step):
    """A handler that calls sys.exit raised SystemExit wherever the signal landed: mid-step, nothing saved since the
    last checkpoint (under torchrun, the other ranks left waiting). Its exit now comes once the step it stops at is
    saved, with its own status; on the run's last step, once the run has ended as it would have."""

    def exit_3(signum, frame):
        sys.exit(3)

    previous = signal.signal(signal.SIGTERM, exit_3)
    quiet = {"logging.tensorboard": False, "trainer.progress_bar": False, "trainer.max_epochs": 2}
    try:
        with pytest.raises(SystemExit) as exited:
            ToyTrainer(toy_cfg(tmp_path, **quiet), callbacks=[_SigtermAt(step)]).fit()
        assert signal.getsignal(signal.SIGTERM) is exit_3
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert exited.value.code == 3
    last = load_checkpoint(tmp_path / "run" / "version_0" / "checkpoints" / "last.pt")
    assert last["loop"]["global_step"] == step and last["stopped_early"] is None
    assert not (tmp_path / "run" / "version_0" / "run.lock").exists()


class _SigtermThenFails(ampkit.Callback):
    def on_train_batch_end(self, trainer, outputs, batch) -> None:
        if trainer.state.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
            raise RuntimeError("the step failed")


def test_a_failure_before_the_stop_is_not_hidden_by_the_held_exit(tmp_path):
    """The held SystemExit of a previous handler would end the process quietly, hiding a failure that came before
    the stop; the failure is raised, noting the exit it cut short."""

    def exit_3(signum, frame):
        sys.exit(3)

    previous = signal.signal(signal.SIGTERM, exit_3)
    quiet = {"logging.tensorboard": False, "trainer.progress_bar": False, "trainer.max_epochs": 2}
    try:
        with pytest.raises(RuntimeError, match="the step failed") as failed:
            ToyTrainer(toy_cfg(tmp_path, **quiet), callbacks=[_SigtermThenFails()]).fit()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "had raised SystemExit(3), held until fit() ended" in "".join(failed.value.__notes__)


def test_a_sigterm_handler_installed_outside_python_is_left_in_place(tmp_path, monkeypatch):
    """``signal.getsignal`` answers None for a handler a C host installed; Python could not put it back after fit()
    (``signal.signal(SIGTERM, None)`` is a TypeError), so fit() leaves SIGTERM alone there."""
    monkeypatch.setattr(signal, "getsignal", lambda signum: None if signum == signal.SIGTERM else signal.SIG_DFL)
    installed = []
    real_signal = signal.signal
    monkeypatch.setattr(
        signal, "signal", lambda signum, handler: installed.append(signum) or real_signal(signum, handler)
    )
    quiet = {"logging.tensorboard": False, "trainer.progress_bar": False, "trainer.max_steps": 2}
    trainer = ToyTrainer(toy_cfg(tmp_path, **quiet))
    trainer.fit()
    assert trainer.state.global_step == 2 and signal.SIGTERM not in installed


@pytest.mark.parametrize("during", ["train", "validation"])
def test_a_sigterm_to_the_whole_process_group_spares_the_loader_workers_and_saves_the_step(tmp_path, during):
    """Slurm signals every process of a job step and torchrun's agent each rank's process group, DataLoader workers
    included: they died of it, and the run failed with torch's 'DataLoader worker (pid N) is killed by signal:
    Terminated' and saved nothing. Now the workers (persistent ones, a validation's, with the loader's own
    worker_init_fn) keep serving, the step is saved, the exit status is 143 and --resume last finishes the run.
    SIGTERM (what Slurm or Kubernetes send before a kill) once killed the process silently with its lock held; it
    unwinds as an interrupt, with the resume hint, and the lock released."""
    settings = {"trainer_class": "toy_trainers:WorkersToyTrainer", "run_dir": str(tmp_path / "run"),
                "trainer": {"max_epochs": 2, "device": "cpu", "progress_bar": False, "val_every_n_steps": 4},
                "logging": {"tensorboard": False}}  # fmt: skip
    cfg_path = tmp_path / "toy.yaml"
    OmegaConf.save(OmegaConf.create(settings), cfg_path)
    env = child_env(TESTS, REPO, AMPKIT_TEST_GROUP_SIGTERM=during)
    cut = subprocess.run(_cli(cfg_path), cwd=TESTS, env=env, capture_output=True, text=True, timeout=120,
                         start_new_session=True)  # fmt: skip
    step = 3 if during == "train" else 4
    assert cut.returncode == 143, cut.stderr
    assert f"ampkit: SIGTERM: stopping at step {step}" in cut.stderr and "DataLoader worker" not in cut.stderr
    assert "ampkit: terminated (SIGTERM) (--resume last continues from" in cut.stderr
    assert not (tmp_path / "run" / "version_0" / "run.lock").exists()
    last = tmp_path / "run" / "version_0" / "checkpoints" / "last.pt"
    assert load_checkpoint(last)["loop"] == {"epoch": 0, "batches_done": step, "global_step": step}
    # The resume sends no signal: it runs here, through the same command, without a fresh interpreter's imports.
    assert main(["fit", "--config", str(cfg_path), "--resume", "last"]) == 0
    assert load_checkpoint(last)["loop"]["global_step"] == 16


class _WorkerPids(torch.utils.data.Dataset):
    """Each sample: the pid of the worker that read it, and whether its loader's own worker_init_fn ran there."""

    init_ran = False

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, index: int) -> tuple[int, bool]:
        return os.getpid(), _WorkerPids.init_ran


def _note_init(worker_id: int) -> None:
    _WorkerPids.init_ran = True


def test_a_loader_worker_ignores_another_process_sigterm_yet_ends_on_its_own_process_sigterm():
    """What the workers of a preempted run need: a SIGTERM from another process (a scheduler's, to every process)
    leaves the worker serving; one from the process that started it (torch's terminate() at shutdown and at exit)
    still ends it at once, with status 0 as torch's own handler does."""
    from torch.utils.data import DataLoader

    from ampkit.trainer.loader_workers import iterate

    loader = DataLoader(
        _WorkerPids(), batch_size=None, num_workers=1, worker_init_fn=_note_init, persistent_workers=True
    )
    batches = iterate(loader)
    pid, init_ran = next(batches)
    assert init_ran
    kill = f"import os, signal; os.kill({pid}, signal.SIGTERM)"
    subprocess.run([sys.executable, "-c", kill], start_new_session=True, check=True, timeout=30)
    time.sleep(0.3)
    assert next(batches)[0] == pid
    worker = next(w for w in batches._workers if w.pid == pid)
    os.kill(pid, signal.SIGTERM)
    worker.join(timeout=10)
    assert worker.exitcode == 0
    batches._shutdown_workers()


def test_a_process_that_leaves_persistent_loader_workers_running_still_exits():
    """At interpreter exit multiprocessing terminate()s and then joins the workers still alive (persistent ones): the
    policy must let that SIGTERM end them, or the exit would hang."""
    script = (
        "from torch.utils.data import DataLoader\n"
        "from ampkit.trainer.loader_workers import iterate\n"
        "loader = DataLoader(range(100), num_workers=2, persistent_workers=True)\n"
        "batches = iterate(loader)\n"
        "next(batches)\n"
        "print('read')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], env=child_env(REPO), capture_output=True, text=True,
                          timeout=30)  # fmt: skip
    assert done.returncode == 0 and done.stdout == "read\n", done.stderr


class _KeptLoadersToyTrainer(ToyTrainer):
    """Loaders with workers that the trainer's caller keeps (and may iterate again after fit)."""

    def train_dataloader(self):
        self.kept_train = DataLoader(
            toy_dataset(self.cfg.data.n), batch_size=8, num_workers=1, worker_init_fn=_note_init
        )
        return self.kept_train

    def val_dataloader(self):
        self.kept_val = DataLoader(toy_dataset(24, seed=7), batch_size=8, num_workers=1, persistent_workers=True)
        return self.kept_val


def test_fit_leaves_the_callers_loaders_as_it_found_them(tmp_path):
    """fit() set its worker SIGTERM policy as the worker_init_fn of the caller's own DataLoaders for good: iterated
    again after fit(), their workers ignored a scheduler's SIGTERM. The policy now applies only while fit() starts
    their workers."""
    quiet = {"logging.tensorboard": False, "trainer.progress_bar": False, "trainer.max_steps": 3}
    trainer = _KeptLoadersToyTrainer(toy_cfg(tmp_path, **quiet, **{"trainer.val_every_n_steps": 2}))
    trainer.fit()
    assert trainer.kept_train.worker_init_fn is _note_init
    assert trainer.kept_val.worker_init_fn is None


class _PersistentWorkersToyTrainer(ToyTrainer):
    def train_dataloader(self):
        return DataLoader(toy_dataset(self.cfg.data.n), batch_size=8, shuffle=True, num_workers=1,
                          persistent_workers=True)  # fmt: skip

    def val_dataloader(self):
        return DataLoader(toy_dataset(24, seed=7), batch_size=8, num_workers=1, persistent_workers=True)


def test_a_resume_at_an_epoch_end_with_persistent_workers_is_bit_identical(tmp_path):
    """Persistent workers draw their seed from torch's RNG when they start: in the first epoch of a run only, so the
    resumed run drew once more than the run it continues, and its dropout (and so its weights) went another way."""
    quiet = {"logging.tensorboard": False, "trainer.progress_bar": False}
    full = _PersistentWorkersToyTrainer(toy_cfg(tmp_path / "full", **quiet, **{"trainer.max_epochs": 2}))
    full.fit()
    _PersistentWorkersToyTrainer(toy_cfg(tmp_path / "cut", **quiet, **{"trainer.max_epochs": 1})).fit()
    resumed = _PersistentWorkersToyTrainer(toy_cfg(tmp_path / "cut", **quiet, **{"trainer.max_epochs": 2}))
    resumed.fit(resume="last")
    assert_same_checkpoint(
        load_checkpoint(resumed.version_dir / "checkpoints" / "last.pt"),
        load_checkpoint(full.version_dir / "checkpoints" / "last.pt"),
    )


class _LogsBatchIndexPerEpoch(ToyTrainer):
    def training_step(self, batch):
        self.log("index", torch.tensor(float(self.state.batch_idx)), on_step=False, on_epoch=True)
        return super().training_step(batch)


def test_an_epoch_mean_of_log_on_epoch_spans_a_mid_epoch_resume(tmp_path):
    """The sums of log(on_epoch=True) are saved: resumed after batch 3 of 8, the epoch's mean index was 5 (the mean
    of batches 3..7 only) where the uninterrupted run's is 3.5."""
    quiet = {"logging.tensorboard": False, "trainer.max_epochs": 1}
    full = _LogsBatchIndexPerEpoch(toy_cfg(tmp_path / "full", **quiet))
    full.fit()
    _LogsBatchIndexPerEpoch(toy_cfg(tmp_path / "cut", **quiet, **{"trainer.max_steps": 3})).fit()
    resumed = _LogsBatchIndexPerEpoch(toy_cfg(tmp_path / "cut", **quiet))
    resumed.fit(resume="last")
    assert full.epoch_scalars == {"index": 3.5} and resumed.epoch_scalars == full.epoch_scalars


class FreezesItsFirstLayerAtStep4(ToyTrainer):
    """Freezes a layer in its own on_train_batch_end, as a schedule of unfreezing (or freezing) is often written."""

    def on_train_batch_end(self, outputs, batch):
        if self.state.global_step == 4:
            self.module[0].weight.requires_grad_(False)


def test_a_change_the_trainer_s_own_batch_end_makes_at_a_checkpoint_s_step_is_in_that_checkpoint(tmp_path):
    """The step-4 checkpoint was saved before the Trainer's own on_train_batch_end froze the layer, and a resume from it
    (which never runs step 4's hooks again) trained the layer the uninterrupted run had frozen."""
    settings = {"logging.tensorboard": False, "trainer.progress_bar": False, "checkpoint.every_n_steps": 4,
                "checkpoint.keep_last": 9}  # fmt: skip
    FreezesItsFirstLayerAtStep4(toy_cfg(tmp_path, **settings)).fit()
    step_4 = tmp_path / "run" / "version_0" / "checkpoints" / "step-00000004.pt"
    resumed = FreezesItsFirstLayerAtStep4(toy_cfg(tmp_path, **settings))
    resumed.fit(resume=step_4)
    assert not resumed.module[0].weight.requires_grad
    torch.testing.assert_close(resumed.module[0].weight.detach(), load_checkpoint(step_4)["model"]["0.weight"])


def test_a_storage_failure_is_told_from_a_permission_refusal_also_when_dcp_gathered_it_from_a_rank():
    """ampkit fit's status 74 (the disk failed: retry once there is room, or elsewhere) reads storage_errno; a sharded
    save's failure comes as DCP's CheckpointException gathering each rank's error, the OSError behind it."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from ampkit.trainer.checkpoint_io import from_storage, storage_errno

    def raised(exc: BaseException):
        try:
            raise exc
        except BaseException as caught:
            return _wrap_exception(caught)

    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    gathered = CheckpointException("save failed", {0: raised(ValueError("a bug")), 1: raised(quota)})
    assert storage_errno(gathered) == errno.EDQUOT
    assert storage_errno(CheckpointException("save failed", {0: raised(ValueError("a bug"))})) is None
    for code in (errno.ENOSPC, errno.EIO, errno.EROFS):
        assert storage_errno(OSError(code, os.strerror(code))) == code
    assert storage_errno(PermissionError(errno.EACCES, "write-protected")) is None
    error = from_storage(CheckpointError("could not write checkpoint"), quota)
    assert pickle.loads(pickle.dumps(error)).storage_errno == errno.EDQUOT  # as it travels to the other ranks


def test_a_checkpoints_folder_replaced_by_a_file_mid_run_is_named_and_the_file_kept(tmp_path):
    """A file put in the checkpoints folder's place while the run trains stopped the next save with mkdir's bare
    'File exists' and advice to free space; the line names the file now, which ampkit leaves as it is."""

    class FolderBecomesFile(ToyTrainer):
        def on_train_batch_end(self, outputs, batch) -> None:
            if self.state.global_step == 3:
                checkpoints = self.version_dir / "checkpoints"
                shutil.rmtree(checkpoints)
                checkpoints.write_text("my file")

    settings = {"trainer.max_epochs": 2, "logging.tensorboard": False, "checkpoint.every_n_steps": 2}
    run = FolderBecomesFile(toy_cfg(tmp_path, **settings))
    with pytest.raises(CheckpointError, match=r"\('.*/checkpoints' is a file now, not the checkpoints folder; "):
        run.fit()
    assert (run.version_dir / "checkpoints").read_text() == "my file"


@pytest.mark.parametrize("deleted", ["folder", "last.pt"])
def test_a_full_disk_after_the_checkpoints_were_deleted_mid_run_says_so(tmp_path, monkeypatch, deleted):
    """The user deletes the checkpoints folder (or last.pt) while the run trains, then the next save finds the disk
    full: the line says the run's checkpoint was deleted and what is left, where it said 'this run has no checkpoint
    yet', advice for a run that never saved."""

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    class DeletesThenFills(ToyTrainer):
        def on_train_batch_end(self, outputs, batch) -> None:
            if self.state.global_step == 3:
                checkpoints = self.version_dir / "checkpoints"
                shutil.rmtree(checkpoints) if deleted == "folder" else (checkpoints / "last.pt").unlink()
                monkeypatch.setattr(torch, "save", full)

    settings = {"trainer.max_epochs": 1, "logging.tensorboard": False, "checkpoint.every_n_steps": 2}
    run = DeletesThenFills(toy_cfg(tmp_path, **settings))
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    left = (
        ", and no other checkpoint of the run is left: free space (or get write access) and start it again"
        if deleted == "folder"
        else f"; '{checkpoints / 'step-00000002.pt'}' is the newest checkpoint left: resume it by its path"
    )
    said = f"(No space left on device); '{checkpoints / 'last.pt'}' was deleted while the run trained"
    with pytest.raises(CheckpointError, match=re.escape(said + left)) as raised:
        run.fit()
    assert raised.value.__notes__[-1].endswith(
        f"the newest checkpoint, '{checkpoints / 'last.pt'}', was deleted while the run trained"
    )
