"""What a run checks before it trains, so a mistake costs seconds rather than an epoch: monitored metrics need
validation data and a validation interval (at construction), an empty validation loader is an error when a
metric is monitored and a warning otherwise (at set-up), and a sanity validation on the first
``trainer.num_sanity_val_steps`` batches proves ``validation_step`` runs and returns every monitored metric."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from lightning_utilities.core.rank_zero import rank_zero_warn
from omegaconf import DictConfig, OmegaConf

from ampkit.config import ConfigError
from ampkit.trainer.distributed import DistributedEnv, broadcast_object, gather_object, no_batch_under_fsdp
from ampkit.trainer.evaluation import average_metrics
from ampkit.trainer.rng import capture_rng, restore_rng
from ampkit.trainer.user_code import no_batches_message
from ampkit.wording import counted, shown

if TYPE_CHECKING:
    from ampkit.trainer.trainer import Trainer

_MONITOR_KEYS = ("checkpoint.monitor", "early_stopping.monitor")
# The way out of a validation monitor a run cannot meet: a training value, which needs no validation.
_TRAINING_HINT = (
    "; to monitor a training value instead, log it in training_step with self.log('train/<name>', value, "
    "on_epoch=True) and monitor 'train/<name>' (its epoch mean, checked at each epoch's end)"
)


def is_training_metric(metric: str) -> bool:
    """Whether a monitor names a ``train/`` tag: the epoch mean of ``log(..., on_epoch=True)``, read at each epoch's
    end (Lightning's ``check_on_train_epoch_end``), not a validation metric."""
    return metric.startswith("train/")


def epoch_mean(means: dict[str, float], metric: str) -> float | None:
    """A monitored ``train/`` tag's value among an epoch's ``means`` (``train/loss_epoch`` for ``train/loss`` logged
    with ``on_step`` too, as Lightning's monitors find it), or None when it was not logged."""
    return means.get(metric, means.get(f"{metric}_epoch"))


def unprefixed_note(metric: str, logged: Iterable[str]) -> str:
    """``"'m' is logged without the train/ prefix...; "`` where a monitor of ``train/m`` found ``m`` among the
    ``logged`` names (only train/ tags are training metrics), else ``""``: the start of a message's advice."""
    bare = metric.removeprefix("train/")
    return f"'{bare}' is logged without the train/ prefix a monitored tag needs; " if bare in logged else ""


def monitored_metrics(cfg: DictConfig, training: bool = False) -> dict[str, str]:
    """The validation metrics the config monitors, by config key; with ``training`` its ``train/`` epoch means
    instead (which need no validation)."""
    monitors = {key: OmegaConf.select(cfg, key) for key in _MONITOR_KEYS}
    if not cfg.checkpoint.enabled:
        monitors.pop("checkpoint.monitor")
    return {key: metric for key, metric in monitors.items() if metric and is_training_metric(metric) == training}


def check_monitors_can_be_met(cfg: DictConfig, trainer_name: str, has_val_dataloader: bool) -> None:
    """A monitored metric needs validation: a ``val_dataloader`` and a validation interval."""
    monitors = monitored_metrics(cfg)
    if not monitors:
        return
    key, metric = next(iter(monitors.items()))
    if not has_val_dataloader:
        raise ConfigError(
            f"config key '{key}': monitors {shown(metric)}, but {trainer_name} defines no val_dataloader(); "
            f"define it (and validation_step), or set {key}=null{_TRAINING_HINT}"
        )
    t = cfg.trainer
    if t.val_every_n_epochs == 0 and t.val_every_n_steps == 0:
        raise ConfigError(
            f"config key '{key}': monitors {shown(metric)}, but validation never runs (trainer.val_every_n_epochs=0 "
            "and trainer.val_every_n_steps=0)"
        )


def check_epoch_scheduler_monitors(trainer: Trainer) -> None:
    """A strict scheduler stepping on a validation metric at epoch ends needs a validation before its first step:
    refused before training, not with a KeyError after the first epoch (Lightning asks the same of 'frequency'). One
    monitoring a ``train/`` epoch mean steps at epoch ends, where that mean is known."""
    t = trainer.settings
    for spec in trainer._specs:
        for sched in spec.schedulers:
            which = f"the scheduler '{sched.name}'" if sched.name else "the scheduler"
            if sched.monitor is not None and is_training_metric(sched.monitor) and sched.interval != "epoch":
                raise ConfigError(
                    f"{which} of optimizer '{spec.name}' monitors {shown(sched.monitor)}, an epoch mean known at epoch "
                    f"ends only, but steps every {sched.interval}: give it 'interval': 'epoch'"
                )
            if sched.monitor is None or is_training_metric(sched.monitor):
                continue
            if not sched.strict or sched.interval != "epoch" or t.val_every_n_steps > 0:
                continue
            if trainer._val_loader is None or t.val_every_n_epochs == 0:
                raise ConfigError(
                    f"{which} of optimizer '{spec.name}' monitors {shown(sched.monitor)}, but validation never runs "
                    f"(trainer.val_every_n_epochs={t.val_every_n_epochs}, or no val_dataloader()): validate, or give "
                    "it 'strict': False"
                )
            if sched.frequency < t.val_every_n_epochs:
                raise ConfigError(
                    f"{which} of optimizer '{spec.name}' monitors {shown(sched.monitor)} and steps every "
                    f"{sched.frequency} epoch(s), but validation first runs after trainer.val_every_n_epochs="
                    f"{t.val_every_n_epochs}: give it 'frequency': {t.val_every_n_epochs}, or 'strict': False"
                )


def refuse_a_loader_on_some_ranks(source: str, given: list[bool], otherwise: str) -> None:
    """Raise naming the ranks unless ``source`` gave a loader on every rank or on none (``given``: per rank). Every
    rank takes part in each pass, whose end gathers every rank's results: the ranks with a loader would wait there
    for the others until the timeout."""
    if any(given) and not all(given):
        missing = ", ".join(str(rank) for rank, has in enumerate(given) if not has)
        present = ", ".join(str(rank) for rank, has in enumerate(given) if has)
        raise ValueError(
            f"{source} returned None on rank(s) {missing} but a loader on rank(s) {present}: every rank takes part in "
            "each pass (its end gathers every rank's results), so the others would wait there until "
            "distributed.timeout_s; return a loader on every rank (an empty list on a rank with no batches; a "
            f"map-style DataLoader is sharded across the ranks for you), {otherwise}"
        )


def refuse_an_empty_rank_under_fsdp(source: str, counts: list[int | None]) -> None:
    """Raise where ``source`` is known to give a rank no batch while another has some (``counts``: per rank, None
    where unknown): under FSDP each pass would refuse it on every rank, so a fit refuses it before training."""
    empty = [rank for rank, count in enumerate(counts) if count == 0]
    others = [count for count in counts if count]
    if empty and others:
        raise no_batch_under_fsdp(source, empty, min(others))


def usable_validation_loader(
    cfg: DictConfig,
    loader: Any,
    num_batches: int | None,
    env: DistributedEnv,
    validates: bool = True,
    sharded: bool = False,
) -> Any:
    """``loader``, or None when it has no batches (with a warning that validation is skipped, naming why as the train
    loader's error does); no validation data at all is an error when a metric is monitored.

    Under torchrun the ranks decide together (one gather, at set-up): every rank takes part in each validation, whose
    end gathers their metrics, so one whose loader is empty while another's has batches keeps it and runs each pass
    with none (its metrics weigh nothing, as in ``validate()``); a loader on some ranks only is refused on all, and so
    is, under FSDP (``sharded``), a rank known to have no batch while another has some, which the first validation
    would refuse after training up to it. In a fit that never ``validates`` each rank decides alone, with no gather:
    no pass runs to wait in."""
    mine = (loader is not None, num_batches)
    ranks = gather_object(mine, env) if validates else [mine]
    given = [has_loader for has_loader, _ in ranks]
    refuse_a_loader_on_some_ranks("val_dataloader()", given, "or None on every rank to not validate")
    if sharded and validates:
        refuse_an_empty_rank_under_fsdp("val_dataloader()", [count for _, count in ranks])
    empty = any(given) and all(count == 0 for _, count in ranks)
    if any(given) and not empty:
        return loader
    monitors = monitored_metrics(cfg)
    if monitors:
        key, metric = next(iter(monitors.items()))
        why = _no_validation_batches(loader, env.world_size, "validation never runs") if empty else None
        why = why or "val_dataloader() returned None"
        raise ConfigError(f"config key '{key}': monitors {shown(metric)}, but {why}")
    if empty:
        rank_zero_warn(_no_validation_batches(loader, env.world_size, "validation is skipped"))
    return None


def _no_validation_batches(loader: Any, world_size: int, outcome: str) -> str:
    return no_batches_message("val_dataloader", loader, world_size, outcome, "validation then runs to its end")


def sanity_validate(trainer: Trainer, loader: Any) -> None:
    """Run ``validation_step`` on the first ``trainer.num_sanity_val_steps`` batches of ``loader`` and check that
    every monitored metric (config keys, strict scheduler monitors) is among its metrics. It runs under the run's
    precision (``on_validation_start`` and ``_end`` fire with ``state.stage == "sanity"``, which loggers,
    checkpoints and early stopping ignore); the RNG is restored afterwards, so training draws what it would have
    drawn without it."""
    t = trainer.settings
    if loader is None or t.num_sanity_val_steps == 0 or t.val_every_n_epochs == t.val_every_n_steps == 0:
        return
    limit = sanity_batches(t.num_sanity_val_steps, trainer._val_limit)
    rng = capture_rng()
    trainer.state.stage = "sanity"
    try:
        trainer.fire("on_validation_start")
        metrics = average_metrics(trainer, loader, trainer.validation_step, limit, first_batch=trainer._val_first_batch)
        trainer._fire_evaluation_end("on_validation_end", metrics)
    finally:
        trainer.state.stage = "fit"
    restore_rng(rng)
    # A tag an on_validation_end hook logs is monitored as a validation metric; the sanity pass's are no run's values.
    logged, trainer.validation_end_values = trainer.validation_end_values, {}
    monitored = {**monitored_metrics(trainer.cfg), **monitors_given_in_code(trainer.callbacks)}
    for spec in trainer._specs:
        for sched in spec.schedulers:
            if sched.monitor is not None and sched.strict and not is_training_metric(sched.monitor):
                monitored[f"the scheduler of optimizer '{spec.name}'"] = sched.monitor
    if any(metric.removeprefix("val/") not in metrics for metric in monitored.values()):
        # rank zero's tags, which the run monitors (Trainer.monitored_validation_value): one logged there alone was
        # refused on the other ranks only, which left rank zero training alone. Every rank's metrics have the same
        # keys, so all of them take this collective or none.
        logged = broadcast_object(sorted(logged), trainer.dist)
    total = trainer.num_val_batches
    for key, metric in monitored.items():
        if metric.removeprefix("val/") not in metrics and metric not in logged:
            where = f"config key '{key}'" if "." in key else key
            setting = f"={total} (all its batches) or 0" if total else "=-1 (all its batches) or 0"
            later = (
                f"; a metric only later batches return (a second validation set) needs trainer.num_sanity_val_steps"
                f"{setting}"
                if limit is not None and (total is None or limit < total)
                else ""
            )
            checked = "all its batches" if limit is None else counted(limit, "batch", "batches")
            raise ConfigError(
                f"{where}: monitors {shown(metric)}, which is not a validation metric; validation_step returns "
                f"{', '.join(f'val/{m}' for m in metrics) or 'nothing'}"
                + (f" and on_validation_end logs {', '.join(sorted(logged))}" if logged else "")
                + f" (checked before training on {checked}, trainer.num_sanity_val_steps="
                f"{t.num_sanity_val_steps}{later}); or log it in on_validation_end with "
                f"self.log({shown(metric)}, value)"
                f" (an on_validation_end that returns early in the sanity pass, state.stage == 'sanity', must log it "
                f"there too; trainer.num_sanity_val_steps=0 skips this check)"
                + (_TRAINING_HINT if "." in key else "")
                + (_COUNTER_HINT if metric in ("epoch", "step") else "")
            )


# Lightning adds its loop counters to what a ModelCheckpoint may monitor: monitor='epoch', mode='max' keeps the newest.
_COUNTER_HINT = (
    "; Lightning's 'epoch' and 'step' are its loop counters, which no validation returns here: to keep the newest k "
    "checkpoints, give ModelCheckpoint no monitor and keep_last=k (checkpoint.keep_last), with every_n_epochs or "
    "every_n_steps"
)


def monitors_given_in_code(callbacks: list[Any]) -> dict[str, str]:
    """The validation metrics a ModelCheckpoint or EarlyStopping given in code (or by ``configure_callbacks``)
    monitors, by how a message names it (``ModelCheckpoint(monitor='val/acc')``): checked as the config's are, so a
    misspelt one is found before training rather than at the first validation."""
    from ampkit.callbacks.monitor import KeyedByMonitor  # lazily: it reads this module's is_training_metric

    return {
        f"{cb.name}(monitor='{cb.monitor.metric}')": cb.monitor.metric
        for cb in callbacks
        # the config's name their config key and are checked as such; a train/ one needs no validation
        if isinstance(cb, KeyedByMonitor)
        and cb.monitor is not None
        and cb.monitor.setting is None
        and not cb.monitor.per_epoch
    }


def sanity_batches(num_sanity_val_steps: int, limit_val_batches: int | None) -> int | None:
    """How many validation batches the sanity validation runs (None: all): ``num_sanity_val_steps`` (-1: all, as in
    Lightning), never more than ``limit_val_batches``, so it validates no batch a validation run would leave out."""
    limits = [n for n in (num_sanity_val_steps, limit_val_batches) if n is not None and n >= 0]
    return min(limits) if limits else None
