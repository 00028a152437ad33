"""fla's keyword options on ``chunk_gated_delta_rule`` and ``gated_delta_rule_decode``, and fla's recurrent function
``fused_recurrent_gated_delta_rule``.

Options at the value that changes nothing give bit-identical results to the call without them (which the op tests
check against float64 references); every other value is a ``ValueError`` naming the option as unsupported and
changes nothing; unknown keywords are a ``TypeError`` naming them. The decode step's in-kernel options are tested
in test_gdn_decode_options.py.
"""

import warnings

import numpy as np
import pytest
import torch
from harness import P, assert_close, rand, randn

import gqla_triton.ops.gdn.plan as plan_mod
from gqla_triton.ops.gdn import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, gated_delta_rule_decode
from gqla_triton.ops.gdn.reference import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref

pytestmark = pytest.mark.usefixtures("poison_buffers")

H, HV, K, V = 1, 2, 16, 16
NOOP_COMMON = dict(use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                   state_v_first=False, transpose_state_layout=False, head_first=False, A_log=None, dt_bias=None)
# both functions take the V-first layout flags, the in-kernel gate, beta sigmoid and negative eigenvalues (chunked
# op: tests/test_gdn_chunk_options.py)
UNSUPPORTED_CHUNK = [("head_first", True), ("cp_context", object())]
# the decode step computes the in-kernel gate / beta / eigenvalue options and the V-first layout
# (tests/test_gdn_decode_options.py)
UNSUPPORTED_DECODE = [("head_first", True), ("inplace_final_state", False), ("output_final_state", True),
                      ("num_accepted_tokens", "tensor")]


def _inputs(B, T, seed, dtype=torch.float32):
    q = randn((B, T, H, K), seed, dtype=dtype)
    k = randn((B, T, H, K), seed + 1, dtype=dtype)
    v = randn((B, T, HV, V), seed + 2, dtype=dtype)
    g = -rand((B, T, HV), seed + 3, lo=0.01, hi=0.5)
    beta = rand((B, T, HV), seed + 4, lo=0.1, hi=0.9)
    return q, k, v, g, beta


def _value(v):
    return torch.zeros(HV, device=P.device) if isinstance(v, str) else v


