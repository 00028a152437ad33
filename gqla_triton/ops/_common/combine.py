"""Split-KV combine: merge per-split partial attention results with their log-sum-exp; the decode kernels'
shared epilogue (``finish_rows``, ``store_rows``) that writes either final rows or a split's partials.

``o_partial [B, S, Q, H, D]`` fp32 and ``lse_partial [B, S, Q, H]`` fp32 (``-inf`` marks a split whose softmax
weights sum to 0) for S splits, Q query tokens and H heads give ``out [B, Q, H, D]`` (any float dtype) and
``lse [B, H, Q]`` fp32 (natural log). Rows whose weights sum to 0 in every split give ``out = 0``, ``lse = -inf``.

The partials' lse is in natural log (``unit`` 1), or in units of ``unit = c`` nats: ``L = lse / c``. The kernels'
raw-score softmax (``score_mode``, ``|qk_scale| > 1``) stores ``L = m + ln(l) / c`` with ``c = qk_scale · ln 2``
(``split_lse_unit``), m the running max of the raw scores: finite wherever the scores are, where ``m · c``, the
natural-log lse, may pass the float32 range. The merge takes ``M = max L_i``, weights ``exp((L_i - M) · c)`` and
``lse = M · c + ln Σ w``: ``+inf`` where the true lse passes the float32 range, out still the weighted mean of the
splits' partials (with one split the kernels write the same ``+inf`` lse and the same out).

Non-finite values follow IEEE arithmetic (the references define it): a NaN score poisons its row's running sum
``l`` (out and lse NaN); a ``+inf`` score makes the running max ``+inf``, which the steps below rescale from 0
instead of from itself, so lse is ``+inf`` (NaN with a NaN score too) and out NaN. A split enters the merge as
``w · o`` even where ``w`` is 0, so its partial for a row of weight 0 must be 0 or that row's ``Σ 0 · v``
(what the kernels write: ``finish_rows(..., SPLIT=True)``).
"""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import ClassVar

import torch
import triton
import triton.language as tl

from ...dispatch import device_info, select_config
from .config import WARPS, KernelConfig
from .host import cdiv, next_pow2, on_device


@dataclasses.dataclass(frozen=True)
class CombineConfig(KernelConfig):
    """``combine``: a program merges one (heads x D) tile of at most ``elems`` values of one (sequence, query
    token); where that leaves fewer than ``waves`` programs per SM (small batches) the tile shrinks, heads first,
    down to ``min_elems`` (a tile of ``elems <= min_elems`` stays as it is). Each loop step loads the partials of
    ``step_elems // tile`` splits at once (their loads in flight together: the split loop is latency-bound, not
    bandwidth-bound). ``num_warps``."""

    OP: ClassVar[str] = "combine"
    MATCH: ClassVar[dict] = {"D": int}

    elems: int = 2048
    min_elems: int = 128
    waves: int = 2
    step_elems: int = 8192
    num_warps: int = 4

    def check(self) -> None:
        self.one_of(("elems", "min_elems", "step_elems"), tuple(2**i for i in range(4, 17)))
        self.one_of("num_warps", WARPS)
        self.within("waves", 1)


@triton.jit
def scale_scores(s, qk_scale, RAW: tl.constexpr):
    """The scores ``softmax_step`` takes from raw ``q·k``: ``s·qk_scale`` (log2 units), or under ``RAW`` (see
    ``score_mode``) the raw scores themselves, negated where ``RAW < 0`` (a negative scale: the largest scaled
    score is the smallest raw one)."""
    if RAW > 0:
        return s
    if RAW < 0:
        return -s
    return s * qk_scale


