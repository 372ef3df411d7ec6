"""Lightning's naming attributes of ModelCheckpoint (``checkpoint_callback.CHECKPOINT_NAME_LAST = "{epoch}-last"``, as
its docs show): the last name is honoured as Lightning formats it, beside the last.pt a resume reads; the others are
refused where changed, naming why, instead of being silently ignored."""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest
from toy_trainers import ToyTrainer, toy_cfg

from ampkit import Callback
from ampkit.callbacks import ModelCheckpoint
from ampkit.callbacks import checkpoint as checkpoint_module
from ampkit.trainer.checkpoint_io import CheckpointError, load_checkpoint

# 48 samples in batches of 8: 6 iterations an epoch
SETTINGS = {"logging.tensorboard": False, "trainer.progress_bar": False, "logging.throughput": False,
            "checkpoint.enabled": False, "trainer.num_sanity_val_steps": 0, "data.n": 48}  # fmt: skip


def _fit(tmp_path, callback: ModelCheckpoint, epochs: int, resume: str | None = None) -> ToyTrainer:
    run = ToyTrainer(toy_cfg(tmp_path, **SETTINGS, **{"trainer.max_epochs": epochs}), callbacks=[callback])
    run.fit(resume=resume)
    return run


def test_checkpoint_name_last_set_on_the_instance_names_a_copy_of_the_newest_as_lightning_formats_it(tmp_path):
    """It did nothing. Now each save also writes ``epoch=<current_epoch>-last.pt`` (the previous one removed, as
    Lightning's save_last does), last_model_path names it, and --resume last (last.pt) continues the run, which
    removes the resumed run's named file at its next save."""
    callback = ModelCheckpoint()
    callback.CHECKPOINT_NAME_LAST = "{epoch}-last"
    run = _fit(tmp_path, callback, epochs=3)
    directory = run.version_dir / "checkpoints"
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["epoch-0002.pt", "epoch-0003.pt", "epoch=2-last.pt", "last.pt"]
    assert callback.last_model_path == str(directory / "epoch=2-last.pt")
    assert load_checkpoint(directory / "epoch=2-last.pt")["loop"] == load_checkpoint(directory / "last.pt")["loop"]
    again = ModelCheckpoint()
    again.CHECKPOINT_NAME_LAST = "{epoch}-last"
    resumed = _fit(tmp_path, again, epochs=4, resume="last")
    assert resumed.version_dir == run.version_dir and resumed.state.global_step == 24
    assert sorted(p.name for p in directory.glob("*last*")) == ["epoch=3-last.pt", "last.pt"]
    assert load_checkpoint(directory / "epoch=3-last.pt")["loop"]["global_step"] == 24


def test_a_subclass_s_last_name_takes_its_equals_char_format_spec_and_step(tmp_path):
    """Set on a subclass, with Lightning's CHECKPOINT_EQUALS_CHAR and a format spec; a constant name is one file."""

    class Latest(ModelCheckpoint):
        CHECKPOINT_NAME_LAST = "{step:05d}-latest"
        CHECKPOINT_EQUALS_CHAR = "_"

    run = _fit(tmp_path, Latest(every_n_steps=4, every_n_epochs=0), epochs=2)
    names = sorted(p.name for p in (run.version_dir / "checkpoints").iterdir())
    assert names == ["last.pt", "step-00000008.pt", "step-00000012.pt", "step_00012-latest.pt"]

    class Constant(ModelCheckpoint):
        CHECKPOINT_NAME_LAST = "latest"

    run = _fit(tmp_path / "constant", Constant(), epochs=2)
    assert load_checkpoint(run.version_dir / "checkpoints" / "latest.pt")["loop"]["global_step"] == 12


