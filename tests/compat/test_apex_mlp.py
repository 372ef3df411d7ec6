"""``apex.mlp`` under the shim, as NVIDIA's DLRM (DeepLearningExamples) uses it: ``import apex.mlp`` at the top of
``dlrm/nn/mlps.py`` (so the whole program needs it to import, even on the CPU where it then picks its torch MLP),
an ``AmpMlp(apex.mlp.MLP)`` whose own autograd Function calls ``apex.mlp.MlpFunction.forward``/``.backward``
with its own ``ctx``, and checkpoints moving weights between that and a ``Linear``/``ReLU`` stack. Checked
against the same stack of torch layers in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ampkit.compat import install_apex_shim, uninstall_apex_shim


@pytest.fixture
def apex_mlp():
    install_apex_shim()
    import apex.mlp

    yield apex.mlp
    uninstall_apex_shim()


def _dlrm_amp_mlp(apex_mlp):
    """DLRM's ``AmpMlpFunction`` and ``AmpMlp``, written as in ``dlrm/nn/mlps.py``."""

    class AmpMlpFunction(torch.autograd.Function):
        @staticmethod
        def forward(*args, **kwargs):
            return apex_mlp.MlpFunction.forward(*args, **kwargs)

        @staticmethod
        def backward(*args, **kwargs):
            return apex_mlp.MlpFunction.backward(*args, **kwargs)

    class AmpMlp(apex_mlp.MLP):
        def forward(self, input):
            return AmpMlpFunction.apply(self.bias, self.activation, input, *self.weights, *self.biases)

    return AmpMlp


def _torch_stack(mlp, activation: type[nn.Module] | None) -> nn.Sequential:
    layers = []
    for i in range(mlp.num_layers):
        linear = nn.Linear(mlp.mlp_sizes[i], mlp.mlp_sizes[i + 1], bias=bool(mlp.bias), dtype=torch.float64)
        linear.weight.data.copy_(mlp.weights[i])
        if mlp.bias:
            linear.bias.data.copy_(mlp.biases[i])
        layers += [linear] + ([activation()] if activation else [])
    return nn.Sequential(*layers)


@pytest.mark.parametrize(
    ("activation", "module", "bias"),
    [("relu", nn.ReLU, True), ("sigmoid", nn.Sigmoid, True), ("none", None, False)],
)
def test_dlrm_amp_mlp_matches_the_torch_layers_forward_and_backward(apex_mlp, activation, module, bias):
    torch.manual_seed(0)
    mlp = _dlrm_amp_mlp(apex_mlp)([6, 8, 5, 3], bias=bias, activation=activation).double()
    reference = _torch_stack(mlp, module)
    x = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, expected = mlp(x), reference(x_ref)
    assert torch.allclose(out, expected, atol=1e-12)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-12)
    linears = [m for m in reference if isinstance(m, nn.Linear)]
    assert all(torch.allclose(w.grad, m.weight.grad, atol=1e-12) for w, m in zip(mlp.weights, linears, strict=True))
    assert all(torch.allclose(b.grad, m.bias.grad, atol=1e-12) for b, m in zip(mlp.biases, linears, strict=False))
    assert len(mlp.biases) == (len(linears) if bias else 0)
    assert torch.allclose(apex_mlp.MLP.forward(mlp, x), out)  # Apex's own forward, through mlp_function


def test_apex_layout_checkpoints_and_errors(apex_mlp):
    mlp = apex_mlp.MLP([4, 3, 2])
    assert list(mlp.state_dict()) == ["weight_0", "bias_0", "weight_1", "bias_1"]
    assert mlp.weights[0] is mlp.weight_0 and mlp.biases[1] is mlp.bias_1
    copy = apex_mlp.MLP([4, 3, 2])
    copy.load_state_dict(mlp.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(copy.weights + copy.biases, mlp.weights + mlp.biases, strict=True))
    mlp.half()
    assert mlp.weights[0].dtype == torch.half  # the lists still hold the module's parameters
    from apex.mlp.mlp import MLP

    assert MLP is apex_mlp.MLP
    with pytest.raises(TypeError, match="activation 'gelu' is not one of 'none', 'relu', 'sigmoid'"):
        apex_mlp.MLP([4, 2], activation="gelu")
    with pytest.raises(TypeError, match=r"activation 'ggg.* \(10002 characters\) is not one of"):
        apex_mlp.MLP([4, 2], activation="g" * 10_000)
    with pytest.raises(ValueError, match=r"the input must be 2-D \(batch, features\), got shape \[2, 3, 4\]"):
        apex_mlp.MLP([4, 2])(torch.randn(2, 3, 4))


def test_sizes_that_do_not_chain_and_mixed_dtypes_are_named(apex_mlp):
    """Apex's kernel took the layer count from the argument count and one dtype; a miscount read garbage."""
    x, w0, w1, b0 = torch.randn(2, 4), torch.randn(5, 4), torch.randn(3, 5), torch.randn(5)
    cases = [
        (lambda: apex_mlp.MLP([4]), ValueError, r"mlp_sizes must be \[in, ..., out\], at least two positive ints"),
        (lambda: apex_mlp.MLP([4, 0, 3]), ValueError, r"got \[4, 0, 3\]"),
        (lambda: apex_mlp.MlpFunction.apply(0, 1, x, w0, b0), ValueError, r"weights\[1\] must be \[out, 5\]"),
        (lambda: apex_mlp.MlpFunction.apply(1, 1, x, w0, w1, b0), ValueError, r"2 tensor\(s\) per layer .* got 3"),
        (lambda: apex_mlp.MlpFunction.apply(1, 1, x, w0, torch.randn(4)), ValueError, r"biases\[0\] must be \[5\]"),
        (lambda: apex_mlp.MLP([4, 3])(x.half()), TypeError, r"weights\[0\] is torch.float32 but the input is"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    assert apex_mlp.MLP(np.array([4, 5, 3])).num_layers == 2  # sizes from a numpy array, as DLRM's configs give