@triton.jit
def softmax_step(s, m_i, l_i, qk_scale, AXIS: tl.constexpr, RAW: tl.constexpr):
    """One online-softmax step over a tile of scores from ``scale_scores`` (-inf where masked), reduced along
    ``AXIS`` (1: s is [rows, keys]; 0: [keys, rows]); ``qk_scale`` = softmax_scale · log2(e). For
    ``|qk_scale| <= 1`` the scores are scaled (``|s·qk_scale| <= |s|``: nothing overflows) and the running max m is
    of the scaled scores. With ``RAW`` (``|qk_scale| > 1``, where a finite score times the scale may pass the
    float32 range while the softmax is finite; ``score_mode``) m is the max of the raw scores (negated for a
    negative scale) and the scale, then ``|qk_scale|``, applies to differences from it, ``p = 2^((s - m)·qk_scale)``.
    Returns ``(m_new, alpha, p, l_new)``: the running max, the rescale of the old accumulator, the tile's
    probabilities and the running sum. A row with no key so far keeps m = -inf and gets p = 0. The max skips NaN
    scores; they reach ``l`` (and P·V) through ``p = NaN``. A ``+inf`` max rescales from 0, so a ``+inf`` score
    gives ``p = +inf`` and ``l = +inf`` (lse ``+inf``) instead of ``inf - inf``."""
    m_new = tl.maximum(m_i, tl.max(s, AXIS))
    m_safe = tl.where(tl.abs(m_new) == float("inf"), 0.0, m_new)
    a = m_i - m_safe
    if AXIS == 1:
        d = s - m_safe[:, None]
    else:
        d = s - m_safe[None, :]
    if RAW:
        a = a * qk_scale
        d = d * qk_scale
    alpha = tl.exp2(a)
    p = tl.exp2(d)
    return m_new, alpha, p, l_i * alpha + tl.sum(p, AXIS)


@triton.jit
def finish_rows(acc, m, l, qk_scale, SPLIT: tl.constexpr, RAW: tl.constexpr, LSE_RAW: tl.constexpr):
    """Normalise a [rows, D] online-softmax accumulator: ``(o, lse)`` with lse in natural log. ``m`` is the
    running max of ``softmax_step`` (of the raw scores under ``RAW``, else of the scaled ones), ``l`` the running
    sum; under ``RAW`` ``lse = m·c + ln l`` with ``c = qk_scale·ln 2`` (``m·qk_scale`` itself, which may pass the
    float32 range where lse does not, is never formed); ``+inf`` where ``m·c`` passes the float32 range. Under
    ``SPLIT`` and ``LSE_RAW`` (``RAW`` partials: ``split_lse_unit``) the split's lse is stored in units of ``c``,
    ``m + ln(l) / c`` (``c > 0.69``: finite wherever m is), for ``combine_splits(..., unit=c)``. A row whose
    weights sum to 0 (no key, or every score -inf) gets lse = -inf and o = 0, or under ``SPLIT`` its raw
    accumulator (0, or NaN where a -inf score met an infinite value) for ``combine_splits``. A NaN ``l`` gives NaN
    o and lse."""
    empty = l == 0
    safe_l = tl.where(empty, 1.0, l)
    o = acc / safe_l[:, None]
    if not SPLIT:
        o = tl.where(empty[:, None], 0.0, o)
    ln_m = qk_scale * 0.6931471805599453 if RAW else 0.6931471805599453
    if SPLIT and LSE_RAW:
        lse = tl.where(empty, float("-inf"), m + tl.log(safe_l) / ln_m)
    else:
        lse = tl.where(empty, float("-inf"), m * ln_m + tl.log(safe_l))
    return o, lse


def score_mode(qk_scale: float, raw: bool = False) -> tuple[float, int]:
    """``(qk_scale, RAW)`` as the decode kernels take them (``softmax_step``): the scale itself and ``RAW = 0``
    (scaled scores) for ``|qk_scale| <= 1``; past that (or with ``raw``: a kernel that scales its scores itself),
    raw scores, negated for a negative scale (``RAW = -1``, else 1), and ``|qk_scale|``."""
    if abs(qk_scale) <= 1.0 and not raw:
        return qk_scale, 0
    return abs(qk_scale), (-1 if qk_scale < 0 else 1)


