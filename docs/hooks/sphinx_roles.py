"""A Griffe extension for the docs build: ampkit's docstrings are written with Sphinx roles and RST markers.

``:class:`~ampkit.amp.LossScaler``` (and ``:func:``, ``:meth:``, ``:mod:``, ``:attr:``, ``:exc:``, ``:data:``,
``:obj:``) becomes an optional autorefs link: a link where the target is rendered in the reference, plain
code where it is not, so a docstring can name a private helper without breaking ``mkdocs build --strict``.
A relative target (``:meth:`fit```) is looked up from the documented object, as Sphinx does.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import griffe

_LITERAL_MARKER = re.compile(r"(?<=\w)::$", re.M)  # "Example::" introduces an indented code block in RST
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|exc|data|obj):`(~?)([\w.]+)(?:\(\))?`")


def sphinx_roles_to_autorefs(text: str, resolve: Callable[[str], str] = str) -> str:
    """Rewrite every Sphinx cross-reference role in ``text`` as an optional autorefs link to ``resolve(target)``,
    and RST's ``::`` before a code block as ``:`` (the indented block is a Markdown code block already)."""

    def link(match: re.Match) -> str:
        short, target = match.group(1), match.group(2)
        title = target.rsplit(".", 1)[-1] if short else target
        return f'<autoref identifier="{resolve(target)}" optional><code>{title}</code></autoref>'

    return _LITERAL_MARKER.sub(":", _ROLE.sub(link, text))


def _resolver(obj: griffe.Object) -> Callable[[str], str]:
    def resolve(target: str) -> str:
        first, _, rest = target.partition(".")
        try:
            path = obj.resolve(first)  # a member of obj or of its parents, or a name imported there
        except (griffe.NameResolutionError, ValueError):
            return target
        return f"{path}.{rest}" if rest else path

    return resolve


class SphinxRoles(griffe.Extension):
    """Rewrites the docstrings of a loaded package before mkdocstrings renders them."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        todo: list[griffe.Object] = [pkg]
        while todo:
            obj = todo.pop()
            if obj.docstring is not None:
                obj.docstring.value = sphinx_roles_to_autorefs(obj.docstring.value, _resolver(obj))
            todo += [member for member in obj.members.values() if not member.is_alias]
