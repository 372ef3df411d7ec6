"""Config errors name the dotted key, the bad value and what is valid — before any training starts."""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
from pathlib import Path

import pytest
from omegaconf import MISSING, OmegaConf
from toy_trainers import ToyTrainer, toy_cfg

from ampkit.cli import main
from ampkit.config import Config, ConfigError, build_config, check_values, load_config

REPO = Path(__file__).resolve().parents[1]


def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_loads_yaml_with_overrides_into_the_trainer_schema(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    cls, cfg = load_config(REPO / "configs/digits.yaml", ["trainer.max_epochs=3", "optim.lr=0.01"])
    assert cls.__name__ == "DigitsTrainer"
    assert cfg.trainer.max_epochs == 3 and cfg.optim.lr == 0.01
    assert cfg.model.hidden == 128  # from the YAML
    assert cfg.trainer.accumulate_grad_batches == 1  # from the schema's defaults


def test_colon_times_are_read_as_written_not_as_yaml_base_60_numbers(tmp_path):
    """YAML 1.1 reads an unquoted ``1:00:00:00`` as 216000 (base 60): a one-day max_time would run 2.5 days."""
    from ampkit.config import duration_seconds

    path = _write(tmp_path, "trainer_class: toy_trainers:ToyTrainer\nname: 12:30\ntrainer:\n  max_time: 1:00:00:00\n")
    _, cfg = load_config(path)
    assert cfg.name == "12:30" and duration_seconds(cfg.trainer.max_time) == 86400
    _, cfg = load_config(path, ["trainer.max_time=2:00:00"])  # HH:MM:SS
    assert duration_seconds(cfg.trainer.max_time) == 7200
    _, cfg = load_config(path, ["trainer.max_time=600", "trainer.max_epochs=3"])  # plain numbers are numbers
    assert cfg.trainer.max_time == 600 and cfg.trainer.max_epochs == 3
    _, cfg = load_config(path, ["trainer.max_time=1:30"])  # hours and minutes, or minutes and seconds?
    assert duration_seconds(cfg.trainer.max_time) is None


@pytest.mark.parametrize(
    "max_time", [{"days": 1, "hours": 5}, datetime.timedelta(days=1, hours=5)], ids=["dict", "timedelta"]
)
def test_max_time_takes_lightning_s_dict_and_timedelta_forms(tmp_path, max_time):
    """Lightning's ``Trainer(max_time={"days": 1, "hours": 5})`` or a ``timedelta``: both were refused (the timedelta
    as 'not a supported primitive type')."""
    from ampkit.callbacks import MaxTime, default_callbacks

    cfg = toy_cfg(tmp_path)
    cfg["trainer"]["max_time"] = max_time
    trainer = ToyTrainer(cfg)
    timers = [cb for cb in default_callbacks(trainer) if isinstance(cb, MaxTime)]
    assert [timer.max_time_s for timer in timers] == [29 * 3600]
    assert cfg["trainer"]["max_time"] is max_time  # the caller's config stays as written


def test_a_max_time_dict_overriding_another_takes_its_place_whole(tmp_path):
    """Merged as config sections are, ``{minutes: 2}`` over a YAML's ``{days: 1, hours: 5}`` trained for 29 hours
    and 2 minutes, without a word."""
    path = _write(tmp_path, "trainer_class: toy_trainers:ToyTrainer\ntrainer:\n  max_time: {days: 1, hours: 5}\n")
    _, cfg = load_config(path, ["trainer.max_time={minutes: 2}"])
    assert OmegaConf.to_container(cfg.trainer.max_time) == {"minutes": 2}
    _, cfg = load_config(path, ["trainer.max_epochs=2"])  # not overridden: the file's
    assert OmegaConf.to_container(cfg.trainer.max_time) == {"days": 1, "hours": 5}
    first = {"trainer_class": "toy_trainers:ToyTrainer", "trainer": {"max_time": {"hours": 5}}}
    cfg = build_config(Config, first, {"trainer": {"max_time": {"seconds": 30}}})
    assert OmegaConf.to_container(cfg.trainer.max_time) == {"seconds": 30}


@pytest.mark.parametrize("max_time", [{"hour": 5}, {"hours": "5"}, {}, {"hours": 0}, datetime.timedelta(0)])
def test_a_max_time_dict_of_no_duration_is_refused_naming_timedelta_s_keywords(tmp_path, max_time):
    cfg = toy_cfg(tmp_path)
    cfg["trainer"]["max_time"] = max_time
    with pytest.raises(ConfigError, match=r"trainer\.max_time.*timedelta's keywords \(weeks, days, hours, minutes"):
        ToyTrainer(cfg)


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("val_every_n_steps", 0.25, r"0\.25 is a float, not an integer; .*fractional val_check_interval is that share "
         r"of an epoch's iterations \(num_train_batches / accumulate_grad_batches\)"),
        ("val_every_n_epochs", None, r"is empty \(null\).*; Lightning's check_val_every_n_epoch=None.* is 0 here"),
    ],
)  # fmt: skip
def test_lightning_s_value_of_another_type_is_refused_saying_what_it_is_here(tmp_path, key, value, said):
    """A port's val_check_interval=0.25 written as val_every_n_steps, or check_val_every_n_epoch=None: the type error
    alone left them guessing."""
    cfg = toy_cfg(tmp_path)
    cfg["trainer"][key] = value
    with pytest.raises(ConfigError, match=rf"config key 'trainer\.{key}'.*{said}"):
        ToyTrainer(cfg)


