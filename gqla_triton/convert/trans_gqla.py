"""TransGQLA: convert a pretrained GQA attention (LLaMA-style q/k/v/o with RoPE) into a ``GQLAttention``.

Source (``h`` query heads, ``g`` KV groups, head size ``d``, value size ``d_v``, rotate-half RoPE on all ``d``
dims: pair ``m`` is dims ``(m, m + d/2)`` at inverse frequency ``ω_m``)::

    q_i = W_Q[i] x,  k_j = W_K[j] x,  v_j = W_V[j] x,  score(i, t, s) = Σ_m q_i,m(t)ᵀ R((s - t) ω_m) k_γ(i),m(s)

where ``q_i,m``, ``k_j,m`` are 2-vectors and ``R`` a 2-D rotation. Conversion (all in float64):

1. Per-frequency PCA of the rotary keys across the KV heads. For each pair ``m`` stack the groups' ``2 x hidden``
   maps ``K_m = [W_K[0]_m; ...; W_K[g-1]_m]`` and take the eigenvectors ``U_m [g, g]`` of the Gram matrix
   ``G_m[j, j'] = <W_K[j]_m, W_K[j']_m>`` (with calibration activations ``X``: ``<W_K[j]_m Xᵀ, W_K[j']_m Xᵀ>``).
   The components ``u_m,l = Σ_j U_m[j, l] W_K[j]_m`` give ``k_j,m = Σ_l U_m[j, l] u_m,l x``; a rotation commutes
   with this scalar mixing, so ``q_i,mᵀ R k_j,m = Σ_l (U_m[j, l] q_i,m)ᵀ R (u_m,l x)`` exactly.
2. Shared rope key: the ``d_R / 2`` components ``(m, l)`` of largest energy (eigenvalue) over all frequencies
   become the rope pairs of the one shared key, each at its own frequency ``ω_m`` (``rope_inv_freq`` of the
   layer); query head ``i`` gets ``U_m[γ(i), l] q_i,m`` there. Every other component stays in the group's key,
   ``k_j,res = Σ_(m,l) not kept U_m[j, l] u_m,l x`` (``d`` dims), which becomes the no-rope key (``d_h = d``),
   matched by the full ``q_i`` as no-rope query: only these folded components lose their rotation.
3. K/V norm balancing and joint PCA: ``W = [α W_K,res[0]; W_V[0]; ...]`` (``g·(d + d_v)`` rows) with
   ``α = ‖W_V‖ / ‖W_K,res‖`` (norms on ``X`` when calibrating), so neither side dominates the factorization.
   With ``U_r`` the top-``r`` eigenvectors of ``W Wᵀ`` (or ``W XᵀX Wᵀ``, whose zero-eigenvalue directions, left by
   fewer calibration tokens than ``hidden``, are taken from ``W Wᵀ``), ``kv_a_proj``'s latent rows are
   ``U_rᵀ W`` and ``kv_b_proj = D⁻¹ U_r`` (``D`` the ``α`` row scaling): the per-group K/V maps become
   ``D⁻¹ U_r U_rᵀ D W``, an orthogonal projection of the balanced maps whose error never grows with ``r``.
4. ``q_proj`` rows per head = [``W_Q[i]`` (no-rope, ``d``); rope part (``d_R``)] times the square of the
   source's RoPE attention scaling; ``o_proj = W_O``; ``softmax_scale`` the source's (default ``d^-0.5``);
   no latent RMSNorm (``kv_norm=False``).

Exact (to float rounding, RoPE active) when nothing is truncated: ``d_R = g·d`` keeps every rotary component
and ``r >= min(g·(d + d_v), hidden)`` every K/V direction. Truncating ``r`` costs the dropped directions'
energy; a smaller ``d_R`` drops the rotation of the folded components (models converted that way need the
fine-tuning the paper describes). The error per rank of a converted model against the original, and the command
that measures it: ``examples/convert_llama.py`` (its docstring holds the table).
"""

