"""Apex's O1: torch functions patched process-wide to cast their arguments, as ``amp.init()`` did.

While the handle that installed them is active, whitelist functions (``linear``, ``conv*``, ``mm``,
``matmul``, ``@``, RNNs ...) run in the low-precision dtype, blacklist functions (``softmax``, losses,
``exp``, ``pow``, ``sum``, ``.cpu()`` ...) in float32, multi-argument functions (``add``, ``mul``,
``atan2``, ``cat`` ...) in the widest type among their arguments, in-place methods in ``self``'s type,
and a low-precision ``binary_cross_entropy`` is an error unless banned functions are allowed. Casts of
float32 ``Parameter`` s to the low dtype are cached per iteration (the handle's ``cache``).

Where ampkit differs from Apex: casts apply to tensors on every device (Apex cast CUDA tensors only,
so CPU runs silently stayed float32), float64 tensors are never cast (they are not amp's business), and
promotion between types amp did not make (e.g. float32 with float64) is left to torch instead of
raising.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from ampkit.amp.patch_scope import torch_patches_cast
from ampkit.compat.amp.lists import functional_overrides, linalg_overrides, tensor_overrides, torch_overrides

LOW_PRECISION = (torch.float16, torch.bfloat16)
_CASTABLE = (torch.float16, torch.bfloat16, torch.float32)
# The backend functions torch.nn's RNN modules and cells call through ``torch.nn.modules.rnn._VF``.
RNN_BACKEND_FUNCTIONS = ["rnn_tanh", "rnn_relu", "lstm", "gru",
                         "rnn_tanh_cell", "rnn_relu_cell", "lstm_cell", "gru_cell"]  # fmt: skip
# Tensor methods of FP32_FUNCS cast only when the tensor is not on the CPU already.
_CAST_BEFORE_TRANSFER = ("cpu",)


class CastState(Protocol):
    """What the wrappers ask of the handle that installed them."""

    def is_active(self) -> bool: ...

    @property
    def has_cache(self) -> bool: ...

    @property
    def cache(self) -> dict[torch.Tensor, torch.Tensor]: ...


def casts_here(state: CastState) -> bool:
    """Whether the patches cast now: their handle is active, and this thread runs no Trainer, whose config sets its
    own precision (:mod:`ampkit.amp.patch_scope`)."""
    return state.is_active() and torch_patches_cast()


def _castable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in _CASTABLE


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def _cast_value(x: Any, dtype: torch.dtype) -> Any:
    """Cast a tensor, or a list/tuple made only of castable tensors (Apex's rule); anything else as is."""
    if _castable(x):
        return _cast(x, dtype)
    if isinstance(x, (list, tuple)) and x and all(_castable(y) for y in x):
        return type(x)(_cast(y, dtype) for y in x)
    return x


def _cast_deep(x: Any, dtype: torch.dtype) -> Any:
    """Cast every castable tensor inside nested lists/tuples (RNN weight lists)."""
    if _castable(x):
        return _cast(x, dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast_deep(y, dtype) for y in x)
    return x


def _cached_cast(x: Any, dtype: torch.dtype, state: CastState) -> Any:
    """Cast a float32 Parameter through the handle's cache: once per iteration, re-cast when it changed."""
    if not (isinstance(x, torch.nn.Parameter) and x.dtype == torch.float32):
        return _cast_value(x, dtype)
    cache = state.cache
    cached = cache.get(x)
    if cached is not None:
        stale = cached.dtype != dtype or cached._ampkit_source_version != x._version
        if torch.is_grad_enabled() and x.requires_grad != cached.requires_grad:
            stale = True  # cast under no_grad (eval): it has no autograd edge back to the weight
        if not stale:
            return cached
    cast = x.to(dtype)
    cast._ampkit_source_version = x._version
    cache[x] = cast
    return cast


def _floating_dtypes(values: Iterable[Any]) -> set[torch.dtype]:
    found: set[torch.dtype] = set()
    for x in values:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            found.add(x.dtype)
        elif isinstance(x, (list, tuple)):
            found |= _floating_dtypes(x)
    return found


def _is_amp_mix(dtypes: set[torch.dtype]) -> bool:
    """One low-precision dtype beside float32: the mix O1's casts create, promoted to float32."""
    return len(dtypes) == 2 and torch.float32 in dtypes and bool(dtypes & set(LOW_PRECISION))


class CastPatches:
    """The attributes one handle replaced, so that ``restore`` puts every original back."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any, bool]] = []

    def replace(self, owner: Any, name: str, make_wrapper: Callable[[Callable], Callable]) -> None:
        """Wrap ``owner.name`` (skipped when this torch build has no such attribute)."""
        if not hasattr(owner, name):
            return
        original = getattr(owner, name)
        self._saved.append((owner, name, original, name in vars(owner)))
        setattr(owner, name, make_wrapper(original))

    def set(self, owner: Any, name: str, value: Any) -> None:
        """Replace ``owner.name`` by ``value`` outright."""
        self._saved.append((owner, name, getattr(owner, name), name in vars(owner)))
        setattr(owner, name, value)

    def remember(self, owner: Any, name: str, original: Any) -> None:
        """Record that ``owner.name`` was ``original`` (someone else replaced it) so that ``restore`` puts it back."""
        self._saved.append((owner, name, original, True))

    def originals(self) -> list[tuple[Any, str, Any]]:
        """``(owner, name, original)`` for every replacement, oldest first."""
        return [(owner, name, original) for owner, name, original, _ in self._saved]

    def restore(self) -> None:
        """Undo every replacement, newest first (a wrapper of a wrapper unwinds in order)."""
        while self._saved:
            owner, name, original, was_own = self._saved.pop()
            if was_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # it was inherited (e.g. from torch._C.TensorBase)


# ---------------------------------------------------------------------------------------------- wrappers
def cast_arguments(
    state: CastState, dtype: torch.dtype, try_caching: bool, args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    """Cast floating arguments to ``dtype`` (through the cache for low-precision casts of weights)."""
    if try_caching and state.has_cache:
        return tuple(_cached_cast(a, dtype, state) for a in args), {
            k: _cached_cast(v, dtype, state) for k, v in kwargs.items()
        }
    return tuple(_cast_value(a, dtype) for a in args), {k: _cast_value(v, dtype) for k, v in kwargs.items()}


def cast_wrapper(state: CastState, dtype: torch.dtype, try_caching: bool) -> Callable[[Callable], Callable]:
    """Wrap a function so that, while ``state`` is active, its floating arguments are cast to ``dtype``."""

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not casts_here(state):
                return original(*args, **kwargs)
            args, kwargs = cast_arguments(state, dtype, try_caching, args, kwargs)
            return original(*args, **kwargs)

        return wrapper

    return make


def fp32_before_transfer_wrapper(state: CastState) -> Callable[[Callable], Callable]:
    """``Tensor.cpu``: a low-precision tensor leaving another device arrives in float32 (Apex's rule); one
    already on the CPU comes back as it is, the same object, as Apex left tensors off the GPU alone (so a
    half model's ``.cpu()`` keeps it half)."""

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if casts_here(state) and self.device.type != "cpu":
                self = _cast_value(self, torch.float32)
            return original(self, *args, **kwargs)

        return wrapper

    return make


def promote_wrapper(state: CastState) -> Callable[[Callable], Callable]:
    """Cast to float32 when the arguments mix a low-precision dtype with float32."""

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if casts_here(state) and _is_amp_mix(_floating_dtypes((*args, *kwargs.values()))):
                args = tuple(_cast_value(a, torch.float32) for a in args)
                kwargs = {k: _cast_value(v, torch.float32) for k, v in kwargs.items()}
            return original(*args, **kwargs)

        return wrapper

    return make


def sequence_promote_wrapper(state: CastState) -> Callable[[Callable], Callable]:
    """``cat``/``stack``: cast the sequence to float32 when it mixes a low-precision dtype with float32. The sequence
    comes first or as ``tensors=`` (torch's name for it), which a wrapper taking it positionally refused."""

    def promoted(seq: Any) -> Any:
        if isinstance(seq, (list, tuple)) and _is_amp_mix(_floating_dtypes(seq)):
            return [_cast(x, torch.float32) if _castable(x) else x for x in seq]
        return seq

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if casts_here(state) and args:
                args = (promoted(args[0]), *args[1:])
            elif casts_here(state) and "tensors" in kwargs:
                kwargs = {**kwargs, "tensors": promoted(kwargs["tensors"])}
            return original(*args, **kwargs)

        return wrapper

    return make


def match_self_wrapper(state: CastState) -> Callable[[Callable], Callable]:
    """In-place methods: cast the other arguments to ``self``'s type, so ``self`` keeps its dtype."""

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if casts_here(state) and _castable(self):
                args = tuple(_cast_value(a, self.dtype) for a in args)
                kwargs = {k: _cast_value(v, self.dtype) for k, v in kwargs.items()}
            return original(self, *args, **kwargs)

        return wrapper

    return make


def error_if_self_low_wrapper(state: CastState, name: str) -> Callable[[Callable], Callable]:
    """In-place blacklist methods (``exp_``): an error on a low-precision ``self``, float32 otherwise."""

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not casts_here(state):
                return original(self, *args, **kwargs)
            if isinstance(self, torch.Tensor) and self.dtype in LOW_PRECISION:
                raise NotImplementedError(
                    f"Cannot call in-place method {name} on {self.dtype} tensors under amp O1: it must run in "
                    "float32. Call the out-of-place form, or cast the tensor to float first."
                )
            args = tuple(_cast_value(a, torch.float32) for a in args)
            kwargs = {k: _cast_value(v, torch.float32) for k, v in kwargs.items()}
            return original(self, *args, **kwargs)

        return wrapper

    return make


def error_if_any_low_wrapper(state: CastState, message: str) -> Callable[[Callable], Callable]:
    """An error when any floating argument is low precision (in-place blacklist functions, banned ones)."""

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if casts_here(state) and _floating_dtypes((*args, *kwargs.values())) & set(LOW_PRECISION):
                raise NotImplementedError(message)
            return original(*args, **kwargs)

        return wrapper

    return make


class _RnnBackend:
    """Stands in for ``torch._VF`` inside ``torch.nn.modules.rnn``: its RNN kernels run in low precision."""

    def __init__(self, backend: Any, state: CastState, dtype: torch.dtype) -> None:
        self._backend = backend
        for name in RNN_BACKEND_FUNCTIONS:
            if hasattr(backend, name):
                setattr(self, name, self._wrap(getattr(backend, name), state, dtype, name.endswith("_cell")))

    @staticmethod
    def _wrap(original: Callable, state: CastState, dtype: torch.dtype, cached_weights: bool) -> Callable:
        """A cell's weights are cast through the cache (Apex's rule), so a cell unrolled over a sequence shares
        one low-precision copy per iteration instead of keeping one per time step in the graph."""

        def cast(value: Any) -> Any:
            if cached_weights and state.has_cache and isinstance(value, torch.nn.Parameter):
                return _cached_cast(value, dtype, state)
            return _cast_deep(value, dtype)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not casts_here(state):
                return original(*args, **kwargs)
            return original(*(cast(a) for a in args), **{k: cast(v) for k, v in kwargs.items()})

        return wrapper

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def _rnn_check_input_wrapper(state: CastState) -> Callable[[Callable], Callable]:
    """torch's RNN modules refuse an input whose dtype differs from their weights unless autocast is on;
    under O1 the backend casts both, so check the shape only (as autocast does)."""

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(self: Any, input: torch.Tensor, batch_sizes: Any) -> None:
            weight_dtype = self._flat_weights[0].dtype if self._flat_weights else input.dtype
            if casts_here(state) and input.dtype != weight_dtype:
                input = torch.empty(input.shape, dtype=weight_dtype, device="meta")
            return original(self, input, batch_sizes)

        return wrapper

    return make


def _fastpath_off_wrapper(state: CastState) -> Callable[[Callable], Callable]:
    """``torch.backends.mha.get_fastpath_enabled`` answering False while O1 casts, as torch's layers do under
    autocast: an eval-mode ``MultiheadAttention``/``TransformerEncoder(Layer)`` then runs its functions, which
    O1 casts, instead of a fused kernel (torch >= 1.12) that no list reaches and that refuses mixed dtypes."""

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper() -> bool:
            return False if casts_here(state) else original()

        return wrapper

    return make


def _replace_with_functional_alias(
    patches: CastPatches,
    owner: Any,
    name: str,
    make_wrapper: Callable[[Callable], Callable],
    functional_listed: set[str],
) -> None:
    """Wrap ``owner.name``, and ``torch.nn.functional.name`` too where it is the same function as ``torch.name``
    and the functional table does not list it (``conv2d`` has been an alias all along, with a row of its own).

    In Apex's day ``F.prelu`` and ``F.bilinear`` called ``torch.prelu``/``torch.bilinear``, so a patch of torch's
    name reached ``nn.PReLU`` and ``nn.Bilinear``; torch has since made them aliases of the torch functions,
    which a patch of one name misses.
    """
    original = getattr(owner, name, None)
    patches.replace(owner, name, make_wrapper)
    functional = torch.nn.functional
    if owner is torch and name not in functional_listed and getattr(functional, name, object()) is original:
        patches.replace(functional, name, make_wrapper)


def _as_inplace(names: Iterable[str]) -> list[str]:
    return [name + "_" for name in names]


def install_o1_casts(
    state: CastState,
    dtype: torch.dtype,
    allow_banned: bool,
    user_casts: Iterable[tuple[Any, str, str]] = (),
) -> CastPatches:
    """Patch torch as Apex's ``amp.init`` did and return the patches (``restore()`` undoes them).

    ``user_casts`` are ``(module, name, kind)`` registrations, kind ``"half"``/``"float"``/``"promote"``;
    they are applied first, so the built-in lists wrap them (Apex's order).
    """
    patches = CastPatches()
    low, fp32 = cast_wrapper(state, dtype, True), cast_wrapper(state, torch.float32, False)
    # Read at every install, as Apex's amp.init did: edits a script made to the lists take effect.
    functional, torch_lists, tensor, linalg = functional_overrides, torch_overrides, tensor_overrides, linalg_overrides
    functional_listed = {*functional.FP16_FUNCS, *functional.FP32_FUNCS, *functional.CASTS}
    functional_listed |= {name for name, _ in functional.BANNED_FUNCS}
    promote = promote_wrapper(state)
    for module, name, kind in user_casts:
        wrapper = {"half": low, "float": fp32, "promote": promote}[kind]
        _replace_with_functional_alias(patches, module, name, wrapper, functional_listed)
    tensor_fp32 = [name for name in tensor.FP32_FUNCS if name not in _CAST_BEFORE_TRANSFER]
    before_transfer = [name for name in tensor.FP32_FUNCS if name in _CAST_BEFORE_TRANSFER]
    tables = [
        (functional.MODULE, functional.FP16_FUNCS, low),
        (functional.MODULE, functional.FP32_FUNCS, fp32),
        (torch_lists.MODULE, torch_lists.FP16_FUNCS, low),
        (torch_lists.MODULE, torch_lists.FP32_FUNCS, fp32),
        (tensor.MODULE, tensor.FP16_FUNCS, low),
        (tensor.MODULE, tensor_fp32, fp32),
        (tensor.MODULE, before_transfer, fp32_before_transfer_wrapper(state)),
        (linalg.MODULE, linalg.FP16_FUNCS, low),
        (functional.MODULE, functional.CASTS, promote),
        (torch_lists.MODULE, torch_lists.CASTS, promote),
        (tensor.MODULE, tensor.CASTS, promote),
        (linalg.MODULE, linalg.CASTS, promote),
        (torch_lists.MODULE, torch_lists.SEQUENCE_CASTS, sequence_promote_wrapper(state)),
        (tensor.MODULE, tensor.SEQUENCE_CASTS, sequence_promote_wrapper(state)),
    ]
    for owner, names, wrapper in tables:
        for name in names:
            _replace_with_functional_alias(patches, owner, name, wrapper, functional_listed)
    for name in _as_inplace(torch_lists.FP32_FUNCS):
        message = f"Cannot call in-place function {name} with low-precision arguments under amp O1."
        patches.replace(torch_lists.MODULE, name, error_if_any_low_wrapper(state, message))
    for name in _as_inplace(tensor_fp32):
        patches.replace(tensor.MODULE, name, error_if_self_low_wrapper(state, name))
    for name in _as_inplace([*tensor.FP16_FUNCS, *tensor.CASTS]):
        patches.replace(tensor.MODULE, name, match_self_wrapper(state))
    rnn_module = torch.nn.modules.rnn
    patches.set(rnn_module, "_VF", _RnnBackend(rnn_module._VF, state, dtype))
    patches.replace(torch.backends.mha, "get_fastpath_enabled", _fastpath_off_wrapper(state))
    patches.replace(rnn_module.RNNBase, "check_input", _rnn_check_input_wrapper(state))
    for name, message in functional.BANNED_FUNCS:
        if allow_banned:
            patches.replace(functional.MODULE, name, fp32)
        else:
            patches.replace(functional.MODULE, name, error_if_any_low_wrapper(state, message))
    return patches
