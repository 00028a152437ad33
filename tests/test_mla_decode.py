"""mla_decode (absorb path, dense + sparse) against the float64 reference in ops/mla/reference.py."""

import math

import pytest
import torch
from harness import (
    SM90_SHARED,
    P,
    assert_close,
    capture_graph,
    compile_in_child,
    compile_sm90_in_child,
    dtypes,
    examples,
    gen,
    pick,
    randn,
    rel_err,
    seeds,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gqla_triton.ops._common import sparse_rows
from gqla_triton.ops.mla import (
    dequantize_latent_fp8,
    mla_decode,
    mla_decode_ref,
    mla_sparse_prefill,
    quantize_latent_fp8,
)

# every buffer the launchers allocate starts NaN-filled: an element a kernel does not write fails the comparison
pytestmark = pytest.mark.usefixtures("poison_buffers")
# the config_override fixture holds no per-example state: hypothesis tests may take it
FIXTURE_OK = settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                             HealthCheck.data_too_large])

DIMS = pick([(32, 16), (64, 16)], [(512, 64), (256, 64)])  # (latent r = head_dim_v, rope d_R)
HEADS = pick([16, 48], [16, 32, 64, 128])
PAGES = pick([16, 32], [16, 64])
SPARSE_PAGES = PAGES + [1, 2, 61]  # sparse rows take any page size (FlashMLA's sparse caches use 2 or 61)
MAXLEN = pick(70, 1100)


def _case(seed, B, s_q, h_q, r, dr, page_size, dtype, *, zero_len=True, extra_pages=3, bad_pages=False):
    """Random q, a cache whose pages are randomly permuted, block table, lengths (incl. 0 / non-multiples)."""
    g = gen(seed)
    D = r + dr
    lens = torch.randint(0, MAXLEN + 1, (B,), generator=g)
    if zero_len and B > 1:
        lens[int(torch.randint(0, B, (1,), generator=g))] = 0
    max_pages = max(1, math.ceil(int(lens.max()) / page_size) + int(torch.randint(0, 2, (1,), generator=g)))
    num_pages = B * max_pages + extra_pages
    block_table = torch.randperm(num_pages, generator=g)[: B * max_pages].reshape(B, max_pages).int()
    if bad_pages:  # entries no kernel may follow: they mark ignored keys
        mask = torch.rand(B, max_pages, generator=g) < 0.2
        junk = torch.tensor([-1, num_pages, 2**31 - 1, -(2**31)], dtype=torch.int32)
        pick_ = junk[torch.randint(0, 4, (B, max_pages), generator=g)]
        block_table = torch.where(mask, pick_, block_table)
    q = randn((B, s_q, h_q, D), g, dtype=dtype, scale=1.0)
    kv = randn((num_pages, page_size, 1, D), g, dtype=dtype)
    return q, kv, block_table.to(P.device), lens.int().to(P.device), g


def _check(out, lse, q, kv, bt, lens, r, causal, dtype, indices=None, topk_length=None, scale=None):
    ro, rl = mla_decode_ref(q, kv, bt, lens, head_dim_v=r, softmax_scale=scale, causal=causal, indices=indices,
                            topk_length=topk_length)
    lo, _ = mla_decode_ref(q, kv, bt, lens, head_dim_v=r, softmax_scale=scale, causal=causal, indices=indices,
                           topk_length=topk_length, p_dtype=dtype)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert_close("out", out, ro, lo, dtype=dtype)
    assert_close("lse", lse, rl, rl.float(), dtype=torch.float32, eps=1e-5 if dtype == torch.float32 else 1e-4)
    return ro, rl


@given(B=st.integers(1, 3), s_q=st.integers(1, 3), h_q=st.sampled_from(HEADS), dims=st.sampled_from(DIMS),
       page_size=st.sampled_from(PAGES), causal=st.booleans(), num_splits=st.sampled_from([0, 1, 2, 3, 7]),
       bad_pages=st.booleans(), dtype=dtypes(), seed=seeds())
def test_dense_vs_reference(B, s_q, h_q, dims, page_size, causal, num_splits, bad_pages, dtype, seed):
    r, dr = dims
    q, kv, bt, lens, _ = _case(seed, B, s_q, h_q, r, dr, page_size, dtype, bad_pages=bad_pages)
    out, lse = mla_decode(q, kv, bt, lens, head_dim_v=r, causal=causal, num_splits=num_splits)
    _check(out, lse, q, kv, bt, lens, r, causal, dtype)


@given(B=st.integers(1, 3), s_q=st.integers(1, 3), dims=st.sampled_from(DIMS), page_size=st.sampled_from(PAGES),
       num_splits=st.sampled_from([2, 3, 5]), dtype=dtypes(), seed=seeds())
def test_paging_and_split_invariance(B, s_q, dims, page_size, num_splits, dtype, seed):
    r, dr = dims
    h_q = HEADS[0]
    q, kv, bt, lens, g = _case(seed, B, s_q, h_q, r, dr, page_size, dtype, zero_len=False)
    out1, lse1 = mla_decode(q, kv, bt, lens, head_dim_v=r, num_splits=1)
    # the same logical cache under another page permutation gives bit-identical results
    perm = torch.randperm(kv.shape[0], generator=g)
    kv2 = torch.empty_like(kv)
    kv2[perm.to(kv.device)] = kv
    bt2 = perm.to(bt.device)[bt.long()].int()
    out2, lse2 = mla_decode(q, kv2, bt2, lens, head_dim_v=r, num_splits=1)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    # any split count computes the same function
    outs, lses = mla_decode(q, kv, bt, lens, head_dim_v=r, num_splits=num_splits)
    ro, rl = _check(outs, lses, q, kv, bt, lens, r, True, dtype)
    e1 = rel_err(out1, ro)
    assert rel_err(outs, out1.double()) <= 2 * e1 + 2e-3 * (dtype != torch.float32) + 1e-6


