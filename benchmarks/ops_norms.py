"""Norms section of ``benchmarks/ops.py``: fused LayerNorm/RMSNorm fwd+bwd vs F.layer_norm / F.rms_norm.

Run with the whole table (``PYTHONPATH=$PWD python benchmarks/ops.py``) or alone::

    PYTHONPATH=$PWD python benchmarks/ops_norms.py [--threads 2] [--quick]

Each case times ``y = norm(x); y.backward(dy)`` with x, weight and bias requiring grad, at
(8192, 1024) and (32768, 4096) (``--quick``: the first only), fp32 and bf16. Bytes the op must move
per element: x read and y written (forward), dy and x read and dx written (backward): 5 x element
size; weight-sized traffic is ignored. % of ceiling is against the harness's read+write ceiling.

Large freed blocks are kept in the heap (glibc ``mallopt``) so that output and gradient buffers are
warm pages for both torch and ampkit, as with a caching allocator in a training loop; otherwise each
fresh 16-512 MB buffer pays ~0.3 ms/MB of page faults on both sides and the table measures the
kernel's page-fault handler.

SyncBatchNorm's local statistics (per-channel mean and invstd, NCHW and channels-last): ampkit's kernel
against ``torch.batch_norm_update_stats``, torch's only CPU kernel for them (``torch.batch_norm_stats`` is
CUDA-only); bytes: the input, read once, against the read ceiling. ``ampkit.ops.norms.batch_norm_stats``
uses the kernel where these rows show it winning (NCHW) and torch's elsewhere.

The fused row is what ``auto`` runs (``AMPKIT_FUSED_BACKEND``): where it hands a case to torch's kernel (fp32
LayerNorm on the CPU) a ``backend=ampkit`` row times ampkit's kernel beside it, the evidence for that rule.

Targets (issue 5): fp32 ratio >= 3x (LayerNorm) and >= 10x (RMSNorm), and >= 50% of the ceiling.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ampkit.ops._backend import ENV_VAR  # noqa: E402
from ampkit.ops.norms import _torch_runs, fused_layer_norm_affine, fused_rms_norm_affine  # noqa: E402

EPS = 1e-5
SHAPES = ((8192, 1024), (32768, 4096))
DTYPES = (torch.float32, torch.bfloat16)
BN_SHAPES = ((64, 64, 56, 56), (32, 256, 14, 14))
BIG = 1 << 26  # elements above which a case runs only a few timed calls (torch RMSNorm takes seconds)


def keep_freed_memory_warm() -> bool:
    """Stop glibc from unmapping large freed blocks, so reallocating them does not page-fault again."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    int_max = 2**31 - 1  # mallopt takes a C int: larger values wrap (1 << 40 would become 0: always trim)
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, int_max))


def _fwd_bwd(kind: str, backend: str | None, x, w, b, dy) -> Callable[[], None]:
    """One fwd+bwd: torch's function (``backend=None``) or ampkit's under that ``AMPKIT_FUSED_BACKEND``."""
    n = x.shape[-1]
    params = (x, w, b) if kind == "LayerNorm" else (x, w)
    fused = backend is not None

    def step() -> None:
        for p in params:
            p.grad = None
        if fused:
            os.environ[ENV_VAR] = backend
        if kind == "LayerNorm":
            y = fused_layer_norm_affine(x, w, b, n, EPS) if fused else F.layer_norm(x, (n,), w, b, EPS)
        else:
            y = fused_rms_norm_affine(x, w, n, EPS) if fused else F.rms_norm(x, (n,), w, EPS)
        y.backward(dy)

    return step


def run(ctx) -> list[dict]:
    """Rows for the ops table: one per (op, shape, dtype)."""
    os.environ["AMPKIT_OPS"] = "kernel"
    keep_freed_memory_warm()
    rows = []
    for n_rows, n in SHAPES[:1] if ctx.quick else SHAPES:
        for dtype in DTYPES:
            x = torch.randn(n_rows, n, dtype=dtype).requires_grad_()
            dy = torch.randn(n_rows, n, dtype=dtype)
            w = (torch.rand(n) + 0.5).to(dtype).requires_grad_()
            b = torch.randn(n, dtype=dtype).requires_grad_()
            nbytes = 5 * x.numel() * x.element_size()
            # Interleaved calls, best of each (harness); the big cases take seconds per torch call.
            few = {"min_time_s": 0.0, "min_iters": 2} if x.numel() > BIG else {}
            size = f"{n_rows}x{n} {str(dtype).removeprefix('torch.')}"
            for kind, baseline in (("LayerNorm", "F.layer_norm"), ("RMSNorm", "F.rms_norm")):
                os.environ[ENV_VAR] = "auto"
                routed = _torch_runs(kind, x, w, False, layer_norm=kind == "LayerNorm")
                for backend in ("auto", "ampkit") if routed else ("auto",):
                    torch_ms, ms = ctx.compare_ms(
                        _fwd_bwd(kind, None, x, w, b, dy), _fwd_bwd(kind, backend, x, w, b, dy), **few
                    )
                    name = f"{kind} fwd+bwd" + (", backend=ampkit" if backend == "ampkit" else "")
                    rows.append(ctx.row("norms", name, baseline, size, ms, torch_ms, nbytes))
            del x, dy, w, b
    rows += batch_norm_stats_rows(ctx)
    return rows


def batch_norm_stats_rows(ctx) -> list[dict]:
    """SyncBatchNorm local statistics: ampkit's CPU kernel vs torch.batch_norm_update_stats."""
    rows = []
    for shape in BN_SHAPES[1:] if ctx.quick else BN_SHAPES:
        for fmt, fmt_name in ((torch.contiguous_format, "NCHW"), (torch.channels_last, "NHWC")):
            x = torch.randn(shape).contiguous(memory_format=fmt)
            torch_ms, ms = ctx.compare_ms(
                lambda x=x: torch.batch_norm_update_stats(x, None, None, 0.1),
                lambda x=x: torch.ops.ampkit_norms.batch_norm_stats(x, EPS),
            )
            size = f"{'x'.join(map(str, shape))} {fmt_name}"
            rows.append(
                ctx.row("norms", "SyncBN local stats kernel", "batch_norm_update_stats", size, ms, torch_ms,
                        x.numel() * 4, "read")
            )  # fmt: skip
    return rows


def _harness():
    """benchmarks/ops.py loaded by path (it is a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("ops_bench", Path(__file__).resolve().parent / "ops.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Fused norms vs torch, fwd+bwd")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="only the 8192x1024 cases")
    args = parser.parse_args(argv)
    harness = _harness()
    torch.set_num_threads(args.threads)
    ctx = harness.BenchContext(threads=args.threads, quick=args.quick, sizes=())
    rows = harness.measure_ceilings(ctx)
    rows += run(ctx)
    harness.print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
