"""What the console shows: the start banner, plain progress lines when piped, bars in a terminal."""

from __future__ import annotations

import errno
import io
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from child_env import child_env
from omegaconf import OmegaConf
from rank_forkserver import ForkedPython
from toy_trainers import ToyTrainer, toy_cfg

from ampkit import Callback, Phase
from ampkit.callbacks import ProgressBar
from ampkit.cli import main
from ampkit.trainer.checkpoint_io import load_checkpoint
from ampkit.trainer.console import say

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


class _NamedLossesOverflowAt3(ToyTrainer):
    """Returns two named values; the loss is infinite at iteration 3, so that step is skipped."""

    def training_step(self, batch):
        loss = super().training_step(batch)
        scaled = loss * math.inf if self.state.iteration == 3 else loss
        return {"loss": scaled, "mse_x2": 2 * loss}


class _LogsAucAtValidationEnd(ToyTrainer):
    """Logs an AUC-like value over the validated set in the Trainer's own on_validation_end, which runs after the
    console's callbacks of its phase."""

    def on_validation_end(self, metrics):
        self.log("val/auc", 0.25 if self.state.stage == "fit" else 0.75)  # the sanity pass's is no run's value


def _run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """``command`` (a Python script and its arguments) run in this directory, forked from the warm rank server."""
    run = ForkedPython(command, env=env)
    stdout, stderr = run.communicate(timeout=120)
    return subprocess.CompletedProcess(command, run.returncode, stdout, stderr)


def test_piped_stdout_gets_a_banner_progress_lines_and_val_prefixed_epoch_lines(tmp_path, monkeypatch):
    monkeypatch.chdir(TESTS)  # where the runs start
    cfg_path = tmp_path / "toy.yaml"
    trainer = {"max_epochs": 2, "device": "cpu"}  # the banner's device: auto would name a GPU where one is visible
    cfg = {"trainer_class": "toy_trainers:ToyTrainer", "run_dir": str(tmp_path / "run"), "trainer": trainer}
    OmegaConf.save(OmegaConf.create(cfg), cfg_path)
    env = {k: v for k, v in child_env(TESTS, REPO).items() if k != "CI"}  # not CI: only the pipe says "no terminal"
    # The CLI's main() in a process forked from the warm rank server, its stdout a file (like a pipe, no terminal): a
    # new Python spent seconds importing torch and ampkit, twice.
    cli = tmp_path / "ampkit_cli.py"
    cli.write_text("import sys\nfrom ampkit.cli import main\nsys.exit(main())\n")
    command = [sys.executable, str(cli), "fit", "--config", str(cfg_path), "logging.console_every_n_steps=4"]
    result = _run(command, env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:6] == [
        "ampkit: training ToyTrainer",
        "  device      cpu",
        "  precision   O0 (float32)",
        "  parameters  129 (129 trainable)",
        "  data        8 batches/epoch, 2 epochs, accumulate 1",
        f"  run dir     {tmp_path / 'run' / 'version_0'}",
    ]
    progress = [line for line in lines if re.match(r"epoch \d batch", line)]
    assert [line.split(" | ")[0] for line in progress] == [
        "epoch 0 batch 4/8 step 4",
        "epoch 0 batch 8/8 step 8",
        "epoch 1 batch 4/8 step 12",
        "epoch 1 batch 8/8 step 16",
    ]
    status = r".* \| loss=[\d.e+-]+( samples/s=[\d.]+k?)? \| [\d.]+ (it/s|s/it) \| elapsed \d+:\d\d:\d\d"
    assert all(re.fullmatch(status, p) for p in progress)
    assert "samples/s=" in progress[-1]  # the throughput of the window that ended at step 10
    epochs = [line for line in lines if re.match(r"epoch \d \|", line)]
    assert len(epochs) == 2 and all(re.search(r"\| 8 steps in .* \| val/mse=[\d.]+$", e) for e in epochs)
    assert "ampkit: trained 16 steps in" in result.stdout
    assert "\r" not in result.stdout + result.stderr  # no bar drawn into a log file

    # a resume says where it started and counts what this run trained
    more = [*command, "trainer.max_epochs=3", "--resume", "last"]
    resumed = _run(more, env)
    assert resumed.returncode == 0, resumed.stderr
    last = tmp_path / "run" / "version_0" / "checkpoints" / "last.pt"
    assert f"  resumed     from {last} at step 16" in resumed.stdout.splitlines()
    assert "ampkit: trained to step 24 (8 steps in this run) in" in resumed.stdout


