"""Chunked Gated DeltaNet (ops/gdn: api.py, plan.py, launch.py, kernels/) against the float64 token recurrence
(ops/gdn/reference.py).

Tolerances: ``err(kernel, fp64) <= 2·err(lowp, fp64) + eps`` where ``lowp`` is torch at the kernel's
precision: the chunked einsum reference run with ``compute_dtype`` = the test dtype (every matmul rounds to
it, as the kernels' bf16/fp16 tensor-core operands do; solve, g-cumsum and states in fp32), on the same
inputs; gradients come from autograd through that same low-precision reference. In float32 (ci) lowp is
the fp32 chunk reference.
"""

import contextlib
import math

import pytest
import torch
from harness import P, assert_close, dtypes, examples, gen, pick, rand, randn, rel_err, seeds
from hypothesis import given, settings
from hypothesis import strategies as st

import gqla_triton.ops.gdn.api as api_mod
import gqla_triton.ops.gdn.launch as launch_mod
import gqla_triton.ops.gdn.plan as plan_mod
from gqla_triton.dispatch import config_override
from gqla_triton.ops.gdn import chunk_gated_delta_rule
from gqla_triton.ops.gdn.config import ChunkConfig
from gqla_triton.ops.gdn.reference import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref

NAMES = ("q", "k", "v", "g", "beta", "h0")

# every buffer the launchers allocate starts NaN-filled (ints: a large negative): unwritten elements fail
pytestmark = pytest.mark.usefixtures("poison_buffers")


def _override(over):
    """``config_override`` of gdn_chunk fields (the hypothesis tests cannot take the function-scoped fixture)."""
    return config_override({"gdn_chunk": over}) if over else contextlib.nullcontext()


def _inputs(seed, B, T, H, HV, K, V, N, *, gmin=-1.0, l2=True):
    """fp64 CPU inputs: q, k (unit rows when not l2-normalised in the kernel), v, g in [gmin, 0), beta, h0."""
    g_ = gen(seed)
    q = randn((B, T, H, K), g_, dtype=torch.float64, device="cpu")
    k = randn((B, T, H, K), g_, dtype=torch.float64, device="cpu")
    if not l2:
        q = torch.nn.functional.normalize(q, dim=-1)
        k = torch.nn.functional.normalize(k, dim=-1)
    v = randn((B, T, HV, V), g_, dtype=torch.float64, device="cpu")
    g = rand((B, T, HV), g_, lo=gmin, hi=0.0, dtype=torch.float64, device="cpu")
    beta = rand((B, T, HV), g_, lo=0.05, hi=0.95, dtype=torch.float64, device="cpu")
    h0 = randn((N, HV, K, V), g_, dtype=torch.float64, device="cpu", scale=0.5)
    return [q, k, v, g, beta, h0]


def _lens_layout(lens, varlen):
    """(B, T, N, cu_seqlens int32 CPU or None) of sequences of lengths ``lens``: one varlen row, or a batch of
    max(lens) tokens per row."""
    if varlen:
        return 1, sum(lens), len(lens), torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return len(lens), max(1, max(lens)), len(lens), None


def _run_kernel(ins, dtype, *, cu=None, l2=True, grads=None, **kw):
    """Kernel forward (+ backward with cotangents ``grads = (do, dht)``). Returns o, ht, [grads]. ``kw``: more
    options of chunk_gated_delta_rule (e.g. ``impl``)."""
    xs = [t.to(device=P.device, dtype=dtype if i < 3 else (torch.float32 if i == 5 else dtype)).requires_grad_()
          for i, t in enumerate(ins)]
    cu_d = cu.to(P.device) if cu is not None else None
    o, ht = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True,
                                   use_qk_l2norm_in_kernel=l2, cu_seqlens=cu_d, **kw)
    if grads is None:
        return o, ht, None
    do, dht = grads
    torch.autograd.backward([o, ht], [do.to(o.device, o.dtype), dht.to(ht.device, ht.dtype)])
    return o, ht, [x.grad for x in xs]


def _run_ref(fn, ins, *, cu=None, l2=True, grads=None, **kw):
    """A reference forward (+ backward). The float64 token recurrence runs on the test device: on the CPU its
    step loop is the slow part of a GPU-profile example (~7 s at B2 T600 K=V=128); the low-precision chunked
    reference stays on the CPU."""
    dev = P.device if fn is recurrent_gated_delta_rule_ref else "cpu"
    xs = [t.detach().clone().to(dev).requires_grad_() for t in ins]
    o, ht = fn(*xs[:5], initial_state=xs[5], output_final_state=True, use_qk_l2norm=l2, cu_seqlens=cu, **kw)
    if grads is None:
        return o, ht, None
    do, dht = grads
    torch.autograd.backward([o, ht], [do.to(o.device, o.dtype), dht.to(ht.device, ht.dtype)])
    return o, ht, [x.grad for x in xs]


def _lowp_inputs(ins, dtype):
    """Inputs rounded the way the kernel sees them (h0 stays fp32), back in float64."""
    return [t.to(dtype).double() if i < 5 else t.float().double() for i, t in enumerate(ins)]


def _check_vs_refs(ins, dtype, grads, *, cu=None, l2=True, over=None, chunk_size=64):
    """Kernel forward + backward (with config fields ``over`` replacing the table's) against the float64
    recurrence, at the tolerance of the low-precision chunked reference (same chunk size). Returns the kernel's
    (o, ht, grads)."""
    with _override(over):
        o, ht, dx = _run_kernel(ins, dtype, cu=cu, l2=l2, grads=grads, chunk_size=chunk_size)
    ro, rht, rdx = _run_ref(recurrent_gated_delta_rule_ref, ins, cu=cu, l2=l2, grads=grads)
    lo, lht, ldx = _run_ref(chunk_gated_delta_rule_ref, [t.float() for t in _lowp_inputs(ins, dtype)], cu=cu,
                            l2=l2, grads=grads, compute_dtype=dtype if dtype != torch.float32 else None,
                            chunk_size=chunk_size)
    assert_close("o", o, ro, lo, dtype=dtype)
    assert_close("final_state", ht, rht, lht, dtype=dtype)
    for name, a, r, lw in zip(NAMES, dx, rdx, ldx, strict=True):
        assert_close(f"d{name}", a, r, lw, dtype=dtype)
    return o, ht, dx


@settings(max_examples=examples(3, 12))  # the interpreter's share of CI time; all 12 on the GPU
@given(
    B=st.integers(1, 2), T=st.integers(1, pick(150, 600)), H=st.integers(1, 2), G=st.sampled_from([1, 2, 3, 4]),
    K=st.sampled_from(pick([16, 32], [16, 64, 128, 192, 256])), V=st.sampled_from(pick([16, 32], [32, 128, 256])),
    l2=st.booleans(), dtype=dtypes(), seed=seeds(),
)
def test_kernel_vs_recurrence(B, T, H, G, K, V, l2, dtype, seed):
    HV = H * G
    ins = _inputs(seed, B, T, H, HV, K, V, B, l2=l2)
    grads = (randn((B, T, HV, V), seed + 1, dtype=torch.float64, device="cpu"),
             randn((B, HV, K, V), seed + 2, dtype=torch.float64, device="cpu"))
    _check_vs_refs(ins, dtype, grads, l2=l2)


@settings(max_examples=examples(2, 6))
@given(T=st.integers(1, pick(130, 300)), V=st.sampled_from([300, 512, 1024]), K=st.sampled_from(pick([16], [64, 128])),
       dtype=dtypes(), seed=seeds())
def test_wide_value_heads(T, V, K, dtype, seed):
    """V up to 1024 (fla's default GatedDeltaNet has head_dim 256 with expand_v 2: V = 512): every stage tiles V,
    forward and backward against the float64 recurrence; GVA and an initial state included."""
    ins = _inputs(seed, 1, T, 1, 2, K, V, 1)
    grads = (randn((1, T, 2, V), seed + 1, dtype=torch.float64, device="cpu"),
             randn((1, 2, K, V), seed + 2, dtype=torch.float64, device="cpu"))
    _check_vs_refs(ins, dtype, grads)


@given(T=st.integers(65, pick(200, 1500)), K=st.sampled_from(pick([32], [64, 128])), decay=st.sampled_from([0.0, 0.1]),
       dtype=dtypes(), seed=seeds())
@settings(max_examples=examples(2, 6))
def test_correlated_keys_weak_decay(T, K, decay, dtype, seed):
    """fla's own test inputs: non-negative q, k (unit rows), v in [0, 1), beta in [0.5, 0.73], g = decay·logsigmoid
    of [0, 1) (0: no decay, the state keeps growing), unit-scale initial state. Every chunk's keys point nearly the
    same way, so ``I + A`` is ill-conditioned and the WY inverse's rounding is amplified: it must stay within the
    input dtype's own error (a single tf32 product per block dot does not, on the GPU)."""
    B, H, HV, V = 1, 1, 2, 64
    g_ = gen(seed)
    q = torch.nn.functional.normalize(rand((B, T, H, K), g_, dtype=torch.float64, device="cpu"), dim=-1)
    k = torch.nn.functional.normalize(rand((B, T, H, K), g_, dtype=torch.float64, device="cpu"), dim=-1)
    v = rand((B, T, HV, V), g_, dtype=torch.float64, device="cpu")
    g = torch.nn.functional.logsigmoid(rand((B, T, HV), g_, dtype=torch.float64, device="cpu")) * decay
    beta = torch.sigmoid(rand((B, T, HV), g_, dtype=torch.float64, device="cpu"))
    h0 = randn((B, HV, K, V), g_, dtype=torch.float64, device="cpu")
    ins = [q, k, v, g, beta, h0]
    o, ht, _ = _run_kernel(ins, dtype, l2=False)
    ro, rht, _ = _run_ref(recurrent_gated_delta_rule_ref, ins, l2=False)
    lo, lht, _ = _run_ref(chunk_gated_delta_rule_ref, [t.float() for t in _lowp_inputs(ins, dtype)], l2=False,
                          compute_dtype=dtype if dtype != torch.float32 else None)
    assert_close("o", o, ro, lo, dtype=dtype)
    assert_close("final_state", ht, rht, lht, dtype=dtype)

@given(B=st.integers(1, 2), T=st.integers(1, 200), H=st.integers(1, 2), G=st.sampled_from([1, 2]),
       l2=st.booleans(), gmin=st.sampled_from([-0.5, -5.0]), seed=seeds())
