"""Token datasets in the batch format of ``MHCGPTModule`` (``tokens``, ``labels``), and
``check_data``: whether a data source can feed a run, decided before any process starts."""
from __future__ import annotations

import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_mhc.data.samplers import global_batch_loader
from lightning_mhc.data.text import text_problem
from lightning_mhc.errors import ConfigError

HEAD_BYTES = 1 << 16
"""``check_data`` reads this many bytes at the start of each text file it checks."""


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


def used_bytes(files: list[Path], max_bytes: int) -> list[tuple[Path, int]]:
    """The files ``read_bytes`` reads and how many bytes of each, from their sizes (nothing is read)."""
    used, total = [], 0
    for file in files:
        size = min(file.stat().st_size, max_bytes - total)
        used.append((file, size))
        total += size
        if total >= max_bytes:
            break
    return used


def _windows(n_bytes: int, seq_length: int) -> int:
    """``len(ByteWindows(...))`` of ``n_bytes`` bytes (0 where it cannot hold one window)."""
    return (n_bytes - 1) // seq_length if n_bytes >= seq_length + 1 else 0


def _train_bytes(n_bytes: int, val_fraction: float) -> int:
    """Where ``TokenDataModule`` splits ``n_bytes`` bytes: the first ones train, the rest validate."""
    return int(n_bytes * (1 - val_fraction))


def _synthetic_val_samples(synthetic_samples: int, val_fraction: float) -> int:
    return max(1, int(synthetic_samples * val_fraction))


def _check_text(file: Path, size: int) -> None:
    """Refuse a file whose first bytes are not text: NUL bytes or invalid UTF-8."""
    with open(file, "rb") as handle:
        head = handle.read(min(size, HEAD_BYTES))
    where = f"data.path: the file {str(file)!r}"
    fix = ("data=text trains on text: point data.path at a UTF-8 text file, or at a folder holding only text files "
           "(data=synthetic for random tokens).")
    problem = text_problem(head, final=len(head) == file.stat().st_size)
    if problem:
        raise ConfigError(f"{where} {problem}. {fix}")


def check_data(source: str = "stdlib", path: str | None = None, seq_length: int = 64, val_fraction: float = 0.05,
               max_bytes: int = 2_000_000, synthetic_samples: int = 512, global_batch_size: int = 8,
               validate: bool = True) -> dict[str, int]:
    """Check that ``TokenDataModule`` with these arguments gives the training split at least one
    global batch of windows (``seq_length + 1`` bytes each) and, with ``validate``, the validation
    split one global batch too (otherwise validation would silently run no batch); text files must
    start as UTF-8 text. Reads only the files' sizes and first ``HEAD_BYTES`` bytes, with the same
    readers as ``TokenDataModule.setup``. Returns the bytes used and the windows of each split;
    raises ConfigError naming the keys, their values and the fix."""
    if source == "synthetic":
        return _check_synthetic(synthetic_samples, val_fraction, global_batch_size, validate)
    files, what = _byte_sources(source, path)
    used = used_bytes(files, max_bytes)
    if source == "text":
        for file, size in used:
            if size:
                _check_text(file, size)
    n_bytes = sum(size for _, size in used)
    split = _train_bytes(n_bytes, val_fraction)
    counts = dict(bytes=n_bytes, train_windows=_windows(split, seq_length), val_windows=_windows(n_bytes - split, seq_length))
    if n_bytes == 0:
        raise ConfigError(f"{what} is empty (0 bytes{' in every file' if len(files) > 1 else ''}). "
                          "Point data.path at a file or folder with text.")
    _check_split_windows(counts, split, what, seq_length, val_fraction, max_bytes, global_batch_size, validate)
    return counts


def _check_synthetic(synthetic_samples: int, val_fraction: float, global_batch_size: int,
                     validate: bool) -> dict[str, int]:
    """``check_data`` for ``source="synthetic"``: sample counts, no bytes."""
    n_train, n_val = synthetic_samples, _synthetic_val_samples(synthetic_samples, val_fraction)
    counts = dict(bytes=0, train_windows=n_train, val_windows=n_val)
    if n_train < global_batch_size or (validate and n_val < global_batch_size):
        raise ConfigError(
            f"data.synthetic_samples={synthetic_samples} gives {n_train} training and {n_val} validation samples "
            f"(data.val_fraction={val_fraction}); each split needs at least one global batch "
            f"(data.global_batch_size={global_batch_size}). Raise data.synthetic_samples (or data.val_fraction), "
            "lower data.global_batch_size, or set trainer.limit_val_batches=0 to skip validation."
        )
    return counts


def _byte_sources(source: str, path: str | None) -> tuple[list[Path], str]:
    """The files a byte-level source reads, and how the messages name the source."""
    if source != "text":
        return stdlib_sources(), "data.source=stdlib (the standard library's sources)"
    try:
        files = text_sources(path)
    except FileNotFoundError:
        raise ConfigError(
            f"data.path={str(path)!r}: no such file, or a folder without files. Give an existing text file or "
            "folder (a relative path is taken from the directory the command was started in)."
        ) from None
    return files, f"data.path={str(path)!r}"


