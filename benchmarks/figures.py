"""The README's headline figures and docs/benchmarks.md's tables of the benchmarks it cites, and
docs/planning.md's tables of the planner's answers at scale, written from the result files those
benchmarks wrote, never by hand.

    python benchmarks/figures.py              # both rewritten from docs/benchmarks/NAME.json
    python benchmarks/figures.py --collect    # first copy each cited benchmark's newest result
                                              # (benchmarks/results/NAME.json, its plot) into docs/benchmarks/
    python benchmarks/figures.py --check      # exit 1 if either is not what the files say

The cited benchmarks (``CITED``) are run with the commands docs/benchmarks.md gives; each result
file carries where and on what commit it was taken (``measured``), and the headline says so. The
planned ones (``PLANNED``) come from the planner, not a measurement: tests/test_planning_at_scale.py
holds their file to a fresh plan. ``tests/test_figures.py`` holds the pages to these files.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
KEPT = ROOT / "docs" / "benchmarks"
"""Where the result files the headline cites are kept (benchmarks/results/ is not committed)."""
MARKER = "<!-- figures: {name}, written by benchmarks/figures.py from docs/benchmarks/*.json -->"
END = "<!-- /figures -->"
CITED = ("recompute_memory", "mhc_overhead", "mhc_sublayer", "pipeline_schedule", "checkpoint_io",
         "distributed_optimizer", "byom_vs_model_parallel")
"""The benchmarks whose result files the headline reads, as ``benchmarks/NAME.py`` writes them."""
PLANNED = ("planning_at_scale",)
"""Result files of the planner's answers (``benchmarks/NAME.py`` plans, measures nothing): their pages'
tables are written from them, the headline does not cite them."""


def load(directory: pathlib.Path = KEPT) -> dict[str, dict]:
    """Each cited benchmark's result file in ``directory``; one that is missing or was taken
    without its provenance is refused in one line."""
    results = {}
    for name in CITED + PLANNED:
        path = directory / f"{name}.json"
        if not path.is_file():
            raise SystemExit(f"figures: {path} is missing: run python benchmarks/{name}.py, then --collect")
        results[name] = json.loads(path.read_text())
        if not (results[name].get("measured") or {}).get("commit"):
            raise SystemExit(f"figures: {path} does not say on what commit it was taken: run it again")
    return results


def _row(rows: list[dict], **match) -> dict:
    return next(r for r in rows if all(r[k] == v for k, v in match.items()))


def _range(values: list[float], fmt: str) -> str:
    low, high = min(values), max(values)
    return f"{low:{fmt}}" if f"{low:{fmt}}" == f"{high:{fmt}}" else f"{low:{fmt}} to {high:{fmt}}"


def _recompute(r: dict) -> str:
    block = _row(r["rows"], label="mhc_block")
    return (f"- `mhc_block` keeps {block['bytes_ratio_vs_none']:.3f} of `none`'s activations, "
            f"{'less' if block['bytes_ratio_vs_no_hc'] < 1 else 'more'} than the same model without mHC "
            f"({block['bytes_ratio_vs_no_hc']:.3f}) ([recompute](docs/benchmarks.md#recompute-policies)).")


def _fused(overhead: dict, sublayer: dict) -> str:
    def hc_vs_no_hc(hidden: str, impl: str) -> float:
        row = overhead["table"][hidden]
        return row[f"{impl}/none"]["median_step_s"] / row["no_hc"]["median_step_s"]

    widths = sorted(overhead["table"], key=int)
    small, large = widths[0], widths[-1]
    peer = [row["hyper-connections"]["median_s"] / row["fused"]["median_s"] for row in sublayer["table"].values()]
    return (f"- The fused hyper-connection: a step with mHC at {hc_vs_no_hc(small, 'fused'):.2f}x the model "
            f"without it at C = {small} (op by op: {hc_vs_no_hc(small, 'reference'):.2f}x) and "
            f"{hc_vs_no_hc(large, 'fused'):.2f}x at C = {large}; one sub-layer {_range(peer, '.2f')}x "
            f"faster than the `hyper-connections` package ([fast mHC](docs/benchmarks.md#fast-mhc)).")


def _pipeline(r: dict) -> str:
    row = _row(r["rows"], pp=2, microbatches=4)
    saved = [f"{m['saved_bytes'] / m['output_bytes']:.2f} stage outputs at PP {m['pp']}" for m in r["memory"]]
    return (f"- 1F1B at PP 2: step time {row['measured_ratio']:.3f}x the steady state at m = 4 (ideal "
            f"{row['ideal_ratio']:.3f}); output deallocation saves stage 0 {' and '.join(saved)} "
            "([parallel runtime](docs/benchmarks.md#parallel-runtime)).")


def _checkpoints(r: dict) -> str:
    saves = [row["save_s"] for row in r["layouts"]]
    return ("- A TP 2 x PP 2 checkpoint continued on PP 2 x DP 2, PP 4, TP 2 x SP x PP 2 x v 2, TP 2 and one "
            "process equals the run continued where it was saved within 1e-5 (`tests/test_checkpoint_reshard.py`); "
            f"the `{r['model']}` model saves in {_range(saves, '.2f')} s on "
            f"{', '.join(LAYOUT_LABELS.get(row['layout'], row['layout']) for row in r['layouts'])} "
            "([checkpoints](docs/benchmarks.md#checkpoint-save-and-load)).")


def _distributed_optimizer(r: dict) -> str:
    sharded = [row for row in r["rows"] if row["optimizer"] == "distributed" and row["dp"] > 1]
    off = max(abs(row["state_vs_ideal"] - 1) for row in sharded)
    steps = [row["step_vs_adamw"] for row in sharded]
    return (f"- The distributed optimizer: AdamW's state per rank at 1/DP of the whole within {100 * off:.2g} % "
            f"on DP {' and '.join(str(row['dp']) for row in sharded)}, step time {_range(steps, '.2f')}x "
            "AdamW's ([distributed optimizer](docs/benchmarks.md#the-distributed-optimizer)).")


def _byom(r: dict) -> str:
    lines, ratio = r["user_lines"], r["ratios"]["step_time_ours_vs_lightning"]
    return (f"- A Hugging Face Llama under our TP 2 against Lightning's `ModelParallelStrategy`: {lines['ours']} "
            f"user lines against {lines['lightning']}, our step time {ratio:.2f}x its ([bring your own model]"
            "(docs/benchmarks.md#bring-your-own-model-against-modelparallelstrategy)).")


GPU = ("- GPU: none yet (no GPU has been lent to this project). `make gpu-check` runs the GPU test set, the "
       "benchmark against Megatron-LM's mHC and a training run in one 540 s budget "
       "([GPU](docs/benchmarks.md#mhc-on-the-gpu)).")


def headline(results: dict[str, dict]) -> str:
    """The README's headline list from the cited result files."""
    results = {name: results[name] for name in CITED}
    dates = sorted({r["measured"]["date"] for r in results.values()})
    commits = sorted({r["measured"]["commit"] for r in results.values()})
    cpus = sorted({r["measured"]["cpus"] for r in results.values()})
    bullets = [_recompute(results["recompute_memory"]), _fused(results["mhc_overhead"], results["mhc_sublayer"]), GPU,
               _pipeline(results["pipeline_schedule"]), _checkpoints(results["checkpoint_io"]),
               _distributed_optimizer(results["distributed_optimizer"]), _byom(results["byom_vs_model_parallel"])]
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    head = (f"{'/'.join(map(str, cpus))}-core CPU, gloo; taken on {when} at commit{'s' if len(commits) > 1 else ''} "
            f"{', '.join(commits)}; the commands, full tables and plots are in "
            "[docs/benchmarks.md](docs/benchmarks.md).")
    return "\n".join([head, "", *bullets])


