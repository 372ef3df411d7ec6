"""The GPT example's training step: a nanoGPT-style hand loop against ``ampkit.Trainer``, paired in one process.

Both train the same model (``ampkit.examples.gpt.GPT``) on the same batches with the same optimizer and clipping:
the hand loop is ``autocast`` → forward → ``GradScaler.scale(loss).backward()`` → ``unscale_`` →
``clip_grad_norm_`` → ``step`` → ``update`` → ``zero_grad`` (the scaler disabled unless fp16); the Trainer gets the
matching ``precision`` section and ``trainer.clip_grad_norm``, with its default throughput callback on and
TensorBoard, progress bar and checkpoints off. Rows: fp32 / bf16 / fp16, eager and compiled (``torch.compile`` of
the whole model in all). Columns: the hand loop's tokens/s, TFLOP/s and MFU (the model's FLOPs counted once with
``torch.utils.flop_counter``; MFU against the throughput callback's peak table, so on a GPU it knows), then each
contender's tokens/s over the hand loop's: the Trainer with torch's ``AdamW(fused=True)`` and ``nn.LayerNorm`` (as
the hand loop), the Trainer with ampkit's ``FusedAdam`` and ``FusedLayerNorm``, and Lightning (when importable: the
same model, batches, optimizer and clipping in a ``LightningModule`` at ``32-true`` / ``bf16-mixed`` /
``16-mixed``).

Each row starts with the hand loop; each repeat then runs every contender and the hand loop again, so the hand
loop brackets every repeat (the run after one repeat is the one before the next); the contenders' order rotates
from one repeat to the next, so that drift in the run's course (clocks, the allocator's pool) does not always favour
the same column. A column's speed is the tokens/s of the two hand loops around a repeat (their mean) over the
contender's, the median over repeats [min, max]. Tokens/s count the steps after ``--warmup`` (compilation, allocator
warm-up) by their total time, which is what a user gets: on a CPU by the wall clock, on a GPU by CUDA events
recorded at each step's end (no synchronisation inside the timed steps).

Hygiene around each run: ``gc.collect()`` first, so that reference cycles a finished contender left (a Trainer or a
LightningModule holding a model on the GPU) are not collected inside the next run's timed steps (what the imports
made is frozen once, out of every collection's way); then, on a GPU, ``torch.cuda.synchronize()``, and again at the
first mark, so that no earlier work and none of the set-up's (the model's initialisation, copies) runs inside the
first steps and the host and device clocks start together. Every
contender builds its model on the device (the same seed, so the same weights in every column): built on a CPU and
copied, GPT-2-small's 86M parameters took 0.65-0.75 s of the Trainer's 0.74-0.90 s set-up on a 2-core machine.

After the table, a detail table per row and contender (what ``step_times.py`` says of it) tells host-bound steps
from device-bound ones and stalls from uniform slowness: device ms/step (median, p90, max over the timed steps of
every repeat), host ms/step (median), the end lag (how far the device trailed the host at the last step: about 0
when the GPU waits for Python), each run's set-up seconds and the median-step speed against the hand loops.
``--json PATH`` writes every run's raw per-step device and host times (rewritten after each run, so a run stopped
by SIGINT keeps the finished ones; it then prints the detail table of what ran); an existing file is replaced only
with ``--overwrite``. Run from the repository root::

    PYTHONPATH=$PWD python benchmarks/gpt_step.py --steps 30 --repeats 3
    PYTHONPATH=$PWD python benchmarks/gpt_step.py --device cuda --layers 12 --width 768 --seq-len 1024 --batch 8
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F
from step_times import RunTimes, detail_table, paired_ratios, ratio_cell, write_json  # a sibling script

import ampkit
from ampkit.callbacks.throughput import count_training_flops, matmul_dtype, peak_tflops
from ampkit.examples.gpt import GPT, VOCAB, GPTModelConfig

MODES = ("eager", "compiled")
LABELS = {"hand": "hand loop", "trainer": "Trainer", "fused": "Trainer + ampkit fused", "lightning": "Lightning"}
PRECISIONS = {  # name: (autocast dtype or None, the Trainer's precision section, Lightning's precision)
    "fp32": (None, {"opt_level": "O0"}, "32-true"),
    "bf16": (torch.bfloat16, {"opt_level": "O1", "dtype": "bfloat16"}, "bf16-mixed"),
    "fp16": (torch.float16, {"opt_level": "O1", "dtype": "float16", "loss_scale": "dynamic"}, "16-mixed"),
}


@dataclass
class Setting:
    model: GPTModelConfig
    batches: list[tuple[torch.Tensor, torch.Tensor]]  # on the device
    warmup: int
    device: torch.device
    lr: float = 1e-3
    clip: float = 1.0


class StepClock:
    """Marks a run's start and each step's end: a CUDA event on a GPU (read once, after the last step); on a CPU the
    wall clock, or with ``--clock process`` the process's CPU time, which other jobs on a loaded machine disturb far
    less (with one thread it is the step's own compute; the rates are then tokens per CPU-second). Each mark also
    reads the host's ``perf_counter``, so the host's time per step stands beside the device's."""

    cpu_clock = staticmethod(time.perf_counter)

    def __init__(self, setting: Setting) -> None:
        self.cuda = setting.device.type == "cuda"
        self.steps = len(setting.batches)
        self.marks: list = []
        self.host: list[float] = []
        self.end_lag_ms: float | None = None

    def mark(self) -> None:
        if self.cuda and not self.marks:  # the set-up's kernels done: the host's and the device's clocks start together
            torch.cuda.synchronize()
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(self.cpu_clock())
        self.host.append(time.perf_counter())
        if self.cuda and len(self.marks) == self.steps + 1:  # the last step: how far the device trails the host
            self.marks[-1].synchronize()
            self.end_lag_ms = (time.perf_counter() - self.host[-1]) * 1e3

    def step_ms(self) -> tuple[list[float], list[float]]:
        """Each step's device and host milliseconds."""
        if self.cuda:
            self.marks[-1].synchronize()
            device = [a.elapsed_time(b) for a, b in pairwise(self.marks)]
        else:
            device = [(b - a) * 1e3 for a, b in pairwise(self.marks)]
        return device, [(b - a) * 1e3 for a, b in pairwise(self.host)]

    def tokens_per_sec(self, setting: Setting) -> float:
        """Tokens/s over the steps after the warm-up ones (``marks``: the start, then each step's end)."""
        first, last = self.marks[setting.warmup], self.marks[-1]
        if self.cuda:
            last.synchronize()
            seconds = first.elapsed_time(last) / 1e3
        else:
            seconds = last - first
        return (len(self.marks) - 1 - setting.warmup) * setting.batches[0][0].numel() / seconds


def make_optimizer(model: torch.nn.Module, lr: float, fused_ampkit: bool) -> torch.optim.Optimizer:
    if fused_ampkit:
        return ampkit.ops.FusedAdam(model.parameters(), lr=lr, weight_decay=0.1)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=True)


