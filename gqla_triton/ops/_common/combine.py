"""Split-KV combine: merge per-split partial attention results with their log-sum-exp; the decode kernels'
shared epilogue (``finish_rows``, ``store_rows``) that writes either final rows or a split's partials.

``o_partial [B, S, Q, H, D]`` fp32 and ``lse_partial [B, S, Q, H]`` fp32 (natural log; ``-inf`` marks a
split whose softmax weights sum to 0) for S splits, Q query tokens and H heads give ``out [B, Q, H, D]`` (any
float dtype) and ``lse [B, H, Q]`` fp32. Rows whose weights sum to 0 in every split give ``out = 0``,
``lse = -inf``.

Non-finite values follow IEEE arithmetic (the references define it): a NaN score poisons its row's running sum
``l`` (out and lse NaN); a ``+inf`` score makes the running max ``+inf``, which the steps below rescale from 0
instead of from itself, so lse is ``+inf`` (NaN with a NaN score too) and out NaN. A split enters the merge as
``w · o`` even where ``w`` is 0, so its partial for a row of weight 0 must be 0 or that row's ``Σ 0 · v``
(what the kernels write: ``finish_rows(..., SPLIT=True)``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import triton
import triton.language as tl

from ...dispatch import select_config
from .config import WARPS, KernelConfig


@dataclasses.dataclass(frozen=True)
class CombineConfig(KernelConfig):
    """``combine``: ``elems`` = largest (heads x D) tile of one program; ``num_warps``."""

    OP: ClassVar[str] = "combine"
    MATCH: ClassVar[dict] = {"D": int}

    elems: int = 2048
    num_warps: int = 4

    def check(self) -> None:
        self.one_of("elems", tuple(2**i for i in range(4, 17)))
        self.one_of("num_warps", WARPS)


@triton.jit
def softmax_step(s, m_i, l_i, AXIS: tl.constexpr):
    """One online-softmax step over a tile of log2-scaled scores (-inf where masked), reduced along ``AXIS``
    (1: s is [rows, keys]; 0: [keys, rows]). Returns ``(m_new, alpha, p, l_new)``: the running max, the rescale
    of the old accumulator, the tile's probabilities and the running sum. A row with no key so far keeps
    m = -inf and gets p = 0. The max skips NaN scores; they reach ``l`` (and P·V) through ``p = NaN``. A ``+inf``
    max rescales from 0, so a ``+inf`` score gives ``p = +inf`` and ``l = +inf`` (lse ``+inf``) instead of
    ``inf - inf``."""
    m_new = tl.maximum(m_i, tl.max(s, AXIS))
    m_safe = tl.where(tl.abs(m_new) == float("inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    if AXIS == 1:
        p = tl.exp2(s - m_safe[:, None])
    else:
        p = tl.exp2(s - m_safe[None, :])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, AXIS)


@triton.jit
def finish_rows(acc, m_log2, l, SPLIT: tl.constexpr):
    """Normalise a [rows, D] online-softmax accumulator: ``(o, lse)`` with lse in natural log. ``m_log2`` is
    the running max of the log2-scaled scores, ``l`` the running sum. A row whose weights sum to 0 (no key, or
    every score -inf) gets lse = -inf and o = 0, or under ``SPLIT`` its raw accumulator (0, or NaN where a
    -inf score met an infinite value) for ``combine_splits``. A NaN ``l`` gives NaN o and lse."""
    empty = l == 0
    safe_l = tl.where(empty, 1.0, l)
    o = acc / safe_l[:, None]
    if not SPLIT:
        o = tl.where(empty[:, None], 0.0, o)
    lse = tl.where(empty, float("-inf"), m_log2 * 0.6931471805599453 + tl.log(safe_l))
    return o, lse


@triton.jit
def store_rows(o, lse, o_mask, lse_mask, cols, b64, split, q64, h64,
               out, s_ob, s_oq, s_oh, lse_out, s_lb, s_lh, s_lq,
               o_part, s_pb, s_ps, s_pq, s_ph, lse_part, s_plb, s_pls, s_plq, SPLIT: tl.constexpr):
    """Store a decode tile's rows (query token q64, head h64 per row; value columns ``cols``): the final
    ``out`` (its dtype) and ``lse_out``, or under split-KV this split's fp32 partials for combine_splits."""
    if SPLIT:
        s64 = split.to(tl.int64)
        po = o_part + b64 * s_pb + s64 * s_ps + q64 * s_pq + h64 * s_ph
        tl.store(po[:, None] + cols[None, :], o, mask=o_mask)
        tl.store(lse_part + b64 * s_plb + s64 * s_pls + q64 * s_plq + h64, lse, mask=lse_mask)
    else:
        po = out + b64 * s_ob + q64 * s_oq + h64 * s_oh
        tl.store(po[:, None] + cols[None, :], o.to(out.dtype.element_ty), mask=o_mask)
        tl.store(lse_out + b64 * s_lb + h64 * s_lh + q64 * s_lq, lse, mask=lse_mask)


