"""Skip verdicts that stay on the device: an overflow or a non-finite gradient norm skips the step unread.

Without a loss scaler (bf16, fp32) the only per-step host read of a clipped run was the gradient norm's
finiteness: clipping must not let an inf/nan norm reach the step. On a GPU that read stalls the CPU until the
GPU has finished the backward, and the GPU then idles while Python prepares the next step (on an H100 the
GPT-2-small bf16 step ran at 0.89x a hand loop that reads nothing). An optimizer that honours GradScaler's
``found_inf`` (torch's fused Adam/AdamW/Adagrad, torch's fused SGD without momentum, ampkit's fused optimizers)
can take the flag instead and skip on the device: parameters, state and step counts stay as they were. In one
process whose optimizers all take it, the loss scalers' found_inf flags stay there too (``Trainer.
facts_on_device``): each loss's flags go to the steps it reached, and its scaler updates on the device.

The host learns such a verdict later, when the Trainer *settles* it: at the next iteration (by then the GPU has
long finished that step, so the read waits for nothing), or before validation, an epoch's end and a
checkpoint. Until then the step counts as taken; a settled skip moves it to ``skipped_steps`` and fires
``on_optimizer_step_skipped``, and the LR schedulers of that iteration step only once it is settled (before
the next optimizer step, which is the first to use their learning rate).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ampkit.ops.optimizers import FusedOptimizer
from ampkit.wording import shown

MODES = ("auto", "host", "device")


def uses_device_verdicts(mode: str, device: torch.device, sharded: bool) -> bool:
    """``trainer.skip_verdict`` resolved: ``auto`` keeps verdicts on the device on CUDA only (a host read is free
    on a CPU, and the verdict is then known at once). Sharded runs (FSDP) always read on the host."""
    if mode not in MODES:
        raise ValueError(f"trainer.skip_verdict must be one of {', '.join(MODES)}; got {shown(mode)}")
    if sharded or mode == "host":
        return False
    return mode == "device" or device.type == "cuda"


def takes_device_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` honours a ``found_inf`` tensor (GradScaler's attribute) without reading it on
    the host, leaving parameters, state and step counts untouched when it is set, with every parameter on one
    device (torch's fused ops take one flag per device).

    torch's ``SGD(fused=True)`` with momentum is left out: a skipped first step leaves its momentum buffers
    uninitialised (they come from ``empty_like`` and the next step treats them as set)."""
    devices = {p.device for group in optimizer.param_groups for p in group["params"]}
    if len(devices) != 1:
        return False
    if isinstance(optimizer, FusedOptimizer):
        return True
    if not optimizer.defaults.get("fused"):
        return False
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad):
        return True
    return type(optimizer) is torch.optim.SGD and all(group.get("momentum", 0) == 0 for group in optimizer.param_groups)


def nonfinite_flag(norm: torch.Tensor) -> torch.Tensor:
    """A 0-dim float32 flag on ``norm``'s device: 1 where the norm is inf/nan (GradScaler's ``found_inf`` form)."""
    return torch.logical_not(torch.isfinite(norm)).to(torch.float32).reshape(())


def step_with_found_inf(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, step) -> None:
    """Run ``step(optimizer)`` with ``found_inf`` set as GradScaler sets it (``grad_scale`` None: the gradients
    are already unscaled), then take the attributes off again."""
    if found_inf.untyped_storage().nbytes() > found_inf.element_size():
        # GradScaler's flag holds its memory alone; the ranks' agreed flags view one all-reduce buffer, and a view
        # made a fused optimizer look for it among every parameter, gradient and state tensor (ms a step)
        found_inf = found_inf.clone()
    optimizer.grad_scale, optimizer.found_inf = None, found_inf
    try:
        step(optimizer)
    finally:
        del optimizer.grad_scale, optimizer.found_inf


