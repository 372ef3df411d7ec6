"""The evaluation loops: metrics averaged over a data set (validation, test) and per-batch predictions."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from lightning_utilities.core.rank_zero import rank_zero_warn

from ampkit.trainer.batch_counts import checked_count, length_may_undercount, loader_length
from ampkit.trainer.distributed import (
    DistributedEnv,
    all_reduce_sum,
    evened_by_agreement,
    filler_batches_from,
    gather_object,
    padded_to_the_longest_rank,
)
from ampkit.trainer.duplicated_data import EvaluationFirstBatch
from ampkit.trainer.failure_note import noting_fetch_failures
from ampkit.trainer.loader_rng import set_sampler_epoch
from ampkit.trainer.user_code import check_metrics, no_batches_message

if TYPE_CHECKING:
    from ampkit.trainer.trainer import Trainer


@dataclass(frozen=True)
class Stage:
    """What one evaluation entry point runs: its Trainer methods and the hooks around it."""

    name: str  # validate | test | predict
    dataloader: str  # the Trainer method returning its batches
    step: str  # the Trainer method run on each batch
    hook: str  # fires on_<hook>_start / on_<hook>_end


VALIDATE = Stage("validate", "val_dataloader", "validation_step", "validation")
TEST = Stage("test", "test_dataloader", "test_step", "test")
PREDICT = Stage("predict", "predict_dataloader", "predict_step", "predict")


_SEQUENCES = (list, tuple)  # a tuple of types: ``list | tuple`` would build a union object at each call


def batch_size(batch: Any) -> int | None:
    """The samples in ``batch``: the leading size of its first non-empty tensor (a 0-d tensor is one), searched
    through dicts, lists, tuples and dataclasses; 0 when every tensor in it is empty; None (unknown) when it holds
    no tensor (strings, a custom object). Runs on every training batch (once: the Trainer keeps it in its state),
    so it is plain recursion, with lists and tuples looked for before the ``Mapping`` ABC's slower isinstance."""
    if isinstance(batch, torch.Tensor):
        return batch.size(0) if batch.dim() else 1  # not .shape: a nested tensor has no sizes, but a leading one
    if isinstance(batch, _SEQUENCES):
        values: Any = batch
    elif isinstance(batch, Mapping):
        values = batch.values()
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        values = (getattr(batch, f.name) for f in dataclasses.fields(batch))
    else:
        return None
    found = None
    for value in values:
        size = batch_size(value)
        if size:
            return size
        if size == 0:
            found = 0
    return found


_RETURNS_NOTHING = {"validate": "validate() returns no metrics", "test": "test() returns no metrics"}


def warn_of_no_batches(stage: Stage, loader: Any, world_size: int) -> bool:
    """A standalone validate/test/predict over a loader of ``len()`` 0 runs no step and returns nothing: said, naming
    why as fit's loaders' messages do (Lightning warns of a zero-length loader too); whether it was said. A stream's
    ``len()`` is its author's count and its pass runs to the end whatever it says, so it is not judged by it (see
    :func:`warn_of_an_empty_pass`)."""
    if length_may_undercount(loader) or loader_length(loader, f"{stage.dataloader}()") != 0:
        return False
    rank_zero_warn(no_batches_message(stage.dataloader, loader, world_size, _outcome(stage)))
    return True


def warn_of_an_empty_pass(
    stage: Stage, loader: Any, batches: int, env: DistributedEnv, expected: bool, outcome: str | None = None
) -> bool:
    """An evaluation pass that ran no batch on any rank (``batches``: all ranks'), where no ``len()`` said so
    beforehand (a stream without one, or whose ``len()`` promised more): said after the pass, or validate/test/predict
    returned ``{}`` or ``[]`` (a fit's validation, no metrics: ``outcome``) without a word; not where that was
    ``expected`` (said before, or a limit of 0). Whether it was said."""
    if batches > 0 or expected:
        return False
    length = loader_length(loader, f"{stage.dataloader}()")
    told = "it has no len() to tell beforehand" if length is None else f"though its len() is {length}"
    rank_zero_warn(
        f"{stage.dataloader}() yielded no batches{' on any rank' if env.enabled else ''} ({told}); "
        f"{outcome or _outcome(stage)}: a stream that ended at once (an iterator an earlier pass used up, a filter "
        "that drops every sample, a shard by rank that leaves none)"
    )
    return True


