"""ampkit: a PyTorch training loop built around mixed precision done right."""

from ampkit.config import CheckpointConfig, Config, ConfigError, LoggingConfig, PrecisionConfig, TrainerConfig
from ampkit.trainer import BackwardState, Callback, CheckpointError, Logger, OptimizerState, Trainer
from ampkit.trainer.sharded_checkpoint import consolidate_checkpoint

__version__ = "0.1.0"

__all__ = [
    "BackwardState",
    "Callback",
    "CheckpointConfig",
    "CheckpointError",
    "Logger",
    "Config",
    "ConfigError",
    "LoggingConfig",
    "OptimizerState",
    "PrecisionConfig",
    "Trainer",
    "TrainerConfig",
    "consolidate_checkpoint",
]
