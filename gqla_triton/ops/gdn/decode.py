"""Recurrent Gated DeltaNet decode step over a pooled state (fp32, bf16 or fp16; ``[K, V]`` or ``[V, K]`` rows),
updated in place.

Per value head, for each of the ``s`` new tokens in order (state ``S`` is ``[K, V]`` fp32)::

    S = exp(g_t) * S
    S = S + beta_t * k_t (v_t - S^T k_t)^T
    o_t = scale * S^T q_t

One program owns one (sequence, value head, BV-wide slice of V): it loads its ``K x BV`` state slice,
runs the sequence's tokens in registers and writes the slice back (one load and one store per state element), so
the step is bound by the 2 x state bytes it must move. Options, each a compile-time specialisation that is off by
default: ragged sequences packed along one token axis (``cu_seqlens``), the state after every token stored
(``intermediate_states``), only the state after the first ``accepted`` tokens committed (``accepted``:
speculative verification), fla's in-kernel gate ``g = -exp(A_log)·softplus(a + dt_bias)``, in-kernel
``beta = sigmoid(b)``, beta doubled (``allow_neg_eigval``), V-first ``[V, K]`` state rows, and fla's recurrent
options: per-key / per-value decays (``gk``, ``gv``) and one beta per value channel. Forward only (inference);
training uses ``chunk_gated_delta_rule``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...dispatch import select_config
from .._common.alloc import empty
from .._common.boundary import route
from .._common.config import names_config
from .._common.host import MAX_GRID_X, cdiv, next_pow2, on_device
from .._common.impl import check_impl
from .._common.memo import CheckedCalls, call_key
from .._common.validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_bools,
    check_contiguous,
    check_disjoint,
    check_flag,
    check_kernel_device,
    check_pool_rows,
    check_scale,
    check_tensor,
    contiguous,
    inference_writes,
    refuse_grad,
)
from .compat import check_fla_options, check_gate, decode_state_v_first
from .config import DecodeConfig
from .kernels.common import _softplus, v_block_unit
from .plan import host_cu_seqlens
from .reference import gate_ref, recurrent_gated_delta_rule_ref

__all__ = ["gated_delta_rule_decode", "gated_delta_rule_decode_fwd", "check_launch", "launch_plan"]

_REFERENCE = "gqla_triton.ops.gdn.reference.recurrent_gated_delta_rule_ref"
_CU_DTYPES = (torch.int32, torch.int64)


@triton.jit(do_not_specialize=["S", "P", "N"])
def gated_delta_rule_decode_fwd_kernel(
    q, k, v, g, beta, o, state, idx, cu, acc, inter,
    scale, S, P, N,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
    VARLEN: tl.constexpr, ACCEPT: tl.constexpr, INTER: tl.constexpr,
    a_log=None, dt_bias=None, gk=None, gv=None,
    GATE: tl.constexpr = False, BETA_SIGMOID: tl.constexpr = False, NEG_EIGVAL: tl.constexpr = False,
    V_FIRST: tl.constexpr = False, BETA_V: tl.constexpr = False, CU_BLOCK: tl.constexpr = 256,
):
    # S: tokens per sequence (VARLEN: the packed token count T); N: sequences (VARLEN only)
    # GATE: g holds the raw gate input a, g = -exp(a_log) * softplus(a + dt_bias); BETA_SIGMOID: beta holds logits;
    # NEG_EIGVAL: beta doubled; V_FIRST: state (and inter) rows laid out [V, K]; gk / gv: per-key / per-value
    # decays [.., HV, K] / [.., HV, V]; BETA_V: one beta per value channel [.., HV, V]
    i_v, i_bh = v_block_unit(V, BV)  # a one-axis grid, V blocks fastest (no 65535 limit on N x HV)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V

    if VARLEN:
        # clamped to [0, T] and made non-decreasing (each bound the running maximum of those before it, as the
        # chunked op's plan takes them): no cu_seqlens value can move an access outside the tensors or give two
        # sequences one token; in int64, as every token index below (T and the products of a token and HV may
        # pass 2**31)
        bos = tl.minimum(tl.maximum(tl.load(cu).to(tl.int64), 0), S)
        for j0 in range(1, i_b + 1, CU_BLOCK):
            jj = j0 + tl.arange(0, CU_BLOCK)
            bos = tl.maximum(bos, tl.minimum(tl.max(tl.load(cu + jj, mask=jj <= i_b, other=0).to(tl.int64)), S))
        eos = tl.minimum(tl.maximum(tl.load(cu + i_b + 1).to(tl.int64), bos), S)
        n_tok = eos - bos
        tok0 = bos
    else:
        n_tok = S
        tok0 = i_b.to(tl.int64) * S

    # negative or out-of-pool rows are skipped: the K bound of every state access becomes 0 for them
    row = tl.load(idx + i_b).to(tl.int64)
    live = (row >= 0) & (row < P)
    if VARLEN:
        live = live & (n_tok > 0)
    row = tl.where(live, row, 0)
    k_end = tl.where(live, K, 0)
    m_s = (o_k < k_end)[:, None] & m_v[None, :]

    if ACCEPT:
        n_acc = tl.minimum(tl.maximum(tl.load(acc + i_b), 0), n_tok)

    if V_FIRST:
        p_s = state + (row * HV + i_hv) * (K * V) + o_v[None, :] * K + o_k[:, None]
    else:
        p_s = state + (row * HV + i_hv) * (K * V) + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
    if GATE:
        b_na = -tl.exp(tl.load(a_log + i_hv).to(tl.float32))
        if dt_bias is not None:
            b_dtb = tl.load(dt_bias + i_hv).to(tl.float32)

    for t in range(n_tok):
        tok = tok0 + t
        b_q = tl.load(q + (tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + (tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (tok * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + tok * HV + i_hv).to(tl.float32)
        if BETA_V:
            b_beta = tl.load(beta + (tok * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        else:
            b_beta = tl.load(beta + tok * HV + i_hv).to(tl.float32)
        if GATE:
            if dt_bias is not None:
                b_g = b_g + b_dtb
            b_g = b_na * _softplus(b_g)
        if BETA_SIGMOID:
            b_beta = tl.sigmoid(b_beta)
        if NEG_EIGVAL:
            b_beta = b_beta * 2.0
        if L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        b_s = b_s * tl.exp(b_g)
        if gk is not None:
            b_s = b_s * tl.exp(tl.load(gk + (tok * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32))[:, None]
        if gv is not None:
            b_s = b_s * tl.exp(tl.load(gv + (tok * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32))[None, :]
        b_u = (b_v - tl.sum(b_s * b_k[:, None], 0)) * b_beta
        b_s = b_s + b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_s * b_q[:, None], 0) * scale
        b_o = tl.where(live, b_o, 0.0)
        tl.store(o + (tok * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if INTER:
            if V_FIRST:
                tl.store(inter + (tok * HV + i_hv) * (K * V) + o_v[None, :] * K + o_k[:, None], b_s, mask=m_s)
            else:
                tl.store(inter + (tok * HV + i_hv) * (K * V) + o_k[:, None] * V + o_v[None, :], b_s, mask=m_s)
        if ACCEPT:
            if t + 1 == n_acc:
                tl.store(p_s, b_s.to(state.dtype.element_ty), mask=m_s)

    if not ACCEPT:
        tl.store(p_s, b_s.to(state.dtype.element_ty), mask=m_s)

    if VARLEN:
        # tokens before the first sequence or after the last belong to none: o = 0
        zero = tl.zeros([BV], dtype=o.dtype.element_ty)
        if i_b == 0:
            for t in range(bos):
                tl.store(o + (t * HV + i_hv) * V + o_v, zero, mask=m_v)
        if i_b == N - 1:
            for t in range(eos, S):
                tl.store(o + (t * HV + i_hv) * V + o_v, zero, mask=m_v)


def launch_plan(N: int, HV: int, K: int, V: int, device: torch.device,
                name: str = "cu_seqlens / v") -> tuple[DecodeConfig, int, tuple[int]]:
    """The step's launch for ``N`` sequences of ``HV`` value heads and head dims ``K``, ``V`` on ``device``: ``(config,
    BV, grid)``, one program per (sequence, value head, BV-wide V block) on the grid's first axis. A ``ValueError``
    naming ``name`` where they pass what one launch takes; a caller that changes state before the step (the layer's
    decode prep) asks first."""
    cfg = select_config("gdn_decode", {"K": K, "V": V}, device=device)
    BV = min(cfg.bv, next_pow2(V))
    grid = (cdiv(V, BV) * N * HV,)
    if grid[0] > MAX_GRID_X:
        raise ValueError(f"{name}: {N} sequences x {HV} value heads x {cdiv(V, BV)} V blocks make {grid[0]} "
                         f"programs, more than one launch takes ({MAX_GRID_X}); split the call")
    return cfg, BV, grid


def check_launch(N: int, HV: int, K: int, V: int, device: torch.device, name: str) -> None:
    """``launch_plan``'s refusal without its config lookup where the step fits for any config (``bv`` >= 16, so it
    runs at most ``ceil(V / 16)`` V blocks): for a caller that changes state before the step (the layer's decode
    prep), which asks first."""
    if N * HV * cdiv(V, 16) > MAX_GRID_X:
        launch_plan(N, HV, K, V, device, name)


@names_config("gdn_decode")
def gated_delta_rule_decode_fwd(q, k, v, g, beta, state, state_indices, scale: float,
                                use_qk_l2norm_in_kernel: bool, cu_seqlens=None, accepted=None,
                                intermediate_states=None, *, A_log=None, dt_bias=None, use_gate_in_kernel=False,
                                use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                                v_first=False, gk=None, gv=None) -> torch.Tensor:
    """Launch the step on contiguous inputs (shapes as ``gated_delta_rule_decode``; state_indices ``[B]`` or ``[N]``
    int32; ``v_first``: state rows ``[HV, V, K]``; beta ``[B, s, HV]`` or ``[B, s, HV, V]``). Returns o ``[B, s, HV,
    V]`` in v's dtype; updates the state rows (and ``intermediate_states``) in place."""
    B, S, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    P = state.shape[0]
    varlen = cu_seqlens is not None
    N = cu_seqlens.shape[0] - 1 if varlen else B
    cfg, BV, grid = launch_plan(N, HV, K, V, q.device)
    o = empty(v.shape, dtype=v.dtype, device=v.device)
    BK = next_pow2(K)
    gate = bool(use_gate_in_kernel)
    with on_device(q.device):
        gated_delta_rule_decode_fwd_kernel[grid](
            q, k, v, g, beta, o, state, state_indices,
            cu_seqlens if varlen else state_indices, accepted if accepted is not None else state_indices,
            intermediate_states if intermediate_states is not None else state,
            float(scale), S, P, N,
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, L2NORM=bool(use_qk_l2norm_in_kernel),
            VARLEN=varlen, ACCEPT=accepted is not None, INTER=intermediate_states is not None,
            a_log=A_log if gate else None, dt_bias=dt_bias if gate else None,
            GATE=gate, BETA_SIGMOID=bool(use_beta_sigmoid_in_kernel), NEG_EIGVAL=bool(allow_neg_eigval),
            V_FIRST=bool(v_first), gk=gk, gv=gv, BETA_V=beta.dim() == 4,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return o


def _check_cu_values(cu_seqlens: torch.Tensor | None, T: int) -> None:
    """A CPU ``cu_seqlens`` is checked (non-decreasing, within [0, T]); device values are not read (the kernel
    clamps them)."""
    if cu_seqlens is None or cu_seqlens.device.type != "cpu":
        return
    cu = cu_seqlens.tolist()
    if cu[0] < 0 or cu[-1] > T or any(b < a for a, b in zip(cu[:-1], cu[1:], strict=True)):
        raise ValueError(f"cu_seqlens: expected non-decreasing values within [0, T={T}], got {cu}")


@torch.library.custom_op("gqla_triton::gated_delta_rule_decode", mutates_args=("state", "intermediate_states"))
def _decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, state_indices: torch.Tensor, scale: float, use_qk_l2norm_in_kernel: bool,
               cu_seqlens: torch.Tensor | None, accepted: torch.Tensor | None,
               intermediate_states: torch.Tensor | None, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
               use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool,
               v_first: bool, gk: torch.Tensor | None = None, gv: torch.Tensor | None = None) -> torch.Tensor:
    # a direct torch.ops call reaches here unchecked: the public function's checks (of shapes, dtypes, devices and
    # options; kept per call as the public function keeps them), then what it cannot read while tracing (CPU index
    # values) and what it reads every call (addresses)
    layout = "vk" if v_first else "kv"
    key = call_key((q, k, v, g, beta, state, state_indices, cu_seqlens, accepted, intermediate_states, A_log, dt_bias,
                    gk, gv), (scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                              allow_neg_eigval, layout, "triton"))
    if _CHECKED.get(key) is None:
        _CHECKED.put(key, _check_step(q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm_in_kernel,
                                      cu_seqlens, None, accepted, intermediate_states, use_gate_in_kernel, A_log,
                                      dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, gk, gv, layout, "triton",
                                      {}))
    check_pool_rows("state_indices", state_indices, state.shape[0])
    _check_cu_values(cu_seqlens, q.shape[1])
    _check_written(state, intermediate_states)
    _check_overlap(state, intermediate_states, q=q, k=k, v=v, g=g, beta=beta, state_indices=state_indices,
                   cu_seqlens=cu_seqlens, accepted=accepted, A_log=A_log, dt_bias=dt_bias, gk=gk, gv=gv)
    q, k, v, g, beta, state_indices, cu_seqlens, accepted, A_log, dt_bias, gk, gv = contiguous(
        q, k, v, g, beta, state_indices, cu_seqlens, accepted, A_log, dt_bias, gk, gv)
    return gated_delta_rule_decode_fwd(q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm_in_kernel,
                                       cu_seqlens, accepted, intermediate_states, A_log=A_log, dt_bias=dt_bias,
                                       use_gate_in_kernel=use_gate_in_kernel,
                                       use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                                       allow_neg_eigval=allow_neg_eigval, v_first=v_first, gk=gk, gv=gv)


