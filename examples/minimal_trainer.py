"""The smallest MHCParallelStrategy run: a 2-stage pipeline on 2 CPU processes.

    python examples/minimal_trainer.py
"""
import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_mhc import MHCGPTModule, MHCParallelStrategy, MHCRecomputeCallback
from lightning_mhc.data.sources import SyntheticTokens

if __name__ == "__main__":
    model = MHCGPTModule(dict(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=256,
                              max_sequence_length=32), lr=1e-3, warmup_steps=2)
    trainer = pl.Trainer(
        strategy=MHCParallelStrategy(pipeline_model_parallel_size=2),
        callbacks=[MHCRecomputeCallback("mhc_block")],
        accelerator="cpu", devices=2, max_steps=5, logger=False, enable_checkpointing=False,
    )
    trainer.fit(model, DataLoader(SyntheticTokens(64, 32), batch_size=4))
    if trainer.is_global_zero:
        print(f"done: {trainer.global_step} steps, train_loss {float(trainer.callback_metrics['train_loss']):.4f}")
