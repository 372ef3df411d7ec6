"""``apex.parallel.DistributedDataParallel`` on ``torch.nn.parallel.DistributedDataParallel``.

Apex argument → effect here:

- ``message_size`` (elements) → ``bucket_cap_mb = message_size * 4 bytes`` (Apex sized buckets in fp32 elements).
- ``delay_allreduce=True`` → Apex's "allreduce at the end of backward": torch's reducer stays idle and, once
  backward has finished, the gradients that exist are all-reduced in one flat tensor per dtype. No graph walk
  (torch's ``find_unused_parameters``) is needed, and a parameter the forward did not use is no error. The reduce
  is queued from the parameters' gradient hooks, as Apex's was, so whatever the forward returns (a class of the
  model's own included) its backward is reduced. A gradient only some ranks have (a parameter one rank's batch did
  not use) is counted as zeros on the others, at the cost of one small all-reduce of flags per backward: Apex
  reduced each rank's own list, so the ranks' flat buffers differed (a hang, or two parameters' gradients of one
  size added into each other, silently).
- ``gradient_average``, ``gradient_predivide_factor``, ``allreduce_always_fp32`` → divide by the predivide
  factor before the allreduce and, when averaging, multiply by ``predivide / world_size`` after it; with
  ``gradient_average=False`` the result stays ``sum / predivide``, as in Apex. It reduces in fp32 when asked.
  Without these options (and without ``delay_allreduce``) torch's default comm hook runs.
- A parameter frozen at construction and unfrozen later: torch's reducer keeps the parameters trainable at
  construction, so from then on each backward reduces at its end, as ``delay_allreduce=True``. A module frozen
  whole (kanachan's target networks) is taken, as Apex took it, though torch's constructor refuses one.
- A parameter the forward never uses (thunlp/ERNIE's last layer computes an entity branch no loss reads): Apex's
  default mode built its buckets from the gradients its first backward produced, reducing that backward at its
  end, and never waited for the others. Here too the first synced backward reduces at its end. If the backwards
  of that forward reached every parameter torch's reducer holds, on every rank, torch's reducer overlaps the
  allreduce from the next forward on (where this is decided, so that a reentrant checkpoint's inner backward does
  not decide it early); else every backward reduces at its end (the same averages, no overlap), with the
  gradients some rank has and another lacks counted as zeros on the other (one small all-reduce per backward).
  ``find_unused_parameters``, ``static_graph`` or a sparse-gradient embedding go to torch's reducer from the start.
- The end-of-backward reduce runs at the end of each backward that reaches a parameter (a reentrant checkpoint's
  inner one included), as averaging is then exact: the part reduced before is the same on every rank. A sum
  (``gradient_average=False``) is not: there each reduce takes the gradients a backward added to since the last
  one, a gradient reduced since the forward is not reduced again, and what a later backward adds to it (a loss on
  the weights themselves) stays local, as under Apex, whose reduce was queued once per forward. (Apex's queued
  reduce ran at the end of a reentrant checkpoint's inner backward only, leaving the rest rank-local.)
- Buffers (e.g. BatchNorm running statistics) stay rank-local: Apex broadcast only the parameters, once, at
  construction, so torch's buffer broadcast is off unless ``broadcast_buffers``/``forward_sync_buffers`` is given.
- ``gradient_average_split_factor`` → Apex's deprecated alias of ``gradient_predivide_factor`` (warns).
- ``shared_param`` → rejected, as in Apex.
- ``retain_allreduce_buffers=True`` → reduce at the end of backward, as ``delay_allreduce``, and keep the flat
  reduced buffers in ``allreduce_buffers`` (one per dtype: float16, float32, float64, bfloat16), each parameter's
  ``.grad`` a view of its buffer, as Apex left them for optimizers that step a flat gradient (MLPerf's GNMT, SSD);
  ``active_params`` and ``active_i_buckets`` name the parameters of each buffer, as Apex's did. The buffers hold
  every gradient after each backward, a reentrant checkpoint's included (Apex's held the inner backward's only).
- A subclass's ``allreduce_bucket`` (one that all-reduces over its own group, as hierarchical trainers did) is
  what reduces each bucket, called as Apex called it: ``(grads, bucket_idx, force_default_stream)`` (``True`` at the
  end of backward), or ``(grads)`` for Apex's older signature; the flat tensor it returns is what the gradients
  become. A function set on the instance (``ddp.allreduce_bucket = fn``), also after construction, reduces each
  bucket from then on: it is looked up at each bucket, as Apex looked it up.
- ``allreduce_trigger_params``, ``num_allreduce_streams``, ``allreduce_communicators``, ``prof`` → no effect
  (torch's reducer schedules buckets and streams itself); a non-default value warns once.

Gradient accumulation: Apex's class had no ``no_sync`` (only ``disable_allreduce``), so clients that use
``no_sync`` when a model has it (timm) all-reduced every micro-batch under Apex; here ``no_sync`` is hidden
and they do the same. ``disable_allreduce`` keeps gradients local, except while ``amp.scale_loss`` takes each
backward's gradients out of ``.grad``: the final synced backward would then average only its own micro-batch
and each rank would add its own earlier ones back (ranks drift apart, as they did under Apex), so every
micro-batch is all-reduced instead, with a warning.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import itertools
import math
import numbers
import sys
import warnings
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from ampkit.amp.trainable import any_requires_grad
from ampkit.compat.amp._amp_state import _amp_state
from ampkit.compat.parallel.flat_dist import (
    apply_flat_dist_call,
    extract_tensors,
    flat_dist_call,
    flatten,
    split_by_type,
    split_half_float_double,
    unflatten,
)
from ampkit.ops._switches import checked_switch
from ampkit.trainer.distributed import let_gloo_threads_release
from ampkit.wording import shown

__all__ = [  # Apex's module held its flat collectives too: scripts import flat_dist_call from here
    "DistributedDataParallel",
    "Reducer",
    "apply_flat_dist_call",
    "extract_tensors",
    "flat_dist_call",
    "flatten",
    "split_by_type",
    "split_half_float_double",
    "unflatten",
]

_FP32_BYTES = 4
# Apex's split_half_float_double order of the flat buffers (bfloat16 came last, in its later versions).
_APEX_BUCKET_ORDER = {torch.float16: 0, torch.float32: 1, torch.float64: 2, torch.bfloat16: 3}
_NO_EFFECT_DEFAULTS = {
    "allreduce_trigger_params": None,
    "num_allreduce_streams": 1,
    "allreduce_communicators": None,
    "prof": False,
}


@dataclass(frozen=True)
class _ApexReduceOptions:
    """What Apex's reducer did to each gradient bucket around the allreduce."""

    process_group: Any
    average: bool
    predivide_factor: float
    always_fp32: bool

    @property
    def is_torch_default(self) -> bool:
        """True when the reduction is torch's plain average (no comm hook needed)."""
        return self.average and self.predivide_factor == 1.0 and not self.always_fp32


