"""A run directory's rules (ampkit/trainer/run_life.py): a finished run resumed writes nothing, a resume from
an older checkpoint branches into a new version_N, predict never writes over a checkpoint, one live run per
version directory."""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from checkpoint_compare import assert_same_checkpoint
from omegaconf import OmegaConf
from torch.utils.data import DataLoader
from torn_checkpoint import tear
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


@pytest.mark.parametrize("sharded", [False, True], ids=["files", "fsdp"])
def test_a_branch_from_best_with_a_top_k_ranks_its_own_checkpoints(tmp_path, sharded):
    """``--resume best`` with ``save_top_k=2`` (training got worse, go back): the restored ranking named files of
    the original version directory, and the branch's first best-k save failed on it, every retry alike."""
    common = {**QUIET, "checkpoint.monitor": "val/mse", "checkpoint.save_top_k": 2, "trainer.device": "cpu"}
    if sharded:
        common["distributed.strategy"] = "fsdp"
    ToyTrainer(toy_cfg(tmp_path, **common, **{"trainer.max_epochs": 3})).fit()
    branch = ToyTrainer(toy_cfg(tmp_path, **common, **{"trainer.max_epochs": 5}))
    branch.fit(resume="best")
    assert branch.version_dir.name == "version_1"
    names = {p.name for p in (branch.version_dir / "checkpoints").iterdir()}
    ranked = [n for n in names if re.fullmatch(r"best-\d{8}(\.pt)?", n)]
    checkpoints = branch.version_dir / "checkpoints"
    assert 1 <= len(ranked) <= 2
    assert (checkpoints / ("best" if sharded else "best.pt")).exists()  # one of them, not dangling


class TiedScores(ToyTrainer):
    """A validation score that ties: step 8 and 10 score what step 4 did."""

    SCORES = {2: 3.0, 4: 1.0, 6: 2.0, 8: 1.0, 10: 1.0}

    def validation_step(self, batch):
        return {"score": self.SCORES.get(self.state.global_step, 9.0)}  # 9: the sanity check


@pytest.mark.parametrize("sharded", [False, True], ids=["files", "fsdp"])
@pytest.mark.parametrize(("top_k", "kept"), [(1, ["best-00000004"]), (2, ["best-00000004", "best-00000008"])])
def test_a_branch_keeps_on_a_tie_what_the_run_it_branched_from_keeps(tmp_path, sharded, top_k, kept):
    """A branch from step 6 ranked afresh in its new version directory, so step 8's score, equal to step 4's, entered
    its top k where the uninterrupted run kept step 4 (a tie does not displace): it continues the saved ranking, with
    copies of the ranked files, and the run it branched from is left as it was."""
    settings = {
        **QUIET,
        "checkpoint.monitor": "val/score",
        "checkpoint.save_top_k": top_k,
        "checkpoint.every_n_steps": 2,
        "checkpoint.keep_last": 9,
        "trainer.val_every_n_steps": 2,
        "trainer.max_steps": 10,
        "trainer.max_epochs": 2,
        **({"distributed.strategy": "fsdp"} if sharded else {}),
    }
    straight = TiedScores(toy_cfg(tmp_path, **settings))
    straight.fit()
    before = _files(straight.version_dir)
    branch = TiedScores(toy_cfg(tmp_path, **settings))
    branch.fit(resume=straight.version_dir / "checkpoints" / ("step-00000006" + ("" if sharded else ".pt")))
    assert branch.version_dir.name == "version_1" and _files(straight.version_dir) == before

    def ranked(run) -> list[str]:
        names = (p.name for p in (run.version_dir / "checkpoints").iterdir())
        return sorted(n.removesuffix(".pt") for n in names if re.fullmatch(r"best-\d{8}(\.pt)?", n))

    assert ranked(straight) == ranked(branch) == kept
    best = branch.version_dir / "checkpoints" / ("best" if sharded else "best.pt")
    part = best / "trainer.pt" if sharded else best
    assert load_checkpoint(part)["loop"]["global_step"] == 4
    assert [Path(p).parent for p in branch.callbacks[-1].best_k_models] == [best.parent] * top_k


def test_a_branch_whose_ranked_file_is_gone_keeps_its_value_and_names_it(tmp_path):
    """A ranked file pruned (here deleted) from the run branched from since cannot be copied: it stays ranked by its
    value, so the tie at step 8 still does not enter, and a warning names it."""
    settings = {
        **QUIET,
        "checkpoint.monitor": "val/score",
        "checkpoint.every_n_steps": 2,
        "checkpoint.keep_last": 9,
        "trainer.val_every_n_steps": 2,
        "trainer.max_steps": 10,
        "trainer.max_epochs": 2,
    }
    straight = TiedScores(toy_cfg(tmp_path, **settings))
    straight.fit()
    (straight.version_dir / "checkpoints" / "best-00000004.pt").unlink()
    branch = TiedScores(toy_cfg(tmp_path, **settings))
    with pytest.warns(UserWarning, match=r"names best-00000004\.pt, no longer in '.*version_0/checkpoints'"):
        branch.fit(resume=straight.version_dir / "checkpoints" / "step-00000006.pt")
    assert list(branch.callbacks[-1].best_k) == ["best-00000004.pt"]
    assert not list((branch.version_dir / "checkpoints").glob("best*"))


def test_a_branch_whose_ranked_name_holds_a_folder_of_the_users_keeps_it_and_says_what_it_may_be(tmp_path):
    """A folder of the user's where a ranked file was is no checkpoint to copy: it stays as it was, the ranking keeps
    the value, and the warning says the name holds something else, not only that the file is gone."""
    settings = {**QUIET, "checkpoint.monitor": "val/score", "checkpoint.every_n_steps": 2, "checkpoint.keep_last": 9,
                "trainer.val_every_n_steps": 2, "trainer.max_steps": 10, "trainer.max_epochs": 2}  # fmt: skip
    straight = TiedScores(toy_cfg(tmp_path, **settings))
    straight.fit()
    ranked = straight.version_dir / "checkpoints" / "best-00000004.pt"
    ranked.unlink()
    ranked.mkdir()
    (ranked / "notes.txt").write_text("mine")
    branch = TiedScores(toy_cfg(tmp_path, **settings))
    with pytest.warns(UserWarning, match=r"best-00000004\.pt, no longer in '.*' as that step's checkpoint \(deleted"):
        branch.fit(resume=straight.version_dir / "checkpoints" / "step-00000006.pt")
    assert list(branch.callbacks[-1].best_k) == ["best-00000004.pt"] and (ranked / "notes.txt").read_text() == "mine"


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


def test_predict_on_fewer_ranks_refuses_an_output_whose_earlier_shards_would_be_mixed_in(tmp_path):
    """preds.rank2.pt of an earlier predict on 4 ranks beside a 2-rank one's output: a reader of preds.rank*.pt
    would take 4 shards and interleave wrong rows. Refused (rank zero's check, which a 2-rank predict agrees on
    before anything runs: tests/test_distributed.py); one process writes preds.pt."""
    from ampkit.trainer.run_life import prediction_output

    shards = {tmp_path / f"preds.rank{rank}.pt": f"shard {rank}".encode() for rank in range(4)}
    for shard, content in shards.items():
        shard.write_bytes(content)
    cfg = toy_cfg(tmp_path, **{"trainer.progress_bar": False, "logging.tensorboard": False})
    message = "preds.rank2.pt, preds.rank3.pt beside it hold the shards of an earlier predict on more ranks"
    with pytest.raises(RunDirectoryError, match=re.escape(f"predict --output '{tmp_path / 'preds.pt'}': {message}")):
        prediction_output(tmp_path / "preds.pt", None, world_size=2)
    assert all(shard.read_bytes() == content for shard, content in shards.items())
    Predicting(cfg).predict(output=tmp_path / "preds.pt")
    assert (tmp_path / "preds.pt").is_file()


