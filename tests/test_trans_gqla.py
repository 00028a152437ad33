"""TransGQLA (GQA with RoPE -> GQLA conversion) and tensor-parallel sharding of GQLAttention along groups."""

import copy
import math

import pytest
import torch
from harness import P, assert_close, dtypes, gen, pick, rand, randn, rel_err, seeds
from hypothesis import given
from hypothesis import strategies as st
from test_gqla_layer import PAGE, make_layer

from gqla_triton.convert import gqa_attention_reference, load_gqla, mla_to_gqla, trans_gqla
from gqla_triton.layers import GQLAttention
from gqla_triton.testing import gqla_reference


def gqa_source(seed, *, hidden, h, g, d, dv=None):
    dv = dv or d
    gg = gen(seed)
    shapes = dict(q_proj=(h * d, hidden), k_proj=(g * d, hidden), v_proj=(g * dv, hidden), o_proj=(hidden, h * dv))
    return {n: randn(s, gg, dtype=torch.float64, device="cpu", scale=s[1] ** -0.5) for n, s in shapes.items()}


@given(g=st.sampled_from([1, 2, 4]), d=st.sampled_from([8, 16]), T=st.integers(1, 12), seed=seeds())
def test_full_rank_reproduces_norope_gqa_exactly(g, d, T, seed):
    hidden, h = 48, 8
    src = gqa_source(seed, hidden=hidden, h=h, g=g, d=d)
    x = randn((2, T, hidden), seed + 1, dtype=torch.float64, device="cpu")
    ref = gqa_attention_reference(src, x, num_heads=h, num_groups=g, head_dim=d)
    full = min(g * 2 * d, hidden)  # rank of the stacked [W_K; W_V]
    for r in (full, full + 5):
        layer = trans_gqla(src, num_heads=h, num_groups=g, head_dim=d, kv_rank=r, impl="reference")
        pos = torch.arange(T)[None].expand(2, T)
        assert rel_err(gqla_reference(layer, x, pos), ref) < 1e-12
        assert rel_err(layer(x, pos), ref) < 1e-12  # the module's own (SDPA) prefill


def balanced(src, g, d, hidden):
    """The stacked per-group [α·K; V] maps of a rope-free conversion, α = ‖W_V‖ / ‖W_K‖ (the K/V balancing)."""
    k, v = src["k_proj"].view(g, d, hidden), src["v_proj"].view(g, d, hidden)
    alpha = (v.norm() / k.norm()).item()
    return alpha, torch.cat([alpha * k, v], 1).reshape(-1, hidden)


