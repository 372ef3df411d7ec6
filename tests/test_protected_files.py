"""A checkpoint the user made read-only (``chmod a-w``, the Unix way to say "keep this") is never deleted or
replaced: pruning passes over it, and a resume that would replace ``last``/``best`` branches instead."""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from checkpoint_compare import assert_same_checkpoint
from omegaconf import OmegaConf
from toy_trainers import ToyTrainer, toy_cfg

from ampkit.trainer.checkpoint_io import CheckpointError, _umask, load_checkpoint, save_atomic

QUIET = {"logging.tensorboard": False, "trainer.progress_bar": False}


def _read_only(path: Path) -> None:
    path.chmod(path.stat().st_mode & ~0o222)
    for inner in path.iterdir() if path.is_dir() else []:
        inner.chmod(inner.stat().st_mode & ~0o222)


def _files(root: Path) -> dict:
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()}


class KeepsStepTwo(ToyTrainer):
    """Validates at every step a metric that grows, so each validation is a new best and pushes the previous one out
    of a top 1; at step 3, before its save, the user write-protects step 2's files."""

    def validation_step(self, batch):
        return {"step": float(self.state.global_step)}

    def on_train_batch_end(self, outputs, batch):
        if self.state.global_step == 3:
            for path in self.version_dir.glob("checkpoints/*-00000002*"):
                _read_only(path)


@pytest.mark.parametrize("sharded", [False, True], ids=["files", "fsdp"])
def test_pruning_keeps_write_protected_checkpoints_outside_keep_last_and_top_k(tmp_path, sharded):
    """keep_last and save_top_k deleted write-protected step and best files as any others."""
    settings = {
        **QUIET,
        "trainer.max_steps": 6,
        "trainer.val_every_n_steps": 1,
        "trainer.num_sanity_val_steps": 0,
        "checkpoint.every_n_steps": 1,
        "checkpoint.keep_last": 2,
        "checkpoint.monitor": "val/step",
        "checkpoint.mode": "max",
        "checkpoint.save_top_k": 1,
    }
    if sharded:
        settings["distributed.strategy"] = "fsdp"
    trainer = KeepsStepTwo(toy_cfg(tmp_path, **settings))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit()
    suffix = "" if sharded else ".pt"
    names = sorted(p.name for p in (trainer.version_dir / "checkpoints").iterdir())
    assert [n for n in names if n.startswith("step-")] == [f"step-{s:08d}{suffix}" for s in (2, 5, 6)]
    assert [n for n in names if n.startswith("best-")] == [f"best-{s:08d}{suffix}" for s in (2, 6)]
    said = [str(w.message) for w in caught if "write-protected" in str(w.message)]
    assert sorted(re.findall(r"(?:step|best)-00000002", " ".join(said))) == ["best-00000002", "step-00000002"]
    assert len(said) == 2  # one warning per file, not one per save


@pytest.mark.parametrize("alias", ["last.pt", "best.pt"])
def test_a_write_protected_last_or_best_makes_the_resume_branch(tmp_path, alias):
    """os.replace ignores the file's mode: --resume last replaced a read-only last.pt (and best.pt) with newer
    states."""
    settings = {**QUIET, "checkpoint.monitor": "val/mse", "trainer.val_every_n_steps": 2}
    first = ToyTrainer(toy_cfg(tmp_path, **settings))
    first.fit()
    kept = first.version_dir / "checkpoints" / alias
    _read_only(kept)
    before = _files(first.version_dir)
    resumed = ToyTrainer(toy_cfg(tmp_path, **settings, **{"trainer.max_epochs": 2}))
    with pytest.warns(UserWarning, match=rf"'{re.escape(str(kept))}' is write-protected .* training branches"):
        resumed.fit(resume="last")
    assert resumed.version_dir.name == "version_1" and resumed.state.global_step == 16
    assert _files(first.version_dir) == before


def test_a_save_never_replaces_a_write_protected_file(tmp_path):
    """The last line of defence, below every caller: the file stays as it was and the error names it."""
    kept = save_atomic({"ampkit_checkpoint": 1, "mine": 1}, tmp_path / "last.pt")
    _read_only(kept)
    before = kept.read_bytes()
    with pytest.raises(PermissionError, match="write-protected") as raised:
        save_atomic({"ampkit_checkpoint": 1, "mine": 2}, kept)
    assert raised.value.filename == str(kept) and kept.read_bytes() == before
    assert sorted(tmp_path.iterdir()) == [kept]  # no temp file left


