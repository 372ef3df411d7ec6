"""``amp.initialize`` and ``amp.state_dict`` / ``amp.load_state_dict`` with Apex's signature and formats; Apex's
``Properties``, ``O0`` .. ``O3`` and ``opt_levels`` are importable from here, as from ``apex.amp.frontend``."""

from __future__ import annotations

import numbers
import os
import re
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ampkit.amp import OptLevelProperties, resolve_opt_level
from ampkit.amp.scaler import is_grad_scaler_state, loss_count_option
from ampkit.compat.amp import _ddp_no_sync
from ampkit.compat.amp._amp_state import _amp_state, maybe_print
from ampkit.compat.amp._model_casts import Float32StateDict, apply_model_casts
from ampkit.compat.amp._optimizer_stash import AmpOptimizerStash, inner_optimizer
from ampkit.compat.amp.handle import init
from ampkit.compat.amp.properties import O0, O1, O2, O3, O4, O5, Properties, opt_levels  # noqa: F401 - Apex's
from ampkit.compat.amp.scaler import ApexLossScaler
from ampkit.ops._switches import is_switch
from ampkit.wording import shown, type_of

# What amp.load_state_dict got before the first initialize: loaded into the scalers that initialize makes.
_held_state: dict[str, Any] | None = None

# initialize's names for the scaler's options, so that an error names the argument the caller wrote.
_SCALER_OPTION_NAMES = {
    "init_scale": "dynamic_init_scale",
    "growth_factor": "scale_growth_factor",
    "backoff_factor": "scale_backoff_factor",
    "growth_interval": "scale_window",
    "min_scale": "min_loss_scale",
    "max_scale": "max_loss_scale",
}

# What num_losses=0 does, as Apex's range(0) did; amp.scale_loss then says there is no scaler to scale with.
_NO_SCALER = "no loss scaler, for models initialized without a loss to scale"


def _is_optimizer(obj: Any) -> bool:
    return isinstance(obj, torch.optim.Optimizer) or isinstance(getattr(obj, "optim", None), torch.optim.Optimizer)


def _as_list(value: Any, name: str) -> tuple[list[Any], type | None]:
    """The items, and the container type to hand them back in (``None`` for a single object). A one-pass iterator
    (``model.children()``, a generator expression) is refused by ``name``: Apex's rule, a single object or a list."""
    if isinstance(value, (list, tuple)):
        return list(value), type(value)
    if isinstance(value, Iterator):  # was "models[0] is a generator", an index into a list the caller never made
        raise TypeError(
            f"{name} is {type_of(value)}; amp.initialize takes one {name[:-1]} or a list of them: pass "
            f"list(...) of it, and unpack the list it hands back"
        )
    return [value], None


def _item(name: str, i: int, single: bool) -> str:
    """How an error names the ``i``-th of ``name``: by index only where the caller passed a list (``models[1]``), as
    a single object is ``models`` itself."""
    return name if single else f"{name}[{i}]"


def _values_hint(name: str, value: Any) -> str:
    return f" (for a dict's values, pass list({name}.values()))" if isinstance(value, Mapping) else ""


def _check_models(models: list[Any], single: bool = False) -> None:
    for i, model in enumerate(models):
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            raise RuntimeError(
                f"Incoming model {i} is an instance of {type(model).__name__}. Parallel wrappers should only "
                "be applied to the model(s) AFTER the model(s) have been returned from amp.initialize: pass the "
                "model it wraps (its .module) and wrap the model amp.initialize returns."
            )
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"{_item('models', i, single)} is {type_of(model)}; amp.initialize expects a torch.nn.Module "
                f"or a list of them{_values_hint('models', model)}"
            )
        if _amp_state.allow_incoming_model_not_fp32:
            continue
        for name, param in model.named_parameters():
            if param.is_floating_point() and param.dtype != torch.float32:
                raise RuntimeError(
                    f"Found param {name} with dtype {param.dtype}, expected torch.float32. When using "
                    "amp.initialize, you do not need to call .half() on your model before passing it, no matter "
                    "what optimization level you choose (a model already initialized under O2/O3 is cast: build "
                    "a fresh one, or set amp._amp_state.allow_incoming_model_not_fp32 = True)."
                )


