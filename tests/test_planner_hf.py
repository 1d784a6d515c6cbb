"""The planner's per-rank model-state bytes of Hugging Face models (``planning.hf``: counted from the
config on the meta device) against the models ``parallelize`` builds on 4 spawned ranks (one group,
every case in it): dense families with and without added hyper-connections, a sparse-MoE family
under EP, DeepSeek-V4 with its own streams; TP, PP, TP x PP, a virtual pipeline, EP."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_mhc.testing.launch import spawn_ranks  # noqa: E402

# the traces run in this process over a fake group, which the planner refuses beside a layout's groups: a
# test before in the same worker (an in-process Trainer.fit keeps its layout, on purpose) leaves none here
pytestmark = pytest.mark.usefixtures("no_model_parallel")

_COMMON = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, max_position_embeddings=64, pad_token_id=None,
               bos_token_id=0, eos_token_id=1)


def _config(family: str):
    """Tiny configs with what changes a tensor's shape or presence: grouped queries, a tied head
    (Llama), the attention's biases (Qwen2), routed experts (Mixtral), DeepSeek-V4's streams,
    sinks, grouped output projection and hash-routed first layer."""
    t = transformers
    if family == "llama":
        return t.LlamaConfig(**_COMMON, num_key_value_heads=2, intermediate_size=48, num_hidden_layers=4,
                             tie_word_embeddings=True)
    if family == "qwen2":
        return t.Qwen2Config(**_COMMON, num_key_value_heads=2, intermediate_size=40, num_hidden_layers=2)
    if family == "mixtral":
        return t.MixtralConfig(**_COMMON, num_key_value_heads=2, intermediate_size=16, num_hidden_layers=2,
                               num_local_experts=4, num_experts_per_tok=2)
    from v4_utils import tiny_v4_config

    return tiny_v4_config()


# (family, added streams, TP, PP, VP, EP): each divides the 4 ranks (DP fills the rest)
CASES = [("llama", 4, 2, 1, 1, 1), ("llama", 4, 1, 2, 2, 1), ("llama", 4, 2, 2, 1, 1), ("llama", None, 1, 1, 1, 1),
         ("qwen2", None, 2, 2, 1, 1), ("qwen2", 2, 2, 1, 1, 1),
         ("mixtral", None, 1, 1, 1, 2), ("mixtral", 4, 2, 1, 1, 2), ("mixtral", None, 1, 2, 1, 2),
         ("deepseek_v4", None, 2, 1, 1, 1), ("deepseek_v4", None, 1, 2, 1, 2), ("deepseek_v4", None, 2, 2, 1, 1)]
# ZeRO-1 (family, added streams, TP, PP, VP, EP, bucket bytes): DP 4; PP 2 x DP 2 with several buckets a
# stage (the head tied across the stages in one of its own, which these sizes would share); EP 2 x DP 4; DeepSeek-V4 EP 2, small buckets
ZERO1_CASES = [("llama", 4, 1, 1, 1, 1, 25 * 2**20), ("llama", 4, 1, 2, 1, 1, 40_000),
               ("mixtral", None, 1, 1, 1, 2, 25 * 2**20), ("deepseek_v4", None, 1, 1, 1, 2, 20_000)]
# retained activations (family, added streams, recompute policy, layout sizes, micro-batches): measured by
# the runtime's meter (the CLI's activation_bytes), planned by tracing on the meta device (planning.hf_activations;
# under TP, SP, CP or EP over a fake process group)
ACTIVATION_CASES = [("llama", None, "none", {}, 2), ("llama", None, "selective", dict(pp=2), 4),
                    ("llama", 4, "none", dict(pp=2, vp=2), 4), ("llama", 4, "mhc_block", dict(pp=2), 4),
                    ("llama", 4, "full", dict(pp=2), 4),
                    ("qwen2", 2, "mhc_block", {}, 2), ("qwen2", None, "full", dict(pp=2), 4),
                    ("mixtral", None, "none", dict(pp=2), 4), ("mixtral", 4, "mhc_block", {}, 2),
                    ("mixtral", None, "selective", {}, 2),
                    ("deepseek_v4", None, "none", dict(pp=2), 4), ("deepseek_v4", None, "mhc_block", {}, 1),
                    ("llama", 4, "selective", dict(tp=2, sp=True), 2),
                    ("llama", 4, "mhc_block", dict(tp=2, sp=True, pp=2), 4), ("mixtral", None, "none", dict(ep=2), 2),
                    ("mixtral", 4, "none", dict(tp=2, ep=2), 2), ("llama", None, "none", dict(cp=2), 2)]
# traffic per step (family, added streams, recompute policy, layout sizes, micro-batches): every rank's bytes
# per (dimension, collective) counted in a real step (distributed.collectives), planned by the same trace (DP's
# reduction in the PP, CP and EP cases; TP without SP under full recompute)
TRAFFIC_CASES = [("llama", 4, "none", dict(pp=2), 4), ("llama", 4, "selective", dict(tp=2, sp=True), 2),
                 ("llama", 4, "full", dict(tp=2, pp=2), 4), ("mixtral", None, "none", dict(ep=2), 1),
                 ("llama", None, "none", dict(cp=2), 1)]
# the same through the distributed optimizer's buckets (family, added streams, recompute policy, layout sizes,
# micro-batches, precision, ZeRO-1): ZeRO-1 on PP 2 x DP 2 (the head tied across the stages, its bucket alone);
# bf16 weights with ZeRO-1 under TP 2 with SP (each rank's pieces of the SP parameters summed over TP: the ranks
# differ); bf16 weights unsharded (fp32 buckets all-reduced) on PP 2 x DP 2; ZeRO-1 on EP 2 (the experts'
# buckets cut over the expert-data ranks)
BUCKET_TRAFFIC_CASES = [("llama", 4, "none", dict(pp=2), 2, "32-true", True),
                        ("llama", 4, "selective", dict(tp=2, sp=True), 2, "bf16-true", True),
                        ("llama", None, "none", dict(pp=2), 2, "bf16-true", False),
                        ("mixtral", None, "none", dict(ep=2), 1, "32-true", True)]
# the same under bf16-true: the model cast whole by Lightning's plugin, traced in bf16 (not the fp32 trace halved)
BF16_ACTIVATION_CASES = [("llama", 4, "none", dict(pp=2), 4), ("llama", None, "selective", dict(pp=2), 4),
                         ("qwen2", 2, "mhc_block", {}, 2)]
SEQ, MICRO_BATCH, TOLERANCE = 32, 2, 0.05
CASES = [c for c in CASES if c[0] != "deepseek_v4" or hasattr(transformers, "DeepseekV4Config")]
ZERO1_CASES = [c for c in ZERO1_CASES if c[0] != "deepseek_v4" or hasattr(transformers, "DeepseekV4Config")]
ACTIVATION_CASES = [c for c in ACTIVATION_CASES if c[0] != "deepseek_v4" or hasattr(transformers, "DeepseekV4Config")]
MEASURED = {"states": len(CASES), "zero1": len(CASES) + len(ZERO1_CASES),
            "traffic": len(CASES) + len(ZERO1_CASES) + len(ACTIVATION_CASES) + len(BF16_ACTIVATION_CASES)}
MEASURED["bucket_traffic"] = MEASURED["traffic"] + len(TRAFFIC_CASES)
"""Where each part of a rank's measurements begins (model states first)."""