# ------------------------------------------------------------------ docs/benchmarks.md's tables
def _table(header: list[str], align: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|",
                      *("| " + " | ".join(row) + " |" for row in rows)])


POLICY_LABELS = {"none": "`none`", "selective": "`selective`", "mhc_block": "`mhc_block`", "full": "`full`",
                 "no_hc_none": "no mHC, `none`"}


def recompute_table(results: dict[str, dict]) -> str:
    rows = [[POLICY_LABELS.get(r["label"], r["label"]), f"{r['retained_bytes']:,}", f"{r['bytes_ratio_vs_none']:.3f}",
             f"{r['bytes_ratio_vs_no_hc']:.3f}", f"{r['step_time_ratio_vs_none']:.3f}"]
            for r in results["recompute_memory"]["rows"]]
    return _table(["policy", "retained bytes", "vs `none`", "vs no mHC", "step time vs `none`"],
                  ["---", "---:", "---:", "---:", "---:"], rows)


def overhead_table(results: dict[str, dict]) -> str:
    rows = []
    for hidden, row in sorted(results["mhc_overhead"]["table"].items(), key=lambda item: int(item[0])):
        t = {k: v["median_step_s"] for k, v in row.items() if "median_step_s" in v}
        b = {k: v["retained_bytes"] for k, v in row.items() if "retained_bytes" in v}
        for impl in ("reference", "fused"):
            bold = "**{}**" if impl == "fused" else "{}"
            rows.append([hidden, impl, bold.format(f"{t[f'{impl}/none'] / t['no_hc']:.2f}"),
                         f"{t[f'{impl}/mhc_block'] / t[f'{impl}/none']:.2f}",
                         bold.format(f"{b[f'{impl}/none'] / b['no_hc']:.2f}"),
                         f"{b[f'{impl}/mhc_block'] / b['no_hc']:.2f}"])
    return _table(["C", "impl", "step time HC / no HC (`none`)", "`mhc_block` / `none`",
                   "retained bytes HC / no HC (`none`)", "`mhc_block` bytes / no HC"],
                  ["---", "---", "---:", "---:", "---:", "---:"], rows)


