"""gqa_decode (GQLA grouped path / GQA decode, dense + sparse) against the float64 reference."""


import pytest
import torch
from harness import P, assert_close, capture_graph, dtypes, examples, gen, pick, randn, rel_err, seeds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gqla_triton.ops.gqa import gqa_decode, gqa_decode_reference

# every buffer the launcher allocates starts NaN-filled: an element the kernel does not write fails the comparison
pytestmark = pytest.mark.usefixtures("poison_buffers")
# the config_override fixture holds no per-example state: hypothesis tests may take it
_FIXTURE_OK = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]

PAGE = pick(16, 64)


def _case(seed, *, B, s_q, g, G, d_h, d_r, d_v, max_len, dtype, page=PAGE, empty=True):
    """Random paged caches with permuted pages (and spare pages), lengths in [0, max_len] (some 0)."""
    gg = gen(seed)
    pages_per = -(-max(max_len, 1) // page)
    num_pages = B * pages_per + 3
    q = randn((B, s_q, g * G, d_h + d_r), gg, dtype=dtype)
    k = randn((num_pages, page, g, d_h), gg, dtype=dtype)
    v = randn((num_pages, page, g, d_v), gg, dtype=dtype)
    kr = randn((num_pages, page, d_r), gg, dtype=dtype) if d_r else None
    perm = torch.randperm(num_pages, generator=gg)[: B * pages_per]
    bt = perm.reshape(B, pages_per).to(torch.int32).to(P.device)
    lens = torch.randint(0, max_len + 1, (B,), generator=gg)
    lens[0] = max_len  # at least one full-length sequence
    if empty and B > 1:
        lens[-1] = 0
    return q, k, v, bt, lens.to(torch.int32).to(P.device), kr, gg


def _run(q, k, v, bt, lens, kr, *, causal=True, indices=None, topk_length=None, num_splits=0, scale=None,
         impl="triton"):
    """The op with the kernel (outputs NaN-poisoned through the module's poison_buffers)."""
    return gqa_decode(q, k, v, bt, lens, kr, softmax_scale=scale, causal=causal, indices=indices,
                      topk_length=topk_length, num_splits=num_splits, impl=impl)


def _check(name, got, args, dtype, **kw):
    out, lse = got
    ref_o, ref_l = gqa_decode_reference(*args, **kw)
    low_o, low_l = gqa_decode_reference(*args, **kw, compute_dtype=dtype)
    assert_close(f"{name} out", out, ref_o, low_o, dtype=dtype)
    assert_close(f"{name} lse", lse, ref_l, low_l, dtype=dtype)
    # rows that see nothing: exactly 0 / -inf
    dead = torch.isneginf(ref_l).permute(0, 2, 1).cpu()  # [B, s_q, h_q]
    assert torch.isneginf(lse.cpu().permute(0, 2, 1)[dead]).all()
    assert (out.cpu()[dead] == 0).all()


dims = st.sampled_from(pick([(16, 0, 16), (16, 16, 32), (32, 16, 16)], [(128, 64, 128), (128, 0, 128),
                                                                       (64, 32, 64), (256, 0, 256)]))


@settings(max_examples=examples(16, 20))
@given(B=st.integers(1, 3), s_q=st.integers(1, 3), G=st.sampled_from([1, 4, 8, 16, 32]),
       g=st.sampled_from(pick([1, 2], [1, 2, 8])), d=dims, max_len=st.integers(1, pick(70, 1500)),
       causal=st.booleans(), splits=st.sampled_from([0, 1, 3]), dtype=dtypes(), seed=seeds())
def test_dense_vs_reference(B, s_q, G, g, d, max_len, causal, splits, dtype, seed):
    d_h, d_r, d_v = d
    q, k, v, bt, lens, kr, _ = _case(seed, B=B, s_q=s_q, g=g, G=G, d_h=d_h, d_r=d_r, d_v=d_v,
                                     max_len=max_len, dtype=dtype)
    args = (q, k, v, bt, lens, kr)
    _check("dense", _run(*args, causal=causal, num_splits=splits), args, dtype, causal=causal)


@given(s_q=st.integers(1, 2), G=st.sampled_from([4, 16]), max_len=st.integers(pick(20, 500), pick(90, 3000)),
       dtype=dtypes(), seed=seeds())
def test_split_invariance(s_q, G, max_len, dtype, seed):
    q, k, v, bt, lens, kr, _ = _case(seed, B=2, s_q=s_q, g=2, G=G, d_h=pick(16, 128), d_r=16,
                                     d_v=pick(16, 128), max_len=max_len, dtype=dtype, empty=False)
    args = (q, k, v, bt, lens, kr)
    base = _run(*args, num_splits=1)
    _check("splits=1", base, args, dtype)
    low_o = gqa_decode_reference(*args, compute_dtype=dtype)[0]
    ref_o = gqa_decode_reference(*args)[0]
    tol = 4 * rel_err(low_o, ref_o) + 1e-5
    for s in (2, 5, 0):
        o, l = _run(*args, num_splits=s)
        assert rel_err(o, base[0].double()) <= tol, f"splits={s} differs from one split"
        assert rel_err(l, base[1].double()) <= 1e-5


@given(s_q=st.integers(1, 3), G=st.sampled_from([1, 4, 16]), splits=st.sampled_from([1, 3]), dtype=dtypes(),
       seed=seeds())
def test_zero_rope_equals_plain_gqa(s_q, G, splits, dtype, seed):
    d_h = pick(16, 128)
    d_r = pick(16, 64)
    q, k, v, bt, lens, kr, _ = _case(seed, B=2, s_q=s_q, g=2, G=G, d_h=d_h, d_r=d_r, d_v=d_h,
                                     max_len=pick(40, 700), dtype=dtype)
    o1, l1 = _run(q, k, v, bt, lens, torch.zeros_like(kr), num_splits=splits, scale=0.3)
    o2, l2 = _run(q[..., :d_h].contiguous(), k, v, bt, lens, None, num_splits=splits, scale=0.3)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


def test_default_scale_and_custom_op_route():
    """Default scale = (d_h + d_R)^-0.5; the custom op (torch.compile's route) gives the eager call's bits."""
    q, k, v, bt, lens, kr, _ = _case(1, B=2, s_q=2, g=2, G=4, d_h=16, d_r=16, d_v=16, max_len=30,
                                     dtype=torch.float32)
    o, l = gqa_decode(q, k, v, bt, lens, kr)
    o2, l2 = _run(q, k, v, bt, lens, kr, scale=q.shape[-1] ** -0.5)
    assert torch.equal(o, o2) and torch.equal(l, l2)
    assert o.shape == (2, 2, 8, 16) and l.shape == (2, 8, 2) and o.dtype == q.dtype and l.dtype == torch.float32
    o3, l3 = torch.ops.gqla_triton.gqa_decode(q, k, v, bt, lens, kr, q.shape[-1] ** -0.5, True, None, None, 0, "auto")
    assert torch.equal(o, o3) and torch.equal(l, l3)


@settings(max_examples=examples(3, 6))
@given(sparse=st.booleans(), s_q=st.integers(1, 2), splits=st.sampled_from([0, 2]), dtype=dtypes(), seed=seeds())
def test_reference_impl_equals_triton(sparse, s_q, splits, dtype, seed):
    """``impl="reference"`` is the float64 reference in the kernel's output dtypes, shapes and device;
    ``impl="triton"`` computes the same function (data-derived tolerance)."""
    max_len = pick(40, 700)
    q, k, v, bt, lens, kr, gg = _case(seed, B=2, s_q=s_q, g=2, G=4, d_h=pick(16, 128), d_r=pick(16, 64),
                                      d_v=pick(16, 128), max_len=max_len, dtype=dtype)
    idx = _indices(gg, 2, s_q, 2, pick(24, 256), max_len, per_group=False, adversarial=True,
                   lens=lens) if sparse else None
    args = (q, k, v, bt, lens, kr)
    o_ref, l_ref = _run(*args, indices=idx, num_splits=splits, impl="reference")
    o_tri, l_tri = _run(*args, indices=idx, num_splits=splits, impl="triton")
    for a, b in ((o_ref, o_tri), (l_ref, l_tri)):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
    _check("triton", (o_tri, l_tri), args, dtype, indices=idx)
    ro, rl = gqa_decode_reference(*args, indices=idx)
    assert torch.equal(o_ref.cpu(), ro.to(dtype)) and torch.equal(l_ref.cpu(), rl.float())


# ------------------------------------------------------------------------------------------------ sparse
def _indices(gg, B, s_q, g, topk, max_len, *, per_group, adversarial, lens=None):
    shape = (B, s_q, g, topk) if per_group else (B, s_q, topk)
    idx = torch.randint(-2, max_len + 3, shape, generator=gg)
    if lens is not None:  # many entries at the causal boundary: the last s_q positions of each sequence
        near = lens.cpu().long().reshape(B, *([1] * (len(shape) - 1))) - torch.randint(1, 4, shape, generator=gg)
        idx = torch.where(torch.rand(shape, generator=gg) < 0.3, near, idx)
    if adversarial:
        bad = torch.tensor([-1, -(2**31), 2**31 - 1, -7, 1 << 30, max_len + 1000], dtype=torch.int64)
        pick_bad = torch.rand(shape, generator=gg) < 0.3
        idx = torch.where(pick_bad, bad[torch.randint(0, len(bad), shape, generator=gg)], idx)
        dup = torch.rand(shape, generator=gg) < 0.2  # repeated positions
        idx = torch.where(dup, idx[..., :1].expand(shape), idx)
    return idx.to(torch.int32).to(P.device)


@settings(max_examples=examples(16, 20))
@given(B=st.integers(1, 3), s_q=st.integers(1, 3), G=st.sampled_from([1, 4, 16, 32]), g=st.sampled_from([1, 2]),
       topk=st.sampled_from(pick([5, 16, 40], [64, 2048, 300])), per_group=st.booleans(),
       with_len=st.booleans(), causal=st.booleans(), splits=st.sampled_from([0, 1, 3]),
       page=st.sampled_from([PAGE, 1, 61]), dtype=dtypes(), seed=seeds())
def test_sparse_vs_reference_adversarial(B, s_q, G, g, topk, per_group, with_len, causal, splits, page, dtype,
                                         seed):
    """Junk, duplicated and per-group indices, topk lengths, splits, pages of any size (sparse rows are addressed
    one by one): the float64 reference."""
    max_len = pick(60, 3000)
    q, k, v, bt, lens, kr, gg = _case(seed, B=B, s_q=s_q, g=g, G=G, d_h=pick(16, 128), d_r=pick(16, 64),
                                      d_v=pick(16, 128), max_len=max_len, dtype=dtype, page=page)
    idx = _indices(gg, B, s_q, g, topk, max_len, per_group=per_group, adversarial=True, lens=lens)
    tl_ = (torch.randint(-1, topk + 2, (B,), generator=gg).to(torch.int32).to(P.device) if with_len else None)
    args = (q, k, v, bt, lens, kr)
    got = _run(*args, causal=causal, indices=idx, topk_length=tl_, num_splits=splits)
    _check("sparse", got, args, dtype, causal=causal, indices=idx, topk_length=tl_)


@pytest.mark.parametrize("page", [1, 2, 61])
def test_sparse_any_page_size(page):
    """Sparse rows are addressed one by one: pages of any size; a dense call on such pages is refused by name."""
    dtype = P.dtypes[-1]
    max_len = pick(60, 3000)
    q, k, v, bt, lens, kr, gg = _case(23, B=2, s_q=2, g=2, G=4, d_h=pick(16, 128), d_r=pick(16, 64),
                                      d_v=pick(16, 128), max_len=max_len, dtype=dtype, page=page)
    idx = _indices(gg, 2, 2, 2, pick(40, 2048), max_len, per_group=True, adversarial=True, lens=lens)
    args = (q, k, v, bt, lens, kr)
    for splits in (0, 3):
        got = _run(*args, causal=True, indices=idx, num_splits=splits)
        _check("sparse", got, args, dtype, causal=True, indices=idx)
    with pytest.raises(ValueError, match=r"page_size \(dim 1\) must be a positive multiple of 16"):
        _run(*args)


@given(s_q=st.integers(1, 3), G=st.sampled_from([4, 16]), causal=st.booleans(), dtype=dtypes(), seed=seeds())
def test_sparse_all_positions_equals_dense(s_q, G, causal, dtype, seed):
    max_len = pick(50, 2000)
    q, k, v, bt, lens, kr, gg = _case(seed, B=2, s_q=s_q, g=2, G=G, d_h=pick(16, 128), d_r=pick(16, 64),
                                      d_v=pick(16, 128), max_len=max_len, dtype=dtype)
    perm = torch.stack([torch.randperm(max_len, generator=gg) for _ in range(2 * s_q)]).reshape(2, s_q, max_len)
    idx = perm.to(torch.int32).to(P.device)  # every position once, in random order
    args = (q, k, v, bt, lens, kr)
    so, sl = _run(*args, causal=causal, indices=idx)
    do, dl = _run(*args, causal=causal)
    low_o = gqa_decode_reference(*args, causal=causal, compute_dtype=dtype)[0]
    ref_o, ref_l = gqa_decode_reference(*args, causal=causal)
    tol = 4 * rel_err(low_o, ref_o) + 1e-5
    assert rel_err(so, do.double()) <= tol
    assert rel_err(sl, dl.double()) <= 1e-5
    _check("sparse-all", (so, sl), args, dtype, causal=causal)


@given(s_q=st.integers(1, 2), G=st.sampled_from([1, 4, 16]), dtype=dtypes(), seed=seeds())
def test_sparse_per_group_equals_each_group_alone(s_q, G, dtype, seed):
    g = 2 if not P.big else 4
    max_len = pick(50, 2000)
    topk = pick(24, 512)
    q, k, v, bt, lens, kr, gg = _case(seed, B=2, s_q=s_q, g=g, G=G, d_h=pick(16, 128), d_r=pick(16, 64),
                                      d_v=pick(16, 128), max_len=max_len, dtype=dtype)
    idx = _indices(gg, 2, s_q, g, topk, max_len, per_group=True, adversarial=True, lens=lens)
    out, lse = _run(q, k, v, bt, lens, kr, indices=idx, num_splits=2)
    for j in range(g):
        h = slice(j * G, (j + 1) * G)
        o1, l1 = _run(q[:, :, h], k[:, :, j:j + 1], v[:, :, j:j + 1], bt, lens, kr,
                      indices=idx[:, :, j].contiguous(), num_splits=2, scale=q.shape[-1] ** -0.5)
        assert torch.equal(out[:, :, h], o1) and torch.equal(lse[:, h], l1), f"group {j}"


@given(seed=seeds(), dtype=dtypes())
def test_sparse_no_valid_index_gives_zero_and_neg_inf(seed, dtype):
    q, k, v, bt, lens, kr, gg = _case(seed, B=2, s_q=1, g=2, G=4, d_h=16, d_r=16, d_v=16, max_len=40,
                                      dtype=dtype)
    lens = torch.tensor([40, 20], dtype=torch.int32, device=P.device)  # the table holds 48 positions of each
    idx = torch.full((2, 1, 8), -1, dtype=torch.int32, device=P.device)
    # positions at or past the length but inside the table (non-causal: only the length excludes them)
    idx[1, 0, :6] = torch.tensor([2**31 - 1, -(2**31), 50, 1000, 20, 47])
    out, lse = _run(q, k, v, bt, lens, kr, indices=idx, causal=False)
    assert (out == 0).all() and torch.isneginf(lse).all()
    idx = torch.randint(0, 30, (2, 1, 8), generator=gg).to(torch.int32).to(P.device)
    out, lse = _run(q, k, v, bt, lens, kr, indices=idx, topk_length=torch.zeros(2, dtype=torch.int32,
                                                                              device=P.device))
    assert (out == 0).all() and torch.isneginf(lse).all()


@given(sparse=st.booleans(), splits=st.sampled_from([1, 3]), dtype=dtypes(), seed=seeds())
def test_unreadable_pages_are_skipped(sparse, splits, dtype, seed):
    """Block-table entries outside [0, num_pages) and lengths past the table: never read, never counted."""
    q, k, v, bt, lens, kr, gg = _case(seed, B=3, s_q=2, g=2, G=4, d_h=pick(16, 128), d_r=pick(16, 64),
                                      d_v=pick(16, 128), max_len=pick(60, 1000), dtype=dtype, empty=False)
    num_pages = k.shape[0]
    bt = bt.clone()
    bt[0, 0] = -7
    bt[1, -1] = num_pages
    bt[2, 0] = 2**31 - 1
    lens = lens.clone()
    lens[1] = bt.shape[1] * PAGE + 37  # longer than the block table covers
    idx = _indices(gg, 3, 2, 2, pick(24, 400), int(lens.max()), per_group=False, adversarial=True,
                   lens=lens) if sparse else None
    args = (q, k, v, bt, lens, kr)
    _check("pages", _run(*args, indices=idx, num_splits=splits), args, dtype, indices=idx)


# ------------------------------------------------------------------------------------------ bad inputs
def test_bad_inputs_raise():
    q, k, v, bt, lens, kr, _ = _case(0, B=2, s_q=1, g=2, G=4, d_h=16, d_r=16, d_v=16, max_len=20,
                                     dtype=torch.float32)
    i32 = dict(dtype=torch.int32, device=P.device)
    with pytest.raises(ValueError, match="q: last dim"):
        gqa_decode(q[..., :20].contiguous(), k, v, bt, lens, kr)
    with pytest.raises(ValueError, match="h_q"):
        gqa_decode(q[:, :, :7].contiguous(), k, v, bt, lens, kr)
    with pytest.raises(TypeError, match="k_cache"):
        gqa_decode(q, k.half(), v, bt, lens, kr)
    with pytest.raises(ValueError, match="v_cache"):
        gqa_decode(q, k, v[:, :, :1], bt, lens, kr)
    with pytest.raises(ValueError, match="k_rope_cache"):
        gqa_decode(q, k, v, bt, lens, kr[:-1])
    with pytest.raises(ValueError, match="d_h"):
        gqa_decode(q[..., :28].contiguous(), k[..., :12].contiguous(), v, bt, lens, kr)
    with pytest.raises(TypeError, match="block_table"):
        gqa_decode(q, k, v, bt.long(), lens, kr)
    with pytest.raises(ValueError, match="cache_seqlens"):
        gqa_decode(q, k, v, bt, lens[:1], kr)
    with pytest.raises(ValueError, match="indices"):
        gqa_decode(q, k, v, bt, lens, kr, indices=torch.zeros(2, 1, 3, 4, **i32))
    with pytest.raises(TypeError, match="indices"):
        gqa_decode(q, k, v, bt, lens, kr, indices=torch.zeros(2, 1, 4, dtype=torch.int64, device=P.device))
    with pytest.raises(ValueError, match="topk_length"):
        gqa_decode(q, k, v, bt, lens, kr, topk_length=torch.zeros(2, **i32))
    with pytest.raises(ValueError, match="num_splits"):
        gqa_decode(q, k, v, bt, lens, kr, num_splits=-1)
    with pytest.raises(TypeError, match="num_splits"):
        gqa_decode(q, k, v, bt, lens, kr, num_splits=True)
    with pytest.raises((TypeError, ValueError), match="softmax_scale"):
        gqa_decode(q, k, v, bt, lens, kr, softmax_scale="x")
    with pytest.raises((TypeError, ValueError), match="softmax_scale"):
        gqa_decode(q, k, v, bt, lens, kr, softmax_scale=float("inf"))
    with pytest.raises(ValueError, match="impl='gluon'"):
        gqa_decode(q, k, v, bt, lens, kr, impl="gluon")
    for bad in ("cuda", "", None):
        with pytest.raises(TypeError if bad is None else ValueError, match="impl"):
            gqa_decode(q, k, v, bt, lens, kr, impl=bad)
    if P.device == "cpu":  # the interpreter computes bfloat16 wrongly: refused there, by name
        bf = [t.bfloat16() for t in (q, k, v)]
        with pytest.raises(TypeError, match="bfloat16"):
            gqa_decode(bf[0], bf[1], bf[2], bt, lens, kr.bfloat16())
        out, lse = gqa_decode(bf[0], bf[1], bf[2], bt, lens, kr.bfloat16(), impl="reference")
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    with pytest.raises(ValueError, match="page_size"):
        gqa_decode(q, k[:, :8].contiguous(), v[:, :8].contiguous(), bt, lens, kr[:, :8].contiguous())
    with pytest.raises(ValueError, match="contiguous"):
        gqa_decode(q, k, v, bt, lens, torch.randn(kr.shape[0], kr.shape[1], 32, device=P.device)[..., ::2])
    if P.device == "cuda":
        with pytest.raises(ValueError, match="k_cache"):
            gqa_decode(q, k.cpu(), v, bt, lens, kr)


@pytest.mark.gpu_only
def test_cpu_tensors_without_interpreter_raise():
    q, k, v, bt, lens, kr, _ = _case(0, B=1, s_q=1, g=1, G=4, d_h=16, d_r=16, d_v=16, max_len=20,
                                     dtype=torch.float32)
    with pytest.raises(RuntimeError, match="reference"):
        gqa_decode(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), lens.cpu(), kr.cpu())