def _group_and_size(options: _ApexReduceOptions) -> tuple[Any, int]:
    group = options.process_group if options.process_group is not None else dist.group.WORLD
    return group, dist.get_world_size(group)


def _before_allreduce(options: _ApexReduceOptions, buffer: torch.Tensor) -> torch.Tensor:
    """What Apex did before the allreduce: an fp32 copy when asked, then the predivide (in place)."""
    reduced = buffer.float() if options.always_fp32 and buffer.dtype != torch.float32 else buffer
    if options.predivide_factor != 1.0:
        reduced.div_(options.predivide_factor)
    return reduced


def _after_allreduce(options: _ApexReduceOptions, reduced: torch.Tensor, world_size: int) -> torch.Tensor:
    """And after it: average (``* predivide / world_size``), or leave ``sum / predivide``."""
    if options.average:
        reduced.mul_(options.predivide_factor / world_size)
    return reduced


def _apex_allreduce_hook(options, bucket):  # unannotated: DDP rejects string annotations of comm hooks
    """torch DDP comm hook: Apex's reduction of one ``dist.GradBucket``; a future of the reduced bucket."""
    group, world_size = _group_and_size(options)
    buffer = bucket.buffer()
    reduced = _before_allreduce(options, buffer)
    future = dist.all_reduce(reduced, group=group, async_op=True).get_future()
    return future.then(lambda fut: _after_allreduce(options, fut.value()[0], world_size).to(buffer.dtype))


def _bucket_hook(ddp_ref, bucket):  # unannotated: DDP rejects string annotations of comm hooks
    """torch DDP comm hook: one ``dist.GradBucket`` reduced by the script's ``allreduce_bucket`` where it has one now
    (looked up at each bucket, as Apex called it), the flat tensor it returns becoming the bucket; else by Apex's
    reduction options."""
    ddp = ddp_ref()
    allreduce_bucket = ddp._scripts_allreduce_bucket()
    if allreduce_bucket is None:
        return _apex_allreduce_hook(ddp._reduce_options, bucket)
    buffer = bucket.buffer()
    reduced = ddp._call_allreduce_bucket(allreduce_bucket, bucket.gradients(), bucket.index(), False)
    if reduced is not None and reduced is not buffer:
        buffer.copy_(reduced.reshape(-1))
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future


