"""What ampkit's collectives would hand NCCL, checked on a CPU machine: ``torch.distributed`` replaced by a pretend
two-rank world whose default group is NCCL (every tensor must be on this rank's GPU) beside any gloo group the code
makes, and a pretend GPU: a CPU tensor that says it lives on ``cuda:0`` (``OnGpu``), so values still come back.
Every tensor collective is recorded with the backend its group has; one on the wrong device fails the test there.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from toy_trainers import ToyTrainer, toy_cfg

from ampkit.callbacks.distributed import DistributedSync
from ampkit.trainer import distributed, model_setup
from ampkit.trainer import trainer as trainer_module
from ampkit.trainer.distributed import DistributedEnv

NCCL_ALONE = ("nccl", "cuda:nccl")  # groups that take no CPU tensor ("cpu:gloo,cuda:nccl" gives the CPU's to gloo)
GPU = torch.device("cuda", 0)  # this rank's GPU: what torch.cuda.current_device() says after set_device(0)


class OnGpu(torch.Tensor):
    """A CPU tensor that reports ``cuda:0`` as its device; what torch computes from it is one too, until ``.cpu()``."""

    @property
    def device(self) -> torch.device:
        return GPU

    @property
    def is_cuda(self) -> bool:
        return True

    @property
    def is_cpu(self) -> bool:
        return False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cpu:
            return args[0].as_subclass(torch.Tensor).clone()
        if func is torch.Tensor.to and _names_cpu(args[1:], kwargs):  # a dtype named beside the device too
            return args[0].as_subclass(torch.Tensor).to(*args[1:], **{**kwargs, "copy": True})
        return super().__torch_function__(func, types, args, kwargs)


def _names_cpu(args: tuple, kwargs: dict) -> bool:
    return any(_device_of(a) == "cpu" for a in (*args, kwargs.get("device")))


def _device_of(value: Any) -> str | None:
    if isinstance(value, str | torch.device):
        return torch.device(value).type
    return None


class PretendGpu(TorchFunctionMode):
    """Tensors made on, or moved to, ``cuda`` are made on the CPU and marked :class:`OnGpu`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        to_gpu = _device_of(kwargs.get("device")) == "cuda"
        if to_gpu:
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0].clone().as_subclass(OnGpu)
        if func is torch.Tensor.to and any(_device_of(a) == "cuda" for a in args[1:]):
            args, to_gpu = tuple("cpu" if _device_of(a) == "cuda" else a for a in args), True
        result = func(*args, **kwargs)
        return result.as_subclass(OnGpu) if to_gpu and isinstance(result, torch.Tensor) else result


@dataclass(frozen=True)
class Group:
    """A group the code made with ``dist.new_group``."""

    backend: str


@dataclass
class PretendNccl:
    """Two ranks whose rank 1 contributes what rank 0 does; ``calls``: (collective, backend, devices) of each."""

    default_backend: str = "nccl"  # how init_process_group named it: "nccl", "cuda:nccl", "cpu:gloo,cuda:nccl"
    calls: list[tuple[str, str, tuple[str, ...]]] = field(default_factory=list)
    device_set: int | None = None  # torch.cuda.set_device's last index

    def backend(self, group: Any = None) -> str:
        return self.default_backend if group is None else group.backend

    model_device: torch.device | None = None  # set while a collective of the model's own tensors runs

    def record(self, name: str, tensors: list[torch.Tensor], group: Any = None) -> None:
        backend = self.backend(group)
        devices = tuple(str(t.device) for t in tensors)
        self.calls.append((name, backend, devices))
        if (
            backend in NCCL_ALONE
        ):  # the model's tensors are where it is: under NCCL, on this rank's GPU (trainer.device)
            expected = str(self.model_device or GPU)
            wrong = [d for d in devices if d != expected]
            assert not wrong, f"{name} would hand NCCL a tensor on {wrong[0]}, not this rank's GPU {expected}"

    def of_the_model(self, run):
        """``run`` (a collective of the model's own parameters, buffers or gradients) with the model's device as
        the one NCCL takes: this rank's GPU in a real run, the CPU where the test's model is."""

        def wrapped(*args, **kwargs):
            self.model_device = torch.device("cpu")
            try:
                return run(*args, **kwargs)
            finally:
                self.model_device = None

        return wrapped

    def record_object(self, name: str, group: Any = None) -> None:
        """NCCL's object collectives stage through torch.cuda.current_device(): set_device must have chosen it."""
        self.calls.append((name, self.backend(group), ()))
        if self.backend(group) in NCCL_ALONE:
            assert self.device_set == GPU.index, f"{name} under NCCL before torch.cuda.set_device({GPU.index})"

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.record("all_reduce", [tensor], group)
        if op == dist.ReduceOp.SUM:
            tensor.mul_(2)

    def broadcast(self, tensor, src=0, group=None, async_op=False):
        self.record("broadcast", [tensor], group)

    def all_gather(self, out, tensor, group=None, async_op=False):
        self.record("all_gather", [*out, tensor], group)
        for each in out:
            each.copy_(tensor)

    def all_gather_object(self, out, value, group=None):
        self.record_object("all_gather_object", group)
        out[:] = [value] * len(out)

    def broadcast_object_list(self, values, src=0, group=None, device=None):
        self.record_object("broadcast_object_list", group)

    def barrier(self, group=None, async_op=False, device_ids=None):
        self.record_object("barrier", group)
        return Done()

    def set_device(self, index) -> None:
        self.device_set = torch.device(index).index if not isinstance(index, int) else index


class Done:
    """The work of a collective that has completed."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _references_only(monkeypatch):
    """The pure-PyTorch ops, whatever was built: a pretend-GPU tensor's storage is on the CPU, and on a machine with
    built CUDA kernels ampkit's dispatch (which goes by the device a tensor reports) would hand them CPU memory."""
    monkeypatch.setenv("AMPKIT_OPS", "reference")


