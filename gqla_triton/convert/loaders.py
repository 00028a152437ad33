"""Loaders of DeepSeek-layout attention checkpoints into ``GQLAttention``.

Checkpoint layout (one attention layer's state dict, optional ``prefix``)::

    q_proj.weight            [h·(d_nope + d_R), hidden]        or q_a_proj.weight [q_rank, hidden],
                                                                  q_a_layernorm.weight [q_rank], q_b_proj.weight
    kv_a_proj_with_mqa.weight [r + d_R, hidden]                latent rows, then the shared rope key's rows
    kv_a_layernorm.weight     [r]
    kv_b_proj.weight          [n·(d_nope + d_v), r]            per up-projection block: W_UK (d_nope rows), W_UV
    o_proj.weight             [hidden, h·d_v]

with ``n = g`` (GQLA, the paper's layout: one up-projection per group) or ``n = h`` (MLA: one per head). The rope
part of each query head and the rope key are rotated as interleaved pairs ``(2i, 2i + 1)`` at ``theta^(-2i/d_R)``
(``rope_interleaved=True``, DeepSeek's convention); ``GQLAttention`` rotates halves ``(i, i + d_R/2)``, so the
loaders permute those rows (``[0, 2, 4, ..., 1, 3, 5, ...]``), which leaves every score unchanged.

- ``load_gqla``: the paper's layout, loaded as is (exact).
- ``mla_to_gqla``: MLA -> GQLA by per-group PCA of the up-projections. For group ``j`` (heads ``i`` with
  ``γ(i) = j``) the stacked ``[W_UK[i]]`` (``rep·d_nope x r``) has the SVD ``U S Vᵀ``; the group key is
  ``W_UK'[j] = (S Vᵀ)[:d_h]`` and head ``i``'s query is mapped by ``U_iᵀ`` (its rows of ``U[:, :d_h]``), so
  ``q_iᵀ W_UK[i] c ≈ (U_iᵀ q_i)ᵀ W_UK'[j] c``. Values alike: ``W_UV'[j] = (S Vᵀ)[:d_v']`` and head ``i``'s
  ``o_proj`` columns ``W_O[i] U_i``. Exact when ``d_h >= rank`` and ``d_v' >= rank`` of the stacks (always when
  ``d_h >= min(rep·d_nope, r)``, ``d_v' >= min(rep·d_v, r)``); truncation keeps the top singular directions.
"""

from __future__ import annotations

import torch

from ..layers.gqla import GQLAttention
from ..layers.rope import check_rope_dim
from ..ops._common.validation import (
    check_dense,
    check_device,
    check_flag,
    check_float_dtype,
    check_int_type,
    check_optional_int,
    check_positive_int,
)
from .trans_gqla import beyond_range

__all__ = ["load_gqla", "mla_to_gqla", "interleaved_to_half"]

_F64 = dict(dtype=torch.float64, device="cpu")


def interleaved_to_half(d: int) -> torch.Tensor:
    """Row order taking interleaved rope pairs ``(2i, 2i + 1)`` to rotate-half pairs ``(i, i + d/2)``."""
    d = check_rope_dim("d", d)
    return torch.arange(d).view(-1, 2).t().reshape(-1)


def _check_heads(num_heads, num_groups) -> None:
    """``num_heads`` a positive int, ``num_groups`` a positive divisor of it."""
    check_positive_int("num_heads", num_heads)
    check_int_type("num_groups", num_groups, f"a positive divisor of num_heads {num_heads}")
    if num_groups <= 0 or num_heads % num_groups:
        raise ValueError(f"num_groups: expected a positive divisor of num_heads {num_heads}, got {num_groups!r}")


def _get(sd: dict, prefix: str, name: str, shape) -> torch.Tensor:
    key = prefix + name
    if key not in sd:
        raise ValueError(f"state_dict: missing {key!r}")
    t = check_dense(f"state_dict: {key!r}", sd[key])
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"state_dict: {key!r} expected shape {list(shape)}, got {list(t.shape)}")
    if not t.is_floating_point() or t.element_size() < 2:
        raise TypeError(f"state_dict: {key!r} expected a real floating tensor of 16 bits or more, got {t.dtype} "
                        "(float8 weights need their scales: dequantise them first)")
    if t.device.type == "meta":
        raise ValueError(f"state_dict: {key!r} is on the meta device (it holds no values)")
    if not torch.isfinite(t.detach()).all():
        raise ValueError(f"state_dict: {key!r} has non-finite values")
    return t.detach().to(**_F64)


