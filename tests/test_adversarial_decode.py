"""Hostile inputs through ``mla_decode`` and ``gqa_decode`` (issue 23): strided / expanded / transposed index
tensors, INT32 extremes in lengths, indices and block tables, lengths past the block table's capacity, empty
sequences, NaN / Inf in seen and unseen keys, values and q. Each case runs under ``AddressCheck`` in the ci profile
(every load and store inside the tensors passed in) and is compared with the float64 reference: NaN exactly where
the reference has NaN, equal infinities, data-derived tolerance elsewhere. ``tools/sanitize_decode.py`` runs the
same case lists on the GPU under compute-sanitizer."""

from __future__ import annotations

import math

import pytest
import torch

I32_MIN, I32_MAX = -(2**31), 2**31 - 1


def _dev_default():
    try:
        from harness import P
        return P.device, P.dtypes[-1], P.big
    except Exception:  # imported by tools/sanitize_decode.py outside pytest
        return "cuda", torch.bfloat16, True


# ---------------------------------------------------------------- the cases (one list per op, two runners)


def _paged(g, B, max_pages, page, extra=2):
    num_pages = B * max_pages + extra
    bt = torch.randperm(num_pages, generator=g)[: B * max_pages].reshape(B, max_pages).int()
    return num_pages, bt


def _views(name, t):
    """(label, view) pairs of ``t`` whose contents equal ``t``: strided, expanded (1-D of equal entries only),
    transposed."""
    out = []
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype)
    wide[..., ::2] = t
    out.append((f"{name}-strided", wide[..., ::2]))
    if t.dim() >= 2:
        out.append((f"{name}-transposed", t.transpose(0, 1).contiguous().transpose(0, 1)))
    return out