# ---------------------------------------------------------------------------------- graphs / compile
def _gpu_case(sparse):
    q, k, v, bt, lens, kr, gg = _case(3, B=4, s_q=2, g=8, G=16, d_h=128, d_r=64, d_v=128, max_len=1000,
                                      dtype=torch.bfloat16)
    idx = _indices(gg, 4, 2, 8, 256, 1000, per_group=False, adversarial=True) if sparse else None
    return (q, k, v, bt, lens, kr), idx


@pytest.mark.gpu_only
@pytest.mark.parametrize("sparse", [False, True])
def test_cuda_graph_replay(sparse):
    args, idx = _gpu_case(sparse)
    q, k, v, bt, lens, kr = args
    static_q = q.clone()
    fn = lambda: gqa_decode(static_q, k, v, bt, lens, kr, indices=idx)  # noqa: E731
    graph, (out, lse) = capture_graph(fn)
    q2 = randn(q.shape, 99, dtype=q.dtype)
    lens2 = torch.randint(0, 1000, lens.shape, generator=gen(5)).to(torch.int32).cuda()
    static_q.copy_(q2)
    lens.copy_(lens2)  # lengths change between replays without re-capture
    graph.replay()
    torch.cuda.synchronize()
    eo, el = gqa_decode(q2, k, v, bt, lens2, kr, indices=idx)
    assert torch.equal(out, eo) and torch.equal(lse, el)


