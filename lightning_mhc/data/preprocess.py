"""Text or JSONL to megatron-core's indexed dataset (``.bin`` + ``.idx``), in worker processes.

What Megatron-LM's ``tools/preprocess_data.py`` does, for the inputs a user has: a ``.jsonl`` /
``.json`` file (one JSON object per line; each of ``json_keys`` is a document's text), a plain
text file (the whole file is one document, of the key ``text``), or a directory of either
(every file under it, in sorted order). Each document is tokenized in a pool of ``workers``
processes (in input order), followed by the end-of-document token with ``append_eod``, and
written with megatron-core's ``IndexedDatasetBuilder`` to ``{output_prefix}_{key}_document``
(Megatron's naming): the files megatron's ``IndexedDataset`` and ``GPTDataset`` read.
Both files are written under temporary names and renamed at the end (``.idx`` last), so an
interrupted run leaves no pair that looks complete.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy
from tqdm import tqdm

from lightning_mhc.data.sample import SAMPLE, SAMPLE_DIR, resolve
from lightning_mhc.data.text import text_problem
from lightning_mhc.data.tokenizers import load_tokenizer
from lightning_mhc.errors import ConfigError

JSON_SUFFIXES = (".jsonl", ".json")
TEXT_KEY = "text"
"""The key whose output a plain text file's document goes to (Megatron's default json key)."""


@dataclass
class PreprocessResult:
    prefixes: dict[str, str]
    """Per json key, the output prefix (``<prefix>.bin`` and ``<prefix>.idx``)."""
    documents: int
    tokens: int
    seconds: float
    skipped_empty: int

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


def input_files(path: str | Path) -> list[Path]:
    """A file, or every file under a directory (sorted; hidden files left out); ``'sample'``: the
    corpus the package ships."""
    path = Path(resolve(path, "corpus.jsonl")).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if files:
            return files
        raise ConfigError(f"--input {str(path)!r}: the directory holds no files.")
    raise ConfigError(f"--input {str(path)!r}: no such file or directory.")


def document_prefix(prefix: str | Path, key: str) -> str:
    return f"{prefix}_{key}_document"


def _records(files: list[Path], json_keys: list[str]) -> Iterator[tuple[str, str, bool]]:
    """``(where, raw text, is_json)`` per document, read lazily: the workers parse and tokenize."""
    for file in files:
        if file.suffix in JSON_SUFFIXES:
            with open(file, "rb") as handle:
                for number, line in enumerate(handle, 1):
                    if line.strip():
                        yield f"{file}:{number}", _decode(line, f"{file}:{number}"), True
        else:
            if TEXT_KEY not in json_keys:
                raise ConfigError(f"{str(file)!r} is a text file (one document of the key {TEXT_KEY!r}), but "
                                  f"--json-keys {' '.join(json_keys)} has no {TEXT_KEY!r}. Add it, or give .jsonl input.")
            yield str(file), _decode(file.read_bytes(), str(file)), False


def _decode(raw: bytes, where: str) -> str:
    problem = text_problem(raw)
    if problem:
        raise ConfigError(f"{where} {problem}. Give UTF-8 text or JSON lines.")
    return raw.decode("utf-8")


# ------------------------------------------------------------------ workers
_WORKER: dict = {}


def _init_worker(tokenizer: str, json_keys: list[str], append_eod: bool) -> None:
    _WORKER.update(tokenizer=load_tokenizer(tokenizer), keys=json_keys, append_eod=append_eod)


def _encode(record: tuple[str, str, bool]) -> dict[str, list[int]] | str:
    """One document's ids per key, or an error message naming where it came from."""
    where, raw, is_json = record
    if is_json:
        try:
            obj = json.loads(raw)
        except ValueError as error:
            return f"{where}: not a JSON object ({error}). JSONL input holds one JSON object per line."
        missing = [k for k in _WORKER["keys"] if not isinstance(obj, dict) or not isinstance(obj.get(k), str)]
        if missing:
            return (f"{where}: has no text under {', '.join(map(repr, missing))}. Name the keys that hold "
                    "the documents' text with --json-keys.")
        texts = {k: obj[k] for k in _WORKER["keys"]}
    else:
        texts = {TEXT_KEY: raw}
    tokenizer = _WORKER["tokenizer"]
    ids = {}
    for key, text in texts.items():
        tokens = tokenizer.tokenize(text)
        if tokens and _WORKER["append_eod"]:
            tokens.append(tokenizer.eod)
        ids[key] = tokens
    return ids


