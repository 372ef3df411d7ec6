"""A hostile user's inputs and faults (a corrupt checkpoint, a broken config, odd return values, a full disk, a
read-only run directory, Ctrl-C before training): each is one line naming the bad value and what is valid, and
the last good checkpoint is never damaged."""

from __future__ import annotations

import errno
import io
import math
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from full_disk import FullDisk
from omegaconf import OmegaConf
from rank_forkserver import ForkedPython
from torch.utils.data import DataLoader
from toy_trainers import ToyTrainer, toy_cfg, toy_dataset

import ampkit
from ampkit.callbacks.throughput import sample_worth
from ampkit.cli import main
from ampkit.config import ConfigError, load_config
from ampkit.trainer.checkpoint_io import CheckpointError, load_checkpoint
from ampkit.trainer.run_life import RunDirectoryError
from ampkit.trainer.user_code import UserCodeError

QUIET = {"logging.tensorboard": False, "trainer.progress_bar": False}


def _config(tmp_path, trainer_class: str = "toy_trainers:ToyTrainer", **settings) -> str:
    config = tmp_path / "run.yaml"
    base = {"trainer_class": trainer_class, "run_dir": str(tmp_path / "runs")}
    dotted = OmegaConf.from_dotlist([f"{k}={v}" for k, v in {**QUIET, **settings}.items()])
    OmegaConf.save(OmegaConf.merge(base, dotted), config)
    return str(config)


def _one_line_error(capsys, argv: list[str], status: int = 2) -> str:
    capsys.readouterr()
    assert main(argv) == status
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ampkit: error: "), lines
    return lines[0]