@pytest.mark.gpu_only
@pytest.mark.parametrize("sparse", [False, True])
def test_torch_compile_fullgraph(sparse):
    args, idx = _gpu_case(sparse)

    @torch.compile(fullgraph=True)
    def f(q, k, v, bt, lens, kr, idx):
        o, lse = gqa_decode(q * 1.0, k, v, bt, lens, kr, indices=idx)
        return o.float() * 2, lse

    o, lse = f(*args, idx)
    eo, el = gqa_decode(*args, indices=idx)
    assert torch.equal(o, eo.float() * 2) and torch.equal(lse, el)


# ---------------------------------------------------------------------------------- kernel variants
# Every config-selectable kernel variant (config fields of GQADecodeConfig), each flag both ways, against the
# reference; flags a variant does not name are off.
VARIANTS = [
    {},
    {"paged": True},  # dense: one block-table lookup per tile
    {"rows_ahead": True},  # sparse: the next tile's row indices loaded one iteration ahead
    {"paged": True, "rows_ahead": True},
]
FLAGS_OFF = {"paged": False, "rows_ahead": False}


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "+".join(f"{k}={v[k]}" for k in v) or "plain")
@settings(max_examples=examples(4, 6), deadline=None, suppress_health_check=_FIXTURE_OK)
@given(sparse=st.booleans(), s_q=st.integers(1, 2), G=st.sampled_from([1, 4, 16]), causal=st.booleans(),
       splits=st.sampled_from([0, 1, 3]), dtype=dtypes(), seed=seeds())
