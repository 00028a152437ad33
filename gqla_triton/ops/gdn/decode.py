"""Recurrent Gated DeltaNet decode step over a pooled fp32 state, updated in place.

Per value head, for each of the ``s`` new tokens in order (state ``S`` is ``[K, V]`` fp32)::

    S = exp(g_t) * S
    S = S + beta_t * k_t (v_t - S^T k_t)^T
    o_t = scale * S^T q_t

One program owns one (sequence, value head, BV-wide slice of V): it loads its ``K x BV`` state slice,
runs the ``s`` tokens in registers and writes the slice back (one load and one store per state element), so
the step is bound by the 2 x state bytes it must move. Not differentiable (inference only; training uses ``chunk_gated_delta_rule``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...dispatch import select_config
from .._common.alloc import empty
from .._common.boundary import route
from .._common.host import cdiv, next_pow2
from .._common.impl import check_impl
from .._common.validation import FLOAT_DTYPES, INDEX_DTYPES, check_kernel_device, check_tensor
from .reference import recurrent_gated_delta_rule_ref

__all__ = ["gated_delta_rule_decode", "gated_delta_rule_decode_fwd"]

_REFERENCE = "gqla_triton.ops.gdn.reference.recurrent_gated_delta_rule_ref"


@triton.jit(do_not_specialize=["S", "P"])
def gated_delta_rule_decode_fwd_kernel(
    q, k, v, g, beta, o, state, idx,
    scale, S, P,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V

    # negative or out-of-pool rows are skipped: the K bound of every state access becomes 0 for them
    row = tl.load(idx + i_b).to(tl.int64)
    live = (row >= 0) & (row < P)
    row = tl.where(live, row, 0)
    k_end = tl.where(live, K, 0)
    m_s = (o_k < k_end)[:, None] & m_v[None, :]

    p_s = state + (row * HV + i_hv) * (K * V) + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)

    for t in range(S):
        tok = i_b.to(tl.int64) * S + t
        b_q = tl.load(q + (tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + (tok * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (tok * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + tok * HV + i_hv).to(tl.float32)
        b_beta = tl.load(beta + tok * HV + i_hv).to(tl.float32)
        if L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        b_s = b_s * tl.exp(b_g)
        b_u = (b_v - tl.sum(b_s * b_k[:, None], 0)) * b_beta
        b_s = b_s + b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_s * b_q[:, None], 0) * scale
        b_o = tl.where(live, b_o, 0.0)
        tl.store(o + (tok * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)

    tl.store(p_s, b_s, mask=m_s)


def gated_delta_rule_decode_fwd(q, k, v, g, beta, state, state_indices, scale: float,
                                use_qk_l2norm_in_kernel: bool) -> torch.Tensor:
    """Launch the step on contiguous inputs (shapes as ``gated_delta_rule_decode``; state_indices ``[B]`` int32).
    Returns o ``[B, s, HV, V]`` in v's dtype; updates the state rows in place."""
    B, S, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    P = state.shape[0]
    o = empty(v.shape, dtype=v.dtype, device=v.device)
    cfg = select_config("gdn_decode", {"K": K, "V": V}, device=q.device)
    BK = next_pow2(K)
    BV = min(cfg.bv, next_pow2(V))
    grid = (cdiv(V, BV), B * HV)
    gated_delta_rule_decode_fwd_kernel[grid](
        q, k, v, g, beta, o, state, state_indices, float(scale), S, P,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, L2NORM=bool(use_qk_l2norm_in_kernel),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return o


def _check_pool_rows(state_indices: torch.Tensor, pool_rows: int) -> None:
    """A CPU ``state_indices`` is checked against the pool size (no device sync); device indices are not read."""
    if state_indices.device.type == "cpu" and state_indices.numel():
        hi = int(state_indices.max())
        if hi >= pool_rows:
            raise ValueError(f"state_indices: index {hi} is outside the state pool [0, {pool_rows})")


@torch.library.custom_op("gqla_triton::gated_delta_rule_decode", mutates_args=("state",))
def _decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, state_indices: torch.Tensor, scale: float,
               use_qk_l2norm_in_kernel: bool) -> torch.Tensor:
    _check_pool_rows(state_indices, state.shape[0])  # the public function cannot read it while tracing
    return gated_delta_rule_decode_fwd(q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm_in_kernel)


@_decode_op.register_fake
def _(q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm_in_kernel):
    return torch.empty_like(v)