def test_predict_output_through_a_symlink_updates_the_file_it_leads_to_and_keeps_the_link(tmp_path):
    """The atomic rename used to replace the user's link with a file, leaving old predictions where it led."""
    target = tmp_path / "shared" / "preds.pt"
    target.parent.mkdir()
    target.write_bytes(b"old predictions")
    link = tmp_path / "preds.pt"
    link.symlink_to(target)
    predictions = Predicting(toy_cfg(tmp_path, **QUIET)).predict(output=link, overwrite=True)
    assert link.is_symlink() and link.resolve() == target
    torch.testing.assert_close(torch.load(target, weights_only=True), predictions)


def test_predict_replaces_an_existing_output_only_with_overwrite_never_a_read_only_one(tmp_path, capsys):
    """An existing predictions file of the user's was replaced silently; a read-only one too (os.replace ignores the
    mode). Refused before anything runs, naming the way out; --overwrite replaces it whole."""
    from ampkit.cli import main

    config = tmp_path / "toy.yaml"
    OmegaConf.save({"trainer_class": "test_run_lineage:Predicting", "run_dir": str(tmp_path / "run"),
                    "trainer": {"max_steps": 2, "progress_bar": False}, "logging": {"tensorboard": False}},
                   config)  # fmt: skip
    assert main(["fit", "--config", str(config)]) == 0
    mine = tmp_path / "preds.pt"
    mine.write_bytes(b"the user's own predictions")
    capsys.readouterr()
    assert main(["predict", "--config", str(config), "--output", str(mine)]) == 2
    assert f"'{mine}' exists already; pass --overwrite" in capsys.readouterr().err
    assert mine.read_bytes() == b"the user's own predictions"
    assert main(["predict", "--config", str(config), "--output", str(mine), "--overwrite"]) == 0
    assert [p.shape[0] for p in torch.load(mine)] == [4, 4, 2]
    mine.chmod(0o444)
    kept = mine.read_bytes()
    capsys.readouterr()
    assert main(["predict", "--config", str(config), "--output", str(mine), "--overwrite"]) == 2
    assert f"'{mine}' is write-protected" in capsys.readouterr().err and mine.read_bytes() == kept


class OutputTakenMidway(Predicting):
    """Another process writes the output file while this predict runs (after its start's check found none)."""

    def predict_step(self, batch):
        taken = Path(self.taken)
        if not taken.exists():
            taken.write_bytes(b"another process's predictions")
        return super().predict_step(batch)


@pytest.mark.parametrize("links", [True, False], ids=["hard links", "no hard links"])
def test_predict_never_replaces_an_output_another_process_wrote_while_it_ran(tmp_path, monkeypatch, links):
    """The output was checked at the start, then renamed over whatever was there at the end: two predicts started at
    once into one --output (each found none) left the second's alone, the first's replaced without a word. Without
    overwrite the file found at the end is kept too (by a hard link's no-clobber, or a last look where the filesystem
    has none), the temp file goes, and the error says so; this run's predictions are kept beside it under the first
    free ``<stem>.<N><suffix>`` (an hour's predict is not thrown away), named in the error; with overwrite the file
    is replaced."""
    if not links:  # an object-store mount (s3fs, gcsfuse)
        monkeypatch.setattr(os, "link", lambda *args: (_ for _ in ()).throw(OSError(errno.EPERM, "no hard links")))
    output = tmp_path / "preds.pt"
    trainer = OutputTakenMidway(toy_cfg(tmp_path, **QUIET))
    trainer.taken = str(output)
    (tmp_path / "preds.1.pt").write_bytes(b"an earlier kept file")  # taken too: the next free name is used
    with pytest.raises(
        RunDirectoryError, match=re.escape(f"cannot write predictions to '{output}': a file appeared")
    ) as err:
        trainer.predict(output=output)
    kept = tmp_path / "preds.2.pt"
    assert f"this run's predictions are in '{kept}'" in str(err.value)
    assert output.read_bytes() == b"another process's predictions" and trainer.predictions_path is None
    assert (tmp_path / "preds.1.pt").read_bytes() == b"an earlier kept file"
    assert [p.shape[0] for p in torch.load(kept, weights_only=True)] == [4, 4, 2]
    # no temp file left
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "run") == ["preds.1.pt", "preds.2.pt", "preds.pt"]
    for name in ("preds.pt", "preds.1.pt", "preds.2.pt"):
        (tmp_path / name).unlink()
    predictions = trainer.predict(output=output, overwrite=True)
    torch.testing.assert_close(torch.load(output, weights_only=True), predictions)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "run") == ["preds.pt"]


class PredictingWithOwnPredict(Predicting):
    """A subclass overriding predict with the signature it had before the ``overwrite`` option."""

    def predict(self, ckpt=None, output=None):
        return super().predict(ckpt, output)


def test_ampkit_predict_runs_a_subclass_predict_written_before_the_overwrite_option(tmp_path):
    """The CLI passed overwrite=False to every predict: a Trainer overriding predict(ckpt, output) (the GPT recipe
    did) failed with a TypeError; without --overwrite it is not passed."""
    from ampkit.cli import main

    config = tmp_path / "toy.yaml"
    OmegaConf.save({"trainer_class": "test_run_lineage:PredictingWithOwnPredict", "run_dir": str(tmp_path / "run"),
                    "trainer": {"max_steps": 2, "progress_bar": False}, "logging": {"tensorboard": False}},
                   config)  # fmt: skip
    assert main(["fit", "--config", str(config)]) == 0
    assert main(["predict", "--config", str(config), "--output", str(tmp_path / "preds.pt")]) == 0
    assert [p.shape[0] for p in torch.load(tmp_path / "preds.pt")] == [4, 4, 2]


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
    torn = tmp_path / "torn.pt"  # a damaged copy is still the user's checkpoint: it is not written over either
    tear(checkpoints / "last.pt", torn)
    torn_bytes = torn.read_bytes()
    version = checkpoints.parent
    (tmp_path / "link").symlink_to(checkpoints)  # a link into checkpoints/ is inside it
    records = {p: p.read_bytes() for p in (version / "config.yaml", version / "run.lock") if p.exists()}
    (version / "tensorboard").mkdir(exist_ok=True)
    for output in (checkpoints / "last.pt", checkpoints / "preds.pt", outside, torn, tmp_path / "link" / "new.pt",
                   version / "config.yaml", version / "lineage.yaml", version / "run.lock",
                   version / "tensorboard" / "events.out.tfevents.1"):  # fmt: skip
        capsys.readouterr()
        assert main(["predict", "--config", str(config), "--output", str(output)]) == 2
        err = capsys.readouterr().err
        assert f"predict --output '{output}': refusing to write there" in err and "Traceback" not in err
    assert _files(checkpoints) == kept and outside.read_bytes() == (checkpoints / "last.pt").read_bytes()
    assert torn.read_bytes() == torn_bytes
    assert all(path.read_bytes() == content for path, content in records.items())
    assert not (version / "run.lock").exists() and not (version / "lineage.yaml").exists()
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


