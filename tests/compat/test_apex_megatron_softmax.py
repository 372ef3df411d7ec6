"""Apex's Megatron softmax extensions under the shim, as Megatron-LM (mid-2023 on) drives them: its
``FusedScaleMaskSoftmax`` asks ``scaled_masked_softmax_cuda.get_batch_per_block`` whether the fused path applies
to an fp16/bf16 attention, then its Functions import the extension inside ``forward``/``backward``. Checked
against Megatron's own torch path (scale, ``masked_fill(mask, -10000)``, softmax in float32) in float64."""

from __future__ import annotations

import importlib

import pytest
import torch

from ampkit.compat import install_apex_shim, uninstall_apex_shim


@pytest.fixture
def shim():
    install_apex_shim()
    yield
    uninstall_apex_shim()


class ScaledUpperTriangMaskedSoftmax(torch.autograd.Function):  # megatron/model/fused_softmax.py
    @staticmethod
    def forward(ctx, inputs, scale):
        import scaled_upper_triang_masked_softmax_cuda

        scale_t = torch.tensor([scale])
        softmax_results = scaled_upper_triang_masked_softmax_cuda.forward(inputs, scale_t[0])
        ctx.save_for_backward(softmax_results, scale_t)
        return softmax_results

    @staticmethod
    def backward(ctx, output_grads):
        import scaled_upper_triang_masked_softmax_cuda

        softmax_results, scale_t = ctx.saved_tensors
        return scaled_upper_triang_masked_softmax_cuda.backward(output_grads, softmax_results, scale_t[0]), None


class ScaledMaskedSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inputs, mask, scale):
        import scaled_masked_softmax_cuda

        scale_t = torch.tensor([scale])
        softmax_results = scaled_masked_softmax_cuda.forward(inputs, mask, scale_t[0])
        ctx.save_for_backward(softmax_results, scale_t)
        return softmax_results

    @staticmethod
    def backward(ctx, output_grads):
        import scaled_masked_softmax_cuda

        softmax_results, scale_t = ctx.saved_tensors
        return scaled_masked_softmax_cuda.backward(output_grads, softmax_results, scale_t[0]), None, None


def _torch_path(scores, mask, scale):
    return torch.softmax((scores * scale).masked_fill(mask, -10000.0), -1)


def test_megatron_fused_softmaxes_match_its_torch_path(shim):
    torch.manual_seed(0)
    scores = torch.randn(2, 2, 8, 8, dtype=torch.float64)
    causal = torch.ones(8, 8, dtype=torch.bool).triu(1).expand(1, 1, 8, 8)
    padding = torch.rand(2, 1, 8, 8) < 0.3
    grad = torch.randn_like(scores)
    for run, mask in (
        (lambda x: ScaledUpperTriangMaskedSoftmax.apply(x.view(-1, 8, 8), 0.5).view(2, 2, 8, 8), causal),
        (lambda x: ScaledMaskedSoftmax.apply(x, padding, 0.5), padding),
    ):
        x, x_ref = scores.clone().requires_grad_(), scores.clone().requires_grad_()
        out, expected = run(x), _torch_path(x_ref, mask, 0.5)
        assert torch.allclose(out, expected, atol=1e-6)
        out.backward(grad.clone())  # Apex's backward writes into the gradient it is given
        expected.backward(grad)
        assert torch.allclose(x.grad, x_ref.grad, atol=1e-6)
    import scaled_masked_softmax_cuda

    x = scores.clone().requires_grad_()
    ScaledMaskedSoftmax.apply(x, padding, 0.5).sum().backward()  # an expanded gradient is copied, not written
    assert torch.isfinite(x.grad).all()
    assert [scaled_masked_softmax_cuda.get_batch_per_block(128, k, 8, 16) for k in (16, 128, 2048)] == [16, 8, 4]


def test_half_scores_a_fully_masked_row_and_a_wrong_rank(shim):
    scaled_masked_softmax_cuda = importlib.import_module("scaled_masked_softmax_cuda")
    scaled_softmax_cuda = importlib.import_module("scaled_softmax_cuda")
    scores = torch.randn(1, 1, 4, 8, dtype=torch.half)
    mask = torch.zeros(1, 1, 4, 8, dtype=torch.bool)
    mask[..., 1, :] = True
    out = scaled_masked_softmax_cuda.forward(scores, mask, 1.0)
    assert out.dtype == torch.half and torch.all(out[..., 1, :] == 0)
    assert torch.allclose(out[..., 0, :].float().sum(), torch.tensor(1.0), atol=1e-3)
    assert torch.allclose(
        scaled_softmax_cuda.forward(scores, 2.0).float(), torch.softmax(scores.float() * 2, -1), atol=1e-3
    )
    with pytest.raises(ValueError, match=r"scaled_softmax_cuda.forward: expected a 4-D tensor, got shape \[4, 8\]"):
        scaled_softmax_cuda.forward(scores[0, 0], 1.0)


