"""ampkit: a PyTorch training loop built around mixed precision done right."""

__version__ = "0.1.0"
