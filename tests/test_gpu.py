"""The GPU test set (``pytest -m gpu``): what only a CUDA GPU can show, on one GPU.

- ``mhc_implementation='auto'`` runs Triton's kernels (on a GPU no test may skip: Triton missing
  fails the set, and ``benchmarks/gpu_check.py`` fails a skipped test);
- the Triton kernels at real shapes (C = 4096, 8192 tokens, 20 Sinkhorn iterations; bf16 and fp32),
  forward and every gradient, against the reference evaluated in fp64 (their error a small
  multiple of the op-by-op reference's own, or of the tensor-core precision the projection must
  take, emulated; under each of torch's fp32 matmul precisions), and the H_post
  bias-dropout-add kernel with its dropout mask's rate and independence;
- block recompute bit-exact against ``none`` with dropout on CUDA (the CUDA generators captured and
  restored), with ``auto`` (Triton's kernels) and with the eager fused ops;
- the retained activation bytes the recompute meter counts against the CUDA allocator's
  ``memory_allocated`` difference over a forward, within 5 %;
- ``torch.compile`` of a model whose layers carry block-recompute hooks (same loss and gradients);
- the strategy's groups on NCCL at world size 1 (an all-reduce over each), and one-process training
  through ``lightning-mhc-train`` on the GPU: bf16-mixed, the fused kernels, a falling loss.

Skipped without CUDA. ``LIGHTNING_MHC_GPU_TESTS_ON_CPU=1`` runs the same tests on CPU tensors at small
shapes (Triton's interpreter, ``TRITON_INTERPRET=1`` from conftest.py), the CUDA-only checks
skipped: a dry run of the tests' own logic on a machine without a GPU, not a GPU result.
"""
from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before CUDA starts)

import pytest  # noqa: E402
import torch  # noqa: E402
from model_utils import rel_err  # noqa: E402

if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("LIGHTNING_MHC_GPU_TESTS_ON_CPU") == "1":
    DEVICE = "cpu"
else:
    DEVICE = None
ON_GPU = DEVICE == "cuda"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU")]
cuda_only = pytest.mark.skipif(not ON_GPU, reason="a CUDA allocator or NCCL check")


def _triton():
    """Triton, which every kernel test needs: on a GPU its absence fails the test (a GPU run must not
    pass by skipping); in the CPU dry run, where Triton is an optional extra, it skips, and so it
    does where Triton's interpreter cannot run the kernels: before Triton 3.8 it fails on NumPy >=
    2.4 (triton-lang/triton#9172; the GPU image's Triton 3.6 with its NumPy 2.5), a CPU-only fault
    (on a GPU the kernels are compiled, never interpreted)."""
    if ON_GPU:
        import triton

        return triton
    triton = pytest.importorskip("triton")
    import numpy
    from packaging.version import Version

    if Version(triton.__version__) < Version("3.8") and Version(numpy.__version__) >= Version("2.4"):
        pytest.skip(f"Triton {triton.__version__}'s interpreter fails on NumPy {numpy.__version__} "
                    "(triton-lang/triton#9172, fixed in 3.8): the CPU dry run cannot run the kernels here")
    return triton
N = 4
C, TOKENS = (4096, 8192) if ON_GPU else (40, 9)  # the dry run: a C that is no multiple of the block
# the small models' width and sequence; the dry run's run Triton's interpreter (Python per program)
MODEL_HIDDEN, MODEL_SEQ = (64, 32) if ON_GPU else (16, 8)


@cuda_only
def test_the_kernels_run_compiled_not_in_the_interpreter():
    """On a GPU every Triton kernel runs compiled: under ``TRITON_INTERPRET=1`` (conftest.py sets it
    only without CUDA) ``triton.jit`` makes interpreted Python functions, and this set would time
    the interpreter (one aggregate forward at its shape: ~25 minutes) and test nothing of the GPU.
    No kernel of the ops is an interpreted function, and one launched holds a compiled binary."""
    triton = _triton()
    from triton.runtime.interpreter import InterpretedFunction

    from lightning_mhc.ops import triton_kernels

    kernels = {name: f for name, f in vars(triton_kernels).items()
               if isinstance(f, (triton.runtime.JITFunction, InterpretedFunction))}
    assert len(kernels) >= 6, sorted(kernels)
    assert [name for name, f in kernels.items() if isinstance(f, InterpretedFunction)] == [], \
        f"interpreted kernels (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r})"
    from model_utils import hc_sublayer_inputs

    (x, phi, *_), _ = hc_sublayer_inputs(TOKENS, N, C, torch.float32, DEVICE)
    triton_kernels.projection(x, phi, 1e-6)
    torch.cuda.synchronize()
    compiled, *_ = triton_kernels._projection_fwd.device_caches[torch.cuda.current_device()]
    assert compiled, "the projection kernel ran but holds no compiled binary for this device"


