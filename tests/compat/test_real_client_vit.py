"""jeonsworld's ViT-pytorch (2020), the fine-tuning script many vision-transformer repositories copied (TransFG and
others), written here after its ``train.py`` and CPU-sized: ``amp.initialize(models=..., optimizers=...)`` at O2 with
a warm-up cosine ``LambdaLR`` built before it, the first scale written to ``_amp_state.loss_scalers[0]._loss_scale``
(``2**20``), accumulation without ``delay_unscale``, the masters clipped, and ``scheduler.step()`` before
``optimizer.step()``."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from ampkit.compat import install_apex_shim, uninstall_apex_shim


@pytest.fixture
def shim():
    install_apex_shim()
    yield
    uninstall_apex_shim()


class _VisionTransformer(torch.nn.Module):
    """The model in outline: patch embedding, class token and positions, a pre-norm block, a head; with labels it
    returns the loss, without them the logits and the features."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = torch.nn.Conv2d(3, 16, 4, stride=4)
        self.cls_token = torch.nn.Parameter(torch.zeros(1, 1, 16))
        self.position = torch.nn.Parameter(torch.randn(1, 5, 16) * 0.02)
        self.block = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=True)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None):
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), tokens], 1) + self.position
        features = self.norm(self.block(tokens))
        logits = self.head(features[:, 0])
        if labels is not None:
            return F.cross_entropy(logits.view(-1, 5), labels.view(-1))
        return logits, features


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")  # its order, as under Apex
def test_vit_pytorch_at_2_to_the_20_backs_off_once_per_overflowing_micro_batch_and_skips_once_per_step(shim, capsys):
    """Its first scale overflows fp16: each overflowing backward halves the scale, and the iteration's one
    ``optimizer.step()`` is skipped once (Apex patched the step once, however many backwards overflowed before it),
    its message naming the scale at the step. The scheduler counts every iteration, the masters stay finite, and
    once the scale fits every step is taken."""
    from apex import amp

    torch.manual_seed(0)
    model = _VisionTransformer()
    optimizer = torch.optim.SGD(model.parameters(), lr=3e-2, momentum=0.9)
    warmup, total = 2, 10

    def warmup_cosine(step: int) -> float:
        if step < warmup:
            return step / warmup
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / (total + 2 - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
    model, optimizer = amp.initialize(models=model, optimizers=optimizer, opt_level="O2")
    amp._amp_state.loss_scalers[0]._loss_scale = 2**20
    capsys.readouterr()
    scales, stepped, messages = [], [], []
    for step in range(total):
        before = [p.detach().clone() for p in amp.master_params(optimizer)]
        for micro in range(2):
            g = torch.Generator().manual_seed(10 * step + micro)
            x, labels = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)
            loss = model(x, labels) / 2
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            scales.append(amp._amp_state.loss_scalers[0].loss_scale())
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        scheduler.step()
        optimizer.step()
        optimizer.zero_grad()
        stepped.append(not all(torch.equal(a, b) for a, b in zip(before, amp.master_params(optimizer), strict=True)))
        messages.append(capsys.readouterr().out)

    previous = [2.0**20, *scales[:-1]]
    overflows = [a > b for a, b in zip(previous, scales, strict=True)]  # a scale halves only on an overflow
    assert all(b in (a, a / 2) for a, b in zip(previous, scales, strict=True))
    assert sum(overflows) >= 3 and not any(overflows[-8:])  # 2**20 is far too large for fp16; then it fits
    for step in range(total):
        overflowed = overflows[2 * step] or overflows[2 * step + 1]
        assert stepped[step] is not overflowed
        want = f"Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to {scales[2 * step + 1]}\n"
        assert messages[step] == (want if overflowed else "")
    assert scheduler.last_epoch == total and all(torch.isfinite(p).all() for p in amp.master_params(optimizer))
    assert re.fullmatch(r"\d+\.0", str(amp.state_dict()["loss_scaler0"]["loss_scale"]))
    logits, features = model(torch.randn(2, 3, 8, 8))
    assert logits.dtype == features.dtype == torch.float32  # O2 casts the tuple of outputs back
