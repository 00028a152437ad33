"""``mla_sparse_prefill`` (DeepSeek sparse attention prefill) and FlashMLA's ``flash_mla_sparse_fwd`` over it.

Against float64 references: ours (``mla_sparse_prefill_ref``) and FlashMLA's definition with its conventions
(lse ``+inf`` for a query that sees no key, the attention sink, base-2 statistics), written here from its
documentation. Hostile indices and lengths run inside the interpreter's address check; non-finite values reach
exactly the queries whose keys hold them; the split count changes nothing; refusals name the argument.
"""

import math

import pytest
import torch
from harness import (
    P,
    assert_close,
    assert_matches,
    assert_refused,
    capture_graph,
    dtypes,
    examples,
    gen,
    pick,
    randn,
    seeds,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st

import gqla_triton as gq
from gqla_triton.dispatch import is_interpreter
from gqla_triton.ops.mla import mla_sparse_prefill, mla_sparse_prefill_ref

pytestmark = pytest.mark.usefixtures("poison_buffers")

DIMS = pick([(32, 16), (32, 0)], [(512, 64), (512, 0)])  # (head_dim_v = latent, rope): FlashMLA's 576 and 512
HEADS = pick([16], [64, 128])
TOPKS = pick([16, 40], [128, 384, 1024])
JUNK = (-1, -7, -(2**31), 2**31 - 1)  # select nothing, as does any row >= s_kv


def _rows(g, s_q, topk, s_kv, junk_share=0.25):
    """``[s_q, 1, topk]`` int32 rows: valid ones (duplicates included), -1 and other junk, rows past ``s_kv``."""
    idx = torch.randint(0, max(s_kv, 1), (s_q, 1, topk), generator=g)
    junk = torch.tensor([*JUNK, s_kv, s_kv + 3], dtype=torch.int64)
    mask = torch.rand(s_q, 1, topk, generator=g) < junk_share
    idx = torch.where(mask, junk[torch.randint(0, len(junk), (s_q, 1, topk), generator=g)], idx)
    return idx.int().to(P.device)


def _case(seed, s_q, h_q, dims, topk, s_kv, dtype, use_len):
    r, dr = dims
    g = gen(seed)
    q = randn((s_q, h_q, r + dr), g, dtype=dtype)
    kv = randn((s_kv, 1, r + dr), g, dtype=dtype)
    idx = _rows(g, s_q, topk, s_kv)
    length = None
    if use_len:
        length = torch.randint(-2, topk + 3, (s_q,), generator=g).int().to(P.device)
    return q, kv, idx, length


def _run(q, kv, idx, r, scale=None, length=None, num_splits=0, **kw):
    """The op; under the interpreter inside the address check (every access within the tensors passed in)."""
    if not is_interpreter():
        return mla_sparse_prefill(q, kv, idx, r, scale, length, num_splits, **kw)
    from addresscheck import AddressCheck

    with AddressCheck(q, kv, idx, length) as ac:
        got = mla_sparse_prefill(q, kv, idx, r, scale, length, num_splits, **kw)
    ac.assert_clean()
    return got


def _check(got, q, kv, idx, r, scale, length, dtype):
    """out, max_logits and lse against the float64 reference: non-finite values exactly where it has them, the rest
    within the data-derived bound (out) or the score precision (the fp32 statistics)."""
    ref_o, ref_m, ref_l = mla_sparse_prefill_ref(q, kv, idx, r, scale, length)
    low_o, _, _ = mla_sparse_prefill_ref(q, kv, idx, r, scale, length, p_dtype=dtype)
    assert got.out.dtype == q.dtype and got.max_logits.dtype == got.lse.dtype == torch.float32
    assert got.out.shape == ref_o.shape and got.lse.shape == got.max_logits.shape == ref_l.shape
    eps = 1e-5 if dtype == torch.float32 else 1e-4
    assert_matches("out", got.out, ref_o, low_o, dtype=dtype)
    assert_matches("max_logits", got.max_logits, ref_m, ref_m.float(), dtype=torch.float32, eps=eps)
    assert_matches("lse", got.lse, ref_l, ref_l.float(), dtype=torch.float32, eps=eps)
    lonely = ref_l == -math.inf
    assert (got.out.cpu()[lonely] == 0).all(), "a query that sees no key must give out 0"
    return ref_o, ref_m, ref_l


@settings(max_examples=examples(6, 12))
@given(s_q=st.integers(1, pick(4, 48)), h_q=st.sampled_from(HEADS), dims=st.sampled_from(DIMS),
       topk=st.sampled_from(TOPKS), s_kv=st.integers(1, pick(70, 3000)), use_len=st.booleans(),
       num_splits=st.sampled_from([0, 1, 3]), scale=st.sampled_from([None, 0.05, 2.0]), dtype=dtypes(),
       seed=seeds())
def test_matches_reference(s_q, h_q, dims, topk, s_kv, use_len, num_splits, scale, dtype, seed):
    """Junk, duplicated and out-of-range rows, topk lengths below 0 and above topk, s_kv below topk, with and
    without rope channels, scales either side of the raw-score switch (``softmax_scale · log2 e > 1``), any split
    count: the float64 reference."""
    q, kv, idx, length = _case(seed, s_q, h_q, dims, topk, s_kv, dtype, use_len)
    idx[0] = -1  # a query that sees no key
    got = _run(q, kv, idx, dims[0], scale, length, num_splits)
    _check(got, q, kv, idx, dims[0], scale, length, dtype)


@settings(max_examples=examples(3, 6))
@given(dims=st.sampled_from(DIMS), dtype=dtypes(), seed=seeds())
def test_split_count_changes_nothing_but_rounding(dims, dtype, seed):
    """Each query's rows cut into 1, 2 or 5 splits: max_logits bit for bit (a max of the same scores), out and lse
    within rounding of each other and of the reference."""
    s_q, topk = pick(3, 16), pick(40, 1024)
    q, kv, idx, length = _case(seed, s_q, HEADS[0], dims, topk, pick(64, 4096), dtype, True)
    runs = [_run(q, kv, idx, dims[0], None, length, n) for n in (1, 2, 5)]
    for got in runs:
        _check(got, q, kv, idx, dims[0], None, length, dtype)
        assert torch.equal(got.max_logits, runs[0].max_logits)


def test_nonfinite_values_reach_only_the_queries_that_see_them():
    """A NaN in a selected row poisons that query (out, max_logits, lse); +inf in a selected row's channel gives
    +inf / -inf scores per head's sign; an inf in a value channel reaches out through p · v; NaN in rows no query
    selects, or selected past a query's topk length, reaches nothing."""
    r, dr = DIMS[0]
    s_q, h_q, topk, s_kv = 5, HEADS[0], 16, 40
    dtype = P.dtypes[-1]
    g = gen(5)
    q = randn((s_q, h_q, r + dr), g, dtype=dtype)
    kv = randn((s_kv, 1, r + dr), g, dtype=dtype)
    idx = torch.randint(0, 30, (s_q, 1, topk), generator=g).int().to(P.device)
    length = torch.full((s_q,), topk, dtype=torch.int32, device=P.device)
    kv[30:, 0] = float("nan")  # rows 30..39: selected only past a topk length below
    idx[4, 0, 10:] = 35
    length[4] = 10
    # each poisoned row is selected by its one query: (row, that query, what other queries select instead)
    kv[3, 0, 5] = float("nan")  # row 3: query 0 only
    kv[7, 0, r + dr - 1] = float("inf")  # row 7 (a key channel): query 1 only
    q[1, :, r + dr - 1] = torch.where(torch.arange(h_q, device=P.device) % 2 == 0, 1.0, -1.0).to(dtype)
    kv[9, 0, 0] = float("-inf")  # row 9 (value channel 0, also a key channel): query 2 only
    for row, owner, other in ((3, 0, 4), (7, 1, 8), (9, 2, 10)):
        idx[:, 0][idx[:, 0] == row] = other
        idx[owner, 0, owner] = row
    poisoned = {3, 7, 9, *range(30, 40)}
    for j in range(s_q):  # the rows each query sees (within its topk length)
        assert set(idx[j, 0, :int(length[j])].tolist()) & poisoned == ({(3, 7, 9)[j]} if j < 3 else set())
    got = _run(q, kv, idx, r, None, length)
    _, ref_m, ref_l = _check(got, q, kv, idx, r, None, length, dtype)
    assert torch.isnan(got.out[0]).all() and torch.isnan(ref_l[0]).all()
    assert torch.isfinite(got.out[3]).all() and torch.isfinite(got.out[4]).all()
    assert (ref_m[1, ::2] == math.inf).all()


def test_huge_scale_with_duplicated_and_tied_rows():
    """At softmax_scale 1e30 the softmax is a max: a top row listed three times, or two equal rows tied at the top,
    share its weight, so out is that row's value, in the kernel and in the float64 reference (whose weights are
    normalised by their sum: ``exp(s - lse)`` gave each copy weight 1 there, ``max + ln 3`` rounding to ``max``)."""
    r, dr = DIMS[0]
    D = r + dr
    dtype = P.dtypes[-1]
    kv = randn((8, 1, D), 3, dtype=dtype)
    kv[:, 0, D - 1] = 0.0
    kv[3, 0, D - 1], kv[5, 0, D - 1] = 2.0, 1.0
    kv[6] = kv[3]
    q = torch.zeros(2, HEADS[0], D, dtype=dtype, device=P.device)
    q[..., D - 1] = 1.0  # every score is a row's last channel
    idx = torch.tensor([[[3, 3, 3, 5, -1, 0]], [[3, 6, 5, 1, 2, 9]]], dtype=torch.int32, device=P.device)
    want = kv[3, 0, :r].double().cpu().expand(2, HEADS[0], r)
    tol = 1e-6 if dtype == torch.float32 else 4e-3
    for out, lse in (mla_sparse_prefill_ref(q, kv, idx, r, 1e30)[0::2], _run(q, kv, idx, r, 1e30)[0::2]):
        torch.testing.assert_close(out.double().cpu(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(lse.double().cpu(), torch.full((2, HEADS[0]), 2e30, dtype=torch.float64),
                                   rtol=1e-6, atol=0)


def test_every_seen_score_minus_inf_gives_out_zero():
    """A query whose every selected row scores -inf (q -1 on a channel where the row holds +inf) has no weight
    anywhere: out 0 and both statistics -inf, in the kernel (any split count) and in the reference, whose
    ``0 · inf`` in P·V gave NaN there; another query selecting the same row gets what IEEE arithmetic gives (lse
    +inf for its heads whose score is +inf, NaN in out)."""
    r, dr = DIMS[0]
    D = r + dr
    dtype = P.dtypes[-1]
    kv = randn((6, 1, D), 8, dtype=dtype)
    kv[3, 0, 0] = math.inf
    q = randn((2, HEADS[0], D), 9, dtype=dtype)
    q[0] = 0.0
    q[0, :, 0] = -1.0
    idx = torch.tensor([[[3, -1, 3]], [[3, 1, 2]]], dtype=torch.int32, device=P.device)
    for num_splits in (1, 2):
        got = _run(q, kv, idx, r, None, None, num_splits)
        ref_o, ref_m, ref_l = _check(got, q, kv, idx, r, None, None, dtype)
        assert (ref_o[0] == 0).all() and (ref_l[0] == -math.inf).all() and (ref_m[0] == -math.inf).all()
        assert (got.out[0] == 0).all() and (got.lse[0] == -math.inf).all()


def test_hostile_layouts_and_extremes():
    """Strided q and kv (a row stride above D, a storage offset, heads not adjacent), an index tensor that is a
    non-contiguous view, every row junk for some queries, topk lengths at the int32 extremes, a single kv row."""
    r, dr = DIMS[0]
    D = r + dr
    dtype = P.dtypes[-1]
    g = gen(9)
    s_q, h_q, topk = 4, HEADS[0], 24
    for s_kv in (1, 37):
        big_q = randn((h_q, s_q + 1, D + 8), g, dtype=dtype)
        q = big_q[:, 1:, 4:4 + D].transpose(0, 1)  # [s_q, h_q, D], head stride above the token stride
        big_kv = randn((s_kv, 2, D + 16), g, dtype=dtype)
        kv = big_kv[:, 1:, 16:]  # [s_kv, 1, D] with a storage offset and a row stride of 2 (D + 16)
        idx = _rows(g, s_q, 2 * topk, s_kv, junk_share=0.5)[..., ::2]  # a strided view
        idx[1] = torch.tensor(JUNK, dtype=torch.int32, device=P.device).repeat(topk // len(JUNK))
        length = torch.tensor([2**31 - 1, 5, -(2**31), topk], dtype=torch.int32, device=P.device)
        got = _run(q, kv, idx, r, 0.7, length)
        _check(got, q, kv, idx, r, 0.7, length, dtype)
        assert (got.lse[1:3] == -math.inf).all() and (got.max_logits[1:3] == -math.inf).all()


def test_no_query_or_no_key():
    r, dr = DIMS[0]
    dtype = P.dtypes[-1]
    q = randn((3, HEADS[0], r + dr), 1, dtype=dtype)
    empty_kv = torch.empty(0, 1, r + dr, dtype=dtype, device=P.device)
    idx = torch.zeros(3, 1, 16, dtype=torch.int32, device=P.device)
    got = mla_sparse_prefill(q, empty_kv, idx, r)
    assert (got.out == 0).all() and got.out.shape == (3, HEADS[0], r)
    assert (got.lse == -math.inf).all() and (got.max_logits == -math.inf).all()
    none = mla_sparse_prefill(q[:0], randn((5, 1, r + dr), 2, dtype=dtype), idx[:0], r)
    assert none.out.shape == (0, HEADS[0], r) and none.lse.shape == none.max_logits.shape == (0, HEADS[0])


def _bad_calls(q, kv, idx):
    s_q = q.shape[0]
    i64 = idx.long()
    return [
        ("q rank", dict(q=q[None]), ValueError, r"^q: expected 3 dimensions"),
        ("kv heads", dict(kv=kv.expand(-1, 2, -1)), ValueError, r"^kv: expected one latent head"),
        ("kv width", dict(kv=kv[..., :-1]), ValueError, r"^kv: last dim"),
        ("kv stride", dict(kv=kv.transpose(0, 2).contiguous().transpose(0, 2)), ValueError, r"^kv: the last dim"),
        ("kv dtype", dict(kv=kv.double()), TypeError, r"^kv: expected dtype"),
        ("indices dtype", dict(indices=i64), TypeError, r"^indices: expected dtype"),
        ("indices shape", dict(indices=idx[:, 0]), ValueError, r"^indices: expected 3 dimensions"),
        ("indices rows", dict(indices=idx[:-1]), ValueError, r"^indices: expected shape"),
        ("indices groups", dict(indices=idx.expand(-1, 2, -1)), ValueError, r"^indices: expected shape"),
        ("topk 0", dict(indices=idx[..., :0]), ValueError, r"^indices: topk"),
        ("topk_length shape", dict(topk_length=torch.zeros(s_q + 1, dtype=torch.int32, device=q.device)), ValueError,
         r"^topk_length: expected shape"),
        ("topk_length dtype", dict(topk_length=torch.zeros(s_q, dtype=torch.int64, device=q.device)), TypeError,
         r"^topk_length: expected dtype"),
        ("head_dim_v", dict(head_dim_v=q.shape[-1] + 1), ValueError, r"^head_dim_v"),
        ("head_dim_v bool", dict(head_dim_v=True), TypeError, r"^head_dim_v"),
        ("scale nan", dict(softmax_scale=float("nan")), ValueError, r"^softmax_scale"),
        ("scale tensor", dict(softmax_scale=torch.tensor(0.1)), TypeError, r"^softmax_scale"),
        ("num_splits", dict(num_splits=-1), ValueError, r"^num_splits"),
        ("impl gluon", dict(impl="gluon"), ValueError, r"^impl='gluon': mla_sparse_prefill has no Gluon kernel"),
        ("impl", dict(impl="fast"), ValueError, r"^impl: expected one of"),
        ("q heads", dict(q=q[:, :0]), ValueError, r"^q: expected at least one head"),
        ("q channels", dict(q=q[..., :0], kv=kv[..., :0], head_dim_v=1), ValueError,
         r"^q: expected at least one head of at least one channel"),
    ]


def _small():
    """``(q [3, h, D], kv [20, 1, D], indices [3, 1, 16] zeros, head_dim_v)``: a valid call to vary."""
    r, dr = DIMS[0]
    dtype = P.dtypes[-1]
    q = randn((3, HEADS[0], r + dr), 1, dtype=dtype)
    kv = randn((20, 1, r + dr), 2, dtype=dtype)
    return q, kv, torch.zeros(3, 1, 16, dtype=torch.int32, device=P.device), r


def test_bad_arguments_raise_naming_them():
    q, kv, idx, r = _small()
    assert_refused(mla_sparse_prefill, dict(q=q, kv=kv, indices=idx, head_dim_v=r), _bad_calls(q, kv, idx))


def test_reference_impl_custom_op_and_backward():
    """``impl="reference"`` is the float64 reference in the kernel's dtypes; the custom op (torch.compile's route)
    gives the eager call's bits; inputs that require grad keep a grad_fn whose backward raises."""
    r, dr = DIMS[0]
    dtype = P.dtypes[-1]
    q, kv, idx, length = _case(4, 3, HEADS[0], DIMS[0], TOPKS[0], 30, dtype, True)
    ref = mla_sparse_prefill(q, kv, idx, r, None, length, impl="reference")
    got = mla_sparse_prefill(q, kv, idx, r, None, length)
    for a, b in zip(ref, got, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
    ro, rm, rl = mla_sparse_prefill_ref(q, kv, idx, r, None, length)
    assert torch.equal(ref.out.cpu(), ro.to(dtype)) and torch.equal(ref.lse.cpu(), rl.float())
    assert torch.equal(ref.max_logits.cpu(), rm.float())
    op = torch.ops.gqla_triton.mla_sparse_prefill(q, kv, idx, r, (r + dr) ** -0.5, length, 0, "triton")
    assert all(torch.equal(a, b) for a, b in zip(op, got, strict=True))
    qg = q.clone().requires_grad_()
    out = mla_sparse_prefill(qg, kv, idx, r, None, length)
    assert out.out.requires_grad and torch.equal(out.out.detach(), got.out)
    with pytest.raises(RuntimeError, match="mla_sparse_prefill is forward-only"):
        out.out.float().sum().backward()


# ---------------------------------------------------------------- FlashMLA's interface


def _flashmla_prefill_ref(q, kv, idx, scale, d_v, sink=None, length=None):
    """FlashMLA's sparse prefill by its definition, float64: rows -1 or >= s_kv and entries past ``topk_length``
    masked; max_logits the largest scaled score (-inf without a key); lse their log-sum-exp, +inf for a query that
    sees no key; out multiplied by ``1 / (1 + exp(sink - lse))``, 0 without a key."""
    q64, rows = q.double().cpu(), kv.double().cpu()[:, 0]
    idx = idx.long().cpu()[:, 0]
    bad = (idx < 0) | (idx >= rows.shape[0])
    if length is not None:
        bad |= torch.arange(idx.shape[-1])[None, :] >= length.long().cpu()[:, None]
    keys = rows[idx.clamp(0, rows.shape[0] - 1)]
    s = torch.einsum("qhd,qnd->qhn", q64, keys) * scale
    s = s.masked_fill(bad[:, None, :], -math.inf)
    lse = torch.logsumexp(s, -1)
    lonely = lse == -math.inf
    p = torch.where(lonely[..., None], 0.0, torch.exp(s - lse[..., None]))
    out = torch.einsum("qhn,qnd->qhd", p, keys[..., :d_v])
    if sink is not None:
        out = out / (1 + torch.exp(sink.double().cpu()[None, :] - lse))[..., None]
    out = out.masked_fill(lonely[..., None], 0.0)
    return out, s.amax(-1), lse.masked_fill(lonely, math.inf)


@settings(max_examples=examples(4, 8))
@given(h_q=st.sampled_from(HEADS), dims=st.sampled_from(DIMS), topk=st.sampled_from(TOPKS),
       s_kv=st.integers(1, pick(60, 2000)), use_len=st.booleans(), use_sink=st.booleans(),
       log2=st.sampled_from([None, False, True]), dtype=dtypes(), seed=seeds())
@example(h_q=HEADS[0], dims=DIMS[0], topk=TOPKS[0], s_kv=pick(30, 500), use_len=True, use_sink=True, log2=False,
         dtype=P.dtypes[-1], seed=7)
def test_flash_mla_sparse_fwd_vs_flashmla_definition(h_q, dims, topk, s_kv, use_len, use_sink, log2, dtype, seed):
    """FlashMLA's sparse prefill against its definition: out, and max_logits / lse in natural log or base 2, or
    neither (``return_log2_lse=False``)."""
    r, dr = dims
    s_q = pick(3, 24)
    q, kv, idx, length = _case(seed, s_q, h_q, dims, topk, s_kv, dtype, False)
    if use_len:
        length = torch.randint(0, topk + 1, (s_q,), generator=gen(seed)).int().to(P.device)
    idx[0] = -1
    g = gen(seed + 1)
    sink = (randn((h_q,), g) * 2).float().to(P.device) if use_sink else None
    if use_sink:
        sink[0], sink[-1] = math.inf, -math.inf  # head 0: out 0; the last head: no effect
    scale = 0.5 * (r + dr) ** -0.5
    out, mx, lse = gq.flash_mla_sparse_fwd(q, kv, idx, scale, r, sink, length, False, log2)
    ro, rm, rl = _flashmla_prefill_ref(q, kv, idx, scale, r, sink, length)
    assert out.shape == (s_q, h_q, r) and out.dtype == dtype
    lo = ro.to(dtype).double()
    assert_close("out", out, ro, lo, dtype=dtype)
    assert (out[0] == 0).all()
    if log2 is False:
        assert mx is None and lse is None
        return
    unit = 1 / math.log(2) if log2 else 1.0
    eps = 1e-5 if dtype == torch.float32 else 1e-4
    assert_matches("max_logits", mx, rm * unit, (rm * unit).float(), dtype=torch.float32, eps=eps)
    assert_matches("lse", lse, rl * unit, (rl * unit).float(), dtype=torch.float32, eps=eps)
    assert (lse[0] == math.inf).all() and (mx[0] == -math.inf).all()


def test_flash_mla_sparse_fwd_refusals():
    q, kv, idx, r = _small()
    assert_refused(gq.flash_mla_sparse_fwd, dict(q=q, kv=kv, indices=idx, sm_scale=0.1, d_v=r), [
        ("sink shape", dict(attn_sink=torch.zeros(HEADS[0] + 1, device=P.device)), ValueError,
         r"^attn_sink: expected shape"),
        ("sink dtype", dict(attn_sink=torch.zeros(HEADS[0], dtype=torch.float64, device=P.device)), TypeError,
         r"^attn_sink"),
        ("use_legacy", dict(use_legacy="yes"), TypeError, r"^use_legacy"),
        ("return_log2_lse", dict(return_log2_lse=2), TypeError, r"^return_log2_lse"),
        ("sm_scale", dict(sm_scale=math.inf), ValueError, r"^sm_scale"),
        ("q rank", dict(q=q[0]), ValueError, r"^q: expected 3 dimensions"),
    ])


# ---------------------------------------------------------------- GPU only


@pytest.mark.gpu_only
def test_cuda_graph_replay_and_compile():
    """DeepSeek's shape (h_q 128, 576 / 512, top-2048): captured once and replayed on new queries and rows, and
    through torch.compile(fullgraph=True); both match the reference."""
    r, dr = 512, 64
    q, kv, idx, length = _case(3, 8, 128, (r, dr), 2048, 4096, torch.bfloat16, True)
    sq, sidx = q.clone(), idx.clone()
    graph, got = capture_graph(lambda: mla_sparse_prefill(sq, kv, sidx, r, None, length))
    for seed in (1, 2):
        sq.copy_(randn(q.shape, seed, dtype=q.dtype))
        sidx.copy_(_rows(gen(seed), 8, 2048, 4096))
        graph.replay()
        torch.cuda.synchronize()
        _check(got, sq, kv, sidx, r, None, length, torch.bfloat16)

    def f(q, kv, idx, length):
        o = mla_sparse_prefill(q, kv, idx, r, None, length)
        return o.out * 2, o.max_logits, o.lse

    o2, m2, l2 = torch.compile(f, fullgraph=True)(q, kv, idx, length)
    ref = mla_sparse_prefill(q, kv, idx, r, None, length)
    assert torch.equal(o2, ref.out * 2) and torch.equal(m2, ref.max_logits) and torch.equal(l2, ref.lse)


def test_work_buffers_do_not_grow_with_s_kv():
    """A huge kv given as an expanded view (2^30 rows, stride 0) costs nothing of its size: every tensor the call
    creates is bounded by q, the indices and the outputs, and the result is the reference's (every row is the same
    key, so every valid entry selects it)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Sizes(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    Sizes.largest = max(Sizes.largest, t.untyped_storage().nbytes())
            return out

    r, dr = DIMS[0]
    dtype = P.dtypes[-1]
    s_kv = 2**30
    q = randn((3, HEADS[0], r + dr), 5, dtype=dtype)
    kv = randn((1, 1, r + dr), 6, dtype=dtype).expand(s_kv, 1, r + dr)
    idx = torch.tensor([[[0, 5, s_kv - 1, s_kv, -1]], [[7, 7, 2**31 - 1, -5, 3]], [[-1] * 5]], dtype=torch.int32,
                       device=P.device)
    with Sizes():
        got = mla_sparse_prefill(q, kv, idx, r)
    assert Sizes.largest <= 64 * q.untyped_storage().nbytes()
    small = kv[:1].clone()  # the same key as one row: every valid entry of idx selects it
    ref_o, ref_m, ref_l = mla_sparse_prefill_ref(q, small, torch.where((idx >= 0) & (idx < s_kv), 0, -1), r)
    assert_matches("out", got.out, ref_o, mla_sparse_prefill_ref(
        q, small, torch.where((idx >= 0) & (idx < s_kv), 0, -1), r, p_dtype=dtype)[0], dtype=dtype)
    assert_matches("lse", got.lse, ref_l, ref_l.float(), dtype=torch.float32, eps=1e-4)


def test_integral_head_dim_v():
    """``head_dim_v`` takes any integral number (numpy's too), as ``num_splits`` does, in both MLA ops."""
    import numpy as np

    q, kv, idx, r = _small()
    want = mla_sparse_prefill(q, kv, idx, r)
    got = mla_sparse_prefill(q, kv, idx, np.int64(r))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    cache = kv[:16].reshape(1, 16, 1, kv.shape[-1])
    bt = torch.zeros(3, 1, dtype=torch.int32, device=P.device)
    lens = torch.tensor([16, 3, 0], dtype=torch.int32, device=P.device)
    a = gq.mla_decode(q[:, None], cache, bt, lens, np.int32(r))
    b = gq.mla_decode(q[:, None], cache, bt, lens, r)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
