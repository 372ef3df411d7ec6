"""The loop's limits keep the contract Lightning users know: ``max_epochs`` and ``max_steps`` together end the run at
whichever comes first (``max_epochs=-1``: no epoch limit), ``limit_*_batches`` take a count or a fraction of the
batches, validation runs every ``val_every_n_epochs`` epochs and every ``val_every_n_steps`` iterations, the sanity
validation runs ``num_sanity_val_steps`` batches (-1: all) within ``limit_val_batches``, an epoch cut short by
``max_steps`` is not validated, and a resumed run goes on with the batch indices and global steps an uninterrupted one
would have."""

from __future__ import annotations

import warnings

import pytest
import torch
from toy_trainers import ToyTrainer, toy_cfg, toy_dataset

from ampkit import Callback, ConfigError

QUIET = {"checkpoint.enabled": False, "logging.tensorboard": False, "trainer.progress_bar": False,
         "logging.throughput": False}  # fmt: skip


class Positions(Callback):
    """(stage, epoch, batch_idx, global_step) at each training batch's start, each validation and each epoch end."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, int, int]] = []
        self.validations: list[tuple[str, int, int]] = []  # (stage, global_step, batches_done)
        self.epoch_ends: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer, batch) -> None:
        s = trainer.state
        self.batches.append((s.epoch, s.batch_idx, s.global_step))

    def on_validation_end(self, trainer, metrics) -> None:
        self.validations.append((trainer.state.stage, trainer.state.global_step, trainer.state.batches_done))

    def on_train_epoch_end(self, trainer) -> None:
        self.epoch_ends.append((trainer.state.epoch, trainer.state.global_step))


class CountsValidationBatches(ToyTrainer):
    """Records the size of every validation batch; the validation set is 24 samples in batches of 8."""

    def validation_step(self, batch):
        self.validation_batches.append(batch[0].shape[0])
        return super().validation_step(batch)


def _fit(tmp_path, trainer_class=CountsValidationBatches, resume=None, **overrides):
    positions = Positions()
    trainer = trainer_class(toy_cfg(tmp_path, **{**QUIET, **overrides}), callbacks=[positions])
    trainer.validation_batches = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # settings a short run never reaches are named; these tests mean them
        trainer.fit(resume=resume)
    return trainer, positions


@pytest.mark.parametrize(
    ("max_epochs", "max_steps", "steps", "epochs_ended"),
    [(2, -1, 16, 2), (2, 5, 5, 0), (2, 100, 16, 2), (3, 8, 8, 1), (3, 12, 12, 1), (0, 5, 0, 0), (2, 0, 0, 0)],
)
def test_max_epochs_and_max_steps_end_the_run_at_whichever_comes_first(tmp_path, max_epochs, max_steps, steps,
                                                                        epochs_ended):  # fmt: skip
    """Eight batches an epoch. A limit of 0 trains nothing, as in Lightning; an epoch max_steps ends in its middle
    ends too (on_train_epoch_end), unfinished."""
    overrides = {"trainer.max_epochs": max_epochs, "trainer.max_steps": max_steps, "trainer.num_sanity_val_steps": 0}
    trainer, positions = _fit(tmp_path, **overrides)
    assert trainer.state.global_step == len(positions.batches) == steps
    assert len(positions.epoch_ends) == -(-steps // 8)
    assert sum(step % 8 == 0 for _, step in positions.epoch_ends) == epochs_ended
    assert trainer.state.epoch == epochs_ended  # whole epochs: Lightning's current_epoch counts a cut one too


def test_max_epochs_minus_one_leaves_the_run_s_length_to_max_steps_as_in_lightning(tmp_path):
    """20 steps of 8-batch epochs: two epochs and a half; a resume of the finished run trains nothing."""
    settings = {"trainer.max_epochs": -1, "trainer.max_steps": 20, "trainer.num_sanity_val_steps": 0}
    trainer, positions = _fit(tmp_path, **settings, **{"checkpoint.enabled": True})
    assert trainer.num_training_steps == trainer.state.global_step == 20
    assert positions.epoch_ends == [(0, 8), (1, 16), (2, 20)]
    again, positions = _fit(tmp_path, resume="last", **settings, **{"checkpoint.enabled": True})
    assert again.state.global_step == 20 and positions.batches == []


def test_a_max_steps_that_max_epochs_ends_before_is_named_at_fit_start(tmp_path):
    """Lightning's max_steps alone trains that many steps (its max_epochs then has no limit); here the default
    max_epochs=1 ended the run after 8 steps without a word."""
    trainer = ToyTrainer(toy_cfg(tmp_path, **{**QUIET, "trainer.max_steps": 100}))
    with pytest.warns(UserWarning, match=r"trainer.max_steps=100 is never reached: trainer.max_epochs=1 ends the run "
                      r"after 8 steps \(Lightning's max_steps alone lifts its epoch limit; here set "
                      r"trainer.max_epochs=-1 for none, or raise it\)"):  # fmt: skip
        trainer.fit()
    assert trainer.state.global_step == 8


def test_an_epoch_max_steps_cuts_short_is_neither_validated_nor_steps_an_epoch_scheduler(tmp_path):
    class EpochDecay(CountsValidationBatches):
        def configure_optimizers(self):
            sgd = torch.optim.SGD(self.module.parameters(), lr=0.1)
            self.decay = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
            return {"optimizer": sgd, "lr_scheduler": self.decay}

    trainer, positions = _fit(tmp_path, EpochDecay, **{"trainer.max_epochs": 3, "trainer.max_steps": 12,
                                                       "trainer.num_sanity_val_steps": 0})  # fmt: skip
    assert positions.validations == [("fit", 8, 8)]  # after the first epoch only
    assert positions.epoch_ends == [(0, 8), (1, 12)]
    assert trainer.decay.last_epoch == 1
    assert trainer.loop_position() == {"epoch": 1, "batches_done": 4, "global_step": 12}


@pytest.mark.parametrize(
    ("limit", "batches"), [(3, 3), (100, 8), (0.5, 4), (0.3, 2), (1.0, 8), (1, 1)]
)  # fmt: skip
def test_limit_train_batches_takes_a_count_or_a_fraction_of_the_epoch(tmp_path, limit, batches):
    """0.3 of 8 batches is 2 (rounded down, as Lightning's); 1.0 is every batch but 1 is one batch."""
    trainer, positions = _fit(tmp_path, **{"trainer.limit_train_batches": limit, "trainer.max_epochs": 2,
                                           "trainer.num_sanity_val_steps": 0})  # fmt: skip
    assert trainer.num_train_batches == batches
    assert [(epoch, index) for epoch, index, _ in positions.batches] == [(e, i) for e in (0, 1) for i in range(batches)]
    assert trainer.num_training_steps == trainer.state.global_step == 2 * batches


@pytest.mark.parametrize(("limit", "sizes"), [("null", [8, 8, 8]), (2, [8, 8]), (0.5, [8]), (1.0, [8, 8, 8])])
def test_limit_val_batches_takes_a_count_or_a_fraction_and_the_average_covers_only_those(tmp_path, limit, sizes):
    trainer, _ = _fit(tmp_path, **{"trainer.limit_val_batches": limit, "trainer.max_steps": 8,
                                   "trainer.num_sanity_val_steps": 0})  # fmt: skip
    assert trainer.validation_batches == sizes
    assert trainer.num_val_batches == len(sizes)
    x, y = next(iter(trainer.val_dataloader()))  # the first batch alone, for the single-batch limit
    if len(sizes) == 1:
        with torch.no_grad():
            trainer.module.eval()
            mse = torch.nn.functional.mse_loss(trainer.module(x).squeeze(1), y).item()
        assert trainer.val_metrics["mse"] == pytest.approx(mse)


@pytest.mark.parametrize(("limit", "sizes"), [(2, [8, 8]), (0.5, [8]), ("null", [8, 8, 8])])
def test_a_standalone_validate_covers_the_batches_limit_val_batches_leaves_as_fit_s_validations_do(
    tmp_path, limit, sizes
):
    """Lightning's trainer.validate() honours limit_val_batches; validate() ran every batch of the set, so its means
    were not those of the validations of the fit it evaluates."""
    trainer = CountsValidationBatches(toy_cfg(tmp_path, **{**QUIET, "trainer.limit_val_batches": limit}))
    trainer.validation_batches = []
    metrics = trainer.validate()
    assert trainer.validation_batches == sizes and set(metrics) == {"mse"}


class ShuffledValidation(ToyTrainer):
    def val_dataloader(self):
        return torch.utils.data.DataLoader(toy_dataset(24), batch_size=8, shuffle=True)


@pytest.mark.parametrize(("trainer_class", "limit", "said"), [
    (ShuffledValidation, 2, "val_dataloader() shuffles its samples (RandomSampler) and trainer.limit_val_batches=2 "
                            "runs 2 of its 3 batches: each validation measures other samples"),
    (ShuffledValidation, 3, None),  # every batch: the same samples, in another order
    (ToyTrainer, 2, None),  # unshuffled: the same first 2 batches each time
])  # fmt: skip
def test_a_shuffled_validation_set_cut_by_limit_val_batches_is_said_to_measure_other_samples_each_time(
    tmp_path, trainer_class, limit, said
):
    """Each validation took the first 2 batches of another shuffle: a best checkpoint ranked noise, without a word."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer_class(toy_cfg(tmp_path, **{**QUIET, "trainer.limit_val_batches": limit, "trainer.max_steps": 1})).fit()
    shuffles = [str(w.message) for w in seen if "shuffles its samples" in str(w.message)]
    assert len(shuffles) == (said is not None) and all(said in message for message in shuffles)


class Stream:
    """Batches without a length (an IterableDataset's loader)."""

    def __iter__(self):
        yield from torch.utils.data.DataLoader(toy_dataset(32), batch_size=8)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "trainer.limit_train_batches",
            0.1,
            r"0.1 of train_dataloader\(\)'s 8 batches is less than one batch; give at least 0.125",
        ),
        ("trainer.limit_val_batches", 0.2, r"0.2 of val_dataloader\(\)'s 3 batches is less than one batch"),
    ],
)
def test_a_fraction_that_leaves_no_batch_is_refused_naming_the_least_that_would_do(tmp_path, key, value, message):
    trainer = CountsValidationBatches(toy_cfg(tmp_path, **{**QUIET, key: value}))
    with pytest.raises(ConfigError, match=f"config key '{key}': {message}"):
        trainer.fit()
    assert trainer.state.global_step == 0


