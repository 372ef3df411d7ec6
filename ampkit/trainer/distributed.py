"""Process-group set-up from torchrun's environment, and the few collectives the loop itself needs."""

from __future__ import annotations

import gc
import hashlib
import os
import pickle
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_warn
from omegaconf import DictConfig, OmegaConf

from ampkit.amp import read_flags
from ampkit.config import ConfigError, flatten, one_max_time
from ampkit.trainer.batch_counts import loader_length
from ampkit.trainer.devices import resolve_device
from ampkit.trainer.launch_env import check_launch_environment, launch_int
from ampkit.wording import shown

T = TypeVar("T")


class DistributedError(RuntimeError):
    """A collective failed: a rank died, stopped responding, or the ranks diverged."""


def is_communication_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came from the process group's transport rather than from user code (a ``DataLoader``'s own
    ``timeout``, "DataLoader timed out after N seconds", is the user's data, not a collective)."""
    markers = ("gloo", "NCCL", "Connection reset", "Connection closed", "timed out", "Timed out")
    if isinstance(exc, (dist.DistError, DistributedError)):  # the latter: one already diagnosed
        return True
    message = str(exc)
    return isinstance(exc, RuntimeError) and "DataLoader" not in message and any(m in message for m in markers)


def diagnose_failure(what: str, exc: BaseException, wait_s: float = 5.0) -> DistributedError:
    """A failed collective as one line: this rank, ``what`` failed, which ranks did not check in through the
    rendezvous store within ``wait_s`` (died or stopped responding), and the transport's first line."""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    message = f"rank {dist.get_rank()}: {what} failed: {_missing_ranks(wait_s)} ({type(exc).__name__}: {first_line})"
    return DistributedError(message)


