"""The exact sequence of hooks and user methods in a full fit(), per precision recipe and loop shape."""

from __future__ import annotations

import math

import pytest
import torch
from toy_trainers import ToyTrainer, toy_cfg

from ampkit import Callback, Phase
from ampkit.trainer.callback import HOOKS

QUIET = {"checkpoint.enabled": False, "logging.tensorboard": False, "trainer.progress_bar": False}


class Recorder(Callback):
    """Records every hook; the mixed-precision ones with what they say (optimizer, verdict, loss id)."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def on_after_unscale(self, trainer, optimizer, found_inf):
        self.calls.append(("on_after_unscale", trainer.optimizer_state[optimizer].name, found_inf))

    def on_optimizer_step_skipped(self, trainer, optimizer, loss_ids):
        self.calls.append(("on_optimizer_step_skipped", trainer.optimizer_state[optimizer].name, loss_ids))

    def on_loss_scale_update(self, trainer, loss_id, old, new):
        self.calls.append(("on_loss_scale_update", loss_id))


def _recording_hook(name: str):
    def hook(self, trainer, *args):
        self.calls.append(name)

    return hook


for _hook in HOOKS:
    if _hook not in vars(Recorder):
        setattr(Recorder, _hook, _recording_hook(_hook))


class RecordingTrainer(ToyTrainer):
    calls: list
    overflow_at: int | None = None  # iteration whose loss is made infinite

    def configure_model(self):
        self.calls.append("configure_model")
        return super().configure_model()

    def configure_optimizers(self):
        self.calls.append("configure_optimizers")
        return super().configure_optimizers()

    def train_dataloader(self):
        self.calls.append("train_dataloader")
        return super().train_dataloader()

    def val_dataloader(self):
        self.calls.append("val_dataloader")
        return super().val_dataloader()

    def training_step(self, batch):
        self.calls.append("training_step")
        loss = super().training_step(batch)
        return loss * math.inf if self.state.iteration == self.overflow_at else loss

    def validation_step(self, batch):
        self.calls.append("validation_step")
        return super().validation_step(batch)


class TwoLossRecordingTrainer(RecordingTrainer):
    """Manual optimization: loss "A" reaches both optimizers, loss "B" only the head's."""

    automatic_optimization = False

    def configure_optimizers(self):
        self.calls.append("configure_optimizers")
        body = torch.optim.SGD(self.module[0].parameters(), lr=0.05)
        head = torch.optim.SGD(self.module[3].parameters(), lr=0.05)
        return [{"optimizer": body, "name": "body"}, {"optimizer": head, "name": "head"}]

    def training_step(self, batch):
        self.calls.append("training_step")
        x, y = batch
        loss_a = (self.model(x).squeeze(1) - y).square().mean()
        self.backward(loss_a * math.inf if self.state.iteration == self.overflow_at else loss_a, loss_id="A")
        features = self.module[1](self.module[0](x)).detach()
        self.backward(self.module[3](features).abs().mean(), loss_id="B", optimizer=self.optimizers["head"])
        for optimizer in self.optimizers.values():
            self.step(optimizer)


def fit_recording(tmp_path, trainer_class=RecordingTrainer, overflow_at=None, **overrides) -> list:
    calls: list = []
    trainer = trainer_class(toy_cfg(tmp_path, **{**QUIET, **overrides}), callbacks=[Recorder(calls)])
    trainer.calls, trainer.overflow_at = calls, overflow_at
    trainer.fit()
    return calls


SET_UP = ["configure_model", "configure_optimizers", "train_dataloader", "val_dataloader", "on_fit_start"]


def step(name: str = "sgd", scaled: bool = False, overflow: bool = False, culprits=(0,)) -> list:
    """One optimizer's step hooks at the end of an iteration."""
    seq = [("on_after_unscale", name, overflow)] if scaled else []
    seq += ["on_before_optimizer_step"]
    return seq + ([("on_optimizer_step_skipped", name, list(culprits))] if overflow else ["on_after_optimizer_step"])


def batch(backwards: int = 1, steps: list | None = None, scale_updates=(), optimizers: int = 1) -> list:
    """One batch; ``steps`` (the step hooks) only for a batch that ends an iteration."""
    seq = ["on_train_batch_start", "training_step"] + ["on_before_backward", "on_after_backward"] * backwards
    if steps is not None:
        seq += steps + [("on_loss_scale_update", k) for k in scale_updates] + ["on_before_zero_grad"] * optimizers
    return seq + ["on_train_batch_end"]


def fit_of(*batches: list) -> list:
    inner = [call for b in batches for call in b]
    return [
        *SET_UP,
        "on_train_start",
        "on_train_epoch_start",
        *inner,
        "on_train_epoch_end",
        "on_train_end",
        "on_fit_end",
    ]


