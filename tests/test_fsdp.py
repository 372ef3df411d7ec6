"""FSDP2 sharding (``distributed.strategy: fsdp``): config errors, parity with one process, per-loss scalers on
sharded gradients, DCP checkpoints that resume on another world size, consolidation."""

from __future__ import annotations

import errno
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from child_env import child_env
from dist_worker import Plain, Shuffled, TwoLosses
from fsdp_worker import FSDP, FusedAdamShuffled, KeepFinalState, run
from full_disk import FullDisk
from omegaconf import OmegaConf
from rank_forkserver import ForkedPython
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_distributed import _free_port
from toy_trainers import ToyTrainer, toy_cfg

import ampkit
from ampkit import consolidate_checkpoint
from ampkit.callbacks import ModelCheckpoint
from ampkit.trainer import checkpoint_io, sharded_checkpoint
from ampkit.trainer.checkpoint_io import CheckpointError, load_checkpoint
from ampkit.trainer.fsdp import fsdp_param_dtype
from ampkit.trainer.run_life import resolve_checkpoint
from ampkit.trainer.sharded_checkpoint import checkpoint_damage, is_sharded_checkpoint

TESTS = Path(__file__).resolve().parent
WORKER = TESTS / "fsdp_worker.py"


def start(scenario: str, out: Path, *, batch_size: int = 4, resume: Path | str | None = None, **extra: str) -> list:
    """Two gloo ranks of ``fsdp_worker.py`` started (``extra`` variables set in both); returns their processes."""
    port = _free_port()
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(2):
        env = child_env(TESTS, TESTS.parent, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", BATCH=str(batch_size),
                        **({"RESUME_FROM": str(resume)} if resume else {}), **extra)  # fmt: skip
        procs.append(ForkedPython([sys.executable, str(WORKER), scenario, str(out)], env=env))  # no import to pay
    return procs


def launch(scenario: str, out: Path, *, batch_size: int = 4, resume: Path | str | None = None) -> list[dict]:
    """Two gloo ranks of ``fsdp_worker.py``; returns each rank's result."""
    procs = start(scenario, out, batch_size=batch_size, resume=resume)
    for proc in procs:
        _, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, stderr[-3000:]
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(2)]


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


def _cfg(tmp_path, **sections) -> dict:
    trainer = {"progress_bar": False, "device": "cpu", **sections.pop("trainer", {})}
    return {"trainer_class": "x:y", "run_dir": str(tmp_path / "run"), "logging": {"tensorboard": False},
            "trainer": trainer, **sections}  # fmt: skip


# ------------------------------------------------------------------ bad input, before training
@pytest.mark.parametrize(
    ("distributed", "extra", "key"),
    [
        ({"strategy": "zero3"}, {}, "distributed.strategy"),
        ({"fsdp": {"shard_modules": ["Linear"]}}, {}, "distributed.fsdp.shard_modules"),
        ({"fsdp": {"cpu_offload": True}}, {}, "distributed.fsdp.cpu_offload"),
        ({"strategy": "fsdp"}, {"trainer": {"compile": True}}, "trainer.compile"),
        ({"strategy": "fsdp"}, {"precision": {"opt_level": "O1", "combine_grad": True}}, "precision.combine_grad"),
        ({"strategy": "fsdp"}, {"precision": {"opt_level": "O3"}}, "precision.opt_level"),
        ({"strategy": "fsdp", "grad_sync": "step"}, {}, "distributed.grad_sync"),
        ({"strategy": "fsdp", "fsdp": {"cpu_offload": True}}, {}, "distributed.fsdp.cpu_offload"),
    ],
)
def test_bad_strategy_settings_fail_at_construction_naming_the_key(tmp_path, distributed, extra, key):
    cfg = _cfg(tmp_path, distributed=distributed)
    for section, values in extra.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    with pytest.raises(ampkit.ConfigError, match=f"'{key}'"):
        ToyTrainer(cfg)


@pytest.mark.parametrize(
    ("precision", "param_dtype"),
    [
        ({"opt_level": "O0"}, None),
        ({"opt_level": "O1"}, None),  # autocast over fp32 parameters, as without FSDP
        ({"opt_level": "O2"}, torch.float16),
        ({"opt_level": "O2", "dtype": "bfloat16"}, torch.bfloat16),
        ({"opt_level": "O5", "dtype": "bfloat16"}, torch.bfloat16),
        ({"opt_level": "O5", "loss_scale": "none"}, torch.bfloat16),  # bf16 without a scaler, spelled out
    ],
)
def test_fsdp_computes_in_the_model_cast_dtype_of_levels_with_fp32_masters(precision, param_dtype):
    cfg = OmegaConf.merge(OmegaConf.structured(ampkit.PrecisionConfig), precision)
    assert fsdp_param_dtype(cfg) == param_dtype


def test_a_shard_class_the_model_lacks_fails_before_training_listing_its_classes(tmp_path):
    cfg = _cfg(tmp_path, distributed={"strategy": "fsdp", "fsdp": {"shard_modules": ["Block"]}})
    trainer = ToyTrainer(cfg)
    with pytest.raises(ampkit.ConfigError, match=r"distributed.fsdp.shard_modules.*\['Block'\].*Dropout, Linear"):
        trainer.fit()
    assert trainer.state.global_step == 0


# ------------------------------------------------------------------ training on sharded parameters
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """One two-rank FSDP run (clipping, a checkpoint every 3 steps), shared by the tests that read it."""
    return launch("resume", tmp_path_factory.mktemp("two"))


