"""An odd environment around a run: torchrun's variables set by hand (``WORLD_SIZE`` without ``MASTER_ADDR``, a rank
that is no number or beyond the world) or ampkit's switches (``AMPKIT_OPS``, ``AMPKIT_FUSED_BACKEND``,
``AMPKIT_CUDA_KERNELS``) holding a misspelt value. Each is one line naming the variable and what is valid, before
anything is written, not int()'s or torch's rendezvous traceback, nor an error at the first fused op mid-epoch.
A terminal that hangs up (SIGHUP) leaves a resumable run and a last line saying so."""

from __future__ import annotations

import os
import re
import signal
import sys
import warnings

import pytest
import torch
from omegaconf import OmegaConf
from toy_trainers import ToyTrainer, toy_cfg

from ampkit.cli import main
from ampkit.config import ConfigError
from ampkit.ops.optimizers import FusedAdam

QUIET = {"logging.tensorboard": False, "trainer.progress_bar": False, "logging.throughput": False}

LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")
SWITCHES = ("AMPKIT_OPS", "AMPKIT_FUSED_BACKEND", "AMPKIT_CUDA_KERNELS")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in LAUNCH_VARIABLES + SWITCHES:
        monkeypatch.delenv(name, raising=False)


class FusedToy(ToyTrainer):
    """Steps with ampkit's FusedAdam, which reads the ops switches at its first step."""

    def configure_optimizers(self):
        return FusedAdam(self.module.parameters(), lr=self.cfg.lr)