@pytest.mark.parametrize(
    ("attribute", "value", "said"),
    [
        ("FILE_EXTENSION", ".ckpt", "FILE_EXTENSION = '.ckpt' is not taken (only '.pt'): ampkit's checkpoints are .pt"),
        ("CHECKPOINT_JOIN_CHAR", "_", "CHECKPOINT_JOIN_CHAR = '_' is not taken (only '-'): it joins a filename's"),
        ("STARTING_VERSION", 0, "STARTING_VERSION = 0 is not taken (only 1): it numbers Lightning's -v1, -v2"),
        ("CHECKPOINT_EQUALS_CHAR", "_", "CHECKPOINT_EQUALS_CHAR = '_' would change no file's name: here it goes only"),
        ("CHECKPOINT_NAME_LAST", "{val_loss:.2f}-last", "its field {val_loss} is none of {epoch} and {step}"),
        ("CHECKPOINT_NAME_LAST", "best", "it makes 'best.pt', the name of one of ampkit's own checkpoint files"),
        ("CHECKPOINT_NAME_LAST", "{epoch", "it is no format string"),
        ("CHECKPOINT_NAME_LAST", "runs/{epoch}", "which is no plain file name in the checkpoints directory"),
        ("CHECKPOINT_NAME_LAST", "", "expected a non-empty string such as 'last' or '{epoch}-last'"),
    ],
)  # fmt: skip
def test_a_naming_attribute_ampkit_cannot_honour_is_refused_on_a_subclass_and_on_an_instance(
    tmp_path, attribute, value, said
):
    """On a subclass the construction refuses it; set on an instance (Lightning's docs' way), the fit does, before
    training. Each was silently ignored."""
    subclass = type("Named", (ModelCheckpoint,), {attribute: value})
    with pytest.raises(ValueError, match="Named." + attribute) as refused:
        subclass()
    assert said in str(refused.value)
    callback = ModelCheckpoint()
    setattr(callback, attribute, value)
    run = ToyTrainer(toy_cfg(tmp_path, **SETTINGS, **{"trainer.max_epochs": 1}), callbacks=[callback])
    with pytest.raises(ValueError, match="ModelCheckpoint." + attribute) as refused:
        run.fit()
    assert said in str(refused.value) and run.state.global_step == 0


@pytest.mark.parametrize(
    ("attribute", "value"),
    [("CHECKPOINT_NAME_LAST", "x" * 5000 + "{"), ("CHECKPOINT_NAME_LAST", "runs/" + "x" * 5000),
     ("CHECKPOINT_NAME_LAST", "{epoch:" + "x" * 5000 + "}"), ("CHECKPOINT_EQUALS_CHAR", "_" * 5000)],
)  # fmt: skip
def test_a_refused_naming_attribute_is_named_by_its_start_and_length(attribute, value):
    """The refusals repeated a pasted 5000-character name whole, some twice (the name and the file it makes)."""
    with pytest.raises(ValueError, match=r"characters\)") as refused:
        type("Named", (ModelCheckpoint,), {attribute: value})()
    assert len(str(refused.value)) < 700


@pytest.mark.parametrize("key", ["named_last", "replacing_last"])
@pytest.mark.parametrize("named", ["step-00000003.pt", "last.pt", "best-00000002.pt", "../notes.txt"])
def test_a_restored_last_copy_naming_one_of_ampkit_s_files_or_a_path_is_refused(named, key):
    """The next save removes the previous CHECKPOINT_NAME_LAST copy: an edited checkpoint naming a step file (or a
    path outside the directory) as that copy would have had it deleted. The state it had is kept."""
    callback = ModelCheckpoint()
    with pytest.raises(CheckpointError, match=re.escape(repr(named))):
        callback.load_state_dict({"best_k": {}, "kept": [], "protected": [], key: named})
    assert callback.state_dict().get(key) is None


@pytest.mark.parametrize(("left", "removed"), [("epoch-0002.pt", True), ("last.pt", False), (None, False)])
def test_a_resume_removes_the_last_copy_a_killed_save_was_replacing_and_never_a_user_s_file(tmp_path, left, removed):
    """A kill between writing the new CHECKPOINT_NAME_LAST copy and removing the one before left that one for good:
    the resumed run's saves remove only the copy last.pt names. Now the resume removes it where it is provably
    ampkit's (last.pt's state names it as the copy it replaced, and the file's own state names it as its copy); a
    user's copy of last.pt, or a file of their own, under that name stays."""
    callback = ModelCheckpoint()
    callback.CHECKPOINT_NAME_LAST = "{epoch}-last"
    directory = _fit(tmp_path, callback, epochs=3).version_dir / "checkpoints"
    killed = directory / "epoch=1-last.pt"  # epoch-0002.pt's state is the one that copy held (epoch 1, 0-based)
    killed.write_bytes((directory / left).read_bytes() if left else b"my notes")
    again = ModelCheckpoint()
    again.CHECKPOINT_NAME_LAST = "{epoch}-last"
    _fit(tmp_path, again, epochs=4, resume="last")
    named = ["epoch=3-last.pt", "last.pt"] if removed else ["epoch=1-last.pt", "epoch=3-last.pt", "last.pt"]
    assert sorted(p.name for p in directory.glob("*last*")) == named


