"""Apex's ``apex.fused_dense`` under the shim, as real programs use it: atorch's ``AmpFusedDense`` (a FusedDense
subclass loading an nn.Linear's state and calling ``FusedDenseFunc``/``DenseNoBiasFunc`` on 2-D rows) and its
linear-GELU-linear swap (``FusedDenseGeluDenseFunc`` on a ``[batch, seq, hidden]`` input viewed as rows).
Outputs and gradients are checked in float64 against nn.Linear and GELU's tanh approximation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ampkit.compat import install_apex_shim, uninstall_apex_shim


@pytest.fixture
def shim():
    install_apex_shim()
    yield
    uninstall_apex_shim()


def _grads(output, tensors, upstream):
    return torch.autograd.grad(output, tensors, upstream)


@pytest.mark.parametrize("bias", [True, False])
def test_atorch_amp_fused_dense_matches_the_linear_it_replaces(shim, bias):
    from apex.fused_dense.fused_dense import DenseNoBiasFunc, FusedDense, FusedDenseFunc

    class AmpFusedDense(FusedDense):  # atorch: 2-D rows through Apex's Functions
        def forward(self, input):
            *other_dims, h = input.size()
            rows = input.reshape(-1, h)
            if self.bias is not None:
                out = FusedDenseFunc.apply(rows, self.weight, self.bias)
            else:
                out = DenseNoBiasFunc.apply(rows, self.weight)
            return out.reshape(*other_dims, self.out_features)

    torch.manual_seed(0)
    linear = torch.nn.Linear(6, 4, bias=bias).double()
    dense = AmpFusedDense(6, 4, bias=bias).double()
    dense.load_state_dict(linear.state_dict())  # Apex's parameter names and shapes are nn.Linear's
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 3, 4, dtype=torch.float64)
    out, expected = dense(x), linear(x)
    torch.testing.assert_close(out, expected, rtol=1e-14, atol=1e-14)
    got = _grads(out, [x, *dense.parameters()], upstream)
    want = _grads(expected, [x, *linear.parameters()], upstream)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-13, atol=1e-13)


def test_linear_gelu_linear_swap_matches_tanh_gelu_between_two_linears(shim):
    from apex.fused_dense import FusedDenseGeluDense, FusedDenseGeluDenseFunc

    torch.manual_seed(0)
    block = FusedDenseGeluDense(5, 16, 3).double()
    x = torch.randn(2, 4, 5, dtype=torch.float64, requires_grad=True) * 3
    batch, seq_length, hidden_size = x.size()  # atorch's _fused_dense_gelu_dense
    out = FusedDenseGeluDenseFunc.apply(
        x.view(batch * seq_length, hidden_size), block.weight1, block.bias1, block.weight2, block.bias2
    ).view(batch, seq_length, -1)
    params = [block.weight1, block.bias1, block.weight2, block.bias2]
    expected = F.linear(F.gelu(F.linear(x, *params[:2]), approximate="tanh"), *params[2:])
    torch.testing.assert_close(out, expected, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(block(x), expected, rtol=1e-14, atol=1e-14)  # the module on 3-D input
    upstream = torch.randn_like(expected)
    got, want = _grads(out, [x, *params], upstream), _grads(expected, [x, *params], upstream)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_under_autocast_the_arguments_take_its_dtype(shim):
    from apex.fused_dense import FusedDense

    torch.manual_seed(0)
    dense = FusedDense(8, 4)
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = dense(x)
    assert out.dtype == torch.bfloat16
    expected = F.linear(x.bfloat16(), dense.weight.bfloat16(), dense.bias.bfloat16())
    assert torch.equal(out, expected)


def test_parameters_start_as_linear_ones_and_bad_shapes_are_named(shim):
    from apex.fused_dense import FusedDense, FusedDenseGeluDense

    torch.manual_seed(0)
    dense = FusedDense(8, 4)
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 4)
    assert torch.equal(dense.weight, linear.weight) and torch.equal(dense.bias, linear.bias)
    wrong_width = r"weight must be \[out, 5\] to take the input's last dimension \(\[3, 5\]\), got \[4, 8\]"
    with pytest.raises(ValueError, match=wrong_width):
        dense(torch.randn(3, 5))
    with pytest.raises(ValueError, match=r"bias=True only, as in Apex, got bias=False"):
        FusedDenseGeluDense(4, 8, 2, bias=False)


@pytest.mark.parametrize("name", ["FusedDenseFunc", "DenseNoBiasFunc", "FusedDenseGeluDenseFunc"])
def test_function_applied_under_autocast_computes_in_its_inputs_dtype(name):
    """Apex's kernels computed in their inputs' dtype whatever autocast was on (only the wrappers cast first): the
    Function applied directly under autocast gives float32 and its float32 gradients, not a dtype error in backward."""
    from ampkit.compat import fused_dense

    torch.manual_seed(0)
    args = [torch.randn(3, 8), torch.randn(6, 8), torch.randn(6), torch.randn(2, 6), torch.randn(2)]
    args = [a.requires_grad_() for a in args[: {"FusedDenseFunc": 3, "DenseNoBiasFunc": 2}.get(name, 5)]]
    function = getattr(fused_dense, name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = function.apply(*args)
    grads = torch.autograd.grad(out.square().sum(), args)
    want_out = function.apply(*args)
    want = torch.autograd.grad(want_out.square().sum(), args)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want_out)
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w)