def _files(root) -> dict:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 4-step run (its config file, its last.pt) to point hostile commands at."""
    tmp_path = tmp_path_factory.mktemp("trained")
    config = _config(tmp_path, **{"trainer.max_steps": 4, "checkpoint.every_n_steps": 2})
    assert main(["fit", "--config", config]) == 0
    return tmp_path, config, tmp_path / "runs" / "version_0" / "checkpoints" / "last.pt"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        # random bytes, but not starting as a pickle (0x80) or a zip does: those read as a damaged torch file
        (lambda last: b"\x00" + os.urandom(299), "is not a torch checkpoint"),
        (lambda last: last.read_bytes()[:300], "is corrupt or truncated: RuntimeError: PytorchStreamReader failed"),
        (lambda last: b"", "is an empty file"),
        (lambda last: None, "is not an ampkit checkpoint (no 'ampkit_checkpoint' entry)"),
    ],
    ids=["garbage", "truncated", "empty", "foreign .pt"],
)
@pytest.mark.parametrize("command", ["fit", "validate", "predict"])
def test_a_bad_checkpoint_file_is_one_line_saying_what_is_wrong(trained, capsys, command, content, message):
    tmp_path, config, last = trained
    bad = tmp_path / f"bad_{command}.pt"
    data = content(last)
    if data is None:
        torch.save({"model": torch.nn.Linear(2, 2).state_dict()}, bad)
    else:
        bad.write_bytes(data)
    before = _files(tmp_path / "runs")
    option = ["--resume", str(bad)] if command == "fit" else ["--ckpt", str(bad)]
    output = ["--output", str(tmp_path / "p.pt")] if command == "predict" else []
    line = _one_line_error(capsys, [command, "--config", config, *option, *output])
    assert message in line and "does not fit" not in line and "This is an internal" not in line
    assert _files(tmp_path / "runs") == before


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", r"holds nothing \(an empty file\)"),
        ("hello\n", r"it holds a str \('hello'\)"),
        ("- 1\n- 2\n", "it holds a list"),
        # the YAML parser's wording differs between OmegaConf releases; the line and column do not
        ("a: [1, 2\n b: :\n", r"is not valid YAML: (did not find )?expected ',' or '\]'.* at line 2, column 3"),
        # found lines later, an unclosed bracket or quote is named where it opened
        ("a: [1, 2\nb: 3\nc: 4\n", r"at line 2, column 2 \(.*flow sequence that starts at line 1, column 4\)$"),
        ('a: "x\nb: 3\n', r"at line 3, column 1 \(.*quoted scalar that starts at line 1, column 4\)$"),
        ("t:\n  a: 1\n  a: 2\n", r"found duplicate key a at line 3, column 3"),  # not the later value taken
    ],
    ids=["empty", "a word", "a list", "invalid", "unclosed bracket", "unclosed quote", "a key twice"],
)
def test_a_config_file_that_is_no_mapping_is_one_line(tmp_path, text, message):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert re.search(message, str(err.value)) and "\n" not in str(err.value)


HEAD = "trainer_class: toy_trainers:ToyTrainer\n"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("trainer:\n  max_steps: 1e3\n", "config key 'trainer.max_steps': 1000.0 is a float, not an integer; expected "
                                         "-1 (no limit) or an integer >= 0 (write 1000)"),
        ("trainer:\n  max_steps: true\n", "config key 'trainer.max_steps': true is a boolean; expected -1"),
        ("trainer:\n  max_steps: ten\n", "config key 'trainer.max_steps': 'ten' is not an integer; expected -1"),
        ("trainer:\n  max_steps: [100]\n", "config key 'trainer.max_steps': [100] is a list; expected -1"),
        ("trainer:\n  clip_grad_norm: big\n", "config key 'trainer.clip_grad_norm': 'big' is not a number; expected"),
        ("name: [a, b]\n", "config key 'name': ['a', 'b'] is a list; expected a string"),
        ("checkpoint:\n  mode: [max]\n", "config key 'checkpoint.mode': ['max'] is a list; expected one of min, max"),
        ("name: ${oc.env:AMPKIT_TEST_UNSET}\n", "config key 'name': environment variable AMPKIT_TEST_UNSET is not set "
                                               "(${oc.env:AMPKIT_TEST_UNSET}); set it, or give a default: "
                                               "${oc.env:AMPKIT_TEST_UNSET,<default>}"),
        ("name: ${oc.enc:HOME}\n", "config key 'name': ${oc.enc:...} names no resolver; OmegaConf's are oc.env, "),
        ("name: ${name\n", "config key 'name': '${name' is no valid interpolation (an unclosed or misspelt ${...})"),
        ("name: ${run_dir}\nrun_dir: ${name}\n", "config key 'name': its ${...} leads back to itself"),
        ("defaults:\n  - base\n", "unknown config key 'defaults'; ampkit reads one file, with no includes"),
    ],
    ids=["1e3", "true", "a word", "a list", "a word for a float", "a list for a string", "a list for a choice",
         "unset variable", "misspelt resolver",
         "unclosed interpolation", "interpolation cycle", "an include"],
)  # fmt: skip
def test_a_new_user_s_bad_value_is_one_line_naming_it_its_key_and_what_is_valid(tmp_path, capsys, text, said):
    """OmegaConf's own words ('Value '1000.0' of type 'float' could not be converted to Integer', 'KeyError raised
    while resolving interpolation') named neither what the value is in YAML's terms nor what the key takes."""
    config = tmp_path / "run.yaml"
    config.write_text(HEAD + f"run_dir: {tmp_path / 'runs'}\n" * ("run_dir" not in text) + text)
    assert said in _one_line_error(capsys, ["fit", "--config", str(config)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]  # nothing written


def test_a_config_file_that_is_no_text_says_so(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_bytes(b"\x89PNG\r\n\x1a\n\x00")
    line = _one_line_error(capsys, ["fit", "--config", str(config)])
    assert "is not a text file: byte 0x89 at offset 0 is not UTF-8; a config is a YAML file saved as UTF-8" in line


def test_a_section_given_a_value_names_the_section(tmp_path, capsys):
    line = _one_line_error(capsys, ["fit", "--config", _config(tmp_path), "trainer=3"])
    assert "config key 'trainer' is a section, not a value (3)" in line and "max_steps" in line


@pytest.mark.parametrize(
    ("override", "shown"),
    [
        (
            "trainer.activation_checkpointing=Linear",
            "'Linear' is not a list; expected a list, e.g. trainer.activation_checkpointing=[Linear]",
        ),
        ("trainer.activation_checkpointing={a: 1}", "{'a': 1} is not a list; expected a list"),  # was a raw TypeError
    ],
    ids=["a name", "a mapping"],
)
def test_a_list_key_given_no_list_names_the_key_and_the_list_form(tmp_path, capsys, override, shown):
    line = _one_line_error(capsys, ["fit", "--config", _config(tmp_path), override])
    assert f"config key 'trainer.activation_checkpointing': {shown}" in line


def test_a_setting_of_the_trainer_s_own_that_its_code_refuses_is_named(tmp_path, capsys):
    """The Trainer's own data.batch_size=0 reaches DataLoader, which refuses it: one line naming the key."""
    line = _one_line_error(capsys, ["fit", "--config", _config(tmp_path), "data.batch_size=0"])
    assert "train_dataloader() raised ValueError: batch_size should be a positive integer" in line
    assert "(config: data.batch_size=0)" in line
    assert not (tmp_path / "runs").exists()


class ForeignParameters(ToyTrainer):
    def configure_optimizers(self):
        return torch.optim.SGD([torch.nn.Parameter(torch.ones(2)), *self.module.parameters()], lr=0.1)


class OneParameterListedTwice(ToyTrainer):
    """torch only warns (an error to come) and steps it twice per step; the scaler unscaled its gradient twice."""

    def configure_optimizers(self):
        params = list(self.module.parameters())
        return torch.optim.SGD([*params, params[0]], lr=0.1)


class OneParameterTwoOptimizers(ToyTrainer):
    """A second optimizer for the last layer, by mistake over it again: under automatic optimization it would move
    twice per iteration."""

    def configure_optimizers(self):
        last = list(self.module.parameters())[-1]
        return [torch.optim.SGD(self.module.parameters(), lr=0.1), torch.optim.Adam([last])]