@pytest.mark.parametrize("dtype, matmul_precision", [(torch.bfloat16, "highest"), (torch.float32, "highest"),
                                                     (torch.float32, "high"), (torch.float32, "medium")])
def test_triton_kernels_against_an_fp64_evaluation_at_real_shapes(dtype, matmul_precision):
    """One hyper-connected sub-layer (C = 4096, 8192 tokens, 20 Sinkhorn iterations, a linear branch
    with a bias) with Triton's kernels under autograd, against the reference evaluated in fp64: the
    next stream, H_post and the gradients of the stream, phi, alpha, the bias, the branch's weight
    and its bias, each within ERROR_FACTOR times the op-by-op reference's own error at the stream's
    precision (its products fp32) or, where the projection should multiply on tensor cores, the
    error of that precision emulated on the same values, plus ERROR_FLOOR (``fp64_bound_violations``
    in model_utils.py). GPU arithmetic (approximate exp, division, square root, another summation
    order) moves the kernels' error; the bound is on their share. The kernels run under each
    ``torch.set_float32_matmul_precision`` (bf16: tf32; fp32: fp32, tf32x3, tf32), the reference
    and the emulation under ``highest``: a projection that fell from tf32x3 to tf32 breaks the bound
    (test_fused_ops.py shows it does)."""
    _triton()
    from model_utils import fp64_bound_violations, hc_sublayer_inputs

    inputs, upstream = hc_sublayer_inputs(TOKENS, N, C, dtype, DEVICE)
    assert fp64_bound_violations("triton", inputs, upstream, N, matmul_precision, iterations=20) == {}


@pytest.mark.parametrize("sharp", [False, True])
def test_deepseek_v4_convention_on_triton_against_an_fp64_evaluation(sharp):
    """DeepSeek-V4's convention (``pre + eps``, V4's Sinkhorn, ``H_res = comb^T``) on Triton's
    kernels at real shapes (C = 4096, 8192 tokens, 20 iterations; fp32), its parameters laid out as
    transformers' (``fn [(2+n)n, n*C]`` read through ``fn.t()``), at init-scale and sharp logits
    (scales 25): the aggregate, H_res, H_post, a linear branch and the mix, forward and every
    gradient, each within ERROR_FACTOR times the op-by-op reference's fp32 error against the same
    reference in fp64, plus ERROR_FLOOR. (The reference is transformers' module's op order, checked
    against it on CPU in tests/test_deepseek_v4_ops.py, so this needs no transformers here.)"""
    _triton()
    from lightning_mhc.ops.convention import deepseek_v4
    from lightning_mhc.ops.hyper_connection import fused_pre_packed, fused_res_post, reference_pre, reference_res_post
    from lightning_mhc.ops.triton_kernels import TritonKernels

    fn, scale, base, weight, x, upstream = _drawn_sublayer(
        7, N * N + 2 * N, [25.0, 20.0, 25.0] if sharp else [1.1, 0.9, 1.0], sharp)

    def run(implementation, dtype):
        leaves = [t.to(DEVICE, dtype).requires_grad_(True) for t in (x, fn, scale, base, weight)]
        xs, fn_, scale_, base_, weight_ = leaves
        if implementation == "triton":
            agg, h_res, h_post = fused_pre_packed(xs, fn_.t(), scale_, base_, N, 1e-6, 20, TritonKernels,
                                                  deepseek_v4())
            y = fused_res_post(xs, h_res, h_post, agg @ weight_.t(), None, 0.0, TritonKernels)
        else:
            phi = fn_.t()
            params = (phi[:, :N], phi[:, N:2 * N], phi[:, 2 * N:], scale_[0], scale_[1], scale_[2], base_[:N],
                      base_[N:2 * N], base_[2 * N:].view(N, N))
            agg, h_res, h_post = reference_pre(xs, params, N, 1e-6, 20, deepseek_v4())
            y = reference_res_post(xs, h_res, h_post, agg @ weight_.t())
        loss = (y * upstream.to(DEVICE, dtype)).sum()
        return [y.detach(), h_res.detach(), h_post.detach(), *torch.autograd.grad(loss, leaves)]

    assert _triton_beyond_the_fp64_bound(run, ("next stream", "H_res", "H_post", "dx", "d fn", "d scale", "d base",
                                               "d weight")) == {}
    # V4's floor on H_pre, which the bound above cannot see (1e-6 of the streams' sum): pre logits
    # of -100 leave exactly eps of each stream
    floor = base.clone()
    floor[:N] = -100.0
    xs = x.to(DEVICE)
    agg, _, _ = fused_pre_packed(xs, fn.to(DEVICE).t(), scale.to(DEVICE), floor.to(DEVICE), N, 1e-6, 20,
                                 TritonKernels, deepseek_v4())
    expected = 1e-6 * xs.view(TOKENS, N, C).sum(dim=1)
    assert torch.allclose(agg, expected, rtol=1e-3, atol=1e-9 * expected.abs().max().item())


