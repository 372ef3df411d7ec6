"""``amp.scale_loss`` (per-loss scaling, combined unscaling, one scale update per backward, one-shot skips)
and Apex's original handle API: ``handle = amp.init()``, ``handle.scale_loss``, ``handle.wrap_optimizer``.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator
from typing import Any

import torch

from ampkit.amp import GradientCombiner
from ampkit.amp.scaler import loss_count_option
from ampkit.compat.amp import _ddp_no_sync, functions, o1_casts
from ampkit.compat.amp._amp_state import _amp_state, maybe_print
from ampkit.compat.amp.functions import disable_casts as disable_casts  # Apex defined it here: apex.amp.handle
from ampkit.compat.amp.scaler import ApexLossScaler
from ampkit.ops._switches import checked_switch, is_switch
from ampkit.wording import shown, type_of


def _optimizer_list(optimizers: Any) -> list[Any]:
    """The optimizers ``scale_loss`` unscales for, each one that ``amp.initialize`` returned; at least one, each once
    (``[opt, opt]`` failed inside amp, in "combine() called without prepare_backward()")."""
    items = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if not items:
        raise ValueError(
            f"amp.scale_loss got no optimizers ({shown(optimizers)}): pass the optimizer(s) that step on this "
            "backward's gradients, which would otherwise stay multiplied by the loss scale"
        )
    for i, optimizer in enumerate(items):
        if not hasattr(optimizer, "_amp_stash"):
            raise RuntimeError(
                f"optimizers[{i}] ({type(optimizer).__name__}) was not returned by amp.initialize; pass every "
                "optimizer used with amp.scale_loss through amp.initialize first."
            )
    return list({id(optimizer): optimizer for optimizer in items}.values())


class LossIdRangeError(ValueError, IndexError):
    """A ``loss_id`` outside ``0..num_losses-1``: Apex indexed its list of scalers with it (an IndexError, and -1
    silently took the last loss's scaler), ampkit raised a ValueError; it is both."""


def _check_loss(loss: Any, where: str) -> None:
    """The loss a ``scale_loss`` scales is a tensor: a number (``loss.item()``) has no graph to backpropagate."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"{where} expects the loss as a tensor, got {type(loss).__name__}: a number has no graph to "
            "backpropagate (pass the loss before .item())"
        )


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: torch.nn.Module | None = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
    **fork_keywords: Any,
) -> Iterator[torch.Tensor]:
    """Yield ``loss.float() * scale`` of scaler ``loss_id``; on exit unscale the new gradients of ``optimizers``.

    On a non-delayed exit the gradients that this backward produced are divided by the scale and added to
    those that existed before (checked for inf/nan on the new part only), and scaler ``loss_id`` updates
    once. An overflow (dynamic scaling) makes the next ``step()`` of each optimizer here a one-shot skip
    that prints ``Gradient overflow.  Skipping step, loss scaler K reducing loss scale to S``.
    ``delay_unscale=True`` leaves the gradients scaled until the next non-delayed ``scale_loss``;
    ``delay_overflow_check=True`` unscales but neither updates the scale nor skips (as in Apex).
    ``model`` is accepted for Apex compatibility and unused. Keywords that patched copies of Apex added
    (varuna's ``last_partition``) are a ``TypeError`` saying what to write with Apex's own API.

    Example:
        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:  # doctest: +SKIP
        ...     scaled_loss.backward()
    """
    _refuse_fork_keywords(fork_keywords)
    if not _amp_state.initialized:
        raise RuntimeError(
            "Invoked 'with amp.scale_loss', but internal Amp state has not been initialized. "
            "model, optimizer = amp.initialize(model, optimizer, opt_level=...) must be called before "
            "'with amp.scale_loss'."
        )
    if not _amp_state.opt_properties.enabled:
        yield loss
        return
    scalers = _amp_state.loss_scalers
    if not scalers:  # Apex's IndexError on its empty list, whatever the loss_id: there is no valid one to name
        raise LossIdRangeError(
            f"loss_id={shown(loss_id)}: amp.initialize was called with num_losses=0, so there is no loss scaler to "
            "scale with: pass num_losses=1 or more to the initialize that takes the optimizers"
        )
    # Apex indexed its list of scalers with loss_id: numpy's integers and bools (True: loss 1) index it as well
    if not isinstance(loss_id, numbers.Integral):
        raise TypeError(
            f"loss_id={shown(loss_id)} is {type_of(loss_id)}; loss ids are the integers 0..{len(scalers) - 1} "
            f"(amp.initialize was called with num_losses={len(scalers)})"
        )
    given, loss_id = loss_id, int(loss_id)
    if not 0 <= loss_id < len(scalers):
        raise LossIdRangeError(  # named as written: loss_id=True read "loss_id=1", which the caller never wrote
            f"loss_id={shown(given)}"
            + (f" (index {loss_id})" if type(given) is not int else "")
            + f" is out of range: amp.initialize was called with num_losses={len(scalers)}, so valid loss ids are "
            f"0..{len(scalers) - 1}"
        )
    _check_loss(loss, "amp.scale_loss")
    for name, value in (("delay_unscale", delay_unscale), ("delay_overflow_check", delay_overflow_check)):
        if not is_switch(value):  # by truthiness "False" delayed: an overflow then stepped on inf gradients
            raise ValueError(f"amp.scale_loss: {name}={shown(value)}: expected True or False")
    stashes = [optimizer._amp_stash for optimizer in _optimizer_list(optimizers)]
    scaler = scalers[loss_id]
    unit_static = not scaler.dynamic and scaler.loss_scale() == 1.0
    if unit_static and not _amp_state.opt_properties.master_weights and not any(s.combine_grad for s in stashes):
        yield loss.float()  # nothing to unscale (O0/O3 defaults); flat combine_grad buffers still need the pass
        _clear_cast_cache()
        return
    if any(stash.in_scale_loss for stash in stashes):
        raise RuntimeError(
            "amp.scale_loss inside another amp.scale_loss of the same optimizer: leave the first with-block (which "
            "unscales its backward's gradients) before scaling the next loss"
        )
    # What torch DDP's no_sync left rank-local is averaged before it is stashed. An inf that only another rank had
    # is that rank's overflow, which backed off its scale then: back off here too, before this backward, so that
    # every rank scales it alike, and skip the step as that rank will.
    if _ddp_no_sync.average_local_gradients(stashes):
        scaler.update(True)
        if scaler.dynamic:
            for stash in stashes:
                stash.schedule_skip(loss_id, scaler)
    with _none_left_pending(stashes, unscaling=False):
        for stash in stashes:
            stash.before_backward(delayed=delay_unscale)  # a script's replaced _prepare_amp_backward runs here
            stash.match_pending_scale(scaler.loss_scale())
    for stash in stashes:
        stash.in_scale_loss = True
    try:
        yield loss.float() * scaler.loss_scale()
    finally:
        for stash in stashes:
            stash.in_scale_loss = False
    if delay_unscale:
        _clear_cast_cache()
        return
    # cleared first, as Apex: a script's replaced optimizer._post_amp_backward leaves its verdict in _overflow_buf
    scaler.clear_overflow_state()
    with _casts_disabled(), _none_left_pending(stashes, unscaling=True):  # no O1 casts in amp's own maths
        flags = [stash.after_backward(scaler) for stash in stashes]
    for flag in flags:  # None: a replaced post left its verdict in _overflow_buf itself
        if flag is not None:
            scaler.flag_overflow(flag)  # on the device, as Apex's unscale: only a dynamic update_scale reads it
    # through the attribute, as Apex: a script's replacement (one agreeing the overflow across ranks) decides
    if not delay_overflow_check and scaler.update_scale():
        for stash in stashes:
            stash.schedule_skip(loss_id, scaler)
    _clear_cast_cache()


@contextlib.contextmanager
def _none_left_pending(stashes: list[Any], *, unscaling: bool) -> Iterator[None]:
    """Where preparing (``unscaling=False``) or unscaling one optimizer of a ``scale_loss`` fails, no other is left
    pending: what this block prepared, or the backward's gradients not yet unscaled, are dropped, and ``.grad`` hold
    what they held before (a first optimizer stayed prepared for good, and each later ``scale_loss`` of it was refused
    as nested in this one). An accumulation of ``delay_unscale`` backwards pending before a failed prepare is kept."""
    pending_before = [stash.combiner.pending for stash in stashes]
    try:
        yield
    except BaseException:
        for stash, was_pending in zip(stashes, pending_before, strict=True):
            if stash.combiner.pending and (unscaling or not was_pending):
                stash.drop_backward()
        raise


# Keywords that forks of Apex added to scale_loss, each with what to write instead with Apex's own API.
_FORK_KEYWORDS = {
    "last_partition": (
        "microsoft/varuna's patched Apex (its apex.patch) added it for pipeline stages: with "
        "last_partition=False it yielded the loss unscaled, because the gradient a stage receives from the next one "
        "is already scaled. With Apex's own scale_loss, backpropagate that gradient divided by the scale: "
        "scaled_loss.backward(grad / amp._amp_state.loss_scalers[loss_id].loss_scale()), which gives the same "
        "gradients (exactly, for the power-of-two dynamic scales)"
    ),
}


def _refuse_fork_keywords(keywords: dict[str, Any]) -> None:
    """A keyword Apex's ``scale_loss`` never had is a ``TypeError`` (as in Apex), naming the fork it came from."""
    for name, value in keywords.items():
        known = ", ".join(f"'{p}'" for p in ("loss", "optimizers", "loss_id", "model", "delay_unscale"))
        why = _FORK_KEYWORDS.get(name, "Apex's scale_loss has no such keyword")
        raise TypeError(
            f"amp.scale_loss() got an unexpected keyword argument {shown(name)} ({name}={shown(value)}): {why}. Apex's "
            f"scale_loss takes {known} and 'delay_overflow_check'."
        )


def _clear_cast_cache() -> None:
    """Drop O1's cached weight casts: the weights change at the step that follows (Apex did it here)."""
    if _amp_state.active_handle is not None:
        _amp_state.active_handle._clear_cache()


def _casts_disabled() -> contextlib.AbstractContextManager:
    handle = _amp_state.active_handle
    return handle._disable_casts() if handle is not None else contextlib.nullcontext()


class _OneShotSkip:
    """Replaces ``optimizer.step`` once: the overflowed iteration's step is skipped with a message."""

    def __init__(self, optimizer: Any, message: str) -> None:
        self.optimizer, self.real_step, self.message = optimizer, optimizer.step, message
        optimizer.step = self

    def __call__(self, closure: Any = None) -> None:
        self.optimizer.step = self.real_step
        maybe_print(self.message)


class _LossScaling:
    """One loss's scaler and the combiner that unscales the gradients of one optimizer's parameters."""

    def __init__(self, optimizer: Any, scaler: ApexLossScaler) -> None:
        self.scaler = scaler
        # once each (torch only warns about a parameter listed twice in a group); frozen ones too: unfrozen later,
        # their gradients are unscaled like the others'
        params = {id(p): p for group in optimizer.param_groups for p in group["params"]}.values()
        self.combiner = GradientCombiner([p for p in params if p.is_floating_point()])


class AmpHandle:
    """What ``amp.init()`` returns: O1's casts are active through it until :meth:`_deactivate`.

    ``scale_loss(loss, optimizer)`` scales with the handle's default scaler and unscales that optimizer's
    gradients on exit; ``wrap_optimizer(optimizer, num_loss)`` gives an optimizer with one scaler per loss
    (``with optimizer.scale_loss(loss):``, one per loss, then ``optimizer.step()``). An overflow skips the
    next step and halves that loss's scale, as in Apex's first API.
    """

    def __init__(
        self,
        loss_scale: float | str = "dynamic",
        enable_caching: bool = True,
        verbose: bool = False,
        dtype: torch.dtype = torch.float16,
    ) -> None:
        # amp.init checks these too; a handle built directly stored verbose="no" as its flag
        self._enable_caching = checked_switch("AmpHandle", "enable_caching", enable_caching)
        self._verbose = checked_switch("AmpHandle", "verbose", verbose)
        self._cache: dict[torch.Tensor, torch.Tensor] = {}
        self._default_scaler: ApexLossScaler | None = ApexLossScaler(loss_scale)
        self._scalings: dict[int, _LossScaling] = {}
        self._is_active = True
        self._patches: o1_casts.CastPatches | None = None
        self.dtype = dtype

    def is_active(self) -> bool:
        """Whether O1's casts are on (off after ``_deactivate``, and inside ``disable_casts``)."""
        return self._is_active

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        was_active, self._is_active = self._is_active, False
        try:
            yield
        finally:
            self._is_active = was_active

    def wrap_optimizer(self, optimizer: Any, num_loss: int = 1) -> OptimWrapper:
        """Wrap ``optimizer`` for ``num_loss`` losses; use ``optimizer.scale_loss(loss)`` from then on."""
        self._default_scaler = None
        return OptimWrapper(optimizer, self, num_loss)

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizer: Any) -> Iterator[torch.Tensor]:
        """Yield the scaled loss; on exit unscale ``optimizer``'s new gradients and update the scale."""
        if not self.is_active():
            yield loss
            return
        if self._default_scaler is None:
            raise RuntimeError(
                "After calling `handle.wrap_optimizer()`, you must explicitly use `optimizer.scale_loss(loss)`."
            )
        _check_loss(loss, "handle.scale_loss")
        if not hasattr(optimizer, "param_groups"):  # an optimizer, or a wrapper of one (LARC)
            raise TypeError(
                f"handle.scale_loss expects one optimizer, got {type(optimizer).__name__} (Apex's handle scales one "
                "optimizer per call)"
            )
        scaling = self._scalings.get(id(optimizer))
        if scaling is None:
            scaling = self._scalings[id(optimizer)] = _LossScaling(optimizer, self._default_scaler)
        scaling.combiner.prepare_backward()
        yield loss.float() * scaling.scaler.loss_scale()
        if _unscale(self, scaling):
            _OneShotSkip(optimizer, "Gradient overflow, skipping update")
        self._clear_cache()

    def _clear_cache(self) -> None:
        self._cache.clear()

    @property
    def _all_wrappers(self) -> list[tuple[Any, str, Any]]:
        """Apex's record of the functions O1 replaced: ``(module, name, original)`` for each, oldest first (a
        copy: record more with :meth:`_save_func`); what :meth:`_deactivate` puts back."""
        return self._patches.originals() if self._patches is not None else []

    def _save_func(self, mod: Any, fn: str, func: Any) -> None:
        """Apex's hook for code that patches functions beside amp: ``mod.fn`` was ``func``, and
        :meth:`_deactivate` sets it back."""
        if self._patches is None:
            self._patches = o1_casts.CastPatches()
        self._patches.remember(mod, fn, func)

    def _deactivate(self) -> None:
        """Undo every patch this handle made and stop casting."""
        if self._patches is not None:
            self._patches.restore()
            self._patches = None
        self._is_active = False
        self._cache.clear()

    @property
    def has_cache(self) -> bool:
        """Whether casts of float32 parameters are cached within an iteration (``enable_caching``)."""
        return self._enable_caching

    @property
    def cache(self) -> dict[torch.Tensor, torch.Tensor]:
        """The cached low-precision casts, keyed by the float32 parameter."""
        return self._cache

    def remove_cache(self, param: torch.Tensor) -> None:
        """Forget the cached cast of ``param``."""
        self._cache.pop(param, None)

    @property
    def verbose(self) -> bool:
        """The ``verbose`` flag given to ``amp.init`` (accepted; no per-cast lines are printed)."""
        return self._verbose


def _unscale(handle: AmpHandle | NoOpHandle, scaling: _LossScaling) -> bool:
    """Unscale the gradients of one backward and update its scaler; True when it overflowed (dynamic)."""
    with handle._disable_casts():
        flag = scaling.combiner.combine(scaling.scaler).found_inf
    scaling.scaler.clear_overflow_state()
    scaling.scaler.flag_overflow(flag)
    return scaling.scaler.update_scale()  # as Apex's handle: read only by a dynamic scaler


class NoOpHandle:
    """What ``amp.init(enabled=False)`` returns: nothing is cast or scaled."""

    def is_active(self) -> bool:
        """Always False: nothing is cast."""
        return False

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        yield

    def wrap_optimizer(self, optimizer: Any, num_loss: int = 1) -> OptimWrapper:
        """Wrap ``optimizer`` as the active handle would; its ``scale_loss`` yields the loss unscaled."""
        return OptimWrapper(optimizer, self, num_loss)

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizer: Any) -> Iterator[torch.Tensor]:
        """Yield ``loss`` unchanged: a disabled amp scales nothing."""
        yield loss

    @property
    def has_cache(self) -> bool:
        """Always False: nothing is cast, so nothing is cached."""
        return False

    @property
    def cache(self) -> dict[torch.Tensor, torch.Tensor]:
        """Always empty."""
        return {}

    @property
    def verbose(self) -> bool:
        """Always False."""
        return False

    def _clear_cache(self) -> None:
        pass

    def remove_cache(self, param: torch.Tensor) -> None:
        """Nothing to forget."""
        pass

    def _deactivate(self) -> None:
        pass


