"""ampkit: a PyTorch training loop built around mixed precision done right."""

from ampkit.callbacks.early_stopping import EarlyStopping
from ampkit.config import (
    CheckpointConfig,
    Config,
    ConfigError,
    EarlyStoppingConfig,
    LoggingConfig,
    PrecisionConfig,
    TrainerConfig,
)
from ampkit.trainer import (
    BackwardState,
    Callback,
    CheckpointError,
    DamagedCheckpointError,
    HungUp,
    Logger,
    OptimizerState,
    Phase,
    Preempted,
    Trainer,
    load_model,
)
from ampkit.trainer.sharded_checkpoint import consolidate_checkpoint

__version__ = "0.1.0"

__all__ = [
    "BackwardState",
    "Callback",
    "CheckpointConfig",
    "CheckpointError",
    "DamagedCheckpointError",
    "Logger",
    "Config",
    "ConfigError",
    "EarlyStopping",
    "EarlyStoppingConfig",
    "HungUp",
    "LoggingConfig",
    "OptimizerState",
    "Phase",
    "PrecisionConfig",
    "Preempted",
    "Trainer",
    "TrainerConfig",
    "consolidate_checkpoint",
    "load_model",
]
