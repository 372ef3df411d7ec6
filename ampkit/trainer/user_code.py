"""What a Trainer subclass's methods must return, checked where the loop receives it: a mistake becomes one
:class:`UserCodeError` naming the method, what it gave and what is expected (one line in the CLI)."""

from __future__ import annotations

import numbers
import re
from collections.abc import Iterable
from typing import Any

import torch
from omegaconf import DictConfig

from ampkit.config import AMPKIT_KEYS, flatten
from ampkit.trainer.state import loss_id_key
from ampkit.wording import beyond_float, counted, integer_digits, shown


class UserCodeError(TypeError, ValueError):
    """A Trainer subclass's method is misspelt, or returned something the loop cannot use.

    Both a TypeError and a ValueError, as the wrong type or the wrong value it reports."""


TAG_RULE = "printable text (no newline, tab or control character), such as 'samples/grid'"


def check_tag(call: str, tag: Any, rule: str = TAG_RULE) -> None:
    """Raise a UserCodeError naming ``call`` and ``tag`` unless the tag is ``rule``: a number or tuple would be written
    under its str(), and a newline or control character splits the console's line and is in no name a monitor can
    give (config.names_a_metric refuses it there), so log() and ``trainer.logger`` refuse one as monitors do."""
    if not isinstance(tag, str) or not tag.strip():
        what = "empty" if isinstance(tag, str) else type(tag).__name__
        raise UserCodeError(f"{call}(tag={shown(tag)}): the tag is {what}; expected a string such as 'train/acc'")
    if not tag.isprintable():
        raise UserCodeError(f"{call}(tag={shown(tag)}): the tag is invalid; expected {rule}")


def check_loss(loss: torch.Tensor, loss_id: Any) -> int | str:
    """A loss ``backward`` can use: a real scalar tensor that requires grad (three reads per backward), and a
    ``loss_id`` that can name its scaler, returned as its key (:func:`loss_id_key`)."""
    try:
        loss_id = loss_id_key(loss_id)
    except TypeError:  # at O0 too: a tensor id made a new loss entry at every backward, scaled or not
        raise UserCodeError(
            f"backward(loss_id={shown(loss_id)}): a loss id is a name or an integer, not a {type(loss_id).__name__}"
        ) from None
    named = shown(loss_id)  # a pasted 100 kB name, or an integer of 5000 digits, whose repr() raises
    if not isinstance(loss, torch.Tensor):
        raise UserCodeError(f"backward(loss_id={named}) got a {type(loss).__name__}; expected the loss tensor")
    if loss.numel() != 1:
        raise UserCodeError(
            f"the loss of loss_id {named} has shape {tuple(loss.shape)}; expected a scalar (reduce it: .mean())"
        )
    if not loss.requires_grad:
        if not (loss.is_floating_point() or loss.is_complex()):  # an integer tensor cannot carry a gradient at all
            raise UserCodeError(
                f"the loss of loss_id {named} is a {loss.dtype} tensor, which has no gradient; expected a "
                "floating-point loss computed from the model's output"
            )
        raise UserCodeError(
            f"the loss of loss_id {named} does not require grad: it was computed under torch.no_grad(), "
            "detached, or from no trainable parameter"
        )
    if loss.is_meta:  # autograd's "Cannot copy out of meta tensor" names neither the loss nor the way out
        raise UserCodeError(
            f"the loss of loss_id {named} is on the meta device, which holds no values to backpropagate; compute "
            "it from the model's output on the device the model is on"
        )
    if loss.is_complex():  # autograd's own error names neither the loss nor the way out
        raise UserCodeError(
            f"the loss of loss_id {named} is {loss.dtype}; expected a real number (take .abs() or .real)"
        )
    return loss_id


