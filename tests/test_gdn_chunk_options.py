"""``chunk_gated_delta_rule``'s state options (ops/gdn: api.py, compat.py, launch.py, kernels/state.py, seg.py,
state_bwd.py, grad.py): initial states and state pools in fp32 / bf16 / fp16, read in the kernels as they are, and
the V-first ``[V, K]`` state layout (``state_layout="vk"``, fla's ``state_v_first`` / ``transpose_state_layout``)
for the initial state, the final state, the state pool and the initial state's gradient.

The layout only moves the state rows' addresses: a ``"vk"`` call equals the ``"kv"`` call on the transposed states
bitwise (o, final state, every gradient). A low-precision initial state is read exactly: the call equals the fp32
call on the same (representable) values bitwise, and its gradient is the fp32 gradient rounded. Both, forward and
every gradient, against the float64 recurrence (autograd on the float64 side).
"""

import contextlib

import pytest
import torch
from harness import P, assert_close, dtypes, examples, gdn_problem, gen, rand, randn, seeds
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gqla_triton.dispatch import config_override
from gqla_triton.ops.gdn import chunk_gated_delta_rule
from gqla_triton.ops.gdn.reference import chunk_gated_delta_rule_ref, gate_ref, recurrent_gated_delta_rule_ref

pytestmark = pytest.mark.usefixtures("poison_buffers")

SEG = {"seg_units": 1 << 20, "seg_below": 1 << 20, "seg_min": 1}  # split every sequence into one-chunk segments
STATE_DTYPES = (torch.float32, torch.float16) if not P.big else (torch.float32, torch.bfloat16, torch.float16)
H, K, V = 1, 16, 32  # K != V: a layout mix-up is a shape error or a wrong answer, never a silent pass


def _split(seg):
    return config_override({"gdn_chunk": SEG}) if seg else contextlib.nullcontext()


def _problem(seed, lens, varlen, HV):
    """float64 CPU inputs q, k (unit rows), v, g, beta, h0 [N, HV, K, V]; cu_seqlens (CPU int32) or None."""
    ins, cu = gdn_problem(seed, lens, varlen, H, HV, K, V)
    return ins[:5], ins[5], cu


def _kernel(x, h0, cu, dtype, grads, **kw):
    """The op on the test device (inputs in ``dtype``, h0 as given), forward + backward: o, ht, [dq..dbeta, dh0]."""
    xs = [t.to(P.device, dtype).requires_grad_() for t in x]
    h = h0.detach().to(P.device).requires_grad_()
    o, ht = chunk_gated_delta_rule(*xs, initial_state=h, output_final_state=True,
                                   cu_seqlens=cu.to(P.device) if cu is not None else None, **kw)
    do, dht = grads
    torch.autograd.backward([o, ht], [do.to(o.device, o.dtype), dht.to(ht.device, ht.dtype)])
    return o, ht, [t.grad for t in (*xs, h)]


def _ref(fn, x, h0_kv, cu, grads, **kw):
    """A reference (``[K, V]`` states), forward + backward by autograd: o, ht, [dq..dbeta, dh0]."""
    xs = [t.detach().clone().requires_grad_() for t in (*x, h0_kv)]
    o, ht = fn(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu, **kw)
    torch.autograd.backward([o, ht], [grads[0].to(o.dtype), grads[1].to(ht.dtype)])
    return o, ht, [t.grad for t in xs]


@settings(max_examples=examples(4, 12), deadline=None)
@given(lens=st.lists(st.integers(1, 80), min_size=1, max_size=3), varlen=st.booleans(), G=st.sampled_from([1, 2]),
       vk=st.booleans(), sdt=st.sampled_from(STATE_DTYPES), seg=st.booleans(), dtype=dtypes(), seed=seeds())
