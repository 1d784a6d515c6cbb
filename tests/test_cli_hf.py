"""``lightning-mhc-train model=hf``: a Hugging Face checkpoint continued (or a config trained from
fresh weights), with hyper-connections added by ``model.hyper_connections``, from the command line.

Every bad setting is refused before launch in one line naming its key (exit 2, no run directory);
the slow test continues a saved Llama with 4 streams on the shipped sample corpus on TP 2 x PP 2
with the block recompute (the loss falls), exports it, and ``load_pretrained`` rebuilds it in one
process with the parallel run's logits."""
from __future__ import annotations

import json
import pathlib
import shutil
import sys

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(pathlib.Path(__file__).parent / "scripts"))
from lm_models import save_sample_llama  # noqa: E402
from script_runs import run_module_on_a_rank  # noqa: E402
from subprocess_env import child_env  # noqa: E402
from train_cli import check_before_launch, run_train_on_ranks, stream_divergences, train_losses  # noqa: E402

from lightning_mhc.data.sample import SAMPLE_DIR, SAMPLE_VOCAB  # noqa: E402

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> pathlib.Path:
    return save_sample_llama(tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def sample_data(tmp_path_factory) -> pathlib.Path:
    """The sample corpus in Megatron's indexed format, tokenized by the sample BPE (the Llama's)."""
    import subprocess

    out = tmp_path_factory.mktemp("data")
    subprocess.run([sys.executable, "-m", "lightning_mhc.cli.preprocess", "--input", "sample", "--json-keys", "text",
                    "--tokenizer", "sample", "--output-prefix", str(out / "sample"), "--workers", "1",
                    "--append-eod"], check=True, capture_output=True, env=child_env(), timeout=300)
    return out / "sample_text_document"


def _hf(llama_dir, *extra):
    return ["model=hf", f"model.pretrained={llama_dir}", "data=synthetic", *extra]


@pytest.mark.parametrize("extra, message", [
    ([], None),  # the valid run: accepted
    (["model.hyper_connections=4", "parallel=tp2pp2", "trainer.devices=4", "recompute=mhc_block"], None),
    (["model.hyper_connections=0"], r"model.hyper_connections=0: the residual stream is n >= 1 streams"),
    (["recompute=mhc_block"], r"recompute.policy=mhc_block needs model.hyper_connections=<n >= 2> \(model=hf\)"),
    (["parallel=tp2", "trainer.devices=2", "model.hyper_connections=4"], None),
    (["parallel.tensor_model_parallel_size=8", "trainer.devices=8"],
     r"model.pretrained=.*: model.layers.0.self_attn.config.num_attention_heads=4 cannot be split across "
     r"parallel.tensor_model_parallel_size=8: each TP rank must hold whole attention heads"),
    (["parallel=tp2sp", "trainer.devices=2", "model.hyper_connections=4"], None),
    (["parallel=tp2sp", "trainer.devices=2", "data.seq_length=63"],
     r"parallel.sequence_parallel=true splits data.seq_length=63 over parallel.tensor_model_parallel_size=2 ranks"),
    (["parallel=pp4", "trainer.devices=4", "parallel.virtual_pipeline_model_parallel_size=2",
      "data.global_batch_size=16", "data.micro_batch_size=2"],
     r"4 blocks cannot fill 8 pipeline stages"),
    (["model.num_layers=8"], r"model.num_layers=8: the project's GPT reads it, not model=hf"),
    # the GPT's keys at their GPT defaults: refused all the same (they were silently ignored)
    (["model.enable_hyper_connections=true", "model.num_residual_streams=4"],
     r"model.enable_hyper_connections=true: the project's GPT reads it, not model=hf.* give "
     r"model.hyper_connections=<n>"),
    (["model.num_residual_streams=4"], r"model.num_residual_streams=4: the project's GPT reads it"),
    (["model.hidden_dropout=0.1"], r"model.hidden_dropout=0.1: the project's GPT reads it"),
    (["model.plan=bloom"], r"model.plan=bloom: LlamaForCausalLM names no built-in plan; the command line takes the "
                           r"built-in plans \(.*llama.*\).* call parallelize\(\) from Python"),
    (["model.init_seed=-1"], r"model.init_seed=-1: must be an integer >= 0"),
    (["parallel=tp2cp2", "trainer.devices=4", "model.hyper_connections=4"], None),  # Llama: split over CP
    (["parallel=cp2", "trainer.devices=2", "data.seq_length=62"],
     r"parallel.context_parallel_size=2 cuts data.seq_length=62 into 2 \* 2 chunks: use a sequence length divisible "
     r"by 4"),
    (["data.seq_length=256"], r"data.seq_length=256 exceeds its max_position_embeddings=128"),
    (["parallel.expert_model_parallel_size=2", "trainer.devices=2"],
     r"parallel.expert_model_parallel_size=2: LlamaForCausalLM has no fused experts .* to split; set it to 1"),
    # the GPT's and a biased router's key (DeepSeek-V4's): on a family without such routers, refused
    (["model.moe_router_bias_update_rate=0.001"],
     r"model.pretrained=.*: model.moe_router_bias_update_rate=0.001: llama has no routers with a score-correction bias"),
    (["model.moe_router_bias_update_rate=0"], None),
])
def test_the_command_line_checks_a_hugging_face_model_before_launch(llama_dir, extra, message, tmp_path, monkeypatch,
                                                                   capsys):
    status, err = check_before_launch(_hf(llama_dir, *extra), tmp_path, monkeypatch, capsys)
    if message is None:
        assert status == 0, err
        return
    import re

    assert status == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert not (tmp_path / "outputs").exists()


def test_a_family_without_a_plan_and_a_missing_model_are_refused(tmp_path, monkeypatch, capsys):
    """A config of a family with no built-in plan, a directory without config.json, both model keys; an MoE
    model's expert-parallel sizes (``any_model/experts.py``): one that divides its experts is accepted."""
    from transformers import BloomConfig, MixtralConfig

    BloomConfig(n_layer=2, hidden_size=32, n_head=4, vocab_size=300).save_pretrained(tmp_path / "bloom")
    MixtralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2,
                  num_local_experts=4, vocab_size=300).save_pretrained(tmp_path / "mixtral")
    mixtral = ["model=hf", f"model.config={tmp_path / 'mixtral'}", "data=synthetic", "model.hyper_connections=4"]
    # an MoE model's experts over EP 2 (DP 2) are accepted; 4 experts over EP 4 ranks too, not over 3
    assert check_before_launch([*mixtral, "parallel.expert_model_parallel_size=2", "trainer.devices=2"], tmp_path,
                               monkeypatch, capsys)[0] == 0
    cases = [
        ([*mixtral, "parallel.expert_model_parallel_size=3", "trainer.devices=3", "data.global_batch_size=6"],
         r"parallel.expert_model_parallel_size=3: model.layers.0.mlp.experts has 4 experts, which do not split evenly"),
        (["model=hf", f"model.config={tmp_path / 'bloom'}", "data=synthetic"],
         r"model.config=.*bloom: model.plan=auto: BloomForCausalLM has model_type 'bloom'; the command line takes the "
         r"built-in plans"),
        (["model=hf", f"model.pretrained={tmp_path}", "data=synthetic"], r"model.pretrained=.*: .* no config.json there"),
        (["model=hf", "data=synthetic"], r"model=hf needs one of model.pretrained=.* or model.config=.*not neither"),
        (["model.hyper_connections=4"], r"model.hyper_connections=4: model.hyper_connections is for a Hugging Face "
                                        r"model \(model=hf\)"),
        (["model.plan=auto"], r"model.plan='auto': model.plan is for a Hugging Face model"),  # its model=hf default
    ]
    import re

    for argv, message in cases:
        status, err = check_before_launch(argv, tmp_path, monkeypatch, capsys)
        assert status == 2 and re.search(message, err), (argv, err)