def test_chunk_reference_equals_recurrence(B, T, H, G, l2, gmin, seed):
    ins = _inputs(seed, B, T, H, H * G, 16, 32, B, gmin=gmin, l2=l2)
    ro, rht, _ = _run_ref(recurrent_gated_delta_rule_ref, ins, l2=l2)
    co, cht, _ = _run_ref(chunk_gated_delta_rule_ref, ins, l2=l2, chunk_size=16 if T % 2 else 64)
    assert_close("o", co, ro, dtype=torch.float64)
    assert_close("final_state", cht, rht, dtype=torch.float64)


@given(T=st.integers(2, pick(150, 700)), K=st.sampled_from(pick([16, 32], [128])), dtype=dtypes(), seed=seeds())
def test_split_sequence_with_carried_state(T, K, dtype, seed):
    B, H, HV, V = 1, 1, 2, 32
    ins = _inputs(seed, B, T, H, HV, K, V, B)
    cut = int(torch.randint(1, T, (1,), generator=gen(seed)))
    o, ht, _ = _run_kernel(ins, dtype)
    first = [t[:, :cut] if i < 5 else t for i, t in enumerate(ins)]
    o1, h1, _ = _run_kernel(first, dtype)
    second = [t[:, cut:] if i < 5 else h1.detach().double().cpu() for i, t in enumerate(ins)]
    o2, h2, _ = _run_kernel(second, dtype)
    ro, rht, _ = _run_ref(recurrent_gated_delta_rule_ref, ins)
    lo, lht, _ = _run_ref(chunk_gated_delta_rule_ref, [t.float() for t in _lowp_inputs(ins, dtype)],
                          compute_dtype=dtype if dtype != torch.float32 else None)
    assert_close("o (split)", torch.cat([o1, o2], 1), ro, lo, dtype=dtype)
    assert_close("final_state (split)", h2, rht, lht, dtype=dtype)
    assert_close("o (one pass)", o, ro, lo, dtype=dtype)


@settings(max_examples=examples(3, 12))  # the interpreter's share of CI time; all 12 on the GPU
@given(lens=st.lists(st.sampled_from([1, 2, 17, 63, 64, 65, 100]) | st.integers(1, pick(130, 400)),
                     min_size=1, max_size=4), G=st.sampled_from([1, 2]), dtype=dtypes(), seed=seeds())
def test_varlen_equals_loop(lens, G, dtype, seed):
    H, K, V = 1, 16 if not P.big else 128, 32 if not P.big else 128
    HV = H * G
    T, N = sum(lens), len(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    ins = _inputs(seed, 1, T, H, HV, K, V, N)
    grads = (randn((1, T, HV, V), seed + 1, dtype=torch.float64, device="cpu"),
             randn((N, HV, K, V), seed + 2, dtype=torch.float64, device="cpu"))
    o, ht, _ = _check_vs_refs(ins, dtype, grads, cu=cu)
    # the same as a loop of single-sequence kernel calls
    for n in range(N):
        s, e = int(cu[n]), int(cu[n + 1])
        part = [t[:, s:e] if i < 5 else t[n:n + 1] for i, t in enumerate(ins)]
        on, hn, _ = _run_kernel(part, dtype)
        assert_close(f"o seq {n}", o[:, s:e], on.double(), on.double(), dtype=dtype)
        assert_close(f"final seq {n}", ht[n:n + 1], hn.double(), hn.double(), dtype=dtype)


@pytest.mark.parametrize("where", ["host", "device"])
def test_varlen_plan_follows_cu_seqlens_changes(monkeypatch, where):
    """A plan from host values reads cu_seqlens one time per forward + backward (the forward's plan serves the
    backward); a plan built on the device reads it never. Either way a change in place, with the version counter
    bumped or not (``.data``, numpy), is honoured by the next call. A bad in-place value is refused by the host
    plan; the device plan clamps it (cu[1] > T: the first sequence takes every token, the second none)."""
    monkeypatch.setattr(plan_mod, "plans_on_device", lambda cu: where == "device")
    T, K, V = 100, 16, 32
    ins = _inputs(3, 1, T, 1, 1, K, V, 2)
    x = [t.to(P.device, torch.float32) for t in ins]
    cu = torch.tensor([0, 30, T], dtype=torch.int32, device=P.device)
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist",
                        lambda self: (reads.append(1) if self.data_ptr() == cu.data_ptr() else None, tolist(self))[1])

    def run(cu_, grad=False):
        xs = [t.clone().requires_grad_(grad) for t in x]
        o, ht = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu_)
        if grad:
            torch.autograd.backward([o, ht], [torch.ones_like(o), torch.ones_like(ht)])
        return o.detach(), ht.detach()

    o1, _ = run(cu, grad=True)
    want = 1 if where == "host" else 0
    assert len(reads) == want, f"cu_seqlens read to the host {len(reads)} times in one forward + backward"

    def same_as_fresh_copy(what):
        o, h = run(cu)
        r, rh = run(cu.clone())
        torch.testing.assert_close(o, r, rtol=0, atol=0, msg=what)
        torch.testing.assert_close(h, rh, rtol=0, atol=0, msg=what)
        return o

    cu[1] = 70  # in place, version counter bumped
    assert not torch.equal(o1, same_as_fresh_copy("after cu[1] = 70"))
    version = cu._version
    cu.data[1] = 50  # in place without bumping cu's version counter
    assert cu._version == version
    same_as_fresh_copy("after cu.data[1] = 50")
    if cu.device.type == "cpu":
        cu.numpy()[1] = 20
        assert cu._version == version
        same_as_fresh_copy("after cu.numpy()[1] = 20")
    cu[1] = 120
    if where == "host":
        with pytest.raises(ValueError, match="cu_seqlens"):
            run(cu)
    else:
        o, h = run(cu)
        r, rh = run(torch.tensor([0, T, T], dtype=torch.int32, device=P.device))
        assert torch.equal(o, r) and torch.equal(h, rh)
    if where == "device":
        assert not reads


def test_strided_cu_seqlens_equals_contiguous():
    """A strided cu_seqlens (a view ``t[::2]``) gives bitwise the outputs and gradients of its contiguous copy."""
    T, K, V = 100, 16, 32
    ins = _inputs(5, 1, T, 1, 2, K, V, 3)
    grads = (randn((1, T, 2, V), 6, dtype=torch.float64, device="cpu"),
             randn((3, 2, K, V), 7, dtype=torch.float64, device="cpu"))
    wide = torch.tensor([0, 1 << 20, 40, -(1 << 20), 64, 1 << 20, T], dtype=torch.int32, device=P.device)
    strided = wide[::2]
    assert not strided.is_contiguous()
    a = _run_kernel(ins, torch.float32, cu=strided, grads=grads)
    b = _run_kernel(ins, torch.float32, cu=strided.contiguous(), grads=grads)
    for name, x, y in zip(("o", "final_state", *("d" + n for n in NAMES)), [*a[:2], *a[2]], [*b[:2], *b[2]],
                          strict=True):
        assert torch.equal(x, y), f"{name}: strided cu_seqlens differs from contiguous"


@settings(max_examples=examples(3, 12))  # the interpreter's share of CI time; all 12 on the GPU
@given(T=st.integers(1, pick(100, 400)), G=st.sampled_from([2, 4]), dtype=dtypes(), seed=seeds())
def test_gva_equals_repeated_heads(T, G, dtype, seed):
    B, H, K, V = 1, pick(1, 2), pick(16, 128), pick(16, 128)
    ins = _inputs(seed, B, T, H, H * G, K, V, B)
    o, ht, _ = _run_kernel(ins, dtype)
    rep = [t.repeat_interleave(G, dim=2) if i < 2 else t for i, t in enumerate(ins)]
    o2, ht2, _ = _run_kernel(rep, dtype)
    assert torch.equal(o.cpu(), o2.cpu()) and torch.equal(ht.cpu(), ht2.cpu())


@settings(max_examples=examples(3, 12))  # the interpreter's share of CI time; all 12 on the GPU
@given(T=st.integers(1, pick(100, 300)), H=st.integers(1, 2), G=st.sampled_from([1, 2, 3, 4]), dtype=dtypes(),
       seed=seeds())
def test_forward_backward_bitwise_deterministic(T, H, G, dtype, seed):
    """Repeated forward + backward calls give bitwise-equal outputs and gradients, for every GVA ratio: the dq / dk
    sums over the value heads of a q/k head do not depend on the order in which the heads arrive (``gva.py``). On
    the GPU this also catches races inside a kernel (a result that depends on timing)."""
    K = V = pick(16, 128)
    HV = H * G
    ins = _inputs(seed, 1, T, H, HV, K, V, 1)
    _assert_repeatable(ins, dtype, seed)


def _assert_repeatable(ins, dtype, seed):
    """Three identical forward + backward calls (do, dht from ``seed``) give bitwise-equal results."""
    B, T, HV, V = ins[2].shape
    K, N = ins[0].shape[3], ins[5].shape[0]
    grads = (randn((B, T, HV, V), seed + 1, dtype=torch.float64, device="cpu"),
             randn((N, HV, K, V), seed + 2, dtype=torch.float64, device="cpu"))
    o, ht, dx = _run_kernel(ins, dtype, grads=grads)
    for _ in range(2):
        o2, ht2, dx2 = _run_kernel(ins, dtype, grads=grads)
        for name, a, b in zip(("o", "final_state") + tuple("d" + n for n in NAMES), [o, ht, *dx], [o2, ht2, *dx2],
                              strict=True):
            assert torch.equal(a, b), f"{name}: differs between two identical calls"


