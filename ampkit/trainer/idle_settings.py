"""Settings that would do nothing, or less than they say, in the run about to start: named at fit start, since
a run that trains on without them looks like one that used them."""

from __future__ import annotations

from omegaconf import DictConfig

from ampkit.trainer.optimizers import OptimizerSpec, SchedulerSpec
from ampkit.trainer.sanity import monitored_metrics
from ampkit.wording import counted, shown


def idle_settings(
    cfg: DictConfig,
    trainer_name: str,
    has_validation: bool,
    defines_validation: bool,
    batches_per_epoch: int | None,
    training_steps: int | None,
    specs: list[OptimizerSpec] | None = None,
) -> list[str]:
    """One warning per setting this run cannot honour. ``has_validation``: a validation loader with batches;
    ``defines_validation``: the Trainer overrides ``val_dataloader``; ``batches_per_epoch`` and ``training_steps``
    (:attr:`Trainer.num_training_steps`) are None where the loader has no length; ``specs``: the optimizers and
    their LR schedulers."""
    t = cfg.trainer
    found = []
    for spec in specs or []:
        for sched in spec.schedulers:
            if why := _idle_scheduler(cfg, spec.name, sched, batches_per_epoch, training_steps):
                found.append(why)
    if training_steps is not None and 0 <= t.max_epochs and training_steps < t.max_steps:
        found.append(
            f"trainer.max_steps={t.max_steps} is never reached: trainer.max_epochs={t.max_epochs} ends the run after "
            f"{counted(training_steps, 'step')} (Lightning's max_steps alone lifts its epoch "
            "limit; here set trainer.max_epochs=-1 for none, or raise it)"
        )
    if batches_per_epoch is not None and t.accumulate_grad_batches > batches_per_epoch:
        found.append(
            f"trainer.accumulate_grad_batches={t.accumulate_grad_batches} is more than the {batches_per_epoch} "
            f"batches of an epoch: each epoch steps once, on {batches_per_epoch} batches whose losses are each "
            f"divided by {t.accumulate_grad_batches}, so its gradient is {batches_per_epoch}/"
            f"{t.accumulate_grad_batches} of a full window's. Set it to at most {batches_per_epoch}"
        )
    every = cfg.logging.log_every_n_steps
    if cfg.logging.tensorboard and training_steps is not None and 0 < training_steps < every:
        found.append(
            f"logging.log_every_n_steps={every} is more than this run's {counted(training_steps, 'iteration')}: "
            "TensorBoard gets "
            "no learning rate, gradient norm or log(on_step) value of any step, only the losses' mean at the end "
            f"(Lightning warns likewise); set it to at most {training_steps}"
        )
    if batches_per_epoch is None and (waiting := _waiting_for_epoch_end(cfg, has_validation)):
        found.append(
            f"train_dataloader() has no length, so an epoch ends only where its data does, and {waiting} only at "
            "an epoch's end: a stream that never ends (or runs for days) gets none before the run stops, and a crash "
            "leaves nothing to resume. Set checkpoint.every_n_steps (and trainer.val_every_n_steps), or "
            "trainer.limit_train_batches for epochs of that many batches"
        )
    trained = " and ".join(f"{key}={shown(metric)}" for key, metric in monitored_metrics(cfg, training=True).items())
    if batches_per_epoch is None and trained:
        found.append(
            f"train_dataloader() has no length, so an epoch ends only where its data does, and {trained} (an epoch "
            "mean) is checked only then: a stream that never ends ranks and stops on nothing. Set "
            "trainer.limit_train_batches for epochs of that many batches, or monitor a validation metric with "
            "trainer.val_every_n_steps"
        )
    if not defines_validation:
        if t.val_every_n_steps > 0:
            found.append(
                f"trainer.val_every_n_steps={t.val_every_n_steps} does nothing: {trainer_name} defines no "
                "val_dataloader() (define it and validation_step, or leave the setting at 0)"
            )
    elif has_validation and (t.val_every_n_epochs > 0 or t.val_every_n_steps > 0):
        monitors = ", ".join(f"{key}={shown(metric)}" for key, metric in monitored_metrics(cfg).items())
        # The default interval in a run of fewer steps than an epoch (a quick try-out) passes unless monitored.
        asked = monitors or t.val_every_n_steps > 0 or t.val_every_n_epochs > 1
        never = _validation_never_runs(cfg, batches_per_epoch, training_steps) if asked else None
        if never is not None:
            found.append(
                f"validation never runs in this run: {never}"
                + (f", and no value reaches {monitors}" if monitors else "")
                + ". Lower the interval, or train longer"
            )
    return found


