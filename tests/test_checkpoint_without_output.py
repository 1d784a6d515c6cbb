"""CheckpointWithoutOutput and MHCBlockRecomputeManager on small graphs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_mhc import CheckpointWithoutOutput, MHCBlockRecomputeManager
from lightning_mhc.recompute import ActivationMemoryMeter, register_rng_state_source
from lightning_mhc.recompute import rng as rng_module


def _leaf(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_()


def _dropout_gelu(x):
    return F.dropout(F.gelu(x), p=0.5, training=True)


def test_discard_and_recompute_restores_storage_in_place():
    x, w = _leaf(8, 16), _leaf(16, 16, seed=1)
    torch.manual_seed(3)
    ref = (_dropout_gelu(x) @ w).sum()
    ref.backward()
    ref_grads = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None

    torch.manual_seed(3)
    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(_dropout_gelu, x)
    z = y @ w  # saves y for w's gradient
    forward_value = y.detach().clone()
    ckpt.discard_output_and_register_recompute(z)
    assert y.untyped_storage().nbytes() == 0
    loss = z.sum()
    torch.testing.assert_close(loss, ref, rtol=0, atol=0)
    loss.backward()
    assert torch.equal(y, forward_value), "recomputed dropout mask differs"
    assert torch.equal(x.grad, ref_grads[0]) and torch.equal(w.grad, ref_grads[1])


def test_nested_arguments_and_none_outputs():
    out, bias, residual = _leaf(4, 8), _leaf(8, seed=1), _leaf(4, 8, seed=2)

    def bda(x_with_bias, res, prob):
        o, b = x_with_bias
        return res + F.dropout(o + b, p=prob, training=True), None

    torch.manual_seed(0)
    ref, _ = bda((out, bias), residual, 0.3)
    (ref * ref).sum().backward()
    ref_grads = [t.grad.clone() for t in (out, bias, residual)]
    for t in (out, bias, residual):
        t.grad = None
    torch.manual_seed(0)
    ckpt = CheckpointWithoutOutput()
    y, nothing = ckpt.checkpoint(bda, (out, bias), residual, 0.3)
    assert nothing is None
    sq = y * y
    ckpt.discard_output_and_register_recompute(sq)
    sq.sum().backward()
    for t, g in zip((out, bias, residual), ref_grads):
        assert torch.equal(t.grad, g)


def test_recompute_twice_is_an_error():
    x = _leaf(4, 4)
    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(torch.tanh, x)
    z = y * y
    ckpt.discard_output_and_register_recompute(z)
    z.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="recompute triggered twice"):
        z.sum().backward()


def test_autograd_grad_is_an_error():
    x = _leaf(4, 4)
    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(torch.tanh, x)
    z = y * y
    ckpt.discard_output_and_register_recompute(z)
    with pytest.raises(RuntimeError, match="not compatible with torch.autograd.grad"):
        torch.autograd.grad(z.sum(), x)


def test_no_grad_hook_tensor_keeps_outputs():
    x = torch.randn(4, 4)
    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(torch.tanh, x)
    ckpt.discard_output_and_register_recompute(y * 2)
    assert torch.equal(y, torch.tanh(x))


def test_tracker_states_are_restored():
    """A registered RNG source is captured and restored around recompute."""
    gen = torch.Generator().manual_seed(5)
    register_rng_state_source("test_gen", gen.get_state, gen.set_state)
    try:
        x = _leaf(64)
        ckpt = CheckpointWithoutOutput()
        y = ckpt.checkpoint(lambda t: t * torch.rand(64, generator=gen), x)
        first = y.detach().clone()
        after_forward = gen.get_state()
        z = y * 1.0
        ckpt.discard_output_and_register_recompute(z)
        z.sum().backward()
        assert torch.equal(y, first)
        assert torch.equal(gen.get_state(), after_forward), "recompute must not advance the tracker"
    finally:
        rng_module._SOURCES.pop("test_gen")


def test_manager_recomputes_chain_in_forward_order_from_one_hook():
    x, w = _leaf(6, 8), _leaf(8, 8, seed=1)
    ref = ((torch.tanh(x) * 2).sigmoid() @ w).relu()
    ref.sum().backward()
    ref_grads = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None

    manager = MHCBlockRecomputeManager("chain")
    a = CheckpointWithoutOutput(ckpt_manager=manager).checkpoint(torch.tanh, x)
    b = CheckpointWithoutOutput(ckpt_manager=manager).checkpoint(lambda t: t * 2, a)
    c = CheckpointWithoutOutput(ckpt_manager=manager).checkpoint(torch.sigmoid, b)
    out = (c @ w).relu()  # not checkpointed: the hook tensor
    with pytest.raises(ValueError, match="about to be freed"):
        manager.discard_all_outputs_and_register_unified_recompute(c)
    manager.discard_all_outputs_and_register_unified_recompute(out)
    names = [e.name for e in manager.last_plan]
    assert [n.rsplit(".", 1)[-1] for n in names] == ["tanh", "<lambda>", "sigmoid"], names
    assert [e.bytes_freed for e in manager.last_plan] == [6 * 8 * 4] * 3
    assert all(t.untyped_storage().nbytes() == 0 for t in (a, b, c))
    out.sum().backward()
    assert manager.recompute_count == 1
    assert torch.equal(x.grad, ref_grads[0]) and torch.equal(w.grad, ref_grads[1])


def test_manager_makes_discard_a_no_op_and_skips_no_grad():
    manager = MHCBlockRecomputeManager()
    x = _leaf(4)
    ckpt = CheckpointWithoutOutput(ckpt_manager=manager)
    y = ckpt.checkpoint(torch.exp, x)
    ckpt.discard_output_and_register_recompute(y * 1)
    assert y.untyped_storage().nbytes() > 0 and manager.checkpoints == [ckpt]
    with torch.no_grad():
        hook = y * 3
    manager.discard_all_outputs_and_register_unified_recompute(hook)
    assert not manager.hook_registered and y.untyped_storage().nbytes() > 0


def test_out_of_order_recompute_is_detected():
    manager = MHCBlockRecomputeManager()
    x = _leaf(4)
    a = CheckpointWithoutOutput(ckpt_manager=manager).checkpoint(torch.exp, x)
    CheckpointWithoutOutput(ckpt_manager=manager).checkpoint(torch.sin, a)
    manager.checkpoints.reverse()  # break the forward order
    out = a.detach().requires_grad_()
    manager.discard_all_outputs_and_register_unified_recompute(out * 1)
    with pytest.raises(RuntimeError, match="forward order"):
        manager._unified_recompute_hook(None)


def test_activation_meter_counts_saved_storages_once():
    lin = torch.nn.Linear(32, 32)
    x = torch.randn(10, 32)
    with ActivationMemoryMeter(lin) as meter:
        h = lin(x)  # saves x (input; weight excluded)
        y = torch.tanh(h)  # saves its output y
        z = y * y  # saves y twice: counted once
    assert meter.result.retained_bytes == 2 * 10 * 32 * 4
    z.sum().backward()