@pytest.mark.parametrize("K", pick([16], [64, 128]))
@settings(max_examples=examples(1, 2), deadline=None)
@given(G=st.sampled_from([1, 2]), dtype=dtypes(), seed=seeds())
def test_many_programs_backward_repeatable_and_accurate(K, G, dtype, seed):
    """Hundreds of programs in flight at once (on the GPU B4 x 8 value heads x 16 chunks per kernel), on fla's
    test inputs (non-negative unit q, k; v in [0, 1); g = logsigmoid(U[0, 1))): a race inside a software-pipelined
    loop shows only under such load. wy_bwd pipelined on sm_90 under Triton 3.6 gave dg and dbeta that changed
    from call to call, ten times their error against float64 (``ChunkConfig.check``). Bitwise repeatable, and
    every output and gradient against the float64 recurrence (K = V = 128: twice the loop trips of 64)."""
    B, T, H = pick((2, 70, 1), (4, 1024, 8 // G))
    V = K
    g_ = gen(seed)
    q, k = (torch.nn.functional.normalize(rand((B, T, H, K), g_, dtype=torch.float64, device="cpu"), dim=-1)
            for _ in range(2))
    v = rand((B, T, H * G, V), g_, dtype=torch.float64, device="cpu")
    g = torch.nn.functional.logsigmoid(rand((B, T, H * G), g_, dtype=torch.float64, device="cpu"))
    beta = torch.sigmoid(rand((B, T, H * G), g_, dtype=torch.float64, device="cpu"))
    h0 = randn((B, H * G, K, V), g_, dtype=torch.float64, device="cpu")
    ins = [q, k, v, g, beta, h0]
    grads = (randn((B, T, H * G, V), seed + 1, dtype=torch.float64, device="cpu"),
             randn((B, H * G, K, V), seed + 2, dtype=torch.float64, device="cpu"))
    _check_vs_refs(ins, dtype, grads, l2=False)
    _assert_repeatable(ins, dtype, seed)


@pytest.mark.parametrize("K", [16, 32])
@pytest.mark.parametrize("G", [2, 4])
@settings(max_examples=examples(2, 4))
@given(T=st.integers(1, pick(80, 200)), V=st.sampled_from(pick([16, 32], [16, 32, 64])), dtype=dtypes(),
       seed=seeds())
def test_small_k_tiles_with_value_head_sums(K, G, T, V, dtype, seed):
    """K = 16 / 32 with the value heads summing dq / dk (HV > H), V down to 16: wy_bwd's 16-wide K or V tiles
    miscompile on sm_90 (Triton 3.6: out-of-range shared-memory addresses, dk off by ~10% and different from one
    call to the next), so such head dims take 32-wide tiles. Against the float64 recurrence, and bitwise repeatable
    (G 2: a running sum of two terms; G 4: four slots added in head order)."""
    H = 1
    ins = _inputs(seed, 1, T, H, H * G, K, V, 1)
    grads = (randn((1, T, H * G, V), seed + 1, dtype=torch.float64, device="cpu"),
             randn((1, H * G, K, V), seed + 2, dtype=torch.float64, device="cpu"))
    _check_vs_refs(ins, dtype, grads)
    _assert_repeatable(ins, dtype, seed)


@settings(max_examples=examples(3, 8))
@given(T=st.integers(1, pick(80, 300)), G=st.sampled_from([1, 2]), K=st.sampled_from(pick([8, 24], [8, 24, 60, 100])),
       V=st.sampled_from(pick([12, 40], [4, 12, 20, 40, 100, 200])), varlen=st.booleans(), seg=st.booleans(),
       dtype=dtypes(), seed=seeds())
def test_head_dims_of_any_size(T, G, K, V, varlen, seg, dtype, seed):
    """K, V not multiples of 16, below 16 too (fla takes any head dim up to 256): tiles are padded to powers of two
    (at least 16) and masked, so forward and backward equal the float64 recurrence, dense or varlen, with
    sequence splitting."""
    H = 1
    if varlen:
        cut = T // 3
        cu = torch.tensor([0, cut, T], dtype=torch.int32)
        N = 2
    else:
        cu, N = None, 1
    ins = _inputs(seed, 1, T, H, H * G, K, V, N)
    grads = (randn((1, T, H * G, V), seed + 1, dtype=torch.float64, device="cpu"),
             randn((N, H * G, K, V), seed + 2, dtype=torch.float64, device="cpu"))
    over = dict(seg_units=1 << 20, seg_below=1 << 20, seg_min=1) if seg else None
    _check_vs_refs(ins, dtype, grads, cu=cu, over=over)


@pytest.mark.parametrize("chunk_size", [16, 32])
@settings(max_examples=examples(4, 8))
@given(lens=st.lists(st.integers(0, pick(90, 300)), min_size=1, max_size=3), varlen=st.booleans(),
       G=st.sampled_from([1, 2]), seg=st.booleans(), l2=st.booleans(), dtype=dtypes(), seed=seeds())
def test_chunk_sizes_16_and_32(chunk_size, lens, varlen, G, seg, l2, dtype, seed):
    """fla's chunk_size 16 / 32 (the GPU kernels take 16 as 32): the same function as 64 (one or two 16-row blocks per
    WY inverse), forward and all six gradients against the float64 recurrence, dense or varlen (empty sequences
    too), GVA, sequence splitting."""
    H, K, V = 1, pick(16, 64), pick(16, 64)
    if varlen:
        T = max(sum(lens), 1)
        lens = lens if sum(lens) else [1]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        B, N = 1, len(lens)
    else:
        T, cu, B, N = max(lens[0], 1), None, 1, 1
    ins = _inputs(seed, B, T, H, H * G, K, V, N, l2=l2)
    grads = (randn((B, T, H * G, V), seed + 1, dtype=torch.float64, device="cpu"),
             randn((N, H * G, K, V), seed + 2, dtype=torch.float64, device="cpu"))
    over = dict(seg_units=1 << 20, seg_below=1 << 20, seg_min=1) if seg else None
    _check_vs_refs(ins, dtype, grads, cu=cu, l2=l2, over=over, chunk_size=chunk_size)


@settings(max_examples=examples(3, 8))
@given(lens=st.lists(st.integers(0, pick(100, 300)), min_size=1, max_size=3), varlen=st.booleans(),
       G=st.sampled_from([1, 2]), seg=st.booleans(), gate=st.booleans(), dtype=dtypes(), seed=seeds())
def test_first_decay_of_a_sequence_from_no_state_has_zero_gradient(lens, varlen, G, seg, gate, dtype, seed):
    """Without an initial state a sequence's first decay scales a zero state, so its gradient is 0 exactly (FlashQLA's
    tests hold it to that), through fla's in-kernel gate too, dense or varlen, with sequence splitting; with an
    initial state it is not (the float64 recurrence's is compared in the other properties)."""
    if sum(lens) == 0:
        return
    H, K, V = 1, pick(16, 128), pick(16, 128)
    B, T, N, cu = _lens_layout(lens, varlen)
    ins = _inputs(seed, B, T, H, H * G, K, V, N)
    xs = [t.to(P.device, dtype if i < 3 else torch.float32) for i, t in enumerate(ins[:5])]
    kw = {}
    if gate:
        # decays -exp(A_log)·softplus(g + dt_bias) of 0.3-0.8, as g's own range gives without the gate
        kw = dict(use_gate_in_kernel=True, A_log=randn((H * G,), seed + 1, scale=0.1),
                  dt_bias=randn((H * G,), seed + 2, scale=0.1))
    xs[3].requires_grad_()
    over = dict(seg_units=1 << 20, seg_below=1 << 20, seg_min=1) if seg else None
    with _override(over):
        o, _ = chunk_gated_delta_rule(*xs[:5], cu_seqlens=cu.to(P.device) if cu is not None else None,
                                      use_qk_l2norm_in_kernel=True, **kw)
        (o.float() * randn(o.shape, seed + 3)).sum().backward()
    dg = xs[3].grad
    if cu is None:
        firsts = [(b, 0) for b in range(B)]
    else:  # (an empty sequence has no first token)
        c = cu.tolist()
        firsts = [(0, c[n]) for n in range(N) if c[n + 1] > c[n]]
    for b, t in firsts:
        assert (dg[b, t] == 0).all(), f"row {b}, token {t}: dg at a sequence's first token {dg[b, t].tolist()}"
    assert torch.isfinite(dg).all() and dg.abs().sum() > 0


@pytest.mark.skipif(P.big, reason="checks every address the interpreter dereferences")
@pytest.mark.parametrize("chunk_size", [16, 32])
def test_chunk_sizes_stay_in_bounds(chunk_size):
    """chunk_size 16 / 32 with partial last chunks, GVA and varlen: no access outside the tensors passed in."""
    from addresscheck import AddressCheck

    T, H, HV, K, V = 45, 1, 2, 16, 24
    ins = [t.float().contiguous() for t in _inputs(3, 1, T, H, HV, K, V, 2)]
    cu = torch.tensor([0, 19, T], dtype=torch.int32)
    xs = [t.clone().requires_grad_() for t in ins]
    do, dht = torch.randn(1, T, HV, V), torch.randn(2, HV, K, V)
    with AddressCheck(*xs, do, dht, cu) as ac:
        o, ht = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu,
                                       chunk_size=chunk_size)
        torch.autograd.backward([o, ht], [do, dht])
    ac.assert_clean()


def test_kernel_chunk(monkeypatch):
    """The GPU kernels take 16-token chunks as 32 (every wy_bwd product would be 16 deep, the tile width Triton 3.6
    miscompiles there on sm_90); the interpreter, the CPU and the reference run what is asked."""
    for size in (16, 32, 64):
        assert plan_mod.kernel_chunk(size, torch.device("cpu"), "auto") == size
    monkeypatch.setattr(plan_mod, "is_interpreter", lambda: False)
    assert plan_mod.kernel_chunk(16, torch.device("cuda", 0), "auto") == 32
    assert plan_mod.kernel_chunk(16, torch.device("cuda", 0), "triton") == 32
    assert plan_mod.kernel_chunk(16, torch.device("cuda", 0), "reference") == 16
    for size in (32, 64):
        assert plan_mod.kernel_chunk(size, torch.device("cuda", 0), "auto") == size
    monkeypatch.setattr(plan_mod, "is_interpreter", lambda: True)
    assert plan_mod.kernel_chunk(16, torch.device("cuda", 0), "auto") == 16


@pytest.mark.gpu_only
@pytest.mark.parametrize("varlen", [False, True])
def test_gpu_runs_16_token_chunks_as_32(varlen):
    """On the GPU chunk_size=16 is chunk_size=32 bit for bit (forward and all six gradients), fla's chunk_indices
    still count 16-token chunks, and the reference runs 16 itself."""
    T, N = 100, 2 if varlen else 1
    ins = _inputs(0, 1, T, 1, 2, 64, 64, N)
    cu = torch.tensor([0, 37, T], dtype=torch.int32, device=P.device) if varlen else None
    do, dht = randn((1, T, 2, 64), 1, device=P.device), randn((N, 2, 64, 64), 2, device=P.device)
    outs = []
    for size in (16, 32):
        xs = [t.to(P.device, torch.bfloat16 if i < 5 else torch.float32).requires_grad_() for i, t in enumerate(ins)]
        extra = {}
        if varlen:
            extra["chunk_indices"] = torch.tensor([(n, c) for n, L in enumerate((37, T - 37))
                                                   for c in range(-(-L // size))], device=P.device)
        o, ht = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu,
                                       chunk_size=size, **extra)
        torch.autograd.backward([o, ht], [do.to(o.dtype), dht])
        outs.append([o.detach(), ht.detach(), *(x.grad for x in xs)])
    for name, a, b in zip(("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"), *outs, strict=True):
        assert torch.equal(a, b), f"{name}: chunk_size 16 differs from 32"
    xs = [t.to(P.device, torch.bfloat16 if i < 5 else torch.float32) for i, t in enumerate(ins)]
    o16, _ = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], cu_seqlens=cu, chunk_size=16, impl="reference")
    o32, _ = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], cu_seqlens=cu, chunk_size=32, impl="reference")
    assert o16.shape == o32.shape == (1, T, 2, 64) and not torch.equal(o16, o32)


