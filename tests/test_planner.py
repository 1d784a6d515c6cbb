"""The planner's per-rank counts against the same counts measured on models the runtime builds on
forked ranks (one group per world size, every case in it)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_mhc.testing.launch import spawn_ranks

TINY = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=300,
            max_sequence_length=64, enable_hyper_connections=True, num_residual_streams=4)
MOE = dict(TINY, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
# the options that change a tensor's shape or presence: grouped queries, head width, gated units,
# no biases, learned positions, an untied output layer; shared experts, MoE every other layer
VARIED = dict(TINY, num_query_groups=2, kv_channels=8, gated_linear_unit=True, add_bias_linear=False,
              position_embedding_type="learned_absolute", share_embeddings_and_output_weights=False,
              num_residual_streams=2)
VARIED_MOE = dict(MOE, gated_linear_unit=True, moe_shared_expert_intermediate_size=48, moe_layer_freq=2)
# (model, TP, PP, VP, EP): each divides the 4 ranks; the vocabulary 300 is padded to 384 rows, split over TP
CASES = [(TINY, 1, 1, 1, 1), (TINY, 2, 1, 1, 1), (TINY, 2, 2, 1, 1), (TINY, 1, 4, 1, 1),
         (TINY, 1, 2, 2, 1), (dict(TINY, num_residual_streams=1, enable_hyper_connections=False), 4, 1, 1, 1),
         (MOE, 1, 1, 1, 4), (MOE, 1, 2, 1, 2), (VARIED, 2, 2, 1, 1), (VARIED_MOE, 1, 2, 1, 2)]
# ZeRO-1 (model, TP, PP, VP, EP, bucket bytes): DP 4; TP 2 x DP 2; PP 2 x DP 2 with several buckets a
# stage (the tied output layer's copy in one of its own); EP 2 x DP 4; PP 2 x EP 2, untied, small buckets
ZERO1_CASES = [(TINY, 1, 1, 1, 1, 25 * 2**20), (TINY, 2, 1, 1, 1, 25 * 2**20), (TINY, 1, 2, 1, 1, 100_000),
               (MOE, 1, 1, 1, 2, 25 * 2**20), (dict(VARIED_MOE, share_embeddings_and_output_weights=False),
                                               1, 2, 1, 2, 30_000)]
# bf16-true (model, TP, PP, VP, EP, bucket bytes, ZeRO-1): the weights bf16 (the hyper-connections' and the
# router's too, cast by Lightning's plugin), stepped on fp32 main weights, gradients in fp32 buckets. Without
# ZeRO-1: DP 4, TP 2 x PP 2, an MoE model on PP 2 x EP 2; with it: DP 4, PP 2 x DP 2 with several buckets a
# stage (the tied output's copy alone), an MoE model on EP 2 x DP 4 with small buckets
BF16_CASES = [(TINY, 1, 1, 1, 1, 25 * 2**20, False), (TINY, 2, 2, 1, 1, 25 * 2**20, False),
              (MOE, 1, 2, 1, 2, 25 * 2**20, False), (TINY, 1, 1, 1, 1, 25 * 2**20, True),
              (TINY, 1, 2, 1, 1, 100_000, True), (MOE, 1, 1, 1, 2, 30_000, True)]


def _layout(world, tp, pp, vp, ep):
    from lightning_mhc.distributed.layout import ParallelLayout

    return ParallelLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          virtual_pipeline_model_parallel_size=vp, expert_model_parallel_size=ep, world_size=world)


def _measure(rank, world):
    """Per case: this rank's stage, parameter bytes and AdamW state bytes after one step."""
    from megatron.core import parallel_state

    from lightning_mhc.distributed.optimizer import optimizer_state_bytes
    from lightning_mhc.model.config import MHCTransformerConfig, with_parallel_layout
    from lightning_mhc.model.stages import build_gpt_chunks

    out = []
    for model, tp, pp, vp, ep in CASES:
        layout = _layout(world, tp, pp, vp, ep).build()
        config = with_parallel_layout(MHCTransformerConfig(**model), layout)
        chunks = build_gpt_chunks(config, layout)
        params = [p for c in chunks for p in c.parameters()]
        for p in params:
            p.grad = torch.zeros_like(p)
        optim = torch.optim.AdamW(params)
        optim.step()
        out.append((layout.pipeline_model_parallel_rank,
                    sum(p.numel() * p.element_size() for p in params),
                    sum(p.grad.numel() * p.grad.element_size() for p in params),
                    optimizer_state_bytes(optim)))
        parallel_state.destroy_model_parallel()
    return out + [_measure_zero1(*case, world) for case in ZERO1_CASES] \
        + [_measure_zero1(*case[:6], world, precision="bf16-true", shard=case[6]) for case in BF16_CASES]


