"""The Trainer: owns the loop and fires hooks; every feature lives in a callback.

Order of one ``fit()`` (pinned by ``tests/test_hook_order.py``)::

    set-up: seed → configure_model → configure_optimizers → train/val_dataloader → callbacks → resume
    on_fit_start → sanity validation (``trainer.num_sanity_val_steps`` batches: on_validation_start →
      validation_step → on_validation_end, with ``state.stage == "sanity"``) → on_train_start
    per epoch:  on_train_epoch_start
      per batch:  on_train_batch_start → training_step
                    (backward:  on_before_backward → autograd → on_after_backward)
                    (step, at the end of an iteration:  facts agreed across ranks → on_after_unscale (when
                       a loss was scaled) → on_before_optimizer_step → the skip verdict →
                       optimizer.step() → on_after_optimizer_step   |   on_optimizer_step_skipped)
                  at the end of an iteration: each loss scaler updates once (on_loss_scale_update)
                    → step-interval schedulers (only of optimizers that stepped)
                    → on_before_zero_grad → zero_grad → validation if due (on_validation_start →
                       validation_step → on_validation_batch_end per batch → on_validation_end)
                  → on_train_batch_end
      at the end of the epoch: validation if due → on_train_epoch_end (callbacks up to OBSERVE, the Trainer's own,
                    PERSIST's but the checkpoint writers') → epoch-interval schedulers → on_train_epoch_end of the
                    checkpoint writers (saves_checkpoints)
    on_train_end → on_fit_end (also after an exception, which first fires on_exception)

A standalone ``validate``/``test``/``predict`` (not fitted in this process): seed → configure_model →
checkpoint weights → callbacks → on_evaluation_setup → on_<validation|test|predict>_start → the step per
batch (validate: then on_validation_batch_end) → on_<validation|test|predict>_end. Hooks defined on the
subclass run after the callbacks' hooks, but before the checkpoint's (``Phase.PERSIST``), which saves what they left.

An *iteration* is one accumulation window of ``trainer.accumulate_grad_batches`` batches; ``global_step``
counts iterations. Under ``automatic_optimization`` the Trainer calls ``backward`` on the returned loss
and ``step`` on every optimizer; otherwise ``training_step`` calls ``self.backward(loss, loss_id=...,
optimizer=...)`` and ``self.step(optimizer)`` itself (e.g. a GAN's D step then G step).

Mixed precision, as a reader finds it below: the loss is scaled (``on_before_backward``) → autograd →
gradients unscaled and checked, per loss (``on_after_backward``) → in ``step``: facts agreed across ranks in
one collective (:meth:`Trainer._agree_facts`) → clip (``on_before_optimizer_step``) → the one verdict
(:func:`~ampkit.trainer.state.skip_verdict`) → step or skip → at the end of the iteration each loss scaler
updates once (:meth:`Trainer._end_iteration`).

Callbacks share facts only through the Trainer's state: ``trainer.state`` (loop position),
``trainer.optimizer_state[opt]`` (``loss_ids`` reached it; ``grad_norm_nonfinite``/``found_inf`` make it
skip; ``stepped``/``skipped`` and counts) and ``trainer.loss_state[loss_id]`` (``found_inf`` per loss, agreed
across ranks; ``scaler``/``scale`` when the loss is scaled).
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any, ClassVar

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from lightning_utilities.core.overrides import is_overridden
from lightning_utilities.core.rank_zero import rank_zero_only, rank_zero_warn
from omegaconf import DictConfig, OmegaConf
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from ampkit.amp.patch_scope import without_torch_patches
from ampkit.config import (
    METRIC_NAME_RULE,
    Config,
    ConfigError,
    TrainerConfig,
    build_config,
    check_values,
    is_config_instance,
    plain_config,
)
from ampkit.ops._switches import is_switch
from ampkit.trainer.agreed_start import agreed_checkpoint, agreed_fit_start
from ampkit.trainer.batch_counts import (
    batch_limit,
    checked_count,
    length_may_undercount,
    loader_length,
    shuffled_subset_message,
    yields_more,
)
from ampkit.trainer.batch_layout import (
    RescaledResume,
    batch_layout,
    batches_done_here,
    layout_change,
    order_change_note,
    rescaling,
    saved_accumulation,
)
from ampkit.trainer.callback import HOOKS, Callback, Phase, run_order
from ampkit.trainer.callback_states import states_to_load
from ampkit.trainer.calling_context import grad_mode_for_training, refuse_outer_autocast
from ampkit.trainer.checkpoint_hooks import fire_checkpoint_hook, weights_loaded_before
from ampkit.trainer.checkpoint_io import (
    FORMAT_KEY,
    FORMAT_VERSION,
    CheckpointError,
    from_storage,
    peek_checkpoint,
    save_atomic,
    unloadable_entry,
)
from ampkit.trainer.console import say
from ampkit.trainer.device_skip import DeviceVerdicts, step_with_found_inf, takes_device_found_inf, uses_device_verdicts
from ampkit.trainer.devices import rank_device, resolve_device
from ampkit.trainer.distributed import (
    DistributedEnv,
    DistributedError,
    any_rank,
    any_rank_on_device,
    batch_agreement_group,
    broadcast_object,
    check_equal_batches,
    check_same_config,
    counted_batches,
    decided_by_rank_zero,
    diagnose_failure,
    distributed_loader,
    evaluation_loader,
    gather_object,
    is_communication_failure,
    raise_the_first_failure,
    setup_distributed,
    teardown_distributed,
    warn_of_uneven_evaluation,
    while_every_rank_has_a_batch,
)
from ampkit.trainer.duplicated_data import EvaluationFirstBatch, FirstBatchComparison
from ampkit.trainer.evaluation import (
    INSTEAD_OF_LOG,
    PREDICT,
    TEST,
    VALIDATE,
    Stage,
    average_metrics,
    batch_size,
    collect_predictions,
    warn_of_an_empty_pass,
    warn_of_no_batches,
)
from ampkit.trainer.failure_note import loop_position_note
from ampkit.trainer.finite_weights import check_saved_weights_finite
from ampkit.trainer.fsdp import backward_to, full_norm, uses_fsdp, validate_strategy
from ampkit.trainer.idle_settings import idle_settings
from ampkit.trainer.launch_env import check_launch_environment
from ampkit.trainer.lightning_names import (
    LIGHTNING_NAMES,
    keyword_settings_error,
    missing_attribute,
    refuses_lightning_arguments,
)
from ampkit.trainer.loader_rng import capture_generators, restore_generators, set_sampler_epoch
from ampkit.trainer.loader_workers import StartedWorkers
from ampkit.trainer.logger import Logger
from ampkit.trainer.model_setup import ModelSetup, setup_model, validate_model_setup
from ampkit.trainer.optimizers import (
    MonitorNotFoundError,
    NamedOptimizers,
    OptimizerSpec,
    SchedulerSpec,
    check_group_settings,
    check_parameters,
    group_settings,
    normalize_optimizers,
    refuse_direct_steps,
    refuse_scheduler_overrun,
    settings_kept_from_checkpoint,
    step_,
    step_scheduler,
    zero_grad_,
)
from ampkit.trainer.ordering import FROM_CONFIG, callback_list, order_callbacks
from ampkit.trainer.own_hooks import (
    check_instance_attributes,
    check_lightning_only_hooks,
    check_replaced_methods,
    check_step_signatures,
    models_set_by_hand,
    own_hooks,
    refuse_models_set_by_hand,
)
from ampkit.trainer.param_groups import TRAINABLE_KEY, restore_trainable, trainable_record
from ampkit.trainer.parameter_reach import ParameterReach
from ampkit.trainer.preemption import (
    Preempted,
    interrupt_note,
    sighup_raises,
    sigterm_asks_to_stop,
    uncaught_exits_with_signal_status,
)
from ampkit.trainer.process_runs import enter_run, leave_run
from ampkit.trainer.rank_callbacks import check_collective_callbacks_on_every_rank
from ampkit.trainer.rng import (
    capture_callers_rng,
    capture_rng,
    restore_callers_rng,
    restore_rng,
    rng_not_restored,
    seed_everything,
)
from ampkit.trainer.run_dir import quoted_run_dir, shard_writing_problem, unwritable_reason
from ampkit.trainer.run_life import (
    FitStart,
    RunDirectoryError,
    RunLock,
    discard_new_version_dir,
    finish_interrupted_pruning,
    lineage,
    load_with_fallback_hint,
    loop_of,
    misfit_detail,
    missing_alias_hint,
    open_version_dir,
    plan_fit,
    prediction_output,
    rank_output,
    resolve_checkpoint,
    restarted_from,
    resume_settings_warning,
    save_predictions_beside,
    tidy_run_dir,
    torchrun_launch,
)
from ampkit.trainer.sanity import (
    check_epoch_scheduler_monitors,
    check_monitors_can_be_met,
    epoch_mean,
    is_training_metric,
    refuse_a_loader_on_some_ranks,
    sanity_validate,
    unprefixed_note,
    usable_validation_loader,
)
from ampkit.trainer.sharded_checkpoint import (
    TRAINER_FILE,
    consolidate_checkpoint,
    is_sharded_checkpoint,
    load_sharded,
)
from ampkit.trainer.state import BackwardState, LoopState, LossState, OptimizerState, skip_verdict
from ampkit.trainer.state_misfit import check_optimizer_fits, check_schedulers_fit, load_model_state
from ampkit.trainer.unread_settings import unread_settings
from ampkit.trainer.user_code import (
    SETUP_ERROR_LINE,
    UserCodeError,
    call_setup_method,
    check_batches,
    check_loader,
    check_loss,
    check_model_has_parameters,
    check_model_has_values,
    check_tag,
    empty_batch_error,
    exhausted_loader_error,
    keyword_batch_error,
    long_epoch_message,
    never_stepped,
    nothing_trained_warning,
    refuse_beyond_float,
    short_epoch_message,
    training_step_loss_error,
)
from ampkit.wording import counted, shown

_NO_BATCH = object()  # the end of an epoch's batches, fetched one ahead
_STOP_ASKED = "trainer.state.should_stop was set"  # the stop reason when the setter gave none
_CLAIMS = threading.Lock()  # one check-and-mark of a Trainer's running entry point at a time (Trainer._claim)
# Where log() gives the evaluated set's value, and the evaluation hooks before them, in which an on_epoch mean would
# join the training epoch's: each names the hook that logs the set's value instead.
_EVALUATION_ENDS = ("on_validation_end", "on_test_end")
_EVALUATION_STARTS = {"on_validation_start": "on_validation_end", "on_test_start": "on_test_end"}
_LOG_OPTIONS = (
    "log() takes on_step, on_epoch, always and step; the progress bar shows the values training_step returns "
    "beside 'loss', and the epoch line the epoch means of on_epoch tags and what on_train_epoch_end hooks log "
    "(Lightning's prog_bar), every value goes to TensorBoard (no logger=False), and each value is this rank's, as "
    "Lightning's without sync_dist; Lightning's batch_size, rank_zero_only, add_dataloader_idx, sync_dist_group and "
    "metric_attribute are taken too"
)
# What does the work of Lightning's log() options that change a value's meaning, named where one is given.
_LOG_OPTION_INSTEAD = {
    "batch_size": (
        "batch_size is the batch's weight in an on_epoch mean: an integer >= 1, or None for samples_in(batch)"
    ),
    "reduce_fx": "an on_epoch value is the epoch's mean; for a max or a sum, log it yourself in on_train_epoch_end",
    "sync_dist": (
        "under torchrun each rank logs its own value and rank zero's is written and monitored (sync_dist=True is "
        "taken in one process, where there is nothing to sync): all-reduce it across the ranks yourself first "
        "(torch.distributed.all_reduce), or return it from validation_step, whose means cover every rank's samples"
    ),
    "enable_graph": "log() detaches every value and keeps no graph: keep the tensor yourself where you need its graph",
}

# Lightning's log() options at the values that ask for what log() does here anyway: a port that spells them out
# (``sync_dist=False``, ``reduce_fx="mean"``) is taken as written; another value is refused above.
_LOG_OPTION_AS_HERE: dict[str, tuple[Any, ...]] = {
    "prog_bar": (False,),  # the bar shows what training_step returns, never a log() value
    "logger": (True,),  # every value goes to TensorBoard
    "sync_dist": (False,),  # each rank's own value (True in one process too: see _asks_what_log_does)
    "rank_zero_only": (False, True),  # every rank may log; rank zero's values are written and monitored
    "enable_graph": (False,),  # values are detached
    "add_dataloader_idx": (True, False),  # log() runs in training and evaluation-end hooks: no loader index to add
}
# Lightning's log() options that change nothing here at any value: the group of a sync_dist (refused by name under
# torchrun, a no-op in one process), and the attribute of a torchmetrics object (whose value is refused, by name).
_LOG_OPTION_IGNORED = ("sync_dist_group", "metric_attribute")
# Lightning's reductions (its log() refuses any other): by name in any case ("avg" is its mean), or the function.
_REDUCTIONS: dict[Any, str] = {"avg": "mean", **{name: name for name in ("mean", "max", "min", "sum")}}
_REDUCTIONS.update({torch.mean: "mean", torch.max: "max", torch.min: "min", torch.sum: "sum"})
_REDUCTIONS.update({max: "max", min: "min", sum: "sum"})


def _asks_what_log_does(option: str, value: Any, reduced: bool, distributed: bool) -> bool:
    """Whether Lightning's log() ``option`` at ``value`` asks for what log() does here without it: a ``reduce_fx``
    of Lightning's that is its mean, or any where the value is not ``reduced`` (Lightning reduces on_epoch values
    only, so an on_step one's max is its value); ``sync_dist=True`` where no other rank is ``distributed``, as
    Lightning syncs nothing in one process; a ``batch_size`` (checked where it weighs a value)."""
    if option in _LOG_OPTION_IGNORED or option == "batch_size":
        return True
    if option == "sync_dist" and value is True:
        return not distributed
    if option == "reduce_fx":
        kind = _REDUCTIONS.get(value.lower() if isinstance(value, str) else value) if value.__hash__ else None
        return kind == "mean" or (kind is not None and not reduced)
    same_as_here = _LOG_OPTION_AS_HERE.get(option, ())
    return any(value is same or (isinstance(value, str) and value == same) for same in same_as_here)


def _scheduler_name(sched: SchedulerSpec, optimizer: str) -> str:
    """How a message names a scheduler: ``scheduler 'warmup' of 'adam'`` (its ``name`` where it has one)."""
    which = f"scheduler '{sched.name}'" if sched.name else "scheduler"
    return f"{which} of '{optimizer}'"


def _refuse_or_skip(sched: SchedulerSpec, problem: str) -> None:
    """A scheduler whose monitored value is missing (``problem`` says why): an error where it is ``strict``, else a
    warning, and it does not step."""
    if sched.strict:
        raise MonitorNotFoundError(problem)
    rank_zero_warn(f"{problem}; not stepping it (strict=False)")


def _log_switch(tag: str, name: str, value: Any, default: bool | None) -> bool:
    """log()'s ``name`` argument as a bool: ``None`` is ``default`` (Lightning's "the hook's default") where there is
    one; ``"False"`` or 2 is an error, where it was silently on."""
    if value is True or value is False:  # what nearly every call passes: log() may run several times a step
        return value
    if value is None and default is not None:
        return default
    if is_switch(value):
        return bool(value)
    or_none = " or None (the hook's default)" if default is not None else ""
    raise UserCodeError(f"log({shown(tag)}, {name}={shown(value)}): expected True or False{or_none}")


def _log_batch_size(tag: str, batch_size: Any) -> int | None:
    """log()'s ``batch_size`` (Lightning's): the value's weight in an on_epoch mean, an integer >= 1; None (its
    default) leaves the weight to ``samples_in(batch)``."""
    if batch_size is None or (type(batch_size) is int and batch_size >= 1):
        return batch_size
    if isinstance(batch_size, numbers.Integral) and not isinstance(batch_size, bool) and batch_size >= 1:
        return int(batch_size)
    raise UserCodeError(f"log({shown(tag)}, batch_size={shown(batch_size)}): {_LOG_OPTION_INSTEAD['batch_size']}")


def _every(n: int, count: int) -> bool:
    """Event filter: the ``count``-th occurrence is due every ``n`` (``n <= 0`` never)."""
    return n > 0 and count % n == 0


def _has_grad(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any parameter of ``optimizer`` holds a gradient (a loop: it is asked every step)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                return True
    return False


def _reached_by_scaled_loss(opt_state: OptimizerState, losses: dict[Any, LossState]) -> bool:
    """Whether a loss with a loss scaler reached this optimizer (its gradients were unscaled)."""
    for loss_id in opt_state.loss_ids:  # a loop, not any(generator): asked at every step
        loss = losses.get(loss_id)
        if loss is not None and loss.scaler is not None:
            return True
    return False


def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The total L2 norm of ``tensors``, bit for bit ``torch.nn.utils.get_total_norm(tensors, foreach=True)``
    but with one device move per group of (device, dtype) instead of one per tensor: a third of its time on
    a small model, and a step's worth of tiny ops fewer on a large one. A sparse gradient (an
    ``Embedding(sparse=True)``'s) counts through its coalesced values: no norm kernel takes sparse tensors."""
    try:
        return _dense_total_norm(tensors)
    except NotImplementedError:  # a sparse tensor's refusal: looked for then, not in every tensor at every step
        if not any(t.is_sparse for t in tensors):
            raise
    return _dense_total_norm([t.coalesce()._values() if t.is_sparse else t for t in tensors])


