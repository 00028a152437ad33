"""TransGQLA: convert a pretrained GQA attention (LLaMA-style q/k/v/o) into a ``GQLAttention``.

Source (``h`` query heads, ``g`` KV groups, head size ``d``, value size ``d_v``, rotate-half RoPE on all
``d`` dims or no RoPE)::

    q = W_Q x [h, d],  k = W_K x [g, d],  v = W_V x [g, d_v],  o = W_O · attn(q, k, v) (head i reads group γ(i))

Conversion:

1. RoPE split (``rope_dim = d_R > 0``): the ``d_R/2`` highest-frequency rotary pairs ``(i, i + d/2)``,
   ``i < d_R/2``, become the GQLA rope part; their frequencies are kept by setting
   ``rope_theta' = theta^(d_R/d)``. The shared rope key is group ``rope_group``'s key rows for those dims
   (every group then uses that group's rope key: this is the approximation MHA2MLA-style conversions make).
   The remaining ``d - d_R`` dims become the no-rope part (``head_dim = d - d_R``): their rotation is dropped.
   ``d_R = 0`` keeps no RoPE at all.
2. Joint low-rank factorization of the stacked no-rope key and value projections of all groups,
   ``W = [W_K,nope[0]; W_V[0]; ...; W_K,nope[g-1]; W_V[g-1]]`` (``g·(d_h + d_v)`` rows): with ``U_r`` the top
   ``r`` left singular vectors of ``W`` (or of ``W Xᵀ`` for calibration activations ``X``, which minimizes the
   K/V error on that data), ``kv_a_proj``'s latent rows are ``W_down = U_rᵀ W`` and ``kv_b_proj = U_r``, whose
   per-group row blocks are ``W_UK[j]``, ``W_UV[j]``. ``W_UK W_down = U_r U_rᵀ W`` is the orthogonal projection
   of the K/V maps onto the top-r subspace, so its error ``‖(I - U_r U_rᵀ) W‖`` never grows with ``r``.
3. ``q_proj`` rows per head = [no-rope dims; rope dims] of ``W_Q``; ``o_proj = W_O``; ``softmax_scale = d^-0.5``.
   The latent RMSNorm is left out (``kv_norm=False``): the source has none.

Exact: with ``r >= rank(W)`` (always when ``r >= min(g·(d_h + d_v), hidden)``) the K/V maps are reproduced
exactly, so a source without RoPE converted with ``d_R = 0`` gives the same layer output (up to rounding).
Also exact: sources whose RoPE is already decoupled (one rope key shared by all groups, as GQLA/MLA have).
Approximate: ``r < rank(W)`` (truncation error above), and any RoPE source with coupled per-group rotary keys
(groups other than ``rope_group`` lose their own rope key; no-rope dims lose their rotation) — such models
need the fine-tuning the paper describes after conversion.
"""

from __future__ import annotations

import math

import torch

from ..layers.gqla import GQLAttention

__all__ = ["trans_gqla", "gqa_attention_reference"]


def _weights(source, names):
    if isinstance(source, dict):
        missing = [n for n in names if n not in source]
        if missing:
            raise ValueError(f"source: missing weights {missing}")
        return [source[n] for n in names]
    out = []
    for n in names:
        mod = getattr(source, n, None)
        if mod is None or not hasattr(mod, "weight"):
            raise ValueError(f"source: expected a module with {names} (nn.Linear), missing {n!r}")
        if getattr(mod, "bias", None) is not None:
            raise ValueError(f"source: {n} has a bias; TransGQLA supports bias-free projections only")
        out.append(mod.weight)
    return out


