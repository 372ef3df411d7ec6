"""Round twenty of real Apex programs, their Apex-DDP set-ups (written here after the programs' own code, CPU-sized,
in a one-rank gloo group):

- fex's ``ApexDDPAccelerator`` (``fex/engine/accelerators/ddp_accelerator.py``): ``amp.initialize`` with
  ``keep_batchnorm_fp32=None``, the configured ``loss_scale``, ``max_loss_scale=1024.0`` and ``min_loss_scale=1.0``,
  then ``apex.parallel.DistributedDataParallel(model, delay_allreduce=True)``, ``scale_loss`` and the masters
  clipped by ``clip_grad_norm_(amp.master_params(optimizer), ...)``, whose norm it logs;
- simseg's ``DistHook`` (``simseg/core/hooks/dist.py``): ``amp.initialize`` on the list of the model's submodules
  less its parameter-free ``criterion``, each put back into the model's ``_modules`` by name, then Apex's DDP
  (``delay_allreduce=False``) around the whole model, criterion included.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ampkit.compat import install_apex_shim, uninstall_apex_shim


@pytest.fixture
def shim():
    install_apex_shim()
    yield
    uninstall_apex_shim()


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def _fex_run(opt_level: str, steps: int = 6) -> tuple[list[float], list[float], list[torch.Tensor]]:
    """fex's trainer through its accelerator: set_up (initialize, Apex DDP), then per batch backward_step and
    optimizer_step (clip the masters, log the norm), then the optimizer's step."""
    from apex import amp
    from apex.parallel import DistributedDataParallel as Apex_DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, keep_batchnorm_fp32=None,
                                      loss_scale="dynamic", max_loss_scale=1024.0, min_loss_scale=1.0)  # fmt: skip
    model = Apex_DDP(model, delay_allreduce=True)
    losses, norms = [], []
    for i in range(steps):
        x, y = _batch(i)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x).float(), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 0.5)))
        optimizer.step()
        losses.append(loss.item())
    return losses, norms, [p.detach().float().clone() for p in amp.master_params(optimizer)]


def test_fex_apex_ddp_accelerator_starts_the_dynamic_scale_at_its_cap_and_trains_as_float32(shim, one_rank):
    """``max_loss_scale=1024.0`` caps the dynamic scale, so it starts at 1024 (Apex's ``min(max_loss_scale, 2**16)``),
    not 2**16; ``keep_batchnorm_fp32=None`` keeps O2's float32 batch norm. The clip norms, losses and masters follow
    O0's, whose scale (static 1 by default) the same keywords turn dynamic and capped too."""
    from apex import amp

    runs = {level: _fex_run(level) for level in ("O0", "O2")}
    scaler = amp._amp_state.loss_scalers[0]
    assert scaler.loss_scale() == 1024.0 and scaler._max_loss_scale == 1024.0 and scaler._min_loss_scale == 1.0
    (losses, norms, masters), (losses0, norms0, masters0) = runs["O2"], runs["O0"]
    assert min(norms0) > 0.5  # the clip bites every step
    torch.testing.assert_close(norms, norms0, rtol=1e-2, atol=0)
    torch.testing.assert_close(losses, losses0, rtol=0, atol=5e-3)
    for ours, full in zip(masters, masters0, strict=True):
        torch.testing.assert_close(ours, full, rtol=0, atol=5e-3)


class _SimsegModel(torch.nn.Module):
    """simseg's model layout: backbone, head and a parameter-free label-smoothing criterion."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.ReLU())
        self.head = torch.nn.Linear(16, 3)
        self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.criterion(self.head(self.backbone(x)).float(), y)


def _simseg_run(opt_level: str, steps: int = 6) -> tuple[list[float], torch.nn.Module]:
    from apex import amp
    from apex.parallel import DistributedDataParallel as DDP

    model = _SimsegModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert not hasattr(model, "criterion") or len(list(model.criterion.parameters())) == 0  # its before_run check
    modules = model.__dict__.get("_modules")
    pipeline_modules = {name: module for name, module in modules.items() if name != "criterion"}
    pipeline_amp, optimizer = amp.initialize(list(pipeline_modules.values()), optimizer, opt_level=opt_level,
                                             verbosity=0)  # fmt: skip
    for idx, name in enumerate(pipeline_modules.keys()):
        modules[name] = pipeline_amp[idx]
    model = DDP(model, delay_allreduce=False)
    losses = []
    for i in range(steps):
        x, y = _batch(i)
        optimizer.zero_grad()
        loss = model(x, y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.module


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_simseg_dist_hook_initializes_submodules_less_the_criterion_and_trains_as_float32(shim, one_rank, opt_level):
    """The submodules initialized as a list and put back by name are the model's own (cast at O2, their forwards
    patched), the criterion stays float32 outside amp, and Apex's DDP around the whole model trains as O0 does."""
    runs = {level: _simseg_run(level) for level in ("O0", opt_level)}
    (losses, model), (losses0, _) = runs[opt_level], runs["O0"]
    expected = torch.float16 if opt_level == "O2" else torch.float32
    assert model.head.weight.dtype == model.backbone[0].weight.dtype == expected
    assert isinstance(model.criterion, torch.nn.CrossEntropyLoss)
    torch.testing.assert_close(losses, losses0, rtol=0, atol=1e-2)
    assert losses[-1] < losses[0]