def _allreduce_bucket_arity(method: Any) -> int:
    """How many arguments a script's ``allreduce_bucket`` takes: 3 (Apex's last ``bucket, bucket_idx,
    force_default_stream``) or 1 (its older ``bucket``)."""
    try:
        inspect.signature(method).bind([], 0, False)
    except TypeError:
        return 1
    return 3


def _queue_end_of_backward_reduce(ddp_ref: weakref.ref, param: torch.Tensor) -> None:
    """A parameter's post-accumulate-grad hook: queue its DDP's delayed allreduce, once per backward, and note the
    parameter while the DDP is finding out which ones its backwards reach. The DDP is held by a weak reference: the
    hook lives on the parameter, which the DDP holds, and a cycle would leave the DDP (its reducer and process
    group) to the garbage collector, possibly in interpreter finalization."""
    ddp = ddp_ref()
    if ddp is None or not ddp._reduce_after_backward:
        return
    ddp._accumulated_since_reduce.add(id(param))
    if ddp._reached_params is not None:
        ddp._reached_params.add(id(param))
    if not ddp._allreduce_queued:
        ddp._allreduce_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(ddp._allreduce_grads)


def _has_sparse_gradients(module: torch.nn.Module) -> bool:
    """Whether an embedding of ``module`` gives sparse gradients (torch's reducer's own test)."""
    return any(isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse for m in module.modules())


def _gradient_buckets(params: list[torch.nn.Parameter]) -> dict[tuple[torch.device, torch.dtype], list[Any]]:
    """``params`` (each with a gradient) by their gradients' (device, dtype), in Apex's dtype order. A sparse gradient
    is an error: the flat reduce takes dense ones only, as Apex's."""
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = defaultdict(list)
    for param in params:
        if param.grad.layout != torch.strided:
            raise RuntimeError(
                f"delay_allreduce=True (or retain_allreduce_buffers=True) reduces dense gradients only (as "
                f"Apex); a parameter of shape {tuple(param.shape)} has a {param.grad.layout} gradient: "
                f"use delay_allreduce=False"
            )
        buckets[(param.grad.device, param.grad.dtype)].append(param)
    return {key: buckets[key] for key in sorted(buckets, key=lambda key: _APEX_BUCKET_ORDER.get(key[1], 4))}


def _copy_into_grads(flat: torch.Tensor, params: list[torch.nn.Parameter]) -> None:
    """Copy ``flat`` (the gradients of ``params``, concatenated) back into their ``.grad`` tensors."""
    grads = [p.grad for p in params]
    synced = flat.split([g.numel() for g in grads])
    torch._foreach_copy_(grads, [s.view_as(g) for s, g in zip(synced, grads, strict=True)])


def _agree_across_ranks(params: list[torch.nn.Parameter], wanted: list[bool], group: Any) -> list[torch.nn.Parameter]:
    """The parameters some rank wants reduced, the same list on every rank; one that has no gradient here gets zeros,
    as torch's reducer counts an unused parameter's (a branch only some ranks' batches use, ERNIE's entities; a layer
    one rank's batch skips). Each rank flattening its own list, as Apex did, made the flat buffers differ: gloo
    aborts, NCCL hangs, and two of the same size are added into each other, so the ranks' weights drift apart. One
    small all-reduce of flags."""
    if not params:
        return []
    # sent without waiting (torch.tensor(..., device=cuda) waits for the GPU after its copy): one sync, the read below
    flags = torch.tensor(wanted, dtype=torch.int32).to(params[0].device, non_blocking=True)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    agreed = [param for param, some_rank_wants in zip(params, flags.tolist(), strict=True) if some_rank_wants]
    for param in agreed:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    return agreed


@contextlib.contextmanager
def _trainable_while_torch_wraps(module: torch.nn.Module) -> Iterator[None]:
    """Make a module none of whose parameters trains (a target network or a teacher, frozen whole) trainable while
    torch's constructor runs, which refuses it ("DistributedDataParallel is not needed when a module doesn't have any
    parameter that requires a gradient"); Apex's class took it, broadcast its parameters and ran its forwards. The
    parameters then count as frozen at construction (see ``_unfrozen_since_construction``)."""
    params = list(module.parameters())
    frozen_whole = bool(params) and not any(p.requires_grad for p in params)
    if frozen_whole:
        for param in params:
            param.requires_grad_(True)
    try:
        yield
    finally:
        if frozen_whole:
            for param in params:
                param.requires_grad_(False)


