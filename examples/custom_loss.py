"""Subclassing MHCGPTModule: label smoothing and a z-loss on the last stage, SGD with momentum.

    python examples/custom_loss.py

Only ``loss_func`` needs the last stage's output; the schedule calls it per
microbatch. Here the per-token loss comes from the model, so the subclass
asks the model for logits instead (``labels=None``) and computes its own loss.
"""
import lightning.pytorch as pl
import torch
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from torch.utils.data import DataLoader

from lightning_mhc import MHCGPTModule, MHCParallelStrategy
from lightning_mhc.data.sources import SyntheticTokens


class SmoothedGPT(MHCGPTModule):
    def forward_step(self, microbatch):
        tokens = microbatch["tokens"] if self.model.pre_process else None
        return self.model(tokens)  # hidden state, or vocab-parallel logits [b, s, V/tp] on the last stage

    def loss_func(self, logits, microbatch):
        logits = logits.float().transpose(0, 1).contiguous()  # [s, b, V/tp]
        labels = microbatch["labels"].transpose(0, 1).contiguous()
        ce = vocab_parallel_cross_entropy(logits, labels, label_smoothing=0.1).mean()
        z_loss = 1e-4 * torch.logsumexp(logits, dim=-1).pow(2).mean()  # valid for TP = 1
        return ce + z_loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


if __name__ == "__main__":
    model = SmoothedGPT(dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256,
                             max_sequence_length=32))
    trainer = pl.Trainer(strategy=MHCParallelStrategy(), accelerator="cpu", devices=1, max_steps=8,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(model, DataLoader(SyntheticTokens(64, 32), batch_size=8))
    print(f"done: {trainer.global_step} steps, train_loss {float(trainer.callback_metrics['train_loss']):.4f}")
