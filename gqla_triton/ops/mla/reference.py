"""Float64 reference of ``mla_decode`` (torch only): gather the paged latent cache (``_common.paging``), then
einsum attention.

Definitions (the kernels follow them exactly):
- key ``s`` of sequence ``b`` = full cache row ``[latent ; rope]`` (``D = r + d_R`` channels); its value = the
  first ``head_dim_v`` channels of the same row.
- a negative ``cache_seqlens[b]`` counts as 0 (an empty sequence).
- dense: query ``j`` of ``s_q`` sits at position ``cache_seqlens[b] - s_q + j`` when ``causal`` and sees the
  keys at positions ``0 .. that position``; without ``causal`` every query sees ``[0, cache_seqlens[b])``.
  A query whose position is negative sees nothing.
- a key whose page lies beyond the block table (position ``>= max_pages · page_size``), or whose block id is
  outside ``[0, num_pages)``, is ignored. A length above the block table's capacity therefore sees the
  ``max_pages · page_size`` positions the table holds; query positions still follow ``cache_seqlens``.
- sparse: ``indices[b, j, :n]`` (``n = min(topk, topk_length[b])``, clamped at 0) are logical positions;
  entries that are negative, ``>= cache_seqlens[b]``, after the query's position (causal), or whose page is
  invalid as above (including positions at or past the capacity), are ignored (never clamped onto a key). A
  **duplicated index counts once per occurrence** (exactly as gathering the selected rows and attending to them
  would): its weight in the softmax is multiplied by its count.
- ``lse`` is the natural-log log-sum-exp of the scaled scores of the keys a query sees (``[B, h_q, s_q]``). A query
  whose weights sum to 0 (it sees no key, or every score it sees is -inf) has ``lse = -inf`` and ``out = 0``.
- non-finite values follow IEEE arithmetic over the keys a query sees and nothing else: a NaN score (NaN in q or
  in a seen key) makes its out and lse NaN; a ``+inf`` score gives ``lse = +inf`` and out NaN
  (``exp(inf - inf)``); a seen key enters ``P·V`` as ``p · v`` even where ``p = 0`` (``0 · inf = NaN``). Keys a
  query does not see (beyond its length or position, ignored sparse entries, missing pages) never enter its
  arithmetic.
"""

from __future__ import annotations

import math

import torch

from .._common.paging import gather_pages, key_capacity, page_rows
from .fp8 import dequantize_latent_fp8, is_fp8_latent

__all__ = ["mla_decode_ref", "mla_sparse_prefill_ref", "seen_pv"]


