"""Pure-PyTorch reference of the multi-tensor ops: the semantics the kernels must match.

Each function validates its arguments with the same messages as the C++ kernels (``RuntimeError``
naming the argument and index), then computes tensor by tensor in the accumulation type: float32 for
half inputs, float64 when an input or output is float64. Fed float64 tensors it is the float64 ground
truth the tests compare kernels against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ampkit.ops._dtypes import KERNEL_DTYPES
from ampkit.ops._layout import is_dense


def _acc_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _check_length(op: str, tensors: Sequence, name: str, ref_len: int, ref_name: str) -> None:
    if len(tensors) != ref_len:
        raise RuntimeError(
            f"{op}: `{name}` has {len(tensors)} tensors but `{ref_name}` has {ref_len}; "
            "the lists must have the same length"
        )


def _check_tensor(op: str, t: torch.Tensor, name: str, i: int, device: torch.device, numel: int | None) -> None:
    if t is None:
        raise RuntimeError(f"{op}: `{name}[{i}]` is undefined (None)")
    if t.dtype not in KERNEL_DTYPES:
        raise RuntimeError(f"{op}: `{name}[{i}]` has dtype {t.dtype}; expected float32, float16, bfloat16 or float64")
    if t.device != device:
        raise RuntimeError(
            f"{op}: `{name}[{i}]` is on {t.device} but the op runs on {device}; all tensors must be on one device"
        )
    if numel is not None and t.numel() != numel:
        raise RuntimeError(f"{op}: `{name}[{i}]` has {t.numel()} elements but the matching input has {numel}")


def _check_list(op: str, tensors: Sequence[torch.Tensor], name: str, device: torch.device, like=None) -> None:
    for i, t in enumerate(tensors):
        _check_tensor(op, t, name, i, device, None if like is None else like[i].numel())


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _partly_shared(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch's overlap rule (``at::get_overlap_status``): two dense tensors of one storage whose bytes intersect
    without coinciding. Tensors it cannot judge (not dense) count as separate, as there."""
    if a.numel() == 0 or b.numel() == 0 or not (is_dense(a) and is_dense(b)):
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a_start, a_end), (b_start, b_end) = _byte_range(a), _byte_range(b)
    return (a_start, a_end) != (b_start, b_end) and a_start < b_end and b_start < a_end


def _check_writable(op: str, out: torch.Tensor, name: str, i: int, read: torch.Tensor, read_name: str) -> None:
    """``out`` may be ``read`` itself (in place), but not part of it, nor an expanded tensor (the kernels write in
    parallel chunks: the result would depend on their order)."""
    repeats = any(stride == 0 and size > 1 for stride, size in zip(out.stride(), out.shape, strict=True))
    if repeats and not is_dense(out):
        raise RuntimeError(
            f"{op}: `{name}[{i}]` holds one element at several positions (an expanded tensor?); pass one that owns "
            "its memory, e.g. its clone()"
        )
    if _partly_shared(out, read):
        raise RuntimeError(
            f"{op}: `{name}[{i}]` shares part of its memory with `{read_name}[{i}]`; pass the same tensor (in place) "
            "or separate ones"
        )


def _check_writable_list(op: str, out: Sequence[torch.Tensor], name: str, read: Sequence[torch.Tensor], read_name: str):
    for i, (o, r) in enumerate(zip(out, read, strict=True)):
        _check_writable(op, o, name, i, r, read_name)


class _Span(NamedTuple):
    """The bytes one tensor of a call covers, and where it sits in the call."""

    begin: int
    end: int
    name: str
    index: int
    written: bool


def _check_separate(op: str, read: dict[str, Sequence], written: dict[str, Sequence], flag: torch.Tensor) -> None:
    """No written tensor shares memory with a tensor of another index, read or written (the kernels run every index's
    chunks in parallel), and the overflow flag, which any chunk may write, with none. Sorted by address: O(n log n).
    Tensors that are not dense are left out, as torch leaves them."""
    spans = [
        _Span(*_byte_range(t), name, i, is_written)
        for lists, is_written in ((read, False), (written, True))
        for name, tensors in lists.items()
        for i, t in enumerate(tensors)
        if t is not None and t.numel() and is_dense(t)
    ]
    spans.append(_Span(*_byte_range(flag), "found_inf", -1, True))
    if not any(span.written for span in spans):
        return
    open_spans: list[_Span] = []  # begun before the current one and not ended
    for span in sorted(spans, key=lambda s: s.begin):
        open_spans = [s for s in open_spans if s.end > span.begin]
        for earlier in open_spans:
            if earlier.index != span.index and (earlier.written or span.written):
                w, r = (earlier, span) if earlier.written and span.index != -1 else (span, earlier)
                if w.index == -1:
                    raise RuntimeError(
                        f"{op}: `found_inf` shares memory with `{r.name}[{r.index}]`; pass a flag tensor of its own, "
                        "e.g. torch.zeros(1)"
                    )
                raise RuntimeError(
                    f"{op}: `{w.name}[{w.index}]` shares memory with `{r.name}[{r.index}]`; an output may be its own "
                    "index's input (in place), never another index's tensor"
                )
        open_spans.append(span)


