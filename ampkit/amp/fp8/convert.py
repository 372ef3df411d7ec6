"""Swap a model's eligible ``nn.Linear`` layers for float8 ones: ampkit's reference or torchao's.

Eligible: exactly ``nn.Linear`` (a subclass may have its own forward), named by ``modules`` (all when empty) and
not by ``skip_modules`` (``fnmatch`` patterns on the dotted name), with both dims divisible by 16 (float8 GEMMs
need it; the others stay in high precision). Both backends keep ``nn.Linear``'s parameters and state_dict keys.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import torch
from torch import nn

from ampkit.amp.fp8.linear import Float8Linear
from ampkit.amp.fp8.recipes import recipe_named
from ampkit.wording import counted, shown

BACKENDS = ("torchao", "reference")
"""precision.fp8.backend values: torchao's Float8Linear, or ampkit's own pure-torch casts."""
DIM_MULTIPLE = 16
INSTALL_HINT = 'pip install "ampkit[fp8]"'
"""How to install the torchao backend, named in the error when it is missing."""


def torchao_available() -> bool:
    """Whether torchao's float8 training can be imported (without importing it)."""
    return importlib.util.find_spec("torchao") is not None


def torchao_import_error() -> str | None:
    """Why an installed torchao's float8 training fails to import (one built for another torch fails on its compiled
    parts), or None when it imports. It imports torchao: ask only when a run uses it."""
    try:
        import torchao.float8  # noqa: F401
    except Exception as exc:  # ImportError, or the OSError/RuntimeError of an extension built for another torch
        reason = (str(exc).strip().splitlines() or [""])[0]
        return f"{type(exc).__name__}: {reason}"
    return None


def fp8_gemm_capable(device: torch.device) -> bool:
    """Whether ``device`` runs float8 GEMMs natively (CUDA compute capability 8.9 or later)."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)


@dataclass
class Float8Conversion:
    """What :func:`convert_to_float8` did: the converted layers' names, and each skipped Linear with the reason."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    emulated: bool = False  # the float8 GEMMs run as float32 ones (no float8 hardware, or the reference backend)

    def summary(self) -> str:
        """One line for the start banner: how many layers are in float8, which stayed high precision and why, and
        whether the GEMMs are emulated (then the run is slower than without fp8: a newcomer trying the fp8 config
        on a CPU should know it shows the mechanics, not the speed).

        Names are quoted: a ``Sequential``'s layers are called ``0``, ``3``, which read as counts when bare."""
        kept = "; ".join(f"'{name}' ({why})" for name, why in self.skipped.items())
        n = len(self.converted)
        line = f"{counted(n, 'Linear layer')} in float8"
        if kept:
            line += f"; kept in high precision: {kept}"
        if self.emulated and n:
            line += "; GEMMs emulated in float32, slower than without fp8 (float8 GEMMs need CUDA capability 8.9+)"
        return line


def _skip_reason(name: str, module: nn.Linear, modules: list[str], skip_modules: list[str]) -> str | None:
    if modules and not any(fnmatchcase(name, p) for p in modules):
        return "not named by modules"
    if any(fnmatchcase(name, p) for p in skip_modules):
        return "named by skip_modules"
    if module.in_features % DIM_MULTIPLE or module.out_features % DIM_MULTIPLE:
        return f"{module.in_features}x{module.out_features} not divisible by {DIM_MULTIPLE}"
    return None


def convert_to_float8(
    model: nn.Module,
    recipe: str = "tensorwise",
    *,
    backend: str = "reference",
    emulate: bool = True,
    modules: list[str] | tuple[str, ...] = (),
    skip_modules: list[str] | tuple[str, ...] = (),
    fsdp_float8_all_gather: bool = False,
) -> Float8Conversion:
    """Replace ``model``'s eligible Linears in place by float8 Linears of ``backend`` running ``recipe``.

    ``emulate`` (torchao only; the reference always emulates) multiplies in float32 instead of float8 GEMMs;
    ``fsdp_float8_all_gather`` (torchao, tensorwise) makes FSDP2 all-gather the weights in float8.

    Raises:
        ValueError: an unknown backend or recipe, a pattern in ``modules`` or ``skip_modules`` naming no Linear, the
            model itself a Linear.
        ImportError: backend torchao without torchao installed.
    """
    spec = recipe_named(recipe)
    if backend not in BACKENDS:
        raise ValueError(f"unknown fp8 backend {shown(backend)}; expected one of {', '.join(BACKENDS)}")
    if isinstance(model, nn.Linear):
        raise ValueError("the model itself is a Linear: it cannot be swapped in place; wrap it in a container")
    linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    unmatched = [p for p in modules if not any(fnmatchcase(name, p) for name in linears)]
    if unmatched:
        raise ValueError(f"modules {unmatched} name no nn.Linear; the model's: {', '.join(linears)}")
    any_linear = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    unmatched = [p for p in skip_modules if not any(fnmatchcase(name, p) for name in any_linear)]
    if unmatched:  # a misspelt name would otherwise leave that layer in float8 without a word
        raise ValueError(f"skip_modules {unmatched} name no nn.Linear; the model's: {', '.join(any_linear)}")
    report = Float8Conversion()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and type(module) is not nn.Linear and not is_float8_linear(module):
            report.skipped[name] = "a subclass of nn.Linear (its forward may differ)"
    chosen: dict[str, nn.Linear] = {}
    for name, module in linears.items():
        reason = _skip_reason(name, module, list(modules), list(skip_modules))
        if reason is None:
            chosen[name] = module
        else:
            report.skipped[name] = reason
    if backend == "torchao":
        _convert_with_torchao(model, set(map(id, chosen.values())), recipe, emulate, fsdp_float8_all_gather)
    else:
        for name, module in chosen.items():
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, Float8Linear.from_linear(module, spec))
    report.converted = list(chosen)
    report.emulated = emulate or backend == "reference"
    return report


def _convert_with_torchao(
    model: nn.Module, chosen: set[int], recipe: str, emulate: bool, fsdp_float8_all_gather: bool
) -> None:
    """torchao's own conversion (it also applies its compiler workarounds) of the Linears in ``chosen`` (ids)."""
    if not torchao_available():
        raise ImportError(f"fp8 backend 'torchao' needs torchao: {INSTALL_HINT} (or use backend 'reference')")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(recipe),
        emulate=emulate,
        enable_fsdp_float8_all_gather=fsdp_float8_all_gather,
    )
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, _: id(module) in chosen)
    if fsdp_float8_all_gather:
        for module in model.modules():
            if is_float8_linear(module):
                module.register_state_dict_post_hook(_save_the_plain_weight)


def _save_the_plain_weight(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """state_dict hook: torchao's float8 all-gather weight (a tensor subclass; under FSDP2 the local tensor of a
    DTensor) goes into checkpoints as the plain tensor it wraps. Pickled, the subclass names a torchao class that
    ``torch.load(weights_only=True)`` refuses where torchao is not imported, so the checkpoint would not load into
    the plain model there."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    key = prefix + "weight"
    value = state_dict.get(key)
    if isinstance(value, DTensor) and isinstance(value._local_tensor, WeightWithDynamicFloat8CastTensor):
        plain = value._local_tensor._tensor.detach()
        state_dict[key] = DTensor.from_local(
            plain, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )
    elif isinstance(value, WeightWithDynamicFloat8CastTensor):
        state_dict[key] = value._tensor.detach()


def is_float8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a float8 Linear of either backend."""
    if isinstance(module, Float8Linear):
        return True
    cls = type(module)
    return cls.__name__ == "Float8Linear" and cls.__module__.startswith("torchao.")