def mla_cases(big=False):
    """``(label, kwargs)`` for ``mla_decode``; tensors on the CPU (the runner moves them)."""
    r, dr, h_q, page = (512, 64, 64, 64) if big else (32, 16, 16, 16)
    cases = []
    g = torch.Generator().manual_seed(23)
    B, max_pages = 3, 4
    num_pages, bt = _paged(g, B, max_pages, page)
    cap = max_pages * page
    kv = torch.randn(num_pages, page, 1, r + dr, generator=g)

    def q_(s_q):
        return torch.randn(B, s_q, h_q, r + dr, generator=g)

    lens = torch.tensor([cap - 3, 1, 0], dtype=torch.int32)
    base = dict(kv_cache=kv, block_table=bt, head_dim_v=r)
    topk = 24
    idx = torch.randint(0, cap, (B, 2, topk), generator=g).int()
    tkl = torch.tensor([topk, 5, -3], dtype=torch.int32)
    for s_q in (1, 2, 3):
        for causal in (True, False):
            for ns in (0, 1, 3):
                cases.append((f"dense-s{s_q}-c{int(causal)}-n{ns}",
                              dict(base, q=q_(s_q), cache_seqlens=lens, causal=causal, num_splits=ns)))
    # views of index tensors
    q2 = q_(2)
    lens_w = torch.zeros(2 * B, dtype=torch.int32)
    lens_w[::2] = lens
    cases.append(("lens-strided", dict(base, q=q2, cache_seqlens=lens_w[::2], num_splits=3)))
    cases.append(("lens-expanded", dict(base, q=q2, cache_seqlens=torch.tensor([cap - 5], dtype=torch.int32)
                                        .expand(B), num_splits=3)))
    for lab, v in _views("bt", bt):
        cases.append((lab, dict(base, q=q2, block_table=v, cache_seqlens=lens, num_splits=3)))
    for lab, v in _views("idx", idx):
        cases.append((lab, dict(base, q=q2, cache_seqlens=lens, indices=v, num_splits=3)))
    tkl_w = torch.zeros(2 * B, dtype=torch.int32)
    tkl_w[::2] = tkl
    cases.append(("topk_length-strided", dict(base, q=q2, cache_seqlens=lens, indices=idx, topk_length=tkl_w[::2])))
    cases.append(("topk_length-expanded", dict(base, q=q2, cache_seqlens=lens, indices=idx,
                                               topk_length=torch.tensor([7], dtype=torch.int32).expand(B))))
    # extreme lengths: INT32_MAX, past the capacity, negative
    for lab, ls in (("lens-int32max", [I32_MAX, I32_MAX - 1, 5]), ("lens-over-capacity", [cap + 1, cap * 7, 3]),
                    ("lens-negative", [-1, I32_MIN, -100])):
        lt = torch.tensor(ls, dtype=torch.int32)
        for s_q, causal, ns in ((1, True, 0), (3, True, 3), (2, False, 1)):
            cases.append((f"{lab}-s{s_q}-c{int(causal)}-n{ns}",
                          dict(base, q=q_(s_q), cache_seqlens=lt, causal=causal, num_splits=ns)))
        cases.append((f"{lab}-sparse", dict(base, q=q2, cache_seqlens=lt, indices=idx, num_splits=3)))
    # junk block-table entries and junk / duplicated indices, every index kind between 0 and INT32 extremes
    junk_bt = bt.clone()
    junk_bt[0, 1], junk_bt[1, 0], junk_bt[1, 2], junk_bt[2, 3] = -1, num_pages, I32_MAX, I32_MIN
    cases.append(("bt-junk", dict(base, q=q_(3), block_table=junk_bt, cache_seqlens=lens, num_splits=3)))
    jidx = idx.clone()
    jidx[:, :, :6] = torch.tensor([-1, I32_MIN, I32_MAX, cap, cap + page, 10**9], dtype=torch.int32)
    jidx[:, :, 6:10] = jidx[:, :, 10:11]  # duplicates
    for ns in (0, 3):
        cases.append((f"idx-junk-n{ns}", dict(base, q=q2, block_table=junk_bt, cache_seqlens=lens, indices=jidx,
                                             num_splits=ns)))
        cases.append((f"idx-capacity-lens-n{ns}", dict(base, q=q2, cache_seqlens=torch.tensor(
            [I32_MAX, cap * 3, 40], dtype=torch.int32), indices=jidx, num_splits=ns)))
    cases.append(("topk_length-extremes", dict(base, q=q2, cache_seqlens=lens, indices=jidx,
                                               topk_length=torch.tensor([I32_MAX, I32_MIN, 0], dtype=torch.int32))))
    # NaN / Inf
    L0 = int(lens[0])
    row = lambda b, p: (int(bt[b, p // page]), p % page)  # noqa: E731

    def poisoned(positions, value, chans=slice(None)):
        k = kv.clone()
        for b, p in positions:
            k[row(b, p)][0, chans] = value
        return k
    nan = float("nan")
    inf = float("inf")
    for ns in (1, 3):
        cases.append((f"nan-seen-key-n{ns}", dict(base, kv_cache=poisoned([(0, 5)], nan), q=q_(2), cache_seqlens=lens,
                                                  num_splits=ns)))
        cases.append((f"nan-unseen-key-n{ns}", dict(base, kv_cache=poisoned([(0, L0 + 1), (1, 2)], nan), q=q_(2),
                                                    cache_seqlens=lens, num_splits=ns)))
        # s_q = 2 causal: position L0 - 1 is seen by query 1 only
        cases.append((f"nan-mtp-tail-n{ns}", dict(base, kv_cache=poisoned([(0, L0 - 1)], nan), q=q_(2),
                                                  cache_seqlens=lens, num_splits=ns)))
        cases.append((f"inf-value-mtp-tail-n{ns}", dict(base, kv_cache=poisoned([(0, L0 - 1)], inf, slice(0, 3)),
                                                        q=q_(3), cache_seqlens=lens, num_splits=ns)))
        qn = q_(2)
        qn[0, 1, 3, 0] = nan
        cases.append((f"nan-q-n{ns}", dict(base, kv_cache=kv, q=qn, cache_seqlens=lens, num_splits=ns)))
        qi = q_(1).abs()
        qi[0, 0, 2, :] = inf  # +inf scores for keys with positive entries, -inf / NaN for others
        cases.append((f"inf-q-n{ns}", dict(base, kv_cache=kv.abs(), q=qi, cache_seqlens=lens, num_splits=ns)))
    spare = kv.clone()
    used = set(bt.flatten().tolist())
    for p_ in range(num_pages):
        if p_ not in used:
            spare[p_] = nan
    cases.append(("nan-unused-pages", dict(base, kv_cache=spare, q=q_(3), cache_seqlens=lens, num_splits=3)))
    # a sparse entry that does not count (past topk_length) names a NaN key
    sidx = idx.clone()
    sidx[0, :, -1] = 5
    cases.append(("nan-ignored-sparse", dict(base, kv_cache=poisoned([(0, 5)], nan), q=q2, cache_seqlens=lens,
                                             indices=sidx,
                                             topk_length=torch.tensor([topk - 1, 3, 3], dtype=torch.int32))))
    cases.append(("nan-seen-sparse", dict(base, kv_cache=poisoned([(0, 5)], nan), q=q2, cache_seqlens=lens,
                                          indices=sidx, num_splits=3)))
    return cases


def gqa_cases(big=False):
    """``(label, kwargs)`` for ``gqa_decode``; tensors on the CPU."""
    gr, G, d_h, d_r, d_v, page = (2, 8, 128, 64, 128, 64) if big else (2, 4, 16, 16, 16, 16)
    cases = []
    g = torch.Generator().manual_seed(29)
    B, max_pages = 3, 4
    num_pages, bt = _paged(g, B, max_pages, page)
    cap = max_pages * page
    k = torch.randn(num_pages, page, gr, d_h, generator=g)
    v = torch.randn(num_pages, page, gr, d_v, generator=g)
    kr = torch.randn(num_pages, page, d_r, generator=g)

    def q_(s_q):
        return torch.randn(B, s_q, gr * G, d_h + d_r, generator=g)

    lens = torch.tensor([cap - 3, 1, 0], dtype=torch.int32)
    base = dict(k_cache=k, v_cache=v, k_rope_cache=kr, block_table=bt)
    topk = 24
    idx = torch.randint(0, cap, (B, 2, topk), generator=g).int()
    idx_g = torch.randint(0, cap, (B, 2, gr, topk), generator=g).int()
    for s_q in (1, 2, 3):
        for causal in (True, False):
            for ns in (0, 1, 3):
                cases.append((f"dense-s{s_q}-c{int(causal)}-n{ns}",
                              dict(base, q=q_(s_q), cache_seqlens=lens, causal=causal, num_splits=ns)))
    q2 = q_(2)
    lens_w = torch.zeros(2 * B, dtype=torch.int32)
    lens_w[::2] = lens
    cases.append(("lens-strided", dict(base, q=q2, cache_seqlens=lens_w[::2], num_splits=3)))
    cases.append(("lens-expanded", dict(base, q=q2, cache_seqlens=torch.tensor([cap - 5], dtype=torch.int32)
                                        .expand(B), num_splits=3)))
    for lab, vv in _views("bt", bt):
        cases.append((lab, dict(base, q=q2, block_table=vv, cache_seqlens=lens, num_splits=3)))
    for lab, vv in _views("idx", idx) + _views("idx_g", idx_g):
        cases.append((lab, dict(base, q=q2, cache_seqlens=lens, indices=vv, num_splits=3)))
    cases.append(("topk_length-expanded", dict(base, q=q2, cache_seqlens=lens, indices=idx,
                                               topk_length=torch.tensor([7], dtype=torch.int32).expand(B))))
    for lab, ls in (("lens-int32max", [I32_MAX, I32_MAX - 1, 5]), ("lens-over-capacity", [cap + 1, cap * 7, 3]),
                    ("lens-negative", [-1, I32_MIN, -100])):
        lt = torch.tensor(ls, dtype=torch.int32)
        for s_q, causal, ns in ((1, True, 0), (3, True, 3), (2, False, 1)):
            cases.append((f"{lab}-s{s_q}-c{int(causal)}-n{ns}",
                          dict(base, q=q_(s_q), cache_seqlens=lt, causal=causal, num_splits=ns)))
        cases.append((f"{lab}-sparse", dict(base, q=q2, cache_seqlens=lt, indices=idx_g, num_splits=3)))
    junk_bt = bt.clone()
    junk_bt[0, 1], junk_bt[1, 0], junk_bt[1, 2], junk_bt[2, 3] = -1, num_pages, I32_MAX, I32_MIN
    cases.append(("bt-junk", dict(base, q=q_(3), block_table=junk_bt, cache_seqlens=lens, num_splits=3)))
    jidx = idx.clone()
    jidx[:, :, :6] = torch.tensor([-1, I32_MIN, I32_MAX, cap, cap + page, 10**9], dtype=torch.int32)
    jidx[:, :, 6:10] = jidx[:, :, 10:11]
    for ns in (0, 3):
        cases.append((f"idx-junk-n{ns}", dict(base, q=q2, block_table=junk_bt, cache_seqlens=lens, indices=jidx,
                                             num_splits=ns)))
        cases.append((f"idx-capacity-lens-n{ns}", dict(base, q=q2, cache_seqlens=torch.tensor(
            [I32_MAX, cap * 3, 40], dtype=torch.int32), indices=jidx, num_splits=ns)))
    cases.append(("topk_length-extremes", dict(base, q=q2, cache_seqlens=lens, indices=jidx,
                                               topk_length=torch.tensor([I32_MAX, I32_MIN, 0], dtype=torch.int32))))
    L0 = int(lens[0])
    nan, inf = float("nan"), float("inf")

    def put(t, positions, value, chans=slice(None)):
        t = t.clone()
        for b, p in positions:
            t[int(bt[b, p // page]), p % page, ..., chans] = value
        return t
    for ns in (1, 3):
        cases.append((f"nan-seen-key-n{ns}", dict(base, k_cache=put(k, [(0, 5)], nan), q=q_(2), cache_seqlens=lens,
                                                  num_splits=ns)))
        cases.append((f"nan-seen-value-n{ns}", dict(base, v_cache=put(v, [(0, 5)], nan, slice(0, 2)), q=q_(2),
                                                    cache_seqlens=lens, num_splits=ns)))
        cases.append((f"nan-unseen-n{ns}", dict(base, k_cache=put(k, [(0, L0 + 1), (1, 2)], nan),
                                                v_cache=put(v, [(0, L0 + 1), (1, 2)], nan), q=q_(2),
                                                cache_seqlens=lens, num_splits=ns)))
        cases.append((f"nan-mtp-tail-n{ns}", dict(base, k_cache=put(k, [(0, L0 - 1)], nan),
                                                  v_cache=put(v, [(0, L0 - 1)], nan), q=q_(2), cache_seqlens=lens,
                                                  num_splits=ns)))
        cases.append((f"inf-value-mtp-tail-n{ns}", dict(base, v_cache=put(v, [(0, L0 - 1), (0, L0 - 2)], inf,
                                                                         slice(0, 3)), q=q_(3), cache_seqlens=lens,
                                                        num_splits=ns)))
        qn = q_(2)
        qn[0, 1, 3, 0] = nan
        cases.append((f"nan-q-n{ns}", dict(base, q=qn, cache_seqlens=lens, num_splits=ns)))
        qi = q_(1).abs()
        qi[0, 0, 2, :] = inf
        cases.append((f"inf-q-n{ns}", dict(base, k_cache=k.abs(), k_rope_cache=kr.abs(), q=qi, cache_seqlens=lens,
                                           num_splits=ns)))
    sidx = idx.clone()
    sidx[0, :, -1] = 5
    cases.append(("nan-ignored-sparse", dict(base, v_cache=put(v, [(0, 5)], nan), q=q2, cache_seqlens=lens,
                                             indices=sidx,
                                             topk_length=torch.tensor([topk - 1, 3, 3], dtype=torch.int32))))
    cases.append(("nan-seen-sparse", dict(base, v_cache=put(v, [(0, 5)], nan), q=q2, cache_seqlens=lens, indices=sidx,
                                          num_splits=3)))
    return cases


# ---------------------------------------------------------------- comparison


def compare(name, got, ref, lowp):
    """NaN exactly where ``ref`` has NaN, equal infinities, data-derived tolerance (harness.assert_close) on the
    finite elements. Raises AssertionError."""
    from harness import assert_close

    got = got.detach().double().cpu()
    nan = ref.isnan()
    if not torch.equal(got.isnan(), nan):
        raise AssertionError(f"{name}: NaN at {int((got.isnan() & ~nan).sum())} positions the reference has finite, "
                             f"missing at {int((~got.isnan() & nan).sum())} NaN positions of the reference")
    inf = ref.isinf()
    if not torch.equal(got.isinf(), inf) or not torch.equal(got[inf], ref[inf]):
        raise AssertionError(f"{name}: infinities differ from the reference")
    fin = torch.isfinite(ref)
    low = lowp.double().cpu()[fin]
    assert_close(name, got[fin], ref[fin], torch.where(torch.isfinite(low), low, ref[fin]), dtype=torch.float32,
                 eps=1e-4)


def _to(kw, device, dtype):
    return {k: (v.to(device, dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else
                v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def run_mla(kw, device, dtype, address_check=False):
    from gqla_triton.ops.mla import mla_decode, mla_decode_ref

    kw = _to(kw, device, dtype)
    r = kw["head_dim_v"]
    if address_check:
        from addresscheck import AddressCheck

        with AddressCheck(*[v for v in kw.values() if isinstance(v, torch.Tensor)]) as ac:
            out, lse = mla_decode(**kw, impl="triton")
        ac.assert_clean()
    else:
        out, lse = mla_decode(**kw, impl="triton")
        if device != "cpu":
            torch.cuda.synchronize()
    ref_kw = {k: v for k, v in kw.items() if k != "num_splits"}
    ro, rl = mla_decode_ref(**ref_kw)
    lo, _ = mla_decode_ref(**ref_kw, p_dtype=dtype)
    del r
    compare("out", out, ro, lo)
    compare("lse", lse, rl, rl.float())


def run_gqa(kw, device, dtype, address_check=False):
    from gqla_triton.ops.gqa import gqa_decode, gqa_decode_reference

    kw = _to(kw, device, dtype)
    if address_check:
        from addresscheck import AddressCheck

        with AddressCheck(*[v for v in kw.values() if isinstance(v, torch.Tensor)]) as ac:
            out, lse = gqa_decode(**kw, impl="triton")
        ac.assert_clean()
    else:
        out, lse = gqa_decode(**kw, impl="triton")
        if device != "cpu":
            torch.cuda.synchronize()
    ref_kw = {k: v for k, v in kw.items() if k != "num_splits"}
    ro, rl = gqa_decode_reference(**ref_kw)
    lo, ll = gqa_decode_reference(**ref_kw, compute_dtype=dtype)
    compare("out", out, ro, lo)
    compare("lse", lse, rl, ll)


# ---------------------------------------------------------------- tests

_DEV, _DTYPE, _BIG = _dev_default()
MLA_CASES = mla_cases(_BIG)
GQA_CASES = gqa_cases(_BIG)


@pytest.mark.parametrize("kw", [c[1] for c in MLA_CASES], ids=[c[0] for c in MLA_CASES])
def test_mla_adversarial(kw):
    run_mla(kw, _DEV, _DTYPE, address_check=_DEV == "cpu")


@pytest.mark.parametrize("kw", [c[1] for c in GQA_CASES], ids=[c[0] for c in GQA_CASES])
def test_gqa_adversarial(kw):
    run_gqa(kw, _DEV, _DTYPE, address_check=_DEV == "cpu")


def test_case_counts():
    assert len(MLA_CASES) >= 55 and len(GQA_CASES) >= 55


def _small():
    dev = _DEV
    q = torch.randn(1, 1, 4, 32, device=dev)
    kv = torch.randn(2, 16, 1, 32, device=dev)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=dev)
    lens = torch.full((1,), 5, dtype=torch.int32, device=dev)
    return q, kv, bt, lens


def test_clear_errors():
    from gqla_triton.ops.gqa import gqa_decode
    from gqla_triton.ops.mla import mla_decode

    q, kv, bt, lens = _small()
    for bad in (10**6, 2**40, True, -1, 1.5):
        with pytest.raises(ValueError, match="num_splits"):
            mla_decode(q, kv, bt, lens, head_dim_v=16, num_splits=bad)
    for bad in ("x", [1.0], None.__class__):
        with pytest.raises((TypeError, ValueError), match="softmax_scale"):
            mla_decode(q, kv, bt, lens, head_dim_v=16, softmax_scale=bad)
    with pytest.raises(TypeError, match="cache_seqlens"):
        mla_decode(q, kv, bt, lens.float(), head_dim_v=16)
    with pytest.raises(TypeError, match="block_table"):
        mla_decode(q, kv, bt.to(torch.int16), lens, head_dim_v=16)
    with pytest.raises(ValueError, match="block_table"):
        mla_decode(q, kv, torch.zeros(1, 2**27, dtype=torch.int32, device=q.device).expand(1, 2**27), lens,
                   head_dim_v=16)
    with pytest.raises(ValueError, match="head_dim_v"):
        mla_decode(q, kv, bt, lens, head_dim_v=0)
    with pytest.raises(ValueError, match="page_size"):
        mla_decode(q, torch.zeros(2, 8, 1, 32, device=q.device), bt, lens, head_dim_v=16)
    k = torch.randn(2, 16, 1, 16, device=q.device)
    with pytest.raises(ValueError, match="num_splits"):
        gqa_decode(q[..., :16], k, k, bt, lens, num_splits=True)
    with pytest.raises(TypeError, match="indices"):
        gqa_decode(q[..., :16], k, k, bt, lens, indices=torch.zeros(1, 1, 4, device=q.device))


def test_not_differentiable():
    from gqla_triton.ops.gqa import gqa_decode
    from gqla_triton.ops.mla import mla_decode

    q, kv, bt, lens = _small()
    q.requires_grad_(True)
    out, lse = mla_decode(q, kv, bt, lens, head_dim_v=16, impl="triton")
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="mla_decode is not differentiable"):
        out.sum().backward()
    k = torch.randn(2, 16, 1, 16, device=q.device)
    out, lse = gqa_decode(q[..., :16], k, k, bt, lens)
    with pytest.raises(RuntimeError, match="gqa_decode is not differentiable"):
        lse.masked_fill(lse.isinf(), 0).sum().backward()
    with torch.no_grad():
        out, _ = mla_decode(q, kv, bt, lens, head_dim_v=16, impl="triton")
    assert not out.requires_grad
    assert math.isfinite(float(out.float().sum()))
