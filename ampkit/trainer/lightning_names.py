"""What a LightningModule's attributes are called on a Trainer, for the AttributeError a ported step meets.

A Trainer is both Lightning's module and its trainer, so ``self.current_epoch`` or ``self.trainer.global_step``
has an ampkit spelling; the error names it instead of only saying the attribute does not exist."""

from __future__ import annotations

from typing import Any

from ampkit.lightning_settings import LIGHTNING_SETTINGS

LIGHTNING_NAMES: dict[str, str] = {
    "current_epoch": "self.state.epoch",
    "should_stop": (
        "self.state.should_stop (trainer.state.should_stop in a callback): set it True and training ends after this "
        "iteration"
    ),
    "global_step": "self.state.global_step",
    "trainer": "self (a Trainer is Lightning's module and trainer in one)",
    "manual_backward": "self.backward(loss, loss_id=..., optimizer=...)",
    "log_dict": "self.log(tag, value) for each item",
    "callback_metrics": (
        "self.val_metrics (the latest validation's means, named as validation_step returns them), "
        "self.validation_end_values (what its on_validation_end hooks logged) and self.monitor_values() (this "
        "training epoch's on_epoch means), each kept after fit()"
    ),
    "logged_metrics": (
        "nothing kept per step: log() hands its values to TensorBoard; self.epoch_scalars holds the latest epoch's "
        "on_epoch means"
    ),
    "progress_bar_metrics": (
        "nothing: the bar shows what training_step returns and the epoch means of on_epoch tags (no prog_bar)"
    ),
    "hparams": "self.cfg (the resolved config)",
    "save_hyperparameters": "nothing: self.cfg is saved in every checkpoint and in the run directory",
    "toggle_optimizer": "self.backward(loss, optimizer=opt), which gives only that optimizer's parameters grads",
    "untoggle_optimizer": "nothing: self.backward(loss, optimizer=opt) limits the grads of that backward only",
    "clip_gradients": "trainer.clip_grad_norm in the config (clipping of unscaled gradients, per optimizer)",
    "print": "print() under if self.is_global_zero",
    "batch_idx": "self.state.batch_idx",
    "estimated_stepping_batches": "self.num_training_steps",
    "lr_schedulers": (
        "nothing to step: each scheduler configure_optimizers returned steps after its optimizer's steps, as its "
        "interval and frequency say, under manual optimization too (a scheduler stepped again here would step twice)"
    ),
}


def missing_attribute(obj: Any, name: str) -> AttributeError:
    """The AttributeError for ``obj.name``: with the ampkit spelling when ``name`` is Lightning's."""
    message = f"'{type(obj).__name__}' object has no attribute '{name}'"
    if name in LIGHTNING_NAMES:
        message += f" (Lightning's name; here it is {LIGHTNING_NAMES[name]})"
    return AttributeError(message, name=name, obj=obj)


def keyword_settings_error(class_name: str, schema: type, names: list[str]) -> str:
    """The message for ``Trainer(max_epochs=3)``: each name's config key (``trainer.max_epochs``), and where keys go."""
    from ampkit.config_docs import sections

    leaves = [leaf.key for _, _, keys in sections(schema) for leaf in keys]
    found = []
    for name in names:
        keys = [key for key in leaves if key.rpartition(".")[2] == name] or [LIGHTNING_SETTINGS.get(name, "")]
        found.append(f"{name} is " + (" or ".join(k for k in keys if k) or "no config key"))
    return (
        f"{class_name}() takes a config, not settings as keyword arguments ({'; '.join(found)}); pass them in cfg, "
        f"e.g. {class_name}({{'trainer': {{'max_epochs': 3}}}})"
    )
