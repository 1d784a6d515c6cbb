"""``lightning-mhc-plan`` / ``python -m lightning_mhc.cli.plan``: each rank's model-state bytes for a
layout, before launch, with the overrides and config groups of ``lightning-mhc-train``.

    lightning-mhc-plan model=small parallel=tp2pp2 trainer.devices=4        # that layout's table per stage
    lightning-mhc-plan model=gpt_125m plan.devices=8 plan.device_memory=80GB  # layouts of 8 devices that fit
    lightning-mhc-plan ... plan.json=plan.json                               # {"layouts": [...]}, asked first

The counts are the planner's (``lightning_mhc.planning``): parameters, gradients and AdamW state per
rank of each pipeline stage, counted from the config (the mHC GPT's by arithmetic; a Hugging Face model's
(``model=hf``) from its config.json on the meta device, no weights read), the retained activations at
the schedule's peak for the run's recompute policy, and the bytes each rank sends per step by dimension
(``planning.traffic``; docs/planning.md). The GPT's are arithmetic (for the device it trains on,
``trainer.accelerator``: on CUDA the fused attention's; what the count does not cover, an expert
capacity or ``recompute_modules`` other than a policy's default, prints the model states alone and
says why in one line); a Hugging Face model's activations and traffic come from one trace of its stages on the meta device (``planning.hf_activations``), under TP, CP or EP as one rank over a fake process group torn
down after it (``planning.fake_group``). No real process group is started. The pipeline bubble is the
schedule's idle fraction, (p - 1) / (v m + p - 1). Bad input is one line,
``lightning-mhc-plan: invalid configuration: ...``, exit status 2.
"""
from __future__ import annotations

import json
import sys
from typing import Any

PREFIX = "lightning-mhc-plan: invalid configuration: "
PLAN_KEYS = ("devices", "device_memory", "json", "top")