def first_names(names: list[str], shown: int = 3) -> str:
    """``names`` for a message: the first ``shown`` of them, then how many more (``a, b, c and 4 more``)."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def check_model_has_values(module: torch.nn.Module) -> None:
    """``configure_model``'s module holds values: a parameter or buffer on the meta device (built under
    ``torch.device("meta")`` and never materialized) has none to train, move or load into, and torch's error at
    ``.to(device)`` names neither the tensors nor the way out."""
    names = [name for name, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    if names and torch.get_default_device().type == "meta":  # every tensor the run makes would have no values
        raise UserCodeError(
            f"configure_model() returned a model whose {first_names(names)} are on the meta device, where "
            "torch.set_default_device('meta') puts every tensor made without a device (the run's own too): set it "
            "back with torch.set_default_device(None) before fit(), and build the model under `with "
            "torch.device('meta'):` where meant"
        )
    if names:
        raise UserCodeError(
            f"configure_model() returned a model whose {first_names(names)} are on the meta device, which holds no "
            "values: build it on a real device, or materialize it in configure_model (model.to_empty(device='cpu'), "
            "then initialize its weights, e.g. with each module's reset_parameters())"
        )


def check_model_has_parameters(module: torch.nn.Module) -> None:
    """A model to train holds a parameter: one of buffers only (a fixed transform, a model whose weights were
    registered as buffers) failed inside torch, in ``configure_optimizers``, as an optimizer of an empty list."""
    if next(module.parameters(), None) is not None:
        return
    buffers = [name for name, _ in module.named_buffers()]
    held = f"only buffers: {first_names(buffers)}" if buffers else "no tensors"
    raise UserCodeError(
        f"configure_model() returned a {type(module).__name__} with no parameters to train ({held}): make trainable "
        "tensors nn.Parameter (register_parameter, not register_buffer); validate, test and predict run a model "
        "without any as it is"
    )


def _shown(value: Any) -> str:
    """``value`` as an error names it: its type, and a number's value (``float 0.53``)."""
    if value is None:
        return "None"
    kind = type(value).__name__
    return f"{kind} {value:.4g}" if isinstance(value, numbers.Real) and not isinstance(value, bool) else f"a {kind}"


def training_step_loss_error(out: Any) -> UserCodeError:
    """Why ``out``, which ``training_step`` returned under automatic optimization, holds no loss to backpropagate,
    naming what it held (a dict's keys, a number that has left autograd's graph)."""
    if isinstance(out, dict):
        if "loss" not in out:
            keys = ", ".join(repr(key) for key in list(out)[:6]) + (", ..." if len(out) > 6 else "")
            got = f"a dict without 'loss' (keys: {keys or 'none'})"
        else:
            got = f"a dict whose 'loss' is {_shown(out['loss'])}"
            out = out["loss"]
    else:
        got = "None" if out is None else _shown(out)
    if isinstance(out, numbers.Number):
        got += ", a number with no autograd graph (return the tensor itself, not loss.item())"
    why = (
        "; to skip a batch, set automatic_optimization = False and call self.backward/self.step for the batches to "
        "train"
        if out is None
        else ""
    )
    return UserCodeError(
        f"training_step returned {got}; under automatic optimization it returns the loss tensor, or a dict holding it "
        f"under 'loss'{why}"
    )


def refuse_beyond_float(what: str, value: Any) -> None:
    """Refuse an integer no float holds (``float()`` of it raises a bare OverflowError): metrics are averaged, shown
    and written to TensorBoard as floats. ``what`` names where it came from (``log('acc')``)."""
    if beyond_float(value):
        raise UserCodeError(
            f"{what}: {integer_digits(value)} is beyond a float's range (+-1.8e308), which the "
            "mean, the console and TensorBoard read it as; give a value within it"
        )


def check_metrics(metrics: Any, method: str) -> dict[str, Any]:
    """``validation_step``/``test_step``'s return value: a dict of metric name to number or scalar tensor."""
    if not isinstance(metrics, dict):
        raise UserCodeError(
            f"{method} returned a {type(metrics).__name__}; expected a dict of metrics, e.g. {{'loss': loss}}"
        )
    for key, value in metrics.items():
        if not isinstance(key, str) or not key.strip():  # logged under val/<name>: 'val/3', or 'val/' for ''
            what = "an empty name" if isinstance(key, str) else f"a name that is {type(key).__name__}"
            raise UserCodeError(
                f"{method} returned metric {shown(key)}, {what}; each metric is named by a non-empty string such "
                "as 'mse'"
            )
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            if isinstance(value, torch.Tensor) and value.is_complex():  # float() of it fails naming neither
                raise UserCodeError(
                    f"{method} returned metric {shown(key)} as a {value.dtype} tensor; each metric is a real number "
                    "(take .abs() or .real)"
                )
            shape = f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""
            raise UserCodeError(
                f"{method} returned metric {shown(key)} as a {type(value).__name__}{shape}; each metric is a number "
                "or a one-element tensor (reduce it: .mean())"
            )
        if beyond_float(value):  # named only when refused: this runs for every metric of every step
            refuse_beyond_float(f"{method} returned metric {shown(key)}", value)
    return metrics