def test_status_shows_named_losses_loss_scale_and_skipped_steps(tmp_path, capsys):
    cfg = toy_cfg(
        tmp_path,
        **{
            "trainer.max_epochs": 1,
            "trainer.progress_bar": False,
            "trainer.val_every_n_steps": 4,
            "precision.opt_level": "O1",
            "precision.dtype": "bfloat16",
            "precision.loss_scale": "dynamic",
            "logging.tensorboard": False,
        },
    )
    trainer = _NamedLossesOverflowAt3(cfg, callbacks=[ProgressBar(bar=False, every_n_steps=4)])
    trainer.fit()
    out = capsys.readouterr().out
    assert "  precision   O1 bfloat16, loss scale dynamic" in out
    (at_4,) = [line for line in out.splitlines() if line.startswith("epoch 0 batch 4/8")]
    assert re.search(r"\| loss=[\d.]+ mse_x2=[\d.]+ scale\[0\]=32768 skipped=1 \|", at_4), at_4
    assert re.search(r"^epoch 0 step 4 \| val/mse=[\d.]+ \| validation [\d.]+ s$", out, re.M)  # step validation


@pytest.mark.parametrize(
    ("epochs", "steps", "length", "epoch_0", "trained"),
    [(1, 1, "1 epoch, at most 1 step", "1 step", "1 step"), (2, -1, "2 epochs", "8 steps", "16 steps")],
)
def test_the_console_counts_one_epoch_and_one_step_in_the_singular(
    tmp_path, capsys, epochs, steps, length, epoch_0, trained
):
    """A one-epoch, one-step run (the smoke test a newcomer runs first) read "1 epochs" and "trained 1 steps"."""
    settings = {"trainer.max_epochs": epochs, "trainer.max_steps": steps, "logging.tensorboard": False}
    cfg = toy_cfg(tmp_path, **settings, **{"trainer.progress_bar": False, "checkpoint.enabled": False})
    ToyTrainer(cfg, callbacks=[ProgressBar(bar=False)]).fit()
    lines = capsys.readouterr().out.splitlines()
    assert f"  data        8 batches/epoch, {length}, accumulate 1" in lines
    assert any(line.startswith(f"epoch 0 | {epoch_0} in ") for line in lines), lines
    assert any(line.startswith(f"ampkit: trained {trained} in ") for line in lines), lines


def test_values_logged_in_on_validation_end_show_beside_the_means_on_every_line(tmp_path, capsys):
    """A user who logs val/auc in on_validation_end sees it in the validation's line, the epoch's and the CLI's last."""
    config = tmp_path / "fit.yaml"
    cfg = toy_cfg(
        tmp_path,
        **{"trainer.max_epochs": 1, "data.n": 32, "trainer.val_every_n_steps": 3, "logging.tensorboard": False},
    )
    OmegaConf.save(OmegaConf.create({**cfg, "trainer_class": f"{__name__}:_LogsAucAtValidationEnd"}), config)
    assert main(["fit", "--config", str(config), "logging.console_every_n_steps=4"]) == 0  # stdout piped: no bars
    out = capsys.readouterr().out
    assert re.search(r"^epoch 0 step 3 \| val/mse=[\d.]+ val/auc=0.25 \| validation [\d.]+ s$", out, re.M), out
    assert re.search(r"^epoch 0 \| 4 steps in .* \| val/mse=[\d.]+ val/auc=0.25$", out, re.M), out
    assert re.search(r"^ampkit: finished 4 steps in 1 epoch; val/mse=[\d.]+, val/auc=0.2500$", out, re.M), out


class _LogsAtPersist(Callback):
    """Logs a value over the validated set and an epoch metric from PERSIST, the phase of a callback reading what the
    Trainer's own hooks log."""

    phase = Phase.PERSIST

    def on_validation_end(self, trainer, metrics):
        trainer.log("val/auc", 0.5)

    def on_train_epoch_end(self, trainer):
        trainer.log("train/acc", 0.75)


