"""Which keys of a built config someone wrote, and in which source: the YAML file, the command line, a dict in Python.

A built config holds every key of its schema, so it no longer tells a value someone wrote from a default. Each
config :func:`~ampkit.config.build_config` returns remembers its sources (in merge order) here, and a config built from
it takes them over, so ``load_config``'s file and overrides stay apart inside the Trainer. A change made in place
later (``trainer.cfg.precision.dtype = "bfloat16"`` in a notebook) counts as one more source.

The sources ride on the config's root as an OmegaConf flag, so ``copy.copy``, ``copy.deepcopy``, a pickle round trip
and ``OmegaConf.merge`` keep them on either side: ``OmegaConf.merge(cfg, override)`` is ``cfg`` with the override laid
over it (a change), and ``OmegaConf.merge(base, cfg)`` takes ``cfg``'s sources with its values, as a merge takes the
flags of the config laid over (the values of ``base`` it keeps, none where ``cfg`` holds every key, are a change too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

_NOT_SET = object()

# The flag of a built config's root holding its _Remembered sources. A merge copies the flags of the config laid over
# onto the result; metadata of any other kind stays with the left-hand config, which is a user's base as often.
_SOURCES = "_ampkit_sources"


class _Remembered:
    """A built config's sources as plain mappings and its plain values when built, held as a flag. OmegaConf's
    ``_set_flag`` reads a flag's value as a list of values, one per flag: this is its own one item."""

    def __init__(self, sources: tuple[Mapping[str, Any], ...], built: dict[str, Any]) -> None:
        self.sources, self.built = sources, built

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> _Remembered:
        if index not in (0, -1):
            raise IndexError(index)
        return self

    def __rmul__(self, times: int) -> list[_Remembered]:
        return [self] * times


def remember_sources(cfg: DictConfig, sources: tuple[Mapping[str, Any], ...]) -> None:
    """Note that ``cfg`` was built from ``sources`` (plain mappings, in merge order)."""
    cfg._set_flag(_SOURCES, _Remembered(tuple(sources), OmegaConf.to_container(cfg)))


def sources_of(cfg: Any) -> tuple[Mapping[str, Any], ...] | None:
    """The sources a built ``cfg`` (or a copy of one) came from, with its changes made in place since as a last one;
    None where ``cfg`` was not built by ``build_config`` (then what it holds is all anyone wrote)."""
    remembered = cfg._get_node_flag(_SOURCES) if isinstance(cfg, DictConfig) else None
    if not isinstance(remembered, _Remembered):
        return None
    changed = _changes(remembered.built, OmegaConf.to_container(cfg))
    return (*remembered.sources, changed) if changed else remembered.sources


def _changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """The leaves of ``after`` whose value differs from ``before``'s, nested as in ``after``."""
    changed: dict[str, Any] = {}
    for key, value in after.items():
        old = before.get(key, _NOT_SET)
        if isinstance(value, Mapping) and isinstance(old, Mapping):
            inner = _changes(old, value)
            if inner:
                changed[key] = inner
        elif value != old:
            changed[key] = value
    return changed


def written_value(source: Any, key: str) -> Any:
    """The value dotted ``key`` has in a plain ``source`` mapping, or ``NOT_SET`` where it does not set it."""
    node = source
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _NOT_SET
        node = node[part]
    return node


def is_set(value: Any) -> bool:
    """Whether :func:`written_value` found a value."""
    return value is not _NOT_SET


def merged(base: Mapping[str, Any], *sources: Any) -> dict[str, Any]:
    """``base`` with each of ``sources`` laid over it, mapping by mapping (plain values, nothing checked)."""
    out = dict(base)
    for source in sources:
        if not isinstance(source, Mapping):
            continue
        for key, value in source.items():
            old = out.get(key)
            out[key] = merged(old, value) if isinstance(old, Mapping) and isinstance(value, Mapping) else value
    return out