def test_hostile_arguments_are_refused_by_name_where_apex_refused_or_read_garbage(shim):
    masked = importlib.import_module("scaled_masked_softmax_cuda")
    causal = importlib.import_module("scaled_upper_triang_masked_softmax_cuda")
    scaled = importlib.import_module("scaled_softmax_cuda")
    scores = torch.randn(2, 2, 4, 8, dtype=torch.half)
    mask = torch.zeros(2, 1, 4, 8, dtype=torch.bool)
    cases = [
        (lambda: scaled.forward(torch.ones(2, 2, 4, 8, dtype=torch.long), 1.0), r"inputs must be a floating-point"),
        (lambda: masked.forward(scores, torch.full((2, 1, 4, 8), 0.5), 1.0), r"mask must be bool or uint8.*float32"),
        (lambda: masked.forward(scores, mask.transpose(2, 3), 1.0), r"mask shape \[2, 1, 8, 4\] does not broadcast"),
        (lambda: masked.forward(scores, mask[0], 1.0), r"expected a 4-D mask, got shape \[1, 4, 8\]"),
        (lambda: causal.forward(scores[0], 1.0), r"needs square \[attn_batches, sq, sq\] scores, got \[2, 4, 8\]"),
        (lambda: causal.backward(scores[0], scores[0], 1.0), r"needs square .* gradients, got \[2, 4, 8\]"),
        (lambda: scaled.backward(scores, scores[:1], 1.0), r"\[2, 2, 4, 8\] and softmax_results \[1, 2, 4, 8\]"),
        (lambda: scaled.backward(scores.long(), scores, 1.0), r"output_grads must be a floating-point"),
        (lambda: scaled.forward(scores, torch.tensor([1.0, 2.0])), r"scale must be a number or a one-element"),
    ]
    for call, message in cases:
        with pytest.raises((TypeError, ValueError), match=message):
            call()
    uint8_mask = mask.to(torch.uint8)  # Megatron's older masks; a [1, 1, sq, sk] mask serves every batch
    uint8_mask[..., 3:] = 1
    out = masked.forward(scores, uint8_mask[:1], 1.0)
    assert torch.all(out[..., 3:] == 0) and torch.allclose(out.float().sum(-1), torch.ones(2, 2, 4), atol=1e-3)


def test_a_scale_apexs_binding_refused_or_sparse_scores_are_named(shim):
    """pybind11 refused a string or None for Apex's ``float scale``: ``float()`` here read ``"0.125"`` as a number and
    named no argument for None; sparse scores failed in the dispatcher, naming a SparseCPU backend."""
    scaled = importlib.import_module("scaled_softmax_cuda")
    masked = importlib.import_module("scaled_masked_softmax_cuda")
    scores = torch.randn(2, 2, 4, 8, dtype=torch.half)
    for scale in ("0.125", None):
        with pytest.raises(TypeError, match=r"^scaled_softmax_cuda.forward: scale must be a number, as Apex's"):
            scaled.forward(scores, scale)
        with pytest.raises(TypeError, match=r"^scaled_masked_softmax_cuda.backward: scale must be a number"):
            masked.backward(scores, scores, scale)
    with pytest.raises(TypeError, match=r"inputs is a torch.sparse_coo tensor; pass a dense one"):
        scaled.forward(scores.float().to_sparse(), 1.0)
    scaled.forward(scores, True)  # a bool is the number 1.0 to pybind11, as to Apex


def test_only_a_mask_value_of_1_masks_as_in_apexs_kernel(shim):
    masked = importlib.import_module("scaled_masked_softmax_cuda")
    scores = torch.zeros(1, 1, 2, 4)
    mask = torch.tensor([[0, 1, 255, 2], [1, 1, 0, 0]], dtype=torch.uint8).view(1, 1, 2, 4)  # Apex tested == 1
    out = masked.forward(scores, mask, 1.0)
    assert torch.allclose(out[0, 0], torch.tensor([[1 / 3, 0.0, 1 / 3, 1 / 3], [0.0, 0.0, 0.5, 0.5]]))
