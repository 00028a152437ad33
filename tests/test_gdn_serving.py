"""GatedDeltaNet serving (layers/gated_deltanet.py): slots, packed decode steps, speculative verify + commit, pooled
prefill, rejected calls, torch.compile and CUDA graphs of a decode step.

Low-precision results are judged against the float64 reference layer (same weights) with the harness's data-derived
tolerance; two low-precision computations that must agree (verify + commit against decoding only the accepted
tokens) are held to a few times the error of torch at that precision.
"""

import copy

import pytest
import torch
from harness import EPS, P, assert_close, capture_graph, dtypes, examples, gen, pick, randn, rel_err, seeds
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_gated_deltanet_layer import IMPLS, _as, _layer

from gqla_triton.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetCache

pytestmark = pytest.mark.usefixtures("poison_buffers")

FEW = settings(max_examples=examples(3, 10))
I32 = dict(dtype=torch.int32, device=P.device)


def _agree(name, out, other, ref64, lowp, dtype):
    """``out`` and ``other`` (two low-precision computations of ``ref64``) are each within the data-derived tolerance
    of the float64 result and within 4x torch's low-precision error of each other."""
    assert_close(name, out, ref64, lowp, dtype=dtype)
    e_low = rel_err(lowp, ref64)
    assert rel_err(out, other) <= 4 * e_low + 2 * EPS[dtype], (name, rel_err(out, other), e_low)


def _reference_run(base, dtype, seqs):
    """Each sequence's tokens ``x [1, L, hidden]`` through the pure-torch layer in one call from a fresh cache:
    ``[(out, cache)]`` in float64 and at ``dtype``."""
    r64, rlp = _as(base, "reference", torch.float64), _as(base, "reference", dtype)
    res = []
    with torch.no_grad():
        for x in seqs:
            c64, clp = r64.init_cache(1), rlp.init_cache(1)
            res.append((r64(x.to(torch.float64), c64), c64, rlp(x.to(dtype), clp), clp))
    return res


def _snapshot(cache):
    return (cache._conv.clone(), cache.recurrent_state.clone(), cache._lens.clone(), list(cache._held),
            cache._draft)


def _held(m, g, num_seqs: int, T: int):
    """A cache of ``num_seqs`` slots whose first two hold ``T`` prefilled tokens each, and its snapshot."""
    cache = m.init_cache(num_seqs)
    with torch.no_grad():
        m(randn((2, T, m.hidden_size), g), cache, slots=[0, 1])
    return cache, _snapshot(cache)


def _assert_unchanged(cache, snap, what=""):
    conv, rec, lens, held, draft = snap
    assert torch.equal(cache._conv, conv), what
    assert torch.equal(cache.recurrent_state, rec), what
    assert torch.equal(cache._lens, lens), what
    assert cache._held == held and cache._draft is draft, what


def _split(x, cu):
    return [x[:, a:b] for a, b in zip(cu[:-1], cu[1:], strict=True)]


# ------------------------------------------------------------------------------------------ speculative decoding
@pytest.mark.parametrize("impl", IMPLS)
@FEW
@given(N=st.integers(1, pick(3, 8)), s=st.integers(1, 4), varlen=st.booleans(), device_slots=st.booleans(),
       H=st.sampled_from([1, 2]), G=st.sampled_from([1, 2]), dtype=dtypes(), seed=seeds())
@example(N=2, s=3, varlen=True, device_slots=False, H=2, G=1, dtype=P.dtypes[0], seed=5)  # drafts of 3, packed
def test_commit_after_verify_equals_decoding_the_accepted_tokens(impl, N, s, varlen, device_slots, H, G, dtype,
                                                                 seed):
    """Verify s draft tokens (ragged counts through cu_seqlens when ``varlen``), commit(accepted): outputs of the
    accepted tokens, recurrent states, conv windows and lengths equal those of decoding only the accepted tokens;
    the verify step leaves the cache as it was; the next decode step agrees too (float64 reference layer)."""
    D = pick(16, 128)
    base = _layer(H, G, D, torch.float64, seed)
    g = gen(seed)
    m = _as(base, impl, dtype)
    hidden = base.hidden_size
    num = N + 2
    slots = torch.randperm(num, generator=g)[:N].tolist()
    prompt = pick(3, 40)
    lens = torch.randint(0, s + 1, (N,), generator=g).tolist() if varlen else [s] * N
    acc = torch.randint(-1, s + 2, (N,), generator=g).to(torch.int32)
    n_acc = [min(max(int(a), 0), n) for a, n in zip(acc, lens, strict=True)]
    xp = randn((N, prompt, hidden), g, dtype=dtype)
    nxt = randn((N, 1, hidden), g, dtype=dtype)
    if varlen:
        cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
        xd = randn((1, max(cu[-1], 1), hidden), g, dtype=dtype)
        drafts = _split(xd, cu)
        cu_t = torch.tensor(cu, **I32)
    else:
        xd = randn((N, s, hidden), g, dtype=dtype)
        drafts = [xd[n:n + 1] for n in range(N)]
        cu_t = None
    sl = torch.tensor(slots, **I32) if device_slots else slots

    cv = m.init_cache(num)
    with torch.no_grad():
        m(xp, cv, slots=slots)
        cd = copy.deepcopy(cv)
        snap = _snapshot(cv)
        out_v = m(xd, cv, cu_t, slots=sl, verify=True)
        assert cv.pending
        conv, rec, lens_, held, _ = snap
        _assert_unchanged(cv, (conv, rec, lens_, held, cv._draft), "verify changed the cache")
        cv.commit(acc.to(P.device))
        assert not cv.pending
        outs_d = []
        for n in range(N):  # each sequence alone, only its accepted tokens
            outs_d.append(m(drafts[n][:, :n_acc[n]], cd, slots=[slots[n]]) if n_acc[n] else None)
        o1 = m(nxt, cv, slots=sl)
        o2 = m(nxt, cd, slots=slots)

    r = _reference_run(base, dtype, [torch.cat([xp[n:n + 1], drafts[n][:, :n_acc[n]], nxt[n:n + 1]], 1)
                                     for n in range(N)])
    rows = torch.tensor(slots, device=P.device)
    for n, (out64, _, outlp, _) in enumerate(r):
        a = n_acc[n]
        vn = out_v[:, cu[n]:cu[n + 1]] if varlen else out_v[n:n + 1]
        if a:
            _agree(f"accepted outputs (seq {n})", vn[:, :a], outs_d[n], out64[:, prompt:prompt + a],
                   outlp[:, prompt:prompt + a], dtype)
        _agree(f"next step after commit (seq {n})", o1[n:n + 1], o2[n:n + 1], out64[:, -1:], outlp[:, -1:], dtype)
    assert torch.equal(cv.seqlens, cd.seqlens)
    want = torch.tensor([prompt + a + 1 for a in n_acc], **I32)
    assert torch.equal(cv.seqlens[rows], want)
    c64 = torch.cat([x[1].recurrent_state for x in r])
    clp = torch.cat([x[3].recurrent_state for x in r])
    _agree("recurrent state", cv.recurrent_state[rows], cd.recurrent_state[rows], c64, clp, torch.float32)
    c64 = torch.cat([x[1].conv_state for x in r])
    clp = torch.cat([x[3].conv_state for x in r])
    _agree("conv state", cv.conv_state[rows], cd.conv_state[rows], c64, clp, dtype)


