"""Pure-torch references of the gated delta rule (any device, float64-capable, differentiable by autograd).

Shapes (both functions): q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g (log-space decay, <= 0; -inf resets the
state) and beta ``[B, T, HV]``; initial_state ``[N, HV, K, V]``; ``cu_seqlens`` ``[N+1]`` integer (then B == 1,
N sequences), else N == B. Value head ``i`` uses q/k head ``i // (HV // H)``.

Computation runs in ``float64`` if any of q, k, v, g, beta is float64, else ``float32``; the outputs
``o [B, T, HV, V]`` and ``final_state [N, HV, K, V]`` (or None) come back in that compute dtype.
"""

from __future__ import annotations

import torch

__all__ = ["l2norm_ref", "recurrent_gated_delta_rule_ref", "chunk_gated_delta_rule_ref", "gate_ref", "softplus_ref", "L2NORM_EPS",
           "G_FLOOR"]

L2NORM_EPS = 1e-6  # x / sqrt(sum(x^2) + eps), as fla and FlashQLA
# The chunked forms take g no lower than this: exp(-104) is below half of fp32's smallest subnormal, so every fp32
# decay through such a token is 0, as through g = -inf (a full reset of the state), while the chunk's cumulative
# sums stay finite (-inf - -inf would be NaN in their differences).
G_FLOOR = -104.0


