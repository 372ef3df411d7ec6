"""Clipping by ``trainer.clip_grad_norm`` is ``torch.nn.utils.clip_grad_norm_``: the same total norm and the same
clipped gradients, bit for bit, over parameters with no gradient, empty ones, and O2's fp32 masters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from toy_trainers import ToyTrainer, toy_cfg

from ampkit import Callback, Phase

QUIET = {"checkpoint.enabled": False, "logging.tensorboard": False, "trainer.progress_bar": False,
         "logging.throughput": False, "trainer.num_sanity_val_steps": 0, "trainer.val_every_n_epochs": 0}  # fmt: skip


class ManyParams(torch.nn.Module):
    """Layers of several sizes, one never used (its parameters get no gradient) and an empty parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in [(6, 32), (32, 3), (3, 17), (17, 1)])
        self.unused = torch.nn.Linear(4, 4)
        self.empty = torch.nn.Parameter(torch.empty(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x)) * 3
        return x + self.empty.sum()


class ManyParamsTrainer(ToyTrainer):
    dtype = torch.float64

    def configure_model(self):
        return ManyParams().to(self.dtype)

    def training_step(self, batch):
        x, y = batch
        out = self.model(x.to(self.dtype)).squeeze(1).float()
        return F.mse_loss(out, y) * 1000  # a norm far above max_norm: every step clips


class Grads(Callback):
    """Each step's gradients as clipping got them (a phase before it) and as the optimizer steps on them."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def _grads(self, optimizer) -> list[torch.Tensor | None]:
        return [None if p.grad is None else p.grad.clone() for g in optimizer.param_groups for p in g["params"]]

    def on_before_optimizer_step(self, trainer, optimizer) -> None:  # DEFAULT: after CLIP
        self.seen[-1]["clipped"] = self._grads(optimizer)
        self.seen[-1]["norm"] = trainer.grad_norm(optimizer).clone()

    def on_train_batch_start(self, trainer, batch) -> None:
        if trainer.state.is_iteration_start:
            self.seen.append({})


class Unclipped(Callback):
    """Records the gradients before clipping: runs at on_before_optimizer_step in the DISTRIBUTE phase."""

    hook_phases = {"on_before_optimizer_step": Phase.DISTRIBUTE}

    def __init__(self, grads: Grads) -> None:
        self.grads = grads

    def on_before_optimizer_step(self, trainer, optimizer) -> None:
        self.grads.seen[-1]["raw"] = self.grads._grads(optimizer)


def _run(tmp_path, max_norm: float, trainer=ManyParamsTrainer, accumulate: int = 1, **precision) -> list[dict]:
    grads = Grads()
    settings = {"trainer.clip_grad_norm": max_norm, "trainer.max_steps": 4, "trainer.max_epochs": 2}
    settings["trainer.accumulate_grad_batches"] = accumulate
    trainer(toy_cfg(tmp_path, **QUIET, **precision, **settings), callbacks=[grads, Unclipped(grads)]).fit()
    steps = grads.seen  # one per iteration: with accumulation, recorded at its window's last batch
    assert len(steps) == 4 and all("clipped" in step for step in steps)
    return steps


def _torch_clip(raw: list[torch.Tensor | None], max_norm: float) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    params = []
    for grad in raw:
        p = torch.nn.Parameter(torch.zeros(0 if grad is None else grad.shape, dtype=torch.float64))
        p.grad = None if grad is None else grad.clone()
        params.append(p)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm, [p.grad for p in params]


def _assert_same(ours: list[torch.Tensor | None], theirs: list[torch.Tensor | None]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize(("max_norm", "accumulate"), [(0.5, 1), (1e-30, 1), (0.5, 3)])
def test_the_norm_and_the_clipped_grads_are_torch_s_in_float64(tmp_path, max_norm, accumulate):
    """Parameters with no gradient are left out, an empty one counts nothing, and even a tiny max_norm scales the
    gradients exactly as torch does (coefficient max_norm / (norm + 1e-6)). Accumulating, the window's summed
    gradients are clipped once, at its end (as Lightning clips)."""
    for step in _run(tmp_path, max_norm, accumulate=accumulate):
        assert step["raw"][0].numel() == 0 and step["raw"][-2:] == [None, None]  # empty; unused
        norm, clipped = _torch_clip(step["raw"], max_norm)
        assert torch.equal(step["norm"], norm)
        assert step["norm"] > max_norm
        _assert_same(step["clipped"], clipped)


def test_a_norm_under_max_norm_leaves_the_grads_untouched(tmp_path):
    """The coefficient is clamped at 1: gradients under the limit are not scaled up, not even by rounding."""
    for step in _run(tmp_path, 1e30):
        _assert_same(step["clipped"], step["raw"])


class HalfManyParamsTrainer(ManyParamsTrainer):
    dtype = torch.float32  # O2 casts the model; its optimizer steps fp32 masters


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_under_o2_the_masters_unscaled_grads_are_clipped_as_torch_clips_them(tmp_path, dtype):
    """O2 half weights with fp32 masters: clipping sees the masters' unscaled fp32 gradients, and its norm and
    clipped gradients are torch's over those."""
    precision = {"precision.opt_level": "O2", "precision.dtype": dtype}
    if dtype == "float16":
        precision["precision.init_scale"] = 1.0  # no overflow: every step clips
    for step in _run(tmp_path, 0.5, trainer=HalfManyParamsTrainer, **precision):
        assert {g.dtype for g in step["raw"] if g is not None} == {torch.float32}
        params = []
        for grad in step["raw"]:
            p = torch.nn.Parameter(torch.zeros(0 if grad is None else grad.shape))
            p.grad = None if grad is None else grad.clone()
            params.append(p)
        assert torch.equal(step["norm"], torch.nn.utils.clip_grad_norm_(params, 0.5))
        _assert_same(step["clipped"], [p.grad for p in params])


def test_lightning_s_gradient_clip_algorithm_names_where_value_clipping_goes():
    expected = (
        r"gradient_clip_algorithm is no config key: clipping is by norm \(trainer.clip_grad_norm\); to clip by "
        r"value, call torch.nn.utils.clip_grad_value_ in a callback's on_before_optimizer_step"
    )
    with pytest.raises(TypeError, match=expected):
        ToyTrainer(gradient_clip_algorithm="value")


class ClipValue(Callback):
    """Lightning's gradient_clip_algorithm="value", as the docs say to write it."""

    def on_before_optimizer_step(self, trainer, optimizer) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_value_(params, 0.01)


def test_value_clipping_in_a_callback_clips_the_unscaled_grads_as_torch_does(tmp_path):
    """Under a float16 loss scaler the callback sees unscaled gradients: clip_grad_value_ there clips by the value
    the user means, not by it times the loss scale."""
    grads = Grads()
    cfg = toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 3, "precision.opt_level": "O1",
                                        "precision.dtype": "float16", "precision.init_scale": 1024.0})  # fmt: skip
    ManyParamsTrainer(cfg, callbacks=[ClipValue(), grads, Unclipped(grads)]).fit()
    for step in grads.seen:
        expected = [None if g is None else g.clamp(-0.01, 0.01) for g in step["raw"]]
        assert any(g is not None and g.numel() and g.abs().max() > 0.01 for g in step["raw"])
        _assert_same(step["clipped"], expected)