def check_loader(loader: Any, method: str, optional: bool = False) -> Any:
    """A ``*_dataloader`` method's return value: a DataLoader or any iterable of batches, not several loaders
    (``optional``: None, no such data, passes)."""
    if loader is None and optional:
        return None
    if not isinstance(loader, Iterable) or isinstance(loader, str | bytes):
        raise UserCodeError(
            f"{method}() returned a {type(loader).__name__}; expected a DataLoader or another iterable of batches"
        )
    items = list(loader.values()) if isinstance(loader, dict) else loader if isinstance(loader, list | tuple) else []
    if items and all(isinstance(item, torch.utils.data.DataLoader) for item in items):
        raise UserCodeError(
            f"{method}() returned a {type(loader).__name__} of {len(items)} DataLoaders; it returns one iterable of "
            "batches: chain the sets into one and tag each batch with its set, and the step names its metrics per "
            "set (acc_a, acc_b; each is averaged over the batches that return it)"
        )
    return loader


def empty_batch_error(method: str, where: str) -> UserCodeError:
    """A batch of 0 samples from ``method``'s loader (a DataLoader never makes one; a collate_fn or a dataset's
    own batching can), which would train or average on nothing: a nan loss, zero gradients, a nan metric."""
    return UserCodeError(
        f"{method}() gave an empty batch ({where}): every tensor in it has 0 rows; a collate_fn or dataset that "
        "filters samples must not return a batch with none left (drop it there, or keep at least one sample)"
    )


def keyword_batch_error(batch: Any, exc: BaseException) -> UserCodeError | None:
    """The default ``predict_step`` passed a dict ``batch`` to the model as one argument: a one-line error saying
    what to write, when ``exc`` is the model refusing it (naming the batch's type, or a missing argument)."""
    kind = type(batch).__name__
    text = " ".join(str(exc).split())
    if not isinstance(exc, TypeError | AttributeError) or (kind not in text and "positional argument" not in text):
        return None
    keys = ", ".join(map(str, list(batch)[:5])) + (", ..." if len(batch) > 5 else "")
    return UserCodeError(
        f"the default predict_step() passed the batch, a {kind} of {keys}, to the model as one argument, and the "
        f"model refused it ({type(exc).__name__}: {text}): for a model that takes keyword arguments (a Hugging Face "
        "model) define predict_step(self, batch) returning self.model(**batch)"
    )


def check_batches(count: int | None, method: str, loader: Any = None, world_size: int = 1) -> None:
    """A training loader with batches (an empty one would 'finish' at once, training nothing); ``loader`` (this
    rank's) and ``world_size`` let the error give the numbers behind it (:func:`no_batches_message`)."""
    if count != 0:
        return
    raise UserCodeError(
        no_batches_message(
            method,
            loader,
            world_size,
            "no epoch would train on it (an epoch ends at len())",
            "the epoch then ends where the data does",
        )
    )


def no_batches_message(
    method: str,
    loader: Any,
    world_size: int,
    outcome: str,
    stream_then: str = "a pass then runs to the end of the data",
) -> str:
    """Why ``method()``'s loader, of ``len()`` 0, has no batches, and its ``outcome`` (``validation is skipped``):
    that only its ``len()`` is 0 where that is its author's count (an IterableDataset's, which may yield more; a
    stream without a length does ``stream_then`` instead), else the numbers behind it where lengths tell (an empty
    dataset, a per-rank share below one batch). One message for the train, validation, test and predict loaders."""
    from ampkit.trainer.batch_counts import length_may_undercount

    if loader is not None and length_may_undercount(loader):  # a stream's len() 0 need not mean it yields nothing
        return (
            f"len({method}()) is 0, so {outcome}; its __len__ returns the number of batches "
            f"a pass yields, or raises TypeError where it has no length ({stream_then})"
        )
    return f"{method}() yields no batches{_why_no_batches(loader, world_size)}; {outcome}"


