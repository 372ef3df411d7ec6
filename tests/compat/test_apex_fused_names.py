"""Apex's fused optimizer and norm names resolve to ampkit's ops (needs the ops branches merged)."""

import pytest
import torch

import ampkit.compat.normalization as normalization
import ampkit.compat.optimizers as optimizers

OPTIMIZERS = list(optimizers.__all__)
NORMS = list(normalization.__all__)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_names_are_ampkits_fused_optimizers(name):
    import ampkit.ops.optimizers as ops

    cls = getattr(optimizers, name)
    assert cls is getattr(ops, name)
    assert issubclass(cls, torch.optim.Optimizer)


@pytest.mark.parametrize("name", NORMS)
def test_norm_names_are_ampkits_fused_norms(name):
    import ampkit.ops.norms as ops

    cls = getattr(normalization, name)
    assert cls is getattr(ops, name)
    norm = cls(8)
    out = norm(torch.randn(3, 8))
    assert out.shape == (3, 8) and torch.isfinite(out).all()


def test_fused_adam_steps_through_the_apex_shim():
    from ampkit.compat import install_apex_shim, uninstall_apex_shim

    install_apex_shim()
    try:
        from apex.normalization import FusedLayerNorm
        from apex.optimizers import FusedAdam

        model = torch.nn.Sequential(torch.nn.Linear(8, 8), FusedLayerNorm(8))
        optimizer = FusedAdam(model.parameters(), lr=1e-2)
        before = [p.detach().clone() for p in model.parameters()]
        model(torch.randn(4, 8)).pow(2).sum().backward()
        optimizer.step()
        assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    finally:
        uninstall_apex_shim()


def test_unknown_names_are_a_clear_error():
    with pytest.raises(AttributeError, match="FusedAdamW.*FusedAdam"):
        optimizers.FusedAdamW  # noqa: B018
