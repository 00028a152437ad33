"""The fused kernels of a GatedDeltaNet decode step (layers/gdn_step.py): ``gdn_decode_prep`` (conv + SiLU, gates,
pool rows, conv rows and lengths in place) and ``gdn_gated_norm`` (gated RMSNorm from a strided z).

Results are judged against the float64 torch references with the harness's data-derived tolerance (the same
reference at the kernel's precision sets the bound); in-place updates are copies of input values, so they must equal
the low-precision reference's bit for bit. Slot entries outside ``[0, num_slots)`` touch no row (under the
interpreter every address is checked).
"""

import contextlib

import pytest
import torch
from harness import P, assert_close, dtypes, examples, gen, mapped_zeros, pick, randn, record_launches, seeds
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gqla_triton.layers.gdn_step import gdn_decode_prep, gdn_decode_prep_ref, gdn_gated_norm, gdn_gated_norm_ref

pytestmark = pytest.mark.usefixtures("poison_buffers")

I32 = dict(dtype=torch.int32, device=P.device)
HOSTILE = [-1, -(2**31), 2**31 - 1]  # plus num_slots and the pool rows past it, drawn per example


def _prep_problem(g, B, T, H, HV, K, V, W, P_rows, dtype, gate_scale):
    """Inputs of one prep call: ``mixed`` a strided view (columns inside a wider buffer), the pool and the lengths
    views with a guard row on each side (``buf``, ``lens_buf``)."""
    KD, VD = H * K, HV * V
    C = 2 * KD + VD
    D = C + VD + 2 * HV
    wide = randn((B, T, D + 3), g, dtype=torch.float64)
    wide[..., 1 + C + VD:1 + D] *= gate_scale  # b, a: through softplus's threshold and sigmoid's tails
    mixed = wide.to(dtype)[..., 1:1 + D]
    conv_w = randn((C, 1, W), g, dtype=dtype, scale=0.5)
    buf = randn((P_rows + 2, C, W - 1), g, dtype=dtype)
    lens_buf = torch.randint(0, 50, (P_rows + 2,), generator=g).to(**I32)
    A_log = randn((HV,), g, dtype=dtype, scale=0.5)
    dt_bias = randn((HV,), g, dtype=dtype)
    return mixed, conv_w, buf, lens_buf, A_log, dt_bias


def _run(fn, mixed, conv_w, buf, lens_buf, slots, A_log, dt_bias, dims, num_slots, update, dtype=None):
    """``fn`` over copies of the pool and lengths buffers (cast to ``dtype``): ``(outputs, buf, lens_buf)``."""
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    b, lb = cast(buf).clone(), lens_buf.clone()
    n = b.shape[0] - 2
    out = fn(cast(mixed), cast(conv_w), b[1:n + 1], lb[1:n + 1], slots, cast(A_log), cast(dt_bias), **dims,
             num_slots=num_slots, update=update)
    return out, b, lb


@settings(max_examples=examples(8, 24))
@given(B=st.integers(1, 4), T=st.integers(1, pick(4, 17)), H=st.sampled_from([1, 2]), G=st.sampled_from([1, 2]),
       K=st.sampled_from([8, 12, 16]), V=st.sampled_from([8, 16, 24]), W=st.integers(2, 5), update=st.booleans(),
       gate_scale=st.sampled_from([1.0, 30.0]), dtype=dtypes(), seed=seeds(),
       picks=st.lists(st.one_of(st.just(0), st.integers(1, 5)), min_size=4, max_size=4))
@example(B=4, T=3, H=2, G=2, K=12, V=16, W=3, update=True, gate_scale=30.0, dtype=P.dtypes[-1], seed=5,
         picks=[0, 0, 0, 0])  # every slot in the pool, T >= W - 1: the window is the last tokens alone
@example(B=3, T=1, H=1, G=2, K=8, V=8, W=4, update=True, gate_scale=1.0, dtype=P.dtypes[0], seed=6,
         picks=[0, 4, 0, 0])  # num_slots between two in-pool slots, T < W - 1: the window keeps old columns
