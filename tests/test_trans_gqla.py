"""TransGQLA (GQA -> GQLA conversion) and tensor-parallel sharding of GQLAttention along groups."""

import pytest
import torch
from harness import P, assert_close, dtypes, gen, pick, randn, rel_err, seeds
from hypothesis import given
from hypothesis import strategies as st
from test_gqla_layer import PAGE, make_layer

from gqla_triton.convert import gqa_attention_reference, trans_gqla
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


@given(g=st.sampled_from([2, 4]), seed=seeds())
def test_error_decreases_with_rank(g, seed):
    hidden, h, d = 64, 8, 16
    src = gqa_source(seed, hidden=hidden, h=h, g=g, d=d)
    x = randn((2, 16, hidden), seed + 1, dtype=torch.float64, device="cpu")
    ref = gqa_attention_reference(src, x, num_heads=h, num_groups=g, head_dim=d)
    pos = torch.arange(16)[None].expand(2, 16)
    W = torch.cat([src["k_proj"].view(g, d, hidden), src["v_proj"].view(g, d, hidden)], 1).reshape(-1, hidden)
    full = min(W.shape[0], hidden)
    w_errs, o_errs = [], []
    for r in sorted({1, full // 8, full // 4, full // 2, 3 * full // 4, full}):
        layer = trans_gqla(src, num_heads=h, num_groups=g, head_dim=d, kv_rank=r, impl="reference")
        wb = layer.kv_b_proj.weight.detach().double()
        wa = layer.kv_a_proj.weight.detach().double()
        w_errs.append(rel_err(wb @ wa, W))  # reconstructed per-group K/V maps
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


def test_rope_conversion_keeps_frequencies():
    """d_R = d: with g = 1 (MQA) every head shares the one rope key, so the rotary source is reproduced."""
    hidden, h, g, d = 48, 4, 1, 16
    src = gqa_source(7, hidden=hidden, h=h, g=g, d=d)
    x = randn((1, 9, hidden), 8, dtype=torch.float64, device="cpu")
    pos = torch.arange(9) * 3 + 2
    ref = gqa_attention_reference(src, x, num_heads=h, num_groups=g, head_dim=d, positions=pos, rope_theta=500.0)
    # all rotary pairs kept (d_R = d - 2 leaves one pair unrotated: approximate; d_R must be < d)
    layer = trans_gqla(src, num_heads=h, num_groups=g, head_dim=d, kv_rank=2 * d, rope_dim=d - 2, rope_theta=500.0,
                       impl="reference")
    err_most = rel_err(gqla_reference(layer, x, pos[None]), ref)
    layer0 = trans_gqla(src, num_heads=h, num_groups=g, head_dim=d, kv_rank=2 * d, rope_dim=0, impl="reference")
    err_none = rel_err(gqla_reference(layer0, x, pos[None]), ref)
    assert err_most < err_none  # keeping the rotary dims (at their frequencies) is closer than dropping rope
    assert abs(layer.rope_theta - 500.0 ** ((d - 2) / d)) < 1e-9


@given(path=st.sampled_from(["absorb", "grouped"]), dtype=dtypes(), seed=seeds())
def test_converted_layer_decodes_on_both_paths(path, dtype, seed):
    hidden, h, g, d = pick((64, 8, 2, 32), (1024, 32, 8, 128))
    dR = 16 if not P.big else 64
    src = gqa_source(seed, hidden=hidden, h=h, g=g, d=d)
    layer = trans_gqla(src, num_heads=h, num_groups=g, head_dim=d, kv_rank=pick(32, 512), rope_dim=dR,
                       device=P.device, dtype=dtype)
    T0, B = pick(20, 300), 2
    x = randn((B, T0 + 2, hidden), seed + 1, dtype=dtype)
    pos = torch.arange(T0 + 2)
    ref = gqla_reference(layer, x, pos[None].expand(B, -1))
    with torch.no_grad():
        full = layer(x, pos)
        cache = layer.make_cache(B, T0 + 2, path=path, page_size=PAGE)
        layer(x[:, :T0], pos[:T0], cache)
        y = torch.cat([layer(x[:, T0:T0 + 1], None, cache), layer(x[:, T0 + 1:], None, cache)], 1)
    assert_close("converted decode", y, ref[:, T0:], full[:, T0:], dtype=dtype)


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
    with pytest.raises(ValueError, match="k_proj"):
        trans_gqla({**src, "k_proj": src["k_proj"][:8]}, **kw)
    with pytest.raises(ValueError, match="missing"):
        trans_gqla({k: v for k, v in src.items() if k != "o_proj"}, **kw)
    with pytest.raises(ValueError, match="num_heads"):
        trans_gqla(src, **{**kw, "num_heads": 3})
    with pytest.raises(ValueError, match="rope_dim"):
        trans_gqla(src, **kw, rope_dim=3)
    with pytest.raises(ValueError, match="rope_dim"):
        trans_gqla(src, **kw, rope_dim=8)
    with pytest.raises(ValueError, match="kv_rank"):
        trans_gqla(src, **{**kw, "kv_rank": 0})
    with pytest.raises(ValueError, match="rope_group"):
        trans_gqla(src, **kw, rope_dim=2, rope_group=2)
