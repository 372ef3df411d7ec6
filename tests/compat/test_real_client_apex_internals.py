"""Programs that reached past Apex's documented API, one pattern per test (written here after the programs' own code,
CPU-sized): a masked batch norm subclassing ``apex.parallel.SyncBatchNorm`` that reduces its own statistics and calls
``apex.parallel.sync_batchnorm_kernel.SyncBatchnormFunction``; copies of Apex's fused layers (NeMo's and Megatron's
softmax, FastLayerNorm ports) that cast through ``apex._autocast_utils``; MLPerf-era fairseq importing the sharded
Adams Apex dropped in 2022, and NVIDIA's Megatron scripts importing ``apex.contrib.torchsched``; Habana's GPU
migration layer, which replaces ``amp.initialize`` by building ``_amp_state`` by hand; convasr's
``data_parallel_and_autocast``, which initializes an ``nn.Sequential`` around the model and casts a DataParallel's
inputs itself; Horovod Adasum's BERT optimizer, which writes its own overflow verdict into amp's scaler; and
glow-tts, which initializes the optimizer inside its own Noam wrapper (``optimizer_g._optim``); and a Kaggle
solution passing torchcontrib's ``SWA`` wrapper (no ``Optimizer.__init__``) through ``amp.initialize``; a Lightning
fork entering ``scale_loss`` by hand and deferring its optimizer checkpoint to amp's lazy init; a research codebase's
standalone fp16 optimizer built from Apex's O2 internals on ``apex.amp.scaler.LossScaler`` and ``amp_C``.
The two-rank part of the batch norm is in ``test_apex_parallel.py``."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import math
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from ampkit.compat import install_apex_shim, uninstall_apex_shim


@pytest.fixture
def shim():
    install_apex_shim()
    yield
    uninstall_apex_shim()


def _masked_sync_batchnorm_class():
    """The client's subclass in outline: statistics over the valid (mask > 0) positions only, scaled up by how many
    positions the mask dropped, reduced over the ranks by hand, then normalised by ``SyncBatchnormFunction``."""
    import apex
    from apex.parallel import ReduceOp
    from apex.parallel.sync_batchnorm_kernel import SyncBatchnormFunction

    class MaskSyncBatchNorm(apex.parallel.SyncBatchNorm):
        def forward(self, inputs):
            input, mask = inputs
            mask = (mask[:, 0:1] > 0).float().detach()
            input = input * mask
            rectifier = input[:, 0].numel() / (mask.sum() + 1e-3)
            if not self.training:
                return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                    self.eps)  # fmt: skip
            process_group = self.process_group or torch.distributed.group.WORLD
            world_size = 1
            with torch.no_grad():
                flat = input.transpose(0, 1).reshape(input.shape[1], -1)
                count = float(flat.shape[1])
                mean, sqr_mean = flat.mean(1) * rectifier, flat.pow(2).mean(1) * rectifier**2
                if torch.distributed.is_initialized():
                    world_size = torch.distributed.get_world_size(process_group)
                    torch.distributed.all_reduce(mean, ReduceOp.SUM, process_group)
                    torch.distributed.all_reduce(sqr_mean, ReduceOp.SUM, process_group)
                    mean, sqr_mean, count = mean / world_size, sqr_mean / world_size, count * world_size
                var = sqr_mean - mean.pow(2)
                self.running_mean = self.momentum * mean + (1 - self.momentum) * self.running_mean
                self.running_var = count / (count - 1) * self.momentum * var + (1 - self.momentum) * self.running_var
            return SyncBatchnormFunction.apply(input, self.weight, self.bias, mean, var, self.eps, process_group,
                                               world_size)  # fmt: skip

    return MaskSyncBatchNorm


def test_a_masked_sync_batchnorm_through_sync_batchnorm_function_is_a_batch_norm_where_nothing_is_masked(shim):
    mask_bn = _masked_sync_batchnorm_class()(3)
    reference = torch.nn.BatchNorm2d(3)
    with torch.no_grad():
        for bn in (mask_bn, reference):
            bn.weight.copy_(torch.tensor([0.5, 1.5, 2.0]))
            bn.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    x = torch.randn(4, 3, 5, 5) * 3 + 1
    upstream = torch.randn(4, 3, 5, 5)
    ours, theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out = mask_bn((ours, torch.ones(4, 1, 5, 5)))
    (out * upstream).sum().backward()
    reference_out = reference(theirs)
    (reference_out * upstream).sum().backward()
    # The rectifier (100 / (100 + 1e-3)) shifts the statistics by 1e-5 relative: well inside these bounds.
    torch.testing.assert_close(out, reference_out.detach(), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(mask_bn.weight.grad, reference.weight.grad, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(mask_bn.bias.grad, reference.bias.grad)
    torch.testing.assert_close(mask_bn.running_var, reference.running_var, rtol=1e-3, atol=1e-3)


def test_sync_batchnorm_function_gives_the_batch_norm_gradient_for_the_statistics_it_is_given(shim):
    """Apex's backward treats ``mean`` and ``var`` as the batch's own statistics (its ``mean_dy`` terms), whatever
    they are: normalising with running statistics (the client's semi-global variant) still subtracts them."""
    from apex.parallel.sync_batchnorm_kernel import SyncBatchnormFunction

    x = (torch.randn(6, 2, 7, dtype=torch.float64) * 2 + 3).requires_grad_(True)
    weight = torch.tensor([0.7, 1.3], dtype=torch.float64, requires_grad=True)
    bias = torch.tensor([0.2, -0.4], dtype=torch.float64, requires_grad=True)
    mean, var = torch.tensor([2.5, 3.5], dtype=torch.float64), torch.tensor([3.0, 5.0], dtype=torch.float64)
    upstream = torch.randn(6, 2, 7, dtype=torch.float64)
    out = SyncBatchnormFunction.apply(x, weight, bias, mean, var, 1e-5, None, 1)
    (out * upstream).sum().backward()
    shape = (1, 2, 1)
    invstd = (var + 1e-5).rsqrt().view(shape)
    torch.testing.assert_close(out, ((x - mean.view(shape)) * invstd * weight.view(shape) + bias.view(shape)))
    centred = x.detach() - mean.view(shape)
    mean_dy = upstream.mean((0, 2), keepdim=True)
    mean_dy_xmu = (upstream * centred).mean((0, 2), keepdim=True)
    expected = (upstream - mean_dy - centred * invstd**2 * mean_dy_xmu) * invstd * weight.detach().view(shape)
    torch.testing.assert_close(x.grad, expected)
    torch.testing.assert_close(weight.grad, (centred * invstd * upstream).sum((0, 2)))
    torch.testing.assert_close(bias.grad, upstream.sum((0, 2)))
    with pytest.raises(ValueError, match=r"one value per channel .* \(6, 2, 7\), got \(3,\)"):
        SyncBatchnormFunction.apply(x, weight, bias, torch.zeros(3), var, 1e-5, None, 1)


class _LayerNormKernel(torch.autograd.Function):
    """A copied fused layer's kernel stand-in: records the dtypes it was handed (it runs with autocast off)."""

    seen: list[torch.dtype] = []

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        _LayerNormKernel.seen = [x.dtype, weight.dtype, bias.dtype]
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)

    @staticmethod
    def backward(ctx, grad):
        raise AssertionError("not differentiated here")


