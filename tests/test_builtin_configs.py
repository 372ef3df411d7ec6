"""The repository's configs run from any directory, and a wheel install runs its built-in example."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from child_env import child_env

from ampkit.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]


def _hide_the_repo(monkeypatch, tmp_path, *extra_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    hidden = {REPO, REPO / "tests"}  # tests/examples/ would pass for the examples package
    kept = [p for p in sys.path if Path(p or ".").resolve() not in hidden]
    monkeypatch.setattr(sys, "path", [*map(str, extra_path), *kept])
    for name in [m for m in sys.modules if m == "examples" or m.startswith("examples.")]:
        monkeypatch.delitem(sys.modules, name)


def test_repo_config_resolves_its_trainer_against_the_config_files_project_root(tmp_path, monkeypatch):
    _hide_the_repo(monkeypatch, tmp_path)  # examples/ is not importable from here: only the config file's root has it
    cls, cfg = load_config(REPO / "configs" / "gan.yaml", ["trainer.max_epochs=1"])
    assert cls.__name__ == "GanTrainer" and Path(sys.modules[cls.__module__].__file__).is_relative_to(REPO)


@pytest.mark.parametrize("regular", [True, False], ids=["package", "namespace"])
def test_repo_config_resolves_its_trainer_though_another_examples_package_is_installed(tmp_path, monkeypatch, regular):
    """An installed package named ``examples`` (wheels do ship one; a bare ``examples/`` folder on the path is a
    namespace package) came first and has no ``gan``: the GAN config failed with "No module named
    'examples.gan'"; the config's own project now provides it."""
    foreign = tmp_path / "site" / "examples"
    foreign.mkdir(parents=True)
    if regular:
        (foreign / "__init__.py").write_text("")
    _hide_the_repo(monkeypatch, tmp_path, foreign.parent)
    cls, _ = load_config(REPO / "configs" / "gan.yaml", ["trainer.max_epochs=1"])
    assert cls.__name__ == "GanTrainer" and Path(sys.modules[cls.__module__].__file__).is_relative_to(REPO)
    assert sys.modules["examples"].__path__ == [str(REPO / "examples")]
    if not regular:
        return

    # A program that imported the other package itself keeps it, and is told what clashes
    for name in [m for m in sys.modules if m == "examples" or m.startswith("examples.")]:
        del sys.modules[name]
    importlib.import_module("examples")
    with pytest.raises(ConfigError, match=r"'examples' this program already imported comes from .*site.examples, "
                       r"which has no such module; the config's project .* has it in .*: rename one"):  # fmt: skip
        load_config(REPO / "configs" / "gan.yaml", ["trainer.max_epochs=1"])
    assert sys.modules["examples"].__path__ == [str(foreign)]


def test_a_builtin_config_is_found_by_name_and_a_wrong_name_lists_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cls, cfg = load_config("digits")
    assert cls.__module__ == "ampkit.examples.digits" and cfg.name == "digits"
    with pytest.raises(ConfigError, match=r"config file 'digit' does not exist.*built-in: digits"):
        load_config("digit")


@pytest.mark.slow
def test_a_wheel_install_trains_the_builtin_example_from_any_directory(tmp_path):
    source = tmp_path / "src"
    shutil.copytree(REPO / "ampkit", source / "ampkit", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    site = tmp_path / "site"
    zipfile.ZipFile(next((tmp_path / "dist").glob("ampkit-*.whl"))).extractall(site)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = child_env(site)
    run = subprocess.run(
        [sys.executable, "-c", "import ampkit, sys; print(ampkit.__file__); from ampkit.cli import main; "
         "sys.exit(main(sys.argv[1:]))", "fit", "--config", "digits", "trainer.max_steps=5",
         "logging.tensorboard=false", "trainer.progress_bar=false"],
        cwd=work, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0].startswith(str(site))
    assert "finished 5 steps in 5 batches\n" in run.stdout
    assert (work / "runs" / "digits" / "version_0" / "checkpoints" / "last.pt").is_file()
