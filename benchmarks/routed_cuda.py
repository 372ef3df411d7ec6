"""ampkit's fused optimizers under ``AMPKIT_FUSED_BACKEND=auto`` on a GPU against torch's fused forms.

On CUDA ``auto`` hands Adam/AdamW/SGD buckets to torch's fused ops, so this needs no CUDA build of ampkit's own
kernels: it checks that the routed step is bit-identical to torch's and costs no more, plain and through
``torch.amp.GradScaler``. Run from the repository root on a GPU machine::

    PYTHONPATH=$PWD python benchmarks/routed_cuda.py

Timing and parameter lists are ``benchmarks/ops_cuda.py``'s: CUDA events around a batch of steps, best of
several batches, torch and ampkit interleaved; transformer-like lists (many small 1-D tensors plus matrices).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ampkit.ops.optimizers import FusedAdam, FusedSGD  # noqa: E402

SIZES = (1_000_000, 10_000_000, 50_000_000, 200_000_000)
OPTIMIZERS: dict[str, tuple[Callable, Callable]] = {
    "AdamW": (
        lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, fused=True),
        lambda p: FusedAdam(p, lr=1e-3, weight_decay=0.01),
    ),
    "SGD momentum": (
        lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, fused=True),
        lambda p: FusedSGD(p, lr=1e-2, momentum=0.9),
    ),
}


def _ops_cuda():
    """``benchmarks/ops_cuda.py``, loaded by path: its timer and parameter lists are the ones used here."""
    spec = importlib.util.spec_from_file_location("bench_ops_cuda", ROOT / "benchmarks" / "ops_cuda.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_ops_cuda"] = module
    spec.loader.exec_module(module)
    return module


OPS_CUDA = _ops_cuda()


def params_with_grads(n: int) -> list[torch.nn.Parameter]:
    """``ops_cuda``'s transformer-like list of about ``n`` parameters, with gradients; the same on every call."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(t) for t in OPS_CUDA.param_list(n)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    return params


def scaler_step(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    scaler = torch.amp.GradScaler("cuda")

    def step() -> None:
        scaler.scale(torch.ones((), device="cuda"))  # creates the scale, as scaling a loss would
        scaler.step(optimizer)
        scaler.update()

    return step


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # --help works off a GPU too
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark is for a GPU machine", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    for name, (make_torch, make_ours) in OPTIMIZERS.items():
        theirs, ours = params_with_grads(1_000_000), params_with_grads(1_000_000)
        torch_opt, our_opt = make_torch(theirs), make_ours(ours)
        for _ in range(20):
            torch_opt.step()
            our_opt.step()
        diff = max((p - q).abs().max().item() for p, q in zip(theirs, ours, strict=True))
        print(f"{name}: max |ampkit - torch| after 20 steps = {diff}")
    print("\n| step | params | torch fused ms | ampkit auto ms | torch / ampkit |\n|---|---|---|---|---|")
    for n in SIZES:
        batch = 10 if n >= 50_000_000 else 20
        rows = [(name, make_torch, make_ours, False) for name, (make_torch, make_ours) in OPTIMIZERS.items()]
        rows.append(("GradScaler.step(AdamW)", *OPTIMIZERS["AdamW"], True))
        for name, make_torch, make_ours, scaled in rows:
            torch_opt = make_torch(params_with_grads(n))
            our_opt = make_ours(params_with_grads(n))
            fns = [scaler_step(torch_opt), scaler_step(our_opt)] if scaled else [torch_opt.step, our_opt.step]
            t_torch, t_ours = OPS_CUDA.time_ms(*fns, batch=batch)
            print(f"| {name} | {n / 1e6:.0f}M | {t_torch:.3f} | {t_ours:.3f} | {t_torch / t_ours:.3f}x |", flush=True)
            del torch_opt, our_opt
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
