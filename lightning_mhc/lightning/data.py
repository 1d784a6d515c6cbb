"""Token datasets in the batch format of ``MHCGPTModule`` (``tokens``, ``labels``)."""
from __future__ import annotations

import torch
from torch.utils.data import Dataset


class SyntheticTokens(Dataset):
    """Deterministic random token windows: sample ``i`` depends only on ``(seed, i)``."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int = 256, seed: int = 0) -> None:
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        window = torch.randint(0, self.vocab_size, (self.seq_length + 1,), generator=g)
        return dict(tokens=window[:-1], labels=window[1:])
