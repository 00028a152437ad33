"""FlashMLA's interface (``flash_mla_with_kvcache``, ``get_mla_metadata``) over mla_decode: FlashMLA's conventions
(physical sparse rows, lse = +inf for a query that sees no key, attention sink, an extra cache) against a float64
reference written from FlashMLA's definitions, and every refusal before any state changes."""

import pytest
import torch
from harness import P, assert_close, dtypes, examples, gen, pick, randn, rel_err, seeds
from hypothesis import example, given, settings
from hypothesis import strategies as st

import gqla_triton as gq
from gqla_triton.ops.mla import mla_decode_ref

pytestmark = pytest.mark.usefixtures("poison_buffers")

DIMS = pick([(32, 16)], [(512, 64)])  # (latent = head_dim_v, rope)
HEADS = pick([16], [16, 64, 128])


def _cache(g, num_pages, page, D, dtype):
    return randn((num_pages, page, 1, D), g, dtype=dtype)


def _rows(g, B, s_q, topk, n_rows):
    """Physical rows: valid ones, -1, and entries past the cache (both select nothing)."""
    idx = torch.randint(0, n_rows, (B, s_q, topk), generator=g)
    junk = torch.tensor([-1, n_rows, n_rows + 7, 2**31 - 1], dtype=torch.int64)
    mask = torch.rand(B, s_q, topk, generator=g) < 0.25
    idx = torch.where(mask, junk[torch.randint(0, 4, (B, s_q, topk), generator=g)], idx)
    return idx.int().to(P.device)


def _flashmla_ref(q, scopes, scale, r, sink=None, p_dtype=None):
    """FlashMLA's sparse decode by definition, in float64: each scope (cache, rows, topk_length or None) gathers
    its rows; -1, rows outside the cache and entries past topk_length are masked; softmax over all scopes; the sink
    scales out by 1 / (1 + exp(sink - lse)); a query with no key gets out 0, lse +inf. ``p_dtype``: the
    probabilities rounded to it before P·V (the kernels' operand precision)."""
    q64 = q.double().cpu()
    keys, bad = [], []
    for kv, idx, length in scopes:
        rows = kv.double().cpu().reshape(-1, kv.shape[-1])
        idx = idx.long().cpu()
        invalid = (idx < 0) | (idx >= rows.shape[0])
        if length is not None:
            invalid |= torch.arange(idx.shape[-1])[None, None, :] >= length.long().cpu()[:, None, None]
        keys.append(rows[idx.clamp(0, rows.shape[0] - 1)])
        bad.append(invalid)
    k = torch.cat(keys, 2)  # [B, s_q, n, D]
    invalid = torch.cat(bad, 2)
    s = torch.einsum("bqhd,bqnd->bqhn", q64, k) * scale
    s = s.masked_fill(invalid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)  # [B, s_q, h]
    lonely = lse == float("-inf")
    p = torch.where(lonely[..., None], 0.0, torch.exp(s - lse[..., None]))
    if p_dtype is not None:
        p = p.to(p_dtype).double()
    out = torch.einsum("bqhn,bqnd->bqhd", p, k[..., :r])
    if sink is not None:
        out = out / (1 + torch.exp(sink.double().cpu()[None, None, :] - lse))[..., None]
    out = out.masked_fill(lonely[..., None], 0.0)
    return out, lse.masked_fill(lonely, float("inf")).transpose(1, 2)


@settings(max_examples=examples(3, 12))
@given(B=st.integers(1, 3), s_q=st.integers(1, 2), h_q=st.sampled_from(HEADS), dims=st.sampled_from(DIMS),
       causal=st.booleans(), dtype=dtypes(), seed=seeds())
@example(B=3, s_q=2, h_q=HEADS[0], dims=DIMS[0], causal=True, dtype=P.dtypes[-1], seed=6)
def test_dense_is_mla_decode_with_flashmla_lse(B, s_q, h_q, dims, causal, dtype, seed):
    """FlashMLA's dense call (MTP, causal or not) is ``mla_decode`` with lse +inf for a sequence with no key."""
    r, dr = dims
    g = gen(seed)
    page = 16
    lens = torch.randint(0, 60, (B,), generator=g)
    lens[0] = 0  # a sequence with no key: lse +inf, out 0
    max_pages = 4
    bt = torch.randperm(B * max_pages + 2, generator=g)[: B * max_pages].reshape(B, max_pages).int().to(P.device)
    q = randn((B, s_q, h_q, r + dr), g, dtype=dtype)
    kv = _cache(g, B * max_pages + 2, page, r + dr, dtype)
    lens = lens.int().to(P.device)
    meta, none = gq.get_mla_metadata(lens, s_q * h_q, 1)
    assert none is None
    out, lse = gq.flash_mla_with_kvcache(q, kv, bt, lens, r, meta, causal=causal)
    ro, rl = mla_decode_ref(q, kv, bt, lens, head_dim_v=r, causal=causal)
    lo, _ = mla_decode_ref(q, kv, bt, lens, head_dim_v=r, causal=causal, p_dtype=dtype)
    assert_close("out", out, ro, lo, dtype=dtype)
    rl = torch.where(rl == float("-inf"), float("inf"), rl)
    assert_close("lse", lse, rl, rl, dtype=torch.float32, eps=1e-5 if dtype == torch.float32 else 1e-4)
    assert torch.isinf(lse[0]).all() and (lse[0] > 0).all() and (out[0] == 0).all()
    assert meta.have_initialized and meta.config.b == B and meta.config.topk is None
    out2, _ = gq.flash_mla_with_kvcache(q, kv, bt, lens, r, meta, causal=causal)  # the record reused
    assert torch.equal(out2, out)


