"""Float64 reference of a whole ``GQLAttention`` layer (einsums only), the definition its kernels' paths are
tested against."""

from __future__ import annotations

import torch

from ..layers.rope import apply_rope
from .attention import attend, key_weights

__all__ = ["gqla_reference"]


def gqla_reference(layer, hidden_states: torch.Tensor, positions: torch.Tensor, past=None, *,
                   params: dict | None = None, indices=None, topk_length=None):
    """Float64 CPU reference of ``layer`` (einsums only): ``hidden_states [B, T, hidden]`` -> ``[B, T, hidden]``.

    ``positions [B, T]`` rotate the new tokens. ``past`` (optional): per sequence a pair ``(c [L_b, r],
    k_rope [L_b, d_R])`` of cached latent tokens (rope already applied) that precede the new ones; the new
    tokens attend causally to past + themselves. ``params`` (float64 CPU tensors by state-dict name) replaces
    the layer's weights, e.g. leaves to differentiate the reference; ``hidden_states`` keeps its graph.
    ``indices [B, T, topk]`` / ``topk_length [B]``: sparse attention as in ``forward``.
    """
    if params is None:
        params = {k: v.detach().to("cpu", torch.float64) for k, v in layer.state_dict().items()}
    P = params
    x = hidden_states.to("cpu", torch.float64)
    pos = positions.to("cpu")
    inv_freq = layer.rope_inv_freq
    inv_freq = None if inv_freq is None else inv_freq.to("cpu")
    B, T, _ = x.shape
    h, g, dh, dv, dR, r = (layer.num_heads, layer.num_groups, layer.head_dim, layer.v_head_dim, layer.rope_dim,
                           layer.kv_rank)

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + layer.norm_eps) * w

    if layer.q_rank is None:
        q = x @ P["q_proj.weight"].T
    else:
        q = rms(x @ P["q_a_proj.weight"].T, P["q_a_layernorm.weight"]) @ P["q_b_proj.weight"].T
    q = q.view(B, T, h, dh + dR)
    q_nope, q_rope = q[..., :dh], apply_rope(q[..., dh:], pos, layer.rope_theta, inv_freq=inv_freq)
    kv = x @ P["kv_a_proj.weight"].T
    c = kv[..., :r]
    if layer.kv_norm:
        c = rms(c, P["kv_a_layernorm.weight"])
    k_rope = apply_rope(kv[..., r:], pos, layer.rope_theta, inv_freq=inv_freq)
    w = P["kv_b_proj.weight"].view(g, dh + dv, r)
    w_uk, w_uv = w[:, :dh], w[:, dh:]
    grp = torch.arange(h) // (h // g)
    outs = []
    for b in range(B):
        if past is not None and past[b] is not None:
            pc, pk = (t.detach().to("cpu", torch.float64) for t in past[b])
        else:
            pc, pk = torch.zeros(0, r, dtype=torch.float64), torch.zeros(0, dR, dtype=torch.float64)
        call, kall = torch.cat([pc, c[b]]), torch.cat([pk, k_rope[b]])
        K = torch.einsum("gdr,lr->lgd", w_uk, call)[:, grp]  # [L, h, dh]
        V = torch.einsum("gdr,lr->lgd", w_uv, call)[:, grp]
        L = call.shape[0]
        w = key_weights(L, T, None if indices is None else indices[b],
                         None if topk_length is None else topk_length[b])
        # keys a query does not see (weight 0) never reach it, non-finite ones included (``attend``)
        outs.append(attend(torch.cat([q_nope[b], q_rope[b]], -1), torch.cat([K, kall[:, None].expand(L, h, dR)], -1),
                           V, layer.softmax_scale, w))
    o = torch.stack(outs).reshape(B, T, h * dv)
    return o @ P["o_proj.weight"].T
