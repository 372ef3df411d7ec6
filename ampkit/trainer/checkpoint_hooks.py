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


def _weights_seen(checkpoint: dict[str, Any]) -> tuple[Any, list[tuple[str, int]] | None]:
    """The weights entry of ``checkpoint`` and each of its keys with the identity of its tensor."""
    weights = checkpoint.get("model")
    return weights, (None if not isinstance(weights, dict) else [(k, id(v)) for k, v in weights.items()])


@contextmanager
def weights_loaded_before(checkpoint: dict[str, Any]) -> Iterator[None]:
    """Around ``on_load_checkpoint``: refuse a hook's edit of ``checkpoint['model']`` (a key renamed, a tensor
    replaced, the entry swapped) or a Lightning ``checkpoint['state_dict']`` set there, which would change nothing:
    the weights were loaded before the hook ran."""
    before = _weights_seen(checkpoint)
    yield
    after = _weights_seen(checkpoint)
    if after[0] is before[0] and after[1] == before[1] and "state_dict" not in checkpoint:
        return
    edited = "checkpoint['state_dict']" if "state_dict" in checkpoint else "checkpoint['model']"
    raise UserCodeError(
        f"on_load_checkpoint changed {edited}, which would change nothing: the model's weights were loaded from "
        "checkpoint['model'] before the hook ran (Lightning calls it before loading them). To adapt a checkpoint's "
        "weights (rename an older model's keys), edit a copy of the file: ck = torch.load(path, weights_only=True), "
        "change ck['model'], torch.save(ck, new_path), then resume from new_path; to change the model itself, do it "
        "in the hook, on self.module"
    )
