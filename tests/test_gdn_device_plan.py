"""The chunked GDN op's varlen plan built on the device (ops/gdn/plan.py ``device_plan``, kernels/plan.py): a GPU
cu_seqlens is never read on the host. Under the interpreter the device plan is forced (``plans_on_device``); on
the GPU it is what every varlen call without ``cu_seqlens_cpu`` gets.

What it must do: the same chunk programs and segments as the host plan (padded to bounds from the shapes), the same
results as the host plan where both choose the same launch, no access outside the inputs for any cu_seqlens
values (clamped to [0, T], running maximum), and tokens outside [cu[0], cu[N]) inert: zero outputs and gradients,
no effect on any sequence, whatever values they hold.
"""

import math

import pytest
import torch
from harness import P, dtypes, examples, gdn_problem, pick, randn, seeds
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import gqla_triton.ops.gdn.plan as plan_mod
from gqla_triton.dispatch import config_override, device_info, select_config
from gqla_triton.ops.gdn import chunk_gated_delta_rule

pytestmark = pytest.mark.usefixtures("poison_buffers")

NAMES = ("q", "k", "v", "g", "beta", "h0")
SEG = {"seg_units": 1 << 20, "seg_below": 1 << 20, "seg_min": 1}  # split every sequence into 1-chunk segments
ON_DEVICE = plan_mod.plans_on_device


class _Patch:
    """A context in which varlen calls plan on the device (``"device"``) or from host values (``"host"``)."""

    def __init__(self, where):
        self.where = where

    def __enter__(self):
        self.mp = pytest.MonkeyPatch()
        self.mp.setattr(plan_mod, "plans_on_device", lambda cu: self.where == "device")

    def __exit__(self, *exc):
        self.mp.undo()


def _project(cu: list[int], T: int) -> list[int]:
    """The bounds the device plan takes: each value clamped to [0, T], then the running maximum."""
    out, run = [], 0
    for c in cu:
        run = max(run, min(max(c, 0), T))
        out.append(run)
    return out


def _call(xs, cu, *, grad_seed=None, do=None, **kw):
    """Forward (+ backward when ``grad_seed``: seeded cotangents, or ``do`` for the output's) on copies of ``xs``
    (q, k, v, g, beta, h0 on the device). Returns (o, ht, [grads] or None)."""
    xs = [t.detach().clone().requires_grad_(grad_seed is not None) for t in xs]
    o, ht = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu, **kw)
    if grad_seed is None:
        return o.detach(), ht.detach(), None
    do = randn(o.shape, grad_seed, device=P.device).to(o.dtype) if do is None else do
    dht = randn(ht.shape, grad_seed + 1, device=P.device)
    torch.autograd.backward([o, ht], [do, dht])
    return o.detach(), ht.detach(), [x.grad for x in xs]


def _device_inputs(ins, dtype):
    return [t.to(P.device, dtype if i < 5 else torch.float32) for i, t in enumerate(ins)]


# ------------------------------------------------------------------------------------------------ the plan itself
@settings(max_examples=examples(12, 24), deadline=None)
@given(lens=st.lists(st.integers(0, 300), min_size=1, max_size=7), BT=st.sampled_from([16, 32, 64]),
       L=st.integers(0, 3), HV=st.sampled_from([1, 4]))
