"""Lightning's Trainer, ModelCheckpoint and EarlyStopping arguments that ampkit's config names otherwise or has no
key for, each with what does its work here: the errors of a config key or a ``Trainer(...)`` keyword a Lightning
user types name it (``val_check_interval`` is ``trainer.val_every_n_steps``) instead of only listing valid keys."""

from __future__ import annotations

import inspect
from typing import Any

from ampkit.wording import shown

# name -> its config key, or "no config key: " and what to set instead; read as "<name> is <value>".
LIGHTNING_SETTINGS: dict[str, str] = {
    "precision": "precision.opt_level",
    "accelerator": "trainer.device",
    "devices": "trainer.device (one process; torchrun starts more)",
    "gradient_clip_val": "trainer.clip_grad_norm",
    "gradient_clip_algorithm": (
        "no config key: clipping is by norm (trainer.clip_grad_norm); to clip by value, call "
        "torch.nn.utils.clip_grad_value_ in a callback's on_before_optimizer_step, where gradients are unscaled"
    ),
    "check_val_every_n_epoch": "trainer.val_every_n_epochs",
    "val_check_interval": (
        "trainer.val_every_n_steps, in iterations counted over the whole run, beside which epoch ends validate too "
        "unless trainer.val_every_n_epochs=0 (Lightning's integer interval replaces them); for a fraction of an epoch "
        "give that share of its iterations, e.g. 100 for 0.25 of 400"
    ),
    "default_root_dir": "run_dir",
    "enable_progress_bar": "trainer.progress_bar",
    "enable_checkpointing": (
        "checkpoint.enabled, which switches the config's ModelCheckpoint off; one given in code still saves (Lightning "
        "refuses one beside enable_checkpointing=False)"
    ),
    "strategy": "distributed.strategy",
    "fast_dev_run": (
        "no config key: trainer.max_epochs=1 trainer.limit_train_batches=1 trainer.limit_val_batches=1 "
        "trainer.num_sanity_val_steps=0 checkpoint.enabled=false logging.tensorboard=false runs one batch of "
        "training and one of validation, writing no checkpoint nor TensorBoard events (for Lightning's "
        "fast_dev_run=N, N batches of each, set both limits to N)"
    ),
    "overfit_batches": (
        "no config key: trainer.limit_train_batches=N with an unshuffled train_dataloader() trains on the same N "
        "batches every epoch (Lightning validates on them too)"
    ),
    "limit_test_batches": "no config key: test runs every batch of test_dataloader()",
    "limit_predict_batches": "no config key: predict runs every batch of predict_dataloader()",
    "min_epochs": "no config key: a stop ends the run when asked; give early stopping a larger patience instead",
    "min_steps": "no config key: a stop ends the run when asked; give early stopping a larger patience instead",
    "every_n_train_steps": "checkpoint.every_n_steps",
    "save_last": "no config key: last.pt is always written",
    "save_on_train_epoch_end": "no config key: a train/ monitor ranks at each epoch's end, any other at validations",
    "check_on_train_epoch_end": "no config key: a train/ monitor counts at each epoch's end, any other at validations",
    "dirpath": "no config key: checkpoints go to <run_dir>/version_N/checkpoints (set run_dir)",
    "filename": "no config key: checkpoint files are named by step (step-N.pt, best-N.pt), whatever the metric",
    "save_weights_only": (
        "no config key: a checkpoint holds everything a resume needs; ampkit.load_model(path) reads its model alone"
    ),
    "train_time_interval": (
        "no config key: checkpoint.every_n_steps saves every N iterations, and a preempted run (SIGTERM) saves the "
        "step it stops at"
    ),
    "strict": (
        "no config key: a monitor a validation does not return is always an error, which the sanity validation finds "
        "before training"
    ),
    "logger": "logging.tensorboard",
    "num_nodes": "no config key: torchrun starts the processes (--nnodes, --nproc-per-node)",
    "enable_model_summary": "no config key: the start banner counts the parameters (trainer.progress_bar=false: none)",
    "reload_dataloaders_every_n_epochs": (
        "no config key: train_dataloader() and val_dataloader() are called once per run; a sampler's set_epoch, "
        "called at each epoch, or a dataset reading self.state.epoch varies the data by epoch"
    ),
    "use_distributed_sampler": (
        "no config key: under torchrun each rank takes its share of a DataLoader's samples (training: a "
        "DistributedSampler, shuffled where its sampler shuffled; evaluation: each sample once); give it your own "
        "DistributedSampler to choose"
    ),
    "inference_mode": "no config key: validate, test and predict run under torch.no_grad()",
    "deterministic": "no config key: call torch.use_deterministic_algorithms(True) before fit()",
    "detect_anomaly": "no config key: call torch.autograd.set_detect_anomaly(True) before fit()",
}

# What Lightning's None for a ModelCheckpoint interval does here (ampkit takes both intervals at once, Lightning one).
LIGHTNING_NONE_INTERVAL = (
    "Lightning's None saves every epoch where no other interval is set, else not by epoch: give every_n_epochs=1, or "
    "every_n_steps=N with every_n_epochs=0 (0: never)"
)

# What Lightning's 0 for a setting ampkit counts from 1 (or -1) does here, for the error that refuses the 0.
LIGHTNING_ZERO: dict[str, str] = {
    "save_top_k": "Lightning's 0 (save none) is checkpoint.enabled=false",
    "patience": "Lightning's 0 stops at the first validation without improvement, as 1 does here",
}

