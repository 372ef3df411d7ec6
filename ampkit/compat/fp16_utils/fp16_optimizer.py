"""Apex's ``FP16_Optimizer`` (its last version): fp32 master weights and a loss scaler around any optimizer.

Dynamic loss scaling is Apex amp's ``LossScaler``: the scale starts at ``2**16``, halves on every overflow
(no floor; ampkit stops at 2**-126, where ``1/scale`` leaves float32), doubles after ``scale_window=2000`` clean
updates and is capped at ``2**24``; ``dynamic_loss_args`` takes that scaler's keyword arguments (``init_scale``,
``scale_factor`` -- accepted and ignored, as in Apex, with a warning unless 2 --, ``scale_window``,
``min_loss_scale``, ``max_loss_scale``).
The scale moves at the end of every :meth:`FP16_Optimizer.update_master_grads` (so on every ``backward``), whose
verdict ``overflow`` makes the next ``step()`` skip without touching anything. The older Apex's
``DynamicLossScaler`` behaviour (``2**32``, window 1000, floor 1, scale updated in ``step``) is gone.

Built on ampkit's engine: :class:`~ampkit.amp.MasterWeights` holds the masters, :class:`~ampkit.amp.GradientCombiner`
unscales each backward's new gradients into the master grads (Apex overwrote the master grads with the
accumulated fp16 grads divided by the current scale, wrong once the scale moved between backwards) and the scaler
is :class:`~ampkit.compat.amp.scaler.ApexLossScaler`. As in Apex, a param frozen when the optimizer is wrapped gets no
master: it stays in its group as it is. Differences from Apex: any device and fp16 or bf16 models; a frozen param
unfrozen later gets its master at the next backward; ``state_dict()`` saves the scaler as a dict and the masters as
one flat list, None for a param without one (``load_state_dict`` also reads Apex's pickled-scaler, per-group form);
no deprecation banner.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ampkit.amp import GradientCombiner, MasterWeights
from ampkit.amp.scaler import float32_scale
from ampkit.compat import amp_c
from ampkit.compat._wrapped_optimizer import PromotedOptimizerAttributes
from ampkit.compat._wrapper_state import require_wrapper_keys
from ampkit.compat.amp._amp_state import maybe_print
from ampkit.compat.amp.scaler import ApexLossScaler, scripts_unscales
from ampkit.compat.fp16_utils._options import checked_options
from ampkit.compat.fp16_utils.fp16util import clip_grad_norm
from ampkit.ops._switches import checked_switch
from ampkit.ops.host_values import host_numbers

# Apex amp LossScaler's keyword arguments, the only keys dynamic_loss_args may hold.
_LOSS_SCALER_ARGS = ("init_scale", "scale_factor", "scale_window", "min_loss_scale", "max_loss_scale")
_MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# How an error names each scaler option: the dynamic_loss_args key the user wrote.
_DYNAMIC_LOSS_ARG_NAMES = {
    "init_scale": "dynamic_loss_args['init_scale']",
    "scale_factor": "dynamic_loss_args['scale_factor']",
    "growth_interval": "dynamic_loss_args['scale_window']",
    "min_scale": "dynamic_loss_args['min_loss_scale']",
    "max_scale": "dynamic_loss_args['max_loss_scale']",
}


def _dynamic_scaler(args: dict[str, Any]) -> ApexLossScaler:
    """Apex's ``LossScaler("dynamic", **dynamic_loss_args)`` (``args``: its checked keys): always halves / doubles
    (``scale_factor`` ignored, with a warning where it is not 2)."""
    scaler = ApexLossScaler("dynamic", **args, option_names=_DYNAMIC_LOSS_ARG_NAMES)
    # Apex starts at init_scale as given, even above max_loss_scale; within float32's range (1e39 skipped ~870 steps)
    scaler._loss_scale = float32_scale(args.get("init_scale", 2.0**16), _DYNAMIC_LOSS_ARG_NAMES["init_scale"])
    return scaler


def _torch_optimizer(optimizer: Any) -> Any:
    """The ``torch.optim.Optimizer`` that owns ``param_groups``: ``optimizer`` or, for a wrapper such as
    ``apex.parallel.LARC``, the optimizer it wraps (``.optim``); MasterWeights needs a real one."""
    inner, seen = optimizer, set()
    while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optim") and id(inner) not in seen:
        seen.add(id(inner))
        inner = inner.optim
    return inner


def _apex_attr(obj: Any, name: str, default: Any = None) -> Any:
    """An attribute of an unpickled Apex scaler (plain ``__dict__`` entries, which a property may shadow)."""
    try:
        return getattr(obj, name)
    except AttributeError:
        return vars(obj).get(name, default)


class FP16_Optimizer(PromotedOptimizerAttributes):
    """Wrap ``init_optimizer`` (built on a half/bf16 model's params) with fp32 masters and loss scaling.

    Use ``optimizer.backward(loss)`` instead of ``loss.backward()``; ``step()`` skips the update when the last
    ``update_master_grads`` saw an overflow (a dynamic scale has already backed off by then).

    Example:
        >>> optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True)
        ... # doctest: +SKIP
    """

    def __init__(
        self,
        init_optimizer: Any,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: Mapping[str, Any] | None = None,
        verbose: bool = True,
    ) -> None:
        # the scale's options before the optimizer is touched: one refused leaves its groups as they were
        self.verbose, self.dynamic_loss_scale, args = checked_options(
            verbose, dynamic_loss_scale, dynamic_loss_args, _LOSS_SCALER_ARGS
        )
        if self.dynamic_loss_scale:
            self.loss_scaler = _dynamic_scaler(args)
        else:  # Apex ignores dynamic_loss_args here
            self.loss_scaler = ApexLossScaler(static_loss_scale, option_names={"loss_scale": "static_loss_scale"})
        self.optimizer = init_optimizer
        for group in init_optimizer.param_groups:
            for param in group["params"]:
                if param.requires_grad and param.dtype not in _MODEL_DTYPES:
                    raise TypeError(
                        f"Wrapped parameters must be float32, float16 or bfloat16 tensors. Received {param.type()}"
                    )
        # As Apex: masters for the params that require a gradient; a frozen one stays in its group as it is (no fp32
        # copy) until it is unfrozen, when the next backward gives it its master.
        self.master_weights = MasterWeights(_torch_optimizer(init_optimizer), frozen_masters=False)
        self._build_groups()
        # As Apex: state made on the fp16 params moved to the masters above; a state_dict round trip recasts it
        # to the masters' fp32 (torch's load_state_dict casts floating state to its param's dtype).
        self.optimizer.load_state_dict(self.optimizer.state_dict())
        self.overflow = False
        self.first_closure_call_this_step = True
        self.clip_grad_norm = clip_grad_norm
        # Apex's handles for copying master weights to the model in one call, which subclasses reuse.
        self.multi_tensor_scale = amp_c.multi_tensor_scale
        device = self.all_fp16_params[0].device if self.all_fp16_params else torch.device("cpu")
        self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int32, device=device)
        # Whether a backward since the last zero_grad overflowed (update_scale's verdict, a script's agreed across
        # ranks included): its inf stays in the accumulated master grads, so (as Apex, which re-checked the
        # accumulated fp16 grads) every later update_master_grads sees it again, with nothing to read.
        self._grads_overflowed = False
        self._stepped = False  # a step or a skip since the last backward: the next one restarts the master grads
        # Each model param's grad as the last update_master_grads left it (the tensor and its version), or None:
        # at the first backward after a step it tells whether the script zeroed it, set it to None, or kept it.
        self._left_grads: list[tuple[torch.Tensor, int] | None] = []
        self._grads_before: list[torch.Tensor | None] = []  # as the pending backward began
        self._low_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pair_up()

    def _pair_up(self) -> None:
        """The gradient combiner over every param, frozen ones too (Apex's lists above hold the trainable ones): one
        unfrozen later has its gradients unscaled into its master and the master copied back, where Apex stepped it
        in fp16 on its scaled gradients. The model keeps its (scaled) fp16 grads after each backward, as Apex's copy
        into the masters left them: scripts log a grad norm over model.parameters() or check that every param got
        one. Rebuilt when a param gets its master after set-up (unfrozen, or given its saved one back)."""
        pairs = list(zip(self.master_weights.model_params, self.master_weights.master_params, strict=True))
        self._combiner = GradientCombiner([p for p, _ in pairs], [m for _, m in pairs], keep_param_grads=True)
        left = {id(p): grads for (p, _), grads in zip(self._low_pairs, self._left_grads, strict=True)}
        self._low_pairs = [(p, m) for p, m in pairs if m is not p]
        self._left_grads = [left.get(id(p)) for p, _ in self._low_pairs]
        self._grads_before = [None] * len(self._low_pairs)

    def _gained_masters(self) -> bool:
        """Whether a param got its master since :meth:`_pair_up` last ran."""
        masters = self.master_weights
        return sum(m is not p for p, m in zip(masters.model_params, masters.master_params, strict=True)) != len(
            self._low_pairs
        )

    def _build_groups(self) -> None:
        """Apex's per-group lists of the trainable params: fp16 (model) / fp32 master pairs, and fp32 params."""
        model_of = {
            id(m): p for p, m in zip(self.master_weights.model_params, self.master_weights.master_params, strict=True)
        }
        self.fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp32_groups: list[list[torch.Tensor]] = []
        for i, group in enumerate(self.optimizer.param_groups):
            self.maybe_print(f"FP16_Optimizer processing param group {i}:")
            fp16, fp32_from_fp16, fp32 = [], [], []
            for master in group["params"]:
                param = model_of[id(master)]
                if not param.requires_grad:
                    continue
                self.maybe_print(f"FP16_Optimizer received {param.type()} with {param.size()}")
                if param is master:
                    fp32.append(param)
                else:
                    fp16.append(param)
                    fp32_from_fp16.append(master)
            self.fp16_groups.append(fp16)
            self.fp32_from_fp16_groups.append(fp32_from_fp16)
            self.fp32_from_fp32_groups.append(fp32)
        self.all_fp16_params = [p for g in self.fp16_groups for p in g]
        self.all_fp32_from_fp16_params = [p for g in self.fp32_from_fp16_groups for p in g]
        self.all_fp32_from_fp32_params = [p for g in self.fp32_from_fp32_groups for p in g]

    def maybe_print(self, msg: str) -> None:
        """Print ``msg`` when ``verbose`` (Apex's set-up messages)."""
        if self.verbose:
            print(msg)

    def __getstate__(self) -> Any:
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __setstate__(self, state: Any) -> None:
        raise RuntimeError("FP16_Optimizer should be deserialized using load_state_dict().")

    def __repr__(self) -> str:
        return f"FP16_Optimizer({self.optimizer!r}, loss_scaler={self.loss_scaler!r})"

    @property
    def loss_scale(self) -> float:
        """The current loss scale; assigning it sets the scaler's scale (Apex's ``_loss_scale``)."""
        return self.loss_scaler.loss_scale()

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.loss_scaler._loss_scale = float32_scale(value, "FP16_Optimizer.loss_scale")  # named as the user wrote it

    def zero_grad(self, set_grads_to_None: bool = False) -> None:
        """Zero the masters' and fp16 params' grads in place (Apex's default) or set them to ``None``.

        ``overflow`` is left as it is (as in Apex); the overflow seen by this iteration's backwards is forgotten.
        """
        set_grads_to_None = checked_switch("FP16_Optimizer.zero_grad", "set_grads_to_None", set_grads_to_None)
        if set_grads_to_None:
            self._combiner.zero_grad()
        elif self._combiner.pending:
            self._combiner.combine(1.0)  # close a backward never unscaled, so the combiner holds no stash
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                self._zero(group["params"], set_grads_to_None)
            self._zero(self.all_fp16_params, set_grads_to_None)
        self._grads_overflowed = False
        self._stepped = False

    @torch.no_grad()
    def _restart_master_grads(self) -> None:
        """At the first backward after a step or a skip, each master grad follows what the script did to its model
        param's grad, as Apex's did (it set the master grads to the model's over the scale at every backward):

        - set to None (``model.zero_grad()`` on torch 2, transformer-xl): the master grad is dropped;
        - zeroed or changed in place (``model.zero_grad(set_to_none=False)``): it is that grad over the scale, so a
          param no backward reaches steps on zeros (momentum and weight decay go on), as under Apex;
        - left as the last backward left it (not zeroed): the master grad is kept, and the new gradients add to it.

        Apex stepped on the master's stale gradient where a param's grad was None; here it is dropped."""
        inv_scale = 1.0 / self.loss_scaler.loss_scale()
        kept: list[torch.Tensor] = []
        for (param, master), left in zip(self._low_pairs, self._left_grads, strict=True):
            grad = param.grad
            if grad is None:
                master.grad = None
            elif left is not None and grad is left[0] and grad._version == left[1]:
                if master.grad is not None:
                    kept.append(master.grad)
            else:
                master.grad = grad.detach().to(master.dtype, copy=True).mul_(inv_scale)
        # the overflow of the last iteration counts again only if its gradients were kept (Apex re-checked them):
        # every kept gradient's check read in one transfer, not one GPU sync each
        if self._grads_overflowed:
            self._grads_overflowed = not all(host_numbers(torch.isfinite(g).all() for g in kept))
        self._stepped = False

    @staticmethod
    def _zero(params: list[torch.Tensor], set_to_none: bool) -> None:
        for p in params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    def backward(self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        """Backward of ``loss.float() * loss_scale``; then (unless told not to) :meth:`update_master_grads`."""
        # by truthiness "False" unscaled after this backward, where the caller meant to accumulate first
        update_master_grads = checked_switch("FP16_Optimizer.backward", "update_master_grads", update_master_grads)
        if not self._combiner.pending:
            if self.master_weights.adopt_unfrozen():  # its fp32 master before its first step
                self._pair_up()
            if self._stepped:
                self._restart_master_grads()
            self._grads_before = [p.grad for p, _ in self._low_pairs]
            self._combiner.prepare_backward()
        (loss.float() * self.loss_scaler.loss_scale()).backward(retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Unscale the grads of the backward(s) since the last call into the fp32 master grads, then update the
        scale: ``overflow`` is True when a dynamic scaler saw inf/nan (this iteration) and backed off."""
        scaler = self.loss_scaler
        scaler.clear_overflow_state()
        if self._combiner.pending:
            if "unscale" in scripts_unscales(scaler):
                self._unscale_through_scaler()
            else:  # the verdict left on the device, as Apex's unscale kernel left it: update_scale reads it once
                scaler.flag_overflow(self._combiner.combine(scaler).found_inf)
            # a param no backward reached keeps the grad it had, as Apex left it (prepare_backward took it away)
            for (param, _), before in zip(self._low_pairs, self._grads_before, strict=True):
                if param.grad is None and before is not None:
                    param.grad = before
            self._grads_before = [None] * len(self._low_pairs)
            self._left_grads = [None if p.grad is None else (p.grad, p.grad._version) for p, _ in self._low_pairs]
        if self._grads_overflowed:  # an earlier backward's inf is still in the gradients: known, nothing to read
            scaler._overflow_buf.fill_(1)
            scaler._has_overflow = True
        # through the attribute, as Apex decided it: a script's update_scale (the overflow agreed across ranks) decides,
        # reading the overflow buffer (one GPU sync a backward); its verdict is what the gradients now hold
        self.overflow = scaler.update_scale()
        self._grads_overflowed = bool(self.overflow)

    @torch.no_grad()
    def _unscale_through_scaler(self) -> None:
        """The backward's gradients unscaled through the scaler's own ``unscale``, a script's (a subclass's or a
        patch: its overflow agreed across ranks, say), called as Apex's last version called it: the fp16 params' new
        gradients onto their masters, then the float32 params' in place, at ``loss_scale()``. Gradients an earlier
        backward of this iteration left are added afterwards (Apex re-unscaled the accumulated fp16 gradients)."""
        scaler = self.loss_scaler
        combiner = self._combiner
        lists: dict[bool, tuple[list[torch.Tensor], list[torch.Tensor]]] = {False: ([], []), True: ([], [])}
        sums: list[tuple[torch.Tensor, torch.Tensor]] = []  # (a gradient, what to add to it once unscaled)
        undo: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # (a float32 param or new master, its .grad before)
        for param, owner, stashed in zip(combiner.params, combiner.grad_owners, combiner.take_stash(), strict=True):
            grad = param.grad
            own = owner is param
            if grad is None:
                if stashed is not None:
                    param.grad = stashed
                continue
            if own:  # unscaled in place, then what was stashed before the backward added
                out = grad
                undo.append((param, stashed))
                if stashed is not None:
                    sums.append((grad, stashed))
            elif owner.grad is None:
                out = owner.grad = torch.empty_like(owner)
                undo.append((owner, None))
            else:  # the master's gradient from an earlier backward of this iteration
                out = torch.empty_like(owner)
                sums.append((owner.grad, out))
            lists[own][0].append(grad)
            lists[own][1].append(out)
        try:
            for own in (False, True):  # Apex's order: the fp16 params onto their masters, then the float32 params
                model_grads, master_grads = lists[own]
                if model_grads:
                    scaler.unscale(model_grads, master_grads, scaler.loss_scale())
        except BaseException:
            # the backward dropped, as the combiner drops one (take_stash ended it): no float32 gradient left at the
            # loss scale, nor a new master's unwritten; a master's earlier gradient is untouched until the sums
            for tensor, before in undo:
                tensor.grad = before
            raise
        for total, part in sums:
            total.add_(part)

    def inspect_master_grad_data(self) -> list[list[torch.Tensor | None]] | None:
        """The fp32 master grads per param group (``None`` for a param without one); ``None`` while ``overflow``."""
        if self.overflow:
            print(
                "Warning:  calling FP16_Optimizer.inspect_master_grad_data while in an overflow state.  "
                "Gradients are currently invalid (may be inf, nan, or stale).  Returning None."
            )
            return None
        return [
            [None if p.grad is None else p.grad.data for p in group["params"]] for group in self.optimizer.param_groups
        ]

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> torch.Tensor | int:
        """Clip the fp32 master grads; returns their total norm (a tensor), or -1 while ``overflow``."""
        if self.overflow:
            return -1
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return self.clip_grad_norm(params, max_norm, norm_type)

    @torch.no_grad()
    def _master_params_to_model_params(self) -> None:
        # the trainable ones now: a frozen param keeps its own values (a user may set them by hand)
        pairs = [(p, m) for p, m in self._low_pairs if p.requires_grad]
        if pairs:
            torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the wrapped optimizer on the masters and copy them into the model; after an overflow, only
        report the skip (the scale already backed off in ``update_master_grads``) and return ``None``."""
        if self.overflow:
            maybe_print(f"Gradient overflow.  Skipping step, reducing loss scale to {self.loss_scaler.loss_scale()}")
            self._stepped = True
            return None
        if closure is not None:
            result = self._step_with_closure(closure)
        else:
            result = self.optimizer.step()
        self._master_params_to_model_params()
        self._stepped = True
        return result

    def _step_with_closure(self, closure: Callable[[], Any]) -> Any:
        """Apex's closure step: the closure (which zeroes grads and calls :meth:`backward`) reruns while
        ``overflow``; the model gets the masters before each later call the optimizer makes."""

        def wrapped_closure() -> Any:
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:
                self._master_params_to_model_params()
            loss = closure()
            while self.overflow:
                print(f"OVERFLOW within closure! Skipping step, reducing loss scale to {self.loss_scaler.loss_scale()}")
                loss = closure()
            return loss

        result = self.optimizer.step(wrapped_closure)
        self.first_closure_call_this_step = True
        return result

    def state_dict(self) -> dict[str, Any]:
        """Scaler (as a dict), flags, the wrapped optimizer's state and the fp32 masters (Apex's keys)."""
        return {
            "loss_scaler": self.loss_scaler.state_dict(),
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": self.master_weights.state_dict()["master_params"],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` (or Apex's) saved; the masters are copied into the model too."""
        require_wrapper_keys(
            state_dict,
            ("loss_scaler", "overflow", "first_closure_call_this_step", "optimizer_state_dict", "fp32_from_fp16"),
        )
        scaler = state_dict["loss_scaler"]
        if isinstance(scaler, Mapping):
            self.loss_scaler.load_state_dict(scaler)
        else:
            self._load_apex_scaler(scaler)
            self.dynamic_loss_scale = bool(state_dict["dynamic_loss_scale"])
        self.overflow = state_dict["overflow"]
        self.first_closure_call_this_step = state_dict["first_closure_call_this_step"]
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        saved = state_dict["fp32_from_fp16"]
        if any(isinstance(s, (list, tuple)) for s in saved):
            self._load_apex_masters(saved)
            return
        self.master_weights.load_state_dict({"master_params": saved})
        if self._gained_masters():
            # a frozen param that trained before it was frozen got its saved master back: its state onto it, in fp32
            self._pair_up()
            self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])

    def _load_apex_scaler(self, scaler: Any) -> None:
        """Take the settings and state of Apex's pickled ``LossScaler`` (Apex replaced its scaler by it)."""
        self.loss_scaler.load_state_dict(
            {"loss_scale": _apex_attr(scaler, "_loss_scale"), "unskipped": _apex_attr(scaler, "_unskipped")}
        )
        self.loss_scaler.dynamic = bool(_apex_attr(scaler, "dynamic", self.loss_scaler.dynamic))
        window = _apex_attr(scaler, "_scale_seq_len")
        if window is not None:
            self.loss_scaler._scale_seq_len = window
        self.loss_scaler._min_loss_scale = _apex_attr(scaler, "_min_loss_scale")
        self.loss_scaler._max_loss_scale = _apex_attr(scaler, "_max_loss_scale", self.loss_scaler.max_scale)

    @torch.no_grad()
    def _load_apex_masters(self, saved: list[list[torch.Tensor]]) -> None:
        """Copy Apex's per-group master lists into :attr:`fp32_from_fp16_groups`, then into the model."""
        if [len(g) for g in saved] != [len(g) for g in self.fp32_from_fp16_groups]:
            raise ValueError(
                f"checkpoint holds master groups of sizes {[len(g) for g in saved]}, the optimizer has "
                f"{[len(g) for g in self.fp32_from_fp16_groups]}"
            )
        for current_group, saved_group in zip(self.fp32_from_fp16_groups, saved, strict=True):
            for current, value in zip(current_group, saved_group, strict=True):
                if value.shape != current.shape:
                    raise ValueError(f"saved master of shape {tuple(value.shape)}, expected {tuple(current.shape)}")
                current.copy_(value)
        self._master_params_to_model_params()
