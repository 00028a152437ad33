"""Non-finite inputs through ``chunk_gated_delta_rule``: NaN / ±inf in q, k, v, g, beta or the initial state reach
exactly the outputs the token recurrence sends them to, in the kernels and in the chunked reference.

The recurrence (``recurrent_gated_delta_rule_ref``, float64) defines where: a non-finite k, beta or g (g = +inf or
NaN; g = -inf is a full decay, finite) at token t makes every output of its sequence and value head from t on and
its final state non-finite; a non-finite v[t, c] does so for value column c only; a non-finite q[t] makes row t
only; a non-finite initial-state entry makes its column. Inside a chunk the kernels' dense products would also
carry a value to the chunk's earlier tokens (0·NaN); they must not. Everything finite in the recurrence is finite
here and within the data-derived tolerance, and other sequences / value heads are bitwise as in a clean call.
"""

from __future__ import annotations

import math

import pytest
import torch
from harness import P, assert_close, dtypes, examples, gdn_problem, pick, randn, seeds
from hypothesis import given, settings
from hypothesis import strategies as st

from gqla_triton.dispatch import config_override
from gqla_triton.ops.gdn import chunk_gated_delta_rule
from gqla_triton.ops.gdn.reference import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref

pytestmark = pytest.mark.usefixtures("poison_buffers")

NONFINITE = (math.nan, math.inf, -math.inf)
# where a bad value goes: (input, fraction of the tokens, which head / channel)
SPOTS = st.tuples(st.sampled_from(["q", "k", "v", "g", "beta", "h0"]), st.floats(0, 0.999),
                  st.integers(0, 10**6), st.sampled_from(NONFINITE))


def _spoil(ins, spots, full_decay):
    """Copies of ins with each spot's value written (g: NaN or +inf; -inf there is the valid full decay), and the
    tokens ``full_decay`` (fractions) set to g = -inf."""
    bad = [t.clone() for t in ins]
    names = ("q", "k", "v", "g", "beta", "h0")
    for name, frac, pick_, val in spots:
        t = bad[names.index(name)]
        if name == "g" and val == -math.inf:
            val = math.nan
        flat = t.view(-1)
        if name == "h0":
            flat[pick_ % flat.numel()] = val
            continue
        B, T = t.shape[:2]
        rest = flat.numel() // (B * T)
        b, tok = pick_ % B, int(frac * T)
        flat[(b * T + tok) * rest + pick_ % rest] = val
    for frac in full_decay:
        B, T, HV = bad[3].shape
        bad[3][0, int(frac * T), 0] = -math.inf
    return bad


def _run(ins, dtype, cu, **kw):
    xs = [t.to(P.device, dtype if i < 5 else torch.float32) for i, t in enumerate(ins)]
    with torch.no_grad():
        return chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True,
                                      cu_seqlens=None if cu is None else cu.to(P.device), **kw)


def _check_pattern(name, out, ref, lowp, dtype):
    """out is non-finite exactly where the float64 reference is; the finite rest within the data-derived bound
    (``lowp``: torch's chunked form at the kernel's precision)."""
    fin = torch.isfinite(ref)
    got = torch.isfinite(out.detach().cpu())
    wrong = (got != fin).nonzero()
    assert wrong.numel() == 0, (f"{name}: {len(wrong)} elements finite where the recurrence is not or the other way "
                                f"round, first at {wrong[:4].tolist()}")
    z = torch.zeros((), dtype=torch.float64)
    lowp = lowp.double()  # torch's CPU bf16 products do not carry every NaN: its pattern is not the oracle here
    assert_close(name, torch.where(fin, out.detach().cpu().double(), z), torch.where(fin, ref, z),
                 torch.where(fin & torch.isfinite(lowp), lowp, torch.where(fin, ref, z)), dtype=dtype)


@settings(max_examples=examples(8, 24), deadline=None)
@given(lens=st.lists(st.integers(1, pick(100, 300)), min_size=1, max_size=3), varlen=st.booleans(),
       G=st.sampled_from([1, 2]), chunk_size=st.sampled_from(pick([32, 64], [32, 64])),
       spots=st.lists(SPOTS, min_size=1, max_size=3), full_decay=st.lists(st.floats(0, 0.999), max_size=2),
       seg=st.booleans(), fuse=st.booleans(), dtype=dtypes(), seed=seeds())
