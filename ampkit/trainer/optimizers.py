"""The Trainer's optimizers: what ``configure_optimizers`` returns, normalised into named optimizers with their
schedulers, and the two calls the loop makes on each every iteration (``step_``, ``zero_grad_``)."""

from __future__ import annotations

import contextvars
import inspect
import math
import numbers
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer
from torch.utils.hooks import RemovableHandle

from ampkit.config import names_a_metric
from ampkit.trainer.user_code import UserCodeError
from ampkit.wording import counted, shown


class MonitorNotFoundError(UserCodeError, KeyError):
    """A scheduler's ``monitor`` names a metric validation has not produced (a KeyError, as Lightning's lookup)."""

    __str__ = Exception.__str__  # one plain line, not KeyError's quoted repr


@dataclass
class SchedulerSpec:
    """An LR scheduler and when it steps: every ``frequency`` iterations or epochs; ``monitor``: val metric.

    ``interval`` defaults to ``"epoch"``, monitored or not, as in Lightning."""

    scheduler: Any
    interval: str | None = "epoch"
    frequency: int = 1
    monitor: str | None = None
    strict: bool = True  # a missing monitored metric is an error (False: warn and skip the step)
    name: str | None = None  # how messages name it (Lightning's LR-monitor name)
    count_after_step: int | None = field(default=None, init=False)  # its last_epoch after the Trainer's last step


@dataclass
class OptimizerSpec:
    name: str
    optimizer: torch.optim.Optimizer
    schedulers: list[SchedulerSpec] = field(default_factory=list)


class NamedOptimizers(dict):
    """The Trainer's optimizers by name, in ``configure_optimizers``' order. Not a method, as Lightning's
    ``self.optimizers()`` is: calling it is refused with what to write instead."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        first = next(iter(self), "adam")
        raise UserCodeError(
            f"self.optimizers is a dict of the optimizers by name ({', '.join(self) or 'none yet'}), not a method as "
            f"in Lightning: write self.optimizers.values() (in configure_optimizers' order), "
            f"self.optimizers['{first}'], or self.optimizer when there is one"
        )


_SCHEDULER_KEYS = {"scheduler", "interval", "frequency", "monitor", "strict", "name"}
_ACCEPTED = (
    "an Optimizer, a list of Optimizers, a pair ([optimizers], [schedulers]), or dicts {'optimizer': opt, "
    "'lr_scheduler': sched or {'scheduler': sched, 'interval': 'step'|'epoch', 'frequency': n, "
    "'monitor': 'val/metric', 'strict': bool, 'name': str}, 'monitor': 'val/metric', 'name': str}"
)


def _scheduler_spec(value: Any, where: str) -> SchedulerSpec:
    if isinstance(value, dict):
        unknown = set(value) - _SCHEDULER_KEYS
        if unknown or "scheduler" not in value:
            raise UserCodeError(
                f"{where}: lr_scheduler dict needs 'scheduler' and may have interval/frequency/"
                f"monitor/strict/name; got keys {sorted(value)}"
            )
        spec = SchedulerSpec(**value)
    else:
        spec = SchedulerSpec(scheduler=value)
    if isinstance(spec.scheduler, type):  # its unbound step() passed the check below, and failed at the first step
        raise UserCodeError(
            f"{where}: lr_scheduler is the class {spec.scheduler.__name__}, not a scheduler: construct it on the "
            f"optimizer ({spec.scheduler.__name__}(optimizer, ...))"
        )
    if not all(callable(getattr(spec.scheduler, name, None)) for name in ("step", "state_dict", "load_state_dict")):
        raise UserCodeError(
            f"{where}: lr_scheduler is {type(spec.scheduler).__name__} ({str(spec.scheduler)[:40]!r}); expected a "
            "scheduler object with step(), state_dict() and load_state_dict() (torch.optim.lr_scheduler.*)"
        )
    if spec.interval not in (None, "step", "epoch"):
        raise UserCodeError(f"{where}: lr_scheduler interval '{spec.interval}' must be 'step' or 'epoch'")
    if isinstance(spec.frequency, bool) or not isinstance(spec.frequency, numbers.Integral):
        raise UserCodeError(f"{where}: lr_scheduler frequency {shown(spec.frequency)} must be an integer >= 1")
    if spec.frequency < 1:
        raise UserCodeError(f"{where}: lr_scheduler frequency {spec.frequency} must be >= 1")
    spec.frequency = int(spec.frequency)
    if not isinstance(spec.strict, bool):  # "false" would be true
        raise UserCodeError(f"{where}: lr_scheduler strict {shown(spec.strict)} must be True or False")
    for key in ("monitor", "name"):
        if not isinstance(getattr(spec, key), str | None):
            raise UserCodeError(
                f"{where}: lr_scheduler {key} {shown(getattr(spec, key))} must be a string (e.g. 'val/loss') or None"
            )
    _check_monitor_names_a_metric(spec.monitor, f"{where}: lr_scheduler monitor")
    return spec


def _check_monitor_names_a_metric(monitor: str | None, named: str) -> None:
    """Refuse a monitor that names no metric (``""``, ``"val/"``): the scheduler waited on a value never produced."""
    if monitor is not None and not names_a_metric(monitor):
        raise UserCodeError(
            f"{named} {shown(monitor)} names no metric; give one such as 'val/loss', or None (a metric's name is "
            "printable text: no newline, tab or control character)"
        )


def step_scheduler(sched: SchedulerSpec, optimizer_name: str, *metric: float) -> None:
    """Step ``sched`` (on a monitored ``metric``), refusing one that was stepped elsewhere since the Trainer last
    stepped it: a Lightning port's manual-optimization ``sched.step()`` in ``training_step`` would step it twice."""
    count = getattr(sched.scheduler, "last_epoch", None)
    if sched.count_after_step is not None and count != sched.count_after_step:
        which = f"LR scheduler '{sched.name}'" if sched.name else f"the LR scheduler {type(sched.scheduler).__name__}"
        raise UserCodeError(
            f"{which} of optimizer '{optimizer_name}' was stepped outside the Trainer (its count went from "
            f"{sched.count_after_step} to {count} since the Trainer stepped it): the Trainer steps each scheduler "
            "configure_optimizers returned after its optimizer's steps (its interval and frequency), under manual "
            "optimization too, so a step of your own steps it twice; remove that call"
        )
    sched.scheduler.step(*metric)
    sched.count_after_step = getattr(sched.scheduler, "last_epoch", None)