def test_unknown_key_names_dotted_path_and_valid_keys(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs/digits.yaml", ["trainer.max_epoch=3"])
    msg = str(err.value)
    assert "trainer.max_epoch" in msg and "max_epochs" in msg and "accumulate_grad_batches" in msg


def test_unknown_key_in_yaml_user_section(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    path = _write(tmp_path, "trainer_class: examples.digits:DigitsTrainer\nmodel:\n  hiden: 3\n")
    with pytest.raises(ConfigError, match=r"model\.hiden.*valid keys at 'model': dropout, hidden"):
        load_config(path)


def test_wrong_type_names_key_and_value(monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs/digits.yaml", ["trainer.max_epochs=lots"])
    assert "trainer.max_epochs" in str(err.value) and "lots" in str(err.value)


def test_missing_trainer_class_module_and_attribute(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match="cannot import module 'examples.nope'"):
        load_config(_write(tmp_path, "trainer_class: examples.nope:Trainer\n"))
    with pytest.raises(ConfigError, match="has no 'Nope'.*DigitsTrainer"):
        load_config(_write(tmp_path, "trainer_class: examples.digits:Nope\n"))
    with pytest.raises(ConfigError, match="must set trainer_class"):
        load_config(_write(tmp_path, "name: x\n"))
    # a near miss is named, and the list holds the module's own classes, not the DataLoader it imported
    with pytest.raises(ConfigError) as misspelt:
        load_config(_write(tmp_path, "trainer_class: ampkit.examples.digits:DigitTrainer\n"))
    assert "(did you mean 'ampkit.examples.digits:DigitsTrainer'?)" in str(misspelt.value)
    assert "DataLoader" not in str(misspelt.value) and "TensorDataset" not in str(misspelt.value)
    with pytest.raises(ConfigError, match="not a subclass of ampkit.Trainer"):
        load_config(_write(tmp_path, "trainer_class: examples.digits:DigitsConfig\n"))


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="key=value"):
        load_config(REPO / "configs/digits.yaml", ["trainer.max_epochs"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.yaml")
    # a folder exists: saying it does not sent users looking for a typo
    with pytest.raises(ConfigError, match=f"--config '{tmp_path}' is a directory; name a YAML file in it"):
        load_config(tmp_path)


_LONG = "x" * 100_000


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("~" + _LONG, r"override '~x{78}\.\.\. \(100003 characters\): removing a key .* keep the key's default"),
        (_LONG, r"override 'x{79}\.\.\. \(100002 characters\) is not of the form key=value \(e\.g\."),
        (f"trainer..{_LONG}=1", r"override 'trainer\.\.x{70}\.\.\. \(100013 characters\): key 'trainer\.\.x{70}"),
        ("trainer.max_epochs=[" + "1," * 50_000, r"cannot read the value '\[1,1,.{74}\.\.\. \(100003 characters\)"),
    ],
    ids=["removal", "no equals", "empty part", "unclosed list"],
)
def test_a_long_override_is_named_by_its_start_and_length(override, expected):
    """A pasted 100 kB override was repeated whole, in some messages twice."""
    with pytest.raises(ConfigError, match=expected) as err:
        load_config(REPO / "configs/digits.yaml", [override])
    assert len(str(err.value)) < 1000


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("compile", ["Block"] * 2000 + [""], r"'trainer.compile': \['Block', .{70}\.\.\. \(18004 characters\) is"),
        ("compile_mode", "max" * 30_000, r"'trainer.compile_mode': 'max.{76}\.\.\. \(90002 characters\) is invalid"),
        ("activation_checkpointing", ["Block"] * 2000 + [""], r"\(18004 characters\) is invalid; expected a list"),
    ],
    ids=["compile", "compile_mode", "activation_checkpointing"],
)
def test_a_long_model_setup_setting_is_named_by_its_start_and_length(tmp_path, key, value, named):
    """A pasted list of 2000 names, or a 90 kB mode, was repeated whole in the error."""
    cfg = toy_cfg(tmp_path)
    cfg["trainer"][key] = value
    with pytest.raises(ConfigError, match=named) as err:
        ToyTrainer(cfg).fit()
    assert len(str(err.value)) < 400


