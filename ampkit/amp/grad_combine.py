"""Combined unscaling: each backward's new gradients are unscaled by their own loss's scale and added
to what earlier backwards of the same iteration left, with the inf/nan check on the new part only.

Per backward: :meth:`GradientCombiner.prepare_backward` (stash the gradients that exist), run the
scaled backward, then :meth:`GradientCombiner.combine` with that loss's scaler:

    grad = new * (1 / scale_k) + stash        found_inf = any(~isfinite(new))

so an overflow in loss 0 never backs off scaler 1, and accumulation over several backwards is exact
(up to the rounding of ``new / scale_k``). With master weights the stash is the fp32 master gradient
and the low-precision model gradient is upcast before unscaling (unscaling in fp16 would flush small
gradients to zero).

``flat=True`` (Ascend's ``combine_grad``) relocates the gradients of each (device, dtype) into one
flat buffer whose slices are the ``.grad`` tensors, so unscale, inf check, stash and zeroing are one
kernel per buffer instead of one per parameter. Both paths leave ``.grad`` ``None`` for a parameter
that had none and no backward reached, so optimizers skip it exactly as they would without combining.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from ampkit.amp.scaler import LossScaler, positive_option
from ampkit.ops import multi_tensor
from ampkit.ops._layout import local_shards
from ampkit.ops._switches import checked_switch
from ampkit.ops.host_values import host_numbers

__all__ = ["CombineResult", "GradientCombiner", "read_flags", "unscale_and_check_"]


# Below this many elements torch's op is faster on CPU: 6 vs 35 us at 10k elements, 55 vs 93 us at 262k,
# 211 vs 270 us at 1M (one thread, process time); the kernel's parallel pass pays off on larger lists.
KERNEL_MIN_NUMEL = 1 << 20


def unscale_and_check_(tensors: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply ``tensors`` in place by ``inv_scale`` and set ``found_inf`` to 1 if any holds inf/nan.

    ``found_inf`` and ``inv_scale`` are one-element float32 tensors on the tensors' device. On CPU, from
    :data:`KERNEL_MIN_NUMEL` elements on, this runs ampkit's multi-tensor kernel (one parallel pass;
    1.0-1.4x torch's op in ``benchmarks/ops.py``) when it is built; below that (one step of a small
    model: the kernel's ~30 us Python dispatch would cost more than the whole pass), elsewhere, and
    without a compiler, torch's ``_amp_foreach_non_finite_check_and_unscale_``, which reads ``inv_scale``
    on the device (no sync on CUDA, where it also beats ampkit's kernel). Both compute ``x * inv_scale``
    in float32: same bits. A sparse tensor (an ``Embedding(sparse=True)`` gradient) is scaled and checked through
    its values, as torch's ``GradScaler`` does; coalesce a half one first, so that no duplicate sum overflows later.
    """
    _unscale_and_check_strided_([t._values() if t.is_sparse else t for t in tensors], found_inf, inv_scale)


def _unscale_and_check_strided_(tensors: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """:func:`unscale_and_check_` of tensors none of which is sparse (a caller that read each one's layout already
    skips a second look at every tensor)."""
    if not tensors:
        return
    tensors = local_shards(tensors)  # FSDP's sharded gradients: ranks agree on found_inf afterwards
    if (
        found_inf.is_cpu
        and sum(map(torch.Tensor.numel, tensors)) >= KERNEL_MIN_NUMEL
        and multi_tensor.kernel_available(found_inf.device)
    ):
        multi_tensor.scale_(tensors, inv_scale, found_inf)
    else:
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)


def read_flags(flags: Sequence[torch.Tensor]) -> list[bool]:
    """Read several one-element found_inf flags to the host with a single sync (non-zero means overflow)."""
    return [value != 0.0 for value in host_numbers(flags)]


class CombineResult(NamedTuple):
    """What one :meth:`GradientCombiner.combine` saw.

    Attributes:
        found_inf: one-element float32 tensor (not synced), non-zero if the new gradients held inf/nan.
        reached: the model parameters that received a new gradient, in the combiner's order.
    """

    found_inf: torch.Tensor
    reached: tuple[torch.Tensor, ...]


