"""EarlyStopping and best-k checkpointing by a monitored validation metric, both resumable."""

from __future__ import annotations

import re
import warnings
from typing import ClassVar

import pytest
import torch
from toy_trainers import ToyTrainer, toy_cfg

from ampkit import Callback, ConfigError, Phase, consolidate_checkpoint
from ampkit.callbacks import EarlyStopping, ModelCheckpoint
from ampkit.trainer.checkpoint_io import load_checkpoint
from ampkit.trainer.user_code import UserCodeError

# validation after every iteration, none at epoch ends; 8 batches per epoch
EVERY_STEP = {
    "trainer.val_every_n_steps": 1,
    "trainer.val_every_n_epochs": 0,
    "trainer.max_epochs": 3,
    "logging.tensorboard": False,
    "trainer.progress_bar": False,
}


class Scripted(ToyTrainer):
    """Validation reports ``scores[i]`` after iteration ``i + 1`` (so a resumed run sees the same values)."""

    scores: ClassVar[list[float]] = []

    def validation_step(self, batch):
        return {"score": self.scores[self.state.global_step - 1]}


def _fit(tmp_path, scores, resume=None, **overrides) -> Scripted:
    Scripted.scores = scores
    trainer = Scripted(toy_cfg(tmp_path, **EVERY_STEP, **overrides))
    trainer.fit(resume=resume)
    return trainer


@pytest.mark.parametrize(
    ("mode", "min_delta", "scores", "stop_step"),
    [
        ("min", 0.0, [5, 4, 4.5, 4.2, 4.1, 3, 2, 1], 5),  # best 4 at step 2, then three without improvement
        ("min", 0.5, [5, 4.6, 4.4, 4.2, 4.0, 3.95, 1], 6),  # only 4.4 beats its best by more than 0.5
        ("max", 0.0, [1, 2, 3, 3, 2, 2.5, 9], 6),
    ],
)
def test_early_stopping_stops_after_patience_validations_without_improvement(
    tmp_path, mode, min_delta, scores, stop_step
):
    es = {"early_stopping.monitor": "val/score", "early_stopping.mode": mode, "early_stopping.min_delta": min_delta}
    trainer = _fit(tmp_path, scores, **es, **{"early_stopping.patience": 3, "checkpoint.enabled": False})
    assert trainer.state.global_step == stop_step


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("settings", "scores", "stop_step", "reason"),
    [
        ({}, [5, 4, NAN, 3, 2, 1], 3, "val/score is nan, not finite (best was 4.0): the run diverged"),
        ({"early_stopping.mode": "max"}, [1, -INF, 2, 3], 2, "val/score is -inf, not finite (best was 1.0)"),
        ({"early_stopping.check_finite": False}, [5, 4, NAN, 3, 2, 1], 8, None),  # counted, then improved on
        ({"early_stopping.check_finite": False}, [5, NAN, NAN, NAN, 1], 4, "did not improve on 5.0 for 3 valid"),
        ({"early_stopping.stopping_threshold": 2.5}, [5, 4, 3, 2.5, 2, 1], 5, "val/score = 2.0 reached early_st"),
        ({"early_stopping.divergence_threshold": 10}, [5, 4, 10, 11, 1], 4, "val/score = 11.0 is past early_stopp"),
        ({"early_stopping.mode": "max", "early_stopping.stopping_threshold": 3}, [1, 3, 4], 3, "4.0 reached"),
    ],
)  # fmt: skip
def test_early_stopping_stops_at_once_on_a_non_finite_value_or_a_threshold_as_lightning_does(
    tmp_path, capsys, settings, scores, stop_step, reason
):
    """A NaN validation loss counted as one more validation without improvement: a diverged run trained on for
    ``patience`` more validations, and stopped saying only that the metric did not improve."""
    es = {"early_stopping.monitor": "val/score", "early_stopping.patience": 3, "checkpoint.enabled": False}
    trainer = _fit(tmp_path, scores + [0.0] * (8 - len(scores)), **es, **settings, **{"trainer.max_steps": 8})
    assert trainer.state.global_step == stop_step
    if reason is None:
        assert not trainer.state.should_stop
    else:
        assert reason in trainer.state.stop_reason
        assert f"ampkit: early stopping: {trainer.state.stop_reason.removeprefix('early stopping: ')}" in (
            capsys.readouterr().err
        )