def _check_flag(op: str, flag: torch.Tensor, device: torch.device) -> None:
    if flag.numel() != 1:
        raise RuntimeError(f"{op}: `found_inf` must have exactly one element, got {flag.numel()}")
    if flag.dtype not in (torch.float32, torch.int32):
        raise RuntimeError(f"{op}: `found_inf` has dtype {flag.dtype}; expected float32 or int32")
    if flag.device != device:
        raise RuntimeError(f"{op}: `found_inf` is on {flag.device} but the tensors are on {device}")


def _nonfinite(t: torch.Tensor) -> torch.Tensor:
    """Whether ``t`` holds inf/nan, as a bool on its device: not read back (on CUDA, a sync per tensor)."""
    return (~torch.isfinite(t)).any()


def _raise_flag(flag: torch.Tensor, seen: list[torch.Tensor]) -> None:
    """Set ``flag`` to 1 where any of the ``seen`` checks found inf/nan, on the device, as the kernels do."""
    if seen:
        flag.masked_fill_(torch.stack(seen).any(), 1)


@torch.no_grad()
def scale_(
    inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], factor: float, found_inf: torch.Tensor
) -> None:
    """outputs[i] = inputs[i] * factor; found_inf = 1 if any input is non-finite."""
    op = "ampkit_multi_tensor.scale_"
    _check_length(op, outputs, "out", len(inputs), "inputs")
    device = found_inf.device
    _check_flag(op, found_inf, device)
    _check_list(op, inputs, "inputs", device)
    _check_list(op, outputs, "out", device, like=inputs)
    _check_writable_list(op, outputs, "out", inputs, "inputs")
    _check_separate(op, {"inputs": inputs}, {"out": outputs}, found_inf)
    seen: list[torch.Tensor] = []
    for x, out in zip(inputs, outputs, strict=True):
        acc = _acc_dtype(x.dtype, out.dtype)
        xa = x.to(acc)
        seen.append(_nonfinite(xa))
        out.copy_((xa * factor).reshape(out.shape))
    _raise_flag(found_inf, seen)


@torch.no_grad()
def axpby_(
    a: float,
    x: Sequence[torch.Tensor],
    b: float,
    y: Sequence[torch.Tensor],
    out: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    arg_to_check: int = -1,
) -> None:
    """out[i] = a * x[i] + b * y[i]; found_inf = 1 if x (0), y (1) or either (-1) has a non-finite value."""
    op = "ampkit_multi_tensor.axpby_"
    if arg_to_check not in (-1, 0, 1):
        raise RuntimeError(
            f"{op}: `arg_to_check` is {arg_to_check}; expected -1 (check x and y), 0 (check x) or 1 (check y)"
        )
    _check_length(op, y, "y", len(x), "x")
    _check_length(op, out, "out", len(x), "x")
    device = found_inf.device
    _check_flag(op, found_inf, device)
    _check_list(op, x, "x", device)
    _check_list(op, y, "y", device, like=x)
    _check_list(op, out, "out", device, like=x)
    for i, (xi, yi) in enumerate(zip(x, y, strict=True)):
        if xi.dtype != yi.dtype:
            raise RuntimeError(
                f"{op}: `y[{i}]` has dtype {yi.dtype} but `x[{i}]` has {xi.dtype}; x and y must share a dtype"
            )
    _check_writable_list(op, out, "out", x, "x")
    _check_writable_list(op, out, "out", y, "y")
    _check_separate(op, {"x": x, "y": y}, {"out": out}, found_inf)
    seen: list[torch.Tensor] = []
    for xi, yi, oi in zip(x, y, out, strict=True):
        acc = _acc_dtype(xi.dtype, oi.dtype)
        xa, ya = xi.to(acc), yi.to(acc)
        if arg_to_check in (-1, 0):
            seen.append(_nonfinite(xa))
        if arg_to_check in (-1, 1):
            seen.append(_nonfinite(ya))
        oi.copy_((a * xa + b * ya).reshape(oi.shape))
    _raise_flag(found_inf, seen)