def hand_loop(setting: Setting, precision: str, compiled: bool) -> StepClock:
    """nanoGPT's step: autocast, one scaled backward, unscale, clip, step, update, zero_grad."""
    torch.manual_seed(0)
    dtype = PRECISIONS[precision][0]
    kind = setting.device.type
    with setting.device:  # initialised where it trains (see the module's docstring)
        model = GPT(setting.model)
    optimizer = make_optimizer(model, setting.lr, fused_ampkit=False)
    scaler = torch.amp.GradScaler(kind, enabled=dtype == torch.float16)
    forward = torch.compile(model) if compiled else model
    clock = StepClock(setting)
    clock.mark()
    for x, y in setting.batches:
        with torch.autocast(kind, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = F.cross_entropy(forward(x).flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), setting.clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        clock.mark()
    return clock


class _Marks(ampkit.Callback):
    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_train_start(self, trainer) -> None:
        self.clock.mark()

    def on_train_batch_end(self, trainer, outputs, batch) -> None:
        self.clock.mark()


class BenchTrainer(ampkit.Trainer):
    setting: Setting
    fused_ampkit = False

    def configure_model(self):
        torch.manual_seed(0)
        config = GPTModelConfig(**{**vars(self.setting.model), "fused_norm": self.fused_ampkit})
        self.tokens_per_sample = config.seq_len
        with self.setting.device:  # as the hand loop's
            return GPT(config)

    def configure_optimizers(self):
        return make_optimizer(self.module, self.setting.lr, self.fused_ampkit)

    def train_dataloader(self):
        return self.setting.batches

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())


