"""Chunked Gated DeltaNet (prefill / training): Triton forward + backward, fla/FlashQLA-compatible API.

``chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
use_qk_l2norm_in_kernel=False, cu_seqlens=None) -> (o, final_state)``; see its docstring for shapes.
Kernels: ``chunk_fwd.py`` (wy, wu, state, output stages) and ``chunk_bwd.py``.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import NamedTuple

import torch

from ...dispatch import device_info, select_config
from .._common.host import cdiv, next_pow2
from .._common.validation import FLOAT_DTYPES, check_kernel_device, check_same_device, check_same_dtype, check_tensor
from .chunk_bwd import gdn_dv_local_kernel, gdn_grad_chunk_kernel, gdn_state_bwd_kernel, gdn_wy_bwd_kernel
from .chunk_fwd import (
    gdn_output_fwd_kernel,
    gdn_state_fwd_kernel,
    gdn_state_prefix_kernel,
    gdn_state_seg_kernel,
    gdn_wu_fwd_kernel,
    gdn_wy_fwd_kernel,
)
from .reference import L2NORM_EPS

__all__ = ["chunk_gated_delta_rule", "chunk_gdn_fwd", "chunk_gdn_bwd"]

BT = 64  # chunk size

# every buffer the kernels must fill comes from here (tests swap in a NaN-filling allocator)
_empty = torch.empty

# Launch parameters when the config table leaves a field out. Every kernel has its own fields, named
# "<kernel>_<field>" (BK, BV: tile widths along K and V; warps; stages), so each can be tuned alone;
# wy_prec is the dot precision of the 16x16 block inverse in the wy stage ("ieee" fp32 FMA, "tf32x3", or "tf32": every
# consumer of Ainv reads it at tf32 precision or below, as a bf16 / fp16 operand or an fp32 one of tf32 dots); wy_fuse = 1
# computes w and u in the wy kernel (with the wu tiles) instead of a second kernel; out_fuse = 1 computes the
# forward's output inside its state pass (no h / v_new round trip through memory; that pass then runs with the out_BV
# / out_warps / out_stages fields, the backward's recomputing state pass with the state_* ones); seg_units > 0
# splits sequences when there are fewer than seg_below (sequence x value head) units, into about seg_units units of
# >= seg_min chunks each, so that the sequential state passes run on more SMs (seg_units 0: never); wy_bwd_trans = 1
# and grad_trans = 1 take a term of dk as a transposed dot result (the kernels' TRANS_OUT; H200: bitwise deterministic
# over bench.determinism_gdn, G1 backward 0.35 ms faster); grad_early / out_early / dvl_early = 1 issue the loads
# that follow those kernels' loops (grad_chunk: q and k; output: v_new and gc; dv_local: dO and gc) before the loop;
# grad_late / wy_bwd_late = 1: in the GVA sums of dq / dk the later value heads wait for the earlier ones' running
# sum after their other work (grad: its dk terms; wy_bwd: its dv loop) while the first passes its sum on before it.
KERNELS = {"wy": "gdn_wy_fwd_kernel", "wu": "gdn_wu_fwd_kernel", "state": "gdn_state_fwd_kernel",
           "out": "gdn_output_fwd_kernel", "dvl": "gdn_dv_local_kernel", "state_bwd": "gdn_state_bwd_kernel",
           "grad": "gdn_grad_chunk_kernel", "wy_bwd": "gdn_wy_bwd_kernel", "seg": "gdn_state_seg_kernel"}
_DEFAULT_CFG = {
    "wy_BK": 64, "wy_warps": 4, "wy_stages": 3, "wy_prec": "ieee", "wy_fuse": 0,
    "wu_BK": 64, "wu_BV": 64, "wu_warps": 8, "wu_stages": 3,
    "state_BV": 32, "state_warps": 8, "state_stages": 2,
    "seg_units": 0, "seg_below": 16, "seg_min": 16, "seg_BV": 64, "seg_warps": 4, "seg_stages": 2,
    "out_BK": 64, "out_BV": 64, "out_warps": 8, "out_stages": 2, "out_fuse": 0, "out_early": 0,
    "dvl_BK": 64, "dvl_BV": 64, "dvl_warps": 8, "dvl_stages": 2, "dvl_early": 0,
    "state_bwd_BV": 32, "state_bwd_warps": 8, "state_bwd_stages": 2,
    "grad_BV": 16, "grad_warps": 8, "grad_stages": 2, "grad_trans": 0, "grad_early": 0, "grad_late": 0,
    "wy_bwd_BK": 16, "wy_bwd_BV": 16, "wy_bwd_warps": 8, "wy_bwd_stages": 1, "wy_bwd_trans": 0, "wy_bwd_late": 0,
}
# wy_bwd_stages: before k kᵀ took kᵀ from its own load and the transposed dk term (wy_bwd_trans), dbeta and dg of the
# H200 differed bitwise from run to run with Triton 3.6's software pipelining (2 or 3 stages); with both, 2 and 3
# stages were identical over bench.determinism_gdn's shapes (session 9). Check it there before changing the stages.


def _mid_dtype(dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of Ainv and of the gradients passed between backward stages: bf16 for bf16 inputs (fp32's
    exponent range at half the bytes), fp32 otherwise (in fp16, decayed terms and small gradients underflow)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _cfg_key(K: int, V: int) -> dict:
    """The tables match the padded widths the kernels tile with: K = 192 runs [.., 256] state tiles, where the
    K = 128 entry's state passes would need 254-333 KB of shared memory."""
    return {"K": next_pow2(K), "V": next_pow2(V)}


