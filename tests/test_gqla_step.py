"""GQLAttention decode-step kernels (``layers.gqla_step``): ``norm_rope``, ``absorb_q``, ``absorb_o`` and ``grouped_q``
against float64 references, with hostile strides (views of larger projection outputs and weights), positions near
the int32 limits, d_R = 0 and every heads-per-group count (fewer than 16: padded tiles; more than 64: split);
their torch.library registration (opcheck, a fullgraph compile); bad inputs."""

import math

import numpy as np
import pytest
import torch
from harness import P, assert_close, dtypes, gen, pick, randn, seeds
from hypothesis import assume, example, given
from hypothesis import strategies as st

from gqla_triton.layers import gqla_step as gs
from gqla_triton.layers.rope import apply_rope, cached_inv_freq, rope_cos_sin, rope_inv_freq
from gqla_triton.ops._common.alloc import poisoned

I32_MAX, I32_MIN = 2**31 - 1, -(2**31)
POS_MODES = ["small", "high", "low"]


def positions_of(mode, B, T, gg, *, add_t=False):
    """``(kernel positions, [B, T] int64 reference positions)``. ``mode``: small values, just below 2**31 - 1
    (the last row's at 2**31 - 1 itself, so with ``add_t`` and T > 1 its sums pass it), or near -2**31 (the last
    row's at -2**31). ``add_t``: the kernel gets one int32 value per row, expanded over T (stride 0), and adds t."""
    lo, hi = {"small": (0, 5000), "high": (I32_MAX - 40, I32_MAX), "low": (I32_MIN, I32_MIN + 40)}[mode]
    if add_t:
        base = torch.randint(lo, hi + 1, (B,), generator=gg, dtype=torch.int64)
        if mode != "small":
            base[-1] = hi if mode == "high" else lo
        ref = base[:, None] + torch.arange(T)
        return base.to(torch.int32).to(P.device)[:, None].expand(B, T), ref
    ref = torch.randint(lo, hi + 1, (B, T), generator=gg, dtype=torch.int64)
    return ref.to(P.device), ref