def test_copied_fused_layers_cast_their_inputs_through_apex_autocast_utils(shim):
    import apex
    from apex._autocast_utils import _cast_if_autocast_enabled, _get_autocast_dtypes, _get_current_dtype

    def fast_layer_norm(x, weight, bias, eps):  # the FastLayerNorm ports' and Apex's own fused layers' wrapper
        args = _cast_if_autocast_enabled(x, weight, bias, eps)
        with torch.autocast("cpu", enabled=False):
            return _LayerNormKernel.apply(*args)

    x, weight, bias = torch.randn(2, 8), torch.ones(8), torch.zeros(8)
    assert _cast_if_autocast_enabled(x, weight, 1.0)[0] is x  # outside autocast: the arguments themselves
    assert fast_layer_norm(x, weight, bias, 1e-5).dtype == torch.float32
    assert _get_current_dtype() == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fast_layer_norm(x, weight, bias, 1e-5)
        assert _get_current_dtype() == torch.bfloat16
        # NeMo's softmax passes (inputs, mask, scale): tensors in a list are cast too, float64 and ints are not
        mixed = _cast_if_autocast_enabled([x, x.double()], torch.ones(2, dtype=torch.int64), 0.5)
        assert _cast_if_autocast_enabled({"scores": x})[0]["scores"].dtype == torch.bfloat16
    assert _LayerNormKernel.seen == [torch.bfloat16] * 3 and out.dtype == torch.bfloat16
    assert [t.dtype for t in mixed[0]] == [torch.bfloat16, torch.float64] and mixed[1].dtype == torch.int64
    assert mixed[2] == 0.5
    assert set(_get_autocast_dtypes()) >= {torch.float16}  # apex.transformer's tests parametrize over these
    assert apex._autocast_utils._cast_if_autocast_enabled is _cast_if_autocast_enabled  # as after Apex's import


@pytest.mark.parametrize(
    ("statement", "advice"),
    [
        # MLPerf-era fairseq's optim/adam.py imported all three at its top
        ("from apex.contrib.optimizers.distributed_fused_adam_v3 import DistributedFusedAdamV3", "ZeroRedundancy"),
        ("from apex.contrib.optimizers.distributed_fused_adam_v2 import DistributedFusedAdamV2", "FSDP"),
        ("from apex.contrib.optimizers.distributed_fused_adam_v4 import DistributedFusedAdamV4", "FSDP"),
        ("from apex.normalization.instance_norm import InstanceNorm3dNVFuser", "torch.nn.InstanceNorm3d"),
        ("import apex.contrib.torchsched", "torch.compile(model)"),  # NVIDIA's Megatron training scripts
        ("from apex.contrib.torchsched.passes import pre_grad_custom_pass", "torch.compile(model)"),
        ("from apex.parallel.optimized_sync_batchnorm_kernel import SyncBatchnormFunction", "apex.parallel.SyncBatch"),
    ],
)
def test_removed_or_cuda_only_apex_modules_programs_import_name_what_to_use(shim, statement, advice):
    with pytest.raises(ModuleNotFoundError, match="does not serve") as refused:
        exec(statement, {})
    assert advice in str(refused.value)
    # `find_spec(...) is not None` feature checks fall back (for the first module missing: a submodule of a missing
    # package is a ModuleNotFoundError from find_spec, as for any package not installed)
    assert importlib.util.find_spec(refused.value.name) is None


