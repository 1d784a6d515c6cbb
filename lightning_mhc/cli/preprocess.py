"""``lightning-mhc-preprocess``: text or JSONL to a Megatron indexed dataset, with Megatron-LM's flags.

    lightning-mhc-preprocess --input corpus.jsonl --json-keys text --tokenizer tokenizer.json \\
        --output-prefix data/corpus --workers 2 --append-eod
    # -> data/corpus_text_document.bin / .idx; train on it with data=megatron data.blend=[data/corpus_text_document]
"""
from __future__ import annotations

import argparse
import sys

from lightning_mhc.data.preprocess import preprocess
from lightning_mhc.errors import ConfigError

PROG = "lightning-mhc-preprocess"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Tokenize text files or JSON lines into megatron-core's indexed dataset (.bin + .idx), "
                    "the format of Megatron-LM's tools/preprocess_data.py.")
    parser.add_argument("--input", required=True,
                        help="a .jsonl/.json file (one JSON object per line), a text file (one document), or a "
                             "directory of them")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="the keys of each JSON line whose text is a document (one output per key)")
    parser.add_argument("--tokenizer", default="byte",
                        help="a tokenizer.json, the directory holding one, or 'byte' (default)")
    parser.add_argument("--output-prefix", required=True,
                        help="writes <prefix>_<key>_document.bin and .idx")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    parser.add_argument("--append-eod", action="store_true",
                        help="end every document with the tokenizer's end-of-document token")
    parser.add_argument("--log-interval", type=int, default=None, help=argparse.SUPPRESS)  # Megatron's; the bar shows it
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        result = preprocess(args.input, args.output_prefix, tokenizer=args.tokenizer, json_keys=args.json_keys,
                            workers=args.workers, append_eod=args.append_eod, progress=not args.no_progress)
    except ConfigError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    outputs = ", ".join(f"{prefix}.bin/.idx" for prefix in result.prefixes.values())
    skipped = f", {result.skipped_empty} empty skipped" if result.skipped_empty else ""
    print(f"{PROG}: {result.documents} documents, {result.tokens:,} tokens in {result.seconds:.2f} s "
          f"({result.tokens_per_sec:,.0f} tokens/s, {args.workers} workers{skipped}) -> {outputs}")


if __name__ == "__main__":
    main()