@torch.no_grad()
def combine_(
    new: Sequence[torch.Tensor],
    stash: Sequence[torch.Tensor | None] | None,
    out: Sequence[torch.Tensor],
    inv_scale: float,
    found_inf: torch.Tensor,
) -> None:
    """out[i] = new[i] * inv_scale + stash[i] (None counts as 0); found_inf = 1 if new is non-finite."""
    op = "ampkit_multi_tensor.combine_"
    _check_length(op, out, "out", len(new), "new")
    stash = list(stash or [])
    if stash and len(stash) != len(new):
        raise RuntimeError(
            f"{op}: `stash` has {len(stash)} entries but `new` has {len(new)}; "
            "pass one per tensor (None where nothing is stashed)"
        )
    device = found_inf.device
    _check_flag(op, found_inf, device)
    _check_list(op, new, "new", device)
    _check_list(op, out, "out", device, like=new)
    _check_writable_list(op, out, "out", new, "new")
    for i, s in enumerate(stash):
        if s is None:
            continue
        _check_tensor(op, s, "stash", i, device, new[i].numel())
        if s.dtype != out[i].dtype:
            raise RuntimeError(
                f"{op}: `stash[{i}]` has dtype {s.dtype} but `out[{i}]` has {out[i].dtype}; they must match"
            )
        _check_writable(op, out[i], "out", i, s, "stash")
    _check_separate(op, {"new": new, "stash": stash}, {"out": out}, found_inf)
    seen: list[torch.Tensor] = []
    for i, (ni, oi) in enumerate(zip(new, out, strict=True)):
        acc = _acc_dtype(ni.dtype, oi.dtype)
        na = ni.to(acc)
        seen.append(_nonfinite(na))
        value = na * inv_scale
        if stash and stash[i] is not None:
            value = value + stash[i].to(acc).reshape(value.shape)
        oi.copy_(value.reshape(oi.shape))
    _raise_flag(found_inf, seen)


@torch.no_grad()
def l2norm(inputs: Sequence[torch.Tensor], per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(total L2 norm, per-tensor norms or an empty tensor), float32 (float64 if an input is float64)."""
    op = "ampkit_multi_tensor.l2norm"
    device = inputs[0].device if inputs else torch.device("cpu")
    _check_list(op, inputs, "inputs", device)
    return _norms(inputs, [], 1.0, None, per_tensor, device)


@torch.no_grad()
def unscale_l2norm(
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    inv_scale: float,
    found_inf: torch.Tensor,
    per_tensor: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Norms of inputs * inv_scale; found_inf = 1 on a non-finite input; outputs (if any) get the values."""
    op = "ampkit_multi_tensor.unscale_l2norm"
    if outputs:
        _check_length(op, outputs, "out", len(inputs), "inputs")
    device = found_inf.device
    _check_flag(op, found_inf, device)
    _check_list(op, inputs, "inputs", device)
    _check_list(op, outputs, "out", device, like=inputs)
    if outputs:
        _check_writable_list(op, outputs, "out", inputs, "inputs")
    _check_separate(op, {"inputs": inputs}, {"out": outputs}, found_inf)
    return _norms(inputs, outputs, inv_scale, found_inf, per_tensor, device)


def _norms(inputs, outputs, factor, found_inf, per_tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = _acc_dtype(*(t.dtype for t in inputs))
    squares = []
    seen: list[torch.Tensor] = []
    for i, x in enumerate(inputs):
        xa = x.to(_acc_dtype(x.dtype))
        seen.append(_nonfinite(xa))
        value = xa * factor
        if outputs:
            outputs[i].copy_(value.reshape(outputs[i].shape))
        squares.append(value.to(torch.float64).square().sum())
    if found_inf is not None:
        _raise_flag(found_inf, seen)
    per = torch.stack(squares) if squares else torch.zeros(0, dtype=torch.float64)
    total = per.sum().sqrt().to(dtype=dtype, device=device)
    per_norm = per.sqrt().to(dtype=dtype, device=device) if per_tensor else torch.empty(0, dtype=dtype, device=device)
    return total, per_norm
