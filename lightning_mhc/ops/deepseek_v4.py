"""DeepSeek-V4's hyper-connections on this project's ops, with their own parameters.

transformers' ``DeepseekV4HyperConnection`` (a decoder layer's ``attn_hc`` and ``ffn_hc``) holds
``fn [(2+n)n, n*D]``, ``base [(2+n)n]`` and ``scale [3]``; ``DeepseekV4HyperHead`` (the model's
``hc_head``) holds ``hc_fn [n, n*D]``, ``hc_base [n]`` and ``hc_scale [1]``. They are this project's
packed ``phi^T``, ``bias`` and ``alpha`` in DeepSeek-V4's convention (``lightning_mhc.ops.convention``,
docs/native_mhc.md), so the fused ops run them as they are: ``fn.t()`` is a view, every parameter is
read in place and gets its gradient in place (no copy that could drift, the same state-dict names).

- :func:`deepseek_v4_pre`: a hyper-connection's forward, ``(post, comb, collapsed)`` as
  transformers' returns them (``comb`` is a transposed view of the ops' ``H_res``);
- :func:`deepseek_v4_res_post`: the layer's ``post ⊗ F + comb^T x`` in one pass of the kernels;
- :func:`deepseek_v4_head`: the head's collapse;
- :func:`hy_v4_pre`: HY-V4's hyper-connection (``HYV4HyperConnection``: ``fn [2n, n*D]``,
  ``base [2n]``, ``scale [2]``, no ``comb``, ``post = hc_post_magnitude sigmoid + hc_eps``), the
  head's kernel with a post gate (``HyperHead`` with ``post_magnitude``);
- :func:`use_our_ops`: a module (or every such module of a model) swapped in place to a subclass
  whose forward is the above (``isinstance``, class name, parameters and state-dict names kept;
  copies and pickles rebuild it); decoder layers also mix on the kernels.

The modules are recognised by their attributes, so this room imports no transformers. HY-V4's
``hc_head`` (``HYV4HyperHead``) is V4's head with the norm's factor applied after the projection
(the same function): it is found and run as one; HY-V4's ``attn_hc`` / ``ffn_hc`` run on
:func:`hy_v4_pre` (their decoder layer keeps transformers' ``post ⊗ F + x``, an elementwise add).
``implementation`` is ``mhc_implementation``'s (``lightning_mhc.ops``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_mhc.ops import MHC_IMPLEMENTATIONS, fused_kernels, is_fused
from lightning_mhc.ops.convention import Convention, deepseek_v4
from lightning_mhc.ops.hyper_connection import (
    compiled,
    fused_hyper_head,
    fused_pre_packed,
    fused_res_post,
    reference_pre,
    reference_res_post,
)
from lightning_mhc.ops.rms_norm import rms_normalize
from lightning_mhc.wrapping import unwrap, wrap


def convention_of(hc: nn.Module) -> Convention:
    """The V4 convention with the module's ``hc_eps``."""
    return deepseek_v4(float(hc.hc_eps))


def _check(implementation: str) -> None:
    if implementation not in MHC_IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: one of {MHC_IMPLEMENTATIONS}")


def deepseek_v4_pre(hc: nn.Module, hidden_streams: Tensor, implementation: str = "auto"):
    """``DeepseekV4HyperConnection.forward`` on our ops: ``[B, S, n, D]`` -> ``(post [B, S, n],
    comb [B, S, n, n], collapsed [B, S, D])`` (``comb`` a view of the ops' ``H_res = comb^T``)."""
    _check(implementation)
    n = hc.hc_mult
    lead = hidden_streams.shape[:-2]
    x = hidden_streams.reshape(*lead, -1)
    phi, norm_eps, iterations = hc.fn.t(), float(hc.input_norm.eps), int(hc.hc_sinkhorn_iters)
    convention = convention_of(hc)
    if is_fused(implementation):
        kernels = fused_kernels(implementation, x.device.type)
        collapsed, h_res, post = fused_pre_packed(x, phi, hc.scale, hc.base, n, norm_eps, iterations, kernels,
                                                  convention)
    else:
        params = (phi[:, :n], phi[:, n:2 * n], phi[:, 2 * n:], hc.scale[0], hc.scale[1], hc.scale[2],
                  hc.base[:n], hc.base[n:2 * n], hc.base[2 * n:].view(n, n))
        pre = compiled(reference_pre) if implementation == "compile" else reference_pre
        collapsed, h_res, post = pre(x, params, n, norm_eps, iterations, convention)
    return post, h_res.mT, collapsed.to(hidden_streams.dtype)