def _hidden(sd: dict, prefix: str, q_in: str) -> int:
    """The hidden size: the width that the query input weight ``q_in``, ``kv_a_proj_with_mqa`` (inputs) and
    ``o_proj`` (outputs) share. Where one of the three differs, the others' width is taken (``_get`` then names the
    odd one); three different widths are a ``ValueError`` naming them."""
    widths = {}
    for name, dim, shape in ((q_in, 1, "[rows, hidden]"),
                             ("kv_a_proj_with_mqa.weight", 1, "[kv_rank + rope_dim, hidden]"),
                             ("o_proj.weight", 0, "[hidden, num_heads·v_head_dim]")):
        key = prefix + name
        if key not in sd:
            raise ValueError(f"state_dict: missing {key!r}")
        t = check_dense(f"state_dict: {key!r}", sd[key])
        if t.dim() != 2:
            raise ValueError(f"state_dict: {key!r} expected a 2-D weight {shape}, got {list(t.shape)}")
        widths[key] = t.shape[dim]
    sizes = sorted(widths.values())
    if sizes[0] != sizes[1] and sizes[1] != sizes[2]:
        raise ValueError(f"state_dict: the hidden sizes of {widths} disagree")
    return sizes[1]


def _read(sd, prefix, *, h, n, d_nope, d_R, d_v, r, q_rank, rope_interleaved):
    """The checkpoint's weights in float64, rope rows in rotate-half order; q as [h, d_nope + d_R, in]."""
    if not isinstance(sd, dict):
        raise TypeError(f"state_dict: expected a dict of tensors, got {type(sd).__name__}")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix: expected a str, got {type(prefix).__name__}")
    rope_interleaved = check_flag("rope_interleaved", rope_interleaved)
    for name, v in (("num_heads", h), ("head_dim", d_nope), ("v_head_dim", d_v), ("kv_rank", r)):
        check_positive_int(name, v)
    q_rank = check_optional_int("q_rank", q_rank)
    want = ({"q_proj.weight"} if q_rank is None else {"q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"}) | {
        "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"}
    extra = sorted(k for k in sd if isinstance(k, str) and k.startswith(prefix) and k[len(prefix):] not in want)
    if extra:  # a bias, FP8 scales or a query path other than q_rank's would otherwise be dropped
        raise ValueError(f"state_dict: unexpected keys {extra} (the attention with q_rank={q_rank} has "
                         f"{sorted(prefix + k for k in want)})")
    check_int_type("rope_dim", d_R, "an even int >= 0")  # no int32 bound: a width past the rows is named below
    if d_R < 0 or d_R % 2:
        raise ValueError(f"rope_dim: expected an even int >= 0, got {d_R!r}")
    hidden = _hidden(sd, prefix, "q_proj.weight" if q_rank is None else "q_a_proj.weight")
    kva = _get(sd, prefix, "kv_a_proj_with_mqa.weight", (r + d_R, hidden))  # bounds d_R before the permutation
    perm = interleaved_to_half(d_R) if rope_interleaved else torch.arange(d_R)
    out = {}
    qd = d_nope + d_R
    if q_rank is None:
        q = _get(sd, prefix, "q_proj.weight", (h * qd, hidden))
    else:
        out["q_a_proj"] = _get(sd, prefix, "q_a_proj.weight", (q_rank, hidden))
        out["q_a_layernorm"] = _get(sd, prefix, "q_a_layernorm.weight", (q_rank,))
        q = _get(sd, prefix, "q_b_proj.weight", (h * qd, q_rank))
    q = q.view(h, qd, -1)
    out["q"] = torch.cat([q[:, :d_nope], q[:, d_nope:][:, perm]], 1)
    out["kv_a"] = torch.cat([kva[:r], kva[r:][perm]])
    out["kv_a_layernorm"] = _get(sd, prefix, "kv_a_layernorm.weight", (r,))
    out["kv_b"] = _get(sd, prefix, "kv_b_proj.weight", (n * (d_nope + d_v), r)).view(n, d_nope + d_v, r)
    out["o"] = _get(sd, prefix, "o_proj.weight", (hidden, h * d_v))
    out["hidden"] = hidden
    return out