def test_device_plan_matches_host_plan(lens, BT, L, HV):
    """cu, coff, the chunk programs and the segments of ``device_plan`` equal the host plan's (``_chunk_index``,
    ``_seg_plan`` with the same segment length); the programs past the real chunks are (-1, 0), the segments past
    the real ones empty at cu[N]; the bounds hold."""
    T = max(1, sum(lens))
    cu_list = [0, *torch.tensor(lens).cumsum(0).tolist()]
    cu_list[-1] = T  # all-empty sequences: the last bound at T (tokens past cu[N] are covered elsewhere)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=P.device)
    K = 16
    q = torch.zeros(1, T, 1, K, device=P.device)
    base = select_config("gdn_chunk", plan_mod.config_key(K, 16), info=device_info(q))
    cfg = base.replace(**{**SEG, "seg_min": L}) if L else base.replace(seg_units=0)
    longest = -(-T // BT)
    plan = plan_mod.device_plan(cfg, device_info(q), cu, T, HV, K, BT, 16)
    assert plan.empty_slots and plan.padding and plan.varlen and plan.N == len(lens)
    assert torch.equal(plan.cu.cpu(), torch.tensor(cu_list, dtype=torch.int64))
    ntt, cidx, coff = plan_mod._chunk_index(tuple(cu_list), BT, torch.device(P.device))
    assert plan.NTT == plan.NG >= ntt and plan.NTT == (T + len(lens) * (BT - 1)) // BT
    assert torch.equal(plan.coff.cpu(), coff.cpu())
    assert torch.equal(plan.cidx[:ntt].cpu(), cidx.cpu())
    assert (plan.cidx[ntt:].cpu() == torch.tensor([-1, 0], dtype=torch.int32)).all()
    Lp = plan_mod.seg_len(cfg, len(lens) * HV, longest)
    if not Lp:
        assert plan.seg is None
        return
    assert plan.seg.L == Lp
    host = plan_mod._seg_plan(tuple(cu_list), Lp, BT, torch.device(P.device))
    assert plan.seg.nseg >= host.nseg
    assert torch.equal(plan.seg.soff.cpu(), host.soff.cpu())
    assert torch.equal(plan.seg.cu[:host.nseg + 1].cpu(), host.cu.cpu())
    assert (plan.seg.cu[host.nseg:].cpu() == T).all()
    assert torch.equal(plan.seg.coff[:host.nseg].cpu(), host.coff.cpu())


@pytest.mark.parametrize("L", [0, 2])
def test_device_plan_many_sequences(L):
    """Past one block of the plan kernel's passes (1024 entries): 2500 sequences (a third of them empty) with
    unsorted raw bounds, in int64; the bounds, chunk programs and segments equal the host plan's of the clamped
    bounds."""
    g = torch.Generator().manual_seed(L)
    lens = torch.randint(0, 90, (2500,), generator=g) * (torch.rand(2500, generator=g) > 0.33)
    T = int(lens.sum()) + 37
    raw = [0, *lens.cumsum(0).tolist()]
    raw[700], raw[1900], raw[2400] = -9, T + 5, 3  # clamped: 0, T (then every later bound is T), T
    cu_list = _project(raw, T)
    cu = torch.tensor(raw, dtype=torch.int64, device=P.device)
    q = torch.zeros(1, T, 1, 16, device=P.device)
    base = select_config("gdn_chunk", plan_mod.config_key(16, 16), info=device_info(q))
    cfg = base.replace(**{**SEG, "seg_min": L}) if L else base.replace(seg_units=0)
    plan = plan_mod.device_plan(cfg, device_info(q), cu, T, 1, 16, 64, 16)
    assert plan.cu.cpu().tolist() == cu_list
    ntt, cidx, coff = plan_mod._chunk_index(tuple(cu_list), 64, torch.device(P.device))
    assert torch.equal(plan.coff.cpu(), coff.cpu()) and torch.equal(plan.cidx[:ntt].cpu(), cidx.cpu())
    assert (plan.cidx[ntt:].cpu() == torch.tensor([-1, 0], dtype=torch.int32)).all()
    assert (plan.seg is not None) == bool(L)
    if L:
        host = plan_mod._seg_plan(tuple(cu_list), plan.seg.L, 64, torch.device(P.device))
        assert torch.equal(plan.seg.soff.cpu(), host.soff.cpu())
        assert torch.equal(plan.seg.cu[:host.nseg + 1].cpu(), host.cu.cpu())
        assert (plan.seg.cu[host.nseg:].cpu() == cu_list[-1]).all()
        assert torch.equal(plan.seg.coff[:host.nseg].cpu(), host.coff.cpu())


# ------------------------------------------------------------------------------------------ results, both plans
def _some_token(lens):
    """``lens`` with a 24-token sequence appended when all are empty (a call without any token is refused)."""
    return lens if any(lens) else [*lens, 24]


@settings(max_examples=examples(4, 12), deadline=None)
@given(lens=st.lists(st.integers(0, pick(140, 700)), min_size=1, max_size=4).map(_some_token),
       G=st.sampled_from([1, 2, 4]), seg=st.booleans(), chunk_size=st.sampled_from(pick([16, 32, 64], [32, 64])),
       opts=st.integers(0, 3), v_first=st.booleans(), dtype=dtypes(), seed=seeds())
@example(lens=[37, 0, 20], G=2, seg=True, chunk_size=16, opts=2, v_first=True, dtype=P.dtypes[0], seed=7)
def test_device_plan_equals_host_plan(lens, G, seg, chunk_size, opts, v_first, dtype, seed):
    """Forward and backward through the device plan equal the host plan's bitwise (a config where both choose the
    same launches: sequences split into 1-chunk segments or not at all, outputs fused or not by the same rule),
    with empty sequences, GVA, every chunk size, both state layouts and fla's beta options. (On the GPU every
    varlen test of test_gdn_chunk.py runs the device plan against the float64 recurrence.)"""
    H, K, V = 1, pick(16, 128), pick(32, 128)
    ins, cu = gdn_problem(seed, lens, True, H, H * G, K, V)
    xs = _device_inputs(ins, dtype)
    cu = cu.to(P.device)
    kw = dict(chunk_size=chunk_size, use_beta_sigmoid_in_kernel=bool(opts & 1), allow_neg_eigval=bool(opts & 2),
              state_layout="vk" if v_first else "kv")
    if v_first:
        xs[5] = xs[5].transpose(-1, -2).contiguous()
    over = {**(SEG if seg else {"seg_units": 0}), "sout_chunks": 0}
    res = {}
    with config_override({"gdn_chunk": over}):
        for where in ("host", "device"):
            with _Patch(where):
                o, ht, dx = _call(xs, cu, grad_seed=seed % 1000, **kw)
                with torch.no_grad():
                    of, htf, _ = _call(xs, cu, **kw)  # a forward without gradient (fused where the config says)
            res[where] = (o, ht, *dx, of, htf)
    for name, a, b in zip(("o", "ht", *("d" + n for n in NAMES), "o (no grad)", "ht (no grad)"), res["host"],
                          res["device"], strict=True):
        assert torch.equal(a, b), f"{name}: device plan differs from host plan"


def test_device_plan_over_a_state_pool():
    """The pool call (inference, rows read and written through state_indices) with the device plan equals the host
    plan's bitwise, and writes only the named rows."""
    dtype = P.dtypes[0]
    ins, cu = gdn_problem(11, [40, 0, 75, 9], True, 1, 2, 16, 32)
    xs = _device_inputs(ins, dtype)
    cu = cu.to(P.device)
    idx = torch.tensor([5, 0, -1, 2], dtype=torch.int32, device=P.device)
    start = randn((6, 2, 16, 32), 12, device=P.device)
    out = {}
    for where in ("host", "device"):
        pool = start.clone()
        with _Patch(where), torch.no_grad():
            o, _ = chunk_gated_delta_rule(*xs[:5], initial_state=pool, state_indices=idx, cu_seqlens=cu)
        out[where] = (o, pool)
    assert torch.equal(out["host"][0], out["device"][0]) and torch.equal(out["host"][1], out["device"][1])
    untouched = [1, 3, 4]
    assert torch.equal(out["device"][1][untouched], start[untouched])


# ------------------------------------------------------------------------------- padding and hostile cu_seqlens
@pytest.mark.parametrize("where", ["host", "device"])
@settings(max_examples=examples(4, 12), deadline=None)
@given(lens=st.lists(st.integers(0, pick(90, 400)), min_size=1, max_size=3), lead=st.integers(0, pick(40, 200)),
       tail=st.integers(0, pick(70, 200)), opts=st.integers(0, 7), seg=st.booleans(), G=st.sampled_from([1, 2]),
       dtype=dtypes(), seed=seeds())
@example(lens=[33, 0, 18], lead=9, tail=21, opts=0, seg=False, G=2, dtype=P.dtypes[0], seed=3)
@example(lens=[0, 0], lead=6, tail=11, opts=5, seg=True, G=2, dtype=P.dtypes[-1], seed=4)
def test_padding_tokens_are_inert(where, lens, lead, tail, opts, seg, G, dtype, seed):
    """Tokens before cu[0] and from cu[N] on (a serving batch padded to a graph's size, FlashQLA's cu[N] < T) hold
    NaN and inf: their outputs and every gradient of them are 0, and the sequences' outputs, final states and
    gradients are bitwise those of the same call with finite padding, and those of the call without the padding
    where both plans split the sequences alike (dA_log / ddt_bias: the same sums in another order); with fla's
    in-kernel gate and beta sigmoid too, with and without sequence splitting, on the host plan and the device plan.
    (The device plan sizes its split from T, so padding may turn splitting on: the same function, rounded
    differently.) Every sequence empty: all tokens padding, ht = h0 and dh0 = dht."""
    assume(sum(lens) + lead + tail > 0)  # no token at all: refused
    empty = sum(lens) == 0
    H, K, V = 1, pick(16, 128), pick(16, 128)
    HV = H * G
    ins, cu = gdn_problem(seed, lens, True, H, HV, K, V)
    T = ins[0].shape[1] + lead + tail

    def pad(fill_value):
        out = []
        for t in ins[:5]:
            fill = torch.full((1, lead + tail, *t.shape[2:]), fill_value, dtype=t.dtype)
            if math.isnan(fill_value):
                fill.view(-1)[::3] = math.inf
            out.append(torch.cat([fill[:, :lead], t, fill[:, lead:]], 1))
        return out + [ins[5]]

    gate = bool(opts & 4)
    kw = dict(use_beta_sigmoid_in_kernel=bool(opts & 1), allow_neg_eigval=bool(opts & 2), use_gate_in_kernel=gate)
    if gate:
        kw["A_log"] = randn((HV,), seed + 3, device=P.device, scale=0.5).requires_grad_()
        kw["dt_bias"] = randn((HV,), seed + 4, device=P.device, scale=0.5).requires_grad_()
    do = randn((1, T, HV, V), seed + 5, device=P.device).to(dtype)  # the padding rows' too: they must not matter
    res, splits = [], []
    with _Patch(where), config_override({"gdn_chunk": SEG if seg else {}}):
        calls = [(pad(math.nan), cu + lead, do), (pad(-0.75), cu + lead, do), (ins, cu, do[:, lead:T - tail])]
        for x, c, d in calls[:2] if empty else calls:
            xs = _device_inputs(x, dtype)
            if gate:
                for p in (kw["A_log"], kw["dt_bias"]):
                    p.grad = None
            o, ht, dx = _call(xs, c.to(P.device), grad_seed=seed % 997, do=d, **kw)
            res.append((o, ht, dx, [p.grad.clone() for p in (kw["A_log"], kw["dt_bias"])] if gate else []))
            plan = plan_mod.chunk_plan(xs[0], xs[2], c.to(P.device))
            splits.append(plan.seg.L if plan.seg is not None else 0)
    inner = slice(lead, T - tail)
    (o, ht, dx, dp) = res[0]
    assert (o[:, :lead] == 0).all() and (o[:, T - tail:] == 0).all(), "padding output not 0"
    for name, a in zip(NAMES[:5], dx[:5], strict=True):
        assert (a[:, :lead] == 0).all() and (a[:, T - tail:] == 0).all(), f"d{name}: padding gradient not 0"
    for name, a in zip(("dA_log", "ddt_bias")[:len(dp)], dp, strict=True):
        assert torch.isfinite(a).all(), f"{name}: the padding reached it"
    assert splits[0] == splits[1]
    if empty:
        assert torch.equal(ht, ins[5].to(P.device, torch.float32)), "an empty sequence's final state is not h0"
        assert torch.equal(dx[5], randn(ht.shape, seed % 997 + 1, device=P.device)), "dh0 is not dht"
        assert all((a == 0).all() for a in dp), "dA_log / ddt_bias not 0 without a token"
    elif where == "host":
        assert splits[0] == splits[2], "the host plan splits from the sequences' own lengths"
    for (o0, ht0, dx0, dp0), what in zip(res[1:], ("finite padding", "no padding"), strict=False):
        if what == "no padding" and splits[0] != splits[2]:
            continue  # the same function over another split (test_device_plan_equals_host_plan and the split tests)
        assert torch.equal(o[:, inner], o0[:, inner] if o0.shape[1] == T else o0), f"o differs from {what}"
        assert torch.equal(ht, ht0), f"the final state differs from {what}"
        for name, a, b in zip(NAMES, dx, dx0, strict=True):
            if name != "h0":
                a, b = a[:, inner], (b[:, inner] if b.shape[1] == T else b)
            assert torch.equal(a, b), f"d{name} differs from {what}"
        for name, a, b in zip(("dA_log", "ddt_bias")[:len(dp)], dp, dp0, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"{name} ({what})")


_BIG = st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(-5, 200))