def test_values_a_persist_phase_callback_logs_show_on_the_lines_wherever_it_stands_in_the_list(tmp_path, capsys):
    """Given after the progress bar, it logged after the bar had printed its validation and epoch lines, so its values
    missed them (and a value logged in on_train_epoch_end showed on no line at all)."""
    cfg = {"trainer.max_epochs": 1, "data.n": 32, "trainer.val_every_n_steps": 3, "logging.tensorboard": False}
    cfg |= {"trainer.progress_bar": False, "checkpoint.monitor": "val/auc", "checkpoint.mode": "max"}
    for i, callbacks in enumerate(
        ([ProgressBar(bar=False), _LogsAtPersist()], [_LogsAtPersist(), ProgressBar(bar=False)])
    ):
        ToyTrainer(toy_cfg(tmp_path / str(i), **cfg), callbacks=callbacks).fit()
        out = capsys.readouterr().out
        assert re.search(r"^epoch 0 step 3 \| val/mse=[\d.]+ val/auc=0.5 \| validation [\d.]+ s$", out, re.M), out
        assert re.search(r"^epoch 0 \| 4 steps in .* \| train/acc=0.75 \| val/mse=[\d.]+ val/auc=0.5$", out, re.M), out


def test_terminal_bars_for_training_and_validation(tmp_path, capsys):
    cfg = toy_cfg(tmp_path, **{"trainer.max_epochs": 1, "trainer.progress_bar": False, "logging.tensorboard": False})
    ToyTrainer(cfg, callbacks=[ProgressBar(bar=True, refresh_s=0.0)]).fit()
    captured = capsys.readouterr()
    assert "epoch 0:" in captured.err and "8/8" in captured.err and "loss=" in captured.err
    assert "validation:" in captured.err and "3/3" in captured.err  # 24 samples in batches of 8
    assert re.search(r"^epoch 0 \| 8 steps in .* \| val/mse=", captured.out, re.M)


def test_bf16_without_a_scaler_shows_no_loss_scale_but_counts_the_skipped_step(tmp_path, capsys):
    cfg = toy_cfg(
        tmp_path,
        **{
            "trainer.max_epochs": 1,
            "trainer.progress_bar": False,
            "precision.opt_level": "O4",  # bfloat16 by the opt level; no scaler: skip_nonfinite skips step 3
            "precision.skip_nonfinite": True,
            "logging.tensorboard": False,
        },
    )
    trainer = _NamedLossesOverflowAt3(cfg, callbacks=[ProgressBar(bar=False, every_n_steps=4)])
    trainer.fit()
    out = capsys.readouterr().out
    assert "  precision   O4 bfloat16, skip_nonfinite\n" in out
    (at_4,) = [line for line in out.splitlines() if line.startswith("epoch 0 batch 4/8")]
    assert re.search(r"\| loss=[\d.]+ mse_x2=[\d.]+ skipped=1 \|", at_4), at_4
    assert "scale[" not in out


def test_validate_stage_draws_a_bar_and_leaves_its_metrics_to_the_caller(tmp_path, capsys):
    cfg = toy_cfg(tmp_path, **{"trainer.progress_bar": False, "logging.tensorboard": False})
    trainer = ToyTrainer(cfg, callbacks=[ProgressBar(bar=True, refresh_s=0.0)])
    assert set(trainer.validate()) == {"mse"}
    captured = capsys.readouterr()
    assert captured.out == ""  # no banner, no epoch line: validate() returns the metrics
    assert "validation: " in captured.err and "3it" in captured.err  # a bar counting the 3 batches


def test_steps_slower_than_one_a_second_show_seconds_per_step():
    """A compiled GPT on a CPU took seconds a step, and its epoch line read "(0.0 it/s)"."""
    from ampkit.callbacks.progress import _rate

    assert (_rate(0.04), _rate(0.5), _rate(1.0), _rate(12.34), _rate(0.0)) == (
        "25.0 s/it", "2.0 s/it", "1.0 it/s", "12.3 it/s", "0.0 it/s"
    )  # fmt: skip


class _ClosesAfter(io.StringIO):
    """A console whose reader goes away (``| head`` exited, the ``tee`` of a log killed) after ``writes`` writes:
    every write after fails with EPIPE, as a closed pipe's do."""

    def __init__(self, writes: int, name: str) -> None:
        super().__init__()
        self.writes, self.name = writes, name

    def write(self, text: str) -> int:
        if self.writes <= 0:
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))
        self.writes -= 1
        return super().write(text)


