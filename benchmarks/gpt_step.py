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

Each repeat runs the hand loop, then each contender, then the hand loop again; a column's speed is the hand
loops' mean tokens/s beside it over its own, the median over repeats [min, max]. Tokens/s count the steps after
``--warmup`` (compilation, allocator warm-up): on a CPU by the wall clock, on a GPU by CUDA events recorded at each
step's end (no synchronisation inside the timed steps). Run from the repository root::

    PYTHONPATH=$PWD python benchmarks/gpt_step.py --steps 30 --repeats 3
    PYTHONPATH=$PWD python benchmarks/gpt_step.py --device cuda --layers 12 --width 768 --seq-len 1024 --batch 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import ampkit
from ampkit.callbacks.throughput import count_training_flops, matmul_dtype, peak_tflops
from ampkit.examples.gpt import GPT, VOCAB, GPTModelConfig

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
    """Marks each step's end: a CUDA event on a GPU (read once, after the last step); on a CPU the wall clock, or
    with ``--clock process`` the process's CPU time, which other jobs on a loaded machine disturb far less (with
    one thread it is the step's own compute; the rates are then tokens per CPU-second)."""

    cpu_clock = staticmethod(time.perf_counter)

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(self.cpu_clock())

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


def hand_loop(setting: Setting, precision: str, compiled: bool) -> float:
    """nanoGPT's step: autocast, one scaled backward, unscale, clip, step, update, zero_grad."""
    torch.manual_seed(0)
    dtype = PRECISIONS[precision][0]
    kind = setting.device.type
    model = GPT(setting.model).to(setting.device)
    optimizer = make_optimizer(model, setting.lr, fused_ampkit=False)
    scaler = torch.amp.GradScaler(kind, enabled=dtype == torch.float16)
    forward = torch.compile(model) if compiled else model
    clock = StepClock(setting.device)
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
    return clock.tokens_per_sec(setting)


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
        return GPT(config)

    def configure_optimizers(self):
        return make_optimizer(self.module, self.setting.lr, self.fused_ampkit)

    def train_dataloader(self):
        return self.setting.batches

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())


def trainer_loop(setting: Setting, precision: str, compiled: bool, fused_ampkit: bool, run_dir: str) -> float:
    clock = StepClock(setting.device)
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
    return clock.tokens_per_sec(setting)


def lightning_version() -> str | None:
    try:
        import lightning
    except ImportError:
        return None
    return lightning.__version__


def lightning_loop(setting: Setting, precision: str, compiled: bool) -> float | None:
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

    clock = StepClock(setting.device)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
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
    return clock.tokens_per_sec(setting)


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
    args = parser.parse_args()
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
    print("| precision | mode | hand loop tok/s | TFLOP/s | MFU | Trainer | Trainer + ampkit fused | Lightning |")
    print("|---|---|---|---|---|---|---|---|")
    for precision in args.precisions.split(","):
        peak = peak_tflops(device, matmul_dtype(PRECISIONS[precision][0]))
        for mode in args.modes.split(","):
            compiled = mode == "compiled"
            columns: dict[str, list[float]] = {"trainer": [], "fused": [], "lightning": []}
            hands: list[float] = []
            # Lightning has no fp16 AMP on a CPU (it runs bf16 instead, with a warning): no figure rather than a
            # bf16 one in the fp16 row.
            lightning_runs = not (precision == "fp16" and device.type == "cpu")
            for _ in range(args.repeats):
                before = hand_loop(setting, precision, compiled)
                runs = {
                    "trainer": trainer_loop(setting, precision, compiled, False, args.run_dir),
                    "fused": trainer_loop(setting, precision, compiled, True, args.run_dir),
                    "lightning": lightning_loop(setting, precision, compiled) if lightning_runs else None,
                }
                after = hand_loop(setting, precision, compiled)
                hands += [before, after]
                for name, value in runs.items():
                    if value is not None:
                        columns[name].append(value / ((before + after) / 2))

            def cell(ratios: list[float]) -> str:
                if not ratios:
                    return "no fp16 AMP on CPU" if version else "not importable"
                return f"{statistics.median(ratios):.3f}x [{min(ratios):.3f}, {max(ratios):.3f}]"

            tokens = statistics.median(hands)
            tflops = tokens * flops / 1e12
            mfu = f"{tflops / peak:.1%}" if peak else "n/a"
            print(f"| {precision} | {mode} | {tokens:.0f} | {tflops:.3g} | {mfu} | {cell(columns['trainer'])} | "
                  f"{cell(columns['fused'])} | {cell(columns['lightning'])} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
