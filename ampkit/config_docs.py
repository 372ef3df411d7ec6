"""The config keys of a schema with their types, defaults and meanings, for ``fit --help`` and the docs.

The meanings are the schema's own comments (``max_steps: int = -1  # ... -1 = no limit``) and each section's
docstring, so the reference cannot drift from the code. ``python -m ampkit.config_docs`` prints the Markdown
reference of :class:`ampkit.Config` (``docs/config_reference.md``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import tokenize
from dataclasses import dataclass
from enum import Enum
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf


@dataclass(frozen=True)
class ConfigKey:
    """One leaf of a schema: its dotted key, annotated type, default (``MISSING``: required) and meaning."""

    key: str
    type: str
    default: Any
    meaning: str


@functools.cache
def _field_comments(cls: type) -> dict[str, str]:
    """``{field: trailing comment}`` read from the class's source (empty if the source is unavailable); cached, as
    finding a class's source parses its whole module."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    comments: dict[str, str] = {}
    lines = source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            code = lines[token.start[0] - 1][: token.start[1]].strip()
            name = code.partition(":")[0].strip()
            if name.isidentifier() and ":" in code:
                comments[name] = token.string.lstrip("#").strip()
    return comments


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return MISSING


def sections(schema: type, prefix: str = "") -> list[tuple[str, str, list[ConfigKey]]]:
    """``(section key, section docstring's first line, its leaf keys)`` for ``schema`` and each nested dataclass."""
    comments = {name: text for cls in reversed(schema.__mro__) for name, text in _field_comments(cls).items()}
    doc = (inspect.getdoc(schema) or "").split("\n\n")[0].replace("\n", " ")
    leaves: list[ConfigKey] = []
    nested: list[tuple[str, str, list[ConfigKey]]] = []
    for field in dataclasses.fields(schema):
        key = f"{prefix}{field.name}"
        default = _default(field)
        if dataclasses.is_dataclass(default):
            nested += sections(type(default), f"{key}.")
        else:
            meaning = comments.get(field.name, "")
            if isinstance(default, Enum) and not meaning:
                meaning = " | ".join(member.name for member in type(default))
            leaves.append(ConfigKey(key, str(field.type), default, meaning))
    return [(prefix.rstrip("."), doc, leaves), *nested]


def _shown(value: Any) -> str:
    if isinstance(value, str) and value == MISSING:  # a loaded config's unset key is an equal string
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Enum):
        return value.name  # as YAML spells it
    return str(list(value) if isinstance(value, tuple) else value)


def help_text(schema: type, values: DictConfig | None = None) -> str:
    """Plain text for ``fit --help``: one line per key with its value in ``values`` (a loaded config; else the
    schema's default) and meaning."""
    keys = [leaf for _, _, leaves in sections(schema) for leaf in leaves]
    shown = {k.key: _shown(k.default if values is None else _value_at(values, k.key)) for k in keys}
    width = max(len(k.key) for k in keys) + 2
    value_width = min(max(len(v) for v in shown.values()), 20) + 2
    rows = [f"  {k.key:<{width}}{shown[k.key].ljust(value_width - 1)} {k.meaning}".rstrip() for k in keys]
    return "\n".join(rows)


def _value_at(values: DictConfig, key: str) -> Any:
    """The value of dotted ``key`` in a loaded config, as plain Python (``MISSING`` where it is unset)."""
    node = OmegaConf.select(values, key, throw_on_missing=False)
    return OmegaConf.to_container(node, resolve=False) if isinstance(node, (DictConfig, ListConfig)) else node


def markdown(schema: type) -> str:
    """The Markdown reference of every key of ``schema``, one table per section."""
    out = [
        "# Configuration reference",
        "",
        f"Every key of `{schema.__module__}.{schema.__qualname__}`, generated from the schema by "
        "`python -m ampkit.config_docs` (a test checks this file is current). Set keys in the YAML file or as "
        "`key=value` overrides after `ampkit fit --config FILE`; `ampkit fit --config FILE --print-config` "
        "prints a run's resolved config, including its Trainer's own sections.",
    ]
    for name, doc, leaves in sections(schema):
        if not leaves:
            continue
        out += ["", f"## {name or 'top level'}", ""]
        if doc and name:
            out += [doc, ""]
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for k in leaves:
            # A meaning's "<run_dir>" would be an HTML tag to MkDocs, hidden on the page: escape its "<".
            cells = (f"`{k.key}`", f"`{k.type}`", f"`{_shown(k.default)}`", k.meaning.replace("<", "&lt;"))
            out.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    from ampkit.config import Config

    print(markdown(Config), end="")
