"""ampkit.ops on a CUDA GPU: every ratio against PyTorch's CUDA form measured in the same process.

Run from the repository root on a machine with a GPU (and nvcc, so the CUDA kernels build)::

    PYTHONPATH=$PWD python benchmarks/ops_cuda.py            # 1M / 10M / 50M / 200M params
    PYTHONPATH=$PWD python benchmarks/ops_cuda.py --quick    # 1M / 10M
    PYTHONPATH=$PWD python benchmarks/ops_cuda.py --quick --sections compiled   # one section (see --help)

Timing: CUDA events around a batch of calls (the mean over the batch, best of several batches, calls of
torch and ampkit interleaved batch by batch), after warm-up. The parameter lists are the transformer-like
lists of ``benchmarks/ops.py`` (many small 1-D tensors plus large matrices), on the GPU. The ceiling is a
device-to-device copy (bytes read + written). Optimizer rows compare with the fastest torch form of each
(fused where torch has one); the ampkit side runs under ``AMPKIT_FUSED_BACKEND=auto``, which hands Adam, AdamW
and SGD to torch's fused ops on a GPU. Sections:

* ``multi_tensor``: unscale, L2 norm, the one-read unscale+norm;
* ``optimizers``: each fused optimizer against torch's fastest eager form, the pipeline, GradScaler.step and the
  Trainer's amp step;
* ``routed``: Adam, SGD and Adagrad with ``backend=ampkit`` and ``backend=torch``, plain and through GradScaler,
  against torch's fused form (what ``auto`` chooses between);
* ``compiled``: each optimizer torch has no fused CUDA op for against ``torch.compile`` of its foreach form
  (compiles take tens of seconds each, hence a section of its own);
* ``norms``: ``y = norm(x); y.backward(dy)`` under ``auto`` (torch's kernels on a GPU) and ``backend=ampkit``;
* ``kernels``: the kernels ``AMPKIT_CUDA_KERNELS=multi_tensor`` selects (opt-in until measured here): each optimizer
  torch has no fused op for against torch's foreach form, its ``torch.compile``d foreach form (smallest size) and
  ampkit's default per-tensor kernels; the multi-tensor ops' vector loads against their element loops.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ampkit.ops import multi_tensor as mt  # noqa: E402
from ampkit.ops.optimizers import (  # noqa: E402
    FusedAdadelta,
    FusedAdam,
    FusedAdamP,
    FusedLAMB,
    FusedNovoGrad,
    FusedRMSprop,
    FusedRMSpropTF,
)
from ampkit.ops.pipeline import fused_unscale_clip_step_  # noqa: E402


def _load(name: str):
    """A sibling benchmark script, loaded by path once (its dataclasses look their module up)."""
    key = f"bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "benchmarks" / f"{name}.py")
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


def time_ms(*fns: Callable[[], object], batch: int = 20, rounds: int = 7) -> list[float]:
    """Mean time per call in ms of each fn over a batch, best of ``rounds`` batches, interleaved."""
    for fn in fns:
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(batch):
                fn()
            end.record()
            end.synchronize()
            best[i] = min(best[i], start.elapsed_time(end) / batch)
    return best


def param_list(n: int) -> list[torch.Tensor]:
    return [t.cuda() for t in _load("ops").BenchContext(threads=1, quick=False, sizes=()).param_list(n)]


def copy_ceiling_gbps() -> float:
    src = torch.empty(1 << 28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    (ms,) = time_ms(lambda: dst.copy_(src), batch=10)
    return 2 * src.numel() * 4 / ms / 1e6


def multi_tensor_cases(grads: list[torch.Tensor]) -> list[tuple]:
    found = torch.zeros(1, device="cuda")
    one = torch.ones(1, device="cuda")

    def torch_unscale():
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)

    def torch_norm():
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)

    def torch_unscale_norm():
        torch_unscale()
        return torch_norm()

    return [
        ("unscale+inf check", "_amp_foreach_non_finite_check_and_unscale_", torch_unscale,
         lambda: mt.scale_(grads, 1.0, found), 8),
        ("L2 norm", "_foreach_norm+stack+norm", torch_norm, lambda: mt.l2norm(grads), 4),
        ("unscale+check+norm (read-only)", "unscale_ then _foreach_norm", torch_unscale_norm,
         lambda: mt.unscale_l2norm(grads, 1.0, found), 4),
    ]  # fmt: skip


def _families() -> list[tuple]:
    """The CPU table's optimizer families, and Adadelta (torch has a foreach form of it, no fused one)."""
    adadelta = (
        "Adadelta step",
        lambda p: FusedAdadelta(p, lr=1.0),
        {"Adadelta(foreach=True)": lambda p: torch.optim.Adadelta(p, lr=1.0, foreach=True)},
        24,
    )
    return [*_load("ops_optimizers").FAMILIES, adadelta]  # fmt: skip


