"""A resume after the user changed the code: a layer added, removed or resized, an optimizer's param groups or frozen
parameters changed, a scheduler added or of another class. Each is refused before anything is written, in one line
naming every difference (keys with their shapes, groups with their sizes and parameters, schedulers by class), not
torch's wall of keys, its "different number of parameter groups", or a zip() error; nor is another scheduler class's
state loaded into this one's without a word."""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torn_checkpoint import tear
from toy_trainers import ToyTrainer, toy_cfg, toy_model

from ampkit.trainer.checkpoint_io import FORMAT_KEY, FORMAT_VERSION, CheckpointError
from ampkit.trainer.run_life import resolve_checkpoint

QUIET = {"logging.tensorboard": False, "trainer.progress_bar": False, "trainer.max_epochs": 1}


class Wider(ToyTrainer):
    def configure_model(self):
        return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))


class OneMore(ToyTrainer):
    def configure_model(self):
        return nn.Sequential(*toy_model(), nn.Linear(1, 1))


class Shifted(ToyTrainer):
    def configure_model(self):
        return nn.Sequential(*toy_model()[:3], nn.Identity(), nn.Linear(16, 1))  # the last layer is `4.` now


class TwoGroups(ToyTrainer):
    def configure_optimizers(self):
        first, last = self.module[0], self.module[3]
        return torch.optim.SGD([{"params": first.parameters()}, {"params": last.parameters(), "lr": 0.01}], lr=0.05)


class FrozenFirst(ToyTrainer):
    def configure_model(self):
        model = toy_model()
        model[0].requires_grad_(False)
        return model

    def configure_optimizers(self):
        return torch.optim.SGD(self.module[3].parameters(), lr=self.cfg.lr, momentum=0.9)


class WithStepLR(ToyTrainer):
    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 3)}


class WithCosine(ToyTrainer):
    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 10)}


def _trained(tmp_path, trainer_class=ToyTrainer):
    trainer_class(toy_cfg(tmp_path, **QUIET)).fit()
    return sorted((tmp_path / "run").rglob("*"))


@pytest.mark.parametrize(
    "trainer_class, said",
    [
        (
            Wider,
            r"size mismatch for 0\.weight: shape \[16, 6\] in the checkpoint, \[32, 6\] in this run's model; also "
            r"0\.bias \[16\] -> \[32\], 3\.weight \[1, 16\] -> \[1, 32\]$",
        ),
        (OneMore, r": Missing key\(s\) in the checkpoint: 4\.weight \[1, 1\], 4\.bias \[1\]$"),
        (
            Shifted,
            r": Missing key\(s\) in the checkpoint: 4\.weight \[1, 16\], 4\.bias \[1\]; Unexpected key\(s\) in the "
            r"checkpoint: 3\.weight \[1, 16\], 3\.bias \[1\]$",
        ),
        (
            TwoGroups,
            r"optimizer 'sgd' holds 1 param group of 4 parameters in the checkpoint, 2 param groups of 2, 2 parameters "
            r"in this run: its state cannot be restored into other param groups\. Resume with configure_optimizers\(\)",
        ),
        (
            WithStepLR,
            r"optimizer 'sgd' has the lr schedulers \[none\] in the checkpoint, \[StepLR\] in this run: their state",
        ),
    ],
)
def test_a_resume_with_a_changed_model_optimizer_or_scheduler_names_every_difference_and_writes_nothing(
    tmp_path, trainer_class, said
):
    before = _trained(tmp_path)
    with pytest.raises(CheckpointError) as raised:
        trainer_class(toy_cfg(tmp_path, **{**QUIET, "trainer.max_epochs": 2})).fit(resume="last")
    message = str(raised.value)
    assert "\n" not in message and re.search(said, message), message
    assert sorted((tmp_path / "run").rglob("*")) == before


def test_other_param_groups_under_fsdp_are_named_as_without_it_not_as_a_damaged_shard(tmp_path):
    """DCP's load failed on the missing ``param_groups.1.lr`` key, which read as a damaged shard file."""
    sharded = {**QUIET, "distributed.strategy": "fsdp"}
    ToyTrainer(toy_cfg(tmp_path, **sharded)).fit()
    before = sorted((tmp_path / "run").rglob("*"))
    with pytest.raises(CheckpointError) as raised:
        TwoGroups(toy_cfg(tmp_path, **{**sharded, "trainer.max_epochs": 2})).fit(resume="last")
    message = str(raised.value)
    assert re.search(
        r"sharded checkpoint '.*last' does not fit this run's optimizers: optimizer 'sgd' holds 1 param group of 4 "
        r"parameters in the checkpoint, 2 param groups of 2, 2 parameters in this run: ",
        message,
    ), message
    assert "damaged" not in message and sorted((tmp_path / "run").rglob("*")) == before


