"""Fused kernels (C++/CUDA) with a pure-PyTorch reference for every op."""

from ampkit.ops.multi_tensor import L2Norm, axpby_, combine_, l2norm, scale_, unscale_l2norm

__all__ = ["L2Norm", "axpby_", "combine_", "l2norm", "scale_", "unscale_l2norm"]
