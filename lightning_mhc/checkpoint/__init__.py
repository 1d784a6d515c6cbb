"""Checkpoints: reshardable on ``torch.distributed.checkpoint`` (``format.py``: keyed by global
names, ``sharding.py``: each rank's pieces; the earlier per-(tp, pp) format refused, naming
``lightning_mhc.cli.convert``), crash-safe (``commit.py``).
No Lightning import: the Trainer and Fabric strategies share it."""
from lightning_mhc.checkpoint.commit import (
    FAULT_ENV,
    FAULT_PHASES,
    IncompleteCheckpointError,
    is_complete,
    latest_complete,
    remove,
)
from lightning_mhc.checkpoint.format import (
    FORMAT, load, model_state, optimizer_state, read_metadata, read_trainer_state, save)

__all__ = [
    "FAULT_ENV", "FAULT_PHASES", "FORMAT", "IncompleteCheckpointError", "is_complete", "latest_complete", "load",
    "model_state", "optimizer_state", "read_metadata", "read_trainer_state", "remove", "save",
]