def test_a_last_name_made_invalid_mid_run_refuses_the_save_and_best_model_path_still_names_a_written_file(tmp_path):
    """The last name is formatted as a save starts, so one set anew mid-run (checked at the fit's start only) is refused
    there: the refusal left best_model_path (and the state a later save writes) naming the file never written."""
    callback = ModelCheckpoint()

    class Renames(Callback):
        def on_train_epoch_start(self, trainer) -> None:
            if trainer.state.epoch == 1:
                callback.CHECKPOINT_NAME_LAST = "{loss}-last"

    run = ToyTrainer(toy_cfg(tmp_path, **SETTINGS, **{"trainer.max_epochs": 3}), callbacks=[callback, Renames()])
    with pytest.raises(ValueError, match=r"CHECKPOINT_NAME_LAST = '\{loss\}-last' is invalid: its field \{loss\}"):
        run.fit()
    assert Path(callback.best_model_path).name == "epoch-0001.pt" and Path(callback.best_model_path).is_file()
    assert callback.state_dict()["newest"] == "epoch-0001.pt"


@pytest.mark.parametrize("kind", ["folder", "dangling link"])
def test_a_user_s_folder_or_link_at_the_previous_last_name_stays_and_the_save_goes_on(tmp_path, kind):
    """The next save removes the previous copy only where it is ampkit's file: a folder of the user's there made the
    removal fail after last.pt was written, stopping the run as a failed save, and a link of theirs was deleted."""
    callback = ModelCheckpoint()
    callback.CHECKPOINT_NAME_LAST = "{epoch}-last"

    class Replaces(Callback):
        def on_train_epoch_start(self, trainer) -> None:
            if trainer.state.epoch == 1:  # the user's thing where epoch 0's copy was
                mine = trainer.version_dir / "checkpoints" / "epoch=0-last.pt"
                mine.unlink()
                mine.mkdir() if kind == "folder" else mine.symlink_to("elsewhere")

    run = ToyTrainer(toy_cfg(tmp_path, **SETTINGS, **{"trainer.max_epochs": 2}), callbacks=[callback, Replaces()])
    run.fit()
    mine = run.version_dir / "checkpoints" / "epoch=0-last.pt"
    assert (mine.is_dir() if kind == "folder" else mine.is_symlink()) and run.state.epoch == 2
    assert (run.version_dir / "checkpoints" / "epoch=1-last.pt").is_file()


def test_a_resume_removes_the_temp_file_a_killed_copy_to_the_last_name_left_and_keeps_a_user_s(tmp_path):
    """The copy to the CHECKPOINT_NAME_LAST name goes through ``.<name>.<random>.tmp``, which the fit's tidy (knowing
    only ampkit's own names) kept for good after a kill: a checkpoint's size each time. The resume that names the copy
    removes what a killed copy leaves there (the start of torch's archive); a file of the user's there stays."""
    callback = ModelCheckpoint()
    callback.CHECKPOINT_NAME_LAST = "{epoch}-last"
    directory = _fit(tmp_path, callback, epochs=2).version_dir / "checkpoints"
    killed, notes = directory / ".epoch=1-last.pt.k1ll3d_x.tmp", directory / ".epoch=1-last.pt.mynotes1.tmp"
    killed.write_bytes((directory / "last.pt").read_bytes()[:100])
    notes.write_text("my notes")
    again = ModelCheckpoint()
    again.CHECKPOINT_NAME_LAST = "{epoch}-last"
    _fit(tmp_path, again, epochs=3, resume="last")
    assert not killed.exists() and notes.read_text() == "my notes"


def test_a_full_disk_at_the_last_name_s_copy_says_last_pt_holds_this_save(tmp_path, monkeypatch):
    """The named copy is written after last.pt: its failure (a full disk) was told as 'last.pt still holds the previous
    checkpoint', while last.pt held this save's, and a resume by that word would have gone back a save."""
    real_copy = checkpoint_module.copy_atomic

    def full_at_the_named_copy(source, alias):
        if alias.name == "epoch=0-last.pt":
            raise OSError(errno.ENOSPC, "No space left on device", str(alias))
        real_copy(source, alias)

    monkeypatch.setattr(checkpoint_module, "copy_atomic", full_at_the_named_copy)
    callback = ModelCheckpoint()
    callback.CHECKPOINT_NAME_LAST = "{epoch}-last"
    with pytest.raises(CheckpointError) as failed:
        _fit(tmp_path, callback, epochs=1)
    said = str(failed.value)
    assert "'epoch=0-last.pt'" not in said and "epoch=0-last.pt' (No space left on device)" in said
    assert "last.pt holds this save's checkpoint" in said and "previous" not in said
    written = tmp_path / "run" / "version_0" / "checkpoints"
    assert load_checkpoint(written / "last.pt")["loop"] == load_checkpoint(written / "epoch-0001.pt")["loop"]