def exhausted_loader_error(epoch: int, expected: int | None) -> UserCodeError:
    """A training epoch whose loader yielded no batch at all, which would otherwise end at once, training nothing,
    for this epoch and every one after it: most often an iterator a former epoch used up."""
    promised = f" (its len() says {expected})" if expected else ""
    before = (
        "a generator or iterator that an earlier epoch used up, a sampler that does not start over, or "
        if epoch > 0
        else ""
    )
    return UserCodeError(
        f"train_dataloader() yielded no batch in epoch {epoch}{promised}: {before}an iterable that yields nothing. "
        "Return a DataLoader, or an object whose __iter__ starts a new pass each time it is called"
    )


def short_epoch_message(epoch: int, got: int, promised: int, open_batches: int, window_end: int) -> str:
    """Why an epoch whose loader yielded ``got`` batches, fewer than its ``len()`` of ``promised``, is wrong
    (``open_batches``: the batches of an accumulation window its last batch left open, to close at batch
    ``window_end``, whose gradients no step took); most often an IterableDataset whose ``__len__`` overstates it."""
    fix = "make its len() count what it yields, or give it no __len__ (the epoch then ends where the data does)"
    said = (
        f"train_dataloader() yielded {counted(got, 'batch', 'batches')} in epoch {epoch}, but its len() says {promised}"
    )
    if open_batches:
        return (
            f"{said}: the gradients of its last {open_batches} wait for an accumulation window "
            f"(trainer.accumulate_grad_batches) to close at batch {window_end}, which never comes, so the next "
            f"epoch's first step would take them too; {fix}"
        )
    return f"{said}: progress, num_training_steps (a scheduler's length) and mid-epoch resumes count on len(); {fix}"


def long_epoch_message(epoch: int, promised: int, loader: Any = None) -> str:
    """Why an epoch that stopped at its loader's ``len()`` of ``promised`` batches while the loader had more (an
    IterableDataset whose ``__len__`` understates it) is said: the batches past it are never trained on. Under a
    DataLoader with several workers, the commonest cause comes first: each worker iterating the whole stream."""
    said = (
        f"train_dataloader() has more batches than its len() of {promised}: epoch {epoch} ended after {promised} "
        "of them, as every epoch will (as Lightning's do), and the rest are never trained on"
    )
    fix = "make its len() count what it yields, or give it no __len__ (the epoch then ends where the data does)"
    workers = getattr(loader, "num_workers", 0) if isinstance(loader, torch.utils.data.DataLoader) else 0
    if workers > 1:
        return (
            f"{said}; its DataLoader runs num_workers={workers}, each with its own copy of the IterableDataset: "
            f"unless its __iter__ yields only its worker's share, every worker yields the whole stream and each sample "
            f"comes {workers} times. Shard it in __iter__ by torch.utils.data.get_worker_info() (its id and "
            f"num_workers: skip the samples of the other workers); else {fix}"
        )
    return f"{said}; {fix}"


def _why_no_batches(loader: Any, world_size: int) -> str:
    """Why a DataLoader yields no batch (``: its 1 sample dealt to 2 ranks, 1 per rank, ...``) where lengths tell."""
    guess = " (an empty dataset, or a batch size above its length?)"
    if not isinstance(loader, torch.utils.data.DataLoader):
        return guess
    try:
        total = len(loader.dataset)
    except TypeError:  # a dataset without a length
        return guess
    if total == 0:
        return ": its dataset is empty"
    if loader.batch_size is None:  # a batch_sampler of its own (evaluation's per-rank batches)
        return guess
    try:
        share = len(loader.sampler)
    except TypeError:  # a sampler without a length
        return guess
    if not (loader.drop_last and share < loader.batch_size):
        return guess
    if world_size > 1:
        counts = f"its {counted(total, 'sample')} dealt to {world_size} ranks, {share} per rank"
        fixes = "fewer ranks, a smaller batch_size, or drop_last=False"
    else:
        counts = f"{counted(share, 'sample')} per epoch"
        fixes = "a smaller batch_size, or drop_last=False"
    return f": {counts}, fewer than batch_size={loader.batch_size} with drop_last=True ({fixes})"


