"""The command line: --version, help that lists config keys, --print-config, one-line errors and --debug."""

from __future__ import annotations

import re
import sys
import warnings

import pytest
from omegaconf import OmegaConf

import ampkit
from ampkit.cli import main
from ampkit.trainer.checkpoint_io import load_checkpoint
from ampkit.trainer.ordering import CallbackOrderError


def _config(tmp_path, trainer_class: str = "toy_trainers:ToyTrainer", **settings) -> str:
    path = tmp_path / "run.yaml"
    OmegaConf.save(
        OmegaConf.create({"trainer_class": trainer_class, "run_dir": str(tmp_path / "runs"), **settings}), path
    )
    return str(path)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"ampkit {ampkit.__version__} (torch ")


def test_help_lists_config_keys_with_defaults_and_no_rest_markup(tmp_path, capsys):
    helps = [["--help"], *([command, "--help"] for command in ("fit", "validate", "test", "predict"))]
    for argv in (*helps, ["validate", "--config", _config(tmp_path), "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0, argv
        text = capsys.readouterr().out
        assert "``" not in text and ":class:" not in text
        if argv[0] != "--help":
            assert any(line.split()[:2] == ["trainer.max_epochs", "1"] for line in text.splitlines())
            assert re.search(r"^  trainer\.device +auto +auto \| cpu \| cuda \| cuda:N$", text, re.M)
    assert "config keys of ToyTrainer" in text
    assert any(line.split() == ["data.batch_size", "8"] for line in text.splitlines())  # the Trainer's own keys


def test_a_command_without_help_never_builds_the_keys_table(tmp_path, monkeypatch, capsys):
    """The table of every config key (read from the schema's source) took a second to build for each command, on
    every run: it is built for ``--help`` only."""

    def refused(*args, **kwargs):
        raise AssertionError("the help's table of config keys was built for a command without --help")

    monkeypatch.setattr(ampkit.cli, "help_text", refused)
    assert main(["fit", "--config", _config(tmp_path), "--print-config"]) == 0
    assert "trainer_class" in capsys.readouterr().out


def test_top_level_help_says_predict_saves_only_with_output(capsys):
    """``ampkit predict`` runs without --output and then saves nothing, so its summary names --output."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    summary = capsys.readouterr().out.split("    predict", 1)[1].split("options:")[0]
    assert "--output" in summary


def test_help_with_a_config_shows_that_files_values_and_every_keys_meaning(tmp_path, capsys):
    """``fit --config f --help`` is how a user checks what a file sets: its values, not the schema's defaults,
    and the meanings of the keys the Trainer's schema inherits."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", _config(tmp_path, trainer={"max_steps": 7}, data={"batch_size": 3}), "--help"])
    assert exit_info.value.code == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["trainer.max_steps", "7"] == next(line[:2] for line in lines if line[:1] == ["trainer.max_steps"])
    assert ["data.batch_size", "3"] in lines
    assert ["run_dir", str(tmp_path / "runs"), "each", "fresh", "run"] == next(
        line[:5] for line in lines if line[:1] == ["run_dir"]
    )


def test_print_config_prints_the_resolved_config_and_does_not_train(tmp_path, capsys):
    assert main(["fit", "--config", _config(tmp_path, name="toy"), "--print-config", "trainer.max_epochs=7"]) == 0
    printed = OmegaConf.create(capsys.readouterr().out)
    assert printed.trainer.max_epochs == 7 and printed.data.batch_size == 8
    assert printed.run_dir == str(tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


def test_print_config_of_a_value_no_run_takes_prints_it_and_names_it(tmp_path, capsys):
    """--print-config is how a user checks a config: opt_level O7 was printed with exit status 0, as if fine."""
    config = _config(tmp_path, name="toy")
    assert main(["fit", "--config", config, "--print-config", "precision.opt_level=O7"]) == 2
    captured = capsys.readouterr()
    assert OmegaConf.create(captured.out).precision.opt_level == "O7"
    assert re.search(r"^ampkit: error: .*opt_level.*'O7'", captured.err, re.M), captured.err
    assert not (tmp_path / "runs").exists()


def test_overrides_may_come_on_both_sides_of_an_option(tmp_path, capsys):
    """``fit --config f trainer.max_steps=9 --resume last trainer.seed=1`` is how a resume command grows: every
    override applies, later ones winning, and a stray word or option is still an error naming it."""
    config = _config(tmp_path)
    argv = [
        "fit",
        "--config",
        config,
        "trainer.max_epochs=7",
        "--print-config",
        "trainer.seed=3",
        "trainer.max_epochs=5",
    ]
    assert main(argv) == 0
    printed = OmegaConf.create(capsys.readouterr().out)
    assert printed.trainer.max_epochs == 5 and printed.trainer.seed == 3
    for stray in (["--bogus", "x"], ["seed"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--config", config, "trainer.max_epochs=7", "--print-config", *stray])
        assert exit_info.value.code == 2
        assert f"unrecognized arguments: {' '.join(stray)}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        (["--trainer.max_epochs=3"], "trainer.max_epochs=3"),
        (["--trainer.max_epochs", "3"], "trainer.max_epochs=3"),  # LightningCLI's spelling
        (["--lr=0.1"], "lr=0.1"),
        (["--trainer.max_epochs"], "trainer.max_epochs=<value>"),
    ],
)
def test_a_config_key_given_as_an_option_is_shown_as_an_override(tmp_path, capsys, given, meant):
    """argparse's answer, "unrecognized arguments: --trainer.max_epochs=3", did not say how ampkit takes a key."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", _config(tmp_path), *given])
    assert exit_info.value.code == 2
    assert f"a config key is set without dashes, as key=value: {meant}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "option", "first", "second"),
    [
        ("fit", "--config", None, "other.yaml"),
        ("fit", "--resume", "last", "best"),
        ("predict", "--output", "a.pt", "b.pt"),
    ],
)
def test_an_option_given_twice_with_two_values_is_refused_naming_both(tmp_path, capsys, command, option, first, second):
    """The second value was taken and the first dropped without a word: ``--config base.yaml --config exp.yaml``
    ran exp.yaml alone, where LightningCLI merges the two. The same value twice is no conflict."""
    config = _config(tmp_path)
    first = config if first is None else first
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--config", config, option, first, option, second, "--print-config"])
    assert exit_info.value.code == 2
    assert f"argument {option}: given twice ({first!r}, then {second!r}); give it once" in capsys.readouterr().err
    assert main(["fit", "--config", config, "--config", config, "--print-config"]) == 0
    assert not (tmp_path / "runs").exists()


def test_an_option_given_twice_with_a_long_value_names_it_by_its_start_and_length(tmp_path, capsys):
    """A pasted 100 kB value was repeated whole in the usage error."""
    with pytest.raises(SystemExit):
        main(["fit", "--config", _config(tmp_path), "--resume", "last", "--resume", "x" * 100_000, "--print-config"])
    err = capsys.readouterr().err
    assert "given twice ('last', then 'xxxx" in err and "... (100002 characters)); give it once" in err
    assert len(err) < 2000


@pytest.mark.parametrize(
    ("trainer_class", "override", "message"),
    [
        (
            "toy_trainers:ToyTrainer",
            "trainer.max_epoch=2",
            "unknown config key 'trainer.max_epoch' (did you mean 'trainer.max_epochs'?); valid keys at",
        ),  # fmt: skip
        ("toy_trainers:DuplicateCallbacksTrainer", "trainer.max_epochs=1", "callback state_key must be unique, got"),
    ],
)
def test_user_errors_are_one_line_and_debug_shows_the_traceback(tmp_path, capsys, trainer_class, override, message):
    config = _config(tmp_path, trainer_class, logging={"tensorboard": False})
    assert main(["fit", "--config", config, override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"ampkit: error: {message}")
    assert err.rstrip().endswith("(--debug shows the traceback)")
    expected = CallbackOrderError if "Duplicate" in trainer_class else ampkit.ConfigError
    with pytest.raises(expected, match=re.escape(message.split(";")[0])):
        main(["fit", "--config", config, override, "--debug"])


def test_evaluation_commands_report_errors_in_one_line_too(tmp_path, capsys):
    config = _config(tmp_path, logging={"tensorboard": False})
    assert main(["validate", "--config", config, "--ckpt", "best"]) == 2  # nothing trained under run_dir yet
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ampkit: error: validate: no 'best.pt' under ")
    with pytest.raises(ampkit.CheckpointError):
        main(["validate", "--config", config, "--ckpt", "best", "--debug"])
    assert main(["fit", "--config", config, "trainer.progress_bar=false"]) == 0
    capsys.readouterr()
    assert main(["test", "--config", config]) == 2  # last.pt exists now; ToyTrainer has no test_dataloader
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ampkit: error: ToyTrainer.test() needs test_dataloader()")
    assert main(["predict", "--config", config, "--output", str(tmp_path / "p.pt"), "--print-config"]) == 0
    assert OmegaConf.create(capsys.readouterr().out).run_dir == str(tmp_path / "runs")


def test_the_final_line_says_when_the_validation_it_shows_ran(tmp_path, capsys):
    """A resume that does not validate again shows the checkpoint's metrics: the line says they are not this step's."""
    config = _config(tmp_path, trainer={"progress_bar": False}, logging={"tensorboard": False})
    assert main(["fit", "--config", config, "trainer.max_epochs=1"]) == 0
    first = capsys.readouterr().out
    steps = int(re.search(r"finished (\d+) steps", first)[1])
    assert "val/mse=" in first and "validated at" not in first
    argv = ["fit", "--config", config, "trainer.max_epochs=2", "trainer.val_every_n_epochs=0", "--resume", "last"]
    assert main(argv) == 0
    assert f"(validated at step {steps})" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("max_steps", "trained"),
    [(8, "8 steps in 1 epoch"), (11, "11 steps in 1 epoch and 3 batches"), (3, "3 steps in 3 batches")]
    + [(1, "1 step in 1 batch")],  # not "1 steps"
)
def test_the_final_line_counts_a_partly_run_epoch_as_batches(tmp_path, capsys, max_steps, trained):
    """A stop inside an epoch (max_steps here; max_time and early stopping alike) ran only part of it."""
    config = _config(tmp_path, trainer={"progress_bar": False, "max_epochs": 3}, logging={"tensorboard": False})
    assert main(["fit", "--config", config, f"trainer.max_steps={max_steps}"]) == 0
    assert re.search(rf"finished {trained}[;\n]", capsys.readouterr().out)


def test_the_final_line_after_a_resume_on_other_batches_says_which_batches_it_counts(tmp_path, capsys):
    """A checkpoint 2 batches of 16 into its epoch resumed with batches of 8 (as 2 ranks' resumed on 1) continues at
    batch 4 of this run's: 3 steps later the line read "finished 5 steps in 7 batches", as if 2 had not stepped.
    It says whose batches it counts, where the line ends in that epoch (a later one's batches are all this run's).
    A resume on as many samples a batch (2 ranks x 8 on 1 x 16) keeps its count and says nothing more."""
    config = _config(tmp_path, trainer={"progress_bar": False, "max_epochs": 1}, logging={"tensorboard": False},
                     data={"batch_size": 16})  # fmt: skip
    assert main(["fit", "--config", config, "trainer.max_steps=2"]) == 0
    capsys.readouterr()
    assert main(["fit", "--config", config, "data.batch_size=8", "trainer.max_steps=5", "--resume", "last"]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"^ampkit: finished 5 steps in 7 batches of 8 samples \(1 rank x 8\), the first 4 of them the resumed "
        r"checkpoint's 2 batches of 16 samples \(1 rank x 16\)$",
        out,
        re.M,
    ), out
    from ampkit.cli import _trained_span
    from ampkit.trainer.batch_layout import rescaling

    two_ranks, one_rank = {"ranks": 2, "batch_size": 8}, {"ranks": 1, "batch_size": 8}
    moved = rescaling(1, two_ranks, one_rank, 3, 6)
    assert _trained_span(1, 9, moved) == (
        "1 epoch and 9 batches of 8 samples (1 rank x 8), the first 6 of them the resumed checkpoint's 3 batches of "
        "16 samples (2 ranks x 8)"
    )
    assert _trained_span(2, 9, moved) == "2 epochs and 9 batches"  # a later epoch: every batch is this run's
    assert rescaling(1, two_ranks, {"ranks": 1, "batch_size": 16}, 3, 3) is None  # as many samples a batch


def test_the_interrupt_hint_names_the_sharded_checkpoint_resume_last_continues_when_its_link_is_lost(tmp_path):
    """A copy that drops links (rsync without -l) loses a sharded run's ``last``; --resume last continues from the
    newest complete checkpoint directory, which the hint of an interrupted fit names, not 'before its first'."""
    from ampkit.cli import _resume_hint

    step = tmp_path / "version_0" / "checkpoints" / "step-00000003"
    step.mkdir(parents=True)
    (step / ".metadata").touch()
    (step / "trainer.pt").touch()
    assert _resume_hint(OmegaConf.create({"run_dir": str(tmp_path)})) == f" (--resume last continues from {step})"


def test_an_interrupted_fit_names_the_step_it_stopped_at_and_the_step_resume_continues_from(tmp_path, capsys):
    """A Ctrl-C saves nothing: the hint said only which file --resume last continues from, so a user took the steps
    since that checkpoint for kept."""
    quiet = {"progress_bar": False}
    config = _config(tmp_path, "toy_trainers:CtrlCToyTrainer", trainer=quiet, logging={"tensorboard": False})
    assert main(["fit", "--config", config, "trainer.max_epochs=3"]) == 130
    last = tmp_path / "runs" / "version_0" / "checkpoints" / "last.pt"
    assert (
        capsys.readouterr().err
        == f"ampkit: interrupted (--resume last continues from {last}, saved at step 8; this run reached step 10)\n"
    )


RESUMED_FROM = "(--resume last continues from {last}"


@pytest.mark.parametrize(
    ("sent", "status", "said"),
    [
        ("TERM", 143, f"ampkit: SIGTERM: stopping at step 11\nampkit: terminated (SIGTERM) {RESUMED_FROM})"),
        ("HUP", 129, f"ampkit: hung up (SIGHUP) {RESUMED_FROM}, saved at step 8; this run reached step 10)"),
    ],
)
def test_a_preempted_or_hung_up_fit_exits_with_a_status_of_its_own_and_resume_last_finishes_it(
    tmp_path, capsys, monkeypatch, sent, status, said
):
    """What a wrapper script or a scheduler's requeue rule reads: a fit stopped by SIGTERM (a preemption, its step
    saved) or SIGHUP exits 143 or 129 ("resume me"), never 0, 2 (bad input) or the 1 of a crash, whose traceback
    Python prints; then --resume last finishes the run."""
    monkeypatch.setenv("AMPKIT_TEST_SIGNAL", sent)
    quiet = {"progress_bar": False}
    config = _config(tmp_path, "toy_trainers:SignalledToyTrainer", trainer=quiet, logging={"tensorboard": False})
    assert main(["fit", "--config", config, "trainer.max_epochs=3"]) == status
    last = tmp_path / "runs" / "version_0" / "checkpoints" / "last.pt"
    assert capsys.readouterr().err == said.format(last=last) + "\n"
    assert load_checkpoint(last)["loop"]["global_step"] == (11 if sent == "TERM" else 8)
    assert main(["fit", "--config", config, "trainer.max_epochs=3", "--resume", "last"]) == 0
    assert load_checkpoint(last)["loop"]["global_step"] == 24
    monkeypatch.setenv("AMPKIT_TEST_SIGNAL", "crash")
    with pytest.raises(RuntimeError, match="a batch this step cannot take"):  # Python's status 1, with its traceback
        main(["fit", "--config", config, "trainer.max_epochs=3", f"run_dir={tmp_path / 'crashed'}"])


def _show_warnings_as_python_does(monkeypatch) -> None:
    """Python's own way to show a warning (pytest records them instead): ``warnings.formatwarning`` to stderr."""

    def show(message, category, filename, lineno, file=None, line=None):
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    monkeypatch.setattr(warnings, "showwarning", show)


def test_ampkits_own_warnings_print_as_one_line_without_its_source(tmp_path, capsys, monkeypatch):
    """A command's warning printed the path inside ampkit that raised it and that source line
    (``rank_zero_warn(why)``), noise to a user of the command; a warning from elsewhere keeps its place."""
    _show_warnings_as_python_does(monkeypatch)
    settings = {
        "trainer": {"progress_bar": False, "val_every_n_epochs": 0, "val_every_n_steps": 100},
        "logging": {"tensorboard": False},
    }
    config = _config(tmp_path, checkpoint={"monitor": "val/mse"}, **settings)
    assert main(["fit", "--config", config]) == 0
    err = capsys.readouterr().err
    assert err.startswith("ampkit: warning: validation never runs in this run: ") and err.count("\n") == 1
    with warnings.catch_warnings():  # restored after the command: a script's warnings are Python's again
        warnings.simplefilter("always")
        warnings.warn("outside the command", stacklevel=1)
    assert f"{__file__}:" in capsys.readouterr().err


def test_a_best_checkpoint_a_run_never_kept_says_why_and_names_last(tmp_path, capsys):
    """The GPT example cut short (``trainer.max_steps=30``, validation every 100) keeps no best.pt, and the
    documented ``predict --ckpt best`` said only "no 'best.pt' ... (pass a path)"."""
    settings = {"trainer": {"progress_bar": False}, "logging": {"tensorboard": False}}
    config = _config(tmp_path, checkpoint={"monitor": "val/mse"}, **settings)
    assert main(["fit", "--config", config, "trainer.val_every_n_epochs=0", "trainer.val_every_n_steps=100"]) == 0
    capsys.readouterr()
    assert main(["predict", "--config", config, "--ckpt", "best"]) == 2
    last = tmp_path / "runs" / "version_0" / "checkpoints" / "last.pt"
    assert f"best.pt is kept only where checkpoint.monitor ('val/mse') was logged at a save; '{last}' is the" in (
        capsys.readouterr().err
    )
    assert main(["validate", "--config", config, "--ckpt", "last"]) == 0  # the named alternative loads
    capsys.readouterr()
    assert main(["fit", "--config", config, "--resume", "best"]) == 2  # fit --resume best alike, naming --resume last
    assert f"was logged at a save; '{last}' is the newest checkpoint (--resume last)" in capsys.readouterr().err


def test_the_bare_command_and_help_say_where_to_start_and_name_the_built_in_configs(capsys):
    """A first ``ampkit`` printed only "the following arguments are required: COMMAND", and no help named the
    built-in configs ``--config`` accepts, so a newcomer outside a checkout had no config to start from."""
    assert main([]) == 2
    bare = capsys.readouterr().err
    assert "    fit " in bare and "ampkit fit --config digits (built-in configs: digits, gpt)" in bare
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    assert "or a built-in config (digits, gpt)" in " ".join(capsys.readouterr().out.split())