def test_a_stop_after_one_validation_without_improvement_words_its_count_in_the_singular(tmp_path):
    """patience=1 stopped saying "for 1 validations": the count goes through the shared wording helper."""
    es = {"early_stopping.monitor": "val/score", "early_stopping.patience": 1, "checkpoint.enabled": False}
    trainer = _fit(tmp_path, [5, 6, 7, 8], **es, **{"trainer.max_steps": 4})
    assert trainer.state.global_step == 2
    assert trainer.state.stop_reason == "early stopping: val/score did not improve on 5.0 for 1 validation"


def test_early_stopping_thresholds_that_would_stop_every_run_are_config_errors_before_training(tmp_path):
    for settings, message in [
        ({"early_stopping.stopping_threshold": "nan"}, "'early_stopping.stopping_threshold': nan is invalid"),
        ({"early_stopping.stopping_threshold": 5, "early_stopping.divergence_threshold": 4},
         "stopping_threshold 5.0 is not better than divergence_threshold 4.0 in mode 'min'"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(message)):
            ToyTrainer(toy_cfg(tmp_path, **{"early_stopping.monitor": "val/mse", **settings})).fit()


class _ValidatedAt(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_validation_end(self, trainer, metrics) -> None:
        if trainer.state.stage == "fit":
            self.steps.append(trainer.state.global_step)


def test_an_epoch_end_just_validated_by_val_every_n_steps_is_not_validated_again(tmp_path):
    """Steps 8 and 16 end the epochs: validated twice on the same weights, each counting against the patience
    (early stopping stopped at step 8, after two validations of one model, where patience 2 means 4 and 8 and 12)."""
    spy = _ValidatedAt()
    settings = {**EVERY_STEP, "trainer.val_every_n_steps": 4, "trainer.val_every_n_epochs": 1, "trainer.max_epochs": 2}
    Scripted.scores = [3.0] * 16
    Scripted(toy_cfg(tmp_path / "all", **settings), callbacks=[spy]).fit()
    assert spy.steps == [4, 8, 12, 16]
    es = {"early_stopping.monitor": "val/score", "early_stopping.patience": 2, "checkpoint.enabled": False}
    stopped = Scripted(toy_cfg(tmp_path / "es", **settings, **es))
    stopped.fit()
    assert stopped.state.global_step == 12


def test_early_stopping_resumes_its_count(tmp_path):
    scores = [5, 4, 4.5, 4.2, 4.1, 3, 2, 1]
    es = {"early_stopping.monitor": "score", "early_stopping.patience": 3, "checkpoint.every_n_steps": 1}
    _fit(tmp_path, scores, **es, **{"trainer.max_steps": 4})  # stopped by max_steps, two validations waited
    resumed = _fit(tmp_path, scores, resume="last", **es)
    assert resumed.state.global_step == 5  # the third validation without improvement, as uninterrupted


def test_best_k_keeps_the_top_files_and_best_pt_names_the_best(tmp_path):
    scores = [5, 3, 4, 1, 2, 6]
    best = {"checkpoint.monitor": "val/score", "checkpoint.save_top_k": 2, "trainer.max_steps": 6}
    trainer = _fit(tmp_path, scores, **best)
    checkpoints = trainer.version_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("best*.pt")) == ["best-00000004.pt", "best-00000005.pt", "best.pt"]
    assert load_checkpoint(checkpoints / "best.pt")["loop"]["global_step"] == 4
    assert load_checkpoint(checkpoints / "last.pt")["callbacks"]["ModelCheckpoint[val/score]"]["best_k"] == {
        "best-00000004.pt": 1.0,
        "best-00000005.pt": 2.0,
    }


def test_save_top_k_minus_one_keeps_every_validation_as_in_lightning(tmp_path):
    scores = [5, 3, 4, 1, 2, float("nan")]  # a NaN is never among the best
    trainer = _fit(
        tmp_path, scores, **{"checkpoint.monitor": "val/score", "checkpoint.save_top_k": -1, "trainer.max_steps": 6}
    )
    checkpoints = trainer.version_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("best-*.pt")) == [f"best-{step:08d}.pt" for step in range(1, 6)]
    assert load_checkpoint(checkpoints / "best.pt")["loop"]["global_step"] == 4


