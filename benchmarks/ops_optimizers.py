"""Optimizers section of ``benchmarks/ops.py``: fused optimizers and the fused amp step vs torch.

Run it inside the full table (``PYTHONPATH=$PWD python benchmarks/ops.py``) or alone::

    PYTHONPATH=$PWD python benchmarks/ops_optimizers.py [--threads 2] [--quick]

Every row times one step on ``ctx.param_list(n)`` (transformer-like: many small 1-D tensors plus large
matrices) at 1M / 10M / 50M fp32 params; ampkit and torch get their own copy of the parameters and
state, share the gradients, are warmed, and are timed interleaved (best of repeated calls). GB/s counts
the bytes each ampkit step moves per parameter: Adam 28 (read param, grad, two moments; write param and
moments), SGD-momentum/Adagrad/RMSprop 20, LAMB 52 (global norm 4, stage 1 28, trust-ratio norms 8,
stage 2 12), AdamP 44 for matrices (moments and row sums 24, then the projected update 20), pipeline 32
(read grads once for inf + norm, then the Adam pass), AdamW through GradScaler.step 40 (GradScaler's inf
check reads the grads, the Adam pass, the grads written back unscaled), the Trainer's amp step 36 (the
unscale + inf check pass reads and writes the grads, then the Adam pass).
The last two rows share a baseline, so they answer where the unscale belongs: in a pass of its own (the
Trainer's path) or inside the optimizer's kernel with the grads written back unscaled (GradScaler's contract).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from ampkit.amp.grad_combine import unscale_and_check_
from ampkit.ops.optimizers import FusedAdagrad, FusedAdam, FusedAdamP, FusedLAMB, FusedRMSprop, FusedSGD
from ampkit.ops.pipeline import fused_unscale_clip_step_

SECTION = "optimizers"


def _params_with_grads(base: list[Tensor], grads: list[Tensor]) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(t.clone()) for t in base]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    return params


class _ForeachLamb:
    """Apex-semantics LAMB in torch foreach ops: the best plain-PyTorch form (torch has no LAMB)."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float = 1e-3, wd: float = 0.01) -> None:
        self.params, self.lr, self.wd = params, lr, wd
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.steps = 0

    @torch.no_grad()
    def step(self) -> None:
        beta1, beta2, eps = 0.9, 0.999, 1e-6
        self.steps += 1
        grads = [p.grad for p in self.params]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        grads = torch._foreach_div(grads, torch.clamp(norm, min=1.0))
        torch._foreach_lerp_(self.m, grads, 1 - beta1)
        torch._foreach_mul_(self.v, beta2)
        torch._foreach_addcmul_(self.v, grads, grads, value=1 - beta2)
        denom = torch._foreach_sqrt(torch._foreach_div(self.v, 1 - beta2**self.steps))
        torch._foreach_add_(denom, eps)
        update = torch._foreach_div(torch._foreach_div(self.m, 1 - beta1**self.steps), denom)
        torch._foreach_add_(update, self.params, alpha=self.wd)
        p_norm = torch.stack(torch._foreach_norm(self.params))
        u_norm = torch.stack(torch._foreach_norm(update))
        ratio = torch.where((p_norm > 0) & (u_norm > 0), p_norm / u_norm, torch.ones_like(p_norm)) * -self.lr
        torch._foreach_mul_(update, list(ratio.unbind()))
        torch._foreach_add_(self.params, update)