def _chunk_indices(cu, bt=64):
    pairs = [(n, c) for n in range(len(cu) - 1) for c in range(-(-(cu[n + 1] - cu[n]) // bt))]
    return torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_chunk_noop_options_change_nothing(impl):
    """head_first=False, chunk_size=64, chunk_indices consistent with cu_seqlens, cu_seqlens_cpu, and the off
    values of the in-kernel gate / beta / eigenvalue / layout options: bit-identical to the plain call."""
    cu_list = [0, 5, 5, 70, 72]
    T = cu_list[-1]
    dtype = P.dtypes[0]  # float32 under the interpreter, bfloat16 on the GPU
    q, k, v, g, beta = _inputs(1, T, 11, dtype)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=P.device)
    h0 = randn((4, HV, K, V), 12)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, impl=impl)
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    ref = dict(output_final_state=True, use_qk_l2norm=True, cu_seqlens=cu)
    o64, ht64 = chunk_gated_delta_rule_ref(*(t.double() for t in (q, k, v, g, beta)), initial_state=h0.double(), **ref)
    olp, htlp = chunk_gated_delta_rule_ref(*(t.float() for t in (q, k, v, g, beta)), initial_state=h0, **ref,
                                           compute_dtype=dtype if dtype != torch.float32 else None)
    assert_close("o", o, o64, olp, dtype=dtype)
    assert_close("final state", ht, ht64, htlp, dtype=dtype)
    o2, ht2 = chunk_gated_delta_rule(q, k, v, g, beta, **kw, **NOOP_COMMON, chunk_size=64, cp_context=None,
                                     chunk_indices=_chunk_indices(cu_list), cu_seqlens_cpu=torch.tensor(cu_list))
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
    assert _chunk_indices(cu_list).shape[0] == 1 + 0 + 2 + 1  # 5, 0, 65, 2 tokens


def test_chunk_noop_options_without_varlen():
    q, k, v, g, beta = _inputs(2, 9, 21)
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    o2, _ = chunk_gated_delta_rule(q, k, v, g, beta, head_first=False, chunk_size=64, use_gate_in_kernel=False)
    assert torch.equal(o, o2)


@pytest.mark.parametrize(("name", "value"), UNSUPPORTED_CHUNK)
def test_chunk_unsupported_options_are_refused(name, value):
    q, k, v, g, beta = _inputs(1, 4, 31)
    pool = randn((3, HV, K, V), 32)
    keep = pool.clone()
    idx = torch.tensor([2], dtype=torch.int32, device=P.device)
    with pytest.raises(ValueError, match=f"{name}.*not supported"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool, state_indices=idx, **{name: _value(value)})
    assert torch.equal(pool, keep)


@pytest.mark.parametrize("name", ["foo", "ssm_state_indices", "inplace_final_state", "num_accepted_tokens"])
def test_chunk_unknown_keywords_raise_type_error(name):
    q, k, v, g, beta = _inputs(1, 4, 41)
    with pytest.raises(TypeError, match=f"unexpected keyword argument.*'{name}'"):
        chunk_gated_delta_rule(q, k, v, g, beta, **{name: None})


def test_chunk_option_types_and_chunk_indices_checks():
    q, k, v, g, beta = _inputs(1, 70, 51)
    cu_list = [0, 64, 70]
    cu = torch.tensor(cu_list, device=P.device)
    ci = _chunk_indices(cu_list)
    call = lambda **kw: chunk_gated_delta_rule(q, k, v, g, beta, **kw)  # noqa: E731
    for name in ("head_first", "use_gate_in_kernel", "state_v_first"):
        with pytest.raises(TypeError, match=f"{name}: expected a bool"):
            call(**{name: 0})
    with pytest.raises(TypeError, match="chunk_size: expected an int"):
        call(chunk_size=64.0)
    pool = randn((2, HV, K, V), 52)
    keep = pool.clone()
    idx = torch.tensor([1], dtype=torch.int32, device=P.device)
    for bad in (0, 8, 48, 128, -16):
        with pytest.raises(ValueError, match=r"chunk_size: expected one of \(16, 32, 64\)"):
            call(chunk_size=bad)
        with pytest.raises(ValueError, match=rf"^chunk_size: expected one of \(16, 32, 64\), got {bad}$"):
            with torch.no_grad():
                call(chunk_size=bad, initial_state=pool, state_indices=idx)
    assert torch.equal(pool, keep)
    # checked against the host values of cu_seqlens: its host copy, or itself on the CPU (a GPU tensor is not read)
    for host in ({"cu_seqlens_cpu": cu_list},) + (({},) if cu.device.type == "cpu" else ()):
        with pytest.raises(ValueError, match=r"chunk_indices: 2 chunks, but cu_seqlens \[0, 64, 70\] has 3 chunks "
                                             "of 32"):
            call(cu_seqlens=cu, chunk_indices=ci, chunk_size=32, **host)  # chunk_indices count chunks of chunk_size
        with pytest.raises(ValueError, match="chunk_indices: 3 chunks, but cu_seqlens"):
            call(cu_seqlens=cu, chunk_indices=_chunk_indices([0, 64, 65, 70]), **host)
        with pytest.raises(ValueError, match="chunk_indices: does not match cu_seqlens"):
            call(cu_seqlens=cu, chunk_indices=ci.flip(0), **host)
    with pytest.raises(ValueError, match="chunk_indices: given without cu_seqlens"):
        call(chunk_indices=ci)
    with pytest.raises(ValueError, match=r"chunk_indices: expected \[NT, 2\]"):
        call(cu_seqlens=cu, chunk_indices=ci[:, :1])
    with pytest.raises(TypeError, match="chunk_indices: expected int32 or int64"):
        call(cu_seqlens=cu, chunk_indices=ci.float())
    with pytest.raises(TypeError, match="chunk_indices: expected a torch.Tensor"):
        call(cu_seqlens=cu, chunk_indices=ci.tolist())
    # matching shape, values on a device are not read: only checkable on the host
    o, _ = call(cu_seqlens=cu, chunk_indices=ci.to(torch.int32), cu_seqlens_cpu=cu_list, impl="reference")
    assert o.shape == v.shape


def _pool_call(**kw):
    B, s = 2, 3
    q, k, v, g, beta = _inputs(B, s, 61)
    state = randn((4, HV, K, V), 62)
    idx = torch.tensor([3, 1], dtype=torch.int32, device=P.device)
    return (q, k, v, g, beta, state, idx), kw


def test_flags_take_bools_and_name_a_tensor_in_their_place():
    """``output_final_state`` and ``use_qk_l2norm_in_kernel`` of the three GDN functions take a bool (or 0 / 1); a
    tensor there (cu_seqlens passed ninth, as some fla forks order it) is a TypeError naming the flag, not torch's
    ambiguous-truth error; a bool tenth (fla 0.6's use_beta_sigmoid_in_kernel) is a TypeError naming cu_seqlens."""
    q, k, v, g, beta = _inputs(1, 8, 61)
    cu = torch.tensor([0, 3, 8], device=P.device)
    with pytest.raises(TypeError, match=r"use_qk_l2norm_in_kernel: expected a bool, got a tensor of shape \[3\] "
                                        r"\(cu_seqlens is the tenth argument"):
        chunk_gated_delta_rule(q, k, v, g, beta, None, None, False, cu)
    for flag in (False, True):  # fla 0.6's positional order: use_beta_sigmoid_in_kernel tenth
        with pytest.raises(TypeError, match=r"cu_seqlens: expected a torch.Tensor or None, got a bool .*fla 0.6"):
            chunk_gated_delta_rule(q, k, v, g, beta, None, None, False, False, flag)
    for bad in ("yes", 2, 0.5, torch.tensor(True)):
        for name in ("output_final_state", "use_qk_l2norm_in_kernel"):
            with pytest.raises(TypeError, match=f"{name}: expected a bool"):
                chunk_gated_delta_rule(q, k, v, g, beta, **{name: bad})
            with pytest.raises(TypeError, match=f"{name}: expected a bool"):
                fused_recurrent_gated_delta_rule(q, k, v, g, beta, **{name: bad})
        state = torch.zeros(1, HV, K, V, device=P.device)
        with pytest.raises(TypeError, match="use_qk_l2norm_in_kernel: expected a bool"):
            gated_delta_rule_decode(q, k, v, g, beta, state, use_qk_l2norm_in_kernel=bad)
    o1, _ = chunk_gated_delta_rule(q, k, v, g, beta, None, None, 1, 1)
    o2, _ = chunk_gated_delta_rule(q, k, v, g, beta, None, None, True, True)
    assert torch.equal(o1, o2)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_decode_noop_options_change_nothing(impl):
    """cu_seqlens_cpu, inplace_final_state=True, output_final_state=False and the off values of the other
    options: bit-identical outputs and state pools to the plain call."""
    cu_list = [0, 2, 2, 5]
    q, k, v, g, beta = _inputs(1, 6, 71)  # token 5 is padding
    state = randn((4, HV, K, V), 72)
    idx = torch.tensor([3, 0, 1], dtype=torch.int32, device=P.device)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=P.device)
    s1, s2 = state.clone(), state.clone()
    o1 = gated_delta_rule_decode(q, k, v, g, beta, s1, idx, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, impl=impl)
    o2 = gated_delta_rule_decode(q, k, v, g, beta, s2, idx, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                 cu_seqlens_cpu=torch.tensor(cu_list), inplace_final_state=True,
                                 output_final_state=False, num_accepted_tokens=None, impl=impl, **NOOP_COMMON)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    assert not torch.equal(s1, state)  # the step did update the pool
    o3 = gated_delta_rule_decode(q, k, v, g, beta, state.clone(), idx, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                 cu_seqlens_cpu=cu_list, impl=impl)
    assert torch.equal(o1, o3)