def test_variants_vs_reference(config_override, variant, sparse, s_q, G, causal, splits, dtype, seed):
    max_len = pick(70, 2000)
    q, k, v, bt, lens, kr, gg = _case(seed, B=2, s_q=s_q, g=2, G=G, d_h=pick(16, 128), d_r=pick(16, 64),
                                      d_v=pick(16, 128), max_len=max_len, dtype=dtype)
    bt = bt.clone()
    bt[1, 0] = -3  # unreadable page: never read, never counted
    idx = _indices(gg, 2, s_q, 2, pick(40, 700), max_len, per_group=False, adversarial=True,
                   lens=lens) if sparse else None
    args = (q, k, v, bt, lens, kr)
    with config_override({"gqa_decode": {**FLAGS_OFF, **variant}}):
        got = _run(*args, causal=causal, indices=idx, num_splits=splits)
    _check(f"variant {variant}", got, args, dtype, causal=causal, indices=idx)


@pytest.mark.gpu_only
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "+".join(f"{k}={v[k]}" for k in v) or "plain")
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_variants_bitwise_repeatable(config_override, variant, sparse, splits):
    """Triton 3.6 can miscompile sm_90 pipelined loops whose tiles feed several tensor-core products: every variant
    returns the same bits call after call (and stays within the reference's tolerance)."""
    args, idx = _gpu_case(sparse)
    with config_override({"gqa_decode": {**FLAGS_OFF, **variant}}):
        first = _run(*args, indices=idx, num_splits=splits)
        for _ in range(4):
            again = _run(*args, indices=idx, num_splits=splits)
            assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    _check(f"variant {variant}", first, args, torch.bfloat16, causal=True, indices=idx)


