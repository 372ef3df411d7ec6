"""The Trainer: owns the loop and fires hooks; every feature lives in a callback.

Order of one ``fit()`` (pinned by ``tests/test_hook_order.py``)::

    set-up: seed → configure_model → configure_optimizers → train/val_dataloader → callbacks → resume
    on_fit_start → on_train_start
    per epoch:  on_train_epoch_start
      per batch:  on_train_batch_start → training_step
                    (backward:  on_before_backward → autograd → on_after_backward)
                    (step, at the end of an iteration:  on_before_optimizer_step →
                       optimizer.step() → on_after_optimizer_step   |   on_optimizer_step_skipped)
                  at the end of an iteration: step-interval schedulers (only of optimizers that stepped)
                    → on_before_zero_grad → zero_grad → validation if due (on_validation_start/_end)
                  → on_train_batch_end
      at the end of the epoch: validation if due → epoch-interval schedulers → on_train_epoch_end
    on_train_end → on_fit_end (also after an exception, which first fires on_exception)

An *iteration* is one accumulation window of ``trainer.accumulate_grad_batches`` batches; ``global_step``
counts iterations. Under ``automatic_optimization`` the Trainer calls ``backward`` on the returned loss
and ``step`` on every optimizer; otherwise ``training_step`` calls ``self.backward(loss, loss_id=...,
optimizer=...)`` and ``self.step(optimizer)`` itself (e.g. a GAN's D step then G step).

Callbacks share facts only through the Trainer's state: ``trainer.state`` (loop position),
``trainer.optimizer_state[opt]`` (``found_inf`` skips the step; ``loss_ids`` reached it; ``stepped``/``skipped``)
and ``trainer.loss_state[loss_id]`` (``found_inf`` per loss, e.g. set by a loss scaler).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from lightning_utilities.core.overrides import is_overridden
from lightning_utilities.core.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from ampkit.config import Config, ConfigError, TrainerConfig, build_config, check_values
from ampkit.trainer.callback import HOOKS, Callback
from ampkit.trainer.checkpoint_io import FORMAT_KEY, FORMAT_VERSION, CheckpointError, load_checkpoint
from ampkit.trainer.distributed import (
    DistributedEnv,
    all_reduce_sum,
    broadcast_object,
    check_same_config,
    distributed_loader,
    setup_distributed,
    teardown_distributed,
)
from ampkit.trainer.fsdp import backward_to, full_norm, shard_model, uses_fsdp, validate_strategy
from ampkit.trainer.optimizers import OptimizerSpec, normalize_optimizers
from ampkit.trainer.ordering import order_callbacks
from ampkit.trainer.rng import capture_rng, restore_rng, seed_everything
from ampkit.trainer.run_dir import latest_checkpoint, new_version_dir, unwritable_reason
from ampkit.trainer.sharded_checkpoint import is_sharded_checkpoint, load_sharded
from ampkit.trainer.state import BackwardState, LoopState, LossState, OptimizerState


def _every(n: int, count: int) -> bool:
    """Event filter: the ``count``-th occurrence is due every ``n`` (``n <= 0`` never)."""
    return n > 0 and count % n == 0


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.ndim else 1
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, list | tuple) else ()
    for value in values:
        size = _batch_size(value)
        if size:
            return size
    return 0


class Trainer:
    """Subclass it, implement ``configure_model``, ``configure_optimizers``, ``train_dataloader`` and
    ``training_step`` (plus ``val_dataloader``/``validation_step`` to validate), then call :meth:`fit`.

    Example::

        class DigitsTrainer(ampkit.Trainer):
            config_class = DigitsConfig
            def configure_model(self):       return Net(self.cfg.model)
            def configure_optimizers(self):  return torch.optim.AdamW(self.module.parameters(), lr=1e-3)
            def train_dataloader(self):      return DataLoader(train_set, batch_size=64, shuffle=True)
            def training_step(self, batch):  return F.cross_entropy(self.model(batch[0]), batch[1])
    """

    config_class: ClassVar[type] = Config
    automatic_optimization: ClassVar[bool] = True

    def __init__(self, cfg: DictConfig | dict | None = None, callbacks: list[Callback] | None = None) -> None:
        self.cfg: DictConfig = cfg if isinstance(cfg, DictConfig) else build_config(self.config_class, cfg or {})
        self._validate_config()
        # A plain copy for the loop: reading an OmegaConf node costs microseconds, paid several times a step.
        self.settings: TrainerConfig = OmegaConf.to_object(self.cfg.trainer)
        self.state = LoopState()
        self.device = self._resolve_device(self.settings.device)
        self.dist = DistributedEnv()
        self.sharded = uses_fsdp(self.cfg)  # FSDP: sharded model and optimizer state, DCP checkpoints
        self._user_callbacks = list(callbacks or [])
        self.callbacks: list[Callback] = []
        self.module: torch.nn.Module | None = None  # the bare model: checkpoints and optimizers use it
        self.model: Any = None  # what training code calls: the module, possibly compiled/wrapped
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.optimizer_state: dict[torch.optim.Optimizer, OptimizerState] = {}
        self.loss_state: dict[Any, LossState] = {}
        self.val_metrics: dict[str, float] = {}
        self.logged_scalars: list[tuple[str, Any, int]] = []
        self.version_dir: Path | None = None
        self._specs: list[OptimizerSpec] = []
        self._hooks: dict[str, list[Any]] = {}
        self._resume: dict[str, Any] | None = None
        self._epoch_rng: dict[str, Any] | None = None

    # ----------------------------------------------------------------- what a subclass implements
    def configure_model(self) -> torch.nn.Module:
        """Build and return the model (``self.cfg`` holds the config)."""
        raise NotImplementedError(f"{type(self).__name__} must implement configure_model() returning a Module")

    def configure_optimizers(self) -> Any:
        """Return an optimizer, a list of them, or dicts with ``optimizer``/``lr_scheduler``/``name``."""
        raise NotImplementedError(f"{type(self).__name__} must implement configure_optimizers()")

    def train_dataloader(self) -> Any:
        """Return an iterable of training batches (usually a DataLoader)."""
        raise NotImplementedError(f"{type(self).__name__} must implement train_dataloader()")

    def val_dataloader(self) -> Any:
        """Return an iterable of validation batches, or None for no validation."""
        return None

    def training_step(self, batch: Any) -> Any:
        """Return the loss (automatic optimization), or call ``backward``/``step`` yourself (manual)."""
        raise NotImplementedError(f"{type(self).__name__} must implement training_step(batch)")

    def validation_step(self, batch: Any) -> dict[str, Any]:
        """Return metrics for one batch; the Trainer averages them weighted by batch size."""
        raise NotImplementedError(
            f"{type(self).__name__} returns a val_dataloader, so it must implement "
            "validation_step(batch) returning a dict of metrics"
        )

    def configure_callbacks(self) -> list[Callback]:
        """Extra callbacks this Trainer always wants."""
        return []

    # ----------------------------------------------------------------- what training code calls
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The single optimizer (an error when there are several: use ``self.optimizers[name]``)."""
        if len(self.optimizers) != 1:
            raise AttributeError(
                f"there are {len(self.optimizers)} optimizers ({', '.join(self.optimizers)}); use self.optimizers[name]"
            )
        return next(iter(self.optimizers.values()))

    def backward(self, loss: torch.Tensor, loss_id: Any = 0, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Backpropagate ``loss``; ``loss_id`` picks its loss scaler, ``optimizer`` limits which params get grads."""
        inputs = None
        if optimizer is not None:
            inputs = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        backward = BackwardState(loss=loss, loss_id=loss_id, inputs=inputs)
        loss_state = self.loss_state.get(loss_id)
        if loss_state is None:
            loss_state = self.loss_state[loss_id] = LossState(loss_id)
        loss_state.backwards += 1
        for opt_state in self.optimizer_state.values():
            opt_state.grad_norm = None
        self.fire("on_before_backward", backward)
        if self.sharded:
            backward_to(backward.loss, backward.inputs, self.module)
        else:
            backward.loss.backward(inputs=backward.inputs)
        self.fire("on_after_backward", backward)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step ``optimizer`` if this batch ends an iteration; returns whether it stepped.

        It is skipped (parameters, state and step count untouched) when a callback set ``found_inf``, and
        not stepped at all when none of its parameters received a gradient this iteration.
        """
        if not self.state.is_iteration_end:
            return False
        opt_state = self.optimizer_state.get(optimizer)
        if opt_state is None:
            raise ValueError("step() got an optimizer that configure_optimizers() did not return")
        if opt_state.stepped or opt_state.skipped:
            raise RuntimeError(f"optimizer '{opt_state.name}' was already stepped in this iteration")
        if not any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
            return False
        self.fire("on_before_optimizer_step", optimizer)
        if opt_state.found_inf:
            opt_state.skipped = True
            opt_state.skipped_steps += 1
            reached = sorted(opt_state.loss_ids, key=str)
            culprits = [k for k in reached if k in self.loss_state and self.loss_state[k].found_inf]
            self.fire("on_optimizer_step_skipped", optimizer, culprits or reached)
            return False
        optimizer.step()
        opt_state.stepped = True
        opt_state.steps += 1
        opt_state.epoch_steps += 1
        self.fire("on_after_optimizer_step", optimizer)
        return True

    def grad_norm(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Total L2 norm of ``optimizer``'s gradients, computed once per backward and shared by callbacks."""
        opt_state = self.optimizer_state[optimizer]
        if opt_state.grad_norm is None:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, foreach=True) if grads else torch.zeros(())
            opt_state.grad_norm = full_norm(norm) if self.sharded else norm  # sharded: a collective
        return opt_state.grad_norm

    def log(self, tag: str, value: float | torch.Tensor, step: int | None = None) -> None:
        """Queue a scalar for the loggers; it is written at the end of the batch (default step: this iteration)."""
        self.logged_scalars.append((tag, value, self.state.iteration if step is None else step))

    def fire(self, hook: str, *args: Any) -> None:
        """Call ``hook`` on every callback that overrides it, in the declared order."""
        for method in self._hooks[hook]:
            method(self, *args)

    @property
    def global_rank(self) -> int:
        return self.dist.rank

    @property
    def world_size(self) -> int:
        return self.dist.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.dist.rank == 0

    # ----------------------------------------------------------------- fit
    def fit(self, resume: str | os.PathLike | None = None) -> None:
        """Train. ``resume``: a checkpoint path, or ``"last"`` for the newest ``last.pt`` under ``run_dir``."""
        self.dist = setup_distributed(self.cfg)
        rank_zero_only.rank = self.dist.rank
        clean = False
        try:
            self._fit(resume)
            clean = True
        finally:
            teardown_distributed(self.dist, clean)

    def _fit(self, resume: str | os.PathLike | None) -> None:
        if self.dist.enabled and self.device.type == "cuda":
            self.device = torch.device("cuda", self.dist.local_rank)
        check_same_config(self.cfg, self.dist)
        checkpoint_path = self._resolve_resume(resume)
        # Loaded before any user code runs, so an empty or foreign file fails at once (shards need the model).
        plain = checkpoint_path is not None and not is_sharded_checkpoint(checkpoint_path)
        checkpoint = load_checkpoint(checkpoint_path) if plain else None
        self._setup(checkpoint, checkpoint_path)
        try:
            self.fire("on_fit_start")
            self.fire("on_train_start")
            while not self._finished():
                self._run_epoch()
            self.fire("on_train_end")
        except BaseException as exc:
            self.fire("on_exception", exc)
            raise
        finally:
            self.fire("on_fit_end")

    def _finished(self) -> bool:
        s, t = self.state, self.settings
        return s.should_stop or s.epoch >= t.max_epochs or 0 <= t.max_steps <= s.global_step

    def _run_epoch(self) -> None:
        s = self.state
        for opt_state in self.optimizer_state.values():
            opt_state.epoch_steps = 0
        self.module.train()
        self.fire("on_train_epoch_start")
        exhausted = True
        for batch in self._epoch_batches():
            self._run_batch(batch)
            if 0 <= self.settings.max_steps <= s.global_step:
                s.should_stop = True
                exhausted = s.batches_done == self._num_train_batches
                break
        s.epoch_finished = exhausted
        if exhausted:
            if _every(self.settings.val_every_n_epochs, s.epoch + 1):
                self._validate()
            self._step_schedulers("epoch")
        self.fire("on_train_epoch_end")
        if exhausted:
            s.epoch, s.batches_done, s.epoch_finished = s.epoch + 1, 0, False

    def _run_batch(self, batch: Any) -> None:
        s, accumulate = self.state, self.settings.accumulate_grad_batches
        s.batch_idx = s.batches_done
        s.iteration = s.global_step + 1
        s.is_iteration_start = s.batch_idx % accumulate == 0
        s.is_iteration_end = (s.batch_idx + 1) % accumulate == 0 or s.batch_idx + 1 == self._num_train_batches
        if s.is_iteration_start:
            for opt_state in self.optimizer_state.values():
                opt_state.begin_iteration()
            for loss_state in self.loss_state.values():
                loss_state.begin_iteration()
        batch = self._to_device(batch)
        self.fire("on_train_batch_start", batch)
        outputs = self._training_step(batch)
        s.batches_done += 1
        if s.is_iteration_end:
            self._end_iteration()
        self.fire("on_train_batch_end", outputs, batch)
        self.logged_scalars.clear()

    def _training_step(self, batch: Any) -> dict[str, Any]:
        out = self.training_step(batch)
        if not self.automatic_optimization:
            return self._detached(out)
        loss = out if isinstance(out, torch.Tensor) else out.get("loss") if isinstance(out, dict) else None
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"training_step must return the loss tensor or a dict with 'loss' under automatic "
                f"optimization; got {type(out).__name__}. Set automatic_optimization = False to "
                "call self.backward/self.step yourself."
            )
        accumulate = self.settings.accumulate_grad_batches
        self.backward(loss / accumulate if accumulate > 1 else loss)
        for optimizer in self.optimizers.values():
            self.step(optimizer)
        return self._detached(out if isinstance(out, dict) else {"loss": loss})

    def _end_iteration(self) -> None:
        self._step_schedulers("step")
        for optimizer in self.optimizers.values():
            self.fire("on_before_zero_grad", optimizer)
            optimizer.zero_grad(set_to_none=True)
        self.state.global_step += 1
        if _every(self.settings.val_every_n_steps, self.state.global_step):
            self._validate()

    def _step_schedulers(self, interval: str) -> None:
        for spec in self._specs:
            opt_state = self.optimizer_state[spec.optimizer]
            stepped = opt_state.stepped if interval == "step" else opt_state.epoch_steps > 0
            count = opt_state.steps if interval == "step" else self.state.epoch + 1
            for sched in spec.schedulers:
                if sched.interval != interval or not stepped or count % sched.frequency:
                    continue
                if sched.monitor is None:
                    sched.scheduler.step()
                    continue
                key = sched.monitor.removeprefix("val/")
                if key not in self.val_metrics:
                    raise KeyError(
                        f"scheduler of '{spec.name}' monitors '{sched.monitor}', but validation "
                        f"produced {sorted(self.val_metrics) or 'nothing yet'}"
                    )
                sched.scheduler.step(self.val_metrics[key])

    @torch.no_grad()
    def _validate(self) -> None:
        if self._val_loader is None:
            return
        self.fire("on_validation_start")
        was_training = self.module.training
        self.module.eval()
        sums: dict[str, float] = {}
        seen = 0
        limit = self.settings.limit_val_batches
        for i, batch in enumerate(self._val_loader):
            if limit is not None and i >= limit:
                break
            batch = self._to_device(batch)
            metrics = self.validation_step(batch)
            n = _batch_size(batch) or 1
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value) * n
            seen += n
        self.module.train(was_training)
        *totals, seen = all_reduce_sum([*sums.values(), float(seen)], self.dist)
        self.val_metrics = {key: total / max(seen, 1) for key, total in zip(sums, totals, strict=True)}
        self.fire("on_validation_end", dict(self.val_metrics))

    # ----------------------------------------------------------------- set-up and data
    def _setup(self, checkpoint: dict[str, Any] | None, checkpoint_path: Path | None) -> None:
        if self.settings.seed is not None:
            seed_everything(self.settings.seed)
        module = self.configure_model()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"configure_model() must return a torch.nn.Module, got {type(module).__name__}")
        self.module = module.to(self.device)
        if self.sharded:  # before the optimizers: they must hold the sharded parameters
            self.module = shard_model(self.module, self.cfg, self.device)
        self.model = torch.compile(self.module) if self.settings.compile else self.module
        self._specs = normalize_optimizers(self.configure_optimizers())
        self.optimizers = {spec.name: spec.optimizer for spec in self._specs}
        self.optimizer_state = {spec.optimizer: OptimizerState(name=spec.name) for spec in self._specs}
        seed = self.settings.seed or 0
        self._train_loader = distributed_loader(self.train_dataloader(), seed, self.dist, shuffle_default=True)
        self._val_loader = distributed_loader(self.val_dataloader(), seed, self.dist, shuffle_default=False)
        self._num_train_batches = self._count_train_batches()
        self._setup_callbacks()
        if checkpoint_path is not None:  # before anything is written: a checkpoint that does not fit leaves no trace
            if checkpoint is None:
                checkpoint = load_sharded(checkpoint_path, self.module, self.optimizers)
            self._restore(checkpoint, checkpoint_path)
        self.version_dir = checkpoint_path.parent.parent if self._inside_run(checkpoint_path) else None
        if self.is_global_zero and self.version_dir is None:
            self.version_dir = new_version_dir(self.cfg.run_dir)
        if self.sharded:  # every rank writes its shards into the checkpoint directory
            self.version_dir = broadcast_object(self.version_dir, self.dist)
        if self.is_global_zero:
            self._save_config()

    def _setup_callbacks(self) -> None:
        from ampkit.callbacks import default_callbacks

        self.callbacks = order_callbacks(default_callbacks(self) + self.configure_callbacks() + self._user_callbacks)
        self._hooks = {
            hook: [getattr(cb, hook) for cb in self.callbacks if is_overridden(hook, cb, Callback)] for hook in HOOKS
        }

    def _count_train_batches(self) -> int | None:
        try:
            total = len(self._train_loader)
        except TypeError:
            total = None
        limit = self.settings.limit_train_batches
        if limit is not None:
            total = limit if total is None else min(total, limit)
        return total

    def _epoch_batches(self) -> Iterator[Any]:
        """This epoch's batches; after a mid-epoch resume, the same ones the interrupted run would have seen."""
        resume, self._resume = self._resume, None
        skip = resume["batches_done"] if resume else 0
        if resume:  # mid-epoch: replay the epoch's start to draw the same order, then skip what was done
            restore_rng(resume["epoch_rng"] if skip else resume["rng"])
        sampler = getattr(self._train_loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):  # DistributedSampler: a new shuffle each epoch, the same on every rank
            sampler.set_epoch(self.state.epoch)
        self._epoch_rng = capture_rng()
        iterator = iter(self._train_loader)
        for _ in range(skip):
            next(iterator)
        if skip:
            restore_rng(resume["rng"])
        for index, batch in enumerate(iterator, start=skip):
            if self._num_train_batches is not None and index >= self._num_train_batches:
                return
            yield batch

    def _to_device(self, batch: Any) -> Any:
        if self.device.type == "cpu":
            return batch
        return apply_to_collection(batch, torch.Tensor, lambda t: t.to(self.device, non_blocking=True))

    @staticmethod
    def _detached(out: Any) -> dict[str, Any]:
        if out is None:
            return {}
        if isinstance(out, torch.Tensor):
            return {"loss": out.detach()}
        if not isinstance(out, dict):
            raise TypeError(f"training_step must return a tensor, a dict or None; got {type(out).__name__}")
        return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in out.items()}

    # ----------------------------------------------------------------- checkpoints
    def loop_position(self) -> dict[str, int]:
        """Where a run resumed from now would continue: epoch, batches already done in it, global step."""
        s = self.state
        if s.epoch_finished:
            return {"epoch": s.epoch + 1, "batches_done": 0, "global_step": s.global_step}
        return {"epoch": s.epoch, "batches_done": s.batches_done, "global_step": s.global_step}

    def checkpoint_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-identically: model, optimizers, schedulers, callbacks, loop, RNG.

        Under FSDP the model and optimizer shards are not in it: every rank writes its own (``save_sharded``).
        """
        checkpoint = {
            FORMAT_KEY: FORMAT_VERSION,
            "schedulers": {spec.name: [sc.scheduler.state_dict() for sc in spec.schedulers] for spec in self._specs},
            "optimizer_counts": {
                st.name: {"steps": st.steps, "skipped_steps": st.skipped_steps} for st in self.optimizer_state.values()
            },
            "loop": self.loop_position(),
            "rng": capture_rng(),
            "epoch_rng": self._epoch_rng,
            "val_metrics": dict(self.val_metrics),
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
            "config": OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True),
        }
        if not self.sharded:
            checkpoint["model"] = self.module.state_dict()
            checkpoint["optimizers"] = {spec.name: spec.optimizer.state_dict() for spec in self._specs}
        self.fire("on_save_checkpoint", checkpoint)
        return checkpoint

    def _restore(self, checkpoint: dict[str, Any], path: Path) -> None:
        try:
            self.module.load_state_dict(checkpoint["model"])
            for spec in self._specs:
                spec.optimizer.load_state_dict(checkpoint["optimizers"][spec.name])
                for sched, state in zip(spec.schedulers, checkpoint["schedulers"][spec.name], strict=True):
                    sched.scheduler.load_state_dict(state)
        except (KeyError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint '{path}' does not fit this run's model/optimizers: {exc}") from None
        for opt_state in self.optimizer_state.values():
            counts = checkpoint["optimizer_counts"].get(opt_state.name, {})
            opt_state.steps = counts.get("steps", 0)
            opt_state.skipped_steps = counts.get("skipped_steps", 0)
        for cb in self.callbacks:
            if cb.state_key in checkpoint["callbacks"]:
                cb.load_state_dict(checkpoint["callbacks"][cb.state_key])
        loop = checkpoint["loop"]
        self.state.epoch, self.state.batches_done, self.state.global_step = (
            loop["epoch"],
            loop["batches_done"],
            loop["global_step"],
        )
        self.val_metrics = dict(checkpoint.get("val_metrics", {}))
        self._resume = {
            "batches_done": loop["batches_done"],
            "rng": checkpoint["rng"],
            "epoch_rng": checkpoint["epoch_rng"],
        }
        self.fire("on_load_checkpoint", checkpoint)

    def _resolve_resume(self, resume: str | os.PathLike | None) -> Path | None:
        if resume is None:
            return None
        if str(resume) == "last":  # rank zero decides, so every rank loads the same file
            last = broadcast_object(latest_checkpoint(self.cfg.run_dir) if self.is_global_zero else None, self.dist)
            if last is None:
                raise CheckpointError(
                    f"resume='last': no checkpoint under run_dir '{self.cfg.run_dir}' (no version_N/checkpoints/"
                    "last.pt); check run_dir, or start without resume for a fresh run"
                )
            return last
        path = Path(resume)
        if not (path.is_file() or is_sharded_checkpoint(path)):
            raise CheckpointError(
                f"resume: no checkpoint file or sharded checkpoint at '{path}' (pass a path or 'last')"
            )
        return path

    @staticmethod
    def _inside_run(path: Path | None) -> bool:
        return path is not None and path.parent.name == "checkpoints" and (path.parent.parent / "config.yaml").is_file()

    def _save_config(self) -> None:
        text = OmegaConf.to_yaml(self.cfg, resolve=True)
        target = self.version_dir / "config.yaml"
        if target.is_file() and target.read_text() != text:
            target = self.version_dir / f"config.resumed_at_step_{self.state.global_step}.yaml"
        if not target.is_file():
            target.write_text(text)

    # ----------------------------------------------------------------- validation of settings
    def _validate_config(self) -> None:
        check_values(self.cfg)
        if os.environ.get("RANK", "0") == "0":  # only rank zero writes the run directory
            reason = unwritable_reason(self.cfg.run_dir)
            if reason is not None:
                raise ConfigError(f"config key 'run_dir': cannot create a run under '{self.cfg.run_dir}': {reason}")
        validate_strategy(self.cfg)

    @staticmethod
    def _resolve_device(name: str) -> torch.device:
        if name == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(name)
        except RuntimeError:
            raise ConfigError(
                f"config key 'trainer.device': '{name}' is not a device; use auto, cpu, cuda or cuda:N"
            ) from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                f"config key 'trainer.device': '{name}' requested but CUDA is not available; use auto or cpu"
            )
        return device