def seen_pv(p: torch.Tensor, v: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """``out[b, j, h] = Σ_n p[b, j, h, n] · v[b, n, h]`` over the keys ``n`` that row sees only, in IEEE arithmetic
    (a key a row does not see never multiplies into it, so a NaN or inf value there cannot reach it).

    ``p``: ``[B, Q, H, N]``; ``v``: ``[B, N, D]`` (shared by the heads), ``[B, N, H, D]`` (one per head) or
    ``[B, N, S, D]`` (one per key set, shared by its ``H // S`` heads); ``seen``: bool ``[B, Q, S, N]`` with S
    dividing H, the heads ``[s·H/S, (s+1)·H/S)`` seeing the keys of set ``s`` (``[B, Q, 1, N]``: all heads the
    same)."""
    B, Q, H, N = p.shape
    D = v.shape[-1]
    seen = seen.expand(B, Q, seen.shape[2], N)
    out = torch.zeros(B, Q, H, D, dtype=p.dtype)
    hs = H // seen.shape[2]  # heads per distinct key set
    per_set = v.dim() == 4 and v.shape[2] == seen.shape[2]
    for b in range(B):
        for j in range(Q):
            for g in range(seen.shape[2]):
                sel = seen[b, j, g].nonzero()[:, 0]
                if sel.numel() == 0:
                    continue
                h = slice(g * hs, (g + 1) * hs)
                pv = p[b, j, h][:, sel]  # [hs, n]
                if v.dim() == 3:
                    out[b, j, h] = pv @ v[b, sel]
                elif per_set:
                    out[b, j, h] = pv @ v[b, sel, g]
                else:
                    out[b, j, h] = torch.einsum("hn,nhd->hd", pv, v[b, sel][:, h])
    return out


def _weights(s: torch.Tensor, count, empty: torch.Tensor) -> torch.Tensor:
    """Softmax weights ``count · exp(s - max) / Σ count · exp(s - max)`` over the last dim of the scores ``s``
    (-inf: unseen; ``count``: each key's multiplicity, broadcast to ``s``), 0 for the ``empty`` rows. Normalised by
    their sum, not by ``exp(lse)``: at scores of 1e17 and more ``max + ln(count)`` rounds back to ``max``, and tied
    keys would each get weight 1. A ``+inf`` max gives NaN weights (``inf - inf``), a NaN score NaN ones."""
    m = torch.where(empty, 0.0, s.amax(dim=-1))[..., None]
    w = count * torch.exp(s - m)
    return torch.where(empty[..., None], 0.0, w / torch.where(empty[..., None], 1.0, w.sum(-1, keepdim=True)))


def mla_decode_ref(q, kv_cache, block_table, cache_seqlens, head_dim_v=512, softmax_scale=None, causal=True,
                   indices=None, topk_length=None, *, q_descale=None, k_descale=None, kv_format=None, p_dtype=None):
    """Reference ``(out [B, s_q, h_q, head_dim_v] float64, lse [B, h_q, s_q] float64)`` on the CPU.

    ``kv_cache`` may be in a quantised layout (``fp8.py``; ``kv_format`` names it, None: told by the row width): the
    reference runs on its dequantised values (each value · scale rounded once to float32, as the kernels form it;
    ``dequantize_latent_fp8``). With
    ``k_descale`` (``[1]`` or ``[B]``) it is a float8_e4m3fn cache scaled per tensor: the scores are
    ``softmax_scale · q_descale · k_descale · (q·row)`` over the exact e4m3 values (``q_descale`` 1 where None) and
    out is ``k_descale · Σ p·row[:head_dim_v]``. ``p_dtype`` (tests only): round the probabilities and the output to
    that dtype, i.e. what a torch implementation at the kernel's precision does; gives the low-precision error the
    tolerance is built on.
    """
    q = q.detach().double().cpu()
    B = q.shape[0]
    scaled = k_descale is not None
    if scaled:  # [B] factors of the scores and of the output
        k_desc = k_descale.detach().double().cpu().expand(B)
        s_desc = k_desc * (q_descale.detach().double().cpu().expand(B) if q_descale is not None else 1.0)
    elif is_fp8_latent(kv_cache):
        # value · scale rounded once to float32, as the kernels form it (a product past float32's range is inf there)
        kv_cache = dequantize_latent_fp8(kv_cache.detach().cpu(), torch.float32, kv_format=kv_format)
    kv_cache = kv_cache.detach().double().cpu()
    block_table = block_table.detach().long().cpu()
    seqlens = cache_seqlens.detach().long().cpu().clamp(min=0)
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
        ok = inside & (idx >= 0) & (idx < seqlens[:, None, None]) & (idx <= last[..., None]) & (idx < L)
        safe = torch.where(ok, idx, torch.zeros_like(idx))
        ok = ok & torch.gather(valid[:, None, :].expand(B, s_q, L), 2, safe)
        count = torch.zeros(B, s_q, L, dtype=torch.float64)
        count.scatter_add_(2, safe, ok.double())

    seen = (count > 0)[:, :, None, :]  # [B, s_q, 1, L]
    s = torch.einsum("bqhd,bnd->bqhn", q, keys)
    if scaled:
        s = s * s_desc[:, None, None, None]
    s = s * softmax_scale
    # a key a query does not see takes no part in its arithmetic (a NaN or inf score there included)
    s = torch.where(seen, s, -math.inf)
    cnt = count[:, :, None, :]
    lse = torch.logsumexp(s + torch.where(seen, cnt, 1.0).log(), dim=-1)  # +inf for a +inf score, NaN for a NaN one
    empty = lse == -math.inf
    p = _weights(s, cnt, empty)
    if p_dtype is not None:
        p = p.to(p_dtype).double()
    out = seen_pv(p, keys[..., :head_dim_v], seen)
    if scaled:
        out = out * k_desc[:, None, None, None]
    out = torch.where(empty[..., None], 0.0, out)
    if p_dtype is not None:
        out = out.to(p_dtype).double()
    return out, lse.permute(0, 2, 1).contiguous()


def mla_sparse_prefill_ref(q, kv, indices, head_dim_v=512, softmax_scale=None, topk_length=None, *, p_dtype=None):
    """Reference of ``mla_sparse_prefill``: ``(out [s_q, h_q, head_dim_v], max_logits [s_q, h_q], lse [s_q, h_q])``,
    float64 on the CPU.

    Query token ``i`` attends to the rows ``indices[i, 0, :n]`` of ``kv [s_kv, 1, D]`` (``n = topk_length[i]``
    clamped to ``[0, topk]``, or ``topk``); an entry outside ``[0, s_kv)`` selects nothing, a duplicated one
    counts once per occurrence. ``max_logits`` is the largest scaled score ``softmax_scale · q·k`` over the keys a
    query sees (NaN where one of them is NaN) and ``lse`` their log-sum-exp (natural log); a query that sees no key
    has out 0 and both -inf. Non-finite values follow ``mla_decode_ref``: only the keys a query sees enter its
    arithmetic. ``p_dtype`` (tests only): the probabilities and out rounded to that dtype."""
    q = q.detach().double().cpu()
    rows = kv.detach().double().cpu()[:, 0]  # [s_kv, D]
    idx = indices.detach().long().cpu()[:, 0]  # [s_q, topk]
    s_q, h_q, D = q.shape
    topk = idx.shape[-1]
    if softmax_scale is None:
        softmax_scale = D ** -0.5
    n = torch.full((s_q,), topk) if topk_length is None else topk_length.detach().long().cpu().clamp(0, topk)
    seen = (torch.arange(topk)[None, :] < n[:, None]) & (idx >= 0) & (idx < rows.shape[0])  # [s_q, topk]
    keys = rows[torch.where(seen, idx, 0)] if rows.shape[0] else torch.zeros(s_q, topk, D, dtype=torch.float64)
    keys = torch.where(seen[..., None], keys, 0.0)  # an unseen entry's row never enters (a NaN there included)
    s = torch.einsum("qhd,qnd->qhn", q, keys) * softmax_scale
    s = torch.where(seen[:, None, :], s, -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # [s_q, h_q]
    max_logits = s.amax(dim=-1)  # NaN where a seen score is NaN
    empty = lse == -math.inf
    p = _weights(s, 1.0, empty)
    if p_dtype is not None:
        p = p.to(p_dtype).double()
    out = torch.einsum("qhn,qnd->qhd", p, keys[..., :head_dim_v])
    out = torch.where(empty[..., None], 0.0, out)  # every seen score -inf: out 0 (no 0 · inf from its values)
    if p_dtype is not None:
        out = out.to(p_dtype).double()
    return out, max_logits, lse
