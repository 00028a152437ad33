"""@triton.jit helpers shared by the chunk kernels: which tokens, chunk rows and state rows a program covers, and
one step of the state recurrence.

Layouts (rows = flattened tokens ``B*T``): q, k ``[rows, H, K]``; v, u, v_new, o ``[rows, HV, V]``;
w ``[rows, HV, K]``; g, gc (chunk-local cumsum, fp32), beta ``[rows, HV]``; Ainv ``[rows, HV, BT]`` (bf16 for
bf16 inputs, else fp32; row t holds row t mod BT of its chunk's ``(I + A)^-1``); chunk states h
``[chunks, HV, K, V]`` (state at each chunk's start). Sequences come from ``cu`` (varlen: token bounds
``[N+1]``, with ``cidx [chunks, 2]`` (sequence, chunk within it) and ``coff [N+1]`` (first chunk-state row of
each sequence); a device-built plan has more chunk programs than chunks, the extra ones return at once) or are
the B rows of length T. Head counts and lengths are runtime values that Triton does not specialise on: one compiled
variant per (K, V, dtype, launch config) serves every H, HV and T.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _seq_bounds(i_t, i_b, cu, cidx, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(bos int64, sequence length, chunk start within the sequence) of chunk program i_t."""
    if IS_VARLEN:
        i_n = tl.load(cidx + 2 * i_t).to(tl.int64)
        i_c = tl.load(cidx + 2 * i_t + 1)
        bos = tl.load(cu + i_n).to(tl.int64)
        eos = tl.load(cu + i_n + 1).to(tl.int64)
    else:
        i_c = i_t
        bos = i_b.to(tl.int64) * T
        eos = bos + T
    return bos, (eos - bos).to(tl.int32), i_c * BT


