"""Device values read on the host in one transfer (:mod:`ampkit.ops.host_values`): exact values, numbers and None kept
as they are, a tensor's value typed as its ``item()``. The one-sync count on a GPU is pinned in test_nccl_devices.py
(a pretend GPU) and below on a real one."""

from __future__ import annotations

import math

import pytest
import torch

from ampkit.ops.host_values import host_numbers, host_vectors

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_host_numbers_reads_exact_values_and_keeps_none():
    grad_scale = torch.tensor([2.0**-20 * 3], dtype=torch.float32)
    found_inf = torch.zeros(1)
    assert host_numbers([found_inf, grad_scale]) == [0.0, float(grad_scale)]
    assert host_numbers([None, grad_scale]) == [None, float(grad_scale)]
    assert host_numbers([torch.tensor(float("nan")), None])[0] != 0  # nan counts as found (a truthy skip)
    assert host_numbers([None, None]) == [None, None] and host_numbers([]) == []


def test_host_numbers_keep_numbers_as_they_are_and_type_tensors_as_item_does():
    """A step count stays an int (formatted, or used as an index), a flag a bool; a float tensor is a float."""
    values = [3, 0.5, True, torch.ones(1, dtype=torch.int32), torch.tensor(7), torch.tensor(True), torch.zeros(())]
    read = host_numbers(values)
    assert read == [3, 0.5, True, 1, 7, True, 0.0]
    assert [type(v) for v in read] == [int, float, bool, int, int, bool, float]


def test_host_numbers_of_many_cpu_scalars_match_one_by_one():
    """Many zero-dim CPU values are read through one stack: the same values as reading each, None kept in place,
    mixed dtypes and shapes read one by one."""
    values = [torch.randn(()) for _ in range(7)] + [torch.tensor(float("inf")), torch.tensor(float("nan"))]
    read = host_numbers([values[0], None, *values[1:]])
    expected = [float(v) for v in values]
    assert read[1] is None and read[0] == expected[0] and read[2:-1] == expected[1:-1] and math.isnan(read[-1])
    mixed = [torch.tensor(2.5, dtype=torch.bfloat16), torch.tensor(3), torch.ones(1), torch.zeros(())]
    assert host_numbers(mixed) == [2.5, 3, 1.0, 0.0]
    counts = [torch.tensor(i) for i in range(5)]  # stacked: still ints
    assert [type(v) for v in host_numbers(counts)] == [int] * 5


def test_host_vectors_are_flat_float64_cpu_tensors_of_every_size():
    int_counts = torch.tensor([[1, 2], [3, 16777217]], dtype=torch.int32)
    read = host_vectors([0.25, torch.tensor(2.0, dtype=torch.float16), int_counts, torch.zeros(0)])
    assert all(t.dtype == torch.float64 and t.dim() == 1 and t.is_cpu for t in read)
    assert [t.tolist() for t in read] == [[0.25], [2.0], [1.0, 2.0, 3.0, 16777217.0], []]


@needs_cuda
def test_cuda_host_numbers_mixes_devices_and_dtypes_in_one_sync():
    values = [torch.tensor(3.0, device="cuda"), torch.ones(1, dtype=torch.int32, device="cuda"), torch.tensor(0.5)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with pytest.warns(UserWarning, match="synchroniz") as caught:
            read = host_numbers([None, *values])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert read == [None, 3.0, 1, 0.5] and type(read[2]) is int
    assert sum("synchroniz" in str(w.message) for w in caught) == 1
