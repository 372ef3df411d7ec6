"""Pure-PyTorch references of the ``ampkit_optimizers`` ops, with the same signatures and in-place effects.

They are the fallback when the C++ ops cannot be built, and the ground truth the kernel tests compare
against (run on float64 copies). Each loops over tensors in Python and computes in the accumulate dtype
(float64 for float64 parameters, float32 otherwise), mirroring the per-element math of
``csrc/optimizers/optimizer_math.h`` operation by operation. The ops that take torch's GradScaler
arguments (``grad_scale``, ``found_inf``) read them on the host here; the kernels read them where they run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ampkit.ops._dtypes import HALF_DTYPES, KERNEL_DTYPES
from ampkit.ops._layout import shares_memory

TensorList = Sequence[Tensor]


def _acc_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _check_lists(
    op: str,
    params: TensorList,
    *,
    master_params: TensorList = (),
    optional: dict[str, tuple[TensorList, bool]] | None = None,
    vectors: dict[str, Tensor] | None = None,
    scaler: tuple[Tensor | None, Tensor | None] = (None, None),
    **lists: TensorList,
) -> None:
    """The kernels' argument checks (``csrc/optimizers/list_checks.h``), with their messages, all made before anything
    is written: params of one float dtype on one device; grads of it (or float32 for half params); every other list
    in the accumulate dtype, one tensor per param, of its shape, on its device; each ``optional`` list (name: (list,
    whether these options use it)) empty unless used; float32 ``master_params`` only for half params; one-element
    float step counters; host ``vectors`` (LAMB's ratios, NovoGrad's denominators) with one entry per param. Without
    them an int parameter was stepped and truncated, a complex one lost its imaginary part, and a list one tensor
    short (or one tensor on another device) stepped every parameter before it, then failed naming no list. Last,
    GradScaler's ``scaler`` tensors (``grad_scale``, ``found_inf``) as :func:`_check_scaler` takes them."""
    for i, p in enumerate(params):
        if p.dtype not in KERNEL_DTYPES:
            raise RuntimeError(f"{op}: params[{i}] has dtype {p.dtype}; expected float32, float64, float16 or bfloat16")
        if p.dtype != params[0].dtype:
            raise RuntimeError(
                f"{op}: params must share one dtype; params[0] is {params[0].dtype} but params[{i}] is {p.dtype}"
            )
        if p.device != params[0].device or p.is_meta:  # a meta parameter was "stepped", holding no values
            raise RuntimeError(
                f"{op}: params[{i}] is on {p.device}; every list must be on params[0]'s device, not meta"
            )
    matched = dict(lists)
    for name, (values, used) in (optional or {}).items():
        if used:
            matched[name] = values
        elif len(values):
            raise RuntimeError(f"{op}: {name} must be empty for these options; got {len(values)} tensors")
    if len(master_params):
        if params and params[0].dtype not in HALF_DTYPES:
            raise RuntimeError(
                f"{op}: master_params are only meaningful for float16/bfloat16 params, but params are {params[0].dtype}"
            )
        matched["master_params"] = master_params
    for name, values in matched.items():
        if len(values) != len(params):
            raise RuntimeError(f"{op}: {name} has {len(values)} tensors but params has {len(params)}")
    if not params:
        return
    acc = _acc_dtype(params[0])
    for name, values in matched.items():
        if name == "steps":  # one counter per tensor, read on the host or where the params are
            for i, s in enumerate(values):
                if s.numel() != 1 or s.dtype not in (torch.float32, torch.float64) or s.is_meta:
                    raise RuntimeError(
                        f"{op}: steps[{i}] must be a one-element float32 tensor; got {s.dtype} of shape "
                        f"{list(s.shape)} on {s.device}"
                    )
            continue
        if name == "grads":
            expected = values[0].dtype
            if expected != params[0].dtype and not (expected == torch.float32 and acc == torch.float32):
                raise RuntimeError(
                    f"{op}: grads have dtype {expected} but params have {params[0].dtype}; expected the parameter "
                    "dtype or float32"
                )
        else:
            expected = torch.float32 if name == "master_params" else acc
        for i, (t, p) in enumerate(zip(values, params, strict=True)):
            if t.device != p.device:
                raise RuntimeError(f"{op}: {name}[{i}] is on {t.device}; expected {p.device}")
            if t.dtype != expected:
                raise RuntimeError(f"{op}: {name}[{i}] has dtype {t.dtype}; expected {expected}")
            if t.shape != p.shape:
                raise RuntimeError(
                    f"{op}: {name}[{i}] has shape {list(t.shape)} but params[{i}] has shape {list(p.shape)}"
                )
    for name, vector in (vectors or {}).items():
        if vector.dim() != 1 or vector.numel() != len(params) or not vector.is_floating_point() or vector.is_meta:
            raise RuntimeError(
                f"{op}: {name} must be a float64 vector with one entry per param ({len(params)}); got {vector.dtype} "
                f"of shape {list(vector.shape)} on {vector.device}"
            )
    _check_scaler(op, params, scaler, {"params": params, **matched})