# Lightning's ModelCheckpoint and EarlyStopping arguments that ampkit's classes lack -> what does their work here; read
# as "<name>: <value>". A port passing one hears that, not only "unexpected keyword argument".
LIGHTNING_CALLBACK_ARGUMENTS: dict[str, dict[str, str]] = {
    "ModelCheckpoint": {
        "dirpath": "checkpoints go to <run_dir>/version_N/checkpoints (set run_dir in the config)",
        "filename": (
            "files are named by step (step-N.pt, epoch-N.pt, best-N.pt), whatever the metric; best_k_models maps "
            "each best file to its value"
        ),
        "auto_insert_metric_name": (
            "files are named by step, never by the metric; the {epoch} and {step} fields of CHECKPOINT_NAME_LAST "
            "always carry their names (epoch=3-last.pt)"
        ),
        "every_n_train_steps": "every_n_steps",
        "save_last": "last.pt is always written (a copy of the newest checkpoint)",
        "save_on_train_epoch_end": "a train/ monitor ranks at each epoch's end, any other at validations",
        "save_weights_only": "a checkpoint holds everything a resume needs; ampkit.load_model(path) reads its model",
        "train_time_interval": "every_n_steps saves every N iterations, and a SIGTERM saves the step it stops at",
        "enable_version_counter": "each fresh run writes its own version_N, never over an earlier one's files",
        "verbose": "best_k_models and best_model_path say what was ranked",
    },
    "EarlyStopping": {
        "check_on_train_epoch_end": "a train/ monitor counts at each epoch's end, any other at validations",
        "strict": "a monitor a validation does not return is always an error, found by the sanity validation",
        "verbose": "a stop is always said on the console (rank zero's), with its reason",
        "log_rank_zero_only": "rank zero alone says why the run stopped",
    },
}

# Lightning's ModelCheckpoint and EarlyStopping attributes that ampkit's classes compute (read-only properties) -> how,
# and what to set instead where anything does their work; read as "<class> computes it, <value>". A port assigning one
# (Lightning's are plain attributes) hears that, not Python's "property has no setter".
LIGHTNING_COMPUTED_ATTRIBUTES: dict[str, dict[str, str]] = {
    "ModelCheckpoint": {
        "best_model_path": (
            "from the checkpoints it ranked (a resume restores it); to evaluate another file, give its path to "
            "trainer.validate(ckpt=...) or trainer.test(ckpt=...)"
        ),
        "best_model_score": "as best_model_path's monitored value",
        "best_k_models": "from the checkpoints it ranked (a resume restores it); save_top_k sets how many it keeps",
        "kth_best_model_path": "as the ranked checkpoint a better value replaces next",
        "kth_value": "as kth_best_model_path's monitored value, the one to beat",
        "current_score": "as the monitored value of the checkpoint that entered the top k last",
        "last_model_path": "as the newest checkpoint's copy once the run saved (CHECKPOINT_NAME_LAST names the file)",
    },
    "EarlyStopping": {
        "wait_count": "from wait (the checks in a row without an improvement): set wait instead (0: count afresh)",
        "best_score": "from best (the best value so far): set best instead (None: the next check sets it)",
    },
}

# Lightning's order of each class's first arguments: a positional call written for it binds them to ampkit's others.
LIGHTNING_POSITIONAL_ORDER: dict[str, str] = {
    "ModelCheckpoint": "dirpath, filename, monitor, verbose, save_last, save_top_k",
    "EarlyStopping": "monitor, min_delta, patience",
}


def ampkit_class_named(cls: type, table: dict[str, Any]) -> type | None:
    """The class of ampkit's own in ``cls``'s line (``cls`` itself, or the one a subclass extends) that ``table`` is
    keyed by, or None. Known by its module as well as its name: a port's drop-in ``class ModelCheckpoint(...)`` of its
    own shares the name."""
    return next((k for k in cls.__mro__ if k.__name__ in table and k.__module__.startswith("ampkit.")), None)


def lightning_positional_error(cls: type, name: str, value: Any, refusal: str | None = None) -> ValueError:
    """The refusal of ``value`` given for ``cls``'s argument ``name`` where a call by Lightning's positional order puts
    one of its other arguments (``EarlyStopping("val_loss", 0.01, 5)``: min_delta where ampkit takes ``mode``).
    ``refusal`` is the error the value gets as this argument (by keyword too: the order is only a likely cause)."""
    base = ampkit_class_named(cls, LIGHTNING_POSITIONAL_ORDER)  # a subclass's own __init__ aside
    parameters = list(inspect.signature(base.__init__).parameters.values())[1:]
    ours = [p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    head = refusal or f"{cls.__name__}: {name}={shown(value)} is invalid"
    return ValueError(
        f"{head}; a call written for Lightning's positional order ({LIGHTNING_POSITIONAL_ORDER[base.__name__]}) puts "
        f"its arguments here: pass them by keyword, as {base.__name__}'s own order is ({', '.join(ours)})"
    )


def lightning_arguments_error(cls: type, names: list[str]) -> TypeError:
    """The TypeError of ``cls(**kwargs)`` given arguments ``names`` it lacks: each Lightning one with what does its
    work here (``every_n_train_steps: every_n_steps``), and the arguments ``cls`` takes."""
    # A subclass (class MyCheckpoint(ModelCheckpoint)) takes the arguments of the ampkit class it extends
    base = ampkit_class_named(cls, LIGHTNING_CALLBACK_ARGUMENTS)
    known = {} if base is None else LIGHTNING_CALLBACK_ARGUMENTS[base.__name__]
    said = [f"{name} (Lightning's; here: {known[name]})" if name in known else name for name in sorted(names)]
    parameters = inspect.signature(cls.__init__).parameters.values()
    takes = [p.name for p in parameters if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]
    return TypeError(f"{cls.__name__}() got arguments it does not take: {'; '.join(said)}. It takes {', '.join(takes)}")