class OptimWrapper:
    """An optimizer with one loss scaler per loss (``handle.wrap_optimizer``); other attributes pass through.

    Each ``with optimizer.scale_loss(loss)`` uses the next loss's scaler; ``step()`` starts over at loss 0
    and is skipped when any loss of the iteration overflowed.
    """

    def __init__(self, optimizer: Any, amp_handle: AmpHandle | NoOpHandle, num_loss: int) -> None:
        num_loss = loss_count_option(num_loss, "num_loss")  # as amp.initialize's num_losses: numpy's, and bounded
        self._optimizer = optimizer
        self._amp_handle = amp_handle
        self._num_loss = num_loss
        self._loss_idx = 0
        self._skip_next = [False] * num_loss
        self._loss_scaler = [ApexLossScaler("dynamic") for _ in range(num_loss)]
        self._scalings = [_LossScaling(optimizer, scaler) for scaler in self._loss_scaler]

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor) -> Iterator[torch.Tensor]:
        """Yield ``loss`` times the current loss's scale; on exit unscale the gradients it produced."""
        if not self._amp_handle.is_active():
            yield loss
            return
        if not 0 <= self._loss_idx < self._num_loss:
            raise RuntimeError(
                f"scale_loss called {self._loss_idx + 1} times before step(), but the optimizer was wrapped for "
                f"num_loss={self._num_loss}"
            )
        _check_loss(loss, "optimizer.scale_loss")
        scaling = self._scalings[self._loss_idx]
        scaling.combiner.prepare_backward()
        yield loss.float() * scaling.scaler.loss_scale()
        self._skip_next[self._loss_idx] = _unscale(self._amp_handle, scaling)
        self._loss_idx += 1

    def step(self, closure: Any = None) -> Any:
        if not self._amp_handle.is_active():
            return self._optimizer.step(closure=closure)
        self._loss_idx = 0
        for group in self._optimizer.param_groups:
            for p in group["params"]:
                self._amp_handle.remove_cache(p)
        if closure is not None:
            raise NotImplementedError("The `closure` argument is unsupported by the amp optimizer wrapper.")
        if any(self._skip_next):
            maybe_print("Gradient overflow, skipping update")
            self._skip_next = [False] * self._num_loss
            return None
        return self._optimizer.step()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._optimizer, attr)

    def __repr__(self) -> str:
        return repr(self._optimizer)

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        # without an argument, the wrapped optimizer's own default (Apex's wrapper passed none)
        if set_to_none is None:
            self._optimizer.zero_grad()
        else:
            self._optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._optimizer.add_param_group(param_group)
        self._scalings = [_LossScaling(self._optimizer, scaler) for scaler in self._loss_scaler]