class _TorchOpsAdamP:
    """AdamP as clovaai/AdamP (and timm) write it in torch ops: the form its users run (torch has no AdamP)."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float = 1e-3, wd: float = 0.01) -> None:
        self.params, self.lr, self.wd = params, lr, wd
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.steps = 0

    @staticmethod
    def _projection(p: Tensor, grad: Tensor, perturb: Tensor, delta: float, wd_ratio: float, eps: float):
        expand = [-1] + [1] * (p.dim() - 1)
        for view in (lambda x: x.reshape(x.size(0), -1), lambda x: x.reshape(1, -1)):
            cosine = torch.nn.functional.cosine_similarity(view(grad), view(p), dim=1, eps=eps).abs_()
            if cosine.max() < delta / math.sqrt(view(p).size(1)):
                unit = p / view(p).norm(dim=1).view(expand).add_(eps)
                perturb -= unit * view(unit * perturb).sum(dim=1).view(expand)
                return perturb, wd_ratio
        return perturb, 1.0

    @torch.no_grad()
    def step(self) -> None:
        beta1, beta2, eps = 0.9, 0.999, 1e-8
        self.steps += 1
        bc1, bc2 = 1 - beta1**self.steps, 1 - beta2**self.steps
        for p, m, v in zip(self.params, self.m, self.v, strict=True):
            grad = p.grad
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            perturb = m / (v.sqrt() / math.sqrt(bc2)).add_(eps)
            ratio = 1.0
            if p.dim() > 1:
                perturb, ratio = self._projection(p, grad, perturb, 0.1, 0.1, eps)
            p.mul_(1 - self.lr * self.wd * ratio)
            p.add_(perturb, alpha=-self.lr / bc1)


# (name, ampkit factory, {torch form: factory}, bytes per param)
FAMILIES: list[tuple[str, Callable, dict[str, Callable], int]] = [
    ("AdamW step", lambda p: FusedAdam(p, lr=1e-3, weight_decay=0.01),
     {"AdamW(fused=True)": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, fused=True)}, 28),
    ("SGD momentum step", lambda p: FusedSGD(p, lr=1e-2, momentum=0.9),
     {"SGD(fused=True)": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, fused=True),
      "SGD(foreach=True)": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, foreach=True)}, 20),
    ("Adagrad step", lambda p: FusedAdagrad(p, lr=1e-2),
     {"Adagrad(fused=True)": lambda p: torch.optim.Adagrad(p, lr=1e-2, fused=True),
      "Adagrad(foreach=True)": lambda p: torch.optim.Adagrad(p, lr=1e-2, foreach=True)}, 20),
    ("RMSprop step", lambda p: FusedRMSprop(p, lr=1e-3),
     {"RMSprop(foreach=True)": lambda p: torch.optim.RMSprop(p, lr=1e-3, foreach=True)}, 20),
    ("LAMB step", lambda p: FusedLAMB(p, lr=1e-3), {"LAMB in foreach ops": _ForeachLamb}, 52),
    ("AdamP step", lambda p: FusedAdamP(p, lr=1e-3, weight_decay=0.01), {"AdamP in torch ops": _TorchOpsAdamP}, 44),
]  # fmt: skip


# The optimizers torch has a fused op for, each run through both backends: the evidence for ``auto``'s CPU rule
# (``_cpu_prefers_torch`` of each class). (name, factory taking params and a backend, torch's form, its factory)
ROUTED: list[tuple[str, Callable, str, Callable]] = [
    ("FusedAdam", lambda p, b: FusedAdam(p, lr=1e-3, weight_decay=0.01, backend=b),
     "AdamW(fused=True)", lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, fused=True)),
    ("FusedSGD", lambda p, b: FusedSGD(p, lr=1e-2, momentum=0.9, backend=b),
     "SGD(momentum=0.9, fused=True)", lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, fused=True)),
    ("FusedAdagrad", lambda p, b: FusedAdagrad(p, lr=1e-2, backend=b),
     "Adagrad(fused=True)", lambda p: torch.optim.Adagrad(p, lr=1e-2, fused=True)),
]  # fmt: skip


def routed_pairs(base: list[Tensor], grads: list[Tensor]) -> list[tuple[str, str, Callable, Callable]]:
    """(name, baseline, torch step, ampkit step) for each routed optimizer's plain step and ``GradScaler.step``
    under each backend, against torch's fused form (plain, and through GradScaler), on ``base``'s device. Each
    side has its own parameters and state; the GradScaler pairs their own copy of the grads (they unscale them)."""
    pairs = []
    for name, make, baseline, make_torch in ROUTED:
        torch_step = make_torch(_params_with_grads(base, grads)).step
        torch_scaled = _through_scaler(make_torch(_params_with_grads(base, [g.clone() for g in grads])))
        for backend in ("ampkit", "torch"):
            ours = make(_params_with_grads(base, grads), backend)
            pairs.append((f"{name}.step, backend={backend}", baseline, torch_step, ours.step))
            ours = make(_params_with_grads(base, [g.clone() for g in grads]), backend)
            pairs.append((f"GradScaler.step({name}), backend={backend}", f"GradScaler.step({baseline})", torch_scaled,
                          _through_scaler(ours)))  # fmt: skip
    return pairs


def routed_rows(ctx, base: list[Tensor], grads: list[Tensor], size: str) -> list[dict]:
    """``routed_pairs`` timed interleaved (the evidence for each class's ``_cpu_prefers_torch``)."""
    rows = []
    for name, baseline, torch_step, ours in routed_pairs(base, grads):
        torch_ms, ms = ctx.compare_ms(torch_step, ours)
        rows.append(ctx.row(SECTION, name, baseline, size, ms, torch_ms, None))
    return rows


def _best_torch_form(ctx, base, grads, forms: dict[str, Callable]) -> tuple[str, Callable]:
    """The fastest torch form for this list (a quick pre-timing), as (name, step)."""
    best = None
    for name, make in forms.items():
        opt = make(_params_with_grads(base, grads))
        ms = ctx.time_ms(opt.step, min_time_s=0.1)
        if best is None or ms < best[0]:
            best = (ms, name, opt.step)
    return best[1], best[2]


def _pipeline_pair(base: list[Tensor], grads: list[Tensor]) -> tuple[Callable, Callable]:
    """(torch sequence, ampkit pipeline). Scale 1 and a max_norm that never clips keep every call's
    inputs identical; both sides still multiply every gradient (torch special-cases neither)."""
    max_norm = 1e30
    ours = FusedAdam(_params_with_grads(base, grads), lr=1e-3, weight_decay=0.01)
    params = _params_with_grads(base, [g.clone() for g in grads])
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=2**30)
    scaler.scale(torch.ones(()))  # creates the scale tensor, as scaling the loss would

    def torch_step() -> None:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        scaler.step(opt)
        scaler.update()

    return torch_step, lambda: fused_unscale_clip_step_(ours, 1.0, max_norm)


