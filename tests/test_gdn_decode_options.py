"""fla / serving options of the GDN decode step (ops/gdn/decode.py): the in-kernel gate, beta sigmoid, negative
eigenvalues, V-first state layout, half-precision pools and mixed input dtypes, against a float64 recurrence that
applies the same formulas in torch."""

import math

import pytest
import torch
from harness import P, assert_close, examples, gen, pick, rand, randn, rel_err, seeds
from hypothesis import given, settings
from hypothesis import strategies as st

from gqla_triton.ops.gdn.decode import gated_delta_rule_decode, gated_delta_rule_decode_fwd

pytestmark = pytest.mark.usefixtures("poison_buffers")

DIMS = pick([16, 24], [64, 128])
IN_DTYPES = pick([torch.float32, torch.float16], [torch.bfloat16, torch.float16, torch.float32])
POOL_DTYPES = pick([torch.float32, torch.float16], [torch.float32, torch.bfloat16, torch.float16])


def _softplus64(x):
    return torch.where(x > 20, x, torch.log1p(torch.exp(x.clamp(max=20))))


def _ref64(q, k, v, a, b, pool, idx, cu, acc, *, scale, A_log, dt_bias, gate, sig, neg, vk):
    """float64 recurrence with the options' formulas. Returns o, the pool after the step (float64, pool layout,
    committed rows only) and the state after every token (``[B, s, HV, ...]`` / ``[T, HV, ...]``, NaN where the
    kernel writes nothing)."""
    q, k, v, a, b = (t.detach().cpu().double() for t in (q, k, v, a, b))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    B, S, H, K = q.shape
    HV, V = v.shape[2:]
    q, k = q.repeat_interleave(HV // H, 2), k.repeat_interleave(HV // H, 2)
    if gate:
        x = a + (dt_bias.cpu().double() if dt_bias is not None else 0.0)
        g = -torch.exp(A_log.cpu().double()) * _softplus64(x)
    else:
        g = a
    beta = torch.sigmoid(b) if sig else b
    beta = beta * 2 if neg else beta
    pool64 = pool.detach().cpu().double().clone()
    rows = pool64.transpose(-1, -2) if vk else pool64  # [P, HV, K, V] view
    o = torch.zeros(B, S, HV, V, dtype=torch.float64)
    inter = torch.full((B, S, HV, K, V), math.nan, dtype=torch.float64)
    seqs = [(0, lo, hi) for lo, hi in zip(cu[:-1], cu[1:], strict=True)] if cu is not None else \
        [(i, 0, S) for i in range(B)]
    for n, (bi, lo, hi) in enumerate(seqs):
        row = idx[n]
        if not 0 <= row < pool.shape[0] or hi == lo:
            continue
        n_acc = min(max(acc[n], 0), hi - lo) if acc is not None else hi - lo
        h = rows[row].clone()
        for t in range(lo, hi):
            h = h * torch.exp(g[bi, t])[:, None, None]
            u = beta[bi, t][:, None] * (v[bi, t] - torch.einsum("hk,hkv->hv", k[bi, t], h))
            h = h + k[bi, t][:, :, None] * u[:, None, :]
            o[bi, t] = scale * torch.einsum("hk,hkv->hv", q[bi, t], h)
            inter[bi, t] = h
            if t + 1 - lo == n_acc:
                rows[row] = h
    inter = inter.transpose(-1, -2) if vk else inter
    return o, pool64, (inter[0] if cu is not None else inter)


def _case(g, *, B, s, H, HV, K, V, qdt, vdt, pdt, gate, dtb, sig, neg, vk, varlen, accept, inter):
    """Inputs of one call (on the profile's device) and the host index lists."""
    q = randn((B, s, H, K), g, dtype=qdt)
    k = randn((B, s, H, K), g, dtype=qdt)
    v = randn((B, s, HV, V), g, dtype=vdt)
    if gate:
        a = randn((B, s, HV), g, scale=4.0)
        a.view(-1)[::5] = 60.0  # far above the softplus threshold: g = -exp(A_log)·a, no overflow
        a.view(-1)[1::7] = -40.0
        A_log = rand((HV,), g, lo=-6.0, hi=0.5)
        dt_bias = randn((HV,), g) if dtb else None
    else:
        a, A_log, dt_bias = -rand((B, s, HV), g, lo=0.01, hi=1.0), None, None
    b = randn((B, s, HV), g, scale=2.0) if sig else rand((B, s, HV), g, lo=0.05, hi=1.0)
    Pn = (B if not varlen else 3) + 1
    pool = randn((Pn, HV, V, K) if vk else (Pn, HV, K, V), g, scale=0.5).to(pdt)
    if varlen:
        T = B * s
        q, k, v, a, b = (t.reshape(1, T, *t.shape[2:]) for t in (q, k, v, a, b))
        cut = sorted(torch.randint(0, T + 1, (2,), generator=g).tolist())
        cu = [0, *cut, T]
        idx = torch.randperm(Pn, generator=g)[:3].tolist()
    else:
        cu = None
        idx = torch.randperm(Pn, generator=g)[:B].tolist()
    idx[0] = -1 if torch.rand((), generator=g) < 0.3 else idx[0]
    N = len(idx)
    acc = torch.randint(0, q.shape[1] + 1, (N,), generator=g).tolist() if accept else None
    row = (HV, V, K) if vk else (HV, K, V)
    lead = (q.shape[1],) if varlen else (B, s)
    buf = torch.zeros(*lead, *row, device=P.device) if inter else None
    i32 = dict(dtype=torch.int32, device=P.device)
    kw = dict(state_indices=torch.tensor(idx, **i32), use_qk_l2norm_in_kernel=True,
              cu_seqlens=torch.tensor(cu, **i32) if varlen else None,
              accepted=torch.tensor(acc, **i32) if accept else None, intermediate_states=buf,
              use_gate_in_kernel=gate, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=sig,
              allow_neg_eigval=neg, state_layout="vk" if vk else "kv")
    return (q, k, v, a, b, pool), kw, (idx, cu, acc)


@settings(max_examples=examples(40, 40))
@given(B=st.integers(1, pick(2, 8)), s=st.integers(1, 3), H=st.sampled_from([1, 2]), G=st.sampled_from([1, 2]),
       K=st.sampled_from(DIMS), V=st.sampled_from(DIMS), qdt=st.sampled_from(IN_DTYPES),
       vdt=st.sampled_from(IN_DTYPES), pdt=st.sampled_from(POOL_DTYPES), gate=st.booleans(), dtb=st.booleans(),
       sig=st.booleans(), neg=st.booleans(), vk=st.booleans(), varlen=st.booleans(), accept=st.booleans(),
       inter=st.booleans(), seed=seeds())
def test_options_match_float64(B, s, H, G, K, V, qdt, vdt, pdt, gate, dtb, sig, neg, vk, varlen, accept, inter,
                               seed):
    """Every option combination: outputs, committed pool rows and intermediate states vs float64 (tolerance from
    the same step by torch at fp32, ``impl="reference"``); rows not committed stay bitwise unchanged."""
    g = gen(seed)
    (q, k, v, a, b, pool), kw, (idx, cu, acc) = _case(
        g, B=B, s=s, H=H, HV=H * G, K=K, V=V, qdt=qdt, vdt=vdt, pdt=pdt, gate=gate, dtb=dtb, sig=sig, neg=neg,
        vk=vk, varlen=varlen, accept=accept, inter=inter)
    before = pool.clone()
    scale = K**-0.5
    o64, p64, i64 = _ref64(q, k, v, a, b, pool, idx, cu, acc, scale=scale, A_log=kw["A_log"],
                           dt_bias=kw["dt_bias"], gate=gate, sig=sig, neg=neg, vk=vk)
    pool_lp = pool.clone()
    kw_lp = dict(kw, intermediate_states=kw["intermediate_states"].clone() if inter else None)
    o_lp = gated_delta_rule_decode(q, k, v, a, b, pool_lp, **kw_lp, impl="reference")
    o = gated_delta_rule_decode(q, k, v, a, b, pool, **kw)
    assert o.dtype == vdt and pool.dtype == pdt
    low = max(qdt, vdt, pdt, key=lambda d: torch.finfo(d).eps)  # the floor of the coarsest dtype
    assert_close("o", o, o64, o_lp, dtype=low)
    changed = (p64 != before.cpu().double()).flatten(1).any(1)
    assert torch.equal(pool[~changed.to(P.device)], before[~changed.to(P.device)])
    assert_close("pool", pool, p64, pool_lp, dtype=low)
    if inter:
        written = ~torch.isnan(i64)
        got = kw["intermediate_states"].cpu()
        assert torch.equal(got[~written], torch.zeros_like(got[~written]))  # entries of skipped tokens untouched
        assert_close("intermediate states", got[written], i64[written], kw_lp["intermediate_states"].cpu()[written],
                     dtype=low)


@pytest.mark.parametrize("opts", [
    dict(gate=True, dtb=True, sig=True, neg=True, vk=True, varlen=True),
    dict(gate=False, dtb=False, sig=False, neg=False, vk=False, varlen=False),
    dict(gate=False, dtb=False, sig=False, neg=True, vk=False, varlen=True),
    dict(gate=False, dtb=False, sig=True, neg=False, vk=True, varlen=False),
    dict(gate=True, dtb=False, sig=False, neg=True, vk=False, varlen=False),
], ids=lambda o: "+".join(k for k, on in o.items() if on) or "plain")
def test_reference_path_matches_float64_exactly_enough(opts):
    """``impl="reference"`` (the bound of the kernel's tolerance in test_options_match_float64) on float64 inputs
    equals the float64 recurrence to 1e-12, with every option on, none, and each beta / gate option alone."""
    g = gen(3)
    (q, k, v, a, b, pool), kw, (idx, cu, acc) = _case(
        g, B=2, s=3, H=1, HV=2, K=16, V=8, qdt=torch.float32, vdt=torch.float32, pdt=torch.float32, **opts,
        accept=True, inter=True)
    d = lambda t: t.double() if t is not None else None  # noqa: E731
    q, k, v, a, b, pool = map(d, (q, k, v, a, b, pool))
    kw = dict(kw, A_log=d(kw["A_log"]), dt_bias=d(kw["dt_bias"]), intermediate_states=d(kw["intermediate_states"]))
    o64, p64, i64 = _ref64(q, k, v, a, b, pool, idx, cu, acc, scale=16**-0.5, A_log=kw["A_log"],
                           dt_bias=kw["dt_bias"], gate=opts["gate"], sig=opts["sig"], neg=opts["neg"],
                           vk=opts["vk"])
    o = gated_delta_rule_decode(q, k, v, a, b, pool, **kw, impl="reference")
    assert rel_err(o, o64) < 1e-12 and rel_err(pool, p64) < 1e-12
    w = ~torch.isnan(i64)
    assert rel_err(kw["intermediate_states"].cpu()[w], i64[w]) < 1e-12


@pytest.mark.parametrize("opts", [dict(), dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                                allow_neg_eigval=True)])
def test_vk_layout_equals_kv_on_the_transposed_pool(opts):
    """The same step on a ``[V, K]`` pool and on its ``[K, V]`` transpose: outputs, pools and intermediate states
    agree (bitwise under the interpreter, where the register tile and its sums are the same)."""
    g = gen(7)
    gate = bool(opts)
    (q, k, v, a, b, pool), kw, _ = _case(
        g, B=1, s=5, H=1, HV=2, K=16, V=24, qdt=torch.float32, vdt=torch.float32, pdt=torch.float32, gate=gate,
        dtb=gate, sig=gate, neg=gate, vk=False, varlen=True, accept=True, inter=True)
    kw_vk = dict(kw, state_layout="vk", intermediate_states=kw["intermediate_states"].transpose(-1, -2).contiguous())
    pool_vk = pool.transpose(-1, -2).contiguous()
    o = gated_delta_rule_decode(q, k, v, a, b, pool, **kw)
    o_vk = gated_delta_rule_decode(q, k, v, a, b, pool_vk, **kw_vk)
    got = (o_vk, pool_vk.transpose(-1, -2), kw_vk["intermediate_states"].transpose(-1, -2))
    want = (o, pool, kw["intermediate_states"])
    for x, y in zip(got, want, strict=True):
        if P.big:
            assert rel_err(x, y) <= 1e-6
        else:
            assert torch.equal(x, y)


