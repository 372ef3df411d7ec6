"""The apex import shim and ``python -m ampkit.legacy``: unmodified Apex scripts run on ampkit."""

import importlib.metadata
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from child_env import child_env
from rank_forkserver import ForkedPython

import ampkit.compat.amp
from ampkit.compat import install_apex_shim, uninstall_apex_shim
from ampkit.compat.shim import _TOP_LEVEL_MODULES

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def shim():
    install_apex_shim()
    yield
    uninstall_apex_shim()


def test_apex_names_resolve_to_ampkit_modules(shim):
    import apex
    import apex.amp._amp_state
    from apex import amp
    from apex.amp._amp_state import _amp_state
    from apex.fp16_utils import FP16_Optimizer, FP16Model
    from apex.parallel import LARC, DistributedDataParallel, SyncBatchNorm, convert_syncbn_model

    import ampkit.compat.fp16_utils as fp16_utils
    import ampkit.compat.parallel as parallel

    assert amp is ampkit.compat.amp and apex.amp is amp
    assert _amp_state is amp._amp_state
    assert apex.amp._amp_state is amp._amp_state
    assert (FP16_Optimizer, FP16Model) == (fp16_utils.FP16_Optimizer, fp16_utils.FP16Model)
    assert (LARC, DistributedDataParallel, SyncBatchNorm, convert_syncbn_model) == (
        parallel.LARC, parallel.DistributedDataParallel, parallel.SyncBatchNorm, parallel.convert_syncbn_model,
    )  # fmt: skip
    assert apex.parallel is parallel
    assert ampkit.compat.amp.__spec__.name == "ampkit.compat.amp"  # the module itself is not renamed
    from apex.parallel.LARC import LARC as larc_by_module_path

    assert larc_by_module_path is parallel.LARC and apex.parallel.LARC is parallel.LARC  # class, not module
    served_contrib = re.escape(
        "provides apex.{amp, fp16_utils, parallel, optimizers, normalization, multi_tensor_apply"
    )
    served_contrib += r".* and apex\.contrib\.\{clip_grad, focal_loss, optimizers, xentropy\}"  # apex.contrib too
    with pytest.raises(ModuleNotFoundError, match=r"apex\.contrib\.layer_norm.*" + served_contrib):
        import apex.contrib.layer_norm  # noqa: F401


@pytest.mark.parametrize(
    ("statement", "instead"),
    [
        ("from apex.contrib.multihead_attn import SelfMultiheadAttn", r"scaled_dot_product_attention"),
        ("from apex.contrib import layer_norm", r"apex\.normalization\.FusedLayerNorm"),
        ("from apex.contrib.layer_norm.layer_norm import FastLayerNormFN", r"apex\.normalization\.FusedLayerNorm"),
        ("from apex.contrib.groupbn.batch_norm import BatchNorm2d_NHWC", r"channels_last"),
        ("from apex.contrib.optimizers.distributed_fused_lamb import DistributedFusedLAMB", r"ZeroRedundancyOptimizer"),
        ("from apex.contrib.transducer import TransducerJoint", r"torchaudio\.functional\.rnnt_loss"),
        ("from apex.transformer import parallel_state", r"torch\.distributed\.tensor\.parallel"),
    ],
)
def test_an_apex_package_the_shim_does_not_serve_names_what_to_use_instead(shim, statement, instead):
    """Still a ModuleNotFoundError (guarded imports fall back), naming the package and its replacement; ``apex.contrib``
    itself imports empty, as in Apex, where each of its subpackages needs its own extension."""
    import apex.contrib  # noqa: F401

    with pytest.raises(ModuleNotFoundError, match=r"does not serve 'apex\.[\w.]+' \(.*\); use .*" + instead):
        exec(statement, {})