@_decode_op.register_fake
def _(q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm_in_kernel, cu_seqlens, accepted,
      intermediate_states, A_log, dt_bias, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
      v_first, gk=None, gv=None):
    _check_written(state, intermediate_states)
    return v.new_empty(v.shape)


def _check_written(state: torch.Tensor, intermediate_states: torch.Tensor | None) -> None:
    """What the op writes in place is contiguous (the kernel writes it without strides)."""
    check_contiguous("state", state)
    check_contiguous("intermediate_states", intermediate_states)


def _check_overlap(state: torch.Tensor, intermediate_states: torch.Tensor | None, **reads: torch.Tensor | None) -> None:
    """What the op writes in place shares no memory with what it reads (``ValueError``; addresses, every call)."""
    check_disjoint("state", state, **reads)
    check_disjoint("intermediate_states", intermediate_states, state=state, **reads)


def _decode_reference(q, k, v, g, beta, state, state_indices, scale, l2, cu_seqlens, accepted, inter, gk=None,
                      gv=None):
    """The step by ``recurrent_gated_delta_rule_ref``, one token at a time, with the kernel's conventions: rows
    outside [0, P) are skipped (o = 0, nothing written), the committed rows of ``state`` and the live rows of
    ``inter`` are updated in place. Reads the index tensors on the host."""
    B, S = q.shape[:2]
    o = torch.zeros_like(v)
    if inter is not None and cu_seqlens is not None:
        inter = inter[None]  # [1, T, HV, K, V]: indexed like o
    if cu_seqlens is not None:
        _check_cu_values(cu_seqlens.cpu(), S)
        cu = cu_seqlens.tolist()
        seqs = [(0, a, b) for a, b in zip(cu[:-1], cu[1:], strict=True)]
    else:
        seqs = [(b, 0, S) for b in range(B)]
    rows = state_indices.tolist()
    acc = accepted.tolist() if accepted is not None else None
    for n, (b, lo, hi) in enumerate(seqs):
        row = rows[n]
        if not 0 <= row < state.shape[0] or hi == lo:
            continue
        n_acc = min(max(acc[n], 0), hi - lo) if acc is not None else hi - lo
        h = state[row][None]
        for t in range(lo, hi):
            sl = slice(t, t + 1)
            one = [x[b:b + 1, sl] if x is not None else None for x in (q, k, v, g, beta, gk, gv)]
            ot, h = recurrent_gated_delta_rule_ref(*one[:5], scale=scale, initial_state=h, output_final_state=True,
                                                   use_qk_l2norm=l2, gk=one[5], gv=one[6])
            o[b, t] = ot[0, 0].to(o.dtype)
            if inter is not None:
                with inference_writes(inter):
                    inter[b, t] = h[0].to(inter.dtype)
            if t + 1 - lo == n_acc:
                with inference_writes(state):
                    state[row] = h[0].to(state.dtype)
    return o


