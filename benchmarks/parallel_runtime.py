"""Interleaved 1F1B against 1F1B at PP = 2, and the overlapped DP gradient reduction at DP = 2.

    python benchmarks/parallel_runtime.py [--rounds 8] [--out PATH]

Model: 8 layers, hidden 128, sequence 64, micro-batch 2, n = 4, fp32, recompute
none. A step is the schedule (forward + backward of m microbatches), gradient
reduction and an SGD step, timed between barriers; variants run round-robin in
one spawned gloo group (one thread per rank), medians of ``--rounds``.

- bubble (2 ranks, PP = 2): one model chunk per stage (1F1B) and two (interleaved,
  v = 2) for m in {2, 4, 8}; the ratio T(v=2) / T(v=1) next to the ideal one,
  ``(m + (p-1)/v) / (m + p - 1)`` (bubble fractions ``(p-1)/(v m)`` and ``(p-1)/m``).
  The interleaved schedule sends v times as many activations; on a CPU with gloo
  that cost is not small against a tiny stage.
- overlap (2 ranks, DP = 2, m = 2): DP all-reduce after backward against
  started bucket by bucket during the last backward (25 MiB and 64 KiB buckets).

Writes JSON and a PNG (default ``benchmarks/results/parallel_runtime.json``).
"""
from __future__ import annotations

import argparse
import os
import pathlib

import lightning_mhc  # noqa: F401  (before megatron: quiets its Transformer Engine notice)
from _harness import RESULTS, interleaved_times, median, pyplot, save_figure, write_json

SEQ, MICRO_BATCH, LAYERS, HIDDEN = 64, 2, 8, 128
MICROBATCHES = (2, 4, 8)


def _setup(pp: int, v: int):
    import torch

    from lightning_mhc.model import MHCTransformerConfig
    from lightning_mhc.model.config import with_parallel_layout
    from lightning_mhc.model.stages import build_gpt_chunks
    from lightning_mhc.distributed.layout import ParallelLayout

    layout = ParallelLayout(1, pp, v).build()
    cfg = MHCTransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=4 * HIDDEN,
                               vocab_size=256, max_sequence_length=SEQ, hidden_dropout=0.0, attention_dropout=0.0)
    cfg = with_parallel_layout(cfg, layout)
    chunks = build_gpt_chunks(cfg, layout)
    optimizer = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=1e-3)
    return layout, chunks, optimizer


def _microbatches(m: int):
    import torch

    data = torch.randint(0, 256, (m * MICRO_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(m))
    return [dict(tokens=c[:, :-1], labels=c[:, 1:]) for c in data.split(MICRO_BATCH)]


def _step(layout, chunks, optimizer, m: int, reducer=None):
    import torch.distributed as dist

    from lightning_mhc.model.gpt import gpt_forward_step, gpt_loss_func
    from lightning_mhc.distributed.grads import finalize_model_grads
    from lightning_mhc.distributed.pipeline import ScheduleConfig, forward_backward_pipelining

    def run() -> None:
        dist.barrier()
        forward_backward_pipelining(chunks, _microbatches(m), gpt_forward_step, gpt_loss_func, ScheduleConfig(
            layout, chunks[0].pipeline_tensor_shape(MICRO_BATCH, SEQ),
            on_last_backward=reducer.start if reducer is not None else None))
        finalize_model_grads(chunks, layout, overlapped=reducer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()

    return run


def _run(rank: int, world: int, args: argparse.Namespace) -> dict:
    import torch

    from lightning_mhc.distributed.grad_overlap import OverlappedGradReduction
    from lightning_mhc.distributed.random import model_parallel_manual_seed
    from lightning_mhc.distributed.layout import ParallelLayout, destroy_parallel

    torch.set_num_threads(1)
    result = {}
    model_parallel_manual_seed(0, ParallelLayout(1, 2).build())
    models = {v: _setup(2, v) for v in (1, 2)}
    steps = {f"v{v}/m{m}": _step(*models[v], m) for m in MICROBATCHES for v in (1, 2)}
    result["bubble"] = interleaved_times(steps, args.rounds)
    destroy_parallel()

    model_parallel_manual_seed(0, ParallelLayout().build())  # DP = 2
    layout, chunks, optimizer = _setup(1, 1)
    steps = {"after backward": _step(layout, chunks, optimizer, 2)}
    for label, size in (("overlapped, 25 MiB buckets", 25 * 2**20), ("overlapped, 64 KiB buckets", 2**16)):
        steps[label] = _step(layout, chunks, optimizer, 2, OverlappedGradReduction(chunks, layout, size))
    result["overlap"] = interleaved_times(steps, args.rounds)
    destroy_parallel()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "parallel_runtime.json")
    args = parser.parse_args()

    from lightning_mhc.testing.launch import spawn_ranks

    times = spawn_ranks(_run, 2, args, timeout_s=1800)[0]
    p = 2
    bubble = []
    for m in MICROBATCHES:
        t1, t2 = median(times["bubble"][f"v1/m{m}"]), median(times["bubble"][f"v2/m{m}"])
        bubble.append(dict(microbatches=m, step_s_v1=t1, step_s_v2=t2, measured_ratio=t2 / t1,
                           ideal_ratio=(m + (p - 1) / 2) / (m + p - 1),
                           bubble_v1=(p - 1) / m, bubble_v2=(p - 1) / (2 * m)))
    base = median(times["overlap"]["after backward"])
    overlap = [dict(variant=k, step_s=median(v), vs_after_backward=median(v) / base) for k, v in times["overlap"].items()]

    print(f"PP = 2, 8 layers, hidden {HIDDEN}, seq {SEQ}, micro-batch {MICRO_BATCH}, {os.cpu_count()} cores, "
          f"1 thread per rank, medians of {args.rounds} interleaved rounds")
    print(f"{'m':>3} {'1F1B ms':>9} {'v=2 ms':>9} {'v2/v1':>7} {'ideal':>7} {'bubble v1':>10} {'bubble v2':>10}")
    for r in bubble:
        print(f"{r['microbatches']:>3} {1e3 * r['step_s_v1']:>9.1f} {1e3 * r['step_s_v2']:>9.1f} "
              f"{r['measured_ratio']:>7.3f} {r['ideal_ratio']:>7.3f} {r['bubble_v1']:>10.3f} {r['bubble_v2']:>10.3f}")
    print("DP = 2, m = 2: gradient reduction")
    for r in overlap:
        print(f"  {r['variant']:<28} {1e3 * r['step_s']:8.1f} ms  x{r['vs_after_backward']:.3f}")
    write_json(args.out, dict(cpus=os.cpu_count(), rounds=args.rounds, bubble=bubble, overlap=overlap, times=times))
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        ms = [r["microbatches"] for r in bubble]
        ax.plot(ms, [r["measured_ratio"] for r in bubble], "o-", label="measured T(v=2) / T(v=1)")
        ax.plot(ms, [r["ideal_ratio"] for r in bubble], "s--", label="ideal (m + (p-1)/v) / (m + p - 1)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("microbatches m (PP = 2)")
        ax.set_ylabel("step time, interleaved / 1F1B")
        ax.set_xticks(ms)
        ax.legend(fontsize=8)
        save_figure(fig, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
