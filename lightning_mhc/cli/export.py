"""``lightning-mhc-export``: a checkpoint of any layout as one safetensors file and its config."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_mhc.errors import ConfigError


def export(path: Path, out: Path) -> dict:
    """The whole model of a checkpoint of any layout, written to ``out``: an ``MHCGPTModule``'s as
    one safetensors file and its config (``model/export.py``); a Hugging Face model's
    (``lightning-mhc-train model=hf``) as ``save_pretrained`` writes it, its hyper-connections and
    tokenizer beside it (``any_model/export.py``). Returns what was written."""
    import time

    from lightning_mhc.lightning import MHCGPTModule
    from lightning_mhc.model.export import save_exported

    start = time.perf_counter()
    hparams = _hyperparameters(path)
    if "model_dir" in hparams:
        written = _export_hf(path, hparams, out)
    else:
        written = save_exported(MHCGPTModule.load_from_checkpoint(path).model, out)
    return {**written, "seconds": time.perf_counter() - start}


def _hyperparameters(path: Path) -> dict:
    """The checkpoint's saved hyperparameters (a clear error for a missing or incomplete one)."""
    from lightning_mhc.checkpoint.format import read_metadata, read_trainer_state

    if not Path(path).is_dir():
        return {}  # MHCGPTModule.load_from_checkpoint names what it is
    read_metadata(Path(path))  # a clear error for a missing, incomplete or earlier-format checkpoint
    return read_trainer_state(Path(path)).get("hyper_parameters") or {}


def _export_hf(path: Path, hparams: dict, out: Path) -> dict:
    import shutil

    from lightning_mhc.lightning.modules.hf import HFCausalLMModule
    from lightning_mhc.any_model.export import export_pretrained

    written = export_pretrained(path, HFCausalLMModule.whole_model(hparams), out)
    tokenizer = Path(hparams["model_dir"]) / "tokenizer.json"
    if tokenizer.is_file():
        shutil.copy(tokenizer, Path(out) / "tokenizer.json")
    return dict(tensors=written["tensors"], bytes=written["bytes"], weights=str(out), config="config.json")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-mhc-export",
        description="Write the whole model of a lightning_mhc checkpoint (any layout): the mHC GPT's as one "
                    "safetensors file plus its config (JSON), loadable with lightning_mhc.load_exported(out); a Hugging "
                    "Face model's (model=hf) as save_pretrained writes it, loadable with from_pretrained, its "
                    "hyper-connections beside it (lightning_mhc.load_pretrained(out) rebuilds the mHC model).")
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
