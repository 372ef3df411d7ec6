"""The checkpoint dict ``on_save_checkpoint`` and ``on_load_checkpoint`` hand a hook, as a Lightning port meets it.

Lightning's keys (``checkpoint["state_dict"]``, ``checkpoint["epoch"]``) have ampkit names, which a KeyError for one
is noted with. Lightning calls ``on_load_checkpoint`` before it loads the weights, so a port's hook that renames or
replaces them there (migrating an older model's keys) works there; here the hook runs once everything is restored,
so such an edit would be dropped without a word: it is refused, naming the way that works.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ampkit.trainer.user_code import UserCodeError

# Lightning's checkpoint keys -> where the dict the checkpoint hooks get holds the same here.
LIGHTNING_CHECKPOINT_KEYS: dict[str, str] = {
    "state_dict": "checkpoint['model'] (absent under FSDP, whose shards are files of their own)",
    "optimizer_states": "checkpoint['optimizers'], by optimizer name (absent under FSDP)",
    "lr_schedulers": "checkpoint['schedulers'], a list per optimizer name",
    "epoch": (
        "checkpoint['loop']['epoch'], the epochs finished (at an epoch's end one more than Lightning's, the index of "
        "the epoch that ended)"
    ),
    "global_step": "checkpoint['loop']['global_step']",
    "loops": "checkpoint['loop'] (epoch, batches_done, global_step)",
    "hyper_parameters": "checkpoint['config'], the run's resolved config",
    "pytorch-lightning_version": "checkpoint['ampkit_checkpoint'], the format's version",
}


def fire_checkpoint_hook(fire: Callable[[str, dict[str, Any]], None], hook: str, checkpoint: dict[str, Any]) -> None:
    """``fire(hook, checkpoint)``; a KeyError of one of Lightning's keys this dict lacks gets a note naming ampkit's."""
    try:
        fire(hook, checkpoint)
    except KeyError as exc:
        key = exc.args[0] if exc.args else None
        if isinstance(key, str) and key in LIGHTNING_CHECKPOINT_KEYS and key not in checkpoint:
            here = LIGHTNING_CHECKPOINT_KEYS[key]
            exc.add_note(f"'{key}' is Lightning's checkpoint key; in {hook}'s checkpoint it is {here}")
        raise


_ABSENT = object()


def _weights_seen(checkpoint: dict[str, Any], key: str) -> Any:
    """``checkpoint[key]`` (``_ABSENT`` where there is none), a dict of weights as a copy of its entries: an edit of
    the dict in place then shows against it."""
    weights = checkpoint.get(key, _ABSENT)
    return dict(weights) if isinstance(weights, dict) else weights


def _same_weights(before: Any, after: Any) -> bool:
    """Whether the entry ``after`` holds what ``before`` held: the same object, or a dict of the same keys whose each
    value is the same tensor or one equal to it (a hook that rebuilds the dict and changes nothing, as a migration
    whose renames match no key)."""
    if before is after:
        return True
    if not (isinstance(before, dict) and isinstance(after, dict)) or before.keys() != after.keys():
        return False
    return all(_same_tensor(before[k], after[k]) for k in before)


def _same_tensor(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and torch.equal(a, b)


@contextmanager
def weights_loaded_before(checkpoint: dict[str, Any]) -> Iterator[None]:
    """Around ``on_load_checkpoint``: refuse a hook's edit of ``checkpoint['model']`` (a key renamed, a tensor
    replaced by other values, the entry swapped for other weights) or of a Lightning ``checkpoint['state_dict']``,
    which would change nothing: the weights were loaded before the hook ran. A ``state_dict`` entry the file holds
    (written by an ``on_save_checkpoint`` for Lightning's tools) is no edit while the hook leaves it as it was."""
    before = {key: _weights_seen(checkpoint, key) for key in ("model", "state_dict")}
    yield
    changed = [key for key in before if not _same_weights(before[key], _weights_seen(checkpoint, key))]
    if not changed:
        return
    key = "state_dict" if "state_dict" in changed else "model"
    verb = "removed" if key not in checkpoint else "changed"  # del checkpoint['model'], checkpoint.clear()
    raise UserCodeError(
        f"on_load_checkpoint {verb} checkpoint['{key}'], which would change nothing: the model's weights were loaded "
        "from checkpoint['model'] before the hook ran (Lightning calls it before loading them). To adapt a "
        "checkpoint's weights (rename an older model's keys), edit a copy of the file: ck = torch.load(path, "
        "weights_only=True), change ck['model'], torch.save(ck, new_path), then resume from new_path; to change the "
        "model itself, do it in the hook, on self.module"
    )