@pytest.fixture
def nccl(monkeypatch):
    """The pretend NCCL world, this process its rank 0 with ``cuda:0`` its GPU, and the pretend GPU's tensors."""
    world = PretendNccl()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", world.set_device)
    for name in ("all_reduce", "broadcast", "all_gather", "all_gather_object", "broadcast_object_list", "barrier"):
        monkeypatch.setattr(dist, name, getattr(world, name))
    monkeypatch.setattr(dist, "get_backend", world.backend)
    monkeypatch.setattr(dist, "new_group", lambda ranks=None, backend=None, **kw: Group(backend or "nccl"))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    store = dist.HashStore()
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    with PretendGpu():
        yield world


def test_the_pretend_world_refuses_a_cpu_tensor_to_nccl_and_takes_one_to_gloo(nccl):
    """The check itself: a collective put on the CPU fails; the same on a gloo group beside NCCL is right."""
    with pytest.raises(AssertionError, match=r"all_reduce would hand NCCL a tensor on cpu, not this rank's GPU"):
        dist.all_reduce(torch.ones(1))
    dist.all_reduce(torch.ones(1), group=dist.new_group(backend="gloo"))
    flag = torch.ones(1, device="cuda")
    dist.all_reduce(flag)
    assert flag.device == GPU and flag.cpu().tolist() == [2.0]


@pytest.mark.parametrize("backend", ["nccl", "cuda:nccl"])
def test_the_loops_own_collectives_put_their_tensors_on_this_ranks_gpu(nccl, backend):
    """Also in a group a script made as ``init_process_group("cuda:nccl")``, which the backend's name "nccl" alone
    did not recognise: its flags went to NCCL on the CPU."""
    nccl.default_backend = backend
    env = DistributedEnv(rank=0, world_size=2)
    assert distributed.collective_device() == GPU
    assert distributed.all_reduce_sum([1.0, 2.5], env) == [2.0, 5.0]
    assert distributed.any_rank([torch.tensor(0.0), True, False], env) == [False, True, False]
    assert list(distributed.padded_to_the_longest_rank(["a", "b"], env, "val_dataloader()")) == [
        ("a", True),
        ("b", True),
    ]
    group = distributed.batch_agreement_group(env)
    assert group == Group("gloo")  # asking whether every rank has a batch never waits for the GPU
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the pretend rank 1 doubles the count: it "has more"
        list(distributed.while_every_rank_has_a_batch(iter("ab"), env, group, epoch=0))
    assert [backend for name, backend, _ in nccl.calls] == [backend] * 5 + ["gloo"] * 3
    assert all(devices == ("cpu",) * len(devices) for _, backend, devices in nccl.calls if backend == "gloo")


def test_a_group_with_a_cpu_backend_beside_nccl_keeps_the_loops_flags_on_the_cpu(nccl):
    """``cpu:gloo,cuda:nccl`` takes CPU tensors through gloo: no copy to the GPU, and no gloo group of its own for
    the batch agreement."""
    nccl.default_backend = "cpu:gloo,cuda:nccl"
    env = DistributedEnv(rank=0, world_size=2)
    assert distributed.collective_device() == torch.device("cpu")
    assert distributed.all_reduce_sum([1.0], env) == [2.0]
    assert distributed.batch_agreement_group(env) is None
    assert nccl.calls == [("all_reduce", "cpu:gloo,cuda:nccl", ("cpu",))]


def test_a_group_the_script_made_still_gets_this_ranks_gpu_set(nccl, monkeypatch):
    """A script that made its NCCL group itself before fit(): without set_device every rank's object collectives
    staged through cuda:0."""
    from omegaconf import OmegaConf

    from ampkit.config import Config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    cfg = OmegaConf.structured(Config)
    cfg.distributed.backend = "nccl"
    env = distributed.setup_distributed(cfg)
    assert (env.local_rank, env.owns_group, nccl.device_set) == (1, False, 1)


def test_nccl_with_a_cpu_device_is_refused_before_the_group_is_joined(nccl, monkeypatch):
    """Every collective of such a run (DDP's gradients, the loop's own) would hand NCCL a CPU tensor."""
    from omegaconf import OmegaConf

    from ampkit import ConfigError
    from ampkit.config import Config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "0")
    cfg = OmegaConf.structured(Config)
    # One rule for one process and for torchrun's: a single process (with a group for FSDP, or none) ran silently,
    # and its config then failed once launched on more.
    for world_size, strategy in [("2", "ddp"), ("1", "ddp"), ("1", "fsdp")]:
        monkeypatch.setenv("WORLD_SIZE", world_size)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        cfg.distributed.strategy, cfg.distributed.backend, cfg.trainer.device = strategy, "nccl", "cpu"
        with pytest.raises(ConfigError, match=r"'distributed.backend': nccl takes CUDA tensors only, but trainer.dev"):
            distributed.setup_distributed(cfg)
        # trainer.device=cuda where torch sees no GPU: said so, not that the device setting trains on the CPU
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        cfg.trainer.device = "cuda"
        with pytest.raises(ConfigError, match=r"nccl takes CUDA tensors only, but this machine has no usable CUDA GPU"):
            distributed.setup_distributed(cfg)
        cfg.trainer.device = "cpu"
        with pytest.raises(ConfigError, match=r"no usable CUDA GPU: use distributed.backend=gloo \(or auto\)"):
            distributed.setup_distributed(cfg)