def test_best_k_ranking_survives_a_resume(tmp_path):
    scores = [5, 3, 4, 1, 2, 6]
    best = {"checkpoint.monitor": "val/score", "checkpoint.save_top_k": 2, "checkpoint.mode": "max"}
    _fit(tmp_path, scores, **best, **{"trainer.max_steps": 3})
    resumed = _fit(tmp_path, scores, resume="last", **best, **{"trainer.max_steps": 6})
    checkpoints = resumed.version_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("best-*.pt")) == ["best-00000001.pt", "best-00000006.pt"]
    assert load_checkpoint(checkpoints / "best.pt")["loop"]["global_step"] == 6


def test_a_resume_with_another_monitor_mode_ranks_afresh_and_keeps_the_earlier_best_files(tmp_path):
    """The restored ranking was measured the other way round: best-k starts a new one (best.pt its best), and the
    files ranked before are neither compared with the new values nor pruned."""
    scores = [5, 3, 4, 1, 2, 6, 0]
    best = {"checkpoint.monitor": "val/score", "checkpoint.save_top_k": 2}
    _fit(tmp_path, scores, **best, **{"trainer.max_steps": 3})  # min: best-2 (3) and best-3 (4)
    with pytest.warns(UserWarning, match=r"val/score \(min\) -> val/score \(max\).*\(best-00000002.pt, best-00"):
        resumed = _fit(tmp_path, scores, resume="last", **best, **{"checkpoint.mode": "max", "trainer.max_steps": 6})
    checkpoints = resumed.version_dir / "checkpoints"
    names = sorted(p.name for p in checkpoints.glob("best-*.pt"))
    assert names == ["best-00000002.pt", "best-00000003.pt", "best-00000005.pt", "best-00000006.pt"]
    assert load_checkpoint(checkpoints / "best.pt")["loop"]["global_step"] == 6
    _fit(tmp_path, scores, resume="last", **best, **{"checkpoint.mode": "max", "trainer.max_steps": 7})
    assert sorted(p.name for p in checkpoints.glob("best-*.pt")) == names  # the kept files survive a resume's tidying


def test_early_stopping_resumed_with_another_mode_counts_afresh(tmp_path):
    scores = [5, 4, 3, 2, 1.5, 1, 0.5, 0.2, 0.1]
    es = {"early_stopping.monitor": "val/score", "early_stopping.patience": 3, "checkpoint.every_n_steps": 1}
    _fit(tmp_path, scores, **es, **{"trainer.max_steps": 3})  # min: best 3 at step 3
    with pytest.warns(UserWarning, match=r"early_stopping.monitor or mode changed.*\(val/score \(min\) -> val/"):
        resumed = _fit(tmp_path, scores, resume="last", **es, **{"early_stopping.mode": "max"})
    assert resumed.state.global_step == 7  # best 2 at step 4, then three validations without improvement


