"""Float64 reference of ``mla_decode`` (torch only): gather the paged latent cache (``_common.paging``), then
einsum attention.

Definitions (the kernels follow them exactly):
- key ``s`` of sequence ``b`` = full cache row ``[latent ; rope]`` (``D = r + d_R`` channels); its value = the
  first ``head_dim_v`` channels of the same row.
- dense: query ``j`` of ``s_q`` sits at position ``cache_seqlens[b] - s_q + j`` when ``causal`` and sees the
  keys at positions ``0 .. that position``; without ``causal`` every query sees ``[0, cache_seqlens[b])``.
  A query whose position is negative sees nothing.
- a key whose page lies beyond the block table, or whose block id is outside ``[0, num_pages)``, is ignored.
- sparse: ``indices[b, j, :n]`` (``n = min(topk, topk_length[b])``, clamped at 0) are logical positions;
  entries that are negative, ``>= cache_seqlens[b]``, after the query's position (causal), or whose page is
  invalid as above, are ignored. A **duplicated index counts once per occurrence** (exactly as gathering
  the selected rows and attending to them would): its weight in the softmax is multiplied by its count.
- a query that sees no key: ``out = 0``, ``lse = -inf``. ``lse`` is the natural-log log-sum-exp of the
  scaled scores (``[B, h_q, s_q]``).
"""

from __future__ import annotations

import math

import torch

from .._common.paging import gather_pages, key_capacity, page_rows

__all__ = ["mla_decode_ref"]


def mla_decode_ref(q, kv_cache, block_table, cache_seqlens, head_dim_v=512, softmax_scale=None, causal=True,
                   indices=None, topk_length=None, *, p_dtype=None):
    """Reference ``(out [B, s_q, h_q, head_dim_v] float64, lse [B, h_q, s_q] float64)`` on the CPU.

    ``p_dtype`` (tests only): round the probabilities and the output to that dtype, i.e. what a torch
    implementation at the kernel's precision does; gives the low-precision error the tolerance is built on.
    """
    q = q.detach().double().cpu()
    kv_cache = kv_cache.detach().double().cpu()
    block_table = block_table.detach().long().cpu()
    seqlens = cache_seqlens.detach().long().cpu()
    B, s_q, h_q, D = q.shape
    num_pages, page_size = kv_cache.shape[:2]
    if softmax_scale is None:
        softmax_scale = D ** -0.5
    L = key_capacity(block_table.shape[1], page_size)
    pos = torch.arange(L)
    _, valid = page_rows(block_table, num_pages, page_size, L)  # [B, L]: the position has a physical row
    keys = gather_pages(kv_cache, block_table, L)[:, :, 0]  # [B, L, D], zeros where not valid

    qpos = seqlens[:, None] - s_q + torch.arange(s_q)[None, :]  # [B, s_q]
    last = qpos if causal else (seqlens[:, None] - 1).expand(B, s_q)
    if indices is None:
        count = ((pos[None, None, :] < seqlens[:, None, None]) & (pos[None, None, :] <= last[..., None])
                 & valid[:, None, :]).double()  # [B, s_q, L]
    else:
        idx = indices.detach().long().cpu()
        topk = idx.shape[-1]
        n = torch.full((B,), topk) if topk_length is None else topk_length.detach().long().cpu().clamp(0, topk)
        inside = torch.arange(topk)[None, None, :] < n[:, None, None]
        ok = inside & (idx >= 0) & (idx < seqlens[:, None, None]) & (idx <= last[..., None])
        safe = torch.where(ok, idx, torch.zeros_like(idx)).clamp(max=L - 1)
        ok = ok & torch.gather(valid[:, None, :].expand(B, s_q, L), 2, safe)
        count = torch.zeros(B, s_q, L, dtype=torch.float64)
        count.scatter_add_(2, safe, ok.double())

    s = torch.einsum("bqhd,bnd->bqhn", q, keys) * softmax_scale
    logw = torch.where(count > 0, count.log(), torch.full_like(count, -math.inf))[:, :, None, :]
    s = s + logw
    lse = torch.logsumexp(s, dim=-1)  # [B, s_q, h_q]
    seen = torch.isfinite(lse)
    p = torch.where(seen[..., None], torch.exp(s - torch.where(seen, lse, 0.0)[..., None]), 0.0)
    if p_dtype is not None:
        p = p.to(p_dtype).double()
    out = torch.einsum("bqhn,bnd->bqhd", p, keys[..., :head_dim_v])
    if p_dtype is not None:
        out = out.to(p_dtype).double()
    return out, lse.permute(0, 2, 1).contiguous()
