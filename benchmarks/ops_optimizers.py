"""Fused optimizers and the fused amp step vs their best PyTorch form (section of ``benchmarks/ops.py``).

Run on its own: ``PYTHONPATH=. python benchmarks/ops_optimizers.py [--threads 2] [--sizes 1e6,1e7,5e7]``.

Every row times one optimizer step on a transformer-like parameter list (per layer: four weight matrices
plus six 1-D biases/norm weights) at 1M, 10M and 50M fp32 parameters, with all buffers allocated and
touched before timing (fresh pages cost ~0.3 ms/MB and would swamp the kernels). The figure is the best
of several repetitions; ``ratio`` is torch's time / ampkit's time in the same process. GB/s counts the
bytes each implementation must move per parameter (Adam: read param, grad, two moments; write param, two
moments = 28 B). ``ceiling`` is the in-place triad bandwidth measured in the same run (``a += s * b``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import Tensor

from ampkit.ops.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedRMSprop, FusedSGD
from ampkit.ops.pipeline import fused_unscale_clip_step_

SIZES = (1_000_000, 10_000_000, 50_000_000)
LOSS_SCALE = 1024.0


def transformer_shapes(n_params: int) -> list[tuple[int, ...]]:
    """Shapes of a GPT-like stack with about ``n_params`` parameters (width grows with size)."""
    d = 128 if n_params <= 2_000_000 else 256 if n_params <= 20_000_000 else 512
    per_layer = 12 * d * d + 13 * d
    shapes: list[tuple[int, ...]] = []
    for _ in range(max(1, round(n_params / per_layer))):
        shapes += [(3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes


def make_params(shapes: list[tuple[int, ...]], seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    return params


def best_ms(fn: Callable[[], object], reps: int, setup: Callable[[], object] | None = None) -> float:
    """Best wall time of ``fn`` over ``reps`` runs after two warm-ups (``setup`` runs untimed before each)."""
    times = []
    for i in range(reps + 2):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return min(times) * 1e3


def triad_gbps(n: int = 64_000_000) -> float:
    """In-place triad bandwidth (read two arrays, write one: 12 B/element)."""
    a, b = torch.rand(n), torch.rand(n)
    ms = best_ms(lambda: a.add_(b, alpha=1e-9), 5)
    return 12 * n / ms / 1e6


def _torch_lamb_step(params: list[Tensor], state: dict[str, list[Tensor]], step: int) -> None:
    """Apex-semantics LAMB written with torch's foreach ops: the best plain-PyTorch form we know."""
    lr, beta1, beta2, eps, wd, max_norm = 1e-3, 0.9, 0.999, 1e-6, 0.01, 1.0
    grads = [p.grad for p in params]
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    clip = torch.clamp(norm / max_norm, min=1.0)
    grads = torch._foreach_div(grads, clip)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    torch._foreach_lerp_(m, grads, 1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
    denom = torch._foreach_sqrt(torch._foreach_div(v, 1 - beta2**step))
    torch._foreach_add_(denom, eps)
    update = torch._foreach_div(torch._foreach_div(m, 1 - beta1**step), denom)
    torch._foreach_add_(update, params, alpha=wd)
    p_norm = torch.stack(torch._foreach_norm(params))
    u_norm = torch.stack(torch._foreach_norm(update))
    ratio = torch.where((p_norm > 0) & (u_norm > 0), p_norm / u_norm, torch.ones_like(p_norm)) * -lr
    torch._foreach_mul_(update, list(ratio.unbind()))
    torch._foreach_add_(params, update)


class _TorchLamb:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.state = {
            "exp_avg": [torch.zeros_like(p) for p in params],
            "exp_avg_sq": [torch.zeros_like(p) for p in params],
        }
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        with torch.no_grad():
            _torch_lamb_step(self.params, self.state, self.steps)


def _best_torch(candidates: dict[str, Callable[[list[torch.nn.Parameter]], object]], shapes, reps: int):
    """Time each torch form that constructs on this build; return (best ms, its name)."""
    best = None
    for name, make in candidates.items():
        params = make_params(shapes, seed=1)
        try:
            opt = make(params)
            opt.step()
        except (RuntimeError, TypeError, ValueError):
            continue
        ms = best_ms(opt.step, reps)
        if best is None or ms < best[0]:
            best = (ms, name)
        del opt, params
    assert best is not None
    return best


def _row(
    name: str, n: int, bytes_per_param: int, ms: float, torch_ms: float, torch_name: str, ceiling: float
):
    gbps = bytes_per_param * n / ms / 1e6
    return {
        "name": name,
        "params": n,
        "ms": ms,
        "GB/s": gbps,
        "baseline": torch_name,
        "baseline_ms": torch_ms,
        "ratio": torch_ms / ms,
        "of_ceiling": gbps / ceiling,
    }


def rows(threads: int = 2, sizes: tuple[int, ...] = SIZES) -> list[dict]:
    """Benchmark rows (one dict per measurement) with ``threads`` intra-op threads."""
    torch.set_num_threads(threads)
    ceiling = triad_gbps()
    out = [
        {
            "name": "in-place triad (ceiling)",
            "params": 64_000_000,
            "ms": float("nan"),
            "GB/s": ceiling,
            "baseline": "",
            "baseline_ms": float("nan"),
            "ratio": float("nan"),
            "of_ceiling": 1.0,
        }
    ]
    families = [
        # (row name, ampkit factory, torch candidates, bytes/param)
        (
            "AdamW",
            lambda p: FusedAdam(p, lr=1e-3, weight_decay=0.01),
            {"AdamW(fused)": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, fused=True)},
            28,
        ),
        (
            "SGD momentum",
            lambda p: FusedSGD(p, lr=1e-2, momentum=0.9),
            {
                "SGD(fused)": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, fused=True),
                "SGD(foreach)": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, foreach=True),
            },
            20,
        ),
        (
            "Adagrad",
            lambda p: FusedAdagrad(p, lr=1e-2),
            {
                "Adagrad(fused)": lambda p: torch.optim.Adagrad(p, lr=1e-2, fused=True),
                "Adagrad(foreach)": lambda p: torch.optim.Adagrad(p, lr=1e-2, foreach=True),
            },
            20,
        ),
        (
            "RMSprop",
            lambda p: FusedRMSprop(p, lr=1e-3),
            {"RMSprop(foreach)": lambda p: torch.optim.RMSprop(p, lr=1e-3, foreach=True)},
            20,
        ),
        ("LAMB", lambda p: FusedLAMB(p, lr=1e-3), {"LAMB(foreach ops)": _TorchLamb}, 52),
    ]
    for n in sizes:
        shapes = transformer_shapes(n)
        count = sum(torch.Size(s).numel() for s in shapes)
        reps = 20 if count <= 2_000_000 else 8
        for name, make_ours, candidates, nbytes in families:
            params = make_params(shapes, seed=1)
            ours = make_ours(params)
            ours.step()
            ms = best_ms(ours.step, reps)
            del ours, params
            torch_ms, torch_name = _best_torch(candidates, shapes, reps)
            out.append(
                _row(f"{name} ({len(shapes)} tensors)", count, nbytes, ms, torch_ms, torch_name, ceiling)
            )
        out.append(_pipeline_row(shapes, count, reps, ceiling))
    return out