def test_nonfinite_inputs_reach_what_the_recurrence_reaches(lens, varlen, G, chunk_size, spots, full_decay, seg,
                                                            fuse, dtype, seed):
    """``fuse`` False: the output comes from its own kernel (``sout_chunks`` 0), not from the state pass."""
    H, K, V = 1, pick(16, 64), pick(32, 64)
    if not varlen:
        lens = [lens[0]] * len(lens)
    ins, cu = gdn_problem(seed, lens, varlen, H, H * G, K, V)
    bad = _spoil([t.to(dtype).double() if i < 5 else t.float().double() for i, t in enumerate(ins)], spots,
                 full_decay)
    over = dict(seg_units=1 << 20, seg_below=1 << 20, seg_min=1) if seg else {}
    if not fuse:
        over["sout_chunks"] = 0
    with config_override({"gdn_chunk": over} if over else {}):
        o, ht = _run(bad, dtype, cu, chunk_size=chunk_size)
    ro, rht = recurrent_gated_delta_rule_ref(*bad[:5], initial_state=bad[5], output_final_state=True, cu_seqlens=cu)
    lo, lht = chunk_gated_delta_rule_ref(*[t.float() for t in bad[:5]], initial_state=bad[5].float(),
                                         output_final_state=True, cu_seqlens=cu, chunk_size=chunk_size,
                                         compute_dtype=dtype if dtype != torch.float32 else None)
    _check_pattern("o", o, ro, lo, dtype)
    _check_pattern("final_state", ht, rht, lht, dtype)


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("what", ["v", "k"])
def test_nonfinite_input_through_both_inference_output_paths(what, fuse):
    """A forward without autograd forms the output in the state pass (``sout``, fuse) or in the output kernel
    (``sout_chunks`` 0); both place a mid-chunk NaN v[t, c] (column c from t on) or k[t] (every column from t on)
    as the float64 recurrence does, in a chunk that also has clean rows before it."""
    dtype = torch.float32 if P.device == "cpu" else torch.bfloat16
    ins, cu = gdn_problem(3, [150], False, 1, 2, pick(16, 64), pick(32, 64))
    bad = [t.to(dtype).double() if i < 5 else t.float().double() for i, t in enumerate(ins)]
    if what == "v":
        bad[2][0, 70, 1, 3] = math.nan
    else:
        bad[1][0, 70, 0, 5] = math.inf
    over = {"sout_chunks": 1 << 20, "sout_waves": 1 << 20} if fuse else {"sout_chunks": 0}
    with config_override({"gdn_chunk": over}):
        o, ht = _run(bad, dtype, cu)
    ro, rht = recurrent_gated_delta_rule_ref(*bad[:5], initial_state=bad[5], output_final_state=True)
    low = dtype if dtype != torch.float32 else None
    lo, lht = chunk_gated_delta_rule_ref(*[t.float() for t in bad[:5]], initial_state=bad[5].float(),
                                         output_final_state=True, compute_dtype=low)
    _check_pattern("o", o, ro, lo, dtype)
    _check_pattern("final_state", ht, rht, lht, dtype)
    assert torch.isfinite(o[0, :70]).all() and o[0, 70:, 0 if what == "k" else 1].isnan().any()


@settings(max_examples=examples(10, 10), deadline=None)
@given(T=st.integers(1, 150), G=st.sampled_from([1, 2]), chunk_size=st.sampled_from([16, 32, 64]),
       spots=st.lists(SPOTS, min_size=1, max_size=3), full_decay=st.lists(st.floats(0, 0.999), max_size=2),
       seed=seeds())
