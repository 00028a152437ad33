"""FlashMLA's FP8 latent caches (656-byte rows; MODEL1 pages): the quantiser's layout and error bound, ``mla_decode``
over them against the float64 reference of the dequantised cache (dense, sparse, splits, MTP, bad pages, pages of
any size for sparse calls), exact NaN propagation, and refusals by name. Under the interpreter every call runs
inside the address check."""

import copy
import math

import pytest
import torch
import triton
import triton.language as tl
from harness import SM90_SHARED, P, assert_close, assert_matches, compile_in_child, examples, gen, pick, randn, seeds
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_adversarial_decode import run_op
from test_gqla_layer import make_layer

from gqla_triton.layers.cache import GroupedCache, LatentCache
from gqla_triton.ops.mla import dequantize_latent_fp8, mla_decode, mla_decode_ref, quantize_latent_fp8
from gqla_triton.ops.mla.fp8 import FP8_ROW_BYTES, M1_ROW_BYTES, M1_TOKEN_BYTES, PAGED, ROW_BYTES, _e2m1_codes
from gqla_triton.ops.mla.triton import _e2m1, _e4m3
from gqla_triton.testing import gqla_reference

pytestmark = pytest.mark.usefixtures("poison_buffers")

QDT = torch.bfloat16 if P.big else torch.float32  # the interpreter computes bf16 wrongly (triton#11584)
HEADS = pick([16], [16, 64, 128])
PAGE = pick([16, 32], [64])
MAXLEN = pick(60, 1500)
# on the GPU both kernels: "auto" takes the Gluon one on Hopper (bf16 q), "triton" the portable one
IMPLS = pick(["auto"], ["auto", "triton"])


def _call(q, kv_cache, block_table, cache_seqlens, head_dim_v, impl="auto", **kw):
    """``mla_decode`` as the adversarial suite runs it (poisoned buffers; the address check under the interpreter)."""
    return run_op("mla", dict(q=q, kv_cache=kv_cache, block_table=block_table, cache_seqlens=cache_seqlens,
                              head_dim_v=head_dim_v, **kw), impl=impl)


def _case(seed, B, s_q, h_q, page, *, bad_pages=False, scale=1.0, past_cap=False):
    """``past_cap``: the first sequence one key longer than its block table holds (the capacity bounds the keys,
    the length places the causal boundary)."""
    g = gen(seed)
    lens = torch.randint(0, MAXLEN + 1, (B,), generator=g)
    max_pages = max(1, math.ceil(int(lens.max()) / page) + int(torch.randint(0, 2, (1,), generator=g)))
    if past_cap:
        lens[0] = max_pages * page + 1
    num_pages = B * max_pages + 2
    bt = torch.randperm(num_pages, generator=g)[: B * max_pages].reshape(B, max_pages).int()
    if bad_pages:
        junk = torch.tensor([-1, num_pages, 2**31 - 1], dtype=torch.int32)
        bt = torch.where(torch.rand(B, max_pages, generator=g) < 0.2, junk[torch.randint(0, 3, bt.shape, generator=g)],
                         bt)
    q = randn((B, s_q, h_q, 576), g, dtype=QDT)
    kv = randn((num_pages, page, 1, 576), g, scale=scale)
    return q, quantize_latent_fp8(kv.cpu()).to(P.device), bt.to(P.device), lens.int().to(P.device), g


def _check(out, lse, q, kv8, bt, lens, **kw):
    deq = dequantize_latent_fp8(kv8.cpu(), torch.float64)
    ro, rl = mla_decode_ref(q, deq, bt, lens, 512, **kw)
    # the kernel's precision: the dequantised keys rounded to q's dtype for the dots (as FlashMLA's FP8 kernel
    # does), P rounded for P·V
    lo, ll = mla_decode_ref(q, deq.to(QDT), bt, lens, 512, p_dtype=QDT, **kw)
    assert out.dtype == q.dtype and out.shape == ro.shape
    assert_close("out", out, ro, lo, dtype=QDT)
    assert_close("lse", lse, rl, ll, dtype=torch.float32, eps=1e-5 if QDT == torch.float32 else 1e-4)


# ---------------------------------------------------------------------------------------------- the layout
@settings(max_examples=examples(20, 20), deadline=None)
@given(rows=st.integers(1, 9), scale=st.sampled_from([1e-3, 1.0, 300.0]), pow2=st.booleans(), seed=seeds())
def test_quantizer_layout_and_error_bound(rows, scale, pow2, seed):
    """Bytes [0, 512) e4m3, [512, 528) the float32 tile scales (amax / 448, or its power of two at or above),
    [528, 656) the bf16 rope values; each value within half an e4m3 step of the original (relative 2^-4, or
    2^-10 of its tile's scale for e4m3 subnormals); a tile's largest magnitude maps to at most 448."""
    x = randn((rows, 576), seed, scale=scale)
    x[0, 128:256] = 0.0  # an all-zero tile: scale 0, zeros back
    q8 = quantize_latent_fp8(x, pow2_scales=pow2)
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == (rows, FP8_ROW_BYTES)
    b = q8.view(torch.uint8)
    sc = b[:, 512:528].contiguous().view(torch.float32)
    amax = x[:, :512].reshape(rows, 4, 128).abs().amax(-1)
    if pow2:
        assert torch.all((sc == 0) | (torch.frexp(sc).mantissa == 0.5)) and torch.all(sc >= amax / 448)
        assert torch.all(sc <= 2 * amax / 448)
    else:
        torch.testing.assert_close(sc, amax / 448, rtol=1e-6, atol=0)
    assert sc[0, 1] == 0
    lat = b[:, :512].contiguous().view(torch.float8_e4m3fn).float()
    assert lat.abs().max() <= 448
    assert torch.equal(b[:, 528:].contiguous().view(torch.bfloat16), x[:, 512:].to(torch.bfloat16))
    deq = dequantize_latent_fp8(q8, torch.float64)
    tile_sc = sc.double().repeat_interleave(128, -1)
    err = (deq[:, :512] - x[:, :512].double()).abs()
    assert torch.all(err <= torch.maximum(x[:, :512].double().abs() * 2**-4, tile_sc * 2**-10) * (1 + 1e-6))
    assert torch.all(deq[0, 128:256] == 0)
    assert torch.equal(dequantize_latent_fp8(q8.view(torch.uint8)), dequantize_latent_fp8(q8))


@pytest.mark.parametrize("pow2", [False, True])
def test_quantizer_tiny_tiles_keep_the_error_bound(pow2):
    """Tiles whose scale amax / 448 is a float32 subnormal, or below float32's range: the scale is rounded up, not
    down or to 0, so every value keeps the bound of ``test_quantizer_layout_and_error_bound`` (none saturates
    past 448, no nonzero tile reads back as zeros); an all-zero tile keeps scale 0."""
    amaxes = [1e-45, 3e-43, 8e-43, 1.5e-42, 1e-40, 1e-38]
    x = torch.zeros(len(amaxes), 576)
    g = gen(4)
    for i, a in enumerate(amaxes):
        x[i, :128] = (torch.rand(128, generator=g, dtype=torch.float64) * 2 - 1) * a
        x[i, 7] = a
    q8 = quantize_latent_fp8(x, pow2_scales=pow2)
    sc = q8.view(torch.uint8)[:, 512:528].contiguous().view(torch.float32)
    assert (sc[:, 0] > 0).all() and (sc[:, 1:] == 0).all()
    assert (sc[:, 0].double() * 448 >= x[:, :128].double().abs().amax(-1)).all()
    deq = dequantize_latent_fp8(q8, torch.float64)
    err = (deq[:, :128] - x[:, :128].double()).abs()
    bound = torch.maximum(x[:, :128].double().abs() * 2**-4, sc[:, :1].double() * 2**-10) * (1 + 1e-6)
    assert (err <= bound).all(), err.amax(-1) / x[:, :128].double().abs().amax(-1)


def test_quantizer_nonfinite_stays_in_its_tile_and_refusals():
    x = torch.randn(2, 576)
    x[1, 300] = float("nan")
    deq = dequantize_latent_fp8(quantize_latent_fp8(x))
    assert deq[1, 256:384].isnan().all() and deq[1, :256].isfinite().all() and deq[1, 384:].isfinite().all()
    assert deq[0].isfinite().all()
    with pytest.raises(ValueError, match=r"^kv: expected a last dim of 576 \(latent 512 \+ rope 64\)"):
        quantize_latent_fp8(torch.randn(3, 512))
    with pytest.raises(TypeError, match="^kv: expected a floating tensor"):
        quantize_latent_fp8(torch.zeros(3, 576, dtype=torch.int32))
    with pytest.raises(TypeError, match="^pow2_scales: expected a bool"):
        quantize_latent_fp8(x, pow2_scales=1)
    with pytest.raises(ValueError, match=r"^kv_cache: expected rows of \[288, 528, 584, 656\] bytes"):
        dequantize_latent_fp8(torch.zeros(3, 576, dtype=torch.uint8))
    with pytest.raises(TypeError, match="^kv_cache: expected a float8_e4m3fn or uint8 tensor"):
        dequantize_latent_fp8(torch.zeros(3, 656))
    for dtype in ("float32", torch.int32, torch.float8_e4m3fn, torch.bool):
        with pytest.raises(TypeError, match="^dtype: expected a floating torch.dtype of 16 bits or more"):
            dequantize_latent_fp8(quantize_latent_fp8(x), dtype)
    # float64: the exact fp8 · scale products; float32: each rounded once (as a float32 kernel forms them)
    x8 = quantize_latent_fp8(torch.randn(2, 576) * 3.7)
    exact, single = dequantize_latent_fp8(x8, torch.float64), dequantize_latent_fp8(x8, torch.float32)
    assert torch.equal(exact.float(), single) and not torch.equal(exact, single.double())