@pytest.mark.gpu_only
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("splits", [0, 1, 3])
def test_plain_gqa_bitwise_repeatable(s_q, splits):
    """Plain GQA (no rope key, 4 query heads per group: the LLaMA layout, which the H200 table gives a pipeline
    of its own) returns the same bits call after call, and the reference's answer."""
    q, k, v, bt, lens, kr, _ = _case(4, B=4, s_q=s_q, g=8, G=4, d_h=128, d_r=0, d_v=128, max_len=1500,
                                     dtype=torch.bfloat16)
    args = (q, k, v, bt, lens, kr)
    first = _run(*args, num_splits=splits)
    for _ in range(4):
        again = _run(*args, num_splits=splits)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    _check("plain", first, args, torch.bfloat16, causal=True)


@pytest.mark.parametrize("s_q", [1, 2])
def test_bitwise_repeatable_under_load(s_q):
    """Thousands of programs in flight (on the GPU 64 sequences x 8 groups x the planned splits): a race inside a
    software-pipelined loop shows when memory is busy (GDN's pipelined wy_bwd did on sm_90 with hundreds of
    programs, never with a few), so the kernel returns the same bits call after call at such a load, and the
    reference's answer."""
    dt = P.dtypes[0]
    q, k, v, bt, lens, kr, _ = _case(5, B=pick(3, 64), s_q=s_q, g=pick(2, 8), G=pick(2, 16), d_h=pick(16, 128),
                                     d_r=pick(16, 64), d_v=pick(16, 128), max_len=pick(100, 2048), dtype=dt)
    args = (q, k, v, bt, lens, kr)
    first = _run(*args)
    for _ in range(3):
        again = _run(*args)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    _check("under load", first, args, dt, causal=True)


