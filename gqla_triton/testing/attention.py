"""Pure-torch decode attention over a layer cache, with key multiplicities: the ``impl="reference"`` decode
path of ``GQLAttention`` and part of the float64 layer oracle. Computes in the inputs' dtype promoted to at
least float32."""

from __future__ import annotations

import torch

__all__ = ["attend", "key_weights", "latent_cache_attention", "grouped_cache_attention"]


def key_weights(L: int, T: int, indices=None, n=None, device=None) -> torch.Tensor:
    """How often query ``t`` (at position ``L-T+t``) attends to each key: float64 ``[T, L]``; causal, and when
    ``indices [T, topk]`` is given only its first ``n`` entries inside ``[0, L)`` (duplicates count twice)."""
    last = L - T + torch.arange(T)
    w = (torch.arange(L)[None, :] <= last[:, None]).double()
    if indices is not None:
        idx = indices.long().cpu()
        if n is not None:
            idx = idx[:, : max(0, min(idx.shape[1], int(n)))]
        w = torch.zeros(T, L, dtype=torch.float64)
        for t in range(T):
            row = idx[t][(idx[t] >= 0) & (idx[t] < L) & (idx[t] <= last[t])]
            w[t] = torch.bincount(row, minlength=L)[:L].double()
    return w.to(device)


def attend(q, k, v, scale, weights):
    """``q [T, H, D]``, ``k [L, H|1, D]``, ``v [L, H|1, Dv]``, key multiplicities ``weights [T, L]`` (0 = masked);
    a query with no key gives 0; non-finite scores and values of the keys a query sees propagate as the softmax and
    the product send them (NaN, inf); those of keys it does not see never reach it."""
    L, H = k.shape[0], q.shape[1]
    seen = weights > 0
    s = torch.einsum("thd,lhd->htl", q, k.expand(L, H, k.shape[-1])) * scale
    s = torch.where(seen[None], s + weights.to(s.dtype).clamp_min(1).log()[None], float("-inf"))
    p = torch.where(seen.any(-1)[None, :, None], torch.softmax(s, -1), 0.0)
    v = v.expand(L, H, v.shape[-1])
    bad = ~torch.isfinite(v).all(-1).all(-1)  # keys with a non-finite value: summed where seen only
    out = torch.einsum("htl,lhd->thd", p, torch.where(bad[:, None, None], 0.0, v))
    if bad.any():
        pb, vb = p[..., bad], v[bad]  # [H, T, n], [n, H, Dv]
        term = torch.where(seen[:, bad].T[:, None, :, None], pb.permute(2, 0, 1)[..., None] * vb[:, :, None], 0.0)
        out = out + term.sum(0).transpose(0, 1)
    return out


def latent_cache_attention(q, cache, ids, r: int, scale: float, indices=None,
                            topk_length=None) -> torch.Tensor:
    """Absorb-path attention in torch (float32 or wider): ``q [B, T, h, r + d_R]`` -> ``[B, T, h, r]``."""
    cdt = torch.promote_types(q.dtype, torch.float32)
    outs = []
    for b, s in enumerate(ids):
        c, kr = cache.gather(s)
        key = torch.cat([c, kr], -1).to(cdt)[:, None]
        w = key_weights(c.shape[0], q.shape[1], None if indices is None else indices[b],
                         None if topk_length is None else topk_length[b], q.device)
        outs.append(attend(q[b].to(cdt), key, c.to(cdt)[:, None], scale, w))
    return torch.stack(outs).to(q.dtype)


def grouped_cache_attention(q, cache, ids, dh: int, scale: float, indices=None,
                             topk_length=None) -> torch.Tensor:
    """Grouped-path attention in torch (float32 or wider): ``q [B, T, h, d_h + d_R]`` -> ``[B, T, h, d_v]``."""
    cdt = torch.promote_types(q.dtype, torch.float32)
    B, T, h, _ = q.shape
    g = cache.num_groups
    outs = []
    for b, s in enumerate(ids):
        k, v, kr = cache.gather(s)
        L = k.shape[0]
        key = torch.cat([k, kr[:, None].expand(L, g, kr.shape[-1])], -1).to(cdt).repeat_interleave(h // g, 1)
        w = key_weights(L, T, None if indices is None else indices[b],
                         None if topk_length is None else topk_length[b], q.device)
        outs.append(attend(q[b].to(cdt), key, v.to(cdt).repeat_interleave(h // g, 1), scale, w))
    return torch.stack(outs).to(q.dtype)
