"""The JIT loader: mode switch, one-line compile message, warn-once fallback, cross-process cache."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from child_env import child_env
from rank_forkserver import ForkedPython

from ampkit.ops import _build
from ampkit.ops import build as ops_build

BROKEN_SOURCE = '#error "deliberately broken ampkit test source"\n'
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def broken_family(tmp_path, monkeypatch):
    """A family whose only source fails to compile, built into a private cache directory."""
    monkeypatch.setenv("AMPKIT_EXTENSIONS_DIR", str(tmp_path / "ext"))
    source = tmp_path / "broken.cpp"
    source.write_text(BROKEN_SOURCE)
    name = f"ampkit_broken_{tmp_path.name.replace('-', '_')}"
    yield _build.register_family(name, [source])
    _build.FAMILIES.pop(name, None)


def test_reference_mode_never_builds(broken_family, monkeypatch, capfd):
    monkeypatch.setenv("AMPKIT_OPS", "reference")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert broken_family.use_kernel() is False
    assert "compiling" not in capfd.readouterr().err
    assert broken_family.name not in _build._loaded


def test_broken_build_falls_back_with_one_warning(broken_family, monkeypatch, capfd):
    monkeypatch.delenv("AMPKIT_OPS", raising=False)
    with pytest.warns(RuntimeWarning, match=broken_family.name) as record:
        assert broken_family.use_kernel() is False
        assert broken_family.use_kernel() is False
    assert len(record) == 1
    assert "deliberately broken" in str(record[0].message)
    err = capfd.readouterr().err
    announced = f"ampkit: compiling C++ ops '{broken_family.name}'"
    (line,) = [line for line in err.splitlines() if line.startswith(announced)]
    assert "first use of these sources, so this step waits" in line and "python -m ampkit.ops.build" in line


def test_kernel_mode_raises_naming_the_family(broken_family, monkeypatch):
    monkeypatch.setenv("AMPKIT_OPS", "kernel")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match=f"{broken_family.name}.*AMPKIT_OPS=kernel"):
            broken_family.use_kernel()


def test_missing_compiler_warns_once_for_all_families(broken_family, tmp_path, monkeypatch):
    monkeypatch.delenv("AMPKIT_OPS", raising=False)
    monkeypatch.setenv("CXX", "ampkit-no-such-compiler")
    monkeypatch.setattr(_build, "_warned_no_compiler", False)
    other = _build.register_family(broken_family.name + "_other", broken_family.sources)
    try:
        with pytest.warns(RuntimeWarning, match="ampkit-no-such-compiler") as record:
            assert broken_family.use_kernel() is False
            assert other.use_kernel() is False
        assert len(record) == 1
    finally:
        _build.FAMILIES.pop(other.name)


def test_first_error_line_quotes_the_compiler_not_ninja(broken_family):
    """The CUDA fallback's warning carries one line of the failure: the compiler's error, not ninja's command."""
    from torch.utils import cpp_extension

    build_dir = Path(broken_family.sources[0]).parent / "direct"
    build_dir.mkdir()
    with pytest.raises(RuntimeError) as failure:
        cpp_extension.load(
            name=broken_family.name,
            sources=[str(s) for s in broken_family.sources],
            build_directory=str(build_dir),
            is_python_module=False,
        )
    line = _build._first_error_line(failure.value)
    assert line.endswith('error: #error "deliberately broken ampkit test source"'), line
    assert _build._first_error_line(OSError("CUDA_HOME is not set.\nmore")) == "OSError: CUDA_HOME is not set."


def test_invalid_mode_names_the_valid_ones(monkeypatch):
    monkeypatch.setenv("AMPKIT_OPS", "fast")
    with pytest.raises(ValueError, match="AMPKIT_OPS='fast'.*auto, reference, kernel"):
        _build.ops_mode()


def test_cache_key_follows_header_edits(tmp_path):
    """Any header under the family's csrc root (here csrc/common/) is part of the cache key."""
    (tmp_path / "csrc" / "family").mkdir(parents=True)
    (tmp_path / "csrc" / "common").mkdir()
    source = tmp_path / "csrc" / "family" / "op.cpp"
    header = tmp_path / "csrc" / "common" / "op.h"
    source.write_text("int f();\n")
    header.write_text("#define A 1\n")
    before = _build.extension_dir("ampkit_x", [source], with_cuda=False)
    header.write_text("#define A 2\n")
    assert _build.extension_dir("ampkit_x", [source], with_cuda=False) != before


