"""Keep ranks in lock-step: DDP or step-time gradient averaging, SyncBatchNorm, a named dead rank.

(The Trainer itself agrees the per-loss ``found_inf`` facts across ranks before every skip verdict.)
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ampkit.amp.grad_average import average_grads, through_flat_buffers_
from ampkit.amp.scaler import positive_option
from ampkit.ops._switches import checked_switch
from ampkit.ops.sync_batchnorm import convert_sync_batchnorm
from ampkit.trainer.callback import Callback, Phase
from ampkit.trainer.distributed import DistributedError, diagnose_failure, is_communication_failure
from ampkit.trainer.model_setup import compiles_whole_model
from ampkit.trainer.param_groups import TrainableParams
from ampkit.trainer.user_code import UserCodeError
from ampkit.wording import shown


class DistributedSync(Callback):
    """Synchronises gradients and overflow decisions across ranks (only present when world size > 1).

    ``grad_sync="ddp"`` wraps the model in ``DistributedDataParallel`` (gradients averaged during backward,
    ``require_backward_grad_sync`` off for all but the last micro-batch of an accumulation window — set before
    the forward, as DDP reads it there — unless a callback takes each backward's gradients out of ``.grad``
    (``state.grads_leave_params``: loss scaling, fp32 masters), when every micro-batch is averaged).
    ``grad_sync="step"`` averages an optimizer's gradients right before its step: it works for any number of
    forwards and backwards per step (a GAN's D and G passes, backward restricted to one optimizer's parameters),
    which DDP's one-forward-one-backward reducer does not.
    ``grad_sync="fsdp"``: the model is sharded and FSDP reduce-scatters gradients itself.
    """

    phase = Phase.DISTRIBUTE  # after the model is cast, before clipping reads the averaged gradients
    takes_part_in_collectives = True

    def __init__(self, grad_sync: str = "ddp", ddp_kwargs: dict[str, Any] | None = None,
                 sync_batchnorm: bool = False, failure_wait_s: float = 5.0) -> None:  # fmt: skip
        if grad_sync not in ("ddp", "step", "fsdp"):
            raise ValueError(f"DistributedSync: grad_sync must be 'ddp', 'step' or 'fsdp', got {shown(grad_sync)}")
        self.grad_sync = grad_sync
        self.ddp_kwargs = _checked_ddp_kwargs(ddp_kwargs)
        self.sync_batchnorm = checked_switch("DistributedSync", "sync_batchnorm", sync_batchnorm)
        self.failure_wait_s = positive_option(failure_wait_s, "DistributedSync: failure_wait_s")
        self._ddp: torch.nn.parallel.DistributedDataParallel | None = None
        self._unwrapped: Any = None  # trainer.model before DDP wrapped it, handed back at fit end
        self._buffers: list[torch.Tensor] = []  # grad_sync="step": the module's buffers, broadcast before forwards
        self._watch: Any = None  # DDP's forward hook: noting that this batch's loss came through DDP
        self._forwarded = False
        self._ddp_params: set[int] = set()  # the parameters DDP's reducer averages: those trainable when it wrapped
        self._ddp_names: list[str] = []  # their names, in DDP's order (its errors number them)
        self._trainable: TrainableParams | None = None
        self._unfrozen: set[int] = set()  # parameters trainable since DDP wrapped the model: averaged at the step
        self._evaluating: str | None = None  # "validation", "test", "prediction" while one runs (a fit's included)

    # ---------------------------------------------------------------- set-up
    def on_fit_start(self, trainer) -> None:
        if self.sync_batchnorm:  # the batch norms are replaced in place: trainer.model (compiled) runs them as is
            converted = convert_sync_batchnorm(trainer.module)
            if converted is not trainer.module:  # the root itself was one: what wrapped it holds the old one
                trainer.module, trainer.model = converted, _compiled_if_asked(trainer, converted)
        if self.grad_sync == "ddp":
            self._unwrapped = trainer.model
            device_ids = [trainer.device.index] if trainer.device.type == "cuda" else None
            # DDP over the compiled module: dynamo stops at a compiled DDP wrapper's forward (its _inside_ddp_forward
            # is not traced) and went on only into a model of the user's own class; an nn.Sequential compiled no
            # graph. Either way dynamo's DDP optimizer splits the graph at DDP's buckets (it asks for the active DDP)
            inner = _compiled_if_asked(trainer, trainer.module)
            self._ddp = torch.nn.parallel.DistributedDataParallel(inner, device_ids=device_ids, **self.ddp_kwargs)
            trainer.model = self._ddp
            self._watch = self._ddp.register_forward_pre_hook(self._note_forward)
            wrapped = [(name, p) for name, p in trainer.module.named_parameters() if p.requires_grad]
            self._ddp_names, self._ddp_params = [name for name, _ in wrapped], {id(p) for _, p in wrapped}
            self._trainable, self._unfrozen = TrainableParams(trainer.module, trainer.optimizers.values()), set()
        elif self.grad_sync == "step":  # the Trainer gave every rank rank 0's weights when it built the model
            self._buffers = list(trainer.module.buffers())

    def _note_forward(self, module: torch.nn.Module, args: Any) -> None:
        self._forwarded = True

    def on_fit_end(self, trainer) -> None:
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        if self._ddp is not None:  # drop DDP's hold on the process group before it is destroyed
            trainer.model, self._unwrapped, self._ddp = self._unwrapped, None, None

    # ---------------------------------------------------------------- per batch / step
    def on_train_batch_start(self, trainer, batch: Any) -> None:
        if self._buffers:  # as DDP before each forward: every rank takes rank 0's buffers (BatchNorm statistics)
            self._broadcast_buffers()
        if self._ddp is not None:  # with gradients taken out after each backward, every backward must average
            s = trainer.state
            self._ddp.require_backward_grad_sync = s.is_iteration_end or s.grads_leave_params
            self._forwarded = False

    def on_after_backward(self, trainer, backward: Any) -> None:
        if self._watch is not None and not self._forwarded:
            raise UserCodeError(
                "training_step's loss did not come from self.model: under DDP only self.model (the wrapped model) "
                "averages gradients across ranks, so a loss of self.module (the bare one) trains each rank apart; "
                "call self.model in training_step"
            )

    def on_validation_start(self, trainer) -> None:
        self._evaluating = "validation"
        self._sync_buffers_before_evaluation()

    def on_test_start(self, trainer) -> None:  # a test() from a hook of the fit: its steps call the DDP model too
        self._evaluating = "test"
        self._sync_buffers_before_evaluation()

    def on_predict_start(self, trainer) -> None:
        self._evaluating = "prediction"
        self._sync_buffers_before_evaluation()

    def on_validation_end(self, trainer, metrics: dict[str, float]) -> None:
        self._evaluating = None

    def on_test_end(self, trainer, metrics: dict[str, float]) -> None:
        self._evaluating = None

    def on_predict_end(self, trainer, predictions: list[Any]) -> None:
        self._evaluating = None

    def _sync_buffers_before_evaluation(self) -> None:
        """DDP gives every rank rank 0's buffers (BatchNorm statistics) at the first forward after a training one:
        in an evaluation, at its first batch, which a rank with no batch (an uneven stream) never runs, so the
        others waited in that broadcast until distributed.timeout_s. Every rank syncs them here instead, where all
        meet, and DDP is told the pass's forwards need none, as its first no-grad forward would have told it."""
        if self._ddp is None or not self._ddp.will_sync_module_buffers():
            return
        self._collective("broadcast of buffers before evaluation", self._ddp._sync_buffers)
        self._ddp.require_forward_param_sync = False

    def on_before_optimizer_step(self, trainer, optimizer: torch.optim.Optimizer) -> None:
        if self.grad_sync == "step":  # every rank averages (also before a skip: the verdict is agreed anyway)
            self._average_grads(optimizer)
            trainer.optimizer_state[optimizer].grad_norm = None  # a norm cached before averaging is stale
        elif self._ddp is not None:  # DDP never averages a parameter frozen when it wrapped: ranks would drift apart
            # Looked up at the step, after every backward before it, not at an iteration's start: a layer unfrozen
            # between the backwards of one iteration (accumulation, manual optimization) has gradients from the later
            # ones. Kept once unfrozen: frozen again mid-iteration, it has gradients from the earlier ones.
            if self._trainable.changed():
                params = trainer.module.parameters()
                self._unfrozen |= {id(p) for p in params if p.requires_grad and id(p) not in self._ddp_params}
            if self._unfrozen:
                self._average_unfrozen_grads(trainer, optimizer)

    # ---------------------------------------------------------------- collectives
    def _average_grads(self, optimizer: torch.optim.Optimizer) -> None:
        self._average_over_ranks([p for group in optimizer.param_groups for p in group["params"]])

    def _average_unfrozen_grads(self, trainer, optimizer: torch.optim.Optimizer) -> None:
        """Average the gradients of this optimizer's parameters unfrozen after DDP wrapped the model (a backbone
        fine-tuned from some epoch on), where the optimizer reads them: on their fp32 masters under O2."""
        masters = trainer.optimizer_state[optimizer].master_weights
        if masters is not None:
            pairs = zip(masters.model_params, masters.master_params, strict=True)
        else:
            pairs = ((p, p) for group in optimizer.param_groups for p in group["params"])
        # trainable, or frozen again since with a gradient of this iteration (its master stays requires_grad=True)
        owners = [o for p, o in pairs if id(p) in self._unfrozen and (p.requires_grad or o.grad is not None)]
        if self._average_over_ranks(owners):
            trainer.optimizer_state[optimizer].grad_norm = None

    def _average_over_ranks(self, tensors: list[torch.Tensor]) -> bool:
        """Average the ``.grad`` of the trainable ``tensors`` over the ranks, every one taking part (a zero where a
        rank has none: :func:`~ampkit.amp.grad_average.average_grads`); False if there were none."""
        # trainable, or given a gradient anyway (the fp32 master of a weight unfrozen after O2 made it)
        tensors = [t for t in tensors if t.requires_grad or t.grad is not None]
        if not tensors:
            return False
        average_grads(
            tensors, dist.get_world_size(), lambda flat: self._collective("gradient all-reduce", dist.all_reduce, flat)
        )
        return True

    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers on every rank (``grad_sync="step"``, which has no DDP to do it)."""
        self._flat_collective("broadcast of buffers", self._buffers, dist.broadcast, 0)

    def _flat_collective(self, what: str, tensors: list[torch.Tensor], fn, *args) -> None:
        """Run the in-place collective ``fn(flat, *args)`` once per device and dtype over ``tensors`` flattened
        together, and write the result back into each tensor."""
        through_flat_buffers_(tensors, lambda flat: self._collective(what, fn, flat, *args))

    def explain_exception(self, trainer, exception: BaseException) -> str | None:
        text, rank = str(exception), trainer.global_rank
        if _ONE_VALUE_PER_CHANNEL in text and not self.sync_batchnorm:  # torch's BatchNorm on a batch of one
            return (
                f"rank {rank}: a batch norm in training got one value per channel ({text}): each rank normalises "
                "its own batch, so it needs 2 or more samples; distributed.sync_batchnorm=true computes the "
                "statistics over every rank's batch together (or drop_last=True drops a last batch of one)"
            )
        if self._ddp is None or self.ddp_kwargs.get("find_unused_parameters") or not _UNFINISHED_REDUCTION.search(text):
            return None
        return (
            f"rank {rank}: parameters {unused_parameter_names(self._ddp_names, text)} got no gradient in the step "
            "before, so DDP never finished reducing them: set distributed.find_unused_parameters=true for a model "
            "whose steps leave some parameters out (or make every step's loss use all of them)"
        )

    def on_exception(self, trainer, exception: BaseException) -> None:
        if isinstance(exception, DistributedError) or not is_communication_failure(exception):
            return
        # a fit's validation runs in stage "fit": the pass that was running, not the stage, says where it failed
        during = self._evaluating or ("validation before training" if trainer.state.stage == "sanity" else "training")
        raise self._diagnose(f"a collective during {during}", exception) from exception

    def _collective(self, what: str, fn, *args) -> None:
        try:
            fn(*args)
        except RuntimeError as exc:
            if not is_communication_failure(exc):
                raise
            raise self._diagnose(what, exc) from exc

    def _diagnose(self, what: str, exc: BaseException) -> DistributedError:
        return diagnose_failure(what, exc, self.failure_wait_s)


_ONE_VALUE_PER_CHANNEL = "Expected more than 1 value per channel when training"  # torch's BatchNorm on 1 sample
# torch's DDP error at the forward after a backward that left parameters without a gradient
_UNFINISHED_REDUCTION = re.compile(r"Expected to have finished reduction in the prior iteration")
_UNUSED_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")


def _checked_ddp_kwargs(ddp_kwargs: Any) -> dict[str, Any]:
    """``ddp_kwargs`` as a dict of DistributedDataParallel's own options, checked when the callback is built: a typo
    (``find_unused_parameter``) or ``device_ids``, which the callback sets, failed only at fit start, on every rank,
    and a list or 0 was taken as no options."""
    if ddp_kwargs is None:
        return {}
    if not isinstance(ddp_kwargs, Mapping):
        raise TypeError(
            "DistributedSync: ddp_kwargs must be a dict of DistributedDataParallel options or None, got "
            f"{shown(ddp_kwargs)}"
        )
    params = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    options = [name for name in params if name not in ("self", "module", "device_ids")]
    unknown = [key for key in ddp_kwargs if key not in options]
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise ValueError(
            f"DistributedSync: ddp_kwargs names {unknown}, no option of DistributedDataParallel here (device_ids "
            f"follows trainer.device, module is the Trainer's); its options: {', '.join(options)}"
        )
    return dict(ddp_kwargs)


def unused_parameter_names(names: list[str], message: str) -> str:
    """The names of the parameters DDP's ``message`` lists by index, e.g. ``'b.weight', 'b.bias'``; "some" where it
    lists none. ``names``: those requiring grad when DDP wrapped the model, in ``named_parameters`` order (DDP's
    numbering: a parameter unfrozen since is not among them)."""
    found = _UNUSED_INDICES.search(message)
    if found is None:
        return "some"
    indices = [int(i) for i in found.group(1).split()]
    return ", ".join(repr(names[i]) if i < len(names) else str(i) for i in indices)


def _compiled_if_asked(trainer, module: torch.nn.Module) -> Any:
    """``module`` compiled where ``trainer.compile: true`` asks for the whole model (as the model set-up compiles
    it), else ``module`` itself."""
    if not compiles_whole_model(trainer.cfg):
        return module
    return torch.compile(module, mode=trainer.cfg.trainer.compile_mode)