def test_a_layer_frozen_then_or_now_names_the_parameters_only_one_side_s_optimizer_holds(tmp_path):
    _trained(tmp_path / "frozen_then", FrozenFirst)
    with pytest.raises(CheckpointError, match=r"1 param group of 2 parameters in the checkpoint, 1 param group of 4 "
                       r"parameters in this run; only this run's holds 0\.weight, 0\.bias: "):  # fmt: skip
        ToyTrainer(toy_cfg(tmp_path / "frozen_then", **{**QUIET, "trainer.max_epochs": 2})).fit(resume="last")
    _trained(tmp_path / "frozen_now")
    with pytest.raises(CheckpointError, match=r"; only the checkpoint's holds 0\.weight, 0\.bias: "):
        FrozenFirst(toy_cfg(tmp_path / "frozen_now", **{**QUIET, "trainer.max_epochs": 2})).fit(resume="last")


def test_another_scheduler_class_is_refused_and_the_same_one_resumes(tmp_path):
    """StepLR's state loaded into CosineAnnealingLR (``__dict__.update``) gave a schedule neither run asked for."""
    _trained(tmp_path, WithStepLR)
    with pytest.raises(CheckpointError, match=r"the lr schedulers \[StepLR\] in the checkpoint, \[CosineAnnealingLR\]"):
        WithCosine(toy_cfg(tmp_path, **{**QUIET, "trainer.max_epochs": 2})).fit(resume="last")
    resumed = WithStepLR(toy_cfg(tmp_path, **{**QUIET, "trainer.max_epochs": 2}))
    resumed.fit(resume="last")
    assert resumed.state.epoch == 2


def test_the_loss_scaler_a_precision_change_drops_is_named_as_the_config_s_not_as_a_callback_to_pass(tmp_path):
    """fp16 resumed as bf16 said to pass LossScaling to Trainer(callbacks=...): it is ampkit's own, which the config
    switches on."""
    fp16 = {**QUIET, "precision.opt_level": "O1", "precision.dtype": "float16"}
    ToyTrainer(toy_cfg(tmp_path, **fp16)).fit()
    bf16 = {**fp16, "precision.dtype": "bfloat16", "trainer.max_epochs": 2}
    with pytest.warns(UserWarning) as warned:
        ToyTrainer(toy_cfg(tmp_path, **bf16)).fit(resume="last")
    said = [str(w.message) for w in warned if "holds the state of" in str(w.message)]
    assert len(said) == 1 and said[0].endswith(
        "holds the state of ['LossScaling'], which its config switched on and this run's config leaves off; it is "
        "not restored (set the config as it was to restore it)"
    ), said


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_kill_between_a_periodic_save_and_last_s_move_resumes_last_and_names_the_newer_file(tmp_path, strategy):
    """A SIGKILL after ModelCheckpoint wrote epoch-0002 but before it moved ``last`` left the resume at epoch 1 without
    a word; it still resumes ``last`` (deterministic), and says which newer file to pass to take that one instead."""
    saved = {**QUIET, "trainer.max_epochs": 2, "checkpoint.every_n_epochs": 1, "distributed.strategy": strategy}
    ToyTrainer(toy_cfg(tmp_path, **saved)).fit()
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    newer = checkpoints / ("epoch-0002" if strategy == "fsdp" else "epoch-0002.pt")
    last = checkpoints / ("last" if strategy == "fsdp" else "last.pt")
    if strategy == "fsdp":  # the link moved back to the epoch before, as the kill left it
        last.unlink()
        last.symlink_to("epoch-0001")
    else:
        last.unlink()
        last.write_bytes((checkpoints / "epoch-0001.pt").read_bytes())
    resumed = ToyTrainer(toy_cfg(tmp_path, **{**saved, "trainer.max_epochs": 3}))
    with pytest.warns(UserWarning) as warned:
        resumed.fit(resume="last")
    said = [str(w.message) for w in warned if "is newer" in str(w.message)]
    assert len(said) == 1 and "\n" not in said[0], said
    assert f"'{newer}' beside '{last.name}' is newer (epoch 2, step " in said[0], said
    assert said[0].endswith(f"Resuming '{last}'; to take the newer one instead, --resume {newer} (a branch)"), said
    assert resumed.fit_start.loop["epoch"] == 1 and resumed.state.epoch == 3


