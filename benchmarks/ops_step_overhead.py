"""The Python around a fused optimizer's kernel: one step over 66 tiny tensors, where the kernel itself costs
next to nothing, against the same kernel called on ready-made lists and against torch.optim's fused step::

    PYTHONPATH=$PWD python benchmarks/ops_step_overhead.py [--repeats 7]

Each row is the median over ``--repeats`` rounds of the best-of time per step (µs); "overhead" is the row's
time less the raw op's time, the cost of gathering buckets, state and lists each step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from ampkit.ops.optimizers import FusedAdam, FusedSGD
from ampkit.ops.optimizers._kernels import op

N_TENSORS = 66


def _params() -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.randn(16)) for _ in range(N_TENSORS)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def _best_us(fn: Callable[[], None], calls: int = 200) -> float:
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def _raw_adam() -> Callable[[], None]:
    """ampkit's Adam kernel on lists built once: what a step costs with no Python around it."""
    params = _params()
    grads = [p.grad for p in params]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    steps = [torch.zeros(()) for _ in params]
    kernel = op("adam_step", params[0].device)
    return lambda: kernel(params, grads, m, v, [], [], steps, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, False, True, 1.0,
                          None, None)  # fmt: skip


def _raw_torch_adamw() -> Callable[[], None]:
    params = _params()
    grads = [p.grad for p in params]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    steps = [torch.zeros(()) for _ in params]

    def step() -> None:
        torch._foreach_add_(steps, 1)
        torch._fused_adamw_(params, grads, m, v, [], steps, amsgrad=False, lr=1e-3, beta1=0.9, beta2=0.999,
                            weight_decay=0.01, eps=1e-8, maximize=False)  # fmt: skip

    return step


RAW_AMPKIT = "adam_step kernel, lists built once"
RAW_TORCH = "torch._fused_adamw_ + step counters, lists built once"
# name: (factory of a step, the raw row its overhead is counted against, or None)
CASES: dict[str, tuple[Callable[[], Callable[[], None]], str | None]] = {
    RAW_AMPKIT: (_raw_adam, None),
    "FusedAdam.step, backend=ampkit": (lambda: FusedAdam(_params(), weight_decay=0.01, backend="ampkit").step,
                                       RAW_AMPKIT),
    "FusedAdam.step(grad_scale, found_inf), ampkit": (lambda: _with_scaler(FusedAdam(_params(), backend="ampkit")),
                                                      RAW_AMPKIT),
    RAW_TORCH: (_raw_torch_adamw, None),
    "FusedAdam.step, backend=torch": (lambda: FusedAdam(_params(), weight_decay=0.01, backend="torch").step,
                                      RAW_TORCH),
    "AdamW(fused=True).step": (lambda: torch.optim.AdamW(_params(), weight_decay=0.01, fused=True).step, RAW_TORCH),
    "FusedSGD(momentum=0.9).step, backend=ampkit": (lambda: FusedSGD(_params(), momentum=0.9, backend="ampkit").step,
                                                    None),
    "SGD(momentum=0.9, fused=True).step": (lambda: torch.optim.SGD(_params(), momentum=0.9, fused=True).step, None),
}  # fmt: skip


def _with_scaler(opt: torch.optim.Optimizer) -> Callable[[], None]:
    scale, found = torch.ones(()), torch.zeros(())
    return lambda: opt.step(grad_scale=scale, found_inf=found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    os.environ["AMPKIT_OPS"] = "kernel"
    torch.set_num_threads(1)
    steps = {name: make() for name, (make, _) in CASES.items()}
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.repeats):  # rounds interleave the cases, so load drifts hit them alike
        for name, step in steps.items():
            times[name].append(_best_us(step))
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"{N_TENSORS} tensors of 16 elements, 1 thread, median of {args.repeats} rounds")
    print(f"| {'step':<54} | {'µs':>7} | {'overhead µs':>11} |")
    print(f"|{'-' * 56}|{'-' * 9}|{'-' * 13}|")
    for name, us in median.items():
        raw = CASES[name][1]
        extra = f"{us - median[raw]:11.1f}" if raw else f"{'-':>11}"
        print(f"| {name:<54} | {us:7.1f} | {extra} |")


if __name__ == "__main__":
    main()