def l2norm_ref(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """Normalise the last dimension: ``x * rsqrt(sum(x^2) + eps)``."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prep(q, k, v, g, beta, scale, initial_state, use_qk_l2norm, cu_seqlens, cdt=None):
    if cdt is None:
        cdt = torch.float64 if any(t.dtype == torch.float64 for t in (q, k, v, g, beta)) else torch.float32
    q, k, v, g, beta = (t.to(cdt) for t in (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV = v.shape[2]
    if HV % H:
        raise ValueError(f"v: HV={HV} must be a multiple of H={H}")
    if use_qk_l2norm:
        q, k = l2norm_ref(q), l2norm_ref(k)
    if HV != H:
        q = q.repeat_interleave(HV // H, dim=2)
        k = k.repeat_interleave(HV // H, dim=2)
    if scale is None:
        scale = K ** -0.5
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens: needs B == 1, got B={B}")
        bounds = [(0, int(a), int(b)) for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True)]
    else:
        bounds = [(b, 0, T) for b in range(B)]
    if initial_state is not None:
        initial_state = initial_state.to(cdt)
        if initial_state.shape[0] != len(bounds):
            raise ValueError(f"initial_state: expected N={len(bounds)} states, got {initial_state.shape[0]}")
    return q, k, v, g, beta, scale, initial_state, bounds, cdt


def _live_rows(d: torch.Tensor) -> torch.Tensor:
    """Rows of a chunk before its first bad one ``[..., C]`` bool, from ``d = beta·|k|²·gc`` per row (not finite
    when k, beta or the cumulative decay is). The recurrence takes every later token of the sequence through the
    bad one's state; the rows before it never see it."""
    return (~torch.isfinite(d)).cumsum(-1) == 0


def _tie(*xs):
    """An exact zero that depends on every given input (None: absent), added to the references' results so that
    they stay differentiable (zero gradients) when no sequence has a token and no initial state is given."""
    return sum(x.reshape(-1)[:0].sum() for x in xs if x is not None)


def recurrent_gated_delta_rule_ref(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                   use_qk_l2norm=False, cu_seqlens=None, *, gk=None, gv=None):
    """Token-by-token recurrence: ``S = exp(g_t)·S; S += beta_t·k_t (v_t − Sᵀk_t)ᵀ; o_t = scale·Sᵀq_t``.

    fla's recurrent options: per-key and per-value decays ``gk [B, T, HV, K]`` / ``gv [B, T, HV, V]`` (log space)
    scale the state's rows / columns by ``exp(gk_t)`` / ``exp(gv_t)`` with ``exp(g_t)``, and a per-value beta
    ``[B, T, HV, V]`` scales each column of the update. Returns ``(o [B, T, HV, V], final_state [N, HV, K, V] or
    None)`` in the compute dtype (float64 if any input is).
    """
    f64 = any(t is not None and t.dtype == torch.float64 for t in (gk, gv))
    q, k, v, g, beta, scale, h0, bounds, cdt = _prep(q, k, v, g, beta, scale, initial_state, use_qk_l2norm,
                                                     cu_seqlens, torch.float64 if f64 else None)
    gk, gv = (t.to(cdt) if t is not None else None for t in (gk, gv))
    B, T, HV, V = v.shape
    K = q.shape[-1]
    o_rows = [[None] * T for _ in range(B)]
    finals = []
    for n, (b, lo, hi) in enumerate(bounds):
        S = h0[n] if h0 is not None else torch.zeros(HV, K, V, dtype=cdt, device=q.device)
        for t in range(lo, hi):
            S = S * torch.exp(g[b, t])[:, None, None]
            if gk is not None:
                S = S * torch.exp(gk[b, t])[:, :, None]
            if gv is not None:
                S = S * torch.exp(gv[b, t])[:, None, :]
            kt = k[b, t]  # [HV, K]
            bt = beta[b, t] if beta.dim() == 4 else beta[b, t][:, None]  # [HV, V] or [HV, 1]
            delta = bt * (v[b, t] - torch.einsum("hk,hkv->hv", kt, S))
            S = S + kt[:, :, None] * delta[:, None, :]
            o_rows[b][t] = scale * torch.einsum("hk,hkv->hv", q[b, t], S)
        finals.append(S)
    zero = torch.zeros(HV, V, dtype=cdt, device=q.device)
    o = torch.stack([torch.stack([r if r is not None else zero for r in row]) for row in o_rows]) if T else \
        v.new_zeros(B, 0, HV, V)
    tie = _tie(q, k, v, g, beta, gk, gv)
    return o + tie.to(o.dtype), (torch.stack(finals) + tie.to(cdt) if output_final_state else None)


def chunk_gated_delta_rule_ref(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm=False, cu_seqlens=None, chunk_size=64, compute_dtype=None):
    """The chunked (WY) form the kernels implement, in einsums. Same arguments and results as the recurrence.

    Per chunk (length C, ``gc`` = cumulative sum of g within the chunk, S the state at the chunk start):
    ``A = tril(beta_i k_i·k_j exp(gc_i − gc_j), −1)``, ``Tm = (I + A)^-1``, ``w = Tm (beta·exp(gc)·k)``,
    ``u = Tm (beta·v)``, ``v_new = u − w S``,
    ``o = scale·(exp(gc)·q S + (q kᵀ ⊙ exp(gc_i − gc_j) ⊙ [i >= j]) v_new)``,
    ``S ← exp(gc_C)·S + (k·exp(gc_C − gc))ᵀ v_new``.

    ``compute_dtype`` (e.g. bfloat16) runs every einsum in that dtype ("torch at the kernel's precision";
    the triangular solve runs in float32 and is rounded; g's cumsum and the state stay float32). g is floored at
    ``G_FLOOR`` first, as in the kernels (g = -inf resets the state).
    """
    q, k, v, g, beta, scale, h0, bounds, cdt = _prep(q, k, v, g, beta, scale, initial_state, use_qk_l2norm,
                                                     cu_seqlens, compute_dtype)
    sdt = torch.promote_types(cdt, torch.float32)  # g cumsum and states
    B, T, HV, V = v.shape
    K = q.shape[-1]
    o_parts = [[] for _ in range(B)]
    finals = []
    for n, (b, lo, hi) in enumerate(bounds):
        S = h0[n].to(sdt) if h0 is not None else torch.zeros(HV, K, V, dtype=sdt, device=q.device)
        for s in range(lo, hi, chunk_size):
            e = min(s + chunk_size, hi)
            C = e - s
            qc, kc, vc = q[b, s:e].transpose(0, 1), k[b, s:e].transpose(0, 1), v[b, s:e].transpose(0, 1)
            gc = g[b, s:e].transpose(0, 1).to(sdt).clamp(min=G_FLOOR).cumsum(-1)  # [HV, C]
            bc = beta[b, s:e].transpose(0, 1)
            lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
            incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(0)
            kk = torch.einsum("hik,hjk->hij", kc, kc).to(sdt)
            # non-finite inputs: gc is NaN from the chunk's first token with a non-finite k, beta or decay on, which
            # takes every later output and the state to NaN; the products run on the live rows' finite entries, so
            # no NaN reaches an earlier row through a product's zeros (0·NaN)
            live = _live_rows(torch.diagonal(kk, dim1=-2, dim2=-1) * bc.to(sdt) * gc)
            gc = torch.where(live, gc, torch.nan)
            diff = gc[:, :, None] - gc[:, None, :]
            A = torch.where(lower & live[..., None], bc[:, :, None].to(sdt) * kk * torch.exp(
                torch.where(lower, diff, 0.0)), 0.0)
            eye = torch.eye(C, dtype=sdt, device=q.device).expand(HV, C, C)
            Tm = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True).to(cdt)
            w = Tm @ torch.where(live[..., None], bc[..., None] * torch.exp(gc)[..., None] * kc, 0.0).to(cdt)
            vok = torch.isfinite(vc)
            u = Tm @ torch.where(vok & live[..., None], bc[..., None] * vc, 0.0)
            u = torch.where((~vok).cumsum(-2) > 0, torch.nan, u)  # a non-finite v: its column from its row on
            vn = u - w @ S.to(cdt)
            att = torch.where(incl, torch.einsum("hik,hjk->hij", qc, kc).to(sdt) * torch.exp(torch.where(
                incl, diff, 0.0)), 0.0).to(cdt)
            vfin = torch.isfinite(vn)
            oc = scale * ((torch.exp(gc)[..., None] * (qc @ S.to(cdt))) + att @ torch.where(vfin, vn, 0.0))
            # v_new is non-finite in a suffix of each column's rows: from each column's first such row on, NaN
            oc = torch.where((~vfin).cumsum(-2) > 0, torch.nan, oc)
            o_parts[b].append((s, oc.transpose(0, 1).to(cdt)))
            gl = gc[:, -1]
            kd = (kc * torch.exp(gl[:, None] - gc)[..., None]).to(cdt)
            S = torch.exp(gl)[:, None, None] * S + (kd.transpose(1, 2) @ vn).to(sdt)
        finals.append(S)
    o = torch.zeros(B, T, HV, V, dtype=cdt, device=q.device)
    rows = []
    for b in range(B):
        ob = o[b]
        for s, oc in o_parts[b]:
            ob = torch.cat([ob[:s], oc, ob[s + oc.shape[0]:]], 0)
        rows.append(ob)
    o = torch.stack(rows) if rows else o
    tie = _tie(q, k, v, g, beta)
    return o + tie.to(o.dtype), (torch.stack(finals) + tie.to(sdt) if output_final_state else None)


def softplus_ref(x: torch.Tensor) -> torch.Tensor:
    """``log(1 + exp(x))``, and ``x`` itself above 20 (the threshold of fla's and torch's softplus)."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x.clamp(max=20.0))))


def gate_ref(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """The log-space decay from the raw gate input: ``-exp(A_log) * softplus(a + dt_bias)``; a ``[..., HV]``,
    A_log / dt_bias ``[HV]``. Computed in a's dtype."""
    x = a + dt_bias.to(a.dtype) if dt_bias is not None else a
    return -torch.exp(A_log.to(a.dtype)) * softplus_ref(x)