@pytest.mark.parametrize("sharp", [False, True])
def test_hy_v4_connection_on_triton_against_an_fp64_evaluation(sharp):
    """HY-V4's hyper-connection (``HYV4HyperConnection``: gates only, ``post = 1.5 sigmoid + eps``,
    the layer's ``post ⊗ F + x``) on Triton's kernels at real shapes (fp32), its parameters laid out
    as transformers' (``fn [2n, n*C]`` read through ``fn.t()``, ``scale [2]``), at init-scale and
    sharp logits: the collapsed input, post, a linear branch and the add, forward and every
    gradient, each within ERROR_FACTOR times transformers' op order's fp32 error (written out here:
    projection, then the norm's factor; checked against the module on CPU in
    tests/test_deepseek_v4_ops.py) against the same in fp64, plus ERROR_FLOOR."""
    _triton()
    from lightning_mhc.ops.hyper_connection import fused_hyper_head
    from lightning_mhc.ops.triton_kernels import TritonKernels

    fn, scale, base, weight, x, upstream = _drawn_sublayer(8, 2 * N, [25.0, 20.0] if sharp else [1.1, 0.9], sharp)
    width = N * C

    def run(implementation, dtype):
        leaves = [t.to(DEVICE, dtype).requires_grad_(True) for t in (x, fn, scale, base, weight)]
        xs, fn_, scale_, base_, weight_ = leaves
        if implementation == "triton":
            agg, post = fused_hyper_head(xs, fn_.t(), scale_, base_, N, 1e-6, 1e-6, TritonKernels, 1.5)
        else:  # transformers' lines
            mixes = torch.nn.functional.linear(xs, fn_) * torch.rsqrt(xs.square().mean(-1, keepdim=True) + 1e-6)
            pre = torch.sigmoid(mixes[:, :N] * scale_[0] + base_[:N]) + 1e-6
            post = 1.5 * torch.sigmoid(mixes[:, N:] * scale_[1] + base_[N:]) + 1e-6
            agg = (pre.unsqueeze(-1) * xs.view(TOKENS, N, C)).sum(dim=1)
        y = (post.unsqueeze(-1) * (agg @ weight_.t()).unsqueeze(-2) + xs.view(TOKENS, N, C)).view(TOKENS, width)
        loss = (y * upstream.to(DEVICE, dtype)).sum()
        return [y.detach(), agg.detach(), post.detach(), *torch.autograd.grad(loss, leaves)]

    assert _triton_beyond_the_fp64_bound(run, ("next stream", "collapsed", "post", "dx", "d fn", "d scale", "d base",
                                               "d weight")) == {}