# ------------------------------------------------------------------------------------------ packed decode steps
@pytest.mark.parametrize("impl", IMPLS)
@FEW
@given(lens=st.lists(st.integers(0, 3), min_size=1, max_size=pick(4, 8)), pad=st.integers(0, 2),
       device_slots=st.booleans(), G=st.sampled_from([1, 2]), dtype=dtypes(), seed=seeds())
def test_packed_decode_equals_per_sequence_decode(impl, lens, pad, device_slots, G, dtype, seed):
    """New tokens of N sequences packed through cu_seqlens (ragged counts, 0 allowed, padding tokens after cu[N])
    in one decode step == each sequence decoding its tokens alone; padding tokens output 0; float64 reference."""
    H, D = 2, pick(16, 128)
    base = _layer(H, G, D, torch.float64, seed)
    g = gen(seed)
    m = _as(base, impl, dtype)
    N = len(lens)
    num = N + 1
    slots = torch.randperm(num, generator=g)[:N].tolist()
    prompt = pick(2, 20)
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    T = cu[-1] + max(pad, 1 if cu[-1] == 0 else 0)
    xp = randn((N, prompt, base.hidden_size), g, dtype=dtype)
    xd = randn((1, T, base.hidden_size), g, dtype=dtype)
    cache = m.init_cache(num)
    with torch.no_grad():
        m(xp, cache, slots=slots)
        alone = copy.deepcopy(cache)
        before = cache.recurrent_state.clone()
        out = m(xd, cache, torch.tensor(cu, **I32), slots=torch.tensor(slots, **I32) if device_slots else slots)
        outs = [m(x, alone, slots=[slots[n]]) if x.shape[1] else None for n, x in enumerate(_split(xd, cu))]
    assert out.shape == xd.shape
    assert torch.equal(out[:, cu[-1]:], torch.zeros_like(out[:, cu[-1]:]))
    r = _reference_run(base, dtype, [torch.cat([xp[n:n + 1], x], 1) for n, x in enumerate(_split(xd, cu))])
    for n, (out64, _, outlp, _) in enumerate(r):
        if lens[n]:
            _agree(f"seq {n}", out[:, cu[n]:cu[n + 1]], outs[n], out64[:, prompt:], outlp[:, prompt:], dtype)
    assert torch.equal(cache.seqlens, alone.seqlens)
    rows = torch.tensor(slots, device=P.device)
    assert torch.equal(cache.seqlens[rows], torch.tensor([prompt + n for n in lens], **I32))
    c64 = torch.cat([x[1].recurrent_state for x in r])
    clp = torch.cat([x[3].recurrent_state for x in r])
    _agree("recurrent state", cache.recurrent_state[rows], alone.recurrent_state[rows], c64, clp, torch.float32)
    c64 = torch.cat([x[1].conv_state for x in r])
    clp = torch.cat([x[3].conv_state for x in r])
    _agree("conv state", cache.conv_state[rows], alone.conv_state[rows], c64, clp, dtype)
    free = [i for i in range(num) if i not in slots]
    assert torch.equal(cache.recurrent_state[free], before[free])