def test_decode_prep_matches_reference(B, T, H, G, K, V, W, update, gate_scale, dtype, seed, picks):
    """q, k, v, g, beta against the float64 reference; pool rows, conv windows and lengths equal the low-precision
    reference's exactly, and with ``update`` a live slot's window is its last W - 1 inputs and its length grew by
    T; slots outside [0, num_slots) (negative, num_slots, rows of the pool past it, int32's extremes) get row -1, a
    zero window, and leave every row as it was. ``picks[i]``: sequence i's slot, 0 its own, else an outside one."""
    g = gen(seed)
    HV = H * G
    P_rows = B + 3
    num_slots = P_rows - 1  # the pool's last row is no slot
    live = torch.randperm(num_slots, generator=g)[:B].tolist()
    slots = [([s] + HOSTILE + [num_slots, P_rows])[c] for s, c in zip(live, picks, strict=False)]
    slots_t = torch.tensor(slots, **I32)
    ins = _prep_problem(g, B, T, H, HV, K, V, W, P_rows, dtype, gate_scale)
    dims = dict(num_heads=H, head_k_dim=K, num_v_heads=HV, head_v_dim=V)
    with torch.no_grad():
        out, buf, lens = _run(gdn_decode_prep, *ins[:4], slots_t, *ins[4:], dims, num_slots, update)
        out64, _, _ = _run(gdn_decode_prep_ref, *ins[:4], slots_t, *ins[4:], dims, num_slots, update,
                           dtype=torch.float64)
        lowp, buf_lp, lens_lp = _run(gdn_decode_prep_ref, *ins[:4], slots_t, *ins[4:], dims, num_slots, update)
    for name, o, o64, olp in zip(("q", "k", "v", "g", "beta"), out, out64, lowp, strict=False):
        assert o.shape == olp.shape and o.dtype == olp.dtype and o.is_contiguous(), name
        assert_close(name, o, o64, olp, dtype=dtype if name in ("q", "k", "v") else torch.float32)
    want_rows = [s if 0 <= s < num_slots else -1 for s in slots]
    assert out[5].tolist() == want_rows
    assert torch.equal(buf, buf_lp), "conv windows differ from the reference's"
    assert torch.equal(lens, lens_lp), "lengths differ from the reference's"
    named = [s + 1 for s in slots if 0 <= s < num_slots] if update else []
    C = 2 * H * K + HV * V
    for i, s in enumerate(slots):
        if update and 0 <= s < num_slots:
            window = torch.cat([ins[2][s + 1], ins[0][i, :, :C].t()], 1)[:, -(W - 1):]
            assert torch.equal(buf[s + 1], window), f"slot {s}: the window is not the last W - 1 inputs"
            assert lens[s + 1] == ins[3][s + 1] + T, f"slot {s}: the length did not grow by T"
    others = [i for i in range(P_rows + 2) if i not in named]
    assert torch.equal(buf[others], ins[2][others]), "a row of no live sequence was touched"
    assert torch.equal(lens[others], ins[3][others]), "a length of no live sequence was touched"