def _recorded(family: str):
    from lightning_mhc.any_model import record_module_init

    with record_module_init():
        return transformers.AutoModelForCausalLM.from_config(_config(family), dtype="float32")


def _layout(tp=1, pp=1, vp=1, ep=1, sp=False, cp=1):
    from lightning_mhc.distributed.layout import ParallelLayout

    return ParallelLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          virtual_pipeline_model_parallel_size=vp, expert_model_parallel_size=ep, sequence_parallel=sp,
                          context_parallel_size=cp, world_size=4)


def _measure(rank, world):
    """Per case: this rank's stage, and its parameter, gradient and AdamW state bytes after one step."""
    from lightning_mhc.any_model import parallelize
    from lightning_mhc.distributed.layout import destroy_parallel
    from lightning_mhc.distributed.optimizer import optimizer_state_bytes

    out = []
    for family, streams, tp, pp, vp, ep in CASES:
        layout = _layout(tp, pp, vp, ep).build()
        model = parallelize(_recorded(family), "auto", layout=layout, hyper_connections=streams)
        params = list(model.parameters())
        trained = [p for p in params if p.requires_grad]
        for p in trained:
            p.grad = torch.zeros_like(p)
        optim = torch.optim.AdamW(trained)
        optim.step()
        out.append((layout.pipeline_model_parallel_rank, sum(p.numel() * p.element_size() for p in params),
                    sum(p.grad.numel() * p.grad.element_size() for p in trained), optimizer_state_bytes(optim)))
        destroy_parallel()
    out += [_measure_zero1(*case) for case in ZERO1_CASES]
    out += [_measure_activations(rank, *case) for case in ACTIVATION_CASES]
    out += [_measure_activations(rank, *case, precision="bf16-true") for case in BF16_ACTIVATION_CASES]
    out += [_measure_traffic(rank, *case) for case in TRAFFIC_CASES]
    return out + [_measure_traffic(rank, *case) for case in BUCKET_TRAFFIC_CASES]


