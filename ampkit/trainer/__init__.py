"""The training loop and what it exposes to callbacks."""

from ampkit.trainer.callback import HOOKS, Callback, Phase
from ampkit.trainer.checkpoint_io import CheckpointError, DamagedCheckpointError, load_checkpoint
from ampkit.trainer.inference import load_model
from ampkit.trainer.logger import Logger
from ampkit.trainer.ordering import CallbackOrderError, order_callbacks
from ampkit.trainer.preemption import HungUp, Preempted
from ampkit.trainer.state import BackwardState, LoopState, LossState, OptimizerState, skip_verdict
from ampkit.trainer.trainer import Trainer

__all__ = [
    "HOOKS",
    "BackwardState",
    "Callback",
    "CallbackOrderError",
    "CheckpointError",
    "DamagedCheckpointError",
    "Logger",
    "LoopState",
    "LossState",
    "OptimizerState",
    "Phase",
    "HungUp",
    "Preempted",
    "Trainer",
    "load_checkpoint",
    "load_model",
    "order_callbacks",
    "skip_verdict",
]