@pytest.mark.parametrize(("name", "value"), UNSUPPORTED_DECODE)
def test_decode_unsupported_options_are_refused(name, value):
    (q, k, v, g, beta, state, idx), _ = _pool_call()
    keep = state.clone()
    with pytest.raises(ValueError, match=f"{name}.*not supported"):
        gated_delta_rule_decode(q, k, v, g, beta, state, idx, **{name: _value(value)})
    assert torch.equal(state, keep)


@pytest.mark.parametrize("name", ["foo", "chunk_indices", "chunk_size", "cp_context", "initial_state"])
def test_decode_unknown_keywords_raise_type_error(name):
    (q, k, v, g, beta, state, idx), _ = _pool_call()
    keep = state.clone()
    with pytest.raises(TypeError, match=f"unexpected keyword argument.*'{name}'"):
        gated_delta_rule_decode(q, k, v, g, beta, state, idx, **{name: None})
    assert torch.equal(state, keep)


@pytest.mark.parametrize("op", ["chunk", "decode"])
def test_cu_seqlens_cpu_is_taken_alike_by_both_functions(op):
    """Both GDN functions take one form of ``cu_seqlens_cpu``: integers of any integral type (numpy's, as
    ``list(array)`` gives) are ints, a tensor of another rank is refused as not 1-D (ValueError), a bool is refused
    (TypeError); a refused call leaves the pool as it was."""
    q, k, v, g, beta = _inputs(1, 5, 91)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=P.device)
    state = randn((2, HV, K, V), 92)
    keep = state.clone()

    def call(host):
        if op == "chunk":
            return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                          cu_seqlens=cu, cu_seqlens_cpu=host)
        return gated_delta_rule_decode(q, k, v, g, beta, state, cu_seqlens=cu, cu_seqlens_cpu=host), state.clone()

    for bad, exc, match in ((torch.tensor([[0, 2, 5]]), ValueError, "1-D"), ([0, True, 5], TypeError, "ints")):
        with pytest.raises(exc, match=f"cu_seqlens_cpu: .*{match}"):
            call(bad)
        assert torch.equal(state, keep)
    want = call([0, 2, 5])
    state.copy_(keep)
    got = call([np.int64(0), np.int32(2), np.int64(5)])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

def test_decode_cu_seqlens_cpu_checks():
    q, k, v, g, beta = _inputs(1, 5, 81)
    state = randn((2, HV, K, V), 82)
    keep = state.clone()
    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=P.device)
    call = lambda **kw: gated_delta_rule_decode(q, k, v, g, beta, state, **kw)  # noqa: E731
    for bad, exc, match in (([0, 2], ValueError, "expected 3 values"), ([0, 3, 2], ValueError, "non-decreasing"),
                            ([0, 2, 6], ValueError, "within"), ([-1, 2, 5], ValueError, "within"),
                            (torch.tensor([0.0, 2, 5]), TypeError, "CPU int32/int64"),
                            (torch.tensor([[0, 2, 5]]), ValueError, "1-D"), ("0,2,5", TypeError, "sequence of ints")):
        with pytest.raises(exc, match=f"cu_seqlens_cpu: .*{match}"):
            call(cu_seqlens=cu, cu_seqlens_cpu=bad)
    with pytest.raises(ValueError, match="cu_seqlens_cpu: given without cu_seqlens"):
        gated_delta_rule_decode(q.reshape(5, 1, H, K), k.reshape(5, 1, H, K), v.reshape(5, 1, HV, V),
                                g.reshape(5, 1, HV), beta.reshape(5, 1, HV), randn((5, HV, K, V), 83),
                                cu_seqlens_cpu=[0, 5])
    with pytest.raises(TypeError, match="inplace_final_state: expected a bool"):
        call(inplace_final_state=1)
    if cu.device.type == "cpu":  # read with no sync: the host copy must equal it, as for the chunked op
        with pytest.raises(ValueError, match=r"cu_seqlens_cpu: \[0, 4, 5\] differs from cu_seqlens \[0, 2, 5\]"):
            call(cu_seqlens=cu, cu_seqlens_cpu=[0, 4, 5])
    assert torch.equal(state, keep)
    call(cu_seqlens=cu.new_tensor([0, 2, 4]), cu_seqlens_cpu=[0, 2, 4])  # padded: token 4 belongs to no sequence
    assert not torch.equal(state, keep)


# ------------------------------------------------------------------------------ fused_recurrent_gated_delta_rule