def _inv_scale(scaler: LossScaler | float, device: torch.device) -> torch.Tensor:
    if isinstance(scaler, LossScaler):
        return scaler.inv_scale_tensor(device)
    return torch.full((1,), 1.0 / float(scaler), dtype=torch.float32, device=device)


class _Flags:
    """One lazily created found_inf tensor per device (or the caller's flag), merged into one at the end."""

    def __init__(self, given: torch.Tensor | None = None) -> None:
        self.by_device: dict[torch.device, torch.Tensor] = {} if given is None else {given.device: given}

    def get(self, device: torch.device) -> torch.Tensor:
        flag = self.by_device.get(device)
        if flag is None:
            flag = self.by_device[device] = torch.zeros(1, dtype=torch.float32, device=device)
        return flag

    def merged(self, fallback: torch.device) -> torch.Tensor:
        flags = list(self.by_device.values())
        if not flags:
            return torch.zeros(1, dtype=torch.float32, device=fallback)
        total = flags[0]
        for flag in flags[1:]:
            total = total + flag.to(total.device)
        return total


_HALF = (torch.float16, torch.bfloat16)


def _coalesced_if_half(grad: torch.Tensor) -> torch.Tensor:
    """A half sparse gradient summed over its duplicate indices before its check (torch's ``GradScaler`` does the
    same): two finite fp16 duplicates may sum to inf after the check passed."""
    return grad.coalesce() if grad.is_sparse and grad.dtype in _HALF else grad