@triton.jit
def _state_span(i_n, cu, coff, T, NT, IS_VARLEN: tl.constexpr):
    """(bos int64, length, first chunk-state row int64) of sequence i_n, for the sequential state passes."""
    if IS_VARLEN:
        bos = tl.load(cu + i_n).to(tl.int64)
        Tn = (tl.load(cu + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        boh = tl.load(coff + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        Tn = T
        boh = i_n.to(tl.int64) * NT
    return bos, Tn, boh


@triton.jit
def _chunk_rows(i_t, i_bh, cu, cidx, T, H, HV, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Chunk program (i_t, i_bh = batch row x value head): (i_b, i_hv, i_h, bos, length, chunk start,
    t [BT] positions in the sequence, valid [BT], x [BT] int64 flat rows)."""
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    bos, Tn, t0 = _seq_bounds(i_t, i_b, cu, cidx, T, BT, IS_VARLEN)
    t = t0 + tl.arange(0, BT)
    return i_b, i_hv, i_h, bos, Tn, t0, t, t < Tn, bos + t


@triton.jit
def _state_heads(i_nh, cu, coff, T, NT, H, HV, IS_VARLEN: tl.constexpr):
    """Sequential state program over sequence x value head i_nh: (i_hv, i_h, bos, length, first state row)."""
    i_n, i_hv = i_nh // HV, i_nh % HV
    bos, Tn, boh = _state_span(i_n, cu, coff, T, NT, IS_VARLEN)
    return i_hv, i_hv // (HV // H), bos, Tn, boh


@triton.jit
def _pool_row(idx, i_nh, HV, P):
    """Row (int64) of state pool ``[P, HV, K, V]`` that sequence x value head i_nh reads and writes, and whether it is
    live: ``idx[sequence]`` in [0, P) (a row that is not is never accessed)."""
    r = tl.load(idx + i_nh // HV).to(tl.int64)
    live = (r >= 0) & (r < P)
    return tl.where(live, r, 0) * HV + i_nh % HV, live


@triton.jit
def _h_row(idx, i_nh, ck, cv, mkv, HV, P, K: tl.constexpr, V: tl.constexpr, POOL: tl.constexpr):
    """Row (int64) of the initial / final state of sequence x value head i_nh and the mask of its [BK, BV] slice
    (``mkv``): row i_nh, or with POOL ``_pool_row``'s, masked off entirely when not live."""
    if POOL:
        row, live = _pool_row(idx, i_nh, HV, P)
        return row, (ck[:, None] < K) & (cv[None, :] < tl.where(live, V, 0))
    return i_nh.to(tl.int64), mkv


@triton.jit
def _state_ptr(base, row, ck, cv, K: tl.constexpr, V: tl.constexpr, V_FIRST: tl.constexpr):
    """Pointers of the [BK, BV] slice (rows ck, columns cv) of state ``row`` (int64) of ``base``: rows
    ``[K, V]``, or ``[V, K]`` with V_FIRST (the slice is then read transposed)."""
    if V_FIRST:
        return base + (row * V + cv[None, :]) * K + ck[:, None]
    return base + (row * K + ck[:, None]) * V + cv[None, :]


@triton.jit
def v_block_unit(V: tl.constexpr, BV: tl.constexpr):
    """(V block, unit) of a program of the one-axis grid ``(cdiv(V, BV) * units,)``, V blocks fastest."""
    NVB: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    return pid % NVB, pid // NVB


@triton.jit
def _state_begin(h0, idx, cu, coff, T, NT, P, H, HV, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr, POOL: tl.constexpr,
                 V_FIRST: tl.constexpr):
    """A sequential state program (of a one-axis grid of V blocks x sequences x value heads, V blocks fastest: no
    second-axis limit of 65535 on the units): (i_nh, i_hv, i_h, bos, length, first state row, ck [BK], cv [BV], its
    slice mask, and its start state S [BK, BV] fp32: read from h0 (``_h_row``; the reverse pass: the final state's
    gradient) with USE_H0, zeros without)."""
    i_v, i_nh = v_block_unit(V, BV)
    i_hv, i_h, bos, Tn, boh = _state_heads(i_nh, cu, coff, T, NT, H, HV, IS_VARLEN)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mkv = (ck[:, None] < K) & (cv[None, :] < V)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        row, mrow = _h_row(idx, i_nh, ck, cv, mkv, HV, P, K, V, POOL)
        S += tl.load(_state_ptr(h0, row, ck, cv, K, V, V_FIRST), mask=mrow, other=0.0).to(tl.float32)
    return i_nh, i_hv, i_h, bos, Tn, boh, ck, cv, mkv, S


@triton.jit
def _state_end(ht, idx, S, i_nh, ck, cv, mkv, HV, P, K: tl.constexpr, V: tl.constexpr, POOL: tl.constexpr,
               V_FIRST: tl.constexpr):
    """Store a sequential state program's final S into ht (rounded to its dtype; rows as ``_state_begin`` reads)."""
    row, mrow = _h_row(idx, i_nh, ck, cv, mkv, HV, P, K, V, POOL)  # formed again: nothing of it lives in the loop
    tl.store(_state_ptr(ht, row, ck, cv, K, V, V_FIRST), S.to(ht.dtype.element_ty), mask=mrow)


@triton.jit
def _beta_in(b, mask, BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr):
    """beta as the recurrence takes it from the loaded values b (fp32, 0 where not ``mask``): sigmoid(b) with
    BETA_SIGMOID (b holds logits), doubled with NEG_EIGVAL; b itself with neither."""
    if BETA_SIGMOID:
        b = tl.where(mask, tl.sigmoid(b), 0.0)
    if NEG_EIGVAL:
        b = b * 2.0
    return b


@triton.jit
def _dbeta_out(db, b, BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr):
    """The gradient of the loaded values from db = dL/d(beta as taken) and b = beta as taken (``_beta_in``'s
    result: the loaded values need not stay live): ·s(1 − s) with BETA_SIGMOID (s, the sigmoid of the loaded
    value, is b, or b/2 with NEG_EIGVAL), ·2 with NEG_EIGVAL."""
    if BETA_SIGMOID:
        if NEG_EIGVAL:
            s = b * 0.5
        else:
            s = b
        db = db * (s * (1.0 - s))
    if NEG_EIGVAL:
        db = db * 2.0
    return db


@triton.jit
def _chunk_state_row(i_t, i_b, coff, cidx, NT, IS_VARLEN: tl.constexpr):
    """Row (int64) of chunk program i_t's state in h ``[chunks, HV, K, V]``."""
    if IS_VARLEN:
        i_ch = tl.load(coff + tl.load(cidx + 2 * i_t)).to(tl.int64) + tl.load(cidx + 2 * i_t + 1)
    else:
        i_ch = i_b.to(tl.int64) * NT + i_t
    return i_ch


@triton.jit
def _empty_slot(cidx, i_t):
    """Whether chunk program i_t of a device-built varlen plan has no chunk: its cidx row is (-1, 0) (the plan's
    program count is a bound; ``kernels/plan.py``)."""
    return tl.load(cidx + 2 * i_t) < 0


@triton.jit
def _chunk_k_g(k, gc, x, valid, mk, bos, t0, Tn, i_hv, i_h, ck, H, HV, K: tl.constexpr, BT: tl.constexpr):
    """One chunk's k rows [BT, BK], gc [BT] and gl = gc of its last valid row (the chunk starts at token t0)."""
    last = tl.minimum(t0 + BT, Tn) - 1
    gl = tl.load(gc + (bos + last) * HV + i_hv)
    gg = tl.load(gc + x * HV + i_hv, mask=valid, other=0.0)
    kk = tl.load(k + x[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0)
    return kk, gg, gl


@triton.jit
def _decay_update(S, vn, kk, gg, gl, valid):
    """End of one chunk step of the state recurrence: S ← e^gl·S + kᵀ (e^(gl−gc)·v_new). The decay scales the
    rows of v_new ([BT, BV]), not of k ([BT, K]): k goes from memory to the dot as is."""
    vd = vn * tl.exp(tl.where(valid, gl - gg, 0.0))[:, None]
    return S * tl.exp(gl) + tl.dot(tl.trans(kk), vd.to(kk.dtype))


@triton.jit
def _nan_from_first_bad(x, ok, BT: tl.constexpr):
    """x ``[BT, BV]`` with each column NaN from its first row where ok is False on (a non-finite v or v_new: the
    recurrence carries it to the column's later rows, not its earlier ones)."""
    r = tl.arange(0, BT)
    return tl.where(r[:, None] >= tl.min(tl.where(ok, BT, r[:, None]), 0)[None, :], float("nan"), x)


@triton.jit
def _vnew_ainv(A, b, vv, kS, gg, BT: tl.constexpr):
    """One chunk's v_new = Ainv·(beta·(v − e^gc·(k S))) ``[BT, BV]`` fp32 (= u − w S, without w and u) from its
    Ainv rows A ``[BT, BT]`` (k's dtype), beta as taken b ``[BT]``, v ``[BT, BV]`` and k S ``[BT, BV]`` (fp32) and gc
    ``[BT]``; the difference is taken in fp32 and rounded once to A's dtype. Non-finite inputs: the product takes the
    finite, live entries only (a row whose gc is NaN is dead; a later row's NaN must not reach an earlier row as
    0·NaN through it), and each column is NaN from its first non-finite v on, where ``gdn_wu_fwd_kernel`` puts
    NaN. Returns v_new and whether the chunk has no non-finite v and no dead row."""
    xs = b[:, None] * (vv - tl.exp(gg)[:, None] * kS)
    okv = tl.abs(vv) < float("inf")
    live = gg == gg
    clean = tl.sum(tl.sum(tl.where(okv, 0, 1), 1) + tl.where(live, 0, 1), 0) == 0
    vn = tl.dot(A, tl.where(okv & live[:, None], xs, 0.0).to(A.dtype))
    if not clean:
        vn = _nan_from_first_bad(vn, okv, BT)
    return vn, clean


@triton.jit
def _softplus(x):
    """``log(1 + exp(x))`` (``x`` itself above 20, as torch's softplus), log1p-accurate for very negative x; a NaN
    stays NaN (the clamp is a select: tl.minimum would return 20 for it on the GPU)."""
    u = tl.exp(tl.where(x > 20.0, 20.0, x))
    w = 1.0 + u
    # log1p(u) = log(w) · u / (w - 1): exact to rounding when w rounds away from u + 1 (and u itself when w == 1)
    lp = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
    return tl.where(x > 20.0, x, lp)


@triton.jit
def _gate_par(a_log, dt_bias, i_hv, HAS_BIAS: tl.constexpr, mask=None):
    """The in-kernel gate's parameters of value head(s) i_hv (a scalar or a vector, with ``mask``): (-exp(A_log),
    dt_bias or 0), fp32."""
    if mask is None:
        na = -tl.exp(tl.load(a_log + i_hv).to(tl.float32))
    else:
        na = -tl.exp(tl.load(a_log + i_hv, mask=mask, other=0.0).to(tl.float32))
    bias = na * 0.0
    if HAS_BIAS:
        if mask is None:
            bias = tl.load(dt_bias + i_hv).to(tl.float32)
        else:
            bias = tl.load(dt_bias + i_hv, mask=mask, other=0.0).to(tl.float32)
    return na, bias


@triton.jit
def _gate_in(a, na, bias):
    """fla's in-kernel gate from the raw input ``a`` (fp32) and ``_gate_par``'s (na, bias), broadcast against a:
    (g, dg/da) with ``g = -exp(A_log)·softplus(a + dt_bias)`` (``_softplus``), fp32."""
    x = a + bias
    dsp = tl.where(x > 20.0, 1.0, tl.sigmoid(x))
    return na * _softplus(x), na * dsp