def _recurrent_ref(q, k, v, g, beta, h0, cu, l2, cdt):
    """fla's recurrent function on the CPU in ``cdt`` (g None: no decay; beta None: ones)."""
    B, T, HVv = v.shape[:3]
    g = torch.zeros(B, T, HVv) if g is None else g
    beta = torch.ones(B, T, HVv) if beta is None else beta
    return recurrent_gated_delta_rule_ref(*(t.to("cpu", cdt) for t in (q, k, v, g, beta)),
                                          initial_state=None if h0 is None else h0.to("cpu", cdt),
                                          output_final_state=True, use_qk_l2norm=l2,
                                          cu_seqlens=None if cu is None else cu.cpu())


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("case", ["h0", "no_h0", "no_g_beta", "v_first"])
def test_fused_recurrent_matches_the_recurrence(varlen, case):
    """fla's recurrent function against float64: outputs in v's dtype, fp32 final states only when asked for, the
    initial states left as they were, the V-first layout transposing both; the chunked op gives the same result."""
    dtype = P.dtypes[-1]
    cu_list = [0, 7, 7, 40, 45]
    B, T = (1, cu_list[-1]) if varlen else (3, 20)
    N = len(cu_list) - 1 if varlen else B
    cu = torch.tensor(cu_list, dtype=torch.int64, device=P.device) if varlen else None
    q, k, v, g, beta = _inputs(B, T, 91, dtype)
    if case == "no_g_beta":
        g, beta = None, None
    h0 = randn((N, HV, K, V), 92, scale=0.5) if case in ("h0", "v_first") else None
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    o64, s64 = _recurrent_ref(q, k, v, g, beta, h0, cu, True, torch.float64)
    olp, slp = _recurrent_ref(q, k, v, g, beta, h0, cu, True, torch.float32)
    if case == "v_first":
        keep = h0.transpose(-1, -2).contiguous()
        o, ht = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **{**kw, "initial_state": keep},
                                                 state_v_first=True)
        assert torch.equal(keep, h0.transpose(-1, -2)), "the initial states were written"
        ht = ht.transpose(-1, -2)
    else:
        keep = None if h0 is None else h0.clone()
        o, ht = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **kw)
        assert h0 is None or torch.equal(h0, keep), "the initial states were written"
    assert o.dtype == v.dtype and ht.dtype == torch.float32 and tuple(ht.shape) == (N, HV, K, V)
    assert_close("o", o, o64, olp.to(dtype), dtype=dtype)
    assert_close("final state", ht, s64, slp, dtype=torch.float32)
    _, none = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **{**kw, "output_final_state": False,
                                                                     "initial_state": None})
    assert none is None
    if g is not None:
        oc, hc = chunk_gated_delta_rule(q, k, v, g, beta, **kw)
        assert_close("o (chunked op)", oc, o64, olp.to(dtype), dtype=dtype)


def _fla_recurrence(q, k, v, g, gk, gv, beta, h0, cu, scale):
    """fla's fused recurrent kernel's arithmetic written out in float64, token by token: per value head the state
    ``[K, V]`` is scaled by exp(g), then row-wise by exp(gk) and column-wise by exp(gv), then the delta rule with a
    per-head or per-value beta (q, k already normalised; value head i uses q/k head i // (HV // H))."""
    f = lambda t: None if t is None else t.detach().double().cpu()  # noqa: E731
    q, k, v, g, gk, gv, beta, h0 = map(f, (q, k, v, g, gk, gv, beta, h0))
    B, T, Hq, Kd = q.shape
    HVv, Vd = v.shape[2:]
    rep = HVv // Hq
    seqs = ([(0, a, b) for a, b in zip(cu[:-1], cu[1:], strict=True)] if cu is not None
            else [(b, 0, T) for b in range(B)])
    o = torch.zeros(B, T, HVv, Vd, dtype=torch.float64)
    finals = torch.zeros(len(seqs), HVv, Kd, Vd, dtype=torch.float64)
    for n, (b, lo, hi) in enumerate(seqs):
        for hv in range(HVv):
            S = h0[n, hv].clone() if h0 is not None else torch.zeros(Kd, Vd, dtype=torch.float64)
            for t in range(lo, hi):
                if g is not None:
                    S = S * torch.exp(g[b, t, hv])
                if gk is not None:
                    S = S * torch.exp(gk[b, t, hv])[:, None]
                if gv is not None:
                    S = S * torch.exp(gv[b, t, hv])[None, :]
                kt, qt = k[b, t, hv // rep], q[b, t, hv // rep]
                bt = 1.0 if beta is None else beta[b, t, hv]
                S = S + kt[:, None] * (bt * (v[b, t, hv] - kt @ S))[None, :]
                o[b, t, hv] = scale * (qt @ S)
            finals[n, hv] = S
    return o, finals


@pytest.mark.parametrize("gates", ["gk", "gv", "gk+gv", "g+gk+gv"])
@pytest.mark.parametrize("beta_kind", ["head", "value", "none"])
@pytest.mark.parametrize("layout", ["kv", "vk+varlen"])
def test_fused_recurrent_per_channel_decays_and_beta(gates, beta_kind, layout):
    """fla's per-key / per-value decays and per-value beta: outputs and final states against fla's arithmetic in
    float64, through the kernel and through the reference implementation, both state layouts, packed sequences."""
    dtype = P.dtypes[-1]
    varlen = layout.endswith("varlen")
    cu_list = [0, 9, 9, 30]
    B, T = (1, cu_list[-1]) if varlen else (2, 13)
    N = len(cu_list) - 1 if varlen else B
    cu = torch.tensor(cu_list, dtype=torch.int64, device=P.device) if varlen else None
    q, k, v, g, beta = _inputs(B, T, 101, dtype)
    q = q / q.float().norm(dim=-1, keepdim=True).to(dtype)
    k = k / k.float().norm(dim=-1, keepdim=True).to(dtype)
    g = g if gates.startswith("g+") else None
    gk = -rand((B, T, HV, K), 102, lo=0.0, hi=0.4) if "gk" in gates else None
    gv = -rand((B, T, HV, V), 103, lo=0.0, hi=0.4) if "gv" in gates else None
    beta = {"head": beta, "value": rand((B, T, HV, V), 104, lo=0.1, hi=0.9), "none": None}[beta_kind]
    h0 = randn((N, HV, K, V), 105, scale=0.5)
    want_o, want_h = _fla_recurrence(q, k, v, g, gk, gv, beta, h0, cu_list if varlen else None, K ** -0.5)
    v_first = layout.startswith("vk")
    init = h0.transpose(-1, -2).contiguous() if v_first else h0
    for impl in ("auto", "reference"):
        o, ht = fused_recurrent_gated_delta_rule(q, k, v, g=g, gk=gk, gv=gv, beta=beta, initial_state=init,
                                                 output_final_state=True, cu_seqlens=cu, state_v_first=v_first,
                                                 impl=impl)
        ht = ht.transpose(-1, -2) if v_first else ht
        lowp = _fla_recurrence(q.float(), k.float(), v, g, gk, gv, beta, h0, cu_list if varlen else None,
                               K ** -0.5)[0].to(dtype)
        assert_close(f"o ({impl})", o, want_o, lowp, dtype=dtype)
        assert_close(f"final state ({impl})", ht, want_h, None, dtype=torch.float32, eps=1e-5)


def test_fused_recurrent_inputs_that_require_grad():
    """As fla's: the forward runs on inputs that require grad; a backward through its outputs raises fla's
    ``NotImplementedError``. (fla's signature: g, gk, gv, beta in that order, so g and beta go by keyword.)"""
    q, k, v, g, beta = _inputs(2, 6, 93)
    q.requires_grad_()
    o, ht = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True)
    with torch.no_grad():
        o2, ht2 = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(ht, ht2) and o.requires_grad
    with pytest.raises(NotImplementedError, match="forward-only"):
        o.sum().backward()


