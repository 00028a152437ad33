"""Recurrent GDN decode step (ops/gdn/decode.py) vs the float64 recurrence and the chunked op."""

import pytest
import torch
from harness import EPS, P, assert_close, dtypes, examples, gen, pick, rand, randn, rel_err, seeds
from hypothesis import given, settings
from hypothesis import strategies as st

from gqla_triton.ops.gdn.decode import gated_delta_rule_decode, gated_delta_rule_decode_fwd
from gqla_triton.ops.gdn.reference import recurrent_gated_delta_rule_ref

# every buffer the launcher allocates starts NaN-filled: an output element the kernel does not write fails
pytestmark = pytest.mark.usefixtures("poison_buffers")

DIMS = pick([16, 32, 64], [64, 128])
FEW = settings(max_examples=examples(3, 25))  # tests that run the chunked op: slow under the interpreter


def _inputs(B, s, H, HV, K, V, dtype, g):
    q = randn((B, s, H, K), g, dtype=dtype)
    k = randn((B, s, H, K), g, dtype=dtype)
    v = randn((B, s, HV, V), g, dtype=dtype)
    gate = (-rand((B, s, HV), g, lo=0.01, hi=1.0)).float()  # log-space decay
    beta = rand((B, s, HV), g, lo=0.05, hi=1.0).float()
    return q, k, v, gate, beta


def _ref(q, k, v, gate, beta, h0, l2, cdt):
    o, st_ = recurrent_gated_delta_rule_ref(*(t.to("cpu", cdt) for t in (q, k, v, gate, beta)),
                                            initial_state=h0.to("cpu", cdt), output_final_state=True,
                                            use_qk_l2norm=l2)
    return o, st_


@given(B=st.integers(1, pick(3, 48)), s=st.integers(1, pick(3, 4)), H=st.sampled_from(pick([1, 2], [4, 16])),
       G=st.sampled_from([1, 2]), K=st.sampled_from(DIMS), V=st.sampled_from(DIMS), l2=st.booleans(),
       extra=st.integers(0, 3), dtype=dtypes(), seed=seeds())
def test_decode_matches_recurrence_in_pool(B, s, H, G, K, V, l2, extra, dtype, seed):
    """Outputs and updated rows vs float64; rows not indexed stay bitwise unchanged; -1 rows skip (o = 0)."""
    g = gen(seed)
    HV = H * G
    q, k, v, gate, beta = _inputs(B, s, H, HV, K, V, dtype, g)
    if not l2:
        q, k = q * K**-0.5, k * K**-0.5  # keep the unnormalised recurrence in a sane range
    Pn = B + extra
    pool = randn((Pn, HV, K, V), g, scale=0.5)
    idx = torch.randperm(Pn, generator=g)[:B].to(torch.int32)
    skip = torch.rand(B, generator=g) < 0.25
    idx[skip] = -1 - torch.randint(0, 5, (int(skip.sum()),), generator=g).to(torch.int32)
    before = pool.clone()
    idx_d = idx.to(P.device)
    o = gated_delta_rule_decode(q, k, v, gate, beta, pool, idx_d, use_qk_l2norm_in_kernel=l2)

    live = (~skip).nonzero().flatten()
    rows = idx[live].long()
    touched = torch.zeros(Pn, dtype=torch.bool)
    touched[rows] = True
    assert torch.equal(pool[~touched.to(P.device)].cpu(), before[~touched.to(P.device)].cpu())
    assert torch.equal(o[skip.to(P.device)].cpu(), torch.zeros_like(o[skip.to(P.device)].cpu()))
    if len(live) == 0:
        return
    sel = [t[live.to(P.device)] for t in (q, k, v, gate, beta)]
    o64, s64 = _ref(*sel, before[rows.to(P.device)], l2, torch.float64)
    o32, s32 = _ref(*sel, before[rows.to(P.device)], l2, torch.float32)
    assert_close("o", o[live.to(P.device)], o64, o32.to(dtype), dtype=dtype)
    assert_close("state", pool[rows.to(P.device)], s64, s32, dtype=torch.float32)


@given(B=st.integers(1, pick(2, 16)), s=st.integers(2, 4), K=st.sampled_from(DIMS), V=st.sampled_from(DIMS),
       seed=seeds())