def test_two_sharded_ranks_with_clipping_equal_one_plain_process(two_ranks, tmp_path):
    """Clipping to the global norm over shards: a per-shard norm would clip differently on each rank."""
    rank0, rank1 = two_ranks
    _close(rank0["model"], rank1["model"])
    settings = {"data": {"batch_size": 8}, "checkpoint": {"enabled": False}}
    single = Shuffled(_cfg(tmp_path / "single", trainer={"max_epochs": 2, "clip_grad_norm": 0.5}, **settings))
    single.fit()
    _close(rank0["model"], single.module.state_dict())
    assert rank0["val"]["mse"] == pytest.approx(single.val_metrics["mse"], rel=1e-5)
    unclipped = Shuffled(_cfg(tmp_path / "unclipped", trainer={"max_epochs": 2}, **settings))
    unclipped.fit()
    assert not torch.allclose(unclipped.module.state_dict()["0.weight"], single.module.state_dict()["0.weight"])


def test_fp16_o2_per_loss_scalers_on_sharded_grads_agree_when_only_rank_1_overflows(tmp_path):
    rank0, rank1 = launch("overflow_o2", tmp_path)
    assert rank0["skips"] == rank1["skips"] == [(3, "G")]
    assert rank0["scales"] == rank1["scales"] == {"0": 1024.0, "1": 512.0}
    assert rank0["param_dtypes"] == ["torch.float32"]  # the sharded fp32 parameters are the masters
    _close(rank0["model"], rank1["model"])


@pytest.mark.parametrize("fsdp", [{}, {"reshard_after_forward": False}])
def test_one_sharded_process_trains_as_an_unsharded_one_whatever_the_knobs(tmp_path, fsdp):
    settings = {"data": {"batch_size": 8}, "checkpoint": {"enabled": False}, "trainer": {"max_steps": 6}}
    keep = KeepFinalState()
    Plain(_cfg(tmp_path / "fsdp", distributed={"strategy": "fsdp", "fsdp": fsdp}, **settings), callbacks=[keep]).fit()
    plain = Plain(_cfg(tmp_path / "plain", **settings))
    plain.fit()
    _close(keep.state, plain.module.state_dict())


def test_the_start_banner_names_the_fsdp_units(tmp_path, capsys):
    """The banner named the device and ranks but not the sharding: a user could not see FSDP, nor its units."""
    fsdp = {"strategy": "fsdp", "fsdp": {"shard_modules": ["Linear"]}}
    cfg = _cfg(
        tmp_path, distributed=fsdp, trainer={"max_steps": 1, "progress_bar": True}, checkpoint={"enabled": False}
    )
    Plain(cfg).fit()
    assert "  sharding    FSDP2 over 1 rank, one unit each: Linear x2, then the root\n" in capsys.readouterr().out


def test_ampkits_fused_adam_steps_each_ranks_shards_as_one_process_steps_the_whole_model(tmp_path):
    """FusedAdam's kernel took FSDP2's DTensors and failed at the first step ('params[0] is on meta'); it now steps
    each rank's local shards, which for an element-wise update is the whole model's step."""
    rank0, rank1 = launch("fused_adam", tmp_path / "two")
    _close(rank0["model"], rank1["model"])
    settings = {"data": {"batch_size": 8}, "checkpoint": {"enabled": False}, "trainer": {"max_epochs": 1}}
    single = FusedAdamShuffled(_cfg(tmp_path / "single", **settings))
    single.fit()
    _close(rank0["model"], single.module.state_dict())


def test_fused_sgds_momentum_made_at_the_first_step_is_sharded_and_resumes_on_one_rank(tmp_path):
    """FusedSGD made its momentum buffers from the local shards: plain tensors, which the sharded checkpoint saved as
    rank-local pieces that no resume could load ('Size mismatch'). They are DTensors like their parameters now."""
    two = launch("fused_sgd", tmp_path / "two")
    _close(two[0]["model"], two[1]["model"])
    resumed = run(
        "fused_sgd", tmp_path / "2to1", batch_size=8, resume=_copied(two[0]["version_dir"], "step-00000008", tmp_path)
    )
    assert sorted(resumed["losses"]) == list(range(9, 17))
    for iteration, loss in resumed["losses"].items():
        assert loss == pytest.approx(two[0]["losses"][iteration], rel=1e-5)
    _close(resumed["model"], two[0]["model"])


@pytest.mark.parametrize("optimizer", ["FusedLAMB", "FusedNovoGrad", "FusedAdamP"])
def test_a_fused_optimizer_whose_step_takes_whole_tensor_norms_refuses_shards_by_name(tmp_path, optimizer):
    class NormOptimizer(Plain):
        def configure_optimizers(self):
            return getattr(ampkit.ops, optimizer)(self.module.parameters(), lr=1e-3)

    settings = {"checkpoint": {"enabled": False}, "trainer": {"max_steps": 2}}
    trainer = NormOptimizer(_cfg(tmp_path, distributed={"strategy": "fsdp"}, **settings))
    with pytest.raises(RuntimeError, match=f"{optimizer} cannot step sharded .*norms over whole tensors"):
        trainer.fit()


def test_manual_optimization_keeps_each_optimizers_grads_to_its_own_loss_under_fsdp(tmp_path):
    """backward(loss, optimizer=D) cannot name FSDP's sharded parameters to autograd; G's grads must not leak."""
    settings = {"checkpoint": {"enabled": False}, "trainer": {"max_steps": 4, "accumulate_grad_batches": 2}}
    keep = KeepFinalState()
    TwoLosses(_cfg(tmp_path / "fsdp", distributed={"strategy": "fsdp", "fsdp": {"shard_modules": ["Linear"]}},
                   **settings), callbacks=[keep]).fit()  # fmt: skip
    plain = TwoLosses(_cfg(tmp_path / "plain", **settings))
    plain.fit()
    _close(keep.state, plain.module.state_dict())