def test_fla_layout_names_and_option_checks():
    """fla's state_v_first / transpose_state_layout select the V-first layout; contradictions, unknown layouts,
    non-bool flags and misplaced gate parameters raise naming the argument, before the pool changes."""
    g = gen(11)
    (q, k, v, a, b, pool), kw, _ = _case(
        g, B=2, s=2, H=1, HV=2, K=16, V=8, qdt=torch.float32, vdt=torch.float32, pdt=torch.float32, gate=False,
        dtb=False, sig=False, neg=False, vk=True, varlen=False, accept=False, inter=False)
    kw.pop("state_layout")
    ref = gated_delta_rule_decode(q, k, v, a, b, pool.clone(), **kw, state_layout="vk")
    for name in ("state_v_first", "transpose_state_layout"):
        p2 = pool.clone()
        assert torch.equal(gated_delta_rule_decode(q, k, v, a, b, p2, **kw, **{name: True}), ref)
    before = pool.clone()
    hv = torch.zeros(2, device=P.device)
    cases = [
        (ValueError, "^state_layout: expected 'kv' .* or 'vk' .*, got 'kv_'", dict(state_layout="kv_")),
        (TypeError, "^state_layout: expected 'kv' or 'vk', got int", dict(state_layout=1)),
        (ValueError, "^state_v_first=True and transpose_state_layout=False: .*contradict",
         dict(state_v_first=True, transpose_state_layout=False)),
        (ValueError, "^state_v_first=False contradicts state_layout='vk'",
         dict(state_layout="vk", state_v_first=False)),
        (TypeError, "state_v_first: expected a bool", dict(state_v_first=1)),
        (TypeError, "allow_neg_eigval: expected a bool", dict(state_layout="vk", allow_neg_eigval=1)),
        (TypeError, "use_gate_in_kernel: expected a bool", dict(state_layout="vk", use_gate_in_kernel=None)),
        (ValueError, r"state: expected shape \[P, 2, 16, 8\]", dict()),  # a [V, K] pool taken as [K, V]
        (ValueError, "A_log: required", dict(state_layout="vk", use_gate_in_kernel=True)),
        (ValueError, "A_log: given without use_gate_in_kernel", dict(state_layout="vk", A_log=hv)),
        (ValueError, "dt_bias: given without use_gate_in_kernel", dict(state_layout="vk", dt_bias=hv)),
        (ValueError, r"^A_log: expected shape \[2\], got \[3\]",
         dict(state_layout="vk", use_gate_in_kernel=True, A_log=torch.zeros(3, device=P.device))),
        (TypeError, r"^dt_bias: expected dtype in \(float32(, float64)?\), got int32",
         dict(state_layout="vk", use_gate_in_kernel=True, A_log=hv, dt_bias=hv.int())),
        (ValueError, r"^intermediate_states: expected shape \[2, 2, 2, 8, 16\], got \[2, 2, 2, 16, 8\]",
         dict(state_layout="vk", intermediate_states=torch.zeros(
            2, 2, 2, 16, 8, device=P.device))),  # [K, V] buffer with a [V, K] pool
        (ValueError, "head_first.*not supported", dict(state_layout="vk", head_first=True)),
    ]
    for impl in ("triton", "reference"):
        for exc, match, extra in cases:
            with pytest.raises(exc, match=match):
                gated_delta_rule_decode(q, k, v, a, b, pool, **{**kw, **extra}, impl=impl)
            assert torch.equal(pool, before), match
    if not P.big:  # the interpreter computes bf16 wrongly: a bf16 pool (or v) is refused there, pool untouched
        for name, t in (("state", pool.bfloat16()), ("v", v.bfloat16())):
            args = dict(q=q, k=k, v=v, g=a, beta=b, state=pool, **kw, state_layout="vk")
            args[name] = t
            keep = args["state"].clone()
            with pytest.raises(TypeError, match="^bfloat16 inputs: Triton's CPU interpreter"):
                gated_delta_rule_decode(**args)
            assert torch.equal(args["state"], keep)