@dataclass(slots=True)
class UnsettledFlag:
    """A device flag (non-zero: inf/nan) whose value the host has not read yet: a step's verdict, or the
    overflow flag a loss scaler was updated with on the device."""

    iteration: int
    flag: torch.Tensor  # on the host: pinned and filled asynchronously on CUDA; a copy on a CPU
    done: torch.cuda.Event | None  # recorded after the copy; None on a CPU

    @staticmethod
    def copy(found_inf: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if found_inf.device.type != "cuda":
            return found_inf.detach().reshape(()).clone(), None
        host = torch.empty((), dtype=torch.float32, pin_memory=True)
        host.copy_(found_inf.reshape(()), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    def is_set(self) -> bool:
        """Read the flag: waits only for its own copy, not for work queued after it."""
        if self.done is not None:
            self.done.synchronize()
        return bool(self.flag.item() != 0)


@dataclass(slots=True)
class UnsettledStep(UnsettledFlag):
    """A step taken with a device-side verdict."""

    optimizer: torch.optim.Optimizer = None  # type: ignore[assignment]
    loss_ids: list = field(default_factory=list)  # the losses that reached it


@dataclass(slots=True)
class UnsettledLoss(UnsettledFlag):
    """A loss whose scaler was updated on the device with this flag."""

    loss_id: Any = None


@dataclass(slots=True)
class UnsettledStopAsk(UnsettledFlag):
    """The ranks' agreed stop ask (a SIGTERM or ``state.should_stop`` on any rank), carried in the all-reduce of an
    iteration's facts on the device."""


class DeviceVerdicts:
    """The steps and scaler updates whose verdicts are still on the device, and the schedulers waiting for them."""

    def __init__(self) -> None:
        self.unsettled: list[UnsettledFlag] = []
        self.waiting_schedules: list[tuple[int, dict[torch.optim.Optimizer, bool]]] = []  # (iteration, stepped)
        self.stop_asked = False  # a settled stop ask: the Trainer agrees the stop on the host, then clears it

    def record(self, optimizer: torch.optim.Optimizer, iteration: int, loss_ids: list, found_inf: torch.Tensor):
        """A step taken with ``found_inf`` as its verdict."""
        self.unsettled.append(UnsettledStep(iteration, *UnsettledFlag.copy(found_inf), optimizer, loss_ids))

    def record_loss(self, loss_id: Any, iteration: int, found_inf: torch.Tensor) -> None:
        """A scaler update on the device with ``found_inf``."""
        self.unsettled.append(UnsettledLoss(iteration, *UnsettledFlag.copy(found_inf), loss_id))

    def record_stop_ask(self, iteration: int, asked: torch.Tensor) -> None:
        """The ranks' agreed stop ask of ``iteration``, read with that iteration's verdicts."""
        self.unsettled.append(UnsettledStopAsk(iteration, *UnsettledFlag.copy(asked)))

    def pending(self, iteration: int | None = None) -> bool:
        """Whether a step's verdict is unsettled (of ``iteration``, when given)."""
        return any(
            isinstance(u, UnsettledStep) and (iteration is None or u.iteration == iteration) for u in self.unsettled
        )

    def settle(self, before: int | None = None) -> tuple[list, list, list]:
        """Read the flags of the iterations before ``before`` (all, when None). Returns, in order: the skipped
        steps with the losses to blame (those that overflowed in that iteration, else every loss that reached
        the step), each loss's scaler verdict ``(iteration, loss_id, overflowed)``, and the schedules now free to
        run with each optimizer's stepped flag corrected."""
        due, self.unsettled = (
            [u for u in self.unsettled if before is None or u.iteration < before],
            [u for u in self.unsettled if before is not None and u.iteration >= before],
        )
        if not due:
            return [], [], []
        self.stop_asked = self.stop_asked or any(isinstance(u, UnsettledStopAsk) and u.is_set() for u in due)
        overflowed = {(u.iteration, u.loss_id) for u in due if isinstance(u, UnsettledLoss) and u.is_set()}
        skipped = []
        for u in due:
            if isinstance(u, UnsettledStep) and u.is_set():
                blamed = [k for k in u.loss_ids if (u.iteration, k) in overflowed]
                skipped.append((u, blamed or list(u.loss_ids)))
        scale_updates = [
            (u.iteration, u.loss_id, (u.iteration, u.loss_id) in overflowed)
            for u in due
            if isinstance(u, UnsettledLoss)
        ]
        skipped_at = {(u.iteration, u.optimizer) for u, _ in skipped}
        still = {u.iteration for u in self.unsettled}
        ready = [(it, stepped) for it, stepped in self.waiting_schedules if it not in still]
        self.waiting_schedules = [(it, stepped) for it, stepped in self.waiting_schedules if it in still]
        corrected = [
            (it, {opt: was and (it, opt) not in skipped_at for opt, was in stepped.items()}) for it, stepped in ready
        ]
        return skipped, scale_updates, corrected