# ------------------------------------------------------------------ sharded checkpoints across world sizes
def _copied(version_dir: str, name: str, to: Path) -> Path:
    """A checkpoint copied out of its run, so resuming it starts a new run directory."""
    source = Path(version_dir) / "checkpoints" / name
    assert (source / ".metadata").is_file() and (source / "trainer.pt").is_file()
    return Path(shutil.copytree(source, to / name))


def test_sharded_checkpoints_resume_from_two_ranks_on_one_and_from_one_on_two(two_ranks, tmp_path):
    two = two_ranks[0]
    last = Path(two["version_dir"]) / "checkpoints" / "last"
    assert last.is_symlink() and last.resolve().name == "epoch-0002"
    assert not list(last.parent.glob(".*"))  # no temp directories left behind

    two_then_one = run(
        "resume", tmp_path / "2to1", batch_size=8, resume=_copied(two["version_dir"], "step-00000009", tmp_path)
    )
    written_by_one = _copied(two_then_one["version_dir"], "step-00000012", tmp_path)
    one_then_two = launch("resume", tmp_path / "1to2", resume=written_by_one)[0]
    for resumed, first in ((two_then_one, 10), (one_then_two, 13)):
        assert sorted(resumed["losses"]) == list(range(first, 17))
        for iteration, loss in resumed["losses"].items():
            assert loss == pytest.approx(two["losses"][iteration], rel=1e-5)
        _close(resumed["model"], two["model"])


@pytest.mark.parametrize("links", ["followed", "dropped"])
def test_a_sharded_run_copied_by_a_tool_that_follows_or_drops_links_resumes_last_in_place(tmp_path, links):
    """zip, shutil.copytree and object stores copy the ``last`` link as a whole directory, which the next save
    could not rename its link over; rsync without -l drops it. Either copy continues in its version_0."""

    def fit(run_dir: Path, max_steps: int, resume: str | None = None) -> ampkit.Trainer:
        cfg = _cfg(tmp_path, trainer={"max_steps": max_steps, "max_epochs": 2}, distributed=FSDP,
                   checkpoint={"every_n_steps": 3})  # fmt: skip
        trainer = Shuffled({**cfg, "run_dir": str(run_dir)})
        trainer.fit(resume=resume)
        return trainer

    fit(tmp_path / "run", max_steps=6)
    copy = Path(shutil.copytree(tmp_path / "run", tmp_path / "copy", symlinks=links == "dropped"))
    checkpoints = copy / "version_0" / "checkpoints"
    if links == "dropped":
        (checkpoints / "last").unlink()
    else:
        assert (checkpoints / "last").is_dir() and not (checkpoints / "last").is_symlink()
    resumed = fit(copy, max_steps=9, resume="last")
    assert resumed.version_dir == copy / "version_0" and resumed.fit_start.loop["global_step"] == 6
    assert (checkpoints / "last").is_symlink()
    assert load_checkpoint(checkpoints / "last" / "trainer.pt")["loop"]["global_step"] == 9
    assert not list(checkpoints.glob(".*"))


class ScriptedValidation(Shuffled):
    """Validation metrics set per epoch: the best of the two kept is the older one."""

    def validation_step(self, batch):
        return {"mse": torch.tensor({0: 1.0, 1: 0.5, 2: 0.7}[self.state.epoch])}


def test_a_sharded_run_whose_best_link_a_copy_dropped_resumes_best_from_the_directory_it_named(tmp_path):
    """rsync without -l drops the ``best`` link too: --resume best then took an older version's best, or found
    none. The newest checkpoint's ranking names the directory the link named."""
    cfg = _cfg(tmp_path, trainer={"max_epochs": 3}, distributed=FSDP,
               checkpoint={"monitor": "val/mse", "save_top_k": 2})  # fmt: skip
    ScriptedValidation(cfg).fit()
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    named = (checkpoints / "best").resolve().name
    kept = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("best-"))
    assert len(kept) == 2 and named == kept[0]
    copy = Path(shutil.copytree(tmp_path / "run", tmp_path / "copy", symlinks=True))
    for link in ("best", "last"):
        (copy / "version_0" / "checkpoints" / link).unlink()
    assert resolve_checkpoint(copy, "best") == copy / "version_0" / "checkpoints" / named
    (copy / "version_0" / "checkpoints" / "best").symlink_to("best-00000099")  # dangling: named, never guessed past
    assert resolve_checkpoint(copy, "best") is None


def test_fit_on_a_finished_sharded_run_reads_its_best_k_ranking_back(tmp_path):
    """fit() again on a finished run restores the callbacks' states (Lightning's idiom to read best_model_path); a
    sharded run's come from the trainer.pt its resume plan read (its checkpoint is not loaded whole), which only
    reading had checked: best_model_path names the best directory, and nothing trains or is written."""
    cfg = _cfg(tmp_path, trainer={"max_epochs": 3}, distributed=FSDP,
               checkpoint={"monitor": "val/mse", "save_top_k": 2})  # fmt: skip
    ScriptedValidation(cfg).fit()
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    before = sorted((p.name, p.stat().st_mtime_ns) for p in checkpoints.rglob("*"))
    again = ScriptedValidation(cfg)
    again.fit(resume="last")
    ranker = next(cb for cb in again.callbacks if isinstance(cb, ModelCheckpoint))
    assert again.fit_start.finished and again.state.global_step == 24
    assert ranker.best_model_path == str(checkpoints / "best-00000016") and ranker.best_model_score == 0.5
    assert list(ranker.best_k_models) == [str(checkpoints / "best-00000016"), str(checkpoints / "best-00000024")]
    assert sorted((p.name, p.stat().st_mtime_ns) for p in checkpoints.rglob("*")) == before