@pytest.mark.skipif(P.big, reason="checks every address the interpreter dereferences")
@pytest.mark.parametrize("K,V,varlen", [(8, 12, False), (24, 40, True), (60, 20, True)])
def test_head_dims_of_any_size_stay_in_bounds(K, V, varlen):
    """The padded tiles of odd head dims never address past q, k, v, g, beta, the initial state or the gradients."""
    from addresscheck import AddressCheck

    T, H, HV = 70, 1, 2
    N = 2 if varlen else 1
    ins = [t.float().contiguous() for t in _inputs(0, 1, T, H, HV, K, V, N)]
    cu = torch.tensor([0, 30, T], dtype=torch.int32) if varlen else None
    xs = [t.clone().requires_grad_() for t in ins]
    do = torch.randn(1, T, HV, V)
    dht = torch.randn(N, HV, K, V)
    with AddressCheck(*xs, do, dht, *([cu] if varlen else [])) as ac:
        o, ht = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu)
        torch.autograd.backward([o, ht], [do, dht])
    ac.assert_clean()


@pytest.mark.skipif(P.big, reason="checks every address the interpreter dereferences")
@pytest.mark.parametrize("bias,neg", [(True, False), (False, True)])
def test_options_stay_in_bounds(bias, neg):
    """fla's gate and beta options, forward and backward (their elementwise passes tile the value heads in a padded
    power of two: HV = 3 here), never address past the tensors passed in, A_log and dt_bias included."""
    from addresscheck import AddressCheck

    T, H, HV, K, V = 45, 1, 3, 16, 24
    ins = [t.float().contiguous() for t in _inputs(4, 1, T, H, HV, K, V, 2)]
    A_log = torch.rand(HV).log().requires_grad_()
    dt_bias = torch.randn(HV).requires_grad_() if bias else None
    cu = torch.tensor([0, 19, T], dtype=torch.int32)
    xs = [t.clone().requires_grad_() for t in ins]
    do, dht = torch.randn(1, T, HV, V), torch.randn(2, HV, K, V)
    with AddressCheck(*xs, A_log, dt_bias, do, dht, cu) as ac:
        o, ht = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu,
                                       use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                       use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg)
        torch.autograd.backward([o, ht], [do, dht])
    ac.assert_clean()
    assert all(torch.isfinite(t.grad).all() for t in (*xs, A_log, *([dt_bias] if bias else [])))


def test_wy_bwd_config_refuses_16_wide_tiles():
    """wy_bwd's 16-wide K or V tiles miscompile on sm_90 (Triton 3.6): no config may ask for them."""
    from gqla_triton.ops.gdn.config import ChunkConfig

    for field in ("wy_bwd_bk", "wy_bwd_bv"):
        with pytest.raises(ValueError, match=field):
            ChunkConfig(**{field: 16})
    assert ChunkConfig().wy_bwd_bk == 32 and ChunkConfig().wy_bwd_bv == 32


@settings(max_examples=examples(3, 12))  # the interpreter's share of CI time; all 12 on the GPU
@given(lens=st.lists(st.integers(0, pick(150, 400)), min_size=1, max_size=3), varlen=st.booleans(),
       seg=st.sampled_from([0, 1, 2]), G=st.sampled_from([1, 2]), dtype=dtypes(), seed=seeds())
def test_saved_states_equal_recomputed(lens, varlen, seg, G, dtype, seed):
    """``save_states=True`` (the backward reads the forward's w, h and v_new; under sequence splitting it rebuilds
    only the segment maps' M part) and ``save_states=False`` (it recomputes them) give bitwise-equal outputs and
    gradients, with and without varlen (empty sequences included) and sequence splitting (``seg`` chunks)."""
    H, K, V = 1, pick(32, 128), pick(32, 128)
    HV = H * G
    B, T, N, cu = _lens_layout(lens, varlen)
    cu = cu.to(P.device) if cu is not None else None
    if T == 0:
        return
    ins = _inputs(seed, B, T, H, HV, K, V, N)
    do = randn((B, T, HV, V), seed + 1, dtype=torch.float64, device="cpu").to(P.device, dtype)
    dht = randn((N, HV, K, V), seed + 2, dtype=torch.float64, device="cpu").to(P.device, torch.float32)
    res, passes = [], []
    over = dict(seg_units=1 << 20, seg_below=1 << 20, seg_min=seg) if seg else None
    with pytest.MonkeyPatch.context() as mp, _override(over):
        state_fwd = launch_mod.chunk_gdn_state_fwd
        mp.setattr(launch_mod, "chunk_gdn_state_fwd", lambda *a, **kw: (passes.append(1), state_fwd(*a, **kw))[1])
        for save in (True, False):
            xs = [t.to(P.device, dtype if i < 5 else torch.float32).requires_grad_() for i, t in enumerate(ins)]
            o, ht = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True,
                                           use_qk_l2norm_in_kernel=True, cu_seqlens=cu, save_states=save)
            torch.autograd.backward([o, ht], [do, dht])
            res.append([o, ht] + [x.grad for x in xs])
    assert len(passes) == 3, f"state passes: {len(passes)} (expected 1 with saved states, 2 recomputing)"
    for name, a, b in zip(("o", "final_state", *("d" + n for n in NAMES)), *res, strict=True):
        assert torch.equal(a, b), f"{name}: saved and recomputed states differ"


@settings(max_examples=examples(3, 12))  # the interpreter's share of CI time; all 12 on the GPU
@given(lens=st.lists(st.integers(0, pick(200, 700)), min_size=1, max_size=3), seg_min=st.integers(1, 3),
       varlen=st.booleans(), G=st.sampled_from([1, 2]), dtype=dtypes(), seed=seeds())
def test_sequence_splitting_state_pass(lens, seg_min, varlen, G, dtype, seed):
    """Sequences split into segments of seg_min chunks (config ``seg_units``: segment maps in parallel, then
    chained) against the float64 recurrence, forward and backward; varlen includes empty sequences."""
    H, K, V = 1, pick(32, 128), pick(32, 128)
    HV = H * G
    B, T, N, cu = _lens_layout(lens, varlen)
    if T == 0:
        return
    ins = _inputs(seed, B, T, H, HV, K, V, N)
    grads = (randn((B, T, HV, V), seed + 1, dtype=torch.float64, device="cpu"),
             randn((N, HV, K, V), seed + 2, dtype=torch.float64, device="cpu"))
    _check_vs_refs(ins, dtype, grads, cu=cu, over=dict(seg_units=1 << 20, seg_below=1 << 20, seg_min=seg_min))


SEG = {"seg_units": 1 << 20, "seg_below": 1 << 20, "seg_min": 1}
STAGE_VARIANTS = [
    {"wy_prec": "tf32x3"}, {"wy_prec": "ieee"},
    {"wy_bwd_trans": True, "grad_trans": True}, {"wy_bwd_trans": False, "grad_trans": False},
    {"grad_early": True, "grad_trans": False}, {"grad_early": False},
    {"grad_late": True, "wy_bwd_late": True},
    {"grad_late": True, "wy_bwd_late": True, "grad_trans": False, "wy_bwd_trans": False},
    {"grad_late": False, "wy_bwd_late": False}, {"out_early": True, "dvl_early": True},
    {"out_early": False, "dvl_early": False}, {"sout_chunks": 1 << 20}, {"sout_chunks": 0},
    {"sout_chunks": 1 << 20, **SEG}, {"sout_chunks": 0, **SEG},
    {"wy_prec": "tf32x3", "grad_trans": True, "wy_bwd_trans": True, **SEG}]