def sublayer_table(results: dict[str, dict]) -> str:
    rows = []
    for hidden, row in sorted(results["mhc_sublayer"]["table"].items(), key=lambda item: int(item[0])):
        impls = ("reference", "fused", "hyper-connections")
        rows.append([hidden, *(f"{1e3 * row[i]['median_s']:.1f}" for i in impls),
                     f"{row['hyper-connections']['median_s'] / row['fused']['median_s']:.2f}",
                     *(f"{row[i]['saved_bytes_per_token']:,.0f}" for i in impls)])
    return _table(["C", "reference ms", "fused ms", "hyper-connections ms", "its time / fused",
                   "saved B/token: reference", "fused", "hyper-connections"],
                  ["---", "---:", "---:", "---:", "---:", "---:", "---:", "---:"], rows)


def pipeline_table(results: dict[str, dict]) -> str:
    rows = [[str(r["pp"]), str(r["microbatches"]), f"{1e3 * r['step_s']:.1f}", f"{r['measured_ratio']:.3f}",
             f"{r['ideal_ratio']:.3f}"] for r in results["pipeline_schedule"]["rows"]]
    return _table(["PP", "m", "step ms", "measured T/(m t)", "ideal (m+p-1)/m"],
                  ["---:", "---:", "---:", "---:", "---:"], rows)


def pipeline_memory_table(results: dict[str, dict]) -> str:
    rows = [[str(r["pp"]), str(r["microbatches"]), f"{r['peak_bytes_kept']:,}", f"{r['peak_bytes_deallocated']:,}",
             f"{r['saved_bytes']:,} ({r['saved_bytes'] / r['output_bytes']:.2f})"]
            for r in results["pipeline_schedule"]["memory"]]
    return _table(["PP", "m", "peak bytes, outputs kept", "deallocated", "saved (stage outputs)"],
                  ["---:", "---:", "---:", "---:", "---:"], rows)


LAYOUT_LABELS = {"1": "one process", "dp2": "DP 2", "tp2": "TP 2", "pp2": "PP 2", "tp2pp2": "TP 2 x PP 2"}


def checkpoint_table(results: dict[str, dict]) -> str:
    rows = [[LAYOUT_LABELS.get(r["layout"], r["layout"]), str(r["devices"]), f"{r['bytes']:,}", str(r["files"]),
             f"{r['save_s']:.2f}", f"{r['load_s']:.2f}"] for r in results["checkpoint_io"]["layouts"]]
    return _table(["layout", "ranks", "bytes", "files", "save s", "load s"], ["---"] * 6, rows)


