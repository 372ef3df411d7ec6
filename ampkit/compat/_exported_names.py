"""Keep a package's exported objects when a submodule of the same name is imported under an ``apex`` name.

Apex exported objects named like their modules: ``amp._amp_state`` (the state object, in module
``_amp_state``) and ``parallel.LARC`` (the class, in module ``LARC``). When legacy code imports such a module
through the shim (``from apex.parallel.LARC import LARC``), Python sets the freshly imported module as an
attribute of the package, replacing the exported object; a package marked here refuses that replacement.
"""

import sys
import types


class _KeepsExportedNames(types.ModuleType):
    def __setattr__(self, name: str, value: object) -> None:
        current = self.__dict__.get(name)
        if isinstance(value, types.ModuleType) and current is not None and not isinstance(current, types.ModuleType):
            return
        super().__setattr__(name, value)


def keep_exported_names(package_name: str) -> None:
    """Protect the non-module attributes of the (already imported) package ``package_name``."""
    sys.modules[package_name].__class__ = _KeepsExportedNames
