"""Apex's fused softmax cross-entropy (``apex.contrib.xentropy``, ``xentropy_cuda``) under the shim, as fairseq's
``modules/cross_entropy.py`` (``ignore_index`` passed as ``padding_idx``, ``half_to_float`` for fp16 logits) and
MosaicML Composer (its own autograd Function on ``xentropy_cuda.forward``/``backward``) drive it. Losses and
gradients are checked in float64 against label-smoothed cross-entropy written out."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from ampkit.compat import install_apex_shim, uninstall_apex_shim


@pytest.fixture
def shim():
    install_apex_shim()
    yield
    uninstall_apex_shim()


def reference_losses(logits, labels, smoothing, padding_idx):
    """Per row ``(1 - s) * -log p[label] + s * mean(-log p)``, 0 at padding rows, in float64."""
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    padding = labels == padding_idx
    nll = -log_probs.gather(1, labels.masked_fill(padding, 0).unsqueeze(1)).squeeze(1)
    losses = (1 - smoothing) * nll - smoothing * log_probs.mean(dim=-1)
    return losses.masked_fill(padding, 0)


def _fairseq_cross_entropy(logits, target, ignore_index=-100, smoothing=0.0, reduction="mean"):
    """fairseq/modules/cross_entropy.py's fused path (its CPU check left out: it is what runs on a GPU)."""
    import xentropy_cuda  # noqa: F401  (fairseq imports both, in one try block)
    from apex.contrib import xentropy

    half_to_float = logits.dtype == torch.half
    losses = xentropy.SoftmaxCrossEntropyLoss.apply(logits, target, smoothing, ignore_index, half_to_float)
    if reduction == "sum":
        return losses.sum()
    if reduction == "mean":
        return losses.sum() / target.ne(ignore_index).sum() if ignore_index >= 0 else losses.mean()
    return losses