def _waiting_for_epoch_end(cfg: DictConfig, has_validation: bool) -> str:
    """What this run does only at an epoch's end (``checkpoints (checkpoint.every_n_steps=0)``), or ``""``."""
    t, c = cfg.trainer, cfg.checkpoint
    waiting = []
    if c.enabled and c.every_n_steps == 0:
        waiting.append("checkpoints are written (checkpoint.every_n_steps=0)")
    if has_validation and t.val_every_n_steps == 0 and t.val_every_n_epochs > 0:
        waiting.append("validation runs (trainer.val_every_n_steps=0)")
    return " and ".join(waiting)


def _full_epochs(cfg: DictConfig, batches_per_epoch: int | None) -> int | None:
    """The epochs the run finishes (``max_steps`` may end it within one); None when that is unknown."""
    t = cfg.trainer
    if t.max_steps < 0:
        return t.max_epochs if t.max_epochs >= 0 else None
    if batches_per_epoch is None:
        return None
    by_steps = t.max_steps // -(-batches_per_epoch // t.accumulate_grad_batches)
    return by_steps if t.max_epochs < 0 else min(t.max_epochs, by_steps)


def _idle_scheduler(
    cfg: DictConfig, optimizer: str, sched: SchedulerSpec, batches_per_epoch: int | None, training_steps: int | None
) -> str | None:
    """Why an LR scheduler takes no step before training ends, or None: most often one that steps per epoch (the
    default interval, as in Lightning) in a run of one epoch, or shorter, which was meant to step per iteration."""
    which = f"LR scheduler '{sched.name}'" if sched.name else f"the LR scheduler {type(sched.scheduler).__name__}"
    if sched.interval == "epoch":
        epochs = _full_epochs(cfg, batches_per_epoch)
        if epochs is None or sched.frequency < epochs:
            return None
        fix = (
            "train for more epochs"  # a monitored one (ReduceLROnPlateau) reads a validation metric per epoch
            if sched.monitor is not None
            else "for a schedule over iterations (warm-up, one-cycle, cosine decay) return it as "
            "{'scheduler': s, 'interval': 'step'}"
        )
        return (
            f"{which} of optimizer '{optimizer}' steps every {sched.frequency} epoch(s), and this run finishes "
            f"{epochs}: the learning rate does not change while it trains; {fix}"
        )
    if training_steps is None or sched.frequency <= training_steps:
        return None
    return (
        f"{which} of optimizer '{optimizer}' steps every {sched.frequency} iterations, and this run trains "
        f"{training_steps}: it never steps. Lower its 'frequency'"
    )


def _validation_never_runs(cfg: DictConfig, batches_per_epoch: int | None, training_steps: int | None) -> str | None:
    """Why neither interval is reached before the run ends (``val_every_n_epochs=5`` with 2 epochs), or None when
    one is, or may be (an unknown length)."""
    t = cfg.trainer
    full_epochs = _full_epochs(cfg, batches_per_epoch)
    if full_epochs is None:
        return None
    if 0 < t.val_every_n_epochs <= full_epochs:
        return None
    if t.val_every_n_steps > 0 and (training_steps is None or t.val_every_n_steps <= training_steps):
        return None
    epochs = (
        "trainer.val_every_n_epochs=0"
        if t.val_every_n_epochs == 0
        else f"trainer.val_every_n_epochs={t.val_every_n_epochs} is more than its {counted(full_epochs, 'full epoch')}"
    )
    steps = (
        "trainer.val_every_n_steps=0"
        if t.val_every_n_steps == 0
        else f"trainer.val_every_n_steps={t.val_every_n_steps} is more than its {counted(training_steps, 'step')}"
    )
    return f"{epochs} and {steps}"