def _dense_total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """:func:`total_norm` of strided tensors; a NotImplementedError for a sparse one (before any result)."""
    first_device = tensors[0].device
    norms: list[torch.Tensor] = []
    for (device, _), ([group], _) in _group_tensors_by_device_and_dtype([tensors]).items():
        group_norms = torch._foreach_norm(group)
        norms.extend(group_norms if device == first_device else [n.to(first_device) for n in group_norms])
    return torch.linalg.vector_norm(torch.stack(norms))


class _IsFrozenDataclass(type):
    def __instancecheck__(cls, value: Any) -> bool:
        params = getattr(type(value), "__dataclass_params__", None)
        return params is not None and params.frozen


class _FrozenDataclass(metaclass=_IsFrozenDataclass):
    """Instances of frozen dataclasses, as an ``isinstance`` target (``apply_to_collection`` then hands them over)."""


class _NoHooksYet(dict):
    """The hooks before ``fit()`` (or validate/test/predict) set up the callbacks: ``backward``, ``step`` or a hook
    fired before then is an error saying where they belong, not a KeyError naming a hook."""

    def __missing__(self, hook: str) -> list[Any]:
        raise UserCodeError(
            f"the hook {hook} has no callbacks yet: fit() (or validate/test/predict) sets them up, and backward(), "
            "step() and the hooks run inside it (in training_step and the hooks), not before it or after it failed "
            "to set up"
        )


def _batches_in(loader: Any, limit: int | None, source: str) -> int | None:
    """How many batches a pass over ``loader`` yields under ``limit``; None when it has no length and no limit."""
    total = loader_length(loader, source)
    return total if limit is None else limit if total is None else min(total, limit)


