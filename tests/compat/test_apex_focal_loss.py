"""Apex's fused focal loss under the shim, as NVIDIA's EfficientDet (DeepLearningExamples) drives it: its own
autograd Function around ``focal_loss_cuda.forward``/``backward`` (the module imported at the top of
``effdet/focal_loss.py``), logits padded to a multiple of 8 classes, ``-2`` for ignored anchors, label smoothing.
The loss is checked against the focal loss written out in float64, and the gradient against autograd of it."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from ampkit.compat import install_apex_shim, uninstall_apex_shim


@pytest.fixture
def focal_loss_cuda():
    install_apex_shim()
    yield importlib.import_module("focal_loss_cuda")
    uninstall_apex_shim()


def reference_focal_loss(logits, targets, num_positives, num_real_classes, alpha, gamma, smoothing):
    """Sigmoid focal loss against smoothed one-hot targets, ignored anchors and pad classes left out."""
    classes = torch.arange(logits.shape[-1])
    one_hot = (targets.unsqueeze(-1) == classes).to(logits.dtype)
    smoothed = one_hot * (1 - smoothing) + smoothing / 2
    prob = torch.sigmoid(logits)
    p_t = one_hot * prob + (1 - one_hot) * (1 - prob)
    alpha_t = one_hot * alpha + (1 - one_hot) * (1 - alpha)
    bce = F.binary_cross_entropy_with_logits(logits, smoothed, reduction="none")
    counted = (targets.unsqueeze(-1) != -2) & (classes < num_real_classes)
    return (alpha_t * (1 - p_t).pow(gamma) * bce * counted).sum() / num_positives.double().reshape(())


def _efficientdet_function(extension):
    class FocalLoss(torch.autograd.Function):  # effdet/focal_loss.py
        @staticmethod
        def forward(ctx, cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma,
                    label_smoothing=0.0):  # fmt: skip
            loss, partial_grad = extension.forward(
                cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma, label_smoothing
            )
            ctx.save_for_backward(partial_grad, num_positives_sum)
            return loss

        @staticmethod
        def backward(ctx, grad_loss):
            partial_grad, num_positives_sum = ctx.saved_tensors
            grad_input = extension.backward(grad_loss, partial_grad, num_positives_sum)
            return grad_input, None, None, None, None, None, None

    return FocalLoss


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_efficientdet_focal_loss_matches_the_focal_loss_and_its_gradient(focal_loss_cuda, smoothing):
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 8, dtype=torch.float64) * 3
    targets = torch.randint(-1, 5, (2, 6))  # 5 real classes padded to 8; -1 background
    targets[0, 1] = -2  # ignored anchor
    num_positives = torch.tensor([float((targets >= 0).sum())])
    x = logits.clone().requires_grad_()
    loss = _efficientdet_function(focal_loss_cuda).apply(x, targets, num_positives, 5, 0.25, 1.5, smoothing)
    (loss * 3).backward()
    x_ref = logits.clone().requires_grad_()
    expected = reference_focal_loss(x_ref, targets, num_positives, 5, 0.25, 1.5, smoothing)
    (expected * 3).backward()
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert torch.allclose(loss.double(), expected, rtol=1e-6)
    assert torch.allclose(x.grad, x_ref.grad, rtol=1e-5, atol=1e-7)
    assert x.grad[0, 1].abs().sum() == 0 and x.grad[..., 5:].abs().sum() == 0


def test_apex_contrib_focal_loss_as_apex_tests_import_it_and_a_clear_error(focal_loss_cuda):
    from apex.contrib.focal_loss import focal_loss  # the module: Apex's package __init__ deletes the function

    logits = torch.randn(3, 8, dtype=torch.half, requires_grad=True)
    targets = torch.tensor([0, -1, 3])
    loss = focal_loss.FocalLoss.apply(logits, targets, torch.ones([]), 4, 0.25, 2.0, 0.0)
    assert torch.equal(loss, focal_loss.focal_loss(logits, targets, torch.ones([]), 4, 0.25, 2.0))
    loss.backward()
    assert logits.grad.dtype == torch.half and torch.isfinite(logits.grad).all()
    with pytest.raises(ValueError, match=r"cls_output \[3, 8\] must be cls_targets_at_level's shape \[2\]"):
        focal_loss_cuda.forward(logits, targets[:2], torch.tensor([2.0]), 4, 0.25, 2.0, 0.0)


def test_integer_logits_a_scalar_and_a_batched_grad_loss_are_refused_by_name(focal_loss_cuda):
    targets, num_positives = torch.zeros(2, 3, dtype=torch.long), torch.tensor([1.0])
    cases = [  # Apex's kernel dispatched on floating logits only and asserted one more dim than the targets
        (lambda: focal_loss_cuda.forward(torch.zeros(2, 3, 8, dtype=torch.long), targets, num_positives, 8, 0.25, 2.0),
         r"cls_output must be a floating-point tensor, got torch.int64"),
        (lambda: focal_loss_cuda.forward(torch.tensor(1.0), torch.tensor(0), num_positives, 1, 0.25, 2.0),
         r"cls_output \[\] must be cls_targets_at_level's shape \[\] plus a class dimension"),
        (lambda: focal_loss_cuda.backward(torch.ones(2), torch.zeros(2, 3, 8), num_positives),
         r"grad_loss must be the one-element gradient of the loss, got shape \[2\]"),
    ]  # fmt: skip
    for call, message in cases:
        with pytest.raises((TypeError, ValueError), match=message):
            call()


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("alpha", float("nan")),
        ("alpha", float("-inf")),
        ("gamma", -1.0),
        ("gamma", float("inf")),
        ("label_smoothing", 1.5),
        ("alpha", "0.25"),
    ],
)
def test_a_hyper_parameter_that_makes_every_loss_nan_or_inf_is_refused_by_name(focal_loss_cuda, argument, value):
    """The host numbers are checked where it costs nothing: a NaN alpha, a negative or infinite gamma (sigma**gamma
    near 0) and a smoothing outside [0, 1] made the loss NaN or inf with no error."""
    logits, targets, num_positives = torch.randn(2, 3, 8), torch.zeros(2, 3, dtype=torch.long), torch.tensor([1.0])
    arguments = {"alpha": 0.25, "gamma": 2.0, "label_smoothing": 0.1, argument: value}
    with pytest.raises((TypeError, ValueError), match=rf"Invalid focal_loss_cuda\.forward {argument}: "):
        focal_loss_cuda.forward(logits, targets, num_positives, 8, *arguments.values())
    with pytest.raises(TypeError, match=r"num_real_classes must be an int, got 7\.5"):
        focal_loss_cuda.forward(logits, targets, num_positives, 7.5, 0.25, 2.0, 0.0)
    loss, _ = focal_loss_cuda.forward(logits, targets, num_positives, 8, 0.25, 2.0, 1.0)
    assert loss.isfinite()