def test_a_write_protected_best_pt_mid_run_stops_the_save_naming_it(tmp_path):
    """A best.pt made read-only while the run trains: the next new best stops the run at that save with the file
    named (the step's own file is whole), instead of replacing it."""

    class ProtectsBest(KeepsStepTwo):
        def on_train_batch_end(self, outputs, batch):
            if self.state.global_step == 3:
                _read_only(self.version_dir / "checkpoints" / "best.pt")

    settings = {
        **QUIET,
        "trainer.max_steps": 6,
        "trainer.val_every_n_steps": 1,
        "trainer.num_sanity_val_steps": 0,
        "checkpoint.monitor": "val/step",
        "checkpoint.mode": "max",
    }
    trainer = ProtectsBest(toy_cfg(tmp_path, **settings))
    best = tmp_path / "run" / "version_0" / "checkpoints" / "best.pt"
    with pytest.raises(CheckpointError, match=rf"'{re.escape(str(best))}' \(write-protected"):
        trainer.fit()


def test_a_write_protected_checkpoints_folder_makes_the_resume_branch_for_root_too(tmp_path):
    """The read-only check asked os.access, which says yes to root: as root, --resume last wrote into a checkpoints/
    folder the user had made read-only to keep it."""
    first = ToyTrainer(toy_cfg(tmp_path, **QUIET))
    first.fit()
    kept = first.version_dir / "checkpoints"
    kept.chmod(0o555)
    before = _files(kept)
    resumed = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 2}))
    with pytest.warns(UserWarning, match=rf"but '{re.escape(str(kept))}' cannot be written \(read-only\)"):
        resumed.fit(resume="last")
    assert resumed.version_dir.name == "version_1" and _files(kept) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="under this umask only root can write in the folders a run makes")
def test_a_umask_that_takes_write_permission_away_protects_nothing(tmp_path):
    """Under umask 0277 every file ampkit writes has no write permission: the run's second save refused to replace
    its own last.pt, and pruning kept every step file."""
    settings = {**QUIET, "trainer.max_steps": 4, "checkpoint.every_n_steps": 1, "checkpoint.keep_last": 1}
    before = os.umask(0o277)
    try:
        trainer = ToyTrainer(toy_cfg(tmp_path, **settings))
        trainer.fit()
    finally:
        os.umask(before)
    names = sorted(p.name for p in (trainer.version_dir / "checkpoints").iterdir())
    assert names == ["last.pt", "step-00000004.pt"]


@pytest.mark.skipif(os.geteuid() != 0, reason="under this umask only root can write in the folders a run makes")
def test_under_a_umask_that_takes_write_permission_away_a_resume_continues_its_run(tmp_path):
    """The resume's own test for a read-only version directory read the folder's mode without the umask's guard that
    checkpoint files have: under umask 0277 every folder a run makes has no write permission, so each --resume last
    branched into a new version_N, saying its run directory was read-only."""
    before = os.umask(0o277)
    try:
        ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 2})).fit()
        resumed = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 3}))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed.fit(resume="last")
    finally:
        os.umask(before)
    assert resumed.version_dir.name == "version_0" and resumed.fit_start.branched_from is None
    assert not [w for w in caught if "read-only" in str(w.message)]


def test_a_write_protected_config_record_is_kept_and_a_new_one_written_beside_it(tmp_path):
    """A resume from a step that an earlier resume (with another config) left a config record for replaced that
    record; write-protected, the resume was refused. Both are kept now, so the protection stops nothing."""

    class StopsAtOnce(ToyTrainer):
        def training_step(self, batch):
            raise KeyboardInterrupt

    ToyTrainer(toy_cfg(tmp_path, **QUIET)).fit()
    with pytest.raises(KeyboardInterrupt):
        StopsAtOnce(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 2, "lr": 0.01})).fit(resume="last")
    record = tmp_path / "run" / "version_0" / "config.resumed_at_step_8.yaml"
    _read_only(record)
    kept = record.read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the changed config's warning
        ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 2, "lr": 0.02})).fit(resume="last")
    assert record.read_bytes() == kept
    assert OmegaConf.load(record.with_name("config.resumed_at_step_8.1.yaml")).lr == 0.02