def _named_settings(cfg: DictConfig, message: str) -> str:
    """`` (config: data.batch_size=0)``: the keys of the Trainer's own config sections that ``message`` names."""
    own = {key: value for key, value in flatten(cfg, sep=".").items() if key.partition(".")[0] not in AMPKIT_KEYS}
    named = [
        f"{key}={shown(value)}"
        for key, value in own.items()
        if len(leaf := key.rpartition(".")[2]) >= 3 and re.search(rf"\b{re.escape(leaf)}\b", message)
    ]
    return f" (config: {', '.join(named)})" if named else ""


# The attribute :func:`call_setup_method` sets on what a set-up method raised (and the casting callback on a dtype
# clash of a cast model): the one line the CLI prints for it.
SETUP_ERROR_LINE = "ampkit_setup_error"


def call_setup_method(trainer: Any, method: str) -> Any:
    """``trainer.<method>()`` at set-up (``configure_model``, ``train_dataloader``...). What it raises (a setting
    of its own that a library refuses, such as a batch size of 0; a missing package) propagates as it is, carrying
    one line (:data:`SETUP_ERROR_LINE`) naming the method and the config keys its message names, which the CLI
    prints instead of a traceback. ampkit's own errors, and ``NotImplementedError`` (a method it lacks), carry none."""
    try:
        return getattr(trainer, method)()
    except Exception as exc:
        if not (type(exc).__module__.startswith("ampkit.") or isinstance(exc, NotImplementedError)):
            text = " ".join(str(exc).split())
            detail = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
            setattr(exc, SETUP_ERROR_LINE, f"{method}() raised {detail}{_named_settings(trainer.cfg, str(exc))}")
        raise


def nothing_trained_warning(optimizer_states: Any, automatic: bool, loss_states: Any = ()) -> str | None:
    """Why an epoch that ends with an optimizer that never stepped trained nothing (or nothing with it), or None:
    every step it took was skipped (non-finite gradients at every step: a loss scaler's early back-off skips a
    few, not all); under manual optimization a ``training_step`` that never calls ``self.step``; else a loss
    reaching no parameter. ``loss_states`` (the Trainer's) name the loss scales."""
    states = list(optimizer_states)
    all_skipped = _skipped_every_step(states)
    if all_skipped:
        return _all_skipped_warning(all_skipped, len(all_skipped) == len(states), list(loss_states))
    if any(st.epoch_steps or st.epoch_skipped_steps for st in states):
        return None
    if not automatic:
        return (
            "no optimizer stepped in this epoch: under manual optimization training_step calls "
            "self.step(optimizer) after self.backward(loss)"
        )
    return (
        "no optimizer stepped in this epoch: no parameter of theirs received a gradient (the loss does not depend "
        "on the model's trainable parameters)"
    )


def never_stepped(optimizer_states: Any) -> bool:
    """Whether each optimizer that skipped every step of the epoch has never stepped in the run: its loss scaler
    may still be backing off from its first scale (an epoch shorter than the back-off), so the epoch's warning waits,
    said only if the run ends before a step is taken."""
    skipped = _skipped_every_step(optimizer_states)
    return bool(skipped) and all(not st.steps for st in skipped)


def _skipped_every_step(optimizer_states: Any) -> list[Any]:
    """The optimizers that skipped every step they took this epoch (and took at least one)."""
    return [st for st in optimizer_states if st.epoch_skipped_steps and not st.epoch_steps]


def _all_skipped_warning(skipped: list[Any], every_optimizer: bool, losses: list[Any]) -> str:
    counts = ", ".join(f"'{st.name}' skipped all {st.epoch_skipped_steps}" for st in skipped)
    blamed = ", ".join(shown(i) for i in sorted({i for st in skipped for i in st.loss_ids}, key=str))
    scales = ", ".join(
        f"loss_id {shown(loss.loss_id)}'s is {loss.scale:.4g}" for loss in losses if loss.scale is not None
    )
    who = "the model" if every_optimizer else "their parameters"
    return (
        f"every step of this epoch was skipped, so {who} did not change (optimizer {counts}: inf/NaN gradients"
        f"{f' from loss_id {blamed}' if blamed else ''}{f'; loss scale now: {scales}' if scales else ''}). A loss "
        "scaler skips a few steps while its scale backs off from its first one (precision.init_scale); where it "
        "keeps skipping, the gradients are inf/NaN at any scale: look for a NaN/inf loss (bad inputs or labels, log "
        "or division of 0), parameters already non-finite, or too high a learning rate"
    )