def _split(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The train overrides, and the ``plan.<key>=value`` ones (not part of the train schema)."""
    train, plan = [], {}
    for arg in argv:
        if arg.startswith("plan."):
            key, _, value = arg[len("plan."):].partition("=")
            if key not in PLAN_KEYS:
                from lightning_mhc.errors import ConfigError

                raise ConfigError(f"plan.{key} is not a planner option: give plan.devices, plan.device_memory, "
                                  "plan.json or plan.top.")
            plan[key] = value
        else:
            train.append(arg)
    return train, plan


def _positive_int(key: str, value: str) -> int:
    from lightning_mhc.errors import ConfigError

    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"plan.{key}={value!r}: must be a positive whole number.")
    return int(value)


def layout_row(cfg, layout, num_microbatches: int) -> dict[str, Any]:
    """One layout's entry of ``plan.json``: its sizes, the most loaded rank's bytes, each stage's."""
    from lightning_mhc.planning import bubble

    param_bytes = 2 if cfg.trainer.precision == "bf16-true" else 4
    if cfg.model.is_hf:
        stages, activations, not_counted, traffic, traffic_not_counted = _hf_terms(cfg, layout, num_microbatches,
                                                                                   param_bytes)
    else:
        stages, activations, not_counted, traffic, traffic_not_counted = _gpt_terms(cfg, layout, num_microbatches,
                                                                                    param_bytes)
    totals = [s.total + a for s, a in zip(stages, activations)]
    top = stages[max(range(len(stages)), key=totals.__getitem__)]
    p = layout.pipeline_model_parallel_size
    return dict(
        sizes=dict(world_size=layout.world_size, tensor=layout.tensor_model_parallel_size, pipeline=p,
                   virtual=layout.num_virtual_stages // p, data=layout.data_parallel_size,
                   context=layout.context_parallel_size, expert=layout.expert_model_parallel_size,
                   sequence_parallel=layout.sequence_parallel, microbatches=num_microbatches),
        most_loaded_stage=top.stage, parameter_bytes=top.parameter_bytes, gradient_bytes=top.gradient_bytes,
        optimizer_bytes=top.optimizer_bytes,
        activation_bytes=None if not_counted else activations[top.stage], activations_not_counted=not_counted,
        total_bytes=totals[top.stage],
        traffic_bytes=_most_sent(traffic), traffic_not_counted=traffic_not_counted,
        bubble=bubble(p, layout.num_virtual_stages // p, num_microbatches),
        stages=[dict(stage=s.stage, parameter_bytes=s.parameter_bytes, gradient_bytes=s.gradient_bytes,
                     optimizer_bytes=s.optimizer_bytes, activation_bytes=None if not_counted else a,
                     total_bytes=total, traffic_bytes=sent)
                for s, a, total, sent in zip(stages, activations, totals, traffic)])


def _gpt_terms(cfg, layout, num_microbatches: int, param_bytes: int):
    """The mHC GPT's stages (model states), activations and traffic per stage, with why either is not counted."""
    from lightning_mhc.cli.preflight import device_type
    from lightning_mhc.errors import ConfigError
    from lightning_mhc.planning import plan_activations, plan_gpt, plan_traffic

    config = cfg.gpt_sizes()
    stages = plan_gpt(config, layout, param_bytes=param_bytes,
                      distributed_optimizer=cfg.optim.use_distributed_optimizer)
    try:  # activations in the parameters' dtype, what stays fp32 in fp32 (checked in fp32 and bf16-true), on the
        # device the run trains on (CUDA: SDPA's fused kernels whatever the attention dropout)
        activations = [a for a, _ in plan_activations(
            config, layout, cfg.recompute_policy, seq_length=cfg.data.seq_length,
            micro_batch_size=cfg.data.micro_batch_size, num_microbatches=num_microbatches, element_bytes=param_bytes,
            device=device_type(cfg.trainer.accelerator))]
        not_counted = None
    except ConfigError as error:  # what the activation count does not cover: the model states alone
        activations, not_counted = [0] * len(stages), str(error)
    try:  # the bytes each rank sends per step, by dimension
        traffic = [t.per_dimension() for t in plan_traffic(
            config, layout, cfg.recompute_policy, seq_length=cfg.data.seq_length,
            micro_batch_size=cfg.data.micro_batch_size, num_microbatches=num_microbatches, element_bytes=param_bytes,
            param_bytes=param_bytes, distributed_optimizer=cfg.optim.use_distributed_optimizer)]
        traffic_not_counted = None
    except ConfigError as error:
        traffic, traffic_not_counted = [None] * len(stages), str(error)
    return stages, activations, not_counted, traffic, traffic_not_counted


def _hf_terms(cfg, layout, num_microbatches: int, param_bytes: int):
    """A Hugging Face model's stages (model states, from its config.json on the meta device: no weights
    read), retained activations and traffic (one trace of its stages on the meta device, over a fake
    process group under TP, CP or EP: ``planning.hf_activations``), with why either is not counted."""
    from lightning_mhc.errors import ConfigError
    from lightning_mhc.any_model.record import recorded_hf_model
    from lightning_mhc.planning import plan_hf
    from lightning_mhc.planning.hf_activations import trace_dtype, trace_hf_stages

    m = cfg.model
    parallelize_args = dict(plan=m.plan, hyper_connections=m.hyper_connection_settings, recompute=cfg.recompute_policy)
    try:
        stages = plan_hf(recorded_hf_model(m.hf_dir), layout, param_bytes=param_bytes,
                         distributed_optimizer=cfg.optim.use_distributed_optimizer, **parallelize_args)
    except ConfigError as error:
        raise error.within(m.hf_key) from None
    try:  # traced in the run's dtype (bf16-true: the model cast whole, as Lightning's plugin casts it)
        traced = trace_hf_stages(lambda: recorded_hf_model(m.hf_dir), layout, seq_length=cfg.data.seq_length,
                                 micro_batch_size=cfg.data.micro_batch_size, num_microbatches=num_microbatches,
                                 dtype=trace_dtype(param_bytes),
                                 distributed_optimizer=cfg.optim.use_distributed_optimizer, **parallelize_args)
    except ConfigError as error:  # what the trace does not cover: the model states alone
        return stages, [0] * len(stages), str(error), [None] * len(stages), str(error)
    activations = [t.activation_bytes for t in traced]
    return stages, activations, None, [t.traffic.per_dimension() for t in traced], None


def _most_sent(traffic: list[dict[str, int] | None]) -> dict[str, int] | None:
    """Per dimension, the most any stage's rank sends in a step (None: not counted)."""
    if traffic[0] is None:
        return None
    return {d: max(t[d] for t in traffic) for d in traffic[0]}


def _candidates(cfg, devices: int):
    """Every TP x PP x DP (x EP) layout of ``devices`` the model divides into, with its micro-batches:
    the global batch is kept, the micro-batch size too, and sequence parallelism where the asked
    layout has it (on every layout with TP > 1: at scale it decides what fits)."""
    from lightning_mhc.distributed.layout import ParallelLayout
    from lightning_mhc.errors import ConfigError

    d = cfg.data
    for tp in range(1, devices + 1):
        for pp in range(1, devices // tp + 1):
            if devices % (tp * pp):
                continue
            dp = devices // (tp * pp)
            # a Hugging Face model's experts are in its config.json: an EP its experts refuse is skipped below
            experts = dp if cfg.model.is_hf else cfg.model.num_moe_experts or 0
            for ep in ([e for e in range(1, dp + 1) if dp % e == 0 and experts % e == 0] if experts else [1]):
                if d.global_batch_size % (d.micro_batch_size * dp):
                    continue
                try:
                    layout = ParallelLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                            expert_model_parallel_size=ep, world_size=devices,
                                            sequence_parallel=cfg.layout.sequence_parallel and tp > 1)
                    yield layout_row(cfg, layout, d.global_batch_size // (d.micro_batch_size * dp))
                except ConfigError:
                    continue  # the model does not divide into it (heads, layers, vocabulary, experts)


def fitting_layouts(cfg, devices: int, memory: int) -> list[dict[str, Any]]:
    """The layouts of ``devices`` whose most loaded rank fits ``memory`` bytes, best first: most
    headroom, then the smaller bubble, then the fewest bytes sent."""
    fitting = [r for r in _candidates(cfg, devices) if r["total_bytes"] <= memory]
    fitting.sort(key=lambda r: (r["total_bytes"], r["bubble"], _sent(r)))
    return fitting


TERMS = ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "activation_bytes")


def largest_term(row: dict[str, Any]) -> tuple[str, int]:
    """The most loaded rank's largest term: ``(name, bytes)``."""
    return max(((t, row[t] or 0) for t in TERMS), key=lambda pair: pair[1])


def describe(row: dict[str, Any]) -> str:
    """A layout in the words of the config: ``parallel.tensor_model_parallel_size=2 ...``."""
    s = row["sizes"]
    return (f"TP {s['tensor']} x PP {s['pipeline']} x DP {s['data']}" + (f" x CP {s['context']}" if s["context"] > 1
                                                                         else "")
            + (f", EP {s['expert']}" if s["expert"] > 1 else ""))


def _sent(row: dict[str, Any]) -> float:
    """The bytes a rank sends per step over every dimension (not counted: last)."""
    return sum(row["traffic_bytes"].values()) if row["traffic_bytes"] is not None else float("inf")


def _gb(n: int | float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e7 else f"{n:,} B"


def _print_layout(row: dict[str, Any]) -> None:
    s = row["sizes"]
    print(f"layout: {s['world_size']} ranks = TP {s['tensor']} x PP {s['pipeline']} (v {s['virtual']}) x "
          f"DP {s['data']} x CP {s['context']}, EP {s['expert']}; {s['microbatches']} micro-batches; "
          f"bubble {row['bubble']:.3f}")
    print(f"{'stage':>5} {'parameters':>14} {'gradients':>14} {'optimizer':>14} {'activations':>14} {'total':>14}")
    for st in row["stages"]:
        activations = "-" if st["activation_bytes"] is None else _gb(st["activation_bytes"])
        print(f"{st['stage']:>5} {_gb(st['parameter_bytes']):>14} {_gb(st['gradient_bytes']):>14} "
              f"{_gb(st['optimizer_bytes']):>14} {activations:>14} {_gb(st['total_bytes']):>14}")
    what = (f"model states only: {row['activations_not_counted']}" if row["activations_not_counted"]
            else "model states and retained activations")
    print(f"most loaded rank: stage {row['most_loaded_stage']}, {_gb(row['total_bytes'])} ({what})")
    sent = row["traffic_bytes"]
    print("sent per rank and step: " + (", ".join(f"{d} {_gb(b)}" for d, b in sent.items() if b) or "nothing"
                                        if sent is not None else f"not counted: {row['traffic_not_counted']}"))


def plan(argv: list[str]) -> list[dict[str, Any]]:
    from hydra import compose, initialize_config_dir

    from lightning_mhc.cli.preflight import CONF_DIR, to_train_config
    from lightning_mhc.planning import parse_bytes

    overrides, options = _split(argv)
    enumerate_ = "devices" in options or "device_memory" in options
    if enumerate_:  # the planner's own options first: a bad one is refused before anything is built
        devices = _positive_int("devices", options["devices"]) if "devices" in options else None
        memory = parse_bytes(options.get("device_memory", "80GB"))
        top = _positive_int("top", options.get("top", "3"))
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3", job_name="plan"):
        cfg = to_train_config(compose(config_name="config", overrides=overrides), sizes_only=True)
    asked = layout_row(cfg, cfg.layout, cfg.num_microbatches)
    rows = [asked]
    _print_layout(asked)
    if enumerate_:
        devices = devices or cfg.world_size
        fitting = fitting_layouts(cfg, devices, memory)
        print(f"\n{len(fitting)} layouts of {devices} devices fit {_gb(memory)}; the best {min(top, len(fitting))}:")
        for row in fitting[:top]:
            print()
            _print_layout(row)
            sent = "traffic not counted" if row["traffic_bytes"] is None else f"{_gb(_sent(row))} sent per rank and step"
            print(f"why: {_gb(memory - row['total_bytes'])} headroom, bubble {row['bubble']:.3f}, {sent}")
        rows += fitting
    if "json" in options:
        with open(options["json"], "w") as f:
            json.dump({"layouts": rows}, f, indent=1)
    return rows


def main(argv: list[str] | None = None) -> None:
    from omegaconf.errors import OmegaConfBaseException
    from hydra.errors import HydraException

    from lightning_mhc.cli.preflight import hydra_error_message
    from lightning_mhc.cli.schema import in_config_keys
    from lightning_mhc.errors import ConfigError

    argv = sys.argv[1:] if argv is None else argv
    try:
        plan(argv)
    except ConfigError as error:
        print(PREFIX + " ".join(str(in_config_keys(error)).split()), file=sys.stderr)
        sys.exit(2)
    except (HydraException, OmegaConfBaseException) as error:
        print(PREFIX + " ".join(hydra_error_message(error, argv).split()), file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
