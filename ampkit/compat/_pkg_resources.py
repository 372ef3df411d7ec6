"""The apex shim's answer to ``pkg_resources`` (setuptools before 82): ``get_distribution("apex")``,
``require("apex")`` and ``working_set.find`` see the same ``apex`` distribution that ``importlib.metadata`` does.

``pkg_resources`` reads no meta-path finder: it builds its working set from ``sys.path`` when first imported. So the
shim adds its distribution to that working set, at once when ``pkg_resources`` is already imported and otherwise
just after its import, and takes it out again when the shim is uninstalled. The distribution has no location, so
that ``pkg_resources`` activating it never puts a folder on ``sys.path``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from pathlib import Path
from typing import Any

# The working set's entry the shim's distribution is listed under (``iter(working_set)`` walks entries): ampkit.compat,
# where importlib.metadata's answer locates its files too. Never added to sys.path.
_ENTRY = str(Path(__file__).parent)
_MARKER = "_ampkit_apex_shim"


class _Metadata:
    """``pkg_resources``' metadata provider for the shim's distribution: its PKG-INFO, and nothing else."""

    def __init__(self, text: str) -> None:
        self._text = text

    def has_metadata(self, name: str) -> bool:
        return name == "PKG-INFO"

    def get_metadata(self, name: str) -> str:
        if name != "PKG-INFO":
            raise FileNotFoundError(name)
        return self._text

    def get_metadata_lines(self, name: str) -> list[str]:
        return [line for line in self.get_metadata(name).splitlines() if line.strip()]

    def metadata_isdir(self, name: str) -> bool:
        return False

    def metadata_listdir(self, name: str) -> list[str]:
        return []

    def run_script(self, script_name: str, namespace: dict[str, Any]) -> None:
        raise FileNotFoundError(script_name)


def announce(pkg_resources: types.ModuleType, version: str, metadata: str) -> None:
    """Add the shim's ``apex`` to ``pkg_resources.working_set``, in place of any other it lists (as the shim shadows
    a real apex), keeping that one to put back."""
    working_set = getattr(pkg_resources, "working_set", None)
    if working_set is None or getattr(working_set.by_key.get("apex"), _MARKER, False):
        return
    dist = pkg_resources.Distribution(location=None, metadata=_Metadata(metadata), project_name="apex", version=version)
    setattr(dist, _MARKER, True)
    dist._shadowed = working_set.by_key.get("apex")  # put back by forget()
    working_set.add(dist, entry=_ENTRY, insert=False, replace=True)
    if _ENTRY not in working_set.entries:
        working_set.entries.append(_ENTRY)


def forget(pkg_resources: types.ModuleType | None) -> None:
    """Take the shim's ``apex`` out of ``pkg_resources.working_set`` again, putting back what it shadowed."""
    working_set = getattr(pkg_resources, "working_set", None)
    if working_set is None:
        return
    dist = working_set.by_key.get("apex")
    if not getattr(dist, _MARKER, False):
        return
    for entry in (_ENTRY, None):
        keys = working_set.entry_keys.get(entry, [])
        if "apex" in keys:
            keys.remove("apex")
    if _ENTRY in working_set.entries and not working_set.entry_keys.get(_ENTRY):
        working_set.entries.remove(_ENTRY)
        working_set.entry_keys.pop(_ENTRY, None)
    if dist._shadowed is not None:
        working_set.by_key["apex"] = dist._shadowed
    else:
        del working_set.by_key["apex"]
        getattr(working_set, "normalized_to_canonical_keys", {}).pop("apex", None)


class _AnnouncingLoader(importlib.abc.Loader):
    """``pkg_resources``' own loader, then :func:`announce` once the module has built its working set."""

    def __init__(self, loader: importlib.abc.Loader, version: str, metadata: str) -> None:
        self._loader, self._version, self._metadata = loader, version, metadata

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self._loader  # the module keeps its own loader
        self._loader.exec_module(module)
        announce(module, self._version, self._metadata)


def spec_announcing_apex(
    finder: object, fullname: str, path: Any, target: Any, version: str, metadata: str
) -> importlib.machinery.ModuleSpec | None:
    """``pkg_resources``' spec as the finders after ``finder`` on ``sys.meta_path`` find it, loading through
    :class:`_AnnouncingLoader`; None where they find none (setuptools 82 and later have no ``pkg_resources``)."""
    later = sys.meta_path[sys.meta_path.index(finder) + 1 :] if finder in sys.meta_path else sys.meta_path
    for other in later:
        find_spec = getattr(other, "find_spec", None)
        spec = find_spec(fullname, path, target) if find_spec is not None else None
        if spec is not None:
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _AnnouncingLoader(spec.loader, version, metadata)
            return spec
    return None