def _missing_ranks(wait_s: float) -> str:
    """After a failed collective, survivors check in through the rendezvous store; absentees are named."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=wait_s))
        me, world = dist.get_rank(), dist.get_world_size()
        store.set(f"ampkit/alive/{me}", "1")
        deadline = time.monotonic() + wait_s
        missing, failed = [r for r in range(world) if r != me], {}
        while missing and time.monotonic() < deadline:
            failed |= {r: store.get(f"ampkit/failed/{r}").decode() for r in missing
                       if store.check([f"ampkit/failed/{r}"])}  # fmt: skip
            missing = [r for r in missing if r not in failed and not store.check([f"ampkit/alive/{r}"])]
            time.sleep(0.05)
        if missing:  # a rank that arrives later learns that this one stopped waiting for it
            store.set(f"ampkit/missed/{me}", ",".join(map(str, missing)))
        left = [r for r in range(world) if r != me and r not in failed and store.check([f"ampkit/missed/{r}"])
                and str(me) in store.get(f"ampkit/missed/{r}").decode().split(",")]  # fmt: skip
    except Exception:  # the store itself is gone: it lives with rank 0 or the launcher
        return "the rendezvous store is unreachable, so rank 0 or the launcher died"
    found = [f"rank {rank} failed with {why}" for rank, why in sorted(failed.items())]
    if missing:
        found.append(f"rank(s) {', '.join(map(str, missing))} died or stopped responding")
    if left:  # this rank was the slow one: its peers' collective timed out first
        found.append(
            f"rank(s) {', '.join(map(str, left))} stopped waiting for this rank at an earlier collective and left: "
            "this rank was slower than distributed.timeout_s there (stuck, or doing work the others were not)"
        )
    return "; ".join(found) or "all ranks are alive; a collective timed out or the ranks diverged"


@dataclass(frozen=True)
class DistributedEnv:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False  # the Trainer created the process group, so it destroys it
    enabled: bool = field(init=False)  # more than one process: a field, not a property (asked every backward)

    def __post_init__(self) -> None:
        object.__setattr__(self, "enabled", self.world_size > 1)


def launched_world_size() -> int:
    """How many processes torchrun launched (``WORLD_SIZE``; 1 without it), known before the group is joined."""
    return launch_int("WORLD_SIZE")


def setup_distributed(cfg: DictConfig) -> DistributedEnv:
    """Join the process group torchrun describes (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``...), if any."""
    check_launch_environment()
    world_size, local_rank = launched_world_size(), launch_int("LOCAL_RANK")
    backend, on_gpu = _checked_backend(cfg)  # one rule alone or under torchrun: a config that one refuses, both do
    if world_size <= 1:
        if cfg.distributed.strategy != "fsdp":
            return DistributedEnv()
        device = resolve_device(cfg.trainer.device)
        if on_gpu and device.index is not None:  # trainer.device=cuda:1: NCCL and FSDP stage on the current device
            torch.cuda.set_device(device.index)
        if dist.is_initialized():
            return DistributedEnv()
        # FSDP needs a process group even alone: one process shards trivially, so its checkpoints are
        # the same DCP format as a multi-rank run's and resume at any world size.
        dist.init_process_group("cpu:gloo,cuda:nccl" if on_gpu else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)  # fmt: skip
        return DistributedEnv(owns_group=True)
    if (backend == "nccl" or on_gpu) and local_rank >= torch.cuda.device_count():  # gloo too trains on cuda:LOCAL_RANK
        raise ConfigError(
            f"LOCAL_RANK {local_rank} needs cuda:{local_rank}, but this machine has {torch.cuda.device_count()} "
            "GPU(s): launch at most one process per GPU (torchrun --nproc-per-node), or set trainer.device=cpu "
            "to train on CPU processes with gloo"
        )
    if backend == "nccl" or on_gpu:  # also in a group the script made: NCCL's object collectives stage on this GPU
        torch.cuda.set_device(local_rank)
    owns = not dist.is_initialized()
    if owns:
        check_launch_environment(joining=True)  # torchrun's rendezvous variables, all of them, before torch reads one
        timeout = timedelta(seconds=cfg.distributed.timeout_s)
        store, rank, size = _fresh_group_store(timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    return DistributedEnv(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                          owns_group=owns)  # fmt: skip


def _checked_backend(cfg: DictConfig) -> tuple[str, bool]:
    """``distributed.backend`` as the run would use it (``auto`` resolved) and whether the run trains on a GPU.

    Raises:
        ConfigError: nccl for a run on the CPU (every collective would hand NCCL a CPU tensor), also in a single
            process, whose config would fail once launched on more.
    """
    backend = cfg.distributed.backend
    on_gpu = torch.cuda.is_available() and resolve_device(cfg.trainer.device).type == "cuda"
    if backend == "auto":
        backend = "nccl" if on_gpu else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"config key 'distributed.backend': '{backend}' is not supported; use auto, gloo or nccl")
    if backend == "nccl" and not on_gpu:
        why = (
            f"trainer.device is '{cfg.trainer.device}', so the run trains on the CPU"
            if torch.cuda.is_available()
            else "this machine has no usable CUDA GPU"
        )
        fix = "or trainer.device=cuda" if torch.cuda.is_available() else "or run where CUDA is available"
        raise ConfigError(
            f"config key 'distributed.backend': nccl takes CUDA tensors only, but {why}: use "
            f"distributed.backend=gloo (or auto) for CPU processes, {fix}"
        )
    return backend, on_gpu


_rendezvous: tuple[dist.Store, int, int] | None = None  # torchrun's store, this rank, world size: kept for the process
_groups_created = 0


def _fresh_group_store(timeout: timedelta) -> tuple[dist.Store, int, int]:
    """Torchrun's rendezvous store under a key prefix no earlier group of this process used, with rank and size.

    torch gives every default group the same keys, so a script's second group (``fit`` then ``validate``) would
    read the first one's connection addresses and hang. Each group gets its own prefix, in the same order on
    every rank, on one store kept for the process: rank 0 hosts it outside torchrun's agent, and a new one
    could start while a slower peer still reads the old one.
    """
    global _rendezvous, _groups_created
    if _rendezvous is None:
        _rendezvous = next(dist.rendezvous("env://", timeout=timeout))
    store, rank, size = _rendezvous
    store.set_timeout(timeout)
    _groups_created += 1
    # torchrun's agent keeps its store across the restarts of a worker group (--max-restarts): a restarted group's
    # keys are its own too, or its ranks would connect to the dead attempt's addresses.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"ampkit_group_{attempt}_{_groups_created}", store), rank, size


# How long a rank leaving a gloo group lets gloo's threads take the GIL: they need microseconds of it, and a loaded
# machine's scheduler runs a waiting thread within some tens of milliseconds. A barrier alone is not enough: it ends
# when the collectives are done, not when the threads have let go of them (CI's two loaded cores aborted an exit).
GLOO_RELEASE_GRACE_S = 0.1


def let_gloo_threads_release() -> None:
    """Sleep a moment with the GIL free where the default group is gloo's: a gloo worker thread may still need the GIL
    to free a finished collective's Python tensor, and one that gets it only as the group is destroyed (its join
    waits on the thread, the GIL held) or as the interpreter shuts down hangs or aborts the process."""
    if dist.is_initialized() and dist.get_backend() == "gloo":
        time.sleep(GLOO_RELEASE_GRACE_S)


def teardown_distributed(env: DistributedEnv, clean: bool = True, failure: BaseException | None = None) -> None:
    """Destroy the process group; after a clean run, only once every rank got here.

    A rank that exits while a peer still has gloo work in flight makes the peer's transport thread fail, and a
    gloo worker thread that frees the last collective's Python tensor after the interpreter began shutting down
    is ended mid-release: either aborts the process ("terminate called without an active exception") after all
    its work is done. The barrier makes ranks leave together, and releases the GIL to those threads while it
    waits; after an exception it is skipped (a peer may be dead), and this rank's own ``failure`` is left on the
    store first, for the peers' diagnosis to name. Either way the rank then sleeps a moment with the GIL free
    (:func:`let_gloo_threads_release`) before the destroy joins those threads and ``gc.collect`` runs.
    """
    if env.owns_group and dist.is_initialized():
        if clean:
            dist.barrier()
            let_gloo_threads_release()
        else:
            if env.enabled and failure is not None and not is_communication_failure(failure):
                _leave_failure(failure, env)
            let_gloo_threads_release()
        dist.destroy_process_group()
        gc.collect()  # what still referenced the group goes now, not during interpreter shutdown


def _leave_failure(failure: BaseException, env: DistributedEnv) -> None:
    """Put this rank's failure (its type and first line) on the group's store, where :func:`diagnose_failure` on
    the peers, whose next collective fails as this rank leaves, finds it."""
    text = str(failure).strip().splitlines()[0] if str(failure).strip() else ""
    if not text and isinstance(failure, KeyboardInterrupt):  # a Ctrl-C or SIGINT to this rank says nothing itself
        text = "interrupted (Ctrl-C or SIGINT)"
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=2))
        name = type(failure).__name__
        store.set(f"ampkit/failed/{env.rank}", (f"{name}: {text}" if text else name)[:300])
    except Exception:  # the store is gone with rank 0: the peers name this rank as dead instead
        pass


def collective_device(group: Any = None) -> torch.device:
    """The device this rank's tensor collectives on ``group`` (None: the default group) take their tensors on: the CPU
    where its backend takes CPU tensors (gloo; "cpu:gloo,cuda:nccl"), else this rank's own GPU (NCCL refuses a CPU
    tensor, and takes each rank's on the GPU set at set-up, as its object collectives stage through it)."""
    backend = str(dist.get_backend(group))
    if ":" in backend:  # a backend per device type
        takes_cpu = any(pair.split(":")[0].strip() == "cpu" for pair in backend.split(","))
    else:
        takes_cpu = "cpu" in dist.Backend.backend_capability.get(backend, ["cpu"])
    return torch.device("cpu") if takes_cpu else torch.device("cuda", torch.cuda.current_device())