def _logits_and_targets(dtype=torch.float64, rows=12, classes=37):
    torch.manual_seed(0)
    logits = (torch.randn(rows, classes, dtype=torch.float64) * 4).to(dtype).requires_grad_()
    target = torch.randint(0, classes, (rows,))
    return logits, target


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignore_index", [-100, 1])
def test_fairseq_fused_cross_entropy_matches_the_label_smoothed_loss_and_its_gradient(shim, smoothing, ignore_index):
    logits, target = _logits_and_targets()
    target[[2, 7]] = ignore_index  # padding rows; -100 lies outside the classes and must not be read
    loss = _fairseq_cross_entropy(logits, target, ignore_index, smoothing, reduction="sum")
    (grad,) = torch.autograd.grad(loss, logits)
    expected_logits = logits.detach().clone().requires_grad_()
    expected = reference_losses(expected_logits, target, smoothing, ignore_index).sum()
    (expected_grad,) = torch.autograd.grad(expected, expected_logits)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)
    assert torch.equal(grad[[2, 7]], torch.zeros(2, logits.shape[1], dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_logits_with_half_to_float_give_float32_losses_and_half_gradients(shim, dtype):
    from apex.contrib.xentropy import SoftmaxCrossEntropyLoss

    logits, target = _logits_and_targets(dtype)
    target[0] = 0  # Apex's default padding_idx
    losses = SoftmaxCrossEntropyLoss.apply(logits, target, 0.1, 0, True)
    assert losses.dtype == torch.float32 and losses[0] == 0
    upstream = torch.randn(losses.shape)
    (grad,) = torch.autograd.grad(losses, logits, upstream)
    assert grad.dtype == dtype
    exact_logits = logits.detach().double().requires_grad_()
    exact = reference_losses(exact_logits, target, 0.1, 0)
    (exact_grad,) = torch.autograd.grad(exact, exact_logits, upstream.double())
    torch.testing.assert_close(losses.double(), exact, rtol=1e-6, atol=1e-5)  # float32 maths on the half values
    torch.testing.assert_close(grad.double(), exact_grad, rtol=0, atol=4e-3)  # rounded once to the logits' dtype


def test_composer_function_on_the_extension_module(shim):
    """Composer's Function: ``xentropy_cuda.forward`` then its own masking, ``backward`` with the saved
    log-sum-exp."""
    xentropy_cuda = importlib.import_module("xentropy_cuda")

    class SoftmaxCrossEntropyLossFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, labels, smoothing=0.0, padding_idx=0, half_to_float=False):
            losses, max_log_sum_exp = xentropy_cuda.forward(logits, labels, smoothing, half_to_float)
            losses.masked_fill_(labels == padding_idx, 0)
            ctx.save_for_backward(logits, max_log_sum_exp, labels)
            ctx.smoothing, ctx.padding_idx = smoothing, padding_idx
            return losses

        @staticmethod
        def backward(ctx, grad_loss):
            logits, max_log_sum_exp, labels = ctx.saved_tensors
            grad_loss = grad_loss.contiguous().masked_fill_(labels == ctx.padding_idx, 0)
            grad_logits = xentropy_cuda.backward(grad_loss, logits, max_log_sum_exp, labels, ctx.smoothing)
            return grad_logits, None, None, None, None

    logits, target = _logits_and_targets()
    target[5] = -1
    losses = SoftmaxCrossEntropyLossFn.apply(logits, target, 0.2, -1)
    _, max_log_sum_exp = xentropy_cuda.forward(logits.detach(), target, 0.2, False)
    torch.testing.assert_close(max_log_sum_exp, torch.logsumexp(logits.detach(), dim=-1), rtol=1e-14, atol=0)
    (grad,) = torch.autograd.grad(losses.sum(), logits)
    exact_logits = logits.detach().clone().requires_grad_()
    (exact_grad,) = torch.autograd.grad(reference_losses(exact_logits, target, 0.2, -1).sum(), exact_logits)
    torch.testing.assert_close(losses, reference_losses(logits.detach(), target, 0.2, -1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, exact_grad, rtol=1e-12, atol=1e-12)


def test_bad_arguments_are_named(shim):
    from apex.contrib.xentropy import SoftmaxCrossEntropyLoss

    xentropy_cuda = importlib.import_module("xentropy_cuda")
    logits, target = _logits_and_targets(torch.float32)
    target[3] = 37
    with pytest.raises(ValueError, match=r"label 37 \(row 3\) is outside 0\.\.36 and is not padding_idx=0"):
        SoftmaxCrossEntropyLoss.apply(logits, target, 0.0, 0)  # Apex's kernel read past the row
    with pytest.raises(ValueError, match=r"half_to_float=True takes float16 or bfloat16 logits, got torch\.float32"):
        xentropy_cuda.forward(logits, target, 0.0, True)
    with pytest.raises(TypeError, match=r"half_to_float must be True or False, got 'False'"):  # pybind11's TypeError
        xentropy_cuda.forward(logits, target, 0.0, "False")  # was read as True, and named so
    with pytest.raises(ValueError, match=r"logits must be 2-D \(rows, classes\), got shape \[2, 6, 37\]"):
        xentropy_cuda.forward(logits.reshape(2, 6, 37), target, 0.0, False)
    with pytest.raises(ValueError, match=r"labels must be 1-D int64 with one entry per logits row \(12\)"):
        xentropy_cuda.forward(logits, target.int(), 0.0, False)


def test_sparse_logits_or_labels_on_another_device_are_named(shim):
    """Sparse logits failed in torch's dispatcher, naming a SparseCPU backend; logits on another device than the
    labels (a meta model) failed in a gather naming neither."""
    xentropy_cuda = importlib.import_module("xentropy_cuda")
    logits, target = _logits_and_targets(torch.float32)
    with pytest.raises(TypeError, match=r"^xentropy_cuda.forward: logits is a torch.sparse_coo tensor"):
        xentropy_cuda.forward(logits.to_sparse(), target, 0.0, False)
    with pytest.raises(ValueError, match=r"^xentropy_cuda.forward: labels are on cpu but logits on meta"):
        xentropy_cuda.forward(logits.to("meta"), target, 0.0, False)


def _fused_lm():
    from apex.fused_dense import FusedDense, FusedDenseGeluDense
    from apex.normalization import FusedLayerNorm

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(40, 16, padding_idx=1)
            self.ln, self.mlp, self.out = FusedLayerNorm(16), FusedDenseGeluDense(16, 32, 16), FusedDense(16, 40)

        def forward(self, x):
            h = self.emb(x)
            return self.out(h + self.mlp(self.ln(h)))

    torch.manual_seed(0)
    return LM()


def _train(model, optimizer, batches):
    from apex import amp

    for tokens in batches:
        source, target = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        logits = model(source)
        loss = _fairseq_cross_entropy(logits.view(-1, 40), target.view(-1), ignore_index=1, smoothing=0.1)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        optimizer.step()


def test_an_o2_lm_on_fused_dense_and_xentropy_resumes_bit_for_bit(shim):
    """fp16 layers (Apex's O2 casts the logits back to float32 for the loss); a run killed after its checkpoint
    {model, optimizer, amp} continues as if it had never stopped."""
    from apex import amp
    from apex.optimizers import FusedAdam

    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 40, (4, 9), generator=generator) for _ in range(6)]

    def start():
        amp._amp_state.reset()
        model = _fused_lm()
        optimizer = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
        return amp.initialize(model, optimizer, opt_level="O2", verbosity=0)

    model, optimizer = start()
    assert model.out.weight.dtype == model.mlp.weight1.dtype == torch.float16
    _train(model, optimizer, batches)
    straight = {k: v.clone() for k, v in model.state_dict().items()}
    masters = [p.detach().clone() for p in amp.master_params(optimizer)]

    model, optimizer = start()
    _train(model, optimizer, batches[:3])
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}
    checkpoint = copy.deepcopy(checkpoint)
    model, optimizer = start()
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    _train(model, optimizer, batches[3:])
    assert all(torch.equal(v, straight[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(p, m) for p, m in zip(amp.master_params(optimizer), masters, strict=True))


@pytest.mark.parametrize("smoothing", [float("nan"), -0.1, 1.5, "0.1", None])
def test_a_smoothing_outside_torchs_label_smoothing_range_is_refused_by_name(shim, smoothing):
    """A NaN smoothing gave NaN losses, 1.5 a negative weight on the true class, and the string "0.1" (a config value
    left unparsed) was read as 0.1: each silently. torch's cross_entropy takes label_smoothing in [0, 1]."""
    from apex.contrib.xentropy import SoftmaxCrossEntropyLoss

    xentropy_cuda = importlib.import_module("xentropy_cuda")
    logits, target = _logits_and_targets(torch.float32)
    match = r"Invalid xentropy_cuda\.forward smoothing: .* \[0\.0, 1\.0\]"
    with pytest.raises((TypeError, ValueError), match=match):
        SoftmaxCrossEntropyLoss.apply(logits, target, smoothing, 0)
    log_sum_exp = torch.logsumexp(logits, dim=1)
    with pytest.raises((TypeError, ValueError), match=match.replace("forward", "backward")):
        xentropy_cuda.backward(torch.ones(12), logits, log_sum_exp, target, smoothing)
    for edge in (0.0, 1.0, torch.tensor(0.5)):  # the range's ends, and a one-element tensor as Apex's binding took
        assert SoftmaxCrossEntropyLoss.apply(logits, target, edge, 0).isfinite().all()
