"""``ampkit fit|validate|test|predict --config FILE [--print-config] [--debug] [key=value ...]`` (also
``python -m ampkit``).

``fit [--resume last|best|PATH]`` trains; ``validate``/``test`` print the averaged metrics of a checkpoint
(``--ckpt last|best|PATH``, default ``last``); ``predict --output FILE`` saves the per-batch predictions (without it
they are only shown by whatever the Trainer's ``on_predict_end`` prints, as the GPT example's generated text).
``--config`` is a YAML file or the name of a built-in config (``digits``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
import warnings
from collections.abc import Container, Iterator
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

import ampkit
from ampkit.callbacks.nonfinite_guard import NonFiniteError
from ampkit.config import Config, ConfigError, builtin_configs, load_config
from ampkit.config_docs import help_text
from ampkit.trainer.batch_layout import RescaledResume
from ampkit.trainer.checkpoint_io import STORAGE_EXIT_STATUS, CheckpointError
from ampkit.trainer.distributed import DistributedError
from ampkit.trainer.ordering import CallbackOrderError
from ampkit.trainer.preemption import (
    INTERRUPT_EXIT_STATUS,
    SIGHUP_EXIT_STATUS,
    SIGTERM_EXIT_STATUS,
    HungUp,
    Preempted,
    signal_raises,
)
from ampkit.trainer.run_life import RunDirectoryError, loop_of, resolve_checkpoint
from ampkit.trainer.user_code import SETUP_ERROR_LINE, UserCodeError
from ampkit.wording import counted, shown

# What a user can fix from the message alone: one line, no traceback (``--debug`` shows it). The Trainer raises
# NotImplementedError for a method the command needs and the subclass lacks (``test`` without test_dataloader),
# UserCodeError for a subclass's method that returned something the loop cannot use.
USER_ERRORS = (
    ConfigError,
    CheckpointError,
    DistributedError,
    CallbackOrderError,
    NotImplementedError,
    NonFiniteError,
    RunDirectoryError,
    UserCodeError,
)

# (help, description) of each command; every command takes --config, --print-config, --debug and overrides.
COMMANDS = {
    "fit": (
        "train the Trainer named by a config file",
        "Train the Trainer subclass that the config file names (trainer_class: package.module:Class).",
    ),
    "validate": (
        "print the validation metrics of a checkpoint",
        "Run validation_step over val_dataloader once with a checkpoint's weights and print the averaged metrics.",
    ),
    "test": (
        "print the test metrics of a checkpoint (test_dataloader/test_step)",
        "Run test_step over test_dataloader once with a checkpoint's weights and print the averaged metrics.",
    ),
    "predict": (
        "run a checkpoint over predict_dataloader; --output FILE saves the predictions",
        "Run predict_step over predict_dataloader with a checkpoint's weights; --output saves its outputs with "
        "torch.save.",
    ),
}


def _keys_for_help(argv: list[str]) -> tuple[type, DictConfig | None, str]:
    """The schema whose keys a command's ``--help`` lists, the values to show (the named config's, else the
    schema's defaults: None) and the epilog's heading."""
    if "--config" in argv[:-1]:
        name = argv[argv.index("--config") + 1]
        try:
            trainer_class, cfg = load_config(name)
            return trainer_class.config_class, cfg, f"config keys of {trainer_class.__name__}, with {name}'s values"
        except Exception:  # help must print even when the config cannot load
            pass
    return (
        Config,
        None,
        "config keys (those every Trainer has; add --config FILE to see its Trainer's own), with defaults",
    )


class _GivenOnce(argparse.Action):
    """An option a command line gives once: a second, other value (``--config a.yaml --config b.yaml``) was taken
    over the first without a word, where its user may have meant both (LightningCLI merges several ``--config``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._given: list[str] = []

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        if self._given and self._given[0] != values:
            hint = " (a config's keys are changed by key=value overrides after it)" if self.dest == "config" else ""
            first, then = shown(self._given[0], 300), shown(values, 300)  # a path whole; a pasted 100 kB text not
            parser.error(f"argument {option}: given twice ({first}, then {then}); give it once{hint}")
        self._given.append(values)
        setattr(namespace, self.dest, values)


def _parser(argv: list[str]) -> argparse.ArgumentParser:
    builtin = ", ".join(builtin_configs())
    parser = argparse.ArgumentParser(
        prog="ampkit",
        description="ampkit: a PyTorch training loop built around mixed precision.",
        epilog=f"Start with a built-in example: ampkit fit --config digits (built-in configs: {builtin}).\n"
        "ampkit COMMAND --help lists every config key; add --config FILE for that file's values.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"ampkit {ampkit.__version__} (torch {torch.__version__})"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    epilog = None  # the keys' table costs a second to build: only for the help that shows it
    if {"-h", "--help"} & set(argv):
        schema, values, heading = _keys_for_help(argv)
        epilog = f"{heading}:\n{help_text(schema, values)}"
    parsers = {}
    for name, (summary, description) in COMMANDS.items():
        command = parsers[name] = commands.add_parser(
            name,
            help=summary,
            description=description,
            epilog=epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_argument(
            "--config",
            required=True,
            action=_GivenOnce,
            help=f"YAML file naming trainer_class, or a built-in config ({builtin})",
        )
    parsers["fit"].add_argument(
        "--resume", default=None, action=_GivenOnce, help="'last' or 'best' (newest under run_dir) or a checkpoint path"
    )
    for name in ("validate", "test", "predict"):
        parsers[name].add_argument(
            "--ckpt", default="last", action=_GivenOnce, help="'last' or 'best' (newest under run_dir) or a path"
        )
    parsers["predict"].add_argument(
        "--output",
        default=None,
        action=_GivenOnce,
        help="file to torch.save the per-batch predictions to (a directory: predictions.pt in it; never a "
        "checkpoint; an existing file only with --overwrite); without it nothing is written",
    )
    parsers["predict"].add_argument(
        "--overwrite", action="store_true", help="replace an existing --output file (never a write-protected one)"
    )
    for name, command in parsers.items():
        command.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
        command.add_argument("--debug", action="store_true", help="show the full traceback of an error")
        example = "trainer.max_epochs=3" if name == "fit" else "trainer.device=cpu"  # a key the command reads
        command.add_argument("overrides", nargs="*", help=f"key=value overrides, e.g. {example}")
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The command line, with ``key=value`` overrides allowed on both sides of an option
    (``fit --config f.yaml trainer.max_steps=9 --resume last trainer.seed=1``): argparse takes one run of
    positionals, so the overrides after an option come back unparsed and join the rest, in their order."""
    args, rest = parser.parse_known_args(argv)
    unknown = [arg for arg in rest if arg.startswith("-") or "=" not in arg]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{_dashed_override_hint(unknown, argv)}")
    args.overrides = [*getattr(args, "overrides", []), *rest]
    return args


def _dashed_override_hint(unknown: list[str], argv: list[str]) -> str:
    """For ``--trainer.max_epochs=3`` or ``--trainer.max_epochs 3`` (argparse's or LightningCLI's spelling of a config
    key): the override as ampkit reads it, ``trainer.max_epochs=3``."""
    for arg in unknown:
        key, equals, value = arg.lstrip("-").partition("=")
        if not arg.startswith("--") or not (equals or "." in key):
            continue
        after = argv[argv.index(arg) + 1 :][:1]
        if not equals and after and not after[0].startswith("-") and "=" not in after[0]:
            value = after[0]
        return f"; a config key is set without dashes, as key=value: {key}={value or '<value>'}"
    return ""


def _metrics(prefix: str, metrics: dict[str, float], logged: Container[str] = ()) -> str:
    """``metrics`` as ``val/acc=0.9300, ...``: a step's means under ``prefix``, a tag its end hooks ``logged`` as is."""
    return ", ".join(f"{k if k in logged else f'{prefix}/{k}'}={v:.4f}" for k, v in metrics.items())


def _resume_hint(cfg: Any, stopped_at: int | None = None) -> str:
    """What an interrupted ``fit`` can resume from: the newest checkpoint under ``run_dir``, or none yet. A Ctrl-C
    saves nothing, so where that checkpoint is older than the step the run ``stopped_at``, the hint names both: the
    steps between are trained again."""
    newest = None if cfg is None else resolve_checkpoint(cfg.run_dir, "last")
    if newest is None:
        return " before its first checkpoint (run it again without --resume to start over)"
    saved = (loop_of(newest) or {}).get("global_step")
    if saved is None or stopped_at is None or stopped_at <= saved:
        return f" (--resume last continues from {newest})"
    return f" (--resume last continues from {newest}, saved at step {saved}; this run reached step {stopped_at})"


@contextlib.contextmanager
def _short_warnings() -> Iterator[None]:
    """ampkit's own warnings as one ``ampkit: warning: ...`` line: a command's user needs the message, not the path
    and source line inside ampkit that raised it. A warning from elsewhere (torch, the user's own module) keeps both."""
    package, original = os.path.dirname(ampkit.__file__) + os.sep, warnings.formatwarning

    def short(message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None):
        if not str(filename).startswith(package):
            return original(message, category, filename, lineno, line)
        kind = "warning" if category is UserWarning else category.__name__
        return f"ampkit: {kind}: {message}\n"

    warnings.formatwarning = short
    try:
        yield
    finally:
        warnings.formatwarning = original


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser(argv)
    if not argv:  # a first try of the bare command: the commands and where to start, not a usage error alone
        parser.print_help(sys.stderr)
        return 2
    args = _parse(parser, argv)
    # fit() inside takes SIGTERM over, to save the step it stops at; a SIGHUP (the terminal or ssh session closed)
    # unwinds as a Ctrl-C does, where its default action would end the process without a last line
    with _short_warnings(), signal_raises(Terminated), signal_raises(HungUp, signal.SIGHUP):
        return _run(args)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's notice before it kills a job; torchrun's to the ranks left when one fails), raised
    where the process is so that it unwinds as an interrupt does: the run lock released, the resume hint printed."""


def _run(args: argparse.Namespace) -> int:
    cfg = trainer = None
    try:
        trainer_class, cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(OmegaConf.to_yaml(cfg, resolve=True), end="")
            trainer_class(cfg)  # the checks a run makes at once: a value no run takes is an error, not printed as fine
            return 0
        trainer = trainer_class(cfg)
        if args.command == "fit":
            trainer.fit(resume=args.resume)
        elif args.command == "predict":
            # overwrite only when asked: a subclass's predict(ckpt, output) written before the option still runs
            replace = {"overwrite": True} if args.overwrite else {}
            predictions = trainer.predict(ckpt=args.ckpt, output=args.output, **replace)
        else:
            metrics = getattr(trainer, args.command)(ckpt=args.ckpt)
    except USER_ERRORS as exc:
        if args.debug:
            raise
        print(f"ampkit: error: {exc} (--debug shows the traceback)", file=sys.stderr)
        if getattr(exc, "storage_errno", None) is not None:  # the disk failed, not the run: it may go on elsewhere
            return STORAGE_EXIT_STATUS
        return 1 if isinstance(exc, DistributedError | NonFiniteError) else 2  # failed runs, not bad input
    except Exception as exc:  # a set-up method's error, or a cast model's dtype clash: one line; else a traceback
        line = getattr(exc, SETUP_ERROR_LINE, None)
        if line is None or args.debug:
            raise
        print(f"ampkit: error: {line} (--debug shows the traceback)", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        if args.debug:
            raise
        sigterm = isinstance(exc, Terminated | Preempted)
        how = "terminated (SIGTERM)" if sigterm else "hung up (SIGHUP)" if isinstance(exc, HungUp) else "interrupted"
        with contextlib.suppress(OSError):  # a hung-up terminal may take no more output
            stopped_at = None if trainer is None else trainer.state.global_step
            hint = _resume_hint(cfg, stopped_at) if args.command == "fit" else ""
            print(f"ampkit: {how}{hint}", file=sys.stderr)
        hung_up = isinstance(exc, HungUp)
        return SIGTERM_EXIT_STATUS if sigterm else SIGHUP_EXIT_STATUS if hung_up else INTERRUPT_EXIT_STATUS
    if not trainer.is_global_zero:
        return 0
    if args.command == "fit" and trainer.fit_start.finished:
        return 0  # a resume of a finished run: the Trainer said so, and wrote nothing
    if args.command == "fit":
        logged = trainer.validation_end_values  # the last validation's on_validation_end values, rank zero's
        shown = _metrics("val", {**trainer.val_metrics, **logged}, logged)
        s = trainer.state
        if shown and trainer.val_metrics_step != s.global_step:  # e.g. a resume that did not validate again
            at = trainer.val_metrics_step
            shown += f" (validated at step {at})" if at is not None else " (from the checkpoint resumed)"
        steps = counted(s.global_step, "step")
        span = _trained_span(s.epoch, s.batches_done, trainer.rescaled_resume)
        print(f"ampkit: finished {steps} in {span}" + (f"; {shown}" if shown else ""))
        logdir = shlex.quote(str(trainer.version_dir))  # a run_dir with a space must paste as one argument
        board = f" (tensorboard --logdir {logdir})" if trainer.cfg.logging.tensorboard else ""  # no events: no hint
        print(f"ampkit: run directory {trainer.version_dir}{board}")
    elif args.command == "predict":
        batches = counted(len(predictions), "batch", "batches")
        written = trainer.predictions_path
        if written is None:
            print(f"ampkit: predictions of {batches} not saved (--output FILE saves them)")
        else:
            where = written if trainer.world_size == 1 else f"one file per rank beside {written}"
            print(f"ampkit: predictions of {batches} saved to {where}")
    else:
        validate = args.command == "validate"
        logged = trainer.validation_end_values if validate else trainer.test_end_values
        print(f"ampkit: {args.command}: {_metrics('val' if validate else 'test', metrics, logged)}")
    return 0


def _trained_span(epochs: int, batches: int, rescaled: RescaledResume | None = None) -> str:
    """``"2 epochs"``, ``"1 epoch and 12 batches"``: a stop inside an epoch (max_steps, max_time, early stopping)
    ran part of it, which is not a whole epoch. Where that epoch was resumed on batches of another size (2 ranks'
    checkpoint on 1), the batches are this run's, and the ``rescaled`` note says so and which were the checkpoint's:
    "5 steps in 7 batches" read as if two batches had not stepped."""
    whole = counted(epochs, "epoch")
    part = counted(batches, "batch", "batches")
    if rescaled is not None and rescaled.epoch == epochs and batches:
        part += f" {rescaled.note()}"
    return whole if not batches else part if not epochs else f"{whole} and {part}"


if __name__ == "__main__":
    sys.exit(main())