# Every module of Apex's tree at its last commit with amp (May 2025), its tests and examples aside: served ...
_APEX_MODULES_SERVED = """
apex apex._autocast_utils apex.amp apex.amp._amp_state apex.amp._initialize apex.amp._process_optimizer apex.amp.amp
apex.amp.frontend
apex.amp.handle apex.amp.lists apex.amp.lists.functional_overrides apex.amp.lists.tensor_overrides
apex.amp.lists.torch_overrides apex.amp.scaler apex.amp.utils apex.contrib apex.contrib.clip_grad
apex.contrib.clip_grad.clip_grad apex.contrib.focal_loss apex.contrib.focal_loss.focal_loss apex.contrib.optimizers
apex.contrib.optimizers.fp16_optimizer apex.contrib.optimizers.fused_adam apex.contrib.xentropy
apex.contrib.xentropy.softmax_xentropy apex.fp16_utils apex.fp16_utils.fp16_optimizer apex.fp16_utils.fp16util
apex.fp16_utils.loss_scaler apex.fused_dense apex.fused_dense.fused_dense apex.mlp apex.mlp.mlp
apex.multi_tensor_apply apex.multi_tensor_apply.multi_tensor_apply apex.normalization
apex.normalization.fused_layer_norm apex.optimizers apex.optimizers.fused_adagrad apex.optimizers.fused_adam
apex.optimizers.fused_lamb apex.optimizers.fused_mixed_precision_lamb apex.optimizers.fused_novograd
apex.optimizers.fused_sgd apex.parallel apex.parallel.LARC apex.parallel.distributed apex.parallel.multiproc
apex.parallel.optimized_sync_batchnorm apex.parallel.sync_batchnorm apex.parallel.sync_batchnorm_kernel
""".split()
# ... or refused naming what to use instead (a package and its deepest module: submodules share the refusal) ...
_APEX_MODULES_REFUSED = """
apex.RNN apex.RNN.models apex.contrib.bottleneck apex.contrib.bottleneck.halo_exchangers apex.contrib.conv_bias_relu
apex.contrib.cudnn_gbn.batch_norm apex.contrib.fmha.fmha apex.contrib.gpu_direct_storage apex.contrib.group_norm
apex.contrib.groupbn.batch_norm apex.contrib.index_mul_2d.index_mul_2d apex.contrib.layer_norm.layer_norm
apex.contrib.multihead_attn apex.contrib.multihead_attn.fast_self_multihead_attn_func apex.contrib.nccl_allocator
apex.contrib.openfold_triton.fused_adam_swa apex.contrib.optimizers.distributed_fused_adam
apex.contrib.optimizers.distributed_fused_lamb apex.contrib.optimizers.fused_lamb apex.contrib.optimizers.fused_sgd
apex.contrib.peer_memory.peer_memory apex.contrib.sparsity apex.contrib.sparsity.permutation_search_kernels
apex.contrib.torchsched.inductor.scheduler apex.contrib.transducer.transducer
apex.parallel.optimized_sync_batchnorm_kernel apex.transformer
apex.transformer.pipeline_parallel.schedules.fwd_bwd_pipelining_with_interleaving
""".split()
# ... except amp's internal modules, which name what apex.amp provides.
_APEX_AMP_INTERNALS = ["apex.amp.compat", "apex.amp.opt", "apex.amp.rnn_compat", "apex.amp.wrap"]


def test_every_module_of_apexs_last_tree_is_served_or_refused_naming_what_to_use(shim):
    """The class of failure this round's clients met (a module missing, or refused with no advice), checked across
    Apex's whole tree, so that no import of one of its modules stops a program without saying what to do."""
    for name in _APEX_MODULES_SERVED:
        importlib.import_module(name)
    for name in _APEX_MODULES_REFUSED:
        with pytest.raises(ModuleNotFoundError, match=r"does not serve .*; use "):
            importlib.import_module(name)
    for name in _APEX_AMP_INTERNALS:
        with pytest.raises(ModuleNotFoundError, match=r"apex\.amp provides .*initialize"):
            importlib.import_module(name)


def test_monai_asks_for_apexs_nvfuser_instance_norm_and_falls_back_on_being_told_what_to_use(shim):
    """MONAI's ``instance_nvfuser`` norm: ``optional_import("apex.normalization", name="InstanceNorm3dNVFuser")``
    (an attribute read, caught) decides between Apex's nvFuser kernel (2022-23) and ``nn.InstanceNorm3d``."""
    import apex.normalization

    def optional_import(module: str, name: str):  # MONAI's, in outline
        try:
            return getattr(importlib.import_module(module), name), True
        except (ImportError, AttributeError) as error:
            return error, False

    found, available = optional_import("apex.normalization", name="InstanceNorm3dNVFuser")
    assert not available and isinstance(found, AttributeError) and "torch.nn.InstanceNorm3d" in str(found)
    assert not hasattr(apex.normalization, "InstanceNorm2dNVFuser")
    with pytest.raises(ImportError, match=r"InstanceNorm1dNVFuser .*use torch\.nn\.InstanceNorm1d"):
        exec("from apex.normalization import InstanceNorm1dNVFuser", {})


