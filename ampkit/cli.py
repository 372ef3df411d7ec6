"""``ampkit fit --config FILE [--resume last|PATH] [--print-config] [--debug] [key=value ...]`` (also
``python -m ampkit``)."""

from __future__ import annotations

import argparse
import sys

import torch
from omegaconf import OmegaConf

import ampkit
from ampkit.config import Config, ConfigError, load_config
from ampkit.config_docs import help_text
from ampkit.trainer.checkpoint_io import CheckpointError
from ampkit.trainer.distributed import DistributedError
from ampkit.trainer.ordering import CallbackOrderError

# What a user can fix from the message alone: one line, no traceback (``--debug`` shows it).
USER_ERRORS = (ConfigError, CheckpointError, DistributedError, CallbackOrderError)


def _schema_for_help(argv: list[str]) -> tuple[type, str]:
    """The schema whose keys ``fit --help`` lists: the named config's Trainer's, else the base one."""
    if {"-h", "--help"} & set(argv) and "--config" in argv[:-1]:
        try:
            trainer_class, _ = load_config(argv[argv.index("--config") + 1])
            return trainer_class.config_class, f" of {trainer_class.__name__}"
        except Exception:  # help must print even when the config cannot load
            pass
    return Config, " (those every Trainer has; add --config FILE to see its Trainer's own)"


def _parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ampkit", description="ampkit: a PyTorch training loop built around mixed precision."
    )
    parser.add_argument(
        "--version", action="version", version=f"ampkit {ampkit.__version__} (torch {torch.__version__})"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    schema, whose = _schema_for_help(argv)
    fit = commands.add_parser(
        "fit",
        help="train the Trainer named by a config file",
        description="Train the Trainer subclass that the config file names (trainer_class: package.module:Class).",
        epilog=f"config keys{whose}, with defaults:\n{help_text(schema)}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    fit.add_argument("--config", required=True, help="YAML file naming trainer_class and its settings")
    fit.add_argument("--resume", default=None, help="'last' (newest last.pt under run_dir) or a checkpoint path")
    fit.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    fit.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    fit.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.max_epochs=3")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser(argv).parse_args(argv)
    try:
        trainer_class, cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(OmegaConf.to_yaml(cfg, resolve=True), end="")
            return 0
        trainer = trainer_class(cfg)
        trainer.fit(resume=args.resume)
    except USER_ERRORS as exc:
        if args.debug:
            raise
        print(f"ampkit: error: {exc} (--debug shows the traceback)", file=sys.stderr)
        return 1 if isinstance(exc, DistributedError) else 2
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("ampkit: interrupted (--resume last continues from the newest checkpoint)", file=sys.stderr)
        return 130
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
