"""The CUDA multi-tensor launch table (common/chunk_plan.h), run on the CPU through ampkit_multi_tensor.chunk_plan:
the very code the CUDA launcher uses to pack tensors and chunks into launches and to choose vector loads."""

from __future__ import annotations

import random

import pytest
import torch

from ampkit.ops import multi_tensor as mt

CHUNK = 65536
MAX_BLOCKS = 320
MAX_TENSORS = {1: 90, 2: 64, 3: 48, 4: 36, 5: 32, 6: 28}
VECTOR = 4  # elements per vector load


@pytest.fixture(autouse=True)
def built(monkeypatch):
    """The plan is compiled code: a failed build is an error, never a silent skip."""
    monkeypatch.setenv("AMPKIT_OPS", "kernel")
    assert mt.kernel_available(torch.device("cpu"))


def plan(numels, addresses=None, element_bytes=(4,)):
    """Launches as lists: [(tensors [(source, vectorized)], blocks [(tensor in launch, chunk)])]."""
    depth = len(element_bytes)
    if addresses is None:
        addresses = [0] * (len(numels) * depth)
    tensors, blocks = torch.ops.ampkit_multi_tensor.chunk_plan(list(numels), list(addresses), list(element_bytes))
    count = int(max(tensors[:, 0].max(), blocks[:, 0].max())) + 1 if len(blocks) else 0
    launches = [([], []) for _ in range(count)]
    for launch, source, vectorized in tensors.tolist():
        launches[launch][0].append((source, bool(vectorized)))
    for launch, tensor, chunk in blocks.tolist():
        launches[launch][1].append((tensor, chunk))
    return launches