@settings(max_examples=examples(6, 12), deadline=None)
@given(raw=st.lists(_BIG, min_size=2, max_size=6), i64=st.booleans(), stride=st.sampled_from([1, 2]),
       seed=seeds())
def test_hostile_cu_seqlens_are_clamped(raw, i64, stride, seed):
    """Any cu_seqlens values (negative, past T, decreasing, int32 / int64 extremes; strided) give bitwise the
    results of their projection (clamped to [0, T], running maximum) passed as a well-formed call, and under the
    interpreter touch nothing outside the inputs and the op's own buffers."""
    T, N = 130, len(raw) - 1
    ins, _ = gdn_problem(seed, [T], True, 1, 2, 16, 16)
    ins[5] = ins[5][:1].repeat(N, 1, 1, 1)
    dtype = P.dtypes[0]
    xs = [t.contiguous().requires_grad_() for t in _device_inputs(ins, dtype)]
    wide = torch.tensor([x for r in raw for x in (r, 7)], dtype=torch.int64 if i64 else torch.int32,
                        device=P.device)
    cu = wide[::2] if stride == 2 else wide[::2].contiguous()
    clean = torch.tensor(_project(raw, T), dtype=torch.int32, device=P.device)
    do = randn((1, T, 2, 16), seed + 1, device=P.device).to(dtype)
    outs = []
    with _Patch("device"):
        for c in (cu, clean):
            for x in xs:
                x.grad = None
            if P.big or c is clean:
                o, ht = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=c)
                torch.autograd.backward([o], [do])
            else:
                from addresscheck import AddressCheck

                with AddressCheck(*xs, do, wide, cu) as ac:
                    o, ht = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True,
                                                   cu_seqlens=c)
                    torch.autograd.backward([o], [do])
                ac.assert_clean()
            outs.append((o.detach(), ht.detach(), *(x.grad.clone() for x in xs)))
    for name, a, b in zip(("o", "ht", *("d" + n for n in NAMES)), *outs, strict=True):
        assert torch.equal(a, b), f"{name}: differs from the projected cu_seqlens {_project(raw, T)}"


