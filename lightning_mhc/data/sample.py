"""The sample corpus and BPE tokenizer the package ships, and how they are made.

Nothing is downloaded at run time, so the quick start needs text and a tokenizer that come with
the package: ``sample_corpus/corpus.jsonl`` holds the docstrings of the Python standard library
(one JSON line per module, ``{"text": ...}``; Python Software Foundation License) and
``sample_corpus/tokenizer.json`` a byte-level BPE trained on it with the ``tokenizers`` trainer.
The name ``sample`` stands for them where a path is taken (``--input sample``,
``--tokenizer sample``, ``data.tokenizer=sample``), and ``data.blend=sample`` names the corpus in
Megatron's indexed format (``preprocess.sample_prefix``, made once into the user's cache). Rebuild both with
``python -m lightning_mhc.data.sample [OUT_DIR]``; tests call ``train_bpe`` on text they make.
"""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

SAMPLE = "sample"
SAMPLE_DIR = Path(__file__).with_name("sample_corpus")
CORPUS_BYTES = 600_000
"""The corpus stops at the first module that would take it past this size (a small package)."""
SAMPLE_VOCAB = 2048
EOD = "<|endoftext|>"


def resolve(spec: str | Path, file: str) -> str:
    """``'sample'`` -> the shipped ``file``; anything else unchanged."""
    return str(SAMPLE_DIR / file) if str(spec) == SAMPLE else str(spec)


def stdlib_docstrings(max_bytes: int = CORPUS_BYTES) -> list[str]:
    """Per standard-library module (sorted by path), its docstrings joined by blank lines."""
    from lightning_mhc.data.sources import stdlib_sources

    documents, total = [], 0
    for path in stdlib_sources():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))]
        text = "\n\n".join(d for d in (ast.get_docstring(n) for n in nodes) if d)
        if not text:
            continue
        size = len(json.dumps({"text": text}).encode()) + 1
        if total + size > max_bytes:
            break
        documents.append(text)
        total += size
    return documents


def train_bpe(texts: list[str], vocab_size: int, out: str | Path) -> Path:
    """A byte-level BPE (GPT-2's scheme) trained on ``texts``, with ``<|endoftext|>`` as its
    end-of-document token, saved as ``out`` (a ``tokenizer.json``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out))
    return out


def build(out_dir: str | Path = SAMPLE_DIR) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = stdlib_docstrings()
    with open(out_dir / "corpus.jsonl", "w") as handle:
        for text in texts:
            handle.write(json.dumps({"text": text}) + "\n")
    train_bpe(texts, SAMPLE_VOCAB, out_dir / "tokenizer.json")
    print(f"{len(texts)} documents -> {out_dir / 'corpus.jsonl'}; BPE of {SAMPLE_VOCAB} -> {out_dir / 'tokenizer.json'}")


if __name__ == "__main__":
    build(sys.argv[1] if len(sys.argv) > 1 else SAMPLE_DIR)
