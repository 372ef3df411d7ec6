"""Keep ranks in lock-step: DDP or step-time gradient averaging, rank-agreed overflow flags, SyncBatchNorm.

Every skip decision and loss-scale update must be identical on all ranks, or the next collective hangs.
Per-loss and per-optimizer ``found_inf`` flags are therefore all-reduced (MAX) right before each optimizer
step, so an inf that appears on one rank only makes every rank skip the same optimizer.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ampkit.ops.sync_batchnorm import convert_sync_batchnorm
from ampkit.trainer.callback import Callback
from ampkit.trainer.distributed import DistributedError, is_communication_failure


class DistributedSync(Callback):
    """Synchronises gradients and overflow decisions across ranks (only present when world size > 1).

    ``grad_sync="ddp"`` wraps the model in ``DistributedDataParallel`` (gradients averaged during backward,
    ``require_backward_grad_sync`` off for all but the last micro-batch of an accumulation window — set before
    the forward, as DDP reads it there). ``grad_sync="step"`` averages an optimizer's gradients right before
    its step: it works for any number of forwards and backwards per step (a GAN's D and G passes, backward
    restricted to one optimizer's parameters), which DDP's one-forward-one-backward reducer does not.
    ``grad_sync="fsdp"``: the model is sharded and FSDP reduce-scatters gradients; only the flags are agreed.
    """

    before = ("GradientClipping",)

    def __init__(self, grad_sync: str = "ddp", ddp_kwargs: dict[str, Any] | None = None,
                 sync_batchnorm: bool = False, failure_wait_s: float = 5.0) -> None:  # fmt: skip
        if grad_sync not in ("ddp", "step", "fsdp"):
            raise ValueError(f"DistributedSync: grad_sync must be 'ddp', 'step' or 'fsdp', got {grad_sync!r}")
        self.grad_sync = grad_sync
        self.ddp_kwargs = dict(ddp_kwargs or {})
        self.sync_batchnorm = sync_batchnorm
        self.failure_wait_s = failure_wait_s
        self._ddp: torch.nn.parallel.DistributedDataParallel | None = None
        self._unwrapped: Any = None  # trainer.model before DDP wrapped it, handed back at fit end
        self._synced: set[Any] = set()

    # ---------------------------------------------------------------- set-up
    def on_fit_start(self, trainer) -> None:
        if self.sync_batchnorm:
            trainer.module = convert_sync_batchnorm(trainer.module)
            trainer.model = trainer.module
        if self.grad_sync == "ddp":
            self._unwrapped = trainer.model
            device_ids = [trainer.device.index] if trainer.device.type == "cuda" else None
            self._ddp = torch.nn.parallel.DistributedDataParallel(
                trainer.module, device_ids=device_ids, **self.ddp_kwargs
            )
            trainer.model = torch.compile(self._ddp) if trainer.cfg.trainer.compile else self._ddp
        elif self.grad_sync == "step":
            with torch.no_grad():  # an in-place collective on a parameter must not enter the autograd graph
                for tensor in [*trainer.module.parameters(), *trainer.module.buffers()]:
                    self._collective("broadcast of initial weights", dist.broadcast, tensor, 0)

    def on_fit_end(self, trainer) -> None:
        if self._ddp is not None:  # drop DDP's hold on the process group before it is destroyed
            trainer.model, self._unwrapped, self._ddp = self._unwrapped, None, None

    # ---------------------------------------------------------------- per batch / step
    def on_train_batch_start(self, trainer, batch: Any) -> None:
        if trainer.state.is_iteration_start:
            self._synced = set()
        if self._ddp is not None:
            self._ddp.require_backward_grad_sync = trainer.state.is_iteration_end

    def on_before_optimizer_step(self, trainer, optimizer: torch.optim.Optimizer) -> None:
        opt_state = trainer.optimizer_state[optimizer]
        loss_ids = sorted(trainer.loss_state, key=str)
        flags = [float(trainer.loss_state[k].found_inf) for k in loss_ids] + [float(opt_state.found_inf)]
        agreed = self._all_reduce_max(flags, trainer)
        for key, flag in zip(loss_ids, agreed, strict=False):
            trainer.loss_state[key].found_inf = bool(flag)
        self._synced.update(loss_ids)
        opt_state.found_inf = bool(agreed[-1]) or any(trainer.loss_state[k].found_inf for k in opt_state.loss_ids)
        if self.grad_sync == "step" and not opt_state.found_inf:
            self._average_grads(optimizer, trainer)
            opt_state.grad_norm = None  # a norm cached before averaging is stale

    def on_train_batch_end(self, trainer, outputs: dict[str, Any], batch: Any) -> None:
        unsynced = sorted((k for k in trainer.loss_state if k not in self._synced), key=str)
        if trainer.state.is_iteration_end and unsynced:  # losses no stepped optimizer saw: agree before updates
            agreed = self._all_reduce_max([float(trainer.loss_state[k].found_inf) for k in unsynced], trainer)
            for key, flag in zip(unsynced, agreed, strict=True):
                trainer.loss_state[key].found_inf = bool(flag)

    # ---------------------------------------------------------------- collectives
    def _all_reduce_max(self, values: list[float], trainer) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float32, device=self._comm_device(trainer))
        self._collective("all-reduce of overflow flags", dist.all_reduce, tensor, dist.ReduceOp.MAX)
        return tensor.cpu().tolist()

    def _average_grads(self, optimizer: torch.optim.Optimizer, trainer) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        world = dist.get_world_size()
        for grads in by_dtype.values():
            flat = _flatten_dense_tensors(grads)
            self._collective("gradient all-reduce", dist.all_reduce, flat)
            flat.div_(world)
            for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                grad.copy_(synced)

    @staticmethod
    def _comm_device(trainer) -> torch.device:
        return trainer.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def on_exception(self, trainer, exception: BaseException) -> None:
        if isinstance(exception, DistributedError) or not is_communication_failure(exception):
            return
        raise self._diagnose("a collective during training", exception) from exception

    def _collective(self, what: str, fn, *args) -> None:
        try:
            fn(*args)
        except RuntimeError as exc:
            if not is_communication_failure(exc):
                raise
            raise self._diagnose(what, exc) from exc

    def _diagnose(self, what: str, exc: BaseException) -> DistributedError:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        message = f"rank {dist.get_rank()}: {what} failed: {self._missing_ranks()} ({type(exc).__name__}: {first_line})"
        return DistributedError(message)

    def _missing_ranks(self) -> str:
        """After a failed collective, survivors check in through the rendezvous store; absentees are named."""
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set_timeout(timedelta(seconds=self.failure_wait_s))
            me, world = dist.get_rank(), dist.get_world_size()
            store.set(f"ampkit/alive/{me}", "1")
            deadline = time.monotonic() + self.failure_wait_s
            missing = [r for r in range(world) if r != me]
            while missing and time.monotonic() < deadline:
                missing = [r for r in missing if not store.check([f"ampkit/alive/{r}"])]
                time.sleep(0.05)
        except Exception:  # the store itself is gone: it lives with rank 0 or the launcher
            return "the rendezvous store is unreachable, so rank 0 or the launcher died"
        if not missing:
            return "all ranks are alive; a collective timed out or the ranks diverged"
        return f"rank(s) {', '.join(map(str, missing))} died or stopped responding"
