"""The ``apex`` import shim: ``import apex`` / ``from apex import amp`` resolve to :mod:`ampkit.compat`.

A meta-path finder maps ``apex.<name>[.<sub>]`` onto ``ampkit.compat.<name>[.<sub>]`` (the same module
objects, so ``apex.amp._amp_state is ampkit.compat.amp._amp_state``) and serves a small ``apex`` package
whose submodules load on first touch, plus Apex's top-level extension modules (``amp_C``, ``apex_C``,
``fused_adam_cuda``, ``fused_layer_norm_cuda``, ``focal_loss_cuda``, ``xentropy_cuda``,
``fused_weight_gradient_mlp_cuda`` and the Megatron softmaxes), and Megatron's own
``fused_mix_prec_layer_norm_cuda``. A real apex installation wins unless the shim is forced.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import pathlib
import pkgutil
import sys
import types
import warnings
from typing import Any

from ampkit.compat import _pkg_resources
from ampkit.compat._unserved import EMPTY_PACKAGES, unserved_advice
from ampkit.missing_name import missing_name
from ampkit.wording import shown

APEX_SUBPACKAGES = {
    "amp": "ampkit.compat.amp",
    "fp16_utils": "ampkit.compat.fp16_utils",
    "parallel": "ampkit.compat.parallel",
    "optimizers": "ampkit.compat.optimizers",
    "normalization": "ampkit.compat.normalization",
    "multi_tensor_apply": "ampkit.compat.multi_tensor_apply",
    "mlp": "ampkit.compat.mlp",
    "fused_dense": "ampkit.compat.fused_dense",
    "_autocast_utils": "ampkit.compat.autocast_utils",  # copies of Apex's fused layers import its cast helper
}
# Apex's CUDA extension, a top-level module: served only while the shim is installed, never put on sys.path.
_TOP_LEVEL_MODULES = {
    "amp_C": "ampkit.compat.amp_c",
    "apex_C": "ampkit.compat.apex_c",
    "fused_adam_cuda": "ampkit.compat.fused_adam_cuda",  # the first FusedAdam's kernel, which copies of it load
    "fused_layer_norm_cuda": "ampkit.compat.fused_layer_norm_cuda",  # Megatron-LM loads it by name
    "fused_mix_prec_layer_norm_cuda": "ampkit.compat.fused_mix_prec_layer_norm_cuda",  # Megatron 2021-22's own
    "focal_loss_cuda": "ampkit.compat.focal_loss_cuda",  # NVIDIA's EfficientDet imports it at the top
    "xentropy_cuda": "ampkit.compat.xentropy_cuda",  # fairseq and MosaicML Composer import it by name
    "fused_weight_gradient_mlp_cuda": "ampkit.compat.fused_weight_gradient_mlp_cuda",  # Megatron's default path
    # Megatron's fused softmax (mid-2023 on) asks for these on every fp16/bf16 attention
    "scaled_upper_triang_masked_softmax_cuda": "ampkit.compat.fused_softmax.scaled_upper_triang_masked_softmax_cuda",
    "scaled_masked_softmax_cuda": "ampkit.compat.fused_softmax.scaled_masked_softmax_cuda",
    "generic_scaled_masked_softmax_cuda": "ampkit.compat.fused_softmax.generic_scaled_masked_softmax_cuda",
    "scaled_softmax_cuda": "ampkit.compat.fused_softmax.scaled_softmax_cuda",
}
# Apex modules that legacy code imported by file name rather than through the package.
_MODULE_ALIASES = {
    "apex.normalization.fused_layer_norm": "ampkit.compat.normalization",
    "apex.optimizers.fused_adam": "ampkit.compat.optimizers",
    "apex.optimizers.fused_sgd": "ampkit.compat.optimizers",
    "apex.optimizers.fused_lamb": "ampkit.compat.optimizers",
    "apex.optimizers.fused_novograd": "ampkit.compat.optimizers",
    "apex.optimizers.fused_adagrad": "ampkit.compat.optimizers",
    "apex.optimizers.fused_mixed_precision_lamb": "ampkit.compat.optimizers",
    "apex.optimizers.fp16_optimizer": "ampkit.compat.legacy_fused_adam",
    "apex.parallel.distributed": "ampkit.compat.parallel.distributed",
    "apex.parallel.LARC": "ampkit.compat.parallel.larc",
    "apex.parallel.sync_batchnorm": "ampkit.compat.parallel.sync_batchnorm",
    "apex.parallel.optimized_sync_batchnorm": "ampkit.compat.parallel.sync_batchnorm",
    "apex.fp16_utils.fp16_optimizer": "ampkit.compat.fp16_utils.fp16_optimizer",
    "apex.fp16_utils.fp16util": "ampkit.compat.fp16_utils.fp16util",
    "apex.mlp.mlp": "ampkit.compat.mlp",
    "apex.fused_dense.fused_dense": "ampkit.compat.fused_dense",
    "apex.contrib.clip_grad": "ampkit.compat.clip_grad",  # the apex.contrib packages served
    "apex.contrib.clip_grad.clip_grad": "ampkit.compat.clip_grad",
    "apex.contrib.focal_loss.focal_loss": "ampkit.compat.focal_loss",  # its package is empty, as in Apex
    "apex.contrib.xentropy": "ampkit.compat.xentropy",
    "apex.contrib.xentropy.softmax_xentropy": "ampkit.compat.xentropy",
    "apex.contrib.optimizers": "ampkit.compat.contrib_optimizers",  # Apex's first FP16_Optimizer and FusedAdam
    "apex.contrib.optimizers.fp16_optimizer": "ampkit.compat.contrib_optimizers",
    "apex.contrib.optimizers.fused_adam": "ampkit.compat.contrib_optimizers",
}
_SERVED_CONTRIB = sorted({name.split(".")[2] for name in _MODULE_ALIASES if name.startswith("apex.contrib.")})
_SHIM_MARKER = "__ampkit_apex_shim__"
APEX_VERSION = "0.1+ampkit"  # Apex's own version (0.1), marked as this stand-in
_APEX_METADATA = f"Metadata-Version: 2.1\nName: apex\nVersion: {APEX_VERSION}\nSummary: ampkit's apex shim\n"


def _target_module_name(fullname: str) -> str:
    if fullname in _MODULE_ALIASES:
        return _MODULE_ALIASES[fullname]
    _, _, rest = fullname.partition(".")
    head, _, tail = rest.partition(".")
    if head not in APEX_SUBPACKAGES:
        message = _unserved_message(fullname) or f"{_PROVIDED}; {shown(fullname)} is not one of them"
        raise ModuleNotFoundError(message, name=fullname)
    target = APEX_SUBPACKAGES[head] + (f".{tail}" if tail else "")
    if not _module_exists(target):  # e.g. apex.amp.opt: Apex's internal module layout is not reproduced
        unserved = _unserved_message(fullname)  # a CUDA-only internal that programs imported: what to use instead
        if unserved:
            raise ModuleNotFoundError(unserved, name=fullname)
        package = importlib.import_module(APEX_SUBPACKAGES[head])
        names = getattr(package, "__all__", None) or [n for n in dir(package) if not n.startswith("_")]
        raise ModuleNotFoundError(
            f"ampkit's apex shim has no module {shown(fullname)}; apex.{head} provides {', '.join(names)}",
            name=fullname,
        )
    return target


_PUBLIC_SUBPACKAGES = [name for name in APEX_SUBPACKAGES if not name.startswith("_")]
_PROVIDED = (
    f"ampkit's apex shim provides apex.{{{', '.join(_PUBLIC_SUBPACKAGES)}}} and "
    f"apex.contrib.{{{', '.join(_SERVED_CONTRIB)}}}"
)


def _unserved_message(fullname: str) -> str | None:
    """What to use instead of the Apex package ``fullname`` (or one above it) the shim does not serve, else None."""
    advice = unserved_advice(fullname)
    return f"{advice} ({_PROVIDED})" if advice else None


def served_module_name(fullname: str) -> str:
    """The ampkit module the shim serves as the Apex module ``fullname`` (``python -m ampkit.legacy -m apex.X`` runs
    it); a ``ModuleNotFoundError`` saying what is served when there is none."""
    return _target_module_name(fullname)


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent that is a plain module, not a package
        return False


def _make_apex_package() -> types.ModuleType:
    package = types.ModuleType("apex", "ampkit's stand-in for NVIDIA apex (see ampkit.compat).")
    package.__path__ = []
    package.__version__ = APEX_VERSION
    # Environment reports print where apex lives (VISSL's collect_env: os.path.dirname(apex.__file__)): ampkit.compat
    package.__file__ = str(pathlib.Path(__file__).with_name("__init__.py"))
    setattr(package, _SHIM_MARKER, True)

    def __getattr__(name: str) -> Any:
        if name in APEX_SUBPACKAGES or f"apex.{name}" in EMPTY_PACKAGES:  # apex.contrib: OpenNMT-py reads it so
            return importlib.import_module(f"apex.{name}")
        unserved = _unserved_message(f"apex.{name}")  # apex.transformer: what to use instead
        message = unserved or (
            f"module 'apex' (ampkit shim) has no attribute {shown(name)}; it provides {', '.join(_PUBLIC_SUBPACKAGES)}"
            " and contrib"
        )
        raise missing_name(message, "apex", name, submodule=unserved is not None)

    package.__getattr__ = __getattr__
    return package


def _make_empty_package(name: str) -> types.ModuleType:
    """An Apex package that imports empty, as Apex's own did (``apex.contrib``, ``apex.contrib.focal_loss``); its
    subpackages are refused unless aliased (``apex.contrib.clip_grad``, ``apex.contrib.focal_loss.focal_loss``), an
    aliased one is imported when read as an attribute, ``from apex.contrib import layer_norm`` raises the
    subpackage's ``ModuleNotFoundError``, not a bare ImportError, and ``apex.contrib.layer_norm`` read as an attribute
    raises an AttributeError with the same advice (as Apex's own package, so ``hasattr`` feature checks answer)."""
    package = types.ModuleType(name, f"ampkit's stand-in for {name}: empty, as in Apex.")
    package.__path__ = []

    def __getattr__(attribute: str) -> Any:
        submodule = f"{name}.{attribute}"
        if submodule in _MODULE_ALIASES or submodule in EMPTY_PACKAGES:  # a served subpackage, read as an attribute
            return importlib.import_module(submodule)  # (apex.contrib.optimizers.FP16_Optimizer after `import apex`)
        unserved = _unserved_message(submodule)
        message = unserved or f"module {shown(name)} (ampkit shim) has no attribute {shown(attribute)}; {_PROVIDED}"
        raise missing_name(message, name, attribute, submodule=unserved is not None)

    package.__getattr__ = __getattr__
    return package


class _EmptyPackageLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _make_empty_package(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _ModuleNamedLikeItsFunction(types.ModuleType):
    """An Apex file named like a function it defines (``apex/normalization/fused_layer_norm.py`` and its
    ``fused_layer_norm``), served from the ampkit module standing for its package.

    Python binds an imported submodule on its package, so serving the package's module itself rebound the
    function's name to a module ('module' object is not callable). This module reads its names from the
    package's, returns the function under its own name, and calls like it where the package's name is used.
    """

    def __init__(self, name: str, package: types.ModuleType, function: Any) -> None:
        super().__init__(name, package.__doc__)
        self._package = package
        self._function = function

    def __getattr__(self, name: str) -> Any:
        if name == self.__name__.rpartition(".")[2]:
            return self._function
        return getattr(self._package, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._function(*args, **kwargs)

    def __dir__(self) -> list[str]:
        return dir(self._package)


def _function_named(package: types.ModuleType, name: str) -> Any:
    """The function ``package`` exports as ``name``, or None (a class, a module or nothing has that name)."""
    value = getattr(package, name, None)
    if isinstance(value, _ModuleNamedLikeItsFunction):  # served before, by an earlier install of the shim
        value = value._function
    return value if callable(value) and not isinstance(value, type | types.ModuleType) else None


class _AliasLoader(importlib.abc.Loader):
    """Hands out an existing ampkit module under an ``apex`` name, leaving the module itself untouched."""

    def __init__(self, target: str | None) -> None:
        self.target = target
        self._original_spec: Any = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        self.name = spec.name
        module = _make_apex_package() if self.target is None else importlib.import_module(self.target)
        parent_name, _, leaf = spec.name.rpartition(".")
        function = _function_named(module, leaf) if module is sys.modules.get(parent_name) else None
        if function is not None:
            return _ModuleNamedLikeItsFunction(spec.name, module, function)
        self._original_spec = getattr(module, "__spec__", None)
        if not hasattr(module, "__path__") and any(alias.startswith(spec.name + ".") for alias in _MODULE_ALIASES):
            # A plain ampkit module standing for an Apex package whose file-named submodules legacy code imports
            # (apex.normalization.fused_layer_norm): Python imports a submodule only under a package.
            module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        if self.target is not None and not isinstance(module, _ModuleNamedLikeItsFunction):
            module.__spec__ = self._original_spec
        for alias in _MODULE_ALIASES:  # Apex's package imports its files: apex.optimizers.fused_adam is bound
            package, _, leaf = alias.rpartition(".")
            if package == self.name and not hasattr(module, leaf):  # a class or function of that name stays
                importlib.import_module(alias)  # binds it on the package, as any submodule import does


class _ApexDistribution(importlib.metadata.Distribution):
    """The shim's answer to ``importlib.metadata`` for ``apex``: libraries such as transformers count apex as
    available only when both ``find_spec("apex")`` and ``importlib.metadata.version("apex")`` succeed."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return _APEX_METADATA
        if filename == "top_level.txt":
            return "apex\n"
        return None

    def locate_file(self, path: str | pathlib.PurePath) -> pathlib.Path:
        return pathlib.Path(__file__).parent / path


def _is_apex_distribution_name(name: str | None) -> bool:
    """Whether a distribution lookup by ``name`` (None: all of them) asks for apex (PEP 503 normalized)."""
    return name is None or name.lower().replace("-", "_").replace(".", "_") == "apex"


def _asked_by_find_spec() -> bool:
    """Whether this lookup is ``importlib.util.find_spec`` asking whether a module exists, not an import: its frame
    is two calls above the finder (``importlib._bootstrap._find_spec`` between), where an import has its own."""
    frame = sys._getframe(3)  # this function, the finder, importlib._bootstrap._find_spec, then the caller
    for _ in range(2):  # one more for a finder that hands the lookup on (the child processes' first-touch one)
        if frame is None:
            return False
        if frame.f_code is importlib.util.find_spec.__code__:
            return True
        frame = frame.f_back
    return False


class _ApexShimFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "apex":
            return importlib.machinery.ModuleSpec("apex", _AliasLoader(None), is_package=True)
        if fullname in _TOP_LEVEL_MODULES:
            return importlib.machinery.ModuleSpec(fullname, _AliasLoader(_TOP_LEVEL_MODULES[fullname]))
        if fullname == "pkg_resources":  # its working set lists the shim's apex too, once it has been built
            return _pkg_resources.spec_announcing_apex(self, fullname, path, target, APEX_VERSION, _APEX_METADATA)
        if not fullname.startswith("apex."):
            return None
        if fullname in EMPTY_PACKAGES:
            return importlib.machinery.ModuleSpec(fullname, _EmptyPackageLoader(), is_package=True)
        try:
            target_name = _target_module_name(fullname)
        except ModuleNotFoundError:
            # Libraries probe optional Apex parts with `importlib.util.find_spec(...) is not None`, unguarded: that
            # question gets None, as for any module not installed; an import still gets the error naming what to use.
            if _asked_by_find_spec():
                return None
            raise
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(target_name))

    def find_distributions(
        self, context: importlib.metadata.DistributionFinder.Context | None = None
    ) -> list[importlib.metadata.Distribution]:
        """``importlib.metadata``'s hook: the shim's ``apex`` distribution when apex (or every one) is asked for."""
        name = context.name if context is not None else None
        return [_ApexDistribution()] if _is_apex_distribution_name(name) else []


def _installed_finder() -> _ApexShimFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, _ApexShimFinder)), None)


def _forget_apex_modules() -> None:
    for alias in _MODULE_ALIASES:  # file names bound on the ampkit module standing for their package: unbind
        package, served = sys.modules.get(alias.rpartition(".")[0]), sys.modules.get(alias)
        leaf = alias.rpartition(".")[2]
        if package is not None and served is not None and getattr(package, leaf, None) is served:
            if served.__name__ != f"{package.__name__}.{leaf}" and not isinstance(served, _ModuleNamedLikeItsFunction):
                delattr(package, leaf)  # not a real submodule of it (apex.optimizers.fused_adam)
    for name in [n for n in sys.modules if n == "apex" or n.startswith("apex.") or n in _TOP_LEVEL_MODULES]:
        module = sys.modules.pop(name)
        leaf = name.rpartition(".")[2]
        if isinstance(module, _ModuleNamedLikeItsFunction) and getattr(module._package, leaf, None) is module:
            setattr(module._package, leaf, module._function)  # the ampkit name is the function again


# Libraries that decide at their own import whether apex is installed, and the module-level flag keeping the answer.
_APEX_CHECKED_AT_IMPORT = {
    "transformers.utils.import_utils": "_apex_available",
    "deepspeed.runtime.engine": "APEX_INSTALLED",
}


def _warn_of_libraries_that_already_found_no_apex() -> None:
    late = [
        name for name, flag in _APEX_CHECKED_AT_IMPORT.items() if getattr(sys.modules.get(name), flag, None) is False
    ]
    if late:
        warnings.warn(
            f"{', '.join(late)} was imported before the apex shim was installed and keeps its answer that apex is "
            "missing; install the shim before importing it (python -m ampkit.legacy does)",
            stacklevel=3,
        )


# Subpackages every NVIDIA Apex has had at least one of; a `pip install apex` gets PyPI's unrelated package instead.
_NVIDIA_APEX_PACKAGES = ("amp", "optimizers", "normalization", "parallel", "fp16_utils", "contrib")


def _is_nvidia_apex(locations: list[str]) -> bool:
    """Whether the ``apex`` package found at ``locations`` (its ``__path__``, a folder or inside an egg) is NVIDIA's;
    nothing of it is imported."""
    return any(module.name in _NVIDIA_APEX_PACKAGES for module in pkgutil.iter_modules(locations))


def install_apex_shim(force: bool = False) -> bool:
    """Make ``import apex`` (``apex.amp``, ``.fp16_utils``, ``.parallel``, ``.optimizers``, ``.normalization``,
    ``.multi_tensor_apply``, ``.mlp``, ``.fused_dense``) and Apex's extension modules (``import amp_C``, ``apex_C``,
    ``fused_adam_cuda``, ``fused_layer_norm_cuda``, ``focal_loss_cuda``, ``xentropy_cuda``,
    ``fused_weight_gradient_mlp_cuda``, the Megatron softmaxes, Megatron's ``fused_mix_prec_layer_norm_cuda``)
    resolve to ampkit.

    Args:
        force: install even when a real apex is importable (it is then shadowed for this process). A package named
            ``apex`` that is not NVIDIA's (PyPI's ``apex``) is shadowed without it, and a warning says so.

    Returns:
        True when the shim is active, False when a real apex was found and left in place (a warning says so).
    """
    if _installed_finder() is not None:
        return True
    loaded = sys.modules.get("apex")
    real_origin: str | None = None
    locations: list[str] = []
    if loaded is not None and not getattr(loaded, _SHIM_MARKER, False):
        real_origin = getattr(loaded, "__file__", None) or repr(loaded)
        locations = list(getattr(loaded, "__path__", []))
    elif loaded is None:
        spec = importlib.util.find_spec("apex")
        if _installed_finder() is not None:  # a legacy run's child process: its lazy shim just installed itself
            return True
        if spec is not None:
            locations = list(spec.submodule_search_locations or [])
            real_origin = spec.origin or ", ".join(locations) or "unknown location"
    if real_origin is not None and not force:
        if not _is_nvidia_apex(locations):
            warnings.warn(
                f"The installed 'apex' ({real_origin}) is not NVIDIA Apex: it has none of "
                f"apex.{{{', '.join(_NVIDIA_APEX_PACKAGES)}}} (PyPI's 'apex' is an unrelated Pyramid toolkit); "
                "ampkit's apex shim shadows it in this process.",
                stacklevel=2,
            )
        else:
            warnings.warn(
                f"A real apex is installed ({real_origin}); ampkit's apex shim was NOT installed. "
                "Use install_apex_shim(force=True) or `python -m ampkit.legacy --force-shim` to use ampkit instead.",
                stacklevel=2,
            )
            return False
    _forget_apex_modules()
    sys.meta_path.insert(0, _ApexShimFinder())
    if "pkg_resources" in sys.modules:  # imported before: its working set is built, so the shim's apex is added now
        _pkg_resources.announce(sys.modules["pkg_resources"], APEX_VERSION, _APEX_METADATA)
    _warn_of_libraries_that_already_found_no_apex()
    return True


def uninstall_apex_shim() -> None:
    """Remove the shim and forget every ``apex`` module it served (a later ``import apex`` searches again)."""
    finder = _installed_finder()
    if finder is not None:
        sys.meta_path.remove(finder)
    _pkg_resources.forget(sys.modules.get("pkg_resources"))
    _forget_apex_modules()