def trans_gqla(source, *, num_heads: int, num_groups: int, head_dim: int, kv_rank: int, rope_dim: int = 0,
               v_head_dim: int | None = None, rope_theta: float = 10000.0, rope_group: int = 0,
               calib: torch.Tensor | None = None, path: str = "auto", impl: str = "triton", device=None,
               dtype=None) -> GQLAttention:
    """Convert a GQA attention into a ``GQLAttention`` (see module docstring for the math and exactness).

    ``source``: a module with bias-free ``q_proj [h·d, hidden]``, ``k_proj [g·d, hidden]``, ``v_proj
    [g·d_v, hidden]``, ``o_proj [hidden, h·d_v]`` (LLaMA naming) or a dict of those weight tensors.
    ``kv_rank``: latent rank r. ``rope_dim``: d_R dims kept as the shared rope part (0: none; even, <= d).
    ``calib``: optional activations ``[N, hidden]`` for a data-aware factorization. The factorization runs
    in float64; the result has ``dtype`` (default: the source's) on ``device``.
    """
    wq, wk, wv, wo = _weights(source, ("q_proj", "k_proj", "v_proj", "o_proj"))
    h, g, d = num_heads, num_groups, head_dim
    dv = d if v_head_dim is None else v_head_dim
    if h % g:
        raise ValueError(f"num_heads: {h} is not a multiple of num_groups {g}")
    hidden = wq.shape[1]
    for name, w, shape in (("q_proj", wq, (h * d, hidden)), ("k_proj", wk, (g * d, hidden)),
                           ("v_proj", wv, (g * dv, hidden)), ("o_proj", wo, (hidden, h * dv))):
        if tuple(w.shape) != shape:
            raise ValueError(f"{name}: expected weight shape {list(shape)}, got {list(w.shape)}")
    if not isinstance(rope_dim, int) or rope_dim < 0 or rope_dim % 2 or rope_dim >= d:
        raise ValueError(f"rope_dim: expected an even int in [0, {d}), got {rope_dim!r}")
    if d % 2 and rope_dim:
        raise ValueError(f"head_dim: rotary sources need an even head_dim, got {d}")
    if not 0 <= rope_group < g:
        raise ValueError(f"rope_group: expected a group in [0, {g}), got {rope_group}")
    if not isinstance(kv_rank, int) or kv_rank <= 0:
        raise ValueError(f"kv_rank: expected a positive int, got {kv_rank!r}")
    dtype = dtype or wq.dtype
    device = device if device is not None else wq.device
    f64 = dict(dtype=torch.float64, device="cpu")
    wq, wk, wv, wo = (w.detach().to(**f64) for w in (wq, wk, wv, wo))

    half, dR = d // 2, rope_dim
    rope_idx = torch.cat([torch.arange(dR // 2), half + torch.arange(dR // 2)])  # empty when d_R = 0
    keep = torch.ones(d, dtype=torch.bool)
    keep[rope_idx] = False
    nope_idx = torch.nonzero(keep).flatten()
    dn = d - dR

    wq3 = wq.view(h, d, hidden)
    wk3 = wk.view(g, d, hidden)
    W = torch.cat([wk3[:, nope_idx], wv.view(g, dv, hidden)], 1).reshape(g * (dn + dv), hidden)
    M = W if calib is None else W @ calib.detach().to(**f64).reshape(-1, hidden).T
    U, _, _ = torch.linalg.svd(M, full_matrices=False)
    r_eff = min(kv_rank, U.shape[1])
    U_r = torch.zeros(W.shape[0], kv_rank, **f64)
    U_r[:, :r_eff] = U[:, :r_eff]
    down = U_r.T @ W  # [r, hidden] (zero rows past the rank)

    theta = rope_theta ** (dR / d) if dR else rope_theta
    layer = GQLAttention(hidden, h, g, dn, dR, kv_rank, None, dv, theta, 1.0 / math.sqrt(d), path, impl,
                         device=device, dtype=dtype, kv_norm=False)
    with torch.no_grad():
        layer.q_proj.weight.copy_(torch.cat([wq3[:, nope_idx], wq3[:, rope_idx]], 1).reshape(h * d, hidden))
        layer.kv_a_proj.weight.copy_(torch.cat([down, wk3[rope_group, rope_idx]], 0))
        layer.kv_b_proj.weight.copy_(U_r)
        layer.o_proj.weight.copy_(wo)
    return layer


def gqa_attention_reference(source, x: torch.Tensor, *, num_heads: int, num_groups: int, head_dim: int,
                            v_head_dim: int | None = None, positions: torch.Tensor | None = None,
                            rope_theta: float | None = None) -> torch.Tensor:
    """Float64 causal GQA attention of the source weights: ``x [B, T, hidden]`` -> ``[B, T, hidden]``.

    ``rope_theta=None``: no RoPE; else rotate-half RoPE on all ``head_dim`` dims of q and k at ``positions``.
    """
    from ..layers.rope import apply_rope

    wq, wk, wv, wo = (w.detach().to("cpu", torch.float64) for w in _weights(source, ("q_proj", "k_proj",
                                                                                      "v_proj", "o_proj")))
    x = x.detach().to("cpu", torch.float64)
    B, T, _ = x.shape
    h, g, d = num_heads, num_groups, head_dim
    dv = d if v_head_dim is None else v_head_dim
    q = (x @ wq.T).view(B, T, h, d)
    k = (x @ wk.T).view(B, T, g, d)
    v = (x @ wv.T).view(B, T, g, dv)
    if rope_theta is not None:
        pos = positions if positions is not None else torch.arange(T)
        pos = pos.expand(B, T) if pos.dim() == 1 else pos
        q, k = apply_rope(q, pos, rope_theta), apply_rope(k, pos, rope_theta)
    k, v = k.repeat_interleave(h // g, 2), v.repeat_interleave(h // g, 2)
    s = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    o = torch.einsum("bhts,bshd->bthd", torch.softmax(s, -1), v).reshape(B, T, h * dv)
    return o @ wo.T
