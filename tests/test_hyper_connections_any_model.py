"""mHC for any model (``add_hyper_connections``, ``parallelize(hyper_connections=n)``), in one process:
the retrofit is exact at step 0 for every built-in family, from ``from_pretrained`` weights of
sharded ``save_pretrained`` files; training moves it off the plain model; the block recompute
equals no recompute bit for bit with dropout and keeps less; the meta and the materialised paths
draw the same parameters; wrong plans and settings are refused naming what is wrong. The parallel
layouts are in ``test_parallelize.py`` (``:hc`` cases of ``scripts/fit_parallelize.py``)."""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

sys.path.insert(0, str(pathlib.Path(__file__).parent / "scripts"))
from lm_models import FAMILIES, SEQ, VOCAB, PlainTransformer, gpt2, llama  # noqa: E402

from lightning_mhc import ConfigError, add_hyper_connections  # noqa: E402
from lightning_mhc.any_model import (  # noqa: E402
    Branch, HyperConnectionPlan, build_recorded_module, parallelize, record_module_init)
from lightning_mhc.recompute import RecomputePolicy  # noqa: E402
from lightning_mhc.recompute.manager import MHCBlockRecomputeManager  # noqa: E402

BUILT_IN = {"gpt2": gpt2, "llama": llama, **{name: make for name, (make, _) in FAMILIES.items()}}
PLAIN_BRANCHES = HyperConnectionPlan((Branch("ln1", "attn"), Branch("ln2", "mlp_drop")))
"""The docs' plan for the hand-written block of ``lm_models.PlainTransformer``."""
TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=TOKENS)
    return out if isinstance(out, torch.Tensor) else out.logits


def _pretrained(make, directory: pathlib.Path) -> nn.Module:
    """``make()``'s model with weights no seed gives (norms off one), through sharded files."""
    model = make()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory, max_shard_size="20KB")
    assert len(list(directory.glob("*.safetensors"))) > 1
    return type(model).from_pretrained(directory).eval()


@pytest.mark.parametrize("family", list(BUILT_IN))
def test_the_retrofit_of_a_pretrained_model_keeps_its_logits(family, tmp_path):
    """Every built-in family, from sharded ``save_pretrained`` files: the logits with 4 (and 3)
    streams equal the unmodified model's within 1e-5; with gating factors off zero they differ."""
    torch.manual_seed(1)
    model = _pretrained(BUILT_IN[family], tmp_path / family)
    before = _logits(model)
    assert add_hyper_connections(model, num_residual_streams=4) is model
    assert model.hyper_connection_settings.num_residual_streams == 4
    torch.testing.assert_close(_logits(model), before, rtol=0, atol=1e-5)
    three = add_hyper_connections(type(model).from_pretrained(tmp_path / family).eval(), 3, implementation="reference")
    torch.testing.assert_close(_logits(three), before, rtol=0, atol=1e-5)
    gated = add_hyper_connections(type(model).from_pretrained(tmp_path / family).eval(), 4, init_gating_factor=0.5)
    assert (_logits(gated) - before).abs().max() > 1e-3  # the hyper-connections are in the forward


def test_a_users_plan_for_a_hand_written_block(tmp_path):
    """``PlainTransformer`` (a block written by hand) with the docs' plan: exact at step 0; one
    training step moves every gating factor (each hyper-connection is in the graph)."""
    torch.manual_seed(2)
    model = PlainTransformer().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    before = _logits(model)
    with pytest.raises(ConfigError, match=r"has no config.model_type.*HyperConnectionPlan"):
        add_hyper_connections(model, 4)
    add_hyper_connections(model, 4, plan=PLAIN_BRANCHES)
    torch.testing.assert_close(_logits(model), before, rtol=0, atol=1e-5)
    model.train()
    logits = model(input_ids=TOKENS)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), TOKENS.flatten()).backward()
    alphas = [p for name, p in model.named_parameters() if name.endswith("hyper_connections.0.alpha")]
    assert len(alphas) == 4 and all(p.grad is not None and p.grad.abs().sum() > 0 for p in alphas)


def test_the_recorded_and_the_materialised_paths_draw_the_same_parameters(model_parallel):
    """``add_hyper_connections`` on a recorded (meta) Llama, then ``build_recorded_module``; on the
    materialised one; and ``parallelize(hyper_connections=4)``: the same hyper-connection
    parameters by name (drawn from the seed by name), the same logits as the plain model."""
    def recorded():
        with record_module_init():
            return llama()

    plain = build_recorded_module(recorded(), seed=3).eval()
    on_meta = build_recorded_module(add_hyper_connections(recorded(), 4, seed=3), seed=3).eval()
    on_real = add_hyper_connections(build_recorded_module(recorded(), seed=3), 4, seed=3).eval()
    split = parallelize(recorded(), "llama", seed=3, hyper_connections=4).eval()

    def hc(named):
        return {name: t for name, t in named if ".hyper_connections." in name}

    meta_params = hc(on_meta.named_parameters())
    assert len(meta_params) == 4 * 2 * 3  # blocks x branches x (phi, alpha, bias)
    for other in (hc(on_real.named_parameters()),
                  {split.global_parameter_name(n): t for n, t in hc(split.named_parameters()).items()}):
        assert other.keys() == meta_params.keys()
        assert all(torch.equal(other[n], meta_params[n]) for n in meta_params)
    reference = _logits(plain)
    for model in (on_meta, on_real, split):
        torch.testing.assert_close(_logits(model), reference, rtol=0, atol=1e-5)
    assert split.pipeline_tensor_shape({"input_ids": TOKENS}) == (2, SEQ, 4 * 64)


