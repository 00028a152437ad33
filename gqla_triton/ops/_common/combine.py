"""Split-KV combine: merge per-split partial attention results with their log-sum-exp; the decode kernels'
shared epilogue (``finish_rows``, ``store_rows``) that writes either final rows or a split's partials.

``o_partial [B, S, Q, H, D]`` fp32 and ``lse_partial [B, S, Q, H]`` fp32 (natural log; ``-inf`` marks a
split that saw no key) for S splits, Q query tokens and H heads give ``out [B, Q, H, D]`` (any float
dtype) and ``lse [B, H, Q]`` fp32. Rows with no key anywhere give ``out = 0``, ``lse = -inf``.
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
    m = -inf and gets p = 0."""
    m_new = tl.maximum(m_i, tl.max(s, AXIS))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    if AXIS == 1:
        p = tl.exp2(s - m_safe[:, None])
    else:
        p = tl.exp2(s - m_safe[None, :])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, AXIS)


@triton.jit
def finish_rows(acc, m_log2, l):
    """Normalise a [rows, D] online-softmax accumulator: ``(o, lse)`` with lse in natural log. ``m_log2`` is
    the running max of the log2-scaled scores, ``l`` the running sum; a row that saw no key gets o = 0 and
    lse = -inf."""
    has = l > 0
    safe_l = tl.where(has, l, 1.0)
    o = tl.where(has[:, None], acc / safe_l[:, None], 0.0)
    lse = tl.where(has, m_log2 * 0.6931471805599453 + tl.log(safe_l), float("-inf"))
    return o, lse


@triton.jit
def store_rows(o, lse, o_mask, lse_mask, cols, b64, split, q64, h64,
               out, s_ob, s_oq, s_oh, lse_out, s_lb, s_lh, s_lq,
               o_part, s_pb, s_ps, s_pq, s_ph, lse_part, s_plb, s_pls, s_plq, SPLIT: tl.constexpr):
    """Store a decode tile's rows (query token q64, head h64 per row; value columns ``cols``): the final
    ``out`` (its dtype) and ``lse_out``, or under split-KV this split's fp32 partials for combine_splits."""
    if SPLIT:
        po = o_part + b64 * s_pb + split * s_ps + q64 * s_pq + h64 * s_ph
        tl.store(po[:, None] + cols[None, :], o, mask=o_mask)
        tl.store(lse_part + b64 * s_plb + split * s_pls + q64 * s_plq + h64, lse, mask=lse_mask)
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
    for s in range(num_splits):
        lse_s = tl.load(lse_part + b64 * s_lb + s * s_ls + q * s_lq + offs_h, mask=mh, other=float("-inf"))
        o_ptr = o_part + b64 * s_ob + s * s_os + q * s_oq + offs_h[:, None] * s_oh + offs_d[None, :]
        o_s = tl.load(o_ptr, mask=mh[:, None] & md[None, :], other=0.0)
        m_new = tl.maximum(m, lse_s)
        safe = m_new > float("-inf")
        alpha = tl.where(safe, tl.exp(m - m_new), 0.0)
        w = tl.where(safe, tl.exp(lse_s - m_new), 0.0)
        # a split that saw nothing may hold anything: never let it into the sum
        o_s = tl.where((w > 0)[:, None], o_s, 0.0)
        acc = acc * alpha[:, None] + w[:, None] * o_s
        l = l * alpha + w
        m = m_new
    has = l > 0
    o = tl.where(has[:, None], acc / tl.where(has, l, 1.0)[:, None], 0.0)
    lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
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