def optimizer_rows(base: list[torch.Tensor], size: str, ceiling: float) -> list[tuple]:
    opt_bench = _load("ops_optimizers")
    count = sum(t.numel() for t in base)
    grads = [torch.randn_like(t) * 1e-3 for t in base]
    rows = []
    for name, make_ours, forms, per_param in _families():
        best = None
        for form, make in forms.items():
            opt = make(opt_bench._params_with_grads(base, grads))
            try:
                (ms,) = time_ms(opt.step, rounds=2)
            except RuntimeError:  # a form torch does not offer on CUDA (e.g. Adagrad(fused=True))
                continue
            if best is None or ms < best[0]:
                best = (ms, form, opt)
        ours = make_ours(opt_bench._params_with_grads(base, grads))
        torch_ms, ms = time_ms(best[2].step, ours.step)
        rows.append(("optimizers", name, best[1], size, ms, torch_ms, count * per_param / ms / 1e6, ceiling))
        del ours, best
    # pipeline: unscale + inf check + clip + AdamW
    params = opt_bench._params_with_grads(base, [g.clone() for g in grads])
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=1.0, growth_interval=2**30)
    scaler.scale(torch.ones((), device="cuda"))

    def torch_step() -> None:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 1e30, foreach=True)
        scaler.step(opt)
        scaler.update()

    ours = FusedAdam(opt_bench._params_with_grads(base, grads), lr=1e-3, weight_decay=0.01)
    torch_ms, ms = time_ms(torch_step, lambda: fused_unscale_clip_step_(ours, 1.0, 1e30))
    rows.append(("optimizers", "pipeline: unscale+check+clip+AdamW", "GradScaler + clip_grad_norm_ + AdamW(fused)",
                 size, ms, torch_ms, count * 32 / ms / 1e6, ceiling))  # fmt: skip
    # scaler.step on a fused optimizer: GradScaler's read-only inf check, then the kernel skips or unscales
    # on the device (no host read on either side); bytes: the check reads g, the step reads p, g, m, v and
    # writes p, m, v and the unscaled g.
    torch_adamw = torch.optim.AdamW(opt_bench._params_with_grads(base, grads), lr=1e-3, fused=True)
    ours_adamw = FusedAdam(opt_bench._params_with_grads(base, grads), lr=1e-3)

    def scaler_step(opt: torch.optim.Optimizer) -> Callable[[], None]:
        scaler = torch.amp.GradScaler("cuda", init_scale=1.0, growth_interval=2**30)
        scaler.scale(torch.ones((), device="cuda"))

        def step() -> None:
            scaler.step(opt)
            scaler.update()

        return step

    torch_ms, ms = time_ms(scaler_step(torch_adamw), scaler_step(ours_adamw))
    rows.append(("optimizers", "GradScaler.step(AdamW)", "GradScaler + AdamW(fused)", size, ms, torch_ms,
                 count * 36 / ms / 1e6, ceiling))  # fmt: skip
    # The Trainer's amp step with a fused optimizer: its own unscale + inf check pass after backward (reads and
    # writes g), then the plain kernel (reads p, g, m, v; writes p, m, v). Against the row above, it says
    # whether moving the Trainer's unscale into the kernel would pay on this GPU (on CPU it does not).
    trainer_step = opt_bench.trainer_amp_step(FusedAdam(opt_bench._params_with_grads(base, grads), lr=1e-3))
    torch_ms, ms = time_ms(scaler_step(torch_adamw), trainer_step)
    rows.append(("optimizers", "Trainer amp step: unscale pass + FusedAdam", "GradScaler + AdamW(fused)", size, ms,
                 torch_ms, count * 36 / ms / 1e6, ceiling))  # fmt: skip
    return rows