def _pipeline_row(shapes, count: int, reps: int, ceiling: float) -> dict:
    """fused_unscale_clip_step_ vs GradScaler.unscale_ + clip_grad_norm_(foreach) + AdamW(fused) + update."""
    ours_params = make_params(shapes, seed=2)
    scaled = [p.grad.mul_(LOSS_SCALE).clone() for p in ours_params]
    ours = FusedAdam(ours_params, lr=1e-3, weight_decay=0.01)
    ms = best_ms(lambda: fused_unscale_clip_step_(ours, 1.0 / LOSS_SCALE, 1.0), reps)

    params = make_params(shapes, seed=2)
    for p, g in zip(params, scaled, strict=True):
        p.grad.copy_(g)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=LOSS_SCALE, growth_interval=1_000_000)
    scaler.scale(torch.ones(()))  # creates the scale tensor, as scaling the loss would

    def restore() -> None:
        for p, g in zip(params, scaled, strict=True):
            p.grad.copy_(g)

    def torch_step() -> None:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        scaler.step(opt)
        scaler.update()

    torch_ms = best_ms(torch_step, reps, setup=restore)
    return _row(
        "pipeline unscale+check+clip+AdamW",
        count,
        32,
        ms,
        torch_ms,
        "unscale_+clip_grad_norm_+AdamW(fused)",
        ceiling,
    )


def format_table(table: list[dict]) -> str:
    head = f"{'op':<36}{'params':>11}{'ms':>9}{'GB/s':>8}{'%ceil':>7}{'torch ms':>10}{'ratio':>7}  baseline"
    lines = [head, "-" * len(head)]
    for r in table:
        lines.append(
            f"{r['name']:<36}{r['params']:>11,}{r['ms']:>9.2f}{r['GB/s']:>8.1f}{100 * r['of_ceiling']:>6.0f}%"
            f"{r['baseline_ms']:>10.2f}{r['ratio']:>7.2f}  {r['baseline']}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--sizes", default=",".join(str(s) for s in SIZES), help="comma-separated param counts"
    )
    args = parser.parse_args()
    sizes = tuple(int(float(s)) for s in args.sizes.split(","))
    print(format_table(rows(args.threads, sizes)))


if __name__ == "__main__":
    main()