def test_tiles_fit_the_gpus_shared_memory(monkeypatch):
    """On a GPU of 99 KB a block (sm_89), fp32 rows of 256 channels take fewer rows per tile, then fewer pipeline
    stages, until ``plan.shared_bytes`` fits; 2-byte rows on an sm_90 keep the table's tiles; dims nothing fits are
    refused by name (``tools.audit_shared --gpu l40s`` compiles such plans: every launch fits)."""
    import dataclasses

    import gqla_triton.ops.gqa.plan as plan_mod
    from gqla_triton.dispatch import config_override

    real = plan_mod.device_info
    # default.json's tiles (the interpreter's table runs 16 x 16 tiles in one stage)
    with config_override({"gqa_decode": {"block_n": 64, "max_m": 64, "num_stages": 3, "smem": 90000}}):
        for smem in (101376, 232448):
            monkeypatch.setattr(plan_mod, "device_info",
                                lambda d, s=smem: dataclasses.replace(real(d), smem_per_block=s))
            for dt in (torch.float32, torch.float16):
                for s_q, topk in ((4, None), (2, 64)):
                    q = torch.zeros(1, s_q, 128, 256 + 64, dtype=dt, device=P.device)
                    p = plan_mod.plan(q, 8, 16, 4, 256, 64, 256, topk, 0)
                    need = plan_mod.shared_bytes(p.BLOCK_M, p.BLOCK_N, p.cfg.num_stages, 256, 64, 256,
                                                 q.element_size())
                    assert need <= smem
                    if smem == 232448 and dt == torch.float16:  # the table's tiles as they were
                        assert p.BLOCK_M == (64 if topk is None else 16) and p.cfg.num_stages == 3
                    if smem == 101376 and dt == torch.float32 and topk is None:
                        assert p.BLOCK_M < 64
        monkeypatch.setattr(plan_mod, "device_info", lambda d: dataclasses.replace(real(d), smem_per_block=20000))
        with pytest.raises(ValueError, match="q / v_cache: head dims d_h 256, d_r 64, d_v 256 .* shared memory"):
            plan_mod.plan(torch.zeros(1, 1, 16, 320, device=P.device), 1, 16, 4, 256, 64, 256, None, 0)