def test_a_write_protected_checkpoint_is_warned_about_once_in_a_run_not_at_every_resume(tmp_path):
    """Each resume warned again about every write-protected file pruning passed over, though nothing had changed."""
    settings = {**QUIET, "trainer.max_steps": 4, "checkpoint.every_n_steps": 1, "checkpoint.keep_last": 1}
    ToyTrainer(toy_cfg(tmp_path, **settings)).fit()
    kept = tmp_path / "run" / "version_0" / "checkpoints" / "step-00000004.pt"
    _read_only(kept)
    said = []
    for max_steps in (6, 8):
        resumed = ToyTrainer(toy_cfg(tmp_path, **{**settings, "trainer.max_steps": max_steps}))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed.fit(resume="last")
        said.append([str(w.message) for w in caught if "write-protected" in str(w.message)])
    assert len(said[0]) == 1 and str(kept) in said[0][0] and said[1] == []
    assert kept.is_file() and resumed.version_dir.name == "version_0"


def test_pruning_keeps_a_users_file_under_a_checkpoint_s_name(tmp_path):
    """A file of the user's in checkpoints/ under a name ampkit gives checkpoints (notes, a torch.save of weights, a
    best-k file copied in from another run's folder would be a checkpoint and goes) was deleted by a resume's tidy
    (best-*) and by keep_last's pruning (step-*), as if the run had written it."""
    settings = {
        **QUIET,
        "trainer.max_epochs": 2,
        "checkpoint.every_n_steps": 2,
        "checkpoint.keep_last": 2,
        "trainer.val_every_n_steps": 3,
        "checkpoint.monitor": "val/mse",
        "checkpoint.save_top_k": 2,
    }
    first = ToyTrainer(toy_cfg(tmp_path, **settings))
    first.fit()
    checkpoints = first.version_dir / "checkpoints"
    mine = {
        checkpoints / "best-00000001.pt": b"my notes",
        checkpoints / "step-00000001.pt": b"my notes, again",
        checkpoints / "epoch-0001.pt": b"",
    }
    for path, text in mine.items():
        path.write_bytes(text)
    weights = checkpoints / "best-00000002.pt"
    torch.save({"weight": torch.ones(2)}, weights)
    with pytest.warns(UserWarning, match="best-00000001.pt' holds no ampkit checkpoint: ampkit keeps it") as caught:
        ToyTrainer(toy_cfg(tmp_path, **{**settings, "trainer.max_epochs": 4})).fit(resume="last")
    assert {path: path.read_bytes() for path in mine} == mine
    assert torch.load(weights)["weight"].tolist() == [1.0, 1.0]
    kept = sorted(str(w.message).split("'")[1].rpartition("/")[2] for w in caught if "holds no" in str(w.message))
    assert kept == ["best-00000001.pt", "best-00000002.pt", "epoch-0001.pt", "step-00000001.pt"]  # once each
    periodic = sorted(p.name for p in checkpoints.glob("*") if p not in mine and p.name.startswith(("step", "epoch")))
    assert periodic == ["epoch-0004.pt", "step-00000032.pt"]  # keep_last still prunes the run's own


@pytest.mark.parametrize("name", ["best.pt", "step-00000040.pt"])
def test_a_resume_that_would_write_over_a_users_file_is_refused_before_training(tmp_path, name):
    """A file of the user's at best.pt (or a step file the run reaches later) of the run a --resume last continues was
    replaced by the resume's tidy-up (best.pt) or its first save there, with a checkpoint."""
    settings = {**QUIET, "checkpoint.monitor": "val/mse", "trainer.val_every_n_steps": 2, "checkpoint.every_n_steps": 4}
    first = ToyTrainer(toy_cfg(tmp_path, **settings))
    first.fit()
    mine = first.version_dir / "checkpoints" / name
    torch.save({"weight": torch.ones(2)}, mine)
    before = _files(tmp_path)
    resumed = ToyTrainer(toy_cfg(tmp_path, **settings, **{"trainer.max_epochs": 6}))
    with pytest.raises(CheckpointError, match=rf"'{re.escape(str(mine))}' holds no ampkit checkpoint .* move it out"):
        resumed.fit(resume="last")
    assert _files(tmp_path) == before


def test_a_users_file_put_at_best_pt_mid_run_stops_the_save_naming_it(tmp_path):
    """A user's torch.save of weights at best.pt while the run trains: the next new best replaced it."""

    class PutsMyBest(KeepsStepTwo):
        def on_train_batch_end(self, outputs, batch):
            if self.state.global_step == 3:
                torch.save({"weight": torch.ones(2)}, self.version_dir / "checkpoints" / "best.pt")

    settings = {
        **QUIET,
        "trainer.max_steps": 6,
        "trainer.val_every_n_steps": 1,
        "trainer.num_sanity_val_steps": 0,
        "checkpoint.monitor": "val/step",
        "checkpoint.mode": "max",
    }
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    with pytest.raises(CheckpointError, match=rf"'{re.escape(str(checkpoints / 'best.pt'))}' \(holds no ampkit"):
        PutsMyBest(toy_cfg(tmp_path, **settings)).fit()
    assert list(torch.load(checkpoints / "best.pt", weights_only=True)) == ["weight"]
    assert torch.load(checkpoints / "last.pt", weights_only=True)["loop"]["global_step"] == 2  # the save before