def test_a_long_padded_foreign_spelling_is_named_by_its_start_and_length(tmp_path):
    """The note on what a foreign spelling means repeated the value whole."""
    cfg = toy_cfg(tmp_path)
    cfg["precision"] = {"opt_level": " " * 100_000 + "o1"}
    with pytest.raises(ConfigError, match=r"\(' {79}\.\.\. \(100004 characters\) is opt_level O1,") as err:
        ToyTrainer(cfg)
    assert len(str(err.value)) < 600


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("trainer.accumulate_grad_batches", 0, "an integer >= 1"),
        ("trainer.device", "gpu", "use auto, cpu, cuda or cuda:N"),
        ("trainer.clip_grad_norm", -1.0, "a finite number > 0"),
        ("trainer.clip_grad_norm", "inf", "a finite number > 0"),
        ("early_stopping.min_delta", "inf", "a finite number >= 0"),
        ("trainer.limit_val_batches", -1, "null \\(all batches.*\\) or an integer >= 1"),
        ("trainer.val_every_n_steps", -3, "an integer >= 0"),
        ("trainer.val_every_n_epochs", -1, "an integer >= 0"),
        ("trainer.max_steps", -2, "-1 \\(no limit\\) or an integer >= 0"),
        # a limit of no time at all, in each spelling: refused naming the config key
        ("trainer.max_time", "00:00:00", 'a number of seconds > 0, "HH:MM:SS"'),
        ("trainer.max_time", "0:00:00:00", 'a number of seconds > 0, "HH:MM:SS"'),
        ("trainer.max_time", 0, 'a number of seconds > 0, "HH:MM:SS"'),
        ("checkpoint.keep_last", 0, "an integer >= 1"),
        ("checkpoint.every_n_steps", -1, "an integer >= 0"),
        ("checkpoint.every_n_epochs", -1, "an integer >= 0"),
        ("logging.log_every_n_steps", 0, "an integer >= 1"),
        ("distributed.backend", "mpi", "one of auto, gloo, nccl"),
        ("distributed.grad_sync", "fsdp", "one of auto, ddp, step"),
        ("distributed.timeout_s", 0, "a number of seconds > 0"),
        ("distributed.timeout_s", "inf", "a number of seconds > 0, at most 1e9"),  # torchrun: an OverflowError
        ("distributed.timeout_s", 9e9, "a number of seconds > 0, at most 1e9"),  # torchrun: a store timeout at once
        ("distributed.bucket_cap_mb", "nan", "a number > 0 and below 2\\*\\*43"),
        ("distributed.bucket_cap_mb", "1e30", "a number > 0 and below 2\\*\\*43"),  # DDP: a raw TypeError
        ("trainer.accumulate_grad_batches", 10**23, "out of range; expected a 64-bit integer"),  # OverflowError
        ("data.batch_size", -(10**20), "out of range; expected a 64-bit integer"),  # a Trainer's own section too
        ("trainer.max_steps", 2**63, "out of range; expected a 64-bit integer"),  # one past int64's largest
        ("run_dir", "' '", "a non-empty path"),
        ("precision.dtype", "float32", "not a low-precision dtype; use float16 or bfloat16"),  # named as a dotted key
        ("precision.loss_scale", -1, "a static loss scale must be finite and > 0"),
        # a key of several forms is worded by its own rule, not as an integer key out of int64's range
        ("precision.loss_scale", 2**200, r"1606938044.*: a static loss scale must lie in float32's range of scales"),
        ("precision.keep_batchnorm_fp32", "maybe", "expected True, False"),
        # checked at O0 too, where no callback reads them: a typo surfaced only once O1 (or O2) was tried
        ("precision.num_losses", -1, r"expected None or an integer in \[1, 1024\]"),
        ("precision.cast_model_outputs", "int8", "no dtype of a model's outputs; use float32, float16 or bfloat16"),
        # an empty name monitored nothing: no best checkpoint, no early stopping, and no word of it
        ("checkpoint.monitor", "''", "expected null \\(no best checkpoint\\) or a metric's name"),
        ("early_stopping.monitor", "' '", "expected null \\(no early stopping\\) or a metric's name"),
        # nor did a prefix alone: the metric it looked for had no name
        ("checkpoint.monitor", "val/", "'val/' is invalid; expected null \\(no best checkpoint\\) or a metric's name"),
        (
            "early_stopping.monitor",
            "train/",
            "'train/' is invalid; expected null \\(no early stopping\\) or a metric's name",
        ),
    ],
)
def test_invalid_values_are_rejected_at_construction(tmp_path, key, value, expected):
    with pytest.raises(ConfigError, match=expected) as err:
        ToyTrainer(toy_cfg(tmp_path, **{key: value}))
    assert key in str(err.value)