# ------------------------------------------------------------------ the run
def preprocess(input: str | Path, output_prefix: str | Path, tokenizer: str = "byte",
               json_keys: list[str] | None = None, workers: int = 1, append_eod: bool = False,
               progress: bool = True, chunksize: int = 16) -> PreprocessResult:
    """Tokenize ``input`` into ``{output_prefix}_{key}_document.{bin,idx}`` per json key."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    json_keys = list(json_keys or [TEXT_KEY])
    tok = load_tokenizer(tokenizer)  # refuses a bad tokenizer here, before any worker starts
    if append_eod and tok.eod is None:
        raise ConfigError(f"--append-eod: the tokenizer {tok.name!r} has no end-of-document token (none of "
                          "eos_token in tokenizer_config.json, <|endoftext|>, </s>, ...). Add one, or leave out --append-eod.")
    if workers < 1:
        raise ConfigError(f"--workers {workers}: give 1 or more.")
    files = input_files(input)
    Path(output_prefix).expanduser().parent.mkdir(parents=True, exist_ok=True)
    final = {key: document_prefix(Path(output_prefix).expanduser(), key) for key in json_keys}
    dtype = DType.optimal_dtype(tok.vocab_size)
    builders = {key: IndexedDatasetBuilder(prefix + ".bin.tmp", dtype=dtype) for key, prefix in final.items()}
    documents = tokens = skipped = 0
    start = time.perf_counter()
    bar = tqdm(desc="preprocessing", unit=" docs", file=sys.stderr, dynamic_ncols=True, disable=not progress)
    try:
        with multiprocessing.get_context("spawn").Pool(workers, _init_worker, (tokenizer, json_keys, append_eod)) as pool:
            for ids in pool.imap(_encode, _records(files, json_keys), chunksize=chunksize):
                if isinstance(ids, str):
                    raise ConfigError(ids)
                for key, doc in ids.items():
                    if not doc:
                        skipped += 1
                        continue
                    builders[key].add_document(numpy.asarray(doc, dtype=dtype), [len(doc)])
                    tokens += len(doc)
                documents += 1
                bar.update(1)
                bar.set_postfix(tokens_per_s=f"{tokens / max(time.perf_counter() - start, 1e-9):,.0f}", refresh=False)
    except BaseException:
        _discard(builders, final)
        raise
    finally:
        bar.close()
    if documents == 0:
        _discard(builders, final)
        raise ConfigError(f"--input {str(input)!r}: no documents (empty files, or blank lines only).")
    for key, builder in builders.items():
        builder.finalize(final[key] + ".idx.tmp")
        os.replace(final[key] + ".bin.tmp", final[key] + ".bin")
        os.replace(final[key] + ".idx.tmp", final[key] + ".idx")  # last: a complete pair
    return PreprocessResult(final, documents, tokens, time.perf_counter() - start, skipped)


def sample_prefix(cache_dir: str | Path | None = None) -> str:
    """The shipped corpus in Megatron's indexed format (the shipped BPE, an end-of-document token
    after each document): the prefix of its ``.bin`` / ``.idx`` pair, what ``data.blend=sample``
    reads. Made on first use (seconds) into ``cache_dir`` (default ``$LIGHTNING_MHC_CACHE``, else
    ``$XDG_CACHE_HOME/lightning_mhc``, else ``~/.cache/lightning_mhc``), under a name that changes with
    the shipped files, so it works from any directory and an installed package's folder is never
    written."""
    digest = hashlib.sha256()
    for name in ("corpus.jsonl", "tokenizer.json"):
        digest.update((SAMPLE_DIR / name).read_bytes())
    cache = Path(cache_dir or os.environ.get("LIGHTNING_MHC_CACHE")
                 or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning_mhc").expanduser()
    folder = cache / f"sample-{digest.hexdigest()[:12]}"
    prefix = folder / "sample_text_document"
    if not prefix.with_suffix(".idx").is_file():
        # made aside and renamed into place: a reader never sees half a pair, and of two makers
        # (two runs started at once) the second keeps the first's
        staging = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        preprocess(SAMPLE, staging / "sample", tokenizer=SAMPLE, append_eod=True, progress=False)
        try:
            staging.rename(folder)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return str(prefix)


def _discard(builders: dict, final: dict[str, str]) -> None:
    """An interrupted or failed run: remove the partial ``.bin`` files (nothing was renamed yet)."""
    for key, builder in builders.items():
        builder.data_file.close()
        Path(final[key] + ".bin.tmp").unlink(missing_ok=True)