def test_a_checkpoint_keyed_by_class_name_still_resumes_early_stopping_and_the_best_k_ranking(tmp_path):
    """An older ampkit saved EarlyStopping's and ModelCheckpoint's states under their class names; now keyed by their
    monitor, each still finds its own: the count stops the resumed run as an uninterrupted one, the ranking keeps its
    files, and no warning says a state was not restored."""
    scores = [5, 4, 4.5, 4.2, 4.1, 3, 2, 1]
    es = {"early_stopping.monitor": "val/score", "early_stopping.patience": 3, "checkpoint.monitor": "val/score",
          "checkpoint.save_top_k": 2}  # fmt: skip
    last = _fit(tmp_path, scores, **es, **{"trainer.max_steps": 4}).version_dir / "checkpoints" / "last.pt"
    checkpoint = torch.load(last, weights_only=True)
    for name in ("EarlyStopping", "ModelCheckpoint"):
        checkpoint["callbacks"][name] = checkpoint["callbacks"].pop(f"{name}[val/score]")
    torch.save(checkpoint, last)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _fit(tmp_path, scores, resume="last", **es)
    assert not [w for w in caught if "not restored" in str(w.message)]
    assert resumed.state.global_step == 5  # the third validation without improvement on 4 (step 2)
    checkpoints = resumed.version_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("best-*.pt")) == ["best-00000002.pt", "best-00000005.pt"]


def test_a_subclass_resumed_with_another_monitor_gets_its_state_as_the_class_it_extends_does(tmp_path):
    """A subclass of EarlyStopping is keyed as EarlyStopping[val/score]; resumed watching another metric, its state was
    looked up by the subclass's own name, so it was left unrestored with a warning, where a plain EarlyStopping's is
    handed over and counts afresh, saying why."""

    class Patient(EarlyStopping):
        pass

    class TwoScores(Scripted):
        def validation_step(self, batch):
            score = self.scores[self.state.global_step - 1]
            return {"score": score, "neg": -score}

    def fit(max_steps, monitor, resume=None):
        TwoScores.scores = [5, 4, 3, 2, 1.5, 1, 0.5, 0.2, 0.1]
        settings = {**EVERY_STEP, "checkpoint.every_n_steps": 1, "trainer.max_steps": max_steps}
        run = TwoScores(toy_cfg(tmp_path, **settings), callbacks=[Patient(monitor, patience=3)])
        run.fit(resume=resume)
        return run

    fit(3, "val/score")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = fit(9, "val/neg", resume="last")
    said = [str(w.message) for w in caught]
    assert not [line for line in said if "not restored" in line], said
    assert [line for line in said if "early_stopping.monitor or mode changed" in line], said
    assert resumed.state.global_step == 7  # best -2 at step 4, then three validations without improvement


def test_a_subclass_finds_the_state_an_older_ampkit_keyed_by_its_own_class_name():
    """Before states were keyed by their monitor, a subclass's was saved under its own name (Patient); keyed now as
    the class it extends, it still finds that one, as it finds EarlyStopping[<another metric>]."""
    from ampkit.trainer.callback_states import states_to_load

    class Patient(EarlyStopping):
        pass

    stopper = Patient("val/score")
    assert states_to_load([stopper], {"Patient": {"best": 1.0}}) == [(stopper, "Patient")]
    assert states_to_load([stopper], {"EarlyStopping[val/x]": {}}) == [(stopper, "EarlyStopping[val/x]")]
    assert states_to_load([stopper], {"Other": {}}) == []


def test_two_early_stoppings_on_other_metrics_each_resume_their_own_count(tmp_path):
    """As Lightning's, keyed by their monitor: they were refused as one state_key. 'score' improves at every step,
    'neg' never after step 1: resumed at step 3, each goes on counting from where it was, and the one whose patience
    runs out stops the run, as Lightning stops at the first of several to ask."""

    class TwoScores(Scripted):
        def validation_step(self, batch):
            score = self.scores[self.state.global_step - 1]
            return {"score": score, "neg": -score}

    def fit(max_steps, resume=None):
        stoppers = [EarlyStopping("val/score", patience=3), EarlyStopping("val/neg", patience=3)]
        TwoScores.scores = [5, 4, 3, 2, 1, 0]
        run = TwoScores(toy_cfg(tmp_path, **EVERY_STEP, **{"trainer.max_steps": max_steps}), callbacks=stoppers)
        run.fit(resume=resume)
        return [(es.best, es.wait) for es in stoppers], run.state

    assert fit(3)[0] == [(3, 0), (-5, 2)]
    counts, state = fit(6, resume="last")
    assert counts == [(2, 0), (-5, 3)] and state.global_step == 4
    assert state.stop_reason.startswith("early stopping: val/neg did not improve on -5.0 for 3 validations")