def test_decode_prep_hostile_slots_stay_in_bounds():
    """Slot values the host never checks (negative, num_slots, past the pool, int32's extremes) read and write no
    row and, under the interpreter, no address outside the tensors passed or created; the live sequences'
    results are those of the same call without the hostile entries."""
    g = gen(3)
    H, HV, K, V, W, T = 1, 2, 8, 8, 4, 3
    P_rows, num_slots = 4, 3
    slots = [num_slots, -1, 2**31 - 1, -(2**31), 1, P_rows + 5, 0, P_rows - 1]
    B = len(slots)
    mixed, conv_w, buf, lens_buf, A_log, dt_bias = _prep_problem(g, B, T, H, HV, K, V, W, P_rows, P.dtypes[0], 1.0)
    dims = dict(num_heads=H, head_k_dim=K, num_v_heads=HV, head_v_dim=V)
    b, lb = buf.clone(), lens_buf.clone()
    pool, lens = b[1:P_rows + 1], lb[1:P_rows + 1]
    slots_t = torch.tensor(slots, **I32)
    check = contextlib.nullcontext()
    if not P.big:
        from addresscheck import AddressCheck

        check = AddressCheck(mixed, conv_w, pool, lens, slots_t, A_log, dt_bias)
    with torch.no_grad(), check:
        out = gdn_decode_prep(mixed, conv_w, pool, lens, slots_t, A_log, dt_bias, **dims, num_slots=num_slots)
    if not P.big:
        check.assert_clean()
    assert out[5].tolist() == [-1, -1, -1, -1, 1, -1, 0, -1]
    untouched = [0, 3, 4, 5]  # guard rows, pool row 2 (no live slot names it), pool row 3 (not a slot)
    assert torch.equal(b[untouched], buf[untouched]) and torch.equal(lb[untouched], lens_buf[untouched])
    b2, lb2 = buf.clone(), lens_buf.clone()
    keep = [4, 6]
    with torch.no_grad():
        ref = gdn_decode_prep(mixed[keep], conv_w, b2[1:P_rows + 1], lb2[1:P_rows + 1], slots_t[keep], A_log,
                              dt_bias, **dims, num_slots=num_slots)
    for o, r in zip(out[:5], ref[:5], strict=True):
        assert torch.equal(o[keep], r)
    assert torch.equal(b, b2) and torch.equal(lb, lb2)
    zero = gdn_decode_prep_ref(mixed[:4], conv_w, buf[1:P_rows + 1].clone(), lens_buf[1:P_rows + 1].clone(),
                               torch.full((4,), -1, **I32), A_log, dt_bias, **dims, num_slots=num_slots)
    for o, r in zip(out[:3], zero[:3], strict=True):  # a skipped sequence's conv starts from a zero window
        torch.testing.assert_close(o[:4], r, rtol=2e-3, atol=2e-3)
    # an empty pool: every sequence skipped, in the kernel and the reference alike
    empty = (buf[:0].clone(), lens_buf[:0].clone())
    got = gdn_decode_prep(mixed[:2], conv_w, *empty, slots_t[:2], A_log, dt_bias, **dims)
    want = gdn_decode_prep_ref(mixed[:2], conv_w, *empty, slots_t[:2], A_log, dt_bias, **dims)
    assert got[5].tolist() == want[5].tolist() == [-1, -1]
    for o, r in zip(got[:5], want[:5], strict=True):
        torch.testing.assert_close(o, r, rtol=2e-3, atol=2e-3)


@pytest.mark.skipif(P.device != "cpu", reason="a view of a sparse file mapped under the interpreter")
def test_decode_prep_strides_past_int32(tmp_path):
    """``mixed`` with a token stride that puts a conv tap's token more than 2**31 elements back, and a channel stride
    that puts the gate input a more than 2**31 elements past b (views of a mapped sparse file: no memory): the
    results and in-place updates equal those of a compact copy (no int32 offset wraps)."""
    g = gen(5)
    B, T, H, HV, K, V, W = 2, 4, 1, 2, 2, 2, 4
    C = 2 * H * K + HV * V
    D = C + HV * V + 2 * HV
    s_xt, s_xc = 2**31 // (W - 1) + 1, 2**30 + 1  # (W - 1)·s_xt and HV·s_xc pass 2**31 - 1
    strides = (2**20, s_xt, s_xc)  # no two elements share an address
    span = sum((n - 1) * st for n, st in zip((B, T, D), strides, strict=True)) + 1
    mixed = mapped_zeros(span + 2**31, torch.float16, tmp_path).as_strided((B, T, D), strides)
    compact = randn((B, T, D), g, dtype=torch.float16)
    mixed.copy_(compact)
    _, conv_w, buf, lens_buf, A_log, dt_bias = _prep_problem(g, B, T, H, HV, K, V, W, 3, torch.float16, 1.0)
    dims = dict(num_heads=H, head_k_dim=K, num_v_heads=HV, head_v_dim=V)
    slots = torch.tensor([2, 0], **I32)
    with torch.no_grad():
        got, b, lb = _run(gdn_decode_prep, mixed, conv_w, buf, lens_buf, slots, A_log, dt_bias, dims, 3, True)
        want, b2, lb2 = _run(gdn_decode_prep, compact, conv_w, buf, lens_buf, slots, A_log, dt_bias, dims, 3, True)
    for name, o, r in zip(("q", "k", "v", "g", "beta", "rows"), got, want, strict=True):
        assert torch.equal(o, r), name
    assert torch.equal(b, b2) and torch.equal(lb, lb2)