def _outcome(stage: Stage) -> str:
    return _RETURNS_NOTHING.get(stage.name, "predict() returns no predictions")


# What an evaluation step gives where a Lightning step calls self.log: Trainer.log there is refused with it.
INSTEAD_OF_LOG = {
    "validation_step": "it returns its metrics (e.g. {'acc': acc}), each averaged over the set and logged as val/acc; "
    "log() is for training",
    "test_step": "it returns its metrics (e.g. {'acc': acc}), each averaged over the set (test/acc); log() is for "
    "training",
    "predict_step": "it returns its predictions; log() is for training",
}


def run_step(trainer: Trainer, step: Callable[[Any], Any], batch: Any) -> Any:
    """``step(batch)``, with ``trainer.evaluation_step`` naming it meanwhile (so ``log()`` there is refused)."""
    trainer.evaluation_step = step.__name__
    try:
        return step(batch)
    finally:
        trainer.evaluation_step = None


def training_modes(module: torch.nn.Module) -> list[tuple[torch.nn.Module, bool]]:
    """Each submodule's train/eval mode, to hand the model back after evaluation as training code left it (a frozen
    backbone kept in eval mode, its BatchNorm statistics fixed), not all in train mode."""
    return [(submodule, submodule.training) for submodule in module.modules()]


def restore_training_modes(modes: list[tuple[torch.nn.Module, bool]]) -> None:
    """Put each submodule back in the mode :func:`training_modes` saw (not recursively: each is listed)."""
    for submodule, training in modes:
        submodule.training = training


def real_and_filler_batches(trainer: Trainer, loader: Any, source: str) -> Iterator[tuple[Any, bool]]:
    """``(batch, real)`` for each batch this rank runs: a filler batch (``real`` False) keeps step with ranks that
    have more, its results dropped. Under FSDP, where every forward is a collective, a loader that may give the ranks
    different counts (an ``IterableDataset``, per-rank lists) is padded to the longest rank's."""
    filler = filler_batches_from(loader)
    batches = noting_fetch_failures(trainer._workers.iterate(loader), source)  # a bad sample's error names its batch
    if filler is None and trainer.dist.enabled and trainer.sharded and evened_by_agreement(loader):
        return padded_to_the_longest_rank(batches, trainer.dist, source)
    return ((batch, filler is None or i < filler) for i, batch in enumerate(batches))