from __future__ import annotations

import math

import torch

from ..layers.gqla import GQLAttention
from ..layers.rope import apply_rope, check_rope_dim, check_rope_inv_freq, rope_inv_freq
from ..ops._common.validation import (
    check_dense,
    check_device,
    check_flag,
    check_float_dtype,
    check_positive_int,
    check_positive_real,
    check_scale,
)

__all__ = ["beyond_range", "trans_gqla", "gqa_attention_reference"]

_F64 = dict(dtype=torch.float64, device="cpu")


def check_plain_attention(module, arg: str = "source", what: str = "the attention") -> None:
    """``module`` (an attention) holds its bias-free q / k / v / o projections and nothing else that enters its
    function: no biases, no per-head q / k norms (``q_norm`` / ``k_norm`` other than None or ``nn.Identity``, with
    or without weights) and no parameters besides the projections' (else a ``ValueError`` naming the argument
    ``arg``, ``what`` the module is, and what is extra)."""
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if getattr(getattr(module, n, None), "bias", None) is not None:
            raise ValueError(f"{arg}: {what}'s {n} has a bias; TransGQLA supports bias-free projections only")
    if any(not isinstance(getattr(module, n, None), (type(None), torch.nn.Identity)) for n in ("q_norm", "k_norm")):
        raise ValueError(f"{arg}: {what} normalizes q / k per head (q_norm / k_norm); not supported")
    if isinstance(module, torch.nn.Module):
        own = {f"{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias")}
        extra = sorted(n for n, _ in module.named_parameters() if n not in own)
        if extra:  # norms of q / k / the output (StableLM, HunYuan, BitNet), differential attention's λ, ...
            raise ValueError(f"{arg}: {what} has parameters beyond Llama's q / k / v / o projections ({extra}): its "
                             "function is not the one converted; not supported")


def _weights(source, names):
    if isinstance(source, dict):
        missing = [n for n in names if n not in source]
        if missing:
            raise ValueError(f"source: missing weights {missing}")
        extra = sorted(map(str, set(source) - set(names)))
        if extra:
            raise ValueError(f"source: unexpected weights {extra} (the source holds {list(names)} only)")
        return [source[n] for n in names]
    check_plain_attention(source)
    out = []
    for n in names:
        mod = getattr(source, n, None)
        if mod is None or not hasattr(mod, "weight"):
            raise ValueError(f"source: expected a module with {names} (nn.Linear), missing {n!r}")
        out.append(mod.weight)
    return out


def _checked(names, weights, finite: bool = True):
    """Each source weight a 2-D floating tensor, finite with ``finite`` (the factorization of a NaN / inf weight
    has no answer)."""
    for n, w in zip(names, weights, strict=True):
        check_dense(f"source: {n}", w)
        if w.dim() != 2 or not w.is_floating_point():
            raise (ValueError if w.is_floating_point() else TypeError)(
                f"source: {n} must be a 2-D floating weight tensor, got {w.dtype} {list(w.shape)}")
        if w.device.type == "meta":
            raise ValueError(f"source: {n} is on the meta device (it holds no values to factorize)")
        if w.element_size() < 2:
            raise TypeError(f"source: {n} is {w.dtype}: float8 weights need their scales; dequantise them first")
        if finite and not torch.isfinite(w.detach()).all():
            raise ValueError(f"source: {n} has non-finite values")
    return weights