@pytest.mark.gpu_only
@settings(max_examples=examples(1, 12))
@given(vk=st.booleans(), seed=seeds())
def test_bf16_pool_on_gpu(vk, seed):
    """A bf16 pool with bf16 inputs and every beta / gate option: vs float64, tolerance from torch at fp32."""
    g = gen(seed)
    (q, k, v, a, b, pool), kw, (idx, cu, acc) = _case(
        g, B=8, s=2, H=4, HV=8, K=128, V=128, qdt=torch.bfloat16, vdt=torch.bfloat16, pdt=torch.bfloat16,
        gate=True, dtb=True, sig=True, neg=True, vk=vk, varlen=False, accept=True, inter=True)
    o64, p64, _ = _ref64(q, k, v, a, b, pool, idx, cu, acc, scale=128**-0.5, A_log=kw["A_log"],
                         dt_bias=kw["dt_bias"], gate=True, sig=True, neg=True, vk=vk)
    pool_lp = pool.clone()
    o_lp = gated_delta_rule_decode(q, k, v, a, b, pool_lp, **dict(kw, intermediate_states=None), impl="reference")
    o = gated_delta_rule_decode(q, k, v, a, b, pool, **kw)
    assert_close("o", o, o64, o_lp, dtype=torch.bfloat16)
    assert_close("pool", pool, p64, pool_lp, dtype=torch.bfloat16)