@pytest.mark.parametrize("key", ["checkpoint.monitor", "early_stopping.monitor"])
@pytest.mark.parametrize(
    "monitor",
    ["val/loss\nval/acc", "val/\tloss", "val/loss\x00", "val/" + "x" * 100_000 + "\r"],
    ids=["newline", "tab", "nul", "100kB"],
)
def test_a_monitor_no_logged_tag_can_hold_is_refused_when_the_trainer_is_built(tmp_path, key, monitor):
    """A newline, tab or other control character is in no tag a run logs: such a monitor was accepted and failed only
    at the first validation, repeating a pasted 100 kB value whole."""
    cfg = toy_cfg(tmp_path)
    section, name = key.split(".")
    cfg[section] = {name: monitor}
    with pytest.raises(ConfigError, match=f"'{key}': .* is invalid; .*no newline, tab or control character") as err:
        ToyTrainer(cfg)
    assert len(str(err.value)) < 400


def test_a_long_monitor_is_named_by_its_start_and_length_when_it_cannot_be_met(tmp_path):
    """A pasted 100 kB name is a legal tag; a message about it named all of it."""
    cfg = toy_cfg(tmp_path, **{"trainer.val_every_n_epochs": 0, "trainer.val_every_n_steps": 0})
    cfg["checkpoint"] = {"monitor": "val/" + "x" * 100_000}
    with pytest.raises(
        ConfigError, match=r"monitors 'val/x{75}\.\.\. \(100006 characters\), but validation never"
    ) as err:
        ToyTrainer(cfg)
    assert len(str(err.value)) < 400


@pytest.mark.parametrize("monitor", ["val/acc@1", "loss/epoch", "val/top-1 acc", "train/loss", "val/précision"])
def test_odd_but_loggable_monitor_names_are_taken(tmp_path, monitor):
    cfg = toy_cfg(tmp_path)
    cfg["early_stopping"] = {"monitor": monitor}
    assert ToyTrainer(cfg).cfg.early_stopping.monitor == monitor


def test_a_huge_num_losses_is_refused_instead_of_making_a_scaler_for_each(tmp_path):
    """A scaler per loss_id is made up front, so 10**23 (a typo, a units slip) hung the construction."""
    cfg = toy_cfg(tmp_path, **{"precision.opt_level": "O1", "precision.num_losses": 10**15})
    expected = r"'precision.num_losses': 1000000000000000: expected None or an integer in \[1, 1024\]"
    with pytest.raises(ConfigError, match=expected):
        ToyTrainer(cfg)


class _RecordsUserCode(ToyTrainer):
    called = False

    def configure_model(self):
        type(self).called = True
        return super().configure_model()


def test_every_bad_key_is_named_at_once_before_user_code(tmp_path):
    cfg = toy_cfg(tmp_path, **{"checkpoint.keep_last": 0, "trainer.limit_val_batches": -1})
    with pytest.raises(ConfigError) as err:
        _RecordsUserCode(cfg).fit()
    assert "'trainer.limit_val_batches': -1" in str(err.value) and "'checkpoint.keep_last': 0" in str(err.value)
    assert not _RecordsUserCode.called and not (tmp_path / "run").exists()