def _source(source, num_heads, num_groups, head_dim, v_head_dim, finite: bool = True):
    """The source's checked weights (``_checked``, ``finite`` as its) and sizes ``(wq, wk, wv, wo, h, g, d, d_v,
    hidden)``: positive head counts and widths, ``num_groups`` dividing ``num_heads``, an even ``head_dim`` (rotary
    sources), weight shapes that agree with them."""
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    wq, wk, wv, wo = _checked(names, _weights(source, names), finite)
    for name, v in (("num_heads", num_heads), ("num_groups", num_groups), ("head_dim", head_dim)):
        check_positive_int(name, v)
    h, g, d = num_heads, num_groups, head_dim
    dv = d if v_head_dim is None else check_positive_int("v_head_dim", v_head_dim)
    if h % g:
        raise ValueError(f"num_heads: {h} is not a multiple of num_groups {g}")
    if d % 2:
        raise ValueError(f"head_dim: rotary sources need an even head_dim, got {d}")
    hidden = wq.shape[1]
    for name, w, shape, what in (("q_proj", wq, (h * d, hidden), "num_heads·head_dim"),
                                 ("k_proj", wk, (g * d, hidden), "num_groups·head_dim"),
                                 ("v_proj", wv, (g * dv, hidden), "num_groups·v_head_dim"),
                                 ("o_proj", wo, (hidden, h * dv), "hidden, num_heads·v_head_dim")):
        if tuple(w.shape) != shape:
            raise ValueError(f"{name}: expected weight shape {list(shape)} ({what}), got {list(w.shape)}")
    return wq, wk, wv, wo, h, g, d, dv, hidden