def _check_scaler(
    op: str, params: TensorList, scaler: tuple[Tensor | None, Tensor | None], lists: dict[str, TensorList]
) -> None:
    """torch's GradScaler contract, checked as the kernels check it: ``grad_scale`` and ``found_inf`` are absent or
    one-element float32 tensors on the params' device (an int flag or a float64 scale was taken here, which the kernels
    refuse), sharing memory with no tensor of the call: the kernels read them while writing every list in parallel
    chunks, so a flag or scale inside a parameter, gradient or counter was read before or after a chunk wrote it."""
    given = [(name, t) for name, t in zip(("grad_scale", "found_inf"), scaler, strict=True) if t is not None]
    if not given or not len(params):
        return
    for name, t in given:
        if t.numel() != 1 or t.dtype != torch.float32 or t.device != params[0].device:
            raise RuntimeError(
                f"{op}: {name} must be a one-element float32 tensor on {params[0].device} (the params' device); got "
                f"{t.dtype} of shape {list(t.shape)} on {t.device}"
            )
    # This runs every step where no kernel is built: each tensor of the lists costs one address read, gathered in a
    # set. A tensor sharing memory with a scaler tensor starts inside its storage, so a scaler holding its memory
    # alone (GradScaler's 4 bytes) is a few set look-ups; only a storage holding a tensor's start is searched in full.
    starts: set[int] = set()
    for values in lists.values():
        starts.update(map(Tensor.data_ptr, values))
    for name, t in given:
        storage = t.untyped_storage()
        begin, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        small = end - begin <= 16
        if not (any(a in starts for a in range(begin, end)) if small else any(begin <= a < end for a in starts)):
            continue
        for list_name, values in lists.items():
            for i, other in enumerate(values):
                if begin <= other.data_ptr() < end and shares_memory(t, other):
                    raise RuntimeError(
                        f"{op}: {name} shares memory with {list_name}[{i}], which the step writes (torch: some "
                        "elements of the input tensor and the written-to tensor refer to a single memory location); "
                        f"pass a {name} of its own, e.g. its clone()"
                    )


def _bump(step: Tensor) -> float:
    step += 1
    return float(step.item())


def _scaler_skips(found_inf: Tensor | None) -> bool:
    """Whether a non-zero ``found_inf`` (checked by :func:`_check_scaler`) skips the whole step; read on the host."""
    return found_inf is not None and float(found_inf) != 0


def _unscaled_factor(grad_factor: float, grad_scale: Tensor | None) -> float:
    return grad_factor / float(grad_scale) if grad_scale is not None else grad_factor


def _write_back_unscaled(grads: TensorList, grad_scale: Tensor | None) -> None:
    """Divide the grads by ``grad_scale`` in place, as torch's fused optimizers leave them after the step."""
    if grad_scale is not None and len(grads):
        torch._foreach_div_(list(grads), grad_scale.reshape(()))


def _load(params: TensorList, master_params: TensorList, i: int) -> Tensor:
    p = params[i]
    return master_params[i].clone() if master_params else p.to(_acc_dtype(p))


def _store(params: TensorList, master_params: TensorList, i: int, value: Tensor) -> None:
    if master_params:
        master_params[i].copy_(value)
    params[i].copy_(value)


def _grad(grads: TensorList, i: int, dtype: torch.dtype, grad_factor: float) -> Tensor:
    return grads[i].to(dtype) * grad_factor