def deepseek_v4_res_post(hidden_streams: Tensor, post: Tensor, comb: Tensor, out: Tensor,
                         implementation: str = "auto") -> Tensor:
    """A V4 decoder layer's ``post ⊗ out + comb^T x`` (``[B, S, n, D]``) on our ops: one pass of
    the kernels each way for the fused implementations (``H_res = comb^T``)."""
    _check(implementation)
    n = post.shape[-1]
    x = hidden_streams.reshape(*hidden_streams.shape[:-2], -1)
    h_res = comb.mT
    if is_fused(implementation):
        with torch.autocast(device_type=x.device.type, enabled=False):
            y = fused_res_post(x, h_res, post, out, None, 0.0, fused_kernels(implementation, x.device.type))
    else:
        res_post = compiled(reference_res_post) if implementation == "compile" else reference_res_post
        y = res_post(x, h_res, post, out)
    return y.view(*hidden_streams.shape[:-2], n, -1)


def deepseek_v4_head(head: nn.Module, x: Tensor, implementation: str = "auto") -> Tensor:
    """``DeepseekV4HyperHead.forward`` (and ``HYV4HyperHead``'s) on our ops: ``[B, S, n, D]`` -> ``[B, S, D]``."""
    return _gates_only(head, head.hc_fn, head.hc_scale, head.hc_base, float(head.eps), None, x, implementation)


def hy_v4_pre(hc: nn.Module, hidden_streams: Tensor, implementation: str = "auto") -> tuple[Tensor, Tensor]:
    """``HYV4HyperConnection.forward`` on our ops: ``[B, S, n, D]`` -> ``(post [B, S, n] (fp32),
    collapsed [B, S, D])``; ``post = hc_post_magnitude * sigmoid(.) + hc_eps``. Its layer's
    ``post ⊗ F + x`` stays transformers' elementwise line (autograd saves ``post`` and ``F`` only)."""
    collapsed, post = _gates_only(hc, hc.fn, hc.scale, hc.base, float(hc.hc_eps), float(hc.hc_post_magnitude),
                                  hidden_streams, implementation)
    return post, collapsed


def _gates_only(module: nn.Module, fn: Tensor, scale: Tensor, base: Tensor, eps: float, post_magnitude,
                x: Tensor, implementation: str):
    """A collapse by sigmoid gates (``HyperHead``): the head's output, or with ``post_magnitude``
    HY-V4's ``(collapsed, post)``."""
    _check(implementation)
    n = module.hc_mult
    flat = x.reshape(*x.shape[:-2], -1)
    norm_eps = float(module.input_norm.eps)
    if is_fused(implementation):
        kernels = fused_kernels(implementation, x.device.type)
        outs = fused_hyper_head(flat, fn.t(), scale, base, n, norm_eps, eps, kernels, post_magnitude)
    else:
        outs = (compiled(_reference_gates) if implementation == "compile" else _reference_gates)(
            flat, fn, scale, base, n, norm_eps, eps, post_magnitude)
    if post_magnitude is None:
        return outs.to(x.dtype)
    return outs[0].to(x.dtype), outs[1]


def _reference_gates(flat: Tensor, fn: Tensor, scale: Tensor, base: Tensor, n: int, norm_eps: float,
                     eps: float, post_magnitude: float | None):
    """``HyperHead`` op by op (the norm as one node, as ``reference_pre``'s)."""
    with torch.autocast(device_type=flat.device.type, enabled=False):
        flat = flat.view_as(flat)
        gates = torch.sigmoid(rms_normalize(flat, norm_eps) @ fn.t().to(torch.promote_types(flat.dtype, torch.float32))
                              * scale.repeat_interleave(n) + base)
        out = ((gates[..., :n] + eps).unsqueeze(-1) * flat.unflatten(-1, (n, -1))).sum(dim=-2)
        return out if post_magnitude is None else (out, gates[..., n:] * post_magnitude + eps)


# ------------------------------------------------------------------ the modules swapped in place
class _OurHyperConnection:
    def forward(self, hidden_streams: Tensor):
        return deepseek_v4_pre(self, hidden_streams, self.mhc_implementation)


class _OurHyV4HyperConnection:
    def forward(self, hidden_streams: Tensor):
        return hy_v4_pre(self, hidden_streams, self.mhc_implementation)


class _OurHyperHead:
    def forward(self, x: Tensor) -> Tensor:
        return deepseek_v4_head(self, x, self.mhc_implementation)


