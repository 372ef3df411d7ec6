"""What a LightningModule's attributes are called on a Trainer, for the AttributeError a ported step meets.

A Trainer is both Lightning's module and its trainer, so ``self.current_epoch`` or ``self.trainer.global_step``
has an ampkit spelling; the error names it instead of only saying the attribute does not exist."""

from __future__ import annotations

from typing import Any

LIGHTNING_NAMES: dict[str, str] = {
    "current_epoch": "self.state.epoch",
    "global_step": "self.state.global_step",
    "trainer": "self (a Trainer is Lightning's module and trainer in one)",
    "manual_backward": "self.backward(loss, loss_id=..., optimizer=...)",
    "log_dict": "self.log(tag, value) for each item",
    "hparams": "self.cfg (the resolved config)",
    "save_hyperparameters": "nothing: self.cfg is saved in every checkpoint and in the run directory",
    "toggle_optimizer": "self.backward(loss, optimizer=opt), which gives only that optimizer's parameters grads",
    "untoggle_optimizer": "nothing: self.backward(loss, optimizer=opt) limits the grads of that backward only",
    "clip_gradients": "trainer.clip_grad_norm in the config (clipping of unscaled gradients, per optimizer)",
    "print": "print() under if self.is_global_zero",
    "batch_idx": "self.state.batch_idx",
}


def missing_attribute(obj: Any, name: str) -> AttributeError:
    """The AttributeError for ``obj.name``: with the ampkit spelling when ``name`` is Lightning's."""
    message = f"'{type(obj).__name__}' object has no attribute '{name}'"
    if name in LIGHTNING_NAMES:
        message += f" (Lightning's name; here it is {LIGHTNING_NAMES[name]})"
    return AttributeError(message, name=name, obj=obj)
