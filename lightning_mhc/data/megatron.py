"""Megatron indexed datasets for training: blends, splits and ``GPTDataset`` through megatron-core.

    data = MegatronDataModule(blend=[0.7, "data/a_text_document", 0.3, "data/b_text_document"],
                              tokenizer="tokenizer.json", seq_length=1024, global_batch_size=256)
    trainer.fit(module, datamodule=data)

The datasets are megatron-core's own: ``BlendedMegatronDatasetBuilder`` builds a ``GPTDataset``
per prefix and split (``split="969,30,1"``: train, validation, test shares of each prefix's
documents) and a ``BlendedDataset`` that draws from the prefixes in the blend's ratio; index
caches (document/sample/shuffle indices) go to ``cache_dir`` (default: Megatron's, beside the
data). The numbers of samples are Megatron's: ``max_steps x global batch`` for training and
``limit_val_batches x global batch`` for validation and test, read from the Trainer (an epoch of
each split when it sets no number; ``EVAL_BATCHES`` for a weighted blend). Loaders take a DP
rank's slice of each global batch in order (``ConsumedSamplesSampler``), so a resumed run starts
at its ``consumed_samples`` without reading.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import lightning.pytorch as pl
from torch.utils.data import Dataset

from lightning_mhc.data.samplers import global_batch_loader
from lightning_mhc.data.tokenizers import load_tokenizer
from lightning_mhc.errors import ConfigError

DEFAULT_SPLIT = "969,30,1"
SPLITS = ("train", "validation", "test")
EVAL_BATCHES = 100
"""Held-out global batches of a weighted blend when the Trainer sets no number (Megatron's --eval-iters)."""


def parse_blend(blend: str | Sequence[Any], key: str = "data.blend") -> tuple[list[str], list[float] | None]:
    """Megatron's ``--data-path``: one prefix, prefixes, or weights and prefixes alternating
    (``[0.7, A, 0.3, B]``) -> ``(prefixes, weights or None)``."""
    items = [blend] if isinstance(blend, (str, Path)) else list(blend)
    if not items:
        raise ConfigError(f"{key}=[]: give a prefix, or weights and prefixes: {key}=[0.7,PATH_A,0.3,PATH_B].")
    if len(items) == 1:
        return [str(items[0])], None
    if all(not _is_weight(item) for item in items):
        return [str(item) for item in items], None
    if len(items) % 2 or not all(_is_weight(w) for w in items[0::2]) or any(_is_weight(p) for p in items[1::2]):
        raise ConfigError(f"{key}={_show(items)}: a blend alternates weights and prefixes ([0.7,PATH_A,0.3,PATH_B]), "
                          "or lists prefixes only; this one does not parse as either.")
    weights = [float(w) for w in items[0::2]]
    if any(not math.isfinite(w) or w <= 0 for w in weights):
        raise ConfigError(f"{key}={_show(items)}: blend weights must be positive numbers (got {weights}).")
    return [str(p) for p in items[1::2]], weights


def _is_weight(item: Any) -> bool:
    if isinstance(item, bool):
        return False
    if isinstance(item, (int, float)):
        return True
    try:
        float(item)
        return True
    except (TypeError, ValueError):
        return False


def _show(items: list[Any]) -> str:
    return "[" + ",".join(str(i) for i in items) + "]"


def check_prefix(prefix: str, key: str = "data.blend") -> None:
    """An indexed dataset prefix: ``<prefix>.bin`` and ``<prefix>.idx`` exist."""
    bin_, idx = Path(prefix + ".bin"), Path(prefix + ".idx")
    if not bin_.is_file() and not idx.is_file():
        hint = " (lightning-mhc-preprocess names its output <output-prefix>_<key>_document)" \
            if not prefix.endswith("_document") else ""
        raise ConfigError(f"{key}: no indexed dataset at prefix {prefix!r}: neither {bin_.name} nor {idx.name} "
                          f"exists{hint}. Give the prefix of a .bin/.idx pair, without the suffix.")
    for present, missing in ((bin_, idx), (idx, bin_)):
        if not missing.is_file():
            raise ConfigError(f"{key}: {str(present)!r} has no {missing.suffix} beside it ({missing.name}): an "
                              "indexed dataset is the pair. Preprocess the data again (an interrupted run leaves no .idx).")


def check_indexed_data(prefixes: list[str], split: str, sizes: Sequence[int | None], key: str = "data.blend") -> None:
    """Each prefix is a readable .bin/.idx pair, and every split that must give samples (its size
    is not 0 or None) holds documents with tokens: megatron's ``GPTDataset`` would loop forever
    on an empty one. Reads the indices only (megatron's ``IndexedDataset``), splitting documents
    as megatron's builder does."""
    from megatron.core.datasets.blended_megatron_dataset_config import convert_split_vector_to_split_matrix
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    matrix = convert_split_vector_to_split_matrix(check_split(split))
    for prefix in prefixes:
        check_prefix(prefix, key)
        try:
            index = IndexedDataset(prefix, mmap=True)
        except Exception as error:  # megatron asserts on a bad header
            raise ConfigError(f"{key}: {prefix + '.idx'!r} is not a Megatron index ({type(error).__name__}: {error}). "
                              "Preprocess the data again.") from None
        documents = len(index.document_indices) - 1
        for name, bounds, size in zip(SPLITS, matrix, sizes):
            if not size:
                continue
            beg, end = (int(round(b * documents)) for b in bounds or (0, 0))
            tokens = int(index.sequence_lengths[index.document_indices[beg]:index.document_indices[end]].sum()) \
                if end > beg else 0
            if tokens == 0:
                raise ConfigError(
                    f"data.split={split!r} leaves the {name} split of {prefix!r} no tokens (documents [{beg}, {end}) "
                    f"of its {documents}), and {size} samples are needed from it. Give that split a larger share "
                    "(e.g. data.split=[90,10,0]), more documents, or need none (trainer.limit_val_batches=0).")


def check_split(split: str, key: str = "data.split") -> list[float]:
    """``"969,30,1"`` -> normalized shares of train, validation, test (Megatron's format)."""
    parts = str(split).replace("/", ",").split(",")
    try:
        shares = [float(p) for p in parts]
    except ValueError:
        shares = []
    if not 1 <= len(shares) <= 3 or any(s < 0 or not math.isfinite(s) for s in shares) or sum(shares) <= 0:
        raise ConfigError(f"{key}={split!r}: give up to three non-negative shares of train, validation and test, "
                          "e.g. '969,30,1'.")
    shares += [0.0] * (3 - len(shares))
    return [s / sum(shares) for s in shares]


def megatron_num_samples(global_batch_size: int, max_steps: int, limit_val_batches: Any,
                         evaluated: tuple[str, ...] = ("validation", "test")) -> list[int | None]:
    """Samples per split as Megatron counts them: ``max_steps x global batch`` to train and
    ``limit_val_batches x global batch`` for each held-out split in ``evaluated``; None (megatron's
    one epoch, which may be empty) where no number is set."""
    train = max_steps * global_batch_size if max_steps and max_steps > 0 else None
    evals = limit_val_batches if isinstance(limit_val_batches, int) and limit_val_batches > 0 else None
    held_out = evals * global_batch_size if evals else None
    return [train, *(held_out if name in evaluated else None for name in SPLITS[1:])]


def blend_num_samples(sizes: Sequence[int | None], weighted: bool, split: str, global_batch_size: int
                      ) -> list[int | None]:
    """``sizes`` as megatron's builder takes them for this blend: a weighted blend is drawn to a
    number of samples on every split, so a held-out split without one gets ``EVAL_BATCHES`` global
    batches (0 where its share is 0); training must have a number."""
    train, *held_out = sizes
    if not weighted:
        return [train, *held_out]
    if train is None:
        raise ConfigError("a weighted data.blend needs the number of training samples: set "
                          "Trainer(max_steps=...) or MegatronDataModule(num_samples=...).")
    shares = check_split(split)[1:]
    return [train, *(n if n is not None else EVAL_BATCHES * global_batch_size * (share > 0)
                     for n, share in zip(held_out, shares))]


class GPTSamples(Dataset):
    """A megatron ``GPTDataset`` / ``BlendedDataset`` in our batch format: ``tokens``, ``labels``
    and ``loss_mask`` (megatron's ``position_ids`` are those the model makes itself)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = self.dataset[index]
        return {k: sample[k] for k in ("tokens", "labels", "loss_mask")}


class MegatronDataModule(pl.LightningDataModule):
    """Train / validation / test loaders over Megatron indexed datasets (see the module docstring).

    Args:
        blend: a prefix, prefixes, or ``[weight, prefix, weight, prefix, ...]`` (Megatron's ``--data-path``).
        tokenizer: the tokenizer the data was preprocessed with (``tokenizer.json``, its directory,
            ``'byte'`` or ``'sample'``): its end-of-document and pad ids, and the vocabulary check.
        seq_length: tokens per sample (each sample reads ``seq_length + 1``).
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        split: train, validation, test shares of each prefix's documents.
        seed: the seed of megatron's shuffles (documents, samples, blend).
        cache_dir: where megatron writes its index caches.
        num_samples: ``(train, validation, test)`` samples to build; None: from the Trainer.
    """

    def __init__(self, blend: str | Sequence[Any], tokenizer: str, seq_length: int, global_batch_size: int,
                 split: str = DEFAULT_SPLIT, seed: int = 1234, cache_dir: str | None = None,
                 num_samples: Sequence[int | None] | None = None, num_workers: int = 0) -> None:
        super().__init__()
        self.prefixes, self.weights = parse_blend(blend)
        check_split(split)
        self.tokenizer_spec, self.seq_length, self.global_batch_size = str(tokenizer), seq_length, global_batch_size
        self.split, self.seed, self.cache_dir, self.num_workers = split, seed, cache_dir, num_workers
        self.num_samples = list(num_samples) if num_samples is not None else None
        self.datasets: dict[str, Dataset | None] = {}

    @property
    def tokenizer(self):
        return load_tokenizer(self.tokenizer_spec)  # loaded once per process

    def sizes(self) -> list[int | None]:
        """Samples per split (``megatron_num_samples``): given, or from the Trainer's steps and
        validation batches."""
        if self.num_samples is not None:
            sizes = self.num_samples
        else:
            trainer = self.trainer
            sizes = megatron_num_samples(self.global_batch_size, getattr(trainer, "max_steps", -1) if trainer else -1,
                                         getattr(trainer, "limit_val_batches", None) if trainer else None)
        return blend_num_samples(sizes, self.weights is not None, self.split, self.global_batch_size)

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

        from lightning_mhc.distributed.layout import ensure_default_group

        ensure_default_group()  # outside a parallel run (a DataModule on its own, one process)
        sizes = self.sizes()
        check_indexed_data(self.prefixes, self.split, sizes)
        config = GPTDatasetConfig(
            random_seed=self.seed, sequence_length=self.seq_length, blend=(self.prefixes, self.weights),
            split=str(self.split), path_to_cache=self.cache_dir, tokenizer=self.tokenizer,
            reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
        )
        built = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
        self.datasets = {name: (GPTSamples(ds) if ds is not None else None) for name, ds in zip(SPLITS, built)}

    def _loader(self, name: str):
        dataset = self.datasets.get(name)
        if dataset is None:
            return []  # a split of share 0: Lightning runs no batch of it
        return global_batch_loader(dataset, self.global_batch_size, self.trainer, num_workers=self.num_workers)

    def train_dataloader(self):
        return self._loader("train")

    def val_dataloader(self):
        return self._loader("validation")

    def test_dataloader(self):
        return self._loader("test")