def _batch(m, rank):
    """The step's batch of this rank (its own tokens: under EP the routing, so the measured activations and
    the all-to-all, follow them)."""
    torch.manual_seed(1 + rank)
    tokens = torch.randint(0, _COMMON["vocab_size"], (MICRO_BATCH * m, SEQ + 1))
    return dict(input_ids=tokens[:, :-1].clone(), labels=tokens[:, 1:].clone())


def _measure_activations(rank, family, streams, policy, sizes, m, precision="32-true"):
    """The runtime's ``activation_bytes`` (max over ranks) of one training step through its schedule."""
    from lightning_mhc.distributed.layout import destroy_parallel
    from planner_runtime import hf_on_runtime, train_schedule

    runtime, module = hf_on_runtime(_layout(**sizes), m, _recorded(family), policy, streams, precision,
                                    measure_activation_memory=True)
    train_schedule(runtime, module, _batch(m, rank), precision)
    destroy_parallel()
    return runtime.activation_bytes


def _measure_traffic(rank, family, streams, policy, sizes, m, precision="32-true", zero1=False):
    """This rank's stage, its expert group's ranks, its DP x CP index and the payload bytes it sent by
    (dimension, op) over one training step (schedule, gradient reduction, optimizer step) in
    ``precision`` (``zero1``: the distributed optimizer sharding)."""
    import torch.distributed as dist

    from lightning_mhc.distributed.layout import destroy_parallel
    from lightning_mhc.distributed.collectives import CollectiveCounter, dimension_of
    from planner_runtime import hf_on_runtime, train_schedule

    runtime, module = hf_on_runtime(_layout(**sizes), m, _recorded(family), policy, streams, precision,
                                    use_distributed_optimizer=zero1)
    optimizer = torch.optim.AdamW(module.parameters())
    runtime.take_over_optimizers(module, [optimizer])
    batch = _batch(m, rank)
    with CollectiveCounter(dimension_of(runtime.layout)) as counted:
        train_schedule(runtime, module, batch, precision, where="traffic grid")
        runtime.reduce_gradients(module)
        optimizer.step()
        runtime.finish_step()
    row = (runtime.layout.pipeline_model_parallel_rank, tuple(dist.get_process_group_ranks(runtime.layout.ep_group)),
           dist.get_rank(runtime.layout.dp_cp_group), dict(counted.bytes))
    destroy_parallel()
    return row


def _measure_zero1(family, streams, tp, pp, vp, ep, bucket_bytes):
    """This rank's ZeRO-1 row (``testing.zero1``) on the chunks the strategy hands the distributed optimizer."""
    from lightning_mhc.any_model import parallelize
    from lightning_mhc.distributed.layout import destroy_parallel
    from lightning_mhc.distributed.pipeline.protocol import has_model_chunks
    from lightning_mhc.testing.zero1 import zero1_state_row

    layout = _layout(tp, pp, vp, ep).build()
    model = parallelize(_recorded(family), "auto", layout=layout, hyper_connections=streams)
    row = zero1_state_row(model.model_chunks() if has_model_chunks(model) else [model], layout, bucket_bytes)
    destroy_parallel()
    return row