@pytest.mark.parametrize("verify", [False, True])
def test_device_slot_padding_is_skipped(verify):
    """A device slot tensor with padding (-1) and out-of-range entries: those rows output exactly 0 (even from NaN
    hidden states) and touch no slot; the live rows equal the same step over host slots."""
    base = _layer(1, 2, 16, torch.float64, 3)
    m = _as(base, "triton", P.dtypes[0])
    g = gen(3)
    cache = m.init_cache(4)
    xp = randn((2, 3, m.hidden_size), g, dtype=m.in_proj.weight.dtype)
    x = randn((4, 2, m.hidden_size), g, dtype=m.in_proj.weight.dtype)
    x[[1, 3]] = float("nan")  # whatever a padding row holds, its output is 0
    with torch.no_grad():
        m(xp, cache, slots=[3, 1])
        twin = copy.deepcopy(cache)
        before = _snapshot(cache)
        out = m(x, cache, slots=torch.tensor([3, -1, 1, 9], **I32), verify=verify)
        ref = m(x[[0, 2]], twin, slots=[3, 1], verify=verify)
        if verify:
            acc = torch.tensor([2, 1, 1, 2], **I32)
            cache.commit(acc)
            twin.commit(acc[[0, 2]])
    assert torch.equal(out[[1, 3]], torch.zeros_like(out[[1, 3]]))
    torch.testing.assert_close(out[[0, 2]], ref)
    for name in ("conv_state", "recurrent_state", "seqlens"):
        torch.testing.assert_close(getattr(cache, name), getattr(twin, name))
    for t, t0 in ((cache.conv_state, before[0][:4]), (cache.recurrent_state, before[1]), (cache.seqlens,
                                                                                          before[2][:4])):
        assert torch.equal(t[[0, 2]], t0[[0, 2]])  # rows of no live sequence
    assert cache.holds() == [False, True, False, True]


# ------------------------------------------------------------------------------------------ pooled prefill
@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_into_fresh_and_held_slots(impl):
    """A packed prefill over a held slot (continues from its states) and two free slots whose rows hold garbage
    (start from zero) == each sequence prefilled alone (float64 reference); the other slot stays bitwise as it
    was; reset() zeroes rows and frees them."""
    base = _layer(2, 2, pick(16, 128), torch.float64, 8)
    dt = P.dtypes[0]
    m = _as(base, impl, dt)
    g = gen(8)
    hid = m.hidden_size
    first = [randn((1, n, hid), g, dtype=dt) for n in (4, 6)]
    second = [randn((1, n, hid), g, dtype=dt) for n in (pick(18, 70), 5, 7)]
    cache = m.init_cache(4)
    with torch.no_grad():
        m(torch.cat(first, 1), cache, torch.tensor([0, 4, 10], device=P.device), slots=[0, 2])
        assert cache.holds() == [True, False, True, False]
        cache.free([2])
        cache.recurrent_state[[1, 2, 3]] = randn((3, *cache.recurrent_state.shape[1:]), g)
        cache.conv_state[[1, 2, 3]] = randn((3, *cache.conv_state.shape[1:]), g, dtype=dt)
        keep = cache.recurrent_state[3].clone(), cache.conv_state[3].clone()
        cu = torch.tensor([0, *torch.tensor([x.shape[1] for x in second]).cumsum(0).tolist()], device=P.device)
        out = m(torch.cat(second, 1), cache, cu, slots=[0, 2, 1])
    assert cache.holds() == [True, True, True, False]
    assert torch.equal(cache.recurrent_state[3], keep[0]) and torch.equal(cache.conv_state[3], keep[1])
    r = _reference_run(base, dt, [torch.cat([first[0], second[0]], 1), second[1], second[2]])
    pieces = _split(out, cu.tolist())
    skip = [first[0].shape[1], 0, 0]
    for n, (out64, _, outlp, _) in enumerate(r):
        assert_close(f"seq {n}", pieces[n], out64[:, skip[n]:], outlp[:, skip[n]:], dtype=dt)
    rows = [0, 2, 1]
    assert_close("recurrent state", cache.recurrent_state[rows], torch.cat([x[1].recurrent_state for x in r]),
                 torch.cat([x[3].recurrent_state for x in r]), dtype=torch.float32)
    assert_close("conv state", cache.conv_state[rows], torch.cat([x[1].conv_state for x in r]),
                 torch.cat([x[3].conv_state for x in r]), dtype=dt)
    assert cache.seqlens.tolist() == [first[0].shape[1] + second[0].shape[1], 7, 5, 0]
    cache.reset([0, 3])
    assert cache.holds() == [False, True, True, False]
    assert not cache.recurrent_state[0].any() and not cache.conv_state[0].any() and cache.seqlens[0] == 0


@pytest.mark.parametrize("hostile", [False, True])
def test_prefill_with_gpu_bounds_reads_nothing_and_pads(monkeypatch, hostile):
    """A prefill whose cu_seqlens is planned on the device (a GPU tensor; forced under the interpreter) reads
    nothing of it on the host. Its bounds are taken clamped to [0, T] and made non-decreasing: padding tokens
    before cu[0] and from cu[N] on (NaN hidden states) reach no sequence and no cache row, and output 0 where
    finite; each sequence's outputs and cache rows equal those of the call over its tokens alone. ``hostile``: a
    bound out of order that clamps to the same sequences."""
    import gqla_triton.ops.gdn.plan as plan_mod

    monkeypatch.setattr(plan_mod, "plans_on_device", lambda cu: True)
    base = _layer(1, 2, 16, torch.float64, 5)
    m = _as(base, "triton", P.dtypes[0])
    dt = m.in_proj.weight.dtype
    g = gen(5)
    lens, lead, tail = [7, 0, 12], 3, 5
    T = lead + sum(lens) + tail
    x = randn((1, T, m.hidden_size), g, dtype=dt)
    x[:, :lead] = float("nan")
    x[:, T - tail:] = float("nan")
    x[:, T - 2] = 1.0  # one finite padding token: its output is exactly 0
    bounds = [lead, lead + 7, lead + 7, lead + 19]
    raw = [lead, lead + 7, lead + 3, lead + 19] if hostile else bounds  # lead + 3 < lead + 7: clamps to lead + 7
    cu = torch.tensor(raw, **I32)
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: (
        reads.append(1) if self.data_ptr() == cu.data_ptr() else None, tolist(self))[1])
    cache, alone = m.init_cache(4), m.init_cache(4)
    with torch.no_grad():
        out = m(x, cache, cu, slots=[2, 0, 3])
        ref = m(x[:, lead:T - tail], alone, torch.tensor([b - lead for b in bounds], **I32), slots=[2, 0, 3])
    assert not reads, "cu_seqlens read on the host"
    assert torch.equal(out[:, T - 2], torch.zeros_like(out[:, T - 2]))
    torch.testing.assert_close(out[:, lead:T - tail], ref, rtol=1e-5, atol=1e-5)
    for name in ("conv_state", "recurrent_state", "seqlens"):
        torch.testing.assert_close(getattr(cache, name), getattr(alone, name), rtol=1e-5, atol=1e-5, msg=name)
    assert cache.seqlens.tolist() == [0, 0, 7, 12] and cache.holds() == alone.holds()