@pytest.mark.parametrize(
    ("device", "strategy", "set_to"),
    [("cuda:1", "fsdp", [1]), ("cuda", "fsdp", []), ("cpu", "fsdp", []), ("cuda:1", "ddp", [])],
)
def test_a_single_process_fsdp_run_on_another_gpu_makes_it_the_current_device_before_its_group(
    monkeypatch, device, strategy, set_to
):
    """One process's FSDP group is NCCL's for CUDA tensors, which (with FSDP's own staging) works on the current
    device: on trainer.device=cuda:1 that was cuda:0, which no call set. What a CPU machine can show: the calls, in
    their order, with torch.cuda's answers pretended (``cuda`` alone is the current device already; no group, none)."""
    from omegaconf import OmegaConf

    from ampkit.config import Config

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("group", backend)))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = OmegaConf.structured(Config)
    cfg.trainer.device, cfg.distributed.strategy = device, strategy
    env = distributed.setup_distributed(cfg)
    group = [("group", "gloo" if device == "cpu" else "cpu:gloo,cuda:nccl")] if strategy == "fsdp" else []
    assert calls == [("set_device", index) for index in set_to] + group
    assert env.owns_group == (strategy == "fsdp")


class Predicts(ToyTrainer):
    predict_dataloader = ToyTrainer.val_dataloader


def test_a_fit_validate_and_predict_hand_nccl_only_tensors_on_this_ranks_gpu(nccl, tmp_path, monkeypatch):
    """A fit of two epochs with validation, sharded checkpoints' decisions, a stop agreed across ranks, then a
    validate and a predict: every collective of the loop's own (host verdicts, stop asks, evaluation sums and the
    first-batch digests, rank zero's decisions) on this rank's GPU or on a gloo group. The model's own collectives
    (its initial broadcast, step-time gradient averages) go where the model is: on the CPU in this test."""

    def torchrun_on_gpu_0(cfg):
        torch.cuda.set_device(0)  # what setup_distributed does for an NCCL rank
        return DistributedEnv(rank=0, world_size=2)

    monkeypatch.setattr(trainer_module, "setup_distributed", torchrun_on_gpu_0)
    monkeypatch.setattr(model_setup, "broadcast_module_", nccl.of_the_model(model_setup.broadcast_module_))
    monkeypatch.setattr(DistributedSync, "_average_over_ranks", nccl.of_the_model(DistributedSync._average_over_ranks))
    monkeypatch.setattr(DistributedSync, "_flat_collective", nccl.of_the_model(DistributedSync._flat_collective))
    overrides = {"trainer.max_epochs": 2, "distributed.grad_sync": "step", "logging.tensorboard": False,
                 "trainer.progress_bar": False, "logging.log_every_n_steps": 2}  # fmt: skip
    trainer = Predicts(toy_cfg(tmp_path, **overrides))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the pretend rank 1's batches are rank 0's: named as duplicated data
        trainer.fit()
        trainer.validate(ckpt="last")
        trainer.predict()
    names = {name for name, _, _ in nccl.calls}
    assert {"all_reduce", "all_gather_object", "broadcast_object_list"} <= names, names


