"""One rank of an FSDP test: ``python fsdp_worker.py SCENARIO OUT_DIR`` with torchrun-style env vars (or none:
one process, which shards trivially)."""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from dist_worker import InfOnRank1, Shuffled, SkipRecorder
from full_disk import FullDisk
from torch.distributed.tensor import DTensor

import ampkit
from ampkit.trainer.distributed import all_reduce_sum

RANK = int(os.environ.get("RANK", 0))
FSDP = {"strategy": "fsdp", "fsdp": {"shard_modules": ["Linear"]}}


class LossRecorder(ampkit.Callback):
    """The loss curve: each iteration's loss averaged over ranks (= one process's loss on the whole batch)."""

    def __init__(self):
        self.losses = {}

    def on_train_batch_end(self, trainer, outputs, batch):
        (total,) = all_reduce_sum([float(outputs["loss"])], trainer.dist)
        self.losses[trainer.state.iteration] = total / trainer.world_size


class KeepFinalState(ampkit.Callback):
    """Gathers the model at the end of training, while the process group still exists."""

    def on_train_end(self, trainer):
        self.state = full_state(trainer.module)


class FusedAdamShuffled(Shuffled):
    """Shuffled, stepped by ampkit's FusedAdam (with weight decay): under FSDP each rank steps its shards."""

    def configure_optimizers(self):
        return ampkit.ops.FusedAdam(self.module.parameters(), lr=1e-2, weight_decay=0.01)


class FusedSGDShuffled(Shuffled):
    """Shuffled, stepped by ampkit's FusedSGD with momentum, whose buffers are made at the first step."""

    def configure_optimizers(self):
        return ampkit.ops.FusedSGD(self.module.parameters(), lr=1e-2, momentum=0.9)


class NaNGradInRank1sShard(ampkit.Callback):
    """At iteration 2, one element of rank 1's gradient shard turns NaN before the step: only rank 1's shard of the
    weights is then non-finite, and every loss finite."""

    def on_before_optimizer_step(self, trainer, optimizer):
        if trainer.state.iteration == 2 and RANK == 1:
            grad = next(p.grad for p in trainer.module.parameters() if p.grad is not None)
            grad.to_local().view(-1)[0] = float("nan")


class CopiesLastAndProtectsIt(ampkit.Callback):
    """Before the save of step 4, rank zero (a user with a shell) puts a copy of the checkpoint ``last`` links to in
    the link's place, as a copy of the run that follows links makes it, and takes its write permission."""

    def on_train_batch_end(self, trainer, outputs, batch):
        if trainer.state.global_step == 4 and RANK == 0:
            import shutil

            last = trainer.version_dir / "checkpoints" / "last"
            target = last.resolve()
            last.unlink()
            shutil.copytree(target, last)
            for path in (*last.iterdir(), last):
                path.chmod(path.stat().st_mode & ~0o222)


class Rank1LateToTheSave(ampkit.Callback):
    """Rank 1 adds its state to the checkpoint of step 2 (a slow or stuck callback of its own) only 1 s after rank 0
    came to that save's barrier (its first: it counts its arrivals in the store)."""

    def on_save_checkpoint(self, trainer, checkpoint):
        if trainer.state.global_step == 2 and RANK == 1:
            import time

            store = torch.distributed.distributed_c10d._get_default_store()
            while store.add("ampkit/barriers/0", 0) < 1:
                time.sleep(0.01)
            time.sleep(1)


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (a collective: all ranks call it)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}