@pytest.mark.parametrize("impl", ["auto", "triton"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_bitwise_repeatable_under_load(impl, sparse):
    """Thousands of programs in flight (on the GPU 64 sequences of up to 1100 keys, 128 heads, the planned splits;
    on Hopper ``auto`` is the Gluon kernel): a race inside a pipelined loop shows when memory is busy (GDN's
    pipelined wy_bwd did on sm_90 with hundreds of programs, never with a few), so every call returns the same
    bits, and the reference's answer."""
    dt = P.dtypes[0]
    r, dr = DIMS[0]
    B, h_q = pick(3, 64), HEADS[-1]
    q, kv, bt, lens, g = _case(7, B, 1, h_q, r, dr, PAGES[-1], dt)
    idx = torch.randint(-2, MAXLEN, (B, 1, pick(32, 512)), generator=g).int().to(P.device) if sparse else None
    first = mla_decode(q, kv, bt, lens, head_dim_v=r, indices=idx, impl=impl)
    for _ in range(3):
        again = mla_decode(q, kv, bt, lens, head_dim_v=r, indices=idx, impl=impl)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    _check(*first, q, kv, bt, lens, r, True, dt, indices=idx)


@given(s_q=st.integers(1, 4), seed=seeds())
def test_empty_and_negative_positions(s_q, seed):
    """cache_seqlens 0 -> out 0 / lse -inf; with causal, queries at negative positions see nothing."""
    r, dr = DIMS[0]
    h_q = HEADS[0]
    q, kv, bt, _, _ = _case(seed, 3, s_q, h_q, r, dr, PAGES[0], torch.float32)
    lens = torch.tensor([0, 1, 2], dtype=torch.int32, device=P.device)
    out, lse = mla_decode(q, kv, bt, lens, head_dim_v=r, num_splits=2)
    _check(out, lse, q, kv, bt, lens, r, True, torch.float32)
    assert torch.equal(out[0].cpu(), torch.zeros(s_q, h_q, r)) and torch.isneginf(lse[0]).all()
    for b, n in ((1, 1), (2, 2)):
        for j in range(s_q):
            seen = n - s_q + j >= 0
            assert bool(torch.isfinite(lse[b, :, j]).all()) == seen
            if not seen:
                assert not out[b, j].any()


# launch variants selectable through the config table (bench.mla --sweep times them on the GPU); each must compute
# the same function. The interpreter's tile sizes come from interpreter.json plus these fields; every flag the
# override does not name is off (the base below), so each flag runs both ways.
VARIANTS = [
    {},
    {"paged_tiles": True},
    {"paged_tiles": True, "block_n": 32},  # block_n > page 16: the per-token path there
    {"block_h": 16, "block_n": 16, "num_stages": 1},  # the fp32 entries' small tiles, here in bf16 / fp16
    # P and alpha through a double-buffered global scratch tile (the H200 table's dense entry)
    {"p_scratch": True},
    {"p_scratch": True, "paged_tiles": True, "block_h": 64, "block_n": pick(32, 64), "num_stages": 2},
    # the next tile's row indices (sparse) or block-table entry (dense, paged tiles) loaded one iteration ahead
    # (with p_scratch and paged_tiles: the H200 table's sparse entry)
    {"p_scratch": True, "paged_tiles": True, "block_h": 64, "block_n": pick(32, 64), "num_stages": 2,
     "rows_ahead": True},
    # 32-key tiles on 4 stages: with rows_ahead the sm_90 pipeliner keeps a whole tile in flight
    {"p_scratch": True, "paged_tiles": True, "block_h": 64, "block_n": 32, "num_stages": 4, "rows_ahead": True},
    {"rows_ahead": True},
    {"paged_tiles": True, "rows_ahead": True},
]
FLAGS_OFF = {"paged_tiles": False, "p_scratch": False, "rows_ahead": False}


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={v[k]}" for k in v) or "plain")
@FIXTURE_OK
@given(B=st.integers(1, 2), s_q=st.integers(1, 3), page_size=st.sampled_from(PAGES), causal=st.booleans(),
       sparse=st.booleans(), num_splits=st.sampled_from([0, 1, 3]), bad_pages=st.booleans(), dtype=dtypes(),
       seed=seeds())
def test_variants_vs_reference(config_override, variant, B, s_q, page_size, causal, sparse, num_splits, bad_pages,
                               dtype, seed):
    r, dr = DIMS[0]
    h_q = HEADS[0]
    q, kv, bt, lens, g = _case(seed, B, s_q, h_q, r, dr, page_size, dtype, bad_pages=bad_pages)
    idx = _adversarial_indices(g, B, s_q, pick(24, 256), lens).to(P.device) if sparse else None
    with config_override({"mla_decode": {**FLAGS_OFF, **variant}}):
        out, lse = mla_decode(q, kv, bt, lens, head_dim_v=r, causal=causal, indices=idx, num_splits=num_splits,
                              impl="triton")
    _check(out, lse, q, kv, bt, lens, r, causal, dtype, indices=idx)


# ---------------------------------------------------------------- sparse


def _adversarial_indices(g, B, s_q, topk, lens, *, dup=True):
    """Valid positions mixed with -1, huge, negative, >= seqlen and (optionally) duplicated entries."""
    L = int(lens.max()) + 1
    idx = torch.randint(0, max(L, 1), (B, s_q, topk), generator=g)
    kind = torch.randint(0, 10, (B, s_q, topk), generator=g)
    junk = torch.tensor([-1, -2, 2**31 - 1, -(2**31), 10**6], dtype=torch.int64)
    idx = torch.where(kind == 0, junk[torch.randint(0, 5, (B, s_q, topk), generator=g)], idx)
    idx = torch.where(kind == 1, lens.cpu().long()[:, None, None] + torch.randint(0, 40, (B, s_q, topk), generator=g),
                      idx)
    if dup and topk > 1:  # copy some entries onto others
        src = torch.randint(0, topk, (B, s_q, topk), generator=g)
        idx = torch.where(kind == 2, torch.gather(idx, 2, src), idx)
    return idx.int()


@given(B=st.integers(1, 3), s_q=st.integers(1, 3), groups=st.sampled_from([0, 1, 3]), page_size=st.sampled_from(PAGES),
       topk=st.sampled_from([1, 16, 40, 1500]), causal=st.booleans(), with_len=st.booleans(), seed=seeds())
def test_sparse_rows_translation(B, s_q, groups, page_size, topk, causal, with_len, seed):
    """sparse_rows: the physical cache row of every index entry that counts, -1 for every other one (shared
    [B, s_q, topk] and per-group [B, s_q, g, topk] index sets)."""
    _, kv, bt, lens, g = _case(seed, B, s_q, 1, 16, 16, page_size, torch.float32, bad_pages=True)
    idx = _adversarial_indices(g, B, s_q * max(groups, 1), topk, lens)
    idx = idx.reshape(B, s_q, groups, topk) if groups else idx
    tkl = torch.randint(-2, topk + 3, (B,), generator=g).int() if with_len else None
    rows = sparse_rows(idx.to(P.device), bt, lens, None if tkl is None else tkl.to(P.device), page_size=page_size,
                       num_pages=kv.shape[0], causal=causal)
    assert rows.dtype == torch.int32 and rows.shape == idx.shape
    rows = rows.cpu().long()
    bt_, lens_ = bt.cpu().long(), lens.cpu().long()
    shape = (B, s_q, 1, topk) if groups == 0 else idx.shape
    pos = idx.long().reshape(shape)
    n_valid = torch.full((B,), topk) if tkl is None else tkl.long().clamp(0, topk)
    qi = torch.arange(s_q).reshape(1, s_q, 1, 1)
    last = lens_.reshape(B, 1, 1, 1) - 1 + (qi + 1 - s_q if causal else 0)
    ok = ((torch.arange(topk) < n_valid.reshape(B, 1, 1, 1)) & (pos >= 0) & (pos < lens_.reshape(B, 1, 1, 1))
          & (pos <= last))
    page = torch.where(ok, pos // page_size, 0)
    ok &= page < bt_.shape[1]
    blk = torch.gather(bt_, 1, page.clamp(max=bt_.shape[1] - 1).reshape(B, -1)).reshape(page.shape)
    ok &= (blk >= 0) & (blk < kv.shape[0])
    want = torch.where(ok, blk * page_size + pos % page_size, -1).reshape(rows.shape)
    assert torch.equal(rows, want)


@given(B=st.integers(1, 3), s_q=st.integers(1, 3), h_q=st.sampled_from(HEADS), dims=st.sampled_from(DIMS),
       page_size=st.sampled_from(SPARSE_PAGES), topk=st.sampled_from(pick([1, 16, 40], [64, 2048])),
       causal=st.booleans(), with_len=st.booleans(), num_splits=st.sampled_from([0, 1, 3]), dtype=dtypes(),
       seed=seeds())
def test_sparse_vs_reference(B, s_q, h_q, dims, page_size, topk, causal, with_len, num_splits, dtype, seed):
    r, dr = dims
    q, kv, bt, lens, g = _case(seed, B, s_q, h_q, r, dr, page_size, dtype, bad_pages=True)
    idx = _adversarial_indices(g, B, s_q, topk, lens).to(P.device)
    tl_ = torch.randint(-2, topk + 3, (B,), generator=g).int().to(P.device) if with_len else None
    out, lse = mla_decode(q, kv, bt, lens, head_dim_v=r, causal=causal, indices=idx, topk_length=tl_,
                          num_splits=num_splits)
    _check(out, lse, q, kv, bt, lens, r, causal, dtype, indices=idx, topk_length=tl_)


@pytest.mark.parametrize("page_size", [1, 2, 61])
def test_sparse_any_page_size(page_size):
    """Sparse rows are addressed one by one: pages of any size (FlashMLA's sparse caches use 2 or 61 tokens), on
    every kernel ``impl="auto"`` picks; a dense call on such pages is refused by name."""
    r, dr = DIMS[0]
    dtype = P.dtypes[-1]
    q, kv, bt, lens, g = _case(17, 2, 2, HEADS[0], r, dr, page_size, dtype, bad_pages=True)
    idx = _adversarial_indices(g, 2, 2, pick(40, 2048), lens).to(P.device)
    tl_ = torch.tensor([pick(30, 1500), 0], dtype=torch.int32, device=P.device)
    for num_splits in (0, 3):
        out, lse = mla_decode(q, kv, bt, lens, head_dim_v=r, indices=idx, topk_length=tl_, num_splits=num_splits)
        _check(out, lse, q, kv, bt, lens, r, True, dtype, indices=idx, topk_length=tl_)
    with pytest.raises(ValueError, match=r"page_size \(dim 1\) must be a positive multiple of 16"):
        mla_decode(q, kv, bt, lens, head_dim_v=r)


@given(s_q=st.integers(1, 3), num_splits=st.sampled_from([2, 3, 5]), causal=st.booleans(), seed=seeds())
def test_sparse_split_invariance(s_q, num_splits, causal, seed):
    """Every split count covers each index entry exactly once (no entry dropped or counted twice)."""
    r, dr = DIMS[0]
    h_q, B, topk = HEADS[0], 2, pick(40, 2048)
    q, kv, bt, lens, g = _case(seed, B, s_q, h_q, r, dr, PAGES[0], torch.float32, zero_len=False)
    idx = _adversarial_indices(g, B, s_q, topk, lens).to(P.device)
    tl_ = torch.tensor([topk, topk - 7], dtype=torch.int32, device=P.device)
    out, lse = mla_decode(q, kv, bt, lens, head_dim_v=r, causal=causal, indices=idx, topk_length=tl_,
                          num_splits=num_splits)
    _check(out, lse, q, kv, bt, lens, r, causal, torch.float32, indices=idx, topk_length=tl_)


@given(B=st.integers(1, 2), s_q=st.integers(1, 3), causal=st.booleans(), pad=st.integers(0, 9), dtype=dtypes(),
       seed=seeds())
def test_sparse_all_positions_equals_dense(B, s_q, causal, pad, dtype, seed):
    r, dr = DIMS[0]
    h_q = HEADS[0]
    q, kv, bt, lens, g = _case(seed, B, s_q, h_q, r, dr, PAGES[0], dtype)
    L = int(lens.max())
    topk = L + pad
    idx = torch.full((B, s_q, topk), -1, dtype=torch.int32)
    for b in range(B):
        n = int(lens[b])
        for j in range(s_q):
            idx[b, j, :n] = torch.randperm(n, generator=g).int()  # any order
            idx[b, j] = idx[b, j][torch.randperm(topk, generator=g)]
    if topk == 0:
        return  # every sequence empty and no padding: nothing to select (indices need topk >= 1)
    idx = idx.to(P.device)
    out_s, lse_s = mla_decode(q, kv, bt, lens, head_dim_v=r, causal=causal, indices=idx)
    out_d, lse_d = mla_decode(q, kv, bt, lens, head_dim_v=r, causal=causal)
    ro, rl = _check(out_s, lse_s, q, kv, bt, lens, r, causal, dtype, indices=idx)
    ro_d, rl_d = mla_decode_ref(q, kv, bt, lens, head_dim_v=r, causal=causal)
    assert rel_err(ro, ro_d) < 1e-12 and rel_err(rl, rl_d) < 1e-12
    assert_close("sparse vs dense", out_s, out_d.double(), ro.to(dtype), dtype=dtype, factor=4.0)


@given(B=st.integers(1, 2), topk=st.integers(1, pick(40, 700)), dims=st.sampled_from(DIMS), dtype=dtypes(),
       seed=seeds())
def test_sparse_equals_dense_over_gathered_subset(B, topk, dims, dtype, seed):
    """Gathering the selected rows (duplicates included) into a fresh cache and attending densely is the
    definition of sparse attention: a duplicated index counts once per occurrence."""
    r, dr = dims
    h_q, ps = HEADS[0], PAGES[0]
    q, kv, bt, lens, g = _case(seed, B, 1, h_q, r, dr, ps, dtype, zero_len=False)
    lens = lens.clamp(min=1)
    idx = torch.stack([torch.randint(0, int(n), (1, topk), generator=g) for n in lens.cpu()]).int()  # dups likely
    # fresh contiguous cache holding the selected rows in order, one page run per sequence
    from gqla_triton.ops._common import gather_pages

    full = gather_pages(kv, bt, int(lens.max()))  # [B, L, 1, D]
    sel = torch.stack([full[b, idx[b, 0].long().to(full.device)] for b in range(B)])  # [B, topk, 1, D]
    npg = math.ceil(topk / ps)
    sub = torch.zeros(B * npg * ps, 1, r + dr, dtype=dtype, device=P.device)
    for b in range(B):
        sub[b * npg * ps: b * npg * ps + topk] = sel[b]
    sub = sub.reshape(B * npg, ps, 1, r + dr)
    bt_sub = torch.arange(B * npg, dtype=torch.int32, device=P.device).reshape(B, npg)
    out_d, lse_d = mla_decode(q, sub, bt_sub, torch.full((B,), topk, dtype=torch.int32, device=P.device),
                              head_dim_v=r, causal=False)
    out_s, lse_s = mla_decode(q, kv, bt, lens, head_dim_v=r, causal=False, indices=idx.to(P.device))
    ro, rl = _check(out_s, lse_s, q, kv, bt, lens, r, False, dtype, indices=idx.to(P.device))
    assert_close("gathered dense", out_d, ro, ro.to(dtype), dtype=dtype, factor=4.0)
    assert_close("gathered lse", lse_d, rl, rl.float(), dtype=torch.float32, eps=1e-4)


@given(s_q=st.integers(1, 3), mode=st.sampled_from(["neg", "len0", "oob", "future"]), seed=seeds())
def test_sparse_empty_rows(s_q, mode, seed):
    r, dr = DIMS[0]
    h_q = HEADS[0]
    B = 2
    q, kv, bt, lens, g = _case(seed, B, s_q, h_q, r, dr, PAGES[0], torch.float32, zero_len=False)
    lens = lens.clamp(min=s_q + 1)
    topk = 8
    tl_ = None
    if mode == "neg":
        idx = -torch.randint(1, 2**31 - 1, (B, s_q, topk), generator=g)
    elif mode == "len0":
        idx = torch.randint(0, int(lens.min()), (B, s_q, topk), generator=g)
        tl_ = torch.tensor([0, -5], dtype=torch.int32, device=P.device)
    elif mode == "oob":
        idx = lens.cpu().long()[:, None, None] + torch.randint(0, 2**30, (B, s_q, topk), generator=g)
    else:  # every entry after the query's own position (causal)
        idx = (lens.cpu().long() - s_q)[:, None, None] + torch.arange(s_q)[None, :, None] + 1
        idx = idx.expand(B, s_q, topk).clamp(max=lens.min().item() - 1)
        idx = torch.where(idx <= (lens.cpu().long() - s_q)[:, None, None] + torch.arange(s_q)[None, :, None],
                          torch.full_like(idx, -1), idx)
    idx = idx.int().to(P.device)
    out, lse = mla_decode(q, kv, bt, lens.to(P.device), head_dim_v=r, indices=idx, topk_length=tl_, num_splits=2)
    assert torch.equal(out.cpu(), torch.zeros(B, s_q, h_q, r)) and torch.isneginf(lse).all()


# ---------------------------------------------------------------- errors


def test_bad_inputs():
    r, dr = DIMS[0]
    D = r + dr
    dev = P.device
    q = torch.zeros(1, 1, 16, D, device=dev)
    kv = torch.zeros(4, 16, 1, D, device=dev)
    bt = torch.zeros(1, 2, dtype=torch.int32, device=dev)
    lens = torch.ones(1, dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match="kv_cache"):
        mla_decode(q, torch.zeros(4, 16, 1, D + 1, device=dev), bt, lens, head_dim_v=r)
    with pytest.raises(ValueError, match="kv_cache"):
        mla_decode(q, torch.zeros(4, 16, 2, D, device=dev), bt, lens, head_dim_v=r)
    with pytest.raises(ValueError, match="page_size"):
        mla_decode(q, torch.zeros(4, 24, 1, D, device=dev), bt, lens, head_dim_v=r)
    with pytest.raises(TypeError, match="kv_cache"):
        mla_decode(q, kv.half(), bt, lens, head_dim_v=r)
    with pytest.raises(TypeError, match="block_table"):
        mla_decode(q, kv, bt.long(), lens, head_dim_v=r)
    with pytest.raises(ValueError, match="block_table"):
        mla_decode(q, kv, torch.zeros(2, 2, dtype=torch.int32, device=dev), lens, head_dim_v=r)
    with pytest.raises(ValueError, match="cache_seqlens"):
        mla_decode(q, kv, bt, torch.ones(2, dtype=torch.int32, device=dev), head_dim_v=r)
    with pytest.raises(ValueError, match="head_dim_v"):
        mla_decode(q, kv, bt, lens, head_dim_v=D + 1)
    with pytest.raises(ValueError, match="num_splits"):
        mla_decode(q, kv, bt, lens, head_dim_v=r, num_splits=-1)
    with pytest.raises(TypeError, match="num_splits"):
        mla_decode(q, kv, bt, lens, head_dim_v=r, num_splits=True)
    with pytest.raises(TypeError, match="num_splits"):
        mla_decode(q, kv, bt, lens, head_dim_v=r, num_splits=2.0)
    with pytest.raises(TypeError, match="softmax_scale"):
        mla_decode(q, kv, bt, lens, head_dim_v=r, softmax_scale="x")
    with pytest.raises(ValueError, match="softmax_scale"):
        mla_decode(q, kv, bt, lens, head_dim_v=r, softmax_scale=float("nan"))
    with pytest.raises(ValueError, match="q"):
        mla_decode(q[0], kv, bt, lens, head_dim_v=r)
    with pytest.raises(ValueError, match="indices"):
        mla_decode(q, kv, bt, lens, head_dim_v=r, indices=torch.zeros(1, 1, 2, 4, dtype=torch.int32, device=dev))
    with pytest.raises(TypeError, match="indices"):
        mla_decode(q, kv, bt, lens, head_dim_v=r, indices=torch.zeros(1, 1, 4, dtype=torch.int64, device=dev))
    with pytest.raises(ValueError, match="topk_length"):
        mla_decode(q, kv, bt, lens, head_dim_v=r, topk_length=torch.ones(1, dtype=torch.int32, device=dev))
    for bad in ("cuda", "", None):
        with pytest.raises(TypeError if bad is None else ValueError, match="impl"):
            mla_decode(q, kv, bt, lens, head_dim_v=r, impl=bad)
    if dev == "cpu":  # no Gluon kernel under the interpreter: asked for, it is refused by name
        with pytest.raises(ValueError, match="impl='gluon'"):
            mla_decode(q, kv, bt, lens, head_dim_v=r, impl="gluon")
    elif torch.cuda.get_device_capability()[0] == 9:  # inputs the Gluon kernel does not take: fp32, other widths
        with pytest.raises(ValueError, match="impl='gluon'.*float32"):
            mla_decode(q, kv, bt, lens, head_dim_v=r, impl="gluon")
        with pytest.raises(ValueError, match="impl='gluon'.*head_dim_v 256"):
            mla_decode(q.half(), kv.half(), bt, lens, head_dim_v=256, impl="gluon")
    if dev == "cpu":
        import gqla_triton.ops._common.validation as v

        old = v.is_interpreter
        v.is_interpreter = lambda: False
        try:
            with pytest.raises(RuntimeError, match="mla_decode_ref"):
                mla_decode(q, kv, bt, lens, head_dim_v=r)
        finally:
            v.is_interpreter = old
        # the interpreter computes bfloat16 wrongly: refused there, by name (the reference takes it)
        with pytest.raises(TypeError, match="bfloat16"):
            mla_decode(q.bfloat16(), kv.bfloat16(), bt, lens, head_dim_v=r)
        with pytest.raises(TypeError, match="bfloat16"):
            mla_decode(q.bfloat16(), kv.bfloat16(), bt, lens, head_dim_v=r, impl="triton")
        out, lse = mla_decode(q.bfloat16(), kv.bfloat16(), bt, lens, head_dim_v=r, impl="reference")
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


@settings(max_examples=examples(3, 6))
@given(B=st.integers(1, 3), s_q=st.integers(1, 3), sparse=st.booleans(), num_splits=st.sampled_from([0, 2]),
       dtype=dtypes(), seed=seeds())
def test_reference_impl_equals_triton(B, s_q, sparse, num_splits, dtype, seed):
    """``impl="reference"`` is the float64 reference in the kernel's output dtypes, shapes and device;
    ``impl="triton"`` computes the same function (data-derived tolerance); the custom op (torch.compile's route)
    gives the eager call's bits."""
    r, dr = DIMS[0]
    h_q = HEADS[0]
    q, kv, bt, lens, g = _case(seed, B, s_q, h_q, r, dr, PAGES[0], dtype, bad_pages=True)
    idx = _adversarial_indices(g, B, s_q, pick(24, 256), lens).to(P.device) if sparse else None
    o_ref, l_ref = mla_decode(q, kv, bt, lens, head_dim_v=r, indices=idx, num_splits=num_splits, impl="reference")
    o_tri, l_tri = mla_decode(q, kv, bt, lens, head_dim_v=r, indices=idx, num_splits=num_splits, impl="triton")
    for a, b in ((o_ref, o_tri), (l_ref, l_tri)):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
    ro, rl = _check(o_tri, l_tri, q, kv, bt, lens, r, True, dtype, indices=idx)
    assert torch.equal(o_ref.cpu(), ro.to(dtype)) and torch.equal(l_ref.cpu(), rl.float())
    o_op, l_op = torch.ops.gqla_triton.mla_decode(q, kv, bt, lens, r, (r + dr) ** -0.5, True, idx, None, num_splits,
                                                  "triton")
    assert torch.equal(o_op, o_tri) and torch.equal(l_op, l_tri)



@settings(max_examples=examples(3, 6))
@given(B=st.integers(1, 3), s_q=st.integers(1, 3), sparse=st.booleans(), num_splits=st.sampled_from([0, 1, 3]),
       impl=st.sampled_from(["auto", "triton"]), dtype=dtypes(), seed=seeds())
def test_float32_out_is_the_output_before_its_rounding(B, s_q, sparse, num_splits, impl, dtype, seed):
    """``out_dtype=torch.float32`` returns out as the kernel holds it before rounding to q's dtype (the default
    output is exactly its rounding) with the same lse, for mla_decode (any split count, the Gluon kernel on Hopper)
    and mla_sparse_prefill; anything but None, q's dtype or float32 is refused by name."""
    r, dr = DIMS[0]
    q, kv, bt, lens, g = _case(seed, B, s_q, HEADS[-1], r, dr, PAGES[-1], dtype)
    idx = _adversarial_indices(g, B, s_q, pick(24, 256), lens).to(P.device) if sparse else None
    kw = dict(head_dim_v=r, indices=idx, num_splits=num_splits, impl=impl)
    o, lse = mla_decode(q, kv, bt, lens, **kw)
    o32, lse32 = mla_decode(q, kv, bt, lens, **kw, out_dtype=torch.float32)
    assert o32.dtype == torch.float32 and torch.equal(o32.to(dtype), o) and torch.equal(lse32, lse)
    assert torch.equal(mla_decode(q, kv, bt, lens, **kw, out_dtype=dtype)[0], o)
    rows = kv.reshape(-1, 1, r + dr)
    pidx = torch.randint(-1, rows.shape[0] + 1, (B * s_q, 1, 24), generator=g).int().to(P.device)
    p = mla_sparse_prefill(q.reshape(B * s_q, -1, r + dr), rows, pidx, r, impl="triton")
    p32 = mla_sparse_prefill(q.reshape(B * s_q, -1, r + dr), rows, pidx, r, impl="triton", out_dtype=torch.float32)
    assert p32.out.dtype == torch.float32 and torch.equal(p32.out.to(dtype), p.out) and torch.equal(p32.lse, p.lse)
    other = torch.bfloat16 if dtype != torch.bfloat16 else torch.float16
    for bad, err in ((other, ValueError), (torch.float64, ValueError), ("float32", TypeError), (32, TypeError)):
        with pytest.raises(err, match="^out_dtype: "):
            mla_decode(q, kv, bt, lens, **kw, out_dtype=bad)
        with pytest.raises(err, match="^out_dtype: "):
            mla_sparse_prefill(q.reshape(B * s_q, -1, r + dr), rows, pidx, r, out_dtype=bad)
    with pytest.raises(ValueError, match="^out_dtype: expected None or torch.float64"):  # float32 would round it
        mla_decode(q.double(), kv.double(), bt, lens, head_dim_v=r, impl="reference", out_dtype=torch.float32)


# ---------------------------------------------------------------- GPU only


@pytest.mark.gpu_only
@pytest.mark.parametrize("sparse", [False, True])
def test_cuda_graph_replay(sparse):
    r, dr = 512, 64
    B, s_q, h_q = 4, 2, 128
    q, kv, bt, lens, g = _case(7, B, s_q, h_q, r, dr, 64, torch.bfloat16)
    idx = _adversarial_indices(g, B, s_q, 256, lens).cuda() if sparse else None
    static_q = q.clone()
    fn = lambda: mla_decode(static_q, kv, bt, lens, head_dim_v=r, indices=idx)  # noqa: E731
    graph, (out, lse) = capture_graph(fn)
    for seed in (1, 2):  # new values through the same graph
        static_q.copy_(randn(q.shape, seed, dtype=q.dtype))
        lens.copy_(torch.randint(0, MAXLEN, (B,), generator=gen(seed)).int().cuda())
        graph.replay()
        torch.cuda.synchronize()
        _check(out, lse, static_q, kv, bt, lens, r, True, torch.bfloat16, indices=idx)


@pytest.mark.gpu_only
def test_torch_compile_fullgraph():
    r, dr = 512, 64
    q, kv, bt, lens, g = _case(3, 2, 1, 64, r, dr, 64, torch.bfloat16)
    idx = _adversarial_indices(g, 2, 1, 128, lens).cuda()

    def f(q, kv, bt, lens, idx):
        o, l = mla_decode(q, kv, bt, lens, head_dim_v=r)
        o2, l2 = mla_decode(q, kv, bt, lens, head_dim_v=r, indices=idx)
        return o * 2, l, o2, l2

    cf = torch.compile(f, fullgraph=True)
    o, l, o2, l2 = cf(q, kv, bt, lens, idx)
    _check(o / 2, l, q, kv, bt, lens, r, True, torch.bfloat16)
    _check(o2, l2, q, kv, bt, lens, r, True, torch.bfloat16, indices=idx)


# ---------------------------------------------------------------- the warp-specialised Gluon kernel (Hopper)

GLUON_VARIANTS = [{"block_h": 64, "block_n": 64, "num_stages": 2}, {"block_h": 32, "block_n": 64, "num_stages": 2},
                  {"block_h": 64, "block_n": 64, "num_stages": 2, "owner_scores": False},
                  {"block_h": 64, "block_n": 64, "num_stages": 2, "owner_scores": True}]


@pytest.mark.gpu_only
@pytest.mark.parametrize("variant", GLUON_VARIANTS, ids=["h64", "h32", "h64_split_scores", "h64_owner_scores"])
@FIXTURE_OK
@given(B=st.integers(1, 3), s_q=st.integers(1, 3), h_q=st.sampled_from([16, 64, 128]), page_size=st.sampled_from(
       [16, 48, 64]), causal=st.booleans(), sparse=st.booleans(), num_splits=st.sampled_from([0, 1, 3]),
       bad_pages=st.booleans(), dtype=st.sampled_from([torch.bfloat16, torch.float16]), seed=seeds())
def test_gluon_variants_vs_reference(config_override, variant, B, s_q, h_q, page_size, causal, sparse, num_splits,
                                     bad_pages, dtype, seed):
    """The Hopper kernel at both head tilings (config field ``block_h``; full 64-row tiles and half-filled ones)
    and with either score schedule (``owner_scores`` off and on: whichever the GPU's table selects, the other is
    checked too) against float64, dense and sparse with adversarial indices and block tables."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon MLA kernel is Hopper-only (sm_90)")
    r, dr = 512, 64
    q, kv, bt, lens, g = _case(seed, B, s_q, h_q, r, dr, page_size, dtype, bad_pages=bad_pages)
    idx = _adversarial_indices(g, B, s_q, 200, lens).to(P.device) if sparse else None
    with config_override({"mla_decode": variant}):
        out, lse = mla_decode(q, kv, bt, lens, head_dim_v=r, causal=causal, indices=idx, num_splits=num_splits,
                              impl="gluon")
    _check(out, lse, q, kv, bt, lens, r, causal, dtype, indices=idx)


@pytest.mark.parametrize("D, head_dim_v, dtype, sparse, cut", [(576, 512, "bf16", False, False),
                                                          (704, 512, "fp16", False, True),
                                                          (1152, 1024, "bf16", True, True),
                                                          (2112, 2048, "bf16", False, True),
                                                          (1152, 1024, "fp32", False, False)])
def test_wide_heads_fit_sm90_shared_memory(D, head_dim_v, dtype, sparse, cut):
    """From the H200 table's portable configs (which the H100 shares), the plan cuts stages, key tiles and row
    tiles until ``shared_bytes`` fits an sm_90 block (the table's own tiles at 512 + 64 channels), and
    ``shared_bytes`` bounds what Triton allocates for the tiles it keeps (compiled for sm_90, no GPU needed)."""
    from gqla_triton.dispatch import table_config
    from gqla_triton.ops.mla.plan import _fit_shared, shared_bytes

    key = {"D": D, "DV": head_dim_v, "sparse": sparse, "s_q": 1, "impl": "triton", "fp32": dtype == "fp32"}
    table = table_config("h200", "mla_decode", key)
    elt = 4 if dtype == "fp32" else 2
    cfg = _fit_shared(table, 128, head_dim_v, D, elt, SM90_SHARED)
    assert (cfg != table) == cut
    need = shared_bytes(cfg.block_h, cfg.block_n, cfg.num_stages, head_dim_v, D, elt)
    assert need <= SM90_SHARED
    fields = dict(dtype=dtype, head_dim_v=head_dim_v, D=D, sparse=sparse, block_h=cfg.block_h, block_n=cfg.block_n,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, p_scratch=cfg.p_scratch,
                  rows_ahead=cfg.rows_ahead)
    shared = compile_in_child(f"from gqla_triton.ops.mla.triton import compile_sm90; k = compile_sm90(**{fields!r})",
                              "k.metadata.shared")
    assert int(shared[0]) <= need


@pytest.mark.parametrize("sparse", [False, True])
def test_portable_scores_split_over_the_warpgroups(sparse):
    """The H200 table's portable config (which the H100 shares), compiled for sm_90 (no GPU needed): one wgmma per
    16-channel step of the latent and rope score products and of P·V, 32 + 4 + 4 for 512 + 64 channels and 64-key
    tiles. A score tile computed whole in both warpgroups (the latent and rope dots folded into one chained
    accumulation) takes 72 and spills."""
    from gqla_triton.dispatch import table_config

    key = {"D": 576, "DV": 512, "sparse": sparse, "s_q": 1, "impl": "triton", "fp32": False}
    cfg = table_config("h200", "mla_decode", key)
    fields = dict(dtype="bf16", sparse=sparse, block_h=cfg.block_h, block_n=cfg.block_n, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages, p_scratch=cfg.p_scratch, rows_ahead=cfg.rows_ahead)
    got = compile_in_child(f"from gqla_triton.ops.mla.triton import compile_sm90; k = compile_sm90(**{fields!r})",
                           "k.asm['ptx'].count('wgmma.mma_async')")
    assert int(got[0]) == 512 // 16 + 64 // 16 + cfg.block_n // 16


def test_heads_too_wide_for_shared_memory_are_refused(monkeypatch):
    """Where even one stage of 16 x 16 tiles exceeds the GPU's shared memory, ``mla_decode`` refuses q by name
    before any launch (on an sm_90's 227 KB: 65536 channels)."""
    import dataclasses

    import gqla_triton.ops.mla.plan as plan_mod
    from gqla_triton.ops.mla.plan import _fit_shared

    cfg = plan_mod.MLADecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2)
    assert _fit_shared(cfg, 16, 512, 576, 2, 100_000).num_stages == 1
    with pytest.raises(ValueError, match="q: 65536 channels .*shared memory"):
        _fit_shared(cfg, 16, 65472, 65536, 2, SM90_SHARED)
    real = plan_mod.device_info
    monkeypatch.setattr(plan_mod, "device_info", lambda d: dataclasses.replace(real(d), smem_per_block=SM90_SHARED))
    q = torch.zeros(1, 1, 2, 8192, device=P.device)
    kv = torch.zeros(1, 16, 1, 8192, device=P.device)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=P.device)
    with pytest.raises(ValueError, match="q: 8192 channels"):
        mla_decode(q, kv, bt, torch.ones(1, dtype=torch.int32, device=P.device), 8192 - 64)


def test_portable_kernel_fits_whatever_the_config_names(monkeypatch):
    """A config that names the Gluon kernel (its 64 x 64 tiles, two stages) for a call the portable kernel runs
    (fp32 q, which the Gluon kernel refuses): the portable kernel's tiles are cut to the GPU's shared memory as for
    a config that names the portable kernel, not launched past it."""
    import dataclasses

    import gqla_triton.ops.mla.plan as plan_mod
    from gqla_triton.dispatch import config_override

    real = plan_mod.device_info
    monkeypatch.setattr(plan_mod, "device_info", lambda d: dataclasses.replace(real(d), smem_per_block=SM90_SHARED))
    q = torch.zeros(1, 1, 64, 576, dtype=torch.float32, device=P.device)
    plans = []
    for impl in ("triton", "gluon"):
        with config_override({"mla_decode": {"impl": impl, "block_h": 64, "block_n": 64, "num_stages": 2}}):
            p = plan_mod.plan(q, 64, 4, 512, None, 0, "triton")
        assert plan_mod.shared_bytes(p.BLOCK_H, p.cfg.block_n, p.cfg.num_stages, 512, 576, 4) <= SM90_SHARED
        plans.append((p.BLOCK_H, p.cfg.block_n, p.cfg.num_stages))
    assert plans[0] == plans[1]


def test_gluon_config_has_one_key_ring():
    """A table cannot ask the Gluon kernel for a key ring it does not have (64-key tiles, two stages): the config
    is refused by field name, not launched with the fields ignored."""
    from gqla_triton.ops.mla.config import MLADecodeConfig

    assert MLADecodeConfig(impl="gluon", block_h=32, block_n=64, num_stages=2).block_h == 32
    with pytest.raises(ValueError, match="'block_n'"):
        MLADecodeConfig(impl="gluon", block_n=32, num_stages=2)
    with pytest.raises(ValueError, match="'num_stages'"):
        MLADecodeConfig(impl="gluon", block_n=64, num_stages=3)
    assert MLADecodeConfig(impl="triton", block_n=32, num_stages=3).num_stages == 3  # the portable kernel's fields


def test_caches_of_2_31_rows_or_more():
    """A cache of 2**31 token rows or more (an expanded view of one page: no memory) is read at its rows past int32
    by the portable kernel, exactly as the page itself; the Gluon kernel, whose row indices are int32, refuses it
    (``impl="auto"`` then runs the portable kernel)."""
    from gqla_triton.ops.mla.fp8 import FP8_ROW_BYTES
    from gqla_triton.ops.mla.gluon_sm90 import gluon_unsupported

    g = gen(11)
    page = randn((1, 16, 1, 48), g)
    big = page.expand(2**27, 16, 1, 48)  # 2**31 rows
    q = randn((1, 2, 4, 48), g)
    lens = torch.tensor([20], dtype=torch.int32, device=P.device)
    table = torch.tensor([[2**27 - 1, 2**27 - 2]], dtype=torch.int32, device=P.device)
    got = mla_decode(q, big, table, lens, 32, causal=True, impl="triton")
    want = mla_decode(q, page, torch.zeros_like(table), lens, 32, causal=True, impl="triton")
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    q16 = torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16)
    one = torch.zeros(1, 64, 1, 576, dtype=torch.bfloat16)
    assert gluon_unsupported(q16, one.expand(2**25 - 1, 64, 1, 576), 512) is None
    assert "2^31 token rows" in gluon_unsupported(q16, one.expand(2**25, 64, 1, 576), 512)
    fp8 = torch.zeros(1, 64, 1, FP8_ROW_BYTES, dtype=torch.float8_e4m3fn).expand(2**25, 64, 1, FP8_ROW_BYTES)
    assert "2^31 token rows" in gluon_unsupported(q16, fp8, 512)


@pytest.mark.gpu_only
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("s_q", [1, 3])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gluon_kernel_is_deterministic(fp8, sparse, s_q):
    """The Gluon kernel over many tiles, with and without splits (s_q 3, dense: the boundary keys one per tile;
    FP8: the in-place dequantisation of every stage) gives the same bits on every call, and the float64
    reference's answer."""
    g = gen(11)
    B, h_q, page, S = 4, 16 if s_q > 1 else 128, 64, 3000
    lens = torch.tensor([S, S - 37, 1, 700], dtype=torch.int32).cuda()
    max_pages = math.ceil(S / page)
    bt = torch.randperm(B * max_pages, generator=g).reshape(B, max_pages).int().cuda()
    q = randn((B, s_q, h_q, 576), g, dtype=torch.bfloat16).cuda()
    kv = randn((B * max_pages, page, 1, 576), g, dtype=torch.float32)
    kv = quantize_latent_fp8(kv).cuda() if fp8 else kv.to(torch.bfloat16).cuda()
    ref_kv = dequantize_latent_fp8(kv, torch.bfloat16) if fp8 else kv  # the values the kernel multiplies
    idx = torch.randint(-2, S, (B, s_q, 2048), generator=g).int().cuda() if sparse else None
    for ns in (0, 3):
        o, l = mla_decode(q, kv, bt, lens, 512, indices=idx, num_splits=ns, impl="gluon")
        for _ in range(4):
            o2, l2 = mla_decode(q, kv, bt, lens, 512, indices=idx, num_splits=ns, impl="gluon")
            assert torch.equal(o, o2) and torch.equal(l, l2), f"num_splits={ns}: a repeat differs"
        _check(o, l, q, ref_kv, bt, lens, 512, True, torch.bfloat16, indices=idx)


@pytest.mark.gpu_only
@pytest.mark.parametrize("layout", ["contiguous", "offset", "padded_pages", "shared_table", "expanded_rows"])
@pytest.mark.parametrize("page", [64, 128])
@pytest.mark.parametrize("s_q", [1, 3])
def test_gluon_tma_copies_equal_cp_async(config_override, layout, page, s_q):
    """Dense tiles copied by TMA (``tma``) give the same bits as the ``cp.async`` gather, with tiles of one call
    mixing both (lengths that end mid-tile, block-table entries no kernel may follow, causal boundary keys), a
    page of two tiles, a cache at a storage offset, pages whose stride leaves a gap (no descriptor: every tile
    by ``cp.async``) or whose tokens share a row (token stride 0, likewise), and one block-table row shared by every
    sequence (batch stride 0, read as it is); both equal the float64 reference."""
    g = gen(23 + page + s_q)
    B, h_q, S = 4, 128 if s_q == 1 else 32, 1500
    lens = torch.tensor([S, S - 37, 1, 700], dtype=torch.int32).cuda()
    max_pages = math.ceil(S / page) + 1
    num_pages = B * max_pages + 2
    bt = torch.randperm(num_pages, generator=g)[: B * max_pages].reshape(B, max_pages).int()
    bt[1, 3] = -1
    bt[2, 0] = num_pages  # sequence 2's only key is on a page no kernel may follow
    bt[3, 5] = 2**31 - 1
    bt = bt.cuda()
    if layout == "shared_table":
        bt = bt[:1].expand(B, max_pages)
    q = randn((B, s_q, h_q, 576), g, dtype=torch.bfloat16).cuda()
    kv = randn((num_pages, page, 1, 576), g, dtype=torch.bfloat16).cuda()
    if layout == "offset":  # the cache starts 8 rows into its storage
        kv = torch.cat([kv.new_zeros(1, page, 1, 576), kv]).reshape(-1, 576)[8:8 + num_pages * page]
        kv = kv.reshape(num_pages, page, 1, 576)
    elif layout == "padded_pages":  # 16 unused rows after every page
        kv = torch.cat([kv, kv.new_full((num_pages, 16, 1, 576), float("nan"))], 1)[:, :page]
    elif layout == "expanded_rows":  # every token of a page one row (token stride 0): no descriptor
        kv = kv[:, :1].expand(num_pages, page, 1, 576)
    runs = {}
    for tma in (True, False):
        with config_override({"mla_decode": {"tma": tma}}):
            for ns in (0, 3):
                runs[tma, ns] = mla_decode(q, kv, bt, lens, 512, causal=True, num_splits=ns, impl="gluon")
    for ns in (0, 3):
        (o1, l1), (o2, l2) = runs[True, ns], runs[False, ns]
        assert torch.equal(o1, o2) and torch.equal(l1, l2), f"num_splits={ns}: TMA and cp.async copies differ"
        _check(o1, l1, q, kv, bt, lens, 512, True, torch.bfloat16)


@pytest.mark.parametrize("sparse,split,tail,fp8,raw,tma,opts", [(False, True, False, False, False, False, ""),
                                                                (True, False, False, False, False, False, ""),
                                                                (False, False, True, False, False, False, ""),
                                                                (False, True, True, True, False, False, ""),
                                                                (True, False, False, True, False, False, ""),
                                                                (False, True, False, False, True, False, ""),
                                                                (False, False, False, False, False, True, ""),
                                                                (False, True, True, False, False, True, ""),
                                                                (False, False, False, False, False, True, "solo=True"),
                                                                (True, True, False, False, True, False, "solo=True"),
                                                                (False, True, False, False, False, False, "solo=True")])
def test_gluon_kernel_compiles_for_sm90(sparse, split, tail, fp8, raw, tma, opts):
    """The Gluon kernel compiles for sm_90 with the installed Triton (no GPU needed): warp-specialised (register
    reallocation), wgmma products, cp.async gathers (and with ``tma`` TMA tile copies), within the H200's shared
    memory; also with ``owner_scores`` (``opts``). In a child process: under TRITON_INTERPRET=1 Triton's own
    reductions are interpreter functions no compiler can take."""
    flags = f"sparse={sparse}, split={split}, tail={tail}, fp8={fp8}, raw={raw}, tma={tma}, {opts}".rstrip(", ")
    shared = compile_sm90_in_child(f"from gqla_triton.ops.mla.gluon_sm90 import compile_sm90; "
                                   f"k = compile_sm90({flags})", tma=tma)
    assert shared <= 227 * 1024
