"""A decoder-only transformer (GPT) trained byte by byte on English text that ships with Python.

Launch: ``ampkit fit --config gpt`` (the packaged ``ampkit/configs/gpt.yaml``); then
``ampkit predict --config gpt --ckpt best --output samples.pt`` prints text generated from ``generate.prompt``.

- Corpus: the standard library's ``pydoc_data.topics`` (~465 kB of Python's documentation, English), as UTF-8
  bytes (vocabulary 256); the last ``data.val_fraction`` is the validation set. The console prints the unigram
  entropy of the bytes: a model that learnt nothing of context cannot beat it.
- Model: pre-norm blocks (``model.norm``: layernorm | rmsnorm; ``model.fused_norm``: ampkit's fused kernels),
  causal ``F.scaled_dot_product_attention``, tied embeddings. ``optim.fused``: ampkit's ``FusedAdam``. The logits
  are computed in the weights' dtype, outside autocast (float32 under O1): with bf16 logits the default run's
  validation loss after 300 steps was 12% higher than float32's, with float32 logits bf16 is within 0.3% of it.
- Precision: ``precision.opt_level: auto`` picks bf16 O1 on a GPU; on a CPU float32 without AMX (bf16 runs slower
  there), and with AMX the faster of the two, timed on one block (float32 under torchrun: ranks timing apart could
  choose differently), when a run starts; a resumed or evaluated checkpoint keeps the level it trained in, untimed.
  Any opt level can be set instead.
- ``trainer.compile=[Block]`` compiles each block in place, ``trainer.activation_checkpointing=[Block]``
  recomputes their activations, ``distributed.strategy=fsdp`` shards each block (``distributed.fsdp.
  shard_modules: [Block]``); tokens/s, TFLOP/s and MFU come from the FLOPs counted once on a meta-device copy.
- Every ``generate.every_n_steps`` iterations a sample from ``generate.prompt`` goes to TensorBoard's Text tab
  (to the console under ``logging.tensorboard=false``).
"""

from __future__ import annotations

import math
import numbers
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from lightning_utilities.core.rank_zero import rank_zero_warn
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import DataLoader, Dataset

import ampkit
from ampkit.callbacks.nonfinite_guard import NonFiniteError
from ampkit.callbacks.throughput import count_training_flops
from ampkit.config import build_config, is_config_instance
from ampkit.trainer.checkpoint_io import peek_checkpoint
from ampkit.trainer.console import say, say_above_the_bars
from ampkit.trainer.run_life import resolve_checkpoint
from ampkit.trainer.sharded_checkpoint import TRAINER_FILE
from ampkit.wording import shown

VOCAB = 256  # bytes


@dataclass
class GPTModelConfig:
    seq_len: int = 64  # context length in bytes (tokens)
    layers: int = 4  # transformer blocks
    width: int = 128  # model dimension (embedding and residual stream)
    heads: int = 4  # attention heads; width must divide by it
    dropout: float = 0.0  # dropout probability on embeddings, attention weights and residual branches
    norm: str = "layernorm"  # layernorm | rmsnorm
    fused_norm: bool = False  # ampkit.ops.FusedLayerNorm / FusedRMSNorm instead of torch's


@dataclass
class GPTDataConfig:
    batch_size: int = 32  # sequences per batch (per rank)
    val_fraction: float = 0.1  # the corpus's last part, held out for validation
    val_batches: int = 10  # validation: this many optimizer steps' worth of windows, evenly spread over the val text


@dataclass
class GPTOptimConfig:
    lr: float = 3e-3  # peak learning rate, reached after warmup_steps
    min_lr: float = 3e-4  # cosine decay to this at the run's end (trainer.max_steps, or max_epochs if sooner)
    warmup_steps: int = 50  # linear warmup from 0
    weight_decay: float = 0.1  # decoupled (AdamW), on the matrices only (not norms or biases)
    betas: tuple[float, float] = (0.9, 0.95)  # Adam's moment decay rates
    fused: bool = False  # ampkit.ops.FusedAdam (AdamW maths) instead of torch.optim.AdamW


@dataclass
class GPTGenerateConfig:
    prompt: str = "The "  # text the samples continue (at least one character)
    tokens: int = 200  # bytes generated per sample
    top_k: int = 10  # 0: greedy; else sample among the k most likely bytes
    temperature: float = 0.8  # 0: greedy
    every_n_steps: int = 100  # a sample to TensorBoard's Text tab (else the console) every N iterations (0: never)