def test_no_host_read(monkeypatch):
    """Forward + backward, a forward without gradient and the pool call read nothing of cu_seqlens on the host
    (no ``tolist`` / ``item`` / ``__index__`` of it) when planned on the device."""
    monkeypatch.setattr(plan_mod, "plans_on_device", lambda cu: True)
    ins, cu = gdn_problem(4, [20, 50], True, 1, 2, 16, 16)
    cu = cu.to(P.device)
    xs = _device_inputs(ins, P.dtypes[0])
    reads = []
    for meth in ("tolist", "item", "__index__", "__int__", "__bool__"):
        orig = getattr(torch.Tensor, meth)
        monkeypatch.setattr(torch.Tensor, meth, lambda self, *a, _o=orig, _m=meth: (
            reads.append(_m) if self.data_ptr() == cu.data_ptr() else None, _o(self, *a))[1])
    _call(xs, cu, grad_seed=1)
    with torch.no_grad():
        _call(xs, cu)
        chunk_gated_delta_rule(*xs[:5], initial_state=randn((3, 2, 16, 16), 5, device=P.device),
                               state_indices=torch.tensor([0, 2], dtype=torch.int32, device=P.device), cu_seqlens=cu)
    assert not reads, f"cu_seqlens read on the host: {reads}"


@pytest.mark.gpu_only
def test_varlen_prefill_in_a_cuda_graph():
    """A varlen forward over a state pool captured in one CUDA graph (nothing of cu_seqlens read on the host), then
    replayed with other sequence lengths written into the same cu_seqlens: each replay equals the eager call."""
    from harness import capture_graph

    assert ON_DEVICE(torch.zeros(1, device="cuda"))
    H, HV, K, V, T = 2, 8, 128, 128, 1024
    ins, _ = gdn_problem(21, [T], True, H, HV, K, V)
    xs = _device_inputs(ins, torch.bfloat16)
    cu = torch.tensor([0, 100, 100, 700, T], dtype=torch.int32, device="cuda")
    idx = torch.tensor([3, 0, 1, 2], dtype=torch.int32, device="cuda")
    start = randn((4, HV, K, V), 22, device="cuda")
    pool = start.clone()

    def step():
        return chunk_gated_delta_rule(*xs[:5], initial_state=pool, state_indices=idx, cu_seqlens=cu)[0]

    with torch.no_grad():
        graph, o_graph = capture_graph(step)
        for bounds in ([0, 100, 100, 700, T], [0, 1, 513, 900, 1000], [0, 0, 0, 0, T], [5, 64, 128, 640, 641]):
            cu.copy_(torch.tensor(bounds, dtype=torch.int32))
            pool.copy_(start)
            graph.replay()
            got_o, got_pool = o_graph.clone(), pool.clone()
            pool.copy_(start)
            want_o = step()
            assert torch.equal(got_o, want_o) and torch.equal(got_pool, pool), f"replay with cu_seqlens {bounds}"