def test_run_dir_under_a_file_is_refused_at_construction(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match=r"'run_dir': cannot create .*a_file' is not a directory"):
        ToyTrainer(toy_cfg(tmp_path, run_dir=str(tmp_path / "a_file" / "runs")))


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes through permission bits")
def test_read_only_run_dir_is_refused_before_fit_runs_user_code(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    _RecordsUserCode.called = False
    trainer = _RecordsUserCode(toy_cfg(tmp_path, run_dir=str(locked / "runs")))  # validate/predict may read it
    with pytest.raises(ConfigError, match=r"'run_dir': cannot create .*locked' is not writable"):
        trainer.fit()
    assert not _RecordsUserCode.called


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        ("trainer.max_epoch", " (did you mean 'trainer.max_epochs'?)"),  # misspelt
        ("precision.loss_scale_window", " (did you mean 'precision.scale_window'?)"),
        ("trainer.opt_level", " (did you mean 'precision.opt_level'?)"),  # another section's key
        ("logging.monitor", " (did you mean 'checkpoint.monitor' or 'early_stopping.monitor'?)"),
        ("trainer.learning_rate", ""),  # nothing near: no guess
        ("bogus", ""),
    ],
)
def test_an_unknown_key_names_the_nearest_valid_one(override, hint):
    """A typo or a key put in the wrong section is named with what was probably meant, before the list of the
    section's keys (which does not show a key of another section)."""
    with pytest.raises(ConfigError) as caught:
        build_config(Config, OmegaConf.from_dotlist([f"{override}=1"]))
    assert str(caught.value).startswith(f"unknown config key '{override}'{hint}; valid keys at ")


