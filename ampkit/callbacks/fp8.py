"""Float8 training's two callbacks: FSDP2's float8 weight scales after each taken step, and per-layer telemetry."""

from __future__ import annotations

import torch

from ampkit.amp.fp8 import ROLES, Float8Recorder, is_float8_linear, recipe_named
from ampkit.amp.scaler import interval_option
from ampkit.ops.host_values import host_vectors
from ampkit.trainer.callback import Callback, Phase


class Float8AllGatherScales(Callback):
    """With FSDP2's float8 all-gather (torchao), recomputes every float8 weight's scale in one all-reduce after each
    optimizer step that ran, so the next all-gather casts the updated weights with their own amax.

    A step skipped on the host fires no ``on_after_optimizer_step``, so nothing is recomputed; one the device skips
    (its verdict read later) recomputes the scales its unchanged weights already have. All ranks agree on every skip
    verdict, so all of them join the all-reduce or none does.
    """

    phase = Phase.DISTRIBUTE  # after the casting callback's master-weight copy, before anything reads the model

    def on_after_optimizer_step(self, trainer, optimizer: torch.optim.Optimizer) -> None:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(trainer.module)


class Float8Telemetry(Callback):
    """Every ``every_n_steps`` iterations, the float8 statistics of each converted layer's weight, input and output
    gradient (of the iteration's last micro-batch), as TensorBoard scalars ``fp8/<layer>/<role>/{amax,scale,
    underflow}`` and one histogram per role of every layer's log2 scales, ``fp8/<role>/log2_scale``.

    ``amax`` is the tensor's largest magnitude, ``scale`` the factor that maps it to the float8 format's largest
    value (rowwise: the smallest row's), ``underflow`` the fraction of its values that are non-zero but become zero
    in float8: the precision float8 loses at the small end. The scalars stay device tensors queued with
    ``trainer.log``, read by the logger with the iteration's other values; the histograms take one read per
    telemetry step for all layers. Skipped steps are recorded too: an inf shows as an infinite amax.
    """

    phase = Phase.OBSERVE

    def __init__(self, recipe: str, every_n_steps: int = 100) -> None:
        self.recipe = recipe_named(recipe)
        self.every_n_steps = interval_option(every_n_steps, "Float8Telemetry: every_n_steps")
        self.recorder: Float8Recorder | None = None

    def on_fit_start(self, trainer) -> None:
        layers = {name: m for name, m in trainer.module.named_modules() if is_float8_linear(m)}
        self.recorder = Float8Recorder(layers, self.recipe)

    def on_train_batch_start(self, trainer, batch) -> None:
        s = trainer.state
        if s.is_iteration_end and s.iteration % self.every_n_steps == 0:
            self.recorder.arm()

    def on_before_zero_grad(self, trainer, optimizer: torch.optim.Optimizer) -> None:
        if not self.recorder.armed:  # the first optimizer of the iteration harvests, before validation runs
            return
        stats = self.recorder.disarm()
        for layer, roles in stats.items():
            for role, st in roles.items():
                for what in ("amax", "scale", "underflow"):
                    trainer.log(f"fp8/{layer}/{role}/{what}", getattr(st, what), always=True)
        if trainer.is_global_zero and stats:
            self._log_histograms(trainer, stats)

    def _log_histograms(self, trainer, stats) -> None:
        per_role = {role: [r[role].scales for r in stats.values() if role in r] for role in ROLES}
        per_role = {role: torch.cat(scales) for role, scales in per_role.items() if scales}
        host = host_vectors(per_role.values())  # one read for every layer and role
        for role, values in zip(per_role, host, strict=True):
            log2 = values[values > 0].log2()
            log2 = log2[log2.isfinite()]  # an inf amax gives a zero scale: shown by the amax scalar instead
            if log2.numel():
                trainer.logger.log_histogram(f"fp8/{role}/log2_scale", log2, trainer.state.iteration)

    def on_exception(self, trainer, exception: BaseException) -> None:
        if self.recorder is not None:
            self.recorder.disarm()