def test_the_command_line_trains_with_the_python_apis_defaults(llama_dir, monkeypatch):
    """``model=hf`` without optimizer or seed keys: the learning rate, warm-up and the seed of fresh
    weights and hyper-connections are ``HFCausalLMModule``'s defaults, and that seed is the one
    ``add_hyper_connections``, ``parallelize`` and ``HyperConnectionSettings`` default to (the CLI
    used to take 3e-3 with 20 warm-up steps and the run's seed, 1234)."""
    import inspect

    from test_hydra import compose_config

    from lightning_mhc import add_hyper_connections
    from lightning_mhc.lightning.modules.hf import HFCausalLMModule
    from lightning_mhc.any_model.hyper_connections import HyperConnectionSettings
    from lightning_mhc.any_model.model import parallelize

    monkeypatch.chdir(llama_dir.parent)
    cfg = compose_config("model=hf", f"model.pretrained={llama_dir}", "data=synthetic", "model.hyper_connections=4")
    module = inspect.signature(HFCausalLMModule).parameters
    assert (cfg.optim.lr, cfg.optim.warmup_steps) == (module["lr"].default, module["warmup_steps"].default) == (3e-4, 0)
    seeds = {cfg.model.init_seed, cfg.model.hyper_connection_settings.seed, module["seed"].default,
             HyperConnectionSettings().seed, inspect.signature(add_hyper_connections).parameters["seed"].default,
             inspect.signature(parallelize).parameters["seed"].default}
    assert seeds == {0}
    gpt = compose_config("data=synthetic")
    assert (gpt.optim.lr, gpt.optim.warmup_steps, gpt.model.init_seed) == (3e-3, 20, 1234)
    assert (compose_config("model=hf", f"model.pretrained={llama_dir}", "data=synthetic", "optim.lr=1e-3").optim.lr
            == 1e-3)