def broadcast_object(value: Any, env: DistributedEnv | None = None) -> Any:
    """Rank zero's ``value`` on every rank (``env`` None: of the process group there is, if any)."""
    if not (dist.is_initialized() if env is None else env.enabled):
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def decided_by_rank_zero(decide: Callable[[], T], env: DistributedEnv) -> T:
    """``decide()``, run on rank zero only, and its value (which must pickle) on every rank; where it raises, every
    rank raises that error (its type and message), so that no rank trains on into a collective rank zero never joins,
    to fail there with another error (or, under NCCL, which may not notice a peer that left, to wait there until
    ``distributed.timeout_s``)."""
    if not env.enabled:
        return decide()
    outcome = None
    if env.rank == 0:
        try:
            outcome = (True, decide())
        except Exception as exc:
            broadcast_object((False, _travelling(exc)), env)
            raise  # rank zero's own error, with its traceback
    decided, value = broadcast_object(outcome, env)
    if not decided:
        raise value
    return value


def raise_the_first_failure(failure: BaseException | None, env: DistributedEnv) -> None:
    """Every rank's ``failure`` (an error met on that rank alone, or None), gathered (one collective): where any rank
    has one, every rank raises the lowest such rank's, its type and message (that rank its own, with its traceback),
    so that all stop together with one error rather than the others failing later in a collective it left."""
    if not env.enabled:
        if failure is not None:
            raise failure
        return
    failures = gather_object(None if failure is None else _travelling(failure), env)
    for rank, found in enumerate(failures):
        if found is None:
            continue
        if rank == env.rank:
            raise failure
        if hasattr(found, "add_note"):  # Python 3.11+
            found.add_note(f"ampkit: rank {rank} met this error; every rank stops with it")
        raise found