def _check_scripted(models: list[Any], properties: OptLevelProperties, cast_model_outputs: Any) -> None:
    """A TorchScript module cannot take a replaced ``forward`` or state-dict hooks, and its compiled code calls none
    of the torch functions O1 patches: refused where the model would be cast, warned about under O1."""
    for i, model in enumerate(models):
        if not isinstance(model, torch.jit.ScriptModule):
            continue
        what = f"models[{i}] is a TorchScript module ({type(model).__name__})"
        if properties.cast_model_type not in (None, torch.float32) or cast_model_outputs is not None:
            # Apex failed here too, in torch's "_register_state_dict_hook is not supported on ScriptModules",
            # after it had cast the module to half
            raise RuntimeError(
                f"{what}: amp.initialize cannot cast it at {properties.opt_level} (torch takes no state-dict hook on a "
                "ScriptModule, and O2/O3 need one to save float32). Pass the Python module to amp.initialize; if "
                "you need TorchScript, torch.jit.trace the model it returns."
            )
        if properties.patch_torch_functions:
            warnings.warn(
                f"{what}: its compiled code calls none of the torch functions {properties.opt_level} casts, so it "
                "runs in float32 (as under Apex). Pass the Python module to amp.initialize for mixed precision.",
                stacklevel=3,
            )


def _check_masters_unshared(optimizers: list[Any]) -> None:
    """Under master weights each optimizer keeps fp32 masters of its parameters and copies them into the model
    after its step: two optimizers over one parameter would each overwrite the other's update (Apex lost one
    silently)."""
    owner: dict[int, int] = {}
    for i, optimizer in enumerate(optimizers):
        for group in inner_optimizer(optimizer).param_groups:
            for param in group["params"]:
                j = owner.setdefault(id(param), i)
                if j != i:
                    raise RuntimeError(
                        f"optimizers[{j}] and optimizers[{i}] both hold a parameter of shape {tuple(param.shape)}: "
                        "with master weights (O2) each keeps its own fp32 copy and the later step overwrites the "
                        "earlier one's update; give each parameter to one optimizer"
                    )


def _check_optimizers(optimizers: list[Any], single: bool = False) -> None:
    for i, optimizer in enumerate(optimizers):
        if type(optimizer).__name__ == "FP16_Optimizer":
            raise RuntimeError(
                "An incoming optimizer is an instance of FP16_Optimizer. amp.initialize takes care of that "
                "itself: pass the torch optimizer FP16_Optimizer wraps."
            )
        if not _is_optimizer(optimizer):
            raise TypeError(
                f"{_item('optimizers', i, single)} is {type_of(optimizer)}; expected a torch.optim.Optimizer "
                f"or LARC, or a list of them{_values_hint('optimizers', optimizer)}"
            )
        if hasattr(optimizer, "_amp_stash"):
            raise RuntimeError(
                f"optimizers[{i}] ({type(optimizer).__name__}) was already passed through amp.initialize. "
                "A given optimizer should only be passed through amp.initialize once; build a new optimizer "
                "for a new run."
            )
    if len({id(inner_optimizer(o)) for o in optimizers}) != len(optimizers):
        raise RuntimeError("the same optimizer appears twice in the optimizers passed to amp.initialize")


def _check_parameters(models: list[Any], optimizers: list[Any]) -> None:
    """Every parameter holds values (none on the meta device), and each optimizer steps some parameter of the models
    passed: either mistake trained nothing, failing later in a raw op error (O1, O2) or not at all (O0)."""
    model_params: set[int] = set()
    for i, model in enumerate(models):
        for name, param in model.named_parameters():
            if param.is_meta:
                raise ValueError(
                    f"models[{i}]'s parameter {shown(name)} is on the meta device, which holds no values to train: "
                    "materialize the model (model.to_empty(device=...) and its init) before amp.initialize, and "
                    "build its optimizer after that"
                )
            model_params.add(id(param))
    for i, optimizer in enumerate(optimizers):
        params = [p for group in inner_optimizer(optimizer).param_groups for p in group["params"]]
        if any(p.is_meta for p in params):
            raise ValueError(
                f"optimizers[{i}] ({type(optimizer).__name__}) holds parameters on the meta device, which hold no "
                "values to update: build the optimizer after materializing the model (model.to_empty(device=...))"
            )
        if model_params and params and not any(id(p) in model_params for p in params):
            warnings.warn(
                f"optimizers[{i}] ({type(optimizer).__name__}) holds none of the parameters of the model(s) passed to "
                "amp.initialize, so its steps will not train them: was it built over another model's parameters?",
                stacklevel=3,
            )


def _print_properties(properties: OptLevelProperties, cast_model_outputs: Any, num_losses: int) -> None:
    maybe_print(f"Selected optimization level {opt_levels[properties.opt_level].brief.rstrip()}\n")
    maybe_print("Optimization options are:")
    rows = {
        "enabled": properties.enabled,
        "opt_level": properties.opt_level,
        "dtype": properties.dtype,
        "cast_model_type": properties.cast_model_type,
        "patch_torch_functions": properties.patch_torch_functions,
        "keep_batchnorm_fp32": properties.keep_batchnorm_fp32,
        "master_weights": properties.master_weights,
        "loss_scale": properties.loss_scale,
        "cast_model_outputs": cast_model_outputs,
        "num_losses": num_losses,
    }
    for key, value in rows.items():
        maybe_print(f"{key:22} : {value}")