def run(scenario: str, out: Path, batch_size: int, resume: str | None = None) -> dict:
    """Train one scenario; returns what the test compares (also called in-process for one-process runs)."""
    cpu = {"progress_bar": False, "device": "cpu"}
    base = {"trainer_class": "x:y", "run_dir": str(out / "run"), "logging": {"tensorboard": False}, "trainer": cpu,
            "distributed": FSDP, "data": {"batch_size": batch_size}}  # fmt: skip
    extra: dict = {}
    keep = KeepFinalState()
    if scenario == "overflow_o2":
        spy = SkipRecorder()
        precision = {"opt_level": "O2", "dtype": "float16", "loss_scale": "dynamic", "init_scale": 1024.0}
        cfg = {**base, "checkpoint": {"enabled": False}, "trainer": {**cpu, "max_steps": 6}, "precision": precision}
        trainer = InfOnRank1(cfg, callbacks=[spy, keep])
        extra = {"skips": spy.skips}
    elif scenario == "resume":
        losses = LossRecorder()
        cfg = {**base, "checkpoint": {"every_n_steps": 3, "keep_last": 50},
               "trainer": {**cpu, "max_epochs": 2, "clip_grad_norm": 0.5}}  # fmt: skip
        trainer = Shuffled(cfg, callbacks=[losses, keep])
        extra = {"losses": losses.losses}
    elif scenario == "fused_adam":
        cfg = {**base, "checkpoint": {"enabled": False}, "trainer": {**cpu, "max_epochs": 1}}
        trainer = FusedAdamShuffled(cfg, callbacks=[keep])
    elif scenario == "fused_sgd":
        losses = LossRecorder()
        cfg = {**base, "checkpoint": {"every_n_steps": 4, "keep_last": 50}, "trainer": {**cpu, "max_epochs": 2}}
        trainer = FusedSGDShuffled(cfg, callbacks=[losses, keep])
        extra = {"losses": losses.losses}
    elif scenario == "gpt":  # the GPT example sharded per Block (its default under fsdp), activations recomputed
        from ampkit.config import load_config

        losses = LossRecorder()
        overrides = ["model.layers=2", "model.width=32", "model.heads=2", "model.seq_len=16", "data.val_batches=1",
                     f"data.batch_size={batch_size}", "precision.opt_level=O0", "trainer.device=cpu",
                     "trainer.progress_bar=false", "logging.tensorboard=false", "trainer.max_steps=6",
                     "trainer.val_every_n_steps=0", "checkpoint.every_n_steps=3", "checkpoint.monitor=null",
                     "checkpoint.keep_last=5", "generate.every_n_steps=3", "generate.tokens=4",
                     "trainer.activation_checkpointing=[Block]", "distributed.strategy=fsdp",
                     f"run_dir={out / 'run'}"]  # fmt: skip
        trainer_class, cfg = load_config("gpt", overrides)
        trainer = trainer_class(cfg, callbacks=[losses, keep])
        extra = {"losses": losses.losses}
    elif scenario == "nan_in_one_shard":
        cfg = {**base, "checkpoint": {"every_n_steps": 2, "keep_last": 50}, "trainer": {**cpu, "max_steps": 4}}
        trainer = Shuffled(cfg, callbacks=[NaNGradInRank1sShard()])
        try:
            trainer.fit()
        except ampkit.callbacks.NonFiniteError as error:
            return {"error": str(error), "version_dir": str(trainer.version_dir)}
        return {"error": None}
    elif scenario == "failing_sharded_saves":
        return failing_sharded_saves(base, cpu)
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    trainer.fit(resume=resume)
    if scenario == "overflow_o2":
        scaling = next(cb for cb in trainer.callbacks if cb.name == "LossScaling")
        extra["scales"] = {str(k): v for k, v in scaling.scales.items()}
        extra["param_dtypes"] = sorted({str(p.dtype) for p in trainer.module.parameters()})
    if scenario == "gpt":
        extra["units"] = sorted({type(m).__name__ for m in trainer.module.modules() if hasattr(m, "unshard")})
    return {"model": keep.state, "version_dir": str(trainer.version_dir), "val": trainer.val_metrics, **extra}


@contextmanager
def full_disk_at_step_8(failing: str) -> Iterator[None]:
    """The disk fills in the sharded save of step 8: on rank 1 as it writes its shard file (``rank 1's shard``), or on
    rank 0 as it writes ``trainer.pt`` (``rank 0's trainer.pt``), its last write."""
    real_open, real_save = Path.open, torch.save

    def open_(path, mode="r", *args, **kwargs):  # DCP opens each rank's shard file with Path.open(mode="wb")
        if mode == "wb" and path.suffix == ".distcp" and path.parent.name == ".step-00000008.tmp":
            return FullDisk(path, room=64)
        return real_open(path, mode, *args, **kwargs)

    def save(obj, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("loop", {}).get("global_step") == 8:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, *args, **kwargs)

    if failing == f"rank {RANK}'s shard":
        Path.open = open_
    elif failing == f"rank {RANK}'s trainer.pt":
        torch.save = save
    try:
        yield
    finally:
        Path.open, torch.save = real_open, real_save