@pytest.mark.parametrize(("device", "said"), [("cuda:1", True), ("cuda", False)])
def test_a_gpu_index_in_trainer_device_under_torchrun_is_named_once_as_each_rank_takes_its_local_rank(
    nccl, tmp_path, monkeypatch, device, said
):
    """trainer.device=cuda:1 under torchrun: each rank trains on cuda:LOCAL_RANK (rank zero here on cuda:0), so the
    index is not used; it was replaced without a word. ``cuda`` alone says nothing."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("WORLD_SIZE", "2")  # a group the script made: torchrun's rank 0 of 2 on this machine
    monkeypatch.setenv("LOCAL_RANK", "0")
    trainer = ToyTrainer(toy_cfg(tmp_path, **{"trainer.device": device}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer._start_distributed()
    assert trainer.device == GPU
    named = [str(w.message) for w in caught if "trainer.device=" in str(w.message)]
    expected = ["trainer.device=cuda:1 is not used: under torchrun each rank trains on cuda:LOCAL_RANK (cuda:0 on "
                "local rank 0, cuda:1 on local rank 1, ...); set trainer.device=cuda (or auto), and choose the GPUs "
                "with CUDA_VISIBLE_DEVICES"]  # fmt: skip
    assert named == (expected if said else [])


@pytest.mark.parametrize("route", ["unscale", "unscale_with_stashed", "post_backward_models_are_masters"])
def test_apex_loss_scalers_own_overflow_flag_follows_the_gradients_to_the_gpu(route):
    """A scaler's ``_overflow_buf`` was made on the CPU and moved only by amp's own unscale: a script unscaling by
    itself first (onnxruntime's replaced O2 post-backward, NVIDIA BERT's scaler.unscale) handed the kernels CUDA
    gradients beside a CPU flag. A buffer the script put there is its own and stays where it is."""
    from ampkit.compat.amp._process_optimizer import post_backward_models_are_masters
    from ampkit.compat.amp.scaler import LossScaler

    with PretendGpu():
        scaler = LossScaler("dynamic", init_scale=4.0)
        grads = [torch.tensor([8.0, float("inf")], device="cuda"), torch.full((3,), 4.0, device="cuda")]
        if route == "unscale":
            scaler.unscale(grads, grads, None)
        elif route == "unscale_with_stashed":
            stashed = [torch.ones_like(g) for g in grads]
            scaler.unscale_with_stashed(grads, stashed, grads)
        else:
            params = [torch.zeros(2, device="cuda"), torch.zeros(3, device="cuda")]
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad
            post_backward_models_are_masters(scaler, params, [None, torch.ones(3, device="cuda")])
        assert scaler._overflow_buf.device == GPU
        assert scaler.update_scale() and scaler.loss_scale() == 2.0  # the inf was flagged there, and read
        mine = scaler._overflow_buf = torch.zeros(1, dtype=torch.int32)  # a script's own, on the CPU
        scaler.clear_overflow_state()
        scaler.unscale([torch.ones(1)], [torch.ones(1)], None)
        assert scaler._overflow_buf is mine and mine.device.type == "cpu"


class MovedByModelCuda(torch.nn.Parameter):
    """A parameter whose data ``model.cuda()`` moved after an optimizer took it (the optimizer holds the same object):
    its device says so, its values stay on the CPU here."""

    moved_to: torch.device | None = None

    @property
    def device(self) -> torch.device:
        return self.moved_to or super().device


@pytest.mark.parametrize("name", ["FusedAdam", "FusedSGD", "FusedLAMB", "FusedNovoGrad", "FusedAdagrad"])
def test_apex_optimizers_skip_flag_follows_their_parameters_to_the_gpu(name):
    """Apex's ``_dummy_overflow_buf`` was ``torch.cuda.IntTensor([0])``; ours was made where the parameters were at
    construction, so an optimizer built before ``model.cuda()`` handed a subclass's ``amp_C`` step (fairseq's
    FusedAdamV2) a CPU flag beside CUDA tensors. It follows them, its value kept; one the script assigns is its own."""
    from ampkit.compat import optimizers

    param = MovedByModelCuda(torch.zeros(3))
    optimizer = getattr(optimizers, name)([param], lr=0.1)
    flag = optimizer._dummy_overflow_buf
    assert flag is optimizer._dummy_overflow_buf and flag.device.type == "cpu"  # made once, where the params are
    flag.fill_(1)
    param.moved_to = GPU
    with PretendGpu():
        assert optimizer._dummy_overflow_buf.device == GPU
        assert optimizer._dummy_overflow_buf is optimizer._dummy_overflow_buf
        assert optimizer._dummy_overflow_buf.cpu().tolist() == [1]
    mine = optimizer._dummy_overflow_buf = torch.zeros(1, dtype=torch.int32)
    assert optimizer._dummy_overflow_buf is mine


class CountsHostTraffic(PretendGpu):
    """The pretend GPU, counting what would synchronize with it on CUDA: a copy of host data to it (``torch.tensor``
    of a list onto ``cuda``, a CPU tensor moved there: torch waits for the stream after a pageable copy) and a read of
    one of its values (``item``, ``tolist``, ``bool``, ``float``, ``cpu``)."""

    READS = (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.cpu)

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.tensor and _device_of(kwargs.get("device")) == "cuda":
            self.syncs.append("torch.tensor onto the GPU")
        elif func in (torch.Tensor.to, torch.Tensor.cuda) and not isinstance(args[0], OnGpu):
            named = (*args[1:], kwargs.get("device"))
            onto_gpu = func is torch.Tensor.cuda or any(_device_of(a) == "cuda" for a in named)
            if onto_gpu and not kwargs.get("non_blocking"):  # non-blocking to the GPU: staged, no wait for it
                self.syncs.append(f"{func.__name__} of a CPU tensor onto the GPU")
        elif func in self.READS and isinstance(args[0], OnGpu):
            self.syncs.append(f"{func.__name__} of a GPU tensor")
        return super().__torch_function__(func, types, args, kwargs)


def test_averaging_gradients_over_ranks_costs_no_sync_where_every_rank_has_them():
    """grad_sync=step averages every optimizer step: the count of ranks holding each gradient was built with
    ``torch.tensor(list, device=cuda)``, a pageable copy after which torch waits for the GPU, every step. It is made
    on the device; only a rank that lacks a gradient reads the counts back (once)."""
    from ampkit.amp.grad_average import average_grads

    traffic = CountsHostTraffic()
    with traffic:
        params = [torch.zeros(2, device="cuda").requires_grad_() for _ in range(3)]
        for param, value in zip(params, (1.0, 2.0, 4.0), strict=True):
            param.grad = torch.full((2,), value, device="cuda")
        traffic.syncs.clear()
        average_grads(params, 2, lambda flat: flat.mul_(2))  # the other rank has the same gradients
        assert traffic.syncs == []
        assert [p.grad.cpu().tolist() for p in params] == [[1.0, 1.0], [2.0, 2.0], [4.0, 4.0]]
        params[1].grad = None  # a layer this rank's batch skipped, and the other rank's (it has what this one has)
        traffic.syncs.clear()
        average_grads(params, 2, lambda flat: flat.mul_(2))
        assert traffic.syncs == ["tolist of a GPU tensor"]
        assert params[1].grad is None and params[2].grad.cpu().tolist() == [4.0, 4.0]  # no rank reached it


def test_sync_batchnorm_reduces_on_this_ranks_gpu_with_no_sync_a_layer(nccl):
    """Each SyncBatchNorm's forward all-reduces its sums beside the batch's sample count, which was a
    ``torch.tensor([count], device=cuda)``: a copy torch waits on, one GPU sync per layer per forward. Its statistics
    go to NCCL on this rank's GPU and nothing is read back. (The backward's gradients come from autograd's engine,
    which the pretend GPU does not reach: its one all-reduce is of them, where they are.)"""
    from ampkit.ops.sync_batchnorm import SyncBatchNorm

    norm = SyncBatchNorm(3, device="cuda")
    with CountsHostTraffic() as traffic:
        out = norm(torch.randn(4, 3, 5, device="cuda"))
    assert traffic.syncs == []
    assert [name for name, _, _ in nccl.calls] == ["all_reduce"] * 2  # the sums with the count, then the variance
    assert out.device == norm.running_mean.device == GPU


def test_the_stop_agreement_reads_the_gpu_once_whatever_its_host_flags(nccl):
    """The stop agreement at an epoch's start (and each logging iteration's) hands NCCL three host bools: each was a
    ``torch.tensor(flag, device=cuda)``, a copy torch waits on, before the one read of the agreed flags."""
    env = DistributedEnv(rank=0, world_size=2)
    with CountsHostTraffic() as traffic:
        agreed = distributed.any_rank([True, False, torch.zeros((), device="cuda"), False], env)
    assert agreed == [True, False, False, False]
    assert traffic.syncs == ["tolist of a GPU tensor"]
    assert nccl.calls == [("all_reduce", "nccl", (str(GPU),))]


def test_apex_no_sync_averaging_reads_its_inf_checks_in_one_transfer(nccl):
    """Apex amp's average of what DDP's ``no_sync`` left rank-local (once an accumulation cycle) asked whether each
    gradient was finite before and after, one ``bool`` each: two GPU syncs a parameter. Read together: one. The
    averaging itself goes to NCCL on this rank's GPU."""
    from ampkit.compat.amp._ddp_no_sync import _average_grads

    params = [torch.zeros(2, device="cuda").requires_grad_() for _ in range(4)]
    for param in params:
        param.grad = torch.ones(2, device="cuda")
    params[2].grad[0] = float("inf")  # this rank's own inf: nothing came from another rank
    with CountsHostTraffic() as traffic:
        assert not _average_grads(params, None)
    assert len(traffic.syncs) == 1, traffic.syncs
    assert [name for name, _, _ in nccl.calls] == ["all_reduce"]


