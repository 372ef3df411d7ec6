"""Run an unmodified Apex training script on ampkit: ``python -m ampkit.legacy [--force-shim] SCRIPT [ARGS...]``.

``import apex``, ``from apex import amp``, ``apex.parallel``, ``apex.fp16_utils``, ``apex.optimizers`` and
``apex.normalization`` resolve to :mod:`ampkit.compat`, in the script and in the Python processes it spawns.
``-m MODULE`` runs a module instead of a file, and a directory with a ``__main__.py`` runs as python runs it; ``--``
ends the runner's own options. If a real apex is installed it is used (and a warning says so)
unless ``--force-shim`` is given. Under ``python -m torch.distributed.launch ... -m ampkit.legacy SCRIPT`` the
launcher's ``--local-rank=N`` reaches the script as Apex-era launchers passed it (see :func:`_local_rank_flag`).
"""

from __future__ import annotations

import importlib.util
import os
import re
import runpy
import sys
from collections.abc import Callable
from types import TracebackType

import ampkit
from ampkit.compat import _child_shim
from ampkit.compat.parallel.distributed import leave_the_group_at_exit
from ampkit.compat.shim import install_apex_shim, served_module_name
from ampkit.wording import shown

_USAGE = "usage: python -m ampkit.legacy [--force-shim] [--] (SCRIPT | -m MODULE) [ARGS...]"
# What torch.distributed.launch (without --use-env) puts before the program's arguments: here, before the script.
_LAUNCHER_LOCAL_RANK = re.compile(r"--local[-_]rank=(\d+)")
# The script's globals, kept until the interpreter exits as ``python script.py`` keeps them. Freed when runpy
# returns, a torch DDP model over gloo died while Python still ran: its process group's destructor joined gloo's
# thread, which waited for the GIL to free a tensor, and about one run in four hung at exit under torchrun.
# A failed program's error is kept too: its frames hold the same globals.
_script_globals: list[object] = []


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
            return f"ampkit.legacy: module not found: {shown(name)}: {unserved}"
    return f"ampkit.legacy: module not found: {shown(name)} (not importable from {shown(sys.path[0] or '.')})"


def _unrunnable_script(path: str) -> str | None:
    """Why ``python path`` would not run, or None: a file, or a directory holding ``__main__.py``, runs."""
    if os.path.isfile(path) or os.path.isfile(os.path.join(path, "__main__.py")):
        return None
    if os.path.isdir(path):
        return f"{shown(path)} is a directory without a __main__.py; name the script in it"
    if path.startswith("-"):  # an option of the script's, given before it (or a typo of --force-shim)
        option = path if len(path) <= 40 else "OPTION"  # as typed, to copy; a pasted 10 kB one by its name
        return (
            f"unknown option {shown(path)}; the runner's own are --force-shim and -m MODULE, and the script's "
            f"arguments go after it: python -m ampkit.legacy SCRIPT {option} ..."
        )
    return f"script not found: {shown(path)}"


def _program_source(args: list[str]) -> str:
    """The text of the script or module ``args`` names ("" where it cannot be read: a compiled or namespace one)."""
    path = args[0]
    if args[0] == "-m":
        try:
            spec = importlib.util.find_spec(args[1])
        except (ImportError, ValueError):
            return ""
        path = spec.origin if spec is not None and spec.origin else ""
    try:
        with open(path, encoding="utf-8", errors="replace") as source:
            return source.read()
    except OSError:
        return ""


def _local_rank_flag(rank: str, source: str) -> str:
    """The launcher's local rank in the spelling the script parses. torch.distributed.launch passed
    ``--local_rank=N`` until torch 2.0 and ``--local-rank=N`` since; an Apex-era script's argparse knows only the
    first and exits on the second, so a script gets the underscore unless its text names only the dash."""
    dash_only = "--local-rank" in source and "--local_rank" not in source
    return f"--local-rank={rank}" if dash_only else f"--local_rank={rank}"


def main(argv: list[str] | None = None) -> None:
    """Install the apex shim, then run the script or module with the remaining arguments as its argv."""
    args = list(sys.argv[1:] if argv is None else argv)
    force = False
    local_rank = None
    while args and (args[0] in ("--force-shim", "-h", "--help", "--") or _LAUNCHER_LOCAL_RANK.fullmatch(args[0])):
        option = args.pop(0)
        if option == "--":  # the end of the runner's options, as python's own: the script comes next
            break
        if launcher_flag := _LAUNCHER_LOCAL_RANK.fullmatch(option):
            local_rank = launcher_flag.group(1)
        elif option == "--force-shim":
            force = True
        else:
            print(_USAGE + "\n\n" + (__doc__ or "").strip())
            return
    if not args or (args[0] == "-m" and len(args) < 2):
        raise SystemExit(_USAGE)
    if args[0] != "-m" and (problem := _unrunnable_script(args[0])):
        raise SystemExit(f"ampkit.legacy: {problem}\n{_USAGE}")
    if args[0] == "-m" and (missing := _missing_module(args[1])):
        raise SystemExit(missing)
    if local_rank is not None:  # the script's own first argument, where the launcher would have put it
        args.insert(2 if args[0] == "-m" else 1, _local_rank_flag(local_rank, _program_source(args)))
    shim_installed = install_apex_shim(force=force)
    leave_the_group_at_exit()  # whichever DDP the program uses: its process group, if it leaves one up
    if shim_installed:
        _share_shim_with_child_processes()
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        sys.argv = [module, *rest]
        if shim_installed and module.startswith("apex."):  # the shim's modules run under their ampkit names
            module = served_module_name(module)
        elif not _module_exists(module):  # an installed apex without it (NVIDIA's of 2025 has no multiproc)
            raise SystemExit(
                f"ampkit.legacy: the installed apex has no module {shown(module)}; --force-shim serves ampkit's"
            )
        _run_as_python_would(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))
        return
    script, rest = args[0], args[1:]
    sys.argv = [script, *rest]
    script_dir = os.path.abspath(script) if os.path.isdir(script) else os.path.dirname(os.path.abspath(script))
    sys.path[0] = script_dir  # as python's own: a directory run by its __main__.py is itself the first entry
    # Its ``__file__`` (and the traceback's frames) absolute, as python's own since 3.9.
    _run_as_python_would(lambda: runpy.run_path(os.path.abspath(script), run_name="__main__"))


def _run_as_python_would(run: Callable[[], dict]) -> None:
    """Run the program; an error it raises is reported from the program's own first frame down, as
    ``python script.py`` reports it, without the runner's and runpy's frames above it, and exits 1."""
    try:
        _script_globals.append(run())
    except Exception as error:
        _script_globals.append(error)
        frames = _program_frames(error.__traceback__)
        sys.excepthook(type(error), error.with_traceback(frames), frames)  # the hook prints the error's own
        raise SystemExit(1) from None


def _program_frames(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without its leading frames of this module and runpy (None if nothing else is left: an error
    raised before the program ran, such as a SyntaxError, which prints its own location)."""
    while tb is not None and _is_runner_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def _is_runner_frame(filename: str) -> bool:
    return filename in (__file__, runpy.__file__) or filename == "<frozen runpy>"


if __name__ == "__main__":
    main()
