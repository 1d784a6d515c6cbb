"""A hyper-connected Hugging Face model under the idioms a user applies next, in one process, on
tiny Llama, Gemma 2 and GPT-NeoX configs: gradient checkpointing (reentrant and not) gives every
gradient of the unchecked run; ``save_pretrained`` writes what ``load_pretrained`` needs (and the
base class still reads its weights); ``output_hidden_states`` has the unmodified model's shapes;
``copy.deepcopy`` and ``torch.save``/``torch.load`` give independent working copies; ``generate``
and ``torch.compile`` match; bad inputs are one-line ConfigErrors naming what the user wrote."""
from __future__ import annotations

import copy
import pathlib
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")

sys.path.insert(0, str(pathlib.Path(__file__).parent / "scripts"))
from script_runs import run_source_on_a_rank  # noqa: E402
from lm_models import SEQ, VOCAB, WIDTH, PlainTransformer, gemma2, gpt_neox, llama, opt  # noqa: E402

import lightning_mhc  # noqa: E402
from lightning_mhc import ConfigError, add_hyper_connections, record_module_init  # noqa: E402
from lightning_mhc.any_model import Branch, HyperConnectionPlan  # noqa: E402

FAMILIES = {"llama": llama, "gemma2": gemma2, "gpt_neox": gpt_neox}
TOKENS = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
STREAMS = 4
PLAIN_BRANCHES = HyperConnectionPlan((Branch("ln1", "attn"), Branch("ln2", "mlp_drop")))


def _hyper_connected(family: str, gating: float = 0.5) -> nn.Module:
    """``family``'s tiny model with weights off the seed's and hyper-connections whose gating
    factors are off zero, so their parameters are in the gradient and change the logits."""
    torch.manual_seed(1)
    model = FAMILIES[family]()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return add_hyper_connections(model, STREAMS, init_gating_factor=gating, implementation="reference")


def _logits(model: nn.Module, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=TOKENS, labels=TOKENS)
    out.loss.backward()
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_gradient_checkpointing_gives_every_gradient_of_the_unchecked_run(family, reentrant):
    """``gradient_checkpointing_enable()`` (transformers' own, each block's forward re-run in the
    backward): every parameter's gradient, the hyper-connections' included, equals the unchecked
    run's within 1e-6, and none is missing."""
    model = _hyper_connected(family)
    expected = _grads(model)
    assert sum(".hyper_connections." in n for n in expected) == 3 * STREAMS * 2  # (phi, alpha, bias) per branch
    assert all(g is not None for g in expected.values())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    got = _grads(model)
    missing = [n for n, g in got.items() if g is None]
    assert not missing, f"no gradient for {len(missing)} parameters, e.g. {missing[:3]}"
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("make", [llama, opt], ids=["llama", "opt"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_gradient_checkpointing_with_dropout_is_bit_exact(make, reentrant):
    """With dropout (Llama's in its attention; OPT's after each branch, drawn in the
    hyper-connections' own bias-dropout-add): the re-run block draws the same masks, so every
    gradient equals the unchecked run's bit for bit. Here in a plain process (a run's randomizer is
    gone after its teardown); under the strategy's randomizer: test_process_state."""
    torch.manual_seed(1)
    model = add_hyper_connections(make(dropout=0.1), STREAMS, init_gating_factor=0.5, implementation="reference")

    def grads() -> dict[str, torch.Tensor]:
        torch.manual_seed(7)
        return _grads(model)

    expected = grads()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    got = grads()
    assert all(torch.equal(got[name], grad) for name, grad in expected.items())


class _Checkpointed(nn.Module):
    """A block run under ``torch.utils.checkpoint``, as a user wraps one."""

    def __init__(self, block: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.block, self.reentrant = block, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_torch_checkpoint_of_a_users_block_gives_every_gradient(reentrant):
    """A hand-written model with the docs' plan, each block then wrapped in
    ``torch.utils.checkpoint``: every gradient equals the unwrapped run's (1e-6)."""
    torch.manual_seed(2)
    model = add_hyper_connections(PlainTransformer(), STREAMS, plan=PLAIN_BRANCHES, init_gating_factor=0.5,
                                  implementation="reference")

    def grads() -> dict[str, torch.Tensor | None]:
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=TOKENS)
        nn.functional.cross_entropy(logits.flatten(0, 1), TOKENS.flatten()).backward()
        return {n.replace("block.", ""): p.grad for n, p in model.named_parameters()}

    expected = grads()
    model.blocks = nn.ModuleList(_Checkpointed(block, reentrant) for block in model.blocks)
    got = grads()
    assert got.keys() == expected.keys() and all(g is not None for g in got.values())
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_save_pretrained_writes_what_load_pretrained_needs(family, tmp_path):
    """The model's own ``save_pretrained(d)`` (its defaults) writes the hyper-connections beside
    the base model: ``lightning_mhc.load_pretrained(d)`` gives the same logits (1e-6), and the base
    class's ``from_pretrained(d)`` reads the base weights (the plain model's tensors, no warning of
    unexpected ones)."""
    model = _hyper_connected(family).eval()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "hyper_connections.json").is_file()
    loaded = lightning_mhc.load_pretrained(tmp_path).eval()
    assert loaded.hyper_connection_settings == model.hyper_connection_settings
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=1e-6)
    base = type(model).from_pretrained(tmp_path)  # the model's own class: only its blocks are rewired
    base_state = base.state_dict()
    for name, tensor in model.state_dict().items():
        if ".hyper_connections." not in name:
            assert torch.equal(base_state[name], tensor), name
    assert not any(".hyper_connections." in n for n in base_state)