SHARDED_EPOCHS = {**QUIET, "trainer.max_epochs": 3, "checkpoint.every_n_epochs": 1, "checkpoint.keep_last": 3,
                  "distributed.strategy": "fsdp"}  # fmt: skip


def _three_sharded_epochs_the_last_torn(tmp_path) -> Path:
    """The checkpoints folder of a sharded run of three epochs, a shard file of ``epoch-0003`` torn."""
    ToyTrainer(toy_cfg(tmp_path, **SHARDED_EPOCHS)).fit()
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    shard = next((checkpoints / "epoch-0003").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of a tensor, its layout intact
    shard.write_bytes(bytes(data))
    return checkpoints


def test_a_torn_sharded_checkpoint_names_the_newest_whole_one_beside_it_as_a_file_does(tmp_path):
    """A torn shard file, or a damaged trainer.pt, said 'resume from an older checkpoint beside it (--resume
    .../step-NNNNNNNN)' or nothing, where a damaged file names the newest whole checkpoint beside it."""
    checkpoints = _three_sharded_epochs_the_last_torn(tmp_path)
    torn, whole = checkpoints / "epoch-0003", checkpoints / "epoch-0002"
    again = {**SHARDED_EPOCHS, "trainer.max_epochs": 4}
    with pytest.raises(CheckpointError, match=re.escape(f"the newest whole checkpoint beside it is '{whole}'")):
        ToyTrainer(toy_cfg(tmp_path, **again)).fit(resume=str(torn))
    tear(torn / "trainer.pt", torn / "trainer.pt")
    with pytest.raises(CheckpointError, match=re.escape(f"the newest whole checkpoint beside it is '{whole}'")):
        ToyTrainer(toy_cfg(tmp_path, **again)).fit(resume=str(torn))
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["version_0"]  # nothing written
    # the test behind each hint: what a load of each directory would find, its trainer.pt read before its shards
    from ampkit.trainer.sharded_checkpoint import checkpoint_damage

    assert checkpoint_damage(whole) is None
    assert checkpoint_damage(torn).startswith("its trainer.pt: its record ")
    shutil.copytree(whole, tmp_path / "partial")
    (tmp_path / "partial" / ".metadata").unlink()  # a copy cut short
    assert checkpoint_damage(tmp_path / "partial") == "it lacks .metadata"


@pytest.mark.parametrize("sharded", [False, True], ids=["files", "fsdp"])
def test_the_checkpoint_named_beside_a_torn_one_follows_one_rule_for_files_and_shard_directories(tmp_path, sharded):
    """A torn shard directory's hint looked only at step/epoch directories, where a torn file's took any file beside
    it: with the older epochs pruned, its whole best-k copy of the same moment went unnamed ('resume an older
    checkpoint'). One rule now: ampkit's checkpoints beside it, best-k ones and last/best too, newest first, a
    step/epoch one before a best-k one of the same step, then an alias; not a user's file, nor a damaged copy."""
    settings = {**QUIET, "trainer.max_epochs": 3, "checkpoint.every_n_epochs": 1, "checkpoint.keep_last": 1,
                "checkpoint.monitor": "val/mse", "checkpoint.save_top_k": -1,
                **({"distributed.strategy": "fsdp"} if sharded else {})}  # fmt: skip
    ToyTrainer(toy_cfg(tmp_path, **settings)).fit()
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    suffix = "" if sharded else ".pt"
    torn, copy = checkpoints / f"epoch-0003{suffix}", checkpoints / f"best-00000024{suffix}"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith(("epoch", "best-"))) == [
        f"best-000000{step}{suffix}" for step in ("08", "16", "24")
    ] + [torn.name]
    (checkpoints / "mine.pt").write_bytes((copy / "trainer.pt" if sharded else copy).read_bytes())  # a user's
    os.utime(checkpoints / "mine.pt", (2e9, 2e9))
    for damaged in (torn, copy):  # a shard file (or a tensor record) of the newest two torn
        if sharded:
            shard = next(damaged.glob("*.distcp"))
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))
        else:
            tear(damaged, damaged)
        again = ToyTrainer(toy_cfg(tmp_path, **{**settings, "trainer.max_epochs": 4}))
        # then last.pt, a whole copy too (a link to the torn one, for directories), or the best-k one before
        beside = copy if damaged is torn else checkpoints / ("best-00000016" if sharded else "last.pt")
        with pytest.raises(CheckpointError, match=re.escape(f"the newest whole checkpoint beside it is '{beside}'")):
            again.fit(resume=str(torn))
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["version_0"]  # nothing written