def test_a_resume_that_another_resume_overtook_before_the_lock_is_refused(tmp_path):
    """Two --resume last at once: the second read last.pt (step 8), and while it built its model the first took the
    lock, trained to step 32 and left; the second then took the free lock and trained from step 8 over it, its last.pt
    going back to step 16 and keep_last pruning by the older lineage."""
    ToyTrainer(toy_cfg(tmp_path, **QUIET)).fit()
    last = tmp_path / "run" / "version_0" / "checkpoints" / "last.pt"

    class Overtaken(ToyTrainer):
        def configure_model(self):
            ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 4})).fit(resume="last")
            return super().configure_model()

    with pytest.raises(RunDirectoryError, match=r"changed after this run read .*now epoch 4, step 32"):
        Overtaken(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 2})).fit(resume="last")
    assert load_checkpoint(last)["loop"]["global_step"] == 32
    assert not (last.parent.parent / LOCK_FILE).exists()
    resumed = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 5}))
    resumed.fit(resume="last")  # run again: it continues from the newest
    assert resumed.version_dir.name == "version_0" and load_checkpoint(last)["loop"]["global_step"] == 40


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
    # A container restarted on the same volume: the run's pid now names another live process (here: this one).
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": "another-boot/17"}))
    ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 3})).fit(resume="last")
    assert not lock.exists()
    lock.write_text(json.dumps({"pid": 1, "host": "elsewhere", "since": "earlier"}))
    with pytest.raises(RunDirectoryError, match="pid 1 on host elsewhere"):
        ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 4})).fit(resume="last")
    assert lock.exists()  # someone else's: left alone


def test_a_run_stopped_by_its_sanity_check_takes_back_only_what_it_wrote(tmp_path):
    """The version_N made for a run whose sanity validation failed was removed whole, with the file a callback of the
    user's had put there (a copy of the script, for the record)."""

    class KeepsItsScript(ToyTrainer):
        def on_fit_start(self):
            (self.version_dir / "train.py").write_text("# the script of this run\n")

        def validation_step(self, batch):
            raise ValueError("a broken validation_step")

    trainer = KeepsItsScript(toy_cfg(tmp_path, **QUIET))
    with pytest.raises(ValueError, match="a broken validation_step"):
        trainer.fit()
    assert sorted(p.name for p in trainer.version_dir.iterdir()) == ["train.py"]


def test_a_run_stopped_by_its_sanity_check_keeps_what_the_user_put_in_its_tensorboard_folder(tmp_path):
    """The whole tensorboard/ folder of a run whose sanity validation failed was removed, with the event file of the
    user's own SummaryWriter and the notes a callback of the user's wrote there; only the run's own event file and
    records go, and the folders holding the user's files stay."""
    from torch.utils.tensorboard import SummaryWriter

    class WritesBesideTheRun(ampkit.Callback):
        def on_fit_start(self, trainer):
            folder = trainer.version_dir / "tensorboard"
            folder.mkdir(exist_ok=True)
            (folder / "notes.md").write_text("why this run was started\n")
            with SummaryWriter(log_dir=str(folder)) as mine:  # beside the run's own event file
                mine.add_scalar("user/x", 1.0, 0)
                self.file = Path(mine.file_writer.event_writer._file_name).name

    class BrokenValidation(ToyTrainer):
        def validation_step(self, batch):
            raise ValueError("a broken validation_step")

    cfg = toy_cfg(tmp_path, **{"trainer.progress_bar": False, "logging.log_every_n_steps": 1})
    users = WritesBesideTheRun()
    trainer = BrokenValidation(cfg, callbacks=[users])
    with pytest.raises(ValueError, match="a broken validation_step"):
        trainer.fit()
    left = sorted(str(p.relative_to(trainer.version_dir)) for p in trainer.version_dir.rglob("*") if p.is_file())
    assert left == [f"tensorboard/{users.file}", "tensorboard/notes.md"]
    # With nothing of the user's there, nothing is left at all.
    again = BrokenValidation(cfg)
    with pytest.raises(ValueError, match="a broken validation_step"):
        again.fit()
    assert again.version_dir.name == "version_1" and not again.version_dir.exists()


def test_a_run_dir_without_hard_links_is_named_as_such_and_left_as_it_was(tmp_path, monkeypatch):
    """On an object-store mount (s3fs, gcsfuse) os.link fails, and the lock's failure read as 'cannot write ...:
    free space or write access under run_dir', though neither was the matter."""

    def no_link(source, target):
        raise OSError(errno.EPERM, "Operation not permitted", str(source))

    monkeypatch.setattr(os, "link", no_link)
    with pytest.raises(RunDirectoryError, match=r"file system without hard links \(os.link: Operation not permitted\)"):
        ToyTrainer(toy_cfg(tmp_path, **QUIET)).fit()
    assert list((tmp_path / "run").iterdir()) == []  # the version_0 made for it is gone again


def test_a_resume_with_a_changed_config_names_each_changed_key(tmp_path):
    ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 1})).fit()
    changed = {"trainer.max_epochs": 2, "data.batch_size": 4, "trainer.clip_grad_norm": 1.0}
    with pytest.warns(
        UserWarning, match="changed config: data.batch_size: 8 -> 4; trainer.clip_grad_norm: None -> 1.0"
    ):
        ToyTrainer(toy_cfg(tmp_path, **QUIET, **changed)).fit(resume="last")


def _plant_stale_temps(checkpoints) -> tuple[list, list]:
    """What a kill during a save leaves (ampkit's names), and files a user put there that look alike."""
    ours = [
        checkpoints / ".last.pt.k3x9_q0a.tmp",  # copy_atomic's
        checkpoints / ".step-00000006.pt.abcd1234.tmp",  # save_atomic's
        checkpoints / ".step-00000009.tmp",  # the sharded writer's directory
        checkpoints.parent / ".config.yaml.zz99yy88.tmp",
    ]
    users = [
        checkpoints / ".notes.tmp",
        checkpoints / "last.pt.tmp",
        checkpoints / ".last.pt.tmp",
        checkpoints.parent / "x.tmp",
    ]
    for path in ours[:2]:
        path.write_bytes(b"PK\x03\x04half")  # the start of torch's zip archive, cut short
    ours[3].write_text((checkpoints.parent / "config.yaml").read_text())  # written whole, killed before its rename
    for path in users:
        path.write_bytes(b"half")
    ours[2].mkdir()
    (ours[2] / "trainer.pt").write_bytes(b"half")
    return ours, users