def _return_shape(
    models: list[Any],
    models_container: type | None,
    optimizers: list[Any],
    optimizers_container: type | None,
    optimizers_given: bool,
) -> Any:
    model_out = models[0] if models_container is None else models_container(models)
    if not optimizers_given:
        return model_out
    return model_out, (optimizers[0] if optimizers_container is None else optimizers_container(optimizers))


def _several_ranks() -> bool:
    """Whether this process is one of several: DDP will give every rank rank 0's (cast) weights, so O2's masters
    start from that rounding, as Apex's did, and all ranks start from the same masters. Alone, they start from
    the float32 weights before the cast."""
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )


def initialize(
    models: torch.nn.Module | list[torch.nn.Module],
    optimizers: Any = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: torch.dtype | None = None,
    patch_torch_functions: bool | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    master_weights: bool | None = None,
    loss_scale: float | str | None = None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
    dynamic_init_scale: float = 2.0**16,
    scale_growth_factor: float = 2.0,
    scale_backoff_factor: float = 0.5,
    scale_window: int = 2000,
    combine_grad: bool | None = None,
    *,
    dtype: torch.dtype | str | None = None,
) -> Any:
    """Set up mixed precision for ``models`` and ``optimizers`` at ``opt_level`` (Apex's ``amp.initialize``).

    Models (and optimizers, when given) come back in the shape they were passed: a single object or a list.
    Apex's O0-O5 table and override rules apply; the Ascend knobs (``dynamic_init_scale``,
    ``scale_growth_factor``, ``scale_backoff_factor``, ``scale_window``, ``combine_grad``) configure the
    dynamic scalers and flat gradient buffers. ``dtype`` (ampkit's addition, keyword-only) picks float16
    (default) or bfloat16 for O1's autocast and O2/O3's model cast. Everything keys on dtype and device:
    CPU models really run in low precision. Calling ``initialize`` again starts a new run (fresh scalers,
    casts and registrations); passing an optimizer a second time is an error.

    Example:
        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")  # doctest: +SKIP
    """
    _amp_state.reset()
    if not isinstance(verbosity, numbers.Integral):  # a bool too: NVIDIA's odtk passes verbosity=is_master
        raise ValueError(f"verbosity={shown(verbosity)}: expected an integer (0 silences amp)")
    verbosity = int(verbosity)
    _amp_state.verbosity = verbosity
    if not is_switch(enabled):  # by truthiness enabled='False' from a config switched amp on
        raise ValueError(f"enabled={shown(enabled)}: expected True or False")
    if not enabled:
        # Apex returned here, reading nothing else: a float32 run of a script that passes its fp16 settings through
        # (opt_level=None or 'o1', loss_scale=0 meaning dynamic, ...) must not stop on them
        _amp_state.opt_properties = resolve_opt_level("O0", enabled=False)
        return models if optimizers is None else (models, optimizers)
    # numpy's integers too, as Apex's range(num_losses) took them; 10**8, a typo, made a scaler each for the better
    # part of an hour. 0 made none in Apex: programs initialize their models alone with num_losses=0, and the
    # optimizer in a second initialize that makes the scalers (ColossalAI's GPT benchmark)
    num_losses = loss_count_option(num_losses, "num_losses", zero_means=_NO_SCALER)
    if combine_grad is not None and not is_switch(combine_grad):
        raise ValueError(f"combine_grad={shown(combine_grad)}: expected True, False or None")  # bool("False") is True
    properties = resolve_opt_level(
        opt_level,
        dtype=dtype,
        enabled=enabled,
        cast_model_type=cast_model_type,
        patch_torch_functions=patch_torch_functions,
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=master_weights,
        loss_scale=loss_scale,
    )
    if cast_model_outputs is not None and not (
        isinstance(cast_model_outputs, torch.dtype) and cast_model_outputs.is_floating_point
    ):
        raise ValueError(f"cast_model_outputs={shown(cast_model_outputs)}: expected a floating torch dtype or None")
    model_list, models_container = _as_list(models, "models")
    optimizers_given = optimizers is not None
    optimizer_list, optimizers_container = _as_list(optimizers, "optimizers") if optimizers_given else ([], None)
    _check_models(model_list, single=models_container is None)
    _check_scripted(model_list, properties, cast_model_outputs)
    _check_optimizers(optimizer_list, single=optimizers_container is None)
    if properties.master_weights:
        _check_masters_unshared(optimizer_list)
    scalers = [
        ApexLossScaler(
            properties.loss_scale,
            init_scale=dynamic_init_scale,
            growth_factor=scale_growth_factor,
            backoff_factor=scale_backoff_factor,
            scale_window=scale_window,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
            option_names=_SCALER_OPTION_NAMES,
        )
        for _ in range(num_losses)
    ]
    _amp_state.opt_properties = properties
    _amp_state.min_loss_scale, _amp_state.max_loss_scale = min_loss_scale, max_loss_scale
    _check_parameters(model_list, optimizer_list)
    _print_properties(properties, cast_model_outputs, num_losses)
    fp32_values = None
    if properties.master_weights and properties.cast_model_type not in (None, torch.float32) and not _several_ranks():
        fp32_values = {id(p): p.detach().clone() for m in model_list for p in m.parameters()}
    state_dict_hook = Float32StateDict()
    for model in model_list:
        apply_model_casts(model, properties, cast_model_outputs, state_dict_hook)
    if properties.cast_model_type not in (None, torch.float32) and not properties.master_weights:
        for optimizer in optimizer_list:  # state made before the cast (O3 momentum, Adam moments) follows it
            optimizer.load_state_dict(optimizer.state_dict())
    for optimizer in optimizer_list:
        optimizer._amp_stash = AmpOptimizerStash(optimizer, properties, bool(combine_grad), fp32_values)
        state_dict_hook.master_sources.append(optimizer._amp_stash.masters_by_param)
    _amp_state.loss_scalers = scalers
    _amp_state.combine_grad = bool(combine_grad)
    _ddp_no_sync.install()
    if properties.patch_torch_functions:
        init(loss_scale=properties.loss_scale, verbose=verbosity == 2, patch_type=properties.dtype)
    _restore_held_state()
    return _return_shape(model_list, models_container, optimizer_list, optimizers_container, optimizers_given)


