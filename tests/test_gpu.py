"""The GPU test set (``pytest -m gpu``): what only a CUDA GPU can show, on one GPU.

- the Triton kernels at real shapes (C = 4096, 8192 tokens, 20 Sinkhorn iterations; bf16 and fp32),
  forward and every gradient, against the reference evaluated in fp64 (their error a small
  multiple of the op-by-op reference's own; under each of torch's fp32 matmul precisions, so the
  projection's tensor-core variants run), and the H_post bias-dropout-add kernel;
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
    triton = pytest.importorskip("triton")
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
    and its bias, each within ERROR_FACTOR times the op-by-op reference's own error at the same
    precision, plus ERROR_FLOOR (model_utils.py). GPU arithmetic (approximate exp, division, square
    root, another summation order) moves both; the bound is on the kernels' share. Under each
    ``torch.set_float32_matmul_precision`` the projection takes its own precision (bf16: tf32;
    fp32: fp32, tf32x3, tf32: ``projection_precision``) and the reference's matmuls cuBLAS's (fp32
    or tf32): the kernels no worse than torch at the same setting."""
    pytest.importorskip("triton")
    from model_utils import ERROR_FACTOR, ERROR_FLOOR, errors_against_fp64, hc_sublayer_inputs

    from lightning_mhc.testing.precision import float32_matmul_precision

    inputs, upstream = hc_sublayer_inputs(TOKENS, N, C, dtype, DEVICE)
    with float32_matmul_precision(matmul_precision):
        errors = errors_against_fp64("triton", inputs, upstream, N, iterations=20)
    for name, (ours, reference) in errors.items():
        assert ours <= ERROR_FACTOR * reference + ERROR_FLOOR[dtype], (name, ours, reference)


@pytest.mark.parametrize("prob", [0.0, 0.1])
def test_res_post_kernel_at_real_shapes(prob):
    """``H_res x + dropout(H_post^T (out + b))`` in bf16 against its fp32 math with the kernel's
    mask (read off an fp32 run from the same generator state: the mask depends on the seed and
    the position only): the output and the gradients of x, H_res, H_post, out and the bias
    within 2e-2."""
    pytest.importorskip("triton")
    from lightning_mhc.ops.hyper_connection import fused_res_post, reference_apply_h_res
    from lightning_mhc.ops.triton_kernels import TritonKernels

    g = torch.Generator(device=DEVICE).manual_seed(2)
    x = torch.randn(TOKENS, N * C, generator=g, device=DEVICE)
    h_res = torch.softmax(torch.randn(TOKENS, N, N, generator=g, device=DEVICE), -1)
    h_post = torch.rand(TOKENS, N, generator=g, device=DEVICE) * 2 + 0.1
    out, bias = torch.randn(TOKENS, C, generator=g, device=DEVICE), torch.randn(C, generator=g, device=DEVICE)
    upstream = torch.randn(TOKENS, N * C, generator=g, device=DEVICE)
    leaves = [t.bfloat16().requires_grad_(True) if t is x or t is out or t is bias else t.requires_grad_(True)
              for t in (x, h_res, h_post, out, bias)]
    torch.manual_seed(3)
    y = fused_res_post(*leaves, prob, TritonKernels)
    ours = [y, *torch.autograd.grad(y, leaves, upstream.bfloat16())]
    f32 = [t.detach().float().requires_grad_(True) for t in leaves]
    mixed = reference_apply_h_res(f32[1], f32[0], N)
    spread = (f32[2][:, :, None] * (f32[3] + f32[4])[:, None, :]).reshape(TOKENS, N * C)
    torch.manual_seed(3)
    y32 = fused_res_post(*(t.detach() for t in f32), prob, TritonKernels)
    keep = ((y32 - mixed).abs() > 0.5 * spread.abs()).float() if prob else 1.0
    expected = mixed + spread * keep / (1 - prob)
    reference = [expected, *torch.autograd.grad(expected, f32, upstream)]
    for name, a, b in zip(("y", "dx", "dH_res", "dH_post", "dout", "dbias"), ours, reference):
        assert rel_err(a, b) < 2e-2, (name, rel_err(a, b))


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
    if implementation == "auto" and not ON_GPU:  # 'auto' is 'fused' on CPU; Triton's kernels there, under
        pytest.skip("its interpreter, are checked the same way by tests/test_triton_kernels.py")
    none = _steps(_tiny_model(implementation, "none", 0.1))
    again = _steps(_tiny_model(implementation, "none", 0.1))
    block = _steps(_tiny_model(implementation, "mhc_block", 0.1))
    for (loss_n, grads_n), (loss_a, grads_a), (loss_b, grads_b) in zip(none, again, block):
        assert torch.equal(loss_n, loss_a), "two identical runs differ: the comparison means nothing"
        assert torch.equal(loss_b, loss_n)
        assert all(torch.equal(grads_b[k], grads_n[k]) for k in grads_n)


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
runtime.start(1, LightningEnvironment(), torch.device("cuda", 0))
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