def test_habanas_initialize_replacement_builds_amp_state_by_hand_and_scale_loss_passes_the_loss_through(shim):
    """Habana's gpu_migration ``apex.amp.initialize``: a fresh ``Properties`` with ``enabled = False``, one
    ``LossScaler(1.0)`` per loss, the model's forward wrapped in the device's autocast; scripts then call
    ``amp.scale_loss`` and ``amp.state_dict`` as under Apex."""
    import apex
    from apex import amp

    def habana_initialize(models, optimizers=None, opt_level="O1", num_losses=1):
        apex.amp._amp_state.opt_properties = apex.amp.frontend.Properties()
        apex.amp._amp_state.opt_properties.enabled = False
        apex.amp._amp_state.loss_scalers = [apex.amp.scaler.LossScaler(1.0) for _ in range(num_losses)]
        forward = models.forward

        def wrapped(*args, **kwargs):
            with torch.autocast(device_type="cpu", dtype=None):  # "hpu" there
                return forward(*args, **kwargs)

        models.forward = wrapped
        return models, optimizers

    torch.manual_seed(0)
    model, twin = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    twin.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = habana_initialize(model, optimizer, num_losses=2)
    x = torch.randn(3, 4)
    loss = model(x).float().pow(2).mean()
    with amp.scale_loss(loss, optimizer, loss_id=1) as scaled_loss:
        assert scaled_loss is loss
        scaled_loss.backward()
    optimizer.step()
    with torch.autocast("cpu"):
        twin(x).float().pow(2).mean().backward()
    torch.testing.assert_close(model.weight, twin.weight.detach() - 0.1 * twin.weight.grad)
    assert amp.state_dict() == {f"loss_scaler{i}": {"loss_scale": 1.0, "unskipped": 0} for i in range(2)}


def test_convasr_initializes_a_sequential_and_casts_a_data_parallels_io_itself(shim):
    """convasr's ``data_parallel_and_autocast``: ``amp.initialize(nn.Sequential(model), optimizers=..., ...)`` so
    that the cast forward is the Sequential's, then ``DataParallel(model[0])`` whose forward it replaces with casts
    read from ``_amp_state.opt_properties.options`` through ``amp._initialize.applier``; the model returns a dict."""
    import apex
    from torch import nn

    class OneConvModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.ModuleList([nn.Conv1d(8, 16, kernel_size=5, stride=2, padding=2)])

        def forward(self, x):
            for subblock in self.conv:
                x = subblock(x)
            return dict(out=x)

    torch.manual_seed(0)
    model, twin = OneConvModel(), OneConvModel()
    twin.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = apex.amp.initialize(nn.Sequential(model), optimizers=optimizer, opt_level="O2", verbosity=0)
    model = torch.nn.DataParallel(model[0])
    options = apex.amp._amp_state.opt_properties.options
    applier = apex.amp._initialize.applier

    def input_caster(tensor):
        return tensor.to(options["cast_model_type"]) if tensor.is_floating_point() else tensor

    def output_caster(tensor):
        wanted = options["cast_model_outputs"] if options.get("cast_model_outputs") is not None else torch.float32
        return tensor.to(wanted) if tensor.is_floating_point() else tensor

    old_forward = model.forward
    model.forward = lambda *args, **kwargs: applier(
        old_forward(*applier(args, input_caster), **applier(kwargs, input_caster)), output_caster
    )
    x = torch.randn(2, 8, 20)
    out = model(x)["out"]
    assert out.dtype == torch.float32 and model.module.conv[0].weight.dtype == torch.float16
    half_twin = OneConvModel()
    half_twin.load_state_dict(twin.state_dict())
    torch.testing.assert_close(out, half_twin.half()(x.half())["out"].float(), rtol=0, atol=0)
    with apex.amp.scale_loss(out.pow(2).mean(), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    master = optimizer.param_groups[0]["params"][0]
    assert master.dtype == torch.float32 and not torch.equal(master, twin.conv[0].weight)
    torch.testing.assert_close(model.module.conv[0].weight, master.half(), rtol=0, atol=0)


class _ActNorm(torch.nn.Module):
    """glow-tts' ActNorm: its first training forward sets bias and log-scale from the batch (data-dependent init)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.logs = torch.nn.Parameter(torch.zeros(1, channels, 1))
        self.bias = torch.nn.Parameter(torch.zeros(1, channels, 1))
        self.initialized = False

    def forward(self, x):
        if not self.initialized:
            with torch.no_grad():
                mean, var = x.mean([0, 2]), x.var([0, 2], unbiased=False)
                logs = 0.5 * torch.log(torch.clamp_min(var, 1e-6))
                self.bias.data.copy_((-mean * torch.exp(-logs)).view(1, -1, 1).to(self.bias.dtype))
                self.logs.data.copy_((-logs).view(1, -1, 1).to(self.logs.dtype))
            self.initialized = True
        return self.bias + torch.exp(self.logs) * x, torch.sum(self.logs) * x.shape[2]


class _InvConv(torch.nn.Module):
    """glow-tts' invertible 1x1 convolution: ``F.conv1d`` with a square weight, its ``torch.logdet`` in the loss."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        weight = torch.linalg.qr(torch.randn(channels, channels))[0]
        if torch.det(weight) < 0:  # as glow-tts: a positive determinant, so that its log is defined
            weight[:, 0] = -weight[:, 0]
        self.weight = torch.nn.Parameter(weight)

    def forward(self, x):
        return F.conv1d(x, self.weight.unsqueeze(-1)), torch.logdet(self.weight) * x.shape[2]


class _Flow(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_ActNorm(4), _InvConv(4), _ActNorm(4)])

    def forward(self, x):
        logdet = 0
        for layer in self.layers:
            x, piece = layer(x)
            logdet = logdet + piece
        return x, logdet


