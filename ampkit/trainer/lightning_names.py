"""What a LightningModule's attributes are called on a Trainer, for the AttributeError a ported step meets.

A Trainer is both Lightning's module and its trainer, so ``self.current_epoch`` or ``self.trainer.global_step``
has an ampkit spelling; the error names it instead of only saying the attribute does not exist. So do the
TypeErrors of Lightning's arguments to fit/validate/test/predict (``ckpt_path=``, a model given first)."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
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
        "training epoch's on_epoch means), each kept after fit(), its values Python floats where Lightning's "
        "are tensors: a port's .item() is the value itself"
    ),
    "logged_metrics": (
        "nothing kept per step: log() hands its values to TensorBoard; self.epoch_scalars holds the latest epoch's "
        "on_epoch means, its values Python floats where Lightning's are tensors"
    ),
    "progress_bar_metrics": (
        "nothing: the bar shows what training_step returns, and the epoch line the epoch means of on_epoch tags and "
        "what on_train_epoch_end hooks log (no prog_bar)"
    ),
    "checkpoint_callback": (
        "the ModelCheckpoint among self.callbacks (the config's checkpoint section, or one given in code, whose "
        "best_model_path, best_model_score, best_k_models, current_score, kth_best_model_path, kth_value, "
        "last_model_path and dirpath answer as Lightning's)"
    ),
    "checkpoint_callbacks": "[cb for cb in self.callbacks if isinstance(cb, ampkit.callbacks.ModelCheckpoint)]",
    "early_stopping_callback": "the EarlyStopping among self.callbacks (the config's early_stopping section)",
    "early_stopping_callbacks": "[cb for cb in self.callbacks if isinstance(cb, ampkit.callbacks.EarlyStopping)]",
    "hparams": "self.cfg (the resolved config)",
    "save_hyperparameters": "nothing: self.cfg is saved in every checkpoint and in the run directory",
    "toggle_optimizer": "self.backward(loss, optimizer=opt), which gives only that optimizer's parameters grads",
    "untoggle_optimizer": "nothing: self.backward(loss, optimizer=opt) limits the grads of that backward only",
    "clip_gradients": "trainer.clip_grad_norm in the config (clipping of unscaled gradients, per optimizer)",
    "print": "print() under if self.is_global_zero",
    "batch_idx": "self.state.batch_idx",
    "estimated_stepping_batches": (
        "self.num_training_steps (None where Lightning's is inf or -1: no max_epochs nor max_steps, or a loader "
        "without a length and no max_steps)"
    ),
    "num_training_batches": "self.num_train_batches (this rank's batches per epoch, after limit_train_batches)",
    "max_epochs": "self.cfg.trainer.max_epochs",
    "max_steps": "self.cfg.trainer.max_steps",
    "accumulate_grad_batches": "self.cfg.trainer.accumulate_grad_batches",
    "num_sanity_val_steps": "self.cfg.trainer.num_sanity_val_steps",
    "check_val_every_n_epoch": "self.cfg.trainer.val_every_n_epochs",
    "val_check_interval": "self.cfg.trainer.val_every_n_steps (in iterations counted over the whole run)",
    "log_every_n_steps": "self.cfg.logging.log_every_n_steps",
    "log_dir": "self.version_dir (the run's version_N directory; TensorBoard writes under its tensorboard/)",
    "default_root_dir": "self.cfg.run_dir",
    "lightning_module": "self (a Trainer is Lightning's module and trainer in one)",
    "local_rank": "self.dist.local_rank",
    "sanity_checking": "self.state.stage == 'sanity' (the validation before training)",
    "lr_schedulers": (
        "nothing to step: each scheduler configure_optimizers returned steps after its optimizer's steps, as its "
        "interval and frequency say, under manual optimization too (a scheduler stepped again here would step twice)"
    ),
}


# A LightningModule's hooks without the on_ prefix, which a Trainer never calls -> what does their work here. One a
# ported Trainer defines would silently never run (an on_... one that is no hook is refused as misspelt already).
LIGHTNING_MODULE_HOOKS: dict[str, str] = {
    "setup": (
        "configure_model() builds the model and the *_dataloader() methods the data, each called once per run; work "
        "for every run goes in __init__"
    ),
    "teardown": "on_fit_end, which runs at the end of every fit, also after an exception",
    "configure_sharded_model": "configure_model(), which returns the model (FSDP shards it: distributed.strategy)",
    "training_epoch_end": "on_train_epoch_end(self); an epoch's means are self.epoch_scalars",
    "validation_epoch_end": "on_validation_end(self, metrics), metrics being validation_step's means over the set",
    "test_epoch_end": "on_test_end(self, metrics), metrics being test_step's means over the set",
    "training_step_end": "training_step itself: what it returns is the step's output",
    "validation_step_end": "validation_step itself: what it returns is averaged over the set",
    "test_step_end": "test_step itself: what it returns is averaged over the set",
    "optimizer_step": (
        "the Trainer's own step (skip rule, clipping, loss scaling); a callback's on_before_optimizer_step runs "
        "before it, or automatic_optimization = False to call self.step(opt) yourself"
    ),
    "optimizer_zero_grad": "the Trainer's zero_grad(set_to_none=True) at each iteration's end (on_before_zero_grad)",
    "lr_scheduler_step": "configure_optimizers' scheduler dict ('interval', 'frequency', 'monitor')",
    "configure_gradient_clipping": (
        "trainer.clip_grad_norm, or a callback's on_before_optimizer_step, where gradients are unscaled"
    ),
    "transfer_batch_to_device": "the Trainer, which moves the tensors of dicts, lists, tuples and dataclasses",
}
# A Lightning Callback's hooks without the on_ prefix -> what does their work in an ampkit Callback.
LIGHTNING_CALLBACK_HOOKS: dict[str, str] = {
    "setup": "on_fit_start (a fit) and on_evaluation_setup (a standalone validate, test or predict)",
    "teardown": "on_fit_end, which runs at the end of every fit, also after an exception",
}
# Lightning's on_... hooks (a LightningModule's or a Callback's) the Trainer never calls -> what does their work here,
# for the error that refuses one (a near name would guess wrong: on_before_batch_transfer is no on_before_backward).
_EVAL_MODE = "nothing: the Trainer puts the model in eval mode to evaluate and back in train mode after"
LIGHTNING_ON_HOOKS: dict[str, str] = {
    "on_sanity_check_start": "on_validation_start, where trainer.state.stage == 'sanity' in the sanity validation",
    "on_sanity_check_end": "on_validation_end, where trainer.state.stage == 'sanity' in the sanity validation",
    "on_validation_epoch_start": "on_validation_start",
    "on_validation_epoch_end": (
        "on_validation_end, whose metrics are validation_step's means over the set (a value logged there may be "
        "monitored)"
    ),
    "on_validation_batch_start": "validation_step itself (on_validation_batch_end runs after each batch)",
    "on_test_epoch_start": "on_test_start",
    "on_test_epoch_end": "on_test_end, whose metrics are test_step's means over the set",
    "on_test_batch_start": "test_step itself",
    "on_test_batch_end": "test_step itself: what it returns is averaged over the set, which on_test_end gets",
    "on_predict_epoch_start": "on_predict_start",
    "on_predict_epoch_end": "on_predict_end, which gets every batch's output",
    "on_predict_batch_start": "predict_step itself",
    "on_predict_batch_end": "predict_step itself: on_predict_end gets every batch's output",
    "on_before_batch_transfer": "the DataLoader's collate_fn, which runs before the Trainer moves the batch",
    "on_after_batch_transfer": "the step itself, which gets the batch on the device",
    "on_validation_model_eval": _EVAL_MODE,
    "on_validation_model_train": _EVAL_MODE,
    "on_test_model_eval": _EVAL_MODE,
    "on_test_model_train": _EVAL_MODE,
    "on_validation_model_zero_grad": "nothing: evaluation runs under torch.no_grad() and leaves gradients alone",
    "on_epoch_start": "on_train_epoch_start",  # Lightning 1.x
    "on_epoch_end": "on_train_epoch_end",
    "on_batch_start": "on_train_batch_start",
    "on_batch_end": "on_train_batch_end",
    "on_pretrain_routine_start": "on_fit_start",
    "on_pretrain_routine_end": "on_fit_start",
    "on_keyboard_interrupt": "on_exception, which gets the KeyboardInterrupt",
    "on_init_start": "__init__",
    "on_init_end": "__init__",
}
# Of these, names a class may use for a helper of its own: Lightning's only where they take Lightning's 'stage'.
_TAKES_STAGE = ("setup", "teardown")


def lightning_only_hooks(cls: type, base: type, hooks: dict[str, str]) -> list[str]:
    """The Lightning hooks among ``hooks`` (:data:`LIGHTNING_MODULE_HOOKS`, :data:`LIGHTNING_CALLBACK_HOOKS`) that
    ``cls`` or a mixin defines below ``base``: ``setup``/``teardown`` only with a ``stage`` argument, as a helper of
    that name may be the class's own."""
    found = []
    for name in hooks:
        owner = next((klass for klass in cls.__mro__ if name in vars(klass)), None)
        if owner is None or owner in base.__mro__ or not callable(vars(owner)[name]):
            continue
        if name in _TAKES_STAGE:
            try:
                if "stage" not in inspect.signature(vars(owner)[name]).parameters:
                    continue
            except (TypeError, ValueError):  # no signature to read
                continue
        found.append(name)
    return found