def test_state_layout_and_dtype_vs_recurrence(lens, varlen, G, vk, sdt, seg, dtype, seed):
    """o, the final state and every gradient (dh0 included) with the initial state in ``sdt`` and either layout,
    dense or varlen, with and without sequence splitting, against the float64 recurrence; ht fp32 in the chosen
    layout, dh0 in h0's dtype and layout."""
    HV = H * G
    x, h0, cu = _problem(seed, lens, varlen, HV)
    h0 = h0.to(sdt).double()  # the values the kernel reads exactly
    N = h0.shape[0]
    do = randn(x[2].shape, seed + 1, dtype=torch.float64, device="cpu")
    dht = randn((N, HV, K, V), seed + 2, dtype=torch.float64, device="cpu")
    tr = (lambda t: t.transpose(-1, -2).contiguous()) if vk else (lambda t: t)
    with _split(seg):
        o, ht, dx = _kernel(x, tr(h0).to(sdt), cu, dtype, (do, tr(dht)), state_layout="vk" if vk else "kv")
    assert ht.dtype == torch.float32 and ht.shape == tr(dht).shape
    assert dx[5].dtype == sdt and dx[5].shape == tr(h0).shape
    ro, rht, rdx = _ref(recurrent_gated_delta_rule_ref, x, h0, cu, (do, dht))
    low = [t.to(dtype).float() for t in x]
    lo, lht, ldx = _ref(chunk_gated_delta_rule_ref, low, h0.float(), cu, (do, dht),
                        compute_dtype=dtype if dtype != torch.float32 else None)
    assert_close("o", o, ro, lo, dtype=dtype)
    assert_close("final_state", tr(ht), rht, lht, dtype=dtype)
    for name, a, r, lw in zip(("q", "k", "v", "g", "beta"), dx[:5], rdx[:5], ldx[:5], strict=True):
        assert_close(f"d{name}", a, r, lw, dtype=dtype)
    # dh0 is rounded to h0's dtype: the tolerance floor of that dtype on top of the data-derived one
    assert_close("dh0", tr(dx[5]), rdx[5], ldx[5], dtype=dtype if sdt == torch.float32 else sdt)


@settings(max_examples=examples(3, 8), deadline=None)
@given(lens=st.lists(st.integers(1, 80), min_size=1, max_size=3), varlen=st.booleans(), seg=st.booleans(),
       sdt=st.sampled_from(STATE_DTYPES), dtype=dtypes(), seed=seeds())
def test_vk_equals_kv_on_transposed_states_bitwise(lens, varlen, seg, sdt, dtype, seed):
    """The layout moves addresses only: o, the final state and every gradient of the ``"vk"`` call (and of fla's
    ``state_v_first=True`` / ``transpose_state_layout=True``) equal the ``"kv"`` call's on transposed states,
    bitwise; so does an fp32 initial state holding the same values as a low-precision one (dh0 then rounded)."""
    x, h0, cu = _problem(seed, lens, varlen, 2)
    h0 = h0.to(sdt)
    do = randn(x[2].shape, seed + 1, dtype=torch.float64, device="cpu")
    dht = randn((h0.shape[0], 2, K, V), seed + 2, dtype=torch.float64, device="cpu")
    T = lambda t: t.transpose(-1, -2).contiguous()  # noqa: E731
    with _split(seg):
        o, ht, dx = _kernel(x, h0, cu, dtype, (do, dht))
        o32, ht32, dx32 = _kernel(x, h0.float(), cu, dtype, (do, dht))
        runs = [_kernel(x, T(h0), cu, dtype, (do, T(dht)), **kw)
                for kw in ({"state_layout": "vk"}, {"state_v_first": True}, {"transpose_state_layout": True})]
    assert torch.equal(o, o32) and torch.equal(ht, ht32), "a low-precision h0 is not read exactly"
    for a, b in zip(dx[:5], dx32[:5], strict=True):
        assert torch.equal(a, b)
    assert dx[5].dtype == sdt and torch.equal(dx[5], dx32[5].to(sdt))
    for ov, htv, dxv in runs:
        assert torch.equal(ov, o) and torch.equal(T(htv), ht)
        for a, b in zip(dxv[:5], dx[:5], strict=True):
            assert torch.equal(a, b)
        assert torch.equal(T(dxv[5]), dx[5])