def test_save_pretrained_with_its_arguments(tmp_path):
    """``save_pretrained`` with a ``state_dict`` (as Hugging Face's Trainer passes one): the
    hyper-connection tensors are taken from it; with ``is_main_process=False`` nothing of them is
    written (the main process writes them); sharded files are still read back whole."""
    model = _hyper_connected("llama").eval()
    state = {name: t.clone() for name, t in model.state_dict().items()}
    alpha = next(name for name in state if name.endswith("hyper_connections.0.alpha"))
    state[alpha] += 1.0
    model.save_pretrained(tmp_path / "given", state_dict=state, max_shard_size="40KB")
    assert len(list((tmp_path / "given").glob("model-*.safetensors"))) > 1
    loaded = lightning_mhc.load_pretrained(tmp_path / "given")
    assert torch.equal(loaded.state_dict()[alpha], state[alpha])
    model.save_pretrained(tmp_path / "worker", is_main_process=False)
    assert not (tmp_path / "worker" / "hyper_connections.json").exists()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hidden_states_have_the_unmodified_models_shapes(family):
    """``output_hidden_states=True``: one ``[batch, seq, C]`` tensor per block and the embedding,
    as the unmodified model returns them; at step 0 (gates at zero) they equal its values (each
    block's is the streams' mean)."""
    torch.manual_seed(1)
    plain = FAMILIES[family]().eval()
    with torch.no_grad():
        expected = plain(input_ids=TOKENS, output_hidden_states=True).hidden_states
        model = add_hyper_connections(plain, STREAMS, implementation="reference")
        got = model(input_ids=TOKENS, output_hidden_states=True).hidden_states
        base = getattr(model, model.base_model_prefix)  # the base model on its own, returning a tuple
        in_tuple = base(input_ids=TOKENS, output_hidden_states=True, return_dict=False)[-1]
    assert [tuple(h.shape) for h in got] == [tuple(h.shape) for h in expected] == [(2, SEQ, WIDTH)] * len(expected)
    for mine, theirs in zip(got, expected):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)
    assert len(in_tuple) == len(expected)
    for mine, theirs in zip(in_tuple, expected):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)


def _train_once(model: nn.Module) -> None:
    """One SGD step (lr 0.1) on the test batch."""
    model.zero_grad(set_to_none=True)
    model.train()
    model(input_ids=TOKENS, labels=TOKENS).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(0.1 * p.grad)
    model.eval()


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("how", ["deepcopy", "torch_save"])
def test_a_copy_gives_the_same_logits_and_trains_on_its_own(family, how, tmp_path):
    """``copy.deepcopy(model)`` and ``torch.save(model)``/``torch.load``: the copy's logits equal
    the model's; a training step of the copy changes it and leaves the original as it was; its
    hyper-connections (and ``save_pretrained``) are its own."""
    model = _hyper_connected(family).eval()
    before = _logits(model)
    if how == "deepcopy":
        other = copy.deepcopy(model)
    else:
        torch.save(model, tmp_path / "model.pt")
        other = torch.load(tmp_path / "model.pt", weights_only=False)
    torch.testing.assert_close(_logits(other), before, rtol=0, atol=0)
    _train_once(other)
    assert (_logits(other) - before).abs().max() > 1e-4
    torch.testing.assert_close(_logits(model), before, rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters())
    other.save_pretrained(tmp_path / "copy")
    torch.testing.assert_close(_logits(lightning_mhc.load_pretrained(tmp_path / "copy").eval()), _logits(other),
                               rtol=0, atol=1e-6)


LOAD_IN_ANOTHER_PROCESS = """
import torch
model = torch.load("model.pt", weights_only=False).eval()
with torch.no_grad():
    torch.save(model(input_ids=torch.load("tokens.pt")).logits, "logits.pt")
"""