def _wide_view(shape, strides, values):
    """A view of ``shape`` / ``strides`` (elements) into an uninitialised buffer spanning past 2**31 elements, holding
    ``values`` (only the touched pages are ever written)."""
    span = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1
    view = torch.empty(span, dtype=values.dtype, device=values.device).as_strided(shape, strides)
    view.copy_(values)
    return view


@pytest.mark.parametrize("variant", ["dense", "paged", "sparse"])
def test_cache_offsets_past_int32_do_not_wrap(config_override, variant):
    """Cache strides below 2**31 whose products with a group or slot index pass it (a group-major buffer viewed
    [pages, page, g, d], a token stride of 2**28): every offset is formed in int64, so the result is that of the
    same values in a compact cache (no wrapped, out-of-bounds address)."""
    ps, d, g, dt = 16, 16, 3, torch.float16
    gg = gen(11)
    q = randn((1, 1, 2 * g, d), gg, dtype=dt)
    k, v = randn((1, ps, g, d), gg, dtype=dt), randn((1, ps, g, d), gg, dtype=dt)
    if variant == "sparse":
        k_wide = _wide_view((1, ps, g, d), (ps * 2**28, 2**28, d, 1), k)
    else:
        sg = 2**30 + 2**20  # stride(2): 2·sg > 2**31
        k_wide = _wide_view((1, ps, g, d), (ps * d, d, sg, 1), k)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=P.device)
    sl = torch.full((1,), ps, dtype=torch.int32, device=P.device)
    kw = dict(causal=False)
    if variant == "sparse":
        kw["indices"] = torch.arange(8, 16, dtype=torch.int32, device=P.device).view(1, 1, 8)
    with config_override({"gqa_decode": {"paged": variant == "paged"}}):
        got, lse = gqa_decode(q, k_wide, v, bt, sl, **kw)
    want, want_lse = gqa_decode_reference(q, k.contiguous(), v, bt, sl, **kw)
    ref_lowp, _ = gqa_decode_reference(q, k.contiguous(), v, bt, sl, **kw, compute_dtype=torch.float32)
    assert_close("out", got, want, ref_lowp, dtype=dt)
    assert torch.allclose(lse.double().cpu(), want_lse.double().cpu(), rtol=1e-3, atol=1e-3)