@settings(max_examples=examples(3, 8), deadline=None)
@given(lens=st.lists(st.integers(1, 80), min_size=1, max_size=3), varlen=st.booleans(), seg=st.booleans(),
       vk=st.booleans(), sdt=st.sampled_from(STATE_DTYPES), spare=st.integers(0, 2), dtype=dtypes(), seed=seeds())
def test_pool_layout_and_dtype(lens, varlen, seg, vk, sdt, spare, dtype, seed):
    """A state pool in ``sdt`` and either layout: the pooled call equals gather -> the op (initial state in the
    pool's dtype) -> final states rounded to the pool's dtype and scattered, bitwise (rows not named and rows of
    negative indices untouched); the impl="reference" pool path within the tolerance of the float64 recurrence."""
    x, _, cu = _problem(seed, lens, varlen, 2)
    N = len(lens)
    rows = (2, V, K) if vk else (2, K, V)
    pool = randn((N + spare, *rows), seed + 5, scale=0.5).to(sdt)
    g_ = gen(seed + 7)
    idx = torch.randperm(N + spare, generator=g_)[:N].to(torch.int32)
    idx = torch.where(torch.rand(N, generator=g_) < 0.3, -1, idx).to(P.device)
    live = idx >= 0
    h0 = torch.zeros(N, *rows, dtype=sdt, device=P.device)
    h0[live] = pool[idx[live].long()]
    xs = [t.to(P.device, dtype) for t in x]
    cu_d = cu.to(P.device) if cu is not None else None
    layout = "vk" if vk else "kv"
    with torch.no_grad(), _split(seg):
        o_ref, ht = chunk_gated_delta_rule(*xs, initial_state=h0, output_final_state=True, cu_seqlens=cu_d,
                                           state_layout=layout)
        got = pool.clone()
        o, none = chunk_gated_delta_rule(*xs, initial_state=got, state_indices=idx, cu_seqlens=cu_d,
                                         state_layout=layout)
        ref_pool = pool.clone()
        o_r, _ = chunk_gated_delta_rule(*xs, initial_state=ref_pool, state_indices=idx, cu_seqlens=cu_d,
                                        state_layout=layout, impl="reference")
    want = pool.clone()
    want[idx[live].long()] = ht[live].to(sdt)
    assert none is None
    assert torch.equal(o, o_ref), "o: pooled call differs from gather -> op"
    assert torch.equal(got, want), "pool: differs from gather -> op -> scatter (or a row not named was touched)"
    # the float64 recurrence (and the chunked reference at the kernel's precision) on the gathered states
    h_kv = (h0.transpose(-1, -2) if vk else h0).double().cpu()
    o64, ht64 = recurrent_gated_delta_rule_ref(*x, initial_state=h_kv, output_final_state=True, cu_seqlens=cu)
    lo, lht = chunk_gated_delta_rule_ref(*(t.to(dtype).float() for t in x), initial_state=h_kv.float(),
                                         output_final_state=True, cu_seqlens=cu,
                                         compute_dtype=dtype if dtype != torch.float32 else None)
    T = (lambda t: t.transpose(-1, -2)) if vk else (lambda t: t)  # noqa: E731
    lv = live.cpu()
    named = idx[live].long()
    assert_close("o", o, o64, lo, dtype=dtype)
    assert_close("pool rows", T(got[named]), ht64[lv], lht[lv].to(sdt), dtype=dtype)
    assert_close("o (impl='reference')", o_r, o64, lo, dtype=dtype)
    assert_close("pool rows (impl='reference')", T(ref_pool[named]), ht64[lv], lht[lv].to(sdt), dtype=dtype)