def test_a_sharded_checkpoint_lacking_a_section_names_the_newest_complete_one_as_a_file_does(tmp_path):
    """A trainer.pt trimmed of a section a resume reads was refused naming no checkpoint to take, where a file's
    refusal names the newest complete one beside it."""
    ToyTrainer(toy_cfg(tmp_path, **SHARDED_EPOCHS)).fit()
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    trimmed = torch.load(checkpoints / "epoch-0003" / "trainer.pt", weights_only=True)
    del trimmed["schedulers"]
    torch.save(trimmed, checkpoints / "epoch-0003" / "trainer.pt")
    again = ToyTrainer(toy_cfg(tmp_path, **{**SHARDED_EPOCHS, "trainer.max_epochs": 4}))
    complete = f"; the newest complete checkpoint beside it is '{checkpoints / 'epoch-0002'}'"
    with pytest.raises(
        CheckpointError, match=r"' \(format 1\) lacks schedulers: it cannot be resumed .*" + re.escape(complete)
    ):
        again.fit(resume="last")


def test_a_newer_sharded_checkpoint_torn_in_a_shard_is_not_the_one_named_to_take_instead(tmp_path):
    """Only a newer directory's .metadata was checked: one whose shard file was torn (its CRC-32 not the one recorded
    at its save) was named as the checkpoint to take, which its load then refused. The newest whole one is named."""
    saved = SHARDED_EPOCHS
    checkpoints = _three_sharded_epochs_the_last_torn(tmp_path)
    last = checkpoints / "last"
    last.unlink()
    last.symlink_to("epoch-0001")  # killed after the saves of epochs 2 and 3, before last moved
    cut_short = shutil.copytree(checkpoints / "epoch-0002", checkpoints / "step-00000099")
    (cut_short / ".metadata").unlink()  # a save cut short, resumed by its path: the whole one beside it is named
    with pytest.raises(
        CheckpointError, match=f"the newest whole checkpoint beside it is '{checkpoints / 'epoch-0002'}'"
    ):
        resolve_checkpoint(tmp_path / "run", cut_short)
    shutil.rmtree(cut_short)
    resumed = ToyTrainer(toy_cfg(tmp_path, **{**saved, "trainer.max_epochs": 4}))
    with pytest.warns(UserWarning) as warned:
        resumed.fit(resume="last")
    said = [str(w.message) for w in warned if "is newer" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(f"'{checkpoints / 'epoch-0002'}' beside 'last' is newer"), said
    assert resumed.fit_start.loop["epoch"] == 1


@pytest.mark.parametrize("listed", ["sorted", "reversed"])
def test_the_newer_sharded_checkpoint_named_among_several_of_one_step_does_not_depend_on_the_listing_order(
    tmp_path, monkeypatch, listed
):
    """Killed after step 16's saves (step-00000016 at the batch's end; epoch-0002 and its best-k copy at the epoch's
    end) before last moved: the notice named whichever of them the directory listed first, where the one rule of
    checkpoints beside another names the latest moment first (epoch 2's end, after the batch's), a step/epoch one
    before a best-k one of the same moment."""
    saved = {**QUIET, "trainer.max_epochs": 2, "checkpoint.every_n_epochs": 1, "checkpoint.every_n_steps": 8,
             "checkpoint.keep_last": 5, "checkpoint.monitor": "val/mse", "checkpoint.save_top_k": -1,
             "distributed.strategy": "fsdp"}  # fmt: skip
    ToyTrainer(toy_cfg(tmp_path, **saved)).fit()
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    (checkpoints / "last").unlink()
    (checkpoints / "last").symlink_to("epoch-0001")
    real_iterdir = Path.iterdir

    def iterdir(path):
        found = sorted(real_iterdir(path))
        return iter(found if listed == "sorted" or path != checkpoints else found[::-1])

    monkeypatch.setattr(Path, "iterdir", iterdir)
    resumed = ToyTrainer(toy_cfg(tmp_path, **{**saved, "trainer.max_epochs": 3}))
    with pytest.warns(UserWarning) as warned:
        resumed.fit(resume="last")
    said = [str(w.message) for w in warned if "is newer" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(f"'{checkpoints / 'epoch-0002'}' beside 'last' is newer"), said


def test_a_resume_whose_last_is_the_newest_checkpoint_says_nothing_of_newer_files(tmp_path):
    saved = {**QUIET, "trainer.max_epochs": 2, "checkpoint.every_n_epochs": 1}
    ToyTrainer(toy_cfg(tmp_path, **saved)).fit()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        ToyTrainer(toy_cfg(tmp_path, **{**saved, "trainer.max_epochs": 3})).fit(resume="last")
    assert not [w for w in warned if "is newer" in str(w.message)]


def test_the_checkpoint_named_beside_one_is_never_itself_nor_a_link_to_it(tmp_path):
    """The hint names another checkpoint to take in a refused one's place: never the refused one itself, nor its
    ``last.pt``/``best.pt`` alias where that is a link to it (a hint naming the same file again); a newer one first."""
    from ampkit.trainer.sharded_checkpoint import newest_whole_beside

    older, newer = tmp_path / "step-00000002.pt", tmp_path / "step-00000004.pt"
    for step, path in ((2, older), (4, newer)):
        torch.save({FORMAT_KEY: FORMAT_VERSION, "loop": {"epoch": 0, "global_step": step}}, path)
    os.link(newer, tmp_path / "last.pt")
    (tmp_path / "best.pt").symlink_to(newer.name)
    assert newest_whole_beside(newer) == older
    assert newest_whole_beside(older) == newer  # the step file before its aliases of the same moment
    torch.save({FORMAT_KEY: FORMAT_VERSION, "model": {}}, tmp_path / "step-00000008.pt")  # no loop position
    assert newest_whole_beside(older) == newer
    older.unlink()
    assert newest_whole_beside(newer) is None


def test_the_checkpoint_named_beside_one_is_of_a_format_this_ampkit_reads(tmp_path):
    """A step file refused for its newer format (written by a newer ampkit) has ``last.pt`` beside it as a copy
    (ModelCheckpoint copies, it does not link): the hint named that copy, which is refused for the same reason, as
    the checkpoint to take instead; it names an older file this ampkit reads, or nothing. A file that is no ampkit
    checkpoint at all is never named either."""
    from ampkit.trainer.run_life import load_with_fallback_hint
    from ampkit.trainer.sharded_checkpoint import newest_whole_beside

    older, newer = tmp_path / "step-00000002.pt", tmp_path / "step-00000004.pt"
    torch.save({FORMAT_KEY: FORMAT_VERSION, "loop": {"epoch": 0, "global_step": 2}}, older)
    torch.save({FORMAT_KEY: FORMAT_VERSION + 1, "loop": {"epoch": 0, "global_step": 4}}, newer)
    shutil.copyfile(newer, tmp_path / "last.pt")
    torch.save({"loop": {"epoch": 0, "global_step": 6}}, tmp_path / "step-00000006.pt")  # no format entry
    with pytest.raises(CheckpointError, match=f"this ampkit reads up to {FORMAT_VERSION}") as refused:
        load_with_fallback_hint(newer)
    assert str(refused.value).endswith(f"the newest whole checkpoint beside it is '{older}'")
    older.unlink()
    assert newest_whole_beside(newer) is None


def test_the_newer_checkpoint_named_beside_last_is_the_newest_whole_one(tmp_path):
    """Of the checkpoints past ``last.pt``'s step (a kill between their saves and its move), the newest is named, its
    step/epoch file before a best-k copy of the same step; a damaged newest gives way to the next."""
    from ampkit.trainer.run_life import _newer_than_last

    for name, step in [("last.pt", 2), ("step-00000004.pt", 4), ("best-00000006.pt", 6), ("step-00000006.pt", 6)]:
        torch.save({"loop": {"epoch": 0, "global_step": step}, "model": {"w": torch.ones(64)}}, tmp_path / name)
    assert _newer_than_last(tmp_path / "last.pt") == tmp_path / "step-00000006.pt"
    tear(tmp_path / "step-00000006.pt", tmp_path / "step-00000006.pt")  # its tensor zeroed: its loop still reads
    assert _newer_than_last(tmp_path / "last.pt") == tmp_path / "best-00000006.pt"