def test_fused_recurrent_refusals():
    """fla's options this function does not compute are refused by name, as are unknown keywords."""
    q, k, v, g, beta = _inputs(1, 4, 94)
    B, T = 1, 4
    shape = r"expected shape \[1, 4, 2, 16\], got \[1, 4, 2, 17\]"
    for kw, exc, match in ((dict(gk=torch.zeros(B, T, HV, V + 1, device=P.device)), ValueError, f"^gk: {shape}"),
                           (dict(gv=torch.zeros(B, T, HV, K + 1, device=P.device)), ValueError, f"^gv: {shape}"),
                           (dict(gk=torch.zeros(B, T, HV, K, dtype=torch.int32, device=P.device)), TypeError,
                            r"^gk: expected dtype in \(.*\), got int32"),
                           (dict(beta=torch.ones(B, T, HV, V + 1, device=P.device)), ValueError, f"^beta: {shape}"),
                           (dict(g=None, use_gate_in_kernel=True, A_log=torch.zeros(HV, device=P.device)),
                            ValueError, "^g: required with use_gate_in_kernel=True"),
                           (dict(head_first=True), ValueError, "^head_first=True is not supported"),
                           (dict(cp_context=None), TypeError, r"unexpected keyword argument\(s\) 'cp_context'"),
                           (dict(output_final_state="yes"), TypeError, "^output_final_state: expected a bool, got str"),
                           (dict(state_v_first=1), TypeError, "^state_v_first: expected a bool, got int"),
                           (dict(state_v_first=True, transpose_state_layout=False), ValueError,
                            "^state_v_first=True and transpose_state_layout=False: .*contradict"),
                           (dict(initial_state=randn((2, HV, K, V), 95)), ValueError,
                            r"^initial_state: expected shape \[1, 2, 16, 16\], got \[2, 2, 16, 16\]"),
                           (dict(cu_seqlens=torch.zeros(0, dtype=torch.int64, device=P.device)), ValueError,
                            r"^cu_seqlens: expected \[N\+1\] with N >= 1, got shape \[0\]"),
                           (dict(cu_seqlens=[0, 4]), TypeError, "^cu_seqlens: expected a torch.Tensor, got list")):
        args = dict(g=g, beta=beta) | kw
        with pytest.raises(exc, match=match):
            fused_recurrent_gated_delta_rule(q, k, v, **args)
    o1, h1 = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True,
                                              transpose_state_layout=True)
    o2, h2 = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True, state_v_first=True)
    assert torch.equal(o1, o2) and torch.equal(h1, h2) and tuple(h1.shape) == (1, HV, V, K)


def test_fused_recurrent_torch_compile():
    """``torch.compile(fullgraph=True)`` of fla's recurrent function (transformers compiles its decode step) equals the
    eager call, outputs and final states, with and without a per-key decay."""
    q, k, v, g, beta = _inputs(1, 6, 96)
    cu = torch.tensor([0, 2, 6], dtype=torch.int64, device=P.device)
    h0 = randn((2, HV, K, V), 97, scale=0.5)
    gk = -rand((1, 6, HV, K), 98, lo=0.0, hi=0.3)

    def f(q, k, v, g, beta, h0, gk):
        o, ht = fused_recurrent_gated_delta_rule(q, k, v, g=g, gk=gk, beta=beta, initial_state=h0,
                                                 output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        return o * 2, ht

    backend = "aot_eager" if P.device == "cpu" else "inductor"
    for decay in (None, gk):  # fla's per-key decay: optional tensors of the custom op
        o1, h1 = torch.compile(f, fullgraph=True, backend=backend)(q, k, v, g, beta, h0, decay)
        o2, h2 = f(q, k, v, g, beta, h0, decay)
        torch.testing.assert_close(o1, o2)
        torch.testing.assert_close(h1, h2)


# ------------------------------------------------------------------ fla's deprecated layout name, FlashQLA's keywords


def _layout_call(op, layout_kw, seed=101):
    """One call of ``op`` with the V-first layout flags ``layout_kw``: its outputs (o, and the final state or the
    updated pool), each [V, K] state given as such. The inputs depend on the seed only."""
    q, k, v, g, beta = _inputs(2, 5, seed)
    h0 = randn((2, HV, V, K), seed + 7, scale=0.5)  # read as [V, K] rows where the flags ask for V-first
    if op == "chunk":
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, **layout_kw)
    if op == "fused_recurrent":
        return fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                                **layout_kw)
    pool = h0.clone()
    return gated_delta_rule_decode(q, k, v, g, beta, pool, **layout_kw), pool