def _drawn_sublayer(seed: int, columns: int, scales: list[float], sharp: bool):
    """A hyper-connection's parameters laid out as transformers' (``fn [columns, n*C]``, ``scale``,
    ``base [columns]``) at init-scale or sharp logits, a branch's weight, the streams ``[T, n*C]``
    and their upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    width = N * C
    fn = torch.randn(columns, width, generator=g) * (1.0 / width ** 0.5 if sharp else 0.02)
    base = torch.randn(columns, generator=g) * (2.0 if sharp else 0.5)
    weight = torch.randn(C, C, generator=g) / C ** 0.5
    x = torch.randn(TOKENS, width, generator=g)
    return fn, torch.tensor(scales), base, weight, x, torch.randn(TOKENS, width, generator=g)


def _triton_beyond_the_fp64_bound(run, names) -> dict:
    """``{result: (Triton's error, the reference's)}`` for each of ``run(implementation, dtype)``'s
    results whose fp32 error on Triton (against the reference in fp64) passes ERROR_FACTOR times
    the reference's fp32 error plus ERROR_FLOOR."""
    from model_utils import ERROR_FACTOR, ERROR_FLOOR

    exact = run("reference", torch.float64)
    ours, reference = run("triton", torch.float32), run("reference", torch.float32)

    def error(a, e):
        return ((a.double() - e).abs().max() / e.abs().max()).item()

    return {name: (error(o, e), error(r, e)) for name, o, r, e in zip(names, ours, reference, exact)
            if error(o, e) > ERROR_FACTOR * error(r, e) + ERROR_FLOOR[torch.float32]}


@pytest.mark.parametrize("prob", [0.0, 0.1])
def test_res_post_kernel_at_real_shapes(prob):
    """``H_res x + dropout(H_post^T (out + b))`` in bf16 against its fp32 math with the kernel's
    mask (probed from the same generator state: the mask depends on the seed and the position
    only): the output and the gradients of x, H_res, H_post, out and the bias within 2e-2. A mask
    taken from the kernel proves nothing of the mask itself, so it is checked against what dropout must be: the rate drawn (within 6 standard deviations of
    ``prob`` over all elements, and over each stream), elements independent (the n streams of one
    channel all equal, and two neighbours both kept, as often as independent draws give), a new
    mask for a new generator state and the same for the same."""
    _triton()
    from lightning_mhc.ops.hyper_connection import fused_res_post, reference_apply_h_res
    from lightning_mhc.ops.triton_kernels import TritonKernels

    tokens = TOKENS if ON_GPU else 64  # the dry run: enough draws for the mask's checks to see a flaw

    g = torch.Generator(device=DEVICE).manual_seed(2)
    x = torch.randn(tokens, N * C, generator=g, device=DEVICE)
    h_res = torch.softmax(torch.randn(tokens, N, N, generator=g, device=DEVICE), -1)
    h_post = torch.rand(tokens, N, generator=g, device=DEVICE) * 2 + 0.1
    out, bias = torch.randn(tokens, C, generator=g, device=DEVICE), torch.randn(C, generator=g, device=DEVICE)
    upstream = torch.randn(tokens, N * C, generator=g, device=DEVICE)
    leaves = [t.bfloat16().requires_grad_(True) if t is x or t is out or t is bias else t.requires_grad_(True)
              for t in (x, h_res, h_post, out, bias)]
    torch.manual_seed(3)
    y = fused_res_post(*leaves, prob, TritonKernels)
    ours = [y, *torch.autograd.grad(y, leaves, upstream.bfloat16())]
    f32 = [t.detach().float().requires_grad_(True) for t in leaves]
    mixed = reference_apply_h_res(f32[1], f32[0], N)
    spread = (f32[2][:, :, None] * (f32[3] + f32[4])[:, None, :]).reshape(tokens, N * C)

    def keep_mask(seed: int) -> torch.Tensor:
        """The kernel's mask for a generator state, probed where the output is the mask itself
        (x = 0, H_res = 0, H_post = 1, out = 1, bias = 0: y = keep / (1 - p)); read off the real
        output instead, an element whose ``out + b`` is near 0 cannot show it, though its gradient
        still passes through it."""
        torch.manual_seed(seed)
        probe = fused_res_post(torch.zeros_like(mixed), torch.zeros_like(h_res), torch.ones_like(h_post),
                               torch.ones_like(out), torch.zeros_like(bias), prob, TritonKernels)
        return (probe != 0).float()

    keep = keep_mask(3)
    expected = mixed + spread * keep / (1 - prob)
    reference = [expected, *torch.autograd.grad(expected, f32, upstream)]
    for name, a, b in zip(("y", "dx", "dH_res", "dH_post", "dout", "dbias"), ours, reference):
        assert rel_err(a, b) < 2e-2, (name, rel_err(a, b))
    if prob:
        _check_dropout_mask(keep.bool().view(tokens, N, C), prob)
        assert torch.equal(keep_mask(3), keep) and not torch.equal(keep_mask(4), keep)