def distributed_optimizer_table(results: dict[str, dict]) -> str:
    mib = 1 << 20
    rows = []
    for r in results["distributed_optimizer"]["rows"]:
        m = r["max_rank"]
        ideal = "-" if r["state_vs_ideal"] is None else f"{r['state_vs_ideal']:.4f}"
        rows.append([str(r["dp"]), r["optimizer"], *(f"{m[k] / mib:.2f}" for k in
                     ("weights", "gradients", "optimizer_state", "activations", "total")),
                     ideal, f"{1e3 * r['step_s']:.1f}", f"{r['step_vs_adamw']:.3f}"])
    return _table(["DP", "optimizer", "weights MiB", "gradients MiB", "state MiB", "activations MiB", "total MiB",
                   "state / ideal (AdamW's / DP)", "step ms", "vs AdamW"],
                  ["---:", "---", *["---:"] * 8], rows)


def distributed_optimizer_peak_table(results: dict[str, dict]) -> str:
    largest = results["distributed_optimizer"]["peak_resident_mib"]["largest"]
    rows = [[label, f"{largest['AdamW'][key]:.1f} MiB", f"{largest['distributed'][key]:.1f} MiB",
             f"{largest['distributed'][key] / largest['AdamW'][key]:.3f}"]
            for label, key in (("steps 2 to 4 (the optimizer's state exists)", "steady"),
                               ("first step (no state before its update)", "first_step"))]
    return _table(["", "AdamW", "distributed", "ratio"], ["---", "---:", "---:", "---:"], rows)


# ------------------------------------------------------------------ docs/planning.md's answers at scale
def _layout(row: dict) -> str:
    s = row["sizes"]
    parts = [f"TP {s['tensor']}" + (" (SP)" if s["sequence_parallel"] else ""),
             f"PP {s['pipeline']}" + (f" (v {s['virtual']})" if s["virtual"] > 1 else "")]
    parts += [f"CP {s['context']}"] if s["context"] > 1 else []
    return " x ".join(parts + [f"DP {s['data']}"]) + f", m {s['microbatches']}"


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def _states(row: dict) -> int:
    return row["parameter_bytes"] + row["gradient_bytes"] + row["optimizer_bytes"]


def _commands(*commands: str) -> str:
    return "\n".join(["```bash", *commands, "```"])


def planning_llama3_70b(results: dict[str, dict]) -> str:
    r = results["planning_at_scale"]
    rows, commands = [], []
    for policy in ("none", "selective", "mhc_block", "full"):
        q = r["questions"][f"llama3_70b_{policy}"]
        commands.append(q["command"])
        for rank, row in enumerate(q["fitting"][:3]) if q["fitting"] else [(None, q["asked"])]:
            rows.append([f"`{policy}`" if rank in (0, None) else "",
                         str(q["fitting_count"]) if rank in (0, None) else "",
                         _layout(row) + ("" if rank is not None else " (asked; does not fit)"),
                         f"**{_gb(row['total_bytes'])}**", _gb(_states(row)), _gb(row["activation_bytes"]),
                         f"{row['bubble']:.3f}"])
    table = _table(["policy", f"layouts of 64 that fit {r['device_memory']}", "layout (best first)",
                    "most loaded rank GB", "model states GB", "activations GB", "bubble"],
                   ["---", "---:", "---", "---:", "---:", "---:", "---:"], rows)
    return table + "\n\n" + _commands(*commands)


def planning_streams(results: dict[str, dict]) -> str:
    r = results["planning_at_scale"]
    policies = ("none", "selective", "mhc_block", "full")
    cell = {(row["policy"], row["streams"]): row for row in r["streams"]}
    rows = []
    for n in sorted({row["streams"] for row in r["streams"]}):
        rows.append([str(n), *(f"{_gb(cell[p, n]['total_bytes'])} ({_gb(cell[p, n]['activation_bytes'])})"
                               if (p, n) in cell else "- (needs streams)" for p in policies)])
    table = _table(["n", *(f"`{p}`" for p in policies)], ["---:"] * 5, rows)
    return table + "\n\n" + _commands(cell["full", 4]["command"])


RECIPES = (("megatron_bridge", "Megatron-Bridge `llama3_70b` pretrain (TP 4, PP 4, v 5, CP 2, SP; `selective`)"),
           ("megatron_bridge_cp1", "the same without CP (its DP 4)"),
           ("torchtitan", "torchtitan `llama3_70b.toml` (TP 8, FSDP 8 -> our ZeRO-1; `full`)"))