class Trainer:
    """Subclass it, implement ``configure_model``, ``configure_optimizers``, ``train_dataloader`` and
    ``training_step`` (plus ``val_dataloader``/``validation_step`` to validate), then call :meth:`fit`.

    Example::

        class DigitsTrainer(ampkit.Trainer):
            config_class = DigitsConfig
            def configure_model(self):       return Net(self.cfg.model)
            def configure_optimizers(self):  return torch.optim.AdamW(self.module.parameters(), lr=1e-3)
            def train_dataloader(self):      return DataLoader(train_set, batch_size=64, shuffle=True)
            def training_step(self, batch):  return F.cross_entropy(self.model(batch[0]), batch[1])

    A subclass may define any hook of :class:`Callback` without the ``trainer`` argument
    (``def on_train_epoch_end(self)``); it runs after the callbacks' but before a checkpoint's (a misspelt hook is
    an error).
    """

    config_class: ClassVar[type] = Config
    automatic_optimization: ClassVar[bool] = True
    # What a sample is worth, for the throughput figures: tokens (a sequence's length) and training FLOPs
    # (forward + backward; ampkit.callbacks.throughput.count_training_flops). Set them in configure_model.
    tokens_per_sample: int | None = None
    flops_per_sample: float | None = None

    def __init__(
        self, cfg: DictConfig | dict | None = None, callbacks: list[Callback] | Callback | None = None, **settings: Any
    ) -> None:
        if settings:  # Lightning's Trainer(max_epochs=3): here settings are config keys
            raise TypeError(keyword_settings_error(type(self).__name__, self.config_class, list(settings)))
        self._own_hooks = own_hooks(type(self), Trainer)
        check_replaced_methods(type(self), Trainer)
        check_step_signatures(type(self))
        check_lightning_only_hooks(type(self), Trainer)
        if not (cfg is None or isinstance(cfg, dict | DictConfig) or is_config_instance(cfg)):
            raise ConfigError(
                f"{type(self).__name__}(cfg=...): got {type(cfg).__name__} {str(cfg)[:60]!r}; expected a dict, an "
                "OmegaConf DictConfig or a config_class instance, or None for the defaults (a YAML file: "
                "OmegaConf.load(path))"
            )
        # Always merged onto the schema: a DictConfig from OmegaConf.load/create has no defaults and no type checks.
        # In Python the class at hand is the trainer_class a YAML would name.
        here = {"trainer_class": f"{type(self).__module__}:{type(self).__qualname__}"}
        cfg = build_config(self.config_class, here, {} if cfg is None else cfg)
        self.cfg: DictConfig = cfg
        self.dist = DistributedEnv()  # one process until fit/validate/test/predict start torch.distributed
        self._validate_config()
        self._take_settings()
        self.state = LoopState()
        self._user_callbacks = callback_list(callbacks, "Trainer(callbacks=...)")
        self.callbacks: list[Callback] = []
        self.module: torch.nn.Module | None = None  # the bare model: checkpoints and optimizers use it
        self.model: Any = None  # what training code calls: the module, possibly compiled/wrapped
        self.model_setup: ModelSetup | None = None  # what was applied to the model (compile, checkpointing...)
        self.optimizers: dict[str, torch.optim.Optimizer] = NamedOptimizers()
        self.optimizer_state: dict[torch.optim.Optimizer, OptimizerState] = {}
        self.loss_state: dict[Any, LossState] = {}
        self.val_metrics: dict[str, float] = {}
        self.val_metrics_step: int | None = None  # the global step val_metrics were measured at (None: unknown)
        # What on_validation_end hooks log(), by tag, in the latest validation: monitors read a tag it lacks here, and
        # validate() returns them beside its means, as on_test_end's (test_end_values) beside test()'s.
        self.validation_end_values: dict[str, float] = {}
        self.test_end_values: dict[str, float] = {}
        self._evaluated: Mapping[str, float] = {}  # the means of the evaluation whose end hook runs now (log() checks)
        self.logged_scalars: list[tuple[str, Any, int]] = []  # Trainer.log's values to write at this batch's end
        self._logged_taken = False  # a logger took logged_scalars in this batch (take_logged)
        # on_step values of iterations not due to log, the latest per tag: (value, step, iteration). The run's last
        # iteration writes its own (_log_the_last_iteration), as it writes the outputs since the last log step.
        self._held_step_values: dict[str, tuple[Any, int, int]] = {}
        self.epoch_scalars: dict[str, float] = {}  # Trainer.log's on_epoch means, set before on_train_epoch_end
        self._epoch_end_values: dict[str, Any] = {}  # on_epoch values logged in on_train_epoch_end (monitor_values)
        self.logger: Logger = Logger()  # images/histograms/text; a logging callback replaces this no-op one
        self._epoch_sums: dict[str, list[Any]] = {}
        # The hook (or training_step) running now, and the one that logs each on_epoch tag: Lightning keeps one tag's
        # values apart per hook, so one mean over two hooks' values would be neither's.
        self._fx: str | None = None
        self._epoch_fx: dict[str, str] = {}
        self._curve_kind: dict[str, tuple[bool, str]] = {}  # log()'s TensorBoard tags: (epoch means?, first hook)
        self._curve_mix_said: set[tuple[str, str]] = set()  # (tag, hook) whose mixed curve was warned of
        self._train_monitors: tuple[str, ...] = ()  # the train/ tags monitored; see _monitored_train_tags
        self._monitors_unheard: tuple[str, ...] = ()  # checked once, at the first iteration's end
        self._monitors_per_step: set[str] = set()  # of those, the ones log() gave a per-step value only
        self._epoch_means_taken = False  # this epoch's means are computed: later on_epoch values are written at once
        self._batch: Any = None  # the training batch running now: its size weighs log()'s epoch means
        self.evaluation_step: str | None = None  # the evaluation step running now (validation_step...), or None
        self.evaluated_batches = 0  # the real batches every rank together ran in the latest evaluation pass
        self.version_dir: Path | None = None
        # What fit(resume='last') continues from as rank zero, which writes the checkpoints, sees it: known on every
        # rank from the fit's start and each save, for a failure's note (on a node-local disk another rank's differs).
        self.rank_zero_last: Path | None = None
        # Rank zero's version directory, known on every rank from the fit's start: paths a callback names alike on
        # every rank (best_model_path), never a place to write (another rank's disk may not hold it).
        self.rank_zero_version_dir: Path | None = None
        self.fit_start = FitStart()  # where the last fit() started: fresh, a checkpoint it continued or branched from
        self._lock: RunLock | None = None
        self._launch: str | None = None  # which fit of which torchrun launch this is (None outside torchrun)
        self._discard_version_dir = False  # set when the run fails before training (the sanity validation)
        self.predictions_path: Path | None = None  # the file predict(output=...) wrote (rank zero's)
        self._specs: list[OptimizerSpec] = []
        self._configured: dict[str, list[dict[str, Any]]] = {}  # each optimizer's group settings as configured
        self._unsaid_config_changes: list[str] = []  # a resume's changed config keys, said with its restore
        self._train_loader: Any = None  # train_dataloader(), once per set-up (see _load_train_data)
        self._workers = StartedWorkers()  # the loader workers a run started, ended as it ends
        self._num_train_batches: int | None = None
        self._train_limit: int | None = None  # trainer.limit_train_batches as a count (None: all)
        self._val_limit: int | None = None  # trainer.limit_val_batches as a count (None: all)
        self._val_loader: Any = None  # val_dataloader(), once per fit's set-up, after train_dataloader()
        self._val_loaded = False  # this fit's set-up asked val_dataloader(): num_val_batches is known
        self._train_length_known = True  # len(train loader) works: each epoch's last batch is known by its index
        self._at_last_batch = False  # a loader without a length: the batch running now is its epoch's last
        # Where an epoch's loop is, for an exception's note: "fetch" (the loader's next batch) or "batch" (its step)
        self._loop_phase: str | None = None
        self._fetched_ahead = 0  # batches fetched beyond the one running (_flag_last reads one ahead)
        self._said_short_epoch = False  # warned that the loader yields fewer batches than its len()
        self._check_long_epoch = False  # the loader's len() ends each epoch but may undercount it (a stream's)
        self._said_long_epoch = False  # warned that the loader yields more batches than its len()
        self._epoch_pass: Iterator[Any] | None = None  # the epoch's pass over the loader, before its cut at len()
        self._rng_before_fetch: dict[str, Any] | None = None  # fetching one ahead: the RNGs before the last fetch
        self._rng_after_fetch: dict[str, Any] | None = None  # a resume fetching one ahead: the RNGs after its first
        self._batch_layout: dict[str, int] | None = None  # samples per training batch over all ranks (batch_layout)
        self.resumed_layout_change: str | None = None  # samples per step in the resumed checkpoint and now, if changed
        self.rescaled_resume: RescaledResume | None = None  # a mid-epoch position moved to batches of another size
        self._agree_each_batch = False  # under torchrun, some rank's batch count is unknown (an IterableDataset)
        self._batch_agreement: Any = None  # the process group that agreement runs in (None: the default one)
        self._has_step_schedulers = False  # any scheduler with interval "step": walked once per iteration
        self._hooks: dict[str, list[Any]] = _NoHooksYet()  # fit/validate/test/predict set them up
        self._resume: dict[str, Any] | None = None
        self._epoch_rng: dict[str, Any] | None = None
        self._epoch_generators: list[torch.Tensor] | None = None  # the train loader's own generators at epoch start
        self._facts_pending = False  # a check reported found_inf (or, distributed, a backward ran) since agreeing
        self._verdicts = DeviceVerdicts()  # steps skipped or not on the device, not yet read (device_skip.py)
        self._device_skip: dict[torch.optim.Optimizer, bool] = {}  # optimizers that take a device-side verdict
        self._facts_on_device = False  # found_inf flags stay on the device too (see facts_on_device)
        self._settling: int | None = None  # the iteration whose verdicts are being settled: what log() stamps
        self._stop_agreed = False  # under torchrun: the ranks agreed that one of them set state.should_stop
        self._preempt_asked = False  # a SIGTERM arrived (preemption.py): stop and save where the iteration ends
        self._preempt_agreed = False  # under torchrun: the ranks agreed that one of them got a SIGTERM
        self._stop_heard = False  # a rank's stop or SIGTERM, heard in the facts' collective: agree at iteration end
        self._rank_failure: BaseException | None = None  # fail_on_every_rank's error, until the ranks next agree
        self._running: str | None = None  # the entry point running now (fit, validate...): fit() inside one is refused
        self._running_in: tuple[int, str] | None = None  # the thread it runs in, by id and name (see _claim)
        self._models_left: tuple[Any, Any] = (None, None)  # module and model as the last run that built one left them
        self._built_model = False  # the run in progress built its model (then _release records it in _models_left)
        self._in_automatic_step = False  # training_step runs under automatic optimization: the Trainer backpropagates
        self._stepping: torch.optim.Optimizer | None = None  # the optimizer step() is stepping now
        self._direct_step_guards: list[Any] = []  # manual optimization: hooks refusing optimizer.step() outside step()

    def _take_settings(self) -> None:
        """The loop's plain copies of the config's settings (reading an OmegaConf node costs microseconds, paid
        several times a step), and what the config they came from was (see :meth:`_follow_config`)."""
        self.settings: TrainerConfig = OmegaConf.to_object(self.cfg.trainer)
        self._log_every: int = self.cfg.logging.log_every_n_steps
        self.device = resolve_device(self.settings.device)
        self._on_cpu = self.device.type == "cpu"  # batches stay where the DataLoader put them
        self._val_every_n_steps = self.settings.val_every_n_steps
        self.sharded = uses_fsdp(self.cfg)  # FSDP: sharded model and optimizer state, DCP checkpoints
        self._settings_from = OmegaConf.to_container(self.cfg)

    def _follow_config(self) -> None:
        """Before a run: a config changed since the settings were taken (``trainer.cfg.trainer.max_steps = 5`` in a
        notebook between two fits) is checked as at construction and taken again. Else the loop ran on the old
        settings while checks and messages read the new ones, and a resume said it had nothing to train."""
        if OmegaConf.to_container(self.cfg) != self._settings_from:
            self._validate_config()
            self._take_settings()

    # ----------------------------------------------------------------- what a subclass implements
    def configure_model(self) -> torch.nn.Module:
        """Build and return the model (``self.cfg`` holds the config)."""
        raise NotImplementedError(f"{type(self).__name__} must implement configure_model() returning a Module")

    def configure_optimizers(self) -> Any:
        """Return an optimizer, a list of them, or dicts with ``optimizer``/``lr_scheduler``/``name``."""
        raise NotImplementedError(f"{type(self).__name__} must implement configure_optimizers()")

    def train_dataloader(self) -> Any:
        """Return an iterable of training batches (usually a DataLoader)."""
        raise NotImplementedError(f"{type(self).__name__} must implement train_dataloader()")

    def val_dataloader(self) -> Any:
        """Return an iterable of validation batches, or None for no validation."""
        return None

    def training_step(self, batch: Any) -> Any:
        """Return the loss (automatic optimization), or call ``backward``/``step`` yourself (manual)."""
        raise NotImplementedError(f"{type(self).__name__} must implement training_step(batch)")

    def validation_step(self, batch: Any) -> dict[str, Any]:
        """Return metrics for one batch; the Trainer averages them weighted by batch size."""
        raise NotImplementedError(
            f"{type(self).__name__} returns a val_dataloader, so it must implement "
            "validation_step(batch) returning a dict of metrics"
        )

    def test_dataloader(self) -> Any:
        """Return an iterable of test batches for :meth:`test`."""
        return None

    def test_step(self, batch: Any) -> dict[str, Any]:
        """Return metrics for one test batch; the Trainer averages them weighted by batch size."""
        raise NotImplementedError(
            f"{type(self).__name__} returns a test_dataloader, so it must implement test_step(batch) "
            "returning a dict of metrics"
        )

    def predict_dataloader(self) -> Any:
        """Return an iterable of batches for :meth:`predict`."""
        return None

    def predict_step(self, batch: Any) -> Any:
        """One batch's predictions: by default the model's output on the batch (on its first element if a tuple)."""
        inputs = batch[0] if isinstance(batch, list | tuple) else batch
        if not isinstance(inputs, Mapping):
            return self.model(inputs)
        try:
            return self.model(inputs)
        except (TypeError, AttributeError) as exc:
            error = keyword_batch_error(inputs, exc)
            if error is None:
                raise
            raise error from exc

    def configure_callbacks(self) -> list[Callback]:
        """Extra callbacks this Trainer always wants."""
        return []

    def samples_in(self, batch: Any) -> int | None:
        """The samples in one batch, counted on the host before it moves to the device: they weigh ``log()``'s epoch
        means and validation's averages and make samples/s. By default the leading size of its first tensor;
        override for a batch laid out otherwise (time-major: ``return batch[0].size(1)``). None: unknown."""
        return batch_size(batch)

    def tokens_in(self, batch: Any) -> int | None:
        """The tokens in one training batch, for tokens/s, counted on the host before it moves to the device. By
        default None: samples x ``tokens_per_sample``; override for packed or variable-length sequences
        (``return int(batch["attention_mask"].sum())``)."""
        return None

    # ----------------------------------------------------------------- what training code calls
    def __getattr__(self, name: str) -> Any:
        """Only for a missing attribute: the error names the ampkit spelling of Lightning's (``current_epoch``)."""
        attribute = getattr(type(self), name, None)
        if isinstance(attribute, property):  # its getter raised AttributeError: let its own message through
            return attribute.__get__(self)
        if "cfg" not in self.__dict__ and not name.startswith("__"):  # a subclass's __init__ skipped the Trainer's
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute '{name}' yet: Trainer.__init__ has not run; "
                f"{type(self).__name__}.__init__ must call super().__init__(cfg, callbacks) before it uses self.{name}",
                name=name,
                obj=self,
            )
        raise missing_attribute(self, name)

    @property
    def should_stop(self) -> bool:
        """Lightning's ``trainer.should_stop``, refused naming ``state.should_stop``: a value set here would stop
        nothing (a ported callback's ``trainer.should_stop = True``)."""
        raise missing_attribute(self, "should_stop")

    @should_stop.setter
    def should_stop(self, value: Any) -> None:
        raise AttributeError(
            f"{type(self).__name__}.should_stop = {shown(value)} would stop nothing: Lightning's trainer.should_stop "
            f"is {LIGHTNING_NAMES['should_stop']}",
            name="should_stop",
            obj=self,
        )

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The single optimizer (an error when there are several: use ``self.optimizers[name]``)."""
        if len(self.optimizers) != 1:
            raise AttributeError(
                f"there are {len(self.optimizers)} optimizers ({', '.join(self.optimizers)}); use self.optimizers[name]"
            )
        return next(iter(self.optimizers.values()))

    def backward(
        self, loss: torch.Tensor, loss_id: Any = 0, optimizer: torch.optim.Optimizer | str | None = None
    ) -> None:
        """Backpropagate ``loss``; ``loss_id`` picks its loss scaler, ``optimizer`` (or its name) limits which params
        get grads."""
        if self._in_automatic_step:
            self._refuse_in_automatic_step("backward")
        loss_id = check_loss(loss, loss_id)
        inputs = None
        if optimizer is not None:
            optimizer = self._optimizer_named(optimizer, "backward")
            inputs = [p for group in optimizer.param_groups for p in group["params"]]
        backward = BackwardState(loss, loss_id, inputs)
        loss_state = self.loss_state.get(loss_id)
        if loss_state is None:
            loss_state = self.loss_state[loss_id] = LossState(loss_id)
        loss_state.backwards += 1
        for opt_state in self.optimizer_state.values():
            opt_state.grad_norm = None
        fx, self._fx = self._fx, "on_before_backward"
        for hook in self._hooks["on_before_backward"]:  # mixed precision scales the loss here
            hook(self, backward)
        if backward.inputs is not None:  # the trainable ones, as the model has them (O2's masters mapped to them)
            backward.inputs = [t for t in backward.inputs if t.requires_grad]
        if self.sharded:
            backward_to(backward.loss, backward.inputs, self.module)
        else:
            backward.loss.backward(inputs=backward.inputs)
        self._fx = "on_after_backward"
        for hook in self._hooks["on_after_backward"]:  # ... and unscales the new gradients, reporting found_inf
            hook(self, backward)
        self._fx = fx
        if loss_state.reported or self.dist.enabled:  # every rank agrees after every backward, in lockstep
            self._facts_pending = True

    def _refuse_in_automatic_step(self, method: str) -> None:
        """``self.backward``/``self.step`` inside ``training_step`` under automatic optimization, where the Trainer
        calls both on the returned loss: a second backward through the freed graph would fail deep in autograd, a
        second step as 'already stepped' (Lightning refuses its manual_backward there too)."""
        raise UserCodeError(
            f"training_step called self.{method}() under automatic optimization, where the Trainer calls backward on "
            "the loss training_step returns and steps every optimizer: return the loss without calling it, or set "
            f"automatic_optimization = False in {type(self).__name__} to call self.backward/self.step yourself"
        )

    def _optimizer_named(self, optimizer: torch.optim.Optimizer | str, method: str) -> torch.optim.Optimizer:
        """``optimizer`` itself, or the one ``configure_optimizers`` gave that name; anything else is an error."""
        if not self.optimizers:  # before fit() ran configure_optimizers
            raise UserCodeError(
                f"{method}() was called before fit() made the optimizers: it runs inside fit(), in training_step"
            )
        if isinstance(optimizer, str):
            if optimizer not in self.optimizers:
                raise UserCodeError(
                    f"{method}(optimizer={shown(optimizer)}): no optimizer has that name; configure_optimizers() made "
                    f"{list(self.optimizers)}"
                )
            return self.optimizers[optimizer]
        try:
            known = optimizer in self.optimizer_state
        except TypeError:  # unhashable: not an optimizer
            known = False
        if not known:
            raise UserCodeError(
                f"{method}() got a {type(optimizer).__name__} that configure_optimizers() did not return; pass one "
                f"of self.optimizers or its name ({', '.join(self.optimizers)})"
            )
        return optimizer

    def step(self, optimizer: torch.optim.Optimizer | str) -> bool:
        """Step ``optimizer`` if this batch ends an iteration; returns whether it stepped.

        It is skipped (parameters, state and step count untouched) when :func:`skip_verdict` says so, and not
        stepped at all when none of its parameters received a gradient this iteration.
        """
        if self._in_automatic_step:
            self._refuse_in_automatic_step("step")
        optimizer = self._optimizer_named(optimizer, "step")
        if not self.state.is_iteration_end:
            return False
        opt_state = self.optimizer_state[optimizer]
        if opt_state.stepped or opt_state.skipped:
            raise RuntimeError(f"optimizer '{opt_state.name}' was already stepped in this iteration")
        if self._verdicts.unsettled:  # the last iteration's: the GPU finished those steps long ago
            self._settle(before=self.state.iteration)
        if not _has_grad(optimizer):
            return False
        if self._reach.watching:  # a parameter no loss reaches never trains, silently
            for why in self._reach.at_step(optimizer, opt_state.name, opt_state.master_weights):
                rank_zero_warn(why)
        if self._facts_pending:
            self._agree_facts()
        if opt_state.loss_ids and _reached_by_scaled_loss(opt_state, self.loss_state):
            self.fire("on_after_unscale", optimizer, skip_verdict(opt_state, self.loss_state) is not None)
        fx, self._fx = self._fx, "on_before_optimizer_step"
        for hook in self._hooks["on_before_optimizer_step"]:  # clipping
            hook(self, optimizer)
        self._fx = fx
        culprits = skip_verdict(opt_state, self.loss_state)
        if culprits is not None:
            opt_state.skipped = True
            opt_state.skipped_steps += 1
            opt_state.epoch_skipped_steps += 1
            self.fire("on_optimizer_step_skipped", optimizer, culprits)
            return False
        found_inf = self._device_found_inf(opt_state)
        self._stepping = optimizer  # manual optimization's guard lets this step through
        try:
            if found_inf is None:
                step_(optimizer)
            else:  # skipped or not on the device; counted as taken until settled
                step_with_found_inf(optimizer, found_inf, step_)
                loss_ids = sorted(opt_state.loss_ids, key=str)
                self._verdicts.record(optimizer, self.state.iteration, loss_ids, found_inf)
        finally:
            self._stepping = None
        opt_state.stepped = True
        opt_state.steps += 1
        opt_state.epoch_steps += 1
        fx, self._fx = self._fx, "on_after_optimizer_step"
        for hook in self._hooks["on_after_optimizer_step"]:
            hook(self, optimizer)
        self._fx = fx
        return True

    def _device_found_inf(self, opt_state: OptimizerState) -> torch.Tensor | None:
        """The device flags that decide this step (clipping's, and those of the losses that reached it), as one
        0-dim flag, or None when the host decided alone."""
        flags = [] if opt_state.device_skip is None else [opt_state.device_skip]
        for loss_id in opt_state.loss_ids:
            loss = self.loss_state.get(loss_id)
            if loss is not None and loss.device_found_inf is not None:
                flags.append(loss.device_found_inf)
        if not flags:
            return None
        return flags[0] if len(flags) == 1 else torch.stack(flags).sum()

    def skips_on_device(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether a check may hand ``optimizer``'s skip verdict to its step as a device flag
        (``optimizer_state[optimizer].device_skip``) instead of reading it: ``trainer.skip_verdict`` and an
        optimizer that honours GradScaler's ``found_inf`` (see :mod:`ampkit.trainer.device_skip`)."""
        return self._device_skip.get(optimizer, False)

    @property
    def event_iteration(self) -> int:
        """The iteration a hook's event is about: the current one, or, while a verdict kept on the device is
        settled an iteration late (``on_optimizer_step_skipped``, ``on_loss_scale_update``), the one it was
        made in. ``log()`` stamps its values with it."""
        return self.state.iteration if self._settling is None else self._settling

    @property
    def facts_on_device(self) -> bool:
        """Whether the reported found_inf flags stay on the device as well: every optimizer takes a device-side
        verdict (:meth:`skips_on_device`), all on one device. Then no iteration reads the device: each loss's
        flags (agreed across ranks by an all-reduce there) go to the steps it reached as GradScaler's
        ``found_inf``, its scaler updates on the device (:meth:`ampkit.amp.LossScaler.update_on_device`), and
        the host learns both an iteration later."""
        return self._facts_on_device

    def _settle(self, before: int | None = None) -> None:
        """Read the device-side verdicts of the iterations before ``before`` (all when None): a skipped step
        leaves ``steps`` for ``skipped_steps`` and fires ``on_optimizer_step_skipped``; the LR schedulers that
        waited for those iterations step."""
        skipped, scale_updates, schedules = self._verdicts.settle(before)
        if self._verdicts.stop_asked:  # a rank's stop or SIGTERM, heard in the device facts' all-reduce
            self._verdicts.stop_asked, self._stop_heard = False, True
        for step, culprits in skipped:
            opt_state = self.optimizer_state[step.optimizer]
            opt_state.steps -= 1
            opt_state.epoch_steps -= 1
            opt_state.skipped_steps += 1
            opt_state.epoch_skipped_steps += 1
            self._fire_about(step.iteration, "on_optimizer_step_skipped", step.optimizer, culprits)
        for iteration, loss_id, overflowed in scale_updates:  # each scaler's host copy follows its device copy
            loss = self.loss_state[loss_id]
            current, loss.found_inf = loss.found_inf, overflowed  # what on_loss_scale_update's hooks read
            try:
                old, new = loss.scaler.update(overflowed)
                self._fire_about(iteration, "on_loss_scale_update", loss_id, old, new)
            finally:
                loss.found_inf = current
        for _, stepped in schedules:
            self._step_schedulers("step", stepped)

    def _fire_about(self, iteration: int, hook: str, *args: Any) -> None:
        """Fire ``hook`` for an event of an earlier ``iteration``: what its hooks log is stamped with it."""
        self._settling = iteration
        try:
            self.fire(hook, *args)
        finally:
            self._settling = None

    def grad_norm(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Total L2 norm of ``optimizer``'s gradients, computed once per backward and shared by callbacks."""
        opt_state = self.optimizer_state[optimizer]
        if opt_state.grad_norm is None:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            norm = total_norm(grads) if grads else torch.zeros(())
            opt_state.grad_norm = full_norm(norm) if self.sharded else norm  # sharded: a collective
        return opt_state.grad_norm

    def log(
        self,
        tag: str,
        value: float | torch.Tensor,
        *,
        on_step: bool | None = True,
        on_epoch: bool | None = False,
        always: bool = False,
        step: int | None = None,
        **others: Any,
    ) -> None:
        """Record a scalar for the loggers (tensors are detached, so no graph is kept alive).

        ``on_step``: written at the end of this batch if the iteration is due (every ``logging.log_every_n_steps``,
        the run's last, or ``always`` for events such as an overflow; outside a batch, e.g. in
        ``on_train_epoch_end``, always) at ``step`` (default: this iteration). ``on_epoch``: its mean
        over the epoch (weighted by each batch's size), written at the epoch's end. With both, the tags get
        ``_step`` and ``_epoch`` suffixes. In ``on_validation_end``/``on_test_end`` it is the evaluated set's value
        (an AUC over it): written once under ``tag``, monitorable, and returned by validate()/test().
        Lightning's ``prog_bar``, ``sync_dist``, ``reduce_fx``... are taken at the values that ask for what log()
        does anyway (``sync_dist=False``, or True in one process; ``reduce_fx="mean"``) and refused at others, naming
        what does their work; ``batch_size`` weighs the value in its epoch mean, as in Lightning.
        ``None`` for ``on_step``/``on_epoch`` is Lightning's "the hook's default", which these defaults are.
        """
        check_tag("log", tag, METRIC_NAME_RULE)  # as a monitor naming it is checked (config.names_a_metric)
        if self.evaluation_step is not None:  # before its options: a port's prog_bar or sync_dist there is not the fix
            instead = INSTEAD_OF_LOG.get(self.evaluation_step, "log() is for training")
            raise UserCodeError(f"log({shown(tag)}) in {self.evaluation_step}: {instead}")
        on_step = _log_switch(tag, "on_step", on_step, default=True)
        on_epoch = _log_switch(tag, "on_epoch", on_epoch, default=False)
        refused: list[str] = []
        if others:  # Lightning's options; values are reduced where on_epoch is set and in on_train_epoch_end
            reduced = on_epoch or self._epoch_means_taken
            distributed = self.dist.enabled
            refused = sorted(
                name for name, given in others.items() if not _asks_what_log_does(name, given, reduced, distributed)
            )
        if refused:
            instead = "".join(f"; {_LOG_OPTION_INSTEAD[name]}" for name in refused if name in _LOG_OPTION_INSTEAD)
            got = ", ".join(f"{name}={shown(others[name])}" for name in refused)
            raise UserCodeError(f"log({shown(tag)}) got {got}, which it does not take: {_LOG_OPTIONS}{instead}")
        weight = _log_batch_size(tag, others.get("batch_size"))
        always = _log_switch(tag, "always", always, default=None)
        valid_step = step is None or (type(step) is int and step >= 0)  # the usual cases, without an ABC check
        if not valid_step and (isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0):
            raise UserCodeError(
                f"log({shown(tag)}, step={shown(step)}): expected None (this iteration) or an integer >= 0"
            )
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:  # a one-line error at the CLI, as the user's code can fix it from the message
                raise UserCodeError(
                    f"log({shown(tag)}): expected a scalar, got a tensor of shape {tuple(value.shape)}; log one number "
                    "(its mean, a norm) or each element under a tag of its own"
                )
            value = value.detach()
        elif type(value) is not float and not isinstance(value, numbers.Real):
            metric = (  # a torchmetrics Metric, which Lightning's log() computes and resets itself
                "; for a metric object, log its value (metric(preds, target) per step, or metric.compute() in "
                "on_train_epoch_end, then metric.reset())"
                if callable(getattr(value, "compute", None))
                else ""
            )
            raise UserCodeError(
                f"log({shown(tag)}): expected a number or a one-element tensor, got {type(value).__name__}{metric}"
            )
        elif type(value) is not float:  # every logger and mean reads it as a float
            refuse_beyond_float(f"log({shown(tag)})", value)
        if self._fx in _EVALUATION_ENDS:  # the set's value (an AUC over it), as Lightning's on_*_epoch_end logs one
            self._log_evaluation_value(tag, value, step)
            return
        if not (on_step or on_epoch):  # nothing would be written: Lightning refuses it too
            raise UserCodeError(
                f"log({shown(tag)}, on_step=False, on_epoch=False) writes nothing; give on_step=True (its value at the "
                "logged steps) or on_epoch=True (its mean over the epoch), or both"
            )
        if self._fx == "on_validation_batch_end":  # Lightning's default there is the mean over the set
            raise UserCodeError(
                f"log({shown(tag)}) in on_validation_batch_end: each validation batch's value would be written at one "
                "training step, the last batch's left (Lightning averages it over the set): return it from "
                "validation_step (averaged over the set and written as val/<name>), or log the set's value in "
                "on_validation_end"
            )
        if on_epoch and self._fx in _EVALUATION_STARTS:  # outside training, yet it would join training's epoch mean
            raise UserCodeError(
                f"log({shown(tag)}, on_epoch=True) in {self._fx}: an epoch mean logged there would be one of the "
                f"training epoch's; a value over the evaluated set is one its step returns (averaged over the set) or "
                f"one {_EVALUATION_STARTS[self._fx]} logs"
            )
        if self.state.stage != "fit":  # the sanity validation, a validate() or test() of its own: see below
            return
        if on_step:  # an on_step value in on_train_epoch_end is the epoch's (Lightning's default there: on_epoch)
            self._check_one_curve(f"{tag}_step" if on_epoch else tag, epoch=self._epoch_means_taken and not on_epoch)
        if on_epoch:
            self._check_one_curve(f"{tag}_epoch" if on_step else tag, epoch=True)
        if not on_epoch and tag in self._monitors_unheard:  # the first iteration: a monitor it cannot feed
            self._monitors_per_step.add(tag)
        if on_step and not on_epoch and self._epoch_means_taken:  # on_train_epoch_end, where Lightning's default is
            self._epoch_end_values[tag] = value  # on_epoch=True: a monitor reads it as the epoch's value too
        # Outside a training batch (an epoch-end hook, as Lightning users log an epoch's metric) it is written at once.
        if on_step:
            step_tag, at = f"{tag}_step" if on_epoch else tag, self.event_iteration if step is None else step
            if always or self._batch is None or _every(self._log_every, self.state.iteration):
                self.logged_scalars.append((step_tag, value, at))
            else:  # written only if the run ends with this iteration
                self._held_step_values[step_tag] = (value, at, self.state.iteration)
        if on_epoch:  # weighted by the batch's size, as validation metrics and Lightning's epoch means are
            self._check_one_hook_logs(tag)
            epoch_tag = f"{tag}_epoch" if on_step else tag
            if self._epoch_means_taken:  # on_train_epoch_end: its own value is the epoch's, not one for the next
                self.logged_scalars.append((epoch_tag, value, self.event_iteration if step is None else step))
                # ... and a monitor's (Lightning's pattern: an epoch metric computed and logged there).
                self._epoch_end_values[epoch_tag] = value
                return
            self._add_to_epoch_sum(epoch_tag, value, weight)

    def _log_evaluation_value(self, tag: str, value: float | torch.Tensor, step: int | None) -> None:
        """A value an ``on_validation_end``/``on_test_end`` hook logs: the evaluated set's, kept for monitors and for
        what validate()/test() return (one per evaluation, so no ``_step``/``_epoch`` tags, whatever ``on_step`` and
        ``on_epoch`` say) and written under ``tag`` at the evaluation's step."""
        validation = self._fx == "on_validation_end"
        prefix = "val/" if validation else "test/"
        clash = tag if tag in self._evaluated else tag.removeprefix(prefix)
        if clash in self._evaluated:
            step_name = "validation_step" if validation else "test_step"
            raise UserCodeError(
                f"log({shown(tag)}) in {self._fx}: {step_name} returns '{clash}' ({prefix}{clash}, its mean over the "
                "set), so one name would hold two values; log this one under a tag of its own"
            )
        (self.validation_end_values if validation else self.test_end_values)[tag] = float(value)
        # Written for a fit's validations only, as their val/ metrics are: not the sanity pass's (a few batches of an
        # untrained model, which Lightning keeps from its loggers too), nor a validate() or test() of their own, which
        # no logger takes from (the next fit's would write it at its first step). So is every value log() gets.
        if self.state.stage == "fit":
            self.logged_scalars.append((tag, value, self.event_iteration if step is None else step))

    def _fire_evaluation_end(self, hook: str, metrics: dict[str, float]) -> None:
        """Fire ``on_validation_end`` or ``on_test_end`` with the set's ``metrics``; what its hooks log replaces the
        previous evaluation's values (``validation_end_values``, ``test_end_values``)."""
        if hook == "on_validation_end":
            self.validation_end_values = {}
        else:
            self.test_end_values = {}
        self._evaluated = metrics
        try:
            self.fire(hook, dict(metrics))
        finally:
            self._evaluated = {}

    def _log_the_last_iteration(self) -> None:
        """Queue the on_step values of the run's last iteration that it was not due to log: a run that ends off the
        ``log_every_n_steps`` interval (max_steps, a stop) writes its last step's values, as it writes the returned
        outputs' since the last log step (Lightning logs at a stop's step too). Not a SIGTERM's step: that run goes on
        when resumed, and logs as one never stopped would."""
        held, self._held_step_values = self._held_step_values, {}
        last = self.state.global_step
        self.logged_scalars += [(tag, value, at) for tag, (value, at, iteration) in held.items() if iteration == last]

    def monitor_values(self) -> dict[str, float]:
        """The epoch's values a ``train/`` monitor reads at its end: the ``on_epoch`` means, and the values logged
        with ``on_epoch=True`` in ``on_train_epoch_end`` so far (an epoch metric computed there, as Lightning's
        monitoring callbacks read one logged in the module's hook)."""
        late = {tag: float(value) for tag, value in self._epoch_end_values.items()}
        return {**self.epoch_scalars, **late}

    def monitor_value_names(self) -> list[str]:
        """The names of :meth:`monitor_values` as log() was given them (``m`` for the ``m_epoch`` of ``log('m',
        on_step=True, on_epoch=True)``, ``train/loss`` for the returned loss's mean): what a message says was logged."""
        return sorted({tag if tag in self._epoch_fx else tag.removesuffix("_epoch") for tag in self.monitor_values()})

    def monitored_epoch_value(self, metric: str) -> float | None:
        """This epoch's value of the monitored ``train/`` tag ``metric`` among :meth:`monitor_values` (or its
        ``_epoch`` mean), rank zero's on every rank (the value TensorBoard shows), so that every rank ranks, stops
        and schedules alike; None where the epoch logged none. Collective: every rank calls it."""
        return broadcast_object(epoch_mean(self.monitor_values(), metric), self.dist)

    def monitored_validation_value(self, metric: str, metrics: Mapping[str, float]) -> float | None:
        """The monitored validation value ``metric``: among ``metrics`` (what validation_step returned, its ``val/``
        dropped), else a tag an ``on_validation_end`` hook logged (an AUC computed there), rank zero's on every rank;
        None where neither has it."""
        value = metrics.get(metric.removeprefix("val/"))
        if value is None:  # every rank's metrics have the same keys: all of them take this collective or none
            value = broadcast_object(self.validation_end_values.get(metric), self.dist)
        return value

    def _add_to_epoch_sum(self, tag: str, value: float | torch.Tensor, weight: int | None = None) -> None:
        """Add ``value`` to ``tag``'s epoch mean, weighted by ``weight`` (log()'s ``batch_size``) or else the batch's
        size (1 outside a batch), as validation metrics and Lightning's epoch means are; a tensor stays on its device
        (no host read)."""
        if weight is None:
            weight = (self.state.batch_size or 1) if self._batch is not None else 1
        total = self._epoch_sums.setdefault(tag, [0.0, 0])
        total[0] += (value.float() if isinstance(value, torch.Tensor) else float(value)) * weight
        total[1] += weight

    def _monitored_train_tags(self) -> tuple[str, ...]:
        """The ``train/`` tags a callback or scheduler monitors. One naming a key of training_step's output
        (``train/loss``: the returned loss) the run averages over each epoch itself (``train/loss_epoch``) unless the
        code logs that tag with ``on_epoch=True``: a monitor of the loss it trains on needs no log() call."""
        monitors = [getattr(cb, "monitor", None) for cb in self.callbacks]  # ampkit's Monitor, or a name
        metrics = [getattr(m, "metric", m) for m in monitors]
        metrics += [sched.monitor for spec in self._specs for sched in spec.schedulers]
        return tuple(sorted({m for m in metrics if isinstance(m, str) and is_training_metric(m)}))

    def _feed_epoch_means(self, outputs: dict[str, Any]) -> None:
        """Add this batch's monitored outputs to their epoch means (a device add, no host read), weighted by its
        size as log(on_epoch=True) is; not one the code logs itself with on_epoch=True (its own mean is monitored)."""
        for tag in self._train_monitors:
            value = outputs.get(tag.removeprefix("train/"))
            scalar = isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.numel() == 1)
            if scalar and tag not in self._epoch_fx:
                self._add_to_epoch_sum(f"{tag}_epoch", value)

    def _warn_unheard_monitors(self) -> None:
        """At the first iteration's end, name a monitored ``train/`` tag nothing has given a value yet: the epoch's
        end stops the run without one, and a warning now costs no epoch of training."""
        unheard = [
            t for t in self._monitors_unheard if t not in self._epoch_sums and f"{t}_epoch" not in self._epoch_sums
        ]
        self._monitors_unheard = ()
        if "on_train_epoch_end" in self._own_hooks:  # it may log them there, as the epoch's values
            return
        if per_step := [tag for tag in unheard if tag in self._monitors_per_step]:
            # Lightning ranks such a tag by its last batch's value, one batch's noise; the epoch's end would fail
            # here anyway, an epoch of training later.
            named = shown(per_step[0])  # a pasted 100 kB tag by its start and length
            raise MonitorNotFoundError(
                f"{named} is monitored, but log({named}) gives it per step only (on_epoch=False): a monitored train/ "
                f"tag is its epoch mean, read at each epoch's end; log it with self.log({named}, value, "
                "on_epoch=True) (on_step=True too keeps its per-step curve)"
            )
        for tag in unheard:
            named, bare = shown(tag), tag.removeprefix("train/")
            unprefixed = (
                f" (self.log({shown(bare)}) logs it without the train/ prefix a monitored tag needs)"
                if bare in self._epoch_fx
                else ""
            )
            rank_zero_warn(
                f"{named} is monitored, but the first iteration gave it no value{unprefixed}: its epoch mean, read at "
                f"each epoch's end, comes from self.log({named}, value, on_epoch=True) in training_step or a value "
                f"training_step returns under {shown(bare)}; without one the run stops at this epoch's end"
            )

    def _check_one_hook_logs(self, tag: str) -> None:
        """Refuse an ``on_epoch`` tag that another hook logs too: Lightning keeps each hook's values of a tag apart
        (and writes one hook's mean), where one mean of both would be neither's."""
        fx = self._fx or "code outside the Trainer's hooks"
        first = self._epoch_fx.setdefault(tag, fx)
        if first != fx:
            named = shown(tag)  # a pasted 100 kB tag by its start and length
            raise UserCodeError(
                f"log({named}, on_epoch=True) in {fx}: {named} has an epoch mean logged in {first} already, and one "
                f"mean of both hooks' values would be neither's: log it under a tag of its own here (e.g. "
                f"{shown(f'{tag}_{fx}')})"
            )

    def _check_one_curve(self, name: str, epoch: bool) -> None:
        """A log() that writes epoch means under a TensorBoard tag that gets per-step values (or the reverse): one
        curve of both is neither. Refused within one hook, as Lightning refuses the pair there ("twice ... with
        different arguments"); across hooks, where Lightning writes both, said once per tag."""
        fx = self._fx or "code outside the Trainer's hooks"
        first_epoch, first_fx = self._curve_kind.setdefault(name, (epoch, fx))
        if first_epoch == epoch or (name, fx) in self._curve_mix_said:
            return
        kinds = ("per-step values", "epoch means")
        problem = (
            f"log() in {fx} writes {kinds[epoch]} under {shown(name)}, which gets {kinds[first_epoch]} logged in "
            f"{first_fx}: one curve of both is neither; log one of them under a tag of its own (on_step and "
            "on_epoch together write <tag>_step and <tag>_epoch)"
        )
        if fx == first_fx:
            raise UserCodeError(problem)
        self._curve_mix_said.add((name, fx))
        rank_zero_warn(problem)

    def take_logged(self) -> list[tuple[str, Any, int]]:
        """``log()``'s values not taken yet, as ``(tag, value, step)``, for the logger that writes them: they leave
        the queue, and what is logged later in the batch (in a hook that runs after the logger's) waits for its next
        take instead of being dropped at the batch's end."""
        taken, self.logged_scalars = self.logged_scalars, []
        self._logged_taken = True
        return taken

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Mark the work inside as not training (a checkpoint save, a sample generated in a hook): every callback's
        :meth:`Callback.paused` is entered, so a throughput window leaves its time out."""
        with ExitStack() as stack:
            for callback in self.callbacks:
                stack.enter_context(callback.paused())
            yield

    def fire(self, hook: str, *args: Any, methods: list[Any] | None = None) -> None:
        """Call ``hook`` on every callback that overrides it, in the declared order, then on this Trainer
        (``methods``: a part of ``self._hooks[hook]`` only, as the epoch's end fires its PERSIST part apart).

        The hooks of every batch loop over ``self._hooks[hook]`` in place instead: a hook nobody overrides
        then costs an empty loop, not a call (a few microseconds a step on a small model)."""
        fx, self._fx = self._fx, hook
        try:
            for method in self._hooks[hook] if methods is None else methods:
                method(self, *args)
        finally:
            self._fx = fx

    @property
    def num_train_batches(self) -> int | None:
        """Batches per training epoch on this rank (after ``limit_train_batches``); None for an iterable without a
        length. Known in ``configure_optimizers`` too (it runs ``train_dataloader()`` then), for a schedule's length."""
        if self._train_loader is None:
            self._load_train_data()
        return self._num_train_batches

    @property
    def num_training_steps(self) -> int | None:
        """Iterations the whole run trains (Lightning's ``estimated_stepping_batches``), to size a schedule in
        ``configure_optimizers``: ``max_epochs`` x ``ceil(num_train_batches / accumulate_grad_batches)`` (an epoch's
        last, short window steps too), or ``max_steps`` when it ends the run first; None when neither is known."""
        t, batches = self.settings, self.num_train_batches
        if batches is None or t.max_epochs < 0:  # an iterable without a length, or no epoch limit: max_steps says
            return t.max_steps if t.max_steps >= 0 else None
        steps = t.max_epochs * -(-batches // t.accumulate_grad_batches)
        return steps if t.max_steps < 0 else min(t.max_steps, steps)

    @property
    def num_val_batches(self) -> int | None:
        """Batches per validation run of a fit (after ``limit_val_batches``); 0 where the fit never validates (no
        loader, or ``val_every_n_epochs`` and ``val_every_n_steps`` both 0, as Lightning's ``limit_val_batches=0``
        counts 0), None if unknown: a loader without a length, or before the fit's set-up asked ``val_dataloader()``
        (after ``configure_optimizers``)."""
        if not self._val_loaded:
            return None
        if self._val_loader is None or self.settings.val_every_n_epochs == self._val_every_n_steps == 0:
            return 0
        return _batches_in(self._val_loader, self._val_limit, "val_dataloader()")

    @property
    def global_rank(self) -> int:
        """This process's rank among all processes (0 without torchrun)."""
        return self.dist.rank

    @property
    def world_size(self) -> int:
        """How many processes train together (1 without torchrun)."""
        return self.dist.world_size

    @property
    def is_global_zero(self) -> bool:
        """Whether this is rank 0, the process that logs, shows progress and writes checkpoints."""
        return self.dist.rank == 0

    def fail_on_every_rank(self, error: BaseException) -> None:
        """Stop the fit with ``error``, met on this rank alone (rank zero's write of TensorBoard events, a file only it
        writes): raised at once in one process; under torchrun kept, and raised on every rank where the ranks next
        meet to agree on a stop (the iteration after next at the latest, or as the fit ends), so that the others do
        not train on into a collective this rank has left and fail there with another error. A later one is dropped.
        """
        if not self.dist.enabled or self._running != "fit":
            raise error
        if self._rank_failure is None:
            self._rank_failure = error

    # ----------------------------------------------------------------- fit
    @refuses_lightning_arguments
    def fit(self, resume: str | os.PathLike | None = None) -> None:
        """Train. ``resume``: a checkpoint path, or ``"last"``/``"best"`` for the newest one under ``run_dir``.

        Each call is a run of its own: a second ``fit()`` trains a new model from the start (``resume="last"``
        continues the first), and ``fit()`` from a hook or step of a running ``fit``/``validate``... is refused."""
        check_instance_attributes(self, Trainer)
        if self._running is None:  # from a hook of a run, the run's settings stay
            self._follow_config()
        if not self._claim("fit", seeded=self.settings.seed is not None):  # it would recurse until the stack ends
            raise UserCodeError(
                f"fit() was called while {self._running}() is running (from a hook or a step of "
                f"{type(self).__name__}); a fit runs to its end before another starts: call fit() after it returns"
            )
        try:
            refuse_outer_autocast(self.cfg, self.device)
            self._start_distributed()
        except BaseException:
            self._release()
            raise
        clean = False
        failure = None
        self._preempt_asked = False
        try:
            with self._process_kept(self.settings.seed is not None), sigterm_asks_to_stop(self._ask_preemption):
                with sighup_raises(), grad_mode_for_training(), without_torch_patches():
                    self._fit(resume)
                # What rank zero alone wrote as the fit ended (TensorBoard's last events) failed: every rank says so.
                raise_the_first_failure(self._rank_failure, self.dist)
            clean = True
        except BaseException as exc:
            if isinstance(exc, RuntimeError):
                self._raise_set_up_failure(exc, "fit")
            if isinstance(exc, KeyboardInterrupt) and self.is_global_zero:
                newest = self._newest_checkpoint()
                saved = None if newest is None else (loop_of(newest) or {}).get("global_step")
                exc.add_note(interrupt_note(exc, self.state.global_step, newest, saved))
            if isinstance(exc, KeyboardInterrupt):  # a SIGTERM's or SIGHUP's stop ends a script as ampkit fit's does
                uncaught_exits_with_signal_status()
            failure = exc
            raise
        finally:
            self._release()
            for guard in self._direct_step_guards:
                guard.remove()
            self._direct_step_guards = []
            if self._lock is not None:
                self._lock.release()
                self._lock = None
            if self._discard_version_dir and self.is_global_zero:
                discard_new_version_dir(self.version_dir, self.fit_start)
            teardown_distributed(self.dist, clean, failure)

    def _claim(self, entry: str, seeded: bool) -> bool:
        """Mark ``entry`` (``"fit"``, ``"validate"``...) as running, or return False: called from a hook or a step of
        the run in progress. Called from another thread while one runs, it is refused: the two would share the model,
        the optimizers and the loop's state (and both passed the check before either marked itself), as is a run of
        another Trainer while one runs in another thread (:mod:`~ampkit.trainer.process_runs`)."""
        here = (threading.get_ident(), threading.current_thread().name)
        with _CLAIMS:
            claimed = self._running is None
            if claimed:
                self._running, self._running_in = entry, here
        if claimed:
            try:
                enter_run(self, entry, seeded)  # another Trainer's run in another thread: refused, naming it
            except UserCodeError:
                self._running = None
                raise
            return True
        if self._running_in != here:
            raise UserCodeError(
                f"{entry}() was called in thread '{here[1]}' while {self._running}() is running in thread "
                f"'{self._running_in[1]}' on this {type(self).__name__}: one Trainer runs one "
                "fit, validate, test or predict at a time (they would share its model, optimizers and loop state); "
                "call it after that one returns"
            )
        return False

    def _release(self) -> None:
        """The run :meth:`_claim` marked has ended."""
        self._running = None
        if self._built_model:  # with what its callbacks made of it (a DDP wrapper); a run failing before keeps the last
            self._models_left, self._built_model = (self.module, self.model), False
        leave_run(self)

    @contextmanager
    def _process_kept(self, seeds: bool) -> Iterator[None]:
        """The process as a run (``fit``, a standalone ``validate``...) found it once it ends, also by an error: the
        loader workers it started ended, and, where it ``seeds`` (``trainer.seed``), the caller's RNGs as they were."""
        callers_rng = capture_callers_rng() if seeds else None
        try:
            yield
        finally:
            self._workers.shut_down()
            if callers_rng is not None:
                restore_callers_rng(callers_rng)

    def _start_distributed(self) -> None:
        self.dist = setup_distributed(self.cfg)
        rank_zero_only.rank = self.dist.rank
        if self.dist.enabled and self.device.type == "cuda":
            self.device = rank_device(self.device, self.dist.local_rank)
        self._on_cpu = self.device.type == "cpu"
        check_same_config(self.cfg, self.dist)

    def _fit(self, resume: str | os.PathLike | None) -> None:
        # An earlier fit's position would end this one at once, and its checkpoints would stamp an untrained model
        # with that fit's step: each fit starts at step 0 (a resume then restores its checkpoint's position).
        self.state = LoopState()
        self._rank_failure = None
        self.val_metrics, self.val_metrics_step, self.epoch_scalars = {}, None, {}
        self.validation_end_values = {}  # an earlier fit's would reach this one's hparams before it validates
        self._resume = self._rng_after_fetch = None
        self._launch = torchrun_launch()
        if resume is None and self._launch is not None:  # a torchrun restart continues its first attempt's run
            resume = self._restarted_from()
        # Rank zero decides for every rank, from its own look at run_dir (a node-local one differs between nodes).
        plan = partial(self._plan_fit, resume)
        self.fit_start = agreed_fit_start(plan, self.dist, str(self.cfg.run_dir))
        self._unsaid_config_changes = list(self.fit_start.config_changes)  # said as its optimizers are restored
        if self.is_global_zero:  # what a killed save left behind goes first, also when nothing will be trained
            tidy_run_dir(self.cfg.run_dir)
        if self.fit_start.finished:
            self._say_config_changes(self.fit_start.checkpoint_path, [])
            self._already_finished()
            return
        try:
            self._check_run_dir(write=True)  # before any user code runs
            self._setup(self.fit_start)
        finally:  # a failure before the restore still names what changed
            self._say_config_changes(self.fit_start.checkpoint_path, [])
        failure = None
        try:
            self.fire("on_fit_start")
            self._train_monitors = self._monitors_unheard = self._monitored_train_tags()
            self._monitors_per_step = set()
            if self.fit_start.branched_from is not None:
                self.logger.log_text("run/lineage", OmegaConf.to_yaml(lineage(self.fit_start)), self.state.global_step)
            try:
                sanity_validate(self, self._val_loader)
            except BaseException:  # a failure or a Ctrl-C: nothing trained, so a version_N made for it leaves no trace
                self._discard_version_dir = True
                raise
            if not self._nothing_to_train():
                self.fire("on_train_start")
                self._agree_stop()  # a hook of one rank may already have asked
                while not self._finished():
                    self._run_epoch()
                    self._stop_if_preempted()
                if self._unsaid_skips:  # the scale backed off to the end: the run changed nothing
                    rank_zero_warn(self._unsaid_skips)
                self._log_the_last_iteration()
                self.fire("on_train_end")
        except BaseException as exc:
            failure = exc
            self._explain(exc)
            self._note_loop_position(exc)
            self._fire_every_one("on_exception", exc, failure=exc)
            raise
        finally:
            self._fire_every_one("on_fit_end", failure=failure)

    def _nothing_to_train(self) -> bool:
        """``trainer.max_epochs=0`` or ``max_steps=0`` (a fresh run: a resume of one is finished before this): as in
        Lightning the fit validates and trains nothing, so no training hook runs, no checkpoint of the untrained
        model is written, and the version_N made for it goes again."""
        t = self.settings
        zero = "max_epochs" if t.max_epochs == 0 else "max_steps" if t.max_steps == 0 else None
        if zero is None:
            return False
        self._discard_version_dir = True
        if self.is_global_zero:
            say(
                f"ampkit: fit() trained nothing: trainer.{zero}=0 (as in Lightning); "
                "nothing was saved. Set it >= 1, or -1 for no limit"
            )
        return True

    def _plan_fit(self, resume: str | os.PathLike | None) -> FitStart:
        """:func:`plan_fit` from this process's own look at ``run_dir`` (rank zero's, under torchrun)."""
        return plan_fit(self.cfg.run_dir, resume, resolve_checkpoint(self.cfg.run_dir, resume), self.cfg)

    def _restarted_from(self) -> Path | None:
        """Rank zero's :func:`restarted_from` on every rank, said on rank zero's console."""
        path = decided_by_rank_zero(partial(restarted_from, self.cfg.run_dir, self._launch), self.dist)
        if path is not None and self.is_global_zero:
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
            say(f"ampkit: torchrun restart {restart} continues this launch's run from '{path}'")
        return path

    def _finished(self) -> bool:
        s, t = self.state, self.settings
        return self._stopping() or 0 <= t.max_epochs <= s.epoch or 0 <= t.max_steps <= s.global_step

    def _stopping(self) -> bool:
        """Whether training ends now for ``state.should_stop``: at once in one process; under torchrun only once the
        ranks agreed it (:meth:`_agree_stop`), so that no rank leaves while the others wait in a collective."""
        return self._stop_agreed if self.dist.enabled else self.state.should_stop

    def _ask_preemption(self) -> None:
        """A SIGTERM's request (a signal handler: it only sets a flag): stop and save where this iteration ends."""
        self._preempt_asked = True

    def _stop_if_preempted(self) -> None:
        """At an iteration's end: raise :class:`Preempted` once a SIGTERM asked to stop (under torchrun: once the ranks
        agreed, so that all raise at the same step); ``ModelCheckpoint`` saves this step as it unwinds."""
        asked = self._preempt_agreed if self.dist.enabled else self._preempt_asked
        if asked and self.state.is_iteration_end and not self._finished():  # a run that ends here saves as it ends
            if self.is_global_zero:
                say(f"ampkit: SIGTERM: stopping at step {self.state.global_step}")
            raise Preempted(f"SIGTERM: stopped at step {self.state.global_step}")

    def _agree_stop(self) -> None:
        """Under torchrun, whether any rank set ``state.should_stop`` or got a SIGTERM: one small collective, run by
        every rank at the same points (an iteration that logs, after a validation, an epoch's start and end, and the
        end of an iteration whose facts' collective carried a rank's ask), where the ranks meet anyway. When one did,
        every rank stops there, with ``stop_reason`` naming the ranks that asked and why (a SIGTERM's stop is no early
        stop: its checkpoint resumes). A rank's own failure (:meth:`fail_on_every_rank`) is asked the same way, and
        raised here on every rank."""
        self._stop_heard = False
        if not self.dist.enabled or self._stop_agreed:
            return
        s = self.state
        failed = self._rank_failure is not None
        stop_asked, preempted, any_failed = any_rank([s.should_stop, self._preempt_asked, failed], self.dist)
        if any_failed:
            raise_the_first_failure(self._rank_failure, self.dist)
        self._preempt_agreed = self._preempt_agreed or preempted
        if not stop_asked:
            return
        mine = (s.stop_reason or _STOP_ASKED) if s.should_stop else None
        asked = gather_object(mine, self.dist)
        reasons = {why for why in asked if why is not None}
        if len(reasons) == 1 and None not in asked:  # every rank, for one reason (a metric they share)
            reason = reasons.pop()
        else:
            reason = "; ".join(f"rank {rank}: {why}" for rank, why in enumerate(asked) if why is not None)
        if self.is_global_zero:  # also after its own callback's line: that named the step it asked at, maybe earlier
            say(f"ampkit: stopping every rank at step {s.global_step}: {reason}")
        s.should_stop, s.stop_reason, self._stop_agreed = True, reason, True

    def _run_epoch(self) -> None:
        s = self.state
        self._epoch_means_taken = False
        if s.batches_done == 0:  # a mid-epoch resume keeps the epoch's steps so far: epoch schedulers step on them
            for opt_state in self.optimizer_state.values():
                opt_state.epoch_steps = opt_state.epoch_skipped_steps = 0
        self.module.train()
        self.fire("on_train_epoch_start")
        # A stop asked there trains no batch of this epoch, as in Lightning, whose epoch loop asks before each batch;
        # under torchrun the ranks agree on it here (one rank's ask left every rank training a step of the epoch).
        self._agree_stop()
        stopped_at_start = self._stopping()
        exhausted, max_steps, first_batch = not stopped_at_start, self.settings.max_steps, s.batches_done
        first_step = s.global_step
        # An epoch's partial accumulation window steps at its end, also where another rank's stream ends it early.
        ahead = self.settings.accumulate_grad_batches > 1 and not (
            self._train_length_known and not self._agree_each_batch
        )
        self._rng_before_fetch = None  # set by _flag_last while it fetches ahead
        batches = iter(()) if stopped_at_start else self._epoch_batches(ahead)
        if ahead:
            batches = self._flag_last(batches)
        self._loop_phase = "fetch"
        for batch in batches:
            self._run_batch(batch)
            self._loop_phase = None  # between batches (a stop's validation): no batch to name
            self._stop_if_preempted()
            # A callback (early stopping) asked, or the limit. A stop asked inside an accumulation window waits for
            # its end, as under torchrun: its checkpoint then holds whole windows, and a run extended from it is exact.
            if (s.is_iteration_end and self._stopping()) or 0 <= max_steps <= s.global_step:
                exhausted = s.batches_done == self._num_train_batches
                if not exhausted and self._stopping():
                    self._validate_at_stop()
                break
            self._loop_phase = "fetch"
        self._at_last_batch, self._loop_phase = False, None
        ran = s.batches_done > first_batch  # a resume at an epoch's last batch runs none of it
        if not ran and first_batch == 0 and not stopped_at_start:  # else every epoch would end at once, training none
            raise exhausted_loader_error(s.epoch, self._num_train_batches)
        if ran and exhausted and not self._agree_each_batch and s.batches_done < (self._num_train_batches or 0):
            self._short_epoch()
        if self._check_long_epoch and s.batches_done == self._num_train_batches:
            self._long_epoch()
        self._epoch_pass = None
        self._settle()  # counts, skip events and schedulers settled before anything reads them at the epoch's end
        # A stopped epoch (max_steps, early stopping) is the run's last: its steps are said too, if any ended in it.
        if ran and (exhausted or s.global_step > first_step):
            why = nothing_trained_warning(
                self.optimizer_state.values(), self.automatic_optimization, self.loss_state.values()
            )
            self._unsaid_skips = f"epoch {s.epoch}: {why}" if why else None
            if why and not never_stepped(self.optimizer_state.values()):
                rank_zero_warn(self._unsaid_skips)
                self._unsaid_skips = None
        # Parameters that did not train in the first epoch (at most a window).
        for why in self._reach.finish(st.master_weights for st in self.optimizer_state.values()):
            rank_zero_warn(why)
        s.epoch_finished = exhausted
        if exhausted:
            # Not again when the epoch's last step validated (val_every_n_steps): the same weights, a second pass,
            # and a second non-improving validation for early stopping's patience.
            if _every(self.settings.val_every_n_epochs, s.epoch + 1) and self.val_metrics_step != s.global_step:
                self._validate()
        # The means after validation (whose hooks may log into them) and before the schedulers (which may monitor one)
        self.epoch_scalars = {tag: float(total / count) for tag, (total, count) in self._epoch_sums.items()}
        self._epoch_means_taken, self._epoch_end_values = True, {}
        if exhausted:  # a stopped epoch's sums go on into its checkpoint, for a resume to finish the epoch
            self._epoch_sums = {}
        # Epoch schedulers step after the epoch-end hooks of the callbacks and the Trainer, PERSIST's too, as
        # Lightning's do (a plateau scheduler reads a value logged there; a rate read there is the epoch's own), and
        # before the checkpoint writers', whose save then holds the stepped schedulers that a resume continues from.
        hooks, at = self._hooks["on_train_epoch_end"], self._saves_at["on_train_epoch_end"]
        self.fire("on_train_epoch_end", methods=hooks[:at])
        if exhausted:
            self._step_schedulers("epoch")
        self.fire("on_train_epoch_end", methods=hooks[at:])
        self._agree_stop()  # before the next epoch starts
        if exhausted:
            s.epoch, s.batches_done, s.epoch_finished = s.epoch + 1, 0, False

    def _validate_at_stop(self) -> None:
        """A stop asked mid-epoch (a callback, ``max_time``) validates the weights it leaves, once, as Lightning
        does, in an epoch that validates at all; not again after the validation that asked it (early stopping). The
        run's stop reason stays the first one, whatever that validation's early stopping says."""
        s = self.state
        validates = self._val_every_n_steps > 0 or _every(self.settings.val_every_n_epochs, s.epoch + 1)
        if not validates or self.val_metrics_step == s.global_step:
            return
        reason = s.stop_reason
        self._validate()
        s.stop_reason = reason

    def _short_epoch(self) -> None:
        """The loader ended before its ``len()``: an accumulation window its last batch left open is an error (its
        gradients would join the next epoch's first step); else a warning, as counts built on len() are off."""
        s, accumulate, promised = self.state, self.settings.accumulate_grad_batches, self._num_train_batches
        open_batches = 0 if s.is_iteration_end else s.batch_idx % accumulate + 1
        window_end = min((s.batch_idx // accumulate + 1) * accumulate, promised) - 1
        why = short_epoch_message(s.epoch, s.batches_done, promised, open_batches, window_end)
        if open_batches:
            raise UserCodeError(why)
        if not self._said_short_epoch:  # once a run: each epoch would say the same
            self._said_short_epoch = True
            rank_zero_warn(why)

    def _long_epoch(self) -> None:
        """The epoch took its loader's ``len()`` of batches: a loader with more is said once a run (the rest are never
        trained on). Checked every epoch, a batch fetched and dropped, so a resumed run draws as an unbroken one."""
        if yields_more(self._epoch_pass) and not self._said_long_epoch:
            self._said_long_epoch = True
            rank_zero_warn(long_epoch_message(self.state.epoch, self._num_train_batches, self._train_loader))

    def _run_batch(self, batch: Any) -> None:
        s, accumulate = self.state, self.settings.accumulate_grad_batches
        self._loop_phase = "batch"
        s.batch_idx = s.batches_done
        s.iteration = s.global_step + 1
        s.is_iteration_start = s.batch_idx % accumulate == 0
        s.is_iteration_end = (
            (s.batch_idx + 1) % accumulate == 0 or s.batch_idx + 1 == self._num_train_batches or self._at_last_batch
        )
        if s.is_iteration_start:
            for opt_state in self.optimizer_state.values():
                opt_state.begin_iteration()
            for loss_state in self.loss_state.values():
                loss_state.begin_iteration()
        # Once a batch: log()'s epoch means and the throughput figures read them.
        s.batch_size = checked_count(self.samples_in(batch), self, "samples_in")
        s.batch_tokens = checked_count(self.tokens_in(batch), self, "tokens_in")
        if s.batch_size == 0:  # on the host, before any work: nan loss and zero gradients otherwise
            raise empty_batch_error("train_dataloader", f"batch {s.batch_idx} of epoch {s.epoch}, step {s.iteration}")
        if not self._on_cpu:
            batch = self._to_device(batch)
        self._batch = batch
        self._fx = "on_train_batch_start"
        for hook in self._hooks["on_train_batch_start"]:
            hook(self, batch)
        self._fx = "training_step"
        outputs = self._training_step(batch)
        if self._train_monitors:
            self._feed_epoch_means(outputs)
        s.batches_done += 1
        if s.is_iteration_end:
            self._end_iteration()
        self._fx = "on_train_batch_end"
        for hook in self._hooks["on_train_batch_end"]:
            hook(self, outputs, batch)
        self._fx = None
        if self._monitors_unheard and s.is_iteration_end:
            self._warn_unheard_monitors()
        # What a hook logged after the logger took this batch's values (the Trainer's own on_train_batch_end runs
        # after the logger's) waits for its next take (or a checkpoint's); with no logger taking them, nothing would.
        if not self._logged_taken:
            self.logged_scalars.clear()
        self._logged_taken = False
        self._batch = None

    def _training_step(self, batch: Any) -> dict[str, Any]:
        if not self.automatic_optimization:
            return self._detached(self.training_step(batch))
        self._in_automatic_step = True  # backward/step there would run twice: refused (_refuse_in_automatic_step)
        try:
            out = self.training_step(batch)
        finally:
            self._in_automatic_step = False
        loss = out if isinstance(out, torch.Tensor) else out.get("loss") if isinstance(out, dict) else None
        if not isinstance(loss, torch.Tensor):
            raise training_step_loss_error(out)
        accumulate = self.settings.accumulate_grad_batches
        self.backward(loss / accumulate if accumulate > 1 else loss)
        for optimizer in self.optimizers.values():
            self.step(optimizer)
        return self._detached(out) if out is not loss else {"loss": loss.detach()}

    def _agree_facts(self) -> None:
        """Read every reported per-loss found_inf flag (one device-to-host read) and agree them across ranks
        (one collective), so that every rank takes the same skip verdicts and scaler updates."""
        if not self._facts_pending:
            return
        self._facts_pending = False
        if self._facts_on_device:
            self._agree_facts_on_device()
            return
        distributed = self.dist.enabled
        losses = [s for s in self.loss_state.values() if s.reported or distributed]
        if not losses:
            return
        if distributed:  # the same order on every rank
            losses.sort(key=lambda s: str(s.loss_id))
        flags: list[torch.Tensor | bool] = []
        for loss in losses:
            reported, loss.reported = loss.reported, []
            if not reported:
                flags.append(loss.found_inf)
            else:
                flag = reported[0] if len(reported) == 1 else torch.stack([f.reshape(()) for f in reported]).sum()
                flags.append(flag + 1.0 if loss.found_inf else flag)
        hears_stop = distributed and not self._stop_agreed  # the ask rides along: no collective of its own
        asked = self.state.should_stop or self._preempt_asked or self._rank_failure is not None
        agreed = any_rank([*flags, asked] if hears_stop else flags, self.dist)
        if hears_stop:
            self._stop_heard = agreed.pop() or self._stop_heard
        for loss, found_inf in zip(losses, agreed, strict=True):
            loss.found_inf = found_inf

    def _agree_facts_on_device(self) -> None:
        """The same facts, never read: each loss's reported flags summed on the device, a ``found_inf`` a callback
        set on the host folded in, and agreed across ranks by an all-reduce there; the steps and scalers take them
        as they are (``LossState.device_found_inf``)."""
        distributed = self.dist.enabled
        losses = [s for s in self.loss_state.values() if s.reported or s.found_inf or distributed]
        if distributed:  # the same order on every rank
            losses.sort(key=lambda s: str(s.loss_id))
        flags = []
        for loss in losses:
            reported, loss.reported = loss.reported, []
            flag = torch.stack([f.reshape(()) for f in reported]).sum() if reported else None
            if loss.found_inf:  # a callback's verdict joins the device one: every rank skips the same way
                flag = torch.ones((), device=self.device) if flag is None else flag + 1.0
                loss.found_inf = False
            flags.append(torch.zeros((), device=self.device) if flag is None else flag)
        # The stop ask rides along (no collective of its own) and is read when this iteration's verdicts settle,
        # at the next iteration's end on every rank alike, which then agree the stop on the host.
        hears_stop = distributed and not self._stop_agreed
        if hears_stop:
            asked = self.state.should_stop or self._preempt_asked or self._rank_failure is not None
            flags.append(torch.full((), float(asked), device=self.device))  # a fill: no copy from the host
        agreed = any_rank_on_device(flags, self.dist)
        if hears_stop:
            self._verdicts.record_stop_ask(self.state.iteration, agreed.pop())
        for loss, flag in zip(losses, agreed, strict=True):
            loss.device_found_inf = flag if loss.device_found_inf is None else loss.device_found_inf + flag

    def _end_iteration(self) -> None:
        if self._verdicts.unsettled:
            self._settle(before=self.state.iteration)
        if self._facts_pending:  # also losses that no stepped optimizer looked at: their scalers update below
            self._agree_facts()
        for loss in self.loss_state.values():
            if loss.scaler is None or not loss.backwards:
                continue
            if loss.device_found_inf is not None:  # updated on the device; the host copy follows when settled
                loss.scaler.keep_on_device(loss.device_found_inf.device)
                loss.scaler.update_on_device(loss.device_found_inf)
                self._verdicts.record_loss(loss.loss_id, self.state.iteration, loss.device_found_inf)
                continue
            old, new = loss.scaler.update(loss.found_inf)
            self.fire("on_loss_scale_update", loss.loss_id, old, new)
        if self._has_step_schedulers:
            if self._verdicts.pending(self.state.iteration):  # they step once the verdicts are read
                stepped = {st_opt: st.stepped for st_opt, st in self.optimizer_state.items()}
                self._verdicts.waiting_schedules.append((self.state.iteration, stepped))
            else:
                self._step_schedulers("step")
        fx, self._fx = self._fx, "on_before_zero_grad"
        for optimizer in self.optimizers.values():
            for hook in self._hooks["on_before_zero_grad"]:
                hook(self, optimizer)
            zero_grad_(optimizer)
        self._fx = fx
        self.state.global_step += 1
        if self._val_every_n_steps > 0 and self.state.global_step % self._val_every_n_steps == 0:
            self._validate()
        if self.dist.enabled and (self._stop_heard or _every(self._log_every, self.state.global_step)):
            self._agree_stop()  # before on_train_batch_end: the checkpoint of this step records an agreed stop

    def _step_schedulers(self, interval: str, stepped_of: dict[torch.optim.Optimizer, bool] | None = None) -> None:
        for spec in self._specs:
            opt_state = self.optimizer_state[spec.optimizer]
            if stepped_of is not None:  # an iteration settled late: whether each optimizer's step stood
                stepped = stepped_of[spec.optimizer]
            else:
                stepped = opt_state.stepped if interval == "step" else opt_state.epoch_steps > 0
            count = opt_state.steps if interval == "step" else self.state.epoch + 1
            for sched in spec.schedulers:
                if sched.interval != interval or not stepped or count % sched.frequency:
                    continue
                if sched.monitor is None:
                    step_scheduler(sched, spec.name)
                    continue
                if is_training_metric(sched.monitor):
                    self._step_on_epoch_mean(sched, spec.name)
                else:
                    self._step_on_validation_value(sched, spec.name, interval)

    def _step_on_validation_value(self, sched: SchedulerSpec, optimizer: str, interval: str) -> None:
        """Step ``sched`` on the validation metric it monitors, or a tag an ``on_validation_end`` hook logged (rank
        zero's, so that every rank steps alike)."""
        value = self.monitored_validation_value(sched.monitor, self.val_metrics)
        if value is not None:
            step_scheduler(sched, optimizer, value)
            return
        logged = sorted(self.validation_end_values)
        problem = (
            f"{_scheduler_name(sched, optimizer)} monitors {shown(sched.monitor)}, but validation "
            f"produced {sorted(self.val_metrics) or 'nothing yet'}"
            + (f" and its on_validation_end hooks logged {logged}" if logged else "")
        )
        if not self.val_metrics and interval == "step":
            problem += " (its 'interval' is 'step'; 'epoch', a monitor's default, steps after validation)"
        _refuse_or_skip(sched, problem)

    def _step_on_epoch_mean(self, sched: SchedulerSpec, optimizer: str) -> None:
        """Step ``sched`` on this epoch's mean of the ``train/`` tag it monitors (or the value logged for it in
        ``on_train_epoch_end``, as a monitor reads it): rank zero's on every rank (the value TensorBoard shows), so
        every rank's learning rate stays the same."""
        value = self.monitored_epoch_value(sched.monitor)
        if value is not None:
            step_scheduler(sched, optimizer, value)
            return
        logged = broadcast_object(self.monitor_value_names(), self.dist)
        problem = (
            f"{_scheduler_name(sched, optimizer)} monitors {shown(sched.monitor)}, but epoch {self.state.epoch} logged "
            f"{', '.join(logged) or 'none'}: {unprefixed_note(sched.monitor, logged)}log it in training_step with "
            f"self.log({shown(sched.monitor)}, value, on_epoch=True), or in "
            "on_train_epoch_end by the Trainer's own hook or a callback that saves no checkpoints (epoch-interval "
            "schedulers step before the checkpoint writers' on_train_epoch_end, whose save then holds the stepped "
            "schedulers)"
        )
        _refuse_or_skip(sched, problem)

    def _validate(self) -> None:
        self._settle()
        if self._val_loader is None:
            return
        # Validation is outside the training batch, also where val_every_n_steps runs it inside one: a value its
        # hooks log() is written at once (not only when the iteration is due to log) and weighs 1 in an epoch mean.
        batch, self._batch = self._batch, None
        try:
            self.fire("on_validation_start")
            self.val_metrics = average_metrics(
                self, self._val_loader, self.validation_step, self._val_limit, "on_validation_batch_end",
                self._val_first_batch,
            )  # fmt: skip
            self.val_metrics_step = self.state.global_step
            if not self._said_empty_validation:
                self._said_empty_validation = warn_of_an_empty_pass(
                    VALIDATE, self._val_loader, self.evaluated_batches, self.dist, expected=False,
                    outcome=f"the validation at step {self.state.global_step} gives no metrics (said once a fit)",
                )  # fmt: skip
            self._fire_evaluation_end("on_validation_end", self.val_metrics)
        finally:
            self._batch = batch
        self._agree_stop()  # early stopping takes effect at once on every rank

    # ----------------------------------------------------------------- validate, test, predict
    @refuses_lightning_arguments
    def validate(self, ckpt: str | os.PathLike | None = None) -> dict[str, float]:
        """Run ``validation_step`` over ``val_dataloader()`` once; returns the averaged metrics.

        ``ckpt``: ``"last"``, ``"best"`` (the newest under ``run_dir``), a path, or None for the current weights.
        Runs under the configured precision and, under ``torchrun``, each rank on its shard. Beside the means (keyed
        as the step returned them) it returns what ``on_validation_end`` hooks logged, by tag, rank zero's values.
        """
        return self._evaluate(VALIDATE, ckpt)

    @refuses_lightning_arguments
    def test(self, ckpt: str | os.PathLike | None = None) -> dict[str, float]:
        """Run ``test_step`` over ``test_dataloader()`` once; returns the averaged metrics and what ``on_test_end``
        hooks logged (``ckpt`` and the values as in validate)."""
        return self._evaluate(TEST, ckpt)

    @refuses_lightning_arguments
    def predict(
        self, ckpt: str | os.PathLike | None = None, output: str | os.PathLike | None = None, overwrite: bool = False
    ) -> list[Any]:
        """``predict_step``'s output for each batch of ``predict_dataloader()`` (tensors on the CPU).

        ``output``: also save them there (``torch.save``; an existing directory gets ``predictions.pt``; under
        ``torchrun`` each rank writes ``<stem>.rank<N><suffix>`` with its shard). Checked before anything runs:
        an output that would overwrite a checkpoint is refused, and so is an existing file unless ``overwrite``.
        """
        checked: list[Path] = []

        def check_output(reading: Path | None) -> None:
            # Rank zero's look at the disk decides for every rank: a refusal there stops them all, with its message.
            decide = partial(prediction_output, output, reading, self.dist.world_size, overwrite)
            checked.append(decided_by_rank_zero(decide, self.dist))

        def write(predictions: list[Any]) -> None:
            # Each rank writes its own shard; one rank's failure stops every rank with its error, so that none returns
            # as if the output were whole (a script's next step, reading every shard, would find one missing).
            path = checked[0] if self.world_size == 1 else rank_output(checked[0], self.global_rank)
            failure = None
            try:
                # Unless asked to overwrite, a file another process put there while this one predicted stays.
                save_atomic(predictions, path, replace=overwrite)
            except FileExistsError:
                kept = save_predictions_beside(predictions, path)  # what this run computed is not thrown away either
                failure = RunDirectoryError(
                    f"cannot write predictions to '{path}': a file appeared there while this predict ran (another "
                    f"process wrote it), which is kept; {kept}; pass --overwrite (predict(..., overwrite=True)) to "
                    "replace it, or name a new file"
                )
            except OSError as exc:  # a full disk, a read-only folder: nothing half-written is left
                said = f"cannot write predictions to '{path}' ({exc.strerror or exc})"
                failure = from_storage(RunDirectoryError(said), exc)
            raise_the_first_failure(failure, self.dist)
            self.predictions_path = checked[0]

        output_given = output is not None
        return self._evaluate(PREDICT, ckpt, check_output if output_given else None, write if output_given else None)

    def _evaluate(
        self,
        stage: Stage,
        ckpt: str | os.PathLike | None,
        before: Callable[[Path | None], None] | None = None,
        after: Callable[[Any], None] | None = None,
    ) -> Any:
        """``stage`` over its loader; ``before(checkpoint path)`` runs on every rank once the checkpoint is agreed,
        before the model is built (predict's check of its output), ``after(result)`` on every rank at the end, while
        the ranks can still agree (predict's write of its output)."""
        check_instance_attributes(self, Trainer)
        if self._running is None:
            self._follow_config()
        if self._running is None and self.module is not None:  # evaluates the model there: one set by hand is not
            refuse_models_set_by_hand(self, models_set_by_hand(self, self._models_left, wrappers=True), stage.name)
        seeds = self._unset() and self.settings.seed is not None  # a fresh model is built from the seed
        if not self._claim(stage.name, seeds):  # from a hook of a running run: its process group stays its own
            result = self._run_stage(stage, ckpt, before)
            if after is not None:
                after(result)
            return result
        try:
            self._start_distributed()
        except BaseException:
            self._release()
            raise
        clean = False
        failure = None
        try:
            with self._process_kept(seeds), without_torch_patches():  # its precision is the config's alone
                result = self._run_stage(stage, ckpt, before)
                if after is not None:
                    after(result)
            clean = True
        except BaseException as exc:
            if isinstance(exc, RuntimeError):
                self._raise_set_up_failure(exc, stage.name)
            failure = exc
            raise
        finally:
            self._release()
            teardown_distributed(self.dist, clean, failure)
        return result

    def _unset(self) -> bool:
        """Whether no run set this Trainer up (its model and callbacks), so an evaluation builds them: also after a
        fit that failed while setting up (configure_optimizers, a loader), which left a model but no callbacks."""
        return self.module is None or isinstance(self._hooks, _NoHooksYet)

    def _raise_set_up_failure(self, exc: RuntimeError, stage: str) -> None:
        """A collective that failed before the callbacks that name a dead rank were set up (comparing configs,
        counting batches, sharing the run directory) is raised naming the ranks that did not check in."""
        if self.dist.enabled and not isinstance(exc, DistributedError) and is_communication_failure(exc):
            raise diagnose_failure(f"a collective while setting up {stage}", exc) from exc

    def _run_stage(
        self, stage: Stage, ckpt: str | os.PathLike | None, before: Callable[[Path | None], None] | None = None
    ) -> Any:
        path, checkpoint = None, None
        if ckpt is not None:  # rank zero resolves it, and every rank must see that file (a node-local run_dir may not)
            resolve, run_dir = partial(resolve_checkpoint, self.cfg.run_dir, ckpt), str(self.cfg.run_dir)
            path, checkpoint = agreed_checkpoint(resolve, self.dist, run_dir, f"{stage.name}: loading")
        if before is not None:
            before(path)
        if ckpt is not None and path is None:
            hint = missing_alias_hint(self.cfg.run_dir, str(ckpt), self.cfg.checkpoint.monitor)
            raise CheckpointError(f"{stage.name}: no '{ckpt}.pt' under {quoted_run_dir(self.cfg.run_dir)}{hint}")
        fresh = self._unset()  # not fitted in this process: build the model as fit would
        if fresh:
            self._setup_model()
        if path is not None:
            self._load_weights(path, checkpoint)
            checkpoint = None  # its optimizer states are not held through the evaluation
        if fresh:
            self._setup_callbacks()
        loader = check_loader(call_setup_method(self, stage.dataloader), stage.dataloader, optional=True)
        given = gather_object(loader is not None, self.dist)  # one rank's None alone: the others would wait
        refuse_a_loader_on_some_ranks(f"{stage.dataloader}()", given, "or define none")
        if loader is None:
            raise NotImplementedError(
                f"{type(self).__name__}.{stage.name}() needs {stage.dataloader}() to return batches"
            )
        loader = evaluation_loader(loader, self.dist, f"{stage.dataloader}()")
        said_empty = warn_of_no_batches(stage, loader, self.world_size)
        outer_stage, self.state.stage = self.state.stage, stage.name  # from a hook: the fit's stage after it
        try:
            if fresh:
                self.fire("on_evaluation_setup", stage.name)
            self.fire(f"on_{stage.hook}_start")
            step = getattr(self, stage.step)
            first_batch = EvaluationFirstBatch(loader, self.dist, f"{stage.dataloader}()")  # every rank alike?
            limit = None
            if stage is VALIDATE:  # trainer.limit_val_batches holds as in fit's validations (and Lightning's)
                limit = batch_limit(
                    self.settings.limit_val_batches, loader, "trainer.limit_val_batches", "val_dataloader()"
                )
            if not self.sharded:  # under FSDP the shorter ranks pad
                source, end_hook = f"{stage.dataloader}()", f"on_{stage.hook}_end"
                warn_of_uneven_evaluation(loader, limit, self.dist, source, stage.step, end_hook)
            if stage is PREDICT:
                result = collect_predictions(self, loader, step, first_batch)
                warn_of_an_empty_pass(stage, loader, self.evaluated_batches, self.dist, said_empty)
                self.fire("on_predict_end", result)
            else:
                batch_end = "on_validation_batch_end" if stage is VALIDATE else None
                result = average_metrics(self, loader, step, limit, batch_end, first_batch)
                warn_of_an_empty_pass(stage, loader, self.evaluated_batches, self.dist, said_empty or limit == 0)
                if stage is VALIDATE:
                    self.val_metrics = result
                self._fire_evaluation_end(f"on_{stage.hook}_end", result)
                logged = self.validation_end_values if stage is VALIDATE else self.test_end_values
                result = {**result, **broadcast_object(logged, self.dist)}  # rank zero's, as monitors read them
        except BaseException as exc:  # as in fit: callbacks undo what they started (precision's autocast)
            if self._running == stage.name:  # from a hook, the outer run fires it, once, as the error unwinds it
                self._explain(exc)
                self._fire_every_one("on_exception", exc, failure=exc)
            raise
        finally:
            self.state.stage = outer_stage
        return result

    def _fire_every_one(self, hook: str, *args: Any, failure: BaseException | None) -> None:
        """Fire an ending hook (``on_exception``, ``on_fit_end``) on every callback even where one raises: the later
        ones save a preempted step, flush logs and leave the process group. While ``failure`` unwinds, a hook's error
        becomes a note on it (the run's own error stays the one raised), except one raised ``from failure``: that
        one says what the failure was (a dead rank named for gloo's "Connection closed by peer") and is raised in
        its place once every hook has run. Otherwise the first error is raised afterwards."""
        first = None
        for method in self._hooks[hook]:
            try:
                method(self, *args)
            except Exception as exc:
                owner = getattr(method, "__self__", self)
                where = f"{type(owner).__name__}.{hook}"
                if failure is None or (exc.__cause__ is failure and first is None):
                    first = first or exc
                elif hasattr(failure, "add_note"):  # Python 3.11+
                    failure.add_note(f"{where} raised {type(exc).__name__}: {exc} while this error unwound")
        if first is not None:
            raise first

    def _explain(self, exception: BaseException) -> None:
        """Attach the first callback's one-line explanation of ``exception`` (what the CLI prints), also as a note
        that ends its traceback; one a set-up method already attached is kept."""
        if getattr(exception, SETUP_ERROR_LINE, None) is not None:
            return
        for callback in self.callbacks:
            line = callback.explain_exception(self, exception)
            if line is not None:
                setattr(exception, SETUP_ERROR_LINE, line)
                if hasattr(exception, "add_note"):  # Python 3.11+
                    exception.add_note(line)
                return

    def _note_loop_position(self, exception: BaseException) -> None:
        """Add to an error raised in an epoch's loop the batch and epoch it struck and the checkpoint to resume: the
        traceback of a dataset's or DataLoader worker's error names neither."""
        if self._loop_phase is None or not isinstance(exception, Exception) or not hasattr(exception, "add_note"):
            return
        newest = self._newest_checkpoint()
        deleted = self.rank_zero_last if newest is None else None  # saved (or resumed), then deleted by hand
        # the batch is set before its first hook runs, so None there is the batch the loader gave
        none = self._fx in ("on_train_batch_start", "training_step") and self._batch is None
        phase, fetched = self._loop_phase, self._fetched_ahead
        exception.add_note(
            loop_position_note(exception, phase, self.state, fetched, newest, self.module, none, deleted)
        )
        self._loop_phase = None

    def _newest_checkpoint(self) -> Path | None:
        """What ``fit(resume="last")`` would continue from, for a note on a failure (None where it cannot be read: the
        note must not replace the error it explains). Rank zero's: another rank's disk may hold none, or older ones;
        it is known there without a collective, which a failing rank may never reach (:attr:`rank_zero_last`)."""
        if self.dist.enabled and not self.is_global_zero:
            return self.rank_zero_last
        try:
            return resolve_checkpoint(self.cfg.run_dir, "last")
        except Exception:
            return None

    # ----------------------------------------------------------------- set-up and data
    def _setup_model(self) -> None:
        if self.settings.seed is not None:
            seed_everything(self.settings.seed)
        self.model_setup = ModelSetup(self.cfg, self.device, self.dist, self.sharded)  # configure_model may add notes
        by_hand = models_set_by_hand(self, self._models_left)
        module = call_setup_method(self, "configure_model")
        if not isinstance(module, torch.nn.Module):
            raise UserCodeError(f"configure_model() must return a torch.nn.Module, got {type(module).__name__}")
        refuse_models_set_by_hand(self, by_hand, self._running or "fit", built=module)
        check_model_has_values(module)
        # Broadcast, checkpoint, compile, shard: the order is stated once, in ampkit/trainer/model_setup.py.
        self.module, self.model = setup_model(module.to(self.device), self.model_setup)
        self._built_model = True

    def _load_train_data(self) -> None:
        """``train_dataloader()``, sharded across ranks, and its batches per epoch."""
        self._train_loader = distributed_loader(
            check_loader(call_setup_method(self, "train_dataloader"), "train_dataloader"),
            self.settings.seed or 0,
            self.dist,
            shuffle_default=True,
        )
        limit = self.settings.limit_train_batches
        self._train_limit = batch_limit(limit, self._train_loader, "trainer.limit_train_batches", "train_dataloader()")
        self._num_train_batches = _batches_in(self._train_loader, self._train_limit, "train_dataloader()")
        full = _batches_in(self._train_loader, None, "train_dataloader()")
        self._train_length_known = full is not None
        self._check_long_epoch = (
            full is not None and full == self._num_train_batches and length_may_undercount(self._train_loader)
        )
        check_batches(self._num_train_batches, "train_dataloader", self._train_loader, self.world_size)
        equal = check_equal_batches(
            counted_batches(self._train_loader, self._train_limit, "train_dataloader()"), self.dist
        )
        self._batch_agreement = None if equal else batch_agreement_group(self.dist)
        self._agree_each_batch = not equal
        self._first_batch_comparison = FirstBatchComparison(self._train_loader, self.dist)  # the same on every rank?
        self._batch_layout = batch_layout(self._train_loader, self.world_size, self._num_train_batches)

    def _setup(self, start: FitStart) -> None:
        self._train_loader = None  # a second fit() asks train_dataloader() again
        self._val_loaded = False  # and val_dataloader(), after it: the earlier fit's count is not this one's
        self._hooks = _NoHooksYet()  # an earlier run's, until this one's callbacks are set up
        self._stop_agreed = self._stop_heard = self._preempt_agreed = False
        self._said_empty_validation = False  # a validation stream that yielded nothing is said once per fit
        self.resumed_layout_change = self.rescaled_resume = None  # a resume sets them; an earlier fit's go
        self._epoch_sums = {}  # a resume restores its checkpoint's
        self._epoch_fx, self._fx, self._epoch_means_taken = {}, None, False
        self._curve_kind = {}
        self._curve_mix_said = set()
        self._held_step_values = {}
        self._unsaid_skips: str | None = None  # an epoch of skips while the scale may still be backing off
        self._setup_model()
        check_model_has_parameters(self.module)
        self._specs = normalize_optimizers(call_setup_method(self, "configure_optimizers"))
        check_group_settings(self._specs)
        # What configure_optimizers set, before groups added mid-run come back (their settings are the checkpoint's).
        self._configured = {spec.name: group_settings(spec.optimizer) for spec in self._specs}
        if start.checkpoint_path is not None:  # a group added and parameters unfrozen mid-run, as when it was saved
            saved = start.checkpoint if start.checkpoint is not None else start.trainer_part  # sharded: trainer.pt's
            restore_trainable(
                self.module, {spec.name: spec.optimizer for spec in self._specs}, saved.get(TRAINABLE_KEY)
            )
        check_parameters(self._specs, self.module, self.automatic_optimization)
        self._has_step_schedulers = any(sc.interval == "step" for spec in self._specs for sc in spec.schedulers)
        self.optimizers = NamedOptimizers((spec.name, spec.optimizer) for spec in self._specs)
        self.optimizer_state = {spec.optimizer: OptimizerState(name=spec.name) for spec in self._specs}
        if not self.automatic_optimization:
            self._direct_step_guards = refuse_direct_steps(self.optimizers, lambda: self._stepping)
        self._reach = ParameterReach(self._specs, self.module)  # named at the end of the first epoch
        if self._train_loader is None:  # configure_optimizers did not ask num_train_batches
            self._load_train_data()
        self._val_loader = evaluation_loader(
            check_loader(call_setup_method(self, "val_dataloader"), "val_dataloader", optional=True), self.dist
        )
        if self._val_loader is not None:
            limit = self.settings.limit_val_batches
            self._val_limit = batch_limit(limit, self._val_loader, "trainer.limit_val_batches", "val_dataloader()")
            said = shuffled_subset_message(
                self._val_loader, self._val_limit, limit, "trainer.limit_val_batches", "val_dataloader()"
            )
            if said is not None:
                rank_zero_warn(said)
        self._val_loaded = True
        count = None if self._val_loader is None else _batches_in(self._val_loader, self._val_limit, "val_dataloader()")
        # The ranks keep or drop the loader together: one whose list is empty runs each pass with none (and is named)
        validates = self.settings.val_every_n_epochs > 0 or self._val_every_n_steps > 0
        self._val_loader = usable_validation_loader(
            self.cfg, self._val_loader, count, self.dist, validates, self.sharded
        )
        if self._val_loader is not None and validates and not self.sharded:  # under FSDP the shorter ranks pad
            warn_of_uneven_evaluation(
                self._val_loader, self._val_limit, self.dist, "val_dataloader()", "validation_step", "on_validation_end"
            )
        self._val_first_batch = EvaluationFirstBatch(self._val_loader, self.dist, "val_dataloader()")  # fit's first
        check_epoch_scheduler_monitors(self)
        for why in idle_settings(
            self.cfg,
            type(self).__name__,
            self._val_loader is not None,
            is_overridden("val_dataloader", self, Trainer),
            self._num_train_batches,
            self.num_training_steps,
            self._specs,
        ):
            rank_zero_warn(why)
        for why in unread_settings(self.cfg, self.config_class, self.world_size, self._val_loader is not None):
            rank_zero_warn(why)
        self._setup_callbacks()
        on_device = uses_device_verdicts(self.settings.skip_verdict, self.device, self.sharded) and not any(
            cb.needs_verdicts_at_once for cb in self.callbacks
        )
        self._device_skip = {
            spec.optimizer: on_device and takes_device_found_inf(spec.optimizer) for spec in self._specs
        }
        devices = {p.device for spec in self._specs for g in spec.optimizer.param_groups for p in g["params"]}
        self._facts_on_device = all(self._device_skip.values()) and bool(self._device_skip) and len(devices) == 1
        self._verdicts = DeviceVerdicts()
        path = start.checkpoint_path
        if path is not None and self.sharded and start.checkpoint is not None:
            raise CheckpointError(
                f"'{path}' is a single-file checkpoint (saved without distributed.strategy=fsdp); this run uses "
                "distributed.strategy=fsdp, which resumes sharded checkpoint directories: resume it with "
                "distributed.strategy=ddp"
            )
        if path is not None and not self.sharded and start.checkpoint is None:
            raise CheckpointError(
                f"'{path}' is a sharded checkpoint directory (saved with distributed.strategy=fsdp); this run uses "
                f"distributed.strategy={self.cfg.distributed.strategy}, which saves single-file checkpoints, and one "
                "run directory keeps one kind: resume it with distributed.strategy=fsdp, on any number of processes "
                "(one included)"
            )
        if path is not None:  # before anything is written: a checkpoint that does not fit leaves no trace
            checkpoint = start.checkpoint if start.checkpoint is not None else self._load_shards(path, start)
            self._restore(checkpoint, path)
            self._check_resume_position(path, checkpoint.get("batch_layout"), saved_accumulation(checkpoint))
        if self.automatic_optimization and (total := self.num_training_steps) is not None:  # one step per iteration
            for spec in self._specs:
                steps = self.optimizer_state[spec.optimizer].steps
                refuse_scheduler_overrun(spec, steps, total - self.state.global_step)
        # One run writes a version directory at a time (run_life's rules): rank zero opens it, and where it refuses (a
        # live run holds it) every rank stops with its error, rather than training on into a collective it never joins.
        self.version_dir = self.rank_zero_version_dir = None
        version_dir, self.rank_zero_last = decided_by_rank_zero(partial(self._open_version_dir, start), self.dist)
        self.version_dir = version_dir if self.is_global_zero or self.sharded else None
        self.rank_zero_version_dir = version_dir
        if self.sharded:  # every rank writes its shards into the checkpoint directory
            self._check_shards_writable()

    def _open_version_dir(self, start: FitStart) -> tuple[Path, Path | None]:
        """:func:`open_version_dir`, keeping its lock (rank zero's: the others get only the directory), and what
        ``fit(resume="last")`` would continue from."""
        self.version_dir, self._lock = open_version_dir(self.cfg.run_dir, start, self.cfg, self.state.global_step)
        return self.version_dir, self._newest_checkpoint()

    def _check_shards_writable(self) -> None:
        """Under FSDP every rank writes its shards into the version directory rank zero made: each must see it and
        may write there. Checked on every rank before training, not found out by the first checkpoint."""
        if not self.cfg.checkpoint.enabled:
            return
        problems = gather_object(shard_writing_problem(self.version_dir), self.dist)
        found = "; ".join(f"on rank {rank} {problem}" for rank, problem in enumerate(problems) if problem)
        if found:
            self._discard_version_dir = True  # nothing trained: a version_N made for this run goes again
            raise ConfigError(
                f"config key 'run_dir': under distributed.strategy=fsdp every rank writes its checkpoint shards into "
                f"'{self.version_dir}', but {found}: put run_dir on a file system that every rank (node) shares and "
                "may write"
            )

    def _check_resume_position(self, path: Path, saved_layout: dict[str, int] | None, saved_accumulate: int) -> None:
        """A mid-epoch position moved to this run's ranks x batch size; refused where this run's epoch cannot reach
        it (a larger batch size, less data)."""
        note = order_change_note(
            self.fit_start.order_changes, saved_layout, self._batch_layout, self.state.batches_done
        )
        if note is not None:
            rank_zero_warn(
                f"resuming '{path}' {counted(self.state.batches_done, 'batch', 'batches')} into its epoch: {note}"
            )
        saved_batches = self.state.batches_done
        done = batches_done_here(
            saved_layout, self._batch_layout, saved_batches, self.settings.accumulate_grad_batches, path
        )
        self.state.batches_done = self._resume["batches_done"] = done
        self.rescaled_resume = rescaling(self.state.epoch, saved_layout, self._batch_layout, saved_batches, done)
        self.resumed_layout_change = layout_change(
            saved_layout, self._batch_layout, saved_accumulate, self.settings.accumulate_grad_batches
        )
        total = self._num_train_batches
        if total is not None and done > total:
            raise CheckpointError(
                f"checkpoint '{path}' is {counted(done, 'batch', 'batches')} into epoch {self.state.epoch}, but this "
                f"run's epoch has {total}: the data, batch size or limit_train_batches changed since it was saved. "
                "Resume with the settings it was saved with, or resume from an epoch-end checkpoint"
            )

    def _load_shards(self, path: Path, start: FitStart) -> dict[str, Any]:
        try:
            return load_sharded(path, self.module, self.optimizers, self.cfg, start.trainer_part)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc} (this run's distributed.strategy: {self.cfg.distributed.strategy})") from None

    def _already_finished(self) -> None:
        """A resume of a run that already finished (run_life's rules): nothing runs, nothing is written. The
        callbacks' saved states are restored, so a fit() run again to read ``best_model_path`` or ``stopped_epoch``
        (a Lightning idiom) reads the run's; the model and optimizers are not built."""
        from ampkit.callbacks import ModelCheckpoint

        loop, path = self.fit_start.loop, self.fit_start.checkpoint_path
        self.state.epoch, self.state.batches_done, self.state.global_step = (
            loop["epoch"],
            loop["batches_done"],
            loop["global_step"],
        )
        self.version_dir = path.parent.parent if self.fit_start.version_dir is not None else None
        self.rank_zero_version_dir = self.version_dir  # every rank's: nothing is written
        try:  # configure_callbacks() may read the model or the data, which a finished run does not build
            self._setup_callbacks()
            saved = self.fit_start.checkpoint or self.fit_start.trainer_part or {}
            self._load_callback_states(saved.get("callbacks", {}), path)
            for cb in self.callbacks:  # its ranked files are beside the checkpoint (no on_fit_start told it where)
                if isinstance(cb, ModelCheckpoint):
                    cb.ranked_in(path.parent)
        except Exception as error:  # a convenience, so it never turns "nothing to train" into a failure
            self.callbacks = []
            rank_zero_warn(
                f"the callbacks of the finished run '{path}' were not restored ({type(error).__name__}: {error}): "
                "their saved states (best_model_path, stopped_epoch...) are not on this Trainer"
            )
        if self.is_global_zero:
            finish_interrupted_pruning(self.fit_start)
            say(f"ampkit: nothing to train: {self.fit_start.nothing_to_train}")

    def _setup_callbacks(self) -> None:
        from ampkit.callbacks import default_callbacks, switched_on_by

        defaults = default_callbacks(self)
        self._config_callback_keys = sorted(cb.state_key for cb in defaults)  # a resume's config may drop them
        own = callback_list(call_setup_method(self, "configure_callbacks"), "configure_callbacks()")
        keys = [switched_on_by(cb) for cb in defaults]
        sources = [FROM_CONFIG if key is None else f"{FROM_CONFIG}'s {key}" for key in keys]
        sources += ["configure_callbacks()"] * len(own)
        sources += ["Trainer(callbacks=...)"] * len(self._user_callbacks)
        self.callbacks = order_callbacks(defaults + own + self._user_callbacks, sources)
        check_collective_callbacks_on_every_rank(self.callbacks, self.dist)  # before any of them joins one
        for cb in self.callbacks:  # a misspelt hook (Lightning's on_validation_epoch_end) would never run
            own_hooks(type(cb), Callback, takes_trainer=True)
            check_lightning_only_hooks(type(cb), Callback)  # nor Lightning's setup(trainer, pl_module, stage)
        unused, known = {id(cb): set(cb.unused_hooks(self)) for cb in self.callbacks}, set(HOOKS)
        for cb in self.callbacks:
            if not unused[id(cb)] <= known:
                raise ValueError(f"{cb.name}.unused_hooks() names {sorted(unused[id(cb)] - known)}, not hooks")
            if not set(cb.hook_phases) <= known:
                raise ValueError(f"{cb.name}.hook_phases names {sorted(set(cb.hook_phases) - known)}, not hooks")
        self._hooks, self._saves_at = {}, {}
        for hook in HOOKS:
            # ties: as given, but a reader of logged values (the console, early stopping) after the others of its phase
            # and a checkpoint's save after that (they may log or change its state)
            ordered = sorted(self.callbacks, key=partial(run_order, hook=hook))
            running = [cb for cb in ordered if is_overridden(hook, cb, Callback) and hook not in unused[id(cb)]]
            self._hooks[hook] = [getattr(cb, hook) for cb in running]
            persist = [cb.hook_phases.get(hook, cb.phase) >= Phase.PERSIST for cb in running]
            at = persist.index(True) if True in persist else len(running)
            saves = [is_persist and cb.saves_checkpoints for cb, is_persist in zip(running, persist, strict=True)]
            saves_at = saves.index(True) if True in saves else len(running)
            if hook in self._own_hooks:  # called as fn(self, *args)
                # The subclass's own hook runs after the callbacks' but before a checkpoint's (PERSIST): what it
                # changes or logs at a checkpoint's step is in that checkpoint, not lost to a kill after the save.
                self._hooks[hook].insert(at, getattr(type(self), hook))
                saves_at += 1
            self._saves_at[hook] = saves_at  # where the checkpoint writers start (epoch schedulers step just before)

    def _epoch_batches(self, ahead: bool = False) -> Iterator[Any]:
        """This epoch's batches (an iterator made now: no Python frame between the loop and the loader per batch);
        after a mid-epoch resume, the same ones the interrupted run would have seen (``ahead``: fetched one ahead, the
        next one drawn from the RNGs as they were before the saved batch ran)."""
        resume, self._resume = self._resume, None
        skip = resume["batches_done"] if resume else 0
        if resume:  # mid-epoch: replay the epoch's start to draw the same order, then skip what was done
            restore_rng(resume["epoch_rng"] if skip else resume["rng"])
            generators = resume["loader_generators"]  # None: a checkpoint of a run before they were saved
            if generators is not None and generators["epoch" if skip else "now"] is not None:
                restore_generators(self._train_loader, generators["epoch" if skip else "now"])
        set_sampler_epoch(self._train_loader, self.state.epoch)  # a new shuffle each epoch, the same on every rank
        self._epoch_rng = capture_rng()
        self._epoch_generators = capture_generators(self._train_loader)
        iterator = self._workers.iterate(self._train_loader)
        for done in range(skip):
            if next(iterator, None) is None:  # a loader without a length, shorter than when the checkpoint was saved
                raise CheckpointError(
                    f"the resumed checkpoint is {counted(skip, 'batch', 'batches')} into epoch {self.state.epoch}, "
                    f"but this run's train_dataloader() yields only {done}: the data or batch size changed since it "
                    "was saved"
                )
        if skip and ahead and resume.get("rng_before_fetch") is not None:
            restore_rng(resume["rng_before_fetch"])
            self._rng_after_fetch = resume["rng"]  # restored by _flag_last once it fetched
        elif skip:
            restore_rng(resume["rng"])
        total = self._num_train_batches
        self._epoch_pass = iterator
        batches = islice(iterator, None if total is None else max(total - skip, 0))
        if self._agree_each_batch:  # some rank's count is unknown: the epoch ends where any rank's data does
            batches = while_every_rank_has_a_batch(batches, self.dist, self._batch_agreement, self.state.epoch, skip)
        return self._first_batch_comparison.batches(batches)  # after the agreement: every rank has a first batch

    def _flag_last(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches`` fetched one ahead, so that a loader without a length still marks its last batch
        (``self._at_last_batch``): its partial window then steps with the epoch, as a known length's does, instead of
        leaving its gradients to the next epoch's first step (or, after the last epoch, to no step). The RNGs before
        each fetch are kept for a checkpoint: a fetch may draw from them (a random augmentation), and it ran before the
        batch before it, so a mid-epoch resume fetches it from there (bit-identical resumes)."""
        self._rng_before_fetch = capture_rng()
        self._fetched_ahead = 0
        upcoming = next(batches, _NO_BATCH)
        if self._rng_after_fetch is not None:  # a resume: the RNGs the saved run had after its batch
            restore_rng(self._rng_after_fetch)
            self._rng_after_fetch = None
        self._fetched_ahead = 1
        while upcoming is not _NO_BATCH:
            self._rng_before_fetch = capture_rng()
            batch, upcoming = upcoming, next(batches, _NO_BATCH)
            self._at_last_batch = upcoming is _NO_BATCH
            yield batch
        self._at_last_batch = False
        self._rng_before_fetch = None
        self._fetched_ahead = 0

    def _to_device(self, batch: Any) -> Any:
        """``batch`` with its tensors on the device, found in dicts, lists, tuples (named too) and dataclasses (frozen
        too: their copy gets the moved fields, where apply_to_collection refuses them)."""
        if self._on_cpu:
            return batch
        return apply_to_collection(batch, (torch.Tensor, _FrozenDataclass), self._moved)

    def _moved(self, value: torch.Tensor | Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(self.device, non_blocking=True)
        moved = copy.copy(value)
        for f in dataclasses.fields(value):
            object.__setattr__(moved, f.name, self._to_device(getattr(value, f.name)))  # past the frozen __setattr__
        return moved

    @staticmethod
    def _detached(out: Any) -> dict[str, Any]:
        if out is None:
            return {}
        if isinstance(out, torch.Tensor):
            return {"loss": out.detach()}
        if not isinstance(out, dict):
            raise UserCodeError(f"training_step must return a tensor, a dict or None; got {type(out).__name__}")
        return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in out.items()}

    # ----------------------------------------------------------------- checkpoints
    def loop_position(self) -> dict[str, int]:
        """Where a run resumed from now would continue: epoch, batches already done in it, global step."""
        s = self.state
        if s.epoch_finished:
            return {"epoch": s.epoch + 1, "batches_done": 0, "global_step": s.global_step}
        return {"epoch": s.epoch, "batches_done": s.batches_done, "global_step": s.global_step}

    def stop_reason(self) -> str | None:
        """Why training stopped before its limits (``state.should_stop``), or None: a resume of a checkpoint that
        records it trains nothing unless a key that decides stopping changed (run_life's rules)."""
        s = self.state
        if not s.should_stop or (self.dist.enabled and not self._stop_agreed):  # torchrun: one rank's ask is not a stop
            return None
        return s.stop_reason or _STOP_ASKED

    def checkpoint_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-identically: model, optimizers, schedulers, callbacks, loop, RNG.

        Under FSDP the model and optimizer shards are not in it: every rank writes its own (``save_sharded``).
        """
        self._settle()  # the counts and schedulers it saves are the settled ones
        checkpoint = {
            FORMAT_KEY: FORMAT_VERSION,
            "schedulers": {spec.name: [sc.scheduler.state_dict() for sc in spec.schedulers] for spec in self._specs},
            # their classes: a resume refuses to load one's state into another class, which would take it silently
            "scheduler_types": {
                spec.name: [type(sc.scheduler).__name__ for sc in spec.schedulers] for spec in self._specs
            },
            "optimizer_counts": {
                st.name: {
                    "steps": st.steps,
                    "skipped_steps": st.skipped_steps,
                    "epoch_steps": st.epoch_steps,
                    "epoch_skipped_steps": st.epoch_skipped_steps,
                }
                for st in self.optimizer_state.values()
            },
            "loop": self.loop_position(),
            "stopped_early": self.stop_reason(),
            "rng": capture_rng(),
            "epoch_rng": self._epoch_rng,
            # a sampler's (or the loader's) own torch.Generator: at the epoch's start, for a mid-epoch resume to
            # replay it, and now, for one at the next epoch's start
            "loader_generators": {"epoch": self._epoch_generators, "now": capture_generators(self._train_loader)},
            "rng_before_fetch": self._rng_before_fetch,  # None unless fetching one ahead (_flag_last)
            "batch_layout": self._batch_layout,
            "val_metrics": dict(self.val_metrics),
            "val_metrics_step": self.val_metrics_step,
            "validation_end_values": dict(self.validation_end_values),
            # log(on_epoch=True) sums so far this epoch: a mid-epoch resume's epoch mean covers the whole epoch
            "epoch_sums": {tag: [float(total), count] for tag, (total, count) in self._epoch_sums.items()},
            # which hook logs each on_epoch tag: a resume refuses a second hook's as the run before it would have
            "epoch_fx": dict(self._epoch_fx),
            # which kind of value (per step, epoch means) each log() tag got first, and in which hook, and the mixes
            # warned of: a resume refuses or warns of a mix as the run before it would have, and says it once
            "curve_kind": {name: [epoch, fx] for name, (epoch, fx) in self._curve_kind.items()},
            "curve_mix_said": sorted([name, fx] for name, fx in self._curve_mix_said),
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
            "optional_callback_states": sorted(cb.state_key for cb in self.callbacks if cb.state_is_optional),
            "config_callback_states": self._config_callback_keys,
            TRAINABLE_KEY: trainable_record(self.module, self.optimizers, self._master_pairs()),
            "config": plain_config(self.cfg),
            # What configure_optimizers() built for this run (values a weights-only load rebuilds: a custom
            # optimizer's callable in a group is left out), so a resume names only the settings the code changed.
            "configured_optimizer_settings": {
                name: [{key: v for key, v in group.items() if unloadable_entry(v) is None} for group in groups]
                for name, groups in self._configured.items()
            },
        }
        if self._launch is not None:  # under torchrun: a restart of this launch continues from it
            checkpoint["launch"] = self._launch
        if not self.sharded:
            checkpoint["model"] = self.module.state_dict()
            checkpoint["optimizers"] = {spec.name: spec.optimizer.state_dict() for spec in self._specs}
        fire_checkpoint_hook(self.fire, "on_save_checkpoint", checkpoint)
        return checkpoint

    def _master_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model parameter, its fp32 master) of every optimizer that holds masters (O2) in the model's place."""
        return [
            pair
            for st in self.optimizer_state.values()
            if st.master_weights is not None
            for pair in zip(st.master_weights.model_params, st.master_weights.master_params, strict=True)
        ]

    def _say_config_changes(self, path: Path | None, kept: list[str]) -> None:
        """Warn once of the resume's changed config keys not yet said, with the optimizer settings ``kept`` from
        the checkpoint over configure_optimizers()'s (:func:`resume_settings_warning`)."""
        changed, self._unsaid_config_changes = self._unsaid_config_changes, []
        if path is not None and (said := resume_settings_warning(path, changed, kept)) is not None:
            rank_zero_warn(said)

    def _load_callback_states(self, saved: dict[str, Any], path: Path) -> list[tuple[Callback, str]]:
        """Each callback's state among ``saved`` (checkpoint ``path``'s) loaded into it; returns ``(callback, key)`` of
        those loaded. A state it refuses (a damaged file) is noted with the file and the key it came from."""
        loaded = states_to_load(self.callbacks, saved)
        for cb, key in loaded:
            try:
                cb.load_state_dict(saved[key])
            except (ValueError, TypeError, KeyError) as exc:
                exc.add_note(f"in checkpoint '{path}', the state of callback '{key}'")
                raise
        return loaded

    def _restore(self, checkpoint: dict[str, Any], path: Path) -> None:
        from ampkit.callbacks.precision import saved_masters_into_model

        saved = sorted(checkpoint["optimizers"])
        ours = sorted(spec.name for spec in self._specs)
        if saved != ours:
            raise CheckpointError(
                f"checkpoint '{path}' has the optimizers {saved}; this run's configure_optimizers() makes {ours}: "
                "resume with the optimizers it was saved with (their names come from configure_optimizers)"
            )
        check_saved_weights_finite(path, checkpoint["model"], self.dist if self.sharded else None)
        try:
            load_model_state(self.module, checkpoint["model"])
            saved_masters_into_model(self.module, self.optimizers, checkpoint)
            saved_groups = (checkpoint.get(TRAINABLE_KEY) or {}).get("groups", {})
            our_groups = trainable_record(self.module, self.optimizers, self._master_pairs())["groups"]
            for spec in self._specs:
                saved_state, schedulers = checkpoint["optimizers"][spec.name], checkpoint["schedulers"][spec.name]
                then = [len(group["params"]) for group in saved_state.get("param_groups", [])]
                check_optimizer_fits(
                    spec.name, then, spec.optimizer, saved_groups.get(spec.name), our_groups[spec.name]
                )
                spec.optimizer.load_state_dict(saved_state)
                saved_types = checkpoint.get("scheduler_types", {}).get(spec.name)
                check_schedulers_fit(spec.name, saved_types, len(schedulers), [sc.scheduler for sc in spec.schedulers])
                for sched, state in zip(spec.schedulers, schedulers, strict=True):
                    sched.scheduler.load_state_dict(state)
        except (KeyError, RuntimeError, ValueError) as exc:
            detail = misfit_detail(exc, checkpoint.get("config") or {}, self.cfg)
            raise CheckpointError(f"checkpoint '{path}' does not fit this run's model/optimizers: {detail}") from None
        kept = [
            line
            for spec in self._specs
            for line in settings_kept_from_checkpoint(
                spec, self._configured[spec.name], checkpoint.get("configured_optimizer_settings", {}).get(spec.name)
            )
        ]
        self._say_config_changes(path, kept)  # with them: "lr: 0.05 -> 0.001" alone reads as the new rate training
        for opt_state in self.optimizer_state.values():
            counts = checkpoint["optimizer_counts"].get(opt_state.name, {})
            opt_state.steps = counts.get("steps", 0)
            opt_state.skipped_steps = counts.get("skipped_steps", 0)
            opt_state.epoch_steps = counts.get("epoch_steps", 0)
            opt_state.epoch_skipped_steps = counts.get("epoch_skipped_steps", 0)
        loaded = self._load_callback_states(checkpoint["callbacks"], path)
        present = {key for _, key in loaded}.union(checkpoint.get("optional_callback_states", ()))
        orphaned = sorted(key for key, state in checkpoint["callbacks"].items() if state and key not in present)
        by_config = [key for key in orphaned if key in checkpoint.get("config_callback_states", ())]
        if by_config:  # ampkit's own, which a config key switched on then (fp16's loss scaling) and off now
            rank_zero_warn(
                f"checkpoint '{path}' holds the state of {by_config}, which its config switched on and this run's "
                "config leaves off; it is not restored (set the config as it was to restore it)"
            )
        orphaned = [key for key in orphaned if key not in by_config]
        if orphaned:  # a callback left out or renamed on resume: its saved state would vanish without a word
            rank_zero_warn(
                f"checkpoint '{path}' holds the state of callbacks {orphaned} that this run does not have; it is not "
                "restored (pass them to Trainer(callbacks=...) or configure_callbacks(), under the same state_key)"
            )
        loop = checkpoint["loop"]
        self.state.epoch, self.state.batches_done, self.state.global_step = (
            loop["epoch"],
            loop["batches_done"],
            loop["global_step"],
        )
        # The iteration the loop is at between batches, as in the run that saved it: a resume at an epoch's last batch
        # runs that epoch's end before any batch, and its log() values and logger events are stamped with it.
        self.state.iteration = loop["global_step"]
        self.val_metrics = dict(checkpoint.get("val_metrics", {}))
        self.val_metrics_step = checkpoint.get("val_metrics_step")
        self.validation_end_values = dict(checkpoint.get("validation_end_values", {}))  # absent before this ampkit
        self._epoch_sums = {tag: list(total) for tag, total in checkpoint.get("epoch_sums", {}).items()}
        self._epoch_fx = dict(checkpoint.get("epoch_fx", {}))  # absent from checkpoints of an older ampkit
        self._curve_kind = {name: (bool(epoch), fx) for name, (epoch, fx) in checkpoint.get("curve_kind", {}).items()}
        self._curve_mix_said = {(name, fx) for name, fx in checkpoint.get("curve_mix_said", [])}  # as epoch_fx
        self._resume = {
            "batches_done": loop["batches_done"],
            "rng": checkpoint["rng"],
            "epoch_rng": checkpoint["epoch_rng"],
            "loader_generators": checkpoint.get("loader_generators"),
            "rng_before_fetch": checkpoint.get("rng_before_fetch"),
        }
        not_restored = rng_not_restored(checkpoint["rng"])  # said once here: a resume restores its RNGs several times
        if not_restored:
            rank_zero_warn(f"checkpoint '{path}': {not_restored}")
        with weights_loaded_before(checkpoint):
            fire_checkpoint_hook(self.fire, "on_load_checkpoint", checkpoint)

    def _load_weights(self, path: Path, checkpoint: dict[str, Any] | None = None) -> None:
        """The model weights of a checkpoint file or sharded directory, for validate/test/predict; ``checkpoint``: the
        file (a sharded one's ``trainer.pt``), where every rank has loaded it already (agreed_checkpoint)."""
        if is_sharded_checkpoint(path) and self.sharded:  # shards straight into this run's sharded model
            load_sharded(path, self.module, {}, self.cfg, checkpoint)
            check_saved_weights_finite(path, self.module.state_dict(), self.dist)  # every rank: one collective
            return
        checkpoint = checkpoint or {}
        try:
            if is_sharded_checkpoint(path):
                state = consolidate_checkpoint(path, checkpoint or None)
            else:
                checkpoint = checkpoint or load_with_fallback_hint(path)
                if "model" not in checkpoint:
                    raise CheckpointError(f"checkpoint '{path}' has no 'model' entry: it holds no weights to load")
                state = checkpoint["model"]
            check_saved_weights_finite(path, state)
            load_model_state(self.module, state)
        except CheckpointError:  # a corrupt or foreign file (a RuntimeError too): its own message says why
            raise
        except (KeyError, RuntimeError) as exc:
            saved = checkpoint or peek_checkpoint(path / TRAINER_FILE) or {}  # a sharded one keeps it in trainer.pt
            detail = misfit_detail(exc, saved.get("config") or {}, self.cfg)
            raise CheckpointError(f"checkpoint '{path}' does not fit this run's model: {detail}") from None

    # ----------------------------------------------------------------- validation of settings
    def _validate_config(self) -> None:
        check_values(self.cfg)
        check_launch_environment()
        if os.environ.get("RANK", "0") == "0":  # a file in the way; write access is fit's to check
            self._check_run_dir(write=False)
        t = self.cfg.trainer
        validate_strategy(self.cfg)
        validate_model_setup(self.cfg)
        check_monitors_can_be_met(self.cfg, type(self).__name__, is_overridden("val_dataloader", self, Trainer))
        clip, precision_clip = t.clip_grad_norm, self.cfg.precision.clip_grad_norm
        if clip is not None and precision_clip is not None and clip != precision_clip:
            raise ConfigError(
                f"config keys 'trainer.clip_grad_norm' ({clip}) and 'precision.clip_grad_norm' ({precision_clip}) "
                "disagree; set one of them"
            )
        from ampkit.callbacks import precision_callbacks  # lazily, as _setup_callbacks does

        # Building the precision callbacks runs every precision.* check (opt level, dtype, scaler knobs) now,
        # before configure_model or any other user code; they are plain objects, rebuilt at set-up.
        precision_callbacks(self.cfg.precision)

    def _check_run_dir(self, write: bool) -> None:
        """``run_dir`` can hold a run (and, with ``write``, this process may write there). validate/test/predict only
        read it, so a read-only run directory (an archive, a shared mount) still serves them. Rank zero, which writes
        it, decides for every rank (once distributed has started), so all stop together."""
        reason = decided_by_rank_zero(partial(unwritable_reason, self.cfg.run_dir, write), self.dist)
        if reason is not None:
            raise ConfigError(f"config key 'run_dir': cannot create a run under '{self.cfg.run_dir}': {reason}")
