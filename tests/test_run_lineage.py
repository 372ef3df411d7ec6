"""A run directory's rules (ampkit/trainer/run_life.py): a finished run resumed writes nothing, a resume from
an older checkpoint branches into a new version_N, predict never writes over a checkpoint, one live run per
version directory."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from checkpoint_compare import assert_same_checkpoint
from omegaconf import OmegaConf
from torch.utils.data import DataLoader
from toy_trainers import ToyTrainer, toy_cfg, toy_dataset

import ampkit
from ampkit.trainer.checkpoint_io import load_checkpoint
from ampkit.trainer.run_life import LOCK_FILE, RunDirectoryError

QUIET = {"logging.tensorboard": False, "trainer.progress_bar": False}


def _files(root) -> dict:
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()}


def test_resuming_a_finished_run_writes_nothing_and_says_so(tmp_path, capsys):
    cfg = toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 6, "checkpoint.every_n_steps": 2})
    ToyTrainer(cfg).fit()
    before = _files(tmp_path / "run")
    resumed = ToyTrainer(cfg)
    resumed.fit(resume="last")
    assert _files(tmp_path / "run") == before
    assert resumed.state.global_step == 6
    assert "nothing to train" in capsys.readouterr().err


@pytest.mark.parametrize("noop_resumes", [0, 1])
def test_extending_a_finished_run_continues_from_its_exact_state(tmp_path, noop_resumes):
    """A finished run (max_steps mid-epoch) resumed with a larger max_steps ends where one longer run ends:
    every key of the final checkpoint, RNG included, also after a no-op resume of the finished run."""
    common = {**QUIET, "checkpoint.every_n_steps": 2}
    ToyTrainer(toy_cfg(tmp_path / "short", **common, **{"trainer.max_steps": 6})).fit()
    for _ in range(noop_resumes):
        ToyTrainer(toy_cfg(tmp_path / "short", **common, **{"trainer.max_steps": 6})).fit(resume="last")
    longer = toy_cfg(tmp_path / "short", **common, **{"trainer.max_steps": 13, "trainer.max_epochs": 3})
    extended = ToyTrainer(longer)
    extended.fit(resume="last")
    assert extended.version_dir.name == "version_0"
    straight = ToyTrainer(
        toy_cfg(tmp_path / "straight", **common, **{"trainer.max_steps": 13, "trainer.max_epochs": 3})
    )
    straight.fit()
    assert_same_checkpoint(
        load_checkpoint(extended.version_dir / "checkpoints" / "last.pt"),
        load_checkpoint(straight.version_dir / "checkpoints" / "last.pt"),
    )


def test_resume_from_an_older_checkpoint_branches_and_leaves_the_run_intact(tmp_path):
    common = {**QUIET, "trainer.max_epochs": 2, "trainer.max_steps": 12, "checkpoint.every_n_steps": 1}
    original = ToyTrainer(toy_cfg(tmp_path, **common, **{"checkpoint.keep_last": 3}))
    original.fit()
    version_0 = original.version_dir
    before = _files(version_0)
    older = version_0 / "checkpoints" / "step-00000010.pt"
    branch = ToyTrainer(toy_cfg(tmp_path, **common, **{"checkpoint.keep_last": 1, "trainer.clip_grad_norm": 0.01}))
    branch.fit(resume=older)
    assert _files(version_0) == before  # nothing of the original lineage rewritten or pruned
    assert branch.version_dir == tmp_path / "run" / "version_1"
    record = OmegaConf.load(branch.version_dir / "lineage.yaml")
    assert record.branched_from == str(older) and record.global_step == 10
    assert (branch.version_dir / "config.yaml").read_text().startswith(f"# branched from {older}")
    assert load_checkpoint(branch.version_dir / "checkpoints" / "last.pt")["loop"]["global_step"] == 12
    # The branch's last.pt continues in place.
    again = ToyTrainer(toy_cfg(tmp_path, **{**common, "trainer.max_steps": 14, "trainer.max_epochs": 3}))
    again.fit(resume="last")
    assert again.version_dir == branch.version_dir


def test_the_branch_is_named_in_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    common = {
        "trainer.progress_bar": False,
        "trainer.max_epochs": 1,
        "checkpoint.every_n_steps": 2,
        "checkpoint.keep_last": 9,
    }
    first = ToyTrainer(toy_cfg(tmp_path, **common))
    first.fit()
    branch = ToyTrainer(toy_cfg(tmp_path, **common))
    branch.fit(resume=first.version_dir / "checkpoints" / "step-00000004.pt")
    events = EventAccumulator(str(branch.version_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert "run/lineage/text_summary" in events.Tags()["tensors"]


class Predicting(ToyTrainer):
    def predict_dataloader(self):
        return DataLoader(toy_dataset(10, seed=11), batch_size=4)


def test_predict_output_never_overwrites_a_checkpoint(tmp_path, capsys):
    from ampkit.cli import main

    config = tmp_path / "toy.yaml"
    OmegaConf.save({"trainer_class": "test_run_lineage:Predicting", "run_dir": str(tmp_path / "run"),
                    "trainer": {"max_epochs": 1, "progress_bar": False}, "logging": {"tensorboard": False}},
                   config)  # fmt: skip
    assert main(["fit", "--config", str(config)]) == 0
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    kept = _files(checkpoints)
    outside = tmp_path / "copy.pt"
    outside.write_bytes((checkpoints / "last.pt").read_bytes())
    for output in (checkpoints / "last.pt", checkpoints / "preds.pt", outside):
        capsys.readouterr()
        assert main(["predict", "--config", str(config), "--output", str(output)]) == 2
        err = capsys.readouterr().err
        assert f"predict --output '{output}': refusing to write there" in err and "Traceback" not in err
    assert _files(checkpoints) == kept and outside.read_bytes() == (checkpoints / "last.pt").read_bytes()
    # An existing directory, or a path ending in "/", gets predictions.pt inside it.
    for output, written in [
        (str(tmp_path), tmp_path / "predictions.pt"),
        (f"{tmp_path}/new/", tmp_path / "new" / "predictions.pt"),
    ]:
        assert main(["predict", "--config", str(config), "--output", output]) == 0
        assert f"saved to {written}" in capsys.readouterr().out
        assert [p.shape[0] for p in torch.load(written)] == [4, 4, 2]


def test_a_second_live_run_in_the_same_version_directory_is_refused(tmp_path):
    cfg = toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 1})
    ToyTrainer(cfg).fit()
    refusals = []

    class StartAnother(ampkit.Callback):
        def on_train_start(self, trainer) -> None:
            with pytest.raises(RunDirectoryError) as info:
                ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 3})).fit(resume="last")
            refusals.append(str(info.value))

    first = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 2}), callbacks=[StartAnother()])
    first.fit(resume="last")
    (message,) = refusals
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in message and "in use" in message
    assert not (first.version_dir / LOCK_FILE).exists()  # released at the end
    assert load_checkpoint(first.version_dir / "checkpoints" / "last.pt")["loop"]["epoch"] == 2


def test_a_stale_lock_is_taken_over_and_a_foreign_host_s_is_refused(tmp_path):
    cfg = toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 1})
    first = ToyTrainer(cfg)
    first.fit()
    lock = first.version_dir / LOCK_FILE
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a SIGKILLed run's pid: no longer running
    lock.write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname(), "since": "earlier"}))
    ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 2})).fit(resume="last")
    assert not lock.exists()
    lock.write_text(json.dumps({"pid": 1, "host": "elsewhere", "since": "earlier"}))
    with pytest.raises(RunDirectoryError, match="pid 1 on host elsewhere"):
        ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 3})).fit(resume="last")
    assert lock.exists()  # someone else's: left alone


def test_a_resume_with_a_changed_config_names_each_changed_key(tmp_path):
    ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 1})).fit()
    changed = {"trainer.max_epochs": 2, "data.batch_size": 4, "trainer.clip_grad_norm": 1.0}
    with pytest.warns(
        UserWarning, match="changed config: data.batch_size: 8 -> 4; trainer.clip_grad_norm: None -> 1.0"
    ):
        ToyTrainer(toy_cfg(tmp_path, **QUIET, **changed)).fit(resume="last")