@pytest.fixture(scope="module")
def measured():
    return spawn_ranks(_measure, 4, timeout_s=600)


def test_hf_model_state_bytes_per_rank_exact(measured):
    """Parameter, gradient and AdamW bytes of every rank equal the planner's for its stage."""
    from lightning_mhc.planning import plan_hf

    for i, (family, streams, tp, pp, vp, ep) in enumerate(CASES):
        planned = plan_hf(_recorded(family), _layout(tp, pp, vp, ep), hyper_connections=streams)
        for rank, rows in enumerate(measured):
            stage, params, grads, optim = rows[i]
            want = planned[stage]
            got = (params, grads, optim)
            assert got == (want.parameter_bytes, want.gradient_bytes, want.optimizer_bytes), (CASES[i], rank, got, want)


def test_hf_zero1_optimizer_bytes_per_rank_exact(measured):
    """Under ZeRO-1 each rank's AdamW state (its pieces' moments and one step per piece) equals the
    planner's for its stage and DP x CP index; the stage's figure is its most loaded rank's."""
    from lightning_mhc.planning import plan_hf
    from lightning_mhc.testing.zero1 import check_zero1_rows

    for i, (family, streams, tp, pp, vp, ep, bucket_bytes) in enumerate(ZERO1_CASES):
        planned = plan_hf(_recorded(family), _layout(tp, pp, vp, ep), hyper_connections=streams,
                          distributed_optimizer=True, bucket_bytes=bucket_bytes)
        check_zero1_rows(planned, [r[MEASURED["states"] + i] for r in measured], ZERO1_CASES[i])


def test_hf_activation_bytes_within_5_percent(measured):
    """Every activation case: the planner's most loaded stage (traced on the meta device; under TP,
    SP, CP or EP as one rank over a fake process group) is within 5 % of the runtime's measured
    bytes, max over ranks."""
    from lightning_mhc.planning import plan_hf_activations

    misses = []
    cases = [(case, None) for case in ACTIVATION_CASES] + [(case, torch.bfloat16) for case in BF16_ACTIVATION_CASES]
    for i, ((family, streams, policy, sizes, m), dtype) in enumerate(cases):
        got = measured[0][MEASURED["zero1"] + i]
        want = max(b for b, _ in plan_hf_activations(lambda: _recorded(family), _layout(**sizes), seq_length=SEQ,
                                                     micro_batch_size=MICRO_BATCH, num_microbatches=m,
                                                     hyper_connections=streams, recompute=policy, dtype=dtype))
        print("activations", cases[i], "measured", got, "planned", want, f"{(want - got) / got:+.2%}")
        if abs(want - got) > TOLERANCE * got:
            misses.append((cases[i], got, want, f"{(want - got) / got:+.1%}"))
    assert not misses, misses


def test_hf_traffic_per_rank_exact(measured):
    """Every traffic case: the bytes each rank sent per (dimension, collective) in a real step are the
    planner's for its stage (traced: the forward's and backward's collectives over a fake process
    group, the sends between stages, the step's end); EP's all-to-all, which follows the routing,
    is the planner's (a balanced router's) on average over each expert group."""
    from lightning_mhc.planning import plan_hf_traffic
    from lightning_mhc.testing.collectives import traffic_misses

    misses = []
    for i, (family, streams, policy, sizes, m) in enumerate(TRAFFIC_CASES):
        stages = plan_hf_traffic(lambda: _recorded(family), _layout(**sizes), seq_length=SEQ,
                                 micro_batch_size=MICRO_BATCH, num_microbatches=m, hyper_connections=streams,
                                 recompute=policy)
        print("traffic", TRAFFIC_CASES[i], "per stage", [s.per_dimension() for s in stages])
        misses += traffic_misses(TRAFFIC_CASES[i], stages, [rows[MEASURED["traffic"] + i] for rows in measured])
    assert not misses, misses


