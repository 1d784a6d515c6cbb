"""1F1B step time against the ideal bubble, and stage-output deallocation, side by side.

    python benchmarks/pipeline_schedule.py [--steps 6]

For PP = 2 and PP = 4 (one spawned gloo group each, one thread per rank) and
m in {p, 2p, 4p} microbatches, times a training step (schedule + gradient
reduction + SGD) of an 8-layer mHC GPT (hidden 128, sequence 64,
micro-batch 2, n = 4, fp32). The per-microbatch steady-state time t is
estimated from the largest m as T(4p) / (4p + p - 1); the table compares
the measured T(m) / (m t) with the ideal 1F1B ratio (m + p - 1) / m. It also
reports stage 0's peak retained activation bytes (saved tensors plus the
tensors the schedule holds) with and without deallocation.

Caveat: with more ranks than cores the stages cannot all run at once, so
PP = 4 on a 2-core machine measures time-slicing, not the bubble.
Writes benchmarks/results/pipeline_schedule.json.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import time

import lightning_mhc  # noqa: F401  (before megatron: quiets its Transformer Engine notice)
from _harness import RESULTS, write_json

SEQ, MICRO_BATCH = 64, 2


def _stage_run(rank: int, world: int, args: argparse.Namespace) -> dict:
    import torch

    from lightning_mhc.model import MHCTransformerConfig
    from lightning_mhc.model.gpt import gpt_forward_step, gpt_loss_func
    from lightning_mhc.distributed.grads import finalize_model_grads
    from lightning_mhc.distributed.random import model_parallel_manual_seed
    from lightning_mhc.distributed.pipeline import ScheduleConfig, forward_backward_pipelining
    from lightning_mhc.model.stages import build_gpt_chunks
    from lightning_mhc.distributed.layout import ParallelLayout
    from lightning_mhc.recompute import ActivationMemoryMeter, RecomputePolicy, attach_recompute

    layout = ParallelLayout(1, world).build()
    model_parallel_manual_seed(0, layout)
    cfg = MHCTransformerConfig(
        num_layers=8, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512,
        vocab_size=256, max_sequence_length=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
    )
    (model,) = build_gpt_chunks(RecomputePolicy(args.policy).apply(cfg), layout)
    attach_recompute(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    shape = model.pipeline_tensor_shape(MICRO_BATCH, SEQ)

    def microbatches(m: int):
        data = torch.randint(0, 256, (m * MICRO_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(m))
        return [dict(tokens=c[:, :-1], labels=c[:, 1:]) for c in data.split(MICRO_BATCH)]

    def step(m: int, deallocate: bool = True, probe=None) -> float:
        torch.distributed.barrier()
        start = time.perf_counter()
        forward_backward_pipelining(model, microbatches(m), gpt_forward_step, gpt_loss_func, ScheduleConfig(
            layout, shape, deallocate_pipeline_outputs=deallocate, probe=probe))
        finalize_model_grads(model, layout)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        return time.perf_counter() - start

    p = world
    times = {}
    for m in (p, 2 * p, 4 * p):
        step(m)  # warm-up
        times[m] = statistics.median(step(m) for _ in range(args.steps))
    peaks = {}
    for deallocate in (False, True):
        peak = 0
        meter = ActivationMemoryMeter(model)

        def probe(held):
            nonlocal peak
            peak = max(peak, meter.live_bytes(extra=held))

        with meter:
            step(2 * p, deallocate, probe)
        peaks[deallocate] = peak
    return dict(stage=layout.pipeline_model_parallel_rank, times=times, peaks=peaks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--policy", default="none")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "pipeline_schedule.json")
    args = parser.parse_args()

    from lightning_mhc.testing.launch import spawn_ranks

    rows, memory = [], []
    for p in (2, 4):
        stage0 = spawn_ranks(_stage_run, p, args, timeout_s=1800)[0]
        times = stage0["times"]
        t_steady = times[4 * p] / (4 * p + p - 1)
        for m, t in sorted(times.items()):
            rows.append(dict(pp=p, microbatches=m, step_s=t, measured_ratio=t / (m * t_steady),
                             ideal_ratio=(m + p - 1) / m))
        kept, freed = stage0["peaks"][False], stage0["peaks"][True]
        memory.append(dict(pp=p, microbatches=2 * p, peak_bytes_kept=kept, peak_bytes_deallocated=freed,
                           saved_bytes=kept - freed,
                           output_bytes=SEQ * MICRO_BATCH * 4 * 128 * 4))

    print(f"1F1B step time, {os.cpu_count()} CPU cores, one thread per rank, policy {args.policy}")
    print(f"{'PP':>3} {'m':>3} {'step ms':>9} {'T/(m t)':>9} {'ideal (m+p-1)/m':>16}")
    for r in rows:
        print(f"{r['pp']:>3} {r['microbatches']:>3} {1e3 * r['step_s']:>9.1f} "
              f"{r['measured_ratio']:>9.3f} {r['ideal_ratio']:>16.3f}")
    print("stage 0 peak retained activation bytes (saved tensors + schedule-held tensors), m = 2p")
    print(f"{'PP':>3} {'kept':>12} {'deallocated':>12} {'saved':>12} {'saved / output':>15}")
    for r in memory:
        print(f"{r['pp']:>3} {r['peak_bytes_kept']:>12,d} {r['peak_bytes_deallocated']:>12,d} "
              f"{r['saved_bytes']:>12,d} {r['saved_bytes'] / r['output_bytes']:>15.2f}")
    write_json(args.out, dict(policy=args.policy, cpus=os.cpu_count(), rows=rows, memory=memory))


if __name__ == "__main__":
    main()