@torch.no_grad()
def adam_step(
    params: TensorList,
    grads: TensorList,
    exp_avgs: TensorList,
    exp_avg_sqs: TensorList,
    max_exp_avg_sqs: TensorList,
    master_params: TensorList,
    steps: TensorList,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    amsgrad: bool,
    bias_correction: bool,
    grad_factor: float,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """Adam (L2 weight decay) or AdamW (decoupled) step, torch.optim semantics."""
    _check_lists(
        "adam_step",
        params,
        master_params=master_params,
        optional={"max_exp_avg_sqs": (max_exp_avg_sqs, amsgrad)},
        scaler=(grad_scale, found_inf),
        grads=grads,
        exp_avgs=exp_avgs,
        exp_avg_sqs=exp_avg_sqs,
        steps=steps,
    )
    if _scaler_skips(found_inf):
        return
    grad_factor = _unscaled_factor(grad_factor, grad_scale)
    for i in range(len(params)):
        step = _bump(steps[i])
        bc1 = 1 - beta1**step if bias_correction else 1.0
        bc2 = 1 - beta2**step if bias_correction else 1.0
        p = _load(params, master_params, i)
        g = _grad(grads, i, p.dtype, grad_factor)
        if adam_w_mode:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m, v = exp_avgs[i], exp_avg_sqs[i]
        m.add_((g - m) * (1 - beta1))
        v.copy_(beta2 * v + (1 - beta2) * g * g)
        second = v
        if amsgrad:
            torch.maximum(max_exp_avg_sqs[i], v, out=max_exp_avg_sqs[i])
            second = max_exp_avg_sqs[i]
        denom = second.sqrt() / math.sqrt(bc2) + eps
        _store(params, master_params, i, p - (lr / bc1) * m / denom)
    _write_back_unscaled(grads, grad_scale)


@torch.no_grad()
def sgd_step(
    params: TensorList,
    grads: TensorList,
    momentum_buffers: TensorList,
    master_params: TensorList,
    lr: float,
    weight_decay: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    first_step: bool,
    grad_factor: float,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """SGD step with optional momentum/dampening/Nesterov; ``first_step`` seeds the buffers with the grad."""
    _check_lists(
        "sgd_step",
        params,
        master_params=master_params,
        optional={"momentum_buffers": (momentum_buffers, momentum != 0)},
        scaler=(grad_scale, found_inf),
        grads=grads,
    )
    if _scaler_skips(found_inf):
        return
    grad_factor = _unscaled_factor(grad_factor, grad_scale)
    for i in range(len(params)):
        p = _load(params, master_params, i)
        g = _grad(grads, i, p.dtype, grad_factor) + weight_decay * p
        if momentum != 0:
            buf = momentum_buffers[i]
            buf.copy_(g if first_step else momentum * buf + (1 - dampening) * g)
            g = g + momentum * buf if nesterov else buf
        _store(params, master_params, i, p - lr * g)
    _write_back_unscaled(grads, grad_scale)


@torch.no_grad()
def adagrad_step(
    params: TensorList,
    grads: TensorList,
    state_sums: TensorList,
    master_params: TensorList,
    steps: TensorList,
    lr: float,
    lr_decay: float,
    weight_decay: float,
    eps: float,
    grad_factor: float,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """Adagrad step, torch.optim semantics."""
    _check_lists(
        "adagrad_step",
        params,
        master_params=master_params,
        scaler=(grad_scale, found_inf),
        grads=grads,
        state_sums=state_sums,
        steps=steps,
    )
    if _scaler_skips(found_inf):
        return
    grad_factor = _unscaled_factor(grad_factor, grad_scale)
    for i in range(len(params)):
        clr = lr / (1 + (_bump(steps[i]) - 1) * lr_decay)
        p = _load(params, master_params, i)
        g = _grad(grads, i, p.dtype, grad_factor) + weight_decay * p
        s = state_sums[i]
        s.add_(g * g)
        _store(params, master_params, i, p - clr * g / (s.sqrt() + eps))
    _write_back_unscaled(grads, grad_scale)


def _check_rmsprop_lists(
    op: str,
    params: TensorList,
    grads: TensorList,
    square_avgs: TensorList,
    grad_avgs: TensorList,
    momentum_buffers: TensorList,
    master_params: TensorList,
    steps: TensorList,
    *,
    centered: bool,
    momentum: float,
    scaler: tuple[Tensor | None, Tensor | None],
) -> None:
    """Both RMSprops' lists: ``grad_avgs`` only where centered, ``momentum_buffers`` only with momentum."""
    _check_lists(
        op,
        params,
        master_params=master_params,
        optional={"grad_avgs": (grad_avgs, centered), "momentum_buffers": (momentum_buffers, momentum > 0)},
        scaler=scaler,
        grads=grads,
        square_avgs=square_avgs,
        steps=steps,
    )


@torch.no_grad()
def rmsprop_step(
    params: TensorList,
    grads: TensorList,
    square_avgs: TensorList,
    grad_avgs: TensorList,
    momentum_buffers: TensorList,
    master_params: TensorList,
    steps: TensorList,
    lr: float,
    alpha: float,
    eps: float,
    weight_decay: float,
    momentum: float,
    centered: bool,
    grad_factor: float,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """RMSprop step (centered, momentum), torch.optim semantics."""
    lists = (params, grads, square_avgs, grad_avgs, momentum_buffers, master_params, steps)
    _check_rmsprop_lists("rmsprop_step", *lists, centered=centered, momentum=momentum, scaler=(grad_scale, found_inf))
    if _scaler_skips(found_inf):
        return
    grad_factor = _unscaled_factor(grad_factor, grad_scale)
    for i in range(len(params)):
        _bump(steps[i])
        p = _load(params, master_params, i)
        g = _grad(grads, i, p.dtype, grad_factor) + weight_decay * p
        sq = square_avgs[i]
        sq.copy_(alpha * sq + (1 - alpha) * g * g)
        if centered:
            ga = grad_avgs[i]
            ga.add_((1 - alpha) * (g - ga))
            avg = (sq - ga * ga).sqrt() + eps
        else:
            avg = sq.sqrt() + eps
        if momentum > 0:
            buf = momentum_buffers[i]
            buf.copy_(momentum * buf + g / avg)
            p = p - lr * buf
        else:
            p = p - lr * g / avg
        _store(params, master_params, i, p)
    _write_back_unscaled(grads, grad_scale)


@torch.no_grad()
def rmsprop_tf_step(
    params: TensorList,
    grads: TensorList,
    square_avgs: TensorList,
    grad_avgs: TensorList,
    momentum_buffers: TensorList,
    master_params: TensorList,
    steps: TensorList,
    lr: float,
    alpha: float,
    eps: float,
    weight_decay: float,
    momentum: float,
    centered: bool,
    decoupled_decay: bool,
    lr_in_momentum: bool,
    grad_factor: float,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """TensorFlow-style RMSprop (timm's RMSpropTF): eps inside the sqrt, optional lr inside momentum."""
    lists = (params, grads, square_avgs, grad_avgs, momentum_buffers, master_params, steps)
    _check_rmsprop_lists(
        "rmsprop_tf_step", *lists, centered=centered, momentum=momentum, scaler=(grad_scale, found_inf)
    )
    if _scaler_skips(found_inf):
        return
    grad_factor = _unscaled_factor(grad_factor, grad_scale)
    for i in range(len(params)):
        _bump(steps[i])
        p = _load(params, master_params, i)
        if decoupled_decay:
            p = p * (1 - lr * weight_decay)
        g = _grad(grads, i, p.dtype, grad_factor)
        if not decoupled_decay:
            g = g + weight_decay * p
        sq = square_avgs[i]
        sq.add_((1 - alpha) * (g * g - sq))
        if centered:
            ga = grad_avgs[i]
            ga.add_((1 - alpha) * (g - ga))
            avg = (sq - ga * ga + eps).sqrt()
        else:
            avg = (sq + eps).sqrt()
        if momentum > 0:
            buf = momentum_buffers[i]
            if lr_in_momentum:
                buf.copy_(momentum * buf + lr * g / avg)
                p = p - buf
            else:
                buf.copy_(momentum * buf + g / avg)
                p = p - lr * buf
        else:
            p = p - lr * g / avg
        _store(params, master_params, i, p)
    _write_back_unscaled(grads, grad_scale)


@torch.no_grad()
def adadelta_step(
    params: TensorList,
    grads: TensorList,
    square_avgs: TensorList,
    acc_deltas: TensorList,
    master_params: TensorList,
    steps: TensorList,
    lr: float,
    rho: float,
    eps: float,
    weight_decay: float,
    grad_factor: float,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """Adadelta step, torch.optim semantics."""
    _check_lists(
        "adadelta_step",
        params,
        master_params=master_params,
        scaler=(grad_scale, found_inf),
        grads=grads,
        square_avgs=square_avgs,
        acc_deltas=acc_deltas,
        steps=steps,
    )
    if _scaler_skips(found_inf):
        return
    grad_factor = _unscaled_factor(grad_factor, grad_scale)
    for i in range(len(params)):
        _bump(steps[i])
        p = _load(params, master_params, i)
        g = _grad(grads, i, p.dtype, grad_factor) + weight_decay * p
        sq, ad = square_avgs[i], acc_deltas[i]
        sq.copy_(rho * sq + (1 - rho) * g * g)
        delta = (ad + eps).sqrt() / (sq + eps).sqrt() * g
        ad.copy_(rho * ad + (1 - rho) * delta * delta)
        _store(params, master_params, i, p - lr * delta)
    _write_back_unscaled(grads, grad_scale)


@torch.no_grad()
def lamb_stage1(
    params: TensorList,
    grads: TensorList,
    exp_avgs: TensorList,
    exp_avg_sqs: TensorList,
    updates: TensorList,
    master_params: TensorList,
    steps: TensorList,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    grad_averaging: bool,
    bias_correction: bool,
    grad_factor: float,
) -> None:
    """LAMB stage 1 (Apex): update the moments, write the raw direction into ``updates``."""
    _check_lists(
        "lamb_stage1",
        params,
        master_params=master_params,
        grads=grads,
        exp_avgs=exp_avgs,
        exp_avg_sqs=exp_avg_sqs,
        updates=updates,
        steps=steps,
    )
    beta3 = 1 - beta1 if grad_averaging else 1.0
    for i in range(len(params)):
        step = _bump(steps[i])
        bc1 = 1 - beta1**step if bias_correction else 1.0
        bc2 = 1 - beta2**step if bias_correction else 1.0
        p = _load(params, master_params, i)
        g = _grad(grads, i, p.dtype, grad_factor)
        if not adam_w_mode:
            g = g + weight_decay * p
        m, v = exp_avgs[i], exp_avg_sqs[i]
        m.copy_(beta1 * m + beta3 * g)
        v.copy_(beta2 * v + (1 - beta2) * g * g)
        u = (m / bc1) / ((v / bc2).sqrt() + eps)
        if adam_w_mode:
            u = u + weight_decay * p
        updates[i].copy_(u)


@torch.no_grad()
def lamb_stage2(params: TensorList, updates: TensorList, master_params: TensorList, ratios: Tensor) -> None:
    """LAMB stage 2: ``param -= ratios[i] * update`` (ratios = lr x trust ratio per tensor)."""
    _check_lists("lamb_stage2", params, master_params=master_params, vectors={"ratios": ratios}, updates=updates)
    for i in range(len(params)):
        p = _load(params, master_params, i)
        _store(params, master_params, i, p - float(ratios[i]) * updates[i])


@torch.no_grad()
def novograd_step(
    params: TensorList,
    grads: TensorList,
    exp_avgs: TensorList,
    master_params: TensorList,
    denoms: Tensor,
    lr: float,
    beta1: float,
    weight_decay: float,
    reg_inside_moment: bool,
    grad_averaging: bool,
    bias_correction1: float,
    grad_factor: float,
) -> None:
    """NovoGrad element update (Apex) given each tensor's denominator."""
    _check_lists(
        "novograd_step", params, master_params=master_params, vectors={"denoms": denoms}, grads=grads, exp_avgs=exp_avgs
    )
    beta3 = 1 - beta1 if grad_averaging else 1.0
    for i in range(len(params)):
        p = _load(params, master_params, i)
        g = _grad(grads, i, p.dtype, grad_factor)
        m, d = exp_avgs[i], float(denoms[i])
        if reg_inside_moment:
            g = g / d + weight_decay * p
            m.copy_(beta1 * m + beta3 * g)
            p = p - lr * (m / bias_correction1)
        else:
            m.copy_(beta1 * m + beta3 * g)
            p = p - lr * ((m / bias_correction1) / d + weight_decay * p)
        _store(params, master_params, i, p)


def _radial_coef(pq: Tensor, pp: Tensor, eps: float) -> Tensor:
    """``direction . unit`` per row over ``|weight| + eps`` again: the radial part is ``coef * weight``."""
    return pq / (pp.sqrt() + eps).square()


def _abs_cosine(gp: Tensor, gg: Tensor, pp: Tensor, eps: float) -> Tensor:
    """``|cos(grad, weight)|`` per row as ``F.cosine_similarity`` computes it (norms clamped below at ``eps``)."""
    return gp.abs() / (gg.sqrt().clamp_min(eps) * pp.sqrt().clamp_min(eps))


def adamp_projection(
    g: Tensor, p: Tensor, q: Tensor, delta: float, wd_ratio: float, eps: float
) -> tuple[Tensor, Tensor]:
    """AdamP's choice for a weight ``p`` of two or more dimensions, its (factored) gradient ``g`` and Adam direction
    ``q``: channel-wise (a coefficient per row) when every row's ``|cos(g, p)|`` is under ``delta / sqrt(row
    length)``, else layer-wise (one coefficient) under ``delta / sqrt(numel)``, else none. Returns the radial
    coefficient per row (``q - coef * p`` is the projected direction) and the weight-decay ratio, as tensors:
    decided on ``p``'s device, with no host read."""
    rows = p.reshape(p.size(0), -1)
    gr, qr = g.reshape(rows.shape), q.reshape(rows.shape)
    gp, gg, pp, pq = (gr * rows).sum(1), (gr * gr).sum(1), (rows * rows).sum(1), (rows * qr).sum(1)
    channel = _abs_cosine(gp, gg, pp, eps).max() < delta / math.sqrt(rows.size(1))
    layer = _abs_cosine(gp.sum(), gg.sum(), pp.sum(), eps) < delta / math.sqrt(p.numel())
    layer_coef = torch.where(layer, _radial_coef(pq.sum(), pp.sum(), eps), 0.0)
    coef = torch.where(channel, _radial_coef(pq, pp, eps), layer_coef)
    # float64, so the decay factor 1 - lr * wd * ratio is derived in double and rounded once, as the kernel does
    ratio = torch.where(channel | layer, wd_ratio, 1.0).to(torch.float64)
    return coef.view([-1] + [1] * (p.dim() - 1)), ratio


@torch.no_grad()
def adamp_step(
    params: TensorList,
    grads: TensorList,
    exp_avgs: TensorList,
    exp_avg_sqs: TensorList,
    master_params: TensorList,
    steps: TensorList,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    delta: float,
    wd_ratio: float,
    nesterov: bool,
    grad_factor: float,
) -> None:
    """AdamP (clovaai/AdamP): Adam whose direction loses its radial part where the weight looks scale-invariant
    (see ``adamp_projection``), with weight decay scaled by ``wd_ratio`` there. Step counters are host tensors; the
    rest runs on the params' device without reading it back."""
    _check_lists(
        "adamp_step",
        params,
        master_params=master_params,
        grads=grads,
        exp_avgs=exp_avgs,
        exp_avg_sqs=exp_avg_sqs,
        steps=steps,
    )
    for i in range(len(params)):
        step = _bump(steps[i])
        p = _load(params, master_params, i)
        g = _grad(grads, i, p.dtype, grad_factor)
        m, v = exp_avgs[i], exp_avg_sqs[i]
        m.copy_(m * beta1 + (1 - beta1) * g)
        v.copy_(v * beta2 + (1 - beta2) * g * g)
        denom = v.sqrt() / math.sqrt(1 - beta2**step) + eps
        q = (beta1 * m + (1 - beta1) * g if nesterov else m) / denom
        ratio: Tensor | float = 1.0
        if p.dim() > 1 and p.numel() > 0:
            coef, ratio = adamp_projection(g, p, q, delta, wd_ratio, eps)
            q = q - coef * p
        if weight_decay > 0:
            p = p * (1 - lr * weight_decay * ratio)
        _store(params, master_params, i, p - lr / (1 - beta1**step) * q)
