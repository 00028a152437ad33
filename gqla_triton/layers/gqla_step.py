"""Triton kernels of one ``GQLAttention`` decode step, around the attention ops.

- ``norm_rope``: the ``q_a_layernorm`` row (RMSNorm over ``q_rank``), the latent cache row
  ``[RMSNorm(c) | rope(k_rope)]`` from ``kv_a_proj``'s output and each token's rope factors, one launch.
- ``absorb_q``: the absorb path's query ``[W_UK[γ(i)]ᵀ q_nope[i] | rope(q_rope[i])]`` for ``mla_decode``.
- ``absorb_o``: the absorb path's output ``W_UV[γ(i)] õ[i]`` for ``o_proj``.
- ``grouped_q``: the grouped path's query ``[q_nope[i] | rope(q_rope[i])]`` for ``gqa_decode``.

Rope (rotate-half / NeoX, as ``rope.apply_rope``): the angle of pair ``(i, i + d_R/2)`` is
``pos · inv_freq[i]`` in float64 (``pos + t`` summed in float64 too, so it never wraps), its cos / sin taken in
float64 and rounded to float32 (``cos_sin [B, T, 2, d_R/2]``, made once per token by ``norm_rope``, the same
numbers as ``rope.rope_cos_sin``), the rotation done in float32. Positions are ``positions[b, t]`` (``add_t``
False) or ``positions[b, t] + t`` (``add_t`` True: ``positions`` is then a stride-0 view of the cached lengths,
so the default decode positions cost no launch).

The two absorb products run on tensor cores (``tl.dot``, fp32 accumulation, IEEE for float32). A row tile
holds ``TOK`` tokens x ``HB`` heads of one group (``HB`` the heads per group rounded up to a power of two, or 64
of them), at least 16 rows: rows past the group's heads or the last token are masked, so every ``tl.dot`` is
>= 16 wide whatever the heads per group. Tiles: ``_plan``. Every kernel takes strided inputs (a query view of a
larger projection output, weight views of ``kv_b_proj.weight``) and writes contiguous outputs.

Each op is a ``torch.library`` custom op with a fake (``torch.compile(fullgraph=True)`` traces it); eager calls
run the launcher directly (``route``). The ops are forward-only.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..dispatch import device_info
from ..ops._common import FLOAT_DTYPES, cdiv, check_kernel_device, next_pow2
from ..ops._common.alloc import empty
from ..ops._common.boundary import route
from ..ops._common.host import on_device
from ..ops._common.memo import CheckedCalls, call_key
from ..ops._common.validation import (
    check_eps,
    check_flag,
    check_positive_int,
    check_tensor,
    forward_only,
    requires_grad,
)
from .rope import check_positions

__all__ = ["absorb_o", "absorb_q", "grouped_q", "norm_rope"]

_REFERENCE = "GQLAttention(impl='reference')"
_CHECKED = CheckedCalls()  # the custom ops' checked calls (``_common.memo``)


def _checked_op(name: str, tensors: tuple, options: tuple, check) -> None:
    """``check()`` in a custom op's body (a direct ``torch.ops`` call reaches it unchecked), kept per call by the
    call's metadata (``_common.memo``)."""
    key = call_key(tensors, (name, *options))
    if _CHECKED.get(key) is None:
        check()
        _CHECKED.put(key, True)


