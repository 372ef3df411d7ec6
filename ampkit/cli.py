"""``ampkit fit|validate|test|predict --config FILE [key=value ...]`` (also ``python -m ampkit``).

``fit [--resume last|best|PATH]`` trains; ``validate``/``test`` print the averaged metrics of a checkpoint
(``--ckpt last|best|PATH``, default ``last``); ``predict --output FILE`` saves the per-batch predictions.
``--config`` is a YAML file or the name of a built-in config (``digits``).
"""

from __future__ import annotations

import argparse
import sys

from ampkit.callbacks.nonfinite_guard import NonFiniteError
from ampkit.config import ConfigError, load_config
from ampkit.trainer.checkpoint_io import CheckpointError
from ampkit.trainer.distributed import DistributedError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampkit", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    fit = commands.add_parser("fit", help="train the Trainer named by a config file")
    fit.add_argument("--resume", default=None, help="'last' or 'best' (newest under run_dir) or a checkpoint path")
    validate = commands.add_parser("validate", help="print the validation metrics of a checkpoint")
    test = commands.add_parser("test", help="print the test metrics of a checkpoint (test_dataloader/test_step)")
    predict = commands.add_parser("predict", help="save the predictions of a checkpoint (predict_dataloader)")
    predict.add_argument("--output", required=True, help="file to torch.save the per-batch predictions to")
    for command in (validate, test, predict):
        command.add_argument("--ckpt", default="last", help="'last' or 'best' (newest under run_dir) or a path")
    for command in (fit, validate, test, predict):
        command.add_argument("--config", required=True, help="YAML file naming trainer_class, or a built-in name")
        command.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.max_epochs=3")
    return parser


def _metrics(prefix: str, metrics: dict[str, float]) -> str:
    return ", ".join(f"{prefix}/{k}={v:.4f}" for k, v in metrics.items())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        trainer_class, cfg = load_config(args.config, args.overrides)
        trainer = trainer_class(cfg)
        if args.command == "fit":
            trainer.fit(resume=args.resume)
        elif args.command == "predict":
            predictions = trainer.predict(ckpt=args.ckpt, output=args.output)
        else:
            metrics = getattr(trainer, args.command)(ckpt=args.ckpt)
    except (ConfigError, CheckpointError) as exc:
        print(f"ampkit: error: {exc}", file=sys.stderr)
        return 2
    except (DistributedError, NonFiniteError) as exc:
        print(f"ampkit: error: {exc}", file=sys.stderr)
        return 1
    if not trainer.is_global_zero:
        return 0
    if args.command == "fit":
        shown = _metrics("val", trainer.val_metrics)
        print(
            f"ampkit: finished {trainer.state.global_step} steps in {trainer.state.epoch} epochs"
            + (f"; {shown}" if shown else "")
        )
        print(f"ampkit: run directory {trainer.version_dir} (tensorboard --logdir {trainer.version_dir})")
    elif args.command == "predict":
        where = args.output if trainer.world_size == 1 else f"one file per rank beside {args.output}"
        print(f"ampkit: predictions of {len(predictions)} batches saved to {where}")
    else:
        print(f"ampkit: {args.command}: {_metrics('val' if args.command == 'validate' else 'test', metrics)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
