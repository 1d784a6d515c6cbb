"""Token datasets in the batch format of ``MHCGPTModule`` (``tokens``, ``labels``)."""
from __future__ import annotations

import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset


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


def stdlib_sources() -> list[Path]:
    """The standard library's ``.py`` files in a fixed (sorted) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def text_sources(path: str | Path) -> list[Path]:
    """A text file, or every file under a folder in sorted order."""
    path = Path(path).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        if files:
            return files
    raise FileNotFoundError(f"data.path={str(path)!r}: no such file, or a folder without files.")


def read_bytes(files: list[Path], max_bytes: int) -> torch.Tensor:
    """Concatenated bytes of ``files`` (in order) up to ``max_bytes``, as int64 tokens."""
    chunks, total = [], 0
    for file in files:
        data = file.read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


class ByteWindows(Dataset):
    """Consecutive non-overlapping windows of a byte stream: ``tokens`` and next-byte ``labels``."""

    def __init__(self, data: torch.Tensor, seq_length: int) -> None:
        if len(data) < seq_length + 1:
            raise ValueError(f"{len(data)} bytes cannot fill one window of seq_length={seq_length}")
        self.data, self.seq_length = data, seq_length

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = index * self.seq_length
        window = self.data[start:start + self.seq_length + 1]
        return dict(tokens=window[:-1], labels=window[1:])


class TokenDataModule(pl.LightningDataModule):
    """Train/validation loaders for 'stdlib', 'text' or 'synthetic' data.

    ``batch_size`` is the per-data-parallel-rank batch (global batch / DP); the
    strategy's sampler gives each DP rank its own part of the data.
    """

    def __init__(self, source: str = "stdlib", batch_size: int = 8, seq_length: int = 64,
                 path: str | None = None, val_fraction: float = 0.05, max_bytes: int = 2_000_000,
                 synthetic_samples: int = 512, vocab_size: int = 256, num_workers: int = 0) -> None:
        super().__init__()
        if source not in ("stdlib", "text", "synthetic"):
            raise ValueError(f"data.source={source!r}: choose stdlib, text or synthetic.")
        if source != "synthetic" and vocab_size < 256:
            raise ValueError(f"byte-level data needs model.vocab_size >= 256 (got {vocab_size}).")
        self.source, self.batch_size, self.seq_length, self.path = source, batch_size, seq_length, path
        self.val_fraction, self.max_bytes, self.num_workers = val_fraction, max_bytes, num_workers
        self.synthetic_samples, self.vocab_size = synthetic_samples, vocab_size
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if self.source == "synthetic":
            n_val = max(1, int(self.synthetic_samples * self.val_fraction))
            self.train_set = SyntheticTokens(self.synthetic_samples, self.seq_length, self.vocab_size, seed=0)
            self.val_set = SyntheticTokens(n_val, self.seq_length, self.vocab_size, seed=1)
            return
        files = stdlib_sources() if self.source == "stdlib" else text_sources(self.path)
        data = read_bytes(files, self.max_bytes)
        split = int(len(data) * (1 - self.val_fraction))
        self.train_set = ByteWindows(data[:split], self.seq_length)
        self.val_set = ByteWindows(data[split:], self.seq_length)

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle, drop_last=True,
                          num_workers=self.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)