# ---- kernels --------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["T"])
def gqla_norm_rope_kernel(qa, qa_w, qa_out, kv, kv_w, kv_out, cs_out, pos, inv_freq, qa_eps, kv_eps, T,
                          s_qa_b, s_qa_t, s_qa_d, s_kv_b, s_kv_t, s_kv_d, s_pb, s_pt, s_qaw, s_kvw, s_inv,
                          QR: tl.constexpr, BLOCK_QR: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
                          HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, KV_NORM: tl.constexpr,
                          ADD_T: tl.constexpr):
    """Grid ``(B·T, 1 or 2)``: axis 1 = 0 writes the cache row ``kv_out[row] = [RMSNorm(kv[:R])·kv_w |
    rope(kv[R:])]`` (``[R + 2·HALF]``) and the token's rope factors ``cs_out[row] = [cos | sin]`` (``[2, HALF]``
    fp32), axis 1 = 1 the normed query row ``qa_out[row] = RMSNorm(qa)·qa_w``."""
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t = row % T
    if tl.program_id(1) == 1:
        e = tl.arange(0, BLOCK_QR)
        em = e < QR
        e64 = e.to(tl.int64)  # channel x stride in int64: any strides
        xq = tl.load(qa + b * s_qa_b + t * s_qa_t + e64 * s_qa_d, mask=em, other=0.0).to(tl.float32)
        yq = xq * tl.rsqrt(tl.sum(xq * xq, axis=0) / QR + qa_eps)
        wq = tl.load(qa_w + e64 * s_qaw, mask=em, other=0.0).to(tl.float32)
        tl.store(qa_out + row * QR + e, (yq * wq).to(qa_out.dtype.element_ty), mask=em)
    else:
        src = kv + b * s_kv_b + t * s_kv_t
        dst = kv_out + row * (R + 2 * HALF)
        d = tl.arange(0, BLOCK_R)
        dm = d < R
        d64 = d.to(tl.int64)
        x = tl.load(src + d64 * s_kv_d, mask=dm, other=0.0).to(tl.float32)
        if KV_NORM:
            x = x * tl.rsqrt(tl.sum(x * x, axis=0) / R + kv_eps)
            x = x * tl.load(kv_w + d64 * s_kvw, mask=dm, other=0.0).to(tl.float32)
        tl.store(dst + d, x.to(kv_out.dtype.element_ty), mask=dm)
        if HALF > 0:
            i = tl.arange(0, BLOCK_HALF)
            im = i < HALF
            i64 = i.to(tl.int64)
            p = tl.load(pos + b * s_pb + t * s_pt).to(tl.float64)  # exact below 2**53, as torch's .double()
            if ADD_T:
                p += t  # in float64: an int64 sum would wrap past 2**63 - 1
            ang = p * tl.load(inv_freq + i64 * s_inv, mask=im, other=0.0)
            cos, sin = tl.cos(ang).to(tl.float32), tl.sin(ang).to(tl.float32)
            tl.store(cs_out + row * (2 * HALF) + i, cos, mask=im)
            tl.store(cs_out + row * (2 * HALF) + HALF + i, sin, mask=im)
            x1 = tl.load(src + (R + i64) * s_kv_d, mask=im, other=0.0).to(tl.float32)
            x2 = tl.load(src + (R + HALF + i64) * s_kv_d, mask=im, other=0.0).to(tl.float32)
            tl.store(dst + R + i, (x1 * cos - x2 * sin).to(kv_out.dtype.element_ty), mask=im)
            tl.store(dst + R + HALF + i, (x2 * cos + x1 * sin).to(kv_out.dtype.element_ty), mask=im)