def _cfg(K: int, V: int, device) -> dict:
    cfg = dict(_DEFAULT_CFG)
    cfg.update(select_config("gdn_chunk", _cfg_key(K, V), device=device) or {})
    unknown = sorted(set(cfg) - set(_DEFAULT_CFG))
    if unknown:
        raise ValueError(f"gdn_chunk config: unknown fields {unknown}; expected <kernel>_<field> from {sorted(_DEFAULT_CFG)}")
    if cfg["wy_prec"] not in ("ieee", "tf32", "tf32x3"):
        raise ValueError(f"gdn_chunk config: wy_prec must be 'ieee', 'tf32' or 'tf32x3', got {cfg['wy_prec']!r}")
    return cfg


def _opts(cfg: dict, kern: str) -> dict:
    return {"num_warps": cfg[f"{kern}_warps"], "num_stages": cfg[f"{kern}_stages"]}


class _VarlenPlan(NamedTuple):
    cu: list[int]  # host copy of cu_seqlens
    NTT: int  # chunk programs over all sequences
    cidx: torch.Tensor  # [NTT, 2] int32 (sequence, chunk within it)
    coff: torch.Tensor  # [N+1] int32 first chunk row of each sequence


_PLANS: OrderedDict[int, tuple[torch.Tensor, int, _VarlenPlan]] = OrderedDict()


def _varlen_plan(cu_seqlens: torch.Tensor, T: int) -> _VarlenPlan:
    """Validated host copy and chunk indices of ``cu_seqlens``. Reading it costs a host sync, so the plan is kept
    per tensor (the cache holds the tensor, so its id is not reused, and checks its version counter for in-place
    changes): a forward + backward, or all the layers of a model sharing one cu_seqlens, sync once."""
    try:
        version = cu_seqlens._version
    except RuntimeError:  # inference tensors have no version counter: never cached
        version = None
    hit = _PLANS.get(id(cu_seqlens))
    if version is not None and hit is not None and hit[0] is cu_seqlens and hit[1] == version:
        _PLANS.move_to_end(id(cu_seqlens))
        return hit[2]
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu[:-1], cu[1:], strict=True)):
        raise ValueError(f"cu_seqlens: must be non-decreasing from 0 to T={T}, got {cu}")
    pairs, offs = [], [0]
    for n in range(len(cu) - 1):
        c = cdiv(cu[n + 1] - cu[n], BT)
        pairs.extend((n, i) for i in range(c))
        offs.append(offs[-1] + c)
    dev = cu_seqlens.device
    plan = _VarlenPlan(cu, len(pairs), torch.tensor(pairs, dtype=torch.int32, device=dev).reshape(-1, 2),
                       torch.tensor(offs, dtype=torch.int32, device=dev))
    if version is not None:
        _PLANS[id(cu_seqlens)] = (cu_seqlens, version, plan)
        while len(_PLANS) > 8:
            _PLANS.popitem(last=False)
    return plan


def _chunks(cu_seqlens: torch.Tensor | None, B: int, T: int):
    """(num chunk programs, chunk index pairs [NT,2] int32 or None, chunk offsets [N+1] int32 or None, NT per seq)."""
    if cu_seqlens is None:
        nt = cdiv(T, BT)
        return B * nt, None, None, nt
    plan = _varlen_plan(cu_seqlens, T)
    return plan.NTT, plan.cidx, plan.coff, 0