def model(numels, depth):
    """The packing rules stated independently: a launch takes tensors in order until it holds the depth's maximum
    of tensors or 320 chunks; a tensor whose chunks do not fit goes on in the next launch (as its first tensor)."""
    launches, tensors, blocks = [], [], []
    for source, n in enumerate(numels):
        if n == 0:
            continue
        if len(tensors) == MAX_TENSORS[depth] or len(blocks) == MAX_BLOCKS:
            launches.append((tensors, blocks))
            tensors, blocks = [], []
        tensors.append(source)
        for chunk in range(-(-n // CHUNK)):
            if len(blocks) == MAX_BLOCKS:
                launches.append((tensors, blocks))
                tensors, blocks = [source], []
            blocks.append((len(tensors) - 1, chunk))
    if blocks:
        launches.append((tensors, blocks))
    return launches


def sources(launches):
    return [([s for s, _ in tensors], blocks) for tensors, blocks in launches]


def test_empty_list_and_empty_tensors_launch_nothing():
    assert plan([]) == []
    assert plan([0, 0, 0]) == []


def test_empty_tensors_are_left_out_and_the_rest_keep_their_list_index():
    launches = plan([0, 5, 0, CHUNK + 1, 0])
    assert sources(launches) == [([1, 3], [(0, 0), (1, 0), (1, 1)])]


def test_a_tensor_longer_than_one_launch_goes_on_as_the_next_launchs_first_tensor():
    numel = 330 * CHUNK + 5  # 331 chunks
    launches = sources(plan([7, numel, 3]))
    assert launches[0] == ([0, 1], [(0, 0)] + [(1, c) for c in range(319)])
    assert launches[1] == ([1, 2], [(0, c) for c in range(319, 331)] + [(1, 0)])
    assert len(launches) == 2


@pytest.mark.parametrize("depth", sorted(MAX_TENSORS))
def test_exactly_full_tensor_slots_make_one_launch_and_one_more_tensor_a_second(depth):
    most = MAX_TENSORS[depth]
    exact = plan([1] * most, element_bytes=(4,) * depth)
    assert len(exact) == 1 and len(exact[0][0]) == most
    over = sources(plan([1] * (most + 1), element_bytes=(4,) * depth))
    assert [t for t, _ in over] == [list(range(most)), [most]]


def test_exactly_full_blocks_start_the_next_tensor_in_a_fresh_launch():
    launches = sources(plan([160 * CHUNK, 160 * CHUNK, 1]))
    assert [t for t, _ in launches] == [[0, 1], [2]]  # no slot spent on a tensor without a block
    assert len(launches[0][1]) == MAX_BLOCKS and launches[1][1] == [(0, 0)]


def test_thousands_of_tiny_tensors_share_launches():
    launches = sources(plan([3] * 5000, element_bytes=(2, 4, 4, 4)))
    assert len(launches) == -(-5000 // MAX_TENSORS[4])
    assert [s for tensors, _ in launches for s in tensors] == list(range(5000))
    assert all(blocks == [(i, 0) for i in range(len(tensors))] for tensors, blocks in launches)


def test_a_huge_tensor_takes_every_chunk_once_in_order():
    numel = 2**33 + 3  # 131073 chunks: past int32 element offsets
    launches = sources(plan([numel]))
    chunks = [c for _, blocks in launches for _, c in blocks]
    assert chunks == list(range(numel // CHUNK + 1))
    assert all(tensors == [0] for tensors, _ in launches)
    assert len(launches) == -(-len(chunks) // MAX_BLOCKS)


def test_random_lists_follow_the_packing_rules():
    rng = random.Random(0)
    for _ in range(40):
        depth = rng.randint(1, 6)
        numels = [rng.choice([0, 1, rng.randint(2, 5000), rng.randint(CHUNK - 2, 3 * CHUNK), 400 * CHUNK + 1])
                  for _ in range(rng.randint(0, 200))]  # fmt: skip
        assert sources(plan(numels, element_bytes=(4,) * depth)) == model(numels, depth)


def addresses_of(*slots):
    return [t.data_ptr() for t in slots]


def test_vector_loads_need_every_slot_aligned_to_four_of_its_elements():
    base = torch.empty(64)  # torch's CPU allocations are 64-byte aligned
    half = torch.empty(64, dtype=torch.float16)
    assert base.data_ptr() % 64 == 0 and half.data_ptr() % 64 == 0
    cases = [
        ((base[4:],), (4,), True),  # offset 16 bytes
        ((base[1:],), (4,), False),  # storage_offset 1: 4 bytes
        ((base[2:],), (4,), False),  # 8 bytes: not 16
        ((half[4:],), (2,), True),  # four halves: 8 bytes
        ((half[2:],), (2,), False),
        ((half[4:], base[8:]), (2, 4), True),  # fp16 params with fp32 state
        ((half[4:], base[9:]), (2, 4), False),  # one slot off is enough to fall back
    ]
    for tensors, element_bytes, expected in cases:
        launches = plan([7], addresses_of(*tensors), element_bytes)  # odd size: the kernel's scalar tail
        assert launches[0][0] == [(0, expected)], (tensors, element_bytes)


def test_absent_slots_do_not_block_vector_loads_and_each_tensor_decides_alone():
    state = torch.empty(64)
    launches = plan([9, 9], [state.data_ptr(), 0, state.data_ptr() + 4, 0], (4, 4))
    assert launches[0][0] == [(0, True), (1, False)]


def test_double_needs_32_byte_alignment():
    doubles = torch.empty(16, dtype=torch.float64)
    assert plan([3], addresses_of(doubles[4:]), (8,))[0][0] == [(0, True)]
    assert plan([3], addresses_of(doubles[2:]), (8,))[0][0] == [(0, False)]


def test_bad_arguments_name_themselves():
    with pytest.raises(RuntimeError, match=r"element_bytes has 7 entries; expected 1 to 6"):
        plan([1], [0] * 7, (4,) * 7)
    with pytest.raises(
        RuntimeError, match=r"addresses has 1 entries; expected len\(numels\) \* len\(element_bytes\) = 4"
    ):
        torch.ops.ampkit_multi_tensor.chunk_plan([1, 2], [0], [4, 4])
    with pytest.raises(RuntimeError, match=r"numels\[1\] is -2; expected >= 0"):
        plan([1, -2])


def test_cuda_kernel_choice_is_read_at_every_call(monkeypatch):
    choice = torch.ops.ampkit_multi_tensor.cuda_kernels
    monkeypatch.delenv("AMPKIT_CUDA_KERNELS", raising=False)
    assert choice() == "per_tensor"
    monkeypatch.setenv("AMPKIT_CUDA_KERNELS", "multi_tensor")
    assert choice() == "multi_tensor"
    monkeypatch.setenv("AMPKIT_CUDA_KERNELS", "per_tensor")
    assert choice() == "per_tensor"
    monkeypatch.setenv("AMPKIT_CUDA_KERNELS", "fast")
    with pytest.raises(
        RuntimeError, match=r"AMPKIT_CUDA_KERNELS='fast' is not valid; use per_tensor \(the default\) or multi_tensor"
    ):
        choice()