def _through_scaler(opt: torch.optim.Optimizer) -> Callable[[], None]:
    """``opt``'s step through ``GradScaler.step`` and ``update`` at scale 1 (every call's inputs stay the same), on
    the device its parameters live on."""
    device = opt.param_groups[0]["params"][0].device
    scaler = torch.amp.GradScaler(device.type, init_scale=1.0, growth_interval=2**30)
    scaler.scale(torch.ones((), device=device))  # creates the scale tensor, as scaling the loss would

    def step() -> None:
        scaler.step(opt)
        scaler.update()

    return step


def _torch_adamw_through_scaler(base: list[Tensor], grads: list[Tensor]) -> Callable[[], None]:
    params = _params_with_grads(base, [g.clone() for g in grads])
    return _through_scaler(torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True))


def _grad_scaler_pair(base: list[Tensor], grads: list[Tensor]) -> tuple[Callable, Callable]:
    """(torch, ampkit) AdamW steps through ``GradScaler.step``: both read the scaled grads and leave them
    unscaled. Scale 1 keeps every call's inputs identical; both sides still divide every gradient."""
    ours = FusedAdam(_params_with_grads(base, grads), lr=1e-3, weight_decay=0.01)
    return _torch_adamw_through_scaler(base, grads), _through_scaler(ours)