@settings(max_examples=examples(3, 8), deadline=None)
@given(B=st.integers(1, 3), s_q=st.integers(1, 4), h_k=st.sampled_from([2, 3, 8]), group=st.sampled_from([1, 3, 16]),
       causal=st.booleans(), dtype=dtypes(), seed=seeds())
def test_dense_cache_with_several_heads(B, s_q, h_k, group, causal, dtype, seed):
    """FlashMLA's dense decode over a cache of h_k heads (its own tests take h_k 1, 2, 3, 8): query head i attends
    to cache head i // (h_q / h_k); each head against a float64 reference of its own, a sequence with no key
    included; a head count h_k does not divide, or several heads with indices, is refused."""
    r, dr = DIMS[0]
    g = gen(seed)
    page = 16
    h_q = h_k * group
    lens = torch.randint(0, 60, (B,), generator=g)
    lens[-1] = 0
    bt = torch.randperm(B * 4 + 1, generator=g)[: B * 4].reshape(B, 4).int().to(P.device)
    q = randn((B, s_q, h_q, r + dr), g, dtype=dtype)
    kv = randn((B * 4 + 1, page, h_k, r + dr), g, dtype=dtype)
    lens = lens.int().to(P.device)
    meta, _ = gq.get_mla_metadata()
    out, lse = gq.flash_mla_with_kvcache(q, kv, bt, lens, r, meta, causal=causal)
    assert out.shape == (B, s_q, h_q, r) and lse.shape == (B, h_q, s_q) and meta.config.h_k == h_k
    for i in range(h_q):
        args = (q[:, :, i:i + 1], kv[:, :, i // group:i // group + 1], bt, lens)
        ro, rl = mla_decode_ref(*args, head_dim_v=r, causal=causal)
        lo, _ = mla_decode_ref(*args, head_dim_v=r, causal=causal, p_dtype=dtype)
        assert_close(f"out head {i}", out[:, :, i:i + 1], ro, lo, dtype=dtype)
        rl = torch.where(rl == float("-inf"), float("inf"), rl)
        assert_close(f"lse head {i}", lse[:, i:i + 1], rl, rl, dtype=torch.float32,
                     eps=1e-5 if dtype == torch.float32 else 1e-4)
    assert (out[-1] == 0).all() and (lse[-1] == float("inf")).all()
    if h_q > 1:
        fresh, _ = gq.get_mla_metadata()
        with pytest.raises(ValueError, match="^q: h_q=.* must be a multiple of k_cache's h_k"):
            gq.flash_mla_with_kvcache(q[:, :, 1:], kv, bt, lens, r, fresh, causal=causal)
        assert not fresh.have_initialized


@settings(max_examples=examples(4, 12))
@given(B=st.integers(1, 2), s_q=st.integers(1, 2), h_q=st.sampled_from(HEADS), dims=st.sampled_from(DIMS),
       topk=st.sampled_from([16, 40]), use_len=st.booleans(), use_sink=st.booleans(), use_extra=st.booleans(),
       dtype=dtypes(), seed=seeds())
def test_sparse_physical_rows_vs_flashmla_definition(B, s_q, h_q, dims, topk, use_len, use_sink, use_extra, dtype,
                                                     seed):
    r, dr = dims
    g = gen(seed)
    D = r + dr
    kv = _cache(g, 5, 16, D, dtype)
    idx = _rows(g, B, s_q, topk, 5 * 16)
    idx[0, 0] = -1  # a query that sees no key in the main cache
    length = torch.randint(0, topk + 1, (B,), generator=g).int().to(P.device) if use_len else None
    q = randn((B, s_q, h_q, D), g, dtype=dtype)
    sink = (randn((h_q,), g) * 2).float().to(P.device) if use_sink else None
    if use_sink:
        sink[0] = float("inf")  # head 0: out 0
        sink[-1] = float("-inf")  # last head: no effect
    kw, scopes = {}, [(kv, idx, length)]
    if use_extra:
        kv2 = _cache(g, 3, 32, D, dtype)
        idx2 = _rows(g, B, s_q, 24, 3 * 32)
        len2 = torch.randint(0, 25, (B,), generator=g).int().to(P.device)
        kw = dict(extra_k_cache=kv2, extra_indices_in_kvcache=idx2, extra_topk_length=len2)
        scopes.append((kv2, idx2, len2))
    meta, _ = gq.get_mla_metadata()
    scale = 0.3 * D**-0.5
    out, lse = gq.flash_mla_with_kvcache(q, kv, None, None, r, meta, softmax_scale=scale, indices=idx,
                                         topk_length=length, attn_sink=sink, **kw)
    ro, rl = _flashmla_ref(q, scopes, scale, r, sink)
    lo, _ = _flashmla_ref(q, scopes, scale, r, sink, p_dtype=dtype)
    # the two key sets are merged and the sink applied before out is rounded, once, as in a single pass
    assert_close("out", out, ro, lo, dtype=dtype)
    assert_close("lse", lse, rl, rl, dtype=torch.float32, eps=1e-5 if dtype == torch.float32 else 1e-4)
    assert meta.config.topk == topk and meta.config.extra_topk == (24 if use_extra else None)


def test_refusals_change_no_state():
    g = gen(3)
    r, dr = DIMS[0]
    q = randn((2, 1, 16, r + dr), g)
    kv = _cache(g, 4, 16, r + dr, torch.float32)
    bt = torch.arange(4, dtype=torch.int32, device=P.device).reshape(2, 2)
    lens = torch.tensor([20, 31], dtype=torch.int32, device=P.device)
    idx = torch.zeros(2, 1, 16, dtype=torch.int32, device=P.device)
    meta, _ = gq.get_mla_metadata()
    sink16 = torch.zeros(16, device=P.device)
    cases = [
        (ValueError, r"^num_splits: must be None \(FlashMLA's placeholder",
         dict(num_splits=torch.ones(3, dtype=torch.int32))),
        (ValueError, "^causal: must be False with indices", dict(causal=True, indices=idx)),
        (ValueError, "^attn_sink, extra_k_cache, .*: must be None without indices", dict(attn_sink=sink16)),
        (ValueError, "^k_cache: is_fp8_kvcache=True but the cache is not FlashMLA's FP8 layout",
         dict(is_fp8_kvcache=True)),
        (ValueError, "^extra_k_cache and extra_indices_in_kvcache: give both or neither",
         dict(indices=idx, extra_k_cache=kv)),
        (TypeError, r"^attn_sink: expected dtype in \(float32\), got float64",
         dict(indices=idx, attn_sink=sink16.double())),
        (ValueError, r"^attn_sink: expected shape \[16\], got \[15\]", dict(indices=idx, attn_sink=sink16[:15])),
        (TypeError, "^causal: expected a bool, got str", dict(causal="yes")),
        (TypeError, r"^indices: expected dtype in \(int32\), got int64", dict(indices=idx.long())),
        (ValueError, "^kv_format: expected None or one of", dict(kv_format="v32")),
        (ValueError, "^descale_q: given without descale_k", dict(descale_q=torch.ones(1, device=P.device))),
        (ValueError, "^descale_k: scales a float8_e4m3fn cache", dict(descale_k=torch.ones(1, device=P.device))),
        (ValueError, "^descale_q / descale_k: the dense FP8 path",
         dict(indices=idx, descale_k=torch.ones(1, device=P.device))),
        (TypeError, "^enable_batch_invariant: expected a bool, got str", dict(enable_batch_invariant="yes")),
        (TypeError, "^use_legacy: expected a bool, got NoneType", dict(use_legacy=None)),
        (ValueError, "^extra_topk_length: given without extra_k_cache",
         dict(indices=idx, extra_topk_length=torch.ones(2, dtype=torch.int32, device=P.device))),
        (ValueError, "^k_cache: expected at least one block", dict(k_cache=kv[:0])),
        (ValueError, "^k_cache: expected at least one block", dict(k_cache=kv[:0], indices=idx)),
        (ValueError, "^k_cache: expected at least one block", dict(k_cache=kv[:, :0], indices=idx)),
        (TypeError, "^block_table: expected None or a tensor", dict(indices=idx, block_table="junk")),
        (TypeError, "^cache_seqlens: expected None or a tensor", dict(indices=idx, cache_seqlens=5)),
    ]
    for exc, match, kw in cases:
        with pytest.raises(exc, match=match):
            gq.flash_mla_with_kvcache(**{**dict(q=q, k_cache=kv, block_table=bt, cache_seqlens=lens, head_dim_v=r,
                                                tile_scheduler_metadata=meta), **kw})
        assert not meta.have_initialized and meta.config is None
    for junk in (None, "config"):  # marked initialised by hand, with no configuration recorded
        with pytest.raises(ValueError, match="^tile_scheduler_metadata: have_initialized is set"):
            gq.flash_mla_with_kvcache(q, kv, bt, lens, r, gq.FlashMLASchedMeta(have_initialized=True, config=junk))
    with pytest.raises(TypeError, match="^tile_scheduler_metadata: expected the FlashMLASchedMeta"):
        gq.flash_mla_with_kvcache(q, kv, bt, lens, r, None)
    with pytest.raises(ValueError, match=r"^k_cache: expected \[num_blocks, .*\(sparse calls: one latent head"):
        gq.flash_mla_with_kvcache(q, kv.expand(4, 16, 2, r + dr), bt, lens, r, meta, indices=idx)
    gq.flash_mla_with_kvcache(q, kv, bt, lens, r, meta)
    config = meta.config
    for field, kw in (("causal", dict(causal=True)), ("topk", dict(indices=idx))):
        with pytest.raises(ValueError, match=rf"^tile_scheduler_metadata: recorded for another configuration "
                                             rf"\(differs in \['{field}'\]\)"):
            gq.flash_mla_with_kvcache(q, kv, bt, lens, r, meta, **kw)
    with pytest.raises(ValueError, match=r"^tile_scheduler_metadata: recorded for another configuration "
                                         r"\(differs in \['b'\]\)"):
        gq.flash_mla_with_kvcache(q[:1], kv, bt[:1], lens[:1], r, meta)
    assert meta.config == config


def test_sgl_flash_mla_keywords_and_batch_invariance():
    """sgl-flash-mla's surface: ``is_fp8_kvcache=None`` told by the cache, ``use_legacy`` no effect,
    ``get_mla_decoding_metadata`` placeholders assignable onto the metadata, and ``enable_batch_invariant``: a
    sequence's result bit for bit the same alone as inside a batch (every call unsplit), recorded in the metadata."""
    g = gen(8)
    r, dr = DIMS[0]
    D = r + dr
    kv = _cache(g, 40, 16, D, P.dtypes[-1])
    B, s_q, h_q = pick(8, 132), 1, HEADS[0]  # as many sequences as SMs: unsplit by default, alone split
    idx = _rows(g, B, s_q, pick(256, 2048), 40 * 16)  # long enough rows that a batch of one would be split
    q = randn((B, s_q, h_q, D), g, dtype=P.dtypes[-1])
    lens = torch.full((B,), 90, dtype=torch.int32, device=P.device)
    tsm, splits = gq.get_mla_decoding_metadata(lens, s_q * h_q, 1, h_q, False, idx.shape[-1])
    assert tsm.dtype == splits.dtype == torch.int32 and splits.shape == (B + 1,)
    meta, _ = gq.get_mla_metadata()
    meta.tile_scheduler_metadata, meta.num_splits = tsm, splits
    full, full_lse = gq.flash_mla_with_kvcache(q, kv, None, None, r, meta, indices=idx, is_fp8_kvcache=None,
                                               use_legacy=True, enable_batch_invariant=True)
    assert meta.config.enable_batch_invariant and not meta.config.is_fp8_kvcache
    for b in (0, B - 1):
        one_meta, _ = gq.get_mla_metadata()
        one, one_lse = gq.flash_mla_with_kvcache(q[b:b + 1], kv, None, None, r, one_meta, indices=idx[b:b + 1],
                                                 enable_batch_invariant=True)
        assert torch.equal(one[0], full[b]) and torch.equal(one_lse[0], full_lse[b])
    ro, rl = _flashmla_ref(q, [(kv, idx, None)], D**-0.5, r)
    lo, _ = _flashmla_ref(q, [(kv, idx, None)], D**-0.5, r, p_dtype=P.dtypes[-1])
    assert_close("out", full, ro, lo, dtype=P.dtypes[-1])
    with pytest.raises(ValueError, match="recorded for another configuration"):
        gq.flash_mla_with_kvcache(q, kv, None, None, r, meta, indices=idx)  # batch invariance off: another config


@pytest.mark.gpu_only
@settings(max_examples=examples(1, 6))
@given(B=st.integers(1, 3), s_q=st.integers(1, 2), topk=st.sampled_from([64, 200]), seed=seeds())
def test_fp8_sparse_vs_dequantised_cache(B, s_q, topk, seed):
    """FlashMLA's main use: sparse decode over its FP8 cache (656-byte rows), against the float64 reference of the
    dequantised cache (the kernels' bf16 conversion of each value is the low-precision side)."""
    g = gen(seed)
    h_q, D = 128, 576
    kv = _cache(g, 6, 64, D, torch.bfloat16)
    kv8 = gq.quantize_latent_fp8(kv)
    deq = gq.dequantize_latent_fp8(kv8, torch.float64)
    idx = _rows(g, B, s_q, topk, 6 * 64)
    q = randn((B, s_q, h_q, D), g, dtype=torch.bfloat16)
    meta, _ = gq.get_mla_metadata()
    out, lse = gq.flash_mla_with_kvcache(q, kv8, None, None, 512, meta, is_fp8_kvcache=True, indices=idx)
    ro, rl = _flashmla_ref(q, [(deq, idx, None)], D**-0.5, 512)
    # the low-precision side: the kernels' bf16 conversion of each value, for the scores (lse) as for P·V (out)
    lo, ll = _flashmla_ref(q, [(gq.dequantize_latent_fp8(kv8).to(torch.bfloat16), idx, None)], D**-0.5, 512,
                           p_dtype=torch.bfloat16)
    assert_close("out", out, ro, lo, dtype=torch.bfloat16)
    assert_close("lse", lse, rl, ll, dtype=torch.float32, eps=1e-4)


@settings(max_examples=examples(2, 4), deadline=None)
@given(use_extra=st.booleans(), seed=seeds())
def test_extra_cache_and_sink_round_out_once(use_extra, seed):
    """A second key set and a sink are applied to the unrounded output, which is rounded once at the end: out is as
    close to float64 as the exact result rounded once after P's rounding (0.84-0.92 of its error in float16;
    rounding each cache's out and again after the sink measured 1.08-1.43, and FlashMLA's own tests, which hold
    the cosine distance to 5e-6, fail it in bfloat16)."""
    g = gen(seed)
    dtype = P.dtypes[-1]  # the lowest precision the profile runs: float16 on the CPU, bfloat16 on a GPU
    r, dr = DIMS[0]
    D, B, s_q, h_q = r + dr, 2, 2, HEADS[-1]
    kv, kv2 = _cache(g, 6, 16, D, dtype), _cache(g, 4, 32, D, dtype)
    idx, idx2 = _rows(g, B, s_q, 64, 6 * 16), _rows(g, B, s_q, 48, 4 * 32)
    q = randn((B, s_q, h_q, D), g, dtype=dtype)
    sink = randn((h_q,), g).float().to(P.device)
    kw = dict(extra_k_cache=kv2, extra_indices_in_kvcache=idx2) if use_extra else {}
    scopes = [(kv, idx, None)] + ([(kv2, idx2, None)] if use_extra else [])
    meta, _ = gq.get_mla_metadata()
    out, _ = gq.flash_mla_with_kvcache(q, kv, None, None, r, meta, indices=idx, attn_sink=sink, **kw)
    ro, _ = _flashmla_ref(q, scopes, D**-0.5, r, sink)
    lo, _ = _flashmla_ref(q, scopes, D**-0.5, r, sink, p_dtype=dtype)
    once = lo.to(dtype)  # P rounded as the kernel rounds it, then out rounded once
    assert rel_err(out, ro) <= rel_err(once, ro), (rel_err(out, ro), rel_err(once, ro))


@settings(max_examples=examples(3, 6), deadline=None)
@given(B=st.integers(1, 2), s_q=st.integers(1, 2), pages=st.sampled_from([(2, 61), (64, 2), (61, 16)]),
       use_len=st.booleans(), seed=seeds())
def test_model1_fp8_sparse_with_extra_cache(B, s_q, pages, use_len, seed):
    """FlashMLA's MODEL1 FP8 pages (d_qk = d_v = 512) in both caches, each with its own page size, topk lengths and
    a sink: FlashMLA's definition over the dequantised caches."""
    g = gen(seed)
    h_q, D = HEADS[0], 512
    qdt = torch.bfloat16 if P.big else torch.float32  # FP8 caches take bf16 or fp32 q
    (p1, p2) = pages
    kv8 = gq.quantize_latent_fp8(randn((5, p1, 1, D), g, device="cpu"), layout="model1").to(P.device)
    kv28 = gq.quantize_latent_fp8(randn((3, p2, 1, D), g, device="cpu"), layout="model1").to(P.device)
    idx, idx2 = _rows(g, B, s_q, 40, 5 * p1), _rows(g, B, s_q, 24, 3 * p2)
    idx[0, 0] = -1
    length = torch.randint(0, 41, (B,), generator=g).int().to(P.device) if use_len else None
    length2 = torch.randint(0, 25, (B,), generator=g).int().to(P.device) if use_len else None
    sink = (randn((h_q,), g) * 2).float().to(P.device)
    q = randn((B, s_q, h_q, D), g, dtype=qdt)
    meta, _ = gq.get_mla_metadata()
    out, lse = gq.flash_mla_with_kvcache(q, kv8, None, None, D, meta, is_fp8_kvcache=True, indices=idx,
                                         topk_length=length, attn_sink=sink, extra_k_cache=kv28,
                                         extra_indices_in_kvcache=idx2, extra_topk_length=length2)
    deq = [gq.dequantize_latent_fp8(c, torch.float64) for c in (kv8, kv28)]
    scopes = [(deq[0], idx, length), (deq[1], idx2, length2)]
    ro, rl = _flashmla_ref(q, scopes, D**-0.5, D, sink)
    lo_scopes = [(d.to(qdt), i, n) for d, (_, i, n) in zip(deq, scopes, strict=True)]
    lo, ll = _flashmla_ref(q, lo_scopes, D**-0.5, D, sink, p_dtype=qdt)
    assert_close("out", out, ro, lo, dtype=qdt)  # two caches merged, then the sink, then one rounding
    assert_close("lse", lse, rl, ll, dtype=torch.float32, eps=1e-5 if qdt == torch.float32 else 1e-4)


_LAYOUT_CASES = {  # (k_cache layout, extra_k_cache layout or None, FlashMLA keywords)
    "V41 + fp4 extra, named": ("v41", "v41_fp4", dict(kv_format="V41")),
    "V41 + fp4 extra, by width": ("v41", "v41_fp4", {}),
    "V41 + V41 extra": ("v41", "v41", dict(kv_format="V41", use_legacy=True)),
    "V32_NO_ROPE, legacy": ("v32_no_rope", "v32_no_rope", dict(use_legacy=True)),
    "V32_NO_ROPE, named": ("v32_no_rope", None, dict(kv_format="V32_NO_ROPE")),
    "V4, named": ("model1", None, dict(kv_format="V4")),
}


@pytest.mark.parametrize("case", sorted(_LAYOUT_CASES))
@settings(max_examples=examples(1, 4), deadline=None)
@given(B=st.integers(1, 2), s_q=st.integers(1, 2),
       pages=st.sampled_from([(2, 61), (64, 2), (61, 16)]), use_len=st.booleans(), seed=seeds())
def test_v41_and_no_rope_layouts_through_flash_mla(case, B, s_q, pages, use_len, seed):
    """sgl-flash-mla's layouts of d_qk 512: V4.1 FP8 pages with a V4.1 fp4 (or V4.1) extra cache, V3.2 rows
    without rope and V4 pages, told by ``kv_format`` or, for 528 bytes per token, by ``use_legacy`` (V3.2 without
    rope there, V4.1 otherwise): FlashMLA's definition over the dequantised caches."""
    layout, extra_layout, kw = _LAYOUT_CASES[case]
    g = gen(seed)
    h_q, D = HEADS[0], 512
    qdt = torch.bfloat16 if P.big else torch.float32
    (p1, p2) = pages

    def cache(lay, n, page):
        return gq.quantize_latent_fp8(randn((n, page, 1, D), g, device="cpu"), layout=lay).to(P.device)

    kv8 = cache(layout, 5, p1)
    idx = _rows(g, B, s_q, 40, 5 * p1)
    length = torch.randint(0, 41, (B,), generator=g).int().to(P.device) if use_len else None
    sink = (randn((h_q,), g) * 2).float().to(P.device)
    q = randn((B, s_q, h_q, D), g, dtype=qdt)
    scopes = [(gq.dequantize_latent_fp8(kv8, torch.float64, kv_format=layout), idx, length)]
    extra = {}
    if extra_layout is not None:
        kv28 = cache(extra_layout, 3, p2)
        idx2 = _rows(g, B, s_q, 24, 3 * p2)
        length2 = torch.randint(0, 25, (B,), generator=g).int().to(P.device) if use_len else None
        extra = dict(extra_k_cache=kv28, extra_indices_in_kvcache=idx2, extra_topk_length=length2)
        scopes.append((gq.dequantize_latent_fp8(kv28, torch.float64, kv_format=extra_layout), idx2, length2))
    meta, _ = gq.get_mla_metadata()
    out, lse = gq.flash_mla_with_kvcache(q, kv8, None, None, D, meta, is_fp8_kvcache=True, indices=idx,
                                         topk_length=length, attn_sink=sink, **extra, **kw)
    ro, rl = _flashmla_ref(q, scopes, D**-0.5, D, sink)
    lo_scopes = [(d.to(qdt), i, n) for d, i, n in scopes]
    lo, ll = _flashmla_ref(q, lo_scopes, D**-0.5, D, sink, p_dtype=qdt)
    assert_close("out", out, ro, lo, dtype=qdt)  # the extra cache merged before the one rounding of out
    assert_close("lse", lse, rl, ll, dtype=torch.float32, eps=1e-5 if qdt == torch.float32 else 1e-4)


def test_sgl_flash_mla_positional_order():
    """Every argument passed by position in sgl-flash-mla's order (``..., topk_length, extra_topk_length,
    enable_batch_invariant, use_legacy, kv_format``) gives the keyword call's bits."""
    g = gen(4)
    qdt = torch.bfloat16 if P.big else torch.float32
    q = randn((2, 1, 16, 512), g, dtype=qdt)
    kv8 = gq.quantize_latent_fp8(randn((3, 16, 1, 512), g, device="cpu"), layout="v32_no_rope").to(P.device)
    ex8 = gq.quantize_latent_fp8(randn((2, 16, 1, 512), g, device="cpu"), layout="v32_no_rope").to(P.device)
    idx, idx2 = _rows(g, 2, 1, 24, 48), _rows(g, 2, 1, 8, 32)
    length = torch.tensor([5, 24], dtype=torch.int32, device=P.device)
    sink = (randn((16,), g) * 2).float().to(P.device)
    pos = gq.flash_mla_with_kvcache(q, kv8, None, None, 512, gq.get_mla_metadata()[0], None, 0.07, False, True, idx,
                                    sink, ex8, idx2, length, None, False, True, "V32_NO_ROPE")
    kw = gq.flash_mla_with_kvcache(q, kv8, None, None, 512, gq.get_mla_metadata()[0], softmax_scale=0.07,
                                   is_fp8_kvcache=True, indices=idx, attn_sink=sink, extra_k_cache=ex8,
                                   extra_indices_in_kvcache=idx2, topk_length=length, use_legacy=True,
                                   kv_format="V32_NO_ROPE")
    for a, b in zip(pos, kw, strict=True):
        assert torch.equal(a, b)


def test_kv_format_refusals_change_no_state():
    """``kv_format`` takes FlashMLA's names of k_cache's layout, of its width, for a quantised cache only; a refused
    call leaves the metadata unset."""
    g = gen(2)
    q = randn((1, 1, 16, 512), g, dtype=torch.bfloat16 if P.big else torch.float32)
    v41 = gq.quantize_latent_fp8(randn((2, 16, 1, 512), g, device="cpu"), layout="v41").to(P.device)
    idx = _rows(g, 1, 1, 8, 32)
    meta, _ = gq.get_mla_metadata()
    for bad, cache, match in (("v41", v41, "expected None or one of"), ("V4", v41, "'V4' is a layout of 584 bytes"),
                              ("V41", v41.view(torch.uint8)[..., :512].contiguous().float().to(q.dtype),
                               "names the layout of a quantised k_cache"),
                              (41, v41, "expected None or one of")):
        with pytest.raises(TypeError if bad == 41 else ValueError, match=f"^kv_format: {match}"):
            gq.flash_mla_with_kvcache(q, cache, None, None, 512, meta, indices=idx, kv_format=bad)
        assert not meta.have_initialized and meta.config is None
    fp4 = gq.quantize_latent_fp8(randn((2, 16, 1, 512), g, device="cpu"), layout="v41_fp4").to(P.device)
    with pytest.raises(ValueError, match="^extra_k_cache / .*extra_k_cache: a torch.float8_e4m3fn cache holds"):
        gq.flash_mla_with_kvcache(q, v41, None, None, 512, meta, indices=idx, kv_format="V41",
                                  extra_k_cache=fp4[..., :200], extra_indices_in_kvcache=idx)
    assert not meta.have_initialized


@pytest.mark.gpu_only
def test_cuda_graph_replay_equals_eager():
    """Sparse with an extra cache and a sink, and dense: captured once in a CUDA graph (no host sync inside), each
    replay on new query values equals the eager call."""
    from harness import capture_graph

    g = gen(5)
    r, dr = DIMS[0]
    B, s_q, h_q = 2, 2, HEADS[-1]
    kv, kv2 = _cache(g, 5, 64, r + dr, torch.bfloat16), _cache(g, 2, 64, r + dr, torch.bfloat16)
    idx, idx2 = _rows(g, B, s_q, 96, 5 * 64), _rows(g, B, s_q, 32, 2 * 64)
    sink = randn((h_q,), g).float().to(P.device)
    bt = torch.arange(4, dtype=torch.int32, device=P.device).reshape(2, 2)
    lens = torch.tensor([100, 7], dtype=torch.int32, device=P.device)
    q = randn((B, s_q, h_q, r + dr), g, dtype=torch.bfloat16)
    sparse = dict(indices=idx, attn_sink=sink, extra_k_cache=kv2, extra_indices_in_kvcache=idx2)
    for kw, table, lengths in ((sparse, None, None), ({"causal": True}, bt, lens)):
        meta, _ = gq.get_mla_metadata()
        graph, (out, lse) = capture_graph(lambda: gq.flash_mla_with_kvcache(q, kv, table, lengths, r, meta, **kw))
        for seed in (6, 7):
            q.copy_(randn(q.shape, seed, dtype=torch.bfloat16))
            graph.replay()
            ref, ref_lse = gq.flash_mla_with_kvcache(q, kv, table, lengths, r, meta, **kw)
            assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


def test_two_cache_sparse_decode_compiles_fullgraph():
    """FlashMLA's call over a cache and an extra cache under ``torch.compile(fullgraph=True)``: the merge of the two
    caches' results is an op of its own, so the call is one graph and gives the eager result."""
    g_ = torch.Generator().manual_seed(0)
    r, D = 32, 48
    q = torch.randn(2, 1, 2, D, generator=g_).to(P.device)
    kv, kv2 = torch.randn(6, 16, 1, D, generator=g_).to(P.device), torch.randn(3, 16, 1, D, generator=g_).to(P.device)
    idx = torch.randint(-1, 96, (2, 1, 5), generator=g_).int().to(P.device)
    idx2 = torch.randint(-1, 48, (2, 1, 4), generator=g_).int().to(P.device)

    def f(q, kv, idx, kv2, idx2):
        return gq.flash_mla_with_kvcache(q, kv, None, None, r, gq.get_mla_metadata()[0], indices=idx,
                                         extra_k_cache=kv2, extra_indices_in_kvcache=idx2)

    with torch.no_grad():
        want = f(q, kv, idx, kv2, idx2)
        got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, kv, idx, kv2, idx2)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_errors_name_flashmlas_arguments():
    q = torch.randn(1, 1, 2, 48, device=P.device)
    k_cache = torch.randn(2, 16, 1, 48, device=P.device)
    bt = torch.tensor([[0, 1]], dtype=torch.int32, device=P.device)
    sl = torch.tensor([20], dtype=torch.int32, device=P.device)
    for kc, err in ((k_cache.half(), TypeError), (k_cache[..., :40], ValueError),
                    (torch.randn(4, 8, 1, 48, device=P.device), ValueError)):
        with pytest.raises(err, match="^k_cache: "):
            gq.flash_mla_with_kvcache(q, kc, bt, sl, 32, gq.get_mla_metadata()[0])


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a view of a larger tensor (every dim one longer, the last 128 longer), as FlashMLA's test
    scripts pass q, kv and indices."""
    base = torch.zeros([n + (128 if i == t.dim() - 1 else 1) for i, n in enumerate(t.shape)], dtype=t.dtype,
                       device=t.device)
    view = base[tuple(slice(0, n) for n in t.shape)]
    view.copy_(t)
    return view


def test_flashmla_test_scripts_input_forms():
    """The inputs FlashMLA's own test scripts build, which differ from contiguous ones: q, indices and the prefill's
    kv as views with padded strides; V3.2 FP8 pages allocated one token longer (a page stride of (page + 1) · 656
    bytes) beside MODEL1 pages padded to 576 bytes; a sink of ±inf; index values at int32's ends; a dense block table
    holding 2147480000 past each sequence's pages, whose pages, and the rows past each length, are NaN. Each call
    gives the contiguous call's bits (and no NaN reaches a dense result)."""
    g = gen(11)
    B, s_q, h_q = 2, 2, 16
    qdt = torch.bfloat16 if P.big else torch.float32  # FP8 caches take bf16 or fp32 q
    sink = (randn((h_q,), g) * 2).float().to(P.device)
    sink[0], sink[1] = float("inf"), float("-inf")
    # sparse decode: V3.2 FP8 pages of 3 tokens in a buffer of 4-token pages, an extra cache of MODEL1 pages of 5
    v32 = gq.quantize_latent_fp8(randn((4, 3, 1, 576), g, device="cpu", dtype=torch.bfloat16)).to(P.device)
    padded = torch.zeros(4, 4, 656, dtype=v32.dtype, device=P.device)[:, :3]
    padded.copy_(v32[:, :, 0])
    padded = padded.view(4, 3, 1, 656)
    assert padded.stride(0) == 4 * 656
    m1 = gq.quantize_latent_fp8(randn((3, 5, 1, 512), g, device="cpu"), layout="model1").to(P.device)
    q = randn((B, s_q, h_q, 576), g, dtype=qdt)
    idx, idx2 = _rows(g, B, s_q, 16, 12), _rows(g, B, s_q, 8, 15)
    idx[0, 1] = -1  # a query that sees no key
    length = torch.tensor([16, 5], dtype=torch.int32, device=P.device)
    want = gq.flash_mla_with_kvcache(q, v32.contiguous(), None, None, 512, gq.get_mla_metadata()[0], None, 0.1,
                                     False, True, idx, sink, None, None, length)
    got = gq.flash_mla_with_kvcache(_strided(q), padded, None, None, 512, gq.get_mla_metadata()[0], None, 0.1,
                                    False, True, _strided(idx), sink, None, None, length)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert (got[1][0, :, 1] == float("inf")).all() and (got[0][0, 1] == 0).all() and (got[0][:, :, 0] == 0).all()
    q5 = randn((B, s_q, h_q, 512), g, dtype=qdt)
    m1_want = gq.flash_mla_with_kvcache(q5, m1, None, None, 512, gq.get_mla_metadata()[0], None, 0.1, False, True,
                                       idx2, sink)
    m1_got = gq.flash_mla_with_kvcache(_strided(q5), m1, None, None, 512, gq.get_mla_metadata()[0], None, 0.1, False,
                                       True, _strided(idx2), sink)
    assert all(torch.equal(a, b) for a, b in zip(m1_got, m1_want, strict=True))
    # sparse prefill: strided q, kv and indices, entries at int32's ends and just past kv
    dtype = P.dtypes[-1]
    pq, pkv = randn((5, h_q, 576), g, dtype=dtype), randn((9, 1, 576), g, dtype=dtype)
    pidx = torch.randint(0, 9, (5, 1, 12), generator=g).int()
    pidx[..., :4] = torch.tensor([-2**31, -1, 9, 2**31 - 1], dtype=torch.int32)
    pidx[2] = -2**31  # a query that sees no key
    pidx = pidx.to(P.device)
    want = gq.flash_mla_sparse_fwd(pq, pkv, pidx, sm_scale=0.5, attn_sink=sink)
    got = gq.flash_mla_sparse_fwd(_strided(pq), _strided(pkv), _strided(pidx), sm_scale=0.5, attn_sink=sink)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert got[2][2].eq(float("inf")).all() and got[1][2].eq(float("-inf")).all() and (got[0][2] == 0).all()
    # dense: sentinel block-table entries past each sequence's pages, NaN in those pages and past each length
    r, dr = DIMS[0]
    page = 16
    kv = randn((8, page, 2, r + dr), g, dtype=dtype)
    bt = torch.randperm(8, generator=g)[:6].reshape(B, 3).int()
    lens = torch.tensor([20, 3], dtype=torch.int32)
    clean = kv.clone()
    for b in range(B):
        used = -(-int(lens[b]) // page)
        kv[bt[b, used:].long()] = float("nan")
        kv[bt[b, used - 1].long(), int(lens[b]) - (used - 1) * page:] = float("nan")
        bt[b, used:] = 2147480000
    bt, lens = bt.to(P.device), lens.to(P.device)
    qd = randn((B, s_q, 4, r + dr), g, dtype=dtype)
    got = gq.flash_mla_with_kvcache(qd, kv, bt, lens, r, gq.get_mla_metadata()[0], None, causal=True)
    want = gq.flash_mla_with_kvcache(qd, clean, bt, lens, r, gq.get_mla_metadata()[0], None, causal=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert got[0].isfinite().all() and got[1].isfinite().all()