def test_cli_reports_bad_config_in_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """In this process: ``python -m ampkit`` is ``sys.exit(main())``, and a new Python spent seconds importing torch."""
    monkeypatch.chdir(REPO)
    assert main(["fit", "--config", "configs/digits.yaml", "trainer.max_epoch=2", f"run_dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    assert err.strip().startswith("ampkit: error: unknown config key 'trainer.max_epoch'")
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_run_dir_expands_home_and_variables_and_names_an_unset_one(monkeypatch):
    """docs/checkpoints.md: paths in the config expand ``~`` and ``$VAR`` as a shell would; an unset variable is an
    error naming it, not a directory called ``$SCRATCH`` under the working directory."""
    monkeypatch.setenv("HOME", "/home/someone")
    monkeypatch.setenv("AMPKIT_TEST_SCRATCH", "/scratch/job7")
    monkeypatch.delenv("AMPKIT_TEST_UNSET", raising=False)
    base = {"trainer_class": "toy_trainers:ToyTrainer"}
    assert build_config(Config, base, {"run_dir": "~/runs"}).run_dir == "/home/someone/runs"
    assert build_config(Config, base, {"run_dir": "$AMPKIT_TEST_SCRATCH/runs"}).run_dir == "/scratch/job7/runs"
    with pytest.raises(ConfigError, match="config key 'run_dir': .*names environment variable AMPKIT_TEST_UNSET"):
        build_config(Config, base, {"run_dir": "$AMPKIT_TEST_UNSET/runs"})
    # In braces, OmegaConf reads a config key first: its own resolver is the form that names a variable, and the
    # shell's form failed with no word of either
    assert build_config(Config, base, {"run_dir": "${oc.env:AMPKIT_TEST_SCRATCH}/runs"}).run_dir == "/scratch/job7/runs"
    expected = (
        "config key 'run_dir': Interpolation key 'AMPKIT_TEST_SCRATCH' not found: ${AMPKIT_TEST_SCRATCH} names a "
        "config key; an environment variable is $AMPKIT_TEST_SCRATCH or ${oc.env:AMPKIT_TEST_SCRATCH}"
    )
    with pytest.raises(ConfigError, match=re.escape(expected)):
        build_config(Config, base, {"run_dir": "${AMPKIT_TEST_SCRATCH}/runs"})


def test_resolved_config_is_saved_in_the_run_directory(tmp_path):
    trainer = ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_epochs": 1, "logging.tensorboard": False}))
    trainer.fit()
    saved = OmegaConf.load(trainer.version_dir / "config.yaml")
    assert saved.run_dir == str(tmp_path / "run") and saved.trainer.max_epochs == 1


@pytest.mark.parametrize(
    ("value", "same"),
    [
        ("bf16-mixed", "Lightning's autocast in bfloat16: opt_level O4, or O1 with precision.dtype=bfloat16"),
        ("16-mixed", "Lightning's autocast in float16 with a dynamic loss scaler: opt_level O1"),
        ("bf16-true", "Lightning's model in bfloat16: opt_level O3 with precision.dtype=bfloat16"),
        ("32-true", "float32: opt_level O0"),
        ("BF16-Mixed", "Lightning's autocast in bfloat16: opt_level O4"),  # named in any letter case
        ("o1", "opt_level O1, with a capital letter O"),  # a lowercase o said only "not the number zero"
        ("o5", "opt_level O5, with a capital letter O"),
    ],
)
def test_a_lightning_precision_as_opt_level_names_the_opt_level_that_does_the_same(tmp_path, value, same):
    with pytest.raises(
        ConfigError, match=rf"'precision.opt_level': {value!r} is invalid; expected one of O0.*is {same}"
    ):
        ToyTrainer(toy_cfg(tmp_path, **{"precision.opt_level": value}))


@pytest.mark.parametrize(
    "key, value",
    [
        ("trainer.progress_bar", 2),
        ("logging.tensorboard", -1),
        ("precision.skip_nonfinite", "maybe"),
        ("checkpoint.enabled", "2"),
        ("logging.throughput", 0.5),
    ],
)
def test_a_boolean_key_given_no_boolean_is_refused_naming_it(tmp_path, key, value):
    """OmegaConf reads any integer as a boolean: progress_bar=2 would silently mean true."""
    section, name = key.split(".")
    cfg = {**toy_cfg(tmp_path), section: {name: value}}
    with pytest.raises(ConfigError, match=rf"config key '{key}': {value!r} is not a boolean; expected true or false"):
        ToyTrainer(cfg)


@pytest.mark.parametrize("value, gives", [("${oc.env:AMPKIT_TEST_FLAG}", "'2'"), ("${trainer.max_epochs}", "5")])
def test_a_boolean_key_given_by_an_interpolation_to_no_boolean_is_refused(tmp_path, monkeypatch, value, gives):
    """OmegaConf converts what an interpolation resolves to the key's type, reading 2 (or '2') as true."""
    monkeypatch.setenv("AMPKIT_TEST_FLAG", "2")
    cfg = {**toy_cfg(tmp_path), "trainer": {"max_epochs": 5, "progress_bar": value}}
    with pytest.raises(
        ConfigError, match=rf"config key 'trainer.progress_bar': .* gives {gives}, which is not a boolean"
    ):
        ToyTrainer(cfg)


def test_a_boolean_key_given_by_an_interpolation_or_left_missing_still_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPKIT_TEST_FLAG", "false")
    path = _write(tmp_path, "trainer_class: toy_trainers:ToyTrainer\ntrainer:\n  progress_bar: ???\n")
    _, cfg = load_config(
        path, ["trainer.progress_bar=${oc.env:AMPKIT_TEST_FLAG}", "logging.throughput=${trainer.progress_bar}"]
    )
    assert cfg.trainer.progress_bar is False and cfg.logging.throughput is False


def test_yaml_and_command_line_booleans_still_read(tmp_path):
    path = _write(
        tmp_path, "trainer_class: toy_trainers:ToyTrainer\ntrainer:\n  progress_bar: no\nlogging:\n  tensorboard: off\n"
    )
    _, cfg = load_config(path, ["checkpoint.enabled=false", "logging.throughput=0"])
    assert not (cfg.trainer.progress_bar or cfg.logging.tensorboard or cfg.checkpoint.enabled or cfg.logging.throughput)
    with pytest.raises(ConfigError, match=r"config key 'trainer.progress_bar': 2 is not a boolean"):
        load_config(path, ["trainer.progress_bar=2"])


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("[0.9]", r"\[0.9\] has 1 item; expected 2 \(e.g. optim.betas=\[0.9, 0.95\]\)"),
        ("[0.9,0.9,0.9]", r"\[0.9, 0.9, 0.9\] has 3 items; expected 2"),
        pytest.param(  # a pasted list is named by its start and length, not repeated whole
            "[" + "0.9," * 1000 + "]",
            r"\[0.9, 0.9, .{69}\.\.\. \(5000 characters\) has 1000 items; expected 2 \(",
            id="1000 items",
        ),
        ("abc", r"'abc' is not a list; expected a list, e.g. optim.betas=\[0.9, 0.95\]"),
    ],
)
def test_a_pair_key_given_another_length_is_named(value, said):
    """A ``tuple[float, float]`` key (the GPT recipe's optim.betas) given one item: OmegaConf's error carries no key,
    so it read "config key '': TupleConfig length 1 does not match type hint length 2"."""
    with pytest.raises(ConfigError, match=rf"^config key 'optim.betas': {said}"):
        load_config("gpt", [f"optim.betas={value}"])
    assert tuple(load_config("gpt", ["optim.betas=[0.8,0.9]"])[1].optim.betas) == (0.8, 0.9)