def inv_freq_of(d_r, gg, converted):
    """float64 ``[d_R / 2]``: theta's frequencies, or arbitrary positive ones (a converted model's)."""
    if converted:
        return (torch.rand(d_r // 2, generator=gg, dtype=torch.float64) * 2).to(P.device)
    return rope_inv_freq(d_r, 10000.0, device=P.device)


def hostile(x, mode):
    """The values of ``x`` behind other strides: ``slice`` (inside a wider last dim, NaN around it), ``bt``
    (B and T swapped in memory), ``contig``."""
    if mode == "slice":
        big = torch.full((*x.shape[:-1], x.shape[-1] + 7), float("nan"), dtype=x.dtype, device=x.device)
        big[..., 3:3 + x.shape[-1]] = x
        return big[..., 3:3 + x.shape[-1]]
    if mode == "bt":
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    return x


def hostile_q(q, mode):
    """Query ``[B, T, h, E]`` as a view of a wider projection output (``slice``), with padded heads (``heads``) or
    B / T swapped in memory (``bt``)."""
    B, T, h, E = q.shape
    if mode == "slice":
        return hostile(q.reshape(B, T, h * E), "slice").view(B, T, h, E)
    if mode == "heads":
        big = torch.full((B, T, h, E + 5), float("nan"), dtype=q.dtype, device=q.device)
        big[..., :E] = q
        return big[..., :E]
    return hostile(q, mode)


def hostile_w(w, mode, other=8):
    """Weight ``[g, d, r]`` as rows of a ``kv_b_proj``-like ``[g, other + d, r]`` (``kvb``), with its last dim
    strided (``t``), or contiguous."""
    g, d, r = w.shape
    if mode == "kvb":
        big = torch.full((g, other + d, r), float("nan"), dtype=w.dtype, device=w.device)
        big[:, other:] = w
        return big[:, other:]
    if mode == "t":
        return w.transpose(1, 2).contiguous().transpose(1, 2)
    return w


def rope64(x, pos, inv):
    return apply_rope(x.double(), pos.to(x.device), inv_freq=inv)


def rope_low(x, pos, inv):
    """Rope as the layer's torch path applies it at ``x``'s precision (float32 factors)."""
    return apply_rope(x, pos.to(x.device), inv_freq=inv)


def check_cos_sin(cs, pos, inv):
    ang = pos.to(torch.float64)[..., None] * inv.cpu()
    want = torch.stack([ang.cos(), ang.sin()], -2)
    got = cs.double().cpu()
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() <= 2**-24  # float32 roundings of the float64 cos / sin


# ---- norm_rope ------------------------------------------------------------------------------------------------
@given(B=st.integers(1, pick(3, 64)), T=st.integers(1, 3), q_rank=st.sampled_from([None, pick(24, 1536)]),
       r=st.sampled_from(pick([16, 40], [512, 320])), d_r=st.sampled_from(pick([0, 8, 24], [0, 64, 32])),
       kv_norm=st.booleans(), add_t=st.booleans(), mode=st.sampled_from(POS_MODES), converted=st.booleans(),
       layout=st.sampled_from(["contig", "slice", "bt"]), dtype=dtypes(), out_dtype=dtypes(), seed=seeds())
@example(B=2, T=3, q_rank=pick(24, 1536), r=pick(16, 512), d_r=pick(24, 64), kv_norm=True, add_t=True, mode="high",
         converted=True, layout="slice", dtype=P.dtypes[0], out_dtype=P.dtypes[-1], seed=1)
def test_norm_rope_matches_float64(B, T, q_rank, r, d_r, kv_norm, add_t, mode, converted, layout, dtype, out_dtype,
                                   seed):
    """The normed latent and the rotated rope key at positions near the int32 limits (with ``add_t`` the sums pass
    2**31 - 1), theta's or a converted model's frequencies, and the normed q_a: the float64 reference."""
    gg = gen(seed)
    kv = randn((B, T, r + d_r), gg, dtype=dtype)
    kv_w = randn((r,), gg, dtype=dtype, scale=0.1) + 1 if kv_norm else None
    qa = randn((B, T, q_rank), gg, dtype=dtype, scale=3.0) if q_rank else None
    qa_w = randn((q_rank,), gg, dtype=dtype, scale=0.1) + 1 if q_rank else None
    pos, ref_pos = positions_of(mode, B, T, gg, add_t=add_t)
    inv = inv_freq_of(d_r, gg, converted)
    eps = 1e-6
    with poisoned():  # an element the kernel leaves unwritten stays NaN
        qa_out, row, cs = gs.norm_rope(None if qa is None else hostile(qa, layout), qa_w, hostile(kv, layout), kv_w,
                                       pos, inv, add_t=add_t, kv_rank=r, qa_eps=eps, kv_eps=2 * eps,
                                       out_dtype=out_dtype)
    assert row.dtype == out_dtype and row.is_contiguous() and list(row.shape) == [B, T, r + d_r]

    def rms64(x, w, e):
        x = x.double()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + e) * w.double()

    def rms_low(x, w, e):  # RMSNorm's forward: float32, then x's dtype
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + e) * w.float()).to(x.dtype)

    c64 = rms64(kv[..., :r], kv_w, 2 * eps) if kv_norm else kv[..., :r].double()
    c_low = rms_low(kv[..., :r], kv_w, 2 * eps) if kv_norm else kv[..., :r]
    ref = torch.cat([c64, rope64(kv[..., r:], ref_pos, inv)], -1)
    low = torch.cat([c_low, rope_low(kv[..., r:], ref_pos, inv)], -1).to(out_dtype)
    assert_close("norm_rope row", row, ref, low, dtype=dtype)
    if d_r:
        assert list(cs.shape) == [B, T, 2, d_r // 2]
        check_cos_sin(cs, ref_pos, inv)
    if q_rank:
        assert qa_out.dtype == dtype and qa_out.is_contiguous()
        assert_close("norm_rope q_a", qa_out, rms64(qa, qa_w, eps), rms_low(qa, qa_w, eps), dtype=dtype)
    else:
        assert qa_out.numel() == 0


# ---- absorb_q -------------------------------------------------------------------------------------------------
HPG = pick([1, 3, 12, 16, 80], [16, 8, 4, 128])  # heads per group


@given(B=st.integers(1, pick(3, 64)), T=st.integers(1, 2), g=st.integers(1, pick(3, 8)), hpg=st.sampled_from(HPG),
       dh=st.sampled_from(pick([16, 24], [128, 64])), r=st.sampled_from(pick([16, 40], [512, 256])),
       d_r=st.sampled_from(pick([0, 8, 24], [64, 0, 32])), mode=st.sampled_from(POS_MODES),
       q_layout=st.sampled_from(["slice", "heads", "bt", "contig"]), w_layout=st.sampled_from(["kvb", "t", "contig"]),
       dtype=dtypes(), out_dtype=dtypes(), seed=seeds())
def test_absorb_q_matches_float64(B, T, g, hpg, dh, r, d_r, mode, q_layout, w_layout, dtype, out_dtype, seed):
    assume(g * hpg <= 256)
    gg = gen(seed)
    h = g * hpg
    q = randn((B, T, h, dh + d_r), gg, dtype=dtype)
    w = randn((g, dh, r), gg, dtype=dtype, scale=dh ** -0.5)
    pos, ref_pos = positions_of(mode, B, T, gg)
    inv = inv_freq_of(d_r, gg, False)
    with poisoned():
        out = gs.absorb_q(hostile_q(q, q_layout), hostile_w(w, w_layout), rope_cos_sin(pos, inv), head_dim=dh,
                          out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.is_contiguous() and list(out.shape) == [B, T, h, r + d_r]
    qn = q[..., :dh].reshape(B, T, g, hpg, dh)
    lat64 = torch.einsum("btgjd,gdr->btgjr", qn.double(), w.double()).reshape(B, T, h, r)
    lat_low = torch.einsum("btgjd,gdr->btgjr", qn, w).reshape(B, T, h, r)
    ref = torch.cat([lat64, rope64(q[..., dh:], ref_pos, inv)], -1)
    low = torch.cat([lat_low, rope_low(q[..., dh:], ref_pos, inv)], -1).to(out_dtype)
    assert_close("absorb_q", out, ref, low, dtype=dtype)


# ---- absorb_o -------------------------------------------------------------------------------------------------
@given(B=st.integers(1, pick(3, 64)), T=st.integers(1, 2), g=st.integers(1, pick(3, 8)), hpg=st.sampled_from(HPG),
       r=st.sampled_from(pick([16, 40], [512, 256])), dv=st.sampled_from(pick([16, 24], [128, 64])),
       o_layout=st.sampled_from(["slice", "heads", "bt", "contig"]), w_layout=st.sampled_from(["kvb", "t", "contig"]),
       o_dtype=dtypes(), dtype=dtypes(), seed=seeds())
@example(B=2, T=2, g=2, hpg=HPG[-1], r=pick(40, 512), dv=pick(24, 128), o_layout="heads", w_layout="kvb",
         o_dtype=P.dtypes[-1], dtype=P.dtypes[0], seed=2)
def test_absorb_o_matches_float64(B, T, g, hpg, r, dv, o_layout, w_layout, o_dtype, dtype, seed):
    """``o`` in the cache's dtype (``mla_decode``'s output), ``w_uv`` in the layer's; heads per group below 16
    (padded tiles) and above 64 (split into head blocks)."""
    assume(g * hpg <= 256)
    gg = gen(seed)
    h = g * hpg
    o = randn((B, T, h, r), gg, dtype=o_dtype)
    w = randn((g, dv, r), gg, dtype=dtype, scale=r ** -0.5)
    with poisoned():
        out = gs.absorb_o(hostile_q(o, o_layout), hostile_w(w, w_layout, other=dv))
    assert out.dtype == dtype and out.is_contiguous() and list(out.shape) == [B, T, h, dv]
    ob = o.reshape(B, T, g, hpg, r)
    ref = torch.einsum("btgjr,gvr->btgjv", ob.double(), w.double()).reshape(B, T, h, dv)
    low = torch.einsum("btgjr,gvr->btgjv", ob.to(dtype), w).reshape(B, T, h, dv)
    assert_close("absorb_o", out, ref, low, dtype=dtype)


# ---- grouped_q ------------------------------------------------------------------------------------------------
@given(B=st.integers(1, pick(3, 64)), T=st.integers(1, 2), h=st.sampled_from(pick([1, 5, 16], [128, 32])),
       dh=st.sampled_from(pick([16, 24], [128, 64])), d_r=st.sampled_from(pick([0, 8, 24], [64, 0])),
       mode=st.sampled_from(POS_MODES), q_layout=st.sampled_from(["slice", "heads", "bt", "contig"]),
       dtype=dtypes(), out_dtype=dtypes(), seed=seeds())
def test_grouped_q_matches_float64(B, T, h, dh, d_r, mode, q_layout, dtype, out_dtype, seed):
    gg = gen(seed)
    q = randn((B, T, h, dh + d_r), gg, dtype=dtype)
    pos, ref_pos = positions_of(mode, B, T, gg)
    inv = inv_freq_of(d_r, gg, True)
    with poisoned():
        out = gs.grouped_q(hostile_q(q, q_layout), rope_cos_sin(pos, inv), head_dim=dh, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.is_contiguous() and list(out.shape) == [B, T, h, dh + d_r]
    assert torch.equal(out[..., :dh], q[..., :dh].to(out_dtype))
    ref = torch.cat([q[..., :dh].double(), rope64(q[..., dh:], ref_pos, inv)], -1)
    low = torch.cat([q[..., :dh], rope_low(q[..., dh:], ref_pos, inv)], -1).to(out_dtype)
    assert_close("grouped_q", out, ref, low, dtype=dtype)


# ---- registration -----------------------------------------------------------------------------------------------
def _small(seed=0, dtype=None):
    dtype = dtype or P.dtypes[0]
    gg = gen(seed)
    B, T, g, hpg, dh, r, d_r, q_rank = 2, 2, 2, 3, 16, 32, 8, 24
    h = g * hpg
    kv = randn((B, T, r + d_r), gg, dtype=dtype)
    qa = randn((B, T, q_rank), gg, dtype=dtype)
    q = randn((B, T, h, dh + d_r), gg, dtype=dtype)
    w = randn((g, dh + 16, r), gg, dtype=dtype, scale=0.2)
    pos = torch.tensor([[5, 6], [70, 71]], device=P.device)
    inv = rope_inv_freq(d_r, device=P.device)
    return dict(kv=kv, qa=qa, q=q, w_uk=w[:, :dh], w_uv=w[:, dh:], pos=pos, inv=inv, kv_w=torch.ones(r, dtype=dtype,
                device=P.device), qa_w=torch.ones(q_rank, dtype=dtype, device=P.device), dtype=dtype, r=r, dh=dh)


def test_custom_ops_pass_opcheck():
    """Schemas, fakes and the (raising) autograd registration agree with the kernels."""
    s = _small()
    past = s["pos"][:, :1].to(torch.int32).expand(2, 2)
    _, row, cs = gs.norm_rope(s["qa"], s["qa_w"], s["kv"], s["kv_w"], past, s["inv"], add_t=True, kv_rank=s["r"],
                              out_dtype=s["dtype"])
    q = gs.absorb_q(s["q"], s["w_uk"], cs, head_dim=s["dh"], out_dtype=s["dtype"])
    cases = [
        (gs._norm_rope_op, (s["qa"], s["qa_w"], s["kv"], s["kv_w"], past, s["inv"], True, s["r"], 1e-6, 1e-6,
                            s["dtype"])),
        (gs._norm_rope_op, (None, None, s["kv"], None, s["pos"], s["inv"], False, s["r"], 1e-6, 1e-6, torch.float32)),
        (gs._absorb_q_op, (s["q"], s["w_uk"], cs, s["dh"], s["dtype"])),
        (gs._absorb_o_op, (q[..., : s["r"]], s["w_uv"])),
        (gs._grouped_q_op, (s["q"], cs, s["dh"], s["dtype"])),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_backward_through_the_ops_raises():
    s = _small(dtype=torch.float32)
    w = s["w_uv"].clone().requires_grad_(True)
    out = gs.absorb_o(s["q"][..., :8].repeat(1, 1, 1, 4), w)
    with pytest.raises(RuntimeError, match="forward-only"):
        out.sum().backward()


def test_fullgraph_compile_equals_eager():
    """The four ops chained as a decode step does, through torch.compile(fullgraph=True): one graph, the eager
    results."""
    s = _small(1)
    r, dh = s["r"], s["dh"]

    def step(qa, kv, q, past):
        pos = past[:, None].expand(2, 2)
        qa_n, row, cs = gs.norm_rope(qa, s["qa_w"], kv, s["kv_w"], pos, s["inv"], add_t=True, kv_rank=r,
                                     out_dtype=kv.dtype)
        qq = gs.absorb_q(q, s["w_uk"], cs, head_dim=dh, out_dtype=kv.dtype)
        return qa_n, row, qq, gs.absorb_o(qq[..., :r], s["w_uv"]), gs.grouped_q(q, cs, head_dim=dh, out_dtype=q.dtype)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    past = torch.tensor([3, 900], dtype=torch.int32, device=P.device)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(2):
            args = (s["qa"] + i, s["kv"] - i, s["q"] * (i + 1), past + i)
            for a, b in zip(compiled(*args), step(*args), strict=True):
                assert torch.equal(a, b)


def test_bad_inputs():
    s = _small()
    cs = rope_cos_sin(s["pos"], s["inv"])
    dt = s["dtype"]
    with pytest.raises(ValueError, match=r"^head_dim: expected w_uk.shape\[1\] \(16\)"):
        gs.absorb_q(s["q"], s["w_uk"], cs, head_dim=s["dh"] + 2, out_dtype=dt)
    with pytest.raises(ValueError, match="^w_uk: 2 groups do not divide q's 5 heads"):
        gs.absorb_q(s["q"][:, :, :5], s["w_uk"], cs, head_dim=s["dh"], out_dtype=dt)
    with pytest.raises(ValueError, match=r"^cos_sin: expected shape \[2, 2, 2, 4\]"):
        gs.absorb_q(s["q"], s["w_uk"], cs[:1], head_dim=s["dh"], out_dtype=dt)
    with pytest.raises(TypeError, match=r"^cos_sin: expected dtype in \(float32\)"):
        gs.grouped_q(s["q"], cs.double(), head_dim=s["dh"], out_dtype=dt)
    with pytest.raises(TypeError, match="^out_dtype: expected torch.bfloat16 / float16 / float32"):
        gs.grouped_q(s["q"], cs, head_dim=s["dh"], out_dtype=torch.float64)
    with pytest.raises(TypeError, match="^q: expected a bfloat16 / float16 / float32 tensor"):
        gs.grouped_q(s["q"].double(), cs, head_dim=s["dh"], out_dtype=dt)
    with pytest.raises(ValueError, match=r"^w_uv: expected shape \[g, d_v, 16\]"):
        gs.absorb_o(s["q"][..., :16], s["w_uv"])
    with pytest.raises(ValueError, match=r"^kv_rank: expected an int in \[1, 40\] leaving an even rope width"):
        gs.norm_rope(None, None, s["kv"], None, s["pos"], s["inv"], add_t=False, kv_rank=s["r"] + 1, out_dtype=dt)
    with pytest.raises(TypeError, match="^positions: expected an integer tensor"):
        gs.norm_rope(None, None, s["kv"], None, s["pos"].float(), s["inv"], add_t=False, kv_rank=s["r"],
                     out_dtype=dt)
    with pytest.raises(ValueError, match=r"^positions: expected shape \[2, 2\]"):
        gs.norm_rope(None, None, s["kv"], None, s["pos"][:1], s["inv"], add_t=False, kv_rank=s["r"], out_dtype=dt)
    with pytest.raises(TypeError, match=r"^inv_freq: expected dtype in \(float64\)"):
        gs.norm_rope(None, None, s["kv"], None, s["pos"], s["inv"].float(), add_t=False, kv_rank=s["r"],
                     out_dtype=dt)
    with pytest.raises(ValueError, match=r"^qa_weight: expected a tensor of shape \[24\]"):
        gs.norm_rope(s["qa"], None, s["kv"], None, s["pos"], s["inv"], add_t=False, kv_rank=s["r"], out_dtype=dt)
    with pytest.raises(ValueError, match=r"^kv_weight: expected shape \[32\]"):
        gs.norm_rope(None, None, s["kv"], s["qa_w"], s["pos"], s["inv"], add_t=False, kv_rank=s["r"], out_dtype=dt)
    if not P.big:  # the interpreter computes bf16 wrongly: refused
        with pytest.raises(TypeError, match="^bfloat16 inputs: Triton's CPU interpreter"):
            gs.grouped_q(s["q"].bfloat16(), cs, head_dim=s["dh"], out_dtype=dt)


def test_norm_rope_reads_strided_weights_and_frequencies():
    """``kv_weight``, ``qa_weight`` and ``inv_freq`` as every-other-element views (NaN between): the results of
    contiguous copies."""
    s = _small(2, dtype=torch.float32)
    inv = s["inv"] * torch.linspace(1, 2, s["inv"].numel(), dtype=torch.float64, device=P.device)
    kv_w = randn((s["r"],), gen(3), dtype=torch.float32) + 1
    qa_w = randn((s["qa"].shape[-1],), gen(4), dtype=torch.float32) + 1

    def gapped(t):
        base = torch.full((2 * t.numel(),), float("nan"), dtype=t.dtype, device=t.device)
        base[::2] = t
        return base[::2]

    kw = dict(add_t=False, kv_rank=s["r"], out_dtype=torch.float32)
    want = gs.norm_rope(s["qa"], qa_w, s["kv"], kv_w, s["pos"], inv, **kw)
    got = gs.norm_rope(s["qa"], gapped(qa_w), s["kv"], gapped(kv_w), s["pos"], gapped(inv), **kw)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_norm_rope_refuses_bad_weights_and_positions():
    s = _small()
    dt, kw = s["dtype"], dict(kv_rank=s["r"], out_dtype=s["dtype"])
    before = [t.clone() for t in (s["kv"], s["pos"], s["inv"])]
    for bad in (torch.ones(s["r"], dtype=torch.int32, device=P.device),
                torch.ones(s["r"], dtype=torch.bool, device=P.device)):
        with pytest.raises(TypeError, match=r"^kv_weight: expected dtype in \(bfloat16, float16, float32\)"):
            gs.norm_rope(None, None, s["kv"], bad, s["pos"], s["inv"], add_t=False, **kw)
    with pytest.raises(TypeError, match="^kv_weight: expected a torch.Tensor"):
        gs.norm_rope(None, None, s["kv"], [1.0] * s["r"], s["pos"], s["inv"], add_t=False, **kw)
    with pytest.raises(TypeError, match=r"^qa_weight: expected dtype in \(bfloat16, float16, float32\)"):
        gs.norm_rope(s["qa"], s["qa_w"].double(), s["kv"], None, s["pos"], s["inv"], add_t=False, **kw)
    with pytest.raises(ValueError, match="^qa_weight: given without qa"):
        gs.norm_rope(None, s["qa_w"], s["kv"], None, s["pos"], s["inv"], add_t=False, **kw)
    # 2**63 has no int64 form
    with pytest.raises(TypeError, match="^positions: expected a signed integer tensor or one of at most 32 bits"):
        gs.norm_rope(None, None, s["kv"], None, torch.full((2, 2), 2**63, dtype=torch.uint64, device=P.device),
                     s["inv"], add_t=False, **kw)
    with pytest.raises(TypeError, match="^add_t: expected a bool"):
        gs.norm_rope(None, None, s["kv"], None, s["pos"], s["inv"], add_t="yes", **kw)
    with pytest.raises(TypeError, match=r"^kv_rank: expected a positive int"):
        gs.norm_rope(None, None, s["kv"], None, s["pos"], s["inv"], add_t=False, kv_rank=float(s["r"]), out_dtype=dt)
    for name in ("qa_eps", "kv_eps"):
        for bad in (math.nan, -math.inf, math.inf, -1e-6, "1e-6", None, True, torch.tensor(1e-6)):
            with pytest.raises(ValueError if isinstance(bad, float) else TypeError,
                               match=f"^{name}: expected a finite real number >= 0"):
                gs.norm_rope(s["qa"], s["qa_w"], s["kv"], None, s["pos"], s["inv"], add_t=False, **kw,
                             **{name: bad})
    for a, b in zip((s["kv"], s["pos"], s["inv"]), before, strict=True):
        assert torch.equal(a, b)
    _, row, _ = gs.norm_rope(None, None, s["kv"], None, s["pos"], s["inv"], add_t=False, kv_rank=np.int64(s["r"]),
                             out_dtype=dt)
    assert torch.equal(row, gs.norm_rope(None, None, s["kv"], None, s["pos"], s["inv"], add_t=False, **kw)[1])


def test_norm_rope_channel_strides_past_int32():
    """A kv view whose channels lie 2^26 elements apart (mapped lazily: only the channels read are touched), so its
    last channels sit past 2^31: norm_rope reads them there (the rope at position 0 is the identity)."""
    r, d_r = 32, 16
    D = r + d_r
    s = 2**26
    base = torch.empty((D - 1) * s + 1, dtype=torch.float16, device=P.device)
    kv = base.as_strided((1, 1, D), (0, 0, s))
    vals = torch.linspace(-1, 1, D, dtype=torch.float16, device=P.device)
    for c in range(D):
        kv[0, 0, c] = vals[c]
    pos = torch.zeros(1, 1, dtype=torch.long, device=P.device)
    _, row, _ = gs.norm_rope(None, None, kv, None, pos, rope_inv_freq(d_r, device=P.device), add_t=False, kv_rank=r,
                             out_dtype=torch.float32)
    assert torch.equal(row[0, 0], vals.float())


def test_norm_rope_positions_plus_t_never_wrap():
    """``add_t``: ``positions + t`` as a number (float64), at the int64 limits too (``2**63 - 1 + t`` would wrap to
    a negative int64), and exactly the integer sum where float64 holds it."""
    s = _small(2, dtype=torch.float32)
    B, T = s["pos"].shape
    kw = dict(kv_rank=s["r"], out_dtype=torch.float32)
    t = torch.arange(T, device=P.device, dtype=torch.float64)
    for start in (2**63 - 1, -(2**63), 2**40 + 3):
        pos = torch.full((B, 1), start, dtype=torch.int64, device=P.device).expand(B, T)
        _, _, cs = gs.norm_rope(None, None, s["kv"], None, pos, s["inv"], add_t=True, **kw)
        check_cos_sin(cs, (pos.double() + t).cpu(), s["inv"])
    _, _, cs_sum = gs.norm_rope(None, None, s["kv"], None, pos + t.long(), s["inv"], add_t=False, **kw)
    assert torch.equal(cs, cs_sum)


def test_head_dims_are_checked_by_name():
    """No heads, a float ``head_dim``: refused by name; a numpy integer ``head_dim`` works as the int."""
    s = _small()
    cs = rope_cos_sin(s["pos"], s["inv"])
    dt, dh = s["dtype"], s["dh"]
    for name, x in (("q", s["q"][:, :, :0]),):
        with pytest.raises(ValueError, match=rf"^{name}: expected at least one head \(dim 2\)"):
            gs.absorb_q(x, s["w_uk"], cs, head_dim=dh, out_dtype=dt)
        with pytest.raises(ValueError, match=rf"^{name}: expected at least one head \(dim 2\)"):
            gs.grouped_q(x, cs, head_dim=dh, out_dtype=dt)
    with pytest.raises(ValueError, match="o: expected at least one head"):
        gs.absorb_o(s["q"][:, :, :0, : s["r"]], s["w_uv"])
    for hd in (float(dh), "16", None):
        with pytest.raises(TypeError, match="^head_dim: expected a positive int"):
            gs.absorb_q(s["q"], s["w_uk"], cs, head_dim=hd, out_dtype=dt)
        with pytest.raises(TypeError, match="^head_dim: expected a positive int"):
            gs.grouped_q(s["q"], cs, head_dim=hd, out_dtype=dt)
    assert torch.equal(gs.absorb_q(s["q"], s["w_uk"], cs, head_dim=np.int64(dh), out_dtype=dt),
                       gs.absorb_q(s["q"], s["w_uk"], cs, head_dim=dh, out_dtype=dt))
    assert torch.equal(gs.grouped_q(s["q"], cs, head_dim=np.int64(dh), out_dtype=dt),
                       gs.grouped_q(s["q"], cs, head_dim=dh, out_dtype=dt))


# ---- rope helpers -----------------------------------------------------------------------------------------------
def _rope_bad_calls():
    x = torch.randn(3, 3, 2, 8)
    pos = torch.arange(9).view(3, 3)
    meta = torch.device("meta")
    return [
        ("int x", TypeError, r"^x: expected a real floating tensor", lambda: apply_rope(x.to(torch.int32), pos)),
        ("list x", TypeError, r"^x: expected a torch.Tensor", lambda: apply_rope(x.tolist(), pos)),
        ("2-d x", ValueError, r"^x: expected shape \[B, T, \.\.\., d\]", lambda: apply_rope(x[:, :, 0, 0], pos)),
        ("odd width", ValueError, r"^x: the rope width \(last dimension\) must be even",
         lambda: apply_rope(x[..., :7], pos)),
        ("[T] positions with B == T", ValueError, r"^positions: expected shape \[3, 3\] \(\[B, T\]\)",
         lambda: apply_rope(x, pos[0])),
        ("positions of another shape", ValueError, r"^positions: expected shape \[3, 3\], got \[2, 3\]",
         lambda: apply_rope(x, pos[:2])),
        ("list positions", TypeError, r"^positions: expected a torch.Tensor", lambda: apply_rope(x, pos.tolist())),
        ("float positions", TypeError, r"^positions: expected an integer tensor", lambda: apply_rope(x, pos.float())),
        ("uint64 positions", TypeError, r"^positions: expected a signed integer tensor or one of at most 32 bits",
         lambda: apply_rope(x, pos.to(torch.uint64))),
        ("meta positions", ValueError, r"^positions: expected a tensor on cpu \(same as x\)",
         lambda: apply_rope(x, pos.to(meta))),
        ("theta 0", ValueError, r"^theta: expected a positive, finite real number", lambda: apply_rope(x, pos, 0)),
        ("theta nan", ValueError, r"^theta: expected a positive, finite real number",
         lambda: apply_rope(x, pos, float("nan"))),
        ("theta tensor", TypeError, r"^theta: expected a positive, finite real number",
         lambda: apply_rope(x, pos, torch.tensor(1e4))),
        ("int inv_freq", TypeError, r"^inv_freq: expected a real floating tensor",
         lambda: apply_rope(x, pos, inv_freq=torch.ones(4, dtype=torch.long))),
        ("inv_freq of another width", ValueError, r"^inv_freq: expected shape \[4\]",
         lambda: apply_rope(x, pos, inv_freq=torch.ones(3))),
        ("meta inv_freq", ValueError, r"^inv_freq: expected a tensor on cpu",
         lambda: apply_rope(x, pos, inv_freq=torch.ones(4, device=meta))),
        ("odd d", ValueError, r"^d: expected an even int >= 0", lambda: rope_inv_freq(7)),
        ("negative d", ValueError, r"^d: expected an even int >= 0", lambda: rope_inv_freq(-2)),
        ("float d", TypeError, r"^d: expected an even int >= 0", lambda: rope_inv_freq(8.0)),
        ("theta -1", ValueError, r"^theta: expected a positive, finite real number", lambda: rope_inv_freq(8, -1.0)),
        ("bad device", ValueError, r"^device: expected a torch.device, a device string or a CUDA index",
         lambda: rope_inv_freq(8, device="nowhere")),
        ("cached theta 0", ValueError, r"^theta: expected a positive, finite real number",
         lambda: cached_inv_freq(8, 0, "cpu")),
        ("cached bool d", TypeError, r"^d: expected an even int >= 0", lambda: cached_inv_freq(True, 1e4, "cpu")),
        ("cached no device", ValueError, r"^device: expected a torch.device, a device string or a CUDA index",
         lambda: cached_inv_freq(8, 1e4, None)),
        ("cos_sin float positions", TypeError, r"^positions: expected an integer tensor",
         lambda: rope_cos_sin(pos.float(), rope_inv_freq(8))),
        ("cos_sin [T] positions", ValueError, r"^positions: expected shape \[\*, \*\] \(\[B, T\]\)",
         lambda: rope_cos_sin(pos[0], rope_inv_freq(8))),
        ("cos_sin 2-d inv_freq", ValueError, r"^inv_freq: expected 1 dimensions",
         lambda: rope_cos_sin(pos, torch.ones(2, 2))),
        ("cos_sin int inv_freq", TypeError, r"^inv_freq: expected a real floating tensor",
         lambda: rope_cos_sin(pos, torch.ones(4, dtype=torch.long))),
        ("cos_sin meta positions", ValueError, r"^inv_freq: expected a tensor on meta, got one on cpu",
         lambda: rope_cos_sin(pos.to(meta), rope_inv_freq(8))),
    ]


@pytest.mark.parametrize("case", _rope_bad_calls(), ids=lambda c: c[0])
def test_rope_helpers_refuse_bad_arguments_by_name(case):
    _, exc, match, bad = case
    with pytest.raises(exc, match=match):
        bad()


def test_cached_inv_freq_stays_bounded(monkeypatch):
    """A long-running process that rotates with ever new thetas (a theta scaled per sequence length, say) keeps a
    bounded number of frequency tensors; a repeated call reuses its tensor, and the values are ``rope_inv_freq``'s.
    An entry that a CUDA-graph capture read (its replays read that tensor) is never dropped."""
    from gqla_triton.layers import rope

    x, pos = torch.randn(1, 2, 1, 8), torch.arange(2)[None]
    first = cached_inv_freq(8, 1e4, "cpu")
    assert cached_inv_freq(8, 1e4, "cpu") is first
    captured = cached_inv_freq(8, 1234.5, "cpu")
    with monkeypatch.context() as m:
        m.setattr(rope, "_cacheable", lambda device: False)  # as inside a capture
        assert cached_inv_freq(8, 1234.5, "cpu") is captured
    try:
        for i in range(4 * rope.INV_FREQ_CACHE):
            apply_rope(x, pos, 1000.0 + i)
            assert len(rope._INV_FREQ) <= rope.INV_FREQ_CACHE + len(rope._PINNED)
        assert cached_inv_freq(8, 1234.5, "cpu") is captured
        assert torch.equal(cached_inv_freq(8, 1e4, "cpu"), rope_inv_freq(8, 1e4))
    finally:
        rope._PINNED.discard((8, 1234.5, torch.device("cpu")))


def test_cached_inv_freq_keys_cuda_by_the_current_gpu(monkeypatch):
    """``"cuda"`` names the GPU current at the call: a lookup with it while another GPU is current gets that GPU's
    tensor, and ``"cuda"`` and ``"cuda:i"`` share one entry (two fake GPUs; the tensor is tagged with its device)."""
    from gqla_triton.layers import rope

    current = [1]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(rope, "rope_inv_freq", lambda d, theta, *, device: (d, theta, torch.device(device)))
    monkeypatch.setattr(rope, "_INV_FREQ", {})
    on1 = cached_inv_freq(8, 1e4, "cuda")
    assert on1[2] == torch.device("cuda", 1) and cached_inv_freq(8, 1e4, "cuda:1") is on1
    current[0] = 0
    on0 = cached_inv_freq(8, 1e4, "cuda")
    assert on0[2] == torch.device("cuda", 0) and cached_inv_freq(8, 1e4, torch.device("cuda", 0)) is on0
    assert set(rope._INV_FREQ) == {(8, 1e4, torch.device("cuda", i)) for i in (0, 1)}


def test_apply_rope_takes_the_documented_shapes():
    """``positions [B, T]`` (any integer dtype but uint64) rotate ``x [B, T, ..., d]`` as ``rope_cos_sin``'s
    factors do; d = 0 passes ``x`` through; a numpy integer ``d`` works as the int."""
    x = torch.randn(3, 2, 4, 8, dtype=torch.float64)
    pos = torch.tensor([[0, 1], [5, 9], [100, -3]], dtype=torch.int32)
    cs = rope_cos_sin(pos, rope_inv_freq(8)).double()
    cos, sin = cs[:, :, None, 0], cs[:, :, None, 1]
    want = torch.cat([x[..., :4] * cos - x[..., 4:] * sin, x[..., 4:] * cos + x[..., :4] * sin], -1)
    assert (apply_rope(x, pos) - want).abs().max() < 1e-6
    assert torch.equal(apply_rope(x, pos.long()), apply_rope(x, pos, inv_freq=rope_inv_freq(np.int64(8))))
    empty = torch.randn(3, 2, 0)
    assert apply_rope(empty, pos) is empty
