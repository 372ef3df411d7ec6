"""Casting for the opt levels: O1 autocast around forwards, O2/O3 model casts, O2 fp32 master weights."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn

from ampkit.amp import (
    MasterWeights,
    OptLevelProperties,
    add_boundary_casts,
    autocast_for,
    cast_model,
    model_device,
    parse_dtype,
)
from ampkit.amp.opt_levels import dtype_meant
from ampkit.config import ConfigError
from ampkit.trainer.callback import Callback, Phase
from ampkit.trainer.state import BackwardState
from ampkit.trainer.user_code import first_names
from ampkit.wording import shown


def _warn_of_float64(module: torch.nn.Module, opt_level: str, cast_type: torch.dtype) -> None:
    """Say that the model cast takes float64 parameters down too (as Apex's O2 did): a layer kept in float64 on
    purpose trained in half precision with float32 masters, silently."""
    wide = [name for name, p in module.named_parameters() if p.dtype == torch.float64]
    if wide:
        low = str(cast_type).removeprefix("torch.")
        rank_zero_warn(
            f"precision.opt_level={opt_level} casts the model's float64 parameters to {low} too ({first_names(wide)}), "
            "as Apex did, with float32 master copies: their float64 precision is lost. opt_level O1 keeps them "
            "(autocast leaves float64 alone)"
        )


def output_dtype(cast_model_outputs: torch.dtype | str | None) -> torch.dtype | None:
    """``cast_model_outputs`` as a dtype: float32 (``"float32"``, ``"fp32"``) or a low-precision one; None stays None.

    Raises:
        ValueError: a name of no such dtype (``cast_model_outputs=...``)."""
    if cast_model_outputs is None or (
        isinstance(cast_model_outputs, torch.dtype) and cast_model_outputs.is_floating_point
    ):
        return cast_model_outputs
    name = cast_model_outputs.lower().removeprefix("torch.") if isinstance(cast_model_outputs, str) else None
    if name in ("float32", "fp32"):
        return torch.float32
    try:  # an int dtype or a number, taken as given, failed in the first forward's cast, naming neither
        return parse_dtype(name, "cast_model_outputs")
    except ValueError:
        meant = dtype_meant(cast_model_outputs)
        raise ValueError(
            f"cast_model_outputs={shown(cast_model_outputs)} is no dtype of a model's outputs; use float32, float16 or "
            "bfloat16 (null: float32)" + (f" ({meant})" if meant else "")
        ) from None


def _names(values: Any) -> tuple[str, ...] | None:
    """``values`` as a tuple of strings, or None where it is no iterable of strings."""
    try:
        names = tuple(values)
    except TypeError:
        return None
    return names if all(isinstance(name, str) for name in names) else None


class MixedPrecision(Callback):
    """Applies an :class:`~ampkit.amp.OptLevelProperties` recipe to the Trainer's model and optimizers.

    - O1 (``patch_torch_functions``): the training step runs under ``torch.autocast`` on the model's device
      type (CPU too), paused for each backward (on CPU, autograd runs on the calling thread and would
      otherwise autocast backward ops too); validation runs under it as well. Optimizer steps are not
      affected: autocast only changes matmul/conv-like ops, which optimizers do not call.
    - O2/O3 (``cast_model_type``): the model is cast (batch norm kept fp32 when ``keep_batchnorm_fp32``);
      floating inputs are cast at the boundary of the model, or of each module named in ``cast_modules``
      (e.g. ``["generator", "discriminator"]`` when training code calls submodules directly), and outputs
      cast back to float32 (or ``cast_model_outputs``).
    - ``master_weights``: each optimizer holds fp32 masters; they are copied into the model after every
      step that ran (not after a skipped one) and saved in checkpoints, so a resumed run is bit-identical. As in
      Apex, a parameter frozen at set-up (a fine-tuned backbone) gets none, saving its fp32 copy; unfrozen later, it
      gets its master at its next backward, also between two of one iteration (where the gradient combiner is
      rebuilt).

    A standalone ``validate``/``test``/``predict`` casts at ``on_evaluation_setup`` and runs under autocast too.

    Casting happens at ``on_fit_start``, or earlier at ``on_load_checkpoint`` when resuming, where the
    optimizer states are reloaded onto the cast parameters so they keep the dtype they were saved with.
    """

    phase = Phase.CAST  # cast before DistributedDataParallel wraps the model

    def __init__(
        self,
        properties: OptLevelProperties,
        cast_modules: Sequence[str] = (),
        cast_model_outputs: torch.dtype | str | None = None,
    ) -> None:
        if not isinstance(properties, OptLevelProperties):
            raise TypeError(
                f"MixedPrecision: properties must be an OptLevelProperties (ampkit.amp.resolve_opt_level('O2')), got "
                f"{shown(properties)}"
            )
        # a str was read as its letters: "generator" named the modules g, e, n, ... none of which the model has
        names = None if isinstance(cast_modules, str) else _names(cast_modules)
        if names is None:
            raise TypeError(
                f"MixedPrecision: cast_modules must be a list of module names, such as ['generator'], got "
                f"{shown(cast_modules)}"
            )
        self.properties = properties
        self.cast_modules = names
        self.cast_model_outputs = output_dtype(cast_model_outputs)
        self.masters: dict[torch.optim.Optimizer, MasterWeights] = {}
        self._ready = False
        self._pending_state: dict[str, Any] | None = None
        self._autocast: Any = None  # the torch.autocast context, built once at set-up (O1 only)
        self._autocast_active = False
        self._resume_after_validation = False
        self._master_to_model: dict[int, torch.Tensor] = {}
        self._name_of: dict[torch.optim.Optimizer, str] = {}

    # ------------------------------------------------------------------ set-up
    def _boundaries(self, trainer) -> list[torch.nn.Module]:
        if not self.cast_modules:
            return [trainer.module]
        modules = dict(trainer.module.named_modules())
        missing = [name for name in self.cast_modules if name not in modules]
        if missing:
            children = ", ".join(name for name, _ in trainer.module.named_children()) or "none"
            raise ConfigError(
                f"precision.cast_modules names {missing}, which the model does not have; its children: {children}"
            )
        return [modules[name] for name in self.cast_modules]

    def _setup(self, trainer) -> None:
        if self._ready:
            return
        self._ready = True
        self._name_of = {optimizer: name for name, optimizer in trainer.optimizers.items()}
        props = self.properties
        if props.patch_torch_functions:
            self._autocast = autocast_for(model_device(trainer.module), props.dtype)
        cast_type = props.cast_model_type
        if cast_type is not None and cast_type != torch.float32:
            _warn_of_float64(trainer.module, props.opt_level, cast_type)
            cast_model(trainer.module, cast_type, keep_batchnorm_fp32=bool(props.keep_batchnorm_fp32))
            for module in self._boundaries(trainer):
                add_boundary_casts(module, cast_type, self.cast_model_outputs or torch.float32)
        elif self.cast_model_outputs is not None:
            for module in self._boundaries(trainer):
                add_boundary_casts(module, None, self.cast_model_outputs)
        if props.master_weights:
            for optimizer in trainer.optimizers.values():
                # as Apex's O2: a frozen parameter (a fine-tuned backbone) gets no fp32 copy until it is unfrozen
                masters = self.masters[optimizer] = MasterWeights(optimizer, frozen_masters=False)
                trainer.optimizer_state[optimizer].master_weights = masters  # gradients go to the masters
            self._map_masters()

    def _map_masters(self) -> None:
        """Give every master the model parameter it stands for, after masters were made for added param groups."""
        for masters in self.masters.values():
            masters.refresh()
        self._master_to_model = {
            id(master): param
            for masters in self.masters.values()
            for param, master in zip(masters.model_params, masters.master_params, strict=True)
        }

    def unused_hooks(self, trainer) -> set[str]:
        unused = set()
        if trainer.automatic_optimization:  # autocast is off from each backward on: nothing to resume or end
            unused |= {"on_after_backward", "on_train_batch_end"}
        if not self.properties.master_weights:
            unused |= {"on_after_optimizer_step", "on_train_start"}
        return unused

    def on_fit_start(self, trainer) -> None:
        self._setup(trainer)

    def on_train_start(self, trainer) -> None:
        # a layer frozen after set-up, before training (in on_fit_start, as Lightning's BackboneFinetuning) gives
        # back the master it got
        if any([masters.release_frozen() for masters in self.masters.values()]):
            self._map_masters()

    def on_load_checkpoint(self, trainer, checkpoint: dict[str, Any]) -> None:
        self._setup(trainer)
        saved = (self._pending_state or {}).get("master_weights", {})
        for name, optimizer in trainer.optimizers.items():
            masters = self.masters.get(optimizer)
            if masters is not None and name in saved:  # first: a layer that trained, then froze, gets its master back
                masters.load_state_dict(saved[name])
            elif masters is not None:  # saved at a level without masters (O0, O1) or with master_weights off
                rank_zero_warn(
                    f"the checkpoint has no fp32 master weights for optimizer '{name}' (it was saved without "
                    "precision.master_weights): this run's masters start from its model weights, in the "
                    "model's dtype, as a fresh run's do"
                )
        # The Trainer loaded the optimizer states before the cast: reload them onto the cast parameters
        # (or the masters) so every state tensor has the dtype it was saved with.
        for name, optimizer in trainer.optimizers.items():
            optimizer.load_state_dict(checkpoint["optimizers"][name])
        self._map_masters()  # masters given back above
        self._pending_state = None

    def state_dict(self) -> dict[str, Any]:
        return {"master_weights": {self._name_of[opt]: masters.state_dict() for opt, masters in self.masters.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending_state = state

    # ------------------------------------------------------------------ O1 autocast around forwards
    def _autocast_on(self) -> None:
        if self._autocast is not None and not self._autocast_active:
            self._autocast.__enter__()
            self._autocast_active = True

    def _autocast_off(self) -> None:
        if self._autocast_active:
            self._autocast_active = False
            self._autocast.__exit__(None, None, None)

    def on_train_batch_start(self, trainer, batch: Any) -> None:
        self._autocast_on()

    def on_before_backward(self, trainer, backward: BackwardState) -> None:
        self._autocast_off()
        if backward.inputs is not None and self.masters:
            # ``backward(loss, optimizer=opt)`` names the optimizer's tensors: the masters are not in the
            # graph, their model parameters are. A tensor not mapped yet is in a param group added since.
            if any(id(t) not in self._master_to_model for t in backward.inputs):
                self._map_masters()
            backward.inputs = [self._master_to_model.get(id(t), t) for t in backward.inputs]

    def on_after_backward(self, trainer, backward: BackwardState) -> None:
        # Manual optimization may run a further forward (a GAN's generator step); under automatic
        # optimization only the optimizer step follows, and it runs outside autocast as in torch's recipe.
        if not trainer.automatic_optimization:
            self._autocast_on()

    def on_after_optimizer_step(self, trainer, optimizer: torch.optim.Optimizer) -> None:
        masters = self.masters.get(optimizer)
        if masters is not None:
            masters.copy_to_model()

    def on_train_batch_end(self, trainer, outputs: dict[str, Any], batch: Any) -> None:
        self._autocast_off()

    def on_validation_start(self, trainer) -> None:
        self._resume_after_validation = self._autocast_active
        self._autocast_on()

    def on_validation_end(self, trainer, metrics: dict[str, float]) -> None:
        if not self._resume_after_validation:
            self._autocast_off()

    def on_evaluation_setup(self, trainer, stage: str) -> None:
        self._setup(trainer)

    def on_test_start(self, trainer) -> None:
        self._autocast_on()

    def on_test_end(self, trainer, metrics: dict[str, float]) -> None:
        self._autocast_off()

    def on_predict_start(self, trainer) -> None:
        self._autocast_on()

    def on_predict_end(self, trainer, predictions: list[Any]) -> None:
        self._autocast_off()

    def on_exception(self, trainer, exception: BaseException) -> None:
        self._autocast_off()

    def explain_exception(self, trainer, exception: BaseException) -> str | None:
        cast_type = self.properties.cast_model_type
        if cast_type in (None, torch.float32) or not _is_dtype_mismatch(exception):
            return None
        children = ", ".join(name for name, _ in trainer.module.named_children()) or "none"
        where = f"the modules of precision.cast_modules {list(self.cast_modules)}" if self.cast_modules else "the model"
        text = " ".join(str(exception).split())
        return (
            f"{type(exception).__name__}: {text}; precision.opt_level={trainer.cfg.precision.opt_level} cast the model "
            f"to {str(cast_type).removeprefix('torch.')} and casts inputs only where {where} is called: a step that "
            f"calls a submodule directly (self.module.<name>(x)) names it in precision.cast_modules (the model's "
            f"children: {children})"
        )


# torch's messages for an operation given float32 inputs and half weights (conv, linear, matmul, norms)
_DTYPE_MISMATCH = re.compile(r"should be the same|same dtype|expected scalar type|mixed dtype", re.IGNORECASE)


def _is_dtype_mismatch(exception: BaseException) -> bool:
    """Whether ``exception`` is torch refusing to mix a floating input with half or bfloat16 weights."""
    text = str(exception)
    return (
        isinstance(exception, RuntimeError)
        and bool(_DTYPE_MISMATCH.search(text))
        and bool(re.search(r"half|bfloat16|float16", text, re.IGNORECASE))
    )


@torch.no_grad()
def saved_masters_into_model(
    module: torch.nn.Module, optimizers: dict[str, torch.optim.Optimizer], checkpoint: dict[str, Any]
) -> None:
    """Write the fp32 master weights a checkpoint holds into ``module``'s parameters (its ``model`` entry holds them
    only in half precision), so a run resumed without masters (O1, O0, ``master_weights`` off) continues from the
    trained fp32 weights; a run with masters casts them back to the very half weights it saved."""
    saved = checkpoint.get("callbacks", {}).get(MixedPrecision.__name__, {}).get("master_weights", {})
    names = {id(param): name for name, param in module.named_parameters()}
    for opt_name, state in saved.items():
        optimizer = optimizers.get(opt_name)
        if optimizer is None or "master_params" not in state:
            continue
        params = [p for group in optimizer.param_groups for p in group["params"]]
        dtypes = [getattr(checkpoint["model"].get(names.get(id(p), "")), "dtype", None) for p in params]
        low = [p for p, dtype in zip(params, dtypes, strict=True) if _had_master(dtype)]
        masters = state["master_params"]  # None for a parameter that was frozen without a master
        if len(low) != len(masters) or any(
            m is not None and p.shape != m.shape for p, m in zip(low, masters, strict=False)
        ):
            rank_zero_warn(
                f"the checkpoint's fp32 master weights of optimizer '{opt_name}' do not match its parameters: "
                "the run continues from the model's saved half-precision weights"
            )
            continue
        for param, master in zip(low, masters, strict=True):
            if master is not None:
                param.copy_(master)


def _had_master(saved_dtype: torch.dtype | None) -> bool:
    """Whether a parameter saved in ``saved_dtype`` had an fp32 master (as :class:`MasterWeights` decides)."""
    return saved_dtype is not None and saved_dtype.is_floating_point and saved_dtype != torch.float32
