"""The Triton kernels of the hyper-connection, on CPU under Triton's interpreter (``TRITON_INTERPRET=1``):
every kernel forward and every gradient against the eager kernels and the op-by-op reference, at
small shapes, fp32 (1e-5 relative) and bf16 (2e-2), with ``n`` of 2, 3, 4 and 5 (padded tiles),
token counts that leave a masked tail and a ``C`` that is no multiple of the block."""
from __future__ import annotations

import os

import pytest
import torch

# conftest.py sets TRITON_INTERPRET=1 (without CUDA) before anything imports Triton: the kernels
# run on CPU tensors. On a GPU the interpreter is off: tests/test_gpu.py runs the compiled kernels.
pytest.importorskip("triton", reason="the triton extra: pip install -e '.[triton]'")
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors under Triton's interpreter (on a GPU: pytest -m gpu)")

from lightning_mhc.ops.hyper_connection import EagerKernels  # noqa: E402
from lightning_mhc.ops.sinkhorn import SINKHORN_EPS  # noqa: E402
from lightning_mhc.ops.triton_kernels import TritonKernels  # noqa: E402
from model_utils import hc_sublayer, rel_err  # noqa: E402

SHAPES = [(4, 24, 7), (3, 10, 5), (2, 8, 17), (5, 12, 3)]  # (n, C, tokens)


def _params(n: int, c: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    m = n * n + 2 * n
    phi = torch.randn(n * c, m, generator=g) * 0.2
    alpha = torch.tensor([0.8, 0.6, 1.5])
    bias = torch.randn(m, generator=g)
    return phi, alpha, bias


@interpreted
@pytest.mark.parametrize("n, c, tokens", SHAPES)
def test_each_kernel_matches_the_eager_one(n, c, tokens):
    g = torch.Generator().manual_seed(n * 100 + c)
    x = torch.randn(tokens, n * c, generator=g)
    phi, alpha, bias = _params(n, c)
    iterations = 6
    g_agg, grad = torch.randn(tokens, c, generator=g), torch.randn(tokens, n * c, generator=g)
    out, out_bias = torch.randn(tokens, c, generator=g), torch.randn(c, generator=g)
    results = {}
    for kernels in (EagerKernels, TritonKernels):
        raw, r = kernels.project(x, phi, 1e-6)
        h = kernels.mappings(raw, r, alpha, bias, n, iterations, SINKHORN_EPS)
        grads = [torch.randn(t.shape, generator=torch.Generator().manual_seed(k)) for k, t in enumerate(h)]
        dz = kernels.mappings_dz(raw, r, alpha, bias, h[0], h[1], *grads, n, iterations, SINKHORN_EPS)
        aggregated = kernels.aggregate(x, h[0], n)
        d_aggregate = kernels.aggregate_backward(x, h[0], g_agg, n)
        y = kernels.res_post(x, h[2], h[1], out, out_bias, 0.0, None)
        d_res_post = kernels.res_post_backward(x, h[2], h[1], out, out_bias, 0.0, None, grad)
        results[kernels.name] = (raw, r, *h, dz, aggregated, *d_aggregate, y, *d_res_post)
    names = ("raw", "r", "H_pre", "H_post", "H_res", "dz", "aggregated", "dx (aggregate)", "dH_pre", "next stream",
             "dx (res_post)", "dH_res", "dH_post", "d out")
    for name, ours, eager in zip(names, results["triton"], results["eager"]):
        assert rel_err(ours, eager) < 1e-5, (name, rel_err(ours, eager))


@interpreted
def test_the_projection_tiles_the_tokens_and_splits_the_width():
    """Tiles of 128 fp32 tokens, the width cut into splits whose partial products and sums of
    squares are added after: 131 tokens (two tiles, the second masked) of width 640 in 2 splits,
    against ``x @ phi`` and ``1/rms(x)`` of the eager set."""
    from lightning_mhc.ops.triton_kernels import projection, projection_plan

    block_t, _, splits = projection_plan(131, 640, 4)
    assert (block_t, splits) == (128, 2)
    g = torch.Generator().manual_seed(3)
    x, phi = torch.randn(131, 640, generator=g), torch.randn(640, 24, generator=g) * 0.1
    raw, r = projection(x, phi, 1e-6)
    eager_raw, eager_r = EagerKernels.project(x, phi, 1e-6)
    assert rel_err(raw, eager_raw) < 1e-5 and rel_err(r, eager_r) < 1e-6


@interpreted
def test_the_projection_multiplies_at_the_precision_torch_asks_of_fp32_matmuls(monkeypatch):
    """An fp32 stream's projection follows ``torch.set_float32_matmul_precision`` (``highest`` ->
    fp32 products, ``high`` -> tf32x3, ``medium`` -> tf32); a bf16 stream's is tf32 whatever it
    says (its values are exact in tf32). Read off the kernel's launch."""
    from lightning_mhc.ops import triton_kernels
    from lightning_mhc.testing.precision import float32_matmul_precision

    kernel, launched = triton_kernels._projection_fwd, []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs["PRECISION"])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_kernels, "_projection_fwd", Recorder())
    phi = torch.randn(64, 24) * 0.1
    for setting in ("highest", "high", "medium"):
        with float32_matmul_precision(setting):
            for dtype in (torch.float32, torch.bfloat16):
                triton_kernels.projection(torch.randn(3, 64).to(dtype), phi, 1e-6)
    assert launched == ["ieee", "tf32", "tf32x3", "tf32", "tf32", "tf32"]


