"""``apex.parallel.DistributedDataParallel`` mapped onto ``torch.nn.parallel.DistributedDataParallel``.

Apex argument → effect here:

- ``message_size`` (elements) → ``bucket_cap_mb = message_size * 4 bytes`` (Apex sized buckets in fp32 elements).
- ``delay_allreduce=True`` → one bucket holding every gradient, so the allreduce starts once backward has
  produced all of them (Apex's "allreduce at the end of backward").
- ``gradient_average``, ``gradient_predivide_factor``, ``allreduce_always_fp32`` → a DDP communication hook
  that divides by the predivide factor before the allreduce and, when averaging, multiplies by
  ``predivide / world_size`` after it; with ``gradient_average=False`` the result stays ``sum / predivide``, as
  in Apex. It reduces in fp32 when asked. Without these options, torch's default hook runs.
- Buffers (e.g. BatchNorm running statistics) stay rank-local: Apex broadcast only the parameters, once, at
  construction, so torch's buffer broadcast is off unless ``broadcast_buffers``/``forward_sync_buffers`` is given.
- ``gradient_average_split_factor`` → Apex's deprecated alias of ``gradient_predivide_factor`` (warns).
- ``shared_param`` → rejected, as in Apex.
- ``allreduce_trigger_params``, ``retain_allreduce_buffers``, ``num_allreduce_streams``,
  ``allreduce_communicators``, ``prof`` → no effect (torch's reducer schedules buckets and streams itself);
  a non-default value warns once.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_FP32_BYTES = 4
_NO_EFFECT_DEFAULTS = {
    "allreduce_trigger_params": None,
    "retain_allreduce_buffers": False,
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


def _apex_allreduce_hook(options, bucket):  # unannotated: DDP rejects string annotations of comm hooks
    """Allreduce one ``dist.GradBucket`` the way Apex did: optional fp32 reduction, predivide, then average
    (or leave ``sum / predivide`` without averaging); returns a future of the reduced bucket."""
    group = options.process_group if options.process_group is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)
    buffer = bucket.buffer()
    reduced = buffer.float() if options.always_fp32 and buffer.dtype != torch.float32 else buffer
    if options.predivide_factor != 1.0:
        reduced.div_(options.predivide_factor)
    future = dist.all_reduce(reduced, group=group, async_op=True).get_future()

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        result = fut.value()[0]
        if options.average:
            result.mul_(options.predivide_factor / world_size)
        return result.to(buffer.dtype)

    return future.then(finish)


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
        if shared_param is not None:
            raise ValueError(
                "shared_param is no longer supported as an option (as in Apex); it was misleadingly named. "
                "Use delay_allreduce=True to overlap nothing, or the default to overlap allreduce with backward."
            )
        given = {
            "allreduce_trigger_params": allreduce_trigger_params,
            "retain_allreduce_buffers": retain_allreduce_buffers,
            "num_allreduce_streams": num_allreduce_streams,
            "allreduce_communicators": allreduce_communicators,
            "prof": prof,
        }
        ignored = sorted(name for name, value in given.items() if value != _NO_EFFECT_DEFAULTS[name])
        if ignored:
            warnings.warn(
                f"apex.parallel.DistributedDataParallel arguments {ignored} have no effect on torch's "
                "DistributedDataParallel, which schedules buckets and streams itself.",
                stacklevel=2,
            )
        if gradient_average_split_factor is not None:
            warnings.warn(
                "gradient_average_split_factor has been renamed to gradient_predivide_factor; "
                "using its value as gradient_predivide_factor.",
                stacklevel=2,
            )
            gradient_predivide_factor = gradient_average_split_factor
        if message_size <= 0:
            raise ValueError(f"message_size must be a positive number of elements, got {message_size}")
        if gradient_predivide_factor <= 0:
            raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor}")
        if delay_allreduce:
            total = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
            bucket_cap_mb = max(total, 1) / 2**20 + 1.0
            # Apex reduced whichever gradients existed at the end of backward: a parameter the forward did not
            # use is no error there.
            torch_ddp_kwargs.setdefault("find_unused_parameters", True)
        else:
            bucket_cap_mb = message_size * _FP32_BYTES / 2**20
        torch_ddp_kwargs.setdefault("bucket_cap_mb", bucket_cap_mb)
        if "broadcast_buffers" in torch_ddp_kwargs or "forward_sync_buffers" in torch_ddp_kwargs:
            super().__init__(module, **torch_ddp_kwargs)
        else:
            # Apex broadcast parameters only; ``broadcast_buffers=False`` is torch's one switch that also keeps
            # buffers out of the construction-time sync (``forward_sync_buffers=False`` does not), so use it and
            # hide torch >= 2.13's deprecation warning, which the user cannot act on.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
                super().__init__(module, broadcast_buffers=False, **torch_ddp_kwargs)
        self.delay_allreduce = delay_allreduce
        self.message_size = message_size
        self.gradient_average = gradient_average
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.allreduce_always_fp32 = allreduce_always_fp32
        if allreduce_always_fp32 or not gradient_average or gradient_predivide_factor != 1.0:
            options = _ApexReduceOptions(
                process_group=torch_ddp_kwargs.get("process_group"),
                average=gradient_average,
                predivide_factor=float(gradient_predivide_factor),
                always_fp32=allreduce_always_fp32,
            )
            self.register_comm_hook(options, _apex_allreduce_hook)

    def disable_allreduce(self) -> None:
        """Apex's switch for gradient accumulation: the following backward passes keep their gradients local
        (torch's ``no_sync``, read at each forward) until :meth:`enable_allreduce`."""
        self.require_backward_grad_sync = False

    def enable_allreduce(self) -> None:
        """Allreduce gradients again from the next forward on (see :meth:`disable_allreduce`)."""
        self.require_backward_grad_sync = True


class Reducer:
    """Apex's manual gradient allreduce: ``reducer.reduce()`` averages grads across ranks when called.

    Args:
        module_or_grads_list: a module (its parameters are broadcast from rank 0 now, its buffers left alone,
            and its parameters' grads are reduced) or a list of gradient tensors.
    """

    def __init__(self, module_or_grads_list: torch.nn.Module | list[torch.Tensor]) -> None:
        if isinstance(module_or_grads_list, torch.nn.Module):
            self.module: torch.nn.Module | None = module_or_grads_list
            self.grads: list[torch.Tensor] | None = None
            for param in self.module.parameters():  # parameters only, as Apex: buffers stay rank-local
                dist.broadcast(param.detach(), 0)
        else:
            self.module = None
            self.grads = list(module_or_grads_list)

    def reduce(self) -> None:
        """Average the gradients over all ranks, in place."""
        if self.module is not None:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        else:
            grads = self.grads or []
        world_size = dist.get_world_size()
        for grad in grads:
            dist.all_reduce(grad)
            grad.div_(world_size)