def refuse_scheduler_overrun(spec: OptimizerSpec, steps_taken: int, iterations_left: int) -> None:
    """Refuse a ``OneCycleLR`` stepped per iteration that this run would step past its ``total_steps``: torch raises
    "Tried to step N times" at the step after them, once the run has trained that far (the steps since its last
    checkpoint lost). ``steps_taken``: the optimizer's steps so far (a resume's); ``iterations_left``: at most one
    step of it each."""
    for sched in spec.schedulers:
        if sched.interval != "step" or not isinstance(sched.scheduler, torch.optim.lr_scheduler.OneCycleLR):
            continue
        total = sched.scheduler.total_steps
        room = total - sched.scheduler.last_epoch  # last_epoch: 0 once constructed
        wanted = (steps_taken + iterations_left) // sched.frequency - steps_taken // sched.frequency
        if wanted > room:
            which = f"LR scheduler '{sched.name}'" if sched.name else "the OneCycleLR"
            every = "each step" if sched.frequency == 1 else f"every {sched.frequency} steps"
            per = "" if sched.frequency == 1 else f" // {sched.frequency}"
            raise UserCodeError(
                f"configure_optimizers(): {which} of optimizer '{spec.name}' steps at {every} of it ('interval': "
                f"'step'), {wanted} times in this run, but has total_steps={total} ({room} left): torch would raise "
                f"at its step {total + 1}, after training that far. Build it with total_steps="
                f"self.num_training_steps{per} (the iterations the run trains)"
            )


def _takes_no_metric(scheduler: Any) -> bool:
    """Whether ``scheduler`` is one of torch's that step without a metric (all but ReduceLROnPlateau): the only
    argument their ``step`` takes is a deprecated epoch number."""
    return isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) and not isinstance(
        scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau
    )