def _measure_zero1(model, tp, pp, vp, ep, bucket_bytes, world, precision="32-true", shard=True):
    """This rank's row (``testing.zero1``) once the distributed optimizer took over, the chunks in
    ``precision`` as the Trainer's plugin converts them."""
    from megatron.core import parallel_state

    from lightning_mhc.model.config import MHCTransformerConfig, with_parallel_layout
    from lightning_mhc.model.stages import build_gpt_chunks
    from planner_runtime import lightning_precision
    from lightning_mhc.testing.zero1 import zero1_state_row

    layout = _layout(world, tp, pp, vp, ep).build()
    plugin = lightning_precision(precision)
    chunks = [plugin.convert_module(c) for c in build_gpt_chunks(with_parallel_layout(MHCTransformerConfig(**model),
                                                                                      layout), layout)]
    row = zero1_state_row(chunks, layout, bucket_bytes, shard=shard)
    parallel_state.destroy_model_parallel()
    return row


@pytest.fixture(scope="module")
def measured():
    return spawn_ranks(_measure, 4, timeout_s=300)


def test_model_state_bytes_per_rank_exact(measured):
    """Parameter, gradient and AdamW bytes of every rank equal the planner's for its stage."""
    from lightning_mhc.model.config import MHCTransformerConfig
    from lightning_mhc.planning import plan_gpt

    for i, (model, tp, pp, vp, ep) in enumerate(CASES):
        planned = plan_gpt(MHCTransformerConfig(**model), _layout(4, tp, pp, vp, ep))
        for rank, rows in enumerate(measured):
            stage, params, grads, optim = rows[i]
            want = planned[stage]
            got = (params, grads, optim)
            assert got == (want.parameter_bytes, want.gradient_bytes, want.optimizer_bytes), \
                (CASES[i][1:], rank, got, want)


def test_zero1_optimizer_bytes_per_rank_exact(measured):
    """Under ZeRO-1 each rank's AdamW state (its pieces' moments and one step per piece) equals the
    planner's for its stage and DP x CP index; the stage's figure is its most loaded rank's."""
    from lightning_mhc.model.config import MHCTransformerConfig
    from lightning_mhc.planning import plan_gpt
    from lightning_mhc.testing.zero1 import check_zero1_rows

    for i, (model, tp, pp, vp, ep, bucket_bytes) in enumerate(ZERO1_CASES):
        planned = plan_gpt(MHCTransformerConfig(**model), _layout(4, tp, pp, vp, ep), distributed_optimizer=True,
                           bucket_bytes=bucket_bytes)
        check_zero1_rows(planned, [r[len(CASES) + i] for r in measured], ZERO1_CASES[i])


def test_bf16_true_model_states_per_rank_exact(measured):
    """Under ``bf16-true`` (with and without ZeRO-1) every rank's parameter bytes (every parameter bf16,
    the hyper-connections' and the router's too), fp32 gradient buffers and AdamW state with its fp32
    main weights equal the planner's for its stage and DP x CP index."""
    from lightning_mhc.model.config import MHCTransformerConfig
    from lightning_mhc.planning import plan_gpt
    from lightning_mhc.testing.zero1 import check_zero1_rows

    first = len(CASES) + len(ZERO1_CASES)
    for i, (model, tp, pp, vp, ep, bucket_bytes, zero1) in enumerate(BF16_CASES):
        planned = plan_gpt(MHCTransformerConfig(**model), _layout(4, tp, pp, vp, ep), param_bytes=2,
                           distributed_optimizer=zero1, bucket_bytes=bucket_bytes)
        check_zero1_rows(planned, [r[first + i] for r in measured], BF16_CASES[i][1:])