def test_state_option_checks():
    """Shapes follow the layout, dtypes are fp32 / bf16 / fp16, the layout names must agree; a refused call
    changes no pool row."""
    x, h0, _ = _problem(3, [5], False, 2)
    xs = [t.to(P.device, torch.float32) for t in x]
    h0 = h0.to(P.device, torch.float32)
    call = lambda **kw: chunk_gated_delta_rule(*xs, **kw)  # noqa: E731
    with pytest.raises(ValueError, match=r"^initial_state: expected shape \[1, 2, 32, 16\], got \[1, 2, 16, 32\]"):
        call(initial_state=h0, state_layout="vk")  # [N, HV, K, V] given, [N, HV, V, K] expected
    with pytest.raises(ValueError, match=r"^initial_state: expected shape \[1, 2, 16, 32\], got \[1, 2, 32, 16\]"):
        call(initial_state=h0.transpose(-1, -2).contiguous())
    with pytest.raises(TypeError, match=r"^initial_state: expected dtype in \(float32, bfloat16, float16\), got "
                                        "float64"):
        call(initial_state=h0.double())
    with pytest.raises(ValueError, match="^state_layout: expected 'kv' .* or 'vk' .*, got 'kvk'"):
        call(state_layout="kvk")
    with pytest.raises(TypeError, match="^state_layout: expected 'kv' or 'vk', got int"):
        call(state_layout=1)
    with pytest.raises(ValueError, match="^state_v_first=True and transpose_state_layout=False: .*contradict"):
        call(state_v_first=True, transpose_state_layout=False)
    with pytest.raises(ValueError, match="state_v_first=False contradicts state_layout='vk'"):
        call(state_v_first=False, state_layout="vk")
    pool = randn((3, 2, V, K), 4).to(torch.float16)
    keep = pool.clone()
    idx = torch.tensor([1], dtype=torch.int32, device=P.device)
    with torch.no_grad(), pytest.raises(ValueError, match=r"^initial_state: expected shape \[\*, 2, 16, 32\], got "
                                                         r"\[3, 2, 32, 16\]"):
        call(initial_state=pool, state_indices=idx)  # a [V, K] pool without state_layout="vk"
    assert torch.equal(pool, keep)
    if not P.big:
        with pytest.raises(TypeError, match="^bfloat16 inputs: Triton's CPU interpreter"):
            call(initial_state=h0.bfloat16())
    o, ht = call(initial_state=h0.half(), output_final_state=True, impl="reference")
    assert ht.dtype == torch.float32


def _beta_taken(beta, sigmoid, neg):
    b = torch.sigmoid(beta) if sigmoid else beta
    return 2.0 * b if neg else b


@settings(max_examples=examples(4, 12), deadline=None)
@given(lens=st.lists(st.integers(1, 80), min_size=1, max_size=3), varlen=st.booleans(), G=st.sampled_from([1, 2]),
       mode=st.sampled_from([(True, False), (False, True), (True, True)]), save=st.booleans(), dtype=dtypes(),
       seed=seeds())