class _OurDecoderLayer:
    """transformers' ``DeepseekV4DecoderLayer.forward`` with the streams mixed by our kernels
    (its ``attn_hc`` / ``ffn_hc`` are swapped too)."""

    def forward(self, hidden_states: Tensor, input_ids: Tensor | None = None, **kwargs: Any) -> Tensor:
        post, comb, collapsed = self.attn_hc(hidden_states)
        attn_output, _ = self.self_attn(self.input_layernorm(collapsed), **kwargs)
        hidden_states = self.mix_streams(hidden_states, post, comb, attn_output)
        post, comb, collapsed = self.ffn_hc(hidden_states)
        mlp_output = self.mlp(self.post_attention_layernorm(collapsed), input_ids=input_ids)
        return self.mix_streams(hidden_states, post, comb, mlp_output)

    def mix_streams(self, hidden_streams: Tensor, post: Tensor, comb: Tensor, output: Tensor) -> Tensor:
        """The layer's residual mix on our kernels; block recompute of the layer (which may not
        import the ops' room) replays it by this name, so that it stays this forward bit for bit."""
        return deepseek_v4_res_post(hidden_streams, post, comb, output, self.mhc_implementation)


_ROLES = {"hyper_connection": _OurHyperConnection, "hy_v4_hyper_connection": _OurHyV4HyperConnection,
          "hyper_head": _OurHyperHead, "decoder_layer": _OurDecoderLayer}
_CLASSES: dict[tuple[type, str], type] = {}


def role_of(module: nn.Module) -> str | None:
    """What a module is to V4's hyper-connections, by its attributes: ``"hyper_connection"``
    (``fn``, ``base``, ``scale``, ``hc_sinkhorn_iters``), ``"hyper_head"`` (``hc_fn``, ``hc_base``,
    ``hc_scale``), ``"decoder_layer"`` (``attn_hc`` and ``ffn_hc`` of the first kind),
    ``"hy_v4_hyper_connection"`` (``fn``, ``base``, ``scale``, ``hc_post_magnitude``: HY-V4's), else None."""
    if all(hasattr(module, a) for a in ("fn", "base", "scale", "hc_sinkhorn_iters", "hc_mult", "hc_eps")):
        return "hyper_connection"
    if all(hasattr(module, a) for a in ("fn", "base", "scale", "hc_post_magnitude", "hc_mult", "hc_eps")):
        return "hy_v4_hyper_connection"
    if all(hasattr(module, a) for a in ("hc_fn", "hc_base", "hc_scale", "hc_mult", "eps")):
        return "hyper_head"
    branches = [getattr(module, name, None) for name in ("attn_hc", "ffn_hc")]
    if all(isinstance(b, nn.Module) and role_of(b) == "hyper_connection" for b in branches):
        return "decoder_layer"
    return None


def _our_class(base: type, role: str) -> type:
    if issubclass(base, _ROLES[role]):
        return base
    cls = _CLASSES.get((base, role))
    if cls is None:
        cls = type(base.__name__, (_ROLES[role], base), {
            "__module__": __name__, "__qualname__": base.__qualname__, "our_ops_base": base,
            "our_ops_role": role, "__reduce_ex__": _reduce_ex})
        _CLASSES[(base, role)] = cls
    return cls


def _reduce_ex(self: nn.Module, protocol: int):
    return _rebuild, (type(self).our_ops_base, type(self).our_ops_role), self.__getstate__()


def _rebuild(base: type, role: str) -> nn.Module:
    cls = _our_class(base, role)
    return cls.__new__(cls)


def use_our_ops(module: nn.Module, implementation: str = "auto") -> nn.Module:
    """Run DeepSeek-V4's hyper-connections of ``module`` on our ops, in place: ``module`` itself
    when it is a hyper-connection, the hyper head or a decoder layer (:func:`role_of`), else every
    such module inside it (a ``DeepseekV4Model`` / ``ForCausalLM``). Their parameters, state-dict
    names, ``isinstance`` and class names stay; ``implementation`` (``mhc_implementation``) picks
    the ops. Returns ``module``; raises when it holds none."""
    _check(implementation)
    found = 0
    for sub in module.modules():
        role = role_of(sub)
        if role is not None:
            unwrap(sub, owner="our_ops")  # called again: the ops chosen anew
            wrap(sub, "our_ops", _our_class(type(sub), role))
            sub.mhc_implementation = implementation
            found += 1
    if not found:
        raise TypeError(f"{type(module).__name__} holds no DeepSeek-V4 / HY-V4 hyper-connection, hyper head or "
                        "decoder layer (modules with fn/base/scale and hc_sinkhorn_iters or hc_post_magnitude, "
                        "hc_fn/hc_base/hc_scale, or attn_hc and ffn_hc)")
    return module


__all__ = ["convention_of", "deepseek_v4_head", "deepseek_v4_pre", "deepseek_v4_res_post", "hy_v4_pre", "role_of",
           "use_our_ops"]