def _sparse_sum(grad: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``grad + other`` where either is sparse, in place where the result stays dense; returns the tensor that holds
    the sum, to put back as ``.grad`` (the dense pairs of a combine take one foreach op instead)."""
    if not grad.is_sparse:
        return grad.add_(other)
    if not other.is_sparse:
        return other.add_(grad)
    if grad.dtype in _HALF or other.dtype in _HALF:  # CPU adds no half sparse tensors: sum in float32
        return (grad.float() + other.float()).coalesce().to(grad.dtype)
    return grad + other


def _by_device(tensors: Iterable[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return groups


class _FlatGroup:
    """Params of one (device, model dtype, grad-owner dtype) whose gradients live in flat buffers."""

    def __init__(self, params: list[torch.Tensor], owners: list[torch.Tensor] | None) -> None:
        self.params = params
        self.owners = owners  # None: each param owns its gradient
        first = params[0]
        numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(numel, dtype=first.dtype, device=first.device)
        self.views = self._views(self.buffer, params)
        self.owner_buffer: torch.Tensor | None = None
        self.owner_views: list[torch.Tensor] = []
        if owners is not None:
            self.owner_buffer = torch.zeros(numel, dtype=owners[0].dtype, device=first.device)
            self.owner_views = self._views(self.owner_buffer, owners)
        self.stash: torch.Tensor | None = None  # lazily allocated copy of the buffer that stashes/upcasts
        self.dirty = False  # whether the gradient-owning buffer may hold non-zero values
        self.has_stash = False
        self.was_none: list[int] = []  # gradient holders whose .grad was None before this backward
        self.zeroed: set[int] = set()  # holders whose .grad is None over a slice known to be zero
        with torch.no_grad():
            holders = owners if owners is not None else params
            views = self.owner_views if owners is not None else self.views
            for i, (t, view) in enumerate(zip(holders, views, strict=True)):
                if t.grad is None:
                    self.zeroed.add(i)
                    continue
                view.copy_(t.grad)
                t.grad = view
                self.dirty = True
            if owners is not None:
                for p, view in zip(params, self.views, strict=True):
                    p.grad = view

    @staticmethod
    def _views(buffer: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        views, offset = [], 0
        for t in tensors:
            views.append(buffer[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        return views

    @staticmethod
    def _reattach(
        tensors: list[torch.Tensor], views: list[torch.Tensor], buffer: torch.Tensor, zeroed: set[int]
    ) -> list[int]:
        """Point every ``.grad`` back at the buffer, zeroing the slices of those that were ``None``
        (except the ``zeroed`` ones, known to be zero); returns the indices that were ``None``."""
        missing = []
        for i, (t, view) in enumerate(zip(tensors, views, strict=True)):
            grad = t.grad
            if grad is view:
                continue
            if grad is None:
                missing.append(i)
            else:
                view.copy_(grad)
                t.grad = view
        if len(missing) == len(tensors):
            if len(zeroed) != len(tensors):
                buffer.zero_()
        else:
            for i in missing:
                if i not in zeroed:
                    views[i].zero_()
        for i in missing:
            tensors[i].grad = views[i]
        return missing

    def prepare(self) -> None:
        with torch.no_grad():
            if self.owners is None:
                self.was_none = self._reattach(self.params, self.views, self.buffer, self.zeroed)
                if len(self.was_none) == len(self.params):
                    self.dirty = False
                self.has_stash = self.dirty
                if self.has_stash:
                    if self.stash is None:
                        self.stash = torch.empty_like(self.buffer)
                    self.stash.copy_(self.buffer)
                    self.buffer.zero_()
            else:
                self.was_none = self._reattach(self.owners, self.owner_views, self.owner_buffer, self.zeroed)
                if len(self.was_none) == len(self.owners):
                    self.dirty = False
                self._reattach(self.params, self.views, self.buffer, set())
                self.buffer.zero_()
            self.zeroed = set()

    def combine(self, reached: list[int], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
        with torch.no_grad():
            for i in reached:  # autograd replaces .grad instead of accumulating into it under create_graph
                param, view = self.params[i], self.views[i]
                if param.grad is not view:
                    view.copy_(param.grad.detach())
                    param.grad = view
            if self.owners is None:
                unscale_and_check_([self.buffer], found_inf, inv_scale)
                if self.has_stash:
                    self.buffer.add_(self.stash)
            elif not self.dirty:
                self.owner_buffer.copy_(self.buffer)
                unscale_and_check_([self.owner_buffer], found_inf, inv_scale)
            else:
                if self.stash is None:
                    self.stash = torch.empty_like(self.owner_buffer)
                self.stash.copy_(self.buffer)
                unscale_and_check_([self.stash], found_inf, inv_scale)
                self.owner_buffer.add_(self.stash)
            if self.owners is not None:
                self.buffer.zero_()
            self.dirty = True
            self._restore_none(set(reached))

    def drop(self) -> None:
        """Undo :meth:`prepare`: the backward's gradients are dropped and the buffer holds what it held before (the
        gradient-owning buffer of masters was never touched); ``.grad`` point at the buffers again."""
        with torch.no_grad():
            for tensors, views in ((self.params, self.views), (self.owners or [], self.owner_views)):
                for t, view in zip(tensors, views, strict=True):
                    if t.grad is not None and t.grad is not view:
                        t.grad = view
            if self.owners is None and self.has_stash:
                self.buffer.copy_(self.stash)
            else:
                self.buffer.zero_()
            self._restore_none(set())

    def _restore_none(self, reached: set[int]) -> None:
        """Give ``.grad = None`` back to holders that had none and that no backward reached."""
        holders = self.params if self.owners is None else self.owners
        for i in self.was_none:
            if i not in reached:
                holders[i].grad = None
                self.zeroed.add(i)
        self.was_none = []

    def zero_grad(self, set_to_none: bool, owners_to_none: bool) -> None:
        """Zero the buffers; each ``.grad`` becomes None or stays (a zeroed view), ``owners_to_none`` deciding
        for the gradient owners apart from the params."""
        with torch.no_grad():
            self.buffer.zero_()
            if self.owner_buffer is not None:
                self.owner_buffer.zero_()
            if self.owners is None:
                self.zeroed = self._clear(self.params, self.views, set_to_none)
            else:
                self._clear(self.params, self.views, set_to_none)
                self.zeroed = self._clear(self.owners, self.owner_views, owners_to_none)
        self.dirty = False
        self.was_none = []

    @staticmethod
    def _clear(tensors: list[torch.Tensor], views: list[torch.Tensor], set_to_none: bool) -> set[int]:
        """:func:`_clear_grads` where the views, zeroed with their buffer, need nothing more."""
        if set_to_none:
            return _clear_grads(tensors, True)
        apart = [i for i, (t, view) in enumerate(zip(tensors, views, strict=True)) if t.grad is not view]
        none = _clear_grads([tensors[i] for i in apart], False)
        return {apart[i] for i in none}


def _clear_grads(tensors: Sequence[torch.Tensor], set_to_none: bool) -> set[int]:
    """``Optimizer.zero_grad``'s rule on ``tensors``: each ``.grad`` None, or zeroed in place (detached from any
    graph, as torch does) where there is one; returns the indices whose ``.grad`` is None afterwards."""
    if set_to_none:
        for t in tensors:
            t.grad = None
        return set(range(len(tensors)))
    grads, none = [], set()
    for i, t in enumerate(tensors):
        grad = t.grad
        if grad is None:
            none.add(i)
            continue
        if grad.grad_fn is not None:
            grad.detach_()
        else:
            grad.requires_grad_(False)
        grads.append(grad)
    if grads:
        torch._foreach_zero_(grads)
    return none


class GradientCombiner:
    """Stashes, unscales and combines the gradients of one set of parameters, one backward at a time.

    Args:
        params: the model parameters autograd writes gradients to.
        grad_owners: for each param, the tensor whose ``.grad`` the optimizer reads (an fp32 master
            weight), or the param itself; ``None`` means every param owns its gradient.
        flat: keep gradients in one flat buffer per (device, dtype) so each operation is one kernel
            per buffer (``.grad`` become views of the buffer).
        keep_param_grads: a param with another owner keeps its own (still scaled) gradient after
            :meth:`combine` until the next :meth:`prepare_backward`, as Apex's amp left it (not with ``flat``).

    Example:
        >>> combiner = GradientCombiner(model.parameters())
        >>> combiner.prepare_backward()
        >>> scaler.scale_loss(loss).backward()
        >>> result = combiner.combine(scaler)
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        grad_owners: Iterable[torch.Tensor] | None = None,
        *,
        flat: bool = False,
        keep_param_grads: bool = False,
    ) -> None:
        flat = checked_switch("GradientCombiner", "flat", flat)
        keep_param_grads = checked_switch("GradientCombiner", "keep_param_grads", keep_param_grads)
        self.params: list[torch.Tensor] = list(params)
        owners = self.params if grad_owners is None else list(grad_owners)
        if len(owners) != len(self.params):
            raise ValueError(f"grad_owners has {len(owners)} tensors but params has {len(self.params)}")
        first_index: dict[int, int] = {}
        for i, p in enumerate(self.params):
            if (j := first_index.setdefault(id(p), i)) != i:  # its one gradient was unscaled once per listing
                raise ValueError(
                    f"params[{j}] and params[{i}] are one tensor (shape {tuple(p.shape)}): its gradient would be "
                    "unscaled twice; list each parameter once"
                )
        for i, (p, o) in enumerate(zip(self.params, owners, strict=True)):
            if flat and not p.requires_grad:  # a frozen one is no error otherwise: it has no grad until unfrozen
                raise ValueError(
                    f"params[{i}] does not require grad; flat buffers (flat=True) take only trainable parameters"
                )
            if o is not p and (o.shape != p.shape or o.device != p.device):
                raise ValueError(
                    f"grad_owners[{i}] has shape {tuple(o.shape)} on {o.device}, params[{i}] has "
                    f"{tuple(p.shape)} on {p.device}; a master weight must match its parameter"
                )
            if not (p.is_floating_point() and o.is_floating_point()):
                raise ValueError(f"params[{i}] has dtype {p.dtype}; only floating-point params have gradients")
        self.grad_owners: list[torch.Tensor] = owners
        self.flat = flat
        self.keep_param_grads = keep_param_grads
        devices = {p.device for p in self.params}
        self._device: torch.device | None = devices.pop() if len(devices) == 1 else None
        self._self_idx = [i for i, (p, o) in enumerate(zip(self.params, owners, strict=True)) if o is p]
        self._master_idx = [i for i, (p, o) in enumerate(zip(self.params, owners, strict=True)) if o is not p]
        self._stash: list[torch.Tensor | None] = [None] * len(self._self_idx)
        self._pending = False
        self._groups: list[_FlatGroup] = []
        self._group_of: list[tuple[int, int]] = []  # param index -> (group, index inside group)
        self._reached: dict[int, None] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        if flat:
            self._build_flat_groups()

    @property
    def pending(self) -> bool:
        """True between :meth:`prepare_backward` and :meth:`combine` (the gradients are still scaled)."""
        return self._pending

    def _build_flat_groups(self) -> None:
        keys: dict[tuple, list[int]] = {}
        for i, (p, o) in enumerate(zip(self.params, self.grad_owners, strict=True)):
            keys.setdefault((p.device, p.dtype, o.dtype, o is p), []).append(i)
        self._group_of = [(0, 0)] * len(self.params)
        for g, ((_, _, _, owns), idx) in enumerate(keys.items()):
            params = [self.params[i] for i in idx]
            owners = None if owns else [self.grad_owners[i] for i in idx]
            self._groups.append(_FlatGroup(params, owners))
            for j, i in enumerate(idx):
                self._group_of[i] = (g, j)
        for i, p in enumerate(self.params):
            self._hooks.append(p.register_post_accumulate_grad_hook(self._marker(i)))

    def _marker(self, index: int):
        def mark(_: torch.Tensor) -> None:
            if self._pending:
                self._reached[index] = None

        return mark

    def prepare_backward(self) -> None:
        """Stash the gradients that exist so the next backward's gradients arrive alone.

        Raises:
            RuntimeError: if called again before :meth:`combine`.
        """
        if self._pending:
            raise RuntimeError("prepare_backward() called twice without combine(); combine the pending grads first")
        self._pending = True
        self._reached.clear()
        if self.flat:
            for group in self._groups:
                group.prepare()
            return
        params = self.params
        for k, i in enumerate(self._self_idx):
            p = params[i]
            self._stash[k] = p.grad
            p.grad = None
        for i in self._master_idx:
            params[i].grad = None

    def rescale_pending(self, ratio: float) -> bool:
        """Multiply the gradients that arrived since :meth:`prepare_backward` by ``ratio`` (a delayed unscale whose
        next backward comes at another scale); returns False with flat buffers, which it leaves alone."""
        if not self._pending or self.flat:
            return False
        grads = [p.grad._values() if p.grad.is_sparse else p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, ratio)
        return True

    def adopt_scaled_grads(self) -> None:
        """Count every gradient in ``.grad`` as scaled and new, as if :meth:`prepare_backward` had run before a
        backward into empty gradients: the next :meth:`combine` unscales them whole (Apex's ``delay_unscale``
        protocol runs its first backward without a prepare).

        Raises:
            RuntimeError: while a prepared backward is pending, or with flat buffers (which only know the
                gradients a prepared backward reached).
        """
        if self._pending:
            raise RuntimeError("adopt_scaled_grads() while a prepared backward is pending; combine it first")
        if self.flat:
            raise RuntimeError("flat gradient buffers (combine_grad=True) need prepare_backward() before the backward")
        self._pending = True
        self._stash = [None] * len(self._self_idx)

    def release(self) -> None:
        """End a prepared backward whose gradients the caller unscaled itself (a script's own Apex
        ``_post_amp_backward``): the stashed gradients are added back to what the backward left, unchecked.

        Raises:
            RuntimeError: with flat buffers, whose stash lives in the buffers and is not handed out.
        """
        if not self._pending:
            return
        if self.flat:
            raise RuntimeError("flat gradient buffers (combine_grad=True) are unscaled by combine() only")
        self._pending = False
        with torch.no_grad():
            for k, i in enumerate(self._self_idx):
                p, stash = self.params[i], self._stash[k]
                self._stash[k] = None
                if stash is None:
                    continue
                p.grad = stash if p.grad is None else _sparse_sum(p.grad, stash)

    def take_stash(self) -> list[torch.Tensor | None]:
        """End a prepared backward whose gradients the caller unscales onto the stash itself (Apex's post-backward run
        through a script's own ``LossScaler.unscale``): returns, per param, the gradient stashed before the backward
        (None where there was none, and where another tensor owns the param's gradient: that owner's ``.grad`` is
        its stash); each ``.grad`` holds only the backward's new, still scaled gradient.

        Raises:
            RuntimeError: with nothing pending, or with flat buffers, whose stash lives in the buffers.
        """
        if not self._pending:
            raise RuntimeError("take_stash() called without prepare_backward(); call it before the backward")
        if self.flat:
            raise RuntimeError("flat gradient buffers (combine_grad=True) are unscaled by combine() only")
        self._pending = False
        stash: list[torch.Tensor | None] = [None] * len(self.params)
        for k, i in enumerate(self._self_idx):
            stash[i], self._stash[k] = self._stash[k], None
        return stash

    def drop_pending(self) -> None:
        """End a prepared backward by dropping the gradients it produced: each ``.grad`` is back to what it held
        before :meth:`prepare_backward` (a param that had none has none), still unscaled; a no-op when nothing is
        pending. For a backward whose gradients cannot be unscaled (a replaced unscale that skipped flat buffers)."""
        if not self._pending:
            return
        self._pending = False
        self._reached.clear()
        if self.flat:
            for group in self._groups:
                group.drop()
            return
        for k, i in enumerate(self._self_idx):
            self.params[i].grad, self._stash[k] = self._stash[k], None
        for i in self._master_idx:
            self.params[i].grad = None

    def combine(self, scaler: LossScaler | float, found_inf: torch.Tensor | None = None) -> CombineResult:
        """Unscale the gradients that arrived since :meth:`prepare_backward` by ``scaler`` (a
        :class:`LossScaler` or a scale), check them for inf/nan and add the stash.

        ``found_inf``: a one-element float32 flag on the parameters' device to set on inf/nan (it is never
        cleared), returned as the result's flag when every parameter is on its device; by default a new one.

        Returns:
            the (unsynced) found_inf flag and the parameters reached by the backward(s).

        Raises:
            ValueError: if a scale given as a number is not finite and > 0 (checked before anything changes: the
                division by 0 raised halfway, after the stashed gradients had been let go).
        """
        if not self._pending:
            raise RuntimeError("combine() called without prepare_backward(); call it before the backward")
        if not isinstance(scaler, LossScaler):
            scaler = positive_option(scaler, "scale")
        self._pending = False
        flags = _Flags(found_inf if found_inf is not None and found_inf.device == self._device else None)
        if self.flat:
            return self._combine_flat(scaler, flags)
        params, owners = self.params, self.grad_owners
        reached: list[int] = []
        fresh: list[torch.Tensor] = []
        with_stash: list[torch.Tensor] = []
        stashes: list[torch.Tensor] = []
        # (owner, grad, other) pairs with a sparse side, summed one by one; the dense pairs (every pair of a model
        # without sparse gradients) in one foreach op, as before sparse gradients were taken: no per-pair work
        sparse_sums: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        sparse_seen = False  # whether a new gradient is sparse: unscaled through its values
        for k, i in enumerate(self._self_idx):
            p, stash = params[i], self._stash[k]
            self._stash[k] = None
            grad = p.grad
            if grad is None:
                if stash is not None:
                    p.grad = stash
                continue
            reached.append(i)
            sparse = grad.is_sparse
            if sparse:
                p.grad = grad = _coalesced_if_half(grad)
                sparse_seen = True
            if stash is None:
                fresh.append(grad)
            elif sparse or stash.is_sparse:
                fresh.append(grad)
                sparse_sums.append((p, grad, stash))
            else:
                with_stash.append(grad)
                stashes.append(stash)
        upcast: list[torch.Tensor] = []
        upcast_targets: list[torch.Tensor] = []
        for i in self._master_idx:
            p, owner = params[i], owners[i]
            grad = p.grad
            if grad is None:
                continue
            reached.append(i)
            if not self.keep_param_grads:
                p.grad = None
            grad, sparse = grad.detach(), grad.is_sparse
            if sparse:
                grad, sparse_seen = _coalesced_if_half(grad), True
            new = grad.to(owner.dtype, copy=True)
            if owner.grad is None:
                owner.grad = new
                fresh.append(new)
            elif sparse or owner.grad.is_sparse:
                fresh.append(new)
                sparse_sums.append((owner, owner.grad, new))
            else:
                upcast.append(new)
                upcast_targets.append(owner.grad)
        with torch.no_grad():
            tensors = fresh + with_stash + upcast
            unscale = unscale_and_check_ if sparse_seen else _unscale_and_check_strided_
            if self._device is not None:  # the common case: one device, no grouping
                unscale(tensors, flags.get(self._device), _inv_scale(scaler, self._device))
            else:
                for device, group in _by_device(tensors).items():
                    unscale(group, flags.get(device), _inv_scale(scaler, device))
            if with_stash:
                torch._foreach_add_(with_stash, stashes)
            if upcast:
                torch._foreach_add_(upcast_targets, upcast)
            for owner, grad, other in sparse_sums:
                owner.grad = _sparse_sum(grad, other)
        reached.sort()
        return CombineResult(flags.merged(self._fallback_device()), tuple([params[i] for i in reached]))

    def _fallback_device(self) -> torch.device:
        """Where the flag of a combine that checked nothing lives."""
        return self.params[0].device if self.params else torch.device("cpu")

    def _combine_flat(self, scaler: LossScaler | float, flags: _Flags) -> CombineResult:
        reached = sorted(self._reached)
        self._reached.clear()
        per_group: list[list[int]] = [[] for _ in self._groups]
        for i in reached:
            g, j = self._group_of[i]
            per_group[g].append(j)
        for group, idx in zip(self._groups, per_group, strict=True):
            device = group.buffer.device
            group.combine(idx, flags.get(device), _inv_scale(scaler, device))
        return CombineResult(flags.merged(self._fallback_device()), tuple([self.params[i] for i in reached]))

    def zero_grad(
        self, set_to_none: bool = True, *, owners_to_none: bool | None = None, keep_pending: bool = False
    ) -> None:
        """Drop the stash and clear every gradient as ``Optimizer.zero_grad`` does: set to ``None``, or zeroed in
        place where one exists (flat: the buffers zeroed, one kernel each, the ``.grad`` views kept).

        ``owners_to_none`` (default: ``set_to_none``) decides for the separate gradient owners (fp32 masters)
        apart: Apex's O2 ``zero_grad`` zeroed the model's gradients and set the masters' to None.
        ``keep_pending``: a prepared backward stays prepared, with nothing stashed, so the :meth:`combine` that
        follows unscales what is left (zeros) and any later gradients: a ``zero_grad`` inside Apex's
        ``scale_loss`` block (NeMo's on a nan loss) is then unscaled on exit, as Apex did.
        """
        owners_to_none = set_to_none if owners_to_none is None else owners_to_none
        keep_pending = keep_pending and self._pending
        self._pending = False
        self._reached.clear()
        if self.flat:
            for group in self._groups:
                group.zero_grad(set_to_none, owners_to_none)
            if keep_pending:
                self.prepare_backward()
            return
        self._stash = [None] * len(self._self_idx)
        with torch.no_grad():
            _clear_grads(self.params, set_to_none)
            _clear_grads([self.grad_owners[i] for i in self._master_idx], owners_to_none)
        self._pending = keep_pending

    def flat_buffers(self) -> list[torch.Tensor]:
        """The flat buffers holding the gradients the optimizer reads (empty unless ``flat=True``)."""
        return [g.buffer if g.owner_buffer is None else g.owner_buffer for g in self._groups]

    def remove(self) -> None:
        """Remove the gradient hooks the flat path registered (the ``.grad`` views stay valid tensors)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