class _NoamAdam:
    """glow-tts' ``commons.Adam``: a plain object holding ``_optim`` and setting its lr on the Noam schedule."""

    def __init__(self, params, dim_model: int, warmup_steps: int, lr: float) -> None:
        self.dim_model, self.warmup_steps, self.lr, self.step_num = dim_model, warmup_steps, lr, 1
        self._optim = torch.optim.Adam(params, lr=lr * self._lr_scale(), betas=(0.9, 0.98), eps=1e-9)

    def _lr_scale(self) -> float:
        return self.dim_model**-0.5 * min(self.step_num**-0.5, self.step_num * self.warmup_steps**-1.5)

    def step(self) -> None:
        self._optim.step()
        self.step_num += 1
        for group in self._optim.param_groups:
            group["lr"] = self.lr * self._lr_scale()

    def zero_grad(self) -> None:
        self._optim.zero_grad()

    def state_dict(self):
        return self._optim.state_dict()

    def load_state_dict(self, state):
        self._optim.load_state_dict(state)


def _clip_grad_value(parameters, clip_value: float) -> float:
    """glow-tts' ``commons.clip_grad_value_``: each gradient clamped, the total norm computed on the way."""
    total = 0.0
    for p in [p for p in parameters if p.grad is not None]:
        total += p.grad.data.norm(2).item() ** 2
        p.grad.data.clamp_(min=-clip_value, max=clip_value)
    return total**0.5


def _glow_tts_run(fp16_run: bool, steps: int, state=None):
    import apex
    from apex import amp

    torch.manual_seed(0)
    generator = _Flow()
    optimizer_g = _NoamAdam(generator.parameters(), dim_model=4, warmup_steps=4, lr=1.0)
    if fp16_run:
        generator, optimizer_g._optim = amp.initialize(generator, optimizer_g._optim, opt_level="O1", verbosity=0)
    if state is not None:  # utils.load_checkpoint: the model's state and the wrapper's (its inner optimizer's)
        generator.load_state_dict(state["model"])
        optimizer_g.load_state_dict(state["optimizer"])
        optimizer_g.step_num = state["step_num"]
        for layer in generator.layers:
            layer.initialized = True
    data = torch.randn(8, 4, 6, generator=torch.Generator().manual_seed(1)) * 2 + 0.5
    norms, losses = [], []
    for _ in range(steps):
        optimizer_g.zero_grad()
        z, logdet = generator(data)
        loss_g = 0.5 * torch.sum(z.float() ** 2) / z.numel() - logdet.float() / z.numel()
        losses.append(loss_g.item())
        if fp16_run:
            with amp.scale_loss(loss_g, optimizer_g._optim) as scaled_loss:
                scaled_loss.backward()
            norms.append(_clip_grad_value(amp.master_params(optimizer_g._optim), 5))
        else:
            loss_g.backward()
            norms.append(_clip_grad_value(generator.parameters(), 5))
        optimizer_g.step()
    saved = {"model": generator.state_dict(), "optimizer": optimizer_g.state_dict(), "step_num": optimizer_g.step_num}
    apex.amp._amp_state.reset()
    return generator, optimizer_g, (norms, losses), saved


def test_glow_tts_initializes_its_wrappers_inner_optimizer_and_clips_gradient_values_of_the_masters(shim):
    """glow-tts (jaywalnut310/glow-tts) ``train.py --fp16_run``: ``generator, optimizer_g._optim =
    amp.initialize(generator, optimizer_g._optim, opt_level="O1")`` on its Noam wrapper, ActNorm's data-dependent
    init in the first O1 forward, ``clip_grad_value_(amp.master_params(optimizer_g._optim), 5)`` between the block
    and the wrapper's ``step()``, and ``utils.load_checkpoint`` of the model and the wrapper's state on restart."""
    o1, o1_optimizer, o1_curves, _ = _glow_tts_run(True, steps=6)
    _, _, fp32_curves, _ = _glow_tts_run(False, steps=6)
    assert o1.layers[0].bias.dtype == torch.float32  # O1 leaves the weights float32
    # No step skipped: the gradient norms and losses follow fp32's (Adam on the ActNorm biases, whose gradients the
    # data-dependent init leaves near zero, turns fp16 rounding into different weights, as it would under Apex).
    torch.testing.assert_close(torch.tensor(o1_curves), torch.tensor(fp32_curves), rtol=5e-2, atol=1e-3)
    assert o1_optimizer._optim.param_groups[0]["lr"] == pytest.approx(4**-0.5 * min(7**-0.5, 7 * 4**-1.5))
    _, _, _, half_way = _glow_tts_run(True, steps=3)
    _, resumed_optimizer, resumed_curves, _ = _glow_tts_run(True, steps=3, state=half_way)
    assert resumed_optimizer.step_num == 7 and resumed_optimizer._optim is not None
    # glow-tts saves no amp state, so the scale restarts at 2**16: the losses go on from where the run stopped
    torch.testing.assert_close(torch.tensor(resumed_curves[1]), torch.tensor(o1_curves[1][3:]), rtol=1e-2, atol=1e-3)