def test_multi_token_equals_single_steps(B, s, K, V, seed):
    """One call with s tokens == s calls with one token each (outputs and state)."""
    g = gen(seed)
    H, HV = 2, 4
    q, k, v, gate, beta = _inputs(B, s, H, HV, K, V, torch.float32, g)
    pool = randn((B, HV, K, V), g, scale=0.5)
    pool1 = pool.clone()
    o = gated_delta_rule_decode(q, k, v, gate, beta, pool, use_qk_l2norm_in_kernel=True)
    outs = [gated_delta_rule_decode(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], gate[:, t:t + 1],
                                    beta[:, t:t + 1], pool1, use_qk_l2norm_in_kernel=True) for t in range(s)]
    torch.testing.assert_close(o, torch.cat(outs, 1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool, pool1, rtol=1e-5, atol=1e-6)


@FEW
@given(B=st.integers(1, pick(2, 8)), s=st.integers(1, pick(3, 8)), G=st.sampled_from([1, 2]),
       K=st.sampled_from(pick([16, 32], [128])), V=st.sampled_from(pick([16, 32], [128])), l2=st.booleans(),
       dtype=dtypes(), seed=seeds())
def test_decode_equals_chunk_op(B, s, G, K, V, l2, dtype, seed):
    """Decoding s tokens from a state == the chunked op on the same tokens (outputs and final state)."""
    from gqla_triton.ops.gdn import chunk_gated_delta_rule

    g = gen(seed)
    H = 2
    HV = H * G
    q, k, v, gate, beta = _inputs(B, s, H, HV, K, V, dtype, g)
    if not l2:
        q, k = q * K**-0.5, k * K**-0.5
    h0 = randn((B, HV, K, V), g, scale=0.5)
    oc, sc = chunk_gated_delta_rule(q, k, v, gate, beta, initial_state=h0, output_final_state=True,
                                    use_qk_l2norm_in_kernel=l2)
    pool = h0.clone()
    od = gated_delta_rule_decode(q, k, v, gate, beta, pool, use_qk_l2norm_in_kernel=l2)
    o64, s64 = _ref(q, k, v, gate, beta, h0, l2, torch.float64)
    o32, s32 = _ref(q, k, v, gate, beta, h0, l2, torch.float32)
    # the chunk op rounds its intermediates (w, u, states as dot operands) to the input dtype: allow one
    # rounding unit of that dtype on top of the torch low-precision error
    e_low_o = rel_err(o32.to(dtype), o64)
    e_low_s = rel_err(s32, s64)
    assert rel_err(od, oc) <= 4 * e_low_o + EPS[dtype], (rel_err(od, oc), e_low_o)
    assert rel_err(pool, sc) <= 4 * e_low_s + EPS[dtype], (rel_err(pool, sc), e_low_s)
    assert_close("o", od, o64, o32.to(dtype), dtype=dtype)


def _small(device=None, dtype=torch.float32, B=2, s=1, H=2, HV=4, K=16, V=16, Pn=3):
    device = device or P.device
    z = lambda *sh, dt=dtype: torch.zeros(*sh, dtype=dt, device=device)  # noqa: E731
    return dict(q=z(B, s, H, K), k=z(B, s, H, K), v=z(B, s, HV, V), g=z(B, s, HV), beta=z(B, s, HV),
                state=z(Pn, HV, K, V, dt=torch.float32))


def test_decode_bad_inputs():
    a = _small()
    for bad, err in (("0.25", TypeError), (False, TypeError), (float("inf"), ValueError), (-1e39, ValueError)):
        with pytest.raises(err, match="scale"):
            gated_delta_rule_decode(**a, scale=bad)
    with pytest.raises(TypeError, match="state"):
        gated_delta_rule_decode(**{**a, "state": a["state"].double()})
    with pytest.raises(TypeError, match="state"):
        gated_delta_rule_decode(**{**a, "state": a["state"].int()}, impl="reference")
    with pytest.raises(ValueError, match="HV"):
        b = _small(H=3, HV=4)
        gated_delta_rule_decode(**b)
    with pytest.raises(ValueError, match="state"):
        gated_delta_rule_decode(**{**a, "state": torch.zeros(3, 4, 16, 8, device=P.device)})
    with pytest.raises(ValueError, match="beta"):
        gated_delta_rule_decode(**{**a, "beta": a["beta"][:, :, :2]})
    with pytest.raises(TypeError, match="state_indices"):
        gated_delta_rule_decode(**a, state_indices=torch.zeros(2, dtype=torch.int64, device=P.device))
    with pytest.raises(ValueError, match="state_indices"):
        gated_delta_rule_decode(**a, state_indices=torch.zeros(3, dtype=torch.int32, device=P.device))
    with pytest.raises(ValueError, match="state"):  # default indices need P >= B
        b = _small(Pn=1)
        gated_delta_rule_decode(**b)
    with pytest.raises(ValueError, match="impl"):
        gated_delta_rule_decode(**a, impl="gluon")
    with pytest.raises(ValueError, match="impl"):
        gated_delta_rule_decode(**a, impl="cuda")
    with pytest.raises(ValueError, match="HV"):  # validation comes before the choice of implementation
        gated_delta_rule_decode(**_small(H=3, HV=4), impl="reference")


def test_decode_bfloat16_under_the_interpreter():
    """bfloat16 inputs raise a TypeError under the interpreter (it computes bf16 wrongly, triton#11584) and leave
    the pool untouched; the reference implementation takes them."""
    a = _small(dtype=torch.bfloat16)
    a["state"].normal_()
    a["beta"].fill_(0.5)
    a["k"].fill_(0.25)
    before = a["state"].clone()
    if not P.big:
        with pytest.raises(TypeError, match="bfloat16"):
            gated_delta_rule_decode(**a)
        assert torch.equal(a["state"], before)
    else:
        assert gated_delta_rule_decode(**a).dtype == torch.bfloat16
    assert gated_delta_rule_decode(**{**a, "state": before}, impl="reference").dtype == torch.bfloat16


def test_inference_mode_pool_outside_inference_mode():
    """A state pool and intermediate-state buffer made under ``torch.inference_mode()``, stepped outside it: both
    impls write them (the kernel writes raw memory; the reference writes in inference mode), with the same results."""
    g = gen(3)
    B, s, H, HV, K, V = 2, 3, 1, 2, 16, 16
    q, k, v, gate, beta = _inputs(B, s, H, HV, K, V, torch.float32, g)
    idx = torch.tensor([2, 0], dtype=torch.int32, device=P.device)
    start = randn((3, HV, K, V), g, scale=0.5)
    got = {}
    for impl in ("triton", "reference"):
        with torch.inference_mode():
            pool, inter = start.clone(), torch.zeros(B, s, HV, K, V, device=P.device)
        o = gated_delta_rule_decode(q, k, v, gate, beta, pool, idx, use_qk_l2norm_in_kernel=True,
                                    intermediate_states=inter, impl=impl)
        got[impl] = (o, pool, inter)
    for a, b in zip(got["triton"], got["reference"], strict=True):
        assert_close("decode", a, b.double(), dtype=torch.float32)
    assert torch.equal(got["reference"][1][1], start[1])


@settings(max_examples=examples(3, 12))
@given(B=st.integers(1, pick(3, 16)), s=st.integers(1, 3), G=st.sampled_from([1, 2]), K=st.sampled_from(DIMS),
       V=st.sampled_from(DIMS), l2=st.booleans(), dtype=dtypes(), seed=seeds())
def test_decode_reference_impl_equals_triton(B, s, G, K, V, l2, dtype, seed):
    """``impl="reference"`` and ``impl="triton"``: the same outputs and in-place pool updates (skipped rows: o = 0,
    pool rows untouched), both within the usual tolerance of the float64 recurrence."""
    g = gen(seed)
    H = 2
    HV = H * G
    q, k, v, gate, beta = _inputs(B, s, H, HV, K, V, dtype, g)
    if not l2:
        q, k = q * K**-0.5, k * K**-0.5
    Pn = B + 2
    pool = randn((Pn, HV, K, V), g, scale=0.5)
    idx = torch.randperm(Pn, generator=g)[:B].to(torch.int32)
    idx[torch.rand(B, generator=g) < 0.25] = -1
    live = (idx >= 0).nonzero().flatten()
    rows = idx[live].long()
    before = pool.clone()
    pools, outs = {}, {}
    for impl in ("triton", "reference"):
        pools[impl] = before.clone()
        outs[impl] = gated_delta_rule_decode(q, k, v, gate, beta, pools[impl], idx.to(P.device),
                                             use_qk_l2norm_in_kernel=l2, impl=impl)
        assert outs[impl].dtype == dtype
    untouched = torch.ones(Pn, dtype=torch.bool)
    untouched[rows] = False
    for impl in ("triton", "reference"):
        assert torch.equal(pools[impl][untouched.to(P.device)].cpu(), before[untouched.to(P.device)].cpu())
        assert torch.equal(outs[impl][(idx < 0).to(P.device)].cpu(),
                           torch.zeros_like(outs[impl][(idx < 0).to(P.device)].cpu()))
    if len(live) == 0:
        return
    sel = [t[live.to(P.device)] for t in (q, k, v, gate, beta)]
    o64, s64 = _ref(*sel, before[rows.to(P.device)], l2, torch.float64)
    o32, s32 = _ref(*sel, before[rows.to(P.device)], l2, torch.float32)
    for impl in ("triton", "reference"):
        assert_close(f"o ({impl})", outs[impl][live.to(P.device)], o64, o32.to(dtype), dtype=dtype)
        assert_close(f"state ({impl})", pools[impl][rows.to(P.device)], s64, s32, dtype=torch.float32)


@pytest.mark.skipif(P.device != "cpu", reason="host check applies to CPU index tensors")
def test_decode_out_of_pool_index_raises_on_host():
    a = _small()
    with pytest.raises(ValueError, match="state_indices"):
        gated_delta_rule_decode(**a, state_indices=torch.tensor([0, 3], dtype=torch.int32))


@pytest.mark.skipif(P.device != "cpu", reason="host check applies to CPU index tensors")
def test_decode_pool_row_named_twice_raises_on_host():
    """Two sequences naming one pool row would update it in place at once: refused on the host, the pool left as it
    was; negative entries (sequences skipped) may repeat."""
    a = _small(B=3)
    a["q"].normal_()
    a["k"].normal_()
    a["v"].normal_()
    a["beta"].fill_(0.5)
    a["state"].normal_()
    before = a["state"].clone()
    with pytest.raises(ValueError, match="state_indices: pool row 1 is named by more than one sequence"):
        gated_delta_rule_decode(**a, state_indices=torch.tensor([1, 0, 1], dtype=torch.int32))
    assert torch.equal(a["state"], before)
    o = gated_delta_rule_decode(**a, state_indices=torch.tensor([-1, 0, -1], dtype=torch.int32))
    assert not o[0].any() and not o[2].any() and o[1].any()
    assert torch.equal(a["state"][1:], before[1:]) and not torch.equal(a["state"][0], before[0])


def test_decode_out_of_pool_index_on_device_is_skipped():
    """On the device an index >= P is never accessed: treated as skipped (o = 0, pool unchanged)."""
    g = gen(7)
    q, k, v, gate, beta = _inputs(2, 1, 2, 4, 16, 16, torch.float32, g)
    pool = randn((3, 4, 16, 16), g)
    before = pool.clone()
    idx = torch.tensor([1, 3], dtype=torch.int32, device=P.device)
    if P.device == "cpu":  # bypass the host check to exercise the kernel's own guard
        o = gated_delta_rule_decode_fwd(q, k, v, gate, beta, pool, idx, 0.25, False)
    else:
        o = gated_delta_rule_decode(q, k, v, gate, beta, pool, idx)
    assert torch.equal(o[1].cpu(), torch.zeros(1, 4, 16))
    assert torch.equal(pool[[0, 2]].cpu(), before[[0, 2]].cpu())
    assert not torch.equal(pool[1].cpu(), before[1].cpu())


@pytest.mark.gpu_only
def test_decode_torch_compile():
    g = gen(3)
    B, H, HV, K, V = 4, 4, 8, 128, 128
    q, k, v, gate, beta = _inputs(B, 1, H, HV, K, V, torch.bfloat16, g)
    pool = randn((6, HV, K, V), g, scale=0.5)
    pool2 = pool.clone()
    idx = torch.tensor([5, 0, -1, 2], dtype=torch.int32, device=P.device)

    def f(q, k, v, gate, beta, pool, idx):
        return gated_delta_rule_decode(q, k, v, gate, beta, pool, idx, use_qk_l2norm_in_kernel=True) * 2

    o = torch.compile(f, fullgraph=True)(q, k, v, gate, beta, pool, idx)
    o_ref = f(q, k, v, gate, beta, pool2, idx)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(pool, pool2)


# ------------------------------------------------------------------ speculative verification and packed sequences
def _ref_steps(q, k, v, gate, beta, h0, l2, cdt):
    """The recurrence token by token on the CPU in ``cdt``: ``(o [B, s, HV, V], states [B, s + 1, HV, K, V])``,
    ``states[:, t]`` being the state after the first t tokens (``states[:, 0] = h0``)."""
    q, k, v, gate, beta, h = (t.to("cpu", cdt) for t in (q, k, v, gate, beta, h0))
    outs, states = [], [h]
    for t in range(q.shape[1]):
        sl = slice(t, t + 1)
        o, h = recurrent_gated_delta_rule_ref(q[:, sl], k[:, sl], v[:, sl], gate[:, sl], beta[:, sl],
                                              initial_state=h, output_final_state=True, use_qk_l2norm=l2)
        outs.append(o)
        states.append(h)
    return torch.cat(outs, 1), torch.stack(states, 1)


def _dev(t):
    return t.to(P.device) if t is not None else None


@settings(max_examples=examples(4, 12))
@given(B=st.integers(1, pick(4, 32)), s=st.integers(1, 4), G=st.sampled_from([1, 2]), K=st.sampled_from(DIMS),
       V=st.sampled_from(DIMS), l2=st.booleans(), dtype=dtypes(), seed=seeds())
def test_decode_accepted_commits_the_accepted_prefix(B, s, G, K, V, l2, dtype, seed):
    """``accepted``: the outputs of all s tokens are those of a plain step; each row holds the state after its first
    ``clamp(accepted, 0, s)`` tokens (float64 recurrence), which equals decoding only those tokens; a row with 0
    accepted and every row not indexed stay bitwise unchanged."""
    g = gen(seed)
    H = 2
    HV = H * G
    q, k, v, gate, beta = _inputs(B, s, H, HV, K, V, dtype, g)
    if not l2:
        q, k = q * K**-0.5, k * K**-0.5
    Pn = B + 2
    pool = randn((Pn, HV, K, V), g, scale=0.5)
    idx = torch.randperm(Pn, generator=g)[:B].to(torch.int32)
    acc = torch.randint(-2, s + 3, (B,), generator=g).to(torch.int32)
    before = pool.clone()
    o = gated_delta_rule_decode(q, k, v, gate, beta, pool, _dev(idx), accepted=_dev(acc), use_qk_l2norm_in_kernel=l2)
    o_plain = gated_delta_rule_decode(q, k, v, gate, beta, before.clone(), _dev(idx), use_qk_l2norm_in_kernel=l2)
    torch.testing.assert_close(o, o_plain)

    rows = idx.long()
    n_acc = acc.long().clamp(0, s)
    o64, st64 = _ref_steps(q, k, v, gate, beta, before[_dev(rows)], l2, torch.float64)
    o32, st32 = _ref_steps(q, k, v, gate, beta, before[_dev(rows)], l2, torch.float32)
    assert_close("o", o, o64, o32.to(dtype), dtype=dtype)
    b = torch.arange(B)
    assert_close("committed state", pool[_dev(rows)], st64[b, n_acc], st32[b, n_acc], dtype=torch.float32)
    same = torch.ones(Pn, dtype=torch.bool)
    same[rows[n_acc > 0]] = False
    assert torch.equal(pool[_dev(same)].cpu(), before[_dev(same)].cpu())
    for a in sorted(set(n_acc.tolist()) - {0}):  # the same rows decoding only their first a tokens
        sel = _dev((n_acc == a).nonzero().flatten())
        alone = before.clone()
        gated_delta_rule_decode(q[sel, :a], k[sel, :a], v[sel, :a], gate[sel, :a], beta[sel, :a], alone,
                                _dev(idx)[sel], use_qk_l2norm_in_kernel=l2)
        r = _dev(rows)[sel]
        torch.testing.assert_close(pool[r], alone[r], rtol=1e-6, atol=1e-6)


@settings(max_examples=examples(4, 12))
@given(B=st.integers(1, pick(3, 16)), s=st.integers(1, 4), G=st.sampled_from([1, 2]), K=st.sampled_from(DIMS),
       V=st.sampled_from(DIMS), with_acc=st.booleans(), dtype=dtypes(), seed=seeds())
def test_decode_intermediate_states(B, s, G, K, V, with_acc, dtype, seed):
    """``intermediate_states[b, t]`` is the state after the first t + 1 tokens (float64 recurrence); entries of
    skipped sequences keep the caller's values (NaN here); without ``accepted`` the pool row is the last one."""
    g = gen(seed)
    H = 2
    HV = H * G
    q, k, v, gate, beta = _inputs(B, s, H, HV, K, V, dtype, g)
    Pn = B + 1
    pool = randn((Pn, HV, K, V), g, scale=0.5)
    idx = torch.randperm(Pn, generator=g)[:B].to(torch.int32)
    skip = torch.rand(B, generator=g) < 0.3
    idx[skip] = -1
    acc = torch.randint(0, s + 1, (B,), generator=g).to(torch.int32) if with_acc else None
    inter = torch.full((B, s, HV, K, V), float("nan"), device=P.device)
    before = pool.clone()
    gated_delta_rule_decode(q, k, v, gate, beta, pool, _dev(idx), use_qk_l2norm_in_kernel=True, accepted=_dev(acc),
                            intermediate_states=inter)
    assert torch.isnan(inter[_dev(skip)]).all()
    live = (~skip).nonzero().flatten()
    if not len(live):
        return
    rows = idx[live].long()
    sel = [t[_dev(live)] for t in (q, k, v, gate, beta)]
    _, st64 = _ref_steps(*sel, before[_dev(rows)], True, torch.float64)
    _, st32 = _ref_steps(*sel, before[_dev(rows)], True, torch.float32)
    assert_close("intermediate states", inter[_dev(live)], st64[:, 1:], st32[:, 1:], dtype=torch.float32)
    if acc is None:
        assert torch.equal(pool[_dev(rows)], inter[_dev(live), -1])
    else:
        a = acc[live].long()
        last = inter[_dev(live), _dev((a - 1).clamp(min=0))]
        want = torch.where(_dev(a > 0)[:, None, None, None], last, before[_dev(rows)])
        assert torch.equal(pool[_dev(rows)], want)


@settings(max_examples=examples(5, 12))
@given(lens=st.lists(st.integers(0, 3), min_size=1, max_size=pick(4, 24)), pad=st.integers(0, 2),
       G=st.sampled_from([1, 2]), K=st.sampled_from(DIMS), V=st.sampled_from(DIMS), with_acc=st.booleans(),
       with_inter=st.booleans(), dtype=dtypes(), seed=seeds())
def test_decode_varlen_equals_per_sequence_loop(lens, pad, G, K, V, with_acc, with_inter, dtype, seed):
    """``cu_seqlens`` (ragged counts, 0 allowed, padding tokens after the last sequence) == one call per sequence
    (outputs, pool, intermediate states, accepted), and the float64 recurrence; padding tokens output 0."""
    g = gen(seed)
    H = 2
    HV = H * G
    N, used = len(lens), sum(lens)
    T = used + max(pad, 1 if used == 0 else 0)
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    q, k, v, gate, beta = _inputs(1, T, H, HV, K, V, dtype, g)
    Pn = N + 1
    pool = randn((Pn, HV, K, V), g, scale=0.5)
    idx = torch.randperm(Pn, generator=g)[:N].to(torch.int32)
    idx[torch.rand(N, generator=g) < 0.25] = -1
    acc = torch.randint(-1, 5, (N,), generator=g).to(torch.int32) if with_acc else None
    inter = torch.full((T, HV, K, V), float("nan"), device=P.device) if with_inter else None
    before = pool.clone()
    o = gated_delta_rule_decode(q, k, v, gate, beta, pool, _dev(idx), use_qk_l2norm_in_kernel=True,
                                cu_seqlens=_dev(cu), accepted=_dev(acc), intermediate_states=inter)
    assert torch.equal(o[:, used:].cpu(), torch.zeros_like(o[:, used:].cpu()))
    loop = before.clone()
    for n in range(N):
        a, b = int(cu[n]), int(cu[n + 1])
        if a == b:
            continue
        tok = [t[:, a:b] for t in (q, k, v, gate, beta)]
        it = torch.full((1, b - a, HV, K, V), float("nan"), device=P.device) if with_inter else None
        o_n = gated_delta_rule_decode(*tok, loop, _dev(idx[n:n + 1]), use_qk_l2norm_in_kernel=True,
                                      accepted=_dev(acc[n:n + 1]) if with_acc else None, intermediate_states=it)
        torch.testing.assert_close(o[:, a:b], o_n, rtol=1e-6, atol=1e-6)
        if with_inter:
            torch.testing.assert_close(inter[a:b], it[0], rtol=1e-6, atol=1e-6, equal_nan=True)
        if idx[n] >= 0:
            o64, st64 = _ref_steps(*tok, before[int(idx[n])][None], True, torch.float64)
            o32, _ = _ref_steps(*tok, before[int(idx[n])][None], True, torch.float32)
            assert_close(f"o (sequence {n})", o[:, a:b], o64, o32.to(dtype), dtype=dtype)
    torch.testing.assert_close(pool, loop, rtol=1e-6, atol=1e-6)
    if with_inter:
        assert torch.isnan(inter[used:]).all()


@settings(max_examples=examples(4, 8))
@given(varlen=st.booleans(), with_acc=st.booleans(), with_inter=st.booleans(), G=st.sampled_from([1, 2]),
       K=st.sampled_from(DIMS), V=st.sampled_from(DIMS), dtype=dtypes(), seed=seeds())
def test_decode_options_reference_impl_equals_triton(varlen, with_acc, with_inter, G, K, V, dtype, seed):
    """``impl="reference"`` takes every option with the kernel's conventions: same outputs, pool and intermediate
    states as ``impl="triton"``."""
    g = gen(seed)
    H, HV = 2, 2 * G
    if varlen:
        cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
        B, s, N = 1, 6, 3
    else:
        cu, B, s = None, 3, 3
        N = B
    q, k, v, gate, beta = _inputs(B, s, H, HV, K, V, dtype, g)
    pool = randn((N + 1, HV, K, V), g, scale=0.5)
    idx = torch.randperm(N + 1, generator=g)[:N].to(torch.int32)
    idx[int(torch.randint(0, N, (1,), generator=g))] = -1
    acc = _dev(torch.randint(-1, 5, (N,), generator=g).to(torch.int32)) if with_acc else None
    shape = (s, HV, K, V) if varlen else (B, s, HV, K, V)
    res = {}
    for impl in ("triton", "reference"):
        p = pool.clone()
        it = torch.full(shape, float("nan"), device=P.device) if with_inter else None
        o = gated_delta_rule_decode(q, k, v, gate, beta, p, _dev(idx), use_qk_l2norm_in_kernel=True,
                                    cu_seqlens=_dev(cu), accepted=acc, intermediate_states=it, impl=impl)
        res[impl] = (o, p, it)
    (o_t, p_t, i_t), (o_r, p_r, i_r) = res["triton"], res["reference"]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(o_t, o_r, **tol)
    torch.testing.assert_close(p_t, p_r, rtol=1e-5, atol=1e-5)
    if with_inter:
        torch.testing.assert_close(i_t, i_r, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.skipif(P.device != "cpu", reason="interpreter address check")
def test_decode_malformed_device_indices_stay_in_bounds():
    """cu_seqlens, accepted and state_indices values the host never checks (negative, past T or P, decreasing)
    cause no access outside the tensors the call is given or creates (interpreter address check)."""
    from addresscheck import AddressCheck

    g = gen(5)
    T, H, HV, K, V = 5, 1, 2, 16, 16
    q, k, v, gate, beta = _inputs(1, T, H, HV, K, V, torch.float32, g)
    pool = randn((3, HV, K, V), g)
    inter = torch.zeros(T, HV, K, V)
    for cu in ([-4, 9, 2, 100, 3], [3, 1, 1, 7, -1], [0, 2, 5, 5, 5]):
        cu = torch.tensor(cu, dtype=torch.int32)
        idx = torch.tensor([0, 7, -3, 2], dtype=torch.int32)
        acc = torch.tensor([-5, 100, 2, 1], dtype=torch.int32)
        with AddressCheck(q, k, v, gate, beta, pool, idx, cu, acc, inter) as ac:
            o = gated_delta_rule_decode_fwd(q, k, v, gate, beta, pool, idx, 0.25, True, cu, acc, inter)
        ac.assert_clean()
        assert torch.isfinite(o).all() and torch.isfinite(pool).all()


@pytest.mark.skipif(P.device != "cpu", reason="launcher values a GPU tensor would carry, on the interpreter")
def test_decode_decreasing_cu_seqlens_give_no_token_two_sequences():
    """cu_seqlens values the host never checks (a GPU tensor's): each bound is clamped to ``[0, T]`` and to the
    largest bound before it, as the chunked op's plan takes them, so no two sequences own one token (their programs
    would race on its output): the step equals the one over those bounds, output and pool bit for bit."""
    g = gen(6)
    T, H, HV, K, V = 9, 1, 2, 16, 16
    q, k, v, gate, beta = _inputs(1, T, H, HV, K, V, torch.float32, g)
    pool = randn((5, HV, K, V), g)
    idx = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    for cu in ([0, 5, 3, 8, 6], [-2, 4, 1, 12, 2], [3, 1, 1, 7, 0]):
        bounds, top = [], 0
        for i, c in enumerate(cu):
            top = max(top, min(max(c, 0), T)) if i else min(max(c, 0), T)
            bounds.append(top)
        runs = []
        for c in (cu, bounds):
            p = pool.clone()
            o = gated_delta_rule_decode_fwd(q, k, v, gate, beta, p, idx, 0.25, True, torch.tensor(c, dtype=torch.int32))
            runs.append((o, p))
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]), cu