def _within(observed: float, probability: float, draws: int) -> bool:
    """Whether a frequency over ``draws`` independent draws is within 6 standard deviations of its
    ``probability``."""
    return abs(observed - probability) <= 6 * (probability * (1 - probability) / draws) ** 0.5


def _check_dropout_mask(keep: torch.Tensor, prob: float) -> None:
    """``keep`` (``[tokens, n, C]``, True where kept) is what independent draws at ``prob`` give."""
    tokens, n, c = keep.shape
    kept = 1 - prob
    assert _within(keep.float().mean().item(), kept, keep.numel()), keep.float().mean().item()
    for stream in range(n):
        rate = keep[:, stream].float().mean().item()
        assert _within(rate, kept, tokens * c), (stream, rate)
    same = (keep == keep[:, :1]).all(dim=1).float().mean().item()  # one channel's n streams all alike
    assert _within(same, kept ** n + prob ** n, tokens * c), same
    pairs = (keep[..., 1:] & keep[..., :-1]).float().mean().item()  # two neighbours in a stream both kept
    assert _within(pairs, kept ** 2, tokens * n * (c - 1)), pairs


def _tiny_model(implementation: str, policy: str, dropout: float, hidden: int = MODEL_HIDDEN):
    from lightning_mhc.model import GPTModel
    from lightning_mhc.recompute import RecomputePolicy, attach_recompute
    from model_utils import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config(num_layers=2, hidden_size=hidden, ffn_hidden_size=2 * hidden, hidden_dropout=dropout,
                      attention_dropout=dropout, mhc_implementation=implementation)
    model = GPTModel(RecomputePolicy(policy).apply(cfg))
    attach_recompute(model)
    return model.to(DEVICE)