# Lightning's callback classes that ampkit.callbacks has none of -> what does their work here, for the ImportError of
# a ported ``from ampkit.callbacks import LearningRateMonitor``.
LIGHTNING_CALLBACKS: dict[str, str] = {
    "LearningRateMonitor": (
        "the TensorBoard logger (logging.tensorboard), which writes each optimizer's learning rate as "
        "train/lr/<optimizer> every logging.log_every_n_steps, and its momentum with logging.log_momentum=true"
    ),
    "Timer": "trainer.max_time, the MaxTime callback",
    "ModelSummary": "the start banner, which counts the parameters (trainer.progress_bar)",
    "RichModelSummary": "the start banner, which counts the parameters (trainer.progress_bar)",
    "TQDMProgressBar": "ProgressBar (trainer.progress_bar): a bar in a terminal, plain lines otherwise",
    "RichProgressBar": "ProgressBar (trainer.progress_bar): a bar in a terminal, plain lines otherwise",
    "ThroughputMonitor": "Throughput (logging.throughput): samples/s, tokens/s, TFLOP/s and MFU",
    "GradientAccumulationScheduler": "trainer.accumulate_grad_batches, one count for the whole run",
    "LambdaCallback": "a Callback subclass that overrides the hooks it needs",
    "BackboneFinetuning": (
        "a hook of your own: in on_train_epoch_start, requires_grad_(True) and optimizer.add_param_group(...); "
        "checkpoints restore both"
    ),
    "BaseFinetuning": (
        "a hook of your own: in on_train_epoch_start, requires_grad_(True) and optimizer.add_param_group(...); "
        "checkpoints restore both"
    ),
    "BasePredictionWriter": "trainer.predict(output=path), which saves the predictions (one file per rank)",
    "Checkpoint": "ModelCheckpoint",
}


