"""Apex's ``apex.amp._process_optimizer``, for scripts that replace ``optimizer._post_amp_backward`` with a copy of
Apex's O2 one written against this module (onnxruntime-training's ``ApexAMPModifier``): the helper that unscales
the gradients of parameters that are their own masters. Apex's per-optimizer methods themselves are on each
optimizer ``amp.initialize`` returned (``optimizer._prepare_amp_backward``, ``_post_amp_backward``, ...).
"""

from __future__ import annotations

from typing import Any

import torch

from ampkit.compat.amp.scaler import stashed_scales
from ampkit.missing_name import missing_name

__all__ = ["post_backward_models_are_masters"]


def post_backward_models_are_masters(
    scaler: Any,
    params: list[torch.Tensor],
    stashed_grads: list[torch.Tensor | None],
    scale_override: tuple[float, float, float] | None = None,
) -> None:
    """Unscale each parameter's new gradient in place by ``scaler`` (inf/nan raises its ``_overflow_buf``) onto its
    entry of ``stashed_grads`` (the gradient from before the backward); a parameter the backward did not reach gets
    its stashed gradient back. ``scale_override`` = ``(grads_have_scale, stashed_have_scale, out_scale)``, as Apex's
    FusedSGD post-backward passes it, leaves every gradient at ``out_scale`` (default: the loss scale, 1, 1). The
    stash is emptied (each entry set to None), as in Apex."""
    if len(stashed_grads) != len(params):
        raise ValueError(
            f"post_backward_models_are_masters got {len(params)} params but {len(stashed_grads)} stashed gradients; "
            "pass one stash entry (a tensor or None) per parameter"
        )
    grads_have, stashed_have, out = stashed_scales(scale_override, scaler.loss_scale())
    new, with_stash, stashes = [], [], []
    for param, stashed in zip(params, stashed_grads, strict=True):
        if param.grad is None:
            if stashed is not None:
                if stashed_have != out:  # at the scale the others are left at (Apex handed it back as it was)
                    with torch.no_grad():
                        stashed.mul_(out / stashed_have)
                param.grad = stashed
        elif stashed is None:
            new.append(param.grad)
        else:
            with_stash.append(param.grad)
            stashes.append(stashed)
    if new:
        scaler.unscale(new, new, None, models_are_masters=True, scale_override=grads_have / out)
    if with_stash:  # not dropped at a static scale of 1, as Apex's early return dropped them
        scaler.unscale_with_stashed(with_stash, stashes, with_stash, scale_override=(grads_have, stashed_have, out))
    stashed_grads[:] = [None] * len(stashed_grads)


def __getattr__(name: str) -> Any:
    raise missing_name(
        f"apex.amp._process_optimizer (ampkit.compat.amp._process_optimizer) has no attribute {name!r}: only "
        "post_backward_models_are_masters is served; Apex's per-optimizer methods are on the optimizer that "
        "amp.initialize returned (optimizer._prepare_amp_backward, _post_amp_backward, _amp_lazy_init)",
        "apex.amp._process_optimizer",
        name,
    )
