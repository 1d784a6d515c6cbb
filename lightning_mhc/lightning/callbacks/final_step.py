"""``FinalStepCheckpoint``: Lightning's ModelCheckpoint that also saves the step training ends at.

``every_n_train_steps`` saves steps N, 2N, ...; with ``max_steps`` not a multiple of N the last
steps would be lost. At the end of training the final step is saved too, under the same name
scheme, without removing the newest periodic checkpoint (``save_top_k`` applies to the periodic
ones), so a run ends with ``step-<last periodic>.ckpt`` and ``step-<final>.ckpt``.

Resumed from a checkpoint of its own directory (the CLI's ``ckpt_path=last``), the directory is
not empty by design: Lightning's "Checkpoint directory ... exists and is not empty" is not said
then. What the resumed run removes is what ``save_top_k=1`` removes in one run: the earlier
periodic checkpoint once a newer periodic one is saved (its state names it); final-step
checkpoints are kept.
"""
from __future__ import annotations

import warnings
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn


class FinalStepCheckpoint(ModelCheckpoint):
    @property
    def last_saved(self) -> str | None:
        return self._last_checkpoint_saved or None

    def __init__(self, *args, resumed_from: str | None = None, **kwargs) -> None:
        """``resumed_from``: the checkpoint the run resumes from (the Trainer knows it only after
        ``setup``, where Lightning warns of a non-empty directory)."""
        super().__init__(*args, **kwargs)
        self.resumed_from = resumed_from

    def setup(self, trainer, pl_module, stage: str) -> None:
        resumed = self.resumed_from
        with warnings.catch_warnings():
            if resumed and self.dirpath and Path(resumed).resolve().parent == Path(self.dirpath).resolve():
                warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
            super().setup(trainer, pl_module, stage)

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        if (trainer.global_step == 0 or self._last_global_step_saved == trainer.global_step
                or trainer.state.fn != TrainerFn.FITTING or trainer.fast_dev_run):
            return
        filepath = self.format_checkpoint_name(self._monitor_candidates(trainer))
        if not self.file_exists(filepath, trainer):  # e.g. resumed from it with nothing left to train
            self._save_checkpoint(trainer, filepath)