@example(lens=[19, 36], varlen=True, G=2, mode=(True, True), save=False, dtype=P.dtypes[-1], seed=5)
def test_beta_sigmoid_and_neg_eigval_vs_recurrence(lens, varlen, G, mode, save, dtype, seed):
    """use_beta_sigmoid_in_kernel (beta holds logits) and allow_neg_eigval (beta doubled after the sigmoid): o, the
    final state and every gradient (dbeta: the gradient of the logits / of the undoubled beta) against the float64
    recurrence on the transformed beta, autograd through the transform; saved or recomputed states."""
    sig, neg = mode
    x, h0, cu = _problem(seed, lens, varlen, H * G)
    if sig:  # logits around 0, some large enough for the sigmoid's tails
        x[4] = randn(x[4].shape, seed + 3, dtype=torch.float64, device="cpu", scale=3.0)
    elif neg:  # 2·beta in (0.1, 1.9): eigenvalues of I - 2·beta k kᵀ down to -0.9
        x[4] = 0.05 + 0.9 * x[4]
    do = randn(x[2].shape, seed + 1, dtype=torch.float64, device="cpu")
    dht = randn(h0.shape, seed + 2, dtype=torch.float64, device="cpu")
    o, ht, dx = _kernel(x, h0.float(), cu, dtype, (do, dht), use_beta_sigmoid_in_kernel=sig, allow_neg_eigval=neg,
                        save_states=save)

    def taken(fn):
        def run(q, k, v, g, beta, **rkw):
            return fn(q, k, v, g, _beta_taken(beta, sig, neg), **rkw)
        return run

    ro, rht, rdx = _ref(taken(recurrent_gated_delta_rule_ref), x, h0, cu, (do, dht))
    low = [t.to(dtype).float() for t in x]
    lo, lht, ldx = _ref(taken(chunk_gated_delta_rule_ref), low, h0.float(), cu, (do, dht),
                        compute_dtype=dtype if dtype != torch.float32 else None)
    assert_close("o", o, ro, lo, dtype=dtype)
    assert_close("final_state", ht, rht, lht, dtype=dtype)
    for name, a, r, lw in zip(("q", "k", "v", "g", "beta", "h0"), dx, rdx, ldx, strict=True):
        assert_close(f"d{name}", a, r, lw, dtype=dtype)


def test_beta_options_pool_and_reference():
    """The pooled (inference) call with the beta options equals the op on gathered states bitwise; impl="reference"
    applies the same transform; the options are bools."""
    dtype = P.dtypes[0]  # float32 under the interpreter, bfloat16 on the GPU
    x, h0, cu = _problem(9, [40, 70], True, 2)
    xs = [t.to(P.device, dtype if i < 3 else torch.float32) for i, t in enumerate(x)]
    xs[4] = randn(xs[4].shape, 10, scale=3.0)
    kw = dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, cu_seqlens=cu.to(P.device))
    h0 = h0.to(P.device, torch.float32)
    with torch.no_grad():
        o, ht = chunk_gated_delta_rule(*xs, initial_state=h0, output_final_state=True, **kw)
        pool = torch.zeros(3, *h0.shape[1:], device=P.device)
        pool[torch.tensor([2, 0])] = h0
        op, _ = chunk_gated_delta_rule(*xs, initial_state=pool,
                                       state_indices=torch.tensor([2, 0], dtype=torch.int32, device=P.device), **kw)
        orf, htr = chunk_gated_delta_rule(*xs, initial_state=h0, output_final_state=True, impl="reference", **kw)
    assert torch.equal(op, o) and torch.equal(pool[2], ht[0]) and torch.equal(pool[0], ht[1])
    beta = _beta_taken(xs[4].double(), True, True)
    o64, ht64 = recurrent_gated_delta_rule_ref(*(t.double() for t in xs[:4]), beta, initial_state=h0.double(),
                                               output_final_state=True, cu_seqlens=cu)
    olp, htlp = chunk_gated_delta_rule_ref(*(t.float() for t in xs[:4]), beta.float(), initial_state=h0,
                                           output_final_state=True, cu_seqlens=cu,
                                           compute_dtype=dtype if dtype != torch.float32 else None)
    assert_close("o", o, o64, olp, dtype=dtype)
    assert_close("final state", ht, ht64, htlp, dtype=dtype)
    assert_close("o (impl='reference')", orf, o64, olp, dtype=dtype)
    assert_close("final state (impl='reference')", htr, ht64, htlp, dtype=dtype)
    for name in ("use_beta_sigmoid_in_kernel", "allow_neg_eigval"):
        with pytest.raises(TypeError, match=f"{name}: expected a bool"):
            chunk_gated_delta_rule(*xs, **{name: 1})