def test_a_sum_over_ranks_reads_the_gpu_once(nccl):
    """Evaluation sums, the finite-weights and non-finite-loss checks add numbers over ranks: ``torch.tensor(values,
    device=cuda)`` waited for the GPU after its copy, a sync before the one read of the sums."""
    env = DistributedEnv(rank=0, world_size=2)
    with CountsHostTraffic() as traffic:
        assert distributed.all_reduce_sum([1.0, 0.5], env) == [2.0, 1.0]
    assert traffic.syncs == ["cpu of a GPU tensor"]
    assert nccl.calls == [("all_reduce", "nccl", (str(GPU),))]


def test_apex_ddps_delayed_allreduce_agrees_its_gradients_with_one_sync(nccl):
    """apex.parallel.DistributedDataParallel(delay_allreduce=True) agrees at each backward's end which gradients
    every rank reduces: its flags were a ``torch.tensor(list, device=cuda)``, a sync before the one read of them."""
    from ampkit.compat.parallel.distributed import _agree_across_ranks

    params = [torch.zeros(2, device="cuda").requires_grad_() for _ in range(3)]
    params[0].grad = torch.ones(2, device="cuda")
    with CountsHostTraffic() as traffic:
        agreed = _agree_across_ranks(params, [True, False, False], None)
    assert agreed == [params[0]]
    assert traffic.syncs == ["tolist of a GPU tensor"]
    assert nccl.calls == [("all_reduce", "nccl", (str(GPU),))]


class GradsOnGpu:
    """A loss whose backward leaves ``grads`` times the loss scale on ``params``, on the pretend GPU (autograd's
    engine, which the pretend GPU does not reach, would leave CPU tensors): what a half model's backward leaves."""

    def __init__(self, params: list[torch.Tensor], *grads: list[float]) -> None:
        self.params, self.grads, self.scale = params, grads, 1.0

    def float(self) -> GradsOnGpu:
        return self

    def __mul__(self, scale: float) -> GradsOnGpu:
        self.scale = scale
        return self

    def backward(self, retain_graph: bool = False) -> None:
        for param, values in zip(self.params, self.grads, strict=True):
            param.grad = (torch.tensor(values).to("cuda", non_blocking=True) * self.scale).to(param.dtype)


def _fp16_optimizer_on_the_gpu(scripts_unscale: bool):
    """An ``FP16_Optimizer`` of three fp16 params on the pretend GPU, its dynamic scaler amp's or one whose ``unscale``
    is a script's (a model-parallel script's shape: its verdict raised in its own ``_overflow_buf`` on the GPU, where
    an all-reduce MAX over the ranks would take it, nothing read)."""
    from ampkit.compat.amp.scaler import LossScaler
    from ampkit.compat.fp16_utils import FP16_Optimizer

    class UnscalesOnTheGpu(LossScaler):
        def unscale(self, model_grads, master_grads, unused_scale, models_are_masters=False):
            for grad, master in zip(model_grads, master_grads, strict=True):
                master.copy_(grad.float() / unused_scale)
                self._overflow_buf.masked_fill_(~torch.isfinite(grad).all(), 1)

    params = [torch.zeros(2, dtype=torch.half, device="cuda").requires_grad_() for _ in range(3)]
    optimizer = FP16_Optimizer(torch.optim.SGD(params, lr=1.0), dynamic_loss_scale=True, verbose=False)
    if scripts_unscale:
        optimizer.loss_scaler = UnscalesOnTheGpu("dynamic")
        optimizer.loss_scaler._overflow_buf = torch.zeros(1, dtype=torch.int32, device="cuda")  # Apex's was on CUDA
    return params, optimizer


@pytest.mark.parametrize("scripts_unscale", [False, True], ids=["amps_unscale", "scripts_unscale"])
def test_fp16_optimizer_reads_the_gpu_once_a_backward(scripts_unscale):
    """Its verdict was read to the host after the unscale (``.item()`` of the overflow buffer a script's unscale left),
    then read again by ``update_scale``, which decides the skip: two GPU syncs a backward. The unscale leaves it on the
    device, as Apex's kernel did, and ``update_scale`` alone reads it, after the script's unscale as under Apex. amp's
    own unscale left its buffer on the CPU, where a script's ``update_scale`` all-reducing it would hand NCCL a CPU
    tensor."""
    with CountsHostTraffic() as traffic:
        params, optimizer = _fp16_optimizer_on_the_gpu(scripts_unscale)
        optimizer.backward(GradsOnGpu(params, [0.5, 0.5], [0.5, 0.5], [0.5, 0.5]))  # amp's flag moves to the GPU once
        assert optimizer.loss_scaler._overflow_buf.device == GPU
        for step, (value, skipped) in enumerate([(0.25, False), (float("inf"), True), (0.25, False)]):
            optimizer.zero_grad()
            traffic.syncs.clear()
            optimizer.backward(GradsOnGpu(params, [0.5, 0.5], [0.125, 0.125], [value, 0.5]))
            assert traffic.syncs == ["item of a GPU tensor"], step
            assert optimizer.overflow is skipped
            masters = [p.grad.cpu().tolist() for group in optimizer.param_groups for p in group["params"]]
            assert skipped or masters == [[0.5, 0.5], [0.125, 0.125], [value, 0.5]]
            optimizer.step()
    assert optimizer.loss_scale == 2.0**15


