"""Launchers of the chunked gated delta rule: the forward (``chunk_gdn_fwd``) and backward (``chunk_gdn_bwd``) stage
sequences, the state pass and the chaining of split sequences.

Forward: ``wy`` (gc, Ainv) -> ``wu`` (w, u) -> ``state`` (h, v_new, final state; long sequences split into segments:
``seg`` maps, chained, then ``state`` per segment) -> ``out`` (o). A forward that no backward follows may instead
run ``wy`` -> ``sout`` (``_fuse_out``): one pass forming w and u's products from Ainv, the state and o, with nothing
else through HBM (under sequence splitting ``wu`` and the segment maps still run first, and ``sout`` runs per
segment). Backward (after w, u, h, v_new are recomputed or taken from the forward): ``dvl`` -> ``state_bwd`` ->
``grad`` -> ``wy_bwd``. Every buffer a kernel fills comes from ``alloc.empty``. The launch parameters of stage
``<s>`` are the config fields ``<s>_*`` (``ChunkConfig``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...dispatch import DeviceInfo
from .._common.alloc import empty
from .._common.config import names_config
from .._common.host import MAX_GRID_Y, cdiv, next_pow2, on_device
from .._common.validation import aligned_start
from .config import WY_BWD_TILES, ChunkConfig
from .kernels.dv_local import gdn_dv_local_kernel
from .kernels.grad import gdn_grad_chunk_kernel
from .kernels.options import gdn_beta_in_kernel, gdn_options_bwd_kernel, gdn_options_sum_kernel
from .kernels.output import gdn_output_fwd_kernel
from .kernels.plan import gdn_pad_zero_kernel, gdn_rows_zero_kernel
from .kernels.seg import gdn_state_prefix_kernel, gdn_state_seg_kernel
from .kernels.state import gdn_state_fwd_kernel
from .kernels.state_bwd import gdn_state_bwd_kernel
from .kernels.state_out import gdn_state_out_kernel
from .kernels.state_out_sm90 import MAXNREG as SOUT_SM90_MAXNREG
from .kernels.state_out_sm90 import gdn_state_out_sm90_kernel
from .kernels.state_out_sm90_wide import MAXNREG as SOUT_SM90_WIDE_MAXNREG
from .kernels.state_out_sm90_wide import gdn_state_out_sm90_wide_kernel
from .kernels.wu import gdn_wu_fwd_kernel
from .kernels.wy import gdn_wy_fwd_kernel
from .kernels.wy_bwd import gdn_wy_bwd_kernel
from .plan import ChunkPlan

OPTIONS_BLOCK = 2048  # elements per program of the options' elementwise passes (options.py)
PAD_ROWS = 16  # rows per program of the padding rows' zeroing (kernels/plan.py)
H_ZERO_ROWS, H_ZERO_COLS = 4, 1024  # the [rows, columns] block per program of h's spare rows' zeroing

__all__ = ["States", "chunk_gdn_fwd", "chunk_gdn_bwd", "chunk_gdn_state_fwd", "h_rows", "mid_dtype"]


class States(NamedTuple):
    """What the forward's state pass leaves for the backward (``save_states``): w ``[B, T, HV, K]``, h
    ``[h_rows, HV, K, V]`` (one row per chunk) and v_new ``[B, T, HV, V]``, in the input dtypes."""

    w: torch.Tensor
    h: torch.Tensor
    vnew: torch.Tensor


class _Split(NamedTuple):
    """Sequence splitting of one state pass: the plan's segments and their maps mb ``[nseg, HV, K, K + V]`` fp32."""

    nseg: int
    cu: torch.Tensor
    coff: torch.Tensor
    soff: torch.Tensor
    mb: torch.Tensor


