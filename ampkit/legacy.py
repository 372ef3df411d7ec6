"""Run an unmodified Apex training script on ampkit: ``python -m ampkit.legacy [--force-shim] SCRIPT [ARGS...]``.

``import apex``, ``from apex import amp``, ``apex.parallel``, ``apex.fp16_utils``, ``apex.optimizers`` and
``apex.normalization`` resolve to :mod:`ampkit.compat`, in the script and in the Python processes it spawns.
``-m MODULE`` runs a module instead of a file. If a real apex is installed it is used (and a warning says so)
unless ``--force-shim`` is given.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys

import ampkit
from ampkit.compat import _child_shim
from ampkit.compat.shim import install_apex_shim, served_module_name

_USAGE = "usage: python -m ampkit.legacy [--force-shim] (SCRIPT | -m MODULE) [ARGS...]"


def _share_shim_with_child_processes() -> None:
    """Let Python child processes (spawned workers re-running the script) resolve ``apex`` the same way."""
    entries = [os.path.dirname(_child_shim.__file__), os.path.dirname(os.path.dirname(ampkit.__file__))]
    if os.environ.get("PYTHONPATH"):
        entries.append(os.environ["PYTHONPATH"])
    os.environ["PYTHONPATH"] = os.pathsep.join(entries)
    os.environ["AMPKIT_APEX_SHIM"] = "1"


def _module_exists(name: str) -> bool:
    """Whether ``python -m name`` would find something to run (a missing parent package counts as missing)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _missing_module(name: str) -> str | None:
    """Why ``-m name`` cannot run, or None: an Apex module the shim serves (``apex.parallel.multiproc``) can."""
    if _module_exists(name):
        return None
    if name.startswith("apex."):
        try:
            if _module_exists(served_module_name(name)):
                return None
        except ModuleNotFoundError as unserved:
            return f"ampkit.legacy: module not found: {name!r}: {unserved}"
    return f"ampkit.legacy: module not found: {name!r} (not importable from {sys.path[0] or '.'!r})"


def main(argv: list[str] | None = None) -> None:
    """Install the apex shim, then run the script or module with the remaining arguments as its argv."""
    args = list(sys.argv[1:] if argv is None else argv)
    force = False
    while args and args[0] in ("--force-shim", "-h", "--help"):
        if args[0] != "--force-shim":
            print(_USAGE + "\n\n" + (__doc__ or "").strip())
            return
        force = True
        args.pop(0)
    if not args or (args[0] == "-m" and len(args) < 2):
        raise SystemExit(_USAGE)
    if args[0] != "-m" and not os.path.isfile(args[0]):
        raise SystemExit(f"ampkit.legacy: script not found: {args[0]!r}\n{_USAGE}")
    if args[0] == "-m" and (missing := _missing_module(args[1])):
        raise SystemExit(missing)
    shim_installed = install_apex_shim(force=force)
    if shim_installed:
        _share_shim_with_child_processes()
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        sys.argv = [module, *rest]
        if shim_installed and module.startswith("apex."):  # the shim's modules run under their ampkit names
            module = served_module_name(module)
        elif not _module_exists(module):  # an installed apex without it (NVIDIA's of 2025 has no multiproc)
            raise SystemExit(
                f"ampkit.legacy: the installed apex has no module {module!r}; --force-shim serves ampkit's"
            )
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, rest = args[0], args[1:]
    sys.argv = [script, *rest]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