def _travelling(exc: BaseException) -> BaseException:
    """``exc``, or where it cannot pickle, a RuntimeError of its type and message: what goes to the other ranks."""
    return exc if _picklable(exc) else RuntimeError(f"{type(exc).__name__}: {exc}")


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # a value that cannot travel to the other ranks
        return False
    return True


def broadcast_module_(module: torch.nn.Module, env: DistributedEnv) -> None:
    """Give every rank rank 0's parameters and buffers, in place: all ranks then start from one model, whatever
    their own initialisation (``trainer.seed: null``), before anything is derived from it (an O2 master copy)."""
    if not env.enabled:
        return
    try:
        with torch.no_grad():  # an in-place collective on a parameter must not enter the autograd graph
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, 0)
    except RuntimeError as exc:
        if not is_communication_failure(exc):
            raise
        raise DistributedError(f"rank {env.rank}: broadcast of the initial weights failed: {exc}") from exc


def check_same_config(cfg: DictConfig, env: DistributedEnv) -> None:
    """Fail at start-up, on every rank, when ranks were launched with different configs."""
    if not env.enabled:
        return
    flat = flatten(one_max_time(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)), sep=".")  # as written
    digest = hashlib.sha256(repr(sorted(flat.items())).encode()).hexdigest()
    gathered: list[Any] = [None] * env.world_size
    dist.all_gather_object(gathered, (digest, flat))
    reference = gathered[0][1]
    for rank, (other_digest, other) in enumerate(gathered):
        if other_digest == gathered[0][0]:
            continue
        keys = sorted(k for k in set(reference) | set(other) if reference.get(k) != other.get(k))
        differences = "; ".join(
            f"{k}: rank 0 has {shown(reference.get(k))}, rank {rank} has {shown(other.get(k))}" for k in keys[:8]
        )
        raise ConfigError(f"ranks were launched with different configs ({differences})")