def _build(w, *, h, g, d_h, d_R, d_v, r, q_rank, q, kv_b, o, rope_theta, rope_inv_freq, softmax_scale, norm_eps,
           path, impl, device, dtype):
    device = check_device(device, storage=True)  # a meta layer would drop the loaded values
    check_float_dtype(dtype)
    weights = {"q_proj" if q_rank is None else "q_b_proj": q, "kv_a_proj": w["kv_a"],
               "kv_a_layernorm": w["kv_a_layernorm"], "kv_b_proj": kv_b, "o_proj": o}
    if q_rank is not None:
        weights.update(q_a_proj=w["q_a_proj"], q_a_layernorm=w["q_a_layernorm"])
    target = dtype or torch.get_default_dtype()
    wide = beyond_range(weights, target)  # before the layer is made: inf weights would load silently
    if wide is not None:
        raise ValueError(f"dtype: the loaded {wide[0]} weights reach {wide[1]:.3g}, beyond {target}'s range; load "
                         "into a wider dtype")
    layer = GQLAttention(w["hidden"], h, g, d_h, d_R, r, q_rank, d_v, rope_theta, softmax_scale, path, impl,
                         device=device, dtype=dtype, norm_eps=norm_eps, rope_inv_freq=rope_inv_freq)
    with torch.no_grad():
        if q_rank is None:
            layer.q_proj.weight.copy_(q.reshape(h * (d_h + d_R), -1))
        else:
            layer.q_a_proj.weight.copy_(w["q_a_proj"])
            layer.q_a_layernorm.weight.copy_(w["q_a_layernorm"])
            layer.q_b_proj.weight.copy_(q.reshape(h * (d_h + d_R), -1))
        layer.kv_a_proj.weight.copy_(w["kv_a"])
        layer.kv_a_layernorm.weight.copy_(w["kv_a_layernorm"])
        layer.kv_b_proj.weight.copy_(kv_b.reshape(g * (d_h + d_v), r))
        layer.o_proj.weight.copy_(o)
    return layer


def load_gqla(state_dict: dict, *, num_heads: int, num_groups: int, head_dim: int, rope_dim: int, kv_rank: int,
              q_rank: int | None = None, v_head_dim: int | None = None, rope_theta: float = 10000.0,
              rope_inv_freq: torch.Tensor | None = None, rope_interleaved: bool = True,
              softmax_scale: float | None = None, norm_eps: float = 1e-6, prefix: str = "", path: str = "auto",
              impl: str = "auto", device=None, dtype=torch.bfloat16) -> GQLAttention:
    """A ``GQLAttention`` from a checkpoint in the paper's layout (module docstring; ``kv_b_proj`` per group).

    ``head_dim`` = d_nope, ``rope_dim`` = d_R, ``softmax_scale`` default ``(d_nope + d_R)^-0.5``; ``rope_inv_freq
    [d_R/2]`` replaces ``rope_theta``'s frequencies (e.g. YaRN's). Exact: only the rope rows are reordered.
    """
    _check_heads(num_heads, num_groups)
    check_optional_int("q_rank", q_rank)
    d_v = head_dim if v_head_dim is None else v_head_dim
    w = _read(state_dict, prefix, h=num_heads, n=num_groups, d_nope=head_dim, d_R=rope_dim, d_v=d_v, r=kv_rank,
              q_rank=q_rank, rope_interleaved=rope_interleaved)
    return _build(w, h=num_heads, g=num_groups, d_h=head_dim, d_R=rope_dim, d_v=d_v, r=kv_rank, q_rank=q_rank,
                  q=w["q"], kv_b=w["kv_b"], o=w["o"], rope_theta=rope_theta, rope_inv_freq=rope_inv_freq,
                  softmax_scale=softmax_scale, norm_eps=norm_eps, path=path, impl=impl, device=device, dtype=dtype)