@pytest.mark.parametrize("value", ["Dynamic", "DYNAMIC", "2**16"])
def test_a_bad_loss_scale_names_every_form_the_key_takes(tmp_path, value):
    """The config takes 'none' (no scaler) beside Apex's 'dynamic' and numbers: its error named only Apex's two, and
    a capitalised 'Dynamic' was not told apart from any other word."""
    cfg = toy_cfg(tmp_path, **{"precision.opt_level": "O1", "precision.loss_scale": value})
    with pytest.raises(ConfigError) as caught:
        ToyTrainer(cfg)
    said = str(caught.value)
    assert f"config key 'precision.loss_scale': {value!r}: expected 'dynamic', 'none' (no loss scaler) or a" in said
    assert ("written exactly 'dynamic'" in said) == (value.lower() == "dynamic")


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("precision.loss_scale", 10**400, "'precision.loss_scale': an integer of 401 digits: a static loss scale must"),
        ("trainer.max_time", 10**400, "'trainer.max_time': an integer of 401 digits is invalid; expected null"),
        ("trainer.max_time", {"hours": 10**400}, "'trainer.max_time': {'hours': 1000"),
        ("trainer.max_time", "1" + "0" * 400 + ":00:00", "'trainer.max_time': '1000"),
        ("trainer.max_steps", 10**400, "'trainer.max_steps': an integer of 401 digits is out of range; expected a 64"),
    ],
)
def test_an_integer_no_float_holds_is_a_config_error_naming_the_key(tmp_path, key, value, said):
    """The first four were a bare "OverflowError: int too large to convert to float" naming no key; an int key's
    range error showed all 401 digits."""
    section, name = key.split(".")
    cfg = toy_cfg(tmp_path, **{"precision.opt_level": "O1"})
    cfg.setdefault(section, {})[name] = value
    with pytest.raises(ConfigError) as caught:
        ToyTrainer(cfg)
    assert said in str(caught.value)


@dataclasses.dataclass
class _OptimWithRequiredLr:
    lr: float = MISSING
    schedule: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _RequiredLrConfig(Config):
    optim: _OptimWithRequiredLr = dataclasses.field(default_factory=_OptimWithRequiredLr)


class _RequiredLrTrainer(ToyTrainer):
    config_class = _RequiredLrConfig


@pytest.mark.parametrize(
    ("optim", "said"),
    [
        ({}, "config key 'optim.lr' is required and has no value (the schema's '???'); set it, e.g. optim.lr=..."),
        ({"lr": "???"}, "config key 'optim.lr' is required and has no value"),
        (
            {"lr": 0.1, "schedule": [1, 2]},
            "config key 'optim.schedule' is a section, not a value ([1, 2]); set its keys instead "
            "(optim.schedule.<key>=...): a mapping of its own keys, e.g. optim.schedule={name: value}",
        ),
    ],
)
def test_a_required_key_left_unset_and_a_free_mapping_given_a_list_say_what_to_write(tmp_path, optim, said):
    """OmegaConf's "Missing mandatory value: lr" and a section message ending in ': ' (a dict field names no keys of
    its own) said neither what the key needs nor how to write it."""
    with pytest.raises(ConfigError) as caught:
        _RequiredLrTrainer({"run_dir": str(tmp_path), "trainer": {"device": "cpu"}, "optim": optim})
    assert said in str(caught.value)


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("trainer.max_steps", "x" * 100_000, r"'x{79}\.\.\. \(100002 characters\) is not an integer; expected -1"),
        ("precision.opt_level", "O" * 100_000, r"'O{79}\.\.\. \(100002 characters\) is invalid; expected one of O0"),
        ("trainer.max_epochs", 10**5000, r"an integer of 5001 digits is out of range"),
    ],
    ids=["long-string", "long-enum-string", "5001-digits"],
)
def test_a_huge_config_value_is_named_by_its_start_and_length_not_repeated_whole(key, value, said):
    """A 100 kB string pasted into a key came back whole in the error, and an integer past 4300 digits failed in
    str() inside the message; each is named by its start and its size."""
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=said) as caught:
        check_values(build_config(Config, {"trainer_class": "toy_trainers:ToyTrainer", section: {name: value}}))
    assert len(str(caught.value)) < 400