def test_a_moment_saved_as_a_periodic_and_a_best_k_checkpoint_writes_its_shards_once(tmp_path, monkeypatch):
    """An epoch's end that was also among the best wrote the whole sharded state twice (a second DCP save, every
    rank gathering and writing its shards again). Written once now and copied, so each name stays whole alone."""
    saves = []
    real_save = dcp.save
    monkeypatch.setattr(
        dcp, "save", lambda *args, **kwargs: saves.append(kwargs["checkpoint_id"]) or real_save(*args, **kwargs)
    )
    cfg = _cfg(tmp_path, trainer={"max_epochs": 3}, distributed=FSDP,
               checkpoint={"monitor": "val/mse", "save_top_k": 2, "keep_last": 1})  # fmt: skip
    ScriptedValidation(cfg).fit()
    assert [Path(s).name for s in saves] == [".epoch-0001.tmp", ".epoch-0002.tmp", ".epoch-0003.tmp"]
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["best", "best-00000016", "best-00000024", "epoch-0003",
                                                              "last"]  # fmt: skip
    for best in ("best-00000016", "best-00000024"):  # its epoch file pruned by keep_last: the copy is whole alone
        assert not (checkpoints / best).is_symlink() and checkpoint_damage(checkpoints / best) is None
        assert load_checkpoint(checkpoints / best / "trainer.pt")["loop"]["global_step"] == int(best[5:])
    assert not list(checkpoints.glob(".*"))


def test_a_full_disk_while_a_moment_is_copied_to_its_best_k_name_stops_the_run_and_a_resume_takes_last(
    tmp_path, monkeypatch
):
    """The copy of a sharded moment to its best-k name (epoch-0002 to best-00000016) had no test of a disk that fills
    midway: the run stops with one line, as a file's failed best-k copy stops it; the half-copied directory goes (never
    under a checkpoint's name), the periodic one stays whole, last and best keep naming the previous ones, and a resume
    of last takes epoch 1 and trains the rest as a run never stopped."""
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    copying, real_copy = checkpoints / ".best-00000016.tmp", sharded_checkpoint.copy_atomic

    def copy(source, alias):
        if alias.parent == copying and any(copying.iterdir()):  # the second file: the first is copied whole
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_copy(source, alias)

    monkeypatch.setattr(sharded_checkpoint, "copy_atomic", copy)
    settings = {"distributed": FSDP, "checkpoint": {"monitor": "val/mse", "save_top_k": 2, "keep_last": 3}}
    message = (
        f"could not write checkpoint '{checkpoints / 'best-00000016'}' (No space left on device); "
        "last still holds the previous checkpoint, and --resume last continues from it"
    )
    with pytest.raises(CheckpointError, match=re.escape(message)):
        ScriptedValidation(_cfg(tmp_path, trainer={"max_epochs": 3}, **settings)).fit()
    monkeypatch.undo()
    assert sorted(p.name for p in checkpoints.iterdir()) == ["best", "best-00000008", "epoch-0001", "epoch-0002",
                                                              "last"]  # fmt: skip
    assert (checkpoints / "last").resolve().name == "epoch-0001" and (checkpoints / "best").resolve().name == (
        "best-00000008"
    )
    assert checkpoint_damage(checkpoints / "epoch-0002") is None
    assert resolve_checkpoint(tmp_path / "run", "last") == checkpoints / "last"
    resumed = ScriptedValidation(_cfg(tmp_path, trainer={"max_epochs": 3}, **settings))
    with pytest.warns(UserWarning, match=re.escape(f"'{checkpoints / 'epoch-0002'}' beside 'last' is newer")):
        resumed.fit(resume="last")
    assert resumed.fit_start.loop["global_step"] == 8 and resumed.state.global_step == 24
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("best-")) == ["best-00000016",
                                                                                           "best-00000024"]  # fmt: skip
    assert (checkpoints / "best").resolve().name == "best-00000016"
    assert checkpoint_damage(checkpoints / "best-00000016") is None and not list(checkpoints.glob(".*"))


def test_a_first_save_whose_best_k_copy_failed_is_copied_again_by_the_resume_that_takes_its_moment(
    tmp_path, monkeypatch
):
    """The run's first save (epoch 1, the best by mode max) failed copying to best-00000008 on a full disk, before any
    last was made: --resume last takes epoch-0001, whose ranking names best-00000008. Nothing made that copy, so
    best_model_path named no directory, best was never made, and keep_last later pruned epoch-0001, the only copy of
    the run's best state. The resume makes the copy, and best names it, as the save would have."""
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    copying, real_copy = checkpoints / ".best-00000008.tmp", sharded_checkpoint.copy_atomic

    def copy(source, alias):
        if alias.parent == copying:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_copy(source, alias)

    monkeypatch.setattr(sharded_checkpoint, "copy_atomic", copy)
    settings = {"distributed": FSDP, "checkpoint": {"monitor": "val/mse", "mode": "max", "save_top_k": 2,
                                                    "keep_last": 1}}  # fmt: skip
    with pytest.raises(CheckpointError, match=re.escape(f"'{checkpoints / 'epoch-0001'}' was written whole")):
        ScriptedValidation(_cfg(tmp_path, trainer={"max_epochs": 3}, **settings)).fit()
    monkeypatch.undo()
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch-0001"]
    resumed = ScriptedValidation(_cfg(tmp_path, trainer={"max_epochs": 3}, **settings))
    resumed.fit(resume="last")
    assert resumed.fit_start.loop["global_step"] == 8 and resumed.state.global_step == 24
    ranker = next(cb for cb in resumed.callbacks if isinstance(cb, ModelCheckpoint))
    best = checkpoints / "best-00000008"
    assert ranker.best_model_path == str(best) and checkpoint_damage(best) is None
    assert load_checkpoint(best / "trainer.pt")["loop"]["global_step"] == 8
    assert sorted(p.name for p in checkpoints.iterdir()) == ["best", "best-00000008", "best-00000024", "epoch-0003",
                                                              "last"]  # fmt: skip
    assert (checkpoints / "best").resolve().name == "best-00000008"


