"""RNG states saved on one machine restore on another: what fits is restored, the rest said once, nothing crashes."""

from __future__ import annotations

import warnings

import pytest
import torch
from toy_trainers import ToyTrainer, toy_cfg

from ampkit.trainer.checkpoint_io import load_checkpoint, save_atomic
from ampkit.trainer.rng import capture_rng, restore_rng, rng_not_restored


@pytest.fixture
def cuda_devices(monkeypatch):
    """A fake CUDA machine with ``count(n)`` devices; ``restored`` lists (device, state) as torch's setter got them.
    The setter fails past the last device, as torch's does (an index into its per-device generators)."""
    restored = []

    def set_rng_state(state, device="cuda"):
        if device == "cuda":  # the current device
            device = torch.cuda.current_device()
        if not 0 <= device < torch.cuda.device_count():
            raise IndexError("tuple index out of range")
        restored.append((device, state))

    def count(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda.random, "device_count", lambda: n)

    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    monkeypatch.setattr(torch.cuda.random, "set_rng_state", set_rng_state)
    return count, restored


def _with_cuda_states(devices: int) -> dict:
    state = capture_rng()
    state["cuda"] = [torch.full((16,), device, dtype=torch.uint8) for device in range(devices)]
    return state


def test_states_of_more_devices_than_here_restore_those_that_fit(cuda_devices):
    """A run saved on 8 GPUs and resumed on 1 failed in set_rng_state_all at the second device's state."""
    count, restored = cuda_devices
    count(1)
    state = _with_cuda_states(8)
    restore_rng(state)
    assert [(device, int(s[0])) for device, s in restored] == [(0, 0)]
    assert "8 devices and this machine has 1 CUDA device: those of devices 1-7 are not restored" in rng_not_restored(
        state
    )


def test_each_rank_restores_the_saving_rank_s_own_gpu_state_into_its_own(cuda_devices, monkeypatch):
    """A checkpoint is rank zero's: its state of GPU 3 is untouched since seeding, while rank 3 drew on GPU 3 as rank
    zero did on GPU 0. Restored by index, rank 3's dropout after a resume started over from the seed."""
    count, restored = cuda_devices
    count(8)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_rng_state_all", lambda: [torch.full((16,), d, dtype=torch.uint8) for d in range(8)]
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    saved = capture_rng()  # by rank zero
    assert saved["cuda_device"] == 0
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # rank 3 resumes
    restore_rng(saved)
    last_set = {device: int(state[0]) for device, state in restored}
    assert last_set[3] == 0 and last_set[5] == 5


def test_states_of_fewer_devices_than_here_restore_each_and_lose_nothing(cuda_devices):
    count, restored = cuda_devices
    count(4)
    state = _with_cuda_states(2)
    restore_rng(state)
    assert [device for device, _ in restored] == [0, 1]
    assert rng_not_restored(state) is None


def test_a_cpu_only_machine_restores_the_rest_and_names_the_cuda_states_it_cannot():
    torch.manual_seed(0)
    state = _with_cuda_states(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    restore_rng(state)
    assert torch.equal(torch.rand(3), expected)
    if not torch.cuda.is_available():
        assert "1 device and this machine has no CUDA device: device 0's is not restored" in rng_not_restored(state)


def test_a_resume_with_cuda_states_this_machine_lacks_says_so_once(tmp_path, cuda_devices):
    """A resume restores its RNGs at several points (the epoch's start, the batch it stopped at): one warning."""
    count, _ = cuda_devices
    quiet = {"logging.tensorboard": False, "trainer.progress_bar": False, "trainer.max_steps": 6}
    ToyTrainer(toy_cfg(tmp_path, **{**quiet, "trainer.max_steps": 3})).fit()
    last = tmp_path / "run" / "version_0" / "checkpoints" / "last.pt"
    checkpoint = load_checkpoint(last)
    for key in ("rng", "epoch_rng"):
        checkpoint[key]["cuda"] = [torch.zeros(16, dtype=torch.uint8)] * 2
    save_atomic(checkpoint, last)
    count(1)
    resumed = ToyTrainer(toy_cfg(tmp_path, **quiet))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.fit(resume="last")
    said = [str(w.message) for w in caught if "CUDA RNG states" in str(w.message)]
    assert len(said) == 1 and "device 1's is not restored" in said[0], said
    assert resumed.state.global_step == 6
