"""ModelCheckpoint keeps the contract users know from Lightning's: the best ``save_top_k`` by ``monitor`` and
``mode``, a non-finite value never the best, periodic files beside them, a ranking that survives a resume, a
missing monitor named with the metrics there are, and none of the user's files ever deleted."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from best_checkpoints import best_pt_step, best_steps
from toy_trainers import ToyTrainer, toy_cfg

import ampkit
from ampkit import ConfigError
from ampkit.callbacks import ModelCheckpoint
from ampkit.callbacks import checkpoint as checkpoint_module
from ampkit.trainer.checkpoint_io import load_checkpoint
from ampkit.trainer.optimizers import MonitorNotFoundError
from ampkit.trainer.ordering import CallbackOrderError

QUIET = {"logging.tensorboard": False, "trainer.progress_bar": False, "logging.throughput": False}


class ScriptedScores(ToyTrainer):
    """Validates after every iteration (6 per epoch); the validation after step N returns ``scores[N]`` under the
    metric ``name``."""

    scores: dict[int, float] = {}
    name = "score"

    def validation_step(self, batch):
        return {self.name: torch.tensor(self.scores[self.state.global_step])}


def _fit(tmp_path, scores, *, trainer=ScriptedScores, resume=None, **overrides):
    trainer = type("Scripted", (trainer,), {"scores": scores})
    settings = {**QUIET, "data.n": 48, "trainer.max_epochs": 1, "trainer.val_every_n_steps": 1,
                "trainer.num_sanity_val_steps": 0, "checkpoint.every_n_epochs": 0, **overrides}  # fmt: skip
    run = trainer(toy_cfg(tmp_path, **settings))
    run.fit(resume=resume)
    return run


SCORES = {1: 0.5, 2: 0.3, 3: 0.9, 4: 0.1, 5: 0.4, 6: 0.2}


@pytest.mark.parametrize(
    ("mode", "top_k", "kept", "best"),
    [
        ("min", 1, [4], 4),
        ("min", 3, [2, 4, 6], 4),
        ("max", 1, [3], 3),
        ("max", 2, [1, 3], 3),
        ("min", -1, [1, 2, 3, 4, 5, 6], 4),
    ],
)
def test_the_best_k_by_mode_are_kept_and_best_pt_holds_the_best(tmp_path, mode, top_k, kept, best):
    """As Lightning's save_top_k: k files of the k best values (min or max), -1 every validation's, and the best
    of them also as best.pt, a copy of that step's state."""
    run = _fit(tmp_path, SCORES, **{"checkpoint.monitor": "val/score", "checkpoint.mode": mode,
                                     "checkpoint.save_top_k": top_k})  # fmt: skip
    assert best_steps(run) == kept
    assert best_pt_step(run) == best
    saved = load_checkpoint(run.version_dir / "checkpoints" / "last.pt")["callbacks"]
    callback_state = saved["ModelCheckpoint[val/score]"]
    ranked = sorted((SCORES[s] for s in kept), reverse=mode == "max")
    assert list(callback_state["best_k"].values()) == pytest.approx(ranked), "the saved ranking lists the best first"


def test_a_tie_keeps_the_earlier_checkpoint(tmp_path):
    """A value equal to the k-th best does not displace it (Lightning compares strictly), and best.pt stays the
    first to reach the best value."""
    run = _fit(tmp_path, {1: 0.5, 2: 0.2, 3: 0.2, 4: 0.5, 5: 0.2, 6: 0.9},
               **{"checkpoint.monitor": "val/score", "checkpoint.save_top_k": 2})  # fmt: skip
    assert best_steps(run) == [2, 3]
    assert best_pt_step(run) == 2


@pytest.mark.parametrize("mode", ["min", "max"])
def test_a_better_value_pushes_out_the_oldest_of_the_tied_worst_also_across_a_resume(tmp_path, mode):
    """Lightning's kth_best_model_path is the first of the tied worst in its ranking (``max``/``min`` return the
    first), so a better value replaces the oldest of them: ampkit dropped the newest."""
    sign = 1 if mode == "min" else -1
    scores = {step: sign * value for step, value in {1: 0.5, 2: 0.5, 3: 0.5, 4: 0.2, 5: 0.1, 6: 0.9}.items()}
    keys = {"checkpoint.monitor": "val/score", "checkpoint.mode": mode, "checkpoint.save_top_k": 3}
    run = _fit(tmp_path, scores, **keys, **{"trainer.max_steps": 4})
    assert best_steps(run) == [2, 3, 4]  # step 4's 0.2 pushed out step 1, the oldest of three tied at 0.5
    run = _fit(tmp_path, scores, resume="last", **keys)
    assert best_steps(run) == [3, 4, 5]  # the restored ranking still knows step 2 is older than step 3
    assert best_pt_step(run) == 5