def _trainer_path_pair(base: list[Tensor], grads: list[Tensor]) -> tuple[Callable, Callable]:
    """(torch, ampkit) the amp step as the Trainer runs it with a fused optimizer: one unscale + inf check pass
    over the grads after backward (``unscale_and_check_``), then ``FusedAdam.step()`` on unscaled grads; torch
    as in ``_grad_scaler_pair``. Scale 1 keeps every call's inputs identical; both sides divide every grad."""
    ours = FusedAdam(_params_with_grads(base, grads), lr=1e-3, weight_decay=0.01)
    return _torch_adamw_through_scaler(base, grads), trainer_amp_step(ours)


def trainer_amp_step(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """``optimizer``'s step as the Trainer's amp path runs it: an unscale + inf check pass over its grads (scale 1,
    a fresh flag each call), then ``step()``. On the device its parameters live on (``ops_cuda.py`` uses it too)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
    inv_scale = torch.ones(1, device=grads[0].device)

    def step() -> None:
        unscale_and_check_(grads, torch.zeros(1, device=inv_scale.device), inv_scale)
        optimizer.step()

    return step


def run(ctx, routed_only: bool = False) -> list[dict]:
    """Rows for every size in ``ctx.sizes`` (see benchmarks/ops.py for the row format); ``routed_only``: only
    the backend comparison of the optimizers torch has a fused op for."""
    os.environ["AMPKIT_OPS"] = "kernel"
    rows = []
    for n in ctx.sizes:
        base = ctx.param_list(n)
        count = sum(t.numel() for t in base)
        size = f"{count / 1e6:.1f}M ({len(base)} tensors)"
        grads = [torch.randn_like(t) * 1e-3 for t in base]
        if routed_only:
            rows += routed_rows(ctx, base, grads, size)
            continue
        for name, make_ours, forms, per_param in FAMILIES:
            baseline, torch_step = _best_torch_form(ctx, base, grads, forms)
            ours = make_ours(_params_with_grads(base, grads))
            torch_ms, ms = ctx.compare_ms(torch_step, ours.step)
            rows.append(ctx.row(SECTION, name, baseline, size, ms, torch_ms, count * per_param))
            del ours, torch_step
        torch_fn, ours_fn = _pipeline_pair(base, grads)
        torch_ms, ms = ctx.compare_ms(torch_fn, ours_fn)
        baseline = "GradScaler.unscale_ + clip_grad_norm_(foreach) + AdamW(fused)"
        rows.append(ctx.row(SECTION, "pipeline: unscale+check+clip+AdamW", baseline, size, ms, torch_ms, count * 32))
        torch_fn, ours_fn = _grad_scaler_pair(base, grads)
        torch_ms, ms = ctx.compare_ms(torch_fn, ours_fn)
        baseline = "GradScaler.step(AdamW(fused=True))"
        rows.append(ctx.row(SECTION, "GradScaler.step(FusedAdam)", baseline, size, ms, torch_ms, count * 40))
        torch_fn, ours_fn = _trainer_path_pair(base, grads)
        torch_ms, ms = ctx.compare_ms(torch_fn, ours_fn)
        rows.append(ctx.row(SECTION, "Trainer amp step: unscale pass + FusedAdam", baseline, size, ms, torch_ms,
                            count * 36))  # fmt: skip
        rows += routed_rows(ctx, base, grads, size)
    return rows


def main() -> None:
    spec = importlib.util.spec_from_file_location("ops_bench", Path(__file__).resolve().parent / "ops.py")
    harness = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = harness  # dataclasses look their module up there
    spec.loader.exec_module(harness)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="1M and 10M params only")
    parser.add_argument("--routed", action="store_true", help="only each backend of Adam, SGD and Adagrad")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = (1_000_000, 10_000_000) if args.quick else (1_000_000, 10_000_000, 50_000_000)
    ctx = harness.BenchContext(threads=args.threads, quick=args.quick, sizes=sizes)
    rows = harness.measure_ceilings(ctx)
    harness.print_table(rows + run(ctx, routed_only=args.routed))


if __name__ == "__main__":
    main()