def _train_step(policy: str, dropout: float, streams: int = 4, plan="llama"):
    torch.manual_seed(0)
    with record_module_init():
        model = llama(dropout=dropout)
    split = parallelize(model, plan, seed=1, hyper_connections=streams, recompute=policy).train()
    torch.manual_seed(5)
    loss = split.loss(split(input_ids=TOKENS), TOKENS)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in split.named_parameters()}


def test_block_recompute_equals_no_recompute_bit_for_bit_with_dropout(model_parallel, monkeypatch):
    """``recompute="mhc_block"`` (and ``"full"``) on a Llama with 4 streams and attention dropout:
    the loss and every gradient equal ``none``'s bit for bit; the block recompute ran (one unified
    recompute per group of blocks) and freed the hyper-connections' outputs."""
    recomputes: list[MHCBlockRecomputeManager] = []
    original = MHCBlockRecomputeManager._unified_recompute_hook

    def counted(self, grad):
        recomputes.append(self)
        return original(self, grad)

    monkeypatch.setattr(MHCBlockRecomputeManager, "_unified_recompute_hook", counted)
    loss, grads = _train_step("none", 0.1)
    for policy in ("mhc_block", RecomputePolicy("mhc_block", layer_num=3), "full"):
        other_loss, other_grads = _train_step(policy, 0.1)
        assert torch.equal(loss, other_loss), policy
        assert other_grads.keys() == grads.keys()
        assert all(torch.equal(grads[n], other_grads[n]) for n in grads), policy
    # 4 blocks: the paper's group size max(1, int(sqrt(4 * 4 / 6))) = 1, one manager per block; then
    # groups of layer_num=3 blocks, the last one shorter (backward: the last group first)
    assert [m.name for m in recomputes] == [f"model.layers.{i}..model.layers.{i}" for i in (3, 2, 1, 0)] + [
        "model.layers.3..model.layers.3", "model.layers.0..model.layers.2"]
    plan = recomputes[3].last_plan  # the first block's
    assert [e.name for e in plan] == ["model.layers.0.input_layernorm+hyper_connection",
                                      "model.layers.0.self_attn+h_res_h_post",
                                      "model.layers.0.post_attention_layernorm+hyper_connection"]
    assert all(e.bytes_freed > 0 for e in plan)


def test_one_stream_is_the_model_as_it_is(model_parallel):
    """``n = 1`` adds nothing: no parameters, and training (losses and gradients) is the plain
    model's bit for bit, not only at step 0."""
    loss, grads = _train_step("none", 0.0, streams=1)
    with record_module_init():
        model = llama()
    torch.manual_seed(0)
    plain = parallelize(model, "llama", seed=1).train()
    torch.manual_seed(5)
    plain_loss = plain.loss(plain(input_ids=TOKENS), TOKENS)
    plain_loss.backward()
    assert not any(".hyper_connections." in n for n in grads)
    assert torch.equal(loss, plain_loss.detach())
    assert all(torch.equal(grads[n], p.grad) for n, p in plain.named_parameters())


@pytest.mark.parametrize("call, match", [
    (lambda m: add_hyper_connections(m, 0), r"num_residual_streams=0: the residual stream is n >= 1 streams"),
    (lambda m: add_hyper_connections(m, 2.5), r"num_residual_streams=2.5"),
    (lambda m: add_hyper_connections(m, 4, init_gating_factor=-1.0), r"mhc_init_gating_factor=-1.0"),
    (lambda m: add_hyper_connections(m, 4, implementation="cuda"), r"mhc_implementation='cuda'"),
    (lambda m: add_hyper_connections(m, 4, plan=HyperConnectionPlan((Branch("input_layernorm", "attn"),))),
     r"plan exit 'attn' is not a module of model.layers.0 \(LlamaDecoderLayer"),
    (lambda m: add_hyper_connections(m, 4, plan="bloom"), r"plan=.bloom., and no built-in plan fits"),
    (lambda m: add_hyper_connections(add_hyper_connections(m, 4), 2), r"has hyper-connections already"),
])
def test_bad_settings_and_plans_are_refused_naming_what_is_wrong(call, match):
    with pytest.raises(ConfigError, match=match):
        call(llama())


def test_a_plan_out_of_the_blocks_order_is_refused_when_it_runs():
    """Branches named in another order than the block runs them: a clear error at the first
    forward, not wrong numbers."""
    model = add_hyper_connections(llama(), 4, plan=HyperConnectionPlan((
        Branch("post_attention_layernorm", "mlp"), Branch("input_layernorm", "self_attn"))))
    with pytest.raises(RuntimeError, match=r"model.layers.0.input_layernorm ran as branch 1 of the block, but the "
                                           r"hyper-connection plan names it branch 2: the plan's branches must name"):
        _logits(model)


def test_mhc_block_without_hyper_connections_is_refused_by_parallelize(model_parallel):
    with record_module_init():
        model = llama()
    with pytest.raises(ConfigError, match=r"recompute='mhc_block' needs a model with hyper-connections "
                                          r"\(parallelize\(\.\.\., hyper_connections=n\)"):
        parallelize(model, "llama", recompute="mhc_block")