def test_hf_traffic_through_the_distributed_optimizer_per_rank_exact(measured):
    """Every bucket case (ZeRO-1, bf16 weights): each rank's bytes per (dimension, collective) are the
    planner's for its stage and DP x CP index: the buckets of the traced stage's parameters
    reduce-scattered (padded) and all-gathered in the weights' dtype, or all-reduced in fp32 unsharded,
    their flags, and under ZeRO-1 the TP sum and the tied embedding's sum on the rank's own pieces."""
    from lightning_mhc.planning import plan_hf_traffic
    from lightning_mhc.testing.collectives import traffic_misses

    misses = []
    for i, (family, streams, policy, sizes, m, precision, zero1) in enumerate(BUCKET_TRAFFIC_CASES):
        stages = plan_hf_traffic(lambda: _recorded(family), _layout(**sizes), seq_length=SEQ,
                                 micro_batch_size=MICRO_BATCH, num_microbatches=m, hyper_connections=streams,
                                 recompute=policy, param_bytes=2 if precision == "bf16-true" else 4,
                                 distributed_optimizer=zero1)
        print("traffic", BUCKET_TRAFFIC_CASES[i], "per stage", [s.per_dimension() for s in stages],
              "ranks differ:", any(s.by_data_rank for s in stages))
        misses += traffic_misses(BUCKET_TRAFFIC_CASES[i], stages,
                                 [rows[MEASURED["bucket_traffic"] + i] for rows in measured])
    assert not misses, misses


def test_hf_trace_refuses_what_it_does_not_count(monkeypatch):
    """An op the meta device cannot run (here transformers' packed-sequence search, without the trace's
    stand-ins) stops the trace: one line, not a wrong figure."""
    import contextlib

    from lightning_mhc.errors import ConfigError
    from lightning_mhc.planning import hf_activations, plan_hf_activations

    monkeypatch.setattr(hf_activations, "_meta_trace", contextlib.nullcontext)
    with pytest.raises(ConfigError, match="could not trace LlamaForCausalLM on the meta device .*meta tensors"):
        plan_hf_activations(lambda: _recorded("llama"), _layout(), seq_length=SEQ,
                            micro_batch_size=MICRO_BATCH, num_microbatches=1)


def test_a_traced_plan_leaves_the_process_as_it_was():
    """The trace under TP x CP (two stages, each a fake process group with megatron's groups, CP's
    attention registered in transformers) leaves no group, no megatron state, no registry entry, the
    same generator state; a process's own default group (a worker's one-rank group) is set aside and
    given back; one holding a layout's groups is refused in one line."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from transformers import AttentionInterface

    from lightning_mhc.distributed.layout import ParallelLayout, destroy_parallel
    from lightning_mhc.errors import ConfigError
    from lightning_mhc.planning import plan_hf_traffic
    from lightning_mhc.recompute.rng import get_parallel_randomizer

    def plan():
        return plan_hf_traffic(lambda: _recorded("llama"), _layout(tp=2, cp=2), seq_length=SEQ,
                               micro_batch_size=MICRO_BATCH, num_microbatches=1)

    def state():
        return (dist.is_initialized() and dist.group.WORLD, parallel_state.model_parallel_is_initialized(),
                sorted(AttentionInterface._global_mapping), get_parallel_randomizer(), torch.get_rng_state())

    own = not dist.is_initialized()
    if own:  # a worker's one-rank group, as the suite's fixture makes it
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        before = state()
        assert plan()[0].bytes[("context", "all_gather")] > 0
        after = state()
        assert after[:4] == before[:4] and torch.equal(after[4], before[4])
        ParallelLayout().build()
        with pytest.raises(ConfigError, match="holds a layout's groups already"):
            plan()
        destroy_parallel()
    finally:
        if own:
            dist.destroy_process_group()
    if not dist.is_initialized():  # and a process with no group at all (the pre-launch check's)
        before = state()
        plan()
        after = state()
        assert after[:4] == before[:4] and not after[0]


# ------------------------------------------------------------------ the console door and before launch
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A config-only directory (no weights: the planner reads none)."""
    directory = tmp_path_factory.mktemp("llama_config")
    _config("llama").save_pretrained(directory)
    return directory