# What a Lightning logger's attributes are called on ``trainer.logger`` (ampkit's Logger), for a ported
# ``self.logger.experiment.add_scalar(...)``.
LIGHTNING_LOGGER_NAMES: dict[str, str] = {
    "experiment": (
        "self.log(tag, value) for scalars, and self.logger.log_image, log_histogram and log_text for the rest, "
        "which write in the run's step order and stop the run on a failed write"
    ),
    "log_metrics": "self.log(tag, value) for each metric",
    "log_hyperparams": "nothing: the run's config is written as TensorBoard hparams at the start of each fit",
    "log_graph": "nothing: the model's graph is not written",
    "log_dir": "self.version_dir / 'tensorboard' (the event files' directory, while TensorBoard logs)",
    "save_dir": "self.cfg.run_dir",
    "root_dir": "self.cfg.run_dir",
    "version": "self.version_dir.name (version_N)",
    "name": "self.version_dir.name (version_N) under self.cfg.run_dir",
    "finalize": "nothing: the TensorBoard logger closes its files at the end of each fit",
    "save": "nothing: the TensorBoard logger flushes its files itself",
}


def missing_attribute(obj: Any, name: str, names: dict[str, str] = LIGHTNING_NAMES) -> AttributeError:
    """The AttributeError for ``obj.name``: with the ampkit spelling when ``name`` is Lightning's (among ``names``)."""
    message = f"'{type(obj).__name__}' object has no attribute '{name}'"
    if name in names:
        message += f" (Lightning's name; here it is {names[name]})"
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


