"""Whether bytes are text: the one check behind ``data=text``'s preflight and ``lightning-mhc-preprocess``."""
from __future__ import annotations

import codecs


def text_problem(raw: bytes, final: bool = True) -> str | None:
    """Why ``raw`` is not UTF-8 text (a NUL byte, an invalid sequence), or None. ``final=False``:
    ``raw`` is the start of a longer file, so a sequence cut at its end is not an error."""
    nul = raw.find(b"\0")
    if nul >= 0:
        return f"holds a NUL byte (offset {nul}): it is binary, not text"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(raw, final=final)
    except UnicodeDecodeError as error:
        return f"is not UTF-8 text (byte {error.start}: {error.reason})"
    return None