def init(
    enabled: bool = True,
    loss_scale: float | str = "dynamic",
    enable_caching: bool = True,
    verbose: bool = False,
    allow_banned: bool = False,
    patch_type: torch.dtype = torch.float16,
) -> AmpHandle | NoOpHandle:
    """Apex's original entry point: patch torch for O1 casting process-wide and return the handle.

    The casts stay on until ``handle._deactivate()`` (or the next ``amp.init``/``amp.initialize``).
    ``patch_type`` is the low-precision dtype (float16 or bfloat16); ``allow_banned=True`` runs
    ``binary_cross_entropy`` in float32 instead of refusing low-precision inputs.

    Example:
        >>> handle = amp.init()  # doctest: +SKIP
        >>> with handle.scale_loss(loss, optimizer) as scaled_loss:  # doctest: +SKIP
        ...     scaled_loss.backward()
    """
    if patch_type not in o1_casts.LOW_PRECISION:
        raise ValueError(f"patch_type={shown(patch_type)}: expected torch.float16 or torch.bfloat16")
    switches = {"enabled": enabled, "enable_caching": enable_caching, "verbose": verbose, "allow_banned": allow_banned}
    for name, value in switches.items():
        if not is_switch(value):  # bool("False") is True: amp.initialize refuses it too
            raise ValueError(f"{name}={shown(value)}: expected True or False")
    previous = _amp_state.active_handle
    if previous is not None:
        previous._deactivate()
    if not enabled:
        handle: AmpHandle | NoOpHandle = NoOpHandle()
    else:
        handle = AmpHandle(loss_scale, enable_caching, verbose, patch_type)
        handle._patches = o1_casts.install_o1_casts(handle, patch_type, allow_banned, functions.registered_casts())
    _amp_state.active_handle = handle
    if enabled:  # as in Apex, a disabled init's NoOpHandle is not kept as ``_amp_state.handle``
        _amp_state.handle = handle
    return handle