def _decode_reference(q, k, v, g, beta, state, state_indices, scale, l2):
    """The step by ``recurrent_gated_delta_rule_ref``, with the kernel's conventions: rows outside [0, P) are
    skipped (o = 0), the live rows of ``state`` are updated in place."""
    o = torch.zeros_like(v)
    live = ((state_indices >= 0) & (state_indices < state.shape[0])).nonzero().flatten()
    if live.numel():
        rows = state_indices[live].long()
        ol, fin = recurrent_gated_delta_rule_ref(q[live], k[live], v[live], g[live], beta[live], scale=scale,
                                                 initial_state=state[rows], output_final_state=True,
                                                 use_qk_l2norm=l2)
        o[live] = ol.to(o.dtype)
        state[rows] = fin.to(state.dtype)
    return o


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
    impl: str = "auto",
) -> torch.Tensor:
    """Gated DeltaNet recurrent step for ``s >= 1`` new tokens per sequence; updates ``state`` in place.

    Args:
        q, k: ``[B, s, H, K]`` (bf16/fp16/fp32), the ``s`` tokens of each sequence in order.
        v: ``[B, s, HV, V]``, same dtype; ``HV % H == 0`` (value head ``i`` uses q/k head ``i // (HV // H)``).
        g: ``[B, s, HV]`` log-space decay (<= 0), any float dtype. beta: ``[B, s, HV]``, any float dtype.
        state: ``[P, HV, K, V]`` fp32 contiguous pool; rows ``state_indices`` are read and written in place.
        state_indices: ``[B]`` int32 pool row of each sequence (default ``arange(B)``, needs ``P >= B``).
            A negative index skips that sequence: its output is 0 and no state row is touched. An index
            ``>= P`` raises ``ValueError`` when ``state_indices`` is on the CPU (checked without any device
            sync); on the GPU such a row is treated like a negative one (skipped, never accessed).
        scale: output scale, default ``K ** -0.5``.
        use_qk_l2norm_in_kernel: L2-normalise q and k per head (``x / sqrt(sum(x^2) + 1e-6)``) first.
        impl: ``"auto"`` / ``"triton"``: the Triton kernel; ``"reference"``: ``recurrent_gated_delta_rule_ref`` on
            the live rows (any device; the state is updated in place alike); ``"gluon"`` is refused.

    Returns:
        o: ``[B, s, HV, V]`` in ``v``'s dtype.
    """
    check_impl(impl, op="gated_delta_rule_decode", gluon=False)
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    B, S, H, K = q.shape
    check_tensor("k", k, shape=(B, S, H, K), dtypes=(q.dtype,), device=q.device)
    check_tensor("v", v, ndim=4, dtypes=(q.dtype,), device=q.device)
    HV, V = v.shape[2], v.shape[3]
    check_tensor("v", v, shape=(B, S, HV, V))
    check_tensor("g", g, shape=(B, S, HV), dtypes=FLOAT_DTYPES, device=q.device)
    check_tensor("beta", beta, shape=(B, S, HV), dtypes=FLOAT_DTYPES, device=q.device)
    check_tensor("state", state, ndim=4, dtypes=(torch.float32,), device=q.device)
    if B == 0 or S == 0 or H == 0 or K == 0 or V == 0:
        raise ValueError(f"q/v: expected non-empty B, s, heads and dims, got q {list(q.shape)}, v {list(v.shape)}")
    if HV % H != 0:
        raise ValueError(f"v: value heads HV={HV} must be a multiple of q/k heads H={H}")
    if tuple(state.shape[1:]) != (HV, K, V):
        raise ValueError(f"state: expected shape [P, {HV}, {K}, {V}], got {list(state.shape)}")
    if not state.is_contiguous():
        raise ValueError("state: expected a contiguous tensor (it is updated in place)")
    if K > 256 or V > 1024:
        raise ValueError(f"q/v: head dims K <= 256 and V <= 1024 supported, got K={K}, V={V}")
    if state_indices is None:
        if state.shape[0] < B:
            raise ValueError(f"state: pool has {state.shape[0]} rows, fewer than batch {B} (pass state_indices)")
        state_indices = torch.arange(B, dtype=torch.int32, device=q.device)
    else:
        check_tensor("state_indices", state_indices, shape=(B,), dtypes=INDEX_DTYPES, device=q.device)
    if scale is None:
        scale = K**-0.5
    if not torch.compiler.is_compiling():
        _check_pool_rows(state_indices, state.shape[0])
    if impl == "reference":
        return _decode_reference(q, k, v, g, beta, state, state_indices, float(scale), bool(use_qk_l2norm_in_kernel))
    check_kernel_device(q.device, _REFERENCE, q.dtype)
    step = route(_decode_op, gated_delta_rule_decode_fwd)
    return step(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), state,
                state_indices.contiguous(), float(scale), bool(use_qk_l2norm_in_kernel))