# ------------------------------------------------------------------------------------------ rejected calls
def test_rejected_calls_change_nothing():
    """Every invalid call raises TypeError / ValueError and leaves every cache tensor, flag and pending step as it
    was (snapshots before and after)."""
    m = _as(_layer(2, 2, 16, torch.float64, 1), "triton", P.dtypes[0])
    dt = m.in_proj.weight.dtype
    g = gen(1)
    cache = m.init_cache(3)
    x = randn((2, 1, m.hidden_size), g, dtype=dt)
    with torch.no_grad():
        m(randn((2, 2, m.hidden_size), g, dtype=dt), cache, slots=[2, 0])
    dev = P.device
    x1 = randn((1, 4, m.hidden_size), g, dtype=dt)
    bad = [
        (TypeError, "slots", dict(x=x, slots=[2, 0.0])),
        (TypeError, "slots", dict(x=x, slots=[True, 0])),
        (TypeError, "slots", dict(x=x, slots="02")),
        (TypeError, "slots", dict(x=x, slots={0, 2})),
        (ValueError, "slots", dict(x=x, slots=[2, 2])),
        (ValueError, "slots", dict(x=x, slots=[2, 3])),
        (ValueError, "slots", dict(x=x, slots=[-1, 0])),
        (ValueError, "slots", dict(x=x, slots=[2])),
        (TypeError, "slots", dict(x=x, slots=torch.tensor([2, 0], dtype=torch.int64, device=dev))),
        (ValueError, "slots", dict(x=x, slots=torch.tensor([[2, 0]], **I32))),
        (ValueError, "slots", dict(x=x, slots=torch.tensor([2, 0, 1], **I32))),
        (TypeError, "hidden_states", dict(x=x.double() if dt != torch.float64 else x.float(), slots=[2, 0])),
        (ValueError, "hidden_states", dict(x=x[..., :-1], slots=[2, 0])),
        (ValueError, "hidden_states", dict(x=x[0], slots=[2, 0])),
        (ValueError, "hidden_states", dict(x=x[:, :0], slots=[2, 0])),
        (TypeError, "hidden_states", dict(x=x.tolist(), slots=[2, 0])),
        (ValueError, "cu_seqlens", dict(x=x, cu=torch.tensor([0, 1, 2], **I32), slots=[2, 0])),  # B != 1
        (TypeError, "cu_seqlens", dict(x=x1, cu=torch.tensor([0, 2, 4.0], device=dev), slots=[2, 0])),
        (ValueError, "cu_seqlens", dict(x=x1, cu=torch.tensor([[0, 2, 4]], **I32), slots=[2, 0])),
        (ValueError, "cu_seqlens", dict(x=x1, cu=torch.tensor([4], **I32), slots=[2, 0])),
        (ValueError, "slots", dict(x=x1, cu=torch.tensor([0, 4], **I32), slots=[2, 0])),
        (ValueError, "verify", dict(x=x, slots=[1, 0], verify=True)),  # slot 1 holds no state
        (TypeError, "verify", dict(x=x, slots=[2, 0], verify=1)),
        (TypeError, "cache", dict(x=x, cache=object())),
        (ValueError, "cache", dict(x=x, cache=GatedDeltaNetCache(3, m.conv_dim, 4, 4, 16, 32, device=dev,
                                                                 dtype=dt))),
    ]
    if dev == "cpu":  # a CPU cu_seqlens is checked on the host (no sync), for a prefill and a decode step
        bad += [(ValueError, "cu_seqlens", dict(x=x1, cu=torch.tensor([0, 3, 2], **I32), slots=[1, 0])),
                (ValueError, "cu_seqlens", dict(x=x1, cu=torch.tensor([0, 2, 5], **I32), slots=[1, 0])),  # > T
                (ValueError, "cu_seqlens", dict(x=x1, cu=torch.tensor([0, 3, 2], **I32), slots=[2, 0])),
                (ValueError, "cu_seqlens", dict(x=x1, cu=torch.tensor([0, 3, 5], **I32), slots=[2, 0])),
                # a CPU slot tensor is read on the host (no sync): a slot named twice
                (ValueError, "slots", dict(x=x, slots=torch.tensor([0, 0], **I32)))]
    snap = _snapshot(cache)
    with torch.no_grad():
        for exc, match, kw in bad:
            with pytest.raises(exc, match=match):
                m(kw["x"], kw.get("cache", cache), kw.get("cu"), slots=kw["slots"] if "slots" in kw else None,
                  verify=kw.get("verify", False))
            _assert_unchanged(cache, snap, match)
        with pytest.raises(ValueError, match="slots"):
            m(x, None, slots=[0, 1])
        with pytest.raises(ValueError, match="commit"):
            cache.commit(torch.zeros(2, **I32))
        _assert_unchanged(cache, snap)
        # a pending verify step: forward, reset and free refuse; commit checks its argument
        m(x, cache, slots=[2, 0], verify=True)
        snap = _snapshot(cache)
        for call in (lambda: m(x, cache, slots=[2, 0]), lambda: cache.reset([1]), lambda: cache.free()):
            with pytest.raises(ValueError, match="pending"):
                call()
            _assert_unchanged(cache, snap)
        for acc, exc in ((torch.zeros(3, **I32), ValueError), (torch.zeros(2, dtype=torch.int64, device=dev),
                                                                TypeError), ([0, 0], TypeError)):
            with pytest.raises(exc, match="accepted"):
                cache.commit(acc)
            _assert_unchanged(cache, snap)
        for call in (lambda: cache.reset([3]), lambda: cache.free([0, 0]), lambda: cache.holds([5])):
            with pytest.raises(ValueError, match="slots"):
                call()
        cache.commit(torch.zeros(2, **I32))  # nothing accepted: the cache as before the verify step
        _assert_unchanged(cache, (*snap[:4], None))
    with pytest.raises(RuntimeError, match="inference only"):  # a decode step under autograd
        m(x, cache, slots=[2, 0])
    _assert_unchanged(cache, (*snap[:4], None))