def test_fp16_optimizer_rechecks_kept_gradients_after_an_overflow_in_one_read():
    """A script that does not zero the gradients after a skipped step keeps their inf, which the next backward sees
    again (as Apex re-checked the accumulated gradients): each kept gradient was read to the host, one GPU sync
    apiece. They are checked on the device and read together, and ``update_scale`` need not read the verdict known."""
    with CountsHostTraffic() as traffic:
        params, optimizer = _fp16_optimizer_on_the_gpu(scripts_unscale=False)
        optimizer.backward(GradsOnGpu(params, [0.5, 0.5], [0.5, 0.5], [0.5, 0.5]))
        optimizer.zero_grad()
        optimizer.backward(GradsOnGpu(params, [0.5, 0.5], [0.5, 0.5], [0.5, float("nan")]))
        assert optimizer.overflow
        optimizer.step()
        traffic.syncs.clear()
        optimizer.backward(GradsOnGpu(params, [0.5, 0.5], [0.5, 0.5], [0.5, 0.5]))  # no zero_grad: the nan is kept
        assert traffic.syncs == ["tolist of a GPU tensor"]  # the three checks together; update_scale reads none
        assert optimizer.overflow and optimizer.loss_scale == 2.0**14


def test_step_sync_broadcasts_buffers_of_two_devices_apart(nccl):
    """grad_sync=step broadcasts rank zero's buffers before each forward, flattened together by dtype only: a model
    whose buffers live on two devices (model parallel, parts offloaded to the CPU) had them put in one buffer (on a
    real GPU, torch.cat refuses) and handed to one collective. One per device and dtype, each where its tensors are."""
    from types import SimpleNamespace

    nccl.default_backend = "cpu:gloo,cuda:nccl"  # CPU tensors through gloo, the GPU's through NCCL
    model = torch.nn.Module()
    model.register_buffer("offloaded", torch.tensor([1.0, 2.0]))
    model.register_buffer("on_gpu", torch.tensor([3.0]).to("cuda", non_blocking=True))
    model.register_buffer("count", torch.tensor([4]).to("cuda", non_blocking=True))
    model.register_buffer("offloaded_too", torch.tensor([5.0]))
    sync = DistributedSync(grad_sync="step")
    sync.on_fit_start(SimpleNamespace(module=model))
    with CountsHostTraffic() as traffic:
        sync.on_train_batch_start(None, batch=None)
    assert traffic.syncs == []
    # the CPU's float32 buffers together, then the GPU's float32 one, then its int64 one
    assert [devices for _, _, devices in nccl.calls] == [("cpu",), (str(GPU),), (str(GPU),)]
    assert [(b.device, b.cpu().tolist()) for b in model.buffers()] == [
        (torch.device("cpu"), [1.0, 2.0]), (GPU, [3.0]), (GPU, [4]), (torch.device("cpu"), [5.0])
    ]  # fmt: skip


def test_apexs_first_fp16_optimizer_reads_every_groups_check_and_norm_in_one_transfer():
    """Apex's first ``FP16_Optimizer`` (around its first ``FusedAdam``) checks each group's gradients for inf/nan and
    hands the step each group's norm: a read of the flag, then of the norm, two GPU syncs a group a step. One now, the
    norms handed over as host numbers, as Apex's were; a skip still reads only that one."""
    from ampkit.compat.legacy_fused_adam import FP16_Optimizer, LegacyFusedAdam

    with CountsHostTraffic() as traffic:
        groups = [[torch.ones(3, dtype=torch.half, device="cuda").requires_grad_() for _ in range(2)],
                  [torch.ones(2, dtype=torch.half, device="cuda").requires_grad_()]]  # fmt: skip
        inner = LegacyFusedAdam([{"params": g} for g in groups], lr=0.1, max_grad_norm=1.0)
        optimizer = FP16_Optimizer(inner, dynamic_loss_scale=True, verbose=False)
        for value, skipped in ((0.5, False), (float("inf"), True)):
            for param in groups[0] + groups[1]:
                param.grad = torch.full_like(param, value)
            traffic.syncs.clear()
            optimizer.step()
            assert traffic.syncs == ["tolist of a GPU tensor"]
            assert optimizer.cur_scale == (2**15 if skipped else 2**16)
    assert [p.cpu().tolist() for p in groups[1]] == [[0.90380859375] * 2]  # stepped once: the skip left it


