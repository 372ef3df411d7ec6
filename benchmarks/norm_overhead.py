"""The host time of one norm call (forward + backward) on a tiny input, where the kernel costs next to nothing:
``nn.LayerNorm`` against ampkit's ``FusedLayerNorm``, with and without bf16 autocast::

    PYTHONPATH=$PWD python benchmarks/norm_overhead.py [--backend auto|torch|ampkit] [--calls 3000]

On a GPU whose step is bound by the host (small models, eager), this is what a norm adds to each step. Under
autocast ``FusedLayerNorm`` keeps Apex's semantics: it casts its input, weight and bias to the autocast dtype
(three casts forward, three backward) where ``nn.LayerNorm`` runs in float32. Each row is the time per call less
an identity module's (the loop, the loss and its backward), in µs, best of ``--repeats`` rounds.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from ampkit.ops import FusedLayerNorm


def _per_call_us(module: torch.nn.Module, x: torch.Tensor, autocast: bool, calls: int) -> float:
    def run() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = module(x)
        y.float().sum().backward()

    for _ in range(calls // 10):
        run()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", choices=("auto", "torch", "ampkit"))
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ["AMPKIT_FUSED_BACKEND"] = args.backend
    torch.set_num_threads(1)
    x = torch.randn(4, 64, requires_grad=True)
    print(f"host µs per forward + backward of a 4x64 input, 1 thread, AMPKIT_FUSED_BACKEND={args.backend}")
    print(f"{'autocast':<10} {'nn.LayerNorm':>13} {'FusedLayerNorm':>15}")
    for autocast in (False, True):
        times = {}
        for name, module in (
            ("identity", torch.nn.Identity()),
            ("nn", torch.nn.LayerNorm(64)),
            ("fused", FusedLayerNorm(64)),
        ):
            times[name] = min(_per_call_us(module, x, autocast, args.calls) for _ in range(args.repeats))
        label = "bf16" if autocast else "off"
        print(f"{label:<10} {times['nn'] - times['identity']:>13.1f} {times['fused'] - times['identity']:>15.1f}")


if __name__ == "__main__":
    main()