def test_a_pickled_model_loads_in_a_fresh_process(tmp_path):
    """``torch.load`` in a process that never made the hyper-connected classes (the pickle names
    each by its base class): the same logits. The process is a rank forked from the preloaded
    server (``run_source_on_a_rank``), which imported the package but never built a model: what it
    lacks is the classes, as a fresh interpreter lacks them, without its 7 s of imports."""
    model = _hyper_connected("gemma2").eval()
    torch.save(model, tmp_path / "model.pt")
    torch.save(TOKENS, tmp_path / "tokens.pt")
    run_source_on_a_rank(LOAD_IN_ANOTHER_PROCESS, tmp_path)
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), _logits(model), rtol=0, atol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_with_its_cache_is_the_unmodified_models(family):
    """Greedy ``generate`` (its KV cache on) of the hyper-connected model at step 0 gives the
    unmodified model's tokens, and with gates off zero the same tokens with and without the cache."""
    torch.manual_seed(1)
    plain = FAMILIES[family]().eval()
    prompt = TOKENS[:, :4]
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = plain.generate(prompt, **options)
    add_hyper_connections(plain, STREAMS, implementation="reference")
    assert torch.equal(plain.generate(prompt, **options), expected)
    gated = _hyper_connected(family).eval()
    assert torch.equal(gated.generate(prompt, use_cache=True, **options),
                       gated.generate(prompt, use_cache=False, **options))


@pytest.mark.parametrize("family", ["llama"])
def test_torch_compile_forward_and_backward_equal_eager(family):
    """``torch.compile(model)``: the loss and every gradient equal the eager model's (1e-5)."""
    model = _hyper_connected(family)
    expected = _grads(model)
    compiled = torch.compile(model, backend="aot_eager")
    compiled.zero_grad(set_to_none=True)
    out = compiled(input_ids=TOKENS, labels=TOKENS)
    out.loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("call, match", [
    (lambda m: add_hyper_connections(m, 1, plan="bogus"), r"plan='bogus'"),
    (lambda m: add_hyper_connections(m, 4, seed="x"), r"seed='x'"),
    (lambda m: add_hyper_connections(m, 4, plan={"branches": [{"entry": "input_layernorm", "exti": "self_attn"}]}),
     r"'exti'"),
    (lambda m: add_hyper_connections(m, 4, plan={"branch": []}), r"'branch'"),
    (lambda m: lightning_mhc.parallelize(m, "llama", hyper_connections=0), r"parallelize\(hyper_connections=0\)"),
], ids=["plan_with_one_stream", "seed", "branch_key", "plan_key", "parallelize_zero"])
def test_bad_inputs_are_one_line_config_errors_naming_what_the_user_wrote(call, match):
    """Each a ConfigError of one line naming the argument as written (``parallelize``'s before it
    needs a process group)."""
    with record_module_init():
        model = llama()
    with pytest.raises(ConfigError, match=match) as raised:
        call(model)
    assert "\n" not in str(raised.value)


def test_stream_divergence_and_its_monitor():
    """The divergence is 0 for copies and sqrt((n - 1) / n) for independent streams; the monitor
    records a block's first forward of an armed step only (a recompute's re-run, later
    microbatches and unarmed steps are not counted), and a retrofit's blocks report their streams
    before the last block's mean: exactly 0 at the retrofit's start."""
    from lightning_mhc.model.divergence import StreamDivergenceMonitor, stream_divergence

    x = torch.randn(64, 1, 256, generator=torch.Generator().manual_seed(0))
    assert stream_divergence(x.repeat(1, 1, 4), 4) == 0.0
    independent = torch.randn(4096, 4 * 256, generator=torch.Generator().manual_seed(1))
    assert abs(stream_divergence(independent, 4) - (3 / 4) ** 0.5) < 0.01
    monitor = StreamDivergenceMonitor(4)
    monitor.observe("a", independent)
    assert monitor.take() == {}  # not armed
    monitor.armed = True
    monitor.observe("a", x.repeat(1, 1, 4))
    monitor.observe("a", independent)  # the same block again in the step: not counted
    assert monitor.take() == {"a": 0.0} and not monitor.armed

    from lightning_mhc.any_model.hyper_connections import hyper_connection_blocks
    from lightning_mhc.roles import assign_roles

    torch.manual_seed(0)
    model = add_hyper_connections(llama(), 4)
    monitor = StreamDivergenceMonitor(4)
    for block in hyper_connection_blocks(model):
        assign_roles(block, hyper_connection_observer=monitor.observe)
    monitor.armed = True
    model(input_ids=torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2)))
    assert monitor.take() == {f"model.layers.{i}": 0.0 for i in range(len(model.model.layers))}