def _gate_problem(seed, lens, varlen, HV, bias):
    """_problem with g replaced by the raw gate input a (around 0, tails past softplus's threshold of 20 included)
    and the gate parameters A_log, dt_bias (or None) ``[HV]`` float64."""
    x, h0, cu = _problem(seed, lens, varlen, HV)
    x[3] = randn(x[3].shape, seed + 7, dtype=torch.float64, device="cpu", scale=2.0)
    x[3].view(-1)[:: 37] += 22.0  # some tokens above the threshold
    A_log = rand((HV,), seed + 8, lo=-2.0, hi=0.5, dtype=torch.float64, device="cpu")
    dt_bias = randn((HV,), seed + 9, dtype=torch.float64, device="cpu") if bias else None
    return x, h0, cu, A_log, dt_bias


@settings(max_examples=examples(4, 12), deadline=None)
@given(lens=st.lists(st.integers(1, 80), min_size=1, max_size=3), varlen=st.booleans(), G=st.sampled_from([1, 2]),
       bias=st.booleans(), save=st.booleans(), seg=st.booleans(), dtype=dtypes(), seed=seeds())
def test_gate_in_kernel_vs_recurrence(lens, varlen, G, bias, save, seg, dtype, seed):
    """use_gate_in_kernel (g holds the raw input a, the kernels take -exp(A_log)·softplus(a + dt_bias)): o, the final
    state and every gradient, dA_log and ddt_bias included, against the float64 recurrence on the float64 gate
    (autograd through it); saved or recomputed states, with and without sequence splitting."""
    x, h0, cu, A_log, dt_bias = _gate_problem(seed, lens, varlen, H * G, bias)
    do = randn(x[2].shape, seed + 1, dtype=torch.float64, device="cpu")
    dht = randn(h0.shape, seed + 2, dtype=torch.float64, device="cpu")
    params = [A_log] + ([dt_bias] if bias else [])
    pk = [p.to(P.device, torch.float32).requires_grad_() for p in params]
    with _split(seg):
        o, ht, dx = _kernel(x, h0.float(), cu, dtype, (do, dht), use_gate_in_kernel=True, A_log=pk[0],
                            dt_bias=pk[1] if bias else None, save_states=save)

    def gated(fn, ps):
        def run(q, k, v, a, beta, **rkw):
            return fn(q, k, v, gate_ref(a, ps[0], ps[1] if bias else None), beta, **rkw)
        return run

    p64 = [p.clone().requires_grad_() for p in params]
    ro, rht, rdx = _ref(gated(recurrent_gated_delta_rule_ref, p64), x, h0, cu, (do, dht))
    low = [t.to(dtype).float() for t in x]
    p32 = [p.float().requires_grad_() for p in params]
    lo, lht, ldx = _ref(gated(chunk_gated_delta_rule_ref, p32), low, h0.float(), cu, (do, dht),
                        compute_dtype=dtype if dtype != torch.float32 else None)
    assert_close("o", o, ro, lo, dtype=dtype)
    assert_close("final_state", ht, rht, lht, dtype=dtype)
    for name, a, r, lw in zip(("q", "k", "v", "a", "beta", "h0"), dx, rdx, ldx, strict=True):
        assert_close(f"d{name}", a, r, lw, dtype=dtype)
    for name, a, r, lw in zip(("A_log", "dt_bias"), pk, p64, p32, strict=False):
        assert a.grad.dtype == torch.float32 and a.grad.shape == (H * G,)
        assert_close(f"d{name}", a.grad, r.grad, lw.grad, dtype=dtype)


