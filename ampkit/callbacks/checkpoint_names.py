"""Lightning's file-naming class attributes of ``ModelCheckpoint`` (``CHECKPOINT_NAME_LAST = "{epoch}-last"``, set on a
subclass or on an instance, as Lightning's docs show): the last name is honoured as Lightning formats it, beside
``last.pt``; the others are refused where they would change nothing here, never ignored."""

from __future__ import annotations

import string
from typing import Any

from ampkit.trainer.checkpoint_io import is_best_k_checkpoint_name, is_periodic_checkpoint_name
from ampkit.wording import shown

# Lightning's defaults (FILE_EXTENSION excepted: ampkit's files end in .pt); a changed one is honoured or refused.
LIGHTNING_NAMING = {
    "CHECKPOINT_NAME_LAST": "last",
    "CHECKPOINT_JOIN_CHAR": "-",
    "CHECKPOINT_EQUALS_CHAR": "=",
    "FILE_EXTENSION": ".pt",
    "STARTING_VERSION": 1,
}

# What does the work of each one ampkit cannot honour; read as "<name> ... : <value>".
_REFUSED = {
    "CHECKPOINT_JOIN_CHAR": (
        "it joins a filename's parts and version suffix in Lightning, and ampkit names its files by step (step-N.pt, "
        "epoch-N.pt, best-N.pt) with no filename template or version counter"
    ),
    "FILE_EXTENSION": "ampkit's checkpoints are .pt files (torch.load reads them; ampkit.load_model(path) the model)",
    "STARTING_VERSION": (
        "it numbers Lightning's -v1, -v2 copies of a name taken already; ampkit never writes over a name: each fresh "
        "run writes its own version_N directory"
    ),
}

_FIELDS = ("epoch", "step")
_OWN_NUMBERED = (is_periodic_checkpoint_name, is_best_k_checkpoint_name)


def check_naming(callback: Any, sharded: bool) -> None:
    """Raise naming the attribute, its value and what is valid where ``callback`` (a ModelCheckpoint) has a Lightning
    naming attribute ampkit cannot honour, or a last name that cannot be a file of its own (``sharded``: under FSDP,
    where ``last`` is a link to the newest checkpoint directory)."""
    for attribute, why in _REFUSED.items():
        value = getattr(callback, attribute)
        if value != LIGHTNING_NAMING[attribute] or type(value) is not type(LIGHTNING_NAMING[attribute]):
            raise ValueError(
                f"{type(callback).__name__}.{attribute} = {shown(value)} is not taken (only "
                f"{LIGHTNING_NAMING[attribute]!r}): {why}"
            )
    last, equals = callback.CHECKPOINT_NAME_LAST, callback.CHECKPOINT_EQUALS_CHAR
    if not isinstance(equals, str) or "/" in equals or "\\" in equals:
        raise ValueError(
            f"{type(callback).__name__}.CHECKPOINT_EQUALS_CHAR = {shown(equals)} is invalid: expected a string without "
            "a path separator, which goes between a field's name and value in CHECKPOINT_NAME_LAST"
        )
    if not isinstance(last, str) or not last:
        raise ValueError(
            f"{type(callback).__name__}.CHECKPOINT_NAME_LAST = {shown(last)} is invalid: expected a non-empty string "
            "such as 'last' or '{epoch}-last'"
        )
    fields = _fields(callback, last)
    if equals != LIGHTNING_NAMING["CHECKPOINT_EQUALS_CHAR"] and not fields:
        raise ValueError(
            f"{type(callback).__name__}.CHECKPOINT_EQUALS_CHAR = {shown(equals)} would change no file's name: here it "
            f"goes only into the fields of CHECKPOINT_NAME_LAST ({shown(last)} has none; '{{epoch}}-last' would), as "
            "ampkit's own files are named by step"
        )
    if last != LIGHTNING_NAMING["CHECKPOINT_NAME_LAST"] and sharded:
        raise ValueError(
            f"{type(callback).__name__}.CHECKPOINT_NAME_LAST = {shown(last)} is not taken under FSDP, where 'last' is "
            "the link to the newest sharded checkpoint: leave it 'last' (--resume last finds it)"
        )
    last_file_name(callback, epoch=0, step=0)  # a name that clashes with ampkit's own (or a bad field) is refused now


def last_file_name(callback: Any, epoch: int, step: int) -> str | None:
    """The file name Lightning gives the last checkpoint by ``callback.CHECKPOINT_NAME_LAST`` at ``epoch`` (0-based,
    Lightning's ``current_epoch``) and ``step`` (``"{epoch}-last"`` -> ``epoch=3-last.pt``), or None for the default
    ``last``, whose file is ``last.pt`` itself."""
    last = callback.CHECKPOINT_NAME_LAST
    if last == LIGHTNING_NAMING["CHECKPOINT_NAME_LAST"]:
        return None
    _fields(callback, last)  # set anew since the fit started, say
    values, equals, parts = {"epoch": epoch, "step": step}, callback.CHECKPOINT_EQUALS_CHAR, []
    for literal, field, spec, _ in string.Formatter().parse(last):
        parts.append(literal)
        if field is not None:
            try:
                parts.append(f"{field}{equals}{format(values[field], spec)}")
            except ValueError:  # Python's message repeats the spec whole, and adds only that the value is an int
                raise _bad_last(callback, f"its format spec {shown(spec)} does not format an integer") from None
    name = "".join(parts) + LIGHTNING_NAMING["FILE_EXTENSION"]
    if "/" in name or "\\" in name or name.startswith("."):
        raise _bad_last(callback, f"it makes {shown(name)}, which is no plain file name in the checkpoints directory")
    if is_own_name(name):
        raise _bad_last(callback, f"it makes {shown(name)}, the name of one of ampkit's own checkpoint files")
    return name


def is_own_name(name: str) -> bool:
    """Whether ``name`` is that of one of ampkit's own checkpoint files (``last.pt``, ``step-N.pt``, ``best-N.pt``...),
    which no ``CHECKPOINT_NAME_LAST`` copy may take (nor, named by an edited checkpoint, have removed)."""
    return name in ("last.pt", "best.pt") or any(named(name, False) for named in _OWN_NUMBERED)


def _fields(callback: Any, last: str) -> list[str]:
    """The fields of the last name ``last``, each one of ``epoch`` and ``step`` (others are refused)."""
    try:
        parsed = list(string.Formatter().parse(last))
    except ValueError as exc:  # an unmatched brace
        raise _bad_last(callback, f"it is no format string ({exc})") from None
    fields = [field for _, field, _, _ in parsed if field is not None]
    for _, field, _, conversion in parsed:
        if field is not None and (field not in _FIELDS or conversion is not None):
            raise _bad_last(
                callback,
                f"its field {{{field}{'!' + conversion if conversion else ''}}} is none of {{epoch}} and {{step}} "
                "(ampkit names a checkpoint by where the run is, not by a metric's value: best_k_models maps each best "
                "file to its value)",
            )
    return fields


def _bad_last(callback: Any, why: str) -> ValueError:
    """The refusal of ``callback``'s ``CHECKPOINT_NAME_LAST``, for ``why``."""
    return ValueError(
        f"{type(callback).__name__}.CHECKPOINT_NAME_LAST = {shown(callback.CHECKPOINT_NAME_LAST)} is invalid: {why}; "
        "expected a name such as 'last', 'latest' or '{epoch}-last' (Lightning's format: epoch=3-last.pt), whose "
        "fields are {epoch} and {step}"
    )