def _run_forked(script: Path, code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` (``code`` written to ``script``) with ``env`` set, in a process forked from the warm rank
    server, which imports torch and ampkit but builds and loads no op: a new Python spent seconds importing them."""
    script.write_text(code)
    command = [sys.executable, str(script), *args]
    child = ForkedPython(command, env=child_env(REPO_ROOT, **env))
    try:
        stdout, stderr = child.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        child.kill()  # as subprocess.run does on its timeout
        raise
    return subprocess.CompletedProcess(command, child.returncode, stdout, stderr)


_BUILD_COMMAND = "import sys\nfrom ampkit.ops.build import main\nsys.exit(main())\n"  # python -m ampkit.ops.build


def test_ahead_of_time_build_is_reused_by_a_new_process(tmp_path):
    """`python -m ampkit.ops.build` fills the cache; a new process then loads it without compiling."""
    build = _run_forked(tmp_path / "build.py", _BUILD_COMMAND)
    assert build.returncode == 0, build.stderr
    assert "ampkit_multi_tensor: ready in" in build.stdout
    script = (
        "import torch\n"
        "from ampkit.ops.multi_tensor import _FAMILY\n"
        "assert _FAMILY.use_kernel()\n"
        "print(torch.ops.ampkit_multi_tensor.l2norm([torch.ones(4)], False)[0].item())\n"
    )
    load = _run_forked(tmp_path / "load.py", script, AMPKIT_OPS="kernel")
    assert load.returncode == 0, load.stderr
    assert "compiling" not in load.stderr
    assert load.stdout.strip() == "2.0"


def test_only_builds_the_named_family_and_refuses_an_unknown_one(tmp_path, monkeypatch, capsys):
    """``--only`` lets a GPU script build the families in parallel processes; a misspelt one names the known. The
    refusal is checked in this process (it builds nothing): a new Python spent seconds importing torch to give it."""
    build = _run_forked(tmp_path / "build.py", _BUILD_COMMAND, "--only", "ampkit_norms")
    assert build.returncode == 0, build.stderr
    assert build.stdout.startswith("ampkit_norms: ready in") and "ampkit_multi_tensor" not in build.stdout
    monkeypatch.setenv("AMPKIT_OPS", "kernel")  # as main() sets it, for its process: undone after the test
    assert ops_build.main(["--only", "ampkit_norm"]) == 2
    wrong = capsys.readouterr()
    assert "unknown op family ampkit_norm; known: ampkit_multi_tensor, ampkit_norms, ampkit_optimizers" in wrong.err
    assert wrong.out == ""  # nothing built


# torch/library.h alone: with ATen/ATen.h as well, each of this file's builds compiled three times as long.
TINY_CPU_SOURCE = """
#include <torch/library.h>

static at::Tensor plus_one(const at::Tensor& x) { return x.add(1); }

TORCH_LIBRARY(NAMESPACE, m) { m.def("plus_one(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(NAMESPACE, CPU, m) { m.impl("plus_one", plus_one); }
"""


def _tiny_family_source(tmp_path: Path) -> tuple[str, Path]:
    """A one-op family's name (unique to the test: a namespace registers once per process) and its C++ source."""
    name = f"ampkit_tiny_{tmp_path.name.replace('-', '_')}"
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY_CPU_SOURCE.replace("NAMESPACE", name))
    return name, source


# The cache tests need a library to build, damage and load, not an op: a source without torch's headers compiles
# in a fraction of a second where one with them takes ~10 s, twice per test.
PLAIN_SOURCE = 'extern "C" int NAMESPACE_plus_one(int x) { return x + 1; }\n'


def _plain_family_source(tmp_path: Path) -> tuple[str, Path]:
    """A family whose library exports one C function, ``<name>_plus_one``: its name and its source."""
    name = f"ampkit_plain_{tmp_path.name.replace('-', '_')}"
    source = tmp_path / "plain.cpp"
    source.write_text(PLAIN_SOURCE.replace("NAMESPACE", name))
    return name, source


def _load_in_a_new_process(name: str, source: Path) -> subprocess.CompletedProcess:
    """Build or load the plain family in a process of its own (as a training run would) and print its function's
    result on 1, called in the library the loader loaded."""
    code = (
        "import ctypes\n"
        "from ampkit.ops import _build\n"
        f"assert _build.register_family({name!r}, [{str(source)!r}]).use_kernel()\n"
        f"library = _build.extension_dir({name!r}, [{str(source)!r}], with_cuda=False) / '{name}.so'\n"
        f"print(ctypes.CDLL(str(library)).{name}_plus_one(1))\n"
    )
    return _run_forked(source.parent / "load_plain_family.py", code, AMPKIT_OPS="kernel")


@pytest.fixture
def family_with_broken_cuda(tmp_path, monkeypatch):
    """A one-op family on a host that looks like it has a GPU and nvcc, where torch finds no CUDA_HOME."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("AMPKIT_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_build, "_cuda_toolkit_present", lambda: True)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)  # torch's build then fails: CUDA_HOME is not set
    name, source = _tiny_family_source(tmp_path)
    cuda_source = tmp_path / "tiny_kernels.cu"
    cuda_source.write_text('#error "deliberately broken ampkit CUDA source"\n')
    yield _build.register_family(name, [source], cuda_sources=[cuda_source])
    _build.FAMILIES.pop(name, None)


def test_failed_cuda_build_keeps_the_cpu_kernels(family_with_broken_cuda, monkeypatch, capfd):
    """GPU host with a broken toolkit builds the family CPU-only: CPU tensors run the C++ kernel, not the reference."""
    family = family_with_broken_cuda
    monkeypatch.delenv("AMPKIT_OPS", raising=False)
    with pytest.warns(RuntimeWarning, match=f"CUDA kernels of C\\+\\+ ops '{family.name}'") as record:
        assert family.serves(torch.device("cpu"), "plus_one")
        assert not family.serves(torch.device("cuda"), "plus_one")  # CUDA tensors take the reference path
    (warning,) = record
    message = str(warning.message)
    assert "CUDA_HOME environment variable is not set" in message
    assert "CPU kernels are in use" in message and "python -m ampkit.ops.build" in message
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"{family.name}::plus_one", "CPU")
    assert torch.equal(getattr(torch.ops, family.name).plus_one(torch.zeros(3)), torch.ones(3))

    # The CPU-only build is cached under its own key: the next process loads it without compiling.
    capfd.readouterr()
    monkeypatch.delitem(_build._loaded, family.name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert family.use_kernel()
    assert "compiling" not in capfd.readouterr().err

    monkeypatch.setenv("AMPKIT_OPS", "kernel")
    with pytest.raises(
        RuntimeError, match=r"built without CUDA kernels \(OSError: CUDA_HOME environment variable is not set"
    ):
        family.serves(torch.device("cuda"), "plus_one")


def test_failed_cuda_build_is_an_error_in_kernel_mode(family_with_broken_cuda, monkeypatch):
    family = family_with_broken_cuda
    monkeypatch.setenv("AMPKIT_OPS", "kernel")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match=f"{family.name}.*AMPKIT_OPS=kernel.*CUDA kernels failed.*CUDA_HOME"):
            family.use_kernel()
    assert f"{family.name}::plus_one" not in torch._C._dispatch_get_all_op_names()  # no CPU-only build either


def test_a_failed_cuda_build_is_not_tried_again_until_its_toolchain_changes(family_with_broken_cuda, monkeypatch):
    """Every new process (each DataLoader worker, each torchrun rank) spent minutes failing the same CUDA build
    before it built CPU-only; the failure is now remembered in the cache, keyed by what decides the build."""
    from torch.utils import cpp_extension

    family = family_with_broken_cuda
    monkeypatch.delenv("AMPKIT_OPS", raising=False)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    with pytest.warns(RuntimeWarning, match="later processes do not try again until the sources, the CUDA toolkit"):
        assert family.use_kernel()
    tried, real_load = [], cpp_extension.load
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: tried.append(kw["with_cuda"]) or real_load(**kw))

    def in_a_new_process() -> str:
        monkeypatch.delitem(_build._loaded, family.name)
        monkeypatch.delitem(_build._cuda_failures, family.name)
        with pytest.warns(RuntimeWarning, match=f"CUDA kernels of C\\+\\+ ops '{family.name}'") as record:
            assert family.serves(torch.device("cpu"), "plus_one")
        return str(record[0].message)

    said = in_a_new_process()
    assert tried == []  # neither the CUDA build again nor the CPU-only one, which is cached
    assert "failed to build in an earlier process (OSError: CUDA_HOME environment variable is not set" in said
    assert "`python -m ampkit.ops.build` tries again now" in said

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")  # what decides the build changed: it is tried again
    assert "later processes do not try again" in in_a_new_process()
    assert tried == [True]

    tried.clear()  # the ahead-of-time build (kernel mode) always tries again
    monkeypatch.delitem(_build._loaded, family.name)
    monkeypatch.setenv("AMPKIT_OPS", "kernel")
    with pytest.raises(RuntimeError, match="CUDA kernels failed"):
        family.use_kernel()
    assert tried == [True]


def test_a_cache_entry_copied_in_part_is_rebuilt_from_scratch(tmp_path, monkeypatch):
    """A partial copy of the cache (objects cut short, the library not there yet): ninja called the damaged objects
    up to date and linked them, so the build failed in every process; it starts from scratch instead."""
    name, source = _plain_family_source(tmp_path)
    monkeypatch.setenv("AMPKIT_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert _load_in_a_new_process(name, source).returncode == 0
    build_dir = _build.extension_dir(name, [source], with_cuda=False)
    (build_dir / f"{name}.so").unlink()
    objects = list(build_dir.glob("*.o"))
    assert objects
    for obj in objects:
        whole, stamp = obj.read_bytes(), obj.stat()
        obj.write_bytes(whole[: len(whole) // 2])
        os.utime(obj, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    run = _load_in_a_new_process(name, source)
    assert run.returncode == 0, (run.returncode, run.stderr)
    assert run.stdout.strip() == "2"


def test_a_build_killed_midway_does_not_hang_the_next_one(tmp_path, monkeypatch):
    """A build killed mid-way (OOM, SIGKILL) leaves torch's lock file; the next process builds instead of waiting on
    it forever."""
    name, source = _plain_family_source(tmp_path)
    monkeypatch.setenv("AMPKIT_EXTENSIONS_DIR", str(tmp_path / "ext"))
    build_dir = _build.extension_dir(name, [source], with_cuda=False)
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()
    try:
        run = _load_in_a_new_process(name, source)
    except subprocess.TimeoutExpired:
        pytest.fail("the build waited on the killed build's lock file")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "2"


def test_a_truncated_cached_library_is_rebuilt_not_loaded(tmp_path, monkeypatch):
    """A cache entry cut short (a partial copy, its timestamp kept) killed the loading process with SIGBUS, and ninja
    called it up to date; it is rebuilt instead."""
    name, source = _plain_family_source(tmp_path)
    monkeypatch.setenv("AMPKIT_EXTENSIONS_DIR", str(tmp_path / "ext"))
    # Built in a child: a library this process had loaded, cut short under its mapping, is a SIGBUS here later.
    assert _load_in_a_new_process(name, source).returncode == 0
    library = _build.extension_dir(name, [source], with_cuda=False) / f"{name}.so"
    whole, stamp = library.read_bytes(), library.stat()
    library.write_bytes(whole[: len(whole) // 2])
    os.utime(library, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    run = _load_in_a_new_process(name, source)
    assert run.returncode == 0, (run.returncode, run.stderr)
    assert run.stdout.strip() == "2"
    assert library.stat().st_size == len(whole)


def test_a_build_cache_that_cannot_be_written_is_named_with_the_variable_that_moves_it(tmp_path, monkeypatch):
    """A HOME that is read-only or missing (a container's) left '[Errno 20] Not a directory' and no way out."""
    (tmp_path / "home").write_text("a file where the cache's parent should be")
    monkeypatch.setenv("AMPKIT_EXTENSIONS_DIR", str(tmp_path / "home" / "cache"))
    monkeypatch.delenv("AMPKIT_OPS", raising=False)
    source = tmp_path / "fine.cpp"
    source.write_text("int ampkit_test_fine() { return 1; }\n")
    name = f"ampkit_uncached_{tmp_path.name.replace('-', '_')}"
    family = _build.register_family(name, [source])
    try:
        with pytest.warns(RuntimeWarning) as record:
            assert family.use_kernel() is False
    finally:
        _build.FAMILIES.pop(name, None)
    (warning,) = [str(w.message) for w in record if name in str(w.message)]
    assert f"its build cache '{tmp_path / 'home' / 'cache' / 'ampkit'}" in warning
    assert "cannot be written (Not a directory): set AMPKIT_EXTENSIONS_DIR to a writable directory" in warning