@pytest.mark.skipif(P.device != "cpu", reason="interpreter address check")
def test_options_stay_in_bounds():
    """V-first half-precision pools with the gate parameters and malformed device indices: no access outside the
    tensors the call is given or creates (interpreter address check)."""
    from addresscheck import AddressCheck

    g = gen(13)
    (q, k, v, a, b, pool), kw, _ = _case(
        g, B=1, s=5, H=1, HV=2, K=24, V=16, qdt=torch.float32, vdt=torch.float16, pdt=torch.float16, gate=True,
        dtb=True, sig=True, neg=True, vk=True, varlen=True, accept=True, inter=True)
    i32 = dict(dtype=torch.int32)
    cu = torch.tensor([-4, 9, 2, 3], **i32)
    idx = torch.tensor([0, 7, -3], **i32)
    acc = torch.tensor([-5, 100, 2], **i32)
    inter = kw["intermediate_states"]
    with AddressCheck(q, k, v, a, b, pool, idx, cu, acc, inter, kw["A_log"], kw["dt_bias"]) as ac:
        o = gated_delta_rule_decode_fwd(q, k, v, a, b, pool, idx, 0.25, True, cu, acc, inter, A_log=kw["A_log"],
                                        dt_bias=kw["dt_bias"], use_gate_in_kernel=True,
                                        use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, v_first=True)
    ac.assert_clean()
    assert torch.isfinite(o).all() and torch.isfinite(pool).all()