@pytest.mark.parametrize("verify", [False, True])
def test_inputs_sharing_memory_with_the_cache_change_nothing(verify):
    """A device slot tensor that is a view of the cache's own lengths (or of its conv rows), hidden states that are a
    view of its recurrent states: a ValueError naming the argument before any row changes, on the fused decode
    step, the packed one and a prefill."""
    m = _as(_layer(1, 1, 16, torch.float64, 2), "triton", torch.float32)
    g = gen(2)
    cache = m.init_cache(3)
    hid = m.hidden_size
    with torch.no_grad():
        m(randn((3, 2, hid), g), cache, slots=[0, 1, 2])
        if not verify:
            cache.reset([2])  # slot 2 is free: a call on it is a prefill, which clears its rows first
        cache._lens[:3] = torch.tensor([1, 0, 2], **I32)  # live slot numbers, so the aliased slots decode
    snap = _snapshot(cache)
    rec = cache.recurrent_state.view(-1)
    cases = [
        ("shares memory with slots", randn((2, 1, hid), g), None, cache.seqlens[:2]),
        ("shares memory with slots", randn((2, 1, hid), g), None, cache._lens[2:]),  # with the scratch row
        ("shares memory with slots", randn((1, 3, hid), g), torch.tensor([0, 1, 3], **I32), cache.seqlens[:2]),
        ("shares memory with slots", randn((2, 1, hid), g), None,
         cache.conv_state.flatten()[:2].view(torch.int32)),
        ("shares memory with hidden_states", rec[:2 * hid].view(2, 1, hid), None, [1, 0]),
        ("shares memory with hidden_states", rec[:2 * hid].view(2, 1, hid), None, torch.tensor([1, 0], **I32)),
    ]
    if not verify:  # a prefill of n tokens over the pool's last rows
        n = min(4, rec.numel() // hid)
        assert n >= 2
        cases.append(("shares memory with hidden_states", rec[-n * hid:].view(1, n, hid), None, [2]))
    with torch.no_grad():
        for match, x, cu, slots in cases:
            with pytest.raises(ValueError, match=match):
                m(x, cache, cu, slots=slots, verify=verify)
            _assert_unchanged(cache, snap, match)


def test_decode_step_with_hidden_states_requiring_grad_is_refused_by_name():
    """Parameters frozen, grad mode on, ``hidden_states`` requiring grad: the decode step (forward-only) is a
    RuntimeError naming hidden_states before any row changes; a parameter requiring grad is named alike."""
    m = _as(_layer(1, 1, 16, torch.float64, 6), "triton", torch.float32)
    g = gen(6)
    cache, snap = _held(m, g, 2, 2)
    m.requires_grad_(False)
    x = randn((2, 1, m.hidden_size), g).requires_grad_()
    for slots in ([0, 1], torch.tensor([1, 0], **I32)):
        with pytest.raises(RuntimeError, match="inference only .*hidden_states requires grad"):
            m(x, cache, slots=slots)
        _assert_unchanged(cache, snap)
    m.A_log.requires_grad_(True)
    with pytest.raises(RuntimeError, match="inference only .*A_log requires grad"):
        m(x.detach(), cache, slots=[0, 1])
    _assert_unchanged(cache, snap)


@pytest.mark.parametrize("impl", ["triton", "auto"])
def test_kernel_impl_moved_to_float64_is_refused_before_any_row_changes(impl):
    """A kernel-impl layer moved to float64 after construction: every call (a prefill into a fresh slot, decode steps,
    no cache) is a TypeError naming the layer's dtype and impl, and no cache row changes."""
    m = GatedDeltaNet(32, 1, 2, 16, 16, impl=impl, device=P.device, dtype=torch.float32).to(torch.float64)
    cache = m.init_cache(2)
    with torch.no_grad():
        cache.recurrent_state.normal_()
        cache.conv_state.normal_()
    snap = _snapshot(cache)
    x = randn((1, 20, 32), gen(7), dtype=torch.float64)
    match = f"the layer's dtype.*impl='{impl}'.*float64"
    with torch.no_grad():
        for args, kw in (((x, cache), dict(slots=[1])), ((x, None), {}), ((x[:, :1], cache),
                                                                       dict(slots=torch.tensor([0], **I32)))):
            with pytest.raises(TypeError, match=match):
                m(*args, **kw)
            _assert_unchanged(cache, snap)


def test_pickled_cache_keeps_its_views_of_the_rows():
    """A cache through ``pickle`` (which copies each tensor's storage on its own, unlike ``copy.deepcopy`` and
    ``torch.save``) keeps ``conv_state`` / ``seqlens`` as views of the rows the layer writes: after a decode step on
    both, the copy's public tensors equal the original's."""
    import pickle

    m = GatedDeltaNet(32, 1, 2, 16, 16, impl="triton", device=P.device, dtype=torch.float32)
    g = gen(9)
    cache, _ = _held(m, g, 3, 5)
    twin = pickle.loads(pickle.dumps(cache))
    x = randn((2, 1, 32), g)
    with torch.no_grad():
        out, out_twin = m(x, cache, slots=[0, 1]), m(x, twin, slots=[0, 1])
    assert torch.equal(out, out_twin)
    for name in ("conv_state", "recurrent_state", "seqlens"):
        assert torch.equal(getattr(twin, name), getattr(cache, name)), name
    assert twin.seqlens.tolist() == [6, 6, 0]
    twin.reset([0])
    assert twin.seqlens.tolist() == [0, 6, 0] and twin.holds() == [False, True, False]


@pytest.mark.gpu_only
def test_decode_step_past_65535_sequences():
    """A dense decode step of 65536 sequences (device slots, most of them padding): the live ones equal the same step
    over just them, every other row is untouched."""
    m = GatedDeltaNet(32, 1, 1, 16, 16, impl="triton", device=P.device, dtype=torch.float32)
    g = gen(8)
    cache = m.init_cache(4)
    with torch.no_grad():
        m(randn((4, 3, 32), g), cache, slots=[0, 1, 2, 3])
    twin = copy.deepcopy(cache)
    B = 65536
    slots = torch.full((B,), -1, **I32)
    live = [0, 40000, B - 1]
    slots[live] = torch.tensor([2, 0, 3], **I32)
    x = randn((B, 2, 32), g)
    with torch.no_grad():
        out = m(x, cache, slots=slots)
        ref = m(x[live], twin, slots=[2, 0, 3])
    torch.testing.assert_close(out[live], ref)
    dead = torch.ones(B, dtype=torch.bool, device=P.device)
    dead[live] = False
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))
    for name in ("conv_state", "recurrent_state", "seqlens"):
        torch.testing.assert_close(getattr(cache, name), getattr(twin, name))