@pytest.mark.parametrize("op", ["chunk", "fused_recurrent", "decode"])
@pytest.mark.parametrize("value", [True, False])
def test_transpose_state_layout_is_flas_deprecated_name(op, value):
    """As in fla (both functions): ``transpose_state_layout`` alone warns (DeprecationWarning) and sets the layout,
    exactly as ``state_v_first`` at that value, also beside ``state_v_first=False``; with ``state_v_first=True`` it
    is a ValueError whatever its value, before any state changes; ``state_v_first`` alone does not warn."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        want = _layout_call(op, {"state_v_first": value})
        plain = _layout_call(op, {})
    assert torch.equal(want[0], plain[0]) != value  # the layout does change the result: the test can tell
    for kw in ({"transpose_state_layout": value}, {"state_v_first": False, "transpose_state_layout": value}):
        with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
            got = _layout_call(op, kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), kw
    q, k, v, g, beta = _inputs(1, 3, 103)
    pool = randn((1, HV, V, K), 104)
    keep = pool.clone()
    with pytest.raises(ValueError, match="state_v_first=True and transpose_state_layout"):
        if op == "chunk":
            chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool, state_v_first=True,
                                   transpose_state_layout=value)
        elif op == "fused_recurrent":
            fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=pool, state_v_first=True,
                                             transpose_state_layout=value)
        else:
            gated_delta_rule_decode(q, k, v, g, beta, pool, state_v_first=True, transpose_state_layout=value)
    assert torch.equal(pool, keep)


FLASH_QLA_SCHEDULING = ("auto_cp", "enable_fwd_cp_cache", "force_intra_cp")


def _chunk_outputs(inputs, cu, grad: bool, **kw) -> list:
    """o and the final state of the chunked op over copies of ``inputs`` (q, k, v, g, beta, h0) with ``kw``, and with
    ``grad`` the six gradients of a fixed loss too."""
    xs = [t.clone().requires_grad_(grad) for t in inputs]
    o, ht = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu, **kw)
    if not grad:
        return [o, ht]
    ((o * o.detach()).sum() + ht.sum()).backward()
    return [o, ht] + [t.grad for t in xs]


@pytest.mark.parametrize("grad", [False, True])
def test_chunk_takes_flash_qla_scheduling_keywords(grad):
    """FlashQLA 0.1.3's auto_cp / enable_fwd_cp_cache / force_intra_cp schedule its intra-card context parallelism
    and change no result: taken at either value, outputs, final states and gradients bit-identical to the call
    without them (split sequences included); a non-bool is a TypeError naming it; the recurrent functions, which
    FlashQLA does not have, refuse them as unknown keywords."""
    q, k, v, g, beta = _inputs(1, 70, 111)
    cu = torch.tensor([0, 5, 70], dtype=torch.int64, device=P.device)
    h0 = randn((2, HV, K, V), 112, scale=0.5)

    def run(**kw):
        return _chunk_outputs((q, k, v, g, beta, h0), cu, grad, use_qk_l2norm_in_kernel=True, **kw)

    base = run()
    for name in FLASH_QLA_SCHEDULING:
        for value in (True, False):
            got = run(**{name: value})
            assert all(torch.equal(a, b) for a, b in zip(got, base, strict=True)), (name, value)
    got = run(auto_cp=False, enable_fwd_cp_cache=True, force_intra_cp=True, head_first=False, cp_context=None,
              state_v_first=False)  # every keyword of FlashQLA's signature at once
    assert all(torch.equal(a, b) for a, b in zip(got, base, strict=True))
    for name in FLASH_QLA_SCHEDULING:
        with pytest.raises(TypeError, match=f"{name}: expected a bool"):
            chunk_gated_delta_rule(q, k, v, g, beta, **{name: 1})
        with pytest.raises(TypeError, match=f"unexpected keyword argument.*'{name}'"):
            fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **{name: True})
        (q2, k2, v2, g2, beta2, state, idx), _ = _pool_call()
        with pytest.raises(TypeError, match=f"unexpected keyword argument.*'{name}'"):
            gated_delta_rule_decode(q2, k2, v2, g2, beta2, state, idx, **{name: True})


def test_fla_and_flash_qla_keywords_under_torch_compile():
    """The deprecated layout name and FlashQLA's scheduling keywords trace with ``fullgraph=True`` (no warning is
    issued while tracing) and give the eager results."""
    q, k, v, g, beta = _inputs(1, 6, 121)
    h0 = randn((1, HV, V, K), 122, scale=0.5)

    def f(q, k, v, g, beta, h0):
        o1, h1 = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                                  transpose_state_layout=True)
        o2, h2 = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                        transpose_state_layout=True, auto_cp=False, force_intra_cp=True,
                                        enable_fwd_cp_cache=False)
        return o1 * 2, h1, o2 * 2, h2

    backend = "aot_eager" if P.device == "cpu" else "inductor"
    got = torch.compile(f, fullgraph=True, backend=backend)(q, k, v, g, beta, h0)
    with pytest.warns(DeprecationWarning):
        want = f(q, k, v, g, beta, h0)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


GRAPH_OPTIONS = [dict(use_graph=True), dict(use_graph=False), dict(graph_mode="force_graph"), dict(graph_mode="auto"),
                 dict(graph_mode="eager", use_graph=True),
                 dict(use_graph=True, graph_t_max=70, graph_n_max=3, graph_nt_max=5, graph_actual_tokens=70,
                      graph_actual_sequences=2, graph_actual_nt=2, min_graph_utilization=0.5)]


@pytest.mark.parametrize("grad", [False, True])
def test_chunk_takes_flas_graph_options(grad, monkeypatch):
    """fla's CUDA-graph options at any valid value change no result (outputs, final states, gradients bit for bit),
    fla's fixed-capacity chunk_indices / chunk_offsets included; a graph call plans from cu_seqlens on its device
    even where a host copy (cu_seqlens_cpu) is given, an eager one from the host copy."""
    q, k, v, g, beta = _inputs(1, 70, 131)
    cu_list = [0, 5, 5, 70]
    cu = torch.tensor(cu_list, dtype=torch.int64, device=P.device)
    h0 = randn((3, HV, K, V), 132, scale=0.5)

    def run(**kw):
        return _chunk_outputs((q, k, v, g, beta, h0), cu, grad, **kw)

    base = run()
    for opts in GRAPH_OPTIONS:
        got = run(**opts)
        assert all(torch.equal(a, b) for a, b in zip(got, base, strict=True)), opts
    # fla's static metadata: chunk_indices of graph_nt_max rows (its sentinel rows past the real chunks) and the
    # sequences' chunk offsets
    ci = torch.cat([_chunk_indices(cu_list), torch.full((3, 2), -1)]).to(P.device)
    offsets = torch.tensor([0, 1, 1, 3], device=P.device)
    got = run(use_graph=True, chunk_indices=ci, chunk_offsets=offsets, graph_nt_max=5)
    assert all(torch.equal(a, b) for a, b in zip(got, base, strict=True))

    device_plans = []
    real = plan_mod.device_plan
    monkeypatch.setattr(plan_mod, "plans_on_device", lambda c: True)
    monkeypatch.setattr(plan_mod, "device_plan", lambda *a: device_plans.append(1) or real(*a))
    for opts, on_device in ((dict(use_graph=True), True), (dict(graph_mode="auto"), True), ({}, False),
                            (dict(graph_mode="eager", use_graph=True), False)):
        device_plans.clear()
        got = run(cu_seqlens_cpu=cu_list, **opts)
        assert bool(device_plans) == on_device, opts
        assert all(torch.equal(a, b) for a, b in zip(got, base, strict=True)), opts


def test_chunk_graph_option_checks():
    """Each graph option's type and range (TypeError / ValueError naming it); a graph call's graph_t_max and
    graph_n_max are its own T and sequence count (fla's rule; an eager call ignores them); chunk_offsets is
    ``[N+1]`` integers on cu_seqlens' device, with cu_seqlens. A refused call leaves the state pool as it was."""
    q, k, v, g, beta = _inputs(1, 70, 141)
    cu = torch.tensor([0, 64, 70], device=P.device)
    call = lambda **kw: chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, **kw)  # noqa: E731
    for kw, err, msg in [
            (dict(use_graph=1), TypeError, "use_graph: expected a bool"),
            (dict(use_graph="yes"), TypeError, "use_graph: expected a bool"),
            (dict(graph_mode="graph"), ValueError, "graph_mode: expected None or one of"),
            (dict(graph_mode=True), TypeError, "graph_mode: expected None or one of"),
            (dict(graph_t_max=70.0), TypeError, "graph_t_max: expected None or an int"),
            (dict(graph_nt_max=True), TypeError, "graph_nt_max: expected None or an int"),
            (dict(graph_actual_nt=-1), ValueError, "graph_actual_nt: expected a count >= 0"),
            (dict(min_graph_utilization="0.5"), TypeError, "min_graph_utilization: expected a float"),
            (dict(min_graph_utilization=1.5), ValueError, r"min_graph_utilization: expected a fraction in \[0, 1\]"),
            (dict(use_graph=True, graph_t_max=128), ValueError, "graph_t_max: .* expected 70"),
            (dict(graph_mode="force_graph", graph_n_max=4), ValueError, "graph_n_max: .* expected 2"),
            (dict(chunk_offsets=[0, 1, 2]), TypeError, "chunk_offsets: expected None or a torch.Tensor"),
            (dict(chunk_offsets=torch.zeros(4, dtype=torch.int64, device=P.device)), ValueError,
             r"chunk_offsets: expected shape \[3\]"),
            (dict(chunk_offsets=torch.zeros(3, device=P.device)), TypeError, "chunk_offsets: expected dtype"),
    ]:
        with pytest.raises(err, match=msg):
            call(**kw)
    o, _ = call(graph_t_max=128, graph_n_max=4)  # eager: fla ignores the capacities too
    assert o.shape == v.shape
    with pytest.raises(ValueError, match="chunk_offsets: given without cu_seqlens"):
        chunk_gated_delta_rule(q, k, v, g, beta, chunk_offsets=torch.zeros(2, dtype=torch.int64, device=P.device))
    pool = randn((3, HV, K, V), 142)
    keep = pool.clone()
    idx = torch.tensor([2, 0], dtype=torch.int32, device=P.device)
    with pytest.raises(ValueError, match="^graph_t_max: .* expected 70 .*got 1$"), torch.no_grad():
        call(initial_state=pool, state_indices=idx, use_graph=True, graph_t_max=1)
    assert torch.equal(pool, keep)