@pytest.mark.parametrize("over", STAGE_VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@settings(max_examples=examples(1, 2))
@given(T=st.integers(1, pick(150, 400)), G=st.sampled_from([1, 2, 4]), dtype=dtypes(), seed=seeds())
def test_stage_variants(over, T, G, dtype, seed):
    """The stage variants, each flag both ways (the 16x16 inverse on fp32 FMA or tf32 tensor-core products; the
    backward's wy and grad stages with transposed dot results; grad_chunk's q / k loads before or after its V loop;
    the output's and dv_local's loads before their K loop; the GVA sums' late waits; the H200's choices together
    with sequence splitting) against the float64 recurrence, forward and backward."""
    B, H, K, V = 1, 1, pick(32, 128), pick(32, 128)
    HV = H * G
    ins = _inputs(seed, B, T, H, HV, K, V, B)
    grads = (randn((B, T, HV, V), seed + 1, dtype=torch.float64, device="cpu"),
             randn((B, HV, K, V), seed + 2, dtype=torch.float64, device="cpu"))
    _check_vs_refs(ins, dtype, grads, over=over)


def test_config_key_is_padded():
    """K between two table entries takes the entry of its padded tile width (K = 192 tiles like K = 256)."""
    from gqla_triton.dispatch import table_config

    def h200(K, V):
        return table_config("h200", "gdn_chunk", plan_mod.config_key(K, V))

    assert h200(192, 128) == h200(256, 128) != h200(128, 128)
    assert h200(80, 96) == h200(128, 128)


@given(lens=st.lists(st.integers(0, pick(150, 400)), min_size=1, max_size=3), varlen=st.booleans(),
       seg=st.sampled_from([0, 1, 3]), G=st.sampled_from([1, 2]), bad=st.sampled_from([None, "v", "k"]),
       dtype=dtypes(), seed=seeds())
@settings(max_examples=examples(2, 10))
def test_fused_output_forward(lens, varlen, seg, G, bad, dtype, seed):
    """The forward without gradient where the state pass forms the output (``sout``) against the float64
    recurrence, and against the separate output kernel: the same NaN positions (one non-finite v or k entry:
    its column or its token onwards, nothing earlier) and the finite values within tolerance."""
    H, K, V = 1, pick(32, 128), pick(32, 64)
    HV = H * G
    B, T, N, cu = _lens_layout(lens, varlen)
    if T == 0:
        return
    ins = _inputs(seed, B, T, H, HV, K, V, N, l2=False)
    if bad is not None:
        t = int(torch.randint(0, T, (1,), generator=gen(seed)))
        ins[2 if bad == "v" else 1][0, t, 0, 1] = float("nan")
    seg_over = dict(seg_units=1 << 20, seg_below=1 << 20, seg_min=seg) if seg else {}
    outs = []
    for chunks in (1 << 20, 0):
        with torch.no_grad(), _override({"sout_chunks": chunks, **seg_over}):
            outs.append(_run_kernel(ins, dtype, cu=cu, l2=False)[:2])
    (o, ht), (o2, ht2) = outs
    assert torch.equal(o.isnan(), o2.isnan()) and torch.equal(ht.isnan(), ht2.isnan())
    if bad is None:
        ro, rht, _ = _run_ref(recurrent_gated_delta_rule_ref, ins, cu=cu, l2=False)
        lo, lht, _ = _run_ref(chunk_gated_delta_rule_ref, [t.float() for t in _lowp_inputs(ins, dtype)], cu=cu,
                              l2=False, compute_dtype=dtype if dtype != torch.float32 else None)
        assert_close("o", o, ro, lo, dtype=dtype)
        assert_close("final_state", ht, rht, lht, dtype=dtype)
    else:
        ok = ~o.isnan()
        assert rel_err(o[ok].double(), o2[ok].double()) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_fused_output_rule():
    """The state pass forms the output (``sout``) only where no state program has more than sout_chunks chunks
    (segments count under sequence splitting); sout_chunks 0 never fuses."""
    def fused(T, cu=None, **fields):
        q, v = torch.zeros(1, T, 1, 16, device=P.device), torch.zeros(1, T, 2, 16, device=P.device)
        with config_override({"gdn_chunk": fields}):
            plan = plan_mod.chunk_plan(q, v, None if cu is None else torch.tensor(cu, device=P.device), cu)
            return launch_mod._fuse_out(plan, 2, 16)

    assert fused(64 * 4, sout_chunks=4) and not fused(64 * 4 + 1, sout_chunks=4)
    assert not fused(64, sout_chunks=0)
    assert fused(64 * 9, cu=[0, 64, 64 * 5, 64 * 9], sout_chunks=4)
    assert not fused(64 * 9, cu=[0, 64, 64 * 6, 64 * 9], sout_chunks=4)
    # split into segments of 4 chunks: each state program runs 4
    assert fused(64 * 40, sout_chunks=4, seg_units=20, seg_below=16, seg_min=4)
    assert not fused(64 * 40, sout_chunks=4, seg_units=0)


def test_segment_plan():
    """Segments tile every sequence in order, L chunks each (the last one shorter), empty sequences get one."""
    n, cu, rows, soff, L = plan_mod._seg_plan((0, 64 * 5 + 3, 64 * 5 + 3, 64 * 7), 2, 64, torch.device("cpu"))
    assert n == 3 + 1 + 1 and L == 2
    assert cu.tolist() == [0, 128, 256, 323, 323, 448]
    assert rows.tolist() == [0, 2, 4, 6, 6]
    assert soff.tolist() == [0, 3, 4, 5]
    n, cu, rows, soff, _ = plan_mod._seg_plan((0, 40, 40, 100), 2, 16, torch.device("cpu"))  # chunks of 16 tokens
    assert n == 2 + 1 + 2
    assert cu.tolist() == [0, 32, 40, 40, 72, 100]
    assert rows.tolist() == [0, 2, 3, 3, 5]
    assert soff.tolist() == [0, 2, 3, 5]
    cfg = ChunkConfig(seg_units=64, seg_below=16, seg_min=16)
    assert plan_mod.seg_len(cfg, 8, 512) == 64
    assert plan_mod.seg_len(cfg, 16, 512) == 0
    assert plan_mod.seg_len(cfg, 8, 16) == 0
    assert plan_mod.seg_len(cfg.replace(seg_units=0), 1, 512) == 0


def test_wu_v_tiles_never_narrower_than_k_tiles():
    """wu's V loop after its K loop never takes narrower tiles (Triton 3.6 on sm_90: shared reads past the allocation
    at K 60 / V 20 with tiles 64 / 32); the tuned K = V = 128 tiles stay as the table gives them."""
    cfg = ChunkConfig(wu_bk=64, wu_bv=64)
    assert launch_mod.wu_tiles(cfg, 60, 20) == (64, 64)
    assert launch_mod.wu_tiles(cfg, 32, 16) == (32, 32)
    assert launch_mod.wu_tiles(cfg, 16, 64) == (16, 64)
    assert launch_mod.wu_tiles(cfg, 128, 128) == (64, 64)
    for K in (16, 24, 60, 100, 128, 200, 256):
        for V in (16, 20, 40, 100, 128, 256):
            bk, bv = launch_mod.wu_tiles(cfg, K, V)
            assert bv >= bk and bk <= cfg.wu_bk


@pytest.mark.parametrize("K", [128, 129, 200])
def test_no_sequence_splitting_past_k_128(K):
    """Sequence splitting chains [K, K] fp32 maps in one program: past K = 128 (a 256-wide tile) they do not fit an
    SM's shared memory (on the H200 the chain kernel failed to launch at K = 200), so those keys are not split."""
    q = torch.zeros(1, 64 * 40, 1, K, device=P.device)
    v = torch.zeros(1, 64 * 40, 1, 32, device=P.device)
    with config_override({"gdn_chunk": dict(seg_units=64, seg_below=16, seg_min=1)}):
        plan = plan_mod.chunk_plan(q, v)
    assert (plan.seg is not None) == (K <= plan_mod.SEG_MAX_K)


@given(T=st.integers(1, pick(80, 300)), which=st.sampled_from(["o", "final_state"]),
       layout=st.sampled_from(["dense", "expanded", "strided"]), dtype=dtypes(), seed=seeds())
def test_gradients_through_one_output(T, which, layout, dtype, seed):
    """A loss on o alone or on the final state alone (the other output's gradient is None, not zeros); the incoming
    gradient dense, expanded from one element (stride 0, what ``out.sum().backward()`` passes) or strided."""
    B, H, HV, K, V = 1, 1, 2, pick(16, 128), pick(32, 128)
    # mild decay: with a loss on the final state alone, dh0 ~ exp(sum g) must stay far above fp16's range floor
    # (strong decay has its own test)
    ins = _inputs(seed, B, T, H, HV, K, V, B, gmin=-0.05)
    cot = randn((B, T, HV, V), seed + 1, dtype=torch.float64, device="cpu") if which == "o" else \
        randn((B, HV, K, V), seed + 2, dtype=torch.float64, device="cpu")

    def grads(fn, xs, **kw):
        xs = [t.detach().clone().requires_grad_() for t in xs]
        o, ht = fn(*xs[:5], initial_state=xs[5], output_final_state=True, **kw)
        out = o if which == "o" else ht
        c = cot.to(out.device, out.dtype)
        if layout == "expanded":
            c = c.flatten()[:1].reshape([1] * c.dim()).expand(c.shape)
        elif layout == "strided":
            c = c.transpose(-1, -2).contiguous().transpose(-1, -2)
        out.backward(c)
        return [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs]  # q does not reach the state

    kin = [t.to(P.device, dtype if i < 5 else torch.float32) for i, t in enumerate(ins)]
    got = grads(chunk_gated_delta_rule, kin, use_qk_l2norm_in_kernel=True)
    ref = grads(recurrent_gated_delta_rule_ref, [t.to(P.device) for t in ins], use_qk_l2norm=True)
    low = grads(chunk_gated_delta_rule_ref, [t.float() for t in _lowp_inputs(ins, dtype)], use_qk_l2norm=True,
                compute_dtype=dtype if dtype != torch.float32 else None)
    for name, a, r, lw in zip(NAMES, got, ref, low, strict=True):
        assert_close(f"d{name} (loss on {which})", a, r, lw, dtype=dtype)


@given(T=st.integers(1, pick(140, 500)), dtype=dtypes(), seed=seeds())
def test_strong_decay_finite_and_correct(T, dtype, seed):
    B, H, HV, K, V = 1, 1, 2, pick(16, 128), pick(32, 128)
    ins = _inputs(seed, B, T, H, HV, K, V, B, gmin=-20.0)
    grads = (randn((B, T, HV, V), seed + 1, dtype=torch.float64, device="cpu"),
             randn((B, HV, K, V), seed + 2, dtype=torch.float64, device="cpu"))
    _check_vs_refs(ins, dtype, grads)


def _full_decays(g, seed, *, rate=0.04):
    """g with about ``rate`` of its (token, value head) entries set to -inf (a full decay, the state reset there), and
    always one at the first token and one at a chunk's last row (or the last token)."""
    B, T, HV = g.shape
    hit = rand((B, T, HV), seed + 3, dtype=torch.float64, device="cpu") < rate
    hit[:, 0, 0] = True
    hit[:, min(T, 64) - 1, -1] = True
    return torch.where(hit, float("-inf"), g)


@given(T=st.integers(1, 200), G=st.sampled_from([1, 2]), seed=seeds())
def test_full_decay_references(T, G, seed):
    """g = -inf: the float64 recurrence resets the state at that token (from there on it equals the recurrence
    started from a zero state), and the chunked reference (g floored at G_FLOOR) equals the recurrence."""
    H, K, V = 1, 16, 32
    ins = _inputs(seed, 1, T, H, H * G, K, V, 1)
    ins[3] = _full_decays(ins[3], seed)
    ro, rht, _ = _run_ref(recurrent_gated_delta_rule_ref, ins)
    assert torch.isfinite(ro).all() and torch.isfinite(rht).all()
    t = int(torch.randint(0, T, (1,), generator=gen(seed)))
    ins[3][:, t] = float("-inf")  # every head reset at token t
    ro, rht, _ = _run_ref(recurrent_gated_delta_rule_ref, ins)
    tail = [x[:, t:] if i < 5 else torch.zeros_like(x) for i, x in enumerate(ins)]
    to, tht, _ = _run_ref(recurrent_gated_delta_rule_ref, tail)
    assert_close("o after the reset", ro[:, t:], to, dtype=torch.float64)
    assert_close("final_state after the reset", rht, tht, dtype=torch.float64)
    co, cht, _ = _run_ref(chunk_gated_delta_rule_ref, ins, chunk_size=16 if T % 2 else 64)
    assert_close("o (chunked)", co, ro, dtype=torch.float64)
    assert_close("final_state (chunked)", cht, rht, dtype=torch.float64)


@given(T=st.integers(1, pick(150, 500)), varlen=st.booleans(), seg=st.booleans(), dtype=dtypes(), seed=seeds())
def test_full_decay_kernel_vs_recurrence(T, varlen, seg, dtype, seed):
    """g with -inf entries (the state reset at those tokens) against the float64 recurrence (exp(-inf) = 0),
    forward and backward, with and without varlen and sequence splitting: finite and within the usual tolerance."""
    B, H, HV, K, V = 1, 1, 2, pick(16, 128), pick(32, 128)
    cu = torch.tensor([0, T // 3, T], dtype=torch.int32) if varlen else None
    N = 2 if varlen else 1
    ins = _inputs(seed, B, T, H, HV, K, V, N)
    ins[3] = _full_decays(ins[3], seed)
    grads = (randn((B, T, HV, V), seed + 1, dtype=torch.float64, device="cpu"),
             randn((N, HV, K, V), seed + 2, dtype=torch.float64, device="cpu"))
    _check_vs_refs(ins, dtype, grads, cu=cu, over=SEG if seg else None)


def test_bad_inputs():
    d = P.device
    q = torch.zeros(1, 8, 2, 16, device=d)
    v = torch.zeros(1, 8, 4, 16, device=d)
    g = torch.zeros(1, 8, 4, device=d)
    f = chunk_gated_delta_rule
    with pytest.raises(TypeError, match=r"^k: expected dtype torch.float32 \(same as q\)"):
        f(q, q.half(), v, g, g)
    with pytest.raises(TypeError, match="^save_states: expected a bool"):
        f(q, q, v, g, g, save_states=1)
    for bad, err in (("0.25", TypeError), (True, TypeError), ([0.25], TypeError), (torch.tensor(0.25), TypeError),
                     (math.inf, ValueError), (math.nan, ValueError), (1e39, ValueError)):
        with pytest.raises(err, match="^scale: expected a finite real number"):
            f(q, q, v, g, g, scale=bad)
    with pytest.raises(ValueError, match="^q: expected 4 dimensions"):
        f(q[0], q[0], v, g, g)
    with pytest.raises(ValueError, match="^v: value heads HV=3 must be a positive multiple"):
        f(q, q, torch.zeros(1, 8, 3, 16, device=d), g[..., :3], g[..., :3])
    with pytest.raises(ValueError, match=r"^K \(q/k head dim\): expected 1 <= K <= 256"):
        f(torch.zeros(1, 8, 2, 264, device=d), torch.zeros(1, 8, 2, 264, device=d), v, g, g)
    with pytest.raises(ValueError, match=r"^K \(q/k head dim\): expected 1 <= K <= 256"):
        f(torch.zeros(1, 8, 2, 0, device=d), torch.zeros(1, 8, 2, 0, device=d), v, g, g)
    for b, t in ((0, 8), (1, 0), (0, 0)):  # an empty batch or sequence axis
        with pytest.raises(ValueError, match=rf"^q: expected B >= 1 and T >= 1, got shape \[{b}, {t}, 2, 16\]"):
            f(q[:b, :t], q[:b, :t], v[:b, :t], g[:b, :t], g[:b, :t])
    with pytest.raises(ValueError, match="^V \\(v head dim\\): expected 1 <= V <= 1024, got 1040"):
        f(q, q, torch.zeros(1, 8, 4, 1040, device=d), g, g)
    with pytest.raises(ValueError, match="^cu_seqlens: varlen input needs B == 1"):
        f(q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), g.expand(2, -1, -1),
          g.expand(2, -1, -1), cu_seqlens=torch.tensor([0, 8], device=d))
    with pytest.raises(TypeError, match="^cu_seqlens: expected dtype in"):
        f(q, q, v, g, g, cu_seqlens=torch.tensor([0.0, 8.0], device=d))
    if not plan_mod.plans_on_device(q):  # a GPU cu_seqlens is clamped on the device (test_gdn_device_plan.py)
        for bad in ([0, 9], [-1, 8], [0, 5, 4, 8]):  # past T, negative, decreasing (cu[N] < T is padding)
            with pytest.raises(ValueError, match=r"^cu_seqlens: must be non-decreasing within \[0, T=8\]"):
                f(q, q, v, g, g, cu_seqlens=torch.tensor(bad, device=d))
    with pytest.raises(ValueError, match=r"^initial_state: expected shape \[1, 4, 16, 16\]"):
        f(q, q, v, g, g, initial_state=torch.zeros(2, 4, 16, 16, device=d), cu_seqlens=torch.tensor([0, 8], device=d))
    with pytest.raises(TypeError, match="^initial_state: expected dtype in"):
        f(q, q, v, g, g, initial_state=torch.zeros(1, 4, 16, 16, device=d, dtype=torch.float64))
    with pytest.raises(ValueError, match="^impl='gluon': the Gluon GDN kernel cannot run here"):
        f(q, q, v, g, g, impl="gluon")
    with pytest.raises(ValueError, match="^impl: expected one of"):
        f(q, q, v, g, g, impl="cuda")
    # validation comes before the choice of implementation
    with pytest.raises(ValueError, match="^v: value heads HV=3 must be a positive multiple"):
        f(q, q, torch.zeros(1, 8, 3, 16, device=d), g[..., :3], g[..., :3], impl="reference")
    with pytest.raises(ValueError, match=r"^cu_seqlens: must be non-decreasing within \[0, T=8\]"):
        f(q, q, v, g, g, cu_seqlens=torch.tensor([0, 9], device=d), impl="reference")
    if d == "cuda":
        with pytest.raises(ValueError, match="^g: expected a tensor on"):
            f(q, q, v, g.cpu(), g)
    else:
        import os
        old = os.environ.pop("TRITON_INTERPRET")
        try:
            with pytest.raises(RuntimeError, match="reference"):
                f(q, q, v, g, g)
        finally:
            os.environ["TRITON_INTERPRET"] = old


def test_checked_calls_are_remembered_by_metadata(monkeypatch):
    """A call whose arguments' metadata was checked before skips the checks (``api._call_key``): every argument the
    checks read is in the key, so a call that differs in any of them is checked again and refused, and the plan kept
    with a key follows the config (``config_override`` blocks, ``GQLA_TRITON_CONFIG``)."""
    d = P.device
    q = randn((1, 8, 2, 16), gen(0), device=d)
    v = randn((1, 8, 4, 16), gen(1), device=d)
    g = -rand((1, 8, 4), gen(2), device=d)
    b = rand((1, 8, 4), gen(3), device=d)
    f = chunk_gated_delta_rule
    plans = []
    eager = api_mod._eager
    monkeypatch.setattr(api_mod, "_eager", lambda *a, **k: plans.append(k["plan"]) or eager(*a, **k))
    o1, _ = f(q, q, v, g, b)
    o2, _ = f(q, q, v, g, b)
    assert plans[0] is plans[1] and torch.equal(o1, o2)
    for kw, err, msg in ((dict(bogus=1), TypeError, r"chunk_gated_delta_rule\(\) got unexpected keyword.*'bogus'"),
                         (dict(head_first=True), ValueError, "head_first=True is not supported"),
                         (dict(scale=math.nan), ValueError, "scale: "),
                         (dict(output_final_state=2), TypeError, "output_final_state: "),
                         (dict(save_states=1), TypeError, "save_states: "),
                         (dict(impl="gpu"), ValueError, "impl: "), (dict(chunk_size=48), ValueError, "chunk_size: "),
                         (dict(state_layout="kk"), ValueError, "state_layout: "),
                         (dict(A_log=g[0, 0]), ValueError, "A_log: given without use_gate_in_kernel")):
        with pytest.raises(err, match=f"^{msg}"):
            f(q, q, v, g, b, **kw)
    for args, err, msg in (((q, q, v, g.long(), b), TypeError, "g: expected dtype"),
                           ((q, q.double(), v, g, b), TypeError, "k: expected dtype"),
                           ((q, q[:, :, :1], v, g, b), ValueError, r"k: expected shape \[1, 8, 2, 16\]"),
                           ((q, q, v[..., :3, :], g, b), ValueError, r"g: expected shape \[1, 8, 3\]")):
        with pytest.raises(err, match=f"^{msg}"):
            f(*args)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # other strides: checked again, same result
    assert torch.equal(f(qt, q, v, g, b)[0], o1)
    with pytest.raises(ValueError, match="initial_state"):
        f(q, q, v, g, b, initial_state=torch.zeros(2, 4, 16, 16, device=d))
    with config_override({"gdn_chunk": {"sout_chunks": 7}}):
        f(q, q, v, g, b)
        assert plans[-1].cfg.sout_chunks == 7
    f(q, q, v, g, b)
    assert plans[-1].cfg.sout_chunks != 7
    monkeypatch.setenv("GQLA_TRITON_CONFIG", '{"gdn_chunk": {"sout_chunks": 5}}')
    f(q, q, v, g, b)
    assert plans[-1].cfg.sout_chunks == 5
    monkeypatch.delenv("GQLA_TRITON_CONFIG")
    f(q, q, v, g, b)
    assert plans[-1].cfg.sout_chunks not in (5, 7)


def test_bfloat16_under_the_interpreter():
    """bfloat16 inputs raise a TypeError under the interpreter (it computes bf16 wrongly, triton#11584), before any
    kernel runs; the reference implementation takes them anywhere."""
    d = P.device
    q = torch.randn(1, 8, 1, 16, device=d, dtype=torch.bfloat16)
    v = torch.randn(1, 8, 2, 16, device=d, dtype=torch.bfloat16)
    g = -torch.rand(1, 8, 2, device=d)
    if not P.big:
        with pytest.raises(TypeError, match="bfloat16"):
            chunk_gated_delta_rule(q, q, v, g, g.neg())
    else:
        assert chunk_gated_delta_rule(q, q, v, g, g.neg())[0].dtype == torch.bfloat16
    o, ht = chunk_gated_delta_rule(q, q, v, g, g.neg(), output_final_state=True, impl="reference")
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32 and torch.isfinite(o).all()


def test_reference_impl_takes_float64():
    """``impl="reference"`` takes float64 inputs, initial states and state pools (the kernels refuse them by name):
    the float64 recurrence's result, final states in float64; a pool's rows written in float64. A float64 state
    with inputs of another dtype is refused by name."""
    d, f64 = P.device, torch.float64
    q = torch.nn.functional.normalize(randn((1, 40, 1, 16), gen(4), dtype=f64), dim=-1).to(d)
    v = randn((1, 40, 2, 8), gen(5), dtype=f64).to(d)
    g = rand((1, 40, 2), gen(6), lo=-1.0, hi=0.0, dtype=f64).to(d)
    beta = rand((1, 40, 2), gen(7), lo=0.1, hi=0.9, dtype=f64).to(d)
    h0 = randn((1, 2, 16, 8), gen(8), dtype=f64).to(d)
    with pytest.raises(TypeError, match="q: .*float64"):
        chunk_gated_delta_rule(q, q, v, g, beta, initial_state=h0)
    o, ht = chunk_gated_delta_rule(q, q, v, g, beta, initial_state=h0, output_final_state=True, impl="reference")
    ro, rht = recurrent_gated_delta_rule_ref(q, q, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == ht.dtype == f64
    assert rel_err(o, ro) < 1e-12 and rel_err(ht, rht) < 1e-12
    pool = torch.zeros(3, 2, 16, 8, dtype=f64, device=d)
    pool[2] = h0[0]
    with torch.no_grad():
        o2, _ = chunk_gated_delta_rule(q, q, v, g, beta, initial_state=pool, impl="reference",
                                       state_indices=torch.tensor([2], dtype=torch.int32, device=d))
    assert torch.equal(o2, o) and rel_err(pool[2], rht[0]) < 1e-12 and not pool[:2].any()
    with pytest.raises(TypeError, match="initial_state"):
        chunk_gated_delta_rule(q.float(), q.float(), v.float(), g, beta, initial_state=h0, impl="reference")


@settings(max_examples=examples(2, 4))
@given(T=st.integers(1, pick(150, 400)), varlen=st.booleans(), G=st.sampled_from([1, 2]), dtype=dtypes(),
       seed=seeds())
def test_reference_impl_equals_triton(T, varlen, G, dtype, seed):
    """``impl="reference"`` (torch) and ``impl="triton"`` give the same outputs and gradients: both within the usual
    tolerance of the float64 recurrence, with the same return conventions (o in v's dtype, final state fp32)."""
    H, K, V = 1, pick(16, 128), pick(32, 128)
    HV = H * G
    cu = torch.tensor([0, T // 3, T], dtype=torch.int32) if varlen else None
    N = 2 if varlen else 1
    ins = _inputs(seed, 1, T, H, HV, K, V, N)
    grads = (randn((1, T, HV, V), seed + 1, dtype=torch.float64, device="cpu"),
             randn((N, HV, K, V), seed + 2, dtype=torch.float64, device="cpu"))
    ro, rht, rdx = _run_ref(recurrent_gated_delta_rule_ref, ins, cu=cu, grads=grads)
    lo, lht, ldx = _run_ref(chunk_gated_delta_rule_ref, [t.float() for t in _lowp_inputs(ins, dtype)], cu=cu,
                            grads=grads, compute_dtype=dtype if dtype != torch.float32 else None)
    for impl in ("triton", "reference"):
        o, ht, dx = _run_kernel(ins, dtype, cu=cu, grads=grads, impl=impl)
        assert o.dtype == dtype and ht.dtype == torch.float32 and o.device.type == P.device
        assert_close(f"o ({impl})", o, ro, lo, dtype=dtype)
        assert_close(f"final_state ({impl})", ht, rht, lht, dtype=dtype)
        for name, a, r, lw in zip(NAMES, dx, rdx, ldx, strict=True):
            assert a.dtype == (torch.float32 if name == "h0" else dtype)
            assert_close(f"d{name} ({impl})", a, r, lw, dtype=dtype)


@pytest.mark.parametrize("varlen,save_states", [(False, True), (True, False)])
def test_torch_compile_inference(varlen, save_states):
    """``torch.compile(fullgraph=True)`` of the op without autograd (``torch.no_grad``) traces the custom op (its
    outputs may not alias each other) and matches the eager call."""
    B, T, H, HV, K, V = 1, 100, 1, 2, 16, 32
    N = 2 if varlen else B
    ins = _inputs(11, B, T, H, HV, K, V, N)
    cu = torch.tensor([0, 37, T], dtype=torch.int32, device=P.device) if varlen else None
    dt = P.dtypes[0]
    xs = [t.to(P.device, dt if i < 5 else torch.float32) for i, t in enumerate(ins)]

    def fn(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu, save_states=save_states)

    with torch.no_grad():
        eager = fn(*xs)
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(*xs)
    for name, a, b in zip(("o", "final_state"), eager, compiled, strict=True):
        assert torch.equal(a, b), f"{name}: compiled differs from eager"


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_chunk_size_under_compile_and_over_a_pool(chunk_size):
    """chunk_size through the traced custom ops (a training step under ``torch.compile(fullgraph=True)``, aot_eager:
    forward and backward plan with it) equals eager bitwise; the pooled (inference) call with it writes the same
    final states as the plain call returns."""
    B, T, H, HV, K, V = 1, 70, 1, 2, 16, 16
    ins = _inputs(13, B, T, H, HV, K, V, 2)
    cu = torch.tensor([0, 29, T], dtype=torch.int32, device=P.device)
    dt = P.dtypes[0]

    def fn(q, k, v, g, beta, h0):
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                       chunk_size=chunk_size)
        return o.float().square().sum() + ht.square().sum()

    outs = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        xs = [t.to(P.device, dt if i < 5 else torch.float32).requires_grad_() for i, t in enumerate(ins)]
        loss = f(*xs)
        loss.backward()
        outs.append([loss.detach()] + [x.grad for x in xs])
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    xs = [t.to(P.device, dt if i < 5 else torch.float32) for i, t in enumerate(ins)]
    with torch.no_grad():
        o, ht = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu,
                                       chunk_size=chunk_size)
        pool = torch.zeros(4, HV, K, V, device=P.device)
        pool[[3, 1]] = xs[5]
        idx = torch.tensor([3, 1], dtype=torch.int32, device=P.device)
        op, _ = chunk_gated_delta_rule(*xs[:5], initial_state=pool, state_indices=idx, cu_seqlens=cu,
                                       chunk_size=chunk_size)
    assert torch.equal(op, o) and torch.equal(pool[[3, 1]], ht)


@pytest.mark.gpu_only
def test_torch_compile_fullgraph():
    B, T, H, HV, K, V = 1, 300, 2, 4, 128, 128
    ins = _inputs(7, B, T, H, HV, K, V, B)
    grads = (randn((B, T, HV, V), 8, dtype=torch.float64, device="cpu"),
             randn((B, HV, K, V), 9, dtype=torch.float64, device="cpu"))

    def fn(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)

    cf = torch.compile(fn, fullgraph=True)
    outs = []
    for f in (fn, cf):
        xs = [t.to("cuda", torch.bfloat16 if i < 5 else torch.float32).requires_grad_() for i, t in enumerate(ins)]
        o, ht = f(*xs)
        torch.autograd.backward([o, ht], [grads[0].to("cuda", o.dtype), grads[1].to("cuda", ht.dtype)])
        outs.append([o, ht] + [x.grad for x in xs])
    # inductor may fuse the torch-side l2norm differently from eager (last-bit differences in q, k)
    for name, a, b in zip(("o", "final_state") + tuple("d" + n for n in NAMES), *outs, strict=True):
        assert rel_err(b, a) <= 1e-2, f"{name}: compiled differs from eager by {rel_err(b, a):.3e}"


# ------------------------------------------------------------------ bounds checking at the H200 launch config
def _h200_cfg(bv_state=None, seg=0):
    """Every field of the H200 table's K = V = 128 entry (to override the interpreter's pinned config with)."""
    from gqla_triton.dispatch import table_config

    cfg = table_config("h200", "gdn_chunk", plan_mod.config_key(128, 128)).as_dict()
    if bv_state:  # what _state_bv narrows to on the GPU when few (sequence, head) programs run
        cfg["state_bv"] = cfg["state_bwd_bv"] = cfg["sout_bv"] = bv_state
    if seg:
        cfg.update(seg_units=1 << 20, seg_below=1 << 20, seg_min=seg)
    return cfg


@pytest.mark.skipif(P.big, reason="checks every address the interpreter dereferences")
@pytest.mark.parametrize("B,H,HV,T,varlen,bv_state,seg,save", [
    (2, 1, 1, 8, False, None, 0, True), (2, 1, 2, 63, False, 16, 0, True), (1, 2, 4, 130, True, None, 0, True),
    (1, 1, 1, 1, False, 16, 0, True), (2, 1, 2, 70, False, 64, 0, True), (2, 1, 2, 200, False, None, 1, True),
    (1, 1, 2, 200, True, 16, 1, True), (1, 2, 4, 130, True, None, 0, False),
    (1, 1, 2, 200, True, 16, 1, False), (2, 1, 2, 70, False, None, 0, None), (1, 2, 4, 130, True, 16, 0, None),
    (1, 1, 2, 200, True, 16, 1, None), (2, 1, 1, 8, False, None, 0, None), (1, 1, 3, 130, True, None, 0, True),
    (2, 2, 6, 70, False, None, 0, True)])
def test_no_out_of_bounds_access_h200_config(monkeypatch, config_override, B, H, HV, T, varlen, bv_state, seg,
                                             save):
    """Every load/store address the kernels form (where unmasked) lies inside a live tensor, at K=V=128 with the
    H200 config (with B > 1, a chunk-state row read past the end of h is an illegal memory access on the GPU).
    ``save`` None: a forward without gradient (the state pass forming the output, ``sout``)."""
    import numpy as np
    from triton.runtime import interpreter as ti

    ranges, bad = [], []

    def reg(t):
        ranges.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
        return t

    def check(ptrs, mask, what):
        a = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)].astype(np.uint64)
        if a.size:  # ranges may overlap (freed tensors' memory is reused): test each one
            r = np.array(ranges, dtype=np.uint64)
            a = np.unique(a)
            if not ((a[:, None] >= r[None, :, 0]) & (a[:, None] < r[None, :, 1])).any(1).all():
                bad.append(what)

    load, store = ti.InterpreterBuilder.create_masked_load, ti.InterpreterBuilder.create_masked_store
    monkeypatch.setattr(ti.InterpreterBuilder, "create_masked_load",
                        lambda self, p, m, o, c, v: (check(p, m, "load"), load(self, p, m, o, c, v))[1])
    monkeypatch.setattr(ti.InterpreterBuilder, "create_masked_store",
                        lambda self, p, x, m, c: (check(p, m, "store"), store(self, p, x, m, c))[1])
    alloc, l2 = launch_mod.empty, api_mod._l2norm
    monkeypatch.setattr(launch_mod, "empty", lambda *a, **kw: reg(alloc(*a, **kw)))
    index, segs, bounds = plan_mod._chunk_index, plan_mod._seg_plan, plan_mod._device_bounds

    def reg_all(tup):  # the plan's index tensors (cached by value: possibly built by an earlier test)
        items = [reg(x) if torch.is_tensor(x) else x for x in tup]
        return type(tup)._make(items) if hasattr(tup, "_make") else tuple(items)

    monkeypatch.setattr(plan_mod, "_chunk_index", lambda *a: reg_all(index(*a)))
    monkeypatch.setattr(plan_mod, "_seg_plan", lambda *a: reg_all(segs(*a)))
    monkeypatch.setattr(plan_mod, "_device_bounds", lambda *a: reg(bounds(*a)))
    monkeypatch.setattr(api_mod, "_l2norm", lambda x: reg(l2(x).contiguous()))
    K = V = 128
    N = 2 if varlen else B
    ins = _inputs(0, B, T, H, HV, K, V, N)
    cu = torch.tensor([0, T // 3, T], dtype=torch.int32) if varlen else None
    xs = [reg(t.float().contiguous()).requires_grad_(save is not None) for t in ins]
    with config_override({"gdn_chunk": _h200_cfg(bv_state, seg)}):
        o, ht = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True,
                                       use_qk_l2norm_in_kernel=True, cu_seqlens=reg(cu) if varlen else None,
                                       save_states=bool(save))
        assert not bad, f"forward: out-of-bounds {sorted(set(bad))}"
        if save is None:
            assert all(torch.isfinite(t).all() for t in (o, ht))
            return
        do, dht = reg(torch.randn_like(o)), reg(torch.randn_like(ht))
        torch.autograd.backward([o, ht], [do, dht])
    assert not bad, f"backward: out-of-bounds {sorted(set(bad))}"
    assert all(torch.isfinite(t).all() for t in [o, ht] + [x.grad for x in xs])


@settings(max_examples=examples(3, 4), deadline=None)
@given(lens=st.lists(st.integers(0, pick(70, 300)), min_size=1, max_size=4), as_tensor=st.booleans(), seed=seeds())
def test_cu_seqlens_cpu_gives_the_same_result_without_reading_the_device_copy(lens, as_tensor, seed):
    """``cu_seqlens_cpu`` (fla's option) plans from the host copy: bitwise the same outputs, and the device copy
    of cu_seqlens is never read on the host."""
    from unittest import mock

    T = max(1, sum(lens))
    lens = lens if sum(lens) else [1]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q, k, v, g, beta = (t.to(P.device) for t in _inputs(seed, 1, T, 1, 2, 16, 16, len(lens))[:5])
    q, k, v = (t.to(torch.float32) for t in (q, k, v))
    g, beta = g.float(), beta.float()
    cu_dev = torch.tensor(cu, dtype=torch.int64, device=P.device)
    ref, ref_h = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_dev, output_final_state=True)

    def no_read(*a, **k):
        raise AssertionError("read_cu_seqlens called although cu_seqlens_cpu was given")

    host = torch.tensor(cu, dtype=torch.int32) if as_tensor else cu
    with mock.patch.object(plan_mod, "read_cu_seqlens", no_read):  # the one place cu_seqlens is read on the host
        out, out_h = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_dev, cu_seqlens_cpu=host,
                                            output_final_state=True)
    assert torch.equal(out, ref) and torch.equal(out_h, ref_h)