def test_adasum_bert_optimizer_drives_amps_scaler_with_its_own_overflow_verdict(shim):
    """Horovod Adasum's BERT optimizer (a wrapper around an amp-initialized ``FusedAdam``): ``_amp_lazy_init()``,
    ``_loss_scale = 2**15``, its own unscale of the fp16 gradients into fp32 masters through
    ``amp_C.multi_tensor_scale(..., scaler._overflow_buf, ...)``, an overflow verdict from the gradients' norm written
    to ``scaler._has_overflow``, then ``update_scale()`` and ``clear_overflow_state()``, as Apex's scaler took them."""
    import amp_C
    from apex import amp
    from apex.optimizers import FusedAdam

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    optimizer._amp_lazy_init()  # "why they lazily init is beyond me": Apex's processed optimizers answer it
    scaler = amp._amp_state.loss_scalers[0]
    scaler._loss_scale = 2**15
    masters = [p.detach().clone().float().requires_grad_(False) for p in model.parameters()]
    for master in masters:
        master.grad = torch.zeros_like(master)

    def adasum_step(fp16_grads):
        amp_C.multi_tensor_scale(65536, scaler._overflow_buf, [fp16_grads, [m.grad for m in masters]],
                                 1.0 / scaler.loss_scale())  # fmt: skip
        norm_sq = sum(m.grad.norm() ** 2 for m in masters)
        had_overflow = not math.isfinite(norm_sq.item())
        if not had_overflow:
            groups = optimizer.param_groups
            optimizer.param_groups = [dict(groups[0], params=masters)]  # step the masters, as the wrapper does
            optimizer.step()
            optimizer.param_groups = groups
        scaler._has_overflow = had_overflow
        skipped = scaler.update_scale()
        scaler.clear_overflow_state()
        return skipped

    before = [m.clone() for m in masters]
    clean = [torch.full_like(p, 2.0**15, dtype=torch.float16) for p in model.parameters()]
    assert adasum_step(clean) is False and scaler.loss_scale() == 2**15 and scaler._unskipped == 1
    assert all(not torch.equal(m, b) for m, b in zip(masters, before, strict=True))
    stepped = [m.clone() for m in masters]
    overflowing = [g.clone() for g in clean]
    overflowing[0][0, 0] = float("inf")
    assert adasum_step(overflowing) is True and scaler.loss_scale() == 2**14 and scaler._unskipped == 0
    assert scaler._has_overflow is False and int(scaler._overflow_buf.item()) == 0  # cleared for the next step
    assert all(torch.equal(m, s) for m, s in zip(masters, stepped, strict=True))  # the skipped step left them
    scaler._has_overflow = True  # a verdict the script reached itself backs off even with a clean buffer
    assert scaler.update_scale() is True and scaler.loss_scale() == 2**13


def _torchcontrib_swa_class() -> type:
    """torchcontrib's ``SWA`` in outline: it wraps an optimizer without calling ``Optimizer.__init__``, shares its
    ``param_groups`` and counts steps in them, and averages the weights into buffers of its own ``state``. A class
    per run: torch's ``zero_grad`` patches the class's ``step`` with hooks that need ``Optimizer.__init__``'s fields
    (with or without amp, SWA's ``step`` then fails on torch 2; amp's own ``step`` replaces it on the instance)."""

    class SWA(torch.optim.Optimizer):
        def __init__(self, optimizer, swa_start: int, swa_freq: int) -> None:
            self.optimizer, self.swa_start, self.swa_freq = optimizer, swa_start, swa_freq
            self.defaults, self.param_groups, self.state = optimizer.defaults, optimizer.param_groups, {}
            for group in self.param_groups:
                group["n_avg"], group["step_counter"] = 0, 0

        def step(self, closure=None):
            loss = self.optimizer.step(closure)
            for group in self.param_groups:
                group["step_counter"] += 1
                if group["step_counter"] > self.swa_start and group["step_counter"] % self.swa_freq == 0:
                    for p in group["params"]:
                        buf = self.state.setdefault(p, {}).setdefault("swa_buffer", torch.zeros_like(p.data))
                        buf.add_((p.data - buf) / float(group["n_avg"] + 1))
                    group["n_avg"] += 1
            return loss

        def swap_swa_sgd(self) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    buf = self.state[p]["swa_buffer"]
                    current = p.data.clone()
                    p.data.copy_(buf)
                    buf.copy_(current)

    return SWA


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_kaggle_swa_wrapper_through_initialize_averages_what_the_optimizer_steps(shim, opt_level):
    """BloodAxe's APTOS 2019 Kaggle solution: torchcontrib's ``SWA`` around SGD, then catalyst's ``fp16=True``
    (``amp.initialize`` at O1) and a ``MultiStepLR`` on the wrapper. The first step overflows and is skipped whole, so
    SWA does not count it, as under Apex. The average is of what the optimizer steps: the model's weights at O1, the
    fp32 masters at O2, where ``swap_swa_sgd()`` leaves the half model as it was (as under Apex)."""
    from apex import amp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = _torchcontrib_swa_class()(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), swa_start=2, swa_freq=2
    )
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[3], gamma=0.8)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    stepped = optimizer.param_groups[0]["params"][0]  # the layer's weight: fp32 masters at O2
    snapshots = []
    for _ in range(7):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()  # the first one overflows at 2**16 (a loss of ~1.5): its step is skipped
        optimizer.step()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "lr_scheduler.step() before optimizer.step()", as Apex
            scheduler.step()
        snapshots.append(stepped.detach().clone())
    group = optimizer.param_groups[0]
    assert amp._amp_state.loss_scalers[0].loss_scale() == 2**15 and group["step_counter"] == 6
    assert group["n_avg"] == 2 and group["lr"] == pytest.approx(0.08)
    model_weight = model[0].weight.detach().clone()
    optimizer.swap_swa_sgd()
    torch.testing.assert_close(stepped.detach(), (snapshots[4] + snapshots[6]) / 2)  # step counters 4 and 6
    if opt_level == "O1":
        assert stepped is model[0].weight
    else:
        assert stepped.dtype == torch.float32 and torch.equal(model[0].weight, model_weight)