@triton.jit
def _tile_rows(pid_m, NT, T, HPG: tl.constexpr, TOK: tl.constexpr, HB: tl.constexpr, NHB: tl.constexpr):
    """Rows of tile ``pid_m``: ``TOK`` tokens x ``HB`` heads of the group (heads block ``pid_m % NHB``).
    Returns ``(b, t, hh, valid)`` ``[TOK·HB]`` (``hh``: head within the group)."""
    m = tl.arange(0, TOK * HB)
    tok = (pid_m // NHB) * TOK + m // HB
    hh = (pid_m % NHB) * HB + m % HB
    valid = (tok < NT) & (hh < HPG)
    tok = tl.where(valid, tok, 0).to(tl.int64)
    return tok // T, tok % T, tl.where(valid, hh, 0), valid


@triton.jit
def _rope_rows(q, out, cs, pid_m, j, NT, s_qb, s_qt, s_qh, s_qd, s_ob, s_ot, s_oh, T,
               Q_OFF: tl.constexpr, O_OFF: tl.constexpr, HPG: tl.constexpr, TOK: tl.constexpr, HB: tl.constexpr,
               NHB: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """``out[b, t, head, O_OFF:] = rope(q[b, t, head, Q_OFF:])`` for the ``TOK x HB`` rows of tile ``pid_m``
    of group ``j``, as ``[TOK, HB, BLOCK_HALF]`` tiles (``cs [B·T, 2, HALF]``: each token's cos / sin)."""
    tok = (pid_m // NHB) * TOK + tl.arange(0, TOK)
    tv = tok < NT
    tok = tl.where(tv, tok, 0).to(tl.int64)
    b, t = tok // T, tok % T
    i = tl.arange(0, BLOCK_HALF)
    im = i < HALF
    cm = tv[:, None] & im[None, :]
    cs_tok = cs + tok[:, None] * (2 * HALF) + i[None, :]
    cos = tl.load(cs_tok, mask=cm, other=0.0)[:, None, :]
    sin = tl.load(cs_tok + HALF, mask=cm, other=0.0)[:, None, :]
    hh = (pid_m % NHB) * HB + tl.arange(0, HB)
    head = (j * HPG + hh).to(tl.int64)
    ok = tv[:, None, None] & (hh < HPG)[None, :, None] & im[None, None, :]
    src = q + (b * s_qb + t * s_qt)[:, None, None] + (head * s_qh)[None, :, None]
    dst = out + (b * s_ob + t * s_ot)[:, None, None] + (head * s_oh)[None, :, None] + O_OFF
    i3 = i[None, None, :]
    c3 = i3.to(tl.int64) + Q_OFF  # channel x stride in int64: any strides
    x1 = tl.load(src + c3 * s_qd, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + (c3 + HALF) * s_qd, mask=ok, other=0.0).to(tl.float32)
    tl.store(dst + i3, (x1 * cos - x2 * sin).to(out.dtype.element_ty), mask=ok)
    tl.store(dst + HALF + i3, (x2 * cos + x1 * sin).to(out.dtype.element_ty), mask=ok)


@triton.jit
def _group_rows_dot(a_row, s_ak, w_g, s_wk, s_wn, valid, n, nm, KD: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr, A_TO_W: tl.constexpr):
    """``acc[r, c] = Σ_{k < KD} a[r, k] · w[k, n[c]]`` (fp32) for ``ROWS`` rows ``a_row`` (masked by ``valid``) and
    one group's weight ``w_g`` (strides ``s_wk``, ``s_wn``; columns masked by ``nm``); the dot operands in a's
    dtype, or in w's with ``A_TO_W``."""
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, KD, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < KD
        k64 = k.to(tl.int64)  # index x stride in int64: any strides
        a = tl.load(a_row[:, None] + k64[None, :] * s_ak, mask=valid[:, None] & km[None, :], other=0.0)
        wt = tl.load(w_g + k64[:, None] * s_wk + n.to(tl.int64)[None, :] * s_wn, mask=km[:, None] & nm[None, :],
                     other=0.0)
        if A_TO_W:
            acc = tl.dot(a.to(wt.dtype), wt, acc, input_precision=DOT_PREC)
        else:
            acc = tl.dot(a, wt.to(a.dtype), acc, input_precision=DOT_PREC)
    return acc


@triton.jit(do_not_specialize=["NT", "T"])
def gqla_absorb_q_kernel(q, w, out, cs, NT, T, s_qb, s_qt, s_qh, s_qd, s_wg, s_wd, s_wr, s_ob, s_ot, s_oh,
                         HPG: tl.constexpr, DH: tl.constexpr, R: tl.constexpr, HALF: tl.constexpr,
                         TOK: tl.constexpr, HB: tl.constexpr, NHB: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_HALF: tl.constexpr, DOT_PREC: tl.constexpr):
    """Grid ``(row tiles, g, cdiv(R, BLOCK_N))``: ``out[b, t, i, n] = Σ_d q[b, t, i, d] · w[γ(i), d, n]`` for the
    tile's rows and columns; the programs of column block 0 also write the rotated rope part
    ``out[b, t, i, R:] = rope(q[b, t, i, DH:])``."""
    pid_m, j, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, t, hh, valid = _tile_rows(pid_m, NT, T, HPG, TOK, HB, NHB)
    head = (j * HPG + hh).to(tl.int64)
    q_row = q + b * s_qb + t * s_qt + head * s_qh
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < R
    acc = _group_rows_dot(q_row, s_qd, w + j.to(tl.int64) * s_wg, s_wd, s_wr, valid, n, nm, DH, TOK * HB, BLOCK_N,
                          BLOCK_K, DOT_PREC, False)
    o_row = out + b * s_ob + t * s_ot + head * s_oh
    tl.store(o_row[:, None] + n[None, :], acc.to(out.dtype.element_ty), mask=valid[:, None] & nm[None, :])
    if HALF > 0:
        if pid_n == 0:
            _rope_rows(q, out, cs, pid_m, j, NT, s_qb, s_qt, s_qh, s_qd, s_ob, s_ot, s_oh, T, DH, R, HPG, TOK, HB, NHB,
                       HALF, BLOCK_HALF)


@triton.jit(do_not_specialize=["NT", "T"])
def gqla_absorb_o_kernel(o, w, out, NT, T, s_ob, s_ot, s_oh, s_od, s_wg, s_wv, s_wr, s_yb, s_yt, s_yh,
                         HPG: tl.constexpr, R: tl.constexpr, DV: tl.constexpr, TOK: tl.constexpr,
                         HB: tl.constexpr, NHB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_PREC: tl.constexpr):
    """Grid ``(row tiles, g, cdiv(DV, BLOCK_N))``: ``out[b, t, i, v] = Σ_n o[b, t, i, n] · w[γ(i), v, n]``
    (``o`` cast to ``w``'s dtype, fp32 accumulation; ``out``'s last dim contiguous)."""
    pid_m, j, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, t, hh, valid = _tile_rows(pid_m, NT, T, HPG, TOK, HB, NHB)
    head = (j * HPG + hh).to(tl.int64)
    o_row = o + b * s_ob + t * s_ot + head * s_oh
    v = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    vm = v < DV
    acc = _group_rows_dot(o_row, s_od, w + j.to(tl.int64) * s_wg, s_wr, s_wv, valid, v, vm, R, TOK * HB, BLOCK_N,
                          BLOCK_K, DOT_PREC, True)
    dst = out + b * s_yb + t * s_yt + head * s_yh
    tl.store(dst[:, None] + v[None, :], acc.to(out.dtype.element_ty), mask=valid[:, None] & vm[None, :])


@triton.jit(do_not_specialize=["T", "H"])
def gqla_grouped_q_kernel(q, out, cs, T, H, s_qb, s_qt, s_qh, s_qd,
                          DH: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DH: tl.constexpr,
                          BLOCK_HALF: tl.constexpr):
    """Grid ``(B·T, cdiv(H, BLOCK_H))``: ``out[b, t, i] = [q[b, t, i, :DH] | rope(q[b, t, i, DH:])]``
    (``out`` contiguous ``[B, T, H, DH + 2·HALF]``; ``cs [B·T, 2, HALF]``: each token's cos / sin)."""
    row = tl.program_id(0).to(tl.int64)
    b, t = row // T, row % T
    hd = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = hd < H
    hd64 = hd.to(tl.int64)
    src = q + b * s_qb + t * s_qt + hd64 * s_qh
    dst = out + (row * H + hd64) * (DH + 2 * HALF)
    d = tl.arange(0, BLOCK_DH)
    ok = hm[:, None] & (d < DH)[None, :]
    x = tl.load(src[:, None] + d.to(tl.int64)[None, :] * s_qd, mask=ok, other=0.0)  # int64: any strides
    tl.store(dst[:, None] + d[None, :], x.to(out.dtype.element_ty), mask=ok)
    if HALF > 0:
        i = tl.arange(0, BLOCK_HALF)
        im = i < HALF
        cos = tl.load(cs + row * (2 * HALF) + i, mask=im, other=0.0)[None, :]
        sin = tl.load(cs + row * (2 * HALF) + HALF + i, mask=im, other=0.0)[None, :]
        ok = hm[:, None] & im[None, :]
        c = i.to(tl.int64) + DH
        x1 = tl.load(src[:, None] + c[None, :] * s_qd, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src[:, None] + (c + HALF)[None, :] * s_qd, mask=ok, other=0.0).to(tl.float32)
        tl.store(dst[:, None] + (DH + i)[None, :], (x1 * cos - x2 * sin).to(out.dtype.element_ty), mask=ok)
        tl.store(dst[:, None] + (DH + HALF + i)[None, :], (x2 * cos + x1 * sin).to(out.dtype.element_ty), mask=ok)


# ---- launch helpers -------------------------------------------------------------------------------------
# (a tensor a kernel never reads, e.g. the rope factors with d_R = 0, is replaced by a non-empty one: an empty
# tensor's data pointer may be null)
def _dot_prec(*tensors: torch.Tensor) -> str:
    return "ieee" if any(t.dtype == torch.float32 for t in tensors) else "tf32"


@functools.lru_cache(maxsize=256)
def _plan(n_tok: int, hpg: int, g: int, K: int, N: int, elt: int, fp32: bool, sms: int) -> tuple[int, ...]:
    """Tiles of a per-group product ``[n_tok·hpg, K] @ [K, N]`` (whole ``K`` per program):
    ``(TOK, HB, NHB, BLOCK_N, BLOCK_K, num_warps)``, a row tile being ``TOK`` tokens x ``HB`` heads (``HB`` a power
    of two >= the heads per group, or 64 of them: ``NHB`` head blocks).

    The products are memory-bound: each program streams its row tile, the weight's ``[K, BLOCK_N]`` block and its
    output tile, so the plan minimises ``ceil(programs / SMs) x bytes per program`` (the busiest SM's traffic),
    with accumulators of at most 128 x 128 (64 x 64 in float32, whose IEEE dot runs on the FMA units)."""
    hb = min(next_pow2(hpg), 64)
    nhb = cdiv(hpg, hb)
    max_rows, max_n = (64, 64) if fp32 else (128, 128)
    best = None
    tok = max(1, 16 // hb)
    while tok * hb <= max(max_rows, hb):
        rows = tok * hb
        bn = 16
        while bn <= min(max_n, max(16, next_pow2(N))):
            progs = cdiv(n_tok, tok) * nhb * g * cdiv(N, bn)
            cost = cdiv(progs, sms) * (rows * K + K * bn + rows * bn) * elt
            key = (cost, -rows * bn)
            if best is None or key < best[0]:
                best = (key, tok, bn)
            bn *= 2
        tok *= 2
    _, tok, bn = best
    bk = min(max(16, next_pow2(K)), 32 if fp32 else 64)
    warps = 8 if tok * hb * bn >= 128 * 128 else 4
    return tok, hb, nhb, bn, bk, warps


def _sms(t: torch.Tensor) -> int:
    return device_info(t).sm_count if t.device.type == "cuda" else 132


def _check(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {list(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a bfloat16 / float16 / float32 tensor, got {t.dtype}")


def _check_heads(name: str, t: torch.Tensor) -> None:
    if t.shape[2] == 0:
        raise ValueError(f"{name}: expected at least one head (dim 2), got shape {list(t.shape)}")


def _check_weight(name: str, w, n: int, dev: torch.device) -> None:
    """An RMSNorm weight: a floating ``[n]`` tensor on ``dev`` (any stride)."""
    if w is None:
        raise ValueError(f"{name}: expected a tensor of shape [{n}], got None")
    check_tensor(name, w, shape=(n,), dtypes=FLOAT_DTYPES, device=dev)


def _check_same_device(dev: torch.device, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != dev:
            raise ValueError(f"{name}: expected a tensor on {dev}, got one on {t.device}")


def _check_out_dtype(out_dtype) -> None:
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype: expected torch.bfloat16 / float16 / float32, got {out_dtype}")


def _check_cos_sin(cos_sin, B: int, T: int, half: int, dev: torch.device, any_strides: bool = False) -> None:
    """``any_strides``: not checked contiguous (the custom ops' bodies copy it)."""
    check_tensor("cos_sin", cos_sin, shape=(B, T, 2, half), dtypes=(torch.float32,))
    if not cos_sin.is_contiguous() and not any_strides:
        raise ValueError("cos_sin: expected a contiguous tensor")
    _check_same_device(dev, cos_sin=cos_sin)


# ---- norm_rope ------------------------------------------------------------------------------------------
def _norm_rope_fwd(qa: torch.Tensor | None, qa_weight: torch.Tensor | None, kv: torch.Tensor,
                   kv_weight: torch.Tensor | None, positions: torch.Tensor, inv_freq: torch.Tensor, add_t: bool,
                   kv_rank: int, qa_eps: float, kv_eps: float,
                   out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, D = kv.shape
    half = (D - kv_rank) // 2
    dev = kv.device
    row = empty(B, T, D, dtype=out_dtype, device=dev)
    cos_sin = empty(B, T, 2, half, dtype=torch.float32, device=dev)
    has_q = qa is not None
    QR = qa.shape[-1] if has_q else 1
    qa_out = empty(B, T, QR, dtype=qa.dtype, device=dev) if has_q else row.new_empty(0)
    with on_device(dev):
        gqla_norm_rope_kernel[(B * T, 2 if has_q else 1)](
            qa if has_q else kv, qa_weight if has_q else kv, qa_out if has_q else row, kv,
            kv_weight if kv_weight is not None else kv, row, cos_sin if half else row, positions,
            inv_freq if half else row, float(qa_eps), float(kv_eps), T, *(qa.stride() if has_q else (0, 0, 0)),
            *kv.stride(), *positions.stride(), qa_weight.stride(0) if has_q else 0,
            kv_weight.stride(0) if kv_weight is not None else 0, inv_freq.stride(0) if half else 0,
            QR=QR, BLOCK_QR=next_pow2(QR), R=kv_rank, BLOCK_R=next_pow2(kv_rank), HALF=half,
            BLOCK_HALF=max(1, next_pow2(half)), KV_NORM=kv_weight is not None, ADD_T=bool(add_t),
            num_warps=4 if max(QR, kv_rank) >= 1024 else 2)
    return qa_out, row, cos_sin


@torch.library.custom_op("gqla_triton::gqla_norm_rope", mutates_args=())
def _norm_rope_op(qa: torch.Tensor | None, qa_weight: torch.Tensor | None, kv: torch.Tensor,
                  kv_weight: torch.Tensor | None, positions: torch.Tensor, inv_freq: torch.Tensor, add_t: bool,
                  kv_rank: int, qa_eps: float, kv_eps: float,
                  out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    args = (qa, qa_weight, kv, kv_weight, positions, inv_freq, add_t, kv_rank, qa_eps, kv_eps, out_dtype)
    _checked_op("norm_rope", args[:6], args[6:], lambda: _check_norm_rope(*args))
    return _norm_rope_fwd(*args)


@_norm_rope_op.register_fake
def _(qa, qa_weight, kv, kv_weight, positions, inv_freq, add_t, kv_rank, qa_eps, kv_eps, out_dtype):
    B, T, D = kv.shape
    qa_out = qa.new_empty(qa.shape) if qa is not None else kv.new_empty(0, dtype=out_dtype)
    return (qa_out, kv.new_empty(B, T, D, dtype=out_dtype),
            kv.new_empty(B, T, 2, (D - kv_rank) // 2, dtype=torch.float32))


forward_only(_norm_rope_op, "gqla_norm_rope")


def norm_rope(qa: torch.Tensor | None, qa_weight: torch.Tensor | None, kv: torch.Tensor,
              kv_weight: torch.Tensor | None, positions: torch.Tensor, inv_freq: torch.Tensor, *, add_t: bool,
              kv_rank: int, qa_eps: float = 1e-6, kv_eps: float = 1e-6,
              out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decode step's RMSNorms and rope factors, one launch. Returns ``(qa_out, row, cos_sin)``.

    ``kv [B, T, kv_rank + d_R]`` (``kv_a_proj``'s output, any strides) -> ``row [B, T, kv_rank + d_R]``
    contiguous in ``out_dtype``: ``[RMSNorm(kv[..., :kv_rank]) · kv_weight | rope(kv[..., kv_rank:])]``
    (``kv_weight`` None: no norm), the latent cache row. ``qa [B, T, q_rank]`` (or None) ->
    ``RMSNorm(qa) · qa_weight`` in ``qa``'s dtype (an empty tensor for None). RMSNorm in float32
    (``x · rsqrt(mean(x²) + eps) · w``, ``qa_eps`` / ``kv_eps``). ``cos_sin [B, T, 2, d_R / 2]`` float32: each
    token's rope factors for ``absorb_q`` / ``grouped_q``, from ``positions [B, T]`` (int, not uint64, any
    strides; ``add_t``: ``+ t``) and ``inv_freq [d_R / 2]`` float64 as in the module docstring. ``kv_weight
    [kv_rank]`` / ``qa_weight [q_rank]``: bfloat16 / float16 / float32, any stride (read as float32).
    """
    args = (qa, qa_weight, kv, kv_weight, positions, inv_freq, *_check_norm_rope(
        qa, qa_weight, kv, kv_weight, positions, inv_freq, add_t, kv_rank, qa_eps, kv_eps, out_dtype), out_dtype)
    fn = _norm_rope_op if requires_grad(qa, qa_weight, kv, kv_weight) else route(_norm_rope_op, _norm_rope_fwd)
    return fn(*args)


def _check_norm_rope(qa, qa_weight, kv, kv_weight, positions, inv_freq, add_t, kv_rank, qa_eps, kv_eps,
                     out_dtype) -> tuple[bool, int, float, float]:
    """Every check of ``norm_rope``'s arguments (its custom op's too); returns ``(add_t, kv_rank, qa_eps,
    kv_eps)`` as the kernel takes them."""
    _check("kv", kv, 3)
    B, T, D = kv.shape
    kv_rank = check_positive_int("kv_rank", kv_rank)
    if kv_rank > D or (D - kv_rank) % 2:
        raise ValueError(f"kv_rank: expected an int in [1, {D}] leaving an even rope width, got {kv_rank!r}")
    half = (D - kv_rank) // 2
    _check_out_dtype(out_dtype)
    add_t = check_flag("add_t", add_t)
    if kv_weight is not None:
        _check_weight("kv_weight", kv_weight, kv_rank, kv.device)
    if qa is not None:
        _check("qa", qa, 3)
        if list(qa.shape[:2]) != [B, T] or qa.shape[-1] == 0:
            raise ValueError(f"qa: expected shape [{B}, {T}, q_rank], got {list(qa.shape)}")
        _check_weight("qa_weight", qa_weight, qa.shape[-1], kv.device)
    elif qa_weight is not None:
        raise ValueError("qa_weight: given without qa (it scales the normed qa)")
    qa_eps, kv_eps = check_eps("qa_eps", qa_eps), check_eps("kv_eps", kv_eps)
    check_positions(positions, (B, T))
    check_tensor("inv_freq", inv_freq, shape=(half,), dtypes=(torch.float64,))
    _check_same_device(kv.device, qa=qa, positions=positions, inv_freq=inv_freq)
    check_kernel_device(kv.device, _REFERENCE, kv.dtype)
    if qa is not None:
        check_kernel_device(kv.device, _REFERENCE, qa.dtype)
    check_kernel_device(kv.device, _REFERENCE, out_dtype)
    for w in (qa_weight, kv_weight):
        if w is not None:
            check_kernel_device(kv.device, _REFERENCE, w.dtype)
    return add_t, kv_rank, qa_eps, kv_eps


# ---- absorb_q -------------------------------------------------------------------------------------------
def _absorb_q_fwd(q: torch.Tensor, w_uk: torch.Tensor, cos_sin: torch.Tensor, head_dim: int,
                  out_dtype: torch.dtype) -> torch.Tensor:
    B, T, h, E = q.shape
    g, _, r = w_uk.shape
    half = (E - head_dim) // 2
    hpg = h // g
    out = empty(B, T, h, r + 2 * half, dtype=out_dtype, device=q.device)
    fp32 = torch.float32 in (q.dtype, w_uk.dtype)
    tok, hb, nhb, block_n, block_k, warps = _plan(B * T, hpg, g, head_dim, r, q.element_size(), fp32, _sms(q))
    grid = (cdiv(B * T, tok) * nhb, g, cdiv(r, block_n))
    with on_device(q.device):
        gqla_absorb_q_kernel[grid](
            q, w_uk, out, cos_sin if half else out, B * T, T, *q.stride(), *w_uk.stride(), *out.stride()[:3],
            HPG=hpg, DH=head_dim, R=r, HALF=half, TOK=tok, HB=hb, NHB=nhb, BLOCK_N=block_n, BLOCK_K=block_k,
            BLOCK_HALF=max(1, next_pow2(half)), DOT_PREC=_dot_prec(q, w_uk), num_warps=warps, num_stages=2)
    return out


@torch.library.custom_op("gqla_triton::gqla_absorb_q", mutates_args=())
def _absorb_q_op(q: torch.Tensor, w_uk: torch.Tensor, cos_sin: torch.Tensor, head_dim: int,
                 out_dtype: torch.dtype) -> torch.Tensor:
    _checked_op("absorb_q", (q, w_uk, cos_sin), (head_dim, out_dtype),
                lambda: _check_absorb_q(q, w_uk, cos_sin, head_dim, out_dtype, any_strides=True))
    return _absorb_q_fwd(q, w_uk, cos_sin.contiguous(), head_dim, out_dtype)  # (the kernel reads it without strides)


@_absorb_q_op.register_fake
def _(q, w_uk, cos_sin, head_dim, out_dtype):
    B, T, h, E = q.shape
    return q.new_empty(B, T, h, w_uk.shape[-1] + E - head_dim, dtype=out_dtype)


forward_only(_absorb_q_op, "gqla_absorb_q")


def absorb_q(q: torch.Tensor, w_uk: torch.Tensor, cos_sin: torch.Tensor, *, head_dim: int,
             out_dtype: torch.dtype) -> torch.Tensor:
    """The absorb path's query for ``mla_decode``.

    ``q [B, T, h, head_dim + d_R]`` (any strides: a view of ``q_b_proj``'s output), ``w_uk [g, head_dim, r]``
    (any strides), ``cos_sin [B, T, 2, d_R / 2]`` float32 (``norm_rope``'s) -> ``[B, T, h, r + d_R]`` contiguous
    in ``out_dtype``: ``q_nope[i] @ w_uk[i // (h/g)]`` (``w_uk`` read in ``q``'s dtype, fp32 accumulation), then
    the rotated ``q_rope[i]``.
    """
    head_dim = _check_absorb_q(q, w_uk, cos_sin, head_dim, out_dtype)
    fn = _absorb_q_op if requires_grad(q, w_uk) else route(_absorb_q_op, _absorb_q_fwd)
    return fn(q, w_uk, cos_sin, head_dim, out_dtype)


def _check_absorb_q(q, w_uk, cos_sin, head_dim, out_dtype, any_strides: bool = False) -> int:
    """Every check of ``absorb_q``'s arguments (its custom op's too: ``any_strides``, cos_sin of any strides);
    returns head_dim as an int."""
    _check("q", q, 4)
    _check("w_uk", w_uk, 3)
    _check_heads("q", q)
    B, T, h, E = q.shape
    g, dh, r = w_uk.shape
    head_dim = check_positive_int("head_dim", head_dim)
    if dh != head_dim or head_dim > E or (E - head_dim) % 2:
        raise ValueError(f"head_dim: expected w_uk.shape[1] ({dh}), at most q.shape[-1] ({E}) and leaving an even "
                         f"rope width, got {head_dim!r}")
    if g == 0 or h % g:
        raise ValueError(f"w_uk: {g} groups do not divide q's {h} heads")
    if r == 0:
        raise ValueError("w_uk: expected a latent width r >= 1")
    _check_out_dtype(out_dtype)
    _check_cos_sin(cos_sin, B, T, (E - head_dim) // 2, q.device, any_strides)
    _check_same_device(q.device, w_uk=w_uk)
    for dt in (q.dtype, w_uk.dtype, out_dtype):
        check_kernel_device(q.device, _REFERENCE, dt)
    return head_dim


# ---- absorb_o -------------------------------------------------------------------------------------------
def _absorb_o_fwd(o: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    B, T, h, r = o.shape
    g, dv, _ = w_uv.shape
    hpg = h // g
    out = empty(B, T, h, dv, dtype=w_uv.dtype, device=o.device)
    fp32 = torch.float32 in (o.dtype, w_uv.dtype)
    tok, hb, nhb, block_n, block_k, warps = _plan(B * T, hpg, g, r, dv, w_uv.element_size(), fp32, _sms(o))
    grid = (cdiv(B * T, tok) * nhb, g, cdiv(dv, block_n))
    with on_device(o.device):
        gqla_absorb_o_kernel[grid](
            o, w_uv, out, B * T, T, *o.stride(), *w_uv.stride(), *out.stride()[:3],
            HPG=hpg, R=r, DV=dv, TOK=tok, HB=hb, NHB=nhb, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_PREC=_dot_prec(o, w_uv), num_warps=warps, num_stages=3)
    return out


@torch.library.custom_op("gqla_triton::gqla_absorb_o", mutates_args=())
def _absorb_o_op(o: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    _checked_op("absorb_o", (o, w_uv), (), lambda: _check_absorb_o(o, w_uv))
    return _absorb_o_fwd(o, w_uv)


@_absorb_o_op.register_fake
def _(o, w_uv):
    B, T, h, _ = o.shape
    return o.new_empty(B, T, h, w_uv.shape[1], dtype=w_uv.dtype)


forward_only(_absorb_o_op, "gqla_absorb_o")


def absorb_o(o: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """The absorb path's output for ``o_proj``: ``o [B, T, h, r]`` (``mla_decode``'s output, any strides),
    ``w_uv [g, d_v, r]`` (any strides) -> ``[B, T, h, d_v]`` contiguous in ``w_uv``'s dtype,
    ``o[i] @ w_uv[i // (h/g)]ᵀ`` (``o`` read in ``w_uv``'s dtype, fp32 accumulation)."""
    _check_absorb_o(o, w_uv)
    fn = _absorb_o_op if requires_grad(o, w_uv) else route(_absorb_o_op, _absorb_o_fwd)
    return fn(o, w_uv)


def _check_absorb_o(o, w_uv) -> None:
    """Every check of ``absorb_o``'s arguments (its custom op's too)."""
    _check("o", o, 4)
    _check("w_uv", w_uv, 3)
    _check_heads("o", o)
    h, r = o.shape[2], o.shape[3]
    g = w_uv.shape[0]
    if w_uv.shape[2] != r or r == 0 or w_uv.shape[1] == 0:
        raise ValueError(f"w_uv: expected shape [g, d_v, {r}] (d_v >= 1), got {list(w_uv.shape)}")
    if g == 0 or h % g:
        raise ValueError(f"w_uv: {g} groups do not divide o's {h} heads")
    _check_same_device(o.device, w_uv=w_uv)
    for dt in (o.dtype, w_uv.dtype):
        check_kernel_device(o.device, _REFERENCE, dt)


# ---- grouped_q ------------------------------------------------------------------------------------------
def _grouped_q_fwd(q: torch.Tensor, cos_sin: torch.Tensor, head_dim: int, out_dtype: torch.dtype) -> torch.Tensor:
    B, T, h, E = q.shape
    half = (E - head_dim) // 2
    out = empty(B, T, h, E, dtype=out_dtype, device=q.device)
    block_dh = next_pow2(head_dim)
    fit = max(1, 4096 // (block_dh + 2 * next_pow2(max(half, 1))))  # about 4096 elements per program
    block_h = min(next_pow2(h), 1 << (fit.bit_length() - 1))
    with on_device(q.device):
        gqla_grouped_q_kernel[(B * T, cdiv(h, block_h))](
            q, out, cos_sin if half else out, T, h, *q.stride(),
            DH=head_dim, HALF=half, BLOCK_H=block_h, BLOCK_DH=block_dh, BLOCK_HALF=max(1, next_pow2(half)),
            num_warps=4)
    return out


@torch.library.custom_op("gqla_triton::gqla_grouped_q", mutates_args=())
def _grouped_q_op(q: torch.Tensor, cos_sin: torch.Tensor, head_dim: int, out_dtype: torch.dtype) -> torch.Tensor:
    _checked_op("grouped_q", (q, cos_sin), (head_dim, out_dtype),
                lambda: _check_grouped_q(q, cos_sin, head_dim, out_dtype, any_strides=True))
    return _grouped_q_fwd(q, cos_sin.contiguous(), head_dim, out_dtype)  # (the kernel reads it without strides)


@_grouped_q_op.register_fake
def _(q, cos_sin, head_dim, out_dtype):
    return q.new_empty(q.shape, dtype=out_dtype)


forward_only(_grouped_q_op, "gqla_grouped_q")


def grouped_q(q: torch.Tensor, cos_sin: torch.Tensor, *, head_dim: int, out_dtype: torch.dtype) -> torch.Tensor:
    """The grouped path's query for ``gqa_decode``: ``q [B, T, h, head_dim + d_R]`` (any strides),
    ``cos_sin [B, T, 2, d_R / 2]`` float32 (``norm_rope``'s) -> ``[B, T, h, head_dim + d_R]`` contiguous in
    ``out_dtype``, ``[q_nope | rotated q_rope]``."""
    head_dim = _check_grouped_q(q, cos_sin, head_dim, out_dtype)
    fn = _grouped_q_op if requires_grad(q) else route(_grouped_q_op, _grouped_q_fwd)
    return fn(q, cos_sin, head_dim, out_dtype)


def _check_grouped_q(q, cos_sin, head_dim, out_dtype, any_strides: bool = False) -> int:
    """Every check of ``grouped_q``'s arguments (its custom op's too: ``any_strides``, cos_sin of any strides);
    returns head_dim as an int."""
    _check("q", q, 4)
    _check_heads("q", q)
    B, T, h, E = q.shape
    head_dim = check_positive_int("head_dim", head_dim)
    if head_dim > E or (E - head_dim) % 2:
        raise ValueError(f"head_dim: expected an int in [1, {E}] leaving an even rope width, got {head_dim!r}")
    _check_out_dtype(out_dtype)
    _check_cos_sin(cos_sin, B, T, (E - head_dim) // 2, q.device, any_strides)
    for dt in (q.dtype, out_dtype):
        check_kernel_device(q.device, _REFERENCE, dt)
    return head_dim
