"""The Trainer's total gradient norm (clipping and logging read it) is torch's, bit for bit."""

from __future__ import annotations

import pytest
import torch

from ampkit.trainer.trainer import total_norm

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _random_list(g: torch.Generator) -> list[torch.Tensor]:
    tensors = []
    for i in range(int(torch.randint(1, 10, (1,), generator=g))):
        dtype = DTYPES[int(torch.randint(0, len(DTYPES), (1,), generator=g))]
        rows = int(torch.randint(0, 40, (1,), generator=g))  # 0 rows: an empty tensor
        t = (torch.randn(rows, 7, generator=g, dtype=torch.float64) * 100).to(dtype)
        tensors.append(t.t() if i % 2 else t)  # every other one non-contiguous
    return tensors


@pytest.mark.parametrize("seed", range(5))
def test_total_norm_equals_get_total_norm_bit_for_bit(seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(40):
        tensors = _random_list(g)
        ours, theirs = total_norm(tensors), torch.nn.utils.get_total_norm(tensors, foreach=True)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        assert torch.equal(ours, theirs), (ours, theirs)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_total_norm_of_a_non_finite_gradient_is_non_finite_as_torch_says(bad):
    tensors = [torch.ones(3), torch.tensor([1.0, bad]), torch.ones(2, dtype=torch.float16)]
    ours, theirs = total_norm(tensors), torch.nn.utils.get_total_norm(tensors, foreach=True)
    assert not ours.isfinite() and ours.isnan() == theirs.isnan()


def test_a_half_precision_list_overflows_as_it_does_in_torch():
    tensors = [torch.full((4,), 60000.0, dtype=torch.float16)] * 2  # each norm 120000 > fp16 max
    assert torch.equal(total_norm(tensors), torch.nn.utils.get_total_norm(tensors, foreach=True))


def test_a_sparse_gradient_counts_through_its_summed_values():
    """An ``Embedding(sparse=True)`` gradient, uncoalesced (row 1 twice): its norm is the dense gradient's. No torch
    norm kernel takes sparse tensors, so this raised NotImplementedError in the Trainer's grad norm."""
    sparse = torch.sparse_coo_tensor(
        [[1, 3, 1]], torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), (5, 2), check_invariants=True
    )
    dense = torch.ones(3)
    assert torch.equal(total_norm([sparse, dense]), total_norm([sparse.to_dense(), dense]))