def test_decode_prep_bad_inputs_change_nothing():
    """Every rejected call raises a TypeError / ValueError naming the argument and leaves the pool and the lengths
    as they were."""
    g = gen(4)
    H, HV, K, V, W = 1, 2, 8, 8, 4
    mixed, conv_w, buf, lens_buf, A_log, dt_bias = _prep_problem(g, 2, 1, H, HV, K, V, W, 3, P.dtypes[0], 1.0)
    pool, lens = buf[1:4], lens_buf[1:4]
    before = pool.clone(), lens.clone()
    slots = torch.tensor([0, 2], **I32)
    dims = dict(num_heads=H, head_k_dim=K, num_v_heads=HV, head_v_dim=V)
    base = dict(mixed=mixed, conv_weight=conv_w, conv_state=pool, seqlens=lens, slots=slots, A_log=A_log,
                dt_bias=dt_bias)
    cases = [
        (ValueError, r"^mixed: expected \[B, T, 52\] .*got \[2, 1, 51\]", dict(mixed=mixed[..., :-1])),
        (ValueError, r"^mixed: expected 3 dimensions, got shape \(1, 52\)", dict(mixed=mixed[0])),
        (TypeError, r"^mixed: expected dtype in \(.*\), got int32", dict(mixed=mixed.to(torch.int32))),
        (ValueError, r"^conv_weight: expected \[32, 1, W\] with W >= 2, got \[31, 1, 4\]",
         dict(conv_weight=conv_w[:-1])),
        (ValueError, r"^conv_state: expected shape \[\*, 32, 3\], got \[3, 32, 2\]", dict(conv_state=pool[:, :, :-1])),
        (TypeError, r"^conv_state: expected dtype in \(\w+\), got float64", dict(conv_state=pool.double())),
        (ValueError, "^conv_state: expected a contiguous tensor",
         dict(conv_state=pool.transpose(1, 2).contiguous().transpose(1, 2))),
        (ValueError, r"^seqlens: expected shape \[3\], got \[2\]", dict(seqlens=lens[:2])),
        (TypeError, r"^seqlens: expected dtype in \(int32\), got int64", dict(seqlens=lens.long())),
        (TypeError, r"^slots: expected dtype in \(int32\), got int64", dict(slots=slots.long())),
        (ValueError, r"^slots: expected shape \[2\], got \[1\]", dict(slots=slots[:1])),
        (ValueError, r"^A_log: expected shape \[2\], got \[1\]", dict(A_log=A_log[:1])),
        (TypeError, "^slots: expected a torch.Tensor, got list", dict(slots=[0, 2])),
    ]
    for exc, match, kw in cases:
        with pytest.raises(exc, match=match):
            gdn_decode_prep(**{**base, **kw}, **dims)
        assert torch.equal(pool, before[0]) and torch.equal(lens, before[1]), match
    for exc, match, kw in ((ValueError, r"^num_slots: expected an int in \[0, 3\], got int 4", dict(num_slots=4)),
                           (ValueError, r"^num_slots: expected an int in \[0, 3\], got int -1", dict(num_slots=-1)),
                           (TypeError, "^update: expected a bool, got int", dict(update=1)),
                           (ValueError, "^head_k_dim: expected a positive int .*got int 0", dict(head_k_dim=0))):
        with pytest.raises(exc, match=match):
            gdn_decode_prep(**base, **{**dims, **kw})
        assert torch.equal(pool, before[0]) and torch.equal(lens, before[1]), match
    # it updates the pool in place, so it has no autograd formula: inputs that require grad are refused
    with pytest.raises(RuntimeError, match="gdn_decode_prep is forward-only .*mixed requires grad"):
        gdn_decode_prep(**{**base, "mixed": mixed.detach().requires_grad_()}, **dims)
    assert torch.equal(pool, before[0]) and torch.equal(lens, before[1])