class NoOptimizerInDict(ToyTrainer):
    def configure_optimizers(self):
        return {"optim": torch.optim.SGD(self.module.parameters(), lr=0.1)}


class SchedulerByName(ToyTrainer):
    def configure_optimizers(self):
        return {"optimizer": torch.optim.SGD(self.module.parameters(), lr=0.1), "lr_scheduler": "cosine"}


class SchedulerOfAnother(ToyTrainer):
    def configure_optimizers(self):
        other = torch.optim.SGD(self.module.parameters(), lr=0.1)
        optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(other, 1)}


class NaNLearningRate(ToyTrainer):
    """``lr=nan`` in the config (or a typo'd computation): torch's SGD takes it, and the run trained into NaN
    weights before an error said the model was not finite, naming no learning rate."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.module.parameters(), lr=float("nan"), momentum=0.9)


class NaNFirstFactor(ToyTrainer):
    def configure_optimizers(self):
        sgd = torch.optim.SGD(self.module.parameters(), lr=0.1)
        return {"optimizer": sgd, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(sgd, lambda epoch: math.inf)}


class NaNMomentum(ToyTrainer):
    def configure_optimizers(self):
        return torch.optim.SGD(self.module.parameters(), lr=0.1, momentum=torch.tensor(math.nan))


@pytest.mark.parametrize(
    ("trainer_class", "message"),
    [
        (NaNLearningRate, "optimizer 'sgd' (SGD) has lr=nan in param group 0; expected a finite number >= 0"),
        (NaNFirstFactor, "optimizer 'sgd' (SGD) has lr=inf in param group 0; expected a finite number >= 0"),
        (NaNMomentum, "optimizer 'sgd' (SGD) has momentum=nan in param group 0; expected a number (NaN sets nothing)"),
        (ForeignParameters, "optimizer 'sgd' holds 1 of its 5 parameters outside the model"),
        (OneParameterTwoOptimizers, "is in optimizers 'sgd' and 'adam': under automatic optimization"),
        (OneParameterListedTwice, "parameter '0.weight' is listed twice in param group 0 of optimizer 'sgd': torch"),
        (NoOptimizerInDict, "configure_optimizers()[0] is a dict whose 'optimizer' is NoneType (keys: ['optim'])"),
        (SchedulerByName, "lr_scheduler is str ('cosine'); expected a scheduler object with step()"),
        (SchedulerOfAnother, "its lr_scheduler steps another optimizer than its 'optimizer'"),
    ],
)
def test_odd_configure_optimizers_results_fail_before_training(tmp_path, trainer_class, message):
    trainer = trainer_class(toy_cfg(tmp_path, **QUIET))
    with pytest.raises(UserCodeError) as err:
        trainer.fit()
    assert message in str(err.value)
    assert trainer.state.global_step == 0 and not (tmp_path / "run").exists()


class _InterruptAt(ampkit.Callback):
    def __init__(self, stage: str) -> None:
        self.stage = stage

    def on_validation_start(self, trainer) -> None:
        if trainer.state.stage == self.stage:
            raise KeyboardInterrupt

    def on_train_batch_start(self, trainer, batch) -> None:
        if self.stage == "first step":
            raise KeyboardInterrupt


class InterruptedInSanity(ToyTrainer):
    def configure_callbacks(self):
        return [_InterruptAt("sanity")]


class InterruptedInFirstStep(ToyTrainer):
    def configure_callbacks(self):
        return [_InterruptAt("first step")]


def test_ctrl_c_during_the_sanity_validation_leaves_no_run_behind(tmp_path, capsys):
    capsys.readouterr()
    assert main(["fit", "--config", _config(tmp_path, "test_hostile_inputs:InterruptedInSanity")]) == 130
    assert "interrupted before its first checkpoint" in capsys.readouterr().err
    assert not any((tmp_path / "runs").iterdir())


def test_ctrl_c_before_the_first_checkpoint_says_there_is_nothing_to_resume(tmp_path, capsys):
    config = _config(tmp_path, "test_hostile_inputs:InterruptedInFirstStep")
    capsys.readouterr()
    assert main(["fit", "--config", config]) == 130
    assert "interrupted before its first checkpoint (run it again without --resume" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "version_0" / "run.lock").exists()


def test_a_read_only_run_dir_refuses_training_but_serves_validate_and_a_finished_resume(trained, capsys, monkeypatch):
    tmp_path, config, last = trained
    before = _files(tmp_path / "runs")
    runs = str(tmp_path / "runs")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if str(path) == runs else real_access(path, mode))
    line = _one_line_error(capsys, ["fit", "--config", config])
    assert f"config key 'run_dir': cannot create a run under '{runs}': '{runs}' is not writable" in line
    assert main(["fit", "--config", config, "--resume", "last"]) == 0  # finished: nothing to write
    assert "nothing to train" in capsys.readouterr().err
    assert main(["validate", "--config", config]) == 0
    assert "ampkit: validate: val/mse=" in capsys.readouterr().out
    assert _files(tmp_path / "runs") == before


def test_a_full_disk_while_creating_the_run_is_one_line_and_leaves_no_version(trained, capsys, monkeypatch):
    import ampkit.trainer.run_life as run_life

    tmp_path, config, last = trained
    before = _files(tmp_path / "runs")

    def disk_full(text, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(run_life, "write_text_atomic", disk_full)
    line = _one_line_error(capsys, ["fit", "--config", config], status=74)
    assert "version_1/config.yaml' (No space left on device)" in line and "no checkpoint was touched" in line
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["version_0"]
    assert _files(tmp_path / "runs") == before


def test_a_full_disk_in_the_middle_of_a_checkpoint_keeps_last_and_leaves_no_temp(tmp_path, capsys, monkeypatch):
    import ampkit.trainer.checkpoint_io as checkpoint_io

    config = _config(tmp_path, **{"trainer.max_steps": 6, "checkpoint.every_n_steps": 2})
    real_save, saves = torch.save, []

    def full_mid_write(obj, f, *args, **kwargs):
        saves.append(1)
        if len(saves) < 3:
            return real_save(obj, f, *args, **kwargs)
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint_io.torch, "save", full_mid_write)
    line = _one_line_error(capsys, ["fit", "--config", config], status=74)
    monkeypatch.undo()
    assert "step-00000006.pt' (No space left on device); last.pt still holds the previous checkpoint" in line
    checkpoints = tmp_path / "runs" / "version_0" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.pt", "step-00000002.pt", "step-00000004.pt"]
    assert load_checkpoint(checkpoints / "last.pt")["loop"]["global_step"] == 4
    assert main(["fit", "--config", config, "--resume", "last"]) == 0
    assert load_checkpoint(checkpoints / "last.pt")["loop"]["global_step"] == 6


# A process whose files may grow to a byte limit (RLIMIT_FSIZE): a write past it fails with EFBIG, as a full disk
# fails one with ENOSPC and a quota with EDQUOT. Python ignores SIGXFSZ, so the write raises instead of the signal
# killing the process.
_FILE_SIZE_LIMITED = """
import resource
import sys