@functools.cache
def leave_the_group_at_exit() -> None:
    """Once a process: leave the default process group at exit, while Python still runs, where the program left it
    up (Apex's scripts never destroyed theirs).

    gloo's worker threads drop their last reference to a finished collective's tensors after the caller has moved
    on; a tensor Python made (a ``reduce_tensor`` of the loss to print) then needs the GIL to be freed. A script
    that exits right after such a collective starts the interpreter's shutdown first, the worker thread gets the
    GIL too late and is ended mid-release, and the process aborts after its output ("terminate called without an
    active exception", status 134, about one exit in four). After a clean run the ranks first wait for each other
    in a barrier, which releases the GIL until every earlier collective is done with (as ``fit()``'s teardown
    does); after an uncaught exception they do not, as a peer may be gone. The barrier ends when the collectives are
    done, not when gloo's threads have let go of them: a thread the scheduler left waiting (two loaded cores) may
    still hold one, so each rank then sleeps a moment, the GIL free, before Python shuts down."""
    uncaught: list[type[BaseException]] = []
    printing_hook = sys.excepthook

    def noting_uncaught(kind: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
        uncaught.append(kind)
        printing_hook(kind, value, traceback)

    sys.excepthook = noting_uncaught

    def leave() -> None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_backend() == "gloo" and not uncaught:
            with contextlib.suppress(RuntimeError):  # a peer that is gone: nothing left to wait for
                dist.barrier()
        let_gloo_threads_release()
        dist.destroy_process_group()

    atexit.register(leave)


def _broadcast_parameters(ddp: torch.nn.parallel.DistributedDataParallel) -> None:
    """torch DDP's construction-time sync without its buffers: every rank's trainable parameters checked to have
    rank 0's shapes (a clear error, not a hang), then rank 0's parameters broadcast, as Apex's constructor did."""
    from torch.distributed.utils import _sync_module_states, _verify_param_shape_across_processes

    _verify_param_shape_across_processes(ddp.process_group, [p for p in ddp._module_parameters if p.requires_grad])
    _sync_module_states(
        module=ddp.module,
        process_group=ddp.process_group,
        broadcast_bucket_size=ddp.broadcast_bucket_size,
        src=0,
        params_and_buffers_to_ignore=ddp.parameters_to_ignore,
        broadcast_buffers=False,
    )


def _warn_ignored_arguments(given: dict[str, Any]) -> None:
    ignored = sorted(name for name, value in given.items() if value != _NO_EFFECT_DEFAULTS[name])
    if ignored:
        warnings.warn(
            f"apex.parallel.DistributedDataParallel arguments {ignored} have no effect on torch's "
            "DistributedDataParallel, which schedules buckets and streams itself.",
            stacklevel=3,
        )


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """Apex's DDP constructor on torch's DDP; extra keyword arguments go to torch's constructor.

    Example:
        >>> model = DistributedDataParallel(model, delay_allreduce=True)  # doctest: +SKIP
    """

    def __init__(
        self,
        module: torch.nn.Module,
        message_size: int = 10_000_000,
        delay_allreduce: bool = False,
        shared_param: Any = None,
        allreduce_trigger_params: Any = None,
        retain_allreduce_buffers: bool = False,
        allreduce_always_fp32: bool = False,
        num_allreduce_streams: int = 1,
        allreduce_communicators: Any = None,
        gradient_average: bool = True,
        gradient_predivide_factor: float = 1.0,
        gradient_average_split_factor: float | None = None,
        prof: bool = False,
        **torch_ddp_kwargs: Any,
    ) -> None:
        leave_the_group_at_exit()
        if shared_param is not None:
            raise ValueError(
                "shared_param is no longer supported as an option (as in Apex); it was misleadingly named. "
                "Use delay_allreduce=True to overlap nothing, or the default to overlap allreduce with backward."
            )
        _warn_ignored_arguments(
            {
                "allreduce_trigger_params": allreduce_trigger_params,
                "num_allreduce_streams": num_allreduce_streams,
                "allreduce_communicators": allreduce_communicators,
                "prof": prof,
            }
        )
        if gradient_average_split_factor is not None:
            warnings.warn(
                "gradient_average_split_factor has been renamed to gradient_predivide_factor; "
                "using its value as gradient_predivide_factor.",
                stacklevel=2,
            )
            gradient_predivide_factor = gradient_average_split_factor
        if not (isinstance(message_size, numbers.Real) and 0 < message_size < math.inf):
            raise ValueError(f"message_size must be a positive number of elements, got {shown(message_size)}")
        if not (isinstance(gradient_predivide_factor, numbers.Real) and 0 < gradient_predivide_factor < math.inf):
            # every gradient is divided by it: NaN or inf slipped past a "<= 0" check into NaN or zero gradients
            raise ValueError(
                f"gradient_predivide_factor must be a finite number > 0, got {shown(gradient_predivide_factor)}"
            )
        # read by truthiness, gradient_average="False" averaged where the config asked for a sum
        owner = "DistributedDataParallel"
        delay_allreduce = checked_switch(owner, "delay_allreduce", delay_allreduce)
        gradient_average = checked_switch(owner, "gradient_average", gradient_average)
        allreduce_always_fp32 = checked_switch(owner, "allreduce_always_fp32", allreduce_always_fp32)
        retain_allreduce_buffers = checked_switch(owner, "retain_allreduce_buffers", retain_allreduce_buffers)
        torch_ddp_kwargs.setdefault("bucket_cap_mb", message_size * _FP32_BYTES / 2**20)
        # A module with no parameter at all (a normalizer of buffers, a resize): torch's constructor refuses it, Apex's
        # broadcast and reduced nothing and ran its forwards. Nothing of torch's DDP has anything to do for it.
        self._parameterless = next(module.parameters(), None) is None
        if self._parameterless:
            self._wrap_without_torch(module, torch_ddp_kwargs)
        else:
            self._wrap_with_torch(module, torch_ddp_kwargs)
        # Apex's attributes, which scripts and subclasses read.
        self.delay_allreduce = delay_allreduce
        self.message_size = message_size
        self.gradient_average = gradient_average
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.allreduce_always_fp32 = allreduce_always_fp32
        self.retain_allreduce_buffers = retain_allreduce_buffers
        if retain_allreduce_buffers:
            self.allreduce_buffers: list[torch.Tensor] = []  # filled by each backward (Apex's attribute)
        self.num_allreduce_streams = num_allreduce_streams
        self.allreduce_different_streams = num_allreduce_streams > 1
        self.allreduce_communicators = allreduce_communicators
        self.custom_allreduce_triggers = allreduce_trigger_params is not None
        self.prof = prof
        self.world_size = float(dist.get_world_size(self.process_group))
        self._disable_allreduce = False
        self._reduce_options = _ApexReduceOptions(
            process_group=torch_ddp_kwargs.get("process_group"),
            average=gradient_average,
            predivide_factor=float(gradient_predivide_factor),
            always_fp32=allreduce_always_fp32,
        )
        self._allreduce_queued = False
        self._reduced_since_forward: set[int] = set()  # ids of the gradients summed since the forward (no average)
        self._accumulated_since_reduce: set[int] = set()  # ids of the gradients a backward added to since the reduce
        self._reduce_after_backward = False  # set by each forward with grad enabled; read by the parameters' hooks
        self._hooked_params: dict[int, Any] = {}  # id(param) -> the handle of its hook; see _hook_trainable_params
        self._warned_disable_under_amp = False
        # torch's reducer holds the parameters trainable now; see _unfrozen_since_construction.
        self._frozen_at_construction = [p for p in self.module.parameters() if not p.requires_grad]
        # ... and wants a gradient for each of them at every synced backward: whether it gets them is found out by
        # the first synced forward's backwards, which reduce at their end meanwhile (_decide_whether_reducer_overlaps).
        self._reducer_params = [p for p in self._module_parameters if p.requires_grad]
        torch_decides = (
            torch_ddp_kwargs.get("find_unused_parameters")
            or torch_ddp_kwargs.get("static_graph")
            or delay_allreduce
            or retain_allreduce_buffers
            or _has_sparse_gradients(self.module)  # the end-of-backward reduce takes dense gradients only
        )
        self._reducer_overlaps: bool | None = True if torch_decides else None
        if not self._reducer_params:  # a frozen module (a target network): torch's reducer never runs for it
            self._reducer_overlaps = False
        self._reached_params: set[int] | None = None  # filled by the parameters' hooks while _reducer_overlaps is None
        # a script's allreduce_bucket (a subclass's method, or a function set on the instance, also after this)
        # reduces each bucket, as Apex called it: looked up at each bucket, its arity kept per function
        self._allreduce_bucket_arity: tuple[Any, int] | None = None
        self._bucket_hook_registered = False
        if self._scripts_allreduce_bucket() is not None or not self._reduce_options.is_torch_default:
            self._register_bucket_hook()

    def _register_bucket_hook(self) -> None:
        """Reduce torch's buckets through :func:`_bucket_hook` from now on (once; not where no reducer overlaps)."""
        if not (self.delay_allreduce or self._parameterless or self._bucket_hook_registered):
            self.register_comm_hook(weakref.ref(self), _bucket_hook)
            self._bucket_hook_registered = True

    @property
    def allreduce_bucket(self) -> Any:
        """A function set on the instance (``ddp.allreduce_bucket = fn``, Apex's ``(bucket, bucket_idx,
        force_default_stream)`` or ``(bucket)``) reduces each bucket from then on, as Apex looked it up at each call;
        none set, there is none (ampkit's class reduces by itself)."""
        try:
            return self.__dict__["_assigned_allreduce_bucket"]
        except KeyError:
            raise AttributeError("allreduce_bucket") from None

    @allreduce_bucket.setter
    def allreduce_bucket(self, function: Any) -> None:
        self.__dict__["_assigned_allreduce_bucket"] = function
        self._register_bucket_hook()

    @allreduce_bucket.deleter
    def allreduce_bucket(self) -> None:
        self.__dict__.pop("_assigned_allreduce_bucket", None)

    def _scripts_allreduce_bucket(self) -> Any:
        """The script's ``allreduce_bucket`` now: a function set on the instance (a subclass's instance too), else a
        subclass's method; None where it has neither. A few dictionary lookups, read at each bucket."""
        assigned = self.__dict__.get("_assigned_allreduce_bucket", self.__dict__.get("allreduce_bucket"))
        if assigned is not None:
            return assigned
        if type(self).allreduce_bucket is not DistributedDataParallel.allreduce_bucket:
            return self.allreduce_bucket
        return None

    def _call_allreduce_bucket(
        self, allreduce_bucket: Any, grads: list[torch.Tensor], bucket_idx: int, force_default_stream: bool
    ) -> torch.Tensor | None:
        """The script's ``allreduce_bucket`` on one bucket of gradients, with the arguments its signature takes (read
        once per function)."""
        function = getattr(allreduce_bucket, "__func__", allreduce_bucket)
        known = self._allreduce_bucket_arity
        if known is None or known[0] is not function:
            known = self._allreduce_bucket_arity = (function, _allreduce_bucket_arity(allreduce_bucket))
        if known[1] == 1:
            return allreduce_bucket(grads)
        return allreduce_bucket(grads, bucket_idx, force_default_stream)

    def _wrap_with_torch(self, module: torch.nn.Module, torch_ddp_kwargs: dict[str, Any]) -> None:
        """torch's constructor on ``module`` (one frozen whole made trainable while it runs)."""
        with _trainable_while_torch_wraps(module):
            if "broadcast_buffers" in torch_ddp_kwargs or "forward_sync_buffers" in torch_ddp_kwargs:
                super().__init__(module, **torch_ddp_kwargs)
            else:
                # Apex broadcast rank 0's parameters at construction and never a buffer. torch >= 2.13 deprecates its
                # one switch for that (``broadcast_buffers=False``, with a warning a caller could only hide by
                # swapping the process's warning filters, which another thread's run shares), and
                # ``forward_sync_buffers=False`` still broadcasts buffers at construction: so torch's
                # construction-time sync is off, and ours sends the parameters alone.
                init_sync = torch_ddp_kwargs.pop("init_sync", True)
                super().__init__(module, forward_sync_buffers=False, init_sync=False, **torch_ddp_kwargs)
                if init_sync:
                    _broadcast_parameters(self)

    def _wrap_without_torch(self, module: torch.nn.Module, torch_ddp_kwargs: dict[str, Any]) -> None:
        """Hold ``module``, which has no parameter, as Apex's class did: no broadcast, no reducer; :meth:`forward`
        runs it. torch's keyword arguments are still checked against its constructor's, so a misspelt one is an
        error, not dropped."""
        inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).bind(self, module, **torch_ddp_kwargs)
        torch.nn.Module.__init__(self)
        self.module = module
        self.process_group = torch_ddp_kwargs.get("process_group") or dist.distributed_c10d._get_default_group()
        self._module_parameters: list[torch.nn.Parameter] = []
        self.require_backward_grad_sync = False  # nothing to reduce

    @property
    def no_sync(self) -> Any:
        """Apex's DDP had no ``no_sync``; hiding torch's makes ``hasattr(model, "no_sync")`` False, so clients
        that use it when present (timm) all-reduce every micro-batch, as they did under Apex."""
        raise AttributeError(
            "apex.parallel.DistributedDataParallel has no no_sync(); use disable_allreduce()/enable_allreduce()"
        )

    def disable_allreduce(self) -> None:
        """Apex's switch for gradient accumulation: the following backward passes keep their gradients local
        until :meth:`enable_allreduce` (read at each forward)."""
        self._disable_allreduce = True

    def enable_allreduce(self) -> None:
        """All-reduce gradients again from the next forward on (see :meth:`disable_allreduce`)."""
        self._disable_allreduce = False

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module; this forward's backward all-reduces unless :meth:`disable_allreduce` is in effect."""
        if self._parameterless:  # no gradient to reduce, as under Apex
            return self.module(*inputs, **kwargs)
        if self._reached_params is not None and torch.is_grad_enabled():
            self._decide_whether_reducer_overlaps()
        reduce = not self._disable_allreduce or self._stash_needs_every_backward_reduced()
        delayed = (
            self.delay_allreduce
            or self.retain_allreduce_buffers
            or self._unfrozen_since_construction()
            or not self._reducer_overlaps  # not known before the first synced backward, or a parameter went unused
        )
        # Delayed, torch's reducer stays idle: the end-of-backward callback reduces instead.
        self.require_backward_grad_sync = reduce and not delayed
        output = super().forward(*inputs, **kwargs)
        if torch.is_grad_enabled():  # a no-grad forward (validation) leaves the pending backward's reduce as it was
            self._allreduce_queued = False  # a backward that failed before its reduce ran leaves it set
            self._reduced_since_forward.clear()
            self._accumulated_since_reduce.clear()
            self._reduce_after_backward = reduce and delayed
            if self._reduce_after_backward:
                if self._reducer_overlaps is None:
                    self._reached_params = set()
                self._hook_trainable_params()
        return output

    def _hook_trainable_params(self) -> None:
        """Give each trainable parameter a hook that queues :meth:`_allreduce_grads` once its gradient is accumulated,
        as Apex queued its delayed reduce from the gradient accumulators' hooks. Hooks on the forward's output would
        miss an output of the model's own class, which no search sees into, and leave the gradients rank-local."""
        hook = functools.partial(_queue_end_of_backward_reduce, weakref.ref(self))
        for param in self.module.parameters():
            if param.requires_grad and id(param) not in self._hooked_params:
                self._hooked_params[id(param)] = param.register_post_accumulate_grad_hook(hook)

    def _unfrozen_since_construction(self) -> bool:
        """Whether a parameter frozen at construction trains now (a layer unfrozen for fine-tuning). torch's reducer
        cannot take it in, and left alone its gradient would stay rank-local and the ranks drift apart; Apex rebuilt
        its buckets at such a forward. Such backwards reduce every gradient at their end, as ``delay_allreduce``."""
        return any_requires_grad(self._frozen_at_construction)

    def _stash_needs_every_backward_reduced(self) -> bool:
        if not _amp_state.gradients_leave_params:
            return False
        if not self._warned_disable_under_amp:
            self._warned_disable_under_amp = True
            warnings.warn(
                "disable_allreduce() under amp: amp.scale_loss takes each backward's gradients out of .grad, so "
                "the synced backward would average only its own micro-batch and the ranks would drift apart; "
                "every micro-batch is all-reduced instead.",
                stacklevel=3,
            )
        return True

    @torch.no_grad()
    def _allreduce_grads(self) -> None:
        """Apex's delayed allreduce: the gradients the ranks agree to reduce (:meth:`_agree_gradients_to_reduce`),
        one flat all-reduce per (device, dtype), in Apex's dtype order. Retaining, the buffers are then rebuilt over
        every gradient (see :meth:`_retain_buffers`)."""
        self._allreduce_queued = False
        group, world_size = _group_and_size(self._reduce_options)
        reduced_buckets: dict[tuple[torch.device, torch.dtype], tuple[list[torch.nn.Parameter], torch.Tensor]] = {}
        for index, (key, params) in enumerate(_gradient_buckets(self._agree_gradients_to_reduce()).items()):
            allreduce_bucket = self._scripts_allreduce_bucket()
            if allreduce_bucket is not None:  # the script's, as Apex's allreduce_fallback called it
                grads = [p.grad for p in params]
                returned = self._call_allreduce_bucket(allreduce_bucket, grads, index, True)
                reduced = torch.cat([g.reshape(-1) for g in grads]) if returned is None else returned.reshape(-1)
                if reduced.dtype != key[1]:
                    reduced = reduced.to(key[1])
            else:
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                reduced = _before_allreduce(self._reduce_options, flat)
                dist.all_reduce(reduced, group=group)
                reduced = _after_allreduce(self._reduce_options, reduced, world_size).to(flat.dtype)
            if self.retain_allreduce_buffers:
                reduced_buckets[key] = (params, reduced)  # the gradients become views of it: no copy back
            else:
                _copy_into_grads(reduced, params)  # the same tensors, as Apex: whoever holds one sees it reduced
        if self.retain_allreduce_buffers:
            self._retain_buffers(reduced_buckets)

    def _agree_gradients_to_reduce(self) -> list[torch.nn.Parameter]:
        """The trainable parameters whose gradients this end-of-backward reduce takes, the same on every rank.

        Averaging, every gradient some rank has (averaging again what was averaged before changes nothing). Summing,
        those a backward added to since the last reduce and not summed yet in this forward: summed again, a gradient
        would count once per rank, and a zeroed one summed at a reentrant checkpoint's inner backward would miss what
        the outer one adds. A gradient another rank takes and this one lacks is counted as zeros here (see
        :func:`_agree_across_ranks`)."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        if self._reduce_options.average:
            wanted = [p.grad is not None for p in params]
        else:
            new, summed = self._accumulated_since_reduce, self._reduced_since_forward
            wanted = [p.grad is not None and id(p) in new and id(p) not in summed for p in params]
        self._accumulated_since_reduce = set()
        group, _ = _group_and_size(self._reduce_options)
        agreed = _agree_across_ranks(params, wanted, group)
        if not self._reduce_options.average:
            self._reduced_since_forward.update(id(p) for p in agreed)
        return agreed

    def _retain_buffers(
        self, reduced_buckets: dict[tuple[torch.device, torch.dtype], tuple[list[torch.nn.Parameter], torch.Tensor]]
    ) -> None:
        """Keep one flat buffer per bucket in ``allreduce_buffers``, each gradient a view of it, as Apex left them for
        a flat step (a step on the buffer is a step on every gradient). Every gradient is in them, also one a sum
        reduced at an earlier backward of this forward (a reentrant checkpoint's inner one) and left out of this
        one's reduce; a bucket reduced whole is kept as it is, with no second copy."""
        buckets = _gradient_buckets([p for p in self.module.parameters() if p.grad is not None])
        if not buckets:
            return
        buffers = []
        for key, params in buckets.items():
            reduced_params, buffer = reduced_buckets.get(key, ([], None))
            if buffer is not None and [id(p) for p in reduced_params] != [id(p) for p in params]:
                _copy_into_grads(buffer, reduced_params)  # part of the bucket: the rest was summed before
                buffer = None
            if buffer is None:
                buffer = torch.cat([p.grad.reshape(-1) for p in params])
            views = buffer.split([p.grad.numel() for p in params])
            for param, view in zip(params, views, strict=True):
                param.grad.data = view.view_as(param.grad)
            buffers.append(buffer)
        self.allreduce_buffers = buffers
        # Apex's bucket structure, which scripts read to build flat masters matching the buffers (MLPerf SSD)
        self.active_params = [p for params in buckets.values() for p in params]
        starts = [0, *itertools.accumulate(len(params) for params in buckets.values())]
        self.active_i_buckets = [list(range(a, b)) for a, b in itertools.pairwise(starts)]

    def _decide_whether_reducer_overlaps(self) -> None:
        """At the forward after the default mode's first synced one: torch's reducer overlaps the allreduce from now
        on if the backwards in between reached every parameter it holds, on every rank (two flags all-reduced, so
        that the ranks go on alike); otherwise every backward reduces at its end, as those did. No backward on any
        rank (a loss skipped) leaves it to the next synced forward's."""
        reached, self._reached_params = self._reached_params, None
        missed = any(id(p) not in reached for p in self._reducer_params)
        flags = torch.tensor([float(missed), float(bool(reached))], device=self._reducer_params[0].device)
        group, _ = _group_and_size(self._reduce_options)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        missed_on_a_rank, reached_on_a_rank = flags.tolist()
        if not reached_on_a_rank:
            return
        self._reducer_overlaps = not missed_on_a_rank
        if self._reducer_overlaps:  # no per-parameter call in the backwards torch's reducer serves
            for handle in self._hooked_params.values():
                handle.remove()
            self._hooked_params.clear()


class Reducer:
    """Apex's manual gradient allreduce: ``reducer.reduce()`` averages grads across ranks when called.

    Args:
        module_or_grads_list: a module (its parameters are broadcast from rank 0 now, its buffers left alone,
            and its parameters' grads are reduced) or gradient tensors in a (possibly nested) list, tuple or generator.
    """

    def __init__(self, module_or_grads_list: torch.nn.Module | Iterable[Any]) -> None:
        if isinstance(module_or_grads_list, torch.nn.Module):
            self.module: torch.nn.Module | None = module_or_grads_list
            self.grads: list[torch.Tensor] | None = None
            # parameters only, as Apex: buffers stay rank-local
            flat_dist_call([param.detach() for param in self.module.parameters()], dist.broadcast, (0,))
        else:
            self.module = None
            # as Apex: the tensors found in any nesting of lists, tuples or generators; a None (a parameter that has
            # no grad yet) is skipped, where list() kept it for reduce() to fail on
            self.grads = []
            extract_tensors(module_or_grads_list, self.grads)

    def reduce(self) -> None:
        """Average the gradients over all ranks, in place (one flat allreduce per tensor type, as Apex). On a module,
        a gradient only some ranks have is averaged with zeros from the others (Apex reduced each rank's own list)."""
        if self.module is not None:
            params = list(self.module.parameters())
            agreed = _agree_across_ranks(params, [p.grad is not None for p in params], dist.group.WORLD)
            grads = [p.grad for p in agreed]
        else:
            grads = self.grads or []
        flat_dist_call(grads, dist.all_reduce)  # one flat allreduce per type, averaged