@pytest.mark.parametrize(
    ("package", "name", "instead"),
    [
        ("apex.contrib", "layer_norm", r"apex\.normalization\.FusedLayerNorm"),
        ("apex.contrib", "sparsity", r"torch\.ao\.pruning"),
        ("apex", "transformer", r"torch\.distributed\.tensor\.parallel"),
        ("apex", "RNN", r"torch\.nn\.LSTM"),
        ("apex.contrib.optimizers", "distributed_fused_adam", r"ZeroRedundancyOptimizer"),  # a served package's
    ],
)
def test_feature_checks_on_an_unserved_apex_package_answer_and_its_import_keeps_the_advice(
    shim, package, name, instead
):
    """``hasattr(apex.contrib, "layer_norm")`` raised ModuleNotFoundError, so feature checks crashed where Apex's own
    package answers False; ``from apex import transformer`` lost its advice to a bare 'cannot import name'."""
    module = importlib.import_module(package)

    assert not hasattr(module, name) and getattr(module, name, None) is None
    with pytest.raises(AttributeError, match=rf"does not serve '{package}\.{name}' .*; use .*{instead}"):
        getattr(module, name)
    with pytest.raises(ModuleNotFoundError, match=rf"does not serve '{package}\.{name}' .*; use .*{instead}"):
        exec(f"from {package} import {name}", {})


@pytest.mark.parametrize(
    ("statement", "message"),
    [
        ("from apex.contrib.optimizers import FusedLAMB", r"not 'FusedLAMB'; use apex\.optimizers\.FusedLAMB"),
        ("from apex.parallel import DistributedFusedAdam", r"no attribute 'DistributedFusedAdam'; it provides .*LARC"),
        ("from apex.amp import _initialized", r"no attribute '_initialized'; it provides .*initialize"),
        ("from apex.optimizers import FusedFoo", r"'FusedFoo'; Apex optimizer names are .*FusedLAMB"),
        ("from amp_C import multi_tensor_foo", r"no 'multi_tensor_foo'; it provides .*multi_tensor_scale"),
    ],
)
def test_from_import_of_a_name_a_served_module_lacks_keeps_its_message(shim, statement, message):
    """Python turns a module __getattr__'s AttributeError under ``from m import x`` into a bare 'cannot import name
    x from ampkit.compat...': the message naming what to use was lost. An ImportError, so guarded imports fall back."""
    import amp_C  # noqa: F401

    with pytest.raises(ImportError, match=message):
        exec(statement, {})
    module = importlib.import_module(statement.split()[1])
    assert not hasattr(module, statement.split()[-1])  # hasattr and getattr(..., default) still see an AttributeError


def test_larc_is_reachable_through_its_module_as_apex_clients_spell_it(shim):
    """Apex's apex.parallel never exported LARC: clients reached the class through the LARC module, as
    apex.parallel.LARC.LARC(opt) (VISSL-style builders) or ``from apex.parallel import LARC`` then LARC.LARC(opt)."""
    import apex
    import apex.parallel.LARC  # noqa: F401
    from apex.parallel import LARC as larc_module

    import ampkit.compat.parallel as parallel

    sgd = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    assert isinstance(apex.parallel.LARC.LARC(sgd, trust_coefficient=0.001, clip=False), parallel.LARC)
    assert larc_module.LARC is parallel.LARC


def _nvidia_like_apex(root: Path, init: str = "") -> Path:
    """A package named apex laid out as NVIDIA's is (its apex.amp subpackage)."""
    (root / "apex" / "amp").mkdir(parents=True)
    (root / "apex" / "__init__.py").write_text(init)
    (root / "apex" / "amp" / "__init__.py").write_text("")
    return root / "apex"