@pytest.mark.parametrize(
    "key", ["trainer.device", "precision.loss_scale", "trainer.limit_train_batches", "distributed.strategy"]
)
def test_a_long_string_where_a_trainer_checks_the_key_is_named_by_its_start_and_length(tmp_path, key):
    """The device's, the loss scale's, a union-typed key's and the strategy's refusals each repeated a 100 kB value
    whole."""
    section, name = key.split(".")
    cfg = toy_cfg(tmp_path)
    cfg.setdefault(section, {})[name] = "x" * 100_000
    with pytest.raises(ConfigError, match=rf"config key '{key}': 'x{{79}}\.\.\. \(100002 characters\)") as caught:
        ToyTrainer(cfg)
    assert len(str(caught.value)) < 400


def test_a_long_malformed_interpolation_is_named_by_its_start_and_length(tmp_path):
    """An unclosed ${ in front of a 100 kB value came back whole in the error."""
    config = tmp_path / "long.yaml"
    config.write_text(f"trainer_class: toy_trainers:ToyTrainer\nname: ${{{'x' * 100_000}\n")
    with pytest.raises(ConfigError, match=r"'name': '\$\{x{77}\.\.\. \(100004 characters\) is no valid") as caught:
        load_config(config)
    assert len(str(caught.value)) < 400


def test_an_opt_level_written_02_which_yaml_reads_as_the_number_2_is_named_so(tmp_path):
    """YAML reads 02 (a zero, not the letter O) as the number 2, and the error named '2' as an unknown level."""
    config = tmp_path / "zero.yaml"
    config.write_text(
        f"trainer_class: toy_trainers:ToyTrainer\nrun_dir: {tmp_path / 'run'}\nprecision:\n  opt_level: 02\n"
    )
    trainer_class, cfg = load_config(config)
    with pytest.raises(
        ConfigError, match=r"YAML reads 02 and 2 as the number 2: an opt level starts with the letter O: O2"
    ):
        trainer_class(cfg)


@pytest.mark.parametrize(
    ("precision", "said"),
    [
        ({"opt_level": "02"}, "'02' starts with the number zero, not the letter O; write O2"),
        ({"opt_level": "'O2'"}, "\"'O2'\" holds its quote marks, as a value quoted twice does; write O2"),
        ({"opt_level": " O2 "}, "' O2 ' has spaces around it; write O2"),
        ({"opt_level": "16"}, "'16' is Lightning's precision=16 (16-mixed), autocast in float16"),
        ({"opt_level": "O1", "dtype": "bf-16"}, "'bf-16' reads as bfloat16; write bfloat16"),
        ({"opt_level": "O1", "dtype": "16-mixed"}, "precision '16-mixed' is two settings here: dtype float16 and opt"),
        ({"opt_level": "O2", "cast_model_outputs": "float-16"}, "'float-16' reads as float16; write float16"),
        ({"opt_level": "O1", "skip_nonfinite": "true "}, "'true ' has spaces around it; write true"),
        ({"opt_level": "O2", "keep_batchnorm_fp32": "true"}, "'true' is the string 'True' spelt otherwise: write True"),
    ],
    ids=["02", "quoted twice", "padded", "lightning 16", "bf-16", "16-mixed dtype", "float-16", "padded bool", "true"],
)
def test_a_precision_value_that_looks_like_a_valid_one_is_refused_naming_both(tmp_path, precision, said):
    """Each was refused naming only the value (or, for a padded boolean, in OmegaConf's words), leaving the user to
    spot a zero for an O, a second pair of quotes, a space or a dash."""
    cfg = {"trainer_class": "toy_trainers:ToyTrainer", "run_dir": str(tmp_path), "precision": precision}
    with pytest.raises(ConfigError, match=re.escape(said)):
        ToyTrainer(cfg)


def test_a_padded_or_quoted_choice_of_any_key_is_named_with_the_choice_meant():
    with pytest.raises(ConfigError, match=re.escape("(' host' has spaces around it; write host)")):
        check_values(build_config(Config, {"trainer_class": "x:y", "trainer": {"skip_verdict": " host"}}))
    with pytest.raises(ConfigError, match=re.escape("('\"nccl\"' holds its quote marks, as a value quoted twice")):
        check_values(build_config(Config, {"trainer_class": "x:y", "distributed": {"backend": '"nccl"'}}))