def test_validate_best_loads_the_best_checkpoint(tmp_path):
    seen: list[float] = []

    class Record(Callback):
        def on_validation_end(self, trainer, metrics):
            if trainer.state.stage == "fit":  # not the sanity validation before training
                seen.append(metrics["mse"])

    cfg = toy_cfg(tmp_path, **EVERY_STEP, **{"checkpoint.monitor": "val/mse", "trainer.max_steps": 10})
    ToyTrainer(cfg, callbacks=[Record()]).fit()
    assert ToyTrainer(cfg).validate(ckpt="best")["mse"] == min(seen)


def test_bad_monitor_settings_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"config key 'checkpoint.mode': Invalid value 'lowest'"):
        ToyTrainer(toy_cfg(tmp_path, **{"checkpoint.mode": "lowest"}))
    with pytest.raises(ConfigError, match=r"'early_stopping.patience': 0 is invalid; expected an integer >= 1"):
        ToyTrainer(toy_cfg(tmp_path, **{"early_stopping.patience": 0}))
    without_sanity = {**EVERY_STEP, "early_stopping.monitor": "val/acc", "trainer.num_sanity_val_steps": 0}
    with pytest.raises(
        KeyError, match=r"'early_stopping.monitor': 'val/acc' is not a metric of the validation at step 1"
    ):
        ToyTrainer(toy_cfg(tmp_path, **without_sanity)).fit()