def test_the_tidy_deletes_no_file_of_the_user_s_that_only_looks_like_a_temp_name(tmp_path):
    """The tidy took any ``.<checkpoint>.pt.<word>.tmp`` for a killed save's temp file, and any link at a sharded
    temp name for its own: the user's ``.last.pt.backup.tmp``, notes under mkstemp's very name shape, and a link to
    their own folder went. A killed save's files (a temp file holding the start of a zip archive, the ``.last.tmp``
    link) still go."""
    from ampkit.trainer.run_life import remove_stale_temps

    checkpoints = tmp_path / "version_0" / "checkpoints"
    (checkpoints / "exports").mkdir(parents=True)
    users = [checkpoints / ".last.pt.backup.tmp", checkpoints / ".best.pt.abcd1234.tmp"]
    for path in users:
        path.write_text("my notes")
    os.symlink("exports", checkpoints / ".step-00000006.tmp")
    ours = [checkpoints / ".step-00000002.pt.k3x9_q0a.tmp", checkpoints / ".last.pt.zz99yy88.tmp"]
    ours[0].write_bytes(b"PK\x03\x04")
    ours[1].write_bytes(b"")  # killed before its first byte
    os.symlink("step-00000004", checkpoints / ".last.tmp")
    removed = remove_stale_temps(tmp_path / "version_0")
    assert sorted(removed) == sorted([*ours, checkpoints / ".last.tmp"])
    assert all(path.read_text() == "my notes" for path in users)
    assert os.readlink(checkpoints / ".step-00000006.tmp") == "exports"


def _dead_pid() -> int:
    """A pid no process has now: one that ran and ended."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_the_tidy_removes_a_record_s_or_a_lock_s_temp_file_only_where_it_holds_what_ampkit_writes_there(tmp_path):
    """The config's, the lineage's and the lock's temp names were tidied by their name alone (the lock's by a dead pid
    in it): a file of the user's under such a name was deleted. What a kill leaves there (nothing yet, or the record or
    lock as ampkit writes it) goes; anything else stays. A folder of the user's at a sharded save's temp name holding no
    part of a checkpoint stays where it is: it was moved to the checkpoint's name, where the next save of it stopped."""
    from ampkit.trainer.run_life import remove_stale_temps

    cfg = toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 2})
    ToyTrainer(cfg).fit()
    version_dir = tmp_path / "run" / "version_0"
    checkpoints, dead = version_dir / "checkpoints", _dead_pid()
    lineage = OmegaConf.to_yaml({"branched_from": "/a/step-00000002.pt", "origin_version_dir": "/a", "global_step": 2,
                                 "epoch": 0})  # fmt: skip
    lock = json.dumps({"pid": dead, "host": socket.gethostname(), "since": "then", "lock": "ab12.0"})
    ours = {
        f".config.yaml.{'a' * 8}.tmp": (version_dir / "config.yaml").read_text(),
        f".config.resumed_at_step_2.yaml.{'b' * 8}.tmp": "",  # killed before the write
        f".lineage.yaml.{'c' * 8}.tmp": lineage,
        f".{LOCK_FILE}.{dead}.{'d' * 8}.tmp": lock,
        f".{LOCK_FILE}.stale.{dead}.{'e' * 8}": lock,
        f".{LOCK_FILE}.stale.{dead}.{'j' * 8}": "",  # made free, killed before the lock moved there
        f".{LOCK_FILE}.{dead}.tmp": lock,  # an older ampkit's name
    }
    theirs = {
        f".config.yaml.{'f' * 8}.tmp": "lr: 0.1  # my own sweep's\n",
        f".lineage.yaml.{'g' * 8}.tmp": "parent: exp-3\n",
        f".config.yaml.{'h' * 8}.tmp": "{not yaml at all",
        f".{LOCK_FILE}.{dead}.{'i' * 8}.tmp": "my notes",
        f".{LOCK_FILE}.stale.{dead}": '{"pid": 1}',
    }
    for name, text in [*ours.items(), *theirs.items()]:
        (version_dir / name).write_text(text)
    mine = checkpoints / ".step-00000006.tmp"
    mine.mkdir()
    (mine / "eval.json").write_text("{}")
    removed = remove_stale_temps(version_dir)
    assert sorted(p.name for p in removed) == sorted(ours)
    assert {name: (version_dir / name).read_text() for name in theirs} == theirs
    assert [p.name for p in mine.iterdir()] == ["eval.json"] and not (checkpoints / "step-00000006").exists()


def test_the_tidy_takes_back_what_a_kill_left_at_a_free_temp_name(tmp_path):
    """A save that stepped around the user's thing at its usual temp name went through a free one
    (``.<name>.<random>.tmp`` or ``.old``, temp_names): a kill there leaves a folder, a set-aside checkpoint or a link
    the tidy must know as well as the usual names, or it stays for good (a checkpoint set aside: never put back). A link
    of the user's at a temp name stays, though it leads to a checkpoint's name."""
    from ampkit.trainer.run_life import remove_stale_temps

    checkpoints = tmp_path / "version_0" / "checkpoints"
    checkpoints.mkdir(parents=True)
    for name in (".step-00000008.k3x9_q0a.tmp", ".step-00000004.abcd1234.old", "step-00000002"):
        (checkpoints / name).mkdir()
        for part in (".metadata", "__0_0.distcp", "trainer.pt"):
            (checkpoints / name / part).write_bytes(name.encode())
    os.symlink("step-00000002", checkpoints / ".last.zz99yy88.tmp")  # point_last_at's, at a free name
    os.symlink("step-00000002", checkpoints / ".step-00000006.tmp")  # the user's: ampkit links only last and best
    removed = remove_stale_temps(tmp_path / "version_0")
    assert sorted(p.name for p in removed) == [".last.zz99yy88.tmp", ".step-00000008.k3x9_q0a.tmp"]
    assert sorted(p.name for p in checkpoints.iterdir()) == [".step-00000006.tmp", "step-00000002", "step-00000004"]
    assert (checkpoints / "step-00000004" / "trainer.pt").read_bytes() == b".step-00000004.abcd1234.old"


