"""Peak host memory per rank while ``parallelize(weights=...)`` reads a Hugging Face checkpoint,
against the whole model's size and against ``from_pretrained`` in one process.

    python benchmarks/pretrained_loading.py [--hidden 512] [--layers 8] [--vocab 16384] [--out PATH]

A tied-head Llama is saved with ``save_pretrained`` (sharded, fp32). Then, each in fresh spawned
processes: TP 2 x PP 2 on 4 ranks, each building its part on the meta device and reading its
tensors and TP slices; and one process calling ``LlamaForCausalLM.from_pretrained``. Per process,
at the peak over the load (sampled every millisecond): the growth of the memory it allocated
(anonymous resident memory) and of the file pages it has mapped, next to the model's bytes.

Writes JSON (default ``benchmarks/results/pretrained_loading.json``).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import tempfile

import lightning_mhc  # noqa: F401  (before megatron: quiets its Transformer Engine notice)
from _harness import RESULTS, PeakGrowth, write_json

PLAN = {
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn.q_proj": "column", "model.layers.*.self_attn.k_proj": "column",
    "model.layers.*.self_attn.v_proj": "column", "model.layers.*.self_attn.o_proj": "row",
    "model.layers.*.mlp.gate_proj": "column", "model.layers.*.mlp.up_proj": "column",
    "model.layers.*.mlp.down_proj": "row", "lm_head": "column",
}


def _config(args: argparse.Namespace):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                       num_attention_heads=8, num_key_value_heads=4, vocab_size=args.vocab,
                       max_position_embeddings=128, tie_word_embeddings=True)


def _parallel_load(rank: int, world: int, args: argparse.Namespace, weights: str) -> dict:
    from transformers import LlamaForCausalLM

    from lightning_mhc.distributed.layout import ParallelLayout
    from lightning_mhc.any_model import parallelize, record_module_init

    layout = ParallelLayout(2, 2).build()
    with record_module_init():
        model = LlamaForCausalLM(_config(args))
    with PeakGrowth() as rss:
        part = parallelize(model, PLAN, layout=layout, weights=weights)
    return dict(rank=rank, anon_mib=rss.anon_mib, file_mib=rss.file_mib,
                part_mib=sum(p.numel() * p.element_size() for p in part.parameters()) / 2**20)


def _whole_load(rank: int, world: int, args: argparse.Namespace, weights: str) -> dict:
    from transformers import LlamaForCausalLM

    with PeakGrowth() as rss:
        model = LlamaForCausalLM.from_pretrained(weights)
    return dict(anon_mib=rss.anon_mib, file_mib=rss.file_mib,
                model_mib=sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "pretrained_loading.json")
    args = parser.parse_args()

    import torch
    from transformers import LlamaForCausalLM

    from lightning_mhc.testing.launch import spawn_ranks

    with tempfile.TemporaryDirectory() as tmp:
        weights = str(pathlib.Path(tmp) / "llama")
        torch.manual_seed(0)
        LlamaForCausalLM(_config(args)).save_pretrained(weights, max_shard_size="16MB")
        files = sorted(pathlib.Path(weights).glob("*.safetensors"))
        file_mib = sum(f.stat().st_size for f in files) / 2**20
        parallel = spawn_ranks(_parallel_load, 4, args, weights, timeout_s=900)
        (whole,) = spawn_ranks(_whole_load, 1, args, weights, timeout_s=900)
    print(f"tied Llama: hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}: {whole['model_mib']:.1f} MiB "
          f"of fp32 weights in {len(files)} safetensors files ({file_mib:.1f} MiB); {os.cpu_count()} cores")
    print(f"{'process':<28} {'its part MiB':>13} {'allocated MiB':>14} {'/ whole':>8} {'file pages MiB':>15}")
    for name, r in [(f"TP 2 x PP 2, rank {r['rank']}", r) for r in parallel] + [("from_pretrained, 1 process", whole)]:
        part = r.get("part_mib", whole["model_mib"])
        print(f"{name:<28} {part:>13.1f} {r['anon_mib']:>14.1f} {r['anon_mib'] / whole['model_mib']:>8.3f} "
              f"{r['file_mib']:>15.1f}")
    write_json(args.out, dict(cpus=os.cpu_count(), hidden=args.hidden, layers=args.layers, vocab=args.vocab,
                              files=len(files), file_mib=file_mib, parallel=parallel, whole=whole))


if __name__ == "__main__":
    main()