def _source_inv_freq(d: int, rope_theta: float, inv_freq) -> torch.Tensor:
    if inv_freq is None:
        return rope_inv_freq(d, rope_theta)
    return check_rope_inv_freq(inv_freq, d // 2, " (head_dim / 2)")


def _top_eigh(G: torch.Tensor):
    """Eigenvalues / eigenvectors of symmetric ``G [..., n, n]``, largest first."""
    lam, U = torch.linalg.eigh(G)
    return lam.flip(-1), U.flip(-1)


def _gram(A: torch.Tensor, C: torch.Tensor | None) -> torch.Tensor:
    """``A Aᵀ`` (or ``A C Aᵀ``) for ``A [..., n, hidden]``."""
    return A @ A.transpose(-1, -2) if C is None else A @ C @ A.transpose(-1, -2)


def _finite(G: torch.Tensor, name: str, calibrated: bool) -> torch.Tensor:
    """``G``, a Gram matrix of the source weights ``name``, or a ValueError when it overflows float64 (finite
    weights too large to factorize)."""
    if not torch.isfinite(G).all():
        raise ValueError(f"source: {name}: the Gram matrix of its weights{' on calib' if calibrated else ''} "
                         "overflows float64 (weights too large to factorize; scale them down)")
    return G


def trans_gqla(source, *, num_heads: int, num_groups: int, head_dim: int, kv_rank: int, rope_dim: int = 0,
               v_head_dim: int | None = None, rope_theta: float = 10000.0,
               rope_inv_freq: torch.Tensor | None = None, rope_attention_scaling: float = 1.0,
               softmax_scale: float | None = None, calib: torch.Tensor | None = None, balance_kv: bool = True,
               path: str = "auto", impl: str = "triton", device=None, dtype=None) -> GQLAttention:
    """Convert a GQA attention into a ``GQLAttention`` (module docstring: the math and when it is exact).

    ``source``: a module with bias-free ``q_proj [h·d, hidden]``, ``k_proj [g·d, hidden]``, ``v_proj
    [g·d_v, hidden]``, ``o_proj [hidden, h·d_v]`` (LLaMA naming) and no other parameters or q / k norms, or a dict
    of exactly those weight tensors.
    ``kv_rank``: latent rank r (ranks past ``g·(d + d_v)`` get zero latent rows). ``rope_dim``: d_R, even, at most
    ``g·d`` (= exact RoPE); 0 keeps no rotation. The source's RoPE: ``rope_inv_freq [d/2]`` (default
    ``rope_theta^(-2m/d)``) and ``rope_attention_scaling`` (the factor on its cos / sin).
    ``calib``: optional activations ``[..., hidden]`` (the attention's inputs) for a data-aware factorization.
    ``balance_kv``: scale keys to the values' norm before the joint PCA. The factorization runs in float64;
    the result has ``dtype`` (default: the source's) on ``device`` (default: the source's).
    """
    wq, wk, wv, wo, h, g, d, dv, hidden = _source(source, num_heads, num_groups, head_dim, v_head_dim)
    check_positive_int("kv_rank", kv_rank)
    rope_theta = check_positive_real("rope_theta", rope_theta)
    rope_attention_scaling = check_positive_real("rope_attention_scaling", rope_attention_scaling)
    scale = check_scale("softmax_scale", softmax_scale, d ** -0.5)
    balance_kv = check_flag("balance_kv", balance_kv)
    check_float_dtype(dtype)
    if check_rope_dim("rope_dim", rope_dim) > g * d:
        raise ValueError(f"rope_dim: expected an even int in [0, {g * d}] (num_groups * head_dim), got {rope_dim!r}")
    C = None
    if calib is not None:
        if check_dense("calib", calib).dim() == 0 or calib.shape[-1] != hidden or calib.numel() == 0:
            raise ValueError(f"calib: expected a non-empty tensor [..., {hidden}]")
        if not calib.is_floating_point():
            raise TypeError(f"calib: expected a real floating tensor, got {calib.dtype}")
        if calib.device.type == "meta":
            raise ValueError("calib: is on the meta device (it holds no values)")
        X = calib.detach().to(**_F64).reshape(-1, hidden)  # (float8 too: its values, exactly)
        if not torch.isfinite(X).all():
            raise ValueError("calib: has non-finite values (the factorization of their covariance has no answer)")
        C = X.T @ X / X.shape[0]
        if not torch.isfinite(C).all():
            raise ValueError("calib: its covariance overflows float64 (values too large)")
    inv = _source_inv_freq(d, rope_theta, rope_inv_freq)
    dtype = dtype or wq.dtype
    device = check_device(device, storage=True) or wq.device
    wq3, wk3, wv3 = (w.detach().to(**_F64).view(n, -1, hidden) for w, n in ((wq, h), (wk, g), (wv, g)))
    wo = wo.detach().to(**_F64)
    half, n = d // 2, rope_dim // 2
    grp = torch.arange(h) // (h // g)

    # 1-2. per-frequency PCA across groups; the n components of largest energy form the shared rope key
    Km = torch.stack([wk3[:, :half], wk3[:, half:]], 2).permute(1, 0, 2, 3)  # [half, g, 2, hidden]
    Gk = _gram(Km.reshape(half, g, 2 * hidden), None) if C is None else _calib_gram(Km, C)
    lam, U = _top_eigh(_finite(Gk, "k_proj", C is not None))
    comps = torch.einsum("mjl,mjah->mlah", U, Km)  # u_{m,l}: [half, g, 2, hidden]
    order = torch.argsort(-lam.flatten(), stable=True)[:n]
    km, kl = order // g, order % g
    keep = torch.zeros(half, g, dtype=torch.bool)
    keep[km, kl] = True
    rope_k = torch.cat([comps[km, kl, 0], comps[km, kl, 1]], 0)  # [d_R, hidden]
    coef = U[km[None, :], grp[:, None], kl[None, :]]  # [h, n]: U_m[γ(i), l] per head and kept pair
    q_pairs = torch.stack([wq3[:, :half], wq3[:, half:]], 2)  # [h, half, 2, hidden]
    rope_q = (coef[..., None, None] * q_pairs[:, km]).transpose(1, 2).reshape(h, 2 * n, hidden)
    res = torch.einsum("mjl,mlah->jamh", U * (~keep)[:, None, :], comps).reshape(g, d, hidden)

    # 3. balanced joint PCA of the residual keys and the values of all groups
    nk, nv = (_finite(_gram(w.reshape(-1, hidden), C), name, C is not None).trace().clamp_min(0).sqrt()
              for w, name in ((res, "k_proj"), (wv3, "v_proj")))
    alpha = (nv / nk).item() if balance_kv and nk > 0 and nv > 0 else 1.0
    W = torch.cat([alpha * res, wv3], 1).reshape(g * (d + dv), hidden)
    lam_w, Uw = _top_eigh(_finite(_gram(W, C), "k_proj, v_proj", C is not None))
    if C is not None:
        Uw = _complete(Uw, lam_w, _finite(_gram(W, None), "k_proj, v_proj", False))
    r_eff = min(kv_rank, Uw.shape[1])
    U_r = torch.zeros(W.shape[0], kv_rank, **_F64)
    U_r[:, :r_eff] = Uw[:, :r_eff]
    down = U_r.T @ W  # [r, hidden]
    up = U_r.view(g, d + dv, kv_rank).clone()
    up[:, :d] /= alpha

    s2 = rope_attention_scaling * rope_attention_scaling
    if not 0.0 < s2 < math.inf:
        raise ValueError(f"rope_attention_scaling: {rope_attention_scaling!r} squared (the factor on the converted "
                         f"q_proj weights) is {'past' if s2 else 'below'} float64's range")
    weights = {"q_proj": s2 * torch.cat([wq3, rope_q], 1).reshape(h * (d + rope_dim), hidden),
               "kv_a_proj": torch.cat([down, rope_k], 0), "kv_b_proj": up.reshape(g * (d + dv), kv_rank), "o_proj": wo}
    wide = beyond_range(weights, dtype)  # checked before the layer is made: a refused call allocates nothing
    if wide is not None:  # named by the argument that scaled them (q by rope_attention_scaling²), else dtype
        name, big = wide
        arg = "rope_attention_scaling" if name == "q_proj" and s2 != 1.0 else "dtype"
        raise ValueError(f"{arg}: the converted {name} weights reach {big:.3g}, beyond {dtype}'s range; convert "
                         f"to a wider dtype{' or with balance_kv=False' if balance_kv else ''}")
    layer = GQLAttention(hidden, h, g, d, rope_dim, kv_rank, None, dv, rope_theta, scale, path, impl,
                         device=device, dtype=dtype, kv_norm=False,
                         rope_inv_freq=inv[km] if n else None)
    with torch.no_grad():
        for name, w in weights.items():
            getattr(layer, name).weight.copy_(w)
    return layer


def beyond_range(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[str, float] | None:
    """The first of ``weights`` (name -> float64 values) whose largest magnitude passes ``dtype``'s finite range, and
    that magnitude (copied into a layer of ``dtype`` it would be inf); None where every one fits."""
    limit = torch.finfo(dtype).max
    for name, w in weights.items():
        big = w.abs().max().item() if w.numel() else 0.0
        if not big <= limit:
            return name, big
    return None


def _complete(U: torch.Tensor, lam: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """The eigenvectors ``U [n, n]`` of a calibrated Gram (eigenvalues ``lam``, largest first) whose eigenvalue is
    zero (directions no calibration token reaches: fewer tokens than ``hidden``) replaced by the top eigenvectors of
    the weights' own Gram ``G`` within the complement of the others, so that every direction of the weights is
    ranked and a rank that holds them all is exact; the calibrated directions keep their order."""
    top = lam[0].item() if lam.numel() else 0.0
    k = int((lam > top * 1e-12).sum()) if top > 0 else 0
    if k == U.shape[1]:
        return U
    A = U[:, :k]
    ev, E = torch.linalg.eigh(torch.eye(U.shape[0], **_F64) - A @ A.T)
    Q = E[:, ev > 0.5]  # an orthonormal basis of A's complement
    _, V = _top_eigh(Q.T @ G @ Q)
    return torch.cat([A, Q @ V], 1)


def _calib_gram(Km: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """``G_m[j, j'] = Σ_a W_K[j]_m,a C W_K[j']_m,aᵀ`` for ``Km [half, g, 2, hidden]``."""
    return torch.einsum("mjah,hk,mbak->mjb", Km, C, Km)


def gqa_attention_reference(source, x: torch.Tensor, *, num_heads: int, num_groups: int, head_dim: int,
                            v_head_dim: int | None = None, positions: torch.Tensor | None = None,
                            rope_theta: float | None = None, rope_inv_freq: torch.Tensor | None = None,
                            rope_attention_scaling: float = 1.0, softmax_scale: float | None = None,
                            attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 causal GQA attention of the source weights: ``x [B, T, hidden]`` -> ``[B, T, hidden]``.

    ``rope_theta`` and ``rope_inv_freq`` both None: no RoPE; else rotate-half RoPE on all ``head_dim`` dims of
    q and k at ``positions [T]`` or ``[B, T]`` (default ``0..T-1``), cos / sin times ``rope_attention_scaling``.
    ``attention_mask [B, T]`` (1 = token, 0 = padding) hides padded keys.
    """
    # non-finite weights are taken: the reference carries them where the math does
    wq, wk, wv, wo, h, g, d, dv, hidden = _source(source, num_heads, num_groups, head_dim, v_head_dim, finite=False)
    wq, wk, wv, wo = (w.detach().to(**_F64) for w in (wq, wk, wv, wo))
    if check_dense("x", x).dim() != 3 or x.shape[2] != hidden:
        raise ValueError(f"x: expected a tensor [B, T, {hidden}] (the source's hidden size), got {list(x.shape)}")
    if not x.is_floating_point() or x.device.type == "meta":
        raise TypeError(f"x: expected a real floating tensor with values, got {x.dtype} on {x.device}")
    x = x.detach().to(**_F64)
    B, T, _ = x.shape
    scale = check_scale("softmax_scale", softmax_scale, d ** -0.5)
    rope_attention_scaling = check_positive_real("rope_attention_scaling", rope_attention_scaling)
    if rope_theta is not None:
        rope_theta = check_positive_real("rope_theta", rope_theta)
    if positions is not None:
        check_dense("positions", positions)
        want = f"an integer tensor [{T}] or [{B}, {T}] with values"
        if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
            raise TypeError(f"positions: expected {want}, got {positions.dtype}")
        if positions.shape not in ((T,), (B, T)) or positions.device.type == "meta":
            raise ValueError(f"positions: expected {want}, got {list(positions.shape)} on {positions.device}")
    if attention_mask is not None and (check_dense("attention_mask", attention_mask).shape != (B, T)
                                       or attention_mask.device.type == "meta"):
        raise ValueError(f"attention_mask: expected a tensor [{B}, {T}] (1 = token, 0 = padding), got "
                         f"{list(attention_mask.shape)} on {attention_mask.device}")
    q = (x @ wq.T).view(B, T, h, d)
    k = (x @ wk.T).view(B, T, g, d)
    v = (x @ wv.T).view(B, T, g, dv)
    if rope_theta is not None or rope_inv_freq is not None:
        inv = _source_inv_freq(d, rope_theta if rope_theta is not None else 1.0, rope_inv_freq)
        pos = positions.to("cpu") if positions is not None else torch.arange(T)
        pos = pos.expand(B, T) if pos.dim() == 1 else pos
        q, k = (apply_rope(t, pos, inv_freq=inv) * rope_attention_scaling for t in (q, k))
    k, v = k.repeat_interleave(h // g, 2), v.repeat_interleave(h // g, 2)
    s = torch.einsum("bthd,bshd->bhts", q, k) * scale
    hide = torch.ones(T, T, dtype=torch.bool).triu(1)[None, None]
    if attention_mask is not None:
        hide = hide | (attention_mask.to("cpu") == 0)[:, None, None, :]
    s = s.masked_fill(hide, -math.inf)
    p = torch.where(hide.all(-1, keepdim=True), 0.0, torch.softmax(s, -1))  # a query that sees no key: 0
    o = torch.einsum("bhts,bshd->bthd", p, v).reshape(B, T, h * dv)
    return o @ wo.T