def test_a_run_lock_never_writes_over_a_users_file_at_its_temp_or_stale_name(tmp_path):
    """The lock was written through ``.run.lock.<pid>.tmp`` and a stale one moved aside to ``.run.lock.stale.<pid>``,
    over whatever stood there: a file of the user's of that name was overwritten, then deleted. Both go through free
    names now."""
    from ampkit.trainer.run_life import RunLock

    version_dir = tmp_path / "version_0"
    version_dir.mkdir()
    theirs = {f".{LOCK_FILE}.{os.getpid()}.tmp": "my notes", f".{LOCK_FILE}.stale.{os.getpid()}": "my other notes"}
    for name, text in theirs.items():
        (version_dir / name).write_text(text)
    stale = {"pid": _dead_pid(), "host": socket.gethostname(), "since": "then", "lock": "ab12.0"}
    (version_dir / LOCK_FILE).write_text(json.dumps(stale))  # a killed run's: taken over
    lock = RunLock(version_dir)
    lock.acquire()
    assert json.loads((version_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert {p.name: p.read_text() for p in version_dir.iterdir()} == theirs


def test_a_sharded_temp_folder_s_own_temp_files_are_the_kill_s_not_the_user_s(tmp_path, monkeypatch):
    """A kill mid-save leaves DCP's ``.metadata.tmp`` and ``trainer.pt``'s temp file in the save's folder: the tidy
    took them for the user's, put the folder back under the checkpoint's name, and every later save of that name (a
    resume's) was refused for the user's folder standing there."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    from ampkit.trainer.run_life import remove_stale_temps

    monkeypatch.setattr(rank_zero_only, "rank", 0, raising=False)  # as a Trainer sets it
    checkpoints = tmp_path / "version_0" / "checkpoints"
    tmp = checkpoints / ".step-00000006.tmp"
    tmp.mkdir(parents=True)
    for part in ("__0_0.distcp", "__1_0.distcp", ".metadata.tmp", ".trainer.pt.k3x9_q0a.tmp"):
        (tmp / part).write_bytes(b"half")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing of the user's to name
        assert remove_stale_temps(tmp_path / "version_0") == [tmp]
    assert list(checkpoints.iterdir()) == []


def test_a_set_aside_folder_kept_for_the_user_s_files_is_named_once_not_at_every_fit(tmp_path, monkeypatch):
    """A ``.step-N.old`` folder kept for the notes the user had put in it was named again, and counted among the temp
    files removed, by the tidy of every later fit in the run directory."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    from ampkit.trainer.run_life import remove_stale_temps

    monkeypatch.setattr(rank_zero_only, "rank", 0, raising=False)  # as a Trainer sets it
    checkpoints = tmp_path / "version_0" / "checkpoints"
    aside = checkpoints / ".step-00000002.old"
    aside.mkdir(parents=True)
    (checkpoints / "step-00000002").mkdir()
    for part in (".metadata", "__0_0.distcp", "trainer.pt"):
        (aside / part).write_bytes(b"a part")
    (aside / "notes.txt").write_text("the run before the fix")
    with pytest.warns(UserWarning, match=r"step-00000002\.old' held notes\.txt"):
        assert remove_stale_temps(tmp_path / "version_0") == [aside]
    for _ in range(2):  # the next fits' tidies
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert remove_stale_temps(tmp_path / "version_0") == []
    assert [p.name for p in aside.iterdir()] == ["notes.txt"]


def test_any_resume_removes_only_ampkit_s_stale_temp_files(tmp_path, capsys):
    """A finished run resumed writes nothing, but what a kill during its final save left goes; a user's files stay."""
    cfg = toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 6, "checkpoint.every_n_steps": 2})
    ToyTrainer(cfg).fit()
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    before = _files(tmp_path / "run")
    ours, users = _plant_stale_temps(checkpoints)
    ToyTrainer(cfg).fit(resume="last")
    assert not any(path.exists() for path in ours)
    assert all(path.read_bytes() == b"half" for path in users)
    assert {p: v for p, v in _files(tmp_path / "run").items() if p not in users} == before
    err = capsys.readouterr().err
    assert "removed 4 temp file(s) left by an interrupted save" in err and "nothing to train" in err


def test_a_fresh_start_tidies_the_run_dir_but_not_a_live_run_s_version(tmp_path):
    cfg = toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 2})
    ToyTrainer(cfg).fit()
    ToyTrainer(cfg).fit()
    stale, _ = _plant_stale_temps(tmp_path / "run" / "version_0" / "checkpoints")
    live, _ = _plant_stale_temps(tmp_path / "run" / "version_1" / "checkpoints")
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": "now"}  # a live run writes version_1
    (tmp_path / "run" / "version_1" / LOCK_FILE).write_text(json.dumps(holder))
    ToyTrainer(cfg).fit()
    assert not any(path.exists() for path in stale)
    assert all(path.exists() for path in live)


def test_a_sharded_checkpoint_set_aside_by_a_killed_save_is_put_back(tmp_path):
    from ampkit.trainer.run_life import remove_stale_temps

    checkpoints = tmp_path / "version_0" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / ".step-00000004.old").mkdir()  # killed between setting it aside and renaming the new one in
    (checkpoints / ".step-00000004.old" / "trainer.pt").write_bytes(b"the only copy")
    (checkpoints / ".step-00000002.old").mkdir()  # killed after the new one was in place: the old copy goes
    (checkpoints / "step-00000002").mkdir()
    remove_stale_temps(tmp_path / "version_0")
    assert (checkpoints / "step-00000004" / "trainer.pt").read_bytes() == b"the only copy"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000002", "step-00000004"]


def test_the_tidy_of_a_sharded_checkpoint_s_temp_folders_keeps_a_file_the_user_put_in_them(tmp_path):
    """A checkpoint folder a kill left under its temp name (a removal cut short) or set aside (a save of its name
    cut short after the new one was in place) was removed whole by the next fit's tidy, with the evaluation results
    the user had saved in it; only the checkpoint's own files go."""
    from ampkit.trainer.run_life import remove_stale_temps

    checkpoints = tmp_path / "version_0" / "checkpoints"
    for name in (".step-00000006.tmp", ".step-00000002.old", ".step-00000008.tmp", "step-00000002"):
        (checkpoints / name).mkdir(parents=True)
    for name in (".step-00000006.tmp", ".step-00000002.old", ".step-00000008.tmp"):
        for part in (".metadata", "__0_0.distcp", "trainer.pt"):
            (checkpoints / name / part).write_bytes(b"a part")
    (checkpoints / ".step-00000006.tmp" / "eval.json").write_text("{}")
    (checkpoints / ".step-00000002.old" / "notes.txt").write_text("the run before the fix")
    with pytest.warns(UserWarning) as warned:
        remove_stale_temps(tmp_path / "version_0")
    assert [p.name for p in (checkpoints / "step-00000006").iterdir()] == ["eval.json"]  # back under its name
    assert [p.name for p in (checkpoints / ".step-00000002.old").iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in checkpoints.iterdir()) == [".step-00000002.old", "step-00000002", "step-00000006"]
    messages = " ".join(str(w.message) for w in warned)
    assert "step-00000006' held eval.json" in messages and ".step-00000002.old' held notes.txt" in messages


class StopsItself(ToyTrainer):
    """User code that ends training at step 3 (``state.should_stop``), as a target-loss rule would."""

    def training_step(self, batch):
        if self.state.global_step == 3:
            self.state.should_stop, self.state.stop_reason = True, "reached the target"
        return super().training_step(batch)


class StopsAtAnEpochsEnd(ToyTrainer):
    """A stop asked after the epoch's checkpoint was written (a Trainer's own hooks run after the callbacks'; under
    torchrun a stop the ranks agree at the epoch's end): the run's last checkpoint had not recorded it."""

    def on_train_epoch_end(self):
        self.state.should_stop, self.state.stop_reason = True, "reached the target"


