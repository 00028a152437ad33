"""``chunk_gated_delta_rule(..., state_indices=...)``: the chunked prefill reading its initial states from, and writing
its final states into, rows of a state pool ``[P, HV, K, V]`` through the index (ops/gdn: api.py, launch.py,
kernels/state.py, kernels/seg.py).

The pooled call must equal gather -> the op with ``initial_state`` / ``output_final_state`` -> scatter: bitwise for
the kernels (the same arithmetic, only the addresses of the state rows differ), and within the usual tolerance of
the float64 recurrence. Rows not named, and rows named by a negative index, are never touched.
"""

import contextlib

import pytest
import torch
from harness import P, assert_close, dtypes, examples, gen, pick, randn, seeds
from hypothesis import example, given, settings
from hypothesis import strategies as st

import gqla_triton.ops.gdn.api as api_mod
from gqla_triton.dispatch import config_override
from gqla_triton.ops.gdn import chunk_gated_delta_rule
from gqla_triton.ops.gdn.reference import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref

pytestmark = pytest.mark.usefixtures("poison_buffers")

SEG = {"seg_units": 1 << 20, "seg_below": 1 << 20, "seg_min": 1}  # split every sequence into one-chunk segments


def _problem(seed, lens, varlen, HV, K, V, dtype):
    """Inputs on the test device: q, k, v, g, beta (q, k unit rows), cu_seqlens or None, and N."""
    g_ = gen(seed)
    if varlen:
        B, T, N = 1, sum(lens), len(lens)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=P.device)
    else:
        B, T, N, cu = len(lens), max(lens), len(lens), None
    q = torch.nn.functional.normalize(randn((B, T, 1, K), g_, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(randn((B, T, 1, K), g_, dtype=torch.float64), dim=-1)
    v = randn((B, T, HV, V), g_, dtype=torch.float64)
    g = -torch.rand(B, T, HV, generator=g_, dtype=torch.float64).to(P.device)
    beta = (0.05 + 0.9 * torch.rand(B, T, HV, generator=g_, dtype=torch.float64)).to(P.device)
    return [t.to(dtype) for t in (q, k, v)] + [g.to(dtype), beta.to(dtype)], cu, N


def _indices(seed, N, rows):
    """[N] int32: distinct pool rows in random order, about a third of them -1 (no row)."""
    g_ = gen(seed + 7)
    idx = torch.randperm(rows, generator=g_)[:N].to(torch.int32)
    return torch.where(torch.rand(N, generator=g_) < 0.3, -1, idx)


def _gathered(pool, idx):
    live = idx >= 0
    h0 = torch.zeros(idx.numel(), *pool.shape[1:], dtype=pool.dtype, device=pool.device)
    h0[live] = pool[idx[live].long()]
    return h0, live


@given(lens=st.lists(st.integers(1, pick(150, 500)), min_size=1, max_size=3), varlen=st.booleans(),
       spare=st.integers(0, 3), G=st.sampled_from([1, 2]), seg=st.booleans(), l2=st.booleans(), dtype=dtypes(),
       seed=seeds())
def test_pool_equals_gather_op_scatter(lens, varlen, spare, G, seg, l2, dtype, seed):
    """Pooled call = gather -> op -> scatter, bitwise (o and the whole pool: rows not named and rows of negative
    indices untouched); dense or varlen, GVA, l2-normalised q / k, with and without sequence splitting; and the
    pooled result within the tolerance of the float64 recurrence."""
    HV, K, V = G, pick(16, 128), pick(32, 128)
    x, cu, N = _problem(seed, lens, varlen, HV, K, V, dtype)
    pool = randn((N + spare, HV, K, V), seed + 5, scale=0.5)
    idx = _indices(seed, N, N + spare).to(P.device)
    h0, live = _gathered(pool, idx)
    with torch.no_grad(), config_override({"gdn_chunk": SEG if seg else {}}):
        o_ref, ht = chunk_gated_delta_rule(*x, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                           use_qk_l2norm_in_kernel=l2)
        got = pool.clone()
        o, none = chunk_gated_delta_rule(*x, initial_state=got, state_indices=idx, cu_seqlens=cu,
                                         use_qk_l2norm_in_kernel=l2)
    want = pool.clone()
    want[idx[live].long()] = ht[live]
    assert none is None
    assert torch.equal(o, o_ref), "o: pooled call differs from gather -> op"
    assert torch.equal(got, want), "pool: differs from gather -> op -> scatter (or a row not named was touched)"
    # against the float64 recurrence, and the chunked reference at the kernel's precision for the tolerance
    f64 = [t.double().cpu() for t in x]
    cu_c = cu.cpu() if cu is not None else None
    ro, rht = recurrent_gated_delta_rule_ref(*f64, initial_state=h0.double().cpu(), output_final_state=True,
                                             use_qk_l2norm=l2, cu_seqlens=cu_c)
    lo, lht = chunk_gated_delta_rule_ref(*(t.float() for t in f64), initial_state=h0.cpu(), output_final_state=True,
                                         use_qk_l2norm=l2, cu_seqlens=cu_c,
                                         compute_dtype=dtype if dtype != torch.float32 else None)
    assert_close("o", o, ro, lo, dtype=dtype)
    if live.any():
        lv = live.cpu()
        assert_close("pool rows written", got[idx[live].long()], rht[lv], lht[lv], dtype=dtype)


@settings(max_examples=examples(3, 6))
@given(lens=st.lists(st.integers(1, pick(100, 300)), min_size=1, max_size=3), varlen=st.booleans(),
       dtype=dtypes(), seed=seeds())
@example(lens=[5, 17], varlen=True, dtype=P.dtypes[0], seed=1)  # the packed path, whatever the draws
def test_pool_reference_impl_equals_triton(lens, varlen, dtype, seed):
    """``impl="reference"`` over a pool: the same rows written (within the float64 recurrence's tolerance of each
    other's), every other row bitwise untouched, o alike."""
    HV, K, V = 2, pick(16, 128), pick(32, 128)
    x, cu, N = _problem(seed, lens, varlen, HV, K, V, dtype)
    pool = randn((N + 2, HV, K, V), seed + 5, scale=0.5)
    idx = _indices(seed, N, N + 2).to(P.device)
    h0, live = _gathered(pool, idx)
    f64 = [t.double().cpu() for t in x]
    cu_c = cu.cpu() if cu is not None else None
    ro, rht = recurrent_gated_delta_rule_ref(*f64, initial_state=h0.double().cpu(), output_final_state=True,
                                             cu_seqlens=cu_c)
    lo, lht = chunk_gated_delta_rule_ref(*(t.float() for t in f64), initial_state=h0.cpu(), output_final_state=True,
                                         cu_seqlens=cu_c, compute_dtype=dtype if dtype != torch.float32 else None)
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=P.device)
    untouched[idx[live].long()] = False
    for impl in ("triton", "reference"):
        got = pool.clone()
        with torch.no_grad():
            o, none = chunk_gated_delta_rule(*x, initial_state=got, state_indices=idx, cu_seqlens=cu, impl=impl)
        assert none is None and o.dtype == dtype and got.dtype == torch.float32
        assert_close(f"o ({impl})", o, ro, lo, dtype=dtype)
        assert torch.equal(got[untouched], pool[untouched]), f"{impl}: a row not named was touched"
        if live.any():
            lv = live.cpu()
            assert_close(f"pool rows ({impl})", got[idx[live].long()], rht[lv], lht[lv], dtype=dtype)


@pytest.mark.parametrize("varlen,seg", [(False, False), (True, True)])  # the pool in the state pass / in the chain
def test_rows_outside_the_pool_are_never_accessed(monkeypatch, varlen, seg):
    """Device indices are not read on the host: rows ``>= P`` (up to int32's maximum) and negative ones are skipped by
    the kernels as a negative index is (a zero start, no write), without any access outside the pool (under the
    interpreter every address is checked; the pool is a view inside a larger buffer, so its neighbours count as
    outside); a row named by two sequences stays memory-safe (its content is unspecified) and leaves the other
    sequences alone."""
    from addresscheck import AddressCheck

    monkeypatch.setattr(api_mod, "check_pool_rows", lambda *a: None)  # what a device tensor skips
    HV, K, V, Pr = 2, pick(16, 128), pick(32, 128), 3
    lens = [20, 70, 1, 65, 9, 5]
    x, cu, N = _problem(11, lens, varlen, HV, K, V, P.dtypes[0])
    buf = randn((Pr + 2, HV, K, V), 12)
    pool = buf[1:Pr + 1]  # contiguous rows with a guard row on each side
    idx = torch.tensor([Pr, -1, 2**31 - 1, -(2**31), 1, 1], dtype=torch.int32, device=P.device)
    h0, _ = _gathered(pool, torch.where(idx < Pr, idx, -1))
    got = buf.clone()
    with torch.no_grad(), config_override({"gdn_chunk": SEG if seg else {}}):
        o_ref, _ = chunk_gated_delta_rule(*x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        view = got[1:Pr + 1]
        check = AddressCheck(*x, view, idx, cu) if not P.big else contextlib.nullcontext()
        with check:
            o, _ = chunk_gated_delta_rule(*x, initial_state=view, state_indices=idx, cu_seqlens=cu)
    if not P.big:
        check.assert_clean()
    first4 = o[:, :sum(lens[:4])] if varlen else o[:4]  # the sequences that do not share a row
    assert torch.equal(first4, o_ref[:, :sum(lens[:4])] if varlen else o_ref[:4])
    assert torch.isfinite(o).all() and torch.isfinite(got).all()
    keep = [0, 1, 3, 4]  # guard rows, pool rows 0 and 2 (not named by a live index)
    assert torch.equal(got[keep], buf[keep]), "a row other than the named live rows was touched"


def _small_call(T: int, HV: int = 2, K: int = 16, V: int = 16):
    """q (= k) ``[2, T, 1, K]``, v ``[2, T, HV, V]``, g ``[2, T, HV]`` in (-1, 0], beta ``[2, T, HV]``, fp32."""
    d = P.device
    return (torch.randn(2, T, 1, K, device=d), torch.randn(2, T, HV, V, device=d), -torch.rand(2, T, HV, device=d),
            torch.rand(2, T, HV, device=d))


def test_bad_pool_calls_are_refused_and_change_nothing():
    """Every rejected call raises a ValueError / TypeError naming its argument and leaves the pool as it was."""
    d = P.device
    HV, K, V = 2, 16, 16
    q, v, g, beta = _small_call(8)
    pool = torch.randn(4, HV, K, V, device=d)
    before = pool.clone()
    idx = torch.tensor([0, 3], dtype=torch.int32, device=d)
    f = chunk_gated_delta_rule

    def refused(err, match, *, q_=q, pool_=pool, idx_=idx, **kw):
        for impl in ("triton", "reference"):
            with pytest.raises(err, match=match):
                f(q_, q_, v, g, beta, initial_state=pool_, state_indices=idx_, impl=impl, **kw)
        assert torch.equal(pool, before), f"a rejected call ({match}) changed the pool"

    refused(TypeError, "state_indices", idx_=idx.long())
    refused(ValueError, "state_indices", idx_=idx[:1])
    refused(ValueError, "initial_state", pool_=None)
    refused(TypeError, "initial_state", pool_=pool.double())
    refused(ValueError, "initial_state", pool_=torch.zeros(4, HV, K + 16, V, device=d))
    refused(ValueError, "initial_state", pool_=torch.zeros(0, HV, K, V, device=d))
    refused(ValueError, "initial_state", pool_=pool.transpose(-1, -2))
    refused(ValueError, "output_final_state", output_final_state=True)
    refused(ValueError, "inference only", q_=q.clone().requires_grad_())
    refused(ValueError, "inference only", pool_=pool.clone().requires_grad_())
    with torch.no_grad():  # under no_grad an input that requires grad is fine
        f(q.clone().requires_grad_(), q, v, g, beta, initial_state=pool.clone(), state_indices=idx)
    # cu_seqlens stored inside a pool row the call writes: refused (the decode step refuses it too)
    box = pool.clone()
    cu_in_pool = box.view(-1)[:3].view(torch.int32)[:3]
    cu_in_pool.copy_(torch.tensor([0, 5, 8], dtype=torch.int32))
    kept = box.clone()
    for impl in ("triton", "reference"):
        with pytest.raises(ValueError, match="initial_state: shares memory with cu_seqlens"):
            f(q[:1], q[:1], v[:1], g[:1], beta[:1], initial_state=box, state_indices=idx, cu_seqlens=cu_in_pool,
              impl=impl)
        assert torch.equal(box, kept)
    if d == "cpu":  # a CPU index tensor is checked against the pool
        refused(ValueError, r"state_indices: row 4 is outside", idx_=torch.tensor([0, 4], dtype=torch.int32))
        refused(ValueError, "state_indices: pool row 2 is named by more than one",
                idx_=torch.tensor([2, 2], dtype=torch.int32))
        with torch.no_grad():  # two negative indices are not a duplicate
            f(q, q, v, g, beta, initial_state=pool.clone(), state_indices=torch.tensor([-1, -1], dtype=torch.int32))


@pytest.mark.parametrize("varlen", [False, True])
def test_pool_torch_compile(varlen):
    """``torch.compile(fullgraph=True)`` without autograd traces the pooled call (a custom op that mutates the pool)
    and gives bitwise the eager call's o and pool, updating the caller's pool in place."""
    HV, K, V = 2, 16, 32
    x, cu, N = _problem(21, [37, 63] if varlen else [50, 50], varlen, HV, K, V, P.dtypes[0])
    pool = randn((N + 1, HV, K, V), 22)
    idx = torch.tensor([2, 0], dtype=torch.int32, device=P.device)

    def fn(q, k, v, g, beta, pool):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool, state_indices=idx, cu_seqlens=cu,
                                      use_qk_l2norm_in_kernel=True)[0]

    eager_pool, comp_pool = pool.clone(), pool.clone()
    with torch.no_grad():
        eager = fn(*x, eager_pool)
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(*x, comp_pool)
    assert not torch.equal(eager_pool, pool)
    assert torch.equal(eager, compiled), "o: compiled differs from eager"
    assert torch.equal(eager_pool, comp_pool), "pool: compiled differs from eager"


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_inference_mode_pool_outside_inference_mode(impl):
    """A pool made under ``torch.inference_mode()`` and updated outside it: every impl writes it (the kernels write
    raw memory; the reference writes it in inference mode), bit for bit as it writes an ordinary pool."""
    d = P.device
    HV, K, V = 2, 16, 16
    q, v, g, beta = _small_call(70)
    idx = torch.tensor([2, 0], dtype=torch.int32, device=d)
    start = torch.randn(3, HV, K, V, device=d)
    with torch.inference_mode():
        pool = start.clone()
    plain = start.clone()
    with torch.no_grad():
        o, _ = chunk_gated_delta_rule(q, q, v, g, beta, initial_state=pool, state_indices=idx, impl=impl)
        o2, _ = chunk_gated_delta_rule(q, q, v, g, beta, initial_state=plain, state_indices=idx, impl=impl)
    assert torch.equal(o, o2) and torch.equal(pool, plain)
    assert torch.equal(pool[1], start[1]) and not torch.equal(pool[0], start[0])
