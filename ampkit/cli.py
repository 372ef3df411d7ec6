"""``ampkit fit --config FILE [--resume last|PATH] [key=value ...]`` (also ``python -m ampkit``)."""

from __future__ import annotations

import argparse
import sys

from ampkit.callbacks.nonfinite import NonFiniteError
from ampkit.config import ConfigError, load_config
from ampkit.trainer.checkpoint_io import CheckpointError
from ampkit.trainer.distributed import DistributedError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampkit", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    fit = commands.add_parser("fit", help="train the Trainer named by a config file")
    fit.add_argument("--config", required=True, help="YAML file naming trainer_class and its settings")
    fit.add_argument("--resume", default=None, help="'last' (newest last.pt under run_dir) or a checkpoint path")
    fit.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.max_epochs=3")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        trainer_class, cfg = load_config(args.config, args.overrides)
        trainer = trainer_class(cfg)
        trainer.fit(resume=args.resume)
    except (ConfigError, CheckpointError) as exc:
        print(f"ampkit: error: {exc}", file=sys.stderr)
        return 2
    except (DistributedError, NonFiniteError) as exc:
        print(f"ampkit: error: {exc}", file=sys.stderr)
        return 1
    if trainer.is_global_zero:
        shown = ", ".join(f"val/{k}={v:.4f}" for k, v in trainer.val_metrics.items())
        print(
            f"ampkit: finished {trainer.state.global_step} steps in {trainer.state.epoch} epochs"
            + (f"; {shown}" if shown else "")
        )
        print(f"ampkit: run directory {trainer.version_dir} (tensorboard --logdir {trainer.version_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
