"""``optimizer.state`` as the fused optimizers keep it: torch's ``defaultdict(dict)``, counting resets."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any


class StateMap(defaultdict):
    """Per-parameter state, as torch's ``defaultdict(dict)``, that counts (``resets``) every entry replaced or
    removed: ``del state[p]``, ``state[p] = {}``, ``pop``, ``clear``, ``update``. The buckets a fused optimizer keeps
    between steps hold the state dicts they were built with; a moved count rebuilds them, so a reset state is
    created afresh on the next step, as torch.optim creates it, instead of the old one stepping on unseen."""

    resets = 0

    def __init__(self, items: Iterable[Any] | dict[Any, Any] = ()) -> None:
        super().__init__(dict, items)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (), None, None, iter(self.items())

    def copy(self) -> StateMap:
        return type(self)(self)

    __copy__ = copy

    def __setitem__(self, key: Any, value: Any) -> None:
        if key in self:
            self.resets += 1
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self.resets += 1
        super().__delitem__(key)

    def pop(self, *args: Any) -> Any:
        self.resets += 1
        return super().pop(*args)

    def popitem(self) -> tuple[Any, Any]:
        self.resets += 1
        return super().popitem()

    def clear(self) -> None:
        self.resets += 1
        super().clear()

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.resets += 1
        super().update(*args, **kwargs)

    def __ior__(self, other: Any) -> StateMap:
        self.update(other)
        return self