def test_resume_last_of_a_users_file_at_last_pt_says_whose_it_is(tmp_path):
    """--resume last of a run whose last.pt a user replaced said 'Expected a file ampkit's ModelCheckpoint wrote
    (last.pt, step-N.pt)' of a file named last.pt."""
    first = ToyTrainer(toy_cfg(tmp_path, **QUIET))
    first.fit()
    last = first.version_dir / "checkpoints" / "last.pt"
    torch.save({"weight": torch.ones(2)}, last)
    with pytest.raises(CheckpointError, match="a file of yours put there") as raised:
        ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 2})).fit(resume="last")
    assert "Expected a file" not in str(raised.value) and "epoch-0001.pt" in str(raised.value)
    assert list(torch.load(last, weights_only=True)) == ["weight"]


@pytest.mark.parametrize(("name", "kind"), [("best", "file"), ("best", "directory"), ("step-00000020", "directory")])
def test_a_sharded_resume_refuses_to_replace_a_users_own_file_or_folder(tmp_path, name, kind):
    """A sharded run's best is a link; a file or a folder of the user's put at its name (exported weights) was
    replaced by the link at the resumed run's next best, the folder deleted as if it were a copy of a checkpoint; one
    at a later step's name was set aside and deleted by that step's save."""
    settings = {
        **QUIET,
        "distributed.strategy": "fsdp",
        "checkpoint.monitor": "val/mse",
        "trainer.val_every_n_steps": 4,
        "checkpoint.every_n_steps": 4,
    }
    first = ToyTrainer(toy_cfg(tmp_path, **settings))
    first.fit()
    mine = first.version_dir / "checkpoints" / name
    if mine.is_symlink():
        mine.unlink()
    if kind == "directory":
        mine.mkdir()
        (mine / "model.safetensors").write_bytes(b"my exported weights")
    else:
        mine.write_bytes(b"my notes")
    before = _files(tmp_path)
    with pytest.raises(CheckpointError, match=rf"'{re.escape(str(mine))}' holds no ampkit checkpoint"):
        ToyTrainer(toy_cfg(tmp_path, **settings, **{"trainer.max_epochs": 3})).fit(resume="last")
    assert _files(tmp_path) == before


def test_moving_a_sharded_alias_never_replaces_a_users_file_there(tmp_path):
    """The save's own guard, below the resume's check: a file of the user's put at last while the run trains."""
    from ampkit.trainer.sharded_checkpoint import point_last_at

    (tmp_path / "step-00000001").mkdir()
    mine = tmp_path / "last"
    mine.write_bytes(b"my notes")
    with pytest.raises(FileExistsError, match="holds no ampkit checkpoint") as raised:
        point_last_at(tmp_path / "step-00000001")
    assert raised.value.filename == str(mine) and mine.read_bytes() == b"my notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "step-00000001"]  # no temp link left