def _hf_args(directory, *extra):
    return ["model=hf", f"model.config={directory}", "model.hyper_connections=4", "data=synthetic", *extra]


def test_plan_cli_plans_a_hugging_face_model(llama_dir, tmp_path, monkeypatch, capsys):
    """``lightning-mhc-plan model=hf model.config=DIR``: every stage's model states, retained
    activations and traffic are the planner's (checked against the runtime above), on TP x PP (traced
    over a fake process group) and on PP x DP (no group at all)."""
    from lightning_mhc.cli.plan import plan
    from lightning_mhc.planning import plan_hf, plan_hf_activations, plan_hf_traffic

    monkeypatch.chdir(tmp_path)
    sizes = ("trainer.devices=4", "data.global_batch_size=8", "data.micro_batch_size=2", "data.seq_length=32")
    asked = plan(_hf_args(llama_dir, "parallel=tp2pp2", *sizes))[0]  # DP 1: 4 micro-batches
    layout = _layout(2, 2, 1, 1)
    want = plan_hf(_recorded("llama"), layout, hyper_connections=4)
    assert [(s["parameter_bytes"], s["gradient_bytes"], s["optimizer_bytes"]) for s in asked["stages"]] == \
        [(w.parameter_bytes, w.gradient_bytes, w.optimizer_bytes) for w in want]
    traced = plan_hf_activations(lambda: _recorded("llama"), layout, seq_length=32, micro_batch_size=2,
                                 num_microbatches=4, hyper_connections=4)
    sent = plan_hf_traffic(lambda: _recorded("llama"), layout, seq_length=32, micro_batch_size=2,
                           num_microbatches=4, hyper_connections=4)
    assert asked["activations_not_counted"] is None and asked["traffic_not_counted"] is None
    assert [s["activation_bytes"] for s in asked["stages"]] == [a for a, _ in traced]
    assert [s["traffic_bytes"] for s in asked["stages"]] == [t.per_dimension() for t in sent]
    assert asked["traffic_bytes"]["tensor"] > 0 and asked["traffic_bytes"]["pipeline"] > 0
    assert asked["total_bytes"] == max(w.total + a for w, (a, _) in zip(want, traced))
    out = capsys.readouterr().out
    assert "model states and retained activations" in out and "sent per rank and step: tensor" in out
    # PP 2 x DP 2: 8 samples of 2 per micro-batch over DP 2 = 2 micro-batches. The trace stands in for
    # four library functions while it runs: the process keeps its own afterwards
    import transformers.integrations.moe
    import transformers.masking_utils

    def libraries():
        return (torch.autocast, torch.nn.functional.scaled_dot_product_attention,
                transformers.masking_utils.find_packed_sequence_indices,
                transformers.integrations.moe._can_use_grouped_mm)

    before = libraries()
    asked = plan(_hf_args(llama_dir, "parallel=pp2", *sizes))[0]
    assert libraries() == before
    layout = _layout(1, 2, 1, 1)
    states = plan_hf(_recorded("llama"), layout, hyper_connections=4)
    traced = plan_hf_activations(lambda: _recorded("llama"), layout, seq_length=32, micro_batch_size=2,
                                 num_microbatches=2, hyper_connections=4)
    sent = plan_hf_traffic(lambda: _recorded("llama"), layout, seq_length=32, micro_batch_size=2,
                           num_microbatches=2, hyper_connections=4)
    assert asked["activations_not_counted"] is None
    assert [s["activation_bytes"] for s in asked["stages"]] == [a for a, _ in traced]
    assert [s["traffic_bytes"] for s in asked["stages"]] == [t.per_dimension() for t in sent]
    assert asked["traffic_bytes"]["data"] > 0 and asked["traffic_bytes"]["pipeline"] > 0
    assert asked["total_bytes"] == max(s.total + a for s, (a, _) in zip(states, traced))
    assert "model states and retained activations" in capsys.readouterr().out
    # bf16-true with ZeRO-1: bf16 weights and the trace in bf16 (checked against bf16 runs above), not the
    # fp32 one halved, and the traffic through the distributed optimizer's buckets; torch's default dtype,
    # which the trace sets to bf16, is the process's again afterwards
    asked = plan(_hf_args(llama_dir, "parallel=pp2", "trainer.devices=4", "trainer.precision=bf16-true",
                          "optim.use_distributed_optimizer=true", "data.global_batch_size=8",
                          "data.micro_batch_size=2", "data.seq_length=32"))[0]
    assert torch.get_default_dtype() == torch.float32
    states = plan_hf(_recorded("llama"), layout, hyper_connections=4, param_bytes=2, distributed_optimizer=True)
    traced = plan_hf_activations(lambda: _recorded("llama"), layout, seq_length=32, micro_batch_size=2,
                                 num_microbatches=2, hyper_connections=4, dtype=torch.bfloat16)
    sent = plan_hf_traffic(lambda: _recorded("llama"), layout, seq_length=32, micro_batch_size=2,
                           num_microbatches=2, hyper_connections=4, param_bytes=2, distributed_optimizer=True)
    assert [(s["parameter_bytes"], s["optimizer_bytes"], s["activation_bytes"]) for s in asked["stages"]] == \
        [(w.parameter_bytes, w.optimizer_bytes, a) for w, (a, _) in zip(states, traced)]
    assert asked["traffic_not_counted"] is None
    assert [s["traffic_bytes"] for s in asked["stages"]] == [t.per_dimension() for t in sent]