def _lightning_fork_patch_optimizer(optimizer) -> None:
    """A Lightning 1.1 fork's ApexPlugin ``_patch_optimizer``: ``state_dict`` adds ``master_params`` once amp's lazy
    init ran; the first ``load_state_dict`` (the checkpoint) is kept and loaded again by a wrapper of
    ``_lazy_init_maybe_master_weights``, which then copies ``master_params`` into the optimizer's parameters."""
    old_lazy_init, old_state_dict, old_load = (
        optimizer._lazy_init_maybe_master_weights, optimizer.state_dict, optimizer.load_state_dict
    )  # fmt: skip

    def lazy_init(self):
        old_lazy_init()
        self._amp_stash.lazy_init_called = True
        if hasattr(self, "_lazy_saved_state_dict"):
            self.load_state_dict(self._lazy_saved_state_dict)
            del self._lazy_saved_state_dict

    def state_dict(self):
        state = old_state_dict()
        if self._amp_stash.lazy_init_called:
            state["master_params"] = [p.data.clone() for g in self.param_groups for p in g["params"]]
        return state

    def load_state_dict(self, state):
        if not self._amp_stash.lazy_init_called and not hasattr(self, "_lazy_saved_state_dict"):
            self._lazy_saved_state_dict = state
            return old_load(state)
        if self._amp_stash.lazy_init_called and "master_params" in state:
            saved = state.pop("master_params")
            for p in [p for g in self.param_groups for p in g["params"]]:
                p.data.copy_(saved.pop(0))
        return old_load(state)

    optimizer._lazy_init_maybe_master_weights = types.MethodType(lazy_init, optimizer)
    optimizer.state_dict = types.MethodType(state_dict, optimizer)
    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)


def _fork_build(opt_level, state=None, wrap=None):
    """The fork's model and amp optimizer (its patch applied, then ``wrap``), loaded from ``state`` as it resumes."""
    from apex import amp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    if state is not None:
        model.load_state_dict(state["model"])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, loss_scale=128.0, verbosity=0)
    _lightning_fork_patch_optimizer(optimizer)
    if wrap is not None:
        wrap(optimizer)
    if state is not None:
        optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
    return model, optimizer