class CountsBatches(Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_start(self, trainer, batch) -> None:
        self.batches += 1


@pytest.mark.parametrize(
    ("build", "said"),
    [
        (lambda: ModelCheckpoint(monitor="val/mse_typo"), "ModelCheckpoint(monitor='val/mse_typo'): monitors "
                                                          "'val/mse_typo', which is not a validation metric; "
                                                          "validation_step returns val/mse"),
        (lambda: EarlyStopping("val/acc", mode="max"), "EarlyStopping(monitor='val/acc'): monitors 'val/acc'"),
        (lambda: ModelCheckpoint(monitor="epoch", mode="max", save_top_k=2), "Lightning's 'epoch' and 'step' are its "
                                                                            "loop counters, which no validation "
                                                                            "returns here: to keep the newest k "
                                                                            "checkpoints, give ModelCheckpoint no "
                                                                            "monitor and keep_last=k"),
    ],
)  # fmt: skip
def test_a_monitor_of_a_callback_given_in_code_is_checked_before_training_as_the_config_s_is(tmp_path, build, said):
    """The sanity validation checked the config's monitors only: a Lightning port's ModelCheckpoint(monitor=...)
    in callbacks=[...] with a name no validation returns failed after a whole epoch of training, its message naming
    config key 'checkpoint.monitor', which the port never set."""
    counts = CountsBatches()
    with pytest.raises(ConfigError) as caught:
        ToyTrainer(toy_cfg(tmp_path, **{**EVERY_STEP, "checkpoint.enabled": False}), callbacks=[build(), counts]).fit()
    assert said in str(caught.value) and "config key" not in str(caught.value)
    assert counts.batches == 0


def test_a_monitor_given_in_code_that_a_validation_lacks_names_no_config_key(tmp_path):
    without_sanity = {**EVERY_STEP, "trainer.num_sanity_val_steps": 0}
    with pytest.raises(KeyError, match=r"monitor: 'val/acc' is not a metric of the validation at step 1") as caught:
        ToyTrainer(toy_cfg(tmp_path, **without_sanity), callbacks=[EarlyStopping("val/acc")]).fit()
    assert "config key" not in str(caught.value)


class ScoreOnlyAtFirst(Scripted):
    """Returns ``score`` in the sanity pass and at the first validations, then forgets it."""

    def validation_step(self, batch):
        step = self.state.global_step
        return {"score": 1.0 / (step + 1)} if step < 3 else {"other": 0.0}


@pytest.mark.parametrize("key", ["checkpoint.monitor", "early_stopping.monitor"])
def test_a_monitored_metric_missing_from_a_later_validation_is_one_line_and_keeps_the_checkpoints(tmp_path, key):
    """The sanity pass saw the metric, a later validation lacks it: a user error (the CLI prints one line, not a
    KeyError traceback) naming the key, the step and what was returned; the checkpoints before it stay."""
    cfg = toy_cfg(tmp_path, **EVERY_STEP, **{key: "val/score", "checkpoint.every_n_steps": 1})
    message = f"config key '{key}': 'val/score' is not a metric of the validation at step 3, which returned val/other"
    with pytest.raises(UserCodeError, match=re.escape(message)):
        ScoreOnlyAtFirst(cfg).fit()
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    assert load_checkpoint(checkpoints / "last.pt")["loop"]["global_step"] == 2


def test_a_sharded_best_k_directory_a_kill_left_outside_the_ranking_goes_at_the_resume(tmp_path):
    """A kill after a new best directory was written and ``best`` linked to it, before ``last`` moved (or before the
    one it pushed out went), left a whole model and optimizer state that no pruning ever removed (only best-N.pt
    files were tidied); the resume removes it and links ``best`` to the restored ranking's best again."""
    import shutil

    best = {"checkpoint.monitor": "val/score", "checkpoint.save_top_k": 2, "checkpoint.every_n_epochs": 0,
            "distributed.strategy": "fsdp", "trainer.device": "cpu"}  # fmt: skip
    scores = [5, 3, 4, 9]
    checkpoints = _fit(tmp_path, scores, **best, **{"trainer.max_steps": 3}).version_dir / "checkpoints"
    shutil.copytree(checkpoints / "best-00000002", checkpoints / "best-00000099")  # as the killed save wrote it
    (checkpoints / "best").unlink()
    (checkpoints / "best").symlink_to("best-00000099")
    _fit(tmp_path, scores, resume="last", **best, **{"trainer.max_steps": 4})  # step 4 is not among the best
    assert sorted(p.name for p in checkpoints.glob("best*")) == ["best", "best-00000002", "best-00000003"]
    assert (checkpoints / "best").resolve().name == "best-00000002"


def test_a_sharded_checkpoint_leaving_the_ranking_keeps_the_file_the_user_put_in_it(tmp_path):
    """A best-k directory pushed out of the top k was deleted whole, with the evaluation results the user had saved
    in it; only the checkpoint's own files go, and the user's stay under its name, named in a warning."""
    best = {"checkpoint.monitor": "val/score", "checkpoint.save_top_k": 2, "checkpoint.every_n_epochs": 0,
            "distributed.strategy": "fsdp", "trainer.device": "cpu"}  # fmt: skip
    scores = [5, 3, 4]
    checkpoints = _fit(tmp_path, scores, **best, **{"trainer.max_steps": 2}).version_dir / "checkpoints"
    (checkpoints / "best-00000001" / "eval.json").write_text('{"accuracy": 0.5}')
    with pytest.warns(UserWarning, match=r"best-00000001' held eval.json beside the checkpoint"):
        _fit(tmp_path, scores, resume="last", **best, **{"trainer.max_steps": 3})  # step 3's 4 pushes out step 1's 5
    assert [p.name for p in (checkpoints / "best-00000001").iterdir()] == ["eval.json"]
    assert (checkpoints / "best-00000001" / "eval.json").read_text() == '{"accuracy": 0.5}'
    assert sorted(p.name for p in checkpoints.glob("best-*")) == ["best-00000001", "best-00000002", "best-00000003"]
    assert (checkpoints / "best").resolve().name == "best-00000002"


def test_best_k_under_fsdp_keeps_directories_and_best_links_the_best(tmp_path):
    scores = [5, 3, 4, 1, 2, 6]
    best = {"checkpoint.monitor": "val/score", "checkpoint.save_top_k": 2, "trainer.max_steps": 6,
            "checkpoint.every_n_epochs": 0, "distributed.strategy": "fsdp", "trainer.device": "cpu"}  # fmt: skip
    trainer = _fit(tmp_path, scores, **best)
    checkpoints = trainer.version_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("best*")) == ["best", "best-00000004", "best-00000005"]
    assert (checkpoints / "best").is_symlink() and (checkpoints / "best").resolve().name == "best-00000004"
    assert (checkpoints / "best-00000004" / ".metadata").is_file()
    weights = consolidate_checkpoint(checkpoints / "best")
    sharded = Scripted(toy_cfg(tmp_path, **EVERY_STEP, **best))
    sharded.validate(ckpt="best")  # the shards loaded into a sharded model
    plain = Scripted(toy_cfg(tmp_path / "plain", **EVERY_STEP))
    plain.validate(ckpt=checkpoints / "best")  # consolidated into a plain one
    for key, value in weights.items():
        torch.testing.assert_close(sharded.module.state_dict()[key].full_tensor(), value)
        torch.testing.assert_close(plain.module.state_dict()[key], value)