@settings(max_examples=examples(8, 24))
@given(B=st.integers(1, 4), T=st.integers(1, pick(3, 9)), HV=st.integers(1, 6), V=st.sampled_from([8, 16, 24, 128]),
       with_rows=st.booleans(), dtype=dtypes(), seed=seeds(), data=st.data())
def test_gated_norm_matches_reference(B, T, HV, V, with_rows, dtype, seed, data):
    """``RMSNorm(o)·w·silu(z)`` per head from a strided z (a column block of a wider buffer) and a transposed o
    against float64; sequences with a negative row output exactly 0 whatever their o and z hold (NaN here)."""
    g = gen(seed)
    wide = randn((B, T, HV * V + 5), g, dtype=dtype)
    z = wide[..., 3:3 + HV * V].reshape(B, T, HV, V)
    o = randn((B, HV, T, V), g, dtype=dtype).transpose(1, 2)  # [B, T, HV, V], not contiguous
    w = randn((V,), g, dtype=dtype, scale=0.5) + 1
    rows = None
    if with_rows:
        rows = torch.tensor([data.draw(st.sampled_from([b, -1, -(2**31)]), label=f"row {b}") for b in range(B)],
                            **I32)
        dead = (rows < 0).tolist()
        for b in range(B):
            if dead[b]:
                wide[b] = float("nan")
                o[b] = float("nan")
    with torch.no_grad():
        out = gdn_gated_norm(o, z, w, 1e-6, rows)
        out64 = gdn_gated_norm_ref(o.double(), z.double(), w.double(), 1e-6, rows)
        lowp = gdn_gated_norm_ref(o, z, w, 1e-6, rows)
    assert out.shape == (B, T, HV * V) and out.dtype == dtype and out.is_contiguous()
    assert_close("gated norm", out, out64, lowp, dtype=dtype)
    if rows is not None:
        dead = rows < 0
        assert torch.equal(out[dead], torch.zeros_like(out[dead]))


def test_gated_norm_bad_inputs():
    d = P.device
    o = torch.randn(2, 1, 2, 8, device=d)
    w = torch.ones(8, device=d)
    cases = [
        (ValueError, r"^z: expected shape \[2, 1, 2, 8\], got \[2, 1, 2, 4\]", dict(z=o[..., :4])),
        (TypeError, r"^z: expected dtype in \(.*\), got int32", dict(z=o.to(torch.int32))),
        (ValueError, r"^weight: expected shape \[8\], got \[4\]", dict(weight=w[:4])),
        (TypeError, r"^rows: expected dtype in \(int32\), got int64",
         dict(rows=torch.zeros(2, dtype=torch.int64, device=d))),
        (ValueError, r"^rows: expected shape \[2\], got \[3\]", dict(rows=torch.zeros(3, dtype=torch.int32, device=d))),
        (ValueError, r"^o: expected 4 dimensions, got shape \(1, 2, 8\)", dict(o=o[0])),
        (ValueError, "^eps: expected a finite real number >= 0, got float -1.0", dict(eps=-1.0)),
    ]
    for exc, match, kw in cases:
        args = {"o": o, "z": o, "weight": w, "eps": 1e-6, "rows": None, **kw}
        with pytest.raises(exc, match=match):
            gdn_gated_norm(args["o"], args["z"], args["weight"], args["eps"], args["rows"])


def test_gated_norm_keeps_the_forward_only_guard():
    """Inputs that require grad: the output keeps a node whose backward raises (the graph is not cut silently)."""
    g = gen(9)
    o = randn((2, 1, 2, 8), g).requires_grad_()
    y = gdn_gated_norm(o, randn((2, 1, 2, 8), g), torch.ones(8, device=P.device), 1e-6)
    with pytest.raises(RuntimeError, match="gdn_gated_norm is forward-only"):
        y.sum().backward()