@pytest.mark.parametrize(
    "environment, message",
    [
        ({"WORLD_SIZE": "two"}, r"environment variable WORLD_SIZE='two' is not an integer >= 1 \(torchrun sets"),
        ({"WORLD_SIZE": "0"}, r"WORLD_SIZE='0' is not an integer >= 1"),
        ({"LOCAL_RANK": "gpu0"}, r"environment variable LOCAL_RANK='gpu0' is not an integer >= 0"),
        ({"RANK": "-1"}, r"environment variable RANK='-1' is not an integer >= 0"),
        ({"TORCHELASTIC_RESTART_COUNT": "x"}, r"environment variable TORCHELASTIC_RESTART_COUNT='x' is not an integer"),
        (
            {"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
            r"environment variable RANK=2 is not below WORLD_SIZE=2 \(torchrun sets WORLD_SIZE, RANK and LOCAL_RANK",
        ),
        (  # a hand-set or leftover LOCAL_RANK: the rank waited for a rendezvous until its 300 s timeout
            {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
            r"environment variable LOCAL_RANK=3 is not below WORLD_SIZE=2 \(torchrun sets",
        ),
        (  # processes started by hand without WORLD_SIZE: each trained alone, all of them into one run_dir
            {"RANK": "1"},
            r"environment variable RANK=1 is set but WORLD_SIZE is not: a rank > 0 needs a world \(torchrun sets",
        ),
        ({"AMPKIT_OPS": "kernels"}, r"AMPKIT_OPS='kernels' is not valid; use one of auto, reference, kernel"),
        (  # a 100 kB value was repeated whole
            {"WORLD_SIZE": "x" * 100_000, "AMPKIT_OPS": "k" * 100_000},
            r"WORLD_SIZE='x{79}\.\.\. \(100002 characters\) is not an integer >= 1 .*; AMPKIT_OPS='k{79}\.\.\. "
            r"\(100002 characters\) is not valid",
        ),
        (
            {"AMPKIT_FUSED_BACKEND": "apex"},
            r"AMPKIT_FUSED_BACKEND: invalid fused backend 'apex'; expected one of auto, torch, ampkit",
        ),
        (
            {"AMPKIT_CUDA_KERNELS": "fast", "AMPKIT_OPS": "x"},
            r"AMPKIT_OPS='x' is not valid.*; AMPKIT_CUDA_KERNELS='fast' is not valid; use per_tensor \(the default\) "
            r"or multi_tensor",
        ),
    ],
)
def test_an_unusable_launch_variable_or_ops_switch_is_one_line_before_anything_is_written(
    tmp_path, monkeypatch, capsys, environment, message
):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    config = tmp_path / "run.yaml"
    settings = {**toy_cfg(tmp_path), "trainer_class": f"{__name__}:FusedToy"}
    settings.update(logging={"tensorboard": False}, trainer={"device": "cpu", "max_steps": 2, "progress_bar": False})
    OmegaConf.save(settings, config)
    assert main(["fit", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ampkit: error: "), err
    assert re.search(message, err[0]), err[0]
    assert not (tmp_path / "run").exists()


def test_world_size_without_torchrun_s_rendezvous_variables_names_them_and_the_launch(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    trainer = ToyTrainer(toy_cfg(tmp_path, **{"trainer.max_steps": 2}))
    with pytest.raises(ConfigError) as raised:
        trainer.fit()
    assert str(raised.value) == (
        "WORLD_SIZE=2 asks for 2 processes, but MASTER_ADDR, MASTER_PORT are not set: launch with torchrun "
        "--nproc-per-node 2 (it sets them for each process), or unset WORLD_SIZE to train in one process"
    )
    assert not (tmp_path / "run").exists()


def test_a_cuda_kernel_choice_misspelt_is_refused_by_the_python_ops_too(monkeypatch):
    """On CUDA an op without a checked kernel asks Python, not C++, which kernels to run: a misspelt value there
    must not quietly mean the default."""
    from ampkit.ops.optimizers._kernels import UNCHECKED_ON_CUDA, op

    monkeypatch.setenv("AMPKIT_CUDA_KERNELS", "multi-tensor")
    with pytest.raises(ValueError, match=r"AMPKIT_CUDA_KERNELS='multi-tensor' is not valid; use per_tensor"):
        op(next(iter(UNCHECKED_ON_CUDA)), torch.device("cuda"))


class HangUpAtStep3(ToyTrainer):
    """Its terminal closes (SIGHUP to itself) in the third step, after the checkpoint of step 2."""

    def training_step(self, batch):
        if self.state.global_step == 2:
            os.kill(os.getpid(), signal.SIGHUP)
        return super().training_step(batch)


def _hang_up_config(tmp_path) -> str:
    config = tmp_path / "run.yaml"
    settings = {**toy_cfg(tmp_path), "trainer_class": f"{__name__}:HangUpAtStep3"}
    settings.update(logging={"tensorboard": False}, trainer={"device": "cpu", "max_steps": 6, "progress_bar": False})
    settings.update(checkpoint={"every_n_steps": 2})
    OmegaConf.save(settings, config)
    return str(config)


def test_a_sighup_ends_the_cli_run_with_a_last_line_and_leaves_it_resumable(tmp_path, capsys):
    """SIGHUP's default action ended the process at once: no last line, the run lock left behind."""
    config = _hang_up_config(tmp_path)
    outside = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a terminal's (under nohup, the test's runner ignores it)
    try:
        assert main(["fit", "--config", config]) == 129
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, outside)
    last = tmp_path / "run" / "version_0" / "checkpoints" / "last.pt"
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"ampkit: hung up (SIGHUP) (--resume last continues from {last})"
    )
    assert not (tmp_path / "run" / "version_0" / "run.lock").exists()
    with pytest.MonkeyPatch.context() as patch:  # the resumed run's step 2 is no new hang-up
        patch.setattr(HangUpAtStep3, "training_step", ToyTrainer.training_step)
        assert main(["fit", "--config", config, "--resume", "last"]) == 0
    assert "finished 6 steps" in capsys.readouterr().out


def test_a_sighup_the_caller_ignores_stays_ignored(tmp_path):
    """``nohup ampkit fit ...``: the run goes on after its terminal closes."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert main(["fit", "--config", _hang_up_config(tmp_path)]) == 0
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_the_tensorboard_command_of_a_run_dir_with_a_space_pastes_as_one_argument(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    run_dir = tmp_path / "my runs" / "ünï"
    settings = {**toy_cfg(tmp_path), "run_dir": str(run_dir)}
    settings.update(trainer={"device": "cpu", "max_steps": 1, "progress_bar": False})
    OmegaConf.save(settings, config)
    assert main(["fit", "--config", str(config)]) == 0
    version = run_dir / "version_0"
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        f"ampkit: run directory {version} (tensorboard --logdir '{version}')"
    )
    # a run that wrote no TensorBoard events is pointed at no TensorBoard
    assert main(["fit", "--config", str(config), "logging.tensorboard=false"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"ampkit: run directory {run_dir / 'version_1'}"


def test_a_config_file_indented_with_a_tab_names_the_tab(tmp_path, capsys):
    """PyYAML says "found character that cannot start any token", which names no character; an editor shows none."""
    config = tmp_path / "run.yaml"
    config.write_text("trainer_class: toy_trainers:ToyTrainer\ntrainer:\n\tmax_steps: 2\n")
    assert main(["fit", "--config", str(config)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"ampkit: error: config file '{config}' is not valid YAML: a tab at line 3, column 1: YAML indents with "
        "spaces, never tabs (--debug shows the traceback)"
    )


def test_a_local_rank_beyond_the_gpus_is_named_under_gloo_too(monkeypatch):
    """distributed.backend=gloo on a GPU machine still trains each rank on cuda:LOCAL_RANK: a rank beyond the GPUs
    failed later with CUDA's 'invalid device ordinal'."""
    from ampkit.config import Config
    from ampkit.trainer.distributed import setup_distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    cfg = OmegaConf.structured(Config)
    cfg.distributed.backend = "gloo"
    with pytest.raises(ConfigError, match=r"LOCAL_RANK 1 needs cuda:1, but this machine has 1 GPU\(s\)"):
        setup_distributed(cfg)


def test_no_run_swaps_the_process_warning_filters_nor_leaves_them_changed(tmp_path, monkeypatch):
    """Two unseeded runs may share a process, one a thread: ``warnings.catch_warnings`` swaps the filters of the whole
    process, so one run's exit put back filters under the other's feet (a filter its code installed meanwhile lost,
    a warning it hid shown). No ampkit code enters one in a fit, a resume, a validate or a sharded checkpoint's load,
    and each leaves the filters and ``showwarning`` as it found them."""
    entered: list[str] = []

    class Recorded(warnings.catch_warnings):
        def __enter__(self):
            entered.append(sys._getframe(1).f_globals.get("__name__", "?"))
            return super().__enter__()

    monkeypatch.setattr(warnings, "catch_warnings", Recorded)
    before = (list(warnings.filters), warnings.showwarning)
    sharded = {"trainer.max_steps": 2, "distributed.strategy": "fsdp", "trainer.seed": "null"}
    ToyTrainer(toy_cfg(tmp_path / "fsdp", **QUIET, **sharded)).fit()
    last = next((tmp_path / "fsdp").rglob("checkpoints/last"))
    ToyTrainer(toy_cfg(tmp_path / "fsdp", **QUIET, **{**sharded, "trainer.max_steps": 3})).fit(resume=last)
    plain = ToyTrainer(toy_cfg(tmp_path / "plain", **QUIET, **{"trainer.max_steps": 2}))
    plain.fit()
    plain.fit(resume="last")
    plain.validate()
    ToyTrainer(toy_cfg(tmp_path / "plain", **QUIET)).validate(ckpt=last)  # consolidated in one process
    assert (list(warnings.filters), warnings.showwarning) == before
    assert not [name for name in entered if name.startswith("ampkit")]