def test_a_sharded_save_never_sets_aside_and_deletes_a_users_folder_at_its_name(tmp_path):
    """A save (here a best-k copy) into a name where a folder of the user's stands moved it aside and deleted it."""
    from ampkit.trainer.sharded_checkpoint import copy_sharded

    source = tmp_path / "step-00000001"
    source.mkdir()
    (source / ".metadata").write_bytes(b"m")
    mine = tmp_path / "best-00000001"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds no ampkit checkpoint"):
        copy_sharded(source, mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "mine"


def test_a_sharded_checkpoint_saved_again_under_its_name_keeps_the_file_the_user_put_in_it(tmp_path):
    """A checkpoint folder saved again under its name (a best-k copy, a resume's save of the same step) was set aside
    and deleted whole, with the evaluation results the user had saved in it; they move into the new one."""
    from ampkit.trainer.sharded_checkpoint import copy_sharded

    source, alias = tmp_path / "step-00000004", tmp_path / "best-00000004"
    for folder, text in ((source, b"new"), (alias, b"old")):
        folder.mkdir()
        for part in (".metadata", "__0_0.distcp", "trainer.pt"):
            (folder / part).write_bytes(text)
    (alias / "eval.json").write_text('{"accuracy": 0.5}')
    copy_sharded(source, alias)
    assert sorted(p.name for p in alias.iterdir()) == [".metadata", "__0_0.distcp", "eval.json", "trainer.pt"]
    assert (alias / "trainer.pt").read_bytes() == b"new" and (alias / "eval.json").read_text() == '{"accuracy": 0.5}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best-00000004", "step-00000004"]


def test_a_run_does_not_read_back_the_checkpoints_it_wrote_to_tell_them_from_a_users(tmp_path, monkeypatch):
    """Each save read last.pt (and each file pruning passed) back to see that it was no file of the user's: for a
    model of a few thousand tensors that read cost 70% of the save's time again."""
    from ampkit.trainer import checkpoint_io

    read: list[str] = []
    monkeypatch.setattr(checkpoint_io, "_holds_ampkit_checkpoint", lambda path, *identity: read.append(path) or True)
    settings = {**QUIET, "checkpoint.every_n_steps": 1, "checkpoint.keep_last": 1, "checkpoint.monitor": "val/mse"}
    ToyTrainer(toy_cfg(tmp_path, **{**settings, "trainer.val_every_n_steps": 2})).fit()
    assert read == []


def _sharded_folder(folder: Path, text: bytes = b"a part") -> Path:
    folder.mkdir(parents=True)
    for part in (".metadata", "__0_0.distcp", "trainer.pt"):
        (folder / part).write_bytes(text)
    return folder


def _own_files(folder: Path) -> dict:
    """Every file and link under ``folder``, by path: its bytes (a link: where it leads)."""
    return {
        p: os.readlink(p) if p.is_symlink() else p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_symlink() or p.is_file()
    }


@pytest.fixture
def named_once(monkeypatch):
    """Warnings as a Trainer's rank zero gives them, and a fresh record of the user's things named at temp names."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    from ampkit.trainer import temp_names

    monkeypatch.setattr(rank_zero_only, "rank", 0, raising=False)
    monkeypatch.setattr(temp_names, "_named", set())


def test_a_sharded_save_clears_only_a_killed_save_s_files_from_its_temp_folder(tmp_path, named_once):
    """The save's temp folder (``.best-00000004.tmp``) was deleted whole before each save: a folder of that name the
    user made, or the notes they put in one a kill left, went with it; then such a folder stopped the save, and the run.
    A kill's own leftovers (DCP's ``.metadata.tmp``, a shard, ``trainer.pt``'s temp file) go, and the save is made;
    the user's folder or file there stays as it is, named once, and the save goes through a free temp name."""
    from ampkit.trainer import temp_names
    from ampkit.trainer.sharded_checkpoint import copy_sharded

    source, alias = _sharded_folder(tmp_path / "step-00000004", b"new"), tmp_path / "best-00000004"
    tmp = tmp_path / ".best-00000004.tmp"
    tmp.mkdir()
    for leftover in (".metadata.tmp", "__0_0.distcp", ".trainer.pt.k3x9_q0a.tmp", "..metadata.abcd1234.tmp"):
        (tmp / leftover).write_bytes(b"half")
    copy_sharded(source, alias)
    assert sorted(p.name for p in alias.iterdir()) == [".metadata", "__0_0.distcp", "trainer.pt"]
    assert not tmp.exists()

    for mine in ("a folder", "a file"):
        shutil.rmtree(alias)  # made again below, where only its temp name is in the way
        if mine == "a folder":
            tmp.mkdir()
            (tmp / "__0_0.distcp").write_bytes(b"half")  # a kill's, beside the user's notes: it goes
            (tmp / "notes.txt").write_text("mine")
            said = r"\.best-00000004\.tmp' is a folder holding notes\.txt, which ampkit did not write: ampkit keeps it"
        else:
            shutil.rmtree(tmp)
            tmp.write_text("a file of mine")
            said = r"\.best-00000004\.tmp' is a file: ampkit keeps it as it is and writes through a free temp name"
        with pytest.warns(UserWarning, match=said):
            copy_sharded(source, alias)
        assert {p.name: p.read_bytes() for p in alias.iterdir()} == {n: b"new" for n in (".metadata", "__0_0.distcp",
                                                                                          "trainer.pt")}  # fmt: skip
        assert alias.stat().st_mode & 0o777 == 0o777 & ~_umask()  # as mkdir makes it, not mkdtemp (0o700)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the next save through it: said once
            shutil.rmtree(alias)
            copy_sharded(source, alias)
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == [".best-00000004.tmp", "best-00000004", "step-00000004"], left
        if mine == "a folder":
            assert _own_files(tmp) == {tmp / "notes.txt": b"mine"}
        else:
            assert tmp.read_text() == "a file of mine"
        temp_names._named.clear()  # the next case's thing stands at the same name: said again


def test_a_checkpoint_file_that_cannot_be_deleted_stops_a_save_but_not_a_removal(tmp_path, monkeypatch):
    """Clearing a save's temp folder and discarding a removed checkpoint's share one loop, not one ending. Before a
    save, a leftover shard that cannot be deleted (a read-only mount) is its own error, naming that file, not named as
    the user's; a removal deletes what it can and carries on, as a tidy or a failing save's clean-up must."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    from ampkit.trainer.sharded_checkpoint import discard_checkpoint_dir, free_temp_dir_name

    monkeypatch.setattr(rank_zero_only, "rank", 0, raising=False)  # as a Trainer sets it
    unlink = Path.unlink

    def refused(path: Path, missing_ok: bool = False) -> None:
        if path.name == "__0_0.distcp":
            raise PermissionError(13, "Permission denied", str(path))
        unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refused)
    tmp = tmp_path / ".step-00000004.tmp"
    tmp.mkdir()
    for part in ("__0_0.distcp", "trainer.pt"):
        (tmp / part).write_bytes(b"half")
    with pytest.raises(PermissionError) as raised:
        free_temp_dir_name(tmp_path / "step-00000004", "tmp")
    assert raised.value.filename == str(tmp / "__0_0.distcp")
    (tmp / "trainer.pt").write_bytes(b"half")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert discard_checkpoint_dir(tmp, tmp)
    assert not (tmp / "trainer.pt").exists() and (tmp / "__0_0.distcp").exists()
    said = [str(w.message) for w in caught]  # the shard it could not delete is named as its own, not as the user's
    assert any("own __0_0.distcp could not be deleted" in m for m in said), said
    assert not any("which ampkit did not write" in m for m in said), said


def test_moving_a_sharded_alias_never_deletes_a_users_file_at_its_temp_name(tmp_path, named_once):
    """``point_last_at`` deleted whatever stood at ``.last.tmp`` before making its link there, then refused a file of
    the user's there, stopping the save. ampkit makes only a link to a checkpoint's name there, which a kill may leave
    and which goes; the user's file, or link elsewhere, stays, and the link moves through a free temp name."""
    from ampkit.trainer import temp_names
    from ampkit.trainer.sharded_checkpoint import point_last_at

    (tmp_path / "step-00000001").mkdir()
    (tmp_path / "step-00000002").mkdir()
    mine = tmp_path / ".last.tmp"
    mine.write_bytes(b"my notes")
    with pytest.warns(UserWarning, match=r"\.last\.tmp' is a file: ampkit keeps it as it is"):
        point_last_at(tmp_path / "step-00000001")
    assert os.readlink(tmp_path / "last") == "step-00000001" and mine.read_bytes() == b"my notes"
    mine.unlink()
    os.symlink("my-exports", mine)  # the user's link, to no checkpoint's name
    temp_names._named.clear()  # named once in a process: another thing at the same name is said again here
    with pytest.warns(UserWarning, match=r"\.last\.tmp' is a link of yours"):
        point_last_at(tmp_path / "step-00000002")
    assert os.readlink(tmp_path / "last") == "step-00000002" and os.readlink(mine) == "my-exports"
    mine.unlink()
    os.symlink("step-00000001", mine)  # a kill's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        point_last_at(tmp_path / "step-00000001")
    assert os.readlink(tmp_path / "last") == "step-00000001" and not mine.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "step-00000001", "step-00000002"]


