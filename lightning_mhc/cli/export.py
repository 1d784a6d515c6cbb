"""``lightning-mhc-export``: a checkpoint of any layout as one safetensors file and its config."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_mhc.errors import ConfigError


def export(path: Path, out: Path) -> dict:
    """The whole model of an ``MHCGPTModule`` checkpoint of any layout, written to ``out``
    (``model/export.py``); returns what was written."""
    import time

    from lightning_mhc.lightning import MHCGPTModule
    from lightning_mhc.model.export import save_exported

    start = time.perf_counter()
    written = save_exported(MHCGPTModule.load_from_checkpoint(path).model, out)
    return {**written, "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-mhc-export",
        description="Write the whole model of a lightning_mhc checkpoint (any layout) as one safetensors file "
                    "plus its config (JSON), loadable with lightning_mhc.load_exported(out) in one process.")
    parser.add_argument("checkpoint", type=Path, help="a checkpoint directory (e.g. <run>/checkpoints/step-000050.ckpt)")
    parser.add_argument("out", type=Path, help="the directory to write model.safetensors and config.json into")
    args = parser.parse_args(argv)
    try:
        written = export(args.checkpoint, args.out)
    except (ConfigError, FileNotFoundError) as error:
        print(f"lightning-mhc-export: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"lightning-mhc-export: {written['tensors']} tensors, {written['bytes']:,} bytes -> {written['weights']} "
          f"(+ {written['config']}) in {written['seconds']:.2f} s")


if __name__ == "__main__":
    main()