@dataclass
class GPTConfig(ampkit.Config):
    model: GPTModelConfig = field(default_factory=GPTModelConfig)
    data: GPTDataConfig = field(default_factory=GPTDataConfig)
    optim: GPTOptimConfig = field(default_factory=GPTOptimConfig)
    generate: GPTGenerateConfig = field(default_factory=GPTGenerateConfig)


# ---------------------------------------------------------------------------------------------- data
def corpus_bytes() -> torch.Tensor:
    """``pydoc_data.topics`` as one tensor of UTF-8 bytes (topics in sorted order: the same on every machine)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key].strip() for key in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def split(data: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``1 - val_fraction`` of the bytes for training, the rest for validation."""
    n_val = int(len(data) * val_fraction)
    return data[: len(data) - n_val], data[len(data) - n_val :]


def unigram_entropy(data: torch.Tensor) -> float:
    """Entropy (nats/byte) of the byte frequencies of ``data``: the loss of the best context-free model."""
    p = torch.bincount(data, minlength=VOCAB).double() / len(data)
    p = p[p > 0]
    return float(-(p * p.log()).sum())


class Windows(Dataset):
    """``count`` windows of ``seq_len + 1`` bytes starting every ``stride`` bytes (at most one per start): (input,
    next-byte target)."""

    def __init__(self, data: torch.Tensor, seq_len: int, stride: int | None = None, count: int | None = None) -> None:
        self.data, self.seq_len = data, seq_len
        room = len(data) - seq_len - 1
        if room < 0:
            raise ValueError(f"model.seq_len={seq_len} is longer than the text ({len(data)} bytes)")
        self.stride = stride or seq_len
        self.count = room // self.stride + 1 if count is None else min(count, room + 1)
        if count is not None:  # evenly spread; a text too short for count windows gets one at each start
            self.stride = max(room // max(self.count - 1, 1), 1)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.stride : i * self.stride + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


# ---------------------------------------------------------------------------------------------- model
def make_norm(kind: str, width: int, fused: bool) -> nn.Module:
    if kind == "layernorm":
        return ampkit.ops.FusedLayerNorm(width) if fused else nn.LayerNorm(width)
    return ampkit.ops.FusedRMSNorm(width) if fused else nn.RMSNorm(width)


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: GPTModelConfig) -> None:
        super().__init__()
        w = cfg.width
        self.norm1 = make_norm(cfg.norm, w, cfg.fused_norm)
        self.attn = Attention(w, cfg.heads, cfg.dropout)
        self.norm2 = make_norm(cfg.norm, w, cfg.fused_norm)
        self.mlp = nn.Sequential(nn.Linear(w, 4 * w, bias=False), nn.GELU(), nn.Linear(4 * w, w, bias=False))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    """Byte embeddings + learnt positions → blocks → final norm → logits (the output layer shares the embedding)."""

    def __init__(self, cfg: GPTModelConfig) -> None:
        super().__init__()
        self.seq_len = cfg.seq_len
        self.embed = nn.Embedding(VOCAB, cfg.width)
        self.pos = nn.Embedding(cfg.seq_len, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = make_norm(cfg.norm, cfg.width, cfg.fused_norm)
        self.head = nn.Linear(cfg.width, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2's init; residual projections scaled down by depth
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.shape[1] > self.seq_len:  # the position table ends there: an IndexError naming nothing otherwise
            raise ValueError(
                f"GPT: an input of {idx.shape[1]} tokens is longer than model.seq_len={self.seq_len}; "
                f"pass at most the last {self.seq_len} (generate() does)"
            )
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.embed(idx) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        device = "cpu" if x.is_meta else x.device.type  # meta (the FLOP count) has no autocast state
        with torch.autocast(device, enabled=False):  # the logits in the weights' dtype: float32 under O1
            return self.head(x.to(self.head.weight.dtype))


def matmul_params(cfg: GPTModelConfig) -> int:
    """Parameters that multiply activations: the blocks' linears and the output layer (embeddings only index)."""
    return cfg.layers * 12 * cfg.width**2 + VOCAB * cfg.width


def flops_per_token_formula(cfg: GPTModelConfig) -> int:
    """Training FLOPs per token by hand: 6 per matmul parameter, plus attention's QK^T and AV over the full
    (unmasked, as SDPA's counter counts it) ``seq_len x seq_len`` square: 2 products x 2 x 3 (fwd + bwd)."""
    return 6 * matmul_params(cfg) + 12 * cfg.layers * cfg.width * cfg.seq_len


def prompt_bytes(prompt: torch.Tensor | str | list[int]) -> torch.Tensor:
    """``prompt`` as the model's input: a 1-D long tensor of bytes. A str is encoded as UTF-8 (as the config's
    ``generate.prompt`` is); a tensor or list must hold integers in [0, 256), the vocabulary."""
    if isinstance(prompt, str):
        return torch.tensor(list(prompt.encode("utf-8")), dtype=torch.long)
    tensor = prompt if isinstance(prompt, torch.Tensor) else None
    if tensor is None and isinstance(prompt, list | tuple) and all(isinstance(b, int) for b in prompt):
        tensor = torch.tensor(prompt, dtype=torch.long)
    expected = f"expected one text's bytes: a str, or a 1-D tensor or list of integers in [0, {VOCAB})"
    if tensor is None:
        raise TypeError(f"generate: the prompt is {type(prompt).__name__} {shown(prompt)}; {expected}")
    integral = not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool)
    if tensor.dim() != 1 or not integral:
        raise TypeError(f"generate: the prompt is a {tensor.dim()}-D {tensor.dtype} tensor; {expected}")
    low, high = (int(tensor.min()), int(tensor.max())) if len(tensor) else (0, 0)
    if low < 0 or high >= VOCAB:  # the embedding's IndexError ("index out of range in self") named nothing
        raise ValueError(f"generate: the prompt holds values from {low} to {high}; {expected}")
    return tensor.long()


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor | str | list[int], tokens: int, top_k: int = 0,
             temperature: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:  # fmt: skip
    """``prompt`` (:func:`prompt_bytes`) followed by ``tokens`` more bytes: greedy (``top_k=0`` or ``temperature=0``)
    or sampled among the top k."""
    tokens = _setting("tokens", tokens, numbers.Integral, "an integer >= 0")
    top_k = _setting("top_k", top_k, numbers.Integral, "an integer >= 0 (0: greedy)")
    temperature = _setting("temperature", temperature, numbers.Real, "a finite number >= 0 (0: greedy)")
    weight = next(model.parameters(), None)
    if weight is not None and not isinstance(prompt, torch.Tensor):  # a text or list: where the model is
        prompt = prompt_bytes(prompt).to(weight.device)
    prompt = prompt_bytes(prompt)
    if tokens and not len(prompt):
        raise ValueError("generate: the prompt is empty; the model continues text, so give it at least one byte")
    idx = prompt[None]
    seq_len = model.seq_len
    finite = torch.ones((), dtype=torch.bool, device=idx.device)  # read once at the end on the greedy path: no sync
    for _ in range(tokens):
        with torch.compiler.set_stance("force_eager"):  # a new length each time: compiling each would cost minutes
            logits = model(idx[:, -seq_len:])[:, -1].float()
        finite &= logits.isfinite().all()
        if top_k and temperature > 0:
            _refuse_nonfinite(finite)  # sampling reads the host anyway; torch's multinomial names no cause
            # The k likeliest chosen before the temperature: divided first, a high one rounded them into a tie and a
            # tiny one overflowed them to inf (nan probabilities). Shifted so the best is 0, none can overflow; in
            # float64, where any finite temperature is finite.
            kth = logits.topk(min(top_k, VOCAB)).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf")).double()
            probs = ((logits - logits.amax(-1, keepdim=True)) / temperature).softmax(-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(idx.device)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt], dim=1)
    _refuse_nonfinite(finite)  # greedy: argmax of nan logits picks a byte silently
    return idx[0]