def routed_rows(base: list[torch.Tensor], size: str, ceiling: float) -> list[tuple]:
    """Adam, SGD and Adagrad under each backend against torch's fused form: the evidence for ``auto``'s choice
    (torch has no CUDA ``_fused_adagrad_`` in 2.11-2.13: its torch-side pairs are skipped where it raises)."""
    opt_bench = _load("ops_optimizers")
    grads = [torch.randn_like(t) * 1e-3 for t in base]
    rows = []
    for name, baseline, torch_step, ours in opt_bench.routed_pairs(base, grads):
        try:
            torch_ms, ms = time_ms(torch_step, ours)
        except RuntimeError as exc:
            print(f"ops_cuda: {name} skipped: {str(exc).splitlines()[0]}", file=sys.stderr)
            continue
        rows.append(("routed", name, baseline, size, ms, torch_ms, float("nan"), ceiling))
    return rows


def _compiled_step(opt: object) -> Callable[[], None]:
    """``opt.step`` through ``torch.compile`` (the compiled foreach form torch documents for its optimizers)."""
    step = torch.compile(opt.step, fullgraph=False)
    return lambda: step()


def compiled_rows(base: list[torch.Tensor], size: str, ceiling: float) -> list[tuple]:
    """Each optimizer against ``torch.compile`` of each of its torch foreach forms (LAMB's included)."""
    opt_bench = _load("ops_optimizers")
    count = sum(t.numel() for t in base)
    grads = [torch.randn_like(t) * 1e-3 for t in base]
    rows = []
    for name, make_ours, forms, per_param in _families():
        for form, make in forms.items():
            if "fused" in form:
                continue
            try:
                compiled = _compiled_step(make(opt_bench._params_with_grads(base, grads)))
                ours = make_ours(opt_bench._params_with_grads(base, grads))
                torch_ms, ms = time_ms(compiled, ours.step)
            except Exception as exc:  # noqa: BLE001 - a compile failure is reported, the other rows still run
                print(f"ops_cuda: torch.compile({form}) failed: {str(exc).splitlines()[0]}", file=sys.stderr)
                continue
            rows.append(("compiled", name, f"torch.compile({form}.step)", size, ms, torch_ms,
                         count * per_param / ms / 1e6, ceiling))  # fmt: skip
    return rows


def _multi_tensor_families() -> list[tuple]:
    """(name, ampkit factory, torch form, its factory or None, bytes per param) of each optimizer with CUDA kernels
    that ``AMPKIT_CUDA_KERNELS=multi_tensor`` selects; torch has no RMSprop-TF, NovoGrad or AdamP, so RMSprop-TF
    meets torch's RMSprop with momentum (the nearest form), NovoGrad only ampkit's per-tensor kernels and AdamP the
    clovaai/timm form in torch ops. AdamP's default on CUDA (``per_tensor``) is its torch-ops step."""
    return [
        ("RMSprop step", lambda p: FusedRMSprop(p, lr=1e-3),
         "RMSprop(foreach=True)", lambda p: torch.optim.RMSprop(p, lr=1e-3, foreach=True), 20),
        ("RMSpropTF step, momentum", lambda p: FusedRMSpropTF(p, lr=1e-3, momentum=0.9),
         "RMSprop(momentum=0.9, foreach=True)",
         lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9, foreach=True), 28),
        ("Adadelta step", lambda p: FusedAdadelta(p, lr=1.0),
         "Adadelta(foreach=True)", lambda p: torch.optim.Adadelta(p, lr=1.0, foreach=True), 24),
        ("LAMB step", lambda p: FusedLAMB(p, lr=1e-3), "LAMB in foreach ops", _load("ops_optimizers")._ForeachLamb, 52),
        ("NovoGrad step", lambda p: FusedNovoGrad(p, lr=1e-3), "", None, 16),
        ("AdamP step", lambda p: FusedAdamP(p, lr=1e-3, weight_decay=0.01),
         "AdamP in torch ops", _load("ops_optimizers")._TorchOpsAdamP, 44),
    ]  # fmt: skip