def _decode_reference_options(q, k, v, g, beta, state, state_indices, scale, l2, cu_seqlens, accepted, inter, *,
                              A_log, dt_bias, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                              v_first, gk=None, gv=None):
    """``_decode_reference`` with the in-kernel options applied in torch first (the gate and beta in float64 if any
    input is float64, else float32) and a V-first pool read and written through its transpose."""
    ins = (q, k, v, g, beta, A_log, dt_bias)
    cdt = torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ins) else torch.float32
    if use_gate_in_kernel:
        g = gate_ref(g.to(cdt), A_log, dt_bias)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.to(cdt))
    if allow_neg_eigval:
        beta = beta.to(cdt) * 2
    if v_first:
        state = state.transpose(-1, -2)
        inter = inter.transpose(-1, -2) if inter is not None else None
    return _decode_reference(q, k, v, g, beta, state, state_indices, scale, l2, cu_seqlens, accepted, inter, gk, gv)


def sequence_count(cu_seqlens: torch.Tensor | None, B: int, device: torch.device) -> int:
    """The sequences N of a step over ``B`` batch rows: B, or with ``cu_seqlens`` (checked: ``[N+1]`` int32 / int64 on
    ``device``, N >= 1, B == 1) its N."""
    if cu_seqlens is None:
        return B
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=_CU_DTYPES, device=device)
    if B != 1:
        raise ValueError(f"cu_seqlens: packed sequences need B == 1, got B={B}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected [N+1] with N >= 1, got shape {list(cu_seqlens.shape)}")
    return cu_seqlens.numel() - 1