def trainer_loop(setting: Setting, precision: str, compiled: bool, fused_ampkit: bool, run_dir: str) -> StepClock:
    clock = StepClock(setting)
    cfg = {
        "run_dir": run_dir,
        "trainer": {"max_epochs": 1, "device": str(setting.device), "progress_bar": False, "compile": compiled,
                    "clip_grad_norm": setting.clip, "seed": None},
        "logging": {"tensorboard": False},
        "checkpoint": {"enabled": False},
        "precision": PRECISIONS[precision][1],
    }  # fmt: skip
    trainer = type("Bench", (BenchTrainer,), {"setting": setting, "fused_ampkit": fused_ampkit})(cfg, [_Marks(clock)])
    trainer.fit()
    return clock


def lightning_version() -> str | None:
    try:
        import lightning
    except ImportError:
        return None
    return lightning.__version__


def lightning_loop(setting: Setting, precision: str, compiled: bool) -> StepClock | None:
    """The same step under Lightning's Trainer (bare: no logger, checkpoint, bar or summary, no validation or
    sanity check; clipping through ``configure_gradient_clipping``, since Lightning's own refuses a fused optimizer);
    None when it is not importable."""
    if lightning_version() is None:
        return None
    import logging
    import warnings

    import lightning as L

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # its banner lines would break up the table
    warnings.filterwarnings("ignore", message=".*LeafSpec")  # 2.6.6's own deprecation notice, once per process

    clock = StepClock(setting)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            with setting.device:  # as the hand loop's
                self.model = GPT(setting.model)
            self.forward_fn = torch.compile(self.model) if compiled else self.model

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.forward_fn(x).flatten(0, 1), y.flatten())

        def on_train_start(self) -> None:
            clock.mark()

        def on_train_batch_end(self, *args) -> None:
            clock.mark()

        def configure_optimizers(self):
            return make_optimizer(self.model, setting.lr, fused_ampkit=False)

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            # Lightning refuses to clip for a fused optimizer (its step would unscale): unscale first, then clip,
            # as the hand loop does; the scaler's step then only checks found_inf.
            scaler = getattr(self.trainer.precision_plugin, "scaler", None)
            if scaler is not None:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), gradient_clip_val)

    accelerator = "gpu" if setting.device.type == "cuda" else "cpu"
    devices = [setting.device.index or 0] if accelerator == "gpu" else 1  # where the batches are
    trainer = L.Trainer(accelerator=accelerator, devices=devices, max_epochs=1, precision=PRECISIONS[precision][2],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, gradient_clip_val=setting.clip)  # fmt: skip
    trainer.fit(Module(), train_dataloaders=_Iterable(setting.batches))
    return clock


class _Iterable:
    """The batches as one iterable (Lightning reads a bare list as a list of loaders)."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def flops_per_token(model: GPTModelConfig) -> float:
    """Training FLOPs (forward and backward) per token, counted once on a meta-device copy."""
    with torch.device("meta"):
        meta = GPT(model)
        idx = torch.zeros(1, model.seq_len, dtype=torch.long)
        return count_training_flops(lambda: meta(idx).float().logsumexp(-1).sum()) / model.seq_len


def measure(setting: Setting, run: Callable[[], StepClock | None], **where) -> RunTimes | None:
    """One run under the module docstring's hygiene, its times kept (None where the contender cannot run)."""
    gc.collect()  # an earlier run's cycles (a Trainer holding its GPU model) are not collected in this one's steps
    if setting.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    clock = run()
    if clock is None:
        return None
    device_ms, host_ms = clock.step_ms()
    return RunTimes(**where, warmup=setting.warmup, device_ms=device_ms, host_ms=host_ms, end_lag_ms=clock.end_lag_ms,
                    setup_s=clock.host[0] - start, tokens_per_s=clock.tokens_per_sec(setting))  # fmt: skip