@pytest.mark.gpu_only
def test_varlen_training_step_in_a_cuda_graph():
    """fla's graph use: forward and backward of a varlen call (``use_graph=True``, the lengths in a device
    cu_seqlens, padding past its last bound) captured in one CUDA graph, replayed after new lengths (empty
    sequences, all padding, none) and new inputs are written into the same tensors: each replay's outputs, final
    states and gradients equal the eager call's on the same inputs bit for bit; padding outputs and gradients 0."""
    from harness import capture_graph

    H_, HV_, K_, V_, T = 2, 4, 128, 128, 192
    cu = torch.tensor([0, 48, 96, 144, 192], dtype=torch.int64, device="cuda")
    shapes = [(1, T, H_, K_), (1, T, H_, K_), (1, T, HV_, V_), (1, T, HV_), (1, T, HV_), (4, HV_, K_, V_)]

    def inputs(seed):
        q_, k_, v_, g_, b_, h_ = (randn(s, seed + i, device="cuda") for i, s in enumerate(shapes))
        return [torch.nn.functional.normalize(q_, dim=-1).half(), torch.nn.functional.normalize(k_, dim=-1).half(),
                v_.half(), torch.nn.functional.logsigmoid(g_), b_.sigmoid().half(), h_.half()]

    static = [t.requires_grad_() for t in inputs(0)]
    do, dht = randn((1, T, HV_, V_), 50, device="cuda").half(), randn((4, HV_, K_, V_), 51, device="cuda")

    def step(xs):
        o, ht = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu,
                                       use_graph=True)
        grads = torch.autograd.grad([o, ht], xs, [do, dht])
        return [o, ht, *grads]

    graph, out = capture_graph(lambda: step(static))
    for seed, bounds in enumerate(([0, 17, 73, 192, 192], [0, 31, 111, 111, 111], [0, 0, 0, 0, 0],
                                   [0, 48, 96, 144, 192]), start=1):
        fresh = inputs(seed * 10)
        with torch.no_grad():
            for s, f in zip(static, fresh, strict=True):
                s.copy_(f)
        cu.copy_(torch.tensor(bounds))
        graph.replay()
        got = [t.clone() for t in out]
        want = step([f.requires_grad_() for f in fresh])
        for name, a, b in zip(("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want, strict=True):
            assert torch.equal(a, b), f"{name}: replay with cu_seqlens {bounds} differs from the eager call"
        end = bounds[-1]
        assert (got[0][:, end:] == 0).all() and all((d[:, end:] == 0).all() for d in got[2:7])


def test_import_names_of_fla_and_flash_qla():
    """fla's short names and FlashQLA's top-level ``chunk_gated_delta_rule`` beside its fwd / bwd: the same
    functions, so an import substitution needs no renaming."""
    import gqla_triton.ops.gdn as gdn
    from gqla_triton.ops.gdn import flash_qla

    assert gdn.chunk_gdn is gdn.chunk_gated_delta_rule
    assert gdn.fused_recurrent_gdn is gdn.fused_recurrent_gated_delta_rule
    assert flash_qla.chunk_gated_delta_rule is gdn.chunk_gated_delta_rule


# fla 0.6's parameters, in order, with their defaults (names only), of fused_recurrent_gated_delta_rule and of the
# first nine of chunk_gated_delta_rule (the tenth is FlashQLA's cu_seqlens here: fla's later ones go by keyword)
FLA_RECURRENT = (("q", None), ("k", None), ("v", None), ("g", None), ("gk", None), ("gv", None), ("beta", None),
                 ("scale", None), ("initial_state", None), ("output_final_state", False),
                 ("use_qk_l2norm_in_kernel", False), ("use_gate_in_kernel", False), ("A_log", None), ("dt_bias", None),
                 ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False), ("state_v_first", False),
                 ("cu_seqlens", None))
FLA_CHUNK_HEAD = (("q", None), ("k", None), ("v", None), ("g", None), ("beta", None), ("scale", None),
                  ("initial_state", None), ("output_final_state", False), ("use_qk_l2norm_in_kernel", False))


def test_signatures_follow_fla_and_flash_qla():
    """Callers written against fla / FlashQLA bind the same parameters: fla's recurrent function in its order and
    defaults (then keyword-only options), the chunked op's first nine as in both, cu_seqlens tenth as in FlashQLA;
    fla's later chunk parameters are taken by keyword."""
    import inspect

    def params(fn):
        return [(p.name, None if p.default is inspect.Parameter.empty else p.default, p.kind)
                for p in inspect.signature(fn).parameters.values()]

    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    rec = params(fused_recurrent_gated_delta_rule)
    assert [(n, d) for n, d, k in rec if k is positional] == list(FLA_RECURRENT)
    chunk = [(n, d) for n, d, k in params(chunk_gated_delta_rule) if k is positional]
    assert chunk == [*FLA_CHUNK_HEAD, ("cu_seqlens", None)]
    q, k, v, g, beta = _inputs(1, 6, 151)
    cu = torch.tensor([0, 2, 6], device=P.device)
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
    o2, ht2 = chunk_gated_delta_rule(q, k, v, g, beta, None, None, True, False, use_beta_sigmoid_in_kernel=False,
                                     allow_neg_eigval=False, state_v_first=False, cu_seqlens=cu, cu_seqlens_cpu=None,
                                     chunk_indices=None, cp_context=None)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