def test_cu_seqlens_cpu_is_checked():
    q = torch.zeros(1, 8, 1, 16, device=P.device)
    v = torch.zeros(1, 8, 1, 16, device=P.device)
    g = torch.zeros(1, 8, 1, device=P.device)
    cu = torch.tensor([0, 3, 8], device=P.device)
    for bad, err in (([0, 3], ValueError), ([0, 9, 8], ValueError), ([0, 5, 3], ValueError), ([0.0, 3, 8], TypeError),
                     (torch.tensor([0, 3, 8.0]), TypeError)):
        with pytest.raises(err, match="cu_seqlens_cpu"):
            chunk_gated_delta_rule(q, q, v, g, g, cu_seqlens=cu, cu_seqlens_cpu=bad)
    with pytest.raises(ValueError, match="cu_seqlens_cpu: given without cu_seqlens"):
        chunk_gated_delta_rule(q, q, v, g, g, cu_seqlens_cpu=[0, 8])
    if cu.device.type == "cpu":  # a host copy that disagrees with a CPU cu_seqlens (unchecked: NaN outputs)
        with pytest.raises(ValueError, match=r"cu_seqlens_cpu: \[0, 7, 8\] differs from cu_seqlens"):
            chunk_gated_delta_rule(q, q, v, g, g, cu_seqlens=cu, cu_seqlens_cpu=[0, 7, 8])