def _f32(x: float) -> float:
    """``x`` rounded to float32 (to nearest even; ``±inf`` past its range)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def split_lse_unit(qk_scale: float, raw: int) -> float:
    """The ``unit`` of ``combine_splits`` for the split partials of a kernel launched with ``score_mode``'s
    ``(qk_scale, RAW)``: 1.0 (natural log) for scaled scores, under ``RAW`` with ``qk_scale > 1`` raw-score units,
    ``c = qk_scale · ln 2`` rounded as ``finish_rows`` forms it in float32 (the kernel's float32 ``qk_scale`` times
    float32 ln 2), > 0.69. (A smaller scale under ``RAW``, as ``score_mode(..., raw=True)`` gives, keeps natural
    log: ``ln(l) / c`` could overflow.) The kernels store raw-unit partials where this is not 1.0 (``LSE_RAW``;
    a ``c`` of exactly 1.0 is the same either way)."""
    if not raw or not qk_scale > 1.0:
        return 1.0
    return _f32(_f32(qk_scale) * _f32(math.log(2.0)))


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
    num_splits, Q, H, D, NH,
    s_ob, s_os, s_oq, s_oh,
    s_lb, s_ls, s_lq,
    s_outb, s_outq, s_outh,
    s_lob, s_loh, s_loq,
    unit,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, UNIT: tl.constexpr,
):
    """One [BLOCK_H, BLOCK_D] tile: ``program_id(0)`` = (sequence x query token) x NH head tiles + head tile,
    ``program_id(1)`` the D tile; BLOCK_S splits per step, merged online (the running max of their lse, the
    rescale of what is summed so far). ``UNIT``: the partials' lse is in units of ``unit`` nats (differences
    and the final max times ``unit``), else in natural log."""
    pid = tl.program_id(0)
    pid_bq = pid // NH
    b = pid_bq // Q
    q = pid_bq % Q
    offs_h = (pid % NH) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, BLOCK_S)
    mh = offs_h < H
    md = offs_d < D
    b64 = b.to(tl.int64)
    q64 = q.to(tl.int64)
    h64 = offs_h.to(tl.int64)  # no int32 product of an index and a stride

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    lse_base = lse_part + b64 * s_lb + q64 * s_lq + h64
    o_base = o_part + b64 * s_ob + q64 * s_oq + (h64[:, None] * s_oh + offs_d[None, :])
    for s0 in range(0, num_splits, BLOCK_S):
        sp = s0 + offs_s
        ms = sp < num_splits
        sp64 = sp.to(tl.int64)  # no int32 product of a split index and its stride
        lse_s = tl.load(lse_base[None, :] + sp64[:, None] * s_ls, mask=ms[:, None] & mh[None, :],
                        other=float("-inf"))
        o_s = tl.load(o_base[None, :, :] + sp64[:, None, None] * s_os,
                      mask=ms[:, None, None] & (mh[:, None] & md[None, :])[None, :, :], other=0.0)
        # as softmax_step: the max skips NaN (it reaches l through w), an infinite max rescales from 0
        m_new = tl.maximum(m, tl.max(lse_s, 0))
        m_ref = tl.where(tl.abs(m_new) == float("inf"), 0.0, m_new)
        if UNIT:
            alpha = tl.exp((m - m_ref) * unit)
            w = tl.exp((lse_s - m_ref[None, :]) * unit)
        else:
            alpha = tl.exp(m - m_ref)
            w = tl.exp(lse_s - m_ref[None, :])
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o_s, 0)
        l = l * alpha + tl.sum(w, 0)
        m = m_new
    empty = l == 0
    safe_l = tl.where(empty, 1.0, l)
    o = tl.where(empty[:, None], 0.0, acc / safe_l[:, None])
    if UNIT:
        lse = tl.where(empty, float("-inf"), m * unit + tl.log(safe_l))  # +inf where m · unit passes float32
    else:
        lse = tl.where(empty, float("-inf"), m + tl.log(safe_l))
    tl.store(out + b64 * s_outb + q64 * s_outq + h64[:, None] * s_outh + offs_d[None, :],
             o.to(out.dtype.element_ty), mask=mh[:, None] & md[None, :])
    first = (offs_h * 0 + tl.program_id(1)) == 0  # lse once per head: by the programs of the first D tile
    tl.store(lse_out + b64 * s_lob + h64 * s_loh + q64 * s_loq, lse, mask=mh & first)


def combine_geometry(B: int, S: int, Q: int, H: int, D: int, sm_count: int,
                     cfg: CombineConfig) -> tuple[int, int, int]:
    """``(BLOCK_H, BLOCK_D, BLOCK_S)`` of ``combine_splits_kernel``: the largest tile of at most ``cfg.elems``,
    halved (heads first, then D down to 16) while the grid has fewer than ``cfg.waves`` programs per SM and the
    tile holds more than ``cfg.min_elems``; ``BLOCK_S`` splits per step from ``cfg.step_elems`` (at most S's
    power of two)."""
    BLOCK_D = max(1, next_pow2(D))
    BLOCK_H = max(1, min(next_pow2(H), cfg.elems // BLOCK_D))
    while BLOCK_H * BLOCK_D > cfg.min_elems and B * Q * cdiv(H, BLOCK_H) * cdiv(D, BLOCK_D) < cfg.waves * sm_count:
        if BLOCK_H > 1:
            BLOCK_H //= 2
        elif BLOCK_D > 16:
            BLOCK_D //= 2
        else:
            break
    BLOCK_S = max(1, min(next_pow2(S), cfg.step_elems // (BLOCK_H * BLOCK_D)))
    return BLOCK_H, BLOCK_D, BLOCK_S


def combine_splits(
    o_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *, unit: float = 1.0
) -> None:
    """Write ``out [B, Q, H, D]`` and ``lse [B, H, Q]`` (natural log) from the splits (see module docstring). In
    place. ``unit``: the partials' lse is in units of ``unit`` nats (a finite number > 0; 1.0: natural log, the
    kernels' ``split_lse_unit``)."""
    if not (isinstance(unit, (int, float)) and math.isfinite(unit) and unit > 0):
        raise ValueError(f"combine_splits: unit must be a finite number > 0, got {unit!r}")
    B, S, Q, H, D = o_partial.shape
    if lse_partial.shape != (B, S, Q, H):
        raise ValueError(f"lse_partial: expected shape {[B, S, Q, H]}, got {list(lse_partial.shape)}")
    if out.shape != (B, Q, H, D) or lse.shape != (B, H, Q):
        raise ValueError(f"out/lse: expected {[B, Q, H, D]} / {[B, H, Q]}, got {list(out.shape)} / {list(lse.shape)}")
    if o_partial.stride(-1) != 1 or out.stride(-1) != 1 or lse_partial.stride(-1) != 1:
        raise ValueError("combine_splits: the last dimension of o_partial, lse_partial and out must be contiguous")
    if B * Q * H == 0:
        return
    info = device_info(out)  # (a tensor: the cached lookup of its device)
    cfg = select_config("combine", {"D": D}, info=info)
    BLOCK_H, BLOCK_D, BLOCK_S = combine_geometry(B, S, Q, H, D, info.sm_count, cfg)
    NH = cdiv(H, BLOCK_H)
    grid = (B * Q * NH, max(1, cdiv(D, BLOCK_D)))  # D tiles: a few (CUDA's 65535 along this axis)
    with on_device(o_partial.device):
        combine_splits_kernel[grid](
            o_partial, lse_partial, out, lse,
            S, Q, H, D, NH,
            *o_partial.stride()[:4],
            *lse_partial.stride()[:3],
            *out.stride()[:3],
            *lse.stride(),
            float(unit),
            BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, BLOCK_S=BLOCK_S, UNIT=unit != 1.0, num_warps=cfg.num_warps,
        )
