"""A Griffe extension for the docs build: ampkit's docstrings cross-reference with Sphinx roles.

``:class:`~ampkit.amp.LossScaler``` (and ``:func:``, ``:meth:``, ``:mod:``, ``:attr:``, ``:exc:``, ``:data:``,
``:obj:``) becomes an optional autorefs link: a link where the target is rendered in the reference, plain
code where it is not, so a docstring can name a private helper without breaking ``mkdocs build --strict``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|exc|data|obj):`(~?)([\w.]+)(?:\(\))?`")


def _link(match: re.Match) -> str:
    short, target = match.group(1), match.group(2)
    title = target.rsplit(".", 1)[-1] if short else target
    return f'<autoref identifier="{target}" optional><code>{title}</code></autoref>'


def sphinx_roles_to_autorefs(text: str) -> str:
    """Rewrite every Sphinx cross-reference role in ``text`` as an optional autorefs link."""
    return _ROLE.sub(_link, text)


class SphinxRoles(griffe.Extension):
    """Rewrites the roles of every loaded object's docstring before mkdocstrings renders it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = sphinx_roles_to_autorefs(obj.docstring.value)