def test_decode_option_bad_inputs_change_nothing():
    a = _small(B=2, s=2)
    a["state"].normal_()
    before = a["state"].clone()
    dev = P.device
    i32 = dict(dtype=torch.int32, device=dev)
    packed = _small(B=1, s=4)
    packed["state"] = a["state"]
    cases = [
        (ValueError, "cu_seqlens", dict(a, cu_seqlens=torch.tensor([0, 1, 2], **i32))),  # B != 1
        (TypeError, "cu_seqlens", dict(packed, cu_seqlens=torch.tensor([0, 4], dtype=torch.float32, device=dev))),
        (ValueError, "cu_seqlens", dict(packed, cu_seqlens=torch.tensor([4], **i32))),
        (ValueError, "state_indices", dict(packed, cu_seqlens=torch.tensor([0, 2, 4], **i32),
                                           state_indices=torch.tensor([0], **i32))),
        (ValueError, "accepted", dict(a, accepted=torch.tensor([1], **i32))),
        (TypeError, "accepted", dict(a, accepted=torch.tensor([1, 1], dtype=torch.int64, device=dev))),
        (ValueError, "intermediate_states", dict(a, intermediate_states=torch.zeros(2, 1, 4, 16, 16, device=dev))),
        (TypeError, "intermediate_states", dict(a, intermediate_states=torch.zeros(2, 2, 4, 16, 16, device=dev,
                                                                                    dtype=torch.float16))),
        (ValueError, "intermediate_states", dict(a, intermediate_states=torch.zeros(2, 2, 4, 16, 16, device=dev)
                                                 .transpose(3, 4))),
        (ValueError, "intermediate_states", dict(packed, cu_seqlens=torch.tensor([0, 4], **i32),
                                                 intermediate_states=torch.zeros(1, 4, 4, 16, 16, device=dev))),
    ]
    if dev == "cpu":  # a CPU cu_seqlens is checked on the host
        cases += [(ValueError, "cu_seqlens", dict(packed, cu_seqlens=torch.tensor([0, 3, 2], **i32))),
                  (ValueError, "cu_seqlens", dict(packed, cu_seqlens=torch.tensor([0, 5], **i32))),
                  (ValueError, "cu_seqlens", dict(packed, cu_seqlens=torch.tensor([-1, 2], **i32)))]
    for impl in ("triton", "reference"):
        for exc, match, kw in cases:
            with pytest.raises(exc, match=match):
                gated_delta_rule_decode(**kw, impl=impl)
            assert torch.equal(a["state"], before), (match, kw.keys())


