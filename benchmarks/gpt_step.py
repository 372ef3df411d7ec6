"""The GPT example's training step: a nanoGPT-style hand loop against ``ampkit.Trainer``, paired in one process.

Both train the same model (``ampkit.examples.gpt.GPT``) on the same batches with the same optimizer and clipping:
the hand loop is ``autocast`` → forward → ``GradScaler.scale(loss).backward()`` → ``unscale_`` →
``clip_grad_norm_`` → ``step`` → ``update`` → ``zero_grad`` (the scaler disabled unless fp16); the Trainer gets the
matching ``precision`` section and ``trainer.clip_grad_norm``, with its default throughput callback on and
TensorBoard, progress bar and checkpoints off. Rows: fp32 / bf16 / fp16, eager and compiled (``torch.compile`` of
the whole model in both). Columns: the Trainer with torch's ``AdamW(fused=True)`` and ``nn.LayerNorm`` (as the hand
loop), the Trainer with ampkit's ``FusedAdam`` and ``FusedLayerNorm``, and Lightning when it is importable.

Each repeat runs the hand loop, then each Trainer column, then the hand loop again; a column's speed is the hand
loops' mean tokens/s beside it over its own, the median over repeats [min, max]. Tokens/s count the steps after
``--warmup`` (compilation, allocator warm-up). Run from the repository root::

    PYTHONPATH=$PWD python benchmarks/gpt_step.py --steps 30 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import ampkit
from ampkit.examples.gpt import GPT, VOCAB, GPTModelConfig

PRECISIONS = {  # name: (autocast dtype or None, the Trainer's precision section)
    "fp32": (None, {"opt_level": "O0"}),
    "bf16": (torch.bfloat16, {"opt_level": "O1", "dtype": "bfloat16"}),
    "fp16": (torch.float16, {"opt_level": "O1", "dtype": "float16", "loss_scale": "dynamic"}),
}


@dataclass
class Setting:
    model: GPTModelConfig
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    warmup: int
    lr: float = 1e-3
    clip: float = 1.0


def make_optimizer(model: torch.nn.Module, lr: float, fused_ampkit: bool) -> torch.optim.Optimizer:
    if fused_ampkit:
        return ampkit.ops.FusedAdam(model.parameters(), lr=lr, weight_decay=0.1)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=True)


def tokens_per_sec(stamps: list[float], setting: Setting) -> float:
    """Tokens/s over the steps after the warm-up ones (``stamps``: the time each step ended, first = start)."""
    batch = setting.batches[0][0].numel()
    timed = stamps[setting.warmup :]
    return (len(timed) - 1) * batch / (timed[-1] - timed[0])


def hand_loop(setting: Setting, precision: str, compiled: bool) -> float:
    """nanoGPT's step: autocast, one scaled backward, unscale, clip, step, update, zero_grad."""
    torch.manual_seed(0)
    dtype, _ = PRECISIONS[precision]
    model = GPT(setting.model)
    optimizer = make_optimizer(model, setting.lr, fused_ampkit=False)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    forward = torch.compile(model) if compiled else model
    stamps = [time.perf_counter()]
    for x, y in setting.batches:
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = F.cross_entropy(forward(x).flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), setting.clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        stamps.append(time.perf_counter())
    return tokens_per_sec(stamps, setting)


class _Stamps(ampkit.Callback):
    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_start(self, trainer) -> None:
        self.stamps.append(time.perf_counter())

    def on_train_batch_end(self, trainer, outputs, batch) -> None:
        self.stamps.append(time.perf_counter())


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
    stamps = _Stamps()
    cfg = {
        "run_dir": run_dir,
        "trainer": {"max_epochs": 1, "device": "cpu", "progress_bar": False, "compile": compiled,
                    "clip_grad_norm": setting.clip, "seed": None},
        "logging": {"tensorboard": False},
        "checkpoint": {"enabled": False},
        "precision": PRECISIONS[precision][1],
    }  # fmt: skip
    trainer = type("Bench", (BenchTrainer,), {"setting": setting, "fused_ampkit": fused_ampkit})(cfg, [stamps])
    trainer.fit()
    return tokens_per_sec(stamps.stamps, setting)


def lightning_loop(setting: Setting, precision: str, compiled: bool) -> float | None:
    """The same step under Lightning's Trainer (bare: no logger, checkpoint or bar); None when not importable."""
    try:
        import lightning as L
    except ImportError:
        return None

    stamps: list[float] = []

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT(setting.model)
            self.forward_fn = torch.compile(self.model) if compiled else self.model

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.forward_fn(x).flatten(0, 1), y.flatten())

        def on_train_batch_end(self, *args) -> None:
            stamps.append(time.perf_counter())

        def configure_optimizers(self):
            return make_optimizer(self.model, setting.lr, fused_ampkit=False)

    names = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, precision=names[precision], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=setting.clip)  # fmt: skip
    stamps.append(time.perf_counter())
    trainer.fit(Module(), train_dataloaders=setting.batches)
    return tokens_per_sec(stamps, setting)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precisions", default="fp32,bf16,fp16")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--run-dir", default="/tmp/ampkit-bench-gpt")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = GPTModelConfig(seq_len=args.seq_len, layers=args.layers, width=args.width, heads=max(args.width // 32, 1))
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.steps):
        data = torch.randint(0, VOCAB, (args.batch, args.seq_len + 1), generator=g)
        batches.append((data[:, :-1].contiguous(), data[:, 1:].contiguous()))
    setting = Setting(model, batches, args.warmup)
    print(f"torch {torch.__version__}, {args.threads} threads; GPT {args.layers} layers x {args.width}, "
          f"seq {args.seq_len}, batch {args.batch}; {args.steps} steps ({args.warmup} warm-up), {args.repeats} "
          "repeats")  # fmt: skip
    print("| precision | mode | hand loop tok/s | Trainer | Trainer + ampkit fused | Lightning |")
    print("|---|---|---|---|---|---|")
    for precision in args.precisions.split(","):
        for mode in args.modes.split(","):
            compiled = mode == "compiled"
            columns: dict[str, list[float]] = {"trainer": [], "fused": [], "lightning": []}
            hands: list[float] = []
            for _ in range(args.repeats):
                before = hand_loop(setting, precision, compiled)
                runs = {
                    "trainer": trainer_loop(setting, precision, compiled, False, args.run_dir),
                    "fused": trainer_loop(setting, precision, compiled, True, args.run_dir),
                    "lightning": lightning_loop(setting, precision, compiled),
                }
                after = hand_loop(setting, precision, compiled)
                hands += [before, after]
                for name, value in runs.items():
                    if value is not None:
                        columns[name].append(value / ((before + after) / 2))

            def cell(ratios: list[float]) -> str:
                if not ratios:
                    return "not importable"
                return f"{statistics.median(ratios):.3f}x [{min(ratios):.3f}, {max(ratios):.3f}]"

            print(f"| {precision} | {mode} | {statistics.median(hands):.0f} | {cell(columns['trainer'])} | "
                  f"{cell(columns['fused'])} | {cell(columns['lightning'])} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