def _group_pca(stack: torch.Tensor, k: int):
    """``stack [rep, d, r]`` -> per-head maps ``[rep, d, k]`` and the shared ``[k, r]``: the top-k SVD of the
    stacked ``[rep·d, r]`` (zero-padded past its rank)."""
    rep, d, r = stack.shape
    U, S, Vh = torch.linalg.svd(stack.reshape(rep * d, r), full_matrices=False)
    m = min(k, S.shape[0])
    left = torch.zeros(rep * d, k, **_F64)
    shared = torch.zeros(k, r, **_F64)
    left[:, :m] = U[:, :m]
    shared[:m] = S[:m, None] * Vh[:m]
    return left.view(rep, d, k), shared


def mla_to_gqla(state_dict: dict, *, num_heads: int, num_groups: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                v_head_dim: int, kv_rank: int, head_dim: int | None = None, group_v_head_dim: int | None = None,
                q_rank: int | None = None, rope_theta: float = 10000.0, rope_inv_freq: torch.Tensor | None = None,
                rope_interleaved: bool = True, softmax_scale: float | None = None, norm_eps: float = 1e-6,
                prefix: str = "", path: str = "auto", impl: str = "auto", device=None,
                dtype=torch.bfloat16) -> GQLAttention:
    """A ``GQLAttention`` with ``num_groups`` groups from a DeepSeek-style MLA checkpoint (``kv_b_proj`` per head)
    by per-group PCA of the up-projections (module docstring).

    ``head_dim`` / ``group_v_head_dim``: the GQLA group key / value widths d_h, d_v' (default: exact,
    ``min(rep·d, kv_rank)`` rounded up to a multiple of 16 for the grouped kernels). ``softmax_scale`` default
    the source's ``(qk_nope_head_dim + qk_rope_head_dim)^-0.5``. The PCA runs in float64.
    """
    h, g = num_heads, num_groups
    _check_heads(h, g)
    dn, dR, dv, r = qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_rank
    check_positive_int("qk_nope_head_dim", dn)
    check_rope_dim("qk_rope_head_dim", dR)
    w = _read(state_dict, prefix, h=h, n=h, d_nope=dn, d_R=dR, d_v=dv, r=r, q_rank=q_rank,
              rope_interleaved=rope_interleaved)
    rep = h // g

    def width(name, v, d):
        if v is None:
            return -(-min(rep * d, r) // 16) * 16
        return check_positive_int(name, v)

    d_h, d_v2 = width("head_dim", head_dim, dn), width("group_v_head_dim", group_v_head_dim, dv)
    kv_b = w["kv_b"].view(g, rep, dn + dv, r)
    q, o = w["q"], w["o"].view(-1, g, rep, dv)
    q_nope = q[:, :dn].reshape(g, rep, dn, -1)
    new_q, new_kv, new_o = [], [], []
    for j in range(g):
        uk, k_shared = _group_pca(kv_b[j, :, :dn], d_h)  # [rep, dn, d_h], [d_h, r]
        uv, v_shared = _group_pca(kv_b[j, :, dn:], d_v2)  # [rep, dv, d_v'], [d_v', r]
        new_q.append(torch.einsum("idk,idx->ikx", uk, q_nope[j]))
        new_kv.append(torch.cat([k_shared, v_shared]))
        new_o.append(torch.einsum("oid,idk->oik", o[:, j], uv))
    q = torch.cat([torch.cat(new_q), q[:, dn:]], 1)
    o = torch.stack(new_o, 1).reshape(o.shape[0], h * d_v2)
    scale = (dn + dR) ** -0.5 if softmax_scale is None else softmax_scale
    return _build(w, h=h, g=g, d_h=d_h, d_R=dR, d_v=d_v2, r=r, q_rank=q_rank, q=q, kv_b=torch.stack(new_kv),
                  o=o, rope_theta=rope_theta, rope_inv_freq=rope_inv_freq, softmax_scale=scale, norm_eps=norm_eps,
                  path=path, impl=impl, device=device, dtype=dtype)