class LogsScoreAtValidationEnd(Scripted):
    """validation_step returns no monitored metric; the Trainer's own on_validation_end logs ``val/score`` (an AUC
    computed over the whole set, as a Lightning port logs one in on_validation_epoch_end)."""

    def validation_step(self, batch):
        return {"other": 0.0}

    def on_validation_end(self, metrics):
        fit = self.state.stage == "fit"  # the sanity pass (before any step) logs one too, proving the hook does
        self.log("val/score", torch.tensor(self.scores[self.state.global_step - 1] if fit else 0.0))


class _LogsAuc(Callback):
    def on_validation_end(self, trainer, metrics):
        trainer.log("val_auc", Scripted.scores[trainer.state.global_step - 1] if trainer.state.stage == "fit" else 0)


def test_a_value_logged_in_on_validation_end_is_monitored_by_early_stopping_and_best_k(tmp_path):
    """As Lightning monitors what is logged by the time its monitors run: EarlyStopping runs after the Trainer's own
    on_validation_end (PERSIST), so it counts what that hook logs, and best-k ranks it."""
    scores = [5, 4, 4.5, 4.2, 4.1, 3, 2, 1]
    monitored = {"early_stopping.monitor": "val/score", "checkpoint.monitor": "val/score"}
    LogsScoreAtValidationEnd.scores = scores
    trainer = LogsScoreAtValidationEnd(toy_cfg(tmp_path, **EVERY_STEP, **monitored, **{"checkpoint.save_top_k": 2}))
    trainer.fit()
    assert trainer.state.global_step == 5  # the same stop as a validation_step returning the score
    checkpoints = trainer.version_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("best-*.pt")) == ["best-00000002.pt", "best-00000005.pt"]
    assert load_checkpoint(checkpoints / "last.pt")["validation_end_values"] == {"val/score": pytest.approx(4.1)}


def test_a_tag_a_callback_logs_in_on_validation_end_is_monitored_and_the_sanity_pass_accepts_it(tmp_path):
    """A callback given after the config's EarlyStopping logs Lightning's ``val_auc``: it is still counted."""
    Scripted.scores = [1, 2, 3, 3, 2, 2.5, 9]
    es = {"early_stopping.monitor": "val_auc", "early_stopping.mode": "max", "trainer.num_sanity_val_steps": 2}
    trainer = Scripted(toy_cfg(tmp_path, **EVERY_STEP, **es), callbacks=[_LogsAuc()])
    trainer.fit()
    assert trainer.state.global_step == 6