def test_a_resumed_process_prunes_and_replaces_its_run_s_checkpoints_as_the_uninterrupted_run(tmp_path):
    """A resume is a new process: it has not written the run's earlier checkpoints (checkpoint_io's record of what this
    process wrote is empty), so it reads them to tell them from the user's. It must still replace last.pt and best.pt,
    prune the step files past keep_last and the best files out of the top k, exactly as one uninterrupted run does,
    and keep (naming it once in the run) a file of the user's under a checkpoint's name."""
    from ampkit.trainer import checkpoint_io

    settings = {
        **QUIET,
        "checkpoint.every_n_steps": 2,
        "checkpoint.keep_last": 2,
        "checkpoint.monitor": "val/mse",
        "checkpoint.save_top_k": 2,
        "trainer.val_every_n_steps": 2,
        "trainer.max_epochs": 3,
    }
    straight = ToyTrainer(toy_cfg(tmp_path / "straight", **settings, **{"trainer.max_steps": 16}))
    straight.fit()
    first = ToyTrainer(toy_cfg(tmp_path / "resumed", **settings, **{"trainer.max_steps": 6}))
    first.fit()
    checkpoints = first.version_dir / "checkpoints"
    mine = checkpoints / "step-00000001.pt"
    torch.save({"weights": torch.ones(2)}, mine)
    checkpoint_io._WRITTEN.clear()  # a new process: it wrote none of them
    checkpoint_io._holds_ampkit_checkpoint.cache_clear()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        resumed = ToyTrainer(toy_cfg(tmp_path / "resumed", **settings, **{"trainer.max_steps": 16}))
        resumed.fit(resume="last")
    assert resumed.version_dir == first.version_dir

    def names(run) -> list[str]:
        return sorted(p.name for p in (run.version_dir / "checkpoints").iterdir())

    assert resumed.state.global_step == 16
    assert names(resumed) == sorted([*names(straight), mine.name])
    for name in names(straight):
        ours, theirs = (load_checkpoint(r.version_dir / "checkpoints" / name) for r in (resumed, straight))
        # what differs: what the resume saved remembers that it named the user's file; the first run's, its max_steps
        resumed_saved = ours["loop"]["global_step"] > 6
        named = [mine.name] if resumed_saved else []
        assert ours["callbacks"]["ModelCheckpoint[val/mse]"].pop("protected") == named, name
        if not resumed_saved:
            ours["config"]["trainer"]["max_steps"] = 16
        theirs["callbacks"]["ModelCheckpoint[val/mse]"].pop("protected")
        assert_same_checkpoint(ours, theirs)
    assert torch.load(mine)["weights"].tolist() == [1.0, 1.0]
    about_mine = [w for w in said if str(mine) in str(w.message)]
    assert len(about_mine) == 1 and "holds no ampkit checkpoint" in str(about_mine[0].message)