class PutsThingsAtTempNames(ampkit.Callback):
    """Once training starts (after the fit's tidy), puts the user's things at the temp names the saves and removals of
    the run below go through: folders, a file and links (one to a folder of theirs, whose file must stay)."""

    def on_train_start(self, trainer) -> None:
        checkpoints = trainer.version_dir / "checkpoints"
        checkpoints.mkdir(parents=True, exist_ok=True)
        (checkpoints / ".epoch-0001.tmp").mkdir()  # the first save's folder, and keep_last's removal of it later
        (checkpoints / ".epoch-0001.tmp" / "notes.txt").write_text("mine")
        (checkpoints / ".best-00000008.tmp").write_text("my file")  # the best-k copy's, and its drop's
        (checkpoints / ".last.tmp").mkdir()  # the last link's
        exports = trainer.version_dir.parent / "exports"
        exports.mkdir()
        (exports / "trainer.pt").write_text("my own trainer.pt")
        (checkpoints / ".epoch-0002.tmp").symlink_to(exports)  # a link to a folder of the user's
        (checkpoints / ".best.tmp").symlink_to("my-exports")  # a link to no checkpoint's name


def test_a_sharded_run_saves_and_prunes_past_the_users_things_at_its_temp_names(tmp_path, monkeypatch):
    """A folder, file or link of the user's at a temp name a sharded save, copy, link move or removal goes through
    (``.epoch-0001.tmp``, ``.best-00000008.tmp``, ``.last.tmp``) stopped the run with a FileExistsError, or left a
    checkpoint unpruned: the run trains on, each save through a free temp name, and every one of the user's things
    stays as it was (a linked folder's files too), named once."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    from ampkit.trainer import temp_names

    monkeypatch.setattr(temp_names, "_named", set())
    monkeypatch.setattr(rank_zero_only, "rank", 0, raising=False)
    cfg = _cfg(tmp_path, trainer={"max_epochs": 3}, distributed=FSDP,
               checkpoint={"monitor": "val/mse", "save_top_k": 1, "keep_last": 1})  # fmt: skip
    with pytest.warns(UserWarning) as said:
        ScriptedValidation(cfg, callbacks=[PutsThingsAtTempNames()]).fit()
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    theirs = [".best-00000008.tmp", ".best.tmp", ".epoch-0001.tmp", ".epoch-0002.tmp", ".last.tmp"]
    assert sorted(p.name for p in checkpoints.iterdir()) == [*theirs, "best", "best-00000016", "epoch-0003", "last"]
    assert (checkpoints / ".epoch-0001.tmp" / "notes.txt").read_text() == "mine"
    assert [p.name for p in (checkpoints / ".epoch-0001.tmp").iterdir()] == ["notes.txt"]
    assert (checkpoints / ".best-00000008.tmp").read_text() == "my file"
    assert (checkpoints / ".last.tmp").is_dir() and not any((checkpoints / ".last.tmp").iterdir())
    assert (tmp_path / "run" / "exports" / "trainer.pt").read_text() == "my own trainer.pt"
    assert os.readlink(checkpoints / ".best.tmp") == "my-exports"
    assert os.readlink(checkpoints / "last") == "epoch-0003" and os.readlink(checkpoints / "best") == "best-00000016"
    for name, step in (("epoch-0003", 24), ("best-00000016", 16)):
        assert checkpoint_damage(checkpoints / name) is None
        assert load_checkpoint(checkpoints / name / "trainer.pt")["loop"]["global_step"] == step
    named = [str(w.message) for w in said if "writes through a free temp name" in str(w.message)]
    assert sorted(m.split("'")[1].rpartition("/")[2] for m in named) == theirs, named  # each once


@pytest.mark.parametrize("failing", ["shards", "trainer.pt", "shard file at 0.5", "shard file at 0.95"])
def test_a_full_disk_midway_through_a_sharded_save_is_one_line_and_leaves_last_to_resume(
    tmp_path, monkeypatch, failing
):
    """DCP gathers a rank's write failure into a CheckpointException (a BaseException, no path in it): the error
    names the checkpoint, says what is left, and the partial directory goes at once (a full disk gets space back).
    ``shard file at F``: the disk fills at fraction F of a rank's shard file. DCP writes each tensor with torch.save,
    which turns its file's OSError into 'unexpected pos' where the failing write is one of a tensor's records (at
    0.95 here): DCP's error then named no reason, and the partial directory stayed until the next run."""
    real_write, real_save, real_open = dcp.FileSystemWriter.write_data, torch.save, Path.open
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    temp = checkpoints / ".step-00000006.tmp"

    def full_disk():
        (temp / "__0_9.distcp").write_bytes(b"x")  # what the failed write began: the partial directory is ampkit's
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def write_shards(writer, *args, **kwargs):
        return full_disk() if writer.path == temp else real_write(writer, *args, **kwargs)

    def save(obj, *args, **kwargs):
        at_step_6 = isinstance(obj, dict) and obj.get("loop", {}).get("global_step") == 6
        return full_disk() if at_step_6 else real_save(obj, *args, **kwargs)

    def open_(path, mode="r", *args, **kwargs):  # DCP opens each rank's shard file with Path.open(mode="wb")
        if path.parent != temp or path.suffix != ".distcp" or mode != "wb":
            return real_open(path, mode, *args, **kwargs)
        filled_at = float(failing.rpartition(" ")[2])
        return FullDisk(path, room=int((checkpoints / "step-00000003" / path.name).stat().st_size * filled_at))

    if failing == "shards":
        monkeypatch.setattr(dcp.FileSystemWriter, "write_data", write_shards)
    elif failing == "trainer.pt":
        monkeypatch.setattr(torch, "save", save)
    else:
        monkeypatch.setattr(Path, "open", open_)
    where = "" if failing == "trainer.pt" else " on rank 0"
    message = (
        f"could not write checkpoint '{checkpoints / 'step-00000006'}' (No space left on device{where}); "
        "last still holds the previous checkpoint, and --resume last continues from it"
    )
    with pytest.raises(CheckpointError, match=re.escape(message)):
        run("resume", tmp_path, batch_size=8)
    monkeypatch.undo()
    assert (checkpoints / "last").resolve().name == "step-00000003"
    assert not list(checkpoints.glob(".*"))  # the half-written temp directory went with the failure
    resumed = run("resume", tmp_path, batch_size=8, resume="last")
    assert sorted(resumed["losses"]) == list(range(4, 17))
    assert (checkpoints / "step-00000006" / ".metadata").is_file()