def test_a_fraction_of_a_loader_without_a_length_is_refused_asking_for_a_count(tmp_path):
    class Streaming(ToyTrainer):
        def train_dataloader(self):
            return Stream()

    trainer = Streaming(toy_cfg(tmp_path, **{**QUIET, "trainer.limit_train_batches": 0.5}))
    with pytest.raises(ConfigError, match=r"0.5 is a fraction of the batches, but train_dataloader\(\) has no length"):
        trainer.fit()
    # 1.0 is every batch, which needs no length: the stream's 4 batches train
    trainer = Streaming(toy_cfg(tmp_path, **{**QUIET, "trainer.limit_train_batches": 1.0, "trainer.max_epochs": 1}))
    trainer.fit()
    assert trainer.state.global_step == 4


@pytest.mark.parametrize(
    ("value", "message"),
    [(0, r"0 is invalid; expected null \(all batches; ampkit validate validates alone\) or an integer >= 1 "
         r"\(batches\) or a fraction in \(0.0, 1.0\]"),
     (1.5, r"1.5 is invalid"), (0.0, r"0.0 is invalid"), (-2, r"-2 is invalid")],
)  # fmt: skip
def test_a_limit_that_is_neither_a_count_nor_a_fraction_is_refused_at_construction(tmp_path, value, message):
    with pytest.raises(ConfigError, match=f"'trainer.limit_train_batches': {message}"):
        ToyTrainer(toy_cfg(tmp_path, **{"trainer.limit_train_batches": value}))