def run_row(setting: Setting, precision: str, mode: str, repeats: int, contenders: list[str], run_dir: str,
            done: Callable[[RunTimes], None]) -> None:  # fmt: skip
    """The hand loop, then per repeat every contender in an order rotated by one each repeat and the hand loop again;
    each run is handed to ``done`` as it finishes."""
    compiled = mode == "compiled"
    runners: dict[str, Callable[[], StepClock | None]] = {
        "hand": lambda: hand_loop(setting, precision, compiled),
        "trainer": lambda: trainer_loop(setting, precision, compiled, False, run_dir),
        "fused": lambda: trainer_loop(setting, precision, compiled, True, run_dir),
        "lightning": lambda: lightning_loop(setting, precision, compiled),
    }

    def run(name: str, repeat: int, position: int) -> None:
        times = measure(setting, runners[name], precision=precision, mode=mode, contender=name, repeat=repeat,
                        position=position)  # fmt: skip
        if times is not None:
            done(times)

    run("hand", 0, 0)
    for repeat in range(repeats):
        shift = repeat % len(contenders) if contenders else 0
        for position, name in enumerate(contenders[shift:] + contenders[:shift], 1):
            run(name, repeat, position)
        run("hand", repeat + 1, 0)


def headline(row: list[RunTimes], flops: float, peak: float | None, version: str | None) -> str:
    """The table's line for one row: the hand loops' median tokens/s, its TFLOP/s and MFU, and each contender's
    tokens/s over the hand loops around its repeat."""
    precision, mode = row[0].precision, row[0].mode
    ratios = paired_ratios(row, "hand", lambda run: run.tokens_per_s)

    def cell(name: str) -> str:
        if name in ratios:
            return ratio_cell(ratios[name])
        return "no fp16 AMP on CPU" if version else "not importable"

    tokens = statistics.median(run.tokens_per_s for run in row if run.contender == "hand")
    tflops = tokens * flops / 1e12
    mfu = f"{tflops / peak:.1%}" if peak else "n/a"
    return (f"| {precision} | {mode} | {tokens:.0f} | {tflops:.3g} | {mfu} | {cell('trainer')} | {cell('fused')} | "
            f"{cell('lightning')} |")  # fmt: skip