@torch.no_grad()
def average_metrics(
    trainer: Trainer,
    loader: Any,
    step: Callable[[Any], dict[str, Any]],
    limit: int | None = None,
    batch_end_hook: str | None = None,
    first_batch: EvaluationFirstBatch | None = None,
) -> dict[str, float]:
    """Run ``step`` on every batch (the model in eval mode) and average each metric, weighted by batch size,
    over the batches of all ranks that returned it; ``batch_end_hook`` fires with each batch's metrics and the batch.

    A metric only some batches return (one per validation set of a chained loader) is averaged over those; a
    filler batch (a rank with fewer samples keeping step with the others) counts for nothing. The ranks may run
    different numbers of batches: they meet only at the end, where ``first_batch`` compares their first ones."""
    modes = training_modes(trainer.module)
    trainer.module.eval()
    ran = 0  # real batches: the pass's count over all ranks is kept in trainer.evaluated_batches
    sums: dict[str, float] = {}
    seen: dict[str, float] = {}
    source = _DATALOADER_OF.get(step.__name__, "the evaluation data")
    set_sampler_epoch(loader, trainer.state.epoch)  # as Lightning: a shuffled DistributedSampler's order per epoch
    empty: list[int] = []
    fingerprint = None  # of this rank's first batch, while first_batch's comparison is pending
    for i, (batch, real) in enumerate(real_and_filler_batches(trainer, loader, source)):
        if limit is not None and i >= limit:
            break
        if i == 0 and first_batch is not None:
            fingerprint = first_batch.note(batch)
        n = checked_count(trainer.samples_in(batch), trainer, "samples_in")  # on the host, before it moves
        batch = trainer._to_device(batch)
        metrics = check_metrics(run_step(trainer, step, batch), f"{step.__name__}(batch)")
        if not real:
            continue
        ran += 1
        if n == 0:  # no samples, nothing to average (its step ran: a sharded model's collectives keep in step)
            empty.append(i)
            continue
        n = n or 1  # samples unknown (no tensor in the batch): each batch weighs one
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value) * n
            seen[key] = seen.get(key, 0.0) + n
        if batch_end_hook is not None:
            trainer.fire(batch_end_hook, metrics, batch)
    restore_training_modes(modes)
    if empty:
        warnings.warn(
            f"{step.__name__}: batch(es) {', '.join(map(str, empty[:5]))}{', ...' if len(empty) > 5 else ''} held "
            "0 samples (every tensor with 0 rows: a collate_fn or dataset that filters samples?); left out of the "
            "means",
            stacklevel=2,
        )
    keys = _keys_of_every_rank(list(sums), fingerprint, first_batch, trainer.dist)
    totals = all_reduce_sum(
        [sums.get(k, 0.0) for k in keys] + [seen.get(k, 0.0) for k in keys] + [float(ran)], trainer.dist
    )
    trainer.evaluated_batches = int(totals[-1])
    return {key: totals[i] / totals[len(keys) + i] for i, key in enumerate(keys)}


def _keys_of_every_rank(
    keys: list[str], fingerprint: str | None, first_batch: EvaluationFirstBatch | None, env: DistributedEnv
) -> list[str]:
    """The metric keys any rank returned, in one order on every rank (rank zero's first), so that sums keyed by them
    line up; the same gather carries each rank's first-batch ``fingerprint`` to ``first_batch`` while it is pending."""
    if not env.enabled:
        return keys
    gathered = gather_object((keys, fingerprint), env)
    if first_batch is not None and first_batch.pending:
        first_batch.judge([rank_fingerprint for _, rank_fingerprint in gathered])
    return list(dict.fromkeys(key for rank_keys, _ in gathered for key in rank_keys))


@torch.no_grad()
def collect_predictions(
    trainer: Trainer, loader: Any, step: Callable[[Any], Any], first_batch: EvaluationFirstBatch | None = None
) -> list[Any]:
    """``step``'s output for every batch (the model in eval mode), tensors detached and moved to the CPU; a filler
    batch's (a rank with fewer samples keeping step with the others) is dropped. The ranks meet only at the end, in
    one gather of their counts, which carries the comparison of their first batches (``first_batch``)."""
    modes = training_modes(trainer.module)
    trainer.module.eval()
    predictions = []
    fingerprint = None
    set_sampler_epoch(loader, trainer.state.epoch)
    for i, (batch, real) in enumerate(real_and_filler_batches(trainer, loader, "predict_dataloader()")):
        if i == 0 and first_batch is not None:
            fingerprint = first_batch.note(batch)
        output = run_step(trainer, step, trainer._to_device(batch))
        if real:
            predictions.append(apply_to_collection(output, torch.Tensor, lambda t: t.detach().cpu()))
    restore_training_modes(modes)
    gathered = gather_object((len(predictions), fingerprint), trainer.dist)
    if first_batch is not None and first_batch.pending and trainer.dist.enabled:
        first_batch.judge([rank_fingerprint for _, rank_fingerprint in gathered])
    trainer.evaluated_batches = sum(count for count, _ in gathered)
    return predictions


# The loader each evaluation step's batches come from, as errors name it.
_DATALOADER_OF = {"validation_step": "val_dataloader()", "test_step": "test_dataloader()"}