def _under(kernels: str, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with ``AMPKIT_CUDA_KERNELS=kernels`` (read per call); both sides of a pair pay the same setenv."""

    def run() -> object:
        os.environ["AMPKIT_CUDA_KERNELS"] = kernels
        return fn()

    return run


def kernel_rows(base: list[torch.Tensor], size: str, ceiling: float, compiled: bool) -> list[tuple]:
    """The multi-tensor kernels against torch's foreach forms, ``torch.compile`` of those (when ``compiled``) and
    ampkit's per-tensor kernels; the multi-tensor ops' vector loads against their element loops."""
    opt_bench = _load("ops_optimizers")
    count = sum(t.numel() for t in base)
    grads = [torch.randn_like(t) * 1e-3 for t in base]
    rows = []
    for name, make_ours, form, make_torch, per_param in _multi_tensor_families():
        multi = _under("multi_tensor", make_ours(opt_bench._params_with_grads(base, grads)).step)
        per_tensor = _under("per_tensor", make_ours(opt_bench._params_with_grads(base, grads)).step)
        per_ms, ms = time_ms(per_tensor, multi)
        default = "ampkit default (torch ops)" if name.startswith("AdamP") else "ampkit per_tensor kernels"
        rows.append(("kernels", f"{name}: multi_tensor", default, size, ms, per_ms,
                     count * per_param / ms / 1e6, ceiling))  # fmt: skip
        if make_torch is None:
            continue
        baselines = [(form, make_torch(opt_bench._params_with_grads(base, grads)).step)]
        if compiled:
            baselines.append((f"torch.compile({form}.step)", _compiled_step(make_torch(opt_bench._params_with_grads(
                base, grads)))))  # fmt: skip
        for baseline, torch_step in baselines:
            try:
                torch_ms, ms = time_ms(_under("multi_tensor", torch_step), multi)
            except Exception as exc:  # noqa: BLE001 - a compile failure is reported, the other rows still run
                print(f"ops_cuda: {baseline} failed: {str(exc).splitlines()[0]}", file=sys.stderr)
                continue
            rows.append(("kernels", f"{name}: multi_tensor", baseline, size, ms, torch_ms,
                         count * per_param / ms / 1e6, ceiling))  # fmt: skip
    for name, _, _, ours, per_param in multi_tensor_cases([t.clone() for t in base]):
        element_ms, ms = time_ms(_under("per_tensor", ours), _under("multi_tensor", ours))
        rows.append(("kernels", f"{name}: vector loads", "element loop (per_tensor)", size, ms, element_ms,
                     count * per_param / ms / 1e6, ceiling))  # fmt: skip
    os.environ["AMPKIT_CUDA_KERNELS"] = "per_tensor"
    return rows


def norm_rows(ceiling: float, quick: bool) -> list[tuple]:
    fwd_bwd = _load("ops_norms")._fwd_bwd  # the CPU table's step: y = norm(x); y.backward(dy)
    rows = []
    shapes = ((8192, 1024),) if quick else ((8192, 1024), (32768, 4096))
    for n_rows, n in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(n_rows, n, device="cuda", dtype=dtype).requires_grad_()
            dy = torch.randn_like(x)
            w = (torch.rand(n, device="cuda") + 0.5).to(dtype).requires_grad_()
            b = torch.randn(n, device="cuda", dtype=dtype).requires_grad_()
            nbytes = 5 * x.numel() * x.element_size()
            size = f"{n_rows}x{n} {str(dtype).removeprefix('torch.')}"
            for kind, baseline in (("LayerNorm", "F.layer_norm"), ("RMSNorm", "F.rms_norm")):
                for backend in ("auto", "ampkit"):
                    torch_ms, ms = time_ms(fwd_bwd(kind, None, x, w, b, dy), fwd_bwd(kind, backend, x, w, b, dy))
                    name = f"{kind} fwd+bwd, {backend}"
                    rows.append(("norms", name, baseline, size, ms, torch_ms, nbytes / ms / 1e6, ceiling))
            os.environ[_load("ops_norms").ENV_VAR] = "auto"
    return rows


SECTIONS = ("multi_tensor", "optimizers", "routed", "compiled", "norms", "kernels")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1M and 10M params, the small norm shape")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--no-compiled", dest="compiled", action="store_false",
                        help="leave the torch.compile baselines out of the kernels section (each compiles for tens "
                        "of seconds: a short GPU lease cannot afford them)")  # fmt: skip
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {', '.join(unknown)}; expected a subset of {', '.join(SECTIONS)}")
    if not torch.cuda.is_available():
        print("ops_cuda: no CUDA GPU here; run benchmarks/ops.py for the CPU table", file=sys.stderr)
        return 2
    os.environ["AMPKIT_OPS"] = "kernel"  # a missing CUDA build is an error, not a reference-op timing
    os.environ["AMPKIT_FUSED_BACKEND"] = "auto"
    ceiling = copy_ceiling_gbps()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; device copy ceiling {ceiling:.0f} GB/s")
    print(f"{'section':<13}{'op':<44}{'size':<22}{'ampkit ms':>10}{'torch ms':>10}{'ratio':>8}{'GB/s':>8}"
          f"{'%ceil':>7}  baseline")  # fmt: skip

    class Rows(list):
        """Each row printed as it is measured: a time limit keeps what was measured before it."""

        def __iadd__(self, new):
            for section, name, baseline, size, ms, torch_ms, gbps, ceil in new:
                print(f"{section:<13}{name:<44}{size:<22}{ms:>10.3f}{torch_ms:>10.3f}{torch_ms / ms:>7.2f}x"
                      f"{gbps:>8.0f}{100 * gbps / ceil:>6.0f}%  {baseline}", flush=True)  # fmt: skip
            return super().__iadd__(new)

        def append(self, row):
            self.__iadd__([row])

    rows = Rows()
    sizes = (1_000_000, 10_000_000) if args.quick else (1_000_000, 10_000_000, 50_000_000, 200_000_000)
    for n in sizes:
        base = param_list(n)
        count = sum(t.numel() for t in base)
        size = f"{count / 1e6:.1f}M ({len(base)} tensors)"
        if "multi_tensor" in sections:
            for name, baseline, torch_fn, ours, per_param in multi_tensor_cases([t.clone() for t in base]):
                torch_ms, ms = time_ms(torch_fn, ours)
                rows.append(("multi_tensor", name, baseline, size, ms, torch_ms, count * per_param / ms / 1e6,
                             ceiling))  # fmt: skip
        for section, make_rows in (("optimizers", optimizer_rows), ("routed", routed_rows),
                                   ("compiled", compiled_rows)):  # fmt: skip
            # Compiling costs tens of seconds a form and recompiles for each list: the smallest size only.
            if section in sections and (section != "compiled" or n == sizes[0]):
                rows += make_rows(base, size, ceiling)
                torch.cuda.empty_cache()
        if "kernels" in sections:
            rows += kernel_rows(base, size, ceiling, compiled=args.compiled and n == sizes[0])
            torch.cuda.empty_cache()
        del base
        torch.cuda.empty_cache()
    if "norms" in sections:
        rows += norm_rows(ceiling, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