@pytest.mark.parametrize("moment", ["shards", "after_dcp"])
def test_a_rank_killed_during_a_sharded_save_leaves_last_whole_and_the_run_resumes_on_two_and_on_one(
    two_ranks, tmp_path, moment
):
    """Rank 1 is SIGKILLed in the save of step 6: as it opens its shard file, or once DCP has written every shard
    and the metadata. ``last`` moves only after every rank has written, so it still names step 3; a partial directory
    is never taken for a checkpoint, and the run resumes from step 3 on two ranks and on one as if never killed."""
    killed = start("resume", tmp_path, DIE_IN_SAVE=moment)
    for proc in killed:
        proc.communicate(timeout=240)
    assert killed[1].returncode == -9 and killed[0].returncode != 0
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "version_0" / "checkpoints"
    assert resolve_checkpoint(run_dir, "last") == checkpoints / "last"
    assert (checkpoints / "last").resolve().name == "step-00000003"
    saved = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith(("step-", ".step-")))
    # Killed in the writes: the partial directory keeps its temp name (the next fit removes it). Killed after them:
    # rank zero may have renamed the whole directory in before its last barrier failed.
    assert saved in (["step-00000003"], [".step-00000006.tmp", "step-00000003"], ["step-00000003", "step-00000006"])
    if "step-00000006" in saved:
        assert moment == "after_dcp" and is_sharded_checkpoint(checkpoints / "step-00000006")
    one = shutil.copytree(run_dir, tmp_path / "one" / "run", symlinks=True).parent
    uninterrupted = two_ranks[0]
    for resumed in (launch("resume", tmp_path, resume="last")[0], run("resume", one, batch_size=8, resume="last")):
        assert sorted(resumed["losses"]) == list(range(4, 17))
        for iteration, loss in resumed["losses"].items():
            assert loss == pytest.approx(uninterrupted["losses"][iteration], rel=1e-5)
        _close(resumed["model"], uninterrupted["model"])
    assert not list(checkpoints.glob(".*"))


def test_a_sharded_checkpoint_without_its_metadata_is_refused_naming_what_it_lacks_and_the_newest_whole_one(tmp_path):
    """A checkpoint directory that lost DCP's .metadata (a partial copy; ampkit renames a directory in only once it is
    whole) was "a directory, not a checkpoint: pass a checkpoint file in it", and ``last`` leading to it "no last
    link", which sent the user looking for what is not there."""
    run("resume", tmp_path, batch_size=8)
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    newest = (checkpoints / "last").resolve()
    (newest / ".metadata").unlink()
    cut_short = "is a sharded checkpoint without .metadata (a save cut short, or a partial copy): it cannot be resumed"
    whole = checkpoints / "step-00000015"
    message = f"('{checkpoints / 'last'}' leads to '{newest.name}', which {cut_short}); the newest checkpoint left is "
    with pytest.raises(CheckpointError, match=re.escape(f"{message}'{whole}'")):
        run("resume", tmp_path, batch_size=8, resume="last")
    with pytest.raises(
        CheckpointError, match=re.escape(f"'{newest}' {cut_short}; the newest whole checkpoint beside it is '{whole}'")
    ):
        run("resume", tmp_path, batch_size=8, resume=str(newest))


def test_a_sharded_resume_reads_its_trainer_pt_once_for_the_plan_the_restore_and_the_shards(tmp_path, monkeypatch):
    """The resume's plan, its restore of the trainable record and the shards' load each loaded trainer.pt again (each
    load reading it twice: torch.load, then every record against its CRC-32): a large file read six times, by readers
    that could each see another file if it was replaced meanwhile. Read once now, and what was read handed along."""
    settings = {"logging.tensorboard": False, "trainer.progress_bar": False, "distributed.strategy": "fsdp",
                "checkpoint.every_n_steps": 2, "trainer.max_steps": 2}  # fmt: skip
    ToyTrainer(toy_cfg(tmp_path, **settings)).fit()
    real_load, real_damaged = torch.load, checkpoint_io.damaged_record
    loads, checks = [], []

    def is_trainer_pt(file) -> bool:  # a path, or a file opened from one (DCP loads its shards from other objects)
        name = getattr(file, "name", file)
        return isinstance(name, str | os.PathLike) and Path(name).name == "trainer.pt"

    def load(file, *args, **kwargs):
        if is_trainer_pt(file) and not kwargs.get("mmap"):  # a peek (mmap) reads its pickle alone
            loads.append(file)
        return real_load(file, *args, **kwargs)

    def damaged_record(file):
        if is_trainer_pt(file):
            checks.append(file)
        return real_damaged(file)

    monkeypatch.setattr(torch, "load", load)
    monkeypatch.setattr(checkpoint_io, "damaged_record", damaged_record)
    resumed = ToyTrainer(toy_cfg(tmp_path, **{**settings, "trainer.max_steps": 3}))
    resumed.fit(resume="last")
    assert resumed.fit_start.loop["global_step"] == 2 and resumed.state.global_step == 3
    assert len(loads) == 1 and len(checks) == 1, (loads, checks)
    assert checks[0] is loads[0]  # the file object the load read: one file, even if another is put at its path