@pytest.mark.parametrize("element_size", [4, 2])
def test_the_projection_reads_phi_for_at_most_a_quarter_of_the_streams_bytes(element_size):
    """At C = 4096, n = 4, 16k tokens (fp32 and bf16 streams): the bytes its loads request for
    ``phi`` are at most 25 % of the stream's (they were 200 % and 400 % with 16 tokens a program),
    with a program for every few of an H100's 132 SMs."""
    from lightning_mhc.ops.triton_kernels import projection_bytes, projection_plan

    tokens, width = 16384, 4 * 4096
    traffic = projection_bytes(tokens, width, 24, element_size)
    assert traffic["phi_share"] <= 0.25, traffic
    assert traffic["requested"] <= 1.3 * traffic["minimum"], traffic
    block_t, _, splits = projection_plan(tokens, width, element_size)
    assert -(-tokens // block_t) * splits >= 3 * 132


@interpreted
def test_sinkhorn_backward_where_sums_clamp():
    """Logits far apart: column sums fall below the clamp while their entries still carry gradient,
    and the maximum logit gets a gradient; the kernel's reverse walk with recomputed steps matches
    the eager one, finite."""
    n, tokens, iterations = 4, 3, 20
    raw = torch.zeros(tokens, n * n + 2 * n)
    # exp(-18) ~ 1.5e-8: columns whose sums (< 1e-6) are clamped but whose entries still carry gradient
    raw[:, 2 * n:] = torch.tensor([0.0, -18.0, -19.0, -20.0] * n)
    raw[1, 2 * n:] = torch.randn(n * n, generator=torch.Generator().manual_seed(0)) * 30
    r, alpha, bias = torch.ones(tokens), torch.tensor([1.0, 1.0, 1.0]), torch.zeros(n * n + 2 * n)
    h = {k.name: k.mappings(raw, r, alpha, bias, n, iterations, SINKHORN_EPS) for k in (EagerKernels, TritonKernels)}
    grads = [torch.randn(t.shape, generator=torch.Generator().manual_seed(k)) for k, t in enumerate(h["eager"])]
    dz = {k.name: k.mappings_dz(raw, r, alpha, bias, *h[k.name][:2], *grads, n, iterations, SINKHORN_EPS)
          for k in (EagerKernels, TritonKernels)}
    assert torch.isfinite(dz["triton"]).all()
    assert rel_err(h["triton"][2], h["eager"][2]) < 1e-5 and rel_err(dz["triton"], dz["eager"]) < 1e-5


@interpreted
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("n, c, tokens", [(4, 24, 7), (3, 10, 5)])
def test_the_sublayer_and_its_gradients_match_the_reference(n, c, tokens, dtype, tolerance):
    """The hyper-connection with Triton's kernels (mappings, aggregate, then ``H_res x + H_post^T
    (F + b)`` in one pass) against the op-by-op reference under autograd: the next stream, H_post
    and the gradients of the stream, of every hyper-connection parameter, of the branch's weight
    and of its bias. In bf16 the reference is its math in fp32 on the same bf16 values (the
    op-by-op reference rounds every product to bf16, the kernels accumulate in fp32)."""
    phi, alpha, bias = _params(n, c, seed=1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, n * c, generator=g).to(dtype)
    weight, out_bias = torch.randn(c, c, generator=g) / c ** 0.5, torch.randn(c, generator=g)
    upstream = [torch.randn(tokens, n * c, generator=g), torch.randn(tokens, n, generator=g)]

    def run(implementation: str, stream):
        leaves = [t.clone().requires_grad_() for t in (stream, phi, alpha, bias, weight, out_bias)]
        outs = hc_sublayer(*leaves, n, implementation, iterations=8)  # the interpreter: Python per iteration
        sum((o.float() * w).sum() for o, w in zip(outs, upstream)).backward()
        return [*outs, *(t.grad for t in leaves)]

    names = ("next stream", "H_post", "dx", "dphi", "dalpha", "dbias", "dweight", "d out bias")
    ours = run("triton", x)
    assert [t.dtype for t in ours[:3]] == [dtype, torch.float32, dtype]
    for name, mine, reference in zip(names, ours, run("reference", x.float())):
        assert rel_err(mine, reference) < tolerance, (name, rel_err(mine, reference))


def test_a_cpu_tensor_without_the_interpreter_is_refused_in_one_line(monkeypatch, tmp_path, capsys):
    """At run time (a CPU tensor reaches a kernel) and before launch (``lightning-mhc-train`` with
    ``model.mhc_implementation=triton`` on ``trainer=cpu``): one line that says to set
    ``TRITON_INTERPRET=1`` or use the C++ kernels."""
    from train_cli import check_before_launch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1"):
        TritonKernels.project(torch.zeros(2, 8), torch.zeros(8, 8), 1e-6)
    status, err = check_before_launch(["trainer=debug", "data=synthetic", "model.mhc_implementation=triton"], tmp_path,
                                      monkeypatch, capsys)
    assert status == 2 and "model.mhc_implementation=triton with trainer.accelerator=cpu" in err, err
    assert "TRITON_INTERPRET=1" in err and len(err.strip().splitlines()) == 1, err


def _res_post_leaves(n: int, c: int, tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h_res = torch.softmax(torch.randn(tokens, n, n, generator=g), -1)
    return [t.requires_grad_(True) for t in (torch.randn(tokens, n * c, generator=g), h_res,
                                             torch.rand(tokens, n, generator=g) * 2 + 0.1,
                                             torch.randn(tokens, c, generator=g), torch.randn(c, generator=g))]


@interpreted
@pytest.mark.parametrize("prob", [0.0, 0.3])
@pytest.mark.parametrize("n, c, tokens", [(4, 24, 7), (3, 70, 5)])
def test_res_post_bias_dropout_add_with_the_kernels_dropout(n, c, tokens, prob):
    """``H_res x + dropout(H_post^T (out + bias))`` in one Triton pass each way, dropout drawn in the
    kernel, against the same math in eager ops with the kernel's mask (read off its output: ``y -
    H_res x`` is 0 where dropped, 1/(1-p) of the spread where kept): the output and the gradients of x, H_res, H_post, out and the bias
    within 1e-5; the same generator state gives the same mask."""
    from lightning_mhc.ops.hyper_connection import fused_res_post, reference_apply_h_res

    x, h_res, h_post, out, bias = leaves = _res_post_leaves(n, c, tokens)
    torch.manual_seed(5)
    y = fused_res_post(x, h_res, h_post, out, bias, prob, TritonKernels)
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(9))
    grads = torch.autograd.grad(y, leaves, upstream)
    mixed = reference_apply_h_res(h_res, x, n)
    spread = (h_post[:, :, None] * (out + bias)[:, None, :]).reshape(tokens, n * c)
    keep = ((y - mixed).abs() > 0.5 * spread.abs()).float().detach() if prob else torch.ones_like(spread)
    if prob:
        assert 0 < (1 - keep).sum() < keep.numel(), "no element was dropped, or all were"
    expected = mixed + spread * keep / (1 - prob)
    assert rel_err(y, expected) < 1e-5
    for name, ours, eager in zip(("x", "H_res", "H_post", "out", "bias"), grads,
                                 torch.autograd.grad(expected, leaves, upstream)):
        assert rel_err(ours, eager) < 1e-5, name
    torch.manual_seed(5)
    assert torch.equal(fused_res_post(x, h_res, h_post, out, bias, prob, TritonKernels), y)


def _interpreter_patched(rank: int, world_size: int) -> bool:
    from triton.runtime import interpreter

    return getattr(interpreter._patch_lang, "once_per_launch", False)


@interpreted
def test_the_interpreter_patches_the_language_once_a_launch_here_and_on_forked_ranks(monkeypatch):
    """tests/triton_interpreter.py: a launch patches ``triton.language`` once, not once more for
    every call of a ``@triton.jit`` helper (``res_post``'s kernel calls three per program, a program
    per token), gives the kernel's output bit for bit as Triton's own patching does, and leaves the
    language as it found it; so in this process and on the fork server's ranks."""
    import triton.language as tl
    from triton.runtime import interpreter

    from lightning_mhc.ops.triton_kernels import res_post
    from lightning_mhc.testing.launch import spawn_ranks

    patched = []
    patch_core = interpreter._patch_lang_core
    monkeypatch.setattr(interpreter, "_patch_lang_core",
                        lambda lang, scope: (patched.append(lang), patch_core(lang, scope)))
    language = (tl.reduce, tl.core.reduce, tl.load, tl.arange, tl.core.arange)

    def launch(tokens: int) -> tuple[torch.Tensor, int]:
        patched.clear()
        x, h_res, h_post, out, bias = (t.detach() for t in _res_post_leaves(4, 24, tokens))
        return res_post(x, h_res, h_post, out, bias, 0.0, None), len(patched)

    launch(1)  # its helpers' first calls (Triton rewrites a function once, then its module sees ``tl`` too)
    (six, once_for_six), (_, once_for_twelve) = launch(6), launch(12)
    assert 0 < once_for_six == once_for_twelve <= 3  # tl, and tl.core for tl.sum's helpers: not more with more programs
    assert (tl.reduce, tl.core.reduce, tl.load, tl.arange, tl.core.arange) == language
    monkeypatch.setattr(interpreter, "_patch_lang", interpreter._patch_lang.original)  # Triton's own: once a call
    (again, each_call) = launch(6)
    assert each_call >= 6 * 4 and torch.equal(again, six)  # 4 helper calls a program
    assert spawn_ranks(_interpreter_patched, 1, init_group=False) == [True]


@interpreted
def test_the_kernels_dropout_drops_at_the_rate_asked_and_varies_by_draw():
    from lightning_mhc.ops.hyper_connection import fused_res_post, reference_apply_h_res, reference_res_post

    x, h_res, h_post, out, bias = (t.detach() for t in _res_post_leaves(4, 64, 64))
    mixed = reference_apply_h_res(h_res, x, 4)
    spread = (h_post[:, :, None] * (out + bias)[:, None, :]).reshape(mixed.shape)
    torch.manual_seed(0)
    # y - H_res x is 0 where dropped and 4/3 of the spread where kept
    first = (fused_res_post(x, h_res, h_post, out, bias, 0.25, TritonKernels) - mixed).abs() < 0.5 * spread.abs()
    second = (fused_res_post(x, h_res, h_post, out, bias, 0.25, TritonKernels) - mixed).abs() < 0.5 * spread.abs()
    assert abs(first.float().mean().item() - 0.25) < 0.02  # 16,384 draws: 4.7 standard deviations
    assert not torch.equal(first, second)
    bf16 = fused_res_post(x.bfloat16(), h_res, h_post, out.bfloat16(), bias.bfloat16(), 0.0, TritonKernels)
    assert bf16.dtype == torch.bfloat16
    assert rel_err(bf16, reference_res_post(x, h_res, h_post, out + bias)) < 2e-2


@interpreted
def test_a_model_with_triton_kernels_trains_like_the_eager_one_and_recomputes_bit_exactly(model_parallel):
    """A 2-layer mHC GPT, ``mhc_implementation='triton'``: three AdamW steps give the eager fused
    path's losses (1e-5) and gradients (1e-3) without dropout (the kernel draws its own dropout
    mask); with dropout 0.1, block recompute (``mhc_block``: the kernels and their dropout run
    again in backward) gives ``none``'s losses and gradients bit for bit."""
    from lightning_mhc.model import GPTModel
    from lightning_mhc.recompute import RecomputePolicy, attach_recompute
    from model_utils import tiny_config, train_steps

    def run(implementation: str, policy: str, dropout: float):
        torch.manual_seed(0)
        cfg = tiny_config(num_layers=2, hidden_size=32, ffn_hidden_size=64, hidden_dropout=dropout,
                          mhc_sinkhorn_iterations=5, mhc_implementation=implementation)
        model = GPTModel(RecomputePolicy(policy).apply(cfg))
        attach_recompute(model)
        return train_steps(model, steps=3, batch=2, seq=8)

    without = run("triton", "none", 0.0)  # each run interprets the kernels in Python: run once, used twice
    for (loss_e, grads_e), (loss_t, grads_t) in zip(run("fused", "none", 0.0), without):
        assert rel_err(loss_t, loss_e) < 1e-5
        for name in grads_e:  # fp32 sums in another order, carried through AdamW steps: 1e-3, and atol for the
            # entries that are rounding-sized (after a step some phi gradients are ~1e-9)
            torch.testing.assert_close(grads_t[name], grads_e[name], rtol=1e-3, atol=1e-7, msg=lambda m: f"{name}: {m}")
    dropped = run("triton", "none", 0.1)
    assert not torch.equal(dropped[0][0], without[0][0])  # the dropout is real
    for (loss_t, grads_t), (loss_b, grads_b) in zip(dropped, run("triton", "mhc_block", 0.1)):
        assert torch.equal(loss_b, loss_t) and all(torch.equal(grads_b[k], grads_t[k]) for k in grads_t)


def test_every_kernel_compiles_for_an_h100_ahead_of_time():
    """The interpreter runs the kernels as Python; compiled Triton is stricter (both sides of a
    runtime branch must give the same shape: the Sinkhorn step once picked rows or columns that
    way, passed here and could not compile). The kernels are compiled for sm_90 down to a cubin
    (ptxas) at n = 2, 3, 4, 6, 8, fp32, bf16 and fp16 streams, a bf16 or fp16 sub-layer output on
    an fp32 stream, the mappings in both conventions, the projection at each precision, the bias
    and dropout variants covered in pairs (every pair of stream types, n, bias and dropout at
    least once; the script's ``--all`` compiles all 365 combinations), and n = 4 for sm_80 and
    sm_100, in a child process without ``TRITON_INTERPRET``, no GPU needed: 155 kernels. The
    projection's tf32 and tf32x3 variants multiply on the tensor cores (their PTX has ``mma``,
    ``wgmma`` or ``tcgen05.mma``), its ``ieee`` one does not.

    Triton's cache is kept between runs (``TRITON_AOT_CACHE``, as Inductor's is): its key is the
    kernel's source with every function it calls, the argument types, constexprs and options, the
    target, Triton's version and ptxas's, so a repeat of an unchanged kernel reads the binary and
    PTX that compile made (only a machine's first run, or a change, compiles), and a changed
    kernel or toolchain compiles again. A failed compile is not cached."""
    import pathlib
    import subprocess
    import sys

    from conftest import TRITON_AOT_CACHE
    from subprocess_env import child_env

    env = {k: v for k, v in child_env(TRITON_CACHE_DIR=TRITON_AOT_CACHE).items() if k != "TRITON_INTERPRET"}
    script = pathlib.Path(__file__).parent / "scripts" / "compile_triton_kernels.py"
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.stdout.count("ok   ") == 155, proc.stdout
    projections = [line for line in proc.stdout.splitlines() if "_projection_fwd" in line]
    assert len(projections) == 15, projections
    for line in projections:
        assert line.endswith("[tensor cores]") == ("'ieee'" not in line), line


@interpreted
def test_lightning_mhc_train_with_triton_and_compile_matches_the_eager_paths(tmp_path):
    """Through the public door: ``lightning-mhc-train`` (Trainer.fit on the synthetic DataLoader) with
    ``model.mhc_implementation=triton`` (its kernels under the interpreter the child inherits) gives
    ``fused``'s per-step losses, and ``compile`` gives ``reference``'s, within 1e-5 (3 steps, dropout
    off: Triton's dropout draws its own mask)."""
    import concurrent.futures

    from train_cli import run_train_on_ranks, train_losses

    def losses(implementation: str) -> dict[int, float]:
        cwd = tmp_path / implementation
        cwd.mkdir()
        # 2 sequences of 8 tokens a step: the interpreter runs every program instance in Python. A
        # rank forked from the preloaded server (which has TRITON_INTERPRET too): the subject is
        # what the implementations compute, not how the CLI starts its process
        run_train_on_ranks(cwd, "trainer=debug", "data=synthetic", "trainer.max_steps=3", "trainer.limit_val_batches=0",
                           "model.num_layers=2", "model.hidden_dropout=0", "model.attention_dropout=0",
                           "data.seq_length=8", "data.global_batch_size=2",
                           f"model.mhc_implementation={implementation}", f"hydra.run.dir={cwd / 'run'}", timeout=600)
        return train_losses(cwd / "run" / "metrics.csv")

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        runs = dict(zip(("fused", "triton", "reference", "compile"),
                        pool.map(losses, ("fused", "triton", "reference", "compile"))))
    for ours, eager in (("triton", "fused"), ("compile", "reference")):
        assert runs[ours].keys() == runs[eager].keys() and len(runs[eager]) == 3, runs
        for step, loss in runs[eager].items():
            assert abs(runs[ours][step] - loss) <= 1e-5 * abs(loss), (ours, step, runs[ours][step], loss)


@interpreted
@pytest.mark.parametrize("n, c, tokens", SHAPES)
def test_the_deepseek_v4_mappings_match_the_eager_ones(n, c, tokens):
    """DeepSeek-V4's convention (``V4``): ``H_pre + eps``, V4's Sinkhorn stored as ``comb^T``, and the
    logits' gradient, against the eager set (the C++ kernel), at init-scale and sharp logits."""
    g = torch.Generator().manual_seed(n * 10 + c)
    x = torch.randn(tokens, n * c, generator=g)
    phi, alpha, bias = _params(n, c)
    for sharp in (1.0, 25.0):
        raw, r = EagerKernels.project(x, phi, 1e-6)
        results = {}
        for kernels in (EagerKernels, TritonKernels):
            h = kernels.mappings(raw, r, alpha * sharp, bias, n, 6, 1e-6, convention="deepseek_v4")
            grads = [torch.randn(t.shape, generator=torch.Generator().manual_seed(k)) for k, t in enumerate(h)]
            dz = kernels.mappings_dz(raw, r, alpha * sharp, bias, h[0], h[1], *grads, n, 6, 1e-6,
                                     convention="deepseek_v4")
            results[kernels.name] = (*h, dz)
        for name, ours, eager in zip(("H_pre", "H_post", "H_res", "dz"), results["triton"], results["eager"]):
            assert rel_err(ours, eager) < 1e-5, (name, sharp, rel_err(ours, eager))
    # V4's floor on H_pre: pre logits of -100 leave exactly eps (1e-6 beside H_pre ~ 1 would pass
    # the comparison above without it)
    floor_bias = bias.clone()
    floor_bias[:n] = -100.0
    h_pre = TritonKernels.mappings(raw, r, alpha, floor_bias, n, 6, 1e-6, convention="deepseek_v4")[0]
    assert torch.allclose(h_pre, torch.full_like(h_pre, 1e-6), rtol=1e-3, atol=0)


@interpreted
def test_deepseek_v4_modules_on_the_triton_kernels_match_transformers():
    """transformers' V4 hyper-connection, the layer's mix and the hyper head on Triton's kernels
    (``use_our_ops(..., "triton")``), forward and every gradient, against transformers' fp32 and
    its code in fp64 (tests/v4_utils.py; the bound of tests/test_deepseek_v4_ops.py)."""
    pytest.importorskip("transformers.models.deepseek_v4")
    from test_deepseek_v4_ops import ERROR_FACTOR, ERROR_FLOOR
    from v4_utils import errors, v4_inputs, v4_modules

    for sharp in (False, True):
        modules = v4_modules(n=3, iterations=4, sharp=sharp)
        x, upstream = v4_inputs(5, n=3)
        for name, (ours, theirs, apart) in errors("triton", modules, x, upstream).items():
            assert ours <= ERROR_FACTOR * theirs + ERROR_FLOOR, (name, sharp, ours, theirs)


@interpreted
def test_hy_v4_modules_on_the_triton_kernels_match_transformers():
    """HY-V4's hyper-connection (gates only, ``post = magnitude sigmoid + eps``) and head on Triton's
    kernels (``use_our_ops(..., "triton")``), in a sub-layer with the layer's ``post ⊗ F + x``:
    forward and every gradient against transformers' fp32 and its code in fp64, at init-scale and
    sharp logits, the bound of tests/test_deepseek_v4_ops.py. (Five tokens: a parameter's gradient is
    a short sum that cancels, so ours and transformers' fp32 differ by a few 1e-6 of it, both that
    far from exact; the CPU kernels' test holds the 1e-6 at 48 tokens.)"""
    pytest.importorskip("transformers.models.hy_v4")
    from test_deepseek_v4_ops import ERROR_FACTOR, ERROR_FLOOR, hy_v4_sublayer_errors

    for sharp in (False, True):
        for name, (ours, theirs, _) in hy_v4_sublayer_errors("triton", sharp, 1, 5).items():
            assert ours <= ERROR_FACTOR * theirs + ERROR_FLOOR, (name, sharp, ours, theirs)