def _steps(model, steps: int = 3, batch: int = 2, seq: int = MODEL_SEQ, autocast: bool = False):
    """AdamW steps on fixed tokens: per step ``(loss, {name: grad})``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, model.config.vocab_size, (steps, batch, seq),
                           generator=torch.Generator().manual_seed(0)).to(DEVICE)
    torch.manual_seed(1)
    history = []
    for step in range(steps):
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            loss = model(tokens[step], labels=tokens[step].roll(-1, 1)).float().mean()
        loss.backward()
        history.append((loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return history


@pytest.fixture
def deterministic():
    """Deterministic CUDA algorithms (no atomics in attention or embedding backwards), so that two
    runs can be compared bit for bit at all."""
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("implementation", ["auto", "fused", "compile"])
def test_block_recompute_is_bit_exact_with_dropout(model_parallel, deterministic, implementation):
    """Dropout 0.1 (hidden and attention): ``mhc_block`` gives ``none``'s losses and gradients bit for
    bit over 3 AdamW steps (the recompute replays the CUDA generators); two ``none`` runs agree too."""
    if implementation == "auto" and not ON_GPU:
        pytest.skip("'auto' is 'fused' on CPU; Triton's kernels in its interpreter are checked the same way by "
                    "tests/test_triton_kernels.py")
    none = _steps(_tiny_model(implementation, "none", 0.1))
    again = _steps(_tiny_model(implementation, "none", 0.1))
    block = _steps(_tiny_model(implementation, "mhc_block", 0.1))
    for (loss_n, grads_n), (loss_a, grads_a), (loss_b, grads_b) in zip(none, again, block):
        assert torch.equal(loss_n, loss_a), "two identical runs differ: the comparison means nothing"
        assert torch.equal(loss_b, loss_n)
        assert all(torch.equal(grads_b[k], grads_n[k]) for k in grads_n)


def test_auto_runs_tritons_kernels_on_the_gpu(model_parallel, monkeypatch):
    """``mhc_implementation='auto'`` (the default, and ``trainer=gpu``'s) runs Triton's kernels on a
    GPU: a model's training step calls each of them, forward and backward. Falling back to the
    eager kernels there (Triton missing or failing to import) fails, not skips. (The dry run counts
    the calls of ``triton`` in the interpreter: 'auto' is 'fused' on CPU.)"""
    _triton()
    from lightning_mhc.ops import fused_kernels
    from lightning_mhc.ops.triton_kernels import TritonKernels

    assert fused_kernels("auto", "cuda") is TritonKernels
    calls = {}
    for name in ("project", "mappings", "mappings_dz", "aggregate", "aggregate_backward", "res_post",
                 "res_post_backward"):
        def counted(*args, _kernel=getattr(TritonKernels, name), _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(TritonKernels, name, staticmethod(counted))
    _steps(_tiny_model("auto" if ON_GPU else "triton", "none", 0.0), steps=1)
    assert len(calls) == 7 and min(calls.values()) >= 2, calls  # 2 layers x 2 sub-layers each


@cuda_only
@pytest.mark.parametrize("policy", ["none", "mhc_block"])
def test_retained_bytes_match_the_cuda_allocator(model_parallel, policy):
    """What ``ActivationMemoryMeter`` counts as retained by the graph after a forward equals the CUDA
    allocator's ``memory_allocated`` growth over that forward, within 5 %."""
    from lightning_mhc.recompute import ActivationMemoryMeter

    model = _tiny_model("auto", policy, 0.0, hidden=1024)
    tokens = torch.randint(0, model.config.vocab_size, (2, 512), device=DEVICE)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with ActivationMemoryMeter(model) as meter:
        loss = model(tokens, labels=tokens.roll(-1, 1)).mean()
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    counted = meter.live_bytes(extra=[loss])
    assert abs(counted - grown) <= 0.05 * grown, (counted, grown)
    loss.backward()


def test_compile_of_a_model_with_recompute_hooks(model_parallel):
    """``torch.compile`` of a model whose layers carry block-recompute hooks (``mhc_block``): the
    loss and gradients of the uncompiled model (1e-5), and a second step that runs again."""
    eager = _steps(_tiny_model("auto", "mhc_block", 0.0), steps=2)
    model = _tiny_model("auto", "mhc_block", 0.0)
    compiled = _steps(torch.compile(model), steps=2)
    for (loss_e, grads_e), (loss_c, grads_c) in zip(eager, compiled):
        assert rel_err(loss_c, loss_e) < 1e-5
        for name in grads_e:
            key = name if name in grads_c else f"_orig_mod.{name}"
            torch.testing.assert_close(grads_c[key], grads_e[name], rtol=1e-4, atol=1e-6)


NCCL_GROUPS = """
import torch, torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning_mhc.strategies.runtime import ParallelRuntime
from lightning_mhc.strategies.settings import ParallelSettings
runtime = ParallelRuntime(ParallelSettings())
runtime.start(LightningEnvironment(), torch.device("cuda", 0))
layout = runtime.layout
for group in (layout.tp_group, layout.dp_group):
    value = torch.ones(4, device="cuda")
    dist.all_reduce(value, group=group)
    assert value.sum().item() == 4
print("backend", dist.get_backend(), "world", dist.get_world_size())
runtime.stop()
"""


@cuda_only
def test_the_strategy_groups_on_nccl_at_world_size_one():
    import subprocess
    import sys

    from subprocess_env import child_env

    proc = subprocess.run([sys.executable, "-c", NCCL_GROUPS], capture_output=True, text=True, timeout=300,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "backend nccl world 1" in proc.stdout


@cuda_only
def test_training_on_one_gpu_with_bf16_and_the_fused_kernels(tmp_path):
    """``lightning-mhc-train`` on the GPU (``trainer=gpu``: bf16-mixed, ``mhc_implementation=auto``,
    so Triton's kernels where Triton imports): 40 steps lower the loss."""
    from train_cli import run_train, train_losses

    proc = run_train(tmp_path, "trainer=gpu", "data=synthetic", "trainer.max_steps=40", "trainer.log_every_n_steps=1",
                     "trainer.val_check_interval=1000", "trainer.checkpoint_every_n_steps=1000")
    assert proc.returncode == 0, proc.stderr[-6000:]
    (metrics,) = (tmp_path / "outputs").glob("*/*/metrics.csv")
    losses = train_losses(metrics)
    first, last = losses[min(losses)], losses[max(losses)]
    assert last < first - 0.5, losses