def _check_split_windows(counts: dict[str, int], split: int, what: str, seq_length: int, val_fraction: float,
                         max_bytes: int, global_batch_size: int, validate: bool) -> None:
    """Refuse a training split (or, with ``validate``, a validation split) of fewer windows than
    one global batch."""
    n_bytes = counts["bytes"]
    window = f"window(s) of data.seq_length+1={seq_length + 1} bytes"
    read = f"{what} gives {n_bytes} bytes" + (f" (at most data.max_bytes={max_bytes})" if n_bytes == max_bytes else "")
    if counts["train_windows"] < global_batch_size:
        raise ConfigError(
            f"{read}; its training split ({split} bytes, 1 - data.val_fraction={val_fraction}) holds "
            f"{counts['train_windows']} {window}, fewer than one global batch (data.global_batch_size="
            f"{global_batch_size}). Give more text (or raise data.max_bytes), or lower data.seq_length / "
            "data.global_batch_size."
        )
    if validate and counts["val_windows"] < global_batch_size:
        raise ConfigError(
            f"{read}; its validation split ({n_bytes - split} bytes, data.val_fraction={val_fraction}) holds "
            f"{counts['val_windows']} {window}, fewer than one global batch (data.global_batch_size="
            f"{global_batch_size}), so validation would run no batch. Raise data.val_fraction, give more text, "
            "lower data.seq_length / data.global_batch_size, or set trainer.limit_val_batches=0 to skip validation."
        )


def read_bytes(files: list[Path], max_bytes: int) -> torch.Tensor:
    """Concatenated bytes of ``files`` (in order) up to ``max_bytes``, as int64 tokens."""
    chunks = []
    for file, size in used_bytes(files, max_bytes):
        with open(file, "rb") as handle:
            chunks.append(handle.read(size))
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


class ByteWindows(Dataset):
    """Consecutive non-overlapping windows of a byte stream: ``tokens`` and next-byte ``labels``."""

    def __init__(self, data: torch.Tensor, seq_length: int) -> None:
        if len(data) < seq_length + 1:
            raise ValueError(f"{len(data)} bytes cannot fill one window of seq_length={seq_length}")
        self.data, self.seq_length = data, seq_length

    def __len__(self) -> int:
        return _windows(len(self.data), self.seq_length)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = index * self.seq_length
        window = self.data[start:start + self.seq_length + 1]
        return dict(tokens=window[:-1], labels=window[1:])


class TokenDataModule(pl.LightningDataModule):
    """Train/validation loaders for 'stdlib', 'text' or 'synthetic' data.

    ``global_batch_size`` samples per optimizer step over all data-parallel ranks: each DP rank
    reads its slice of every global batch (``ConsumedSamplesSampler``; the training order is a
    permutation seeded by ``seed`` and the epoch), and a resumed run starts at its consumed samples.
    """

    def __init__(self, source: str = "stdlib", global_batch_size: int = 8, seq_length: int = 64,
                 path: str | None = None, val_fraction: float = 0.05, max_bytes: int = 2_000_000,
                 synthetic_samples: int = 512, vocab_size: int = 256, seed: int = 0, num_workers: int = 0) -> None:
        super().__init__()
        if source not in ("stdlib", "text", "synthetic"):
            raise ValueError(f"data.source={source!r}: choose stdlib, text or synthetic.")
        if source != "synthetic" and vocab_size < 256:
            raise ValueError(f"byte-level data needs model.vocab_size >= 256 (got {vocab_size}).")
        self.source, self.global_batch_size, self.seq_length, self.path = source, global_batch_size, seq_length, path
        self.val_fraction, self.max_bytes, self.num_workers = val_fraction, max_bytes, num_workers
        self.synthetic_samples, self.vocab_size, self.seed = synthetic_samples, vocab_size, seed
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if self.source == "synthetic":
            n_val = _synthetic_val_samples(self.synthetic_samples, self.val_fraction)
            self.train_set = SyntheticTokens(self.synthetic_samples, self.seq_length, self.vocab_size, seed=0)
            self.val_set = SyntheticTokens(n_val, self.seq_length, self.vocab_size, seed=1)
            return
        files = stdlib_sources() if self.source == "stdlib" else text_sources(self.path)
        data = read_bytes(files, self.max_bytes)
        split = _train_bytes(len(data), self.val_fraction)
        self.train_set = ByteWindows(data[:split], self.seq_length)
        self.val_set = ByteWindows(data[split:], self.seq_length)

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        return global_batch_loader(dataset, self.global_batch_size, self.trainer, shuffle=shuffle, seed=self.seed,
                                   num_workers=self.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """The held-out split (the same as validation: the byte data has one held-out part)."""
        return self._loader(self.val_set, shuffle=False)
