"""Preprocessing throughput: ``lightning-mhc-preprocess`` (tokens/s) with 1 and 2 workers, beside
the tokenizer alone.

    python benchmarks/preprocess_throughput.py [--rounds 3] [--copies 10] [--out PATH]

The input is the package's sample corpus (standard-library docstrings, JSONL) repeated
``--copies`` times, tokenized with the sample BPE (vocabulary 2048) and ``--append-eod``. Per
round, one after the other: the library call behind the command with ``workers=1`` and
``workers=2`` (pool start-up, reading, JSON parsing, tokenizing, writing the ``.bin``/``.idx``),
and, as the ceiling of tokenization on this machine, ``tokenizers``' own ``encode_batch`` on the
same texts already in memory (Rust threads, no parsing or writing). Medians over the rounds; the
ratios are to the 1-worker figure.

Writes JSON (default ``benchmarks/results/preprocess_throughput.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile
import time

from _harness import RESULTS, median, write_json

from lightning_mhc.data.preprocess import preprocess
from lightning_mhc.data.sample import SAMPLE_DIR
from lightning_mhc.data.tokenizers import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--copies", type=int, default=10)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "preprocess_throughput.json")
    args = parser.parse_args()
    lines = (SAMPLE_DIR / "corpus.jsonl").read_text().splitlines() * args.copies
    texts = [json.loads(line)["text"] for line in lines]
    tokenizer = load_tokenizer("sample")
    rates: dict[str, list[float]] = {"workers=1": [], "workers=2": [], "encode_batch": []}
    tokens = 0
    with tempfile.TemporaryDirectory() as tmp:
        corpus = pathlib.Path(tmp) / "corpus.jsonl"
        corpus.write_text("\n".join(lines) + "\n")
        for r in range(args.rounds):
            for workers in (1, 2):
                result = preprocess(corpus, pathlib.Path(tmp) / f"out{workers}", tokenizer="sample", workers=workers,
                                    append_eod=True, progress=False)
                rates[f"workers={workers}"].append(result.tokens_per_sec)
                tokens = result.tokens
            start = time.perf_counter()
            encoded = tokenizer._tokenizer.encode_batch(texts, add_special_tokens=False)
            seconds = time.perf_counter() - start
            rates["encode_batch"].append((sum(len(e.ids) for e in encoded) + len(texts)) / seconds)
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:,.0f} tokens/s" for k, v in rates.items()))
    medians = {k: median(v) for k, v in rates.items()}
    payload = dict(
        corpus=dict(documents=len(lines), bytes=sum(len(line) + 1 for line in lines), tokens=tokens,
                    tokenizer="sample BPE, vocabulary 2048"),
        machine=dict(cpus=os.cpu_count()), rounds=args.rounds, tokens_per_sec=rates, median_tokens_per_sec=medians,
        ratios={k: v / medians["workers=1"] for k, v in medians.items()},
    )
    for name, value in medians.items():
        print(f"{name:>13}: {value:>12,.0f} tokens/s  ({payload['ratios'][name]:.2f}x workers=1)")
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