def test_the_flops_of_a_hugging_face_model_match_torchs_flop_counter():
    """``mfu``'s FLOPs for ``model=hf`` (``HFCausalLMModule.flops_per_token``, read off the layer
    shapes) against torch's own FLOP counter over a forward of the unmodified model (eager attention,
    which multiplies the whole ``s x s`` square where the causal count takes half), for a Llama with
    grouped-query attention and a GPT-2 (its ``Conv1D`` layers)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from lightning_mhc.lightning.modules.hf import _forward_flops_of
    from lightning_mhc.any_model.hyper_connections import HyperConnectionSettings

    batch, seq = 2, 24
    for model in (LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                               attn_implementation="eager")),
                  GPT2LMHeadModel(GPT2Config(n_embd=48, n_layer=2, n_head=4, vocab_size=200,
                                             attn_implementation="eager"))):
        fixed, per_position = _forward_flops_of(model, HyperConnectionSettings(1))
        with FlopCounterMode(display=False) as counter:
            model(input_ids=torch.zeros(batch, seq, dtype=torch.long))
        counted = counter.get_total_flops() / (batch * seq)
        assert counted == fixed + 2 * per_position * seq, (type(model).__name__, counted, fixed, per_position)
    with_streams, _ = _forward_flops_of(model, HyperConnectionSettings(4))
    assert with_streams > fixed  # the hyper-connections' own terms


def test_the_tokenizer_comes_from_the_model_directory(llama_dir, sample_data, tmp_path, monkeypatch, capsys):
    """data=megatron without data.tokenizer reads the model's tokenizer.json; a directory without one
    is refused naming data.tokenizer."""
    argv = ["model=hf", f"model.pretrained={llama_dir}", "data=megatron", f"data.blend=[{sample_data}]",
            "data.split=[90,10,0]"]
    status, err = check_before_launch(argv, tmp_path, monkeypatch, capsys)
    assert status == 0, err
    bare = tmp_path / "bare"
    shutil.copytree(llama_dir, bare)
    (bare / "tokenizer.json").unlink()
    argv[1] = f"model.pretrained={bare}"
    status, err = check_before_launch(argv, tmp_path, monkeypatch, capsys)
    assert status == 2 and "data.tokenizer=null: model.pretrained=" in err and "has no tokenizer.json" in err, err


@pytest.mark.slow
def test_continue_a_pretrained_llama_with_hyper_connections_on_tp2_pp2(llama_dir, sample_data, tmp_path):
    """The issue's command: a saved Llama continued with 4 hyper-connection streams on the sample
    corpus, TP 2 x PP 2, block recompute: the loss falls; ``lightning-mhc-export`` writes a directory
    ``from_pretrained`` reads (the base model) with the hyper-connections beside it, and
    ``load_pretrained`` rebuilds the mHC model in one process with the parallel run's logits."""
    # ranks forked from the preloaded server: the subject is what the run computes and writes (the
    # launch has its own tests); lightning-mhc-export below is the real console door
    run_train_on_ranks(tmp_path, "model=hf", f"model.pretrained={llama_dir}", "model.hyper_connections=4",
                       "data=megatron", f"data.blend=[{sample_data}]", "data.split=[90,10,0]", "data.seq_length=64",
                       "data.micro_batch_size=2", "data.global_batch_size=8", "parallel=tp2pp2", "trainer.devices=4",
                       "recompute=mhc_block", "trainer.max_steps=8", "trainer.val_check_interval=8",
                       "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1", "optim.lr=3e-3",
                       "optim.warmup_steps=2", "trainer.peak_tflops=1", "hydra.run.dir=run", timeout=900)
    run = tmp_path / "run"
    losses = train_losses(run / "metrics.csv")
    import csv

    rows = [r for r in csv.DictReader(open(run / "metrics.csv")) if r.get("mfu")]
    assert rows and all(float(r["mfu"]) > 0 for r in rows)  # trainer.peak_tflops gives model=hf an mfu
    # every block's streams, both stages': copies of each other at the retrofit's start (exactly),
    # apart once training moved the gates off 0
    divergences = stream_divergences(run / "metrics.csv")
    first, last = divergences[min(divergences)], divergences[max(divergences)]
    assert len(divergences) == 8 and first.keys() == last.keys() == {f"model.layers.{i}" for i in range(4)}
    assert set(first.values()) == {0.0} and all(v > 0 for v in last.values()), (first, last)
    summary = json.loads((run / "summary.json").read_text())
    print(f"model=hf + 4 streams on TP 2 x PP 2: train loss {losses[min(losses)]:.3f} -> {losses[max(losses)]:.3f}; "
          f"val loss {summary['initial_val_loss']:.3f} -> {summary['final_val_loss']:.3f}")
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.1
    checkpoint = pathlib.Path(summary["last_checkpoint"])
    export = tmp_path / "export"
    run_module_on_a_rank("lightning_mhc.cli.export", str(checkpoint), str(export))  # what it writes, checked below
    from transformers import LlamaForCausalLM

    from lightning_mhc import load_pretrained

    base = LlamaForCausalLM.from_pretrained(export)  # transformers reads the base model
    assert not any("hyper_connections" in name for name in base.state_dict())
    model = load_pretrained(export).eval()
    assert model.hyper_connection_settings.num_residual_streams == 4
    # the parallel run's last validation (TP 2 x PP 2, step 8) against the rebuilt model on the same batches
    loss = validation_loss(model, tmp_path, sample_data)
    print(f"validation loss: TP 2 x PP 2 {summary['final_val_loss']:.6f}, load_pretrained {loss:.6f}")
    assert abs(loss - summary["final_val_loss"]) < 1e-4
    with torch.no_grad():
        tokens = torch.randint(0, SAMPLE_VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
        assert (model(input_ids=tokens).logits - base.eval()(input_ids=tokens).logits).abs().max() > 1e-4  # mHC acts


def validation_loss(model, tmp_path: pathlib.Path, blend: pathlib.Path) -> float:
    """The mean loss of ``model`` over the 2 validation batches the run evaluated (the same data
    module: blend, tokenizer, split, seed, sizes)."""
    from lightning_mhc.data.megatron import MegatronDataModule, blend_num_samples, megatron_num_samples

    sizes = megatron_num_samples(8, 8, 2, evaluated=("validation",))
    data = MegatronDataModule(blend=[str(blend)], tokenizer=str(SAMPLE_DIR / "tokenizer.json"), seq_length=64,
                              global_batch_size=8, split="90,10,0", seed=1234, cache_dir=str(tmp_path / "cache"),
                              num_samples=blend_num_samples(sizes, False, "90,10,0", 8))
    data.setup("fit")
    losses = []
    with torch.no_grad():
        for _, batch in zip(range(2), data.val_dataloader()):
            logits = model(input_ids=batch["tokens"]).logits
            # ParallelLMModule's loss: the mean over every label (no loss mask)
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item())
    return sum(losses) / len(losses)


