"""torch.optim's implementation keywords (``foreach``, ``fused``, ``differentiable``, ``capturable``) in a fused
optimizer's constructor: taken where they say what the fused step does, refused by name where they ask for another.

A port of ``torch.optim.Adam(params, lr, foreach=True)`` to ``FusedAdam`` got Python's bare "unexpected keyword
argument"; accepting every value would drop the user's choice without a word.
"""

from __future__ import annotations

from typing import Any

from ampkit.ops._errors import ArgumentTypeError
from ampkit.ops._switches import is_switch
from ampkit.wording import shown, type_of

# Each keyword: (the values that agree with the fused step, what those are in words).
_AGREEING: dict[str, tuple[tuple[Any, ...], str]] = {
    "foreach": ((None,), "None"),
    "fused": ((None, True), "None or True"),
    "differentiable": ((False,), "False"),
    "capturable": ((None, False), "False or None"),  # torch.optim keeps None and steps as with False
}

# torch.optim keeps differentiable=None, then every step fails in torch.set_grad_enabled(None)
_NONE_FAILS_IN_TORCH = "; torch.optim keeps None there and each of its steps then fails in torch.set_grad_enabled"


def _asks_for(keyword: str, value: bool, owner: str) -> str:
    """What ``keyword=value`` asks torch.optim for, and what ``owner`` does instead."""
    runs = f"{owner} always runs its own fused multi-tensor step"
    if keyword == "foreach":
        form = "foreach (multi-tensor) step, which torch refuses beside fused=True" if value else "for-loop step"
        return f"asks for torch.optim's {form}; {runs}"
    if keyword == "fused":
        return f"asks for torch.optim's unfused (foreach or for-loop) step; {runs}"
    if keyword == "differentiable":
        return f"asks for a step gradients flow through; {owner} updates in place under torch.no_grad()"
    return (
        f"asks for a step CUDA graphs can capture; {owner} reads its hyper-parameters on the host each step, so its "
        "step cannot be captured"
    )


def check_torch_keywords(owner: str, **given: Any) -> None:
    """Raise where one of torch.optim's implementation keywords in ``given`` asks for other than ``owner``'s fused
    step: a TypeError for a value that is no switch (``fused="yes"``), else a ValueError naming the keyword, its
    value and what the fused optimizer does instead. A value that agrees (``fused=True``, ``foreach=None``) is taken
    and kept nowhere: the step has no other form to choose."""
    for keyword, value in given.items():
        agreeing, words = _AGREEING[keyword]
        if value is None and None in agreeing:
            continue
        if value is None or not is_switch(value):
            also = _NONE_FAILS_IN_TORCH if value is None and keyword == "differentiable" else ""
            raise ArgumentTypeError(
                f"{owner}: invalid {keyword}: {shown(value)} is {type_of(value)} (expected {words}, as torch.optim "
                f"takes{also})"
            )
        if bool(value) in agreeing:
            continue
        raise ValueError(
            f"{owner}: {keyword}={shown(value)} {_asks_for(keyword, bool(value), owner)}; leave it out or pass "
            f"{keyword}={words} (torch.optim's optimizers have the other forms)"
        )