def test_host_plan_tensors_a_capture_reads_outlive_their_cache(monkeypatch):
    """A plan from host values takes its device tensors (chunk programs, bounds, segments) from caches that drop
    entries; where a CUDA graph is being captured the graph reads them at every replay, so they are kept for good
    then (else a dropped entry's memory could be taken by another allocation while the graph still reads it), and
    are left to their caches otherwise."""
    import gc
    import weakref

    import gqla_triton.ops._common.host as host

    caches = (plan_mod._chunk_index, plan_mod._device_bounds, plan_mod._seg_plan)
    q, v = torch.zeros(1, 256, 1, 32, device=P.device), torch.zeros(1, 256, 2, 32, device=P.device)
    for capturing in (True, False):
        monkeypatch.setattr(host, "capturing", lambda device, c=capturing: c, raising=False)
        with config_override({"gdn_chunk": SEG}):
            bounds = [0, 40 + capturing, 200, 256]  # a plan of its own per case
            plan = plan_mod.chunk_plan(q, v, torch.tensor(bounds, device=P.device), bounds)
        assert plan.seg is not None
        refs = [weakref.ref(t) for t in (plan.cidx, plan.coff, plan.cu, *plan.seg[1:4])]
        del plan
        for cache in caches:
            cache.cache_clear()
        gc.collect()
        assert all((r() is not None) == capturing for r in refs), capturing
