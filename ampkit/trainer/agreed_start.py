"""Where a ``fit()`` starts, decided once by rank zero for every rank (``run_life.plan_fit``: which checkpoint,
continue or branch, which version directory, the warnings), and the checkpoint each rank loads checked to be rank
zero's file, and whole, before any rank uses it.

Each rank looking at the run directory itself could decide differently: on a node-local ``run_dir`` each node sees
its own disk, where rank zero's node holds the checkpoints and another node none, or older ones. Ranks that resumed
different checkpoints would train on from different steps, and ranks that disagreed on continue or branch would write
to two version directories. So rank zero plans, and a rank that does not see rank zero's checkpoint (no file there,
another one, a sharded checkpoint without some of its shard files, a damaged copy) stops every rank before anything
is trained or written, naming the ranks and their hosts: a resume needs the checkpoint on every node. validate, test
and predict with a checkpoint are checked alike (:func:`agreed_checkpoint`).
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ampkit.trainer.checkpoint_io import CheckpointError, DamagedCheckpointError, file_fingerprint, load_fingerprinted
from ampkit.trainer.distributed import DistributedEnv, decided_by_rank_zero, gather_object
from ampkit.trainer.run_life import FitStart, fallback_hint, loop_of, position_text
from ampkit.trainer.sharded_checkpoint import TRAINER_FILE

# Rank zero's finding where its load of a checkpoint read another file than the view it sent the other ranks.
REPLACED = "read another file there than the one it showed the others (replaced meanwhile): run it again"


@dataclass(frozen=True)
class CheckpointView:
    """What one process sees at a checkpoint's path, read without its tensors."""

    fingerprint: str | None  # None: no checkpoint there (see :func:`file_fingerprint`)
    loop: dict[str, int] | None
    shards: dict[str, int]  # a sharded checkpoint's shard files, by name, and their sizes


def view_of(path: Path, read: tuple[str | None, dict[str, Any]] | None = None) -> CheckpointView:
    """What this process sees at ``path``: a checkpoint file, or a sharded checkpoint's directory (its ``trainer.pt``,
    ``.metadata`` and the names and sizes of its shard files: each rank reads only some of those). ``read``: the
    fingerprint and entries of the file (a sharded one's ``trainer.pt``) as this process loaded it, seen in the place
    of the file at ``path`` now: one put there since is not the state this process holds."""
    if read is None:
        part = path / TRAINER_FILE if path.is_dir() else path
        read = (file_fingerprint(part), {"loop": loop_of(path)})
    fingerprint, loop = read[0], read[1].get("loop")
    if not path.is_dir():
        return CheckpointView(fingerprint, loop, {})
    shards = {p.name: p.stat().st_size for p in sorted(path.glob("*.distcp")) if p.is_file()}
    metadata = path / ".metadata"
    if fingerprint is None or not metadata.is_file():
        return CheckpointView(None, None, shards)
    digest = hashlib.sha256(f"{fingerprint}\n{sorted(shards.items())}\n".encode())
    digest.update(metadata.read_bytes())
    return CheckpointView(digest.hexdigest(), loop, shards)


def difference(mine: CheckpointView, zeros: CheckpointView) -> str | None:
    """How this process's view of a checkpoint differs from rank zero's (``zeros``), or None where it is the same."""
    if mine.fingerprint == zeros.fingerprint:
        return None
    if mine.fingerprint is None and not mine.shards:
        return "has no checkpoint there"
    if lacking := sorted(zeros.shards.keys() - mine.shards.keys()):
        return f"lacks its shard file(s) {', '.join(lacking)}"
    if resized := sorted(n for n, size in mine.shards.items() if zeros.shards.get(n, size) != size):
        return f"has shard file(s) {', '.join(resized)} of other sizes"
    if mine.fingerprint is None:
        return f"lacks its {TRAINER_FILE} or .metadata"
    return f"has another checkpoint there ({position_text(mine.loop)})"


