"""Compile check of ampkit's CUDA sources where no GPU exists: ``python -m ampkit.ops.cuda_compile_check``.

Runs ``nvcc -c`` on every ``ampkit/ops/csrc/**/*.cu`` and a host-compiler syntax check (``-fsyntax-only``)
on every ``*_cuda.cpp`` (the tensor-level CUDA dispatch, built only on GPU hosts) against the installed
torch headers and the CUDA toolkit's headers, ``--jobs`` at a time (default 2). Nothing is linked:
the CPU torch wheel has no CUDA libraries. Exits 0 when all compile, 1 on any failure (printing the
compiler output), 2 when nvcc is missing. ``--arch`` picks the one GPU architecture compiled for.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ampkit.ops._build import CSRC_DIR, CUDA_FLAGS, cxx_compiler  # what the JIT build passes nvcc and runs

# The CPU wheel ships c10/cuda headers but not their CMake-generated config header.
DEFINES = ("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE",)


def cuda_sources(root: Path = CSRC_DIR) -> list[Path]:
    """Every CUDA-only source under ``root``: the ``.cu`` kernels and the ``*_cuda.cpp`` dispatchers."""
    return sorted([*root.rglob("*.cu"), *root.rglob("*_cuda.cpp")])


def _include_flags(nvcc: str) -> list[str]:
    import torch.utils.cpp_extension as cpp_extension

    homes = [
        os.environ.get("CUDA_HOME"),
        cpp_extension.CUDA_HOME,
        Path(nvcc).resolve().parents[1],
        "/usr/local/cuda",
    ]
    cuda_include = next(
        (Path(h) / "include" for h in homes if h and (Path(h) / "include/cuda_runtime.h").exists()), None
    )
    dirs = [str(CSRC_DIR), *cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    if cuda_include is not None:  # nvcc finds its own headers; the host compiler needs them spelled out
        dirs.append(str(cuda_include))
    return [f"-I{d}" for d in dirs]


def _command(source: Path, nvcc: str, includes: list[str], arch: str, out_dir: Path) -> list[str]:
    if source.suffix == ".cu":
        obj = out_dir / (source.stem + ".o")
        return [
            nvcc,
            "-c",
            "-std=c++20",
            *CUDA_FLAGS,
            f"-arch={arch}",
            *DEFINES,
            *includes,
            str(source),
            "-o",
            str(obj),
        ]
    cxx = cxx_compiler()
    return [cxx, "-fsyntax-only", "-std=c++20", *DEFINES, *includes, str(source)]


def _compile(command: list[str]) -> tuple[int, str, float]:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    return done.returncode, done.stdout + done.stderr, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    """Compile every CUDA source; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--arch", default="sm_80")
    parser.add_argument("--root", type=Path, default=CSRC_DIR, help="source tree to check (default: ampkit's)")
    args = parser.parse_args(argv)
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("cuda_compile_check: nvcc not found on PATH; install the CUDA toolkit to check CUDA sources",
              file=sys.stderr)  # fmt: skip
        return 2
    sources = cuda_sources(args.root)
    if not sources:
        print(f"cuda_compile_check: no CUDA sources under {args.root}", file=sys.stderr)
        return 1
    includes = _include_flags(nvcc)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out_dir, ThreadPoolExecutor(args.jobs) as pool:
        commands = [_command(s, nvcc, includes, args.arch, Path(out_dir)) for s in sources]
        results = list(pool.map(_compile, commands))
    failed = 0
    for source, (code, output, seconds) in zip(sources, results, strict=True):
        name = source.relative_to(args.root)
        print(f"{'ok  ' if code == 0 else 'FAIL'} {name} ({seconds:.1f} s)")
        if code != 0:
            failed += 1
            print(output, file=sys.stderr)
    elapsed = time.perf_counter() - start
    print(f"cuda_compile_check: {len(sources) - failed}/{len(sources)} compiled in {elapsed:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