def test_a_max_epochs_below_minus_one_is_refused_naming_what_minus_one_means(tmp_path):
    with pytest.raises(ConfigError, match=r"'trainer.max_epochs': -2 is invalid; expected -1 \(no limit: max_steps, "
                       r"max_time or a stop ends the run\) or >= 0"):  # fmt: skip
        ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_epochs": -2}))


@pytest.mark.parametrize(("overrides", "counted"), [({}, 3), ({"trainer.val_every_n_epochs": 0}, 0)])
def test_num_val_batches_is_unknown_before_the_set_up_and_0_where_the_fit_never_validates(tmp_path, overrides, counted):
    """Lightning's num_val_batches counts 0 under limit_val_batches=0 (here: val_every_n_epochs=0); read before the
    fit it was an AttributeError naming a private attribute, and with validation off it counted the loader's 3."""
    seen = []

    class Reads(Callback):
        def on_fit_start(self, trainer) -> None:
            seen.append(trainer.num_val_batches)

    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET, **overrides), callbacks=[Reads()])
    assert trainer.num_val_batches is None
    trainer.fit()
    assert seen == [counted] and trainer.num_val_batches == counted


def test_validation_runs_after_every_nth_epoch_and_not_after_a_last_epoch_off_the_interval(tmp_path):
    _, positions = _fit(tmp_path, **{"data.n": 16, "trainer.max_epochs": 5, "trainer.val_every_n_epochs": 2,
                                     "trainer.num_sanity_val_steps": 0})  # fmt: skip
    assert positions.validations == [("fit", 4, 2), ("fit", 8, 2)]