def agreed_fit_start(plan: Callable[[], FitStart], env: DistributedEnv, run_dir: str) -> FitStart:
    """``plan()`` (which resolves and loads the checkpoint) on rank zero, its decision and its errors on every rank;
    each other rank loads the checkpoint rank zero chose (a file's whole state; a sharded one's ``trainer.pt``, kept
    in ``trainer_part``: its shards are loaded later, with the model), and every rank stops where any rank's is not
    rank zero's file or is damaged. ``run_dir``: for the message."""
    if not env.enabled:
        return plan()
    planned: list[FitStart] = []

    def rank_zeros() -> tuple[FitStart, CheckpointView | None]:
        planned.append(plan())
        path = planned[0].checkpoint_path
        sent = replace(planned[0], checkpoint=None, trainer_part=None)  # no tensors sent: each rank loads its own
        if path is None:
            return sent, None
        loaded = planned[0].checkpoint if planned[0].checkpoint is not None else planned[0].trainer_part
        return sent, view_of(path, (planned[0].fingerprint, loaded))  # what the plan read, not the file there now

    start, zeros = decided_by_rank_zero(rank_zeros, env)
    if planned:
        start = planned[0]
    if zeros is None or start.finished:  # nothing to load: a finished run trains nothing
        return start
    # Rank zero loaded it in plan(); its load's errors, a damaged copy among them, went to every rank already.
    checkpoint = _same_on_every_rank(start.checkpoint_path, zeros, env, run_dir, "resuming", load=env.rank != 0)
    if checkpoint is None:
        return start
    return replace(start, trainer_part=checkpoint) if zeros.shards else replace(start, checkpoint=checkpoint)


def agreed_checkpoint(
    resolve: Callable[[], Path | None], env: DistributedEnv, run_dir: str, what: str
) -> tuple[Path | None, dict[str, Any] | None]:
    """``resolve()`` (a checkpoint's path from ``last``/``best`` or a path given) on rank zero, its value and its
    errors on every rank, and the checkpoint file loaded there on every rank, once every rank has found it the same
    file as rank zero's and whole (validate, test, predict); a sharded checkpoint's ``trainer.pt`` is checked and
    returned so (its shards load into the model with it). ``what``: what reads it, for the message
    (``validate: loading``)."""
    if not env.enabled:
        return resolve(), None

    def rank_zeros() -> tuple[Path | None, CheckpointView | None]:
        path = resolve()
        return path, view_of(path) if path is not None else None

    path, zeros = decided_by_rank_zero(rank_zeros, env)
    if path is None:
        return None, None
    return path, _same_on_every_rank(path, zeros, env, run_dir, what, load=True)


def _same_on_every_rank(
    path: Path, zeros: CheckpointView, env: DistributedEnv, run_dir: str, what: str, load: bool
) -> dict[str, Any] | None:
    """Refuse on every rank, naming each rank (and its host) that sees another file at ``path`` than rank zero's
    (``zeros``), or where ``load`` cannot load it (its file, or a sharded one's ``trainer.pt``), a damaged copy
    among them: the load reads each record against its CRC-32, which torch.load never checks and the fingerprint
    trusts. The checkpoint loaded on this rank, or None where not ``load``."""
    checkpoint, fingerprint, problem, damaged, failure, fallback = None, None, None, None, None, None
    if load:
        part = path / TRAINER_FILE if path.is_dir() else path
        try:
            with fallback_hint(part):
                checkpoint, fingerprint = load_fingerprinted(part)
        except DamagedCheckpointError as exc:
            damaged, fallback = exc.damage, exc.fallback
        except CheckpointError as exc:
            failure = exc
    if env.rank != 0 and damaged is None:  # what this rank loaded, or where it loads nothing, what is there
        problem = difference(view_of(path, (fingerprint, checkpoint) if checkpoint is not None else None), zeros)
    elif checkpoint is not None and view_of(path, (fingerprint, checkpoint)).fingerprint != zeros.fingerprint:
        problem = REPLACED
    if problem is None and failure is not None:
        problem = f"cannot load it: {failure}"
    found = gather_object((socket.gethostname(), problem, damaged, fallback), env)
    seen = [f"rank {rank} (host {host}) {said or f'has a damaged copy: {why}'}"
            for rank, (host, said, why, _) in enumerate(found) if said or why]  # fmt: skip
    if not seen:
        return checkpoint
    fixes = []
    if any(said and said != REPLACED for _, said, _, _ in found):
        fixes.append(
            f"Every rank reads that checkpoint itself, so run_dir '{run_dir}' (and a checkpoint named by its path) "
            "must be on a file system every node shares (NFS, Lustre, GPFS), not a node-local disk: move it there, or "
            "copy the checkpoint to that path on every node"
        )
    if any(why for _, _, why, _ in found):
        # rank zero's first: the newest whole checkpoint beside the damaged copy, as a single process names it
        beside = next((whole for *_, whole in found if whole is not None), None)
        fixes.append(
            "A damaged copy would load without an error, with other values on that rank than on the others: copy the "
            "checkpoint there again from a whole one, or resume an older checkpoint"
            + (f"; the newest whole checkpoint beside it is '{beside}'" if beside is not None else "")
        )
    raise CheckpointError(
        f"{what} '{path}' ({position_text(zeros.loop)} on rank 0): {'; '.join(seen)}. "
        f"{''.join(f'{fix}. ' for fix in fixes)}Nothing was trained or written"
    )
