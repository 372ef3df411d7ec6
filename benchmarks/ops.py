"""ampkit.ops benchmark: one run, every ratio against PyTorch measured in the same process.

Run from the repository root::

    PYTHONPATH=$PWD python benchmarks/ops.py              # 1M / 10M / 50M params, cold build included
    PYTHONPATH=$PWD python benchmarks/ops.py --quick      # 1M / 10M, smaller ceiling buffers
    PYTHONPATH=$PWD python benchmarks/ops.py --skip-build # no cold-build / warm-import rows

It pins ``--threads`` (default 2) intra-op threads, measures the machine's memory-bandwidth ceiling
(STREAM-like read, copy and in-place triad over large fp32 buffers) and prints one table. Times are
the best of repeated calls on warmed buffers (fresh allocations cost page faults, ~0.3 ms/MB).

Sections. This file times the multi-tensor primitives and the build; it then imports the optional
sections ``benchmarks/ops_optimizers.py`` and ``benchmarks/ops_norms.py`` (by path, if present).
A section module exposes::

    def run(ctx: BenchContext) -> list[dict]

(A module with only ``rows(threads, sizes) -> list[dict]`` is accepted too; its keys "GB/s",
"baseline_ms", "params" and "of_ceiling" (a fraction) are mapped onto the ones below.)
Each returned row is a dict with these keys (build rows with :meth:`BenchContext.row`):

    section         str            the table section ("multi_tensor", "optimizers", "norms", ...)
    name            str            what ampkit ran, e.g. "AdamW step"
    baseline        str            the PyTorch form it is compared with, e.g. "AdamW(fused=True)"
    size            str            e.g. "10M" or "8192x1024 bf16"
    ms              float          ampkit's time (best of repeated calls)
    torch_ms        float | None   the baseline's time, same process, same buffers, same timer
    ratio           float | None   torch_ms / ms (> 1: ampkit is faster)
    gbps            float | None   bytes the op must move / ms
    pct_of_ceiling  float | None   gbps as % of the ceiling for its access pattern

``BenchContext`` gives sections: ``threads``, ``quick``, ``sizes`` (param counts), ``param_list(n)``
(a cached, warmed transformer-like list of fp32 tensors: per layer 4 d x d attention matrices,
d x 4d and 4d x d MLP matrices, biases and LayerNorm vectors; 4 layers), ``time_ms(fn)``,
``compare_ms(torch_fn, ampkit_fn)`` (calls interleaved so both see the same load: use it for rows),
``ceiling_gbps(pattern)`` with pattern "read" (read-only stream) or "read_write" (in-place
update, read+write), and ``row(...)`` which fills ratio, GB/s and % of ceiling.

Lists that fit in the caches (1M params = 4 MB; 10M = 40 MB against a 32 MB L3) run above the DRAM
ceiling, so their "% ceiling" exceeds 100; the 50M rows are the DRAM-bound ones.

In-place ops are timed with factor 1.0 so repeated calls leave the values unchanged (neither
ampkit nor torch's CPU kernel special-cases 1.0: both read and write every element).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SECTION_FILES = ("ops_optimizers.py", "ops_norms.py")
LAYERS = 4


@dataclass
class BenchContext:
    """What a benchmark section gets: thread count, sizes, warmed parameter lists, timer, ceilings."""

    threads: int
    quick: bool
    sizes: tuple[int, ...]
    ceilings: dict[str, float] = field(default_factory=dict)
    _lists: dict[tuple[int, torch.dtype], list[torch.Tensor]] = field(default_factory=dict)

    def param_list(self, n: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """A transformer-like list of ~n parameters (many small 1-D tensors plus large matrices), warmed."""
        key = (n, dtype)
        if key not in self._lists:
            d = max(8, int(math.sqrt(n / (12 * LAYERS))))
            shapes: list[tuple[int, ...]] = []
            for _ in range(LAYERS):
                shapes += [(d, d)] * 4 + [(d,)] * 4  # q, k, v, o projections and biases
                shapes += [(d,), (d,)]  # LayerNorm weight, bias
                shapes += [(4 * d, d), (4 * d,), (d, 4 * d), (d,)]  # MLP
                shapes += [(d,), (d,)]
            shapes += [(d,), (d,)]  # final LayerNorm
            self._lists[key] = [torch.randn(s, dtype=dtype) for s in shapes]
        return self._lists[key]

    def time_ms(self, fn: Callable[[], object], min_time_s: float = 0.3, min_iters: int = 5) -> float:
        """Best (minimum) wall time of fn() in ms over repeated calls, after warm-up calls.

        The minimum, not the median: on a shared 2-core machine a call that loses a core to another
        process mid-way (an OpenMP region waits for its slowest thread) costs a whole scheduler slice.
        """
        return self.compare_ms(fn, min_time_s=min_time_s, min_iters=min_iters)[0]

    def compare_ms(self, *fns: Callable[[], object], min_time_s: float = 1.0, min_iters: int = 5) -> list[float]:
        """Best wall time in ms of each fn, calls interleaved (a, b, a, b, ...) so that every candidate
        sees the same machine load; use it for an ampkit-vs-torch pair."""
        for fn in fns:
            for _ in range(3):
                fn()
        times: list[list[float]] = [[] for _ in fns]
        deadline = time.perf_counter() + min_time_s * len(fns)
        while len(times[0]) < min_iters or time.perf_counter() < deadline:
            for fn, bucket in zip(fns, times, strict=True):
                start = time.perf_counter()
                fn()
                bucket.append((time.perf_counter() - start) * 1e3)
            if len(times[0]) >= 5000:
                break
        return [min(bucket) for bucket in times]

    def ceiling_gbps(self, pattern: str) -> float:
        """Bandwidth ceiling for an access pattern: "read" or "read_write" (in place)."""
        return self.ceilings[pattern]

    def row(
        self,
        section: str,
        name: str,
        baseline: str,
        size: str,
        ms: float,
        torch_ms: float | None,
        nbytes: float | None,
        pattern: str = "read_write",
    ) -> dict:
        """A table row; ratio, GB/s and % of ceiling are derived from the times and bytes moved."""
        gbps = nbytes / ms / 1e6 if nbytes else None
        return {
            "section": section,
            "name": name,
            "baseline": baseline,
            "size": size,
            "ms": ms,
            "torch_ms": torch_ms,
            "ratio": torch_ms / ms if torch_ms else None,
            "gbps": gbps,
            "pct_of_ceiling": 100 * gbps / self.ceiling_gbps(pattern) if gbps else None,
        }


def measure_ceilings(ctx: BenchContext) -> list[dict]:
    """STREAM-like bandwidth over buffers far larger than the caches; fills ctx.ceilings.

    Each pattern's ceiling is the best of the torch kernels measured for it: "read" the faster of a
    sum and a vector norm (4 B/element), "read_write" the faster of an in-place scale (8 B/element)
    and an in-place triad a += s*b (12 B/element).
    """
    n = (16 if ctx.quick else 64) * 2**20
    a, b, c = torch.rand(n), torch.rand(n), torch.rand(n)
    gb = n * 4 / 1e9
    size = f"{n // 2**20}M fp32"
    cases = [
        ("read: sum", lambda: a.sum(), 1, "read"),
        ("read: vector_norm", lambda: torch.linalg.vector_norm(a), 1, "read"),
        ("copy b=a", lambda: b.copy_(a), 2, "read_write"),
        ("triad a=b+s*c", lambda: torch.add(b, c, alpha=1.0, out=a), 3, "read_write"),
        ("in-place scale a*=s", lambda: a.mul_(1.0), 2, "read_write"),
        ("in-place triad a+=s*b", lambda: a.add_(b, alpha=1.0), 3, "read_write"),
    ]
    times = ctx.compare_ms(*(fn for _, fn, _, _ in cases), min_time_s=0.3)
    for (name, _, streams, pattern), ms in zip(cases, times, strict=True):
        if name.startswith("copy") or name.startswith("triad"):
            continue  # write-allocate traffic makes these slower than in-place updates: reported only
        ctx.ceilings[pattern] = max(ctx.ceilings.get(pattern, 0.0), streams * gb / (ms / 1e3))
    return [
        ctx.row("ceiling", name, "-", size, ms, None, streams * gb * 1e9, pattern)
        for (name, _, streams, pattern), ms in zip(cases, times, strict=True)
    ]


def _multi_tensor_cases(grads: list[torch.Tensor], found: torch.Tensor) -> list[tuple]:
    """(name, baseline, torch fn, ampkit fn, bytes per param, access pattern) for one parameter list."""
    from ampkit.ops import multi_tensor as mt

    one = torch.ones(1)

    def torch_unscale():
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)

    def torch_norm():  # what clip_grad_norm_(foreach=True) computes
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)

    def torch_unscale_norm():
        torch_unscale()
        return torch_norm()

    stash = [g.clone() for g in grads]

    def torch_combine():  # the amp engine's combined unscale, in torch ops: new/scale, checked, + stash
        torch_unscale()
        torch._foreach_add_(stash, grads)

    return [
        ("unscale+inf check", "_amp_foreach_non_finite_check_and_unscale_", torch_unscale,
         lambda: mt.scale_(grads, 1.0, found), 8, "read_write"),
        ("L2 norm", "_foreach_norm+stack+norm", torch_norm, lambda: mt.l2norm(grads), 4, "read"),
        ("unscale+check+norm (writes)", "unscale_ then _foreach_norm", torch_unscale_norm,
         lambda: mt.unscale_l2norm(grads, 1.0, found, out=grads), 8, "read_write"),
        ("unscale+check+norm (read-only)", "unscale_ then _foreach_norm", torch_unscale_norm,
         lambda: mt.unscale_l2norm(grads, 1.0, found), 4, "read"),
        ("combine: stash += new*inv_scale, check new", "unscale_ then _foreach_add_", torch_combine,
         lambda: mt.combine_(grads, stash, stash, 1.0, found), 12, "read_write"),
    ]  # fmt: skip


def multi_tensor_rows(ctx: BenchContext) -> list[dict]:
    """Unscale+inf check, L2 norm, unscale+norm and combine vs the torch forms GradScaler/clip use."""
    os.environ["AMPKIT_OPS"] = "kernel"
    rows = []
    for n in ctx.sizes:
        grads = ctx.param_list(n)
        count = sum(g.numel() for g in grads)
        size = f"{count / 1e6:.1f}M ({len(grads)} tensors)"
        for name, baseline, torch_fn, ours, per_param, pattern in _multi_tensor_cases(grads, torch.zeros(1)):
            torch_ms, ms = ctx.compare_ms(torch_fn, ours)
            rows.append(ctx.row("multi_tensor", name, baseline, size, ms, torch_ms, count * per_param, pattern))
    return rows


def build_rows(ctx: BenchContext) -> list[dict]:
    """Cold build of every op family into an empty cache (subprocess), then a warm import of all."""
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "AMPKIT_EXTENSIONS_DIR": cache, "PYTHONPATH": str(ROOT)}
        start = time.perf_counter()
        build = subprocess.run(
            [sys.executable, "-m", "ampkit.ops.build"], env=env, capture_output=True, text=True, check=False
        )
        cold_s = time.perf_counter() - start
        if build.returncode != 0:
            raise RuntimeError(f"cold build failed:\n{build.stdout}\n{build.stderr}")
        families = ", ".join(line.split(":")[0] for line in build.stdout.splitlines() if "ready in" in line)
        rows.append(ctx.row("build", f"cold build, all families ({families})", "-", "-", cold_s * 1e3, None, None))
        probe = (
            "import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter()\n"
            "from ampkit.ops.build import import_frontends; from ampkit.ops._build import FAMILIES\n"
            "import_frontends(); ok = all(f.use_kernel() for f in FAMILIES.values())\n"
            "print(ok, time.perf_counter() - t1, t1 - t0)"
        )
        warm = subprocess.run(
            [sys.executable, "-c", probe], env={**env, "AMPKIT_OPS": "kernel"}, capture_output=True, text=True
        )
        ok, ops_s, torch_s = warm.stdout.split()
        if ok != "True" or "compiling" in warm.stderr:
            raise RuntimeError(f"warm import rebuilt or failed: {warm.stderr}")
        baseline = f"after import torch ({float(torch_s):.2f} s, not counted)"
        rows.append(ctx.row("build", "warm import + load all families", baseline, "-", float(ops_s) * 1e3, None, None))
    return rows


def load_sections() -> list:
    """The optional section modules written beside this file, in a fixed order."""
    modules = []
    for filename in SECTION_FILES:
        path = Path(__file__).resolve().parent / filename
        if path.exists():
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            modules.append(module)
    return modules


# Keys some section modules used before this interface was fixed, mapped onto the documented ones.
_KEY_ALIASES = {"GB/s": "gbps", "baseline_ms": "torch_ms", "params": "size"}


def section_rows(section, ctx: BenchContext) -> list[dict]:
    """Rows of one section: ``run(ctx)``, or the older ``rows(threads, sizes)`` with its keys mapped."""
    if hasattr(section, "run"):
        return section.run(ctx)
    out = []
    for raw in section.rows(threads=ctx.threads, sizes=ctx.sizes):
        row = {_KEY_ALIASES.get(k, k): v for k, v in raw.items()}
        if "of_ceiling" in row:
            row["pct_of_ceiling"] = 100 * row.pop("of_ceiling")
        row.setdefault("section", section.__name__.removeprefix("ops_"))
        for key in ("name", "baseline", "size", "ms", "torch_ms", "ratio", "gbps", "pct_of_ceiling"):
            value = row.get(key)
            row[key] = None if isinstance(value, float) and math.isnan(value) else value
        out.append(row)
    return out


def print_table(rows: list[dict]) -> None:
    def fmt(value, spec):
        return "-" if value is None or isinstance(value, str) else format(value, spec)

    header = ("section", "name", "size", "ms", "torch ms", "ratio", "GB/s", "% ceiling", "baseline")
    lines = [
        (r["section"], r["name"], str(r["size"] or "-"), fmt(r["ms"], ".3f"), fmt(r["torch_ms"], ".3f"),
         fmt(r["ratio"], ".2f") + ("x" if r["ratio"] else ""), fmt(r["gbps"], ".1f"),
         fmt(r["pct_of_ceiling"], ".0f"), r["baseline"] or "-")
        for r in rows
    ]  # fmt: skip
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines, strict=True)]
    for i, line in enumerate([header, *lines]):
        print("| " + " | ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="1M and 10M params only, smaller ceiling buffers")
    parser.add_argument("--skip-build", action="store_true", help="skip the cold-build and warm-import rows")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = (1_000_000, 10_000_000) if args.quick else (1_000_000, 10_000_000, 50_000_000)
    ctx = BenchContext(threads=args.threads, quick=args.quick, sizes=sizes)
    print(f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} CPUs", flush=True)
    rows = [] if args.skip_build else build_rows(ctx)  # first: nothing else competes for the cores
    rows = measure_ceilings(ctx) + rows
    rows += multi_tensor_rows(ctx)
    for section in load_sections():
        rows += section_rows(section, ctx)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
