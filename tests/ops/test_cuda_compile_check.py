"""The CUDA compile check: finds every CUDA source, fails loudly on a broken one or a missing nvcc.

The full check of ampkit's kernels (~20-30 s of nvcc) runs in CI as
``python -m ampkit.ops.cuda_compile_check``; these tests exercise the checker itself on tiny sources.
"""

from __future__ import annotations

import shutil

import pytest

from ampkit.ops import cuda_compile_check as check

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs the CUDA toolkit (nvcc)")


def test_finds_every_cuda_source():
    names = {p.relative_to(check.CSRC_DIR).as_posix() for p in check.cuda_sources()}
    assert {"multi_tensor/multi_tensor_kernels.cu", "multi_tensor/multi_tensor_cuda.cpp"} <= names
    assert not any(name.endswith("_cpu.cpp") for name in names)


@needs_nvcc
def test_compiles_good_and_reports_broken_sources(tmp_path, capsys):
    (tmp_path / "good.cu").write_text("__global__ void twice(float* x) { x[threadIdx.x] *= 2.f; }\n")
    assert check.main(["--root", str(tmp_path)]) == 0
    (tmp_path / "broken.cu").write_text("__global__ void broken( { }\n")
    assert check.main(["--root", str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert "FAIL broken.cu" in out.out and "ok   good.cu" in out.out
    assert "broken.cu" in out.err


def test_missing_nvcc_is_an_error(monkeypatch, capsys):
    monkeypatch.setattr(check.shutil, "which", lambda name: None)
    assert check.main([]) == 2
    assert "nvcc not found" in capsys.readouterr().err