def test_plan_starts_no_process_group(tmp_path, monkeypatch, capsys):
    """A plan is arithmetic on the config: no process group is started or made, no model built
    (an earlier in-process fit on this worker may have left the default group: so the calls that
    would make one are made to fail, whatever the process holds)."""
    import torch.distributed as dist

    from lightning_mhc.cli.plan import plan

    def refuse(*args, **kwargs):
        raise AssertionError("the plan made a process group")

    monkeypatch.chdir(tmp_path)
    for name in ("init_process_group", "new_group", "new_subgroups", "new_subgroups_by_enumeration"):
        monkeypatch.setattr(dist, name, refuse)
    initialized = dist.is_initialized()
    rows = plan(["model=small", "parallel=tp2pp2", "trainer.devices=4"])
    assert dist.is_initialized() == initialized
    assert rows[0]["sizes"]["tensor"] == 2 and "most loaded rank" in capsys.readouterr().out
    # plan.json's traffic_bytes: per dimension, the most a stage's rank sends (TP and PP here)
    sent = rows[0]["traffic_bytes"]
    assert sent == {d: max(s["traffic_bytes"][d] for s in rows[0]["stages"]) for d in sent}
    assert sent["tensor"] > 0 and sent["pipeline"] > 0 and sent["data"] == sent["context"] == sent["expert"] == 0


# ------------------------------------------------------------------ the sizes, without megatron-core
def test_the_sizes_are_the_model_configs():
    """``GPTSizes.from_values`` (what the planner reads, with no megatron-core) holds what
    ``MHCTransformerConfig(**values)`` holds, derived sizes included, for every model the planner's
    grid builds and the command line's configs; its written defaults are the class's."""
    import dataclasses

    from lightning_mhc.model.config import MHCTransformerConfig
    from lightning_mhc.model.sizes import MODEL_DEFAULTS, GPTSizes

    fields = {f.name: f.default for f in dataclasses.fields(MHCTransformerConfig)}
    assert MODEL_DEFAULTS == {k: fields[k] for k in MODEL_DEFAULTS}
    minimal = dict(num_layers=2, hidden_size=48, num_attention_heads=4)
    for values in [minimal, dict(minimal, num_moe_experts=2), dict(MOE, moe_ffn_hidden_size=None),
                   *(case[0] for case in CASES), VARIED_MOE]:
        config = MHCTransformerConfig(**values)
        assert GPTSizes.from_values(values) == GPTSizes.of(config), values
        assert GPTSizes.of(config).padded_vocab_size == config.padded_vocab_size


def test_a_plan_imports_neither_megatron_nor_lightning(tmp_path):
    """``lightning-mhc-plan`` reads sizes: neither megatron-core nor Lightning is imported (their
    imports took most of its seconds), for the GPT and for a Hugging Face model (transformers, which
    builds it on the meta device, is) on a layout whose trace needs no group (PP x DP; under TP, CP or
    EP the trace runs megatron-core's groups over a fake process group)."""
    import subprocess
    import sys

    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256).save_pretrained(tmp_path / "llama")
    script = ("import sys\nfrom lightning_mhc.cli.plan import plan\nplan(sys.argv[1:])\n"
              "print('imported:', sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'lightning'}))")
    for args in (["model=small", "parallel=tp2pp2", "trainer.devices=4"],
                 ["model=hf", f"model.config={tmp_path / 'llama'}", "parallel=pp2", "trainer.devices=4"]):
        run = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=tmp_path,
                             timeout=300)
        assert run.returncode == 0, run.stderr
        assert "most loaded rank" in run.stdout and "imported: []" in run.stdout, (args, run.stdout[-300:])