def test_options_torch_compile():
    """The custom op with the gate, beta and layout options and a half-precision V-first pool under
    ``torch.compile(fullgraph=True)`` equals the eager call."""
    g = gen(17)
    (q, k, v, a, b, pool), kw, _ = _case(
        g, B=1, s=5, H=1, HV=2, K=16, V=16, qdt=torch.float32, vdt=torch.float16, pdt=torch.float16, gate=True,
        dtb=True, sig=True, neg=True, vk=True, varlen=True, accept=True, inter=True)
    kw.pop("intermediate_states")
    inters = [torch.zeros(5, 2, 16, 16, device=P.device) for _ in range(2)]
    pools = [pool.clone(), pool.clone()]

    def f(q, k, v, a, b, pool, inter):
        return gated_delta_rule_decode(q, k, v, a, b, pool, **kw, intermediate_states=inter) * 2

    backend = "aot_eager" if P.device == "cpu" else "inductor"
    o1 = torch.compile(f, fullgraph=True, backend=backend)(q, k, v, a, b, pools[0], inters[0])
    o2 = f(q, k, v, a, b, pools[1], inters[1])
    assert torch.equal(o1, o2) and torch.equal(pools[0], pools[1]) and torch.equal(inters[0], inters[1])
    assert not torch.equal(pools[0], pool)


def test_nan_gate_input_reaches_only_its_head():
    """use_gate_in_kernel with a NaN raw gate input for one (sequence, value head): that head's output and state row
    are NaN, everything else equals the clean step bitwise (the softplus clamp must not turn NaN into 20)."""
    B, H, HV, K, V = 2, 1, 2, 16, 16
    q = randn((B, 1, H, K), 1)
    k = torch.nn.functional.normalize(randn((B, 1, H, K), 2), dim=-1)
    v = randn((B, 1, HV, V), 3)
    a = randn((B, 1, HV), 4)
    beta = rand((B, 1, HV), 5, lo=0.1, hi=0.9)
    A_log, dt_bias = randn((HV,), 6) * 0.5, randn((HV,), 7)
    pool = randn((B, HV, K, V), 8)
    idx = torch.arange(B, dtype=torch.int32, device=P.device)
    kw = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    p0, p1 = pool.clone(), pool.clone()
    bad = a.clone()
    bad[1, 0, 0] = float("nan")
    o = gated_delta_rule_decode(q, k, v, a, beta, p0, idx, **kw)
    ob = gated_delta_rule_decode(q, k, v, bad, beta, p1, idx, **kw)
    assert ob[1, 0, 0].isnan().all() and p1[1, 0].isnan().all()
    assert torch.equal(ob[0], o[0]) and torch.equal(ob[1, 0, 1], o[1, 0, 1])
    assert torch.equal(p1[0], p0[0]) and torch.equal(p1[1, 1], p0[1, 1])
