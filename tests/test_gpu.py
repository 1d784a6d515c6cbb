"""The GPU test set (``pytest -m gpu``): what only a CUDA GPU can show, on one GPU.

- the Triton kernels against the op-by-op reference at real shapes (C = 4096, 8192 tokens, bf16,
  and fp32), forward and every gradient, and the H_post bias-dropout-add kernel;
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


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def _hc_inputs(dtype: torch.dtype):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    m = N * N + 2 * N
    phi = torch.randn(N * C, m, generator=g, device=DEVICE) * (1.0 / (N * C) ** 0.5)
    alpha = torch.tensor([0.8, 0.6, 1.5], device=DEVICE)
    bias = torch.randn(m, generator=g, device=DEVICE)
    x = torch.randn(TOKENS, N * C, generator=g, device=DEVICE).to(dtype)
    return x, phi, alpha, bias


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
def test_triton_kernels_match_the_reference_at_real_shapes(dtype, tolerance):
    """The fused node with Triton's kernels against ``reference_pre`` under autograd: outputs and
    the gradients of the stream, phi, alpha and the bias (20 Sinkhorn iterations)."""
    pytest.importorskip("triton")
    from lightning_mhc.ops.hyper_connection import fused_pre_packed, reference_pre
    from lightning_mhc.ops.triton_kernels import TritonKernels

    x0, phi0, alpha0, bias0 = _hc_inputs(dtype)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    weights = [torch.randn(shape, generator=g, device=DEVICE) for shape in ((TOKENS, C), (TOKENS, N * C), (TOKENS, N))]

    def run(triton: bool):
        x, phi, alpha, bias = (t.clone().requires_grad_(True) for t in (x0, phi0, alpha0, bias0))
        if triton:
            outs = fused_pre_packed(x, phi, alpha, bias, N, 1e-6, 20, TritonKernels)
        else:
            n = N
            params = (phi[:, :n], phi[:, n:2 * n], phi[:, 2 * n:], alpha[0], alpha[1], alpha[2],
                      bias[:n], bias[n:2 * n], bias[2 * n:].view(n, n))
            outs = reference_pre(x, params, n, 1e-6, 20)
        loss = sum((o.float() * w).sum() for o, w in zip(outs, weights))
        return [*(o.detach() for o in outs), *torch.autograd.grad(loss, (x, phi, alpha, bias))]

    names = ("aggregated", "mixed", "H_post", "dx", "dphi", "dalpha", "dbias")
    for name, ours, reference in zip(names, run(True), run(False)):
        assert ours.dtype == reference.dtype, name
        assert _relative(ours, reference) < tolerance, (name, _relative(ours, reference))


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
def test_h_post_bias_dropout_add_kernel_at_real_shapes(dtype, tolerance):
    pytest.importorskip("triton")
    from lightning_mhc.ops.triton_kernels import h_post_bda

    g = torch.Generator(device=DEVICE).manual_seed(2)
    leaves = [t.to(dtype).requires_grad_(True) for t in (
        torch.randn(TOKENS, N * C, generator=g, device=DEVICE), torch.rand(TOKENS, N, generator=g, device=DEVICE) * 2,
        torch.randn(TOKENS, C, generator=g, device=DEVICE), torch.randn(C, generator=g, device=DEVICE))]
    mixed, h_post, out, bias = leaves
    upstream = torch.randn(TOKENS, N * C, generator=g, device=DEVICE).to(dtype)
    y = h_post_bda(mixed, h_post, out, bias, 0.0)
    ours = [y, *torch.autograd.grad(y, leaves, upstream)]
    f32 = [t.detach().float().requires_grad_(True) for t in leaves]
    expected = f32[0] + (f32[1][:, :, None] * (f32[2] + f32[3])[:, None, :]).reshape(TOKENS, N * C)
    reference = [expected, *torch.autograd.grad(expected, f32, upstream.float())]
    for name, a, b in zip(("y", "dmixed", "dH_post", "dout", "dbias"), ours, reference):
        assert _relative(a, b) < tolerance, (name, _relative(a, b))


def _tiny_model(implementation: str, policy: str, dropout: float, hidden: int = 64):
    from lightning_mhc.model import GPTModel
    from lightning_mhc.recompute import attach_recompute, configure_recompute
    from model_utils import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config(num_layers=2, hidden_size=hidden, ffn_hidden_size=2 * hidden, hidden_dropout=dropout,
                      attention_dropout=dropout, mhc_implementation=implementation)
    model = GPTModel(configure_recompute(cfg, policy))
    attach_recompute(model)
    return model.to(DEVICE)


def _steps(model, steps: int = 3, batch: int = 2, seq: int = 32, autocast: bool = False):
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


@pytest.mark.parametrize("implementation", ["auto", "fused"])
def test_block_recompute_is_bit_exact_with_dropout(model_parallel, deterministic, implementation):
    """Dropout 0.1 (hidden and attention): ``mhc_block`` gives ``none``'s losses and gradients bit for
    bit over 3 AdamW steps (the recompute replays the CUDA generators); two ``none`` runs agree too."""
    if implementation == "auto" and not ON_GPU:
        implementation = "triton"  # the dry run: 'auto' is the eager set on CPU
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
        assert _relative(loss_c, loss_e) < 1e-5
        for name in grads_e:
            key = name if name in grads_c else f"_orig_mod.{name}"
            torch.testing.assert_close(grads_c[key], grads_e[name], rtol=1e-4, atol=1e-6)


NCCL_GROUPS = """
import torch, torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning_mhc.distributed.runtime import ParallelRuntime, ParallelSettings
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