def test_chunked_reference_places_nonfinite_as_the_recurrence(T, G, chunk_size, spots, full_decay, seed):
    """The chunked reference (``impl="reference"``), float64: the recurrence's non-finite pattern exactly, its
    finite values to float64 rounding."""
    ins, _ = gdn_problem(seed, [T], False, 1, G, 16, 24)
    bad = _spoil(ins, spots, full_decay)
    ro, rht = recurrent_gated_delta_rule_ref(*bad[:5], initial_state=bad[5], output_final_state=True)
    co, cht = chunk_gated_delta_rule_ref(*bad[:5], initial_state=bad[5], output_final_state=True,
                                         chunk_size=chunk_size)
    for name, a, r in (("o", co, ro), ("final_state", cht, rht)):
        fin = torch.isfinite(r)
        assert torch.equal(torch.isfinite(a), fin), f"{name}: non-finite pattern differs from the recurrence"
        z = torch.zeros((), dtype=torch.float64)
        assert_close(name, torch.where(fin, a, z), torch.where(fin, r, z), dtype=torch.float64)


@pytest.mark.parametrize("what", ["k", "v", "beta", "g", "q"])
def test_nonfinite_token_spares_the_chunks_earlier_tokens_and_other_sequences(what):
    """One NaN at token 40 of the second sequence (a chunk that starts at token 0 of it): its tokens 0 .. 39 and
    the first sequence are bitwise as in the clean call, forward and backward (the backward's gradients of the
    first sequence); the bad sequence's outputs from token 40 on are NaN (all of them but v's column; q: row 40
    only)."""
    dtype = P.dtypes[0]
    ins, cu = gdn_problem(3, [50, 100], True, 1, 2, 16, 32)
    names = ("q", "k", "v", "g", "beta")
    bad = [t.clone() for t in ins]
    t_bad = 50 + 40
    t = bad[names.index(what)]
    t[(0, t_bad, 0, 0)[:t.dim()]] = math.nan  # v: one entry (column 0 of value head 0); q, k: one channel
    outs = []
    for xs in (ins, bad):
        xs = [t.to(P.device, dtype if i < 5 else torch.float32).requires_grad_() for i, t in enumerate(xs)]
        o, ht = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True,
                                       cu_seqlens=cu.to(P.device))
        do = randn(o.shape, 5, dtype=o.dtype, device=P.device)
        torch.autograd.backward([o], [do])
        outs.append((o.detach(), ht.detach(), [x.grad for x in xs]))
    (o, ht, dx), (ob, htb, dxb) = outs
    assert torch.equal(ob[:, :t_bad], o[:, :t_bad]) and torch.equal(htb[0], ht[0])
    if what in ("v", "g", "beta"):  # per value head (q and k are shared by both)
        assert torch.equal(ob[:, t_bad:, 1], o[:, t_bad:, 1])
    if what == "q":
        assert ob[0, t_bad].isnan().all() and torch.equal(ob[:, t_bad + 1:], o[:, t_bad + 1:])
    elif what == "v":
        assert ob[0, t_bad:, 0, 0].isnan().all() and torch.isfinite(ob[0, t_bad:, 0, 1:]).all()
    else:
        assert ob[0, t_bad:, 0].isnan().all() and htb[1, 0].isnan().all()
    for name, a, b in zip(("q", "k", "v", "g", "beta", "h0"), dx, dxb, strict=True):
        assert torch.equal(a[:, :50], b[:, :50]) if name != "h0" else torch.equal(a[0], b[0]), \
            f"d{name}: the clean sequence's gradient changed"


@pytest.mark.skipif(P.big, reason="checks every address the interpreter dereferences")
def test_nonfinite_paths_stay_in_bounds():
    """The kernels' paths over chunks with non-finite inputs (odd head dims: masked tiles; varlen) address only
    the tensors passed in and the op's own buffers, forward and backward."""
    from addresscheck import AddressCheck

    ins, cu = gdn_problem(1, [30, 45], True, 1, 2, 24, 20)
    ins[2][0, 40, 1, 3] = math.nan  # v: the second sequence's first chunk
    ins[1][0, 60, 0, 5] = math.inf  # k
    xs = [t.float().contiguous().requires_grad_() for t in ins]
    do = torch.randn(1, 75, 2, 20)
    with AddressCheck(*xs, do, cu) as ac:
        o, _ = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu)
        torch.autograd.backward([o], [do])
    ac.assert_clean()
    assert o[0, 40:, 1, 3].isnan().all() and torch.isfinite(o[0, :40]).all()