def planning_recipes(results: dict[str, dict]) -> str:
    r = results["planning_at_scale"]
    memory = float(r["device_memory"].removesuffix("GB")) * 1e9
    rows, commands = [], []
    for name, label in RECIPES:
        for n in (1, 4):
            q = r["questions"][f"{name}_n{n}"]
            row = q["asked"]
            commands.append(q["command"])
            verdict = ("model states fit; activations not counted" if row["activations_not_counted"]
                       else "fits" if row["total_bytes"] <= memory else "does not fit")
            rows.append([label if n == 1 else "", str(n), _layout(row), _gb(_states(row)), _gb(row["activation_bytes"]),
                         f"**{_gb(row['total_bytes'])}**", verdict])
    table = _table(["published layout, in our model's form", "n", "layout", "model states GB", "activations GB",
                    "most loaded rank GB", f"on {r['device_memory']}"],
                   ["---", "---:", "---", "---:", "---:", "---:", "---"], rows)
    return table + "\n\n" + _commands(*commands)


def planning_gpt_125m(results: dict[str, dict]) -> str:
    q = results["planning_at_scale"]["questions"]["gpt_125m"]
    rows = [[_layout(row), f"{_gb(row['total_bytes'])}", _gb(_states(row)), _gb(row["activation_bytes"]),
             f"{row['bubble']:.3f}", _gb(row["sent_bytes"])] for row in q["fitting"]]
    table = _table(["layout (best first)", "most loaded rank GB", "model states GB", "activations GB", "bubble",
                    "sent per rank and step GB"], ["---", "---:", "---:", "---:", "---:", "---:"], rows)
    return (f"{q['fitting_count']} layouts of 8 fit.\n\n" + table + "\n\n" + _commands(q["command"]))


BLOCKS = {
    "README.md": {"headline": headline},
    "docs/benchmarks.md": {"recompute_memory": recompute_table, "mhc_overhead": overhead_table,
                           "mhc_sublayer": sublayer_table, "pipeline_schedule": pipeline_table,
                           "pipeline_memory": pipeline_memory_table, "checkpoint_io": checkpoint_table,
                           "distributed_optimizer": distributed_optimizer_table,
                           "distributed_optimizer_peak": distributed_optimizer_peak_table},
    "docs/planning.md": {"planning_llama3_70b": planning_llama3_70b, "planning_streams": planning_streams,
                         "planning_recipes": planning_recipes, "planning_gpt_125m": planning_gpt_125m},
}
"""Each file's blocks (between ``MARKER`` and ``END``) and what writes them."""


def block(text: str, name: str) -> tuple[int, int]:
    """Where the block ``name`` stands in ``text``, its markers included."""
    begin = MARKER.format(name=name)
    start = text.find(begin)
    end = text.find(END, start)
    if start < 0 or end < 0:
        raise SystemExit(f"figures: no '{begin}' ... '{END}' block")
    return start, end + len(END)


def rewritten(text: str, writers: dict, results: dict[str, dict]) -> str:
    """``text`` with each of ``writers``' blocks written afresh from ``results``."""
    for name, write in writers.items():
        start, end = block(text, name)
        text = text[:start] + "\n".join([MARKER.format(name=name), write(results), END]) + text[end:]
    return text


def collect(results: pathlib.Path = ROOT / "benchmarks" / "results") -> None:
    """Copy each cited benchmark's result file (and its plot, where it wrote one) into docs/benchmarks/."""
    for name in CITED + PLANNED:
        for suffix in (".json", ".png"):
            source = results / f"{name}{suffix}"
            if source.is_file():
                shutil.copyfile(source, KEPT / source.name)
                print(f"kept {source.name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collect", action="store_true", help="copy benchmarks/results/NAME.json first")
    parser.add_argument("--check", action="store_true", help="only say whether the files hold what the results say")
    args = parser.parse_args()
    if args.collect:
        collect()
    results = load()
    for relative, writers in BLOCKS.items():
        path = ROOT / relative
        text = path.read_text()
        written = rewritten(text, writers, results)
        if args.check and written != text:
            sys.exit(f"figures: {relative}'s figures are not what docs/benchmarks/*.json say: "
                     "run python benchmarks/figures.py")
        if not args.check:
            path.write_text(written)
            print(f"wrote {relative}'s figures")


if __name__ == "__main__":
    main()