def test_full_fit_hook_sequence_fp32_with_accumulation_and_validation(tmp_path):
    calls: list = []
    overrides = {"data.n": 24, "trainer.max_epochs": 2, "trainer.accumulate_grad_batches": 2}
    trainer = RecordingTrainer(toy_cfg(tmp_path, **{**QUIET, **overrides}), callbacks=[Recorder(calls)])
    trainer.calls = calls
    trainer.fit()
    assert trainer.state.global_step == 4
    assert trainer.optimizer_state[trainer.optimizer].steps == 4
    # 24 samples / batch 8 = 3 batches per epoch; accumulation 2 -> iterations of 2 batches, then 1.
    validation = ["on_validation_start", *["validation_step", "on_validation_batch_end"] * 3, "on_validation_end"]
    epoch = ["on_train_epoch_start", *batch(), *batch(steps=step()), *batch(steps=step()), *validation]
    epoch += ["on_train_epoch_end"]
    sanity = ["on_validation_start", "validation_step", "validation_step", "on_validation_end"]  # 2 batches
    assert calls == [*SET_UP, *sanity, "on_train_start", *epoch, *epoch, "on_train_end", "on_fit_end"]


NO_VAL = {"data.n": 24, "trainer.val_every_n_epochs": 0, "precision.init_scale": 256}  # no overflow of its own


@pytest.mark.parametrize(
    ("trainer_class", "overrides", "overflow_at", "expected"),
    [
        pytest.param(
            RecordingTrainer,
            {"precision.opt_level": "O2"},
            None,
            fit_of(*[batch(steps=step(scaled=True), scale_updates=[0])] * 3),
            id="O2-fp16",
        ),
        pytest.param(
            RecordingTrainer,
            {"precision.opt_level": "O1", "trainer.accumulate_grad_batches": 2},
            None,
            fit_of(
                batch(),
                batch(steps=step(scaled=True), scale_updates=[0]),
                batch(steps=step(scaled=True), scale_updates=[0]),
            ),
            id="O1-fp16-accumulate-2",
        ),
        pytest.param(
            RecordingTrainer,
            {"precision.opt_level": "O1"},
            2,
            fit_of(
                batch(steps=step(scaled=True), scale_updates=[0]),
                batch(steps=step(scaled=True, overflow=True), scale_updates=[0]),
                batch(steps=step(scaled=True), scale_updates=[0]),
            ),
            id="O1-fp16-overflow",
        ),
        pytest.param(
            TwoLossRecordingTrainer,
            {"precision.opt_level": "O1"},
            2,
            fit_of(
                batch(2, step("body", True) + step("head", True), ["A", "B"], optimizers=2),
                batch(2, step("body", True, True, ["A"]) + step("head", True, True, ["A"]), ["A", "B"], 2),
                batch(2, step("body", True) + step("head", True), ["A", "B"], optimizers=2),
            ),
            id="O1-fp16-two-losses-manual-overflow",
        ),
        pytest.param(
            RecordingTrainer,
            {"precision.opt_level": "O1", "precision.dtype": "bfloat16", "precision.skip_nonfinite": True},
            2,
            fit_of(batch(steps=step()), batch(steps=step(overflow=True)), batch(steps=step())),
            id="O1-bf16-skip_nonfinite-overflow",
        ),
    ],
)
def test_full_fit_hook_sequence_mixed_precision(tmp_path, trainer_class, overrides, overflow_at, expected):
    calls = fit_recording(tmp_path, trainer_class, overflow_at, **{**NO_VAL, **overrides})
    assert calls == expected


def test_exception_fires_on_exception_then_on_fit_end(tmp_path):
    calls: list[str] = []

    class Boom(ToyTrainer):
        def training_step(self, batch):
            raise ValueError("boom")

    trainer = Boom(
        toy_cfg(tmp_path, **{"checkpoint.enabled": False, "logging.tensorboard": False}), callbacks=[Recorder(calls)]
    )
    with pytest.raises(ValueError, match="^boom"):  # the user's error, after the hooks, not swallowed by them
        trainer.fit()
    assert calls[-4:] == ["on_train_epoch_start", "on_train_batch_start", "on_exception", "on_fit_end"]


def test_hook_phases_naming_no_hook_is_refused(tmp_path):
    class Misnamed(Callback):
        hook_phases = {"on_validation_epoch_end": Phase.PERSIST}

    with pytest.raises(ValueError, match=r"Misnamed.hook_phases names \['on_validation_epoch_end'\], not hooks"):
        ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_steps": 1}), callbacks=[Misnamed()]).fit()


VALIDATION = ["on_validation_start", *["validation_step", "on_validation_batch_end"] * 3, "on_validation_end"]