def test_reference_takes_an_empty_batch():
    """The float64 reference of an empty batch: empty out ``[0, s_q, h_q, d_v]`` and lse ``[0, h_q, s_q]`` (the op
    itself refuses B = 0 by name)."""
    q = torch.zeros(0, 2, 8, 32)  # d_h 16 + the shared rope key's 16
    k = torch.zeros(3, 16, 2, 16)
    out, lse = gqa_decode_reference(q, k, k, torch.zeros(0, 2, dtype=torch.int32),
                                    torch.zeros(0, dtype=torch.int32), torch.zeros(3, 16, 16))
    assert out.shape == (0, 2, 8, 16) and lse.shape == (0, 8, 2)
    with pytest.raises(ValueError, match="batch"):
        gqa_decode(q.to(P.device), k.to(P.device), k.to(P.device), torch.zeros(0, 2, dtype=torch.int32,
                   device=P.device), torch.zeros(0, dtype=torch.int32, device=P.device),
                   torch.zeros(3, 16, 16, device=P.device))


def test_few_sequences_match_fill_entries_where_a_table_has_them(monkeypatch):
    """A dense step's ``fill`` match key (its (sequence, group) pairs per SM) selects a table's entry for it. The
    H200's shipped table has none (on the H200 the four-stage, one-wave entries measured slower than its catch-all:
    ``docs/performance.md``, grouped decode), so few sequences take the catch-all (three stages, two programs per
    SM); a table with a ``fill`` entry gives the steps of that fill its pipeline and one wave of splits, and larger
    batches, MTP rows and sparse steps keep their entries."""
    import json

    import gqla_triton.ops.gqa.plan as plan_mod
    from gqla_triton import dispatch
    from gqla_triton.dispatch import DeviceInfo

    h200 = DeviceInfo("NVIDIA H200", (9, 0), sm_count=132, smem_per_block=232448, l2_bytes=50 << 20)
    monkeypatch.setattr(plan_mod, "device_info", lambda d: h200)

    def plan(B, S, s_q=1, topk=None):
        q = torch.zeros(B, s_q, 128, 192, dtype=torch.float16)
        return plan_mod.plan(q, 8, 64, S // 64, 128, 64, 128, topk, 0)

    for B, S, splits in ((1, 32768, 33), (8, 8192, 4), (16, 2048, 2), (32, 16384, 1)):
        p = plan(B, S)
        assert (p.cfg.num_stages, p.cfg.waves, p.num_splits) == (3, 2, splits), (B, S)
    raw = json.loads((dispatch._CONFIG_DIR / "h200.json").read_text())
    deep = {"match": {"sparse": False, "rows": 16, "fill": 1},
            "config": {"block_n": 64, "max_m": 64, "num_warps": 4, "num_stages": 4, "smem": 220000,
                       "acc_elems_4w": 4096, "waves": 1, "paged": True}}
    raw["gqa_decode"].insert(len(raw["gqa_decode"]) - 1, deep)  # before the catch-all
    with dispatch.table_swap("h200", raw):
        for B, S, splits in ((1, 32768, 16), (8, 8192, 2), (16, 2048, 1)):
            p = plan(B, S)
            assert (p.cfg.num_stages, p.cfg.waves, p.num_splits) == (4, 1, splits), (B, S)
            assert plan_mod.shared_bytes(p.BLOCK_M, p.BLOCK_N, 4, 128, 64, 128, 2) <= h200.smem_per_block
        for p in (plan(32, 16384), plan(128, 4096), plan(8, 8192, s_q=2), plan(8, 8192, topk=2048)):
            assert p.cfg.num_stages == 3


def test_reference_takes_head_dims_the_kernel_refuses():
    """``impl="reference"`` (any device and dtype) computes head dims the kernel does not take (d_h, d_v, d_R not
    multiples of 16): the float64 reference's answer; the kernel refuses them by name."""
    q, k, v, bt, lens, kr, _ = _case(5, B=2, s_q=2, g=2, G=2, d_h=8, d_r=6, d_v=12, max_len=20,
                                     dtype=torch.float32)
    with pytest.raises(ValueError, match="d_h"):
        gqa_decode(q, k, v, bt, lens, kr)
    out, lse = gqa_decode(q, k, v, bt, lens, kr, impl="reference")
    ref_o, ref_l = gqa_decode_reference(q, k, v, bt, lens, kr)
    assert out.shape == (2, 2, 4, 12) and out.dtype == torch.float32
    assert_close("reference out", out, ref_o, ref_o.float(), dtype=torch.float32)
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_l.cpu()))
    with pytest.raises(ValueError, match="d_v"):
        gqa_decode(q, k, v[..., :0], bt, lens, kr, impl="reference")
