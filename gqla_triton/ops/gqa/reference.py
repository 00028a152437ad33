"""Reference GQLA grouped-path / GQA decode (torch only; float64 on CPU is the definition of correctness).

Every (query token, head) attends over a *multiset* of cached positions: dense = all positions in
``[0, cache_seqlens)`` (causal: up to the query's position ``cache_seqlens - s_q + j``); sparse = the valid
entries of its index row, each counted as many times as it appears (gather-then-attend semantics).
Positions whose page lies beyond the block table (``>= max_pages · page_size``, so a length above that
capacity sees only what the table holds; query positions still follow ``cache_seqlens``), or whose
block-table entry is outside ``[0, num_pages)``, are skipped (the kernels never read them); a negative
``cache_seqlens`` is an empty sequence. Pages are gathered through ``_common.paging``. Empty rows and non-finite
values: as ``mla.reference`` (IEEE arithmetic over the keys a query sees and nothing from the keys it does not
see; weights summing to 0 give ``out = 0``, ``lse = -inf``).
"""

from __future__ import annotations

import math

import torch

from .._common.paging import gather_pages, key_capacity, page_rows
from ..mla.reference import seen_pv

__all__ = ["gqa_decode_reference", "position_counts"]


def position_counts(
    cache_seqlens: torch.Tensor, s_q: int, g: int, length: int, *, causal: bool = True,
    indices: torch.Tensor | None = None, topk_length: torch.Tensor | None = None,
) -> torch.Tensor:
    """How many times each query ``[B, s_q, g]`` attends to each position: float64 ``[B, s_q, g, length]``."""
    B = cache_seqlens.shape[0]
    counts = torch.zeros(B, s_q, g, length, dtype=torch.float64)
    pos = torch.arange(length)
    for b in range(B):
        L = max(0, int(cache_seqlens[b]))
        for j in range(s_q):
            last = L - s_q + j if causal else L - 1
            if indices is None:
                counts[b, j, :, :] = ((pos < L) & (pos <= last)).double()[None, :]
                continue
            for gg in range(g):
                row = (indices[b, j, gg] if indices.dim() == 4 else indices[b, j]).long().cpu()
                n = row.shape[0] if topk_length is None else max(0, min(row.shape[0], int(topk_length[b])))
                row = row[:n]
                row = row[(row >= 0) & (row < L) & (row <= last) & (row < length)]
                counts[b, j, gg] = torch.bincount(row, minlength=length)[:length].double()
    return counts


def gqa_decode_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    cache_seqlens: torch.Tensor, k_rope_cache: torch.Tensor | None = None, softmax_scale: float | None = None,
    causal: bool = True, indices: torch.Tensor | None = None, topk_length: torch.Tensor | None = None,
    *, compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``gqa_decode``; returns float64 ``out [B, s_q, h_q, d_v]`` and ``lse [B, h_q, s_q]``.

    ``compute_dtype`` rounds the two matmul inputs (q·k and p·v) to a low precision, mimicking a kernel at
    that precision (used for data-derived tolerances); softmax statistics stay in float64.
    """
    q = q.detach().cpu().double()
    B, s_q, h_q, _ = q.shape
    num_pages, page_size, g, d_h = k_cache.shape
    G = h_q // g
    # positions past the block table's capacity hold no key (and are never allocated here)
    longest = int(cache_seqlens.max().clamp(min=0)) if cache_seqlens.numel() else 0
    L = max(1, min(longest, key_capacity(block_table.shape[1], page_size)))
    k = gather_pages(k_cache.detach().cpu().double(), block_table.cpu(), L)  # [B, L, g, d_h]
    v = gather_pages(v_cache.detach().cpu().double(), block_table.cpu(), L)
    if k_rope_cache is not None:
        kr = gather_pages(k_rope_cache.detach().cpu().double(), block_table.cpu(), L)  # [B, L, d_R]
        k = torch.cat([k, kr[:, :, None, :].expand(B, L, g, kr.shape[-1])], dim=-1)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    counts = position_counts(cache_seqlens.cpu(), s_q, g, L, causal=causal, indices=None if indices is None
                             else indices.cpu(), topk_length=None if topk_length is None else topk_length.cpu())
    # tokens whose page is beyond the block table or names no page of the cache are skipped (never read)
    _, readable = page_rows(block_table.cpu().long(), num_pages, page_size, L)  # [B, L]
    counts = counts * readable[:, None, None, :]
    counts = counts.repeat_interleave(G, dim=2)  # [B, s_q, h_q, L]

    def rnd(t):
        return t.to(compute_dtype).double()

    # head h reads group h // G: the scores per group, never a per-head copy of the cache
    s = torch.einsum("bjgcd,blgd->bjgcl", rnd(q).reshape(B, s_q, g, G, q.shape[-1]), rnd(k)).reshape(B, s_q, h_q, L)
    s = s * softmax_scale
    seen = counts > 0
    # a key a query does not see takes no part in its arithmetic (a NaN or inf score there included)
    s = torch.where(seen, s + torch.where(seen, counts, 1.0).log(), -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # [B, s_q, h_q]: +inf for a +inf score, NaN for a NaN one
    empty = lse == -math.inf
    p = torch.where(empty[..., None], 0.0, torch.exp(s - torch.where(empty, 0.0, lse)[..., None]))
    out = torch.where(empty[..., None], 0.0, seen_pv(rnd(p), rnd(v), seen[:, :, ::G]))
    return out, lse.permute(0, 2, 1).contiguous()