@pytest.mark.parametrize(
    ("trainer_class", "settings", "why", "stops_at", "to_continue"),
    [
        (StopsItself, {}, "reached the target", 4, {"trainer.max_steps": 9}),
        (StopsAtAnEpochsEnd, {}, "reached the target", 8, {"trainer.max_steps": 12}),
        (
            ToyTrainer,
            {"early_stopping.monitor": "val/mse", "early_stopping.min_delta": 1e9, "early_stopping.patience": 1},
            "early stopping: val/mse did not improve",
            4,
            {"early_stopping.patience": 3},
        ),
        (ToyTrainer, {"trainer.max_time": 1e-6}, "trainer.max_time=1e-06s reached", 1, {"trainer.max_time": 3600}),
    ],
    ids=["should_stop", "after_the_epochs_checkpoint", "early_stopping", "max_time"],
)
def test_an_early_stopped_run_is_finished_until_a_stopping_key_changes(
    tmp_path, capsys, trainer_class, settings, why, stops_at, to_continue
):
    """A stop asked for during a step ends training after it; resumed with the same stopping keys it trains nothing
    (a key that does not decide stopping may change), with a changed one it continues."""
    common = {**QUIET, **settings, "trainer.max_epochs": 3, "trainer.val_every_n_steps": 2}
    trainer_class(toy_cfg(tmp_path, **common)).fit()
    stopped_at = load_checkpoint(tmp_path / "run" / "version_0" / "checkpoints" / "last.pt")["loop"]["global_step"]
    assert stopped_at == stops_at
    before = _files(tmp_path / "run")
    capsys.readouterr()
    same = trainer_class(toy_cfg(tmp_path, **{**common, "trainer.progress_bar": True}))  # not a stopping key
    same.fit(resume="last")
    assert _files(tmp_path / "run") == before
    err = capsys.readouterr().err
    assert "nothing to train" in err and "stopped early" in err and why in err
    resumed = trainer_class(toy_cfg(tmp_path, **{**common, **to_continue}))
    resumed.fit(resume="last")
    assert resumed.version_dir.name == "version_0" and resumed.state.global_step > stopped_at


@pytest.mark.parametrize(
    ("saved", "resumed"), [(3600, "01:00:00"), ("00:00:00:01", 1.0), ({"minutes": 60}, "01:00:00")]
)
def test_a_stopping_key_spelt_another_way_is_no_change(tmp_path, capsys, saved, resumed):
    """``trainer.max_time`` 3600 and "01:00:00" are one duration (``precision.dtype`` bf16 and bfloat16 one dtype):
    the stopped run stays finished, and the resume warns of no changed config."""
    common = {**QUIET, "trainer.max_epochs": 3, "precision.opt_level": "O1"}
    StopsItself(toy_cfg(tmp_path, **common, **{"trainer.max_time": saved, "precision.dtype": "bf16"})).fit()
    before = _files(tmp_path / "run")
    capsys.readouterr()
    again = StopsItself(toy_cfg(tmp_path, **common, **{"trainer.max_time": resumed, "precision.dtype": "bfloat16"}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again.fit(resume="last")
    assert not [str(w.message) for w in caught if "changed config" in str(w.message)]
    assert _files(tmp_path / "run") == before and "stopped early" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("saved", "resumed", "said"),
    [
        ({"hours": 1}, {"hours": 2}, "trainer.max_time: {'hours': 1} -> {'hours': 2}"),
        ("01:00:00", {"hours": 2}, "trainer.max_time: 01:00:00 -> {'hours': 2}"),
        ({"hours": 1}, 7200, "trainer.max_time: {'hours': 1} -> 7200"),
    ],
)
def test_a_changed_max_time_dict_is_named_whole_as_written(tmp_path, saved, resumed, said):
    """A resume's changed-config warning names ``trainer.max_time`` with both values as written: a dict was split
    into ``trainer.max_time.hours`` (said absent beside another form) and {hours: 1} -> {hours: 2} said nothing."""
    common = {**QUIET, "trainer.max_epochs": -1}
    ToyTrainer(toy_cfg(tmp_path, **common, **{"trainer.max_steps": 1, "trainer.max_time": saved})).fit()
    again = ToyTrainer(toy_cfg(tmp_path, **common, **{"trainer.max_steps": 2, "trainer.max_time": resumed}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again.fit(resume="last")
    changed = [str(w.message) for w in caught if "changed config" in str(w.message)]
    assert len(changed) == 1 and changed[0].endswith(f"with a changed config: {said}"), changed


@pytest.mark.parametrize("value", [0, -5, "1h", "00:00:00:00", "soon", True])
def test_a_bad_max_time_names_the_key_and_the_valid_forms(tmp_path, value):
    from ampkit.config import ConfigError

    with pytest.raises(ConfigError, match=r"config key 'trainer.max_time': .* is invalid; expected null \(no limit\)"):
        ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_time": value}))


def test_max_time_counts_on_across_a_resume(tmp_path):
    from ampkit.callbacks import MaxTime

    ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 3, "trainer.max_time": "01:00:00:00"})).fit()
    saved = load_checkpoint(tmp_path / "run" / "version_0" / "checkpoints" / "last.pt")["callbacks"]["MaxTime"]
    resumed = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 5, "trainer.max_time": "01:00:00:00"}))
    resumed.fit(resume="last")
    timer = next(cb for cb in resumed.callbacks if isinstance(cb, MaxTime))
    assert timer.max_time_s == 86400 and 0 < saved["elapsed_s"] == timer.elapsed_before < timer.elapsed()


def test_max_time_stops_once_the_lineage_s_time_is_spent_counting_the_runs_before(monkeypatch):
    """A resumed run that had 50 s of its 60 s stops 10 s in, at the iteration that reaches the limit itself."""
    import types

    from ampkit.callbacks import MaxTime, max_time

    clock = types.SimpleNamespace(monotonic=lambda: now)
    monkeypatch.setattr(max_time, "time", clock)
    now = 1000.0
    timer = MaxTime(60.0)
    timer.load_state_dict({"elapsed_s": 50.0})  # what the checkpoint of the earlier runs saved
    state = types.SimpleNamespace(is_iteration_end=True, should_stop=False, stop_reason=None, global_step=7)
    trainer = types.SimpleNamespace(state=state, is_global_zero=False)
    timer.on_train_start(trainer)
    now += 9.0
    timer.on_train_batch_end(trainer, {}, None)
    assert not state.should_stop and timer.state_dict() == {"elapsed_s": 59.0}
    now += 1.0
    timer.on_train_batch_end(trainer, {}, None)
    assert state.should_stop and state.stop_reason == "trainer.max_time=60s reached after 60.0s of training"


def test_a_finished_run_s_resume_finishes_the_pruning_a_kill_interrupted(tmp_path):
    """Killed between its final save and that save's pruning: the restart trains nothing but prunes to keep_last."""
    cfg = toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 6, "checkpoint.every_n_steps": 2})
    ToyTrainer(cfg).fit()
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    left = checkpoints / "step-00000002.pt"
    left.write_bytes((checkpoints / "step-00000004.pt").read_bytes())
    os.utime(left, ns=(1, 1))  # the oldest
    ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 6, "checkpoint.keep_last": 1})).fit(resume="last")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.pt", "step-00000004.pt", "step-00000006.pt"]


def test_the_last_checkpoint_of_a_read_only_run_branches_into_run_dir(tmp_path, monkeypatch):
    """An archived run on a read-only mount cannot be continued where it is: resuming its last checkpoint into
    another run_dir branches there, instead of failing on a lock in the read-only directory."""
    first = ToyTrainer(toy_cfg(tmp_path / "archive", **QUIET))
    first.fit()
    writable = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != first.version_dir and writable(path, mode))
    before = _files(tmp_path / "archive")
    branch = ToyTrainer(toy_cfg(tmp_path / "mine", **QUIET, **{"trainer.max_epochs": 2}))
    with pytest.warns(UserWarning, match=r"cannot be written \(read-only\): training branches from it"):
        branch.fit(resume=first.version_dir / "checkpoints" / "last.pt")
    assert branch.version_dir == tmp_path / "mine" / "run" / "version_0"
    assert (branch.version_dir / "lineage.yaml").is_file() and branch.state.global_step == 16
    assert _files(tmp_path / "archive") == before


