"""Order callbacks by what they declare must run before or after them (no integer priorities)."""

from __future__ import annotations

from collections.abc import Sequence

from ampkit.trainer.callback import Callback

ALL_OTHERS = "*"


class CallbackOrderError(ValueError):
    """Callbacks declare an order that cannot be satisfied."""


def order_callbacks(callbacks: Sequence[Callback]) -> list[Callback]:
    """Topologically sort ``callbacks``; ties keep the given order. A cycle is an error naming its members."""
    names = [cb.name for cb in callbacks]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise CallbackOrderError(f"callback names must be unique, got duplicates: {duplicates}")
    index = {n: i for i, n in enumerate(names)}
    edges: dict[int, set[int]] = {i: set() for i in range(len(callbacks))}  # i -> must run before j

    def wildcard(cb: Callback, side: str) -> bool:
        return ALL_OTHERS in getattr(cb, side)

    for j, cb in enumerate(callbacks):
        for other in cb.after:
            if other == ALL_OTHERS:
                edges_from = [i for i, c in enumerate(callbacks) if i != j and not wildcard(c, "after")]
                for i in edges_from:
                    edges[i].add(j)
            elif other in index:
                edges[index[other]].add(j)
        for other in cb.before:
            if other == ALL_OTHERS:
                for i, c in enumerate(callbacks):
                    if i != j and not wildcard(c, "before"):
                        edges[j].add(i)
            elif other in index:
                edges[j].add(index[other])

    indegree = {i: 0 for i in edges}
    for targets in edges.values():
        for t in targets:
            indegree[t] += 1
    ready = [i for i in sorted(edges) if indegree[i] == 0]
    ordered: list[int] = []
    while ready:
        i = ready.pop(0)
        ordered.append(i)
        for t in sorted(edges[i]):
            indegree[t] -= 1
            if indegree[t] == 0:
                ready.append(t)
                ready.sort()
    if len(ordered) < len(callbacks):
        stuck = sorted(names[i] for i in edges if i not in ordered)
        raise CallbackOrderError(f"callback order has a cycle among: {', '.join(stuck)}")
    return [callbacks[i] for i in ordered]
