"""Lightning's ModelCheckpoint and EarlyStopping attributes a port sets after construction (``ckpt.dirpath = ...``,
``es.verbose = True``) that ampkit's classes have no setting for: refused naming what does their work here, as the
constructor refuses the argument, instead of becoming an attribute nothing reads. One the class computes
(``ckpt.best_model_path = ...``, ``es.wait_count = 0``) is refused saying so, not with "property has no setter".
Those whose only work in Lightning is what the callback says (``verbose``), which ampkit says anyway, are kept with one
warning: a ported subclass's ``self.verbose = verbose`` (read by its own code) still constructs."""

from __future__ import annotations

import os
import warnings
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_only

from ampkit.lightning_settings import LIGHTNING_CALLBACK_ARGUMENTS, LIGHTNING_COMPUTED_ATTRIBUTES, ampkit_class_named
from ampkit.wording import shown

# Lightning's attributes that change only what a callback prints, which ampkit prints regardless: nothing of a run
# differs whether they are read, so one set is kept (and said once) rather than refused.
SAID_ANYWAY = frozenset({"verbose", "log_rank_zero_only"})

_warned: set[tuple[type, str]] = set()  # (class, name) said so far: each once in the process


class RefusesLightningAttributes:
    """Refuses the assignment of a Lightning argument the class does not take (see the module docstring). A subclass
    keeps an attribute of its own by such a name by declaring it in its class body (``verbose: bool = False``)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if (refusal := _refusal(type(self), name)) is not None:
            base, why = refusal
            said = f"{type(self).__name__}.{name} = {shown(value)}"
            own = (
                f"; a subclass keeps an attribute of its own by this name by declaring it in its class body "
                f"({name}: {type(value).__name__} = ...)"
                if type(self) is not base
                else ""
            )
            if name not in SAID_ANYWAY:
                raise AttributeError(f"{said} is not taken: {why}{own}")
            if (type(self), name) not in _warned and _on_rank_zero():
                _warned.add((type(self), name))
                warnings.warn(f"{said} is kept but changes nothing: {why}{own}", UserWarning, stacklevel=2)
        super().__setattr__(name, value)


def _refusal(cls: type, name: str) -> tuple[type, str] | None:
    """The ampkit class and why ``cls`` refuses Lightning's attribute ``name``; None for any other, or one a subclass
    declares (in its class body, before the ampkit class in its line)."""
    base = ampkit_class_named(cls, LIGHTNING_CALLBACK_ARGUMENTS)
    if base is None:
        return None
    refused = LIGHTNING_CALLBACK_ARGUMENTS[base.__name__]
    computed = LIGHTNING_COMPUTED_ATTRIBUTES[base.__name__]
    if name not in refused and name not in computed:
        return None
    for klass in cls.__mro__[: cls.__mro__.index(base)]:
        if name in vars(klass) or name in vars(klass).get("__annotations__", {}):
            return None
    if name in computed:
        return base, f"{base.__name__} computes it, {computed[name]}"
    return base, _said(base.__name__, name, refused[name])


def _on_rank_zero() -> bool:
    """Whether this process is rank zero: the Trainer's rank once a fit set it, else the launcher's (callbacks are
    built before the Trainer)."""
    rank = getattr(rank_zero_only, "rank", None)
    return rank == 0 if rank is not None else os.environ.get("RANK", "0") == "0"


def _said(base: str, name: str, instead: str) -> str:
    """The refusal of ``base``'s Lightning attribute ``name``, whose work ``instead`` does here."""
    if instead.isidentifier():  # another argument of the class does its work (every_n_train_steps: every_n_steps)
        return f"it is Lightning's; set {instead} instead ({base}({instead}=...), or assign it)"
    return f"it is Lightning's, which {base}() does not take either; here: {instead}"