def test_resuming_another_run_dirs_last_checkpoint_branches_into_run_dir_and_leaves_that_run_alone(tmp_path):
    """Continuing in place would prune the other run's step files by this config's keep_last (all 8 went) and
    replace its last.pt: the run writes under the run_dir it was given."""
    every_step = {"checkpoint.every_n_steps": 1}
    first = ToyTrainer(toy_cfg(tmp_path / "one", **QUIET, **every_step, **{"checkpoint.keep_last": 20}))
    first.fit()
    before = _files(first.version_dir)
    last = first.version_dir / "checkpoints" / "last.pt"
    other = ToyTrainer(toy_cfg(tmp_path / "two", **QUIET, **every_step, **{"trainer.max_epochs": 2}))
    with pytest.warns(
        UserWarning,
        match=rf"to continue that run in place, set run_dir to '{re.escape(str(first.version_dir.parent))}'",
    ):
        other.fit(resume=last)
    assert other.version_dir == tmp_path / "two" / "run" / "version_0" and other.state.global_step == 16
    assert (other.version_dir / "lineage.yaml").is_file()
    assert _files(first.version_dir) == before


def _mid_epoch_checkpoint(tmp_path) -> Path:
    """ToyTrainer's step-3 checkpoint: 3 batches of 8 into an epoch of 8 batches."""
    ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 3, "checkpoint.every_n_steps": 3})).fit()
    return tmp_path / "run" / "version_0" / "checkpoints" / "step-00000003.pt"


def _skip_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "skip" in str(w.message)]


@pytest.mark.parametrize(
    ("changed", "said"),
    [
        ({"data.batch_size": 4}, None),  # the position moves in samples: 24 in, at batch 4 as at batch 8
        ({"data.n": 72}, "it continues at sample 24 of the epoch's order; if data.n changed the dataset or its order"),
        ({"trainer.seed": 5}, "trainer.seed (0 -> 5) orders a shuffled epoch, so the samples it skips are not"),
        ({"trainer.limit_train_batches": 6}, None),  # a shorter epoch, the same 24 samples skipped
    ],
)
def test_a_mid_epoch_resume_warns_of_skipped_samples_only_where_a_change_moves_them(tmp_path, changed, said):
    """Any data.* change added 'a data setting changes which batches a mid-epoch resume skips', untrue where the
    position is kept in samples (ranks x batch size): the resume continues at the same sample of the same order."""
    step_3 = _mid_epoch_checkpoint(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 4}, **changed)).fit(resume=step_3)
    assert any("changed config" in str(w.message) for w in caught)
    skips = _skip_warnings(caught)
    if said is None:
        assert not skips
    else:
        assert len(skips) == 1 and f"resuming '{step_3}' 3 batches into its epoch: {said}" in skips[0], skips


def test_a_loader_without_a_batch_layout_warns_that_its_batch_count_may_skip_other_samples():
    """A batch sampler or an IterableDataset resumes at the saved count of its batches: a data change may move it."""
    from ampkit.trainer.batch_layout import order_change_note

    known = {"ranks": 2, "batch_size": 32, "epoch_batches": 10}
    one_process = {"ranks": 1, "batch_size": 64, "epoch_batches": 10}
    assert order_change_note({"data.batch_size": (32, 64)}, known, one_process, 3) is None
    note = order_change_note({"data.batch_size": (32, 64)}, known, None, 3)
    assert note == (
        "this train loader (no fixed batch size over a map-style dataset) resumes at a count of batches (3), not at "
        "a sample, so data.batch_size may change which samples those batches are"
    )


def test_a_resume_waits_for_another_process_tidying_its_version_directory(tmp_path, monkeypatch):
    """Every fit tidies each idle version directory under run_dir under its lock, for a moment: a ``--resume last``
    (or a fresh run's new version_N) taking the lock then was refused, naming the tidier, though no run wrote there."""
    from ampkit.trainer import run_life

    ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 1})).fit()
    version_0 = tmp_path / "run" / "version_0"
    tidying, resumed = threading.Event(), threading.Event()
    remove = run_life.remove_stale_temps

    def slow_remove(version_dir):  # the other process's tidying, caught while it holds the lock
        if threading.current_thread() is not threading.main_thread():
            tidying.set()
            resumed.wait(0.5)
        return remove(version_dir)

    monkeypatch.setattr(run_life, "remove_stale_temps", slow_remove)
    tidier = threading.Thread(target=run_life.tidy_run_dir, args=(tmp_path / "run",))
    tidier.start()
    assert tidying.wait(30) and (version_0 / LOCK_FILE).exists()
    resumed_run = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 2}))
    resumed_run.fit(resume="last")
    resumed.set()
    tidier.join()
    assert resumed_run.version_dir == version_0 and resumed_run.state.epoch == 2
    assert not (version_0 / LOCK_FILE).exists()


def test_a_run_dir_holding_the_user_s_own_files_keeps_every_one(tmp_path):
    """run_dir pointed at a folder the user already fills: their files beside the versions, and another tool's
    version_0 (Lightning's layout, with a sharded ``best`` and a ``.best.old`` copy of it). Fresh runs, a resume and a
    branch take the next version_N and leave each byte of theirs; the tidying did rmtree ``.best.old`` (an ampkit
    name for a set-aside checkpoint) and took a lock inside the other tool's directory."""
    run = tmp_path / "run"
    theirs = [
        run / "epoch=3.pt",
        run / "last.pt",
        run / "best.pt",
        run / "notes.txt",
        run / "events.out.tfevents.1700000000.host.1.0",
        run / "version_0" / "hparams.yaml",
        run / "version_0" / "events.out.tfevents.1700000000.host.2.0",
        run / "version_0" / "checkpoints" / "epoch=3-step=100.ckpt",
        run / "version_0" / "checkpoints" / "last.ckpt",
        run / "version_0" / "checkpoints" / "best" / ".metadata",
        run / "version_0" / "checkpoints" / ".best.old" / ".metadata",
    ]
    for number, path in enumerate(theirs):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"the user's file {number}".encode())
    before = _files(run)
    common = {**QUIET, "checkpoint.every_n_steps": 4, "checkpoint.keep_last": 9}
    ToyTrainer(toy_cfg(tmp_path, **common, **{"trainer.max_epochs": 1})).fit()
    resumed = ToyTrainer(toy_cfg(tmp_path, **common, **{"trainer.max_epochs": 2}))
    resumed.fit(resume="last")
    branch = ToyTrainer(toy_cfg(tmp_path, **common, **{"trainer.max_epochs": 2}))
    branch.fit(resume=resumed.version_dir / "checkpoints" / "step-00000008.pt")
    assert (resumed.version_dir.name, branch.version_dir.name) == ("version_1", "version_2")
    assert {path: kept for path, kept in _files(run).items() if path in before} == before
    assert sorted(run.iterdir()) == sorted([*theirs[:5], run / "version_0", run / "version_1", run / "version_2"])


