"""The planner's answers for published shapes, on paper (docs/planning.md, "On paper, at scale"):
a Llama-3-70B-shaped mHC GPT on 64 devices of 80 GB under each recompute policy, what each policy
and stream count costs on one layout of it, the layouts of Megatron-Bridge's and torchtitan's
Llama-3-70B recipes in our model's form, and ``gpt_125m`` on 8 devices.

    python benchmarks/planning_at_scale.py     # benchmarks/results/planning_at_scale.json (+ .png with matplotlib)
    python benchmarks/figures.py --collect     # kept in docs/benchmarks/, docs/planning.md's tables rewritten

Every figure is ``lightning-mhc-plan``'s (``lightning_mhc.cli.plan.plan``, the command's own
function, called with the command line the page shows); nothing is measured, so the file is the
same on every run of the same code: tests/test_planning_at_scale.py holds it to a fresh plan.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import pathlib
import time

import lightning_mhc  # noqa: F401  (before megatron: quiets its Transformer Engine notice)
from _harness import RESULTS, pyplot, save_figure, write_json

POLICIES = ("none", "selective", "mhc_block", "full")
STREAMS = (1, 2, 4, 8)
LLAMA = ("model=llama3_70b", "data=synthetic", "data.seq_length=8192", "data.micro_batch_size=1",
         "trainer.precision=bf16-true", "optim.use_distributed_optimizer=true")
"""Llama-3-70B's shape (model=llama3_70b, n = 4) at sequence 8192, micro-batch 1, bf16 weights with
fp32 gradients, moments and main weights sharded over DP (ZeRO-1): Megatron's bf16 recipe's states."""
TP8_PP8 = ("parallel.tensor_model_parallel_size=8", "parallel.pipeline_model_parallel_size=8",
           "parallel.sequence_parallel=true", "trainer.devices=64", "data.global_batch_size=512")
"""The fixed layout of the streams table: TP 8 (with SP) x PP 8 x DP 1, 512 sequences a step."""
MEMORY = "80GB"


def _streams(n: int) -> tuple[str, ...]:
    return (("model.enable_hyper_connections=false", "model.num_residual_streams=1") if n == 1
            else (f"model.num_residual_streams={n}",))


QUESTIONS = {
    # the 70B shape on 64 devices, each policy: every TP x PP x DP layout (SP wherever TP > 1) that fits
    **{f"llama3_70b_{policy}": (*LLAMA, *TP8_PP8, f"recompute={policy}", "plan.devices=64",
                                f"plan.device_memory={MEMORY}", "plan.top=5") for policy in POLICIES},
    # Megatron-Bridge's llama3_70b pretrain recipe: TP 4, PP 4 (virtual 5), CP 2, SP, micro-batch 1,
    # global batch 512, sequence 8192, the distributed optimizer; its file sets no recompute, the
    # published layout is planned under selective; also without CP, to show what CP's split saves
    **{f"megatron_bridge_n{n}": (*LLAMA, *_streams(n), "parallel.tensor_model_parallel_size=4",
                                 "parallel.pipeline_model_parallel_size=4",
                                 "parallel.virtual_pipeline_model_parallel_size=5", "parallel.context_parallel_size=2",
                                 "parallel.sequence_parallel=true", "trainer.devices=64",
                                 "data.global_batch_size=512", "recompute=selective")
       for n in (1, 4)},
    **{f"megatron_bridge_cp1_n{n}": (*LLAMA, *_streams(n), "parallel.tensor_model_parallel_size=4",
                                     "parallel.pipeline_model_parallel_size=4",
                                     "parallel.virtual_pipeline_model_parallel_size=5", "parallel.sequence_parallel=true",
                                     "trainer.devices=64", "data.global_batch_size=512", "recompute=selective")
       for n in (1, 4)},
    # torchtitan's llama3_70b.toml: TP 8 (its TP shards the sequence too), FSDP over the other 8,
    # local batch 8 of 8192 tokens, full activation checkpointing; our nearest to FSDP is ZeRO-1
    **{f"torchtitan_n{n}": (*LLAMA, *_streams(n), "parallel.tensor_model_parallel_size=8",
                            "parallel.sequence_parallel=true", "trainer.devices=64", "data.micro_batch_size=8",
                            "data.global_batch_size=64", "recompute=full") for n in (1, 4)},
    "gpt_125m": ("model=gpt_125m", "plan.devices=8", f"plan.device_memory={MEMORY}"),
}
"""Each question's command line (``lightning-mhc-plan`` + these arguments)."""


def _row(row: dict) -> dict:
    """What the page cites of one layout: its sizes, the most loaded rank's bytes, the bubble, the bytes sent."""
    sent = row["traffic_bytes"]
    return dict(sizes=row["sizes"], most_loaded_stage=row["most_loaded_stage"],
                **{k: row[k] for k in ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "activation_bytes",
                                       "total_bytes", "activations_not_counted", "bubble", "traffic_not_counted")},
                sent_bytes=None if sent is None else sum(sent.values()))


def ask(args: tuple[str, ...]) -> dict:
    """One command's answer: the asked layout, and (with ``plan.devices``) the layouts that fit, best first."""
    from lightning_mhc.cli.plan import plan

    with contextlib.redirect_stdout(io.StringIO()):
        rows = plan(list(args))
    return dict(command="lightning-mhc-plan " + " ".join(args), asked=_row(rows[0]),
                fitting_count=len(rows) - 1 if any(a.startswith("plan.devices=") for a in args) else None,
                fitting=[_row(r) for r in rows[1:]])


def streams_table() -> list[dict]:
    """Each policy and stream count on the fixed layout (TP 8 x PP 8): the most loaded rank's bytes
    (``mhc_block`` needs streams: not at n = 1)."""
    rows = []
    for policy in POLICIES:
        for n in STREAMS[1:] if policy == "mhc_block" else STREAMS:
            answer = ask((*LLAMA, *_streams(n), *TP8_PP8, f"recompute={policy}"))
            rows.append(dict(policy=policy, streams=n, command=answer["command"], **answer["asked"]))
    return rows


def answers() -> dict:
    """Every figure the page cites, planned afresh (deterministic: the same code gives the same file)."""
    top = {}
    for name, args in QUESTIONS.items():
        answer = ask(args)
        if answer["fitting_count"] is not None:  # the page cites the best few; the count says how many fit
            answer["fitting"] = answer["fitting"][:5]
        top[name] = answer
    return dict(device_memory=MEMORY, questions=top, streams=streams_table())


def _plot(result: dict, path: pathlib.Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for policy in POLICIES:
        rows = [r for r in result["streams"] if r["policy"] == policy]
        ax.plot([r["streams"] for r in rows], [r["total_bytes"] / 1e9 for r in rows], marker="o", label=policy)
    ax.axhline(80, color="gray", linestyle="--", linewidth=0.8)
    ax.text(1, 84, "80 GB", color="gray", fontsize=8)
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_yticks([20, 40, 80, 160, 320])
    ax.set_xscale("log", base=2)
    ax.set_xticks(STREAMS, [str(n) for n in STREAMS])
    ax.set_xlabel("residual streams n")
    ax.set_ylabel("most loaded rank (GB, planned)")
    ax.set_title("Llama-3-70B shape, TP 8 (SP) x PP 8, seq 8192, bf16, ZeRO-1", fontsize=9)
    ax.legend(title="recompute")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "planning_at_scale.json")
    args = parser.parse_args()
    start = time.perf_counter()
    result = answers()
    print(f"{len(QUESTIONS) + len(result['streams'])} plans in {time.perf_counter() - start:.1f} s")
    write_json(args.out, result)
    _plot(result, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