@given(g=st.sampled_from([2, 4]), seed=seeds())
def test_error_decreases_with_rank(g, seed):
    hidden, h, d = 64, 8, 16
    src = gqa_source(seed, hidden=hidden, h=h, g=g, d=d)
    x = randn((2, 16, hidden), seed + 1, dtype=torch.float64, device="cpu")
    ref = gqa_attention_reference(src, x, num_heads=h, num_groups=g, head_dim=d)
    pos = torch.arange(16)[None].expand(2, 16)
    alpha, W = balanced(src, g, d, hidden)
    scale = torch.ones(g, 2 * d, 1, dtype=torch.float64)
    scale[:, :d] = alpha
    full = min(W.shape[0], hidden)
    w_errs, o_errs = [], []
    for r in sorted({1, full // 8, full // 4, full // 2, 3 * full // 4, full}):
        layer = trans_gqla(src, num_heads=h, num_groups=g, head_dim=d, kv_rank=r, impl="reference")
        wb = layer.kv_b_proj.weight.detach().double()
        wa = layer.kv_a_proj.weight.detach().double()
        w_errs.append(rel_err((scale * (wb @ wa).view(g, 2 * d, hidden)).reshape(W.shape), W))  # balanced K/V maps
        o_errs.append(rel_err(gqla_reference(layer, x, pos), ref))
    assert all(a > b for a, b in zip(w_errs[:-1], w_errs[1:], strict=True)), w_errs
    assert w_errs[-1] < 1e-12 and o_errs[-1] < 1e-12
    # layer output error: decreasing (the last steps are the large ones; allow tiny non-monotone wiggles early)
    assert all(b <= a * 1.05 for a, b in zip(o_errs[:-1], o_errs[1:], strict=True)), o_errs
    assert o_errs[0] > 10 * o_errs[-2] or o_errs[-2] > o_errs[-1]


def test_calibrated_factorization_beats_plain_on_its_data():
    hidden, h, g, d = 64, 8, 4, 16
    src = gqa_source(3, hidden=hidden, h=h, g=g, d=d)
    # activations concentrated in a 12-dim subspace: a data-aware latent of rank 12 captures them exactly
    basis = randn((12, hidden), 4, dtype=torch.float64, device="cpu")
    x = randn((2, 20, 12), 5, dtype=torch.float64, device="cpu") @ basis
    ref = gqa_attention_reference(src, x, num_heads=h, num_groups=g, head_dim=d)
    pos = torch.arange(20)[None].expand(2, 20)
    plain = trans_gqla(src, num_heads=h, num_groups=g, head_dim=d, kv_rank=12, impl="reference")
    calib = trans_gqla(src, num_heads=h, num_groups=g, head_dim=d, kv_rank=12, calib=x, impl="reference")
    e_plain, e_cal = rel_err(gqla_reference(plain, x, pos), ref), rel_err(gqla_reference(calib, x, pos), ref)
    assert e_cal < 1e-10 < e_plain


def rope_setup(seed, *, hidden, h, g, d, T, dv=None):
    """A source with RoPE at random (sorted, positive) inverse frequencies and attention scaling, its input, the
    positions (strided, so large angles) and the float64 reference output."""
    src = gqa_source(seed, hidden=hidden, h=h, g=g, d=d, dv=dv)
    inv = rand((d // 2,), seed + 2, lo=0.01, hi=1.0, dtype=torch.float64, device="cpu").sort(descending=True).values
    x = randn((2, T, hidden), seed + 1, dtype=torch.float64, device="cpu")
    pos = torch.arange(T) * 5 + 3
    rope = dict(rope_inv_freq=inv, rope_attention_scaling=1.1)
    ref = gqa_attention_reference(src, x, num_heads=h, num_groups=g, head_dim=d, v_head_dim=dv, positions=pos,
                                  **rope)
    return src, rope, x, pos, ref


@given(g=st.sampled_from([1, 2, 4]), d=st.sampled_from([8, 16]), dv=st.sampled_from([None, 8]),
       T=st.integers(1, 10), seed=seeds())
def test_full_rank_with_rope_is_exact(g, d, dv, T, seed):
    """d_R = g·d keeps every rotary component, r = g·(d + d_v) every K/V direction: the RoPE source exactly."""
    hidden, h = 48, 8
    src, rope, x, pos, ref = rope_setup(seed, hidden=hidden, h=h, g=g, d=d, T=T, dv=dv)
    layer = trans_gqla(src, num_heads=h, num_groups=g, head_dim=d, v_head_dim=dv, kv_rank=g * (d + (dv or d)),
                       rope_dim=g * d, impl="reference", **rope)
    with torch.no_grad():
        assert rel_err(layer(x, pos), ref) < 1e-12
    assert layer.rope_inv_freq is not None and layer.rope_inv_freq.shape == (g * d // 2,)


@given(g=st.sampled_from([2, 4]), seed=seeds())
def test_rope_error_decreases_with_rope_dim(g, seed):
    """At full latent rank, keeping more rotary components never hurts much and keeping all of them is exact."""
    hidden, h, d = 64, 8, 16
    src, rope, x, pos, ref = rope_setup(seed, hidden=hidden, h=h, g=g, d=d, T=12)
    errs = []
    for dR in range(0, g * d + 1, g * d // 4):
        layer = trans_gqla(src, num_heads=h, num_groups=g, head_dim=d, kv_rank=2 * g * d, rope_dim=dR,
                           impl="reference", **rope)
        with torch.no_grad():
            errs.append(rel_err(layer(x, pos), ref))
    assert all(b <= a * 1.05 for a, b in zip(errs[:-1], errs[1:], strict=True)), errs
    assert errs[0] > 10 * errs[-2] or errs[-2] > 2 * errs[-1]
    assert errs[-1] < 1e-12 < errs[0]


def test_rope_calibrated_beats_plain_on_its_data():
    """RoPE kept exactly (d_R = g·d), values through a rank-10 latent: activations in a 10-dim subspace make the
    calibrated latent exact on them, the weight-only one not."""
    hidden, h, g, d = 64, 8, 4, 16
    src, rope, _, pos, _ = rope_setup(11, hidden=hidden, h=h, g=g, d=d, T=16)
    basis = randn((10, hidden), 12, dtype=torch.float64, device="cpu")
    x = randn((2, 16, 10), 13, dtype=torch.float64, device="cpu") @ basis
    ref = gqa_attention_reference(src, x, num_heads=h, num_groups=g, head_dim=d, positions=pos, **rope)
    kw = dict(num_heads=h, num_groups=g, head_dim=d, kv_rank=10, rope_dim=g * d, impl="reference", **rope)
    with torch.no_grad():
        e_plain = rel_err(trans_gqla(src, **kw)(x, pos), ref)
        e_cal = rel_err(trans_gqla(src, **kw, calib=x)(x, pos), ref)
    assert e_cal < 1e-10 < e_plain, (e_cal, e_plain)


@given(seed=seeds())
def test_kv_balancing_helps_when_keys_dominate(seed):
    """Keys 10x the values' norm: unbalanced, the joint PCA spends the latent on the keys and the values suffer."""
    hidden, h, g, d = 64, 8, 4, 16
    src = gqa_source(seed, hidden=hidden, h=h, g=g, d=d)
    src["v_proj"] = src["v_proj"] * 0.1
    x = randn((2, 12, hidden), seed + 1, dtype=torch.float64, device="cpu")
    pos = torch.arange(12)
    ref = gqa_attention_reference(src, x, num_heads=h, num_groups=g, head_dim=d, positions=pos, rope_theta=100.0)
    kw = dict(num_heads=h, num_groups=g, head_dim=d, kv_rank=48, rope_dim=16, rope_theta=100.0, impl="reference")
    with torch.no_grad():
        e_bal = rel_err(trans_gqla(src, **kw)(x, pos), ref)
        e_raw = rel_err(trans_gqla(src, **kw, balance_kv=False)(x, pos), ref)
    assert e_bal < 0.9 * e_raw, (e_bal, e_raw)


@given(path=st.sampled_from(["absorb", "grouped"]), dtype=dtypes(), seed=seeds())
def test_converted_layer_decodes_on_both_paths(path, dtype, seed):
    """Converted at ``dtype``: the float64 conversion's weights rounded; prefill then two decode steps against the
    float64 reference of those weights, within the error of the same steps in torch at ``dtype``
    (``impl="reference"``, its own cache)."""
    hidden, h, g, d = pick((64, 8, 2, 32), (1024, 32, 8, 128))
    dR = 16 if not P.big else 64
    src = gqa_source(seed, hidden=hidden, h=h, g=g, d=d)
    kw = dict(num_heads=h, num_groups=g, head_dim=d, kv_rank=pick(32, 512), rope_dim=dR, rope_theta=500.0)
    layer = trans_gqla(src, **kw, device=P.device, dtype=dtype)
    sd64 = trans_gqla(src, **kw, dtype=torch.float64, device="cpu", impl="reference").state_dict()
    assert all(torch.equal(v.cpu(), sd64[k].to(v.dtype)) for k, v in layer.state_dict().items())
    low = copy.deepcopy(layer)
    low.impl = "reference"
    T0, B = pick(20, 300), 2
    x = randn((B, T0 + 2, hidden), seed + 1, dtype=dtype)
    pos = torch.arange(T0 + 2)
    ref = gqla_reference(layer, x, pos[None].expand(B, -1))  # float64 (the layer's frequencies are not theta's)
    outs = []
    with torch.no_grad():
        for m in (layer, low):
            cache = m.make_cache(B, T0 + 2, path=path, page_size=PAGE)
            m(x[:, :T0], pos[:T0], cache)
            outs.append(torch.cat([m(x[:, T0:T0 + 1], None, cache), m(x[:, T0 + 1:], None, cache)], 1))
    assert_close("converted decode", outs[0], ref[:, T0:], outs[1], dtype=dtype)


def test_shards_of_converted_layer_keep_frequencies():
    hidden, h, g, d = 48, 8, 4, 8
    src, rope, x, pos, ref = rope_setup(5, hidden=hidden, h=h, g=g, d=d, T=6)
    layer = trans_gqla(src, num_heads=h, num_groups=g, head_dim=d, kv_rank=g * 2 * d, rope_dim=g * d,
                       impl="reference", **rope)
    with torch.no_grad():
        parts = [layer.shard(r, 2)(x, pos) for r in range(2)]
    assert rel_err(sum(parts), ref) < 1e-12


@given(tp=st.sampled_from([1, 2, 4]), q_rank=st.sampled_from([None, 24]), decode=st.booleans(), seed=seeds())
def test_tp_shards_sum_to_full_layer(tp, q_rank, decode, seed):
    layer = make_layer(seed, g=4, q_rank=q_rank, dtype=torch.float64, device="cpu", impl="reference")
    x = randn((2, 6, layer.hidden_size), seed + 1, dtype=torch.float64, device="cpu")
    pos = torch.arange(6)
    with torch.no_grad():
        if decode:  # prefill 4 tokens into per-shard caches, then decode 2 (MTP)
            caches = [None] * (tp + 1)
            shards = [layer] + [layer.shard(r, tp) for r in range(tp)]
            outs = []
            for i, m in enumerate(shards):
                caches[i] = m.make_cache(2, 6, path="grouped" if i % 2 else "absorb", page_size=16)
                m(x[:, :4], pos[:4], caches[i])
                outs.append(m(x[:, 4:], pos[4:], caches[i]))
            full, parts = outs[0], outs[1:]
        else:
            full = layer(x, pos)
            parts = [layer.shard(r, tp)(x, pos) for r in range(tp)]
    for r in range(tp):
        s = layer.shard(r, tp)
        assert s.num_groups == 4 // tp and s.num_heads == layer.num_heads // tp
    assert rel_err(sum(parts), full) < 1e-12


def test_trans_gqla_bad_inputs():
    src = gqa_source(0, hidden=32, h=4, g=2, d=8)
    kw = dict(num_heads=4, num_groups=2, head_dim=8, kv_rank=8)
    with pytest.raises(ValueError, match=r"^k_proj: expected weight shape \[16, 32\] \(num_groups·head_dim\)"):
        trans_gqla({**src, "k_proj": src["k_proj"][:8]}, **kw)
    with pytest.raises(ValueError, match=r"^source: missing weights \['o_proj'\]"):
        trans_gqla({k: v for k, v in src.items() if k != "o_proj"}, **kw)
    with pytest.raises(ValueError, match="^num_heads: 3 is not a multiple of num_groups 2"):
        trans_gqla(src, **{**kw, "num_heads": 3})
    with pytest.raises(ValueError, match="^rope_dim: expected an even int >= 0"):
        trans_gqla(src, **kw, rope_dim=3)
    with pytest.raises(ValueError, match=r"^rope_dim: expected an even int in \[0, 16\] \(num_groups \* head_dim\)"):
        trans_gqla(src, **kw, rope_dim=18)  # > g·d
    with pytest.raises(ValueError, match="^kv_rank: expected a positive int"):
        trans_gqla(src, **{**kw, "kv_rank": 0})
    with pytest.raises(ValueError, match=r"^rope_inv_freq: expected a tensor of shape \[4\] \(head_dim / 2\)"):
        trans_gqla(src, **kw, rope_dim=4, rope_inv_freq=torch.ones(3))
    with pytest.raises(ValueError, match="^rope_attention_scaling: expected a positive, finite real number"):
        trans_gqla(src, **kw, rope_dim=4, rope_attention_scaling=0.0)
    with pytest.raises(ValueError, match=r"^calib: expected a non-empty tensor \[\.\.\., 32\]"):
        trans_gqla(src, **kw, calib=torch.ones(5, 31))
    calib = torch.ones(5, 32, dtype=torch.float64)
    for bad, exc, why in ((calib.int(), TypeError, "expected a real floating tensor"),
                          (calib.to(torch.complex128), TypeError, "expected a real floating tensor"),
                          (calib.index_fill(0, torch.tensor([2]), math.nan), ValueError, "has non-finite values"),
                          (calib * 1e200, ValueError, "its covariance overflows float64")):
        with pytest.raises(exc, match=f"^calib: {why}"):
            trans_gqla(src, **kw, calib=bad)
    for bad, exc, why in ((torch.ones(4, dtype=torch.complex64), TypeError, "expected a real floating tensor"),
                          (torch.tensor([1.0, 1.0, 1.0, math.inf]), ValueError, "expected finite values")):
        with pytest.raises(exc, match=f"^rope_inv_freq: {why}"):
            trans_gqla(src, **kw, rope_dim=4, rope_inv_freq=bad)
    with pytest.raises(TypeError, match="^dtype: expected None or a floating torch.dtype of 16 bits or more"):
        trans_gqla(src, **kw, dtype=torch.int32)
    with pytest.raises(TypeError, match="^balance_kv: expected a bool"):
        trans_gqla(src, **kw, balance_kv="no")
    with pytest.raises(TypeError, match="^dtype: expected None or a floating torch.dtype of 16 bits or more"):
        GQLAttention(32, 4, 2, 8, 4, 8, dtype=torch.int32)


# ---- DeepSeek-layout checkpoints: the paper's GQLA layout and MLA -> GQLA ----------------------------------------

def deepseek_checkpoint(seed, *, hidden, h, n, dn, dR, dv, r, q_rank=None):
    """Random float64 weights of one attention in the DeepSeek layout with ``n`` up-projection blocks."""
    gg = gen(seed)
    shapes = {"kv_a_proj_with_mqa.weight": (r + dR, hidden), "kv_b_proj.weight": (n * (dn + dv), r),
              "o_proj.weight": (hidden, h * dv)}
    if q_rank is None:
        shapes["q_proj.weight"] = (h * (dn + dR), hidden)
    else:
        shapes.update({"q_a_proj.weight": (q_rank, hidden), "q_b_proj.weight": (h * (dn + dR), q_rank)})
    sd = {k: randn(s, gg, dtype=torch.float64, device="cpu", scale=s[1] ** -0.5) for k, s in shapes.items()}
    sd["kv_a_layernorm.weight"] = rand((r,), gg, lo=0.5, hi=1.5, dtype=torch.float64, device="cpu")
    if q_rank is not None:
        sd["q_a_layernorm.weight"] = rand((q_rank,), gg, lo=0.5, hi=1.5, dtype=torch.float64, device="cpu")
    return sd


def deepseek_reference(sd, x, pos, *, h, n, dn, dR, dv, r, theta, eps=1e-6):
    """Float64 DeepSeek-style attention (interleaved rope pairs rotated as complex numbers), head i reading
    up-projection block ``i // (h / n)``."""
    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w

    B, T, _ = x.shape
    if "q_proj.weight" in sd:
        q = x @ sd["q_proj.weight"].T
    else:
        q = rms(x @ sd["q_a_proj.weight"].T, sd["q_a_layernorm.weight"]) @ sd["q_b_proj.weight"].T
    q = q.view(B, T, h, dn + dR)
    kva = x @ sd["kv_a_proj_with_mqa.weight"].T
    c, kpe = rms(kva[..., :r], sd["kv_a_layernorm.weight"]), kva[..., r:]
    ang = pos[:, None].double() * theta ** (-torch.arange(0, dR, 2, dtype=torch.float64) / dR)
    rot = torch.polar(torch.ones_like(ang), ang)  # [T, dR/2]

    def rope(t):
        tc = torch.view_as_complex(t.reshape(*t.shape[:-1], dR // 2, 2).contiguous())
        return torch.view_as_real(tc * rot.view(T, *([1] * (t.dim() - 3)), dR // 2)).flatten(-2)

    qn, qr, kr = q[..., :dn], rope(q[..., dn:]), rope(kpe)
    kv = (c @ sd["kv_b_proj.weight"].T).view(B, T, n, dn + dv).repeat_interleave(h // n, 2)
    s = torch.einsum("bthd,bshd->bhts", qn, kv[..., :dn]) + torch.einsum("bthd,bsd->bhts", qr, kr)
    s = (s * (dn + dR) ** -0.5).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhts,bshd->bthd", s.softmax(-1), kv[..., dn:]).reshape(B, T, h * dv)
    return o @ sd["o_proj.weight"].T


@given(q_rank=st.sampled_from([None, 24]), g=st.sampled_from([1, 2, 4]), seed=seeds())
def test_load_gqla_paper_layout(q_rank, g, seed):
    hidden, h, dn, dR, dv, r = 48, 8, 16, 16, 16, 32
    sd = deepseek_checkpoint(seed, hidden=hidden, h=h, n=g, dn=dn, dR=dR, dv=dv, r=r, q_rank=q_rank)
    x = randn((2, 7, hidden), seed + 1, dtype=torch.float64, device="cpu")
    pos = torch.arange(7) * 3 + 1
    ref = deepseek_reference(sd, x, pos, h=h, n=g, dn=dn, dR=dR, dv=dv, r=r, theta=300.0)
    layer = load_gqla({"layers.0.attn." + k: v for k, v in sd.items()}, prefix="layers.0.attn.", num_heads=h,
                      num_groups=g, head_dim=dn, rope_dim=dR, kv_rank=r, q_rank=q_rank, v_head_dim=dv,
                      rope_theta=300.0, impl="reference", dtype=torch.float64)
    with torch.no_grad():
        assert rel_err(layer(x, pos), ref) < 1e-12
        cache = layer.make_cache(2, 8, path="grouped" if seed % 2 else "absorb", page_size=PAGE)
        layer(x[:, :5], pos[:5], cache)
        assert rel_err(layer(x[:, 5:], pos[5:], cache), ref[:, 5:]) < 1e-12  # cached decode (MTP 2)


@given(g=st.sampled_from([1, 2, 4]), seed=seeds())
def test_mla_to_gqla_exact_at_full_width_and_monotone(g, seed):
    hidden, h, dn, dR, dv, r = 48, 8, 8, 8, 8, 24
    sd = deepseek_checkpoint(seed, hidden=hidden, h=h, n=h, dn=dn, dR=dR, dv=dv, r=r)
    x = randn((2, 6, hidden), seed + 1, dtype=torch.float64, device="cpu")
    pos = torch.arange(6) * 2
    ref = deepseek_reference(sd, x, pos, h=h, n=h, dn=dn, dR=dR, dv=dv, r=r, theta=1000.0)
    kw = dict(num_heads=h, num_groups=g, qk_nope_head_dim=dn, qk_rope_head_dim=dR, v_head_dim=dv, kv_rank=r,
              rope_theta=1000.0, impl="reference", dtype=torch.float64)
    full = min(h // g * dn, r)
    errs = []
    with torch.no_grad():
        for w in sorted({max(1, full // 4), max(1, full // 2), full}):
            errs.append(rel_err(mla_to_gqla(sd, **kw, head_dim=w, group_v_head_dim=w)(x, pos), ref))
        default = mla_to_gqla(sd, **kw)
        assert default.head_dim % 16 == 0 and rel_err(default(x, pos), ref) < 1e-12
    assert errs[-1] < 1e-12, errs
    assert all(a >= b for a, b in zip(errs[:-1], errs[1:], strict=True)), errs
    assert errs[0] > 1e-6  # truncating the group width costs something


def test_loaders_bad_inputs():
    sd = deepseek_checkpoint(0, hidden=32, h=4, n=2, dn=8, dR=4, dv=8, r=16)
    kw = dict(num_heads=4, num_groups=2, head_dim=8, rope_dim=4, kv_rank=16)
    with pytest.raises(ValueError, match=r"^state_dict: 'kv_b_proj.weight' expected shape \[64, 16\], got \[32, 16\]"):
        load_gqla(sd, **{**kw, "num_groups": 4})  # the checkpoint has 2 blocks
    with pytest.raises(ValueError, match="^state_dict: missing 'o_proj.weight'"):
        load_gqla({k: v for k, v in sd.items() if k != "o_proj.weight"}, **kw)
    with pytest.raises(ValueError, match=r"^state_dict: unexpected keys \['q_proj.weight'\] \(the attention"):
        load_gqla(sd, **kw, q_rank=8)
    with pytest.raises(ValueError, match="^num_groups: expected a positive divisor of num_heads 4, got 3"):
        load_gqla(sd, **{**kw, "num_groups": 3})
    with pytest.raises(TypeError, match="^state_dict: expected a dict of tensors"):
        load_gqla([sd], **kw)
    key = "o_proj.weight"
    for bad, exc, what in ((sd[key].int(), TypeError, "real floating"), (sd[key].bool(), TypeError, "real floating"),
                           (sd[key].to(torch.complex128), TypeError, "real floating"),
                           (sd[key].index_fill(0, torch.tensor([1]), math.nan), ValueError, "non-finite"),
                           (sd[key] * math.inf, ValueError, "non-finite")):
        with pytest.raises(exc, match=f"'{key}'.*{what}"):
            load_gqla({**sd, key: bad}, **kw)
    tensor = ": expected a torch.Tensor"
    for bad, exc, why in ((None, TypeError, tensor), ([1.0], TypeError, tensor),
                          (torch.tensor(1.0), ValueError, r" expected a 2-D weight \[kv_rank \+ rope_dim, hidden\]")):
        with pytest.raises(exc, match=f"^state_dict: 'kv_a_proj_with_mqa.weight'{why}"):
            load_gqla({**sd, "kv_a_proj_with_mqa.weight": bad}, **kw)
    with pytest.raises(TypeError, match="^prefix: expected a str"):
        load_gqla(sd, **kw, prefix=3)
    with pytest.raises(TypeError, match="^rope_interleaved: expected a bool"):
        load_gqla(sd, **kw, rope_interleaved="no")
    with pytest.raises(TypeError, match="^num_groups: expected a positive divisor of num_heads 4, got bool"):
        load_gqla(sd, **{**kw, "num_groups": True})
    with pytest.raises(ValueError, match="^head_dim: expected a positive int"):
        mla_to_gqla(deepseek_checkpoint(0, hidden=32, h=4, n=4, dn=8, dR=4, dv=8, r=16), num_heads=4,
                    num_groups=2, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, kv_rank=16, head_dim=0)


def test_rope_inv_freq_buffer_survives_casts_and_state_dict():
    inv = torch.tensor([1.0, 0.1234567890123, 3e-4, 2.0], dtype=torch.float64)
    layer = GQLAttention(32, 4, 2, 16, 8, 16, rope_inv_freq=inv, impl="reference", dtype=torch.float32)
    assert torch.equal(layer.to(torch.float16).rope_inv_freq, inv)  # the bits are int64: dtype casts skip them
    other = GQLAttention(32, 4, 2, 16, 8, 16, rope_inv_freq=torch.ones(4), impl="reference")
    other.load_state_dict(layer.state_dict())
    assert torch.equal(other.rope_inv_freq, inv)
    x = randn((1, 5, 32), 1, dtype=torch.float64, device="cpu")
    layer, pos = layer.double(), torch.arange(5) * 11
    with torch.no_grad():
        _, q_rope, _, k_rope = layer._project(x, pos[None])
    raw = (x @ layer.kv_a_proj.weight.T)[..., 16:]
    ang = pos[:, None].double() * inv
    want = torch.cat([raw[..., :4] * ang.cos() - raw[..., 4:] * ang.sin(),
                      raw[..., 4:] * ang.cos() + raw[..., :4] * ang.sin()], -1)
    assert rel_err(k_rope, want) < 1e-13
    for bad, exc, why in ((torch.ones(3), ValueError, r"expected a tensor of shape \[4\]"),
                          (torch.tensor([1.0, float("nan"), 1.0, 1.0]), ValueError, "expected finite values"),
                          ([1.0] * 4, TypeError, "expected a torch.Tensor")):
        with pytest.raises(exc, match=f"^rope_inv_freq: {why}"):
            GQLAttention(32, 4, 2, 16, 8, 16, rope_inv_freq=bad)


def test_rope_inv_freq_bits_survive_module_type_casts():
    """``Module.type`` casts every tensor, integer buffers too (of the layer or of a model holding it): the int64
    bits of the RoPE frequencies stay bits, so the frequencies stay exact and the output is the float64 layer's."""
    inv = torch.tensor([1.0, 0.1234567890123, 3e-4, 2.0], dtype=torch.float64)
    layer = GQLAttention(32, 4, 2, 16, 8, 16, rope_inv_freq=inv, impl="reference", dtype=torch.float64)
    x = randn((1, 5, 32), 1, dtype=torch.float64, device="cpu")
    with torch.no_grad():
        want = layer(x)
        for cast in (lambda m: m.type(torch.float64), lambda m: torch.nn.Sequential(m).type(torch.float64)[0]):
            got = cast(layer)
            assert got.rope_inv_freq_bits.dtype == torch.int64 and torch.equal(got.rope_inv_freq, inv)
            assert torch.equal(got(x), want)
        half = layer.type(torch.float32)
        assert half.kv_b_proj.weight.dtype == torch.float32 and torch.equal(half.rope_inv_freq, inv)


def test_weights_beyond_the_target_dtype_are_refused():
    """Balancing scales the key rows of ``kv_b_proj`` by the key / value norm ratio: with values ~1e-6 of the keys
    the rows leave float16's range. A ValueError names it; the float32 result of the same source is right."""
    g0 = gen(5)
    h, g, d, hid = 4, 2, 8, 32
    src = {"q_proj": randn((h * d, hid), g0, dtype=torch.float64, device="cpu"),
           "k_proj": randn((g * d, hid), g0, dtype=torch.float64, device="cpu"),
           "v_proj": randn((g * d, hid), g0, dtype=torch.float64, device="cpu", scale=1e-6),
           "o_proj": randn((hid, h * d), g0, dtype=torch.float64, device="cpu")}
    half = {k: v.half() for k, v in src.items()}
    kw = dict(num_heads=h, num_groups=g, head_dim=d, kv_rank=32, rope_dim=0, impl="reference")
    with pytest.raises(ValueError, match="dtype: the converted kv_b_proj weights .*float16's range.*balance_kv"):
        trans_gqla(half, **kw)
    layer = trans_gqla(half, **kw, dtype=torch.float32)
    x = randn((1, 5, hid), g0, dtype=torch.float32, device="cpu")
    ref = gqa_attention_reference(half, x, num_heads=h, num_groups=g, head_dim=d)
    assert rel_err(layer(x), ref) < 1e-5
    with pytest.raises(ValueError, match="^rope_theta: expected a positive, finite real number"):
        trans_gqla(src, **kw, rope_theta=10**400)  # an int no float holds: a ValueError, not an OverflowError


def test_loaded_weights_beyond_the_target_dtype_are_refused():
    """A finite checkpoint whose weights (``load_gqla``), or whose converted weights (``mla_to_gqla``: a group's
    up-projection is the stacked heads' singular values times their directions, larger than any entry), leave the
    layer's dtype would load as inf: a ValueError names ``dtype`` and the weight; float32 loads the same source."""
    hidden, h, g, dn, dR, dv, r = 32, 4, 2, 8, 4, 8, 16
    sd = deepseek_checkpoint(0, hidden=hidden, h=h, n=g, dn=dn, dR=dR, dv=dv, r=r)
    sd["q_proj.weight"] = sd["q_proj.weight"] * 1e6
    kw = dict(num_heads=h, num_groups=g, head_dim=dn, rope_dim=dR, kv_rank=r, v_head_dim=dv, impl="reference")
    with pytest.raises(ValueError, match=r"^dtype: the loaded q_proj weights reach .* beyond torch.float16's range"):
        load_gqla(sd, **kw, dtype=torch.float16)
    assert torch.isfinite(load_gqla(sd, **kw, dtype=torch.float32).q_proj.weight).all()
    mla = deepseek_checkpoint(1, hidden=hidden, h=h, n=h, dn=dn, dR=dR, dv=dv, r=r)
    top = mla["kv_b_proj.weight"].abs().max()
    mla["kv_b_proj.weight"] = mla["kv_b_proj.weight"] * (60000 / top)  # every entry within float16's range
    kw = dict(num_heads=h, num_groups=g, qk_nope_head_dim=dn, qk_rope_head_dim=dR, v_head_dim=dv, kv_rank=r,
              impl="reference")
    with pytest.raises(ValueError, match=r"^dtype: the loaded kv_b_proj weights reach .* beyond torch.float16's"):
        mla_to_gqla(mla, **kw, dtype=torch.float16)
    assert torch.isfinite(mla_to_gqla(mla, **kw, dtype=torch.float32).kv_b_proj.weight).all()


def test_meta_weights_bad_devices_and_ranks_are_refused_by_name():
    g0 = gen(6)
    h, g, d, hid = 4, 2, 16, 32
    src = {n: randn(s, g0, dtype=torch.float32, device="cpu") for n, s in
           (("q_proj", (h * d, hid)), ("k_proj", (g * d, hid)), ("v_proj", (g * d, hid)), ("o_proj", (hid, h * d)))}
    kw = dict(num_heads=h, num_groups=g, head_dim=d, kv_rank=32, impl="reference")
    with pytest.raises(ValueError, match="source: q_proj is on the meta device"):
        trans_gqla({n: w.to("meta") for n, w in src.items()}, **kw)
    for device in ("junk", 1.5, "cuda:1048576"):
        with pytest.raises(TypeError if device == 1.5 else ValueError, match="^device: "):
            trans_gqla(src, **kw, device=device)
    with pytest.raises(ValueError, match="^q_rank: "):
        load_gqla({}, num_heads=4, num_groups=2, head_dim=16, rope_dim=16, kv_rank=32, q_rank=0)


def test_loaders_refuse_unexpected_keys_float8_weights_and_bad_q_rank_by_name():
    """``load_gqla`` / ``mla_to_gqla`` refuse a key under the prefix that the attention has no weight for (a bias,
    FP8 scales, a query path other than ``q_rank``'s: each would otherwise be dropped), float8 weights (their
    scales are not read) and a ``q_rank`` that is not None or a positive int, naming the argument."""
    sd = deepseek_checkpoint(0, hidden=48, h=8, n=2, dn=8, dR=8, dv=8, r=24)
    kw = dict(num_heads=8, num_groups=2, head_dim=8, rope_dim=8, kv_rank=24, v_head_dim=8, impl="reference",
              dtype=torch.float64)
    load_gqla(sd, **kw)
    for extra in ("o_proj.bias", "kv_b_proj.weight_scale_inv", "q_a_proj.weight"):
        with pytest.raises(ValueError, match=f"unexpected keys.*{extra}"):
            load_gqla({**sd, extra: torch.ones(4, dtype=torch.float64)}, **kw)
    other = {f"attn.{k}": v for k, v in sd.items()} | {"mlp.o_proj.bias": torch.ones(4)}  # outside the prefix
    load_gqla(other, **kw, prefix="attn.")
    with pytest.raises(TypeError, match="'kv_b_proj.weight' expected a real floating tensor of 16 bits"):
        load_gqla({**sd, "kv_b_proj.weight": sd["kv_b_proj.weight"].to(torch.float8_e4m3fn)}, **kw)
    mla = deepseek_checkpoint(0, hidden=48, h=8, n=8, dn=8, dR=8, dv=8, r=24, q_rank=16)
    mkw = dict(num_heads=8, num_groups=2, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, kv_rank=24,
               impl="reference", dtype=torch.float64)
    for bad in ("16", 0, -1, 16.5, True):
        err = TypeError if isinstance(bad, (str, float, bool)) else ValueError
        with pytest.raises(err, match="q_rank: expected None or an int"):
            mla_to_gqla(mla, **mkw, q_rank=bad)
    assert mla_to_gqla(mla, **mkw, q_rank=16).q_rank == 16


def test_float8_parameter_dtypes_are_refused_by_name():
    """A float8 ``dtype`` for a layer's parameters (or a TransGQLA result) is a ``TypeError`` naming ``dtype``;
    float8 source weights of TransGQLA likewise name the weight."""
    f8 = torch.float8_e4m3fn
    with pytest.raises(TypeError, match="dtype: expected None or a floating torch.dtype of 16 bits"):
        GQLAttention(32, 4, 2, 8, 4, 8, impl="reference", dtype=f8)
    src = gqa_source(0, hidden=32, h=4, g=2, d=8)
    kw = dict(num_heads=4, num_groups=2, head_dim=8, kv_rank=8, impl="reference")
    with pytest.raises(TypeError, match="dtype: expected"):
        trans_gqla(src, **kw, dtype=f8)
    with pytest.raises(TypeError, match="float8 weights need their scales"):
        trans_gqla({k: v.to(f8) for k, v in src.items()}, **kw)


def test_refused_gqla_load_state_dict_changes_nothing():
    """A layer built without ``rope_inv_freq`` refuses a state dict carrying RoPE frequencies (strict or not: it
    would keep ``rope_theta``'s), and any refused load (a wrong shape, frequency bits that are not int64 or not of
    finite values, integer / bool / complex weights, an ``assign`` of another dtype) leaves every parameter as it
    was."""
    inv = torch.tensor([1.0, 0.25, 3e-4, 2.0], dtype=torch.float64)
    src = GQLAttention(32, 4, 2, 16, 8, 16, rope_inv_freq=inv, impl="reference", dtype=torch.float64)
    sd = src.state_dict()
    plain = GQLAttention(32, 4, 2, 16, 8, 16, impl="reference", dtype=torch.float64)
    with_inv = GQLAttention(32, 4, 2, 16, 8, 16, rope_inv_freq=torch.ones(4), impl="reference", dtype=torch.float64)
    cases = [(plain, sd, True), (plain, sd, False),
             (with_inv, {**sd, "o_proj.weight": sd["o_proj.weight"][:, :3]}, True),
             (with_inv, {**sd, "rope_inv_freq_bits": inv.float()}, False),
             (with_inv, {**sd, "rope_inv_freq_bits": sd["rope_inv_freq_bits"].int()}, True),
             (with_inv, {**sd, "rope_inv_freq_bits": torch.tensor([1.0, math.inf, 0.5, 2.0],
                                                                  dtype=torch.float64).view(torch.int64)}, True),
             (with_inv, {**sd, "kv_b_proj.weight": sd["kv_b_proj.weight"].long()}, True),
             (with_inv, {**sd, "q_proj.weight": sd["q_proj.weight"] > 0}, False),
             (with_inv, {**sd, "o_proj.weight": sd["o_proj.weight"].to(torch.complex128)}, True)]
    for layer, bad, strict in cases:
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        with pytest.raises(ValueError, match="state_dict: .*(rope_inv_freq_bits|o_proj.weight|kv_b_proj|q_proj)"):
            layer.load_state_dict(bad, strict=strict)
        assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())
    with pytest.raises(ValueError, match="kv_b_proj.weight: assign=True takes the layer's dtype"):
        with_inv.load_state_dict({**sd, "kv_b_proj.weight": sd["kv_b_proj.weight"].float()}, assign=True)
    assert with_inv.kv_b_proj.weight.dtype == torch.float64
    with_inv.load_state_dict(sd)
    assert torch.equal(with_inv.rope_inv_freq, inv)


def test_calibration_with_fewer_tokens_than_hidden_still_converts_exactly_at_full_rank():
    """Calibration activations of fewer tokens than ``hidden`` (a singular covariance) still rank every direction of
    the weights: at ``kv_rank = hidden < g·(d + d_v)`` the conversion reproduces the source (float64), as it does
    uncalibrated; activations of all zeros weight nothing."""
    hidden, h, g, d = 48, 4, 4, 8
    src = gqa_source(0, hidden=hidden, h=h, g=g, d=d)
    x = randn((2, 7, hidden), 4, dtype=torch.float64, device="cpu")
    pos = torch.arange(7)
    ref = gqa_attention_reference(src, x, num_heads=h, num_groups=g, head_dim=d, positions=pos)
    for calib in (randn((40, hidden), 9, dtype=torch.float64, device="cpu"),
                  torch.zeros(5, hidden, dtype=torch.float64)):
        layer = trans_gqla(src, num_heads=h, num_groups=g, head_dim=d, kv_rank=hidden, rope_dim=0, calib=calib,
                           impl="reference", dtype=torch.float64)
        with torch.no_grad():
            assert rel_err(layer(x, pos), ref) < 1e-10


def _gqa_source(h=4, g=2, d=8, hidden=16, seed=3):
    return {n: randn(s, seed + i, dtype=torch.float64, device="cpu") for i, (n, s) in enumerate(
        (("q_proj", (h * d, hidden)), ("k_proj", (g * d, hidden)), ("v_proj", (g * d, hidden)),
         ("o_proj", (hidden, h * d))))}


def test_gqa_attention_reference_checks_its_arguments_by_name():
    """The float64 reference of the source attention names each bad argument before any product (sizes, x,
    positions, mask, scales), as trans_gqla does for the shared ones."""
    src, kw = _gqa_source(), dict(num_heads=4, num_groups=2, head_dim=8)
    x = randn((2, 5, 16), 1, dtype=torch.float64, device="cpu")
    assert gqa_attention_reference(src, x, **kw).shape == (2, 5, 16)
    assert gqa_attention_reference(src, x[:0], **kw).shape == (0, 5, 16)  # an empty batch is computed
    bad = [(dict(x=None), "x"), (dict(x=x[..., :7]), "x"), (dict(x=x.long()), "x"),
           (dict(x=x.to("meta")), "x"), (dict(num_heads=None), "num_heads"), (dict(head_dim=-1), "head_dim"),
           (dict(num_groups=3), "num_heads"), (dict(v_head_dim=0), "v_head_dim"),
           (dict(softmax_scale=10**400), "softmax_scale"), (dict(rope_theta=-1.0), "rope_theta"),
           (dict(rope_attention_scaling=float("nan")), "rope_attention_scaling"),
           (dict(positions=torch.arange(4)), "positions"), (dict(positions=torch.rand(5)), "positions"),
           (dict(attention_mask=torch.tensor(1)), "attention_mask"),
           (dict(attention_mask=torch.ones(2, 4)), "attention_mask")]
    for over, name in bad:
        args = {**kw, "x": x, **over}
        with pytest.raises((ValueError, TypeError), match=f"^{name}: "):
            gqa_attention_reference(src, args.pop("x"), **args)


def test_gqa_attention_reference_carries_non_finite_weights_and_zeroes_queries_without_keys():
    """A NaN weight reaches the outputs it feeds (no NaN is turned into 0), and a query that sees no key (a padded
    first token) gives 0."""
    src = _gqa_source()
    x = randn((2, 5, 16), 1, dtype=torch.float64, device="cpu")
    kw = dict(num_heads=4, num_groups=2, head_dim=8)
    mask = torch.ones(2, 5)
    mask[0, 0] = 0
    o = gqa_attention_reference(src, x, **kw, attention_mask=mask)
    assert o.isfinite().all() and (o[0, 0] == 0).all()
    src["q_proj"][0, 0] = float("nan")  # head 0's query: every token's output through o_proj
    assert gqa_attention_reference(src, x, **kw).isnan().all()


def test_trans_gqla_takes_float8_calibration_and_refuses_meta_calibration():
    """Calibration activations in float8 are taken at their values (the covariance in float64); on the meta device
    they are refused by name."""
    src = _gqa_source(seed=7)
    kw = dict(num_heads=4, num_groups=2, head_dim=8, kv_rank=8, rope_dim=4, device="cpu", dtype=torch.float32)
    calib = randn((64, 16), 2, device="cpu")
    want = trans_gqla(src, **kw, calib=calib.to(torch.float8_e4m3fn).float())
    got = trans_gqla(src, **kw, calib=calib.to(torch.float8_e4m3fn))
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), want.state_dict().values(), strict=True))
    with pytest.raises(ValueError, match="^calib: "):
        trans_gqla(src, **kw, calib=calib.to("meta"))


def test_rope_attention_scaling_whose_square_leaves_float64_is_refused_by_name():
    """The source's RoPE attention scaling multiplies the converted query weights by its square: a scaling whose
    square overflows (or underflows to 0 in) float64 is a ValueError naming it, not an OverflowError."""
    src = gqa_source(0, hidden=32, h=4, g=2, d=8)
    kw = dict(num_heads=4, num_groups=2, head_dim=8, kv_rank=16, rope_dim=4, impl="reference")
    for bad in (1e200, 1e-200):
        with pytest.raises(ValueError, match="^rope_attention_scaling: .*float64"):
            trans_gqla(src, **kw, rope_attention_scaling=bad)
    assert trans_gqla(src, **kw, rope_attention_scaling=1e10).q_proj.weight.isfinite().all()


def test_rope_inv_freq_on_meta_is_refused_by_name_everywhere():
    """``rope_inv_freq`` on the meta device holds no values: trans_gqla, gqa_attention_reference and the layer
    refuse it with the same ValueError."""
    src = gqa_source(0, hidden=32, h=4, g=2, d=8)
    meta = torch.ones(4, device="meta")
    why = "^rope_inv_freq: expected a tensor with values, got one on meta"
    with pytest.raises(ValueError, match=why):
        trans_gqla(src, num_heads=4, num_groups=2, head_dim=8, kv_rank=16, rope_dim=4, rope_inv_freq=meta)
    with pytest.raises(ValueError, match=why):
        gqa_attention_reference(src, torch.randn(1, 2, 32), num_heads=4, num_groups=2, head_dim=8,
                                rope_inv_freq=meta)
    with pytest.raises(ValueError, match=why):
        GQLAttention(32, 4, 2, 8, 8, 16, rope_inv_freq=meta.view(4))


def test_rope_inv_freq_is_copied_from_the_callers_tensor():
    """The layer's frequencies are its own: a later write to the tensor passed as ``rope_inv_freq`` leaves them."""
    inv = torch.tensor([1.0, 0.5, 0.25, 0.125], dtype=torch.float64)
    layer = GQLAttention(32, 4, 2, 8, 8, 16, rope_inv_freq=inv, impl="reference")
    inv.fill_(7.0)
    assert torch.equal(layer.rope_inv_freq, torch.tensor([1.0, 0.5, 0.25, 0.125], dtype=torch.float64))


def test_source_weights_whose_gram_overflows_float64_are_refused_by_name():
    """Finite float64 weights so large that their Gram matrices overflow float64 are refused naming the source
    weight and its magnitude (not ``dtype`` or a converted weight)."""
    src = gqa_source(0, hidden=32, h=4, g=2, d=8)
    kw = dict(num_heads=4, num_groups=2, head_dim=8, kv_rank=16, rope_dim=4, impl="reference", dtype=torch.float64)
    for key in ("k_proj", "v_proj"):
        with pytest.raises(ValueError, match=f"^source: {key}: .*overflow.*float64"):
            trans_gqla({**src, key: src[key] * 1e200}, **kw)
    calib, k10 = torch.full((4, 32), 1e150, dtype=torch.float64), {**src, "k_proj": src["k_proj"] * 1e10}
    assert trans_gqla(k10, **kw).kv_a_proj.weight.isfinite().all()
    with pytest.raises(ValueError, match="^source: k_proj: .* on calib overflows float64"):
        trans_gqla(k10, **kw, calib=calib)
    big = trans_gqla({k: v * 1e100 for k, v in src.items()}, **kw)  # Grams of 1e200: converted
    assert big.kv_a_proj.weight.isfinite().all()


def test_loaders_refuse_the_meta_device_by_name():
    """``load_gqla`` / ``mla_to_gqla`` onto ``device="meta"`` would drop every loaded value: refused as trans_gqla
    refuses it."""
    gq_sd = deepseek_checkpoint(0, hidden=32, h=4, n=2, dn=8, dR=4, dv=8, r=16)
    mla_sd = deepseek_checkpoint(0, hidden=32, h=4, n=4, dn=8, dR=4, dv=8, r=16)
    why = "^device: expected a device with storage, got meta"
    for dev in ("meta", torch.device("meta")):
        with pytest.raises(ValueError, match=why):
            load_gqla(gq_sd, num_heads=4, num_groups=2, head_dim=8, rope_dim=4, kv_rank=16, impl="reference",
                      dtype=torch.float32, device=dev)
        with pytest.raises(ValueError, match=why):
            mla_to_gqla(mla_sd, num_heads=4, num_groups=2, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                        kv_rank=16, impl="reference", dtype=torch.float32, device=dev)


def test_loaders_name_the_weight_whose_hidden_size_differs():
    """The hidden size is the width the query input, ``kv_a_proj_with_mqa`` and ``o_proj`` weights share; the one
    that differs is named (also ``q_a_proj`` with ``q_rank``), and three different widths are all reported."""
    kw = dict(num_heads=4, num_groups=2, head_dim=8, rope_dim=4, kv_rank=16, impl="reference", dtype=torch.float32)
    for q_rank in (None, 8):
        sd = deepseek_checkpoint(0, hidden=32, h=4, n=2, dn=8, dR=4, dv=8, r=16, q_rank=q_rank)
        qkey = "q_proj.weight" if q_rank is None else "q_a_proj.weight"
        for key, dim in ((qkey, 1), ("kv_a_proj_with_mqa.weight", 1), ("o_proj.weight", 0)):
            bad = {**sd, key: sd[key].narrow(dim, 0, 31)}
            with pytest.raises(ValueError, match=f"^state_dict: '{key}' expected shape .*got"):
                load_gqla(bad, **kw, q_rank=q_rank)
        three = {**sd, qkey: sd[qkey][:, :31], "o_proj.weight": sd["o_proj.weight"][:30]}
        with pytest.raises(ValueError, match="^state_dict: the hidden sizes .* disagree"):
            load_gqla(three, **kw, q_rank=q_rank)


def test_loaders_name_num_heads_that_is_not_an_int():
    sd = deepseek_checkpoint(0, hidden=32, h=4, n=4, dn=8, dR=4, dv=8, r=16)
    for bad in (4.0, "4", True, 0):
        err = ValueError if bad == 0 else TypeError
        with pytest.raises(err, match="^num_heads: expected a positive int"):
            load_gqla(sd, num_heads=bad, num_groups=2, head_dim=8, rope_dim=4, kv_rank=16)
        with pytest.raises(err, match="^num_heads: expected a positive int"):
            mla_to_gqla(sd, num_heads=bad, num_groups=2, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                        kv_rank=16)
    with pytest.raises(ValueError, match="^num_groups: expected a positive divisor of num_heads 4, got 3"):
        load_gqla(sd, num_heads=4, num_groups=3, head_dim=8, rope_dim=4, kv_rank=16)


def test_sources_with_more_than_plain_projections_are_refused_by_name():
    """A module whose attention holds anything beyond bias-free q / k / v / o (per-head q / k norms, with or without
    weights, as Qwen3's; differential attention's λ) or a dict with other entries computes another function than
    the one converted: ``trans_gqla`` and the reference refuse it, naming what is extra."""
    h, g, d, hid = 4, 2, 8, 16
    src = gqa_source(31, hidden=hid, h=h, g=g, d=d)
    kw = dict(num_heads=h, num_groups=g, head_dim=d)

    def module(**extra):
        m = torch.nn.Module()
        for n, w in src.items():
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.float64)
            lin.weight.data.copy_(w)
            setattr(m, n, lin)
        for n, v in extra.items():
            setattr(m, n, v)
        return m

    x = randn((1, 3, hid), gen(32), dtype=torch.float64, device="cpu")
    for plain in (module(), module(q_norm=None, k_norm=torch.nn.Identity())):  # the plain projections convert
        trans_gqla(plain, **kw, kv_rank=32, impl="reference")
    for extra, what in ((dict(q_norm=torch.nn.RMSNorm(d, dtype=torch.float64)), "q_norm"),
                        (dict(k_norm=torch.nn.RMSNorm(d, elementwise_affine=False)), "q_norm / k_norm"),
                        (dict(lambda_q=torch.nn.Parameter(torch.ones(d))), "lambda_q")):
        with pytest.raises(ValueError, match=f"^source: .*{what}"):
            trans_gqla(module(**extra), **kw, kv_rank=32, impl="reference")
        with pytest.raises(ValueError, match=f"^source: .*{what}"):
            gqa_attention_reference(module(**extra), x, **kw)
    with pytest.raises(ValueError, match=r"^source: unexpected weights \['q_norm'\]"):
        trans_gqla({**src, "q_norm": torch.ones(d)}, **kw, kv_rank=32, impl="reference")
