"""Ahead-of-time build of every ampkit op family: ``python -m ampkit.ops.build``.

Ops compile on first use anyway; run this at install time (or in a Docker image build) so the first
training step does not pay the ~30-60 s compile. It imports every module of ``ampkit.ops`` (each
frontend registers its family with :func:`ampkit.ops._build.register_family`), builds each family
into the same cache the JIT loader reads, prints one line per family with its build time, and exits
non-zero if any family fails to build.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import time

import ampkit.ops
from ampkit.ops._build import FAMILIES

_NOT_FRONTENDS = {"build", "cuda_compile_check"}


def import_frontends() -> None:
    """Import every ``ampkit.ops`` submodule so that each op family registers itself."""
    for module in pkgutil.walk_packages(ampkit.ops.__path__, prefix="ampkit.ops."):
        leaf = module.name.rsplit(".", 1)[-1]
        if leaf.startswith("_") or leaf in _NOT_FRONTENDS or ".reference" in module.name:
            continue
        importlib.import_module(module.name)


def main(argv: list[str] | None = None) -> int:
    """Build all registered families (or those named with ``--only``); return the process exit status."""
    parser = argparse.ArgumentParser(prog="python -m ampkit.ops.build", description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[], metavar="FAMILY",
                        help="build this family only (repeatable; separate processes build in parallel)")  # fmt: skip
    args = parser.parse_args(argv)
    os.environ["AMPKIT_OPS"] = "kernel"  # report failures instead of falling back
    import_frontends()
    unknown = sorted(set(args.only) - set(FAMILIES))
    if unknown:
        print(f"unknown op family {', '.join(unknown)}; known: {', '.join(sorted(FAMILIES))}", file=sys.stderr)
        return 2
    failed = []
    for name, family in sorted(FAMILIES.items()):
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        try:
            family.use_kernel()
        except RuntimeError as exc:
            failed.append(name)
            print(f"{name}: FAILED: {exc}", file=sys.stderr)
            continue
        print(f"{name}: ready in {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