def test_val_every_n_steps_counts_iterations_over_the_run_not_batches(tmp_path):
    """Six batches an epoch in windows of 2 are three iterations: every 2nd iteration is every 4th batch, and the
    count runs on across the epoch boundary (steps 2, 4, 6), where Lightning's val_check_interval counts batches."""
    _, positions = _fit(tmp_path, **{"data.n": 48, "trainer.accumulate_grad_batches": 2, "trainer.max_epochs": 2,
                                     "trainer.val_every_n_steps": 2, "trainer.val_every_n_epochs": 0,
                                     "trainer.num_sanity_val_steps": 0})  # fmt: skip
    assert positions.validations == [("fit", 2, 4), ("fit", 4, 2), ("fit", 6, 6)]


@pytest.mark.parametrize(
    ("sanity", "limit", "batches"),
    [(2, "null", 2), (0, "null", 0), (-1, "null", 3), (5, "null", 3), (2, 1, 1), (-1, 2, 2)],
)
def test_the_sanity_validation_runs_its_batches_within_limit_val_batches(tmp_path, sanity, limit, batches):
    """A sanity validation of 2 batches under limit_val_batches=1 ran both: a batch no validation of the run would
    see (Lightning takes the smaller). -1 runs every batch, as in Lightning."""
    trainer, positions = _fit(tmp_path, **{"trainer.num_sanity_val_steps": sanity, "trainer.limit_val_batches": limit,
                                           "trainer.max_steps": 1})  # fmt: skip
    assert trainer.validation_batches == [8] * batches
    assert [stage for stage, _, _ in positions.validations] == (["sanity"] if batches else [])


def test_a_resumed_run_goes_on_with_the_batch_indices_and_global_steps_of_an_uninterrupted_one(tmp_path):
    """Ten batches an epoch in windows of 4 (4, 4, 2: three iterations an epoch), stopped by max_steps after the
    second window of the second epoch and resumed: each batch starts at the (epoch, batch_idx, global_step) an
    uninterrupted run gives it, and global_step counts iterations, not batches."""
    settings = {"data.n": 80, "trainer.accumulate_grad_batches": 4, "trainer.max_epochs": 3,
                "trainer.num_sanity_val_steps": 0, "checkpoint.enabled": True}  # fmt: skip
    whole, uninterrupted = _fit(tmp_path / "whole", **settings)
    _, first = _fit(tmp_path / "split", **settings, **{"trainer.max_steps": 5})
    resumed, second = _fit(tmp_path / "split", resume="last", **settings)
    assert first.batches + second.batches == uninterrupted.batches
    assert uninterrupted.batches[:11] == [(0, i, i // 4) for i in range(10)] + [(1, 0, 3)]
    assert second.batches[0] == (1, 8, 5)
    assert resumed.state.global_step == whole.state.global_step == 9
    for key, value in whole.module.state_dict().items():
        assert torch.equal(resumed.module.state_dict()[key], value), key