def _setting(name: str, value: Any, kind: type, valid: str) -> Any:
    """A sampling setting of ``kind`` (a one-element tensor read), finite and >= 0; else a ValueError naming it."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not (isinstance(value, kind) and math.isfinite(value) and value >= 0):
        raise ValueError(f"generate: {name}={shown(value)} is invalid; expected {valid}")
    return value


def _refuse_nonfinite(finite: torch.Tensor) -> None:
    if not finite:
        raise NonFiniteError(
            "generate: the model's logits are not finite (nan or inf), so no byte can be chosen from them: its "
            "weights have diverged or overflow in this precision; generate from an earlier checkpoint (--ckpt PATH)"
        )


def decode(data: torch.Tensor) -> str:
    return bytes(data.tolist()).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------- precision
def faster_cpu_precision(cfg: GPTModelConfig, batch_size: int, pairs: int = 7) -> tuple[bool, str]:
    """Whether bf16 autocast trains a block of this model clearly (10%) faster than float32 on this CPU, and why.

    Without AMX bf16 runs slower than float32 (2.4x on the CI machine), so only an AMX CPU is timed: one block's
    forward and backward at the training shape, in ``pairs`` back-to-back bf16/float32 pairs (alternating which
    runs first), the median of the pairs' ratios. Pairing cancels the drift another process's load puts on both."""
    if not torch.cpu._is_amx_tile_supported():
        return False, "a CPU without AMX (bf16 matmuls run slower than float32 there)"
    block = Block(cfg)
    x = torch.randn(batch_size, cfg.seq_len, cfg.width)

    def seconds(bf16: bool) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            block(x).float().sum().backward()
        return time.perf_counter() - start

    seconds(True), seconds(False)  # warm-up: oneDNN builds its kernels on first use
    ratios = []
    for i in range(pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        took = {bf16: seconds(bf16) for bf16 in order}
        ratios.append(took[False] / took[True])
    speedup = statistics.median(ratios)
    return speedup > 1.1, f"a block trained {speedup:.2f}x as fast in bf16 as in float32 on this CPU (with AMX)"


def choose_precision(cfg: DictConfig) -> str | None:
    """Replace ``precision.opt_level: auto`` by a real level in place; returns why (None if it was not auto).

    A ``precision.dtype`` given with ``auto`` is kept: autocast in it (O1). Otherwise a GPU gets bf16 autocast, a
    CPU the faster of bf16 and float32 (:func:`faster_cpu_precision`), except under several ranks: each would time
    on its own and they could choose apart, so they take float32 without timing."""
    if cfg.precision.opt_level != "auto":
        return None
    device = cfg.trainer.device
    on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if cfg.precision.dtype is not None:
        cfg.precision.opt_level = "O1"
        return f"precision.dtype={cfg.precision.dtype} was given: {cfg.precision.dtype} autocast (O1)"
    if on_gpu:
        bf16, why = True, "a GPU"
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        bf16, why = False, "several ranks on CPUs (timed apart, they could choose differently)"
    else:
        bf16, why = faster_cpu_precision(cfg.model, cfg.data.batch_size)
    cfg.precision.opt_level = "O1" if bf16 else "O0"
    cfg.precision.dtype = "bfloat16" if bf16 else None
    return why + ": " + ("bf16 autocast (O1), no loss scaler" if bf16 else "float32 (O0)")


def saved_precision(run_dir: str, ckpt: str | os.PathLike | None) -> tuple[str, str | None] | None:
    """The ``(opt_level, dtype)`` checkpoint ``ckpt`` (``last``, ``best`` or a path) trained in; None without one."""
    path = resolve_checkpoint(run_dir, ckpt)
    if path is None:
        return None
    saved = peek_checkpoint(path / TRAINER_FILE if path.is_dir() else path) or {}
    precision = (saved.get("config") or {}).get("precision") or {}
    if precision.get("opt_level") in (None, "auto"):
        return None
    return precision["opt_level"], precision.get("dtype")


def check_gpt_config(cfg: DictConfig) -> None:
    """The recipe's checks the schema cannot express, before anything is built or timed; a ConfigError naming
    each bad key and what it takes."""
    rules = {
        "model.layers": (lambda v: v >= 1, "an integer >= 1"),
        "model.width": (lambda v: v >= 1, "an integer >= 1"),
        "model.heads": (lambda v: v >= 1, "an integer >= 1"),
        "model.seq_len": (lambda v: v >= 1, "an integer >= 1"),
        "model.dropout": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
        "model.norm": (lambda v: v in ("layernorm", "rmsnorm"), "layernorm or rmsnorm"),
        "data.batch_size": (lambda v: v >= 1, "an integer >= 1"),
        "data.val_fraction": (lambda v: 0 < v < 1, "a number between 0 and 1 (the held-out share of the text)"),
        "data.val_batches": (lambda v: v >= 1, "an integer >= 1"),
        # finite: an infinite rate or decay made the first step's weights nan, and nothing refused it until sampling
        "optim.lr": (lambda v: 0 < v < math.inf, "a finite number > 0"),
        "optim.min_lr": (lambda v: 0 <= v < math.inf, "a finite number >= 0"),
        "optim.warmup_steps": (lambda v: v >= 0, "an integer >= 0"),
        "optim.weight_decay": (lambda v: 0 <= v < math.inf, "a finite number >= 0"),
        "optim.betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
        "generate.tokens": (lambda v: v >= 0, "an integer >= 0"),
        "generate.top_k": (lambda v: v >= 0, "an integer >= 0 (0: greedy)"),
        "generate.temperature": (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0 (0: greedy)"),
        "generate.every_n_steps": (lambda v: v >= 0, "an integer >= 0 (0: never)"),
    }
    problems = [
        f"config key '{key}': {shown(OmegaConf.select(cfg, key))} is invalid; expected {valid}"
        for key, (ok, valid) in rules.items()
        if not ok(OmegaConf.select(cfg, key))
    ]
    if cfg.generate.tokens and not cfg.generate.prompt:  # a sample continues the prompt: it needs a byte to start
        problems.append("config key 'generate.prompt': '' is invalid; expected at least one character (e.g. a newline)")
    if not problems and cfg.optim.min_lr > cfg.optim.lr:  # the cosine would climb to it: a swapped pair
        problems.append(f"config key 'optim.min_lr': {shown(cfg.optim.min_lr)} is above optim.lr "
                        f"({shown(cfg.optim.lr)}); expected at most optim.lr (the rate decays from optim.lr to "
                        "it)")  # fmt: skip
    m = cfg.model
    if not problems and m.width % m.heads:
        problems.append(f"config key 'model.width': {m.width} is not a multiple of model.heads ({m.heads})")
    if not problems:
        problems += _batch_problems(cfg) or _size_problems(m)
    if problems:
        raise ampkit.ConfigError("; ".join(problems))


def _size_problems(m: DictConfig) -> list[str]:
    """A model whose float32 weights alone exceed this machine's memory (a typo such as ``model.layers=10000000``):
    named here, where building it would run for hours or be killed without a word."""
    params = m.layers * 12 * m.width**2 + (VOCAB + m.seq_len) * m.width
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 4 * params <= memory:
        return []
    return [f"config keys 'model.layers' ({m.layers}), 'model.width' ({m.width}) and 'model.seq_len' ({m.seq_len}): "
            f"a model of {params:.2e} parameters needs {4 * params / 2**30:,.0f} GiB for its float32 weights alone, "
            f"more than this machine's {memory / 2**30:,.1f} GiB of memory; lower them"]  # fmt: skip


def _batch_problems(cfg: DictConfig) -> list[str]:
    """A text too short for one training batch per rank: named here, before the model is timed or built, where the
    Trainer would only say that the loader yields no batches."""
    batch, seq_len, ranks = cfg.data.batch_size, cfg.model.seq_len, int(os.environ.get("WORLD_SIZE", "1"))
    train, val = split(corpus_bytes(), cfg.data.val_fraction)
    if len(val) <= seq_len:
        return [f"config key 'model.seq_len': {seq_len} is not shorter than the held-out text ({len(val)} bytes, "
                "data.val_fraction); lower it or raise data.val_fraction"]  # fmt: skip
    windows = (len(train) - seq_len - 1) // seq_len + 1 if len(train) > seq_len else 0
    if windows // ranks >= batch:
        return []
    per_rank = f" per rank ({ranks} ranks)" if ranks > 1 else ""
    return [f"config keys 'data.batch_size' ({batch}) and 'model.seq_len' ({seq_len}): the training text makes "
            f"{windows} windows of {seq_len} bytes, fewer than one batch{per_rank}; lower either"]  # fmt: skip


# ---------------------------------------------------------------------------------------------- trainer
class GPTTrainer(ampkit.Trainer):
    """Next-byte prediction; validation reports ``loss`` (nats/byte) and ``bits_per_byte``."""

    config_class = GPTConfig

    def __init__(self, cfg: DictConfig | dict | None = None, callbacks: list[ampkit.Callback] | None = None) -> None:
        if not (cfg is None or isinstance(cfg, dict | DictConfig) or is_config_instance(cfg)):
            super().__init__(cfg, callbacks)  # a path or another object: the Trainer refuses it, naming what it takes
        # merged onto the schema as the Trainer does: an OmegaConf.create({...}) has no defaults, nothing to check
        here = {"trainer_class": f"{type(self).__module__}:{type(self).__qualname__}"}
        cfg = build_config(self.config_class, here, {} if cfg is None else cfg)
        check_gpt_config(cfg)
        self._machine_chose = cfg.precision.opt_level == "auto" and cfg.precision.dtype is None  # not the user
        self._chosen = False  # auto's level settled: from a checkpoint, or timed
        if self._machine_chose:  # chosen when a run starts, once it is known whether a checkpoint chose already
            cfg.precision.opt_level, self.precision_choice = "O0", None  # meanwhile the Trainer checks a real level
        else:
            self.precision_choice = choose_precision(cfg)
        fsdp = cfg.distributed.fsdp
        if cfg.distributed.strategy == "fsdp" and not fsdp.shard_modules:
            fsdp.shard_modules = ["Block"]  # one FSDP unit per block, gathered for its forward and backward only
        super().__init__(cfg, callbacks)
        self._data: dict[str, torch.Tensor] = {}

    def _keep_saved_precision(self, ckpt: str | os.PathLike | None) -> None:
        """Under ``opt_level: auto``, a resumed or evaluated checkpoint keeps the precision it trained in, untimed:
        timed again, the choice can flip on a loaded machine (or another world size) and the curve would change.
        Without a checkpoint the machine is timed, once per Trainer (never before it is known that none chose)."""
        if not self._machine_chose:
            return
        saved = saved_precision(self.cfg.run_dir, ckpt)
        if saved is not None:
            self.cfg.precision.opt_level, self.cfg.precision.dtype = saved
            level = f"{saved[0]} {saved[1] or 'float32'}"
            self.precision_choice = f"{level}, the checkpoint's (auto chooses once, when a run starts)"
        elif not self._chosen:
            self.cfg.precision.opt_level = "auto"
            self.precision_choice = choose_precision(self.cfg)
        self._chosen = True

    def fit(self, resume: str | os.PathLike | None = None) -> None:
        self._keep_saved_precision(resume)
        super().fit(resume)

    def validate(self, ckpt: str | os.PathLike | None = None) -> dict[str, float]:
        self._keep_saved_precision(ckpt)
        return super().validate(ckpt)

    def test(self, ckpt: str | os.PathLike | None = None) -> dict[str, float]:
        self._keep_saved_precision(ckpt)
        return super().test(ckpt)

    def predict(
        self, ckpt: str | os.PathLike | None = None, output: str | os.PathLike | None = None, overwrite: bool = False
    ) -> list[Any]:
        self._keep_saved_precision(ckpt)
        return super().predict(ckpt, output, overwrite)

    def _split(self, which: str) -> torch.Tensor:
        if not self._data:
            self._data["train"], self._data["val"] = split(corpus_bytes(), self.cfg.data.val_fraction)
        return self._data[which]

    def configure_model(self) -> nn.Module:
        m = OmegaConf.to_object(self.cfg.model)
        if self.precision_choice is not None:
            self.model_setup.notes["auto prec."] = self.precision_choice
        self.tokens_per_sample = m.seq_len
        with torch.device("meta"):  # FLOPs counted once, on a copy that computes and allocates nothing
            meta = GPT(m)
            idx = torch.zeros(1, m.seq_len, dtype=torch.long)
            self.flops_per_sample = count_training_flops(lambda: meta(idx).float().logsumexp(-1).sum())
        return GPT(m)

    def planned_steps(self) -> int:
        """Iterations this run trains: ``trainer.max_steps``, or ``max_epochs``' worth when they end it first (or
        ``max_steps`` is -1); the schedule decays to ``optim.min_lr`` over them."""
        t, batches = self.settings, self.num_train_batches
        if batches is None or t.max_epochs < 0:  # an iterable without a length, or no epoch limit: max_steps says
            return t.max_steps
        epochs = t.max_epochs * math.ceil(batches / t.accumulate_grad_batches)
        return epochs if t.max_steps < 0 else min(t.max_steps, epochs)

    def configure_optimizers(self) -> Any:
        # plain values: the schedule runs every step, and each read of an OmegaConf node costs microseconds
        o, steps = OmegaConf.to_object(self.cfg.optim), self.planned_steps()
        decay = [p for p in self.module.parameters() if p.dim() >= 2]
        other = [p for p in self.module.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": other, "weight_decay": 0.0}]
        if o.fused:
            optimizer = ampkit.ops.FusedAdam(groups, lr=o.lr, betas=tuple(o.betas))
        else:
            # fused on a GPU (as nanoGPT): one kernel, and it takes a skip verdict on the device (no host read)
            optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), fused=self.device.type == "cuda")

        def lr_factor(step: int) -> float:  # linear warm-up, then cosine to min_lr at the run's last step
            if step < o.warmup_steps:
                return (step + 1) / o.warmup_steps
            if steps <= o.warmup_steps:
                return 1.0
            progress = min((step - o.warmup_steps) / (steps - o.warmup_steps), 1.0)
            return (o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * progress))) / o.lr

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        windows = Windows(self._split("train"), self.cfg.model.seq_len)
        # The Trainer gives a shuffled loader a seeded sampler that deals one permutation per epoch round-robin to
        # the ranks: the same windows make up a step on any number of ranks (at a fixed global batch), so a run
        # resumed at another world size continues the same curve.
        return DataLoader(windows, batch_size=self.cfg.data.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        d = self.cfg.data
        # val_batches global batches (each rank validates its share): the same windows at one global batch on any
        # number of ranks, and with accumulation making it up, so a run resumed at another world size (two ranks
        # as one with accumulate_grad_batches=2) ranks its checkpoints on the same set.
        count = d.val_batches * d.batch_size * self.world_size * self.settings.accumulate_grad_batches
        windows = Windows(self._split("val"), self.cfg.model.seq_len, count=count)
        return DataLoader(windows, batch_size=d.batch_size)

    def predict_dataloader(self) -> list[torch.Tensor]:
        return [prompt_bytes(self.cfg.generate.prompt)]

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def validation_step(self, batch):
        x, y = batch
        loss = F.cross_entropy(self.model(x).flatten(0, 1).float(), y.flatten())
        return {"loss": loss, "bits_per_byte": loss / math.log(2)}

    def predict_step(self, batch: torch.Tensor) -> str:
        g = self.cfg.generate
        generator = torch.Generator().manual_seed(self.settings.seed or 0)
        return decode(generate(self.module, batch, g.tokens, g.top_k, g.temperature, generator))

    def on_fit_start(self) -> None:
        if self.is_global_zero:
            train = self._split("train")
            say(f"  unigram entropy of the training bytes: {unigram_entropy(train):.3f} nats/byte "
                "(a model must go below it to have learnt context)", sys.stdout)  # fmt: skip

    def on_train_start(self) -> None:
        self._sample_every = self.cfg.generate.every_n_steps  # read once: on_train_batch_end runs every batch

    def on_train_batch_end(self, outputs: dict[str, Any], batch: Any) -> None:
        every = self._sample_every
        s = self.state
        if every and s.is_iteration_end and s.iteration % every == 0:  # every rank: a sharded forward is collective
            self.module.eval()
            with self.paused():  # sampling is not training: tokens/s and MFU leave it out, as they do validation
                text = self.predict_step(self.predict_dataloader()[0].to(self.device))
            self.module.train()
            if self.cfg.logging.tensorboard:
                self.logger.log_text("samples", text)
            elif self.is_global_zero:  # no TensorBoard to take it: the console, rather than generating for nothing
                say_above_the_bars(f"  sample at step {s.iteration}: {text!r}")

    def on_predict_start(self) -> None:
        setting = self.cfg.trainer.compile
        if setting is not False:  # generation runs eagerly: the setting would do nothing, silently
            given = "true" if setting is True else list(setting)
            rank_zero_warn(
                f"config key 'trainer.compile'={given}: predict generates eagerly (each new length would compile "
                "another graph), so nothing runs compiled; leave the key out for predict"
            )

    def on_predict_end(self, predictions: list[str]) -> None:
        if self.is_global_zero:
            for text in predictions:
                print(text, flush=True)