@pytest.mark.parametrize("bar", [False, True])
def test_a_console_that_goes_away_mid_run_stops_the_output_not_the_run(tmp_path, monkeypatch, bar):
    """The next progress line (stdout) or bar redraw (stderr) after the pipe closed raised BrokenPipeError and ended
    the run (under torchrun rank zero's alone, which writes, the others failing in their next collective): the
    output stops, said once, and the run trains to its end and saves its checkpoint."""
    monkeypatch.setattr(sys, "stdout", _ClosesAfter(2, "<stdout>"))  # the banner, then nothing
    monkeypatch.setattr(sys, "stderr", _ClosesAfter(0, "<stderr>"))  # where the bars draw
    cfg = toy_cfg(tmp_path, **{"trainer.max_epochs": 2, "trainer.progress_bar": False, "logging.tensorboard": False})
    trainer = ToyTrainer(cfg, callbacks=[ProgressBar(bar=bar, every_n_steps=1, refresh_s=0.0)])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.fit()
    gone = [str(w.message) for w in said if "cannot write to the console" in str(w.message)]
    assert gone == [f"cannot write to the console: {os.strerror(errno.EPIPE)}; ampkit writes no more progress or "
                    "notices there, and the run goes on: its checkpoints and TensorBoard events are its record (run "
                    "under nohup or redirect the output to a file to keep it)"]  # fmt: skip
    assert trainer.state.global_step == 16
    assert load_checkpoint(trainer.version_dir / "checkpoints" / "last.pt")["loop"]["global_step"] == 16


def test_a_notice_to_a_closed_console_is_dropped_said_once_and_the_next_not_tried(monkeypatch):
    """ampkit's one-line notices (a stop, a SIGTERM, early stopping) on a closed stderr raised on rank zero alone."""
    closed = _ClosesAfter(0, "<stderr>")
    monkeypatch.setattr(sys, "stderr", closed)
    with pytest.warns(UserWarning, match=re.escape("cannot write to the console (<stderr>): Broken pipe;")) as said:
        say("ampkit: stopping every rank at step 3")
        closed.writes = 1  # a write now would pass: none is tried, a closed pipe stays closed
        say("ampkit: SIGTERM: stopping at step 4")
    assert len(said) == 1 and closed.getvalue() == ""


def test_a_count_of_one_is_worded_in_the_singular(tmp_path):
    """Messages said "1 batches" where a count can be 1 (a resume one batch into its epoch, a loader that yielded one
    batch, a sanity check of one batch): every count goes through one helper."""
    from ampkit.config import ConfigError
    from ampkit.trainer.batch_layout import RescaledResume, batches_done_here
    from ampkit.trainer.checkpoint_io import CheckpointError
    from ampkit.trainer.user_code import short_epoch_message
    from ampkit.wording import counted

    assert [counted(n, "batch", "batches") for n in (0, 1, 2)] == ["0 batches", "1 batch", "2 batches"]
    assert counted(1, "step") == "1 step" and counted(3, "rank") == "3 ranks"
    assert short_epoch_message(0, 1, 2, 0, 0).startswith("train_dataloader() yielded 1 batch in epoch 0, but its")
    one, two = {"ranks": 1, "batch_size": 8, "epoch_batches": 8}, {"ranks": 2, "batch_size": 8, "epoch_batches": 4}
    assert (
        RescaledResume(0, 1, one, 1, one).note().endswith("the resumed checkpoint's 1 batch of 8 samples (1 rank x 8)")
    )
    said = re.escape("is 1 batch of 8 samples (1 rank x 8) into its epoch; this run's batches take 16 samples (2 ranks")
    with pytest.raises(CheckpointError, match=said):
        batches_done_here(one, two, 1, 1, Path("ck.pt"))
    cfg = toy_cfg(tmp_path, **{"checkpoint.monitor": "val/absent", "trainer.num_sanity_val_steps": 1})
    with pytest.raises(ConfigError, match=r"\(checked before training on 1 batch, trainer.num_sanity_val_steps=1"):
        ToyTrainer(cfg).fit()


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (10**400, "an integer of 401 digits"),
        (-(10**500), "a negative integer of 501 digits"),
        (10**5000 - 1, "an integer of 5000 digits"),
        (-(10**5000), "a negative integer of 5001 digits"),
    ],
    ids=["401", "-501", "5000", "-5001"],
)
def test_a_huge_integer_is_named_by_its_sign_and_exact_digit_count(value, said):
    """-10**500 was 'an integer of 501 digits', its sign dropped, and 10**5000 - 1 (5000 nines, counted by a float
    logarithm) was said to have 5001."""
    from ampkit.wording import integer_digits, shown

    assert integer_digits(value) == said
    assert shown(value) == said
