"""Whether ``trainer.activation_checkpointing`` recomputed anything, checked once in the first iteration."""

from __future__ import annotations

from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import nn

from ampkit.trainer.callback import Callback, Phase


class CheckpointingReport(Callback):
    """Warns when training code called none of the checkpointed modules in the first training iteration: their
    forward never ran, so nothing was recomputed and no memory saved, though the banner says they are checkpointed.

    Forward pre-hooks watch the model from ``on_train_start`` (the sanity validation before it calls the whole
    model) and all go at the first checkpointed call, or at the end of the first iteration, so later steps cost
    nothing. Modules inside a compiled region are not watched: a hook there would make torch recompile it when
    the hook comes and again when it goes. So a run whose checkpointed modules all sit inside compiled code
    (``trainer.compile: true``, or a compiled class around them) is not checked.
    """

    phase = Phase.OBSERVE

    def __init__(self) -> None:
        self._hooks: list[Any] = []
        self._checked = False
        self._called = False
        self._ran: set[str] = set()
        self._root: nn.Module | None = None

    def on_train_start(self, trainer) -> None:
        setup = trainer.model_setup
        compiled = [trainer.module] if trainer.cfg.trainer.compile is True else setup.compiled_regions
        inside = {id(sub) for region in compiled for sub in list(region.modules())[1:]}
        blocks = [m for m in setup.checkpointed if id(m) not in inside]
        self._checked = bool(blocks)
        if not blocks:
            return
        self._called, self._ran = False, set()
        ids = {id(m) for m in blocks}
        for module in trainer.module.modules():
            if id(module) in inside:
                continue
            hook = self._checkpointed_ran if id(module) in ids else self._module_ran
            self._hooks.append(module.register_forward_pre_hook(hook))
        self._root = trainer.module

    def _checkpointed_ran(self, *_: Any) -> None:
        """A checkpointed module ran in training: the setting does something. The hooks go, so later calls cost
        nothing."""
        self._called = True
        self._remove_hooks()

    def _module_ran(self, module: nn.Module, *_: Any) -> None:
        if module is not self._root:
            self._ran.add(class_name(module))

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def on_train_batch_end(self, trainer, outputs: dict[str, Any], batch: Any) -> None:
        if not self._checked or not trainer.state.is_iteration_end:
            return
        self._checked = False
        self._remove_hooks()
        if self._called:
            return
        names = list(trainer.cfg.trainer.activation_checkpointing)
        ran = sorted(self._ran)
        instead = f"it ran {', '.join(ran)} instead" if ran else f"it ran no module inside {class_name(self._root)}"
        rank_zero_warn(
            f"config key 'trainer.activation_checkpointing'={names}: training code called none of the checkpointed "
            f"modules in the first iteration, so nothing was recomputed and no memory saved; {instead}: name the "
            "classes whose forward training calls"
        )

    def on_fit_end(self, trainer) -> None:
        self._remove_hooks()  # a run that stopped before its first iteration ended


def class_name(module: nn.Module) -> str:
    """The name of the module's own class: FSDP2's ``fully_shard`` swaps it for a subclass named ``FSDP<Name>``, a
    name the user never wrote."""
    cls = type(module)
    own = [base for base in cls.__bases__ if base.__name__ != "FSDPModule"]
    return own[0].__name__ if own and len(own) < len(cls.__bases__) else cls.__name__
