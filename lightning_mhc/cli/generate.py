"""``lightning-mhc-generate``: continue a prompt with a trained model, in one process.

    lightning-mhc-generate ckpt_path=outputs/<date>/<time>/checkpoints/step-000050.ckpt prompt="def main("
    lightning-mhc-generate ckpt_path=<lightning-mhc-export dir> prompt="Once" max_new_tokens=100 \\
        temperature=0.8 top_k=40 top_p=0.95 stop="\\n" seed=0

``ckpt_path`` is a checkpoint directory of any layout or an export directory. The prompt is
encoded as bytes (the byte-level data of ``lightning-mhc-train``: token = byte value) and the
continuation decoded back to text (invalid UTF-8 shows as U+FFFD). ``temperature=0`` (the
default) is greedy; ``stop`` is a one-byte string or a token id.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from lightning_mhc.errors import ConfigError

USAGE = ("usage: lightning-mhc-generate ckpt_path=<checkpoint or export dir> prompt=<text> [max_new_tokens=64] "
         "[temperature=0] [top_k=N] [top_p=P] [stop=<byte or token id>] [seed=0]")
DEFAULTS: dict[str, Any] = dict(ckpt_path=None, prompt=None, max_new_tokens=64, temperature=0.0, top_k=None,
                                top_p=None, stop=None, seed=0)
TYPES = dict(max_new_tokens=int, temperature=float, top_k=int, top_p=float, seed=int)


def parse_args(argv: list[str]) -> dict[str, Any]:
    args = dict(DEFAULTS)
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in DEFAULTS:
            raise ConfigError(f"{item!r}: expected key=value with key one of {', '.join(DEFAULTS)}")
        try:
            args[key] = TYPES[key](value) if key in TYPES else value
        except ValueError:
            raise ConfigError(f"{key}={value!r}: not a {TYPES[key].__name__}") from None
    for key in ("ckpt_path", "prompt"):
        if args[key] is None:
            raise ConfigError(f"{key}= is required")
    if args["max_new_tokens"] < 1:
        raise ConfigError(f"max_new_tokens={args['max_new_tokens']}: must be at least 1")
    return args


def stop_token(stop: str | None) -> int | None:
    if stop is None or stop == "":
        return None
    if stop.isdigit():
        return int(stop)
    encoded = stop.encode().decode("unicode_escape").encode("latin-1")  # "\n" on a command line
    if len(encoded) != 1:
        raise ConfigError(f"stop={stop!r}: give one byte (e.g. stop='\\n') or a token id")
    return encoded[0]


def load_model(path: Path):
    """A whole GPTModel from a checkpoint directory (any layout) or an export directory."""
    from lightning_mhc.model.export import CONFIG_FILE, load_exported

    if not path.exists():
        raise ConfigError(f"ckpt_path={path}: does not exist")
    if (path / CONFIG_FILE).is_file():
        return load_exported(path)
    from lightning_mhc.lightning import MHCGPTModule

    return MHCGPTModule.load_from_checkpoint(path).model


def generate_text(model, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
                  top_p: float | None = None, stop: int | None = None, seed: int = 0) -> str:
    """The continuation of ``prompt`` (byte tokens) as text."""
    import torch

    ids = list(prompt.encode("utf-8"))
    if not ids:
        raise ConfigError("prompt= is empty: give at least one character")
    if max(ids) >= model.config.vocab_size:
        raise ConfigError(f"the prompt has bytes >= the model's vocab_size={model.config.vocab_size}: byte-level "
                          "prompts need vocab_size >= 256")
    generator = torch.Generator().manual_seed(seed)
    tokens = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, temperature=temperature,
                            top_k=top_k, top_p=top_p, stop_token=stop, generator=generator)[0, len(ids):].tolist()
    if stop is not None and stop in tokens:
        tokens = tokens[:tokens.index(stop) + 1]
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip() + "\n\n" + USAGE)
        return
    try:
        args = parse_args(argv)
        start = time.perf_counter()
        model = load_model(Path(args["ckpt_path"]).expanduser())
        loaded = time.perf_counter()
        text = generate_text(model, args["prompt"], args["max_new_tokens"], args["temperature"], args["top_k"],
                             args["top_p"], stop_token(args["stop"]), args["seed"])
    except (ConfigError, FileNotFoundError) as error:
        print(f"lightning-mhc-generate: {error}\n{USAGE}", file=sys.stderr)
        raise SystemExit(2) from None
    print(args["prompt"] + text)
    print(f"lightning-mhc-generate: loaded in {loaded - start:.2f} s, {len(text.encode())} bytes generated in "
          f"{time.perf_counter() - loaded:.2f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
