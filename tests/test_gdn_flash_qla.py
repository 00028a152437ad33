"""FlashQLA's entry points (ops/gdn/flash_qla.py): ``chunk_gated_delta_rule_fwd`` / ``_bwd`` against
``chunk_gated_delta_rule`` (the same kernels: bitwise) and against float64 for what only they return (the chunk
cumulative decay, the chunk states h)."""

import numpy as np
import pytest
import torch
from harness import EPS, P, assert_close, dtypes, examples, gdn_problem, pick, randn, seeds
from hypothesis import given, settings
from hypothesis import strategies as st

import gqla_triton as gq
import gqla_triton.ops.gdn.plan as plan_mod
from gqla_triton.ops.gdn.reference import recurrent_gated_delta_rule_ref

pytestmark = pytest.mark.usefixtures("poison_buffers")

C = 64


def _device(ins, dtype):
    return [t.to(P.device, dtype if i < 5 else torch.float32) for i, t in enumerate(ins)]


def _chunk_states64(ins, bounds):
    """float64 state at the start of every 64-token chunk of each sequence ``(b, lo, hi)``, in order."""
    q, k, v, g, beta, h0 = ins
    out = []
    for n, (b, lo, hi) in enumerate(bounds):
        for s in range(lo, hi, C):
            sl = slice(lo, s)
            _, S = recurrent_gated_delta_rule_ref(q[b:b + 1, sl], k[b:b + 1, sl], v[b:b + 1, sl], g[b:b + 1, sl],
                                                  beta[b:b + 1, sl], initial_state=h0[n:n + 1],
                                                  output_final_state=True)
            out.append(S[0])
    return torch.stack(out)


@settings(max_examples=examples(4, 12), deadline=None)
@given(lens=st.lists(st.integers(0, pick(150, 600)), min_size=1, max_size=3), varlen=st.booleans(),
       G=st.sampled_from([1, 2, 4]), v_first=st.booleans(), pad=st.integers(0, 9), dtype=dtypes(), seed=seeds())