# ---------------------------------------------------------------------------------------------- the op
@settings(max_examples=examples(4, 12), deadline=None)
@given(B=st.integers(1, 3), s_q=st.integers(1, 3), h_q=st.sampled_from(HEADS), page=st.sampled_from(PAGE),
       causal=st.booleans(), num_splits=st.sampled_from([0, 1, 3]), bad_pages=st.booleans(), past_cap=st.booleans(),
       impl=st.sampled_from(IMPLS), seed=seeds())
def test_dense_fp8_vs_reference(B, s_q, h_q, page, causal, num_splits, bad_pages, past_cap, impl, seed):
    q, kv8, bt, lens, _ = _case(seed, B, s_q, h_q, page, bad_pages=bad_pages, past_cap=past_cap)
    out, lse = _call(q, kv8, bt, lens, 512, impl, causal=causal, num_splits=num_splits)
    _check(out, lse, q, kv8, bt, lens, causal=causal)


@settings(max_examples=examples(4, 12), deadline=None)
@given(B=st.integers(1, 3), s_q=st.integers(1, 2), topk=st.sampled_from([16, 40]), with_len=st.booleans(),
       num_splits=st.sampled_from([0, 2]), uint8=st.booleans(), page=st.sampled_from([PAGE[0], 2, 61]),
       impl=st.sampled_from(IMPLS), seed=seeds())
@example(B=2, s_q=2, topk=40, with_len=True, num_splits=2, uint8=False, page=PAGE[0], impl=IMPLS[-1], seed=3)
def test_sparse_fp8_vs_reference(B, s_q, topk, with_len, num_splits, uint8, page, impl, seed):
    """Sparse top-k over the FP8 cache, pages of any size (FlashMLA's sparse caches use 2 or 61 tokens), with and
    without topk lengths, split or not; indices out of range, negative or past the table are ignored. The same
    bytes given as uint8 are the same cache."""
    q, kv8, bt, lens, g = _case(seed, B, s_q, 16, page)
    idx = torch.randint(-4, MAXLEN + 8, (B, s_q, topk), generator=g).int().to(P.device)
    tl_ = torch.randint(0, topk + 1, (B,), generator=g).int().to(P.device) if with_len else None
    cache = kv8.view(torch.uint8) if uint8 else kv8
    out, lse = _call(q, cache, bt, lens, 512, impl, indices=idx, topk_length=tl_, num_splits=num_splits)
    _check(out, lse, q, kv8, bt, lens, indices=idx, topk_length=tl_)


