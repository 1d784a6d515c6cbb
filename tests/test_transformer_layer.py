"""TransformerLayer and GPTModel against independent reference math (one rank, TP = 1)."""
from __future__ import annotations

import pytest
import torch

from lightning_mhc import GPTModel, HyperConnectionModule
from lightning_mhc.model import TransformerLayer
from lightning_mhc.layers.init import ParamInit
from lightning_mhc.model.rope import rotary_freqs
from model_utils import (
    mhc_sublayer_reference,
    plain_attention,
    plain_mlp,
    plain_prenorm_layer,
    rms_norm,
    tiny_config,
)


def build_layer(**overrides) -> TransformerLayer:
    return TransformerLayer(tiny_config(**overrides), 1, ParamInit(3, "layer")).eval()


@pytest.mark.parametrize("rope", [False, True])
def test_plain_layer_is_prenorm_transformer(model_parallel, rope):
    """n = 1 without hyper-connections: exactly the pre-norm layer on the same weights."""
    layer = build_layer(enable_hyper_connections=False, num_residual_streams=1)
    x = torch.randn(12, 3, 64)
    freqs = rotary_freqs(12, 16, 10000, x.device) if rope else None
    out, context = layer(x, freqs)
    assert context is None
    torch.testing.assert_close(out, plain_prenorm_layer(layer, x, freqs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 4])
def test_fresh_mhc_layer_is_prenorm_layer_per_stream(model_parallel, n):
    """With a_* = 0 and the static init, an mHC layer on expanded streams is the plain
    layer on every stream (DESIGN: identity static parts reduce to pre-norm)."""
    layer = build_layer(num_residual_streams=n, mhc_init_gating_factor=0.0)
    x = torch.randn(12, 3, 64)
    out, _ = layer(HyperConnectionModule.input_expand(x, n))
    expected = plain_prenorm_layer(layer, x)
    for i in range(n):
        torch.testing.assert_close(out[..., i * 64:(i + 1) * 64], expected, rtol=1e-5, atol=1e-5)


def test_mhc_layer_matches_equations(model_parallel):
    """A trained-looking mHC layer == eq. 7-9 applied around attention, then around the MLP."""
    layer = build_layer(add_bias_linear=True)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for hc in (layer.self_attention_hyper_connection, layer.mlp_hyper_connection):
            for p in hc.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(10, 2, 4 * 64)
    eps = layer.config.layernorm_epsilon
    attn = lambda h: plain_attention(layer, rms_norm(h, layer.input_layernorm.weight, eps), None)
    mlp = lambda h: plain_mlp(layer, rms_norm(h, layer.pre_mlp_layernorm.weight, eps))
    expected = mhc_sublayer_reference(
        layer.mlp_hyper_connection, mhc_sublayer_reference(layer.self_attention_hyper_connection, x, attn), mlp
    )
    out, _ = layer(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_hidden_dropout_active_only_in_training(model_parallel):
    layer = build_layer(hidden_dropout=0.5, attention_dropout=0.5)
    x = torch.randn(8, 2, 4 * 64)
    with torch.no_grad():
        eval_a, eval_b = layer(x)[0], layer(x)[0]
        layer.train()
        train_a, train_b = layer(x)[0], layer(x)[0]
    assert torch.equal(eval_a, eval_b)
    assert not torch.equal(train_a, train_b)


@pytest.mark.parametrize("implementation", ["fused", "reference"])
def test_exact_hidden_dropout_changes_nothing_in_one_process(model_parallel, implementation):
    """At TP 1 and CP 1 ``exact_hidden_dropout`` draws the masks of the default streams (its stream
    has the replicated stream's seed and the whole sequence is this rank's): loss and gradients bit
    for bit, with the randomizer the strategies install."""
    from lightning_mhc.distributed.random import model_parallel_manual_seed
    from lightning_mhc.recompute.rng import set_parallel_randomizer

    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    runs = []
    for exact in (False, True):
        model = GPTModel(tiny_config(hidden_dropout=0.3, exact_hidden_dropout=exact,
                                     mhc_implementation=implementation, mhc_sinkhorn_iterations=4))
        model_parallel_manual_seed(5, model_parallel)
        loss = model(tokens, labels=tokens.roll(-1, 1)).mean()
        loss.backward()
        runs.append((loss.detach(), {name: p.grad for name, p in model.named_parameters()}))
    set_parallel_randomizer(None)
    (loss, grads), (exact_loss, exact_grads) = runs
    assert torch.equal(loss, exact_loss)
    assert all(torch.equal(grads[name], exact_grads[name]) for name in grads)
    model.eval()  # and dropout was on: eval differs
    assert not torch.equal(model(tokens, labels=tokens.roll(-1, 1)).mean().detach(), exact_loss)


def test_gpt_forward_backward_shapes(model_parallel):
    cfg = tiny_config(vocab_size=200, hidden_dropout=0.1, attention_dropout=0.1)
    model = GPTModel(cfg)
    assert cfg.padded_vocab_size == 256
    tokens = torch.randint(0, 200, (3, 16))
    logits = model(tokens)
    assert logits.shape == (3, 16, 256)
    loss = model(tokens, labels=tokens.roll(-1, 1))
    assert loss.shape == (3, 16)
    # untrained loss is near ln(V)
    assert abs(loss.mean().item() - torch.log(torch.tensor(256.0)).item()) < 0.5
    loss.mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing
    # tied output layer: one weight, used twice
    assert model.output_layer.weight is None
    assert model.output_weight() is model.embedding.word_embeddings.weight


def test_gpt_stages_compose_to_the_full_model(model_parallel):
    """Stages built with pre/post_process and layer ranges, chained, equal the whole model
    (same weights by construction: initialisation depends only on global names)."""
    cfg = tiny_config(position_embedding_type="learned_absolute")
    full = GPTModel(cfg)
    first = GPTModel(cfg, pre_process=True, post_process=False, layer_range=(0, 1))
    middle = GPTModel(cfg, pre_process=False, post_process=False, layer_range=(1, 3))
    last = GPTModel(cfg, pre_process=False, post_process=True, layer_range=(3, 4))
    tokens = torch.randint(0, 256, (2, 10))
    labels = tokens.roll(-1, 1)
    hidden = first(tokens)
    assert hidden.shape == (10, 2, 4 * 64)
    middle.set_input_tensor(hidden)
    last.set_input_tensor(middle(None))
    torch.testing.assert_close(last(None, labels=labels), full(tokens, labels=labels), rtol=0, atol=0)
    # the untied copy of the output weight on the last stage starts equal to the embedding
    assert torch.equal(last.output_layer.weight, full.embedding.word_embeddings.weight)
    assert getattr(last.output_layer.weight, "shared_embedding", False)


def test_middle_stage_without_input_tensor_errors(model_parallel):
    stage = GPTModel(tiny_config(), pre_process=False, post_process=False, layer_range=(1, 2))
    with pytest.raises(RuntimeError, match="set_input_tensor"):
        stage(None)


def test_gated_mlp_and_grouped_query_attention_run(model_parallel):
    cfg = tiny_config(num_query_groups=2, gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    model = GPTModel(cfg)
    tokens = torch.randint(0, 256, (2, 8))
    model(tokens, labels=tokens).mean().backward()
