"""``lightning-mhc-generate``: continue a prompt with a trained model, in one process.

    lightning-mhc-generate ckpt_path=outputs/<date>/<time>/checkpoints/step-000050.ckpt prompt="def main("
    lightning-mhc-generate ckpt_path=<lightning-mhc-export dir> prompt="Once" max_new_tokens=100 \\
        temperature=0.8 top_k=40 top_p=0.95 stop="\\n" seed=0

``ckpt_path`` is a checkpoint directory of any layout or an export directory, of the project's
GPT or of a Hugging Face model (``lightning-mhc-train model=hf``: the export ``save_pretrained``
wrote, loaded by ``load_pretrained`` with its hyper-connections, and generated from by its own
``generate``). The prompt is encoded with the model's ``tokenizer.json`` where it has one (a
Hugging Face model's, which ``lightning-mhc-export`` copies beside it), else as bytes (the
byte-level data of ``lightning-mhc-train``: token = byte value), and the continuation decoded back
to text (invalid UTF-8 shows as U+FFFD). ``temperature=0`` (the default) is greedy; ``stop`` is a
one-byte string (a one-token string with a tokenizer) or a token id.
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


class Generator:
    """A loaded model and how its text becomes tokens: ``tokenizer`` (``tokenize`` /
    ``detokenize``: ``lightning_mhc.data.tokenizers``) or None for bytes; ``hf``: a Hugging Face
    model (its own ``generate``) rather than the project's GPT."""

    def __init__(self, model, tokenizer=None, hf: bool = False) -> None:
        self.model, self.tokenizer, self.hf = model, tokenizer, hf

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.tokenize(text) if self.tokenizer is not None else list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.detokenize(tokens)
        return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def stop_token(stop: str | None, tokenizer=None) -> int | None:
    if stop is None or stop == "":
        return None
    if stop.isdigit():
        return int(stop)
    raw = stop.encode().decode("unicode_escape").encode("latin-1")  # "\n" on a command line
    encoded = tokenizer.tokenize(raw.decode("utf-8", errors="replace")) if tokenizer is not None else list(raw)
    if len(encoded) != 1:
        what = "one token of the model's tokenizer" if tokenizer is not None else "one byte"
        raise ConfigError(f"stop={stop!r}: give {what} (e.g. stop='\\n') or a token id")
    return encoded[0]


def load_model(path: Path) -> Generator:
    """The whole model of a checkpoint directory (any layout) or an export directory, the project's
    GPT or a Hugging Face model (``model=hf``), with its tokenizer where it has one."""
    import json

    from lightning_mhc.model.export import CONFIG_FILE, load_exported

    if not path.exists():
        raise ConfigError(f"ckpt_path={path}: does not exist")
    if (path / CONFIG_FILE).is_file():
        if "model_type" in json.loads((path / CONFIG_FILE).read_text()):  # save_pretrained's config.json
            from lightning_mhc.any_model.export import load_pretrained

            return Generator(load_pretrained(path).eval(), _tokenizer_beside(path), hf=True)
        return Generator(load_exported(path))
    from lightning_mhc.cli.export import _hyperparameters

    hparams = _hyperparameters(path)
    if "model_dir" in hparams:  # a model=hf run's checkpoint
        from lightning_mhc.any_model import load_checkpoint
        from lightning_mhc.lightning.modules.hf import HFCausalLMModule

        model = load_checkpoint(HFCausalLMModule.whole_model(hparams), path).eval()
        return Generator(model, _tokenizer_beside(Path(hparams["model_dir"])), hf=True)
    from lightning_mhc.lightning import MHCGPTModule

    return Generator(MHCGPTModule.load_from_checkpoint(path).model)


def _tokenizer_beside(directory: Path):
    from lightning_mhc.data.tokenizers import load_tokenizer

    return load_tokenizer(directory) if (directory / "tokenizer.json").is_file() else None


def generate_text(model, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
                  top_p: float | None = None, stop: int | None = None, seed: int = 0) -> str:
    """The continuation of ``prompt`` as text (``model``: a :class:`Generator`, or the project's GPT,
    whose prompt is bytes)."""
    import torch

    generator = model if isinstance(model, Generator) else Generator(model)
    ids = generator.encode(prompt)
    if not ids:
        raise ConfigError("prompt= is empty: give at least one character")
    if max(ids) >= generator.vocab_size:
        raise ConfigError(f"the prompt has bytes >= the model's vocab_size={generator.vocab_size}: byte-level "
                          "prompts need vocab_size >= 256")
    if generator.hf:
        tokens = _hf_generate(generator.model, ids, max_new_tokens, temperature, top_k, top_p, stop, seed)
    else:
        tokens = generator.model.generate(
            torch.tensor([ids]), max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            stop_token=stop, generator=torch.Generator().manual_seed(seed))[0, len(ids):].tolist()
    if stop is not None and stop in tokens:
        tokens = tokens[:tokens.index(stop) + 1]
    return generator.decode(tokens)


def _hf_generate(model, ids: list[int], max_new_tokens: int, temperature: float, top_k: int | None,
                 top_p: float | None, stop: int | None, seed: int) -> list[int]:
    """A Hugging Face model's own ``generate`` with the same settings: greedy at ``temperature=0``,
    else sampling (seeded through torch's global generator, which transformers draws from); it runs
    to ``max_new_tokens`` unless ``stop`` (not the config's end-of-sequence token, as the GPT's)."""
    import torch

    options = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens, eos_token_id=stop)
    if temperature > 0:
        options.update(temperature=temperature, top_k=top_k or 0, top_p=top_p if top_p is not None else 1.0)
    pad = model.generation_config.pad_token_id
    options["pad_token_id"] = pad if pad is not None else (stop if stop is not None else 0)
    torch.manual_seed(seed)
    with torch.no_grad():
        output = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                **options)
    return output[0, len(ids):].tolist()


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
                             args["top_p"], stop_token(args["stop"], model.tokenizer), args["seed"])
    except (ConfigError, FileNotFoundError) as error:
        print(f"lightning-mhc-generate: {error}\n{USAGE}", file=sys.stderr)
        raise SystemExit(2) from None
    print(args["prompt"] + text)
    print(f"lightning-mhc-generate: loaded in {loaded - start:.2f} s, {len(text.encode())} bytes generated in "
          f"{time.perf_counter() - loaded:.2f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