def gather_object(value: Any, env: DistributedEnv) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank."""
    if not env.enabled:
        return [value]
    gathered: list[Any] = [None] * env.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def all_reduce_sum(values: list[float], env: DistributedEnv) -> list[float]:
    """Element-wise sum over ranks (one collective)."""
    if not env.enabled:
        return values
    # Made on the host and sent without waiting: torch.tensor(values, device=cuda) waits for the GPU after its copy,
    # a sync besides the one read of the sums (a copy from the host to a GPU is safe non-blocking; back, it is not).
    tensor = torch.tensor(values, dtype=torch.float64).to(collective_device(), non_blocking=True)
    dist.all_reduce(tensor)
    return tensor.cpu().tolist()


def any_rank(flags: Sequence[torch.Tensor | bool], env: DistributedEnv) -> list[bool]:
    """For each flag (a bool, or a one-element tensor that is set when non-zero), whether it is set on any
    rank: one device-to-host read, and one collective when distributed. Every rank passes as many flags."""
    if not env.enabled:
        if len(flags) == 1 and isinstance(flags[0], torch.Tensor):
            return [flags[0].item() != 0]  # the common case: one loss, one process (a one-element flag)
        read = iter(read_flags([f for f in flags if isinstance(f, torch.Tensor)]))
        return [next(read) if isinstance(f, torch.Tensor) else bool(f) for f in flags]
    device = collective_device()
    values = torch.stack(
        [
            f.reshape(()).to(device, torch.float32)
            if isinstance(f, torch.Tensor)
            else torch.full((), float(f), device=device)  # a fill: a host bool copied to a GPU is a sync of its own
            for f in flags
        ]
    )
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [v != 0 for v in values.tolist()]


def any_rank_on_device(flags: list[torch.Tensor], env: DistributedEnv) -> list[torch.Tensor]:
    """For each one-element flag, the largest value on any rank, left on the device (an all-reduce, no host read;
    one process: the flags as they are). Every rank passes as many flags, in the same order."""
    if not env.enabled or not flags:
        return flags
    agreed = torch.stack([f.reshape(()).to(torch.float32) for f in flags])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return list(agreed.unbind())


def distributed_loader(
    loader: Any, seed: int, env: DistributedEnv, shuffle_default: bool, source: str = "train_dataloader()"
) -> Any:
    """``loader`` rebuilt with a ``DistributedSampler`` (each rank its shard; reseeded per epoch by the loop).

    A shuffled loader (a plain ``RandomSampler``, as ``shuffle=True`` makes) gets one in a single process too:
    the order is then a function of (seed, epoch) and the world size only, one permutation dealt round-robin to
    the ranks, so one process at batch ``W*B`` steps through the same samples as ``W`` ranks at batch ``B``, and
    a checkpoint resumes on another world size along the same sample sequence. Loaders that already shard (a
    DistributedSampler, an IterableDataset), an unshuffled loader in one process, and non-DataLoader iterables
    are returned as they are.
    """
    from torch.utils.data import DataLoader, IterableDataset, RandomSampler
    from torch.utils.data.distributed import DistributedSampler

    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return loader
    if loader.batch_sampler is None or isinstance(sampler_of(loader), DistributedSampler):
        return loader
    shuffle = shuffle_default and isinstance(sampler_of(loader), RandomSampler)
    if not env.enabled and not (shuffle and _is_permutation(sampler_of(loader))):
        return loader
    if not env.enabled and type(loader.batch_sampler).__name__ != "BatchSampler":
        return loader
    _check_shardable(loader, source)
    sampler = DistributedSampler(loader.dataset, num_replicas=env.world_size, rank=env.rank, shuffle=shuffle,
                                 seed=seed)  # fmt: skip
    batches = loader.batch_sampler  # the loader's own, or one given as batch_sampler= (loader.batch_size is None)
    return DataLoader(
        loader.dataset, batch_size=batches.batch_size, sampler=sampler, num_workers=loader.num_workers,
        collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=batches.drop_last,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn, generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
        persistent_workers=loader.persistent_workers,
    )  # fmt: skip


def counted_batches(loader: Any, limit: int | None, source: str) -> int | None:
    """The batches a pass over ``loader`` yields (at most ``limit``) where that is sure, else None: one without a
    length, or an ``IterableDataset``'s, whose ``len`` is a hint its stream may undercut, also below ``limit``."""
    from torch.utils.data import DataLoader, IterableDataset

    if isinstance(loader, DataLoader) and isinstance(loader.dataset, IterableDataset):
        return None
    count = loader_length(loader, source)
    if count is None:
        return None
    return count if limit is None else min(count, limit)