def test_values_on_the_gpu_come_to_the_host_in_one_transfer_exact_and_typed_as_item():
    """The one way ampkit reads device values: CPU ones where they are, the GPU's in one read whatever their dtypes
    (float64 holds every float32, float16 and int32 exactly); an integer tensor's value is an int on the GPU as on the
    CPU (a step count formatted or indexed with; it came back 3.0 from a GPU), a bool one's a bool."""
    from ampkit.ops.host_values import host_numbers, host_vectors

    with CountsHostTraffic() as traffic:
        on_gpu = [torch.tensor([16777217], dtype=torch.int32), torch.tensor(0.1, dtype=torch.float16),
                  torch.tensor(2.0**-20 * 3), torch.tensor(3), torch.tensor(True)]  # fmt: skip
        on_gpu = [t.to("cuda", non_blocking=True) for t in on_gpu]
        traffic.syncs.clear()
        read = host_numbers([on_gpu[0], 5, None, torch.tensor(4), *on_gpu[1:]])
        assert traffic.syncs == ["tolist of a GPU tensor"]
        assert read == [16777217, 5, None, 4, float(torch.tensor(0.1, dtype=torch.float16)), 2.0**-20 * 3, 3, True]
        assert [type(v) for v in read] == [int, int, type(None), int, float, float, int, bool]
        traffic.syncs.clear()
        same = host_numbers([torch.tensor(i).to("cuda", non_blocking=True) for i in range(3)])  # one dtype: as is
        assert traffic.syncs == ["tolist of a GPU tensor"] and same == [0, 1, 2] and type(same[0]) is int
        norms = torch.tensor([1.5, 2.5]).to("cuda", non_blocking=True)
        traffic.syncs.clear()
        vectors = host_vectors([norms, on_gpu[0], torch.ones(3), 0.5])
        assert traffic.syncs == ["cpu of a GPU tensor"]
    assert [v.tolist() for v in vectors] == [[1.5, 2.5], [16777217.0], [1.0] * 3, [0.5]]
    assert all(v.dtype == torch.float64 and v.device.type == "cpu" for v in vectors)


@pytest.mark.parametrize("op", ["scale_", "axpby_", "unscale_l2norm", "combine_"])
def test_the_multi_tensor_references_flag_inf_on_the_device_without_reading_each_tensor(op):
    """The pure-PyTorch multi-tensor ops (what runs on a GPU whose kernels are not built) asked each tensor whether it
    held inf/nan with ``bool``: a GPU sync per tensor, where the kernels raise the flag on the device. The flag is
    raised there now, and the values are those of before."""
    from ampkit.ops.reference import multi_tensor as reference

    with CountsHostTraffic() as traffic:
        xs = [torch.full((3,), 2.0, device="cuda"), torch.tensor([1.0, float("inf")], device="cuda")]
        outs = [torch.zeros_like(x) for x in xs]
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        traffic.syncs.clear()
        if op == "scale_":
            reference.scale_(xs, outs, 0.5, flag)
        elif op == "axpby_":
            reference.axpby_(0.5, xs, 0.0, [torch.zeros_like(x) for x in xs], outs, flag)
        elif op == "unscale_l2norm":
            reference.unscale_l2norm(xs, outs, 0.5, flag, False)
        else:
            reference.combine_(xs, [None, None], outs, 0.5, flag)
        assert traffic.syncs == []
    assert flag.cpu().tolist() == [1] and outs[0].cpu().tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("raised", [0, 1, 2], ids=["clear", "raised", "raised_to_2"])
@pytest.mark.parametrize("flag_dtype", [torch.int32, torch.float32])
def test_amp_cs_sgd_hands_its_flag_to_the_step_on_the_device(raised, flag_dtype):
    """``amp_C.multi_tensor_sgd`` read ``noop_flag`` with ``item()`` every call, a GPU sync a step where Apex's kernel
    read it on the device. It hands the flag to the SGD step as its ``found_inf``, which the compiled kernels read where
    they run; the one read left here is the pure-PyTorch reference's own (it reads ``found_inf`` on the host). Any
    non-zero flag skips the step, the decay Apex adds after the momentum (``wd_after_momentum``) included."""
    from ampkit.compat import amp_c

    with CountsHostTraffic() as traffic:
        weights = [torch.full((2,), 1.0, device="cuda"), torch.full((3,), 2.0, device="cuda")]
        grads = [torch.full_like(w, 0.5) for w in weights]
        moms = [torch.zeros_like(w) for w in weights]
        flag = torch.full((1,), raised, dtype=flag_dtype, device="cuda")
        traffic.syncs.clear()
        amp_c.multi_tensor_sgd(2048, flag, [grads, weights, moms], 0.5, 0.9, 0.0, 0.1, False, True, True, 2.0)
        assert traffic.syncs == ["__float__ of a GPU tensor"]  # the reference op's read of found_inf
    # stepped: the buffer seeded with scale * g = 1, then w - lr * (buffer + wd * w)
    expected = [1.0] * 2 + [2.0] * 3 if raised else [0.85] * 2 + [1.8] * 3
    assert [v for w in weights for v in w.cpu().tolist()] == pytest.approx(expected)
    assert [v for m in moms for v in m.cpu().tolist()] == [0.0 if raised else 1.0] * 5


def _lamb_lists_on_the_gpu(grad: float) -> list[list[torch.Tensor]]:
    """``[grads, params, exp_avgs, exp_avg_sqs]`` of two tensors on the pretend GPU, the second grad ``grad``."""
    params = [torch.full((2,), 1.0, device="cuda"), torch.full((3,), 2.0, device="cuda")]
    grads = [torch.full_like(params[0], 0.5), torch.full_like(params[1], grad)]
    return [grads, params, [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]]


@pytest.mark.parametrize("grad", [0.25, float("inf")], ids=["finite", "inf"])
def test_amp_cs_lamb_reads_the_gpu_once_before_its_direction_and_once_after(grad):
    """``amp_C.multi_tensor_lamb`` asked with ``bool`` whether each of up to three norms was finite, then read the
    global norm, then the param and direction norms one after the other: up to six GPU syncs a call, where Apex's
    kernels read none. ampkit's LAMB kernels take the clipping factor and the trust ratios as host numbers, so two
    reads remain: the global norm before stage 1, both per-tensor norms together after it. An inf/nan norm raises the
    flag on the device, and the op goes on, as Apex's did."""
    from ampkit.compat import amp_c

    with CountsHostTraffic() as traffic:
        lists = _lamb_lists_on_the_gpu(grad)
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        global_norm = torch.stack(torch._foreach_norm(lists[0])).norm()
        traffic.syncs.clear()
        amp_c.multi_tensor_lamb(2048, flag, lists, 0.1, 0.9, 0.999, 1e-6, 1, 1, 0.01, 1, 1, global_norm, 1.0, False)
        assert traffic.syncs == ["__float__ of a GPU tensor", "cpu of a GPU tensor"]
    assert flag.cpu().tolist() == [0 if grad < float("inf") else 1]


