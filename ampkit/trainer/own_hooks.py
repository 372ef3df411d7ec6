"""Hooks a Trainer subclass or a callback defines (``def on_train_epoch_end(self)``), a Trainer's steps' signatures,
and what a subclass or an instance puts in place of a Trainer's method, checked before anything runs.

A Trainer's take a callback hook's arguments minus ``trainer`` and run after every callback but a checkpoint's
(``Phase.PERSIST``, which saves what they leave), as Lightning runs its module's hooks. A method named ``on_...`` that
is not a hook, or that cannot take the hook's arguments, is refused before training: silently never calling it
would hide the mistake.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from torch import nn

from ampkit.trainer.callback import HOOKS, Callback
from ampkit.trainer.lightning_names import (
    LIGHTNING_CALLBACK_HOOKS,
    LIGHTNING_MODULE_HOOKS,
    LIGHTNING_ON_HOOKS,
    lightning_only_hooks,
)
from ampkit.trainer.user_code import UserCodeError


def _hook_arguments(hook: str) -> list[str]:
    """The arguments a hook passes after ``trainer`` (e.g. ``["outputs", "batch"]``)."""
    return list(inspect.signature(getattr(Callback, hook)).parameters)[2:]


def own_hooks(cls: type, base: type, takes_trainer: bool = False) -> list[str]:
    """Names of the hooks ``cls`` defines below ``base``, in :data:`HOOKS` order (``takes_trainer``: a callback's).

    Raises:
        UserCodeError: a method named ``on_...`` that is no hook, or whose signature cannot take the hook's arguments.
    """
    defined = {
        name
        for klass in cls.__mro__
        if klass not in base.__mro__  # the subclass and any mixin it inherits from
        for name, value in vars(klass).items()
        if name.startswith("on_") and callable(value)
    }
    for name in sorted(defined - set(HOOKS)):
        close = difflib.get_close_matches(name, HOOKS, n=2)  # two: on_validation_epoch_end is near both val hooks
        hint = f"did you mean {' or '.join(repr(hook) for hook in close)}? " if close else ""
        if name in LIGHTNING_ON_HOOKS:  # its name is no typo: say what does its work
            hint = f"it is Lightning's hook; here: {LIGHTNING_ON_HOOKS[name]}. "
        raise UserCodeError(
            f"{cls.__name__}.{name} is not a hook the Trainer calls; {hint}hooks: {', '.join(HOOKS)}. "
            "Rename a helper method that is not meant as a hook."
        )
    for name in defined:
        arguments = ["trainer", *_hook_arguments(name)] if takes_trainer else _hook_arguments(name)
        try:
            inspect.signature(getattr(cls, name)).bind(None, *arguments)
        except TypeError:
            expected = ", ".join(["self", *arguments])
            why = "" if takes_trainer else " (a Trainer's hooks get no 'trainer' argument: it is self)"
            raise UserCodeError(
                f"{cls.__name__}.{name}{inspect.signature(getattr(cls, name))} cannot take the hook's arguments; "
                f"define it as def {name}({expected}){why}"
            ) from None
    return [hook for hook in HOOKS if hook in defined]


STEPS = ("training_step", "validation_step", "test_step", "predict_step")


def check_step_signatures(cls: type) -> None:
    """Each step takes one batch. Lightning's ``training_step(self, batch, batch_idx)`` is refused at construction,
    naming ``self.state.batch_idx``, instead of failing with a TypeError at the first batch."""
    for name in STEPS:
        step = getattr(cls, name)
        try:
            inspect.signature(step).bind(None, None)
        except TypeError:
            raise UserCodeError(
                f"{cls.__name__}.{name}{inspect.signature(step)} cannot be called with one batch; define it as "
                f"def {name}(self, batch) (the batch's index within the epoch is self.state.batch_idx, where "
                "Lightning passes batch_idx)"
            ) from None


def check_lightning_only_hooks(cls: type, base: type) -> None:
    """A Lightning hook without the ``on_`` prefix that a ported Trainer (``base``: Trainer; ``setup(self, stage)``,
    ``validation_epoch_end``) or Callback (``base``: Callback; ``setup``, ``teardown``) defines is refused naming what
    does its work here: ampkit never calls it, so it would silently never run."""
    callback = issubclass(cls, Callback)
    hooks = LIGHTNING_CALLBACK_HOOKS if callback else LIGHTNING_MODULE_HOOKS
    found = lightning_only_hooks(cls, base, hooks)
    if found:
        name, kind = found[0], "Callback" if callback else "LightningModule"
        raise UserCodeError(
            f"{cls.__name__}.{name} is a {kind} hook, which ampkit never calls; in ampkit: {hooks[name]}"
        )


def _replaced_methods(namespace: Any, base: type) -> list[str]:
    """Public methods of ``base`` that ``namespace`` (a subclass, or an instance's ``vars``) holds no function for."""
    methods = [name for name, value in vars(base).items() if not name.startswith("_") and inspect.isfunction(value)]
    if isinstance(namespace, type):
        return [name for name in methods if not callable(getattr(namespace, name))]
    return [name for name in methods if name in namespace and not callable(namespace[name])]


def _parameters(method: Any) -> str:
    return ", ".join(inspect.signature(method).parameters)


def check_replaced_methods(cls: type, base: type) -> None:
    """A subclass's attribute replacing a method of ``base`` with what is no function (Lightning code's
    ``training_step = None``) is refused at construction, naming it, not met as a TypeError of ``inspect`` or of the
    first call."""
    for name in _replaced_methods(cls, base):
        owner = next(klass for klass in cls.__mro__ if name in vars(klass))
        raise UserCodeError(
            f"{owner.__name__}.{name} is {vars(owner)[name]!r:.60}, which replaces the method {base.__name__}.{name} "
            f"with no function; define it as def {name}({_parameters(getattr(base, name))}), or delete the attribute "
            f"to keep {base.__name__}'s"
        )


def check_instance_attributes(trainer: object, base: type) -> None:
    """Attributes set on a Trainer instance in place of its methods or hooks, before a run: one that is no function
    would fail at its first call, and a hook there would silently never run (hooks are the class's)."""
    cls, namespace = type(trainer), vars(trainer)
    for name in _replaced_methods(namespace, base):
        raise UserCodeError(
            f"trainer.{name} was set to {namespace[name]!r:.60} on this {cls.__name__}, which replaces its method "
            f"{name}() with no function; delete the attribute (del trainer.{name}) to call the method again"
        )
    for name in HOOKS:
        if callable(namespace.get(name)):
            raise UserCodeError(
                f"trainer.{name} was set on this {cls.__name__} instance, where the Trainer never calls it: it calls "
                f"the hooks its class defines. Define def {name}(self, ...) in {cls.__name__}, or pass a Callback "
                f"with that hook ({cls.__name__}(callbacks=[...]))"
            )


def models_set_by_hand(trainer: Any, left: tuple[Any, Any], wrappers: bool = False) -> dict[str, Any]:
    """``trainer.module``/``trainer.model`` where they are not what its last run left (``left``: both None before any
    run): set by hand (a model assigned in ``__init__`` or between runs). With ``wrappers``, a ``trainer.model`` that
    wraps the run's own ``trainer.module`` (``torch.compile(trainer.module)`` for a faster evaluation) is not one: it
    runs the module, and so the weights a checkpoint loads into it."""
    held = {"module": trainer.module, "model": trainer.model}
    by_hand = {
        name: obj for (name, obj), was in zip(held.items(), left, strict=True) if obj is not None and obj is not was
    }
    model = by_hand.get("model")
    if wrappers and "module" not in by_hand and isinstance(model, nn.Module):
        if any(sub is trainer.module for sub in model.modules()):
            del by_hand["model"]
    return by_hand


def refuse_models_set_by_hand(trainer: Any, by_hand: dict[str, Any], entry: str, built: Any = None) -> None:
    """Refuse to drop or misuse a model set by hand: one that ``configure_model()`` did not return (``built``; None
    where the run builds none) would be dropped by the run's set-up, or evaluated apart from the module a checkpoint
    loads into."""
    dropped = {name: obj for name, obj in by_hand.items() if obj is not built}
    if not dropped:
        return
    held = " and ".join(f"trainer.{name} was set to a {type(obj).__name__}" for name, obj in dropped.items())
    which = "after the last run set up another" if built is None else "which configure_model() did not return"
    raise UserCodeError(
        f"{entry}() of {type(trainer).__name__}: {held} {which}; the "
        "Trainer runs the model it builds from configure_model() (trainer.module, and trainer.model wrapping or "
        "compiling it) and loads checkpoints into it, so the one set would be dropped or evaluated apart from them. "
        "Return it from configure_model() (a Trainer attribute of another name may hold it; trainer.compile compiles "
        "it), or set both to None for the next run to build its own"
    )
