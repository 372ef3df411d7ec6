"""The environment a run is launched in: torchrun's variables (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) and the switches of ampkit's fused ops. A bad value is one line naming the variable
and what would be valid, where the Trainer is built, not ``int()``'s or torch's rendezvous traceback in ``fit()``, nor
an error at the first fused op mid-epoch."""

from __future__ import annotations

import os

from ampkit.config import ConfigError
from ampkit.ops.environment import environment_problems
from ampkit.wording import shown

# the least valid value of each integer torchrun sets (TORCHELASTIC_RESTART_COUNT: the restarts of its worker group)
_LEAST = {"WORLD_SIZE": 1, "RANK": 0, "LOCAL_RANK": 0, "TORCHELASTIC_RESTART_COUNT": 0}
_RENDEZVOUS = ("RANK", "MASTER_ADDR", "MASTER_PORT")  # what torch's env:// rendezvous reads beside WORLD_SIZE


def _launch_int(name: str) -> tuple[int | None, str | None]:
    """The integer in ``name`` (None when unset) and the problem with it (None when it is usable)."""
    raw = os.environ.get(name)
    if raw is None:
        return None, None
    least = _LEAST[name]
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < least:
        return None, f"environment variable {name}={shown(raw)} is not an integer >= {least}"
    return value, None


_UNSET_HINT = (
    "torchrun sets WORLD_SIZE, RANK and LOCAL_RANK for each process it starts; unset them to train in one process"
)


def launch_int(name: str) -> int:
    """``WORLD_SIZE`` (1 when unset), ``RANK``, ``LOCAL_RANK`` or ``TORCHELASTIC_RESTART_COUNT`` (0 when unset); a
    ConfigError naming a bad value."""
    value, problem = _launch_int(name)
    if problem is not None:
        raise ConfigError(f"{problem} ({_UNSET_HINT})")
    return _LEAST[name] if value is None else value


def check_launch_environment(joining: bool = False) -> None:
    """Raise one ConfigError naming every unusable variable of the launch. ``joining``: this process is about to join
    the process group through torchrun's variables (``WORLD_SIZE`` > 1 with no group yet), which then must all be
    set: a launch without torchrun that set only ``WORLD_SIZE`` would otherwise fail deep in torch."""
    found = {name: _launch_int(name) for name in _LEAST}
    problems = [problem for _, problem in found.values() if problem is not None]
    world = found["WORLD_SIZE"][0]
    for name in ("RANK", "LOCAL_RANK"):  # a local rank counts the processes on this machine, all of them in the world
        value = found[name][0]
        if world is not None and value is not None and value >= world:
            problems.append(f"environment variable {name}={value} is not below WORLD_SIZE={world}")
    rank = found["RANK"][0]
    if world is None and rank:  # processes started by hand, WORLD_SIZE forgotten: each trained alone into one run_dir
        problems.append(f"environment variable RANK={rank} is set but WORLD_SIZE is not: a rank > 0 needs a world")
    if problems:
        problems[-1] += f" ({_UNSET_HINT})"
    missing = [name for name in _RENDEZVOUS if not os.environ.get(name)]
    if joining and world is not None and world > 1 and missing:
        unset = f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set"
        problems.append(
            f"WORLD_SIZE={world} asks for {world} processes, but {unset}: launch with torchrun --nproc-per-node "
            f"{world} (it sets them for each process), or unset WORLD_SIZE to train in one process"
        )
    problems += environment_problems()
    if problems:
        raise ConfigError("; ".join(problems))
