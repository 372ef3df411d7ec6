"""Lightning's ModelCheckpoint and EarlyStopping attributes a port sets after construction (``ckpt.dirpath = ...``,
``es.verbose = True``) that ampkit's classes have no setting for: refused naming what does their work here, as the
constructor refuses the argument, instead of becoming an attribute nothing reads. One the class computes
(``ckpt.best_model_path = ...``, ``es.wait_count = 0``) is refused saying so, not with "property has no setter"."""

from __future__ import annotations

from typing import Any

from ampkit.lightning_settings import LIGHTNING_CALLBACK_ARGUMENTS, LIGHTNING_COMPUTED_ATTRIBUTES
from ampkit.wording import shown


class RefusesLightningAttributes:
    """Refuses the assignment of a Lightning argument the class does not take (see the module docstring). A subclass
    keeps an attribute of its own by such a name by declaring it in its class body (``verbose: bool = False``)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if (why := _refusal(type(self), name)) is not None:
            raise AttributeError(f"{type(self).__name__}.{name} = {shown(value)} is not taken: {why}")
        super().__setattr__(name, value)


def _refusal(cls: type, name: str) -> str | None:
    """Why ``cls`` refuses Lightning's attribute ``name``; None for any other, or one a subclass declares."""
    for klass in cls.__mro__:
        refused = LIGHTNING_CALLBACK_ARGUMENTS.get(klass.__name__)
        if refused is not None:  # the ampkit class the subclass extends
            if name in (computed := LIGHTNING_COMPUTED_ATTRIBUTES[klass.__name__]):
                return f"{klass.__name__} computes it, {computed[name]}"
            return _said(klass.__name__, name, refused[name]) if name in refused else None
        if name in vars(klass) or name in vars(klass).get("__annotations__", {}):
            return None
    return None


def _said(base: str, name: str, instead: str) -> str:
    """The refusal of ``base``'s Lightning attribute ``name``, whose work ``instead`` does here."""
    if instead.isidentifier():  # another argument of the class does its work (every_n_train_steps: every_n_steps)
        return f"it is Lightning's; set {instead} instead ({base}({instead}=...), or assign it)"
    return f"it is Lightning's, which {base}() does not take either; here: {instead}"