def check_equal_batches(count: int | None, env: DistributedEnv, source: str = "train_dataloader()") -> bool:
    """Whether every rank is known to run as many training batches per epoch (one collective, at set-up); refused,
    naming each rank's count, when they are known and differ. False when some rank's count is unknown (an
    ``IterableDataset``, a generator): the loop then agrees on every batch (:func:`while_every_rank_has_a_batch`)."""
    if not env.enabled:
        return True
    counts = gather_object(count, env)
    if None in counts:
        return False
    if len(set(counts)) > 1:
        ranks = ", ".join(f"rank {rank}: {n}" for rank, n in enumerate(counts))
        raise ValueError(
            f"{source} gives the ranks different numbers of batches per epoch ({ranks}), but every training step "
            "all-reduces gradients over all ranks, so the ranks with more would wait there until "
            "distributed.timeout_s: give every rank as many (a DistributedSampler pads each shard to one size) or set "
            f"trainer.limit_train_batches={min(counts)}"
        )
    return True


def batch_agreement_group(env: DistributedEnv) -> Any:
    """The group :func:`while_every_rank_has_a_batch` agrees in: a gloo group on the CPU beside NCCL, so that asking
    whether every rank has a batch never waits for the device. Every rank calls it, at the same point."""
    return None if collective_device().type == "cpu" else dist.new_group(backend="gloo")


_NO_BATCH = object()  # what while_every_rank_has_a_batch's next() returns at the end of a rank's batches


def while_every_rank_has_a_batch(
    batches: Iterator[Any], env: DistributedEnv, group: Any, epoch: int, done: int = 0
) -> Iterator[Any]:
    """``batches`` (the epoch's from batch ``done`` on) for as long as every rank has one (one all-reduce of one
    number per batch, whatever the world size): where one rank's data runs out, every rank ends the epoch there,
    rather than the others waiting in the step's gradient all-reduce until the timeout, and rank zero warns naming
    the ranks and the count (a gather, once)."""
    iterator = iter(batches)
    while True:
        batch = next(iterator, _NO_BATCH)
        mine = torch.tensor([0 if batch is _NO_BATCH else 1], dtype=torch.int32)  # the group takes CPU tensors
        having = mine.clone()
        dist.all_reduce(having, group=group)
        ranks_with_a_batch = int(having.item())
        if ranks_with_a_batch == env.world_size:
            done += 1
            yield batch
            continue
        if ranks_with_a_batch:  # some ranks ran out while others have more: which ones
            gathered = [torch.zeros_like(mine) for _ in range(env.world_size)]
            dist.all_gather(gathered, mine, group=group)
            short = [rank for rank, flag in enumerate(gathered) if not flag.item()]
            rank_zero_warn(
                f"epoch {epoch}: the training data of rank(s) {', '.join(map(str, short))} ran out after {done} "
                f"batches, while the other ranks had more: every rank ends the epoch at {done} (each step "
                "all-reduces gradients over all ranks), so the others' remaining batches go untrained; give every "
                "rank as many batches to train on all of them"
            )
        return


def evened_by_agreement(loader: Any) -> bool:
    """Whether every rank's pass over evaluation ``loader`` may run a different number of batches, so that ranks
    whose every forward is a collective (FSDP) must agree on each one (:func:`padded_to_the_longest_rank`): not
    so for the loaders ampkit shards (``EvaluationBatches``) or a ``DistributedSampler`` (it pads)."""
    from torch.utils.data.distributed import DistributedSampler

    sampler, batches = getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)
    return not isinstance(batches, EvaluationBatches) and not isinstance(sampler, DistributedSampler)


def warn_of_uneven_evaluation(
    loader: Any, limit: int | None, env: DistributedEnv, source: str, step: str, end_hook: str
) -> None:
    """Under DDP, where every rank knows how many batches its pass over evaluation ``loader`` runs (per-rank lists)
    and the counts differ, rank zero warns that a collective of the user's in ``step`` cannot line up across ranks
    (``end_hook``: where to gather instead).
    One gather of a number, as the pass is set up; every rank joins it (ranks evened by ampkit's sharding or a
    ``DistributedSampler``, and those whose count is unknown, send None). Under FSDP the shorter ranks pad instead."""
    if not env.enabled:
        return
    counts = gather_object(counted_batches(loader, limit, source) if evened_by_agreement(loader) else None, env)
    if None in counts or len(set(counts)) == 1:
        return
    ranks = ", ".join(f"rank {rank}: {n}" for rank, n in enumerate(counts))
    rank_zero_warn(
        f"{source} gives the ranks different numbers of batches ({ranks}): each rank runs its own and the ranks meet "
        f"only at the pass's end, so a collective of your own in {step} (an all_gather of predictions) would not line "
        f"up across ranks: the rank with more batches meets the others' end-of-pass collective instead, to fail or "
        f"wait until distributed.timeout_s. Give every rank as many batches (a map-style dataset, which ampkit "
        f"shards evenly), or gather in {end_hook}"
    )


