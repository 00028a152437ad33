"""Stage ``wu``: w = Ainv·(beta·e^gc·k) and u = Ainv·(beta·v) (forward, and again in a backward that recomputes the
states)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _beta_in, _chunk_rows, _empty_slot, _nan_from_first_bad

# vbad codes (bits): the chunk has a non-finite v / rows past a non-finite k, beta or decay (gc NaN there)
VBAD_V: tl.constexpr = tl.constexpr(1)
VBAD_ROWS: tl.constexpr = tl.constexpr(2)


@triton.jit
def _vbad_at(i_t, i_bh, NG, HV):
    """Offset in vbad ``[B, NG, HV]`` (= ``[chunk-state rows, HV]``) of chunk program i_t of batch row x value head
    i_bh (a grid of NG chunk programs per batch row)."""
    return ((i_bh // HV) * NG + i_t) * HV + i_bh % HV


@triton.jit(do_not_specialize=["T", "H", "HV"])
def gdn_wu_fwd_kernel(k, v, beta, gc, Ainv, w, u, vbad, cu, cidx, T, H, HV,
                      K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      IS_VARLEN: tl.constexpr, BETA_SIGMOID: tl.constexpr = False, NEG_EIGVAL: tl.constexpr = False,
                      EMPTY_SLOTS: tl.constexpr = False):
    """w = Ainv·(beta·e^gc·k) [rows, HV, K], u = Ainv·(beta·v) [rows, HV, V] (stored in the input dtype), and
    vbad ``[B, NG, HV]`` int32 (``_vbad_at``): which non-finite inputs the chunk has (``VBAD_*`` bits).
    BETA_SIGMOID / NEG_EIGVAL: beta as ``_beta_in`` takes it.

    Non-finite inputs: gc is NaN from the chunk's first token with a non-finite k, beta or decay on (``wy``), and
    w and u are NaN there through it downstream; a non-finite v[t, c] makes u's column c NaN from row t on. The
    products would also carry a later row's NaN to the earlier rows through their zeros (0·NaN): a chunk with
    any non-finite input forms w and u again from its finite entries (``_wu_rows_nonfinite``, in loops the
    compiler does not pipeline: a rare path), stored over the first results after a barrier."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    if EMPTY_SLOTS:  # a device-built plan: the programs past the last chunk have none
        if _empty_slot(cidx, i_t):
            return
    i_b, i_hv, i_h, bos, Tn, t0, t, valid, x = _chunk_rows(i_t, i_bh, cu, cidx, T, H, HV, BT, IS_VARLEN)
    nbv, ndead = _wu_rows(k, v, beta, gc, Ainv, w, u, x, valid, i_h, i_hv, H, HV, K, V, BT, BK, BV, BETA_SIGMOID,
                          NEG_EIGVAL)
    bad = tl.where(nbv > 0, VBAD_V, 0) + tl.where(ndead > 0, VBAD_ROWS, 0)
    tl.store(vbad + _vbad_at(i_t, i_bh, tl.num_programs(0), HV), bad)
    if bad != 0:
        tl.debug_barrier()  # the first results' stores are ordered before the stores over them
        _wu_rows_nonfinite(k, v, beta, gc, Ainv, w, u, x, valid, i_h, i_hv, H, HV, K, V, BT, BK, BV, BETA_SIGMOID,
                           NEG_EIGVAL)


@triton.jit
def _wu_chunk(beta, gc, Ainv, x, valid, i_hv, HV, BT: tl.constexpr, dt: tl.constexpr, BETA_SIGMOID: tl.constexpr,
              NEG_EIGVAL: tl.constexpr):
    """The chunk's Ainv rows [BT, BT] in dtype dt, beta as taken and gc [BT] (fp32)."""
    c = tl.arange(0, BT)
    A = tl.load(Ainv + (x[:, None] * HV + i_hv) * BT + c[None, :], mask=valid[:, None], other=0.0)
    b = _beta_in(tl.load(beta + x * HV + i_hv, mask=valid, other=0.0).to(tl.float32), valid, BETA_SIGMOID,
                 NEG_EIGVAL)
    return A.to(dt), b, tl.load(gc + x * HV + i_hv, mask=valid, other=0.0)