def _check_scaler_keys(unexpected: list[Any]) -> None:
    if unexpected:
        # A whole training checkpoint handed over (Apex's own README saves amp.state_dict() under 'amp' in one)
        whole = " (a whole checkpoint: pass its 'amp' entry, amp.load_state_dict(checkpoint['amp']))"
        raise RuntimeError(
            "Error(s) in loading state_dict. Unexpected key(s) in state_dict: "
            + ", ".join(f'"{k}"' for k in unexpected)
            + ". Expected loss_scaler0, loss_scaler1, ..."
            + (whole if "amp" in unexpected else "")
        )


def _restore_held_state() -> None:
    """Load into the new scalers what :func:`load_state_dict` got before any ``initialize`` (once)."""
    global _held_state
    held, _held_state = _held_state, None
    if held is not None:
        load_state_dict(held)


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """Apex's format: ``{"loss_scaler0": {"loss_scale": s, "unskipped": n}, ...}``, one entry per loss."""
    if destination is None:
        destination = OrderedDict()
    for idx, scaler in enumerate(getattr(_amp_state, "loss_scalers", ())):  # {} before an enabled initialize
        destination[f"loss_scaler{idx}"] = scaler.state_dict()
    return destination


def load_state_dict(state_dict: dict[str, Any]) -> None:
    """Restore the scalers from :func:`state_dict` (Apex's rules: extra scalers skipped, other keys an error)."""
    if not isinstance(state_dict, Mapping):
        hint = (
            " (load the file first: amp.load_state_dict(torch.load(path)['amp']))"
            if isinstance(state_dict, str | bytes | os.PathLike)
            else ""
        )
        raise TypeError(
            f"amp.load_state_dict expects the dict from amp.state_dict(), got {type(state_dict).__name__}{hint}"
        )
    native = is_grad_scaler_state(state_dict)  # a native-AMP checkpoint's scaler: its one scale served every loss
    unexpected = [] if native else [key for key in state_dict if "loss_scaler" not in key]
    if not _amp_state.initialized:
        # Apex raised here (its scalers exist only once initialize made them); Lightning 1.x restores a checkpoint's
        # amp state before its plugin calls initialize, so the state waits for the scalers the next one makes.
        _check_scaler_keys(unexpected)
        global _held_state
        _held_state = dict(state_dict) if state_dict else None  # {}: a run without amp (mmcv-style runners)
        return
    scalers = getattr(_amp_state, "loss_scalers", [])  # none after initialize(enabled=False)
    if native:
        for scaler in scalers:
            scaler.load_state_dict(state_dict)
        return
    if len(state_dict) != len(scalers):
        print(f"Warning: state_dict contains {len(state_dict)} entries, while {len(scalers)} loss_scalers are used")
    _check_scaler_keys(unexpected)
    for position, key in enumerate(state_dict):
        # by the number in its key (Apex went by position: a dict reordered on the way, by a sorted JSON or YAML
        # dump, gave loss 0 the scale of loss 2, and loss_scaler10 came before loss_scaler2)
        number = re.fullmatch(r"loss_scaler(\d+)", str(key))
        idx = int(number.group(1)) if number else position
        if idx >= len(scalers):
            print(f"Skipping loss_scaler[{idx}], since num_losses was set to {len(scalers)}")
            continue
        scalers[idx].load_state_dict(state_dict[key])
