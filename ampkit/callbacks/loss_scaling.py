"""Per-loss loss scalers and combined unscaling after every backward; each loss's found_inf as a fact.

Per ``trainer.backward(loss, loss_id=k)``: every optimizer's gradients are stashed, the loss is scaled by
scaler ``k``, and after autograd the new gradients are unscaled by scaler ``k``'s scale, checked for
inf/nan and added to the stash (:class:`ampkit.amp.GradientCombiner`). So gradients are unscaled by the
time clipping or logging look at them, accumulation over batches and several losses is exact, and an
overflow is attributed to the loss that produced it.

This callback only reports facts into the Trainer's state: each combine's found_inf flag (on the device,
unread) with ``trainer.loss_state[loss_id].report_found_inf``, the loss ids that reached each optimizer in
``trainer.optimizer_state[opt].loss_ids``, and each loss's scaler in ``trainer.loss_state[loss_id].scaler``.
The Trainer reads and agrees the flags across ranks, decides step or skip (an optimizer skips when a loss
that reached it overflowed), and updates each used scaler once per iteration after every optimizer step
(torch's recipe; updating after each optimizer step, as Lightning and Accelerate do, unscales the second
optimizer with the wrong scale).

Host syncs: the flags stay on the device until the Trainer's first step of the iteration reads them all at
once (so accumulation over micro-batches, or several losses before the steps, cost one read per iteration;
a GAN's D step between its D and G backwards needs the verdict in between, so two).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from ampkit.amp import GradientCombiner, LossScaler
from ampkit.amp.scaler import loss_count_option
from ampkit.callbacks.found_inf_flags import FoundInfFlags
from ampkit.callbacks.nonfinite_guard import NonFiniteError
from ampkit.ops._switches import checked_switch
from ampkit.trainer.callback import Callback, Phase
from ampkit.trainer.param_groups import TrainableParams
from ampkit.trainer.state import BackwardState, loss_id_key
from ampkit.wording import counted, shown

# torch's anomaly detection on a NaN that a backward returned
_ANOMALY_NAN = re.compile(r"Function '\w+' returned nan values")


def check_num_losses(num_losses: Any) -> int | None:
    """``num_losses`` as None or an int in [1, MAX_NUM_LOSSES] (amp.initialize's rule, numpy's integers too), else a
    ValueError: checked wherever it is set, also where no scaler is made (O0, bfloat16 unscaled), so a bad value is
    no surprise when one is."""
    return loss_count_option(num_losses, "num_losses", optional=True)


class LossScaling(Callback):
    """One :class:`~ampkit.amp.LossScaler` per ``loss_id`` (int or name) and the combined unscale.

    Args:
        loss_scale: ``"dynamic"``, a number, or ``"none"``: no scalers; gradients are still combined onto
            O2's fp32 master weights (bfloat16 needs no scaling).
        init_scale: the first scale of every :class:`~ampkit.amp.LossScaler`; ``growth_factor``,
            ``backoff_factor``, ``growth_interval``, ``min_scale`` and ``max_scale`` are its other knobs.
        num_losses: when given, scalers ``0..num_losses-1`` exist from the start and an integer
            ``loss_id`` outside that range is an error; named loss ids are always accepted.
        combine_grad: keep each optimizer's gradients in one flat buffer per dtype.
        warn_consecutive_skips: warn when an optimizer skipped this many steps in a row, and again at twice as many
            (0: never).
        max_overflows_at_min_scale: raise when a scaler overflows this many iterations in a row while
            already at its floor (``min_scale``, or 2**-126 without one; 0: never) — scaling cannot help,
            the loss itself is non-finite.
        check_nonfinite: report found_inf without scalers too (``precision.skip_nonfinite``); scaled
            losses always report it.

    TensorBoard tags (through ``trainer.log``): ``amp/loss_scale/<loss_id>`` at every logged step,
    ``amp/overflow/<loss_id>`` (1 at each iteration that overflowed, 0 at logged clean ones) and
    ``amp/skipped_steps/<optimizer>`` (cumulative).
    """

    phase = Phase.SCALE

    def __init__(
        self,
        loss_scale: float | str = "dynamic",
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float | None = None,
        max_scale: float | None = 2.0**24,
        num_losses: int | None = None,
        combine_grad: bool = False,
        warn_consecutive_skips: int = 10,
        max_overflows_at_min_scale: int = 10,
        check_nonfinite: bool = True,
    ) -> None:
        self._knobs = dict(
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            min_scale=min_scale,
            max_scale=max_scale,
        )
        self.loss_scale = loss_scale
        self.scaled = loss_scale != "none"
        self.check_nonfinite = checked_switch("LossScaling", "check_nonfinite", check_nonfinite) or self.scaled
        if self.scaled:
            LossScaler(loss_scale, **self._knobs)  # validate the knobs now, not at the first backward
        num_losses = check_num_losses(num_losses)
        for option, value in (
            ("warn_consecutive_skips", warn_consecutive_skips),
            ("max_overflows_at_min_scale", max_overflows_at_min_scale),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{option}={shown(value)}: expected an integer >= 0 (0 disables it)")
        self.num_losses = num_losses
        self.combine_grad = checked_switch("LossScaling", "combine_grad", combine_grad)
        self.warn_consecutive_skips = warn_consecutive_skips
        self.max_overflows_at_min_scale = max_overflows_at_min_scale
        self.scalers: dict[Any, LossScaler] = {}
        self._combiners: dict[torch.optim.Optimizer, GradientCombiner] = {}
        self._trainable: TrainableParams | None = None  # when the combiners' parameters must be looked up again
        self._looked_at: int | None = None  # the iteration whose first backward read every parameter's requires_grad
        self._consecutive_skips: dict[str, int] = {}
        self._counts_seen: dict[str, tuple[int, int]] = {}  # per optimizer: (steps, skipped_steps) at the last look
        self._optimizer_states: dict = {}  # the Trainer's, to catch up on verdicts settled since the last look
        self._overflows_at_min: dict[str, int] = {}
        self._overflowing_since: dict[str, int] = {}  # per loss: the iteration its current run of overflows began
        self._loaded: dict[str, Any] = {}
        self._log_every = 1
        self._flags = FoundInfFlags()  # the flag each loss's combines set
        self._device: torch.device | None = None  # the device of every combined parameter (None: several)
        if num_losses is not None and self.scaled:
            for loss_id in range(num_losses):
                self.scaler(loss_id)

    def explain_exception(self, trainer, exception: BaseException) -> str | None:
        if not (self.scaled and isinstance(exception, RuntimeError) and _ANOMALY_NAN.search(str(exception))):
            return None
        scales = ", ".join(f"{scale:g}" for scale in self.scales.values())
        return (
            f"torch's anomaly detection stopped the run: {exception} The losses are scaled (precision.loss_scale="
            f"{self.loss_scale}, scale now {scales}), and a scale too large for float16 makes inf and NaN gradients, "
            "for which the Trainer skips the step and lowers the scale (expected while a dynamic scale finds its "
            "level); anomaly detection raises on them instead. To find a NaN of the model's own with anomaly "
            "detection on, train in bfloat16 (precision.dtype=bfloat16, no loss scale) or float32 "
            "(precision.opt_level=O0)"
        )

    # ------------------------------------------------------------------ scalers
    @staticmethod
    def _key(loss_id: Any) -> str:
        return f"loss_scaler{loss_id}"

    def scaler(self, loss_id: Any = 0) -> LossScaler:
        """The scaler of ``loss_id`` (an int, numpy's too, or a name), created on first use."""
        # checked before the look-up (an int or a name at once: asked at every backward): True and 1.0 hash as 1, so
        # they took loss 1's scaler once it existed, and were refused before; numpy's int64 was refused unless its
        # scaler existed
        loss_id = loss_id_key(loss_id)
        scaler = self.scalers.get(loss_id)
        if scaler is not None:
            return scaler
        if isinstance(loss_id, int) and self.num_losses is not None and not 0 <= loss_id < self.num_losses:
            raise ValueError(
                f"loss_id={loss_id} is out of range for precision.num_losses={self.num_losses} "
                f"(valid: 0..{self.num_losses - 1}, or a name)"
            )
        scaler = self.scalers[loss_id] = LossScaler(self.loss_scale, **self._knobs)
        state = self._loaded.pop(self._key(loss_id), None)
        if state is not None:
            scaler.load_state_dict(state)
        return scaler

    @property
    def scales(self) -> dict[Any, float]:
        """The current scale of every loss id."""
        return {loss_id: scaler.scale for loss_id, scaler in self.scalers.items()}

    # ------------------------------------------------------------------ backward
    def _build_combiners(self, trainer) -> None:
        """One combiner per optimizer over its trainable parameters. Also between two backwards of an iteration: the
        gradients combined so far sit in ``.grad`` (the masters' under O2, the flat buffers' views with
        ``combine_grad``), which the new combiners take over as they are; a parameter left out keeps its own."""
        for combiner in self._combiners.values():
            combiner.remove()  # the old flat buffers' hooks would run at every later backward
        for optimizer in trainer.optimizers.values():
            masters = trainer.optimizer_state[optimizer].master_weights
            if masters is not None:
                masters.refresh()  # fp32 masters for a param group added mid-run, which would step in half precision
                pairs = [(p, m) for p, m in zip(masters.model_params, masters.master_params, strict=True)]
            else:
                pairs = [(p, p) for group in optimizer.param_groups for p in group["params"]]
            pairs = [(p, m) for p, m in pairs if p.requires_grad]
            self._combiners[optimizer] = GradientCombiner(
                [p for p, _ in pairs], [m for _, m in pairs], flat=self.combine_grad
            )
        devices = {p.device for combiner in self._combiners.values() for p in combiner.params}
        self._device = devices.pop() if len(devices) == 1 else None

    def on_fit_start(self, trainer) -> None:
        self._trainable = TrainableParams(trainer.module, trainer.optimizers.values())
        self._looked_at = None
        self._log_every = trainer.cfg.logging.log_every_n_steps  # read once: config access costs µs per step
        trainer.state.grads_leave_params = True  # each backward's gradients go to a stash or the masters

    def on_train_start(self, trainer) -> None:
        self._optimizer_states = trainer.optimizer_state
        self._counts_seen = {st.name: (st.steps, st.skipped_steps) for st in trainer.optimizer_state.values()}

    def on_before_backward(self, trainer, backward: BackwardState) -> None:
        # Rebuilt after training code unfroze a parameter or added or replaced a param group, also between the
        # backwards of one iteration (accumulation, manual optimization): one left out would step on gradients still
        # multiplied by the loss scale, never checked for inf. One frozen is left out from the next iteration on (it
        # gets no gradient).
        if self._looked_at != trainer.state.iteration:  # the iteration's first backward: every parameter read
            self._looked_at = trainer.state.iteration
            rebuild = self._trainable.changed()
        else:  # between its backwards: only the frozen ones (nothing in a model with none)
            rebuild = self._trainable.grew()
        if rebuild:
            self._build_combiners(trainer)
        for combiner in self._combiners.values():
            combiner.prepare_backward()
        if self.scaled:
            scaler = trainer.loss_state[backward.loss_id].scaler = self.scaler(backward.loss_id)  # Trainer updates it
            if trainer.facts_on_device and self._device is not None:
                scaler.keep_on_device(self._device)  # scaled, unscaled and updated there: nothing read per step
            backward.loss = scaler.scale_loss(backward.loss)

    def on_after_backward(self, trainer, backward: BackwardState) -> None:
        loss_id = backward.loss_id
        loss_state = trainer.loss_state[loss_id]
        flag = None if self._device is None else self._flags.get(loss_id, self._device)
        for optimizer, combiner in self._combiners.items():
            result = combiner.combine(loss_state.scaler if self.scaled else 1.0, flag)
            if result.reached:
                trainer.optimizer_state[optimizer].loss_ids.add(loss_id)
                if self.check_nonfinite:
                    loss_state.report_found_inf(result.found_inf)  # the same flag is reported once

    # ------------------------------------------------------------------ after the Trainer's update
    def on_loss_scale_update(self, trainer, loss_id: Any, old: float, new: float) -> None:
        overflowed = trainer.loss_state[loss_id].found_inf
        iteration = trainer.event_iteration  # settled an iteration late when the verdicts stay on the device
        if overflowed:
            self._overflowing_since.setdefault(self._key(loss_id), iteration)
        else:
            self._overflowing_since.pop(self._key(loss_id), None)
        self._check_floor(loss_id, self.scalers[loss_id], overflowed, old)
        if overflowed or iteration % self._log_every == 0:
            trainer.log(f"amp/overflow/{loss_id}", float(overflowed), always=True)

    def on_train_batch_end(self, trainer, outputs: dict[str, Any], batch: Any) -> None:
        if not trainer.state.is_iteration_end:
            return
        self._flags.renew(trainer.loss_state, everything=trainer.facts_on_device)
        logged = trainer.state.iteration % self._log_every == 0
        if logged:
            for loss_id, scaler in self.scalers.items():
                trainer.log(f"amp/loss_scale/{loss_id}", scaler.scale)
        for opt_state in trainer.optimizer_state.values():
            new_skips = self._count_skips(opt_state)
            if logged or new_skips:
                trainer.log(f"amp/skipped_steps/{opt_state.name}", opt_state.skipped_steps, always=True)

    def _check_floor(self, loss_id: Any, scaler: LossScaler, overflowed: bool, old: float) -> None:
        key = self._key(loss_id)
        at_floor = overflowed and scaler.dynamic and old <= scaler.floor
        self._overflows_at_min[key] = self._overflows_at_min.get(key, 0) + 1 if at_floor else 0
        limit = self.max_overflows_at_min_scale
        if limit and self._overflows_at_min[key] >= limit:
            floor = f"min_scale={scaler.min_scale}" if scaler.floor == scaler.min_scale else f"its floor {scaler.floor}"
            raise NonFiniteError(
                f"loss_id {shown(loss_id)} overflowed in every iteration since step "
                f"{self._overflowing_since.get(key)}, "
                f"the last {self._overflows_at_min[key]} at {floor}: its gradients are non-finite whatever the "
                "scale (a NaN/inf loss or input, or parameters already non-finite?). Lower precision.min_scale or "
                "fix the loss."
            )

    def _count_skips(self, opt_state) -> int:
        """Follow the optimizer's counts since the last look; returns the skips that appeared. Counts, not this
        iteration's ``skipped`` flag: with verdicts kept on the device a skip is known one iteration late, when
        the step counted as taken becomes a skipped one (steps -1, skipped_steps +1)."""
        name = opt_state.name
        steps, skipped = self._counts_seen.get(name, (0, 0))
        new_steps, new_skips = opt_state.steps - steps, opt_state.skipped_steps - skipped
        self._counts_seen[name] = (opt_state.steps, opt_state.skipped_steps)
        if new_steps > 0:
            self._consecutive_skips[name] = 0
        elif new_skips > 0:
            self._consecutive_skips[name] = self._consecutive_skips.get(name, 0) + new_skips
            count = self._consecutive_skips[name]
            every = self.warn_consecutive_skips
            # At N, 2N, 4N... in a row: a run that skips on for long says so now and then, not every N steps.
            if every and count % every == 0 and (count // every) & (count // every - 1) == 0:
                culprits = ", ".join(repr(i) for i in sorted(opt_state.loss_ids, key=str))
                skipped = counted(count, "step")
                rank_zero_warn(  # the ranks agree on each verdict: one line, not one per rank
                    f"optimizer '{name}' skipped {skipped} in a row: non-finite gradients from loss_id "
                    f"{culprits} (scales: {self.scales}). A scaler skips a few while its scale backs off; more mean "
                    "a NaN/inf loss or parameters, or too high a learning rate (said again at twice as many; "
                    "precision.warn_consecutive_skips=0: never)",
                    category=RuntimeWarning,
                )
        return new_skips

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        for opt_state in self._optimizer_states.values():  # verdicts the checkpoint settled after this batch's look
            self._count_skips(opt_state)
        scalers = {self._key(loss_id): scaler.state_dict() for loss_id, scaler in self.scalers.items()}
        return {
            "loss_scalers": {**self._loaded, **scalers},
            "consecutive_skips": dict(self._consecutive_skips),
            "overflows_at_min_scale": dict(self._overflows_at_min),
            "overflowing_since": dict(self._overflowing_since),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loaded = dict(state.get("loss_scalers", {}))
        for loss_id, scaler in self.scalers.items():
            saved = self._loaded.pop(self._key(loss_id), None)
            if saved is not None:
                scaler.load_state_dict(saved)
        self._consecutive_skips = dict(state.get("consecutive_skips", {}))
        self._overflows_at_min = dict(state.get("overflows_at_min_scale", {}))
        self._overflowing_since = dict(state.get("overflowing_since", {}))
