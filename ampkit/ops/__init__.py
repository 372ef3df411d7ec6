"""Fused kernels (C++/CUDA) with a pure-PyTorch reference for every op."""