def test_prefill_past_the_chunked_ops_head_dims_changes_nothing():
    """head_k_dim 272: the chunked op (a prefill) takes K up to 256; the refusal comes before the fresh slot's rows
    are cleared."""
    m = GatedDeltaNet(32, 1, 1, 272, 16, impl="triton", dtype=torch.float32, device=P.device)
    cache = m.init_cache(2)
    with torch.no_grad():
        cache.recurrent_state.normal_()
        cache.conv_state.normal_()
    snap = _snapshot(cache)
    with torch.no_grad(), pytest.raises(ValueError, match="head_k_dim / head_v_dim"):
        m(randn((1, 4, 32), gen(2)), cache, slots=[1])
    _assert_unchanged(cache, snap)


# ------------------------------------------------------------------------------------------ capturable decode step
def test_decode_step_torch_compile_fullgraph_no_recompiles():
    """The layer's decode step (device slots with padding; dense, packed and verify + commit) under
    ``torch.compile(fullgraph=True, backend="aot_eager")``, several steps == eager, one compile per step kind."""
    from torch._dynamo.testing import CompileCounterWithBackend

    base = _layer(1, 1, 16, torch.float64, 4)
    m = _as(base, "triton", torch.float32)
    g = gen(4)
    eager = m.init_cache(4)
    with torch.no_grad():
        m(randn((3, 3, m.hidden_size), g), eager, slots=[2, 0, 3])
    comp = copy.deepcopy(eager)
    slots = torch.tensor([2, -1, 0, 3], **I32)
    cu = torch.tensor([0, 2, 2, 3, 5], **I32)

    def dense(x, cache):
        return m(x, cache, slots=slots)

    def packed(x, cache):
        return m(x, cache, cu, slots=slots)

    def spec(x, acc, cache):
        out = m(x, cache, slots=slots, verify=True)
        cache.commit(acc)
        return out

    counters = {f: CompileCounterWithBackend("aot_eager") for f in ("dense", "packed", "spec")}
    fns = {"dense": dense, "packed": packed, "spec": spec}
    compiled = {k: torch.compile(f, fullgraph=True, backend=counters[k]) for k, f in fns.items()}
    with torch.no_grad():
        for step in range(3):
            xs = {"dense": (randn((4, 1, m.hidden_size), g),), "packed": (randn((1, 6, m.hidden_size), g),),
                  "spec": (randn((4, 3, m.hidden_size), g), torch.tensor([step, 3, 1, 2], **I32))}
            for k in fns:
                o_c = compiled[k](*xs[k], comp)
                o_e = fns[k](*xs[k], eager)
                torch.testing.assert_close(o_c, o_e, rtol=1e-5, atol=1e-6)
                for name in ("conv_state", "recurrent_state", "seqlens"):
                    torch.testing.assert_close(getattr(comp, name), getattr(eager, name), rtol=1e-5, atol=1e-6)
    assert {k: c.frame_count for k, c in counters.items()} == {"dense": 1, "packed": 1, "spec": 1}