def _is_lists_pair(result: Any) -> bool:
    """Lightning's ``([opt1, opt2], [sched1, sched2])``, or ``([opt], sched)`` with one scheduler (or its dict) not
    in a list, which Lightning takes too."""
    return (
        isinstance(result, list | tuple)
        and len(result) == 2
        and isinstance(result[0], list | tuple)
        and bool(result[0])
        and all(isinstance(opt, torch.optim.Optimizer) for opt in result[0])
        and not isinstance(result[1], torch.optim.Optimizer)  # [[opt_a], opt_b]: a list holding a list, refused below
    )


def _attach_schedulers(optimizers: list[Any], schedulers: list[Any]) -> list[dict[str, Any]]:
    """One dict per optimizer holding the schedulers that step it (a scheduler's ``.optimizer``)."""
    items: list[dict[str, Any]] = [{"optimizer": opt, "lr_scheduler": []} for opt in optimizers]
    for j, sched in enumerate(schedulers):
        target = getattr(sched.get("scheduler") if isinstance(sched, dict) else sched, "optimizer", None)
        if not isinstance(target, torch.optim.Optimizer):  # not a scheduler: _scheduler_spec names what it is
            _scheduler_spec(sched, f"configure_optimizers()[1][{j}]")
        owner = next((item for item in items if item["optimizer"] is target), None)
        if owner is None:
            raise UserCodeError(
                f"configure_optimizers()[1][{j}] is a scheduler of an optimizer missing from the list of optimizers"
            )
        owner["lr_scheduler"].append(sched)
    return items