def _fork_loss(model, i):
    """Batch ``i``'s loss: the same batches in an uninterrupted run and a resumed one."""
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    return F.mse_loss(model(x).float(), y)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_lightning_fork_defers_its_optimizer_checkpoint_and_enters_scale_loss_by_hand(shim, opt_level):
    """The fork's plugin also enters ``amp.scale_loss`` by hand (``__enter__``, ``backward``, ``__exit__(None, None,
    None)``, raising if that returns true). A run resumed from its ``{model, optimizer}`` checkpoint is bit-identical:
    the masters come back exact (the O2 model's state dict and the optimizer's both hold them), and so do Adam's
    moments, loaded at the first ``load_state_dict``. The first backward calls the wrapper of
    ``_lazy_init_maybe_master_weights``, as Apex's did, which loads the checkpoint once more."""
    from apex import amp

    def train(model, optimizer, first, count):
        for i in range(first, first + count):
            optimizer.zero_grad()
            context = amp.scale_loss(_fork_loss(model, i), optimizer)
            context.__enter__().backward()
            assert not context.__exit__(None, None, None)
            optimizer.step()

    model, optimizer = _fork_build(opt_level)
    train(model, optimizer, 0, 6)
    uninterrupted = [p.detach().clone() for p in amp.master_params(optimizer)]
    model, optimizer = _fork_build(opt_level)
    train(model, optimizer, 0, 3)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    assert "master_params" in state["optimizer"]
    model, optimizer = _fork_build(opt_level, state)
    train(model, optimizer, 3, 3)
    for ours, theirs in zip(amp.master_params(optimizer), uninterrupted, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_lightning_fork_resumes_an_apex_checkpoint_with_the_masters_its_lazy_init_wrapper_reloads(shim):
    """A checkpoint Apex wrote at O2 holds the half model and, through the fork's ``state_dict``, the fp32 masters
    as ``master_params``, but not ampkit's own master key. Apex's first backward called the optimizer's
    ``_lazy_init_maybe_master_weights`` through the attribute, so the fork's wrapper reloaded the checkpoint and put
    the exact masters back: the resumed run is bit-identical. Calling ampkit's own lazy init instead left the masters
    at the half model's rounding."""
    from apex import amp

    calls = []

    def counted(optimizer):
        wrapped = optimizer._lazy_init_maybe_master_weights

        def lazy_init(self):
            calls.append(self)
            wrapped()

        optimizer._lazy_init_maybe_master_weights = types.MethodType(lazy_init, optimizer)

    def build(state=None):
        calls.clear()
        return _fork_build("O2", state, counted)

    def train(model, optimizer, first, count):
        for i in range(first, first + count):
            optimizer.zero_grad()
            with amp.scale_loss(_fork_loss(model, i), optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()

    model, optimizer = build()
    train(model, optimizer, 0, 6)
    uninterrupted = [p.detach().clone() for p in amp.master_params(optimizer)]
    model, optimizer = build()
    train(model, optimizer, 0, 3)
    assert calls == [optimizer]  # once, at the first backward
    apex_optimizer_state = optimizer.state_dict()
    del apex_optimizer_state["ampkit_master_weights"]  # Apex saved no masters of its own
    half_model = {k: v.half() for k, v in model.state_dict().items()}  # Apex's O2 model state was fp16
    model, optimizer = build({"model": half_model, "optimizer": apex_optimizer_state})
    train(model, optimizer, 3, 3)
    assert calls == [optimizer] and not hasattr(optimizer, "_lazy_saved_state_dict")
    for ours, theirs in zip(amp.master_params(optimizer), uninterrupted, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


class _StandaloneAmpOptimizer:
    """A research codebase's fp16 optimizer built from Apex's O2 internals, without ``amp.initialize`` (2021): the
    optimizer gets an ``_amp_stash``, fp32 masters replace the half params in its groups at the first step, the step
    takes an ``apex.amp.scaler.LossScaler``, clears it, unscales the half grads into the masters through
    ``scaler.unscale`` / ``unscale_with_stashed`` and the float32 ones in place, reads ``_overflow_buf`` (the class's
    ``has_fused_kernel``), steps unless it overflowed, and copies the masters back with ``amp_C.multi_tensor_scale``."""

    @staticmethod
    def convert(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        import amp_C

        stash = optimizer._amp_stash = types.SimpleNamespace(lazy_init_called=False)
        stash.multi_tensor_scale = amp_C.multi_tensor_scale
        stash.dummy_overflow_buf = torch.zeros(1, dtype=torch.int)  # torch.cuda.IntTensor([0]) in the original
        old_step = optimizer.step

        def new_step(self, closure=None, scaler=None):
            from apex.multi_tensor_apply import multi_tensor_applier

            scaler.clear_overflow_state()
            _StandaloneAmpOptimizer.grads_to_masters(self, scaler)
            overflow = scaler._overflow_buf.item() if scaler.has_fused_kernel else scaler._has_overflow
            retval = None
            if not overflow:
                retval = old_step()
                multi_tensor_applier(
                    stash.multi_tensor_scale, stash.dummy_overflow_buf, [stash.masters, stash.half], 1.0
                )
            for master in stash.masters:
                master.grad = None
            return retval, overflow

        optimizer.step = types.MethodType(new_step, optimizer)
        return optimizer

    @staticmethod
    def lazy_init(optimizer: torch.optim.Optimizer) -> None:
        stash = optimizer._amp_stash
        stash.half, stash.masters, stash.single = [], [], []
        for group in optimizer.param_groups:
            for i, param in enumerate(group["params"]):
                if param.dtype == torch.half:
                    master = param.detach().clone().float().requires_grad_()
                    group["params"][i] = master
                    stash.half.append(param)
                    stash.masters.append(master)
                else:
                    stash.single.append(param)
        optimizer.load_state_dict(optimizer.state_dict())
        stash.lazy_init_called = True

    @staticmethod
    def grads_to_masters(optimizer: torch.optim.Optimizer, scaler) -> None:
        stash = optimizer._amp_stash
        if not stash.lazy_init_called:
            _StandaloneAmpOptimizer.lazy_init(optimizer)
        new_half, new_masters, acc_half, acc_masters = [], [], [], []
        for half, master in zip(stash.half, stash.masters, strict=True):
            if half.grad is None:
                continue
            if master.grad is None:
                master.grad = torch.empty_like(master)
                new_half.append(half.grad)
                new_masters.append(master.grad)
            else:
                acc_half.append(half.grad)
                acc_masters.append(master.grad)
        if new_half:
            scaler.unscale(new_half, new_masters, scaler.loss_scale(), models_are_masters=False)
        if acc_half:
            scaler.unscale_with_stashed(acc_half, acc_masters, acc_masters)
        single = [p.grad for p in stash.single if p.grad is not None]
        if single:
            scaler.unscale(single, single, None, models_are_masters=True, scale_override=scaler.loss_scale())


def test_a_standalone_fp16_optimizer_on_apexs_loss_scaler_and_amp_c_skips_overflows_and_keeps_its_scale(shim):
    """Without ``amp.initialize``: ``LossScaler(loss_scale='dynamic', min_loss_scale=1.)`` built by the script, with
    ``state_dict``/``load_state_dict`` set on the instance (``_unskipped``, ``_loss_scale``). Clean steps follow the
    float32 run to fp16's precision; an inf skips its step (the weights stay) and halves the scale through
    ``update_scale()``; the scale's state round-trips into a new scaler, as the script resumes it."""
    from apex.amp.scaler import LossScaler

    def dynamic_scaler():
        scaler = LossScaler(loss_scale="dynamic", min_loss_scale=1.0)
        scaler.state_dict = lambda: {"_unskipped": scaler._unskipped, "_loss_scale": scaler._loss_scale}

        def load_state_dict(state):
            scaler._unskipped, scaler._loss_scale = state["_unskipped"], state["_loss_scale"]

        scaler.load_state_dict = load_state_dict
        return scaler

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))

    def forward(model, x):
        return model[2](model[1](model[0](x.half()).float()).half()).float()

    reference, model = build(), build()
    model[0].half()
    model[2].half()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    optimizer = _StandaloneAmpOptimizer.convert(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    scaler = dynamic_scaler()
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 4, generator=g), 0.01 * torch.randn(16, 1, generator=g)
        loss = F.mse_loss(forward(model, x), y) * (float("inf") if step == 2 else 1.0)
        before = [p.detach().clone() for p in model.parameters()]
        (loss * scaler.loss_scale()).backward()
        _, overflow = optimizer.step(scaler=scaler)
        skipped = scaler.update_scale()
        model.zero_grad()
        assert bool(overflow) is skipped is (step == 2)
        if skipped:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
            continue
        ref_optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_optimizer.step()
        for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(param.float(), ref, rtol=0, atol=2e-3)
    assert scaler.state_dict() == {"_unskipped": 1, "_loss_scale": 2.0**15}
    resumed = dynamic_scaler()
    resumed.load_state_dict(scaler.state_dict())
    assert resumed.loss_scale() == 2.0**15 and resumed._unskipped == 1 and resumed.dynamic