def gpu_note(device: torch.device) -> str | None:
    """What a run on this device cannot give, said before the table: on a CPU, MFU and the GPU figures the docs quote;
    on a GPU the peak table lacks, MFU."""
    if device.type == "cpu":
        return ("On a CPU: MFU is n/a (the peak table is NVIDIA GPUs'), and the ratios at this size are a CPU's; the "
                "docs' GPU rows (tokens/s and MFU at GPT-2-small shape, the Trainer's target of >= 0.99x the hand "
                "loop) need a GPU: --device cuda --layers 12 --width 768 --seq-len 1024 --batch 8")  # fmt: skip
    if any(peak_tflops(device, column) is None for column in ("bf16", "fp16", "fp32")):
        return f"MFU is n/a in a row whose dtype has no peak for {torch.cuda.get_device_name(device)} in the table"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--clock", choices=("wall", "process"), default="wall",
                        help="on a CPU: wall time, or the process's CPU time (steadier when loaded)")  # fmt: skip
    parser.add_argument("--precisions", default="fp32,bf16,fp16")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--run-dir", default="/tmp/ampkit-bench-gpt")
    parser.add_argument("--json", metavar="PATH", help="write every run's raw per-step device and host times here")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    args = parser.parse_args()
    if args.json and os.path.lexists(args.json) and not args.overwrite:  # an earlier run's times are not lost
        parser.error(f"--json {args.json!r} exists already: pass --overwrite to replace it, or name a new file")
    device = torch.device(args.device)
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {args.device!r}: expected cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"--device {args.device!r}: no CUDA device is visible")
        if device.index is not None:  # cuda:N: every loop's allocations and events go there
            torch.cuda.set_device(device)
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup}: expected 0 <= warmup < --steps ({args.steps})")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: expected at least 1")
    for name, given, known in (("--precisions", args.precisions, PRECISIONS), ("--modes", args.modes, MODES)):
        unknown = [value for value in given.split(",") if value not in known]
        if unknown:
            parser.error(f"{name} {given!r}: {', '.join(map(repr, unknown))} unknown; expected a comma-separated "
                         f"list of {', '.join(known)}")  # fmt: skip
    torch.set_num_threads(args.threads)
    if args.clock == "process":
        if device.type == "cuda":
            parser.error("--clock process: a GPU's steps are timed by CUDA events")
        StepClock.cpu_clock = staticmethod(time.process_time)
    model = GPTModelConfig(seq_len=args.seq_len, layers=args.layers, width=args.width, heads=max(args.width // 32, 1))
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.steps):
        data = torch.randint(0, VOCAB, (args.batch, args.seq_len + 1), generator=g)
        batches.append((data[:, :-1].to(device), data[:, 1:].to(device)))
    setting = Setting(model, batches, args.warmup, device)
    flops = flops_per_token(model)
    threads = f"CPU, {args.threads} thread{'s' * (args.threads != 1)}, {args.clock} clock"
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else threads
    version = lightning_version()
    print(f"torch {torch.__version__} on {where}; Lightning {version or 'not importable'}; GPT {args.layers} layers "
          f"x {args.width}, seq {args.seq_len}, batch {args.batch}; {flops / 1e6:.2f} MFLOP per token (fwd + bwd); "
          f"{args.steps} steps ({args.warmup} warm-up), {args.repeats} repeats")  # fmt: skip
    meta = {"command": sys.argv, "torch": torch.__version__, "device": where, "lightning": version,
            "model": vars(model), "batch": args.batch, "tokens_per_step": args.batch * args.seq_len,
            "flops_per_token": flops, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
            "clock": "cuda events" if device.type == "cuda" else args.clock}  # fmt: skip
    runs: list[RunTimes] = []

    def done(times: RunTimes) -> None:
        runs.append(times)
        if args.json:
            write_json(args.json, meta, runs)

    note = gpu_note(device)
    if note:
        print(note)
    print("| precision | mode | hand loop tok/s | TFLOP/s | MFU | Trainer | Trainer + ampkit fused | Lightning |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    # What the imports made (torch's, ampkit's and Lightning's modules, ~300k objects) is never garbage: frozen, no
    # collection scans it again, so each run's gc.collect() takes ~0 ms rather than ~150, and a full collection
    # that falls inside a timed step is that much shorter.
    gc.collect()
    gc.freeze()
    row: tuple[str, str] | None = None
    try:
        for precision in args.precisions.split(","):
            peak = peak_tflops(device, matmul_dtype(PRECISIONS[precision][0]))
            for mode in args.modes.split(","):
                row = (precision, mode)
                # Lightning has no fp16 AMP on a CPU (it runs bf16 instead, with a warning): no figure rather than a
                # bf16 one in the fp16 row.
                lightning_runs = version is not None and not (precision == "fp16" and device.type == "cpu")
                contenders = ["trainer", "fused"] + ["lightning"] * lightning_runs
                first = len(runs)
                run_row(setting, precision, mode, args.repeats, contenders, args.run_dir, done)
                print(headline(runs[first:], flops, peak, version), flush=True)
    except (KeyboardInterrupt, SystemExit):  # SIGINT at a time limit (Lightning turns it into SystemExit)
        where_stopped = f" in the {' '.join(row)} row" if row else ""
        print(f"stopped by SIGINT{where_stopped}: the detail table below and --json hold the {len(runs)} finished "
              "runs", flush=True)  # fmt: skip
        stopped = True
    else:
        stopped = False
    print()
    print("\n".join(detail_table(runs, "hand", LABELS)), flush=True)
    if stopped:
        sys.exit(130)


if __name__ == "__main__":
    main()