from ampkit.cli import main

limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
sys.exit(main(sys.argv[2:]))
"""


def test_a_real_write_failure_mid_checkpoint_is_one_line_naming_the_file_and_keeps_last(tmp_path, capsys):
    """A file-size limit fails the write of the next checkpoint halfway, as a full disk would: torch.save turns its
    file's OSError into 'RuntimeError: [enforce fail at inline_container.cc] unexpected pos', which named neither.
    The run stops with one line naming the file and the reason; last.pt is as it was, no temp file is left, and the
    run resumes from it once the writes succeed."""
    config = _config(tmp_path, **{"trainer.max_steps": 4, "checkpoint.every_n_steps": 2})
    assert main(["fit", "--config", config]) == 0
    checkpoints = tmp_path / "runs" / "version_0" / "checkpoints"
    before = _files(checkpoints)
    script = tmp_path / "file_size_limited.py"
    script.write_text(_FILE_SIZE_LIMITED)
    limit = (checkpoints / "last.pt").stat().st_size // 2  # the config, lock and temp names are far smaller
    args = ["fit", "--config", config, "trainer.max_steps=6", "--resume", "last"]
    proc = ForkedPython([sys.executable, str(script), str(limit), *args], env=dict(os.environ))
    _, stderr = proc.communicate(timeout=120)
    lines = stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith(
        f"ampkit: error: could not write checkpoint '{checkpoints / 'step-00000006.pt'}' (File too large); "
        "last.pt still holds the previous checkpoint"
    ), lines
    assert _files(checkpoints) == before
    assert main(args) == 0
    assert load_checkpoint(checkpoints / "last.pt")["loop"]["global_step"] == 6


@pytest.mark.parametrize("failure", [errno.ENOSPC, errno.EIO, errno.EDQUOT])
def test_a_checkpoint_file_whose_write_fails_midway_names_the_reason_and_keeps_last(
    tmp_path, capsys, monkeypatch, failure
):
    """The operating system refuses a write once a checkpoint file holds 1000 bytes (a full disk, an I/O error, a
    quota): the error names the file and the reason, and last.pt and the step files are as they were."""
    config = _config(tmp_path, **{"trainer.max_steps": 4, "checkpoint.every_n_steps": 2})
    assert main(["fit", "--config", config]) == 0
    checkpoints = tmp_path / "runs" / "version_0" / "checkpoints"
    before = _files(checkpoints)

    real_fdopen = os.fdopen

    def fdopen(fd, mode="r", *args, **kwargs):  # a checkpoint's temp file is opened "wb", as open() makes it
        if mode != "wb":
            return real_fdopen(fd, mode, *args, **kwargs)
        return io.BufferedWriter(FullDisk(fd, room=1000, failure=failure))

    monkeypatch.setattr(os, "fdopen", fdopen)
    line = _one_line_error(capsys, ["fit", "--config", config, "trainer.max_steps=6", "--resume", "last"], status=74)
    assert line.startswith(
        f"ampkit: error: could not write checkpoint '{checkpoints / 'step-00000006.pt'}' ({os.strerror(failure)}); "
        "last.pt still holds the previous checkpoint, and --resume last continues from it"
    )
    assert _files(checkpoints) == before


def test_an_io_error_that_leaves_the_file_system_read_only_is_named_and_its_temp_file_goes_at_the_next_fit(
    tmp_path, capsys, monkeypatch
):
    """ext4 remounts read-only after an I/O error (errors=remount-ro): the temp file of the failed write cannot be
    removed, and that removal's "Read-only file system" was raised in place of the write's "Input/output error"."""
    config = _config(tmp_path, **{"trainer.max_steps": 4, "checkpoint.every_n_steps": 2})
    assert main(["fit", "--config", config]) == 0
    checkpoints = tmp_path / "runs" / "version_0" / "checkpoints"
    before = _files(checkpoints)

    def io_error(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    real_unlink = Path.unlink

    def unlink(path, *args, **kwargs):
        if path.parent == checkpoints and path.name.endswith(".tmp"):  # the file system is read-only from now
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", io_error)
    monkeypatch.setattr(Path, "unlink", unlink)
    line = _one_line_error(capsys, ["fit", "--config", config, "trainer.max_steps=6", "--resume", "last"], status=74)
    monkeypatch.undo()
    assert f"could not write checkpoint '{checkpoints / 'step-00000006.pt'}' (Input/output error); last.pt" in line
    (temp,) = [p for p in checkpoints.iterdir() if p.name.startswith(".step-00000006.pt.")]
    assert {p: b for p, b in _files(checkpoints).items() if p != temp} == before
    assert main(["fit", "--config", config, "trainer.max_steps=6", "--resume", "last"]) == 0
    assert (
        f"removed 1 temp file(s) left by an interrupted save: version_0/checkpoints/{temp.name}"
        in capsys.readouterr().err
    )
    assert load_checkpoint(checkpoints / "last.pt")["loop"]["global_step"] == 6


def test_a_last_pt_link_that_leads_nowhere_is_named_with_the_newest_checkpoint_left(tmp_path):
    """A ``last.pt`` turned into a dangling link (by a cleanup script, or a copy; ampkit writes no link there) was
    reported as "no version_N/checkpoints/last.pt", though the user sees one there."""
    cfg = toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 4, "checkpoint.every_n_steps": 2})
    ToyTrainer(cfg).fit()
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    (checkpoints / "last.pt").unlink()
    (checkpoints / "last.pt").symlink_to("step-00000099.pt")
    message = (
        f"('{checkpoints / 'last.pt'}' is a link to 'step-00000099.pt', which does not exist); the newest checkpoint "
        f"left is '{checkpoints / 'step-00000004.pt'}': resume it by its path"
    )
    with pytest.raises(CheckpointError, match=re.escape(message)):
        ToyTrainer(cfg).fit(resume="last")


def test_a_directory_given_as_the_checkpoint_names_the_file_to_pass(trained, capsys):
    tmp_path, config, last = trained
    version_dir = last.parent.parent
    line = _one_line_error(capsys, ["validate", "--config", config, "--ckpt", str(version_dir)])
    assert f"'{version_dir}' is a directory, not a checkpoint: pass a checkpoint file in it (e.g. '{last}')" in line


class Predicting(ToyTrainer):
    def predict_dataloader(self):
        return DataLoader(toy_dataset(10, seed=11), batch_size=4)


def test_a_full_disk_while_saving_predictions_is_one_error_and_leaves_no_temp(trained, tmp_path, monkeypatch):
    import ampkit.trainer.checkpoint_io as checkpoint_io

    _, _, last = trained

    def disk_full(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint_io.torch, "save", disk_full)
    output = tmp_path / "out" / "predictions.pt"
    with pytest.raises(
        RunDirectoryError, match=f"cannot write predictions to '{output}' \\(No space left on device\\)"
    ):
        Predicting(toy_cfg(tmp_path, **QUIET)).predict(ckpt=last, output=output)
    assert list(output.parent.iterdir()) == []


class CountsPredictions(Predicting):
    steps = 0

    def predict_step(self, batch):
        type(self).steps += 1
        return super().predict_step(batch)


def test_predictions_bound_for_a_path_under_a_file_are_refused_before_any_is_made(trained, tmp_path):
    """The output's folder was made only at the save, after every batch was predicted: a path under a file (or a
    folder no one may write) threw them all away with 'File exists'."""
    _, _, last = trained
    (tmp_path / "notes.txt").write_text("mine")
    output = tmp_path / "notes.txt" / "preds" / "predictions.pt"
    with pytest.raises(RunDirectoryError, match=f"predict --output '{output}': cannot write there, "
                       f"'{tmp_path / 'notes.txt'}' is not a directory; name another file"):  # fmt: skip
        CountsPredictions(toy_cfg(tmp_path, **QUIET)).predict(ckpt=last, output=output)
    assert CountsPredictions.steps == 0 and (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("command", ["fit", "validate"])
def test_a_damaged_last_pt_names_the_newest_readable_checkpoint_beside_it(tmp_path, capsys, command):
    config = _config(tmp_path, **{"trainer.max_steps": 4, "trainer.max_epochs": 2, "checkpoint.every_n_steps": 2})
    assert main(["fit", "--config", config]) == 0
    checkpoints = tmp_path / "runs" / "version_0" / "checkpoints"
    (checkpoints / "last.pt").unlink()  # damage only last.pt
    (checkpoints / "last.pt").write_bytes(b"PK\x03\x04 garbage")
    settings = ["--resume", "last", "trainer.max_steps=6"] if command == "fit" else ["--ckpt", "last"]
    line = _one_line_error(capsys, [command, "--config", config, *settings])
    assert f"the newest whole checkpoint beside it is '{checkpoints / 'step-00000004.pt'}'" in line


class NaNFirstStep(ToyTrainer):
    def training_step(self, batch):
        loss = super().training_step(batch)
        return loss * float("nan") if self.state.global_step == 0 else loss


@pytest.mark.parametrize("opt_level", ["O4", "O5"])
def test_a_nan_loss_in_the_first_bf16_step_is_one_line_and_checkpoints_nothing_non_finite(tmp_path, capsys, opt_level):
    settings = {"trainer.max_steps": 3, "checkpoint.every_n_steps": 1, "precision.opt_level": opt_level}
    config = _config(tmp_path, "test_hostile_inputs:NaNFirstStep", **settings)
    capsys.readouterr()
    assert main(["fit", "--config", config]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "not finite at step 1" in lines[0] and "step 1 applied a loss of nan" in lines[0]
    assert not (tmp_path / "runs" / "version_0" / "checkpoints").exists()
    # skip_nonfinite (off by default in bfloat16) skips that step instead, and the run ends with a finite model.
    assert main(["fit", "--config", config, "precision.skip_nonfinite=true"]) == 0
    final = load_checkpoint(tmp_path / "runs" / "version_1" / "checkpoints" / "last.pt")
    assert all(torch.isfinite(t).all() for t in final["model"].values())


def test_ctrl_c_while_pruning_then_resume_matches_an_uninterrupted_run(tmp_path, monkeypatch):
    from checkpoint_compare import assert_same_checkpoint

    from ampkit.callbacks import ModelCheckpoint

    common = {**QUIET, "trainer.max_steps": 10, "trainer.max_epochs": 2, "checkpoint.every_n_steps": 1}
    real_prune, prunes = ModelCheckpoint._prune, []

    def interrupted_prune(self, directory):
        prunes.append(1)
        if len(prunes) == 5:  # after deleting one of the files beyond keep_last
            min(directory.glob("step-*.pt"), key=lambda p: p.stat().st_mtime_ns).unlink()
            raise KeyboardInterrupt
        real_prune(self, directory)

    monkeypatch.setattr(ModelCheckpoint, "_prune", interrupted_prune)
    with pytest.raises(KeyboardInterrupt):
        ToyTrainer(toy_cfg(tmp_path / "a", **common)).fit()
    monkeypatch.undo()
    resumed = ToyTrainer(toy_cfg(tmp_path / "a", **common))
    resumed.fit(resume="last")
    straight = ToyTrainer(toy_cfg(tmp_path / "b", **common))
    straight.fit()
    names = sorted(p.name for p in (resumed.version_dir / "checkpoints").iterdir())
    assert names == ["last.pt", "step-00000009.pt", "step-00000010.pt"]
    assert_same_checkpoint(
        load_checkpoint(resumed.version_dir / "checkpoints" / "last.pt"),
        load_checkpoint(straight.version_dir / "checkpoints" / "last.pt"),
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["fit", "--resume", ""], "the checkpoint path is empty: pass a path, 'last' or 'best'"),
        (["validate", "--ckpt", ""], "the checkpoint path is empty: pass a path, 'last' or 'best'"),
        (["predict", "--output", ""], "predict --output is empty: name a file"),
        (["predict", "--output", "p\0.pt"], "predict --output 'p\\x00.pt' holds a NUL character, which no path can"),
        pytest.param(  # a pasted 100 kB value is named by its start and length
            ["predict", "--output", "p" * 100_000 + "\0"],
            f"predict --output '{'p' * 299}... (100006 characters) holds a NUL character",
            id="long NUL",
        ),
    ],
)
def test_an_empty_path_is_named_as_empty(trained, capsys, argv, message):
    _, config, _ = trained
    assert message in _one_line_error(capsys, [argv[0], "--config", config, *argv[1:]])


def test_a_damaged_config_yaml_in_the_run_is_kept_and_the_resume_goes_on(trained, tmp_path):
    _, config, last = trained
    run = tmp_path / "copy"
    import shutil

    shutil.copytree(last.parent.parent, run / "version_0")
    (run / "version_0" / "config.yaml").write_bytes(b"\xff\xfe not text")
    cfg = {**OmegaConf.to_container(OmegaConf.load(config)), "run_dir": str(run)}
    cfg["trainer"]["max_steps"] = 6
    resumed = ToyTrainer(cfg)
    resumed.fit(resume="last")
    assert resumed.version_dir == run / "version_0" and resumed.state.global_step == 6
    assert (run / "version_0" / "config.yaml").read_bytes() == b"\xff\xfe not text"
    assert (run / "version_0" / "config.resumed_at_step_4.yaml").is_file()


class BrokenModel(ToyTrainer):
    def configure_model(self):
        raise RuntimeError("cannot build the model")


def test_a_set_up_method_s_own_exception_keeps_its_type_in_python_and_is_one_line_in_the_cli(tmp_path, capsys):
    with pytest.raises(RuntimeError, match="cannot build the model"):
        BrokenModel(toy_cfg(tmp_path, **QUIET)).fit()
    line = _one_line_error(capsys, ["fit", "--config", _config(tmp_path, "test_hostile_inputs:BrokenModel")])
    assert "configure_model() raised RuntimeError: cannot build the model" in line


@pytest.mark.parametrize(
    ("make_cfg", "message"),
    [
        (lambda tmp_path: OmegaConf.create({"trainer": {"max_epochs": -3}}), "'trainer.max_epochs': -3 is invalid"),
        (lambda tmp_path: OmegaConf.create({"trainer": {"max_steps": "x"}}), "max_steps': 'x' is not an integer"),
        (lambda tmp_path: OmegaConf.create({"bogus": 1}), "unknown config key 'bogus'"),
        (lambda tmp_path: str(tmp_path / "run.yaml"), "ToyTrainer(cfg=...): got str '"),
        (lambda tmp_path: tmp_path / "run.yaml", "ToyTrainer(cfg=...): got PosixPath '"),
        (lambda tmp_path: [1, 2], "ToyTrainer(cfg=...): got list '[1, 2]'; expected a dict, an OmegaConf DictConfig"),
    ],
    ids=["DictConfig out of range", "DictConfig wrong type", "DictConfig unknown key", "str path", "Path", "list"],
)
def test_a_config_that_bypasses_the_schema_or_is_no_mapping_is_refused_at_construction(tmp_path, make_cfg, message):
    with pytest.raises(ConfigError) as err:
        ToyTrainer(make_cfg(tmp_path))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_an_omegaconf_config_gets_the_schema_s_defaults_and_types(tmp_path):
    """A DictConfig from OmegaConf.load/create is merged onto the schema as a dict is: defaults, types checked."""
    config = tmp_path / "run.yaml"
    config.write_text(f"run_dir: {tmp_path / 'runs'}\ntrainer:\n  max_steps: '2'\n  device: cpu\n")
    trainer = ToyTrainer(OmegaConf.load(config))
    assert trainer.cfg.trainer.max_steps == 2 and trainer.cfg.data.batch_size == 8
    assert trainer.cfg.trainer_class.endswith(":ToyTrainer")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.compile=[Block", "override 'trainer.compile=[Block': cannot read the value '[Block' ("),
        ("trainer.max_steps={a", "override 'trainer.max_steps={a': cannot read the value '{a' ("),
        ("name=${oops", "override 'name=${oops': cannot read the value '${oops' (no viable alternative"),
        ("trainer..max_steps=3", "key 'trainer..max_steps' has an empty or space-padded part"),
        ("trainer.=3", "key 'trainer.' has an empty or space-padded part"),
        # Hydra's deletion: 'is not of the form key=value', or an unknown key '~trainer' when a value was given
        ("~trainer.max_epochs", "override '~trainer.max_epochs': removing a key (Hydra's '~') is not supported"),
        ("~trainer.max_epochs=3", "leave out the override to keep trainer.max_epochs's default, or set it"),
        # a float key given an integer no float holds: OmegaConf's bare OverflowError, a traceback naming no key
        (f"lr={10**400}", "config key 'lr': an integer of 401 digits is out of range; expected a float, between -"),
        (f"logging.peak_tflops=-{10**400}", "config key 'logging.peak_tflops': a negative integer of 401 digits"),
        # LightningCLI's "--key value" without its dashes: the value after the space was not named
        (
            "trainer.max_steps 3",
            "override 'trainer.max_steps' is not of the form key=value; a value after a space is "
            "not taken: write trainer.max_steps=3",
        ),
        ("trainer.max_steps", "override 'trainer.max_steps' is not of the form key=value (e.g. trainer.max_epochs=3)"),
    ],
    ids=[
        "unclosed list",
        "unclosed mapping",
        "unclosed interpolation",
        "double dot",
        "trailing dot",
        "tilde",
        "tilde with value",
        "huge",
        "-huge",
        "value after a space",
        "no value",
    ],
)
def test_an_override_that_cannot_be_read_is_one_line_naming_it(tmp_path, capsys, override, message):
    line = _one_line_error(capsys, ["fit", "--config", _config(tmp_path), *override.split(" ")])
    assert message in line


def test_hydra_s_force_add_prefix_is_a_plain_override(tmp_path, capsys):
    config = _config(tmp_path)
    assert main(["fit", "--config", config, "--print-config", "++trainer.max_steps=7", "+name=x"]) == 0
    printed = OmegaConf.create(capsys.readouterr().out)
    assert printed.trainer.max_steps == 7 and printed.name == "x"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("trainer.max_steps: 3\n", "config key 'trainer.max_steps' is written with a dot inside one mapping; nest it"),
        ("checkpoint:\n  # monitor: val/mse\n", "config key 'checkpoint' is an empty section (null); set its keys"),
        ("trainer:\n  max_epochs:\n", "config key 'trainer.max_epochs' is empty (null); expected a value of type int"),
    ],
    ids=["dotted key", "empty section", "empty value"],
)
def test_a_yaml_key_that_is_dotted_or_empty_says_so(tmp_path, capsys, text, message):
    config = tmp_path / "run.yaml"
    config.write_text(f"trainer_class: toy_trainers:ToyTrainer\nrun_dir: {tmp_path / 'runs'}\n{text}")
    assert message in _one_line_error(capsys, ["fit", "--config", str(config)])


def test_empty_overrides_and_an_empty_config_name_say_they_are_empty(tmp_path, capsys):
    config = _config(tmp_path)
    line = _one_line_error(capsys, ["fit", "--config", config, "name="])
    assert "config key 'name' is empty (null); expected a value of type str" in line
    assert "is an empty section (null)" in _one_line_error(capsys, ["fit", "--config", config, "trainer="])
    line = _one_line_error(capsys, ["fit", "--config", ""])
    assert "--config '' is empty; name a YAML file or a built-in config (digits, gpt)" in line
    with pytest.raises(ConfigError, match=r"'trainer.max_steps' is written with a dot inside one mapping"):
        ToyTrainer({"trainer.max_steps": 3})


def test_a_run_dir_holding_a_nul_character_is_refused_at_construction(tmp_path):
    with pytest.raises(ConfigError, match=r"'run_dir': 'a\\x00b' is invalid; expected a non-empty path without NUL"):
        ToyTrainer({"run_dir": "a\0b", "trainer": {"device": "cpu"}})


def _fused_adam_stepped_with_lr(lr):
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    optimizer = ampkit.ops.FusedAdam([param], lr=0.1)
    optimizer.param_groups[0]["lr"] = lr  # as a scheduler or a config writes it, checked at the step
    optimizer.step()


_HUGE = 10**400  # a count or a product of counts: a Python int no float holds


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda: ampkit.callbacks.GradientClipping(_HUGE), "GradientClipping: max_norm: "),
        (lambda: ampkit.callbacks.MaxTime(_HUGE), "MaxTime: max_time_s: "),
        (lambda: ampkit.callbacks.EarlyStopping("val/loss", divergence_threshold=_HUGE), "divergence_threshold "),
        (lambda: ampkit.callbacks.LossScaling("dynamic", init_scale=_HUGE), "init_scale: "),
        (lambda: ampkit.ops.scale_([torch.ones(3)], _HUGE, torch.zeros(1)), "`factor` must be a number within"),
        (lambda: ampkit.ops.FusedAdam([torch.nn.Parameter(torch.ones(3))], lr=_HUGE), "Invalid lr: "),
        (lambda: _fused_adam_stepped_with_lr(_HUGE), "Invalid lr of FusedAdam.param_groups[0]: "),
        (lambda: ampkit.ops.fused_layer_norm(torch.ones(2, 4), (4,), _HUGE), "eps must be a finite number >= 0, got "),
        (lambda: ampkit.callbacks.TensorBoardLogger(10, flush_secs=_HUGE), "TensorBoardLogger: flush_secs="),
        (lambda: sample_worth(SimpleNamespace(tokens_per_sample=_HUGE), "tokens_per_sample", "tokens"), "tokens_per"),
    ],
)
def test_an_integer_no_float_holds_is_named_where_a_number_is_taken(call, named):
    """Each was a bare "OverflowError: int too large to convert to float" naming neither the argument nor the value
    (at construction, or at the step that read it): now a ValueError naming both, the value by its digit count."""
    with pytest.raises(ValueError) as caught:
        call()
    assert named in str(caught.value) and "an integer of 401 digits" in str(caught.value)


def _larc(value):
    from ampkit.compat.parallel.larc import LARC

    return LARC(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), trust_coefficient=value)


@pytest.mark.parametrize(
    "build",
    [
        lambda value: ampkit.callbacks.TensorBoardLogger(flush_secs=value),
        lambda value: ampkit.ops.optimizers.FusedAdam([torch.zeros(1, requires_grad=True)], betas=value),
        _larc,
    ],
    ids=["flush_secs", "betas", "LARC"],
)
def test_a_long_value_given_in_code_is_named_by_its_start_and_length(build):
    """A 100 kB value given to a callback, a fused optimizer or the Apex layer came back whole in its error."""
    with pytest.raises((ValueError, TypeError)) as caught:
        build("x" * 100_000)
    assert "... (100002 characters)" in str(caught.value) and len(str(caught.value)) < 400