class _LogsAucOutsideSanity(Callback):
    """Lightning's idiom: ``if trainer.sanity_checking: return`` before logging a whole-set metric."""

    def on_validation_end(self, trainer, metrics):
        if trainer.state.stage == "sanity":
            return
        trainer.log("val_auc", Scripted.scores[trainer.state.global_step - 1])


def test_a_hook_that_skips_the_sanity_pass_is_told_how_to_train_with_its_monitor(tmp_path):
    """A monitored tag logged only outside the sanity pass is refused before training (a misspelt one would fail a
    whole epoch later), and the message says what to change rather than only to log it, which the hook does."""

    Scripted.scores = [1, 2, 3, 3, 2, 2.5, 9]
    code_given = [_LogsAucOutsideSanity(), EarlyStopping(monitor="val_auc", mode="max", patience=3)]
    cfg = toy_cfg(tmp_path, **EVERY_STEP, **{"trainer.num_sanity_val_steps": 2})
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "state.stage == 'sanity', must log it there too; trainer.num_sanity_val_steps=0 skips this check"
        ),
    ):
        Scripted(cfg, callbacks=code_given).fit()
    cfg = toy_cfg(tmp_path / "again", **EVERY_STEP, **{"trainer.num_sanity_val_steps": 0})
    trainer = Scripted(
        cfg, callbacks=[_LogsAucOutsideSanity(), EarlyStopping(monitor="val_auc", mode="max", patience=3)]
    )
    trainer.fit()
    assert trainer.state.global_step == 6  # the best (3) at step 3, three without a gain: the stop the hint promises


class _SavesAndLogsAuc(_LogsAuc):
    """A checkpoint writer of the user's (it saves a file of its own) that also logs ``val_auc``."""

    phase = Phase.PERSIST
    saves_checkpoints = True


def test_best_k_ranks_a_value_another_checkpoint_writer_logs_wherever_it_stands_in_the_list(tmp_path):
    """A checkpoint writer of the user's that logs the monitored value, given after the config's ModelCheckpoint, ran
    after it by its place in the list: the first validation failed with 'not a metric of the validation'. Lightning
    runs ModelCheckpoint last; so does ampkit among the checkpoint writers, whatever the list's order."""
    Scripted.scores = [5, 3, 4, 1, 2, 6]
    best = {"checkpoint.monitor": "val_auc", "checkpoint.save_top_k": 2, "trainer.max_steps": 6}
    trainer = Scripted(toy_cfg(tmp_path, **EVERY_STEP, **best), callbacks=[_SavesAndLogsAuc()])
    trainer.fit()
    checkpoints = trainer.version_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("best*.pt")) == ["best-00000004.pt", "best-00000005.pt", "best.pt"]
    assert [type(cb).__name__ for cb in trainer.callbacks][-2:] == ["_SavesAndLogsAuc", "ModelCheckpoint"]


def test_a_monitor_neither_returned_nor_logged_at_validation_end_names_both(tmp_path):
    LogsScoreAtValidationEnd.scores = [1.0] * 8
    cfg = toy_cfg(tmp_path, **EVERY_STEP, **{"early_stopping.monitor": "val/auc", "trainer.num_sanity_val_steps": 0})
    message = (
        "'val/auc' is not a metric of the validation at step 1, which returned val/other and logged val/score in "
        "on_validation_end; validation_step must return a monitored metric at every validation, or a callback or "
        "the Trainer log it in on_validation_end with self.log('val/auc', value)"
    )
    with pytest.raises(UserCodeError, match=re.escape(message)):
        LogsScoreAtValidationEnd(cfg).fit()
