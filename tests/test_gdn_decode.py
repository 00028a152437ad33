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
    with pytest.raises(TypeError, match="state"):
        gated_delta_rule_decode(**{**a, "state": a["state"].half()})
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
