"""Per-optimizer bookkeeping of the Apex API (``optimizer._amp_stash``), built on the engine.

``amp.initialize`` attaches an :class:`AmpOptimizerStash` to each optimizer: a
:class:`~ampkit.amp.GradientCombiner` over the parameters it updates (with fp32 masters from
:class:`~ampkit.amp.MasterWeights` under O2), and instance-level patches of ``step`` / ``zero_grad`` /
``add_param_group`` / ``state_dict`` / ``load_state_dict`` that keep masters, model and combiner in step.
"""

from __future__ import annotations

import types
import warnings
from itertools import chain
from typing import Any

import torch

from ampkit.amp import GradientCombiner, LossScaler, MasterWeights, OptLevelProperties
from ampkit.amp.grad_combine import CombineResult
from ampkit.amp.trainable import any_requires_grad
from ampkit.compat import amp_c
from ampkit.compat.amp._amp_state import maybe_print
from ampkit.compat.amp._param_lists import MasterGroups, params_of_dtype
from ampkit.compat.amp.functions import disable_casts
from ampkit.compat.amp.scaler import scripts_unscales

_MASTER_STATE_KEY = "ampkit_master_weights"


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` behind a wrapper such as LARC (``.optim``), or the optimizer itself."""
    inner = getattr(optimizer, "optim", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(
            f"expected a torch.optim.Optimizer (or apex.parallel.LARC around one), got {type(optimizer).__name__}"
        )
    return inner


class AmpOptimizerStash:
    """Everything amp keeps about one optimizer: masters, the gradient combiner, the pending skip."""

    def __init__(
        self,
        optimizer: Any,
        properties: OptLevelProperties,
        combine_grad: bool,
        fp32_values: dict[int, torch.Tensor] | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.combine_grad = combine_grad
        self.already_patched = False
        self.in_scale_loss = False  # inside an amp.scale_loss block of this optimizer (they do not nest)
        self.pending_scale: float | None = None  # the loss scale of gradients a delayed unscale left in .grad
        self.lazy_init_called = False  # Apex's flag: set by the first backward (or _amp_lazy_init)
        self._lazy_take_over = True  # what amp's own _amp_lazy_init does, called from a script's replacement of it
        # Apex's O2 rule: masters for the parameters that require a gradient; a frozen one stays in its group as it is
        # until it is unfrozen (see prepare_backward)
        self.master_weights = (
            MasterWeights(inner_optimizer(optimizer), frozen_masters=False) if properties.master_weights else None
        )
        if self.master_weights is not None and fp32_values:
            self._seed_masters(fp32_values)
        self._masters_checked = self.master_weights is None
        # Apex's amp_C handles on the stash, for a script's copy of Apex's ``_master_params_to_model_params``
        # (``multi_tensor_applier(stash.multi_tensor_scale, stash.dummy_overflow_buf, [masters, model], 1.0)``). amp's
        # own copy is ``copy_``: the same values (round to nearest, inf where a master is past fp16's range); Apex's
        # kernel also raised the dummy buffer on an inf/nan master, which nothing read.
        self.multi_tensor_scale = amp_c.multi_tensor_scale
        self.multi_tensor_l2norm = amp_c.multi_tensor_l2norm
        first = next((p for group in optimizer.param_groups for p in group["params"]), None)
        self.dummy_overflow_buf = torch.zeros(1, dtype=torch.int32, device=None if first is None else first.device)
        self._kept_model_grads: list[torch.Tensor] = []  # see _masters_with_model_grads
        self.combiner = self._build_combiner()
        self._patch_methods()

    @torch.no_grad()
    def _seed_masters(self, fp32_values: dict[int, torch.Tensor]) -> None:
        """Start the masters from the weights as they were before the model cast (not from their rounding)."""
        for param, master in zip(self.master_weights.model_params, self.master_weights.master_params, strict=True):
            original = fp32_values.get(id(param))
            if master is not param and original is not None:
                master.copy_(original)

    # Apex's lists of its lazy init (``_param_lists``): under O2 per param group and flat, under O1/O3 by dtype.
    # Each exists only where Apex's did, so ``hasattr(stash, "fp16_groups")`` tells weight-averaging code which case.
    @property
    def fp16_groups(self) -> list[list[torch.Tensor]]:
        """Apex's O2 list, per param group: the low-precision model parameters that have a float32 master."""
        return self._master_groups().fp16

    @property
    def fp32_from_fp16_groups(self) -> list[list[torch.Tensor]]:
        """Apex's O2 list, per param group: the float32 masters of :attr:`fp16_groups`, in the same order."""
        return self._master_groups().fp32_from_fp16

    @property
    def fp32_from_fp32_groups(self) -> list[list[torch.Tensor]]:
        """Apex's O2 list, per param group: the parameters that were float32 already (batch norm's)."""
        return self._master_groups().fp32_from_fp32

    @property
    def all_fp16_params(self) -> list[torch.Tensor]:
        """The low-precision model parameters: under O2 those with a float32 master (``fp16_groups`` flattened)."""
        if self.master_weights is None:
            return params_of_dtype(inner_optimizer(self.optimizer), low=True)
        return [p for group in self.fp16_groups for p in group]

    @property
    def all_fp32_from_fp16_params(self) -> list[torch.Tensor]:
        """Apex's O2 list: the float32 masters of those parameters (NVIDIA's BERT clears their grads after an
        overflow it detected by hand). Absent without masters, as in Apex (see :meth:`_o2_only`)."""
        self._o2_only("all_fp32_from_fp16_params")
        return [p for group in self.fp32_from_fp16_groups for p in group]

    @property
    def all_fp32_from_fp32_params(self) -> list[torch.Tensor]:
        """Apex's O2 list: the parameters that were float32 already, their own masters. Absent without masters."""
        self._o2_only("all_fp32_from_fp32_params")
        return [p for group in self.fp32_from_fp32_groups for p in group]

    # Apex's stashes of gradients from before a backward, which a replaced ``_post_amp_backward`` hands to
    # ``_process_optimizer.post_backward_models_are_masters`` with their parameters: all None here, since amp keeps
    # that stash itself and adds it back after the replacement returns.
    @property
    def all_fp32_from_fp32_grad_stash(self) -> list[None]:
        """Apex's O2 stash for :attr:`all_fp32_from_fp32_params` (all None: amp keeps the stash)."""
        return [None] * len(self.all_fp32_from_fp32_params)

    @property
    def all_fp16_grad_stash(self) -> list[None]:
        """Apex's stash for :attr:`all_fp16_params` (all None: amp keeps the stash)."""
        return [None] * len(self.all_fp16_params)

    @property
    def all_fp32_grad_stash(self) -> list[None]:
        """Apex's O1/O3 stash for :attr:`all_fp32_params` (all None: amp keeps the stash)."""
        return [None] * len(self.all_fp32_params)

    def _o2_only(self, name: str) -> None:
        """Refuse an O2 list without masters, as Apex's missing attribute did: an empty list read there made a
        hand-written ``zero_grad`` over ``all_fp16_params + all_fp32_from_fp32_params`` clear no O1 gradient."""
        if self.master_weights is None:
            raise AttributeError(
                f"_amp_stash.{name} is Apex's list with master weights (O2) only; without masters (O1/O3) "
                "the optimizer's parameters are in _amp_stash.all_fp16_params and all_fp32_params"
            )

    @property
    def all_fp32_params(self) -> list[torch.Tensor]:
        """Apex's O1/O3 list: the optimizer's float32 parameters (under O2 Apex had none by this name)."""
        if self.master_weights is not None:
            raise AttributeError("_amp_stash.all_fp32_params is Apex's list without master weights (O1/O3)")
        return params_of_dtype(inner_optimizer(self.optimizer), low=False)

    def _master_groups(self) -> MasterGroups:
        if self.master_weights is None:
            raise AttributeError("Apex's per-group lists (fp16_groups, ...) exist with master weights (O2) only")
        return MasterGroups(self.master_weights)

    def masters_by_param(self) -> dict[int, torch.Tensor]:
        """``id(model parameter) -> float32 master`` for the parameters that have a separate master."""
        if self.master_weights is None:
            return {}
        pairs = zip(self.master_weights.model_params, self.master_weights.master_params, strict=True)
        return {id(param): master for param, master in pairs if master is not param}

    @property
    def params_have_scaled_gradients(self) -> bool:
        """True while gradients of a ``delay_unscale`` backward are still scaled (Apex's flag)."""
        return self.combiner.pending

    @params_have_scaled_gradients.setter
    def params_have_scaled_gradients(self, value: bool) -> None:
        # Code that copied Apex's scale_loss sets the flag itself: True after a delay_unscale backward (which
        # ran without _prepare_amp_backward), False after _post_amp_backward. Here the combiner keeps it.
        if value and not self.combiner.pending:
            self.combiner.adopt_scaled_grads()
        elif not value and self.combiner.pending:
            raise RuntimeError(
                "_amp_stash.params_have_scaled_gradients = False while gradients are still scaled; call "
                "optimizer._post_amp_backward(loss_scaler) first to unscale them"
            )

    def _build_combiner(self) -> GradientCombiner:
        if self.master_weights is not None:
            pairs = zip(self.master_weights.model_params, self.master_weights.master_params, strict=True)
        else:
            params = (p for group in self.optimizer.param_groups for p in group["params"])
            pairs = ((p, p) for p in params)
        model, owners = [], []
        seen: set[int] = set()
        self._combined_ids = seen  # every float param considered, frozen ones included (see _params_swapped_in)
        # A parameter frozen now (requires_grad=False) is combined too: unfrozen later (staged fine-tuning, yolov3's
        # --freeze-layers), its gradients are unscaled like the others', as in Apex's O1, whose lists held every
        # parameter. Flat buffers (combine_grad) take only trainable ones; prepare_backward rebuilds them on unfreezing.
        self._frozen_outside: list[torch.Tensor] = []
        for param, owner in pairs:
            if not param.is_floating_point() or id(param) in seen:
                continue
            seen.add(id(param))
            if self.combine_grad and not param.requires_grad:
                self._frozen_outside.append(param)
                continue
            model.append(param)
            owners.append(owner)
        # The model's fp16 params keep their scaled gradients after each backward, as in Apex: scripts read them
        # between backward and step (grad-norm logging, fairseq-style "did every param get a gradient" checks).
        return GradientCombiner(model, owners, flat=self.combine_grad, keep_param_grads=True)

    @torch.no_grad()
    def _adopt_model_changes(self) -> None:
        """Before the first backward, take over weights loaded into the model after ``initialize`` (a
        pretrained checkpoint): Apex built its masters at this point, so loading then training worked."""
        self._masters_checked = True
        for param, master in zip(self.master_weights.model_params, self.master_weights.master_params, strict=True):
            if master is not param and not torch.equal(master.to(param.dtype), param):
                master.copy_(param)

    def lazy_init(self, take_over: bool = True) -> None:
        """Apex's ``self._amp_lazy_init()`` (before and after each backward, O2 zero_grad): called through the
        attribute where a script replaced it, so the replacement runs where Apex's did; its call of amp's own keeps
        ``take_over`` (see :meth:`own_lazy_init`)."""
        if not self.replaced("_amp_lazy_init"):
            self.own_lazy_init(take_over)
            return
        self._lazy_take_over = take_over
        try:
            self.optimizer._amp_lazy_init()
        finally:
            self._lazy_take_over = True

    def own_lazy_init(self, take_over: bool = True) -> None:
        """amp's own ``_amp_lazy_init``: the first time, call the optimizer's ``_lazy_init_maybe_master_weights``
        through the attribute, as Apex did, so a script's wrapper of it runs (a Lightning fork reloads its deferred
        checkpoint there); every time where ``take_over``, take over weights loaded since (a zero_grad leaves that to
        the backward: a resume may load the model after it)."""
        if not self.lazy_init_called:
            self.optimizer._lazy_init_maybe_master_weights()
            self.lazy_init_called = True
        if take_over:
            self.take_over_model_weights()

    def take_over_model_weights(self) -> None:
        """ampkit's ``_lazy_init_maybe_master_weights``: the masters take over weights loaded into the model since
        ``initialize`` or a checkpoint without masters (Apex built its masters from the model here)."""
        if not self._masters_checked:
            self._adopt_model_changes()

    def prepare_backward(self, delayed: bool = False) -> None:
        """Stash existing gradients before a scaled backward (no-op while a delayed unscale is pending).

        ``delayed``: the backward is a ``delay_unscale`` one, which starts an accumulation."""
        self.lazy_init()
        if not self.combiner.pending:
            self._kept_model_grads = self._masters_with_model_grads() if delayed else []
            # Unfrozen since the flat buffers or the masters were built, or assigned into a group since the combiner
            # was built. An unfrozen O2 parameter gets its master now (Apex never gave it one: it stepped in fp16 on
            # gradients left at the loss scale).
            unfrozen_low = self.master_weights is not None and self.master_weights.adopt_unfrozen()
            if unfrozen_low or any_requires_grad(self._frozen_outside) or self._params_swapped_in():
                self.combiner.remove()
                self.combiner = self._build_combiner()
            self.combiner.prepare_backward()

    def _params_swapped_in(self) -> bool:
        """Whether a group holds a parameter the combiner never saw: a partial-FC classifier assigns a fresh weight into
        ``param_groups[-1]["params"]`` before each backward (and, for Apex, into ``_amp_stash.all_fp32_params``,
        whose parameters Apex's O1 unscaled). Without masters only; under O2 the groups hold the masters."""
        if self.master_weights is not None:
            return False
        known = self._combined_ids
        groups = self.optimizer.param_groups
        if known.issuperset(map(id, chain.from_iterable(group["params"] for group in groups))):
            return False  # the common case, asked in C at each backward: ~3x faster than a Python loop per param
        params = [p for group in groups for p in group["params"]]
        if any(id(p) not in known for p in params if p.is_floating_point()):
            return True
        known.update(id(p) for p in params)  # a non-float tensor (a step counter) is not the combiner's: noted once
        return False

    def match_pending_scale(self, scale: float) -> None:
        """Before a backward at ``scale``: gradients a delayed unscale left at another loss's scale are brought to
        this one, so that the sum unscales right. Apex unscaled the sum by the last scale alone, which shrank or
        grew the delayed part whenever the scalers of a mixed accumulation differed."""
        previous = self.pending_scale
        if self.combiner.pending and previous is not None and previous != scale:
            if not self.combiner.rescale_pending(scale / previous):
                warnings.warn(
                    f"gradients left scaled by delay_unscale at loss scale {previous} are unscaled by this loss's "
                    f"{scale} (as Apex did): with combine_grad=True they cannot be rescaled first",
                    stacklevel=4,
                )
        self.pending_scale = scale

    def combine(self, scaler: LossScaler) -> CombineResult:
        """Unscale the new gradients by ``scaler`` and add the stash (after the lazy init, as Apex's unscale ran it)."""
        self.lazy_init()
        self.pending_scale = None
        result = self.combiner.combine(scaler)
        self._settle_kept_model_grads()
        return result

    def _settle_kept_model_grads(self) -> None:
        for master in self._kept_model_grads:
            if master.grad is None:
                master.grad = torch.zeros_like(master)
        self._kept_model_grads = []

    def replaced(self, name: str) -> bool:
        """Whether a script replaced amp's ``optimizer.<name>`` (one of Apex's per-optimizer methods), so that
        ``scale_loss`` calls the replacement, as Apex called them through the attribute."""
        return getattr(getattr(self.optimizer, name, None), "__func__", None) is not self._own_methods[name]

    def before_backward(self, delayed: bool) -> None:
        """``scale_loss``'s step before its backward: amp's own prepare, or a script's ``_prepare_amp_backward``
        called where Apex called it (not for a ``delay_unscale`` backward, nor while one is pending). Gradients
        that no prepare stashed count as this backward's, as under Apex: a no-op replacement lets gradients that
        a model's forward backpropagated at the loss scale be unscaled (and checked) with the loss's."""
        if not self.replaced("_prepare_amp_backward"):
            self.prepare_backward(delayed=delayed)
            return
        if not delayed and not self.combiner.pending:
            self.optimizer._prepare_amp_backward()
        if not self.combiner.pending:
            self._refuse_flat_without_own("_prepare_amp_backward", "prepared")
            self.lazy_init()
            self.combiner.adopt_scaled_grads()

    def after_backward(self, scaler: LossScaler) -> torch.Tensor | None:
        """``scale_loss``'s unscale after its backward: amp's own (its unsynced found_inf flag returned), or a
        script's ``_post_amp_backward(scaler)`` called as Apex called it (None returned: its verdict is in the
        scaler's ``_overflow_buf``). A replacement that unscaled by itself, without amp's own, gets the gradients
        stashed before the backward added back to what it left, as Apex's stash of them was."""
        if not self.replaced("_post_amp_backward"):
            return self.unscale_backward(scaler)
        self.optimizer._post_amp_backward(scaler)
        if self.combiner.pending:
            if self.combine_grad:  # known only now that it returned: scale_loss drops the backward's gradients
                self._refuse_flat_without_own(
                    "_post_amp_backward",
                    "unscaled",
                    ". The backward ran: its gradients (and those of the delay_unscale backwards before it) were "
                    "dropped from this optimizer's parameters, whose .grad hold what they held before them, "
                    "unscaled, and the loss scale was not updated; run them again",
                )
            self.pending_scale = None
            self.combiner.release()
            self._settle_kept_model_grads()
        return None

    def unscale_backward(self, scaler: Any) -> torch.Tensor | None:
        """amp's own post-backward: the backward's gradients unscaled onto the stash by amp (its unsynced found_inf flag
        returned), or through the scaler's ``unscale`` methods where they are a script's (None: the verdict is in the
        scaler, as Apex's methods left it)."""
        if scripts_unscales(scaler):
            self._unscale_through(scaler)
            return None
        return self.combine(scaler).found_inf

    def _unscale_through(self, scaler: Any) -> None:
        """Apex's post-backward, through ``scaler.unscale`` and ``scaler.unscale_with_stashed`` as Apex called them
        (for a script's subclass or patch of them: ColossalAI's benchmark all-reduces the overflow flag there, across
        its model-parallel ranks): new gradients of parameters with a float32 master, then those that are their own
        masters (the low-precision ones first, as Apex's O1 went by type), each first onto nothing stashed, then onto
        the stash. The verdict is left in the scaler. Where a method raises, the backward is dropped as amp's own
        route drops one it cannot unscale: no ``.grad`` is left at the loss scale, nor a new master's unwritten (a
        master's earlier gradient that the script's ``unscale_with_stashed`` already added to stays so)."""
        if self.combine_grad:  # known before the backward's gradients are touched: scale_loss gives them back
            raise RuntimeError(
                f"{type(scaler).__name__}.unscale or unscale_with_stashed is the script's own, but with "
                "combine_grad=True the flat gradient buffers are unscaled by amp's own only; initialize without "
                "combine_grad, or leave the scaler's unscale methods as they are"
            )
        self.lazy_init()
        self.pending_scale = None
        combiner = self.combiner
        stashes = combiner.take_stash()
        # Apex's order: the masters of low-precision params, then params that are their own masters, low-precision
        # ones before float32 ones
        lists: dict[tuple[bool, bool], tuple[list[torch.Tensor], ...]] = {
            kind: ([], [], [], [], []) for kind in ((False, False), (True, False), (True, True))
        }
        undo: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # (a tensor, its .grad had the backward not been)
        for param, owner, stashed in zip(combiner.params, combiner.grad_owners, stashes, strict=True):
            grad = param.grad
            if grad is None:
                if stashed is not None:
                    param.grad = stashed
                continue
            own = owner is param
            undo.append((param, stashed))
            new_in, new_out, with_in, with_stash, with_out = lists[own, own and param.dtype == torch.float32]
            before = stashed if own else owner.grad
            if before is None:
                out = grad if own else torch.empty_like(owner)
                if not own:
                    owner.grad = out
                    undo.append((owner, None))
                new_in.append(grad)
                new_out.append(out)
            else:
                with_in.append(grad)
                with_stash.append(before)
                with_out.append(grad if own else before)
        try:
            for (own, _), (new_in, new_out, with_in, with_stash, with_out) in lists.items():
                if new_in:
                    scaler.unscale(new_in, new_out, scaler.loss_scale(), models_are_masters=own)
                if with_in:
                    scaler.unscale_with_stashed(with_in, with_stash, with_out)
        except BaseException:
            for tensor, grad in undo:  # take_stash ended what scale_loss's guard would have dropped
                tensor.grad = grad
            self._kept_model_grads = []
            raise
        self._settle_kept_model_grads()

    def drop_backward(self) -> None:
        """Drop the gradients of a prepared backward that cannot be unscaled: ``.grad`` are back as they were before
        it, nothing stays pending (a step or the next ``scale_loss`` would otherwise take them still scaled)."""
        self.combiner.drop_pending()
        self.pending_scale = None
        self._kept_model_grads = []

    def _refuse_flat_without_own(self, name: str, done: str, state: str = "") -> None:
        """combine_grad's flat buffers know only what amp's own methods did: a replacement that skips them is an error
        naming it (the combiner said only that flat buffers need prepare_backward), and ``state`` says what became of
        the gradients."""
        if self.combine_grad:
            method = getattr(self.optimizer, name)
            raise RuntimeError(
                f"optimizer.{name} was replaced by {getattr(method, '__qualname__', type(method).__name__)}, which "
                "did not call amp's own: "
                f"with combine_grad=True the flat gradient buffers are {done} by amp's own method only; call the "
                "original from the replacement, or initialize without combine_grad" + state
            )

    def _masters_with_model_grads(self) -> list[torch.Tensor]:
        """The masters whose model parameter holds a gradient (zeroed in place by Apex's O2 ``zero_grad``) as a
        ``delay_unscale`` accumulation starts. Apex left those gradients in place for the accumulation, so a
        parameter none of its backwards reached still got a zero master gradient and was stepped (its momentum and
        weight decay went on); a backward without ``delay_unscale`` set them to None first, and it was not."""
        if self.master_weights is None or self.combine_grad:
            return []
        pairs = zip(self.master_weights.model_params, self.master_weights.master_params, strict=True)
        return [master for param, master in pairs if master is not param and param.grad is not None]

    def clear_master_grads(self) -> None:
        """Drop the fp32 master gradients (Apex did after every step and skip; the model grads stay)."""
        if self.master_weights is None:
            return
        for param, master in zip(self.master_weights.model_params, self.master_weights.master_params, strict=True):
            if master is not param:
                master.grad = None

    def schedule_skip(self, loss_id: int, scaler: LossScaler) -> None:
        """Replace the next ``optimizer.step()`` by a one-shot skip that prints Apex's overflow message and, as
        Apex's did, drops the skipped gradients' masters and the scale an Apex FusedSGD recorded for them."""
        if self.already_patched:
            return
        optimizer = self.optimizer
        real_step = optimizer.step

        def skip_step(closure: Any = None) -> None:
            if closure is not None:
                raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
            maybe_print(
                f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale to {scaler.loss_scale()}"
            )
            self.clear_master_grads()
            if hasattr(optimizer, "most_recent_scale"):
                # Apex's FusedSGD (materialize_master_grads=False) recorded the scale its gradients were left at
                # for its step to divide by; the skip drops those gradients, and with them the record, as Apex did
                optimizer.most_recent_scale = 1.0
                optimizer.scale_set_by_backward = False
            optimizer.step = real_step
            self.already_patched = False

        optimizer.step = skip_step
        self.already_patched = True

    def _patch_methods(self) -> None:
        optimizer, stash = self.optimizer, self
        original_step = optimizer.step
        original_zero_grad = optimizer.zero_grad
        original_add_param_group = optimizer.add_param_group
        original_state_dict = optimizer.state_dict
        original_load_state_dict = optimizer.load_state_dict

        def step(self: Any, closure: Any = None) -> Any:
            if closure is not None:
                raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
            if stash.combiner.pending and stash.in_scale_loss:  # a step indented into the with-block
                raise RuntimeError(
                    "optimizer.step() inside the `with amp.scale_loss(...)` block: the gradients are still multiplied "
                    "by the loss scale until the block exits and unscales them; call step() after the with-block"
                )
            if stash.combiner.pending:  # Apex stepped on the scaled gradients (inf-sized steps) or, at O2, on none
                raise RuntimeError(
                    "optimizer.step() right after amp.scale_loss(..., delay_unscale=True): the gradients are still "
                    "multiplied by the loss scale and not unscaled onto what the optimizer steps; end the "
                    "accumulation with a scale_loss without delay_unscale, then step"
                )
            stash.own_lazy_init()  # a first step without a scaled backward still sets it up (Apex's never called it)
            with disable_casts():  # O1's casts are for the model's maths: an optimizer's own matmuls stay float32
                result = original_step()
            if stash.master_weights is not None:
                self._master_params_to_model_params()  # through the attribute, as Apex's O2 step called it
                stash.clear_master_grads()
            return result

        def zero_grad(self: Any, set_to_none: bool | None = None) -> None:
            # Inside a scale_loss block (NeMo zeroes the gradients there on a nan loss and `continue`s) the block's
            # exit still unscales, as Apex's did: the backward it prepared stays prepared, with nothing stashed.
            keep_pending = stash.in_scale_loss
            if stash.master_weights is not None:
                # Apex's O2 zero_grad ran the lazy init (its first call only): masters read from param_groups after
                # a zero_grad before the first backward hold the weights loaded into the model since initialize
                stash.lazy_init(take_over=False)
            if stash.master_weights is not None and set_to_none is None:
                # Apex's O2 zero_grad (it took no argument): the model's gradients zeroed in place, so code reading
                # them after zero_grad (p.grad.zero_(), a norm) finds tensors, and the fp32 masters' set to None
                stash.combiner.zero_grad(False, owners_to_none=True, keep_pending=keep_pending)
            elif stash.master_weights is not None or stash.combine_grad:
                to_none = True if set_to_none is None else bool(set_to_none)
                stash.combiner.zero_grad(to_none, keep_pending=keep_pending)
            elif set_to_none is None:
                original_zero_grad()
            else:
                original_zero_grad(set_to_none=set_to_none)

        def add_param_group(self: Any, param_group: dict[str, Any]) -> None:
            # Apex took the new parameters in mid-backward, counting whatever gradient they held as this backward's;
            # here the stash of gradients still scaled is rebuilt around the new group, so it is refused until then.
            if stash.combiner.pending and stash.in_scale_loss:
                raise RuntimeError(
                    "add_param_group() inside the `with amp.scale_loss(...)` block: the gradients are still "
                    "multiplied by the loss scale until the block exits and unscales them; add the group before the "
                    "block or after it"
                )
            if stash.combiner.pending:
                raise RuntimeError(
                    "add_param_group() right after amp.scale_loss(..., delay_unscale=True): the gradients are still "
                    "multiplied by the loss scale; end the accumulation with a scale_loss without delay_unscale (and "
                    "step), then add the group"
                )
            if not stash.lazy_init_called:  # Apex's ran the lazy init first, inline: not through _amp_lazy_init
                self._lazy_init_maybe_master_weights()
                stash.lazy_init_called = True
            if stash.master_weights is not None and isinstance(param_group, dict):
                params = param_group.get("params")
                if isinstance(params, torch.Tensor) or (params is not None and not isinstance(params, set)):
                    # the caller's dict, as torch and Apex keep it: it is the group (its later lr is the step's)
                    param_group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
                    stash.master_weights.check_new_params(param_group["params"])
            original_add_param_group(param_group)
            if stash.master_weights is not None:
                stash.master_weights.refresh()
            stash.combiner.remove()
            stash.combiner = stash._build_combiner()

        def state_dict(self: Any) -> dict[str, Any]:
            state = original_state_dict()
            if stash.master_weights is not None:
                state[_MASTER_STATE_KEY] = stash.master_weights.state_dict()
            return state

        def load_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
            state_dict = dict(state_dict)
            masters = state_dict.pop(_MASTER_STATE_KEY, None)
            original_load_state_dict(state_dict)
            if stash.master_weights is not None and masters is not None:
                stash.master_weights.load_state_dict(masters)
                stash._masters_checked = True  # the checkpoint's masters are the truth, the model follows them
            elif stash.master_weights is not None:
                # A checkpoint without masters (Apex's, torch's): they come from the model again at the next backward
                # or step, as after initialize. Kept as they were, the next step wrote them over weights just loaded
                # into the model (a run rolled back to a checkpoint went on from where it was).
                stash._masters_checked = False

        # Apex's per-optimizer protocol, for code that copied Apex's scale_loss and calls it directly.
        def prepare_amp_backward(self: Any) -> None:
            stash.prepare_backward()

        def post_amp_backward(self: Any, loss_scaler: Any) -> None:
            flag = stash.unscale_backward(loss_scaler)
            if flag is not None:
                loss_scaler.flag_overflow(flag)  # read by loss_scaler.update_scale()

        def amp_lazy_init(self: Any) -> None:
            stash.own_lazy_init(stash._lazy_take_over)

        def lazy_init_maybe_master_weights(self: Any) -> None:
            stash.take_over_model_weights()

        if stash.master_weights is not None:  # Apex's O2 only: code asks hasattr() whether there are masters to push

            def master_params_to_model_params(self: Any) -> None:
                stash.master_weights.copy_to_model()

            optimizer._master_params_to_model_params = types.MethodType(master_params_to_model_params, optimizer)

        # amp's own, told from a script's replacement by ``replaced``
        self._own_methods = {
            "_prepare_amp_backward": prepare_amp_backward,
            "_post_amp_backward": post_amp_backward,
            "_amp_lazy_init": amp_lazy_init,
        }
        optimizer._prepare_amp_backward = types.MethodType(prepare_amp_backward, optimizer)
        optimizer._post_amp_backward = types.MethodType(post_amp_backward, optimizer)
        optimizer._amp_lazy_init = types.MethodType(amp_lazy_init, optimizer)
        optimizer._lazy_init_maybe_master_weights = types.MethodType(lazy_init_maybe_master_weights, optimizer)
        if hasattr(original_step, "_wrapped_by_lr_sched"):
            # A scheduler built before initialize (transformers 2.x, NVIDIA's SSD and GNMT) counts optimizer steps
            # through the step it wrapped, which this one calls: keep its mark, or torch's scheduler warns at its
            # first step that the optimizer's step "has been overridden" (it did under Apex too).
            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        optimizer.step = types.MethodType(step, optimizer)
        optimizer.zero_grad = types.MethodType(zero_grad, optimizer)
        optimizer.add_param_group = types.MethodType(add_param_group, optimizer)
        optimizer.state_dict = types.MethodType(state_dict, optimizer)
        optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)