@triton.jit
def _wu_rows(k, v, beta, gc, Ainv, w, u, x, valid, i_h, i_hv, H, HV, K: tl.constexpr, V: tl.constexpr,
             BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BETA_SIGMOID: tl.constexpr,
             NEG_EIGVAL: tl.constexpr):
    """w = Ainv·(beta·e^gc·k), u = Ainv·(beta·v) for the chunk rows x (valid: inside the sequence). Returns how
    many of its v entries are not finite and how many rows have gc NaN (``gdn_wu_fwd_kernel``)."""
    Ad, b, gcv = _wu_chunk(beta, gc, Ainv, x, valid, i_hv, HV, BT, k.dtype.element_ty, BETA_SIGMOID, NEG_EIGVAL)
    ndead = tl.sum(tl.where(gcv == gcv, 0, 1), 0)
    eg = tl.exp(gcv)
    for k0 in range(0, K, BK):
        ck = k0 + tl.arange(0, BK)
        mk = valid[:, None] & (ck[None, :] < K)
        kk = tl.load(k + x[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0).to(tl.float32)
        wk = tl.dot(Ad, (kk * (b * eg)[:, None]).to(Ad.dtype))
        tl.store(w + x[:, None] * (HV * K) + i_hv * K + ck[None, :], wk.to(w.dtype.element_ty), mask=mk)
    nbv = tl.zeros([BT], dtype=tl.int32)
    for v0 in range(0, V, BV):
        cv = v0 + tl.arange(0, BV)
        mv = valid[:, None] & (cv[None, :] < V)
        vv = tl.load(v + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0).to(tl.float32)
        uv = tl.dot(Ad, (vv * b[:, None]).to(Ad.dtype))
        nbv += tl.sum(tl.where(tl.abs(vv) < float("inf"), 0, 1), 1)
        tl.store(u + x[:, None] * (HV * V) + i_hv * V + cv[None, :], uv.to(u.dtype.element_ty), mask=mv)
    return tl.sum(nbv, 0), ndead


@triton.jit
def _wu_rows_nonfinite(k, v, beta, gc, Ainv, w, u, x, valid, i_h, i_hv, H, HV, K: tl.constexpr, V: tl.constexpr,
                       BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BETA_SIGMOID: tl.constexpr,
                       NEG_EIGVAL: tl.constexpr):
    """``_wu_rows``' products for a chunk with non-finite inputs: the live rows' finite entries only, u's column
    c NaN from its first non-finite v on."""
    Ad, b, gcv = _wu_chunk(beta, gc, Ainv, x, valid, i_hv, HV, BT, k.dtype.element_ty, BETA_SIGMOID, NEG_EIGVAL)
    live = gcv == gcv
    s = tl.where(live, b * tl.exp(gcv), 0.0)
    for k0 in tl.range(0, K, BK, num_stages=1):
        ck = k0 + tl.arange(0, BK)
        mk = valid[:, None] & (ck[None, :] < K)
        kk = tl.load(k + x[:, None] * (H * K) + i_h * K + ck[None, :], mask=mk, other=0.0).to(tl.float32)
        wk = tl.dot(Ad, tl.where(live[:, None], kk * s[:, None], 0.0).to(Ad.dtype))
        tl.store(w + x[:, None] * (HV * K) + i_hv * K + ck[None, :], wk.to(w.dtype.element_ty), mask=mk)
    for v0 in tl.range(0, V, BV, num_stages=1):
        cv = v0 + tl.arange(0, BV)
        mv = valid[:, None] & (cv[None, :] < V)
        vv = tl.load(v + x[:, None] * (HV * V) + i_hv * V + cv[None, :], mask=mv, other=0.0).to(tl.float32)
        ok = tl.abs(vv) < float("inf")
        uv = tl.dot(Ad, tl.where(ok & live[:, None], vv * b[:, None], 0.0).to(Ad.dtype))
        uv = _nan_from_first_bad(uv, ok, BT)
        tl.store(u + x[:, None] * (HV * V) + i_hv * V + cv[None, :], uv.to(u.dtype.element_ty), mask=mv)