def test_train_plans_and_refuses_a_hugging_face_layout(llama_dir, tmp_path, monkeypatch, capsys):
    """``lightning-mhc-train model=hf``: on the CPU the planner's figure is one line, not enforced; on a
    GPU (free memory faked) a layout predicted over it is refused in one line naming a layout of the
    same devices that fits; with room enough it passes."""
    import copy

    from hydra import compose, initialize_config_dir

    from lightning_mhc.cli import plan as plan_cli
    from lightning_mhc.cli import preflight
    from lightning_mhc.cli.plan import describe, fitting_layouts, layout_row
    from train_cli import check_before_launch

    # One command line throughout: the CLI's three checks and this test ask for the same layouts' rows
    # (24 asks of 5 layouts that divide the model and 5 that it refuses: the asked layout 6 times, every
    # other candidate twice), each row a trace with a backward. Each row is traced once here and handed
    # to every later ask (a copy: a caller may change what it gets); a refusal is asked again
    rows: dict = {}

    def layout_row_once(cfg, layout, num_microbatches):
        if (layout, num_microbatches) not in rows:
            rows[layout, num_microbatches] = layout_row(cfg, layout, num_microbatches)
        return copy.deepcopy(rows[layout, num_microbatches])

    monkeypatch.setattr(plan_cli, "layout_row", layout_row_once)
    argv = _hf_args(llama_dir, "trainer.devices=4", "data.global_batch_size=8")  # DP 4: the whole model per rank
    status, err = check_before_launch(argv, tmp_path, monkeypatch, capsys)
    lines = [line for line in err.splitlines() if line.startswith("lightning-mhc-train: plan:")]
    assert status == 0 and len(lines) == 1 and "model states alone" not in lines[0] and "not enforced" in lines[0], err
    monkeypatch.chdir(tmp_path)
    with initialize_config_dir(config_dir=preflight.CONF_DIR, version_base="1.3", job_name="test"):
        cfg = preflight.to_train_config(compose(config_name="config", overrides=argv))
    asked = layout_row_once(cfg, cfg.layout, cfg.num_microbatches)
    best = fitting_layouts(cfg, 4, asked["total_bytes"])[0]
    assert best["total_bytes"] < asked["total_bytes"]
    monkeypatch.setattr(preflight, "free_device_memory", lambda cfg: (best["total_bytes"] + asked["total_bytes"]) // 2)
    status, err = check_before_launch(argv, tmp_path, monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and "does not fit" in lines[0] and describe(best) in lines[0], err
    monkeypatch.setattr(preflight, "free_device_memory", lambda cfg: asked["total_bytes"])
    assert check_before_launch(argv, tmp_path, monkeypatch, capsys) == (0, "")