def _gpu_layer():
    base = _layer(4, 2, 128, torch.float64, 6)
    m = _as(base, "triton", torch.bfloat16)
    g = gen(6)
    cache = m.init_cache(12)
    with torch.no_grad():
        m(randn((8, 24, m.hidden_size), g, dtype=torch.bfloat16), cache, slots=[11, 0, 3, 5, 7, 2, 9, 4])
    return m, cache, g, torch.tensor([11, 0, -1, 3, 5, 7, 2, 9, 4], **I32)


@pytest.mark.gpu_only
def test_decode_step_cuda_graph_replays():
    """One decode step (device slots with padding) captured in a CUDA graph and replayed 24 times == eager steps;
    the same for a verify step + commit captured in one graph."""
    m, cache, g, slots = _gpu_layer()
    eager = copy.deepcopy(cache)
    B = slots.numel()
    with torch.no_grad():
        x = torch.zeros(B, 1, m.hidden_size, device="cuda", dtype=torch.bfloat16)
        graph, out = capture_graph(lambda: m(x, cache, slots=slots))
        m(x, eager, slots=slots)  # capture_graph's warm-up ran one real step
        for _ in range(24):
            xi = randn((B, 1, m.hidden_size), g, dtype=torch.bfloat16)
            x.copy_(xi)
            graph.replay()
            torch.testing.assert_close(out, m(xi, eager, slots=slots))
        for name in ("conv_state", "recurrent_state", "seqlens"):
            torch.testing.assert_close(getattr(cache, name), getattr(eager, name))

        xd = torch.zeros(B, 3, m.hidden_size, device="cuda", dtype=torch.bfloat16)
        acc = torch.zeros(B, **I32)

        def spec(xd, acc, c):
            o = m(xd, c, slots=slots, verify=True)
            c.commit(acc)
            return o

        graph, out = capture_graph(lambda: spec(xd, acc, cache))
        spec(xd, acc, eager)
        for _ in range(20):
            xi = randn((B, 3, m.hidden_size), g, dtype=torch.bfloat16)
            ai = torch.randint(0, 4, (B,), generator=g).to(**I32)
            xd.copy_(xi)
            acc.copy_(ai)
            graph.replay()
            torch.testing.assert_close(out, spec(xi, ai, eager))
        for name in ("conv_state", "recurrent_state", "seqlens"):
            torch.testing.assert_close(getattr(cache, name), getattr(eager, name))