@pytest.mark.gpu_only
@pytest.mark.parametrize("grad", [False, True])
def test_cu_seqlens_cpu_is_what_the_kernels_follow(grad):
    """A device ``cu_seqlens`` that disagrees with ``cu_seqlens_cpu`` (not compared: that would need a sync), even
    one whose bounds lie far outside the inputs: the kernels read the plan's copy of the host bounds, so the call
    equals the one whose ``cu_seqlens`` holds them, bit for bit (forward and gradients)."""
    T, host = 300, [0, 70, 70, 300]
    q, k, v, g, beta = (t.to(P.device).float().requires_grad_(grad) for t in _inputs(1, 1, T, 1, 2, 16, 16, 3)[:5])
    h0 = torch.randn(3, 2, 16, 16, device=P.device)
    outs = []
    for dev in (host, [0, 2**40, 5, 2**62]):
        xs = [t.detach().clone().requires_grad_(grad) for t in (q, k, v, g, beta)]
        o, ht = chunk_gated_delta_rule(*xs, initial_state=h0, output_final_state=True,
                                       cu_seqlens=torch.tensor(dev, device=P.device), cu_seqlens_cpu=host)
        outs.append([o, ht, *(torch.autograd.grad((o.sum(), ht.sum()), xs) if grad else ())])
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)