def test_the_checks_change_nothing_and_one_registry_holds_both_plans():
    """``check_parallelize`` with hyper-connections checks a copy (the model it was given can then be
    parallelized, or checked again); every built-in family is one ``FAMILIES`` entry holding its TP
    plan and its hyper-connection plan, which the two lookups read."""
    from lightning_mhc.distributed.layout import ParallelLayout
    from lightning_mhc.any_model import FAMILIES, HC_PLANS, PLANS, check_parallelize
    from lightning_mhc.any_model.families import resolve_hc_plan, resolve_plan

    with record_module_init():
        model = llama()
    names = {name for name, _ in model.named_modules()}
    for _ in range(2):
        plan, parts, _ = check_parallelize(model, "auto", layout=ParallelLayout(), hyper_connections=4)
        assert len(parts.blocks) == 4 and all(hasattr(b, "hyper_connection_wiring") for b in parts.blocks)
    assert getattr(model, "hyper_connection_settings", None) is None
    assert {name for name, _ in model.named_modules()} == names
    # 4 of them MoE (experts.py); DeepSeek-V4 and HY-V4 carry streams of their own (no hyper-connection plan)
    assert PLANS.keys() == FAMILIES.keys() and len(FAMILIES) == 18
    assert HC_PLANS.keys() == {name for name, family in FAMILIES.items() if family.native_streams is None}
    assert FAMILIES.keys() - HC_PLANS.keys() == {"deepseek_v4", "hy_v4"}
    for name, family in FAMILIES.items():
        assert resolve_plan(name) is family.tp is PLANS[name]
    assert resolve_plan("auto", model) is FAMILIES["llama"].tp
    assert resolve_hc_plan("auto", model) is FAMILIES["llama"].hyper_connections


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_peft_lora_trains_the_adapters_and_the_hyper_connections(tmp_path):
    """PEFT's LoRA on a hyper-connected Llama, the hyper-connections in ``modules_to_save``
    (``hyper_connection_modules``): the logits before training are the model's (LoRA's B starts at
    zero); three AdamW steps move every adapter and every hyper-connection tensor and leave the
    frozen base weights as they were; the PEFT model's ``save_pretrained`` read back by
    ``PeftModel.from_pretrained`` on a fresh hyper-connected base gives the trained logits (1e-6),
    and so does the merged model through its ``save_pretrained`` and ``load_pretrained``."""
    peft = pytest.importorskip("peft")
    model = _hyper_connected("llama").eval()
    before = _logits(model)
    frozen = {name: t.clone() for name, t in model.state_dict().items()}
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             modules_to_save=lightning_mhc.hyper_connection_modules(model))
    tuned = peft.get_peft_model(model, config)
    torch.testing.assert_close(_logits(tuned), before, rtol=0, atol=0)
    trainable = {name: p for name, p in tuned.named_parameters() if p.requires_grad}
    adapters = [n for n in trainable if ".lora_" in n]
    hyper_connections = [n for n in trainable if ".hyper_connections." in n]
    assert len(adapters) == 2 * 2 * 4 and len(hyper_connections) == 3 * 2 * 4  # (A, B) x (q, v); (phi, alpha, bias) x 2
    assert len(trainable) == len(adapters) + len(hyper_connections)
    start = {name: p.detach().clone() for name, p in trainable.items()}
    optimizer = torch.optim.AdamW(trainable.values(), lr=1e-2)
    tuned.train()
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        tuned(input_ids=TOKENS, labels=TOKENS).loss.backward()
        optimizer.step()
    tuned.eval()
    unmoved = [name for name, p in trainable.items() if torch.equal(p, start[name])]
    assert not unmoved, f"{len(unmoved)} trainable tensors did not move, e.g. {unmoved[:3]}"
    base = {name.removeprefix("base_model.model.").replace(".original_module", "").replace(".base_layer", ""): t
            for name, t in tuned.state_dict().items() if ".lora_" not in name and ".modules_to_save." not in name}
    assert base.keys() == frozen.keys() and all(torch.equal(base[n], frozen[n]) for n in frozen)
    trained = _logits(tuned)
    assert (trained - before).abs().max() > 1e-3
    tuned.save_pretrained(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(_hyper_connected("llama"), tmp_path / "adapter").eval()
    torch.testing.assert_close(_logits(reloaded), trained, rtol=0, atol=1e-6)
    merged = tuned.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    torch.testing.assert_close(_logits(lightning_mhc.load_pretrained(tmp_path / "merged").eval()), trained,
                               rtol=0, atol=1e-5)