# Lightning's arguments of Trainer.fit/validate/test/predict -> what does their work here ({method}: the method called,
# {ckpt}: its checkpoint argument, {loader}: its dataloader method).
LIGHTNING_RUN_ARGUMENTS: dict[str, str] = {
    "ckpt_path": "is {ckpt}= here ({method}({ckpt}='last'), 'best' or a path)",
    "model": "has no place here: the Trainer is the module, so call {method}() on it",
    "dataloaders": "has no place here: the Trainer's {loader}() returns the batches",
    "train_dataloaders": "has no place here: the Trainer's train_dataloader() returns the batches",
    "val_dataloaders": "has no place here: the Trainer's val_dataloader() returns the batches",
    "datamodule": "has no place here: the Trainer's *_dataloader() methods return the batches",
    "verbose": "has no place here: {method}() prints nothing and returns its results (ampkit {method} prints them)",
    "return_predictions": "has no place here: predict() returns them always (output= saves them too)",
    "weights_only": "has no place here: every checkpoint is loaded with weights_only=True",
}
_RUN_ARGUMENT_NAMES = {
    "fit": ("resume", "train_dataloader"),
    "validate": ("ckpt", "val_dataloader"),
    "test": ("ckpt", "test_dataloader"),
    "predict": ("ckpt", "predict_dataloader"),
}


def _looks_like_lightning_positional(value: Any) -> bool:
    """Whether a run method's first argument is what Lightning's takes there (a model, a Trainer, a DataLoader)
    rather than a checkpoint: anything with parameters or a training_step, or an iterable that is no path."""
    if isinstance(value, str | os.PathLike | bytes):
        return False
    return callable(getattr(value, "parameters", None)) or hasattr(value, "training_step") or hasattr(value, "__iter__")


def run_arguments_error(method: str, args: tuple[Any, ...], kwargs: dict[str, Any], takes: list[str]) -> TypeError:
    """The TypeError for a call of ``method`` (fit, validate, test, predict) whose ``args``/``kwargs`` its parameters
    (``takes``) do not fit: each of Lightning's arguments named with what does its work here, as Python's own
    message names none."""
    ckpt, loader = _RUN_ARGUMENT_NAMES[method]
    fill = {"method": method, "ckpt": ckpt, "loader": loader}
    said = []
    if len(args) > len(takes) or (args and _looks_like_lightning_positional(args[0])):
        said.append(
            f"Lightning's {method}(model, ...) takes a model or loaders first; here the Trainer is the module (call "
            f"{method}() on it) and its {loader}() returns the batches: the first argument is {ckpt}, a checkpoint"
        )
    for name in kwargs:
        if name in takes:
            continue
        if name in LIGHTNING_RUN_ARGUMENTS:
            said.append(f"Lightning's {name} {LIGHTNING_RUN_ARGUMENTS[name].format(**fill)}")
        else:
            said.append(f"it has no argument '{name}'")
    return TypeError(f"{method}() takes {', '.join(takes)}: " + "; ".join(said or ["those arguments do not fit"]))


def refuses_lightning_arguments(method: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a Trainer's fit/validate/test/predict so that Lightning's arguments (``ckpt_path``, a model, loaders)
    are refused naming what does their work here, not with Python's bare 'unexpected keyword argument'."""
    signature = inspect.signature(method)
    takes = list(signature.parameters)[1:]

    @functools.wraps(method)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            signature.bind(self, *args, **kwargs)
            fits = not (args and _looks_like_lightning_positional(args[0]))
        except TypeError:
            fits = False
        if not fits:
            raise run_arguments_error(method.__name__, args, kwargs, takes)
        return method(self, *args, **kwargs)

    return checked