# gated_delta_rule_decode's checked calls (``_common.memo``)
_CHECKED = CheckedCalls()


def _check_step(q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu,
                accepted, intermediate_states, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
                allow_neg_eigval, gk, gv, state_layout, impl, fla_options) -> tuple[bool, bool, float, int]:
    """The checks of ``gated_delta_rule_decode`` that read the arguments' metadata and plain values (and the values
    of ``cu_seqlens_cpu``): (v_first, use_qk_l2norm_in_kernel, scale, sequences N)."""
    check_impl(impl, op="gated_delta_rule_decode", gluon=False)
    check_fla_options("gated_delta_rule_decode", fla_options)
    v_first = decode_state_v_first(state_layout, fla_options)
    check_bools(use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                allow_neg_eigval=allow_neg_eigval)
    use_qk_l2norm_in_kernel = check_flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    ref = impl == "reference"
    fdt = FLOAT_DTYPES + ((torch.float64,) if ref else ())
    check_tensor("q", q, ndim=4, dtypes=fdt)
    B, S, H, K = q.shape
    check_tensor("k", k, shape=(B, S, H, K), dtypes=(q.dtype,), device=q.device)
    check_tensor("v", v, ndim=4, dtypes=fdt, device=q.device)
    HV, V = v.shape[2], v.shape[3]
    check_tensor("v", v, shape=(B, S, HV, V))
    check_tensor("g", g, shape=(B, S, HV), dtypes=fdt, device=q.device)
    check_tensor("beta", beta, shape=(B, S, HV, V) if isinstance(beta, torch.Tensor) and beta.dim() == 4 else
                 (B, S, HV), dtypes=fdt, device=q.device)
    if gk is not None:
        check_tensor("gk", gk, shape=(B, S, HV, K), dtypes=fdt, device=q.device)
    if gv is not None:
        check_tensor("gv", gv, shape=(B, S, HV, V), dtypes=fdt, device=q.device)
    check_tensor("state", state, ndim=4, dtypes=fdt, device=q.device)
    if B == 0 or S == 0 or H == 0 or HV == 0 or K == 0 or V == 0:
        raise ValueError(f"q/v: expected non-empty B, s, heads and dims, got q {list(q.shape)}, v {list(v.shape)}")
    if HV % H != 0:
        raise ValueError(f"v: value heads HV={HV} must be a multiple of q/k heads H={H}")
    row_shape = (HV, V, K) if v_first else (HV, K, V)
    if tuple(state.shape[1:]) != row_shape:
        raise ValueError(f"state: expected shape [P, {', '.join(map(str, row_shape))}] (state_layout="
                         f"{'vk' if v_first else 'kv'!r}), got {list(state.shape)}")
    check_contiguous("state", state)
    if not ref and (K > 256 or V > 1024):
        raise ValueError(f"q/v: head dims K <= 256 and V <= 1024 supported by the kernel, got K={K}, V={V} "
                         "(impl='reference' takes any)")
    check_gate(use_gate_in_kernel, A_log, dt_bias, HV, q, reference=ref)
    N = sequence_count(cu_seqlens, B, q.device)
    if cu_seqlens_cpu is not None:
        host_cu_seqlens(cu_seqlens_cpu, cu_seqlens, S)
    if state_indices is None:
        if state.shape[0] < N:
            raise ValueError(f"state: pool has {state.shape[0]} rows, fewer than the {N} sequences "
                             "(pass state_indices)")
    else:
        check_tensor("state_indices", state_indices, shape=(N,), dtypes=INDEX_DTYPES, device=q.device)
    if accepted is not None:
        check_tensor("accepted", accepted, shape=(N,), dtypes=INDEX_DTYPES, device=q.device)
    if intermediate_states is not None:
        want = ((B, S) if cu_seqlens is None else (S,)) + row_shape
        idt = (torch.float32,) + ((torch.float64,) if ref else ())
        check_tensor("intermediate_states", intermediate_states, shape=want, dtypes=idt, device=q.device)
        check_contiguous("intermediate_states", intermediate_states)
    scale = check_scale("scale", scale, K**-0.5)
    refuse_grad("gated_delta_rule_decode", ", or use chunk_gated_delta_rule (differentiable in q, k, v, g, beta and "
                "initial_state) to train through the recurrence", q=q, k=k, v=v, g=g, beta=beta, state=state,
                intermediate_states=intermediate_states, A_log=A_log, dt_bias=dt_bias, gk=gk, gv=gv)
    if not ref:
        for dt in (q.dtype, v.dtype, state.dtype):
            check_kernel_device(q.device, _REFERENCE, dt)
    return v_first, use_qk_l2norm_in_kernel, scale, N