def test_resume_best_after_best_pt_was_deleted_by_hand_takes_the_ranking_s_best(tmp_path):
    """best.pt is a copy of the ranking's best best-<step>.pt; with it deleted (to save its space) ``--resume best``
    failed, naming the newest step file as what was left, though the best checkpoint lay beside it."""
    settings = {**QUIET, "checkpoint.monitor": "val/mse", "checkpoint.save_top_k": 2, "trainer.val_every_n_steps": 2}
    first = ToyTrainer(toy_cfg(tmp_path, **settings, **{"trainer.max_epochs": 1}))
    first.fit()
    checkpoints = first.version_dir / "checkpoints"
    best = load_checkpoint(checkpoints / "best.pt")
    (checkpoints / "best.pt").unlink()
    branch = ToyTrainer(toy_cfg(tmp_path, **settings, **{"trainer.max_epochs": 2}))
    branch.fit(resume="best")
    (ranked_best,) = [p for p in checkpoints.glob("best-*.pt") if load_checkpoint(p)["loop"] == best["loop"]]
    assert OmegaConf.load(branch.version_dir / "lineage.yaml").branched_from == str(ranked_best)


def test_the_last_checkpoint_of_a_run_whose_checkpoints_are_read_only_branches(tmp_path, monkeypatch):
    """checkpoints/ made read-only to keep them, in a version directory that stays writable: the resume continued
    there, trained, and stopped at its first save (permission denied) with nothing new saved."""
    first = ToyTrainer(toy_cfg(tmp_path, **QUIET))
    first.fit()
    kept = first.version_dir / "checkpoints"
    writable = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != kept and writable(path, mode))
    before = _files(kept)
    resumed = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 2}))
    with pytest.warns(UserWarning, match=rf"but '{re.escape(str(kept))}' cannot be written \(read-only\)"):
        resumed.fit(resume="last")
    assert resumed.version_dir.name == "version_1" and resumed.state.global_step == 16
    assert _files(kept) == before


def test_what_each_node_sees_at_a_checkpoints_path_tells_a_copy_from_another_checkpoint(tmp_path):
    """Rank zero's checkpoint as another node sees it at the same path (agreed_start): a copy is the same, a save of
    other weights at the same step is another checkpoint, and a sharded checkpoint lacking a shard file or holding one
    of another size is named, without reading a tensor."""
    import shutil

    from ampkit.trainer.agreed_start import difference, view_of
    from ampkit.trainer.checkpoint_io import save_atomic

    state = {"loop": {"epoch": 1, "global_step": 4}, "model": {"w": torch.ones(3)}}
    saved = save_atomic(state, tmp_path / "node0" / "last.pt")
    zeros = view_of(saved)
    assert difference(view_of(Path(shutil.copy(saved, tmp_path / "copy.pt"))), zeros) is None
    other = {**state, "model": {"w": torch.zeros(3)}}
    assert difference(view_of(save_atomic(other, tmp_path / "other.pt")), zeros) == (
        "has another checkpoint there (epoch 1, step 4)"
    )
    assert difference(view_of(tmp_path / "absent.pt"), zeros) == "has no checkpoint there"
    sharded = tmp_path / "node0" / "step-00000004"
    save_atomic(state, sharded / "trainer.pt")
    for name, data in [(".metadata", b"meta"), ("__0_0.distcp", b"0" * 8), ("__1_0.distcp", b"1" * 8)]:
        (sharded / name).write_bytes(data)
    zeros = view_of(sharded)
    node1 = Path(shutil.copytree(sharded, tmp_path / "node1"))
    assert difference(view_of(node1), zeros) is None
    (node1 / "__1_0.distcp").write_bytes(b"1" * 4)
    assert difference(view_of(node1), zeros) == "has shard file(s) __1_0.distcp of other sizes"
    (node1 / "__1_0.distcp").unlink()
    assert difference(view_of(node1), zeros) == "lacks its shard file(s) __1_0.distcp"
    assert difference(view_of(tmp_path / "node2"), zeros) == "has no checkpoint there"


def test_a_config_record_is_never_replaced_even_past_a_gap_in_its_numbers(tmp_path):
    """A second resume from one step writes config.resumed_at_step_N.<K>.yaml after the highest K there (one the
    user deleted leaves a gap that a count would fill by replacing the newest); a resume with the config in effect
    (the newest record of its step) writes nothing."""
    from omegaconf import OmegaConf

    from ampkit.trainer.run_life import FitStart, save_config

    records = {"config.yaml": 0.1, "config.resumed_at_step_8.yaml": 0.2, "config.resumed_at_step_8.2.yaml": 0.3}
    for name, lr in records.items():
        OmegaConf.save(OmegaConf.create({"lr": lr}), tmp_path / name)
    start = FitStart(version_dir=tmp_path)
    save_config(tmp_path, OmegaConf.create({"lr": 0.3}), 8, start)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(records)
    save_config(tmp_path, OmegaConf.create({"lr": 0.4}), 8, start)
    found = {p.name: OmegaConf.load(p).lr for p in tmp_path.iterdir()}
    assert found == {**records, "config.resumed_at_step_8.3.yaml": 0.4}


def test_a_run_dir_symlink_re_pointed_mid_run_does_not_send_the_saves_into_another_run(tmp_path):
    """run_dir is a symlink (runs/current -> runs/exp-a) that the user re-points at another experiment while the run
    trains: the next saves followed the link into exp-b/version_0 and replaced that run's last.pt and epoch file, and
    the lock stayed behind in exp-a. The run writes where it locked: the link's target when it started."""
    settings = {**QUIET, "trainer.max_epochs": 2, "checkpoint.every_n_steps": 2, "checkpoint.keep_last": 1}
    a, b, link = tmp_path / "exp-a", tmp_path / "exp-b", tmp_path / "current"
    a.mkdir()
    other = ToyTrainer({**toy_cfg(tmp_path, **settings), "run_dir": str(b)})
    other.fit()
    theirs = _files(b)
    link.symlink_to(a)

    class RePointed(ToyTrainer):
        def on_train_batch_end(self, outputs, batch) -> None:
            if self.state.global_step == 3:
                link.unlink()
                link.symlink_to(b)

    run = RePointed({**toy_cfg(tmp_path, **settings), "run_dir": str(link)})
    run.fit()
    assert _files(b) == theirs
    assert run.version_dir == a / "version_0" and not (a / "version_0" / LOCK_FILE).exists()
    assert load_checkpoint(a / "version_0" / "checkpoints" / "last.pt")["loop"]["global_step"] == 16


def test_a_lock_whose_temp_file_cannot_be_written_leaves_no_temp_behind(tmp_path, monkeypatch):
    """A full disk while the lock's temp file is written left a partial ``.run.lock.<pid>.<random>.tmp`` that the
    tidy, seeing content that is not a lock's, kept for the user's: the temp is ampkit's own and goes with the error."""
    from ampkit.trainer import run_life
    from ampkit.trainer.run_life import RunLock

    version_dir = tmp_path / "version_0"
    version_dir.mkdir()

    class FullDisk:
        @staticmethod
        def dumps(value):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_life, "json", FullDisk)
    with pytest.raises(OSError, match="No space left"):
        RunLock(version_dir).acquire()
    assert list(version_dir.iterdir()) == []