def test_moving_a_sharded_alias_over_a_copied_checkpoint_never_deletes_a_users_folder_at_its_set_aside_name(
    tmp_path, named_once
):
    """``last`` copied whole by a tool that follows links is set aside as ``.last.old`` while the link takes its place;
    whatever stood at ``.last.old`` was deleted first, a folder of the user's too; then such a folder stopped the save.
    The copy is set aside under a free name and goes; the user's folder stays as it is."""
    from ampkit.trainer.sharded_checkpoint import point_last_at

    (tmp_path / "step-00000002").mkdir()
    _sharded_folder(tmp_path / "last")
    mine = tmp_path / ".last.old"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.warns(UserWarning, match=r"\.last\.old' is a folder holding notes\.txt, which ampkit did not write"):
        point_last_at(tmp_path / "step-00000002")
    assert os.readlink(tmp_path / "last") == "step-00000002"
    assert _own_files(mine) == {mine / "notes.txt": b"mine"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".last.old", "last", "step-00000002"]


def test_pruning_a_sharded_checkpoint_past_a_users_folder_at_its_temp_name_names_it_once(tmp_path, named_once):
    """A removal renames the checkpoint to ``.step-N.tmp`` first; with a folder of the user's there the rename failed
    and the checkpoint stayed, past keep_last, at every save's pruning (named once later, but kept all the same). It
    goes through a free temp name now; the user's folder stays as it is, named once."""
    from ampkit.trainer.sharded_checkpoint import prune_sharded

    for step in (2, 4, 6):
        folder = tmp_path / f"step-0000000{step}"
        folder.mkdir()
        for part in (".metadata", "__0_0.distcp"):
            (folder / part).write_bytes(b"a part")
        save_atomic({"ampkit_checkpoint": 1, "loop": {"global_step": step, "epoch": 0}}, folder / "trainer.pt")
    mine = tmp_path / ".step-00000002.tmp"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.warns(UserWarning, match=r"\.step-00000002\.tmp' is a folder holding notes\.txt") as said:
        prune_sharded(tmp_path, keep_last=2)
    assert len(said) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step-00000002.tmp", "step-00000004", "step-00000006"]
    assert _own_files(mine) == {mine / "notes.txt": b"mine"}


