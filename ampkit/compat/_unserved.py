"""Apex packages the apex shim does not serve, each with what to use instead: the one-line message of the
``ModuleNotFoundError`` a script importing one gets (still a ``ModuleNotFoundError``, so an import guarded by
``try: ... except ImportError:`` falls back as it did where Apex was built without that extension). Read as an
attribute of its package (``apex.contrib.layer_norm``), one raises an AttributeError with the same message."""

from __future__ import annotations

from ampkit.wording import shown

# apex.<name> -> (what it was, what to use instead). A name not listed gets the list of what the shim provides.
UNSERVED: dict[str, tuple[str, str]] = {
    "apex.contrib.layer_norm": ("FastLayerNorm", "apex.normalization.FusedLayerNorm (served) or torch.nn.LayerNorm"),
    "apex.contrib.multihead_attn": (
        "fused multi-head attention",
        "torch.nn.MultiheadAttention or torch.nn.functional.scaled_dot_product_attention",
    ),
    "apex.contrib.fmha": ("fused attention", "torch.nn.functional.scaled_dot_product_attention"),
    "apex.contrib.groupbn": (
        "an NHWC BatchNorm",
        "torch.nn.BatchNorm2d on channels_last tensors (apex.parallel.SyncBatchNorm across ranks)",
    ),
    "apex.contrib.cudnn_gbn": ("a group BatchNorm", "apex.parallel.SyncBatchNorm(process_group=...)"),
    "apex.contrib.group_norm": ("an NHWC GroupNorm", "torch.nn.GroupNorm"),
    "apex.contrib.optimizers.distributed_fused_adam": (
        "a sharded FusedAdam",
        "apex.optimizers.FusedAdam with torch.distributed.optim.ZeroRedundancyOptimizer or FSDP",
    ),
    "apex.contrib.optimizers.distributed_fused_lamb": (
        "a sharded FusedLAMB",
        "apex.optimizers.FusedLAMB with torch.distributed.optim.ZeroRedundancyOptimizer or FSDP",
    ),
    # MLPerf's fairseq (2019-20) imported both at the top of its Adam module; Apex dropped them in June 2022
    "apex.contrib.optimizers.distributed_fused_adam_v2": (
        "a sharded FusedAdam, removed from Apex in 2022",
        "apex.optimizers.FusedAdam with torch.distributed.optim.ZeroRedundancyOptimizer or FSDP",
    ),
    "apex.contrib.optimizers.distributed_fused_adam_v3": (
        "a sharded FusedAdam, removed from Apex in 2022",
        "apex.optimizers.FusedAdam with torch.distributed.optim.ZeroRedundancyOptimizer or FSDP",
    ),
    "apex.contrib.optimizers.distributed_fused_adam_v4": (
        "a sharded FusedAdam of Apex's development branches",
        "apex.optimizers.FusedAdam with torch.distributed.optim.ZeroRedundancyOptimizer or FSDP",
    ),
    "apex.contrib.optimizers.fused_lamb": ("the first FusedLAMB", "apex.optimizers.FusedLAMB"),
    "apex.contrib.optimizers.fused_sgd": ("the first FusedSGD", "apex.optimizers.FusedSGD"),
    "apex.contrib.sparsity": ("ASP 2:4 sparsity", "torch.ao.pruning or torch.sparse.to_sparse_semi_structured"),
    "apex.contrib.transducer": ("the RNN-T joint and loss", "torchaudio.functional.rnnt_loss"),
    "apex.contrib.index_mul_2d": ("a fused index-multiply", "plain indexing: input1[index] * input2"),
    "apex.contrib.conv_bias_relu": ("fused conv + bias + ReLU", "torch.nn.Conv2d followed by torch.relu"),
    "apex.contrib.bottleneck": ("a fused ResNet bottleneck", "torchvision.models.resnet.Bottleneck"),
    "apex.contrib.peer_memory": ("CUDA peer-memory halo exchange", "no equivalent off CUDA; leave the call out"),
    "apex.contrib.nccl_allocator": ("an NCCL memory pool", "no equivalent off CUDA; leave the call out"),
    "apex.contrib.gpu_direct_storage": ("GPUDirect Storage I/O", "torch.save / torch.load"),
    "apex.contrib.openfold_triton": ("OpenFold's Triton kernels", "the model's plain PyTorch LayerNorm and attention"),
    "apex.contrib.torchsched": (
        "a multi-stream torch.compile backend for CUDA",
        "torch.compile(model) with its default backend",
    ),
    "apex.normalization.instance_norm": (
        "nvFuser instance norms, removed from Apex in 2023",
        "torch.nn.InstanceNorm3d",
    ),
    "apex.parallel.optimized_sync_batchnorm_kernel": (
        "the syncbn CUDA extension's autograd function",
        "apex.parallel.SyncBatchNorm (served), or apex.parallel.sync_batchnorm_kernel.SyncBatchnormFunction with "
        "statistics you reduce",
    ),
    "apex.transformer": ("tensor and pipeline parallelism", "Megatron-Core or torch.distributed.tensor.parallel"),
    "apex.RNN": ("Apex's RNN modules", "torch.nn.LSTM, torch.nn.GRU or torch.nn.RNN"),
    "apex.reparameterization": ("weight normalization", "torch.nn.utils.parametrizations.weight_norm"),
    "apex.pyprof": ("an NVTX profiler", "torch.profiler"),
}
# Packages importable and empty, as in Apex itself (apex.contrib's subpackages each need their own extension; the
# focal_loss package deletes what it imported): of their submodules, clip_grad, focal_loss.focal_loss,
# optimizers (Apex's first FP16_Optimizer and FusedAdam) and xentropy are served (module aliases in the shim).
EMPTY_PACKAGES = ("apex.contrib", "apex.contrib.focal_loss")


def unserved_advice(fullname: str) -> str | None:
    """``"'apex.x' (what it was) is not served; use ..."`` for ``fullname`` or a package above it, else None."""
    parts = fullname.split(".")
    for length in range(len(parts), 1, -1):
        entry = UNSERVED.get(".".join(parts[:length]))
        if entry is not None:
            what, instead = entry
            return f"ampkit's apex shim does not serve {shown(fullname)} ({what}); use {instead}"
    return None