def _hopper_info():
    from gqla_triton.dispatch import DeviceInfo

    return DeviceInfo("NVIDIA H200", (9, 0), sm_count=132, smem_per_block=232448, l2_bytes=50 << 20)


def test_fp32_runs_stages_that_fit_shared_memory():
    """The tables' stages and tiles are chosen for 2-byte inputs: fp32 inputs run the state passes and the gradient
    kernel in one stage (gradient V tiles of at most 32); bf16 / fp16 keep the table's config."""
    cfg = ChunkConfig(state_num_stages=3, state_bwd_num_stages=3, grad_bv=64, grad_num_stages=3)
    for dt in (torch.bfloat16, torch.float16):
        assert plan_mod.fit_shared(cfg, dt) == cfg
    f = plan_mod.fit_shared(cfg, torch.float32)
    assert (f.state_num_stages, f.state_bwd_num_stages, f.grad_bv, f.grad_num_stages) == (1, 1, 32, 1)
    assert f.replace(state_num_stages=3, state_bwd_num_stages=3, grad_bv=64, grad_num_stages=3) == cfg


def test_fp32_k256_backward_is_refused_where_it_cannot_fit(monkeypatch):
    """fp32 inputs with a 256-wide K tile in chunks of 64: the backward's gradient kernel takes more shared memory
    than an sm_90 block holds, so a call that may run it is refused by name before any launch (chunks of 32 / 16,
    bf16 / fp16 and the forward alone run)."""
    hopper = _hopper_info()
    why = plan_mod.backward_unsupported(hopper, 64, 256, torch.float32)
    assert "chunk_size=32" in why
    for args in ((hopper, 32, 256, torch.float32), (hopper, 64, 128, torch.float32), (hopper, 64, 256, torch.bfloat16),
                 (hopper, 64, 200, torch.float16)):
        assert plan_mod.backward_unsupported(*args) is None
    assert plan_mod.backward_unsupported(hopper, 64, 129, torch.float32) is not None  # a 256-wide tile
    monkeypatch.setattr(api_mod, "device_info", lambda t: hopper)
    monkeypatch.setattr(api_mod, "_eager", lambda *a, **k: pytest.fail("launched"))
    q = torch.randn(1, 70, 1, 256, device=P.device, requires_grad=True)
    v = torch.randn(1, 70, 1, 32, device=P.device)
    g = -torch.rand(1, 70, 1, device=P.device)
    with pytest.raises(ValueError, match="q / k: float32 inputs with K 256 in chunks of 64.*chunk_size=32"):
        chunk_gated_delta_rule(q, q, v, g, g.neg())


@pytest.mark.parametrize("only", ["fp32", "K256 V256 fp16"])
def test_launches_fit_sm90_shared_memory(only):
    """Every launch of the chunked forward and backward (and the forward alone) at K, V up to 256, compiled for
    sm_90 under the H200 table, which the H100 shares (``tools.audit_shared``, no GPU), fits an sm_90 block."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "tools.audit_shared", "--gpu", "h200", "--case", "gdn", "--only", only],
                         capture_output=True, text=True, env=env, timeout=1200)
    lines = res.stdout.strip().splitlines()
    failed = "\n".join(line for line in lines if not line.startswith("ok"))
    assert res.returncode == 0, failed[-3000:] + res.stderr[-2000:]
    assert lines[-1].endswith(": 0 do not fit or compile") and int(lines[-1].split()[0]) > 10, lines[-1]


@pytest.mark.parametrize("cu", [[0, 0], [2, 2], [0, 0, 0]])
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_no_tokens_in_any_sequence_still_differentiates(cu, impl):
    """Every sequence empty (the rest padding), no initial state: every impl returns zero outputs and final states
    that autograd takes through, with zero gradients for every input."""
    xs = [t.to(P.device).float().requires_grad_() for t in _inputs(0, 1, 4, 1, 2, 16, 16, len(cu) - 1)[:5]]
    o, ht = chunk_gated_delta_rule(*xs, output_final_state=True,
                                   cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=P.device), impl=impl)
    assert o.requires_grad and ht.requires_grad
    assert not o.any() and not ht.any()
    grads = torch.autograd.grad((o.sum(), ht.sum()), xs)
    assert all(gr is not None and not gr.any() for gr in grads)


def test_state_pass_programs_past_a_launch_are_refused():
    """Sequences x value heads x V blocks past one launch's 2^31 - 1 programs (65537 sequences, most of them empty,
    of 32768 value heads): a ValueError naming them before any launch, not a failed launch."""
    HV, N = 32768, 65537
    q = torch.zeros(1, 1, 1, 16, device=P.device)
    v = torch.zeros(1, 1, HV, 16, device=P.device)
    g = torch.zeros(1, 1, HV, device=P.device)
    cu = torch.tensor([0] * N + [1], dtype=torch.int32)
    with pytest.raises(ValueError, match="65537 sequences x 32768 value heads .* more than one launch takes"):
        chunk_gated_delta_rule(q, q, v, g, g, cu_seqlens=cu.to(P.device), cu_seqlens_cpu=cu)