@pytest.mark.parametrize("case", ["steps", "flag_raised", "inf_grad"])
def test_amp_cs_mixed_precision_lamb_reads_the_gpu_at_most_twice(case):
    """``amp_C.multi_tensor_lamb_mp`` (FusedMixedPrecisionLamb) read its flag, lr, step, scales, norms and finite checks
    one at a time: up to ten GPU syncs a call. What the host needs before stage 1 comes in one transfer, the direction's
    norms in one after it; a raised flag stops it after the first, changing nothing, and an inf direction raises the
    flag on the device and leaves the params."""
    from ampkit.compat import amp_c

    with CountsHostTraffic() as traffic:
        lists = _lamb_lists_on_the_gpu(float("inf") if case == "inf_grad" else 0.25)
        before = [p.clone() for p in lists[1]]
        flag = torch.full((1,), int(case == "flag_raised"), dtype=torch.int32, device="cuda")
        lr, step, inv_scale = (torch.full((1,), v, device="cuda") for v in (0.1, 1.0, 0.5))
        norm, max_norm = torch.ones(1, device="cuda"), torch.full((1,), 2.0, device="cuda")
        traffic.syncs.clear()
        amp_c.multi_tensor_lamb_mp(2048, flag, lists, lr, 0.9, 0.999, 1e-6, step, 1, 0.01, 1, 1, norm, max_norm, False,
                                   torch.zeros(1, device="cuda"), inv_scale)  # fmt: skip
        assert traffic.syncs == ["cpu of a GPU tensor"] * (1 if case == "flag_raised" else 2)
    moved = [not torch.equal(p.cpu(), b.cpu()) for p, b in zip(lists[1], before, strict=True)]
    assert moved == ([True, True] if case == "steps" else [False, False])
    assert flag.cpu().tolist() == [0 if case == "steps" else 1]


def test_amp_cs_lamb_stages_read_their_norms_in_one_transfer():
    """NVIDIA's BERT pretraining drives the LAMB stages itself: stage 1 read its per-tensor decays, then the global
    norm; stage 2 the param norms, then the direction's. One transfer each now."""
    from ampkit.compat import amp_c

    with CountsHostTraffic() as traffic:
        grads, params, exp_avgs, exp_avg_sqs = _lamb_lists_on_the_gpu(0.25)
        updates = [torch.zeros_like(p) for p in params]
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        decays, norm = torch.full((2,), 0.01, device="cuda"), torch.ones(1, device="cuda")
        traffic.syncs.clear()
        amp_c.multi_tensor_lamb_stage1_cuda(
            2048, flag, [grads, params, exp_avgs, exp_avg_sqs, updates], decays, 0, 0.9, 0.999, 1e-6, norm, 1.0
        )
        assert traffic.syncs == ["cpu of a GPU tensor"]
        param_norms = torch.stack(torch._foreach_norm(params))
        update_norms = torch.stack(torch._foreach_norm(updates))
        traffic.syncs.clear()
        amp_c.multi_tensor_lamb_stage2_cuda(2048, flag, [params, updates], param_norms, update_norms, 0.1, 0.01, False)
        assert traffic.syncs == ["cpu of a GPU tensor"]
    assert all(u.abs().sum() > 0 for u in updates) and params[0].cpu().tolist() != [1.0, 1.0]


@pytest.mark.parametrize("master", [False, True], ids=["capturable", "capturable_master"])
def test_amp_cs_capturable_adam_reads_lr_and_step_in_one_transfer(master, monkeypatch):
    """``amp_C.multi_tensor_adam_capturable(_master)`` read its ``lr`` and ``step`` tensors apart, two GPU syncs a call,
    where Apex's kernel read both on the device. ampkit's Adam kernel takes them as numbers: one transfer for both
    now, and the flag and the inverse scale go to the kernel on the device (the kernel is stood in for here: what the
    pure-PyTorch reference reads of them is its own)."""
    from ampkit.compat import amp_c

    calls = []
    monkeypatch.setattr(amp_c, "op", lambda name, device: lambda *args: calls.append(args))
    with CountsHostTraffic() as traffic:
        params = [torch.ones(2, device="cuda"), torch.ones(3, device="cuda")]
        lists = [[torch.full_like(p, 0.5) for p in params], params] + [[torch.zeros_like(p) for p in params]] * 2
        lists += [[p.half() for p in params]] if master else []
        flag = torch.full((1,), 2, dtype=torch.int32, device="cuda")
        lr, step, inv_scale = (torch.full((1,), v, device="cuda") for v in (0.1, 3.0, 0.5))
        traffic.syncs.clear()
        capturable = amp_c.multi_tensor_adam_capturable_master if master else amp_c.multi_tensor_adam_capturable
        capturable(2048, flag, lists, lr, 0.9, 0.999, 1e-8, step, 1, 1, 0.01, inv_scale)
        assert traffic.syncs == ["tolist of a GPU tensor"]
    (args,) = calls
    assert [s.cpu().item() for s in args[6]] == [2.0, 2.0] and args[7] == pytest.approx(0.1)
    assert args[-2].cpu().item() == 2.0 and args[-1].cpu().item() == 1.0  # 1 / inv_scale; the raised flag as 1
