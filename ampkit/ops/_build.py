"""Just-in-time loader for ampkit's C++/CUDA op families, with a pure-PyTorch fallback.

Each op family (``ampkit_multi_tensor``, ``ampkit_optimizers``, ``ampkit_norms``) is one shared library
that registers its ops with ``TORCH_LIBRARY(<family>, m)``; once loaded they live at
``torch.ops.<family>.*``. The library is compiled on first use with torch's extension tooling (ninja)
and cached across processes in ``$AMPKIT_EXTENSIONS_DIR`` (default: torch's extension root,
``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``) under a directory keyed by a hash of the
sources, every header under their csrc root, the flags, torch/Python versions and the CPU's feature
flags (we build with ``-march=native``), so an edited header or another machine never reuses a stale
binary. A warm load is a plain ``dlopen`` of the cached library (no ninja run).

``AMPKIT_OPS`` selects the implementation, read at every call so tests can switch it:

* unset / ``auto``: use the kernel; if no compiler is present or the build fails, warn once (naming
  the cause) and use the reference. If only the CUDA part fails (no usable toolkit, an nvcc error), the
  family is built CPU-only instead: CPU tensors keep the kernels, CUDA tensors take the path of a build
  made without a GPU, and one warning per family names the CUDA failure. The failure is remembered in the
  cache, so later processes build CPU-only at once until the toolchain or the sources change.
* ``reference``: never build; always use the pure-PyTorch reference.
* ``kernel``: a missing compiler or failed build (its CUDA part included) raises ``RuntimeError`` naming the
  family — for tests of kernels, so a broken build cannot silently pass against the reference.

A family frontend declares itself once and asks on every op call (a dict lookup after the first)::

    _OPS = register_family("ampkit_multi_tensor", sources=[CSRC_DIR / "multi_tensor" / "multi_tensor.cpp"])
    if _OPS.use_kernel():
        torch.ops.ampkit_multi_tensor.scale_(...)
    else:
        reference.scale_(...)

``python -m ampkit.ops.build`` compiles every registered family ahead of time (see
:mod:`ampkit.ops.build`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ampkit.wording import shown

CSRC_DIR = Path(__file__).resolve().parent / "csrc"

# -fno-math-errno lets gcc vectorize sqrt (without it the sqrt kernels ran at 0.5x of torch). -fopenmp makes
# at::parallel_for (an inline header template) open OpenMP regions; the GOMP symbols resolve
# against the libgomp that libtorch_cpu already loaded, so threads follow torch.set_num_threads.
# -ffp-contract=off: gcc contracts a*b+c into an FMA wherever it chooses by default, so each dtype's instantiation
# of a kernel (and each compiler or -march) could round differently; without it a half kernel computes exactly
# its float kernel rounded once, on any x86 machine (it was set per file for the optimizers only).
# The C++ standard is left to torch (c++20 for torch 2.13). CUDA: no fast-math and no FMA contraction
# (--fmad=false), so GPU results round like the CPU kernels (built with fp-contract=off) and like
# torch.optim's foreach kernels: over 100 AdamW steps FMA alone drifted 1.1e-6 from torch on an H100.
# The kernels are memory-bound; contraction buys no time.
CXX_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp")
CUDA_FLAGS = ("-O3", "--fmad=false")
# Part of the cache key: libraries linked before libstdc++ was named explicitly are rebuilt once.
_LINK_KEY = "shared-libstdc++"
_MARKER = "ampkit.ok"  # written last in a build directory, naming the library: a build cut short leaves none
_LOCK = "ampkit.lock"
_CUDA_FAILED = "ampkit.cuda-failed"  # in a CUDA build's directory: the toolchain it failed with, and why (JSON)
# What, besides the sources, flags and torch (the directory's key), decides whether a CUDA build can succeed.
_TOOLCHAIN_ENV = ("CUDA_HOME", "CUDA_PATH", "CXX", "CC", "CUDAHOSTCXX", "NVCC_CCBIN", "NVCC_PREPEND_FLAGS",
                  "NVCC_APPEND_FLAGS", "TORCH_CUDA_ARCH_LIST")  # fmt: skip

_MODES = ("auto", "reference", "kernel")
_ERROR_LINE = re.compile(r"\b(error|fatal)\b", re.IGNORECASE)  # gcc/nvcc "error:", "nvcc fatal :"
_loaded: dict[str, bool] = {}
_failures: dict[str, str] = {}
_cuda_failures: dict[str, str] = {}  # families loaded CPU-only because their CUDA build failed: the first error line
_warned_no_compiler = False


@dataclass(frozen=True)
class Family:
    """One op family: the shared library ``name`` built from ``sources`` (+ ``cuda_sources`` on GPU hosts)."""

    name: str
    sources: tuple[Path, ...]
    cuda_sources: tuple[Path, ...] = ()

    def use_kernel(self) -> bool:
        """True when this family's ops should run compiled (see :func:`use_kernel`)."""
        return use_kernel(self.name, self.sources, self.cuda_sources)

    def load(self) -> bool:
        """Build or load the library now; True on success (see :func:`load_extension`)."""
        return load_extension(self.name, self.sources, self.cuda_sources)

    def serves(self, device: torch.device, probe_op: str) -> bool:
        """True when this family's compiled ops run on ``device`` (CPU or CUDA), building it on first call.

        CUDA counts only if the build registered ``probe_op`` (an op name of the family) for CUDA, i.e. a
        GPU and nvcc were there at build time. Under ``AMPKIT_OPS=kernel`` a CUDA device the build left
        out is an error instead of a silent fallback to the reference.
        """
        if device.type not in ("cpu", "cuda") or not self.use_kernel():
            return False
        if device.type == "cpu":
            return True
        served = torch._C._dispatch_has_kernel_for_dispatch_key(f"{self.name}::{probe_op}", "CUDA")
        if not served and ops_mode() == "kernel":
            why = _cuda_failures.get(self.name, "no CUDA toolkit at build time")
            raise RuntimeError(
                f"ampkit: {self.name} was built without CUDA kernels ({why}) "
                "and AMPKIT_OPS=kernel forbids the reference fallback"
            )
        return served