def test_step_based_validation_runs_inside_its_batch_after_zero_grad_and_before_on_train_batch_end(tmp_path):
    """val_every_n_steps=2: validation belongs to the iteration that ends at step 2, so a checkpoint or a logger in
    on_train_batch_end sees its metrics (Lightning validates after the batch's on_train_batch_end)."""
    calls = fit_recording(tmp_path, **{"data.n": 24, "trainer.val_every_n_steps": 2, "trainer.val_every_n_epochs": 0,
                                       "trainer.num_sanity_val_steps": 0})  # fmt: skip
    second = batch(steps=step())
    second = [*second[:-1], *VALIDATION, second[-1]]
    assert calls == fit_of(batch(steps=step()), second, batch(steps=step()))


class StopsAfterValidation(Callback):
    """Early stopping's move: asks to stop in the first on_validation_end of training."""

    def on_validation_end(self, trainer, metrics):
        if trainer.state.stage == "fit":
            trainer.state.should_stop = True


@pytest.mark.parametrize("mid_epoch", [False, True])
def test_an_early_stop_ends_the_epoch_then_the_run_as_lightning_s_does(tmp_path, mid_epoch):
    """Asked at an epoch-end validation: on_train_epoch_end, then the end. Asked at a step-based one (step 2 of 3):
    the epoch's later batches and its epoch-end validation do not run, but on_train_epoch_end still fires."""
    every = {"trainer.val_every_n_steps": 2} if mid_epoch else {}
    calls: list = []
    trainer = RecordingTrainer(toy_cfg(tmp_path, **{**QUIET, "data.n": 24, "trainer.max_epochs": 3,
                                                    "trainer.num_sanity_val_steps": 0, **every}),
                               callbacks=[Recorder(calls), StopsAfterValidation()])  # fmt: skip
    trainer.calls = calls
    trainer.fit()
    if mid_epoch:
        second = batch(steps=step())
        batches = [batch(steps=step()), [*second[:-1], *VALIDATION, second[-1]]]
    else:
        batches = [batch(steps=step())] * 3 + [VALIDATION]
    assert calls == fit_of(*batches)
    assert trainer.state.global_step == (2 if mid_epoch else 3)


def test_a_resume_loads_the_checkpoint_after_set_up_and_before_on_fit_start_then_goes_on_mid_epoch(tmp_path):
    """As in Lightning, on_load_checkpoint fires once, before on_fit_start; the resumed epoch starts again with
    on_train_epoch_start and runs only the batch the interrupted run had left."""
    settings = {**QUIET, "data.n": 24, "trainer.val_every_n_epochs": 0, "checkpoint.enabled": True}
    first = fit_recording(tmp_path, **settings, **{"trainer.max_steps": 2})
    assert first == [*fit_of(*[batch(steps=step())] * 2)[:-1], "on_save_checkpoint", "on_fit_end"]  # last.pt
    calls: list = []
    resumed = RecordingTrainer(toy_cfg(tmp_path, **settings), callbacks=[Recorder(calls)])
    resumed.calls = calls
    resumed.fit(resume="last")
    set_up = [*SET_UP[:-1], "on_load_checkpoint", "on_fit_start"]
    epoch_end = ["on_train_epoch_end", "on_save_checkpoint"]  # epoch-1.pt, which is last.pt too: not saved again
    assert calls == [*set_up, "on_train_start", "on_train_epoch_start", *batch(steps=step()), *epoch_end,
                     "on_train_end", "on_fit_end"]  # fmt: skip


class StopsAtSecondEpochStart(Callback):
    """A port's ``on_train_epoch_start`` deciding the run is done (a schedule of epochs it counts itself)."""

    def on_train_epoch_start(self, trainer):
        if trainer.state.epoch == 1:
            trainer.state.should_stop = True


def test_a_stop_asked_in_on_train_epoch_start_trains_no_batch_of_that_epoch_as_lightning_s_does(tmp_path):
    """Lightning's epoch loop asks should_stop before its first batch: the epoch runs no batch, no validation, and
    on_train_epoch_end still fires. It trained one batch of it (one step more than the port's run)."""
    calls: list = []
    trainer = RecordingTrainer(toy_cfg(tmp_path, **{**QUIET, "data.n": 24, "trainer.max_epochs": 3,
                                                    "trainer.num_sanity_val_steps": 0}),
                               callbacks=[Recorder(calls), StopsAtSecondEpochStart()])  # fmt: skip
    trainer.calls = calls
    trainer.fit()
    first = [call for _ in range(3) for call in batch(steps=step())]
    assert calls == fit_of(first, VALIDATION, ["on_train_epoch_end", "on_train_epoch_start"])
    assert (trainer.state.global_step, trainer.state.epoch, trainer.state.batches_done) == (3, 1, 0)
