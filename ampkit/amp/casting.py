"""Casting rules for the opt levels, keyed on dtype and device only (CPU tensors are cast too).

- O1: :func:`autocast_for` runs the forward under ``torch.autocast`` on the model's device type.
- O2/O3: :func:`cast_model` casts a model's floating-point parameters and buffers, optionally keeping
  batch-norm layers in float32; :func:`add_boundary_casts` casts floating inputs to the model's type at
  its boundary and its floating outputs back (Apex casts outputs to float32 unless told otherwise);
  :func:`patch_forward_casts` does the same by replacing ``model.forward``, as Apex did.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ampkit.amp.opt_levels import parse_dtype, parse_keep_batchnorm_fp32
from ampkit.ops._switches import checked_switch
from ampkit.wording import shown

__all__ = [
    "BoundaryCasts",
    "ForwardCasts",
    "add_boundary_casts",
    "autocast_for",
    "cast_floating",
    "cast_model",
    "model_device",
    "patch_forward_casts",
]


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); CPU for a model with neither."""
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def autocast_for(
    model_or_device: nn.Module | torch.device | str, dtype: torch.dtype | str, enabled: bool = True
) -> torch.autocast:
    """``torch.autocast`` on the device type of ``model_or_device`` with ``dtype`` (O1's casting): float16 or
    bfloat16, or its name. torch took another dtype with a warning and ran in float32, and ``enabled="False"`` on."""
    dtype = parse_dtype(dtype)
    enabled = checked_switch("autocast_for", "enabled", enabled)
    if isinstance(model_or_device, nn.Module):
        device = model_device(model_or_device)
    else:
        device = torch.device(model_or_device)
    return torch.autocast(device_type=device.type, dtype=dtype, enabled=enabled)


def _floating_dtype(value: Any, option: str) -> torch.dtype:
    """``value`` if it is a floating-point torch dtype; else a ValueError naming ``option``."""
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"{option}={shown(value)}: expected a floating-point torch dtype")
    return value


def cast_floating(value: Any, dtype: torch.dtype, own_to: bool = False) -> Any:
    """Cast the floating tensors inside ``value`` (nested lists, tuples, namedtuples, dicts, dataclasses) to ``dtype``.

    Integer tensors, strings and other objects pass through unchanged. With ``own_to``, an object of another
    class that has a ``to`` method (a custom batch, a namedtuple with its own ``to``) is cast by
    ``value.to(dtype)``: the contract Apex's O2/O3 offered such classes. Dicts and modules are not. A dataclass
    (frozen too) is copied with its fields cast: passed through, its tensors reached a cast model in float32 (a
    dtype mismatch in the first matmul), and a model's output dataclass stayed in float16 where others are float32.
    ``dtype`` is a floating one: ``torch.int32`` truncated every floating tensor, silently.
    """
    return _cast_floating(value, _floating_dtype(dtype, "dtype"), checked_switch("cast_floating", "own_to", own_to))


def _cast_floating(value: Any, dtype: torch.dtype, own_to: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (str, bytes)):
        return value
    if own_to and _has_own_to(value):
        return _cast_by_own_to(value, dtype)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_cast_floating(v, dtype, own_to) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floating(v, dtype, own_to) for v in value)
    if isinstance(value, Mapping):  # HF's ModelOutput, a dataclass too, is rebuilt as the mapping it is
        return _rebuild_mapping(value, {k: _cast_floating(v, dtype, own_to) for k, v in value.items()})
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cast = copy.copy(value)
        for f in dataclasses.fields(value):
            object.__setattr__(cast, f.name, _cast_floating(getattr(value, f.name), dtype, own_to))  # frozen ones too
        return cast
    return value


def _rebuild_mapping(original: Mapping, items: dict) -> Mapping:
    """``items`` in the type of ``original``. A dict subclass is copied, then given the cast values one by one:
    no constructor is called, so a defaultdict keeps its factory, a subclass taking arguments of its own keeps
    them, and HF's ModelOutput (which refuses ``update``) its fields. Another mapping is built from ``items``,
    or is a plain dict when its constructor refuses them, as Apex's casts returned every mapping."""
    if type(original) is dict:
        return items
    if isinstance(original, dict):
        rebuilt = copy.copy(original)
        for key, value in items.items():
            rebuilt[key] = value
        return rebuilt
    try:
        return type(original)(items)
    except TypeError:
        return items


def _has_own_to(value: Any) -> bool:
    # A mapping keeps the per-tensor cast (HF's BatchEncoding.to refuses a dtype with a warning and casts
    # nothing), and a module passed as an argument is the caller's to cast (``.to`` would cast it in place).
    return callable(getattr(value, "to", None)) and not isinstance(value, (Mapping, nn.Module))