def test_decode_is_forward_only():
    """Inputs requiring grad under autograd: a RuntimeError that names the op and chunk_gated_delta_rule, before
    the pool changes; under no_grad the same call runs."""
    a = _small()
    a["state"].normal_()
    before = a["state"].clone()
    for name in ("q", "v", "g", "beta"):
        b = dict(a, **{name: a[name].clone().requires_grad_(True)})
        for impl in ("triton", "reference"):
            with pytest.raises(RuntimeError, match=r"gated_delta_rule_decode is forward-only.*chunk_gated_delta_rule"):
                gated_delta_rule_decode(**b, impl=impl)
            assert torch.equal(a["state"], before)
        with torch.no_grad():
            gated_delta_rule_decode(**b)


def test_decode_options_torch_compile_aot_eager():
    """The custom op with every option under ``torch.compile(fullgraph=True)`` equals the eager call."""
    g = gen(9)
    H, HV, K, V = 1, 2, 16, 16
    q, k, v, gate, beta = _inputs(1, 5, H, HV, K, V, torch.float32, g)
    pool = randn((4, HV, K, V), g, scale=0.5)
    dev = P.device
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32, device=dev)
    idx = torch.tensor([3, 0, -1], dtype=torch.int32, device=dev)
    acc = torch.tensor([1, 0, 2], dtype=torch.int32, device=dev)

    def f(q, k, v, gate, beta, pool, inter):
        return gated_delta_rule_decode(q, k, v, gate, beta, pool, idx, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                       accepted=acc, intermediate_states=inter) * 2

    pools = [pool.clone(), pool.clone()]
    inters = [torch.zeros(5, HV, K, V, device=dev), torch.zeros(5, HV, K, V, device=dev)]
    o1 = torch.compile(f, fullgraph=True, backend="aot_eager" if dev == "cpu" else "inductor")(
        q, k, v, gate, beta, pools[0], inters[0])
    o2 = f(q, k, v, gate, beta, pools[1], inters[1])
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(pools[0], pools[1])
    torch.testing.assert_close(inters[0], inters[1])


def test_programs_past_a_launch_are_refused():
    """A step whose (sequence x value head x V block) programs pass one launch's 2^31 - 1 (65537 packed sequences,
    most of them empty, of 32768 value heads): a ValueError naming them, the pool unchanged."""
    HV, N = 32768, 65537
    q = torch.zeros(1, 1, 1, 16, device=P.device)
    v = torch.zeros(1, 1, HV, 16, device=P.device)
    g = torch.zeros(1, 1, HV, device=P.device)
    pool = torch.zeros(1, HV, 16, 16, device=P.device)
    idx = torch.full((N,), -1, dtype=torch.int32, device=P.device)
    cu = torch.tensor([0] * N + [1], dtype=torch.int32, device=P.device)
    with pytest.raises(ValueError, match="65537 sequences x 32768 value heads .* more than one launch takes"):
        gated_delta_rule_decode(q, q, v, g, g, pool, idx, cu_seqlens=cu)
    assert not pool.any()