def normalize_optimizers(result: Any) -> list[OptimizerSpec]:
    """Accept the usual shapes; names default to the lower-cased class name, suffixed when repeated."""
    if result is None:
        raise UserCodeError(f"configure_optimizers() returned None; return {_ACCEPTED}")
    if isinstance(result, list | tuple) and len(result) == 2 and isinstance(result[0], list | tuple) and not result[0]:
        raise UserCodeError(f"configure_optimizers() returned an empty list of optimizers; return {_ACCEPTED}")
    if _is_lists_pair(result):
        schedulers = result[1]
        schedulers = list(schedulers) if isinstance(schedulers, list | tuple) else [schedulers]
        result = _attach_schedulers(list(result[0]), schedulers)
    items = list(result) if isinstance(result, list | tuple) else [result]
    if not items:
        raise UserCodeError(f"configure_optimizers returned nothing; return {_ACCEPTED}")
    specs: list[OptimizerSpec] = []
    for i, item in enumerate(items):
        where = f"configure_optimizers()[{i}]"
        if isinstance(item, torch.optim.Optimizer):
            specs.append(OptimizerSpec(name="", optimizer=item))
        elif isinstance(item, dict) and isinstance(item.get("optimizer"), torch.optim.Optimizer):
            unknown = set(item) - {"optimizer", "lr_scheduler", "monitor", "name"}
            if unknown:
                raise UserCodeError(f"{where}: unknown keys {sorted(unknown)}; return {_ACCEPTED}")
            scheds = item.get("lr_scheduler")
            scheds = list(scheds) if isinstance(scheds, list | tuple) else ([] if scheds is None else [scheds])
            sched_specs = [_scheduler_spec(s, where) for s in scheds]
            if not isinstance(item.get("monitor"), str | None):
                raise UserCodeError(
                    f"{where}: monitor {shown(item['monitor'])} must be a string (e.g. 'val/loss') or None"
                )
            _check_monitor_names_a_metric(item.get("monitor"), f"{where}: monitor")
            for spec in sched_specs:
                target = getattr(spec.scheduler, "optimizer", item["optimizer"])
                if target is not item["optimizer"]:
                    raise UserCodeError(
                        f"{where}: its lr_scheduler steps another optimizer than its 'optimizer' "
                        f"({_which_optimizer(target, items)}): put each scheduler beside the optimizer it steps"
                    )
            for spec in sched_specs:
                plateau = isinstance(spec.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
                if spec.monitor is not None and _takes_no_metric(spec.scheduler):
                    raise UserCodeError(
                        f"{where}: its {type(spec.scheduler).__name__} has 'monitor': {shown(spec.monitor)}, but it "
                        "steps without a metric (step(metric) would set its epoch count to the metric's value): leave "
                        "'monitor' out of its dict (a ReduceLROnPlateau steps on one)"
                    )
                if plateau:  # Lightning puts 'monitor' beside 'optimizer' too, for the plateau scheduler alone
                    spec.monitor = spec.monitor or item.get("monitor")
                # an explicit None: the default (a monitored metric is fresh once per validation, not per step)
                spec.interval = spec.interval or "epoch"
                if spec.monitor is None and plateau:
                    raise UserCodeError(
                        f"{where}: a ReduceLROnPlateau steps on a metric: name it with 'monitor' (e.g. "
                        "{'scheduler': sched, 'monitor': 'val/loss', 'interval': 'epoch'})"
                    )
            specs.append(
                OptimizerSpec(name=str(item.get("name") or ""), optimizer=item["optimizer"], schedulers=sched_specs)
            )
        elif isinstance(item, dict):
            found = type(item.get("optimizer")).__name__
            raise UserCodeError(
                f"{where} is a dict whose 'optimizer' is {found} (keys: {sorted(map(str, item))}); it needs "
                f"'optimizer': a torch.optim.Optimizer. Return {_ACCEPTED}"
            )
        elif isinstance(item, type) and issubclass(item, torch.optim.Optimizer):
            raise UserCodeError(
                f"{where} is the class {item.__name__}, not an optimizer: construct it "
                f"({item.__name__}(self.module.parameters(), lr=...))"
            )
        else:
            raise UserCodeError(f"{where} is {type(item).__name__}; return {_ACCEPTED}")
    defaults = Counter(type(s.optimizer).__name__.lower() for s in specs if not s.name)
    seen: Counter[str] = Counter()
    for spec in specs:
        if not spec.name:
            base = type(spec.optimizer).__name__.lower()
            spec.name = base if defaults[base] == 1 else f"{base}_{seen[base]}"
            seen[base] += 1
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise UserCodeError(f"optimizer names must be unique, got {names}")
    if len({id(s.optimizer) for s in specs}) != len(specs):
        raise UserCodeError("the same optimizer object was returned twice by configure_optimizers")
    listed: set[int] = set()
    for sched in (sched.scheduler for spec in specs for sched in spec.schedulers):
        if id(sched) in listed:  # each listing would step it once more
            raise UserCodeError(
                f"configure_optimizers() returned one {type(sched).__name__} object twice: the Trainer would step it "
                "once for each; return each scheduler once"
            )
        listed.add(id(sched))
    for spec in specs:
        if _needs_closure(spec.optimizer):
            raise UserCodeError(
                f"configure_optimizers(): optimizer '{spec.name}' ({type(spec.optimizer).__name__}) needs a closure "
                "in step() to evaluate the loss again, which the Trainer's step does not pass (nor does torch's "
                "GradScaler take one; Lightning's automatic optimization does): use an optimizer whose step takes "
                "none (SGD, AdamW...)"
            )
    return specs


def _which_optimizer(optimizer: Any, items: list[Any]) -> str:
    """Where ``optimizer`` is among ``configure_optimizers``' items, for a message (``"that of
    configure_optimizers()[1]"``), or that it returned no such optimizer."""
    for i, item in enumerate(items):
        if optimizer is item or (isinstance(item, dict) and optimizer is item.get("optimizer")):
            return f"that of configure_optimizers()[{i}]"
    return f"a {type(optimizer).__name__} that configure_optimizers() did not return"


def _needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` requires a closure (LBFGS): called without one it fails with a bare TypeError."""
    try:
        closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read: assume it steps as others do
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def check_parameters(specs: list[OptimizerSpec], module: torch.nn.Module, automatic: bool = True) -> None:
    """Every optimized parameter is the model's: one outside it is neither checkpointed nor used by the model, so
    training it is lost on resume (make it an attribute of the model instead). Under automatic optimization no
    parameter is in two optimizers: each would step it from the one gradient, so it would move twice."""
    own = {id(p) for p in module.parameters()}
    _check_listed_once(specs, module)
    if automatic:
        _check_disjoint(specs, module)
    for spec in specs:
        params = [p for group in spec.optimizer.param_groups for p in group["params"]]
        foreign = sum(id(p) not in own for p in params)
        if foreign:
            raise UserCodeError(
                f"configure_optimizers(): optimizer '{spec.name}' holds {foreign} of its "
                f"{counted(len(params), 'parameter')} outside the model: checkpoints would not save them. Build it "
                "from self.module.parameters() (make any extra parameter an attribute of the model configure_model "
                "returns)"
            )


def check_group_settings(specs: list[OptimizerSpec]) -> None:
    """No param group holds a NaN setting, nor a learning rate that is negative or infinite: torch's SGD takes
    ``lr=float("nan")`` (a config's ``lr=nan``, a scheduler's first factor), and the run trained into NaN weights
    before the error said the model was not finite, the learning rate unnamed."""
    for spec in specs:
        for index, group in enumerate(spec.optimizer.param_groups):
            for key, value in group.items():
                if key == "params":  # read no parameter: a sharded one's local part may be empty
                    continue
                numbers_in = [_setting_number(item) for item in (value if isinstance(value, tuple | list) else [value])]
                if all(number is None for number in numbers_in):
                    continue
                bad = any(n is not None and math.isnan(n) for n in numbers_in) or (
                    key == "lr" and not all(n is not None and 0 <= n < math.inf for n in numbers_in)
                )
                if bad:
                    valid = "a finite number >= 0" if key == "lr" else "a number (NaN sets nothing)"
                    raise UserCodeError(
                        f"configure_optimizers(): optimizer '{spec.name}' ({type(spec.optimizer).__name__}) has "
                        f"{key}={shown(_plain(value))} in param group {index}; expected {valid}, as passed to the "
                        "optimizer or set by its LR scheduler's first step"
                    )


def _setting_number(value: Any) -> float | None:
    """A param group's setting as a float where it is a real number (a one-element floating tensor too), else None."""
    if isinstance(value, torch.Tensor):
        return float(value.detach()) if value.numel() == 1 and value.is_floating_point() else None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def unoptimized_parameters_warning(reached: list[tuple[str, torch.Tensor]]) -> str | None:
    """Why trainable parameters that got gradients but are in no optimizer are likely a mistake (a layer left out
    of ``configure_optimizers``, or one meant to be frozen), naming them (``(name, parameter)`` pairs); None for
    none. They never train, and their ``.grad`` sums those of every step (no optimizer's ``zero_grad`` clears it)."""
    if not reached:
        return None
    names = ", ".join(f"'{name}'" for name, _ in reached[:5]) + (", ..." if len(reached) > 5 else "")
    elements = sum(p.numel() for _, p in reached)
    receive, it, they, train, its = (
        ("receives", "it", "it", "trains", "its")
        if len(reached) == 1
        else ("receive", "them", "they", "train", "their")
    )
    return (
        f"configure_optimizers(): {counted(len(reached), 'parameter')} of the model {receive} gradients but no "
        f"optimizer holds {it} ({names}; {counted(elements, 'element')}): {they} never {train}, and {its} .grad "
        f"sums up the gradients of every backward. Add {it} to an optimizer, or freeze {it} with requires_grad_(False)"
    )


def unreached_parameters_warning(
    left: list[torch.Tensor], name: str, steps: int, module: torch.nn.Module, masters: Any = None
) -> str | None:
    """Why an optimizer's trainable parameters that received no gradient in any of its first ``steps`` steps (a
    layer the forward never calls, a head the loss leaves out) are likely a mistake, naming them; None for none.
    The optimizer steps around them without a word, so they never train. ``masters``: O2's MasterWeights, whose
    fp32 copies are what the optimizer holds."""
    if not left:
        return None
    names = {id(p): n for n, p in module.named_parameters()}
    if masters is not None:
        for param, master in zip(masters.model_params, masters.master_params, strict=True):
            names[id(master)] = names.get(id(param), "")
    shown = ", ".join(f"'{names.get(id(p)) or '?'}'" for p in left[:5]) + (", ..." if len(left) > 5 else "")
    when = "its first step" if steps == 1 else f"any of its first {steps} steps"
    it, does, they = ("it", "does", "it") if len(left) == 1 else ("them", "do", "they")
    return (
        f"{counted(len(left), 'parameter')} of optimizer '{name}' received no gradient in {when} ({shown}): the loss "
        f"does not depend on {it}, so {they} {does} not train (a layer the forward never calls? a head the loss "
        f"leaves out?). Freeze {it} with requires_grad_(False), or leave {it} out of the optimizer"
    )


def _check_listed_once(specs: list[OptimizerSpec], module: torch.nn.Module) -> None:
    """Refuse a parameter listed twice in one param group: torch only warns (an error to come), and steps it twice
    per step, and the loss scaler would unscale its one gradient twice."""
    for spec in specs:
        for index, group in enumerate(spec.optimizer.param_groups):
            seen: set[int] = set()
            for p in group["params"]:
                if id(p) in seen:
                    name = next((n for n, q in module.named_parameters() if q is p), "a parameter")
                    raise UserCodeError(
                        f"configure_optimizers(): parameter '{name}' is listed twice in param group {index} of "
                        f"optimizer '{spec.name}': torch would step it twice per step (it warns that this will be an "
                        "error); list each parameter once (self.module.parameters() does)"
                    )
                seen.add(id(p))


def _check_disjoint(specs: list[OptimizerSpec], module: torch.nn.Module) -> None:
    """Refuse a parameter held by two optimizers (torch refuses one in two groups of one optimizer)."""
    holder: dict[int, str] = {}
    for spec in specs:
        for p in {id(p): p for group in spec.optimizer.param_groups for p in group["params"]}.values():
            first = holder.setdefault(id(p), spec.name)
            if first != spec.name:
                name = next((n for n, q in module.named_parameters() if q is p), "a parameter")
                raise UserCodeError(
                    f"configure_optimizers(): parameter '{name}' is in optimizers '{first}' and '{spec.name}': "
                    "under automatic optimization every optimizer steps on the one backward's gradients, so it "
                    "would move twice per iteration. Give each parameter to one optimizer (one optimizer with "
                    "param groups sets a learning rate per group), or step them yourself with "
                    "automatic_optimization = False"
                )


_TORCH_ZERO_GRAD = torch.optim.Optimizer.zero_grad
# Whether a profiler records (a private torch function: without it, zeroing and stepping always go through
# zero_grad and step).
_profiler_enabled = getattr(torch.autograd, "_profiler_enabled", lambda: True)
# The registries of step hooks that run for every optimizer (private torch names: without them, stepping always
# goes through step).
_GLOBAL_STEP_HOOKS = [
    getattr(torch_optimizer, name, None) for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
]


def zero_grad_(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)``, in about a tenth of its time when torch's own implementation
    would run: for an optimizer that keeps it (neither its class nor the instance overrides ``zero_grad``) and
    while no profiler records, the gradients are set to None directly, which is all torch's does, without its
    profiler range and dynamo guard (about 6 µs a call on CPU, 2% of a tiny model's step). Anything else is
    called as it is."""
    if type(optimizer).zero_grad is not _TORCH_ZERO_GRAD or "zero_grad" in optimizer.__dict__ or _profiler_enabled():
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def step_(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()``, without torch's wrapper around it when that wrapper would do nothing but open a
    profiler range: the class's step is torch's hooked one and the instance does not override it (an LR
    scheduler's step counter does), no step hook is registered (global or on this optimizer) and no profiler
    records. Then the wrapped step and the profiler's entry point run as the wrapper would run them: about 6 µs
    a call sooner on CPU in a tight loop, 3% of a tiny model's step in the Trainer's. Anything else is called
    as it is."""
    wrapper = type(optimizer).step
    inner = getattr(wrapper, "__wrapped__", None)
    step_code = getattr(optimizer, "_optimizer_step_code", None)  # where a profiler with Python tracing looks
    if inner is None or step_code is None or not getattr(wrapper, "hooked", False) or "step" in optimizer.__dict__:
        optimizer.step()
        return
    hook_registries = (
        *_GLOBAL_STEP_HOOKS,
        getattr(optimizer, "_optimizer_step_pre_hooks", None),
        getattr(optimizer, "_optimizer_step_post_hooks", None),
    )
    for hooks in hook_registries:  # a loop, not any(generator): asked at every step
        if hooks is None or hooks:  # unknown to this torch version, or a hook to run
            optimizer.step()
            return
    if _profiler_enabled():
        optimizer.step()
        return
    inner(optimizer)
    step_code()


# Settings an LR scheduler moves as it steps (OneCycleLR cycles momentum/betas too): their resumed values are the
# schedule's position, not the checkpoint overriding the code.
_MOVED_BY_SCHEDULERS = frozenset({"lr", "momentum", "betas"})


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings (lr, weight_decay, ...), without its parameters (a tensor lr as a number)."""
    return [{key: _plain(value) for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def _plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, torch.Tensor) else value  # a capturable optimizer's tensor lr


def settings_kept_from_checkpoint(
    spec: OptimizerSpec, built: list[dict[str, Any]], built_before: list[dict[str, Any]] | None
) -> list[str]:
    """``name[group].key=<checkpoint's> (configure_optimizers: <built>)`` for each setting of ``spec``'s optimizer
    that loading its state replaced (torch's ``load_state_dict`` restores every group setting) where the code now
    builds another value than it built for the saved run (``built_before``; None in older checkpoints: any
    difference). A setting the training code moves itself (nanoGPT's lr set each step) is then not named, and under a
    scheduler the settings it moves are left out."""
    skip = _MOVED_BY_SCHEDULERS if spec.schedulers else frozenset()
    kept = []
    for i, (ours, loaded) in enumerate(zip(built, group_settings(spec.optimizer), strict=False)):
        before = built_before[i] if built_before is not None and i < len(built_before) else None
        for key in sorted(ours.keys() & loaded.keys() - skip):
            if before is not None and key in before and before[key] == ours[key]:
                continue  # configured as for the saved run: the value it reached is the one to go on with
            if ours[key] != loaded[key]:
                kept.append(f"{spec.name}[{i}].{key}={loaded[key]} (configure_optimizers: {ours[key]})")
    return kept


# Set while torch.distributed.checkpoint reads or loads an optimizer's state dict: see state_initialising_steps.
_INITIALISING_STATE = contextvars.ContextVar("ampkit_initialising_optimizer_state", default=False)


@contextmanager
def state_initialising_steps() -> Iterator[None]:
    """Let the direct-step guard pass the step torch.distributed.checkpoint takes itself: getting or setting the
    state dict of an optimizer with no state yet (any before its first step, a momentum-free SGD always) steps it
    once, on zero gradients at a zero learning rate, to create its state. Without this, a sharded checkpoint under
    manual optimization failed to save (SGD) or to resume (any optimizer)."""
    token = _INITIALISING_STATE.set(True)
    try:
        yield
    finally:
        _INITIALISING_STATE.reset(token)


def refuse_direct_steps(
    optimizers: Mapping[str, torch.optim.Optimizer], stepping: Callable[[], torch.optim.Optimizer | None]
) -> list[RemovableHandle]:
    """Make ``optimizer.step()`` raise before it changes anything, unless ``stepping()`` names that optimizer (the
    Trainer's own ``step`` runs it). Under manual optimization a Lightning port's ``opt.step()`` would bypass the
    skip rule, clipping and O2's copy of the masters back to the model. Returns the hooks' handles, to remove."""

    def refuse(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if stepping() is not optimizer and not _INITIALISING_STATE.get():
            name = next(n for n, opt in optimizers.items() if opt is optimizer)
            raise UserCodeError(
                f"optimizer '{name}' was stepped directly (optimizer.step()); under manual optimization call "
                f"self.step('{name}') after self.backward(loss): it skips a step whose gradients overflowed, clips, "
                "and under O2 copies the fp32 master weights back to the model (Lightning's opt.step() is a wrapper "
                "doing the first; this optimizer is torch's own)"
            )

    return [optimizer.register_step_pre_hook(refuse) for optimizer in optimizers.values()]