def test_consolidate_checkpoint_gives_a_plain_state_dict_of_the_whole_model(tmp_path):
    result = run("resume", tmp_path, batch_size=8)
    weights = consolidate_checkpoint(Path(result["version_dir"]) / "checkpoints" / "last")
    _close(weights, result["model"])
    plain = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    plain.load_state_dict(weights)


# ------------------------------------------------------------------ the examples, multi-node launch
@pytest.mark.slow
def test_gan_example_trains_sharded_on_two_torchrun_agents_joined_by_c10d_rendezvous(tmp_path):
    """Two "nodes" on one host: two torchrun agents with one process each meet through c10d rendezvous."""
    port = _free_port()
    fit = ["-m", "ampkit", "fit", "--config", "configs/gan.yaml", f"run_dir={tmp_path}", "distributed.strategy=fsdp",
           "distributed.fsdp.shard_modules=[Sequential]", "precision.opt_level=O2", "trainer.max_steps=4",
           "trainer.device=cpu", "trainer.progress_bar=false", "model.hidden=32", "data.samples=1024",
           "logging.log_every_n_steps=2"]  # fmt: skip
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "gan",
                *fit,
            ],
            cwd=TESTS.parent,
            env=child_env(TESTS.parent, OMP_NUM_THREADS="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    outputs = [agent.communicate(timeout=240) for agent in agents]
    for agent, (_, stderr) in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, stderr[-3000:]
    assert any("ampkit: finished 4 steps" in stdout for stdout, _ in outputs)
    last = tmp_path / "version_0" / "checkpoints" / "last"
    assert sorted(p.name for p in last.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # a shard per node
    scalers = load_checkpoint(last / "trainer.pt")["callbacks"]["LossScaling"]["loss_scalers"]
    assert sorted(scalers) == ["loss_scalerD", "loss_scalerG"]
    weights = consolidate_checkpoint(last)
    assert weights["generator.0.weight"].shape == (32, 8) and weights["generator.0.weight"].dtype == torch.float32
    events = EventAccumulator(str(tmp_path / "version_0" / "tensorboard"))
    events.Reload()  # the global grad norm is a collective: rank 0 logs it, every rank computes it
    norms = [e.value for e in events.Scalars("train/grad_norm/generator")]
    assert len(norms) == 2 and all(math.isfinite(v) and v > 0 for v in norms)


@pytest.mark.slow
def test_digits_example_trains_sharded_under_torchrun(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "ampkit", "fit",
         "--config", "configs/digits.yaml", f"run_dir={tmp_path}", "distributed.strategy=fsdp",
         "distributed.fsdp.shard_modules=[Linear]", "trainer.max_epochs=3", "trainer.device=cpu",
         "trainer.progress_bar=false", "logging.tensorboard=false"],
        cwd=TESTS.parent, env=child_env(TESTS.parent, OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = load_checkpoint(tmp_path / "version_0" / "checkpoints" / "last" / "trainer.pt")
    assert checkpoint["val_metrics"]["acc"] >= 0.8  # 0.847 after 3 epochs, the same as strategy ddp


@pytest.mark.slow  # two processes and a resume: ~30 s on 2 cores
def test_the_gpt_example_shards_per_block_and_resumes_from_two_ranks_on_one(tmp_path):
    """Two gloo ranks, each Block its own FSDP unit with activations recomputed; the step-3 checkpoint resumed
    by one process (batch 2 x 4) continues the same loss curve."""
    two = launch("gpt", tmp_path / "two", batch_size=4)[0]
    assert two["units"] == ["FSDPBlock", "FSDPGPT"]  # fully_shard makes each unit an FSDP<class>
    assert sorted(two["losses"]) == list(range(1, 7))
    one = run("gpt", tmp_path / "one", batch_size=8, resume=_copied(two["version_dir"], "step-00000003", tmp_path))
    assert sorted(one["losses"]) == [4, 5, 6]
    for iteration, loss in one["losses"].items():
        assert loss == pytest.approx(two["losses"][iteration], rel=1e-5)
    _close(one["model"], two["model"])


def test_a_nan_that_reaches_the_sharded_weights_stops_before_it_is_checkpointed(tmp_path):
    """No guard ran under FSDP: a NaN loss trained on and every later checkpoint held a NaN model. The guard now
    checks each rank's shards (and the ranks agree on the verdict), as it checks a whole model."""
    from toy_trainers import NaNLossToyTrainer, toy_cfg

    from ampkit.callbacks import NonFiniteError

    cfg = toy_cfg(tmp_path, **{"logging.tensorboard": False, "trainer.progress_bar": False, "trainer.max_epochs": 2},
                  **{"checkpoint.every_n_steps": 1, "distributed.strategy": "fsdp"})  # fmt: skip
    trainer = NaNLossToyTrainer(cfg)
    with pytest.raises(NonFiniteError, match=r"not finite at step 6 \(.*weight.*\): step 6 applied a loss of nan"):
        trainer.fit()
    last = resolve_checkpoint(cfg["run_dir"], "last")
    assert load_checkpoint(last / "trainer.pt")["loop"]["global_step"] == 5
    model = consolidate_checkpoint(last)
    assert model and all(torch.isfinite(v).all() for v in model.values() if v.is_floating_point())


def test_a_nan_in_one_ranks_shard_stops_every_rank_before_the_checkpoint(tmp_path):
    """Each rank checks only its own shards: the ranks agree on the verdict, or the rank whose shard is finite
    would write its part of a checkpoint the other refused (and then wait on it)."""
    results = launch("nan_in_one_shard", tmp_path)
    for result in results:
        assert result["error"] is not None and "not finite at step 2" in result["error"], result
    assert not (Path(results[0]["version_dir"]) / "checkpoints" / "step-00000002").exists()


@pytest.fixture(scope="module")
def failing_saves(tmp_path_factory) -> tuple[Path, list[str], list[dict]]:
    """One two-rank launch of sharded saves that fail on one rank, and resumes after them (``fsdp_worker.py``'s
    ``failing_sharded_saves``): its folder, each rank's stderr and each rank's result."""
    out = tmp_path_factory.mktemp("failing_saves")
    procs = start("failing_sharded_saves", out)
    outputs = [proc.communicate(timeout=240) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs[1][1][-3000:]
    return out, [stderr for _, stderr in outputs], [torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)]


def test_at_sharded_saves_rank_zero_names_a_late_rank_and_a_protected_last_stops_every_rank(failing_saves):
    """Rank zero waited for a rank late to a save without a word until distributed.timeout_s (300 s by default) failed
    the run; and it alone refused to replace a write-protected copy of the checkpoint in the ``last`` link's place,
    while rank 1 trained on into a collective rank zero never joined. A resume then branches on every rank."""
    out, stderr, results = failing_saves
    said = [line for line in stderr[0].splitlines() if "has waited" in line]
    assert said == [
        "ampkit: rank 0 has waited 0.5 s at the save of step-00000002 for rank(s) 1; a rank that died or hangs there "
        "stops the run after distributed.timeout_s (its own output says why)"
    ]
    assert "has waited" not in stderr[1]
    last = out / "run" / "version_0" / "checkpoints" / "last"
    for result in results:
        kind, error, step = result["error"]
        assert kind == "CheckpointError" and step == 4
        assert error.startswith(f"could not write checkpoint '{last}' (write-protected")
        assert result["resumed_in"] == str(out / "run" / "version_1") and result["resumed_to"] == 6
    assert (last / ".metadata").is_file() and not last.is_symlink()


def test_a_sharded_save_that_fails_on_one_rank_stops_every_rank_and_the_next_resume_takes_the_last_whole_one(
    failing_saves,
):
    """A full disk at step 8's save, as rank 1 wrote its shard file (DCP gathers it to every rank) or as rank 0 wrote
    trainer.pt, its last write: rank 1 then waited in the save's closing barrier until distributed.timeout_s, to
    fail with a timeout. Every rank now stops with rank 0's error; ``last`` still names step 6, which the next resume
    takes. A shard file torn on disk, which only the rank that checks it (rank 1) finds, stops both before training."""
    out, _, results = failing_saves
    checkpoints = out / "run" / "version_1" / "checkpoints"
    for failing, where in (("rank 1's shard", " on rank 1"), ("rank 0's trainer.pt", "")):
        message = (
            f"could not write checkpoint '{checkpoints / 'step-00000008'}' (No space left on device{where}); last "
            "still holds the previous checkpoint, and --resume last continues from it"
        )
        assert [result[failing] for result in results] == [("CheckpointError", message, 8)] * 2, failing
    for result in results:
        assert (result["after_from"], result["after_to"]) == (6, 8)
        kind, error, step = result["torn"]
        assert kind == "CheckpointError" and step == 0, result["torn"]  # refused as it loads: nothing restored
        assert f"sharded checkpoint '{checkpoints / 'last'}': shard file(s) __1_0.distcp are not as written" in error
    assert load_checkpoint(checkpoints / "last" / "trainer.pt")["loop"]["global_step"] == 8  # nothing saved after
    assert results[0]["validated"] == results[1]["validated"] and results[0]["validated"]
    assert not list(checkpoints.glob(".*"))  # no partial directory left by the failed saves


def test_a_kill_while_pruning_a_sharded_checkpoint_leaves_no_half_of_it(tmp_path, monkeypatch):
    """keep_last deleted an old checkpoint directory file by file under its own name: a kill midway left a
    ``step-N`` without ``.metadata``, neither resumable nor ever pruned again."""
    real_unlink = Path.unlink

    def killed_midway(path, *args, **kwargs):  # the kill strikes after the first file
        real_unlink(path, *args, **kwargs)
        if path.name == ".metadata" and "00000001" in path.parent.name:
            raise KeyboardInterrupt

    settings = {"logging.tensorboard": False, "trainer.progress_bar": False, "distributed.strategy": "fsdp",
                "checkpoint.every_n_steps": 1, "checkpoint.keep_last": 1, "trainer.max_steps": 3}  # fmt: skip
    monkeypatch.setattr(Path, "unlink", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        ToyTrainer(toy_cfg(tmp_path, **settings)).fit()
    monkeypatch.setattr(Path, "unlink", real_unlink)
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    assert all(is_sharded_checkpoint(p) for p in checkpoints.iterdir() if not p.name.startswith("."))
    ToyTrainer(toy_cfg(tmp_path, **settings)).fit(resume="last")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last", "step-00000003"]


def test_a_failed_move_of_a_link_over_a_copied_last_puts_the_copy_back_and_leaves_no_temp(tmp_path, monkeypatch):
    """Where a copy of the run has ``last`` as a whole directory, the link's move sets it aside first; a full disk at
    the move itself left the copy under ``.last.old`` and the temp link beside it, with no ``last`` at all."""
    (tmp_path / "step-00000004").mkdir()
    (tmp_path / "last").mkdir()
    (tmp_path / "last" / "trainer.pt").write_bytes(b"the copied checkpoint")
    real_replace = os.replace

    def replace(source, target):
        if Path(source).name == ".last.tmp":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="No space left on device"):
        sharded_checkpoint.point_last_at(tmp_path / "step-00000004")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "step-00000004"]
    assert (tmp_path / "last" / "trainer.pt").read_bytes() == b"the copied checkpoint"