@pytest.mark.gpu_only
def test_host_slots_decode_step_cuda_graph():
    """Host slots in a captured decode step: ``0..n-1`` (made by a device op during the capture, not kept) and a
    tuple used once before the capture; replays == eager steps."""
    m, cache, g, _ = _gpu_layer()
    with torch.no_grad():
        m(randn((12, 4, m.hidden_size), g, dtype=torch.bfloat16), cache, slots=list(range(12)))  # every slot held
    x = torch.zeros(12, 1, m.hidden_size, device="cuda", dtype=torch.bfloat16)
    x2 = torch.zeros(3, 1, m.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        m(x, cache)
        m(x2, cache, slots=[7, 1, 4])  # the tuple's index tensors are made here, before the capture
        eager = copy.deepcopy(cache)
        del cache._index[tuple(range(12))]  # made during the capture instead
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = (m(x, cache), m(x2, cache, slots=[7, 1, 4]))
        assert tuple(range(12)) not in cache._index
        for _ in range(20):
            xi, x2i = (randn(t.shape, g, dtype=torch.bfloat16) for t in (x, x2))
            x.copy_(xi)
            x2.copy_(x2i)
            graph.replay()
            torch.testing.assert_close(out[0], m(xi, eager))
            torch.testing.assert_close(out[1], m(x2i, eager, slots=[7, 1, 4]))
    for name in ("conv_state", "recurrent_state", "seqlens"):
        torch.testing.assert_close(getattr(cache, name), getattr(eager, name))


def test_host_slot_tuple_of_a_captured_step_stays_indexed(monkeypatch):
    """The index tensors of a host slot tuple that a CUDA-graph capture read stay in the cache however many other
    tuples are used after it (the graph reads them at every replay: dropped, their memory would be reused under
    it); a tuple with no index tensors yet is refused by name inside a capture, nothing changed. The capture is
    simulated, so this runs on every device."""
    m = _layer(1, 1, 16, torch.float32, 0, impl="reference")
    cache = m.init_cache(40)
    x = randn((2, 3, m.hidden_size), gen(0), dtype=torch.float32)
    with torch.no_grad():
        m(x, cache, slots=[7, 1])  # eager: the tuple's index tensors are made and kept
        kept = cache._index[(7, 1)]
        monkeypatch.setattr(cache, "_capturing", lambda: True)
        m(x[:, :1], cache, slots=[7, 1])  # the captured step reads them
        before = {k: v.clone() for k, v in vars(cache).items() if isinstance(v, torch.Tensor)}
        with pytest.raises(ValueError, match=r"slots: \[3, 1\] have no device index yet"):
            m(x[:, :1], cache, slots=[3, 1])  # a new tuple would need a host-to-device copy inside the capture
        assert all(torch.equal(v, getattr(cache, k)) for k, v in before.items()) and (3, 1) not in cache._index
        monkeypatch.undo()
    others = [(a, b) for a in range(8, 40) for b in range(8, 40) if a != b][:GatedDeltaNetCache._INDEX_CACHE + 8]
    for ids in others:
        cache.reset(list(ids))
    assert cache._index.get((7, 1)) is kept
    assert len(cache._index) == GatedDeltaNetCache._INDEX_CACHE + 1  # the others: the most recent ones


@pytest.mark.gpu_only
def test_decode_step_torch_compile_default_backend():
    m, cache, g, slots = _gpu_layer()
    eager = copy.deepcopy(cache)
    B = slots.numel()
    step = torch.compile(lambda x, c: m(x, c, slots=slots), fullgraph=True)
    with torch.no_grad():
        for _ in range(4):
            xi = randn((B, 1, m.hidden_size), g, dtype=torch.bfloat16)
            torch.testing.assert_close(step(xi, cache), m(xi, eager, slots=slots))
    for name in ("conv_state", "recurrent_state", "seqlens"):
        torch.testing.assert_close(getattr(cache, name), getattr(eager, name))


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_verify_keeps_its_own_bounds(impl):
    """A packed verify step keeps a copy of ``cu_seqlens``: the caller refilling that buffer before ``commit`` (with
    other bounds, or bounds that would not pass a check) changes nothing: the commit equals decoding the accepted
    tokens with the step's own bounds."""
    m = _as(_layer(1, 2, 16, torch.float64, 3), impl, torch.float32)
    g = gen(3)
    pre, draft = randn((2, 5, m.hidden_size), g), randn((1, 6, m.hidden_size), g)
    got, want = m.init_cache(2), m.init_cache(2)
    with torch.no_grad():
        for c in (got, want):
            m(pre, c, slots=[0, 1])
        cu = torch.tensor([0, 3, 6], **I32)
        m(draft, got, cu, slots=[0, 1], verify=True)
        cu[1] = 7  # the caller's buffer, refilled
        got.commit(torch.tensor([3, 2], **I32))
        m(draft[:, [0, 1, 2, 3, 4]], want, torch.tensor([0, 3, 5], **I32), slots=[0, 1])
    assert got.seqlens.tolist() == want.seqlens.tolist() == [8, 7]
    torch.testing.assert_close(got.recurrent_state, want.recurrent_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.conv_state, want.conv_state, rtol=1e-5, atol=1e-5)


def test_layer_and_cache_arguments_of_the_wrong_kind():
    """Sparse / nested hidden states, a CPU slot tensor naming a slot that holds no state (a decode step continues
    one), a ``max_decode_tokens`` that is no count, nested states for ``load_hf_states``, a repeated slot in
    ``gdn_decode_prep``'s CPU slots: a TypeError / ValueError naming the argument, the cache unchanged."""
    from gqla_triton.layers.gdn_step import gdn_decode_prep

    m = _as(_layer(1, 2, 16, torch.float64, 4), "triton", torch.float32)
    g = gen(4)
    cache, snap = _held(m, g, 3, 3)
    x = randn((2, 1, m.hidden_size), g)
    with torch.no_grad():
        for bad in (x.to_sparse(), torch.nested.nested_tensor([x[0], x[1]])):
            with pytest.raises(TypeError, match="hidden_states: expected a dense"):
                m(bad, cache, slots=[0, 1])
        if P.device == "cpu":  # read only where it costs no sync
            with pytest.raises(ValueError, match=r"slots: \[2\] hold no state"):
                m(x, cache, slots=torch.tensor([1, 2], **I32))
        for bad in ("16", None, -1, 2.5, True):
            m.max_decode_tokens = bad
            with pytest.raises(ValueError if bad == -1 else TypeError, match="max_decode_tokens"):
                m(x, cache, slots=[0, 1])
        m.max_decode_tokens = 16
        rec = randn((1, *cache.recurrent_state.shape[1:]), g)
        conv = randn((1, cache.conv_state.shape[1], 4), g)
        with pytest.raises(ValueError, match="conv_state: expected a dense"):
            cache.load_hf_states(torch.nested.nested_tensor([conv[0]]), rec, slots=[2])
    _assert_unchanged(cache, snap)
    if P.device == "cpu":
        H, K, HV, V = m.num_heads, m.head_k_dim, m.num_v_heads, m.head_v_dim
        mixed = randn((2, 1, 2 * H * K + 2 * HV * V + 2 * HV), g)
        with pytest.raises(ValueError, match="slots: a slot is named by more than one"):
            gdn_decode_prep(mixed, m.conv1d.weight.detach(), cache._conv.clone(), cache._lens.clone(),
                            torch.tensor([1, 1], **I32), m.A_log.detach(), m.dt_bias.detach(), num_heads=H,
                            head_k_dim=K, num_v_heads=HV, head_v_dim=V)


def test_decode_step_of_a_layer_holding_strided_weights():
    """A layer whose conv weight is a transposed or expanded (stride 0) tensor (``load_state_dict(assign=True)``
    keeps a tensor's strides) decodes as the layer holding the same values contiguously: outputs and cache rows."""
    base = _as(_layer(1, 2, 16, torch.float64, 6), "triton", torch.float32)
    g = gen(6)
    x0, x1 = randn((2, 3, base.hidden_size), g), randn((2, 2, base.hidden_size), g)
    sd = base.state_dict()
    w = sd["conv1d.weight"]
    for strided in (w.transpose(0, 2).contiguous().transpose(0, 2), w[:1].expand_as(w)):
        m = copy.deepcopy(base)
        m.load_state_dict({**sd, "conv1d.weight": strided}, assign=True)
        ref = copy.deepcopy(base)
        ref.load_state_dict({**sd, "conv1d.weight": strided.contiguous()})
        assert not m.conv1d.weight.is_contiguous()
        with torch.no_grad():
            outs = []
            for layer in (m, ref):
                cache = layer.init_cache(2)
                outs.append((layer(x0, cache), layer(x1, cache), cache))
        (a0, a1, ca), (b0, b1, cb) = outs
        assert torch.equal(a0, b0) and torch.equal(a1, b1)
        _assert_unchanged(ca, _snapshot(cb))