def failing_sharded_saves(base: dict, cpu: dict) -> dict:
    """Sharded saves that fail on one rank, and what the next resume takes: each stage's error on this rank.

    A rank late to the save of step 2, then a write-protected copy in ``last``'s place at step 4; a resume to step 6
    (a branch, in version_1); the disk full at step 8, as rank 1 writes its shard file, then as rank 0 writes
    trainer.pt; a resume of ``last`` (step 6) to 8; ``last`` (step 8) with rank 1's shard file torn, resumed; and step 6
    validated."""
    from ampkit.trainer import waiting

    waiting.SAY_AFTER_S = 0.5
    cfg = {**base, "checkpoint": {"every_n_steps": 2, "keep_last": 50}, "trainer": {**cpu, "max_steps": 4},
           "distributed": {**FSDP, "timeout_s": 30}}  # fmt: skip
    result = {"error": failed(Shuffled(cfg, callbacks=[Rank1LateToTheSave(), CopiesLastAndProtectsIt()]))}
    resumed = Shuffled({**cfg, "trainer": {**cpu, "max_steps": 6}})  # every rank branches from the kept last
    resumed.fit(resume="last")
    result |= {"resumed_in": str(resumed.version_dir), "resumed_to": resumed.state.global_step}
    cfg = {**cfg, "trainer": {**cpu, "max_steps": 8}}
    for failing in ("rank 1's shard", "rank 0's trainer.pt"):
        with full_disk_at_step_8(failing):
            result[failing] = failed(Shuffled(cfg), resume="last")
    after = Shuffled(cfg)
    after.fit(resume="last")
    result |= {"after_from": after.fit_start.loop["global_step"], "after_to": after.state.global_step}
    if RANK == 1:  # before the next fit's rendezvous: no rank reads it before
        tear_own_weight_shard(after, after.version_dir / "checkpoints" / "last" / "__1_0.distcp")
    result["torn"] = failed(Shuffled({**cfg, "trainer": {**cpu, "max_steps": 10, "max_epochs": 2}}), resume="last")
    # A whole one beside it evaluated: every rank's trainer.pt, checked against rank zero's, loads with the shards.
    result["validated"] = Shuffled(cfg).validate(ckpt=str(after.version_dir / "checkpoints" / "step-00000006"))
    return result


def tear_own_weight_shard(trainer: ampkit.Trainer, shard: Path) -> None:
    """Zero this rank's shard of the first weight in ``shard``, the file it wrote (its layout intact: DCP reads it
    without an error), as a failing disk or an interrupted ``rsync --inplace`` tears it."""
    weight = next(trainer.module.parameters()).to_local().detach().numpy().tobytes()
    data = shard.read_bytes()
    start = data.index(weight)
    shard.write_bytes(data[:start] + bytes(len(weight)) + data[start + len(weight) :])


def failed(trainer: ampkit.Trainer, resume: str | None = None) -> tuple[str, str, int] | None:
    """``trainer.fit(resume=resume)``'s error (its type, its message, the step the trainer was at), or None."""
    try:
        trainer.fit(resume=resume)
    except Exception as error:
        return type(error).__name__, str(error), trainer.state.global_step
    return None


def die_in_the_save_of_step_6(moment: str) -> None:
    """SIGKILL this rank during the sharded save of step 6: as it opens its shard file (``shards``), or once DCP has
    written every rank's shards and the metadata (``after_dcp``), before rank zero renames the directory in."""
    import signal

    import torch.distributed.checkpoint as dcp

    def dies(path) -> bool:
        return Path(path).name == ".step-00000006.tmp"

    if moment == "shards":
        real_open = Path.open

        def open_(path, mode="r", *args, **kwargs):
            if mode == "wb" and path.suffix == ".distcp" and dies(path.parent):
                os.kill(os.getpid(), signal.SIGKILL)
            return real_open(path, mode, *args, **kwargs)

        Path.open = open_
    elif moment == "after_dcp":
        real_save = dcp.save

        def save(*args, checkpoint_id=None, **kwargs):
            result = real_save(*args, checkpoint_id=checkpoint_id, **kwargs)
            if dies(checkpoint_id):
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        dcp.save = save
    else:
        raise SystemExit(f"unknown moment {moment}")


if __name__ == "__main__":
    scenario, out = sys.argv[1], Path(sys.argv[2])
    if RANK == 1 and "DIE_IN_SAVE" in os.environ:
        die_in_the_save_of_step_6(os.environ["DIE_IN_SAVE"])
    result = run(scenario, out, int(os.environ.get("BATCH", 4)), os.environ.get("RESUME_FROM"))
    torch.save(result, out / f"rank{RANK}.pt")
