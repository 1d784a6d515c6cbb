"""In a fresh process, without the strategy: the export and load_from_checkpoint of a checkpoint
give the training layout's logits, and greedy generation equals the argmax of full forwards.

    python check_export.py <checkpoint dir> <export dir> <logits.pt> <result.json>
"""
from __future__ import annotations

import json
import sys

import torch

from lightning_mhc import MHCGPTModule
from lightning_mhc.model.export import load_exported


def main() -> None:
    checkpoint, export_dir, logits_file, out = sys.argv[1:5]
    reference = torch.load(logits_file)
    tokens, expected = reference["tokens"], reference["logits"]
    exported = load_exported(export_dir)
    module = MHCGPTModule.load_from_checkpoint(checkpoint)
    with torch.no_grad():
        from_export = exported(tokens)
        from_checkpoint = module.model(tokens)
    prompt, tokens_out = tokens[:2, :6], tokens[:2, :6]
    with torch.no_grad():
        for _ in range(8):
            tokens_out = torch.cat([tokens_out, exported(tokens_out)[:, -1, :exported.config.vocab_size].argmax(-1, keepdim=True)], 1)
    generated = exported.generate(prompt, max_new_tokens=8)
    result = dict(
        export_vs_training=(from_export - expected).abs().max().item(),
        checkpoint_vs_training=(from_checkpoint - expected).abs().max().item(),
        generate_equals_argmax=bool(torch.equal(generated, tokens_out)),
        shape=list(from_export.shape),
    )
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