@triton.jit
def combine_splits_kernel(
    o_part, lse_part, out, lse_out,
    num_splits, Q, H, D,
    s_ob, s_os, s_oq, s_oh,
    s_lb, s_ls, s_lq,
    s_outb, s_outq, s_outh,
    s_lob, s_loh, s_loq,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_bq = tl.program_id(0)
    pid_h = tl.program_id(1)
    b = pid_bq // Q
    q = pid_bq % Q
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mh = offs_h < H
    md = offs_d < D
    b64 = b.to(tl.int64)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    # pointers advance split by split (64-bit: no int32 product of the split index and its stride)
    lse_ptr = lse_part + b64 * s_lb + q * s_lq + offs_h
    o_ptr = o_part + b64 * s_ob + q * s_oq + offs_h[:, None] * s_oh + offs_d[None, :]
    for _ in range(num_splits):
        lse_s = tl.load(lse_ptr, mask=mh, other=float("-inf"))
        o_s = tl.load(o_ptr, mask=mh[:, None] & md[None, :], other=0.0)
        # as softmax_step: the max skips NaN (it reaches l through w), an infinite max rescales from 0
        m_new = tl.maximum(m, lse_s)
        m_ref = tl.where(tl.abs(m_new) == float("inf"), 0.0, m_new)
        alpha = tl.exp(m - m_ref)
        w = tl.exp(lse_s - m_ref)
        acc = acc * alpha[:, None] + w[:, None] * o_s
        l = l * alpha + w
        m = m_new
        lse_ptr += s_ls
        o_ptr += s_os
    empty = l == 0
    safe_l = tl.where(empty, 1.0, l)
    o = tl.where(empty[:, None], 0.0, acc / safe_l[:, None])
    lse = tl.where(empty, float("-inf"), m + tl.log(safe_l))
    tl.store(out + b64 * s_outb + q * s_outq + offs_h[:, None] * s_outh + offs_d[None, :],
             o.to(out.dtype.element_ty), mask=mh[:, None] & md[None, :])
    tl.store(lse_out + b64 * s_lob + offs_h * s_loh + q * s_loq, lse, mask=mh)


def combine_splits(
    o_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """Write ``out [B, Q, H, D]`` and ``lse [B, H, Q]`` from the splits (see module docstring). In place."""
    B, S, Q, H, D = o_partial.shape
    if lse_partial.shape != (B, S, Q, H):
        raise ValueError(f"lse_partial: expected shape {[B, S, Q, H]}, got {list(lse_partial.shape)}")
    if out.shape != (B, Q, H, D) or lse.shape != (B, H, Q):
        raise ValueError(f"out/lse: expected {[B, Q, H, D]} / {[B, H, Q]}, got {list(out.shape)} / {list(lse.shape)}")
    if o_partial.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("combine_splits: the last dimension of o_partial and out must be contiguous")
    if B * Q * H == 0:
        return
    cfg = select_config("combine", {"D": D}, device=out.device)
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_H = max(1, min(triton.next_power_of_2(H), cfg.elems // BLOCK_D))
    grid = (B * Q, triton.cdiv(H, BLOCK_H))
    combine_splits_kernel[grid](
        o_partial, lse_partial, out, lse,
        S, Q, H, D,
        *o_partial.stride()[:4],
        *lse_partial.stride()[:3],
        *out.stride()[:3],
        *lse.stride(),
        BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, num_warps=cfg.num_warps,
    )