FAMILIES: dict[str, Family] = {}


def register_family(name: str, sources: Sequence[str | Path], cuda_sources: Sequence[str | Path] = ()) -> Family:
    """Declare an op family (idempotent); the ahead-of-time build compiles every registered one."""
    family = Family(name, tuple(Path(s) for s in sources), tuple(Path(s) for s in cuda_sources))
    FAMILIES[name] = family
    return family


def ops_mode() -> str:
    """The implementation ``AMPKIT_OPS`` selects: ``auto`` (default), ``reference`` or ``kernel``."""
    mode = os.environ.get("AMPKIT_OPS", "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"AMPKIT_OPS={shown(mode)} is not valid; use one of {', '.join(_MODES)}")
    return mode


def use_kernel(name: str, sources: Sequence[str | Path], cuda_sources: Sequence[str | Path] = ()) -> bool:
    """True when ops of family ``name`` should run the compiled kernel (building it if needed).

    Returns False in ``reference`` mode, or in ``auto`` mode after a failed build (warned once).
    Raises ``RuntimeError`` in ``kernel`` mode if the family cannot be built.
    """
    mode = ops_mode()
    if mode == "reference":
        return False
    ok = _loaded.get(name)
    if ok is None:
        ok = load_extension(name, sources, cuda_sources)
    if not ok and mode == "kernel":
        raise RuntimeError(
            f"ampkit: C++ ops {name!r} are unavailable and AMPKIT_OPS=kernel forbids the reference "
            f"fallback: {_failures.get(name, 'unknown cause')}"
        )
    return ok


def load_extension(name: str, sources: Sequence[str | Path], cuda_sources: Sequence[str | Path] = ()) -> bool:
    """Build (or load from cache) the extension ``name`` and register its ops; True on success.

    ``cuda_sources`` (``.cu`` files and the ``*_cuda.cpp`` that registers their CUDA dispatch) join
    the build only when torch sees a CUDA device and a CUDA toolkit. If that build fails, the family is
    built CPU-only (its own cache entry) so CPU tensors keep the kernels, with one warning naming the
    CUDA failure; under ``AMPKIT_OPS=kernel`` the CUDA failure is the family's failure instead. On
    failure the cause is recorded, one warning is issued (unless ``AMPKIT_OPS=kernel``, where the
    caller raises), and False is returned; the result is remembered for the life of the process.
    """
    if name in _loaded:
        return _loaded[name]
    cpu_sources, cuda_sources = [Path(s) for s in sources], [Path(s) for s in cuda_sources]
    try:
        if _wants_cuda(cuda_sources):
            _build_with_cuda_or_cpu_only(name, cpu_sources, cuda_sources)
        else:
            _build_and_load(name, cpu_sources, with_cuda=False)
    except _NoCompiler as exc:
        _record_failure(name, str(exc), per_family_warning=False)
        return False
    except Exception as exc:  # a failed build must not take the training run down in auto mode
        _record_failure(name, str(exc) if isinstance(exc, _BuildFailed) else _short_cause(exc), per_family_warning=True)
        return False
    _loaded[name] = True
    return True


def extension_dir(name: str, sources: Sequence[Path], with_cuda: bool) -> Path:
    """The cache directory for this exact build of ``name`` (keyed by content, flags and platform)."""
    root = os.environ.get("AMPKIT_EXTENSIONS_DIR") or os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        root = os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    return Path(root) / "ampkit" / f"{name}-{_build_key(sources, with_cuda)}"


class _NoCompiler(RuntimeError):
    pass


class _BuildFailed(RuntimeError):
    """A build failure whose message is already the cause to report."""


def _wants_cuda(cuda_sources: Sequence[Path]) -> bool:
    return bool(cuda_sources) and torch.cuda.is_available() and _cuda_toolkit_present()


def _build_with_cuda_or_cpu_only(name: str, cpu_sources: list[Path], cuda_sources: list[Path]) -> None:
    """Build ``name`` with its CUDA sources; if that fails, build it CPU-only and warn once, naming the failure.

    A broken toolkit (CUDA_HOME unset, a CUDA version torch refuses, an nvcc error) must not cost the CPU
    kernels: without this the whole family fell back to the several-times-slower reference. The failure is
    remembered in the cache (see :func:`_build_and_load`), so that later processes (each DataLoader worker, each
    torchrun rank) do not spend minutes failing again while nothing that decides the build changed.
    """
    remembered = False
    try:
        _build_and_load(name, cpu_sources + cuda_sources, with_cuda=True)
        return
    except _NoCompiler:
        raise
    except _CudaFailedBefore as exc:
        cuda_cause, remembered = exc.cause, True
    except Exception as exc:
        if ops_mode() == "kernel":
            raise _BuildFailed(f"building its CUDA kernels failed: {_short_cause(exc)}") from exc
        cuda_cause = _first_error_line(exc)
    try:
        _build_and_load(name, cpu_sources, with_cuda=False)
    except _NoCompiler:
        raise
    except Exception as exc:
        raise _BuildFailed(f"{_short_cause(exc)} (its CUDA build had failed first: {cuda_cause})") from exc
    _cuda_failures[name] = cuda_cause
    version = f", CUDA {torch.version.cuda} as torch was built with" if torch.version.cuda else ""
    change = "the sources, the CUDA toolkit, the C++ compiler, TORCH_CUDA_ARCH_LIST or the GPUs change"
    failed = (
        f"the CUDA kernels of C++ ops {name!r} failed to build in an earlier process ({cuda_cause}), and are not "
        f"built again until {change} (`python -m ampkit.ops.build` tries again now)"
        if remembered
        else f"could not build the CUDA kernels of C++ ops {name!r} ({cuda_cause}); later processes do not try "
        f"again until {change}"
    )
    warnings.warn(
        f"ampkit: {failed}. Its CPU kernels are in use, and CUDA tensors take its PyTorch fallback (torch's ops or "
        f"the reference). To get the CUDA kernels, fix the CUDA toolkit (nvcc on PATH or in CUDA_HOME{version}), "
        "then run `python -m ampkit.ops.build`.",
        RuntimeWarning,
        stacklevel=4,
    )


def _build_and_load(name: str, sources: list[Path], with_cuda: bool) -> None:
    """Load ``name`` from the cache, or build it there first. A CUDA build's failure is written beside it, with the
    toolchain it failed with (:func:`_cuda_toolchain`): while that stands, ``auto`` mode raises
    :class:`_CudaFailedBefore` instead of building again (``kernel`` mode, the ahead-of-time build's, tries again)."""
    build_dir = extension_dir(name, sources, with_cuda)
    if _load_cached(build_dir):
        return
    _check_toolchain()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        (build_dir / _LOCK).touch()
    except OSError as exc:  # a HOME read-only or missing (a container's), a cache directory on a full disk
        raise _BuildFailed(
            f"its build cache '{build_dir}' cannot be written ({exc.strerror or exc}): set AMPKIT_EXTENSIONS_DIR to "
            "a writable directory (without it, TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions)"
        ) from None
    toolchain = _cuda_toolchain() if with_cuda else None
    with _build_lock(build_dir):  # under it, another process's finished build or failure is seen once it is written
        if _load_cached(build_dir):
            return
        if toolchain is not None and ops_mode() != "kernel":
            _raise_if_failed_before(build_dir, toolchain)
        _clear_build_dir(build_dir)
        print(
            f"ampkit: compiling C++ ops {name!r} for this machine: first use of these sources, so this step waits "
            f"~30-60 s once; later runs load {build_dir} (`python -m ampkit.ops.build` builds ahead of time)",
            file=sys.stderr,
            flush=True,
        )
        from torch.utils import cpp_extension

        try:
            built = cpp_extension.load(
                name=name,
                sources=[str(s) for s in sources],
                extra_cflags=list(CXX_FLAGS),
                extra_cuda_cflags=list(CUDA_FLAGS),
                extra_ldflags=_shared_libstdcxx(),
                extra_include_paths=[str(CSRC_DIR)],
                build_directory=str(build_dir),
                with_cuda=with_cuda,
                is_python_module=False,
                verbose=False,
            )
        except Exception as exc:
            if toolchain is not None:
                _remember_cuda_failure(build_dir, toolchain, _first_error_line(exc))
            raise
        (build_dir / _CUDA_FAILED).unlink(missing_ok=True)
        (build_dir / _MARKER).write_text(Path(built).name)


def _load_cached(build_dir: Path) -> bool:
    """Load the library a finished build left in ``build_dir``; False when there is none, or it is gone, cut short or
    refused by the loader (a corrupt cache entry: the build that follows starts from scratch)."""
    marker = build_dir / _MARKER
    library = build_dir / _built_library_name(marker)
    if not (marker.exists() and library.is_file() and _elf_complete(library)):
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError:
        return False
    return True


def _clear_build_dir(build_dir: Path) -> None:
    """Empty ``build_dir`` but for the locks (ours; torch's, where ours is not to be had) and a CUDA failure's record,
    so that a build starts from scratch: what is there is a build cut short or a corrupt cache entry (a partial copy
    damages objects as well as the library), and ninja, which judges by timestamps, would call a damaged object up
    to date and link it."""
    for entry in build_dir.iterdir():
        if entry.name in (_LOCK, "lock", _CUDA_FAILED):
            continue
        with contextlib.suppress(OSError):  # a read-only cache: the build then names what is wrong
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()


class _CudaFailedBefore(RuntimeError):
    """The CUDA build of these sources failed in an earlier process with the same toolchain."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


def _raise_if_failed_before(build_dir: Path, toolchain: dict[str, str]) -> None:
    try:
        record = json.loads((build_dir / _CUDA_FAILED).read_text())
    except (OSError, ValueError):  # none, or one cut short: try the build
        return
    if isinstance(record, dict) and record.get("toolchain") == toolchain:
        raise _CudaFailedBefore(str(record.get("cause", "cause not recorded")))


def _remember_cuda_failure(build_dir: Path, toolchain: dict[str, str], cause: str) -> None:
    record = json.dumps({"toolchain": toolchain, "cause": cause}, indent=1)
    with contextlib.suppress(OSError):  # a read-only cache: later processes try again, as before
        staged = build_dir / f"{_CUDA_FAILED}.{os.getpid()}"
        staged.write_text(record)
        os.replace(staged, build_dir / _CUDA_FAILED)


def _cuda_toolchain() -> dict[str, str]:
    """What decides a CUDA build besides the directory's key (sources, flags, torch): the nvcc and the C++ compiler
    found (path, size and time: a reinstall or upgrade changes them), the settings torch's build reads, and the GPUs
    (the architectures built for). Read without starting CUDA: a DataLoader worker must not."""
    found = {
        "nvcc": _file_identity(_nvcc()),
        "c++": _file_identity(shutil.which(cxx_compiler())),
        "gpus": _gpu_models(),
    }
    found.update({name: os.environ[name] for name in _TOOLCHAIN_ENV if name in os.environ})
    return found


def _nvcc() -> str | None:
    """The nvcc torch's build uses: under CUDA_HOME (or CUDA_PATH), else the one on PATH, else CUDA's default home."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return str(Path(home, "bin", "nvcc"))
    return shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"


def _file_identity(path: str | None) -> str:
    if path is None:
        return "none"
    try:
        real = os.path.realpath(path)
        found = os.stat(real)
    except OSError:
        return f"{path} (absent)"
    return f"{real} {found.st_size} {found.st_mtime_ns}"


def _gpu_models() -> str:
    """The GPUs the driver lists (Linux), else how many torch sees: both without a CUDA context."""
    models = []
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        with contextlib.suppress(OSError):
            lines = info.read_text().splitlines()
            models += [line.split(":", 1)[1].strip() for line in lines if line.startswith("Model:")]
    return ", ".join(models) if models else f"{torch.cuda.device_count()} devices"


def _elf_complete(library: Path) -> bool:
    """False for an ELF library cut short (a partial copy of the cache): dlopen of one kills the process with
    SIGBUS instead of raising. The section header table ends the file, so it must fit in what is there."""
    with open(library, "rb") as file:
        header = file.read(64)
    if header[:4] != b"\x7fELF" or header[4:5] != b"\x02":  # not a 64-bit ELF: leave it to dlopen
        return True
    if len(header) < 64:
        return False
    order = "little" if header[5] == 1 else "big"
    table_offset = int.from_bytes(header[0x28:0x30], order)
    entry_size, entries = int.from_bytes(header[0x3A:0x3C], order), int.from_bytes(header[0x3C:0x3E], order)
    return table_offset + entry_size * entries <= library.stat().st_size


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``build_dir`` while building there; the OS drops it when the process dies.

    torch's own build lock is a plain file that a killed build (OOM, SIGKILL, a preempted node) leaves behind,
    and every later build of that directory then waits on it forever, silently. While this lock is held no
    other ampkit process is building here, so a torch lock file found is such a leftover and is removed.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's lock file alone, as before
        yield
        return
    with open(build_dir / _LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file is closed, or by the OS on a crash
        (build_dir / "lock").unlink(missing_ok=True)
        yield


def _built_library_name(marker: Path) -> str:
    """The library file a finished build left. torch names it ``<name>_v1.so`` when this process already built
    ``<name>`` from other sources (a CPU-only build after the CUDA one failed); older markers hold the bare name."""
    try:
        written = marker.read_text().strip()
    except OSError:
        return ""
    return written if written.endswith(".so") else f"{written}.so"


def cxx_compiler() -> str:
    """The C++ compiler torch's extension build runs: ``$CXX``, else ``c++``."""
    return os.environ.get("CXX", "c++")


def _check_toolchain() -> None:
    cxx = cxx_compiler()
    if shutil.which(cxx) is None:
        raise _NoCompiler(f"no C++ compiler found ({cxx!r} is not on PATH; set CXX to choose one)")
    if shutil.which("ninja") is None:
        raise _NoCompiler("ninja is not installed (pip install ninja)")


def _shared_libstdcxx() -> list[str]:
    """The shared C++ runtime as an explicit link input, so the library never carries its own copy.

    A toolchain seen on a GPU machine (g++ 13) linked libstdc++ statically into the extension; that
    private copy's locale is never initialised, and the first error message that formats a number
    (``params[3] ...``) segfaulted. Named on the link line before g++'s implicit ``-lstdc++``, the
    shared runtime resolves every libstdc++ symbol. Empty where the compiler cannot name the file.
    """
    if not sys.platform.startswith("linux"):
        return []
    try:
        found = subprocess.run(
            [cxx_compiler(), "-print-file-name=libstdc++.so.6"],
            capture_output=True, text=True, timeout=60, check=False,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    return [found] if os.path.isabs(found) and os.path.exists(found) else []


def _cuda_toolkit_present() -> bool:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    return shutil.which("nvcc") is not None or bool(home and Path(home, "bin", "nvcc").exists())


def _build_key(sources: Sequence[Path], with_cuda: bool) -> str:
    digest = hashlib.sha256()
    parts = (torch.__version__, sys.version, platform.machine(), str(with_cuda), *CXX_FLAGS, *CUDA_FLAGS, _LINK_KEY)
    for part in parts:
        digest.update(part.encode())
    digest.update(_cpu_flags().encode())
    files = {Path(s).resolve() for s in sources}
    for source in list(files):  # a family may include headers from anywhere under its csrc root
        files.update(p.resolve() for p in source.parent.parent.rglob("*.h"))
        files.update(p.resolve() for p in source.parent.parent.rglob("*.cuh"))
    for path in sorted(files):
        digest.update(str(path.name).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _short_cause(exc: BaseException, limit: int = 2000) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else "..." + text[-limit:]


def _first_error_line(exc: BaseException, limit: int = 300) -> str:
    """The line of a build failure that says what went wrong: the first compiler error, else the first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    found = next((line for line in lines if _ERROR_LINE.search(line) and not line.startswith("Error building")), None)
    line = found or f"{type(exc).__name__}: {lines[0] if lines else 'no message'}"
    return line if len(line) <= limit else line[:limit] + "..."


def _record_failure(name: str, cause: str, per_family_warning: bool) -> None:
    global _warned_no_compiler
    _loaded[name] = False
    _failures[name] = cause
    if ops_mode() == "kernel":
        return
    if not per_family_warning:
        if _warned_no_compiler:
            return
        _warned_no_compiler = True
        message = f"ampkit: {cause}; ampkit.ops uses its pure-PyTorch reference ops (slower)."
    else:
        message = f"ampkit: could not build C++ ops {name!r}; using the pure-PyTorch reference. {cause}"
    warnings.warn(message + " Set AMPKIT_OPS=reference to silence this.", RuntimeWarning, stacklevel=4)