def test_the_exports_of_a_trained_hyper_connected_model_agree(llama_dir, tmp_path, capsys):
    """A saved Llama continued with 4 hyper-connection streams through ``Trainer.fit`` (one process,
    ``HFCausalLMModule``, 3 AdamW steps on a DataLoader), then written three ways: the trained
    model's own ``save_pretrained``; ``trainer.save_checkpoint`` read by ``export_pretrained`` (which
    ``load_checkpoint``s it into the whole model); and ``lightning-mhc-export`` of that checkpoint.
    ``load_pretrained`` of each gives the trained model's logits (1e-6), the base class's
    ``from_pretrained`` of each reads exactly the trained base weights, and the checkpoint loaded
    by ``load_checkpoint`` holds exactly the trained tensors."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader
    from transformers import LlamaForCausalLM

    from lightning_mhc import MHCParallelStrategy, load_pretrained
    from lightning_mhc.data.sample import SAMPLE_VOCAB
    from lightning_mhc.data.sources import SyntheticTokens
    from lightning_mhc.lightning.modules.hf import HFCausalLMModule
    from lightning_mhc.any_model import export_pretrained, load_checkpoint

    pl.seed_everything(0, verbose=False)
    module = HFCausalLMModule(str(llama_dir), pretrained=True, hyper_connections=4, lr=3e-3, weight_decay=0.0,
                              implementation="reference")
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=MHCParallelStrategy(), max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=DataLoader(SyntheticTokens(6, 32, vocab_size=SAMPLE_VOCAB), batch_size=2))
    trained = module.model.chunks[0].eval()  # the whole model on one process, hyper-connected, trained
    tokens = torch.randint(0, SAMPLE_VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = trained(input_ids=tokens).logits
    state = {name: t.detach().clone() for name, t in trained.state_dict().items()}
    start = HFCausalLMModule.whole_model(module.hparams)  # the hyper-connections as drawn, before training
    alpha = next(name for name in state if name.endswith("hyper_connections.0.alpha"))
    assert not torch.equal(state[alpha], start.state_dict()[alpha])  # they trained

    trained.save_pretrained(tmp_path / "save_pretrained")
    checkpoint = tmp_path / "final.ckpt"
    trainer.save_checkpoint(checkpoint)
    whole = load_checkpoint(HFCausalLMModule.whole_model(module.hparams), checkpoint)
    assert whole.state_dict().keys() == state.keys()
    assert all(torch.equal(t, state[name]) for name, t in whole.state_dict().items())
    export_pretrained(checkpoint, HFCausalLMModule.whole_model(module.hparams), tmp_path / "export_pretrained")
    run_module_on_a_rank("lightning_mhc.cli.export", str(checkpoint), str(tmp_path / "cli"))

    for way in ("save_pretrained", "export_pretrained", "cli"):
        loaded = load_pretrained(tmp_path / way).eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=tokens).logits, expected, rtol=0, atol=1e-6, msg=way)
        base = LlamaForCausalLM.from_pretrained(tmp_path / way).state_dict()
        assert base.keys() == {name for name in state if ".hyper_connections." not in name}, way
        assert all(torch.equal(t, state[name]) for name, t in base.items()), way

    # lightning-mhc-generate on the export and on the checkpoint (its console entry point, in this
    # process): the prompt through the tokenizer.json the export carries (the model directory's for
    # the checkpoint), 6 greedy tokens equal to repeated full forwards of the trained model
    from lightning_mhc.cli import generate
    from lightning_mhc.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(llama_dir)
    prompt = "def main("
    ids = torch.tensor([tokenizer.tokenize(prompt)])
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, trained(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    expected_text = prompt + tokenizer.detokenize(ids[0, -6:].tolist())
    for source in (tmp_path / "cli", checkpoint):  # the export, and the checkpoint itself
        capsys.readouterr()
        generate.main([f"ckpt_path={source}", f"prompt={prompt}", "max_new_tokens=6"])
        out, err = capsys.readouterr()
        print(f"lightning-mhc-generate on {source.name}: {out.strip()!r}")
        assert out.rstrip("\n") == expected_text, (source, out, expected_text, err[-2000:])


def test_a_mixtral_asking_for_its_router_loss_trains_with_it_and_logs_it(tmp_path):
    """issue 52: a Mixtral with ``output_router_logits=True`` and ``router_aux_loss_coef=0.02`` under
    ``lightning-mhc-train model=hf`` (PP 2 on 2 ranks) trains on CE + coef x its load-balancing
    loss, as its own ``forward(labels=...)``: its first loss exceeds the same run's with coef 0 (one
    rank) by coef x the logged ``moe/aux_loss``, and both runs log the routers' tokens per expert."""
    import csv

    from transformers import MixtralConfig

    for coef in (0.02, 0.0):
        MixtralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=16, num_attention_heads=4,
                      num_key_value_heads=2, num_local_experts=4, vocab_size=300, output_router_logits=True,
                      router_aux_loss_coef=coef).save_pretrained(tmp_path / f"mixtral{coef}")
    common = ["model=hf", "data=synthetic", "data.seq_length=16", "data.micro_batch_size=2",
              "data.global_batch_size=4", "trainer.max_steps=2", "trainer.log_every_n_steps=1",
              "trainer.limit_val_batches=0"]
    run_train_on_ranks(tmp_path, *common, f"model.config={tmp_path / 'mixtral0.02'}",
                       "parallel.pipeline_model_parallel_size=2", "trainer.devices=2", "hydra.run.dir=aux")
    run_train_on_ranks(tmp_path, *common, f"model.config={tmp_path / 'mixtral0.0'}", "hydra.run.dir=plain")
    rows = {name: [r for r in csv.DictReader(open(tmp_path / name / "metrics.csv")) if r.get("train_loss")]
            for name in ("aux", "plain")}
    with_term, without = float(rows["aux"][0]["train_loss"]), float(rows["plain"][0]["train_loss"])
    aux = float(next(r["moe/aux_loss"] for r in csv.DictReader(open(tmp_path / "aux" / "metrics.csv"))
                     if r.get("moe/aux_loss") and r["step"] == rows["aux"][0]["step"]))
    print(f"first loss with coef 0.02: {with_term:.6f}, coef 0: {without:.6f}; moe/aux_loss {aux:.6f}")
    assert aux > 1  # E x sum f P with f summing to k: about k = 2 when balanced
    assert abs(with_term - without - 0.02 * aux) < 1e-5
    for name in ("aux", "plain"):
        header = next(csv.reader(open(tmp_path / name / "metrics.csv")))
        assert "moe/model.layers.0.mlp.gate/tokens_per_expert/0" in header, header
        assert "moe/model.layers.1.mlp.gate/balance" in header
