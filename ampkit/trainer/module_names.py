"""The config keys that name module classes (``trainer.compile``, ``trainer.activation_checkpointing``,
``distributed.fsdp.shard_modules``): one check of what a list of class names picks out of a model."""

from __future__ import annotations

from torch import nn

from ampkit.config import ConfigError


def has_forward(module: nn.Module) -> bool:
    """Whether calling ``module`` runs anything: a container (``ModuleList``, ``ModuleDict``) has no forward."""
    return type(module).forward is not nn.Module.forward


def modules_named(module: nn.Module, names: list[str], key: str, *, nested: bool = False) -> list[nn.Module]:
    """The submodules (the root included) whose class is named, outermost first.

    Raises:
        ConfigError: naming ``key``: a class the model does not contain (listing the classes it does), a container
            class with no forward (``ModuleList``: training code calls the modules it holds, never the container),
            or, unless ``nested``, a named module inside another named one (its work would be done twice).
    """
    present = {type(m).__name__ for m in module.modules()}
    missing = [name for name in names if name not in present]
    if missing:
        raise ConfigError(
            f"config key '{key}': {missing} not in the model; its module classes: {', '.join(sorted(present))}"
        )
    found = [m for m in module.modules() if type(m).__name__ in names]
    containers = [m for m in found if not has_forward(m)]
    if containers:  # never called: the setting would do nothing (or torch would fail on it, as fully_shard does)
        kinds = sorted({type(m).__name__ for m in containers})
        inner = sorted({type(child).__name__ for m in containers for child in m.children()})
        raise ConfigError(
            f"config key '{key}': {kinds} define no forward (containers: training code calls the modules they hold), "
            f"so nothing would run through them; name the classes inside instead: {', '.join(inner) or 'none'}"
        )
    inside = {id(sub) for m in found for sub in list(m.modules())[1:]}
    nested_names = sorted({type(m).__name__ for m in found if id(m) in inside})
    if nested_names and not nested:
        raise ConfigError(
            f"config key '{key}': {nested_names} sit inside other modules it names ({names}); name only the outer ones"
        )
    return found