@pytest.mark.parametrize("mode", ["min", "max"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_value_is_never_ranked_nor_saved_as_best(tmp_path, mode, bad):
    """NaN, +inf and -inf are no improvement in either mode: not best.pt, not among the top k even while it has
    room (Lightning keeps a NaN one as the worst while there is room, and ranks a -inf one best in min mode)."""
    run = _fit(tmp_path, {1: bad, 2: 0.5, 3: bad, 4: 0.4, 5: bad, 6: 0.6},
               **{"checkpoint.monitor": "val/score", "checkpoint.mode": mode, "checkpoint.save_top_k": 5})  # fmt: skip
    assert best_steps(run) == [2, 4, 6]
    assert best_pt_step(run) == (4 if mode == "min" else 6)


def test_only_non_finite_values_leave_no_best_pt(tmp_path):
    run = _fit(tmp_path, dict.fromkeys(range(1, 7), math.nan), **{"checkpoint.monitor": "val/score"})
    assert best_steps(run) == []
    assert not (run.version_dir / "checkpoints" / "best.pt").exists()
    assert (run.version_dir / "checkpoints" / "last.pt").is_file()


def test_every_n_steps_and_every_n_epochs_both_save_and_keep_last_prunes_them_together(tmp_path):
    """Lightning takes one of every_n_train_steps and every_n_epochs; ampkit takes both: step files every N steps,
    epoch files every M epochs, keep_last the newest of them all, the best-k files apart."""
    run = _fit(tmp_path, {s: 1.0 / s for s in range(1, 19)},
               **{"trainer.max_epochs": 3, "checkpoint.every_n_steps": 4, "checkpoint.every_n_epochs": 2,
                  "checkpoint.keep_last": 3, "checkpoint.monitor": "val/score"})  # fmt: skip
    names = sorted(p.name for p in (run.version_dir / "checkpoints").iterdir())
    assert names == ["best-00000018.pt", "best.pt", "epoch-0002.pt", "last.pt",
                     "step-00000016.pt", "step-00000018.pt"]  # fmt: skip
    assert load_checkpoint(run.version_dir / "checkpoints" / "epoch-0002.pt")["loop"]["global_step"] == 12
    assert best_pt_step(run) == 18


def test_the_ranking_survives_a_resume_and_a_worse_value_after_it_evicts_nothing_better(tmp_path):
    """The top k saved before a resume compete with the values after it: a worse value enters only in place of a
    worse one, and best.pt keeps the pre-resume best until beaten."""
    before = {1: 0.5, 2: 0.1, 3: 0.3, 4: 0.9, 5: 0.8, 6: 0.7}
    after = {7: 0.6, 8: 0.95, 9: 0.2, 10: 0.4, 11: 0.99, 12: 0.05}
    keys = {"checkpoint.monitor": "val/score", "checkpoint.save_top_k": 3}
    first = _fit(tmp_path, before, **keys)
    assert best_steps(first) == [1, 2, 3]
    run = _fit(tmp_path, {**before, **after}, resume="last", **keys, **{"trainer.max_epochs": 2})
    assert run.version_dir == first.version_dir
    assert best_steps(run) == [2, 9, 12]
    assert best_pt_step(run) == 12
    middle = _fit(tmp_path, before, **keys)  # a fresh run (version_1): stopped where no later value beats step 2
    _fit(tmp_path, {**before, 7: 0.6, 8: 0.95, 9: 0.7, 10: 0.4, 11: 0.99, 12: 0.8}, resume="last", **keys,
         **{"trainer.max_epochs": 2})  # fmt: skip
    assert best_steps(middle) == [2, 3, 10]
    assert best_pt_step(middle) == 2


def test_a_kill_between_best_pt_and_last_pt_leaves_best_pt_the_ranking_s_best_after_the_resume(tmp_path):
    """A save copies a new best into best.pt before it moves last.pt. Killed in between, the resume restored last.pt's
    ranking and removed the new best-<step>.pt, but best.pt kept that state, ranked by nothing; where the step scored
    otherwise on resume (a changed config, a GPU's other rounding) best.pt stayed a model no ranking named."""
    import shutil

    keys = {"checkpoint.monitor": "val/score", "checkpoint.save_top_k": 2, "checkpoint.every_n_steps": 1}
    first = _fit(tmp_path, SCORES, **keys, **{"trainer.max_steps": 4})
    checkpoints = first.version_dir / "checkpoints"
    assert best_pt_step(first) == 4
    shutil.copy(checkpoints / "step-00000003.pt", checkpoints / "last.pt")  # as if killed before last.pt moved
    run = _fit(tmp_path, {**SCORES, 4: 0.95}, resume="last", **keys, **{"trainer.max_steps": 4})
    assert run.version_dir == first.version_dir
    assert not (checkpoints / "best-00000004.pt").exists()
    assert best_pt_step(run) == 2


def test_a_monitor_never_returned_is_an_error_naming_it_and_the_metrics_there_are(tmp_path):
    """Lightning's ModelCheckpoint raises naming the monitor and the available metrics; so does ampkit, at the
    first validation (here without the sanity check, which would catch it before training)."""
    with pytest.raises(MonitorNotFoundError) as error:
        _fit(tmp_path, SCORES, **{"checkpoint.monitor": "val/acc"})
    assert "'val/acc'" in str(error.value) and "val/score" in str(error.value)
    assert "checkpoint.monitor" in str(error.value)


@pytest.mark.parametrize("metric", ["acc/top-1 (%)", "loss=0.5:val", "épreuve ø"])
def test_a_metric_name_with_odd_characters_ranks_and_names_files_by_step(tmp_path, metric):
    """Lightning puts the metric in the file name (and mangles '/'); ampkit names best-k files by step alone, so any
    metric name ranks and writes no odd path."""
    trainer = type("Odd", (ScriptedScores,), {"name": metric})
    run = _fit(tmp_path, SCORES, trainer=trainer, **{"checkpoint.monitor": f"val/{metric}", "checkpoint.mode": "max"})
    assert best_steps(run) == [3]
    names = {p.name for p in (run.version_dir / "checkpoints").iterdir()}
    assert names == {"best-00000003.pt", "best.pt", "last.pt", "step-00000006.pt"}  # the last, saved at the end


def test_a_directory_holding_another_run_s_files_loses_none_of_them(tmp_path):
    """A run_dir that already holds another run's files (and the user's own beside them, some named much like
    ampkit's) keeps every one of them: a fresh run writes a version directory of its own, and a resume prunes only
    the names of its own ranking and keep_last."""
    keys = {"checkpoint.monitor": "val/score", "checkpoint.every_n_steps": 1, "checkpoint.keep_last": 1}
    other = _fit(tmp_path, SCORES, **keys)
    others = {p: p.read_bytes() for p in (other.version_dir / "checkpoints").iterdir()}
    run_dir = tmp_path / "run"
    users = {run_dir / "notes.txt": b"mine", run_dir / "best.pt": b"mine", run_dir / "last.pt": b"mine",
             run_dir / "checkpoints" / "best-00000004.pt": b"mine", run_dir / "version_7" / "step-00000001.pt": b"mine",
             other.version_dir / "checkpoints" / "best-final.pt": b"mine"}  # fmt: skip
    for path, data in users.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    fresh = _fit(tmp_path, {s: -v for s, v in SCORES.items()}, **keys)
    assert fresh.version_dir != other.version_dir
    for path, data in {**others, **users}.items():
        assert path.read_bytes() == data, path


def test_the_sanity_validation_ranks_nothing(tmp_path):
    """As in Lightning, the validation batches run before training save no checkpoint: their better value (the
    untrained model's, here scripted best) never becomes best.pt."""
    run = _fit(tmp_path, {0: -1.0, **SCORES}, **{"checkpoint.monitor": "val/score", "trainer.num_sanity_val_steps": 2})
    assert best_steps(run) == [4]
    assert best_pt_step(run) == 4


@pytest.mark.parametrize("top_k", [3, 2])
def test_save_top_k_without_a_monitor_is_refused_naming_what_to_set(tmp_path, top_k):
    """It ranked nothing, so no best file was ever kept, without a word (Lightning's ModelCheckpoint refuses it):
    now the config is refused at construction, before any user code, and so is the callback built by hand."""
    with pytest.raises(ConfigError, match=rf"'checkpoint.save_top_k': {top_k} keeps the best checkpoints by "
                                          r"checkpoint.monitor, which is not set: set checkpoint.monitor"):  # fmt: skip
        ScriptedScores(toy_cfg(tmp_path, **{"checkpoint.save_top_k": top_k}))
    with pytest.raises(ValueError, match=rf"save_top_k={top_k} keeps the best checkpoints by monitor, which is not"):
        ModelCheckpoint(save_top_k=top_k)
    ScriptedScores(toy_cfg(tmp_path, **{"checkpoint.save_top_k": top_k, "checkpoint.monitor": "val/score"}))


def test_save_top_k_minus_one_without_a_monitor_keeps_every_periodic_file(tmp_path):
    """Lightning's ModelCheckpoint(save_top_k=-1) without a monitor keeps every save: here every step file, with
    keep_last not applied (it was refused, so a user porting that setting could not run at all), also after a
    resume that finds the run finished."""
    settings = {"checkpoint.save_top_k": -1, "checkpoint.every_n_steps": 1, "checkpoint.keep_last": 1}
    run = _fit(tmp_path, SCORES, **settings)
    names = sorted(p.name for p in (run.version_dir / "checkpoints").iterdir())
    assert names == ["last.pt", *(f"step-{step:08d}.pt" for step in range(1, 7))]
    again = _fit(tmp_path, SCORES, resume="last", **settings)
    assert sorted(p.name for p in (again.version_dir / "checkpoints").iterdir()) == names
    assert ModelCheckpoint(save_top_k=-1, keep_last=1).keep_last is None


def _fit_ranking_two_best(tmp_path, max_steps: int, resume=None):
    """A scripted-score run with a best-2 ModelCheckpoint given in code (validating every step): the run and it."""
    scripted = type("Scripted", (ScriptedScores,), {"scores": SCORES})
    settings = {**QUIET, "data.n": 48, "trainer.val_every_n_steps": 1, "trainer.num_sanity_val_steps": 0}
    best_k = ModelCheckpoint(monitor="val/score", save_top_k=2, every_n_epochs=0)
    run = scripted(toy_cfg(tmp_path, **settings, **{"trainer.max_steps": max_steps}), callbacks=[best_k])
    run.fit(resume=resume)
    return run, best_k


def test_a_best_k_checkpoint_given_in_code_runs_beside_the_config_s_periodic_one_and_each_resumes_its_own(tmp_path):
    """Lightning's usual pair, a periodic ModelCheckpoint and a best-k one, keyed apart by their monitor: the best-k
    ranking survives a resume and the periodic one deletes none of its files. Two of them in one run were refused,
    as if they shared one state."""
    run, _ = _fit_ranking_two_best(tmp_path, 3)
    saved = load_checkpoint(run.version_dir / "checkpoints" / "last.pt")["callbacks"]
    assert list(saved["ModelCheckpoint[val/score]"]["best_k"]) == ["best-00000002.pt", "best-00000001.pt"]
    assert saved["ModelCheckpoint[None]"]["best_k"] == {}
    run, best_k = _fit_ranking_two_best(tmp_path, 6, resume="last")
    assert list(best_k.best_k) == ["best-00000004.pt", "best-00000006.pt"]  # 0.1, 0.2: ranked on from 0.3, 0.5
    assert best_steps(run) == [4, 6] and best_pt_step(run) == 4


@pytest.mark.parametrize("periodic", [{"every_n_epochs": 0}, {"every_n_steps": 1, "every_n_epochs": 0, "keep_last": 5}])
def test_beside_the_config_s_periodic_checkpoint_one_in_code_neither_writes_nor_prunes_its_step_files(
    tmp_path, monkeypatch, periodic
):
    """A best-k ModelCheckpoint given in code pruned the config's step files by its own keep_last (2 of the config's 5
    kept) and wrote the run's end save again; one by the config's very settings wrote every step file a second time.
    The step files have one writer now: each is written once and keep_last keeps the config's 5."""
    writes = []
    real_save = checkpoint_module.save_atomic
    monkeypatch.setattr(
        checkpoint_module, "save_atomic", lambda obj, path: writes.append(path.name) or real_save(obj, path)
    )
    scripted = type("Scripted", (ScriptedScores,), {"scores": SCORES})
    settings = {**QUIET, "data.n": 48, "trainer.max_steps": 6, "trainer.val_every_n_steps": 1,
                "trainer.num_sanity_val_steps": 0, "checkpoint.every_n_steps": 1, "checkpoint.every_n_epochs": 0,
                "checkpoint.keep_last": 5}  # fmt: skip
    run = scripted(toy_cfg(tmp_path, **settings), callbacks=[ModelCheckpoint(monitor="val/score", **periodic)])
    run.fit()
    steps = sorted(p.name for p in (run.version_dir / "checkpoints").glob("step-*"))
    assert steps == [f"step-{step:08d}.pt" for step in range(2, 7)]
    # step 6 twice, as with the config's alone: its validation came after its save, and the run's end saves it again
    assert sorted(writes) == ["best-00000001.pt", "best-00000002.pt", "best-00000004.pt",
                              *(f"step-{step:08d}.pt" for step in (1, 2, 3, 4, 5, 6, 6))]  # fmt: skip


def test_two_checkpoints_ranking_best_files_are_refused_naming_both_monitors(tmp_path):
    """They would share best.pt and the best-N files of one directory, each pruning the other's: one error before
    training, not a run that deletes best checkpoints."""
    scripted = type("Scripted", (ScriptedScores,), {"scores": SCORES})
    cfg = toy_cfg(tmp_path, **QUIET, **{"checkpoint.monitor": "val/score", "trainer.max_steps": 1})
    run = scripted(cfg, callbacks=[ModelCheckpoint(monitor="val/other")])
    with pytest.raises(CallbackOrderError, match=r"2 ModelCheckpoint callbacks rank best .*monitors val/score, val/o"):
        run.fit()
    assert run.state.global_step == 0


def test_best_model_path_score_and_best_k_models_read_as_lightning_s_also_after_a_resume(tmp_path):
    """A Lightning user reads ``checkpoint.best_model_path`` after fit (to load or report it): there was no such
    attribute. They name the ranked files by path, the best first, and a resumed run ranks on from its checkpoint's."""
    fresh = ModelCheckpoint(monitor="val/score")
    assert (fresh.best_model_path, fresh.best_model_score, fresh.best_k_models) == ("", None, {})
    run, best_k = _fit_ranking_two_best(tmp_path, 3)
    directory = run.version_dir / "checkpoints"
    expected = {str(directory / "best-00000002.pt"): 0.3, str(directory / "best-00000001.pt"): 0.5}
    assert best_k.best_k_models == pytest.approx(expected) and list(best_k.best_k_models) == list(expected)
    assert best_k.best_model_path == str(directory / "best-00000002.pt")
    assert best_k.best_model_score == pytest.approx(0.3)
    assert load_checkpoint(best_k.best_model_path)["loop"]["global_step"] == best_pt_step(run) == 2
    run, best_k = _fit_ranking_two_best(tmp_path, 6, resume="last")
    assert best_k.best_model_path == str(directory / "best-00000004.pt")
    assert best_k.best_model_score == pytest.approx(0.1)
    assert list(best_k.best_k_models) == [str(directory / "best-00000004.pt"), str(directory / "best-00000006.pt")]
    assert ModelCheckpoint().best_model_path == ""  # no monitor: nothing ranked
    # a ranking restored outside a fit names no path, nor a score without its path, until it is told its directory
    restored = ModelCheckpoint(monitor="val/score")
    restored.load_state_dict(best_k.state_dict())
    assert (restored.best_model_path, restored.best_model_score, restored.best_k_models) == ("", None, {})
    restored.ranked_in(directory)
    assert restored.best_model_path == str(directory / "best-00000004.pt")
    assert restored.best_model_score == pytest.approx(0.1)
    # fit() again on the finished run (Lightning's idiom to get the best path): nothing trains, the ranking reads
    run, best_k = _fit_ranking_two_best(tmp_path, 6, resume="last")
    assert run.state.global_step == 6 and best_k.best_model_path == str(directory / "best-00000004.pt")
    assert list(best_k.best_k_models) == [str(directory / "best-00000004.pt"), str(directory / "best-00000006.pt")]


def test_kth_best_model_path_kth_value_current_score_and_dirpath_read_as_lightning_s(tmp_path):
    """A port reads ``checkpoint_callback.dirpath`` (where the files are) and ``kth_value`` (the value to beat):
    AttributeError. The k-th is the file a better value pushes out next, set once the top k is full."""
    assert (ModelCheckpoint().dirpath, ModelCheckpoint(monitor="val/score").kth_best_model_path) == (None, "")
    assert ModelCheckpoint(monitor="val/score").current_score is None
    run, best_k = _fit_ranking_two_best(tmp_path, 1)
    directory = run.version_dir / "checkpoints"
    assert best_k.dirpath == str(directory) and best_k.last_model_path == str(directory / "last.pt")
    assert (best_k.kth_best_model_path, best_k.kth_value) == ("", None)  # one of two places taken
    assert best_k.current_score == 0.5  # the value of the checkpoint that entered the top k last
    run, best_k = _fit_ranking_two_best(tmp_path, 3, resume="last")  # 0.5, 0.3 ranked; 0.9 not
    assert best_k.kth_best_model_path == str(directory / "best-00000001.pt") and best_k.kth_value == 0.5
    assert best_k.current_score == pytest.approx(0.3)  # 0.9 entered nothing, as in Lightning
    run, best_k = _fit_ranking_two_best(tmp_path, 6, resume="last")  # 0.1 and 0.2 pushed them out
    assert best_k.kth_best_model_path == str(directory / "best-00000006.pt")
    assert best_k.kth_value == pytest.approx(0.2)
    _, best_k = _fit_ranking_two_best(tmp_path, 6, resume="last")  # the finished run: each answer restored
    assert best_k.current_score == best_k.kth_value == pytest.approx(0.2)
    tied = ModelCheckpoint(monitor="val/score", save_top_k=3)
    tied.best_k, tied._directory = (
        {"best-00000004.pt": 0.2, "best-00000002.pt": 0.5, "best-00000003.pt": 0.5},
        directory,
    )
    assert tied.kth_best_model_path == str(directory / "best-00000002.pt")  # the oldest of the tied, as Lightning's


def test_a_refused_current_score_leaves_the_ranking_it_had():
    """A state with a current_score that is no number is refused after nothing changed: the ranking, kept files and
    protected names were taken first, so the refused checkpoint's ranking stood in the callback."""
    callback = ModelCheckpoint(monitor="val/score")
    callback.load_state_dict({"best_k": {"best-00000002.pt": 0.3}, "kept": [], "protected": [], "current_score": 0.3})
    edited = {"best_k": {"best-00000009.pt": 0.1}, "kept": ["best-00000005.pt"], "current_score": "0.1"}
    with pytest.raises(checkpoint_module.CheckpointError, match="current_score '0.1', which is no number"):
        callback.load_state_dict(edited)
    assert (callback.best_k, callback.kept, callback.current_score) == ({"best-00000002.pt": 0.3}, [], 0.3)


@pytest.mark.parametrize(("key", "entry"), [("best_k", {"notes.txt": 0.5}), ("best_k", {"../../notes.txt": 0.5}),
                                            ("kept", ["../notes.txt"]), ("protected", ["/tmp/notes.txt"]),
                                            ("protected", [".."])])  # fmt: skip
def test_a_restored_ranking_naming_no_best_k_file_is_refused_before_pruning_deletes_it(tmp_path, key, entry):
    """An edited checkpoint whose ranking named 'notes.txt' (0.5, pushed out of the top 2 by step 4's 0.1) had the
    resumed run delete that file of the user's from its checkpoints directory ('../../notes.txt' too: pruning took
    the name's last part)."""
    scores = {1: 0.9, 2: 0.3, 3: 0.8, 4: 0.1, 5: 0.2, 6: 0.2}
    keys = {"checkpoint.monitor": "val/score", "checkpoint.save_top_k": 2, "trainer.max_steps": 3}
    run = _fit(tmp_path, scores, **keys)
    notes = run.version_dir / "checkpoints" / "notes.txt"
    notes.write_text("mine")
    last = run.version_dir / "checkpoints" / "last.pt"
    checkpoint = load_checkpoint(last)
    state = checkpoint["callbacks"]["ModelCheckpoint[val/score]"]
    state[key] = {**state[key], **entry} if isinstance(entry, dict) else [*state[key], *entry]
    torch.save(checkpoint, last)
    named = next(iter(entry))
    with pytest.raises(checkpoint_module.CheckpointError, match=rf"names '{re.escape(named)}' among its checkpoint"):
        _fit(tmp_path, scores, resume="last", **{**keys, "trainer.max_steps": 6})
    assert notes.read_text() == "mine"


def test_without_a_monitor_best_model_path_names_the_newest_checkpoint_as_lightning_s_also_after_a_resume(tmp_path):
    """Lightning's ModelCheckpoint without a monitor answers best_model_path with the checkpoint it saved last (a
    port's test(ckpt_path=cb.best_model_path) after fit); here it read '', and best_model_score stays None."""
    settings = {**QUIET, "checkpoint.enabled": False, "trainer.max_steps": 7, "trainer.num_sanity_val_steps": 0}
    periodic = ModelCheckpoint(every_n_steps=3, every_n_epochs=0)
    run = ToyTrainer(toy_cfg(tmp_path, **settings), callbacks=[periodic])
    run.fit()
    directory = run.version_dir / "checkpoints"
    assert periodic.best_model_path == str(directory / "step-00000007.pt")  # the run's end save, after step 6's
    assert (periodic.best_model_score, periodic.best_k_models) == (None, {})
    assert periodic.last_model_path == str(directory / "last.pt") and ModelCheckpoint().last_model_path == ""
    assert load_checkpoint(periodic.best_model_path)["loop"]["global_step"] == 7
    again = ModelCheckpoint(every_n_steps=3, every_n_epochs=0)  # fit() again on the finished run: restored
    ToyTrainer(toy_cfg(tmp_path, **settings), callbacks=[again]).fit(resume="last")
    assert again.best_model_path == str(directory / "step-00000007.pt")
    assert again.last_model_path == str(directory / "last.pt")


class ReadsPathsAtTrainStart(ampkit.Callback):
    """Records what the ModelCheckpoint it is given answers as training starts, before the run's first save."""

    def __init__(self, checkpoint: ModelCheckpoint) -> None:
        self.checkpoint, self.read = checkpoint, {}

    def on_train_start(self, trainer) -> None:
        self.read = {"best": self.checkpoint.best_model_path, "models": list(self.checkpoint.best_k_models),
                     "last": self.checkpoint.last_model_path}  # fmt: skip


@pytest.mark.parametrize("monitor", [None, "val/mse"])
def test_a_branch_answers_best_model_path_from_its_start_as_the_straight_run_does(tmp_path, monitor):
    """A branch (a resume from an older checkpoint, into a new version_N) without a monitor answered best_model_path
    '' until its first save, where Lightning's restored path and the straight run answer a file; with a monitor it
    named its inherited best files in its own folder before they were copied there. Each is a file that is there."""
    settings = {**QUIET, "checkpoint.enabled": False, "trainer.max_steps": 7, "trainer.val_every_n_steps": 3}

    def checkpoint() -> ModelCheckpoint:
        return ModelCheckpoint(every_n_steps=3, every_n_epochs=0, keep_last=3, monitor=monitor)

    first = checkpoint()
    run = ToyTrainer(toy_cfg(tmp_path, **settings), callbacks=[first])
    run.fit()
    origin = run.version_dir / "checkpoints"
    branch = checkpoint()
    reader = ReadsPathsAtTrainStart(branch)
    branched = ToyTrainer(toy_cfg(tmp_path, **settings), callbacks=[branch, reader])
    branched.fit(resume=origin / "step-00000006.pt")
    assert branched.version_dir != run.version_dir  # a branch
    states = load_checkpoint(origin / "step-00000006.pt")["callbacks"]
    ranked = next(state["best_k"] for key, state in states.items() if key.startswith("ModelCheckpoint"))
    expected = next(iter(ranked)) if monitor else "step-00000006.pt"  # the straight run's answer at step 6
    assert reader.read["best"] == str(origin / expected) and Path(reader.read["best"]).is_file()
    assert reader.read["models"] == [str(origin / name) for name in ranked] and (ranked or not monitor)
    # last_model_path named the branch's own last.pt (with a monitor), not written yet, or '' (without one)
    assert reader.read["last"] == str(origin / "step-00000006.pt")  # the checkpoint it resumed, there
    here = branched.version_dir / "checkpoints"
    assert branch.best_model_path == str(here / (expected if monitor else "step-00000007.pt"))  # its own, once saved
    assert branch.last_model_path == str(here / "last.pt") and Path(branch.last_model_path).is_file()


def _disk_full_when_writing(name: str, monkeypatch) -> None:
    """ModelCheckpoint's writes fail as on a full disk when the file written is named ``name``."""
    import errno
    import os

    written = checkpoint_module.save_atomic

    def save_atomic(obj, path, *args, **kwargs):
        if Path(path).name == name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return written(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "save_atomic", save_atomic)


def test_without_a_monitor_a_failed_save_leaves_best_model_path_naming_the_file_before_it(tmp_path, monkeypatch):
    """The newest file's name is recorded before the save (the checkpoint's own state names it): a save that fails
    (a full disk) left best_model_path naming a file that was never written."""
    settings = {**QUIET, "checkpoint.enabled": False, "trainer.max_steps": 7, "trainer.num_sanity_val_steps": 0}
    periodic = ModelCheckpoint(every_n_steps=3, every_n_epochs=0)
    run = ToyTrainer(toy_cfg(tmp_path, **settings), callbacks=[periodic])
    _disk_full_when_writing("step-00000006.pt", monkeypatch)
    with pytest.raises(Exception, match="No space left on device"):
        run.fit()
    directory = run.version_dir / "checkpoints"
    assert periodic.best_model_path == str(directory / "step-00000003.pt")
    assert load_checkpoint(periodic.best_model_path)["loop"]["global_step"] == 3


def test_a_failed_best_k_save_leaves_the_ranking_naming_only_files_written(tmp_path, monkeypatch):
    """The ranking takes a better value in before its file is written (the file's own state holds the ranking): a
    save that failed (a full disk) left best_model_path, best_k_models and current_score naming a file never
    written."""
    _disk_full_when_writing("best-00000004.pt", monkeypatch)
    trainer = type("Scripted", (ScriptedScores,), {"scores": SCORES})
    settings = {**QUIET, "data.n": 48, "trainer.max_epochs": 1, "trainer.val_every_n_steps": 1,
                "trainer.num_sanity_val_steps": 0, "checkpoint.every_n_epochs": 0,
                "checkpoint.monitor": "val/score", "checkpoint.save_top_k": 2}  # fmt: skip
    run = trainer(toy_cfg(tmp_path, **settings))
    with pytest.raises(Exception, match="No space left on device"):
        run.fit()
    ranked = next(cb for cb in run.callbacks if isinstance(cb, ModelCheckpoint))
    directory = run.version_dir / "checkpoints"
    assert ranked.best_model_path == str(directory / "best-00000002.pt") and ranked.current_score == pytest.approx(0.3)
    assert set(ranked.best_k_models) == {str(directory / "best-00000002.pt"), str(directory / "best-00000001.pt")}
    assert all(Path(path).is_file() for path in ranked.best_k_models)


def test_a_best_file_a_resume_cannot_delete_stops_it_in_one_line(tmp_path, monkeypatch):
    """The tidy at a resume deletes best files out of the restored ranking (a kill between a save and last's move
    leaves one); one it cannot delete (an I/O error, a read-only remount) was a bare OSError traceback."""
    import errno
    import os
    import shutil

    keys = {"checkpoint.monitor": "val/score", "checkpoint.save_top_k": 1, "trainer.max_steps": 3}
    run = _fit(tmp_path, SCORES, **keys)
    directory = run.version_dir / "checkpoints"
    shutil.copyfile(directory / "last.pt", directory / "best-00000005.pt")  # out of the ranking
    unlink = Path.unlink

    def failing(path, *args, **kwargs):
        if path.name == "best-00000005.pt":
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", failing)
    with pytest.raises(checkpoint_module.CheckpointError, match=r"could not delete '.*best-00000005.pt' \(a best file"):
        _fit(tmp_path, SCORES, resume="last", **{**keys, "trainer.max_steps": 6})
    assert (directory / "best-00000005.pt").is_file()


def test_a_restored_current_score_that_is_no_number_is_refused_by_name(tmp_path):
    keys = {"checkpoint.monitor": "val/score", "checkpoint.save_top_k": 2, "trainer.max_steps": 3}
    run = _fit(tmp_path, SCORES, **keys)
    last = run.version_dir / "checkpoints" / "last.pt"
    checkpoint = load_checkpoint(last)
    checkpoint["callbacks"]["ModelCheckpoint[val/score]"]["current_score"] = "high"
    torch.save(checkpoint, last)
    with pytest.raises(checkpoint_module.CheckpointError, match=r"current_score 'high', which is no number"):
        _fit(tmp_path, SCORES, resume="last", **{**keys, "trainer.max_steps": 6})