def test_a_real_apex_wins_unless_forced(tmp_path, monkeypatch):
    fake = _nvidia_like_apex(tmp_path, "REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.warns(UserWarning, match=re.escape(str(fake))):
            assert install_apex_shim() is False
        import apex

        assert apex.REAL
        assert install_apex_shim(force=True) is True
        import apex

        assert not hasattr(apex, "REAL") and apex.amp is ampkit.compat.amp
    finally:
        uninstall_apex_shim()


def test_a_package_named_apex_that_is_not_nvidias_is_shadowed_with_a_warning(tmp_path, monkeypatch):
    """``pip install apex`` installs PyPI's apex, a Pyramid web toolkit: the shim deferred to it as "a real apex", and
    the script (or transformers, which then counts apex available) failed on ``from apex import amp``."""
    (tmp_path / "apex" / "lib").mkdir(parents=True)
    (tmp_path / "apex" / "__init__.py").write_text("")
    (tmp_path / "apex" / "lib" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.warns(UserWarning, match=r"'apex' \(.*\) is not NVIDIA Apex: it has none of apex\.\{amp, "):
            assert install_apex_shim() is True
        from apex import amp

        assert amp is ampkit.compat.amp and importlib.metadata.version("apex") == "0.1+ampkit"
    finally:
        uninstall_apex_shim()


class _Apex2020FusedRMSNorm(torch.nn.Module):
    """The fields Apex's FusedRMSNorm had before mid-2023 (no ``memory_efficient``); its FusedLayerNorm adds a bias."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.normalized_shape, self.eps, self.elementwise_affine = torch.Size([size]), 1e-5, True
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, size))


class _Apex2020FusedLayerNorm(_Apex2020FusedRMSNorm):
    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.bias = torch.nn.Parameter(torch.linspace(-0.1, 0.1, size))


def _pickled_under_apex_names(
    module_name: str, classes: dict[str, type], build: Callable[[types.ModuleType], torch.nn.Module]
) -> io.BytesIO:
    """``torch.save`` of ``build(module)`` while ``module_name`` (and its parent packages) holds subclasses of
    ``classes``' values under Apex's names: the pickle a machine with Apex installed wrote, ready to load."""
    parts = module_name.split(".")
    fake = {name: types.ModuleType(name) for name in (".".join(parts[: i + 1]) for i in range(len(parts)))}
    module = fake[module_name]
    for name, base in classes.items():
        setattr(module, name, type(name, (base,), {"__module__": module_name}))
    buffer = io.BytesIO()
    with pytest.MonkeyPatch.context() as patch:
        for name, fake_module in fake.items():
            patch.setitem(sys.modules, name, fake_module)
        torch.save(build(module), buffer)
    buffer.seek(0)
    return buffer


def test_a_model_pickled_with_apex_norms_loads_and_runs_on_the_shim():
    """``torch.save(model)`` of a model holding Apex's norms pickles them by their apex path: under the shim they load
    as ampkit's, which read ``memory_efficient`` in forward, a field Apex's had only from mid-2023."""
    buffer = _pickled_under_apex_names(
        "apex.normalization.fused_layer_norm",
        {"FusedLayerNorm": _Apex2020FusedLayerNorm, "FusedRMSNorm": _Apex2020FusedRMSNorm},
        lambda module: torch.nn.Sequential(module.FusedLayerNorm(8), module.FusedRMSNorm(8)),
    )
    install_apex_shim()
    try:
        model = torch.load(buffer, weights_only=False)
        x = torch.randn(3, 8)
        layer_norm = torch.nn.functional.layer_norm(x, (8,), model[0].weight, model[0].bias, 1e-5)
        expected = torch.nn.functional.rms_norm(layer_norm, (8,), model[1].weight, 1e-5)
        torch.testing.assert_close(model(x), expected)
    finally:
        uninstall_apex_shim()


class _ApexPythonSyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """The fields of Apex's Python SyncBatchNorm (apex built without ``--cuda_ext``): only ``process_group``."""

    def __init__(self, num_features: int) -> None:
        super().__init__(num_features)
        self.process_group = None


def test_a_model_pickled_with_apex_python_sync_batchnorm_loads_and_runs_on_the_shim():
    """Its pickle names ``apex.parallel.sync_batchnorm.SyncBatchNorm``, which loads as ampkit's: its forward read
    ``channel_last`` and ``fuse_relu``, fields only Apex's CUDA SyncBatchNorm had."""
    buffer = _pickled_under_apex_names(
        "apex.parallel.sync_batchnorm", {"SyncBatchNorm": _ApexPythonSyncBatchNorm}, lambda m: m.SyncBatchNorm(4)
    )
    install_apex_shim()
    try:
        norm = torch.load(buffer, weights_only=False)
        x = torch.randn(6, 4, 3)
        expected = torch.nn.functional.batch_norm(x, None, None, norm.weight, norm.bias, training=True)
        torch.testing.assert_close(norm(x), expected)
        torch.testing.assert_close(norm.eval()(x), torch.nn.functional.batch_norm(
            x, norm.running_mean, norm.running_var, norm.weight, norm.bias))  # fmt: skip
    finally:
        uninstall_apex_shim()


def test_nvidia_apex_installed_as_a_zipped_egg_is_recognised_and_wins(tmp_path, monkeypatch):
    """``python setup.py install`` of a Python-only Apex could leave a zipped egg, whose package is no folder."""
    import zipfile

    egg = tmp_path / "apex-0.1-py3.egg"
    with zipfile.ZipFile(egg, "w") as archive:
        archive.writestr("apex/__init__.py", "")
        archive.writestr("apex/amp/__init__.py", "")
    monkeypatch.syspath_prepend(str(egg))
    try:
        with pytest.warns(UserWarning, match="A real apex is installed"):
            assert install_apex_shim() is False
    finally:
        uninstall_apex_shim()


def test_installing_the_shim_after_a_library_decided_apex_is_missing_says_so(monkeypatch):
    """transformers decides at its import whether apex is installed (DeepSpeed's engine too): a notebook importing it
    before ``install_apex_shim()`` then got "APEX is not installed" from its Trainer, with nothing naming the order."""
    checked = types.ModuleType("transformers.utils.import_utils")
    checked._apex_available = False
    monkeypatch.setitem(sys.modules, checked.__name__, checked)
    try:
        with pytest.warns(UserWarning, match=r"transformers\.utils\.import_utils was imported before the apex shim"):
            assert install_apex_shim() is True
        uninstall_apex_shim()
        checked._apex_available = True  # imported after the shim: it found apex
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            install_apex_shim()
    finally:
        uninstall_apex_shim()


class _ApexFP16Model(torch.nn.Module):
    """The one field Apex's FP16Model had: the network, converted to half."""

    def __init__(self, network: torch.nn.Module) -> None:
        super().__init__()
        self.network = network.half()


def test_a_model_pickled_in_apex_fp16_model_loads_and_runs_on_the_shim():
    """``apex.fp16_utils.fp16util.FP16Model`` loads as ampkit's, whose forward read a ``dtype`` Apex's never had."""
    buffer = _pickled_under_apex_names(
        "apex.fp16_utils.fp16util", {"FP16Model": _ApexFP16Model}, lambda m: m.FP16Model(torch.nn.Linear(4, 2))
    )
    install_apex_shim()
    try:
        model = torch.load(buffer, weights_only=False)
        x = torch.randn(3, 4)
        torch.testing.assert_close(model(x), model.network(x.half()))
        assert model(x).dtype == torch.float16
    finally:
        uninstall_apex_shim()


# ``python -m ampkit.legacy``: python -m puts the working directory first on sys.path, where a forked script's own
# directory would be; this file lives apart from every test's folder, so that nothing it holds shadows them.
_LEGACY_MAIN = "import os, sys\nsys.path[0] = os.getcwd()\nfrom ampkit.legacy import main\nmain()\n"


def _legacy(*args, cwd=REPO, extra_path=()):
    """``python -m ampkit.legacy ARGS`` in ``cwd``, forked from the warm rank server: what these runs check is the
    runner's handling of its program and arguments, not a new interpreter, and each new one spent seconds importing
    torch and ampkit."""
    main = Path(tempfile.mkdtemp(prefix="legacy-main-")) / "legacy_main.py"
    main.write_text(_LEGACY_MAIN)
    command = [sys.executable, str(main), *map(str, args)]
    here = os.getcwd()
    os.chdir(cwd)  # the fork starts where this process is when it asks for it
    try:
        run = ForkedPython(command, env=child_env(REPO, *extra_path, OMP_NUM_THREADS="1"))
    finally:
        os.chdir(here)
    try:
        stdout, stderr = run.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        run.kill()  # as subprocess.run does on its timeout
        raise
    finally:
        shutil.rmtree(main.parent)
    return subprocess.CompletedProcess(command, run.returncode, stdout, stderr)


def test_legacy_gan_example_trains_through_the_shim(tmp_path):
    result = _legacy(
        "examples/legacy_apex/train_gan.py", "--iters", 100, "--print_every", 50, "--checkpoint", tmp_path / "ck.pt"
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Selected optimization level O1" in out
    assert re.search(r"\[100/100\] Loss_D: [\d.]+ Loss_G: [\d.]+ loss_scale D: \d+ G: \d+", out)
    start = float(re.search(r"start: fraction near a mode ([\d.]+)", out).group(1))
    end = float(re.search(r"end: fraction near a mode ([\d.]+)", out).group(1))
    assert end > start
    assert "saved and reloaded checkpoint with amp state {'loss_scaler0'" in out


def test_legacy_launcher_respects_a_real_apex_and_its_force_flag(tmp_path):
    _nvidia_like_apex(tmp_path)
    script = tmp_path / "which_apex.py"
    script.write_text("import sys, apex\nprint('argv', sys.argv[1:])\nprint('shim', hasattr(apex, 'amp'))\n")
    plain = _legacy(script, "a", "--b", extra_path=[tmp_path])
    assert plain.returncode == 0, plain.stderr
    assert "A real apex is installed" in plain.stderr and "shim False" in plain.stdout
    assert "argv ['a', '--b']" in plain.stdout
    forced = _legacy("--force-shim", "-m", "which_apex", "c", extra_path=[tmp_path])
    assert forced.returncode == 0, forced.stderr
    assert "shim True" in forced.stdout and "argv ['c']" in forced.stdout
    launcher = _legacy("-m", "apex.parallel.multiproc", script, extra_path=[tmp_path])  # this apex lacks it
    assert launcher.returncode == 1 and launcher.stderr.strip().splitlines()[-1] == (
        "ampkit.legacy: the installed apex has no module 'apex.parallel.multiproc'; --force-shim serves ampkit's"
    )


def _local_rank_script(path: Path, *spellings: str) -> Path:
    """A script that parses its local rank the way the launchers of its time passed it, and prints what it got."""
    path.write_text(
        "import argparse, sys\n"
        "parser = argparse.ArgumentParser()\n"
        f"parser.add_argument({', '.join(map(repr, spellings))}, type=int, default=0)\n"
        "parser.add_argument('--lr')\n"
        "args = parser.parse_args()\n"
        # one string, so that two ranks' unbuffered prints into one pipe cannot interleave inside a line
        "print(f'local rank {args.local_rank} lr {args.lr}')\n"
    )
    return path


@pytest.mark.parametrize(
    ("spellings", "rank_flag"),
    [(["--local_rank"], "--local_rank=1"), (["--local-rank"], "--local-rank=1"),
     (["--local-rank", "--local_rank"], "--local_rank=1")],
)  # fmt: skip
def test_the_local_rank_torch_distributed_launch_puts_first_reaches_the_script_as_it_parses_it(
    tmp_path, spellings, rank_flag
):
    """``python -m torch.distributed.launch ... -m ampkit.legacy train.py`` starts ``ampkit.legacy --local-rank=N
    train.py`` (``--local_rank=N`` before torch 2.0): the rank is the script's, and Apex-era scripts (Apex's
    examples, Swin) parse only ``--local_rank``, what the launcher passed before torch 2.0."""
    script = _local_rank_script(tmp_path / "train.py", *spellings)
    result = _legacy(rank_flag, "--force-shim", script, "--lr", "0.1")
    assert result.returncode == 0, result.stderr
    assert "local rank 1 lr 0.1" in result.stdout
    module = _legacy(rank_flag, "-m", "train", "--lr", "0.1", extra_path=[tmp_path])
    assert module.returncode == 0, module.stderr
    assert "local rank 1 lr 0.1" in module.stdout


def test_an_apex_era_script_runs_under_torch_distributed_launch_through_the_legacy_runner(tmp_path):
    script = _local_rank_script(tmp_path / "train.py", "--local_rank")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.launch", "--standalone", "--nproc_per_node", "2",
         "-m", "ampkit.legacy", str(script), "--lr", "0.1"],
        cwd=tmp_path, env=child_env(REPO, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert sorted(re.findall(r"local rank \d lr 0.1", result.stdout)) == ["local rank 0 lr 0.1", "local rank 1 lr 0.1"]


def test_legacy_launcher_argument_errors(tmp_path, capsys):
    from ampkit.legacy import main

    with pytest.raises(SystemExit, match="script not found"):
        main([str(tmp_path / "nope.py")])
    with pytest.raises(SystemExit, match="usage"):
        main(["-m"])
    with pytest.raises(SystemExit, match="module not found: 'no_such_module_xyz'"):
        main(["-m", "no_such_module_xyz"])
    with pytest.raises(SystemExit, match="module not found: 'no_such_package_xyz.train'"):
        main(["-m", "no_such_package_xyz.train"])
    # An Apex flag before the script, and a folder: each read "script not found: '--opt_level'" (or the folder)
    with pytest.raises(
        SystemExit, match=r"unknown option '--opt_level'; .* python -m ampkit.legacy SCRIPT --opt_level"
    ):
        main(["--opt_level", "O1", str(tmp_path / "train.py")])
    with pytest.raises(SystemExit, match=r"is a directory without a __main__.py; name the script in it"):
        main([str(tmp_path)])
    main(["--help"])
    assert "--force-shim" in capsys.readouterr().out
    long = "x" * 10_000  # a pasted path, option or module name: named by its start and length, not repeated whole
    for args in (
        [str(tmp_path / long)],
        ["--" + long],
        ["-m", long],
        ["-m", "apex." + long],
        ["-m", "apex.amp." + long],
    ):
        with pytest.raises(SystemExit, match=r"characters\)") as refused:
            main(args)
        assert len(str(refused.value.code)) < 800, args
    assert "AMPKIT_APEX_SHIM" not in os.environ and "apex" not in sys.modules  # nothing was installed


def test_legacy_runner_takes_a_double_dash_and_a_directory_as_python_does(tmp_path):
    """``python -m ampkit.legacy -- train.py`` read "script not found: '--'", and a directory holding ``__main__.py``
    (which ``python DIR`` runs) was refused as not found."""
    app = tmp_path / "app dir"
    app.mkdir()
    (app / "__main__.py").write_text(  # as under python DIR: the directory is on sys.path, its parent is not
        "import os, sys\nimport apex\nprint(sys.argv[1:], sys.path[0], os.path.dirname(sys.argv[0]) in sys.path)\n"
    )
    result = _legacy("--", app, "an arg with spaces", "--", "-x")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == f"['an arg with spaces', '--', '-x'] {app} False"


# Prints 'at exit' from its atexit handler, then 'freed' when its global object goes. Builtins only as callbacks: a
# function of the script would hold its globals itself.
_HOLDS_AN_OBJECT_UNTIL_EXIT = (
    "import atexit, weakref\n"
    "class Held:\n"
    "    pass\n"
    "held = Held()\n"
    "weakref.finalize(held, print, 'freed', flush=True)\n"
    "atexit.register(print, 'at exit', flush=True)\n"
)


@pytest.mark.parametrize("as_module", [False, True])
def test_a_legacy_script_keeps_its_globals_until_the_interpreter_exits(tmp_path, as_module):
    """As under ``python script.py``, what the script holds outlives its last line (its atexit handlers see it):
    freed earlier, a torch DDP model over gloo deadlocked at exit on the GIL in about one torchrun run in four."""
    (tmp_path / "holding.py").write_text(_HOLDS_AN_OBJECT_UNTIL_EXIT)
    target = ["-m", "holding"] if as_module else [tmp_path / "holding.py"]
    result = _legacy(*target, cwd=tmp_path, extra_path=(tmp_path,))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["at", "exit", "freed"]


@pytest.mark.parametrize("as_module", [False, True])
def test_a_failing_legacy_script_reports_its_error_as_python_does(tmp_path, as_module):
    """The traceback starts at the script's own first frame (nine runner and runpy frames stood above it), the exit
    status is python's 1, and what the script holds still outlives it until exit."""
    (tmp_path / "failing.py").write_text(
        _HOLDS_AN_OBJECT_UNTIL_EXIT + "def train():\n    raise ValueError('bad batch')\ntrain()\n"
    )
    target = ["-m", "failing"] if as_module else ["failing.py"]
    result = _legacy(*target, cwd=tmp_path, extra_path=(tmp_path,))
    plain = subprocess.run([sys.executable, *target], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert (
        (result.returncode, result.stdout.split())
        == (plain.returncode, plain.stdout.split())
        == (1, ["at", "exit", "freed"])
    )
    first_script_frame = result.stderr.splitlines()[1]  # python -m keeps two runpy frames; the runner drops them
    assert first_script_frame == f'  File "{tmp_path / "failing.py"}", line 9, in <module>'
    assert result.stderr.split(first_script_frame)[1] == plain.stderr.split(first_script_frame)[1]
    if not as_module:  # the same run in both cases: a SyntaxError's report is the script file's, not the target's
        (tmp_path / "broken.py").write_text("x = (\n")  # a SyntaxError: its location alone, as python prints it
        result = _legacy("broken.py", cwd=tmp_path)
        assert (result.returncode, result.stderr.splitlines()[0]) == (1, f'  File "{tmp_path / "broken.py"}", line 1')


def test_spawned_child_processes_of_a_legacy_run_see_the_shim(tmp_path):
    script = tmp_path / "spawning.py"
    script.write_text(
        "import multiprocessing as mp\n"
        "from apex import amp\n"
        "def child(queue):\n"
        "    queue.put(amp.__name__)\n"
        "if __name__ == '__main__':\n"
        "    ctx = mp.get_context('spawn')\n"
        "    queue = ctx.Queue()\n"
        "    worker = ctx.Process(target=child, args=(queue,))\n"
        "    worker.start()\n"
        "    print('child sees', queue.get(timeout=120))\n"
        "    worker.join()\n"
    )
    result = _legacy(script)
    assert result.returncode == 0, result.stderr
    assert "child sees ampkit.compat.amp" in result.stdout


def test_apex_has_a_distribution_while_the_shim_is_installed():
    """transformers calls apex available only when ``importlib.metadata.version("apex")`` answers too."""
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("apex")
    install_apex_shim()
    try:
        assert importlib.util.find_spec("apex") is not None
        assert importlib.metadata.version("apex") == "0.1+ampkit"
        assert importlib.metadata.distribution("apex").read_text("top_level.txt") == "apex\n"
    finally:
        uninstall_apex_shim()
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("apex")


@pytest.mark.parametrize("imported", ["before", "after"])
def test_pkg_resources_finds_the_same_apex_distribution_as_importlib_metadata(imported):
    """Scripts and libraries from before 2022 ask ``pkg_resources.get_distribution("apex")`` (or ``require``,
    ``working_set``), which builds its own list from sys.path and missed the shim's apex; it is listed while the shim
    is installed, whether ``pkg_resources`` was imported before or after, and put out again; sys.path never gets a
    folder for it."""
    if importlib.util.find_spec("pkg_resources") is None:
        pytest.skip("pkg_resources left setuptools in version 82; there is nothing here to answer")
    script = (
        "import importlib.metadata, sys, warnings\n"
        "warnings.simplefilter('ignore')\n"
        f"if {imported == 'before'}: import pkg_resources\n"
        "from ampkit.compat import install_apex_shim, uninstall_apex_shim\n"
        "install_apex_shim()\n"
        "import pkg_resources, ampkit.compat, os\n"
        "added = {os.path.dirname(ampkit.compat.__file__), None}  # what activating the shim's apex could add\n"
        "version = importlib.metadata.version('apex')\n"
        "assert pkg_resources.get_distribution('apex').version == version == '0.1+ampkit'\n"
        "assert [str(d) for d in pkg_resources.require('apex>=0.1')] == ['apex 0.1+ampkit']\n"
        "assert pkg_resources.working_set.find(pkg_resources.Requirement.parse('apex')).version == version\n"
        "assert 'apex' in {d.key for d in pkg_resources.working_set}\n"
        "assert 'Version: 0.1+ampkit' in pkg_resources.get_distribution('apex').get_metadata('PKG-INFO')\n"
        "assert not added & set(sys.path)\n"
        "uninstall_apex_shim()\n"
        "assert pkg_resources.working_set.find(pkg_resources.Requirement.parse('apex')) is None\n"
        "assert 'apex' not in {d.key for d in pkg_resources.working_set} and not added & set(sys.path)\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=child_env(REPO))
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr


def test_an_environment_report_can_say_which_apex_version_runs_and_from_where(shim):
    """Training launchers log their dependencies first (VISSL's collect_env, Megatron set-up checks): apex's version
    and ``os.path.dirname(apex.__file__)``, which was an AttributeError that stopped the run before it started."""
    import apex

    report = f"apex {importlib.metadata.version('apex')} @{os.path.dirname(apex.__file__)}"
    assert report == f"apex 0.1+ampkit @{os.path.dirname(ampkit.compat.__file__)}"


@pytest.mark.parametrize(
    ("name", "exists"),
    [
        ("apex.contrib.group_norm", False),  # NVIDIA Earth-2 Studio gates a test on it, unguarded
        ("apex.transformer", False),
        ("apex.amp.opt", False),  # an Apex-internal module the shim does not lay out
        ("apex.amp", True),  # PyTorch Lightning 1.x: _module_available("apex.amp")
        ("apex.normalization.fused_layer_norm", True),  # Megatron-derived layer norms probe it
        ("apex.contrib.xentropy", True),
    ],
)
def test_find_spec_answers_whether_an_apex_module_is_served_and_an_import_still_says_why_not(shim, name, exists):
    """Libraries ask ``importlib.util.find_spec(name) is not None`` without a try: a module the shim does not serve
    answers None, as an absent one does (it raised the import's ModuleNotFoundError into their module-level code)."""
    assert (importlib.util.find_spec(name) is not None) is exists
    if not exists:
        with pytest.raises(ModuleNotFoundError, match=r"apex shim (does not serve|has no module)"):
            importlib.import_module(name)


def test_subprocesses_of_a_legacy_run_find_apex_and_the_served_extension_modules_first(tmp_path):
    """A subprocess finds apex by its distribution, ``apex_C``, or a served extension module by name before anything
    imports apex (a worker may load ``fused_adam_cuda`` or ``fused_layer_norm_cuda`` first).

    The child's hook serves every name of its list the same way, so three of them (the first served, Megatron's,
    the newest) stand for all; the next test keeps the list equal to the shim's. One legacy run starts every child:
    each run of the launcher costs seconds of torch's import."""
    names = ["fused_adam_cuda", "fused_layer_norm_cuda", "xentropy_cuda"]
    script = tmp_path / "launching.py"
    script.write_text(
        "import subprocess, sys\n"
        "children = ['import importlib.metadata as m; print(m.version(\"apex\"))',\n"
        "            'import apex_C; print(apex_C.__name__)']\n"
        f"for name in {names!r}:\n"
        "    children.append(f'import importlib; print(importlib.import_module({name!r}).__name__)')\n"
        "for child in children:\n"
        "    done = subprocess.run([sys.executable, '-c', child], capture_output=True, text=True)\n"
        "    print(done.stdout.strip() or done.stderr.strip().splitlines()[-1])\n"
    )
    result = _legacy(script)
    assert result.returncode == 0, result.stderr
    served = [_TOP_LEVEL_MODULES[name] for name in names]
    assert result.stdout.split("\n")[:-1] == ["0.1+ampkit", "ampkit.compat.apex_c", *served]


def test_child_processes_wait_for_every_extension_module_the_shim_serves():
    """The child hook spells the names out (it loads nothing of ampkit before one is asked for): a name served
    in the parent but missing there would be "No module named" in a spawned worker."""
    from ampkit.compat._child_shim.sitecustomize import EXTENSION_MODULES

    assert sorted(EXTENSION_MODULES) == sorted(_TOP_LEVEL_MODULES)


def test_apex_contrib_optimizers_serves_the_first_fp16_optimizer_as_bert_run_swag_imports_it(shim):
    """NVIDIA's BERT run_swag.py with --fp16: FP16_Optimizer from apex.contrib.optimizers around apex.optimizers'
    FusedAdam built with max_grad_norm (the first FusedAdam)."""
    from apex.contrib.optimizers import FP16_Optimizer
    from apex.optimizers import FusedAdam

    from ampkit.compat.legacy_fused_adam import LegacyFusedAdam

    model = torch.nn.Linear(4, 2).half()
    optimizer = FP16_Optimizer(
        FusedAdam(model.parameters(), lr=1e-3, bias_correction=False, max_grad_norm=1.0), dynamic_loss_scale=True
    )
    optimizer.backward(model(torch.randn(3, 4).half()).float().sum())
    optimizer.step()
    assert isinstance(optimizer.optimizer, LegacyFusedAdam)
    from apex.contrib.optimizers import FusedAdam as first_fused_adam

    assert first_fused_adam is LegacyFusedAdam
    import apex.contrib.optimizers

    with pytest.raises(AttributeError, match=r"not 'FusedLAMB'; use apex\.optimizers\.FusedLAMB"):
        apex.contrib.optimizers.FusedLAMB  # noqa: B018
    with pytest.raises(ModuleNotFoundError, match=r"'apex\.contrib\.optimizers\.distributed_fused_adam' \(a sharded"):
        import apex.contrib.optimizers.distributed_fused_adam  # noqa: F401


def test_apex_contrib_clip_grad_is_torch_clipping_as_moflow_imports_it(shim):
    """NVIDIA's MoFlow: ``from apex.contrib.clip_grad import clip_grad_norm_`` at the top of its training script."""
    from apex.contrib.clip_grad import clip_grad_norm_
    from apex.contrib.clip_grad.clip_grad import clip_grad_norm_ as by_file

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    for p in params:
        p.grad = torch.randn_like(p) * 10
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, p in zip(reference, params, strict=True):
        r.grad = p.grad.clone()
    total = torch.nn.utils.clip_grad_norm_(reference, 1.0)
    assert by_file is clip_grad_norm_
    assert torch.equal(clip_grad_norm_(params, 1.0), total)
    assert all(torch.equal(p.grad, r.grad) for p, r in zip(params, reference, strict=True))
    assert torch.equal(clip_grad_norm_([torch.nn.Parameter(torch.ones(2))], 1.0), torch.tensor(0.0))