def _cast_by_own_to(value: Any, dtype: torch.dtype) -> Any:
    try:
        return value.to(dtype)
    except (TypeError, ValueError, RuntimeError, AttributeError) as err:
        raise TypeError(
            f"{type(value).__name__}.to({dtype}) failed: {err}. The model's inputs and outputs are cast to its "
            f"dtype, and an object of a class of your own by its .to(dtype); give {type(value).__name__} a .to "
            "that takes a dtype and casts its floating tensors, or pass the tensors themselves"
        ) from err


def _is_batchnorm(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


def cast_model(model: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool | None = False) -> nn.Module:
    """Cast the floating-point parameters and buffers of ``model`` to ``dtype`` in place.

    With ``keep_batchnorm_fp32`` the batch-norm layers (``_BatchNorm`` subclasses, SyncBatchNorm
    included) keep float32 weights and running statistics; torch's batch norm accepts low-precision
    inputs with float32 parameters on CPU and CUDA. Returns ``model``.
    """
    if not isinstance(model, nn.Module):  # a list failed in model.modules()
        raise TypeError(f"cast_model expects a torch.nn.Module, got {type(model).__name__}")
    dtype = _floating_dtype(dtype, "dtype")
    keep_batchnorm_fp32 = parse_keep_batchnorm_fp32(keep_batchnorm_fp32)  # "False" kept batch norm in float32
    for module in model.modules():
        keep = keep_batchnorm_fp32 and _is_batchnorm(module)
        target = torch.float32 if keep else dtype
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != target:
                param.data = param.data.to(target)
                if param.grad is not None:
                    param.grad = param.grad.to(target)
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_floating_point() and buf.dtype != target:
                module._buffers[name] = buf.to(target)
    return model


class BoundaryCasts:
    """Handle for the hooks :func:`add_boundary_casts` installed; :meth:`remove` takes them off."""

    def __init__(self, handles: list[torch.utils.hooks.RemovableHandle]) -> None:
        self._handles = handles

    def remove(self) -> None:
        """Remove the input and output casting hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _first_tensor_name(model: nn.Module, dtype: torch.dtype) -> str | None:
    """The qualified name of the first parameter (else buffer) of ``model`` in ``dtype``; None if it has none."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.dtype == dtype:
            return name
    return None


class _DtypeWatch:
    """Tells whether a model still holds a tensor in the dtype its boundary casts were made for.

    A model cast again as a whole (``model.float()`` for inference, on a model loaded whole) holds none, and
    its casts stand down. One tensor is watched, so the check is cheap: when it changes dtype the model is
    searched once, and the watch moves to a tensor still in the dtype (one layer the script made float32) or
    stays, marked away, until the watched tensor is cast back.
    """

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name = name
        self.dtype = dtype
        self.away = False

    def recast_away(self, model: nn.Module) -> bool:
        owner_name, _, leaf = self.name.rpartition(".")
        try:
            tensor = getattr(model.get_submodule(owner_name), leaf, None)
        except AttributeError:
            tensor = None  # the layer was replaced since: search again
        if isinstance(tensor, torch.Tensor):
            if tensor.dtype == self.dtype:
                self.away = False
                return False
            if self.away:
                return True
        name = _first_tensor_name(model, self.dtype)
        self.away = name is None
        self.name = name or self.name
        return self.away


class _CastInputs:
    """Forward pre-hook casting floating inputs to ``dtype`` (an object, not a closure, so the model pickles)."""

    own_to = False  # hooks pickled before an option existed load with it off
    watch: _DtypeWatch | None = None

    def __init__(self, dtype: torch.dtype, own_to: bool = False, watch: _DtypeWatch | None = None) -> None:
        self.dtype = dtype
        self.own_to = own_to
        self.watch = watch

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.watch is not None and self.watch.recast_away(module):
            return args, kwargs
        return _cast_floating(args, self.dtype, self.own_to), _cast_floating(kwargs, self.dtype, self.own_to)


class _CastOutputs:
    """Forward hook casting floating outputs to ``dtype`` (an object, not a closure, so the model pickles)."""

    own_to = False
    watch: _DtypeWatch | None = None

    def __init__(self, dtype: torch.dtype, own_to: bool = False, watch: _DtypeWatch | None = None) -> None:
        self.dtype = dtype
        self.own_to = own_to
        self.watch = watch

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self.watch is not None and self.watch.recast_away(module):
            return output
        return _cast_floating(output, self.dtype, self.own_to)


def add_boundary_casts(
    model: nn.Module,
    input_dtype: torch.dtype | None,
    output_dtype: torch.dtype | None = torch.float32,
    own_to: bool = False,
) -> BoundaryCasts:
    """Cast floating inputs (positional and keyword) of ``model`` to ``input_dtype`` and its floating
    outputs to ``output_dtype``; ``None`` leaves that side alone. The model stays picklable (``torch.save``).
    ``own_to`` casts objects of other classes by their own ``.to(dtype)`` (see :func:`cast_floating`).

    The hooks stand down once the model holds no tensor in ``input_dtype``: a model saved whole, loaded and
    ``.float()``-ed for inference takes float32 inputs and returns its own outputs, as a float32 model does.
    """
    cast_inputs, cast_outputs = _boundary_casters(model, input_dtype, output_dtype, own_to)
    handles = []
    if cast_inputs is not None:
        handles.append(model.register_forward_pre_hook(cast_inputs, with_kwargs=True))
    if cast_outputs is not None:
        handles.append(model.register_forward_hook(cast_outputs))
    return BoundaryCasts(handles)


def _boundary_casters(
    model: nn.Module, input_dtype: torch.dtype | None, output_dtype: torch.dtype | None, own_to: bool
) -> tuple[_CastInputs | None, _CastOutputs | None]:
    for option, dtype in (("input_dtype", input_dtype), ("output_dtype", output_dtype)):
        if dtype is not None:  # torch.int64 cast every floating input to integers, silently
            _floating_dtype(dtype, option)
    own_to = checked_switch("boundary casts", "own_to", own_to)
    watched = _first_tensor_name(model, input_dtype) if input_dtype is not None else None
    watch = _DtypeWatch(watched, input_dtype) if watched is not None else None
    cast_inputs = _CastInputs(input_dtype, own_to, watch) if input_dtype is not None else None
    cast_outputs = _CastOutputs(output_dtype, own_to, watch) if output_dtype is not None else None
    return cast_inputs, cast_outputs


# Per thread (DataParallel runs its replicas in threads): weak references to the modules whose hooked call has cast
# the inputs and is about to run their forward. An entry lives only between the last of our pre-hooks and the
# forward, so there is at most one unless a later pre-hook of the script's calls another model.
_hooked_calls = threading.local()


class _EnterForward:
    """Forward pre-hook of :func:`patch_forward_casts`, after the input casts: tells the patched forward which module
    is being called. A DataParallel replica shares the original's ``forward`` object, so only the hook, which torch
    calls with the replica, can say whose weights to run."""

    def __call__(self, module: nn.Module, args: tuple) -> None:
        stack = getattr(_hooked_calls, "modules", None)
        if stack is None:
            stack = _hooked_calls.modules = []
        stack.append(weakref.ref(module))


class _LeaveForward:
    """Forward hook of :func:`patch_forward_casts`, run even when the call raised: drops the entry of a call that a
    later pre-hook of the script's aborted before the forward ran, so the next direct ``model.forward(x)`` is not
    taken for a hooked call."""

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        stack = getattr(_hooked_calls, "modules", None)
        if stack and stack[-1]() is module:
            stack.pop()


class _CastForward:
    """The ``forward`` put on a model by :func:`patch_forward_casts` (an object, not a closure, so the model
    pickles and ``copy.deepcopy`` gives the copy a forward of its own)."""

    def __init__(
        self,
        model: nn.Module,
        cast_inputs: _CastInputs | None,
        cast_outputs: _CastOutputs | None,
        inner: Any = None,
    ) -> None:
        self.model = model
        self.cast_inputs = cast_inputs
        self.cast_outputs = cast_outputs
        self.inner = inner  # a forward the script had set on the model itself; None: its class's
        # functools.wraps' names that the class itself defines (a property would replace the class's own): help(),
        # inspect.getdoc and pydoc show the model's forward
        forward = self._forward_of(model)
        self.__doc__ = getattr(forward, "__doc__", None)
        self.__module__ = getattr(forward, "__module__", type(model).__module__)

    def _forward_of(self, module: nn.Module) -> Any:
        return self.inner if self.inner is not None else type(module).forward.__get__(module)

    @property
    def __signature__(self) -> inspect.Signature:
        # The model's own: transformers picks the dataset columns and generate()'s keyword arguments from
        # inspect.signature(model.forward)
        return inspect.signature(self._forward_of(self.model))

    # A bound method's names, as functools.wraps gives a wrapper: Lightning's is_overridden("forward", model)
    # follows __wrapped__ to compare __code__, and loggers print __name__/__qualname__. No __func__, as on Apex's
    # closure and on any wrapper: accelerate rebinds forward.__func__ with MethodType when it exists, which would
    # drop the casts of a direct model.forward(x); without it, it wraps this forward whole.
    @property
    def __wrapped__(self) -> Any:
        return self._forward_of(self.model)

    @property
    def __self__(self) -> nn.Module:
        return self.model

    @property
    def __name__(self) -> str:
        return getattr(self._forward_of(self.model), "__name__", "forward")

    def __get__(self, instance: Any, owner: type | None = None) -> _CastForward:
        # Already bound to its model, as a bound method is. Having __get__ makes inspect.isroutine answer True, so
        # help(model.forward) shows the forward's signature and docstring rather than this class.
        return self

    def __getattr__(self, name: str) -> Any:
        # __qualname__ cannot be a property (the class statement takes it as the class's own name). torch.export
        # reads forward.__code__ for its source location, then calls the model, casts included.
        if name in ("__qualname__", "__code__", "__defaults__", "__kwdefaults__", "__annotations__"):
            forward = self._forward_of(self.model)
            if name == "__qualname__":
                return getattr(forward, name, "forward")
            return getattr(forward, name)
        if name == "__globals__":
            # torch.jit.script compiles a forward from its source and globals: it would compile the model's own
            # forward without these casts, so it is told why not and what works
            raise AttributeError(
                f"torch.jit.script cannot compile the forward amp.initialize put on {type(self.model).__name__} "
                "(it casts inputs and outputs in Python, which TorchScript cannot compile; Apex's could not be "
                "scripted either). Use torch.jit.trace(model, example_inputs) or torch.export.export(model, args), "
                "which record the casts, or script a float32 copy of the model loaded from model.state_dict()"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        stack = getattr(_hooked_calls, "modules", None)
        called = stack[-1]() if stack else None
        if called is not None and called.__dict__.get("forward") is self:
            # model(x): the hooks have cast the inputs and will cast the outputs
            stack.pop()
            return self._forward_of(called)(*args, **kwargs)
        model = self.model  # model.forward(x), called by the script itself
        if self.cast_inputs is not None:
            args, kwargs = self.cast_inputs(model, args, kwargs)
        output = self._forward_of(model)(*args, **kwargs)
        return self.cast_outputs(model, args, output) if self.cast_outputs is not None else output


class ForwardCasts:
    """Handle for what :func:`patch_forward_casts` installed; :meth:`remove` gives the model its own forward back."""

    def __init__(self, model: nn.Module, patched: _CastForward, hooks: BoundaryCasts) -> None:
        # Weak: the patched forward holds the model, and a handle kept by whoever installed it (amp's registry of
        # initialized models) must not keep a dropped model alive.
        self._model = weakref.ref(model)
        self._patched = weakref.ref(patched)
        self._hooks = hooks

    def remove(self) -> None:
        """Take the hooks off and restore the forward the model had, unless the script has replaced ours since."""
        self._hooks.remove()
        model, patched = self._model(), self._patched()
        if model is None or patched is None or model.__dict__.get("forward") is not patched:
            return
        if patched.inner is None:
            del model.__dict__["forward"]
        else:
            model.forward = patched.inner


def patch_forward_casts(
    model: nn.Module,
    input_dtype: torch.dtype | None,
    output_dtype: torch.dtype | None = torch.float32,
    own_to: bool = False,
) -> ForwardCasts:
    """Cast as :func:`add_boundary_casts` does, and also where a script calls ``model.forward(x)`` itself or a
    model's method calls ``self.forward(x)``: ``model.forward`` is replaced, as Apex's ``initialize`` did.

    ``model(x)`` is cast by hooks, as with :func:`add_boundary_casts`, so DataParallel replicas run their own
    weights (Apex's replaced forward ran the original's on every device). A forward the script had set on the
    model (``model.forward = ...``) is the one called inside.
    """
    cast_inputs, cast_outputs = _boundary_casters(model, input_dtype, output_dtype, own_to)
    patched = _CastForward(model, cast_inputs, cast_outputs, model.__dict__.get("forward"))
    handles = []
    if cast_inputs is not None:
        handles.append(model.register_forward_pre_hook(cast_inputs, with_kwargs=True))
    handles.append(model.register_forward_pre_hook(_EnterForward()))
    handles.append(model.register_forward_hook(_LeaveForward(), always_call=True))
    if cast_outputs is not None:
        handles.append(model.register_forward_hook(cast_outputs))
    model.forward = patched
    return ForwardCasts(model, patched, BoundaryCasts(handles))