def test_fp8_nan_reaches_only_the_queries_that_see_it():
    """MTP, causal: a NaN in the newest token's latent tile reaches query 1 (which sees it), not query 0."""
    q, kv8, bt, lens, _ = _case(5, 1, 2, 16, PAGE[0])
    lens.fill_(min(MAXLEN, bt.shape[1] * PAGE[0]))
    L = int(lens[0])
    kv = dequantize_latent_fp8(kv8.cpu())
    page, slot = int(bt[0, (L - 1) // PAGE[0]]), (L - 1) % PAGE[0]
    kv[page, slot, 0, 7] = float("nan")
    kv8 = quantize_latent_fp8(kv).to(P.device)
    out, lse = _call(q, kv8, bt, lens, 512, causal=True)
    assert out[0, 0].isfinite().all() and lse[0, :, 0].isfinite().all()
    assert out[0, 1].isnan().all() and lse[0, :, 1].isnan().all()


def test_fp8_refusals_name_the_argument():
    q, kv8, bt, lens, _ = _case(1, 1, 1, 16, PAGE[0])
    with pytest.raises(ValueError, match="kv_cache.*656"):
        mla_decode(q, kv8[..., :576], bt, lens, 512)
    with pytest.raises(ValueError, match="^q / head_dim_v: .* take q of 576 channels and head_dim_v 512"):
        mla_decode(q, kv8, bt, lens, 256)
    with pytest.raises(ValueError, match="q / head_dim_v"):
        mla_decode(q[..., :512].contiguous(), kv8, bt, lens, 448)
    with pytest.raises(TypeError, match="q: .*bfloat16"):
        mla_decode(q.half(), kv8, bt, lens, 512)
    raw = torch.zeros(kv8.numel() + 2, dtype=torch.uint8, device=kv8.device)
    shifted = raw[2:].view(kv8.shape)  # rows 2 bytes off the float32 scales' alignment
    with pytest.raises(ValueError, match="kv_cache.*storage offset must be a multiple of 4"):
        mla_decode(q, shifted, bt, lens, 512)
    odd = raw.as_strided(kv8.shape, (kv8.stride(0), kv8.stride(1), 3, 1))  # a size-1 dim with an odd stride
    with pytest.raises(ValueError, match="kv_cache.*strides .* multiples of 4"):
        mla_decode(q, odd, bt, lens, 512)
    if P.device == "cuda":  # rows 4 bytes off 16-byte boundaries (the interpreter reads them in place)
        wide = torch.zeros(*kv8.shape[:3], 660, dtype=kv8.dtype, device=kv8.device)[..., :656]
        with pytest.raises(ValueError, match="^kv_cache: the kernels read its rows in place with 16-byte loads"):
            mla_decode(q, wide, bt, lens, 512)
    with pytest.raises(ValueError, match="impl='gluon'"):  # float32 q: the Gluon kernel takes bf16 only
        mla_decode(q.float(), kv8, bt, lens, 512, impl="gluon")
    # the reference impl takes the layout too
    o, _ = mla_decode(q, kv8, bt, lens, 512, impl="reference")
    r, _ = mla_decode_ref(q, dequantize_latent_fp8(kv8.cpu()).double(), bt, lens, 512)  # the kernels' float32 values
    torch.testing.assert_close(o.double().cpu(), r.to(o.dtype).double(), rtol=0, atol=0)


def test_which_fp8_caches_the_gluon_kernel_takes():
    """The Gluon kernel's own conditions on an FP8 cache (a CPU check of shapes, strides and dtypes; on a Hopper GPU
    ``impl="auto"`` takes it exactly where this says None, and the FP8 properties above run both kernels): bf16 q,
    rows whose page and token strides and base are 16-byte aligned (the rope values come by cp.async)."""
    from gqla_triton.ops.mla.gluon_sm90 import gluon_unsupported

    q = torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16)
    kv8 = torch.zeros(3, 64, 1, FP8_ROW_BYTES, dtype=torch.float8_e4m3fn)
    assert gluon_unsupported(q, kv8, 512) is None
    assert gluon_unsupported(q, kv8.view(torch.uint8), 512) is None
    assert "bf16 only" in gluon_unsupported(q.half(), kv8, 512)
    assert "bf16 only" in gluon_unsupported(q.float(), kv8, 512)
    raw = torch.zeros(3 * 64 * (FP8_ROW_BYTES + 4) + 4, dtype=torch.uint8)
    padded = raw.as_strided((3, 64, 1, FP8_ROW_BYTES), (64 * (FP8_ROW_BYTES + 4), FP8_ROW_BYTES + 4, 1, 1))
    assert "16-byte" in gluon_unsupported(q, padded, 512)  # 660-byte rows: the scales aligned, the rope not
    assert "16-byte" in gluon_unsupported(q, raw[4:].as_strided(kv8.shape, kv8.stride()), 512)
    assert "kv_cache dtype" in gluon_unsupported(q, torch.zeros(3, 64, 1, 576, dtype=torch.float16), 512)
    for layout in ("model1", "v41", "v41_fp4"):
        paged = quantize_latent_fp8(torch.zeros(2, 64, 1, 512), layout=layout)
        assert f"{layout} layout" in gluon_unsupported(q[..., :512], paged, 512, layout)
    no_rope = quantize_latent_fp8(torch.zeros(2, 64, 1, 512), layout="v32_no_rope")
    assert "v32_no_rope layout" in gluon_unsupported(q[..., :512], no_rope, 512, "v32_no_rope")


# ---------------------------------------------------------------------------------------------- MODEL1 pages
@settings(max_examples=examples(10, 10), deadline=None)
@given(pages=st.integers(1, 3), page=st.sampled_from([1, 2, 61, 64]), scale=st.sampled_from([1e-3, 1.0, 300.0]),
       seed=seeds())
def test_model1_quantizer_layout_and_error_bound(pages, page, scale, seed):
    """Per page: each token's 448 e4m3 values then its 64 bf16 rope values (576 bytes apart), then each token's 7
    UE8M0 scales and a padding byte; pages padded to a multiple of 576 bytes; the scale the least power of two at or
    above amax / 448; each value within half an e4m3 step; an all-zero tile gives zeros, a NaN only its own tile."""
    x = randn((pages, page, 1, 512), seed, scale=scale)
    x[0, 0, 0, 64:128] = 0.0
    if page > 1:
        x[-1, 1, 0, 200] = float("nan")
    q8 = quantize_latent_fp8(x, layout="model1")
    padded = -(-page * M1_ROW_BYTES // 576) * 576
    assert q8.shape == (pages, page, 1, M1_ROW_BYTES) and q8.stride(-1) == 1
    assert (pages == 1 or q8.stride(0) == padded) and (page == 1 or q8.stride(1) == M1_ROW_BYTES)
    b = q8.contiguous().view(torch.uint8).reshape(pages, page * M1_ROW_BYTES)
    tok = b[:, :page * M1_TOKEN_BYTES].reshape(pages, page, M1_TOKEN_BYTES)
    e = b[:, page * M1_TOKEN_BYTES:].reshape(pages, page, 8)
    assert (e[..., 7] == 0).all()
    assert torch.equal(tok[..., 448:].contiguous().view(torch.bfloat16), x[:, :, 0, 448:].to(torch.bfloat16))
    nope = x[:, :, 0, :448].double().reshape(pages, page, 7, 64)
    finite = torch.isfinite(nope).all(-1)
    sc = torch.exp2(e[..., :7].double() - 127)
    amax = nope.abs().amax(-1)
    assert torch.all(~finite | (sc >= amax / 448) & ((sc <= 2 * amax / 448) | (amax == 0)))
    assert torch.equal(e[..., :7] == 255, ~finite)
    deq = dequantize_latent_fp8(q8, torch.float64)
    assert deq.shape == (pages, page, 1, 512)
    d = deq[:, :, 0, :448].reshape(pages, page, 7, 64)
    bound = torch.maximum(nope.abs() * 2**-4, sc[..., None] * 2**-10) * (1 + 1e-6)
    assert torch.all(((d - nope).abs() <= bound)[finite])
    assert torch.isnan(d[~finite]).all() and (deq[0, 0, 0, 64:128] == 0).all()
    assert torch.equal(deq[:, :, 0, 448:], x[:, :, 0, 448:].to(torch.bfloat16).double())
    assert torch.equal(dequantize_latent_fp8(q8.contiguous().view(torch.uint8)).nan_to_num(),
                       dequantize_latent_fp8(q8).nan_to_num())


def _model1_case(seed, B, s_q, h_q, page):
    return _layout_case(seed, "model1", B, s_q, h_q, page)


@settings(max_examples=examples(5, 12), deadline=None)
@given(B=st.integers(1, 3), s_q=st.integers(1, 2), page=st.sampled_from([2, 16, 61]), topk=st.sampled_from([16, 40]),
       with_len=st.booleans(), num_splits=st.sampled_from([0, 2]), uint8=st.booleans(), seed=seeds())
def test_sparse_model1_vs_reference(B, s_q, page, topk, with_len, num_splits, uint8, seed):
    """Sparse top-k over MODEL1 pages (the value is all 512 channels, rope included); junk indices ignored; a NaN in
    a token reaches only the queries that select it."""
    q, kv8, bt, lens, g = _model1_case(seed, B, s_q, HEADS[0], page)
    idx = torch.randint(-4, MAXLEN + 8, (B, s_q, topk), generator=g).int().to(P.device)
    tl_ = torch.randint(0, topk + 1, (B,), generator=g).int().to(P.device) if with_len else None
    cache = kv8.view(torch.uint8) if uint8 else kv8
    out, lse = _call(q, cache, bt, lens, 512, indices=idx, topk_length=tl_, num_splits=num_splits)
    deq = dequantize_latent_fp8(kv8.cpu(), torch.float64)
    ro, rl = mla_decode_ref(q, deq, bt, lens, 512, indices=idx, topk_length=tl_)
    lo, ll = mla_decode_ref(q, deq.to(QDT), bt, lens, 512, indices=idx, topk_length=tl_, p_dtype=QDT)
    assert_close("out", out, ro, lo, dtype=QDT)
    assert_close("lse", lse, rl, ll, dtype=torch.float32, eps=1e-5 if QDT == torch.float32 else 1e-4)


def test_model1_refusals_name_the_argument():
    q, kv8, bt, lens, _ = _model1_case(3, 2, 1, 16, 16)
    idx = torch.zeros(2, 1, 16, dtype=torch.int32, device=P.device)
    with pytest.raises(ValueError, match="MODEL1 FP8 pages .* sparse calls only"):
        mla_decode(q, kv8, bt, lens, 512)
    with pytest.raises(ValueError, match="q / head_dim_v: FlashMLA's MODEL1"):
        mla_decode(q, kv8, bt, lens, 448, indices=idx)
    with pytest.raises(ValueError, match="q / head_dim_v: FlashMLA's MODEL1"):
        mla_decode(torch.zeros(2, 1, 16, 576, dtype=QDT, device=P.device), kv8, bt, lens, 512, indices=idx)
    with pytest.raises(TypeError, match="q: with an FP8"):
        mla_decode(q.half(), kv8, bt, lens, 512, indices=idx)
    swapped = kv8.view(torch.uint8).transpose(0, 1)  # not each page's bytes in order
    with pytest.raises(ValueError, match="kv_cache: FlashMLA's MODEL1 FP8 pages .* are read in place"):
        mla_decode(q, swapped, bt, lens, 512, indices=idx)
    raw = torch.zeros(2 * 16 * M1_ROW_BYTES + 1, dtype=torch.uint8, device=P.device)
    odd = raw[1:].view(2, 16, 1, M1_ROW_BYTES)
    with pytest.raises(ValueError, match="storage offset must be a multiple of 2"):
        mla_decode(q, odd, bt, lens, 512, indices=idx)
    with pytest.raises(ValueError, match="^layout: expected one of"):
        quantize_latent_fp8(torch.zeros(2, 16, 1, 512), layout="model2")
    with pytest.raises(ValueError, match="the model1 layout quantises pages"):
        quantize_latent_fp8(torch.zeros(16, 512), layout="model1")
    with pytest.raises(TypeError, match="^layout: expected one of"):
        quantize_latent_fp8(torch.zeros(2, 576), layout=["v32"])
    with pytest.raises(TypeError, match="^pow2_scales: expected a bool"):
        quantize_latent_fp8(torch.zeros(2, 16, 1, 512), layout="model1", pow2_scales="yes")
    with pytest.raises(ValueError, match=r"^kv_cache: model1 pages are \[num_pages, page_size, 1, 584\]"):
        dequantize_latent_fp8(torch.zeros(2, 3, 2, M1_ROW_BYTES, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------- V4.1 pages, no rope
def _page_regions(q8, layout):
    """The tokens' data bytes ``[pages, page, token]`` and scale bytes ``[pages, page, scales]`` of a paged cache."""
    lay = PAGED[layout]
    pages, page = q8.shape[:2]
    b = q8.contiguous().view(torch.uint8).reshape(pages, page * (lay.token + lay.scales))
    return (b[:, :page * lay.token].reshape(pages, page, lay.token),
            b[:, page * lay.token:].reshape(pages, page, lay.scales))


def _pages_to_quantize(pages, page, scale, seed, *, zero: slice):
    """``[pages, page, 1, 512]`` values: the first token's ``zero`` channels (one scale tile) 0, one value of the
    last page's second token NaN (pages of more than one token)."""
    x = randn((pages, page, 1, 512), seed, scale=scale)
    x[0, 0, 0, zero] = 0.0
    if page > 1:
        x[-1, 1, 0, 200] = float("nan")
    return x


def _paged_strides_ok(q8, layout, pages, page):
    lay = PAGED[layout]
    row = lay.token + lay.scales
    padded = -(-page * row // lay.pad) * lay.pad
    return (q8.shape == (pages, page, 1, row) and q8.stride(-1) == 1 and (pages == 1 or q8.stride(0) == padded)
            and (page == 1 or q8.stride(1) == row))


@settings(max_examples=examples(10, 10), deadline=None)
@given(pages=st.integers(1, 3), page=st.sampled_from([1, 2, 61, 64]), scale=st.sampled_from([1e-3, 1.0, 300.0]),
       seed=seeds())
def test_v41_quantizer_layout_and_error_bound(pages, page, scale, seed):
    """Per page: each token's 512 e4m3 values (rope channels too), then each token's 16 UE8M0 scales, one per 32
    values; pages padded to a multiple of 512 bytes; the scale the least power of two at or above amax / 448; each
    value within half an e4m3 step; an all-zero tile gives zeros, a NaN only its own tile."""
    x = _pages_to_quantize(pages, page, scale, seed, zero=slice(32, 64))
    q8 = quantize_latent_fp8(x, layout="v41")
    assert _paged_strides_ok(q8, "v41", pages, page)
    tok, e = _page_regions(q8, "v41")
    vals = x[:, :, 0].double().reshape(pages, page, 16, 32)
    finite = torch.isfinite(vals).all(-1)
    sc = torch.exp2(e.double() - 127)
    amax = vals.abs().amax(-1)
    assert torch.all(~finite | (sc >= amax / 448) & ((sc <= 2 * amax / 448) | (amax == 0)))
    assert torch.equal(e == 255, ~finite)
    deq = dequantize_latent_fp8(q8, torch.float64, kv_format="v41")
    assert deq.shape == (pages, page, 1, 512)
    d = deq[:, :, 0].reshape(pages, page, 16, 32)
    mine = tok.view(torch.float8_e4m3fn).double().reshape(pages, page, 16, 32) * sc[..., None]
    assert torch.equal(d[finite], mine[finite])  # the scale tile of value i is i // 32
    bound = torch.maximum(vals.abs() * 2**-4, sc[..., None] * 2**-10) * (1 + 1e-6)
    assert torch.all(((d - vals).abs() <= bound)[finite])
    assert torch.isnan(d[~finite]).all() and (deq[0, 0, 0, 32:64] == 0).all()


def test_e2m1_rounds_to_nearest_even_and_saturates():
    """The fp4 quantiser's rounding: the nearest e2m1 value, a tie to the even code, saturated at ±6, the sign
    kept for -0; NaN gives code 0 (its tile's scale carries the NaN)."""
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, float("inf"), -0.25, -5.0, -100.0, 0.3, 2.6,
                      float("nan"), -0.0, 6.0, 0.5])
    want = torch.tensor([0, 2, 2, 4, 4, 6, 6, 7, 7, 8, 14, 15, 1, 5, 0, 8, 7, 1], dtype=torch.uint8)
    assert torch.equal(_e2m1_codes(x), want)


@settings(max_examples=examples(10, 10), deadline=None)
@given(pages=st.integers(1, 3), page=st.sampled_from([1, 2, 61, 64]), scale=st.sampled_from([1e-3, 1.0, 300.0]),
       seed=seeds())
def test_v41_fp4_quantizer_layout_and_error_bound(pages, page, scale, seed):
    """Per page: each token's 512 e2m1 values in 256 bytes (the even channel in the low nibble), then its 32 e4m3
    scales amax / 6 (within [2^-9, 448]), one per 16 values; pages padded to a multiple of 512 bytes; each value
    within half an e2m1 step of its scaled value (plus what saturation at ±6 cuts); a NaN poisons its tile's scale."""
    x = _pages_to_quantize(pages, page, scale, seed, zero=slice(16, 32))
    q8 = quantize_latent_fp8(x, layout="v41_fp4")
    assert _paged_strides_ok(q8, "v41_fp4", pages, page)
    tok, s = _page_regions(q8, "v41_fp4")
    codes = torch.stack((tok & 15, tok >> 4), -1).reshape(pages, page, 512)
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64,
                        device=codes.device)[(codes & 7).long()]
    e2m1 = torch.where((codes & 8) != 0, -mags, mags).reshape(pages, page, 32, 16)
    sc = s.view(torch.float8_e4m3fn).double()
    vals = x[:, :, 0].double().reshape(pages, page, 32, 16)
    finite = torch.isfinite(vals).all(-1)
    amax = vals.abs().amax(-1)
    want_sc = (amax / 6).clamp(2.0**-9, 448).float().to(torch.float8_e4m3fn).double()
    assert torch.equal(sc[finite], want_sc[finite]) and torch.isnan(sc[~finite]).all()
    deq = dequantize_latent_fp8(q8, torch.float64)
    d = deq[:, :, 0].reshape(pages, page, 32, 16)
    assert torch.equal(d[finite], (e2m1 * sc[..., None])[finite])
    r = (vals / sc[..., None]).abs()
    half = torch.where(r <= 2, 0.25, torch.where(r <= 4, 0.5, 1.0))
    bound = sc[..., None] * (half + (r - 6).clamp(min=0)) * (1 + 1e-9)
    assert torch.all(((d - vals).abs() <= bound)[finite])
    assert torch.isnan(d[~finite]).all() and (deq[0, 0, 0, 16:32] == 0).all()


@pytest.mark.parametrize("layout", ["v32", "v32_no_rope", "model1", "v41", "v41_fp4"])
def test_quantisers_take_strided_and_expanded_values(layout):
    """Every layout quantises a strided view (every other channel), a transposed one and an expanded one (stride 0
    along the channels) to the bytes of the same values made contiguous (V4.1, which has no rope part, raised on
    the empty rope slice of a strided view)."""
    width = 576 if layout == "v32" else 512
    shape = (2, 4, 1) if layout in PAGED else (3,)
    g = gen(6)
    views = [torch.randn(*shape, 2 * width, generator=g)[..., ::2],
             torch.randn(width, *shape, generator=g).movedim(0, -1),
             torch.randn(*shape, 1, generator=g).expand(*shape, width)]
    for x in views:
        assert not x.is_contiguous()
        got = quantize_latent_fp8(x, layout=layout).view(torch.uint8)
        assert torch.equal(got, quantize_latent_fp8(x.contiguous(), layout=layout).view(torch.uint8))


@pytest.mark.parametrize("layout", ["v32", "v32_no_rope", "model1", "v41", "v41_fp4"])
def test_quantisers_take_empty_caches(layout):
    """No pages, or pages of no token: every layout quantises to an empty cache of its row width and reads back
    empty (no reshape of zero elements left to infer)."""
    width = 576 if layout == "v32" else 512
    for shape in ((0, 4, 1, width), (3, 0, 1, width)):
        q8 = quantize_latent_fp8(torch.zeros(shape), layout=layout)
        assert tuple(q8.shape) == shape[:3] + (ROW_BYTES[layout],)
        back = dequantize_latent_fp8(q8, torch.float64, kv_format=layout)
        assert tuple(back.shape) == shape


def test_v32_no_rope_rows_are_the_v32_rows_without_rope():
    """The 528-byte rows are the first 528 bytes of the 656-byte rows of the same latent values (and read back as
    them); a 528-byte cache is V4.1 pages unless ``kv_format`` names this layout."""
    x = randn((3, 5, 576), 7, scale=3.0)
    full = quantize_latent_fp8(x)
    short = quantize_latent_fp8(x[..., :512], layout="v32_no_rope")
    assert short.shape == (3, 5, ROW_BYTES["v32_no_rope"])
    assert torch.equal(short.view(torch.uint8), full.view(torch.uint8)[..., :528])
    assert torch.equal(dequantize_latent_fp8(short, torch.float64, kv_format="v32_no_rope"),
                       dequantize_latent_fp8(full, torch.float64)[..., :512])
    pages = quantize_latent_fp8(randn((2, 4, 1, 512), 8), layout="v41")
    assert torch.equal(dequantize_latent_fp8(pages, torch.float64), dequantize_latent_fp8(pages, torch.float64,
                                                                                        kv_format="v41"))
    assert not torch.equal(dequantize_latent_fp8(pages, torch.float64, kv_format="v32_no_rope").nan_to_num(),
                           dequantize_latent_fp8(pages, torch.float64))
    with pytest.raises(ValueError, match="kv_format='v32_no_rope'"):  # 528-byte rows read as V4.1 pages
        dequantize_latent_fp8(short)


def _layout_case(seed, layout, B, s_q, h_q, page, *, nan_token=False):
    """A cache of ``layout`` (pages of ``page`` tokens), its block table and lengths, q of the layout's width."""
    g = gen(seed)
    lens = torch.randint(0, MAXLEN + 1, (B,), generator=g)
    max_pages = max(1, math.ceil(int(lens.max()) / page))
    num_pages = B * max_pages + 2
    bt = torch.randperm(num_pages, generator=g)[: B * max_pages].reshape(B, max_pages).int()
    q = randn((B, s_q, h_q, 512), g, dtype=QDT)
    kv = randn((num_pages, page, 1, 512), g, scale=1.0 if layout in PAGED else 2.0)
    if nan_token:  # one channel of one token of the first sequence's first page
        kv[int(bt[0, 0]), 0, 0, int(torch.randint(0, 512, (1,), generator=g))] = float("nan")
    return q, quantize_latent_fp8(kv, layout=layout).to(P.device), bt.to(P.device), lens.int().to(P.device), g


@settings(max_examples=examples(6, 12), deadline=None)
@given(layout=st.sampled_from(["v41", "v41_fp4", "v32_no_rope"]), B=st.integers(1, 3), s_q=st.integers(1, 2),
       page=st.sampled_from([2, 16, 61]), topk=st.sampled_from([16, 40]), with_len=st.booleans(),
       num_splits=st.sampled_from([0, 2]), uint8=st.booleans(), named=st.booleans(), dense=st.booleans(),
       seed=seeds())
def test_v41_and_no_rope_layouts_vs_reference(layout, B, s_q, page, topk, with_len, num_splits, uint8, named, dense,
                                              seed):
    """Sparse top-k over V4.1 FP8 / fp4 pages and V3.2 rows without rope (dense too: per-token rows, pages of a
    multiple of 16), against the float64 reference of the dequantised cache; junk indices ignored. A 528-byte cache
    is read as V3.2 without rope only where ``kv_format`` says so."""
    dense = dense and layout == "v32_no_rope"
    page = 16 if dense else page
    q, kv8, bt, lens, g = _layout_case(seed, layout, B, s_q, HEADS[0], page)
    fmt = layout if named or layout == "v32_no_rope" else None
    idx = None if dense else torch.randint(-4, MAXLEN + 8, (B, s_q, topk), generator=g).int().to(P.device)
    tl_ = torch.randint(0, topk + 1, (B,), generator=g).int().to(P.device) if with_len and not dense else None
    cache = kv8.view(torch.uint8) if uint8 else kv8
    out, lse = _call(q, cache, bt, lens, 512, indices=idx, topk_length=tl_, num_splits=num_splits, kv_format=fmt)
    deq = dequantize_latent_fp8(kv8.cpu(), kv_format=layout).double()  # value · scale rounded to float32, as read
    ro, rl = mla_decode_ref(q, deq, bt, lens, 512, indices=idx, topk_length=tl_)
    lo, ll = mla_decode_ref(q, deq.to(QDT), bt, lens, 512, indices=idx, topk_length=tl_, p_dtype=QDT)
    assert_close("out", out, ro, lo, dtype=QDT)
    assert_close("lse", lse, rl, ll, dtype=torch.float32, eps=1e-5 if QDT == torch.float32 else 1e-4)
    r2, l2 = mla_decode_ref(q, kv8, bt, lens, 512, indices=idx, topk_length=tl_, kv_format=fmt)  # the same layout
    assert torch.equal(r2, ro) and torch.equal(l2, rl)


@pytest.mark.parametrize("layout", ["v41", "v41_fp4", "v32_no_rope", "model1"])
def test_nan_in_a_quantised_tile_reaches_only_the_queries_that_select_it(layout):
    """A NaN value makes its tile's scale NaN: the token's key and value are NaN over that tile, and exactly the
    queries whose rows select the token get NaN (others exact as the reference)."""
    q, kv8, bt, lens, g = _layout_case(11, layout, 2, 2, HEADS[0], 16, nan_token=True)
    lens = torch.full_like(lens, 40)
    bad = int(bt[0, 0]) * 16  # the NaN token's physical row is page bt[0, 0], slot 0: logical position 0 of seq 0
    idx = torch.randint(1, 40, (2, 2, 16), generator=g).int().to(P.device)
    idx[0, 1, 3] = 0  # only query token 1 of sequence 0 selects position 0
    fmt = "v32_no_rope" if layout == "v32_no_rope" else None
    out, lse = _call(q, kv8, bt, lens, 512, indices=idx, kv_format=fmt)
    deq = dequantize_latent_fp8(kv8.cpu(), torch.float64, kv_format=fmt)
    assert torch.isnan(deq.reshape(-1, 512)[bad]).any()
    ro, rl = mla_decode_ref(q, deq, bt, lens, 512, indices=idx)
    lo, ll = mla_decode_ref(q, deq.to(QDT), bt, lens, 512, indices=idx, p_dtype=QDT)
    assert torch.isnan(ro[0, 1]).all() and not torch.isnan(ro[0, 0]).any() and not torch.isnan(ro[1]).any()
    assert_matches("out", out, ro, lo, dtype=QDT)
    assert_matches("lse", lse, rl, ll, dtype=torch.float32, eps=1e-5 if QDT == torch.float32 else 1e-4)


def test_layout_refusals_name_the_argument():
    q, kv8, bt, lens, _ = _layout_case(3, "v41", 2, 1, 16, 16)
    idx = torch.zeros(2, 1, 16, dtype=torch.int32, device=P.device)
    with pytest.raises(ValueError, match="^kv_format: expected None or one of"):
        mla_decode(q, kv8, bt, lens, 512, indices=idx, kv_format="V41")  # FlashMLA's name belongs to compat
    with pytest.raises(TypeError, match="^kv_format: expected None or one of"):
        mla_decode(q, kv8, bt, lens, 512, indices=idx, kv_format=4)
    with pytest.raises(ValueError, match="^kv_format: 'model1' is a layout of 584-byte rows"):
        mla_decode(q, kv8, bt, lens, 512, indices=idx, kv_format="model1")
    with pytest.raises(ValueError, match="^kv_format: names the layout"):
        mla_decode(q, torch.zeros(4, 16, 1, 512, dtype=QDT, device=P.device), bt, lens, 512, indices=idx,
                   kv_format="v41")
    with pytest.raises(ValueError, match=r"V4.1 FP8 pages \(528 bytes per token\) are read by sparse calls only"):
        mla_decode(q, kv8, bt, lens, 512, kv_format="v41")
    with pytest.raises(ValueError, match="^q / head_dim_v: FlashMLA's V4.1 FP8 pages"):
        mla_decode(q, kv8, bt, lens, 448, indices=idx, kv_format="v41")
    with pytest.raises(ValueError, match="^q / head_dim_v: FlashMLA's V4.1 FP8 pages"):
        mla_decode(torch.zeros(2, 1, 16, 576, dtype=QDT, device=P.device), kv8, bt, lens, 512, indices=idx)
    with pytest.raises(ValueError, match="^q / head_dim_v: FlashMLA's V3.2 FP8 \\(no rope\\) rows"):
        mla_decode(torch.zeros(2, 1, 16, 576, dtype=QDT, device=P.device), kv8, bt, lens, 512, indices=idx,
                   kv_format="v32_no_rope")
    with pytest.raises(ValueError, match="are read in place"):
        mla_decode(q, kv8.view(torch.uint8).transpose(0, 1), bt, lens, 512, indices=idx, kv_format="v41")
    fp4 = quantize_latent_fp8(torch.zeros(4, 16, 1, 512), layout="v41_fp4").to(P.device)
    with pytest.raises(ValueError, match="V4.1 fp4 pages .* sparse calls only"):
        mla_decode(q, fp4, bt, lens, 512)
    with pytest.raises(ValueError, match="^kv_cache: a torch.uint8 cache holds one of FlashMLA's quantised"):
        mla_decode(q, torch.zeros(4, 16, 1, 530, dtype=torch.uint8, device=P.device), bt, lens, 512, indices=idx)
    with pytest.raises(ValueError, match="the v41 layout quantises pages"):
        quantize_latent_fp8(torch.zeros(16, 512), layout="v41")
    with pytest.raises(ValueError, match="last dim of 512 .* v32_no_rope"):
        quantize_latent_fp8(torch.zeros(2, 576), layout="v32_no_rope")
    with pytest.raises(ValueError, match="^kv_format: expected None or one of"):
        dequantize_latent_fp8(kv8.cpu(), kv_format="V41")
    with pytest.raises(ValueError, match=r"^kv_cache: expected rows of .* \(584 for 'model1'\)"):
        dequantize_latent_fp8(kv8.cpu(), kv_format="model1")


def test_v41_under_torch_compile_fullgraph():
    """``kv_format`` crosses the custom op as a string: the traced call gives the eager bits."""
    q, kv8, bt, lens, g = _layout_case(5, "v41", 2, 1, 16, 16)
    idx = torch.randint(-3, MAXLEN + 8, (2, 1, 32), generator=g, dtype=torch.int32).to(P.device)

    def f(q, kv, bt, lens, idx):
        return mla_decode(q, kv, bt, lens, 512, indices=idx, kv_format="v41")

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for a, b in zip(f(q, kv8, bt, lens, idx), compiled(q, kv8, bt, lens, idx), strict=True):
        assert torch.equal(a, b)


@triton.jit
def _decode_e4m3(u_ptr, hw_ptr, bits_ptr):
    offs = tl.arange(0, 256)
    u = tl.load(u_ptr + offs)
    tl.store(hw_ptr + offs, _e4m3(u, True))
    tl.store(bits_ptr + offs, _e4m3(u, False))


def test_e4m3_from_bits_equals_the_conversion():
    """The portable kernel's e4m3 decode from the bits (GPUs before sm_89, which have no e4m3 conversion) gives
    torch's float32 value of every byte, as the conversion path does: signed zeros, subnormals, ±448, NaN."""
    u = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(P.device)
    hw, bits = (torch.empty(256, device=P.device) for _ in range(2))
    _decode_e4m3[(1,)](u, hw, bits)
    want = u.cpu().view(torch.float8_e4m3fn).float()
    for got in (hw.cpu(), bits.cpu()):
        assert torch.equal(got.isnan(), want.isnan())
        ok = ~want.isnan()
        assert torch.equal(got[ok], want[ok]) and torch.equal(got[ok].signbit(), want[ok].signbit())


@triton.jit
def _decode_e2m1(out_ptr):
    offs = tl.arange(0, 16)
    tl.store(out_ptr + offs, _e2m1(offs))


def test_e2m1_decode_of_every_code():
    """All 16 e2m1 codes decode to their values, code 8 to -0.0 (a sign bit, not ``0 - x``)."""
    got = torch.empty(16, device=P.device)
    _decode_e2m1[(1,)](got)
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    want = torch.cat([mags, -mags])
    got = got.cpu()
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())


@pytest.mark.parametrize("layout", ["v32", "model1", "v41", "v41_fp4", "v32_no_rope", "e4m3"])
def test_portable_kernel_compiles_the_layouts_for_sm90(layout):
    """The sparse loaders of every quantised layout (V3.2 rows with and without rope, MODEL1, V4.1 FP8 / fp4
    pages), and the dense float8 q over a cache scaled per tensor (its bytes converted in the kernel), pass Triton's
    sm_90 compiler (to a cubin, with tensor-core products) at the H200 table's configs, which the H100 shares,
    within an sm_90's shared memory, with no GPU (a child process without the interpreter)."""
    out = compile_in_child(f"from gqla_triton.ops.mla.triton import compile_sm90; k = compile_sm90(layout={layout!r})",
                           "k.metadata.shared, len(k.asm['cubin']) > 0, 'mma' in k.asm['ptx']")
    assert out[1:] == ["True", "True"], out
    assert int(out[0]) <= SM90_SHARED, f"{layout}: {out[0]} bytes of shared memory"


def test_fp8_under_torch_compile_fullgraph():
    """Dense and sparse decode over an FP8 cache traced by ``torch.compile(fullgraph=True)`` give the eager bits;
    a cache view off the scales' 4-byte alignment is still refused by name (the op's body checks the storage
    offset, which the trace cannot read)."""
    q, kv8, bt, lens, g = _case(5, 2, 1, 16, PAGE[0])
    idx = torch.randint(-3, MAXLEN + 8, (2, 1, 32), generator=g, dtype=torch.int32).to(P.device)

    def f(q, kv, bt, lens, idx):
        o, lse = mla_decode(q, kv, bt, lens, 512)
        o2, lse2 = mla_decode(q, kv, bt, lens, 512, indices=idx)
        return o, lse, o2, lse2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for a, b in zip(f(q, kv8, bt, lens, idx), compiled(q, kv8, bt, lens, idx), strict=True):
        assert torch.equal(a, b)
    raw = torch.zeros(kv8.numel() + 2, dtype=torch.uint8, device=kv8.device)
    with pytest.raises(ValueError, match="kv_cache.*storage offset"):
        compiled(q, raw[2:].view(kv8.shape), bt, lens, idx)


# ---------------------------------------------------------------------------------------------- the cache and layer
def test_latent_cache_quantises_on_append():
    """``LatentCache(dtype=float8_e4m3fn)``: 656 bytes per token, rows quantised on append exactly as
    ``quantize_latent_fp8`` does, read back dequantised; layouts it cannot hold are refused by name."""
    cache = LatentCache(3, 80, 512, 64, page_size=PAGE[0], dtype=torch.float8_e4m3fn, device=P.device)
    assert cache.bytes_per_token == 656 and cache.kv.shape[-1] == 656 and cache.compute_dtype == torch.bfloat16
    c, kr = randn((2, 37, 512), 3, device=P.device), randn((2, 37, 64), 4, device=P.device)
    cache.append([2, 0], c, kr)
    for i, s in enumerate([2, 0]):
        got_c, got_r = cache.gather(s)
        want = dequantize_latent_fp8(quantize_latent_fp8(torch.cat([c[i], kr[i]], -1))).to(torch.bfloat16)
        assert torch.equal(got_c, want[:, :512]) and torch.equal(got_r, want[:, 512:])
    assert cache.seqlens() == [37, 0, 37]
    with pytest.raises(ValueError, match="^kv_rank/rope_dim: the FP8 latent layout holds 512 latent"):
        LatentCache(2, 64, 256, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="^dtype: the one 8-bit cache is FlashMLA's FP8 layout"):
        LatentCache(2, 64, 512, 64, dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match=r"^compute_dtype: expected None or one of \(torch.bfloat16, torch.float32\)"):
        LatentCache(2, 64, 512, 64, dtype=torch.float8_e4m3fn, compute_dtype=torch.float16)
    with pytest.raises(TypeError, match="^dtype: the grouped cache has no 8-bit layout"):
        GroupedCache(2, 64, 2, 16, 16, dtype=torch.float8_e4m3fn)


def test_latent_cache_scaled_per_tensor():
    """``LatentCache(dtype=float8_e4m3fn, k_scale=s)``: one e4m3 byte per channel (any widths), each value
    ``x / s`` rounded to e4m3 and saturated at ±448 (an infinity too; NaN kept), read back as ``e4m3 · s``;
    ``k_descale`` is the kernels' float32 ``[1]``; a bad scale or dtype is refused by name."""
    cache = LatentCache(3, 80, 96, 32, page_size=PAGE[0], dtype=torch.float8_e4m3fn, device=P.device, k_scale=0.25,
                        compute_dtype=torch.float32)
    assert cache.bytes_per_token == 128 and not cache.fp8 and cache.k_descale.tolist() == [0.25]
    c, kr = randn((2, 21, 96), 3, device=P.device, scale=30.0), randn((2, 21, 32), 4, device=P.device)
    c[0, 0, :3] = torch.tensor([1e6, -math.inf, math.nan])
    cache.append([2, 0], c, kr)
    for i, s in enumerate([2, 0]):
        got_c, got_r = cache.gather(s)
        want = (torch.cat([c[i], kr[i]], -1) / 0.25).clamp(-448, 448).to(torch.float8_e4m3fn).float() * 0.25
        torch.testing.assert_close(got_c, want[:, :96], rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(got_r, want[:, 96:], rtol=0, atol=0)
    got_c, _ = cache.gather(2)
    assert got_c[0, 0] == 112.0 and got_c[0, 1] == -112.0 and got_c[0, 2].isnan()
    assert torch.equal(cache.latent_rows()[..., :96].isnan().sum(), torch.tensor(1, device=P.device))
    for bad, exc in ((0.0, ValueError), (-1.0, ValueError), (math.inf, ValueError), (math.nan, ValueError),
                     (True, TypeError), ("0.1", TypeError), (torch.ones(1), TypeError)):
        why = "expected None or a positive, finite real number" if exc is TypeError else "the scale of a float8_e4m3fn"
        with pytest.raises(exc, match=f"^k_scale: {why}"):
            LatentCache(2, 64, 96, 32, dtype=torch.float8_e4m3fn, k_scale=bad)
    with pytest.raises(ValueError, match="^k_scale: the scale of a float8_e4m3fn cache .* got 0.5 for dtype torch.bf"):
        LatentCache(2, 64, 96, 32, dtype=torch.bfloat16, k_scale=0.5)
    with pytest.raises(ValueError, match=r"^compute_dtype: expected None or one of \(torch.bfloat16, torch.float16, "):
        LatentCache(2, 64, 96, 32, dtype=torch.float8_e4m3fn, k_scale=0.5, compute_dtype=torch.float64)


@settings(max_examples=examples(2, 6), deadline=None)
@given(B=st.integers(1, 2), g=st.sampled_from([1, 2]), steps=st.integers(1, 2), seed=seeds())
@pytest.mark.parametrize("scaled", [False, True])
def test_gqla_layer_decodes_over_an_fp8_latent_cache(scaled, B, g, steps, seed):
    """GQLAttention's absorb decode over an FP8 latent cache (``make_cache(dtype=float8_e4m3fn)``, FlashMLA's layout,
    or with ``k_scale`` one scaled per tensor) equals the float64 layer reference over the dequantised past, within
    torch's error at the same precision (``impl="reference"`` on a copy of the cache); the switch to the grouped
    path reads the same dequantised latents."""
    dims = dict(hidden=64, num_heads=16, head_dim=16, rope_dim=64, kv_rank=512)
    gg = gen(seed)
    layer = make_layer(seed, g=g, dtype=QDT, dims=dims)
    cache = layer.make_cache(B + 1, MAXLEN + 8, path="absorb", page_size=PAGE[0], dtype=torch.float8_e4m3fn,
                             k_scale=0.01 if scaled else None)
    assert cache.fp8 != scaled and cache.compute_dtype == QDT
    assert cache.kv.shape[-1] == (576 if scaled else FP8_ROW_BYTES)
    ids = list(range(1, B + 1))
    lens = torch.randint(1, MAXLEN + 1 - steps, (B,), generator=gg).tolist()
    for i, s in enumerate(ids):
        cache.append([s], randn((1, lens[i], 512), gg, dtype=QDT), randn((1, lens[i], 64), gg, dtype=QDT))
    grp = GroupedCache.from_latent(cache, layer)
    past = [tuple(t.double().cpu() for t in cache.gather(s)) for s in ids]
    for s, (c, kr) in zip(ids, past, strict=True):
        k, _, r = grp.gather(s)
        wk = layer.w_uk_uv(torch.float64)[0].cpu()
        assert_close("grouped k", k, torch.einsum("gdr,lr->lgd", wk, c), k.double().cpu(), dtype=QDT, factor=1.0)
        assert torch.equal(r.double().cpu(), kr)
    low = copy.deepcopy(layer)
    low.impl = "reference"
    for step in range(steps):
        x = randn((B, 1, layer.hidden_size), gg, dtype=QDT)
        pos = torch.tensor([n + step for n in lens])[:, None]
        past = [tuple(t.double().cpu() for t in cache.gather(s)) for s in ids]
        ref = gqla_reference(layer, x, pos, past)
        lowc = copy.deepcopy(cache)
        with torch.no_grad():
            y = layer(x, pos, cache, seq_ids=ids)
            y_low = low(x, pos, lowc, seq_ids=ids)
        assert_close(f"absorb step {step}", y, ref, y_low, dtype=QDT)
        assert cache.seqlens(ids) == [n + step + 1 for n in lens]


@pytest.mark.parametrize("k_scale", [None, 0.02])
def test_gqla_layer_decode_step_over_an_fp8_cache_under_torch_compile(k_scale):
    """A decode step of the absorb layer over an FP8 latent cache (quantise on append, then ``mla_decode``; FlashMLA's
    layout or scaled per tensor) traced by ``torch.compile(fullgraph=True)``: the eager step's output bits and the
    same cache bytes, step after step."""
    dims = dict(hidden=64, num_heads=16, head_dim=16, rope_dim=64, kv_rank=512)
    gg = gen(7)
    layer = make_layer(7, g=1, dtype=QDT, dims=dims, path="absorb")
    cache = layer.make_cache(3, 64, path="absorb", page_size=PAGE[0], dtype=torch.float8_e4m3fn, k_scale=k_scale)
    with torch.no_grad():
        for s, n in ((0, 13), (1, 17)):
            layer(randn((1, n, 64), gg, dtype=QDT), None, cache, seq_ids=[s])
    cache.reserve([0, 1], 3)
    twin, twin_cache = copy.deepcopy(layer), copy.deepcopy(cache)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: layer(x, None, cache), fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        for _ in range(3):
            x = randn((2, 1, 64), gg, dtype=QDT)
            assert torch.equal(compiled(x), twin(x, None, twin_cache))
            assert torch.equal(cache.kv.view(torch.uint8), twin_cache.kv.view(torch.uint8))
            assert torch.equal(cache.cache_seqlens, twin_cache.cache_seqlens)


# ------------------------------------------- a float8 cache scaled per tensor (vLLM's kv_cache_dtype="fp8")
def _scaled_case(seed, B, s_q, h_q, page, *, q8, per_seq):
    """A float8_e4m3fn cache ``[pages, page, 1, 576]`` with its k_descale, q (float8 with its q_descale where
    ``q8``, else QDT), block table and lengths; descales ``[B]`` where ``per_seq``, else ``[1]``."""
    q, _, bt, lens, g = _case(seed, B, s_q, h_q, page)
    kv8 = (torch.randn(bt.numel() + 2, page, 1, 576, generator=g) * 40).to(torch.float8_e4m3fn).to(P.device)
    n = B if per_seq else 1
    kd = (torch.rand(n, generator=g) * 0.05 + 0.005).to(P.device)
    qd = (torch.rand(n, generator=g) * 0.1 + 0.01).to(P.device) if q8 else None
    if q8:
        q = (randn(q.shape, g) * 30).to(torch.float8_e4m3fn).to(P.device)
    return q, kv8, bt, lens, qd, kd, g


def _check_scaled(out, lse, q, kv8, bt, lens, qd, kd, **kw):
    ro, rl = mla_decode_ref(q, kv8, bt, lens, 512, q_descale=qd, k_descale=kd, **kw)
    # the kernel's precision: the exact e4m3 values in the dots' dtype (fp16 for a float8 q), P rounded to it, out
    # rounded to out's dtype
    kdt = torch.float16 if q.dtype == torch.float8_e4m3fn else q.dtype
    lo, ll = mla_decode_ref(q, kv8, bt, lens, 512, q_descale=qd, k_descale=kd, p_dtype=kdt, **kw)
    assert out.dtype == (torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype) and out.shape == ro.shape
    assert_close("out", out, ro, lo.to(out.dtype).double(), dtype=out.dtype)
    assert_close("lse", lse, rl, ll, dtype=torch.float32, eps=1e-5)


@settings(max_examples=examples(4, 12), deadline=None)
@given(B=st.integers(1, 3), s_q=st.integers(1, 3), page=st.sampled_from(PAGE), causal=st.booleans(),
       num_splits=st.sampled_from([0, 1, 3]), q8=st.booleans(), per_seq=st.booleans(), sparse=st.booleans(),
       seed=seeds())
@example(B=3, s_q=2, page=PAGE[0], causal=True, num_splits=3, q8=True, per_seq=True, sparse=False, seed=4)
@example(B=2, s_q=2, page=PAGE[0], causal=False, num_splits=0, q8=False, per_seq=True, sparse=True, seed=5)
def test_scaled_fp8_cache_vs_reference(B, s_q, page, causal, num_splits, q8, per_seq, sparse, seed):
    """Dense (MTP, causal or not) and sparse calls over a float8 cache scaled per tensor, with a float8 q and its
    descale or a QDT q, one descale for the batch or one per sequence, against the float64 reference of the
    descaled scores and output; the FlashMLA entry point gives the same result for the dense path."""
    q, kv8, bt, lens, qd, kd, g = _scaled_case(seed, B, s_q, 16, page, q8=q8, per_seq=per_seq)
    kw = dict(causal=causal)
    if sparse:
        kw = dict(causal=causal, indices=torch.randint(-4, MAXLEN + 8, (B, s_q, 24), generator=g).int().to(P.device))
    out, lse = _call(q, kv8, bt, lens, 512, num_splits=num_splits, q_descale=qd, k_descale=kd, **kw)
    _check_scaled(out, lse, q, kv8, bt, lens, qd, kd, **kw)
    if not sparse and (q8 or qd is None):
        import gqla_triton as gq

        meta, _ = gq.get_mla_metadata()
        fo, fl = gq.flash_mla_with_kvcache(q, kv8, bt, lens, 512, meta, causal=causal, descale_q=qd, descale_k=kd,
                                           is_fp8_kvcache=True)
        ref_o, ref_l = mla_decode(q, kv8, bt, lens, 512, causal=causal, q_descale=qd, k_descale=kd)
        assert torch.equal(fo, ref_o)
        assert torch.equal(fl, torch.where(ref_l == -math.inf, math.inf, ref_l))


def test_scaled_fp8_nonfinite_and_empty_rows():
    """A NaN byte in the newest token reaches only the MTP query that sees it; an empty sequence gives out 0 and
    lse -inf whatever its descale (NaN included); a NaN descale poisons exactly its own sequence."""
    q, kv8, bt, lens, qd, kd, _ = _scaled_case(3, 3, 2, 16, PAGE[0], q8=True, per_seq=True)
    lens[0] = min(MAXLEN, bt.shape[1] * PAGE[0])
    lens[1] = 0
    L = int(lens[0])
    page, slot = int(bt[0, (L - 1) // PAGE[0]]), (L - 1) % PAGE[0]
    raw = kv8.view(torch.uint8)
    raw[page, slot, 0, 7] = 0x7F  # e4m3 NaN
    kd[1] = float("nan")
    kd[2] = float("nan") if int(lens[2]) > 0 else kd[2]
    out, lse = _call(q, kv8, bt, lens, 512, causal=True, q_descale=qd, k_descale=kd)
    assert out[0, 0].isfinite().all() and lse[0, :, 0].isfinite().all()
    assert out[0, 1].isnan().all() and lse[0, :, 1].isnan().all()
    assert (out[1] == 0).all() and (lse[1] == -math.inf).all()
    if int(lens[2]) > 0:
        assert out[2].isnan().all() and lse[2].isnan().all()
    _check_scaled(out[:1, :1], lse[:1, :, :1], q[:1, :1], kv8, bt[:1], lens[:1] - 1, qd[:1], kd[:1], causal=True)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_scaled_fp8_descales_past_the_log2_range(num_splits):
    """Descales whose scores pass float32's range in log2 units but not in natural log (k_descale ±4e37 times a
    score of ±15 at softmax_scale 0.5: lse 3e38), and a negative one: each query's top key takes all the weight
    (out is its value row, times the descale) and lse is finite, as in the float64 reference."""
    g = gen(11)
    B, page = 2, PAGE[0]
    pages = -(-40 // page)
    bt = torch.arange(B * pages, dtype=torch.int32).reshape(B, pages).to(P.device)
    lens = torch.tensor([40, 33], dtype=torch.int32, device=P.device)
    kvf = torch.rand(B * pages, page, 1, 576, generator=g, dtype=torch.float64) * 2 - 1
    kd = torch.tensor([4e37, -4e37], dtype=torch.float32)
    for b, pos in enumerate((19, 30)):
        kvf[int(bt[b, pos // page]), pos % page, 0, 575] = 15.0 if kd[b] > 0 else -15.0
    kv8 = kvf.to(torch.float8_e4m3fn).to(P.device)
    q = torch.zeros(B, 1, 16, 576, dtype=QDT, device=P.device)
    q[..., 575] = 1.0  # every score is a key's last rope channel
    kd = kd.to(P.device)
    out, lse = _call(q, kv8, bt, lens, 512, impl="triton", num_splits=num_splits, softmax_scale=0.5, k_descale=kd)
    ro, rl = mla_decode_ref(q, kv8, bt, lens, 512, softmax_scale=0.5, k_descale=kd)
    assert torch.isfinite(rl).all() and torch.isfinite(ro).all()
    assert torch.isfinite(lse).all() and torch.isfinite(out).all()
    torch.testing.assert_close(lse.double().cpu(), rl.cpu(), rtol=1e-5, atol=0)
    assert_close("out", out, ro, dtype=out.dtype)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_scaled_fp8_zero_tiny_and_nan_descale_products(num_splits):
    """Scales whose product with the descales is not a normal float32 number: a zero k_descale, a zero
    softmax_scale, descales whose product underflows float32 (every score 0: a uniform softmax), descales whose
    product alone overflows it beside a tiny scale (finite scores); each as the float64 reference, never NaN. A NaN
    descale poisons the rows that see a key, and a sparse row that selects nothing keeps out 0 and lse -inf."""
    q8, kv8, bt, lens, _, _, g = _scaled_case(13, 2, 2, 16, PAGE[0], q8=True, per_seq=False)
    qb = randn(q8.shape, g, dtype=QDT)
    lens = lens.clamp(min=1)
    f32 = dict(dtype=torch.float32, device=P.device)
    cases = [(qb, None, torch.zeros(1, **f32), {}), (qb, None, torch.tensor([0.03], **f32), dict(softmax_scale=0.0)),
             (q8, torch.tensor([1e-30], **f32), torch.tensor([1e-30], **f32), {}),
             (q8, torch.tensor([1e20], **f32), torch.tensor([1e20], **f32), dict(softmax_scale=1e-30))]
    for q, qd, kd, kw in cases:
        out, lse = _call(q, kv8, bt, lens, 512, impl="triton", num_splits=num_splits, q_descale=qd, k_descale=kd,
                         **kw)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all(), (qd, kd, kw)
        _check_scaled(out, lse, q, kv8, bt, lens, qd, kd, **kw)
    idx = torch.randint(0, MAXLEN, (2, 2, 16), generator=g).int().to(P.device)
    idx[0, 1] = -1
    nan = torch.full((1,), math.nan, **f32)
    for kd in (nan, torch.zeros(1, **f32)):
        out, lse = _call(qb, kv8, bt, lens, 512, impl="triton", num_splits=num_splits, indices=idx, k_descale=kd)
        assert (out[0, 1] == 0).all() and (lse[0, :, 1] == -math.inf).all()
        seen = (lse != -math.inf).permute(0, 2, 1)
        assert (out[seen].isnan() if kd.isnan().all() else out[seen] == 0).all()


def test_tied_top_keys_share_the_weight_at_huge_descales():
    """Two tokens with the same top score under k_descale 1e30 (a softmax that is a max): each takes half the
    weight, so out is k_descale times their mean, in the kernel and in the float64 reference (whose weights are
    normalised by their sum: ``exp(s - lse)`` gave each weight 1 there, ``max + ln 2`` rounding to ``max``)."""
    g = gen(17)
    page = PAGE[0]
    kvf = torch.rand(2, page, 1, 576, generator=g, dtype=torch.float64) * 2 - 1
    kvf[..., 575] = 0.0
    kvf[0, 2, 0, 575] = kvf[1, 5, 0, 575] = 8.0
    kv8 = kvf.to(torch.float8_e4m3fn).to(P.device)
    q = torch.zeros(1, 1, 16, 576, dtype=QDT, device=P.device)
    q[..., 575] = 1.0  # every score is a token's last rope channel
    bt = torch.tensor([[0, 1]], dtype=torch.int32, device=P.device)
    lens = torch.tensor([2 * page], dtype=torch.int32, device=P.device)
    kd = torch.tensor([1e30], device=P.device)
    rows = kv8.cpu().double()[:, :, 0, :512]
    want = (1e30 * (rows[0, 2] + rows[1, 5]) / 2).expand(1, 1, 16, 512)
    out, lse = _call(q, kv8, bt, lens, 512, impl="triton", softmax_scale=0.5, k_descale=kd)
    ro, rl = mla_decode_ref(q, kv8, bt, lens, 512, softmax_scale=0.5, k_descale=kd)
    torch.testing.assert_close(ro, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.double().cpu(), want, rtol=1e-6 if QDT == torch.float32 else 1e-2, atol=0)
    torch.testing.assert_close(lse.double().cpu(), rl, rtol=1e-6, atol=0)


def test_scaled_fp8_refusals_name_the_argument():
    q, kv8, bt, lens, qd, kd, _ = _scaled_case(1, 2, 1, 16, PAGE[0], q8=True, per_seq=False)
    qb = q.to(QDT)
    with pytest.raises(TypeError, match="q: a float8_e4m3fn q needs q_descale and k_descale"):
        mla_decode(q, kv8, bt, lens, 512)
    with pytest.raises(ValueError, match="q_descale: a float8_e4m3fn q needs it"):
        mla_decode(q, kv8, bt, lens, 512, k_descale=kd)
    with pytest.raises(ValueError, match="q_descale: a float8_e4m3fn q needs it and any other q takes none"):
        mla_decode(qb, kv8, bt, lens, 512, q_descale=qd, k_descale=kd)
    with pytest.raises(ValueError, match="q_descale: given without k_descale"):
        mla_decode(qb, kv8, bt, lens, 512, q_descale=qd)
    with pytest.raises(ValueError, match="k_descale: scales a float8_e4m3fn cache"):
        mla_decode(qb, kv8.view(torch.uint8), bt, lens, 512, k_descale=kd)
    with pytest.raises(ValueError, match="k_descale: scales a float8_e4m3fn cache"):
        mla_decode(qb, quantize_latent_fp8(torch.randn(4, 16, 1, 576)).to(P.device), bt, lens, 512, k_descale=kd)
    with pytest.raises(ValueError, match="k_descale: expected shape \\[1\\]"):
        mla_decode(q, kv8, bt, lens, 512, q_descale=qd, k_descale=kd.expand(3).contiguous())
    with pytest.raises(TypeError, match="k_descale: expected dtype"):
        mla_decode(q, kv8, bt, lens, 512, q_descale=qd, k_descale=kd.double())
    with pytest.raises(ValueError, match="q_descale: expected 1 dimensions"):
        mla_decode(q, kv8, bt, lens, 512, q_descale=qd[None], k_descale=kd)
    with pytest.raises(TypeError, match="k_descale: expected a torch.Tensor"):
        mla_decode(q, kv8, bt, lens, 512, q_descale=qd, k_descale=0.5)
    with pytest.raises(ValueError, match="k_descale: expected a tensor on"):
        mla_decode(q, kv8, bt, lens, 512, q_descale=qd, k_descale=torch.ones(1, device="meta"))
    with pytest.raises(ValueError, match="impl='gluon'.*k_descale"):
        mla_decode(q, kv8, bt, lens, 512, q_descale=qd, k_descale=kd, impl="gluon")
    with pytest.raises(ValueError, match="^q: expected at least one head of at least one channel"):
        mla_decode(qb[..., :0], kv8[..., :0], bt, lens, 1, k_descale=kd)
    import gqla_triton as gq

    with pytest.raises(ValueError, match="descale_q / descale_k: the dense FP8 path"):
        gq.flash_mla_with_kvcache(q, kv8, None, None, 512, gq.get_mla_metadata()[0], descale_q=qd, descale_k=kd,
                                  indices=torch.zeros(2, 1, 16, dtype=torch.int32, device=P.device))
    # the reference impl and the custom op (torch.compile's route) take the descales too
    o, lse = mla_decode(q, kv8, bt, lens, 512, q_descale=qd, k_descale=kd, impl="reference")
    r, rl = mla_decode_ref(q, kv8, bt, lens, 512, q_descale=qd, k_descale=kd)
    assert o.dtype == torch.bfloat16 and torch.equal(o.cpu(), r.to(o.dtype))
    got = mla_decode(q, kv8, bt, lens, 512, q_descale=qd, k_descale=kd)
    op = torch.ops.gqla_triton.mla_decode(q, kv8, bt, lens, 512, 576 ** -0.5, True, None, None, 0, "auto", qd, kd)
    assert all(torch.equal(a, b) for a, b in zip(op, got, strict=True))


def test_scaled_fp8_under_torch_compile_fullgraph():
    """The scaled cache traced by ``torch.compile(fullgraph=True)``: the eager bits, out bfloat16 for a float8 q."""
    q, kv8, bt, lens, qd, kd, _ = _scaled_case(7, 2, 2, 16, PAGE[0], q8=True, per_seq=True)

    def f(q, kv, bt, lens, qd, kd):
        return mla_decode(q, kv, bt, lens, 512, q_descale=qd, k_descale=kd)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for a, b in zip(f(q, kv8, bt, lens, qd, kd), compiled(q, kv8, bt, lens, qd, kd), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_reference_reads_the_fp8_cache_as_the_kernels_do():
    """A tile scale whose product with an e4m3 value passes float32's range (bytes no quantiser writes) is inf in
    the kernels' float32 product; the reference dequantises the same way, so both give NaN for the queries that
    see that key, and the same finite values elsewhere."""
    g = torch.Generator().manual_seed(5)
    kv8 = quantize_latent_fp8(torch.randn(2, 16, 1, 576, generator=g)).to(P.device)
    raw = kv8.view(torch.uint8)
    raw[0, 3, 0, 512:516] = torch.tensor([1e36], dtype=torch.float32).view(torch.uint8).to(P.device)
    q = torch.randn(2, 1, 16, 576, generator=g).to(P.device, QDT)
    bt = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32, device=P.device)
    lens = torch.tensor([20, 3], dtype=torch.int32, device=P.device)
    out, lse = mla_decode(q, kv8, bt, lens, 512)
    ro, rl = mla_decode_ref(q, kv8, bt, lens, 512)
    assert torch.isnan(lse[0]).all() and torch.isnan(rl[0]).all()  # sequence 0 sees token 3 of page 0
    assert torch.isfinite(lse[1]).all() and torch.isfinite(out[1]).all() and torch.isfinite(ro[1]).all()


def test_large_descale_does_not_overflow_before_the_scale():
    """``k_descale`` 3e37 with a scale of 1/sqrt(80): the scores (about 1e38 in log2 units) and the output fit
    float32, and so do the kernel's, which take the descale and the scale as one factor on the dot."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, 16, 80, generator=g).to(P.device)
    kv = torch.randn(2, 16, 1, 80, generator=g).to(P.device, torch.float8_e4m3fn)
    bt = torch.tensor([[0, 1]], dtype=torch.int32, device=P.device)
    lens = torch.tensor([30], dtype=torch.int32, device=P.device)
    kd = torch.tensor([3e37], device=P.device)
    out, lse = mla_decode(q, kv, bt, lens, 64, k_descale=kd, impl="triton")
    ro, rl = mla_decode_ref(q, kv, bt, lens, 64, k_descale=kd)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(lse.double().cpu(), rl, rtol=1e-5, atol=0)


@pytest.mark.parametrize("layout", ["v32", "v32_no_rope", "model1", "v41", "v41_fp4"])
def test_op_reads_any_strides_of_a_quantised_cache(layout):
    """``mla_decode``'s custom op (a compiled graph, or torch.ops directly) over a quantised cache the public
    function refuses for its strides (a last dimension of stride 2; rows sliced from wider ones, so a page's bytes
    are not in order): the same values as over the contiguous cache, bit for bit."""
    g = gen(11)
    D = 576 if layout == "v32" else 512
    kv8 = quantize_latent_fp8(randn((5, 16, 1, D), g), layout=layout).to(P.device)
    q = randn((2, 1, 16, D), g, dtype=QDT).to(P.device)
    bt = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32, device=P.device)
    lens = torch.tensor([29, 7], dtype=torch.int32, device=P.device)
    idx = torch.randint(-1, 80, (2, 1, 8), generator=g, dtype=torch.int32).to(P.device)
    wider = torch.zeros(*kv8.shape[:3], kv8.shape[3] + 8, dtype=kv8.dtype, device=P.device)
    wider[..., :kv8.shape[3]] = kv8
    views = (torch.stack([kv8, kv8], -1)[..., 0], wider[..., :kv8.shape[3]])
    for indices in ((None, idx) if layout in ("v32", "v32_no_rope") else (idx,)):
        def op(kv):
            return torch.ops.gqla_triton.mla_decode(q, kv, bt, lens, 512, 0.1, indices is None, indices, None, 0,
                                                    "triton", None, None, layout, False)

        want = op(kv8)
        for view in views:
            assert all(torch.equal(a, b) for a, b in zip(want, op(view), strict=True))