def _state_bv(bv: int, V: int, programs: int, t: torch.Tensor, floor: int = 16) -> int:
    """Narrow the V block of the sequential state passes (not below ``floor``) while they would leave half the
    SMs idle."""
    info = device_info(t)
    bv = min(bv, next_pow2(V))
    if info.interpreter:
        return bv
    while bv > floor and cdiv(V, bv) * programs * 2 <= info.sm_count:
        bv //= 2
    return bv


def chunk_gdn_fwd(q, k, v, g, beta, scale: float, initial_state, cu_seqlens, *, keep_h: bool = False):
    """Launch the forward stages. Returns (o [B,T,HV,V] v.dtype, final [N,HV,K,V] fp32, gc fp32 [B,T,HV],
    Ainv [B,T,HV,BT] (_mid_dtype)), and with keep_h also the states the backward would recompute:
    ``_States(w [B,T,HV,K] k.dtype, h [_h_rows, HV, K, V] k.dtype, v_new [B,T,HV,V] v.dtype)``."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    cfg = _cfg(K, V, q.device)
    NTT, cidx, coff, NT = _chunks(cu_seqlens, B, T)
    NG = NTT if cu_seqlens is not None else NT  # chunk programs per (batch row, head): grid axis 0
    BKp = next_pow2(K)
    dummy = q  # stand-in pointer for absent optional tensors (never dereferenced)
    cu = cu_seqlens if cu_seqlens is not None else dummy
    cidx_ = cidx if cidx is not None else dummy
    coff_ = coff if coff is not None else dummy
    varlen = cu_seqlens is not None
    gc = _empty(B, T, HV, dtype=torch.float32, device=q.device)
    Ainv = _empty(B, T, HV, BT, dtype=_mid_dtype(k.dtype), device=q.device)
    w = _empty(B, T, HV, K, dtype=k.dtype, device=q.device)
    u = _empty(B, T, HV, V, dtype=v.dtype, device=q.device)
    if NTT > 0:
        fuse = bool(cfg["wy_fuse"])
        wu_tiles = dict(BK=min(cfg["wu_BK"], BKp), BV=min(cfg["wu_BV"], next_pow2(V)))
        gdn_wy_fwd_kernel[(NG, B * HV)](k, v, g, beta, gc, Ainv, w, u, cu, cidx_, T, H=H, HV=HV, K=K, V=V, BT=BT,
                                         BK=min(cfg["wy_BK"], BKp), BKW=wu_tiles["BK"], BVW=wu_tiles["BV"],
                                         PREC=cfg["wy_prec"], FUSE_WU=fuse, IS_VARLEN=varlen, **_opts(cfg, "wy"))
        if not fuse:
            gdn_wu_fwd_kernel[(NG, B * HV)](k, v, beta, gc, Ainv, w, u, cu, cidx_, T, H=H, HV=HV, K=K, V=V, BT=BT,
                                             IS_VARLEN=varlen, **wu_tiles, **_opts(cfg, "wu"))
    o = _empty(v.shape, dtype=v.dtype, device=v.device)
    fuse_out = bool(cfg["out_fuse"])
    h, vnew, ht, _ = chunk_gdn_state_fwd(k, w, u, gc, initial_state, cu_seqlens, cidx, coff, NTT, NT, N, cfg,
                                         out=(q, o, scale) if fuse_out else None, store_h=keep_h or not fuse_out,
                                         h_rows=_h_rows(B, T, N, varlen) if keep_h else None)
    if NTT > 0 and not fuse_out:
        BV = min(cfg["out_BV"], next_pow2(V))
        gdn_output_fwd_kernel[(cdiv(V, BV), NG, B * HV)](
            q, k, vnew, gc, h, o, cu, cidx_, coff_, scale, T, NT, H=H, HV=HV, K=K, V=V, BT=BT,
            BK=min(cfg["out_BK"], BKp), BV=BV, EARLY=bool(cfg["out_early"]), IS_VARLEN=varlen, **_opts(cfg, "out"))
    if keep_h:
        return o, ht, gc, Ainv, _States(w, h, vnew)
    return o, ht, gc, Ainv


class _States(NamedTuple):
    """What the forward's state pass leaves for the backward (``save_states``): w, h (one row per chunk; under
    varlen ``_h_rows`` rows, a bound known from shapes alone) and v_new."""
    w: torch.Tensor
    h: torch.Tensor
    vnew: torch.Tensor


def _h_rows(B: int, T: int, N: int, varlen: bool) -> int:
    """Rows of the chunk-state buffer h: B·ceil(T/BT), or under varlen the bound ceil(T/BT) + N on the number of
    chunks (so torch.compile's fake kernel knows the shape without reading cu_seqlens)."""
    return cdiv(T, BT) + N if varlen else B * cdiv(T, BT)


@functools.lru_cache(maxsize=32)
def _seg_plan(seq_cu: tuple[int, ...], L: int, device) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split each sequence (token bounds ``seq_cu``) into segments of L chunks: (number of segments, segment token
    bounds [S+1] int64, first chunk-state row of each segment [S] int32, first segment of each sequence [N+1]
    int32). Cached: the host-to-device copies happen once per shape."""
    cu, rows, soff = [0], [], [0]
    row = 0
    for a, b in zip(seq_cu[:-1], seq_cu[1:], strict=True):
        nc = cdiv(b - a, BT)
        for c in range(0, nc, L):
            rows.append(row + c)
            cu.append(min(a + (c + L) * BT, b))
        if nc == 0:
            rows.append(row)
            cu.append(b)
        row += nc
        soff.append(len(rows))
    t = functools.partial(torch.tensor, device=device)
    return len(rows), t(cu, dtype=torch.int64), t(rows, dtype=torch.int32), t(soff, dtype=torch.int32)


def _seg_len(cfg: dict, units: int, max_chunks: int) -> int:
    """Chunks per segment for sequence splitting, or 0 to keep one sequential program per sequence: split when the
    (sequence x value head) units are fewer than ``seg_below``, into about ``seg_units`` units in all, with
    segments of at least ``seg_min`` chunks."""
    if not cfg["seg_units"] or units >= cfg["seg_below"]:
        return 0
    L = max(cfg["seg_min"], cdiv(max_chunks, cdiv(cfg["seg_units"], units)))
    return L if L < max_chunks else 0


class _Split(NamedTuple):
    """Sequence splitting of the state passes: segments (as ``_seg_plan``) and their maps [M | b] (fp32)."""
    nseg: int
    cu: torch.Tensor
    coff: torch.Tensor
    soff: torch.Tensor
    mb: torch.Tensor


def _chain_segments(mb, rb, s_in, s_seg, s_out, soff, N, *, reverse: bool):
    """Walk each sequence's segment maps (``gdn_state_prefix_kernel``): s_seg [segments, HV, K, V] gets the state
    entering each segment, s_out [N, HV, K, V] the state leaving the sequence; s_in may be None (zeros)."""
    HV, K, V = mb.shape[1], mb.shape[2], mb.shape[3] - mb.shape[2]
    BV = min(32, next_pow2(V))  # 8 warps, BV 32: the tf32x3 dot on the [K, K] map does not spill
    gdn_state_prefix_kernel[(cdiv(V, BV), N * HV)](
        mb, rb if rb is not None else mb, s_in if s_in is not None else mb, s_seg, s_out, soff, HV, K=K, V=V,
        BK=next_pow2(K), BV=BV, USE_H0=s_in is not None, REVERSE=reverse, num_warps=8, num_stages=1)


def _segments(k, w, u, gc, cu_seqlens, N, V, cfg) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor,
                                                             torch.Tensor] | None:
    """Sequence splitting of the state passes, or None when ``_seg_len`` keeps one program per sequence:
    ``_seg_plan``'s (nseg, cu, coff, soff) and the segment maps mb ``[nseg, HV, K, K + V]`` fp32
    (``gdn_state_seg_kernel``). ``u`` None: only the M columns (all the backward's reverse chain reads)."""
    B, T, H, K = k.shape
    HV = w.shape[2]
    seq_cu = tuple(_varlen_plan(cu_seqlens, T).cu) if cu_seqlens is not None else tuple(range(0, (B + 1) * T, T))
    L = _seg_len(cfg, N * HV, max(cdiv(b - a, BT) for a, b in zip(seq_cu[:-1], seq_cu[1:], strict=True)))
    if not L:
        return None
    nseg, cu, co, soff = _seg_plan(seq_cu, L, k.device)
    BK = next_pow2(K)
    BVs = min(cfg["seg_BV"], BK)
    mb = _empty(nseg, HV, K, K + V, dtype=torch.float32, device=k.device)  # (b columns unwritten when u is None)
    gdn_state_seg_kernel[(BK // BVs + (cdiv(V, BVs) if u is not None else 0), nseg * HV)](
        k, w, u if u is not None else w, gc, mb, cu, co, H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BVs,
        **_opts(cfg, "seg"))
    return nseg, cu, co, soff, mb


def chunk_gdn_state_fwd(k, w, u, gc, initial_state, cu_seqlens, cidx, coff, NTT, NT, N, cfg, *, out=None,
                        store_h=True, h_rows=None):
    """State pass: h [NTT, HV, K, V] (input dtype), v_new [B,T,HV,V] (input dtype), final state fp32, and the
    ``_Split`` (or None) that the backward's reverse pass reuses. ``out = (q, o, scale)``: the pass also writes
    the output o (fused); h and v_new are None unless ``store_h``.
    Long sequences with few heads are split into segments (exactly: each segment's state map S -> M·S + b is
    computed in parallel, then chained; see ``gdn_state_seg_kernel``). ``h_rows``: rows of h if not NTT."""
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    h = _empty(h_rows or NTT, HV, K, V, dtype=k.dtype, device=k.device) if store_h else None
    vnew = _empty(u.shape, dtype=u.dtype, device=u.device) if store_h else None
    ht = _empty(N, HV, K, V, dtype=torch.float32, device=k.device)
    BK = next_pow2(K)
    dummy = k
    h0, cu, co, units, store_ht, varlen = initial_state, cu_seqlens, coff, N, True, cu_seqlens is not None
    split = None
    seg = _segments(k, w, u, gc, cu_seqlens, N, V, cfg)
    if seg is not None:
        nseg, cu, co, soff, mb = seg
        h0 = _empty(nseg, HV, K, V, dtype=torch.float32, device=k.device)
        _chain_segments(mb, None, initial_state, h0, ht, soff, N, reverse=False)
        units, store_ht, varlen = nseg, False, True
        split = _Split(nseg, cu, co, soff, mb)
    kern = "out" if out is not None else "state"  # the fused pass takes the (otherwise unused) output tiles
    BV = _state_bv(cfg[f"{kern}_BV"], V, units * HV, k)
    q, o, scale = out if out is not None else (dummy, dummy, 1.0)
    gdn_state_fwd_kernel[(cdiv(V, BV), units * HV)](
        k, w, u, gc, h if store_h else dummy, vnew if store_h else dummy, h0 if h0 is not None else dummy, ht,
        cu if cu is not None else dummy, co if co is not None else dummy, q, o, scale, T, NT, H=H, HV=HV, K=K, V=V,
        BT=BT, BK=BK, BV=BV, USE_H0=h0 is not None, STORE_HT=store_ht, STORE_H=store_h, FUSE_OUT=out is not None,
        IS_VARLEN=varlen, **_opts(cfg, kern))
    return h, vnew, ht, split


def chunk_gdn_bwd(q, k, v, g, beta, scale: float, initial_state, cu_seqlens, gc, Ainv, do, dht, states=None):
    """Backward launchers. Returns dq, dk [B,T,H,K], dv [B,T,HV,V], dg, dbeta [B,T,HV] (input dtypes) and
    dh0 [N,HV,K,V] fp32 (zeros if there was no initial_state). ``dht`` may be None. ``states``: the forward's
    ``_States``; None recomputes them (w, u, then the state pass)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    dev = q.device
    cfg = _cfg(K, V, dev)
    NTT, cidx, coff, NT = _chunks(cu_seqlens, B, T)
    NG = NTT if cu_seqlens is not None else NT
    BKp = next_pow2(K)
    BVp = next_pow2(V)
    dummy = q
    cu = cu_seqlens if cu_seqlens is not None else dummy
    cidx_ = cidx if cidx is not None else dummy
    coff_ = coff if coff is not None else dummy
    varlen = cu_seqlens is not None
    do = do.contiguous()
    if dht is not None:  # e.g. ht.sum().backward() passes an expanded (stride 0) gradient
        dht = dht.contiguous()
    dv = _empty(v.shape, dtype=v.dtype, device=dev)
    dg = _empty(g.shape, dtype=g.dtype, device=dev)
    dbeta = _empty(beta.shape, dtype=beta.dtype, device=dev)
    dh0 = _empty(N, HV, K, V, dtype=torch.float32, device=dev)
    if states is None:
        w = _empty(B, T, HV, K, dtype=k.dtype, device=dev)
        u = _empty(B, T, HV, V, dtype=v.dtype, device=dev)
        gdn_wu_fwd_kernel[(NG, B * HV)](k, v, beta, gc, Ainv, w, u, cu, cidx_, T, H=H, HV=HV, K=K, V=V, BT=BT,
                                         BK=min(cfg["wu_BK"], BKp), BV=min(cfg["wu_BV"], BVp), IS_VARLEN=varlen,
                                         **_opts(cfg, "wu"))
        h, vnew, _, split = chunk_gdn_state_fwd(k, w, u, gc, initial_state, cu_seqlens, cidx, coff, NTT, NT, N,
                                                cfg)
        del u
    else:
        w, h, vnew = states
        seg = _segments(k, w, None, gc, cu_seqlens, N, V, cfg)  # the reverse chain needs the maps' M part
        split = _Split(*seg) if seg is not None else None
    # gradients passed between stages (and dk's partial terms) are stored in _mid_dtype, the GVA sums in fp32
    dvl = _empty(B, T, HV, V, dtype=_mid_dtype(v.dtype), device=dev)
    BV = min(cfg["dvl_BV"], BVp)
    gdn_dv_local_kernel[(cdiv(V, BV), NG, B * HV)](
        q, k, gc, do, dvl, cu, cidx_, scale, T, H=H, HV=HV, K=K, V=V, BT=BT, BK=min(cfg["dvl_BK"], BKp), BV=BV,
        EARLY=bool(cfg["dvl_early"]), IS_VARLEN=varlen, **_opts(cfg, "dvl"))
    dhe = _empty(NTT, HV, K, V, dtype=k.dtype, device=dev)
    dvn = _empty(B, T, HV, V, dtype=_mid_dtype(v.dtype), device=dev)
    BV = _state_bv(cfg["state_bwd_BV"], V, (N if split is None else split.nseg) * HV, k)
    NVB = cdiv(V, BV)
    if split is None:
        gdn_state_bwd_kernel[(NVB, N * HV)](
            q, k, w, gc, do, dvl, dhe, dvn, dht if dht is not None else dummy, dh0, cu, coff_, scale, T, NT,
            H=H, HV=HV, K=K, V=V, BT=BT, BK=BKp, BV=BV, USE_DHT=dht is not None, STORE_DH0=True, STORE_STEPS=True,
            IS_VARLEN=varlen, **_opts(cfg, "state_bwd"))
    else:  # reversed sequence splitting: segment contributions from zero, chained by Mᵀ, then the pass per segment
        grid = (NVB, split.nseg * HV)
        r = _empty(split.nseg, HV, K, V, dtype=torch.float32, device=dev)
        gdn_state_bwd_kernel[grid](
            q, k, w, gc, do, dvl, dummy, dummy, dummy, r, split.cu, split.coff, scale, T, NT, H=H,
            HV=HV, K=K, V=V, BT=BT, BK=BKp, BV=BV, USE_DHT=False, STORE_DH0=True, STORE_STEPS=False,
            IS_VARLEN=True, **_opts(cfg, "state_bwd"))
        dse = _empty(split.nseg, HV, K, V, dtype=torch.float32, device=dev)
        _chain_segments(split.mb, r, dht, dse, dh0, split.soff, N, reverse=True)
        gdn_state_bwd_kernel[grid](
            q, k, w, gc, do, dvl, dhe, dvn, dse, dummy, split.cu, split.coff, scale, T, NT, H=H, HV=HV,
            K=K, V=V, BT=BT, BK=BKp, BV=BV, USE_DHT=True, STORE_DH0=False, STORE_STEPS=True,
            IS_VARLEN=True, **_opts(cfg, "state_bwd"))
    del dvl
    dw = _empty(B, T, HV, K, dtype=_mid_dtype(k.dtype), device=dev)
    dgc = _empty(B, T, HV, dtype=torch.float32, device=dev)
    dkp = _empty(B, T, HV, K, dtype=_mid_dtype(k.dtype), device=dev)
    # GVA: the value heads of one q/k head pass an fp32 running sum of their dq / dk terms along (part), the last
    # one stores the total; cnt: two int32 per tile (chunk x q/k head), one set for dq and one for dk
    gsum = HV > H
    dq = _empty(B, T, H, K, dtype=q.dtype, device=dev)
    dk = _empty(B, T, H, K, dtype=k.dtype, device=dev)
    if gsum:
        part = _empty(B, T, H, K, dtype=torch.float32, device=dev)
        tiles = NG * B * H
        cnt = torch.zeros(2, 2 * tiles, dtype=torch.int32, device=dev)
    else:
        part, cnt = dummy, (dummy, dummy)
    gdn_grad_chunk_kernel[(NG, B * HV)](
        q, k, vnew, gc, h, dhe, initial_state if initial_state is not None else dummy,
        dht if dht is not None else dummy, do, dvn, dq, dkp, dw, dgc, cnt[0], part, cu, cidx_, coff_, scale, T, NT, H=H,
        HV=HV, K=K, V=V, BT=BT, BK=BKp, BV=min(cfg["grad_BV"], BVp), GSUM=gsum,
        TRANS_OUT=bool(cfg["grad_trans"]), EARLY=bool(cfg["grad_early"]),
        LATE_WAIT=bool(cfg["grad_late"]), USE_H0=initial_state is not None, USE_DHT=dht is not None,
        IS_VARLEN=varlen, **_opts(cfg, "grad"))
    gdn_wy_bwd_kernel[(NG, B * HV)](
        k, v, beta, gc, Ainv, dw, dvn, dkp, dk, dgc, dv, dbeta, dg, cnt[1], part, cu, cidx_, T, H=H, HV=HV, K=K, V=V,
        BT=BT, BK=min(cfg["wy_bwd_BK"], BKp), BV=min(cfg["wy_bwd_BV"], BVp), GSUM=gsum,
        TRANS_OUT=bool(cfg["wy_bwd_trans"]), LATE_WAIT=bool(cfg["wy_bwd_late"]), IS_VARLEN=varlen,
        **_opts(cfg, "wy_bwd"))
    return dq, dk, dv, dg, dbeta, dh0


# ----------------------------------------------------------------------------------- torch.library + autograd
def _fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, save_states):
    """chunk_gdn_fwd's outputs and the saved states flattened: (o, ht, gc, Ainv, w, h, vnew); without
    save_states the last three are empty tensors."""
    if not save_states:
        none = q.new_empty(0)
        return (*chunk_gdn_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens), none, none, none)
    *out, st = chunk_gdn_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, keep_h=True)
    return (*out, *st)


@torch.library.custom_op("gqla_triton::chunk_gated_delta_rule_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
            initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, save_states: bool
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                       torch.Tensor]:
    return _fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, save_states)


@_fwd_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, save_states):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    out = (v.new_empty(B, T, HV, V), q.new_empty(N, HV, K, V, dtype=torch.float32),
           q.new_empty(B, T, HV, dtype=torch.float32), q.new_empty(B, T, HV, BT, dtype=_mid_dtype(k.dtype)))
    if not save_states:
        return (*out, q.new_empty(0), q.new_empty(0), q.new_empty(0))
    return (*out, k.new_empty(B, T, HV, K), k.new_empty(_h_rows(B, T, N, cu_seqlens is not None), HV, K, V),
            v.new_empty(B, T, HV, V))


@torch.library.custom_op("gqla_triton::chunk_gated_delta_rule_bwd", mutates_args=())
def _bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
            initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, gc: torch.Tensor,
            Ainv: torch.Tensor, do: torch.Tensor, dht: torch.Tensor | None, w: torch.Tensor | None,
            h: torch.Tensor | None, vnew: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_launch(q, k, v, g, beta, scale, initial_state, cu_seqlens, gc, Ainv, do, dht, w, h, vnew)


@_bwd_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, gc, Ainv, do, dht, w, h, vnew):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), q.new_empty(N, HV, K, V, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, scale, initial_state, cu_seqlens, save_states = inputs
    _, _, gc, Ainv, w, h, vnew = output
    ctx.scale = scale
    ctx.has_h0 = initial_state is not None
    ctx.set_materialize_grads(False)  # unused outputs (final state, gc, Ainv, states) pass None, not zero tensors
    states = (w, h, vnew) if save_states else (None, None, None)
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, gc, Ainv, *states)


def _backward_with(bwd, ctx, do, dht):
    q, k, v, g, beta, initial_state, cu_seqlens, gc, Ainv, w, h, vnew = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    dq, dk, dv, dg, dbeta, dh0 = bwd(q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens, gc, Ainv, do, dht,
                                     w, h, vnew)
    return dq, dk, dv, dg, dbeta, None, (dh0 if ctx.has_h0 else None), None, None


def _backward(ctx, do, dht, *_unused):
    # the custom op's backward is traced by AOT autograd on fake tensors (where is_compiling() is False): it must
    # stay an opaque op
    return _backward_with(_bwd_op, ctx, do, dht)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _ChunkGDN(torch.autograd.Function):
    """Eager path: the same launchers and autograd formulas as the custom op, without torch.library's dispatch
    (tens of microseconds per call, which set the pace of small forwards such as G3). torch.compile traces the
    custom op instead."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, cu_seqlens, save_states):
        out = _fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, save_states)
        _setup_context(ctx, (q, k, v, g, beta, scale, initial_state, cu_seqlens, save_states), out)
        ctx.mark_non_differentiable(*out[2:])
        return out

    @staticmethod
    def backward(ctx, do, dht, *_unused):
        return _backward_with(_bwd_launch, ctx, do, dht)


def _bwd_launch(q, k, v, g, beta, scale, initial_state, cu_seqlens, gc, Ainv, do, dht, w, h, vnew):
    states = _States(w, h, vnew) if w is not None else None
    return chunk_gdn_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, gc, Ainv, do, dht, states)


EAGER_FUNCTION = True  # False: eager calls also go through the custom op (bench.gdn_host compares the two)


# ------------------------------------------------------------------------------------------------ public op
def _l2norm(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, save_states=True):
    """Chunked gated delta rule (Triton forward + backward), drop-in for fla's / FlashQLA's function.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` with ``HV % H == 0`` (value head i uses q/k head
            ``i // (HV // H)``); all one dtype in (bfloat16, float16, float32); K, V multiples of 16, <= 256.
        g: ``[B, T, HV]`` log-space decay (<= 0), any float dtype; beta: ``[B, T, HV]`` in (0, 1).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` float32 or None (N = B, or the number of sequences with varlen).
        output_final_state: also return the final states ``[N, HV, K, V]`` float32.
        use_qk_l2norm_in_kernel: normalise q and k over K first (``x·rsqrt(Σx² + 1e-6)``, differentiable).
        cu_seqlens: ``[N+1]`` int32/int64 cumulative sequence starts (varlen; then B must be 1).
        save_states: when a gradient is needed, keep the forward's per-chunk states for the backward: w
            ``[B,T,HV,K]``, h ``[chunks, HV, K, V]`` and v_new ``[B,T,HV,V]`` in the input dtype (about 4x v's size
            at K = V; h alone is 2x). False recomputes them in the backward as fla does (the w / u stage and the
            state pass run again). No effect without autograd.
    Returns:
        ``(o [B, T, HV, V] in v's dtype, final_state or None)``; differentiable in q, k, v, g, beta,
        initial_state. Math: ``S_t = e^(g_t)·S_{t−1}; S_t += beta_t·k_t (v_t − S_tᵀk_t)ᵀ; o_t = scale·S_tᵀq_t``.
    """
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    B, T, H, K = q.shape
    check_tensor("k", k, shape=(B, T, H, K), dtypes=FLOAT_DTYPES)
    check_tensor("v", v, shape=(B, T, None, None), dtypes=FLOAT_DTYPES)
    HV, V = v.shape[2], v.shape[3]
    check_tensor("g", g, shape=(B, T, HV), dtypes=(torch.float32, torch.bfloat16, torch.float16))
    check_tensor("beta", beta, shape=(B, T, HV), dtypes=(torch.float32, torch.bfloat16, torch.float16))
    check_same_dtype(q=q, k=k, v=v)
    dev = check_same_device(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens)
    if H == 0 or HV == 0 or HV % H != 0:
        raise ValueError(f"v: value heads HV={HV} must be a positive multiple of the q/k heads H={H}")
    for name, d in (("K (q/k head dim)", K), ("V (v head dim)", V)):
        if d <= 0 or d % 16 or d > 256:
            raise ValueError(f"{name}: expected a positive multiple of 16 and <= 256, got {d}")
    if T < 1 or B < 1:
        raise ValueError(f"q: expected B >= 1 and T >= 1, got shape {list(q.shape)}")
    N = B
    if cu_seqlens is not None:
        check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=(torch.int32, torch.int64))
        if B != 1:
            raise ValueError(f"cu_seqlens: varlen input needs B == 1, got B={B}")
        if cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens: expected at least 2 entries [0, ..., T]")
        if not torch.compiler.is_compiling():
            _varlen_plan(cu_seqlens, T)  # validates (cached per tensor; the launchers reuse the plan)
        N = cu_seqlens.numel() - 1
    if initial_state is not None:
        check_tensor("initial_state", initial_state, shape=(N, HV, K, V), dtypes=(torch.float32,))
    if scale is None:
        scale = K ** -0.5
    if not isinstance(save_states, bool):
        raise TypeError(f"save_states: expected a bool, got {type(save_states).__name__}")
    check_kernel_device(dev, "gqla_triton.ops.gdn.reference.chunk_gated_delta_rule_ref")
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.contiguous(), beta.contiguous()
    h0 = initial_state.contiguous() if initial_state is not None else None
    save = save_states and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, h0))
    fwd = _ChunkGDN.apply if EAGER_FUNCTION and not torch.compiler.is_compiling() else _fwd_op
    o, ht, *_ = fwd(q, k, v, g, beta, float(scale), h0, cu_seqlens, save)
    return o, (ht if output_final_state else None)