def test_decode_prep_refuses_state_sharing_memory_with_its_inputs():
    """conv_state and seqlens, written in place, may share no memory with what the call reads (mixed, slots,
    conv_weight, A_log, dt_bias) or with each other: a ValueError naming both, nothing written."""
    g = gen(5)
    H, HV, K, V, W, B, T, P_rows = 1, 1, 16, 16, 4, 2, 2, 2
    C, D = 2 * H * K + HV * V, 2 * H * K + 2 * HV * V + 2 * HV
    dims = dict(num_heads=H, head_k_dim=K, num_v_heads=HV, head_v_dim=V)
    dt = P.dtypes[0]
    buf = randn((P_rows * C * (W - 1) + B * T * D,), g, dtype=dt)
    lens_buf = torch.tensor([1, 0, 7], **I32)
    fresh = dict(mixed=randn((B, T, D), g, dtype=dt), conv_weight=randn((C, 1, W), g, dtype=dt),
                 conv_state=buf[:P_rows * C * (W - 1)].view(P_rows, C, W - 1), seqlens=lens_buf[1:],
                 slots=torch.tensor([1, 0], **I32), A_log=randn((HV,), g, dtype=dt),
                 dt_bias=randn((HV,), g, dtype=dt))
    pool = fresh["conv_state"]
    cases = [
        ("conv_state: shares memory with mixed", dict(mixed=buf[:B * T * D].view(B, T, D))),
        ("seqlens: shares memory with slots", dict(slots=lens_buf[1:])),  # the slots' values are [0, 7]: live
        ("seqlens: shares memory with slots", dict(slots=lens_buf[:2])),  # partly
        ("conv_state: shares memory with A_log", dict(A_log=pool[1, 0, :HV])),
        ("conv_state: shares memory with dt_bias", dict(dt_bias=pool[0, 3, :HV])),
        ("conv_state: shares memory with conv_weight", dict(conv_weight=buf[:C * W].view(C, 1, W))),
        ("conv_state: shares memory with seqlens", dict(seqlens=pool.flatten().view(torch.int32)[:P_rows])),
    ]
    for match, kw in cases:
        args = {**fresh, **kw}
        before = buf.clone(), lens_buf.clone()
        with torch.no_grad(), pytest.raises(ValueError, match=match):
            gdn_decode_prep(**args, **dims)
        assert torch.equal(buf, before[0]) and torch.equal(lens_buf, before[1]), match


def test_decode_prep_launches_any_batch_of_the_decode_op(monkeypatch):
    """Past 65535 sequences (CUDA's limit on a grid's second and third axes): the sequences lie along grid axis 0
    (2**31 - 1), the channel blocks along axis 1. The launch is recorded, not run (65536 sequences take minutes
    under the interpreter); ``test_decode_step_past_65535_sequences`` runs it on a GPU."""
    from gqla_triton.layers import gdn_step
    from gqla_triton.ops._common.host import MAX_GRID_Y

    launches = record_launches(monkeypatch, gdn_step, "gdn_decode_prep_kernel")
    H, HV, K, V, W, B = 1, 1, 8, 8, 2, MAX_GRID_Y + 1
    C, D = 2 * H * K + HV * V, 2 * H * K + 2 * HV * V + 2 * HV
    mixed = torch.zeros(B, 1, D, device=P.device)
    slots = torch.full((B,), -1, **I32)
    with torch.no_grad():
        out = gdn_decode_prep(mixed, torch.zeros(C, 1, W, device=P.device), torch.zeros(1, C, W - 1, device=P.device),
                              torch.zeros(1, **I32), slots, torch.zeros(HV, device=P.device),
                              torch.zeros(HV, device=P.device), num_heads=H, head_k_dim=K, num_v_heads=HV,
                              head_v_dim=V)
    assert out[0].shape == (B, 1, H, K) and out[5].shape == (B,)
    assert len(launches) == 1 and launches[0][0] == B and all(n <= MAX_GRID_Y for n in launches[0][1:])
    for b in (1, B, 2**31 - 1):
        for c in (3, 4096, 512 * (MAX_GRID_Y - 1)):
            grid, BC = gdn_step._prep_grid(b, c)
            assert grid == (b, -(-c // BC) + 1) and grid[1] <= MAX_GRID_Y