def no_batch_under_fsdp(source: str, empty: list[int], others_have: int) -> ValueError:
    """The error for ranks ``empty`` that ``source`` gives no batch while the others have ``others_have`` or more:
    under FSDP every forward is a collective, so a rank with nothing to run leaves the others' forwards unmet."""
    return ValueError(
        f"{source} gives rank(s) {', '.join(map(str, empty))} no batch while other ranks have {others_have} or more: "
        "under distributed.strategy=fsdp every rank runs each forward together, so each needs a batch; give every "
        "rank a share of the data (a map-style dataset is sharded for you)"
    )


def padded_to_the_longest_rank(batches: Any, env: DistributedEnv, source: str) -> Iterator[tuple[Any, bool]]:
    """``(batch, real)``: this rank's ``batches``, then its last one again (``real`` False: its results are
    dropped) until every rank's ran out, so every rank runs as many forwards, as FSDP's collectives in each need.
    One small collective per batch; a rank with no batch at all while others have some is refused on every rank."""
    device = collective_device()
    iterator, last, done = iter(batches), _NO_BATCH, 0
    while True:
        batch = next(iterator, _NO_BATCH)
        mine = torch.tensor(
            [batch is not _NO_BATCH, last is not _NO_BATCH or batch is not _NO_BATCH], dtype=torch.int32, device=device
        )
        gathered = [torch.zeros_like(mine) for _ in range(env.world_size)]
        dist.all_gather(gathered, mine)
        has, had = zip(*(flags.tolist() for flags in gathered), strict=True)
        if not any(has):
            return
        if not all(had):
            raise no_batch_under_fsdp(source, [rank for rank, any_batch in enumerate(had) if not any_batch], done + 1)
        done += 1
        if batch is _NO_BATCH:
            yield last, False
        else:
            last = batch
            yield batch, True


class EvaluationBatches:
    """This rank's batches of an evaluation set: its samples ``rank, rank + W, ...`` in order, none repeated
    (a ``DistributedSampler`` pads the set to a multiple of ``W`` by repeating samples, which then count twice in a
    metric), followed by filler batches until it has as many as rank zero, the rank with the most: every rank then
    runs as many steps, as the collectives of a DDP or FSDP forward need. Batches from ``real_batches`` on are
    fillers, whose results are dropped."""

    def __init__(self, size: int, batch_size: int, drop_last: bool, env: DistributedEnv) -> None:
        self.mine = range(env.rank, size, env.world_size)
        self.batch_size = batch_size
        self.real_batches = self._batches(len(self.mine), drop_last)
        self.total_batches = self._batches(len(range(0, size, env.world_size)), drop_last)
        self.filler = list(self.mine[:batch_size]) or list(range(min(batch_size, size)))

    def _batches(self, samples: int, drop_last: bool) -> int:
        return samples // self.batch_size if drop_last else -(-samples // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        for start in range(0, self.real_batches * self.batch_size, self.batch_size):
            yield list(self.mine[start : start + self.batch_size])
        for _ in range(self.total_batches - self.real_batches):
            yield self.filler

    def __len__(self) -> int:
        return self.total_batches


def filler_batches_from(loader: Any) -> int | None:
    """The index of ``loader``'s first filler batch (see ``EvaluationBatches``), None if it has none."""
    batches = getattr(loader, "batch_sampler", None)
    if isinstance(batches, EvaluationBatches) and batches.real_batches < batches.total_batches:
        return batches.real_batches
    return None