@pytest.mark.parametrize("argv", [
    ["model=small", "parallel=tp2pp2", "trainer.devices=4"],
    ["model=gpt_moe_tiny", "trainer.devices=8", "data.global_batch_size=32"],
    ["model=tiny", "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true", "trainer.devices=8",
     "model.num_query_groups=2", "recompute.policy=selective", "data.global_batch_size=16"],
])
def test_a_plan_of_sizes_is_the_plan_of_the_model_config(argv):
    """The planner's rows from the sizes alone (``to_train_config(..., sizes_only=True)``) are the rows of the config
    checked and built as ``lightning-mhc-train`` builds it (megatron-core's ``MHCTransformerConfig``):
    the asked layout and every layout of its devices (the enumeration skips what the model refuses)."""
    from hydra import compose, initialize_config_dir

    from lightning_mhc.cli import preflight
    from lightning_mhc.cli.plan import _candidates, layout_row
    from lightning_mhc.model.config import with_parallel_layout
    from lightning_mhc.model.sizes import GPTSizes

    def rows(cfg):
        return [layout_row(cfg, cfg.layout, cfg.num_microbatches), *_candidates(cfg, cfg.world_size)]

    with initialize_config_dir(config_dir=preflight.CONF_DIR, version_base="1.3", job_name="test"):
        composed = compose(config_name="config", overrides=argv)
        built = preflight.to_train_config(composed)
        sized = preflight.to_train_config(composed, sizes_only=True)
    assert GPTSizes.of(built.transformer_config()) == sized.gpt_sizes()
    planned = rows(sized)
    assert planned == rows(built) and len(planned) > 2
    # each layout the enumeration keeps is one the model config takes (and the ones it skips it refuses)
    for row in planned[1:]:
        s = row["sizes"]
        layout = _layout(s["world_size"], s["tensor"], s["pipeline"], s["virtual"], s["expert"])
        with_parallel_layout(built.transformer_config(), dataclasses.replace(layout, sequence_parallel=s["sequence_parallel"]))


# ------------------------------------------------------------------ the console door
PLAN_REFUSES = "lightning-mhc-plan: invalid configuration"


def _plan_cli(*args, cwd):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "lightning_mhc.cli.plan", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_plan_cli_enumerates_layouts_that_fit(tmp_path):
    """``lightning-mhc-plan model=gpt_moe_tiny plan.devices=8``: the asked layout first in plan.json,
    equal to the planner's counts; every other layout of 8 devices fits the memory given, is one
    the model divides into, and they come most headroom first."""
    from lightning_mhc.distributed.layout import ParallelLayout
    from lightning_mhc.model.config import MHCTransformerConfig
    from lightning_mhc.planning import parse_bytes

    out = tmp_path / "plan.json"
    memory = "10MB"  # between the 8-device layouts' smallest (5.3 MB) and largest (15.3 MB) totals, MoE activations in
    run = _plan_cli("model=gpt_moe_tiny", "plan.devices=8", f"plan.device_memory={memory}", f"plan.json={out}",
                    cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    import json

    layouts = json.loads(out.read_text())["layouts"]
    assert layouts[0]["sizes"]["world_size"] == 1  # the asked layout (trainer.devices=1) first
    rest = layouts[1:]
    assert rest, run.stdout
    assert all(r["total_bytes"] <= parse_bytes(memory) for r in rest)
    assert [r["total_bytes"] for r in rest] == sorted(r["total_bytes"] for r in rest)
    assert all(r["sizes"]["world_size"] == 8 for r in rest)
    # traffic per dimension, or the one line saying why not
    assert all((r["traffic_bytes"] is None) == (r["traffic_not_counted"] is not None) for r in layouts)
    assert any(r["traffic_bytes"] and r["traffic_bytes"]["expert"] > 0 for r in rest)
    assert "fit" in run.stdout and "why:" in run.stdout
    # a layout the memory drops: the single-rank one holds every parameter
    assert layouts[0]["total_bytes"] > parse_bytes(memory)


@pytest.mark.parametrize("args, says", [
    (("model=no_such_model",), "model"),
    (("plan.devices=8", "plan.device_memory=lots"), "plan.device_memory='lots' is not a memory size"),
    (("parallel=tp2", "trainer.devices=3"), "does not divide"),
])
def test_plan_cli_refuses_in_one_line(tmp_path, monkeypatch, capsys, args, says):
    """Bad input: one line and exit status 2 (the entry point's ``main`` in this process, which the
    console script calls; the unknown model also through ``python -m``)."""
    from lightning_mhc.cli.plan import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    assert exit_.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(PLAN_REFUSES)]
    assert len(lines) == 1 and says in lines[0], lines