@pytest.mark.parametrize("NP", [1, 17, 1024, 2500])
@pytest.mark.parametrize("bias", [False, True])
def test_gate_parameter_gradients_sum_every_block(NP, bias):
    """dA_log and ddt_bias from the options pass's block partials (``gdn_options_sum_kernel``): any number of
    blocks (one, a ragged one, exactly one loop step, several with a ragged last one) gives the float64 sum to fp32
    rounding, the same bits on every call, and without dt_bias nothing but dA_log is written."""
    from gqla_triton.ops._common.host import next_pow2
    from gqla_triton.ops.gdn.kernels.options import gdn_options_sum_kernel

    HV = 3
    part = randn((2, HV, NP), 7)
    ref = part.double().sum(-1)
    outs = []
    for _ in range(2):
        da, ddt = (torch.full((HV,), float("nan"), device=P.device) for _ in range(2))
        gdn_options_sum_kernel[(HV, 2 if bias else 1)](part, da, ddt if bias else da, HV, NP,
                                                       BLOCK=min(1024, max(16, next_pow2(NP))))
        outs.append((da, ddt))
    bound = 2 * NP * 2.0 ** -24 * part.double().abs().sum(-1)
    assert ((outs[0][0].double() - ref[0]).abs() <= bound[0]).all()
    if bias:
        assert ((outs[0][1].double() - ref[1]).abs() <= bound[1]).all()
    else:
        assert outs[0][1].isnan().all()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1].nan_to_num(), outs[1][1].nan_to_num())


def test_gate_in_kernel_pool_reference_and_errors():
    """The pooled call with the in-kernel gate equals the op on gathered states bitwise; impl="reference" applies the
    same gate; the gate's parameters are checked (A_log required, neither without the flag, shapes / devices), and
    a refused pooled call leaves the pool unchanged."""
    dtype = P.dtypes[0]
    x, h0, cu, A_log, dt_bias = _gate_problem(5, [40, 70], True, 2, True)
    xs = [t.to(P.device, dtype if i < 3 else torch.float32) for i, t in enumerate(x)]
    A_log, dt_bias = A_log.to(P.device, torch.float32), dt_bias.to(P.device, torch.float32)
    h0 = h0.to(P.device, torch.float32)
    kw = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu.to(P.device))
    idx = torch.tensor([2, 0], dtype=torch.int32, device=P.device)
    with torch.no_grad():
        o, ht = chunk_gated_delta_rule(*xs, initial_state=h0, output_final_state=True, **kw)
        pool = torch.zeros(3, *h0.shape[1:], device=P.device)
        pool[idx.long()] = h0
        op, _ = chunk_gated_delta_rule(*xs, initial_state=pool, state_indices=idx, **kw)
        orf, htr = chunk_gated_delta_rule(*xs, initial_state=h0, output_final_state=True, impl="reference", **kw)
    assert torch.equal(op, o) and torch.equal(pool[2], ht[0]) and torch.equal(pool[0], ht[1])
    g64 = gate_ref(xs[3].double(), A_log.double(), dt_bias.double())
    o64, ht64 = recurrent_gated_delta_rule_ref(*(t.double() for t in xs[:3]), g64, xs[4].double(),
                                               initial_state=h0.double(), output_final_state=True, cu_seqlens=cu)
    olp, htlp = chunk_gated_delta_rule_ref(*(t.float() for t in xs[:3]), g64.float(), xs[4].float(),
                                           initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                           compute_dtype=dtype if dtype != torch.float32 else None)
    for name, a, r, lw in (("o", o, o64, olp), ("final state", ht, ht64, htlp), ("o (reference)", orf, o64, olp),
                           ("final state (reference)", htr, ht64, htlp)):
        assert_close(name, a, r, lw, dtype=dtype)
    f = chunk_gated_delta_rule
    with pytest.raises(ValueError, match="A_log: required"):
        f(*xs, use_gate_in_kernel=True)
    for name in ("A_log", "dt_bias"):
        with pytest.raises(ValueError, match=f"{name}: given without use_gate_in_kernel"):
            f(*xs, **{name: A_log})
    with pytest.raises(ValueError, match=r"^A_log: expected shape \[2\], got \[1\]"):
        f(*xs, use_gate_in_kernel=True, A_log=A_log[:1])
    with pytest.raises(ValueError, match=r"^dt_bias: expected 1 dimensions, got shape \(1, 2\)"):
        f(*xs, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias[None])
    with pytest.raises(TypeError, match="use_gate_in_kernel: expected a bool"):
        f(*xs, use_gate_in_kernel=1, A_log=A_log)
    keep = pool.clone()
    with torch.no_grad(), pytest.raises(ValueError, match=r"^A_log: expected shape \[2\], got \[1\]"):
        f(*xs, initial_state=pool, state_indices=idx, use_gate_in_kernel=True, A_log=A_log[:1],
          cu_seqlens=cu.to(P.device))
    with pytest.raises(ValueError, match="state_indices: the call over a state pool is inference only"):
        f(*xs, initial_state=pool, state_indices=idx, use_gate_in_kernel=True, A_log=A_log.clone().requires_grad_(),
          cu_seqlens=cu.to(P.device))  # a pooled call would drop A_log's gradient
    assert torch.equal(pool, keep)


