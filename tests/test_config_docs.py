"""The config reference comes from the schema: its comments and docstrings, its defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import MISSING

from ampkit.config import Config
from ampkit.config_docs import help_text, markdown, sections

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "config_reference.md"


@dataclass
class _Inner:
    """Inner section.

    More detail that the reference leaves out."""

    rate: float = 0.5  # how fast: a | b
    names: list[str] = field(default_factory=lambda: ["x"])


@dataclass
class _Schema:
    required: str = MISSING
    inner: _Inner = field(default_factory=_Inner)
    flag: bool | None = None  # unset: decide later


def test_sections_read_defaults_types_and_comments():
    (top, top_doc, top_keys), (inner, inner_doc, inner_keys) = sections(_Schema)
    assert (top, inner, inner_doc) == ("", "inner", "Inner section.")
    assert [(k.key, k.type, k.meaning) for k in top_keys] == [
        ("required", "str", ""),
        ("flag", "bool | None", "unset: decide later"),
    ]
    assert [(k.key, k.default, k.meaning) for k in inner_keys] == [
        ("inner.rate", 0.5, "how fast: a | b"),
        ("inner.names", ["x"], ""),
    ]
    text = help_text(_Schema)
    assert "  required     (required)" in text and "  inner.names  ['x']" in text and "null" in text
    assert "| `inner.rate` | `float` | `0.5` | how fast: a \\| b |" in markdown(_Schema)


@dataclass
class _Placeholders:
    out: str = "runs"  # files go under <out>/version_N, or <number> of them


def test_placeholders_in_angle_brackets_show_on_the_site():
    """Raw, ``<out>`` is an HTML tag to MkDocs: the page would read "files go under /version_N"."""
    row = markdown(_Placeholders).splitlines()[-1]
    assert row == "| `out` | `str` | `runs` | files go under &lt;out>/version_N, or &lt;number> of them |"


def test_docs_reference_is_current():
    assert REFERENCE.read_text() == markdown(Config), (
        "regenerate: python -m ampkit.config_docs > docs/config_reference.md"
    )