def evaluation_loader(loader: Any, env: DistributedEnv, source: str = "val_dataloader()") -> Any:
    """``loader`` (validation, test, predict) rebuilt to give each rank its share of the samples, each sample
    evaluated once over all ranks (``EvaluationBatches``); one process, loaders that already shard (a
    DistributedSampler, an IterableDataset) and non-DataLoader iterables are returned as they are."""
    from torch.utils.data import DataLoader, IterableDataset
    from torch.utils.data.distributed import DistributedSampler

    if not env.enabled or not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return loader
    if loader.batch_sampler is None:
        return loader
    if isinstance(sampler_of(loader), DistributedSampler):
        _warn_of_padding(sampler_of(loader), source)
        return loader
    _check_shardable(loader, source)
    given = loader.batch_sampler  # the loader's own, or one given as batch_sampler= (loader.batch_size is None)
    batches = EvaluationBatches(len(loader.dataset), given.batch_size, given.drop_last, env)
    return DataLoader(
        loader.dataset, batch_sampler=batches, num_workers=loader.num_workers, collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory, timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        generator=loader.generator, prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
        persistent_workers=loader.persistent_workers,
    )  # fmt: skip


def _warn_of_padding(sampler: Any, source: str) -> None:
    """A ``DistributedSampler`` evaluating a set the ranks do not divide evenly repeats samples to even out the
    shards (unless ``drop_last``, which leaves some out): said, as Lightning does, as they count twice in the means
    (in predictions, are predicted twice)."""
    size = len(sampler.dataset)
    if sampler.drop_last or size % sampler.num_replicas == 0:
        return
    twice = "are predicted twice" if source == "predict_dataloader()" else "count twice in the means"
    rank_zero_warn(
        f"{source}'s DistributedSampler repeats {sampler.total_size - size} of its {size} samples to give each of "
        f"{sampler.num_replicas} ranks as many, so they {twice}: give the DataLoader a plain sampler (or none), which "
        "ampkit shards across the ranks with each sample evaluated once"
    )


def sampler_of(loader: Any) -> Any:
    """The sampler that orders a DataLoader's samples: its batch sampler's. One given as ``batch_sampler=
    BatchSampler(sampler, ...)`` is not ``loader.sampler``, a SequentialSampler the loader never reads."""
    return getattr(loader.batch_sampler, "sampler", loader.sampler)


def _check_shardable(loader: Any, source: str) -> None:
    """Refuse a loader whose samples a sampler over its whole dataset would not reproduce: a custom batch_sampler,
    or a sampler choosing some samples (``SubsetRandomSampler``, ``WeightedRandomSampler``), which sharding the whole
    dataset would silently replace, e.g. training on the samples a split had held out."""
    from torch.utils.data import RandomSampler, SequentialSampler, WeightedRandomSampler

    if type(loader.batch_sampler).__name__ != "BatchSampler":
        raise ValueError(
            f"{source}'s custom batch_sampler cannot be sharded across ranks automatically; give the "
            "DataLoader a DistributedSampler yourself"
        )
    sampler = sampler_of(loader)
    if not isinstance(sampler, RandomSampler | SequentialSampler):
        if isinstance(sampler, WeightedRandomSampler):  # a Subset or a DistributedSampler drops the weights
            instead = "give the DataLoader a DistributedSampler subclass that draws this rank's share with the weights"
        else:
            instead = (
                "pass the chosen samples as a torch.utils.data.Subset with shuffle=True or False, or give the "
                "DataLoader a DistributedSampler yourself"
            )
        raise ValueError(
            f"{source}'s sampler {type(sampler).__name__} cannot be sharded across ranks automatically (each "
            f"rank would draw from the whole dataset, also samples it leaves out); {instead}"
        )


def _is_permutation(sampler: Any) -> bool:
    """A ``RandomSampler`` that draws each sample once per epoch (what ``shuffle=True`` makes), which a seeded
    ``DistributedSampler`` can replace; one drawing with replacement or another count is left to its own RNG."""
    return not sampler.replacement and sampler.num_samples == len(sampler.data_source)
