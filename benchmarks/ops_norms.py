"""Fused LayerNorm/RMSNorm fwd+bwd vs torch (``F.layer_norm`` / ``F.rms_norm``), one process, warm buffers.

Run on its own: ``PYTHONPATH=$PWD python benchmarks/ops_norms.py [--threads 2] [--quick]``; the ops
harness imports :func:`rows`.

Each case times ``y = norm(x); y.backward(dy)`` with x, weight and bias requiring grad (best of a few
runs after warm-up). Bytes counted per element: x read and y written (forward), dy and x read and dx
written (backward): 5 x element size; weight-sized traffic is ignored. The bandwidth ceiling is a
STREAM-style triad (``a = b + s * c`` over 3 x 256 MB, 12 B/element) measured in the same run. Large
freed blocks are kept in the heap (glibc ``mallopt``) so that output and gradient buffers are warm
pages for both torch and ampkit, as with a caching allocator in a training loop; without it every
fresh 32-512 MB buffer costs ~0.3 ms/MB of page faults on both sides.

Targets (issue 5): fp32 speedup >= 3x (LayerNorm) and >= 10x (RMSNorm), and >= 50% of the ceiling.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ampkit.ops.norms import fused_layer_norm_affine, fused_rms_norm_affine  # noqa: E402

EPS = 1e-5
SHAPES = ((8192, 1024), (32768, 4096))
DTYPES = (torch.float32, torch.bfloat16)
TARGET_SPEEDUP = {"LayerNorm": 3.0, "RMSNorm": 10.0}
TARGET_CEILING_FRACTION = 0.5


def keep_freed_memory_warm() -> bool:
    """Stop glibc from returning large freed blocks to the OS (so they are not page-faulted again)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, 1 << 40))


def best_seconds(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def triad_gbps(numel: int = 64 << 20) -> float:
    """Memory-bandwidth ceiling: a = b + 2 * c, counted as 12 bytes per fp32 element."""
    a, b, c = torch.empty(numel), torch.rand(numel), torch.rand(numel)
    seconds = best_seconds(lambda: torch.add(b, c, alpha=2.0, out=a), reps=8)
    return 12 * numel / seconds / 1e9


def _fwd_bwd(kind: str, impl: str, x, w, b, dy) -> Callable[[], None]:
    n = x.shape[-1]
    params = (x, w, b) if kind == "LayerNorm" else (x, w)

    def step() -> None:
        for p in params:
            p.grad = None
        if kind == "LayerNorm":
            y = (
                F.layer_norm(x, (n,), w, b, EPS)
                if impl == "torch"
                else fused_layer_norm_affine(x, w, b, n, EPS)
            )
        else:
            y = F.rms_norm(x, (n,), w, EPS) if impl == "torch" else fused_rms_norm_affine(x, w, n, EPS)
        y.backward(dy)

    return step


def rows(threads: int = 2, quick: bool = False) -> list[dict]:
    """One row per (op, shape, dtype): ms of ampkit and torch, speedup, GB/s and % of the triad ceiling."""
    torch.set_num_threads(threads)
    warm = keep_freed_memory_warm()
    ceiling = triad_gbps()
    out = []
    shapes = SHAPES[:1] if quick else SHAPES
    for rows_, n in shapes:
        big = rows_ * n > 1 << 25
        for dtype in DTYPES:
            x = torch.randn(rows_, n, dtype=dtype).requires_grad_()
            dy = torch.randn(rows_, n, dtype=dtype)
            w = (torch.rand(n) + 0.5).to(dtype).requires_grad_()
            b = torch.randn(n, dtype=dtype).requires_grad_()
            nbytes = 5 * x.numel() * x.element_size()
            for kind in ("LayerNorm", "RMSNorm"):
                ours = best_seconds(_fwd_bwd(kind, "ampkit", x, w, b, dy), reps=3 if big else 10)
                theirs = best_seconds(_fwd_bwd(kind, "torch", x, w, b, dy), reps=2 if big else 5, warmup=1)
                gbps = nbytes / ours / 1e9
                speedup = theirs / ours
                row = {
                    "section": "norms",
                    "op": f"{kind} fwd+bwd",
                    "size": f"{rows_}x{n}",
                    "dtype": str(dtype).removeprefix("torch."),
                    "threads": threads,
                    "ampkit_ms": ours * 1e3,
                    "torch_ms": theirs * 1e3,
                    "speedup": speedup,
                    "gbps": gbps,
                    "ceiling_gbps": ceiling,
                    "ceiling_pct": 100 * gbps / ceiling,
                    "warm_allocator": warm,
                }
                if dtype == torch.float32:
                    row["target"] = f">={TARGET_SPEEDUP[kind]:g}x, >=50% ceiling"
                    row["met"] = speedup >= TARGET_SPEEDUP[kind] and gbps >= TARGET_CEILING_FRACTION * ceiling
                else:
                    row["target"] = ">=50% ceiling"
                    row["met"] = gbps >= TARGET_CEILING_FRACTION * ceiling
                out.append(row)
            del x, dy, w, b
    return out


def format_table(table: list[dict]) -> str:
    header = (
        f"{'op':<20} {'size':<11} {'dtype':<9} {'ampkit ms':>10} {'torch ms':>10} {'speedup':>8} "
        f"{'GB/s':>7} {'% ceil':>7}  target"
    )
    lines = [header, "-" * len(header)]
    for r in table:
        verdict = "met" if r["met"] else "MISSED"
        lines.append(
            f"{r['op']:<20} {r['size']:<11} {r['dtype']:<9} {r['ampkit_ms']:>10.2f} {r['torch_ms']:>10.2f} "
            f"{r['speedup']:>7.1f}x {r['gbps']:>7.1f} {r['ceiling_pct']:>6.0f}%  {r['target']} ({verdict})"
        )
    if table:
        lines.append(
            f"bandwidth ceiling (triad, {table[0]['threads']} threads): {table[0]['ceiling_gbps']:.1f} GB/s"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="only the 8192x1024 cases")
    args = parser.parse_args()
    print(format_table(rows(args.threads, args.quick)))


if __name__ == "__main__":
    main()