def test_pruning_never_deletes_through_a_users_link_at_a_checkpoints_name(tmp_path, monkeypatch):
    """A sharded checkpoint pruned past keep_last was renamed to its temp name and emptied: where ``step-N`` was the
    user's link to a checkpoint folder of theirs elsewhere, its files were deleted there, through the link. A link at a
    checkpoint's name (ampkit copies, never links, there) is kept, named, and so is what it points to."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    from ampkit.trainer.run_life import prune_periodic
    from ampkit.trainer.sharded_checkpoint import prune_sharded, remove_sharded

    monkeypatch.setattr(rank_zero_only, "rank", 0, raising=False)  # as a Trainer sets it
    checkpoints, elsewhere = tmp_path / "checkpoints", tmp_path / "my-checkpoints"
    for folder, step in (
        (elsewhere / "kept", 2),
        (checkpoints / "step-00000004", 4),
        (checkpoints / "step-00000006", 6),
    ):
        folder.mkdir(parents=True)
        for part in (".metadata", "__0_0.distcp"):
            (folder / part).write_bytes(b"a part")
        save_atomic({"ampkit_checkpoint": 1, "loop": {"global_step": step, "epoch": 0}}, folder / "trainer.pt")
    (checkpoints / "step-00000002").symlink_to(elsewhere / "kept")
    theirs = sorted(p.name for p in (elsewhere / "kept").iterdir())
    with pytest.warns(UserWarning, match=r"step-00000002' is a link \(to '.*my-checkpoints/kept'\), which ampkit"):
        prune_sharded(checkpoints, keep_last=1)
    assert sorted(p.name for p in (elsewhere / "kept").iterdir()) == theirs
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000002", "step-00000006"]
    remove_sharded(checkpoints / "step-00000002")  # a best-k drop's removal, called on the link itself
    assert (checkpoints / "step-00000002").is_symlink()
    assert sorted(p.name for p in (elsewhere / "kept").iterdir()) == theirs
    files = tmp_path / "files"
    files.mkdir()
    save_atomic({"ampkit_checkpoint": 1, "loop": {"global_step": 4, "epoch": 0}}, files / "step-00000004.pt")
    save_atomic({"ampkit_checkpoint": 1, "loop": {"global_step": 2, "epoch": 0}}, elsewhere / "step-2.pt")
    (files / "step-00000002.pt").symlink_to(elsewhere / "step-2.pt")
    with pytest.warns(UserWarning, match=r"step-00000002\.pt' is a link"):
        prune_periodic(files, keep_last=1)
    assert (files / "step-00000002.pt").is_symlink() and (elsewhere / "step-2.pt").is_file()


def test_a_sharded_save_of_a_name_again_steps_around_a_users_file_at_its_set_aside_name(tmp_path, named_once):
    """A checkpoint saved again under its name is set aside as ``.<name>.old`` first; a file of the user's there failed
    the save with a bare 'Not a directory', then with its name, stopping the run. It is kept, named, and the old
    checkpoint set aside under a free name while the new one takes its place."""
    from ampkit.trainer.sharded_checkpoint import copy_sharded

    source, alias = _sharded_folder(tmp_path / "step-00000004", b"new"), _sharded_folder(tmp_path / "best-00000004")
    (alias / "eval.json").write_text("{}")  # the user's file in the old checkpoint moves on into the new one
    mine = tmp_path / ".best-00000004.old"
    mine.write_text("my notes")
    with pytest.warns(UserWarning, match=r"\.best-00000004\.old' is a file: ampkit keeps it as it is"):
        copy_sharded(source, alias)
    assert mine.read_text() == "my notes" and (alias / "trainer.pt").read_bytes() == b"new"
    assert (alias / "eval.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".best-00000004.old", "best-00000004", "step-00000004"]


def test_a_resume_s_tidy_never_removes_a_users_dangling_link_at_best(tmp_path):
    """A sharded run's resume removed a ``best`` link that led nowhere where its ranking named no whole best: a link
    of the user's there (to exports they moved away) went too. Only a link to a checkpoint's name, as ampkit makes it,
    is the kill's to remove."""
    from ampkit.callbacks import ModelCheckpoint

    (tmp_path / "best").symlink_to("../my-exports")
    ModelCheckpoint(monitor="val/mse")._relink_best(tmp_path)
    assert os.readlink(tmp_path / "best") == "../my-exports"
    (tmp_path / "best").unlink()
    (tmp_path / "best").symlink_to("best-00000004")  # a kill's, to a directory gone since
    ModelCheckpoint(monitor="val/mse")._relink_best(tmp_path)
    assert not (tmp_path / "best").is_symlink()