def gated_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu=None,
    accepted: torch.Tensor | None = None,
    intermediate_states: torch.Tensor | None = None,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    state_layout: str = "kv",
    impl: str = "auto",
    **fla_options,
) -> torch.Tensor:
    """Gated DeltaNet recurrent step for ``s >= 1`` new tokens per sequence; updates ``state`` in place.

    Args:
        q, k: ``[B, s, H, K]`` (bf16/fp16/fp32, one dtype), the ``s`` tokens of each sequence in order.
        v: ``[B, s, HV, V]``, bf16/fp16/fp32 (may differ from q's); ``HV % H == 0`` (value head ``i`` uses q/k head
            ``i // (HV // H)``).
        g: ``[B, s, HV]`` log-space decay (<= 0); with ``use_gate_in_kernel`` the raw gate input.
        beta: ``[B, s, HV]``; with ``use_beta_sigmoid_in_kernel`` logits. Or ``[B, s, HV, V]``: one
            beta per value channel (fla's recurrent option), scaling each column of the update. g, beta, gk and gv
            are each bf16/fp16/fp32, in dtypes of their own (float64 too with ``impl="reference"``).
        state: ``[P, HV, K, V]`` (``state_layout="vk"``: ``[P, HV, V, K]``) fp32, bf16 or fp16 contiguous pool; rows
            ``state_indices`` are read (to fp32) and written back (rounded to the pool's dtype) in place.
        state_indices: ``[B]`` int32 pool row of each sequence (``[N]`` with ``cu_seqlens``; default ``arange``, needs
            ``P`` >= that many rows). A negative index skips that sequence: its output is 0 and no state row (nor
            intermediate state) is touched. Each row may be named by one sequence only (two would update it in
            place at once). An index ``>= P`` or a row named twice raises ``ValueError`` when ``state_indices`` is on
            the CPU (checked without any device sync); on the GPU an index ``>= P`` is treated like a negative one,
            and a row named twice ends up holding one of the updates or a mix of them.
        scale: output scale, default ``K ** -0.5``.
        use_qk_l2norm_in_kernel: L2-normalise q and k per head (``x / sqrt(sum(x^2) + 1e-6)``) first.
        cu_seqlens: ``[N+1]`` int32/int64 (then ``B == 1``): the ``s = T`` tokens hold ``N`` sequences packed in order,
            sequence ``n`` owning tokens ``[cu[n], cu[n+1])`` (0 tokens allowed: its row is untouched). Never read on
            the host for a GPU tensor: the kernel clamps each bound to ``[0, T]`` and to the largest bound before it,
            so no value can cause an out-of-bounds access or give two sequences one token; a CPU tensor is checked (non-decreasing within ``[0, T]``,
            ``ValueError``). Tokens outside ``[cu[0], cu[N])`` belong to no sequence: o = 0.
        cu_seqlens_cpu: optional host copy of ``cu_seqlens`` (a CPU tensor or a sequence of ints, as fla's option
            of the same name). The step never reads ``cu_seqlens`` on the host, so it changes nothing; it is
            checked (``[N+1]``, non-decreasing within ``[0, T]``, equal to ``cu_seqlens`` where that is a CPU
            tensor; a GPU ``cu_seqlens`` is not read to compare).
        accepted: ``[B]`` (``[N]`` with ``cu_seqlens``) int32: commit to the pool only the state after each sequence's
            first ``accepted[b]`` tokens (clamped to ``[0, s]``, with ``cu_seqlens`` to ``[0, its tokens]``; 0 leaves
            the row unchanged). Outputs of all tokens are computed alike (speculative verification: the outputs of
            the first accepted tokens equal those of decoding only them).
        intermediate_states: ``[B, s, HV, K, V]`` (``"vk"``: ``[B, s, HV, V, K]``) fp32 contiguous output buffer
            (``[T, ...]`` with ``cu_seqlens``; must not overlap ``state``): the state after every token is written
            there; entries of skipped sequences (and of tokens outside every sequence) are left as they are.
        use_gate_in_kernel: ``g`` holds the raw gate input ``a``; the kernel takes
            ``g = -exp(A_log) * softplus(a + dt_bias)`` (softplus is ``x`` itself above 20), as fla's option.
        A_log, dt_bias: ``[HV]`` fp32 or q's dtype; A_log is required with ``use_gate_in_kernel`` (dt_bias ``None``:
            no bias), and both must be ``None`` without it.
        use_beta_sigmoid_in_kernel: ``beta`` holds logits; the kernel takes ``sigmoid(beta)``.
        allow_neg_eigval: beta doubled (after the sigmoid), so ``I - beta k k^T`` may have eigenvalues down to -1.
        gk, gv: fla's per-key / per-value decays ``[B, s, HV, K]`` / ``[B, s, HV, V]`` (log space) or None: with
            ``g`` they scale the state before each update, ``S = exp(g)·diag(exp(gk))·S·diag(exp(gv))``
            (state rows ``[K, V]``).
        state_layout: ``"kv"`` (``[..., K, V]`` rows) or ``"vk"`` (``[..., V, K]``, the layout of vLLM / SGLang /
            FlashInfer decode); fla's ``state_v_first=True`` (and its deprecated name ``transpose_state_layout``,
            with a ``DeprecationWarning``; the two together with ``state_v_first=True`` are a ``ValueError``) is
            ``"vk"``.
        impl: ``"auto"`` / ``"triton"``: the Triton kernel; ``"reference"``: ``recurrent_gated_delta_rule_ref`` token
            by token (any device, float64 too; reads the index tensors on the host; the state is updated in place
            alike); ``"gluon"`` is refused.
        **fla_options: keywords of fla's recurrent step, accepted at the value that computes what this function
            computes: ``inplace_final_state=True``, ``output_final_state=False`` (the pool rows are the final
            states), ``head_first=False``, ``num_accepted_tokens=None``; and ``state_v_first`` /
            ``transpose_state_layout`` (bools, see ``state_layout``). Any other value of these is a ``ValueError``
            naming the option as unsupported; any other keyword a ``TypeError`` naming it.

    Returns:
        o: ``[B, s, HV, V]`` in ``v``'s dtype.

    Forward only: a ``RuntimeError`` if an input requires grad while autograd is enabled.
    """
    key = None
    if not fla_options and cu_seqlens_cpu is None:  # (the host copy's values are checked every time)
        key = call_key((q, k, v, g, beta, state, state_indices, cu_seqlens, accepted, intermediate_states, A_log,
                        dt_bias, gk, gv), (scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                                           use_beta_sigmoid_in_kernel, allow_neg_eigval, state_layout, impl))
    checked = _CHECKED.get(key)
    if checked is None:
        checked = _check_step(q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm_in_kernel, cu_seqlens,
                              cu_seqlens_cpu, accepted, intermediate_states, use_gate_in_kernel, A_log, dt_bias,
                              use_beta_sigmoid_in_kernel, allow_neg_eigval, gk, gv, state_layout, impl, fla_options)
        _CHECKED.put(key, checked)
    v_first, use_qk_l2norm_in_kernel, checked_scale, N = checked
    scale = scale if type(scale) is float else checked_scale  # a float is its own checked value
    ref = impl == "reference"
    S = q.shape[1]
    if state_indices is None:
        state_indices = torch.arange(N, dtype=torch.int32, device=q.device)
    # what the checks read beside metadata, every call: addresses, and the values of host index tensors
    _check_overlap(state, intermediate_states, q=q, k=k, v=v, g=g, beta=beta, state_indices=state_indices,
                   cu_seqlens=cu_seqlens, accepted=accepted, A_log=A_log, dt_bias=dt_bias, gk=gk, gv=gv)
    if not torch.compiler.is_compiling():
        check_pool_rows("state_indices", state_indices, state.shape[0])
        _check_cu_values(cu_seqlens, S)
    opts = dict(A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=use_gate_in_kernel,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                v_first=v_first, gk=gk, gv=gv)
    if ref:
        return _decode_reference_options(q, k, v, g, beta, state, state_indices, float(scale),
                                         bool(use_qk_l2norm_in_kernel), cu_seqlens, accepted, intermediate_states,
                                         **opts)
    step = route(_decode_op, gated_delta_rule_decode_fwd)
    q, k, v, g, beta, state_indices, cu_seqlens, accepted, A_log, dt_bias, gk, gv = contiguous(
        q, k, v, g, beta, state_indices, cu_seqlens, accepted, A_log, dt_bias, gk, gv)
    opts.update(A_log=A_log, dt_bias=dt_bias, gk=gk, gv=gv)
    return step(q, k, v, g, beta, state, state_indices, float(scale), bool(use_qk_l2norm_in_kernel), cu_seqlens,
                accepted, intermediate_states, **opts)