def mid_dtype(dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of Ainv and of the gradients passed between backward stages: bf16 for bf16 inputs (fp32's
    exponent range at half the bytes), fp32 otherwise (in fp16, decayed terms and small gradients underflow)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def tile(d: int) -> int:
    """Tile width covering a head dim ``d`` (any size; masked past ``d``): a power of two, at least 16 (tl.dot's
    smallest dimension on the GPU)."""
    return max(16, next_pow2(d))


def h_rows(B: int, T: int, N: int, varlen: bool, BT: int) -> int:
    """Rows of the saved chunk-state buffer h: B·ceil(T/BT), or under varlen the bound ceil(T/BT) + N on the number
    of chunks (so torch.compile's fake kernel knows the shape without reading cu_seqlens)."""
    return cdiv(T, BT) + N if varlen else B * cdiv(T, BT)


def _state_bv(bv: int, V: int, programs: int, info: DeviceInfo, floor: int = 16) -> int:
    """Narrow the V block of the sequential state passes (not below ``floor``) while they would leave half the
    SMs of the device ``info`` idle."""
    bv = min(bv, tile(V))
    if info.interpreter:
        return bv
    while bv > floor and cdiv(V, bv) * programs * 2 <= info.sm_count:
        bv //= 2
    return bv


def _chain_segments(mb, rb, s_in, s_seg, s_out, soff, N, *, reverse: bool, state_indices=None, v_first=False):
    """Walk each sequence's segment maps (``gdn_state_prefix_kernel``): s_seg [segments, HV, K, V] gets the state
    entering each segment, s_out [N, HV, K, V] the state leaving the sequence; s_in may be None (zeros). With
    ``state_indices`` [N] int32, s_in and s_out are one state pool [P, HV, K, V], read and written at those rows.
    ``v_first``: s_in and s_out have [V, K] rows (s_seg keeps [K, V])."""
    HV, K, V = mb.shape[1], mb.shape[2], mb.shape[3] - mb.shape[2]
    BV = min(32, tile(V))  # 8 warps, BV 32: the tf32x3 dot on the [K, K] map does not spill
    pool = state_indices is not None
    with on_device(mb.device):
        gdn_state_prefix_kernel[(cdiv(V, BV), N * HV)](
            mb, rb if rb is not None else mb, s_in if s_in is not None else mb, s_seg, s_out, soff,
            state_indices if pool else soff, HV, s_out.shape[0] if pool else 0, K=K, V=V, BK=tile(K), BV=BV,
            USE_H0=s_in is not None, REVERSE=reverse, POOL=pool, V_FIRST=v_first, num_warps=8, num_stages=1)


def _segments(k, w, u, gc, V: int, plan: ChunkPlan, ainv: tuple | None = None) -> _Split | None:
    """The segment maps of the plan's sequence splitting (``gdn_state_seg_kernel``), or None without splitting.
    ``u`` None: only the M columns (all the backward's reverse chain reads; the b columns stay unwritten).
    ``ainv`` = (v, beta, Ainv, beta_sigmoid, neg_eigval): the maps formed from Ainv (w and u None: a forward
    without gradient)."""
    if plan.seg is None:
        return None
    cfg = plan.cfg
    B, T, H, K = k.shape
    HV = gc.shape[2]
    nseg, cu, co, soff, _ = plan.seg
    BK = tile(K)
    BVs = min(cfg.seg_bv, BK)
    mb = empty(nseg, HV, K, K + V, dtype=torch.float32, device=k.device)
    v, beta, Ainv, beta_sigmoid, neg_eigval = ainv if ainv is not None else (k, k, k, False, False)
    with on_device(k.device):
        gdn_state_seg_kernel[(BK // BVs + (cdiv(V, BVs) if u is not None or ainv is not None else 0), nseg * HV)](
            k, w if w is not None else k, u if u is not None else k, v, beta, Ainv, gc, mb, cu, co, H=H, HV=HV, K=K,
            V=V, BT=plan.BT, BK=BK, BV=BVs, FROM_AINV=ainv is not None, BETA_SIGMOID=beta_sigmoid,
            NEG_EIGVAL=neg_eigval, **cfg.launch("seg"))
    return _Split(nseg, cu, co, soff, mb)


class _Starts(NamedTuple):
    """Where the sequential programs of a forward state pass start (``_state_starts``): the start states h0 (or
    None: zeros), the final state ht, the programs' token bounds cu and first chunk-state rows coff (None: dense),
    how many (sequences or segments) there are, whether the pass stores ht, runs varlen, reads and writes the pool
    itself (``row_pool``) and has ``[V, K]`` state rows (``v_first``), and the ``_Split`` or None."""

    h0: torch.Tensor | None
    ht: torch.Tensor
    cu: torch.Tensor | None
    coff: torch.Tensor | None
    units: int
    store_ht: bool
    varlen: bool
    row_pool: bool
    v_first: bool
    split: _Split | None

    @property
    def pool_rows(self) -> int:
        """P, the state pool's rows, where the pass reads and writes the pool itself (else 0)."""
        return self.ht.shape[0] if self.row_pool else 0


def _seg_states(plan: ChunkPlan, nseg: int, HV: int, K: int, V: int, device) -> torch.Tensor:
    """The segments' start states (or, reversed, end-state gradients) ``[nseg, HV, K, V]`` fp32 that the chain
    fills for every real segment; zeros under a device-built plan, whose empty segments past the real ones the
    chain never reaches but their (chunkless) state programs still read."""
    if plan.empty_slots:
        return torch.zeros(nseg, HV, K, V, dtype=torch.float32, device=device)
    return empty(nseg, HV, K, V, dtype=torch.float32, device=device)


def _state_starts(k, w, u, gc, initial_state, plan: ChunkPlan, state_indices, v_first: bool, V: int,
                  HV: int, ainv: tuple | None = None) -> _Starts:
    """Without splitting, one program per sequence from initial_state (or the pool); with it, the segment maps
    (``_segments``; ``ainv`` as its) are chained (``_chain_segments``) into each segment's start state and the
    final state, and the programs run segments."""
    N, K = plan.N, k.shape[3]
    pool = state_indices is not None
    ht = initial_state if pool else empty(N, HV, *((V, K) if v_first else (K, V)), dtype=torch.float32,
                                          device=k.device)
    split = _segments(k, w, u, gc, V, plan, ainv)
    if split is None:
        return _Starts(initial_state, ht, plan.cu, plan.coff, N, True, plan.varlen, pool, v_first, None)
    h0 = _seg_states(plan, split.nseg, HV, K, V, k.device)
    _chain_segments(split.mb, None, initial_state, h0, ht, split.soff, N, reverse=False, state_indices=state_indices,
                    v_first=v_first)
    return _Starts(h0, ht, split.cu, split.coff, split.nseg, False, True, False, False, split)


def _starts_args(st: _Starts, state_indices, dummy) -> tuple:
    """The state kernels' pointer arguments (h0, ht, cu, coff, idx) of ``st``, with ``dummy`` for absent ones."""
    return (st.h0 if st.h0 is not None else dummy, st.ht, st.cu if st.cu is not None else dummy,
            st.coff if st.coff is not None else dummy, state_indices if st.row_pool else dummy)


def _starts_flags(st: _Starts) -> dict:
    """The state kernels' constexpr flags of ``st``."""
    return dict(USE_H0=st.h0 is not None, STORE_HT=st.store_ht, IS_VARLEN=st.varlen, POOL=st.row_pool,
                V_FIRST=st.v_first)


def chunk_gdn_state_fwd(k, w, u, gc, initial_state, plan: ChunkPlan, *, rows: int | None = None,
                        state_indices: torch.Tensor | None = None, v_first: bool = False):
    """State pass: h ``[rows or NTT, HV, K, V]`` (k's dtype), v_new ``[B, T, HV, V]`` (u's dtype), the final
    state ``[N, HV, K, V]`` fp32, and the ``_Split`` (or None) that the backward's reverse pass reuses. Long
    sequences with few heads are split into segments (exactly: each segment's state map S -> M·S + b is computed in
    parallel, then chained; see ``gdn_state_seg_kernel``). ``state_indices`` ``[N]`` int32: initial_state is a
    state pool ``[P, HV, K, V]`` contiguous, sequence n starts from row state_indices[n] and its final state is
    written back there in place (rows outside [0, P): a zero start, no write); the pool is returned as the final
    state. One program reads its slice of a row and later writes the same slice, so every read of a row comes
    before its write (unless two sequences share a row). initial_state (or the pool) is fp32, bf16 or fp16;
    ``v_first``: it and the final state have ``[V, K]`` rows."""
    cfg = plan.cfg
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    h = empty(rows or plan.NTT, HV, K, V, dtype=k.dtype, device=k.device)
    vnew = empty(u.shape, dtype=u.dtype, device=u.device)
    dummy = k  # stand-in pointer for absent optional tensors (never dereferenced)
    st = _state_starts(k, w, u, gc, initial_state, plan, state_indices, v_first, V, HV)
    BV = _state_bv(cfg.state_bv, V, st.units * HV, plan.gpu)
    with on_device(k.device):
        gdn_state_fwd_kernel[(cdiv(V, BV) * st.units * HV,)](
            k, w, u, gc, h, vnew, *_starts_args(st, state_indices, dummy), T, plan.NT,
            st.pool_rows, H=H, HV=HV, K=K, V=V, BT=plan.BT, BK=tile(K), BV=BV,
            **_starts_flags(st), **cfg.launch("state"))
    return h, vnew, st.ht, st.split


def sout_sm90_unsupported(info: DeviceInfo, BT: int, q, k, v) -> str | None:
    """Why ``sout`` cannot run the sm_90 Gluon kernel (``kernels/state_out_sm90.py``) on device ``info`` in chunks
    of ``BT`` over these (contiguous) inputs (None when it can). Ainv is ``mid_dtype(k.dtype)``, bf16 with bf16
    inputs, and allocated here, so aligned."""
    if info.interpreter or info.capability != (9, 0):
        return f"device capability {info.capability} (sm_90 only)"
    if BT != 64:
        return f"chunk_size {BT} (64 only)"
    if k.shape[3] != 128:
        return f"K {k.shape[3]} (128 only)"
    if v.shape[3] % 32:
        return f"V {v.shape[3]} (a multiple of 32 only)"
    if not (q.dtype == k.dtype == v.dtype == torch.bfloat16):
        return f"dtypes q {q.dtype}, k {k.dtype}, v {v.dtype} (bf16 only)"
    if max(k.shape[2] * k.shape[3], v.shape[2] * v.shape[3], v.shape[2] * BT) * BT >= 2**31:
        return "H·K, HV·V or HV·64 times 64 rows at least 2^31 (its offsets within a chunk are int32)"
    if not all(aligned_start(t) for t in (q, k, v)):
        return "q, k or v not 16-byte aligned (cp.async copies 16 bytes)"
    return None


def use_sout_sm90(plan: ChunkPlan, q, k, v) -> bool:
    """Whether a fused forward (``sout``) runs the Gluon kernel: the table's ``sout_impl: "gluon"``, at least
    ``sout_gluon_units`` (chunk x value head) units, at most 65535 (sequence or segment x value head) programs (its
    grid's second axis), and inputs it takes (``sout_sm90_unsupported``). Split sequences run it per segment from
    the chained start states (``_state_out``)."""
    cfg = plan.cfg
    units = plan.seg.nseg if plan.seg is not None else plan.N
    return (cfg.sout_impl == "gluon" and plan.NTT * v.shape[2] >= cfg.sout_gluon_units
            and units * v.shape[2] <= MAX_GRID_Y and sout_sm90_unsupported(plan.gpu, plan.BT, q, k, v) is None)


def _sout_bv(plan: ChunkPlan, V: int, programs: int, sm90: bool) -> int:
    """V block of ``sout``: ``_state_bv`` of the config's (``sout_bv``, or ``sout_gluon_bv`` for the Gluon kernels,
    whose blocks are 32, 64 or 128 and divide V)."""
    if not sm90:
        return _state_bv(plan.cfg.sout_bv, V, programs, plan.gpu)
    bv = _state_bv(plan.cfg.sout_gluon_bv, V, programs, plan.gpu, floor=32)
    while bv > 32 and V % bv:
        bv //= 2
    return max(bv, 32)


def _sout_sm90_kernel(cfg: ChunkConfig, BV: int):
    """The Gluon ``sout`` kernel of V block ``BV`` and its launch's register cap: the split-chain kernel at blocks of at
    least ``sout_gluon_split`` (when set), else the single-chain one."""
    if cfg.sout_gluon_split and BV >= cfg.sout_gluon_split:
        return gdn_state_out_sm90_wide_kernel, SOUT_SM90_WIDE_MAXNREG
    return gdn_state_out_sm90_kernel, SOUT_SM90_MAXNREG


def _state_out(q, k, v, beta, gc, Ainv, o, scale: float, initial_state, plan: ChunkPlan, state_indices,
               v_first: bool, beta_sigmoid: bool, neg_eigval: bool, sm90: bool = False):
    """Stage ``sout`` (``gdn_state_out_kernel``, or with ``sm90`` the Gluon kernel): o ``[B, T, HV, V]`` (v's dtype,
    filled here) and the final state (as ``chunk_gdn_state_fwd``'s, with the same pool and ``v_first`` semantics) of
    a forward without gradient. Under sequence splitting the segment maps are formed from Ainv first (no w or u)."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    dummy = k
    st = _state_starts(k, None, None, gc, initial_state, plan, state_indices, v_first, V, HV,
                       ainv=(v, beta, Ainv, beta_sigmoid, neg_eigval))
    BV = _sout_bv(plan, V, st.units * HV, sm90)
    h0, ht, cu, coff, idx = _starts_args(st, state_indices, dummy)
    if sm90:
        kernel, maxnreg = _sout_sm90_kernel(plan.cfg, BV)
        with on_device(q.device):
            kernel[(V // BV, st.units * HV)](
                q, k, v, beta, gc, Ainv, o, h0, ht, cu, idx, scale, T, st.pool_rows, H, HV, V=V, BV=BV,
                STAGES=getattr(plan.cfg, f"sout_gluon_stages_v{BV}"), **_starts_flags(st), BETA_SIGMOID=beta_sigmoid,
                NEG_EIGVAL=neg_eigval, num_warps=4, maxnreg=maxnreg)
    else:
        with on_device(q.device):
            gdn_state_out_kernel[(cdiv(V, BV) * st.units * HV,)](
                q, k, v, beta, gc, Ainv, o, h0, ht, cu, coff, idx, scale, T, plan.NT,
                st.pool_rows, H=H, HV=HV, K=K, V=V, BT=plan.BT, BK=tile(K), BV=BV,
                **_starts_flags(st), BETA_SIGMOID=beta_sigmoid, NEG_EIGVAL=neg_eigval, **plan.cfg.launch("sout"))
    return st.ht


def _fuse_out(plan: ChunkPlan, HV: int, V: int, sm90: bool = False) -> bool:
    """Whether a forward without gradient runs its state pass and output as ``sout`` (``_state_out``; config
    ``sout_chunks`` / ``sout_waves``): not with sout_chunks 0; always where ``sm90`` (the Gluon kernel runs it);
    else where no state program runs more than sout_chunks chunks and there are at most sout_waves programs per
    SM."""
    cfg = plan.cfg
    if not cfg.sout_chunks or plan.NTT == 0:
        return False
    if sm90:
        return True
    units, longest = (plan.N, plan.max_chunks) if plan.seg is None else (plan.seg.nseg, plan.seg.L)
    if longest > cfg.sout_chunks:
        return False
    info = plan.gpu
    programs = cdiv(V, _state_bv(cfg.sout_bv, V, units * HV, info)) * units * HV
    return info.interpreter or programs <= cfg.sout_waves * info.sm_count


def wu_tiles(cfg, K: int, V: int) -> tuple[int, int]:
    """(BK, BV) of the ``wu`` stage. Its V loop never takes narrower tiles than the K loop before it (both dots read
    the same Ainv tile): Triton 3.6 miscompiles that on sm_90 (shared-memory reads past the allocation, seen at
    K = 60, V = 20 with BK 64, BV 32), so a narrower V runs masked tiles as wide as BK."""
    BK = min(cfg.wu_bk, tile(K))
    return BK, max(min(cfg.wu_bv, tile(V)), BK)


def _wu(k, v, beta, gc, Ainv, plan: ChunkPlan, beta_sigmoid: bool = False, neg_eigval: bool = False):
    """w ``[B, T, HV, K]`` (k's dtype), u ``[B, T, HV, V]`` (v's dtype) and each chunk's non-finite inputs
    (``[B, NG, HV]`` int32 ``VBAD_*`` bits, for the output), the ``wu`` stage; ``beta_sigmoid`` /
    ``neg_eigval``: beta as ``chunk_gdn_fwd`` takes it (the backward passes beta as taken)."""
    cfg = plan.cfg
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    w = empty(B, T, HV, K, dtype=k.dtype, device=k.device)
    u = empty(B, T, HV, V, dtype=v.dtype, device=v.device)
    dummy = k
    BK, BV = wu_tiles(cfg, K, V)
    vbad = empty(B, plan.NG, HV, dtype=torch.int32, device=k.device)
    with on_device(k.device):
        gdn_wu_fwd_kernel[(plan.NG, B * HV)](
            k, v, beta, gc, Ainv, w, u, vbad, plan.cu if plan.varlen else dummy, plan.cidx if plan.varlen else dummy, T,
            H=H, HV=HV, K=K, V=V, BT=plan.BT, BK=BK, BV=BV, IS_VARLEN=plan.varlen, BETA_SIGMOID=beta_sigmoid,
            NEG_EIGVAL=neg_eigval, EMPTY_SLOTS=plan.empty_slots, **cfg.launch("wu"))
    return w, u, vbad


def _zero_padding(plan: ChunkPlan, *xs: torch.Tensor) -> None:
    """Zero the rows of the contiguous ``[1, T, ...]`` tensors xs (at most five) whose tokens belong to no sequence
    (outside [cu[0], cu[N]) of a varlen plan with ``padding``): rows no chunk program writes. Nothing for other
    plans."""
    if not plan.padding:
        return
    T = xs[0].shape[1]
    ws = [x.numel() // T if T else 0 for x in xs]
    with on_device(plan.cu.device):
        gdn_pad_zero_kernel[(cdiv(T, PAD_ROWS),)](
            plan.cu, plan.N, T, *xs, *(xs[0],) * (5 - len(xs)), *ws, *(0,) * (5 - len(xs)), NUM=len(xs), BR=PAD_ROWS,
            BW=min(256, tile(max(ws))))


def _pad_in_wy(plan: ChunkPlan, T: int) -> bool:
    """Whether ``wy`` zeroes the output's padding rows (a varlen plan with ``padding`` whose chunk programs are at
    least the BT-token blocks of T, as a device-built plan's always are), so no launch of its own does."""
    return plan.padding and plan.NTT > 0 and cdiv(T, plan.BT) <= plan.NG


def _pad_args(plan: ChunkPlan, o: torch.Tensor) -> dict:
    """``wy``'s arguments that zero o's padding rows (where ``_pad_in_wy``)."""
    V = o.shape[3]
    return dict(o=o, N=plan.N, V=V, PAD=True, BW=min(256, tile(V)))


def _gate_args(gate: tuple | None) -> dict:
    """The in-kernel gate's kernel arguments (none without it: the default specialisation)."""
    if gate is None:
        return {}
    A_log, dt_bias = gate
    return dict(a_log=A_log, dt_bias=dt_bias, GATE=True, HAS_BIAS=dt_bias is not None)


@names_config("gdn_chunk")
def chunk_gdn_fwd(q, k, v, g, beta, scale: float, initial_state, plan: ChunkPlan, *, keep_h: bool = False,
                  state_indices: torch.Tensor | None = None, v_first: bool = False, beta_sigmoid: bool = False,
                  neg_eigval: bool = False, gate: tuple | None = None, fuse: bool = True):
    """The forward stages on contiguous inputs (q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g, beta ``[B, T, HV]``,
    initial_state ``[N, HV, K, V]`` fp32 / bf16 / fp16 or None; ``v_first``: initial and final states
    ``[N, HV, V, K]``). Returns (o ``[B, T, HV, V]`` v's dtype, final state ``[N, HV, K, V]`` fp32, gc ``[B, T, HV]``
    fp32, Ainv ``[B, T, HV, BT]`` ``mid_dtype``), and with ``keep_h`` also the ``States`` the backward would otherwise
    recompute. ``state_indices``: initial_state is a state pool updated in place (``chunk_gdn_state_fwd``), returned
    in the final state's place. ``beta_sigmoid``: beta holds logits (sigmoid taken in the kernels); ``neg_eigval``:
    beta doubled (after the sigmoid). ``gate``: ``(A_log [HV], dt_bias [HV] or None)``: g is the raw gate input of
    fla's in-kernel gate. ``fuse``: a forward without gradient may run as ``wy`` then ``sout`` (``_fuse_out``);
    False where a backward follows."""
    cfg = plan.cfg
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BKp = tile(K)
    dummy = q
    cu = plan.cu if plan.varlen else dummy
    cidx = plan.cidx if plan.varlen else dummy
    coff = plan.coff if plan.varlen else dummy
    gc = empty(B, T, HV, dtype=torch.float32, device=q.device)
    Ainv = empty(B, T, HV, plan.BT, dtype=mid_dtype(k.dtype), device=q.device)
    o = empty(v.shape, dtype=v.dtype, device=v.device)
    pad_wy = _pad_in_wy(plan, T)  # wy also zeroes o's rows that no sequence owns
    if plan.NTT > 0:
        with on_device(k.device):
            gdn_wy_fwd_kernel[(plan.NG, B * HV)](
                k, g, beta, gc, Ainv, cu, cidx, T, H=H, HV=HV, K=K, BT=plan.BT, BK=min(cfg.wy_bk, BKp),
                PREC=cfg.wy_prec, IS_VARLEN=plan.varlen, BETA_SIGMOID=beta_sigmoid, NEG_EIGVAL=neg_eigval,
                **_gate_args(gate),
                EMPTY_SLOTS=plan.empty_slots, **(_pad_args(plan, o) if pad_wy else {}), **cfg.launch("wy"))
    if not pad_wy:
        _zero_padding(plan, o)
    if fuse and not keep_h:
        sm90 = use_sout_sm90(plan, q, k, v)
        if _fuse_out(plan, HV, V, sm90):
            ht = _state_out(q, k, v, beta, gc, Ainv, o, scale, initial_state, plan, state_indices, v_first,
                            beta_sigmoid, neg_eigval, sm90)
            return o, ht, gc, Ainv
    if plan.NTT > 0:
        w, u, vbad = _wu(k, v, beta, gc, Ainv, plan, beta_sigmoid, neg_eigval)
    else:
        w = empty(B, T, HV, K, dtype=k.dtype, device=q.device)
        u = empty(B, T, HV, V, dtype=v.dtype, device=q.device)
        vbad = dummy
    h, vnew, ht, _ = chunk_gdn_state_fwd(k, w, u, gc, initial_state, plan,
                                         rows=h_rows(B, T, plan.N, plan.varlen, plan.BT) if keep_h else None,
                                         state_indices=state_indices, v_first=v_first)
    if plan.NTT > 0:
        BV = min(cfg.out_bv, tile(V))
        with on_device(q.device):
            gdn_output_fwd_kernel[(cdiv(V, BV), plan.NG, B * HV)](
                q, k, vnew, gc, h, o, vbad, cu, cidx, coff, scale, T, plan.NT, H=H, HV=HV, K=K, V=V, BT=plan.BT,
                BK=min(cfg.out_bk, BKp), BV=BV, EARLY=cfg.out_early, IS_VARLEN=plan.varlen,
                EMPTY_SLOTS=plan.empty_slots, **cfg.launch("out"))
    if keep_h:
        if plan.varlen:  # h has a bound's rows (h_rows): the ones past the chunks hold zeros, not leftover memory
            rows, W = h.shape[0], h[0].numel()
            with on_device(h.device):
                gdn_rows_zero_kernel[(cdiv(W, H_ZERO_COLS), cdiv(rows, H_ZERO_ROWS))](
                    h, plan.coff[plan.N:], W, rows, BR=H_ZERO_ROWS, BW=H_ZERO_COLS, num_warps=4)
        return o, ht, gc, Ainv, States(w, h, vnew)
    return o, ht, gc, Ainv


@names_config("gdn_chunk")
def chunk_gdn_bwd(q, k, v, g, beta, scale: float, initial_state, plan: ChunkPlan, gc, Ainv, do, dht,
                  states: States | None = None, *, v_first: bool = False, beta_sigmoid: bool = False,
                  neg_eigval: bool = False, gate: tuple | None = None):
    """The backward stages (inputs as ``chunk_gdn_fwd``'s, its gc and Ainv, the output gradient do and the final
    state's dht ``[N, HV, K, V]`` or None). Returns dq, dk ``[B, T, H, K]``, dv ``[B, T, HV, V]``, dg, dbeta
    ``[B, T, HV]`` (input dtypes) and dh0 ``[N, HV, K, V]`` in initial_state's dtype (fp32 without one).
    ``states``: the forward's ``States``; None recomputes them (the wu stage, then the state pass). ``v_first``:
    initial_state, dht and dh0 have ``[V, K]`` rows. ``beta_sigmoid`` / ``neg_eigval``: as ``chunk_gdn_fwd``'s;
    dbeta is the gradient of the beta input (the logits). ``gate``: as ``chunk_gdn_fwd``'s; dg is then the gradient
    of the raw gate input, and two more results follow: dA_log and ddt_bias ``[HV]`` fp32 (ddt_bias None without
    dt_bias)."""
    cfg = plan.cfg
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N, NTT, NT, NG, varlen = plan.N, plan.NTT, plan.NT, plan.NG, plan.varlen
    dev = q.device
    BKp = tile(K)
    BVp = tile(V)
    dummy = q
    cu = plan.cu if varlen else dummy
    cidx = plan.cidx if varlen else dummy
    coff = plan.coff if varlen else dummy
    do = do.contiguous()
    if dht is not None:  # e.g. ht.sum().backward() passes an expanded (stride 0) gradient
        dht = dht.contiguous()
    dv = empty(v.shape, dtype=v.dtype, device=dev)
    dg = empty(g.shape, dtype=g.dtype, device=dev)
    dbeta = empty(beta.shape, dtype=beta.dtype, device=dev)
    # fla's options: the chunk kernels run on beta as taken (bt) and give the gradients of beta as taken and of the
    # decay in fp32 (dbt, dgl); gdn_options_bwd_kernel chains them on to the inputs at the end
    opt_beta = beta_sigmoid or neg_eigval
    bt = beta
    if opt_beta:
        bt = empty(B, T, HV, dtype=torch.float32, device=dev)
        n = bt.numel()
        with on_device(beta.device):
            gdn_beta_in_kernel[(cdiv(n, OPTIONS_BLOCK),)](beta, bt, n, BETA_SIGMOID=beta_sigmoid, NEG_EIGVAL=neg_eigval,
                                                          BLOCK=OPTIONS_BLOCK)
    dbt = empty(B, T, HV, dtype=torch.float32, device=dev) if opt_beta else dbeta
    dgl = empty(B, T, HV, dtype=torch.float32, device=dev) if gate is not None else dg
    dh0 = empty(N, HV, *((V, K) if v_first else (K, V)),
                dtype=initial_state.dtype if initial_state is not None else torch.float32, device=dev)
    if states is None:
        w, u, _ = _wu(k, v, bt, gc, Ainv, plan)
        h, vnew, _, split = chunk_gdn_state_fwd(k, w, u, gc, initial_state, plan, v_first=v_first)
        del u
    else:
        w, h, vnew = states
        split = _segments(k, w, None, gc, V, plan)  # the reverse chain needs the maps' M part
    # gradients passed between stages (and dk's partial terms) are stored in mid_dtype, the GVA sums in fp32
    dvl = empty(B, T, HV, V, dtype=mid_dtype(v.dtype), device=dev)
    BV = min(cfg.dvl_bv, BVp)
    with on_device(q.device):
        gdn_dv_local_kernel[(cdiv(V, BV), NG, B * HV)](
            q, k, gc, do, dvl, cu, cidx, scale, T, H=H, HV=HV, K=K, V=V, BT=plan.BT, BK=min(cfg.dvl_bk, BKp), BV=BV,
            EARLY=cfg.dvl_early, IS_VARLEN=varlen, EMPTY_SLOTS=plan.empty_slots, **cfg.launch("dvl"))
    dhe = empty(NTT, HV, K, V, dtype=k.dtype, device=dev)
    dvn = empty(B, T, HV, V, dtype=mid_dtype(v.dtype), device=dev)
    BV = _state_bv(cfg.state_bwd_bv, V, (N if split is None else split.nseg) * HV, plan.gpu)
    NVB = cdiv(V, BV)
    if split is None:
        with on_device(q.device):
            gdn_state_bwd_kernel[(NVB * N * HV,)](
                q, k, w, gc, do, dvl, dhe, dvn, dht if dht is not None else dummy, dh0, cu, coff, scale, T, NT,
                H=H, HV=HV, K=K, V=V, BT=plan.BT, BK=BKp, BV=BV, USE_DHT=dht is not None, STORE_DH0=True,
                STORE_STEPS=True, IS_VARLEN=varlen, V_FIRST=v_first, **cfg.launch("state_bwd"))
    else:  # reversed sequence splitting: segment contributions from zero, chained by Mᵀ, then the pass per segment
        grid = (NVB * split.nseg * HV,)
        r = empty(split.nseg, HV, K, V, dtype=torch.float32, device=dev)
        with on_device(q.device):
            gdn_state_bwd_kernel[grid](
                q, k, w, gc, do, dvl, dummy, dummy, dummy, r, split.cu, split.coff, scale, T, NT, H=H,
                HV=HV, K=K, V=V, BT=plan.BT, BK=BKp, BV=BV, USE_DHT=False, STORE_DH0=True, STORE_STEPS=False,
                IS_VARLEN=True, **cfg.launch("state_bwd"))
        dse = _seg_states(plan, split.nseg, HV, K, V, dev)
        _chain_segments(split.mb, r, dht, dse, dh0, split.soff, N, reverse=True, v_first=v_first)
        with on_device(q.device):
            gdn_state_bwd_kernel[grid](
                q, k, w, gc, do, dvl, dhe, dvn, dse, dummy, split.cu, split.coff, scale, T, NT, H=H, HV=HV,
                K=K, V=V, BT=plan.BT, BK=BKp, BV=BV, USE_DHT=True, STORE_DH0=False, STORE_STEPS=True,
                IS_VARLEN=True, **cfg.launch("state_bwd"))
    del dvl
    dw = empty(B, T, HV, K, dtype=mid_dtype(k.dtype), device=dev)
    dgc = empty(B, T, HV, dtype=torch.float32, device=dev)
    dkp = empty(B, T, HV, K, dtype=mid_dtype(k.dtype), device=dev)
    # GVA: the value heads of one q/k head add their dq / dk terms through part (fp32): two pass a running sum along,
    # more store one slot each that the last to arrive adds in head order (kernels/gva.py); cnt: two int32 per tile
    # (chunk x q/k head), one set for dq and one for dk
    gsum = HV > H
    slots = HV > 2 * H
    dq = empty(B, T, H, K, dtype=q.dtype, device=dev)
    dk = empty(B, T, H, K, dtype=k.dtype, device=dev)
    if gsum:
        part = empty(B, T, HV if slots else H, K, dtype=torch.float32, device=dev)
        cnt = empty(2, 2 * NG * B * H, dtype=torch.int32, device=dev).zero_()
    else:
        part, cnt = dummy, (dummy, dummy)
    with on_device(q.device):
        gdn_grad_chunk_kernel[(NG, B * HV)](
            q, k, vnew, gc, h, dhe, initial_state if initial_state is not None else dummy,
            dht if dht is not None else dummy, do, dvn, dq, dkp, dw, dgc, cnt[0], part, cu, cidx, coff, scale, T, NT,
            H=H, HV=HV, K=K, V=V, BT=plan.BT, BK=BKp, BV=min(cfg.grad_bv, BVp), GSUM=gsum, TRANS_OUT=cfg.grad_trans,
            EARLY=cfg.grad_early, LATE_WAIT=cfg.grad_late, USE_H0=initial_state is not None, USE_DHT=dht is not None,
            IS_VARLEN=varlen, V_FIRST=v_first, SLOTS=slots, EMPTY_SLOTS=plan.empty_slots, **cfg.launch("grad"))
    with on_device(k.device):
        gdn_wy_bwd_kernel[(NG, B * HV)](
            k, v, bt, gc, Ainv, dw, dvn, dkp, dk, dgc, dv, dbt, dgl, cnt[1], part, cu, cidx, T, H=H, HV=HV, K=K, V=V,
            BT=plan.BT, BK=max(WY_BWD_TILES[0], min(cfg.wy_bwd_bk, BKp)),
            BV=max(WY_BWD_TILES[0], min(cfg.wy_bwd_bv, BVp)),
            GSUM=gsum, TRANS_OUT=cfg.wy_bwd_trans, LATE_WAIT=cfg.wy_bwd_late, IS_VARLEN=varlen, SLOTS=slots,
            EMPTY_SLOTS=plan.empty_slots, NO_H0=initial_state is None, **cfg.launch("wy_bwd"))
    _zero_padding(plan, dq, dk, dv, *((dg,) if gate is None else ()), *(() if opt_beta else (dbeta,)))
    if not opt_beta and gate is None:
        return dq, dk, dv, dg, dbeta, dh0
    R = B * T
    BH = max(2, next_pow2(HV))
    BR = max(1, OPTIONS_BLOCK // BH)
    nprog = cdiv(R, BR)
    par = empty(2, HV, nprog, dtype=torch.float32, device=dev) if gate is not None else dummy
    with on_device(beta.device):
        gdn_options_bwd_kernel[(nprog,)](
            beta, dbt, dbeta, g, dgl, dg, gate[0] if gate is not None else dummy,
            gate[1] if gate is not None and gate[1] is not None else dummy, par, cu, R, HV, N, BETA=opt_beta,
            BETA_SIGMOID=beta_sigmoid, NEG_EIGVAL=neg_eigval, GATE=gate is not None,
            HAS_BIAS=gate is not None and gate[1] is not None, BR=BR, BH=BH, PADDING=plan.padding)
    if gate is None:
        return dq, dk, dv, dg, dbeta, dh0
    has_bias = gate[1] is not None
    da_log = empty(HV, dtype=torch.float32, device=dev)
    ddt = empty(HV, dtype=torch.float32, device=dev) if has_bias else None
    with on_device(par.device):
        gdn_options_sum_kernel[(HV, 2 if has_bias else 1)](par, da_log, ddt if has_bias else da_log, HV, nprog,
                                                           BLOCK=min(1024, max(16, next_pow2(nprog))))
    return dq, dk, dv, dg, dbeta, dh0, da_log, ddt