def test_gate_in_kernel_compiles_with_autograd():
    """``torch.compile(fullgraph=True)`` (aot_eager) of a training step with the in-kernel gate traces the forward and
    backward custom ops: o, the final state and the gradients of a, A_log and dt_bias equal eager's bitwise."""
    x, h0, cu, A_log, dt_bias = _gate_problem(3, [50, 30], True, 2, True)
    dtype = P.dtypes[-1]

    def fn(q, k, v, a, beta, A, dtb, h):
        o, ht = chunk_gated_delta_rule(q, k, v, a, beta, initial_state=h, output_final_state=True,
                                       use_gate_in_kernel=True, A_log=A, dt_bias=dtb,
                                       cu_seqlens=cu.to(P.device))
        return o.float().square().sum() + ht.square().sum()

    outs = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        xs = [t.to(P.device, dtype if i < 3 else torch.float32).requires_grad_()
              for i, t in enumerate([*x, A_log, dt_bias, h0])]
        f(*xs).backward()
        outs.append([t.grad for t in xs])
    for name, a, b in zip(("q", "k", "v", "a", "beta", "A_log", "dt_bias", "h0"), *outs, strict=True):
        assert torch.equal(a, b), f"d{name}: compiled differs from eager"


@pytest.mark.parametrize("gate", [False, True])
def test_nan_decay_reaches_its_sequence_from_its_token_on(gate):
    """A NaN in g (or in the raw gate input with use_gate_in_kernel) at token t of one sequence: that sequence's
    outputs from t on and its final state are NaN (the decay through t is NaN), the other sequences' results equal
    the clean call's bitwise. The floor of g must not turn the NaN into a full decay (tl.maximum would on the GPU)."""
    x, h0, cu, A_log, dt_bias = _gate_problem(11, [70, 40], True, 2, True)
    if not gate:
        x[3] = -x[3].abs() * 0.1
    dtype = P.dtypes[0]
    xs = [t.to(P.device, dtype if i < 3 else torch.float32) for i, t in enumerate(x)]
    kw = dict(initial_state=h0.to(P.device, torch.float32), output_final_state=True, cu_seqlens=cu.to(P.device))
    if gate:
        kw.update(use_gate_in_kernel=True, A_log=A_log.to(P.device, torch.float32),
                  dt_bias=dt_bias.to(P.device, torch.float32))
    t_bad = 75  # token 5 of the second sequence
    bad = [t.clone() for t in xs]
    bad[3][0, t_bad, 1] = float("nan")
    with torch.no_grad():
        o, ht = chunk_gated_delta_rule(*xs, **kw)
        ob, htb = chunk_gated_delta_rule(*bad, **kw)
    assert torch.equal(ob[:, :70], o[:, :70]) and torch.equal(htb[0], ht[0])
    assert ob[0, t_bad:, 1].isnan().all() and htb[1, 1].isnan().all()
    assert torch.equal(htb[1, 0], ht[1, 0]) and torch.equal(ob[0, 70:, 0], o[0, 70:, 0])  # its other value head