def test_plan_cli_refuses_through_python_m(tmp_path):
    run = _plan_cli("model=no_such_model", cwd=tmp_path)
    assert run.returncode == 2, (run.stdout, run.stderr)
    lines = [line for line in run.stderr.splitlines() if line.startswith(PLAN_REFUSES)]
    assert len(lines) == 1 and "model" in lines[0], run.stderr


# ------------------------------------------------------------------ before launch
def test_train_prints_the_plan_on_cpu(tmp_path, monkeypatch, capsys):
    """``lightning-mhc-train`` on the CPU: the planner's figure for the run, one line, not enforced."""
    from train_cli import check_before_launch

    status, err = check_before_launch(["model=small", "parallel=tp2pp2", "trainer.devices=4"], tmp_path, monkeypatch,
                                      capsys)
    lines = [line for line in err.splitlines() if line.startswith("lightning-mhc-train: plan:")]
    assert status == 0 and len(lines) == 1 and "largest term" in lines[0] and "not enforced" in lines[0], err


def test_train_refuses_a_layout_over_the_free_gpu_memory(tmp_path, monkeypatch, capsys):
    """On a GPU (its free memory faked through the probe): a layout predicted over it is refused in one
    line naming the largest term and the best layout of the same 4 devices that fits; with room
    enough it passes."""
    from hydra import compose, initialize_config_dir

    from lightning_mhc.cli import preflight
    from lightning_mhc.cli.plan import describe, fitting_layouts, largest_term, layout_row
    from train_cli import check_before_launch

    argv = ["model=small", "trainer.devices=4", "data.global_batch_size=16"]  # DP 4: each rank holds the whole model
    with initialize_config_dir(config_dir=preflight.CONF_DIR, version_base="1.3", job_name="test"):
        cfg = preflight.to_train_config(compose(config_name="config", overrides=argv))
    asked = layout_row(cfg, cfg.layout, cfg.num_microbatches)
    best = fitting_layouts(cfg, 4, asked["total_bytes"])[0]
    assert best["total_bytes"] < asked["total_bytes"]
    free = (best["total_bytes"] + asked["total_bytes"]) // 2
    monkeypatch.setattr(preflight, "free_device_memory", lambda cfg: free)
    status, err = check_before_launch(argv, tmp_path, monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1, err
    term = largest_term(asked)[0]
    assert "does not fit" in lines[0] and f"largest term {term}" in lines[0] and describe(best) in lines[0], err
    monkeypatch.setattr(preflight, "free_device_memory", lambda cfg: asked["total_bytes"])
    assert check_before_launch(argv, tmp_path, monkeypatch, capsys) == (0, "")


def test_a_command_line_run_keeps_what_its_plan_said(tmp_path):
    """Through the public doors: ``lightning-mhc-train`` (Trainer.fit on its DataLoader, 2 forked ranks,
    TP 2 with SP, 4 streams, ``mhc_block``) reports its measured ``activation_bytes`` in summary.json;
    ``lightning-mhc-plan`` with the same overrides planned them, within 5 %."""
    import json

    from lightning_mhc.cli.plan import plan
    from train_cli import run_train_on_ranks

    overrides = ["model=tiny", "parallel=tp2sp", "trainer=debug", "trainer.max_steps=1", "trainer.limit_val_batches=0",
                 "data=synthetic", "trainer.devices=2", "recompute=mhc_block"]
    run_train_on_ranks(tmp_path, *overrides, f"hydra.run.dir={tmp_path / 'run'}")
    measured = json.loads((tmp_path / "run" / "summary.json").read_text())["activation_bytes"]
    planned = plan(overrides)[0]["activation_bytes"]
    print("activation bytes: planned", planned, "measured", measured)
    assert measured and abs(planned - measured) <= 0.05 * measured, (planned, measured)
