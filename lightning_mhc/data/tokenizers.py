"""Tokenizers for training data: Hugging Face ``tokenizers`` (a ``tokenizer.json``) and bytes.

Both have what megatron-core's ``GPTDataset`` asks of a tokenizer (``vocab_size``, ``eod``; a
pad id where there is one) and what preprocessing needs (``tokenize`` to a list of ids). We wrap
``tokenizers.Tokenizer`` rather than megatron's Hugging Face tokenizer class because that one
loads through ``transformers`` (an optional extra here) and a tokenizer *name*; a user arrives with
a ``tokenizer.json`` file or a directory holding one.

    load_tokenizer("byte")                      # 256 byte values + an end-of-document id (256)
    load_tokenizer("sample")                    # the BPE the package ships (lightning_mhc.data.sample)
    load_tokenizer("runs/bpe/tokenizer.json")   # or the directory holding it
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from lightning_mhc.errors import ConfigError

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[EOS]", "<|eot_id|>", "<|im_end|>")
"""Tokens taken as the end-of-document token, in this order, when the tokenizer's directory has
no ``tokenizer_config.json`` naming its ``eos_token`` (GPT-2, Llama, Mistral, Gemma, … spellings)."""
PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")
BYTE = "byte"


def is_named(spec: str | Path) -> bool:
    """Whether ``spec`` names a tokenizer (``'byte'``, ``'sample'``) rather than a path."""
    from lightning_mhc.data.sample import SAMPLE

    return str(spec) in (BYTE, SAMPLE)


class ByteTokenizer:
    """Bytes of UTF-8 text as tokens 0-255; 256 ends a document (so the vocabulary is 257)."""

    name = BYTE
    vocab_size = 257
    eod = 256
    unique_identifiers = {"class": "ByteTokenizer"}  # megatron's datasets name their index caches by it

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` read from a ``tokenizer.json``; ``eod`` is the
    ``eos_token`` of a ``tokenizer_config.json`` beside it, else the first of ``EOD_CANDIDATES``
    in the vocabulary (None if none is: preprocessing with ``--append-eod`` is then refused)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        self.path = tokenizer_file(path)
        try:
            self._tokenizer = Tokenizer.from_file(str(self.path))
        except Exception as error:  # tokenizers raises a bare Exception on a malformed file
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise ConfigError(f"{str(self.path)!r} is not a Hugging Face tokenizer file ({reason}). Give the "
                              "tokenizer.json that tokenizers / transformers save (or the directory holding it).") from None
        self.name = str(self.path)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.unique_identifiers = {"class": "HFTokenizer", "tokenizer_path": [self.name], "vocab_size": self.vocab_size}
        self.eod = self._special(_config_token(self.path.parent, "eos_token"), EOD_CANDIDATES)
        self._pad = self._special(_config_token(self.path.parent, "pad_token"), PAD_CANDIDATES)

    @property
    def pad(self) -> int:
        """The pad id; AttributeError without one (megatron's datasets then use their own)."""
        if self._pad is None:
            raise AttributeError(f"the tokenizer {self.name!r} has no pad token")
        return self._pad

    def _special(self, named: str | None, candidates: tuple[str, ...]) -> int | None:
        for token in ([named] if named else []) + list(candidates):
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                return token_id
        return None

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


def tokenizer_file(path: str | Path) -> Path:
    """``path`` itself if it is a file, ``path/tokenizer.json`` if it is a directory."""
    path = Path(path).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise ConfigError(f"the tokenizer directory {str(path)!r} has no tokenizer.json. Give a tokenizer.json "
                              "file, or the directory a Hugging Face tokenizer was saved to.")
        return path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"tokenizer {str(path)!r}: no such file or directory. Give a tokenizer.json, the directory "
                          "holding one, or 'byte'.")
    return path


def _config_token(directory: Path, key: str) -> str | None:
    """A special token named in ``tokenizer_config.json`` (a string, or ``{"content": ...}``)."""
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        token = json.loads(config.read_text()).get(key)
    except (ValueError, OSError):
        return None
    return token.get("content") if isinstance(token, dict) else token


@functools.cache
def _load(spec: str) -> ByteTokenizer | HFTokenizer:
    return ByteTokenizer() if spec == BYTE else HFTokenizer(spec)


def load_tokenizer(spec: str | Path) -> ByteTokenizer | HFTokenizer:
    """``'byte'``, ``'sample'`` (the BPE the package ships), a ``tokenizer.json`` path, or a
    directory holding one (loaded once per process)."""
    from lightning_mhc.data.sample import resolve

    spec = resolve(spec, "tokenizer.json")
    return _load(spec if spec == BYTE else str(tokenizer_file(spec).resolve()))
