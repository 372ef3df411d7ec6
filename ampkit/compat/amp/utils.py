"""``apex.amp.utils``: the tensor tests and cast helpers Apex's O1 patching was built from, which scripts import
(``from apex.amp.utils import is_fp_tensor``) and custom cast wrappers call.

One difference from Apex, the rule of all of ampkit: a cast keys on the tensor's dtype, not on a CUDA type
string, so ``maybe_half`` casts a CPU tensor too (Apex returned it unchanged) and amp's O1 really runs a CPU
model in half. Apex's cuDNN flat-weight RNN helpers are not served (see ``__getattr__``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import Any

import torch

from ampkit.missing_name import missing_name

__all__ = [
    "as_inplace",
    "cached_cast",
    "casted_args",
    "collect_fp_tensor_types",
    "get_cuda_version",
    "get_func",
    "has_func",
    "is_cuda_enabled",
    "is_fp_tensor",
    "is_nested",
    "maybe_float",
    "maybe_half",
    "set_func",
    "set_func_save",
    "should_cache",
    "type_string",
    "verbosify",
]


def is_cuda_enabled() -> bool:
    """Whether this torch was built with CUDA (whether a GPU is present is ``torch.cuda.is_available()``)."""
    return torch.version.cuda is not None


def get_cuda_version() -> tuple[int, ...]:
    """The CUDA version this torch was built with, as integers: ``(12, 4)``."""
    if torch.version.cuda is None:
        raise RuntimeError(
            f"this torch ({torch.__version__}) was built without CUDA, so it has no CUDA version; "
            "check apex.amp.utils.is_cuda_enabled() first"
        )
    return tuple(int(part) for part in torch.version.cuda.split("."))


def is_nested(x: Any) -> bool:
    """Whether ``x`` is a list or tuple (Apex's only containers)."""
    return isinstance(x, (tuple, list))


def is_fp_tensor(x: Any) -> bool:
    """A floating-point tensor, or a list/tuple made only of them (an empty one included, as in Apex)."""
    if is_nested(x):
        return all(is_fp_tensor(y) for y in x)
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def type_string(x: torch.Tensor) -> str:
    """The tensor's legacy type name without its module: ``'FloatTensor'``, ``'HalfTensor'`` (CPU or CUDA alike)."""
    return x.type().split(".")[-1]


def should_cache(x: Any) -> bool:
    """Whether O1 caches the cast of ``x``: a float32 Parameter, or a list/tuple made only of them."""
    if is_nested(x):
        return all(should_cache(y) for y in x)
    return isinstance(x, torch.nn.Parameter) and x.dtype == torch.float32


def collect_fp_tensor_types(args: Iterable[Any], kwargs: dict[str, Any]) -> set[str]:
    """The :func:`type_string` of every floating-point tensor among the arguments (inside lists too)."""
    types: set[str] = set()

    def collect(x: Any) -> None:
        if is_nested(x):
            for y in x:
                collect(y)
        else:
            types.add(type_string(x))

    for x in itertools.chain(args, kwargs.values()):
        if is_fp_tensor(x):
            collect(x)
    return types


def _maybe_cast(dtype: torch.dtype, x: Any, name: str, verbose: bool) -> Any:
    if is_nested(x):
        return type(x)(_maybe_cast(dtype, y, name, verbose) for y in x)
    if x.dtype == dtype:
        return x
    if verbose:
        print(f"{'Float->Half' if dtype == torch.float16 else 'Half->Float'} ({name})")
    return x.to(dtype)


def maybe_half(x: Any, name: str = "", verbose: bool = False) -> Any:
    """``x`` in float16 (each item of a list/tuple), unchanged when it already is; prints the cast when
    ``verbose``."""
    return _maybe_cast(torch.float16, x, name, verbose)


def maybe_float(x: Any, name: str = "", verbose: bool = False) -> Any:
    """``x`` in float32 (each item of a list/tuple), unchanged when it already is; prints the cast when
    ``verbose``."""
    return _maybe_cast(torch.float32, x, name, verbose)


def casted_args(cast_fn: Callable[[Any], Any], args: Iterable[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The positional arguments with ``cast_fn`` applied to the floating-point ones; ``kwargs`` is cast in place
    (Apex's contract: callers pass the same dict on)."""
    new_args = [cast_fn(x) if is_fp_tensor(x) else x for x in args]
    for key, value in kwargs.items():
        if is_fp_tensor(value):
            kwargs[key] = cast_fn(value)
    return new_args


def cached_cast(cast_fn: Callable[[Any], Any], x: Any, cache: MutableMapping[Any, Any]) -> Any:
    """``cast_fn(x)``, reused from ``cache`` while ``x`` is unchanged: a weight is cast once per iteration (the
    handle clears the cache). A cast made under ``no_grad`` is not reused where gradients are needed: it has no
    autograd edge back to ``x``."""
    if is_nested(x):
        return type(x)(cached_cast(cast_fn, y, cache) for y in x)
    entry = cache.get(x)
    if entry is not None:
        stale = getattr(entry, "_ampkit_source_version", x._version) != x._version  # written in place since
        if torch.is_grad_enabled() and x.requires_grad != entry.requires_grad:
            stale = True
        if not stale:
            return entry
        del cache[x]
    cast = cast_fn(x)
    if isinstance(cast, torch.Tensor) and cast is not x:
        cast._ampkit_source_version = x._version
    cache[x] = cast
    return cast


def verbosify(cast_fn: Callable[..., Any], fn_name: str, verbose: bool) -> Callable[..., Any]:
    """``cast_fn`` told which function it casts for, when ``verbose`` (so its casts print that name)."""
    return functools.partial(cast_fn, name=fn_name, verbose=verbose) if verbose else cast_fn


def as_inplace(fns: Iterable[str]) -> Iterator[str]:
    """The in-place names of ``fns``: ``add`` -> ``add_``."""
    for name in fns:
        yield name + "_"


def has_func(mod: Any, fn: str) -> bool:
    """Whether the module (or dict of functions) ``mod`` has ``fn``."""
    return fn in mod if isinstance(mod, dict) else hasattr(mod, fn)


def get_func(mod: Any, fn: str) -> Any:
    """``mod``'s ``fn``, from a module's attributes or a dict's keys."""
    return mod[fn] if isinstance(mod, dict) else getattr(mod, fn)


def set_func(mod: Any, fn: str, new_fn: Any) -> None:
    """Replace ``mod``'s ``fn`` by ``new_fn``."""
    if isinstance(mod, dict):
        mod[fn] = new_fn
    else:
        setattr(mod, fn, new_fn)


def set_func_save(handle: Any, mod: Any, fn: str, new_fn: Any) -> None:
    """Replace ``mod``'s ``fn`` by ``new_fn`` and hand the original to ``handle`` (an ``AmpHandle``), whose
    ``_deactivate`` puts it back."""
    handle._save_func(mod, fn, get_func(mod, fn))
    set_func(mod, fn, new_fn)


_NOT_SERVED = {
    name: (
        f"apex.amp.utils.{name} is not served by ampkit's apex shim: it rebuilt half copies of a cuDNN RNN's flat "
        "weight buffer through raw storage offsets, for Apex's own RNN casting; ampkit's O1 casts the weights of "
        "torch's RNN calls itself, so call the RNN module (torch.nn.LSTM, GRU, RNN) directly"
    )
    for name in ("synthesize_flattened_rnn_weights", "new_synthesize_flattened_rnn_weights")
}


def __getattr__(name: str) -> Any:
    message = _NOT_SERVED.get(name) or (
        f"apex.amp.utils (ampkit.compat.amp.utils) has no attribute {name!r}; it provides {', '.join(__all__)}"
    )
    raise missing_name(message, "apex.amp.utils", name)
