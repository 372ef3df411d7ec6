"""What ``validate()`` and ``test()`` return: one dict of the evaluated set's metrics, which also answers Lightning's
spelling of its result (a list of one dict per loader, ``trainer.validate()[0]["acc"]``) and names what it holds where
a key is missing."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

_TAG_PREFIX = {"validate": "val", "test": "test"}


class MissingResultError(KeyError):
    """A name ``validate()``/``test()`` returned no value under: a KeyError, as a dict's, whose message names the
    names it did return."""

    __str__ = Exception.__str__  # one plain line, not KeyError's quoted repr


class EvaluationResults(dict[str, float]):
    """The metrics of one ``validate()`` or ``test()``, by name (a plain dict in every other way).

    Lightning returns a list of one dict per loader; ampkit evaluates one loader, so ``results[0]`` (and ``[-1]``)
    is this dict itself: a ported ``trainer.validate()[0]["acc"]`` reads the metric. Every key is a string, so no
    metric hides behind an index. A missing name is a KeyError naming the names there are, and the ``val/`` or
    ``test/`` of a TensorBoard tag that the name lacks. Pickled (``torch.save``) it is an ``OrderedDict``, which
    ``torch.load(weights_only=True)`` reads."""

    def __init__(self, stage: str, metrics: Mapping[str, float]) -> None:
        super().__init__(metrics)
        self.stage = stage  # validate | test, as a message names the call
        self.prefix = _TAG_PREFIX[stage]  # the TensorBoard prefix of its metrics' tags

    def __missing__(self, key: Any) -> Any:
        if type(key) is int:
            if key in (0, -1):  # Lightning's one loader
                return self
            raise IndexError(
                f"{self.stage}()[{key}]: {self.stage}() evaluates one loader and returns one dict of its metrics, "
                f"which {self.stage}()[0] gives too (Lightning's list of one dict per loader); index {key} is out of "
                "range"
            )
        names = ", ".join(f"'{name}'" for name in self) or "none (no batch ran)"
        bare = key.removeprefix(f"{self.prefix}/") if isinstance(key, str) else key
        if bare != key and bare in self:
            raise MissingResultError(
                f"{self.stage}()[{key!r}]: its metrics are named as the step returned them, without the "
                f"'{self.prefix}/' of their TensorBoard tags: read {self.stage}()[{bare!r}]"
            )
        raise MissingResultError(f"{self.stage}() returned no {key!r}; it returned {names}")

    def __reduce__(self) -> tuple[Any, ...]:
        return OrderedDict, (), None, None, iter(self.items())