def test_fwd_bwd_equal_the_autograd_op(lens, varlen, G, v_first, pad, dtype, seed):
    """o, the final state and all six gradients of the two-call form equal ``chunk_gated_delta_rule`` and its
    autograd bitwise (dq, dk summed per q/k head; db, dg in FlashQLA's order; dh0 None without an initial state);
    g is the chunk-local cumulative decay; h the float64 chunk states; varlen with FlashQLA's cu[N] < T padding."""
    if sum(lens) == 0 or (not varlen and max(lens) == 0):
        return
    H, K, V = 1, pick(16, 128), pick(32, 128)
    HV = H * G
    ins, cu = gdn_problem(seed, lens, varlen, H, HV, K, V)
    if varlen and pad:
        ins = [torch.cat([t, t[:, :pad]], 1) if i < 5 else t for i, t in enumerate(ins)]
    xs = _device(ins, dtype)
    if v_first:
        xs[5] = xs[5].transpose(-1, -2).contiguous()
    cu_d = cu.to(P.device) if cu is not None else None
    B, T = xs[0].shape[:2]
    do = randn((B, T, HV, V), seed + 1, device=P.device).to(dtype)
    dht = randn(tuple(xs[5].shape), seed + 2, device=P.device)
    layout = "vk" if v_first else "kv"

    gc, A, o, h, ht, cp = gq.chunk_gated_delta_rule_fwd(*xs[:5], initial_state=xs[5], cu_seqlens=cu_d,
                                                         output_h=True, state_v_first=v_first)
    assert cp is None and A.shape == (B, T, HV, C)
    leaves = [t.clone().requires_grad_() for t in xs]
    o2, ht2 = gq.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                        cu_seqlens=cu_d, state_layout=layout)
    torch.autograd.backward([o2, ht2], [do, dht])
    assert torch.equal(o, o2.detach()) and torch.equal(ht, ht2.detach())
    dq, dk, dv, db, dg, dh0 = gq.chunk_gated_delta_rule_bwd(*xs[:3], gc, xs[4], A, do, dht, initial_state=xs[5],
                                                            cu_seqlens=cu_d, state_v_first=v_first)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "db", "dh0"), (dq, dk, dv, dg, db, dh0),
                          [leaves[i].grad for i in (0, 1, 2, 3, 4, 5)], strict=True):
        # dg: fp32 here (FlashQLA's), the input's dtype through autograd: the same values before that rounding
        assert torch.equal(a.to(b.dtype), b), f"{name}: the two-call backward differs from autograd's"
    assert dg.dtype == torch.float32
    assert gq.chunk_gated_delta_rule_bwd(*xs[:3], gc, xs[4], A, do, cu_seqlens=cu_d)[5] is None

    bounds = ([(0, a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)] if varlen
              else [(b, 0, T) for b in range(B)])
    g64 = ins[3].to(dtype).double()  # g as the kernels read it
    want = torch.zeros_like(g64)
    for b, lo, hi in bounds:
        for s in range(lo, hi, C):
            want[b, s:min(s + C, hi)] = g64[b, s:min(s + C, hi)].cumsum(0)
    inside = torch.zeros(B, T, dtype=torch.bool)
    for b, lo, hi in bounds:
        inside[b, lo:hi] = True
    torch.testing.assert_close(gc.cpu()[inside].double(), want[inside], rtol=1e-5, atol=1e-5)
    assert (gc.cpu()[~inside] == 0).all() and (A.cpu()[~inside] == 0).all()  # padding: written, as o's rows
    h64 = _chunk_states64([t.double() for t in ins], bounds)
    hk = h.transpose(-1, -2) if v_first else h
    hk = hk.reshape(-1, HV, K, V)
    assert h.shape[:2] == ((1, h64.shape[0]) if varlen else (B, -(-T // C)))
    # h is stored in the input dtype: its rounding (and the products' at that precision) against float64
    assert_close("h", hk[:h64.shape[0]].double().cpu(), h64, dtype=dtype, eps=4 * EPS[dtype])


def test_padding_rows_are_zero():
    """g and A (like o) are 0 at tokens outside [cu[0], cu[N]), before the first sequence and after the last, also
    where a GPU cu_seqlens is clamped to the tokens (the buffers start NaN-filled here)."""
    H, HV, K, V, T = 1, 2, 16, 16, 100
    ins, _ = gdn_problem(0, [T], False, H, HV, K, V)
    xs = _device(ins, torch.float32)
    for cu in ([5, 70, 97], [0, 0, 0], [30, 30, 200]):
        if max(cu) > T and not plan_mod.plans_on_device(xs[0]):
            continue  # a CPU cu_seqlens past T is refused
        gc, A, o, *_ = gq.chunk_gated_delta_rule_fwd(*xs[:5], cu_seqlens=torch.tensor(cu, device=P.device))
        lo, hi = min(cu[0], T), min(max(cu), T)
        for name, t in (("g", gc), ("A", A), ("o", o)):
            assert torch.isfinite(t).all(), name
            assert (t[:, :lo] == 0).all() and (t[:, hi:] == 0).all(), name


def test_refusals_and_flags():
    """Bad arguments are refused by name; the scheduling flags take bools and change nothing."""
    ins, _ = gdn_problem(3, [70], False, 1, 2, 16, 16)
    xs = _device(ins, P.dtypes[0])
    gc, A, o, h, ht, _ = gq.chunk_gated_delta_rule_fwd(*xs[:5], initial_state=xs[5])
    assert h is None
    for kw in (dict(auto_cp=False), dict(enable_fwd_cp_cache=True), dict(auto_cp=False, enable_fwd_cp_cache=True)):
        assert torch.equal(gq.chunk_gated_delta_rule_fwd(*xs[:5], initial_state=xs[5], **kw)[2], o)
    assert gq.chunk_gated_delta_rule_fwd(*xs[:5], output_final_state=False)[4] is None
    do = torch.ones_like(o)
    bwd = gq.chunk_gated_delta_rule_bwd
    for label, call, exc, pattern in [
        ("cp_cache", lambda: bwd(*xs[:3], gc, xs[4], A, do, cp_cache=(1,)), ValueError, "cp_cache"),
        ("A shape", lambda: bwd(*xs[:3], gc, xs[4], A[..., :32], do), ValueError, "A"),
        ("A dtype", lambda: bwd(*xs[:3], gc, xs[4], A.double(), do), TypeError, "A"),
        ("g dtype", lambda: bwd(*xs[:3], gc.half(), xs[4], A, do), TypeError, "g"),
        ("do shape", lambda: bwd(*xs[:3], gc, xs[4], A, do[:, :5]), ValueError, "do"),
        ("dht shape", lambda: bwd(*xs[:3], gc, xs[4], A, do, ht[:, :1]), ValueError, "dht"),
        ("auto_cp", lambda: bwd(*xs[:3], gc, xs[4], A, do, auto_cp="yes"), TypeError, "auto_cp"),
        ("output_h", lambda: gq.chunk_gated_delta_rule_fwd(*xs[:5], output_h=2), TypeError, "output_h"),
        ("state_v_first", lambda: gq.chunk_gated_delta_rule_fwd(*xs[:5], state_v_first=None), TypeError,
         "state_v_first"),
        ("initial_state", lambda: gq.chunk_gated_delta_rule_fwd(*xs[:5], initial_state=xs[5][:, :1]), ValueError,
         "initial_state"),
    ]:
        with pytest.raises(exc, match=pattern):
            call()
        del label


@pytest.mark.parametrize("use_h0", [False, True])
@pytest.mark.parametrize("Hk,Hv", [(2, 2), (1, 4), (2, 8)])
def test_recurrent_decode_form(use_h0, Hk, Hv):
    """``recurrent_gated_delta_rule``: each row's first seqlens[b] tokens through the float64 recurrence (o and the
    final state), o = 0 past them, the initial state untouched; all T tokens without seqlens; GQA value heads take
    q/k head ``h // (Hv / Hk)``."""
    dtype = P.dtypes[0]
    B, T, K, V = 3, 6, pick(16, 128), pick(16, 128)
    g_ = torch.Generator().manual_seed(Hk * 10 + Hv + use_h0)
    q = torch.nn.functional.normalize(torch.randn(B, T, Hk, K, generator=g_, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, Hk, K, generator=g_, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, Hv, V, generator=g_, dtype=torch.float64)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, Hv, generator=g_, dtype=torch.float64)) / 16
    beta = torch.rand(B, T, Hv, generator=g_, dtype=torch.float64)
    h0 = torch.randn(B, Hv, K, V, generator=g_, dtype=torch.float64) if use_h0 else None
    xs = [t.to(P.device, dtype) for t in (q, k, v)] + [t.to(P.device, torch.float32) for t in (g, beta)]
    h0d = h0.to(P.device, torch.float32) if use_h0 else None
    keep = h0d.clone() if use_h0 else None
    seqlens = torch.tensor([1, T - 1, 0], dtype=torch.int32, device=P.device)
    o, ht = gq.recurrent_gated_delta_rule(*xs, scale=K ** -0.5, initial_state=h0d, seqlens=seqlens)
    assert o.dtype == dtype and ht.dtype == torch.float32
    if use_h0:
        assert torch.equal(h0d, keep)
    lows = [t.to(dtype).double() for t in (q, k, v)] + [g.float().double(), beta.float().double()]
    for b, L in enumerate(seqlens.tolist()):
        start = h0[b:b + 1] if use_h0 else torch.zeros(1, Hv, K, V, dtype=torch.float64)
        r_o, r_s = recurrent_gated_delta_rule_ref(*(t[b:b + 1, :L] for t in lows), initial_state=start,
                                                  output_final_state=True)
        if L:
            assert_close(f"o row {b}", o[b:b + 1, :L].double().cpu(), r_o, dtype=dtype, eps=4 * EPS[dtype])
        assert (o[b, L:] == 0).all()
        assert_close(f"state row {b}", ht[b:b + 1].double().cpu(), r_s, dtype=dtype, eps=4 * EPS[dtype])
    o_all, _ = gq.recurrent_gated_delta_rule(*xs, initial_state=h0d)
    r_o, _ = recurrent_gated_delta_rule_ref(*lows, initial_state=h0, output_final_state=True)
    assert_close("o (all tokens)", o_all.double().cpu(), r_o, dtype=dtype, eps=4 * EPS[dtype])
    assert gq.recurrent_gated_delta_rule(*xs, output_final_state=False)[1] is None
    with pytest.raises(ValueError, match="head_first"):
        gq.recurrent_gated_delta_rule(*xs, head_first=True)
    for bad, err in ((0, ValueError), (-3, ValueError), (1.5, TypeError), ("2", TypeError), (True, TypeError)):
        with pytest.raises(err, match="head_batch"):
            gq.recurrent_gated_delta_rule(*xs, head_batch=bad)
    assert torch.equal(gq.recurrent_gated_delta_rule(*xs, initial_state=h0d, head_batch=4)[0], o_all)
    assert torch.equal(gq.recurrent_gated_delta_rule(*xs, initial_state=h0d, head_batch=np.int64(2))[0], o_all)
    # int64 lengths (FlashQLA takes either), past T and negative: clamped to [0, T] as the int32 ones are
    wide = torch.tensor([1, 2**40, -2**40], dtype=torch.int64, device=P.device)
    got = gq.recurrent_gated_delta_rule(*xs, initial_state=h0d, seqlens=wide)
    want = gq.recurrent_gated_delta_rule(*xs, initial_state=h0d, seqlens=wide.clamp(0, T).int())
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    with pytest.raises(ValueError, match="seqlens"):
        gq.recurrent_gated_delta_rule(*xs, seqlens=seqlens[:2])
    with pytest.raises(ValueError, match="initial_state"):
        gq.recurrent_gated_delta_rule(*xs, initial_state=torch.zeros(B, Hv, V, K + 1, device=P.device))



@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta", "initial_state"])
def test_recurrent_decode_form_refuses_inputs_requiring_grad(name):
    """``recurrent_gated_delta_rule`` is forward-only: any input requiring grad under autograd (the initial state
    included, which it would otherwise read detached and leave without a gradient) is a RuntimeError naming the op
    and the input; under no_grad the same call runs."""
    B, T, H, K, V = 2, 3, 1, 8, 8
    g_ = torch.Generator().manual_seed(3)
    x = dict(q=torch.randn(B, T, H, K, generator=g_), k=torch.randn(B, T, H, K, generator=g_),
             v=torch.randn(B, T, H, V, generator=g_), g=-torch.rand(B, T, H, generator=g_),
             beta=torch.rand(B, T, H, generator=g_), initial_state=torch.randn(B, H, K, V, generator=g_))
    x = {n: t.to(P.device) for n, t in x.items()}
    x[name].requires_grad_(True)
    with pytest.raises(RuntimeError, match=f"recurrent_gated_delta_rule is forward-only.*{name} requires grad"):
        gq.recurrent_gated_delta_rule(**x)
    with torch.no_grad():
        o, ht = gq.recurrent_gated_delta_rule(**x)
    assert o.shape == (B, T, H, V) and ht.shape == (B, H, K, V)

# FlashQLA 0.1.3's parameters of its two-call form, in order, with their defaults (names only: its call sites
# pass them positionally, e.g. ``fwd(q, k, v, g, beta, scale, h0, cu_seqlens, True, False, True, False)``)
FLASH_QLA_FWD = (("q", None), ("k", None), ("v", None), ("g", None), ("beta", None), ("scale", None),
                 ("initial_state", None), ("cu_seqlens", None), ("output_final_state", True), ("output_h", False),
                 ("auto_cp", True), ("state_v_first", False), ("enable_fwd_cp_cache", False), ("cp_context", None),
                 ("is_train", None))
FLASH_QLA_BWD = (("q", None), ("k", None), ("v", None), ("g", None), ("beta", None), ("A", None), ("do", None),
                 ("dht", None), ("scale", None), ("initial_state", None), ("cu_seqlens", None),
                 ("state_v_first", False), ("auto_cp", True), ("cp_cache", None), ("cp_context", None))


def test_flash_qla_013_signatures():
    """The fwd / bwd take FlashQLA 0.1.3's parameters by name and position (its ``cp_context`` and ``is_train``
    included), each with FlashQLA's default."""
    import inspect

    for fn, want in ((gq.chunk_gated_delta_rule_fwd, FLASH_QLA_FWD), (gq.chunk_gated_delta_rule_bwd, FLASH_QLA_BWD)):
        got = [(p.name, None if p.default is inspect.Parameter.empty else p.default)
               for p in inspect.signature(fn).parameters.values()]
        assert got == list(want), fn.__name__
        assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
                   for p in inspect.signature(fn).parameters.values()), fn.__name__


@pytest.mark.parametrize("positional", [False, True])
def test_flash_qla_013_cp_context_and_is_train(positional):
    """FlashQLA 0.1.3's ``is_train`` (None or a bool: no effect here) and ``cp_context=None`` are taken by keyword
    and in their places, bit-identical to the call without them; a cp_context is refused by name (ValueError), a
    non-bool is_train is a TypeError naming it."""
    ins, cu = gdn_problem(5, [40, 30], True, 1, 2, 16, 16)
    xs = _device(ins, P.dtypes[0])
    cu = cu.to(P.device)
    base = gq.chunk_gated_delta_rule_fwd(*xs[:5], initial_state=xs[5], cu_seqlens=cu)
    gc, A, o = base[:3]
    do = torch.ones_like(o)
    dbase = gq.chunk_gated_delta_rule_bwd(*xs[:3], gc, xs[4], A, do, initial_state=xs[5], cu_seqlens=cu)
    for is_train in (None, True, False):
        if positional:
            got = gq.chunk_gated_delta_rule_fwd(*xs[:5], None, xs[5], cu, True, False, True, False, False, None,
                                                is_train)
        else:
            got = gq.chunk_gated_delta_rule_fwd(*xs[:5], initial_state=xs[5], cu_seqlens=cu, cp_context=None,
                                                is_train=is_train)
        assert all(torch.equal(a, b) for a, b in zip(got[:5], base[:5], strict=True) if a is not None)
        assert got[3] is None and got[5] is None
    if positional:
        dgot = gq.chunk_gated_delta_rule_bwd(*xs[:3], gc, xs[4], A, do, None, None, xs[5], cu, False, True, None, None)
    else:
        dgot = gq.chunk_gated_delta_rule_bwd(*xs[:3], gc, xs[4], A, do, initial_state=xs[5], cu_seqlens=cu,
                                             cp_context=None)
    assert all(torch.equal(a, b) for a, b in zip(dgot, dbase, strict=True))
    with pytest.raises(ValueError, match="cp_context: not supported by chunk_gated_delta_rule_fwd"):
        gq.chunk_gated_delta_rule_fwd(*xs[:5], cp_context=object())
    with pytest.raises(ValueError, match="cp_context: not supported by chunk_gated_delta_rule_bwd"):
        gq.chunk_gated_delta_rule_bwd(*xs[:3], gc, xs[4], A, do, cu_seqlens=cu, cp_context=object())
    for bad in ("yes", 2, torch.tensor(True)):
        with pytest.raises(TypeError, match="is_train: expected a bool"):
            gq.chunk_gated_delta_rule_fwd(*xs[:5], is_train=bad)
