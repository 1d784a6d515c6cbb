"""Bring your own model: Hugging Face GPT-2, unmodified, on TP 2 x PP 2 (4 CPU processes).

    pip install -e '.[hf]'
    python examples/hf_gpt2_parallel.py

GPT-2 is built from its config on the meta device; each rank materialises only its pipeline
stage and its TP slices (``parallelize``); Trainer.fit runs the 1F1B schedule with full block
recompute; the checkpoint keeps GPT-2's own parameter names. At the end rank 0 writes a Hugging
Face directory (``save_pretrained``) that ``GPT2LMHeadModel.from_pretrained`` reads.
"""
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_mhc import MHCParallelStrategy, MHCRecomputeCallback, ParallelLMModule, record_module_init
from lightning_mhc.data.sources import SyntheticTokens
from lightning_mhc.any_model import export_pretrained

CONFIG = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=256, n_positions=32)


class GPT2Module(ParallelLMModule):
    def configure_model(self):
        if self.model is None:
            with record_module_init():  # meta device: no weights allocated
                model = GPT2LMHeadModel(CONFIG)
            self.model = self.parallelize(model, plan="gpt2")  # this rank's stage and TP slices


if __name__ == "__main__":
    checkpoint = ModelCheckpoint(dirpath="checkpoints", filename="gpt2-{step}")  # no monitor: best = latest
    trainer = pl.Trainer(
        strategy=MHCParallelStrategy(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
        callbacks=[MHCRecomputeCallback("full"), checkpoint],
        accelerator="cpu", devices=4, max_epochs=1, logger=False,
    )
    trainer.fit(GPT2Module(lr=1e-3), DataLoader(SyntheticTokens(48, 32), batch_size=8))
    if trainer.is_global_zero:
        export_pretrained(checkpoint.best_model_path, GPT2LMHeadModel(CONFIG), "gpt2-export")
        reloaded = GPT2LMHeadModel.from_pretrained("gpt2-export")
        print(f"done: {trainer.global_step} steps, train_loss {float(trainer.callback_metrics['train_loss']):.4f}; "
              f"{checkpoint.best_model_path} exported to gpt2-export ({reloaded.num_parameters():,} parameters)")
